"""Per-layer keep / recompute / offload placement against a peak-memory budget.

Two parts:

1. :func:`measure_profile` runs one training step (forward + backward, with labels) of a
   4-layer copy of the model on the ``meta`` device, once keeping everything and once per
   option applied to its third layer (offload options only when asked, through
   :class:`_MetaOffload`: OffloadActivations' own logic on meta tensors), under
   :class:`~memkernels.meters.PeakBytesMeter`. Hooks cut the step into segments (the
   embedding, each layer's forward, the head = final norm + LM head + loss forward and
   backward, each layer's backward, the embedding's backward) and record the live bytes at
   each boundary and the peak inside each segment; :class:`_FlopTally` counts each step's FLOPs as it runs
   (FlopCounterMode's formulas: what an option replays is its step's FLOPs less the keep-everything
   step's). Layers are identical, so an L-layer model's
   figures follow from the 4-layer ones: the first two and the last layers are measured as such,
   each further middle layer adds R bytes (the live bytes a middle layer leaves behind after its
   forward) to every later segment.

2. :func:`solve` chooses one :data:`LAYER_OPTIONS` entry per layer by dynamic programming so
   that the predicted peak fits the budget at the least added step time.

Searches over the length (``plan(seq="max")``) run inside :func:`predicted_lengths`, where a length
not measured is predicted from two measured ones (:func:`_predicted_profile`); what they answer is
measured. ``measure_profile(keep_only=True)`` measures the keep-everything steps alone (the peaks the
kernels' decision compares), completed on a later request.

The peak model. With layer i's option o_i saving s(o_i) bytes of what stays resident after
its forward, S_i = s(o_0) + ... + s(o_{i-1}), and Pf_i, Pb_i, Ph the keep-everything peaks of
layer i's forward, layer i's backward and the head:

    peak = max( Pe, Pt, Ph - S_L, max_i (Pf_i - S_i), max_i (Pb_i - S_i + d(o_i)) )

where d(o) is what option o adds to its own layer's backward peak (recompute transients,
restored and prefetched offload copies; measured). Savings of layers after i are already freed
when layer i's backward runs, so only the prefix S_i matters.

The cost model (seconds added to a step): recomputing a part costs the FLOPs it replays
(measured) / the GPU's throughput; offloading a part costs the PCIe time of its bytes not hidden behind
compute: max(0, t - t_fwd) on the way out (during the next layer's forward) plus
max(0, t - 2 t_fwd) on the way back (during backward), t = bytes moved (measured) / PCIe
bandwidth, t_fwd the layer's forward time.

The DP (``memkernels._C.plan.cheapest_placement``, csrc/plan/) walks the layers in forward order; a layer's
states are the Pareto front of (prefix savings S_i in bytes, added seconds) over the choices before it, so no byte
is rounded. It is exact: the minimum added time over all 12^L placements, with ties going to the option listed first
(keep before recompute before offload, smaller parts first).
"""
import contextlib
import contextvars
import dataclasses
import functools
from fractions import Fraction

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from memkernels._C import plan as _dp
from memkernels.planning import apply_plan as plan_apply
from memkernels.planning.apply_plan import KERNELS, LOSS_STRATEGY, install_loss_strategy  # noqa: F401 (re-exported)
from memkernels.runtime.ledger import FlashAttentionOnMeta
from memkernels.runtime.meters import PeakBytesMeter
from memkernels.runtime.offload import OffloadActivations

__all__ = ["LayerOption", "LAYER_OPTIONS", "LayerProfile", "Placement", "measure_profile", "solve",
           "flop_counter"]


@dataclasses.dataclass(frozen=True)
class LayerOption:
    """What to do with one decoder layer: ``actions`` maps ``"layer"`` / ``"attn"`` / ``"mlp"`` to
    ``"recompute"``, ``"offload"`` or ``"offload_checkpoint"`` (recomputed, and the one input the
    checkpoint keeps moved to the host); parts not named are kept."""

    name: str
    actions: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)

    @property
    def recomputed(self):
        return tuple(part for part, action in self.actions.items() if action in ("recompute", "offload_checkpoint"))

    @property
    def offloaded(self):
        return tuple(part for part, action in self.actions.items() if action in ("offload", "offload_checkpoint"))


LAYER_OPTIONS = (
    LayerOption("keep", {}),
    LayerOption("recompute attn", {"attn": "recompute"}),
    LayerOption("recompute mlp", {"mlp": "recompute"}),
    LayerOption("recompute attn+mlp", {"attn": "recompute", "mlp": "recompute"}),
    LayerOption("recompute layer", {"layer": "recompute"}),
    LayerOption("offload attn", {"attn": "offload"}),
    LayerOption("offload mlp", {"mlp": "offload"}),
    LayerOption("offload attn+mlp", {"attn": "offload", "mlp": "offload"}),
    LayerOption("offload attn, recompute mlp", {"attn": "offload", "mlp": "recompute"}),
    LayerOption("recompute attn, offload mlp", {"attn": "recompute", "mlp": "offload"}),
    LayerOption("offload layer", {"layer": "offload"}),
    LayerOption("offload checkpoint", {"layer": "offload_checkpoint"}),
)
OPTION_BY_NAME = {option.name: option for option in LAYER_OPTIONS}
_RECOMPUTE_ONLY = tuple(o for o in LAYER_OPTIONS if not o.offloaded)
# The kernels a plan measures and applies (plan_apply.KERNELS, with the fused loss's LOSS_STRATEGY): the fused
# loss's meta step is not run (at a 128k vocabulary it took seconds per step, a minute per plan):
# :class:`_ModelledLoss` stands in for it on meta, with the bytes of :func:`fused_head_bytes`.


