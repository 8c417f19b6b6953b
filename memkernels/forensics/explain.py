"""``memkernels explain``: a post-mortem of a recorded PyTorch memory snapshot.

A ``torch.cuda.memory._dump_snapshot`` pickle holds the allocator's state when it was taken
(``segments``) and the history of each device (``device_traces``: alloc, free, segment and
``oom`` events, each with its stack ``frames``). For each device :func:`explain` answers:

* did an OOM happen, which request failed and how much the device said was free;
* at the OOM (or, without one, at the peak of live bytes): reserved and allocated bytes, the
  largest free block and fragmentation (1 - allocated / reserved);
* which code held the memory: the live allocations grouped by the innermost frame of the
  user's own code (the first Python frame outside torch, the standard library and installed
  packages);
* the counterfactual: the trace (with the failing request) replayed on a device of the same
  capacity through PyTorch's policy (a model of it), PyTorch with expandable segments,
  memkernels' pool and memkernels with expandable segments: would each have fit, by what margin;
* the next step: fragmentation -> change the allocator; real demand -> checkpoint or offload
  the code that held the most, or a smaller micro-batch.

The state at the chosen point is rebuilt from the final state and the events: recording
starts mid-run, so allocations made before it appear only as frees of unknown addresses or as
blocks of the final state, and both are counted as live from the start. Free blocks are the
gaps between live allocations (sizes rounded as PyTorch rounds them) inside each segment.
Files are loaded with the same data-only unpickler as ``memkernels replay``: a pickle that
refers to any class or function is refused.
"""
import os
import pickle

from memkernels.forensics._torch_policy import round_size
from memkernels.forensics.replay import TraceError, run_pool, summary, load_trace, replay_pytorch_model, trace_ops
from memkernels.runtime.allocator import FRAGMENTATION_WARNING
from memkernels.runtime.sizes import format_size

__all__ = ["explain", "Explanation", "load_snapshot", "user_frame", "demand_events", "counterfactuals"]

POLICIES = (
    ("pytorch", "PyTorch's policy (model)"),
    ("pytorch_expandable", "PyTorch, expandable_segments:True"),
    ("memkernels", "memkernels' pool"),
    ("memkernels_expandable", "memkernels' pool, expandable segments"),
)
# How to switch to each policy but the first.
_HOW = {
    "pytorch_expandable": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    "memkernels": "memkernels.allocator.install()",
    "memkernels_expandable": "memkernels.allocator.install(expandable_segments=True)",
}
_LIBRARY_MARKERS = ("site-packages", "dist-packages", "/lib/python3", "\\lib\\python3", "<frozen ")
_TORCH_MARKERS = ("/torch/", "\\torch\\")
_SEGMENT_GROWTH = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


# ---------------------------------------------------------------------- loading


def load_snapshot(path_or_dict):
    """A snapshot dict from a ``_dump_snapshot`` pickle path (or a loaded dict), checked.

    Raises ``ValueError`` with one line naming the file when it is empty, corrupt, not a
    snapshot, or refers to code (a pickle that imports anything is refused, never run).
    """
    name = os.fspath(path_or_dict) if isinstance(path_or_dict, (str, os.PathLike)) else "<snapshot dict>"
    if isinstance(path_or_dict, (str, os.PathLike)) and os.path.isfile(path_or_dict):
        if os.path.getsize(path_or_dict) == 0:
            raise ValueError(f"{name}: empty file, not a torch.cuda.memory._dump_snapshot pickle")
    try:
        snapshot = load_trace(path_or_dict)
    except FileNotFoundError:
        raise
    except TraceError as error:  # already one line naming the file
        if "memkernels loads only plain-data" in str(error):  # the data-only unpickler's refusal
            raise ValueError(f"{name}: refused: {_one_line(error)}") from None
        raise ValueError(_one_line(error)) from None
    except OSError as error:
        raise ValueError(f"{name}: cannot be read ({_one_line(error)})") from None
    except MemoryError:  # a corrupt length field asks for more than any machine has
        raise ValueError(f"{name}: not a torch.cuda.memory._dump_snapshot pickle (corrupt: it declares more data "
                         "than fits in memory)") from None
    except pickle.UnpicklingError as error:
        if "memkernels loads only plain-data" in str(error):  # the data-only unpickler's refusal
            raise ValueError(f"{name}: refused: {_one_line(error)}") from None
        raise ValueError(f"{name}: not a torch.cuda.memory._dump_snapshot pickle (corrupt: {_one_line(error)})") \
            from None
    except (EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError, UnicodeDecodeError,
            OverflowError) as error:
        raise ValueError(f"{name}: not a torch.cuda.memory._dump_snapshot pickle ({_one_line(error)})") from None
    problem = _shape_problem(snapshot)
    if problem:
        raise ValueError(f"{name}: not a torch.cuda.memory._dump_snapshot pickle ({problem})")
    return snapshot


