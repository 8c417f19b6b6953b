"""gated_linear, gated_mlp_recompute and FusedGatedMLP against eager PyTorch in float64, and their memory contract."""
import contextlib
import functools
import gc
import os
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memkernels.fusions.common import act_linear as _act_linear
from memkernels.fusions.gated_mlp import op as gated_module
from memkernels.fusions.gated_mlp.module import FusedGatedMLP
from memkernels.fusions.gated_mlp.op import gated_linear, gated_mlp_recompute
from memkernels.meters import PeakBytesMeter, SavedBytesMeter
from memkernels.testing import check_against_reference

from act_gemm_cases import compile_recording_ops, gemm_sum_lengths, step_log

triton = pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ACTIVATIONS = ["silu", "gelu", "gelu_tanh"]


def act(x, activation):
    if activation == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")


def eager_gated_linear(gate, up, weight, bias, activation="silu"):
    """What a Hugging Face LlamaMLP's down projection computes."""
    return F.linear(act(gate, activation) * up, weight, bias)


def eager_packed(gate_up, weight, bias, activation="silu"):
    gate, up = gate_up.chunk(2, dim=-1)  # Phi-3's split: first half gate
    return F.linear(act(gate, activation) * up, weight, bias)


def fused_gated_linear(gate, up, weight, bias, activation="silu"):
    return gated_linear(gate, up, weight, bias, activation=activation)


def fused_packed(gate_up, weight, bias, activation="silu"):
    return gated_linear(gate_up=gate_up, weight=weight, bias=bias, activation=activation)


def make_inputs(leading, width, out_features, dtype, bias=True, packed=False, requires_grad=True):
    """[gate, up, weight, bias] (or [gate_up, weight, bias]); gate spans silu's and gelu's curved range."""
    gate = torch.randn(*leading, width) * 2
    up = torch.randn(*leading, width)
    weight = torch.randn(out_features, width) * width ** -0.5
    b = torch.randn(out_features) if bias else None
    operands = [torch.cat([gate, up], -1)] if packed else [gate, up]
    tensors = [t if t is None else t.to(dtype).requires_grad_(requires_grad) for t in operands + [weight, b]]
    return tensors


def _functions(packed):
    return (fused_packed, eager_packed) if packed else (fused_gated_linear, eager_gated_linear)


# --------------------------------------------------------------------------------------------
# Output and gradients vs float64


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64(backend, dtype, activation, has_bias, packed):
    fn, eager = _functions(packed)
    inputs = make_inputs((3, 7), 53, 61, dtype, bias=has_bias, packed=packed)
    check_against_reference(fn, eager, inputs, kwargs={"activation": activation}, sum_length=gemm_sum_lengths(inputs))


def eager_with_adapter(gate, up, weight, bias, adapter, activation="silu"):
    """A peft LoRA down projection's two GEMMs: the base on c, lora_A on c cast to the adapter's dtype."""
    product = act(gate, activation) * up
    return F.linear(product, weight, bias), F.linear(product.to(adapter.dtype), adapter)


def fused_with_adapter(gate, up, weight, bias, adapter, activation="silu"):
    return gated_linear(gate, up, weight, bias, activation=activation, adapter=adapter)


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("dtype, adapter_dtype, activation", [
    (torch.float32, torch.float32, "silu"), (torch.bfloat16, torch.float32, "silu"),
    (torch.float16, torch.float16, "gelu_tanh"), (torch.bfloat16, torch.bfloat16, "gelu")], ids=str)
