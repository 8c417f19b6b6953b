"""Pure-PyTorch RMSNorm / LayerNorm with the memory contract of the Triton kernels.

This is the CPU path (backend "torch") and the readable spec of
memkernels/fusions/norm/kernels.py: the same statistics, the same rounding points
and the same tensors kept for backward. Everything works on 2-D contiguous
[M, H] tensors; the public functions flatten and validate.

Notation: s is the normalized input (x, or residual_out = x + residual rounded
to x's dtype), x̂ = (s - mean) * rstd (mean = 0 for RMSNorm), W' = offset + w
(1 without a weight). Everything is computed in fp32, as in the kernels, and
statistics are kept in fp32.

Memory: the kernels keep a row in registers; this path works on blocks of
rows instead (``row_blocks``), so that its float32 temporaries never exceed
BLOCK_ELEMENTS elements each (1 MiB), whatever the tensor's size: a block
keeps at most about six alive, TEMPORARY_BUDGET_BYTES in all. y, residual_out
and dx are allocated once and filled block by block. dw/db are, like the
kernels' per-program partial sums, one fp32 sum per block, added up in float64
in block order (deterministic) and cast to the parameter's dtype once.

casting_mode (RMSNorm; LayerNorm always uses "gemma"):
  "llama": y = round(round(x̂) * W')       (x̂ cast to x's dtype before the weight)
  "gemma": y = round(x̂ * W' + b)          (all in the compute type, one rounding at the end)
  "none":  y = round(round(s * round(rstd)) * round(W'))   (each op in x's dtype)
where round() is a cast to x's dtype.

memory_efficient: instead of s the backward keeps y (which the next layer
keeps anyway) and recovers x̂ = (y - b) / W'. That is only as good as one
rounding of y where |W'_j| >= max(|b_j|, tau(dtype)); the other columns
("unrecoverable": zero, tiny, or small next to the bias) keep x̂ itself in a
compact [M, K] tensor, K = number of such columns (usually 0).
"""
import torch

from memkernels.fusions.common.host import row_blocks

CASTING_MODES = {"none": 0, "llama": 1, "gemma": 2}

# Elements per float32 temporary of a row block (1 MiB): small next to any tensor worth
# metering, large enough that the per-block Python overhead stays small.
BLOCK_ELEMENTS = 1 << 18
# Bound on the bytes of a block's temporaries alive at once (pinned by tests/test_rms_norm.py).
TEMPORARY_BUDGET_BYTES = 8 * 4 * BLOCK_ELEMENTS


def recovery_threshold(dtype):
    """Smallest |W'| for which y / W' loses at most one rounding of y.

    Below smallest_normal / eps, W' * x̂ for x̂ of order one can be subnormal
    in ``dtype``, and y no longer carries x̂ to the dtype's precision.
    fp16: 0.0625, bf16: ~1.5e-36, fp32: ~1e-31.
    """
    info = torch.finfo(dtype)
    return info.tiny / info.eps


def compute_dtype(dtype):
    """The type this path computes in for inputs of ``dtype``: float32, as the kernels do.

    Not float64 for float32 inputs: that doubles every temporary on the CPU path
    and makes its x̂ round differently from the kernels' (one ulp off where the
    float32 computation is exact, e.g. x̂ = ±1 at hidden size 1).
    """
    return torch.float32


def effective_weight(weight, offset, casting, dtype):
    """W' = offset + w in the compute type (rounded to ``dtype`` in casting mode "none"), or None."""
    if weight is None:
        return None
    compute = compute_dtype(dtype)
    scale = weight.to(compute) + offset
    if casting == CASTING_MODES["none"]:
        scale = scale.to(dtype).to(compute)
    return scale


