"""memkernels.integrations.trl: TRL's trainers scoring tokens with linear_logprobs (CPU, tiny Llama from a config).

Each trainer trains twice from the same seed and the same weights: as TRL ships (its chunked kernel), and
with ``memkernels.apply(model)`` plus ``patch_trainer(trainer)``. Losses, logged metrics and parameter updates
agree at torch.testing's float32 tolerance (float32 runs: the TRL configs' default ``bf16=True`` would autocast
on the CPU). Plain SGD, so a parameter's update is the learning rate times its gradient. ``counts`` shows
which kernel scored the tokens.
"""
import copy
import types

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
tokenizers = pytest.importorskip("tokenizers")

from memkernels import apply  # noqa: E402
from memkernels.integrations import trl as mk_trl  # noqa: E402

VOCAB = 160
STEPS = 3


def _llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0, bos_token_id=None, eos_token_id=2)
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny Llama saved to disk: GRPO and DPO build their reference model from the policy's path."""
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    _llama().save_pretrained(path)
    return str(path)


def _tokenizer():
    vocab = {f"t{i}": i for i in range(VOCAB)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t1"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", eos_token="t2",
                                                unk_token="t1")


def _words(generator, n):
    return " ".join(f"t{i}" for i in torch.randint(3, VOCAB, (n,), generator=generator).tolist())


def _config(cls, tmp_path, name, **options):
    return cls(output_dir=str(tmp_path / name), max_steps=STEPS, use_cpu=True, report_to="none", logging_steps=1,
               disable_tqdm=True, save_strategy="no", seed=0, bf16=False, optim="sgd", learning_rate=0.5, **options)


def _train(trainer, model, patched):
    """Train; (log rows of the steps, each parameter's update)."""
    if patched:
        assert mk_trl.patch_trainer(trainer) is trainer
        mk_trl.patch_trainer(trainer)  # a second call changes nothing
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert len(rows) == STEPS
    return rows, {name: p.detach() - before[name] for name, p in model.named_parameters()}


def _assert_same_run(run, patched_run, metrics):
    (rows, updates), (rows_p, updates_p) = run, patched_run
    for key in ("loss", *metrics):
        torch.testing.assert_close(torch.tensor([r[key] for r in rows_p]), torch.tensor([r[key] for r in rows]),
                                   msg=lambda m, key=key: f"{key}: {m}")
    assert updates_p.keys() == updates.keys()
    for name in updates:
        assert updates[name].abs().max() > 0, name  # every parameter trained
        torch.testing.assert_close(updates_p[name], updates[name], msg=lambda m, name=name: f"{name}: {m}")


def _counted(fn):
    """fn()'s result and the kernel calls it made, by path (mk_trl.counts' increase; paths not taken left out)."""
    before = dict(mk_trl.counts)
    result = fn()
    return result, {key: n - before.get(key, 0) for key, n in mk_trl.counts.items() if n != before.get(key, 0)}


# ----------------------------------------------------------------------------- the kernel


def _with_trl_head(model, **options):
    trl.trainer.utils.add_fused_lm_head(model, **options)
    return model


def test_fused_head_gives_trls_outputs_and_gradients_with_bias_softcap_scale_and_temperature():
    """TRL's fused forward on the same model, scored by TRL's kernel and by linear_logprobs: every output field
    and every gradient (a head bias, a softcap, a logit scale, a temperature, ignored labels)."""
    torch.manual_seed(0)
    model = _llama()
    model.lm_head = nn.Linear(64, VOCAB, bias=True)
    model.config.final_logit_softcapping = 3.0  # TRL reads both from any config
    model.config.logit_scale = 0.5
    outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    theirs = _with_trl_head(copy.deepcopy(model), temperature=0.7, outputs=outputs)
    ours = _with_trl_head(copy.deepcopy(model), temperature=0.7, outputs=outputs)
    mk_trl.patch_trainer(types.SimpleNamespace(model=ours))

    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :4] = -100
    labels[2, 8:] = -100

    def score(m):
        out = m(input_ids=ids, labels=labels, fused_lm_head=True)
        (out.loss + 0.1 * out.entropy.sum()).backward()
        return out

    expected, calls = _counted(lambda: score(theirs))
    assert not calls  # a model patch_trainer did not see keeps TRL's kernel
    got, calls = _counted(lambda: score(ours))
    assert calls == {"linear_logprobs": 1}  # the metrics come from the same pass (return_metrics)

    for field in ("loss", *outputs, "label_mask"):
        torch.testing.assert_close(getattr(got, field), getattr(expected, field), msg=lambda m, f=field: f"{f}: {m}")
    assert got.is_top1.dtype == torch.bool and got.log_probs.dtype == torch.float32
    assert (got.log_probs[labels[:, 1:] == -100] == 0).all()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")

    # unpatch_trainer: TRL's kernel again
    mk_trl.unpatch_trainer(types.SimpleNamespace(model=ours))
    _, calls = _counted(lambda: ours(input_ids=ids, labels=labels, fused_lm_head=True))
    assert not calls