def _one_line(error):
    text = " ".join(str(error).split())
    return text or type(error).__name__


def _shape_problem(snapshot):
    """What keeps ``snapshot`` from being PyTorch's format, or None."""
    segments = snapshot.get("segments", [])
    if not isinstance(segments, list) or not all(isinstance(s, dict) for s in segments):
        return "'segments' is not a list of dicts"
    for segment in segments:
        if not isinstance(segment.get("address"), int) or not isinstance(segment.get("total_size"), int) \
                or not isinstance(segment.get("blocks", []), list):
            return "a segment lacks an int 'address' / 'total_size' or a 'blocks' list"
    for device, events in enumerate(snapshot["device_traces"]):
        if not isinstance(events, list):
            return f"device_traces[{device}] is not a list"
        for event in events:
            if not isinstance(event, dict) or not isinstance(event.get("action"), str):
                return f"device_traces[{device}] holds an event that is not a dict with an 'action'"
            if not isinstance(event.get("size", 0), int):
                return f"device_traces[{device}]: an event's 'size' is not an int"
            if event["action"] != "oom" and not isinstance(event.get("addr", 0), int):
                return f"device_traces[{device}]: an event's 'addr' is not an int"
    return None


# ---------------------------------------------------------------------- frames


def _is_python(frame):
    return str(frame.get("filename", "")).endswith(".py")


def _frame_text(frame):
    filename = str(frame.get("filename", "?")).replace("\\", "/")
    return f"{filename}:{frame.get('line', 0)} {frame.get('name', '?')}"


def user_frame(frames):
    """The innermost frame of the user's own code, as ``'path:line function'``.

    Frames are innermost first (PyTorch's order). The user's code is the first Python frame
    outside installed packages and the standard library; failing that, the first Python frame
    outside torch (a library frame, e.g. a Hugging Face model); failing that, says there is none.
    """
    frames = frames or []
    python = [f for f in frames if isinstance(f, dict) and _is_python(f)]
    for frame in python:
        path = str(frame.get("filename", "")).lower()
        if not any(marker in path for marker in _LIBRARY_MARKERS):
            return _frame_text(frame)
    for frame in python:
        if not any(marker in str(frame.get("filename", "")) for marker in _TORCH_MARKERS):
            return _frame_text(frame)
    if frames:
        return "<no Python frame: C++ only, e.g. autograd's backward thread>"
    return "<no stack frames recorded>"


# ---------------------------------------------------------------------- the state at one point


class _Allocation:
    __slots__ = ("addr", "size", "frames", "origin")

    def __init__(self, addr, size, frames, origin):
        self.addr, self.size, self.frames, self.origin = addr, size, frames, origin


def _device_segments(snapshot, device):
    return [s for s in snapshot.get("segments", []) if s.get("device", 0) == device]


def _pre_recording(snapshot, device, events):
    """Allocations live when recording started: freed later in the trace, or still live at the end
    and never seen in the trace: ``{addr: _Allocation}``."""
    seen_alloc, live_before = set(), {}
    for event in events:
        action = event["action"]
        if action == "alloc":
            seen_alloc.add(event["addr"])
        elif action == "free_completed" and event["addr"] not in seen_alloc and event["addr"] not in live_before:
            live_before[event["addr"]] = _Allocation(event["addr"], event.get("size", 0), [],
                                                     "allocated before recording started")
    touched = seen_alloc | set(live_before)
    for segment in _device_segments(snapshot, device):
        for block in segment.get("blocks", []):
            live = block.get("state") in ("active_allocated", "active_pending_free")
            if live and block.get("address") not in touched:
                live_before[block["address"]] = _Allocation(
                    block["address"], block.get("requested_size", block.get("size", 0)), block.get("frames", []),
                    "live through the whole trace")
    return live_before


