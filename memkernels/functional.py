"""Functional API: the fused ops of memkernels/fusions (Triton on CUDA, PyTorch reference elsewhere)."""
from memkernels.fusions.common.act_mul import gelu_mul, silu_mul
from memkernels.fusions.dyt.op import dyt
from memkernels.fusions.gated_mlp.op import gated_linear, gated_mlp_recompute
from memkernels.fusions.gelu_mlp.op import gelu_linear
from memkernels.fusions.loss.common import CrossEntropyOutput
from memkernels.fusions.loss.cross_entropy import cross_entropy
from memkernels.fusions.loss.linear_cross_entropy import linear_cross_entropy
from memkernels.fusions.loss.linear_logprobs import linear_logprobs
from memkernels.fusions.norm.layer_norm import add_layer_norm, layer_norm
from memkernels.fusions.norm.rms_norm import add_rms_norm, rms_norm
from memkernels.fusions.rope.op import rope

__all__ = ["rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm", "gelu_linear", "gated_linear",
           "gated_mlp_recompute", "silu_mul", "gelu_mul", "cross_entropy", "linear_cross_entropy",
           "CrossEntropyOutput", "linear_logprobs", "rope", "dyt"]
