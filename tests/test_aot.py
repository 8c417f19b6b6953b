"""The AOT compile check on small kernels with known properties (tests/aot_example_kernels.py).

The tests that compile (the module fixture runs aot.check(): ~400 s on a loaded 2-core machine) are
marked slow, like tests/test_aot_ops.py; the argument checks stay in the quick loop.
"""
import os
import subprocess
import sys

import pytest

import aot_example_kernels
from memkernels import aot

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def reports():
    """One subprocess compiles every example variant for sm_80 and sm_90, and nothing else: aot.check() with
    no names would also compile every ops kernel that other tests in this worker imported (it did: 2 minutes a
    worker). Without a time limit: under load a timeout tripped and errored every test here (issue 32;
    test_testing.py keeps it out)."""
    examples = [name for name, (module, _, _) in aot.registered().items() if module == aot_example_kernels.__name__]
    return {(r.kernel, r.variant, r.arch): r for r in aot.check(examples)}


@pytest.mark.slow
@pytest.mark.parametrize("arch", aot.ARCHS)
def test_simple_kernel_compiles_cleanly(reports, arch):
    report = reports["example_scale", "block1024", arch]
    assert report.ok, report.error
    assert 0 < report.registers <= 255
    assert report.spill_stores == report.spill_loads == 0
    assert report.shared_bytes == 0  # elementwise: no shared memory at all
    assert report.compile_seconds > 0  # time as data: only that it was measured (load only lengthens it)


@pytest.mark.slow
@pytest.mark.parametrize("arch", aot.ARCHS)
def test_alignment_hints_reach_the_compiler(reports, arch):
    # Without 16-divisibility the masked loads cannot be vectorized; with it, as the
    # JIT specializes aligned launches, each thread loads 4 floats at once.
    unaligned = reports["example_scale", "block1024", arch]
    aligned = reports["example_scale", "block1024-aligned", arch]
    assert aligned.ok, aligned.error
    assert unaligned.vector_loads == 0
    assert aligned.vector_loads > 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", aot.ARCHS)
def test_cross_warp_reduction_uses_one_float_per_warp(reports, arch):
    report = reports["example_normalize_row", "8warps", arch]
    assert report.ok, report.error
    assert report.shared_bytes == 8 * 4  # 8 warps each leave one fp32 partial sum


@pytest.mark.slow
@pytest.mark.parametrize("arch", aot.ARCHS)
def test_register_starved_kernel_reports_spills(reports, arch):
    report = reports["example_normalize_row", "1warp-maxnreg32", arch]
    assert not report.error
    assert report.registers <= 32
    assert report.spill_stores > 0 and report.spill_loads > 0
    assert report.stack_bytes > 0  # spills live in the stack frame
    assert not report.ok


@pytest.mark.slow
@pytest.mark.parametrize("arch", aot.ARCHS)
def test_pipelined_matmul_shared_memory_is_sane(reports, arch):
    report = reports["example_tile_matmul", "64x64x32-3stages", arch]
    assert report.ok, report.error
    one_stage = (64 * 32 + 32 * 64) * 2  # an fp16 A tile and B tile
    assert one_stage <= report.shared_bytes <= 3 * one_stage


@pytest.mark.slow
@pytest.mark.parametrize("arch", aot.ARCHS)
def test_compile_error_is_reported_not_raised(reports, arch):
    report = reports["example_broken_block", "block1000", arch]
    assert "power of 2" in report.error or "power of two" in report.error, report.error
    assert not report.ok


@pytest.mark.slow
def test_command_line_table_and_exit_code():
    def run(*names):
        command = [sys.executable, "-m", "memkernels.aot", "--module", "aot_example_kernels"]
        for name in names:
            command += ["--name", name]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(TESTS_DIR), TESTS_DIR]))
        return subprocess.run(command, capture_output=True, text=True, env=env)

    clean = run("example_scale")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    # example_scale: 2 variants x 2 archs
    assert clean.stdout.count(" ok") == 4 and "sm_80" in clean.stdout and "sm_90" in clean.stdout
    spilling = run("example_scale", "example_normalize_row")
    assert spilling.returncode == 1
    assert spilling.stdout.count("SPILLS") == 2


def test_compiling_in_process_under_the_interpreter_is_refused():
    variant = aot.registered()["example_scale"]
    assert variant[0] == "aot_example_kernels"
    with pytest.raises(RuntimeError, match="check()"):
        aot.compile_kernel(aot_example_kernels.scale_kernel, {"label": "x"}, 80)


def test_register_rejects_bad_variants():
    kernel = aot_example_kernels.scale_kernel
    good = {"signature": {"x_ptr": "*fp32"}, "constexprs": {"BLOCK": 64}, "num_warps": 4, "num_stages": 1,
            "label": "a"}
    with pytest.raises(ValueError, match="missing keys"):
        aot.register(kernel, name="bad", variants=[{k: v for k, v in good.items() if k != "label"}])
    with pytest.raises(ValueError, match="num_warps"):
        aot.register(kernel, name="bad", variants=[dict(good, num_warps=3)])
    with pytest.raises(ValueError, match="unique"):
        aot.register(kernel, name="bad", variants=[good, good])
    with pytest.raises(ValueError, match="already registered"):
        aot.register(aot_example_kernels.tile_matmul_kernel, name="example_scale", variants=[good])
    with pytest.raises(ValueError, match="non-empty list"):
        aot.register(kernel, name="bad", variants=[])
    with pytest.raises(ValueError, match=r"\['BLOCK'\] are not run-time arguments"):
        aot.register(kernel, name="bad", variants=[dict(good, aligned=["BLOCK"])])
    with pytest.raises(TypeError, match="list of argument names"):
        aot.register(kernel, name="bad", variants=[dict(good, aligned="x_ptr")])
    with pytest.raises(ValueError, match=r"\['archs'\]=\('sm_90',\)"):
        aot.register(kernel, name="bad", variants=[dict(good, archs=("sm_90",))])

    def local_kernel(x_ptr):
        return x_ptr

    with pytest.raises(ValueError, match="top level"):
        aot.register(local_kernel, name="bad", variants=[good])
    assert "bad" not in aot.registered()


def test_a_variant_compiles_only_for_the_archs_it_names():
    good = {"signature": {"x_ptr": "*fp32"}, "constexprs": {"BLOCK": 64}, "num_warps": 4, "num_stages": 1}
    aot.register(aot_example_kernels.scale_kernel, name="example_scale_archs",
                 variants=[dict(good, label="everywhere"), dict(good, label="hopper only", archs=(90,))])
    assert aot.expected_compiles(["example_scale_archs"]) == {
        ("example_scale_archs", "everywhere", 80), ("example_scale_archs", "everywhere", 90),
        ("example_scale_archs", "hopper only", 90)}
    assert aot.expected_compiles(["example_scale_archs"], archs=(80,)) == {("example_scale_archs", "everywhere", 80)}


def test_unknown_names_and_bad_archs():
    with pytest.raises(ValueError, match="no kernel registered"):
        aot.check(["no_such_kernel"])
    with pytest.raises(ValueError, match="archs"):
        aot.check(archs=("sm_80",))


def test_ptxas_log_without_an_entry_function_is_an_error():
    with pytest.raises(ValueError, match="one entry function"):
        aot.parse_ptxas_log("ptxas info    : 0 bytes gmem\n")
    registers, stack, stores, loads, smem = aot.parse_ptxas_log(
        "ptxas info    : Function properties for k\n"
        "    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 1 barriers, 2048 bytes smem, 384 bytes cmem[0]\n")
    assert (registers, stack, stores, loads, smem) == (40, 8, 4, 12, 2048)
