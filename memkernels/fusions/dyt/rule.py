"""apply()'s rule for DyT: a module holding one learned scalar and one or two vectors of a size, with no buffers
or submodules, whose forward computes ``weight * tanh(alpha * x) + bias`` over the last dimension (probed once
per class and configuration, in float64, whatever its parameters are called: the paper's ``DynamicTanh`` names
them alpha / weight / bias, Liger's alpha / gamma / beta). Its class is switched to one whose forward calls
``memkernels.functional.dyt`` with those parameters: names, state_dict keys and hooks stay as they were."""
import itertools

import torch
from torch import nn

from memkernels.fusions.rule import Rule, dtensor_reason, missing_op, probe_of, switch_class, unpatched_class

_PROBED = {}  # (class, its plain settings) -> ("last" | "first", (alpha, weight, bias names)), or None


def _plain_settings(module):
    """The module's settings a forward may branch on (the paper's ``channels_last``), as a hashable key."""
    return tuple(sorted((key, value) for key, value in vars(module).items()
                        if not key.startswith("_") and isinstance(value, (bool, int, float, str, type(None)))))


def _candidate(module):
    """(alpha's name, the vectors' names) when ``module`` is shaped like a DyT: one parameter of one element,
    one or two 1-D parameters of one size (at least 2), no buffers, no submodules; else None."""
    parameters = dict(module.named_parameters(recurse=False))
    if not 2 <= len(parameters) <= 3 or next(module.buffers(), None) is not None \
            or next(module.children(), None) is not None:
        return None
    scalars = [name for name, p in parameters.items() if p.numel() == 1 and p.dim() <= 1]
    vectors = [name for name, p in parameters.items() if p.dim() == 1 and p.numel() > 1]
    if len(scalars) != 1 or len(vectors) != len(parameters) - 1 or len({parameters[n].numel() for n in vectors}) != 1:
        return None
    return scalars[0], vectors


def dyt_layout(module):
    """("last" or "first", (alpha, weight, bias names; bias None)) when ``module``'s forward is DyT over the
    last dimension or over dimension 1 (channels first: the paper's ConvNeXt form), else None. Decided once per
    class and settings by running its forward on a copy with random float64 parameters (never the module
    itself: no hooks fire, no device work)."""
    from memkernels.fusions.dyt.module import FusedDyT

    if isinstance(module, FusedDyT) or getattr(type(module), "_memkernels_dyt", False):
        return None
    candidate = _candidate(module)
    if candidate is None:
        return None
    key = (type(module), _plain_settings(module))
    if key not in _PROBED:
        _PROBED[key] = _probe(module, *candidate)
    return _PROBED[key]


def _probe(module, alpha_name, vector_names):
    from memkernels.fusions.dyt import reference

    hidden = getattr(module, vector_names[0]).numel()
    generator = torch.Generator().manual_seed(0)
    values = {alpha_name: torch.rand(getattr(module, alpha_name).shape, generator=generator,
                                     dtype=torch.float64) + 0.3}
    values.update({name: torch.randn(hidden, generator=generator, dtype=torch.float64) for name in vector_names})
    probe = probe_of(module)
    probe._parameters = {name: nn.Parameter(value, requires_grad=False) for name, value in values.items()}
    inputs = {"last": torch.randn(2, 3, hidden, generator=generator, dtype=torch.float64) * 2,
              "first": torch.randn(2, hidden, 3, 2, generator=generator, dtype=torch.float64) * 2}
    for layout, x in inputs.items():
        try:
            with torch.no_grad():
                got = probe.forward(x)  # not __call__: no global module hooks fire
        except Exception:  # noqa: BLE001 - a forward that needs more than x, or another layout: not this one
            continue
        if not isinstance(got, torch.Tensor) or got.shape != x.shape:
            continue
        # which vector is the weight and which the bias (or the weight alone)
        for roles in itertools.permutations(vector_names):
            weight, bias = values[roles[0]], values[roles[1]] if len(roles) > 1 else None
            if layout == "first":
                weight = weight[:, None, None]
                bias = None if bias is None else bias[:, None, None]
            expected = reference.eager(x, values[alpha_name], weight, bias)
            if torch.allclose(got, expected, rtol=1e-12, atol=1e-12):
                return layout, (alpha_name, roles[0], roles[1] if len(roles) > 1 else None)
    return None


class _FusedDyTForward:
    """The forward of a module :class:`DyTRule` switched: memkernels' DyT with the module's own parameters."""

    _memkernels_dyt = True

    def forward(self, x):
        from memkernels.fusions.dyt import op

        alpha, weight, bias = (None if name is None else getattr(self, name) for name in self._memkernels_dyt_roles)
        if op.unsupported(x, alpha, weight, bias) is not None:  # a dtype or device the fused op does not take
            return unpatched_class(type(self)).forward(self, x)
        return op.dyt_checked(x, alpha, weight, bias)


class DyTRule(Rule):
    """A module computing DyT over the last dimension (see :func:`dyt_layout`)."""

    kind, option = "dyt", "norms"

    def matches(self, module):
        return dyt_layout(module) is not None

    def blocker(self, module):
        layout, _ = dyt_layout(module)
        if layout == "first":
            return ("DyT over dimension 1 (channels first, as in a ConvNeXt) keeps its forward: the fused op scales "
                    "the last dimension")
        return dtensor_reason(module, "the DyT")  # hooks stay: the module is the same, its forward fused

    def require(self):
        try:
            import memkernels.fusions.dyt.op  # noqa: F401
        except ImportError as error:
            raise missing_op(self.option, error) from error

    def swap(self, model, name, module, settings):
        _, roles = dyt_layout(module)
        switch_class(module, _FusedDyTForward)
        module._memkernels_dyt_roles = roles
