"""Per-token log-probabilities and entropy of the LM head's softmax, without the N x V logits.

What reinforcement-learning fine-tuning (GRPO, PPO, DPO) takes from the policy: ``log p(target)`` per
token, and often the entropy ``-sum p log p`` for a bonus or a log. Trainers build the logits, a float32
log-softmax and gather; at 65k tokens x a 128k vocabulary that is tens of GB. Here (the math is spelled out
in :mod:`memkernels.fusions.loss.logprobs_reference`, the PyTorch twin of the kernel below):

- forward: token chunks; per chunk one cuBLAS GEMM gives its (r, V) logits and one kernel launch reduces
  each row to (max, log-sum[, entropy]), the log-prob and the entropy. Held for backward: those row
  statistics, 8 bytes a token (12 with the entropy), plus references to the inputs;
- backward: vocabulary tiles (:func:`memkernels.fusions.loss.linear_cross_entropy.tiled_head_backward`, shared with
  ``linear_cross_entropy(strategy="recompute")``): each tile's logits are recomputed, turned into their
  gradient in place, ``d z = g_logp (onehot - p) - g_H p (log p + H)``, and feed the dX (float32
  accumulation) and dW GEMMs.

Chunk and tile sizes are linear_cross_entropy's "recompute" ones (at least 590 tokens a chunk and 2360
classes a tile for half inputs, so its GEMMs stay compute-bound on a GPU); ``chunk_size`` overrides them.
Out-of-range targets: the CPU path raises; the Triton path (no host sync) writes NaN into that token's
results and gradient.
"""
import functools
import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from memkernels import aot
from memkernels.fusions.common.device_guard import on_tensor_device
from memkernels.fusions.common.host import next_power_of_2
from memkernels.fusions.loss import logprobs_reference as reference
from memkernels.fusions.loss.cross_entropy import cast_rne, tanh_fp32
from memkernels.fusions.loss.linear_cross_entropy import (head_logits, recompute_chunk_tokens, recompute_tile_classes,
                                                          tiled_head_backward, validate_head)
from memkernels.fusions.loss.reference import check_targets
from memkernels.fusions.op_spec import OpSpec, Step

# Widest vocabulary block one program holds in registers at a time.
MAX_BLOCK_V = 4096


@triton.jit
def _load_scaled(row_ptr, cols, mask, softcap, temperature, HAS_SOFTCAP: tl.constexpr):
    # (z, tanh(x / c)) in fp32: the soft-capped logits over the temperature; the tanh (for the slope) only with
    # a soft-cap, else x itself (unused)
    x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        capped = tanh_fp32(x / softcap)
        x_capped = softcap * capped
    else:
        capped = x
        x_capped = x
    return x_capped / temperature, capped


