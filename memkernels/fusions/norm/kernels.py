"""Triton kernels shared by RMSNorm and LayerNorm (plain and with fused residual add).

One forward and one backward kernel serve both norms (IS_RMS), as in
flash-attention's layer_norm.py; memkernels/fusions/norm/reference.py is the spec.
Order: helpers → kernels → launchers. The autograd and custom-op layer is
memkernels/fusions/norm/op.py.

Rows are [M, H] contiguous. A row that fits in one block is held in registers
(the input is read once); a wider row is walked in block-sized chunks, once per
reduction and once more to write. The backward runs programs over strided
sets of rows, each holding the weight and its plain fp32 dw/db partial sums
in registers across its rows (for wide rows, one column chunk at a time over
all its rows) and writing the sums once to its own row of an fp32 buffer,
which a second kernel reduces in a fixed order, in float64 (no atomics:
deterministic). Plain sums, not Kahan's: a program adds up its rows one
after another, and the error of that running sum grows with their number n.
Measured through the interpreter against the accuracy tests' rule (error vs
float64 <= 2x eager PyTorch's + one rounding; RMSNorm float32 is the binding
case, its eager dw a pairwise sum; LayerNorm's eager dw is itself a running
sum, bf16/fp16 gradients are dominated by their own rounding): plain sums
reach 0.3-0.4 of the bound at n = 32, 0.3-0.8 at n = 64, up to 1.1 at 128
(1 of 6 seeds fails) and 1.5-1.8 at 512 (every seed fails); Kahan sums
0.1-0.3 at any n. So the grid grows with M (num_programs) to keep n at most
MAX_ROWS_PER_PROGRAM = 64: one wave at 8192 tokens on an H100 (31-62 rows a
program), more waves of the same programs on longer batches, at the cost of
one more fp32 partial row per program (at 65536 tokens, 1056 rows of H: ~2%
of the backward's bytes).
"""
import functools

import torch
import triton
import triton.language as tl

from memkernels import aot
from memkernels.fusions.common.device_guard import on_tensor_device
from memkernels.fusions.common.host import cdiv

# Widest row chunk held in registers, and elements per warp; wider rows loop.
# Chosen with `python -m memkernels.aot` (ptxas -v) so that every registered
# variant compiles with no spills on sm_80 and sm_90: forward 8192 (8 warps; 32 in
# looping rows; 16384 spills in LayerNorm).
# Warps per row, measured on the H200 (docs/gpu-runs.md, 2026-11-26 second run): the forward at
# 1024 elements a warp past 4 warps (4 warps at 4096, 8 at 8192; 256 a warp below) took a bf16
# [8192, 4096] RMSNorm from 40 to 33 us and [8192, 8192] from 93 to 65 (LayerNorm 50 -> 36,
# 112 -> 72; float32 within 2 us) against 256 a warp, where each thread held 8 elements of a row:
# one 16-byte load in flight of a 16-bit row (32 bytes of a float32 one), against 4 now, and the
# row's sums reduced across 16-32 warps.
FWD_MAX_BLOCK, FWD_ELEMENTS_PER_WARP, FWD_SMALL_ELEMENTS_PER_WARP = 8192, 1024, 256
# Backward: Liger-Kernel's shape of work (issue 31): its warps (backward_config: 16 elements a thread
# at 2048-8192), the weight held in registers across a program's rows, plain fp32 sums. On the H200
# the 8-warp RMSNorm bf16 [8192, 4096] backward took 73 us against 106 at 128 elements a warp (32
# warps) and Liger's 91 (docs/gpu-runs.md). It fits in registers (`python -m memkernels.aot`, sm_80
# and sm_90: 102-128 registers at the cap of 128) only where the loads vectorize: rows a multiple of
# 16 wide, which the JIT specializes as 16-byte aligned. Rows of other widths load element by
# element, each with its own 64-bit address, and spill at 16 elements a thread (8-20 bytes at 4096
# and 8 warps, 100-800 at 8192 and 16 warps on sm_90): they keep 128 elements a warp (4 a thread,
# 48-63 registers) and loop past 4096 (at 8192 with 32 warps they spill 4-290 bytes on sm_90).
# Looping rows take chunks of 4096 at 16 warps (8 warps spill 16 bytes in fp32 memory_efficient
# LayerNorm with a residual).
BWD_MAX_BLOCK, BWD_CHUNK, BWD_UNALIGNED_ELEMENTS_PER_WARP = 8192, 4096, 128


def _wide_backward_rows_fit(triton_version):
    """Whether this triton holds the backward's rows of BWD_MAX_BLOCK in registers. Triton 3.7 (the
    version torch 2.13's CUDA wheels pin) spilled them where 3.6, 3.8 and 3.9 did not, when the
    backward kept Kahan sums at 32 warps: 240-984 bytes a thread (64 registers), more at 16 or 8
    warps (128, 255 registers); its rows of 4096 fit (`python -m memkernels.aot` under triton 3.7.1).
    There rows wider than BWD_CHUNK loop over chunks of it instead: x and dy are read twice."""
    return not triton_version.startswith("3.7.")


