"""Gated Linear (the down projection of SwiGLU / GeGLU MLPs): ``y = (act(gate) * up) @ weight.T + bias``.

Eager PyTorch keeps four I-wide tensors per token for a gated MLP's backward: gate, act(gate), up and
the product. Here only gate and up are saved: the product is formed in one elementwise pass into a
transient buffer for cuBLAS's GEMM and freed, and backward forms it again over dy @ W's buffer once
that has given d_gate and d_up (memkernels/fusions/common/act_linear.py, shared with gelu_linear):

- forward: c = act(gate) * up; y = c @ W.T (+ b)                   one pass, then cuBLAS
- backward: g = dy @ W; d_gate = g * up * act'(gate), d_up = g * act(gate), c over g; dW = dy.T @ c
- db:      db = dy.sum(0)                                          a deterministic torch reduction

This file adds the custom ops, autograd and the public functions. :class:`GatedMLPRecomputeFunction`
is the whole MLP saving only its input x, over a long input in token chunks (the tiled MLP: the I-wide
tensors held are one chunk's; the weight gradients summed over chunks in float32).

File order: steps → autograd → public functions.
"""
import functools

import torch
import torch.nn.functional as F

from memkernels.distributed import is_dtensor
from memkernels.fusions.common import act_linear
from memkernels.fusions.common.act_linear import bias_grad
from memkernels.fusions.common.act_linear_reference import ACTIVATIONS
from memkernels.fusions.common.half_gemm import addmm_float32_
from memkernels.fusions.op_spec import OpSpec, Step


# --------------------------------------------------------------------------------------------
# Steps (memkernels/fusions/op_spec.py, as in gelu_linear): the whole forward and the backward, each a custom
# op; the last argument, ``backend``, picks the Triton elementwise passes or their PyTorch twins.


def halves(gate_up):
    """(gate, up) 2-D views of a packed [..., 2*I] tensor: first half gate."""
    gate_up2d = gate_up.reshape(-1, gate_up.shape[-1])
    width = gate_up2d.shape[1] // 2
    return gate_up2d[:, :width], gate_up2d[:, width:]


def _operands(gate, up):
    """2-D gate and up; ``up`` None means ``gate`` is the packed gate_up."""
    if up is None:
        return halves(gate)
    return gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])


def _forward(gate, up, weight, bias, activation, backend):
    """[..., N] from gate and up [..., I] (or a packed [..., 2*I] gate_up and up None)."""
    return act_linear.forward(*_operands(gate, up), weight, bias, activation, backend, lead=gate.shape[:-1])


# --------------------------------------------------------------------------------------------
# Autograd


def _down_backward(step, backend, activation, grad_out2d, gate2d, up2d, weight, packed, needs_inputs,
                   needs_weight, needs_bias):
    """(gradients of gate and up: [one [M, 2*I] tensor] if packed else [d_gate, d_up]; dW; db) of the gated
    down projection, each only when needed; ``step`` is the backward step to call."""
    grads = grad_weight = grad_bias = None
    if needs_inputs or needs_weight:
        results = step(grad_out2d, gate2d, up2d, weight, packed, needs_inputs, needs_weight, activation, backend)
        grads = results[:-1] if needs_weight else results
        grad_weight = results[-1] if needs_weight else None
        del results
    if needs_bias:
        grad_bias = bias_grad(grad_out2d)
    return (grads if needs_inputs else None), grad_weight, grad_bias


def _setup_context(ctx, inputs, output):
    """Saves only gate and up, or the packed gate_up (and the weight parameter)."""
    gate, up, weight, bias, activation, backend = inputs
    ctx.save_for_backward(gate, up, weight)
    ctx.has_bias = bias is not None
    ctx.activation = activation
    ctx.backend = backend


def _operand_grads(grads, gate, up, needs):
    """(d_gate, d_up) in gate's and up's shapes from the backward step's 2-D input gradients ([d_gate_up] when
    packed, up None), each only where ``needs`` (ctx.needs_input_grad) asks for it; ``grads`` None: none."""
    if grads is None:
        return None, None
    return (grads[0].view(gate.shape) if needs[0] else None,
            grads[1].view(up.shape) if up is not None and needs[1] else None)