@triton.jit
def _logprobs_kernel(
    logits_ptr,  # (N, W) logits block, fp32/fp16/bf16, row stride stride_logits, unit column stride
    grad_ptr,  # (N, W) gradient out (may alias logits_ptr), row stride stride_grad; used if WRITE_GRAD
    target_ptr,  # (N,) int64 class ids over the whole vocabulary
    stats_ptr,  # (N, 2 + HAS_ENTROPY) fp32 (max, log-sum[, entropy]) of z: written if COMPUTE_STATS, else read
    logp_ptr,  # (N,) fp32 log p[target]; written if COMPUTE_STATS
    entropy_ptr,  # (N,) fp32 entropy; written if COMPUTE_STATS and HAS_ENTROPY
    grad_logp_ptr,  # (N,) fp32 incoming gradient of logp; read if WRITE_GRAD and HAS_GRAD_LOGP
    grad_entropy_ptr,  # (N,) fp32 incoming gradient of the entropy; read if WRITE_GRAD and HAS_GRAD_ENTROPY
    metrics_ptr,  # (N, 3) fp32 (target is the first argmax, mean z, log sum p^2); written if HAS_METRICS
    stride_logits,
    stride_grad,
    n_cols,  # W: columns in this block (the whole vocabulary when COMPUTE_STATS)
    col_offset,  # class id of column 0 of this block
    n_classes,  # V
    ignore_index,
    softcap,
    temperature,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    HAS_GRAD_LOGP: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    HAS_METRICS: tl.constexpr,  # only with COMPUTE_STATS
    COMPUTE_STATS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_logits
    stats_row = stats_ptr + row * (2 + HAS_ENTROPY)
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    out_of_range = valid & ((target < 0) | (target >= n_classes))
    safe_target = tl.where(valid & (target >= 0) & (target < n_classes), target, 0)
    nan = float("nan")

    if COMPUTE_STATS:
        # Row sums in fp64 (see the cross-entropy kernel). The entropy accumulates sum_j e_j (z_j - m) with
        # e_j = exp(z_j - m) for the running max m: H = log s - that / s, two terms of the order of log V.
        running_max = tl.full((), float("-inf"), tl.float32)
        running_sum = tl.full((), 0.0, tl.float64)
        running_weighted = tl.full((), 0.0, tl.float64)
        if HAS_METRICS:
            z_sum = tl.full((), 0.0, tl.float64)
            running_squares = tl.full((), 0.0, tl.float64)  # sum_j e_j^2 for the running max
            max_before_target = tl.full((), float("-inf"), tl.float32)  # argmax takes the first maximum
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < n_cols
            z, _ = _load_scaled(logits_row, cols, mask, softcap, temperature, HAS_SOFTCAP)
            z = tl.where(mask, z, float("-inf"))  # after the soft-cap: tanh would turn -inf into -c
            new_max = tl.maximum(running_max, tl.max(z, axis=0))
            # An all -inf prefix keeps the max at -inf; shift by 0 then to avoid inf - inf.
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            moved = tl.where(running_max == float("-inf"), 0.0, running_max - shift).to(tl.float64)
            rescale = tl.exp((running_max - shift).to(tl.float64))
            centered = tl.where(mask, z - shift, 0.0)  # padded lanes: 0, not -inf (0 * -inf would be NaN)
            e = tl.where(mask, tl.exp(centered), 0.0)
            if HAS_ENTROPY:
                terms = e.to(tl.float64) * centered.to(tl.float64)
                running_weighted = rescale * (running_weighted + moved * running_sum) + tl.sum(terms, axis=0)
            if HAS_METRICS:
                z_sum += tl.sum(tl.where(mask, z, 0.0).to(tl.float64), axis=0)
                e64 = e.to(tl.float64)
                running_squares = running_squares * rescale * rescale + tl.sum(e64 * e64, axis=0)
                before = tl.where(mask & (cols + col_offset < target), z, float("-inf"))
                max_before_target = tl.maximum(max_before_target, tl.max(before, axis=0))
            running_sum = running_sum * rescale + tl.sum(e.to(tl.float64), axis=0)
            running_max = new_max
        row_max = tl.where(running_max == float("-inf"), 0.0, running_max)
        log_sum64 = tl.log(running_sum)
        target_z, _ = _load_scaled(logits_row, safe_target - col_offset, True, softcap, temperature, HAS_SOFTCAP)
        logp = ((target_z - row_max).to(tl.float64) - log_sum64).to(tl.float32)
        logp = tl.where(out_of_range, nan, tl.where(valid, logp, 0.0))
        tl.store(logp_ptr + row, logp)
        log_sum = log_sum64.to(tl.float32)
        tl.store(stats_row, row_max)
        tl.store(stats_row + 1, log_sum)
        if HAS_ENTROPY:
            entropy = (log_sum64 - running_weighted / running_sum).to(tl.float32)
            tl.store(stats_row + 2, entropy)
            tl.store(entropy_ptr + row, tl.where(out_of_range, nan, tl.where(valid, entropy, 0.0)))
        if HAS_METRICS:
            kept = valid & (out_of_range == 0)
            top1 = kept & (target_z >= row_max) & (target_z > max_before_target)
            mean_z = (z_sum / n_classes).to(tl.float32)
            log_sum_squares = (tl.log(running_squares) - 2.0 * log_sum64).to(tl.float32)
            tl.store(metrics_ptr + row * 3, tl.where(top1, 1.0, 0.0))
            tl.store(metrics_ptr + row * 3 + 1, tl.where(kept, mean_z, 0.0))
            tl.store(metrics_ptr + row * 3 + 2, tl.where(kept, log_sum_squares, 0.0))
    else:
        row_max = tl.load(stats_row)
        log_sum = tl.load(stats_row + 1)
        if HAS_ENTROPY:
            entropy = tl.load(stats_row + 2)

    if WRITE_GRAD:
        if HAS_GRAD_LOGP:
            grad_logp = tl.load(grad_logp_ptr + row)
        else:
            grad_logp = 0.0
        if HAS_GRAD_ENTROPY:
            grad_entropy = tl.load(grad_entropy_ptr + row)
        grad_row = grad_ptr + row * stride_grad
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < n_cols
            z, capped = _load_scaled(logits_row, cols, mask, softcap, temperature, HAS_SOFTCAP)
            # Two parts: a single fp32 lse carries an absolute rounding of eps*|lse| into every log p.
            log_p = (z - row_max) - log_sum
            p = tl.exp(log_p)
            coef = grad_logp
            if HAS_GRAD_ENTROPY:
                coef = coef + grad_entropy * (log_p + entropy)
            g = tl.where(cols + col_offset == target, grad_logp, 0.0) - p * coef
            g = g / temperature
            if HAS_SOFTCAP:
                g *= 1.0 - capped * capped
            g = tl.where(valid, g, 0.0)
            g = tl.where(out_of_range, nan, g)
            tl.store(grad_row + cols, cast_rne(g, grad_ptr.dtype.element_ty), mask=mask)


def _num_warps(block_v):
    return 8 if block_v >= 2048 else 4


def _aot_variants():
    """Each pass (forward statistics, whole-row backward, column-tile backward) for bf16 and fp32 logits and
    the gradient dtypes the backward writes (bf16 logits with a float32 tile: half inputs with a bias), every
    option on (the register-hungriest) and off."""
    passes = [("bf16", 1, 0, "bf16", "stats"), ("fp32", 1, 0, "fp32", "stats")]
    for dtype, grad_dtype in (("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "fp32")):
        passes.append((dtype, 1, 1, grad_dtype, f"stats+grad:{grad_dtype}"))
        passes.append((dtype, 0, 1, grad_dtype, f"grad-only:{grad_dtype}"))
    variants = []
    for dtype, compute_stats, write_grad, grad_dtype, pass_label in passes:
        for features in (0, 1):
            signature = {
                "logits_ptr": f"*{dtype}", "grad_ptr": f"*{grad_dtype}", "target_ptr": "*i64", "stats_ptr": "*fp32",
                "logp_ptr": "*fp32", "entropy_ptr": "*fp32", "grad_logp_ptr": "*fp32", "grad_entropy_ptr": "*fp32",
                "metrics_ptr": "*fp32",
                "stride_logits": "i32", "stride_grad": "i32", "n_cols": "i32", "col_offset": "i32",
                "n_classes": "i32", "ignore_index": "i32", "softcap": "fp32", "temperature": "fp32",
            }
            constexprs = {"HAS_SOFTCAP": features, "HAS_ENTROPY": features, "HAS_GRAD_LOGP": 1,
                          "HAS_GRAD_ENTROPY": features * write_grad, "HAS_METRICS": features * (1 - write_grad),
                          "COMPUTE_STATS": compute_stats,
                          "WRITE_GRAD": write_grad, "BLOCK_V": MAX_BLOCK_V}
            variants.append({"signature": signature, "constexprs": constexprs, "num_warps": _num_warps(MAX_BLOCK_V),
                             "num_stages": 1,
                             "label": f"{dtype}-{pass_label}-{'all-options' if features else 'plain'}"})
    return variants


aot.register(_logprobs_kernel, name="linear_logprobs", variants=_aot_variants())


@on_tensor_device
def _launch(logits, target, stats, cfg, *, logp=None, entropy=None, metrics=None, grad=None, grad_logp=None,
            grad_entropy=None, col_offset=0):
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    compute_stats, write_grad = logp is not None, grad is not None
    dummy = stats  # any fp32 tensor stands in for pointers a variant never reads
    block_v = min(MAX_BLOCK_V, next_power_of_2(n_cols))
    _logprobs_kernel[(n_rows,)](
        logits, grad if write_grad else logits, target, stats,
        logp if compute_stats else dummy,
        entropy if (compute_stats and entropy is not None) else dummy,
        grad_logp if grad_logp is not None else dummy,
        grad_entropy if grad_entropy is not None else dummy,
        metrics if metrics is not None else dummy,
        logits.stride(0), grad.stride(0) if write_grad else logits.stride(0), n_cols, col_offset, cfg.n_classes,
        cfg.ignore_index, cfg.softcap if cfg.softcap else 1.0, cfg.temperature,
        HAS_SOFTCAP=bool(cfg.softcap), HAS_ENTROPY=cfg.with_entropy, HAS_GRAD_LOGP=grad_logp is not None,
        HAS_GRAD_ENTROPY=grad_entropy is not None, HAS_METRICS=metrics is not None, COMPUTE_STATS=compute_stats, WRITE_GRAD=write_grad,
        BLOCK_V=block_v, num_warps=_num_warps(block_v),
    )


def stats_rows_triton(logits, target, cfg, *, grad=None, grad_logp=None, grad_entropy=None):
    """Triton twin of :func:`memkernels.fusions.loss.logprobs_reference.stats_rows` (same contract)."""
    n_rows = logits.shape[0]
    logp = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logp) if cfg.with_entropy else None
    stats = torch.empty(n_rows, 3 if cfg.with_entropy else 2, dtype=torch.float32, device=logits.device)
    metrics = torch.empty(n_rows, 3, dtype=torch.float32, device=logits.device) if cfg.with_metrics else None
    _launch(logits, target, stats, cfg, logp=logp, entropy=entropy, metrics=metrics, grad=grad, grad_logp=grad_logp,
            grad_entropy=grad_entropy)
    return logp, entropy, stats, metrics


def grad_cols_triton(logits, target, stats, cfg, grad, grad_logp, grad_entropy, *, col_offset=0):
    """Triton twin of :func:`memkernels.fusions.loss.logprobs_reference.grad_cols` (same contract)."""
    _launch(logits, target, stats, cfg, grad=grad, grad_logp=grad_logp, grad_entropy=grad_entropy,
            col_offset=col_offset)


def _row_kernels(backend):
    """(stats_rows, grad_cols) of ``backend`` ("triton" or "torch")."""
    if backend == "triton":
        return stats_rows_triton, grad_cols_triton
    return reference.stats_rows, reference.grad_cols


# ----------------------------------------------------------------------------------------------
# the custom op and its autograd


def _forward(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
             ignore_index: int, softcap: float, temperature: float, with_entropy: bool, with_metrics: bool,
             chunk_size: int, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = reference.LogprobConfig(weight.shape[0], ignore_index, softcap, temperature, with_entropy, with_metrics)
    stats_rows, _ = _row_kernels(backend)
    if backend == "torch" and target.device.type == "cpu":
        check_targets(target, cfg.n_classes, ignore_index)
    n_tokens = hidden.shape[0]
    rows_per_chunk = recompute_chunk_tokens(cfg.n_classes, hidden.dtype, chunk_size or None)
    logp = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
    entropy = torch.empty(n_tokens if with_entropy else 0, dtype=torch.float32, device=hidden.device)
    stats = torch.empty(n_tokens, 3 if with_entropy else 2, dtype=torch.float32, device=hidden.device)
    metrics = torch.empty(n_tokens if with_metrics else 0, 3, dtype=torch.float32, device=hidden.device)
    for start in range(0, n_tokens, rows_per_chunk):
        end = min(start + rows_per_chunk, n_tokens)
        logits = head_logits(hidden[start:end], weight, bias)
        logp[start:end], entropy_rows, stats[start:end], metrics_rows = stats_rows(logits, target[start:end], cfg)
        if with_entropy:
            entropy[start:end] = entropy_rows
        if with_metrics:
            metrics[start:end] = metrics_rows
        del logits
    return logp, entropy, stats, metrics


def _forward_fake(hidden, weight, target, bias, ignore_index, softcap, temperature, with_entropy, with_metrics,
                  chunk_size, backend):
    n_tokens = hidden.shape[0]
    return (hidden.new_empty((n_tokens,), dtype=torch.float32),
            hidden.new_empty((n_tokens if with_entropy else 0,), dtype=torch.float32),
            hidden.new_empty((n_tokens, 3 if with_entropy else 2), dtype=torch.float32),
            hidden.new_empty((n_tokens if with_metrics else 0, 3), dtype=torch.float32))


def _backward(grad_logp: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor], hidden: torch.Tensor,
              weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor], stats: torch.Tensor,
              ignore_index: int, softcap: float, temperature: float, with_entropy: bool, with_metrics: bool,
              chunk_size: int, needs_hidden: bool, needs_weight: bool, needs_bias: bool, backend: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = reference.LogprobConfig(weight.shape[0], ignore_index, softcap, temperature, with_entropy, False)
    stats_rows, grad_cols = _row_kernels(backend)
    grad_logp = None if grad_logp is None else grad_logp.float().contiguous()
    grad_entropy = None if grad_entropy is None or not with_entropy else grad_entropy.float().contiguous()
    cols_per_tile = recompute_tile_classes(hidden.shape[0], cfg.n_classes, hidden.dtype, chunk_size or None)
    # One tile holds every class: the statistics come from the recomputed logits in the same launch, so the
    # softmax sums to 1 over exactly the logits the gradient multiplies (one class: p = 1, gradient 0, as eager).
    whole_rows = cols_per_tile >= cfg.n_classes

    def write_tile_grad(logits, grad_tile, start):
        if whole_rows:
            stats_rows(logits, target, cfg, grad=grad_tile, grad_logp=grad_logp, grad_entropy=grad_entropy)
        else:
            grad_cols(logits, target, stats, cfg, grad_tile, grad_logp, grad_entropy, col_offset=start)

    grads = tiled_head_backward(hidden, weight, bias, cols_per_tile, (needs_hidden, needs_weight, needs_bias),
                                write_tile_grad)
    return tuple(g if g is not None else hidden.new_empty(0) for g in grads)


def _backward_fake(grad_logp, grad_entropy, hidden, weight, target, bias, stats, ignore_index, softcap, temperature,
                   with_entropy, with_metrics, chunk_size, needs_hidden, needs_weight, needs_bias, backend):
    return (torch.empty_like(hidden) if needs_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if needs_weight else hidden.new_empty(0),
            torch.empty_like(bias) if needs_bias else hidden.new_empty(0))


def _setup(ctx, inputs, output):
    hidden, weight, target, bias, *options, backend = inputs
    logp, entropy, stats, metrics = output
    ctx.mark_non_differentiable(stats, metrics)
    if not entropy.numel():
        ctx.mark_non_differentiable(entropy)
    # A gradient that does not arrive (only logp or only the entropy used) comes as None, not a zero tensor.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(hidden, weight, target, bias, stats)
    ctx.options = tuple(options)
    ctx.backend = backend


def _grad(ctx, steps, grad_logp, grad_entropy, grad_stats, grad_metrics):
    hidden, weight, target, bias, stats = ctx.saved_tensors
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3])
    if grad_logp is None and grad_entropy is None:
        return (None,) * 11
    grads = steps.backward(grad_logp, grad_entropy, hidden, weight, target, bias, stats, *ctx.options, *needs,
                           ctx.backend)
    grad_hidden, grad_weight, grad_bias = (g if need else None for g, need in zip(grads, needs))
    return (grad_hidden, grad_weight, None, grad_bias) + (None,) * 7


