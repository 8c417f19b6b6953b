"""MemoryMonitor (memkernels/forensics/monitor.py): per-step rows on the CPU, on memkernels' pool over the
simulated device (fragmentation warning, injected OOM), and on PyTorch-allocator statistics."""
import csv
import dataclasses
import io
import json
import pickle

import pytest
import torch
from conftest import SIM_SYNC_TIMEOUT_S
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from memkernels import MemoryMonitor
from memkernels.forensics.explain import counterfactuals
from memkernels.forensics.monitor import COLUMNS, SCALARS, PoolStats, TorchCudaStats
from memkernels.forensics.replay import load_trace
from memkernels.meters import PeakBytesMeter
from memkernels.models import BUILTIN_CONFIGS, TransformerLM, synthetic_batch
from memkernels.runtime.sizes import format_size

MiB = 1 << 20
TINY = dataclasses.replace(BUILTIN_CONFIGS["tiny-gpt"], vocab_size=512, hidden_size=64, num_layers=2, num_heads=2,
                           num_kv_heads=2, intermediate_size=256)


def _event_scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_restart_peak_gives_each_phase_its_own_peak():
    with PeakBytesMeter() as meter:
        a = torch.empty(1000, dtype=torch.uint8)
        del a
        b = torch.empty(100, dtype=torch.uint8)
        assert meter.restart_peak() == 1000 and meter.peak_bytes == 100  # the live bytes now
        c = torch.empty(300, dtype=torch.uint8)
    assert meter.peak_bytes == 400 and b.numel() + c.numel() == 400
    with pytest.raises(RuntimeError, match="active"):
        meter.restart_peak()


