"""apply()'s rules for gated MLPs (SwiGLU / GeGLU) and mixture-of-experts experts: the down projection through
``gated_linear`` (``grouped_gated_linear`` for stacked experts), so gate and up are saved and act(gate) * up never
is; ``mlp="recompute"`` saves only the MLP's input (experts: grouped_gated_mlp_recompute). LoRA adapters (peft) and
colwise/rowwise tensor parallelism are taken; anything else whose forward the fused path would go around is left
alone with the reason."""
import torch
from torch import nn

from memkernels.distributed import layout_hooks_only, sharded_along
from memkernels.fusions.common.autocast import compute_dtype
from memkernels.fusions.gated_mlp.module import gated_activation, gated_mlp_forward, gated_mlp_parts, lora_down
from memkernels.fusions.rule import Rule, dtensor_reason, plain_reason, probe_of, switch_class


def _tensor_parallel_mlp(gate, up, down):
    """Whether ``parallelize_module`` split the gated MLP colwise then rowwise, as the fused forward can run it:
    gate (and up) plain Linears with weights placed Shard(0), down a plain Linear with its weight placed Shard(1)
    on the same 1-D mesh (each rank: I/tp of the intermediate features), each with only the hooks that lay its
    input and output out. gated_linear then takes this rank's gate and up with down's weight shard and gives
    partial sums, which down's own output hook adds up (RowwiseParallel's layout)."""
    if up is None:  # a packed gate_up split colwise gives one rank gates and the other ups, not halves of each
        return False
    projections = [gate, up]
    return (all(type(p) is nn.Linear and layout_hooks_only(p) for p in (*projections, down))
            and sharded_along(down.weight, 1) and all(sharded_along(p.weight, 0) for p in projections)
            and all(p.weight.device_mesh == down.weight.device_mesh for p in projections))


# Attributes a gated MLP's forward may scale by, as down(act(gate * gate_multiplier) * up) * down_multiplier
# (Falcon-H1's mlp_multipliers); honoured when the probe finds its forward uses them that way.
GATED_MLP_MULTIPLIERS = ("gate_multiplier", "down_multiplier")

# gated MLP class -> why its forward is not the fused formula (None when it is), probed once per class
_PROBED_GATED_MLPS = {}


def _gated_mlp_formula_blocker(module):
    """Why ``module``'s forward is not down(act(gate [* gate_multiplier]) * up) [* down_multiplier] (None when it
    is). Fusing by attribute names alone would silently drop whatever else a forward does (Falcon-H1 scales
    gate and output); the class's own forward is run once, in float64, on small stand-in projections."""
    cls = type(module)
    if cls not in _PROBED_GATED_MLPS:
        _PROBED_GATED_MLPS[cls] = _probe_gated_mlp(module)
    return _PROBED_GATED_MLPS[cls]


