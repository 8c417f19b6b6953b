"""The simulated CUDA device, driven through the same function table real CUDA fills.

Every call here goes memkernels.device -> _C.device -> mk::cuda::api() -> the
sim's entry points, so these tests exercise the table and the simulator
together. Host buffers are numpy arrays (no torch: this module also runs
under the sanitizer builds).
"""
import threading
import time

import numpy as np
import pytest
from conftest import simulated_device

from memkernels import device
from memkernels.device import CudaError, sim

pytestmark = pytest.mark.cpp

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture(autouse=True)
def sim_device():
    """A fresh, small, backed simulated device for every test."""
    with simulated_device(capacity=64 * MiB, granularity=64 * KiB) as configured:
        yield configured


def host(nbytes, fill=None):
    """A host buffer of random bytes (or a constant) and its address."""
    arr = np.random.randint(0, 256, size=nbytes, dtype=np.uint8) if fill is None else np.full(nbytes, fill, np.uint8)
    return arr, arr.ctypes.data


def code_and_call(error):
    return error.code, error.call


# --------------------------------------------------------------- streams


@pytest.mark.parametrize("seed", [1, 2])
def test_async_copies_run_in_order_on_one_stream(seed):
    # Random per-operation delays would expose any reordering: every read-back
    # must see exactly the upload queued just before it.
    sim.set_random_delays(max_delay_us=300, seed=seed)
    stream = device.stream_create()
    nbytes = 64 * KiB
    buf = device.malloc(nbytes)
    uploads = [host(nbytes) for _ in range(6)]
    readbacks = [host(nbytes, fill=0) for _ in range(6)]
    for (_, src), (_, dst) in zip(uploads, readbacks):
        device.memcpy_async(buf, src, nbytes, "host_to_device", stream)
        device.memcpy_async(dst, buf, nbytes, "device_to_host", stream)
    device.stream_synchronize(stream)
    for (up, _), (back, _) in zip(uploads, readbacks):
        np.testing.assert_array_equal(back, up)
    assert sim.stats()["bytes_copied"] == 12 * nbytes


def test_random_delays_keep_work_pending():
    # Five operations, each delayed by up to 20 ms: finishing all of them before
    # the query right after enqueueing would need five draws under ~20 us in total.
    sim.set_random_delays(max_delay_us=20_000, seed=11)
    stream = device.stream_create()
    buf = device.malloc(KiB)
    payload, payload_ptr = host(KiB)
    for _ in range(5):
        device.memcpy_async(buf, payload_ptr, KiB, "host_to_device", stream)
    assert not device.stream_query(stream)
    device.stream_synchronize(stream)
    assert device.stream_query(stream)
    assert sim.stats()["bytes_copied"] == 5 * KiB


def test_event_orders_work_across_streams():
    producer, consumer, unordered = device.stream_create(), device.stream_create(), device.stream_create()
    nbytes = 32 * KiB
    buf = device.malloc(nbytes)
    zeros, zeros_ptr = host(nbytes, fill=0)
    device.memcpy_async(buf, zeros_ptr, nbytes, "host_to_device", producer)
    device.stream_synchronize(producer)

    sim.hold_events(True)
    gate, written = device.event_create(), device.event_create()
    device.event_record(gate, producer)             # held: the producer stalls here
    payload, payload_ptr = host(nbytes, fill=7)
    device.memcpy_async(buf, payload_ptr, nbytes, "host_to_device", producer)
    device.event_record(written, producer)

    ordered_out, ordered_ptr = host(nbytes, fill=1)
    device.stream_wait_event(consumer, written)
    device.memcpy_async(ordered_ptr, buf, nbytes, "device_to_host", consumer)
    # Control: the same read without the wait runs at once and sees the old contents.
    unordered_out, unordered_ptr = host(nbytes, fill=1)
    device.memcpy_async(unordered_ptr, buf, nbytes, "device_to_host", unordered)
    device.stream_synchronize(unordered)
    np.testing.assert_array_equal(unordered_out, zeros)

    # The sleep gives a wrongly unordered consumer time to run; on a loaded machine it may be too short to
    # catch that bug, but it cannot fail a correct sim: held events keep the consumer waiting however long.
    time.sleep(0.05)
    assert not device.stream_query(consumer), "the consumer ran before the producer's event completed"
    np.testing.assert_array_equal(ordered_out, np.full(nbytes, 1, np.uint8))

    assert sim.release_events() == 2
    device.stream_synchronize(consumer)
    np.testing.assert_array_equal(ordered_out, payload)


