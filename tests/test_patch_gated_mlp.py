"""memkernels.apply on the gated MLPs (SwiGLU / GeGLU) of tiny Hugging Face models built from configs.

Llama, Mistral, Qwen2, Qwen3, Gemma 1/2/3 and Phi-3 (packed gate_up_proj), with and without
recompute, and with peft LoRA on every projection. Parity is judged as in tests/test_patch.py:
the unpatched model in float64 is the reference, and the patched fp32 model's loss and gradients
must be within 2x the unpatched fp32 model's error, plus a floor of a few fp32 roundings.
"""
import copy

import pytest
import torch
from torch import nn

from memkernels.fusions.apply import apply
from memkernels.meters import SavedBytesMeter
from memkernels.runtime.ledger import activation_ledger

transformers = pytest.importorskip("transformers")

VOCAB = 131
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")


def _gemma_like(model):
    with torch.no_grad():  # Gemma initializes its norm weights to 0 (scale 1 + w): make them matter
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm") and hasattr(module, "weight"):
                module.weight.normal_(0, 0.1)
    return model


FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **COMMON)),
    "gemma": lambda: _gemma_like(transformers.GemmaForCausalLM(transformers.GemmaConfig(head_dim=16, **COMMON))),
    "gemma2": lambda: _gemma_like(transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        head_dim=16, **dict(COMMON, attn_implementation="eager")))),  # Gemma 2 has no SDPA path
    "gemma3": lambda: _gemma_like(transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(head_dim=16,
                                                                                                **COMMON))),
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(pad_token_id=0, eos_token_id=1,
                                                                         bos_token_id=1, **COMMON)),
}
# gated MLP class, activation
EXPECTED_MLP = {"llama": "LlamaMLP", "mistral": "MistralMLP", "qwen2": "Qwen2MLP", "qwen3": "Qwen3MLP",
                "gemma": "GemmaMLP", "gemma2": "Gemma2MLP", "gemma3": "Gemma3MLP", "phi3": "Phi3MLP"}


def _batch(batch=2, seq=24):
    ids = torch.randint(0, VOCAB, (batch, seq))
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def _loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_parity(reference, eager, patched, name, scale):
    eager_error = (eager.double() - reference).abs().max().item()
    patched_error = (patched.double() - reference).abs().max().item()
    floor = 4 * torch.finfo(torch.float32).eps * scale
    assert patched_error <= 2 * eager_error + floor, (
        f"{name}: patched error {patched_error:.3e} > 2 x eager error {eager_error:.3e} + floor {floor:.1e}")


def _check_parity(model, patched):
    """Loss and every gradient of ``patched`` against ``model`` (run in float64 and in fp32)."""
    reference = copy.deepcopy(model).double()
    ids, labels = _batch()
    loss64, grads64 = _loss_and_grads(reference, ids, labels)
    loss32, grads32 = _loss_and_grads(model, ids, labels)
    loss_p, grads_p = _loss_and_grads(patched, ids, labels)
    _assert_parity(loss64.reshape(1), loss32.reshape(1), loss_p.reshape(1), "loss", loss64.abs().item())
    assert set(grads_p) == set(grads32) == set(grads64)
    global_scale = max(g.abs().max().item() for g in grads64.values())
    for name, g64 in grads64.items():
        _assert_parity(g64, grads32[name], grads_p[name], name, max(g64.abs().max().item(), global_scale * 1e-3))
    return grads_p


def _gated_rows(report):
    return [r for r in report.replaced if r["before"].endswith("MLP")]


