"""Rotary position embedding (RoPE) for q and k in one launch each way.

Hugging Face's ``apply_rotary_pos_emb`` (``q * cos + rotate_half(q) * sin``, and the same for k) runs
five kernels a tensor forward and seven backward, plus a copy of q's gradient back into q_proj's
layout: 25 launches a layer, against one each way here, with no [tokens, heads, head_dim]
temporaries (eager makes four a tensor forward: q * cos, -x2, the concatenation, its product with sin).
Saved for backward: cos and sin, as eager's multiplications save (the tables need no gradient, so
q and k are not saved there either); one pair per model forward, shared by every layer.

- forward:  q_out = rot(q), k_out = rot(k)               one launch; fp32 math, rounded once
- backward: dq = rotᵀ(dq_out), dk = rotᵀ(dk_out)          one launch

The math is memkernels/fusions/rope/reference.py's (the ``backend="torch"`` path). Outputs and gradients are
laid out as [batch, seq, heads, head_dim] (viewed as [batch, heads, seq, head_dim]): the layout of
a q_proj output, so attention reads them as Hugging Face's, and the gradients reach q_proj with no
copy.

File order: kernel → launcher → steps → autograd and OpSpec → public function.
"""
import torch
import triton
import triton.language as tl

from memkernels import aot
from memkernels.fusions.common.device_guard import on_tensor_device
from memkernels.fusions.common.host import next_power_of_2
from memkernels.fusions.op_spec import OpSpec, Step
from memkernels.fusions.rope import reference
# Elements of one [heads, head_dim / 2] tile: x1, x2 and their results in fp32 at 4 warps take 76-114
# registers a thread on sm_80 / sm_90 with no spills (`python -m memkernels.aot`; tests/test_aot_ops.py).
_TILE_ELEMENTS = 2048
_WARPS = 4


# --------------------------------------------------------------------------------------------
# Kernel: one program per (batch, position), over every head of q and then of k.