def _backward_formula(ctx, steps, grad_out):
    gate, up, weight = ctx.saved_tensors
    gate2d, up2d = _operands(gate, up)
    needs = ctx.needs_input_grad
    grads, grad_weight, grad_bias = _down_backward(
        steps.backward, ctx.backend, ctx.activation, grad_out.reshape(-1, grad_out.shape[-1]), gate2d, up2d, weight,
        up is None, needs[0] or needs[1], needs[2], ctx.has_bias and needs[3])
    return *_operand_grads(grads, gate, up, needs), grad_weight, grad_bias, None, None


GATED_LINEAR = OpSpec(
    "gated_linear",
    Step("gated_linear", _forward,
         lambda gate, up, weight, bias, activation, backend: gate.new_empty(*gate.shape[:-1], weight.shape[0]),
         schema="(Tensor gate, Tensor? up, Tensor weight, Tensor? bias, str activation, str backend) -> Tensor"),
    steps={
        "backward": Step(
            "gated_linear_backward", act_linear.backward, act_linear.backward_fake,
            schema="(Tensor grad_out2d, Tensor gate2d, Tensor up2d, Tensor weight, bool packed, bool needs_inputs, "
                   "bool needs_weight, str activation, str backend) -> Tensor[]"),
        # the recomputed MLP's chunked backward (GatedMLPRecomputeFunction), which keeps the product for dW
        "backward_product": Step(
            "gated_linear_backward_product", act_linear.backward_keeping_product,
            act_linear.backward_keeping_product_fake,
            schema="(Tensor grad_out2d, Tensor gate2d, Tensor up2d, Tensor weight, bool packed, str activation, "
                   "str backend) -> Tensor[]"),
    },
    setup_context=_setup_context, backward=_backward_formula,
    # A GEMM: under autocast gate, up, weight and bias are cast to the region's dtype, as F.linear's are.
    autocast={"cpu": "lower_precision_fp", "cuda": "lower_precision_fp"}, casts=(0, 1, 2, 3))


def _forward_with_adapter(gate, up, weight, bias, adapter, activation, backend):
    """(y [..., N], t [..., R]) from gate and up [..., I] (or a packed gate_up and up None) and a LoRA A [R, I]."""
    return act_linear.forward_with_adapter(*_operands(gate, up), weight, bias, adapter, activation, backend,
                                           lead=gate.shape[:-1])


def _forward_with_adapter_fake(gate, up, weight, bias, adapter, activation, backend):
    lead = gate.shape[:-1]
    return gate.new_empty(*lead, weight.shape[0]), gate.new_empty(*lead, adapter.shape[0], dtype=adapter.dtype)


def _backward_with_adapter(grad_out2d, grad_low2d, gate2d, up2d, weight, adapter, packed, needs_inputs, needs_weight,
                           needs_adapter, activation, backend):
    return act_linear.backward(grad_out2d, gate2d, up2d, weight, packed, needs_inputs, needs_weight, activation,
                               backend, adapter, grad_low2d, needs_adapter)


def _backward_with_adapter_fake(grad_out2d, grad_low2d, gate2d, up2d, weight, adapter, packed, needs_inputs,
                                needs_weight, needs_adapter, activation, backend):
    return act_linear.backward_fake(grad_out2d, gate2d, up2d, weight, packed, needs_inputs, needs_weight, activation,
                                    backend, adapter, grad_low2d, needs_adapter)


def _setup_context_with_adapter(ctx, inputs, output):
    """Saves gate and up (or gate_up), the weight and the adapter: what gated_linear saves, and A [R, I]."""
    gate, up, weight, bias, adapter, activation, backend = inputs
    ctx.save_for_backward(gate, up, weight, adapter)
    ctx.has_bias = bias is not None
    ctx.activation = activation
    ctx.backend = backend


