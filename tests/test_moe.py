"""Mixture-of-experts MLPs through memkernels.apply() (issue 37 point 1): routed experts' gate_up projection as
grouped_gather_mm (the rows gathered inside the op, not saved) and gated down projection as grouped_gated_linear
(gate_up saved per routed token, act(gate) * up never; with mlp="recompute" the whole experts' MLP as
grouped_gated_mlp_recompute, saving no gate_up either), on tiny Qwen3-MoE, Mixtral and DeepSeek-V3 models built from
their transformers configs (random weights, fp32 on the CPU), and Llama-4's shared expert.

Parity is test_patch.py's rule: against the unpatched model in float64, the patched model's loss, router logits
and every gradient err at most 2x what the unpatched model errs in fp32, plus a floor of a few fp32 roundings; in
bf16 the same with the routing pinned (test_bf16_loss_and_every_gradient_match_with_the_routing_pinned says why).
The op itself is checked against float64 in fp32, fp16 and bf16 through both backends.
"""
import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from memkernels.fusions.gated_mlp import op as gated_mlp_op
from memkernels.fusions.gated_mlp.grouped import (expert_chunks, grouped_gated_linear, grouped_gated_mlp_recompute,
                                                  grouped_gather_mm, grouped_mm)
from memkernels.meters import PeakBytesMeter, SavedBytesMeter
from memkernels.testing import check_against_reference

transformers = pytest.importorskip("transformers")

from memkernels.fusions.apply import apply  # noqa: E402
from test_patch import _assert_parity, _loss_and_grads  # noqa: E402

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, attn_implementation="sdpa")


def _qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, norm_topk_prob=True))


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2))


def _deepseek_v3():
    """Multi-head latent attention, one dense first layer, then routed experts beside a shared expert."""
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **COMMON, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16))


def _qwen2_moe():
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **COMMON, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1))


def _olmoe():
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **COMMON, intermediate_size=48, num_experts=4, num_experts_per_tok=2))


# The causal LMs whose loss memkernels fuses with the router's load-balancing term (CAUSAL_LM_HEADS' router_aux).
LOAD_BALANCED_HEADS = {"Qwen3MoeForCausalLM": _qwen3_moe, "Qwen2MoeForCausalLM": _qwen2_moe,
                       "MixtralForCausalLM": _mixtral, "OlmoeForCausalLM": _olmoe}

MODELS = {"qwen3_moe": (_qwen3_moe, "Qwen3MoeExperts", 2), "mixtral": (_mixtral, "MixtralExperts", 2),
          "deepseek_v3": (_deepseek_v3, "DeepseekV3Experts", 1)}


def _build(name):
    torch.manual_seed(0)
    return MODELS[name][0]().train()