def _live_at(events, index, live_before):
    """Live allocations just before ``events[index]`` (``index=len(events)``: at the end)."""
    live = dict(live_before)
    for event in events[:index]:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = _Allocation(event["addr"], event.get("size", 0), event.get("frames", []),
                                              "trace")
        elif action == "free_completed":
            live.pop(event["addr"], None)
    return live


def _peak_index(events, live_before):
    """Index of the event right after which live bytes peak, and the peak."""
    live = sum(a.size for a in live_before.values())
    sizes = {}
    peak, at = live, 0
    for i, event in enumerate(events):
        action = event["action"]
        if action == "alloc":
            sizes[event["addr"]] = event.get("size", 0)
            live += sizes[event["addr"]]
        elif action == "free_completed":
            if event["addr"] in sizes:
                live -= sizes.pop(event["addr"])
            elif event["addr"] in live_before:
                live -= live_before[event["addr"]].size
        if live > peak:
            peak, at = live, i + 1
    return at, peak


def _segments_at(snapshot, device, events, index):
    """``{address: size}`` of the segments that existed just before ``events[index]``.

    The final state, with segment events after the point undone; None when neither the final
    state nor the trace has any segment.
    """
    segments = {s["address"]: s["total_size"] for s in _device_segments(snapshot, device)}
    has_events = any(e["action"] in _SEGMENT_GROWTH for e in events)
    if not segments and not has_events:
        return None
    for event in reversed(events[index:]):
        growth = _SEGMENT_GROWTH.get(event["action"])
        if growth == 1:
            segments.pop(event["addr"], None)
        elif growth == -1:
            segments[event["addr"]] = event.get("size", 0)
    return segments


def _free_blocks(segments, live):
    """Sizes of the gaps between live allocations (rounded as PyTorch rounds) in each segment."""
    starts = sorted(segments)
    spans = sorted((a.addr, a.addr + round_size(a.size)) for a in live.values())
    gaps, j = [], 0
    for start in starts:
        end = start + segments[start]
        cursor = start
        while j < len(spans) and spans[j][0] < start:
            j += 1
        k = j
        while k < len(spans) and spans[k][0] < end:
            if spans[k][0] > cursor:
                gaps.append(spans[k][0] - cursor)
            cursor = max(cursor, min(spans[k][1], end))
            k += 1
        if end > cursor:
            gaps.append(end - cursor)
    return gaps


# ---------------------------------------------------------------------- counterfactual


def _replay_events(events, stop, live_before, oom_size):
    """What the program asked for up to ``stop``: the pre-recording allocations first, then the
    trace, then (after an OOM) the request that failed."""
    replay = [{"action": "alloc", "addr": a.addr, "size": a.size, "stream": 0} for a in live_before.values()]
    replay += [e for e in events[:stop] if e["action"] in ("alloc", "free_completed")]
    if oom_size is not None:
        # The failing request never got an address: give it one no live block can hold.
        unused_addr = 1 + max((e["addr"] for e in replay), default=0)
        replay.append({"action": "alloc", "addr": unused_addr, "size": oom_size, "stream": 0})
    return replay


def demand_events(snapshot, device=0):
    """Every alloc/free the program made on ``device`` as far as the snapshot knows: the allocations
    live before recording started (as allocations at the start), then the trace's."""
    events = snapshot["device_traces"][device] if device < len(snapshot["device_traces"]) else []
    return _replay_events(events, len(events), _pre_recording(snapshot, device, events), None)