LINEAR_LOGPROBS = OpSpec(
    "linear_logprobs", Step("linear_logprobs", _forward, _forward_fake),
    steps={"backward": Step("linear_logprobs_backward", _backward, _backward_fake)},
    setup_context=_setup, backward=_grad,
    # Under autocast the head's GEMMs run in the region's dtype, as F.linear's do; the results stay float32.
    autocast={"cpu": "lower_precision_fp", "cuda": "lower_precision_fp"}, casts=(0, 1, 3), triton_dtypes=None)


# ----------------------------------------------------------------------------------------------
# public function


def _validate(hidden, weight, target, bias, temperature, softcap, ignore_index, chunk_size):
    validate_head(hidden, weight, bias)
    if weight.shape[0] < 1:
        raise ValueError("weight must have at least one row (the vocabulary size V >= 1)")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a tensor of token ids, got {type(target).__name__}")
    if target.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"target must hold integer token ids (e.g. torch.long), got dtype {target.dtype}")
    n_tokens = math.prod(hidden.shape[:-1])
    if target.numel() != n_tokens:
        raise ValueError(f"target has {target.numel()} elements (shape {tuple(target.shape)}) but hidden has "
                         f"{n_tokens} tokens (shape {tuple(hidden.shape)}); they must match one token id per row")
    if target.device != hidden.device:
        raise ValueError(f"target is on {target.device} but hidden is on {hidden.device}; move it with .to()")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not (math.isfinite(softcap) and softcap > 0)):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int (tokens per chunk), got {chunk_size!r}")


