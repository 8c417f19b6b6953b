"""Pure-PyTorch gated Linear (SwiGLU / GeGLU down projection) with the Triton kernels' memory contract.

``y = (act(gate) * up) @ weight.T + bias``, where only ``gate`` and ``up`` are kept
for backward and the product is recomputed there. This is the CPU path
(``backend="torch"``) and the readable spec of memkernels/ops/gated_linear.py.

As in memkernels/reference/gelu_linear.py, the product is never materialized at full
size: each step works on a slab of rows (forward, d_gate/d_up) or columns (dW) of at most
``_SLAB_ELEMENTS`` elements, and each slab's result is final. The product is formed in
float32 and cast once to the operands' dtype, as the kernel does.

Gradients of one [M, 2*I] tensor, gate's first (Phi-3's packed ``gate_up_proj`` layout),
so the packed form needs no copy; the separate form takes its two halves as views.
"""
import torch
import torch.nn.functional as F

from memkernels.reference.gelu_linear import _slab, gelu_grad

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def _compute(tensor):
    """tensor in float32 (float64 stays float64)."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def activation(x, name):
    """act(x) for ``name`` in ACTIVATIONS, in x's dtype."""
    if name == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if name == "gelu_tanh" else "none")


def activation_grad(x, name):
    """d act(x) / dx, in float32 (float64 stays float64)."""
    if name == "silu":
        sigmoid = torch.sigmoid(_compute(x))
        return (1.0 - sigmoid).mul_(_compute(x)).add_(1.0).mul_(sigmoid)
    return gelu_grad(x, "tanh" if name == "gelu_tanh" else "none")


def product(gate, up, name):
    """act(gate) * up formed in float32, cast once to gate's dtype."""
    return activation(_compute(gate), name).mul_(_compute(up)).to(gate.dtype)


def forward(gate2d, up2d, weight, bias, name):
    """y [M, N] = (act(gate [M, I]) * up [M, I]) @ weight [N, I].T (+ bias [N]), row slab by row slab."""
    out = gate2d.new_empty(gate2d.shape[0], weight.shape[0])
    rows = _slab(gate2d.shape[1])
    for start in range(0, gate2d.shape[0], rows):
        stop = start + rows
        out[start:stop] = F.linear(product(gate2d[start:stop], up2d[start:stop], name), weight, bias)
    return out


def grad_inputs(grad_out2d, gate2d, up2d, weight, name):
    """[M, 2*I]: d_gate = d * up * act'(gate) then d_up = d * act(gate), d = dy [M, N] @ weight [N, I]."""
    width = gate2d.shape[1]
    grads = gate2d.new_empty(gate2d.shape[0], 2 * width)
    rows = _slab(width)
    for start in range(0, gate2d.shape[0], rows):
        stop = start + rows
        grad_product = _compute(grad_out2d[start:stop] @ weight)
        gate = gate2d[start:stop]
        grads[start:stop, width:] = activation(_compute(gate), name).mul_(grad_product)
        grads[start:stop, :width] = activation_grad(gate, name).mul_(_compute(up2d[start:stop])).mul_(grad_product)
    return grads


def grad_weight(grad_out2d, gate2d, up2d, name):
    """dW [N, I] = dy [M, N].T @ (act(gate) * up) [M, I], one column slab at a time."""
    grad_w = grad_out2d.new_empty(grad_out2d.shape[1], gate2d.shape[1])
    cols = _slab(gate2d.shape[0])
    for start in range(0, gate2d.shape[1], cols):
        stop = start + cols
        grad_w[:, start:stop] = grad_out2d.t() @ product(gate2d[:, start:stop], up2d[:, start:stop], name)
    return grad_w
