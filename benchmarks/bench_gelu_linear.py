"""GeLU→Linear: activation memory of a GPT-2-medium MLP, memkernels.FusedMLP vs eager.

    python -m benchmarks.bench_gelu_linear [--tokens 4096] [--hidden 1024] [--ffn 4096]
    pytest benchmarks/bench_gelu_linear.py --benchmark-only [--benchmark-json gelu_linear.json]

Memory (any device, one run): bytes saved for backward per token (SavedBytesMeter, new
storages only; x and the parameters are the caller's) and the extra peak of a forward and of a
forward+backward step (PeakBytesMeter, bytes allocated on top of what existed before, including the
parameter gradients). The target is
FusedMLP saving at most 55% of eager's bytes; the exit status is 1 if it does not.

Timing (only with a CUDA device): TFLOP/s of gelu_linear against eager
F.linear(F.gelu(x), W, b) on the fc2 GEMM and against that eager function under torch.compile (in the
same run; its compile outside the timing), forward and forward+backward; and of gelu_linear's
PyTorch path on the same CUDA tensors (backend="torch": the same cuBLAS GEMMs, PyTorch's
elementwise ops in place of the one Triton pass each way), what the Triton passes save. On a CPU the
section says it skipped (torch.compile's column too: inductor makes C++ loops there, not the GPU's kernels).

Host time (any device): CPU time per forward + backward of gelu_linear and gated_linear at a tiny
shape, through the custom op with its autograd (what torch.compile keeps) and through its
autograd.Function twin (what eager mode runs; memkernels/fusions/common/custom_op.py), beside eager's. On
the CPU the torch backend runs, so the rows include its small GEMMs.

pytest-benchmark (test_gelu_linear_forward_backward): gelu_linear's forward + backward at a small shape on a
CPU ([64, 256] -> 64, fp32; its PyTorch path) or the timing's fc2 shape in bf16 with CUDA; the saved bytes per
token of eager and memkernels' FusedMLP at that shape in extra_info.
"""
import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

from memkernels._backend import resolve
from memkernels.fusions.gelu_mlp.module import FusedMLP
from memkernels.fusions.gelu_mlp.op import gelu_linear
from memkernels.meters import PeakBytesMeter, SavedBytesMeter
from memkernels.testing import benchmark_step

TARGET_SAVED_RATIO = 0.55


def eager_gelu_linear(x, weight, bias):
    """The eager baseline: F.linear(F.gelu(x), W, b)."""
    return F.linear(F.gelu(x), weight, bias)


def measure(model, x, grad_out):
    """(saved new bytes, forward extra peak, forward+backward extra peak) of one step.

    After one warm-up step, so that first-call costs (Triton's compiles, cuBLAS's workspace) are not
    counted."""
    model(x).backward(grad_out)
    x.grad = None
    for param in model.parameters():
        param.grad = None
    with SavedBytesMeter() as saved, PeakBytesMeter() as forward_peak:
        model(x)
    with PeakBytesMeter() as step_peak:
        model(x).backward(grad_out)
    return saved.new_bytes, forward_peak.peak_bytes, step_peak.peak_bytes


def memory_table(tokens, hidden, ffn, device):
    mib = 1 << 20
    print(f"GPT-2-medium MLP, {tokens} tokens x {hidden} -> {ffn} -> {hidden}, device {device}")
    print(f"{'dtype':<10}{'impl':<18}{'saved B/token':>15}{'fwd peak MiB':>14}{'step peak MiB':>15}"
          f"{'saved vs eager':>16}")
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        eager = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden)).to(device, dtype)
        fused = FusedMLP.from_modules(eager[0], eager[1], eager[2])  # shares eager's parameters
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
        grad_out = torch.randn(tokens, hidden, device=device, dtype=dtype)
        backend = resolve(x, "gelu_linear")
        results = {name: measure(model, x, grad_out) for name, model in (("eager", eager), ("memkernels", fused))}
        eager_saved = results["eager"][0]
        for name, (saved, forward_peak, step_peak) in results.items():
            ratio = saved / eager_saved
            label = name if name == "eager" else f"{name}/{backend}"
            print(f"{str(dtype).replace('torch.', ''):<10}{label:<18}{saved / tokens:>15.0f}"
                  f"{forward_peak / mib:>14.1f}{step_peak / mib:>15.1f}{ratio:>15.0%}")
        fused_ratio = results["memkernels"][0] / eager_saved
        ok &= fused_ratio <= TARGET_SAVED_RATIO
    print(f"target: memkernels saves <= {TARGET_SAVED_RATIO:.0%} of eager's bytes per token: "
          f"{'met' if ok else 'NOT met'}")
    return ok


