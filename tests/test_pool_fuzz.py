"""Randomized fuzz and multi-threaded stress of the caching pool.

The fuzz runs 10^5 operations (malloc, free, record_stream, empty_cache) over four streams,
on the pool's own virtual device (events complete after a random number of queries) and on
the simulated CUDA device (stream workers delay every operation by a random time), with
classic and with expandable segments (address ranges with pages mapped through the VMM
calls), and after every step asks the
pool to recount itself (check_invariants, C++): blocks tile their segments (so no two live
blocks overlap), free lists hold exactly the free blocks, adjacent free blocks were merged,
every statistic equals its recount, expandable segments' mapped bytes equal their blocks. Independently, Python tracks the live allocations and
checks them against the pool's statistics. The stress test runs malloc/free from several
threads at once (the bindings release the GIL).
"""
import queue
import random
import threading

import pytest
from conftest import SIM_SYNC_TIMEOUT_S

from memkernels import _C, allocator, device
from memkernels.device import sim

pytestmark = pytest.mark.cpp

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
STREAMS = (0, 1, 2, 3)


def _random_size(rng):
    kind = rng.random()
    if kind < 0.6:
        return int(2 ** rng.uniform(0, 20))  # 1 B .. 1 MiB: small pool
    if kind < 0.95:
        return int(2 ** rng.uniform(20, 25.3))  # 1 .. 40 MiB
    return int(2 ** rng.uniform(25.3, 27.6))  # 40 .. 200 MiB: oversize blocks, OOM near the cap


def _check_live(pool, live):
    stats = pool.stats()
    assert stats["allocation"]["current"] == len(live)
    assert stats["requested_bytes"]["current"] == sum(size for size, _ in live.values())
    intervals = sorted((addr, addr + size) for addr, (size, _) in live.items())
    for (_, end), (start, _) in zip(intervals, intervals[1:]):
        assert end <= start, "two live allocations overlap"


def _virtual_device(rng):
    """The pool's own virtual device; events complete after 0..8 queries."""
    events = _C.DelayedEvents(8, rng.getrandbits(32))
    upstream = _C.VirtualUpstream(GiB)
    return events, upstream.used, STREAMS, (lambda config: _C.Pool(config, upstream, events))


def _simulated_device(rng):
    """The simulated CUDA device: segments by cudaMalloc, events on worker-run streams that
    sleep a random 0..50 us before each operation."""
    device.use_sim()
    sim.configure(device_count=1, capacity=GiB, host_capacity=None, granularity=2 * MiB, memory="virtual",
                  address_space=4 * GiB, sync_timeout_s=SIM_SYNC_TIMEOUT_S)
    sim.set_random_delays(max_delay_us=50, seed=rng.getrandbits(32))
    streams = [0] + [device.stream_create() for _ in range(3)]
    used = lambda: sim.stats()["devices"][0]["bytes_in_use"]  # noqa: E731
    return None, used, streams, _C.make_device_pool


@pytest.fixture
def reset_sim():
    yield
    if device.backend() == "sim":
        sim.set_random_delays(0, 0)
        sim.reset()


