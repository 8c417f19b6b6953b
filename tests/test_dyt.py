"""memkernels.functional.dyt and FusedDyT against DyT's eager form in float64, on both backends (the Triton
kernels through the interpreter without a GPU); its contract (saved bytes, launches, errors) and apply()'s rule."""
import pytest
import torch
from torch import nn

import memkernels
from memkernels.fusions.dyt import op as dyt_module
from memkernels.fusions.dyt import reference
from memkernels.fusions.dyt.module import FusedDyT
from memkernels.fusions.dyt.op import dyt
from memkernels.meters import SavedBytesMeter
from memkernels.testing import check_against_reference

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_inputs(leading, hidden, dtype, bias=True, param_dtype=None, alpha_shape=(1,)):
    param_dtype = param_dtype or dtype
    x = (torch.randn(*leading, hidden) * 2).to(dtype).requires_grad_()
    alpha = (torch.rand(alpha_shape) + 0.3).to(param_dtype).requires_grad_()
    weight = torch.randn(hidden).to(param_dtype).requires_grad_()
    b = torch.randn(hidden).to(param_dtype).requires_grad_() if bias else None
    return [x, alpha, weight, b]


def sum_lengths(leading, hidden, bias=True):
    """The parameters' gradients are sums over rows (weight, bias) and over every element (alpha), taken in the
    kernels' order (per program, then over programs), not eager's."""
    rows = 1
    for n in leading:
        rows *= n
    lengths = {"grad inputs[1]": max(rows * hidden, 1), "grad inputs[2]": max(rows, 1)}
    return dict(lengths, **{"grad inputs[3]": max(rows, 1)}) if bias else lengths


