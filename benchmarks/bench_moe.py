"""A mixture-of-experts layer's routed experts: eager transformers vs memkernels.apply() (and Liger-Kernel's fused
MoE where installed), saved bytes and peak.

Run: python benchmarks/bench_moe.py              (CPU and meta: a few seconds on 2 cores)
On a machine with a GPU it also measures the Qwen3-30B-A3B-shaped experts on it and times forward+backward (ms).

What runs: one transformers ``Qwen3MoeExperts`` module (stacked ``gate_up_proj`` [E, 2*I, H] and
``down_proj`` [E, H, I]) called as its sparse MoE block calls it: hidden states [T, H], each token routed to
its top-k experts by a random router's softmax; the loss is sum(out * dy) for a fixed random dy, then
backward, to the hidden states and the routing weights (a trained router's gradient). Methods, each on a fresh copy with the same weights and routing:
- eager: transformers' own experts forward (``experts_implementation="grouped_mm"``, its default: one grouped
  GEMM each way around act(gate) * up);
- memkernels: the same module after ``memkernels.apply`` (gate_up projection through grouped_gather_mm, the rows
  gathered inside the op and not saved; down projection through grouped_gated_linear, the routing weights
  multiplied in: gate_up saved per routed token, nothing H-wide for the weights' gradient);
- memkernels recompute: after ``memkernels.apply(mlp="recompute")`` (grouped_gated_mlp_recompute: no gate_up
  saved either, gate_up recomputed in backward);
- Liger: Liger-Kernel's ``LigerFusedMoEFunction`` (``liger_kernel.ops.fused_moe``, in releases from April 2026 on)
  on the same weights, where that is installed; Triton kernels, so on the GPU only. Otherwise a line says why it
  is not measured (not installed, or an installed version without the op).

Columns (measured by memkernels.meters, never from formulas):
- saved: bytes saved for backward that saved-tensor hooks see (SavedBytesMeter.new_bytes), per token and per
  routed token;
- extra peak: peak live bytes over forward + backward beyond the inputs, weights and gradients.
The Qwen3-30B-A3B row (H 2048, I 768, 128 experts, top-8, 2048 tokens, bf16) runs on the meta device (every
allocation made and counted, no arithmetic), and on the GPU when there is one; the same layer at 32,768 tokens on
meta (long context: the experts' steps run by runs of whole experts); a small row runs on the CPU in float32. The GPU section adds the median time of forward + backward, its ratio to eager's (flagged above 1.00x)
and the CUDA allocator's peak over one forward + backward (torch.cuda.max_memory_allocated, beyond what was
allocated before it).
"""
import argparse
import copy
import importlib.metadata
import importlib.util

import torch

import memkernels
from memkernels.meters import PeakBytesMeter, SavedBytesMeter

# (label, hidden, intermediate, experts, top-k, tokens, dtype, device)
CONFIGS = [("small (CPU)", 256, 128, 16, 4, 512, torch.float32, "cpu"),
           ("Qwen3-30B-A3B layer (meta)", 2048, 768, 128, 8, 2048, torch.bfloat16, "meta"),
           # long context: every step past 8,192 routed rows runs by runs of whole experts
           ("Qwen3-30B-A3B, 32k (meta)", 2048, 768, 128, 8, 32768, torch.bfloat16, "meta")]
GPU_CONFIG = ("Qwen3-30B-A3B layer (cuda)", *CONFIGS[1][1:-1], "cuda")


def build(hidden, intermediate, experts, top_k, tokens, dtype, device):
    """(experts module, hidden states, top-k indices, top-k weights, dy) on ``device``."""
    import transformers

    config = transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=experts,
                                         num_experts_per_tok=top_k, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=128)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    with torch.device(device):
        module = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config).to(dtype)
    if device != "meta":
        with torch.no_grad():
            module.gate_up_proj.normal_(0, hidden ** -0.5)
            module.down_proj.normal_(0, intermediate ** -0.5)
    generator = torch.Generator().manual_seed(1)
    scores = torch.randn(tokens, experts, generator=generator).softmax(-1)
    weights, index = scores.topk(top_k, dim=-1)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    dy = torch.randn(tokens, hidden, generator=generator).to(dtype)
    return module, x.to(device), index.to(device), weights.to(dtype).to(device), dy.to(device)


