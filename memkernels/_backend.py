"""Which implementation an op runs: the Triton kernels or the pure-PyTorch reference.

``MEMKERNELS_BACKEND`` (read once, at first use) or :func:`set_backend`:

- ``auto`` (default): Triton on CUDA tensors, the PyTorch reference elsewhere.
- ``triton``: always the Triton kernels. CPU tensors work only under the Triton
  interpreter (``TRITON_INTERPRET=1`` set before triton is imported).
- ``torch``: always the PyTorch reference (same memory contract, no Triton).
"""
import os

BACKENDS = ("auto", "triton", "torch")
_backend = None


def _validate(name, source):
    if name not in BACKENDS:
        raise ValueError(f"{source}={name!r} is not a memkernels backend; use one of {', '.join(BACKENDS)}")
    return name


def get_backend():
    """The configured backend name: 'auto', 'triton' or 'torch'."""
    global _backend
    if _backend is None:
        _backend = _validate(os.environ.get("MEMKERNELS_BACKEND", "auto").strip().lower() or "auto",
                             "MEMKERNELS_BACKEND")
    return _backend


def set_backend(name):
    """Select the backend for every later op call ('auto', 'triton' or 'torch')."""
    global _backend
    _backend = _validate(str(name).lower(), "set_backend(name)")


def triton_interpreted():
    """True when Triton runs kernels on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve(tensor, op_name):
    """Return 'triton' or 'torch' for an op called on ``tensor``.

    Raises a RuntimeError naming the fix when 'triton' is forced on a tensor
    that Triton cannot run on.
    """
    backend = get_backend()
    on_cuda = tensor.device.type == "cuda"
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if on_cuda else "torch"
    if on_cuda or (tensor.device.type == "cpu" and triton_interpreted()):
        return "triton"
    raise RuntimeError(
        f"memkernels.{op_name}: backend 'triton' was forced but the input is on {tensor.device}. "
        "Triton runs CPU tensors only under its interpreter: set TRITON_INTERPRET=1 before importing "
        "triton, or use set_backend('auto') / MEMKERNELS_BACKEND=auto to run the PyTorch reference."
    )
