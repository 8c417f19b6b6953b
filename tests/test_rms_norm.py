"""RMSNorm and add+RMSNorm: Triton kernels (interpreter) and the PyTorch reference path.

Every output and gradient is checked against an eager float64 reference at
2x the error eager PyTorch makes in the same dtype (memkernels.testing), and
bytes saved for backward are measured with memkernels.meters.
"""
import functools
import gc
import weakref

import pytest
import torch
from torch import nn

import memkernels
from bf16_rounding_shim import install as install_bf16_rounding_shim
from memkernels.functional import add_rms_norm, rms_norm
from memkernels.meters import SavedBytesMeter
from memkernels.testing import check_against_reference

install_bf16_rounding_shim()

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (hidden, rows): one row and a prime row count; few rows where the interpreter is slow.
SHAPES = [(1, 1), (1, 2), (127, 7), (128, 1), (129, 13), (1000, 7), (4096, 3), (5120, 2),
          pytest.param(65536, 2, marks=pytest.mark.slow)]


@pytest.fixture(params=["triton", "torch"])
def backend(request):
    """Run the Triton kernels (interpreter on CPU) and the PyTorch reference path."""
    memkernels.set_backend(request.param)
    yield request.param
    memkernels.set_backend("auto")


def rms_norm_eager(x, weight, eps=1e-6, *, offset=0.0, casting_mode="llama"):
    """Plain eager RMSNorm with the casting modes' rounding points; float64 in, float64 math."""
    dtype = x.dtype
    compute = torch.promote_types(dtype, torch.float32)
    rstd = torch.rsqrt(x.to(compute).pow(2).mean(-1, keepdim=True) + eps)
    scale = offset + weight.to(compute)
    if casting_mode == "llama":
        return ((x.to(compute) * rstd).to(dtype).to(compute) * scale).to(dtype)
    if casting_mode == "gemma":
        return (x.to(compute) * rstd * scale).to(dtype)
    return (x * rstd.to(dtype)) * scale.to(dtype)  # "none": every step in x's dtype


def add_rms_norm_eager(x, residual, weight, eps=1e-6, **options):
    residual_out = x + residual
    return rms_norm_eager(residual_out, weight, eps, **options), residual_out


def _leaf(*shape, dtype, scale=1.0, shift=0.0):
    return (torch.randn(*shape) * scale + shift).to(dtype).requires_grad_()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden,rows", SHAPES)
