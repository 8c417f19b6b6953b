"""LM head + cross-entropy that never materializes the N x V logits.

The matmuls go through torch (cuBLAS on a GPU); the loss and gradient of each
logits chunk are the row kernel of :mod:`memkernels.ops.cross_entropy` (Triton,
or its PyTorch twin on the CPU path), which writes the gradient into the chunk
in place, so a chunk costs one buffer.

Strategies:

- ``"chunked"``: the forward walks the tokens in chunks and computes the
  gradients there: ``dX`` rows are written once per chunk with ``torch.mm(out=)`` (float32 on the
  CPU: by blocks of classes summed in float64, see :func:`_hidden_grad`),
  ``dW`` (and ``dB``) accumulate in float32 whatever the input dtype, with
  ``addmm_`` (no V x H temporary per chunk). What is held until backward —
  ``dX`` (N x H, input dtype), the float32 ``dW`` accumulator (V x H, 4 bytes per
  element) and float64 ``dB`` (V, summed across chunks without a rounding per
  chunk) — goes through ``save_for_backward``, so saved-tensor hooks (offload,
  meters) see it. For bfloat16 the float32 accumulator is held as its two 16-bit
  halves (see :func:`_split_accumulator`): the high half is a bfloat16 tensor that
  backward rounds in place and returns as ``dW``, so no float32-to-bfloat16 copy of
  ``dW`` ever sits next to the accumulator (that copy is V x H x 2 bytes). Backward only rescales by the incoming gradient, in place: like
  PyTorch's and Liger's chunked ops it supports a single backward (a second one,
  e.g. with ``retain_graph=True``, raises). Needs a scalar loss: with
  ``reduction="none"`` the per-row incoming gradient is unknown in the forward.
- ``"recompute"`` (Cut Cross-Entropy's idea): the forward keeps only the per-token
  logsumexp, as two float32 (max, log-sum) so the backward's probabilities are as
  accurate as eager's: 8 bytes per token, plus references to the inputs. Backward
  tiles the *vocabulary*: per tile of classes it recomputes ``logits[:, tile]``,
  turns it into its gradient in place (rounded once to the input dtype; for half
  inputs with a bias through a float32 tile, so that ``dB`` sums unrounded values),
  and writes ``dW[tile]`` with a single GEMM over all tokens (so ``dW`` needs no
  float32 accumulator), accumulating ``dX`` in float32 (half operands, float32
  accumulation: :mod:`memkernels.ops._half_gemm`).
- ``"auto"``: ``"chunked"`` when gradients are needed, tokens per call >= hidden
  size, the reduction is scalar (then the N x H ``dX`` it holds is no bigger
  than the work saved) and its passes over the float32 ``dW`` cost less on a GPU
  than the logits GEMM that ``"recompute"`` adds (see :func:`pick_strategy`: on
  bfloat16/float16 inputs at LM-head sizes they never do, on float32 they do);
  ``"recompute"`` otherwise.

Under ``torch.no_grad()`` (or when nothing requires grad) only the loss is
computed: chunked logits, no gradient buffers.

Chunk size: by default a logits chunk (with its float32 working copy for half
inputs) is bounded by a transient budget. For ``"recompute"`` (and loss-only
calls) it is :data:`DEFAULT_CHUNK_BYTES`, and the recompute backward uses
vocabulary tiles with the same number of elements, but a chunk has at least
590 tokens for half inputs (80 for float32) and a tile at least 2360 classes
(160): each chunk re-reads the whole weight and each tile the hidden states and
the float32 dX, so small ones make memory-bound GEMMs on a GPU (see
:func:`recompute_chunk_tokens`, :func:`recompute_tile_classes`). Llama-3-8B's
head at 8192 tokens, bfloat16: 14 chunks of 590 tokens and 55 tiles of 2360
classes, against 390 chunks and 376 tiles with 16 MiB alone. For ``"chunked"`` it is the
larger of :data:`DEFAULT_CHUNK_BYTES` and :data:`CHUNKED_TRANSIENT_FRACTION` of
what the strategy holds anyway (dX plus the float32 dW): every chunk reads and
writes all of dW, so at a large V x H fixed 16 MiB chunks would mean hundreds of
passes over gigabytes (Llama-3-8B's head, 8192 tokens, bfloat16: 390 passes over
2 GiB, against 24 with the fraction). The bfloat16 split accumulator's scratch
block is a quarter of that budget. ``chunk_size`` (tokens per chunk) overrides
the chunk. Results are deterministic: reductions are GEMMs and ordered sums, no
atomics.
"""
import sys
from typing import Optional

import torch
import triton
import triton.language as tl

from memkernels import aot
from memkernels.ops._device_guard import on_tensor_device
from memkernels._backend import resolve
from memkernels.ops import _autocast
from memkernels.ops._half_gemm import addmm_float32_, mm_float32
from memkernels.ops._loss import (check_targets_if_cpu, finish_output, forward_grad_scales, grad_scales, make_config,
                                   reduce_rows, reduction_denominators, validate_loss_args)
