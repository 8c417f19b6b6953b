"""Pure-PyTorch cross-entropy over row blocks: the CPU path and the readable spec of the kernel.

Both backends implement the same two primitives on one block of logits, and the
memory-lean algorithms in ``memkernels.fusions.loss.cross_entropy`` and
``memkernels.fusions.loss.linear_cross_entropy`` are written once on top of them:

- :func:`loss_rows` — per-row cross-entropy, z-term and logsumexp of a block of
  full rows; optionally also the gradient, written into a given buffer (which may
  be the logits block itself), and each row's predicted class (its argmax).
- :func:`grad_rows` — the gradient of a block of *columns* ``[col_offset,
  col_offset + width)`` of every row, given the rows' logsumexp: what the
  vocabulary-tiled backward of the "recompute" strategy needs.

Per row ``i`` with logits ``x`` (V classes), target ``t``, class weights ``w``
(all ones when absent), smoothing ``eps``, soft-cap ``c`` and z-loss factor ``z``::

    y    = c * tanh(x / c)                  (y = x without soft-cap)
    lse  = logsumexp(y)
    ce   = (1 - eps) * w[t] * (lse - y[t]) + eps / V * sum_j w[j] * (lse - y[j])
    zt   = z * lse**2
    dce/dy_j = (1 - eps) * w[t] * (p_j - [j == t]) + eps / V * (sum(w) * p_j - w[j]),  p = softmax(y)
    dzt/dy_j = 2 * z * lse * p_j
    dy/dx    = 1 - (y / c)**2

which is PyTorch's definition of label smoothing with class weights. Rows whose
target is ``ignore_index`` contribute 0 and get a zero gradient. Rows whose target
is neither ``ignore_index`` nor in ``[0, V)`` get NaN loss and NaN gradient (the
GPU contract: no host sync); the CPU entry points call :func:`check_targets`
first, which raises instead.

Everything is computed in float32 whatever the logits dtype. Both primitives walk
their rows in blocks of at most :data:`BLOCK_ELEMENTS` logits, so the temporaries
are a few float32 copies of one such block however many rows the caller passes
(``cross_entropy`` passes all of them).
"""
from typing import NamedTuple, Optional

import torch

from memkernels.fusions.common import host


# Logits per block of rows: each float32 temporary of a block is at most 4 MiB.
BLOCK_ELEMENTS = 2**20


def row_blocks(logits):
    """Row slices of ``logits`` (R, V), each of at most BLOCK_ELEMENTS logits (one row at least): the blocks the
    references walk (cross-entropy's and :mod:`memkernels.fusions.loss.logprobs_reference`'); on meta three of them."""
    blocks = [slice(start, stop) for start, stop in host.row_blocks(*logits.shape, BLOCK_ELEMENTS)]
    if logits.device.type == "meta" and len(blocks) > 3:
        # Meta tensors hold no values: blocks differ only in size, and none runs an op
        # FlopCounterMode counts; the second one starts with what the first left alive, as every
        # later one does, and the last may be smaller. So these three allocate and count what all
        # of them do. Walking all of them (43 per chunk at a 128k vocabulary) made one meta
        # training step of Llama-3-8B take 43 s.
        blocks = [blocks[0], blocks[1], blocks[-1]]
    return blocks


def _rows_of(scale, rows):
    """A shared scale (one element) as is, a per-row (R,) scale's block."""
    return scale if scale is None or scale.numel() == 1 else scale[rows]


class LossConfig(NamedTuple):
    """Loss options shared by every block of one call (see the module docstring)."""

    n_classes: int
    ignore_index: int
    label_smoothing: float
    softcap: float  # 0.0 means no soft-cap
    z_loss: float
    class_weight: Optional[torch.Tensor]  # (V,) float32, or None
    class_weight_sum: Optional[torch.Tensor]  # (1,) float64 sum of class_weight, or None


def check_targets(target, n_classes, ignore_index, argument="target"):
    """Raise ValueError when a target is neither ``ignore_index`` nor in ``[0, n_classes)``.

    Reads the tensor on the host: call it only on CPU tensors.
    """
    bad = (target != ignore_index) & ((target < 0) | (target >= n_classes))
    if bool(bad.any()):
        first = target[bad][0].item()
        raise ValueError(
            f"{argument} contains class id {first}, outside [0, {n_classes}) and not ignore_index "
            f"({ignore_index}); fix the labels or pass the ignore_index you pad with"
        )