def _mm_flops(_self_shape, a_shape, b_shape, *_args, out_shape=None, **_kwargs):
    """addmm's FLOPs whatever the overload: addmm_ (in place), addmm.dtype_out (half operands, float32 result),
    whose extra positional ``out_dtype`` the stock formula takes for its ``out_shape`` (a TypeError: "got multiple
    values for argument 'out_shape'"), and memkernels::addmm_float32_ (:mod:`memkernels.fusions.common.half_gemm`)."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def _grouped_mm_flops(a_shape, b_shape, *_args, out_shape=None, **_kwargs):
    """``torch._grouped_mm``'s FLOPs (mixture-of-experts experts; torch's counter has no formula for it): every
    row of the routed tokens meets one group's matrix, so 2 x M x K x N as one GEMM of the stacked rows. 2-D x 3-D
    (forward, dX): a (M, K) by b (G, K, N); 2-D x 2-D (dW, groups split the contraction): a (K, M) by b (M, N)
    into (G, K, N); 3-D x 3-D (batched): a (G, M, K) by b (G, K, N)."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    groups = a_shape[0] if len(a_shape) == 3 and len(b_shape) == 3 else 1
    return 2 * groups * a_shape[-2] * a_shape[-1] * b_shape[-1]


def flop_counter():
    """A FlopCounterMode that also counts the CPU flash-attention op (what runs on CPU and on meta), every
    overload of addmm and memkernels' half-operand GEMM (the fused linear cross-entropy accumulates dX with addmm_ /
    memkernels::addmm_float32_) and ``torch._grouped_mm`` (Hugging Face's mixture-of-experts experts)."""
    from memkernels.fusions.common import half_gemm  # noqa: F401  (defines memkernels::addmm_float32_)
    aten = torch.ops.aten
    return FlopCounterMode(display=False, custom_mapping={
        torch.ops.memkernels.addmm_float32_: _mm_flops,
        aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[aten._scaled_dot_product_flash_attention].__wrapped__,
        aten._scaled_dot_product_flash_attention_for_cpu_backward:
            flop_registry[aten._scaled_dot_product_flash_attention_backward].__wrapped__,
        aten.addmm: _mm_flops, aten.addmm_: _mm_flops, aten._grouped_mm: _grouped_mm_flops})


@dataclasses.dataclass(frozen=True)
class HeadBytes:
    """What the fused linear cross-entropy (strategy "recompute", default chunks) needs for ``tokens`` tokens.

    ``forward_peak``: bytes its forward allocates above its inputs at its peak; ``held``: what it keeps
    for backward (the (max, log-sum) pair: 8 bytes a token; the inputs are referenced, not copied);
    ``backward_peak``: bytes its backward allocates at its peak (dX and dW included);
    ``chunk_tokens`` x ``tile_classes``: the forward's logits chunk and the backward's tile;
    ``flops``: (forward, backward, of which recomputed): 2 N H V, 6 N H V (with dX and dW), 2 N H V.
    """

    tokens: int
    hidden_size: int
    n_classes: int
    chunk_tokens: int
    tile_classes: int
    forward_peak: int
    held: int
    backward_peak: int
    flops: tuple


def fused_head_bytes(n_tokens, hidden_size, n_classes, dtype, *, backend="triton", bias=False,
                     needs=(True, True)):
    """:class:`HeadBytes` of ``linear_cross_entropy(strategy="recompute")`` on N = ``n_tokens`` tokens, H =
    ``hidden_size``, V = ``n_classes``, e bytes an element of ``dtype``, as the op allocates them:

    - forward: the loss and (max, log-sum) rows, 12 N, then one logits chunk of r tokens (r V e) and what
      the row kernel allocates for it (``backend="triton"``, a GPU: its 12 r output rows; ``"torch"``, the
      CPU path: its float32 row blocks, measured on meta, a few ms). Held: 8 N.
    - backward: the float32 dX accumulator (4 N H) and dW (V H e), then one tile of c classes' logits for
      all tokens (N c e) with its gradient written in place (the CPU path's row kernel adds its float32
      blocks), or at the end dX rounded to the input dtype (N H e) beside the accumulator.
      With a bias: dB (V e), and for half inputs a float32 tile (4 N c).

    r and c are the op's defaults (:func:`~memkernels.fusions.loss.linear_cross_entropy.recompute_chunk_tokens`,
    :func:`~memkernels.fusions.loss.linear_cross_entropy.recompute_tile_classes`): at least 590 tokens and 2360
    classes for half inputs (80 and 160 in float32), otherwise 16 MiB of logits (with a float32 copy).
    ``needs``: (dX, dW) wanted.
    """
    from memkernels.fusions.loss.linear_cross_entropy import recompute_chunk_tokens, recompute_tile_classes
    e = torch.finfo(dtype).bits // 8
    half = dtype != torch.float32
    n, h, v = n_tokens, hidden_size, n_classes
    rows = min(recompute_chunk_tokens(v, dtype), n)
    cols = min(recompute_tile_classes(n, v, dtype), v)
    whole_rows = cols >= v  # one tile holds every class: the backward's row kernel is the loss one
    if backend == "triton":
        forward_rows, backward_rows = 12 * rows, 12 * n if whole_rows else 0
    else:
        forward_rows, backward_rows = _reference_row_bytes(rows, n, v, cols, dtype, whole_rows)
    needs_hidden, needs_weight = needs
    # + 8: the reduction's scalars (its denominator; the backward's loss and z scales).
    forward_peak = 12 * n + rows * v * e + forward_rows + 8
    tile = n * cols * e + backward_rows + (4 * n * cols if bias and half else 0)
    backward_peak = ((4 * n * h if needs_hidden else 0) + (v * h * e if needs_weight else 0) + (v * e if bias else 0)
                     + max(tile, n * h * e if needs_hidden and half else 0) + 8)
    flops = 2 * n * h * v
    return HeadBytes(tokens=n, hidden_size=h, n_classes=v, chunk_tokens=rows, tile_classes=cols,
                     forward_peak=forward_peak, held=8 * n, backward_peak=backward_peak,
                     flops=(flops, flops * (1 + needs_hidden + needs_weight), flops))


_row_bytes = {}  # (rows, tokens, classes, tile, dtype, whole rows) -> (forward, backward)


