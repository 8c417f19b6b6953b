"""How memkernels' custom ops behave inside ``torch.autocast``: PyTorch's own cast policies, per op.

PyTorch gives each aten op a cast policy per device (``aten/src/ATen/autocast_mode.cpp``):

- ``"lower_precision_fp"`` (``mm``, ``addmm``, ``linear``): floating inputs are cast to the
  region's dtype (``torch.get_autocast_dtype(device)``, bf16 or fp16) and the op runs there;
- ``"fp32"`` (CUDA ``layer_norm`` and ``rms_norm``, the losses): floating inputs are cast to
  float32 and the output is float32;
- no entry (CPU ``layer_norm`` and ``rms_norm``): the op runs on its inputs as they are
  (policy ``None`` here).

:func:`register` gives a custom op such a policy at its ``Autocast<Device>`` dispatch key, the
way ``torch.library.register_autocast`` does, except that ``"lower_precision_fp"`` reads the
region's dtype at call time (``register_autocast`` fixes one dtype at registration). The op then
runs with that autocast key excluded, so the torch ops inside it are not autocast a second time.

Eager paths that run an ``autograd.Function`` instead of the custom op (to keep their buffers
visible to memory meters) go through :func:`call`, which applies the same registered policy.
"""
import torch

# op qualname -> ({device_type: policy}, positions of the arguments the policy casts)
_POLICIES = {}
_LIBRARIES = []


def _has_autocast(device_type):
    try:
        return torch.amp.is_autocast_available(device_type)
    except RuntimeError:  # a device type this build of torch does not know
        return False


# Device types with an autocast mode, asked once here: torch.compile in torch 2.11 cannot trace
# torch.amp.is_autocast_available (a pybind builtin: "Attempted to call function marked as
# skipped", seen on the H200), and _enabled runs inside every compiled memkernels module.
_AUTOCAST_DEVICE_TYPES = frozenset(
    device_type for device_type in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", "maia",
                                    torch._C._get_privateuse1_backend_name())
    if _has_autocast(device_type))


def _enabled(device_type):
    """Whether an autocast region is active for ``device_type`` (meta and other devices have none)."""
    return device_type in _AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device_type)


def compute_dtype(tensor):
    """The dtype a GEMM on ``tensor`` computes in: the active autocast region's for its device, else its own."""
    device_type = tensor.device.type
    return torch.get_autocast_dtype(device_type) if _enabled(device_type) else tensor.dtype


def _target_dtype(policy, device_type):
    if policy == "fp32":
        return torch.float32
    return torch.get_autocast_dtype(device_type)


def cast(op_name, device_type, args, positions=None):
    """``args`` cast as ``op_name``'s policy for ``device_type`` says; unchanged outside autocast.

    ``positions``: which of ``args`` the policy casts (default: those registered for the op).
    """
    policies, registered = _POLICIES[op_name]
    positions = registered if positions is None else frozenset(positions)
    policy = policies.get(device_type)
    if policy is None or not _enabled(device_type):
        return tuple(args)
    dtype = _target_dtype(policy, device_type)
    return tuple(arg.to(dtype) if index in positions and _eligible(arg) else arg for index, arg in enumerate(args))


def _eligible(arg):
    """What PyTorch's autocast casts: floating tensors other than float64."""
    return isinstance(arg, torch.Tensor) and arg.is_floating_point() and arg.dtype != torch.float64


def register(op_name, policies, positions):
    """Give the custom op ``op_name`` (``"memkernels::name"``) PyTorch's autocast behaviour.

    ``policies``: ``{"cpu": policy, "cuda": policy}``, policy ``"lower_precision_fp"``, ``"fp32"``
    or ``None`` (inputs as they are). Either way the op's insides run with autocast off: its
    matmuls must not be cast again (``torch.mm(out=)`` refuses an autocast dtype change).
    ``positions``: indices of the floating tensor arguments the policy casts (e.g. a GEMM's
    operands, not a loss's class weights).
    """
    _POLICIES[op_name] = (dict(policies), frozenset(positions))
    op = torch._library.utils.lookup_op(op_name)
    namespace, name = op_name.split("::")
    library = torch.library.Library(namespace, "IMPL")
    _LIBRARIES.append(library)  # registrations live as long as their Library object
    for device_type in policies:
        key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        key = getattr(torch._C.DispatchKey, key_name)

        def kernel(_keyset, *args, _device_type=device_type, _key=key):
            cast_args = cast(op_name, _device_type, args)
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_key)):
                return op(*cast_args)

        library.impl(name, kernel, key_name, with_keyset=True)
        # torch.compile traces through the Python dispatcher, which looks here first.
        if op.has_kernel_for_dispatch_key(key):
            op.py_kernels.pop(key, None)
        op.py_impl(key)(lambda *args, _kernel=kernel: _kernel(None, *args))


def device_type_of(args):
    """The device type of the first tensor in ``args`` (None without one)."""
    return next((arg.device.type for arg in args if isinstance(arg, torch.Tensor)), None)


def call(op_name, function, *args, positions=None):
    """``function(*args)`` as ``op_name`` runs under autocast: args cast by its policy, autocast off inside.

    ``positions``: which of ``args`` to cast, when ``function`` takes other arguments than the op
    (default: the op's registered positions). Outside an autocast region ``function(*args)`` runs
    unchanged.
    """
    device_type = device_type_of(args)
    if not _enabled(device_type):
        return function(*args)
    args = cast(op_name, device_type, args, positions)
    with torch.autocast(device_type, enabled=False):
        return function(*args)
