"""Pure-PyTorch cross-entropy over row blocks: the CPU path and the readable spec of the kernel.

Both backends implement the same two primitives on one block of logits, and the
memory-lean algorithms in ``memkernels.ops.cross_entropy`` and
``memkernels.ops.linear_cross_entropy`` are written once on top of them:

- :func:`loss_rows` — per-row cross-entropy, z-term and logsumexp of a block of
  full rows; optionally also the gradient, written into a given buffer (which may
  be the logits block itself).
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

Everything is computed in float32 whatever the logits dtype; the temporaries are
a few float32 copies of the block, which the callers keep small.
"""
from typing import NamedTuple, Optional

import torch


class LossConfig(NamedTuple):
    """Loss options shared by every block of one call (see the module docstring)."""

    n_classes: int
    ignore_index: int
    label_smoothing: float
    softcap: float  # 0.0 means no soft-cap
    z_loss: float
    class_weight: Optional[torch.Tensor]  # (V,) float32, or None
    class_weight_sum: Optional[torch.Tensor]  # () float32 sum of class_weight, or None


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
    y = logits.float()
    if cfg.softcap:
        y = cfg.softcap * torch.tanh(y / cfg.softcap)
    return y


def _target_terms(target, cfg):
    """valid rows, out-of-range rows, a safe gather index and the target's class weight."""
    valid = target != cfg.ignore_index
    out_of_range = valid & ((target < 0) | (target >= cfg.n_classes))
    safe = torch.where(valid & ~out_of_range, target, torch.zeros_like(target))
    w_t = cfg.class_weight[safe] if cfg.class_weight is not None else None
    return valid, out_of_range, safe, w_t


def _finish(values, valid, out_of_range):
    """Zero for ignored rows, NaN for rows with an out-of-range target (broadcasts over columns)."""
    values = torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return torch.where(out_of_range, torch.full((), float("nan"), device=values.device), values)


def loss_rows(logits, target, cfg, *, grad=None, loss_scale=None, z_scale=None):
    """Cross-entropy of full rows.

    logits: (R, V) float; target: (R,) int64.
    Returns ``(ce, zt, lse)``, each (R,) float32 (``zt`` is None when ``cfg.z_loss == 0``).
    With ``grad`` (an (R, V) buffer, possibly ``logits`` itself) the gradient of
    ``sum(loss_scale * ce + z_scale * zt)`` is written into it; ``loss_scale`` and
    ``z_scale`` are float32 tensors of shape () or (R,).
    """
    y = _softcapped(logits, cfg)
    lse = torch.logsumexp(y, dim=1)
    valid, out_of_range, safe, w_t = _target_terms(target, cfg)
    nll = lse - y.gather(1, safe[:, None]).squeeze(1)
    eps = cfg.label_smoothing
    ce = nll if w_t is None else w_t * nll
    if eps:
        if cfg.class_weight is None:
            smooth = cfg.n_classes * lse - y.sum(1)
        else:
            smooth = cfg.class_weight_sum * lse - y @ cfg.class_weight
        ce = (1.0 - eps) * ce + eps / cfg.n_classes * smooth
    ce = _finish(ce, valid, out_of_range)
    zt = _finish(cfg.z_loss * lse * lse, valid, out_of_range) if cfg.z_loss else None
    if grad is not None:
        _write_grad(y, target, lse, cfg, grad, loss_scale, z_scale, col_offset=0)
    return ce, zt, lse


def grad_rows(logits, target, lse, cfg, grad, loss_scale, z_scale, *, col_offset=0):
    """Gradient of columns ``[col_offset, col_offset + logits.shape[1])`` of every row.

    logits: (R, W) float, a column block of the full (R, V) logits; target, lse: (R,);
    grad: (R, W) buffer written in place (may be ``logits``); scales as in :func:`loss_rows`.
    """
    _write_grad(_softcapped(logits, cfg), target, lse, cfg, grad, loss_scale, z_scale, col_offset)


def _write_grad(y, target, lse, cfg, grad, loss_scale, z_scale, col_offset):
    valid, out_of_range, _, w_t = _target_terms(target, cfg)
    eps = cfg.label_smoothing
    loss_scale = loss_scale.reshape(-1)
    target_coef = loss_scale * (1.0 - eps) * (w_t if w_t is not None else 1.0)  # multiplies p_j - [j == t]
    prob_coef = target_coef
    if eps:
        weight_sum = cfg.class_weight_sum if cfg.class_weight is not None else cfg.n_classes
        prob_coef = prob_coef + loss_scale * eps / cfg.n_classes * weight_sum
    if cfg.z_loss:
        prob_coef = prob_coef + z_scale.reshape(-1) * 2.0 * cfg.z_loss * lse
    p = torch.exp(y - lse[:, None])
    g = prob_coef.reshape(-1, 1) * p
    cols = torch.arange(col_offset, col_offset + y.shape[1], device=y.device)
    hit = cols[None, :] == target[:, None]
    g = g - torch.where(hit, target_coef.reshape(-1, 1).expand_as(g), torch.zeros((), device=g.device))
    if eps:
        if cfg.class_weight is None:
            uniform = torch.full((1, y.shape[1]), 1.0, device=g.device)
        else:
            uniform = cfg.class_weight[col_offset:col_offset + y.shape[1]][None, :]
        g = g - (loss_scale.reshape(-1, 1) * eps / cfg.n_classes) * uniform
    if cfg.softcap:
        g = g * (1.0 - (y / cfg.softcap) ** 2)
    grad.copy_(_finish(g, valid[:, None], out_of_range[:, None]))