def test_adapter_on_the_same_product_matches_float64(backend, dtype, adapter_dtype, activation, packed):
    """gated_linear(adapter=A): y and t = c @ A.T (A a LoRA down_proj's lora_A, float32 beside a half base as peft
    keeps it) from one c, and every gradient (gate, up, W, b, A), against eager's two GEMMs in float64."""
    inputs = make_inputs((3, 11), 53, 61, dtype, packed=packed)
    adapter = (torch.randn(6, 53) * 53 ** -0.5).to(adapter_dtype).requires_grad_()
    *operands, weight, bias = inputs
    if packed:
        fn = lambda gate_up, w, b, a, activation: gated_linear(gate_up=gate_up, weight=w, bias=b,  # noqa: E731
                                                                activation=activation, adapter=a)
        eager = lambda gate_up, w, b, a, activation: eager_with_adapter(*gate_up.chunk(2, -1), w, b, a,  # noqa: E731
                                                                         activation)
    else:
        fn, eager = fused_with_adapter, eager_with_adapter
    lengths = gemm_sum_lengths(inputs)
    lengths.update({"output[1]": 53, "grad inputs[%d]" % (len(operands) + 2): 33})  # t: I terms; dA: M tokens
    for index in range(len(operands)):  # dc sums the base's N terms and the adapter's rank
        lengths[f"grad inputs[{index}]"] = 61 + 6
    check_against_reference(fn, eager, [*operands, weight, bias, adapter], kwargs={"activation": activation},
                            sum_length=lengths)


def test_adapter_arguments_are_checked():
    gate, up, weight, bias = make_inputs((4,), 8, 5, torch.float32)
    with pytest.raises(ValueError, match=r"adapter must be a LoRA A weight of shape \[rank, intermediate_size=8\]"):
        gated_linear(gate, up, weight, bias, adapter=torch.randn(3, 7))
    with pytest.raises(ValueError, match="adapter must be a floating tensor"):
        gated_linear(gate, up, weight, bias, adapter=torch.ones(3, 8, dtype=torch.int64))


# (leading dims, I, out features): every compared tensor has ~30+ elements (see test_gelu_linear.py)
SHAPES = [
    ((1,), 131, 67),  # one token
    ((40,), 1, 31),  # I = 1
    ((2, 31), 127, 129),  # just under and over a power of two
    ((3, 43), 130, 70),  # M = 129: several row blocks
    ((37,), 33, 1),  # N = 1
    ((33,), 56, 16),  # Llama-3's I / H = 14336 / 4096 = 3.5
    ((33,), 128, 16),  # Gemma's I / H = 24576 / 3072 = 8
    ((33,), 87, 16),  # Qwen2-0.5B's I / H = 4864 / 896 = 5.43
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[0] + s[1:])))
@pytest.mark.parametrize("dtype, activation, packed", [(torch.float32, "silu", False),
                                                       (torch.bfloat16, "gelu_tanh", True),
                                                       (torch.float16, "gelu", False)], ids=str)
def test_shapes_match_float64(backend, dtype, activation, packed, shape):
    fn, eager = _functions(packed)
    inputs = make_inputs(*shape, dtype, packed=packed)
    check_against_reference(fn, eager, inputs, kwargs={"activation": activation}, sum_length=gemm_sum_lengths(inputs))


# The down projection of real models (H out, I = ratio * H in), a few tokens: the interpreter is slow.
MODEL_WIDTH_CASES = [(torch.bfloat16, "silu", 512, 1792), (torch.float16, "gelu_tanh", 256, 2048),
                     (torch.float32, "silu", 384, 2072)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype, activation, hidden, width", MODEL_WIDTH_CASES, ids=str)
def test_matches_float64_model_widths(backend, dtype, activation, hidden, width):
    inputs = make_inputs((3,), width, hidden, dtype)
    check_against_reference(fused_gated_linear, eager_gated_linear, inputs, kwargs={"activation": activation},
                            sum_length=gemm_sum_lengths(inputs))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_operands(backend, dtype):
    # gate and up with different layouts (a slice and a transposed view), the weight transposed
    gate = (torch.randn(6, 80) * 2).to(dtype)[:, 3:50].requires_grad_()
    up = torch.randn(47, 6).to(dtype).t().requires_grad_()
    weight = (torch.randn(47, 29) * 47 ** -0.5).to(dtype).t().requires_grad_()
    bias = torch.randn(29).to(dtype).requires_grad_()
    assert not gate.is_contiguous() and not up.is_contiguous() and not weight.is_contiguous()
    check_against_reference(fused_gated_linear, eager_gated_linear, [gate, up, weight, bias],
                            sum_length=gemm_sum_lengths([gate, up, weight, bias]))


def eager_mlp(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, activation="silu"):
    if up_weight is None:
        gate, up = F.linear(x, gate_weight, gate_bias).chunk(2, dim=-1)
    else:
        gate, up = F.linear(x, gate_weight, gate_bias), F.linear(x, up_weight, up_bias)
    return F.linear(act(gate, activation) * up, down_weight, down_bias)


def recompute_mlp(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, activation="silu",
                  chunk_size=None):
    return gated_mlp_recompute(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias,
                               activation=activation, chunk_size=chunk_size)


# 34 tokens: one chunk; chunks of 5 (even split: 7 chunks, the last of 4); of 16 (12, 12, 10)
@pytest.mark.parametrize("chunk_size", [None, 5, 16], ids=["whole", "chunks5", "chunks16"])
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype, activation", [(torch.float32, "silu"), (torch.float16, "gelu"),
                                               (torch.bfloat16, "gelu_tanh")], ids=str)