def liger_fused_moe():
    """(Liger-Kernel's fused MoE autograd Function, None), or (None, why it is not measured)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return None, "Liger-Kernel is not installed"
    if importlib.util.find_spec("liger_kernel.ops.fused_moe") is None:
        return None, f"liger-kernel {importlib.metadata.version('liger-kernel')} has no fused MoE op"
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    return LigerFusedMoEFunction, None


class LigerExperts(torch.nn.Module):
    """``module``'s expert weights through Liger's fused MoE, called as transformers calls the experts (Liger's
    own LigerExperts forward: the top-k indices as int32)."""

    def __init__(self, module, function):
        super().__init__()
        self.gate_up_proj, self.down_proj, self.function = module.gate_up_proj, module.down_proj, function

    def forward(self, x, index, weights):
        return self.function.apply(x, self.gate_up_proj, self.down_proj, index.int(), weights)


def methods(module, device):
    """{method: a fresh copy of ``module`` computed that way, or a string saying why that method is not measured}."""
    result = {}
    for method, mlp in (("eager", None), ("memkernels", True), ("memkernels recompute", "recompute")):
        result[method] = copy.deepcopy(module)
        if mlp is not None:
            memkernels.apply(result[method], mlp=mlp, measure=False)
    function, why = liger_fused_moe()
    if function is not None and device != "cuda":
        why = f"not measured on {device}: Liger's fused MoE is Triton kernels (the GPU rows measure it)"
    result["Liger"] = LigerExperts(copy.deepcopy(module), function) if why is None else f"not measured: {why}"
    return result


def measure(module, x, index, weights, dy):
    """(saved bytes, extra peak bytes) of one forward + backward."""
    x, weights = x.detach().requires_grad_(), weights.detach().requires_grad_()
    for parameter in module.parameters():
        parameter.grad = torch.zeros_like(parameter)
    with PeakBytesMeter() as peak:
        with SavedBytesMeter() as saved:
            out = module(x, index, weights)
        out.backward(dy)
        del out
    return saved.new_bytes, peak.peak_bytes - x.nbytes - weights.nbytes  # the gradients the step returns


def memory_section(configs):
    print(f"{'config':<30} {'method':<21} {'saved / token':>14} {'/ routed token':>15} {'saved MiB':>10} "
          f"{'extra peak MiB':>15}")
    for label, hidden, intermediate, experts, top_k, tokens, dtype, device in configs:
        module, x, index, weights, dy = build(hidden, intermediate, experts, top_k, tokens, dtype, device)
        saved_bytes = {}
        for method, computed in methods(module, device).items():
            if isinstance(computed, str):
                print(f"{label:<30} {method:<21} {computed}")
                continue
            saved, extra = measure(computed, x, index, weights, dy)
            saved_bytes[method] = saved
            print(f"{label:<30} {method:<21} {saved / tokens:>12,.0f} B {saved / (tokens * top_k):>13,.0f} B "
                  f"{saved / 2 ** 20:>10,.1f} {extra / 2 ** 20:>15,.1f}")
        eager = saved_bytes["eager"]
        routed_elements = tokens * top_k * x.element_size()
        for method in ("memkernels", "memkernels recompute"):
            fewer = (eager - saved_bytes[method]) / routed_elements
            print(f"{label:<30} {method} keeps {saved_bytes[method] / eager:.1%} of eager's saved bytes "
                  f"({fewer / intermediate:.2f} x I elements a routed token fewer)")


def timing_section(repeats=10):
    print("\nforward + backward on the GPU (ms, median of", repeats, "after 3 warm-ups; CUDA peak beyond the inputs, "
          "weights and gradients):")
    label, *shape = GPU_CONFIG
    module, x, index, weights, dy = build(*shape)
    medians = {}
    for method, computed in methods(module, "cuda").items():
        if isinstance(computed, str):
            print(f"  {label} {method:<21} {computed}")
            continue
        inputs, routing = x.detach().requires_grad_(), weights.detach().requires_grad_()
        for parameter in computed.parameters():
            parameter.grad = torch.zeros_like(parameter)
        times = []
        for attempt in range(repeats + 3):
            if attempt == repeats + 2:  # the last run, warm, measures the peak
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            computed(inputs, index, routing).backward(dy)
            end.record()
            torch.cuda.synchronize()
            if attempt >= 3:
                times.append(begin.elapsed_time(end))
        peak = torch.cuda.max_memory_allocated() - before
        times.sort()
        medians[method] = times[len(times) // 2]
        ratio = medians[method] / medians["eager"]
        flag = "  SLOWER than eager" if ratio > 1.0 and method.startswith("memkernels") else ""
        print(f"  {label} {method:<21} {medians[method]:8.3f} ms  {ratio:5.2f}x eager  "
              f"CUDA peak {peak / 2 ** 20:8.1f} MiB{flag}")


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    memory_section(CONFIGS + [GPU_CONFIG] if torch.cuda.is_available() else CONFIGS)
    if torch.cuda.is_available():
        timing_section()


if __name__ == "__main__":
    main()