def _ids():
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("mlp, mode", [(True, "saves gate_up"), ("recompute", "recompute")], ids=["saves", "recompute"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_apply_fuses_the_routed_experts_and_says_so(name, mlp, mode):
    model = _build(name)
    report = apply(model, mlp=mlp, measure=False)
    _, experts, layers = MODELS[name]
    fused = [row for row in report.replaced if row["before"] == experts]
    assert len(fused) == layers and all(row["after"] == f"Memkernels{experts} ({mode})" for row in fused)
    assert not any("expert" in row["reason"] for row in report.skipped), report.skipped


@pytest.mark.parametrize("name", sorted(MODELS))
def test_mlp_false_leaves_the_experts_alone_and_says_so(name):
    report = apply(_build(name), mlp=False, measure=False)
    _, experts, layers = MODELS[name]
    assert not any(experts in row["before"] for row in report.replaced)
    assert [row["reason"] for row in report.skipped if row["type"] == experts] == ["mlp=False"] * layers


class _PinnedTopK(TorchFunctionMode):
    """``torch.topk`` as recorded: without ``indices`` every call runs and its indices are kept in order
    (``self.indices``); given them, each call returns the next, with its values gathered from its own input (the
    routing weights stay the model's own router scores, differentiable as topk's values are)."""

    def __init__(self, indices=None):
        super().__init__()
        self.replaying = indices is not None
        self.indices = list(indices or ())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (torch.topk, torch.Tensor.topk):
            return func(*args, **kwargs)
        if not self.replaying:
            result = func(*args, **kwargs)
            self.indices.append(result.indices)
            return result
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
        indices = self.indices.pop(0)
        return torch.return_types.topk((args[0].gather(dim, indices), indices))


def _largest_token_loss_error(reference, model, ids, indices):
    """The largest error of ``model``'s per-token next-token losses against ``reference``'s (from their logits,
    [2, 23] tokens, in float64), each run routed by ``indices`` (:class:`_PinnedTopK`)."""
    losses = []
    for run in (reference, model):
        with _PinnedTopK(indices), torch.no_grad():
            logits = run(input_ids=ids, use_cache=False).logits.double()
        losses.append(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none"))
    return (losses[1] - losses[0]).abs().max().item()


def _assert_loss_and_gradients_match(model, patched, ids, pin_routing=False):
    """test_patch.py's rule for the loss and every gradient of ``patched`` against ``model`` in float64, with
    ``model`` (same dtype as ``patched``: fp32 or bf16) as the error to stay within 2x of; returns the float64
    reference. ``pin_routing``: both route each token to the experts the reference picks (:class:`_PinnedTopK`)."""
    reference = copy.deepcopy(model).double()
    reference.set_experts_implementation("eager")  # torch._grouped_mm takes no float64
    record = _PinnedTopK()
    with record if pin_routing else contextlib.nullcontext():
        loss64, grads64 = _loss_and_grads(reference, ids, ids)
    results = []
    for run in (model, patched):
        replay = _PinnedTopK(record.indices)
        with replay if pin_routing else contextlib.nullcontext():
            results.append(_loss_and_grads(run, ids, ids))
        assert not replay.indices, "a model made fewer top-k choices than the reference"
    (loss_e, grads_e), (loss_p, grads_p) = results
    if pin_routing:  # the mean loss within 2x the unpatched model's largest per-token loss error (the bf16 test)
        token_error = _largest_token_loss_error(reference, model, ids, record.indices)
        floor = 4 * torch.finfo(torch.float32).eps * loss64.abs().item()
        assert (loss_p.double() - loss64).abs().item() <= 2 * token_error + floor, (loss_p, loss64, token_error)
    else:
        _assert_parity(loss64.reshape(1), loss_e.reshape(1), loss_p.reshape(1), "loss")
    assert set(grads_p) == set(grads_e) and any("experts" in n for n in grads_p)
    global_scale = max(g.abs().max().item() for g in grads64.values())
    for key, g64 in grads64.items():
        _assert_parity(g64, grads_e[key], grads_p[key], key, scale=max(g64.abs().max().item(), global_scale * 1e-3))
    return reference


@pytest.mark.parametrize("mlp", [True, "recompute"], ids=["saves", "recompute"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_loss_router_logits_and_every_gradient_match(name, mlp):
    model = _build(name)
    patched = copy.deepcopy(model)
    apply(patched, mlp=mlp, measure=False)
    ids = _ids()
    reference = _assert_loss_and_gradients_match(model, patched, ids)
    with torch.no_grad():
        logits = [m(input_ids=ids, output_router_logits=True).router_logits for m in (reference, model, patched)]
    for index, (r64, r32, rp) in enumerate(zip(*logits)):
        _assert_parity(r64, r32, rp, f"router logits {index}")


# Other families whose experts are in the stacked layout at the installed transformers: (model, experts class).
OTHER_FAMILIES = {
    "deepseek_v2": (lambda: transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
        **COMMON, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16)), "DeepseekV2Experts"),
    "qwen3_5_moe": (lambda: transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(
        **COMMON, head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2)), "Qwen3_5MoeExperts"),
    "glm4_moe": (lambda: transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
        **COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, first_k_dense_replace=1)), "Glm4MoeExperts"),
}


@pytest.mark.parametrize("family", sorted(OTHER_FAMILIES))
def test_other_families_experts_are_fused_and_match(family):
    """DeepSeek-V2, Qwen3.5-MoE (beside its linear attention) and GLM-4-MoE: every MoE layer's experts fused, loss
    and every gradient matching the unpatched model (the families README names)."""
    build, experts = OTHER_FAMILIES[family]
    torch.manual_seed(0)
    model = build().train()
    patched = copy.deepcopy(model)
    report = apply(patched, measure=False)
    fused = [row["after"] for row in report.replaced if row["before"] == experts]
    layers = sum(type(module).__name__ == experts for module in model.modules())
    assert layers and fused == [f"Memkernels{experts} (saves gate_up)"] * layers, report.replaced
    _assert_loss_and_gradients_match(model, patched, _ids())


def test_llama4_trains_with_the_shared_expert_fused_and_the_experts_left_alone_with_the_reason():
    """Llama-4 (text): each MoE layer's shared expert, a gated MLP, is fused, and the block adds the routed experts'
    output into its output in place, which training must take; the experts, in the transposed layout, are left
    alone and the report says so. Loss and every gradient match the unpatched model."""
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        **COMMON, head_dim=16, intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=1)).train()
    patched = copy.deepcopy(model)
    report = apply(patched, measure=False)
    shared = [row["name"] for row in report.replaced if row["before"] == "Llama4TextMLP"]
    assert shared == [f"model.layers.{layer}.feed_forward.shared_expert" for layer in range(2)], report.replaced
    reasons = [row["reason"] for row in report.skipped if row["type"] == "Llama4TextExperts"]
    assert len(reasons) == 2 and all("transposed layout" in reason for reason in reasons), reasons
    _assert_loss_and_gradients_match(model, patched, _ids())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_loss_and_every_gradient_match_with_the_routing_pinned(name):
    """bf16, the routing pinned: the float64 reference picks each token's experts (every torch.topk call of the
    routers, recorded in order) and the unpatched and patched bf16 models pick the same ones, each weighting them by
    its own router scores. Unpinned, a token whose top-k scores nearly tie may pick another expert in one bf16 model
    than in the other (one rounding of a fused norm does it: a token of Qwen3-MoE's second layer here), and that
    expert's weight gradients then differ by the token's whole contribution (53% of gate_up_proj's largest), which
    no rounding tolerance should cover; everything else a flip changes comes with it. Pinned, the rule is the fp32
    tests' for every gradient: within 2x the unpatched bf16 model's error against float64 (the same bf16 weights in
    float64), plus a floor of 4 fp32 roundings. The mean loss is held to 2x the unpatched model's largest per-token
    loss error instead of its mean's: the mean's error is a sum of signed roundings that cancel by chance (DeepSeek-V3
    here: unpatched 1.7e-5, patched 4.0e-5, where other batches give 1e-4 to 3e-4 to both), while no mean errs by more
    than its largest part."""
    model = _build(name).to(torch.bfloat16)
    patched = copy.deepcopy(model)
    apply(patched, measure=False)
    _assert_loss_and_gradients_match(model, patched, _ids(), pin_routing=True)