def test_recompute_matches_float64(backend, dtype, activation, has_bias, packed, chunk_size):
    """Outputs and every gradient against float64, whole and in token chunks (the chunked weight and bias
    gradients summed in float32: no less accurate than eager's one GEMM)."""
    hidden, width = 24, 61

    def param(*shape, scale=1.0):
        return (torch.randn(*shape) * scale).to(dtype).requires_grad_()

    x = param(2, 17, hidden)
    gate_weight = param(2 * width if packed else width, hidden, scale=hidden ** -0.5)
    up_weight = None if packed else param(width, hidden, scale=hidden ** -0.5)
    gate_bias = param(gate_weight.shape[0]) if has_bias else None
    up_bias = param(width) if has_bias and not packed else None
    down_weight, down_bias = param(hidden, width, scale=width ** -0.5), param(hidden) if has_bias else None
    check_against_reference(functools.partial(recompute_mlp, chunk_size=chunk_size), eager_mlp,
                            [x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias],
                            kwargs={"activation": activation}, name=f"gated_mlp_recompute(chunk_size={chunk_size})")


@pytest.mark.parametrize("needed", [(True, False, False, False), (False, True, False, False),
                                    (False, False, True, False), (False, False, False, True)],
                         ids=["gate", "up", "weight", "bias"])
def test_backward_computes_only_needed_grads(backend, needed, monkeypatch):
    gate, up, weight, bias = make_inputs((9,), 24, 40, torch.float32)
    for tensor, needs in zip((gate, up, weight, bias), needed):
        tensor.requires_grad_(needs)
    y = gated_linear(gate, up, weight, bias)
    with step_log(monkeypatch, gated_module.GATED_LINEAR, matmuls=True) as log:
        y.backward(torch.ones_like(y))
    # d_gate and d_up need dy @ W; dW needs dy.T @ c; the bias gradient is a sum: no step at all
    needs_inputs, needs_weight = needed[0] or needed[1], needed[2]
    expected = ([("gated_linear_backward", backend)] if needs_inputs or needs_weight else []) + ["mm"] * (
        needs_inputs + needs_weight)
    assert log == expected
    assert (gate.grad is not None, up.grad is not None, weight.grad is not None, bias.grad is not None) == needed


def test_recompute_runs_two_extra_gemms_not_three(backend, monkeypatch):
    # backward recomputes gate and up (two GEMMs), never the down projection's forward
    module = FusedGatedMLP(16, 40, recompute=True)
    x = torch.randn(5, 16, requires_grad=True)
    y = module(x)
    with step_log(monkeypatch, gated_module.GATED_LINEAR, matmuls=True) as log:
        y.backward(torch.ones_like(y))
    assert log == ["mm", "mm",  # gate and up recomputed
                   ("gated_linear_backward", backend), "mm", "mm",  # dy @ W and dW: no forward GEMM
                   "mm", "mm", "mm", "mm"]  # dx and dW of gate, of up (the two dx summed as eager's autograd does)


