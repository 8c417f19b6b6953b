"""Carry out a plan's per-layer placement on a real model.

Each decoder layer's choice (see :data:`memkernels.planning.plan.LAYER_OPTIONS`) names, for
the layer itself or for its attention / MLP submodule, one of three actions:

- ``"recompute"``: the module's forward runs under ``torch.utils.checkpoint`` (non-reentrant,
  ``preserve_rng_state=True``: dropout masks are replayed exactly), so only its inputs stay
  saved and backward recomputes the rest. A gated MLP that :func:`memkernels.apply` fused recomputes
  in its kernel instead (:func:`~memkernels.fusions.gated_mlp.op.gated_mlp_recompute`): it too saves only
  its input, but replays two GEMMs (gate, up) where a checkpoint replays three, and a long input runs
  in token chunks, so its backward holds one chunk's I-wide tensors, not the sequence's.
- ``"offload"``: the module's forward runs inside one shared
  :class:`~memkernels.offload.OffloadActivations` block, so what it saves goes to pinned
  host memory and comes back for backward.
- ``"offload_checkpoint"``: both, the checkpoint inside the block: checkpoint keeps only the
  module's input for backward, and that input is what goes to the host (prefetched one layer
  ahead of its recompute, through the chain of blocks).

The module keeps its parameters, submodules and state_dict keys: only its class is switched
to a subclass whose ``forward`` wraps the original one (the way :mod:`memkernels.fusions`
patches Hugging Face modules). :func:`remove` switches the classes back.
"""
import contextlib
import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply", "KERNELS", "LOSS_STRATEGY", "install_loss_strategy", "find_layers", "wrap", "remove", "apply_plan",
           "apply_placement", "ApplyReport", "OFFLOAD_OPTIONS"]

# The shared OffloadActivations a plan's offloaded modules run in: every saved tensor of the
# module moves, its last submodule's too, whatever the link hides (budget=None): the plan counted
# every saved byte of an offloaded module as gone from the device.
OFFLOAD_OPTIONS = {"budget": None, "min_offload_bytes": 0, "offload_last_module": True}

_ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
_MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe")


def find_layers(model):
    """``(prefix, [layer modules])``: the decoder layers (the ModuleList holding most parameters).

    Raises ValueError when ``model`` has no ModuleList of layers.
    """
    best, best_name, best_numel = None, None, -1
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            numel = sum(p.numel() for p in module.parameters())
            if numel > best_numel:
                best, best_name, best_numel = module, name, numel
    if best is None:
        raise ValueError(f"plan: {type(model).__name__} has no nn.ModuleList of decoder layers to place "
                         "checkpointing / offload on")
    return best_name, list(best)


def submodule_name(layer, part):
    """The child name of ``part`` (``"attn"`` / ``"mlp"``) in ``layer``; ``""`` for ``"layer"``; None if absent."""
    if part == "layer":
        return ""
    names = _ATTENTION_NAMES if part == "attn" else _MLP_NAMES
    for name in names:
        if isinstance(getattr(layer, name, None), nn.Module):
            return name
    return None


