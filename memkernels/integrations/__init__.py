"""Integrations with training frameworks; each imports its framework only when used.

- :class:`MemoryCallback` (``memkernels.integrations.hf``): :class:`memkernels.MemoryMonitor`
  as a Hugging Face ``transformers.TrainerCallback``.
"""

__all__ = ["MemoryCallback"]


def __getattr__(name):
    if name == "MemoryCallback":  # imports transformers: only when asked for
        from memkernels.integrations.hf import MemoryCallback

        return MemoryCallback
    raise AttributeError(f"module 'memkernels.integrations' has no attribute {name!r}")