def test_recompute_in_chunks_runs_the_same_gemms_a_chunk(backend, monkeypatch):
    # 5 tokens in chunks of 2, 2 and 1: per chunk gate and up recomputed, the down projection's backward keeping
    # the product, and every weight gradient added into its buffer (addmm_), dx written row block by row block
    module = FusedGatedMLP(16, 40, recompute=True)
    x = torch.randn(5, 16, requires_grad=True)
    weights = (module.gate_proj, module.up_proj, module.down_proj)
    y = gated_mlp_recompute(x, *_projection_arguments(weights), chunk_size=2)
    with step_log(monkeypatch, gated_module.GATED_LINEAR, matmuls=True) as log:
        y.backward(torch.ones_like(y))
    chunk = ["mm", "mm",  # gate and up recomputed
             ("gated_linear_backward_product", backend), "mm",  # dy @ W, then c over it
             "addmm_",  # dW of down += dy.T @ c
             "mm", "addmm_",  # dx of gate into its rows, dW of gate +=
             "addmm_", "addmm_"]  # dx of up added, dW of up +=
    assert log == chunk * 3


# --------------------------------------------------------------------------------------------
# The algorithm: cuBLAS GEMMs with one elementwise pass each way, in chunks where the product is large


@contextlib.contextmanager
def pass_log(monkeypatch, backend, collect=False):
    """Yields a list recording, in order, the elementwise passes (``"product"``, ``"product_backward"``)
    and the aten matmuls run inside the block. ``collect``: a gc.collect() after each pass, for peak
    measurements: the Triton interpreter keeps a launch's arguments in a reference cycle until the
    collector runs, which a compiled launch on a GPU does not."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []
    passes = _act_linear.PASSES[backend]

    def recorded(name):
        run = getattr(passes, name)

        def wrapper(*args):
            calls.append(name)
            result = run(*args)
            if collect:
                gc.collect()
            return result
        return wrapper

    monkeypatch.setitem(_act_linear.PASSES, backend, types.SimpleNamespace(
        product=recorded("product"), product_backward=recorded("product_backward")))

    class MatmulLog(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("mm", "addmm"):
                calls.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    with MatmulLog():
        yield calls


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_one_pass_around_the_gemms_each_way(backend, monkeypatch, packed):
    inputs = make_inputs((9,), 24, 40, torch.float32, packed=packed)
    fused = _functions(packed)[0]
    with pass_log(monkeypatch, backend) as forward:
        y = fused(*inputs)
    assert forward == ["product", "addmm"]  # c, then F.linear(c, W, b)
    with pass_log(monkeypatch, backend) as backward:
        y.backward(torch.ones_like(y))
    assert backward == ["mm", "product_backward", "mm"]  # dy @ W; d_gate, d_up and c; dy.T @ c


def test_chunk_sizes_keep_the_gemms_large():
    # Llama-3-8B's MLP in bf16 at 65,536 tokens: c would be 1.75 GiB
    rows, width = 65536, 14336
    assert _act_linear._chunk(rows, width, 2, _act_linear.MIN_CHUNK_ROWS) == 37449  # 1 GiB of rows
    assert _act_linear._chunk(width, rows, 2, _act_linear.MIN_SLAB_COLS) == 8192  # 1 GiB of columns
    assert _act_linear._chunk(8192, width, 2, _act_linear.MIN_CHUNK_ROWS) == 8192  # fits: one chunk
    # a wider product than the threshold allows still gets MIN_CHUNK_ROWS rows a GEMM
    assert _act_linear._chunk(1 << 20, 1 << 20, 2, _act_linear.MIN_CHUNK_ROWS) == _act_linear.MIN_CHUNK_ROWS


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_large_products_run_in_chunks_whose_results_are_final(backend, monkeypatch, dtype, packed):
    # c is 37 x 50: a threshold of a third of it gives forward chunks of 10 rows and backward slabs of
    # 16 columns (the minimums below), so every chunk boundary and a ragged last chunk are crossed
    monkeypatch.setattr(_act_linear, "TRANSIENT_BYTES", 37 * 50 * dtype.itemsize // 3)
    monkeypatch.setattr(_act_linear, "MIN_CHUNK_ROWS", 10)
    monkeypatch.setattr(_act_linear, "MIN_SLAB_COLS", 16)
    inputs = make_inputs((37,), 50, 29, dtype, packed=packed)
    fused, eager = _functions(packed)
    check_against_reference(fused, eager, inputs, sum_length=gemm_sum_lengths(inputs))
    with pass_log(monkeypatch, backend) as log:
        y = fused(*inputs)
        y.backward(torch.ones_like(y))
    chunks, slabs = 4, 4  # rows 10+10+10+7, columns 16+16+16+2
    assert log == ["product", "addmm"] * chunks + ["mm", "product_backward", "mm"] * slabs


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_peak_of_forward_and_backward_within_eager(backend, monkeypatch, dtype, packed):
    """Forward + backward of the down projection, every buffer counted (PeakBytesMeter): eager keeps
    act(gate) and the product to the end of forward and four I-wide tensors in backward; the fused op
    holds one transient product in forward and one I-wide buffer beside the gradients in backward."""
    from memkernels.fusions.common import act_linear_reference as reference

    monkeypatch.setattr(reference, "_BLOCK_ELEMENTS", 1 << 12)  # the torch path's float32 blocks: 1/64 of c
    inputs = make_inputs((512,), 512, 64, dtype, bias=False, packed=packed)
    grad = torch.randn(512, 64).to(dtype)
    fused, eager = _functions(packed)

    def peak(fn, collect=False):
        for tensor in inputs[:-1]:
            tensor.grad = None
        with pass_log(monkeypatch, backend, collect) if collect else contextlib.nullcontext(), \
                PeakBytesMeter() as meter:
            fn(*inputs).backward(grad)
        return meter.peak_bytes

    unit = 512 * 512 * dtype.itemsize  # one I-wide tensor
    fused_peak, eager_peak = peak(fused, collect=True), peak(eager)
    # three I-wide tensors at the peak against eager's four; the torch path's float32 blocks (up to
    # 0.35 of a unit in bf16 here) take some of that margin
    assert fused_peak <= eager_peak - unit / 2, (fused_peak / unit, eager_peak / unit)


def test_empty_batch(backend):
    gate, up, weight, bias = make_inputs((0,), 16, 8, torch.float32)
    y = gated_linear(gate, up, weight, bias)
    y.sum().backward()
    assert y.shape == (0, 8)
    assert torch.equal(weight.grad, torch.zeros_like(weight)) and torch.equal(bias.grad, torch.zeros_like(bias))


@pytest.mark.parametrize("op", ["gated_linear", "packed", "recompute", "recompute_chunked", "gelu_linear"])
def test_outputs_may_be_modified_in_place(op):
    """The output [2, 5, 8] (float64) is the op's own tensor, not a view made inside it, so autograd takes an
    in-place add into it (Llama-4's MoE adds its routed experts into the shared expert's output) and gives the
    gradients of the out-of-place add."""
    from memkernels.functional import gelu_linear

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=generator, dtype=torch.float64).requires_grad_()
    gate_up_weight = torch.randn(12, 8, generator=generator, dtype=torch.float64).requires_grad_()
    down = torch.randn(8, 6, generator=generator, dtype=torch.float64).requires_grad_()
    square = torch.randn(8, 8, generator=generator, dtype=torch.float64).requires_grad_()
    residual = torch.randn(2, 5, 8, generator=generator, dtype=torch.float64)
    ops = {"gated_linear": lambda: gated_linear(*(x @ gate_up_weight.t()).chunk(2, -1), down),
           "packed": lambda: gated_linear(gate_up=x @ gate_up_weight.t(), weight=down),
           "recompute": lambda: gated_mlp_recompute(x, gate_up_weight, None, None, None, down, None),
           "recompute_chunked": lambda: gated_mlp_recompute(x, gate_up_weight, None, None, None, down, None,
                                                            chunk_size=4),
           "gelu_linear": lambda: gelu_linear(x, square)}
    leaves = (x, gate_up_weight, square if op == "gelu_linear" else down)

    def grads(in_place):
        out = ops[op]()
        assert out._base is None and out.shape == residual.shape
        out = out.add_(residual) if in_place else out + residual
        return torch.autograd.grad((out * residual).sum(), leaves, allow_unused=op == "gelu_linear")

    for got, expected in zip(grads(True), grads(False)):
        assert (got is None and expected is None) or torch.equal(got, expected)


# --------------------------------------------------------------------------------------------
# Memory contract, measured


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_linear_saves_only_gate_and_up(backend, dtype, packed):
    tokens, width = 100, 96
    inputs = make_inputs((4, 25), width, 40, dtype, packed=packed)
    fn, eager = _functions(packed)
    # gate and up are made inside the metered region, as an MLP's projections make them
    operands = [t.detach().requires_grad_() for t in inputs]
    with SavedBytesMeter() as saved:
        activations = [t * 1 for t in operands[:-2]]
        y = fn(*activations, *operands[-2:])
    element = torch.finfo(dtype).bits // 8
    assert saved.bytes_per_token(tokens) == 2 * width * element  # gate and up
    y.sum().backward()
    with SavedBytesMeter() as saved_eager:
        eager(*[t * 1 for t in operands[:-2]], *operands[-2:])
    # eager: gate (saved by act), up and act(gate) (by the mul), the product (by the Linear);
    # the packed form's chunk views gate and up in one storage, the same bytes
    assert saved_eager.bytes_per_token(tokens) == 4 * width * element


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_gated_mlp_saved_bytes(backend, dtype, packed):
    tokens, hidden, width = 30, 16, 64
    element = torch.finfo(dtype).bits // 8
    x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    for recompute, expected in ((False, 2 * width * element), (True, 0)):
        mlp = FusedGatedMLP(hidden, width, recompute=recompute, packed=packed, dtype=dtype)
        with SavedBytesMeter() as saved:
            mlp(x)
        assert saved.bytes_per_token(tokens) == expected, recompute
        # what it holds beyond that is the caller's x and the parameters
        held = sorted(r["nbytes"] for r in saved.records if not r["new"])
        assert held == sorted([x.nbytes] + [p.nbytes for p in mlp.parameters() if p.dim() == 2]), recompute


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_recompute_in_chunks_holds_one_chunks_tensors_whatever_the_length(dtype, packed):
    """Over twice the tokens, chunk by chunk, the forward's peak grows by exactly the larger output and the
    backward's by exactly the larger grad_x: the I-wide tensors held (gate, up, their gradients, the product)
    are one chunk's. Run whole, the same inputs' peaks grow by several I-wide tensors of the extra tokens.
    The torch backend: the buffers are the shared algorithm's (memkernels/fusions/common/act_linear.py) on both, and the
    interpreter's own copies of a launch's arguments would need a gc.collect() after every pass."""
    hidden, width, chunk = 16, 256, 32
    element = torch.finfo(dtype).bits // 8

    def peaks(tokens, chunk_size):
        torch.manual_seed(0)
        mlp = FusedGatedMLP(hidden, width, recompute=True, packed=packed, dtype=dtype)
        x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
        grad = torch.randn(tokens, hidden, dtype=dtype)
        weights = (mlp.gate_up_proj, mlp.down_proj) if packed else (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        with PeakBytesMeter() as forward:
            y = gated_mlp_recompute(x, *_projection_arguments(weights), activation="silu", backend="torch",
                                    chunk_size=chunk_size)
        with PeakBytesMeter() as backward:
            y.backward(grad)
        return forward.peak_bytes, backward.peak_bytes

    short, long = peaks(2 * chunk, chunk), peaks(4 * chunk, chunk)
    assert long[0] - short[0] == 2 * chunk * hidden * element  # y
    assert long[1] - short[1] == 2 * chunk * hidden * element  # grad_x
    whole_short, whole_long = peaks(2 * chunk, None), peaks(4 * chunk, None)
    assert whole_long[1] - whole_short[1] >= 2 * chunk * hidden * element + 2 * chunk * 4 * width * element
    assert long[1] < whole_long[1]


def _projection_arguments(linears):
    """gated_mlp_recompute's weight and bias arguments from (gate, up, down) or (gate_up, down) nn.Linears."""
    *projections, down = linears
    gate, up = projections if len(projections) == 2 else (projections[0], None)
    return (gate.weight, gate.bias, None if up is None else up.weight, None if up is None else up.bias,
            down.weight, down.bias)


