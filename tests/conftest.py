"""Test harness: Triton kernels run through the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported, so it is set
here, at collection time, before any test module imports memkernels.fusions.

MEMKERNELS_TEST_NO_TORCH=1 (set by tests/test_sanitizers.py for its
subprocesses) skips importing torch: the sanitizer runs load only the C++
core and the torch-free ``cpp`` test modules, and torch's own libraries are
neither built with nor meant to run under ASan/TSan.
"""
import contextlib
import os
import random
import zlib

NO_TORCH = os.environ.get("MEMKERNELS_TEST_NO_TORCH") == "1"

# Inductor's on-disk cache does not key its C++ kernels on ATEN_CPU_CAPABILITY: after a native run,
# ATEN_CPU_CAPABILITY=default reused AVX-512 code and failed to compile it ("'at::vec' has not been
# declared"). A run under another capability gets its own cache directory.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import getpass
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY']}")

# CPU threads per pytest-xdist worker: the machine's cores shared among the workers. PyTorch's default, every
# core in every worker, oversubscribed a 2-core machine 2:1 with spinning OpenMP threads: tests/test_plan.py's
# real runs took 77 s with 2 workers, 19 s with a thread each (2026-12-07). Set before torch is imported, so the
# test's subprocesses (the CLI runs, the distributed ranks) inherit it; a value the caller set is kept.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0))
                                            // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

