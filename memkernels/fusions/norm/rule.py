"""apply()'s rule for norms: ``nn.LayerNorm`` → ``FusedLayerNorm``, ``nn.RMSNorm`` → ``FusedRMSNorm``, and a model
library's own ``...RMSNorm`` / ``...LayerNorm`` class → the fused norm computing the formula its forward computes
(:data:`NORM_FORMULAS`, probed once per class, bit for bit)."""
import torch
from torch import nn

from memkernels.distributed import is_dtensor, layout_hooks_only
from memkernels.fusions.rule import Rule, missing_op, plain_reason, probe_of, set_child

# A norm class of a model library (Hugging Face has an RMSNorm per family, ~180 in transformers 5) is
# fused when its forward computes, bit for bit on probe inputs, one of these formulas, keyed by the
# fused norm ("rms": FusedRMSNorm, "layer": FusedLayerNorm), offset and casting_mode (see _norm_formula).
NORM_FORMULAS = {
    ("rms", 0.0, "llama"): "RMS-normalized in float32, cast to the input dtype, then times the weight (Llama, "
                           "Mistral, Qwen 2/3, Phi-3, Granite, DeepSeek-V3)",
    ("rms", 1.0, "gemma"): "RMS-normalized in float32, times (1 + weight) in float32, then cast (Gemma 1-3, "
                           "Qwen3.5)",
    ("rms", 0.0, "gemma"): "RMS-normalized in float32, times the weight in float32, then cast (OLMo-2, GPT-OSS, "
                           "Gemma 4)",
    ("layer", 0.0, "gemma"): "mean-centred and normalized in float32, times the weight (plus the bias) in float32, "
                             "then cast (Cohere)",
}


def _norm_kind(module):
    """Whether ``module`` is a norm apply() considers: torch's own, or a class named ...RMSNorm or
    ...LayerNorm (not memkernels' own: fused already)."""
    from memkernels.fusions.norm.module import FusedLayerNorm, FusedRMSNorm

    name = type(module).__name__.lower()
    return type(module) in (nn.LayerNorm, nn.RMSNorm) or (
        name.endswith(("rmsnorm", "layernorm")) and not isinstance(module, (FusedRMSNorm, FusedLayerNorm)))


_PROBED_FORMULAS = {}  # class -> its key of NORM_FORMULAS, or the reason it matches none


def _norm_formula(module):
    """The key of NORM_FORMULAS whose fused norm computes what ``module``'s class computes, or a string
    saying why none does. Decided once per class, by running its forward on a CPU copy with random
    weights (never the module itself: no hooks fire, no device work) in float32 and bfloat16 and
    comparing bit for bit with each formula written as such a class writes it."""
    cls = type(module)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    parameters = dict(module.named_parameters())
    if not parameters:
        return (f"{cls.__name__} has no weight (an unweighted norm): fused norms take their normalized shape from "
                "the weight")
    if (parameters.keys() not in ({"weight"}, {"weight", "bias"}) or any(p.dim() != 1 for p in parameters.values())
            or next(module.buffers(), None) is not None or next(module.children(), None) is not None):
        return (f"{cls.__name__} is not a norm over the last dimension with a 1-D weight (and bias) alone (no "
                "other parameters, buffers or submodules)")
    if not isinstance(eps, float):
        return f"{cls.__name__} keeps its epsilon in neither .variance_epsilon nor .eps as a float"
    if cls not in _PROBED_FORMULAS:
        _PROBED_FORMULAS[cls] = _probe_norm(module, eps, sorted(parameters), parameters["weight"].shape[0])
    return _PROBED_FORMULAS[cls]


def _formulas(x, weight, bias, eps):
    """Each NORM_FORMULAS entry's output for ``x``, computed in the op order the classes it names use."""
    dtype, h = x.dtype, x.float()
    outputs = {}
    if bias is None:
        rms = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        outputs.update({("rms", 0.0, "llama"): weight * rms.to(dtype),
                        ("rms", 1.0, "gemma"): (rms * (1.0 + weight.float())).to(dtype),
                        ("rms", 0.0, "gemma"): (weight * rms).to(dtype)})
    centered = h - h.mean(-1, keepdim=True)
    layer = weight.float() * (centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps))
    outputs[("layer", 0.0, "gemma")] = (layer if bias is None else layer + bias.float()).to(dtype)
    return outputs


