"""``FusedDyT``: the nn.Module of memkernels.functional.dyt, with the parameters of DyT's reference ``DynamicTanh``
(``alpha``, ``weight``, ``bias``: the same state_dict keys, so checkpoints load either way)."""
import numbers

import torch
from torch import nn

from memkernels.fusions.dyt.op import dyt


class FusedDyT(nn.Module):
    """Dynamic Tanh over the last dimension: ``weight * tanh(alpha * x) + bias`` (Zhu et al., 2025), a drop-in
    for a transformer's LayerNorm.

    Args:
        hidden_size: the size of x's last dimension.
        alpha_init_value: alpha's initial value (the paper's default 0.5; it suggests less for wide or deep
            models).
        bias: learn a bias (default True, as the paper's ``DynamicTanh``).

    Input [..., hidden_size]; output the same shape, in the dtype eager's formula gives. Saves x alone for
    backward, where eager saves x and tanh's output (see memkernels.functional.dyt).
    """

    def __init__(self, hidden_size, alpha_init_value=0.5, bias=True, device=None, dtype=None):
        super().__init__()
        if not isinstance(hidden_size, numbers.Integral) or isinstance(hidden_size, bool) or hidden_size <= 0:
            raise ValueError(f"FusedDyT: hidden_size={hidden_size!r} must be a positive int (x's last dimension)")
        if not isinstance(alpha_init_value, numbers.Real) or isinstance(alpha_init_value, bool):
            raise TypeError(f"FusedDyT: alpha_init_value={alpha_init_value!r} must be a number (the paper uses 0.5)")
        self.hidden_size = int(hidden_size)
        self.alpha_init_value = float(alpha_init_value)
        factory = {"device": device, "dtype": dtype}
        self.alpha = nn.Parameter(torch.empty(1, **factory))
        self.weight = nn.Parameter(torch.empty(self.hidden_size, **factory))
        self.bias = nn.Parameter(torch.empty(self.hidden_size, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        """alpha = alpha_init_value, weight = 1, bias = 0, as the paper's ``DynamicTanh``."""
        nn.init.constant_(self.alpha, self.alpha_init_value)
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x):
        return dyt(x, self.alpha, self.weight, self.bias)

    def extra_repr(self):
        return f"{self.hidden_size}, alpha_init_value={self.alpha_init_value}, bias={self.bias is not None}"