class _Recomputed:
    """forward under non-reentrant torch.utils.checkpoint (same RNG state on recompute)."""

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return super().forward(*args, **kwargs)
        context = getattr(self, "_memkernels_recompute_context", None)
        if context is None:
            return checkpoint(super().forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
        return checkpoint(super().forward, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=lambda: (contextlib.nullcontext(), context()), **kwargs)


class _KernelRecomputed:
    """A fused gated MLP's forward through gated_mlp_recompute (see the module doc)."""

    def forward(self, x):
        from memkernels.fusions.gated_mlp.rule import patched_gated_mlp_forward
        return patched_gated_mlp_forward(self, x, recompute=True)


class _Offloaded:
    """forward inside the shared OffloadActivations block."""

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return super().forward(*args, **kwargs)
        with self._memkernels_offload:
            return super().forward(*args, **kwargs)


class _OffloadedCheckpoint(_Recomputed):
    """forward recomputed (checkpoint) inside the shared OffloadActivations block: the block sees only
    what checkpoint saves for the recompute, the module's input."""

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return super().forward(*args, **kwargs)
        with self._memkernels_offload:
            return super().forward(*args, **kwargs)


_MIXINS = {"recompute": _Recomputed, "offload": _Offloaded, "offload_checkpoint": _OffloadedCheckpoint,
           "kernel_recompute": _KernelRecomputed}
_CLASS_PREFIX = {"recompute": "Recomputed", "offload": "Offloaded", "offload_checkpoint": "OffloadCheckpointed",
                 "kernel_recompute": "KernelRecomputed"}


def wrap(module, action, offload=None, recompute_context=None):
    """Switch ``module``'s class so its forward is recomputed, offloaded or both (``action``; a fused gated
    MLP's ``"recompute"`` runs in its kernel, see the module doc).

    ``recompute_context``: a callable returning a context manager the recompute runs in
    (the meta measurement routes attention to the flash op there too: backward, and so the
    recompute, may run on another thread than the forward's TorchFunctionMode).
    """
    if action == "recompute":
        from memkernels.fusions.gated_mlp.rule import can_recompute_gated_mlp
        if can_recompute_gated_mlp(module):
            action = "kernel_recompute"
    mixin = _MIXINS[action]
    base = type(module)
    if base.__module__ == __name__:
        raise ValueError(f"plan: {base.__name__} is already wrapped; call remove(model) first")
    name = f"{_CLASS_PREFIX[action]}{base.__name__}"
    cls = getattr(sys.modules[__name__], name, None)
    if cls is None or cls.__bases__[-1] is not base:
        cls = type(name, (mixin, base), {"__module__": __name__})
        setattr(sys.modules[__name__], name, cls)
    module.__class__ = cls
    if action in ("offload", "offload_checkpoint"):
        module._memkernels_offload = offload
    if recompute_context is not None:
        module._memkernels_recompute_context = recompute_context


def remove(model):
    """Undo :func:`wrap` on every module of ``model``; returns how many were unwrapped."""
    count = 0
    for module in model.modules():
        if type(module).__module__ == __name__:
            module.__class__ = type(module).__bases__[-1]
            module.__dict__.pop("_memkernels_offload", None)
            module.__dict__.pop("_memkernels_recompute_context", None)
            count += 1
    return count


class ApplyReport:
    """What :func:`apply_placement` did: ``wrapped`` (list of ``(qualified name, action)``), ``kernels``
    (the :class:`~memkernels.fusions.apply.PatchReport`, or None), ``offload`` (the shared
    OffloadActivations or None)."""

    def __init__(self, wrapped, kernels, offload):
        self.wrapped, self.kernels, self.offload = wrapped, kernels, offload

    def summary(self):
        counts = {}
        for _, action in self.wrapped:
            counts[action] = counts.get(action, 0) + 1
        done = {"recompute": "recomputed", "offload": "offloaded", "offload_checkpoint": "checkpoint-offloaded"}
        parts = [f"{n} modules {done[action]}" for action, n in sorted(counts.items())] or ["no module wrapped"]
        lines = [f"memkernels.apply(plan): {', '.join(parts)}"]
        lines += [f"  {name or '(model)'}: {action}" for name, action in self.wrapped]
        if self.kernels is not None:
            lines.append(self.kernels.summary())
        return "\n".join(lines)

    __str__ = summary


def apply_placement(model, choices, *, kernels=False, offload_options=None, recompute_context=None, offload=None):
    """Wrap ``model``'s layers as ``choices`` says (one :class:`LayerOption` per layer).

    ``kernels``: also swap in memkernels' fused kernels first (:func:`memkernels.fusions.apply.apply`), the
    fused linear cross-entropy with the strategy the plan counted (``"recompute"``).
    ``offload_options``: keyword arguments of the shared OffloadActivations (default
    :data:`OFFLOAD_OPTIONS`); ``offload``: an OffloadActivations to share instead of a new one
    (the meta measurement passes its bookkeeping one).
    """
    prefix, layers = find_layers(model)
    if len(choices) != len(layers):
        raise ValueError(f"memkernels.apply(plan=...): the plan has {len(choices)} layers but the model has "
                         f"{len(layers)}; make the plan for this model")
    kernel_report = None
    if kernels:
        from memkernels.fusions.apply import apply as apply_kernels
        kernel_report = apply_kernels(model, **KERNELS)
        install_loss_strategy(model)
        prefix, layers = find_layers(model)
    if offload is None and any(choice.offloaded for choice in choices):
        from memkernels.runtime.offload import OffloadActivations
        offload = OffloadActivations(**(OFFLOAD_OPTIONS if offload_options is None else offload_options))
    wrapped = []
    for index, (layer, choice) in enumerate(zip(layers, choices)):
        for part, action in choice.actions.items():
            child = submodule_name(layer, part)
            if child is None:
                raise ValueError(f"memkernels.apply(plan=...): layer {index} ({type(layer).__name__}) has no "
                                 f"{part} submodule; make the plan for this model")
            module = layer.get_submodule(child) if child else layer
            wrap(module, action, offload, recompute_context)
            wrapped.append((".".join(p for p in (prefix, str(index), child) if p), action))
    return ApplyReport(wrapped, kernel_report, offload)


# The kernels a plan measures (memkernels.planning.placement) and applies: fused norms and MLPs, and the fused linear
# cross-entropy where apply() installs it, with this strategy (8 B a token held for backward).
KERNELS = {"norms": True, "mlp": True, "loss": True, "measure": False}
LOSS_STRATEGY = "recompute"


def fused_losses(model):
    """``[(name, module)]`` of the fused losses ``memkernels.apply`` installed in ``model``."""
    from memkernels.fusions.loss.rule import CausalLMLoss
    return [(name, module) for name, module in model.named_modules() if isinstance(module, CausalLMLoss)]


def install_loss_strategy(model):
    """Give the fused losses ``memkernels.apply`` installed in ``model`` the plan's :data:`LOSS_STRATEGY`;
    returns how many there were."""
    losses = fused_losses(model)
    for _, module in losses:
        module.strategy = LOSS_STRATEGY
    return len(losses)


def apply(model, plan=None, *, norms=True, mlp=True, loss=True, rope=True, measure=True):
    """``memkernels.apply``: swap memkernels' fused kernels into ``model`` in place, or carry out a plan.

    Without ``plan``: :func:`memkernels.fusions.apply.apply` (returns a :class:`~memkernels.fusions.apply.PatchReport`):
    ``norms`` / ``mlp`` / ``loss`` / ``rope`` choose the kinds replaced (``mlp="recompute"`` also recomputes
    gated MLPs' gate and up in backward), ``measure`` measures saved bytes per token before and after on a meta
    copy. ``plan``: a :class:`memkernels.planning.plan.Plan` (or a per-layer ``Placement``): its kernels, then
    checkpointing / offload on exactly the modules it chose (:func:`apply_plan`; returns an
    :class:`ApplyReport`). Call it before wrapping the model in DDP/FSDP or ``torch.compile``.
    The entry point lives here, with the planner, so that patching never imports the planner.
    """
    if plan is not None:
        return apply_plan(model, plan)
    from memkernels.fusions.apply import apply as apply_kernels
    return apply_kernels(model, norms=norms, mlp=mlp, loss=loss, rope=rope, measure=measure)


def apply_plan(model, plan, offload_options=None):
    """``memkernels.apply(model, plan)``: carry out a :class:`~memkernels.planning.plan.Plan` (its kernels and
    per-layer placement) or a :class:`~memkernels.planning.placement.Placement` on ``model``; returns an
    :class:`ApplyReport`. Offloaded modules share one OffloadActivations (``offload_options``: its
    keyword arguments, on top of :data:`OFFLOAD_OPTIONS`: every saved tensor of the module, its last
    submodule's too)."""
    choices = getattr(plan, "choices", None)
    if not isinstance(model, nn.Module) or choices is None:
        raise ValueError("memkernels.apply(model, plan): needs an nn.Module and a Plan or Placement from "
                         f"memkernels.plan / memkernels.planning.plan.place, got {type(model).__name__} and "
                         f"{type(plan).__name__}")
    options = dict(OFFLOAD_OPTIONS)
    options.update(offload_options or {})
    return apply_placement(model, choices, kernels=bool(getattr(plan, "kernels", False)), offload_options=options)