def _backward_formula_with_adapter(ctx, steps, grad_out, grad_low):
    gate, up, weight, adapter = ctx.saved_tensors
    gate2d, up2d = _operands(gate, up)
    needs = ctx.needs_input_grad
    grad_out2d = grad_out.reshape(-1, grad_out.shape[-1])
    # t unused downstream (its gradient None): dL/dt is zero
    grad_low2d = (grad_out2d.new_zeros(grad_out2d.shape[0], adapter.shape[0], dtype=adapter.dtype) if grad_low is None
                  else grad_low.reshape(-1, grad_low.shape[-1]))
    needs_inputs = needs[0] or needs[1]
    results = steps.backward(grad_out2d, grad_low2d, gate2d, up2d, weight, adapter, up is None, needs_inputs,
                             needs[2], needs[4], ctx.activation, ctx.backend) \
        if needs_inputs or needs[2] or needs[4] else []
    grads = results[:(1 if up is None else 2)] if needs_inputs else None
    rest = results[len(grads or ()):]
    grad_weight = rest.pop(0) if needs[2] else None
    grad_adapter = rest.pop(0) if needs[4] else None
    grad_bias = bias_grad(grad_out2d) if ctx.has_bias and needs[3] else None
    return *_operand_grads(grads, gate, up, needs), grad_weight, grad_bias, grad_adapter, None, None


# gated_linear with a LoRA adapter on the down projection: t = c @ A.T from the same transient c, one GEMM more each
# way (peft's adapter path would hold its own copy of c, or here of gate and up cast to the adapter's dtype).
GATED_LINEAR_WITH_ADAPTER = OpSpec(
    "gated_linear_with_adapter",
    Step("gated_linear_with_adapter", _forward_with_adapter, _forward_with_adapter_fake,
         schema="(Tensor gate, Tensor? up, Tensor weight, Tensor? bias, Tensor adapter, str activation, "
                "str backend) -> (Tensor, Tensor)"),
    steps={"backward": Step(
        "gated_linear_with_adapter_backward", _backward_with_adapter, _backward_with_adapter_fake,
        schema="(Tensor grad_out2d, Tensor grad_low2d, Tensor gate2d, Tensor up2d, Tensor weight, Tensor adapter, "
               "bool packed, bool needs_inputs, bool needs_weight, bool needs_adapter, str activation, "
               "str backend) -> Tensor[]")},
    setup_context=_setup_context_with_adapter, backward=_backward_formula_with_adapter,
    autocast={"cpu": "lower_precision_fp", "cuda": "lower_precision_fp"}, casts=(0, 1, 2, 3, 4))


# Tokens per chunk of gated_mlp_recompute over a long input (module constant: tests shrink it). The
# I-wide tensors of a chunk (gate, up, their gradients, the product: five in backward) are what a recomputed
# MLP holds at once; 8192 tokens keep every GEMM compute-bound (M >= 4096 at H = 4096).
CHUNK_TOKENS = 8192