def unrecoverable_mask(weight, bias, offset, casting, dtype):
    """bool [H] (or None with neither weight nor bias): True where x̂ cannot be recovered from y.

    Computed on the parameters' device without reading anything back.
    """
    scale = effective_weight(weight, offset, casting, dtype)
    if scale is None:
        if bias is None:
            return None
        scale = torch.ones_like(bias, dtype=torch.float32)
    magnitude = scale.abs()
    unsafe = magnitude < recovery_threshold(dtype)
    if bias is not None:
        unsafe |= magnitude < bias.to(magnitude.dtype).abs()
    return unsafe


def unrecoverable_columns(weight, bias, offset, casting, dtype):
    """int64 [K]: columns where x̂ cannot be recovered from y (memory_efficient mode).

    On a CUDA weight this reads K back to the host (a device sync); the custom op
    caches the result per weight state and refreshes the cache of every parameter an
    optimizer step touched with one readback for all of them
    (memkernels.fusions.norm.op.unrecoverable_columns).
    """
    unsafe = unrecoverable_mask(weight, bias, offset, casting, dtype)
    if unsafe is None:
        return torch.empty(0, dtype=torch.int64, device="cpu" if weight is None else weight.device)
    return unsafe.nonzero().flatten()


def _round(t, dtype):
    """A rounding point: ``t`` rounded to ``dtype``, back in t's type."""
    return t.to(dtype).to(t.dtype)


def _rows(t, start, stop):
    """Rows start:stop of an [M, ...] tensor, or None."""
    return None if t is None else t[start:stop]


def norm_forward(x, residual, weight, bias, eps, offset, is_rms, casting, memory_efficient, unsafe_cols):
    """Forward on [M, H] tensors, one row block at a time.

    Returns (y [M, H] x.dtype, residual_out [M, H] or None, mean [M] fp32 or None
    (LayerNorm keeping its input only), rstd [M] fp32, fallback [M, K] x.dtype
    or None (memory_efficient only)).
    """
    rows, hidden = x.shape
    dtype, compute = x.dtype, compute_dtype(x.dtype)
    scale = effective_weight(weight, offset, casting, dtype)
    shift = None if bias is None else bias.to(compute)
    y = torch.empty_like(x)
    residual_out = None if residual is None else torch.empty_like(x)
    keep_mean = not (is_rms or memory_efficient)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device) if keep_mean else None
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    fallback = None
    if memory_efficient:
        unsafe_cols = unsafe_cols.to(x.device)
        fallback = torch.empty((rows, unsafe_cols.numel()), dtype=dtype, device=x.device)
    for start, stop in row_blocks(rows, hidden, BLOCK_ELEMENTS):
        if residual is None:
            s = x[start:stop].to(compute)
        else:
            residual_out[start:stop] = x[start:stop].to(compute) + residual[start:stop].to(compute)
            s = residual_out[start:stop].to(compute)
        if is_rms:
            centered = s
        else:
            block_mean = s.mean(dim=1)
            centered = s - block_mean[:, None]
            if keep_mean:
                mean[start:stop] = block_mean
        block_rstd = torch.rsqrt(centered.square().mean(dim=1) + eps)
        rstd[start:stop] = block_rstd
        xhat = centered * block_rstd[:, None]
        del centered
        if casting == CASTING_MODES["none"]:
            normalized = _round(s * _round(block_rstd, dtype)[:, None], dtype)
        elif casting == CASTING_MODES["llama"]:
            normalized = _round(xhat, dtype)
        else:
            normalized = xhat
        del s
        out = normalized if scale is None else normalized * scale
        del normalized
        if shift is not None:
            out = out + shift
        y[start:stop] = out  # the one rounding to x's dtype
        del out
        if memory_efficient and unsafe_cols.numel():
            fallback[start:stop] = xhat[:, unsafe_cols]
    return y, residual_out, mean, rstd, fallback


