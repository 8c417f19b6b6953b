"""``pytest benchmarks/ --benchmark-only``: collect the benchmark modules that define pytest-benchmark tests.

pytest collects ``test_*.py`` on its own; a benchmark is ``bench_*.py``, run as a script or through pytest.
Only the modules with a top-level ``def test_`` are collected (bench_cross_entropy, bench_dyt, bench_gated_mlp,
bench_gelu_linear, bench_rms_norm, bench_rope, bench_step); the others are scripts only. A module named on the
command line is collected by pytest itself (``pytest benchmarks/bench_step.py --benchmark-only``).

Without CUDA, TRITON_INTERPRET=1 is set here, before any benchmark imports triton (as bench_step, bench_rope and
bench_dyt do when run alone): collected together, the first module's import would otherwise decide for all, and
bench_step counts memkernels' Triton launches through the interpreter.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collect_file(file_path, parent):
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path)
            and "\ndef test_" in file_path.read_text(encoding="utf-8")):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
