"""The bf16 tl.dot shim in conftest.py makes the interpreter's dot right."""
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
