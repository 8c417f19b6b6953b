"""apply()'s rule for RoPE: an attention class whose forward calls a module-level function named like a RoPE that
computes ``x * cos + rotate_half(x) * sin`` for q and k (probed once per function, in float64) becomes a subclass
whose forward calls ``memkernels.functional.rope`` there instead; the model's module is not patched."""
import functools
import inspect
import sys
import types

import torch
from torch import nn

from memkernels.fusions.rule import Rule

# Module-level functions an attention forward calls are RoPE candidates when their names say so; one is
# replaced only when it computes the rotate-half formula (probed once per function, in float64).
_ROPE_NAME_PARTS = ("rotary", "rope")
_PROBED_ROPE = {}  # function -> True, or the reason it is not the rotate-half RoPE
_ROPE_SITES = {}  # attention class -> _rope_site's answer


def _defined_forward(cls):
    """The plain function ``cls`` runs as its forward (its own or inherited), or None."""
    forward = next((klass.__dict__["forward"] for klass in cls.__mro__ if "forward" in klass.__dict__), None)
    return forward if isinstance(forward, types.FunctionType) and forward is not nn.Module.forward else None


def _rope_site(cls):
    """(global name, function) of the RoPE that ``cls.forward`` calls, a string saying why it is not
    replaced, or None when its forward calls nothing named like a RoPE (not an attention module).
    Decided once per class."""
    if cls not in _ROPE_SITES:
        _ROPE_SITES[cls] = _find_rope_site(cls)
    return _ROPE_SITES[cls]


def _is_function(value):
    """A plain function, or one the ``kernels`` package turned into a module instance so that a hub kernel can
    replace it (transformers >= 5.25 with ``kernels`` installed: ``@use_kernel_forward_from_hub`` on
    ``apply_rotary_pos_emb``); called outside a kernelized model, such an instance runs the function."""
    return isinstance(value, types.FunctionType) or (isinstance(value, nn.Module)
                                                      and hasattr(value, "kernel_layer_name"))


def _find_rope_site(cls):
    forward = _defined_forward(cls)
    if forward is None or getattr(cls, "_memkernels_rope", None):
        return None
    inner = inspect.unwrap(forward)  # under functools.wraps decorators (transformers' deprecate_kwarg)
    named = [(name, inner.__globals__[name]) for name in inner.__code__.co_names
             if any(part in name.lower() for part in _ROPE_NAME_PARTS) and name in inner.__globals__
             and _is_function(inner.__globals__[name])]
    if not named:
        return None
    reasons = []
    for name, function in named:
        if function not in _PROBED_ROPE:
            _PROBED_ROPE[function] = _probe_rope(function)
        if _PROBED_ROPE[function] is True:
            return name, function
        reasons.append(_PROBED_ROPE[function])
    return "; ".join(reasons)