def _probe_norm(module, eps, names, hidden):
    generator = torch.Generator().manual_seed(0)
    probe = probe_of(module)
    matching = set(NORM_FORMULAS)
    for dtype in (torch.float32, torch.bfloat16):
        values = {name: torch.randn(hidden, generator=generator).to(dtype) for name in names}
        probe._parameters = {name: nn.Parameter(value, requires_grad=False) for name, value in values.items()}
        # rows at mean squares ~1, ~eps (where eps is half of the denominator) and ~100, off-centre; 3-D, so that
        # a norm over another dimension (a channels-first LayerNorm) shows
        scale = torch.tensor([[1.0], [max(eps, 1e-12) ** 0.5], [10.0]])
        x = (torch.randn(2, 3, hidden, generator=generator).add(0.5) * scale).to(dtype)
        try:
            with torch.no_grad():
                got = probe.forward(x)  # not __call__: no global module hooks fire
        except Exception as error:  # a forward that needs more than x (a gate, a residual) is not this norm
            return f"{type(module).__name__}'s forward did not run on a lone input: {type(error).__name__}: {error}"
        expected = _formulas(x, values["weight"], values.get("bias"), eps)
        matching = {f for f in matching & expected.keys() if isinstance(got, torch.Tensor)
                    and got.dtype == expected[f].dtype and torch.equal(got, expected[f])}
    if not matching:
        return (f"{type(module).__name__}'s forward is none of the norm formulas memkernels fuses "
                "(memkernels.fusions.norm.rule.NORM_FORMULAS), checked bit for bit in float32 and bfloat16")
    return min(matching)


def _sequence_parallel_norm(module):
    """Whether ``parallelize_module`` made ``module`` a sequence-parallel norm the fused norm can stand in for: its
    parameters replicated DTensors on a 1-D mesh, its hooks only the layout ones (kept on the fused norm), whose
    rms_norm / layer_norm take the token-sharded DTensor input."""
    from torch.distributed.tensor import Replicate

    parameters = list(module.parameters(recurse=False))
    return (bool(parameters) and layout_hooks_only(module)
            and all(is_dtensor(p) and p.device_mesh.ndim == 1 and tuple(p.placements) == (Replicate(),)
                    for p in parameters))


def _fused_norm(module, fused_layer_norm, fused_rms_norm):
    if type(module) is nn.LayerNorm:
        new = fused_layer_norm.from_module(module)
    elif type(module) is nn.RMSNorm:
        new = fused_rms_norm.from_module(module, casting_mode="llama")
    else:
        kind, offset, casting_mode = _norm_formula(module)
        new = (fused_rms_norm.from_module(module, offset=offset, casting_mode=casting_mode) if kind == "rms"
               else fused_layer_norm.from_module(module))
    # Share, don't copy: keeps optimizers, tied weights and FSDP/DDP registrations valid.
    if module.weight is not None:
        new.weight = module.weight
    if getattr(module, "bias", None) is not None:
        new.bias = module.bias
    # A sequence-parallel norm's layout hooks (parallelize_module's) move over with it.
    new._forward_pre_hooks.update(module._forward_pre_hooks)
    new._forward_hooks.update(module._forward_hooks)
    return new




class NormRule(Rule):
    """Torch's norms and any class named ...RMSNorm / ...LayerNorm whose forward is one of :data:`NORM_FORMULAS`."""

    kind, option = "norm", "norms"

    def matches(self, module):
        return _norm_kind(module)

    def blocker(self, module):
        why = None if _sequence_parallel_norm(module) else plain_reason(module, (type(module),), "the norm")
        if why is None and type(module) not in (nn.LayerNorm, nn.RMSNorm):
            formula = _norm_formula(module)
            why = formula if isinstance(formula, str) else None
        return why

    def require(self):
        try:
            import memkernels.fusions.norm.module  # noqa: F401
        except ImportError as error:
            raise missing_op(self.option, error) from error

    def swap(self, model, name, module, settings):
        from memkernels.fusions.norm.module import FusedLayerNorm, FusedRMSNorm

        set_child(model, name, _fused_norm(module, FusedLayerNorm, FusedRMSNorm))
