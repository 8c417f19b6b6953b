"""Dynamic Tanh (DyT) in PyTorch: the CPU path and the readable spec of memkernels/fusions/dyt/op.py's kernels.

DyT (Zhu et al., "Transformers without Normalization", 2025) stands where a LayerNorm would: for x of
[..., H], a learned scalar alpha and per-channel weight and bias of [H],

    forward:   t = tanh(alpha * x)            y = weight * t + bias
    backward:  s = 1 - t**2
               dx     = g * weight * alpha * s
               dalpha = sum(g * weight * s * x)       (over every element)
               dweight = sum over rows of g * t        dbias = sum over rows of g

Eager PyTorch saves x (for alpha's gradient) and t (tanh's output, and the weight's gradient): two
tensors of x's size. This path and the kernels save x alone and recompute t in backward, one tanh
an element, in the same pass that reads x and g anyway.

Everything works on 2-D [M, H] tensors in row blocks (``row_blocks``), so that the float32 temporaries of a
block stay under BLOCK_ELEMENTS elements each whatever the tensor's size. Math in float32 (float64 stays
float64), rounded once to the output's dtype; the parameters' gradients are float32 sums per block added
up in float64 in block order (deterministic), cast to each parameter's dtype once.
"""
import torch

from memkernels.fusions.common.host import row_blocks

# Elements per float32 temporary of a row block (1 MiB).
BLOCK_ELEMENTS = 1 << 18


def _promote(a, b):
    """torch.promote_types for two floating dtypes, in Python: an aten call per forward would cost host time
    (and the GPU audit would count it as an op)."""
    if a == b:
        return a
    if {a, b} == {torch.float16, torch.bfloat16}:
        return torch.float32
    return a if a.itemsize > b.itemsize else b


def output_dtype(x, alpha, weight, bias):
    """The dtype eager's ``weight * tanh(alpha * x) + bias`` gives for floating operands: a one-element alpha
    of shape [1] promotes like a tensor, a 0-dim one like a scalar (bf16 x with a float32 [1] alpha is float32,
    as in eager)."""
    dtype = _promote(x.dtype if alpha.dim() == 0 else _promote(x.dtype, alpha.dtype), weight.dtype)
    return dtype if bias is None else _promote(dtype, bias.dtype)


def compute_dtype(*tensors):
    """float32, or float64 when any operand is float64."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def forward(x, alpha, weight, bias, dtype):
    """y = weight * tanh(alpha * x) + bias as ``dtype``. x: [M, H]; alpha: one element; weight, bias: [H]
    (bias may be None). Returns [M, H] contiguous."""
    compute = compute_dtype(x, alpha, weight, bias)
    a, w = alpha.reshape(()).to(compute), weight.to(compute)
    b = None if bias is None else bias.to(compute)
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    for start, stop in row_blocks(*x.shape, BLOCK_ELEMENTS):
        block = torch.tanh(x[start:stop].to(compute) * a) * w
        y[start:stop] = block if b is None else block + b
    return y


def backward(grad, x, alpha, weight, bias_dtype, needs_x, needs_params):
    """(dx, dalpha, dweight, dbias) from y's gradient ``grad`` [M, H] and the saved x [M, H], each in its input's
    dtype (the bias's ``bias_dtype``; None: no bias, and no dbias): dx None unless ``needs_x``, the parameters'
    None unless ``needs_params``."""
    compute = compute_dtype(grad, x, alpha, weight)
    a, w = alpha.reshape(()).to(compute), weight.to(compute)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if needs_x else None
    sums = torch.zeros(3, x.shape[1], dtype=torch.float64, device=x.device) if needs_params else None
    for start, stop in row_blocks(*x.shape, BLOCK_ELEMENTS):
        xs, g = x[start:stop].to(compute), grad[start:stop].to(compute)
        t = torch.tanh(xs * a)
        g_w_s = g * w * (1 - t * t)
        if needs_x:
            dx[start:stop] = g_w_s * a
        if needs_params:
            sums[0] += (g * t).sum(0)
            sums[1] += g.sum(0)
            sums[2] += (g_w_s * xs).sum(0)
    if not needs_params:
        return dx, None, None, None
    dbias = None if bias_dtype is None else sums[1].to(bias_dtype)
    return dx, sums[2].sum().reshape(alpha.shape).to(alpha.dtype), sums[0].to(weight.dtype), dbias


def eager(x, alpha, weight, bias=None):
    """DyT as its paper's code writes it (``DynamicTanh``, channels last), op for op: the eager baseline the
    tests, the benchmark and the GPU audit measure memkernels' DyT against."""
    x = torch.tanh(alpha * x)
    return x * weight if bias is None else x * weight + bias
