"""Trace replay: a recorded PyTorch memory snapshot through memkernels' pool and PyTorch's policy.

``replay(trace)`` runs a recorded snapshot (``torch.cuda.memory._dump_snapshot``) through
memkernels' pool on a device that hands out virtual addresses (no memory is touched, so an
80 GB trace replays on a laptop), and ``print_replay_table`` puts what PyTorch's policy did (a
model of it, :mod:`memkernels.forensics._torch_policy`), what memkernels does, and the ideal (peak
live bytes) side by side: that is ``memkernels replay TRACE...``. ``replay_periodic(trace, steps=N)``
repeats a trace as the step of a loop and counts both policies' device allocations and frees per step.
"""
import os
import pickle
import statistics
import sys
import textwrap

from memkernels.forensics._torch_policy import ModelOutOfMemory, TorchExpandablePolicyModel, TorchPolicyModel
from memkernels.runtime.allocator import core, pool_config
from memkernels.runtime.sizes import format_size

# With no capacity given, the pool's own virtual device has this much memory (it never refuses)...
UNLIMITED_CAPACITY = 1 << 50
# ... and the simulated device this much: it reserves its whole address range up front, and
# 128 GiB fits anywhere (ThreadSanitizer leaves about 256 GiB) while holding any 80 GB GPU's trace.
SIMULATED_DEFAULT_CAPACITY = 128 << 30

_REPLAY_ACTIONS = ("alloc", "free_completed")


# ---------------------------------------------------------------------- traces


class _DataOnlyUnpickler(pickle.Unpickler):
    """Snapshots are plain data: refuse every global so that no code can run from a file."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(
            f"trace refers to {module}.{name}; memkernels loads only plain-data snapshots "
            "(dicts, lists, strings, numbers) and never imports code from a trace file"
        )


class TraceError(ValueError):
    """A trace file that is not a readable ``torch.cuda.memory._dump_snapshot`` pickle; names the file."""


_SNAPSHOT = "a torch.cuda.memory._dump_snapshot pickle"


def trace_files(paths):
    """Expand ``paths`` (trace files and directories) to trace files: a directory gives its
    ``*.pickle`` files, sorted. Raises FileNotFoundError for a path that does not exist and
    TraceError for a directory with no ``*.pickle`` in it."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = []
    for path in map(os.fspath, paths):
        if os.path.isdir(path):
            found = sorted(os.path.join(path, name) for name in os.listdir(path) if name.endswith(".pickle"))
            if not found:
                raise TraceError(f"trace directory {path!r} has no *.pickle files; expected {_SNAPSHOT} in it")
            files += found
        elif os.path.exists(path):
            files.append(path)
        else:
            raise FileNotFoundError(f"no such file or directory {path!r} (a memory snapshot pickle, or a directory of them)")
    return files


def _unpickle(path):
    if os.path.isdir(path):
        raise TraceError(f"trace {path!r} is a directory; pass the snapshot pickles in it "
                         "(memkernels replay and trace_files() take a directory)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file {path!r} (a memory snapshot pickle)")
    with open(path, "rb") as f:
        try:
            return _DataOnlyUnpickler(f).load()
        # A corrupt pickle raises whatever its opcodes lead to (EOFError, UnpicklingError,
        # IndexError, KeyError, ValueError, ...): every one means the same thing here.
        except Exception as error:  # noqa: BLE001
            reason = "the file is empty" if os.path.getsize(path) == 0 else f"{type(error).__name__}: {error}"
            raise TraceError(f"trace {path!r} is not {_SNAPSHOT} ({reason})") from None


def load_trace(trace):
    """A snapshot dict from a path (a ``_dump_snapshot`` pickle) or an already loaded dict.

    Raises FileNotFoundError for a missing file and :class:`TraceError` (a ValueError naming the
    file) for a directory, an empty or corrupt pickle, or one that is not a snapshot.
    """
    where = "trace"
    if isinstance(trace, (str, os.PathLike)):
        where = f"trace {os.fspath(trace)!r}"
        trace = _unpickle(os.fspath(trace))
    if not isinstance(trace, dict) or not isinstance(trace.get("device_traces"), list):
        raise TraceError(
            f"{where} must be {_SNAPSHOT} or its loaded dict with a 'device_traces' list, got "
            f"{type(trace).__name__}{' without a device_traces list' if isinstance(trace, dict) else ''} "
            "(record with torch.cuda.memory._record_memory_history first)"
        )
    return trace


