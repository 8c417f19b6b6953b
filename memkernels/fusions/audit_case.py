"""What a fusion tells the GPU audit about its ops: the contract of every ``fusions/<family>/audit.py``.

Each fusion's ``audit.py`` has a ``cases()`` returning its ops at the shapes of real models, as :class:`Case`:
how to build the call for memkernels, eager PyTorch and (where it has the op) Liger-Kernel, the minimum
bytes and FLOPs of each pass, the small shapes the Triton counts are fitted on, and the op's kernels by
their memkernels.aot names. memkernels.audit.gpu_audit collects every fusion's ``cases()``, counts and fits
them, and prints the table; a new fusion is audited by writing its ``audit.py``, with nothing to register.
Nothing here imports the audit: a training process loads none of it.
"""
from dataclasses import dataclass

# Tokens per step at the real shapes (e.g. 4 sequences of 2048).
TOKENS = 8192
# SMs of the H100 SXM: the norm backwards' grids at the real shape are a multiple of it.
H100_SMS = 132


@dataclass
class Problem:
    """One op call: ``forward()`` returns the outputs, ``backward(outputs)`` runs autograd."""

    forward: object
    backward: object


@dataclass
class Case:
    """An op at one real shape, the small shapes its Triton counts are fitted on, and its minimum."""

    op: str
    label: str
    shape: dict
    variables: tuple  # shape variables the counts are a multilinear polynomial of
    fit_values: dict  # variable -> two small values (the fit uses every combination)
    check_values: tuple  # held-out small shapes (dicts) the fit must reproduce exactly
    build: object  # build(shape, dtype, impl) -> Problem; impl "memkernels" | "eager" | "liger"
    minimum: object  # minimum(shape, element_bytes) -> {"forward": (bytes, flops), "backward": (bytes, flops)}
    setup: object = None  # setup(shape) -> context manager that makes the op take a fit variable's value
    real_shape: object = None  # real_shape(shape, dtype, phase) -> the shape with the op's own value of each
    #                            fit variable that is not a size (linear-CE's chunks C)
    liger_setup: object = None  # liger_setup(shape) -> context manager: the same for Liger's op
    liger_real_shape: object = None  # liger_real_shape(shape) -> the shape with Liger's own values
    step_row: bool = False  # also print forward + backward (an op that moves backward's work into its forward)
    aot_kernels: tuple = ()  # the op's Triton kernels by their memkernels.aot names (--occupancy --op)
    liger: bool = False  # Liger-Kernel has this op (build takes impl="liger")


def leaf(*shape, dtype):
    """A random tensor of ``shape`` in ``dtype`` that requires grad."""
    import torch
    return torch.randn(*shape).to(dtype).requires_grad_()


def liger():
    """The liger_kernel package with its transformers submodule bound (the package alone does not import it)."""
    import liger_kernel.transformers
    return liger_kernel
