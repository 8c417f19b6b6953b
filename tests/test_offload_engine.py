"""The offload copy engine and its pinned pool (csrc/cuda/offload_engine.*, pinned_pool.*) on the simulated device.

No torch: host buffers are numpy arrays, "device" buffers come from the
simulator's cudaMalloc (so its copy validation checks every device range), and
this module also runs under the ASan/UBSan and TSan builds.
"""
import ctypes
import os
import threading

import numpy as np
import pytest
from conftest import simulated_device

from memkernels import _C, device
from memkernels.device import sim

pytestmark = pytest.mark.cpp

KiB = 1 << 10
MiB = 1 << 20
Engine = _C.offload.Engine
SANITIZED = bool(os.environ.get("MEMKERNELS_SANITIZER_RUN"))


@pytest.fixture(autouse=True)
def sim_device():
    with simulated_device(capacity=256 * MiB, granularity=64 * KiB) as configured:
        yield configured


@pytest.fixture
def engine():
    made = []

    def make(**kwargs):
        made.append(Engine(**kwargs))
        return made[-1]

    yield make
    sim.hold_events(False)
    for e in made:
        e.close()


def device_buffer(data):
    """Sim device memory holding `data` (uint8 array); returns its address."""
    ptr = device.malloc(data.nbytes)
    ctypes.memmove(ptr, data.ctypes.data, data.nbytes)
    return ptr


def read_device(ptr, nbytes):
    out = np.empty(nbytes, np.uint8)
    ctypes.memmove(out.ctypes.data, ptr, nbytes)
    return out


def random_bytes(nbytes):
    return np.random.randint(0, 256, size=nbytes, dtype=np.uint8)


# ------------------------------------------------------------------ size classes


@pytest.mark.parametrize("nbytes,expected", [
    (1, 512), (512, 512), (513, 640), (640, 640), (641, 768), (1024, 1024), (1025, 1280),
    (3 * MiB, 3 * MiB), (3 * MiB + 1, 3 * MiB + 512 * KiB), (1 << 40, 1 << 40),
])
def test_class_size_known_answers(nbytes, expected):
    assert _C.offload.class_size(nbytes) == expected


def test_class_size_wastes_under_a_quarter():
    sizes = np.unique(np.random.randint(513, 64 * MiB, size=2000))
    classes = [_C.offload.class_size(int(n)) for n in sizes]
    assert all(c >= n for c, n in zip(classes, sizes))
    assert all(c - n < n / 4 for c, n in zip(classes, sizes))
    assert classes == sorted(classes), "classes must not decrease with the request"


def test_class_size_rejects_zero():
    with pytest.raises(ValueError, match="at least one byte"):
        _C.offload.class_size(0)


# ------------------------------------------------------------------ copies


@pytest.mark.parametrize("nbytes", [1, 511, 4097, 300 * KiB + 3, 3 * MiB + 17])
def test_round_trip_through_pinned_memory(engine, nbytes):
    e = engine()
    data = random_bytes(nbytes)
    src = device_buffer(data)
    dst = device.malloc(nbytes)
    handle = e.offload(src, nbytes, 0)
    assert handle > 0 and e.nbytes(handle) == nbytes
    e.prefetch(handle, dst, 0)
    e.synchronize(handle)
    assert e.offload_done(handle) and e.prefetch_done(handle)
    np.testing.assert_array_equal(read_device(dst, nbytes), data)
    e.release(handle)
    stats = e.stats()
    assert stats["bytes_offloaded"] == nbytes and stats["bytes_prefetched"] == nbytes
    assert stats["live_handles"] == 0 and stats["pool"]["bytes_in_use"] == 0


def test_offload_waits_for_work_queued_on_the_compute_stream(engine):
    # The compute stream is still writing the source when offload() is called:
    # the D2H copy must see the finished data, not what was there before.
    sim.set_random_delays(max_delay_us=2000, seed=3)
    e = engine()
    nbytes = 256 * KiB
    compute = device.stream_create()
    src = device_buffer(np.zeros(nbytes, np.uint8))
    final = random_bytes(nbytes)
    device.memcpy_async(src, final.ctypes.data, nbytes, "host_to_device", compute)
    handle = e.offload(src, nbytes, compute)
    dst = device.malloc(nbytes)
    e.prefetch(handle, dst, 0)
    e.synchronize(handle)
    np.testing.assert_array_equal(read_device(dst, nbytes), final)


def test_source_is_in_use_until_offload_done(engine):
    e = engine()
    nbytes = 64 * KiB
    data = random_bytes(nbytes)
    src = device_buffer(data)
    sim.hold_events(True)  # the D2H copy queues behind a held event
    handle = e.offload(src, nbytes, 0)
    assert not e.offload_done(handle)
    assert not e.idle()
    sim.hold_events(False)
    e.synchronize(handle)
    assert e.offload_done(handle) and e.idle()
    # Only now may the source change: the pinned copy holds the old bytes.
    ctypes.memset(src, 0, nbytes)
    dst = device.malloc(nbytes)
    e.prefetch(handle, dst, 0)
    e.synchronize(handle)
    np.testing.assert_array_equal(read_device(dst, nbytes), data)