def _device_events(snapshot, device):
    traces = snapshot["device_traces"]
    if not isinstance(device, int) or isinstance(device, bool) or not 0 <= device < len(traces):
        raise ValueError(f"device must be an index into the trace's {len(traces)} device_traces, got {device!r}")
    events = traces[device]
    if not isinstance(events, list) or not all(isinstance(event, dict) for event in events):
        raise TraceError(f"trace's device_traces[{device}] must be a list of event dicts (PyTorch's snapshot "
                         f"format), got {type(events).__name__}" + (" holding other things" if isinstance(
                             events, list) else ""))
    return events


def trace_ops(events):
    """Turn trace events into pool steps ``(slot, is_alloc, size, stream)``.

    Replays ``alloc`` and ``free_completed`` in order. Recording starts mid-run, so a free of
    an address never allocated in the trace belongs to an earlier allocation and is skipped.
    Returns ``(ops, num_slots, peak_requested_bytes)``.
    """
    ops, slot_of, spare, live_bytes, peak = [], {}, [], 0, 0
    num_slots = 0
    for index, event in enumerate(events):
        action = event.get("action")
        if action not in _REPLAY_ACTIONS:
            continue
        addr, size, stream = event.get("addr"), event.get("size"), event.get("stream", 0)
        if not all(isinstance(v, int) and v >= 0 for v in (addr, size, stream)):
            raise TraceError(f"trace event {index} ({action}) needs non-negative int addr, size and stream, "
                             f"got addr={addr!r}, size={size!r}, stream={stream!r}")
        if action == "alloc":
            if addr in slot_of:
                raise ValueError(f"trace allocates address {addr:#x} twice without freeing it")
            slot = spare.pop() if spare else num_slots
            num_slots = max(num_slots, slot + 1)
            slot_of[addr] = (slot, size)
            ops.append((slot, True, size, stream))
            live_bytes += size
            peak = max(peak, live_bytes)
        elif addr in slot_of:
            slot, size = slot_of.pop(addr)
            ops.append((slot, False, 0, stream))
            spare.append(slot)
            live_bytes -= size
    return ops, num_slots, peak


# ---------------------------------------------------------------------- pools


def _check_capacity(capacity):
    if capacity is None:
        return None
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
        raise ValueError(f"capacity must be a positive number of bytes or None (unlimited), got {capacity!r}")
    return capacity


def _simulated_device_pool(device, capacity, settings):
    """A pool over the device table on the simulated device, reconfigured for replay."""
    from memkernels.runtime import device as device_module

    device_module.use_sim()  # ValueError if real CUDA is already in use in this process
    capacity = SIMULATED_DEFAULT_CAPACITY if capacity is None else capacity
    device_count = device + 1
    # Expandable segments reserve an address range the size of the device per (stream, pool).
    ranges = 4 if settings.expandable_segments else 1
    device_module.sim.configure(
        device_count=device_count, capacity=capacity, memory="virtual", address_space=capacity * device_count * ranges
    )
    return core().make_device_pool(settings)


def run_pool(ops, num_slots, device, capacity, config, simulated_device=False):
    C = core()
    settings = pool_config(**config)
    if simulated_device:
        pool = _simulated_device_pool(device, capacity, settings)
    else:
        pool = C.Pool(settings, C.VirtualUpstream(UNLIMITED_CAPACITY if capacity is None else capacity))
    run = pool.replay(ops, num_slots, device)
    return pool.stats(device), run


