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


def runs_triton(tensor):
    """Whether Triton can run on ``tensor``'s device: CUDA, or the CPU under the interpreter."""
    return tensor.device.type == "cuda" or (tensor.device.type == "cpu" and triton_interpreted())


def resolve(tensor, op_name, backend=None, triton_dtypes=None, what="the input"):
    """Return 'triton' or 'torch' for the op ``op_name`` called on ``tensor`` (its first operand,
    called ``what`` in messages): the one place every op decides.

    ``backend``: the call's own choice, None (the configured one: :func:`set_backend`), "triton" or
    "torch". ``triton_dtypes``: the dtypes the op's Triton kernels take (None: any). Raises a
    ValueError for an unknown ``backend``, or a per-call "triton" on a device Triton cannot run on;
    a RuntimeError naming the fix when 'triton' was forced globally there; a TypeError when the
    Triton kernels would get a dtype they do not take.
    """
    if backend not in (None, "triton", "torch"):
        raise ValueError(f"{op_name}: backend={backend!r} is not supported; use None (auto), 'triton' or 'torch'")
    if backend is None:
        configured = get_backend()
        if configured == "torch" or (configured == "auto" and tensor.device.type != "cuda"):
            return "torch"
        if not runs_triton(tensor):
            raise RuntimeError(
                f"memkernels.{op_name}: backend 'triton' was forced but the input is on {tensor.device}. "
                "Triton runs CPU tensors only under its interpreter: set TRITON_INTERPRET=1 before importing "
                "triton, or use set_backend('auto') / MEMKERNELS_BACKEND=auto to run the PyTorch reference.")
    elif backend == "torch":
        return "torch"
    elif not runs_triton(tensor):
        raise ValueError(f"{op_name}: backend='triton' cannot run on {tensor.device} tensors; Triton needs CUDA (or "
                         "CPU tensors with TRITON_INTERPRET=1 set before triton is imported); use backend='torch' "
                         "or None")
    if triton_dtypes is not None and tensor.dtype not in triton_dtypes:
        names = [str(dtype).replace("torch.", "") for dtype in triton_dtypes]
        names = " or ".join(filter(None, (", ".join(names[:-1]), names[-1])))
        raise TypeError(f"{op_name}: {what} is {tensor.dtype}; the Triton backend takes {names} (use "
                        "backend='torch' for other dtypes)")
    return "triton"
