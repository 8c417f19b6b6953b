"""A mixture-of-experts layer's routed experts: eager transformers vs memkernels.apply(), saved bytes and peak.

Run: python benchmarks/bench_moe.py              (CPU and meta: about half a minute on 2 cores)
On a machine with a GPU it also times forward+backward (ms) of the Qwen3-30B-A3B-shaped experts.

What runs: one transformers ``Qwen3MoeExperts`` module (stacked ``gate_up_proj`` [E, 2*I, H] and
``down_proj`` [E, H, I]) called as its sparse MoE block calls it: hidden states [T, H], each token routed to
its top-k experts by a random router's softmax; the loss is sum(out * dy) for a fixed random dy, then
backward. Methods, each on a fresh copy with the same weights and routing:
- eager: transformers' own experts forward (``experts_implementation="grouped_mm"``, its default: one grouped
  GEMM each way around act(gate) * up);
- memkernels: the same module after ``memkernels.apply`` (down projection through grouped_gated_linear);
- Liger-Kernel: printed as not measured (Liger 0.8 has no fused MoE experts op to put here).

Columns (measured by memkernels.meters, never from formulas):
- saved: bytes saved for backward that saved-tensor hooks see (SavedBytesMeter.new_bytes), per token and per
  routed token;
- extra peak: peak live bytes over forward + backward beyond the inputs, weights and gradients.
The Qwen3-30B-A3B row (H 2048, I 768, 128 experts, top-8, 2048 tokens, bf16) runs on the meta device (every
allocation made and counted, no arithmetic); a small row runs on the CPU in float32.
"""
import argparse
import copy

import torch

import memkernels
from memkernels.meters import PeakBytesMeter, SavedBytesMeter

# (label, hidden, intermediate, experts, top-k, tokens, dtype, device)
CONFIGS = [("small (CPU)", 256, 128, 16, 4, 512, torch.float32, "cpu"),
           ("Qwen3-30B-A3B layer (meta)", 2048, 768, 128, 8, 2048, torch.bfloat16, "meta")]


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


def measure(module, x, index, weights, dy):
    """(saved bytes, extra peak bytes) of one forward + backward."""
    x = x.detach().requires_grad_()
    for parameter in module.parameters():
        parameter.grad = torch.zeros_like(parameter)
    with PeakBytesMeter() as peak:
        with SavedBytesMeter() as saved:
            out = module(x, index, weights)
        out.backward(dy)
        del out
    return saved.new_bytes, peak.peak_bytes - x.nbytes  # x.grad is the gradient the step returns


def memory_section():
    print(f"{'config':<30} {'method':<12} {'saved / token':>14} {'/ routed token':>15} {'saved MiB':>10} "
          f"{'extra peak MiB':>15}")
    for label, hidden, intermediate, experts, top_k, tokens, dtype, device in CONFIGS:
        module, x, index, weights, dy = build(hidden, intermediate, experts, top_k, tokens, dtype, device)
        rows = {}
        for method in ("eager", "memkernels"):
            copy_ = copy.deepcopy(module)
            if method == "memkernels":
                memkernels.apply(copy_, measure=False)
            rows[method] = measure(copy_, x, index, weights, dy)
            saved, extra = rows[method]
            print(f"{label:<30} {method:<12} {saved / tokens:>12,.0f} B {saved / (tokens * top_k):>13,.0f} B "
                  f"{saved / 2 ** 20:>10,.1f} {extra / 2 ** 20:>15,.1f}")
        print(f"{label:<30} {'Liger':<12} {'not measured: Liger-Kernel has no fused MoE experts op':>56}")
        eager, fused = rows["eager"][0], rows["memkernels"][0]
        print(f"{label:<30} memkernels keeps {fused / eager:.0%} of eager's saved bytes "
              f"({(eager - fused) / (tokens * top_k * intermediate * x.element_size()):.2f} x I elements a routed "
              "token fewer)")


def timing_section(repeats=10):
    print("\nforward + backward on the GPU (ms, median of", repeats, "after 3 warm-ups):")
    label, *shape = CONFIGS[1]
    module, x, index, weights, dy = build(*shape[:-1], "cuda")
    for method in ("eager", "memkernels"):
        copy_ = copy.deepcopy(module)
        if method == "memkernels":
            memkernels.apply(copy_, measure=False)
        inputs = x.detach().requires_grad_()
        times = []
        for attempt in range(repeats + 3):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            copy_(inputs, index, weights).backward(dy)
            end.record()
            torch.cuda.synchronize()
            if attempt >= 3:
                times.append(begin.elapsed_time(end))
        times.sort()
        print(f"  {label} {method:<12} {times[len(times) // 2]:8.3f} ms")


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    memory_section()
    if torch.cuda.is_available():
        timing_section()


if __name__ == "__main__":
    main()