class LogprobMetrics(NamedTuple):
    """Per-token statistics of the same distribution that trainers log (no gradient), each of target's shape;
    False / 0 for ignored tokens. z is the soft-capped logits over the temperature."""

    is_top1: torch.Tensor  # bool: the target is z's first argmax (torch.argmax's rule for ties)
    mean_logit: torch.Tensor  # float32: the mean of z over the vocabulary
    log_sum_sq_probs: torch.Tensor  # float32: log sum_j p_j^2 (the log of the probability two samples agree)


def linear_logprobs(hidden, weight, target, *, bias=None, temperature=1.0, softcap=None, return_entropy=False,
                    return_metrics=False, chunk_size=None, ignore_index=-100, backend=None):
    """``log_softmax(cap(hidden @ weight.T + bias) / temperature)[target]`` per token, without the logits.

    Args:
        hidden: (..., H) float32/float16/bfloat16 final hidden states.
        weight: (V, H) LM-head weight, same dtype; bias: optional (V,).
        target: (...) integer token ids in [0, V) or ``ignore_index``, one per row of hidden. Out of
            range: ValueError on the PyTorch path; the Triton path never reads back to the host, so
            there the row's results are NaN instead (check targets yourself when in doubt).
        temperature: the sampling temperature the logits are divided by (after the soft-cap), > 0.
        softcap: optional c > 0: the logits are ``c * tanh(logits / c)`` first (Gemma-2's final soft-cap).
        return_entropy: also return the per-token entropy ``-sum p log p`` of the same distribution.
        return_metrics: also return a :class:`LogprobMetrics` (is the target the argmax, mean logit, log sum p^2),
            computed in the forward's pass over each row (no extra GEMM), without gradient.
        chunk_size: tokens per forward chunk (and the backward's tile of classes holds as many logits);
            default: linear_cross_entropy's "recompute" sizes (see :mod:`memkernels.fusions.loss.linear_cross_entropy`).
        ignore_index: tokens with this target give 0 (log-prob and entropy) and no gradient.
        backend: None picks by device (Triton on CUDA, the PyTorch reference elsewhere, see
            memkernels.set_backend); "torch" forces the reference, "triton" the kernels.
    Returns:
        logp, float32 of ``target``'s shape; ``(logp, entropy)`` with ``return_entropy``; the metrics last with
        ``return_metrics``. logp and the entropy are differentiable with respect to hidden, weight and bias.

    Memory: between forward and backward 8 bytes a token (12 with the entropy) beyond the inputs; the
    largest transient is one chunk of logits (by default about 16 MiB, at least 590 tokens a chunk for half
    inputs). Under ``torch.autocast`` hidden, weight and bias are cast to the region's dtype first, as
    ``F.linear`` casts them; the results stay float32.
    """
    run = functools.partial(_linear_logprobs, temperature=temperature, softcap=softcap, return_entropy=return_entropy,
                            return_metrics=return_metrics, chunk_size=chunk_size, ignore_index=ignore_index,
                            backend=backend)
    return LINEAR_LOGPROBS.with_autocast(run, hidden, weight, target, bias)


def _linear_logprobs(hidden, weight, target, bias, *, temperature, softcap, return_entropy, return_metrics,
                     chunk_size, ignore_index, backend):
    _validate(hidden, weight, target, bias, temperature, softcap, ignore_index, chunk_size)
    hidden_size = hidden.shape[-1]
    n_tokens = target.numel()
    out_shape = target.shape
    hidden2d = hidden.reshape(n_tokens, hidden_size).contiguous()
    logp, entropy, _, metrics = LINEAR_LOGPROBS(
        hidden2d, weight.contiguous(), target.reshape(-1).long(), bias, ignore_index,
        float(softcap) if softcap is not None else 0.0, float(temperature), bool(return_entropy), bool(return_metrics),
        chunk_size or 0, LINEAR_LOGPROBS.backend(backend, hidden, "linear_logprobs", "hidden"))
    results = [logp.view(out_shape)]
    if return_entropy:
        results.append(entropy.view(out_shape))
    if return_metrics:
        results.append(LogprobMetrics(metrics[:, 0].view(out_shape) != 0, metrics[:, 1].view(out_shape),
                                      metrics[:, 2].view(out_shape)))
    return results[0] if len(results) == 1 else tuple(results)