def test_the_loss_head_is_fused_where_the_forward_is_known_and_left_alone_with_the_reason_elsewhere():
    for name, fused in (("qwen3_moe", True), ("mixtral", True), ("deepseek_v3", False)):
        report = apply(_build(name), measure=False)
        family = type(_build(name)).__name__
        replaced = [row for row in report.replaced if row["before"] == family]
        skipped = [row["reason"] for row in report.skipped if row["type"] == family]
        assert (len(replaced), len(skipped)) == ((1, 0) if fused else (0, 1)), (name, replaced, skipped)
        if not fused:
            assert skipped[0].startswith(f"{family}'s head is not one memkernels knows"), skipped


@pytest.mark.parametrize("how", ["argument", "config"])
@pytest.mark.parametrize("family", sorted(LOAD_BALANCED_HEADS))
def test_the_fused_loss_adds_the_router_load_balancing_term_as_the_model_does(family, how):
    """output_router_logits (the call's argument, or the config's): the loss includes router_aux_loss_coef x the
    load-balancing loss, returned as aux_loss; loss, aux_loss and every gradient match."""
    torch.manual_seed(0)
    model = LOAD_BALANCED_HEADS[family]().train()
    assert type(model).__name__ == family
    model.router_aux_loss_coef = 0.5  # a term large enough to show in the loss
    model.config.output_router_logits = how == "config"
    kwargs = {"output_router_logits": True} if how == "argument" else {}
    patched = copy.deepcopy(model)
    report = apply(patched, measure=False)
    assert ("", family, f"Memkernels{family}") in {(r["name"], r["before"], r["after"]) for r in report.replaced}
    ids = _ids()
    reference = copy.deepcopy(model).double()
    reference.set_experts_implementation("eager")
    outputs = []
    for m in (reference, model, patched):
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids, labels=ids, use_cache=False, **kwargs)
        out.loss.backward()
        outputs.append((out.loss.detach(), out.aux_loss.detach(),
                        {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (loss64, aux64, grads64), (loss32, aux32, grads32), (loss_p, aux_p, grads_p) = outputs
    assert aux64 > 0
    _assert_parity(loss64.reshape(1), loss32.reshape(1), loss_p.reshape(1), "loss")
    _assert_parity(aux64.reshape(1), aux32.reshape(1), aux_p.reshape(1), "aux_loss")
    global_scale = max(g.abs().max().item() for g in grads64.values())
    for key, g64 in grads64.items():
        _assert_parity(g64, grads32[key], grads_p[key], key, scale=max(g64.abs().max().item(), global_scale * 1e-3))
    without = copy.deepcopy(patched)
    without.config.output_router_logits = False
    plain = without(input_ids=ids, labels=ids, use_cache=False, output_router_logits=False)
    assert plain.aux_loss is None and not torch.allclose(plain.loss, loss_p)  # the term was really added


def _experts_call(name, dtype):
    """(the first routed experts module, its inputs: hidden states [T, H], top-k indices and weights) of ``name``."""
    model = _build(name).to(dtype)
    experts = next(m for m in model.modules() if type(m).__name__ == MODELS[name][1])
    generator = torch.Generator().manual_seed(2)
    tokens, top_k, count = 96, 2, experts.gate_up_proj.shape[0]
    hidden = torch.randn(tokens, experts.gate_up_proj.shape[2], generator=generator).to(dtype)
    scores = torch.randn(tokens, count, generator=generator).softmax(-1)
    weights, index = scores.topk(top_k, dim=-1)
    return experts, hidden, index, weights.to(dtype)


@pytest.mark.parametrize("dtype, router", [(torch.float32, "frozen"), (torch.float32, "trained"),
                                           (torch.bfloat16, "frozen"), (torch.bfloat16, "trained"),
                                           (torch.bfloat16, "trained-fp32")],
                         ids=["fp32-frozen", "fp32-trained", "bf16-frozen", "bf16-trained", "bf16-trained-fp32"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_experts_save_at_most_half_of_eager(name, dtype, router):
    """New bytes the experts save for backward (saved_tensors_hooks): eager keeps the gathered hidden states (H),
    gate_up, act(gate) and the product per routed token (H + 4*I); fused only gate_up (2*I), grouped_gather_mm
    gathering the rows inside the op (it saves the caller's hidden states, not new, and each row's token index,
    which eager's index saves too): exactly H + 2*I per routed token fewer. With the routing weights' gradient
    (a trained router), eager's ``routed * weights`` also saves each routed row's output (H); the fused op weights
    its rows inside and saves nothing H-wide for that gradient: 2*H + 2*I fewer. So the fused experts keep 35.0-39.6%
    of eager's new bytes with a frozen router (Qwen3-MoE and DeepSeek-V3, H 64, I 32: 276 / 788 B a routed token
    in fp32, 146 / 402 in bf16; Mixtral, I 48: 404 / 1044 and 210 / 530) and 27.0-32.9% with a trained one (its
    weights float32 beside bf16 experts, as Mixtral's and DeepSeek-V3's routers give them, included), where
    weighting outside the op kept 51.1-52.4% (and saving the gathered rows too, 63-68% frozen)."""
    experts, hidden, index, weights = _experts_call(name, dtype)
    width, features = experts.down_proj.shape[2], experts.down_proj.shape[1]
    hidden.requires_grad_()
    if router == "trained-fp32":
        weights = weights.float()
    weights.requires_grad_(router != "frozen")
    with SavedBytesMeter() as eager:
        experts(hidden, index, weights)
    apply(experts, measure=False)
    assert type(experts).__name__.startswith("Memkernels")
    with SavedBytesMeter() as fused:
        experts(hidden, index, weights)
    routed = index.numel()
    element = hidden.element_size()
    output = 0 if router == "frozen" else features
    assert eager.new_bytes - fused.new_bytes == (2 * width + features + output) * element * routed
    assert fused.new_bytes <= 0.5 * eager.new_bytes


@pytest.mark.parametrize("router", ["frozen", "trained"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_recomputed_experts_save_neither_gate_up_nor_the_gathered_rows(name, dtype, router):
    """mlp="recompute" saves per routed token exactly gate_up (2*I) fewer bytes than the default fused experts
    (saved_tensors_hooks; neither saves the gathered hidden states, both gather in grouped_gather_mm): what is
    left is the routing (each row's token and expert order, the offsets) and the weighting, 18-28 bytes a routed
    token here: 1.9-4.5% of eager's new bytes with a frozen router (Mixtral fp32 1.9%, Qwen3-MoE and DeepSeek-V3
    bf16 4.5%), 2.1-4.9% with a trained one (21.7-28.6% where the rows were weighted outside the op, which saved
    their H-wide output), against the default's 27-40%."""
    experts, hidden, index, weights = _experts_call(name, dtype)
    hidden.requires_grad_()
    weights.requires_grad_(router == "trained")
    saved = {}
    for mlp in (None, True, "recompute"):
        module = copy.deepcopy(experts)
        if mlp is not None:
            apply(module, mlp=mlp, measure=False)
        with SavedBytesMeter() as meter:
            module(hidden, index, weights)
        saved[mlp] = meter.new_bytes
    routed, element = index.numel(), hidden.element_size()
    width = experts.down_proj.shape[2]
    assert saved[True] - saved["recompute"] == 2 * width * element * routed
    assert saved["recompute"] <= 0.05 * saved[None]


@pytest.mark.parametrize("mlp", [True, "recompute"], ids=["saves", "recompute"])
def test_float64_experts_train_through_the_loop_over_experts(mlp):
    """float64 (which torch._grouped_mm does not take, as CUDA's takes no float32): the loop over experts, with
    autograd through the gate_up projection, gives the unpatched model's loss and gradients to 1e-10."""
    model = _build("qwen3_moe").double()
    model.set_experts_implementation("eager")
    patched = copy.deepcopy(model)
    apply(patched, norms=False, loss=False, rope=False, mlp=mlp, measure=False)  # the fused norms take no float64
    ids = _ids()
    loss, grads = _loss_and_grads(model, ids, ids)
    loss_p, grads_p = _loss_and_grads(patched, ids, ids)
    torch.testing.assert_close(loss_p, loss, rtol=1e-10, atol=0)
    assert set(grads_p) == set(grads)
    for key, grad in grads.items():
        torch.testing.assert_close(grads_p[key], grad, rtol=1e-10, atol=1e-12, msg=key)


def _eager_experts(hidden, rows, gate_up_proj, down_proj, ends, activation):
    """The routed experts' MLP in eager PyTorch: each row's token gathered, one GEMM an expert each way."""
    starts = [0] + ends[:-1]
    gathered = hidden[rows]
    gate_up = torch.cat([gathered[start:end] @ gate_up_proj[expert].t()
                         for expert, (start, end) in enumerate(zip(starts, ends))])
    return _eager_grouped(gate_up, down_proj, ends, activation)


def _eager_grouped(gate_up, weight, ends, activation):
    gate, up = gate_up.chunk(2, -1)
    product = (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up
    starts = [0] + ends[:-1]
    return torch.cat([product[start:end] @ weight[expert].t() for expert, (start, end) in enumerate(zip(starts, ends))])


@pytest.mark.parametrize("ends", [[3, 3, 9, 13], [0, 13, 13, 13]], ids=["an-empty-expert", "one-expert"])
@pytest.mark.parametrize("dtype, activation", [(torch.float32, "silu"), (torch.float16, "gelu_tanh"),
                                               (torch.bfloat16, "silu")], ids=str)
def test_grouped_gated_linear_matches_float64(backend, dtype, activation, ends):
    """Output, d_gate_up and every expert's dW against float64; an expert without tokens gets a zero dW."""
    generator = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(13, 32, generator=generator) * 2).to(dtype).requires_grad_()
    weight = (torch.randn(4, 8, 16, generator=generator) * 0.25).to(dtype).requires_grad_()
    offsets = torch.tensor(ends, dtype=torch.int32)
    check_against_reference(lambda g, w: grouped_gated_linear(g, w, offsets, activation=activation),
                            lambda g, w: _eager_grouped(g, w, ends, activation), [gate_up, weight],
                            name=f"grouped_gated_linear {ends}")
    out = grouped_gated_linear(gate_up, weight, offsets, activation=activation)
    out.backward(torch.ones_like(out))
    starts = [0] + ends[:-1]
    for expert, (start, end) in enumerate(zip(starts, ends)):
        if start == end:
            assert not weight.grad[expert].any(), expert


@pytest.mark.parametrize("ends", [[3, 3, 9, 13], [0, 13, 13, 13]], ids=["an-empty-expert", "one-expert"])
@pytest.mark.parametrize("dtype, activation", [(torch.float32, "silu"), (torch.float16, "gelu_tanh"),
                                               (torch.bfloat16, "silu")], ids=str)
@pytest.mark.parametrize("mlp", ["saves", "recompute"])
def test_grouped_gated_mlp_recompute_matches_float64(backend, dtype, activation, ends, mlp):
    """Output and the gradients of the hidden states (summed over a token's rows), gate_up_proj and down_proj
    against float64 autograd through the gather, the gate_up projection and the down projection: the default
    experts path (grouped_gather_mm then grouped_gated_linear) and the recomputing one."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 16, generator=generator).to(dtype).requires_grad_()
    rows = torch.randint(0, 7, (13,), generator=generator)
    gate_up_proj = (torch.randn(4, 32, 16, generator=generator) * 0.5).to(dtype).requires_grad_()
    down_proj = (torch.randn(4, 16, 16, generator=generator) * 0.25).to(dtype).requires_grad_()
    offsets = torch.tensor(ends, dtype=torch.int32)

    def eager(h, w1, w2):
        return _eager_experts(h, rows, w1, w2, ends, activation)

    def fused(h, w1, w2):
        if mlp == "recompute":
            return grouped_gated_mlp_recompute(h, rows, w1, w2, offsets, activation=activation)
        return grouped_gated_linear(grouped_gather_mm(h, rows, w1, offsets), w2, offsets, activation=activation)

    check_against_reference(fused, eager, [hidden, gate_up_proj, down_proj], name=f"experts' MLP ({mlp}) {ends}")


@pytest.mark.parametrize("op", ["grouped_gated_linear", "grouped_gather_mm", "grouped_gated_mlp_recompute"])
def test_torch_compile_fullgraph_keeps_the_custom_ops(op):
    """Under torch.compile (aot_eager, fullgraph) the forward and backward are the custom ops (the default experts
    path's two: grouped_gather_mm then grouped_gated_linear; the recomputed MLP's two), with the eager twin's
    gradients, the routing weights' included."""
    generator = torch.Generator().manual_seed(0)
    offsets = torch.tensor([3, 3, 9, 13], dtype=torch.int32)
    rows = torch.randint(0, 5, (13,), generator=generator)

    def function(*tensors):
        *tensors, row_weights = tensors
        if op == "grouped_gated_linear":
            return grouped_gated_linear(*tensors, offsets, row_weights=row_weights)
        hidden, gate_up_proj, down_proj = tensors
        if op == "grouped_gather_mm":
            return grouped_gated_linear(grouped_gather_mm(hidden, rows, gate_up_proj, offsets), down_proj, offsets,
                                        row_weights=row_weights)
        return grouped_gated_mlp_recompute(hidden, rows, gate_up_proj, down_proj, offsets, row_weights=row_weights)

    shapes = [(13, 32), (4, 8, 16)] if op == "grouped_gated_linear" else [(5, 8), (4, 32, 8), (4, 8, 16)]
    shapes.append((13,))  # the routing weights, multiplied in by the down projection
    inputs = [torch.randn(shape, generator=generator).requires_grad_() for shape in shapes]
    grad = torch.randn(13, 8, generator=generator)
    eager = torch.autograd.grad(function(*inputs), inputs, grad)
    seen = []

    def backend(graph, example_inputs):
        seen.extend(str(node.target) for node in graph.graph.nodes)
        return graph.forward

    compiled_grads = torch.autograd.grad(torch.compile(function, backend="aot_eager", fullgraph=True)(*inputs), inputs,
                                         grad)
    for expected, got in zip(eager, compiled_grads):
        torch.testing.assert_close(got, expected)
    torch._dynamo.reset()
    torch.compile(function, backend=backend, fullgraph=True)(*inputs)
    custom_ops = {"grouped_gated_linear": ["grouped_gated_linear"],
                  "grouped_gather_mm": ["grouped_gather_mm", "grouped_gated_linear"],
                  "grouped_gated_mlp_recompute": ["grouped_gather_mm", "grouped_gated_linear_recomputing"]}[op]
    assert all(f"memkernels.{name}.default" in seen for name in custom_ops), seen


# Over many routed rows the experts' steps run a run of whole experts at a time (expert_chunks): 96 rows in runs of
# at most 16 here, with an expert of 20 rows (a run alone), an empty one and one of 1.
LONG_ENDS = [10, 30, 30, 31, 45, 60, 75, 96]


def test_expert_chunks_are_runs_of_whole_experts():
    offsets = torch.tensor(LONG_ENDS, dtype=torch.int32)
    runs = expert_chunks(offsets, 96, 8, 4)  # 96 rows fit one run (CHUNK_TOKENS 8192): offsets themselves
    assert len(runs) == 1 and runs[0][2] is offsets
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gated_mlp_op, "CHUNK_TOKENS", 16)
        runs = expert_chunks(offsets, 96, 8, 4)
        assert [(e.start, e.stop, r.start, r.stop) for e, r, _ in runs] == [
            (0, 1, 0, 10), (1, 2, 10, 30), (2, 5, 30, 45), (5, 6, 45, 60), (6, 7, 60, 75), (7, 8, 75, 96)]
        for experts, rows, run_offsets in runs:
            assert run_offsets.tolist() == [end - rows.start for end in LONG_ENDS[experts]]
        # a step whose weight gradient outweighs its transients keeps one run; on meta the rows are spread evenly
        assert len(expert_chunks(offsets, 96, 8, 4, grad_weight_bytes=96 * 8 * 4)) == 1
        assert len(expert_chunks(offsets, 96, 8, 4, grad_weight_bytes=96 * 8 * 4 - 1)) == 6
        meta = expert_chunks(offsets.to("meta"), 96, 8, 4)
        assert [(e.start, e.stop, r.start, r.stop) for e, r, _ in meta] == [
            (0, 1, 0, 12), (1, 2, 12, 24), (2, 3, 24, 36), (3, 4, 36, 48), (4, 5, 48, 60), (5, 6, 60, 72),
            (6, 7, 72, 84), (7, 8, 84, 96)]


def _long_experts(dtype, generator):
    """96 routed rows of 40 tokens (H 8), 8 experts of I 4 (N 8): every step's transients outweigh its weights."""
    hidden = torch.randn(40, 8, generator=generator).to(dtype).requires_grad_()
    rows = torch.randint(0, 40, (96,), generator=generator)
    gate_up_proj = (torch.randn(8, 8, 8, generator=generator) * 0.5).to(dtype).requires_grad_()
    down_proj = (torch.randn(8, 8, 4, generator=generator) * 0.5).to(dtype).requires_grad_()
    return hidden, rows, gate_up_proj, down_proj


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mlp", ["saves", "recompute"])
def test_experts_over_many_rows_run_by_runs_and_match(dtype, mlp, monkeypatch):
    """Run by run (CHUNK_TOKENS 16: six runs) the experts' MLP computes what it computes in one run: the output,
    d_gate_up_proj and d_down_proj bitwise (each expert's rows in the same GEMMs), the hidden states' gradient to
    the order of its per-token sums; and against float64 autograd by check_against_reference's rule."""
    generator = torch.Generator().manual_seed(0)
    hidden, rows, gate_up_proj, down_proj = _long_experts(dtype, generator)
    offsets = torch.tensor(LONG_ENDS, dtype=torch.int32)
    grad = torch.randn(96, 8, generator=generator).to(dtype)

    def fused(h, w1, w2):
        if mlp == "recompute":
            return grouped_gated_mlp_recompute(h, rows, w1, w2, offsets)
        return grouped_gated_linear(grouped_gather_mm(h, rows, w1, offsets), w2, offsets)

    def run():
        out = fused(hidden, gate_up_proj, down_proj)
        return (out, *torch.autograd.grad(out, (hidden, gate_up_proj, down_proj), grad))

    whole = run()
    monkeypatch.setattr(gated_mlp_op, "CHUNK_TOKENS", 16)
    runs = run()
    for name, a, b in zip(("output", "d_gate_up_proj", "d_down_proj"), (whole[0], *whole[2:]), (runs[0], *runs[2:])):
        assert torch.equal(a, b), name
    torch.testing.assert_close(runs[1], whole[1])

    def eager(h, w1, w2):
        return _eager_experts(h, rows, w1, w2, LONG_ENDS, "silu")

    check_against_reference(fused, eager, [hidden, gate_up_proj, down_proj], name=f"experts' MLP ({mlp}) in runs")


def test_the_recomputed_experts_backward_holds_a_runs_rows():
    """grouped_gated_mlp_recompute's backward, float32, 96 rows: in one run it holds every row's recomputed gate_up
    and dL/dc, and every row's gathered hidden state (for gate_up, then again for d_gate_up_proj) and its gradient;
    run by run (at most 16 rows, the largest run 21) a run's, beside the same outputs (d_gate_up [96, 8], d_hidden
    [40, 8], the weight gradients) and each run's share of the weight gradients. Measured: 15,360 -> 12,032 bytes
    at the peak (the outputs are most of it at this size); pinned: at least one H-wide float32 row (32 bytes) for
    each of the 75 rows outside the largest run."""
    generator = torch.Generator().manual_seed(0)
    hidden, rows, gate_up_proj, down_proj = _long_experts(torch.float32, generator)
    offsets = torch.tensor(LONG_ENDS, dtype=torch.int32)

    def backward_peak():
        out = grouped_gated_mlp_recompute(hidden, rows, gate_up_proj, down_proj, offsets)
        with PeakBytesMeter() as meter:
            torch.autograd.grad(out, (hidden, gate_up_proj, down_proj), torch.ones_like(out))
        return meter.peak_bytes

    whole = backward_peak()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gated_mlp_op, "CHUNK_TOKENS", 16)
        chunked = backward_peak()
    assert whole - chunked >= (96 - 21) * 8 * 4, (whole, chunked)


@pytest.mark.parametrize("ends", [[3, 3, 9, 13], LONG_ENDS], ids=["one-run", "runs"])
@pytest.mark.parametrize("dtype, weights_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                  (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
                         ids=["fp32", "fp16", "bf16", "bf16-fp32-weights"])
@pytest.mark.parametrize("mlp", ["saves", "recompute"])
def test_row_weights_inside_the_op_match_float64(backend, dtype, weights_dtype, mlp, ends, monkeypatch):
    """row_weights: each routed row's output times its routing weight inside the op, its gradient <dy W, c> from
    the GEMM backward makes anyway: output and the gradients of the hidden states, both projections and the row
    weights against float64 autograd of ``experts' MLP * weights``, float32 weights beside bf16 experts promoting
    the output as that product does; over LONG_ENDS' 96 rows in runs of whole experts (CHUNK_TOKENS 16)."""
    monkeypatch.setattr(gated_mlp_op, "CHUNK_TOKENS", 16)
    generator = torch.Generator().manual_seed(0)
    routed = ends[-1]
    hidden = torch.randn(40, 8, generator=generator).to(dtype).requires_grad_()
    rows = torch.randint(0, 40, (routed,), generator=generator)
    gate_up_proj = (torch.randn(len(ends), 8, 8, generator=generator) * 0.5).to(dtype).requires_grad_()
    down_proj = (torch.randn(len(ends), 8, 4, generator=generator) * 0.5).to(dtype).requires_grad_()
    row_weights = torch.rand(routed, generator=generator).to(weights_dtype).requires_grad_()
    offsets = torch.tensor(ends, dtype=torch.int32)

    def eager(h, w1, w2, weights):
        return _eager_experts(h, rows, w1, w2, ends, "silu") * weights.unsqueeze(-1)

    def fused(h, w1, w2, weights):
        if mlp == "recompute":
            return grouped_gated_mlp_recompute(h, rows, w1, w2, offsets, row_weights=weights)
        return grouped_gated_linear(grouped_gather_mm(h, rows, w1, offsets), w2, offsets, row_weights=weights)

    assert fused(hidden, gate_up_proj, down_proj, row_weights).dtype == torch.promote_types(dtype, weights_dtype)
    check_against_reference(fused, eager, [hidden, gate_up_proj, down_proj, row_weights],
                            name=f"weighted experts' MLP ({mlp}) {ends}")


def test_grouped_mm_loop_matches_the_grouped_kernel():
    """The loop over experts (float64, or strides torch._grouped_mm refuses) computes what torch._grouped_mm does."""
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(13, 16, generator=generator), torch.randn(4, 16, 8, generator=generator)
    offsets = torch.tensor([3, 3, 9, 13], dtype=torch.int32)
    torch.testing.assert_close(grouped_mm(a.double(), b.double(), offsets).float(), grouped_mm(a, b, offsets))
    dy = torch.randn(13, 8, generator=generator)
    torch.testing.assert_close(grouped_mm(dy.t().double(), a.double(), offsets).float(), grouped_mm(dy.t(), a, offsets))


@pytest.mark.parametrize("kwargs, argument", [
    (dict(gate_up=torch.zeros(4, 7)), "gate_up"),
    (dict(weight=torch.zeros(2, 8, 4)), "weight"),
    (dict(weight=torch.zeros(2, 8, 8, dtype=torch.float64)), "weight"),
    (dict(offsets=torch.tensor([2, 4])), "offsets"),
    (dict(offsets=torch.tensor([4], dtype=torch.int32)), "offsets"),
    (dict(activation="relu"), "activation"),
    (dict(row_weights=torch.zeros(3)), "row_weights"),
    (dict(row_weights=torch.zeros(4, dtype=torch.float64)), "row_weights"),
])
def test_grouped_gated_linear_bad_input_names_the_argument(kwargs, argument):
    arguments = dict(gate_up=torch.zeros(4, 16), weight=torch.zeros(2, 8, 8),
                     offsets=torch.tensor([2, 4], dtype=torch.int32))
    arguments.update(kwargs)
    activation = arguments.pop("activation", "silu")
    with pytest.raises(ValueError, match=argument):
        grouped_gated_linear(**arguments, activation=activation)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(hidden_states=torch.zeros(5)), "hidden_states"),
    (dict(rows=torch.zeros(4, dtype=torch.int32)), "rows"),
    (dict(gate_up_proj=torch.zeros(2, 16, 4)), "gate_up_proj"),
    (dict(gate_up_proj=torch.zeros(2, 16, 8, dtype=torch.float64)), "gate_up_proj"),
    (dict(offsets=torch.tensor([2, 4])), "offsets"),
])
def test_grouped_gather_mm_bad_input_names_the_argument(kwargs, argument):
    arguments = dict(hidden_states=torch.zeros(3, 8), rows=torch.tensor([0, 2, 1, 0]),
                     gate_up_proj=torch.zeros(2, 16, 8), offsets=torch.tensor([2, 4], dtype=torch.int32))
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=argument):
        grouped_gather_mm(**arguments)


def test_gpt_oss_experts_are_left_alone_with_the_reason():
    """GPT-OSS's experts: interleaved, transposed, with biases and a clamped SwiGLU: not what is fused."""
    config = transformers.GptOssConfig(**{**COMMON, "attn_implementation": "eager"}, intermediate_size=32,
                                       num_local_experts=4, num_experts_per_tok=2, head_dim=16)
    torch.manual_seed(0)
    report = apply(transformers.GptOssForCausalLM(config), measure=False)
    reasons = [row["reason"] for row in report.skipped if row["type"] == "GptOssExperts"]
    assert len(reasons) == 2 and all("only gate-first, bias-free stacked experts are fused" in r for r in reasons)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_trainer_trains_two_steps(name):
    """transformers.Trainer runs two AdamW steps on the patched model; its losses equal the unpatched model's run
    (the same initialization, batches and order) to fp32 rounding: the first is the same forward fused, the second
    follows one step of gradients that match (the float64 rule of the parity tests)."""
    ids = torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(2))
    dataset = [{"input_ids": row, "labels": row} for row in ids]

    def train(patched):
        model = _build(name)
        if patched:
            apply(model, measure=False)
        args = transformers.TrainingArguments(output_dir="/tmp/memkernels-moe-trainer", per_device_train_batch_size=2,
                                              max_steps=2, learning_rate=1e-3, report_to=[], logging_steps=1,
                                              save_strategy="no", use_cpu=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    losses, unpatched = train(True), train(False)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))) and losses[0] != losses[1]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(unpatched), rtol=1e-5, atol=0)  # measured 1e-7


