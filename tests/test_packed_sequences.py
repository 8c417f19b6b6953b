"""Padding-free packed sequences (issue 37 point 3): transformers' DataCollatorWithFlattening puts a
whole mini-batch in one row, position_ids restart at 0 for every sequence and the labels carry a -100
at each sequence's first token. A model patched by memkernels.apply() must give the unpatched model's
loss and gradients there, and under Trainer with gradient accumulation the loss must be normalized by
Trainer's num_items_in_batch (the labelled tokens of the whole optimizer step), as Hugging Face's is.

Attention: "sdpa" (and "eager" in the one-batch test), fp32 on the CPU; flash-attention is not
available there. In transformers 5.x both build the block-diagonal causal mask from position_ids
(masking_utils.find_packed_sequence_indices), but only when no attention_mask is given and there is
no cache: a direct call must pass use_cache=False (with the config's default use_cache=True the
model builds a DynamicCache, skips the packing check and lets the packed sequences attend to each
other, patched or not: the loss then differs from the per-sequence losses, an effect outside
memkernels). Trainer sets config.use_cache = TrainingArguments.use_cache (False by default).

Tolerances are tests/test_apply_training.py's: one batch against the float64 model (the patched
error at most 2x the unpatched one's, plus a floor of a few fp32 roundings), Trainer runs patched
against unpatched at torch.testing's float32 tolerance.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from memkernels.fusions.apply import apply  # noqa: E402
from memkernels.fusions.loss import rule as loss_rule  # noqa: E402
from test_patch import VOCAB, _assert_parity, _gemma, _llama, _loss_and_grads, _qwen2  # noqa: E402

FAMILIES = {"llama": _llama, "qwen2": _qwen2, "gemma": _gemma}
LENGTHS = (7, 3, 12, 5, 9, 4, 15, 6)  # uneven, so that a mean of per-micro-batch means would differ


def _build(family, attn="sdpa"):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    model.set_attn_implementation(attn)
    return model.train()


def _features(lengths, seed, prompt=2):
    """One feature per sequence; its first ``prompt`` labels masked as an SFT prompt would be."""
    generator = torch.Generator().manual_seed(seed)
    features = []
    for n in lengths:
        ids = torch.randint(1, VOCAB, (n,), generator=generator).tolist()
        features.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return features


def _assert_packed(batch, lengths):
    """One row; position_ids restart at 0 where each sequence starts; a -100 label there."""
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])
    position_ids, labels = batch["position_ids"], batch["labels"]
    assert batch["input_ids"].shape == position_ids.shape == labels.shape == (1, sum(lengths))
    assert "attention_mask" not in batch
    assert (position_ids[0] == 0).nonzero().flatten().tolist() == starts.tolist()
    assert len(starts) > 1  # restarts mid-row
    assert (labels[0, starts] == -100).all()


def _per_sequence_nll(model, features):
    """Summed next-token NLL and the number of scored tokens, each sequence run alone (unpacked)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for feature in features:
            ids, labels = torch.tensor([feature["input_ids"]]), torch.tensor([feature["labels"]])
            scored = int((labels[:, 1:] != -100).sum())
            total += model(input_ids=ids, labels=labels, use_cache=False).loss.double().item() * scored
            count += scored
    return total, count


@pytest.fixture
def loss_calls(monkeypatch):
    """Each call of memkernels' fused loss: (targets, num_items_in_batch)."""
    calls = []
    forward = loss_rule.CausalLMLoss.forward

    def counting(self, hidden, weight, targets, bias=None, softcap=None, num_items_in_batch=None):
        calls.append((targets.detach().clone(), num_items_in_batch))
        return forward(self, hidden, weight, targets, bias, softcap, num_items_in_batch)

    monkeypatch.setattr(loss_rule.CausalLMLoss, "forward", counting)
    return calls


# ----------------------------------------------------------------------------- one packed batch


@pytest.mark.parametrize("family, attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"),
                                          ("gemma", "sdpa")])