def counterfactuals(events, capacity):
    """Replay alloc/free ``events`` on a device of ``capacity`` bytes (None: unlimited) through each
    policy of :data:`POLICIES`. Returns ``{policy: {"fits", "peak_reserved_bytes", "margin_bytes",
    "num_ooms", "unlimited_peak_reserved_bytes"}}``; ``margin_bytes`` is capacity - peak reserved
    when it fits, and capacity - what it reserves on an unlimited device when it does not (< 0).
    """
    snapshot = {"device_traces": [events]}
    ops, num_slots, _ = trace_ops(events)
    results = {}
    for policy, _label in POLICIES:
        expandable = policy.endswith("_expandable")

        def run(cap):
            if policy.startswith("pytorch"):
                return replay_pytorch_model(snapshot, capacity=cap, expandable_segments=expandable)
            return summary(*run_pool(ops, num_slots, 0, cap, {"expandable_segments": expandable}), ops)

        unlimited = run(None)
        capped = unlimited if capacity is None else run(capacity)
        fits = capacity is None or capped["num_ooms"] == 0
        results[policy] = {
            "fits": fits if capacity is not None else None,
            "peak_reserved_bytes": capped["peak_reserved_bytes"],
            "unlimited_peak_reserved_bytes": unlimited["peak_reserved_bytes"],
            "num_ooms": capped["num_ooms"] if capacity is not None else 0,
            "margin_bytes": None if capacity is None else (
                capacity - capped["peak_reserved_bytes"] if fits else capacity - unlimited["peak_reserved_bytes"]),
        }
    return results


# ---------------------------------------------------------------------- the post-mortem


class Explanation:
    """The post-mortem of one snapshot: ``devices`` is a list of per-device dicts.

    Each dict: ``device``; ``oom`` (None, or ``{"size", "device_free", "stream", "frame", "count"}``:
    the failing request of the last OOM, the free bytes the device reported, the user frame that
    asked, how many OOMs the trace holds); ``at`` (``"oom"`` or ``"peak"``); ``allocated_bytes``
    (live requested bytes), ``reserved_bytes`` (None when the snapshot has no segments),
    ``largest_free_block`` and ``fragmentation`` (None likewise); ``segment_events`` (False: reserved
    is the final state's, the trace cannot say how it changed); ``peak_live_bytes``; ``before_recording_bytes``
    (of the allocations live at the peak or OOM, those made before the recording began: ``replay`` does not
    replay them, so its "ideal peak" leaves them out);
    ``top`` (list of ``{"frame", "bytes", "count", "largest"}``, largest first);
    ``capacity`` (bytes the replays ran with, or None) and ``capacity_source``;
    ``counterfactual`` (see :func:`counterfactuals`); ``verdict`` (``"fragmentation"``,
    ``"demand"``, or ``"device refused"`` when the device reported enough free bytes for the
    request) and ``next_step`` (a sentence).
    """

    def __init__(self, name, devices):
        self.name, self.devices = name, devices

    def to_dict(self):
        return {"snapshot": self.name, "devices": self.devices}

    def text(self):
        lines = [f"memkernels explain: {self.name}"]
        if not self.devices:
            lines.append("  the snapshot holds no allocations on any device (was memory history recorded?)")
        for d in self.devices:
            lines += _device_text(d)
        return "\n".join(lines)

    __str__ = text

    def __repr__(self):
        return f"Explanation({self.name!r}, devices={[d['device'] for d in self.devices]})"


def _pct(value):
    return "n/a" if value is None else f"{value:.1%}"


def _size(value):
    return "n/a" if value is None else format_size(value)