# --------------------------------------------------------------------------------------------
# Modules


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_fused_gated_mlp_matches_float64(backend, packed, recompute):
    mlp = FusedGatedMLP(24, 70, activation="gelu_tanh", bias=True, recompute=recompute, packed=packed)
    names = [name for name, _ in mlp.named_parameters()]

    def fused(x, *params):
        return torch.func.functional_call(mlp, dict(zip(names, params)), (x,))

    def eager(x, *params):
        p = dict(zip(names, params))
        if packed:
            gate, up = F.linear(x, p["gate_up_proj.weight"], p["gate_up_proj.bias"]).chunk(2, dim=-1)
        else:
            gate = F.linear(x, p["gate_proj.weight"], p["gate_proj.bias"])
            up = F.linear(x, p["up_proj.weight"], p["up_proj.bias"])
        return F.linear(F.gelu(gate, approximate="tanh") * up, p["down_proj.weight"], p["down_proj.bias"])

    x = torch.randn(2, 5, 24, requires_grad=True)
    params = [p.detach().clone().requires_grad_() for p in mlp.parameters()]
    check_against_reference(fused, eager, [x, *params], name="FusedGatedMLP")


def _hf_mlp(kind):
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=16, intermediate_size=40, num_attention_heads=2, num_key_value_heads=2)
    if kind == "llama":
        from transformers.models.llama.modeling_llama import LlamaMLP
        return LlamaMLP(transformers.LlamaConfig(**common))
    if kind == "gemma":
        from transformers.models.gemma.modeling_gemma import GemmaMLP
        return GemmaMLP(transformers.GemmaConfig(**common))
    from transformers.models.phi3.modeling_phi3 import Phi3MLP
    return Phi3MLP(transformers.Phi3Config(**common))


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
@pytest.mark.parametrize("kind, activation", [("llama", "silu"), ("gemma", "gelu_tanh"), ("phi3", "silu")])
def test_from_module_shares_parameters_and_matches(kind, activation, recompute):
    # float64 runs on the torch backend (the default on CPU); both backends' numerics are checked above
    hf = _hf_mlp(kind)
    fused = FusedGatedMLP.from_module(hf, recompute=recompute)
    assert fused.activation == activation and fused.packed == (kind == "phi3")
    assert list(fused.state_dict()) == [k for k in hf.state_dict()]
    assert all(a is b for a, b in zip(fused.parameters(), hf.parameters()))
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(fused.double()(x), hf.double()(x))


