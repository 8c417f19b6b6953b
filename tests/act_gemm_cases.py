"""Helpers shared by the tests of the activation GEMM kernel's ops (gelu_linear, gated_linear)."""


class KernelChoiceLog:
    """Stands in for one of the GEMM kernel's autotuned entries (memkernels.ops.gelu_linear._AUTOTUNED,
    which gated_linear launches too) and records which one ran."""

    def __init__(self, aligned, kernel, log):
        self.aligned, self.kernel, self.log = aligned, kernel, log

    def __getitem__(self, grid):
        self.log.append(self.aligned)
        return self.kernel[grid]