if not NO_TORCH:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _patch_interpreter_builder(method_name, make_patched):
    """Replace ``InterpreterBuilder.<method_name>`` by ``make_patched(original, interpreter, tl)``, once."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    original = getattr(builder, method_name)
    if getattr(original, "_memkernels_shim", False):
        return
    patched = make_patched(original, interpreter, tl)
    patched._memkernels_shim = True
    setattr(builder, method_name, patched)


def _bf16_dot_shim(original, interpreter, tl):
    """Test-only fix for triton 3.9's interpreter: ``tl.dot`` on bfloat16 operands.

    The interpreter stores bf16 tensors as raw uint16 arrays and its dot calls
    np.matmul on them directly, multiplying the *bit patterns* (relative error
    ~1e9). fp32 and fp16 are right. Here bf16 operands are widened to float32
    first (bf16 is the top half of an fp32, so this is exact) and the product
    accumulates in the accumulator's dtype, as the hardware's bf16 MMA does.
    The shim only touches the interpreter; compiled kernels never see it.
    """

    def widen(handle):
        return (handle.data.astype(np.uint32) << 16).view(np.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16 or b.dtype == tl.bfloat16:
            a_data = widen(a) if a.dtype == tl.bfloat16 else a.data.astype(np.float32)
            b_data = widen(b) if b.dtype == tl.bfloat16 else b.data.astype(np.float32)
            out = np.matmul(a_data, b_data, dtype=np.float32).astype(d.data.dtype) + d.data
            return interpreter.TensorHandle(out, d.dtype.scalar)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    return create_dot


def _bf16_rounding_shim(original, interpreter, tl):
    """Test-only fix for triton 3.9's interpreter: float32 -> bfloat16 casts truncate.

    ``x.to(tl.bfloat16)`` in the interpreter drops the low 16 bits (round toward
    zero), so every bf16 result carries up to one full ulp of error where a GPU
    rounds to nearest even (half an ulp): a bf16 kernel then looks twice as
    inaccurate as it is. Here the cast rounds to nearest even, NaN kept quiet.
    Compiled kernels never see this.
    """

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            nan = np.isnan(src.data)
            rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
            return interpreter.TensorHandle(rounded.reshape(src.data.shape), dst_type.scalar)
        return original(self, src, dst_type)

    return cast_impl


# The shims above replace methods of triton's interpreter as these versions define them; on
# another version they could miss or break it, and the kernels' tests would judge the interpreter.
INTERPRETER_SHIM_TRITON = ("3.9.",)


def interpreter_triton_problem(version):
    """Why the interpreter tests cannot run with triton ``version``, or None when they can."""
    if version.startswith(INTERPRETER_SHIM_TRITON):
        return None
    return (f"the tests run Triton kernels through the interpreter (no GPU here), and tests/conftest.py's shims "
            f"of it are written for triton {' or '.join(v + 'x' for v in INTERPRETER_SHIM_TRITON)}; this "
            f"environment has triton {version}. Install a supported one: pip install triton==3.9.0")


def _installed_triton_version():
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def pytest_configure(config):
    version = _installed_triton_version() if os.environ.get("TRITON_INTERPRET") == "1" else None
    problem = version and interpreter_triton_problem(version)
    if problem:
        raise pytest.UsageError(problem)


def pytest_runtest_logreport(report):
    """MEMKERNELS_FAILURE_LOG=path: append each failure (node id, last lines of its report) as it happens.

    benchmarks/gpu_check.sh sets it: a device lease can end mid-run, and the first GPU run (H200) lost
    pytest's end-of-run summary that way; failures written as they happen survive."""
    path = os.environ.get("MEMKERNELS_FAILURE_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):  # xdist: the controller writes
        lines = str(report.longrepr).splitlines()[-30:]
        with open(path, "a") as log:
            log.write(f"==== {report.nodeid} [{report.when}]\n" + "\n".join(lines) + "\n")


if os.environ.get("TRITON_INTERPRET") == "1" and not interpreter_triton_problem(_installed_triton_version() or ""):
    _patch_interpreter_builder("create_dot", _bf16_dot_shim)
    _patch_interpreter_builder("cast_impl", _bf16_rounding_shim)


@pytest.fixture(params=["torch", "triton"])
def backend(request):
    """Run the Triton kernels (on CUDA tensors with a GPU, else through the interpreter) and the PyTorch reference."""
    from backends import use_backend

    with use_backend(request.param):
        yield request.param


@pytest.fixture
def cuda_nans(monkeypatch):
    """Make the interpreter's float32 arithmetic return CUDA's canonical NaN (0x7FFFFFFF) instead of
    numpy's 0x7FC00000/0xFFC00000, which cast_rne's old bit rounding happened to keep a NaN."""
    from triton.runtime import interpreter

    def canonical(handle):
        data = handle.data
        if isinstance(data, np.ndarray) and data.dtype == np.float32 and np.isnan(data).any():
            data = data.copy()
            data.view(np.uint32)[np.isnan(data)] = 0x7FFFFFFF
            return interpreter.TensorHandle(data, handle.dtype)
        return handle

    builder = interpreter.InterpreterBuilder
    binary_op, unary_op = builder.binary_op, builder.unary_op
    monkeypatch.setattr(builder, "binary_op", lambda self, *args: canonical(binary_op(self, *args)))
    monkeypatch.setattr(builder, "unary_op", lambda self, *args: canonical(unary_op(self, *args)))


# How long a blocking call on the simulated device waits for held or queued work before it fails with
# cudaErrorLaunchTimeout (702). The tests always release what they hold, so the wait always ends; a
# shorter limit would fail a test whose stream workers or releasing thread were merely descheduled on a
# loaded machine (issue 32). As long as CI's own limit (90 min): it only turns a real hang into an error.
# Only test_device_sim's test of the timeout itself sets a short one.
SIM_SYNC_TIMEOUT_S = 5400.0


@contextlib.contextmanager
def simulated_device(*, capacity, granularity, memory="backed", address_space=1 << 36,
                     sync_timeout_s=SIM_SYNC_TIMEOUT_S, device_count=1):
    """Select and configure the simulated CUDA device; release held events and reset it after."""
    from memkernels.device import sim, use_sim

    use_sim()
    sim.configure(device_count=device_count, capacity=capacity, host_capacity=None, granularity=granularity,
                  memory=memory, address_space=address_space, sync_timeout_s=sync_timeout_s)
    try:
        yield sim
    finally:
        sim.hold_events(False)
        sim.reset()


def _test_seed(node_id):
    """The seed of one test: a fixed one per test by default (CI reruns see the same inputs);
    MEMKERNELS_TEST_SEED=random draws fresh inputs every run (to hunt rare failures, e.g. with
    pytest-repeat or a nightly job); MEMKERNELS_TEST_SEED=<number> replays a printed seed."""
    choice = os.environ.get("MEMKERNELS_TEST_SEED", "")
    if choice == "random":
        return int.from_bytes(os.urandom(4), "little")
    if choice:
        return int(choice)
    return zlib.crc32(node_id.encode())


@pytest.fixture(autouse=True)
def _seed(request):
    """Seed torch, numpy and random for each test; the seed is printed when the test fails."""
    seed = _test_seed(request.node.nodeid)
    if not NO_TORCH:
        torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield


def pytest_runtest_makereport(item, call):
    if call.when == "call" and call.excinfo is not None:
        for key, value in item.user_properties:
            if key == "seed":
                item.add_report_section(
                    "call", "seed", f"seed {value} (torch.manual_seed / np.random.seed / random.seed) reproduces this run"
                )


@pytest.fixture(scope="session")
def aot_ops_reports(tmp_path_factory):
    """The AOT compile reports (memkernels.aot.check) of every kernel memkernels.fusions registers, for sm_80 and
    sm_90: compiled once per test run, whichever test asks first, and shared by every xdist worker (a lock
    and a file in the run's temporary directory; each worker's module fixtures compiled it again, and the
    norm and cross-entropy files a third time, minutes of a 2-core run for the same reports, issue 32)."""
    import dataclasses
    import fcntl
    import importlib
    import json

    from memkernels import aot

    for module in aot.ops_modules():
        importlib.import_module(module)
    names = sorted(name for name, (module, _, _) in aot.registered().items()
                   if module.startswith("memkernels.fusions."))
    # this run's directory: an xdist worker's basetemp is one folder per worker inside it
    run_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run_dir = run_dir.parent
    path = run_dir / "aot-ops-reports.json"
    with open(run_dir / "aot-ops-reports.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not path.exists():
            reports = aot.check(names, archs=(80, 90))  # no time limit: see aot.check
            path.write_text(json.dumps([dataclasses.asdict(r) for r in reports]))
    return [aot.AotReport(**row) for row in json.loads(path.read_text())]


def pytest_collection_modifyitems(config, items):
    """Slow checks first (a stable sort: the order within each group stays pytest's). Under xdist the
    longest tests (the sanitizer runs, the wheel build, `memkernels report`: minutes each) were collected
    last and ran while the other worker sat idle at the end of the run; started first, they overlap the
    quick tests instead (issue 32). The order is the same in every worker, as xdist requires."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