def test_event_query_before_and_after_delayed_completion():
    stream, event = device.stream_create(), device.event_create()
    assert device.event_query(event), "a never-recorded event counts as complete"
    sim.hold_events(True)
    device.event_record(event, stream)
    time.sleep(0.05)  # as above: a chance for a wrong completion to show; a held event stays incomplete anyway
    assert not device.event_query(event)
    assert not device.stream_query(stream)
    assert sim.stats()["held_events"] == 1
    assert sim.release_events() == 1
    device.event_synchronize(event)
    assert device.event_query(event)
    assert sim.stats()["held_events"] == 0


def test_event_query_follows_the_latest_record():
    stream, event = device.stream_create(), device.event_create()
    device.event_record(event, stream)
    device.event_synchronize(event)
    sim.hold_events(True)
    device.event_record(event, stream)   # re-recorded: the query now refers to this one
    assert not device.event_query(event)
    sim.hold_events(False)
    device.event_synchronize(event)
    assert device.event_query(event)


def test_blocking_call_on_held_work_times_out_instead_of_hanging():
    sim.configure(sync_timeout_s=0.2)
    stream, event = device.stream_create(), device.event_create()
    sim.hold_events(True)
    device.event_record(event, stream)
    start = time.monotonic()
    with pytest.raises(CudaError) as excinfo:
        device.event_synchronize(event)
    assert code_and_call(excinfo.value) == (device.CUDA_ERROR_LAUNCH_TIMEOUT, "cudaEventSynchronize")
    # It waited for the timeout (0.2 s) before giving up: load can only lengthen that, so only the lower
    # bound is asserted. That it returned at all is the point (a hang would stop the run, not pass).
    assert time.monotonic() - start > 0.15


def test_destroyed_stream_still_runs_its_queued_work():
    stream = device.stream_create()
    nbytes = 4 * KiB
    buf = device.malloc(nbytes)
    payload, payload_ptr = host(nbytes)
    out, out_ptr = host(nbytes, fill=0)
    sim.hold_events(True)
    device.event_record(device.event_create(), stream)
    device.memcpy_async(buf, payload_ptr, nbytes, "host_to_device", stream)
    device.memcpy_async(out_ptr, buf, nbytes, "device_to_host", stream)
    device.stream_destroy(stream)
    assert sim.stats()["live_streams"] == 0
    sim.release_events()
    device.synchronize()
    np.testing.assert_array_equal(out, payload)
    with pytest.raises(CudaError) as excinfo:
        device.stream_synchronize(stream)
    assert excinfo.value.code == device.CUDA_ERROR_INVALID_HANDLE


