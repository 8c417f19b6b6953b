"""memkernels.apply() in the real training stack: transformers.Trainer at its default arguments
(fp32 and bf16 autocast, with and without peft LoRA), TRL's SFTTrainer, torch.autocast, and every
causal-LM head apply() patches. Tiny models built from configs (no downloads).

Parity is test_patch.py's rule: against the unpatched model run in float64, the patched model's
loss and gradients err at most 2x what the unpatched model itself errs in the same precision (plus
a floor of a few fp32 roundings). Trainer runs compare the patched run with the unpatched run under
the same settings: fp32 at torch.testing's float32 tolerance, bf16 autocast to one bfloat16 rounding
of the loss (the logits are bf16 there; AdamW turns gradient roundings into update signs).
"""
import copy
import inspect
import logging
import warnings

import numpy as np
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from memkernels.fusions.apply import apply
from memkernels.fusions.loss import rule as loss_rule  # noqa: E402
from memkernels.fusions.loss.rule import CAUSAL_LM_HEADS  # noqa: E402
from memkernels.models import ModelConfig, TransformerLM  # noqa: E402
from test_patch import (COMMON, VOCAB, _batch, assert_patched_parity, _gemma, _gemma3, _gemma4,  # noqa: E402
                        _gpt2, _llama, _loss_and_grads, _olmo2, _phi3, _qwen2, _qwen3, _qwen3_5)


def _mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(num_key_value_heads=2, **COMMON))


def _gemma2():  # a softcap small enough to bend these logits
    config = transformers.Gemma2Config(num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.5,
                                       **dict(COMMON, attn_implementation="eager"))
    return transformers.Gemma2ForCausalLM(config)


def _granite():  # logits / 8
    return transformers.GraniteForCausalLM(transformers.GraniteConfig(num_key_value_heads=2, logits_scaling=8.0,
                                                                      **COMMON))


def _cohere():  # logits * 0.25
    return transformers.CohereForCausalLM(transformers.CohereConfig(num_key_value_heads=2, logit_scale=0.25, **COMMON))


def _plain_head(model_type, class_name):
    """A tiny model of a family whose head is plain Llama's (lm_head, then the loss): its Auto config, dropout off
    (Seed-OSS defaults to 0.1), so that runs compare."""
    def build():
        config = transformers.AutoConfig.for_model(model_type, num_key_value_heads=2, head_dim=16, pad_token_id=0,
                                                   bos_token_id=0, eos_token_id=0, **COMMON)
        for name in ("attention_dropout", "residual_dropout"):
            if hasattr(config, name):
                setattr(config, name, 0.0)
        return getattr(transformers, class_name)(config)
    return build


PLAIN_HEAD_TYPES = {"Olmo3ForCausalLM": "olmo3", "SmolLM3ForCausalLM": "smollm3", "MinistralForCausalLM": "ministral",
                    "Ministral3ForCausalLM": "ministral3", "SeedOssForCausalLM": "seed_oss",
                    "Ernie4_5ForCausalLM": "ernie4_5", "Exaone4ForCausalLM": "exaone4", "Glm4ForCausalLM": "glm4"}

# Every causal-LM family apply() patches, by the class name CAUSAL_LM_HEADS lists.
FAMILIES = {"LlamaForCausalLM": _llama, "MistralForCausalLM": _mistral, "Qwen2ForCausalLM": _qwen2,
            "Qwen3ForCausalLM": _qwen3, "Qwen3_5ForCausalLM": _qwen3_5, "GemmaForCausalLM": _gemma,
            "Gemma2ForCausalLM": _gemma2, "Gemma3ForCausalLM": _gemma3, "Gemma4ForCausalLM": _gemma4,
            "Olmo2ForCausalLM": _olmo2, "Phi3ForCausalLM": _phi3, "GPT2LMHeadModel": _gpt2,
            "GraniteForCausalLM": _granite, "CohereForCausalLM": _cohere,
            **{name: _plain_head(model_type, name) for name, model_type in PLAIN_HEAD_TYPES.items()}}
# The Trainer matrix runs these in the default selection (LoRA through GPT-2 in fp32 only) and the rest as slow
# tests; so do the head checks of the families whose head is plain Llama's.
QUICK = {("LlamaForCausalLM", False, False), ("LlamaForCausalLM", True, False), ("GPT2LMHeadModel", False, False),
         ("GPT2LMHeadModel", True, False), ("GPT2LMHeadModel", False, True)}
