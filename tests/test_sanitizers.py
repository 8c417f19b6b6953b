"""The C++ core under AddressSanitizer+UndefinedBehaviorSanitizer and under ThreadSanitizer.

For each sanitizer this builds memkernels._C with MEMKERNELS_SANITIZE (see
setup.py) into build/sanitize-<name>/ (kept between runs so ninja only
recompiles what changed), assembles a throw-away tree with the Python package,
the tests and pyproject.toml next to the sanitized extension, and runs every
test module marked ``pytestmark = pytest.mark.cpp`` there, in a fresh
interpreter with gcc's runtime (``gcc -print-file-name=libasan.so`` /
``libtsan.so``) preloaded. The run fails on a non-zero exit or on any
sanitizer report in its output.

The sanitized run sets MEMKERNELS_TEST_NO_TORCH=1 so tests/conftest.py does
not import torch (torch's libraries are not built for the sanitizers); the
``cpp`` modules must therefore not import torch either. Every ``cpp`` module
runs (the full C++-facing set, ``slow`` cases included); new ``cpp`` modules
are picked up automatically. The run also sets MEMKERNELS_SANITIZER_RUN to
the sanitizer's name ("address-undefined" or "thread"), so a long fuzz or
stress test may scale its iteration count down there (TSan costs 5-15x).

The subprocess runs Python itself (not a shell: bash dies under a preloaded
libtsan). TSan works here as is (gcc 12, kernel with 28 bits of mmap
randomness); no `setarch -R` needed. Under TSan an mmap of 1 TiB may fail,
hence the simulator's 256 GiB default address space.

Measured on a quiet 2-core machine (2026-11-28), from a clean build/: ASan+UBSan
(built -O0 -g1) 111 s wall, 143 s of CPU; TSan (-O1 -g1; at -O0 its test run
takes several times longer) 97 s wall, 116 s of CPU; both built -O1 -g, as
before, 313 s of CPU for the two. With the builds cached, ninja recompiles
nothing and the sanitized test runs alone remain. Since 2026-12-01 the bindings
compile as one unit (csrc/bindings/module.cpp); inside the whole suite on a
slower 2-core machine: ASan+UBSan 275 -> 242 s, TSan 235 -> 200 s of wall.
Since 2026-12-02 ASan+UBSan builds at -O1 too (the level ASan's documentation
recommends): on that machine, alone, the build takes 33 s at either level and
the sanitized test run 105 s at -O0, 69 s at -O1 (the fuzz's 10^5 steps with
an invariant recount each: 12-18 s a case at -O0, 1.5-2.9 s at -O1); TSan's
run 61 s. The thread stress cases' times vary most (8-33 s): they are
contention, not work.
"""
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

