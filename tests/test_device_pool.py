"""The pool over the device function table, driven by the simulated device: segments from
cudaMalloc, ordering from cudaEvents on real (simulated) streams, the OOM / fail-Nth / cap
paths through the device's own refusals, the extern "C" CUDAPluggableAllocator entry points
called through a stand-in for torch's call path (tests/pluggable_standin.cpp), and replay on
the simulated device."""

import pytest

import pluggable_standin
from conftest import SIM_SYNC_TIMEOUT_S
from memkernels import _C, allocator, device
from memkernels.device import sim
from memkernels.forensics import replay as trace_replay

pytestmark = pytest.mark.cpp

MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture(autouse=True)
def sim_device():
    device.use_sim()
    sim.configure(device_count=2, capacity=256 * MiB, host_capacity=None, granularity=2 * MiB,
                  memory="virtual", address_space=8 * GiB, sync_timeout_s=SIM_SYNC_TIMEOUT_S)  # small: fits under TSan
    yield sim
    sim.hold_events(False)
    installed = _C.installed_device_pool()
    if installed is not None:  # nothing of a pool may outlive the device state it points into
        for d in installed.devices():
            installed.empty_cache(d)
    sim.reset()


def make_pool(**config):
    return _C.make_device_pool(allocator.pool_config(**config))


def test_segments_come_from_cudamalloc_and_go_back_with_cudafree():
    pool = make_pool()
    p = pool.malloc(3 * MiB)
    assert sim.is_device_memory(p, 3 * MiB)
    assert sim.counters()["cudaMalloc"] == 1
    assert sim.stats()["devices"][0]["bytes_in_use"] == pool.stats()["reserved_bytes"]["current"]
    pool.free(p)
    pool.empty_cache()
    assert sim.counters()["cudaFree"] == 1 and sim.stats()["devices"][0]["bytes_in_use"] == 0
    q = pool.malloc(MiB, device=1)  # per-device pools: the segment is on device 1
    assert sim.stats()["devices"][1]["bytes_in_use"] == 2 * MiB
    pool.free(q, device=1)
    pool.empty_cache(1)


def test_device_refusal_releases_cache_retries_then_raises():
    sim.set_capacity(64 * MiB)
    pool = make_pool(release_before_growth=-1)
    pool.free(pool.malloc(40 * MiB))
    q = pool.malloc(50 * MiB)  # the device refuses until the cached 40 MiB goes back
    stats = pool.stats()
    assert stats["num_alloc_retries"] == 1 and stats["num_device_free"] == 1
    with pytest.raises(_C.OutOfMemoryError, match="tried to allocate 30.00 MiB"):
        pool.malloc(30 * MiB)
    assert pool.stats()["num_ooms"] == 1
    pool.free(q)
    pool.check_invariants()


def test_fail_nth_allocation_of_the_device():
    pool = make_pool(release_before_growth=-1)
    sim.fail_allocations(1)
    p = pool.malloc(16 * MiB)  # first cudaMalloc fails, the retry succeeds
    assert pool.stats()["num_alloc_retries"] == 1
    sim.fail_allocations(1, count=2)  # the attempt and its retry both fail
    with pytest.raises(_C.OutOfMemoryError):
        pool.malloc(16 * MiB)
    q = pool.malloc(16 * MiB)  # injection spent: works again
    assert pool.stats()["num_ooms"] == 1 and sim.stats()["injected_failures"] == 3
    pool.free(p)
    pool.free(q)
    pool.check_invariants()


def test_memory_cap_as_a_fraction_of_device_memory():
    pool = make_pool(memory_cap_fraction=0.25)
    assert pool.stats()["memory_cap"] == 64 * MiB  # of the 256 MiB cudaMemGetInfo reports
    p = pool.malloc(60 * MiB)
    with pytest.raises(_C.OutOfMemoryError, match="memory cap 64.00 MiB"):
        pool.malloc(8 * MiB)
    pool.free(p)


def test_cross_stream_reuse_waits_for_the_event_on_the_simulated_stream():
    s1, s2 = device.stream_create(), device.stream_create()
    pool = make_pool(release_before_growth=-1)
    sim.hold_events(True)  # the event recorded at free time stalls on s1
    p = pool.malloc(MiB, s1)
    others = [pool.malloc(MiB, s2) for _ in range(2)]  # a second stream: frees now record events
    pool.free(p)
    assert pool.malloc(MiB, s1) == p  # own stream: at once
    pool.free(p)
    assert pool.malloc(MiB, s2) not in [p] + others  # s1's event has not completed
    sim.hold_events(False)
    device.stream_synchronize(s1)
    assert pool.malloc(MiB, s2) == p
    pool.check_invariants()


