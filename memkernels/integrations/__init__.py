"""Integrations with training frameworks; each imports its framework only when used.

- :class:`MemoryCallback` (``memkernels.integrations.hf``): :class:`memkernels.MemoryMonitor`
  as a Hugging Face ``transformers.TrainerCallback``.
"""
import importlib

_LAZY = {"MemoryCallback": "memkernels.integrations.hf"}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memkernels.integrations' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = sorted(_LAZY)
