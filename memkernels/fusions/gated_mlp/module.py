"""Drop-in gated (SwiGLU / GeGLU) MLP that never stores act(gate) * up, and the one forward it shares with the
gated MLPs ``memkernels.apply`` fuses."""
import torch
from torch import nn


# Activation modules of gated MLPs -> gated_linear's activation name (Hugging Face's ACT2FN classes
# by name, so transformers need not be imported).
_HF_GATED_ACTIVATIONS = {"SiLU": "silu", "SiLUActivation": "silu", "GELUActivation": "gelu",
                         "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh",
                         "FastGELUActivation": "gelu_tanh"}


def gated_activation(act):
    """"silu" / "gelu" / "gelu_tanh" for a gated MLP's activation module, None if it is none of them."""
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    return _HF_GATED_ACTIVATIONS.get(type(act).__name__)


def gated_mlp_parts(mlp):
    """(gate_proj, up_proj, down_proj, activation module) of a gated MLP; up_proj is None for a packed
    ``gate_up_proj`` (Phi-3). Raises TypeError naming what is missing."""
    act = next((getattr(mlp, name) for name in ("act_fn", "activation_fn", "act") if hasattr(mlp, name)), None)
    if hasattr(mlp, "gate_up_proj"):
        gate, up = mlp.gate_up_proj, None
    else:
        gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    down = getattr(mlp, "down_proj", None)
    if gate is None or down is None or (up is None and not hasattr(mlp, "gate_up_proj")) or act is None:
        raise TypeError(f"{type(mlp).__name__} is not a gated MLP: expected gate_proj + up_proj (or gate_up_proj), "
                        "down_proj and an activation (act_fn / activation_fn / act)")
    return gate, up, down, act


def lora_down(down):
    """(base nn.Linear, [(lora_A weight, lora_B module, scaling)] of the active adapters) of a down
    projection, or a string saying why it cannot be fused. A peft LoRA layer is recognized by its
    attributes (peft need not be importable)."""
    if type(down) is nn.Linear:
        return down, []
    base = getattr(down, "base_layer", down)
    if type(base).__module__.startswith("bitsandbytes"):
        return f"bitsandbytes-quantized down_proj ({type(base).__name__}): the fused GEMM needs a dense weight"
    if type(base) is not nn.Linear or not hasattr(down, "lora_A"):
        return f"down_proj is {type(down).__name__}, not nn.Linear or a LoRA layer over one"
    if down.disable_adapters and down.merged:
        return "down_proj's merged LoRA adapter is disabled (peft unmerges it in its forward)"
    if down.disable_adapters or down.merged:  # the base weight alone is the layer
        return base, []
    adapters = []
    for adapter in down.active_adapters:
        if adapter not in down.lora_A.keys():
            continue
        if adapter in getattr(down, "lora_variant", {}) or getattr(down, "use_dora", {}).get(adapter):
            return f"LoRA variant (e.g. DoRA) {adapter!r} on down_proj"
        if not isinstance(down.lora_dropout[adapter], nn.Identity):
            return f"LoRA dropout on down_proj (adapter {adapter!r}) needs act(gate) * up materialized"
        adapters.append((down.lora_A[adapter].weight, down.lora_B[adapter], down.scaling[adapter]))
    return base, adapters