# (leading dims, hidden): a model's [batch, seq, hidden]; hidden 1; an odd hidden under one column block; 300
# columns (two column blocks of 256, the second masked); 300 rows (three backward programs of 128 rows, the
# last one short); one row
SHAPES = [((2, 5), 40), ((3,), 1), ((4,), 7), ((2,), 300), ((300,), 24), ((1,), 16)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_eager_in_float64(backend, dtype, shape):
    leading, hidden = shape
    inputs = make_inputs(leading, hidden, dtype)
    check_against_reference(dyt, reference.eager, inputs, name=f"dyt {backend}",
                            sum_length=sum_lengths(leading, hidden))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_without_a_bias_and_with_a_0_dim_alpha(backend, dtype):
    inputs = make_inputs((3, 4), 40, dtype, bias=False, alpha_shape=())
    check_against_reference(dyt, reference.eager, inputs, name=f"dyt {backend} no bias",
                            sum_length=sum_lengths((3, 4), 40, bias=False))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16_bit_x_with_float32_parameters_promotes_as_eager(backend, dtype):
    # Mixed precision without autocast casting the parameters: a [1] float32 alpha promotes x like a tensor, so
    # eager's y is float32, and so is dyt's; x's gradient comes back in x's dtype.
    inputs = make_inputs((2, 5), 40, dtype, param_dtype=torch.float32)
    assert dyt(*inputs).dtype == reference.eager(*inputs).dtype == torch.float32
    check_against_reference(dyt, reference.eager, inputs, name=f"dyt {backend} mixed",
                            sum_length=sum_lengths((2, 5), 40))
    # a 0-dim alpha promotes like a scalar: bf16 until the float32 weight
    inputs = make_inputs((2, 5), 40, dtype, param_dtype=torch.float32, alpha_shape=())
    assert dyt(*inputs).dtype == reference.eager(*inputs).dtype == torch.float32


def test_strided_input_and_an_expanded_gradient(backend):
    wide = torch.randn(6, 2, 40)
    x = wide[:, 1].detach().requires_grad_()  # rows 80 elements apart
    _, alpha, weight, bias = make_inputs((6,), 40, torch.float32)
    check_against_reference(dyt, reference.eager, [x, alpha, weight, bias], name=f"dyt {backend} strided",
                            sum_length=sum_lengths((6,), 40))
    dyt(x, alpha, weight, bias).sum().backward()  # y's gradient expanded from a scalar: stride 0
    expected = [t.detach().requires_grad_() for t in (x, alpha, weight, bias)]
    reference.eager(*expected).sum().backward()
    for got, want in zip((x, alpha, weight, bias), expected):
        torch.testing.assert_close(got.grad, want.grad)


def test_saves_x_alone_where_eager_also_saves_tanh():
    x, alpha, weight, bias = make_inputs((4, 8), 32, torch.float32)
    with SavedBytesMeter() as fused:
        dyt(x, alpha, weight, bias)
    with SavedBytesMeter() as eager:
        reference.eager(x, alpha, weight, bias)
    inputs = sum(t.untyped_storage().nbytes() for t in (x, alpha, weight))
    assert fused.new_bytes == 0 and fused.aliased_bytes == inputs
    assert eager.new_bytes == x.numel() * 4  # tanh(alpha * x), saved by tanh and by the weight's product


def test_frozen_parameters_compute_dx_alone(backend, monkeypatch):
    # LoRA / QLoRA: the parameters need no gradient; the kernel skips their partial sums
    calls = []
    original = dyt_module._backward

    def logged(*args):
        calls.append(args[5:7])  # needs_x, needs_params
        return original(*args)

    monkeypatch.setattr(dyt_module.DYT.steps["backward"], "run", logged)
    x, alpha, weight, bias = make_inputs((3, 5), 24, torch.float32)
    for parameter in (alpha, weight, bias):
        parameter.requires_grad_(False)
    check_against_reference(dyt, reference.eager, [x, alpha, weight, bias], name=f"dyt {backend} frozen")
    assert calls and all(call == (True, False) for call in calls)


def test_parameters_alone_need_gradients(backend):
    x, alpha, weight, bias = make_inputs((3, 5), 24, torch.float32)
    x.requires_grad_(False)
    dyt(x, alpha, weight, bias).square().sum().backward()
    expected = [t.detach().requires_grad_() for t in (alpha, weight, bias)]
    reference.eager(x, *expected).square().sum().backward()
    assert x.grad is None
    for got, want in zip((alpha, weight, bias), expected):
        torch.testing.assert_close(got.grad, want.grad)


def test_one_launch_forward_and_two_backward(backend, monkeypatch):
    if backend != "triton":
        pytest.skip("counts Triton launches")
    launches = []
    for name in ("_dyt_forward_kernel", "_dyt_backward_kernel", "_dyt_reduce_kernel"):
        kernel = getattr(dyt_module, name)

        class Counting:
            def __getitem__(self, grid, kernel=kernel, name=name):
                launches.append((name, grid))
                return kernel[grid]

        monkeypatch.setattr(dyt_module, name, Counting())
    x, alpha, weight, bias = make_inputs((300,), 300, torch.float32)
    y = dyt(x, alpha, weight, bias)
    assert launches == [("_dyt_forward_kernel", (38, 2))]  # 8 rows by 256 columns a program
    y.sum().backward()
    # 128 rows by 256 columns a program; the partials summed 128 columns a program
    assert launches[1:] == [("_dyt_backward_kernel", (3, 2)), ("_dyt_reduce_kernel", (3,))]


def test_no_rows(backend):
    x, alpha, weight, bias = make_inputs((0,), 16, torch.float32)
    y = dyt(x, alpha, weight, bias)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert torch.equal(weight.grad, torch.zeros(16)) and torch.equal(alpha.grad, torch.zeros(1))


def test_float64_on_the_torch_path():
    inputs = make_inputs((3, 4), 8, torch.float64)
    torch.testing.assert_close(dyt(*inputs, backend="torch"), reference.eager(*inputs), rtol=0, atol=1e-14)


def test_compiles_whole_as_custom_ops():
    x, alpha, weight, bias = make_inputs((3, 4), 8, torch.float32)
    compiled = torch.compile(lambda *args: dyt(*args, backend="torch"), backend="aot_eager", fullgraph=True)
    compiled(x, alpha, weight, bias).square().sum().backward()
    expected = [t.detach().requires_grad_() for t in (x, alpha, weight, bias)]
    reference.eager(*expected).square().sum().backward()
    for got, want in zip((x, alpha, weight, bias), expected):
        torch.testing.assert_close(got.grad, want.grad)


def test_meta_tensors_give_shapes_at_once():
    x = torch.empty(2, 5, 16, device="meta", dtype=torch.bfloat16)
    alpha, weight = torch.empty(1, device="meta"), torch.empty(16, device="meta")
    y = dyt(x, alpha, weight)
    assert y.device.type == "meta" and y.shape == x.shape and y.dtype == torch.float32


@pytest.mark.parametrize("change,error,message", [
    (lambda a: a.update(x=torch.tensor(1.0)), ValueError, "x is 0-dimensional"),
    (lambda a: a.update(alpha=torch.ones(2)), ValueError, "alpha has shape (2,); pass one element"),
    (lambda a: a.update(weight=torch.ones(7)), ValueError, "weight has shape (7,) but x's last dimension is 8"),
    (lambda a: a.update(bias=torch.ones(8, 1)), ValueError, "bias has shape (8, 1)"),
    (lambda a: a.update(x=a["x"].long()), TypeError, "x is torch.int64; pass a floating-point tensor"),
    (lambda a: a.update(weight=a["weight"].tolist()), TypeError, "weight must be a torch.Tensor"),
    (lambda a: a.update(alpha=torch.ones(1, device="meta")), ValueError, "alpha is on meta but x is on cpu"),
    (lambda a: a.update(backend="cuda"), ValueError, "backend='cuda' is not supported"),
    (lambda a: a.update(backend="triton", x=a["x"].double()), TypeError,
     "the Triton backend takes float32, float16 or bfloat16"),
    (lambda a: a.update(backend="triton", weight=a["weight"].double()), TypeError,
     "dyt: weight is torch.float64; the Triton backend takes float32, float16 or bfloat16"),
])
def test_bad_input_is_a_clear_error(change, error, message):
    x, alpha, weight, bias = make_inputs((2,), 8, torch.float32)
    arguments = {"x": x, "alpha": alpha, "weight": weight, "bias": bias, "backend": None}
    change(arguments)
    with pytest.raises(error) as raised:
        dyt(arguments.pop("x"), arguments.pop("alpha"), arguments.pop("weight"), arguments.pop("bias"), **arguments)
    assert message in str(raised.value)


# --------------------------------------------------------------------------------------------
# The module and apply()'s rule


class DynamicTanh(nn.Module):
    """The paper's DynamicTanh (github.com/jiachenzhu/DyT), as written there."""

    def __init__(self, normalized_shape, channels_last, alpha_init_value=0.5):
        super().__init__()
        self.normalized_shape = normalized_shape
        self.alpha_init_value = alpha_init_value
        self.channels_last = channels_last
        self.alpha = nn.Parameter(torch.ones(1) * alpha_init_value)
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.bias = nn.Parameter(torch.zeros(normalized_shape))

    def forward(self, x):
        x = torch.tanh(self.alpha * x)
        if self.channels_last:
            x = x * self.weight + self.bias
        else:
            x = x * self.weight[:, None, None] + self.bias[:, None, None]
        return x


class GammaBetaDyT(nn.Module):
    """DyT as Liger names it (alpha, gamma, beta), a 0-dim alpha, the product written the other way round."""

    def __init__(self, hidden):
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(0.5))
        self.gamma = nn.Parameter(torch.ones(hidden))
        self.beta = nn.Parameter(torch.zeros(hidden))

    def forward(self, x):
        return self.gamma * torch.tanh(self.alpha * x) + self.beta