def test_cpu_rows_equal_peak_bytes_meter_and_reach_csv_jsonl_tensorboard_and_png(tmp_path):
    torch.manual_seed(0)
    model = TransformerLM(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = synthetic_batch(TINY, 2, 16)
    step_peaks, forward_peaks = [], []
    paths = {"csv": tmp_path / "memory.csv", "jsonl": tmp_path / "memory.jsonl", "png": tmp_path / "memory.png"}
    # source="cpu": "auto" picks memkernels' pool when one is installed, and another test in this
    # process (test_device_pool) may have installed one on the simulated device.
    with MemoryMonitor(model=model, optimizer=optimizer, log_dir=str(tmp_path / "tb"), source="cpu",
                       **{k: str(v) for k, v in paths.items()}) as monitor:
        for _ in range(5):
            with PeakBytesMeter() as step_meter:  # opened where the monitor's step window opens
                live_before_forward = step_meter.current_bytes
                with PeakBytesMeter() as forward_meter:
                    loss = model(ids, ids)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                del loss
            step_peaks.append(step_meter.peak_bytes)
            forward_peaks.append(live_before_forward + forward_meter.peak_bytes)
            monitor.step()
    rows = list(csv.DictReader(open(paths["csv"])))
    assert [int(r["peak_allocated_bytes"]) for r in rows] == step_peaks
    assert [int(r["peak_forward_bytes"]) for r in rows] == forward_peaks
    assert all(r["source"] == "cpu" and r["peak_reserved_bytes"] == "" and r["fragmentation_at_peak"] == ""
               for r in rows)
    for row in monitor.rows:
        phases = [row[f"peak_{p}_bytes"] for p in ("forward", "backward", "optimizer")]
        assert all(p is not None and 0 < p <= row["peak_allocated_bytes"] for p in phases)
    assert step_peaks[0] > step_peaks[1]  # AdamW allocates its state in the first step
    assert [json.loads(line) for line in open(paths["jsonl"])] == monitor.rows
    scalars = _event_scalars(tmp_path / "tb")
    assert scalars["memory/peak_allocated_bytes"] == [(i, float(p)) for i, p in enumerate(step_peaks, 1)]
    assert "memory/peak_reserved_bytes" not in scalars  # no such figure on the CPU: nothing invented
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Nothing left behind: hooks and the meter's dispatch mode are gone.
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not optimizer._optimizer_step_pre_hooks and not _get_current_dispatch_mode_stack()


def _fake_torch_stats(figures):
    """A ``torch.cuda.memory_stats_as_nested_dict`` stand-in: the CUDA caching allocator's nested layout."""
    def nested(device=None):
        stats = {}
        for name in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes", "inactive_split_bytes",
                     "allocation", "segment", "active", "inactive_split"):
            stats[name] = {pool: {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
                           for pool in ("all", "small_pool", "large_pool")}
        stats["allocated_bytes"]["all"].update(current=figures["allocated"], peak=figures["peak_allocated"])
        stats["reserved_bytes"]["all"].update(current=figures["reserved"], peak=figures["peak_reserved"])
        stats.update(num_alloc_retries=figures["retries"], num_ooms=figures["ooms"], num_sync_all_streams=0,
                     num_device_alloc=0, num_device_free=0, max_split_size=-1)
        return stats
    return nested


def test_pytorch_allocator_statistics_are_read_from_torchs_nested_memory_stats(monkeypatch):
    figures = {"allocated": 10 * MiB, "peak_allocated": 30 * MiB, "reserved": 40 * MiB, "peak_reserved": 50 * MiB,
               "retries": 2, "ooms": 0}
    monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict", _fake_torch_stats(figures))
    resets = []
    source = TorchCudaStats(device=0, reset_peak=resets.append)
    with MemoryMonitor(source=source, file=io.StringIO()) as monitor:
        figures.update(retries=5)
        row = monitor.step()
    assert row["source"] == "torch" and row["peak_allocated_bytes"] == 30 * MiB
    assert row["peak_reserved_bytes"] == 50 * MiB and row["fragmentation_at_peak"] == pytest.approx(0.4)
    assert row["alloc_retries"] == 3 and row["ooms"] == 0  # per step, not since the process began
    assert row["largest_free_block_bytes"] is None  # memory_stats has none: not invented
    assert resets == [0, 0, 0]  # peaks reset at each step's start and at the step's end


# ---------------------------------------------------------------------- memkernels' pool, simulated device


@pytest.fixture
def sim_pool():
    from memkernels import _C, allocator, device
    from memkernels.device import sim

    device.use_sim()
    sim.configure(device_count=1, capacity=256 * MiB, host_capacity=None, granularity=2 * MiB, memory="virtual",
                  address_space=8 << 30, sync_timeout_s=SIM_SYNC_TIMEOUT_S)
    pool = _C.make_device_pool(allocator.pool_config(release_before_growth=-1))
    yield pool, sim
    pool.empty_cache(0)
    sim.reset()


class _PoolForward(torch.nn.Module):
    """A module whose forward allocates ``nbytes`` from the pool and frees it."""

    def __init__(self, pool):
        super().__init__()
        self.pool, self.nbytes = pool, MiB

    def forward(self, x):
        self.pool.free(self.pool.malloc(self.nbytes))
        return x


def test_fragmentation_warns_once_with_measured_remedies(sim_pool):
    pool, _sim = sim_pool
    model = _PoolForward(pool)
    out = io.StringIO()
    with MemoryMonitor(source=PoolStats(pool), model=model, record_history=1000, file=out) as monitor:
        model.nbytes = 64 * MiB
        model(torch.zeros(1))  # caches a 64 MiB segment
        first = monitor.step()
        model.nbytes = MiB
        for _ in range(2):
            model(torch.zeros(1))  # 1 MiB live against 64 MiB+ reserved
            monitor.step()
        snapshot = monitor.source.snapshot()
    assert first["fragmentation_at_peak"] == 0.0
    row = monitor.rows[1]
    assert row["source"] == "memkernels" and row["peak_allocated_bytes"] == MiB
    assert row["fragmentation_at_peak"] > 0.3 and row["largest_free_block_bytes"] >= 64 * MiB
    text = out.getvalue()
    assert text.count("memkernels MemoryMonitor: at step 2") == 1 and "step 3" not in text  # once (rows 1, 2, 3)
    # The remedies carry the numbers of a replay of this run's own trace, the same as explain's.
    kept = snapshot["segments"] and [b for seg in snapshot["segments"] for b in seg["blocks"]
                                     if b["state"] == "active_allocated"]
    assert not kept  # nothing was live before the history began: the replay is the trace's allocs and frees
    replay = [e for e in snapshot["device_traces"][0] if e["action"] in ("alloc", "free_completed")]
    results = counterfactuals(replay, None)
    expandable, pool = (format_size(results[p]["peak_reserved_bytes"]) for p in ("pytorch_expandable", "memkernels"))
    assert f"expandable_segments:True): peak reserved {expandable}" in text
    assert f"memkernels.allocator.install()): peak reserved {pool}" in text
    assert "after the forward phase" in text


def test_fragmentation_warning_without_history_says_it_did_not_measure(sim_pool):
    pool, _sim = sim_pool
    out = io.StringIO()
    with MemoryMonitor(source=PoolStats(pool), file=out) as monitor:
        pool.free(pool.malloc(64 * MiB))
        monitor.step()
        pool.free(pool.malloc(MiB))
        monitor.step()
    assert "not measured, no allocation history; pass record_history" in out.getvalue()


def test_injected_oom_writes_a_snapshot_explains_it_reraises_and_leaves_nothing_behind(sim_pool, tmp_path):
    from memkernels import _C

    pool, sim = sim_pool
    out = io.StringIO()
    path = tmp_path / "oom.pickle"
    kept = pool.malloc(16 * MiB)
    with pytest.raises(_C.OutOfMemoryError, match="tried to allocate 32.00 MiB") as info:
        with MemoryMonitor(source=PoolStats(pool), record_history=1000, oom_snapshot=str(path), file=out,
                           csv=str(tmp_path / "m.csv")) as monitor:
            monitor.step()
            sim.fail_allocations(1, count=2)  # the attempt and the retry after releasing the cache
            pool.malloc(32 * MiB)
    assert type(info.value) is _C.OutOfMemoryError  # the original exception, not a wrapper
    snapshot = load_trace(str(path))
    ooms = [e for e in snapshot["device_traces"][0] if e["action"] == "oom"]
    assert len(ooms) == 1 and ooms[0]["size"] == 32 * MiB
    text = out.getvalue()
    assert f"snapshot written to {path}" in text
    assert "OOM: a request of 32.00 MiB failed with 240.00 MiB free on the device" in text
    assert "verdict: device refused" in text  # the device said it had the bytes: the injected fault
    assert "16.00 MiB" in text and "counterfactual on a device of 256.00 MiB" in text
    # Nothing left behind: the trace ring is off again, files closed, and the next step runs.
    assert monitor.snapshot_path == str(path) and not monitor._files
    again = pool.malloc(32 * MiB)
    assert pool.trace(0) == []
    with MemoryMonitor(source=PoolStats(pool), file=out) as next_monitor:
        pool.free(again)
        row = next_monitor.step()
    assert row["peak_allocated_bytes"] == 48 * MiB
    pool.free(kept)
    pool.check_invariants()


def test_an_oom_on_the_cpu_source_is_reraised_with_a_plain_message():
    out = io.StringIO()
    with pytest.raises(torch.OutOfMemoryError):
        with MemoryMonitor(source="cpu", file=out):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    assert "no allocator snapshot to explain" in out.getvalue() and not _get_current_dispatch_mode_stack()


def test_other_exceptions_pass_through_without_a_post_mortem():
    out = io.StringIO()
    with pytest.raises(KeyError):
        with MemoryMonitor(source="cpu", file=out):
            raise KeyError("boom")
    assert out.getvalue() == "" and not _get_current_dispatch_mode_stack()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="record_history"):
        MemoryMonitor(source="cpu", record_history=0)
    with pytest.raises(ValueError, match="source='gpu'"):
        MemoryMonitor(source="gpu")
    with pytest.raises(ValueError, match="model"):
        MemoryMonitor(source="cpu", model=object())
    with pytest.raises(ValueError, match="optimizer"):
        MemoryMonitor(source="cpu", optimizer=object())
    with pytest.raises(ValueError, match="lacks read, reset_peak"):
        MemoryMonitor(source=object())
    with pytest.raises(RuntimeError, match="not active"):
        MemoryMonitor(source="cpu").step()


