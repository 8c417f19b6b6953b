"""Every public op under torch.autocast behaves like its eager counterpart under autocast.

PyTorch's CPU policy (aten/src/ATen/autocast_mode.cpp): mm/addmm/linear run in the region's
dtype, cross-entropy in float32, layer_norm and rms_norm on their inputs as they are. The
judge is memkernels.testing's rule: the op under autocast against eager under autocast, both
against the float64 truth (float64 is never autocast). CUDA autocast needs a GPU: on a machine
with one, gelu_linear's "triton" case runs under it; the same registration serves every op
(memkernels/fusions/common/autocast.py).
"""
import pytest
import torch
import torch.nn.functional as F

from memkernels.fusions.gelu_mlp.op import gelu_linear
from memkernels.fusions.loss.cross_entropy import cross_entropy
from memkernels.fusions.loss.linear_cross_entropy import linear_cross_entropy
from memkernels.fusions.norm.layer_norm import layer_norm
from memkernels.fusions.norm.rms_norm import rms_norm
from memkernels.testing import check_against_reference

from backends import triton_device

LOW = (torch.bfloat16, torch.float16)


def _under_autocast(function, dtype, device_type="cpu"):
    def run(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return function(*args, **kwargs)
    run.__name__ = f"{getattr(function, '__name__', 'op')}[autocast {dtype}]"
    return run


def _eager_gelu_linear(x, weight, bias, approximate="none"):
    return F.linear(F.gelu(x, approximate=approximate), weight, bias)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gelu_linear_computes_in_the_autocast_dtype(dtype, backend):
    device = triton_device() if backend == "triton" else "cpu"  # CUDA autocast where a GPU runs Triton
    x = torch.randn(5, 7, 48, device=device, requires_grad=True)
    weight = torch.randn(40, 48, device=device, requires_grad=True)
    bias = torch.randn(40, device=device, requires_grad=True)
    with torch.autocast(device, dtype=dtype):
        out = gelu_linear(x, weight, bias, backend=backend)
        expected = _eager_gelu_linear(x, weight, bias)
    assert out.dtype == expected.dtype == dtype  # the GEMM ran in the region's dtype, as F.linear's does
    out.float().sum().backward()
    assert (x.grad.dtype, weight.grad.dtype, bias.grad.dtype) == (torch.float32,) * 3
    check_against_reference(_under_autocast(lambda *a: gelu_linear(*a, backend=backend), dtype, device),
                            _under_autocast(_eager_gelu_linear, dtype, device),
                            (x.detach().requires_grad_(), weight.detach().requires_grad_(),
                             bias.detach().requires_grad_()))


def _eager_linear_cross_entropy(hidden, weight, target, bias=None):
    return F.cross_entropy(F.linear(hidden, weight, bias), target)


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("strategy", ["auto", "chunked", "recompute"])
@pytest.mark.parametrize("tokens", [6, 80])  # "auto" (pick_strategy): recompute at both in half dtypes
@pytest.mark.parametrize("hidden_dtype", [torch.float32, "autocast"])  # what an autocast region hands a loss
def test_linear_cross_entropy_matmuls_in_the_autocast_dtype_loss_in_float32(dtype, strategy, tokens, hidden_dtype):
    hidden = torch.randn(tokens, 32, dtype=dtype if hidden_dtype == "autocast" else hidden_dtype)
    weight = torch.randn(50, 32)
    bias = torch.randn(50)
    target = torch.randint(0, 50, (tokens,))
    target[1] = -100
    with torch.autocast("cpu", dtype=dtype):
        loss = linear_cross_entropy(hidden, weight, target, bias=bias, strategy=strategy)
        expected = _eager_linear_cross_entropy(hidden, weight, target, bias)
    assert loss.dtype == expected.dtype == torch.float32
    inputs = (hidden.requires_grad_(), weight.requires_grad_(), target, bias.requires_grad_())
    check_against_reference(
        _under_autocast(lambda h, w, t, b: linear_cross_entropy(h, w, t, bias=b, strategy=strategy), dtype),
        _under_autocast(_eager_linear_cross_entropy, dtype), inputs)


@pytest.mark.parametrize("dtype", LOW)
def test_cross_entropy_keeps_float32_like_eager(dtype):
    logits = torch.randn(12, 70, dtype=dtype, requires_grad=True)
    target = torch.randint(0, 70, (12,))
    with torch.autocast("cpu", dtype=dtype):
        loss = cross_entropy(logits, target)
        expected = F.cross_entropy(logits, target)
    assert loss.dtype == expected.dtype == torch.float32
    check_against_reference(_under_autocast(cross_entropy, dtype), _under_autocast(F.cross_entropy, dtype),
                            (logits, target))


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("x_dtype", [torch.float32, "autocast"])
def test_norms_follow_the_cpu_policy_inputs_as_they_are(dtype, x_dtype):
    x = torch.randn(6, 40, dtype=dtype if x_dtype == "autocast" else x_dtype, requires_grad=True)
    weight = torch.randn(40, requires_grad=True)
    bias = torch.randn(40, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        pairs = [(rms_norm(x, weight, 1e-6, casting_mode="none"), F.rms_norm(x, (40,), weight, 1e-6)),
                 (layer_norm(x, weight, bias), F.layer_norm(x, (40,), weight, bias))]
    for got, expected in pairs:
        assert got.dtype == expected.dtype == x.dtype
    check_against_reference(_under_autocast(lambda a, w, b: layer_norm(a, w, b), dtype),
                            _under_autocast(lambda a, w, b: F.layer_norm(a, (40,), w, b), dtype), (x, weight, bias))


def test_the_custom_ops_carry_the_policy_at_their_autocast_dispatch_key():
    """Called as torch.ops (what torch.compile keeps in its graph), not through the Python wrappers."""
    x, weight = torch.randn(4, 16), torch.randn(8, 16)
    target = torch.randint(0, 8, (4,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.ops.memkernels.gelu_linear(x, weight, None, "none", "torch")
        loss, _, _, _ = torch.ops.memkernels.linear_cross_entropy_recompute(x, weight, target, None, None, -100,
                                                                            0.0, 0.0, 0.0, "mean", 0, False, "torch")
        y = torch.ops.memkernels.norm_fwd(x.bfloat16(), None, weight[0].float(), None, 1e-6, 0.0, True, 0, False,
                                          False, "torch")[0]
        expected = F.cross_entropy(F.linear(x, weight), target)
    assert out.dtype == torch.bfloat16
    assert loss.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(loss, expected)  # the same bf16 logits, the same float32 loss
    assert y.dtype == torch.bfloat16  # CPU: layer_norm/rms_norm are not autocast


def test_compiled_ops_follow_the_same_policy():
    """torch.compile(fullgraph=True) keeps the ops whole and they still run in the autocast dtype."""
    torch._dynamo.reset()
    x, weight = torch.randn(6, 16), torch.randn(10, 16)
    target = torch.randint(0, 10, (6,))

    def step(x, weight, target):
        return gelu_linear(x, weight), linear_cross_entropy(x, weight, target)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, expected = compiled(x, weight, target), step(x, weight, target)
    assert got[0].dtype == expected[0].dtype == torch.bfloat16
    assert got[1].dtype == expected[1].dtype == torch.float32
    for value, reference in zip(got, expected):
        torch.testing.assert_close(value, reference)


def test_every_forward_op_has_a_kernel_at_both_autocast_keys():
    """The CUDA key cannot run here (no GPU); at least the registration that serves it must exist (OpSpec makes it
    for every op)."""
    import memkernels.functional  # noqa: F401
    import memkernels.fusions.gated_mlp.grouped  # noqa: F401  (the one op memkernels.functional does not import)
    from memkernels.fusions.op_spec import SPECS
    ops = sorted(spec.custom_op._qualname for spec in SPECS.values())
    assert {"memkernels::norm_fwd", "memkernels::gelu_linear", "memkernels::rope", "memkernels::dyt"} <= set(ops)
    for op in ops:
        for key in ("AutocastCPU", "AutocastCUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op, key), (op, key)


def test_autocast_check_calls_nothing_torch_compile_cannot_trace(monkeypatch):
    """ops/_autocast._enabled runs inside every compiled memkernels module. torch 2.11's dynamo cannot
    trace torch.amp.is_autocast_available (a pybind builtin: "Attempted to call function marked as
    skipped" broke every fullgraph test on the H200), so it is asked once at import, not per call."""
    from memkernels.fusions.common import autocast as _autocast

    def untraceable(device_type):
        raise AssertionError("torch.amp.is_autocast_available called per call")
    monkeypatch.setattr(torch.amp, "is_autocast_available", untraceable)
    assert not _autocast._enabled("cpu") and not _autocast._enabled("meta") and not _autocast._enabled(None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _autocast._enabled("cpu")