def test_record_stream_on_the_simulated_device():
    s1, s2 = device.stream_create(), device.stream_create()
    pool = make_pool(release_before_growth=-1)
    sim.hold_events(True)
    p = pool.malloc(MiB, s1)
    pool.record_stream(p, s2)
    pool.free(p)
    assert pool.stats()["active_bytes"]["current"] == MiB
    assert pool.malloc(MiB, s1) != p
    sim.hold_events(False)
    device.synchronize()
    assert pool.malloc(MiB, s2) == p
    pool.check_invariants()


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    """PyTorch's call path into the entry points (tests/pluggable_standin.cpp), without torch."""
    return pluggable_standin.load(str(tmp_path_factory.mktemp("standin")))


def _entry_points(standin):
    """alloc / free as CUDAPluggableAllocator calls them; alloc fails the test if anything was thrown."""
    def alloc(size, device_index, stream):
        pointer, error = standin.alloc(size, device_index, stream)
        assert not error, error
        return pointer

    return alloc, standin.free


def test_pluggable_allocator_entry_points(capfd, standin):
    alloc, free = _entry_points(standin)
    pool = _C.install_device_pool(allocator.pool_config(trace_capacity=100))
    stream = device.stream_create()
    p = alloc(5 * MiB, 0, stream)
    assert p and sim.is_device_memory(p, 5 * MiB)
    assert pool.stats()["allocated_bytes"]["current"] == 5 * MiB
    with pytest.raises(ValueError, match="still has live allocations"):
        _C.install_device_pool(allocator.pool_config())
    before = _C.device_pool_counters()["bad_frees"]
    free(p + 512, 5 * MiB, 0, stream)  # unknown pointer: reported, ignored
    free(p, 5 * MiB, 0, stream)
    free(p, 5 * MiB, 0, stream)  # double free: reported, ignored
    assert _C.device_pool_counters()["bad_frees"] == before + 2
    assert "not a live allocation" in capfd.readouterr().err
    pointer, error = standin.alloc(512 * GiB, 0, stream)  # torch does not check for null: it must throw
    assert pointer is None and error.startswith("memkernels: out of memory on device 0: tried to allocate 512.00 GiB")
    assert pool.stats()["allocation"]["current"] == 0 and _C.device_pool_counters()["failed_allocs"] >= 1
    actions = [e["action"] for e in pool.trace(0)]
    assert actions[:3] == ["segment_alloc", "alloc", "free_requested"] and "oom" in actions
    pool.check_invariants()


def test_python_api_over_the_installed_pool(standin):
    alloc, free = _entry_points(standin)
    _C.install_device_pool(allocator.pool_config())
    allocator.reserve(32 * MiB, device=0)
    p = alloc(10 * MiB, 0, None)
    stats = allocator.stats(0)
    assert stats["reserved_bytes"]["current"] == 32 * MiB and stats["num_device_alloc"] == 1
    with pytest.warns(RuntimeWarning, match="69% of the memory reserved on cuda:0 .*allocator.empty_cache"):
        summary = allocator.memory_summary(0)  # 22 of 32 MiB reserved hold no tensor
    assert summary.source == "memkernels" and summary.reserved == 32 * MiB and summary.allocated == 10 * MiB
    assert "reserved memory" in str(summary) and "largest free block 22.00 MiB" in str(summary)
    snapshot = allocator.snapshot()
    assert snapshot["segments"][0]["is_reserved"] and snapshot["segments"][0]["blocks"][0]["state"] == "active_allocated"
    allocator.set_memory_cap(40 * MiB, device=0)
    pointer, error = standin.alloc(30 * MiB, 0, None)  # the 22 MiB left in the reservation is too small; 32 + 30 > 40
    assert pointer is None
    for figure in ("tried to allocate 30.00 MiB", "memory cap 40.00 MiB", "reserved 32.00 MiB", "allocated 10.00 MiB",
                   "largest free block 22.00 MiB"):
        assert figure in error
    q = alloc(20 * MiB, 0, None)  # still usable: what fits is served
    free(q, 20 * MiB, 0, None)
    allocator.set_memory_cap(None, device=0)
    free(p, 10 * MiB, 0, None)
    allocator.reset_peak_stats(0)
    assert allocator.stats(0)["allocated_bytes"]["peak"] == 0
    allocator.empty_cache()  # the reservation stays
    assert allocator.stats(0)["reserved_bytes"]["current"] == 32 * MiB
    with pytest.raises(ValueError, match="bytes must be a positive int"):
        allocator.reserve(-1)


