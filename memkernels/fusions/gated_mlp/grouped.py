"""Routed experts' gated down projection (mixture-of-experts MLPs): rows grouped by expert, each group
``y = (act(gate) * up) @ weight[e].T``, from the packed [S, 2*I] gate_up of the routed tokens.

The dense gated_linear's memory contract for experts: eager PyTorch keeps gate_up, act(gate) and the
product per routed token (4*I elements) for backward; here only gate_up (2*I) is saved. The algorithm is
memkernels/fusions/common/act_linear.py's with the GEMMs grouped:

- forward:  c = act(gate) * up                    one elementwise pass into a transient buffer
            y = grouped(c @ weight[e].T)          one grouped GEMM; c is freed
- backward: g = grouped(dy @ weight[e])           [S, I]: dL/dc
            one pass: d_gate, d_up from g, and c over g
            dW[e] = dy[rows of e].T @ c[rows of e]   one grouped GEMM (2-D x 2-D -> [E, N, I])

Rows are sorted by expert; ``offsets`` [E] (int32) holds each group's end row (a cumulative sum of the
tokens per expert). The grouped GEMMs are ``torch._grouped_mm`` where the installed torch runs it for
these operands (CPU: float32 / float16 / bfloat16 with 16-byte aligned strides; CUDA and meta: bfloat16),
else a loop over experts, which reads ``offsets`` on the host (a device sync on CUDA) and runs one GEMM an
expert: :func:`grouped_mm`.

The experts' gate_up projection, :func:`grouped_gather_mm`: gate_up [S, 2*I] from the token-ordered hidden states
[T, H] and each routed row's token (``rows`` [S]), the gathered rows [S, H] transient in forward and gathered
again in backward; saved: the hidden states (which the caller keeps: the router reads them), the row-to-token
index and the weights, so no H-wide tensor per routed token. The default experts path is grouped_gather_mm then
grouped_gated_linear: per routed token gate_up (2*I) and the index are saved.

``mlp="recompute"``: :func:`grouped_gated_mlp_recompute` is the whole experts' MLP from the same inputs, as two ops:
grouped_gather_mm, then the down projection above recomputing gate_up in backward (grouped_gated_linear_recomputing:
one more grouped GEMM and gather). Neither saves gate_up: no tensor is saved per routed token beyond the index,
where the default path saves gate_up (2*I). Two ops, so that autograd adds and frees one weight gradient before
the next is made, as in eager.

Routing weights: ``row_weights`` [S] multiplies each row's output inside the down projection (in float32 where
they are, as ``routed * weights`` promotes), and its gradient <dy_r, c_r W^T> = <dy_r W, c_r> comes from the g the
backward computes anyway (an elementwise product and a sum over I), so the unweighted [S, N] output is not saved
for it, as ``routed * weights`` saves it.

Long inputs: over more routed rows than the dense recompute's token chunks, each step runs a run of whole experts at
a time (:func:`expert_chunks`), so that its row-sized transients (the gathered rows, the recomputed gate_up, dL/dc)
are a run's; the outputs (gate_up or its gradient, the hidden states' gradient) are every row's, as they must be.
A run never splits an expert: each expert's weight gradient is still one GEMM on the same rows, bitwise as in one
run.

File order: the grouped GEMM → steps → autograd and OpSpec → public functions.
"""
import functools

import torch

from memkernels.fusions.common import act_linear
from memkernels.fusions.gated_mlp.op import check_activation, chunk_tokens, halves
from memkernels.fusions.op_spec import OpSpec, Step


# --------------------------------------------------------------------------------------------
# The grouped GEMM


def _aligned(tensor):
    """torch._grouped_mm's layout rule: every stride but the unit one a multiple of 16 bytes, and the data too."""
    size = tensor.element_size()
    return tensor.data_ptr() % 16 == 0 and all(stride == 1 or (stride * size) % 16 == 0 for stride in tensor.stride())


def _grouped_mm_runs(a, b):
    if a.device.type == "meta":  # no offsets to loop over; profile.meta_forward lets other dtypes than bf16 through
        return True
    if a.dtype != b.dtype:
        return False
    if a.device.type == "cpu":
        return a.dtype in (torch.float32, torch.float16, torch.bfloat16) and _aligned(a) and _aligned(b)
    return a.dtype == torch.bfloat16 and _aligned(a) and _aligned(b)