pytestmark = [pytest.mark.sanitizer, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")

SANITIZERS = {
    # name: (MEMKERNELS_SANITIZE value, runtime to preload, symbol proving the build is instrumented)
    "address-undefined": ("address,undefined", "libasan.so", b"__asan_init"),
    "thread": ("thread", "libtsan.so", b"__tsan_init"),
}
RUNTIME_OPTIONS = {
    # Python itself leaks by design at exit; leak checking would only report that.
    # allocator_may_return_null: an impossible size must come back as NULL (as
    # from glibc), which the simulator turns into an out-of-memory code; the
    # sanitizers' default is to abort instead.
    "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0:allocator_may_return_null=1",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    # Report every race, then exit non-zero at the end.
    "TSAN_OPTIONS": "halt_on_error=0:exitcode=66:second_deadlock_stack=1:allocator_may_return_null=1",
}
REPORT_PATTERNS = re.compile(
    r"ERROR: AddressSanitizer|runtime error:|UndefinedBehaviorSanitizer|"
    r"WARNING: ThreadSanitizer|ERROR: ThreadSanitizer|FATAL: ThreadSanitizer"
)
CPP_MARK = re.compile(r"^pytestmark\s*=.*\bpytest\.mark\.cpp\b", re.MULTILINE)


def cpp_test_modules():
    """Test files whose module-level pytestmark includes pytest.mark.cpp."""
    modules = []
    for name in sorted(os.listdir(TESTS)):
        if name.startswith("test_") and name.endswith(".py"):
            with open(os.path.join(TESTS, name)) as f:
                if CPP_MARK.search(f.read()):
                    modules.append(name)
    return modules


def gcc_library(library):
    path = subprocess.run(["gcc", f"-print-file-name={library}"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        pytest.fail(f"gcc has no {library} (gcc -print-file-name={library} -> {path!r}); install gcc's sanitizer runtimes")
    return path


def preload(runtime_library):
    """The sanitizer runtime first, then libstdc++: Python does not link libstdc++, so
    without it the runtime's __cxa_throw interceptor finds no real function and
    ASan aborts on the first C++ exception ("real___cxa_throw != 0")."""
    return f"{gcc_library(runtime_library)} {gcc_library('libstdc++.so.6')}"


def build_sanitized(name, flags):
    """Build the extension with MEMKERNELS_SANITIZE=flags; return the path of the built _C module."""
    cache = os.path.join(ROOT, "build", f"sanitize-{name}")
    lib, temp = os.path.join(cache, "lib"), os.path.join(cache, "temp")
    env = dict(os.environ, MEMKERNELS_SANITIZE=flags)
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", lib, "--build-temp", temp],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"sanitized build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    built = os.path.join(lib, "memkernels", "_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    assert os.path.isfile(built), f"build did not produce {built}"
    return built


def assemble_tree(tree, extension):
    """A copy of the checkout (sources, build helpers, tests, the benchmarks some tests load,
    pyproject.toml) whose package holds the sanitized extension instead of the regular one."""
    skip = shutil.ignore_patterns("*.so", "__pycache__")
    for part in ("memkernels", "tests", "benchmarks", "csrc", "_build"):
        shutil.copytree(os.path.join(ROOT, part), os.path.join(tree, part), ignore=skip)
    shutil.copy2(extension, os.path.join(tree, "memkernels"))
    shutil.copy2(os.path.join(ROOT, "pyproject.toml"), tree)


@pytest.mark.parametrize("name", sorted(SANITIZERS))
def test_cpp_tests_are_clean_under_sanitizer(name, tmp_path):
    flags, library, marker_symbol = SANITIZERS[name]
    modules = cpp_test_modules()
    assert "test_device_sim.py" in modules, "the marker scan found none of the known cpp modules"
    runtime = preload(library)
    extension = build_sanitized(name, flags)
    with open(extension, "rb") as f:
        assert marker_symbol in f.read(), f"{extension} is not instrumented ({marker_symbol!r} missing)"
    tree = str(tmp_path / "tree")
    assemble_tree(tree, extension)

    env = dict(os.environ, MEMKERNELS_TEST_NO_TORCH="1", MEMKERNELS_SANITIZER_RUN=name, LD_PRELOAD=runtime,
               **RUNTIME_OPTIONS)
    env.pop("MEMKERNELS_DEVICE", None)
    env.pop("PYTHONPATH", None)
    command = [sys.executable, "-c",
               "import memkernels._C as c, sys; sys.stdout.write(c.__file__)"]
    proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.startswith(tree), f"the run would import {proc.stdout}, not the sanitized build"

    # --capture=sys: a sanitizer writes its report to fd 2 and may end the
    # process; fd-level capture would swallow the report with it.
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--capture=sys",
               "-m", "cpp", *[os.path.join("tests", m) for m in modules]]
    proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    reports = REPORT_PATTERNS.findall(output)
    assert proc.returncode == 0 and not reports, (
        f"{name}: exit {proc.returncode}, sanitizer reports {sorted(set(reports))}\n{output[-12000:]}"
    )