def test_from_module_rejects_what_it_cannot_fuse():
    mlp = FusedGatedMLP(8, 16)
    mlp.act_fn = nn.ReLU()
    with pytest.raises(TypeError, match="activation ReLU is not SiLU or GELU"):
        FusedGatedMLP.from_module(mlp)
    with pytest.raises(TypeError, match="is not a gated MLP"):
        FusedGatedMLP.from_module(nn.Linear(4, 4))
    mlp.act_fn = nn.SiLU()
    mlp.down_proj = nn.Identity()
    with pytest.raises(TypeError, match="down_proj must be an nn.Linear, got Identity"):
        FusedGatedMLP.from_module(mlp)


# --------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_names_the_argument():
    gate, up, weight, bias = make_inputs((3,), 8, 5, torch.float32)
    with pytest.raises(ValueError, match="intermediate size mismatch: gate and up have 8"):
        gated_linear(gate, up, weight[:, :7], bias)
    with pytest.raises(ValueError, match="gate has shape \\(3, 8\\) but up \\(3, 7\\)"):
        gated_linear(gate, up[:, :7], weight, bias)
    with pytest.raises(ValueError, match="weight is on meta"):
        gated_linear(gate, up, weight.to("meta"), bias)
    with pytest.raises(ValueError, match="up is torch.float16"):
        gated_linear(gate, up.half(), weight, bias)
    with pytest.raises(ValueError, match="bias has shape"):
        gated_linear(gate, up, weight, bias[:4])
    with pytest.raises(ValueError, match="activation='relu'"):
        gated_linear(gate, up, weight, bias, activation="relu")
    with pytest.raises(ValueError, match="not both"):
        gated_linear(gate, up, weight, gate_up=torch.cat([gate, up], -1))
    with pytest.raises(ValueError, match="an even last dim"):
        gated_linear(gate_up=gate[:, :7], weight=weight)
    with pytest.raises(ValueError, match="intermediate size mismatch: gate and up have 4"):
        gated_linear(gate_up=gate, weight=weight)
    with pytest.raises(ValueError, match="backend='cuda'"):
        gated_linear(gate, up, weight, backend="cuda")
    with pytest.raises(ValueError, match="gate and up must be tensors"):
        gated_linear(gate, None, weight)
    with pytest.raises(ValueError, match="up_weight must be \\[intermediate_size, hidden_size=8\\]"):
        gated_mlp_recompute(gate, weight, None, weight.t(), None, weight, None)
    with pytest.raises(ValueError, match="activation='swish'"):
        FusedGatedMLP(4, 8, activation="swish")


