"""Where the tests find the recorded GPU allocation traces, and why they skip without them.

The traces are real ``torch.cuda.memory._dump_snapshot`` pickles from other people's public
training runs (README, "Traces", lists the sources). They are not part of the repository:
``MEMKERNELS_TRACE_DIR`` names a directory holding them, else ``../shared/traces`` next to the
checkout (or next to its parent, for a git worktree) is used.
"""
import os
import pickle

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_CANDIDATES = [os.environ.get("MEMKERNELS_TRACE_DIR", "")] + [
    os.path.join(_HERE, "..", up, "shared", "traces") for up in ("..", "../..")]

TRACE_DIR = next((d for d in _CANDIDATES if d and os.path.isdir(d)), None)
TRACES = sorted(t for t in os.listdir(TRACE_DIR) if t.endswith(".pickle")) if TRACE_DIR else []

SKIP_REASON = (
    "needs the recorded GPU traces (torch.cuda.memory._dump_snapshot pickles), which are not in the repository: "
    "set MEMKERNELS_TRACE_DIR to a directory holding them, or put them in ../shared/traces "
    "(README, 'Traces', says where they come from)")

needs_traces = pytest.mark.skipif(not TRACES, reason=SKIP_REASON)


def write_trace(path, sizes_mib, frees=()):
    """A made-up snapshot at ``path`` (a pathlib.Path) whose device 0 allocates ``sizes_mib`` in order
    (address i+1 for the i-th) and frees the addresses in ``frees`` right after the allocation with the
    same index: ``[(index, address), ...]``. Returns ``path``."""
    events = []
    for index, size in enumerate(sizes_mib):
        events.append({"action": "alloc", "addr": index + 1, "size": size * 2**20, "stream": 0})
        for addr in (a for i, a in frees if i == index):
            events.append({"action": "free_completed", "addr": addr, "size": 0, "stream": 0})
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [events]}))
    return path
