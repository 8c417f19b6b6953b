"""Triton kernels shared by RMSNorm and LayerNorm (plain and with fused residual add).

One forward and one backward kernel serve both norms (IS_RMS), as in
flash-attention's layer_norm.py; memkernels/fusions/norm/reference.py is the spec.
Order: helpers → kernels → launchers. The autograd and custom-op layer is
memkernels/fusions/norm/op.py.

Rows are [M, H] contiguous. A row that fits in one block is held in registers
(the input is read once); a wider row is walked in block-sized chunks, once per
reduction and once more to write. The backward runs a fixed number of
programs, each over a strided set of rows, keeping its dw/db partial sums in
registers (for wide rows, one column chunk at a time over all its rows) and
writing them once to its own row of an fp32 buffer, which a second kernel
reduces in a fixed order (no atomics: deterministic). The sums are
compensated (Kahan): a program adds up M / P rows one after another, and a
plain fp32 running sum would lose a few ulps more than eager PyTorch's
pairwise reduction. Where the compensations do not fit in registers beside
the row (LayerNorm's dw and db at 4096 < H <= 8192), a program keeps plain
sums of groups of BWD_GROUP_ROWS of its rows and folds each group into its
compensated partial row in memory: a plain sum of at most 32 terms, then
Kahan across groups. To fit, it takes the row's two sums, drops the row and
reads it again for dx (from L1/L2: HBM sees the row once, where the chunked
walk of wider rows reads it twice). memory_efficient mode's x̂ recovery still
spills there, so it keeps the chunked walk.
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
# looping rows; 16384 spills in LayerNorm). Backward, which also carries dy, x̂ and the
# compensated dw (and db) accumulators: 8192 with 32 warps without a bias
# gradient (RMSNorm: 62-64 registers, the most 32 warps allow), 4096 with one
# (LayerNorm at 8192 spills 36-180 bytes with 32 warps, the most a block has). LayerNorm rows of
# 4096 < H <= 8192 keep plain group sums in registers instead (BWD_GROUP_ROWS rows a group): 64
# registers, no spills, except memory_efficient (120-208 bytes), which loops.
# Wider rows loop over chunks of 4096 (the loop at 8192 spills 400-700 bytes on sm_90).
# Warps per row, measured on the H200 (docs/gpu-runs.md, 2026-11-26 second run): the forward at
# 1024 elements a warp past 4 warps (4 warps at 4096, 8 at 8192; 256 a warp below) took a bf16
# [8192, 4096] RMSNorm from 40 to 33 us and [8192, 8192] from 93 to 65 (LayerNorm 50 -> 36,
# 112 -> 72; float32 within 2 us) against 256 a warp, where each thread held 8 elements of a row:
# one 16-byte load in flight of a 16-bit row (32 bytes of a float32 one), against 4 now, and the
# row's sums reduced across 16-32 warps. The backward stays at 128 a warp: 16-bit rows at 256
# (16 warps at 4096) were 7-10 us faster on the H200, but spill 8-12 bytes on sm_90 at 16 warps'
# 128-register cap (LayerNorm with a residual, looping rows).
FWD_MAX_BLOCK, FWD_ELEMENTS_PER_WARP, FWD_SMALL_ELEMENTS_PER_WARP = 8192, 1024, 256
BWD_MAX_BLOCK, BWD_MAX_BLOCK_WITH_DB, BWD_ELEMENTS_PER_WARP = 8192, 4096, 128


def _wide_backward_rows_fit(triton_version):
    """Whether this triton holds the backward's rows of BWD_MAX_BLOCK in registers. Triton 3.7 (the
    version torch 2.13's CUDA wheels pin) spills them where 3.6, 3.8 and 3.9 do not: 240-984
    bytes a thread at 32 warps (64 registers), more at 16 or 8 warps (128, 255 registers); its rows
    of 4096 fit (`python -m memkernels.aot` under triton 3.7.1). There rows wider than
    BWD_MAX_BLOCK_WITH_DB loop over chunks of it instead: x and dy are read twice."""
    return not triton_version.startswith("3.7.")


WIDE_BACKWARD_ROWS_FIT = _wide_backward_rows_fit(triton.__version__)
# Rows per group: one group per program at 8192 tokens on an H100 (31 rows each), so the fold
# costs no read there; on longer batches each further group reads and writes the program's
# partial rows once (4 x H x 4 bytes), against 32 rows of x and dy that a second pass would read.
BWD_GROUP_ROWS = 32
# The dw/db reduction: programs of BLOCK_H columns (coalesced 128-byte rows of the partials;
# 128 programs at H = 4096), each summing BLOCK_P partial rows per step.
REDUCE_BLOCK_P, REDUCE_BLOCK_H, REDUCE_WARPS = 32, 32, 4


@triton.jit
def _round(value, dtype):
    """Cast fp32 ``value`` to ``dtype`` (round to nearest) and back to fp32: a rounding point."""
    return value.to(dtype).to(tl.float32)


@triton.jit
def _load_scale(W, cols, mask, offset, dtype, CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                RELOAD: tl.constexpr = False):
    """W' = offset + w in fp32 ([BLOCK]); 1 without a weight; rounded to dtype in casting "none".
    RELOAD: a second read of the same bytes that the compiler must not merge with the first."""
    if HAS_WEIGHT:
        scale = tl.load(W + cols, mask=mask, other=1.0, volatile=RELOAD).to(tl.float32) + offset
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
def _kahan_add(total, compensation, term):
    """total + term with the rounding error carried in ``compensation`` (total - compensation is the sum)."""
    corrected = term - compensation
    new_total = total + corrected
    return new_total, (new_total - total) - corrected


@triton.jit
def _load_xhat(SAVED, cols, mask, mean, rstd, scale, B, SLOT, FALLBACK,
               HAS_BIAS: tl.constexpr, MEMORY_EFFICIENT: tl.constexpr, RELOAD: tl.constexpr = False):
    """x̂ for one chunk: (s - mean) * rstd, or (y - b) / W' with unrecoverable columns from FALLBACK."""
    saved = tl.load(SAVED + cols, mask=mask, other=0.0, volatile=RELOAD).to(tl.float32)
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
def _fold_group(PARTIAL, group, cols, mask, H, first):
    """Add a group's plain sum into a program's compensated partial row ([2, H]: sum, compensation);
    the program's first group writes it (no read, no zero fill)."""
    if first:
        tl.store(PARTIAL + cols, group, mask=mask)
        tl.store(PARTIAL + H + cols, tl.zeros_like(group), mask=mask)
    else:
        total, compensation = _kahan_add(tl.load(PARTIAL + cols, mask=mask, other=0.0),
                                         tl.load(PARTIAL + H + cols, mask=mask, other=0.0), group)
        tl.store(PARTIAL + cols, total, mask=mask)
        tl.store(PARTIAL + H + cols, compensation, mask=mask)


