"""OpSpec: every memkernels op declared once.

A fused op is a forward :class:`Step` and its backward steps, each a ``torch.library`` custom op
(torch.compile keeps it whole, with no graph break), one autograd formula written over those steps,
an autocast policy, and the dtypes its Triton kernels take. From that one declaration an
:class:`OpSpec` makes:

- the custom ops, their fake (meta) implementations, and the formula registered as their autograd;
- the **eager twin**: an ``autograd.Function`` running the same formula over the steps'
  implementations (why below);
- the autocast policy at the op's ``Autocast<Device>`` dispatch key
  (:mod:`memkernels.fusions.common.autocast`), which the twin follows too;
- :meth:`OpSpec.backend`, the one place where a call's ``backend=`` argument, memkernels.set_backend
  and the tensors' device and dtype decide between the Triton kernels and the PyTorch reference;
- the op's entry in :data:`SPECS`, by which the tests find every op and its twin.

The formula is written once as ``backward(ctx, steps, *grads)``, where ``steps.<name>`` is a backward
step: the custom op while torch.compile traces, its implementation in eager mode. Every step takes
the resolved backend (``"triton"`` or ``"torch"``) as its last argument, so the choice is made once,
in the public function, and travels with the call into backward.

Why a twin in eager mode: a custom op call passes through the dispatcher twice (its autograd
kernel, then its backend kernel) and through torch.library's Python wrappers, about 60 us of host
time per forward + backward on a fast CPU (``benchmarks/bench_rms_norm.py``, host-time rows),
where a norm's kernels take 10-100 us of GPU time: on the H200 a FusedRMSNorm step was host-bound
at 4-6x eager's step (docs/gpu-runs.md). The Function runs the same implementation directly, and
the buffers it allocates pass through the dispatcher where memory meters and profilers see them,
which a custom op's insides do not.
"""
import types

import torch

from memkernels import _backend
from memkernels.fusions.common import autocast as _autocast

# What the Triton kernels of most ops take; the PyTorch reference takes any floating dtype.
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# op name -> its OpSpec, in the order the ops were declared
SPECS = {}


class Step:
    """One step of an op (its forward, or a backward step) as the custom op ``memkernels::<name>``.

    ``run(*args)`` is the implementation the eager twin calls, looked up on every call (a test may
    wrap it to see which steps run); its last argument is the backend. ``fake(*args)`` gives the
    outputs' shapes (torch.compile, ``meta`` tensors). ``custom_op_run``, when given, is what the
    custom op runs instead of ``run``: a custom op returns no None, so an op whose eager path
    returns None for an absent output (the norms: an empty placeholder costs host time) fills them
    in there. The schema is ``schema``, or inferred from the type annotations of ``custom_op_run`` (or ``run``).
    """

    def __init__(self, name, run, fake, *, schema=None, custom_op_run=None, mutates_args=()):
        self.run = run
        self.name = f"memkernels::{name}"
        if schema is None:
            schema = torch.library.infer_schema(custom_op_run or run, mutates_args=mutates_args)
        self.custom_op = torch.library.custom_op(self.name, custom_op_run or self.implementation,
                                                 mutates_args=mutates_args, schema=schema)
        self.custom_op.register_fake(fake)

    def implementation(self, *args):
        return self.run(*args)


