"""The contract of a fusion's rule, and what every rule shares.

A :class:`Rule` recognizes one kind of module by its structure (never by its family's name alone), says why a
module it recognizes must stay as it is, and swaps the fused computation in. ``memkernels.fusions.apply.RULES``
lists them in the order apply() asks them: the first rule that recognizes a module decides for it.
"""
import functools
import inspect
import sys

from memkernels.distributed import is_dtensor


class Rule:
    """One kind of module ``apply()`` fuses.

    ``kind``: the kind's name (a plan's and a test's word for it). ``option``: the ``apply()`` argument that switches
    it on (``"norms"``, ``"mlp"``, ``"loss"``, ``"rope"``). A rule recognizes a module (:meth:`matches`), says why a
    module it recognizes stays as it is (:meth:`blocker`: a reason, or None), imports what its swap needs before any
    module changes (:meth:`require`) and swaps (:meth:`swap`). A rule asked of the model as a whole
    (``memkernels.fusions.apply.MODEL_RULES``: a causal LM's loss is its forward's) finds its module with
    ``locate(model)`` instead of :meth:`matches`.
    """

    kind = None
    option = None
    note = None  # a sentence the report adds once when this rule fused something
    reported_when_off = False  # whether the report lists the modules it recognizes when its option is off

    def matches(self, module):
        """Whether ``module`` is of this rule's kind (and not fused already)."""
        raise NotImplementedError

    def blocker(self, module):
        """Why ``module`` keeps its own forward (a sentence for the report), or None when it is fused."""
        return None

    def require(self):
        """Import the fused ops :meth:`swap` calls; raise RuntimeError naming the option to turn off when
        this installation lacks them."""

    def swap(self, model, name, module, settings):
        """Fuse ``module`` (at ``name`` in ``model``) in place; ``settings``: apply()'s arguments by name. Returns
        the report's words for the result (None: the new module's type name)."""
        raise NotImplementedError


def missing_op(option, error):
    """The RuntimeError of a rule whose fused op does not import (``option``: the apply() argument)."""
    return RuntimeError(
        f"memkernels.apply({option}=True): the fused op it needs is not available in this memkernels "
        f"installation ({error}). Install a memkernels that ships it, or pass {option}=False.")


def plain_reason(module, classes, what):
    """Why the fused path may not read ``module``'s weights itself (None when it may).

    Only exactly one of ``classes`` with no hooks: a subclass or wrapper (a peft LoRA layer, a
    quantized linear) or a hook does something in its forward that reading the weights would skip.
    """
    if type(module) not in classes:
        kind = f"{type(module).__module__}.{type(module).__qualname__}"
        return (f"{what} is a {kind}, not a plain {'/'.join(c.__name__ for c in classes)}: fusing would go around "
                "its forward (e.g. a peft LoRA layer's adapter, a quantized linear)")
    return dtensor_reason(module, what) or hooks_reason(module, what)


def hooks_reason(module, what):
    """Why hooks on ``module`` keep it as it is (None when it has none)."""
    if module._forward_hooks or module._forward_pre_hooks:
        return f"{what} has forward hooks, which fusing would skip"
    return None


def dtensor_reason(module, what):
    """Why ``module`` keeps its forward when tensor parallelism (``parallelize_module``) made its weights DTensors
    in a layout the fused path does not take; its hooks redistribute its inputs and outputs."""
    if any(is_dtensor(p) for p in module.parameters(recurse=False)):
        return (f"{what}'s weights are DTensors (tensor parallelism) in a layout the fused path does not take "
                "(it takes colwise gate/up with a rowwise down_proj, an lm_head split over its classes, and "
                "sequence-parallel norms with replicated weights), so it keeps its own forward")
    return None


def unpatched_class(cls):
    """The class memkernels switched a module from, found in the MRO of ``cls``: the module's class may have been
    switched again since (fully_shard makes it ``FSDP<class>``, a subclass of memkernels' class)."""
    patched = next(k for k in cls.__mro__ if k.__module__ == __name__ and k.__name__.startswith("Memkernels"))
    return patched.__bases__[-1]


def switch_class(module, mixin):
    """Give ``module`` a subclass of its class with ``mixin``'s methods (same attributes, same keys).

    The subclass is registered in this module under its name so it pickles.
    """
    base = type(module)
    name = f"Memkernels{base.__name__}"
    cls = getattr(sys.modules[__name__], name, None)
    if cls is None or cls.__bases__[-1] is not base:
        # Each overridden method shows the original's signature and docstring (tools inspect them).
        methods = {attr: functools.wraps(getattr(base, attr))(_copy_function(fn)) for attr, fn in vars(mixin).items()
                   if inspect.isfunction(fn) and hasattr(base, attr)}
        cls = type(name, (mixin, base), {"__module__": __name__, **methods})
        setattr(sys.modules[__name__], name, cls)
    module.__class__ = cls


def _copy_function(fn):
    return type(fn)(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def probe_of(module):
    """A stand-in of ``module`` for a probe forward: its class and settings, its own dicts of parameters and
    submodules (a probe replaces them with random float64 ones), never the module itself (no hooks fire, no
    device work, nothing of the model's changed)."""
    probe = object.__new__(type(module))
    probe.__dict__.update(module.__dict__)
    probe._parameters, probe._modules = dict(module._parameters), dict(module._modules)
    return probe


def set_child(model, name, new):
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)

