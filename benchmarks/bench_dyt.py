"""DyT (Dynamic Tanh): memkernels.functional.dyt vs its eager form (the paper's DynamicTanh) and Liger's.

    python benchmarks/bench_dyt.py [--tokens 8192] [--hidden 4096]
    pytest benchmarks/bench_dyt.py --benchmark-only

Without CUDA: launches per forward + backward (memkernels.audit.gpu_audit.count(): aten ops that run a
kernel and Triton grids, memkernels' Triton path in the interpreter, at a small shape) and new bytes
saved for backward (SavedBytesMeter) for eager and memkernels: eager saves tanh's output besides x,
memkernels x alone.
With CUDA: forward and forward + backward time (triton.testing.do_bench, median) and the peak memory of
forward + backward (torch.cuda.max_memory_allocated above the inputs) at [tokens, hidden] in bf16 for eager,
memkernels and Liger (when liger_kernel imports), in the same run, with the audit's modelled time beside; the
exit status is 1 when memkernels' forward + backward is slower than eager's or Liger's.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import: Triton launches run on the CPU

import memkernels  # noqa: E402
from memkernels.fusions.dyt import reference  # noqa: E402
from memkernels.fusions.dyt.op import dyt  # noqa: E402
from memkernels.meters import SavedBytesMeter  # noqa: E402
from memkernels.testing import benchmark_step  # noqa: E402

eager_dyt = reference.eager  # the paper's DynamicTanh, op for op


def liger_dyt():
    try:
        from liger_kernel.transformers.functional import liger_dyt as function
    except ImportError:
        return None
    return function


def inputs(tokens, hidden, dtype, device):
    """x (a residual stream's [tokens, hidden]), alpha, weight and bias that need gradients, y's gradient."""
    x = torch.randn(tokens, hidden, dtype=dtype, device=device, requires_grad=True)
    alpha = torch.full((1,), 0.5, dtype=dtype, device=device, requires_grad=True)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype).requires_grad_()
    bias = (0.1 * torch.randn(hidden, device=device)).to(dtype).requires_grad_()
    return x, alpha, weight, bias, torch.randn(tokens, hidden, dtype=dtype, device=device)


def step(fn, x, alpha, weight, bias, grad):
    fn(x, alpha, weight, bias).backward(grad)


def counts_table(device):
    """Launches and saved bytes per forward + backward, eager and memkernels (its Triton path, interpreted)."""
    from memkernels.audit import gpu_audit

    tokens, hidden, dtype = 64, 256, torch.float32
    print(f"Launches and saved bytes per forward + backward: [{tokens}, {hidden}], "
          f"{str(dtype).replace('torch.', '')}, {device}")
    memkernels.set_backend("triton")
    try:
        for name, fn in (("eager", eager_dyt), ("memkernels", dyt)):
            *tensors, grad = inputs(tokens, hidden, dtype, device)
            with SavedBytesMeter() as saved, gpu_audit.count() as counts:
                step(fn, *tensors, grad)
            print(f"  {name:<12}{len(counts.launches):>4} launches   {saved.new_bytes:>7} new bytes saved "
                  f"(x itself: {tokens * hidden * 4})")
    finally:
        memkernels.set_backend("auto")


def timing_table(tokens, hidden):
    import triton.testing

    from memkernels.audit.gpu_audit import prediction_line

    print(f"\nTime on {torch.cuda.get_device_name()}, bf16, [{tokens}, {hidden}] (median ms, triton.testing.do_bench; "
          "peak: max_memory_allocated of forward + backward above the inputs)")
    args = inputs(tokens, hidden, torch.bfloat16, "cuda")
    leaves = list(args[:4])
    columns = {"eager": eager_dyt, "memkernels": dyt}
    if liger_dyt() is not None:
        columns["Liger"] = liger_dyt()
    measured = {}
    for name, fn in columns.items():
        forward = triton.testing.do_bench(lambda: fn(*args[:4]))
        whole = triton.testing.do_bench(lambda: step(fn, *args), grad_to_none=leaves)
        for leaf in leaves:
            leaf.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(fn, *args)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        for leaf in leaves:
            leaf.grad = None
        measured[name] = whole
        print(f"  {name:<12}forward {forward:8.3f}   forward + backward {whole:8.3f}   peak {peak / 2**20:8.1f} MiB")
    if "Liger" not in columns:
        print("  Liger: not installed (pip install liger-kernel) — its column is missing from this run")
    print("  " + prediction_line("dyt", {"N": tokens, "H": hidden}, torch.bfloat16, torch.cuda.get_device_name(),
                                 impls=("memkernels", "eager")))
    ok = all(measured["memkernels"] <= measured[other] for other in measured if other != "memkernels")
    ratios = ", ".join(f"{measured['memkernels'] / measured[other]:.2f}x {other}"
                       for other in measured if other != "memkernels")
    print(f"target: memkernels forward + backward <= eager's and Liger's: {'met' if ok else 'NOT met'} ({ratios})")
    return ok


def test_dyt_forward_backward(benchmark):
    """pytest-benchmark: memkernels' forward + backward at the CPU shape (or [8192, 4096] bf16 with CUDA)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = (8192, 4096) if device == "cuda" else (256, 512)
    args = inputs(*shape, torch.bfloat16 if device == "cuda" else torch.float32, device)

    def run():
        step(dyt, *args)
        for leaf in args[:4]:
            leaf.grad = None

    benchmark_step(benchmark, run, device)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda":
        counts_table(device)
        print("\nGPU timing: skipped (no CUDA device)")
        return 0
    return 0 if timing_table(args.tokens, args.hidden) else 1


if __name__ == "__main__":
    sys.exit(main())
