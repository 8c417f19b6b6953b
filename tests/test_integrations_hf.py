"""memkernels.integrations.MemoryCallback inside a real transformers.Trainer (CPU, tiny Llama from a config)."""
import csv

import pytest
import torch

transformers = pytest.importorskip("transformers")

from memkernels.forensics.monitor import COLUMNS, MemoryMonitor  # noqa: E402
from memkernels.integrations import MemoryCallback  # noqa: E402

STEPS = 3


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _event_tags(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {tag: [e.step for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_callback_logs_the_monitors_scalars_for_each_trainer_step(tmp_path):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    # source="cpu": "auto" would pick a memkernels pool another test in this process installed
    callback = MemoryCallback(csv=str(tmp_path / "memory.csv"), log_dir=str(tmp_path / "tb"), source="cpu")
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=STEPS,
                                          per_device_train_batch_size=2, report_to="none", use_cpu=True,
                                          save_strategy="no", logging_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(8, 16, 128), callbacks=[callback])
    trainer.train()

    rows = callback.monitor.rows
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # state.global_step after each step
    for row in rows:
        assert row["source"] == "cpu" and row["peak_allocated_bytes"] > 0
        # The Trainer's model and optimizer gave the phases (its optimizer is accelerate's wrapper).
        for phase in ("forward", "backward", "optimizer"):
            assert 0 < row[f"peak_{phase}_bytes"] <= row["peak_allocated_bytes"]
    assert [list(r) for r in csv.DictReader(open(tmp_path / "memory.csv"))][0] == list(COLUMNS)

    # The same scalars a MemoryMonitor writes for a CPU run, at the Trainer's step numbers.
    with MemoryMonitor(source="cpu", log_dir=str(tmp_path / "plain"), model=model,
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as monitor:
        model(torch.zeros(1, 4, dtype=torch.long)).logits.sum().backward()
        monitor.optimizer.step()
        monitor.step()
    tags = _event_tags(tmp_path / "tb")
    assert set(tags) == set(_event_tags(tmp_path / "plain"))
    assert all(steps == list(range(1, STEPS + 1)) for steps in tags.values())
    # Training over: hooks removed, the CPU meter's dispatch mode closed.
    assert not model._forward_pre_hooks and not model._forward_hooks
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    assert not _get_current_dispatch_mode_stack()


def test_the_trainer_provides_model_and_optimizer():
    with pytest.raises(ValueError, match="the Trainer provides the model"):
        MemoryCallback(model=torch.nn.Linear(2, 2))
