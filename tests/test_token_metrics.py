"""return_token_accuracy / return_predicted_tokens on cross_entropy and linear_cross_entropy (issue 39.4).

The predictions come from the loss's own pass over the logits (the row kernel's argmax, or its PyTorch
twin), so these tests pin them against eager ``torch.argmax`` (ties, NaN rows, all -inf rows, a maximum
in a later vocabulary tile, soft-capped rows whose capped values tie), the accuracy against its definition,
and that asking for them changes neither the loss nor a gradient, bit for bit.
"""
import pytest
import torch

from memkernels.functional import CrossEntropyOutput, cross_entropy, linear_cross_entropy
from memkernels.fusions.loss.module import ChunkedCrossEntropyLoss, LinearCrossEntropyLoss

REDUCTIONS = ["none", "mean", "sum"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def eager_metrics(logits, target, ignore_index, reduction):
    """(predicted, accuracy) by their definition, from the full logits."""
    kept = target != ignore_index
    predicted = torch.where(kept, logits.argmax(dim=-1), -1)
    correct = ((predicted == target) & kept).float()
    if reduction == "none":
        return predicted, correct
    return predicted, correct.sum() / kept.sum()


def awkward_logits(n_rows, n_classes, dtype):
    """Random logits with a row of two tied maxima, a row holding NaNs, a row of -inf, and an ignored row
    (row 1, set by the caller's target)."""
    logits = torch.randn(n_rows, n_classes) * 3
    logits[2, 7] = logits[2, 3] = logits[2].max() + 1  # a tie: the first index wins
    logits[4, 9] = logits[4, 5] = float("nan")  # the first NaN wins, as in torch.argmax
    logits[5] = float("-inf")  # no maximum above -inf: index 0
    return logits.to(dtype)


def awkward_target(n_rows, n_classes, logits, ignore_index):
    target = torch.randint(0, n_classes, (n_rows,))
    target[::3] = logits[::3].float().nan_to_num(nan=-1e30).argmax(dim=-1)  # some rows right, so 0 < accuracy < 1
    target[1] = ignore_index
    return target


@pytest.mark.parametrize("ignore_index", [-100, -1])  # -1: the value an ignored row's prediction holds
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_predictions_and_accuracy_match_eager_argmax(backend, dtype, reduction, ignore_index):
    torch.manual_seed(0)
    logits = awkward_logits(12, 40, dtype)
    target = awkward_target(12, 40, logits, ignore_index)
    out = cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction,
                        return_token_accuracy=True, return_predicted_tokens=True)
    predicted, accuracy = eager_metrics(logits, target, ignore_index, reduction)
    assert isinstance(out, CrossEntropyOutput) and out.z_loss is None
    assert out.predicted_tokens.dtype == torch.int64 and out.token_accuracy.dtype == torch.float32
    assert torch.equal(out.predicted_tokens, predicted)
    assert 0 < float(accuracy if reduction != "none" else accuracy.mean()) < 1
    torch.testing.assert_close(out.token_accuracy, accuracy, rtol=0, atol=0)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1, "softcap": 5.0, "z_loss": 1e-3, "weight": True}],
                         ids=["plain", "all-options"])
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_asking_for_the_metrics_changes_no_loss_and_no_gradient(backend, options, reduction, inplace_backward):
    torch.manual_seed(1)
    options = dict(options)
    weight = torch.rand(50).add(0.5) if options.pop("weight", False) else None
    source = torch.randn(9, 50) * 3
    target = torch.randint(0, 50, (9,))
    target[3] = -100
    grad_out = torch.rand(9) if reduction == "none" else None
    results = []
    for asked in (False, True):
        leaf = source.clone().requires_grad_()
        logits = leaf * 1.0  # a non-leaf with its own storage, as inplace_backward requires
        out = cross_entropy(logits, target, weight=weight, reduction=reduction, return_z_loss=True,
                            inplace_backward=inplace_backward, return_token_accuracy=asked,
                            return_predicted_tokens=asked, **options)
        loss, z_loss = out[0], out[1]
        loss.backward(grad_out)
        results.append((loss.detach(), z_loss, leaf.grad))
        if asked:
            assert torch.equal(out.predicted_tokens, torch.where(target != -100, source.argmax(-1), -1))
    for without, with_metrics in zip(*results):
        torch.testing.assert_close(with_metrics, without, rtol=0, atol=0)


