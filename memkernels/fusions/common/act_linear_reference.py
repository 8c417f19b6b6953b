"""The activation-linear family's elementwise passes in PyTorch: the CPU path and the readable spec.

gelu_linear (``F.linear(gelu(x), W, b)``) and gated_linear (``F.linear(act(gate) * up, W, b)``) run
one algorithm (memkernels/fusions/common/act_linear.py): every GEMM in the BLAS, and around each one a single
elementwise pass over the I-wide operands. These are those passes for ``backend="torch"``; the
Triton kernels of memkernels/fusions/common/act_linear.py compute the same thing in one launch each.

- :func:`product`: ``c = act(gate) * up`` (``act(gate)`` without up), in float32, cast once.
- :func:`product_backward`: from ``grad`` = dL/dc, ``d_gate = grad * up * act'(gate)`` and
  ``d_up = grad * act(gate)``, and optionally c written over ``grad`` for the dW GEMM.

Float32 temporaries are made a block of rows at a time (``_BLOCK_ELEMENTS``), as a kernel works
tile by tile, so the pass needs no I-wide float32 copy of its operands and its peak stays within
eager's (tests/test_gated_linear.py measures it). On ``meta`` tensors (the planning tools' shape-only
runs) there is no memory to bound, only host time: one block.
"""
import itertools
import math

import torch
import torch.nn.functional as F

from memkernels.fusions.common.host import row_blocks

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")

# Rows of this many elements (256 KiB in float32) are one block of the PyTorch passes' temporaries:
# five such temporaries are small next to any I-wide tensor worth fusing.
_BLOCK_ELEMENTS = 1 << 16

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_CUBIC = 0.044715
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _compute(tensor):
    """tensor in float32 (float64 stays float64)."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def activation(x, name):
    """act(x) for ``name`` in ACTIVATIONS, in x's dtype."""
    if name == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if name == "gelu_tanh" else "none")


def activation_grad(x, name):
    """d act(x) / dx in float32 (float64 stays float64); same shape as x. In place after the first op."""
    x = _compute(x)
    if name == "silu":
        sigmoid = torch.sigmoid(x)
        return (1.0 - sigmoid).mul_(x).add_(1.0).mul_(sigmoid)
    if name == "gelu_tanh":
        inner = (x + _TANH_CUBIC * x.pow(3)).mul_(_SQRT_2_OVER_PI)
        t = inner.tanh()
        sech2 = inner.cosh_().square_().reciprocal_()  # 1 - t^2 without its cancellation
        dinner = x.square().mul_(3.0 * _TANH_CUBIC).add_(1.0).mul_(_SQRT_2_OVER_PI)
        # 0.5 * (1 + t) + 0.5 * x * sech^2 * dinner
        return dinner.mul_(x).mul_(sech2).add_(t).add_(1.0).mul_(0.5)
    pdf_term = x.square().mul_(-0.5).exp_().mul_(x).mul_(_INV_SQRT_2PI)
    cdf = (x * math.sqrt(0.5)).erf_().add_(1.0).mul_(0.5)
    return cdf.add_(pdf_term)


def _row_blocks(tensor):
    """Row ranges of ``tensor`` [M, I], at most _BLOCK_ELEMENTS elements each; on meta the first alone.

    Each block's temporaries are freed before the next block's are made, so the first (the largest) holds what
    every block holds in turn: on meta tensors (the planner's profiles), which hold no values and run no op a
    FLOP counter counts, the first block allocates the CPU run's peak. One block of all rows, as before, allocated
    full-size float32 temporaries that no device does: a meta gated_linear forward peaked at 4x the CPU's and the
    GPU's bytes (80 against 20 MiB at M=4096, I=2048), the backward at 212 against 54 MiB."""
    blocks = row_blocks(*tensor.shape, _BLOCK_ELEMENTS)
    # on meta the first alone, not a list of all: a planner's long sequence has 10^4-10^5 blocks a call
    return list(itertools.islice(blocks, 1)) if tensor.device.type == "meta" else blocks


def _meta_block(key, block):
    """On meta, the first row block's work ``block()`` (its temporaries die inside it) once per ``key``, its
    temporaries' peak measured; later calls with that key allocate and free one buffer of the same bytes instead.

    That is all a memory profile can see of a block on meta (no values; no op a FLOP counter counts), in one op
    where the block runs about twenty: a planner's search runs 10^4 blocks, 25% of its time before. The block's
    shape does not depend on the tensor's rows (``_row_blocks``), so the key's first call serves every length."""
    peak = _META_BLOCK_PEAKS.get(key)
    if peak is None:
        from memkernels.runtime.meters import PeakBytesMeter

        with PeakBytesMeter() as meter:
            block()
        _META_BLOCK_PEAKS[key] = meter.peak_bytes
    elif peak:
        torch.empty(peak, dtype=torch.uint8, device="meta")  # allocated and freed at once, as the block's


# (pass, activation, dtypes, flags, block shape) -> peak bytes of one block's temporaries, measured on meta
_META_BLOCK_PEAKS = {}


def _walk(tensor, block, key):
    """``block(start, stop)`` over ``tensor``'s row blocks; on meta through :func:`_meta_block`, ``key`` (the pass,
    its activation, dtypes and flags) completed with the block's shape."""
    for start, stop in _row_blocks(tensor):
        if tensor.device.type == "meta":
            _meta_block((*key, stop - start, tensor.shape[1]), lambda: block(start, stop))
        else:
            block(start, stop)


def product(gate, up, name):
    """c [M, I] = act(gate [M, I]) * up [M, I] (``up`` None: act(gate)), in float32, cast once to gate's dtype."""
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)

    def block(start, stop):
        activated = activation(_compute(gate[start:stop]), name)
        if up is not None:
            activated.mul_(_compute(up[start:stop]))
        out[start:stop] = activated
        del activated  # before the next block's: one block's temporaries at a time

    _walk(gate, block, ("product", name, gate.dtype, None if up is None else up.dtype))
    return out


def product_backward(grad, gate, up, name, grad_gate, grad_up, write_product):
    """From ``grad`` [M, I] = dL/dc: ``grad_gate`` = grad * up * act'(gate) and ``grad_up`` = grad *
    act(gate) (``up`` None: grad_gate = grad * act'(gate)), written into the given [M, I] buffers;
    with ``write_product``, c = act(gate) * up overwrites ``grad`` (the dW GEMM's operand)."""
    def block(start, stop):
        d = _compute(grad[start:stop])
        gate_block = gate[start:stop]
        activated = activation(_compute(gate_block), name)
        d_gate = activation_grad(gate_block, name).mul_(d)
        if up is not None:
            up_block = _compute(up[start:stop])
            grad_up[start:stop] = d * activated
            d_gate.mul_(up_block)
            activated.mul_(up_block)
        grad_gate[start:stop] = d_gate
        if write_product:
            grad[start:stop] = activated
        del d, activated, d_gate  # before the next block's: one block's temporaries at a time
        if up is not None:
            del up_block

    _walk(gate, block, ("product_backward", name, grad.dtype, gate.dtype, None if up is None else up.dtype,
                        grad_gate.dtype, None if grad_up is None else grad_up.dtype, write_product))
