"""Pure-PyTorch per-token log-probabilities and entropy over row blocks: the CPU path and the readable spec
of :mod:`memkernels.fusions.loss.linear_logprobs`' kernel.

Per token with raw logits ``x`` (V classes), target ``t``, soft-cap ``c`` and temperature ``T``::

    y      = c * tanh(x / c)            (y = x without soft-cap)
    z      = y / T                      (the order of Gemma-2's cap in the model, then the RL trainer's / T)
    lse    = logsumexp(z);  log p = z - lse;  p = softmax(z)
    logp   = log p[t]
    H      = -sum_j p_j log p_j
    d logp / d z_j = [j == t] - p_j
    d H    / d z_j = -p_j (log p_j + H)
    dz/dx  = (1 - tanh(x / c)**2) / T

Two primitives, as for cross-entropy (:mod:`memkernels.fusions.loss.reference`), on which the memory-lean
algorithm is written once for both backends:

- :func:`stats_rows` — per-row log-prob, entropy and statistics ``(max, log-sum[, entropy])`` of full rows;
  optionally also the gradient for given incoming gradients, written into a buffer (which may be the logits);
- :func:`grad_cols` — the gradient of a block of columns of every row from the statistics: what the
  vocabulary-tiled backward needs.

Everything is computed in float32 whatever the logits dtype; row sums in float64. The entropy is accumulated
as ``log s - (sum_j e_j (z_j - m)) / s`` with ``e_j = exp(z_j - m)``, ``s = sum e_j``: both terms are of the
order of log V, where ``lse - sum p z`` would cancel two terms of the order of the logits. Rows whose target
is ``ignore_index`` give 0 and a zero gradient; rows whose target is neither ``ignore_index`` nor in
``[0, V)`` give NaN (the GPU contract: no host sync); the CPU entry point checks the targets first and
raises instead.
"""
from typing import NamedTuple

import torch

from memkernels.fusions.loss.reference import finish_rows, row_blocks


class LogprobConfig(NamedTuple):
    """Options shared by every block of one call."""

    n_classes: int
    ignore_index: int
    softcap: float  # 0.0: no soft-cap
    temperature: float
    with_entropy: bool  # statistics (N, 3) with the entropy, else (N, 2)
    with_metrics: bool = False  # also (N, 3) metrics: target is the first argmax, mean z, log sum p^2


def _scaled(logits, cfg):
    """(z, dz/dx without the 1 / T, or None) in float32: the soft-capped logits over the temperature."""
    x = logits.float()
    if not cfg.softcap:
        return (x / cfg.temperature if cfg.temperature != 1.0 else x), None
    capped = torch.tanh(x / cfg.softcap)  # kept: 1 - tanh^2 from y / c would add a rounding
    z = (cfg.softcap * capped) / cfg.temperature
    return z, capped.square_().neg_().add_(1.0)


def _target_terms(target, cfg):
    valid = target != cfg.ignore_index
    out_of_range = valid & ((target < 0) | (target >= cfg.n_classes))
    safe = torch.where(valid & ~out_of_range, target, torch.zeros_like(target))
    return valid, out_of_range, safe


def stats_rows(logits, target, cfg, *, grad=None, grad_logp=None, grad_entropy=None):
    """Log-prob, entropy and statistics of full rows.

    logits: (R, V) float; target: (R,) int64.
    Returns ``(logp, entropy, stats, metrics)``: logp and entropy (R,) float32 (entropy None without
    ``cfg.with_entropy``); stats (R, 2) float32 ``(max, log-sum)`` of z with ``lse = max + log-sum``,
    (R, 3) with the entropy last when ``cfg.with_entropy``; metrics (R, 3) float32 (1.0 where the target is z's
    first argmax, the mean of z, log sum p^2; zeros for ignored rows), None without ``cfg.with_metrics``. With ``grad`` ((R, V), may be ``logits``) the
    gradient for the incoming ``grad_logp`` / ``grad_entropy`` ((R,) float32 or None) is written into it.
    """
    n_rows = logits.shape[0]
    logp = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logp) if cfg.with_entropy else None
    stats = torch.empty(n_rows, 3 if cfg.with_entropy else 2, dtype=torch.float32, device=logits.device)
    metrics = torch.empty(n_rows, 3, dtype=torch.float32, device=logits.device) if cfg.with_metrics else None
    for rows in row_blocks(logits):
        logp[rows], entropy_rows, stats[rows], metrics_rows = _stats_block(logits[rows], target[rows], cfg)
        if entropy is not None:
            entropy[rows] = entropy_rows
        if metrics is not None:
            metrics[rows] = metrics_rows
        if grad is not None:
            _write_grad(logits[rows], target[rows], stats[rows], cfg, grad[rows], _rows_of(grad_logp, rows),
                        _rows_of(grad_entropy, rows), 0)
    return logp, entropy, stats, metrics


