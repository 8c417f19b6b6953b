"""nn.Module drop-ins for nn.RMSNorm and nn.LayerNorm backed by memkernels.functional.

Parameter names and state_dict keys match torch's (``weight``, ``bias``), so
checkpoints load either way, and ``from_module`` converts an existing norm
with its weights.
"""
import numbers

import torch
from torch import nn

from memkernels.distributed import is_dtensor
from memkernels.fusions.norm.op import normalize


class _FusedNorm(nn.Module):
    """Parameters, conversion and repr shared by the fused norm modules."""

    _is_rms = True
    _has_residual = False
    _default_bias = False

    def __init__(self, normalized_shape, eps, elementwise_affine, bias, device, dtype, *,
                 offset=0.0, casting_mode="llama", memory_efficient=False, in_place=False):
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        if not isinstance(normalized_shape, (tuple, list, torch.Size)) or not all(
                isinstance(n, numbers.Integral) and not isinstance(n, bool) and n > 0 for n in normalized_shape):
            raise ValueError(f"{type(self).__name__}: normalized_shape={normalized_shape!r} must be a positive int "
                             "or a tuple of positive ints (the trailing dims of x to normalize over)")
        self.normalized_shape = tuple(int(n) for n in normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.offset = offset
        self.casting_mode = casting_mode
        self.memory_efficient = memory_efficient
        self.in_place = in_place
        factory = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **factory))
            self.bias = nn.Parameter(torch.empty(self.normalized_shape, **factory)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        """weight = 1 - offset (so offset + weight starts at 1), bias = 0, as torch's norms do."""
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 - self.offset)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _eps_for(self, x):
        # nn.RMSNorm's eps=None is the epsilon of its compute type, fp32 for fp32/fp16/bf16 inputs.
        return torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps if self.eps is None else self.eps

    def _run(self, x, residual):
        y, residual_out = normalize(
            type(self).__name__, x, residual, self.weight, self.bias, self._eps_for(x),
            self.offset, self._is_rms,
            self.casting_mode if self._is_rms else "gemma", self.memory_efficient, self.normalized_shape,
            self.in_place)
        return (y, residual_out) if self._has_residual else y

    def extra_repr(self):
        text = f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        if self.elementwise_affine and self.bias is None and not self._is_rms:
            text += ", bias=False"
        if self._is_rms and self.bias is not None:
            text += ", bias=True"
        if self.offset:
            text += f", offset={self.offset}"
        if self._is_rms and self.casting_mode != "llama":
            text += f", casting_mode={self.casting_mode!r}"
        if self.memory_efficient:
            text += ", memory_efficient=True"
        if self.in_place:
            text += ", in_place=True"
        return text

    @classmethod
    def from_module(cls, module, **options):
        """Build this norm from an existing one, copying its weights.

        Accepts nn.RMSNorm, nn.LayerNorm, memkernels' fused norms, and modules
        shaped like Hugging Face's LlamaRMSNorm (``weight`` plus ``eps`` or
        ``variance_epsilon``). The math of the result is this class's: converting
        an nn.LayerNorm into FusedRMSNorm changes the function (it keeps its bias).
        ``options`` (offset, casting_mode, memory_efficient, ...) go to the
        constructor.
        """
        weight = getattr(module, "weight", None)
        bias = getattr(module, "bias", None)
        eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
        shape = getattr(module, "normalized_shape", None)
        if shape is None and isinstance(weight, torch.Tensor):
            shape = tuple(weight.shape)
        if shape is None or not (isinstance(weight, torch.Tensor) or weight is None):
            raise TypeError(f"{cls.__name__}.from_module: {type(module).__name__} is not a norm module "
                            "(needs normalized_shape or a weight tensor); pass nn.RMSNorm, nn.LayerNorm or "
                            "a fused norm")
        if bias is not None and not isinstance(bias, torch.Tensor):
            bias = None
        reference = weight if weight is not None else bias
        new = cls(shape, eps=eps, elementwise_affine=weight is not None, bias=bias is not None,
                  device=reference.device if reference is not None else None,
                  dtype=reference.dtype if reference is not None else None, **options)
        with torch.no_grad():  # a replicated DTensor (a sequence-parallel norm's) copied from its local copy
            if weight is not None:
                new.weight.copy_(weight.to_local() if is_dtensor(weight) else weight)
            if bias is not None:
                new.bias.copy_(bias.to_local() if is_dtensor(bias) else bias)
        new.train(module.training)
        return new


class FusedRMSNorm(_FusedNorm):
    """RMSNorm: y = x / sqrt(mean(x**2) + eps) * (offset + weight) [+ bias].

    A drop-in for nn.RMSNorm, and for nn.LayerNorm by one word: it accepts
    nn.LayerNorm's constructor arguments (normalized_shape, eps,
    elementwise_affine, bias, device, dtype). The math is RMSNorm all the same
    (no mean subtraction); ``bias=True`` adds a bias after the scale.

    Args:
        normalized_shape: int or tuple; the trailing dims normalized together.
        eps: None (default, as nn.RMSNorm) means torch.finfo(torch.float32).eps, the
            epsilon of the fp32 compute type, as nn.RMSNorm does for fp32/fp16/bf16.
        elementwise_affine: learn ``weight`` (initialized to 1 - offset); without one the
            scale is the offset alone (none when offset is 0).
        bias: learn a ``bias`` too (default False, as nn.RMSNorm).
        offset: scale is (offset + weight); 1.0 for Gemma.
        casting_mode, memory_efficient, in_place: see memkernels.functional.rms_norm.

    Shapes: x [..., *normalized_shape] fp32/fp16/bf16 -> y, same shape and dtype.
    Saves 4 new bytes per token for backward (x itself plus an fp32 rstd).
    """

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, bias=False, device=None, dtype=None,
                 *, offset=0.0, casting_mode="llama", memory_efficient=False, in_place=False):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype, offset=offset,
                         casting_mode=casting_mode, memory_efficient=memory_efficient, in_place=in_place)

    def forward(self, x):
        return self._run(x, None)


class FusedLayerNorm(_FusedNorm):
    """LayerNorm with nn.LayerNorm's constructor and state_dict; ``bias=False`` means no bias parameter.

    Shapes: x [..., *normalized_shape] fp32/fp16/bf16 -> y, same shape and dtype.
    Statistics and the affine step run in fp32. Saves 8 new bytes per token
    (fp32 mean and rstd) beyond x; memory_efficient=True keeps y and rstd instead
    (see memkernels.functional.layer_norm, also for in_place).
    """

    _is_rms = False

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None,
                 *, memory_efficient=False, in_place=False):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype,
                         memory_efficient=memory_efficient, in_place=in_place)

    def forward(self, x):
        return self._run(x, None)


class FusedAddRMSNorm(FusedRMSNorm):
    """Residual add fused with RMSNorm: ``forward(x, residual) -> (y, residual_out)``.

    residual_out = x + residual is the new residual stream; y = RMSNorm(residual_out).
    Constructor as :class:`FusedRMSNorm`. Saves residual_out and an fp32 rstd.
    """

    _has_residual = True

    def forward(self, x, residual):
        return self._run(x, residual)


class FusedAddLayerNorm(FusedLayerNorm):
    """Residual add fused with LayerNorm: ``forward(x, residual) -> (y, residual_out)``.

    Constructor as :class:`FusedLayerNorm`. Saves residual_out, fp32 mean and rstd.
    """

    _has_residual = True

    def forward(self, x, residual):
        return self._run(x, residual)
