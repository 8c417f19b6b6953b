"""``pytest benchmarks/ --benchmark-only``: collect the benchmark modules that define pytest-benchmark tests.

pytest collects ``test_*.py`` on its own; a benchmark is ``bench_*.py``, run as a script or through pytest.
Only the modules with a top-level ``def test_`` are collected: the others are scripts that parse the command
line when imported (bench_rms_norm.py). A module named on the command line is collected by pytest itself
(``pytest benchmarks/bench_step.py --benchmark-only``).
"""
import pytest


def pytest_collect_file(file_path, parent):
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path)
            and "\ndef test_" in file_path.read_text(encoding="utf-8")):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
