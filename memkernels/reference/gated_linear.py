"""Pure-PyTorch gated Linear (SwiGLU / GeGLU down projection) with the Triton kernels' memory contract.

``y = (act(gate) * up) @ weight.T + bias``, where only ``gate`` and ``up`` are kept
for backward and the product is recomputed there. This is the CPU path
(``backend="torch"``) and the readable spec of memkernels/ops/gated_linear.py.

As in memkernels/reference/gelu_linear.py, the product is never materialized at full
size: each step works on a slab of rows (forward, d_gate/d_up) or columns (dW) of at most
``_SLAB_ELEMENTS`` elements, and each slab's result is final. The product is formed in
float32 and cast once to the operands' dtype, as the kernel does.

The gradients of gate and up come as one [M, 2*I] tensor, gate's half first, for the packed
form (the gradient of Phi-3's ``gate_up_proj`` output, no copy), and as two [M, I] tensors for the
separate form, so that each is freed as soon as its projection's backward has used it.
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


def grad_input_buffers(gate2d, packed):
    """(list returned, d_gate [M, I] view, d_up [M, I] view): one [M, 2*I] buffer when ``packed``."""
    rows, width = gate2d.shape
    if packed:
        grads = gate2d.new_empty(rows, 2 * width)
        return [grads], grads[:, :width], grads[:, width:]
    grad_gate, grad_up = gate2d.new_empty(rows, width), gate2d.new_empty(rows, width)
    return [grad_gate, grad_up], grad_gate, grad_up


def grad_inputs(grad_out2d, gate2d, up2d, weight, packed, name):
    """d_gate = d * up * act'(gate) and d_up = d * act(gate), d = dy [M, N] @ weight [N, I]: [one [M, 2*I]
    tensor] when ``packed``, else [d_gate, d_up]."""
    result, grad_gate, grad_up = grad_input_buffers(gate2d, packed)
    rows = _slab(gate2d.shape[1])
    for start in range(0, gate2d.shape[0], rows):
        stop = start + rows
        grad_product = _compute(grad_out2d[start:stop] @ weight)
        gate = gate2d[start:stop]
        grad_up[start:stop] = activation(_compute(gate), name).mul_(grad_product)
        grad_gate[start:stop] = activation_grad(gate, name).mul_(_compute(up2d[start:stop])).mul_(grad_product)
    return result


def grad_weight(grad_out2d, gate2d, up2d, name):
    """dW [N, I] = dy [M, N].T @ (act(gate) * up) [M, I], one column slab at a time."""
    grad_w = grad_out2d.new_empty(grad_out2d.shape[1], gate2d.shape[1])
    cols = _slab(gate2d.shape[0])
    for start in range(0, gate2d.shape[1], cols):
        stop = start + cols
        grad_w[:, start:stop] = grad_out2d.t() @ product(gate2d[:, start:stop], up2d[:, start:stop], name)
    return grad_w
