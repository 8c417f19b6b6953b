"""RMSNorm, plain and with a fused residual add.

Shares its kernels, custom ops and reference with LayerNorm (see memkernels/fusions/norm/op.py).
"""
from memkernels.fusions.norm.op import normalize

_MEMORY_NOTE = """
    Saved for backward (measured in tests/test_rms_norm.py): the normalized input
    (x, or residual_out for the add variant; no new bytes for x itself) and an
    fp32 rstd per row: 4 new bytes per token. memory_efficient=True keeps the
    output y instead (which the next layer keeps anyway, so x can be freed) and
    recovers x̂ = (y - bias) / (offset + weight) in backward. Where that division
    would lose precision (|offset + w_j| < max(|b_j|, tau(dtype)), tau = 0.0625
    for fp16, ~1e-36 for bf16, ~1e-31 for fp32; zero weights included) x̂ of
    those K columns is stored instead, as an [M, K] tensor, so gradients stay
    exact with no division by zero. Finding K reads one count back from the
    device; that decision is cached per weight state and recomputed after an
    in-place update or optimizer step (see memkernels.fusions.norm.op.unrecoverable_columns).
"""


def rms_norm(x, weight=None, eps=1e-6, *, bias=None, offset=0.0, casting_mode="llama", memory_efficient=False,
             normalized_shape=None, in_place=False, backend=None):
    """RMSNorm: y = x / sqrt(mean(x**2) + eps) * (offset + weight) [+ bias].

    Args:
        x: [..., *normalized_shape], float32/float16/bfloat16, any strides
            (non-contiguous input is copied once).
        weight: normalized_shape, x's dtype or float32; None for no scale (a zero
            weight when ``offset`` is set: the scale is the offset alone).
        eps: added to the mean square.
        bias: optional, like weight (plain RMSNorm has none).
        offset: the scale is (offset + weight), e.g. 1.0 for Gemma.
        casting_mode: "llama" (fp32 statistics, x̂ cast to x's dtype before the
            weight multiply), "gemma" (everything in fp32, one cast at the end)
            or "none" (each step in x's dtype; statistics still fp32).
        memory_efficient: keep y instead of x for backward (see below).
        normalized_shape: trailing dims normalized together; defaults to
            weight.shape, else the last dim.
        in_place: backward writes dx into the incoming gradient's buffer, saving one
            [M, H] allocation, but only when nothing else can see that buffer (it is
            not shared with another branch, kept by the caller, or a view); otherwise,
            and under torch.compile, it allocates dx as usual.
        backend: None picks by device (Triton on CUDA, the PyTorch reference elsewhere, see
            memkernels.set_backend); "torch" forces the reference, "triton" the kernels.

    Returns:
        y: x's shape and dtype. An input with no rows gives an empty y.
    """
    return normalize("rms_norm", x, None, weight, bias, eps, offset, True, casting_mode, memory_efficient,
                     normalized_shape, in_place, backend)[0]


def add_rms_norm(x, residual, weight=None, eps=1e-6, *, bias=None, offset=0.0, casting_mode="llama",
                 memory_efficient=False, normalized_shape=None, in_place=False, backend=None):
    """Fused residual add + RMSNorm in one pass: returns (y, residual_out).

    residual_out = x + residual (rounded to x's dtype) and y = rms_norm(residual_out),
    with the arguments of :func:`rms_norm`. residual must match x in shape, dtype
    and device. Gradients reach x and residual (both get d residual_out) and
    include any gradient flowing into residual_out itself.
    """
    return normalize("add_rms_norm", x, residual, weight, bias, eps, offset, True, casting_mode, memory_efficient,
                     normalized_shape, in_place, backend)


# The memory note is shared by both functions' docstrings.
rms_norm.__doc__ += _MEMORY_NOTE
add_rms_norm.__doc__ += _MEMORY_NOTE