def _reference_row_bytes(rows, n_tokens, n_classes, cols, dtype, whole_rows):
    """(bytes the CPU path's row kernel allocates at its peak for one forward chunk, for one backward tile):
    measured on meta (the reference walks three row blocks there, whatever the rows)."""
    key = (rows, n_tokens, n_classes, cols, dtype, whole_rows)
    if key not in _row_bytes:
        from memkernels.fusions.loss import reference
        from memkernels.fusions.loss.common import make_config
        cfg = make_config(n_classes, -100, 0.0, 0.0, 0.0, None)
        scale = torch.ones((), dtype=torch.float32, device="meta")
        figures = []
        for phase, tokens, width in (("forward", rows, n_classes), ("backward", n_tokens, cols)):
            logits = torch.empty(tokens, width, dtype=dtype, device="meta")
            target = torch.zeros(tokens, dtype=torch.long, device="meta")
            lse = torch.empty(tokens, 2, dtype=torch.float32, device="meta")
            with PeakBytesMeter() as meter:
                if phase == "forward":
                    outputs = reference.loss_rows(logits, target, cfg)
                elif whole_rows:  # the gradient written over the logits, as the op's tile
                    outputs = reference.loss_rows(logits, target, cfg, grad=logits, loss_scale=scale, z_scale=scale)
                else:
                    outputs = reference.grad_rows(logits, target, lse, cfg, logits, scale, scale)
                del outputs
            figures.append(meter.peak_bytes)
        _row_bytes[key] = tuple(figures)
    return _row_bytes[key]


# FLOPs the modelled loss stood for in the current step: FlopCounterMode sees none of them.
_MODELLED_HEAD = {"step": 0, "recompute": 0, "figures": None}


class _ModelledHead(torch.autograd.Function):
    """The fused loss's memory on meta: its outputs and saved tensors as they are, its transients as one
    block of :func:`fused_head_bytes`' size allocated and freed."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, backend):
        figures = fused_head_bytes(hidden.shape[0], hidden.shape[1], weight.shape[0], hidden.dtype, backend=backend,
                                   bias=bias is not None, needs=(hidden.requires_grad, weight.requires_grad))
        lse = hidden.new_empty((hidden.shape[0], 2), dtype=torch.float32)
        transient = hidden.new_empty(max(0, figures.forward_peak - figures.held), dtype=torch.uint8)
        del transient
        ctx.save_for_backward(hidden, weight, target, bias, lse)
        ctx.figures = _MODELLED_HEAD["figures"] = figures
        _MODELLED_HEAD["step"] += figures.flops[0]
        return hidden.new_empty((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, _grad_loss):
        hidden, weight, _target, bias, _lse = ctx.saved_tensors
        figures = ctx.figures
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_bias = torch.empty_like(bias) if bias is not None and ctx.needs_input_grad[3] else None
        outputs = sum(g.nbytes for g in (grad_weight, grad_hidden, grad_bias) if g is not None)
        transient = hidden.new_empty(max(0, figures.backward_peak - outputs), dtype=torch.uint8)
        del transient
        _MODELLED_HEAD["step"] += figures.flops[1] - figures.flops[2]
        _MODELLED_HEAD["recompute"] += figures.flops[2]
        return grad_hidden, grad_weight, None, grad_bias, None


@functools.lru_cache(maxsize=None)
def _modelled_loss_class():
    from memkernels.fusions.loss.rule import CausalLMLoss

    class _ModelledLoss(CausalLMLoss):
        """Stands in on meta for the fused loss a plan installs (:data:`LOSS_STRATEGY`): the same
        reshapes as ``linear_cross_entropy``, then :class:`_ModelledHead`."""

        backend = "triton"

        def forward(self, hidden, weight, targets, bias=None, softcap=None, num_items_in_batch=None):
            hidden_size = hidden.shape[-1]
            hidden2d = hidden.reshape(-1, hidden_size).contiguous()
            loss = _ModelledHead.apply(hidden2d, weight.contiguous(), targets.reshape(-1).long(), bias, self.backend)
            return loss if num_items_in_batch is None else loss / num_items_in_batch

    return _ModelledLoss


def _install_modelled_loss(model, backend):
    """Swap the fused losses ``memkernels.apply`` installed in the meta copy ``model`` for the
    :class:`_ModelledHead` stand-in of ``backend``'s loss (``"triton"``: a GPU's; ``"torch"``: the CPU path's)."""
    for name, _ in plan_apply.fused_losses(model):
        stand_in = _modelled_loss_class()()
        stand_in.backend = backend
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, stand_in)


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    if hasattr(value, "values") and callable(value.values):
        return _first_tensor(list(value.values()))
    return None


class _Timeline:
    """Live bytes at segment boundaries and the peak inside each segment of a metered step."""

    def __init__(self, meter):
        self.meter, self.current = meter, None
        self.peaks, self.live = {}, {}

    def mark(self, name):
        watch = self.meter._watch
        if self.current is not None:
            self.peaks[self.current] = max(self.peaks.get(self.current, 0), watch.peak_bytes)
        self.current = name
        if name is not None:
            self.live[name] = watch.live_bytes
            watch.peak_bytes = watch.live_bytes


def _loss_of(output):
    if isinstance(output, torch.Tensor):
        return output
    loss = getattr(output, "loss", None)
    if loss is None:
        raise ValueError("plan: the model's forward with labels returned no loss")
    return loss


def lm_inputs(model, ids):
    """(args, kwargs) of a training forward with labels for a memkernels TransformerLM or a HF causal LM."""
    from memkernels.models import TransformerLM
    if isinstance(model, TransformerLM):
        return (ids, ids), {}
    return (), {"input_ids": ids, "labels": ids, "use_cache": False}


@functools.lru_cache(maxsize=None)
def _flop_formulas():
    return flop_counter().flop_registry


class _FlopTally(TorchDispatchMode):
    """The FLOPs :func:`flop_counter` counts (its formulas), without FlopCounterMode's module tracker, whose
    references keep tensors alive: entered above a PeakBytesMeter, a step counts its FLOPs as it is measured
    (the meter below still sees a custom op's insides; this tally, like FlopCounterMode, the op)."""

    def __init__(self):
        super().__init__()
        self.formulas = _flop_formulas()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


