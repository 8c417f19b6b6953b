"""Functional API: thin dispatch to memkernels.ops (Triton on CUDA, PyTorch reference elsewhere)."""
from memkernels.ops._loss import CrossEntropyOutput
from memkernels.ops.act_mul import gelu_mul, silu_mul
from memkernels.ops.cross_entropy import cross_entropy
from memkernels.ops.gated_linear import gated_linear, gated_mlp_recompute
from memkernels.ops.gelu_linear import gelu_linear
from memkernels.ops.layer_norm import add_layer_norm, layer_norm
from memkernels.ops.linear_cross_entropy import linear_cross_entropy
from memkernels.ops.linear_logprobs import linear_logprobs
from memkernels.ops.rms_norm import add_rms_norm, rms_norm
from memkernels.ops.rope import rope

__all__ = ["rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm", "gelu_linear", "gated_linear",
           "gated_mlp_recompute", "silu_mul", "gelu_mul", "cross_entropy", "linear_cross_entropy",
           "CrossEntropyOutput", "linear_logprobs", "rope"]
