"""Shared by cross_entropy and linear_cross_entropy: configuration, validation, reductions.

Both losses reduce per-row terms (cross-entropy, z-loss) the same way, with PyTorch's rules
for ``ignore_index``, class weights and ``reduction``; the per-row kernels live in
:mod:`memkernels.fusions.loss.cross_entropy`.
"""
import math
from typing import NamedTuple, Optional

import torch

from memkernels.fusions.loss import reference

REDUCTIONS = ("none", "mean", "sum")


def make_config(n_classes, ignore_index, label_smoothing, softcap, z_loss, class_weight):
    """A LossConfig with the class weights in float32 and their sum (a device tensor: no sync)."""
    weight32 = None if class_weight is None else class_weight.detach().float().contiguous()
    return reference.LossConfig(
        n_classes=n_classes,
        ignore_index=ignore_index,
        label_smoothing=float(label_smoothing),
        softcap=float(softcap),
        z_loss=float(z_loss),
        class_weight=weight32,
        class_weight_sum=None if weight32 is None else weight32.sum(dtype=torch.float64).reshape(1),
    )


def check_targets_if_cpu(backend, target, cfg):
    """The CPU reference path raises on out-of-range targets; the Triton path writes NaN instead."""
    if backend == "torch" and target.device.type == "cpu":
        reference.check_targets(target, cfg.n_classes, cfg.ignore_index)


def reduction_denominators(target, cfg, reduction):
    """(ce_denominator, z_denominator) as float64 device tensors of shape (1,) (no host sync).

    For ``mean`` the cross-entropy divides by the summed class weight of the kept
    targets (PyTorch's rule; their count when unweighted) and the z-term by their
    count; ``sum`` and ``none`` divide by 1. All targets ignored gives 0/0 = NaN
    for ``mean`` like PyTorch; the kernels select (never multiply) the ignored
    rows' zero gradient, so the gradient stays 0 as in PyTorch.
    """
    if reduction != "mean":
        one = torch.ones(1, dtype=torch.float64, device=target.device)
        return one, one
    valid = target != cfg.ignore_index
    count = valid.sum(dtype=torch.float64).reshape(1)
    if cfg.class_weight is None:
        return count, count
    safe = torch.where(valid, target, torch.zeros_like(target)).clamp(0, cfg.n_classes - 1)
    return torch.where(valid, cfg.class_weight[safe], 0.0).sum(dtype=torch.float64).reshape(1), count


def reduce_rows(ce, z, denominators, reduction):
    """Combine per-row terms into the loss; returns (loss, z_loss) (z_loss zero-size when unused)."""
    if reduction == "none":
        return (ce if z is None else ce + z), (z if z is not None else ce.new_empty(0))
    # Accumulated in float64 (N values: cheap anywhere), as eager PyTorch does on the CPU.
    ce_denominator, z_denominator = denominators
    total = ce.sum(dtype=torch.float64) / ce_denominator[0]
    if z is None:
        return total.float(), ce.new_empty(0)
    z_total = z.sum(dtype=torch.float64) / z_denominator[0]
    return (total + z_total).float(), z_total.float()


def grad_scales(grad_loss, denominators, reduction, cfg):
    """(loss_scale, z_scale) for the gradient kernels: d(loss)/d(row term) times the incoming gradient.
    z_scale is None without a z-loss (the kernels never read it): each scale costs launches."""
    grad_loss = grad_loss.float()
    if reduction == "none":
        grad_loss = grad_loss.contiguous()
        return grad_loss, grad_loss if cfg.z_loss else None
    ce_denominator, z_denominator = denominators
    # A 0-d float32 over a (1,) float64 denominator divides in float64 (a dimensioned operand's dtype
    # wins over a 0-d one's): the quotient is rounded once, to float32, with no launch for a cast.
    grad_loss = grad_loss.reshape(())
    return (grad_loss / ce_denominator).float(), (grad_loss / z_denominator).float() if cfg.z_loss else None


def forward_grad_scales(target, cfg, reduction):
    """Denominators and the scales for gradients computed in the forward: grad_scales with an incoming
    gradient of 1, i.e. each denominator's float64 reciprocal rounded once to float32 (two launches
    where a ones tensor, its cast and the division took four)."""
    denominators = reduction_denominators(target, cfg, reduction)
    ce_denominator, z_denominator = denominators
    return denominators, (ce_denominator.reciprocal().float(),
                          z_denominator.reciprocal().float() if cfg.z_loss else None)


