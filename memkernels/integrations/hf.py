"""``MemoryCallback``: :class:`memkernels.MemoryMonitor` inside a Hugging Face ``Trainer``.

``transformers`` is imported when this module is, not by ``import memkernels``.

    trainer = Trainer(..., callbacks=[MemoryCallback(csv="memory.csv", log_dir="runs/memory")])

Each optimizer step (``on_step_begin`` .. ``on_step_end``) becomes one monitor row with the same
columns and TensorBoard scalars as the monitor's, numbered by ``state.global_step``; the model
and optimizer the Trainer hands over give the phase peaks. OOM capture is the context
manager's (a callback does not see exceptions); wrap ``trainer.train()`` in a
``MemoryMonitor`` for it. If ``train()`` raises, call :meth:`MemoryCallback.close` (on the
CPU the monitor's meter is a dispatch mode that stays open until then).
"""
from transformers import TrainerCallback

from memkernels.forensics.monitor import MemoryMonitor

__all__ = ["MemoryCallback"]


class MemoryCallback(TrainerCallback):
    """A ``TrainerCallback`` recording memory per step; keyword arguments go to :class:`MemoryMonitor`
    (all but ``model`` and ``optimizer``, which come from the Trainer).

    ``monitor``: the :class:`MemoryMonitor` (``monitor.rows`` holds the rows) once training began.
    """

    def __init__(self, **monitor_options):
        for taken in ("model", "optimizer"):
            if taken in monitor_options:
                raise ValueError(f"MemoryCallback({taken}=...): the Trainer provides the {taken}; leave it out")
        self.monitor_options = monitor_options
        self.monitor = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.close()
        self.monitor = MemoryMonitor(model=model, optimizer=optimizer, **self.monitor_options).__enter__()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.begin_step()

    def on_step_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.step(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self):
        """End the monitor: hooks removed, files closed, PNG written."""
        if self.monitor is not None:
            self.monitor.close()