def timing_table(tokens, hidden, ffn):
    import triton.testing

    from memkernels.audit.gpu_audit import prediction_line

    print(f"\nfc2 GEMM timing on {torch.cuda.get_device_name()}: [{tokens}, {ffn}] -> {hidden}")
    print(f"{'dtype':<10}{'pass':<10}{'eager TFLOP/s':>15}{'compile TFLOP/s':>17}{'memkernels TFLOP/s':>20}"
          f"{'speedup':>9}{'vs compile':>11}{'torch path TFLOP/s':>20}")
    compiled = torch.compile(eager_gelu_linear)  # the eager function compiled: a torch.compile user's baseline
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(tokens, ffn, device="cuda", dtype=dtype, requires_grad=True)
        weight = (torch.randn(hidden, ffn, device="cuda", dtype=dtype) * ffn ** -0.5).requires_grad_()
        bias = torch.randn(hidden, device="cuda", dtype=dtype, requires_grad=True)
        grad_out = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
        flops_forward = 2.0 * tokens * ffn * hidden
        milliseconds = {}
        compiled(x, weight, bias).backward(grad_out)  # compiles here (forward and backward), outside the timing
        x.grad = weight.grad = bias.grad = None
        for name, fn in (("eager", lambda: eager_gelu_linear(x, weight, bias)),
                         ("compile", lambda: compiled(x, weight, bias)),
                         ("memkernels", lambda: gelu_linear(x, weight, bias)),
                         ("torch path", lambda: gelu_linear(x, weight, bias, backend="torch"))):
            milliseconds[name] = (
                triton.testing.do_bench(fn),
                triton.testing.do_bench(lambda: fn().backward(grad_out), grad_to_none=[x, weight, bias]),
            )
        for index, (label, flops) in enumerate((("fwd", flops_forward), ("fwd+bwd", 3 * flops_forward))):
            eager_ms, ours_ms = milliseconds["eager"][index], milliseconds["memkernels"][index]
            compile_ms = milliseconds["compile"][index]
            print(f"{str(dtype).replace('torch.', ''):<10}{label:<10}{flops / eager_ms * 1e-9:>15.1f}"
                  f"{flops / compile_ms * 1e-9:>17.1f}"
                  f"{flops / ours_ms * 1e-9:>20.1f}{eager_ms / ours_ms:>8.2f}x{compile_ms / ours_ms:>10.2f}x"
                  f"{flops / milliseconds['torch path'][index] * 1e-9:>20.1f}")
        print(f"  measured ms, fwd+bwd: eager {milliseconds['eager'][1]:.3f}, compile "
              f"{milliseconds['compile'][1]:.3f}, memkernels {milliseconds['memkernels'][1]:.3f}, torch path "
              f"{milliseconds['torch path'][1]:.3f}")
        print("  " + prediction_line("gelu_linear", {"M": tokens, "K": ffn, "N": hidden}, dtype,
                                     torch.cuda.get_device_name()))