def _metered_step(model, ids):
    """One forward + backward of ``model`` on meta ids, segmented by layer; returns the :class:`_Timeline`, with
    the step's FLOPs (``flops``, a modelled fused loss's included) and those its fused loss replays
    (``head_recompute``)."""
    from memkernels.runtime.ledger import meta_forward
    _, layers = plan_apply.find_layers(model)
    for param in model.parameters():
        if param.requires_grad:  # gradients are model state: present before the step, as after the first one
            param.grad = torch.zeros_like(param)
    meter, tally = PeakBytesMeter(), _FlopTally()
    handles = []
    _MODELLED_HEAD.update(step=0, recompute=0, figures=None)
    with meter, meta_forward(model), torch.enable_grad(), tally:
        timeline = _Timeline(meter)
        last = len(layers) - 1

        def pre(index):
            def hook(_module, args, kwargs):
                timeline.mark(f"fwd{index}")
                if index == 0:
                    hidden = _first_tensor(args) if args else _first_tensor(kwargs.get("hidden_states"))
                    if hidden is not None and hidden.requires_grad:
                        hidden.register_hook(lambda _grad: timeline.mark("tail"))
            return hook

        def post(index):
            def hook(_module, _args, output):
                timeline.mark("head" if index == last else f"gap{index}")
                out = _first_tensor(output)
                out.register_hook(lambda _grad: timeline.mark(f"bwd{index}"))
            return hook

        for index, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(pre(index), with_kwargs=True))
            handles.append(layer.register_forward_hook(post(index)))
        try:
            timeline.mark("embed")
            args, kwargs = lm_inputs(model, ids)
            _loss_of(model(*args, **kwargs)).backward()
            timeline.mark(None)
        finally:
            for handle in handles:
                handle.remove()
    timeline.flops = tally.flops + _MODELLED_HEAD["step"]
    timeline.head_recompute = _MODELLED_HEAD["recompute"]
    return timeline


@dataclasses.dataclass
class LayerProfile:
    """What :func:`measure_profile` measured, per micro-batch of 1 and 2 (affine in between and beyond; micro-batch 1
    alone when measured with ``batches=(1,)``).

    Bytes are ints; ``segments``: {batch: {segment: peak}} of the keep-everything step of a
    ``depth``-layer copy; ``resident``: {batch: R}; ``savings`` / ``extra`` / ``moved``:
    {batch: {option: bytes}} (``moved``: bytes an offload option sends to the host; ``held``: bytes the option
    keeps alive from the head through backward that every layer's copy shares, counted once however many layers
    take it: 1,024 on a tiny Hugging Face Llama whichever layers recompute their attention);
    ``head_live``: {batch: live bytes of the keep-everything step when the head starts};
    ``recompute``: {option: FLOPs replayed per sequence}; ``keep_flops`` / ``step_flops``: FLOPs
    of one sequence's keep-everything step of the measured copy / of the full model, without
    recompute. Offload options are in the tables once ``measure_profile(..., offload=True)``
    measured them. ``kernels``: measured with memkernels' kernels (:data:`KERNELS`); ``head``: the
    fused linear cross-entropy's :class:`HeadBytes` at one sequence when the kernels installed it
    (else None; its bytes are in the head segment), ``head_recompute`` the FLOPs its backward
    replays per sequence (the logits GEMM, 2 seq H V). ``predicted``: not measured but predicted from two
    measured lengths (:func:`predicted_lengths`; its ``head`` is the nearer one's).
    """

    num_layers: int
    depth: int
    seq: int
    segments: dict
    resident: dict
    savings: dict
    extra: dict
    recompute: dict
    keep_flops: int
    step_flops: int
    parts: tuple
    moved: dict = dataclasses.field(default_factory=dict)
    head_live: dict = dataclasses.field(default_factory=dict)
    held: dict = dataclasses.field(default_factory=dict)
    kernels: bool = False
    head: object = None
    head_recompute: int = 0
    predicted: bool = False

    @property
    def complete(self):
        """Whether the FLOPs and recompute options are measured (not only the keep-everything steps)."""
        return bool(self.recompute)

    def keep_peak(self, batch=1):
        """The keep-everything step's activation peak at ``batch`` (what :func:`solve` reports as ``keep_peak``)."""
        embed, tail, head, forward, backward = self.layer_peaks(batch)
        return max(embed, tail, head, max(forward), max(backward))

    @property
    def offload_measured(self):
        return any(OPTION_BY_NAME[name].offloaded for name in self.savings.get(1, ()))

    def _at(self, table, batch):
        if batch == 1:
            return dict(table[1]) if isinstance(table[1], dict) else table[1]
        if 2 not in table:
            raise ValueError(f"this profile is measured at micro-batch 1 only; micro-batch {batch} needs "
                             "measure_profile(..., batches=(1, 2))")
        one, two = table[1], table[2]
        if isinstance(one, dict):
            return {key: one[key] + (batch - 1) * (two[key] - one[key]) for key in one}
        return one + (batch - 1) * (two - one)

    def figures(self, batch):
        """(segments, R, savings, extra, moved, held) at micro-batch ``batch`` for the full depth."""
        return tuple(self._at(table, batch) for table in (self.segments, self.resident, self.savings, self.extra,
                                                           self.moved, self.held))

    @property
    def probe(self):
        """The layer of the measured copy that options were applied to: a middle one when there is one."""
        return _probe_layer(self.depth)

    def measured_layer(self, index):
        """(layer of the measured copy that stands for layer ``index``, layers of R between them)."""
        if index < self.probe:
            return index, 0
        if index == self.num_layers - 1:
            return self.depth - 1, self.num_layers - self.depth
        return self.probe, index - self.probe

    def layer_peaks(self, batch):
        """(Pe, Pt, Ph, [Pf_i], [Pb_i]) of the keep-everything step of the full model at ``batch``."""
        seg, resident = self.figures(batch)[:2]
        forward, backward = [], []
        for i in range(self.num_layers):
            measured, grow = self.measured_layer(i)
            forward.append(seg[f"fwd{measured}"] + grow * resident)
            backward.append(seg[f"bwd{measured}"] + grow * resident)
        head = seg["head"] + (self.num_layers - self.depth) * resident
        return seg.get("embed", 0), seg.get("tail", 0), head, forward, backward


