"""GEMMs on half-precision operands with a float32 result (``out_dtype=torch.float32``).

On CUDA, ``torch.mm`` / ``torch.addmm`` with ``out_dtype`` run cuBLAS on the tensor cores and
accumulate in float32, where upcasting the operands first would run the GEMM at float32 speed
(TF32 is off by default). PyTorch implements these overloads for CUDA only; the CPU kernels
registered here (only while PyTorch has none) compute the same thing by widening the operands:
a product of two bf16/fp16 numbers is exact in float32, so only the order of the float32 sums
can differ. This keeps one code path for the GPU, the interpreter tests and the GPU audit,
which sees the half operands it would see on a GPU.
"""
import torch

_LIBRARY = None


def _mm_dtype_out(a, b, out_dtype, *, out):
    return torch.mm(a.to(out_dtype), b.to(out_dtype), out=out)


def _addmm_dtype_out(accumulator, a, b, out_dtype, *, beta=1, alpha=1, out):
    return torch.addmm(accumulator, a.to(out_dtype), b.to(out_dtype), beta=beta, alpha=alpha, out=out)


def _register_cpu_kernels():
    global _LIBRARY
    missing = [(name, kernel) for name, kernel in (("mm.dtype_out", _mm_dtype_out),
                                                    ("addmm.dtype_out", _addmm_dtype_out))
               if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CPU")]
    if missing:
        _LIBRARY = torch.library.Library("aten", "IMPL")
        for name, kernel in missing:
            _LIBRARY.impl(name, kernel, "CPU")


_register_cpu_kernels()


def mm_float32(a, b, out):
    """out (float32) = a @ b, operands in their own dtype, accumulated in float32."""
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    return torch.mm(a, b, out_dtype=torch.float32, out=out)


def addmm_float32_(accumulator, a, b):
    """accumulator (float32) += a @ b, operands in their own dtype, accumulated in float32."""
    if a.dtype == torch.float32:
        return accumulator.addmm_(a, b)
    return torch.addmm(accumulator, a, b, out_dtype=torch.float32, out=accumulator)