def gated_mlp_forward(x, gate_proj, up_proj, down_proj, activation, *, recompute=False, gate_multiplier=1.0,
                      down_multiplier=1.0):
    """``down_proj(act(gate_proj(x) * gate_multiplier) * up_proj(x)) * down_multiplier`` with the product never
    stored: the one forward of :class:`FusedGatedMLP` and of the gated MLPs ``memkernels.apply`` fuses.

    x: [..., H]; ``up_proj`` None for a packed ``gate_up_proj`` (as ``gate_proj``, [2*I] whose first half is gate).
    ``recompute``: gated_mlp_recompute (saves only x; long inputs in token chunks) where the projections are plain,
    hook-free nn.Linear and there is no gate multiplier, else the saving variant: gate and up saved, gated_linear for
    the down projection, a peft LoRA adapter on down_proj as gated_linear's ``adapter=`` (lora_A on the same c).
    Tensor-parallel projections (colwise gate/up, rowwise down: DTensor weights) give down's partial sums to its own
    output hook. Returns None where down_proj cannot be fused (:func:`lora_down` says why): the caller runs the
    unfused computation or raises.
    """
    from memkernels.distributed import is_dtensor
    from memkernels.fusions.gated_mlp.op import gated_linear, gated_mlp_recompute

    if recompute and gate_multiplier == 1.0 and not is_dtensor(down_proj.weight) and all(
            p is None or type(p) is nn.Linear for p in (gate_proj, up_proj, down_proj)):
        up_weight, up_bias = (None, None) if up_proj is None else (up_proj.weight, up_proj.bias)
        out = gated_mlp_recompute(x, gate_proj.weight, gate_proj.bias, up_weight, up_bias, down_proj.weight,
                                  down_proj.bias, activation=activation)
        return out if down_multiplier == 1.0 else out * down_multiplier
    down = lora_down(down_proj)
    if isinstance(down, str):
        return None
    base, adapters = down
    if adapters and is_dtensor(base.weight):  # LoRA on a tensor-parallel down_proj
        return None
    gate = gate_proj(x)
    if up_proj is None:
        if gate_multiplier != 1.0:  # the gate half scaled, as a new packed tensor (the scaled half alone would
            half = gate.shape[-1] // 2  # keep the whole unscaled one alive through its up half)
            gate = torch.cat((gate[..., :half] * gate_multiplier, gate[..., half:]), dim=-1)
        operands = {"gate_up": gate}
    else:
        operands = {"gate": gate if gate_multiplier == 1.0 else gate * gate_multiplier, "up": up_proj(x)}
    if is_dtensor(base.weight):  # colwise then rowwise: this rank's I/tp features
        return _tensor_parallel_down(base, operands, activation, down_multiplier)
    if not adapters:
        out = gated_linear(**operands, weight=base.weight, bias=base.bias, activation=activation)
    else:  # the adapters' A weights, stacked, on the same transient c: one GEMM more (peft keeps a copy of c for it)
        weights = [a for a, _, _ in adapters]
        stacked = weights[0] if len(weights) == 1 else torch.cat([a.to(weights[0].dtype) for a in weights])
        out, low = gated_linear(**operands, weight=base.weight, bias=base.bias, activation=activation, adapter=stacked)
        for part, (lora_a_weight, lora_b, scaling) in zip(low.split([a.shape[0] for a in weights], -1), adapters):
            out = out + lora_b(part.to(lora_a_weight.dtype)) * scaling
    return out if down_multiplier == 1.0 else out * down_multiplier


def _tensor_parallel_down(down, operands, activation, down_multiplier):
    """down_proj of a tensor-parallel gated MLP, fused: the colwise projections' outputs (this rank's features:
    plain tensors, or DTensors with use_local_output=False) as DTensors sharded over their last dim, gated_linear
    with down's weight shard (partial sums, its replicated bias added once), then down's own output hook, which
    lays the result out as RowwiseParallel was asked to (e.g. all-reduced and local)."""
    from torch.distributed.tensor import Shard

    from memkernels.distributed import contiguous_stride, dtensor_class, is_dtensor
    from memkernels.fusions.gated_mlp.op import gated_linear

    mesh, features = down.weight.device_mesh, down.weight.shape[1]

    def sharded(local):  # the global shape given: Shard splits an uneven I as torch.chunk does
        shape = (*local.shape[:-1], features)
        return dtensor_class().from_local(local, mesh, [Shard(local.dim() - 1)], shape=torch.Size(shape),
                                          stride=contiguous_stride(shape))

    operands = {key: value if is_dtensor(value) else sharded(value) for key, value in operands.items()}
    out = gated_linear(**operands, weight=down.weight, bias=down.bias, activation=activation)
    for hook in down._forward_hooks.values():
        out = hook(down, (), out)
    return out if down_multiplier == 1.0 else out * down_multiplier


class FusedGatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` (SwiGLU / GeGLU) that never stores the product.

    Saves gate and up (2*I elements per token; eager PyTorch keeps gate, act(gate), up and the
    product, 4*I). With ``recompute=True`` it saves only x, which the caller keeps anyway (the
    norm's output), and recomputes gate and up in backward: 0 new bytes, two more GEMMs; over
    more than 8,192 tokens it runs in token chunks, so backward holds one chunk's I-wide tensors
    (:func:`~memkernels.fusions.gated_mlp.op.gated_mlp_recompute`).

    Parameters are Hugging Face's: ``gate_proj``, ``up_proj``, ``down_proj`` nn.Linear modules
    (``packed=True``: one ``gate_up_proj`` [2*I, H] whose first half is gate, Phi-3's layout), so
    checkpoints load unchanged.

    Shapes: [..., hidden_size] -> [..., hidden_size]; float32, float16 or bfloat16.
    ``activation``: "silu", "gelu" or "gelu_tanh".
    ``gate_multiplier``, ``down_multiplier``: Falcon-H1's ``down(act(gate * gate_multiplier) * up) *
    down_multiplier``, each one elementwise pass as in eager (default 1.0: none). ``recompute=True``
    takes no gate multiplier (it forms gate inside gated_mlp_recompute).
    """

    def __init__(self, hidden_size, intermediate_size, *, activation="silu", bias=False, recompute=False,
                 packed=False, gate_multiplier=1.0, down_multiplier=1.0, device=None, dtype=None):
        super().__init__()
        from memkernels.fusions.gated_mlp.op import check_activation
        check_activation(activation, "FusedGatedMLP")
        if recompute and gate_multiplier != 1.0:
            raise ValueError(f"FusedGatedMLP: recompute=True forms gate inside gated_mlp_recompute, so it cannot scale "
                             f"it by gate_multiplier={gate_multiplier}; use recompute=False")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation, self.recompute = activation, bool(recompute)
        self.gate_multiplier, self.down_multiplier = float(gate_multiplier), float(down_multiplier)
        linear = dict(bias=bias, device=device, dtype=dtype)
        if packed:
            self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, **linear)
        else:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, **linear)
            self.up_proj = nn.Linear(hidden_size, intermediate_size, **linear)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **linear)

    @property
    def packed(self):
        return hasattr(self, "gate_up_proj")

    @classmethod
    def from_module(cls, mlp, *, recompute=False):
        """A FusedGatedMLP sharing the projections (the nn.Linear modules themselves) of a gated MLP.

        ``mlp``: a Hugging Face LlamaMLP / MistralMLP / Qwen2MLP / Qwen3MLP / GemmaMLP / Phi3MLP
        (packed ``gate_up_proj``) / FalconH1MLP (its ``gate_multiplier`` and ``down_multiplier`` are
        kept), memkernels.models.GatedMLP, or anything with those attributes whose projections are
        nn.Linear and whose activation is SiLU or a GELU. (``memkernels.apply`` also checks that the
        module's forward computes that formula; this constructor takes the attributes as given.)
        """
        gate, up, down, act = gated_mlp_parts(mlp)
        activation = gated_activation(act)
        if activation is None:
            raise TypeError(f"FusedGatedMLP.from_module: activation {type(act).__name__} is not SiLU or GELU")
        for name, module in (("gate projection", gate), ("up_proj", up), ("down_proj", down)):
            if module is not None and type(module) is not nn.Linear:
                raise TypeError(f"FusedGatedMLP.from_module: {name} must be an nn.Linear, got "
                                f"{type(module).__name__}")
        fused = cls(down.out_features, down.in_features, activation=activation, bias=down.bias is not None,
                    recompute=recompute, packed=up is None, gate_multiplier=getattr(mlp, "gate_multiplier", 1.0),
                    down_multiplier=getattr(mlp, "down_multiplier", 1.0), device="meta")
        if up is None:
            fused.gate_up_proj = gate
        else:
            fused.gate_proj, fused.up_proj = gate, up
        fused.down_proj = down
        return fused

    def forward(self, x):
        gate, up = (self.gate_up_proj, None) if self.packed else (self.gate_proj, self.up_proj)
        out = gated_mlp_forward(x, gate, up, self.down_proj, self.activation, recompute=self.recompute,
                                gate_multiplier=self.gate_multiplier, down_multiplier=self.down_multiplier)
        if out is None:
            raise TypeError(f"FusedGatedMLP: {lora_down(self.down_proj)}; its down_proj cannot be fused (use the "
                            "model's own MLP for it)")
        return out

    def extra_repr(self):
        text = f"activation={self.activation!r}, recompute={self.recompute}"
        if (self.gate_multiplier, self.down_multiplier) != (1.0, 1.0):
            text += f", gate_multiplier={self.gate_multiplier}, down_multiplier={self.down_multiplier}"
        return text
