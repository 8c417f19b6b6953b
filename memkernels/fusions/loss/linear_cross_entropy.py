"""LM head + cross-entropy that never materializes the N x V logits.

The matmuls go through torch (cuBLAS on a GPU); the loss and gradient of each
logits chunk are the row kernel of :mod:`memkernels.fusions.loss.cross_entropy` (Triton,
or its PyTorch twin on the CPU path), which writes the gradient into the chunk
in place, so a chunk costs one buffer.

Strategies:

- ``"chunked"``: the forward walks the tokens in chunks and computes the
  gradients there: ``dX`` rows are written once per chunk with ``torch.mm(out=)`` (float32 on the
  CPU: by blocks of classes summed in float64, see :func:`_hidden_grad`),
  ``dW`` (and ``dB``) accumulate in float32 whatever the input dtype: per chunk one
  cuBLAS GEMM with a float32 result per part of the accumulator (half operands,
  float32 accumulation: :mod:`memkernels.fusions.common.half_gemm`; no V x H temporary, no
  separate add pass). What is held until backward —
  ``dX`` (N x H, input dtype), the float32 ``dW`` accumulator (V x H, 4 bytes per
  element) and float64 ``dB`` (V, summed across chunks without a rounding per
  chunk) — goes through ``save_for_backward``, so saved-tensor hooks (offload,
  meters) see it. For half inputs the accumulator lives in two float32 tensors (see
  :func:`_weight_grad_accumulator`): its first ceil(V / 2) rows, whose storage holds
  V x H half elements, and the other rows, so each chunk's update is two GEMMs (one
  per part), and backward rounds the accumulator into the first one's storage, which
  it returns as ``dW``: no V x H half copy of ``dW`` ever sits next to the accumulator
  (that copy, V x H x 2 bytes, would raise the backward's peak by half the accumulator).
  Backward only rescales by the incoming gradient, in place: like
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
  accumulation: :mod:`memkernels.fusions.common.half_gemm`).
- ``"auto"`` (:func:`pick_strategy`): ``"recompute"`` where ``"chunked"`` cannot serve
  (no gradient needed, or ``reduction="none"``); otherwise the faster of the two by
  the GPU audit's cost model, where ``"chunked"``'s memory fits on the device;
  ``"recompute"`` where it does not.

Under ``torch.no_grad()`` (or when nothing requires grad) only the loss is
computed: chunked logits, no gradient buffers.

Vocabulary-parallel, for an LM head sharded over its classes (tensor parallelism): under ``parallelize_module(model, mesh, {"lm_head": ColwiseParallel(...)})`` the head's weight is a DTensor
placed ``Shard(0)``: each of the ``tp`` ranks holds V/tp classes (its rows ``[offset, offset + width)``), and
``linear_cross_entropy`` takes that DTensor as it is (strategy "recompute" only). No rank ever holds a logit of another rank's classes, nor all N x V/tp of its own at once:

- forward, by token chunks: each chunk's local logits ``hidden_rows @ weight_local.T`` (r x V/tp) give per-row
  partial statistics (:func:`partial_rows`: the local max and sum of exponentials, the target's logit where this
  rank owns the target, the smoothing sum); two all-reduces over the N rows (a max, then one sum of three
  float64 columns) combine them into each row's logsumexp over the whole vocabulary and its loss, the same on
  every rank. Held for backward: that logsumexp as (max, log-sum), 8 bytes a token, like ``"recompute"``.
- backward, by tiles of the local classes: the tile's logits are recomputed and turned into their gradient in
  place by the row kernel's column pass (``grad_rows`` with the tile's global column offset), then dW[tile] and
  this rank's share of dX, as ``"recompute"`` does (:func:`tiled_head_backward`).
  dX is a partial sum over the ranks' classes: DTensor adds the shares (one all-reduce, in dX's dtype) on the
  way back to ``hidden``.

Predictions (``return_token_accuracy`` / ``return_predicted_tokens``) take two more all-reduces (the best value,
then the smallest index holding it, or the first NaN) over the N rows. Eager mode only: torch.compile is not
tested through the collectives.

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
what the strategy holds anyway (dX plus the float32 dW), but no chunk under 1024 tokens
nor under 4 x the GPU's FLOPs per byte in tokens (1180 for half inputs, 1024 for
float32; see :func:`chunked_chunk_tokens`, :data:`CHUNKED_MIN_TOKENS`): every chunk
reads and writes all of the float32 dW, so smaller chunks make its update memory-bound;
the chunks are of equal size, so the last one is not short. Llama-3-8B's head at 8192
tokens, bfloat16: 6 chunks of 1366 tokens (334 MiB of logits each; float32: 8 of 1024,
501 MiB each). A chunk of half logits
takes their gradient in place (rounded once to the input dtype, as eager's is); only
with a bias gradient does it go through a float32 chunk first, so that ``dB`` sums
unrounded values. ``chunk_size`` (tokens per chunk) overrides the chunk. Results are
deterministic: reductions are GEMMs and ordered sums, no atomics (which strategy
``"auto"`` picks may depend on the device's free memory: name the strategy for runs
that must match bit for bit).
"""
import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from memkernels import aot
from memkernels.distributed import dtensor_class, is_dtensor, shard_offset, sharded_along
from memkernels.fusions.common.device_guard import on_tensor_device
from memkernels.fusions.common.half_gemm import addmm_float32_
from memkernels.fusions.common.host import cdiv
from memkernels.fusions.loss.common import (check_metric_flags, check_targets_if_cpu, finish_output,
                                            forward_grad_scales, grad_scales, make_config, reduce_rows,
                                            reduction_denominators, validate_loss_args)
from memkernels.fusions.loss.cross_entropy import (cast_rne, partial_rows, predict_rows, predicted_buffer, row_kernels,
                                                   vocab_shard_loss)
from memkernels.fusions.op_spec import OpSpec, Step


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
        tl.store(x_ptr + offsets, cast_rne(x * scale, tl.bfloat16).to(tl.int16, bitcast=True), mask=mask)
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
        _scale_kernel[(cdiv(n_elements, _SCALE_BLOCK),)](
            tensor.view(torch.int16) if bfloat16 else tensor, scale, n_elements, BLOCK=_SCALE_BLOCK,
            BFLOAT16_BITS=bfloat16, num_warps=4)


