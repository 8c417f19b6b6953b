"""Drop-in modules for GeLU→Linear and the GPT/BERT MLP that never store the activated tensor."""
import torch
from torch import nn

from memkernels.fusions.gelu_mlp.op import APPROXIMATIONS, gelu_linear


def _check_approximate(approximate, owner):
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"{owner}: approximate={approximate!r} is not supported; use 'none' or 'tanh'")


class GeLULinear(nn.Module):
    """``Linear(GELU(x))`` in one fused op that saves only its input for backward.

    Parameters, their names, initialization and state_dict are nn.Linear's
    (``weight`` [out_features, in_features], ``bias`` [out_features]), so a Linear's
    checkpoint loads unchanged. It is deliberately not an nn.Linear subclass: tools that
    swap every nn.Linear by type (adapters, quantizers) would silently drop the GeLU.

    Shapes: [..., in_features] -> [..., out_features]; float32, float16 or bfloat16.
    """

    def __init__(self, in_features, out_features, bias=True, approximate="none", device=None, dtype=None):
        super().__init__()
        _check_approximate(approximate, "GeLULinear")
        self.in_features = in_features
        self.out_features = out_features
        self.approximate = approximate
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        """nn.Linear's initialization, so a new GeLULinear starts like a new Linear."""
        nn.Linear.reset_parameters(self)

    @classmethod
    def from_linear(cls, linear, approximate="none"):
        """A GeLULinear computing ``linear(gelu(x))`` that shares ``linear``'s parameters."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"GeLULinear.from_linear: linear must be an nn.Linear, got {type(linear).__name__}")
        module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                     approximate=approximate, device="meta")
        module.weight = linear.weight
        module.bias = linear.bias
        return module

    def forward(self, x):
        return gelu_linear(x, self.weight, self.bias, approximate=self.approximate)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, approximate={self.approximate!r}")


class FusedMLP(nn.Module):
    """``fc2(gelu(fc1(x)))`` that saves only x and the pre-activation h for backward.

    fc1 is a plain nn.Linear (it saves x); fc2 is a :class:`GeLULinear` (it saves h and
    recomputes gelu(h) in backward). Eager PyTorch would also keep gelu(h), a second
    [tokens, hidden_features] tensor.

    Shapes: [..., in_features] -> [..., out_features] (out_features defaults to in_features).
    """

    def __init__(self, in_features, hidden_features, out_features=None, bias=True, approximate="none",
                 device=None, dtype=None):
        super().__init__()
        _check_approximate(approximate, "FusedMLP")
        out_features = in_features if out_features is None else out_features
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias, device=device, dtype=dtype)
        self.fc2 = GeLULinear(hidden_features, out_features, bias=bias, approximate=approximate,
                              device=device, dtype=dtype)

    @classmethod
    def from_modules(cls, fc1, act, fc2):
        """Convert an existing ``fc1 → GELU → fc2`` MLP, sharing its parameters (no copies).

        ``act`` must be an nn.GELU; its ``approximate`` is kept.
        """
        if not isinstance(act, nn.GELU):
            raise TypeError(f"FusedMLP.from_modules: act must be an nn.GELU, got {type(act).__name__}; "
                            "only a GeLU activation can be fused")
        for name, module in (("fc1", fc1), ("fc2", fc2)):
            if not isinstance(module, nn.Linear):
                raise TypeError(f"FusedMLP.from_modules: {name} must be an nn.Linear, got {type(module).__name__}")
        if fc1.out_features != fc2.in_features:
            raise ValueError(f"FusedMLP.from_modules: fc1.out_features={fc1.out_features} does not match "
                             f"fc2.in_features={fc2.in_features}")
        mlp = cls(fc1.in_features, fc1.out_features, fc2.out_features, approximate=act.approximate,
                  device="meta")
        mlp.fc1 = fc1
        mlp.fc2 = GeLULinear.from_linear(fc2, approximate=act.approximate)
        return mlp

    def forward(self, x):
        return self.fc2(self.fc1(x))