def _probe_rope(function):
    """True when ``function(q, k, cos, sin)`` computes ``x * cos + rotate_half(x) * sin`` for q and k (float64,
    random tables that are not Hugging Face's repeated halves, q as a transposed view); else why not."""
    from memkernels.fusions.rope import reference

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 3, 8, generator=generator, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(2, 5, 2, 8, generator=generator, dtype=torch.float64).transpose(1, 2)
    cos, sin = (torch.randn(2, 5, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    who = f"{function.__module__}.{getattr(function, '__qualname__', type(function).__qualname__)}"
    try:
        with torch.no_grad():
            got = function(q, k, cos, sin)
    except Exception as error:  # another signature (multimodal RoPE's sections, a partial rotary's slice)
        return f"{who}(q, k, cos, sin) did not run as the rotate-half RoPE: {type(error).__name__}: {error}"
    expected = reference.rotate(q, k, cos, sin, torch.float64, torch.float64, False)
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(
            isinstance(t, torch.Tensor) and t.shape == e.shape and torch.allclose(t, e, rtol=0, atol=1e-12)
            for t, e in zip(got, expected))):
        return f"{who} is not the rotate-half RoPE x * cos + rotate_half(x) * sin (checked in float64)"
    return True


def _fused_rope_function(original):
    """``original``'s stand-in: memkernels' rope where it takes the call, ``original`` itself elsewhere
    (other arguments, tables that need a gradient, shapes or dtypes rope does not take)."""
    from memkernels.fusions.rope import op as rope_op

    # Not functools.wraps: torch.compile would take the stand-in for the model module's function of that name
    # and guard on the original's closure.
    def fused(q, k, cos, sin, *args, **kwargs):
        if args or kwargs and (kwargs.keys() != {"unsqueeze_dim"} or kwargs["unsqueeze_dim"] != 1) \
                or rope_op.unsupported(q, k, cos, sin) is not None:
            return original(q, k, cos, sin, *args, **kwargs)
        return rope_op.rope_checked(q, k, cos, sin)

    return fused


def _with_globals(fn, replacements):
    """``fn`` rebuilt so that the function under its ``functools.wraps`` decorators looks ``replacements`` up
    as globals (the module stays as it is); None when a decorator does not hold what it wraps in a closure."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        rebuilt = types.FunctionType(fn.__code__, _redirected_namespace(fn.__globals__, replacements), fn.__name__,
                                     fn.__defaults__, fn.__closure__)
    else:
        cells = fn.__closure__ or ()
        holding = [index for index, cell in enumerate(cells) if _cell_contents(cell) is inner]
        rebuilt_inner = _with_globals(inner, replacements) if len(holding) == 1 else None
        if rebuilt_inner is None:
            return None
        cells = tuple(types.CellType(rebuilt_inner) if index == holding[0] else cell
                      for index, cell in enumerate(cells))
        rebuilt = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)
    rebuilt.__kwdefaults__ = fn.__kwdefaults__
    functools.update_wrapper(rebuilt, fn, updated=())
    rebuilt.__dict__.update(fn.__dict__)
    if inner is None:
        del rebuilt.__wrapped__
    else:
        rebuilt.__wrapped__ = rebuilt_inner
    return rebuilt


def _redirected_namespace(namespace, replacements):
    """A copy of a module's ``namespace`` with ``replacements``, as the namespace of a module of its own in
    sys.modules: torch.compile finds a function's globals through ``__name__``'s module, and must find the
    replacements there, not the model module's originals."""
    name = f"_memkernels_redirected_{namespace['__name__'].replace('.', '_')}"
    module = sys.modules.get(name)
    if module is None or any(module.__dict__.get(key) is not value for key, value in replacements.items()):
        module = types.ModuleType(name)
        module.__dict__.update({**namespace, **replacements, "__name__": name})
        sys.modules[name] = module
    return module.__dict__


def _cell_contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _rope_class(base, name, original):
    """The subclass of attention class ``base`` whose forward calls the fused RoPE for global ``name``;
    a string saying why there is none. Registered in this module under its name so it pickles."""
    cls_name = f"MemkernelsRope{base.__name__}"
    cls = getattr(sys.modules[__name__], cls_name, None)
    if cls is None or cls.__bases__ != (base,) or cls._memkernels_rope != (name, original):
        forward = _with_globals(_defined_forward(base), {name: _fused_rope_function(original)})
        if forward is None:
            return (f"{base.__name__}.forward is wrapped by a decorator that does not keep the function in a "
                    "closure: its RoPE call cannot be redirected")
        cls = type(cls_name, (base,), {"__module__": __name__, "forward": forward, "_memkernels_rope": (name, original)})
        setattr(sys.modules[__name__], cls_name, cls)
    return cls


class RopeRule(Rule):
    """An attention module whose forward calls the rotate-half RoPE (see :func:`_rope_site`)."""

    kind, option = "rope", "rope"

    def matches(self, module):
        return _rope_site(type(module)) is not None

    def blocker(self, module):
        site = _rope_site(type(module))
        replacement = _rope_class(type(module), *site) if isinstance(site, tuple) else site
        return replacement if isinstance(replacement, str) else None

    def swap(self, model, name, module, settings):
        module.__class__ = _rope_class(type(module), *_rope_site(type(module)))
