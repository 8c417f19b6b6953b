"""Load a script of benchmarks/ (or any .py file) as a module, for the tests that check a benchmark's output
or use its helpers.

benchmarks/ is not a package and not on sys.path, so the tests load the scripts by path. The path is taken
from this file's place (tests/ next to benchmarks/), so it holds in any copy of the checkout that keeps
both folders, e.g. the tree test_sanitizers assembles.
"""
import importlib.util
import os
import sys

BENCHMARKS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def load_file(path, name, *, register=False):
    """The module `name` executed from the file at `path`: a fresh one at every call.

    With `register`, it is put in sys.modules under `name` before it runs, as an import would (dataclasses
    and pickling look a class's module up there); taken out again if running it raises."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        if register:
            sys.modules.pop(name, None)
        raise
    return module


def load_benchmark(name):
    """benchmarks/<name>.py as the module `name` (e.g. "bench_offload"), loaded once per process: later calls,
    from any test file, get the same module from sys.modules."""
    if name in sys.modules:
        return sys.modules[name]
    return load_file(os.path.join(BENCHMARKS_DIR, f"{name}.py"), name, register=True)
