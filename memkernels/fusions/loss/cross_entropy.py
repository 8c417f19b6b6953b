"""Cross-entropy over huge vocabularies: one Triton program per row, online logsumexp over V.

The math (label smoothing exactly as PyTorch defines it, with class weights,
soft-cap ``c * tanh(x / c)``, z-loss ``z * lse**2``) is spelled out in
:mod:`memkernels.fusions.loss.reference`, the pure-PyTorch twin of the kernel
below; both implement the same two primitives (``loss_rows`` / ``grad_rows``)
that the memory-lean algorithms here and in ``linear_cross_entropy`` build on.

Memory contract of :func:`cross_entropy`:

- default: forward saves only the per-row logsumexp (two float32, 8 bytes per row) and
  references to the logits and targets, which the caller holds anyway; backward
  writes the gradient straight into the tensor it returns (no V-sized scratch).
- ``inplace_backward=True``: the forward overwrites the caller's logits with the
  gradient (scaled for the reduction) and backward only rescales it by the
  incoming gradient, so no N x V gradient is ever allocated. This destroys the
  logits, so it is opt-in and refused unless it is safe by construction:
  the logits must require grad, be a non-leaf, own their storage (not a view) and
  be contiguous. The version counter is bumped, so an op that saved these
  logits for its own backward makes autograd raise rather than read gradients.
  What no check can see is a caller reading the logits again after the loss
  (e.g. for accuracy): that is the caller's promise when opting in. It is an
  eager-mode feature (a plain autograd.Function, not the custom op); it has not
  been tested under torch.compile.

Out-of-range targets (neither ``ignore_index`` nor in ``[0, V)``): the CPU
reference path raises ValueError; the Triton path, which must not synchronize
with the host, writes NaN into that row's loss (so any reduction is NaN) and
its gradient.

Reduction ``mean`` divides the cross-entropy by the summed class weight of the
non-ignored targets (PyTorch's rule; the count when unweighted) and the z-term
by the count of non-ignored targets. With every target ignored, ``mean`` is NaN
and the gradient is zero, as in PyTorch.
"""
from typing import Optional

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from memkernels import aot
from memkernels.distributed import is_dtensor, shard_offset
from memkernels.fusions.common.device_guard import on_tensor_device
from memkernels.fusions.common.host import next_power_of_2
from memkernels.fusions.loss import reference
from memkernels.fusions.loss.common import (check_metric_flags, check_targets_if_cpu, finish_output,
                                            forward_grad_scales, grad_scales, make_config, reduce_rows,
                                            reduction_denominators, validate_loss_args)
from memkernels.fusions.loss.reference import finish_rows, row_blocks
from memkernels.fusions.op_spec import OpSpec, Step

# Widest vocabulary block one program holds in registers at a time.
MAX_BLOCK_V = 4096


@triton.jit
def tanh_fp32(u):
    # libdevice is a stub under the interpreter, so tanh is built from exp. For |u| >= 0.7,
    # 1 - 2 / (exp(2|u|) + 1) (exp overflowing to inf gives exactly 1); below, where that
    # cancels, the odd Taylor series to u^19. Measured in fp32 against float64 on [0, 9]:
    # max 1.5 ulp, mean 0.26 ulp (numpy's float32 tanh: 1.4 / 0.37).
    a = tl.abs(u)
    large = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
    s = a * a
    series = 0.0005900274409455859 + s * -0.00023912911424355248
    series = -0.0014558343870513183 + s * series
    series = 0.003592128036572481 + s * series
    series = -0.008863235529902197 + s * series
    series = 0.021869488536155203 + s * series
    series = -0.05396825396825397 + s * series
    series = 0.13333333333333333 + s * series
    series = -0.3333333333333333 + s * series
    small = a + a * (s * series)
    magnitude = tl.where(a < 0.7, small, large)
    return tl.where(u < 0, -magnitude, magnitude)