def _interleaved_trace():
    """40 allocations of 3-21 MiB, every third one freeing the allocation two before it."""
    events = []
    for i in range(40):
        events.append({"action": "alloc", "addr": 100 + i, "size": (i % 7 + 1) * 3 * MiB + i, "stream": 0})
        if i % 3 == 2:
            events.append({"action": "free_completed", "addr": 100 + i - 2, "size": 0, "stream": 0})
    return {"segments": [], "device_traces": [events]}


def test_replay_on_the_simulated_device_matches_the_core_replay():
    trace = _interleaved_trace()
    on_sim = trace_replay.replay(trace, simulated_device=True, capacity=4 * GiB)
    on_core = trace_replay.replay(trace, capacity=4 * GiB)
    for key in ("peak_reserved_bytes", "peak_allocated_bytes", "peak_requested_bytes", "num_device_alloc",
                "num_device_free", "num_ooms"):
        assert on_sim[key] == on_core[key], key
    assert sim.counters()["cudaMalloc"] == on_sim["num_device_alloc"]


def test_cli_replay_on_the_simulated_device(tmp_path, capsys):
    import pickle

    from memkernels.cli import main

    events = [{"action": "alloc", "addr": 1, "size": 3 * MiB, "stream": 0},
              {"action": "alloc", "addr": 2, "size": 30 * MiB, "stream": 0},
              {"action": "free_completed", "addr": 1, "size": 3 * MiB, "stream": 0}]
    path = tmp_path / "trace.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [events]}))
    assert main(["replay", str(path), "--simulated-device", "--repeats", "1", "--capacity", "4GiB"]) == 0
    assert "on the simulated CUDA device" in capsys.readouterr().out
    assert sim.counters()["cudaMalloc"] >= 2


def test_pluggable_allocator_entry_points_with_expandable_segments(standin):
    alloc, free = _entry_points(standin)
    pool = _C.install_device_pool(allocator.pool_config(expandable_segments=True, trace_capacity=100))
    stream = device.stream_create()
    p = alloc(5 * MiB, 0, stream)
    q = alloc(3 * MiB, 0, stream)
    assert p and q == p + 5 * MiB and sim.is_device_memory(p, 8 * MiB)  # one range, grown in place
    assert sim.stats()["mapped_bytes"] == pool.stats()["reserved_bytes"]["current"] == 8 * MiB
    free(q, 3 * MiB, 0, stream)
    free(p, 5 * MiB, 0, stream)
    allocator.empty_cache()  # waits for the free-time events, then unmaps
    assert sim.stats()["mapped_bytes"] == 0 and allocator.stats(0)["reserved_bytes"]["current"] == 0
    snapshot = allocator.snapshot()
    assert snapshot["segments"] == []
    actions = [e["action"] for e in snapshot["device_traces"][0]]
    assert actions.count("segment_map") == 2 and "segment_unmap" in actions
    pool.check_invariants()


def test_replay_with_expandable_segments_on_the_simulated_device():
    trace = _interleaved_trace()
    on_sim = trace_replay.replay(trace, simulated_device=True, capacity=GiB, expandable_segments=True)
    on_core = trace_replay.replay(trace, capacity=GiB, expandable_segments=True)
    assert on_sim["peak_requested_bytes"] == on_core["peak_requested_bytes"] and on_sim["num_ooms"] == 0
    # Nothing is unmapped before growth on the core (no free page borders a gap); the sim, whose
    # unmapping also waits for stream events, can only have fewer candidates: the same decisions.
    assert on_core["num_device_free"] == 0
    for key in ("peak_reserved_bytes", "peak_allocated_bytes", "num_device_alloc", "num_device_free"):
        assert on_sim[key] == on_core[key], key
    counters = sim.counters()
    assert counters["cuMemMap"] == counters["cuMemCreate"] >= on_sim["num_device_alloc"] > 0
    assert counters["cuMemAddressReserve"] >= 1
