"""Integrations with training frameworks; each imports its framework only when used.

- :class:`MemoryCallback` (``memkernels.integrations.hf``): :class:`memkernels.MemoryMonitor`
  as a Hugging Face ``transformers.TrainerCallback``.
- ``memkernels.integrations.trl``: :func:`~memkernels.integrations.trl.patch_trainer` makes TRL's
  trainers (GRPO, RLOO, SFT, DPO, KTO) score tokens with ``memkernels.functional.linear_logprobs``.
"""

__all__ = ["MemoryCallback", "trl"]


def __getattr__(name):
    if name == "MemoryCallback":  # imports transformers: only when asked for
        from memkernels.integrations.hf import MemoryCallback

        return MemoryCallback
    if name == "trl":  # imports trl: only when asked for
        import importlib

        return importlib.import_module("memkernels.integrations.trl")
    raise AttributeError(f"module 'memkernels.integrations' has no attribute {name!r}")