@triton.jit
def cast_rne(x, dtype: tl.constexpr):
    # fp32 -> dtype, rounding to nearest even. For bf16 the rounding is done on the bits: the
    # interpreter's bf16 cast truncates, and this gives the same bits as the GPU's cvt.rn there.
    # A NaN keeps its sign and high payload, made quiet: the rounding carry would turn a NaN whose low
    # bits are set into -0.0 (0x7FFFFFFF, CUDA's canonical NaN) or +inf (0x7F800001). Infinities and
    # overflow to infinity come out of the rounding itself.
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        bits = tl.where(x != x, bits | 0x00400000, rounded)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _cross_entropy_kernel(
    logits_ptr,  # (N, W) logits block, fp32/fp16/bf16, row stride stride_logits, unit column stride
    grad_ptr,  # (N, W) gradient out (may alias logits_ptr), row stride stride_grad; used if WRITE_GRAD
    target_ptr,  # (N,) int64 class ids over the whole vocabulary
    class_weight_ptr,  # (V,) fp32 class weights; read if HAS_WEIGHT
    class_weight_sum_ptr,  # (1,) fp64 sum of the class weights; read if HAS_WEIGHT and SMOOTHING
    lse_ptr,  # (N, 2) fp32 logsumexp per row as (max, log-sum-exp below the max): written if COMPUTE_LOSS,
    #           else read
    loss_ptr,  # (N,) fp32 per-row cross-entropy (with smoothing); written if COMPUTE_LOSS
    z_ptr,  # (N,) fp32 per-row z-term z_loss * lse^2; written if COMPUTE_LOSS and HAS_Z
    loss_scale_ptr,  # (1,) or (N,) fp32 d(total)/d(row cross-entropy); read if WRITE_GRAD
    z_scale_ptr,  # (1,) or (N,) fp32 d(total)/d(row z-term); read if WRITE_GRAD and HAS_Z
    predicted_ptr,  # (N,) int64 argmax of each row, -1 for ignored rows; written if COMPUTE_LOSS and PREDICT
    stride_logits,
    stride_grad,
    n_cols,  # W: columns in this block (the whole vocabulary when COMPUTE_LOSS)
    col_offset,  # class id of column 0 of this block
    n_classes,  # V
    ignore_index,
    smoothing,  # label smoothing epsilon
    smoothing_per_class,  # epsilon / V
    softcap,
    z_loss,
    SCALE_STRIDE: tl.constexpr,  # 0: one scale for all rows, 1: one per row (reduction "none")
    HAS_WEIGHT: tl.constexpr,
    SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_Z: tl.constexpr,
    COMPUTE_LOSS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    PREDICT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_logits
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    out_of_range = valid & ((target < 0) | (target >= n_classes))
    safe_target = tl.where(valid & (target >= 0) & (target < n_classes), target, 0)
    if HAS_WEIGHT:
        target_weight = tl.load(class_weight_ptr + safe_target)
    else:
        target_weight = 1.0
    if SMOOTHING:
        if HAS_WEIGHT:
            weight_sum = tl.load(class_weight_sum_ptr)  # fp64: an fp32 sum of V weights is off by ulps
            weight_sum32 = weight_sum.to(tl.float32)
        else:
            weight_sum = n_classes * 1.0
            weight_sum32 = weight_sum
    nan = float("nan")

    if COMPUTE_LOSS:
        # Row sums accumulate in fp64 (as eager PyTorch does on the CPU): an fp32 sum of V terms
        # is off by ~1 ulp, which exp(y - lse) passes on to every probability.
        running_max = tl.full((), float("-inf"), tl.float32)
        running_sum = tl.full((), 0.0, tl.float64)
        weighted_logit_sum = tl.full((), 0.0, tl.float64)  # sum_j w_j * y_j, for smoothing
        if PREDICT:
            best = tl.full((), float("-inf"), tl.float32)
            best_col = tl.full((), 0, tl.int32)
            first_nan = n_cols
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < n_cols
            y = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
            if PREDICT:
                # torch.argmax's answer: the first NaN, else the first maximum. NaNs stay out of the max
                # (a GPU's max drops them, the interpreter's keeps them); taken before the soft-cap, whose
                # rounding could turn neighbouring large logits into ties.
                first_nan = tl.minimum(first_nan, tl.min(tl.where(mask & (y != y), cols, n_cols), axis=0))
                key = tl.where(mask & (y == y), y, float("-inf"))
                tile_max = tl.max(key, axis=0)
                tile_col = tl.min(tl.where(mask & (key == tile_max), cols, n_cols), axis=0)
                best_col = tl.where(tile_max > best, tile_col, best_col)
                best = tl.maximum(best, tile_max)
            if HAS_SOFTCAP:
                y = softcap * tanh_fp32(y / softcap)
            if SMOOTHING:
                if HAS_WEIGHT:
                    w = tl.load(class_weight_ptr + col_offset + cols, mask=mask, other=0.0)
                    weighted_logit_sum += tl.sum(w.to(tl.float64) * y.to(tl.float64), axis=0)
                else:
                    weighted_logit_sum += tl.sum(tl.where(mask, y, 0.0).to(tl.float64), axis=0)
            # Padded lanes are masked after the soft-cap: tanh would turn -inf into -softcap.
            y = tl.where(mask, y, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(y, axis=0))
            # An all -inf prefix keeps the max at -inf; shift by 0 then to avoid inf - inf.
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp((running_max - shift).to(tl.float64))
            running_sum = running_sum * rescale + tl.sum(tl.exp(y - shift).to(tl.float64), axis=0)
            running_max = new_max
        row_max = running_max
        log_sum64 = tl.log(running_sum)  # fp64 until the per-row results are stored
        lse = row_max.to(tl.float64) + log_sum64
        target_logit = tl.load(logits_row + safe_target).to(tl.float32)
        if HAS_SOFTCAP:
            target_logit = softcap * tanh_fp32(target_logit / softcap)
        ce = target_weight * ((row_max - target_logit).to(tl.float64) + log_sum64)
        if SMOOTHING:
            ce = (1.0 - smoothing) * ce + smoothing_per_class * (weight_sum * lse - weighted_logit_sum)
        ce = tl.where(valid, ce.to(tl.float32), 0.0)
        tl.store(loss_ptr + row, tl.where(out_of_range, nan, ce))
        tl.store(lse_ptr + 2 * row, row_max)
        log_sum = log_sum64.to(tl.float32)
        tl.store(lse_ptr + 2 * row + 1, log_sum)
        if HAS_Z:
            z_term = tl.where(valid, (z_loss * (lse * lse)).to(tl.float32), 0.0)
            tl.store(z_ptr + row, tl.where(out_of_range, nan, z_term))
        if PREDICT:
            predicted = tl.where(first_nan < n_cols, first_nan, best_col)
            tl.store(predicted_ptr + row, tl.where(valid, predicted.to(tl.int64), -1))
    else:
        row_max = tl.load(lse_ptr + 2 * row)
        log_sum = tl.load(lse_ptr + 2 * row + 1)

    if WRITE_GRAD:
        loss_scale = tl.load(loss_scale_ptr + row * SCALE_STRIDE)
        target_coef = loss_scale * (1.0 - smoothing) * target_weight
        smooth_coef = loss_scale * smoothing_per_class
        if HAS_Z:
            z_coef = tl.load(z_scale_ptr + row * SCALE_STRIDE) * 2.0 * z_loss * (row_max + log_sum)
        grad_row = grad_ptr + row * stride_grad
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < n_cols
            y = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                capped = tanh_fp32(y / softcap)  # kept: 1 - tanh^2 from y / softcap would add a rounding
                y = softcap * capped
            # Kept as two parts: a single fp32 lse carries an absolute rounding of eps*|lse|,
            # which exp would turn into a relative error of every probability.
            p = tl.exp((y - row_max) - log_sum)
            # coef*p - coef at the target: one rounding when p is tiny, exactly 0 when p == 1 (V = 1).
            g = target_coef * p - tl.where(cols + col_offset == target, target_coef, 0.0)
            if SMOOTHING:
                if HAS_WEIGHT:
                    w = tl.load(class_weight_ptr + col_offset + cols, mask=mask, other=0.0)
                else:
                    w = 1.0
                g += smooth_coef * (weight_sum32 * p - w)
            if HAS_Z:
                g += z_coef * p
            if HAS_SOFTCAP:
                g *= 1.0 - capped * capped
            g = tl.where(valid, g, 0.0)
            g = tl.where(out_of_range, nan, g)
            tl.store(grad_row + cols, cast_rne(g, grad_ptr.dtype.element_ty), mask=mask)


def _aot_variants():
    """Variants for the ahead-of-time compile check: each pass combination and gradient dtype,
    every feature on (the register-hungriest) and off, for bf16 and fp32 logits."""
    variants = []
    passes = [("bf16", 1, 0, "bf16", "loss"), ("fp32", 1, 0, "fp32", "loss")]
    # bf16 logits with an fp32 gradient: linear_cross_entropy's float32 chunk for half inputs.
    for dtype, grad_dtype in (("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "fp32")):
        passes.append((dtype, 1, 1, grad_dtype, f"loss+grad:{grad_dtype}"))
        passes.append((dtype, 0, 1, grad_dtype, f"grad-only:{grad_dtype}"))
    for dtype, compute_loss, write_grad, grad_dtype, pass_label in passes:
        for features in (0, 1):
            signature = {
                "logits_ptr": f"*{dtype}", "grad_ptr": f"*{grad_dtype}", "target_ptr": "*i64",
                "class_weight_ptr": "*fp32", "class_weight_sum_ptr": "*fp64", "lse_ptr": "*fp32",
                "loss_ptr": "*fp32", "z_ptr": "*fp32", "loss_scale_ptr": "*fp32", "z_scale_ptr": "*fp32",
                "predicted_ptr": "*i64", "stride_logits": "i32", "stride_grad": "i32", "n_cols": "i32", "col_offset": "i32",
                "n_classes": "i32", "ignore_index": "i32", "smoothing": "fp32", "smoothing_per_class": "fp32",
                "softcap": "fp32", "z_loss": "fp32",
            }
            constexprs = {"SCALE_STRIDE": features, "HAS_WEIGHT": features, "SMOOTHING": features,
                          "HAS_SOFTCAP": features, "HAS_Z": features, "COMPUTE_LOSS": compute_loss,
                          "WRITE_GRAD": write_grad, "PREDICT": features, "BLOCK_V": MAX_BLOCK_V}
            variants.append({"signature": signature, "constexprs": constexprs,
                             "num_warps": _num_warps(MAX_BLOCK_V), "num_stages": 1,
                             "label": f"{dtype}-{pass_label}-{'all-options' if features else 'plain'}"})
    return variants


@on_tensor_device
def _launch(logits, target, cfg, *, lse, loss, z, grad, loss_scale, z_scale, col_offset, compute_loss,
            predicted=None):
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    write_grad = grad is not None
    dummy = lse  # any fp32 tensor stands in for pointers a variant never reads
    scale_stride = 1 if (write_grad and loss_scale.numel() > 1) else 0
    block_v = min(MAX_BLOCK_V, next_power_of_2(n_cols))
    _cross_entropy_kernel[(n_rows,)](
        logits,
        grad if write_grad else logits,
        target,
        cfg.class_weight if cfg.class_weight is not None else dummy,
        cfg.class_weight_sum if cfg.class_weight_sum is not None else dummy,
        lse,
        loss if compute_loss else dummy,
        z if (compute_loss and z is not None) else dummy,
        loss_scale if write_grad else dummy,
        z_scale if (write_grad and z_scale is not None) else dummy,
        predicted if predicted is not None else target,
        logits.stride(0),
        grad.stride(0) if write_grad else logits.stride(0),
        n_cols,
        col_offset,
        cfg.n_classes,
        cfg.ignore_index,
        cfg.label_smoothing,
        cfg.label_smoothing / cfg.n_classes,
        cfg.softcap if cfg.softcap else 1.0,
        cfg.z_loss,
        SCALE_STRIDE=scale_stride,
        HAS_WEIGHT=cfg.class_weight is not None,
        SMOOTHING=cfg.label_smoothing != 0.0,
        HAS_SOFTCAP=bool(cfg.softcap),
        HAS_Z=cfg.z_loss != 0.0,
        COMPUTE_LOSS=compute_loss,
        WRITE_GRAD=write_grad,
        PREDICT=predicted is not None,
        BLOCK_V=block_v,
        num_warps=_num_warps(block_v),
    )


def _num_warps(block_v):
    return 8 if block_v >= 2048 else 4


aot.register(_cross_entropy_kernel, name="cross_entropy", variants=_aot_variants())


def loss_rows_triton(logits, target, cfg, *, grad=None, loss_scale=None, z_scale=None, predicted=None):
    """Triton twin of :func:`memkernels.fusions.loss.reference.loss_rows` (same contract)."""
    n_rows = logits.shape[0]
    ce = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n_rows, 2, dtype=torch.float32, device=logits.device)
    z = torch.empty_like(ce) if cfg.z_loss else None
    _launch(logits, target, cfg, lse=lse, loss=ce, z=z, grad=grad, loss_scale=loss_scale, z_scale=z_scale,
            col_offset=0, compute_loss=True, predicted=predicted)
    return ce, z, lse


def grad_rows_triton(logits, target, lse, cfg, grad, loss_scale, z_scale, *, col_offset=0):
    """Triton twin of :func:`memkernels.fusions.loss.reference.grad_rows` (same contract)."""
    _launch(logits, target, cfg, lse=lse, loss=None, z=None, grad=grad, loss_scale=loss_scale, z_scale=z_scale,
            col_offset=col_offset, compute_loss=False)


def row_kernels(backend):
    """(loss_rows, grad_rows) of ``backend`` ("triton" or "torch")."""
    if backend == "triton":
        return loss_rows_triton, grad_rows_triton
    return reference.loss_rows, reference.grad_rows


# ----------------------------------------------------------------------------------------------
# vocabulary shards (tensor parallelism): each rank holds the logits of its classes; per-row statistics
# combined over the ranks with all-reduces (cross_entropy below, linear_cross_entropy's sharded head)

def partial_rows(logits, target, cfg, col_offset):
    """This rank's statistics of each row over its classes ``[col_offset, col_offset + W)``.

    logits: (R, W), the local logits of R rows; target: (R,) global class ids. Returns float32 ``local_max``
    (-inf for W = 0 or a row of -inf) and float64 ``(sum_exp, target_logit, weighted_sum)`` stacked as (R, 3):
    the sum of exp(y - max) (the max taken as 0 where it is -inf), y at the target where this rank owns it
    (else 0: summed over the ranks it is the target's logit), and sum_j w_j y_j for label smoothing (else 0).
    y is the soft-capped logit. Row blocks of at most BLOCK_ELEMENTS logits bound the float32 temporaries.
    """
    n_rows, width = logits.shape
    local_max = torch.full((n_rows,), float("-inf"), dtype=torch.float32, device=logits.device)
    sums = torch.zeros(n_rows, 3, dtype=torch.float64, device=logits.device)
    if width == 0:
        return local_max, sums
    for rows in row_blocks(logits):
        y = logits[rows].float()
        if cfg.softcap:
            y = cfg.softcap * torch.tanh(y / cfg.softcap)
        block_max = y.max(dim=1).values
        local_max[rows] = block_max
        shift = torch.where(block_max == float("-inf"), 0.0, block_max)
        sums[rows, 0] = torch.sub(y, shift[:, None]).exp_().sum(dim=1, dtype=torch.float64)
        local_target = target[rows] - col_offset
        owned = (target[rows] != cfg.ignore_index) & (local_target >= 0) & (local_target < width)
        picked = y.gather(1, torch.where(owned, local_target, 0)[:, None]).squeeze(1)
        sums[rows, 1] = torch.where(owned, picked.double(), 0.0)
        if cfg.label_smoothing:
            if cfg.class_weight is None:
                sums[rows, 2] = y.sum(dim=1, dtype=torch.float64)
            else:
                sums[rows, 2] = y.double() @ cfg.class_weight[col_offset:col_offset + width].double()
    return local_max, sums


def combine_rows(local_max, sums, target, cfg, group):
    """Every rank's :func:`partial_rows` into each row's (ce, z-term or None, lse parts (R, 2) float32), as
    :func:`memkernels.fusions.loss.reference.loss_rows` gives them for the whole vocabulary: two all-reduces."""
    row_max = local_max.clone()
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shift = torch.where(row_max == float("-inf"), 0.0, row_max)
    local_shift = torch.where(local_max == float("-inf"), 0.0, local_max)
    # Each rank's sum rescaled to the global max (exp(-inf) = 0 for a rank whose classes are all -inf).
    sums[:, 0] *= torch.exp((local_shift - shift).double())
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    sum_exp, target_logit, weighted_sum = sums.unbind(dim=1)
    log_sum = sum_exp.log()
    lse = shift.double() + log_sum
    valid = target != cfg.ignore_index
    out_of_range = valid & ((target < 0) | (target >= cfg.n_classes))
    ce = (shift.double() - target_logit) + log_sum
    if cfg.class_weight is not None:
        ce = ce * cfg.class_weight[torch.where(valid & ~out_of_range, target, 0)]
    if cfg.label_smoothing:
        weight_sum = cfg.n_classes if cfg.class_weight is None else cfg.class_weight_sum
        smooth = weight_sum * lse - weighted_sum
        ce = (1.0 - cfg.label_smoothing) * ce + cfg.label_smoothing / cfg.n_classes * smooth
    ce = finish_rows(ce.float(), valid, out_of_range)
    z = finish_rows((cfg.z_loss * lse * lse).float(), valid, out_of_range) if cfg.z_loss else None
    return ce, z, torch.stack([shift, log_sum.float()], dim=1)


def predict_rows(logits, col_offset, n_classes):
    """This rank's argmax of each row of its local logits (R, W): ``(best, indices)``, best (R,) float32 the
    largest non-NaN logit (-inf where none) and indices (R, 2) int64 the global class of the first NaN and of the
    first logit equal to ``best`` (``n_classes`` where there is none). By row blocks (bounded temporaries)."""
    n_rows, width = logits.shape
    best = torch.full((n_rows,), float("-inf"), device=logits.device)
    indices = torch.full((n_rows, 2), n_classes, dtype=torch.int64, device=logits.device)
    if width == 0:
        return best, indices
    for rows in row_blocks(logits):
        block = logits[rows]
        nan = block.isnan()
        indices[rows, 0] = torch.where(nan.any(dim=1), nan.int().argmax(dim=1) + col_offset, n_classes)
        clean = block.masked_fill(nan, float("-inf"))
        index = clean.argmax(dim=1)
        best[rows] = clean.gather(1, index[:, None]).squeeze(1).float()
        indices[rows, 1] = index + col_offset
    return best, indices


def combine_predictions(best, indices, target, cfg, group):
    """(R,) int64 predictions over the whole vocabulary from every rank's :func:`predict_rows`: the first NaN,
    else the first class holding the largest logit (``torch.argmax``'s rule); -1 for ignored rows."""
    global_best = best.clone()
    dist.all_reduce(global_best, op=dist.ReduceOp.MAX, group=group)
    indices[:, 1] = torch.where(best == global_best, indices[:, 1], cfg.n_classes)
    dist.all_reduce(indices, op=dist.ReduceOp.MIN, group=group)
    predicted = torch.where(indices[:, 0] < cfg.n_classes, indices[:, 0], indices[:, 1])
    return torch.where(target != cfg.ignore_index, predicted, -1)


def vocab_shard_loss(local_max, sums, predictions, target, cfg, reduction, group):
    """Every rank's :func:`partial_rows` (and :func:`predict_rows`, or None) into ``(loss, z_loss, lse,
    predicted)`` over the whole vocabulary, reduced as the unsharded losses reduce: the forward both sharded losses
    (cross_entropy's logits, linear_cross_entropy's head) end with. ``predicted`` is (0,) without predictions."""
    ce, z, lse = combine_rows(local_max, sums, target, cfg, group)
    predicted = (target.new_empty(0) if predictions is None
                 else combine_predictions(*predictions, target, cfg, group))
    loss, z_loss = reduce_rows(ce, z, reduction_denominators(target, cfg, reduction), reduction)
    return loss, z_loss, lse, predicted


# ----------------------------------------------------------------------------------------------
# cross_entropy on given logits


def predicted_buffer(reference, n_rows, predict):
    """The (N,) int64 buffer the row kernels write predicted classes into; (0,) when not asked."""
    return torch.empty(n_rows if predict else 0, dtype=torch.int64, device=reference.device)


def _cross_entropy_forward(logits: torch.Tensor, target: torch.Tensor, class_weight: Optional[torch.Tensor],
                           ignore_index: int, label_smoothing: float, softcap: float, z_loss: float,
                           reduction: str, predict: bool, backend: str
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = make_config(logits.shape[1], ignore_index, label_smoothing, softcap, z_loss, class_weight)
    loss_rows, _ = row_kernels(backend)
    check_targets_if_cpu(backend, target, cfg)
    predicted = predicted_buffer(logits, logits.shape[0], predict)
    ce, z, lse = loss_rows(logits, target, cfg, predicted=predicted if predict else None)
    loss, z_loss = reduce_rows(ce, z, reduction_denominators(target, cfg, reduction), reduction)
    return loss, z_loss, lse, predicted


def _cross_entropy_fake(logits, target, class_weight, ignore_index, label_smoothing, softcap, z_loss, reduction,
                        predict, backend):
    n_rows = logits.shape[0]
    loss = logits.new_empty((n_rows,) if reduction == "none" else (), dtype=torch.float32)
    z_shape = (0,) if not z_loss else ((n_rows,) if reduction == "none" else ())
    return (loss, logits.new_empty(z_shape, dtype=torch.float32),
            logits.new_empty((n_rows, 2), dtype=torch.float32), predicted_buffer(logits, n_rows, predict))


def _cross_entropy_backward(grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor,
                            lse: torch.Tensor, class_weight: Optional[torch.Tensor], ignore_index: int,
                            label_smoothing: float, softcap: float, z_loss: float, reduction: str,
                            backend: str) -> torch.Tensor:
    cfg = make_config(logits.shape[1], ignore_index, label_smoothing, softcap, z_loss, class_weight)
    _, grad_rows = row_kernels(backend)
    loss_scale, z_scale = grad_scales(grad_loss, reduction_denominators(target, cfg, reduction), reduction, cfg)
    grad = torch.empty_like(logits)
    grad_rows(logits, target, lse, cfg, grad, loss_scale, z_scale)
    return grad


def _cross_entropy_backward_fake(grad_loss, logits, target, lse, class_weight, ignore_index, label_smoothing,
                                 softcap, z_loss, reduction, backend):
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(*output[1:])  # z_loss (returned detached), the logsumexp, the predictions
    # Their gradients arrive as None instead of zero tensors: autograd would launch a fill for each.
    ctx.set_materialize_grads(False)
    logits, target, class_weight, ignore_index, label_smoothing, softcap, z_loss, reduction, _, backend = inputs
    ctx.save_for_backward(logits, target, output[2], class_weight)
    ctx.options = (ignore_index, label_smoothing, softcap, z_loss, reduction, backend)


def _backward_formula(ctx, steps, grad_loss, grad_z_loss, grad_lse, grad_predicted):
    # z_loss and lse are returned detached by the public function; only the loss carries gradient.
    logits, target, lse, class_weight = ctx.saved_tensors
    grad = steps.backward(grad_loss, logits, target, lse, class_weight, *ctx.options)
    return grad, None, None, None, None, None, None, None, None, None


CROSS_ENTROPY = OpSpec(
    "cross_entropy", Step("cross_entropy", _cross_entropy_forward, _cross_entropy_fake),
    steps={"backward": Step("cross_entropy_backward", _cross_entropy_backward, _cross_entropy_backward_fake)},
    setup_context=_setup_context, backward=_backward_formula,
    # PyTorch's autocast casts a loss's logits to float32 (a copy of the N x V logits); this op already
    # computes in float32 from logits of any dtype, so it takes them as they are, with the same result.
    autocast={"cpu": None, "cuda": None}, triton_dtypes=None)


class _InplaceCrossEntropy(torch.autograd.Function):
    """Forward writes the reduction-scaled gradient into the logits; backward rescales it in place."""

    @staticmethod
    def forward(ctx, logits, target, cfg, reduction, backend, predict):
        loss_rows, _ = row_kernels(backend)
        check_targets_if_cpu(backend, target, cfg)
        denominators, (loss_scale, z_scale) = forward_grad_scales(target, cfg, reduction)
        predicted = predicted_buffer(logits, logits.shape[0], predict)
        # The predictions are taken in the loss pass, before the gradient overwrites the logits.
        ce, z, _ = loss_rows(logits, target, cfg, grad=logits, loss_scale=loss_scale, z_scale=z_scale,
                             predicted=predicted if predict else None)
        torch.autograd.graph.increment_version(logits)
        ctx.save_for_backward(logits)
        ctx.reduction = reduction
        loss, z_loss = reduce_rows(ce, z, denominators, reduction)
        ctx.mark_non_differentiable(z_loss, predicted)
        ctx.set_materialize_grads(False)
        return loss, z_loss, predicted

    @staticmethod
    def backward(ctx, grad_loss, grad_z_loss, grad_predicted):
        (grad,) = ctx.saved_tensors  # a second backward fails here: the in-place rescale bumped its version
        scale = grad_loss.reshape(-1, 1) if ctx.reduction == "none" else grad_loss
        # float32 scale: the product is taken in float32 and rounded once to the gradient's dtype.
        return grad.mul_(scale.float()), None, None, None, None, None


class _VocabShardedCrossEntropy(torch.autograd.Function):
    """This rank's logits (N, V/tp) of its classes ``[col_offset, ...)`` -> (loss, z-term, predictions) over the
    whole vocabulary, the same on every rank of ``group``; the gradient of this rank's logits only."""

    @staticmethod
    def forward(ctx, logits, target, cfg, reduction, predict, col_offset, group, backend):
        predictions = predict_rows(logits, col_offset, cfg.n_classes) if predict else None
        loss, z_loss, lse, predicted = vocab_shard_loss(*partial_rows(logits, target, cfg, col_offset), predictions,
                                                        target, cfg, reduction, group)
        ctx.save_for_backward(logits, target, lse)
        ctx.options = (cfg, reduction, col_offset, backend)
        ctx.mark_non_differentiable(z_loss, predicted)
        ctx.set_materialize_grads(False)
        return loss, z_loss, predicted

    @staticmethod
    def backward(ctx, grad_loss, grad_z_loss, grad_predicted):
        logits, target, lse = ctx.saved_tensors
        cfg, reduction, col_offset, backend = ctx.options
        _, grad_rows = row_kernels(backend)
        loss_scale, z_scale = grad_scales(grad_loss, reduction_denominators(target, cfg, reduction), reduction, cfg)
        grad = torch.empty_like(logits)
        grad_rows(logits, target, lse, cfg, grad, loss_scale, z_scale, col_offset=col_offset)
        return grad, None, None, None, None, None, None, None


def _on_dtensor(logits, target, cfg, reduction, predict, backend):
    """cross_entropy of DTensor logits: sharded over the classes on a 1-D mesh (loss_parallel's layout: each rank
    its classes' logits, the rows combined with all-reduces; returns (loss, z-term, predictions), plain tensors
    equal on every rank) or replicated (None: the caller computes on the local copy)."""
    from torch.distributed.tensor import Replicate, Shard

    placements, mesh = tuple(logits.placements), logits.device_mesh
    if all(isinstance(p, Replicate) for p in placements):
        return None
    if mesh.ndim != 1 or placements != (Shard(logits.dim() - 1),):
        raise ValueError(f"cross_entropy: logits are a DTensor placed {placements} on a {mesh.ndim}-D mesh; "
                         "supported: sharded over the classes (Shard(-1), loss_parallel's layout) on a 1-D mesh, "
                         "or replicated. Redistribute them, or pass .full_tensor()")
    offset = shard_offset(logits, logits.dim() - 1, "cross_entropy: logits")
    local = logits.to_local()
    local = local.reshape(-1, local.shape[-1]).contiguous()
    return _VocabShardedCrossEntropy.apply(local, target, cfg, reduction, predict, offset, mesh.get_group(), backend)


def _check_inplace_allowed(logits):
    if not (torch.is_grad_enabled() and logits.requires_grad):
        raise ValueError("inplace_backward=True needs logits that require grad (with grad mode on): "
                         "there is no gradient to write; drop inplace_backward")
    if logits.grad_fn is None:
        raise ValueError("inplace_backward=True refuses a leaf tensor: its values belong to the caller. "
                         "Pass the output of the LM head, or drop inplace_backward")
    if logits._base is not None or not logits.is_contiguous():
        raise ValueError("inplace_backward=True needs logits that own a contiguous storage (not a view): "
                         "other tensors may share a view's memory. Drop inplace_backward or pass .contiguous()")


def cross_entropy(logits, target, *, weight=None, ignore_index=-100, label_smoothing=0.0, reduction="mean",
                  softcap=None, z_loss=0.0, return_z_loss=False, inplace_backward=False, return_token_accuracy=False,
                  return_predicted_tokens=False, backend=None):
    """Cross-entropy of ``logits`` against class ids, without an N x V float32 log-softmax.

    Args:
        logits: (..., V) float32/float16/bfloat16.
        target: (...) integer class ids in [0, V) or ``ignore_index``. Out of range: ValueError on
            the PyTorch path; the Triton path never reads back to the host, so there that row's loss
            and gradient are NaN instead (any reduction is NaN; check targets yourself when in doubt).
        weight: optional (V,) class weights (as ``torch.nn.functional.cross_entropy``).
        label_smoothing: epsilon in [0, 1], PyTorch's definition (also with ``weight``).
        reduction: "none" (shape of ``target``, float32), "mean" or "sum" (0-d float32).
        softcap: optional c > 0: the loss sees ``c * tanh(logits / c)``.
        z_loss: factor z >= 0 of the auxiliary ``z * logsumexp**2`` per kept row
            (reduction "mean" averages it over the kept rows).
        return_z_loss: also return the z-term (already included in the loss), detached, for logging.
        inplace_backward: overwrite ``logits`` with their gradient during forward (see module docs).
        return_token_accuracy: also return the fraction of kept rows whose argmax is their target
            (per row with reduction "none"), taken in the loss's pass over the logits.
        return_predicted_tokens: also return each row's argmax (-1 for ignored rows), from that pass.
        backend: None picks by device (Triton on CUDA, the PyTorch reference elsewhere, see
            memkernels.set_backend); "torch" forces the reference, "triton" the kernels.
    Returns:
        loss, or ``(loss, z_loss)`` with ``return_z_loss``, float32; with either metric flag a
        :class:`memkernels.functional.CrossEntropyOutput` ``(loss, z_loss, token_accuracy,
        predicted_tokens)``, None in the fields not asked for.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError("logits must be a floating-point tensor of shape (..., V)")
    if logits.dim() == 0:
        raise ValueError("logits must have at least one dimension (the classes)")
    n_classes = logits.shape[-1]
    n_rows = logits.numel() // max(n_classes, 1)
    validate_loss_args(target, n_classes, n_rows, ignore_index=ignore_index, label_smoothing=label_smoothing,
                       reduction=reduction, softcap=softcap, z_loss=z_loss, class_weight=weight,
                       device=logits.device)
    check_metric_flags(return_token_accuracy, return_predicted_tokens)
    predict = return_token_accuracy or return_predicted_tokens
    out_shape = target.shape
    target = (target.full_tensor() if is_dtensor(target) else target).reshape(-1).long()
    softcap = float(softcap) if softcap is not None else 0.0
    backend = CROSS_ENTROPY.backend(backend, logits, what="logits")
    if is_dtensor(logits):
        if inplace_backward:
            raise ValueError("inplace_backward=True takes no DTensor logits: drop it under tensor parallelism")
        cfg = make_config(n_classes, ignore_index, label_smoothing, softcap, z_loss, weight)
        check_targets_if_cpu(backend, target, cfg)
        sharded = _on_dtensor(logits, target, cfg, reduction, predict, backend)
        if sharded is not None:
            loss, z, predicted = sharded
            return finish_output(loss, z, out_shape, reduction, return_z_loss, predicted, target, ignore_index,
                                 return_token_accuracy, return_predicted_tokens)
        logits = logits.to_local()  # replicated: every rank computes the whole loss
    if inplace_backward:
        _check_inplace_allowed(logits)
        cfg = make_config(n_classes, ignore_index, label_smoothing, softcap, z_loss, weight)
        loss, z, predicted = _InplaceCrossEntropy.apply(logits.view(n_rows, n_classes), target, cfg, reduction,
                                                        backend, predict)
    else:
        loss, z, _, predicted = CROSS_ENTROPY(logits.reshape(n_rows, n_classes).contiguous(), target,
                                              None if weight is None else weight.detach(), ignore_index,
                                              float(label_smoothing), softcap, float(z_loss), reduction, predict,
                                              backend)
    return finish_output(loss, z, out_shape, reduction, return_z_loss, predicted, target, ignore_index,
                         return_token_accuracy, return_predicted_tokens)
