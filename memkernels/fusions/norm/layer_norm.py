"""LayerNorm, plain and with a fused residual add.

Shares its kernels, custom ops and reference with RMSNorm (see memkernels/fusions/norm/op.py).
"""
from memkernels.fusions.norm.op import normalize

_MEMORY_NOTE = """
    Saved for backward (measured in tests/test_layer_norm.py): the normalized
    input (x, or residual_out for the add variant; no new bytes for x itself)
    and fp32 mean and rstd per row: 8 new bytes per token. memory_efficient=True
    keeps the output y instead (which the next layer keeps anyway) plus rstd:
    4 new bytes per token beyond y, and x can be freed. x̂ = (y - bias) / weight
    is recovered in backward where that loses no more than about one rounding
    of y: |w_j| >= max(|b_j|, tau(dtype)) (tau = 0.0625 for fp16, ~1e-36 bf16,
    ~1e-31 fp32). For the other K columns (zero or tiny weights, or a bias much
    larger than the weight) x̂ itself is stored as an [M, K] tensor, so
    gradients stay exact and nothing is divided by zero. Finding K reads one
    count back from the device; that decision is cached per weight state and
    recomputed after an in-place update or optimizer step (see
    memkernels.fusions.norm.op.unrecoverable_columns).
"""


def layer_norm(x, weight=None, bias=None, eps=1e-5, *, memory_efficient=False, normalized_shape=None,
               in_place=False, backend=None):
    """LayerNorm: y = (x - mean) / sqrt(var + eps) * weight + bias, statistics in fp32.

    Args:
        x: [..., *normalized_shape], float32/float16/bfloat16, any strides
            (non-contiguous input is copied once).
        weight, bias: normalized_shape, x's dtype or float32, or None.
        eps: added to the (biased) variance.
        memory_efficient: keep y instead of x for backward (see below).
        normalized_shape: trailing dims normalized together; defaults to
            weight.shape, else bias.shape, else the last dim.
        in_place: backward writes dx into the incoming gradient's buffer, saving one
            [M, H] allocation, but only when nothing else can see that buffer (it is
            not shared with another branch, kept by the caller, or a view); otherwise,
            and under torch.compile, it allocates dx as usual.
        backend: None picks by device (Triton on CUDA, the PyTorch reference elsewhere, see
            memkernels.set_backend); "torch" forces the reference, "triton" the kernels.

    Returns:
        y: x's shape and dtype (computed in fp32, one rounding). An input with
        no rows gives an empty y.
    """
    if normalized_shape is None and weight is None and bias is not None:
        normalized_shape = bias.shape
    return normalize("layer_norm", x, None, weight, bias, eps, 0.0, False, "gemma", memory_efficient,
                     normalized_shape, in_place, backend)[0]


def add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, *, memory_efficient=False,
                   normalized_shape=None, in_place=False, backend=None):
    """Fused residual add + LayerNorm in one pass: returns (y, residual_out).

    residual_out = x + residual (rounded to x's dtype) and y = layer_norm(residual_out),
    with the arguments of :func:`layer_norm`. residual must match x in shape, dtype
    and device. Gradients reach x and residual and include any gradient flowing
    into residual_out itself.
    """
    if normalized_shape is None and weight is None and bias is not None:
        normalized_shape = bias.shape
    return normalize("add_layer_norm", x, residual, weight, bias, eps, 0.0, False, "gemma", memory_efficient,
                     normalized_shape, in_place, backend)


# The memory note is shared by both functions' docstrings.
layer_norm.__doc__ += _MEMORY_NOTE
add_layer_norm.__doc__ += _MEMORY_NOTE
