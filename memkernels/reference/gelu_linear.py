"""Pure-PyTorch GeLU→Linear that keeps the Triton kernels' memory contract.

``y = gelu(x) @ weight.T + bias``, where only ``x`` is kept for backward and
gelu(x) is recomputed there. This is the CPU path (``backend="torch"``) and the
readable spec of memkernels/ops/gelu_linear.py.

gelu(x) is never materialized at full size: each step works on a slab of at
most ``_SLAB_ELEMENTS`` elements of x (rows for the forward and dx, columns for
dW), so every slab's result is final and nothing is accumulated across slabs.
"""
import math

import torch
import torch.nn.functional as F

# A slab of gelu(x) or gelu'(x) this big (4 MiB in fp32) is the unit of the reference's
# transients: small next to an F-wide activation, big enough that the matmuls stay efficient.
_SLAB_ELEMENTS = 1 << 20

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_CUBIC = 0.044715
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def gelu_grad(x, approximate="none"):
    """d gelu(x) / dx, computed in float32 (float64 stays float64); same shape as x.

    In-place after the first op, so a slab costs few temporaries.
    """
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    if approximate == "tanh":
        inner = (x + _TANH_CUBIC * x.pow(3)).mul_(_SQRT_2_OVER_PI)
        t = inner.tanh()
        sech2 = inner.cosh_().square_().reciprocal_()  # 1 - t^2 without its cancellation
        dinner = x.square().mul_(3.0 * _TANH_CUBIC).add_(1.0).mul_(_SQRT_2_OVER_PI)
        # 0.5 * (1 + t) + 0.5 * x * sech^2 * dinner
        return dinner.mul_(x).mul_(sech2).add_(t).add_(1.0).mul_(0.5)
    pdf_term = x.square().mul_(-0.5).exp_().mul_(x).mul_(_INV_SQRT_2PI)
    cdf = (x * math.sqrt(0.5)).erf_().add_(1.0).mul_(0.5)
    return cdf.add_(pdf_term)


def _slab(length):
    """How many rows (or columns) of ``length`` elements fit in one slab."""
    return max(1, _SLAB_ELEMENTS // max(1, length))


def forward(x2d, weight, bias, approximate):
    """y [M, N] = gelu(x2d [M, K]) @ weight [N, K].T (+ bias [N]), row slab by row slab."""
    out = x2d.new_empty(x2d.shape[0], weight.shape[0])
    rows = _slab(x2d.shape[1])
    for start in range(0, x2d.shape[0], rows):
        stop = start + rows
        out[start:stop] = F.linear(F.gelu(x2d[start:stop], approximate=approximate), weight, bias)
    return out


def grad_input(grad_out2d, x2d, weight, approximate):
    """dx [M, K] = (dy [M, N] @ weight [N, K]) * gelu'(x [M, K]), row slab by row slab."""
    grad_x = torch.empty_like(x2d)
    rows = _slab(x2d.shape[1])
    for start in range(0, x2d.shape[0], rows):
        stop = start + rows
        grad_gelu = grad_out2d[start:stop] @ weight
        grad_x[start:stop] = gelu_grad(x2d[start:stop], approximate).mul_(grad_gelu)
    return grad_x


def grad_weight(grad_out2d, x2d, approximate):
    """dW [N, K] = dy [M, N].T @ gelu(x [M, K]), one column slab of x at a time."""
    grad_w = grad_out2d.new_empty(grad_out2d.shape[1], x2d.shape[1])
    cols = _slab(x2d.shape[0])
    for start in range(0, x2d.shape[1], cols):
        stop = start + cols
        grad_w[:, start:stop] = grad_out2d.t() @ F.gelu(x2d[:, start:stop], approximate=approximate)
    return grad_w