def _rows_of(values, rows):
    return None if values is None else values[rows]


def _stats_block(logits, target, cfg):
    z, _ = _scaled(logits, cfg)
    row_max = z.max(dim=1).values
    # A row of -inf keeps max -inf but is shifted by 0 (exp(-inf - -inf) would be NaN).
    shift = torch.where(row_max == float("-inf"), 0.0, row_max)
    centered = z - shift[:, None]
    e = centered.exp()
    total = e.sum(dim=1, dtype=torch.float64)
    log_sum = total.log()
    valid, out_of_range, safe = _target_terms(target, cfg)
    logp = finish_rows(((z.gather(1, safe[:, None]).squeeze(1) - shift).double() - log_sum).float(), valid,
                   out_of_range)
    columns = [shift, log_sum.float()]
    entropy = None
    if cfg.with_entropy:
        weighted = (e.double() * centered.double()).sum(dim=1)
        entropy64 = log_sum - weighted / total
        columns.append(entropy64.float())
        entropy = finish_rows(entropy64.float(), valid, out_of_range)
    metrics = None
    if cfg.with_metrics:
        kept = valid & ~out_of_range
        top1 = kept & (z.argmax(dim=1) == safe)  # argmax: the first maximum, as the kernel's rule
        mean = (z.sum(dim=1, dtype=torch.float64) / cfg.n_classes).float()
        log_sum_squares = ((e.double() * e.double()).sum(dim=1).log() - 2.0 * log_sum).float()
        zero = torch.zeros((), device=z.device)
        metrics = torch.stack([top1.float(), torch.where(kept, mean, zero), torch.where(kept, log_sum_squares, zero)],
                              dim=1)
    return logp, entropy, torch.stack(columns, dim=1), metrics


def grad_cols(logits, target, stats, cfg, grad, grad_logp, grad_entropy, *, col_offset=0):
    """Gradient of columns ``[col_offset, col_offset + logits.shape[1])`` of every row.

    logits: (R, W) float, a column block of the full (R, V) logits; target: (R,); stats from
    :func:`stats_rows`; grad: (R, W) buffer written in place (may be ``logits``); grad_logp, grad_entropy:
    (R,) float32 incoming gradients, or None for zero.
    """
    for rows in row_blocks(logits):
        _write_grad(logits[rows], target[rows], stats[rows], cfg, grad[rows], _rows_of(grad_logp, rows),
                    _rows_of(grad_entropy, rows), col_offset)


def _write_grad(logits, target, stats, cfg, grad, grad_logp, grad_entropy, col_offset):
    # Every read of the logits happens in _scaled, before grad (possibly the same buffer) is written.
    z, slope = _scaled(logits, cfg)
    valid, out_of_range, _ = _target_terms(target, cfg)
    # log p in two parts (see the cross-entropy kernel: one float32 lse would round by eps * |lse|).
    log_p = (z - stats[:, :1]).sub_(stats[:, 1:2])
    p = log_p.exp()
    coef = torch.zeros_like(p) if grad_logp is None else grad_logp[:, None].expand_as(p).clone()
    if grad_entropy is not None and cfg.with_entropy:
        coef.add_(grad_entropy[:, None] * (log_p + stats[:, 2:3]))
    g = p.mul_(coef).neg_()
    if grad_logp is not None:
        local = target - col_offset
        hit = valid & ~out_of_range & (local >= 0) & (local < logits.shape[1])
        g.scatter_add_(1, torch.where(hit, local, 0)[:, None], torch.where(hit, grad_logp, 0.0)[:, None])
    if cfg.temperature != 1.0:
        g.div_(cfg.temperature)
    if slope is not None:
        g.mul_(slope)
    g.masked_fill_(~valid[:, None], 0.0).masked_fill_(out_of_range[:, None], float("nan"))
    grad.copy_(g)


def eager_linear_logprobs(hidden, weight, target, bias=None, *, temperature=1.0, softcap=None, ignore_index=-100):
    """The plain (memory-hungry) definition in the inputs' own dtype: logits, log-softmax, gather, entropy.
    The ground truth the tests run in float64 and the benchmark's eager baseline.

    hidden (N, H), weight (V, H), bias (V,) or None, target (N,). Returns (logp, entropy), each (N,).
    """
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    log_p = torch.log_softmax(logits, dim=-1)
    valid = target != ignore_index
    safe = torch.where(valid, target, 0)
    logp = torch.where(valid, log_p.gather(-1, safe[:, None]).squeeze(-1), 0.0)
    entropy = torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0)
    return logp, entropy