PLAIN_LLAMA_HEADS = ("MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3_5ForCausalLM",
                     "Olmo2ForCausalLM", "Phi3ForCausalLM", *PLAIN_HEAD_TYPES)


def test_every_family_apply_patches_is_tested_here():
    from test_moe import LOAD_BALANCED_HEADS  # tested with the router's load-balancing term there
    from test_vlm import HEADS as VISION_LANGUAGE_HEADS  # tested with image inputs there
    assert set(FAMILIES) == set(CAUSAL_LM_HEADS) - set(VISION_LANGUAGE_HEADS) - set(LOAD_BALANCED_HEADS)
    assert set(VISION_LANGUAGE_HEADS) | set(LOAD_BALANCED_HEADS) <= set(CAUSAL_LM_HEADS)


# ----------------------------------------------------------------------------- heads


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in PLAIN_LLAMA_HEADS else f
                                    for f in sorted(FAMILIES)])
def test_every_head_gives_the_unpatched_loss_and_gradients(family):
    """Granite's logits_scaling, Cohere's logit_scale and the softcaps of Gemma 2-4 are part of the fused loss."""
    model = FAMILIES[family]().train()
    patched = copy.deepcopy(model)
    report = apply(patched, measure=False)
    assert ("", family, f"Memkernels{family}") in {(r["name"], r["before"], r["after"]) for r in report.replaced}
    ids, labels = _batch()
    assert_patched_parity(model, patched, ids, labels)
    with torch.no_grad():
        assert patched(input_ids=ids, labels=labels).logits is None  # the fused path ran


def test_a_head_memkernels_does_not_know_keeps_its_own_loss_and_says_why():
    """PhiMoE adds its router's load-balancing loss to the LM loss and is not in CAUSAL_LM_HEADS (the MoE families
    that are get the term in the fused loss: tests/test_moe.py): its own loss is kept, with the term."""
    config = transformers.PhimoeConfig(num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1,
                                       output_router_logits=True, router_aux_loss_coef=0.5, **COMMON)
    model = transformers.PhimoeForCausalLM(config).train()
    patched = copy.deepcopy(model)
    report = apply(patched, measure=False)
    assert type(patched) is transformers.PhimoeForCausalLM
    [skip] = [s for s in report.skipped if s["type"] == "PhimoeForCausalLM"]
    assert "CAUSAL_LM_HEADS" in skip["reason"] and "own loss is kept" in skip["reason"]
    assert "PhimoeForCausalLM" in report.summary()
    ids, labels = _batch()
    got, expected = patched(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
    assert got.aux_loss is not None and got.aux_loss > 0  # the router's loss is in
    torch.testing.assert_close(got.loss, expected.loss)  # (the grouped matmul has no float64 to judge by)


# ----------------------------------------------------------------------------- the forward's face


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_patched_forward_keeps_the_signature_and_docstring(family):
    model = FAMILIES[family]()
    before_signature, before_doc = inspect.signature(model.forward), model.forward.__doc__
    unpatched = copy.deepcopy(model).train()
    apply(model, measure=False)
    assert inspect.signature(model.forward) == before_signature
    assert model.forward.__doc__ == before_doc and before_doc
    ids, labels = _batch()
    model.train()
    with torch.no_grad():  # input_ids passed by position, as the original forward names it
        out, expected = model(ids, labels=labels), unpatched(ids, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)


def test_output_uses_only_the_fields_the_installed_transformers_declares(caplog):
    """No "`past_key_values`/`cache_params` are deprecated" on a patched forward."""
    transformers.utils.logging.enable_propagation()
    logging.Logger.warning_once.cache_clear()  # transformers' once-only warnings: let this one show again
    try:
        for factory in (_llama, _gpt2):
            model = factory().train()
            apply(model, measure=False)
            ids, labels = _batch()
            with caplog.at_level(logging.WARNING), warnings.catch_warnings():
                warnings.simplefilter("error", FutureWarning)
                out = model(input_ids=ids, labels=labels, use_cache=True)
            assert not [r for r in caplog.records if "deprecated" in r.getMessage()], caplog.text
            assert out.logits is None and out.loss is not None and out.cache is not None
    finally:
        transformers.utils.logging.disable_propagation()


# ----------------------------------------------------------------------------- peft LoRA


def _lora(model, targets):
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(target_modules=targets, init_lora_weights=False, r=4,
                                                      lora_dropout=0.0))