def replay(trace, *, device=0, expandable_segments=False, capacity=None, simulated_device=False, **config):
    """Replay a recorded PyTorch trace through memkernels' pool; returns its statistics.

    Args:
        trace: path to a ``torch.cuda.memory._dump_snapshot`` pickle, or the loaded dict.
        device: which of the trace's ``device_traces`` to replay.
        expandable_segments: one virtual address range per (stream, pool) with physical pages
            mapped on demand and unmapped when free (docs/allocator.md, "Expandable segments").
        capacity: device memory in bytes; None for unlimited (128 GiB on the simulated
            device, which reserves its address range up front). Allocations the device cannot
            hold after release-and-retry count in ``num_ooms`` and are skipped.
        simulated_device: run on the simulated CUDA device (virtual memory) through the same
            device upstream and cudaEvent ordering that serve a GPU, instead of the pool's own
            virtual-address device. This selects and reconfigures the simulated device for the
            whole process, and ns_per_op then includes the simulated CUDA calls.
        **config: pool options (``csrc/core/policy.hpp`` / ``PoolConfig``), e.g.
            ``release_before_growth``, ``memory_cap_bytes``, ``gc_threshold``; and
            ``policy='pytorch'`` to run PyTorch's rules in memkernels' pool engine.

    Returns a dict: peak_requested_bytes, peak_allocated_bytes, peak_reserved_bytes,
    num_device_alloc, num_device_free, num_alloc_retries; num_ooms (allocations the device could
    not hold: the trace did not fit ``capacity`` when it is above 0, and the peaks then describe
    a different run than the recorded one); first_oom (None, or the first failed allocation as
    a dict: ``request``, its 1-based number among the trace's allocations, ``size``, ``stream``,
    and ``live_bytes``, what the trace had live just before it); ns_per_op (wall time of the
    pool calls over the number of mallocs and frees) and ops.
    """
    if not isinstance(expandable_segments, bool):
        raise ValueError(f"expandable_segments must be True or False, got {expandable_segments!r}")
    capacity = _check_capacity(capacity)
    ops, num_slots, _ = trace_ops(_device_events(load_trace(trace), device))
    config = dict(config, expandable_segments=expandable_segments)
    stats, run = run_pool(ops, num_slots, device, capacity, config, simulated_device)
    return summary(stats, run, ops)


def summary(stats, run, ops):
    return {
        "peak_requested_bytes": stats["requested_bytes"]["peak"],
        "peak_allocated_bytes": stats["allocated_bytes"]["peak"],
        "peak_reserved_bytes": stats["reserved_bytes"]["peak"],
        "num_device_alloc": stats["num_device_alloc"],
        "num_device_free": stats["num_device_free"],
        "num_alloc_retries": stats["num_alloc_retries"],
        "num_ooms": run["failed_allocs"],
        "first_oom": _failed_request(ops, run["first_failed_op"]),
        "ns_per_op": run["elapsed_ns"] / max(run["ops"], 1),
        "ops": run["ops"],
    }


def _failed_request(ops, index):
    """The allocation ``ops[index]`` as a dict: ``request`` (its 1-based number among the trace's
    allocations), ``size`` and ``stream``, and ``live_bytes``: what the trace itself had live just
    before it (independent of which earlier requests the policy could not serve). None for -1."""
    if index < 0:
        return None
    sizes, live, request = {}, 0, 0
    for slot, is_alloc, size, _ in ops[:index]:
        if is_alloc:
            sizes[slot], request = size, request + 1
            live += size
        else:
            live -= sizes.pop(slot, 0)
    _, _, size, stream = ops[index]
    return {"request": request + 1, "size": size, "stream": stream, "live_bytes": live}


# ---------------------------------------------------------------------- PyTorch's policy


def replay_pytorch_model(trace, *, device=0, capacity=None, expandable_segments=False):
    """Replay through the model of PyTorch's caching allocator (:mod:`memkernels.forensics._torch_policy`).

    ``expandable_segments=True`` models ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
    Returns the keys of :func:`replay` (without ns_per_op and ops: the model is Python) plus
    ``segment_sizes``, every segment it took from the device (expandable: every mapping), in order,
    and ``final_segment_sizes``, the classic segments it still holds at the end.
    """
    if not isinstance(expandable_segments, bool):
        raise ValueError(f"expandable_segments must be True or False, got {expandable_segments!r}")
    capacity = _check_capacity(capacity)
    ops, num_slots, _ = trace_ops(_device_events(load_trace(trace), device))
    model = (TorchExpandablePolicyModel if expandable_segments else TorchPolicyModel)(capacity=capacity)
    slots = [None] * num_slots
    sizes = [0] * num_slots
    requested = peak_requested = 0
    first_failed_op = -1
    for index, (slot, is_alloc, size, stream) in enumerate(ops):
        if is_alloc:
            try:
                slots[slot] = model.malloc(size, stream)
            except ModelOutOfMemory:
                slots[slot] = None
                if first_failed_op < 0:
                    first_failed_op = index
                continue
            sizes[slot] = size
            requested += size
            peak_requested = max(peak_requested, requested)
        elif slots[slot] is not None:
            model.free(slots[slot])
            slots[slot] = None
            requested -= sizes[slot]
    return {
        "peak_requested_bytes": peak_requested,
        "peak_allocated_bytes": model.peak_allocated,
        "peak_reserved_bytes": model.peak_reserved,
        "num_device_alloc": model.num_device_alloc,
        "num_device_free": model.num_device_free,
        "num_alloc_retries": model.num_alloc_retries,
        "num_ooms": model.num_ooms,
        "first_oom": _failed_request(ops, first_failed_op),
        "segment_sizes": model.map_calls if expandable_segments else model.segment_sizes,
        "final_segment_sizes": [] if expandable_segments else sorted(model.live_segments.values()),
    }