def _softcapped(logits, cfg):
    """The soft-capped logits in float32; without soft-cap the logits themselves (no copy: every
    op below that mixes them with float32 computes in float32)."""
    if not cfg.softcap:
        return logits
    return cfg.softcap * torch.tanh(logits.float() / cfg.softcap)


def _softcapped_with_slope(logits, cfg):
    """(y, dy/dx) with the slope 1 - tanh^2 from tanh itself (y / c would add a rounding); slope None
    without soft-cap."""
    if not cfg.softcap:
        return logits, None
    capped = torch.tanh(logits.float() / cfg.softcap)
    return cfg.softcap * capped, capped.square_().neg_().add_(1.0)


def _target_terms(target, cfg):
    """valid rows, out-of-range rows, a safe gather index and the target's class weight."""
    valid = target != cfg.ignore_index
    out_of_range = valid & ((target < 0) | (target >= cfg.n_classes))
    safe = torch.where(valid & ~out_of_range, target, torch.zeros_like(target))
    w_t = cfg.class_weight[safe] if cfg.class_weight is not None else None
    return valid, out_of_range, safe, w_t


def finish_rows(values, valid, out_of_range):
    """Zero for ignored rows, NaN for rows with an out-of-range target."""
    values = torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return torch.where(out_of_range, torch.full((), float("nan"), device=values.device), values)


def loss_rows(logits, target, cfg, *, grad=None, loss_scale=None, z_scale=None, predicted=None):
    """Cross-entropy of full rows, block of rows by block of rows.

    logits: (R, V) float; target: (R,) int64.
    Returns ``(ce, zt, lse_parts)``: ce and zt (R,) float32 (``zt`` is None when
    ``cfg.z_loss == 0``); lse_parts (R, 2) float32, the logsumexp as ``(max, log-sum)``
    with ``lse = max + log-sum``: one float32 lse would round by eps*|lse|, which
    exp turns into a relative error of every probability in the backward.
    With ``grad`` (an (R, V) buffer, possibly ``logits`` itself) the gradient of
    ``sum(loss_scale * ce + z_scale * zt)`` is written into it; ``loss_scale`` and
    ``z_scale`` are float32 tensors of shape () or (R,).
    With ``predicted`` (an (R,) int64 buffer) each row's predicted class is written into it:
    ``torch.argmax`` of the logits as given (before any soft-cap, which could merge neighbours
    into ties), -1 for rows whose target is ``ignore_index``.
    """
    n_rows = logits.shape[0]
    ce = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    zt = torch.empty_like(ce) if cfg.z_loss else None
    lse_parts = torch.empty(n_rows, 2, dtype=torch.float32, device=logits.device)
    for rows in row_blocks(logits):
        ce[rows], z_rows, lse_parts[rows] = _loss_block(logits[rows], target[rows], cfg)
        if zt is not None:
            zt[rows] = z_rows
        if predicted is not None:
            predicted[rows] = predicted_classes(logits[rows], target[rows], cfg.ignore_index)
        if grad is not None:
            _write_grad(*_softcapped_with_slope(logits[rows], cfg), target[rows], lse_parts[rows], cfg, grad[rows],
                        _rows_of(loss_scale, rows), _rows_of(z_scale, rows), 0)
    return ce, zt, lse_parts


def predicted_classes(logits, target, ignore_index):
    """(R,) int64: the argmax of each row of logits (R, V) (the first NaN, else the first maximum, as
    ``torch.argmax``), -1 where the target is ``ignore_index``."""
    return torch.where(target != ignore_index, logits.argmax(dim=1), -1)


def _loss_block(logits, target, cfg):
    y = _softcapped(logits, cfg)
    row_max = y.max(dim=1).values.float()
    # exp(-inf - -inf) is NaN: a row of -inf keeps max -inf but is shifted by 0.
    shift = torch.where(row_max == float("-inf"), 0.0, row_max)
    # Row sums and per-row results in float64, as in the kernel (see there why).
    log_sum = torch.sub(y, shift[:, None]).exp_().sum(dim=1, dtype=torch.float64).log_()
    lse_parts = torch.stack([shift, log_sum.float()], dim=1)
    lse = shift.double() + log_sum
    valid, out_of_range, safe, w_t = _target_terms(target, cfg)
    nll = (shift - y.gather(1, safe[:, None]).squeeze(1).float()).double() + log_sum
    eps = cfg.label_smoothing
    ce = nll if w_t is None else w_t * nll
    if eps:
        if cfg.class_weight is None:
            smooth = cfg.n_classes * lse - y.sum(1, dtype=torch.float64)
        else:
            smooth = cfg.class_weight_sum * lse - y.double() @ cfg.class_weight.double()
        ce = (1.0 - eps) * ce + eps / cfg.n_classes * smooth
    ce = ce.float()
    ce = finish_rows(ce, valid, out_of_range)
    zt = finish_rows((cfg.z_loss * (lse * lse)).float(), valid, out_of_range) if cfg.z_loss else None
    return ce, zt, lse_parts


