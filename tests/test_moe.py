"""Mixture-of-experts MLPs through memkernels.apply() (issue 37 point 1): routed experts' gated down projection as
grouped_gated_linear (gate_up saved per routed token, act(gate) * up never), on tiny Qwen3-MoE, Mixtral and
DeepSeek-V3 models built from their transformers configs (random weights, fp32 on the CPU).

Parity is test_patch.py's rule: against the unpatched model in float64, the patched model's loss, router logits
and every gradient err at most 2x what the unpatched model errs in fp32, plus a floor of a few fp32 roundings.
The op itself is checked against float64 in fp32, fp16 and bf16 through both backends.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from memkernels.fusions.gated_mlp.grouped import grouped_gated_linear, grouped_mm
from memkernels.meters import SavedBytesMeter
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


@pytest.mark.parametrize("name", sorted(MODELS))
def test_apply_fuses_the_routed_experts_and_says_so(name):
    model = _build(name)
    report = apply(model, measure=False)
    _, experts, layers = MODELS[name]
    fused = [row for row in report.replaced if row["before"] == experts]
    assert len(fused) == layers and all(row["after"] == f"Memkernels{experts}" for row in fused)
    assert not any("expert" in row["reason"] for row in report.skipped), report.skipped


@pytest.mark.parametrize("name", sorted(MODELS))
def test_loss_router_logits_and_every_gradient_match(name):
    model = _build(name)
    patched = copy.deepcopy(model)
    apply(patched, measure=False)
    ids = _ids()
    reference = copy.deepcopy(model).double()
    reference.set_experts_implementation("eager")  # torch._grouped_mm takes no float64
    loss64, grads64 = _loss_and_grads(reference, ids, ids)
    loss32, grads32 = _loss_and_grads(model, ids, ids)
    loss_p, grads_p = _loss_and_grads(patched, ids, ids)
    _assert_parity(loss64.reshape(1), loss32.reshape(1), loss_p.reshape(1), "loss")
    assert set(grads_p) == set(grads32) and any("experts" in n for n in grads_p)
    global_scale = max(g.abs().max().item() for g in grads64.values())
    for key, g64 in grads64.items():
        _assert_parity(g64, grads32[key], grads_p[key], key, scale=max(g64.abs().max().item(), global_scale * 1e-3))
    with torch.no_grad():
        logits = [m(input_ids=ids, output_router_logits=True).router_logits for m in (reference, model, patched)]
    for index, (r64, r32, rp) in enumerate(zip(*logits)):
        _assert_parity(r64, r32, rp, f"router logits {index}")


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_experts_save_at_most_half_of_eager(name, dtype):
    """New bytes the experts save for backward (saved_tensors_hooks): eager keeps gate_up, act(gate) and the
    product per routed token (4*I); fused only gate_up (2*I): exactly 2*I per routed token fewer, the rest (the
    gathered hidden states, H per routed token, the routing indices and weights) the same in both. So the
    I-wide bytes are 50% of eager's; all new bytes 63-68% of eager's at these shapes."""
    experts, hidden, index, weights = _experts_call(name, dtype)
    width = experts.down_proj.shape[2]
    hidden.requires_grad_()
    with SavedBytesMeter() as eager:
        experts(hidden, index, weights)
    apply(experts, measure=False)
    assert type(experts).__name__.startswith("Memkernels")
    with SavedBytesMeter() as fused:
        experts(hidden, index, weights)
    routed = index.numel()
    element = hidden.element_size()
    assert eager.new_bytes - fused.new_bytes == 2 * width * element * routed
    assert fused.new_bytes - 2 * width * element * routed <= eager.new_bytes - 4 * width * element * routed


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


def test_torch_compile_fullgraph_keeps_the_custom_ops():
    """Under torch.compile (aot_eager, fullgraph) the forward and backward are the custom ops, with the eager
    twin's gradients."""
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(13, 32, generator=generator).requires_grad_()
    weight = torch.randn(4, 8, 16, generator=generator).requires_grad_()
    offsets = torch.tensor([3, 3, 9, 13], dtype=torch.int32)
    grad = torch.randn(13, 8, generator=generator)
    eager = torch.autograd.grad(grouped_gated_linear(gate_up, weight, offsets), (gate_up, weight), grad)
    seen = []

    def backend(graph, example_inputs):
        seen.extend(str(node.target) for node in graph.graph.nodes)
        return graph.forward

    compiled = torch.compile(lambda g, w: grouped_gated_linear(g, w, offsets), backend="aot_eager", fullgraph=True)
    compiled_grads = torch.autograd.grad(compiled(gate_up, weight), (gate_up, weight), grad)
    for expected, got in zip(eager, compiled_grads):
        torch.testing.assert_close(got, expected)
    torch._dynamo.reset()
    torch.compile(lambda g, w: grouped_gated_linear(g, w, offsets), backend=backend, fullgraph=True)(gate_up, weight)
    assert any("grouped_gated_linear" in target for target in seen), seen


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
])
def test_grouped_gated_linear_bad_input_names_the_argument(kwargs, argument):
    arguments = dict(gate_up=torch.zeros(4, 16), weight=torch.zeros(2, 8, 8),
                     offsets=torch.tensor([2, 4], dtype=torch.int32))
    arguments.update(kwargs)
    activation = arguments.pop("activation", "silu")
    with pytest.raises(ValueError, match=argument):
        grouped_gated_linear(**arguments, activation=activation)


def test_gpt_oss_experts_are_left_alone_with_the_reason():
    """GPT-OSS's experts: interleaved, transposed, with biases and a clamped SwiGLU: not what is fused."""
    config = transformers.GptOssConfig(**{**COMMON, "attn_implementation": "eager"}, intermediate_size=32,
                                       num_local_experts=4, num_experts_per_tok=2, head_dim=16)
    torch.manual_seed(0)
    report = apply(transformers.GptOssForCausalLM(config), measure=False)
    reasons = [row["reason"] for row in report.skipped if row["type"] == "GptOssExperts"]
    assert len(reasons) == 2 and all("only gate-first, bias-free stacked experts are fused" in r for r in reasons)


def test_trainer_trains_two_steps():
    """transformers.Trainer runs two optimizer steps on the patched Qwen3-MoE and the loss is finite and moves."""
    model = _build("qwen3_moe")
    apply(model, measure=False)
    ids = _ids()
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(output_dir="/tmp/memkernels-moe-trainer", per_device_train_batch_size=2,
                                          max_steps=2, learning_rate=1e-3, report_to=[], logging_steps=1,
                                          save_strategy="no", use_cpu=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_benchmark_qwen3_30b_a3b_row_on_meta():
    """bench_moe.py's Qwen3-30B-A3B row (meta, bf16, 2048 tokens, top-8): the fused experts save exactly 2*I
    elements a routed token fewer than transformers' grouped_mm path, measured by the benchmark's own meter."""
    from bench_loader import load_benchmark
    bench = load_benchmark("bench_moe")
    label, hidden, intermediate, experts, top_k, tokens, dtype, device = bench.CONFIGS[1]
    assert device == "meta"
    module, x, index, weights, dy = bench.build(hidden, intermediate, experts, top_k, tokens, dtype, device)
    eager = bench.measure(copy.deepcopy(module), x, index, weights, dy)
    fused_module = copy.deepcopy(module)
    apply(fused_module, measure=False)
    fused = bench.measure(fused_module, x, index, weights, dy)
    assert eager[0] - fused[0] == 2 * intermediate * 2 * tokens * top_k
    assert fused[1] <= eager[1]