class _Recovery:
    """What recovering x̂ needs besides the saved rows: per-column [H] values, computed once per call."""

    def __init__(self, saved_dtype, weight, bias, offset, casting, memory_efficient, unsafe_cols):
        compute = compute_dtype(saved_dtype)
        self.memory_efficient = memory_efficient
        self.unsafe_cols = unsafe_cols
        self.shift = None if bias is None else bias.to(compute)
        self.divisor = None
        scale = effective_weight(weight, offset, casting, saved_dtype)
        if memory_efficient and scale is not None:
            unsafe = torch.zeros_like(scale, dtype=torch.bool)
            unsafe[unsafe_cols] = True
            # The guard keeps 0/0 out of columns whose x̂ comes from the fallback.
            self.divisor = torch.where(unsafe, torch.ones_like(scale), scale)

    def xhat(self, saved, mean, rstd, fallback):
        """x̂ of one row block in the compute type, from s with its statistics, or from y (memory_efficient)."""
        compute = compute_dtype(saved.dtype)
        if not self.memory_efficient:
            centered = saved.to(compute) if mean is None else saved.to(compute) - mean.to(compute)[:, None]
            return centered * rstd.to(compute)[:, None]
        xhat = saved.to(compute) if self.shift is None else saved.to(compute) - self.shift
        if self.divisor is not None:
            xhat = xhat / self.divisor
        if self.unsafe_cols.numel():  # never without a weight or a bias: then xhat is a fresh tensor
            xhat[:, self.unsafe_cols] = fallback.to(compute)
        return xhat


def norm_backward(dy, dresidual_out, saved, mean, rstd, weight, bias, eps, offset, is_rms, casting,
                  memory_efficient, unsafe_cols, fallback, needs_dx, needs_dw, needs_db, dx_out=None):
    """Backward on [M, H] tensors, one row block at a time. Returns (dx or None, dw or None, db or None).

    dx is written into ``dx_out`` when given (the in_place backward passes dy itself:
    each block reads its rows of dy before it writes dx there).

    dx is also the gradient of residual (residual_out = x + residual). dw/db: one
    fp32 partial sum per block, accumulated in float64, returned in the parameter's dtype.
    """
    rows, hidden = dy.shape
    compute = compute_dtype(dy.dtype)
    recovery = _Recovery(saved.dtype, weight, bias, offset, casting, memory_efficient, unsafe_cols)
    scale = effective_weight(weight, offset, casting, dy.dtype)
    dx = None
    if needs_dx:
        dx = torch.empty_like(dy) if dx_out is None else dx_out
    dw_total = torch.zeros(hidden, dtype=torch.float64, device=dy.device) if needs_dw else None
    db_total = torch.zeros(hidden, dtype=torch.float64, device=dy.device) if needs_db else None
    for start, stop in row_blocks(rows, hidden, BLOCK_ELEMENTS):
        xhat = recovery.xhat(saved[start:stop], _rows(mean, start, stop), rstd[start:stop],
                             _rows(fallback, start, stop))
        dy_c = dy[start:stop].to(compute)
        # dw and db first: with float32 dy, dy_c *is* dy's rows, which dx may overwrite.
        if needs_dw:
            dw_total += (dy_c * xhat).sum(dim=0)
        if needs_db:
            db_total += dy_c.sum(dim=0)
        if needs_dx:
            block_rstd = rstd[start:stop].to(compute)[:, None]
            g = dy_c if scale is None else dy_c * scale
            del dy_c
            if is_rms and hidden == 1:
                # One column: g - x̂ (g x̂) = g (1 - x̂²), which cancels when x̂² is near 1;
                # there 1 - x̂² = eps rstd² (exactly, in real arithmetic) is the accurate form.
                square = xhat.square()
                inner = g * torch.where(square > 0.5, eps * block_rstd.square(), 1.0 - square)
            else:
                inner = g - xhat * (g * xhat).mean(dim=1, keepdim=True)
            if not is_rms:
                inner -= g.mean(dim=1, keepdim=True)
            del g, xhat
            inner *= block_rstd
            if dresidual_out is not None:
                inner += dresidual_out[start:stop].to(compute)
            dx[start:stop] = inner  # the one rounding to dy's dtype
    dw = dw_total.to(weight.dtype) if needs_dw else None
    db = db_total.to(bias.dtype) if needs_db else None
    return dx, dw, db