def _adapter_grads_are_nonzero(grads):
    lora = {name: g for name, g in grads.items() if "lora_" in name}
    assert lora and all(g.abs().sum() > 0 for g in lora.values())


@pytest.mark.parametrize("factory, targets", [
    (_gpt2, ["c_attn", "c_proj", "c_fc", "lm_head"]),
    (_llama, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]),
], ids=["gpt2", "llama"])
def test_lora_on_every_linear_and_the_head_is_never_bypassed(factory, targets):
    model = _lora(factory(), targets).train()
    patched = copy.deepcopy(model)
    report = apply(patched, measure=False)
    reasons = {s["type"]: s["reason"] for s in report.skipped}
    assert "peft" in reasons[type(model.get_base_model()).__name__]  # lm_head has an adapter: its loss is kept
    if factory is _gpt2:
        assert "c_proj is a peft" in reasons["GPT2MLP"]  # fusing c_proj would skip its adapter
    assert any(r["after"] in ("FusedLayerNorm", "FusedRMSNorm") for r in report.replaced)
    ids, labels = _batch()
    _adapter_grads_are_nonzero(assert_patched_parity(model, patched, ids, labels))


def test_lora_around_the_fused_mlp_and_loss_trains_the_adapters():
    """Adapters on c_attn and c_fc (called through their own forward): the MLP and the loss stay fused,
    through the PeftModel."""
    model = _lora(_gpt2(), ["c_attn", "c_fc"]).train()
    patched = copy.deepcopy(model)
    report = apply(patched, measure=False)
    after = {r["after"] for r in report.replaced}
    assert {"MemkernelsGPT2MLP", "MemkernelsGPT2LMHeadModel"} <= after, report.summary()
    ids, labels = _batch()
    _adapter_grads_are_nonzero(assert_patched_parity(model, patched, ids, labels))


def test_linear_subclasses_and_hooked_modules_are_left_alone():
    class ScaledLinear(nn.Linear):  # a forward of its own, as a quantized linear has
        def forward(self, x):
            return 2 * super().forward(x)

    config = ModelConfig(name="tiny", vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                         intermediate_size=48, max_seq_len=32, norm="layernorm", mlp="gelu", position="learned")
    lm = TransformerLM(config)
    mlp = next(m for m in lm.modules() if type(m).__name__ == "MLP")
    old = mlp.fc2
    mlp.fc2 = ScaledLinear(old.in_features, old.out_features)
    report = apply(lm, measure=False)
    assert any("ScaledLinear" in s["reason"] and s["type"] == "MLP" for s in report.skipped)
    assert any(type(m).__name__ == "MLP" for m in lm.modules())

    gpt2 = _gpt2()
    gpt2.transformer.h[0].mlp.c_proj.register_forward_hook(lambda module, args, out: out * 2)
    gpt2.transformer.ln_f.register_forward_pre_hook(lambda module, args: None)
    report = apply(gpt2, measure=False)
    reasons = [s["reason"] for s in report.skipped]
    assert "c_proj has forward hooks, which fusing would skip" in reasons
    assert "the norm has forward hooks, which fusing would skip" in reasons
    assert type(gpt2.transformer.h[0].mlp).__name__ == "GPT2MLP"
    assert type(gpt2.transformer.h[1].mlp).__name__ == "MemkernelsGPT2MLP"


# ----------------------------------------------------------------------------- torch.autocast


@pytest.mark.parametrize("factory", [_llama, pytest.param(_qwen2, marks=pytest.mark.slow),
                                     pytest.param(_gemma, marks=pytest.mark.slow), _gpt2],
                         ids=["llama", "qwen2", "gemma", "gpt2"])
