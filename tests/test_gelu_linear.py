"""gelu_linear, GeLULinear and FusedMLP against eager PyTorch in float64, and their memory contract."""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memkernels
from memkernels.fusions.gelu_mlp import op as gelu_module
from memkernels.fusions.gelu_mlp.module import FusedMLP, GeLULinear
from memkernels.fusions.gelu_mlp.op import gelu_linear
from memkernels.meters import SavedBytesMeter
from memkernels.testing import check_against_reference

from act_gemm_cases import compile_recording_ops, gemm_sum_lengths, step_log

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from memkernels.fusions.common.act_linear import _erf, tanh_sech2  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def eager_gelu_linear(x, weight, bias, approximate="none"):
    return F.linear(F.gelu(x, approximate=approximate), weight, bias)


def fused_gelu_linear(x, weight, bias, approximate="none"):
    return gelu_linear(x, weight, bias, approximate=approximate)


def make_inputs(leading, in_features, out_features, dtype, bias=True, requires_grad=(True, True, True)):
    x = torch.randn(*leading, in_features).to(dtype)
    weight = (torch.randn(out_features, in_features) * in_features ** -0.5).to(dtype)
    b = torch.randn(out_features).to(dtype) if bias else None
    tensors = [x, weight, b]
    for tensor, needs in zip(tensors, requires_grad):
        if tensor is not None:
            tensor.requires_grad_(needs)
    return tensors


# --------------------------------------------------------------------------------------------
# GeLU building blocks inside Triton (the interpreter's libdevice is a stub)


@triton.jit
def _erf_tanh_kernel(x_ptr, erf_ptr, tanh_ptr, sech2_ptr, n, BLOCK: tl.constexpr):
    # x_ptr, erf_ptr, tanh_ptr, sech2_ptr: [n] float32
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tanh, sech2 = tanh_sech2(x)
    tl.store(erf_ptr + offs, _erf(x), mask=mask)
    tl.store(tanh_ptr + offs, tanh, mask=mask)
    tl.store(sech2_ptr + offs, sech2, mask=mask)


@pytest.mark.skipif(not (INTERPRETED or torch.cuda.is_available()), reason="needs Triton (GPU or interpreter)")
def test_erf_and_tanh_accurate_to_float32_rounding():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # A grid of 2**22 exact steps over [-6, 6] (integers times a power-of-two step: no rounding, so
    # the points do not depend on how ATen vectorizes linspace), then the special values.
    n = 1 << 21
    grid = (torch.arange(-n, n + 1, dtype=torch.float64) * (6.0 / n)).float()
    x = torch.cat([grid, torch.tensor([0.0, -0.0, 1e-30, 3e38, -3e38, 100.0])]).to(device)
    erf, tanh, sech2 = (torch.empty_like(x) for _ in range(3))
    _erf_tanh_kernel[(triton.cdiv(x.numel(), 4096),)](x, erf, tanh, sech2, x.numel(), BLOCK=4096)
    exact = x.double()
    one_ulp_at_one = torch.finfo(torch.float32).eps  # 2**-23: the spacing of floats just above 1.0
    # The bound is 1.5 spacings of floats just above 1.0 (3 * 2**-24): the largest errors, 2.4 * 2**-24
    # for erf (near |x| = 0.65, where 1 - exp(log erfc) carries the polynomial's rounding) and
    # 1.9 * 2**-24 for (1 - e) / (1 + e)'s tanh, were found on denser grids through the interpreter. An erf or tanh
    # a few ulps wrong fails it.
    assert (erf.double() - torch.special.erf(exact)).abs().max().item() <= 1.5 * one_ulp_at_one
    assert (tanh.double() - torch.tanh(exact)).abs().max().item() <= 1.5 * one_ulp_at_one
    # and relative to tanh itself, where it is small (DyT's weight gradient sums g * tanh): within one ulp
    # (0.8 measured through the interpreter; (1 - e) / (1 + e) alone was 2.4 at |x| = 0.3 and worse below)
    tiny = torch.finfo(torch.float32).tiny
    exact_tanh = torch.tanh(exact)
    small = (exact.abs() < 1) & (exact_tanh.abs() >= tiny)
    relative_tanh = (tanh.double() - exact_tanh).abs()[small] / exact_tanh.abs()[small]
    assert relative_tanh.max().item() <= one_ulp_at_one
    # sech^2 keeps relative accuracy in the tails, where 1 - tanh^2 would be all cancellation
    exact_sech2 = torch.cosh(exact).pow(-2)
    normal = exact_sech2 >= torch.finfo(torch.float32).tiny  # sech^2(100) underflows float32, rightly to 0
    relative = (sech2.double() - exact_sech2).abs()[normal] / exact_sech2[normal]
    # exp(-2|x|) is relatively accurate to a few ulp, plus |2x| * eps/2 on a GPU, whose exp
    # rounds its scaled argument (measured here: 2.7 ulp)
    assert (relative <= 4 * one_ulp_at_one * (1 + exact.abs()[normal])).all()
    assert sech2[~normal].eq(0).all()
    assert erf[-3:].tolist() == [1.0, -1.0, 1.0] and tanh[-3:].tolist() == [1.0, -1.0, 1.0]
    assert torch.isfinite(erf).all() and torch.isfinite(tanh).all() and torch.isfinite(sech2).all()