# The copy measured has up to 4 layers; options are applied to its third. Layers are identical,
# but what they leave resident is not always: in a bf16 Hugging Face Llama on the CPU the first
# two layers each keep one more hidden-sized tensor alive than the rest.
_DEPTH = 4


def _probe_layer(depth):
    return min(2, depth - 1)


class _BookkeepingEngine:
    """Stands in for the C++ copy engine on ``meta``: hands out handles, copies nothing, and every
    copy is complete at once (the device copy goes as soon as OffloadActivations looks)."""

    closed = False

    def __init__(self):
        self._handles = 0

    def offload(self, _address, _nbytes, _stream):
        self._handles += 1
        return self._handles

    def offload_done(self, _handle):
        return True

    def prefetch(self, _handle, _address, _stream):
        pass

    def synchronize(self, _handle):
        pass

    synchronize_all = trim = close = lambda self: None
    release = synchronize

    def stats(self):
        return {"pool": {"refusals": 0}, "live_handles": 0}


class _MetaOffload(OffloadActivations):
    """OffloadActivations on ``meta``: the same choices of what moves and what stays (parameters,
    the last module, views sharing a storage), the same restores and prefetches, made of meta
    tensors, so PeakBytesMeter sees on meta what the real one leaves on the device. Copies are
    taken to finish at once: a GPU whose device-to-host copies lag behind forward frees later."""

    @staticmethod
    def _resolve_mode():
        return "meta"

    def __init__(self):
        super().__init__(**plan_apply.OFFLOAD_OPTIONS)
        self._device = torch.device("meta")
        self._engine = _BookkeepingEngine()


def _build(source, depth, dtype, kernels=False, option=None, backend="triton"):
    """(a ``depth``-layer meta copy in train mode with the kernels and ``option`` on the probe layer,
    its :class:`_MetaOffload` or None). With the kernels, a fused loss is the :class:`_ModelledHead`
    stand-in of ``backend``'s (``"triton"``: a GPU; ``"torch"``: the CPU path)."""
    model = source.build(depth).to(dtype)
    model.train()
    if kernels:
        from memkernels.fusions.apply import apply
        apply(model, **KERNELS)
        _install_modelled_loss(model, backend)
    offload = None
    if option is not None:
        choices = [OPTION_BY_NAME["keep"]] * depth
        choices[_probe_layer(depth)] = option
        offload = _MetaOffload() if option.offloaded else None
        plan_apply.apply_placement(model, choices, recompute_context=FlashAttentionOnMeta, offload=offload)
    return model, offload


_profiles = {}  # (model key, seq, dtype, kernels, backend) -> LayerProfile


def measure_profile(source, seq, dtype, *, kernels=False, offload=False, backend="triton", keep_only=False,
                    batches=(1, 2)):
    """Measure a :class:`LayerProfile` on meta for ``source`` (an estimate ``ModelSource``) at ``seq``
    (cached per model, sequence length, dtype, kernels and backend). ``offload``: also measure the
    offload options (through :class:`_MetaOffload`; measured once, on first request). ``backend``:
    whose fused loss the kernels' profile counts (``"triton"``: a GPU's; ``"torch"``: the CPU path's,
    whose row kernels add float32 blocks). ``keep_only``: the keep-everything part alone (its peaks:
    :meth:`LayerProfile.keep_peak`), two meta steps where the whole profile takes about sixteen; completed
    when asked for without it. ``batches``: ``(1,)`` measures micro-batch 1 alone, half the meta steps (a
    search that asks only whether micro-batch 1 fits); completed with micro-batch 2 when asked for."""
    if tuple(batches) not in ((1,), (1, 2)):
        raise ValueError(f"measure_profile(batches={batches!r}): use (1,) or (1, 2)")
    key = (source.key(), seq, dtype, kernels, backend if kernels else None)
    if key not in _profiles and _predicting.get():
        guess = _predicted_profile(key, offload, keep_only)
        if guess is not None:
            return guess
    if key not in _profiles:
        _profiles[key] = _new_profile(source, seq, kernels)
    profile = _profiles[key]
    for batch in batches:
        if batch not in profile.segments:
            _measure_keep(profile, source, dtype, backend, batch)
    if keep_only:
        return profile
    if not profile.complete:
        _measure_flops(profile, source, dtype, backend)
    options = [o for o in LAYER_OPTIONS if offload or not o.offloaded]
    for batch in batches:
        _measure_options(profile, source, dtype, options, backend, batch)
    return profile


_predicting = contextvars.ContextVar("memkernels.placement: predict profiles across lengths", default=False)


@contextlib.contextmanager
def predicted_lengths():
    """Inside, :func:`measure_profile` answers a length it has not measured with :func:`_predicted_profile` once
    two lengths of the same model, dtype, kernels and backend are measured. For searches over the length
    (``plan(seq="max")``), which measure the lengths their answer rests on: a prediction is a guide, not a
    measurement (a sliding window or a chunk count changes the step's shape at lengths between)."""
    token = _predicting.set(True)
    try:
        yield
    finally:
        _predicting.reset(token)