def test_prefetch_right_after_offload_is_ordered_behind_it(engine):
    sim.set_random_delays(max_delay_us=1000, seed=5)
    e = engine()
    for nbytes in (KiB, 200 * KiB, MiB + 5):
        data = random_bytes(nbytes)
        src, dst = device_buffer(data), device.malloc(nbytes)
        handle = e.offload(src, nbytes, 0)
        e.prefetch(handle, dst, 0)  # no host wait in between
        e.synchronize(handle)
        np.testing.assert_array_equal(read_device(dst, nbytes), data)
        e.release(handle)


def test_wait_orders_a_stream_behind_the_prefetch(engine):
    e = engine()
    nbytes = 128 * KiB
    data = random_bytes(nbytes)
    handle = e.offload(device_buffer(data), nbytes, 0)
    consumer = device.stream_create()
    dst = device.malloc(nbytes)
    sim.hold_events(True)
    e.prefetch(handle, dst, 0)
    e.wait(handle, consumer)
    out = np.zeros(nbytes, np.uint8)
    device.memcpy_async(out.ctypes.data, dst, nbytes, "device_to_host", consumer)
    assert not device.stream_query(consumer), "the consumer ran before the prefetch completed"
    sim.hold_events(False)
    device.stream_synchronize(consumer)
    np.testing.assert_array_equal(out, data)


def test_released_block_is_not_reused_before_its_prefetch_read_it(engine):
    # A's prefetch is stalled; A is released and B (same class) offloaded. B
    # gets A's block only behind a stream wait, so A's prefetch reads A's bytes.
    # (A large class: its slab is that one block, so no other block is cached.)
    e = engine()
    nbytes = 384 * KiB
    a, b = random_bytes(nbytes), random_bytes(nbytes)
    handle_a = e.offload(device_buffer(a), nbytes, 0)
    e.synchronize(handle_a)
    pinned_before = e.stats()["pool"]["slab_allocations"]
    dst_a = device.malloc(nbytes)
    sim.hold_events(True)
    e.prefetch(handle_a, dst_a, 0)
    e.release(handle_a)
    assert e.stats()["retiring_blocks"] == 1
    handle_b = e.offload(device_buffer(b), nbytes, 0)
    stats = e.stats()
    assert stats["reused_behind_wait"] == 1 and stats["pool"]["slab_allocations"] == pinned_before
    sim.hold_events(False)
    dst_b = device.malloc(nbytes)
    e.prefetch(handle_b, dst_b, 0)
    e.synchronize(handle_b)
    device.synchronize()
    np.testing.assert_array_equal(read_device(dst_a, nbytes), a)
    np.testing.assert_array_equal(read_device(dst_b, nbytes), b)


# ------------------------------------------------------------------ pool


def test_pool_reuses_blocks_across_steps(engine):
    e = engine()
    sizes = [3 * KiB, 70 * KiB, 70 * KiB, 2 * MiB + 1, 512]
    sources = [(n, device_buffer(random_bytes(n))) for n in sizes]
    slabs_after_first = None
    for step in range(3):
        handles = [e.offload(src, n, 0) for n, src in sources]
        for h in handles:
            e.synchronize(h)
            e.release(h)
        pool = e.stats()["pool"]
        if step == 0:
            slabs_after_first = pool["slab_allocations"]
            assert pool["misses"] == pool["slab_allocations"]
        assert pool["slab_allocations"] == slabs_after_first, f"step {step} pinned new memory"
    assert pool["hits"] == 3 * len(sizes) - pool["misses"]


def test_small_classes_share_a_slab(engine):
    e = engine()
    handles = [e.offload(device_buffer(random_bytes(4 * KiB)), 4 * KiB, 0) for _ in range(16)]
    pool = e.stats()["pool"]
    assert pool["slab_allocations"] == 1 and pool["bytes_in_use"] == 16 * 4 * KiB
    for h in handles:
        e.release(h)


def test_trim_returns_unused_slabs_to_the_host(engine):
    e = engine()
    kept = e.offload(device_buffer(random_bytes(4 * KiB)), 4 * KiB, 0)
    for n in (300 * KiB, MiB):
        h = e.offload(device_buffer(random_bytes(n)), n, 0)
        e.release(h)
    assert e.trim() == _C.offload.class_size(300 * KiB) + MiB
    pool = e.stats()["pool"]
    assert pool["slabs"] == 1 and pool["bytes_in_use"] == 4 * KiB  # the slab still in use stays
    assert sim.stats()["host_bytes_in_use"] == pool["pinned_bytes"]
    e.release(kept)