# --------------------------------------------------------------------------------------------
# Output and gradients vs float64

# Every compared tensor has at least ~30 elements (a scalar grad bias aside, which is the
# same torch.sum as eager's): the rule compares maximum errors, and the maximum of a handful of
# rounding errors is too noisy to tell a 2x difference, so 4-element outputs fail by chance.
SHAPES = [  # (leading dims, in_features K, out_features N)
    ((1,), 131, 67),  # one row
    ((40,), 1, 31),  # K = 1
    ((3, 7), 53, 61),  # primes, two leading dims
    ((2, 31), 127, 129),  # just under and over a power of two
    ((3, 43), 130, 70),  # M = 129: several row blocks under any config
    ((37,), 33, 1),  # N = 1
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[0] + s[1:])))
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64(backend, dtype, approximate, has_bias, shape):
    inputs = make_inputs(*shape, dtype, bias=has_bias)
    check_against_reference(fused_gelu_linear, eager_gelu_linear, inputs, kwargs={"approximate": approximate},
                            sum_length=gemm_sum_lengths(inputs))


# Every dtype with both widths and both approximations, without the full product: each
# interpreted case takes ~30 s.
MLP_WIDTH_CASES = [
    (torch.float32, "none", 768), (torch.float16, "tanh", 768), (torch.bfloat16, "none", 768),
    (torch.float32, "tanh", 1000), (torch.float16, "none", 1000), (torch.bfloat16, "tanh", 1000),
]


@pytest.mark.slow
@pytest.mark.parametrize("dtype, approximate, hidden", MLP_WIDTH_CASES, ids=lambda v: str(v))
def test_matches_float64_mlp_widths(backend, dtype, approximate, hidden):
    # fc2 of a transformer MLP: K = 4 * hidden in, hidden out. Few rows: the interpreter is slow.
    inputs = make_inputs((3,), 4 * hidden, hidden, dtype)
    check_against_reference(fused_gelu_linear, eager_gelu_linear, inputs, kwargs={"approximate": approximate},
                            sum_length=gemm_sum_lengths(inputs))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_weight_and_input(backend, dtype):
    # weight as a transposed view (nn.Linear weights tied to an embedding, or a W.T), x as a slice
    x = torch.randn(6, 80).to(dtype)[:, 3:50].requires_grad_()
    weight = (torch.randn(47, 29) * 47 ** -0.5).to(dtype).t().requires_grad_()
    bias = torch.randn(29).to(dtype).requires_grad_()
    assert not weight.is_contiguous() and not x.is_contiguous()
    check_against_reference(fused_gelu_linear, eager_gelu_linear, [x, weight, bias],
                            sum_length=gemm_sum_lengths([x, weight, bias]))


@pytest.mark.parametrize("requires_grad", [(True, False, False), (False, True, False), (False, False, True)],
                         ids=["x", "weight", "bias"])
