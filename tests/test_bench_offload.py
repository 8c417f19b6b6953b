"""benchmarks/bench_offload.py's table on the simulated device: its invariants, not its numbers.

The step times there are modelled (the simulator's link and stand-in kernels), so they are deterministic: at
the default 64 MiB/s link, "auto" hides its copies behind the forward and offloading everything does not.
"""
import contextlib
import io

import pytest
from bench_loader import load_benchmark

from memkernels.device import sim

bench_offload = load_benchmark("bench_offload")


@pytest.fixture(scope="module")
def run():
    """The sim path's rows by mode, and what it printed; the simulator reset after."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            rows = bench_offload.main(["--sim", "--steps", "3"])
    finally:
        sim.hold_events(False)
        sim.reset()
    return {row["mode"]: row for row in rows}, printed.getvalue()


def test_one_row_per_mode_and_the_table_says_modelled(run):
    rows, printed = run
    assert list(rows) == list(bench_offload.MODES)
    assert printed.startswith("MODELLED step times")
    for mode in bench_offload.MODES:
        assert f"\n{mode} " in printed


def test_auto_hides_its_copies_and_everything_does_not(run):
    rows, _ = run
    assert rows["auto"]["step_s"] <= 1.05 * rows["none"]["step_s"]
    assert rows["everything"]["step_s"] > rows["auto"]["step_s"]


def test_auto_offloads_within_its_budget(run):
    auto = run[0]["auto"]
    assert 0 < auto["offloaded"] <= auto["budget"]
    assert auto["kept_budget"] > 0
    assert run[0]["everything"]["kept_budget"] == 0


def test_recompute_and_offload_leave_less_after_forward(run):
    rows, _ = run
    for mode in ("recompute", "auto", "everything"):
        assert rows[mode]["after_forward"] < rows["none"]["after_forward"]
        assert rows[mode]["resident"] < rows["none"]["resident"]
    assert rows["recompute"]["step_s"] > rows["none"]["step_s"], "recompute runs each layer's forward again"


def test_offloaded_checkpoints_cost_at_most_2_percent_over_recompute_and_free_its_inputs(run):
    rows, _ = run
    checkpoints, recompute = rows["checkpoints"], rows["recompute"]
    assert checkpoints["step_s"] <= 1.02 * recompute["step_s"]
    assert checkpoints["offloaded"] > 0
    assert checkpoints["after_forward"] < recompute["after_forward"]
    assert checkpoints["resident"] < recompute["resident"]