class SigmoidGate(nn.Module):
    """Shaped like a DyT (a scalar and two vectors) but not one: left alone, and not listed."""

    def __init__(self, hidden):
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(0.5))
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden))

    def forward(self, x):
        return self.weight * torch.sigmoid(self.alpha * x) + self.bias


class Block(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = DynamicTanh(hidden, True), GammaBetaDyT(hidden), DynamicTanh(hidden, False)
        self.gate, self.proj = SigmoidGate(hidden), nn.Linear(hidden, hidden)

    def forward(self, x, image):
        return self.gate(self.norm2(self.proj(self.norm1(x)))), self.norm3(image)


def _randomized(module):
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.5 + (0.5 if parameter.numel() == 1 else 0.0))
    return module


def test_fused_dyt_module_matches_dynamic_tanh_and_loads_its_state_dict(backend):
    source = _randomized(DynamicTanh(24, True))
    fused = FusedDyT(24)
    fused.load_state_dict(source.state_dict())
    assert fused.state_dict().keys() == source.state_dict().keys()
    x = torch.randn(3, 5, 24)
    torch.testing.assert_close(fused(x), source(x))
    assert FusedDyT(8, alpha_init_value=0.25).alpha.item() == 0.25 and FusedDyT(8, bias=False).bias is None
    assert "8, alpha_init_value=0.5, bias=True" in repr(FusedDyT(8))