class OpSpec:
    """A fused op declared once (see the module docstring).

    Args:
        name: the op's public name, used in error messages (``"gelu_linear"``).
        forward: the forward :class:`Step`; its custom op is the op torch.compile sees.
        steps: ``{name: Step}``, the backward steps the formula calls as ``steps.<name>``.
        setup_context: ``setup_context(ctx, inputs, output)``, saving what backward needs.
        backward: ``backward(ctx, steps, *grads)``, returning one gradient (or None) per input.
        autocast: ``{"cpu": policy, "cuda": policy}`` with policy ``"lower_precision_fp"`` (a GEMM's),
            ``"fp32"`` (CUDA's norms) or None (inputs as they are); see memkernels.fusions.common.autocast.
        casts: positions of the forward's arguments the autocast policy casts.
        triton_dtypes: the dtypes the Triton kernels take (None: the op's own checks decide).
        fake_on_meta: run the custom op, whose fake gives the outputs at once, on ``meta`` tensors
            (the planner's profiles of a model never allocated): for an op whose PyTorch path would
            loop over row blocks of shapes alone (a norm at [8192, 8192]: 1.8 s on meta against
            1 ms) and whose kernels hold no transient worth counting. The losses keep their twin
            there: their chunk buffers are what a profile must see.
    """

    def __init__(self, name, forward, *, steps, setup_context, backward, autocast, casts=(),
                 triton_dtypes=TRITON_DTYPES, fake_on_meta=False):
        if name in SPECS:
            raise RuntimeError(f"memkernels: the op {name!r} is declared twice")
        self.name = name
        self.forward = forward
        self.steps = dict(steps)
        self.triton_dtypes = None if triton_dtypes is None else tuple(triton_dtypes)
        self.fake_on_meta = fake_on_meta
        self.custom_op = forward.custom_op
        traced = types.SimpleNamespace(**{key: step.custom_op for key, step in self.steps.items()})
        eager = types.SimpleNamespace(**{key: step.implementation for key, step in self.steps.items()})
        self.custom_op.register_autograd(lambda ctx, *grads: backward(ctx, traced, *grads),
                                         setup_context=setup_context)
        self.function = _twin(name, forward.implementation, setup_context,
                              _first_order_only(self.custom_op._qualname,
                                                lambda ctx, *grads: backward(ctx, eager, *grads)))
        _autocast.register(self.custom_op._qualname, autocast, casts)
        SPECS[name] = self

    def backend(self, backend, like, owner=None, what="the input"):
        """``"triton"`` or ``"torch"``: the backend this op runs on ``like`` (its first operand, called ``what``
        in messages) for a call's ``backend=`` (None: memkernels.set_backend's choice for the tensor's device).
        ``owner`` names the public function in messages (default: the op's name)."""
        return _backend.resolve(like, owner or self.name, backend, self.triton_dtypes, what)

    @property
    def all_steps(self):
        """{name: Step}: the forward (as "forward") and the backward steps."""
        return {"forward": self.forward, **self.steps}

    def step(self, name):
        """The step ``name`` ("forward" or a backward step's) for a composite's own autograd.Function to call: the
        custom op while torch.compile traces, its implementation otherwise."""
        step = self.all_steps[name]
        return step.custom_op if torch.compiler.is_compiling() else step.implementation

    def with_autocast(self, function, *args, positions=None):
        """``function(*args)`` as this op runs under autocast: ``args`` cast by its policy, autocast off inside;
        outside an autocast region, ``function(*args)``. ``positions``: which of ``args`` the policy casts, when
        ``function`` takes other arguments than the forward step (default: ``casts``)."""
        return _autocast.call(self.custom_op._qualname, function, *args, positions=positions)

    def __call__(self, *args):
        """The op on ``args`` (the forward step's arguments, the resolved backend last): the custom op while
        torch.compile traces (and on meta tensors with ``fake_on_meta``), its eager twin otherwise, both under
        the op's autocast policy."""
        if torch.compiler.is_compiling() or (self.fake_on_meta and _autocast.device_type_of(args) == "meta"):
            return self.custom_op(*args)
        return _autocast.call(self.custom_op._qualname, self.function.apply, *args)


def _twin(name, run, setup_context, backward):
    # One forward(ctx, ...) that sets the context up itself: given a separate setup_context,
    # Function.apply binds every call's arguments through inspect.signature (~30 us of host time).
    def forward(ctx, *args):
        output = run(*args)
        setup_context(ctx, args, output)
        return output

    return type(f"{name}_function", (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward)})


def _first_order_only(qualname, backward):
    """``backward`` whose gradients, under create_graph=True, raise when differentiated again.

    The kernels compute no second derivative. Through the custom op a double backward raises (its
    backward op has no autograd); the twin must not instead drop the op's second-order terms from
    a sum that has others (a gradient penalty). ``once_differentiable`` is not enough: it marks the
    gradients only when an incoming gradient requires grad, and a loss's incoming gradient is a
    constant.
    """
    message = (f"{qualname} has no second derivative: its backward is not differentiable (create_graph=True "
               "through it, then a backward through the gradients it gave)").encode()

    def first_order_backward(ctx, *grads):
        if not torch.is_grad_enabled():  # a plain backward
            return backward(ctx, *grads)
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        tensors = [index for index, output in enumerate(outputs) if isinstance(output, torch.Tensor)]
        raise_on_backward = torch._C._functions.DelayedError(message, len(tensors))
        raising = raise_on_backward(*[outputs[index].detach().requires_grad_() for index in tensors])
        raising = raising if isinstance(raising, tuple) else (raising,)
        outputs = list(outputs)
        for index, tensor in zip(tensors, raising):
            outputs[index] = tensor
        return tuple(outputs)

    return first_order_backward