def test_triton_backend_rejects_a_device_it_cannot_run_on():
    gate, up, weight, bias = (t.detach().to("meta") for t in make_inputs((3,), 8, 5, torch.float32))
    with pytest.raises(ValueError, match="backend='triton' cannot run on meta"):
        gated_linear(gate, up, weight, bias, backend="triton")


# --------------------------------------------------------------------------------------------
# torch.library registration


def test_custom_ops_pass_opcheck(backend):
    gate, up, weight, bias = make_inputs((6,), 20, 12, torch.float32, requires_grad=False)
    grad_out = torch.randn(6, 12)
    ops = torch.ops.memkernels
    torch.library.opcheck(ops.gated_linear.default, (gate, up, weight, bias, "silu", backend))
    torch.library.opcheck(ops.gated_linear.default, (gate, up, weight, None, "gelu", backend))
    for packed, needs_inputs, needs_weight, activation in ((False, True, True, "gelu_tanh"),
                                                           (True, True, False, "silu"), (False, False, True, "gelu")):
        torch.library.opcheck(ops.gated_linear_backward.default,
                              (grad_out, gate, up, weight, packed, needs_inputs, needs_weight, activation, backend))


@pytest.mark.parametrize("recompute", [False, True, "chunks"], ids=["saved", "recompute", "recompute-chunks"])
def test_torch_compile_fullgraph(backend, recompute, monkeypatch):
    if recompute == "chunks":  # 10 tokens in chunks of 4, 3 and 3
        monkeypatch.setattr(gated_module, "CHUNK_TOKENS", 4)
    mlp = FusedGatedMLP(24, 40, recompute=bool(recompute), packed=bool(recompute))
    compiled, graph_ops = compile_recording_ops(mlp)
    x = torch.randn(2, 5, 24, requires_grad=True)
    y = compiled(x)
    y.backward(torch.ones_like(y))
    expected_grad = torch.autograd.grad(mlp(x).sum(), x)[0]
    torch.testing.assert_close(x.grad, expected_grad)
    assert "memkernels.gated_linear.default" in graph_ops["forward"]
    backward_step = "gated_linear_backward_product" if recompute == "chunks" else "gated_linear_backward"
    assert f"memkernels.{backward_step}.default" in graph_ops["backward"]
    assert not any("silu" in op for ops in graph_ops.values() for op in ops)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_meta_peaks_equal_the_cpus_to_the_byte_every_call(dtype, activation):
    """The planner profiles on meta: gated_linear's torch path must allocate there what it allocates on the CPU.
    Meta walks one row block (the CPU walks eight here); from the second call on, a block of that shape is one
    allocation of the first call's measured peak (act_linear_reference._meta_block): the same bytes."""
    from memkernels.fusions.common import act_linear_reference

    tokens, width, hidden = 512, 1024, 64  # 64-row blocks of 1024 columns

    def peaks(device):
        torch.manual_seed(0)
        gate, up = (torch.randn(tokens, width).to(dtype).to(device).requires_grad_() for _ in range(2))
        weight = torch.randn(hidden, width).to(dtype).to(device).requires_grad_()
        grad = torch.randn(tokens, hidden).to(dtype).to(device)
        with PeakBytesMeter() as forward:
            y = gated_linear(gate, up, weight, activation=activation, backend="torch")
        with PeakBytesMeter() as backward:
            y.backward(grad)
        return forward.peak_bytes, backward.peak_bytes

    act_linear_reference._META_BLOCK_PEAKS.clear()
    cpu = peaks("cpu")
    assert peaks("meta") == cpu  # measured
    assert act_linear_reference._META_BLOCK_PEAKS  # the blocks' peaks, kept
    assert peaks("meta") == cpu  # from the kept peaks