def test_backward_computes_only_needed_grads(backend, requires_grad, monkeypatch):
    inputs = make_inputs((9,), 24, 40, torch.float32, requires_grad=requires_grad)
    check_against_reference(fused_gelu_linear, eager_gelu_linear, inputs, sum_length=gemm_sum_lengths(inputs))
    x, weight, bias = inputs
    y = gelu_linear(x, weight, bias)
    # which steps and GEMMs ran, on which backend
    with step_log(monkeypatch, gelu_module.GELU_LINEAR, matmuls=True) as log:
        y.backward(torch.ones_like(y))
    # dx needs dy @ W; dW needs dy.T @ gelu(x); the bias gradient is a sum: no step at all
    needs_x, needs_w = requires_grad[:2]
    expected = ([("gelu_linear_backward", backend)] if needs_x or needs_w else []) + ["mm"] * (needs_x + needs_w)
    assert log == expected


def test_explicit_backend_overrides_global(monkeypatch):
    memkernels.set_backend("triton" if INTERPRETED else "torch")
    try:
        x, weight, bias = make_inputs((4,), 16, 8, torch.float32)
        with step_log(monkeypatch, gelu_module.GELU_LINEAR) as log:
            gelu_linear(x, weight, bias, backend="torch")
        assert log == [("gelu_linear", "torch")]
    finally:
        memkernels.set_backend("auto")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_large_activations_run_in_chunks_whose_results_are_final(backend, monkeypatch, dtype):
    # gelu(x) is 37 x 50: forward chunks of 10 rows, backward slabs of 16 columns (a ragged last one each)
    from memkernels.fusions.common import act_linear as _act_linear

    monkeypatch.setattr(_act_linear, "TRANSIENT_BYTES", 37 * 50 * dtype.itemsize // 3)
    monkeypatch.setattr(_act_linear, "MIN_CHUNK_ROWS", 10)
    monkeypatch.setattr(_act_linear, "MIN_SLAB_COLS", 16)
    inputs = make_inputs((37,), 50, 29, dtype)
    check_against_reference(fused_gelu_linear, eager_gelu_linear, inputs, kwargs={"approximate": "tanh"},
                            sum_length=gemm_sum_lengths(inputs))
    x, weight, bias = inputs
    with step_log(monkeypatch, gelu_module.GELU_LINEAR, matmuls=True) as log:
        gelu_linear(x, weight, bias).backward(torch.ones(37, 29, dtype=dtype))
    assert log == [("gelu_linear", backend)] + ["addmm"] * 4 + [("gelu_linear_backward", backend)] + ["mm"] * 8


def test_empty_batch(backend):
    x, weight, bias = make_inputs((0,), 16, 8, torch.float32)
    y = gelu_linear(x, weight, bias)
    y.sum().backward()
    assert y.shape == (0, 8)
    assert torch.equal(weight.grad, torch.zeros_like(weight)) and torch.equal(bias.grad, torch.zeros_like(bias))


# --------------------------------------------------------------------------------------------
# Memory contract, measured


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gelu_linear_saves_no_new_bytes(backend, dtype):
    x, weight, bias = make_inputs((4, 25), 96, 40, dtype)
    with SavedBytesMeter() as saved:
        y = gelu_linear(x, weight, bias)
    assert saved.bytes_per_token(100) == 0
    # what it holds is the caller's x and the weight, nothing derived from them
    assert sorted(r["nbytes"] for r in saved.records) == sorted([x.nbytes, weight.nbytes])
    y.sum().backward()

    with SavedBytesMeter() as eager:
        eager_gelu_linear(x, weight, bias)
    assert eager.bytes_per_token(100) == 96 * x.element_size()  # eager keeps gelu(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_mlp_saves_only_x_and_h(backend, dtype):
    tokens, hidden, ffn = 30, 16, 64
    mlp = FusedMLP(hidden, ffn, dtype=dtype)
    eager = nn.Sequential(mlp.fc1, nn.GELU(), nn.Linear(ffn, hidden, dtype=dtype))
    x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    bytes_per = torch.finfo(dtype).bits // 8
    with SavedBytesMeter() as saved:
        mlp(x)
    new = [r for r in saved.records if r["new"]]
    assert [r["shape"] for r in new] == [(tokens, ffn)]  # h, and nothing else
    assert saved.bytes_per_token(tokens) == ffn * bytes_per
    assert x.nbytes in [r["nbytes"] for r in saved.records if not r["new"]]
    with SavedBytesMeter() as saved_eager:
        eager(x)
    assert saved_eager.bytes_per_token(tokens) == 2 * ffn * bytes_per  # h and gelu(h)


# --------------------------------------------------------------------------------------------
# Modules


def test_gelu_linear_module_is_a_linear_checkpoint():
    linear = nn.Linear(12, 7)
    module = GeLULinear(12, 7, approximate="tanh")
    assert module.state_dict().keys() == linear.state_dict().keys()
    module.load_state_dict(linear.state_dict())
    x = torch.randn(3, 12)
    torch.testing.assert_close(module(x), linear(F.gelu(x, approximate="tanh")))
    assert "approximate='tanh'" in repr(module)
    assert GeLULinear(12, 7, bias=False).bias is None
    assert not isinstance(module, nn.Linear)  # Linear-swapping tools must not take it for one
    torch.manual_seed(0)
    fresh_linear = nn.Linear(12, 7)
    torch.manual_seed(0)
    fresh = GeLULinear(12, 7)
    assert torch.equal(fresh.weight, fresh_linear.weight) and torch.equal(fresh.bias, fresh_linear.bias)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_mlp_from_modules_matches_float64(backend, dtype, approximate):
    fc1, act, fc2 = nn.Linear(24, 70, dtype=dtype), nn.GELU(approximate=approximate), nn.Linear(70, 20, dtype=dtype)
    fused = FusedMLP.from_modules(fc1, act, fc2)
    assert fused.fc1 is fc1 and fused.fc2.weight is fc2.weight and fused.fc2.bias is fc2.bias
    assert fused.fc2.approximate == approximate
    eager = nn.Sequential(fc1, act, fc2)
    names = [name for name, _ in eager.named_parameters()]
    fused_names = [name for name, _ in fused.named_parameters()]
    assert [n.replace("fc1", "0").replace("fc2", "2") for n in fused_names] == names

    def run(module, param_names):
        def call(x, *params):
            return torch.func.functional_call(module, dict(zip(param_names, params)), (x,))
        return call

    x = torch.randn(2, 5, 24, dtype=dtype, requires_grad=True)
    params = [p.detach().clone().requires_grad_() for p in eager.parameters()]
    check_against_reference(run(fused, fused_names), run(eager, names), [x, *params], name="FusedMLP")


def test_fused_mlp_defaults_and_no_bias():
    mlp = FusedMLP(8, 32, bias=False)
    assert mlp.fc2.out_features == 8 and mlp.fc1.bias is None and mlp.fc2.bias is None
    assert mlp(torch.randn(3, 8)).shape == (3, 8)
    assert FusedMLP(8, 32, 5)(torch.randn(2, 8)).shape == (2, 5)


def test_from_modules_rejects_bad_modules():
    fc1, fc2 = nn.Linear(4, 16), nn.Linear(16, 4)
    with pytest.raises(TypeError, match="act must be an nn.GELU"):
        FusedMLP.from_modules(fc1, nn.ReLU(), fc2)
    with pytest.raises(TypeError, match="fc2 must be an nn.Linear"):
        FusedMLP.from_modules(fc1, nn.GELU(), nn.Identity())
    with pytest.raises(ValueError, match="fc2.in_features=8"):
        FusedMLP.from_modules(fc1, nn.GELU(), nn.Linear(8, 4))


# --------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_names_the_argument():
    x, weight, bias = make_inputs((3,), 8, 5, torch.float32)
    with pytest.raises(ValueError, match="in_features mismatch: x has 8"):
        gelu_linear(x, weight[:, :7], bias)
    with pytest.raises(ValueError, match="weight is on meta but x is on cpu"):
        gelu_linear(x, weight.to("meta"), bias)
    with pytest.raises(ValueError, match="bias is on meta"):
        gelu_linear(x, weight, bias.to("meta"))
    with pytest.raises(ValueError, match="bias has shape"):
        gelu_linear(x, weight, bias[:4])
    with pytest.raises(ValueError, match="weight is torch.float16"):
        gelu_linear(x, weight.half(), bias)
    with pytest.raises(ValueError, match="approximate='erf'"):
        gelu_linear(x, weight, bias, approximate="erf")
    with pytest.raises(ValueError, match="backend='cuda'"):
        gelu_linear(x, weight, bias, backend="cuda")
    with pytest.raises(ValueError, match="weight must be a 2-D"):
        gelu_linear(x, weight[0], bias)
    with pytest.raises(ValueError, match="approximate='fast'"):
        GeLULinear(4, 4, approximate="fast")
    with pytest.raises(ValueError, match="approximate='fast'"):
        FusedMLP(4, 4, approximate="fast")


@pytest.mark.skipif(not INTERPRETED, reason="forces the Triton backend on CPU tensors")
def test_triton_backend_rejects_float64():
    x, weight, bias = make_inputs((3,), 8, 5, torch.float64)
    with pytest.raises(TypeError, match="x is torch.float64; the Triton backend"):
        gelu_linear(x, weight, bias, backend="triton")


def test_triton_backend_rejects_a_device_it_cannot_run_on():
    x, weight, bias = (t.to("meta") for t in make_inputs((3,), 8, 5, torch.float32))
    with pytest.raises(ValueError, match="backend='triton' cannot run on meta"):
        gelu_linear(x, weight, bias, backend="triton")


# --------------------------------------------------------------------------------------------
# torch.library registration


def test_custom_ops_pass_opcheck(backend):
    x, weight, bias = make_inputs((6,), 20, 12, torch.float32, requires_grad=(False, False, False))
    grad_out = torch.randn(6, 12)
    ops = torch.ops.memkernels
    torch.library.opcheck(ops.gelu_linear.default, (x, weight, bias, "tanh", backend))
    torch.library.opcheck(ops.gelu_linear.default, (x, weight, None, "none", backend))
    for needs_input, needs_weight in ((True, True), (True, False), (False, True)):
        torch.library.opcheck(ops.gelu_linear_backward.default,
                              (grad_out, x, weight, needs_input, needs_weight, "tanh", backend))


def test_torch_compile_fullgraph(backend):
    compiled, graph_ops = compile_recording_ops(fused_gelu_linear)
    check_against_reference(compiled, eager_gelu_linear, make_inputs((2, 5), 24, 16, torch.float32),
                            kwargs={"approximate": "tanh"}, name="compiled gelu_linear")
    # The steps stay opaque custom ops and gelu(x) is not materialized by the compiled graphs.
    assert "memkernels.gelu_linear.default" in graph_ops["forward"]
    assert "memkernels.gelu_linear_backward.default" in graph_ops["backward"]
    assert not any("gelu.default" in op for ops in graph_ops.values() for op in ops)


def test_torch_compile_inductor_default_backend():
    # the default compiler end to end on CPU (C++ codegen around the opaque custom ops)
    torch._dynamo.reset()
    compiled = torch.compile(fused_gelu_linear, fullgraph=True)
    check_against_reference(compiled, eager_gelu_linear, make_inputs((3, 4), 24, 16, torch.float32),
                            kwargs={"approximate": "none"}, name="inductor gelu_linear")


def test_float64_bias_gradient_is_summed_in_float64():
    """The torch path takes float64 (the Triton one refuses it): its bias gradient was a float32 sum
    cast back, ~1e-2 off at 4096 tokens of gradients ~1e3 where a float64 sum is ~1e-10 off."""
    x, weight, bias = make_inputs((4096,), 8, 3, torch.float64)
    grad_out = torch.randn(4096, 3, dtype=torch.float64) * 1e3 + 1
    gelu_linear(x, weight, bias).backward(grad_out)
    exact = grad_out.sum(0)
    assert (bias.grad - exact).abs().max() <= 1e3 * 4096 * torch.finfo(torch.float64).eps