def test_streams_used_from_several_threads():
    # Worker threads and caller threads touch the same sim state; this is the
    # case the TSan build is for. Each thread checks its own round trips.
    nbytes = 16 * KiB
    failures = []

    def round_trips(index):
        try:
            stream, event = device.stream_create(), device.event_create()
            buf = device.malloc(nbytes)
            for step in range(20):
                payload, payload_ptr = host(nbytes, fill=(index * 31 + step) % 256)
                out, out_ptr = host(nbytes, fill=0)
                device.memcpy_async(buf, payload_ptr, nbytes, "host_to_device", stream)
                device.memcpy_async(out_ptr, buf, nbytes, "device_to_host", stream)
                device.event_record(event, stream)
                device.event_synchronize(event)
                if not np.array_equal(out, payload):
                    failures.append((index, step))
            device.free(buf)
            device.stream_destroy(stream)
        except Exception as exc:  # surfaced below with the thread's index
            failures.append((index, repr(exc)))

    sim.set_random_delays(max_delay_us=50, seed=3)
    threads = [threading.Thread(target=round_trips, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert sim.stats()["devices"][0]["bytes_in_use"] == 0


# --------------------------------------------------------------- faults


def test_capacity_cap_returns_the_cuda_out_of_memory_code():
    sim.configure(capacity=1 * MiB)
    first = device.malloc(768 * KiB)
    with pytest.raises(CudaError) as excinfo:
        device.malloc(512 * KiB)
    assert code_and_call(excinfo.value) == (device.CUDA_ERROR_OUT_OF_MEMORY, "cudaMalloc")
    assert "cudaErrorMemoryAllocation" in str(excinfo.value)
    assert device.mem_get_info() == (256 * KiB, 1 * MiB)

    granule = device.mem_granularity()
    with pytest.raises(CudaError) as excinfo:
        device.mem_create(256 * KiB + granule)  # 256 KiB free
    assert code_and_call(excinfo.value) == (device.CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate")
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(excinfo.value)

    device.free(first)
    device.free(device.malloc(1 * MiB))  # all of it is usable again


def test_fail_nth_allocation_counts_malloc_and_mem_create():
    sim.fail_allocations(3, count=2)
    kept = [device.malloc(KiB), device.mem_create(device.mem_granularity())]
    with pytest.raises(CudaError) as excinfo:
        device.malloc(KiB)
    assert excinfo.value.code == device.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(CudaError) as excinfo:
        device.mem_create(device.mem_granularity())
    assert excinfo.value.code == device.CUDA_ERROR_OUT_OF_MEMORY
    kept.append(device.malloc(KiB))  # the 5th succeeds again
    assert sim.stats()["injected_failures"] == 2
    assert sim.stats()["devices"][0]["allocations"] == 3


@pytest.mark.parametrize("memory", ["backed", "virtual"])
def test_absurd_sizes_are_out_of_memory_not_overflow(memory):
    sim.configure(memory=memory, capacity=(1 << 64) - 1)  # nothing but the address space limits it
    for nbytes in (1 << 63, (1 << 64) - 1):
        with pytest.raises(CudaError) as excinfo:
            device.malloc(nbytes)
        assert excinfo.value.code == device.CUDA_ERROR_OUT_OF_MEMORY
        with pytest.raises(CudaError) as excinfo:
            device.host_alloc(nbytes)
        assert excinfo.value.code == device.CUDA_ERROR_OUT_OF_MEMORY
    g = device.mem_granularity()
    with pytest.raises(CudaError) as excinfo:
        device.mem_address_reserve(1 << 63)
    assert excinfo.value.code == device.CUDA_ERROR_OUT_OF_MEMORY
    # A hint CUDA cannot honour is only a hint: the range goes elsewhere.
    far = (1 << 64) - g
    ptr = device.mem_address_reserve(g, hint=far)
    assert ptr != far
    device.mem_address_free(ptr, g)
    assert sim.stats()["devices"][0]["bytes_in_use"] == 0


def test_pinned_host_capacity():
    sim.configure(host_capacity=1 * MiB)
    ptr = device.host_alloc(1 * MiB)
    with pytest.raises(CudaError) as excinfo:
        device.host_alloc(1)
    assert excinfo.value.code == device.CUDA_ERROR_OUT_OF_MEMORY
    device.free_host(ptr)
    assert sim.stats()["host_peak_bytes"] == 1 * MiB


# --------------------------------------------------------------- memory


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * KiB
    raise RuntimeError("no VmRSS in /proc/self/status")


def test_virtual_memory_hands_out_more_than_this_machine_has():
    sim.configure(memory="virtual", capacity=80 * GiB, address_space=128 * GiB)
    before = rss_bytes()
    ptrs = [device.malloc(GiB) for _ in range(80)]
    with pytest.raises(CudaError) as excinfo:
        device.malloc(GiB)
    assert excinfo.value.code == device.CUDA_ERROR_OUT_OF_MEMORY
    starts = sorted(ptrs)
    assert all(b - a >= GiB for a, b in zip(starts, starts[1:])), "virtual allocations overlap"
    # Copies are bookkeeping only: counted, validated, nothing written.
    out, out_ptr = host(4 * KiB, fill=5)
    device.memcpy_async(ptrs[-1], out_ptr, 4 * KiB, "host_to_device")
    device.memcpy_async(out_ptr, ptrs[0], 4 * KiB, "device_to_host")
    device.synchronize()
    np.testing.assert_array_equal(out, np.full(4 * KiB, 5, np.uint8))
    assert sim.stats()["bytes_copied"] == 8 * KiB
    assert sim.stats()["devices"][0]["bytes_in_use"] == 80 * GiB
    assert rss_bytes() - before < 64 * MiB, "virtual memory touched host memory"
    with pytest.raises(CudaError) as excinfo:  # still validated: past the end of an allocation
        device.memcpy_async(ptrs[0] + GiB - 8, out_ptr, 16, "host_to_device")
    assert excinfo.value.code == device.CUDA_ERROR_INVALID_VALUE
    for p in ptrs:
        device.free(p)
    assert sim.stats()["devices"][0]["bytes_in_use"] == 0


def test_backed_memory_copies_really_copy():
    nbytes = 96 * KiB + 3
    a, b = device.malloc(nbytes), device.malloc(nbytes)
    pinned = device.host_alloc(nbytes)
    payload, payload_ptr = host(nbytes)
    out, out_ptr = host(nbytes, fill=0)
    device.memcpy_async(pinned, payload_ptr, nbytes, "host_to_host")
    device.memcpy_async(a, pinned, nbytes, "host_to_device")
    device.memcpy_async(b, a, nbytes, "device_to_device")
    device.memcpy_async(out_ptr, b, nbytes, "default")  # direction inferred from the addresses
    device.synchronize()
    np.testing.assert_array_equal(out, payload)
    assert sim.is_device_memory(a, nbytes) and not sim.is_device_memory(pinned, nbytes)


def test_copies_outside_live_device_memory_are_rejected():
    buf = device.malloc(4 * KiB)
    _, src = host(8 * KiB)
    with pytest.raises(CudaError) as excinfo:
        device.memcpy_async(buf, src, 4 * KiB + 1, "host_to_device")
    assert code_and_call(excinfo.value) == (device.CUDA_ERROR_INVALID_VALUE, "cudaMemcpyAsync")
    with pytest.raises(CudaError):
        device.memcpy_async(src, src, 16, "device_to_host")  # a host address is not device memory
    device.free(buf)
    with pytest.raises(CudaError):
        device.memcpy_async(buf, src, 16, "host_to_device")  # freed
    with pytest.raises(CudaError) as excinfo:
        device.free(buf)
    assert excinfo.value.code == device.CUDA_ERROR_INVALID_VALUE


def test_peak_and_in_use_figures():
    ptrs = [device.malloc(MiB) for _ in range(3)]
    device.free(ptrs.pop(1))
    ptrs.append(device.malloc(2 * MiB))
    stats = sim.stats()["devices"][0]
    assert (stats["bytes_in_use"], stats["peak_bytes"], stats["allocations"]) == (4 * MiB, 4 * MiB, 3)
    sim.reset_peak()
    device.free(ptrs.pop())
    stats = sim.stats()["devices"][0]
    assert (stats["bytes_in_use"], stats["peak_bytes"]) == (2 * MiB, 4 * MiB)


def test_devices_are_separate_and_current_device_is_per_thread():
    sim.configure(device_count=2, capacity=2 * MiB)
    device.set_device(1)
    device.malloc(2 * MiB)
    seen = []
    thread = threading.Thread(target=lambda: seen.append((device.get_device(), device.mem_get_info())))
    thread.start()
    thread.join()
    assert seen == [(0, (2 * MiB, 2 * MiB))]
    assert device.mem_get_info() == (0, 2 * MiB)
    assert [d["bytes_in_use"] for d in sim.stats()["devices"]] == [0, 2 * MiB]
    with pytest.raises(CudaError) as excinfo:
        device.set_device(2)
    assert excinfo.value.code == 101  # cudaErrorInvalidDevice
    device.set_device(0)


# --------------------------------------------------------------- VMM


@pytest.mark.parametrize("memory", ["backed", "virtual"])
def test_vmm_map_unmap_bookkeeping(memory):
    sim.configure(memory=memory)
    g = device.mem_granularity()
    base = device.mem_address_reserve(4 * g)
    first, second = device.mem_create(2 * g), device.mem_create(g)
    device.mem_map(base, 2 * g, first)
    device.mem_map(base + 2 * g, g, second)

    def code_of(call, *args):
        with pytest.raises(CudaError) as excinfo:
            call(*args)
        return excinfo.value.code

    assert code_of(device.mem_map, base, 2 * g, first) == device.CUDA_ERROR_ALREADY_MAPPED
    assert code_of(device.mem_map, base + g, g, second) == device.CUDA_ERROR_ALREADY_MAPPED
    assert code_of(device.mem_map, base + 3 * g, g, second, g) == device.CUDA_ERROR_INVALID_VALUE  # past handle
    assert code_of(device.mem_map, base + 4 * g, g, second) == device.CUDA_ERROR_INVALID_VALUE  # outside reservation
    assert code_of(device.mem_map, base + 3 * g, g // 2, second) == device.CUDA_ERROR_INVALID_VALUE  # not granular
    assert code_of(device.mem_unmap, base + 3 * g, g) == device.CUDA_ERROR_NOT_MAPPED
    assert code_of(device.mem_unmap, base, g) == device.CUDA_ERROR_INVALID_VALUE  # half a mapping

    # Mapped but not yet accessible: copies are refused.
    payload, payload_ptr = host(3 * g)
    assert code_of(device.memcpy_async, base, payload_ptr, 16, "host_to_device") == device.CUDA_ERROR_INVALID_VALUE
    device.mem_set_access(base, 3 * g)
    # One copy across two adjacent mappings, as an expandable segment does.
    out, out_ptr = host(3 * g, fill=0)
    device.memcpy_async(base, payload_ptr, 3 * g, "host_to_device")
    device.memcpy_async(out_ptr, base, 3 * g, "device_to_host")
    device.synchronize()
    if memory == "backed":
        np.testing.assert_array_equal(out, payload)
    else:
        np.testing.assert_array_equal(out, np.zeros(3 * g, np.uint8))

    stats = sim.stats()
    assert (stats["reserved_bytes"], stats["mapped_bytes"], stats["devices"][0]["bytes_in_use"]) == (4 * g, 3 * g, 3 * g)
    device.mem_release(first)  # still mapped: its memory stays in use
    assert sim.stats()["devices"][0]["bytes_in_use"] == 3 * g
    assert code_of(device.mem_release, first) == device.CUDA_ERROR_INVALID_VALUE  # released twice
    assert code_of(device.mem_address_free, base, 4 * g) == device.CUDA_ERROR_INVALID_VALUE  # still mapped
    device.mem_unmap(base, 3 * g)  # both mappings at once
    assert sim.stats()["devices"][0]["bytes_in_use"] == g  # `second` is unmapped but not released
    assert code_of(device.memcpy_async, base, payload_ptr, 16, "host_to_device") == device.CUDA_ERROR_INVALID_VALUE
    device.mem_release(second)
    device.mem_address_free(base, 4 * g)
    stats = sim.stats()
    assert (stats["reserved_bytes"], stats["mapped_bytes"], stats["devices"][0]["bytes_in_use"]) == (0, 0, 0)
    assert device.mem_address_reserve(2 * g, hint=base + g) == base + g  # a free hinted range is honoured


def test_unmap_before_a_queued_copy_runs_is_an_illegal_address():
    g = device.mem_granularity()
    base = device.mem_address_reserve(g)
    handle = device.mem_create(g)
    device.mem_map(base, g, handle)
    device.mem_set_access(base, g)
    stream = device.stream_create()
    _, src = host(g)
    sim.hold_events(True)
    device.event_record(device.event_create(), stream)  # stall the stream
    device.memcpy_async(base, src, g, "host_to_device", stream)  # valid when queued
    device.mem_unmap(base, g)  # unmap does not wait for the stream (nor does CUDA's)
    sim.release_events()
    with pytest.raises(CudaError) as excinfo:
        device.stream_synchronize(stream)
    assert excinfo.value.code == device.CUDA_ERROR_ILLEGAL_ADDRESS
    assert sim.stats()["async_errors"] == 1
    with pytest.raises(CudaError) as excinfo:  # sticky, as a corrupted context is
        device.malloc(KiB)
    assert excinfo.value.code == device.CUDA_ERROR_ILLEGAL_ADDRESS
    sim.reset()
    device.free(device.malloc(KiB))


# --------------------------------------------------------------- modelled time
# Clocks are computed when work is enqueued, from the link bandwidth and run_kernel's durations alone: exact
# figures, whatever the machine's speed or load (approx only absorbs float rounding).

MB = 10**6
LINK = 1e9  # bytes per second: 1 MB takes 1 ms


def modelled(seconds):
    return pytest.approx(seconds, rel=1e-12, abs=1e-15)


def test_a_copy_takes_its_bytes_over_the_link_bandwidth():
    sim.set_link_bandwidth(LINK)
    stream = device.stream_create()
    pinned = device.host_alloc(MB)
    payload, payload_ptr = host(MB)
    out, out_ptr = host(MB, fill=0)
    device.memcpy_async(pinned, payload_ptr, MB, "host_to_host", stream)  # pageable -> pinned crosses the link
    assert sim.clock(stream) == modelled(1e-3)
    device.memcpy_async(out_ptr, pinned, MB, "default", stream)
    assert sim.clock(stream) == modelled(2e-3)
    a, b = device.malloc(MB), device.malloc(MB)
    device.memcpy_async(a, pinned, MB, "host_to_device", stream)
    device.memcpy_async(b, a, MB, "device_to_device", stream)  # stays on the device: no link time
    assert sim.clock(stream) == modelled(3e-3)
    assert sim.stats()["modelled_link_seconds"] == modelled(3e-3)
    assert (sim.clock(), sim.host_clock()) == (0, 0), "other streams and the host are not held up"
    device.stream_synchronize(stream)
    np.testing.assert_array_equal(out, payload)


def test_a_copy_on_another_stream_overlaps_a_kernel():
    sim.set_link_bandwidth(LINK)
    side = device.stream_create()
    pinned = device.host_alloc(MB)
    payload, payload_ptr = host(MB)
    sim.run_kernel(0.005)
    device.memcpy_async(pinned, payload_ptr, MB, "host_to_host", side)
    assert (sim.clock(), sim.clock(side)) == (modelled(0.005), modelled(1e-3))
    device.memcpy_async(pinned, payload_ptr, MB, "host_to_host")  # behind the kernel on its own stream
    assert sim.clock() == modelled(0.006)
    device.synchronize()


def test_a_stream_waiting_on_an_event_starts_at_the_record():
    sim.set_link_bandwidth(LINK)
    side = device.stream_create()
    done, never = device.event_create(), device.event_create()
    pinned = device.host_alloc(MB)
    payload, payload_ptr = host(MB)
    sim.run_kernel(0.005)
    device.event_record(done)
    sim.run_kernel(0.002)  # after the record: not waited for
    device.stream_wait_event(side, never)  # never recorded: nothing to wait for
    assert sim.clock(side) == 0
    device.stream_wait_event(side, done)
    device.memcpy_async(pinned, payload_ptr, MB, "host_to_host", side)
    assert sim.clock(side) == modelled(0.006)
    device.event_synchronize(done)
    assert sim.host_clock() == modelled(0.005)
    device.synchronize()


def test_blocking_calls_move_the_host_clock_and_later_work_starts_there():
    sim.set_link_bandwidth(LINK)
    stream = device.stream_create()
    pinned = device.host_alloc(MB)
    payload, payload_ptr = host(MB)
    device.memcpy_async(pinned, payload_ptr, MB, "host_to_host", stream)
    device.stream_query(stream)
    assert sim.host_clock() == 0, "a query does not block the host"
    device.stream_synchronize(stream)
    assert sim.host_clock() == modelled(1e-3)
    sim.run_kernel(0.002)  # stream 0 was idle: it starts when the host issues it
    assert sim.clock() == modelled(3e-3)
    assert sim.host_clock() == modelled(1e-3), "enqueueing does not block the host"

    # Device synchronize waits for every stream of the device, a destroyed one's queued work included.
    sim.run_kernel(0.01, stream)
    device.memcpy_async(pinned, payload_ptr, MB, "host_to_host", stream)
    device.stream_destroy(stream)
    device.synchronize()
    assert sim.host_clock() == modelled(0.012)

    sim.run_kernel(0.004)
    device.free_host(pinned)  # a free synchronizes the device first
    assert sim.host_clock() == modelled(0.016)


def test_reset_zeroes_the_clocks_and_turns_the_link_model_off():
    sim.set_link_bandwidth(LINK)
    pinned = device.host_alloc(MB)
    payload, payload_ptr = host(MB)
    sim.run_kernel(0.005)
    device.memcpy_async(pinned, payload_ptr, MB, "host_to_host")
    device.synchronize()
    assert sim.host_clock() == modelled(0.006)
    sim.reset()
    assert (sim.clock(), sim.host_clock(), sim.stats()["modelled_link_seconds"]) == (0, 0, 0)
    stream = device.stream_create()
    pinned = device.host_alloc(MB)
    device.memcpy_async(pinned, payload_ptr, MB, "host_to_host", stream)
    assert sim.clock(stream) == 0, "without a link bandwidth copies take no modelled time"
    sim.run_kernel(0.003, stream)
    assert sim.clock(stream) == modelled(0.003)
    device.stream_synchronize(stream)


def offload_step_clocks():
    """An offload-shaped step on three streams; returns every clock it produces."""
    compute, d2h, h2d = 0, device.stream_create(), device.stream_create()
    saved, restored = device.event_create(), device.event_create()
    pinned = device.host_alloc(2 * MB)
    activations, activations_ptr = host(2 * MB)
    restored_buf, restored_ptr = host(MB, fill=0)
    seen = []
    for layer in range(3):
        sim.run_kernel(0.001 * (layer + 1), compute)
        device.event_record(saved, compute)
        device.stream_wait_event(d2h, saved)
        device.memcpy_async(pinned, activations_ptr, 2 * MB, "host_to_host", d2h)
        device.stream_wait_event(h2d, saved)
        device.memcpy_async(restored_ptr, pinned, MB, "host_to_host", h2d)
        device.event_record(restored, h2d)
        device.stream_wait_event(compute, restored)
        seen.append((sim.clock(compute), sim.clock(d2h), sim.clock(h2d)))
    device.event_synchronize(restored)
    seen.append(sim.host_clock())
    device.synchronize()
    seen.append(sim.host_clock())
    return seen


def test_modelled_clocks_do_not_depend_on_random_delays():
    sim.set_link_bandwidth(LINK)
    quiet = offload_step_clocks()
    sim.reset()
    sim.set_link_bandwidth(LINK)
    sim.set_random_delays(max_delay_us=300, seed=4)
    assert offload_step_clocks() == quiet
    # Each kernel waits for the previous restore: the last ends at 8 ms, its restore 1 ms and its save 2 ms later.
    assert quiet[-2:] == [modelled(0.009), modelled(0.010)]


def test_modelled_time_arguments_are_checked():
    for bad in (-1, float("nan"), float("inf"), "fast", True):
        with pytest.raises(ValueError, match="bytes_per_second"):
            sim.set_link_bandwidth(bad)
    with pytest.raises(ValueError, match="seconds"):
        sim.run_kernel(-0.001)
    with pytest.raises(ValueError, match="stream"):
        sim.run_kernel(0.001, stream=-1)
    with pytest.raises(ValueError, match="stream"):
        sim.clock(stream=None)
    stream = device.stream_create()
    device.stream_destroy(stream)
    with pytest.raises(ValueError, match="not a live stream"):
        sim.clock(stream)
    with pytest.raises(ValueError, match="not a live stream"):
        sim.run_kernel(0.001, stream)
    assert (sim.clock(), sim.host_clock()) == (0, 0)


# --------------------------------------------------------------- counters, selection


def test_counters_count_every_call_by_name():
    sim.reset()
    stream, event = device.stream_create(), device.event_create()
    ptr = device.malloc(KiB)
    device.event_record(event, stream)
    device.event_synchronize(event)
    device.event_query(event)
    device.free(ptr)
    with pytest.raises(CudaError):
        device.free(ptr)  # failed calls count too
    assert sim.counters() == {
        "cudaStreamCreateWithPriority": 1,
        "cudaEventCreateWithFlags": 1,
        "cudaMalloc": 1,
        "cudaEventRecord": 1,
        "cudaEventSynchronize": 1,
        "cudaEventQuery": 1,
        "cudaFree": 2,
        # the error message of the failed free names the error
        "cudaGetErrorName": 1,
        "cudaGetErrorString": 1,
    }


def test_stream_priorities_are_clamped_to_the_reported_range():
    least, greatest = device.stream_priority_range()
    assert greatest < least
    device.stream_destroy(device.stream_create(priority=greatest - 10))
    device.stream_destroy(device.stream_create(priority=least + 10))


def test_backend_cannot_switch_after_first_use():
    device.load()
    assert device.backend() == "sim" and device.is_locked()
    with pytest.raises(ValueError, match="fixed at first use"):
        device.use_cuda()


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="nbytes"):
        device.malloc(-1)
    with pytest.raises(ValueError, match="kind"):
        device.memcpy_async(1, 2, 3, kind="sideways")
    with pytest.raises(ValueError, match="granularity"):
        sim.configure(granularity=3000)
    with pytest.raises(ValueError, match="memory"):
        sim.configure(memory="sparse")
    with pytest.raises(ValueError, match="nth"):
        sim.fail_allocations(0)
    with pytest.raises(ValueError, match="address_space"):
        sim.configure(address_space=1 << 50)  # more than x86-64 user space
    assert sim.config()["address_space"] == 1 << 36, "a rejected configuration must leave the old one"
    device.free(device.malloc(KiB))
