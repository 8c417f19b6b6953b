"""The backend fixtures' device rule, shared by the op tests.

"triton" runs the kernels where they can run: on CUDA tensors when a GPU is present (the test's
tensors are made there through torch's default device), else on CPU tensors through the Triton
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 and applies its interpreter shims only
then). "torch" runs the PyTorch reference on CPU tensors either way.
"""
import contextlib

import torch

import memkernels


def triton_device():
    """Where the "triton" backend's tests put their tensors: "cuda", or "cpu" under the interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def use_backend(name):
    """Select ``name`` ("triton" or "torch") and the device its tests make tensors on."""
    memkernels.set_backend(name)
    previous = torch.get_default_device()
    torch.set_default_device(triton_device() if name == "triton" else "cpu")
    try:
        yield name
    finally:
        torch.set_default_device(previous)
        memkernels.set_backend("auto")