def chunk_tokens(rows, width, element_size, chunk_size=None):
    """Tokens per chunk of a recomputed gated MLP over ``rows`` tokens of intermediate size ``width``:
    ``chunk_size`` (default :data:`CHUNK_TOKENS`), at most what keeps one [chunk, width] tensor within
    act_linear.TRANSIENT_BYTES, split evenly (no short last chunk); ``rows`` when one chunk holds them all."""
    limit = min(chunk_size or CHUNK_TOKENS, max(1, act_linear.TRANSIENT_BYTES // max(1, width * element_size)))
    if rows <= limit:
        return max(rows, 1)
    count = -(-rows // limit)
    return -(-rows // count)


class GatedMLPRecomputeFunction(torch.autograd.Function):
    """down(act(gate(x)) * up(x)) saving only x (and the parameters): gate and up are recomputed in
    backward, two GEMMs of the MLP's nine.

    ``up_weight`` None: ``gate_weight`` [2*I, H] (and ``gate_bias``) is the packed gate_up projection.
    Over more tokens than :func:`chunk_tokens` gives, forward and backward run chunk by chunk, so the
    I-wide tensors held at once are a chunk's, not the sequence's; the weight and bias gradients are
    summed over the chunks in float32 for half dtypes (in their own dtype otherwise) and rounded once.
    """

    @staticmethod
    def forward(ctx, x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, activation, backend,
                chunk_size):
        x2d = x.reshape(-1, x.shape[-1])
        rows = x2d.shape[0]
        step = chunk_tokens(rows, down_weight.shape[1], x.element_size(), chunk_size)
        forward_step = GATED_LINEAR.step("forward")
        if step >= rows:
            # gate and up in x's leading shape: the step returns the output itself, not a view of it, which the
            # caller could not modify in place
            gate, up = _project(x2d, gate_weight, gate_bias, up_weight, up_bias)
            lead = x.shape[:-1]
            out = forward_step(gate.view(*lead, gate.shape[-1]), up.view(*lead, up.shape[-1]), down_weight,
                               down_bias, activation, backend)
        else:
            out = x.new_empty(*x.shape[:-1], down_weight.shape[0])
            out2d = out.view(rows, down_weight.shape[0])
            for start in range(0, rows, step):
                part = slice(start, start + step)
                out2d[part] = forward_step(*_project(x2d[part], gate_weight, gate_bias, up_weight, up_bias),
                                           down_weight, down_bias, activation, backend)
        ctx.save_for_backward(x, gate_weight, gate_bias, up_weight, up_bias, down_weight)
        ctx.has_down_bias = down_bias is not None
        ctx.activation = activation
        ctx.backend = backend
        ctx.step = step
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, gate_weight, gate_bias, up_weight, up_bias, down_weight = ctx.saved_tensors
        x2d = x.reshape(-1, x.shape[-1])
        grad_out2d = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.step < x2d.shape[0]:
            grads = _chunked_backward(ctx, x2d, grad_out2d, gate_weight, gate_bias, up_weight, up_bias, down_weight)
        else:
            grads = _whole_backward(ctx, x2d, grad_out2d, gate_weight, gate_bias, up_weight, up_bias, down_weight)
        grad_x, *rest = grads
        return (None if grad_x is None else grad_x.view(x.shape), *rest, None, None, None)


def _whole_backward(ctx, x2d, grad_out2d, gate_weight, gate_bias, up_weight, up_bias, down_weight):
    """(grad_x [M, H], dW and db of gate, of up, of down) over all tokens at once."""
    needs = ctx.needs_input_grad
    projections_need = any(needs[:5])
    gate2d, up2d = _project(x2d, gate_weight, gate_bias, up_weight, up_bias)
    grads, grad_down_weight, grad_down_bias = _down_backward(
        GATED_LINEAR.step("backward"), ctx.backend, ctx.activation, grad_out2d, gate2d, up2d, down_weight,
        up_weight is None, projections_need, needs[5], ctx.has_down_bias and needs[6])
    del gate2d, up2d  # the recomputed activations go before the projections' gradients come
    grad_x = grad_gate_weight = grad_gate_bias = grad_up_weight = grad_up_bias = None
    if projections_need:
        # each projection's output gradient is dropped as soon as it is used, as eager's autograd does
        grad_gate, *grad_up = grads
        del grads
        grad_x, grad_gate_weight, grad_gate_bias = _projection_backward(
            grad_gate, x2d, gate_weight, gate_bias, needs[0], needs[1], needs[2], None)
        del grad_gate
        if grad_up:
            grad_x, grad_up_weight, grad_up_bias = _projection_backward(
                grad_up[0], x2d, up_weight, up_bias, needs[0], needs[3], needs[4], grad_x)
    return grad_x, grad_gate_weight, grad_gate_bias, grad_up_weight, grad_up_bias, grad_down_weight, grad_down_bias


def _sum_dtype(dtype):
    """The dtype a gradient is summed over chunks in: float32 for half dtypes (rounded once, at the end)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _chunked_backward(ctx, x2d, grad_out2d, gate_weight, gate_bias, up_weight, up_bias, down_weight):
    """_whole_backward's gradients, ``ctx.step`` tokens at a time: per chunk gate and up are recomputed, the
    down projection's backward gives their gradients and the product c (:func:`act_linear.backward_keeping_product`),
    and every weight and bias gradient is added into a zeroed buffer of :func:`_sum_dtype`; grad_x is written row block by
    row block."""
    needs = ctx.needs_input_grad
    packed = up_weight is None
    parameters = (gate_weight, gate_bias, up_weight, up_bias, down_weight)  # needs[1:6]
    sums = {index: torch.zeros(tensor.shape, dtype=_sum_dtype(tensor.dtype), device=tensor.device)
            for index, tensor in enumerate(parameters) if tensor is not None and needs[index + 1]}
    down_bias_sum = None
    if ctx.has_down_bias and needs[6]:
        down_bias_sum = grad_out2d.new_zeros(down_weight.shape[0], dtype=_sum_dtype(grad_out2d.dtype))
    grad_x = x2d.new_empty(x2d.shape) if needs[0] else None
    projections = ((gate_weight, 0, 1),) if packed else ((gate_weight, 0, 1), (up_weight, 2, 3))
    backward_step = GATED_LINEAR.step("backward_product")
    for start in range(0, x2d.shape[0], ctx.step):
        part = slice(start, start + ctx.step)
        x_part, grad_out_part = x2d[part], grad_out2d[part]
        *grads, product = backward_step(grad_out_part, *_project(x_part, gate_weight, gate_bias, up_weight, up_bias),
                                        down_weight, packed, ctx.activation, ctx.backend)
        if 4 in sums:
            addmm_float32_(sums[4], grad_out_part.t(), product)
        del product
        if down_bias_sum is not None:
            down_bias_sum.add_(grad_out_part.sum(0, dtype=down_bias_sum.dtype))
        for grad, (weight, weight_index, bias_index) in zip(grads, projections):
            if grad_x is not None and weight_index == 0:
                torch.mm(grad, weight, out=grad_x[part])
            elif grad_x is not None:
                grad_x[part].addmm_(grad, weight)
            if weight_index in sums:
                addmm_float32_(sums[weight_index], grad.t(), x_part)
            if bias_index in sums:
                sums[bias_index].add_(grad.sum(0, dtype=sums[bias_index].dtype))
        del grads
    results = [sums[index].to(parameters[index].dtype) if index in sums else None for index in range(5)]
    down_bias_grad = None if down_bias_sum is None else down_bias_sum.to(grad_out2d.dtype)
    return grad_x, *results, down_bias_grad


def _projection_backward(grad, x2d, weight, bias, needs_x, needs_weight, needs_bias, grad_x):
    """(grad_x plus this projection's dx, dW, db) of ``F.linear(x2d, weight, bias)`` from its output's gradient.

    The two projections' dx are summed as eager's autograd sums them (each rounded, then added), not with
    addmm_'s one rounding: the recompute MLP's gradients are then bitwise those of the saving variant, which a
    plan that switches one for the other relies on (tests/test_plan.py)."""
    if needs_x:
        grad_x = grad @ weight if grad_x is None else grad_x.add_(grad @ weight)
    grad_weight = grad.t() @ x2d if needs_weight else None
    grad_bias = bias_grad(grad) if bias is not None and needs_bias else None
    return grad_x, grad_weight, grad_bias


def _project(x2d, gate_weight, gate_bias, up_weight, up_bias):
    """(gate, up) [M, I] each from x2d [M, H]; ``up_weight`` None: one packed gate_up projection."""
    if up_weight is None:
        return halves(F.linear(x2d, gate_weight, gate_bias))
    return F.linear(x2d, gate_weight, gate_bias), F.linear(x2d, up_weight, up_bias)


# --------------------------------------------------------------------------------------------
# Public functions


def _check_tensor(name, tensor, like, owner):
    if tensor.device != like.device:
        raise ValueError(f"{owner}: {name} is on {tensor.device} but the input is on {like.device}; "
                         "move them to the same device")
    if tensor.dtype != like.dtype:
        raise ValueError(f"{owner}: {name} is {tensor.dtype} but the input is {like.dtype}; cast them to one dtype")


def check_activation(activation, owner):
    if activation not in ACTIVATIONS:
        raise ValueError(f"{owner}: activation={activation!r} is not supported; use one of {', '.join(ACTIVATIONS)} "
                         "(Hugging Face's 'gelu_pytorch_tanh' is 'gelu_tanh')")


def _check_weight(weight, bias, width, like, owner):
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{owner}: weight must be a 2-D tensor of shape [out_features, intermediate_size]")
    if weight.shape[1] != width:
        raise ValueError(f"{owner}: intermediate size mismatch: gate and up have {width} features (last dim) but "
                         f"weight {tuple(weight.shape)} expects {weight.shape[1]}; weight must be "
                         "[out_features, intermediate_size]")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{owner}: bias has shape {tuple(bias.shape)}; expected ({weight.shape[0]},) (out_features)")
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None:
            _check_tensor(name, tensor, like, owner)


def gated_linear(gate=None, up=None, weight=None, bias=None, *, gate_up=None, activation="silu", backend=None,
                 adapter=None):
    """``F.linear(act(gate) * up, weight, bias)`` without storing act(gate) or the product.

    Two forms: ``gated_linear(gate, up, weight, bias)`` and ``gated_linear(gate_up=..., weight=...)``
    for a packed [..., 2*I] tensor whose first half is gate and second half up (the layout of
    Phi-3's ``gate_up_proj`` and of vLLM-style merged checkpoints: ``gate, up = gate_up.chunk(2, -1)``).

    Args:
        gate, up: [..., I] each, float32 / float16 / bfloat16 (the torch backend takes any
            floating dtype), same shape, dtype and device.
        weight: [out_features, I], same dtype and device; any strides.
        bias: optional [out_features].
        gate_up: [..., 2*I] instead of gate and up.
        activation: "silu" (SwiGLU: Llama, Mistral, Qwen, Phi-3), "gelu" (erf) or "gelu_tanh"
            (GeGLU: Gemma's ``gelu_pytorch_tanh``).
        backend: None picks by device (Triton on CUDA, the PyTorch reference elsewhere, see
            memkernels.set_backend); "torch" forces the reference, "triton" the kernels.
        adapter: a LoRA A weight [R, I] on this down projection (any floating dtype, same device; peft keeps
            it float32 beside a half base): returns ``(y, c @ adapter.T)``, the second [..., R] in the
            adapter's dtype, from the same transient c (cast to the adapter's dtype as peft casts its
            input): one GEMM more each way, nothing more saved than the adapter. Not with DTensors.

    Returns:
        [..., out_features] in the inputs' dtype (with ``adapter``, the pair above). Only gate and up (or gate_up), and weight, are saved
        for backward: 2*I elements per token, against eager's 4*I. Under ``torch.autocast`` every
        tensor argument is cast to the region's dtype first, as ``F.linear`` casts its own. DTensors (tensor
        parallelism): gate and up sharded over I with weight sharded over its columns (colwise then rowwise:
        partial sums), or sharded over tokens with a replicated weight
        (``memkernels.fusions.common.act_linear.on_dtensors``); not the packed form.
    """
    if any(is_dtensor(t) for t in (gate, up, weight, bias, gate_up, adapter)):
        if adapter is not None:
            raise ValueError("gated_linear: adapter= takes no DTensors (a LoRA adapter on a tensor-parallel down "
                             "projection is not fused); run the adapter separately")
        return _gated_linear_dtensor(gate, up, weight, bias, gate_up, activation, backend)
    return GATED_LINEAR.with_autocast(functools.partial(_gated_linear, activation=activation, backend=backend),
                                      gate, up, weight, bias, gate_up, adapter, positions=range(6))


def _gated_linear_dtensor(gate, up, weight, bias, gate_up, activation, backend):
    """gated_linear on DTensors (tensor parallelism): see :func:`memkernels.fusions.common.act_linear.on_dtensors`."""
    owner = "gated_linear"
    if gate_up is not None:
        raise ValueError(f"{owner}: the packed gate_up= form takes no DTensor (a shard of gate_up is not a shard of "
                         "gate and one of up); pass gate and up")
    return act_linear.on_dtensors(owner, (gate, up), weight, bias, lambda operands, weight_local: gated_linear(
        *operands, weight_local, activation=activation, backend=backend))


def _gated_linear(gate, up, weight, bias, gate_up, adapter, *, activation, backend):
    owner = "gated_linear"
    check_activation(activation, owner)
    if gate_up is not None:
        if gate is not None or up is not None:
            raise ValueError(f"{owner}: pass either gate and up, or gate_up=, not both")
        if not isinstance(gate_up, torch.Tensor) or gate_up.dim() < 1 or gate_up.shape[-1] % 2:
            raise ValueError(f"{owner}: gate_up must be a tensor of shape [..., 2 * intermediate_size] (an even "
                             f"last dim), got {tuple(gate_up.shape) if isinstance(gate_up, torch.Tensor) else gate_up}")
        _check_weight(weight, bias, gate_up.shape[-1] // 2, gate_up, owner)
        gate, up, what = gate_up, None, "gate_up"
    else:
        if not isinstance(gate, torch.Tensor) or not isinstance(up, torch.Tensor) or gate.dim() < 1:
            raise ValueError(f"{owner}: gate and up must be tensors of shape [..., intermediate_size] "
                             "(or pass gate_up= for the packed form)")
        if gate.shape != up.shape:
            raise ValueError(f"{owner}: gate has shape {tuple(gate.shape)} but up {tuple(up.shape)}; they must match")
        _check_tensor("up", up, gate, owner)
        _check_weight(weight, bias, gate.shape[-1], gate, owner)
        what = "gate"
    resolved = GATED_LINEAR.backend(backend, gate, owner, what)
    if adapter is None:
        return GATED_LINEAR(gate, up, weight, bias, activation, resolved)
    width = weight.shape[1]
    if not isinstance(adapter, torch.Tensor) or adapter.dim() != 2 or adapter.shape[1] != width:
        raise ValueError(f"{owner}: adapter must be a LoRA A weight of shape [rank, intermediate_size={width}], got "
                         f"{tuple(adapter.shape) if isinstance(adapter, torch.Tensor) else adapter}")
    if adapter.device != gate.device or not adapter.is_floating_point():
        raise ValueError(f"{owner}: adapter must be a floating tensor on {gate.device} (the input's device), got "
                         f"{adapter.dtype} on {adapter.device}")
    return GATED_LINEAR_WITH_ADAPTER(gate, up, weight, bias, adapter, activation, resolved)


def gated_mlp_recompute(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, *,
                        activation="silu", backend=None, chunk_size=None):
    """``down(act(gate(x)) * up(x))`` saving only x: gate and up are recomputed in backward.

    x: [..., H]; gate_weight / up_weight: [I, H] (or ``up_weight`` None and ``gate_weight`` the packed
    [2*I, H] gate_up projection, first half gate); down_weight: [N, I]; biases optional. All one dtype
    and device. Returns [..., N]. Used by ``FusedGatedMLP(recompute=True)``. Under ``torch.autocast``
    every tensor argument is cast to the region's dtype first, as the three ``F.linear`` calls would be.

    ``chunk_size``: tokens per chunk over a long input (default :data:`CHUNK_TOKENS`, 8192; fewer where one
    [chunk, I] tensor would pass 1 GiB): forward and backward hold the I-wide tensors of one chunk (backward
    five: gate, up, their gradients, the product), not of the whole input, and the weight and bias gradients
    are summed over chunks in float32 buffers for half dtypes (weight-sized: 4 bytes an element of the three
    projections, beside the gradients themselves). An input of at most one chunk runs whole, as before.
    """
    run = functools.partial(_gated_mlp_recompute, activation=activation, backend=backend, chunk_size=chunk_size)
    return GATED_LINEAR.with_autocast(run, x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias,
                                      positions=range(7))


def _gated_mlp_recompute(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, *, activation,
                         backend, chunk_size):
    owner = "gated_mlp_recompute"
    check_activation(activation, owner)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"{owner}: chunk_size={chunk_size!r} must be a positive number of tokens (or None for "
                         f"the default, {CHUNK_TOKENS})")
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"{owner}: x must be a tensor of shape [..., hidden_size]")
    projections = [("gate_weight", gate_weight, gate_bias)] + ([] if up_weight is None else
                                                               [("up_weight", up_weight, up_bias)])
    rows = set()
    for name, weight, bias in projections:
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
            raise ValueError(f"{owner}: {name} must be [intermediate_size, hidden_size={x.shape[-1]}], got "
                             f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else weight}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{owner}: the bias of {name} has shape {tuple(bias.shape)}; expected "
                             f"({weight.shape[0]},)")
        for label, tensor in ((name, weight), (f"bias of {name}", bias)):
            if tensor is not None:
                _check_tensor(label, tensor, x, owner)
        rows.add(weight.shape[0])
    if len(rows) != 1 or (up_weight is None and gate_weight.shape[0] % 2):
        raise ValueError(f"{owner}: gate and up projections must have the same number of rows (a packed gate_up "
                         f"an even number), got {sorted(rows)}")
    width = gate_weight.shape[0] // 2 if up_weight is None else gate_weight.shape[0]
    _check_weight(down_weight, down_bias, width, x, owner)
    return GatedMLPRecomputeFunction.apply(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias,
                                           activation, GATED_LINEAR.backend(backend, x, owner, "x"), chunk_size)
