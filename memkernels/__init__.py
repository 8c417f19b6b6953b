"""memkernels: train larger models on the GPUs you have.

Fused Triton kernels that save less for backward, a caching pool allocator
with the statistics PyTorch loses under a pluggable allocator, asynchronous
activation offload, and tools that measure before you optimize.

Importing memkernels is cheap: torch, triton and the C++ core load on first use.
"""
import importlib

from memkernels._backend import get_backend, set_backend

__version__ = "0.1.0"

# public name -> module that defines it; resolved on first attribute access.
_LAZY = {
    "OffloadActivations": "memkernels.runtime.offload",
    "no_offload": "memkernels.runtime.offload",
    "offload_checkpoints": "memkernels.runtime.offload",
    "FusedRMSNorm": "memkernels.nn",
    "FusedLayerNorm": "memkernels.nn",
    "FusedAddRMSNorm": "memkernels.nn",
    "FusedAddLayerNorm": "memkernels.nn",
    "FusedDyT": "memkernels.nn",
    "GeLULinear": "memkernels.nn",
    "FusedMLP": "memkernels.nn",
    "FusedGatedMLP": "memkernels.nn",
    "ChunkedCrossEntropyLoss": "memkernels.nn",
    "LinearCrossEntropyLoss": "memkernels.nn",
    "apply": "memkernels.planning.apply_plan",  # kernels (memkernels.fusions.apply.apply), or a plan carried out
    "activation_ledger": "memkernels.runtime.ledger",
    "memory_summary": "memkernels.runtime.allocator",
    "evaluate": "memkernels.planning.evaluate",
    "MemoryMonitor": "memkernels.forensics.monitor",
    "explain": "memkernels.forensics.explain",
    "plan": "memkernels.planning.plan",
    "estimate": "memkernels.planning.estimate",
}


# public modules, imported on first attribute access too (``memkernels.device.use_sim()`` after ``import memkernels``)
_MODULES = ("allocator", "offload", "device", "meters", "functional", "nn", "integrations")


def __getattr__(name):
    if name in _MODULES:
        value = importlib.import_module(f"memkernels.{name}")
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memkernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_MODULES))


__all__ = ["get_backend", "set_backend", "__version__"] + sorted(_LAZY)