aot.register(_scale_kernel, name="scale_in_float32", variants=[
    {"signature": {"x_ptr": pointer, "scale_ptr": "*fp32", "n_elements": "i32"},
     "constexprs": {"BLOCK": _SCALE_BLOCK, "BFLOAT16_BITS": bits}, "num_warps": 4, "num_stages": 1,
     "label": label}
    for label, pointer, bits in (("bf16", "*i16", True), ("fp16", "*fp16", False))
])


def _scale_in_float32_(tensor, scale, backend):
    """tensor *= scale (0-d float32), the product taken in float32 and rounded once to tensor's dtype.

    ``tensor.mul_(scale)`` does that on the CPU (a CPU scale is read as a float32 scalar), but a CUDA
    kernel casts a float32 CUDA operand to a half tensor's dtype first: the incoming gradient would
    be rounded to bfloat16 before the product (the H200 run's chunked_backward_only_scales[bf16]).
    Reading the scale on the host instead would synchronize.
    """
    if tensor.dtype not in (torch.float16, torch.bfloat16):
        return tensor.mul_(scale)
    if tensor.is_contiguous() and backend == "triton":
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


# GPU FLOPs per HBM byte at which a pass costs as much as a GEMM (H100 SXM datasheet: 989 TFLOP/s for
# bf16/fp16 tensor-core GEMMs, 67 TFLOP/s float32 without TF32, over 3.35 TB/s).
RIDGE_FLOPS_PER_BYTE = {torch.bfloat16: 295, torch.float16: 295, torch.float32: 20}


# "chunked" chunks have at least this many tokens (unless N has fewer), in every dtype (issue 31.3), and at least
# 4 * ridge (1180 for bf16/fp16): every chunk's dW update reads and writes the whole float32 accumulator. float32's
# ridge (20, FP32 without TF32) alone would allow 80-token chunks, but a float32 GEMM runs on TF32 tensor cores
# wherever torch.backends.cuda.matmul allows it (ridge ~148: ~590 tokens), and below ~1k rows cuBLAS's dW GEMMs
# fall off their efficient sizes; the cost is a larger transient chunk (Llama-3-8B's head at 8192 float32 tokens:
# 8 chunks of 1024, 501 MiB of logits each, instead of 16 of 512).
CHUNKED_MIN_TOKENS = 1024


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