@triton.jit
def _rotate_heads(X, stride_h, OUT, heads, half, cos1, cos2, sin1, sin2, cols, col_mask,
                  BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate ``heads`` head vectors at X (head stride ``stride_h``, halves ``half`` apart) into OUT
    (heads contiguous, 2 * half apart), BLOCK_H heads at a time."""
    for start in range(0, heads, BLOCK_H):
        h = start + tl.arange(0, BLOCK_H)
        mask = (h < heads)[:, None] & col_mask[None, :]
        source = X + h[:, None].to(tl.int64) * stride_h + cols[None, :]
        x1 = tl.load(source, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(source + half, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:  # the transpose of the rotation
            out1 = x1 * cos1[None, :] + x2 * sin2[None, :]
            out2 = x2 * cos2[None, :] - x1 * sin1[None, :]
        else:
            out1 = x1 * cos1[None, :] - x2 * sin1[None, :]
            out2 = x2 * cos2[None, :] + x1 * sin2[None, :]
        target = OUT + h[:, None] * (2 * half) + cols[None, :]
        tl.store(target, out1.to(OUT.dtype.element_ty), mask=mask)
        tl.store(target + half, out2.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K,            # [B, HQ, S, D], [B, HK, S, D] (backward: the outputs' gradients); head_dim contiguous
    COS, SIN,        # [B or 1, S, D], head_dim contiguous, the same strides
    Q_OUT, K_OUT,    # [B, S, HQ, D], [B, S, HK, D] contiguous
    seq_len, q_heads, k_heads, half,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_cb, stride_cs,
    BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # batch * seq_len + position
    batch = row // seq_len
    position = row % seq_len
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half
    table = batch * stride_cb + position * stride_cs + cols
    cos1 = tl.load(COS + table, mask=col_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(COS + table + half, mask=col_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(SIN + table, mask=col_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(SIN + table + half, mask=col_mask, other=0.0).to(tl.float32)
    _rotate_heads(Q + batch * stride_qb + position * stride_qs, stride_qh, Q_OUT + row * q_heads * 2 * half,
                  q_heads, half, cos1, cos2, sin1, sin2, cols, col_mask, BACKWARD, BLOCK_H)
    _rotate_heads(K + batch * stride_kb + position * stride_ks, stride_kh, K_OUT + row * k_heads * 2 * half,
                  k_heads, half, cos1, cos2, sin1, sin2, cols, col_mask, BACKWARD, BLOCK_H)


# --------------------------------------------------------------------------------------------
# Launcher


def _blocks(half, heads):
    """(BLOCK_H, BLOCK_HALF) for head vectors of 2 * ``half`` and at most ``heads`` heads."""
    block_half = next_power_of_2(half)
    block_h = min(next_power_of_2(heads), max(_TILE_ELEMENTS // block_half, 1))
    return block_h, block_half


# Launches compile without floating-point contraction, as in the interpreter where the accuracy
# tests run: x1 * c1 - x2 * s1 stays two rounded products and a subtraction, as eager computes it.
_LAUNCH_OPTIONS = {"enable_fp_fusion": False}


def _head_dim_contiguous(tensor):
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


@on_tensor_device
def _rotate_triton(q, k, cos, sin, q_dtype, k_dtype, backward):
    """Triton twin of reference.rotate: one launch for q and k."""
    batch, q_heads, seq, dim = q.shape
    k_heads = k.shape[1]
    q_out, k_out = reference.empty_rotated(q, q_dtype), reference.empty_rotated(k, k_dtype)
    if not (batch and seq and dim and (q_heads or k_heads)):
        return q_out, k_out
    q, k = _head_dim_contiguous(q), _head_dim_contiguous(k)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    block_h, block_half = _blocks(dim // 2, max(q_heads, k_heads))
    _rope_kernel[(batch * seq,)](
        q, k, cos, sin, q_out, k_out, seq, q_heads, k_heads, dim // 2,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        cos.stride(0) if cos.shape[0] == batch else 0, cos.stride(1),
        BACKWARD=backward, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=_WARPS, **_LAUNCH_OPTIONS)
    return q_out, k_out


def _rotate(q, k, cos, sin, q_dtype, k_dtype, backward, backend):
    implementation = _rotate_triton if backend == "triton" else reference.rotate
    return implementation(q, k, cos, sin, q_dtype, k_dtype, backward)


def _aot_variants():
    """Launch variants for memkernels.aot: every dtype with tables of its own dtype, 16-bit q and k with
    float32 tables (autocast: Hugging Face builds the tables in the hidden states' float32, and the
    outputs are float32 as eager's promotion gives), forward and backward, at head_dim 128 (Llama,
    Mistral, Qwen) and 256 (Gemma)."""
    short = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    # (dtype of the inputs read, of the tables, of the outputs written, backward, head_dim)
    cases = [(t, t, t, backward, 128) for t in short.values() for backward in (False, True)]
    cases += [(t, "fp32", "fp32", False, 128) for t in ("bf16", "fp16")]  # forward: q, k 16-bit; out fp32
    cases += [("fp32", "fp32", t, True, 128) for t in ("bf16", "fp16")]   # backward: fp32 grads; dq, dk 16-bit
    cases += [("bf16", "bf16", "bf16", backward, 256) for backward in (False, True)]
    variants = []
    for source, table, target, backward, dim in cases:
        block_h, block_half = _blocks(dim // 2, 32)
        variants.append({
            "signature": {"Q": f"*{source}", "K": f"*{source}", "COS": f"*{table}", "SIN": f"*{table}",
                          "Q_OUT": f"*{target}", "K_OUT": f"*{target}", "seq_len": "i32", "q_heads": "i32",
                          "k_heads": "i32", "half": "i32", "stride_qb": "i32", "stride_qh": "i32",
                          "stride_qs": "i32", "stride_kb": "i32", "stride_kh": "i32", "stride_ks": "i32",
                          "stride_cb": "i32", "stride_cs": "i32"},
            "constexprs": {"BACKWARD": backward, "BLOCK_H": block_h, "BLOCK_HALF": block_half},
            "num_warps": _WARPS, "num_stages": 1, "options": dict(_LAUNCH_OPTIONS),
            "aligned": ["Q", "K", "COS", "SIN", "Q_OUT", "K_OUT", "half", "stride_qb", "stride_qh", "stride_qs",
                        "stride_kb", "stride_kh", "stride_ks", "stride_cb", "stride_cs"],
            "label": f"{'bwd' if backward else 'fwd'}-{source}-cos{table}-out{target}-d{dim}"})
    return variants


aot.register(_rope_kernel, name="rope", variants=_aot_variants())


# --------------------------------------------------------------------------------------------
# Steps (memkernels/fusions/op_spec.py): the forward and the backward, each taking ``backend`` last.


def _forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate(q, k, cos, sin, torch.result_type(q, cos), torch.result_type(k, cos), False, backend)


def _forward_fake(q, k, cos, sin, backend):
    return (reference.empty_rotated(q, torch.result_type(q, cos)),
            reference.empty_rotated(k, torch.result_type(k, cos)))


def _backward(grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              q_dtype: torch.dtype, k_dtype: torch.dtype, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate(grad_q, grad_k, cos, sin, q_dtype, k_dtype, True, backend)


def _backward_fake(grad_q, grad_k, cos, sin, q_dtype, k_dtype, backend):
    return reference.empty_rotated(grad_q, q_dtype), reference.empty_rotated(grad_k, k_dtype)


# --------------------------------------------------------------------------------------------
# Autograd and the declaration: only the tables are saved.


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, backend = inputs
    ctx.save_for_backward(cos, sin)
    ctx.dtypes = (q.dtype, k.dtype)
    ctx.backend = backend


def _backward_formula(ctx, steps, grad_q, grad_k):
    cos, sin = ctx.saved_tensors
    needs_q, needs_k = ctx.needs_input_grad[:2]
    if not (needs_q or needs_k):
        return None, None, None, None, None
    dq, dk = steps.backward(grad_q, grad_k, cos, sin, *ctx.dtypes, ctx.backend)
    return dq if needs_q else None, dk if needs_k else None, None, None, None


ROPE = OpSpec("rope", Step("rope", _forward, _forward_fake),
              steps={"backward": Step("rope_backward", _backward, _backward_fake)},
              setup_context=_setup_context, backward=_backward_formula,
              # PyTorch's autocast has no entry for mul, cat and add, Hugging Face's RoPE: the inputs are taken as
              # they are (16-bit q with float32 tables promote, as eager's products do).
              autocast={"cpu": None, "cuda": None}, fake_on_meta=True)


# --------------------------------------------------------------------------------------------
# Public function


def unsupported(q, k, cos, sin, backend=None):
    """Why :func:`rope` cannot take these arguments, as the exception it raises; None when it can.

    ``backend`` as :func:`rope`'s; with None, the one memkernels.set_backend resolves for q.
    """
    for name, tensor, dims, layout in (("q", q, 4, "[batch, heads, seq, head_dim]"),
                                       ("k", k, 4, "[batch, kv_heads, seq, head_dim]"),
                                       ("cos", cos, 3, "[batch or 1, seq, head_dim]"),
                                       ("sin", sin, 3, "[batch or 1, seq, head_dim]")):
        if not isinstance(tensor, torch.Tensor):
            return TypeError(f"rope: {name} must be a torch.Tensor {layout}, got {type(tensor).__name__}")
        if tensor.dim() != dims:
            return ValueError(f"rope: {name} has shape {tuple(tensor.shape)}; expected {layout} ({dims} dims)")
        if not tensor.is_floating_point():
            return TypeError(f"rope: {name} is {tensor.dtype}; pass a floating-point tensor")
        if tensor.device != q.device:
            return ValueError(f"rope: {name} is on {tensor.device} but q is on {q.device}; move them to one device")
    batch, _, seq, dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, seq, dim):
        return ValueError(f"rope: q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, seq and head_dim "
                          "([batch, heads, seq, head_dim] each)")
    if dim % 2:
        return ValueError(f"rope: head_dim {dim} is odd; the rotate-half form pairs its two halves")
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        return ValueError(f"rope: cos is {tuple(cos.shape)} {cos.dtype} but sin is {tuple(sin.shape)} {sin.dtype}; "
                          "they must match")
    if cos.shape[0] not in (1, batch) or tuple(cos.shape[1:]) != (seq, dim):
        return ValueError(f"rope: cos and sin have shape {tuple(cos.shape)}; expected ({batch} or 1, {seq}, {dim}) "
                          f"for q of shape {tuple(q.shape)} (the tables before Hugging Face's unsqueeze)")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return ValueError("rope: cos or sin requires grad; this RoPE computes no gradient for the tables (position "
                          "tables are constants): pass cos.detach() and sin.detach()")
    try:  # an unknown backend, 'triton' where it cannot run or on a dtype it does not take
        if ROPE.backend(backend, q, what="q") == "triton":
            for name, tensor in (("k", k), ("cos", cos)):
                ROPE.backend("triton", tensor, what=name)
    except (ValueError, TypeError, RuntimeError) as error:
        return error
    return None


def rope(q, k, cos, sin, *, backend=None):
    """Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin)``: ``x * cos + rotate_half(x) * sin`` for x in q, k.

    Args:
        q: [batch, heads, seq, head_dim], head_dim even, any strides (a q_proj output viewed and
            transposed, as Hugging Face's attention passes it).
        k: [batch, kv_heads, seq, head_dim], the same batch, seq and head_dim.
        cos, sin: [batch or 1, seq, head_dim], one dtype; no gradient is computed for them.
        backend: None picks by device (Triton on CUDA, the PyTorch reference elsewhere, see
            memkernels.set_backend); "torch" forces the reference, "triton" the kernel.

    Returns:
        (q_embed, k_embed): q's and k's shapes, dtype ``torch.result_type(x, cos)`` (eager's
        promotion: 16-bit q with float32 tables, as under autocast, gives float32), laid out as
        [batch, seq, heads, head_dim]. Math in float32, rounded once. Only cos and sin are saved for
        backward; the gradients of q and k come in their dtypes.
    """
    problem = unsupported(q, k, cos, sin, backend)
    if problem is not None:
        raise problem
    return rope_checked(q, k, cos, sin, backend)


def rope_checked(q, k, cos, sin, backend=None):
    """:func:`rope` for arguments :func:`unsupported` has accepted (apply()'s redirected attention asks it first,
    to fall back to the model's own RoPE): the checks not run twice a call."""
    return tuple(ROPE(q, k, cos, sin, ROPE.backend(backend, q, what="q")))
