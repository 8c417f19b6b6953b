"""Rotary position embedding (RoPE, the rotate-half form) in PyTorch: the CPU path and the readable spec.

For a head vector x = (x1, x2) (halves of head_dim) and a position's tables cos = (c1, c2), sin =
(s1, s2), Hugging Face's ``x * cos + rotate_half(x) * sin`` is

    forward:   o1 = x1 * c1 - x2 * s1        o2 = x2 * c2 + x1 * s2
    backward:  d1 = g1 * c1 + g2 * s2        d2 = g2 * c2 - g1 * s1   (the transpose, from o's gradient g)

Written with both halves of the tables, so it holds for any tables (Hugging Face's repeat their halves,
c1 = c2). memkernels/fusions/rope/op.py's Triton kernel computes the same in one launch for q and k.

Layouts: x is [batch, heads, seq, head_dim] with any strides; cos and sin are [batch or 1, seq,
head_dim]. The result is [batch, heads, seq, head_dim] laid out as [batch, seq, heads, head_dim]
(contiguous after ``transpose(1, 2)``), the layout of a q_proj output that attention and its gradient
use without a copy. Math in float32 (float64 stays float64), rounded once to ``dtype``.
"""
import torch


def empty_rotated(x, dtype):
    """An uninitialized [B, H, S, D] tensor of ``dtype`` on x's device, laid out as [B, S, H, D]."""
    batch, heads, seq, dim = x.shape
    return torch.empty_strided((batch, heads, seq, dim), (seq * heads * dim, dim, heads * dim, 1), dtype=dtype,
                               device=x.device)


def rotate_one(x, cos, sin, dtype, backward):
    """One of q or k rotated (``backward``: its gradient rotated back). x: [B, H, S, D]; cos, sin:
    [B or 1, S, D]. Returns [B, H, S, D] of ``dtype`` in :func:`empty_rotated`'s layout."""
    compute = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), torch.float32)
    half = x.shape[-1] // 2
    x = x.to(compute)
    cos, sin = cos.unsqueeze(1).to(compute), sin.unsqueeze(1).to(compute)
    x1, x2 = x[..., :half], x[..., half:]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    out = empty_rotated(x, dtype)
    if backward:
        out[..., :half] = x1 * c1 + x2 * s2
        out[..., half:] = x2 * c2 - x1 * s1
    else:
        out[..., :half] = x1 * c1 - x2 * s1
        out[..., half:] = x2 * c2 + x1 * s2
    return out


def rotate(q, k, cos, sin, q_dtype, k_dtype, backward):
    """(q, k) rotated by the tables (or, ``backward``, their gradients rotated back), as ``q_dtype`` and
    ``k_dtype``; see :func:`rotate_one`."""
    return rotate_one(q, cos, sin, q_dtype, backward), rotate_one(k, cos, sin, k_dtype, backward)


def rotate_half(x):
    """(-x2, x1) for the halves (x1, x2) of x's last dimension, as Hugging Face writes it."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def eager(q, k, cos, sin):
    """Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin)`` op for op (unsqueeze_dim=1): the eager baseline
    the tests, the benchmark and the GPU audit measure memkernels' RoPE against."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