@pytest.mark.parametrize("arguments,error,message", [
    ((0,), ValueError, "hidden_size=0 must be a positive int"),
    ((True,), ValueError, "hidden_size=True must be a positive int"),
    ((8, "0.5"), TypeError, "alpha_init_value='0.5' must be a number"),
])
def test_fused_dyt_module_bad_arguments(arguments, error, message):
    with pytest.raises(error, match=message):
        FusedDyT(*arguments)


def test_apply_fuses_dyt_by_structure_whatever_its_names():
    torch.manual_seed(0)
    model = _randomized(Block()).double()
    unpatched = _randomized(Block()).double()
    unpatched.load_state_dict(model.state_dict())
    keys = list(model.state_dict())
    report = memkernels.apply(model)
    fused = {row["name"]: row["after"] for row in report.replaced}
    assert fused == {"norm1": "MemkernelsDynamicTanh", "norm2": "MemkernelsGammaBetaDyT"}
    skipped = {row["name"]: row["reason"] for row in report.skipped}
    assert "channels first" in skipped["norm3"] and "gate" not in skipped  # a look-alike is not listed
    assert list(model.state_dict()) == keys and model.norm2._memkernels_dyt_roles == ("alpha", "gamma", "beta")

    calls = []
    original = dyt_module.DYT.forward.run
    dyt_module.DYT.forward.run = lambda *args: calls.append(args[-1]) or original(*args)
    try:
        x, image = torch.randn(3, 4, 16, dtype=torch.float64), torch.randn(2, 16, 3, 3, dtype=torch.float64)
        outputs = model(x, image)
    finally:
        dyt_module.DYT.forward.run = original
    assert len(calls) == 2  # norm1 and norm2 through the fused op
    expected = unpatched(x, image)
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    (outputs[0].sum() + outputs[1].sum()).backward()
    (expected[0].sum() + expected[1].sum()).backward()
    for (name, got), want in zip(model.named_parameters(), unpatched.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-10, msg=name)
    assert memkernels.apply(model).replaced == []  # fused already


def test_apply_with_norms_off_leaves_dyt_alone():
    model = Block()
    report = memkernels.apply(model, norms=False)
    assert type(model.norm1) is DynamicTanh and report.replaced == []


def test_a_fused_dyt_falls_back_to_its_own_forward_on_what_dyt_does_not_take():
    # x's last dimension is not the weight's: the original forward runs, and fails as it would have
    model = Block()
    memkernels.apply(model)
    with pytest.raises(RuntimeError, match="size of tensor"):
        model.norm1(torch.randn(2, 5))


def test_the_ledger_counts_dyt_as_a_norm():
    from memkernels.runtime.ledger import categorize
    for type_name in ("DynamicTanh", "FusedDyT", "LigerDyT", "MemkernelsDynamicTanh"):
        assert categorize("layers.0.pre", {"layers.0.pre": type_name}) == "norm"


def test_a_model_with_its_dyt_fused_compiles_whole():
    # torch.compile traces the patched forward (the fallback check, then the custom op) with no graph break
    torch.manual_seed(0)
    model, unpatched = _randomized(Block()), _randomized(Block())
    unpatched.load_state_dict(model.state_dict())
    memkernels.apply(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x, image = torch.randn(3, 4, 16), torch.randn(2, 16, 3, 3)
    outputs, expected = compiled(x, image), unpatched(x, image)
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want)
    (outputs[0].sum() + outputs[1].sum()).backward()
    (expected[0].sum() + expected[1].sum()).backward()
    for (name, got), want in zip(model.named_parameters(), unpatched.parameters()):
        torch.testing.assert_close(got.grad, want.grad, msg=name)
