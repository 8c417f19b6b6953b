"""install(): the thin glue between memkernels' pool and torch's CUDAPluggableAllocator.

Without a GPU only the parts before torch takes over can run: the refusals, and that torch is
handed the right library and symbols (checked with stand-ins for torch's two calls, and by
resolving the symbols with ctypes as torch's dlopen would). The entry points themselves are
tested on the simulated device in tests/test_device_pool.py. Nothing here has run on a GPU.
"""
import ctypes
import os

import pytest
import torch

import pluggable_standin
from conftest import SIM_SYNC_TIMEOUT_S
from memkernels import _C, allocator


@pytest.fixture(autouse=True)
def process_state(monkeypatch):
    """What install() changes for the whole process, put back after each test."""
    monkeypatch.setattr(allocator, "_plugin", allocator._plugin)
    monkeypatch.setattr(torch.Tensor, "record_stream", torch.Tensor.record_stream)
    monkeypatch.delenv(allocator.NCCL_AVOID_RECORD_STREAMS, raising=False)
    monkeypatch.setattr(allocator, "_step_hook", None)
    yield
    if allocator._step_hook is not None:  # the optimizer hook this test's install() registered
        allocator._step_hook.remove()
    _C.forget_torch_out_of_memory_error()


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


def test_install_ends_a_pool_step_at_every_optimizer_step(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda.memory, "CUDAPluggableAllocator", lambda *names: names)
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator", lambda a: None)
    ended = []
    monkeypatch.setattr(allocator, "end_step", lambda: ended.append(True))
    parameter = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    allocator.install()
    allocator.install()  # installed twice: still one hook
    parameter.grad = torch.ones(2)
    optimizer.step()
    optimizer.step()
    assert len(ended) == 2
    allocator._step_hook.remove()
    allocator._step_hook = None
    allocator.install(mark_steps=False)
    optimizer.step()
    assert len(ended) == 2 and allocator._step_hook is None
    with pytest.raises(ValueError, match="mark_steps must be True or False"):
        allocator.install(mark_steps="yes")


# ---------------------------------------------------------------- under install(), with the simulated device

MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture
def installed(monkeypatch, tmp_path_factory):
    """install() with stand-ins for torch's two calls, on the simulated device; the stand-in for
    torch's call path into the pool, linked with torch's own error translation."""
    from memkernels import device
    from memkernels.device import sim

    device.use_sim()
    sim.configure(device_count=2, capacity=256 * MiB, host_capacity=None, granularity=2 * MiB,
                  memory="virtual", address_space=8 * GiB, sync_timeout_s=SIM_SYNC_TIMEOUT_S)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda.memory, "CUDAPluggableAllocator", lambda *names: names)
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator", lambda a: None)
    monkeypatch.setattr(allocator, "_plugin", None)
    standin = pluggable_standin.load(str(tmp_path_factory.mktemp("standin")), torch=True)
    yield standin
    sim.hold_events(False)
    pool = _C.installed_device_pool()
    for d in pool.devices():
        pool.empty_cache(d)
    sim.reset()


def test_out_of_memory_under_install_raises_torch_out_of_memory_error(installed):
    allocator.install()
    assert _C.torch_out_of_memory_error_resolved()
    # the object is libc10's own, in a buffer of TORCH_ERROR_BYTES: it must fit
    assert installed.library.standin_torch_error_size() <= _C.TORCH_ERROR_BYTES
    p = installed.alloc_torch(100 * MiB, 0, None)
    with pytest.raises(torch.OutOfMemoryError) as caught:  # torch's own translation picked the type
        installed.alloc_torch(300 * MiB, 0, None)
    message = str(caught.value)
    for figure in ("memkernels: out of memory on device 0", "tried to allocate 300.00 MiB", "reserved 100.00 MiB",
                   "allocated 100.00 MiB", "largest free block 0 B"):
        assert figure in message, (figure, message)
    assert installed.library.standin_caught_as(300 * MiB, 0, None) == 1  # caught as c10::OutOfMemoryError
    q = installed.alloc_torch(100 * MiB, 0, None)  # the process stays usable
    assert q and q != p
    installed.free(q, 100 * MiB, 0, None)
    installed.free(p, 100 * MiB, 0, None)
    assert allocator.stats(0)["allocation"]["current"] == 0 and allocator.stats(0)["num_ooms"] == 2


