"""act(a) * b (SiLU-mul, GeLU-mul) that saves only a and b: a gated MLP's elementwise core, for
people who keep their own down projection (a LoRA'd, quantized or sharded one).

Eager ``F.silu(a) * b`` keeps a (for silu), silu(a) and b (for the mul): three [..., I] tensors.
Here the product is one elementwise pass and backward recomputes act(a) from a, so only a and b
(which the caller's projections made, and usually still hold) are saved.

- forward:  c = act(a) * b                       fp32 math, rounded once to a's dtype
- backward: da = dc * b * act'(a), db = dc * act(a)  one pass reading dc, a and b

The passes are the act-linear family's (memkernels/fusions/common/act_linear.py: Triton kernels, or their
PyTorch twins in memkernels/fusions/common/act_linear_reference.py), so this op shares their AOT variants and
their float64 tests.

File order: steps → autograd and OpSpec → public functions.
"""
import functools

import torch

from memkernels.distributed import contiguous_stride, dtensor_class, is_dtensor
from memkernels.fusions.common import act_linear
from memkernels.fusions.op_spec import OpSpec, Step

# gelu_mul's approximate -> the activation's name in memkernels/fusions/common/act_linear.py
_GELU_ACTIVATIONS = {"none": "gelu", "tanh": "gelu_tanh"}


# --------------------------------------------------------------------------------------------
# Steps: forward and backward, each a custom op taking ``backend`` last.


def _rows(tensor):
    """[M, I] view (or copy) of a [..., I] tensor."""
    return tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() else tensor.reshape(1, 1)


def _forward(a, b, activation, backend):
    """c [..., I] = act(a) * b, in a's dtype, contiguous."""
    return act_linear.PASSES[backend].product(_rows(a), _rows(b), activation).view(a.shape)


def _backward(grad, a, b, activation, backend):
    """[da, db], each [..., I] in a's dtype, from grad = dL/dc."""
    a2d, b2d = _rows(a), _rows(b)
    # Contiguous buffers (not empty_like, which keeps a transposed a's strides): the passes step rows by
    # stride and take columns as contiguous.
    grad_a, grad_b = (torch.empty(a2d.shape, dtype=a.dtype, device=a.device) for _ in range(2))
    act_linear.PASSES[backend].product_backward(_rows(grad).contiguous(), a2d, b2d, activation, grad_a, grad_b,
                                                 False)
    return [grad_a.view(a.shape), grad_b.view(b.shape)]


# --------------------------------------------------------------------------------------------
# Autograd and the declaration


def _setup_context(ctx, inputs, output):
    """Saves a and b only."""
    a, b, activation, backend = inputs
    ctx.save_for_backward(a, b)
    ctx.activation, ctx.backend = activation, backend


def _backward_formula(ctx, steps, grad):
    a, b = ctx.saved_tensors
    needs_a, needs_b = ctx.needs_input_grad[:2]
    if not (needs_a or needs_b):
        return None, None, None, None
    grad_a, grad_b = steps.backward(grad, a, b, ctx.activation, ctx.backend)
    return grad_a if needs_a else None, grad_b if needs_b else None, None, None


# Elementwise, as F.silu and mul: autocast leaves the inputs as they are.
ACT_MUL = OpSpec(
    "act_mul",
    Step("act_mul", _forward,
         lambda a, b, activation, backend: torch.empty_like(a, memory_format=torch.contiguous_format),
         schema="(Tensor a, Tensor b, str activation, str backend) -> Tensor"),
    steps={"backward": Step("act_mul_backward", _backward,
                            lambda grad, a, b, activation, backend: [torch.empty_like(a), torch.empty_like(b)],
                            schema="(Tensor grad, Tensor a, Tensor b, str activation, str backend) -> Tensor[]")},
    setup_context=_setup_context, backward=_backward_formula, autocast={"cpu": None, "cuda": None}, casts=(0, 1))


# --------------------------------------------------------------------------------------------
# Public functions


def _check_inputs(op_name, a, b, backend):
    for name, tensor in (("a", a), ("b", b)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{op_name}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise TypeError(f"{op_name}: {name} has dtype {tensor.dtype}; pass a floating tensor")
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"{op_name}: a is {tuple(a.shape)} {a.dtype} on {a.device} but b is {tuple(b.shape)} "
                         f"{b.dtype} on {b.device}; they must match (broadcasting is not supported: expand b "
                         "yourself)")
    return ACT_MUL.backend(backend, a, op_name, "a")


def _act_mul(a, b, *, activation, op_name, backend):
    return ACT_MUL(a, b, activation, _check_inputs(op_name, a, b, backend))


def _call(op_name, activation, a, b, backend):
    if is_dtensor(a):
        return _call_dtensor(op_name, activation, a, b, backend)
    return ACT_MUL.with_autocast(functools.partial(_act_mul, activation=activation, op_name=op_name,
                                                                    backend=backend), a, b)


def _call_dtensor(op_name, activation, a, b, backend):
    """act(a) * b of DTensors (tensor parallelism: gate and up column-sharded, or sequence-sharded): elementwise, so
    each rank computes its own shard; a and b must be laid out alike, and not as partial sums (act is not linear)."""
    from torch.distributed.tensor import Partial

    placements = tuple(a.placements)
    if not is_dtensor(b) or tuple(b.placements) != placements or b.device_mesh != a.device_mesh:
        raise ValueError(f"{op_name}: a is a DTensor placed {placements}; b must be a DTensor on the same mesh with "
                         "the same placements")
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(f"{op_name}: a is a DTensor of partial sums {placements}; act(a) needs the sums: "
                         "redistribute a and b to Shard or Replicate first")
    out = _call(op_name, activation, a.to_local(), b.to_local(), backend)
    return dtensor_class().from_local(out, a.device_mesh, placements, shape=a.shape, stride=contiguous_stride(a.shape))


def silu_mul(a, b, *, backend=None):
    """``F.silu(a) * b`` saving only a and b for backward (eager also keeps silu(a)).

    Args:
        a, b: [..., I], the same shape, dtype and device; float32 / float16 / bfloat16 (the
            torch backend takes any floating dtype); any strides.
        backend: None picks by device (Triton on CUDA, the PyTorch reference elsewhere, see
            memkernels.set_backend); "torch" or "triton" forces one.

    Returns:
        [..., I] in a's dtype, computed in float32 and rounded once. DTensor a and b (laid out alike, not
        partial sums) give a DTensor laid out as a, each rank computing its own shard.
    """
    return _call("silu_mul", "silu", a, b, backend)


def gelu_mul(a, b, *, approximate="none", backend=None):
    """``F.gelu(a, approximate=approximate) * b`` saving only a and b for backward (GeGLU's core).

    Args as :func:`silu_mul`; ``approximate``: "none" (exact, erf) or "tanh", as in ``F.gelu``.
    """
    if approximate not in _GELU_ACTIVATIONS:
        raise ValueError(f"gelu_mul: approximate={approximate!r} is not supported; use 'none' or 'tanh'")
    return _call("gelu_mul", _GELU_ACTIVATIONS[approximate], a, b, backend)
