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
from memkernels.functional import add_rms_norm, rms_norm
from memkernels.meters import PeakBytesMeter, SavedBytesMeter
from memkernels.testing import check_against_reference
from norm_cases import (CASES, DTYPES, assert_drop_in, eager_add_then, leaf,  # noqa: F401
                        peak_with_next_layer, small_row_blocks)  # (small_row_blocks: a fixture)


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


@pytest.mark.parametrize("dtype, hidden, rows", CASES)
def test_rms_norm_matches_float64(backend, dtype, hidden, rows):
    x = leaf(rows, hidden, dtype=dtype)
    weight = leaf(hidden, dtype=dtype, scale=0.5, shift=1.0)
    check_against_reference(rms_norm, rms_norm_eager, (x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("casting_mode,offset", [("llama", 0.0), ("gemma", 1.0), ("none", 0.0), ("none", 1.0)])
def test_casting_modes_and_offset(backend, dtype, casting_mode, offset):
    x = leaf(2, 5, 129, dtype=dtype)
    weight = leaf(129, dtype=dtype, scale=0.3)
    options = {"casting_mode": casting_mode, "offset": offset}
    check_against_reference(functools.partial(rms_norm, **options), functools.partial(rms_norm_eager, **options),
                            (x, weight), name=f"rms_norm[{casting_mode}, offset={offset}]")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fp32_weight_with_low_precision_input(backend, dtype):
    x = leaf(7, 300, dtype=dtype)
    weight = leaf(300, dtype=torch.float32, scale=0.5, shift=1.0)
    report = check_against_reference(rms_norm, rms_norm_eager, (x, weight))
    assert report.rows[-1].dtype == torch.float32  # the weight gradient keeps the weight's dtype


@pytest.mark.parametrize("hidden", [129, 9000])  # 9000: chunked rows (> 8192)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_matches_float64(backend, dtype, hidden):
    """Gradients reach x, residual and weight, including the gradient flowing into residual_out."""
    x, residual = leaf(5, hidden, dtype=dtype), leaf(5, hidden, dtype=dtype)
    weight = leaf(hidden, dtype=dtype, scale=0.5, shift=1.0)
    check_against_reference(add_rms_norm, add_rms_norm_eager, (x, residual, weight))


@pytest.mark.parametrize("views", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_add_rms_norm_gradients_do_not_alias(backend, in_place, views):
    """x.grad and residual.grad are equal but separate: changing one must not change the other
    (also when the norm sees views of the leaves, where each leaf gets its own view of one dx)."""
    x, residual, weight = leaf(3, 8, dtype=torch.float32), leaf(3, 8, dtype=torch.float32), leaf(8, dtype=torch.float32)
    x_in, residual_in = (x.view(3, 2, 4).view(3, 8), residual.view(24).view(3, 8)) if views else (x, residual)
    y, residual_out = add_rms_norm(x_in, residual_in, weight, in_place=in_place)
    (y.pow(2).sum() + residual_out.sin().sum()).backward()
    assert torch.equal(x.grad, residual.grad)
    expected = residual.grad.clone()
    x.grad.zero_()
    assert torch.equal(residual.grad, expected)


def test_add_norm_shares_dx_between_layer_outputs(backend):
    """x and residual made by other layers get one dx between them (no copy), as eager's add does;
    leaves get separate .grads (test_add_rms_norm_gradients_do_not_alias)."""
    source, weight = leaf(64, 32, dtype=torch.float32), leaf(32, dtype=torch.float32)
    x, residual = source * 2, source * 3  # activations: their gradients go to MulBackward, not a leaf
    received = []
    x.register_hook(received.append)
    residual.register_hook(received.append)
    y, residual_out = add_rms_norm(x, residual, weight)
    torch.autograd.backward([y, residual_out], [torch.randn_like(y), torch.randn_like(y)])
    x_grad, residual_grad = received
    assert x_grad.untyped_storage().data_ptr() == residual_grad.untyped_storage().data_ptr()
    expected_source_grad = 5 * x_grad
    torch.testing.assert_close(source.grad, expected_source_grad)


@pytest.mark.parametrize("used", ["residual_out", "y"])
def test_add_norm_with_one_output_unused(backend, used):
    """Outputs without a gradient reach the backward as None (no zero fill): only residual_out used
    gives dx = its gradient and a zero weight gradient; only y used matches the fused add's eager form."""
    x, residual, weight = leaf(5, 33, dtype=torch.float32), leaf(5, 33, dtype=torch.float32), leaf(33, dtype=torch.float32)
    y, residual_out = add_rms_norm(x, residual, weight)
    (residual_out if used == "residual_out" else y).sum().backward()
    if used == "residual_out":
        assert torch.equal(x.grad, torch.ones_like(x)) and torch.equal(weight.grad, torch.zeros_like(weight))
        return
    xe, weight_e = x.detach().requires_grad_(), weight.detach().requires_grad_()
    s = xe + residual.detach()
    (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * weight_e).sum().backward()
    torch.testing.assert_close(x.grad, xe.grad)
    torch.testing.assert_close(weight.grad, weight_e.grad)


def test_leading_dims_non_contiguous_and_no_weight(backend):
    x = torch.randn(6, 4, 130, dtype=torch.bfloat16).transpose(0, 1).requires_grad_()
    assert not x.is_contiguous()
    check_against_reference(lambda x: rms_norm(x), lambda x: rms_norm_eager(x, torch.ones((), dtype=x.dtype)),
                            (x,), name="rms_norm(no weight)")


def test_tuple_normalized_shape(backend):
    x = leaf(3, 4, 5, 6, dtype=torch.float32)
    weight = leaf(5, 6, dtype=torch.float32, shift=1.0)
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
@pytest.mark.parametrize("hidden", [129, 9000])
def test_memory_efficient_zero_and_tiny_weights(backend, dtype, hidden):
    """memory_efficient keeps y; columns whose x̂ y cannot give back are stored: no NaN, exact gradients."""
    x = leaf(7, hidden, dtype=dtype)
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
    x, residual = leaf(5, 129, dtype=dtype), leaf(5, 129, dtype=dtype)
    weight = _spiked_weight(129, dtype)
    check_against_reference(functools.partial(add_rms_norm, memory_efficient=True), add_rms_norm_eager,
                            (x, residual, weight), name="add_rms_norm(memory_efficient)")


# --- bytes saved for backward, measured -------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_saved_bytes_rms_norm_is_4_per_token(backend, dtype):
    rows, hidden = 37, 256
    x = leaf(rows, hidden, dtype=dtype)
    weight = leaf(hidden, dtype=dtype)
    with SavedBytesMeter() as saved:
        rms_norm(x, weight)
    assert saved.new_bytes == 4 * rows  # the fp32 rstd and nothing else
    assert saved.aliased_bytes == x.untyped_storage().nbytes() + weight.untyped_storage().nbytes()
    # Hugging Face's composed RMSNorm (Llama's), for contrast, saves more than the input and rstd. (nn.RMSNorm
    # on CUDA is a fused kernel that saves rstd only, like this op: torch 2.11 on an H200.)
    with SavedBytesMeter() as eager_saved:
        rms_norm_eager(x, weight)
    assert eager_saved.new_bytes > saved.new_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_saved_bytes_add_rms_norm_is_residual_out_and_rstd(backend, dtype):
    rows, hidden = 11, 300
    x, residual, weight = leaf(rows, hidden, dtype=dtype), leaf(rows, hidden, dtype=dtype), leaf(hidden, dtype=dtype)
    with SavedBytesMeter() as saved:
        _, residual_out = add_rms_norm(x, residual, weight)
    new = sorted((r["shape"], r["dtype"]) for r in saved.records if r["new"])
    assert new == sorted([((rows, hidden), dtype), ((rows,), torch.float32)])
    assert saved.new_bytes == residual_out.untyped_storage().nbytes() + 4 * rows
    assert saved.aliased_bytes == weight.untyped_storage().nbytes()  # neither x nor residual


def test_memory_efficient_does_not_keep_the_input(backend):
    rows, hidden = 9, 200
    source = leaf(rows, hidden, dtype=torch.bfloat16)
    weight = leaf(hidden, dtype=torch.bfloat16, shift=1.0)
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


# --- determinism, bad input, zero-size ---------------------------------------------------------

@pytest.mark.parametrize("hidden", [300, 9000])  # register-resident rows and looping rows
def test_weight_gradient_is_bitwise_deterministic(backend, hidden):
    x = leaf(41, hidden, dtype=torch.bfloat16)  # more rows than backward programs
    weight = leaf(hidden, dtype=torch.float32, shift=1.0)
    grad = torch.randn(41, hidden, dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        weight.grad = None
        rms_norm(x, weight).backward(grad)
        runs.append(weight.grad.clone())
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("call,error,words", [
    (lambda x, w: rms_norm(x, w[:-1]), ValueError, ["weight", "shape"]),
    (lambda x, w: rms_norm(x, w.to("meta")), ValueError, ["weight", "meta"]),
    (lambda x, w: rms_norm(x.to(torch.int32), None), TypeError, ["x", "int32"]),
    (lambda x, w: rms_norm(x, w.to(torch.int64)), TypeError, ["weight", "int64"]),
    (lambda x, w: rms_norm(x, w.half()), TypeError, ["weight", "float16"]),  # x is fp32
    (lambda x, w: rms_norm(x, w, casting_mode="fp8"), ValueError, ["casting_mode", "llama"]),
    (lambda x, w: rms_norm(x, w, eps=-1.0), ValueError, ["eps"]),
    (lambda x, w: rms_norm(x[:, :0], None), ValueError, ["normalized shape"]),
    (lambda x, w: add_rms_norm(x, x[:1], w), ValueError, ["residual"]),
    (lambda x, w: add_rms_norm(x, x.half(), w), ValueError, ["residual"]),
    (lambda x, w: rms_norm(x.cpu().numpy(), w), TypeError, ["x", "Tensor"]),
], ids=["weight-shape", "weight-device", "int-x", "int-weight", "weight-dtype", "casting-mode", "eps",
        "empty-row", "residual-shape", "residual-dtype", "not-a-tensor"])
def test_bad_input_names_the_argument(backend, call, error, words):
    x = torch.randn(3, 8)
    weight = torch.ones(8)
    with pytest.raises(error) as raised:
        call(x, weight)
    for word in words:
        assert word in str(raised.value)


@pytest.mark.parametrize("normalized_shape", [-1, 0, (8, -2), "8", 8.0, True])
def test_module_refuses_a_normalized_shape_that_is_not_positive_ints(normalized_shape):
    """FusedRMSNorm(-1) raised torch's "negative dimension" from inside nn.Parameter, and ("8") a TypeError of
    torch.empty; 0 built a module that failed only at its first forward."""
    from memkernels.nn import FusedLayerNorm, FusedRMSNorm

    for module in (FusedRMSNorm, FusedLayerNorm):
        with pytest.raises(ValueError, match=f"{module.__name__}: normalized_shape=.* must be a positive int"):
            module(normalized_shape)


def test_zero_rows_give_empty_results(backend):
    """Documented: an input with no rows returns an empty y (and empty gradients)."""
    x = torch.randn(0, 3, 64, requires_grad=True)
    residual = torch.randn(0, 3, 64, requires_grad=True)
    weight = torch.ones(64, requires_grad=True)
    y, residual_out = add_rms_norm(x, residual, weight)
    assert y.shape == residual_out.shape == x.shape
    (y.sum() + residual_out.sum()).backward()
    assert x.grad.shape == x.shape and torch.equal(weight.grad, torch.zeros(64))


# --- modules -----------------------------------------------------------------------------------

def test_module_matches_nn_rms_norm_and_loads_its_state_dict(backend):
    eager = nn.RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        eager.weight.uniform_(0.5, 1.5)
    assert_drop_in(memkernels.FusedRMSNorm, eager, torch.randn(4, 5, 96), ["weight"])


def test_module_takes_layer_norm_arguments():
    """Replacing nn.LayerNorm is one word; the math is RMSNorm (its bias is kept if it has one)."""
    layer_norm = nn.LayerNorm((4, 6), eps=1e-5, elementwise_affine=True, bias=True, dtype=torch.float64)
    fused = memkernels.FusedRMSNorm((4, 6), eps=1e-5, elementwise_affine=True, bias=True, device="cpu",
                                    dtype=torch.float32)
    assert list(fused.state_dict()) == list(layer_norm.state_dict()) == ["weight", "bias"]
    assert memkernels.FusedRMSNorm(8, bias=False).bias is None
    plain = memkernels.FusedRMSNorm(8, elementwise_affine=False)
    assert plain.weight is None and list(plain.state_dict()) == []
    converted = memkernels.FusedRMSNorm.from_module(layer_norm.float())
    with torch.no_grad():
        converted.bias.normal_()
    x = torch.randn(3, 4, 6)
    expected = rms_norm_eager(x.flatten(-2), converted.weight.flatten(), 1e-5, casting_mode="gemma").view(x.shape)
    torch.testing.assert_close(converted(x), expected + converted.bias)


def test_module_eps_none_follows_dtype_like_nn_rms_norm(backend):
    x = torch.randn(3, 16, dtype=torch.bfloat16) * 1e-3
    torch.testing.assert_close(memkernels.FusedRMSNorm(16, dtype=torch.bfloat16)(x),
                               nn.RMSNorm(16, dtype=torch.bfloat16)(x))


def test_add_module_and_gemma_offset(backend):
    module = memkernels.FusedAddRMSNorm(32, eps=1e-6, offset=1.0, casting_mode="gemma")
    assert torch.equal(module.weight, torch.zeros(32))  # offset + weight starts at 1
    x, residual = torch.randn(5, 32), torch.randn(5, 32)
    y, residual_out = module(x, residual)
    torch.testing.assert_close(residual_out, x + residual)
    torch.testing.assert_close(y, rms_norm_eager(x + residual, module.weight, 1e-6, offset=1.0,
                                                 casting_mode="gemma"))


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("casting_mode", ["llama", "gemma", "none"])
def test_an_offset_without_a_weight_scales_by_the_offset(backend, casting_mode, memory_efficient):
    """weight=None with offset c is the norm with a zero weight (scale c + 0), in the function and in
    FusedRMSNorm(elementwise_affine=False, offset=c), which used to drop the offset without a word."""
    options = {"casting_mode": casting_mode, "memory_efficient": memory_efficient}
    module = memkernels.FusedRMSNorm(24, eps=1e-6, elementwise_affine=False, offset=0.5, dtype=torch.bfloat16,
                                     **options)
    grad = torch.randn(5, 24, dtype=torch.bfloat16)
    runs = []
    for call in (lambda x: rms_norm(x, None, offset=0.5, **options), module,
                 lambda x: rms_norm(x, torch.zeros(24), offset=0.5, **options)):
        x = torch.randn(5, 24, generator=torch.Generator().manual_seed(0)).bfloat16().requires_grad_()
        y = call(x)
        y.backward(grad)
        runs.append((y, x.grad))
    for y, dx in runs[1:]:
        assert torch.equal(y, runs[0][0]) and torch.equal(dx, runs[0][1])
    x = runs[0][1].new_tensor(torch.randn(5, 24, generator=torch.Generator().manual_seed(0)).bfloat16())
    expected = rms_norm_eager(x, torch.zeros(24), offset=0.5, casting_mode=casting_mode)  # its rounding points
    torch.testing.assert_close(runs[0][0], expected, atol=0, rtol=2 ** -7)  # one bf16 ulp
    # Without an offset there is no scale at all, as before.
    x = torch.randn(5, 24)
    torch.testing.assert_close(rms_norm(x, None), rms_norm_eager(x, torch.zeros(24), offset=1.0))


def test_from_module_rejects_non_norms():
    with pytest.raises(TypeError, match="not a norm module"):
        memkernels.FusedRMSNorm.from_module(nn.ReLU())


# --- torch.compile ----------------------------------------------------------------------------

@pytest.mark.parametrize("memory_efficient", [False, True])
def test_torch_compile_fullgraph_has_no_graph_break(memory_efficient):
    """The custom ops keep a compiled model whole: fullgraph=True raises on any graph break."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(16, 32), memkernels.FusedRMSNorm(32, eps=1e-6, memory_efficient=memory_efficient),
                          nn.Linear(32, 32))
    norm = memkernels.FusedAddRMSNorm(32, eps=1e-6, memory_efficient=memory_efficient)

    def step(x):
        hidden = model(x)
        y, residual = norm(hidden, x.repeat(1, 2))
        return (y * residual).sum()

    compiled = torch.compile(step, fullgraph=True)
    x = torch.randn(6, 16, requires_grad=True)
    loss = compiled(x)
    loss.backward()
    compiled_grad = x.grad.clone()
    x.grad = None
    step(x).backward()
    torch.testing.assert_close(loss, step(x))
    torch.testing.assert_close(compiled_grad, x.grad)


# --- opt-in in_place backward -----------------------------------------------------------------

def _gradients(build, leaves, in_place):
    for leaf in leaves:
        leaf.grad = None
    build(in_place).backward()
    return [None if leaf.grad is None else leaf.grad.clone() for leaf in leaves]


@pytest.mark.parametrize("graph", ["private", "shared-by-two-norms", "shared-with-a-leaf", "caller-keeps-grad",
                                   "output-used-twice", "expanded-grad", "add-variant"])
def test_in_place_backward_matches_and_never_corrupts_a_shared_gradient(backend, graph):
    """Liger wrote dx into a dy that another branch still needed; each graph here shares it differently."""
    x = leaf(6, 40, dtype=torch.float32)
    residual = leaf(6, 40, dtype=torch.float32)
    weight = leaf(40, dtype=torch.float32, shift=1.0)
    kept_grad = torch.randn(6, 40)

    def build(in_place):
        norm = functools.partial(rms_norm, weight=weight, in_place=in_place)
        if graph == "private":
            return norm(x * 1).pow(2).sum()
        if graph == "shared-by-two-norms":  # the add hands one gradient tensor to both norms
            return (norm(x * 1) + norm(x * 2)).pow(2).sum()
        if graph == "shared-with-a-leaf":  # the same gradient also becomes residual.grad
            return (norm(x * 1) + residual).pow(2).sum()
        if graph == "caller-keeps-grad":
            return (norm(x * 1) * kept_grad).sum()
        if graph == "output-used-twice":
            y = norm(x * 1)
            return (y + y.sin()).pow(2).sum()
        if graph == "expanded-grad":
            return norm(x * 1).sum()
        y, residual_out = add_rms_norm(x * 1, residual, weight, in_place=in_place)
        return (y.pow(2) + residual_out.sin()).sum()

    expected = _gradients(build, [x, residual, weight], in_place=False)
    kept_before = kept_grad.clone()
    actual = _gradients(build, [x, residual, weight], in_place=True)
    for got, want in zip(actual, expected):
        assert (got is None and want is None) or torch.equal(got, want)
    assert torch.equal(kept_grad, kept_before)


def test_in_place_backward_saves_one_buffer(backend):
    rows, hidden = 64, 256
    x, weight = leaf(rows, hidden, dtype=torch.bfloat16), leaf(hidden, dtype=torch.bfloat16)
    probe = torch.randn(rows, hidden, dtype=torch.bfloat16)
    peaks, grads = {}, {}
    for in_place in (False, True):
        # dy = probe * d(sum) is a fresh private tensor; x.grad takes dx without a copy.
        loss = (rms_norm(x, weight, in_place=in_place) * probe).sum()
        x.grad = None
        with PeakBytesMeter() as peak:
            loss.backward()
        peaks[in_place], grads[in_place] = peak.peak_bytes, x.grad
    assert peaks[False] - peaks[True] == rows * hidden * 2  # dx went into dy's buffer
    assert torch.equal(grads[False], grads[True])


# --- ahead-of-time compile check --------------------------------------------------------------

@pytest.mark.slow
def test_kernels_compile_for_sm80_and_sm90_without_spills(aot_ops_reports):
    """Every registered variant (both norms, fp32/fp16/bf16, widest register-resident and looping rows,
    the backward's at widths a multiple of 16 as the JIT specializes them and at other widths, and the
    dw/db reduction); the reports are compiled once per run for every test that reads them
    (tests/conftest.py)."""
    from memkernels.fusions.norm import kernels as _norm_kernels

    reports = [r for r in aot_ops_reports if r.kernel in ("norm_fwd", "norm_bwd", "norm_reduce_partials")]
    variants = (_norm_kernels._FORWARD_VARIANTS, _norm_kernels._BACKWARD_VARIANTS, _norm_kernels._REDUCE_VARIANTS)
    assert len(reports) == 2 * sum(map(len, variants))
    failed = [(r.kernel, r.variant, r.arch, r.spills, r.error) for r in reports if not r.ok]
    assert not failed, failed
    # No contracted multiply-add in the backward (the H200's LayerNorm dx at H = 1 came from one) nor in
    # the reduction.
    contracted = [(r.kernel, r.variant, r.arch, r.fused_multiply_adds) for r in reports
                  if r.kernel in ("norm_bwd", "norm_reduce_partials") and r.fused_multiply_adds != 0]
    assert not contracted, contracted
    # The programs_per_sm blocks of a backward variant fit on one SM together (65536 registers).
    warps = {v["label"]: v["num_warps"] for v in _norm_kernels._BACKWARD_VARIANTS}
    crowded = [(r.variant, r.arch, r.registers) for r in reports if r.kernel == "norm_bwd"
               and r.registers * 32 * warps[r.variant] * _norm_kernels.programs_per_sm(warps[r.variant]) > 65536]
    assert not crowded, crowded


def test_backward_grid_is_the_programs_an_sm_holds(monkeypatch):
    """One program per SM for blocks of 16 warps or more (a second would run in a second wave and write
    more dw/db partial rows), two for smaller blocks; as many waves of them as keep each program's plain
    fp32 sums at most MAX_ROWS_PER_PROGRAM rows long (64: one wave at 8192 tokens on 132 SMs); never
    more programs than rows."""
    from memkernels.fusions.norm import kernels as _norm_kernels
    monkeypatch.setattr(_norm_kernels, "_multiprocessors", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert _norm_kernels.MAX_ROWS_PER_PROGRAM == 64

    def programs(rows, hidden):
        return _norm_kernels.num_programs(rows, cuda, _norm_kernels.backward_config(hidden)[1])
    assert programs(8192, 8192) == programs(8192, 16384) == 132  # 16 warps (16384: chunks of 4096)
    assert programs(8192, 5000) == 132  # not a multiple of 16: chunks of 4096 at 32 warps
    assert programs(8192, 4096) == programs(8192, 2048) == programs(8192, 1024) == 264  # 8, 8, 4 warps
    assert programs(100, 1024) == 100
    # Longer batches: more waves, at most 64 rows a program.
    assert programs(132 * 64, 8192) == 132 and programs(132 * 64 + 1, 8192) == 264
    assert programs(65536, 8192) == programs(65536, 4096) == 1056  # 62-63 rows a program
    # Under the interpreter: INTERPRETER_PROGRAMS (4) a wave.
    cpu = torch.device("cpu")
    assert [_norm_kernels.num_programs(rows, cpu, 8) for rows in (3, 256, 257, 1024)] == [3, 4, 8, 16]


def test_backward_warps_per_row():
    """Widths a multiple of 16 (vectorized loads): Liger-Kernel's warps, 4 below 2048, 8 up to 4096, 16 at
    8192 and in the chunks of 4096 of wider rows; other widths 128 elements a warp, looping past 4096."""
    from memkernels.fusions.norm.kernels import backward_config
    aligned = {hidden: backward_config(hidden) for hidden in (64, 1024, 2048, 4096, 5120, 8192, 16384)}
    assert aligned == {64: (64, 4, True), 1024: (1024, 4, True), 2048: (2048, 8, True), 4096: (4096, 8, True),
                       5120: (8192, 16, True), 8192: (8192, 16, True), 16384: (4096, 16, False)}
    odd = {hidden: backward_config(hidden) for hidden in (1, 129, 1000, 4095, 5000, 9000)}
    assert odd == {1: (1, 1, True), 129: (256, 2, True), 1000: (1024, 8, True), 4095: (4096, 32, True),
                   5000: (4096, 32, False), 9000: (4096, 32, False)}


def test_forward_warps_per_row():
    """The forward's warps per row: 256 elements a warp up to 4 warps, then 1024 (on the H200, 256 a
    warp, one 16-byte load of a 16-bit row in flight per thread, made a [8192, 4096] bf16 forward
    40 us against 33), 32 warps for rows that loop (LayerNorm's loop spills with fewer)."""
    from memkernels.fusions.norm.kernels import _forward_config
    warps = {hidden: _forward_config(hidden)[1] for hidden in (64, 512, 1024, 2048, 4096, 5000, 8192, 16384)}
    assert warps == {64: 1, 512: 2, 1024: 4, 2048: 4, 4096: 4, 5000: 8, 8192: 8, 16384: 32}
    assert _forward_config(16384)[2] is False and _forward_config(8192)[2] is True


def test_backward_rows_past_4096_loop_where_triton_spills_them(monkeypatch):
    """Triton 3.7 (torch 2.13's CUDA wheels pin 3.7.1) spilled the backward's register-resident rows of
    8192, 240-984 bytes a thread, where 3.6, 3.8 and 3.9 fit them (`python -m memkernels.aot`);
    its rows of 4096 fit. Under it every row wider than 4096 loops over chunks of 4096."""
    from memkernels.fusions.norm import kernels as _norm_kernels
    from memkernels.fusions.norm.kernels import backward_config, _wide_backward_rows_fit
    versions = ("3.6.0", "3.7.0", "3.7.1", "3.8.0", "3.9.0", "3.10.0")
    assert [_wide_backward_rows_fit(v) for v in versions] == [True, False, False, True, True, True]
    monkeypatch.setattr(_norm_kernels, "WIDE_BACKWARD_ROWS_FIT", True)
    assert backward_config(8192) == backward_config(6016) == (8192, 16, True)
    monkeypatch.setattr(_norm_kernels, "WIDE_BACKWARD_ROWS_FIT", False)
    assert backward_config(8192) == backward_config(6016) == (4096, 16, False)
    assert backward_config(4096) == (4096, 8, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunked_backward_of_rows_that_would_fit(backend, monkeypatch, dtype):
    """Rows of 4096 < H <= 8192 as triton 3.7 runs them: chunks of 4096, not one register-resident row."""
    from memkernels.fusions.norm import kernels as _norm_kernels
    monkeypatch.setattr(_norm_kernels, "WIDE_BACKWARD_ROWS_FIT", False)
    assert _norm_kernels.backward_config(5120)[2] is False  # the path under test
    x, residual = leaf(7, 5120, dtype=dtype), leaf(7, 5120, dtype=dtype)
    weight = leaf(5120, dtype=dtype, scale=0.5, shift=1.0)
    check_against_reference(rms_norm, rms_norm_eager, (x, weight, 1e-6))
    check_against_reference(add_rms_norm, add_rms_norm_eager, (x, residual, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_plain_sums_over_many_rows_per_program(backend, dtype):
    """The backward's dw is plain fp32 sums, each program's at most MAX_ROWS_PER_PROGRAM rows long:
    257 rows take two waves of the interpreter's 4 programs, 33 rows each (measured through the
    interpreter, float32 RMSNorm, against the rule's bound: 0.3-0.4 of it at 32 rows a program,
    0.3-0.8 at 64, one of 6 seeds over it at 128, all over it at 512 (1.5-1.8); Kahan sums 0.1-0.3).
    5120 wide: one register-resident row, a multiple of 16 (Liger-Kernel's warps on a GPU)."""
    from memkernels.fusions.norm import kernels as _norm_kernels
    rows = _norm_kernels.INTERPRETER_PROGRAMS * _norm_kernels.MAX_ROWS_PER_PROGRAM + 1
    if backend == "triton":
        assert _norm_kernels.num_programs(rows, torch.device("cpu"), 16) == 8  # the path under test
        assert _norm_kernels.backward_config(5120)[2]
    x = leaf(rows, 5120, dtype=dtype)
    weight = leaf(5120, dtype=dtype, scale=0.5, shift=1.0)
    check_against_reference(rms_norm, rms_norm_eager, (x, weight, 1e-6))


def test_launches_compile_without_contraction(monkeypatch):
    """The launchers pass what the AOT variants above compile with: enable_fp_fusion=False."""
    from backends import use_backend
    from memkernels.fusions.norm import kernels as _norm_kernels

    seen = {}

    class Recorder:
        def __init__(self, name):
            self.name, self.kernel = name, getattr(_norm_kernels, name)

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen[self.name] = kwargs.get("enable_fp_fusion")
                return self.kernel[grid](*args, **kwargs)
            return launch

    for name in ("_norm_fwd_kernel", "_norm_bwd_kernel", "_norm_reduce_partials_kernel"):
        monkeypatch.setattr(_norm_kernels, name, Recorder(name))
    with use_backend("triton"):
        x, weight = leaf(3, 64, dtype=torch.float32), leaf(64, dtype=torch.float32)
        rms_norm(x, weight).sum().backward()
    assert seen == dict.fromkeys(("_norm_fwd_kernel", "_norm_bwd_kernel", "_norm_reduce_partials_kernel"), False)


# --- reference path: row blocks, peak memory --------------------------------------------------

@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_row_blocks_match_float64(small_row_blocks, dtype, memory_efficient):
    """13 rows in blocks of 3 + 1: statistics, y, dx and the per-block dw partial sums stay exact."""
    x, residual = leaf(13, 129, dtype=dtype), leaf(13, 129, dtype=dtype)
    weight = _spiked_weight(129, dtype)
    options = {"memory_efficient": memory_efficient}
    check_against_reference(functools.partial(rms_norm, **options), rms_norm_eager, (x, weight))
    check_against_reference(functools.partial(add_rms_norm, **options), add_rms_norm_eager, (x, residual, weight))


def test_reference_row_blocks_in_place_backward(small_row_blocks):
    """dx is written over dy block by block; each block reads its rows of dy first."""
    x, weight = leaf(13, 129, dtype=torch.float32), leaf(129, dtype=torch.float32, shift=1.0)
    probe = torch.randn(13, 129)
    grads = []
    for in_place in (False, True):
        x.grad = weight.grad = None
        (rms_norm(x, weight, in_place=in_place) * probe).sum().backward()
        grads.append((x.grad, weight.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", ["rms_norm", "add_rms_norm"])
def test_reference_peak_is_at_most_eager(dtype, variant, memory_efficient):
    """Measured with PeakBytesMeter, which sees inside the custom ops: the reference path's row-block
    temporaries fit under what eager nn.RMSNorm (after x + residual for the add variant) needs."""
    rows, hidden = 1024, 2048  # 8 MiB per fp32 tensor: larger than a block's temporaries
    memkernels.set_backend("torch")
    try:
        fused = (memkernels.FusedAddRMSNorm if variant == "add_rms_norm" else memkernels.FusedRMSNorm)(
            hidden, eps=1e-6, dtype=dtype, memory_efficient=memory_efficient)
        eager = nn.RMSNorm(hidden, eps=1e-6, dtype=dtype)
        takes_residual = variant == "add_rms_norm"
        ours = peak_with_next_layer(fused, takes_residual, rows, hidden, dtype)
        baseline = peak_with_next_layer(eager_add_then(eager) if takes_residual else eager,
                                        takes_residual, rows, hidden, dtype)
    finally:
        memkernels.set_backend("auto")
    assert ours <= baseline, (ours, baseline)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_temporaries_stay_within_budget(dtype):
    """Forward and backward each need at most TEMPORARY_BUDGET_BYTES beyond the tensors they return."""
    from memkernels.fusions.norm import reference as _norm
    rows, hidden = 1024, 2048  # a whole-tensor fp32 temporary is 8 MiB; the old path kept several
    memkernels.set_backend("torch")
    try:
        x, residual = leaf(rows, hidden, dtype=dtype), leaf(rows, hidden, dtype=dtype)
        weight = leaf(hidden, dtype=dtype, shift=1.0)
        with PeakBytesMeter() as forward:
            y, residual_out = add_rms_norm(x, residual, weight)
        returned = 2 * y.untyped_storage().nbytes() + 4 * rows  # y, residual_out, rstd
        assert forward.peak_bytes - returned <= _norm.TEMPORARY_BUDGET_BYTES
        grad = torch.randn_like(y)
        with PeakBytesMeter() as backward:
            y.backward(grad)
        # dx, its copy for residual, dw and the engine's zero gradient for residual_out
        returned = 3 * y.untyped_storage().nbytes() + weight.untyped_storage().nbytes()
        assert backward.peak_bytes - returned <= _norm.TEMPORARY_BUDGET_BYTES
    finally:
        memkernels.set_backend("auto")


# --- memory_efficient: the unrecoverable-column decision is cached per weight state ---------------

@pytest.fixture
def counted_readbacks(monkeypatch):
    """Counts the device-to-host reads of the decision: a forward's (K of one layer) and an
    optimizer step hook's (every stepped layer's mask at once)."""
    from memkernels.fusions.norm import op as _norm_ops
    from memkernels.fusions.norm import reference as _norm
    calls = []
    compute, read = _norm.unrecoverable_columns, _norm_ops._read_masks
    monkeypatch.setattr(_norm, "unrecoverable_columns", lambda *args: calls.append(len(args)) or compute(*args))
    monkeypatch.setattr(_norm_ops, "_read_masks", lambda masks: calls.append(len(masks)) or read(masks))
    return calls


def _memory_efficient_gradients(module, x):
    module.zero_grad()
    x.grad = None
    module(x).square().sum().backward()
    return x.grad.clone(), module.weight.grad.clone()


def _expected_gradients(module, x):
    x64 = x.detach().double().requires_grad_()
    weight64 = module.weight.detach().double().requires_grad_()
    rms_norm_eager(x64, weight64).square().sum().backward()
    return x64.grad, weight64.grad


@pytest.mark.parametrize("update", ["no_grad-mul_", "sgd", "fused-adamw"])
def test_unrecoverable_columns_cached_until_the_weight_changes(backend, counted_readbacks, update):
    module = memkernels.FusedRMSNorm(64, eps=1e-6, memory_efficient=True)
    x = torch.randn(5, 64, requires_grad=True)
    for _ in range(3):  # a step with unchanged weight reuses the decision
        _memory_efficient_gradients(module, x)
    assert len(counted_readbacks) == 1
    # The update zeroes column 7: the cached decision (no fallback column) would divide by zero.
    if update == "no_grad-mul_":
        with torch.no_grad():
            module.weight.mul_(torch.where(torch.arange(64) == 7, 0.0, 1.0))
    else:
        module.weight.grad = torch.zeros(64)
        module.weight.grad[7] = 1.0
        optimizer = (torch.optim.SGD([module.weight], lr=1.0) if update == "sgd"
                     else torch.optim.AdamW([module.weight], lr=1.0, weight_decay=0.0, fused=True))
        optimizer.step()
        with torch.no_grad():  # the counter-visible write is not needed for the optimizer case to work
            module.weight.data[7] = 0.0
    assert module.weight[7] == 0.0
    grads = _memory_efficient_gradients(module, x)
    assert len(counted_readbacks) == 2  # recomputed once after the update (by the step's hook for optimizers)
    _memory_efficient_gradients(module, x)
    assert len(counted_readbacks) == 2  # and cached again
    for got, want in zip(grads, _expected_gradients(module, x)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_memory_efficient_norms_read_back_once_per_optimizer_step_for_the_whole_model(backend, counted_readbacks):
    """No per-layer host sync: after an optimizer step the first norm layer refreshes every
    layer's decision with one readback; the other layers and the backward read nothing back."""
    from memkernels.audit.gpu_audit import count
    layers = torch.nn.Sequential(*(memkernels.FusedRMSNorm(64, memory_efficient=True) for _ in range(3)))
    optimizer = torch.optim.SGD(layers.parameters(), lr=0.1)
    x = torch.randn(5, 64)
    for step in range(2):
        layers(x).square().sum().backward()
        optimizer.step()
        del counted_readbacks[:]
        with count() as forward:
            y = layers(x)
        with count() as backward:
            y.square().sum().backward()
        assert counted_readbacks == [3]  # one read of the three layers' masks
        assert forward.syncs == backward.syncs == []  # on the CPU path that read is no aten op


def test_unrecoverable_columns_cache_keeps_no_weight_alive():
    from memkernels.fusions.norm import op as _norm_ops
    weight = torch.rand(32) + 0.5
    rms_norm(torch.randn(3, 32), weight, memory_efficient=True)
    released = []
    watch = weakref.ref(weight.untyped_storage(), released.append)  # noqa: F841 (the callback needs it alive)
    assert weight.untyped_storage() in _norm_ops._UNRECOVERABLE  # cached, keyed by the weight's storage
    del weight
    gc.collect()
    assert released, "the cache must not keep the weight alive"