ALLOCATION_CAUSES = ("no_fit", "oversize", "released", "refused")


def device_allocation_causes(trace, *, device=0, capacity=None, **config):
    """Why memkernels' pool asks the device for memory, request by request, next to PyTorch's policy.

    Replays ``trace`` (classic segments) through the pool one call at a time, with
    :mod:`memkernels.forensics._torch_policy` in lockstep, and files each of the pool's device allocations
    under one cause (the first that applies):

    - ``refused``: the device refused the segment and the pool released its cache and retried;
    - ``released``: the pool first released idle whole segments (its release-before-growth rule);
    - ``oversize``: a free block of the stream was large enough but the oversize rule kept the
      request off it (``oversize_block`` / ``oversize_ratio``);
    - ``no_fit``: no free block of the stream was large enough.

    Returns a dict with, for each cause, ``{"pool": n, "pytorch_too": m}``: ``m`` of the pool's
    ``n`` allocations of that cause were requests on which PyTorch's policy also allocated. The
    rest (``n - m``) are the pool's extra device allocations. Plus ``num_device_alloc`` of both.
    A request one side cannot hold (out of memory) is skipped by that side, as in :func:`replay`.
    Slow (one Python call and a walk of the free blocks per request): a diagnosis, not a benchmark.
    ``**config``: pool options as for :func:`replay`, classic segments only.
    """
    if config.get("expandable_segments"):
        raise ValueError("device_allocation_causes replays classic segments; expandable segments map pages instead "
                         "of allocating segments: drop expandable_segments=True")
    capacity = _check_capacity(capacity)
    ops, num_slots, _ = trace_ops(_device_events(load_trace(trace), device))
    C = core()
    settings = pool_config(**config)
    pool = C.Pool(settings, C.VirtualUpstream(UNLIMITED_CAPACITY if capacity is None else capacity))
    policy = settings.policy
    model = TorchPolicyModel(capacity=capacity)
    ours, theirs = [None] * num_slots, [None] * num_slots
    causes = {cause: {"pool": 0, "pytorch_too": 0} for cause in ALLOCATION_CAUSES}
    for slot, is_alloc, size, stream in ops:
        if not is_alloc:
            if ours[slot] is not None:
                pool.free(ours[slot], device)
            if theirs[slot] is not None:
                model.free(theirs[slot])
            ours[slot] = theirs[slot] = None
            continue
        rounded = policy.round_size(size)
        # A free block of the stream and pool that is large enough: only the oversize rule keeps a
        # request off the smallest such block (replay has no events, so blocks stay with their stream).
        fits = any(b["state"] == "inactive" and b["size"] >= rounded for s in pool.segments(device)
                   if s["stream"] == stream and s["segment_type"] == policy.pool_for(rounded) for b in s["blocks"])
        before = pool.stats(device)
        try:
            ours[slot] = pool.malloc(size, stream, device)
        except C.OutOfMemoryError:
            pass
        model_allocs = model.num_device_alloc
        try:
            theirs[slot] = model.malloc(size, stream)
        except ModelOutOfMemory:
            pass
        after = pool.stats(device)
        if after["num_device_alloc"] == before["num_device_alloc"]:
            continue
        if after["num_alloc_retries"] > before["num_alloc_retries"]:
            cause = "refused"
        elif after["num_early_releases"] > before["num_early_releases"]:
            cause = "released"
        elif fits:
            cause = "oversize"
        else:
            cause = "no_fit"
        causes[cause]["pool"] += 1
        causes[cause]["pytorch_too"] += model.num_device_alloc > model_allocs
    return dict(causes, num_device_alloc={"pool": pool.stats(device)["num_device_alloc"],
                                          "pytorch": model.num_device_alloc})


