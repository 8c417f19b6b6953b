"""`memkernels explain`: the post-mortem of a PyTorch memory snapshot (memkernels/forensics/explain.py).

The snapshot with a known OOM is built here in PyTorch's `_dump_snapshot` format (events with
stack frames, innermost first; the final `segments` state; an `oom` event with `device_free`),
with every figure the post-mortem must find worked out by hand.
"""
import glob
import os
import pickle

import pytest

from memkernels import explain
from memkernels.cli import main
from memkernels.forensics.explain import POLICIES, load_snapshot, user_frame
from memkernels.forensics.replay import load_trace, trace_ops

MiB = 1 << 20
SEG_A, SEG_B = 0x7F0000000000, 0x7F0002000000
TRACES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "traces", "*.pickle")))


def _frames(path, line, function):
    """A stack as PyTorch records it: allocator C++ frames, torch's Python, the user's code, the script."""
    return [{"name": "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc",
             "filename": "CUDACachingAllocator.cpp", "line": 0},
            {"name": "linear", "filename": "/venv/lib/python3.11/site-packages/torch/nn/functional.py", "line": 10},
            {"name": "_call_impl", "filename": "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py",
             "line": 1750},
            {"name": function, "filename": path, "line": line},
            {"name": "<module>", "filename": "/home/me/train.py", "line": 99}]


ATTENTION = _frames("/home/me/model.py", 42, "attention")
MLP = _frames("/home/me/model.py", 77, "mlp")


def _block(addr, size, state, frames=()):
    return {"address": addr, "size": size, "requested_size": 0 if state == "inactive" else size, "state": state,
            "frames": list(frames)}


def _segment(addr, blocks):
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {"device": 0, "address": addr, "total_size": 20 * MiB, "allocated_size": allocated,
            "active_size": allocated, "requested_size": allocated, "stream": 0, "segment_type": "large",
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks}


def oom_snapshot():
    """Two 20 MiB segments, each 6+6+6 MiB allocated, the middle block freed: 24 MiB live in 40 MiB
    reserved, free blocks 6+2 MiB per segment. A 10 MiB request fails with 4 MiB free on the
    device: 16 + 4 MiB were there, in pieces (fragmentation). The except-handler's unwinding then
    frees one more block, so the final state is *after* the OOM and must be undone.
    """
    events = []

    def alloc(addr, size, frames):
        events.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": frames})

    def free(addr, size):
        for action in ("free_requested", "free_completed"):
            events.append({"action": action, "addr": addr, "size": size, "stream": 0, "frames": []})

    for base, frames in ((SEG_A, (ATTENTION, MLP, MLP)), (SEG_B, (ATTENTION, ATTENTION, ATTENTION))):
        events.append({"action": "segment_alloc", "addr": base, "size": 20 * MiB, "stream": 0, "frames": []})
        for i, f in enumerate(frames):
            alloc(base + 6 * MiB * i, 6 * MiB, f)
    free(SEG_A + 6 * MiB, 6 * MiB)
    free(SEG_B + 6 * MiB, 6 * MiB)
    events.append({"action": "oom", "size": 10 * MiB, "device_free": 4 * MiB, "stream": 0, "frames": MLP})
    free(SEG_A, 6 * MiB)  # unwinding after the OOM, before _dump_snapshot
    segments = [
        _segment(SEG_A, [_block(SEG_A, 12 * MiB, "inactive"),
                         _block(SEG_A + 12 * MiB, 6 * MiB, "active_allocated", MLP),
                         _block(SEG_A + 18 * MiB, 2 * MiB, "inactive")]),
        _segment(SEG_B, [_block(SEG_B, 6 * MiB, "active_allocated", ATTENTION),
                         _block(SEG_B + 6 * MiB, 6 * MiB, "inactive"),
                         _block(SEG_B + 12 * MiB, 6 * MiB, "active_allocated", ATTENTION),
                         _block(SEG_B + 18 * MiB, 2 * MiB, "inactive")]),
    ]
    return {"segments": segments, "device_traces": [events]}


def test_user_frame_is_the_innermost_frame_outside_torch_stdlib_and_installed_packages():
    assert user_frame(ATTENTION) == "/home/me/model.py:42 attention"
    library_only = ATTENTION[:3] + [{"name": "forward", "filename":
                                     "/venv/lib/python3.11/site-packages/transformers/models/llama/modeling_llama.py",
                                     "line": 89}]
    assert user_frame(library_only).endswith("modeling_llama.py:89 forward")  # no user frame: the library's
    assert user_frame(ATTENTION[:1]).startswith("<no Python frame")
    assert user_frame([]) == "<no stack frames recorded>"


