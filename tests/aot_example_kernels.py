"""Small Triton kernels with known compile properties, for tests/test_aot.py.

Registered at import time, as ops do, so that the AOT check's subprocess finds
them by importing this module.
"""
import triton
import triton.language as tl

from memkernels import aot


@triton.jit
def scale_kernel(x_ptr, y_ptr, n_elements, BLOCK: tl.constexpr):
    # x_ptr, y_ptr: (n_elements,) fp32
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2.0, mask=mask)


@triton.jit
def normalize_row_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    # x_ptr, y_ptr: (BLOCK,) fp32. The whole row stays live across the reduction:
    # with one warp and 4096 elements that is 128 values per thread.
    offsets = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets)
    tl.store(y_ptr + offsets, x / tl.sum(x * x, axis=0))


@triton.jit
def tile_matmul_kernel(a_ptr, b_ptr, c_ptr, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    # a_ptr: (BLOCK_M, K) fp16, b_ptr: (K, BLOCK_N) fp16, c_ptr: (BLOCK_M, BLOCK_N) fp32; all row-major.
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rows[:, None] * K + (k + ks)[None, :])
        b = tl.load(b_ptr + (k + ks)[:, None] * BLOCK_N + cols[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + rows[:, None] * BLOCK_N + cols[None, :], acc)


aot.register(scale_kernel, name="example_scale", variants=[
    {"signature": {"x_ptr": "*fp32", "y_ptr": "*fp32", "n_elements": "i32"}, "constexprs": {"BLOCK": 1024},
     "num_warps": 4, "num_stages": 1, "label": "block1024"},
    {"signature": {"x_ptr": "*fp32", "y_ptr": "*fp32", "n_elements": "i32"}, "constexprs": {"BLOCK": 1024},
     "num_warps": 4, "num_stages": 1, "aligned": ["x_ptr", "y_ptr", "n_elements"], "label": "block1024-aligned"},
])
aot.register(normalize_row_kernel, name="example_normalize_row", variants=[
    {"signature": {"x_ptr": "*fp32", "y_ptr": "*fp32"}, "constexprs": {"BLOCK": 4096},
     "num_warps": 8, "num_stages": 1, "label": "8warps"},
    {"signature": {"x_ptr": "*fp32", "y_ptr": "*fp32"}, "constexprs": {"BLOCK": 4096},
     "num_warps": 1, "num_stages": 1, "options": {"maxnreg": 32}, "label": "1warp-maxnreg32"},
])
aot.register(tile_matmul_kernel, name="example_tile_matmul", variants=[
    {"signature": {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp32", "K": "i32"},
     "constexprs": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}, "num_warps": 4, "num_stages": 3,
     "label": "64x64x32-3stages"},
])
# tl.arange needs a power-of-two length: this variant must be reported as a compile error.
aot.register(scale_kernel, name="example_broken_block", variants=[
    {"signature": {"x_ptr": "*fp32", "y_ptr": "*fp32", "n_elements": "i32"}, "constexprs": {"BLOCK": 1000},
     "num_warps": 4, "num_stages": 1, "label": "block1000"},
])