def _longest_common_subsequence(a, b):
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def _multiset_found(wanted, available):
    """How many of ``wanted`` are in ``available``, each element of ``available`` used once."""
    remaining = {}
    for size in available:
        remaining[size] = remaining.get(size, 0) + 1
    found = 0
    for size in wanted:
        if remaining.get(size, 0) > 0:
            remaining[size] -= 1
            found += 1
    return found


def segment_match(trace, *, device=0):
    """How closely the PyTorch-policy model reproduces the segments the trace recorded.

    Three sources, the first the trace has:

    - ``segment_alloc`` events (classic segments): the model's sizes against them, in order;
    - ``segment_map`` events (recorded with expandable segments): the expandable model's mappings;
    - else the ``segments`` the snapshot held when it was dumped (classic): the model's segments
      at the end of the replay must all be among them (the snapshot may hold more, taken before
      recording started).

    Returns None when the trace has none of these, else a dict: ``source``, ``trace_segments``
    and ``model_segments`` (counts), ``in_order`` (events only: fraction of the trace's sizes found
    in the model's sequence in the same order, longest common subsequence / trace count; None for
    the snapshot's segments) and ``as_multiset`` (events: fraction of the trace's sizes the model
    also took; snapshot: fraction of the model's final segments found among the snapshot's).
    The model starts from an empty cache while recording started mid-run, so it may take
    segments the trace already held.
    """
    snapshot = load_trace(trace)
    events = _device_events(snapshot, device)
    for action, expandable in (("segment_alloc", False), ("segment_map", True)):
        recorded = [e.get("size") for e in events if e.get("action") == action]
        if not all(isinstance(size, int) for size in recorded):
            raise TraceError(f"trace has a {action} event without an int size")
        if recorded:
            modeled = replay_pytorch_model(snapshot, device=device, expandable_segments=expandable)["segment_sizes"]
            return {
                "source": f"{action} events",
                "trace_segments": len(recorded),
                "model_segments": len(modeled),
                "in_order": _longest_common_subsequence(recorded, modeled) / len(recorded),
                "as_multiset": _multiset_found(recorded, modeled) / len(recorded),
            }
    held = [s["total_size"] for s in snapshot.get("segments", [])
            if s.get("device", 0) == device and not s.get("is_expandable", False)]
    if not held:
        return None
    modeled = replay_pytorch_model(snapshot, device=device)["final_segment_sizes"]
    return {
        "source": "segments held at the dump",
        "trace_segments": len(held),
        "model_segments": len(modeled),
        "in_order": None,
        "as_multiset": _multiset_found(modeled, held) / len(modeled) if modeled else 1.0,
    }


# ---------------------------------------------------------------------- periodic loops