def _predicted_profile(key, offload, keep_only=False):
    """The :class:`LayerProfile` of ``key`` (``_profiles``' key) predicted from the two measured lengths nearest to
    its length (the two around it where there are such): bytes affine in the length, FLOPs A s + C s² (a causal
    LM's matmuls and attention; exact on Llama, GPT-2, Mistral and Qwen3-MoE, not across a sliding window's
    edge). None until two are measured."""
    seq = key[1]
    measured = {k[1]: p for k, p in _profiles.items() if k[0] == key[0] and k[2:] == key[2:]
                and (keep_only or (p.complete and (p.offload_measured or not offload)))}
    below = sorted(s for s in measured if s < seq)
    above = sorted(s for s in measured if s > seq)
    # Between two measured lengths: the two around it. Beyond them: the nearest and the farthest on that side, as a
    # slope read over a few thousand tokens carries the steps of chunked work (a tiled MLP's last chunk, a loss
    # chunk) far out: Qwen2-72B's extra bytes at 90,112 tokens were 1.8 GB off from 81,920 and 82,944, 18 MB from
    # 8,192 and 82,944.
    anchors = ([below[-1], above[0]] if below and above else [below[0], below[-1]] if len(below) > 1
               else [above[0], above[-1]] if len(above) > 1 else None)
    if anchors is None:
        return None
    (s1, p1), (s2, p2) = ((s, measured[s]) for s in anchors)

    def affine(v1, v2):
        if isinstance(v1, dict):  # what both measured (a keep-only profile has no options)
            return {name: affine(v1[name], v2[name]) for name in v1 if name in v2}
        return round(v1 + Fraction(v2 - v1, s2 - s1) * (seq - s1))

    def quadratic(f1, f2):  # f(s) = A s + C s^2 through (s1, f1) and (s2, f2)
        if isinstance(f1, dict):
            return {name: quadratic(f1[name], f2[name]) for name in f1 if name in f2}
        c = (Fraction(f2, s2) - Fraction(f1, s1)) / (s2 - s1)
        return round(seq * (Fraction(f1, s1) + c * (seq - s1)))

    nearer = p1 if abs(seq - s1) <= abs(seq - s2) else p2
    return dataclasses.replace(
        nearer, seq=seq, predicted=True, recompute=quadratic(p1.recompute, p2.recompute),
        keep_flops=quadratic(p1.keep_flops, p2.keep_flops), step_flops=quadratic(p1.step_flops, p2.step_flops),
        head_recompute=quadratic(p1.head_recompute, p2.head_recompute),
        **{name: affine(getattr(p1, name), getattr(p2, name))
           for name in ("segments", "resident", "savings", "extra", "moved", "head_live", "held")})


def _new_profile(source, seq, kernels):
    """An empty :class:`LayerProfile` of ``source`` at ``seq``: the measured copy's depth and the parts its layers
    have (attention, MLP)."""
    depth = min(_DEPTH, source.num_layers)
    _, layers = plan_apply.find_layers(source.build(1))
    parts = tuple(p for p in ("attn", "mlp") if plan_apply.submodule_name(layers[-1], p) is not None)
    return LayerProfile(num_layers=source.num_layers, depth=depth, seq=seq, segments={}, resident={},
                        savings={}, extra={}, moved={}, recompute={}, keep_flops=0, step_flops=0, parts=parts,
                        kernels=kernels)


def _measure_keep(profile, source, dtype, backend, batch):
    """The keep-everything step at micro-batch ``batch`` (one meta step): its segments' peaks, R and the live bytes
    at the head; at micro-batch 1, the FLOPs of one sequence and the fused loss's figures."""
    depth, probe_layer = profile.depth, profile.probe
    ids = torch.empty(batch, profile.seq, dtype=torch.long, device="meta")
    keep = _metered_step(_build(source, depth, dtype, profile.kernels, backend=backend)[0], ids)
    profile.segments[batch] = dict(keep.peaks)
    profile.head_live[batch] = keep.live["head"]
    # R: what a middle layer leaves resident (the first and last layers may differ; they are measured).
    after = keep.live[f"gap{probe_layer}"] if probe_layer < depth - 1 else keep.live["head"]
    profile.resident[batch] = after - keep.live[f"gap{probe_layer - 1}"] if probe_layer else 0
    for table in (profile.savings, profile.extra, profile.moved, profile.held):
        table[batch] = {"keep": 0}
    if batch == 1:
        profile.keep_flops, profile.head_recompute = keep.flops, keep.head_recompute
        # The fused loss is installed: what it needs at one sequence (its bytes are in the head segment).
        profile.head = _MODELLED_HEAD["figures"] if keep.head_recompute else None


def _measure_flops(profile, source, dtype, backend="triton"):
    """The full model's step FLOPs (one sequence), from the measured copy's and one layer's more."""
    depth = profile.depth
    if depth > 1:
        one = torch.empty(1, profile.seq, dtype=torch.long, device="meta")
        per_layer = profile.keep_flops - _metered_step(_build(source, depth - 1, dtype, profile.kernels,
                                                              backend=backend)[0], one).flops
    else:
        per_layer = profile.keep_flops
    profile.step_flops = profile.keep_flops + (source.num_layers - depth) * per_layer
    profile.recompute["keep"] = 0


def _measure_options(profile, source, dtype, options, backend, batch):
    """Add the savings, extra and moved bytes of ``options`` at ``batch`` (against the keep-everything step in
    ``profile``; a meta step each, those measured before skipped) and, at micro-batch 1, the FLOPs each replays."""
    options = [o for o in options if o.name not in profile.savings[batch]
               and all(p in profile.parts + ("layer",) for p in o.actions)]
    last_bwd = f"bwd{profile.probe}"
    ids = torch.empty(batch, profile.seq, dtype=torch.long, device="meta")
    for option in options:
        model, offload = _build(source, profile.depth, dtype, profile.kernels, option, backend)
        run = _metered_step(model, ids)
        saved = profile.head_live[batch] - run.live["head"]
        profile.savings[batch][option.name] = saved
        # What the head's peak drops by less than the bytes saved before it: a tensor of the whole model's the
        # option keeps for backward (counted once, as held; the option's own backward transient without it).
        held = max(0, saved - (profile.segments[batch]["head"] - run.peaks["head"]))
        profile.held[batch][option.name] = held
        profile.extra[batch][option.name] = run.peaks[last_bwd] - profile.segments[batch][last_bwd] - held
        profile.moved[batch][option.name] = offload.stats()["bytes_offloaded"] if offload else 0
        if batch == 1:
            profile.recompute[option.name] = run.flops - profile.keep_flops