WIDE_BACKWARD_ROWS_FIT = _wide_backward_rows_fit(triton.__version__)
# Rows a backward program sums at most (the module docstring: plain fp32 sums of 64 rows stay within the
# accuracy tests' rule with room, 128 do not always).
MAX_ROWS_PER_PROGRAM = 64
# Backward programs under the interpreter (no SMs to count): a few, so that programs sum several rows.
INTERPRETER_PROGRAMS = 4
# The dw/db reduction: programs of BLOCK_H columns (coalesced 128-byte rows of the partials;
# 128 programs at H = 4096), each summing BLOCK_P partial rows per step.
REDUCE_BLOCK_P, REDUCE_BLOCK_H, REDUCE_WARPS = 32, 32, 4


@triton.jit
def _round(value, dtype):
    """Cast fp32 ``value`` to ``dtype`` (round to nearest) and back to fp32: a rounding point."""
    return value.to(dtype).to(tl.float32)


@triton.jit
def _load_scale(W, cols, mask, offset, dtype, CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """W' = offset + w in fp32 ([BLOCK]); 1 without a weight; rounded to dtype in casting "none"."""
    if HAS_WEIGHT:
        scale = tl.load(W + cols, mask=mask, other=1.0).to(tl.float32) + offset
        if CASTING == 0:
            scale = _round(scale, dtype)
    else:
        scale = tl.full(cols.shape, 1.0, tl.float32)
    return scale


@triton.jit
def _load_input(X, RESIDUAL, RESIDUAL_OUT, cols, mask, HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr):
    """One chunk of s: x, or residual_out = round(x + residual) (stored when STORE_RESIDUAL)."""
    s = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        s = _round(s + tl.load(RESIDUAL + cols, mask=mask, other=0.0).to(tl.float32), X.dtype.element_ty)
        if STORE_RESIDUAL:
            tl.store(RESIDUAL_OUT + cols, s.to(RESIDUAL_OUT.dtype.element_ty), mask=mask)
    return s


@triton.jit
def _write_output(s, cols, mask, mean, correction, rstd, W, B, Y, SLOT, FALLBACK, offset,
                  CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                  MEMORY_EFFICIENT: tl.constexpr):
    """y = casting(x̂) * W' + b for one chunk; in memory_efficient mode also x̂ of unrecoverable columns.

    The row mean is mean + correction (see _norm_fwd_kernel), subtracted in two steps.
    """
    dtype = Y.dtype.element_ty
    xhat = ((s - mean) - correction) * rstd
    if CASTING == 0:
        normalized = _round(s * _round(rstd, dtype), dtype)
    elif CASTING == 1:
        normalized = _round(xhat, dtype)
    else:
        normalized = xhat
    out = normalized
    if HAS_BIAS:
        bias = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            # One rounding for scale-and-shift (what FP contraction gives on the GPU anyway).
            out = tl.fma(out, _load_scale(W, cols, mask, offset, dtype, CASTING, HAS_WEIGHT), bias)
        else:
            out += bias
    elif HAS_WEIGHT:
        out = out * _load_scale(W, cols, mask, offset, dtype, CASTING, HAS_WEIGHT)
    tl.store(Y + cols, out.to(dtype), mask=mask)
    if MEMORY_EFFICIENT:
        slot = tl.load(SLOT + cols, mask=mask, other=-1)
        tl.store(FALLBACK + slot, xhat.to(dtype), mask=mask & (slot >= 0))


@triton.jit
def _norm_fwd_kernel(
    X,             # [M, H] input (fp32/fp16/bf16)
    RESIDUAL,      # [M, H] residual, x's dtype (read if HAS_RESIDUAL)
    RESIDUAL_OUT,  # [M, H] x + residual, x's dtype (written if HAS_RESIDUAL)
    W,             # [H] weight, x's dtype or fp32 (read if HAS_WEIGHT)
    B,             # [H] bias, like W (read if HAS_BIAS)
    Y,             # [M, H] output, x's dtype
    MEAN,          # [M] fp32 row means (written if STORE_MEAN)
    RSTD,          # [M] fp32 1 / sqrt(var + eps)
    SLOT,          # [H] int32 fallback slot per column, -1 where x̂ is recoverable (MEMORY_EFFICIENT)
    FALLBACK,      # [M, K] x's dtype: x̂ at the unrecoverable columns (MEMORY_EFFICIENT)
    H, K, eps, offset,
    IS_RMS: tl.constexpr, CASTING: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_MEAN: tl.constexpr,
    MEMORY_EFFICIENT: tl.constexpr, BLOCK: tl.constexpr, SINGLE_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    X += row * H
    RESIDUAL += row * H
    RESIDUAL_OUT += row * H
    Y += row * H
    FALLBACK += row * K
    cols = tl.arange(0, BLOCK)

    # LayerNorm's mean is mean + correction, the corrected two-pass algorithm: the
    # first pass's mean carries a rounding error of up to half an ulp of the mean,
    # which (s - mean) inherits in full; the average of (s - mean) gives it back.
    if SINGLE_PASS:
        mask = cols < H
        s = _load_input(X, RESIDUAL, RESIDUAL_OUT, cols, mask, HAS_RESIDUAL, True)
        if IS_RMS:
            mean = 0.0
            correction = 0.0
        else:
            mean = tl.sum(s, axis=0) / H
            correction = tl.sum(tl.where(mask, s - mean, 0.0), axis=0) / H
        centered = tl.where(mask, (s - mean) - correction, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / H + eps)
        _write_output(s, cols, mask, mean, correction, rstd, W, B, Y, SLOT, FALLBACK, offset,
                      CASTING, HAS_WEIGHT, HAS_BIAS, MEMORY_EFFICIENT)
    else:
        # Wide rows: the first pass writes residual_out, later passes read it back.
        SOURCE = RESIDUAL_OUT if HAS_RESIDUAL else X
        if IS_RMS:
            mean = 0.0
        else:
            total = tl.zeros([BLOCK], tl.float32)
            for start in range(0, H, BLOCK):
                mask = start + cols < H
                total += _load_input(X + start, RESIDUAL + start, RESIDUAL_OUT + start, cols, mask,
                                     HAS_RESIDUAL, True)
            mean = tl.sum(total, axis=0) / H
        squares = tl.zeros([BLOCK], tl.float32)
        differences = tl.zeros([BLOCK], tl.float32)
        for start in range(0, H, BLOCK):
            mask = start + cols < H
            if IS_RMS:
                s = _load_input(X + start, RESIDUAL + start, RESIDUAL_OUT + start, cols, mask, HAS_RESIDUAL, True)
            else:
                s = tl.load(SOURCE + start + cols, mask=mask, other=0.0).to(tl.float32)
            centered = tl.where(mask, s - mean, 0.0)
            squares += centered * centered
            differences += centered
        if IS_RMS:
            correction = 0.0
            variance = tl.sum(squares, axis=0) / H
        else:
            correction = tl.sum(differences, axis=0) / H
            variance = tl.sum(squares, axis=0) / H - correction * correction
        rstd = 1.0 / tl.sqrt(variance + eps)
        for start in range(0, H, BLOCK):
            mask = start + cols < H
            s = tl.load(SOURCE + start + cols, mask=mask, other=0.0).to(tl.float32)
            _write_output(s, cols, mask, mean, correction, rstd, W + start, B + start, Y + start, SLOT + start, FALLBACK, offset,
                          CASTING, HAS_WEIGHT, HAS_BIAS, MEMORY_EFFICIENT)
    if STORE_MEAN:
        tl.store(MEAN + row, mean + correction)
    tl.store(RSTD + row, rstd)


@triton.jit
def _load_xhat(SAVED, cols, mask, mean, rstd, scale, B, SLOT, FALLBACK,
               HAS_BIAS: tl.constexpr, MEMORY_EFFICIENT: tl.constexpr):
    """x̂ for one chunk: (s - mean) * rstd, or (y - b) / W' with unrecoverable columns from FALLBACK."""
    saved = tl.load(SAVED + cols, mask=mask, other=0.0).to(tl.float32)
    if MEMORY_EFFICIENT:
        if HAS_BIAS:
            saved -= tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        slot = tl.load(SLOT + cols, mask=mask, other=-1)
        unrecoverable = slot >= 0
        # Guarded division: those columns take x̂ from the fallback, never from y / 0.
        xhat = saved / tl.where(unrecoverable, 1.0, scale)
        kept = tl.load(FALLBACK + slot, mask=mask & unrecoverable, other=0.0).to(tl.float32)
        xhat = tl.where(unrecoverable, kept, xhat)
    else:
        xhat = (saved - mean) * rstd
    return tl.where(mask, xhat, 0.0)


@triton.jit
def _row_stats(MEAN, RSTD, row, UNCENTERED: tl.constexpr):
    """(mean, rstd) of one row; mean is 0 when x̂ does not need it (RMSNorm, or recovered from y)."""
    if UNCENTERED:
        mean = 0.0
    else:
        mean = tl.load(MEAN + row)
    return mean, tl.load(RSTD + row)


@triton.jit
def _row_scale(held, W, cols, mask, offset, dtype, CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr,
               MEMORY_EFFICIENT: tl.constexpr):
    """W' for one row: the program's ``held`` copy, or in memory_efficient mode read again (from L1/L2).
    There x̂'s recovery also reads the bias and the fallback slots, and a held weight spilled (fp32
    LayerNorm with a residual: 48-72 bytes at 64-128 registers; `python -m memkernels.aot`)."""
    if MEMORY_EFFICIENT:
        held = _load_scale(W, cols, mask, offset, dtype, CASTING, HAS_WEIGHT)
    return held


@triton.jit
def _single_pass_row(row, DY, DRESIDUAL_OUT, SAVED, W, held_scale, B, MEAN, RSTD, SLOT, FALLBACK, DX, H, K, eps,
                     offset, cols, mask, dw_sum, db_sum,
                     IS_RMS: tl.constexpr, CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                     HAS_DRESIDUAL: tl.constexpr, MEMORY_EFFICIENT: tl.constexpr, COMPUTE_DX: tl.constexpr,
                     COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr):
    """One register-resident row of the backward: adds its dy * x̂ and dy to the plain fp32 dw/db
    sums and stores its dx."""
    offs = row * H
    scale = _row_scale(held_scale, W, cols, mask, offset, DY.dtype.element_ty, CASTING, HAS_WEIGHT, MEMORY_EFFICIENT)
    mean, rstd = _row_stats(MEAN, RSTD, row, IS_RMS or MEMORY_EFFICIENT)
    xhat = _load_xhat(SAVED + offs, cols, mask, mean, rstd, scale, B, SLOT, FALLBACK + row * K,
                      HAS_BIAS, MEMORY_EFFICIENT)
    dy = tl.load(DY + offs + cols, mask=mask, other=0.0).to(tl.float32)
    if COMPUTE_DW:
        dw_sum += dy * xhat
    if COMPUTE_DB:
        db_sum += dy
    if COMPUTE_DX:
        g = dy * scale
        mean_g_xhat = tl.sum(g * xhat, axis=0) / H
        inner = g - xhat * mean_g_xhat
        if IS_RMS:
            # One column: inner = g (1 - x̂²), which cancels when x̂² is near 1;
            # there 1 - x̂² = eps rstd² (exactly, in real arithmetic) is the accurate form.
            one_minus_square = tl.where(xhat * xhat > 0.5, eps * rstd * rstd, 1.0 - xhat * xhat)
            inner = tl.where(H == 1, g * one_minus_square, inner)
        else:
            inner -= tl.sum(g, axis=0) / H
        dx = inner * rstd
        if HAS_DRESIDUAL:
            dx += tl.load(DRESIDUAL_OUT + offs + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs + cols, dx.to(DY.dtype.element_ty), mask=mask)
    return dw_sum, db_sum


@triton.jit
def _norm_bwd_kernel(
    DY,            # [M, H] gradient of y
    DRESIDUAL_OUT, # [M, H] gradient of residual_out (read if HAS_DRESIDUAL)
    SAVED,         # [M, H] s (x or residual_out), or y when MEMORY_EFFICIENT
    W,             # [H] weight (read if HAS_WEIGHT)
    B,             # [H] bias (read if HAS_BIAS and MEMORY_EFFICIENT)
    MEAN,          # [M] fp32 (read unless IS_RMS or MEMORY_EFFICIENT)
    RSTD,          # [M] fp32
    SLOT,          # [H] int32 fallback slot per column, -1 where x̂ is recoverable (MEMORY_EFFICIENT)
    FALLBACK,      # [M, K] x̂ at the unrecoverable columns (MEMORY_EFFICIENT)
    DX,            # [M, H] gradient of x (and of residual), DY's dtype (written if COMPUTE_DX)
    DW_PARTIAL,    # [P, H] fp32 per-program sum of dy * x̂ (written if COMPUTE_DW)
    DB_PARTIAL,    # [P, H] fp32 per-program sum of dy (written if COMPUTE_DB)
    ROW_SUMS,      # [M, 2] fp32 scratch: each row's mean of g * x̂ and of g, g = dy * W' (wide rows with COMPUTE_DX)
    M, H, K, eps, offset,
    IS_RMS: tl.constexpr, CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DRESIDUAL: tl.constexpr, MEMORY_EFFICIENT: tl.constexpr, COMPUTE_DX: tl.constexpr,
    COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr, BLOCK: tl.constexpr, SINGLE_PASS: tl.constexpr,
):
    # Program p handles rows p, p + P, p + 2P, ... (at most MAX_ROWS_PER_PROGRAM of them) and owns
    # row p of the partial sums: a fixed reduction order, so dw/db are bitwise deterministic.
    # int64 program id: the row loop below inherits it, so row * H cannot overflow.
    pid = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    dtype = DY.dtype.element_ty
    DW_PARTIAL += pid * H
    DB_PARTIAL += pid * H
    UNCENTERED: tl.constexpr = IS_RMS or MEMORY_EFFICIENT

    if SINGLE_PASS:
        mask = cols < H
        # The weight stays in registers across the program's rows, as in Liger-Kernel's backward
        # (_row_scale: except in memory_efficient mode).
        scale = _load_scale(W, cols, mask, offset, dtype, CASTING, HAS_WEIGHT)
        dw_sum = tl.zeros([BLOCK], tl.float32)
        db_sum = tl.zeros([BLOCK], tl.float32)
        for row in range(pid, M, programs):
            dw_sum, db_sum = _single_pass_row(
                row, DY, DRESIDUAL_OUT, SAVED, W, scale, B, MEAN, RSTD, SLOT, FALLBACK, DX, H, K, eps, offset,
                cols, mask, dw_sum, db_sum, IS_RMS, CASTING, HAS_WEIGHT, HAS_BIAS, HAS_DRESIDUAL, MEMORY_EFFICIENT,
                COMPUTE_DX, COMPUTE_DW, COMPUTE_DB)
        if COMPUTE_DW:
            tl.store(DW_PARTIAL + cols, dw_sum, mask=mask)
        if COMPUTE_DB:
            tl.store(DB_PARTIAL + cols, db_sum, mask=mask)
    else:
        # Wide rows. Pass 1 takes each row's two sums over all its chunks into ROW_SUMS. Pass 2
        # walks the columns chunk by chunk, each chunk over all of this program's rows, so the
        # chunk's weight and dw/db partial sums stay in registers and the sums are written once
        # (a row-by-row pass would read and write the fp32 partial rows once per row). x and dy are
        # read twice.
        if COMPUTE_DX:
            for row in range(pid, M, programs):
                offs = row * H
                mean, rstd = _row_stats(MEAN, RSTD, row, UNCENTERED)
                g_xhat_acc = tl.zeros([BLOCK], tl.float32)
                g_acc = tl.zeros([BLOCK], tl.float32)
                for start in range(0, H, BLOCK):
                    mask = start + cols < H
                    scale = _load_scale(W + start, cols, mask, offset, dtype, CASTING, HAS_WEIGHT)
                    xhat = _load_xhat(SAVED + offs + start, cols, mask, mean, rstd, scale, B + start,
                                      SLOT + start, FALLBACK + row * K, HAS_BIAS, MEMORY_EFFICIENT)
                    g = tl.load(DY + offs + start + cols, mask=mask, other=0.0).to(tl.float32) * scale
                    g_xhat_acc += g * xhat
                    g_acc += g
                tl.store(ROW_SUMS + 2 * row, tl.sum(g_xhat_acc, axis=0) / H)
                tl.store(ROW_SUMS + 2 * row + 1, tl.sum(g_acc, axis=0) / H)
            # The row sums were stored by some threads of this program and are read by others.
            tl.debug_barrier()
        for start in range(0, H, BLOCK):
            mask = start + cols < H
            held_scale = _load_scale(W + start, cols, mask, offset, dtype, CASTING, HAS_WEIGHT)
            dw_sum = tl.zeros([BLOCK], tl.float32)
            db_sum = tl.zeros([BLOCK], tl.float32)
            for row in range(pid, M, programs):
                offs = row * H + start
                scale = _row_scale(held_scale, W + start, cols, mask, offset, dtype, CASTING, HAS_WEIGHT,
                                   MEMORY_EFFICIENT)
                mean, rstd = _row_stats(MEAN, RSTD, row, UNCENTERED)
                xhat = _load_xhat(SAVED + offs, cols, mask, mean, rstd, scale, B + start, SLOT + start,
                                  FALLBACK + row * K, HAS_BIAS, MEMORY_EFFICIENT)
                dy = tl.load(DY + offs + cols, mask=mask, other=0.0).to(tl.float32)
                if COMPUTE_DX:
                    inner = dy * scale - xhat * tl.load(ROW_SUMS + 2 * row)
                    if not IS_RMS:
                        inner -= tl.load(ROW_SUMS + 2 * row + 1)
                    dx = inner * rstd
                    if HAS_DRESIDUAL:
                        dx += tl.load(DRESIDUAL_OUT + offs + cols, mask=mask, other=0.0).to(tl.float32)
                    tl.store(DX + offs + cols, dx.to(dtype), mask=mask)
                if COMPUTE_DW:
                    dw_sum += dy * xhat
                if COMPUTE_DB:
                    db_sum += dy
            if COMPUTE_DW:
                tl.store(DW_PARTIAL + start + cols, dw_sum, mask=mask)
            if COMPUTE_DB:
                tl.store(DB_PARTIAL + start + cols, db_sum, mask=mask)


@triton.jit
def _sum_partials(PARTIAL, OUT, programs, H, cols, BLOCK_P: tl.constexpr):
    """OUT[cols] = sum over programs of the partial rows, in float64, rounded to fp32 and then to OUT's dtype."""
    total = tl.zeros([BLOCK_P, cols.shape[0]], tl.float64)
    for first in range(0, programs, BLOCK_P):
        program = (first + tl.arange(0, BLOCK_P)).to(tl.int64)
        mask = (program < programs)[:, None] & (cols < H)[None, :]
        total += tl.load(PARTIAL + program[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float64)
    result = tl.sum(total, axis=0).to(tl.float32)
    tl.store(OUT + cols, result.to(OUT.dtype.element_ty), mask=cols < H)


@triton.jit
def _norm_reduce_partials_kernel(
    DW_PARTIAL,  # [P, H] fp32 per-program sums of dy * x̂ (read if COMPUTE_DW)
    DB_PARTIAL,  # [P, H] fp32, the same for dy (read if COMPUTE_DB)
    DW,          # [H] weight gradient, the weight's dtype (written if COMPUTE_DW)
    DB,          # [H] bias gradient, the bias's dtype (written if COMPUTE_DB)
    programs, H,
    COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # One launch for dw and db, in a fixed order (bitwise deterministic). The sums are taken in
    # float64 (P * H elements: little work beside the backward's M * H) and each result is
    # rounded to fp32 once: the programs' own sums are then the only fp32 sums.
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    if COMPUTE_DW:
        _sum_partials(DW_PARTIAL, DW, programs, H, cols, BLOCK_P)
    if COMPUTE_DB:
        _sum_partials(DB_PARTIAL, DB, programs, H, cols, BLOCK_P)


def _launch_config(hidden, max_block, elements_per_warp):
    """(BLOCK, num_warps, SINGLE_PASS) for rows of ``hidden`` elements."""
    block = min(1 << (hidden - 1).bit_length(), max_block)  # next power of 2; triton's costs ~1.5 us a call
    num_warps = min(max(block // elements_per_warp, 1), 32)
    return block, num_warps, hidden <= max_block


def _forward_config(hidden):
    """(BLOCK, num_warps, SINGLE_PASS) of the forward: FWD_SMALL_ELEMENTS_PER_WARP elements a warp up
    to 4 warps (rows to 1024), FWD_ELEMENTS_PER_WARP past them. Rows wider than FWD_MAX_BLOCK loop
    at FWD_SMALL_ELEMENTS_PER_WARP (32 warps): LayerNorm's loop spills 8-32 bytes at 8 warps."""
    block, num_warps, single_pass = _launch_config(hidden, FWD_MAX_BLOCK, FWD_SMALL_ELEMENTS_PER_WARP)
    if single_pass:
        num_warps = max(min(num_warps, block // FWD_ELEMENTS_PER_WARP), min(num_warps, 4))
    return block, num_warps, single_pass


def backward_config(hidden):
    """(BLOCK, num_warps, SINGLE_PASS) of the backward. Rows whose width is a multiple of 16 (the JIT
    then knows every row 16-byte aligned, and loads vectorize): Liger-Kernel's warps (4 below 2048
    elements, 8 up to 4096, 16 at 8192), one block per row up to BWD_MAX_BLOCK, wider rows in chunks
    of BWD_CHUNK. Other widths: BWD_UNALIGNED_ELEMENTS_PER_WARP, one block up to BWD_CHUNK, wider rows
    in chunks. Where the installed triton spills rows wider than BWD_CHUNK (not WIDE_BACKWARD_ROWS_FIT),
    they go in chunks too. Neither a bias gradient nor memory_efficient changes the shape."""
    aligned = hidden % 16 == 0
    widest = BWD_MAX_BLOCK if aligned and WIDE_BACKWARD_ROWS_FIT else BWD_CHUNK
    single_pass = hidden <= widest
    block = 1 << (hidden - 1).bit_length() if single_pass else BWD_CHUNK  # next power of 2 (triton's: ~1.5 us)
    if aligned:
        num_warps = 4 if block < 2048 else 8 if block <= 4096 and single_pass else 16
    else:
        num_warps = min(max(block // BWD_UNALIGNED_ELEMENTS_PER_WARP, 1), 32)
    return block, num_warps, single_pass


def _register_cap(num_warps):
    """Registers per thread that a backward block of ``num_warps`` may use: the SM's 65536 over the
    threads of the programs_per_sm blocks that share it (at most 255). Without the cap ptxas for
    sm_90 budgets half of that at 16 and 32 warps, and spills."""
    return min(65536 // (32 * num_warps * programs_per_sm(num_warps)), 255)


# Launches (and AOT variants) compile without floating-point contraction: a * b + c stays a rounded
# multiply and an add, as in the Triton interpreter where the accuracy tests run. On the H200 a
# contracted g * w - mean(g * w) kept the product's rounding error and left 3.9e-6 in a LayerNorm dx
# that is exactly 0 (docs/gpu-runs.md). The kernels are bound by memory: the FMAs they give up cost
# no time.
_LAUNCH_OPTIONS = {"enable_fp_fusion": False}


def _slots(unsafe_cols, hidden, device):
    """[H] int32: fallback slot of each unrecoverable column, -1 elsewhere."""
    slot = torch.full((hidden,), -1, dtype=torch.int32, device=device)
    slot[unsafe_cols.to(device)] = torch.arange(unsafe_cols.numel(), dtype=torch.int32, device=device)
    return slot


@on_tensor_device
def norm_forward(x, residual, weight, bias, eps, offset, is_rms, casting, memory_efficient, unsafe_cols):
    """Triton forward on [M, H] contiguous tensors; same contract as reference.norm_forward."""
    rows, hidden = x.shape
    block, num_warps, single_pass = _forward_config(hidden)
    y = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else None
    store_mean = not is_rms and not memory_efficient
    mean = torch.empty(rows, dtype=torch.float32, device=x.device) if store_mean else None
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    fallback = slot = None
    if memory_efficient:
        fallback = torch.empty((rows, unsafe_cols.numel()), dtype=x.dtype, device=x.device)
        slot = _slots(unsafe_cols, hidden, x.device)
    if not rows:
        return y, residual_out, mean, rstd, fallback
    # Pointer arguments a variant never dereferences get a tensor of their dtype the launch has anyway:
    # an allocation per launch costs host time (under cProfile on the H200 each took 5-7 us), and one kept
    # across calls would outlive the op in memory meters and the allocator's statistics.
    unused, unused32 = y, rstd
    _norm_fwd_kernel[(rows,)](
        x, residual if residual is not None else unused, residual_out if residual is not None else unused,
        weight if weight is not None else unused, bias if bias is not None else unused, y,
        mean if store_mean else unused32, rstd,
        slot if memory_efficient else unused32, fallback if memory_efficient and fallback.numel() else unused,
        hidden, unsafe_cols.numel() if memory_efficient else 0, eps, offset,
        IS_RMS=is_rms, CASTING=casting, HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None, STORE_MEAN=store_mean, MEMORY_EFFICIENT=memory_efficient,
        BLOCK=block, SINGLE_PASS=single_pass, num_warps=num_warps, **_LAUNCH_OPTIONS,
    )
    return y, residual_out, mean, rstd, fallback


def programs_per_sm(num_warps):
    """Backward programs resident per SM: two blocks of up to 8 warps (_register_cap holds them to 128
    registers a thread; the H200's fastest RMSNorm 4096 backward ran 8 warps, 2 per SM), one of 16 or
    more (a 16-warp block of 8192 takes 102-128 registers: a second would wait for the first, in a
    second wave, and double the dw/db partial rows written and read; on the H200, one 32-warp block
    per SM took the reduction from 10 to 4 us, docs/gpu-runs.md)."""
    return 1 if num_warps >= 16 else 2


def num_programs(rows, device, num_warps):
    """Backward programs: the programs the GPU holds at once (programs_per_sm per SM; under the
    interpreter a few, so that each program still sums several rows as it does on a GPU), times as
    many waves as keep each program's share at most MAX_ROWS_PER_PROGRAM rows; never more than rows."""
    if device.type == "cuda":
        resident = programs_per_sm(num_warps) * _multiprocessors(device.index)
    else:
        resident = INTERPRETER_PROGRAMS
    return min(rows, resident * cdiv(rows, resident * MAX_ROWS_PER_PROGRAM))


@functools.lru_cache(maxsize=None)
def _multiprocessors(index):
    """SMs of CUDA device ``index`` (asked once: get_device_properties costs microseconds a call)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@on_tensor_device
def norm_backward(dy, dresidual_out, saved, mean, rstd, weight, bias, eps, offset, is_rms, casting,
                  memory_efficient, unsafe_cols, fallback, needs_dx, needs_dw, needs_db, dx_out=None):
    """Triton backward on [M, H] contiguous tensors; same contract as reference.norm_backward.

    ``dx_out`` may be dy itself: every program reads a row chunk of dy before writing dx there.
    """
    rows, hidden = dy.shape
    block, num_warps, single_pass = backward_config(hidden)
    programs = max(num_programs(rows, dy.device, num_warps), 1)
    dx = (torch.empty_like(dy) if dx_out is None else dx_out) if needs_dx else None
    dw = torch.empty_like(weight) if needs_dw else None
    db = torch.empty_like(bias) if needs_db else None
    if not rows:  # no row: zero gradients for the parameters
        return dx, dw.zero_() if needs_dw else None, db.zero_() if needs_db else None
    # Every program writes all of its partial row: no zero fill.
    dw_partial = torch.empty((programs, hidden), dtype=torch.float32, device=dy.device) if needs_dw else None
    db_partial = torch.empty((programs, hidden), dtype=torch.float32, device=dy.device) if needs_db else None
    row_sums = torch.empty((rows, 2), dtype=torch.float32, device=dy.device) if needs_dx and not single_pass else None
    unused, unused32 = dy, rstd  # never dereferenced (see norm_forward)
    slot = _slots(unsafe_cols, hidden, dy.device) if memory_efficient else None
    _norm_bwd_kernel[(programs,)](
        dy, dresidual_out if dresidual_out is not None else unused, saved,
        weight if weight is not None else unused, bias if bias is not None else unused,
        mean if mean is not None else unused32, rstd,
        slot if slot is not None else unused32, fallback if fallback is not None and fallback.numel() else unused,
        dx if needs_dx else unused, dw_partial if needs_dw else unused32, db_partial if needs_db else unused32,
        row_sums if row_sums is not None else unused32,
        rows, hidden, unsafe_cols.numel() if memory_efficient else 0, eps, offset,
        IS_RMS=is_rms, CASTING=casting, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        HAS_DRESIDUAL=dresidual_out is not None, MEMORY_EFFICIENT=memory_efficient,
        COMPUTE_DX=needs_dx, COMPUTE_DW=needs_dw, COMPUTE_DB=needs_db,
        BLOCK=block, SINGLE_PASS=single_pass, num_warps=num_warps, maxnreg=_register_cap(num_warps),
        **_LAUNCH_OPTIONS,
    )
    if needs_dw or needs_db:
        _norm_reduce_partials_kernel[(cdiv(hidden, REDUCE_BLOCK_H),)](
            dw_partial if needs_dw else unused32, db_partial if needs_db else unused32,
            dw if needs_dw else unused, db if needs_db else unused, programs, hidden,
            COMPUTE_DW=needs_dw, COMPUTE_DB=needs_db, BLOCK_P=REDUCE_BLOCK_P, BLOCK_H=REDUCE_BLOCK_H,
            num_warps=REDUCE_WARPS, **_LAUNCH_OPTIONS,
        )
    return dx, dw, db


def _aot_variants():
    """Launch variants for memkernels.aot, for every dtype and both norms as drop-ins use them (plain,
    weights in x's dtype or fp32) and feature-heavy combinations (residual, memory_efficient, casting
    modes). The forward: its widest register-resident row ("single", 8192) and looping rows ("loop",
    16384). The backward: rows a multiple of 16 wide, compiled as the JIT specializes them ("aligned":
    vectorized loads) at 4096 (8 warps), 8192 (16) and looping (16384: chunks of 4096, 8 warps), and
    other widths ("odd": 4095, 32 warps, and 8191, chunks of 4096)."""
    short = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    single, loop = FWD_MAX_BLOCK, 2 * BWD_MAX_BLOCK
    params = [(dtype, param_dtype) for dtype in short for param_dtype in dict.fromkeys((dtype, torch.float32))]
    # (dtype, param dtype, is_rms, casting, residual, weight, bias, memory_efficient, hidden)
    plain = [(dtype, param_dtype, is_rms, 1 if is_rms else 2, False, True, not is_rms, False, hidden)
             for dtype, param_dtype in params for is_rms in (True, False)
             for hidden in (BWD_CHUNK, single, loop, BWD_CHUNK - 1, single - 1)]
    features = [
        (torch.bfloat16, torch.bfloat16, True, 1, True, True, False, False, single),
        (torch.bfloat16, torch.bfloat16, True, 1, False, True, False, True, single),
        (torch.bfloat16, torch.bfloat16, False, 2, True, True, True, False, single),
        (torch.bfloat16, torch.bfloat16, False, 2, True, True, True, True, single - 16),  # backward only
        (torch.bfloat16, torch.bfloat16, False, 2, True, True, True, True, loop),
        (torch.bfloat16, torch.bfloat16, True, 0, True, True, False, False, loop),
        (torch.bfloat16, torch.float32, True, 1, True, True, False, True, loop),
        (torch.float16, torch.float16, False, 2, False, True, True, True, single),
        (torch.float16, torch.float16, False, 2, True, True, True, True, BWD_CHUNK),
        (torch.float16, torch.float16, False, 2, True, True, True, True, BWD_CHUNK - 1),
        (torch.float32, torch.float32, True, 2, True, True, False, False, single),
        (torch.float32, torch.float32, False, 2, True, True, True, True, single - 16),  # backward only
        (torch.float32, torch.float32, False, 2, True, True, True, True, loop),
        (torch.float32, torch.float32, False, 2, True, True, True, True, single - 1),
    ]
    forward, backward = [], []
    for dtype, param_dtype, is_rms, casting, residual, weight, bias, memory_efficient, hidden in plain + features:
        t, p = "*" + short[dtype], "*" + short[param_dtype]
        label = (f"{short[dtype]}{'' if param_dtype == dtype else '-w' + short[param_dtype]}"
                 f"-{'rms' if is_rms else 'ln'}-{['none', 'llama', 'gemma'][casting]}"
                 f"{'-residual' if residual else ''}{'-meff' if memory_efficient else ''}")
        common = {"IS_RMS": is_rms, "CASTING": casting, "HAS_WEIGHT": weight, "HAS_BIAS": bias,
                  "MEMORY_EFFICIENT": memory_efficient}
        if hidden in (single, loop):
            block, num_warps, single_pass = _forward_config(hidden)
            forward.append({
                "signature": {"X": t, "RESIDUAL": t, "RESIDUAL_OUT": t, "W": p, "B": p, "Y": t, "MEAN": "*fp32",
                              "RSTD": "*fp32", "SLOT": "*i32", "FALLBACK": t, "H": "i32", "K": "i32",
                              "eps": "fp32", "offset": "fp32"},
                "constexprs": {**common, "SINGLE_PASS": single_pass, "HAS_RESIDUAL": residual,
                               "STORE_MEAN": not is_rms and not memory_efficient, "BLOCK": block},
                "num_warps": num_warps, "num_stages": 1, "options": dict(_LAUNCH_OPTIONS),
                "label": f"{label}-{'single' if single_pass else 'loop'}{block}"})
        block, num_warps, single_pass = backward_config(hidden)
        aligned = hidden % 16 == 0
        signature = {"DY": t, "DRESIDUAL_OUT": t, "SAVED": t, "W": p, "B": p, "MEAN": "*fp32", "RSTD": "*fp32",
                     "SLOT": "*i32", "FALLBACK": t, "DX": t, "DW_PARTIAL": "*fp32", "DB_PARTIAL": "*fp32",
                     "ROW_SUMS": "*fp32", "M": "i32", "H": "i32", "K": "i32", "eps": "fp32", "offset": "fp32"}
        backward.append({
            "signature": signature,
            "constexprs": {**common, "SINGLE_PASS": single_pass, "HAS_DRESIDUAL": residual, "COMPUTE_DX": True,
                           "COMPUTE_DW": weight, "COMPUTE_DB": bias, "BLOCK": block},
            "num_warps": num_warps, "num_stages": 1,
            "options": {"maxnreg": _register_cap(num_warps), **_LAUNCH_OPTIONS},
            # The JIT's specialization of a row width that is a multiple of 16: every pointer 16-byte aligned.
            "aligned": [name for name, kind in signature.items() if kind.startswith("*")] + ["H"] if aligned else [],
            "label": f"{label}-{'aligned' if aligned else 'odd'}-{'single' if single_pass else 'loop'}{block}"})
    reduce = [
        {"signature": {"DW_PARTIAL": "*fp32", "DB_PARTIAL": "*fp32", "DW": p, "DB": p, "programs": "i32", "H": "i32"},
         "constexprs": {"COMPUTE_DW": True, "COMPUTE_DB": bias, "BLOCK_P": REDUCE_BLOCK_P, "BLOCK_H": REDUCE_BLOCK_H},
         "num_warps": REDUCE_WARPS, "num_stages": 1, "options": dict(_LAUNCH_OPTIONS),
         "label": f"{name}-{'dw-db' if bias else 'dw'}"}
        for p, name in (("*fp32", "fp32"), ("*bf16", "bf16"), ("*fp16", "fp16")) for bias in (False, True)
    ]
    return forward, backward, reduce


_FORWARD_VARIANTS, _BACKWARD_VARIANTS, _REDUCE_VARIANTS = _aot_variants()
aot.register(_norm_fwd_kernel, name="norm_fwd", variants=_FORWARD_VARIANTS)
aot.register(_norm_bwd_kernel, name="norm_bwd", variants=_BACKWARD_VARIANTS)
aot.register(_norm_reduce_partials_kernel, name="norm_reduce_partials", variants=_REDUCE_VARIANTS)
