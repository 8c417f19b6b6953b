"""How every memkernels op registers itself with its autograd: a custom op for torch.compile, its
autograd.Function twin for eager mode (the norms, the losses, gelu_linear, gated_linear). The one
composite, gated_mlp_recompute (three GEMMs, two of them PyTorch's), is an autograd.Function over
gated_linear's steps, which are these custom ops while torch.compile traces it.

:func:`custom_op` registers the forward (and each backward step) as a ``torch.library`` custom op
with a fake implementation: torch.compile keeps it whole, with no graph break. :func:`autograd_pair`
gives that op its autograd formula and returns the same formula as an ``autograd.Function``.
:func:`apply_op` runs the op while torch.compile traces and the Function in eager mode.

Why a twin in eager mode: a custom op call passes through the dispatcher twice (its autograd
kernel, then its backend kernel) and through torch.library's Python wrappers, about 60 us of host
time per forward + backward on a fast CPU (``benchmarks/bench_rms_norm.py``, host-time rows),
where a norm's kernels take 10-100 us of GPU time: on the H200 a FusedRMSNorm step was host-bound
at 4-6x eager's step (docs/gpu-runs.md). The Function runs the same implementation directly, and
the buffers it allocates pass through the dispatcher where memory meters and profilers see them,
which a custom op's insides do not. Both follow the op's autocast policy
(:mod:`memkernels.fusions.common.autocast`): the op at its autocast dispatch key, the Function through
:func:`memkernels.fusions.common.autocast.call`.
"""
import torch

from memkernels.fusions.common import autocast as _autocast


def custom_op(name, impl, fake, mutates_args=(), schema=None):
    """Register ``impl`` as the torch.library custom op ``name`` with ``fake`` as its fake (meta)
    implementation; returns the op. Its schema is inferred from ``impl``'s type annotations, or
    given as ``schema`` (e.g. ``"(Tensor x, str backend) -> Tensor"``)."""
    op = torch.library.custom_op(name, impl, mutates_args=mutates_args, schema=schema)
    op.register_fake(fake)
    return op


def autograd_pair(op, impl, setup_context, op_backward, eager_backward):
    """Give ``op`` its autograd formula, and return the same formula as an autograd.Function.

    ``impl`` is the op's implementation and ``setup_context`` is shared. ``op_backward`` runs
    under torch.compile and calls the backward custom ops; ``eager_backward`` calls their
    implementations directly.
    """
    op.register_autograd(op_backward, setup_context=setup_context)

    # One forward(ctx, ...) that sets the context up itself: given a separate setup_context,
    # Function.apply binds every call's arguments through inspect.signature (~30 us of host time).
    def forward(ctx, *args):
        output = impl(*args)
        setup_context(ctx, args, output)
        return output

    return type(f"{op._name.split('::')[-1]}_function", (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "backward": staticmethod(_first_order_only(op, eager_backward)),
    })


def _first_order_only(op, backward):
    """``backward`` whose gradients, under create_graph=True, raise when differentiated again.

    The kernels compute no second derivative. Through the custom op a double backward raises (its
    backward op has no autograd); the twin must not instead drop the op's second-order terms from
    a sum that has others (a gradient penalty). ``once_differentiable`` is not enough: it marks the
    gradients only when an incoming gradient requires grad, and a loss's incoming gradient is a
    constant.
    """
    message = (f"{op._qualname} has no second derivative: its backward is not differentiable (create_graph=True "
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


def apply_op(op, function, *args, fake_on_meta=False):
    """The custom op while torch.compile traces; its autograd.Function twin in eager mode.

    ``fake_on_meta``: on ``meta`` tensors (the planner's profiles of a model that was never
    allocated) run the custom op, whose fake implementation gives the kernels' outputs at once, for
    an op whose PyTorch path would loop over row blocks of shapes alone (a norm at [8192, 8192]:
    1.8 s on meta against 1 ms) and whose kernels hold no transient worth counting. The losses keep
    their twin there: their chunk buffers are what a profile must see.
    """
    if torch.compiler.is_compiling() or (fake_on_meta and _autocast.device_type_of(args) == "meta"):
        return op(*args)
    return _autocast.call(op._qualname, function.apply, *args)