@dataclasses.dataclass
class Placement:
    """A per-layer choice and what it predicts at one micro-batch.

    ``choices``: one :class:`LayerOption` per layer; ``predicted_peak``: activation peak of a
    training step on top of model state (bytes); ``keep_peak``: the same with every layer kept;
    ``recompute_flops``: forward FLOPs replayed in backward per step, the fused loss's
    (``head_recompute_flops``, the logits GEMM: 2 N H V) included; ``offload_bytes``: bytes
    moved to the host per step; ``added_seconds``: the cost model's added step time;
    ``kernels``: the profile was measured with memkernels' kernels (``apply(model, placement)``
    installs them, the fused loss with strategy :data:`LOSS_STRATEGY`).
    """

    batch: int
    budget: int
    choices: list
    predicted_peak: int
    keep_peak: int
    recompute_flops: int
    offload_bytes: int
    added_seconds: float
    fits: bool
    kernels: bool = False
    head_recompute_flops: int = 0

    def counts(self):
        counts = {}
        for choice in self.choices:
            counts[choice.name] = counts.get(choice.name, 0) + 1
        return counts

    def describe(self):
        """``'recompute layer: 0-11, 14; keep: 12-13, 15'``."""
        runs = {}
        for index, choice in enumerate(self.choices):
            runs.setdefault(choice.name, []).append(index)
        return "; ".join(f"{name}: {_ranges(indices)}" for name, indices in runs.items())

    def to_dict(self):
        return {"batch": self.batch, "budget": self.budget, "choices": [c.name for c in self.choices],
                "predicted_peak": self.predicted_peak, "keep_peak": self.keep_peak,
                "recompute_flops": self.recompute_flops, "offload_bytes": self.offload_bytes,
                "added_seconds": self.added_seconds, "fits": self.fits, "kernels": self.kernels,
                "head_recompute_flops": self.head_recompute_flops}


def _ranges(indices):
    out, start = [], indices[0]
    for prev, cur in zip(indices, indices[1:] + [None]):
        if cur != prev + 1:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(out)


def _option_costs(profile, batch, options, *, tflops, pcie_gbps):
    """Per option: (savings, extra, seconds, recompute flops, offload bytes, held bytes) at ``batch``."""
    _, _, savings, extra, moved, held = profile.figures(batch)
    throughput = tflops * 1e12
    # A layer's forward: a third of its share of the step (backward does about twice the forward's work).
    layer_seconds = batch * profile.step_flops / (3 * profile.num_layers) / throughput
    out = {}
    for option in options:
        recompute_flops = batch * profile.recompute[option.name]
        seconds = recompute_flops / throughput
        if option.offloaded:
            transfer = moved[option.name] / (pcie_gbps * 1e9)
            seconds += max(0.0, transfer - layer_seconds) + max(0.0, transfer - 2 * layer_seconds)
        out[option.name] = (max(0, savings[option.name]), extra[option.name], seconds, recompute_flops,
                            moved[option.name], held[option.name])
    return out


def solve(profile, batch, budget, *, offload=False, tflops=400.0, pcie_gbps=25.0, host_budget=None, enough=None):
    """The cheapest :class:`Placement` whose predicted peak fits ``budget`` bytes at micro-batch ``batch``.

    ``offload``: also consider activation offload (needs a CUDA device or the simulated one, and a
    profile measured with ``offload=True``); ``host_budget``: the most bytes it may move to the host
    (None: no limit). Over it, offloading is priced (a Lagrangian multiplier on moved bytes, the least
    found by bisection that brings the placement within the host budget; at worst no offload at all),
    so a host budget never leaves a plan worse than no offload; then, from the cheapest placement over the
    budget, :func:`_toward` switches layers one at a time to options that move less, where a price cannot
    reach (kept when cheaper).
    ``tflops``: sustained throughput of a GPU (TFLOP/s) for the recompute cost; ``pcie_gbps``:
    host link bandwidth (GB/s). When nothing fits, returns the placement with the lowest
    predicted peak, ``fits=False``; when placements fit but none within ``host_budget``, the one that moves least
    (``fits`` says the GPU budget holds; its ``offload_bytes`` exceed ``host_budget``). ``enough``: a predicate
    on placements; the first placement found that fits the budget and the host budget and satisfies it is
    returned, the cheapest or not (for a search that asks only whether any placement does: the same answer,
    found with fewer DP runs).
    """
    if offload and not profile.offload_measured:
        raise ValueError("solve(offload=True): the profile has no offload figures; measure it with "
                         "measure_profile(..., offload=True)")
    options = [o for o in (LAYER_OPTIONS if offload else _RECOMPUTE_ONLY)
               if all(part in profile.parts + ("layer",) for part in o.actions)]
    costs = _option_costs(profile, batch, options, tflops=tflops, pcie_gbps=pcie_gbps)
    placement = _placement(profile, batch, budget, options, costs, tflops, price=0.0)
    # A price changes what each option costs, never which placements fit: when none fits at price 0, none will.
    if host_budget is None or placement.offload_bytes <= host_budget or not placement.fits:
        return placement

    def answers(found):
        return enough is not None and found.fits and enough(found)

    best = _placement(profile, batch, budget, _without_offload(options), costs, tflops, price=0.0)
    if answers(best):
        return best
    # log10 of the price in seconds per byte moved: from 1e-16 (a GB's copy priced at 0.1 us, nothing) to 1e-6 (a
    # MB's at a second, more than any recompute); 12 halvings: the price within 0.6%
    low, high = -16.0, -6.0
    over = placement  # the fitting placement over the host budget at the highest price tried: the least moving
    for _ in range(12):
        middle = (low + high) / 2
        trial = _placement(profile, batch, budget, options, costs, tflops, price=10.0 ** middle)
        if trial.offload_bytes <= host_budget:
            high = middle
            if trial.fits and (not best.fits or trial.added_seconds < best.added_seconds):
                best = trial
                if answers(best):
                    return best
        else:
            low = middle
            if trial.fits:
                over = trial
    between = _toward(profile, batch, budget, over, options, costs, tflops, host_budget)
    if between is not None and between.fits and (not best.fits or between.added_seconds < best.added_seconds):
        best = between
    # Nothing fits within the host budget: the fitting placement that moves least, over it (the caller compares
    # offload_bytes: "the GPUs would hold it with this much host memory").
    return best if best.fits else over