@triton.jit
def _row_stats(MEAN, RSTD, row, UNCENTERED: tl.constexpr):
    """(mean, rstd) of one row; mean is 0 when x̂ does not need it (RMSNorm, or recovered from y)."""
    if UNCENTERED:
        mean = 0.0
    else:
        mean = tl.load(MEAN + row)
    return mean, tl.load(RSTD + row)


@triton.jit
def _single_pass_row(row, DY, DRESIDUAL_OUT, SAVED, W, B, MEAN, RSTD, SLOT, FALLBACK, DX, H, K, eps, offset,
                     cols, mask, dw_sum, dw_comp, db_sum, db_comp,
                     IS_RMS: tl.constexpr, CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                     HAS_DRESIDUAL: tl.constexpr, MEMORY_EFFICIENT: tl.constexpr, COMPUTE_DX: tl.constexpr,
                     COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr, COMPENSATED: tl.constexpr):
    """One register-resident row of the backward: adds its dy * x̂ and dy to the dw/db sums (Kahan
    when COMPENSATED, else plain; the compensations are passed through) and stores its dx."""
    offs = row * H
    dtype = DY.dtype.element_ty
    # The weight is read again for every row (from L1/L2): holding it across rows costs
    # BLOCK / threads registers, which the widest single-pass block cannot spare.
    scale = _load_scale(W, cols, mask, offset, dtype, CASTING, HAS_WEIGHT)
    mean, rstd = _row_stats(MEAN, RSTD, row, IS_RMS or MEMORY_EFFICIENT)
    xhat = _load_xhat(SAVED + offs, cols, mask, mean, rstd, scale, B, SLOT, FALLBACK + row * K,
                      HAS_BIAS, MEMORY_EFFICIENT)
    dy = tl.load(DY + offs + cols, mask=mask, other=0.0).to(tl.float32)
    # dw and db first: dy is then dead across the row sums below (fewer live registers).
    if COMPUTE_DW:
        if COMPENSATED:
            dw_sum, dw_comp = _kahan_add(dw_sum, dw_comp, dy * xhat)
        else:
            dw_sum += dy * xhat
    if COMPUTE_DB:
        if COMPENSATED:
            db_sum, db_comp = _kahan_add(db_sum, db_comp, dy)
        else:
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
        elif COMPENSATED:
            inner -= tl.sum(g, axis=0) / H
        else:
            # Group sums hold no compensations, yet the row and two sums barely fit: take the
            # sums, drop the row, and read it again (from L1) for dx.
            mean_g = tl.sum(g, axis=0) / H
            scale = _load_scale(W, cols, mask, offset, dtype, CASTING, HAS_WEIGHT, True)
            xhat = _load_xhat(SAVED + offs, cols, mask, mean, rstd, scale, B, SLOT, FALLBACK + row * K,
                              HAS_BIAS, MEMORY_EFFICIENT, True)
            g = tl.load(DY + offs + cols, mask=mask, other=0.0, volatile=True).to(tl.float32) * scale
            inner = g - xhat * mean_g_xhat - mean_g
        dx = inner * rstd
        if HAS_DRESIDUAL:
            dx += tl.load(DRESIDUAL_OUT + offs + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs + cols, dx.to(dtype), mask=mask)
    return dw_sum, dw_comp, db_sum, db_comp


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
    DW_PARTIAL,    # [P, 2, H] fp32 per-program Kahan sum and compensation of dy * x̂ (if COMPUTE_DW)
    DB_PARTIAL,    # [P, 2, H] fp32 per-program Kahan sum and compensation of dy (if COMPUTE_DB)
    ROW_SUMS,      # [M, 2] fp32 scratch: each row's mean of g * x̂ and of g, g = dy * W' (wide rows with COMPUTE_DX)
    M, H, K, eps, offset,
    IS_RMS: tl.constexpr, CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DRESIDUAL: tl.constexpr, MEMORY_EFFICIENT: tl.constexpr, COMPUTE_DX: tl.constexpr,
    COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr, BLOCK: tl.constexpr, SINGLE_PASS: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
):
    # Program p handles rows p, p + P, p + 2P, ... and owns row p of the partial
    # sums: a fixed reduction order, so dw/db are bitwise deterministic.
    # int64 program id: the row loop below inherits it, so row * H cannot overflow.
    pid = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    dtype = DY.dtype.element_ty
    DW_PARTIAL += pid * 2 * H
    DB_PARTIAL += pid * 2 * H
    UNCENTERED: tl.constexpr = IS_RMS or MEMORY_EFFICIENT

    if SINGLE_PASS:
        mask = cols < H
        if GROUP_ROWS == 0:
            dw_sum = tl.zeros([BLOCK], tl.float32)
            dw_comp = tl.zeros([BLOCK], tl.float32)
            db_sum = tl.zeros([BLOCK], tl.float32)
            db_comp = tl.zeros([BLOCK], tl.float32)
            for row in range(pid, M, programs):
                dw_sum, dw_comp, db_sum, db_comp = _single_pass_row(
                    row, DY, DRESIDUAL_OUT, SAVED, W, B, MEAN, RSTD, SLOT, FALLBACK, DX, H, K, eps, offset,
                    cols, mask, dw_sum, dw_comp, db_sum, db_comp, IS_RMS, CASTING, HAS_WEIGHT, HAS_BIAS,
                    HAS_DRESIDUAL, MEMORY_EFFICIENT, COMPUTE_DX, COMPUTE_DW, COMPUTE_DB, True)
            if COMPUTE_DW:
                tl.store(DW_PARTIAL + cols, dw_sum, mask=mask)
                tl.store(DW_PARTIAL + H + cols, dw_comp, mask=mask)
            if COMPUTE_DB:
                tl.store(DB_PARTIAL + cols, db_sum, mask=mask)
                tl.store(DB_PARTIAL + H + cols, db_comp, mask=mask)
        else:
            # Plain sums over GROUP_ROWS of this program's rows, each group folded into the
            # program's compensated partial row in memory (the compensations need no registers).
            stride = programs * GROUP_ROWS
            for first in range(pid, M, stride):
                dw_sum = tl.zeros([BLOCK], tl.float32)
                db_sum = tl.zeros([BLOCK], tl.float32)
                for row in range(first, tl.minimum(first + stride, M), programs):
                    dw_sum, no_comp, db_sum, no_comp = _single_pass_row(
                        row, DY, DRESIDUAL_OUT, SAVED, W, B, MEAN, RSTD, SLOT, FALLBACK, DX, H, K, eps, offset,
                        cols, mask, dw_sum, 0.0, db_sum, 0.0, IS_RMS, CASTING, HAS_WEIGHT, HAS_BIAS,
                        HAS_DRESIDUAL, MEMORY_EFFICIENT, COMPUTE_DX, COMPUTE_DW, COMPUTE_DB, False)
                if COMPUTE_DW:
                    _fold_group(DW_PARTIAL, dw_sum, cols, mask, H, first == pid)
                if COMPUTE_DB:
                    _fold_group(DB_PARTIAL, db_sum, cols, mask, H, first == pid)
    else:
        # Wide rows. Pass 1 takes each row's two sums over all its chunks into ROW_SUMS. Pass 2
        # walks the columns chunk by chunk, each chunk over all of this program's rows, so the
        # chunk's dw/db partial sums stay in registers and are written once (a row-by-row pass
        # would read and write the fp32 partial rows once per row). x and dy are read twice.
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
            dw_sum = tl.zeros([BLOCK], tl.float32)
            dw_comp = tl.zeros([BLOCK], tl.float32)
            db_sum = tl.zeros([BLOCK], tl.float32)
            db_comp = tl.zeros([BLOCK], tl.float32)
            for row in range(pid, M, programs):
                offs = row * H + start
                scale = _load_scale(W + start, cols, mask, offset, dtype, CASTING, HAS_WEIGHT)  # per row, as above
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
                    dw_sum, dw_comp = _kahan_add(dw_sum, dw_comp, dy * xhat)
                if COMPUTE_DB:
                    db_sum, db_comp = _kahan_add(db_sum, db_comp, dy)
            if COMPUTE_DW:
                tl.store(DW_PARTIAL + start + cols, dw_sum, mask=mask)
                tl.store(DW_PARTIAL + H + start + cols, dw_comp, mask=mask)
            if COMPUTE_DB:
                tl.store(DB_PARTIAL + start + cols, db_sum, mask=mask)
                tl.store(DB_PARTIAL + H + start + cols, db_comp, mask=mask)


