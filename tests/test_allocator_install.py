"""install(): the thin glue between memkernels' pool and torch's CUDAPluggableAllocator.

Without a GPU only the parts before torch takes over can run: the refusals, and that torch is
handed the right library and symbols (checked with stand-ins for torch's two calls, and by
resolving the symbols with ctypes as torch's dlopen would). The entry points themselves are
tested on the simulated device in tests/test_device_pool.py. Nothing here has run on a GPU.
"""
import ctypes

import pytest
import torch

from memkernels import _C, allocator


def test_install_refuses_a_torch_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(RuntimeError, match="build without CUDA"):
        allocator.install()


def test_install_refuses_once_cuda_is_initialized(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="must run before the first CUDA allocation"):
        allocator.install()


def test_install_hands_torch_the_pool_entry_points(monkeypatch):
    handed = {}

    class FakePluggableAllocator:
        def __init__(self, path, alloc_name, free_name):
            handed.update(path=path, alloc=alloc_name, free=free_name)

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda.memory, "CUDAPluggableAllocator", FakePluggableAllocator)
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator", lambda a: handed.update(current=a))
    pool = allocator.install(memory_cap_bytes=1 << 30)
    assert handed["path"] == _C.__file__ and isinstance(handed["current"], FakePluggableAllocator)
    assert allocator._plugin is handed["current"]  # torch keeps only a raw pointer: we hold the object
    assert _C.installed_device_pool() is not None and pool.stats()["memory_cap"] == 1 << 30
    library = ctypes.CDLL(handed["path"])
    assert getattr(library, handed["alloc"]) and getattr(library, handed["free"])
    with pytest.raises(TypeError, match="unknown allocator option"):
        allocator.install(cap=3)


def test_install_with_expandable_segments(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda.memory, "CUDAPluggableAllocator", lambda *names: names)
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator", lambda a: None)
    allocator.install(expandable_segments=True)
    assert _C.installed_device_pool() is not None
    with pytest.raises(TypeError, match="unknown allocator option"):
        allocator.install(expandable_segment=True)