def test_one_packed_batch_gives_the_unpatched_loss_and_gradients(family, attn, loss_calls):
    model = _build(family, attn)
    patched = copy.deepcopy(model)
    report = apply(patched, measure=False)
    assert any(r["after"].startswith("Memkernels") and r["after"].endswith("ForCausalLM") for r in report.replaced)
    lengths = LENGTHS[:5]
    features = _features(lengths, seed=1)
    batch = transformers.DataCollatorWithFlattening()(features)
    _assert_packed(batch, lengths)
    ids, labels, kwargs = batch["input_ids"], batch["labels"], {"position_ids": batch["position_ids"]}

    reference = copy.deepcopy(model).double()
    loss64, grads64 = _loss_and_grads(reference, ids, labels, **kwargs)
    loss32, grads32 = _loss_and_grads(model, ids, labels, **kwargs)
    loss_p, grads_p = _loss_and_grads(patched, ids, labels, **kwargs)
    # the fused loss ran, once, on the packed labels shifted within the row: each sequence's last
    # position targets the next one's -100 separator
    [(targets, num_items)] = loss_calls
    assert num_items is None
    torch.testing.assert_close(targets, torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:])
    _assert_parity(loss64.reshape(1), loss32.reshape(1), loss_p.reshape(1), "loss")
    assert set(grads_p) == set(grads32) == set(grads64)
    global_scale = max(g.abs().max().item() for g in grads64.values())
    for name, g64 in grads64.items():
        _assert_parity(g64, grads32[name], grads_p[name], name, scale=max(g64.abs().max().item(), global_scale * 1e-3))

    # The packing isolated the sequences: the packed loss is the token-weighted mean of each sequence's
    # loss run alone, to a few fp32 roundings (Hugging Face's loss upcasts logits with .float(), so even
    # the float64 model's loss is a float32 one). Attention across the sequences moved it by ~1e-3 here.
    total, count = _per_sequence_nll(reference, features)
    torch.testing.assert_close(loss64.item(), total / count, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(loss_p.double().item(), total / count, rtol=1e-5, atol=0.0)


# ----------------------------------------------------------------------------- Trainer


def _train(model, tmp_path, name, collator):
    dataset = datasets.Dataset.from_list(_features(LENGTHS * 2, seed=2))
    args = transformers.TrainingArguments(output_dir=str(tmp_path / name), max_steps=2, use_cpu=True,
                                          per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                          optim="sgd", learning_rate=0.5, report_to="none", logging_steps=1,
                                          disable_tqdm=True, save_strategy="no")
    trainer = transformers.Trainer(model, args, train_dataset=dataset, data_collator=collator)
    trainer.train()
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


class _RecordingCollator(transformers.DataCollatorWithFlattening):
    """DataCollatorWithFlattening that keeps every (features, batch) it made, in order."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __call__(self, features, *args, **kwargs):
        batch = super().__call__(features, *args, **kwargs)
        self.made.append((features, batch))
        return batch


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_trainer_with_flattening_and_gradient_accumulation_matches_the_unpatched_model(family, tmp_path,
                                                                                       loss_calls):
    """2 optimizer steps of 2 micro-batches of 4 packed sequences each (SGD, so that parameters follow
    the gradients linearly: AdamW would turn rounding-level gradient differences into update signs)."""
    model = _build(family)
    initial = copy.deepcopy(model)
    patched = copy.deepcopy(model)
    apply(patched, measure=False)
    collators = {"unpatched": _RecordingCollator(), "patched": _RecordingCollator()}
    losses = _train(model, tmp_path, "unpatched", collators["unpatched"])
    assert not loss_calls
    losses_p = _train(patched, tmp_path, "patched", collators["patched"])
    assert len(losses) == len(losses_p) == 2

    made = collators["patched"].made
    assert len(made) == 4  # 2 steps x 2 micro-batches, each packed
    for (features, batch), (features_u, batch_u) in zip(made, collators["unpatched"].made):
        assert features == features_u  # both runs saw the same batches
        _assert_packed(batch, [len(f["input_ids"]) for f in features])
    # The fused loss ran on every micro-batch with Trainer's count of the whole step's labelled tokens.
    assert len(loss_calls) == 4
    for step in range(2):
        step_items = sum(int((batch["labels"][:, 1:] != -100).sum()) for _, batch in made[2 * step:2 * step + 2])
        assert [int(n) for _, n in loss_calls[2 * step:2 * step + 2]] == [step_items] * 2
    counts = [int((batch["labels"][:, 1:] != -100).sum()) for _, batch in made]
    assert counts[0] != counts[1]  # so that the normalization is tested: a mean of means would differ

    torch.testing.assert_close(torch.tensor(losses_p), torch.tensor(losses))
    changed = 0
    for (name, p), p_u, p0 in zip(patched.named_parameters(), model.parameters(), initial.parameters()):
        torch.testing.assert_close(p, p_u, msg=lambda m: f"{name}: {m}")
        changed += not torch.equal(p, p0)
    assert changed > len(list(initial.parameters())) // 2  # it trained

    # num_items_in_batch normalization across the accumulation: the first logged loss is the first
    # step's summed NLL over both micro-batches divided by their labelled tokens, each sequence run
    # alone through the initial model (not the mean of the two micro-batches' means).
    sums = [_per_sequence_nll(initial, features) for features, _ in made[:2]]
    assert [n for _, n in sums] == counts[:2]
    token_weighted = sum(s for s, _ in sums) / sum(counts[:2])
    mean_of_means = sum(s / n for s, n in sums) / 2
    rtol = 1e-5
    torch.testing.assert_close(losses_p[0], token_weighted, rtol=rtol, atol=0.0)
    assert abs(mean_of_means - token_weighted) > 10 * rtol * token_weighted  # the check tells the two apart