def grouped_mm(a, b, offsets):
    """Per expert e, the rows (or, for 2-D ``b``, the columns of ``a`` and rows of ``b``) from ``offsets[e-1]`` to
    ``offsets[e]``: ``a`` [S, K] x ``b`` [E, K, N] -> [S, N]; ``a`` [M, S] x ``b`` [S, N] -> [E, M, N] (a weight
    gradient; an expert without rows gets zeros). torch._grouped_mm where it runs, else a loop over experts
    (differentiable in the first form, as torch._grouped_mm is, for callers under autograd; the ops here call it
    with grad off)."""
    if _grouped_mm_runs(a, b):
        return torch._grouped_mm(a, b, offs=offsets)
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
            # autograd records no out= op: one GEMM an expert into its own tensor, then one copy into the result
            return torch.cat([a[start:end] @ b[expert] for expert, (start, end) in enumerate(zip(starts, ends))])
        out = a.new_empty(a.shape[0], b.shape[-1])
        for expert, (start, end) in enumerate(zip(starts, ends)):
            torch.mm(a[start:end], b[expert], out=out[start:end])
        return out
    out = a.new_empty(len(ends), a.shape[0], b.shape[-1])
    for expert, (start, end) in enumerate(zip(starts, ends)):
        torch.mm(a[:, start:end], b[start:end], out=out[expert])
    return out


# --------------------------------------------------------------------------------------------
# Steps: the forward and the backward, each a custom op (memkernels/fusions/op_spec.py)