def periodic_ops(events, steps):
    """The trace's events as one step of a loop, repeated ``steps`` times, as pool steps.

    A recorded step leaves some allocations live at its end. Those the trace's own frees of
    earlier allocations pair with (a free of an address allocated before recording started,
    matched by size and stream, in order) are *carried*: allocated in one step, freed by the
    next (a step's output, the loss). The others are *persistent* (parameters, optimizer
    state, or what a forward-only trace keeps): allocated once, in step 1, and kept. Everything
    the trace frees itself is repeated every step. Step 1 is the trace as :func:`trace_ops`
    replays it.

    Returns ``(ops, num_slots, step_starts, persistent, carried)``: pool steps as
    :func:`trace_ops` gives them, the index in ``ops`` where each step starts, and how many of the
    trace's allocations are persistent and carried.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be a positive int (repetitions of the trace), got {steps!r}")
    trace_ops(events)  # validates the events (and refuses an address allocated twice)
    entries, alloc_of, unmatched = [], {}, []
    for event in events:
        action = event.get("action")
        if action == "alloc":
            alloc_of[event["addr"]] = len(entries)
            entries.append(["alloc", event["size"], event.get("stream", 0), False])  # [.., freed in the trace]
        elif action == "free_completed":
            if event["addr"] in alloc_of:
                index = alloc_of.pop(event["addr"])
                entries[index][3] = True
                entries.append(["free", index])
            else:
                unmatched.append(len(entries))
                entries.append(["carry_free", None, event.get("size", 0), event.get("stream", 0)])
    live_at_end = [i for i, entry in enumerate(entries) if entry[0] == "alloc" and not entry[3]]
    carried = set()
    for position in unmatched:  # pair each free of an earlier allocation with a block the trace leaves live
        _, _, size, stream = entries[position]
        for index in live_at_end:
            if index not in carried and entries[index][1] == size and entries[index][2] == stream:
                carried.add(index)
                entries[position][1] = index
                break
    ops, slot_of, spare, num_slots, step_starts = [], {}, [], 0, []
    for step in range(steps):
        step_starts.append(len(ops))
        for index, entry in enumerate(entries):
            kind = entry[0]
            if kind == "alloc":
                if step > 0 and not entry[3] and index not in carried:
                    continue  # persistent: allocated once
                slot = spare.pop() if spare else num_slots
                num_slots = max(num_slots, slot + 1)
                slot_of[step, index] = slot
                ops.append((slot, True, entry[1], entry[2]))
            else:
                owner = (step, entry[1]) if kind == "free" else (step - 1, entry[1])
                if owner not in slot_of:  # a free of something never allocated here (step 1, unpaired)
                    continue
                slot = slot_of.pop(owner)
                ops.append((slot, False, 0, entries[owner[1]][2]))
                spare.append(slot)
    persistent = len(live_at_end) - len(carried)
    return ops, num_slots, step_starts, persistent, len(carried)


def replay_periodic(trace, *, steps=6, device=0, capacity=None, expandable_segments=False, **config):
    """Replay ``trace`` as one step of a loop, ``steps`` times (:func:`periodic_ops`), through
    memkernels' pool and the model of PyTorch's policy; count device allocations and frees per step.

    A device allocation inside a step is a ``cudaMalloc`` (a device synchronization) paid by that
    step, a device free a ``cudaFree``; once a loop repeats, a cache that keeps what the loop
    needs makes neither. With expandable segments the counts are page mappings and unmappings.
    memkernels' pool is told where each step ends (``end_step``, as ``install()``'s optimizer hook
    does), so from step 3 on it runs the loop under its repeating-loop rules (docs/allocator.md).

    Returns a dict: ``steps``, ``persistent`` and ``carried`` (see :func:`periodic_ops`),
    ``ideal_peak_bytes`` (peak live bytes of the loop) and, for ``"memkernels"`` and
    ``"pytorch"``: ``device_allocs`` and ``device_frees`` (one count per step), and
    ``peak_reserved_bytes``, ``peak_requested_bytes``, ``num_ooms`` of the whole loop.
    ``capacity`` and ``**config``: as for :func:`replay` (pool options apply to memkernels' pool).
    """
    if not isinstance(expandable_segments, bool):
        raise ValueError(f"expandable_segments must be True or False, got {expandable_segments!r}")
    capacity = _check_capacity(capacity)
    events = _device_events(load_trace(trace), device)
    ops, num_slots, step_starts, persistent, carried = periodic_ops(events, steps)
    ideal = live = 0
    sizes = [0] * num_slots
    for slot, is_alloc, size, _ in ops:
        if is_alloc:
            sizes[slot] = size
            live += size
            ideal = max(ideal, live)
        else:
            live -= sizes[slot]
    ends = step_starts[1:] + [len(ops)]

    C = core()
    pool = C.Pool(pool_config(**dict(config, expandable_segments=expandable_segments)),
                  C.VirtualUpstream(UNLIMITED_CAPACITY if capacity is None else capacity))

    def pool_counts():
        stats = pool.stats(device)
        return stats["num_device_alloc"], stats["num_device_free"]

    def pool_malloc(size, stream):
        try:
            return pool.malloc(size, stream, device)
        except C.OutOfMemoryError:
            return None

    model = (TorchExpandablePolicyModel if expandable_segments else TorchPolicyModel)(capacity=capacity)

    def model_malloc(size, stream):
        try:
            return model.malloc(size, stream)
        except ModelOutOfMemory:
            return None

    result = {"steps": steps, "persistent": persistent, "carried": carried, "ideal_peak_bytes": ideal}
    for name, malloc, free, counts in (
        ("memkernels", pool_malloc, lambda addr: pool.free(addr, device), pool_counts),
        ("pytorch", model_malloc, model.free, lambda: (model.num_device_alloc, model.num_device_free)),
    ):
        held, held_sizes, ooms, allocs, frees = [None] * num_slots, [0] * num_slots, 0, [], []
        requested = peak_requested = 0
        for start, end in zip(step_starts, ends):
            before = counts()
            for slot, is_alloc, size, stream in ops[start:end]:
                if is_alloc:
                    held[slot] = malloc(size, stream)
                    if held[slot] is None:
                        ooms += 1
                        continue
                    held_sizes[slot] = size
                    requested += size
                    peak_requested = max(peak_requested, requested)
                elif held[slot] is not None:
                    free(held[slot])
                    held[slot] = None
                    requested -= held_sizes[slot]
            if name == "memkernels":
                pool.end_step(device)  # the optimizer's step under install()
            after = counts()
            allocs.append(after[0] - before[0])
            frees.append(after[1] - before[1])
        peak_reserved = pool.stats(device)["reserved_bytes"]["peak"] if name == "memkernels" else model.peak_reserved
        result[name] = {"device_allocs": allocs, "device_frees": frees, "peak_reserved_bytes": peak_reserved,
                        "peak_requested_bytes": peak_requested, "num_ooms": ooms}
    return result


# ---------------------------------------------------------------------- comparison


def compare(trace, *, device=0, capacity=None, repeats=5, simulated_device=False, expandable_segments=False,
            **config):
    """PyTorch's policy (model), memkernels and the ideal on one trace, as a dict of dicts.

    memkernels' ``ns_per_op`` is the median over ``repeats`` fresh replays (the machine is
    shared, single runs are noisy). ``expandable_segments`` applies to both columns.
    """
    if not isinstance(expandable_segments, bool):
        raise ValueError(f"expandable_segments must be True or False, got {expandable_segments!r}")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats <= 0:
        raise ValueError(f"repeats must be a positive int (replays for the ns/op median), got {repeats!r}")
    snapshot = load_trace(trace)
    capacity_bytes = _check_capacity(capacity)
    ops, num_slots, peak_live = trace_ops(_device_events(snapshot, device))
    config = dict(config, expandable_segments=expandable_segments)
    runs = [
        run_pool(ops, num_slots, device, capacity_bytes, config, simulated_device) for _ in range(repeats)
    ]
    memkernels = summary(*runs[0], ops)
    memkernels["ns_per_op"] = statistics.median(run["elapsed_ns"] / max(run["ops"], 1) for _, run in runs)
    return {
        "pytorch": replay_pytorch_model(
            snapshot, device=device, capacity=capacity, expandable_segments=expandable_segments
        ),
        "memkernels": memkernels,
        "ideal_peak_bytes": peak_live,
        "segment_match": segment_match(snapshot, device=device),
        "ops": len(ops),
        "requests": sum(1 for op in ops if op[1]),
    }


def _ratio(result, ideal):
    return result["peak_reserved_bytes"] / ideal if ideal else float("nan")


def _fit_text(result, requests, capacity):
    """Whether one policy's replay fit ``capacity``; for a run that did not, how many requests
    failed and the first of them."""
    first = result["first_oom"]
    if first is None:
        return f"fits in {format_size(capacity)} (peak reserved {format_size(result['peak_reserved_bytes'])})"
    return (
        f"does NOT fit in {format_size(capacity)}: {result['num_ooms']:,} of {requests:,} requests failed; the "
        f"first is request {first['request']:,} ({format_size(first['size'])} on stream {first['stream']}, with "
        f"{format_size(first['live_bytes'])} live before it)"
    )


_NAME_WIDTH = 30  # trace names longer than this are cut, with "..."
_TEXT_WIDTH = 100  # the notes under the table are wrapped to this width


def print_replay_table(traces, *, device=None, capacity=None, repeats=5, simulated_device=False, file=None,
                       on_error=None, **config):
    """Print PyTorch's policy vs memkernels vs ideal for each trace (and each device in it).

    ``device=None`` replays every device that has events. Under a ``capacity``, a line per policy
    says whether the trace fit, how many requests failed and the first that did; a run that did
    not fit prints ``OOM`` instead of its ratio (its peaks are those of a different run).
    ``on_error``: None raises for a trace that cannot be read; else it is called with the
    message (naming the file) and the trace is skipped. Returns the list of rows printed (dicts
    from :func:`compare` plus ``trace`` and ``device``).
    """
    out = file if file is not None else sys.stdout
    if isinstance(traces, (str, os.PathLike, dict)):  # one trace, not an iterable of them
        traces = [traces]
    # Under 100 columns: the model-vs-recorded check goes on its own line under each row.
    header = (
        f"{'trace':<{_NAME_WIDTH}} {'dev':>3} {'ideal peak':>11} | {'PyTorch':>7} {'dev.alloc':>9} | "
        f"{'memkernels':>10} {'dev.alloc':>9} {'ns/op':>7}"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    rows = []
    for path in traces:
        try:
            rows += _print_replay_rows(path, device, capacity, repeats, simulated_device, config, out)
        except (TraceError, FileNotFoundError) as error:
            if on_error is None:
                raise
            on_error(str(error))
    unchecked = [f"{row['trace']} (device {row['device']})" for row in rows if row["segment_match"] is None]
    print(textwrap.fill("model of PyTorch checked against recorded segments on every trace but: "
                        + (", ".join(unchecked) if unchecked else "none"), _TEXT_WIDTH), file=out)
    where = "the simulated CUDA device (virtual memory)" if simulated_device else "a virtual-address device"
    print(textwrap.fill(
        "ideal peak: the most bytes live at once among the allocations the trace records (blocks allocated before "
        "the recording began are not replayed; explain's peak of live allocations includes them). "
        "ratios: peak reserved / peak requested (ideal = 1.000). PyTorch: a model of its documented policy; "
        f"ns/op: memkernels' pool, median of runs, on {where}."
        + (" Expandable segments in both columns; dev.alloc counts page mappings." if config.get(
            "expandable_segments") else "")
        + (f" Under the {format_size(capacity)} capacity, a ratio column reads OOM for a policy that ran out of "
           "memory (the lines under each row say which)." if capacity is not None else ""),
        _TEXT_WIDTH), file=out)
    return rows


def _print_replay_rows(path, device, capacity, repeats, simulated_device, config, out):
    snapshot = load_trace(path)
    name = os.path.basename(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else "<dict>"
    count = len(snapshot["device_traces"])
    if device is not None and not 0 <= device < count:
        raise TraceError(f"trace {name!r} records {count} device(s) (device_traces); device {device} is not one")
    devices = range(count) if device is None else [device]
    rows = []
    for d in devices:
        if device is None and not any(e.get("action") == "alloc" for e in _device_events(snapshot, d)):
            continue
        row = compare(
            snapshot, device=d, capacity=capacity, repeats=repeats, simulated_device=simulated_device, **config
        )
        row.update(trace=name, device=d)
        rows.append(row)
        ideal = row["ideal_peak_bytes"]
        match = row["segment_match"]
        if match is None:
            match_text = "nothing to check: no segment events, no segments in the snapshot"
        elif match["in_order"] is None:
            match_text = (f"its {match['model_segments']} final ones: {match['as_multiset']:.1%} among the "
                          f"{match['trace_segments']} held at the dump")
        else:
            source = match["source"].replace(" events", "")
            match_text = (f"{match['in_order']:.1%} in order, {match['as_multiset']:.1%} any order of "
                          f"{match['trace_segments']} {source} (model {match['model_segments']})")
        ratios = [f"{_ratio(row[policy], ideal):.3f}" if row[policy]["num_ooms"] == 0 else "OOM"
                  for policy in ("pytorch", "memkernels")]
        shown = name if len(name) <= _NAME_WIDTH else name[:_NAME_WIDTH - 3] + "..."
        print(
            f"{shown:<{_NAME_WIDTH}} {d:>3} {format_size(ideal):>11} | {ratios[0]:>7} "
            f"{row['pytorch']['num_device_alloc']:>9} | {ratios[1]:>10} "
            f"{row['memkernels']['num_device_alloc']:>9} {row['memkernels']['ns_per_op']:>7.0f}",
            file=out,
        )
        print(f"    model vs recorded segments: {match_text}", file=out)
        if capacity is not None:
            for label, policy in (("PyTorch", "pytorch"), ("memkernels", "memkernels")):
                print(f"    {label}: {_fit_text(row[policy], row['requests'], capacity)}", file=out)
    return rows
