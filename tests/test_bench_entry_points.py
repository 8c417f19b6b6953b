"""The op benchmarks' pytest-benchmark entry points (issue 31.4: ``pytest benchmarks/ --benchmark-only`` runs
them, ``--benchmark-json`` keeps the figures, the scripts' tables stay).

Each benchmark below is imported as pytest imports it (with pytest's command line in sys.argv, which
bench_rms_norm.py used to parse at import) and its test is run once here on a stand-in for pytest-benchmark's
``benchmark`` fixture, at its CPU shape: a few seconds in all. benchmarks/conftest.py collects a ``bench_*.py``
with a top-level ``def test_``.
"""
import inspect
import sys

import pytest
from bench_loader import BENCHMARKS_DIR, load_file

# {benchmark: (its pytest-benchmark test, the parameter values pytest_generate_tests gives it)}
ENTRY_POINTS = {
    "bench_gated_mlp": ("test_gated_mlp_forward_backward", {}),
    "bench_gelu_linear": ("test_gelu_linear_forward_backward", {}),
    "bench_rms_norm": ("test_norm_forward_backward", {"norm": ["rms_norm", "layer_norm"]}),
    "bench_cross_entropy": ("test_linear_cross_entropy_forward_backward",
                            {"strategy": ["recompute", "chunked", "auto"]}),
}


class StandInBenchmark:
    """pytest-benchmark's fixture, as far as the tests use it: each call runs the function once."""

    def __init__(self):
        self.extra_info = {}
        self.calls = 0

    def __call__(self, function, *args, **kwargs):
        self.calls += 1
        return function(*args, **kwargs)

    def pedantic(self, function, args=(), kwargs=None, rounds=1, warmup_rounds=0, iterations=1, setup=None):
        self.calls += 1
        return function(*args, **(kwargs or {}))


def load_as_pytest_does(name, monkeypatch):
    """benchmarks/<name>.py imported under a module name of its own, with a pytest command line in sys.argv."""
    monkeypatch.setattr(sys, "argv", ["pytest", "benchmarks/", "--benchmark-only", "-q"])
    return load_file(f"{BENCHMARKS_DIR}/{name}.py", f"{name}_entry_point")


def cases():
    for name, (test, parameters) in ENTRY_POINTS.items():
        (key, values), = parameters.items() if parameters else ((None, [None]),)
        for value in values:
            yield pytest.param(name, test, key, value, id=f"{name}-{value}" if value else name)


@pytest.mark.parametrize("name, test, key, value", cases())
def test_entry_point_runs_and_keeps_its_figures(name, test, key, value, monkeypatch):
    module = load_as_pytest_does(name, monkeypatch)
    function = getattr(module, test)
    assert "benchmark" in inspect.signature(function).parameters
    assert f"\ndef {test}(" in open(f"{BENCHMARKS_DIR}/{name}.py", encoding="utf-8").read()  # conftest collects it
    assert callable(module.main)  # the script, with its tables, stays
    benchmark = StandInBenchmark()
    function(benchmark, **({key: value} if key else {}))
    assert benchmark.calls == 1
    if name == "bench_cross_entropy":
        assert benchmark.extra_info["strategy"] == ("recompute" if value == "recompute" else "chunked")
        assert benchmark.extra_info["held_hooks_bytes"] > 0
    else:
        saved = benchmark.extra_info["saved_bytes_per_token"]
        assert 0 < saved["memkernels"] <= saved["eager"], saved


def test_rms_norm_reads_no_command_line_when_imported(monkeypatch):
    module = load_as_pytest_does("bench_rms_norm", monkeypatch)
    assert (module.ARGS.tokens, module.ARGS.hidden, module.ARGS.backend, module.ARGS.sweep_backward) == (
        4096, 4096, "torch", False)
