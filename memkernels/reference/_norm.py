"""Pure-PyTorch RMSNorm / LayerNorm with the memory contract of the Triton kernels.

This is the CPU path (backend "torch") and the readable spec of
memkernels/ops/_norm_kernels.py: the same statistics, the same rounding points
and the same tensors kept for backward. Everything works on 2-D contiguous
[M, H] tensors; the public functions flatten and validate.

Notation: s is the normalized input (x, or residual_out = x + residual rounded
to x's dtype), x̂ = (s - mean) * rstd (mean = 0 for RMSNorm), W' = offset + w
in fp32 (1 without a weight). Statistics are fp32.

casting_mode (RMSNorm; LayerNorm always uses "gemma"):
  "llama": y = round(round(x̂) * W')       (x̂ cast to x's dtype before the weight)
  "gemma": y = round(x̂ * W' + b)          (all in fp32, one rounding at the end)
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


def effective_weight(weight, offset, casting, dtype):
    """W' = offset + w in fp32 (rounded to ``dtype`` in casting mode "none"), or None."""
    if weight is None:
        return None
    scale = weight.float() + offset
    if casting == CASTING_MODES["none"]:
        scale = scale.to(dtype).float()
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
        unsafe |= magnitude < bias.float().abs()
    return unsafe.nonzero().flatten()


def _round(t, dtype):
    return t.to(dtype).float()


def norm_forward(x, residual, weight, bias, eps, offset, is_rms, casting, memory_efficient, unsafe_cols):
    """Forward on [M, H] tensors.

    Returns (y [M, H] x.dtype, residual_out [M, H] or None, mean [M] fp32 or None
    (LayerNorm keeping its input only), rstd [M] fp32, fallback [M, K] x.dtype
    or None (memory_efficient only)).
    """
    dtype = x.dtype
    residual_out = None
    if residual is not None:
        residual_out = (x.float() + residual.float()).to(dtype)
        s = residual_out.float()
    else:
        s = x.float()
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
        out = out + bias.float()
    y = out.to(dtype)

    fallback = None
    if memory_efficient:
        fallback = xhat[:, unsafe_cols.to(x.device)].to(dtype)
    return y, residual_out, (None if memory_efficient else mean), rstd, fallback


def recover_xhat(saved, mean, rstd, weight, bias, offset, casting, memory_efficient, unsafe_cols, fallback):
    """x̂ [M, H] fp32 from what forward kept: s with its statistics, or y (memory_efficient)."""
    if not memory_efficient:
        centered = saved.float() if mean is None else saved.float() - mean[:, None]
        return centered * rstd[:, None]
    shifted = saved.float() if bias is None else saved.float() - bias.float()
    scale = effective_weight(weight, offset, casting, saved.dtype)
    if scale is None:
        xhat = shifted
    else:
        unsafe = torch.zeros_like(scale, dtype=torch.bool)
        unsafe[unsafe_cols] = True
        # The guard keeps 0/0 out of columns whose x̂ comes from the fallback.
        xhat = shifted / torch.where(unsafe, torch.ones_like(scale), scale)
    if unsafe_cols.numel():
        xhat[:, unsafe_cols] = fallback.float()
    return xhat


def norm_backward(dy, dresidual_out, saved, mean, rstd, weight, bias, eps, offset, is_rms, casting,
                  memory_efficient, unsafe_cols, fallback, needs_dx, needs_dw, needs_db):
    """Backward on [M, H] tensors. Returns (dx or None, dw or None, db or None).

    dx is also the gradient of residual (residual_out = x + residual). dw/db are
    reduced in fp32 and returned in the parameter's dtype.
    """
    xhat = recover_xhat(saved, mean, rstd, weight, bias, offset, casting, memory_efficient, unsafe_cols, fallback)
    dy32 = dy.float()
    dx = dw = db = None
    if needs_dx:
        scale = effective_weight(weight, offset, casting, dy.dtype)
        g = dy32 if scale is None else dy32 * scale
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
        dx32 = inner * rstd[:, None]
        if dresidual_out is not None:
            dx32 = dx32 + dresidual_out.float()
        dx = dx32.to(dy.dtype)
    if needs_dw:
        dw = (dy32 * xhat).sum(dim=0).to(weight.dtype)
    if needs_db:
        db = dy32.sum(dim=0).to(bias.dtype)
    return dx, dw, db
