"""Pure-PyTorch RMSNorm / LayerNorm with the memory contract of the Triton kernels.

This is the CPU path (backend "torch") and the readable spec of
memkernels/ops/_norm_kernels.py: the same statistics, the same rounding points
and the same tensors kept for backward. Everything works on 2-D contiguous
[M, H] tensors; the public functions flatten and validate.

Notation: s is the normalized input (x, or residual_out = x + residual rounded
to x's dtype), x̂ = (s - mean) * rstd (mean = 0 for RMSNorm), W' = offset + w
(1 without a weight). Statistics are kept in fp32. This CPU path computes in
fp32 for fp16/bf16 inputs and in float64 for fp32 inputs (the kernels use
fp32 throughout): on the CPU the wider type costs little, and it keeps fp32
results within one rounding of exact.

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

CASTING_MODES = {"none": 0, "llama": 1, "gemma": 2}


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


def unrecoverable_columns(weight, bias, offset, casting, dtype):
    """int64 [K]: columns where x̂ cannot be recovered from y (memory_efficient mode).

    On a CUDA weight this reads K back to the host: one device sync per call.
    """
    scale = effective_weight(weight, offset, casting, dtype)
    if scale is None:
        if bias is None:
            return torch.empty(0, dtype=torch.int64, device="cpu" if weight is None else weight.device)
        scale = torch.ones_like(bias, dtype=torch.float32)
    magnitude = scale.abs()
    unsafe = magnitude < recovery_threshold(dtype)
    if bias is not None:
        unsafe |= magnitude < bias.to(magnitude.dtype).abs()
    return unsafe.nonzero().flatten()


def _round(t, dtype):
    """A rounding point: ``t`` rounded to ``dtype``, back in t's type."""
    return t.to(dtype).to(t.dtype)


def norm_forward(x, residual, weight, bias, eps, offset, is_rms, casting, memory_efficient, unsafe_cols):
    """Forward on [M, H] tensors.

    Returns (y [M, H] x.dtype, residual_out [M, H] or None, mean [M] fp32 or None
    (LayerNorm keeping its input only), rstd [M] fp32, fallback [M, K] x.dtype
    or None (memory_efficient only)).
    """
    dtype, compute = x.dtype, compute_dtype(x.dtype)
    residual_out = None
    if residual is not None:
        residual_out = (x.to(compute) + residual.to(compute)).to(dtype)
        s = residual_out.to(compute)
    else:
        s = x.to(compute)
    mean = None if is_rms else s.mean(dim=1)
    centered = s if is_rms else s - mean[:, None]
    rstd = torch.rsqrt(centered.square().mean(dim=1) + eps)
    xhat = centered * rstd[:, None]

    if casting == CASTING_MODES["none"]:
        normalized = _round(s * _round(rstd, dtype)[:, None], dtype)
    elif casting == CASTING_MODES["llama"]:
        normalized = _round(xhat, dtype)
    else:
        normalized = xhat
    scale = effective_weight(weight, offset, casting, dtype)
    out = normalized if scale is None else normalized * scale
    if bias is not None:
        out = out + bias.to(compute)
    y = out.to(dtype)

    fallback = None
    if memory_efficient:
        fallback = xhat[:, unsafe_cols.to(x.device)].to(dtype)
    mean = None if memory_efficient or mean is None else mean.float()
    return y, residual_out, mean, rstd.float(), fallback


def recover_xhat(saved, mean, rstd, weight, bias, offset, casting, memory_efficient, unsafe_cols, fallback):
    """x̂ [M, H] in the compute type from what forward kept: s with its statistics, or y (memory_efficient)."""
    compute = compute_dtype(saved.dtype)
    if not memory_efficient:
        centered = saved.to(compute) if mean is None else saved.to(compute) - mean.to(compute)[:, None]
        return centered * rstd.to(compute)[:, None]
    shifted = saved.to(compute) if bias is None else saved.to(compute) - bias.to(compute)
    scale = effective_weight(weight, offset, casting, saved.dtype)
    if scale is None:
        xhat = shifted
    else:
        unsafe = torch.zeros_like(scale, dtype=torch.bool)
        unsafe[unsafe_cols] = True
        # The guard keeps 0/0 out of columns whose x̂ comes from the fallback.
        xhat = shifted / torch.where(unsafe, torch.ones_like(scale), scale)
    if unsafe_cols.numel():
        xhat[:, unsafe_cols] = fallback.to(compute)
    return xhat


def norm_backward(dy, dresidual_out, saved, mean, rstd, weight, bias, eps, offset, is_rms, casting,
                  memory_efficient, unsafe_cols, fallback, needs_dx, needs_dw, needs_db, dx_out=None):
    """Backward on [M, H] tensors. Returns (dx or None, dw or None, db or None).

    dx is written into ``dx_out`` when given (the in_place backward passes dy).

    dx is also the gradient of residual (residual_out = x + residual). dw/db are
    reduced in the compute type and returned in the parameter's dtype.
    """
    xhat = recover_xhat(saved, mean, rstd, weight, bias, offset, casting, memory_efficient, unsafe_cols, fallback)
    dy_c = dy.to(compute_dtype(dy.dtype))
    rstd = rstd.to(dy_c.dtype)
    dx = dw = db = None
    # dw and db first: with float32 dy, dy_c *is* dy, which dx_out may overwrite.
    if needs_dw:
        dw = (dy_c * xhat).sum(dim=0).to(weight.dtype)
    if needs_db:
        db = dy_c.sum(dim=0).to(bias.dtype)
    if needs_dx:
        scale = effective_weight(weight, offset, casting, dy.dtype)
        g = dy_c if scale is None else dy_c * scale
        projection = (g * xhat).mean(dim=1, keepdim=True)
        if is_rms and xhat.shape[1] == 1:
            # One column: g - x̂ (g x̂) = g (1 - x̂²), which cancels when x̂² is near 1;
            # there 1 - x̂² = eps rstd² (exactly, in real arithmetic) is the accurate form.
            square = xhat.square()
            inner = g * torch.where(square > 0.5, eps * rstd.square()[:, None], 1.0 - square)
        else:
            inner = g - xhat * projection
        if not is_rms:
            inner = inner - g.mean(dim=1, keepdim=True)
        dx_c = inner * rstd[:, None]
        if dresidual_out is not None:
            dx_c = dx_c + dresidual_out.to(dx_c.dtype)
        dx = dx_c.to(dy.dtype) if dx_out is None else dx_out.copy_(dx_c)
    return dx, dw, db
