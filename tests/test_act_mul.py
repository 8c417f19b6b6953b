"""memkernels.functional.silu_mul / gelu_mul against eager PyTorch in float64 on both backends (the Triton
passes through the interpreter without a GPU), and their memory contract: only a and b are saved."""
import types

import pytest
import torch
import torch.nn.functional as F

from memkernels.functional import gelu_mul, silu_mul
from memkernels.fusions.common import act_linear as _act_linear
from memkernels.meters import SavedBytesMeter
from memkernels.testing import check_against_reference

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# [..., I]: a model's [batch, seq, I]; one row; I = 1; a width past one 1,024-column block with a
# ragged tail (the kernel's masked columns)
SHAPES = [(2, 3, 24), (1, 7), (5, 1), (3, 1029)]
OPS = {
    "silu": (lambda a, b: silu_mul(a, b), lambda a, b: F.silu(a) * b),
    "gelu": (lambda a, b: gelu_mul(a, b), lambda a, b: F.gelu(a) * b),
    "gelu_tanh": (lambda a, b: gelu_mul(a, b, approximate="tanh"), lambda a, b: F.gelu(a, approximate="tanh") * b),
}


def inputs(shape, dtype):
    return [(torch.randn(*shape) * 3).to(dtype).requires_grad_(), torch.randn(*shape).to(dtype).requires_grad_()]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("activation", OPS)
def test_matches_eager_in_float64(backend, activation, shape, dtype):
    fused, eager = OPS[activation]
    check_against_reference(fused, eager, inputs(shape, dtype), name=f"{activation}_mul {backend}")


def test_halves_of_a_packed_projection_and_transposed_inputs(backend):
    """a and b as views: the two halves of one gate_up output (rows strided), and a transposed pair."""
    fused, eager = OPS["silu"]
    gate_up = torch.randn(2, 3, 16, requires_grad=True)
    check_against_reference(lambda t: fused(t[..., :8], t[..., 8:]), lambda t: eager(t[..., :8], t[..., 8:]),
                            [gate_up], name="packed halves")
    a, b = (torch.randn(6, 5).t().requires_grad_() for _ in range(2))
    check_against_reference(fused, eager, [a, b], name="transposed")


@pytest.mark.parametrize("activation", OPS)
def test_only_a_and_b_are_saved(activation):
    """Eager saves act(a) besides a and b (mul keeps both operands); here nothing new."""
    fused, eager = OPS[activation]
    a, b = inputs((4, 64), torch.float32)
    with SavedBytesMeter() as fused_meter:
        fused(a, b)
    with SavedBytesMeter() as eager_meter:
        eager(a, b)
    assert fused_meter.new_bytes == 0
    assert fused_meter.aliased_bytes == a.untyped_storage().nbytes() + b.untyped_storage().nbytes()
    assert eager_meter.new_bytes == a.numel() * a.element_size()  # act(a)


def test_one_pass_each_way(backend, monkeypatch):
    """Forward is one elementwise pass and backward one (the act-linear family's passes)."""
    passes = []
    original = _act_linear.PASSES[backend]

    def record(name):
        def call(*args, **kwargs):
            passes.append(name)
            return getattr(original, name)(*args, **kwargs)
        return call

    monkeypatch.setitem(_act_linear.PASSES, backend, types.SimpleNamespace(product=record("product"),
                                                                          product_backward=record("product_backward")))
    a, b = inputs((3, 8), torch.float32)
    silu_mul(a, b).sum().backward()
    assert passes == ["product", "product_backward"]


def test_one_input_without_grad(backend):
    a, b = inputs((3, 8), torch.float32)
    b.requires_grad_(False)
    silu_mul(a, b).sum().backward()
    a_ref = a.detach().requires_grad_()
    (F.silu(a_ref) * b).sum().backward()
    torch.testing.assert_close(a.grad, a_ref.grad)


def test_no_rows_and_a_scalar(backend):
    a, b = inputs((0, 8), torch.float32)
    out = silu_mul(a, b)
    out.sum().backward()
    assert out.shape == (0, 8) and a.grad.shape == (0, 8)
    a, b = torch.tensor(1.5, requires_grad=True), torch.tensor(-2.0)
    out = silu_mul(a, b)
    out.backward()
    assert out.shape == () and torch.allclose(out, F.silu(torch.tensor(1.5)) * -2.0)


def test_float64_on_the_torch_path():
    a, b = inputs((3, 8), torch.float64)
    torch.testing.assert_close(gelu_mul(a, b, backend="torch"), F.gelu(a) * b, rtol=0, atol=1e-14)


def test_compiles_whole_as_custom_ops():
    a, b = inputs((3, 8), torch.float32)
    compiled = torch.compile(lambda a, b: silu_mul(a, b, backend="torch"), backend="aot_eager", fullgraph=True)
    compiled(a, b).sum().backward()
    a2, b2 = a.detach().requires_grad_(), b.detach().requires_grad_()
    (F.silu(a2) * b2).sum().backward()
    torch.testing.assert_close(a.grad, a2.grad)
    torch.testing.assert_close(b.grad, b2.grad)


def test_under_autocast_the_inputs_are_taken_as_they_are(backend):
    """Elementwise, as F.silu and mul: autocast casts nothing."""
    a, b = inputs((3, 8), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = silu_mul(a, b)
    assert out.dtype == torch.float32


@pytest.mark.parametrize("call,error,message", [
    (lambda a, b: silu_mul(a, b[:, :4]), ValueError, "they must match"),
    (lambda a, b: silu_mul(a, b.double()), ValueError, "they must match"),
    (lambda a, b: silu_mul(a.long(), b.long()), TypeError, "a has dtype torch.int64; pass a floating tensor"),
    (lambda a, b: silu_mul(a, b.tolist()), TypeError, "b must be a torch.Tensor"),
    (lambda a, b: gelu_mul(a, b, approximate="erf"), ValueError, "approximate='erf' is not supported"),
    (lambda a, b: silu_mul(a, b, backend="cuda"), ValueError, "backend='cuda' is not supported"),
    (lambda a, b: silu_mul(a.double(), b.double(), backend="triton"), TypeError,
     "a is torch.float64; the Triton backend takes float32, float16 or bfloat16"),
])
def test_bad_input_is_a_clear_error(call, error, message):
    a, b = inputs((3, 8), torch.float32)
    with pytest.raises(error) as raised:
        call(a, b)
    assert message in str(raised.value)