def test_rms_norm_matches_float64(backend, dtype, hidden, rows):
    x = _leaf(rows, hidden, dtype=dtype)
    weight = _leaf(hidden, dtype=dtype, scale=0.5, shift=1.0)
    check_against_reference(rms_norm, rms_norm_eager, (x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("casting_mode,offset", [("llama", 0.0), ("gemma", 1.0), ("none", 0.0), ("none", 1.0)])
def test_casting_modes_and_offset(backend, dtype, casting_mode, offset):
    x = _leaf(2, 5, 129, dtype=dtype)
    weight = _leaf(129, dtype=dtype, scale=0.3)
    options = {"casting_mode": casting_mode, "offset": offset}
    check_against_reference(functools.partial(rms_norm, **options), functools.partial(rms_norm_eager, **options),
                            (x, weight), name=f"rms_norm[{casting_mode}, offset={offset}]")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fp32_weight_with_low_precision_input(backend, dtype):
    x = _leaf(7, 300, dtype=dtype)
    weight = _leaf(300, dtype=torch.float32, scale=0.5, shift=1.0)
    report = check_against_reference(rms_norm, rms_norm_eager, (x, weight))
    assert report.rows[-1].dtype == torch.float32  # the weight gradient keeps the weight's dtype


@pytest.mark.parametrize("hidden", [129, 5120])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_matches_float64(backend, dtype, hidden):
    """Gradients reach x, residual and weight, including the gradient flowing into residual_out."""
    x, residual = _leaf(5, hidden, dtype=dtype), _leaf(5, hidden, dtype=dtype)
    weight = _leaf(hidden, dtype=dtype, scale=0.5, shift=1.0)
    check_against_reference(add_rms_norm, add_rms_norm_eager, (x, residual, weight))


def test_leading_dims_non_contiguous_and_no_weight(backend):
    x = torch.randn(6, 4, 130, dtype=torch.bfloat16).transpose(0, 1).requires_grad_()
    assert not x.is_contiguous()
    check_against_reference(lambda x: rms_norm(x), lambda x: rms_norm_eager(x, torch.ones((), dtype=x.dtype)),
                            (x,), name="rms_norm(no weight)")


def test_tuple_normalized_shape(backend):
    x = _leaf(3, 4, 5, 6, dtype=torch.float32)
    weight = _leaf(5, 6, dtype=torch.float32, shift=1.0)
    check_against_reference(rms_norm, lambda x, w: rms_norm_eager(x.flatten(-2), w.flatten()).view(x.shape),
                            (x, weight), name="rms_norm(weight [5, 6])")


def _spiked_weight(hidden, dtype):
    """Weights with exact zeros and values tiny for the dtype: where y / w cannot give x̂ back."""
    weight = torch.rand(hidden) + 0.5
    weight[3] = 0.0
    weight[10] = -0.0
    weight[20] = 1e-37 if dtype != torch.float16 else 1e-3  # below the recovery threshold
    weight[30] = 1e-30 if dtype != torch.float16 else 0.1  # small but recoverable
    return weight.to(dtype).requires_grad_()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [129, 4500])
def test_memory_efficient_zero_and_tiny_weights(backend, dtype, hidden):
    """memory_efficient keeps y; columns whose x̂ y cannot give back are stored: no NaN, exact gradients."""
    x = _leaf(7, hidden, dtype=dtype)
    weight = _spiked_weight(hidden, dtype)
    report = check_against_reference(functools.partial(rms_norm, memory_efficient=True), rms_norm_eager,
                                      (x, weight), name="rms_norm(memory_efficient)")
    assert len(report.rows) == 3
    with SavedBytesMeter() as saved:
        rms_norm(x, weight, memory_efficient=True)
    fallback = [r["shape"] for r in saved.records if r["new"] and r["dtype"] == dtype and len(r["shape"]) == 2
                and r["shape"] != (7, hidden)]
    assert fallback == [(7, 3)]  # only columns 3, 10 and 20 keep x̂


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_add_rms_norm_memory_efficient(backend, dtype):
    x, residual = _leaf(5, 129, dtype=dtype), _leaf(5, 129, dtype=dtype)
    weight = _spiked_weight(129, dtype)
    check_against_reference(functools.partial(add_rms_norm, memory_efficient=True), add_rms_norm_eager,
                            (x, residual, weight), name="add_rms_norm(memory_efficient)")


# --- bytes saved for backward, measured -------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_saved_bytes_rms_norm_is_4_per_token(backend, dtype):
    rows, hidden = 37, 256
    x = _leaf(rows, hidden, dtype=dtype)
    weight = _leaf(hidden, dtype=dtype)
    with SavedBytesMeter() as saved:
        rms_norm(x, weight)
    assert saved.new_bytes == 4 * rows  # the fp32 rstd and nothing else
    assert saved.aliased_bytes == x.untyped_storage().nbytes() + weight.untyped_storage().nbytes()
    # eager nn.RMSNorm, for contrast, saves more than the input and rstd
    eager = nn.RMSNorm(hidden, dtype=dtype)
    with SavedBytesMeter() as eager_saved:
        eager(x)
    assert eager_saved.new_bytes > saved.new_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_saved_bytes_add_rms_norm_is_residual_out_and_rstd(backend, dtype):
    rows, hidden = 11, 300
    x, residual, weight = _leaf(rows, hidden, dtype=dtype), _leaf(rows, hidden, dtype=dtype), _leaf(hidden, dtype=dtype)
    with SavedBytesMeter() as saved:
        _, residual_out = add_rms_norm(x, residual, weight)
    new = sorted((r["shape"], r["dtype"]) for r in saved.records if r["new"])
    assert new == sorted([((rows, hidden), dtype), ((rows,), torch.float32)])
    assert saved.new_bytes == residual_out.untyped_storage().nbytes() + 4 * rows
    assert saved.aliased_bytes == weight.untyped_storage().nbytes()  # neither x nor residual


def test_memory_efficient_does_not_keep_the_input(backend):
    rows, hidden = 9, 200
    source = _leaf(rows, hidden, dtype=torch.bfloat16)
    weight = _leaf(hidden, dtype=torch.bfloat16, shift=1.0)
    with SavedBytesMeter() as saved:
        x = source * 2  # an activation made inside the region (a scalar multiply saves nothing)
        y = rms_norm(x, weight, memory_efficient=True)
    # Had x been kept it would count as new bytes too (it was created inside the region).
    assert saved.new_bytes == y.untyped_storage().nbytes() + 4 * rows
    assert saved.aliased_bytes == weight.untyped_storage().nbytes()
    released = []
    watch = weakref.ref(x.untyped_storage(), released.append)  # noqa: F841 (the callback needs it alive)
    del x
    gc.collect()  # the Triton interpreter leaves reference cycles around launch arguments
    assert released, "x's memory must be free to release once the caller drops it"
    y.float().sum().backward()
    assert torch.isfinite(source.grad).all()


def test_interpreter_rounds_bf16_to_nearest():
    """The shim: fp32 -> bf16 in a kernel rounds to nearest even, as torch and the GPU do."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

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