def chunked_chunk_tokens(n_tokens, hidden_size, n_classes, dtype, bias=False, chunk_size=None):
    """Tokens per "chunked" chunk: chunk_size, or by default the N tokens in C chunks of ceil(N / C) (the last
    one up to C - 1 shorter), C as small as keeps a chunk within :func:`chunked_budget` (e bytes a logit, 4 more
    for half inputs with a bias gradient: its float32 chunk) but no chunk under m = max(CHUNKED_MIN_TOKENS,
    4 * ridge) tokens (1180 for bf16/fp16, 1024 for float32) unless N is: a chunk of r tokens reads and writes
    the float32 dW accumulator (8 V H bytes) for the 2 r V H FLOPs of its update, r / 4 FLOPs per byte, so a
    smaller chunk (a short last one included) makes that update memory-bound on a GPU (float32: see
    CHUNKED_MIN_TOKENS). Under 2 m tokens that is one chunk."""
    if chunk_size is not None:
        return chunk_size
    budget = chunked_budget(n_tokens, hidden_size, n_classes, dtype)
    bytes_per_logit = torch.finfo(dtype).bits // 8 + (4 if bias and dtype != torch.float32 else 0)
    fit = max(1, budget // (bytes_per_logit * max(n_classes, 1)))
    minimum = max(CHUNKED_MIN_TOKENS, 4 * RIDGE_FLOPS_PER_BYTE[dtype])
    n_chunks = max(1, min(-(-n_tokens // max(fit, minimum)), n_tokens // minimum))
    return max(1, -(-n_tokens // n_chunks))


def _chunk_elements(dtype, chunk_size, n_classes, budget):
    """Elements per logits chunk: chunk_size tokens, or as many as fit ``budget`` bytes."""
    if chunk_size is not None:
        return chunk_size * n_classes
    half = dtype != torch.float32
    bytes_per_element = torch.finfo(dtype).bits // 8 + (4 if half else 0)
    return max(n_classes, budget // bytes_per_element)


def head_logits(hidden_rows, weight_rows, bias_rows):
    """hidden_rows (R, H) @ weight_rows.T (c, H) (+ bias_rows (c,)): the LM head's logits (R, c), one cuBLAS GEMM."""
    if bias_rows is None:
        return hidden_rows @ weight_rows.t()
    return torch.addmm(bias_rows, hidden_rows, weight_rows.t())


def _weight_grad_accumulator(weight):
    """The zeroed float32 accumulator of dW, as ``(front, rest)``: rows [0, ceil(V / 2)) and the others.

    float32 weight: ``front`` (V, H) is dW itself and ``rest`` is empty. Half weight: ``front``
    (ceil(V / 2), H) and ``rest`` (V // 2, H), 4 bytes per element in all; backward rounds the accumulator
    into ``front``'s storage, which holds V x H half elements, and returns that as dW
    (:func:`_finish_weight_grad`). Both are float32 tensors while held, so whatever copies them (a saved-tensor
    hook, torch.compile) copies float32 values, which keeps every bit.
    """
    if weight.dtype == torch.float32:
        return torch.zeros_like(weight), _empty(weight)
    n_classes, hidden_size = weight.shape
    front = torch.zeros(n_classes - n_classes // 2, hidden_size, dtype=torch.float32, device=weight.device)
    return front, torch.zeros(n_classes // 2, hidden_size, dtype=torch.float32, device=weight.device)


def _weight_grad_parts(front, rest):
    """[(float32 accumulator rows, first class)]: the front (dW itself for float32), then the rest if any."""
    return [(front, 0)] + ([(rest, front.shape[0])] if rest.numel() else [])


def _accumulate_weight_grad(front, rest, grad_rows, hidden_rows):
    """accumulator += grad_rows.T @ hidden_rows in float32: one cuBLAS GEMM with a float32 result per part of the
    accumulator (one for float32, two for half inputs), on operands in the input dtype (half: tensor cores,
    float32 accumulation; :mod:`memkernels.fusions.common.half_gemm`). grad_rows (R, V), hidden_rows (R, H)."""
    for part, start in _weight_grad_parts(front, rest):
        addmm_float32_(part, grad_rows[:, start:start + part.shape[0]].t(), hidden_rows)


# The finish rounds the front's first rows (this fraction of them) through a temporary; later blocks need none.
FINISH_FIRST_BLOCK_FRACTION = 1 / 16


def _finish_weight_grad(front, rest, scale, dtype):
    """dW = accumulator * scale rounded once (to nearest even) to ``dtype``, in the front's own storage.

    float32: the front is dW, scaled in place. Half: dW (V, H) is a ``dtype`` view of the front's storage
    (2 ceil(V / 2) H half elements). Its row i takes bytes [2 i H, 2 (i + 1) H), where the front's float32
    rows [i / 2, (i + 1) / 2) lay, so the front's rows are rounded in order, by blocks [s, e): once e <= 2 s
    a block overwrites only float32 rows already rounded, and it is written directly (one pass: read 4,
    write 2 bytes per element); the first block (FINISH_FIRST_BLOCK_FRACTION of the front) overlaps its own
    float32 rows, so it goes through a temporary. Then the rest's rows land over the front's second half.

    While torch.compile traces the backward, dW is a new tensor instead (V x H x 2 bytes more at the backward's
    peak): functionalization turns the writes through the half view into copies of that view as half values,
    and inductor's copies go through float, which rewrote the unrounded float32 rows' low 16 bits wherever
    they read as a half NaN (dW one ulp off in ~0.4% of the elements).
    """
    if dtype == torch.float32:
        return front.mul_(scale)
    rows, hidden_size = front.shape
    if torch.compiler.is_compiling():
        grad_weight = front.new_empty((rows + rest.shape[0], hidden_size), dtype=dtype)
        torch.mul(front, scale, out=grad_weight[:rows])
        torch.mul(rest, scale, out=grad_weight[rows:])
        return grad_weight
    grad_weight = front.view(-1).view(dtype)[:(rows + rest.shape[0]) * hidden_size].view(-1, hidden_size)
    first = max(1, int(rows * FINISH_FIRST_BLOCK_FRACTION))
    block = torch.empty(first, hidden_size, dtype=dtype, device=front.device)
    grad_weight[:first] = torch.mul(front[:first], scale, out=block)
    start = first
    while start < rows:
        end = min(2 * start, rows)
        torch.mul(front[start:end], scale, out=grad_weight[start:end])
        start = end
    if rest.numel():
        torch.mul(rest, scale, out=grad_weight[rows:])
    return grad_weight


# float32 dX of a chunk on the CPU: one GEMM per this many classes, summed in float64 (_hidden_grad).
HIDDEN_GRAD_VOCAB_BLOCK = 128
# _hidden_grad's batched GEMMs: float32 products of at most this many bytes at a time.
HIDDEN_GRAD_GROUP_BYTES = 2 * 2**20


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

    The blocks go by groups into one batched GEMM (``torch.bmm``: one float32 (R, H) product per block), summed
    over the group in float64: a few ops per chunk instead of two per block, the same sums (a GEMM per block of
    HIDDEN_GRAD_VOCAB_BLOCK classes, float64 across blocks). At 32k classes that was 500 ops per chunk, which
    anything that sees every op (a dispatch mode, the memory meters) paid for: 7 of the 9.5 s of the loss in a
    metered CPU step of tiny-llama. A group holds at most HIDDEN_GRAD_GROUP_BYTES of products (with 16 MiB the
    report's tiny models peaked 13 MiB higher); with their float64 sum that is at most ~2 x that much transient
    beyond the one-block loop's (bench_step's CPU step: 1.45 -> 1.63 MiB). Where a group would hold one block,
    the loop runs as before (each block's GEMM into ``out``): large chunks get no transient beyond it.
    """
    n_classes, block = grad_logits.shape[1], _hidden_grad_block(grad_logits)
    if block >= n_classes:
        torch.mm(grad_logits, weight, out=out)
        return
    n_rows, hidden_size = out.shape
    total = torch.zeros(out.shape, dtype=torch.float64, device=out.device)
    group = max(1, min(n_classes // block, HIDDEN_GRAD_GROUP_BYTES // max(1, n_rows * hidden_size * 4)))
    # Groups of two blocks or more go through bmm; one block at a time, its GEMM goes straight into out (below).
    batched_blocks = n_classes // block if group > 1 else 0
    for first in range(0, batched_blocks, group):
        count = min(group, batched_blocks - first)
        start, end = first * block, (first + count) * block
        products = torch.bmm(grad_logits[:, start:end].view(n_rows, count, block).transpose(0, 1),
                             weight[start:end].view(count, block, hidden_size))
        total += products.sum(0, dtype=torch.float64)
        del products
    for start in range(batched_blocks * block, n_classes, block):  # the last partial block, or every block
        total += torch.mm(grad_logits[:, start:start + block], weight[start:start + block], out=out)
    out.copy_(total)


def _forward_chunks(hidden, weight, target, bias, cfg, chunk_size, reduction, backend, grads=None, predicted=None):
    """Loss over token chunks; with ``grads`` = (dX or None, (front, rest) or None, dB64 or None) also
    the gradients (see :func:`_weight_grad_accumulator` for dW); with ``predicted`` (N,) int64 each token's
    argmax class (-1 where ignored), from the loss's pass over each chunk's logits.

    Returns (loss, z_loss, lse) with lse (N, 2) float32 (the logsumexp as max + log-sum).
    """
    loss_rows, _ = row_kernels(backend)
    check_targets_if_cpu(backend, target, cfg)
    n_tokens = hidden.shape[0]
    if grads is None:
        rows_per_chunk = recompute_chunk_tokens(cfg.n_classes, hidden.dtype, chunk_size)
        denominators = reduction_denominators(target, cfg, reduction)
    else:
        grad_hidden, grad_weight_parts, grad_bias64 = grads
        rows_per_chunk = chunked_chunk_tokens(n_tokens, hidden.shape[1], cfg.n_classes, hidden.dtype,
                                              bias=grad_bias64 is not None, chunk_size=chunk_size)
        denominators, (loss_scale, z_scale) = forward_grad_scales(target, cfg, reduction)
    ce = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
    z = torch.empty_like(ce) if cfg.z_loss else None
    lse = torch.empty(n_tokens, 2, dtype=torch.float32, device=hidden.device)
    for start in range(0, n_tokens, rows_per_chunk):
        end = min(start + rows_per_chunk, n_tokens)
        hidden_rows = hidden[start:end]
        logits = head_logits(hidden_rows, weight, bias)
        predicted_rows = None if predicted is None else predicted[start:end]
        if grads is None:
            ce[start:end], z_rows, lse[start:end] = loss_rows(logits, target[start:end], cfg,
                                                              predicted=predicted_rows)
        else:
            # The GEMMs take the gradient rounded once to the input dtype (as eager's do), written in
            # place over the logits: half operands, float32 accumulation. Half inputs with a bias: the
            # gradient goes to a float32 chunk first, so that dB sums unrounded values.
            half_with_bias = logits.dtype != torch.float32 and grad_bias64 is not None
            grad_chunk = torch.empty_like(logits, dtype=torch.float32) if half_with_bias else logits
            ce[start:end], z_rows, lse[start:end] = loss_rows(logits, target[start:end], cfg, grad=grad_chunk,
                                                              loss_scale=loss_scale, z_scale=z_scale,
                                                              predicted=predicted_rows)
            if grad_bias64 is not None:
                grad_bias64 += grad_chunk.sum(0, dtype=torch.float64)
            rounded = logits if grad_chunk is logits else logits.copy_(grad_chunk)
            if grad_weight_parts is not None:
                _accumulate_weight_grad(*grad_weight_parts, rounded, hidden_rows)
            if grad_hidden is not None:
                _hidden_grad(rounded, weight, grad_hidden[start:end])
            del grad_chunk, rounded
        if z is not None:
            z[start:end] = z_rows
        del logits
    loss, z_loss = reduce_rows(ce, z, denominators, reduction)
    return loss, z_loss, lse


def _recompute_backward(grad_loss, hidden, weight, target, bias, lse, cfg, chunk_size, reduction, needs, backend):
    """Vocabulary-tiled backward from the saved logsumexp; returns (dX, dW, dB), None where not needed."""
    loss_rows, grad_rows = row_kernels(backend)
    cols_per_tile = recompute_tile_classes(hidden.shape[0], cfg.n_classes, hidden.dtype, chunk_size)
    # One tile holds every class: its logsumexp is taken from the recomputed logits in the same launch
    # (the loss kernel with a gradient buffer: one more read of the tile) rather than from the forward's,
    # which a GPU rounds through a GEMM of another shape. The softmax then sums to 1 over exactly the
    # logits the gradient multiplies: with one class p = 1 and the gradient is 0, as eager's.
    whole_rows = cols_per_tile >= cfg.n_classes
    loss_scale, z_scale = grad_scales(grad_loss, reduction_denominators(target, cfg, reduction), reduction, cfg)

    def write_tile_grad(logits, grad_tile, start):
        if whole_rows:
            loss_rows(logits, target, cfg, grad=grad_tile, loss_scale=loss_scale, z_scale=z_scale)
        else:
            grad_rows(logits, target, lse, cfg, grad_tile, loss_scale, z_scale, col_offset=start)

    return tiled_head_backward(hidden, weight, bias, cols_per_tile, needs, write_tile_grad)


def tiled_head_backward(hidden, weight, bias, cols_per_tile, needs, write_tile_grad):
    """The backward of a per-token loss on ``hidden @ weight.T + bias``, tile of classes by tile of classes.

    hidden (N, H), weight (V, H), bias (V,) or None, all one dtype; needs: (dX, dW, dB) wanted.
    ``write_tile_grad(logits, grad_tile, start)`` writes d(loss)/d(logits) of the recomputed tile ``logits``
    (N, c; classes [start, start + c)) into ``grad_tile`` (``logits`` itself, or a float32 tile for half
    inputs with a bias gradient). Returns (dX, dW, dB) in the inputs' dtype, None where not needed:
    dW[tile] is one GEMM over all tokens (no float32 accumulator); dX accumulates in float32 over the tiles
    (half operands, float32 accumulation: :mod:`memkernels.fusions.common.half_gemm`); dB sums in float64.
    """
    needs_hidden, needs_weight, needs_bias = needs
    half = hidden.dtype != torch.float32
    grad_hidden = None
    if needs_hidden:
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    grad_weight = torch.empty_like(weight) if needs_weight else None
    grad_bias = torch.empty_like(bias) if needs_bias else None
    for start in range(0, weight.shape[0], cols_per_tile):
        end = min(start + cols_per_tile, weight.shape[0])
        weight_rows = weight[start:end]
        logits = head_logits(hidden, weight_rows, None if bias is None else bias[start:end])
        # The GEMMs take the gradient rounded once to the input dtype (as eager's do), in the logits
        # buffer: half operands, float32 accumulation (dX over the tiles in float32). Half inputs with
        # a bias: the gradient goes to a float32 tile first, so that dB sums unrounded values.
        grad_tile = torch.empty_like(logits, dtype=torch.float32) if half and needs_bias else logits
        write_tile_grad(logits, grad_tile, start)
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
                       chunk_size: int, predict: bool, backend: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = make_config(weight.shape[0], ignore_index, label_smoothing, softcap, z_loss, class_weight)
    predicted = predicted_buffer(hidden, hidden.shape[0], predict)
    loss, z, lse = _forward_chunks(hidden, weight, target, bias, cfg, chunk_size or None, reduction, backend,
                                   predicted=predicted if predict else None)
    return loss, z, lse, predicted


def _loss_shapes(hidden, z_loss, reduction):
    n_tokens = hidden.shape[0]
    loss = hidden.new_empty((n_tokens,) if reduction == "none" else (), dtype=torch.float32)
    z_shape = (0,) if not z_loss else ((n_tokens,) if reduction == "none" else ())
    return loss, hidden.new_empty(z_shape, dtype=torch.float32)


def _recompute_fake(hidden, weight, target, bias, class_weight, ignore_index, label_smoothing, softcap, z_loss,
                    reduction, chunk_size, predict, backend):
    loss, z = _loss_shapes(hidden, z_loss, reduction)
    return (loss, z, hidden.new_empty((hidden.shape[0], 2), dtype=torch.float32),
            predicted_buffer(hidden, hidden.shape[0], predict))


def _recompute_backward_impl(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                             target: torch.Tensor, bias: Optional[torch.Tensor], lse: torch.Tensor,
                             class_weight: Optional[torch.Tensor], ignore_index: int, label_smoothing: float,
                             softcap: float, z_loss: float, reduction: str, chunk_size: int, needs_hidden: bool,
                             needs_weight: bool, needs_bias: bool, backend: str
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = make_config(weight.shape[0], ignore_index, label_smoothing, softcap, z_loss, class_weight)
    grads = _recompute_backward(grad_loss, hidden, weight, target, bias, lse, cfg, chunk_size or None, reduction,
                                (needs_hidden, needs_weight, needs_bias), backend)
    return tuple(g if g is not None else _empty(hidden) for g in grads)


def _recompute_backward_fake(grad_loss, hidden, weight, target, bias, lse, class_weight, ignore_index,
                             label_smoothing, softcap, z_loss, reduction, chunk_size, needs_hidden, needs_weight,
                             needs_bias, backend):
    return (torch.empty_like(hidden) if needs_hidden else _empty(hidden),
            torch.empty_like(weight) if needs_weight else _empty(hidden),
            torch.empty_like(bias) if needs_bias else _empty(hidden))


def _recompute_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(*output[1:])  # z_loss (returned detached), the logsumexp, the predictions
    # Their gradients arrive as None instead of zero tensors: autograd would launch a fill for each.
    ctx.set_materialize_grads(False)
    hidden, weight, target, bias, class_weight, *options, _, backend = inputs  # predict: forward's alone
    ctx.save_for_backward(hidden, weight, target, bias, class_weight, output[2])
    ctx.options = tuple(options)
    ctx.backend = backend


def _recompute_grad(ctx, steps, grad_loss, grad_z_loss, grad_lse, grad_predicted):
    hidden, weight, target, bias, class_weight, lse = ctx.saved_tensors
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3])
    grads = steps.backward(grad_loss, hidden, weight, target, bias, lse, class_weight, *ctx.options, *needs,
                           ctx.backend)
    grad_hidden, grad_weight, grad_bias = (g if need else None for g, need in zip(grads, needs))
    return (grad_hidden, grad_weight, None, grad_bias) + (None,) * 9


# Under autocast the LM-head matmuls run in the region's dtype, as F.linear's do (hidden, weight and
# bias are cast); the loss is float32 either way, as PyTorch's policy keeps cross-entropy.
_AUTOCAST = {"cpu": "lower_precision_fp", "cuda": "lower_precision_fp"}
_AUTOCAST_CAST = (0, 1, 3)  # hidden, weight, bias
RECOMPUTE = OpSpec(
    "linear_cross_entropy_recompute",
    Step("linear_cross_entropy_recompute", _recompute_forward, _recompute_fake),
    steps={"backward": Step("linear_cross_entropy_recompute_backward", _recompute_backward_impl,
                            _recompute_backward_fake)},
    setup_context=_recompute_setup, backward=_recompute_grad, autocast=_AUTOCAST, casts=_AUTOCAST_CAST,
    triton_dtypes=None)


# ----------------------------------------------------------------------------------------------
# "chunked": returns the gradients it computed, held through save_for_backward


def _chunked_forward(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
                     class_weight: Optional[torch.Tensor], ignore_index: int, label_smoothing: float, softcap: float,
                     z_loss: float, reduction: str, chunk_size: int, predict: bool, needs_hidden: bool,
                     needs_weight: bool, needs_bias: bool, backend: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor]:
    cfg = make_config(weight.shape[0], ignore_index, label_smoothing, softcap, z_loss, class_weight)
    grad_hidden = torch.empty_like(hidden) if needs_hidden else None
    grad_weight_parts = _weight_grad_accumulator(weight) if needs_weight else None
    grad_bias64 = torch.zeros(bias.shape, dtype=torch.float64, device=bias.device) if needs_bias else None
    predicted = predicted_buffer(hidden, hidden.shape[0], predict)
    loss, z_loss_out, _ = _forward_chunks(hidden, weight, target, bias, cfg, chunk_size or None, reduction, backend,
                                          grads=(grad_hidden, grad_weight_parts, grad_bias64),
                                          predicted=predicted if predict else None)
    grad_weight_parts = grad_weight_parts or (_empty(hidden), _empty(hidden))
    grads = tuple(g if g is not None else _empty(hidden) for g in (grad_hidden, grad_bias64))
    return (loss, z_loss_out, predicted, grads[0]) + grad_weight_parts + grads[1:]


def _chunked_fake(hidden, weight, target, bias, class_weight, ignore_index, label_smoothing, softcap, z_loss,
                  reduction, chunk_size, predict, needs_hidden, needs_weight, needs_bias, backend):
    loss, z = _loss_shapes(hidden, z_loss, reduction)
    grad_weight_parts = (_empty(hidden), _empty(hidden))
    if needs_weight:
        n_classes, hidden_size = weight.shape
        half = weight.dtype != torch.float32
        front_rows, rest_rows = (n_classes - n_classes // 2, n_classes // 2) if half else (n_classes, 0)
        grad_weight_parts = (weight.new_empty((front_rows, hidden_size), dtype=torch.float32),
                             weight.new_empty((rest_rows, hidden_size) if half else (0,), dtype=torch.float32))
    return (loss, z, predicted_buffer(hidden, hidden.shape[0], predict),
            torch.empty_like(hidden) if needs_hidden else _empty(hidden),
            *grad_weight_parts,
            bias.new_empty(bias.shape, dtype=torch.float64) if needs_bias else _empty(hidden))


def _chunked_setup(ctx, inputs, output):
    # The held gradients are outputs only to reach save_for_backward: no gradient flows into them,
    # and autograd must not materialize zero V x H gradients for them in the backward.
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*output[3:])
    ctx.dtypes = (inputs[1].dtype, None if inputs[3] is None else inputs[3].dtype)
    ctx.needs = inputs[-4:-1]
    ctx.backend = inputs[-1]


def _chunked_grad(ctx, grad_loss, grad_z_loss, *unused_grads_of_grads):
    grad_hidden, grad_weight_front, grad_weight_rest, grad_bias64 = ctx.saved_tensors
    weight_dtype, bias_dtype = ctx.dtypes
    needs_hidden, needs_weight, needs_bias = ctx.needs
    scale = grad_loss.float()
    # In place: these buffers exist only for this backward (a second backward trips the version check).
    grad_hidden = _scale_in_float32_(grad_hidden, scale, ctx.backend) if needs_hidden else None
    grad_weight = (_finish_weight_grad(grad_weight_front, grad_weight_rest, scale, weight_dtype)
                   if needs_weight else None)
    grad_bias = grad_bias64.mul_(scale).to(bias_dtype) if needs_bias else None
    return (grad_hidden, grad_weight, None, grad_bias) + (None,) * 12


# No backward step: backward scales the gradients forward computed.
CHUNKED = OpSpec(
    "linear_cross_entropy_chunked", Step("linear_cross_entropy_chunked", _chunked_forward, _chunked_fake), steps={},
    setup_context=_chunked_setup, backward=lambda ctx, steps, *grads: _chunked_grad(ctx, *grads),
    autocast=_AUTOCAST, casts=_AUTOCAST_CAST, triton_dtypes=None)


# ----------------------------------------------------------------------------------------------
# vocabulary-parallel: a head sharded over its classes (tensor parallelism; see the module docstring)

class _VocabParallelFunction(torch.autograd.Function):
    """hidden (N, H) (this rank's copy, the same on every rank), weight (V/tp, H) and bias (V/tp,) or None (this
    rank's classes) -> (loss, z-term, predictions) as :func:`linear_cross_entropy` gives them; dX is this rank's
    share of the sum over the ranks."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, cfg, reduction, chunk_size, predict, col_offset, group, backend):
        n_tokens = hidden.shape[0]
        local_max = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
        sums = torch.empty(n_tokens, 3, dtype=torch.float64, device=hidden.device)
        if predict:
            best = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
            indices = torch.empty(n_tokens, 2, dtype=torch.int64, device=hidden.device)
        rows_per_chunk = recompute_chunk_tokens(weight.shape[0], hidden.dtype, chunk_size)
        for start in range(0, n_tokens, rows_per_chunk):
            rows = slice(start, min(start + rows_per_chunk, n_tokens))
            logits = head_logits(hidden[rows], weight, bias)
            local_max[rows], sums[rows] = partial_rows(logits, target[rows], cfg, col_offset)
            if predict:
                best[rows], indices[rows] = predict_rows(logits, col_offset, cfg.n_classes)
            del logits
        loss, z_loss, lse, predicted = vocab_shard_loss(local_max, sums, (best, indices) if predict else None,
                                                        target, cfg, reduction, group)
        ctx.save_for_backward(hidden, weight, bias, target, lse)
        ctx.options = (cfg, reduction, chunk_size, col_offset, backend)
        ctx.mark_non_differentiable(z_loss, predicted)
        ctx.set_materialize_grads(False)
        return loss, z_loss, predicted

    @staticmethod
    def backward(ctx, grad_loss, grad_z_loss, grad_predicted):
        hidden, weight, bias, target, lse = ctx.saved_tensors
        cfg, reduction, chunk_size, col_offset, backend = ctx.options
        _, grad_rows = row_kernels(backend)
        loss_scale, z_scale = grad_scales(grad_loss, reduction_denominators(target, cfg, reduction), reduction, cfg)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])

        def write_tile_grad(logits, grad_tile, start):
            grad_rows(logits, target, lse, cfg, grad_tile, loss_scale, z_scale, col_offset=col_offset + start)

        cols_per_tile = recompute_tile_classes(hidden.shape[0], weight.shape[0], hidden.dtype, chunk_size)
        grad_hidden, grad_weight, grad_bias = tiled_head_backward(hidden, weight, bias, cols_per_tile, needs,
                                                                  write_tile_grad)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None, None


def _head_layout(weight, bias):
    """(mesh, this rank's first class) of a head sharded over its classes on a 1-D mesh."""
    if not sharded_along(weight, 0):
        raise ValueError("linear_cross_entropy: a DTensor weight must be sharded over its classes on a 1-D mesh "
                         f"(placements (Shard(dim=0),), ColwiseParallel's layout of an LM head); got "
                         f"{tuple(weight.placements)} on a {weight.device_mesh.ndim}-D mesh. Pass "
                         "weight.full_tensor() for any other layout")
    if bias is not None and (not sharded_along(bias, 0) or bias.device_mesh != weight.device_mesh):
        raise ValueError("linear_cross_entropy: with a vocabulary-sharded weight the bias must be a DTensor "
                         "sharded the same way (Shard(dim=0) on the weight's mesh)")
    return weight.device_mesh, shard_offset(weight, 0, "linear_cross_entropy: weight")


def _vocab_parallel(hidden, weight, target, bias, cfg, reduction, chunk_size, predict, backend):
    """The loss of :func:`memkernels.fusions.loss.linear_cross_entropy.linear_cross_entropy` for a DTensor ``weight``
    sharded over its classes. ``hidden`` (N, H): a plain tensor (the same on every rank, as the replicated input
    of a ColwiseParallel head) or a DTensor (redistributed to Replicate first: one all-gather where it is
    sharded over tokens). ``target`` (N,) plain. Returns (loss, z-term, predictions), plain tensors,
    equal on every rank; hidden's gradient is summed over the ranks."""
    from torch.distributed.tensor import Partial, Replicate

    mesh, offset = _head_layout(weight, bias)
    if is_dtensor(hidden):
        if hidden.device_mesh != mesh:
            raise ValueError("linear_cross_entropy: hidden is a DTensor on another mesh than the weight's")
        hidden = hidden.redistribute(mesh, [Replicate()])
    else:
        # Its gradient is a partial sum per rank: from_local's backward adds them up (an all-reduce).
        hidden = dtensor_class().from_local(hidden, mesh, [Replicate()], run_check=False)
    hidden_local = hidden.to_local(grad_placements=[Partial()])
    bias_local = None if bias is None else bias.to_local()
    return _VocabParallelFunction.apply(hidden_local, weight.to_local(), bias_local, target, cfg, reduction,
                                        chunk_size, predict, offset, mesh.get_group(), backend)


# ----------------------------------------------------------------------------------------------
# public function


def validate_head(hidden, weight, bias):
    """Raise TypeError/ValueError naming the argument unless hidden (..., H), weight (V, H) and bias (V,) or None
    make an LM head: float32, float16 or bfloat16, one dtype and device. Shared with linear_logprobs."""
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 1:
        raise TypeError("hidden must be a floating-point tensor of shape (..., H)")
    if hidden.dtype not in RIDGE_FLOPS_PER_BYTE:  # the dtypes the chunking rules (and the row kernels) know
        raise TypeError(f"hidden has dtype {hidden.dtype}; supported are float32, float16 and bfloat16 (cast the "
                        "head's input and weight, e.g. .float())")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be the LM head's (V, H) matrix, got shape {tuple(getattr(weight, 'shape', ()))}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight has shape {tuple(weight.shape)} but hidden's last dimension is {hidden.shape[-1]}; "
                         "weight must be (V, H) with H = hidden.shape[-1]")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"weight ({weight.dtype}, {weight.device}) must match hidden ({hidden.dtype}, "
                         f"{hidden.device}); cast one of them")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],)
                             or bias.dtype != hidden.dtype or bias.device != hidden.device):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), dtype {hidden.dtype} and device "
                         f"{hidden.device}; got {tuple(getattr(bias, 'shape', ()))}, {getattr(bias, 'dtype', None)}, "
                         f"{getattr(bias, 'device', None)}")


def _validate(hidden, weight, bias, strategy, chunk_size, reduction):
    validate_head(hidden, weight, bias)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int (tokens per chunk), got {chunk_size!r}")
    if strategy == "chunked" and reduction == "none":
        raise ValueError('strategy="chunked" needs reduction "mean" or "sum" (it computes gradients in the '
                         'forward, before the per-token incoming gradient exists); use strategy="recompute"')


def chunked_peak_bytes(n_tokens, hidden_size, n_classes, dtype, chunk_size=None):
    """Bytes "chunked" allocates beyond its inputs at its peak (the forward's) on a GPU, without a bias: dX
    (N H e), the float32 dW accumulator, whose storage becomes dW (4 V H),
    one chunk of logits (r V e) and the row statistics (the loss and the (max, log-sum) pair: 12 bytes a token,
    and a chunk's own before they are stored: 12 r)."""
    e = torch.finfo(dtype).bits // 8
    rows = min(chunked_chunk_tokens(n_tokens, hidden_size, n_classes, dtype, chunk_size=chunk_size), n_tokens)
    return n_tokens * hidden_size * e + 4 * n_classes * hidden_size + rows * (n_classes * e + 12) + 12 * n_tokens


def _chunked_extra_cost(n_tokens, hidden_size, n_classes, dtype, chunk_size=None):
    """What "chunked" costs on top of recompute's work, in FLOPs at the dtype's GEMM peak (a byte counts ridge
    FLOPs): per chunk of r tokens its dW update moves 8 bytes per element (the float32 accumulator read and
    written) against 2 r FLOPs, max(0, 8 ridge - 2 r) V H beyond them; then the final scaling pass over the
    accumulator (zeroed first: 4 + 6 bytes per element into half dW, 4 + 8 in place for float32)."""
    ridge = RIDGE_FLOPS_PER_BYTE[dtype]
    rows = min(chunked_chunk_tokens(n_tokens, hidden_size, n_classes, dtype, chunk_size=chunk_size),
               max(n_tokens, 1))
    full, last = divmod(n_tokens, rows)
    beyond = [max(0, 8 * ridge - 2 * r) for r in (rows, last)]
    zero_and_finish = 12 if dtype == torch.float32 else 10
    return n_classes * hidden_size * (full * beyond[0] + (beyond[1] if last else 0) + zero_and_finish * ridge)


def _recompute_extra_cost(n_tokens, hidden_size, n_classes, dtype):
    """What "recompute" costs on top of chunked's work, in the same unit: the logits GEMM its backward repeats
    (2 N H V FLOPs) and the one more pass of its loss kernels over the logits (N V e bytes)."""
    e = torch.finfo(dtype).bits // 8
    return 2 * n_tokens * hidden_size * n_classes + RIDGE_FLOPS_PER_BYTE[dtype] * n_tokens * n_classes * e


def _fits_on_device(device, nbytes):
    """Whether ``nbytes`` more can be allocated on ``device`` now: the driver's free memory, then what the caching
    allocator holds unused (PyTorch's, or memkernels' pool when installed). True where that is not asked: off CUDA
    (CPU, meta) and while torch.compile traces."""
    if device is None or device.type != "cuda" or torch.compiler.is_compiling():
        return True
    free = torch.cuda.mem_get_info(device)[0]
    if free >= nbytes:
        return True
    from memkernels.runtime import allocator
    if allocator.installed():
        cached = allocator.stats(device)["free_bytes"]
    else:
        stats = torch.cuda.memory_stats(device)
        cached = stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
    return free + cached >= nbytes


def pick_strategy(strategy, n_tokens, hidden_size, n_classes, dtype, grad_needed, reduction, device=None,
                  chunk_size=None):
    """The documented "auto" rule: the faster strategy where the memory of both fits.

    1. "recompute" where "chunked" cannot serve: no gradient needed (loss only) or reduction "none".
    2. Else the faster by the GPU audit's cost model (:mod:`memkernels.audit.gpu_audit`: per launch
       max(bytes / HBM bandwidth, FLOPs / peak), H100 figures; its ratio RIDGE_FLOPS_PER_BYTE turns bytes into
       FLOPs), counting only what differs. Both run the logits, dX and dW GEMMs (6 N H V FLOPs, compute-bound
       at their default chunks and tiles) and the loss kernels. "recompute" adds a fourth GEMM and a pass over
       the logits (:func:`_recompute_extra_cost`); "chunked" adds its float32 dW accumulator's traffic beyond
       its update GEMMs' FLOPs, and the passes that zero and finish it (:func:`_chunked_extra_cost`). "chunked"
       only if its extra is smaller: at Llama-3-8B's head (H 4096, V 128256) from 1376 tokens in bf16/fp16,
       from 119 in float32. Ties go to "recompute".
    3. "chunked" only where its memory fits: for a CUDA ``device`` its peak (:func:`chunked_peak_bytes`) must
       be free on the device now (the driver's free memory plus the caching allocator's unused cache); off
       CUDA and under torch.compile this is not checked. "recompute" otherwise: it holds 8 bytes per token.
    """
    if strategy != "auto":
        return strategy
    if not grad_needed or reduction == "none":
        return "recompute"
    chunked = _chunked_extra_cost(n_tokens, hidden_size, n_classes, dtype, chunk_size)
    if chunked >= _recompute_extra_cost(n_tokens, hidden_size, n_classes, dtype):
        return "recompute"
    peak = chunked_peak_bytes(n_tokens, hidden_size, n_classes, dtype, chunk_size)
    return "chunked" if _fits_on_device(device, peak) else "recompute"


def linear_cross_entropy(hidden, weight, target, *, bias=None, class_weight=None, ignore_index=-100,
                         label_smoothing=0.0, reduction="mean", softcap=None, z_loss=0.0, strategy="auto",
                         chunk_size=None, return_z_loss=False, return_token_accuracy=False,
                         return_predicted_tokens=False, backend=None):
    """``cross_entropy(hidden @ weight.T + bias, target)`` without materializing the logits.

    Args:
        hidden: (..., H) float32/float16/bfloat16 activations.
        weight: (V, H) LM-head weight, same dtype; bias: optional (V,).
        target: (...) integer class ids in [0, V) or ``ignore_index``. Out of range: ValueError on
            the PyTorch path; the Triton path never reads back to the host, so there that row's loss
            and gradient are NaN instead (any reduction is NaN; check targets yourself when in doubt).
        class_weight: optional (V,) per-class loss weights (PyTorch's ``weight``).
        label_smoothing, reduction, softcap, z_loss, return_z_loss, return_token_accuracy,
        return_predicted_tokens: as in :func:`memkernels.fusions.loss.cross_entropy.cross_entropy`; the
            predictions come from each chunk's logits in the loss's pass (no extra GEMM).
        strategy: "auto", "chunked" or "recompute" (see the module docstring).
        chunk_size: tokens per logits chunk; default: as many as fit the transient budget (16 MiB;
            for "chunked" at least 1/8 of dX + float32 dW and at least 1180 tokens for half inputs, 1024 for
            float32; for "recompute" at least 590 tokens per chunk and 2360 classes per backward tile for half
            inputs, 80 and 160 for float32; see the module docstring).
        backend: None picks by device (Triton on CUDA, the PyTorch reference elsewhere, see
            memkernels.set_backend); "torch" forces the reference, "triton" the kernels.
    Returns:
        float32 loss (shape of ``target`` for reduction "none", else 0-d), or
        ``(loss, z_loss)`` with ``return_z_loss`` (z_loss detached); with either metric flag a
        :class:`memkernels.functional.CrossEntropyOutput`.

    Under ``torch.autocast`` hidden, weight and bias are cast to the region's dtype first (as
    ``F.linear`` casts them) and the loss stays float32 (as PyTorch's policy keeps cross-entropy).
    """
    run = functools.partial(
        _linear_cross_entropy, class_weight=class_weight, ignore_index=ignore_index, label_smoothing=label_smoothing,
        reduction=reduction, softcap=softcap, z_loss=z_loss, strategy=strategy, chunk_size=chunk_size,
        return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy,
        return_predicted_tokens=return_predicted_tokens, backend=backend)
    return RECOMPUTE.with_autocast(run, hidden, weight, target, bias)


def _linear_cross_entropy(hidden, weight, target, bias, *, class_weight, ignore_index, label_smoothing, reduction,
                          softcap, z_loss, strategy, chunk_size, return_z_loss, return_token_accuracy,
                          return_predicted_tokens, backend):
    _validate(hidden, weight, bias, strategy, chunk_size, reduction)
    hidden_size = hidden.shape[-1]
    n_tokens = hidden.numel() // max(hidden_size, 1)
    validate_loss_args(target, weight.shape[0], n_tokens, ignore_index=ignore_index,
                       label_smoothing=label_smoothing, reduction=reduction, softcap=softcap, z_loss=z_loss,
                       class_weight=class_weight, device=hidden.device, weight_name="class_weight")
    check_metric_flags(return_token_accuracy, return_predicted_tokens)
    predict = return_token_accuracy or return_predicted_tokens
    out_shape = target.shape
    backend = RECOMPUTE.backend(backend, hidden, "linear_cross_entropy", "hidden")
    hidden2d = hidden.reshape(n_tokens, hidden_size).contiguous()
    target = (target.full_tensor() if is_dtensor(target) else target).reshape(-1).long()
    weight = weight.contiguous()
    class_weight = None if class_weight is None else class_weight.detach()
    options = (ignore_index, float(label_smoothing), float(softcap) if softcap is not None else 0.0, float(z_loss),
               reduction, chunk_size or 0, predict)
    needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    grad_needed = torch.is_grad_enabled() and any(needs)
    if is_dtensor(hidden) and not is_dtensor(weight):
        raise ValueError("linear_cross_entropy: hidden is a DTensor but weight a plain tensor; pass the head's weight "
                         "as parallelize_module left it (a DTensor sharded over its classes), or hidden.full_tensor()")
    if is_dtensor(weight):
        if strategy == "chunked":
            raise ValueError('strategy="chunked" takes no vocabulary-sharded (DTensor) weight: it would hold a '
                             'float32 dW per rank in the forward; use strategy="auto" or "recompute"')
        cfg = make_config(weight.shape[0], *options[:4], class_weight)
        check_targets_if_cpu(backend, target, cfg)
        loss, z, predicted = _vocab_parallel(hidden2d, weight, target, bias, cfg, reduction, chunk_size, predict,
                                             backend)
        return finish_output(loss, z, out_shape, reduction, return_z_loss, predicted, target, ignore_index,
                             return_token_accuracy, return_predicted_tokens)
    chosen = pick_strategy(strategy, n_tokens, hidden_size, weight.shape[0], hidden.dtype, grad_needed, reduction,
                           device=hidden.device, chunk_size=chunk_size)
    if chosen == "chunked" and grad_needed:
        loss, z, predicted, *_ = CHUNKED(hidden2d, weight, target, bias, class_weight, *options, *needs, backend)
    else:
        loss, z, _, predicted = RECOMPUTE(hidden2d, weight, target, bias, class_weight, *options, backend)
    return finish_output(loss, z, out_shape, reduction, return_z_loss, predicted, target, ignore_index,
                         return_token_accuracy, return_predicted_tokens)