def test_columns_and_scalars_are_consistent():
    assert set(SCALARS) <= set(COLUMNS) and "step" not in SCALARS
    # Every row the monitor writes has exactly these columns (checked on a CPU step).
    with MemoryMonitor(source="cpu") as monitor:
        row = monitor.step()
    assert tuple(row) == tuple(c for c in COLUMNS if c in row) and set(row) == set(COLUMNS)
    pickle.dumps(row)  # plain data


def test_tensorboard_is_an_optional_extra_and_its_absence_is_explained(monkeypatch, tmp_path):
    import os
    import sys

    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    extras = project["optional-dependencies"]
    assert "tensorboard" in extras["monitor"] and "tensorboard" in extras["test"]
    assert not any("tensorboard" in d for d in project["dependencies"])  # optional: never required
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    with pytest.raises(ImportError, match=r"memkernels\[monitor\]"):
        MemoryMonitor(source="cpu", log_dir=str(tmp_path)).__enter__()
    assert not _get_current_dispatch_mode_stack()


def test_importing_the_tools_pulls_in_no_optional_dependency():
    import subprocess
    import sys

    code = ("import sys, memkernels, memkernels.integrations; memkernels.MemoryMonitor; memkernels.explain; "
            "print(sorted(m for m in ('transformers', 'tensorboard', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_dispatch_mode_left_open_inside_a_step_is_refused_not_popped():
    with MemoryMonitor(source="cpu") as monitor:
        stray = PeakBytesMeter().__enter__()
        with pytest.raises(RuntimeError, match="still active"):
            monitor.step()
        stray.__exit__(None, None, None)
        monitor.begin_step()
        assert monitor.step()["peak_allocated_bytes"] == 0
    assert not _get_current_dispatch_mode_stack()


def test_an_oom_without_history_says_the_failing_request_was_not_recorded(sim_pool, tmp_path):
    from memkernels import _C

    pool, sim = sim_pool
    out = io.StringIO()
    with pytest.raises(_C.OutOfMemoryError):
        with MemoryMonitor(source=PoolStats(pool), oom_snapshot=str(tmp_path / "oom.pickle"), file=out):
            sim.fail_allocations(1, count=2)
            pool.malloc(32 * MiB)
    assert "recorded no history, so the failing request is not in the snapshot" in out.getvalue()


def test_steps_are_numbered_from_1_as_the_trainer_callbacks_are():
    """MemoryMonitor's rows started at step 0 and MemoryCallback's at 1 (issue 38)."""
    with MemoryMonitor(source="cpu") as monitor:
        for _ in range(3):
            torch.ones(1024).sum()
            monitor.step()
    assert [row["step"] for row in monitor.rows] == [1, 2, 3]
