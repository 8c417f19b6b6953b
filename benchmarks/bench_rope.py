"""RoPE on q and k: memkernels.functional.rope vs Hugging Face's apply_rotary_pos_emb (eager) and Liger's.

    python benchmarks/bench_rope.py [--tokens 8192] [--heads 32] [--kv-heads 8] [--head-dim 128]
    pytest benchmarks/bench_rope.py --benchmark-only

Without CUDA: launches per forward + backward (memkernels.audit.gpu_audit.count(): aten ops that run a
kernel and Triton grids, memkernels' Triton path in the interpreter, at a small shape) and new bytes
saved for backward (SavedBytesMeter) for eager and memkernels; both save only the tables.
With CUDA: forward and forward + backward time (triton.testing.do_bench, median) at Llama-3-8B's q and
k (32 and 8 heads of 128, bf16) for eager, memkernels and Liger (when liger_kernel imports), in the same
run, with the audit's modelled time beside; the exit status is 1 when memkernels' forward + backward is
slower than eager's.
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
from memkernels.fusions.rope import reference  # noqa: E402
from memkernels.fusions.rope.op import rope  # noqa: E402
from memkernels.meters import SavedBytesMeter  # noqa: E402
from memkernels.testing import benchmark_step  # noqa: E402


eager_rope = reference.eager  # Hugging Face's apply_rotary_pos_emb, op for op


def liger_rope():
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError:
        return None
    return liger_rotary_pos_emb


def inputs(tokens, heads, kv_heads, head_dim, dtype, device):
    """q and k as Hugging Face's attention passes them (projection outputs viewed and transposed), its tables."""
    q_base = torch.randn(1, tokens, heads, head_dim, dtype=dtype, device=device, requires_grad=True)
    k_base = torch.randn(1, tokens, kv_heads, head_dim, dtype=dtype, device=device, requires_grad=True)
    angles = torch.arange(tokens, device=device).float()[None, :, None] * torch.rand(1, 1, head_dim // 2,
                                                                                   device=device)
    angles = torch.cat((angles, angles), dim=-1)
    grads = (torch.randn(1, heads, tokens, head_dim, dtype=dtype, device=device),
             torch.randn(1, kv_heads, tokens, head_dim, dtype=dtype, device=device))
    return q_base, k_base, angles.cos().to(dtype), angles.sin().to(dtype), grads


def step(fn, q_base, k_base, cos, sin, grads):
    outputs = fn(q_base.transpose(1, 2), k_base.transpose(1, 2), cos, sin)
    torch.autograd.backward(outputs, grads)


def counts_table(device):
    """Launches and saved bytes per forward + backward, eager and memkernels (its Triton path, interpreted)."""
    from memkernels.audit import gpu_audit

    shape, dtype = (64, 4, 2, 16), torch.float32
    print(f"Launches and saved bytes per forward + backward: {shape[0]} tokens, {shape[1]} q heads, {shape[2]} "
          f"kv heads of {shape[3]}, {str(dtype).replace('torch.', '')}, {device}")
    memkernels.set_backend("triton")
    try:
        for name, fn in (("eager", eager_rope), ("memkernels", rope)):
            q_base, k_base, cos, sin, grads = inputs(*shape, dtype, device)
            with SavedBytesMeter() as saved, gpu_audit.count() as counts:
                step(fn, q_base, k_base, cos, sin, grads)
            print(f"  {name:<12}{len(counts.launches):>4} launches   {saved.new_bytes:>6} new bytes saved")
    finally:
        memkernels.set_backend("auto")


def timing_table(tokens, heads, kv_heads, head_dim):
    import triton.testing

    from memkernels.audit.gpu_audit import prediction_line

    print(f"\nTime on {torch.cuda.get_device_name()}, bf16, {tokens} tokens, q {heads} and k {kv_heads} heads of "
          f"{head_dim} (median ms, triton.testing.do_bench)")
    args = inputs(tokens, heads, kv_heads, head_dim, torch.bfloat16, "cuda")
    q_base, k_base, cos, sin, grads = args
    columns = {"eager": eager_rope, "memkernels": rope}
    if liger_rope() is not None:
        columns["Liger"] = liger_rope()
    measured = {}
    for name, fn in columns.items():
        forward = triton.testing.do_bench(lambda: fn(q_base.transpose(1, 2), k_base.transpose(1, 2), cos, sin))
        whole = triton.testing.do_bench(lambda: step(fn, *args), grad_to_none=[q_base, k_base])
        measured[name] = whole
        print(f"  {name:<12}forward {forward:8.3f}   forward + backward {whole:8.3f}")
    if "Liger" not in columns:
        print("  Liger: not installed (pip install liger-kernel) — its column is missing from this run")
    impls = ("memkernels", "eager") + (("liger",) if "Liger" in columns else ())
    print("  " + prediction_line("rope", {"N": tokens, "HQ": heads, "HK": kv_heads, "D": head_dim}, torch.bfloat16,
                                 torch.cuda.get_device_name(), impls=impls))
    ok = measured["memkernels"] <= measured["eager"]
    print(f"target: memkernels forward + backward <= eager's: {'met' if ok else 'NOT met'} "
          f"({measured['memkernels'] / measured['eager']:.2f}x eager)")
    return ok


def test_rope_forward_backward(benchmark):
    """pytest-benchmark: memkernels' forward + backward at the CPU shape (or Llama-3-8B's q and k with CUDA)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = (8192, 32, 8, 128) if device == "cuda" else (256, 8, 2, 64)
    args = inputs(*shape, torch.bfloat16 if device == "cuda" else torch.float32, device)

    def run():
        step(rope, *args)
        args[0].grad = args[1].grad = None

    benchmark_step(benchmark, run, device)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda":
        counts_table(device)
        print("\nGPU timing: skipped (no CUDA device)")
        return 0
    return 0 if timing_table(args.tokens, args.heads, args.kv_heads, args.head_dim) else 1


if __name__ == "__main__":
    sys.exit(main())