def test_benchmark_qwen3_30b_a3b_row_on_meta():
    """bench_moe.py's Qwen3-30B-A3B row (meta, bf16, 2048 tokens, top-8, the routing weights' gradient asked for as
    a trained router's is), measured by the benchmark's own meter: the fused experts save exactly 2*H + 2*I
    elements a routed token fewer than transformers' grouped_mm path (the gathered rows, act(gate), the product,
    and the unweighted output its ``routed * weights`` keeps for the weights' gradient: 3,098 of 14,362 B a routed
    token, 21.6%), recomputing 4*I + 2*H fewer (nothing a routed token but the routing); neither's peak is above
    eager's (888 against 944 MiB: the two ops free down_proj's gradient before gate_up_proj's is made, and
    backward gathers the rows only for dW)."""
    from bench_loader import load_benchmark
    bench = load_benchmark("bench_moe")
    label, hidden, intermediate, experts, top_k, tokens, dtype, device = bench.CONFIGS[1]
    assert device == "meta"
    module, x, index, weights, dy = bench.build(hidden, intermediate, experts, top_k, tokens, dtype, device)
    measured = {method: bench.measure(computed, x, index, weights, dy)
                for method, computed in bench.methods(module, device).items() if not isinstance(computed, str)}
    routed_bytes = 2 * tokens * top_k  # bf16
    assert measured["eager"][0] - measured["memkernels"][0] == (2 * intermediate + 2 * hidden) * routed_bytes
    assert measured["memkernels"][0] <= 0.5 * measured["eager"][0]
    assert measured["eager"][0] - measured["memkernels recompute"][0] == (4 * intermediate + 2 * hidden) * routed_bytes
    assert measured["memkernels recompute"][1] <= measured["memkernels"][1] <= measured["eager"][1]