def _probe_gated_mlp(module):
    from memkernels.fusions.common.act_linear_reference import activation

    gate, up, _, act = gated_mlp_parts(module)
    hidden, width = 5, 7
    generator = torch.Generator().manual_seed(0)

    def stand_in(features_in, features_out, like):
        linear = nn.Linear(features_in, features_out, bias=like.bias is not None, dtype=torch.float64)
        with torch.no_grad():
            for parameter in linear.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
        return linear.requires_grad_(False)

    probe = probe_of(module)
    projections = {"down_proj": stand_in(width, hidden, module.down_proj)}
    if up is None:
        projections["gate_up_proj"] = stand_in(hidden, 2 * width, gate)
    else:
        projections.update(gate_proj=stand_in(hidden, width, gate), up_proj=stand_in(hidden, width, up))
    probe._modules.update(projections)
    sizes = {"hidden_size": hidden, "intermediate_size": width}
    probe.__dict__.update({name: value for name, value in sizes.items() if name in module.__dict__})
    # Values no model uses, so a forward that ignores or misreads one shows.
    multipliers = {"gate_multiplier": 0.75, "down_multiplier": 1.5}
    multipliers = {name: multipliers[name] if hasattr(module, name) else 1.0 for name in GATED_MLP_MULTIPLIERS}
    probe.__dict__.update({name: value for name, value in multipliers.items() if hasattr(module, name)})
    x = torch.randn(2, 3, hidden, generator=generator, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = probe.forward(x)  # not __call__: no global module hooks fire
    except Exception as error:
        return f"{type(module).__name__}'s forward did not run on a lone input: {type(error).__name__}: {error}"
    with torch.no_grad():
        if up is None:
            gate_out, up_out = projections["gate_up_proj"](x).split(width, dim=-1)
        else:
            gate_out, up_out = projections["gate_proj"](x), projections["up_proj"](x)
        product = activation(gate_out * multipliers["gate_multiplier"], gated_activation(act)) * up_out
        expected = projections["down_proj"](product) * multipliers["down_multiplier"]
    if not (isinstance(got, torch.Tensor) and got.shape == expected.shape
            and torch.allclose(got, expected, rtol=1e-12, atol=1e-12)):
        return (f"{type(module).__name__}'s forward is not down_proj(act(gate) * up) (with its "
                f"{' and '.join(GATED_MLP_MULTIPLIERS)}, when it has them), checked in float64")
    return None


def gated_mlp_multipliers(mlp):
    """(gate_multiplier, down_multiplier) of a gated MLP, 1.0 where it has none."""
    return tuple(float(getattr(mlp, name, 1.0)) for name in GATED_MLP_MULTIPLIERS)


# ----------------------------------------------------------------------------- mixture-of-experts experts

def _experts_blocker(module):
    """Why a mixture-of-experts' experts module cannot take :func:`fused_experts_forward` (None when it can).

    Recognized by structure: Hugging Face's stacked layout (``gate_up_proj`` [E, 2*I, H] and ``down_proj``
    [E, H, I] Parameters, gate first, no bias, not transposed: Qwen2/3-MoE, Mixtral, DeepSeek-V2/V3, OLMoE
    and the others built on transformers' ``use_experts_implementation``), the default gating
    act(gate) * up with a SiLU or GELU activation."""
    layout = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
              "has_post_expert_norm": False, "_is_expert_parallel": False}
    odd = [f"{key}={getattr(module, key)}" for key, expected in layout.items()
           if getattr(module, key, expected) != expected]
    if odd:
        return f"mixture-of-experts experts with {', '.join(odd)}: only gate-first, bias-free stacked experts are fused"
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == down.dim() == 3
            and gate_up.shape[2] == 2 * down.shape[1] and gate_up.shape[1] == down.shape[2]):
        # told by the shapes: Llama-4's experts carry no is_transposed attribute to read
        return ("mixture-of-experts experts in the transposed layout (gate_up_proj [E, H, 2*I], down_proj [E, I, H]: "
                "Llama-4's, whose forward runs every expert on every token, scaled by its router score, with no top-k "
                "indices); only [E, 2*I, H] / [E, H, I] experts called with top-k indices and weights are fused")
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[0] == down.shape[0]):
        return ("mixture-of-experts experts not in the stacked layout (gate_up_proj [E, 2*I, H] and down_proj "
                "[E, H, I] parameters)")
    gating = getattr(type(module), "_apply_gate", None)
    if gating is not None and gating.__name__ != "_default_apply_gate":
        return (f"mixture-of-experts experts with their own gating ({type(module).__name__}._apply_gate, e.g. "
                "GPT-OSS's clamped SwiGLU), not act(gate) * up")
    activation = gated_activation(getattr(module, "act_fn", None))
    if activation is None:
        return f"mixture-of-experts activation {type(getattr(module, 'act_fn', None)).__name__} is not SiLU or GELU"
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if implementation not in (None, "eager", "grouped_mm"):
        return f"experts_implementation={implementation!r} (only 'eager' and 'grouped_mm' compute what is fused)"
    return None