def test_apply_under_bf16_autocast_matches_eager_under_autocast(factory):
    """Two SGD steps under torch.autocast("cpu", bfloat16), on each of eight freshly initialized
    models. At each step the eager and patched fp32 models take the float64 model's current
    weights, and their loss and every gradient are judged against it (the float64 model is never
    autocast). Copying the weights keeps one step's rounding from being amplified into the next.

    The verdict: each gradient's worst RMS error over the sixteen steps, patched against 2x eager's worst
    (memkernels.testing's rule for few-element quantities), and the loss's mean error over the sixteen
    steps against 2x eager's mean (a worst-of-three still failed for Qwen2 in CI: 2.3x). Under bf16 one model's error is set by
    how its weights happen to round: over seeds 0-7 the Llama loss error of eager and of the fused
    gated MLP each ranged 6e-6..1.6e-4, their ratio 0.5..2.7 with a median near 1, the same ratio
    for all steps of one model. So one model says nothing; many do: with three models the mean loss
    ratio of Qwen2 reached 2.10 on an AMD EPYC CPU under this test's seed (at most 1.14 over seeds
    0-3); with eight, 1.39 there and 0.51-1.02 over seeds 0-3 (a model costs ~0.3 s). Gradients
    are compared by RMS error, which separates a correct patch from a wrong one where the max
    error over a few bf16 roundings does not (figures below)."""
    errors, floors, loss_errors = {}, {}, {"eager": [], "patched": []}

    def record(quantity, who, error, floor):
        errors[quantity, who] = max(errors.get((quantity, who), 0.0), error)
        floors[quantity] = max(floors.get(quantity, 0.0), floor)

    eps = torch.finfo(torch.float32).eps
    for _model in range(8):
        reference = factory().double().train()
        eager = copy.deepcopy(reference).float()
        patched = copy.deepcopy(eager)
        apply(patched, measure=False)
        optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
        for _step in range(2):
            with torch.no_grad():
                for model in (eager, patched):
                    for param, param64 in zip(model.parameters(), reference.parameters()):
                        param.copy_(param64)
            ids, labels = _batch()
            losses, grads = {}, {}
            for who, model in (("reference", reference), ("eager", eager), ("patched", patched)):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    losses[who], grads[who] = _loss_and_grads(model, ids, labels)
            global_scale = max(g.abs().max().item() for g in grads["reference"].values())
            for who in ("eager", "patched"):
                loss_errors[who].append((losses[who].double() - losses["reference"]).abs().item())
                record("loss", who, loss_errors[who][-1], 4 * eps * losses["reference"].abs().item())
                for name, g64 in grads["reference"].items():
                    record(name, who, (grads[who][name].double() - g64).pow(2).mean().sqrt().item(),
                           4 * eps * max(g64.abs().max().item(), global_scale * 1e-3))
            optimizer.step()
    for quantity, floor in floors.items():
        eager_error, patched_error = errors[quantity, "eager"], errors[quantity, "patched"]
        # Measured on Llama over seeds 1-8, the worst RMS ratio of a correct patch was 1.00-1.32 (1.58
        # once in 12 test seeds), of one whose gated MLP output is 1% off 1.73-1.97, 3% off above 2: this
        # bf16 test catches errors of a few percent and wrong dtypes; the fp32 parity tests
        # (tests/test_patch.py, test_patch_gated_mlp.py) catch finer ones. By max error the correct and
        # the 1%-off patch overlap (1.21-1.67 against 2.01-3.33).
        bound = 2
        if quantity == "loss":  # one number per step: the mean over the steps (see the docstring)
            eager_error, patched_error = (sum(loss_errors[who]) / len(loss_errors[who]) for who in ("eager", "patched"))
        assert patched_error <= bound * eager_error + floor, (
            f"{quantity}: patched error {patched_error:.3e} > {bound} x eager error {eager_error:.3e} (loss: mean "
        f"over the steps, gradients: worst RMS) "
            f"+ {floor:.1e}")


# ----------------------------------------------------------------------------- Trainer


def _dataset(samples, seed, seq=16):
    ids = torch.randint(0, VOCAB, (samples, seq), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:, :2] = -100
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def _nll_from_logits(prediction):
    """compute_metrics: the next-token NLL read from the logits Trainer.evaluate() collected."""
    logits, labels = prediction.predictions.astype(np.float64)[:, :-1], prediction.label_ids[:, 1:]
    keep = labels != -100
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    picked = np.take_along_axis(log_probs, np.where(keep, labels, 0)[..., None], -1)[..., 0]
    return {"nll_from_logits": float(-picked[keep].mean())}


def _train_and_evaluate(model, tmp_path, name, bf16):
    args = transformers.TrainingArguments(output_dir=str(tmp_path / name), max_steps=2, use_cpu=True,
                                          report_to="none", bf16=bf16, logging_steps=1, disable_tqdm=True)
    trainer = transformers.Trainer(model, args, train_dataset=_dataset(8, 0), eval_dataset=_dataset(4, 1),
                                   compute_metrics=_nll_from_logits)
    trainer.train()
    metrics = trainer.evaluate()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 2
    return losses, metrics