def _device_text(d):
    lines = [f"device {d['device']}:"]
    oom = d["oom"]
    if oom:
        lines.append(f"  OOM: a request of {format_size(oom['size'])} failed with {format_size(oom['device_free'])} "
                     f"free on the device (stream {oom['stream']}), asked by {oom['frame']}"
                     + (f"; the trace holds {oom['count']} OOMs, this is the last" if oom["count"] > 1 else ""))
    else:
        before = d["before_recording_bytes"]
        lines.append(f"  no OOM in the trace; peak of live allocations {format_size(d['peak_live_bytes'])}"
                     + (f", {format_size(before)} of it allocated before the recording began (replay's \"ideal "
                        "peak\" counts only what the trace records)" if before else ""))
    where = "at the OOM" if oom else "at the peak"
    lines.append(f"  {where}: reserved {_size(d['reserved_bytes'])}, allocated {format_size(d['allocated_bytes'])}, "
                 f"largest free block {_size(d['largest_free_block'])}, fragmentation {_pct(d['fragmentation'])} "
                 "(1 - allocated/reserved)")
    if d["reserved_bytes"] is None:
        lines.append("    (the snapshot has no segments, so reserved memory is unknown)")
    elif not d["segment_events"]:
        lines.append("    (the trace has no segment events: reserved and free blocks are those of the snapshot's "
                     "final state)")
    lines.append(f"  top live allocations {where}, by the innermost frame of your code:")
    for row in d["top"]:
        lines.append(f"    {format_size(row['bytes']):>11}  {row['count']:>5} allocation(s), largest "
                     f"{format_size(row['largest'])}  {row['frame']}")
    capacity = d["capacity"]
    if capacity is None:
        lines.append("  counterfactual (device capacity unknown, no OOM in the trace: pass capacity= / --capacity to "
                     "judge fit): peak reserved on an unlimited device")
    else:
        lines.append(f"  counterfactual on a device of {format_size(capacity)} ({d['capacity_source']}):")
    for policy, label in POLICIES:
        r = d["counterfactual"][policy]
        if capacity is None:
            verdict = f"peak reserved {format_size(r['peak_reserved_bytes'])}"
        elif r["fits"]:
            verdict = (f"fits, peak reserved {format_size(r['peak_reserved_bytes'])}, "
                       f"margin {format_size(r['margin_bytes'])}")
        else:
            verdict = (f"does not fit ({r['num_ooms']} OOM(s)); unlimited it reserves "
                       f"{format_size(r['unlimited_peak_reserved_bytes'])}, {format_size(-r['margin_bytes'])} over")
        lines.append(f"    {label:<40} {verdict}")
    lines.append(f"  verdict: {d['verdict']}. Next step: {d['next_step']}")
    return lines


def _next_step(d):
    """Fragmentation -> an allocator that fits; real demand -> the code to checkpoint or offload."""
    framed = [row["frame"] for row in d["top"] if not row["frame"].startswith("<")]
    top = framed[0] if framed else "the largest live allocations"
    counter = d["counterfactual"]
    fitting = [f"{label} ({_HOW[policy]})" for policy, label in POLICIES[1:] if counter[policy]["fits"]]
    if d["verdict"] == "device refused":
        return ("the device reported enough free memory for the request, so neither the cache nor the program's "
                "demand explains it: look for a memory cap (torch.cuda.set_per_process_memory_fraction, "
                "memkernels' memory_cap), another process on the GPU (nvidia-smi), or an injected fault")
    if d["verdict"] == "fragmentation":
        if fitting:
            return f"the memory was there but in pieces; switch the allocator: {fitting[0]} fits this trace"
        return ("the memory was there but in pieces; free cached segments between phases "
                "(torch.cuda.empty_cache()) or try expandable segments / memkernels' pool")
    if d["oom"] and fitting:
        return (f"{fitting[0]} fits it; otherwise lower the peak: checkpoint or offload the activations "
                f"held by {top}, or a smaller micro-batch")
    return (f"real demand: lower the peak by checkpointing or offloading the activations held by {top} "
            "(memkernels.OffloadActivations), or a smaller micro-batch")


