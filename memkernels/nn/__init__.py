"""nn.Module drop-ins backed by memkernels' fused kernels."""
from memkernels.nn.cross_entropy import ChunkedCrossEntropyLoss, LinearCrossEntropyLoss
from memkernels.nn.mlp import FusedGatedMLP, FusedMLP, GeLULinear
from memkernels.nn.norms import FusedAddLayerNorm, FusedAddRMSNorm, FusedLayerNorm, FusedRMSNorm

__all__ = ["FusedRMSNorm", "FusedLayerNorm", "FusedAddRMSNorm", "FusedAddLayerNorm", "GeLULinear", "FusedMLP",
           "FusedGatedMLP", "ChunkedCrossEntropyLoss", "LinearCrossEntropyLoss"]