def _trainer_case(family, bf16, lora, tmp_path):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    if lora:
        model = _lora(model, "all-linear")
    patched = copy.deepcopy(model)
    report = apply(patched, measure=False)
    assert any(r["before"] == family for r in report.replaced), report.summary()  # the fused loss is in
    losses, metrics = _train_and_evaluate(model, tmp_path, "unpatched", bf16)
    losses_p, metrics_p = _train_and_evaluate(patched, tmp_path, "patched", bf16)
    tolerance = dict(rtol=2.0 ** -8, atol=0.0) if bf16 else {}
    torch.testing.assert_close(torch.tensor(losses_p), torch.tensor(losses), **tolerance)
    torch.testing.assert_close(torch.tensor(metrics_p["eval_loss"]), torch.tensor(metrics["eval_loss"]), **tolerance)
    # compute_metrics got the logits, and they are the ones the loss came from
    for got in (metrics, metrics_p):
        torch.testing.assert_close(torch.tensor(got["eval_nll_from_logits"]), torch.tensor(got["eval_loss"]),
                                   rtol=1e-5, atol=0.0)


# Every dtype x LoRA combination on the families of QUICK; one case per other family, the path that is the
# family's own: its fused head under Trainer's bf16 autocast with LoRA adapters around it. Its other three
# cases add no path: the head's float32 loss and gradients are test_every_head_gives_the_unpatched_loss_and_
# gradients', and float32 or LoRA under Trainer do not depend on the family (the QUICK families' cases).
_FULL_MATRIX_FAMILIES = {family for family, _, _ in QUICK}
TRAINER_MATRIX = [pytest.param(family, bf16, lora, marks=() if (family, bf16, lora) in QUICK else pytest.mark.slow,
                               id=f"{family}-{'bf16' if bf16 else 'fp32'}{'-lora' if lora else ''}")
                  for family in sorted(FAMILIES) for bf16 in (False, True) for lora in (False, True)
                  if family in _FULL_MATRIX_FAMILIES or (bf16 and lora)]


@pytest.mark.parametrize("family, bf16, lora", TRAINER_MATRIX)
def test_trainer_trains_and_evaluates_like_the_unpatched_model(family, bf16, lora, tmp_path):
    """Trainer at its defaults (remove_unused_columns=True inspects forward's signature) for 2 steps,
    then evaluate() with a compute_metrics that reads the logits."""
    _trainer_case(family, bf16, lora, tmp_path)


# ----------------------------------------------------------------------------- TRL


def _word_level_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"t{i}": i for i in range(VOCAB)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t1"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", eos_token="t2",
                                                unk_token="t1")


def test_sft_trainer_trains_and_the_report_says_it_does_not_use_the_fused_loss(tmp_path, monkeypatch):
    """TRL's SFTTrainer swaps model.forward for its own chunked LM-head loss: memkernels' loss is
    never called (counted), the run matches the unpatched one, and apply()'s report says so."""
    trl = pytest.importorskip("trl")
    calls = []
    count_calls = loss_rule.CausalLMLoss.forward

    def counting(self, *args, **kwargs):
        calls.append(1)
        return count_calls(self, *args, **kwargs)

    monkeypatch.setattr(loss_rule.CausalLMLoss, "forward", counting)
    ids = torch.randint(3, VOCAB, (8, 16), generator=torch.Generator().manual_seed(0))
    dataset = datasets.Dataset.from_dict({"input_ids": ids.tolist()})
    losses = {}
    for patched in (False, True):
        torch.manual_seed(0)
        model = _llama()
        if patched:
            # The loss alone: with the norms and MLPs fused too, the two runs would differ by their float32
            # roundings (3.6e-6 of the loss on an AMD EPYC CPU, more than assert_close's default allows), where
            # this test's question is only whether SFTTrainer's steps call the fused loss. Bypassed, it leaves
            # the run bit for bit the unpatched one.
            report = apply(model, norms=False, mlp=False, rope=False, measure=False)
            model.train()
            model(input_ids=ids[:1], labels=ids[:1])  # outside TRL the counter sees the fused loss
            assert len(calls) == 1
        args = trl.SFTConfig(output_dir=str(tmp_path / str(patched)), max_steps=2, use_cpu=True, report_to="none",
                             logging_steps=1, disable_tqdm=True)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dataset,
                                 processing_class=_word_level_tokenizer())
        trainer.train()
        losses[patched] = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(calls) == 1  # none during SFTTrainer's steps
    assert "do NOT use it" in report.summary() and "patch_trainer(trainer)" in report.summary()
    assert len(losses[True]) == 2
    assert losses[True] == losses[False]