def test_explain_names_the_failing_request_top_frame_fragmentation_and_each_policys_verdict(tmp_path):
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(oom_snapshot()))
    result = explain(str(path))
    (d,) = result.devices
    assert d["oom"] == {"size": 10 * MiB, "device_free": 4 * MiB, "stream": 0,
                        "frame": "/home/me/model.py:77 mlp", "count": 1}
    # At the OOM, not at the dump: the block freed while unwinding counts as live.
    assert d["allocated_bytes"] == 24 * MiB and d["reserved_bytes"] == 40 * MiB
    assert d["largest_free_block"] == 6 * MiB  # not the 12 MiB the final state shows
    assert d["fragmentation"] == pytest.approx(0.4)
    assert d["top"][0] == {"frame": "/home/me/model.py:42 attention", "bytes": 18 * MiB, "count": 3,
                           "largest": 6 * MiB}
    assert d["top"][1]["frame"] == "/home/me/model.py:77 mlp" and d["top"][1]["bytes"] == 6 * MiB
    assert d["capacity"] == 44 * MiB  # reserved at the OOM + the 4 MiB the device reported
    assert d["verdict"] == "fragmentation"
    verdicts = {policy: r["fits"] for policy, r in d["counterfactual"].items()}
    # PyTorch's policy: the 10 MiB request takes a fresh 10 MiB segment; 40 + 10 > 44 and no whole
    # segment is free to release: it fails, as the real run did. Expandable segments map 20 MiB pages:
    # the 20 MiB range of each pool holds 18 + 18 MiB and growing needs another page: fails too.
    # memkernels' pool fits its six 6 MiB blocks in fitted segments and reuses the freed middles.
    assert verdicts == {"pytorch": False, "pytorch_expandable": False, "memkernels": True,
                        "memkernels_expandable": True}
    assert d["counterfactual"]["pytorch"]["margin_bytes"] == 44 * MiB - 50 * MiB  # unlimited: 40 + 10 MiB
    text = result.text()
    for expected in ("OOM: a request of 10.00 MiB failed with 4.00 MiB free", "fragmentation 40.0%",
                     "largest free block 6.00 MiB", "18.00 MiB", "/home/me/model.py:42 attention",
                     "verdict: fragmentation", "memkernels.allocator.install()"):
        assert expected in text
    for _policy, label in POLICIES:
        assert label in text
    assert text.count("does not fit") == 2 and text.count(" fits, peak reserved") == 2


def test_a_run_that_needed_more_than_the_device_is_real_demand():
    snapshot = oom_snapshot()
    snapshot["device_traces"][0][-3]["size"] = 30 * MiB  # 24 live + 30 > 40 reserved + 4 free
    (d,) = explain(snapshot).devices
    assert d["verdict"] == "demand"
    assert not any(r["fits"] for r in d["counterfactual"].values())
    assert "checkpointing or offloading the activations held by /home/me/model.py:42 attention" in d["next_step"]


def test_allocations_made_before_recording_count_as_live_from_the_start():
    snapshot = oom_snapshot()
    events = snapshot["device_traces"][0]
    # A 2 MiB block in segment A's tail, allocated before recording began, freed after the OOM.
    events.append({"action": "free_completed", "addr": SEG_A + 18 * MiB, "size": 2 * MiB, "stream": 0,
                   "frames": []})
    (d,) = explain(snapshot).devices
    assert d["allocated_bytes"] == 26 * MiB and d["largest_free_block"] == 6 * MiB
    assert any(row["frame"].startswith("<allocated before recording") and row["bytes"] == 2 * MiB
               for row in d["top"])
    assert d["before_recording_bytes"] == 2 * MiB  # what replay's "ideal peak" leaves out, said in the text


