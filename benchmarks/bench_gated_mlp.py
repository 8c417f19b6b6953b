"""Gated MLP (SwiGLU): activation memory of a Llama-3-8B MLP, memkernels vs eager and Liger's layout.

    python -m benchmarks.bench_gated_mlp [--tokens 2048] [--hidden 4096] [--intermediate 14336]
    pytest benchmarks/bench_gated_mlp.py --benchmark-only [--benchmark-json gated_mlp.json]

Memory (any device, one run per implementation and dtype, bf16 and fp32): bytes saved for backward
per token (SavedBytesMeter, new storages only; x and the parameters are the caller's) and the extra
peak of a forward+backward step (PeakBytesMeter, bytes allocated on top of what existed before,
including the parameter gradients), for

- eager: Hugging Face's LlamaMLP, ``down(silu(gate(x)) * up(x))``;
- Liger's layout: a SiLU-mul function that saves gate and up and recomputes silu in backward, and a
  plain down Linear, which saves the product (Liger's LigerSiLUMulFunction; built from torch ops here
  when liger_kernel is not installed or the tensors are not on a GPU, as the table says);
- memkernels: FusedGatedMLP (saves gate and up);
- memkernels recompute: FusedGatedMLP(recompute=True) (saves nothing new).

Targets (exit status 1 if one is missed): memkernels saves <= 50% of eager's bytes and <= 67% of
Liger's; recompute saves 0 new bytes; each memkernels peak <= eager's.

Timing (only with a CUDA device): TFLOP/s of the whole MLP forward+backward against eager, eager under
torch.compile (the same module compiled, in the same run; its compile is outside the timing) and, when
liger_kernel is installed, Liger's layout (LigerSiLUMulFunction between the projections), with
FusedGatedMLP's PyTorch path on the same CUDA tensors beside it (backend "torch": the same cuBLAS
GEMMs, PyTorch's elementwise ops in place of the one Triton pass each way). On a CPU the section says
it skipped (torch.compile's column too: inductor makes C++ loops there, not the GPU's kernels).
On a CPU the default shape takes minutes (nine 2048 x 4096 x 14336 GEMMs per step and dtype).

pytest-benchmark (test_gated_mlp_forward_backward): FusedGatedMLP's forward + backward at a small shape on a
CPU (64 tokens, 64 -> 2 x 224 -> 64, fp32; its PyTorch path) or the default shape in bf16 with CUDA; the saved
bytes per token of eager and memkernels at that shape in extra_info.
"""
import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

import memkernels
from memkernels._backend import resolve
from memkernels.fusions.gated_mlp.module import FusedGatedMLP
from memkernels.meters import PeakBytesMeter, SavedBytesMeter
from memkernels.testing import benchmark_step

TARGET_VS_EAGER = 0.50
TARGET_VS_LIGER = 0.67