def test_the_maximum_in_a_later_vocabulary_tile_and_a_tie_across_tiles(backend):
    # The row kernel walks V in tiles of 4096: the maximum (or the first of two equal ones) may sit in any tile.
    n_classes = 4096 + 900
    logits = torch.randn(4, n_classes)
    logits[0, 4500] = 50.0  # in the second tile
    logits[1, 100] = logits[1, 4200] = 50.0  # tied across tiles: the first tile's index
    logits[2, 4095] = logits[2, 4096] = 50.0  # tied across the tile boundary
    logits[3, n_classes - 1] = 50.0  # the last, partial tile's last class
    target = torch.tensor([4500, 4200, 4096, n_classes - 1])
    out = cross_entropy(logits, target, return_token_accuracy=True, return_predicted_tokens=True)
    assert out.predicted_tokens.tolist() == [4500, 100, 4095, n_classes - 1]
    assert float(out.token_accuracy) == 0.5


def test_predictions_are_taken_before_the_soft_cap(backend):
    # c * tanh(x / c) rounds 1000 and 1001 to the same float32 value c: the capped logits tie, the model's don't.
    logits = torch.randn(3, 20)
    logits[:, 4] = 1000.0
    logits[:, 11] = 1001.0
    out = cross_entropy(logits, torch.tensor([11, 4, -100]), softcap=4.0, return_token_accuracy=True,
                        return_predicted_tokens=True, reduction="none")
    assert out.predicted_tokens.tolist() == [11, 11, -1]
    assert out.token_accuracy.tolist() == [1.0, 0.0, 0.0]


def test_every_row_ignored_gives_nan_accuracy_like_a_mean_loss(backend):
    logits = torch.randn(3, 8)
    target = torch.full((3,), -100)
    out = cross_entropy(logits, target, return_token_accuracy=True, return_predicted_tokens=True)
    assert torch.isnan(out.token_accuracy) and torch.isnan(out.loss)
    assert out.predicted_tokens.tolist() == [-1, -1, -1]


def test_shapes_follow_the_target_and_unasked_fields_are_none():
    logits = torch.randn(2, 3, 10)
    target = torch.randint(0, 10, (2, 3))
    out = cross_entropy(logits, target, reduction="none", return_predicted_tokens=True)
    assert out.loss.shape == out.predicted_tokens.shape == (2, 3)
    assert out.token_accuracy is None and out.z_loss is None
    out = cross_entropy(logits, target, reduction="none", return_token_accuracy=True, return_z_loss=True)
    assert out.token_accuracy.shape == out.z_loss.shape == (2, 3) and out.predicted_tokens is None
    out = cross_entropy(logits, target, return_token_accuracy=True)
    assert out.token_accuracy.shape == () and out.loss.shape == ()
    assert not out.token_accuracy.requires_grad
    loss, z = cross_entropy(logits, target, return_z_loss=True)  # without a metric: as before
    assert isinstance(loss, torch.Tensor) and z.shape == ()


def separable_head(n_tokens, hidden_size, n_classes, dtype, with_bias):
    """hidden, weight, bias whose logits have one clear maximum per token (a margin far above the GEMMs'
    rounding, whatever the chunking), and the true argmax."""
    weight = torch.randn(n_classes, hidden_size)
    weight *= hidden_size ** 0.5 / weight.norm(dim=1, keepdim=True)  # rows of one norm: the own row's logit wins
    winners = torch.randint(0, n_classes, (n_tokens,))
    hidden = weight[winners] * 2 + 0.1 * torch.randn(n_tokens, hidden_size)
    bias = 0.1 * torch.randn(n_classes) if with_bias else None
    logits = hidden.double() @ weight.double().T + (0 if bias is None else bias.double())
    top2 = logits.topk(2, dim=-1).values
    assert bool((top2[:, 0] - top2[:, 1] > 1.0).all())  # the margin this test relies on
    cast = (lambda t: None if t is None else t.to(dtype))
    return cast(hidden), cast(weight), cast(bias), logits.argmax(-1)


def eager_metrics_of_winners(winners, target, reduction):
    kept = target != -100
    correct = ((winners == target) & kept).float()
    return correct if reduction == "none" else correct.sum() / kept.sum()