def host_time_table(device, calls=300):
    """CPU time per forward + backward, issued without waiting for the GPU in the loop."""
    import time

    from memkernels.fusions.gated_mlp.op import GATED_LINEAR
    from memkernels.fusions.gelu_mlp.op import GELU_LINEAR

    backend = "triton" if device == "cuda" else "torch"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(4, 16, device=device, dtype=dtype, requires_grad=True)
    up = torch.randn(4, 16, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(8, 16, device=device, dtype=dtype, requires_grad=True)
    gelu_op, gated_op = GELU_LINEAR.custom_op, GATED_LINEAR.custom_op
    rows = {
        "gelu_linear: custom op": lambda: gelu_op(x, weight, None, "none", backend),
        "gelu_linear: eager twin (what runs)": lambda: GELU_LINEAR.function.apply(
            x, weight, None, "none", backend),
        "eager F.linear(F.gelu(x))": lambda: F.linear(F.gelu(x), weight),
        "gated_linear: custom op": lambda: gated_op(x, up, weight, None, "silu", backend),
        "gated_linear: eager twin (what runs)": lambda: GATED_LINEAR.function.apply(
            x, up, weight, None, "silu", backend),
        "eager F.linear(F.silu(gate) * up)": lambda: F.linear(F.silu(x) * up, weight),
    }
    print(f"\nHost time per forward + backward, [4, 16] x [8, 16] {dtype} on {device}, backend {backend} "
          "(CPU time to issue; the GPU is not awaited in the loop)")
    for label, call in rows.items():
        for _ in range(20):
            call().sum().backward()
        start = time.perf_counter()
        for _ in range(calls):
            call().sum().backward()
        print(f"  {label:<40}{(time.perf_counter() - start) / calls * 1e6:9.1f} us")
        if device == "cuda":
            torch.cuda.synchronize()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ok = memory_table(args.tokens, args.hidden, args.ffn, device)
    host_time_table(device)
    if device == "cuda":
        timing_table(args.tokens, args.hidden, args.ffn)
    else:
        print("\nGPU timing (eager, torch.compile, memkernels): skipped (no CUDA device; torch.compile's column "
              "needs one too: inductor makes C++ loops on a CPU, not the GPU's kernels)")
    return 0 if ok else 1


# ------------------------------------------------------------------------------------------------- pytest-benchmark
def bench_shape(device):
    """(tokens, ffn, hidden, dtype) of the pytest-benchmark test: the timing's fc2 GEMM at main()'s defaults in
    bf16 with CUDA, a small one on a CPU."""
    return (4096, 4096, 1024, torch.bfloat16) if device == "cuda" else (64, 256, 64, torch.float32)


def test_gelu_linear_forward_backward(benchmark):
    """pytest-benchmark: gelu_linear's forward + backward on fc2's input, synchronized on a GPU; the saved bytes
    per token of eager's MLP and FusedMLP at the same sizes in extra_info."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens, ffn, hidden, dtype = bench_shape(device)
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden)).to(device, dtype)
    fused = FusedMLP.from_modules(eager[0], eager[1], eager[2])
    mlp_x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    mlp_grad = torch.randn(tokens, hidden, device=device, dtype=dtype)
    saved = {name: measure(model, mlp_x, mlp_grad)[0] / tokens for name, model in (("eager", eager),
                                                                                 ("memkernels", fused))}
    x = torch.randn(tokens, ffn, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(hidden, ffn, device=device, dtype=dtype) * ffn ** -0.5).requires_grad_()
    bias = torch.randn(hidden, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(tokens, hidden, device=device, dtype=dtype)

    def run():
        gelu_linear(x, weight, bias).backward(grad_out)
        x.grad = weight.grad = bias.grad = None

    benchmark_step(benchmark, run, device)
    benchmark.extra_info.update(shape=[tokens, ffn, hidden], dtype=str(dtype), backend=resolve(x, "gelu_linear"),
                                saved_bytes_per_token=saved)
    assert saved["memkernels"] <= TARGET_SAVED_RATIO * saved["eager"]


if __name__ == "__main__":
    sys.exit(main())
