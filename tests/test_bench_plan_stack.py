"""benchmarks/bench_plan_stack.py (issue 35's GPU check) on the CPU: every line of the GPU run but the CUDA-only
ones, at its tiny shape, and its verdicts on rows that miss."""
import os
from types import SimpleNamespace

import pytest
import torch
from bench_loader import BENCHMARKS_DIR, load_file

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bench():
    return load_file(os.path.join(BENCHMARKS_DIR, "bench_plan_stack.py"), "bench_plan_stack", register=True)


def test_each_planned_run_measures_the_peak_the_plan_predicts(bench, capsys):
    assert bench.main(["--tiny", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["128"], ["256"])]
    assert [row[1] for row in rows] == ["keep", "recompute"] * 2
    for row in rows:
        assert row[-1] != "MISS" and "ok" in row
    planned = [row for row in rows if row[1] == "recompute"]
    assert all("recompute" in " ".join(row[10:]) for row in planned), out  # the half budget binds
    assert "overheads are judged on a GPU only" in out


def _row(predicted, tensors, allocator=None, overhead=0.0, predicted_overhead=0.0):
    placement = SimpleNamespace(predicted_peak=predicted, describe=lambda: "keep: 0-3")
    return dict(seq=128, run="recompute", placement=placement, tensors=tensors, allocator=allocator, seconds=1.0,
                overhead=overhead, predicted_overhead=predicted_overhead)


@pytest.mark.parametrize("row, device, misses", [
    (_row(1000, 1029), "cpu", []),
    (_row(1000, 1031), "cpu", ["tensors peak +3.1% off the plan's"]),
    (_row(1000, 1000, allocator=960), "cuda", ["allocator peak -4.0% off the plan's"]),
    (_row(1000, 1100, allocator=1000), "cuda", []),  # on CUDA the allocator's peak is judged (tensors: host too)
    (_row(1000, 1000, overhead=0.10, predicted_overhead=0.06), "cuda", ["overhead +10.0% against the plan's +6.0%"]),
    (_row(1000, 1000, overhead=0.10, predicted_overhead=0.06), "cpu", []),  # a CPU's times are not judged
], ids=["within", "tensors", "allocator", "allocator-judged", "overhead", "cpu-times"])
def test_verdicts_name_each_miss(bench, row, device, misses):
    assert bench.verdicts([row], torch.device(device)) == [(row, misses)]


def test_bad_arguments_name_the_flag(bench, capsys):
    for argv, flag in ((["--fraction", "0"], "--fraction"), (["--steps", "0"], "--steps"),
                       (["--seqs", "16k"], "--seqs")):
        with pytest.raises(SystemExit):
            bench.main(["--tiny", *argv])
        assert flag in capsys.readouterr().err