def test_under_bf16_autocast_the_error_is_trls():
    """Under torch.autocast (the TRL configs' default bf16=True): both kernels project in bfloat16, as TRL's does;
    the outputs agree to a bfloat16 rounding and each gradient errs, against float64, at most 2x what TRL's kernel
    errs (plus a floor of a few bfloat16 roundings)."""
    torch.manual_seed(0)
    model = _llama()
    outputs = ("log_probs", "entropy", "is_top1")
    theirs = _with_trl_head(copy.deepcopy(model), temperature=0.7, outputs=outputs)
    ours = _with_trl_head(copy.deepcopy(model), temperature=0.7, outputs=outputs)
    exact = _with_trl_head(copy.deepcopy(model).double(), temperature=0.7, outputs=outputs)
    mk_trl.patch_trainer(types.SimpleNamespace(model=ours))
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
    results = []
    for m, autocast in ((theirs, True), (ours, True), (exact, False)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = m(input_ids=ids, labels=ids, fused_lm_head=True)
        (out.loss + 0.1 * out.entropy.sum()).backward()
        results.append((out, {name: p.grad.double() for name, p in m.named_parameters()}))
    (expected, trl_grads), (got, grads), (_, exact_grads) = results
    for field in ("loss", "log_probs", "entropy"):
        torch.testing.assert_close(getattr(got, field), getattr(expected, field), rtol=2.0 ** -8, atol=2.0 ** -8)
    for name, reference in exact_grads.items():
        scale = reference.abs().max()
        trl_error = (trl_grads[name] - reference).abs().max() / scale
        error = (grads[name] - reference).abs().max() / scale
        assert error <= 2 * trl_error + 4 * 2.0 ** -9, f"{name}: {error:.2e} against TRL's {trl_error:.2e}"


def test_without_fused_lm_head_the_models_own_forward_runs():
    """Generation and logits: a call without fused_lm_head is the model's forward, logits and all."""
    torch.manual_seed(0)
    model = _with_trl_head(_llama(), outputs=("log_probs", "entropy"))
    mk_trl.patch_trainer(types.SimpleNamespace(model=model))
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    out, calls = _counted(lambda: model(input_ids=ids))
    assert out.logits.shape == (1, 6, VOCAB) and not calls


# ----------------------------------------------------------------------------- trainers


def _grpo_run(llama_dir, tmp_path, patched):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(llama_dir)
    if patched:
        apply(model, measure=False)
    generator = torch.Generator().manual_seed(0)
    dataset = datasets.Dataset.from_dict({"prompt": [_words(generator, 4) for _ in range(4)]})

    def reward(completions, completion_ids, **kwargs):  # the completion's tokens below 40
        return [float(sum(token < 40 for token in ids)) for ids in completion_ids]

    # beta > 0: a reference model (scored too); entropy_coef: the entropy's gradient is in the loss
    args = _config(trl.GRPOConfig, tmp_path, f"grpo-{patched}", per_device_train_batch_size=4, num_generations=2,
                   max_completion_length=8, temperature=0.7, beta=0.1, entropy_coef=0.01)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                              processing_class=_tokenizer())
    return _counted(lambda: _train(trainer, model, patched))


def test_grpo_trains_like_trls_own_kernel(llama_dir, tmp_path):
    """GRPO, 3 steps of 2 prompts x 2 completions of 8 tokens: policy log-probs and entropies (the loss, the
    entropy bonus and metric) and the reference's log-probs (the KL) through linear_logprobs."""
    run, calls = _grpo_run(llama_dir, tmp_path, patched=False)
    assert not calls
    patched_run, calls = _grpo_run(llama_dir, tmp_path, patched=True)
    assert calls == {"linear_logprobs": 2 * STEPS}  # policy and reference, each step
    assert max(row["reward_std"] for row in run[0]) > 0 and max(row["kl"] for row in run[0]) > 0  # a real signal
    _assert_same_run(run, patched_run, ("entropy", "kl", "reward", "grad_norm"))


def _sft_run(llama_dir, tmp_path, patched):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(llama_dir)
    if patched:
        apply(model, measure=False)
    generator = torch.Generator().manual_seed(0)
    dataset = datasets.Dataset.from_dict({"text": [_words(generator, 12) for _ in range(6)]})
    args = _config(trl.SFTConfig, tmp_path, f"sft-{patched}", per_device_train_batch_size=2)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=_tokenizer())
    return _counted(lambda: _train(trainer, model, patched))


def test_sft_loss_entropy_and_token_accuracy_match_trls(llama_dir, tmp_path):
    """SFTTrainer: the loss, the entropy metric and mean_token_accuracy (is_top1) through linear_logprobs, in one
    pass over the head."""
    run, calls = _sft_run(llama_dir, tmp_path, patched=False)
    assert not calls
    patched_run, calls = _sft_run(llama_dir, tmp_path, patched=True)
    assert calls == {"linear_logprobs": STEPS}
    _assert_same_run(run, patched_run, ("entropy", "mean_token_accuracy", "grad_norm"))