def test_cap_refuses_and_counts_without_error(engine):
    e = engine(max_pinned_bytes=256 * KiB)
    big = e.offload(device_buffer(random_bytes(300 * KiB)), 300 * KiB, 0)
    assert big == 0
    fits = e.offload(device_buffer(random_bytes(200 * KiB)), 200 * KiB, 0)
    assert fits > 0
    stats = e.stats()
    assert stats["kept"] == 1 and stats["bytes_kept"] == 300 * KiB and stats["pool"]["refusals"] == 1
    assert stats["pool"]["pinned_bytes"] <= 256 * KiB
    e.release(fits)


def test_cap_refuses_instead_of_freeing_slabs_mid_step(engine):
    """cudaFreeHost synchronizes the device: the pool never calls it from offload() (in forward);
    the owner trims outside the step, after which the refused size fits."""
    e = engine(max_pinned_bytes=MiB)
    first = e.offload(device_buffer(random_bytes(600 * KiB)), 600 * KiB, 0)  # a 640 KiB slab
    e.synchronize(first)
    e.release(first)
    assert e.offload(device_buffer(random_bytes(900 * KiB)), 900 * KiB, 0) == 0  # would need the room back
    pool = e.stats()["pool"]
    assert pool["slab_frees"] == 0 and pool["refusals"] == 1
    assert e.trim() == 640 * KiB
    second = e.offload(device_buffer(random_bytes(900 * KiB)), 900 * KiB, 0)
    assert second > 0 and e.stats()["pool"]["pinned_bytes"] == 1024 * KiB
    e.release(second)


def test_host_out_of_pinned_memory_is_a_refusal(engine):
    sim.configure(host_capacity=128 * KiB)
    e = engine()
    assert e.offload(device_buffer(random_bytes(200 * KiB)), 200 * KiB, 0) == 0
    assert e.stats()["pool"]["refusals"] == 1


# ------------------------------------------------------------------ lifecycle and errors


def test_close_frees_everything(engine):
    e = engine()
    before = sim.stats()["live_streams"]
    for n in (KiB, MiB):
        e.offload(device_buffer(random_bytes(n)), n, 0)
    assert sim.stats()["host_bytes_in_use"] > 0
    e.close()
    stats = sim.stats()
    assert stats["host_bytes_in_use"] == 0 and stats["live_streams"] == before - 2
    assert e.closed
    with pytest.raises(ValueError, match="closed"):
        e.offload(device_buffer(random_bytes(KiB)), KiB, 0)
    e.close()  # idempotent


def test_bad_handles_and_arguments(engine):
    e = engine()
    with pytest.raises(ValueError, match="unknown or already released"):
        e.release(12345)
    with pytest.raises(ValueError, match="nbytes must be positive"):
        e.offload(device_buffer(random_bytes(KiB)), 0, 0)
    with pytest.raises(ValueError, match="non-null"):
        e.offload(0, KiB, 0)
    h = e.offload(device_buffer(random_bytes(KiB)), KiB, 0)
    with pytest.raises(ValueError, match="never prefetched"):
        e.wait(h, 0)
    e.release(h)
    with pytest.raises(ValueError, match="already released"):
        e.offload_done(h)


def test_stream_priorities_default_and_clamp(engine):
    least, greatest = device.stream_priority_range()
    assert engine().priorities == (least, greatest)
    assert engine(d2h_priority=greatest - 10, h2d_priority=least + 10).priorities == (greatest, least)


def test_concurrent_offload_and_prefetch_keep_every_byte():
    # Threads share one engine under random stream delays; each checks its own bytes.
    sim.set_random_delays(max_delay_us=200, seed=7)
    e = Engine(max_pinned_bytes=4 * MiB)
    rounds = 8 if SANITIZED else 30
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(rounds):
                nbytes = int(rng.integers(1, 300 * KiB))
                data = rng.integers(0, 256, nbytes, dtype=np.uint8)
                src = device_buffer(data)
                handle = e.offload(src, nbytes, 0)
                if handle == 0:  # cap reached by the other threads: data stays put
                    continue
                dst = device.malloc(nbytes)
                e.prefetch(handle, dst, 0)
                e.synchronize(handle)
                if not np.array_equal(read_device(dst, nbytes), data):
                    errors.append(f"thread {seed}: bytes differ")
                e.release(handle)
        except Exception as exc:  # reported below, on the main thread
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    e.synchronize_all()
    stats = e.stats()
    e.close()
    assert not errors, errors
    assert stats["live_handles"] == 0 and stats["pool"]["bytes_in_use"] == 0
    assert stats["offloads"] + stats["kept"] == 3 * rounds
