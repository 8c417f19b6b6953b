"""memkernels/fusions/op_spec.py: each op is a custom op under torch.compile and its
autograd.Function twin in eager mode, with one formula for both.

The twin exists for host time (a custom op's dispatch cost ~60 us per norm forward + backward;
benchmarks/bench_rms_norm.py prints the split on a GPU), so these tests pin what keeps it cheap
and equal: eager calls dispatch no memkernels op, the Functions define no separate setup_context
(Function.apply would bind every call's arguments through inspect.signature), and the custom op's
registered autograd gives the same gradients, bit for bit, as the twin.
"""
import importlib
import pkgutil

import pytest
import torch
from torch.autograd.function import _is_setup_context_defined
from torch.utils._python_dispatch import TorchDispatchMode

import memkernels.fusions
from memkernels.fusions.common import act_mul as act_mul_module
from memkernels.fusions.gated_mlp.op import gated_linear
from memkernels.fusions.gelu_mlp.op import gelu_linear
from memkernels.fusions.loss.cross_entropy import cross_entropy
from memkernels.fusions.norm.layer_norm import add_layer_norm
from memkernels.fusions.norm.op import NORM
from memkernels.fusions.norm.rms_norm import rms_norm
from memkernels.fusions.op_spec import SPECS

for _module in pkgutil.walk_packages(memkernels.fusions.__path__, "memkernels.fusions."):  # declares every op
    importlib.import_module(_module.name)
TWINS = {name: spec.function for name, spec in SPECS.items()}


def test_every_op_is_declared_through_an_op_spec():
    """Every memkernels:: custom op is a step of an OpSpec (none registered by hand), over a floor of the
    ops memkernels ships (a new op adds itself to SPECS)."""
    assert {"norm", "cross_entropy", "linear_cross_entropy_recompute", "linear_cross_entropy_chunked",
            "linear_logprobs", "gelu_linear", "gated_linear", "grouped_gated_linear", "act_mul", "rope", "dyt"} <= set(SPECS)
    registered = {name for name in torch._C._dispatch_get_all_op_names() if name.startswith("memkernels::")}
    declared = {step.name for spec in SPECS.values() for step in spec.all_steps.values()}
    # the one helper: a GEMM with a float32 result (common/half_gemm.py), no autograd, called inside steps
    assert registered - declared == {"memkernels::addmm_float32_"}, "registered outside an OpSpec"
    assert declared <= registered


@pytest.mark.parametrize("name", TWINS)
def test_the_eager_twin_sets_its_context_up_inside_forward(name):
    assert not _is_setup_context_defined(TWINS[name].setup_context), (
        f"{name}: a separate setup_context makes Function.apply call inspect.signature on every call")


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(f"{func.namespace}::{func._opname}")
        return func(*args, **(kwargs or {}))


def test_eager_calls_dispatch_no_custom_op():
    x = torch.randn(6, 16, requires_grad=True)
    weight = torch.randn(16, requires_grad=True)
    logits = torch.randn(6, 11, requires_grad=True)
    target = torch.randint(0, 11, (6,))
    down = torch.randn(5, 16, requires_grad=True)
    with _Ops() as seen:
        rms_norm(x, weight).sum().backward()
        y, _ = add_layer_norm(x, x.detach(), weight)
        y.sum().backward()
        cross_entropy(logits, target).backward()
        gelu_linear(x, down, backend="torch").sum().backward()
        gated_linear(x, x * 2, down, backend="torch").sum().backward()
        act_mul_module.silu_mul(x, x * 2).sum().backward()
    memkernels_ops = [name for name in seen.names if name.startswith("memkernels::")]
    assert not memkernels_ops and "aten::mul" in seen.names  # the implementations ran, op by op


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_the_custom_op_and_its_twin_give_the_same_gradients(memory_efficient, in_place):
    torch.manual_seed(0)
    x = torch.randn(5, 24, dtype=torch.float64)
    residual = torch.randn(5, 24, dtype=torch.float64)
    weight = torch.randn(24, dtype=torch.float64)
    bias = torch.randn(24, dtype=torch.float64)
    grad = torch.randn(5, 24, dtype=torch.float64)
    args = (1e-6, 0.0, False, 1, memory_efficient, in_place, "torch")

    def run(call):
        leaves = [t.clone().requires_grad_() for t in (x, residual, weight, bias)]
        y, residual_out, *_ = call(*leaves, *args)
        (y * grad).sum().backward(retain_graph=True)
        return [y.detach(), residual_out.detach()] + [leaf.grad for leaf in leaves]

    through_op = run(NORM.custom_op)
    through_twin = run(NORM.function.apply)
    for a, b in zip(through_op, through_twin):
        assert torch.equal(a, b)


def test_norms_on_meta_take_the_custom_op_and_its_fake():
    """the planner profiles models on ``meta``: the norm's fake gives the kernels' outputs at
    once, where its PyTorch path would loop over row blocks of shapes alone (seconds per layer)."""
    x = torch.randn(6, 16, device="meta", requires_grad=True)
    weight = torch.randn(16, device="meta", requires_grad=True)
    with _Ops() as seen:
        rms_norm(x, weight).sum().backward()
    assert {"memkernels::norm_fwd", "memkernels::norm_bwd"} <= set(seen.names)
    assert x.grad.shape == x.shape and weight.grad.shape == weight.shape


def test_a_double_backward_raises_as_through_the_custom_op():
    """The kernels compute no second derivative: a double backward must fail loudly, not drop the
    norm's or the loss's second-order terms from a sum that has others (a gradient penalty)."""
    x = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(8, requires_grad=True)
    logits = torch.randn(4, 5, requires_grad=True)
    target = torch.randint(0, 5, (4,))
    down = torch.randn(3, 8, requires_grad=True)
    for output, leaf in ((rms_norm(x, weight).pow(2).sum(), x), (cross_entropy(logits, target), logits),
                         (gelu_linear(x, down, backend="torch").pow(2).sum(), x),
                         (gated_linear(x, x, down, backend="torch").pow(2).sum(), x)):
        grad, = torch.autograd.grad(output, leaf, create_graph=True)
        with pytest.raises(RuntimeError, match="has no second derivative"):
            (grad.sum() + leaf.pow(2).sum()).backward()


class _EmptyOutputs(TorchDispatchMode):
    """Records the ops whose output is a tensor with no elements."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() == 0:
            self.names.append(f"{func.namespace}::{func._opname}")
        return out


@pytest.mark.parametrize("norm", ["rms_norm", "add_layer_norm"])
def test_an_eager_norm_step_allocates_no_placeholder(norm):
    """Absent outputs (mean of an RMSNorm, residual_out without a residual, the memory_efficient
    columns and fallback, gradients not asked for) are None on the eager path: six zero-size
    placeholders a step cost ~16 us of host time, 15% of a small FusedRMSNorm step's (issue 31.2).
    The custom op still returns tensors (its schema has no None), which the eager path never calls."""
    x = torch.randn(6, 16, requires_grad=True)
    residual = torch.randn(6, 16)
    weight = torch.randn(16, requires_grad=True)
    bias = torch.randn(16)  # no gradient asked for: db absent
    with _EmptyOutputs() as seen:
        if norm == "rms_norm":
            rms_norm(x, weight).sum().backward()
        else:
            add_layer_norm(x, residual, weight, bias=bias)[0].sum().backward()
    assert seen.names == [] and x.grad is not None and weight.grad is not None