class _PerExpertMoE(torch.nn.Module):
    """transformers 4.x's layout (Mixtral's and Qwen2-MoE's sparse blocks before the stacked ``...Experts``): a
    router and an ``nn.ModuleList`` of one gated MLP an expert, run on the tokens routed to each."""

    def __init__(self, hidden=64, intermediate=32, experts=4, top_k=2):
        super().__init__()
        config = transformers.Qwen2MoeConfig(hidden_size=hidden, intermediate_size=intermediate, hidden_act="silu")
        self.top_k = top_k
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(
            transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeMLP(config, intermediate_size=intermediate)
            for _ in range(experts))

    def forward(self, x):
        weights, chosen = torch.topk(F.softmax(self.gate(x), dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return out


def test_experts_as_a_module_per_expert_are_fused_as_gated_mlps():
    """Each expert of a per-expert module list is a gated MLP apply() fuses by structure (the dense rule): every
    expert reported fused, the loss and every gradient within the float64 rule."""
    torch.manual_seed(0)
    model = _PerExpertMoE()
    patched = copy.deepcopy(model)
    report = apply(patched, measure=False)
    fused = [row for row in report.replaced if row["name"].startswith("experts.")]
    assert len(fused) == 4, report
    x = torch.randn(24, 64)
    reference = copy.deepcopy(model).double()
    runs = []
    for run, inputs in ((reference, x.double()), (model, x), (patched, x)):
        run.zero_grad(set_to_none=True)
        loss = run(inputs).square().mean()
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in run.named_parameters() if p.grad is not None}))
    (loss64, grads64), (loss_e, grads_e), (loss_p, grads_p) = runs
    _assert_parity(loss64.reshape(1), loss_e.reshape(1), loss_p.reshape(1), "loss")
    assert set(grads_p) == set(grads_e) == set(grads64)
    for key, g64 in grads64.items():
        _assert_parity(g64, grads_e[key], grads_p[key], key)