@pytest.mark.parametrize(
    "device_kind, policy, steps, expandable",
    [
        ("virtual", "memkernels", 100_000, False),
        ("virtual", "pytorch", 30_000, False),
        ("simulated", "memkernels", 100_000, False),
        ("virtual", "memkernels", 100_000, True),
        ("simulated", "memkernels", 100_000, True),
    ],
)
def test_fuzz_invariants_hold_after_every_step(device_kind, policy, steps, expandable, reset_sim):
    rng = random.Random(random.getrandbits(64))  # conftest seeds `random` per test
    make_device = _virtual_device if device_kind == "virtual" else _simulated_device
    events, device_used, streams, make_pool = make_device(rng)
    pool = make_pool(allocator.pool_config(policy=policy, expandable_segments=expandable))
    live = {}  # addr -> (requested size, stream)
    addrs = []
    counts = dict.fromkeys(("malloc", "free", "oom", "record_stream", "empty_cache", "drain"), 0)
    for step in range(steps):
        action = rng.random()
        live_bytes = sum(size for size, _ in live.values()) if step % 64 == 0 else 0
        if not addrs or (action < 0.5 and live_bytes < 700 * MiB):
            size, stream = _random_size(rng), rng.choice(streams)
            try:
                addr = pool.malloc(size, stream)
            except _C.OutOfMemoryError:
                counts["oom"] += 1
            else:
                assert addr not in live
                live[addr] = (size, stream)
                addrs.append(addr)
                counts["malloc"] += 1
        elif action < 0.95:
            index = rng.randrange(len(addrs))
            addrs[index], addrs[-1] = addrs[-1], addrs[index]
            addr = addrs.pop()
            del live[addr]
            assert pool.free(addr)
            counts["free"] += 1
        elif action < 0.995:
            addr = rng.choice(addrs)
            pool.record_stream(addr, rng.choice(streams))
            counts["record_stream"] += 1
        elif action < 0.999:
            pool.empty_cache()
            counts["empty_cache"] += 1
        else:  # free everything: after empty_cache nothing may stay reserved
            for addr in addrs:
                assert pool.free(addr)
            addrs.clear()
            live.clear()
            pool.empty_cache()
            assert pool.stats()["reserved_bytes"]["current"] == 0 and device_used() == 0
            counts["drain"] += 1
        pool.check_invariants()
        if step % 101 == 0:
            _check_live(pool, live)
    # every path was exercised, and the final drain gives everything back
    assert all(counts.values()), counts
    for addr in addrs:
        assert pool.free(addr)
    pool.empty_cache()
    pool.check_invariants()
    stats = pool.stats()
    assert stats["reserved_bytes"]["current"] == 0 and device_used() == 0 and stats["segment"]["current"] == 0
    if expandable:  # every page was mapped and unmapped through the upstream
        assert stats["num_device_alloc"] > 0 and stats["num_device_free"] > 0
    else:
        assert stats["num_device_alloc"] == stats["num_device_free"]
    if device_kind == "simulated":  # no mapping or address range outlives the pool's cache
        assert sim.stats()["mapped_bytes"] == 0 and sim.stats()["reserved_bytes"] == 0
    if events is not None:
        assert events.live_events() == 0
    else:  # ordering really went through the simulated device's events
        counters = sim.counters()
        assert counters["cudaEventRecord"] >= counts["free"] and counters["cudaEventQuery"] > 0


@pytest.mark.parametrize("expandable", [False, True])
def test_stress_concurrent_malloc_free_from_threads(expandable):
    threads, steps = 4, 15_000
    base_seed = random.getrandbits(64)
    events = _C.DelayedEvents(4, base_seed)
    upstream = _C.VirtualUpstream(64 * GiB)
    pool = _C.Pool(allocator.pool_config(expandable_segments=expandable), upstream, events)
    owners, owners_lock = {}, threading.Lock()
    handoff = queue.Queue()  # allocations freed by a thread other than the one that made them
    errors = []

    def take(addr, who):
        with owners_lock:
            assert addr not in owners, f"address {addr:#x} handed to {who} while {owners.get(addr)} holds it"
            owners[addr] = who

    def give_back(addr):
        with owners_lock:  # drop ownership before the pool may hand the address out again
            del owners[addr]
        assert pool.free(addr)

    def worker(index):
        rng = random.Random(base_seed + index)
        stream, mine = STREAMS[index % len(STREAMS)], []
        try:
            for _ in range(steps):
                action = rng.random()
                if action < 0.5 or not mine:
                    addr = pool.malloc(_random_size(rng) // 4 + 1, stream)
                    take(addr, index)
                    mine.append(addr)
                elif action < 0.85:
                    give_back(mine.pop(rng.randrange(len(mine))))
                elif action < 0.95:
                    pool.record_stream(rng.choice(mine), rng.choice(STREAMS))
                else:
                    handoff.put(mine.pop())
                    try:
                        give_back(handoff.get_nowait())
                    except queue.Empty:
                        pass
            for addr in mine:
                give_back(addr)
        except Exception as error:  # reported from the main thread
            errors.append(error)

    def checker(stop):
        # A pause between checks: back to back, the checker re-took the pool's mutex (not fair) as soon as it
        # let go, each check a walk over every block, and the workers' 60,000 steps took 70-340 s instead of
        # 0.3 s (about 250 checks now interleave with them).
        while not stop.wait(0.001):
            pool.check_invariants()

    stop = threading.Event()
    watcher = threading.Thread(target=checker, args=(stop,))
    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    watcher.start()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    watcher.join()
    assert not errors, errors
    while not handoff.empty():
        give_back(handoff.get())
    assert not owners
    pool.empty_cache()
    pool.check_invariants()
    stats = pool.stats()
    assert stats["allocation"]["current"] == 0 and stats["reserved_bytes"]["current"] == 0
    assert upstream.used() == 0 and upstream.mapped() == 0
    assert stats["allocation"]["allocated"] >= threads * steps // 3