def validate_loss_args(target, n_classes, n_rows, *, ignore_index, label_smoothing, reduction, softcap, z_loss,
                       class_weight, device, weight_name="weight"):
    """Raise ValueError/TypeError naming the bad argument; shared by both public functions."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a tensor of class ids, got {type(target).__name__}")
    if target.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"target must hold integer class ids (e.g. torch.long), got dtype {target.dtype}; "
                        "class probabilities are not supported")
    if target.numel() != n_rows:
        raise ValueError(f"target has {target.numel()} elements (shape {tuple(target.shape)}) but there are "
                         f"{n_rows} rows of logits; they must match one class id per row")
    if target.device != device:
        raise ValueError(f"target is on {target.device} but the logits are on {device}; move it with .to()")
    if n_classes < 1:
        raise ValueError("the vocabulary size (last dimension of the logits) must be at least 1")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if not (0.0 <= float(label_smoothing) <= 1.0):
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if softcap is not None and not (float(softcap) > 0.0 and math.isfinite(float(softcap))):
        raise ValueError(f"softcap must be None or a finite positive number, got {softcap}")
    if not (float(z_loss) >= 0.0 and math.isfinite(float(z_loss))):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss}")
    if class_weight is not None:
        if class_weight.shape != (n_classes,):
            raise ValueError(f"{weight_name} must have shape ({n_classes},) (one weight per class), "
                             f"got {tuple(class_weight.shape)}")
        if class_weight.device != device:
            raise ValueError(f"{weight_name} is on {class_weight.device} but the logits are on {device}")


class CrossEntropyOutput(NamedTuple):
    """What the losses return when asked for a metric: the fields not asked for are None.

    loss: float32, as without the metric. z_loss: the detached z-term (``return_z_loss``).
    token_accuracy (``return_token_accuracy``): float32, the fraction of kept rows (target not
    ``ignore_index``) whose predicted class is their target, 0-d (NaN when no row is kept, like a
    ``mean`` loss); with reduction "none" 1.0 or 0.0 per row in the target's shape, 0.0 for ignored rows.
    predicted_tokens (``return_predicted_tokens``): int64 in the target's shape, each row's argmax
    (``torch.argmax`` of its logits), -1 for ignored rows. Both are detached.
    """

    loss: torch.Tensor
    z_loss: Optional[torch.Tensor]
    token_accuracy: Optional[torch.Tensor]
    predicted_tokens: Optional[torch.Tensor]


def token_accuracy(predicted, target, ignore_index, reduction):
    """CrossEntropyOutput.token_accuracy of flat predicted (N,) and target (N,) (no host sync)."""
    kept = target != ignore_index
    correct = (predicted == target) & kept
    if reduction == "none":
        return correct.float()
    return (correct.sum(dtype=torch.float64) / kept.sum(dtype=torch.float64)).float()


def finish_output(loss, z, out_shape, reduction, return_z_loss, predicted=None, target=None, ignore_index=None,
                  return_token_accuracy=False, return_predicted_tokens=False):
    """Reshape per-row results to the target's shape; add the detached z-term when asked; a
    :class:`CrossEntropyOutput` when a metric is asked (``predicted`` (N,) and the flat ``target`` then)."""
    if reduction == "none":
        loss = loss.view(out_shape)
        z = z.view(out_shape) if z.numel() else z
    z = (z.detach() if z.numel() else torch.zeros_like(loss).detach()) if return_z_loss else None
    if return_token_accuracy or return_predicted_tokens:
        accuracy = token_accuracy(predicted, target, ignore_index, reduction) if return_token_accuracy else None
        if accuracy is not None and reduction == "none":
            accuracy = accuracy.view(out_shape)
        return CrossEntropyOutput(loss, z, accuracy,
                                  predicted.detach().view(out_shape) if return_predicted_tokens else None)
    return (loss, z) if return_z_loss else loss


def check_metric_flags(return_token_accuracy, return_predicted_tokens):
    """Raise TypeError unless both metric flags are bools (a string would silently be true)."""
    for name, flag in (("return_token_accuracy", return_token_accuracy),
                       ("return_predicted_tokens", return_predicted_tokens)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