def test_the_cli_prints_the_post_mortem(tmp_path, capsys):
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(oom_snapshot()))
    assert main(["explain", str(path), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "OOM: a request of 10.00 MiB" in out and "/home/me/model.py:42 attention" in out
    assert "/home/me/model.py:77 mlp\n" not in out.split("top live allocations")[1]  # --top 1
    assert main(["explain", str(path), "--capacity", "1GiB"]) == 0
    assert "on a device of 1.00 GiB (given)" in capsys.readouterr().out


@pytest.mark.skipif(not TRACES, reason="no recorded traces: ../shared/traces/*.pickle is not on this machine")
@pytest.mark.parametrize("path", TRACES, ids=os.path.basename)
def test_recorded_traces_report_the_peak_and_the_counterfactual(path):
    events = load_trace(path)["device_traces"][0]
    (d,) = explain(path).devices
    assert d["oom"] is None and d["at"] == "peak" and d["capacity"] is None
    _ops, _slots, trace_peak = trace_ops(events)
    # The trace's own peak, plus what was allocated before recording and still live.
    assert d["peak_live_bytes"] >= trace_peak and d["allocated_bytes"] == d["peak_live_bytes"]
    # At explain's peak: what the trace recorded live then (at most replay's ideal peak) + what was there before.
    assert d["peak_live_bytes"] <= trace_peak + d["before_recording_bytes"]
    for result in d["counterfactual"].values():
        assert result["peak_reserved_bytes"] >= d["peak_live_bytes"]  # no allocator holds less than is live
    text = explain(path).text()
    assert "no OOM in the trace; peak of live allocations" in text
    if d["before_recording_bytes"]:
        assert "allocated before the recording began (replay's \"ideal peak\" counts only what the trace" in text
    for _policy, label in POLICIES:
        assert label in text


@pytest.mark.parametrize("content, message", [
    (b"", "empty file"),
    (b"\x80\x04\x95 this is not a pickle", "not a torch.cuda.memory._dump_snapshot pickle"),
    (pickle.dumps({"segments": []})[:-5], "not a torch.cuda.memory._dump_snapshot pickle"),
    (pickle.dumps([1, 2, 3]), "_dump_snapshot pickle or its loaded dict"),
    (pickle.dumps({"device_traces": [[{"action": "alloc", "addr": "x", "size": 1}]]}), "'addr' is not an int"),
])
def test_bad_files_get_one_line_naming_the_file(tmp_path, content, message, capsys):
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as info:
        explain(str(path))
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and message in err


def test_a_pickle_that_imports_anything_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pickle"
    # GLOBAL os.system, called with a shell command: what an unrestricted pickle.load would run.
    path.write_bytes(b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    with pytest.raises(ValueError, match=r"refused.*os\.system") as info:
        load_snapshot(str(path))
    assert str(path) in str(info.value)
    with pytest.raises(SystemExit):
        main(["explain", str(path)])
    assert not marker.exists()


def test_bad_arguments():
    with pytest.raises(ValueError, match="top"):
        explain(oom_snapshot(), top=0)
    with pytest.raises(ValueError, match="capacity"):
        explain(oom_snapshot(), capacity=-1)
    with pytest.raises(ValueError, match="device"):
        explain(oom_snapshot(), device=3)
    with pytest.raises(FileNotFoundError, match="no such file"):
        explain("/nonexistent/snapshot.pickle")


def test_a_missing_or_unreadable_path_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        main(["explain", str(tmp_path)])  # a directory without snapshots
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(tmp_path) in err and "has no *.pickle files" in err
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(oom_snapshot()))
    # A directory of snapshots is explained file by file, as replay takes one (issue 38).
    assert main(["explain", str(tmp_path)]) == 0
    assert capsys.readouterr().out == explain(str(path)).text() + "\n"

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("memkernels.forensics.replay.open", refuse, raising=False)  # root reads any file: simulate
    with pytest.raises(ValueError, match=r"cannot be read \(\[Errno 13\] Permission denied\)") as info:
        load_snapshot(str(path))
    assert str(path) in str(info.value)


def test_demand_events_put_allocations_live_before_recording_first():
    from memkernels.forensics.explain import demand_events

    snapshot = oom_snapshot()
    snapshot["device_traces"][0].insert(0, {"action": "free_completed", "addr": 0x1000, "size": 512, "stream": 0,
                                            "frames": []})
    events = demand_events(snapshot)
    assert events[0] == {"action": "alloc", "addr": 0x1000, "size": 512, "stream": 0}
    assert events[1]["action"] == "free_completed" and events[1]["addr"] == 0x1000
    assert [e["action"] for e in events].count("alloc") == 1 + 6 and events[-1]["action"] == "free_completed"
