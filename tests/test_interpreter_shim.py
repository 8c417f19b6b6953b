"""conftest.py's interpreter shims: bf16 tl.dot and fp32 -> bf16 casts are right."""
import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    # a_ptr: [N, N], b_ptr: [N, N], c_ptr: [N, N] float32
    offs = tl.arange(0, N)
    a = tl.load(a_ptr + offs[:, None] * N + offs[None, :])
    b = tl.load(b_ptr + offs[:, None] * N + offs[None, :])
    tl.store(c_ptr + offs[:, None] * N + offs[None, :], tl.dot(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dot_matches_float64(dtype):
    n = 16
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    c = torch.empty(n, n, dtype=torch.float32)
    _dot_kernel[(1,)](a, b, c, N=n)
    expected = a.double() @ b.double()
    # operands are exact in every dtype; only fp32 accumulation (or tf32-like rounding) differs
    torch.testing.assert_close(c.double(), expected, rtol=1e-2, atol=1e-2)


def test_interpreter_rounds_bf16_to_nearest():
    """The rounding shim: fp32 -> bf16 in a kernel rounds to nearest even, as torch and the GPU do."""
    @triton.jit
    def cast_kernel(X, Y, N: tl.constexpr):  # X: [N] fp32, Y: [N] bf16
        offs = tl.arange(0, N)
        tl.store(Y + offs, tl.load(X + offs).to(tl.bfloat16))

    x = torch.tensor([1.2109375 * 0.99999994, 1.9999999, -0.99999994, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8,
                      float("inf"), float("nan"), 3.0e38, 1.0e-40, -0.0, 2.0 ** -130, -1.5, 0.1, 1 / 3,
                      -(1.0 + 2.0 ** -8), 1.0 + 2.0 ** -9])
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    cast_kernel[(1,)](x, y, N=x.numel())
    expected = x.to(torch.bfloat16)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16)) or (
        torch.isnan(y[6]) and torch.equal(y[:6], expected[:6]) and torch.equal(y[7:], expected[7:]))


@pytest.mark.parametrize("version", ["3.7.1", "3.10.0", "2.3.1"])
def test_the_suite_refuses_a_triton_its_interpreter_shims_were_not_written_for(version):
    """torch 2.13.0's CUDA wheels pin triton 3.7.1; the shims patch 3.9's interpreter."""
    from conftest import interpreter_triton_problem

    problem = interpreter_triton_problem(version)
    assert f"triton {version}" in problem and "written for triton 3.9.x" in problem
    assert "pip install triton==3.9.0" in problem


def test_the_installed_triton_is_one_the_shims_were_written_for():
    from conftest import interpreter_triton_problem

    assert interpreter_triton_problem("3.9.0") is None
    assert interpreter_triton_problem(triton.__version__) is None
