"""GeLU→Linear: ``y = gelu(x) @ weight.T + bias`` without storing gelu(x).

Eager PyTorch keeps two F-wide tensors for backward (GELU saves x, Linear saves gelu(x)). Here
only x is saved: the forward forms gelu(x) in one elementwise pass into a transient buffer for
cuBLAS's GEMM and frees it; backward forms dx = (dy @ W) * gelu'(x) and gelu(x) for dW in one pass
over dy @ W's buffer. The algorithm and its kernels are memkernels/fusions/common/act_linear.py's, shared
with gated_linear (this is its case without up); this file adds the custom ops, autograd and the
public function.

- forward: y  = gelu(x) @ W.T (+ b)        one pass, then cuBLAS
- dx, dW:  g = dy @ W; dx = g * gelu'(x); gelu(x) over g; dW = dy.T @ gelu(x)
- db:      db = dy.sum(0)                 a deterministic torch reduction

File order: steps → autograd and OpSpec → public function.
"""

import functools

import torch

from memkernels.distributed import is_dtensor
from memkernels.fusions.common import act_linear
from memkernels.fusions.common.act_linear import bias_grad
from memkernels.fusions.op_spec import OpSpec, Step

APPROXIMATIONS = ("none", "tanh")
# gelu_linear's approximate -> the activation's name in memkernels/fusions/common/act_linear.py
_GELU_ACTIVATIONS = {"none": "gelu", "tanh": "gelu_tanh"}


# --------------------------------------------------------------------------------------------
# Steps: the forward and the backward, each a custom op (memkernels/fusions/op_spec.py) taking
# ``backend`` last, "triton" (the Triton elementwise passes) or "torch" (their PyTorch twins).


def _forward(x, weight, bias, approximate, backend):
    """[..., N] from x [..., K]: the shared algorithm on x's 2-D view."""
    x2d = x.reshape(-1, x.shape[-1])
    return act_linear.forward(x2d, None, weight, bias, _GELU_ACTIVATIONS[approximate], backend, lead=x.shape[:-1])


def _backward(grad_out2d, x2d, weight, needs_input, needs_weight, approximate, backend):
    return act_linear.backward(grad_out2d, x2d, None, weight, False, needs_input, needs_weight,
                                _GELU_ACTIVATIONS[approximate], backend)


# --------------------------------------------------------------------------------------------
# Autograd and the declaration


def _setup_context(ctx, inputs, output):
    """Saves only x (and the weight parameter)."""
    x, weight, bias, approximate, backend = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None
    ctx.approximate = approximate
    ctx.backend = backend


def _backward_formula(ctx, steps, grad_out):
    x, weight = ctx.saved_tensors
    grad_out2d = grad_out.reshape(-1, grad_out.shape[-1])
    needs_x, needs_w = ctx.needs_input_grad[:2]
    grad_x = grad_w = grad_bias = None
    if needs_x or needs_w:
        grads = steps.backward(grad_out2d, x.reshape(-1, x.shape[-1]), weight, needs_x, needs_w, ctx.approximate,
                               ctx.backend)
        grad_x = grads[0].view(x.shape) if needs_x else None
        grad_w = grads[-1] if needs_w else None
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = bias_grad(grad_out2d)
    return grad_x, grad_w, grad_bias, None, None


GELU_LINEAR = OpSpec(
    "gelu_linear",
    Step("gelu_linear", _forward,
         lambda x, weight, bias, approximate, backend: x.new_empty(*x.shape[:-1], weight.shape[0]),
         schema="(Tensor x, Tensor weight, Tensor? bias, str approximate, str backend) -> Tensor"),
    steps={"backward": Step(
        "gelu_linear_backward", _backward,
        lambda grad_out2d, x2d, weight, needs_input, needs_weight, approximate, backend: act_linear.backward_fake(
            grad_out2d, x2d, None, weight, False, needs_input, needs_weight, None, backend),
        schema="(Tensor grad_out2d, Tensor x2d, Tensor weight, bool needs_input, bool needs_weight, str approximate, "
               "str backend) -> Tensor[]")},
    setup_context=_setup_context, backward=_backward_formula,
    # A GEMM: under autocast x, weight and bias are cast to the region's dtype, as F.linear's are.
    autocast={"cpu": "lower_precision_fp", "cuda": "lower_precision_fp"}, casts=(0, 1, 2))


# --------------------------------------------------------------------------------------------
# Public function


def _check_inputs(x, weight, bias, approximate):
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"gelu_linear: approximate={approximate!r} is not supported; use 'none' or 'tanh'")
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError("gelu_linear: x must be a tensor of shape [..., in_features]")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError("gelu_linear: weight must be a 2-D tensor of shape [out_features, in_features]")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"gelu_linear: in_features mismatch: x has {x.shape[-1]} features (last dim) but weight "
            f"{tuple(weight.shape)} expects {weight.shape[1]}; weight must be [out_features, in_features]")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"gelu_linear: bias has shape {tuple(bias.shape)}; expected ({weight.shape[0]},) "
                         "(out_features)")
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is None:
            continue
        if tensor.device != x.device:
            raise ValueError(f"gelu_linear: {name} is on {tensor.device} but x is on {x.device}; "
                             f"move them to the same device")
        if tensor.dtype != x.dtype:
            raise ValueError(f"gelu_linear: {name} is {tensor.dtype} but x is {x.dtype}; cast them to one dtype")


def gelu_linear(x, weight, bias=None, *, approximate="none", backend=None):
    """``F.linear(F.gelu(x, approximate=approximate), weight, bias)`` without storing gelu(x).

    Args:
        x: [..., in_features], float32 / float16 / bfloat16 (the torch backend takes any
            floating dtype).
        weight: [out_features, in_features], same dtype and device as x; any strides.
        bias: optional [out_features].
        approximate: "none" (exact, erf) or "tanh", as in ``F.gelu``.
        backend: None picks by device (Triton on CUDA, the PyTorch reference elsewhere, see
            memkernels.set_backend); "torch" forces the reference, "triton" the kernels.

    Returns:
        [..., out_features] in x's dtype. Only x (and weight) is saved for backward. DTensors (tensor
        parallelism): x sharded over in_features with weight sharded over its columns, or x sharded over
        tokens with a replicated weight (see ``memkernels.fusions.common.act_linear.on_dtensors``).
        Under ``torch.autocast`` x, weight and bias are cast to the region's dtype first, as
        ``F.linear`` casts them, and the result is in that dtype.
    """
    if any(is_dtensor(t) for t in (x, weight, bias)):  # tensor parallelism: each rank on its shards
        return act_linear.on_dtensors("gelu_linear", (x,), weight, bias, lambda operands, weight_local: gelu_linear(
            *operands, weight_local, approximate=approximate, backend=backend))
    return GELU_LINEAR.with_autocast(functools.partial(_gelu_linear, approximate=approximate, backend=backend),
                                     x, weight, bias)


def _gelu_linear(x, weight, bias, *, approximate, backend):
    _check_inputs(x, weight, bias, approximate)
    return GELU_LINEAR(x, weight, bias, approximate, GELU_LINEAR.backend(backend, x, what="x"))