class EagerGatedMLP(nn.Module):
    """Hugging Face's LlamaMLP forward, on shared projections."""

    def __init__(self, gate_proj, up_proj, down_proj):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _TorchSiLUMul(torch.autograd.Function):
    """Liger's LigerSiLUMulFunction in torch ops: saves gate and up, returns silu(gate) * up."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        sigmoid = torch.sigmoid(gate.float())
        silu = gate.float() * sigmoid
        grad_gate = grad.float() * up.float() * sigmoid * (1 + gate.float() * (1 - sigmoid))
        return grad_gate.to(gate.dtype), (grad.float() * silu).to(up.dtype)


def _liger_silu_mul(device):
    """(silu_mul function, label): Liger's own when installed and on a GPU, else the torch-op equivalent
    (Liger's kernel does not run under triton 3.9's interpreter: "'float' object has no attribute 'to'")."""
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return _TorchSiLUMul.apply, "Liger layout*"
    if torch.device(device).type != "cuda":
        return _TorchSiLUMul.apply, "Liger layout*"
    return LigerSiLUMulFunction.apply, "Liger (liger_kernel)"


class LigerLayoutMLP(EagerGatedMLP):
    def __init__(self, gate_proj, up_proj, down_proj, silu_mul):
        super().__init__(gate_proj, up_proj, down_proj)
        self.silu_mul = silu_mul

    def forward(self, x):
        return self.down_proj(self.silu_mul(self.gate_proj(x), self.up_proj(x)))


def measure(model, x, grad_out):
    """(saved new bytes, forward+backward extra peak) of one step, after one warm-up step (first-call costs,
    Triton's compiles and cuBLAS's workspace, are not counted)."""
    model(x).backward(grad_out)
    x.grad = None
    for param in model.parameters():
        param.grad = None
    with PeakBytesMeter() as step_peak:
        with SavedBytesMeter() as saved:
            y = model(x)
        y.backward(grad_out)
        del y
    return saved.new_bytes, step_peak.peak_bytes


def memory_table(tokens, hidden, intermediate, device):
    mib = 1 << 20
    silu_mul, liger_label = _liger_silu_mul(device)
    print(f"Llama-style SwiGLU MLP, {tokens} tokens x {hidden} -> 2 x {intermediate} -> {hidden}, device {device}")
    print(f"{'dtype':<10}{'impl':<26}{'saved B/token':>15}{'step peak MiB':>15}{'saved vs eager':>16}"
          f"{'vs Liger':>10}")
    ok = True
    for dtype in (torch.bfloat16, torch.float32):
        linear = dict(bias=False, device=device, dtype=dtype)
        gate, up = nn.Linear(hidden, intermediate, **linear), nn.Linear(hidden, intermediate, **linear)
        down = nn.Linear(intermediate, hidden, **linear)
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
        grad_out = torch.randn(tokens, hidden, device=device, dtype=dtype)
        backend = resolve(x, "gated_linear")
        eager = EagerGatedMLP(gate, up, down)
        models = {"eager": eager, liger_label: LigerLayoutMLP(gate, up, down, silu_mul),
                  f"memkernels/{backend}": FusedGatedMLP.from_module(_with_act(eager)),
                  f"memkernels recompute/{backend}": FusedGatedMLP.from_module(_with_act(eager), recompute=True)}
        results = {name: measure(model, x, grad_out) for name, model in models.items()}
        (eager_saved, eager_peak), (liger_saved, _) = results["eager"], results[liger_label]
        for name, (saved, peak) in results.items():
            print(f"{str(dtype).replace('torch.', ''):<10}{name:<26}{saved / tokens:>15.0f}{peak / mib:>15.1f}"
                  f"{saved / eager_saved:>15.0%}{saved / liger_saved:>10.0%}")
        fused_saved, fused_peak = results[f"memkernels/{backend}"]
        recompute_saved, recompute_peak = results[f"memkernels recompute/{backend}"]
        ok &= (fused_saved <= TARGET_VS_EAGER * eager_saved and fused_saved <= TARGET_VS_LIGER * liger_saved
               and recompute_saved == 0 and fused_peak <= eager_peak and recompute_peak <= eager_peak)
    if liger_label.endswith("*"):
        print("* liger_kernel not installed, or not on a GPU: its layout (SiLU-mul saving gate and up, then a "
              "plain down Linear) built from torch ops")
    print(f"targets: memkernels saves <= {TARGET_VS_EAGER:.0%} of eager's and <= {TARGET_VS_LIGER:.0%} of Liger's "
          f"bytes per token, recompute 0 new bytes, step peaks <= eager's: {'met' if ok else 'NOT met'}")
    return ok


def _with_act(mlp):
    """The eager module with the act_fn attribute FusedGatedMLP.from_module reads (it shares the projections)."""
    mlp.act_fn = nn.SiLU()
    return mlp


def timing_table(tokens, hidden, intermediate):
    import triton.testing

    from memkernels.audit.gpu_audit import prediction_line

    print(f"\nSwiGLU MLP fwd+bwd timing on {torch.cuda.get_device_name()}: {tokens} tokens, "
          f"{hidden} -> 2 x {intermediate} -> {hidden}")
    print(f"{'dtype':<10}{'eager TFLOP/s':>15}{'compile TFLOP/s':>17}{'memkernels TFLOP/s':>20}"
          f"{'recompute TFLOP/s':>19}{'torch path TFLOP/s':>20}{'Liger TFLOP/s':>14}")
    flops = 3 * 2.0 * tokens * hidden * intermediate * 3  # three GEMMs forward, twice that backward
    for dtype in (torch.bfloat16, torch.float16):
        linear = dict(bias=False, device="cuda", dtype=dtype)
        eager = _with_act(EagerGatedMLP(nn.Linear(hidden, intermediate, **linear),
                                        nn.Linear(hidden, intermediate, **linear),
                                        nn.Linear(intermediate, hidden, **linear)))
        x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
        grad_out = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
        silu_mul, liger_label = _liger_silu_mul("cuda")
        compiled = torch.compile(eager)  # eager's module compiled: the baseline a user of torch.compile has
        compiled(x).backward(grad_out)  # compiles here, outside the timing
        models = {"eager": eager, "compile": compiled, "memkernels": FusedGatedMLP.from_module(eager),
                  "recompute": FusedGatedMLP.from_module(eager, recompute=True)}
        if liger_label.startswith("Liger ("):  # only Liger's own kernel: its layout in torch ops times nothing
            models["Liger"] = LigerLayoutMLP(eager.gate_proj, eager.up_proj, eager.down_proj, silu_mul)
        ms = {name: triton.testing.do_bench(lambda: model(x).backward(grad_out),  # noqa: B023
                                            grad_to_none=[x, *model.parameters()])
              for name, model in models.items()}
        # The PyTorch path on the same CUDA tensors (the same GEMMs, PyTorch's elementwise ops).
        memkernels.set_backend("torch")
        try:
            fused = FusedGatedMLP.from_module(eager)
            ms["torch path"] = triton.testing.do_bench(lambda: fused(x).backward(grad_out),
                                                       grad_to_none=[x, *fused.parameters()])
        finally:
            memkernels.set_backend("auto")
        liger = f"{flops / ms['Liger'] * 1e-9:>14.1f}" if "Liger" in ms else f"{'-':>14}"
        print(f"{str(dtype).replace('torch.', ''):<10}{flops / ms['eager'] * 1e-9:>15.1f}"
              f"{flops / ms['compile'] * 1e-9:>17.1f}"
              f"{flops / ms['memkernels'] * 1e-9:>20.1f}{flops / ms['recompute'] * 1e-9:>19.1f}"
              f"{flops / ms['torch path'] * 1e-9:>20.1f}{liger}")
        print("  measured ms, fwd+bwd: " + ", ".join(f"{name} {value:.3f}" for name, value in ms.items())
              + f"; memkernels / eager {ms['memkernels'] / ms['eager']:.2f}x"
              + f", memkernels / compile {ms['memkernels'] / ms['compile']:.2f}x"
              + (f", memkernels / Liger {ms['memkernels'] / ms['Liger']:.2f}x" if "Liger" in ms else
                 " (liger_kernel not installed)"))
        # the model's memkernels is FusedGatedMLP without recompute (gpu_audit's first gated_mlp case)
        print("  " + prediction_line("gated_mlp", {"M": tokens, "K": intermediate, "N": hidden}, dtype,
                                     torch.cuda.get_device_name()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ok = memory_table(args.tokens, args.hidden, args.intermediate, device)
    if device == "cuda":
        timing_table(args.tokens, args.hidden, args.intermediate)
    else:
        print("\nGPU timing (eager, torch.compile, memkernels, Liger): skipped (no CUDA device; torch.compile's "
              "column needs one too: inductor makes C++ loops on a CPU, not the GPU's kernels)")
    return 0 if ok else 1


# ------------------------------------------------------------------------------------------------- pytest-benchmark
def bench_shape(device):
    """(tokens, hidden, intermediate, dtype) of the pytest-benchmark test: main()'s default shape in bf16 with
    CUDA, a small one on a CPU (seconds, not minutes)."""
    return (2048, 4096, 14336, torch.bfloat16) if device == "cuda" else (64, 64, 224, torch.float32)


def test_gated_mlp_forward_backward(benchmark):
    """pytest-benchmark: FusedGatedMLP's forward + backward (the memory table's "memkernels" row), synchronized
    on a GPU; the saved bytes per token of eager and memkernels at the same shape in extra_info."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens, hidden, intermediate, dtype = bench_shape(device)
    torch.manual_seed(0)
    linear = dict(bias=False, device=device, dtype=dtype)
    eager = _with_act(EagerGatedMLP(nn.Linear(hidden, intermediate, **linear),
                                    nn.Linear(hidden, intermediate, **linear),
                                    nn.Linear(intermediate, hidden, **linear)))
    fused = FusedGatedMLP.from_module(eager)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(tokens, hidden, device=device, dtype=dtype)
    saved = {name: measure(model, x, grad_out)[0] / tokens for name, model in (("eager", eager), ("memkernels", fused))}

    def run():
        fused(x).backward(grad_out)
        x.grad = None
        for param in fused.parameters():
            param.grad = None

    benchmark_step(benchmark, run, device)
    benchmark.extra_info.update(shape=[tokens, hidden, intermediate], dtype=str(dtype),
                                backend=resolve(x, "gated_linear"),
                                saved_bytes_per_token=saved)
    assert saved["memkernels"] <= TARGET_VS_EAGER * saved["eager"]


if __name__ == "__main__":
    sys.exit(main())