@pytest.mark.parametrize("mlp", [True, "recompute"], ids=["saved", "recompute"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_loss_and_every_gradient_match_unpatched(family, mlp):
    model = FAMILIES[family]().train()
    patched = copy.deepcopy(model)
    report = apply(patched, mlp=mlp, measure=False)
    mode = "recompute" if mlp == "recompute" else "saves gate, up"
    assert [(r["before"], r["after"]) for r in _gated_rows(report)] == [
        (EXPECTED_MLP[family], f"Memkernels{EXPECTED_MLP[family]} ({mode})")] * 2
    _check_parity(model, patched)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_state_dict_loads_both_ways(family):
    model = FAMILIES[family]()
    patched = copy.deepcopy(model)
    apply(patched, mlp="recompute", measure=False)
    original_state, patched_state = model.state_dict(), patched.state_dict()
    assert list(patched_state) == list(original_state)
    fresh, fresh_patched = FAMILIES[family](), FAMILIES[family]()
    apply(fresh_patched, measure=False)
    fresh_patched.load_state_dict(original_state, strict=True)
    fresh.load_state_dict(patched_state, strict=True)
    ids, labels = _batch()
    with torch.no_grad():
        expected = model(input_ids=ids, labels=labels, use_cache=False).loss
        torch.testing.assert_close(fresh(input_ids=ids, labels=labels, use_cache=False).loss, expected)
        torch.testing.assert_close(fresh_patched(input_ids=ids, labels=labels, use_cache=False).loss, expected,
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_saved_bytes_per_token_drop_as_the_contract_says(family):
    model = FAMILIES[family]().train()
    ids, labels = _batch()
    tokens, width = ids.numel(), COMMON["intermediate_size"]

    def mlp_bytes(mlp_mode):
        patched = copy.deepcopy(model)
        apply(patched, norms=False, loss=False, mlp=mlp_mode, measure=False)
        ledger = activation_ledger(patched, input_ids=ids, labels=labels, use_cache=False)
        return ledger.by_category()["mlp"] / tokens / COMMON["num_hidden_layers"]

    # per layer, the ledger files the MLP's input x (the norm's output) under "mlp" in every variant; beyond
    # it, eager keeps gate, act(gate), up and the product (Phi-3: the packed gate_up, act(gate) and the
    # product, the same 4 * I); fused, gate and up; with recompute nothing
    x_bytes = COMMON["hidden_size"] * 4
    assert mlp_bytes(False) == x_bytes + 4 * width * 4
    assert mlp_bytes(True) == x_bytes + 2 * width * 4
    assert mlp_bytes("recompute") == x_bytes


def test_mixture_of_experts_routed_and_shared_experts_are_fused():
    model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, **COMMON))
    report = apply(model, measure=False)
    assert not report.skipped or all("xperts" not in s["type"] for s in report.skipped), report.skipped
    # the routed experts through grouped_gated_linear (tests/test_moe.py), the dense shared expert as an ordinary
    # gated MLP
    routed = [r["after"] for r in report.replaced if r["before"] == "Qwen2MoeExperts"]
    assert routed == ["MemkernelsQwen2MoeExperts (saves gate_up)"] * 2
    assert [r["before"] for r in _gated_rows(report)] == ["Qwen2MoeMLP"] * 2


def test_unfusable_down_projections_are_left_alone_with_the_reason():
    fake_bnb = type("Linear4bit", (nn.Linear,), {"__module__": "bitsandbytes.nn.modules"})
    model = FAMILIES["llama"]()
    mlp = model.model.layers[0].mlp
    mlp.down_proj = fake_bnb(96, 64, bias=False)
    model.model.layers[1].mlp.act_fn = nn.ReLU()
    report = apply(model, measure=False)
    reasons = {s["name"]: s["reason"] for s in report.skipped}
    assert reasons["model.layers.0.mlp"] == ("bitsandbytes-quantized down_proj (Linear4bit): the fused GEMM needs "
                                             "a dense weight")
    assert reasons["model.layers.1.mlp"] == "gated MLP activation ReLU is not SiLU or GELU"
    with pytest.raises(ValueError, match="mlp='yes'"):
        apply(model, mlp="yes")


# --------------------------------------------------------------------------------------------
# peft LoRA

peft = pytest.importorskip("peft")
LORA_TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}


def _lora_model(family, dropout=0.0):
    torch.manual_seed(0)
    base = FAMILIES[family]()
    targets = LORA_TARGETS.get(family, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # init_lora_weights=False: B is random too, so every adapter changes the output and has gradients
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets,
                             init_lora_weights=False)
    return peft.get_peft_model(base, config).train()


@pytest.mark.parametrize("family", ["llama", "gemma", "phi3"])
def test_lora_mlps_are_fused_and_match(family):
    model = _lora_model(family)
    patched = copy.deepcopy(model)
    report = apply(patched, mlp="recompute", measure=False)
    # LoRA projections keep the saving variant (recompute needs plain Linear weights)
    assert [r["after"] for r in _gated_rows(report)] == [f"Memkernels{EXPECTED_MLP[family]} (saves gate, up)"] * 2
    grads = _check_parity(model, patched)
    adapters = [name for name in grads if "lora_" in name]
    assert any("down_proj.lora_A" in name for name in adapters) and all(grads[n].abs().max() > 0 for n in adapters)
    assert not any("base_layer" in name for name in grads)  # base weights stay frozen

    ids, labels = _batch()
    tokens, width = ids.numel(), COMMON["intermediate_size"]
    before = activation_ledger(model, input_ids=ids, labels=labels, use_cache=False).by_category()["mlp"]
    after = activation_ledger(patched, input_ids=ids, labels=labels, use_cache=False).by_category()["mlp"]
    # the product (and act(gate)) is no longer kept, for the base GEMM nor for the down adapter
    assert (before - after) / tokens / COMMON["num_hidden_layers"] == 2 * width * 4


