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

# A slab of gelu(x) or gelu'(x) this big is the largest transient the reference
# allocates (16 MiB in fp32): small next to an F-wide activation, big enough that
# the matmuls stay efficient.
_SLAB_ELEMENTS = 1 << 22

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_CUBIC = 0.044715
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def gelu_grad(x, approximate="none"):
    """d gelu(x) / dx, computed in float32 (float64 stays float64); same shape as x."""
    x = x.float() if x.dtype != torch.float64 else x
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (x + _TANH_CUBIC * x.pow(3))
        t = torch.tanh(inner)
        dinner = _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_CUBIC * x.square())
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t.square()) * dinner
    cdf = 0.5 * (1.0 + torch.erf(x * math.sqrt(0.5)))
    return cdf + x * torch.exp(-0.5 * x.square()) * _INV_SQRT_2PI


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
        grad_x[start:stop] = grad_gelu * gelu_grad(x2d[start:stop], approximate)
    return grad_x


def grad_weight(grad_out2d, x2d, approximate):
    """dW [N, K] = dy [M, N].T @ gelu(x [M, K]), one column slab of x at a time."""
    grad_w = grad_out2d.new_empty(grad_out2d.shape[1], x2d.shape[1])
    cols = _slab(x2d.shape[0])
    for start in range(0, x2d.shape[1], cols):
        stop = start + cols
        grad_w[:, start:stop] = grad_out2d.t() @ F.gelu(x2d[:, start:stop], approximate=approximate)
    return grad_w