@pytest.mark.parametrize("strategy,reduction", [("chunked", "mean"), ("chunked", "sum"), ("recompute", "mean"),
                                                ("recompute", "none")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_linear_cross_entropy_predictions_accuracy_and_unchanged_gradients(backend, dtype, strategy, reduction,
                                                                           with_bias):
    torch.manual_seed(2)
    hidden, weight, bias, winners = separable_head(23, 32, 70, dtype, with_bias)
    target = torch.randint(0, 70, (23,))
    target[::2] = winners[::2]
    target[5] = -100
    grad_out = torch.rand(23) if reduction == "none" else None
    results = []
    for asked in (False, True):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight) + ((bias,) if with_bias else ())]
        out = linear_cross_entropy(leaves[0], leaves[1], target, bias=leaves[2] if with_bias else None,
                                   strategy=strategy, chunk_size=5, reduction=reduction,
                                   return_token_accuracy=asked, return_predicted_tokens=asked)
        loss = out.loss if asked else out
        loss.backward(grad_out)
        results.append([loss.detach()] + [leaf.grad for leaf in leaves])
        if asked:
            assert torch.equal(out.predicted_tokens, torch.where(target != -100, winners, -1))
            torch.testing.assert_close(out.token_accuracy, eager_metrics_of_winners(winners, target, reduction),
                                       rtol=0, atol=0)
    for without, with_metrics in zip(*results):
        torch.testing.assert_close(with_metrics, without, rtol=0, atol=0)


def test_linear_cross_entropy_loss_only_path_predicts_too(backend):
    torch.manual_seed(3)
    hidden, weight, _, winners = separable_head(11, 32, 30, torch.float32, False)
    target = winners.clone()
    target[0] = (target[0] + 1) % 30
    with torch.no_grad():
        out = linear_cross_entropy(hidden.reshape(1, 11, 32), weight, target.reshape(1, 11), chunk_size=4,
                                   return_token_accuracy=True, return_predicted_tokens=True)
    assert torch.equal(out.predicted_tokens, winners.reshape(1, 11))
    assert out.token_accuracy == torch.tensor(10 / 11, dtype=torch.float32)


def test_the_loss_modules_pass_the_flags():
    torch.manual_seed(4)
    logits = torch.randn(5, 9)
    target = torch.randint(0, 9, (5,))
    out = ChunkedCrossEntropyLoss(return_token_accuracy=True, return_predicted_tokens=True)(logits, target)
    assert torch.equal(out.predicted_tokens, logits.argmax(-1))
    hidden, weight, _, winners = separable_head(5, 32, 9, torch.float32, False)
    out = LinearCrossEntropyLoss(return_predicted_tokens=True)(hidden, weight, target)
    assert torch.equal(out.predicted_tokens, winners) and out.token_accuracy is None


def test_compiled_metrics_equal_eager():
    torch.manual_seed(5)
    logits = torch.randn(6, 12)
    target = torch.randint(0, 12, (6,))
    target[2] = -100
    hidden, weight, _, _ = separable_head(6, 32, 12, torch.float32, False)

    def both(logits, hidden, weight, target):
        first = cross_entropy(logits, target, return_token_accuracy=True, return_predicted_tokens=True)
        second = linear_cross_entropy(hidden, weight, target, strategy="recompute", return_token_accuracy=True,
                                      return_predicted_tokens=True)
        return (*first[::2], *first[3:], *second[::2], *second[3:])

    compiled = torch.compile(both, fullgraph=True, backend="aot_eager")(logits, hidden, weight, target)
    for got, expected in zip(compiled, both(logits, hidden, weight, target)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["return_token_accuracy", "return_predicted_tokens"])
@pytest.mark.parametrize("loss", ["cross_entropy", "linear_cross_entropy"])
def test_a_flag_that_is_not_a_bool_is_refused(loss, name):
    logits = torch.randn(2, 5)
    target = torch.tensor([1, 2])
    with pytest.raises(TypeError, match=f"^{name} must be True or False, got 'yes'$"):
        if loss == "cross_entropy":
            cross_entropy(logits, target, **{name: "yes"})
        else:
            linear_cross_entropy(logits, torch.randn(7, 5), target, **{name: "yes"})
