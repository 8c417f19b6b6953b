"""Test-only fix for triton 3.9's interpreter: float32 -> bfloat16 casts truncate.

The interpreter converts fp32 to bf16 by dropping the low 16 bits (its cast
ignores the rounding mode), so every bf16 store is off by up to one ulp toward
zero and errors come out about twice the hardware's. The GPU rounds to
nearest even. This patch makes the interpreter's cast do the same; compiled
kernels never see it. (Like conftest.py's bf16 tl.dot shim; it belongs next to
it so every op's tests get it.)
"""
import numpy as np


def _float32_to_bfloat16_bits(values):
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


def install():
    """Patch the interpreter's fp32 -> bf16 cast to round to nearest even (idempotent)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "_memkernels_bf16_rounding", False):
        return
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_float32_to_bfloat16_bits(src.data), dst_type.scalar)
        return original(self, src, dst_type)

    cast_impl._memkernels_bf16_rounding = True
    builder.cast_impl = cast_impl
