"""Every kernel variant that memkernels.fusions registers compiles for sm_80 and sm_90 without spills.

The check compiles each registered variant with triton and the bundled ptxas in a subprocess
(minutes, hence slow). Run with -s to see the table of registers per variant.
"""
import collections
import importlib

import pytest

from memkernels import aot

pytestmark = pytest.mark.slow


def _ops_kernel_names():
    """Import every memkernels.fusions module; the kernels they register (not tests' examples)."""
    for module in aot.ops_modules():
        importlib.import_module(module)
    return sorted(name for name, (module, _, _) in aot.registered().items() if module.startswith("memkernels.fusions."))


def _summary(reports):
    """Max registers per kernel, arch and label without its tile shape: the first two words and
    the last."""
    most = collections.defaultdict(int)
    for r in reports:
        words = r.variant.split()
        key = (r.kernel, f"sm_{r.arch}", " ".join(dict.fromkeys(words[:2] + words[-1:])))
        most[key] = max(most[key], r.registers)
    return "\n".join(f"{kernel:<16}{arch:<7}{group:<30}max {regs} registers"
                     for (kernel, arch, group), regs in sorted(most.items()))


@pytest.fixture(scope="module")
def reports(aot_ops_reports):
    """Every ops kernel compiled once per test run (tests/conftest.py's aot_ops_reports, without a time limit:
    a 900 s limit errored every test here under load, issue 32; test_testing.py keeps one from coming back)."""
    print("\n" + aot.format_table(aot_ops_reports) + "\n\n" + _summary(aot_ops_reports))
    return aot_ops_reports


def test_every_registered_variant_was_compiled_for_its_archs(reports):
    expected = aot.expected_compiles(_ops_kernel_names(), archs=(80, 90))
    assert {(r.kernel, r.variant, r.arch) for r in reports} == expected


def test_no_compile_errors_and_no_spills(reports):
    failed = [r for r in reports if not r.ok]
    assert not failed, "compile errors or spills:\n" + aot.format_table(failed)


@pytest.mark.parametrize("kernel", ["act_linear_product", "act_linear_product_backward", "rope", "dyt_forward",
                                    "dyt_backward"])
def test_act_linear_passes_vectorize_their_loads(reports, kernel):
    # The activation-linear passes are bandwidth-bound: with contiguous rows (16-byte aligned pointers,
    # 16-divisible row strides, as the JIT sees them) each thread's 8 consecutive elements must load as
    # vectors (ld.global.v4/v2), else the hints did not reach ptxas.
    passes = [r for r in reports if r.kernel == kernel]
    assert passes
    scalar = [r for r in passes if r.vector_loads <= 0]
    assert not scalar, "variants without vector loads:\n" + aot.format_table(scalar)
