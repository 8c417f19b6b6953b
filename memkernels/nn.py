"""nn.Module drop-ins backed by memkernels' fused kernels."""
from memkernels.fusions.dyt.module import FusedDyT
from memkernels.fusions.gated_mlp.module import FusedGatedMLP
from memkernels.fusions.gelu_mlp.module import FusedMLP, GeLULinear
from memkernels.fusions.loss.module import ChunkedCrossEntropyLoss, LinearCrossEntropyLoss
from memkernels.fusions.norm.module import FusedAddLayerNorm, FusedAddRMSNorm, FusedLayerNorm, FusedRMSNorm

__all__ = ["FusedRMSNorm", "FusedLayerNorm", "FusedAddRMSNorm", "FusedAddLayerNorm", "FusedDyT", "GeLULinear", "FusedMLP",
           "FusedGatedMLP", "ChunkedCrossEntropyLoss", "LinearCrossEntropyLoss"]