from memkernels.ops._custom_op import apply_op, autograd_pair, custom_op
from memkernels.ops.cross_entropy import _cast_rne, row_kernels


@triton.jit
def _add_to_split_float32_kernel(
    high_ptr,  # (n,) int16: upper halves of the float32 accumulator (the bfloat16 dW buffer's bits)
    low_ptr,  # (n,) int16: lower halves of the float32 accumulator
    update_ptr,  # (n,) float32: this chunk's contribution
    n_elements,
    BLOCK: tl.constexpr,
):
    # One pass instead of join + add + split: rebuild each float32 from its halves, add, store the halves.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    high = tl.load(high_ptr + offsets, mask=mask, other=0).to(tl.int32)
    low = tl.load(low_ptr + offsets, mask=mask, other=0).to(tl.int32) & 0xFFFF
    total = ((high << 16) | low).to(tl.float32, bitcast=True) + tl.load(update_ptr + offsets, mask=mask, other=0.0)
    bits = total.to(tl.int32, bitcast=True)
    tl.store(high_ptr + offsets, (bits >> 16).to(tl.int16), mask=mask)
    tl.store(low_ptr + offsets, bits.to(tl.int16), mask=mask)  # int32 -> int16 keeps the low 16 bits


_SPLIT_BLOCK = 1024


@on_tensor_device
def _add_to_split_float32_triton(high, low, update):
    """(high, low) += update; high (R, H) bfloat16, low (R, H) int16, update (R, H) float32, all contiguous."""
    n_elements = update.numel()
    if n_elements:
        _add_to_split_float32_kernel[(triton.cdiv(n_elements, _SPLIT_BLOCK),)](
            high.view(torch.int16), low, update, n_elements, BLOCK=_SPLIT_BLOCK, num_warps=4)


_SPLIT_SIGNATURE = {"high_ptr": "*i16", "low_ptr": "*i16", "update_ptr": "*fp32", "n_elements": "i32"}
# Row blocks of a (V, H) accumulator with H a multiple of 8 start 16-byte aligned: the common case.
aot.register(_add_to_split_float32_kernel, name="add_to_split_float32", variants=[
    {"signature": _SPLIT_SIGNATURE, "constexprs": {"BLOCK": _SPLIT_BLOCK}, "num_warps": 4, "num_stages": 1,
     "label": f"bf16-halves{suffix}", "aligned": aligned}
    for suffix, aligned in (("", ()), ("-aligned", tuple(_SPLIT_SIGNATURE)))
])


