"""GEMMs on half-precision operands accumulating into a float32 tensor (``out_dtype=torch.float32``).

On CUDA, ``torch.addmm`` with ``out_dtype`` runs cuBLAS on the tensor cores and
accumulates in float32, where upcasting the operands first would run the GEMM at float32 speed
(TF32 is off by default). PyTorch implements the overload for CUDA only; the CPU kernel
registered here (only while PyTorch has none) computes the same thing by widening the operands:
a product of two bf16/fp16 numbers is exact in float32, so only the order of the float32 sums
can differ. This keeps one code path for the GPU, the interpreter tests and the GPU audit,
which sees the half operands it would see on a GPU.
"""
import torch

_LIBRARY = None


def _addmm_dtype_out(accumulator, a, b, out_dtype, *, beta=1, alpha=1, out):
    return torch.addmm(accumulator, a.to(out_dtype), b.to(out_dtype), beta=beta, alpha=alpha, out=out)


def _register_cpu_kernel():
    global _LIBRARY
    if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::addmm.dtype_out", "CPU"):
        _LIBRARY = torch.library.Library("aten", "IMPL")
        _LIBRARY.impl("addmm.dtype_out", _addmm_dtype_out, "CPU")


_register_cpu_kernel()


def addmm_float32_(accumulator, a, b):
    """accumulator += a @ b: half operands into a float32 accumulator (accumulated in float32), or operands of
    the accumulator's own dtype."""
    if a.dtype == accumulator.dtype:
        return accumulator.addmm_(a, b)
    return torch.addmm(accumulator, a, b, out_dtype=torch.float32, out=accumulator)
