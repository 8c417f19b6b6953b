"""nn.Module drop-ins for the memory-lean cross-entropy ops."""
import torch

from memkernels.fusions.loss.cross_entropy import cross_entropy
from memkernels.fusions.loss.linear_cross_entropy import linear_cross_entropy


class ChunkedCrossEntropyLoss(torch.nn.Module):
    """``torch.nn.CrossEntropyLoss`` for class-id targets, without an N x V float32 log-softmax.

    "Chunked" over the vocabulary: on the GPU each row's program walks V in blocks with an
    online logsumexp (no temporaries); on the CPU path rows go in blocks of at most
    ``memkernels.fusions.loss.reference.BLOCK_ELEMENTS`` logits. Either way the forward
    holds 8 bytes per row and the backward allocates only the gradient it returns.

    forward(logits (..., V), target (...)) -> float32 loss; options as
    :func:`memkernels.fusions.loss.cross_entropy.cross_entropy` (``weight`` is a buffer).
    """

    def __init__(self, weight=None, ignore_index=-100, label_smoothing=0.0, reduction="mean", softcap=None,
                 z_loss=0.0, return_z_loss=False, inplace_backward=False, return_token_accuracy=False,
                 return_predicted_tokens=False):
        super().__init__()
        self.register_buffer("weight", weight)
        self.options = {"ignore_index": ignore_index, "label_smoothing": label_smoothing, "reduction": reduction,
                        "softcap": softcap, "z_loss": z_loss, "return_z_loss": return_z_loss,
                        "inplace_backward": inplace_backward, "return_token_accuracy": return_token_accuracy,
                        "return_predicted_tokens": return_predicted_tokens}

    def forward(self, logits, target):
        return cross_entropy(logits, target, weight=self.weight, **self.options)


class LinearCrossEntropyLoss(torch.nn.Module):
    """LM head + cross-entropy that never materializes the logits.

    forward(hidden (..., H), weight (V, H), target (...), bias=None) -> float32 loss; options as
    :func:`memkernels.fusions.loss.linear_cross_entropy.linear_cross_entropy` (``class_weight`` is a buffer).
    """

    def __init__(self, class_weight=None, ignore_index=-100, label_smoothing=0.0, reduction="mean", softcap=None,
                 z_loss=0.0, strategy="auto", chunk_size=None, return_z_loss=False, return_token_accuracy=False,
                 return_predicted_tokens=False):
        super().__init__()
        self.register_buffer("class_weight", class_weight)
        self.options = {"ignore_index": ignore_index, "label_smoothing": label_smoothing, "reduction": reduction,
                        "softcap": softcap, "z_loss": z_loss, "strategy": strategy, "chunk_size": chunk_size,
                        "return_z_loss": return_z_loss, "return_token_accuracy": return_token_accuracy,
                        "return_predicted_tokens": return_predicted_tokens}

    def forward(self, hidden, weight, target, bias=None):
        return linear_cross_entropy(hidden, weight, target, bias=bias, class_weight=self.class_weight,
                                    **self.options)