@triton.jit
def _scale_kernel(
    x_ptr,  # (n,) float16, or int16: the bits of bfloat16 values; scaled in place
    scale_ptr,  # (1,) float32: the incoming gradient
    n_elements,
    BLOCK: tl.constexpr,
    BFLOAT16_BITS: tl.constexpr,
):
    # x * scale taken in float32 and rounded once (to nearest even) into x's dtype. bfloat16 goes
    # through its bits: widening them is exact everywhere, where the interpreter's bfloat16 load
    # gets subnormals wrong.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    scale = tl.load(scale_ptr)
    if BFLOAT16_BITS:
        x = (tl.load(x_ptr + offsets, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        tl.store(x_ptr + offsets, _cast_rne(x * scale, tl.bfloat16).to(tl.int16, bitcast=True), mask=mask)
    else:
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(x_ptr + offsets, (x * scale).to(x_ptr.dtype.element_ty), mask=mask)


_SCALE_BLOCK = 1024


@on_tensor_device
def _scale_triton(tensor, scale):
    """tensor (any shape, contiguous, float16 / bfloat16) *= scale (0-d float32 on its device)."""
    n_elements = tensor.numel()
    bfloat16 = tensor.dtype == torch.bfloat16
    if n_elements:
        _scale_kernel[(triton.cdiv(n_elements, _SCALE_BLOCK),)](
            tensor.view(torch.int16) if bfloat16 else tensor, scale, n_elements, BLOCK=_SCALE_BLOCK,
            BFLOAT16_BITS=bfloat16, num_warps=4)


aot.register(_scale_kernel, name="scale_in_float32", variants=[
    {"signature": {"x_ptr": pointer, "scale_ptr": "*fp32", "n_elements": "i32"},
     "constexprs": {"BLOCK": _SCALE_BLOCK, "BFLOAT16_BITS": bits}, "num_warps": 4, "num_stages": 1,
     "label": label}
    for label, pointer, bits in (("bf16", "*i16", True), ("fp16", "*fp16", False))
])


def _scale_in_float32_(tensor, scale):
    """tensor *= scale (0-d float32), the product taken in float32 and rounded once to tensor's dtype.

    ``tensor.mul_(scale)`` does that on the CPU (a CPU scale is read as a float32 scalar), but a CUDA
    kernel casts a float32 CUDA operand to a half tensor's dtype first: the incoming gradient would
    be rounded to bfloat16 before the product (the H200 run's chunked_backward_only_scales[bf16]).
    Reading the scale on the host instead would synchronize.
    """
    if tensor.dtype not in (torch.float16, torch.bfloat16):
        return tensor.mul_(scale)
    if tensor.is_contiguous() and resolve(tensor, "linear_cross_entropy") == "triton":
        _scale_triton(tensor, scale)
        return tensor
    if scale.device.type == "cpu":
        return tensor.mul_(scale)
    return tensor.copy_(tensor.float().mul_(scale))  # the PyTorch path on a GPU: one float32 copy


STRATEGIES = ("auto", "chunked", "recompute")
# Budget for the transient logits chunk and its float32 gradient (half inputs): 16 MiB. It favours
# memory; "recompute" raises it to what keeps its GEMMs compute-bound (recompute_chunk_tokens).
DEFAULT_CHUNK_BYTES = 16 * 2**20
# "chunked" may spend this fraction of what it holds anyway (dX + float32 dW) on one chunk: each
# chunk is a full read-modify-write pass over dW, so the chunk count must stay small at large V x H.
CHUNKED_TRANSIENT_FRACTION = 1 / 8
_OP = "linear_cross_entropy"


# GPU FLOPs per HBM byte at which a pass costs as much as a GEMM (H100 SXM datasheet: 989 TFLOP/s for
# bf16/fp16 tensor-core GEMMs, 67 TFLOP/s float32 without TF32, over 3.35 TB/s).
RIDGE_FLOPS_PER_BYTE = {torch.bfloat16: 295, torch.float16: 295, torch.float32: 20}


# The "recompute" chunks and tiles are at least this many times the size at which their GEMM's FLOPs take as
# long as its re-read operand's bytes (headroom for the bytes it also writes).
RIDGE_HEADROOM = 2


def recompute_chunk_tokens(n_classes, dtype, chunk_size=None):
    """Tokens per "recompute" (and loss-only) forward chunk: chunk_size, or as many as fit DEFAULT_CHUNK_BYTES
    but at least RIDGE_HEADROOM * ridge * e / 2 (590 for bf16/fp16, 80 for float32): a chunk of r tokens
    re-reads the weight (V H e bytes) for 2 r H V FLOPs, 2 r / e FLOPs per byte."""
    if chunk_size is not None:
        return chunk_size
    fit = _chunk_elements(dtype, None, n_classes, DEFAULT_CHUNK_BYTES) // max(n_classes, 1)
    return max(1, fit, RIDGE_HEADROOM * RIDGE_FLOPS_PER_BYTE[dtype] * (torch.finfo(dtype).bits // 8) // 2)


def recompute_tile_classes(n_tokens, n_classes, dtype, chunk_size=None):
    """Classes per "recompute" backward tile: as many logits as chunk_size tokens' (default: DEFAULT_CHUNK_BYTES),
    but by default at least RIDGE_HEADROOM * 4 * ridge (2360 for bf16/fp16, 160 for float32): a tile of c
    classes reads and writes the float32 dX (8 N H bytes) for the 2 N H c FLOPs of its dX GEMM, c / 4 per byte."""
    fit = max(1, _chunk_elements(dtype, chunk_size, n_classes, DEFAULT_CHUNK_BYTES) // max(n_tokens, 1))
    return fit if chunk_size is not None else max(fit, RIDGE_HEADROOM * 4 * RIDGE_FLOPS_PER_BYTE[dtype])


def chunked_budget(n_tokens, hidden_size, n_classes, dtype):
    """Transient bytes of one "chunked" step: DEFAULT_CHUNK_BYTES, or more when dX + float32 dW are large."""
    held = n_tokens * hidden_size * (torch.finfo(dtype).bits // 8) + n_classes * hidden_size * 4
    return max(DEFAULT_CHUNK_BYTES, int(held * CHUNKED_TRANSIENT_FRACTION))


def _chunked_budget(hidden, weight):
    return chunked_budget(hidden.shape[0], hidden.shape[1], weight.shape[0], hidden.dtype)


def _chunk_elements(dtype, chunk_size, n_classes, budget):
    """Elements per logits chunk: chunk_size tokens, or as many as fit ``budget`` bytes."""
    if chunk_size is not None:
        return chunk_size * n_classes
    half = dtype != torch.float32
    bytes_per_element = torch.finfo(dtype).bits // 8 + (4 if half else 0)
    return max(n_classes, budget // bytes_per_element)


def _logits(hidden_rows, weight_rows, bias_rows):
    if bias_rows is None:
        return hidden_rows @ weight_rows.t()
    return torch.addmm(bias_rows, hidden_rows, weight_rows.t())


# float32 as two int16 halves in memory order: on a little-endian machine (x86, ARM, CUDA devices)
# the low half comes first. The high half of a float32 is that float32 truncated to bfloat16.
_SPLIT_BFLOAT16 = sys.byteorder == "little"
# The split accumulator's float32 scratch block takes this share of the chunked budget.
SPLIT_SCRATCH_SHARE = 1 / 4


def _weight_grad_accumulator(weight):
    """Zeroed float32 accumulator for dW as ``(high, low)``.

    bfloat16 weight: ``high`` (V, H) bfloat16 holds the accumulator's upper 16 bits
    (its value truncated to bfloat16), ``low`` (V, H) int16 its lower 16 bits.
    Other dtypes: ``high`` is a plain (V, H) float32 tensor and ``low`` is empty.
    """
    if weight.dtype == torch.bfloat16 and _SPLIT_BFLOAT16:
        return torch.zeros_like(weight), torch.zeros(weight.shape, dtype=torch.int16, device=weight.device)
    return torch.zeros(weight.shape, dtype=torch.float32, device=weight.device), _empty(weight)


def _split_scratch_bytes(budget):
    return int(budget * SPLIT_SCRATCH_SHARE)


def _split_blocks(high, scratch_bytes):
    rows = max(1, scratch_bytes // (4 * max(high.shape[1], 1)))
    scratch = torch.empty(min(rows, high.shape[0]), high.shape[1], dtype=torch.float32, device=high.device)
    for start in range(0, high.shape[0], rows):
        end = min(start + rows, high.shape[0])
        yield start, end, scratch[:end - start]


def _join(high, low, out):
    """out (R, H) float32 <- the float32 whose halves are high (R, H) bfloat16 and low (R, H) int16."""
    halves = out.view(torch.int16)  # (R, 2H): low, high, low, high, ...
    halves[:, 0::2] = low
    halves[:, 1::2] = high.view(torch.int16)
    return out


def _split(value, high, low):
    """high, low <- the two halves of value (R, H) float32."""
    halves = value.view(torch.int16)
    low.copy_(halves[:, 0::2])
    high.view(torch.int16).copy_(halves[:, 1::2])


def _accumulate_weight_grad(high, low, grad_chunk, hidden_rows, backend, scratch_bytes):
    """(high, low) += grad_chunk.T @ hidden_rows, accumulated in float32. grad_chunk (R, V) and
    hidden_rows (R, H) in the input dtype: half operands run on the tensor cores (_half_gemm).

    Split accumulator, per block of dW rows: Triton: the GEMM writes a float32 scratch block and one
    kernel adds it to the halves; torch: the halves are joined into the scratch block, ``addmm_``
    adds to it, and it is split back (the same float32 sums, in more passes).
    """
    if low.numel() == 0:
        addmm_float32_(high, grad_chunk.t(), hidden_rows)
        return
    for start, end, scratch in _split_blocks(high, scratch_bytes):
        if backend == "triton":
            mm_float32(grad_chunk[:, start:end].t(), hidden_rows, out=scratch)
            _add_to_split_float32_triton(high[start:end], low[start:end], scratch)
        else:
            accumulator = _join(high[start:end], low[start:end], scratch)
            addmm_float32_(accumulator, grad_chunk[:, start:end].t(), hidden_rows)
            _split(accumulator, high[start:end], low[start:end])


def _finish_weight_grad(high, low, scale, dtype, scratch_bytes):
    """dW = round(accumulator * scale) in ``dtype``; a split accumulator is rounded into ``high`` in place."""
    if low.numel() == 0:
        return high.mul_(scale).to(dtype)
    for start, end, scratch in _split_blocks(high, scratch_bytes):
        high[start:end] = _join(high[start:end], low[start:end], scratch).mul_(scale)  # rounds to nearest even
    return high


# float32 dX of a chunk on the CPU: one GEMM per this many classes, summed in float64 (_hidden_grad).
HIDDEN_GRAD_VOCAB_BLOCK = 128


def _hidden_grad_block(grad_logits):
    """Classes per GEMM of :func:`_hidden_grad`: HIDDEN_GRAD_VOCAB_BLOCK for float32 on the CPU, else all."""
    n_classes = max(grad_logits.shape[1], 1)
    if grad_logits.dtype == torch.float32 and grad_logits.device.type == "cpu":
        return min(HIDDEN_GRAD_VOCAB_BLOCK, n_classes)
    return n_classes


def _hidden_grad(grad_logits, weight, out):
    """out (R, H) = grad_logits (R, V) @ weight (V, H); float32 on the CPU: by blocks of classes.

    Why: a chunk has few rows, and MKL's float32 GEMM for a few rows (measured: 1-3 and 5, not 4
    or 8) sums each length-V dot product in one running total (``addmm_`` too: it starts from the
    output), while eager's GEMM over all tokens sums short blocks: at V = 32003 the chunk's dX was
    ~10x less accurate than eager's (~100 vs ~10 float32 ulps of max|dX|). Here each block of
    HIDDEN_GRAD_VOCAB_BLOCK classes is one GEMM into a float32 scratch, and the blocks add up in
    float64 (as dB does), rounded once: ~4 ulps whatever the rows and the BLAS, for ~20% more
    time in this GEMM (one thread, V = 32003, H = 1024). Half dtypes keep one GEMM: their rounding
    dwarfs the float32 sum's error. On a GPU also one GEMM: extra passes over dX would cost (with
    TF32 more than the GEMM), and cuBLAS on a short last chunk is not measured here (no GPU).
    """
    n_classes, block = grad_logits.shape[1], _hidden_grad_block(grad_logits)
    if block >= n_classes:
        torch.mm(grad_logits, weight, out=out)
        return
    total = torch.zeros(out.shape, dtype=torch.float64, device=out.device)
    for start in range(0, n_classes, block):
        total += torch.mm(grad_logits[:, start:start + block], weight[start:start + block], out=out)
    out.copy_(total)


def _forward_chunks(hidden, weight, target, bias, cfg, chunk_size, reduction, grads=None):
    """Loss over token chunks; with ``grads`` = (dX or None, (dW high, dW low) or None, dB64 or None) also
    the gradients (see :func:`_weight_grad_accumulator` for dW).

    Returns (loss, z_loss, lse) with lse (N, 2) float32 (the logsumexp as max + log-sum).
    """
    backend = resolve(hidden, _OP)
    loss_rows, _ = row_kernels(hidden, _OP)
    check_targets_if_cpu(backend, target, cfg)
    n_tokens = hidden.shape[0]
    if grads is None:
        rows_per_chunk = recompute_chunk_tokens(cfg.n_classes, hidden.dtype, chunk_size)
    else:
        budget = _chunked_budget(hidden, weight)
        rows_per_chunk = max(1, _chunk_elements(hidden.dtype, chunk_size, cfg.n_classes, budget) // cfg.n_classes)
        scratch_bytes = _split_scratch_bytes(budget)
    if grads is None:
        denominators = reduction_denominators(target, cfg, reduction)
    else:
        denominators, (loss_scale, z_scale) = forward_grad_scales(target, cfg, reduction)
    ce = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
    z = torch.empty_like(ce) if cfg.z_loss else None
    lse = torch.empty(n_tokens, 2, dtype=torch.float32, device=hidden.device)
    for start in range(0, n_tokens, rows_per_chunk):
        end = min(start + rows_per_chunk, n_tokens)
        hidden_rows = hidden[start:end]
        logits = _logits(hidden_rows, weight, bias)
        if grads is None:
            ce[start:end], z_rows, lse[start:end] = loss_rows(logits, target[start:end], cfg)
        else:
            # Half inputs: the gradient goes to a float32 chunk (the copy addmm_ needs anyway), so
            # dW and dB sum unrounded values; dX rounds it once, back in the logits buffer.
            grad_chunk = logits if logits.dtype == torch.float32 else torch.empty_like(logits, dtype=torch.float32)
            ce[start:end], z_rows, lse[start:end] = loss_rows(logits, target[start:end], cfg, grad=grad_chunk,
                                                              loss_scale=loss_scale, z_scale=z_scale)
            grad_hidden, grad_weight_halves, grad_bias64 = grads
            # The GEMMs take the gradient rounded once to the input dtype (as eager's do), back in the
            # logits buffer: half operands, float32 accumulation. dB sums the unrounded float32 chunk.
            rounded = logits if grad_chunk is logits else logits.copy_(grad_chunk)
            if grad_weight_halves is not None:
                _accumulate_weight_grad(*grad_weight_halves, rounded, hidden_rows, backend, scratch_bytes)
            if grad_bias64 is not None:
                grad_bias64 += grad_chunk.sum(0, dtype=torch.float64)
            if grad_hidden is not None:
                _hidden_grad(rounded, weight, grad_hidden[start:end])
            del grad_chunk, rounded
        if z is not None:
            z[start:end] = z_rows
        del logits
    loss, z_loss = reduce_rows(ce, z, denominators, reduction)
    return loss, z_loss, lse


def _recompute_backward(grad_loss, hidden, weight, target, bias, lse, cfg, chunk_size, reduction, needs):
    """Vocabulary-tiled backward from the saved logsumexp; returns (dX, dW, dB), None where not needed."""
    loss_rows, grad_rows = row_kernels(hidden, _OP)
    n_tokens = hidden.shape[0]
    cols_per_tile = recompute_tile_classes(n_tokens, cfg.n_classes, hidden.dtype, chunk_size)
    # One tile holds every class: its logsumexp is taken from the recomputed logits in the same launch
    # (the loss kernel with a gradient buffer: one more read of the tile) rather than from the forward's,
    # which a GPU rounds through a GEMM of another shape. The softmax then sums to 1 over exactly the
    # logits the gradient multiplies: with one class p = 1 and the gradient is 0, as eager's.
    whole_rows = cols_per_tile >= cfg.n_classes
    loss_scale, z_scale = grad_scales(grad_loss, reduction_denominators(target, cfg, reduction), reduction, cfg)
    needs_hidden, needs_weight, needs_bias = needs
    half = hidden.dtype != torch.float32
    grad_hidden = None
    if needs_hidden:
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    grad_weight = torch.empty_like(weight) if needs_weight else None
    grad_bias = torch.empty_like(bias) if needs_bias else None
    for start in range(0, cfg.n_classes, cols_per_tile):
        end = min(start + cols_per_tile, cfg.n_classes)
        weight_rows = weight[start:end]
        logits = _logits(hidden, weight_rows, None if bias is None else bias[start:end])
        # The GEMMs take the gradient rounded once to the input dtype (as eager's do), in the logits
        # buffer: half operands, float32 accumulation (dX over the tiles in float32). Half inputs with
        # a bias: the gradient goes to a float32 tile first, so that dB sums unrounded values.
        grad_tile = torch.empty_like(logits, dtype=torch.float32) if half and needs_bias else logits
        if whole_rows:
            loss_rows(logits, target, cfg, grad=grad_tile, loss_scale=loss_scale, z_scale=z_scale)
        else:
            grad_rows(logits, target, lse, cfg, grad_tile, loss_scale, z_scale, col_offset=start)
        if needs_bias:
            grad_bias[start:end] = grad_tile.sum(0, dtype=torch.float64)  # as eager's CPU sum
        rounded = logits if grad_tile is logits else logits.copy_(grad_tile)
        if needs_hidden:
            addmm_float32_(grad_hidden, rounded, weight_rows)
        if needs_weight:
            torch.mm(rounded.t(), hidden, out=grad_weight[start:end])
        del logits, grad_tile, rounded
    if grad_hidden is not None and half:
        grad_hidden = grad_hidden.to(hidden.dtype)
    return grad_hidden, grad_weight, grad_bias


def _empty(reference_tensor):
    return reference_tensor.new_empty(0)


# ----------------------------------------------------------------------------------------------
# "recompute": holds only the logsumexp


def _recompute_forward(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                       bias: Optional[torch.Tensor], class_weight: Optional[torch.Tensor], ignore_index: int,
                       label_smoothing: float, softcap: float, z_loss: float, reduction: str,
                       chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = make_config(weight.shape[0], ignore_index, label_smoothing, softcap, z_loss, class_weight)
    return _forward_chunks(hidden, weight, target, bias, cfg, chunk_size or None, reduction)


def _loss_shapes(hidden, z_loss, reduction):
    n_tokens = hidden.shape[0]
    loss = hidden.new_empty((n_tokens,) if reduction == "none" else (), dtype=torch.float32)
    z_shape = (0,) if not z_loss else ((n_tokens,) if reduction == "none" else ())
    return loss, hidden.new_empty(z_shape, dtype=torch.float32)


def _recompute_fake(hidden, weight, target, bias, class_weight, ignore_index, label_smoothing, softcap, z_loss,
                    reduction, chunk_size):
    loss, z = _loss_shapes(hidden, z_loss, reduction)
    return loss, z, hidden.new_empty((hidden.shape[0], 2), dtype=torch.float32)


def _recompute_backward_impl(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                             target: torch.Tensor, bias: Optional[torch.Tensor], lse: torch.Tensor,
                             class_weight: Optional[torch.Tensor], ignore_index: int, label_smoothing: float,
                             softcap: float, z_loss: float, reduction: str, chunk_size: int, needs_hidden: bool,
                             needs_weight: bool, needs_bias: bool
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = make_config(weight.shape[0], ignore_index, label_smoothing, softcap, z_loss, class_weight)
    grads = _recompute_backward(grad_loss, hidden, weight, target, bias, lse, cfg, chunk_size or None, reduction,
                                (needs_hidden, needs_weight, needs_bias))
    return tuple(g if g is not None else _empty(hidden) for g in grads)


def _recompute_backward_fake(grad_loss, hidden, weight, target, bias, lse, class_weight, ignore_index,
                             label_smoothing, softcap, z_loss, reduction, chunk_size, needs_hidden, needs_weight,
                             needs_bias):
    return (torch.empty_like(hidden) if needs_hidden else _empty(hidden),
            torch.empty_like(weight) if needs_weight else _empty(hidden),
            torch.empty_like(bias) if needs_bias else _empty(hidden))


def _recompute_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(*output[1:])  # z_loss (returned detached) and the logsumexp
    # Their gradients arrive as None instead of zero tensors: autograd would launch a fill for each.
    ctx.set_materialize_grads(False)
    hidden, weight, target, bias, class_weight, *options = inputs
    ctx.save_for_backward(hidden, weight, target, bias, class_weight, output[2])
    ctx.options = tuple(options)


def _recompute_grad_with(backward):
    def _recompute_grad(ctx, grad_loss, grad_z_loss, grad_lse):
        hidden, weight, target, bias, class_weight, lse = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3])
        grads = backward(grad_loss, hidden, weight, target, bias, lse, class_weight, *ctx.options, *needs)
        grad_hidden, grad_weight, grad_bias = (g if need else None for g, need in zip(grads, needs))
        return grad_hidden, grad_weight, None, grad_bias, None, None, None, None, None, None, None
    return _recompute_grad


_recompute_op = custom_op("memkernels::linear_cross_entropy_recompute", _recompute_forward, _recompute_fake)
# Under autocast the LM-head matmuls run in the region's dtype, as F.linear's do (hidden, weight and
# bias are cast); the loss is float32 either way, as PyTorch's policy keeps cross-entropy.
_AUTOCAST = {"cpu": "lower_precision_fp", "cuda": "lower_precision_fp"}
_AUTOCAST_CAST = (0, 1, 3)  # hidden, weight, bias
_autocast.register(_recompute_op._qualname, _AUTOCAST, _AUTOCAST_CAST)
_recompute_backward_op = custom_op("memkernels::linear_cross_entropy_recompute_backward", _recompute_backward_impl,
                                   _recompute_backward_fake)
_RecomputeFunction = autograd_pair(_recompute_op, _recompute_forward, _recompute_setup,
                                   _recompute_grad_with(_recompute_backward_op),
                                   _recompute_grad_with(_recompute_backward_impl))


# ----------------------------------------------------------------------------------------------
# "chunked": returns the gradients it computed, held through save_for_backward


def _chunked_forward(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
                     class_weight: Optional[torch.Tensor], ignore_index: int, label_smoothing: float, softcap: float,
                     z_loss: float, reduction: str, chunk_size: int, needs_hidden: bool, needs_weight: bool,
                     needs_bias: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = make_config(weight.shape[0], ignore_index, label_smoothing, softcap, z_loss, class_weight)
    grad_hidden = torch.empty_like(hidden) if needs_hidden else None
    grad_weight_halves = _weight_grad_accumulator(weight) if needs_weight else None
    grad_bias64 = torch.zeros(bias.shape, dtype=torch.float64, device=bias.device) if needs_bias else None
    loss, z_loss_out, _ = _forward_chunks(hidden, weight, target, bias, cfg, chunk_size or None, reduction,
                                          grads=(grad_hidden, grad_weight_halves, grad_bias64))
    grad_weight_halves = grad_weight_halves or (_empty(hidden), _empty(hidden))
    grads = tuple(g if g is not None else _empty(hidden) for g in (grad_hidden, grad_bias64))
    return (loss, z_loss_out, grads[0]) + grad_weight_halves + grads[1:]


def _chunked_fake(hidden, weight, target, bias, class_weight, ignore_index, label_smoothing, softcap, z_loss,
                  reduction, chunk_size, needs_hidden, needs_weight, needs_bias):
    loss, z = _loss_shapes(hidden, z_loss, reduction)
    grad_weight_halves = _weight_grad_accumulator(weight) if needs_weight else (_empty(hidden), _empty(hidden))
    return (loss, z,
            torch.empty_like(hidden) if needs_hidden else _empty(hidden),
            *grad_weight_halves,
            bias.new_empty(bias.shape, dtype=torch.float64) if needs_bias else _empty(hidden))


def _chunked_setup(ctx, inputs, output):
    # The held gradients are outputs only to reach save_for_backward: no gradient flows into them,
    # and autograd must not materialize zero V x H gradients for them in the backward.
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*output[2:])
    ctx.dtypes = (inputs[1].dtype, None if inputs[3] is None else inputs[3].dtype)
    ctx.scratch_bytes = _split_scratch_bytes(_chunked_budget(inputs[0], inputs[1]))
    ctx.needs = inputs[-3:]


def _chunked_grad(ctx, grad_loss, grad_z_loss, *unused_grads_of_grads):
    grad_hidden, grad_weight_high, grad_weight_low, grad_bias64 = ctx.saved_tensors
    weight_dtype, bias_dtype = ctx.dtypes
    needs_hidden, needs_weight, needs_bias = ctx.needs
    scale = grad_loss.float()
    # In place: these buffers exist only for this backward (a second backward trips the version check).
    grad_hidden = _scale_in_float32_(grad_hidden, scale) if needs_hidden else None
    grad_weight = (_finish_weight_grad(grad_weight_high, grad_weight_low, scale, weight_dtype, ctx.scratch_bytes)
                   if needs_weight else None)
    grad_bias = grad_bias64.mul_(scale).to(bias_dtype) if needs_bias else None
    return grad_hidden, grad_weight, None, grad_bias, None, None, None, None, None, None, None, None, None, None


_chunked_op = custom_op("memkernels::linear_cross_entropy_chunked", _chunked_forward, _chunked_fake)
_autocast.register(_chunked_op._qualname, _AUTOCAST, _AUTOCAST_CAST)
_ChunkedFunction = autograd_pair(_chunked_op, _chunked_forward, _chunked_setup, _chunked_grad, _chunked_grad)


# ----------------------------------------------------------------------------------------------
# public function


def _validate(hidden, weight, bias, strategy, chunk_size, reduction):
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 1:
        raise TypeError("hidden must be a floating-point tensor of shape (..., H)")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be the LM head's (V, H) matrix, got shape {tuple(getattr(weight, 'shape', ()))}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight has shape {tuple(weight.shape)} but hidden's last dimension is {hidden.shape[-1]}; "
                         "weight must be (V, H) with H = hidden.shape[-1]")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"weight ({weight.dtype}, {weight.device}) must match hidden ({hidden.dtype}, "
                         f"{hidden.device}); cast one of them")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != hidden.dtype
                             or bias.device != hidden.device):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), dtype {hidden.dtype} and device "
                         f"{hidden.device}; got {tuple(bias.shape)}, {bias.dtype}, {bias.device}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int (tokens per chunk), got {chunk_size!r}")
    if strategy == "chunked" and reduction == "none":
        raise ValueError('strategy="chunked" needs reduction "mean" or "sum" (it computes gradients in the '
                         'forward, before the per-token incoming gradient exists); use strategy="recompute"')


def _chunked_weight_grad_bytes(n_tokens, hidden_size, n_classes, dtype):
    """HBM bytes of "chunked"'s dW updates at its default chunks: one pass over the float32 accumulator per
    chunk; a pass moves 16 bytes per element for the bfloat16 halves (float32 update block written and
    read, halves read and written), 8 for a float32 accumulator (read and written)."""
    budget = chunked_budget(n_tokens, hidden_size, n_classes, dtype)
    rows = max(1, _chunk_elements(dtype, None, n_classes, budget) // max(n_classes, 1))
    passes = -(-n_tokens // rows)
    per_element = 16 if dtype == torch.bfloat16 and _SPLIT_BFLOAT16 else 8
    return passes * per_element * n_classes * hidden_size


def pick_strategy(strategy, n_tokens, hidden_size, n_classes, dtype, grad_needed, reduction):
    """The documented "auto" rule. "chunked" iff gradients are needed, the loss is scalar, tokens >= hidden
    size (the N x H dX it holds is then no bigger than the work saved) and its dW passes cost less than
    the GEMM "recompute" adds (2 N H V FLOPs) on an H100: bytes * RIDGE_FLOPS_PER_BYTE[dtype] < FLOPs.
    Else "recompute"."""
    if strategy != "auto":
        return strategy
    if not grad_needed or n_tokens < hidden_size or reduction == "none":
        return "recompute"
    extra_gemm_flops = 2 * n_tokens * hidden_size * n_classes
    dw_pass_bytes = _chunked_weight_grad_bytes(n_tokens, hidden_size, n_classes, dtype)
    return "chunked" if dw_pass_bytes * RIDGE_FLOPS_PER_BYTE[dtype] < extra_gemm_flops else "recompute"


def linear_cross_entropy(hidden, weight, target, *, bias=None, class_weight=None, ignore_index=-100,
                         label_smoothing=0.0, reduction="mean", softcap=None, z_loss=0.0, strategy="auto",
                         chunk_size=None, return_z_loss=False):
    """``cross_entropy(hidden @ weight.T + bias, target)`` without materializing the logits.

    Args:
        hidden: (..., H) float32/float16/bfloat16 activations.
        weight: (V, H) LM-head weight, same dtype; bias: optional (V,).
        target: (...) integer class ids in [0, V) or ``ignore_index``.
        class_weight: optional (V,) per-class loss weights (PyTorch's ``weight``).
        label_smoothing, reduction, softcap, z_loss, return_z_loss: as in
            :func:`memkernels.ops.cross_entropy.cross_entropy`.
        strategy: "auto", "chunked" or "recompute" (see the module docstring).
        chunk_size: tokens per logits chunk; default: as many as fit the transient budget (16 MiB;
            for "chunked" at least 1/8 of dX + float32 dW; for "recompute" at least 590 tokens per chunk
            and 2360 classes per backward tile for half inputs, 80 and 160 for float32; see the module
            docstring).
    Returns:
        float32 loss (shape of ``target`` for reduction "none", else 0-d), or
        ``(loss, z_loss)`` with ``return_z_loss`` (z_loss detached).

    Under ``torch.autocast`` hidden, weight and bias are cast to the region's dtype first (as
    ``F.linear`` casts them) and the loss stays float32 (as PyTorch's policy keeps cross-entropy).
    """
    hidden, weight, _, bias = _autocast.cast(_recompute_op._qualname, _autocast.device_type_of((hidden,)),
                                             (hidden, weight, target, bias))
    _validate(hidden, weight, bias, strategy, chunk_size, reduction)
    hidden_size = hidden.shape[-1]
    n_tokens = hidden.numel() // max(hidden_size, 1)
    validate_loss_args(target, weight.shape[0], n_tokens, ignore_index=ignore_index,
                       label_smoothing=label_smoothing, reduction=reduction, softcap=softcap, z_loss=z_loss,
                       class_weight=class_weight, device=hidden.device, weight_name="class_weight")
    out_shape = target.shape
    hidden2d = hidden.reshape(n_tokens, hidden_size).contiguous()
    target = target.reshape(-1).long()
    weight = weight.contiguous()
    class_weight = None if class_weight is None else class_weight.detach()
    options = (ignore_index, float(label_smoothing), float(softcap) if softcap is not None else 0.0, float(z_loss),
               reduction, chunk_size or 0)
    needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    grad_needed = torch.is_grad_enabled() and any(needs)
    chosen = pick_strategy(strategy, n_tokens, hidden_size, weight.shape[0], hidden.dtype, grad_needed, reduction)
    if chosen == "chunked" and grad_needed:
        loss, z, *_ = apply_op(_chunked_op, _ChunkedFunction, hidden2d, weight, target, bias, class_weight,
                               *options, *needs)
    else:
        loss, z, _ = apply_op(_recompute_op, _RecomputeFunction, hidden2d, weight, target, bias, class_weight,
                              *options)
    return finish_output(loss, z, out_shape, reduction, return_z_loss)