def grad_rows(logits, target, lse_parts, cfg, grad, loss_scale, z_scale, *, col_offset=0):
    """Gradient of columns ``[col_offset, col_offset + logits.shape[1])`` of every row.

    logits: (R, W) float, a column block of the full (R, V) logits; target: (R,);
    lse_parts: (R, 2) from :func:`loss_rows`;
    grad: (R, W) buffer written in place (may be ``logits``); scales as in :func:`loss_rows`.
    """
    for rows in row_blocks(logits):
        _write_grad(*_softcapped_with_slope(logits[rows], cfg), target[rows], lse_parts[rows], cfg, grad[rows],
                    _rows_of(loss_scale, rows), _rows_of(z_scale, rows), col_offset)


def _write_grad(y, slope, target, lse_parts, cfg, grad, loss_scale, z_scale, col_offset):
    # In place where possible: besides the block, a few float32 copies (y and the slope with
    # soft-cap, g when grad is not float32, the smoothing/z term when those are on).
    # y may be the caller's logits block itself (no soft-cap); grad may be that same buffer:
    # every read of y happens before the exp below overwrites it.
    valid, out_of_range, _, w_t = _target_terms(target, cfg)
    eps = cfg.label_smoothing
    loss_scale = loss_scale.reshape(-1, 1)
    target_coef = loss_scale * (1.0 - eps) * (w_t[:, None] if w_t is not None else 1.0)
    g = grad if grad.dtype == torch.float32 else torch.empty_like(y, dtype=torch.float32)
    torch.sub(y, lse_parts[:, :1], out=g).sub_(lse_parts[:, 1:])  # two parts: see the kernel
    lse = lse_parts.sum(dim=1)
    p = g.exp_()
    extra = None  # the terms multiplying p other than the target's, grouped as in the kernel
    if eps:
        smooth_coef = loss_scale * (eps / cfg.n_classes)
        if cfg.class_weight is None:
            extra = (p * cfg.n_classes - 1.0).mul_(smooth_coef)
        else:
            class_weight = cfg.class_weight[col_offset:col_offset + y.shape[1]]
            extra = (p * cfg.class_weight_sum.float() - class_weight[None, :]).mul_(smooth_coef)
    if cfg.z_loss:
        z_term = p * (z_scale.reshape(-1, 1) * 2.0 * cfg.z_loss * lse[:, None])
        extra = z_term if extra is None else extra.add_(z_term)
    local = target - col_offset
    hit = valid & ~out_of_range & (local >= 0) & (local < y.shape[1])
    g.mul_(target_coef)
    g.scatter_add_(1, torch.where(hit, local, 0)[:, None], torch.where(hit[:, None], -target_coef, 0.0))
    if extra is not None:
        g.add_(extra)
    if slope is not None:
        g.mul_(slope)
    g.masked_fill_(~valid[:, None], 0.0).masked_fill_(out_of_range[:, None], float("nan"))
    if g is not grad:
        grad.copy_(g)


def eager_cross_entropy(logits, target, weight=None, *, ignore_index=-100, label_smoothing=0.0, reduction="mean",
                        softcap=None, z_loss=0.0):
    """The plain (memory-hungry) definition, in the logits' own dtype: the ground truth the tests
    run in float64 and the benchmark's eager baseline. logits (N, V), target (N,), weight (V,) or None.

    ``reduction="mean"`` averages the z-term over the kept rows (see :func:`loss_rows`).
    """
    y = logits if not softcap else softcap * torch.tanh(logits / softcap)
    loss = torch.nn.functional.cross_entropy(y, target, weight=weight, ignore_index=ignore_index,
                                             label_smoothing=label_smoothing, reduction=reduction)
    if not z_loss:
        return loss
    valid = target != ignore_index
    z_rows = torch.where(valid, z_loss * torch.logsumexp(y, dim=-1) ** 2, 0.0)
    if reduction == "none":
        return loss + z_rows
    z_total = z_rows.sum()
    return loss + (z_total / valid.sum() if reduction == "mean" else z_total)