def _explain_device(snapshot, device, top, capacity):
    events = snapshot["device_traces"][device] if device < len(snapshot["device_traces"]) else []
    if not events and not _device_segments(snapshot, device):
        return None
    live_before = _pre_recording(snapshot, device, events)
    ooms = [i for i, e in enumerate(events) if e["action"] == "oom"]
    peak_at, peak_live = _peak_index(events, live_before)
    at = ooms[-1] if ooms else peak_at
    live = _live_at(events, at, live_before)
    segments = _segments_at(snapshot, device, events, at)
    allocated = sum(a.size for a in live.values())
    reserved = sum(segments.values()) if segments is not None else None
    gaps = _free_blocks(segments, live) if segments is not None else []
    rounded_allocated = sum(round_size(a.size) for a in live.values())
    fragmentation = 1 - rounded_allocated / reserved if reserved else None
    groups = {}
    for allocation in live.values():
        frame = user_frame(allocation.frames) if allocation.frames or allocation.origin == "trace" \
            else f"<{allocation.origin}, no frames>"
        group = groups.setdefault(frame, {"frame": frame, "bytes": 0, "count": 0, "largest": 0})
        group["bytes"] += allocation.size
        group["count"] += 1
        group["largest"] = max(group["largest"], allocation.size)
    oom = None
    if ooms:
        event = events[at]
        oom = {"size": event.get("size", 0), "device_free": event.get("device_free", 0),
               "stream": event.get("stream", 0), "frame": user_frame(event.get("frames")), "count": len(ooms)}
    if capacity is not None:
        capacity_source = "given"
    elif oom is not None and reserved is not None:
        capacity, capacity_source = reserved + oom["device_free"], "reserved at the OOM + the free bytes reported"
    else:
        capacity_source = None
    replay = _replay_events(events, at if oom else len(events), live_before, oom["size"] if oom else None)
    result = {
        "device": device, "oom": oom, "at": "oom" if oom else "peak", "allocated_bytes": allocated,
        "reserved_bytes": reserved, "largest_free_block": max(gaps, default=0) if segments is not None else None,
        "fragmentation": fragmentation, "peak_live_bytes": peak_live,
        "before_recording_bytes": sum(a.size for addr, a in live.items() if addr in live_before),
        "segment_events": any(e["action"] in _SEGMENT_GROWTH for e in events),
        "top": sorted(groups.values(), key=lambda g: -g["bytes"])[:top],
        "capacity": capacity, "capacity_source": capacity_source,
        "counterfactual": counterfactuals(replay, capacity),
    }
    if oom is not None and oom["size"] <= oom["device_free"]:
        verdict = "device refused"  # it said it had the bytes: a cap, another process, or a fault
    elif oom is not None and reserved is not None:
        # The request fit in what the cache held unused plus what the device had left: fragmentation.
        in_pieces = oom["size"] <= (reserved - rounded_allocated) + oom["device_free"]
        verdict = "fragmentation" if in_pieces else "demand"
    else:
        verdict = "fragmentation" if fragmentation is not None and fragmentation > FRAGMENTATION_WARNING else "demand"
    result["verdict"] = verdict
    result["next_step"] = _next_step(result)
    return result


def explain(snapshot, *, device=None, top=10, capacity=None):
    """Post-mortem of a ``torch.cuda.memory._dump_snapshot`` (path or loaded dict).

    Args:
        snapshot: path to the pickle, or the loaded dict (e.g. ``torch.cuda.memory._snapshot()``
            or :func:`memkernels.allocator.snapshot`).
        device: explain only this device index (default: every device with events or segments).
        top: how many groups of live allocations to list.
        capacity: device memory in bytes for the counterfactual replays. Default: after an
            OOM, reserved bytes at the OOM + the free bytes the device reported; without an OOM,
            unknown (peak reserved on an unlimited device is reported).

    Returns an :class:`Explanation` (``.text()``, ``.to_dict()``). Raises ``ValueError`` (one
    line naming the file) for an empty, corrupt or non-snapshot file, or one that refers to code.
    """
    if not isinstance(top, int) or isinstance(top, bool) or top <= 0:
        raise ValueError(f"explain(top={top!r}): must be a positive int")
    if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0):
        raise ValueError(f"explain(capacity={capacity!r}): must be a positive number of bytes or None")
    name = os.fspath(snapshot) if isinstance(snapshot, (str, os.PathLike)) else "<snapshot dict>"
    data = load_snapshot(snapshot)
    count = max(len(data["device_traces"]), max((s.get("device", 0) + 1 for s in data.get("segments", [])),
                                                 default=0))
    if device is not None and (not isinstance(device, int) or not 0 <= device < max(count, 1)):
        raise ValueError(f"explain(device={device!r}): the snapshot has devices 0..{max(count, 1) - 1}")
    devices = [device] if device is not None else range(count)
    results = [r for r in (_explain_device(data, d, top, capacity) for d in devices) if r is not None]
    return Explanation(name, results)