def test_a_lora_adapter_on_down_proj_saves_only_its_low_rank_input():
    """A bf16 Llama MLP with peft's float32 adapters (its default beside a half base): the adapter on down_proj runs
    on the fused op's own c (gated_linear(adapter=)), so per token it adds only what lora_B saves, its r float32
    inputs; it used to run a second gated_linear on gate and up cast to float32, saved: 2 * I * 4 bytes more."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)

    def saved_per_token(targets):
        torch.manual_seed(0)
        model = peft.get_peft_model(transformers.LlamaForCausalLM(config).to(torch.bfloat16),
                                    peft.LoraConfig(r=8, target_modules=targets))
        apply(model, measure=False)
        mlp = model.base_model.model.model.layers[0].mlp

        def saved(tokens):
            meter = SavedBytesMeter()
            with meter:
                mlp(torch.randn(1, tokens, 64, dtype=torch.bfloat16, requires_grad=True))
            return meter.total_bytes

        return (saved(1024) - saved(512)) / 512  # per token: what does not grow with the tokens cancels

    added = saved_per_token(["gate_proj", "up_proj", "down_proj"]) - saved_per_token(["gate_proj", "up_proj"])
    assert added == 8 * 4  # lora_B's input: r float32 values a token


def test_lora_dropout_on_down_proj_is_left_alone():
    report = apply(_lora_model("llama", dropout=0.1), measure=False)
    reasons = {s["reason"] for s in report.skipped if s["type"] == "LlamaMLP"}
    assert reasons == {"LoRA dropout on down_proj (adapter 'default') needs act(gate) * up materialized"}


def test_fused_gated_mlp_computes_a_lora_adapter_on_its_down_proj():
    """FusedGatedMLP and the MLPs apply() fuses run one forward (memkernels.fusions.gated_mlp.module's
    gated_mlp_forward). FusedGatedMLP had a twin of it that read a peft LoRA down_proj's base weight and dropped the adapter without a word; now the
    adapter is its own gated_linear, and one that cannot be fused (LoRA dropout) raises naming why."""
    from memkernels.nn import FusedGatedMLP

    torch.manual_seed(0)
    mlp = FusedGatedMLP(16, 24, activation="silu", dtype=torch.float64)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj"], init_lora_weights=False)
    mlp = peft.inject_adapter_in_model(config, torch.nn.Sequential(mlp))[0]
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    fused = mlp(x)
    eager = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))  # the LoRA layer's forward
    torch.testing.assert_close(fused, eager, rtol=1e-12, atol=1e-12)
    adapter = [mlp.down_proj.lora_A["default"].weight, mlp.down_proj.lora_B["default"].weight]
    upstream = torch.randn_like(fused)
    torch.testing.assert_close(torch.autograd.grad(fused, adapter, upstream),
                               torch.autograd.grad(eager, adapter, upstream), rtol=1e-12, atol=1e-12)

    dropout = peft.LoraConfig(r=4, target_modules=["down_proj"], lora_dropout=0.1)
    mlp = peft.inject_adapter_in_model(dropout, torch.nn.Sequential(FusedGatedMLP(16, 24)))[0]
    with pytest.raises(TypeError, match="FusedGatedMLP: LoRA dropout on down_proj"):
        mlp(torch.randn(3, 16))


# --------------------------------------------------------------------------------------------
# Forwards that do more than down(act(gate) * up): probed, honoured or left alone


def _falcon_h1():
    return transformers.FalconH1ForCausalLM(transformers.FalconH1Config(
        mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8,
        head_dim=16, mlp_multipliers=[0.5, 3.0], **COMMON))


@pytest.mark.parametrize("mlp", [True, "recompute"], ids=["saved", "recompute"])
def test_falcon_h1_gate_and_down_multipliers_are_kept(mlp):
    """Falcon-H1's MLP is down(act(gate * m_gate) * up) * m_down: fused by structure alone, the multipliers were
    dropped without a word (logits 0.045 off). The probe finds them; gated_linear runs on the scaled gate; the
    recompute variant, which forms gate itself, is not taken (the saving one is)."""
    torch.manual_seed(0)
    model = _falcon_h1().train()
    patched = copy.deepcopy(model)
    report = apply(patched, mlp=mlp, measure=False)
    assert [r["after"] for r in _gated_rows(report)] == ["MemkernelsFalconH1MLP (saves gate, up)"] * 2
    _check_parity(model, patched)


def test_a_gated_mlp_whose_forward_does_more_is_left_alone_with_the_reason():
    from transformers.models.llama.modeling_llama import LlamaMLP

    class ClampedMLP(LlamaMLP):  # GPT-OSS-style clamping of the gate: not what gated_linear computes
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x).clamp(max=0.5)) * self.up_proj(x))

    model = FAMILIES["llama"]()
    for layer in model.model.layers:
        layer.mlp.__class__ = ClampedMLP
    report = apply(model, measure=False)
    assert _gated_rows(report) == []
    reasons = {s["reason"] for s in report.skipped if s["type"] == "ClampedMLP"}
    assert reasons == {"ClampedMLP's forward is not down_proj(act(gate) * up) (with its gate_multiplier and "
                       "down_multiplier, when it has them), checked in float64"}


def test_fused_gated_mlp_module_takes_the_multipliers():
    from memkernels.fusions.gated_mlp.module import FusedGatedMLP

    torch.manual_seed(0)
    falcon = _falcon_h1().model.layers[0].feed_forward
    fused = FusedGatedMLP.from_module(falcon)
    assert (fused.gate_multiplier, fused.down_multiplier) == (0.5, 3.0)
    x = torch.randn(2, 5, COMMON["hidden_size"])
    torch.testing.assert_close(fused(x), falcon(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="recompute=True forms gate inside"):
        FusedGatedMLP.from_module(falcon, recompute=True)