def _dpo_run(llama_dir, tmp_path, patched):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(llama_dir)
    if patched:
        apply(model, measure=False)
    generator = torch.Generator().manual_seed(0)
    dataset = datasets.Dataset.from_dict({"prompt": [_words(generator, 4) for _ in range(6)],
                                          "chosen": [_words(generator, 5) for _ in range(6)],
                                          "rejected": [_words(generator, 3) for _ in range(6)]})
    args = _config(trl.DPOConfig, tmp_path, f"dpo-{patched}", per_device_train_batch_size=2)
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=_tokenizer())
    return _counted(lambda: _train(trainer, model, patched))


def test_dpo_chosen_and_rejected_logps_match_trls(llama_dir, tmp_path):
    """DPOTrainer: chosen/rejected log-probs of the policy and the reference, the logits/* and mean_token_accuracy
    metrics, all through linear_logprobs."""
    run, calls = _dpo_run(llama_dir, tmp_path, patched=False)
    assert not calls
    patched_run, calls = _dpo_run(llama_dir, tmp_path, patched=True)
    assert calls == {"linear_logprobs": 2 * STEPS}
    _assert_same_run(run, patched_run, ("logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected",
                                        "rewards/margins", "entropy", "logits/chosen", "logits/rejected",
                                        "mean_token_accuracy", "grad_norm"))


def _rl_run(kind, llama_dir, tmp_path, patched):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(llama_dir)
    if patched:
        apply(model, measure=False)
    generator = torch.Generator().manual_seed(0)
    if kind == "rloo":
        dataset = datasets.Dataset.from_dict({"prompt": [_words(generator, 4) for _ in range(4)]})

        def reward(completions, completion_ids, **kwargs):
            return [float(sum(token < 40 for token in ids)) for ids in completion_ids]

        args = _config(trl.RLOOConfig, tmp_path, f"rloo-{patched}", per_device_train_batch_size=4, num_generations=2,
                       max_completion_length=8, beta=0.1)
        trainer = trl.RLOOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                                  processing_class=_tokenizer())
    else:
        dataset = datasets.Dataset.from_dict({"prompt": [_words(generator, 4) for _ in range(6)],
                                              "completion": [_words(generator, 4) for _ in range(6)],
                                              "label": [True, False] * 3})
        args = _config(trl.KTOConfig, tmp_path, f"kto-{patched}", per_device_train_batch_size=2)
        trainer = trl.KTOTrainer(model=model, args=args, train_dataset=dataset, processing_class=_tokenizer())
    return _counted(lambda: _train(trainer, model, patched))


@pytest.mark.parametrize("kind", ["rloo", "kto"])
def test_rloo_and_kto_train_like_trls_own_kernel(kind, llama_dir, tmp_path):
    """The other trainers on add_fused_lm_head: every float metric they log, and the updates."""
    run, calls = _rl_run(kind, llama_dir, tmp_path, patched=False)
    assert not calls
    patched_run, calls = _rl_run(kind, llama_dir, tmp_path, patched=True)
    assert calls.get("linear_logprobs", 0) >= 2 * STEPS and "trl_kernel" not in calls  # policy and reference
    metrics = [key for key, value in run[0][0].items()
               if isinstance(value, float) and key not in ("learning_rate", "epoch", "step_time")]
    _assert_same_run(run, patched_run, metrics)


# ----------------------------------------------------------------------------- what it refuses


class _OtherKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature):  # not TRL 1.16's signature
        return hidden


def test_a_trl_whose_kernel_differs_is_refused_with_its_version(monkeypatch):
    torch.manual_seed(0)
    trainer = types.SimpleNamespace(model=_with_trl_head(_llama()))
    supported = f"supports TRL {mk_trl.SUPPORTED_TRL}.x"
    installed = f"the installed TRL is {trl.__version__}"
    with monkeypatch.context() as m:
        m.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", _OtherKernel)
        with pytest.raises(mk_trl.UnsupportedTRL, match="ChunkedLogProbFunction.forward takes") as error:
            mk_trl.patch_trainer(trainer)
        assert supported in str(error.value) and installed in str(error.value)
        assert trl.trainer.utils._ChunkedLogProbFunction is _OtherKernel  # nothing changed
    with monkeypatch.context() as m:
        m.delattr(trl.trainer.utils, "add_fused_lm_head")
        with pytest.raises(mk_trl.UnsupportedTRL, match="has no add_fused_lm_head"):
            mk_trl.patch_trainer(trainer)


def test_a_model_without_trls_fused_forward_or_a_linear_head_is_refused():
    torch.manual_seed(0)
    with pytest.raises(mk_trl.UnsupportedTRL, match="has no forward from trl.trainer.utils.add_fused_lm_head"):
        mk_trl.patch_trainer(types.SimpleNamespace(model=_llama()))

    class Head(nn.Module):  # a head that is not an nn.Linear
        def __init__(self, weight):
            super().__init__()
            self.weight, self.bias = weight, None

        def forward(self, x):
            return x @ self.weight.T

    model = _with_trl_head(_llama())
    model.lm_head = Head(model.lm_head.weight)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="not an nn.Linear"):
        mk_trl.patch_trainer(types.SimpleNamespace(model=model))
    _, calls = _counted(lambda: model(input_ids=ids, labels=ids, fused_lm_head=True))
    assert not calls  # TRL's kernel still scores it