@triton.jit
def _sum_partials(PARTIAL, OUT, programs, H, cols, BLOCK_P: tl.constexpr):
    """OUT[cols] = sum over programs of (sum - compensation), in float64, rounded to fp32 and then to OUT's dtype."""
    total = tl.zeros([BLOCK_P, cols.shape[0]], tl.float64)
    for first in range(0, programs, BLOCK_P):
        program = (first + tl.arange(0, BLOCK_P)).to(tl.int64)
        mask = (program < programs)[:, None] & (cols < H)[None, :]
        offsets = program[:, None] * 2 * H + cols[None, :]
        total += (tl.load(PARTIAL + offsets, mask=mask, other=0.0).to(tl.float64)
                  - tl.load(PARTIAL + H + offsets, mask=mask, other=0.0).to(tl.float64))
    result = tl.sum(total, axis=0).to(tl.float32)
    tl.store(OUT + cols, result.to(OUT.dtype.element_ty), mask=cols < H)


@triton.jit
def _norm_reduce_partials_kernel(
    DW_PARTIAL,  # [P, 2, H] fp32 per-program Kahan (sum, compensation) of dy * x̂ (read if COMPUTE_DW)
    DB_PARTIAL,  # [P, 2, H] fp32, the same for dy (read if COMPUTE_DB)
    DW,          # [H] weight gradient, the weight's dtype (written if COMPUTE_DW)
    DB,          # [H] bias gradient, the bias's dtype (written if COMPUTE_DB)
    programs, H,
    COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # One launch for dw and db, in a fixed order (bitwise deterministic). The sums are taken in
    # float64 (P * H elements: negligible work) so that sum - compensation keeps its extra
    # precision and each result is rounded to fp32 once.
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


def backward_config(hidden, with_db, memory_efficient=False):
    """(BLOCK, num_warps, SINGLE_PASS, GROUP_ROWS) of the backward: one block per row up to its widest
    spill-free block (with a bias gradient past BWD_MAX_BLOCK_WITH_DB: group sums, GROUP_ROWS > 0,
    except in memory_efficient mode, whose x̂ recovery spills there), else chunks of BWD_MAX_BLOCK_WITH_DB.
    Where the installed triton spills wider rows (not WIDE_BACKWARD_ROWS_FIT), every row wider than
    BWD_MAX_BLOCK_WITH_DB goes in chunks."""
    wide_in_registers = WIDE_BACKWARD_ROWS_FIT and BWD_MAX_BLOCK_WITH_DB < hidden <= BWD_MAX_BLOCK
    grouped = wide_in_registers and with_db and not memory_efficient
    if hidden <= BWD_MAX_BLOCK_WITH_DB or (wide_in_registers and not with_db) or grouped:
        block, num_warps, _ = _launch_config(hidden, BWD_MAX_BLOCK, BWD_ELEMENTS_PER_WARP)
        return block, num_warps, True, BWD_GROUP_ROWS if grouped else 0
    block, num_warps, _ = _launch_config(BWD_MAX_BLOCK_WITH_DB, BWD_MAX_BLOCK_WITH_DB, BWD_ELEMENTS_PER_WARP)
    return block, num_warps, False, 0


def _register_cap(num_warps):
    """Registers per thread that one block of ``num_warps`` may use: the SM's 65536 over its threads
    (at most 255). Without the cap ptxas for sm_90 budgets half of that for the backward kernel at
    16 and 32 warps, and spills."""
    return min(65536 // (32 * num_warps), 255)


# Launches (and AOT variants) compile without floating-point contraction: a * b + c stays a rounded
# multiply and an add, as in the Triton interpreter where the accuracy tests run. On the H200 a
# contracted g * w - mean(g * w) kept the product's rounding error and left 3.9e-6 in a LayerNorm dx
# that is exactly 0 (docs/gpu-runs.md). The kernels are bound by memory: the FMAs they give up cost
# no time. One exception: LayerNorm's group-sum rows (GROUP_ROWS > 0) keep contraction, without
# which their 16-bit variants spill 8-16 B on sm_90 at the 64-register cap of 32 warps.
_LAUNCH_OPTIONS = {"enable_fp_fusion": False}


def _backward_options(group_rows):
    """The backward launch's compile options: _LAUNCH_OPTIONS, except for group-sum rows."""
    return {} if group_rows else _LAUNCH_OPTIONS


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
    """Backward programs per SM: as many as can be resident at once, at most two. A block of 32 warps
    (rows from 4096 up) is alone on its SM: two of its 1024 threads' blocks would need at most 32
    registers a thread, and the backward uses 40-64. A second program per SM would only run after
    the first, in a second wave, and double the dw/db partial rows written and read (on the H200,
    one per SM took the dw/db reduction from 10 to 4 us and the step 5-14 us down, docs/gpu-runs.md)."""
    return 1 if num_warps >= 32 else 2


def num_programs(rows, device, num_warps):
    """Backward programs: programs_per_sm per SM on a GPU; under the interpreter a few, so that
    each program still sums several rows as it does on a GPU."""
    if device.type == "cuda":
        return min(rows, programs_per_sm(num_warps) * _multiprocessors(device.index))
    return min(rows, 4)


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
    block, num_warps, single_pass, group_rows = backward_config(hidden, needs_db, memory_efficient)
    programs = max(num_programs(rows, dy.device, num_warps), 1)
    dx = (torch.empty_like(dy) if dx_out is None else dx_out) if needs_dx else None
    dw = torch.empty_like(weight) if needs_dw else None
    db = torch.empty_like(bias) if needs_db else None
    if not rows:  # no row: zero gradients for the parameters
        return dx, dw.zero_() if needs_dw else None, db.zero_() if needs_db else None
    # Every program writes all of its partial row: no zero fill.
    dw_partial = torch.empty((programs, 2, hidden), dtype=torch.float32, device=dy.device) if needs_dw else None
    db_partial = torch.empty((programs, 2, hidden), dtype=torch.float32, device=dy.device) if needs_db else None
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
        BLOCK=block, SINGLE_PASS=single_pass, GROUP_ROWS=group_rows, num_warps=num_warps,
        maxnreg=_register_cap(num_warps), **_backward_options(group_rows),
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
    """Launch variants for memkernels.aot: the widest register-resident row ("single": BLOCK = the
    widest block holding Kahan sums, 8192, or 4096 with a bias gradient), LayerNorm's group-sum rows
    ("grouped": 8192 with a bias gradient) and looping rows ("loop": H > 8192, e.g. 16384), for every
    dtype and both norms as drop-ins use them (plain, weights in x's dtype or fp32), and feature-heavy
    combinations (residual, memory_efficient, casting modes)."""
    short = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    plain = [  # (dtype, param dtype, is_rms, casting, residual, weight, bias, memory_efficient, width)
        (dtype, param_dtype, is_rms, 1 if is_rms else 2, False, True, not is_rms, False, width)
        for dtype in short for param_dtype in dict.fromkeys((dtype, torch.float32))
        for is_rms in (True, False) for width in ("single", "loop") + (() if is_rms else ("grouped",))
    ]
    features = [
        (torch.bfloat16, torch.bfloat16, True, 1, True, True, False, False, "single"),
        (torch.bfloat16, torch.bfloat16, True, 1, False, True, False, True, "single"),
        (torch.bfloat16, torch.bfloat16, False, 2, True, True, True, False, "single"),
        (torch.bfloat16, torch.bfloat16, False, 2, True, True, True, True, "loop"),
        (torch.bfloat16, torch.bfloat16, True, 0, True, True, False, False, "loop"),
        (torch.bfloat16, torch.float32, True, 1, True, True, False, True, "loop"),
        (torch.float16, torch.float16, False, 2, False, True, True, True, "single"),
        (torch.float16, torch.float16, False, 2, True, True, True, False, "grouped"),
        (torch.float32, torch.float32, True, 2, True, True, False, False, "single"),
        (torch.float32, torch.float32, False, 2, True, True, True, True, "loop"),
    ]
    forward, backward = [], []
    for dtype, param_dtype, is_rms, casting, residual, weight, bias, memory_efficient, width in plain + features:
        t, p = "*" + short[dtype], "*" + short[param_dtype]
        label = (f"{short[dtype]}{'' if param_dtype == dtype else '-w' + short[param_dtype]}"
                 f"-{'rms' if is_rms else 'ln'}-{['none', 'llama', 'gemma'][casting]}"
                 f"{'-residual' if residual else ''}{'-meff' if memory_efficient else ''}-{width}")
        fwd_block, fwd_warps, _ = _forward_config(2 * FWD_MAX_BLOCK if width == "loop" else FWD_MAX_BLOCK)
        hidden = {"single": BWD_MAX_BLOCK_WITH_DB if bias else BWD_MAX_BLOCK, "grouped": BWD_MAX_BLOCK,
                  "loop": 2 * BWD_MAX_BLOCK}[width]
        bwd_block, bwd_warps, single_pass, group_rows = backward_config(hidden, bias, memory_efficient)
        common = {"IS_RMS": is_rms, "CASTING": casting, "HAS_WEIGHT": weight, "HAS_BIAS": bias,
                  "MEMORY_EFFICIENT": memory_efficient, "SINGLE_PASS": single_pass}
        if width != "grouped":  # its forward is the "single" one
            forward.append({
                "signature": {"X": t, "RESIDUAL": t, "RESIDUAL_OUT": t, "W": p, "B": p, "Y": t, "MEAN": "*fp32",
                              "RSTD": "*fp32", "SLOT": "*i32", "FALLBACK": t, "H": "i32", "K": "i32",
                              "eps": "fp32", "offset": "fp32"},
                "constexprs": {**common, "HAS_RESIDUAL": residual,
                               "STORE_MEAN": not is_rms and not memory_efficient, "BLOCK": fwd_block},
                "num_warps": fwd_warps, "num_stages": 1, "options": dict(_LAUNCH_OPTIONS),
                "label": f"{label}{fwd_block}"})
        backward.append({
            "signature": {"DY": t, "DRESIDUAL_OUT": t, "SAVED": t, "W": p, "B": p, "MEAN": "*fp32",
                          "RSTD": "*fp32", "SLOT": "*i32", "FALLBACK": t, "DX": t, "DW_PARTIAL": "*fp32",
                          "DB_PARTIAL": "*fp32", "ROW_SUMS": "*fp32", "M": "i32", "H": "i32", "K": "i32",
                          "eps": "fp32", "offset": "fp32"},
            "constexprs": {**common, "HAS_DRESIDUAL": residual, "COMPUTE_DX": True, "COMPUTE_DW": weight,
                           "COMPUTE_DB": bias, "BLOCK": bwd_block, "GROUP_ROWS": group_rows},
            "num_warps": bwd_warps, "num_stages": 1,
            "options": {"maxnreg": _register_cap(bwd_warps), **_backward_options(group_rows)},
            "label": f"{label}{bwd_block}"})
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