class _FusedExperts:
    """A mixture-of-experts' experts whose down projection is grouped_gated_linear (see fused_experts_forward)."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return fused_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def fused_experts_forward(experts, hidden_states, top_k_index, top_k_weights):
    """What transformers' experts forward computes (the routed tokens' gated MLPs, weighted and summed per
    token) with the gate_up projection through grouped_gather_mm (the rows gathered inside the op, so the
    gathered hidden states, H per routed token, are not saved: eager saves them) and the down projection through
    grouped_gated_linear: per routed token only the [2*I] gate_up and the row's token index are saved for
    backward, act(gate) and act(gate) * up never are (eager keeps both: 4*I). Recomputing (``mlp="recompute"``),
    grouped_gated_mlp_recompute saves no gate_up either.

    hidden_states [T, H]; top_k_index [T, k] (int); top_k_weights [T, k]. Routed tokens are sorted by
    expert (stable), gathered and projected by one grouped GEMM, down-projected by another and weighted (inside
    that op where the weights come in its compute dtype, so the unweighted rows, H per routed token, are not saved
    for the weights' gradient as ``routed * weights`` saves them), put back in token order and summed over the k
    choices (in the weights' dtype, then the input's, as transformers' grouped_mm path does)."""
    from memkernels.fusions.gated_mlp.grouped import (grouped_gated_linear, grouped_gated_mlp_recompute,
                                                      grouped_gather_mm)

    tokens, top_k = top_k_index.shape
    count = experts.gate_up_proj.shape[0]
    expert_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
    # histc, not bincount: a fixed number of bins (meta tensors and CUDA graphs need the shape); float ids on the
    # CPU (exact below 2**24), integers on CUDA, as transformers' grouped_mm path counts them
    ids = expert_ids.int() if expert_ids.is_cuda else expert_ids.float()
    offsets = torch.histc(ids, bins=count, min=0, max=count - 1).cumsum(0, dtype=torch.int32)
    rows = order // top_k
    activation = experts._memkernels_gated_activation
    row_weights = top_k_weights.reshape(-1)[order]
    # The weighting inside the op (nothing H-wide saved for the weights' gradient) where the weights come in the
    # dtype the experts compute in or in float32 (the op promotes as routed * weights does); else after it.
    inside = row_weights if row_weights.dtype in (compute_dtype(hidden_states), torch.float32) else None
    if experts._memkernels_recompute:
        routed = grouped_gated_mlp_recompute(hidden_states, rows, experts.gate_up_proj, experts.down_proj, offsets,
                                             row_weights=inside, activation=activation)
    else:
        gate_up = grouped_gather_mm(hidden_states, rows, experts.gate_up_proj, offsets)
        routed = grouped_gated_linear(gate_up, experts.down_proj, offsets, row_weights=inside, activation=activation)
    if inside is None:
        routed = routed * row_weights.unsqueeze(-1)
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel(), device=order.device)
    return routed[restore].view(tokens, top_k, -1).sum(1).to(hidden_states.dtype)


def _patch_experts(module, recompute):
    """Switch ``module`` to its fused subclass; returns the mode shown in the report."""
    switch_class(module, _FusedExperts)
    module._memkernels_gated_activation = gated_activation(module.act_fn)
    module._memkernels_recompute = recompute
    return "recompute" if recompute else "saves gate_up"


class _FusedGatedMLPForward:
    """A gated MLP whose down projection is gated_linear (its forward; see patched_gated_mlp_forward)."""

    def forward(self, x):
        return patched_gated_mlp_forward(self, x)


def can_recompute_gated_mlp(module):
    """Whether ``module`` is a gated MLP apply() fused whose projections gated_mlp_recompute can read itself
    (plain, hook-free nn.Linear: LoRA or hooked ones keep the saving variant, which calls them as modules)."""
    return isinstance(module, _FusedGatedMLPForward) and gated_mlp_multipliers(module)[0] == 1.0 and all(
        p is None or plain_reason(p, (nn.Linear,), "projection") is None for p in gated_mlp_parts(module)[:3])


def patched_gated_mlp_forward(mlp, x, recompute=None):
    """The forward of a gated MLP apply() fused: :func:`memkernels.fusions.gated_mlp.module.gated_mlp_forward` on
    its projections, recomputing in backward when ``recompute`` (default: as apply() set it) and the projections
    allow it; its own forward where a LoRA state changed after apply() makes down_proj unfusable."""
    gate_proj, up_proj, down_proj, _ = gated_mlp_parts(mlp)
    gate_multiplier, down_multiplier = gated_mlp_multipliers(mlp)
    out = gated_mlp_forward(x, gate_proj, up_proj, down_proj, mlp._memkernels_gated_activation,
                            recompute=mlp._memkernels_recompute if recompute is None else recompute,
                            gate_multiplier=gate_multiplier, down_multiplier=down_multiplier)
    return super(_FusedGatedMLPForward, mlp).forward(x) if out is None else out


def _patch_gated_mlp(module, recompute):
    """Switch ``module`` to its fused subclass; returns the mode shown in the report."""
    switch_class(module, _FusedGatedMLPForward)
    module._memkernels_gated_activation = gated_activation(gated_mlp_parts(module)[3])
    module._memkernels_recompute = recompute and can_recompute_gated_mlp(module)
    return "recompute" if module._memkernels_recompute else "saves gate, up"


# ----------------------------------------------------------------------------- RoPE in attention


class ExpertsRule(Rule):
    """A mixture-of-experts' experts in transformers' stacked layout (see :func:`_experts_blocker`)."""

    kind, option = "experts", "mlp"
    reported_when_off = True  # the report lists every mixture-of-experts layer, fused or not

    def matches(self, module):
        return type(module).__name__.endswith("Experts") and not isinstance(module, _FusedExperts)

    def blocker(self, module):
        return _experts_blocker(module)

    def swap(self, model, name, module, settings):
        mode = _patch_experts(module, settings["mlp"] == "recompute")
        return f"{type(module).__name__} ({mode})"


class GatedMLPRule(Rule):
    """A gated MLP: gate_proj + up_proj (or a packed gate_up_proj), down_proj and an activation, whose forward is
    down(act(gate) * up) (probed once per class in float64)."""

    kind, option = "gated_mlp", "mlp"

    def matches(self, module):
        name = type(module).__name__
        return (name.endswith("MLP") and hasattr(module, "down_proj")
                and (hasattr(module, "gate_proj") or hasattr(module, "gate_up_proj"))
                and not isinstance(module, _FusedGatedMLPForward))  # patched by an earlier apply()

    def blocker(self, module):
        gate, up, down, act = gated_mlp_parts(module)
        down_parts = lora_down(down)
        tensor_parallel = _tensor_parallel_mlp(gate, up, down)
        # Checked here, not per call: a measuring tool's own hooks (activation_ledger) must not
        # switch the fused path off.
        hooked = not tensor_parallel and any(m._forward_hooks or m._forward_pre_hooks
                                             for m in (down, getattr(down, "base_layer", down)))
        return (f"gated MLP activation {type(act).__name__} is not SiLU or GELU" if gated_activation(act) is None
                else down_parts if isinstance(down_parts, str)
                else (None if tensor_parallel else dtensor_reason(getattr(down, "base_layer", down), "down_proj"))
                or ("down_proj has forward hooks, which fusing would skip" if hooked
                    else _gated_mlp_formula_blocker(module)))

    def swap(self, model, name, module, settings):
        mode = _patch_gated_mlp(module, settings["mlp"] == "recompute")
        return f"{type(module).__name__} ({mode})"