def test_out_of_memory_without_torch_type_is_a_runtime_error(installed, monkeypatch):
    allocator.install()
    _C.forget_torch_out_of_memory_error()  # as where libc10 could not be resolved
    with pytest.raises(RuntimeError) as caught:
        installed.alloc_torch(300 * MiB, 0, None)
    assert not isinstance(caught.value, torch.OutOfMemoryError) and allocator.is_out_of_memory(caught.value)
    assert installed.library.standin_caught_as(300 * MiB, 0, None) == 2
    assert not allocator.is_out_of_memory(RuntimeError("CUDA error: an illegal memory access"))
    assert "libc10 is not loaded" in _C.use_torch_out_of_memory_error("/nonexistent/libc10.so")
    assert not _C.torch_out_of_memory_error_resolved()
    monkeypatch.setattr(_C, "use_torch_out_of_memory_error", lambda path: "libc10 is not loaded from " + path)
    with pytest.warns(RuntimeWarning, match="raises RuntimeError instead of torch.OutOfMemoryError"):
        allocator.install()


def test_evaluate_measures_with_the_pool_statistics_when_installed(installed, monkeypatch):
    from memkernels.planning import evaluate as evaluation

    allocator.install()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    # torch.cuda.memory_allocated() and friends raise under a pluggable allocator
    for name in ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, name=name: pytest.fail(f"torch.cuda.{name} called"))
    keep = installed.alloc_torch(4 * MiB, 0, None)

    def step(n):
        pointers = [installed.alloc_torch(n * MiB, 0, None) for _ in range(3)]
        for p in pointers:
            installed.free(p, n * MiB, 0, None)

    peak, _ = evaluation._measure_step(step, 8, "cuda")
    assert peak == 24 * MiB  # above the 4 MiB live at entry
    peak, _ = evaluation._measure_step(lambda n: installed.alloc_torch(n * MiB, 0, None), 300, "cuda")
    assert peak is None  # the pool's out of memory counts as "does not fit"
    with pytest.raises(ValueError):
        evaluation._measure_step(lambda n: (_ for _ in ()).throw(ValueError("a bug in the step")), 1, "cuda")
    installed.free(keep, 4 * MiB, 0, None)


def test_install_avoids_record_stream_and_routes_it_to_the_pool(installed, monkeypatch):
    from memkernels import device
    from memkernels.device import sim

    calls = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: calls.append(stream))
    allocator.install()
    assert os.environ[allocator.NCCL_AVOID_RECORD_STREAMS] == "1"  # NCCL groups stash references instead
    side, main = device.stream_create(), device.stream_create()
    p = installed.alloc_torch(4 * MiB, 0, main)

    class FakeTensor:  # a CUDA tensor whose storage the pool allocated
        device = torch.device("cuda", 0)

        def untyped_storage(self):
            return type("Storage", (), {"data_ptr": lambda self: p})()

    side_stream = type("Stream", (), {"cuda_stream": side})()
    torch.Tensor.record_stream(FakeTensor(), side_stream)  # what FSDP1 / DataParallel call
    assert calls == [side_stream]  # torch's own (a no-op under a pluggable allocator) still runs
    sim.hold_events(True)  # the side stream has not finished with the block
    installed.free(p, 4 * MiB, 0, main)
    q = installed.alloc_torch(4 * MiB, 0, main)
    assert q != p  # without the routed record_stream the same stream would get p back at once
    sim.hold_events(False)
    installed.free(q, 4 * MiB, 0, main)


def test_install_warns_where_record_stream_is_still_relied_on(installed, monkeypatch):
    monkeypatch.setenv(allocator.NCCL_AVOID_RECORD_STREAMS, "0")
    with pytest.warns(RuntimeWarning, match="TORCH_NCCL_AVOID_RECORD_STREAMS=0"):
        allocator.install()
    monkeypatch.setenv(allocator.NCCL_AVOID_RECORD_STREAMS, "1")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.warns(RuntimeWarning, match="process group already exists"):
        allocator.install()


def test_an_optimizer_step_ends_the_step_of_every_device_the_pool_serves(installed):
    allocator.install()
    parameter = torch.nn.Parameter(torch.ones(2))
    parameter.grad = torch.ones(2)
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    for _ in range(2):
        for device in (0, 1):
            installed.free(installed.alloc_torch(3 * MiB, device, None), 3 * MiB, device, None)
        optimizer.step()
    pool = _C.installed_device_pool()
    for device in (0, 1):  # the second step repeated the first on both devices
        stats = pool.stats(device)
        assert (stats["num_steps"], stats["num_repeated_steps"], stats["repeating_loop"]) == (2, 1, True)