def expert_chunks(offsets, rows, width, element_size, grad_weight_bytes=0):
    """[(experts, rows, offsets)] to run a step over: runs of whole experts (slices of the experts and of the rows,
    and the run's own end rows) of at most :func:`~memkernels.fusions.gated_mlp.op.chunk_tokens` rows each, as
    the dense recompute chunks tokens (an expert with more rows is a run alone), so that a step's transients of
    ``width`` elements a row are a run's, not every routed row's; a run never splits an expert, so each expert's
    weight gradient is one GEMM, as unchunked. A step that makes a weight gradient (``grad_weight_bytes``) makes a
    run's share of it apart and copies it in (torch._grouped_mm writes into no given buffer): it runs in one run
    unless its transients outweigh that gradient (Qwen3-30B-A3B, top-8: past 12,288 tokens for the down
    projection's backward, 24,576 for the gather's; the forwards past 1,024). One run, ``offsets`` itself, when
    every row fits one; only else are the offsets read on the host (one device sync a step), and on meta (a
    planner's profile, no values) the rows are taken as spread evenly over the experts."""
    experts = offsets.shape[0]
    limit = chunk_tokens(rows, width, element_size)
    if limit >= rows or rows * width * element_size <= grad_weight_bytes:
        return [(slice(0, experts), slice(0, rows), offsets)]
    ends = [(expert + 1) * rows // experts for expert in range(experts)] if offsets.device.type == "meta" \
        else offsets.tolist()
    bounds, first, start = [], 0, 0
    for expert in range(1, experts):
        if ends[expert] - start > limit:  # expert does not fit beside the run so far: the run ends before it
            bounds.append((first, expert, start, ends[expert - 1]))
            first, start = expert, ends[expert - 1]
    bounds.append((first, experts, start, rows))
    return [(slice(first, end), slice(start, stop), offsets[first:end] - start) for first, end, start, stop in bounds]


def _joined(whole, where, part):
    """A step's result made run by run: ``part``, one run's, written at ``where`` into ``whole`` (the buffer made
    for several runs), or with one run (``whole`` None) the step's result itself."""
    if whole is None:
        return part
    whole[where] = part
    return whole


def _forward(gate_up, weight, offsets, row_weights, activation, backend):
    """[S, N] from gate_up [S, 2*I] and weight [E, N, I], each row times its ``row_weights`` [S] entry (when given)."""
    chunks = expert_chunks(offsets, gate_up.shape[0], weight.shape[2], gate_up.element_size())
    out = gate_up.new_empty(gate_up.shape[0], weight.shape[1]) if len(chunks) > 1 else None
    for experts, rows, run_offsets in chunks:
        out = _joined(out, rows, _forward_rows(gate_up[rows], weight[experts], run_offsets, activation, backend))
    if row_weights is None:
        return out
    # in the weights' dtype where they are wider (a float32 router beside bf16 experts), as routed * weights
    return out.mul_(row_weights.unsqueeze(-1)) if row_weights.dtype == out.dtype else out * row_weights.unsqueeze(-1)


def _forward_rows(gate_up, weight, offsets, activation, backend):
    product = act_linear.PASSES[backend].product(*halves(gate_up), activation)
    return grouped_mm(product, weight.transpose(-2, -1), offsets)


def _backward(grad_out, gate_up, weight, offsets, row_weights, needs_input, needs_weight, needs_row_weights,
              activation, backend, gathered=None):
    """[d_gate_up [S, 2*I]] when ``needs_input``, then [dW [E, N, I]] when ``needs_weight``, then [d_row_weights
    [S]] when ``needs_row_weights``. ``gathered``: (hidden states, rows, gate_up_proj) to recompute gate_up from,
    run by run, in place of ``gate_up`` (None then)."""
    width = weight.shape[2] if gathered is None else max(2 * weight.shape[2], gathered[0].shape[1])
    chunks = expert_chunks(offsets, grad_out.shape[0], width, grad_out.element_size(),
                           weight.numel() * weight.element_size() if needs_weight else 0)
    grad_gate_up = weight.new_empty(grad_out.shape[0], 2 * weight.shape[2]) if needs_input else None
    grad_weight = weight.new_empty(weight.shape) if needs_weight and len(chunks) > 1 else None
    grad_row_weights = row_weights.new_empty(row_weights.shape) if needs_row_weights else None
    for experts, rows, run_offsets in chunks:
        run_gate_up = gate_up[rows] if gathered is None else _gather_rows(
            gathered[0], gathered[1][rows], gathered[2][experts], run_offsets)
        grad_run = _backward_rows(
            grad_out[rows], run_gate_up, weight[experts], run_offsets, None if row_weights is None else
            row_weights[rows], needs_weight, activation, backend, None if grad_gate_up is None else grad_gate_up[rows],
            None if grad_row_weights is None else grad_row_weights[rows])
        del run_gate_up
        grad_weight = _joined(grad_weight, experts, grad_run)
    return [grad for grad in (grad_gate_up, grad_weight, grad_row_weights) if grad is not None]


def _backward_rows(grad_out, gate_up, weight, offsets, row_weights, needs_weight, activation, backend, grad_gate_up,
                   grad_row_weights):
    """One run's dW (when ``needs_weight``), its d_gate_up written into ``grad_gate_up`` and its rows' weights'
    gradient into ``grad_row_weights`` (when given). Weighted rows: the output y_r = w_r (c_r W^T) saved nothing
    H-wide for w's gradient, <dy_r, c_r W^T> = <dy_r W, c_r>, a dot over I of the GEMM backward makes anyway."""
    passes = act_linear.PASSES[backend]
    gate, up = halves(gate_up)
    scale = None if row_weights is None else row_weights.unsqueeze(-1)
    grad_out = grad_out.to(gate_up.dtype)  # a wider weights' output gradient: the GEMMs' dtype, as eager's dy is
    if grad_gate_up is not None or grad_row_weights is not None:
        product = grouped_mm(grad_out, weight, offsets)  # dL/dc of unit row weights, then c
        if grad_row_weights is not None:
            _row_dots(passes.product(gate, up, activation), product, grad_row_weights)
        if scale is not None:
            product.mul_(scale)
        if grad_gate_up is not None:
            passes.product_backward(product, gate, up, activation, *halves(grad_gate_up), needs_weight)
        elif needs_weight:
            product = passes.product(gate, up, activation)
    else:
        product = passes.product(gate, up, activation)
    if not needs_weight:
        return None
    if scale is not None:  # dW = sum_r (w_r dy_r)^T c_r
        product.mul_(scale)
    return grouped_mm(grad_out.t(), product, offsets)


def _row_dots(c, grad, out):
    """out[r] = <c[r], grad[r]> ([R, I] each), elementwise work in c's buffer as eager's (dy * y).sum is: in c's dtype
    for weights of that dtype, else in the weights' (float32) a block of rows at a time."""
    if out.dtype == c.dtype:
        torch.sum(c.mul_(grad), -1, out=out)
        return
    for start in range(0, c.shape[0], ROW_DOT_BLOCK):
        block = slice(start, start + ROW_DOT_BLOCK)
        torch.sum(c[block].to(out.dtype).mul_(grad[block]), -1, out=out[block])


# Rows a float32 block of _row_dots holds (I elements each): 32 MiB at I = 1024.
ROW_DOT_BLOCK = 8192


def _backward_fake(grad_out, gate_up, weight, offsets, row_weights, needs_input, needs_weight, needs_row_weights,
                   activation, backend):
    return ([gate_up.new_empty(gate_up.shape)] if needs_input else []) + (
        [weight.new_empty(weight.shape)] if needs_weight else []) + (
        [row_weights.new_empty(row_weights.shape)] if needs_row_weights else [])


def _gather_forward(hidden_states, rows, gate_up_proj, offsets):
    """gate_up [S, 2*I]: hidden_states [T, H] gathered by ``rows`` [S] (each row's token), grouped through
    gate_up_proj [E, 2*I, H]; the gathered rows are transient, a run of experts' at a time. No elementwise pass, so
    no backend argument."""
    chunks = expert_chunks(offsets, rows.shape[0], hidden_states.shape[1], hidden_states.element_size())
    out = hidden_states.new_empty(rows.shape[0], gate_up_proj.shape[1]) if len(chunks) > 1 else None
    for experts, run, run_offsets in chunks:
        out = _joined(out, run, _gather_rows(hidden_states, rows[run], gate_up_proj[experts], run_offsets))
    return out


def _gather_rows(hidden_states, rows, gate_up_proj, offsets):
    return grouped_mm(hidden_states[rows], gate_up_proj.transpose(-2, -1), offsets)


def _gather_backward(grad_gate_up, hidden_states, rows, gate_up_proj, offsets, needs_input, needs_weight):
    """[d_hidden_states [T, H]] when ``needs_input`` (the rows' gradients summed per token, as autograd sums an
    index's), then [d_gate_up_proj [E, 2*I, H]] when ``needs_weight``; the rows gathered again for it. A run of
    experts at a time over many rows (:func:`expert_chunks`)."""
    chunks = expert_chunks(offsets, rows.shape[0], hidden_states.shape[1], hidden_states.element_size(),
                           gate_up_proj.numel() * gate_up_proj.element_size() if needs_weight else 0)
    grad_hidden = hidden_states.new_zeros(hidden_states.shape) if needs_input else None
    grad_weight = gate_up_proj.new_empty(gate_up_proj.shape) if needs_weight and len(chunks) > 1 else None
    for experts, run, run_offsets in chunks:
        if needs_input:
            grad_routed = grouped_mm(grad_gate_up[run], gate_up_proj[experts], run_offsets)
            grad_hidden.index_put_((rows[run],), grad_routed, accumulate=True)
            del grad_routed
        if needs_weight:
            grad_weight = _joined(grad_weight, experts,
                                  grouped_mm(grad_gate_up[run].t(), hidden_states[rows[run]], run_offsets))
    return [grad for grad in (grad_hidden, grad_weight) if grad is not None]


def _gather_backward_fake(grad_gate_up, hidden_states, rows, gate_up_proj, offsets, needs_input, needs_weight):
    return [tensor.new_empty(tensor.shape) for needs, tensor in ((needs_input, hidden_states),
                                                                 (needs_weight, gate_up_proj)) if needs]


def _recomputing_forward(gate_up, hidden_states, rows, gate_up_proj, weight, offsets, row_weights, activation,
                         backend):
    """:func:`_forward`'s [S, N]; hidden_states, rows and gate_up_proj go only to backward, to recompute gate_up."""
    return _forward(gate_up, weight, offsets, row_weights, activation, backend)


def _recomputing_backward(grad_out, hidden_states, rows, gate_up_proj, weight, offsets, row_weights, needs_input,
                          needs_weight, needs_row_weights, activation, backend):
    """:func:`_backward`'s results with gate_up recomputed (one more grouped GEMM), a run of experts at a time."""
    return _backward(grad_out, None, weight, offsets, row_weights, needs_input, needs_weight, needs_row_weights,
                     activation, backend, gathered=(hidden_states, rows, gate_up_proj))


def _recomputing_backward_fake(grad_out, hidden_states, rows, gate_up_proj, weight, offsets, row_weights, needs_input,
                               needs_weight, needs_row_weights, activation, backend):
    return ([weight.new_empty(rows.shape[0], 2 * weight.shape[2])] if needs_input else []) + (
        [weight.new_empty(weight.shape)] if needs_weight else []) + (
        [row_weights.new_empty(row_weights.shape)] if needs_row_weights else [])


# --------------------------------------------------------------------------------------------
# Autograd and the declaration


def _output_dtype(gate_up, row_weights):
    return gate_up.dtype if row_weights is None else torch.promote_types(gate_up.dtype, row_weights.dtype)


def _input_grads(ctx, positions, backward):
    """A backward formula's result, one entry an input: ``backward(*needs)`` (the backward step's results, in
    order, for the inputs at ``positions`` that need a gradient) at those inputs, None elsewhere; the step is not
    run when none does."""
    needs = [ctx.needs_input_grad[position] for position in positions]
    results = iter(backward(*needs) if any(needs) else ())
    grads = [None] * len(ctx.needs_input_grad)
    for position, need in zip(positions, needs):
        if need:
            grads[position] = next(results)
    return tuple(grads)


def _setup_context(ctx, inputs, output):
    gate_up, weight, offsets, row_weights, activation, backend = inputs
    ctx.save_for_backward(gate_up, weight, offsets, row_weights)
    ctx.activation, ctx.backend = activation, backend


def _backward_formula(ctx, steps, grad_out):
    gate_up, weight, offsets, row_weights = ctx.saved_tensors
    return _input_grads(ctx, (0, 1, 3), lambda *needs: steps.backward(
        grad_out.contiguous(), gate_up, weight, offsets, row_weights, *needs, ctx.activation, ctx.backend))


GROUPED_GATED_LINEAR = OpSpec(
    "grouped_gated_linear",
    Step("grouped_gated_linear", _forward,
         lambda gate_up, weight, offsets, row_weights, activation, backend:
         gate_up.new_empty(gate_up.shape[0], weight.shape[1], dtype=_output_dtype(gate_up, row_weights)),
         schema="(Tensor gate_up, Tensor weight, Tensor offsets, Tensor? row_weights, str activation, str backend) "
                "-> Tensor"),
    steps={"backward": Step(
        "grouped_gated_linear_backward", _backward, _backward_fake,
        schema="(Tensor grad_out, Tensor gate_up, Tensor weight, Tensor offsets, Tensor? row_weights, "
               "bool needs_input, bool needs_weight, bool needs_row_weights, str activation, str backend) -> Tensor[]")},
    setup_context=_setup_context, backward=_backward_formula,
    # A GEMM: under autocast gate_up and weight are cast to the region's dtype, as F.linear's are (row weights are
    # not: they come in that dtype or float32, as a router's do, and float32 ones promote the output, unrounded).
    autocast={"cpu": "lower_precision_fp", "cuda": "lower_precision_fp"}, casts=(0, 1))


def _gather_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # hidden_states, rows, gate_up_proj, offsets: not the output


def _gather_backward_formula(ctx, steps, grad_gate_up):
    hidden_states, rows, gate_up_proj, offsets = ctx.saved_tensors
    return _input_grads(ctx, (0, 2), lambda *needs: steps.backward(
        grad_gate_up.contiguous(), hidden_states, rows, gate_up_proj, offsets, *needs))


GROUPED_GATHER_MM = OpSpec(
    "grouped_gather_mm",
    Step("grouped_gather_mm", _gather_forward,
         lambda hidden_states, rows, gate_up_proj, offsets: hidden_states.new_empty(rows.shape[0],
                                                                                     gate_up_proj.shape[1]),
         schema="(Tensor hidden_states, Tensor rows, Tensor gate_up_proj, Tensor offsets) -> Tensor"),
    steps={"backward": Step(
        "grouped_gather_mm_backward", _gather_backward, _gather_backward_fake,
        schema="(Tensor grad_gate_up, Tensor hidden_states, Tensor rows, Tensor gate_up_proj, Tensor offsets, "
               "bool needs_input, bool needs_weight) -> Tensor[]")},
    setup_context=_gather_setup_context, backward=_gather_backward_formula,
    autocast={"cpu": "lower_precision_fp", "cuda": "lower_precision_fp"}, casts=(0, 2))


def _recomputing_setup_context(ctx, inputs, output):
    gate_up, hidden_states, rows, gate_up_proj, weight, offsets, row_weights, activation, backend = inputs
    ctx.save_for_backward(hidden_states, rows, gate_up_proj, weight, offsets, row_weights)  # not gate_up
    ctx.activation, ctx.backend = activation, backend


def _recomputing_backward_formula(ctx, steps, grad_out):
    hidden_states, rows, gate_up_proj, weight, offsets, row_weights = ctx.saved_tensors
    return _input_grads(ctx, (0, 4, 6), lambda *needs: steps.backward(
        grad_out.contiguous(), hidden_states, rows, gate_up_proj, weight, offsets, row_weights, *needs,
        ctx.activation, ctx.backend))


GROUPED_GATED_LINEAR_RECOMPUTING = OpSpec(
    "grouped_gated_linear_recomputing",
    Step("grouped_gated_linear_recomputing", _recomputing_forward,
         lambda gate_up, hidden_states, rows, gate_up_proj, weight, offsets, row_weights, activation, backend:
         gate_up.new_empty(gate_up.shape[0], weight.shape[1], dtype=_output_dtype(gate_up, row_weights)),
         schema="(Tensor gate_up, Tensor hidden_states, Tensor rows, Tensor gate_up_proj, Tensor weight, "
                "Tensor offsets, Tensor? row_weights, str activation, str backend) -> Tensor"),
    steps={"backward": Step(
        "grouped_gated_linear_recomputing_backward", _recomputing_backward, _recomputing_backward_fake,
        schema="(Tensor grad_out, Tensor hidden_states, Tensor rows, Tensor gate_up_proj, Tensor weight, "
               "Tensor offsets, Tensor? row_weights, bool needs_input, bool needs_weight, bool needs_row_weights, "
               "str activation, str backend) -> Tensor[]")},
    setup_context=_recomputing_setup_context, backward=_recomputing_backward_formula,
    autocast={"cpu": "lower_precision_fp", "cuda": "lower_precision_fp"}, casts=(0, 1, 3, 4))


# --------------------------------------------------------------------------------------------
# Public functions


def grouped_gated_linear(gate_up, weight, offsets, *, row_weights=None, activation="silu", backend=None):
    """Each expert's ``(act(gate) * up) @ weight[e].T`` over its rows, saving only gate_up for backward.

    Args:
        gate_up: [S, 2*I], the routed tokens' packed gate and up projections (first half gate), rows sorted
            by expert; float32 / float16 / bfloat16 (the torch backend takes any floating dtype).
        weight: [E, N, I], the experts' down projections (Hugging Face's stacked ``down_proj``), same dtype
            and device.
        offsets: [E] int32, each expert's end row (``tokens_per_expert.cumsum(0)``), ending at S.
        row_weights: None, or [S] on gate_up's device, of its dtype or float32: each row's routing weight,
            multiplied in (the router's top-k weights in row order), with its gradient, so that nothing H-wide is
            saved for it where ``out * weights`` outside saves the [S, N] output.
        activation: "silu", "gelu" or "gelu_tanh".
        backend: None (by device), "torch" or "triton", as gated_linear's.

    Returns:
        [S, N] in the inputs' dtype (float32 for float32 row weights beside half inputs, as ``out * weights``).
    """
    return GROUPED_GATED_LINEAR.with_autocast(
        functools.partial(_grouped_gated_linear, row_weights=row_weights, activation=activation, backend=backend),
        gate_up, weight, offsets)


def _grouped_gated_linear(gate_up, weight, offsets, *, row_weights, activation, backend):
    owner = "grouped_gated_linear"
    check_activation(activation, owner)
    if not isinstance(gate_up, torch.Tensor) or gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"{owner}: gate_up must be a 2-D tensor [routed tokens, 2 * intermediate_size], got "
                         f"{tuple(gate_up.shape) if isinstance(gate_up, torch.Tensor) else gate_up}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or weight.shape[2] != gate_up.shape[1] // 2:
        raise ValueError(f"{owner}: weight must be [experts, out_features, intermediate_size="
                         f"{gate_up.shape[1] // 2}], got {tuple(weight.shape) if isinstance(weight, torch.Tensor) else weight}")
    if weight.dtype != gate_up.dtype or weight.device != gate_up.device:
        raise ValueError(f"{owner}: weight is {weight.dtype} on {weight.device} but gate_up {gate_up.dtype} on "
                         f"{gate_up.device}; give them one dtype and device")
    _check_offsets(offsets, weight.shape[0], gate_up.device, owner)
    _check_row_weights(row_weights, gate_up.shape[0], gate_up, owner)
    return GROUPED_GATED_LINEAR(gate_up, weight, offsets, row_weights, activation,
                                GROUPED_GATED_LINEAR.backend(backend, gate_up, what="gate_up"))


def _check_row_weights(row_weights, count, like, owner):
    """row_weights None, or [count] on ``like``'s device, of its dtype or float32 (a router's, beside half experts)."""
    if row_weights is not None and (not isinstance(row_weights, torch.Tensor) or row_weights.shape != (count,)
                                    or row_weights.dtype not in (like.dtype, torch.float32)
                                    or row_weights.device != like.device):
        raise ValueError(f"{owner}: row_weights must be None or a tensor of shape ({count},) (one weight a routed "
                         f"row), dtype {like.dtype} or torch.float32 and device {like.device}; got "
                         f"{getattr(row_weights, 'shape', type(row_weights).__name__)}, "
                         f"{getattr(row_weights, 'dtype', None)} on {getattr(row_weights, 'device', None)}")


def _check_offsets(offsets, experts, device, owner):
    if (not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int32 or offsets.shape != (experts,)
            or offsets.device != device):
        raise ValueError(f"{owner}: offsets must be an int32 tensor of shape ({experts},) (one end row per expert) "
                         f"on {device}")


def grouped_gather_mm(hidden_states, rows, gate_up_proj, offsets):
    """The routed rows' gate_up projections, ``hidden_states[rows[r]] @ gate_up_proj[e].T`` for each row r of expert
    e, saving for backward only the inputs (no gathered rows: backward gathers them again).

    Args:
        hidden_states: [T, H], the tokens; float32 / float16 / bfloat16 (or float64, through the loop over
            experts).
        rows: [S] int64, each routed row's token, rows sorted by expert (``order // top_k``).
        gate_up_proj: [E, 2*I, H], the experts' packed gate and up projections (Hugging Face's stacked
            ``gate_up_proj``), same dtype and device as hidden_states.
        offsets: [E] int32, each expert's end row, ending at S.

    Returns:
        [S, 2*I] in the inputs' dtype: gate_up for :func:`grouped_gated_linear`. The gradient of hidden_states
        sums each token's rows, as autograd sums an index's.
    """
    return GROUPED_GATHER_MM.with_autocast(_grouped_gather_mm, hidden_states, rows, gate_up_proj, offsets)


def _grouped_gather_mm(hidden_states, rows, gate_up_proj, offsets):
    owner = "grouped_gather_mm"
    _check_gather(hidden_states, rows, owner)
    _check_weight("gate_up_proj", gate_up_proj, "[experts, 2 * intermediate_size, hidden_size]", hidden_states, owner)
    if gate_up_proj.shape[2] != hidden_states.shape[1]:
        raise ValueError(f"{owner}: gate_up_proj {tuple(gate_up_proj.shape)} must be [E, 2*I, "
                         f"H={hidden_states.shape[1]}]")
    _check_offsets(offsets, gate_up_proj.shape[0], hidden_states.device, owner)
    return GROUPED_GATHER_MM(hidden_states, rows, gate_up_proj, offsets)


def _check_gather(hidden_states, rows, owner):
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2:
        raise ValueError(f"{owner}: hidden_states must be a 2-D tensor [tokens, hidden_size]")
    if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype != torch.int64:
        raise ValueError(f"{owner}: rows must be a 1-D int64 tensor (each routed row's token)")


def _check_weight(name, weight, shape, hidden_states, owner):
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        raise ValueError(f"{owner}: {name} must be {shape}")
    if weight.dtype != hidden_states.dtype or weight.device != hidden_states.device:
        raise ValueError(f"{owner}: {name} is {weight.dtype} on {weight.device} but hidden_states "
                         f"{hidden_states.dtype} on {hidden_states.device}; give them one dtype and device")


def grouped_gated_mlp_recompute(hidden_states, rows, gate_up_proj, down_proj, offsets, *, row_weights=None,
                                activation="silu", backend=None):
    """The routed experts' gated MLPs, ``(act(gate) * up) @ down_proj[e].T`` with gate_up the row's hidden state
    through ``gate_up_proj[e]``, saving only the inputs: gate_up is recomputed in backward (``mlp="recompute"``).

    Args:
        hidden_states: [T, H], the tokens; float32 / float16 / bfloat16 (the torch backend takes any floating
            dtype).
        rows: [S] int64, each routed row's token, rows sorted by expert (``order // top_k``).
        gate_up_proj: [E, 2*I, H], the experts' packed gate and up projections (first half gate; Hugging Face's
            stacked ``gate_up_proj``); down_proj: [E, H, I]. Same dtype and device as hidden_states.
        offsets: [E] int32, each expert's end row, ending at S.
        row_weights, activation, backend: as :func:`grouped_gated_linear`'s (row_weights of hidden_states' dtype
            or float32).

    Returns:
        [S, H] in the inputs' dtype (or row_weights', as :func:`grouped_gated_linear`'s), row r the down projection
        of token ``rows[r]``'s gated MLP (times ``row_weights[r]``).
    """
    return GROUPED_GATHER_MM.with_autocast(
        functools.partial(_grouped_gated_mlp_recompute, row_weights=row_weights, activation=activation,
                          backend=backend), hidden_states, rows, gate_up_proj, down_proj, offsets, positions=(0, 2, 3))


def _grouped_gated_mlp_recompute(hidden_states, rows, gate_up_proj, down_proj, offsets, *, row_weights, activation,
                                 backend):
    owner = "grouped_gated_mlp_recompute"
    check_activation(activation, owner)
    _check_gather(hidden_states, rows, owner)
    hidden = hidden_states.shape[1]
    for name, weight, shape in (("gate_up_proj", gate_up_proj, "[experts, 2 * intermediate_size, hidden_size]"),
                                ("down_proj", down_proj, "[experts, hidden_size, intermediate_size]")):
        _check_weight(name, weight, shape, hidden_states, owner)
    if (gate_up_proj.shape[2] != hidden or down_proj.shape[1] != hidden or gate_up_proj.shape[0] != down_proj.shape[0]
            or gate_up_proj.shape[1] != 2 * down_proj.shape[2]):
        raise ValueError(f"{owner}: gate_up_proj {tuple(gate_up_proj.shape)} and down_proj {tuple(down_proj.shape)} "
                         f"must be [E, 2*I, H={hidden}] and [E, H, I]")
    _check_offsets(offsets, down_proj.shape[0], hidden_states.device, owner)
    _check_row_weights(row_weights, rows.shape[0], hidden_states, owner)
    # Two autograd nodes, not one: autograd adds and frees down_proj's gradient before gate_up_proj's is made, as
    # it does eager's (one node returning both would hold both, E*H*I elements more at backward's peak).
    gate_up = GROUPED_GATHER_MM(hidden_states, rows, gate_up_proj, offsets)
    return GROUPED_GATED_LINEAR_RECOMPUTING(
        gate_up, hidden_states, rows, gate_up_proj, down_proj, offsets, row_weights, activation,
        GROUPED_GATED_LINEAR_RECOMPUTING.backend(backend, hidden_states, owner, "hidden_states"))