def _without_offload(options):
    """``options`` less those that move anything to the host."""
    return [o for o in options if not o.offloaded]


def _placement(profile, batch, budget, options, costs, tflops, price):
    """The DP of the module docstring over ``options``, each option's seconds raised by ``price`` per byte it
    moves to the host; the Placement's figures are the unpriced ones. Once per amount of held bytes the options
    have (mostly 0 and one more): the options holding at most that much, it added to the head's and every
    backward's peak; the cheapest of those that fit."""
    embed, tail, head, forward, backward = profile.layer_peaks(batch)
    priced = {o.name: costs[o.name][2] + price * costs[o.name][4] for o in options}
    found = None
    if max(embed, tail) <= budget:
        for reserve in sorted({costs[o.name][5] for o in options}):
            allowed = [o for o in options if costs[o.name][5] <= reserve]
            # Savings needed before layer i for option o, and at the end (the head).
            needs = [max(0, max(forward[i], backward[i] + costs[o.name][1] + reserve) - budget)
                     for i in range(profile.num_layers) for o in allowed]
            indices = _dp.cheapest_placement(needs, [costs[o.name][0] for o in allowed],
                                             [priced[o.name] for o in allowed], max(0, head + reserve - budget))
            if indices is not None:
                seconds = sum(priced[allowed[k].name] for k in indices)
                if found is None or seconds < found[0]:
                    found = (seconds, [allowed[k] for k in indices])
    if found is not None:
        return _placement_of(profile, batch, budget, found[1], costs, tflops, True)
    choices = [max(options, key=lambda o: costs[o.name][0])] * profile.num_layers
    return _placement_of(profile, batch, budget, choices, costs, tflops, False)


def _placement_of(profile, batch, budget, choices, costs, tflops, feasible=True):
    """The :class:`Placement` of ``choices`` (its figures unpriced)."""
    peak = predict_peak(profile, batch, choices, costs)
    # The fused loss replays its logits GEMM whatever the layers do: counted, never chosen.
    head_flops = batch * profile.head_recompute
    return Placement(batch=batch, budget=budget, choices=choices, predicted_peak=peak,
                     keep_peak=profile.keep_peak(batch),
                     recompute_flops=sum(costs[c.name][3] for c in choices) + head_flops,
                     offload_bytes=sum(costs[c.name][4] for c in choices),
                     added_seconds=float(sum(costs[c.name][2] for c in choices)) + head_flops / (tflops * 1e12),
                     fits=bool(feasible and peak <= budget), kernels=profile.kernels,
                     head_recompute_flops=head_flops)


def _toward(profile, batch, budget, over, options, costs, tflops, host_budget):
    """A price on moved bytes reaches only some of the placements between none and all offloaded (a knapsack's
    duality gap: Llama-3-8B QLoRA at 128k tokens, 80 GB + 256 GB host: one price moves 245 GiB, the next 68 GiB at
    six times the added time). So from ``over`` (a placement over the host budget) switch one layer at a time to
    the option of least added seconds per byte it takes off the host that keeps the peak under ``budget``, until
    the host budget holds (e.g. "offload layer" to "offload checkpoint": the same bytes saved, 1/13 of them moved).
    None where no such switch is left."""
    embed, tail, head, forward, backward = profile.layer_peaks(batch)
    choices = list(over.choices)
    layers = len(choices)
    moved = sum(costs[c.name][4] for c in choices)
    while moved > host_budget:
        # With the choices as they are: S_i saved before layer i, layer i's own peak, the peaks before / after it.
        saved, own = [0] * (layers + 1), [0] * layers
        reserve = max(costs[choice.name][5] for choice in choices)  # held bytes: on the head and every backward
        for i, choice in enumerate(choices):
            own[i] = max(forward[i] - saved[i], backward[i] - saved[i] + costs[choice.name][1] + reserve)
            saved[i + 1] = saved[i] + costs[choice.name][0]
        before, after = [max(embed, tail)] * (layers + 1), [head - saved[layers] + reserve] * (layers + 1)
        for i in range(layers):
            before[i + 1] = max(before[i], own[i])
            after[layers - 1 - i] = max(after[layers - i], own[layers - 1 - i])
        best = None
        for i, mine in enumerate(choices):
            for option in options:
                freed = costs[mine.name][4] - costs[option.name][4]
                if freed <= 0:
                    continue
                gained = costs[option.name][0] - costs[mine.name][0]  # saved bytes every later peak gains
                peak = max(before[i], forward[i] - saved[i], backward[i] - saved[i] + costs[option.name][1] + reserve,
                           after[i + 1] - gained) + max(0, costs[option.name][5] - reserve)
                if peak > budget:
                    continue
                cost = (costs[option.name][2] - costs[mine.name][2]) / freed
                if best is None or cost < best[0]:
                    best = (cost, i, option, freed)
        if best is None:
            return None
        choices[best[1]] = best[2]
        moved -= best[3]
    return _placement_of(profile, batch, budget, choices, costs, tflops)


def predict_peak(profile, batch, choices, costs=None, **cost_args):
    """The peak model of the module docstring for ``choices`` at ``batch`` (bytes)."""
    if costs is None:
        costs = _option_costs(profile, batch, set(choices), tflops=cost_args.get("tflops", 400.0),
                              pcie_gbps=cost_args.get("pcie_gbps", 25.0))
    embed, tail, head, forward, backward = profile.layer_peaks(batch)
    reserve = max((costs[choice.name][5] for choice in choices), default=0)
    peak, saved = max(embed, tail), 0
    for i, choice in enumerate(choices):
        saving, extra = costs[choice.name][:2]
        peak = max(peak, forward[i] - saved, backward[i] - saved + extra + reserve)
        saved += saving
    return int(max(peak, head - saved + reserve))

