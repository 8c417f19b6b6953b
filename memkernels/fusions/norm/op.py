"""RMSNorm / LayerNorm as torch.library custom ops with their autograd: one OpSpec, ``NORM``
(memkernels/fusions/op_spec.py).

``memkernels::norm_fwd`` and ``memkernels::norm_bwd`` (and
``memkernels::norm_bwd_into_dy``, the opt-in in-place backward) are opaque to
torch.compile (fake implementations give the shapes), so a compiled model
keeps the fused kernels whole with no graph break. In eager mode the same
implementations run through their autograd.Function twin, without the custom
op's dispatch (host time; see op_spec). Either way the saved tensors go
through ``ctx.save_for_backward``, where saved_tensors_hooks (memkernels.runtime.meters,
activation offload) see them.

Each op runs the Triton kernels (memkernels/fusions/norm/kernels.py) or the
PyTorch reference (memkernels/fusions/norm/reference.py), as NORM.backend
chooses in the public function. The public functions live
in memkernels/fusions/norm/rms_norm.py and memkernels/fusions/norm/layer_norm.py.
"""
import functools
import math
import weakref
from typing import Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from memkernels.distributed import contiguous_stride, dtensor_class, is_dtensor
from memkernels.fusions.norm import reference
from memkernels.fusions.op_spec import OpSpec, Step

try:  # registers the Triton kernels with memkernels.aot; the PyTorch path needs no triton
    from memkernels.fusions.norm import kernels  # noqa: F401
except ImportError:
    pass

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _implementation(backend):
    if backend == "triton":
        from memkernels.fusions.norm import kernels
        return kernels
    return reference


def _empty(like, dtype=None):
    return like.new_empty(0, dtype=dtype)


class _CachedColumns:
    """One memory_efficient decision: the unrecoverable columns for one weight/bias state."""

    __slots__ = ("versions", "weight_storage", "bias_storage", "key", "columns", "valid")

    def __init__(self, versions, weight_storage, bias_storage, key, columns):
        self.versions = versions              # (weight._version, bias._version) when computed
        self.weight_storage = weight_storage  # weakref to the weight storage (None without one)
        self.bias_storage = bias_storage      # weakref to the bias storage (None without one)
        self.key = key                        # (weight geometry, bias geometry, offset, casting, dtype)
        self.columns = columns                # int64 [K] on the parameters' device
        self.valid = True                     # cleared by an optimizer step it could not refresh

    def parameters(self):
        """(weight, bias) as views of their live storages, or None once either is gone."""
        views = []
        for storage_ref, geometry in ((self.weight_storage, self.key[0]), (self.bias_storage, self.key[1])):
            if storage_ref is None:
                views.append(None)
                continue
            storage = storage_ref()
            if storage is None:
                return None
            offset, shape, stride, dtype = geometry
            views.append(torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride))
        return tuple(views)


# parameter storage -> {view geometry and options -> _CachedColumns}. Keyed weakly by
# storage: a cache entry never keeps a weight alive, and dies with it.
_UNRECOVERABLE = WeakIdKeyDictionary()


def _geometry(param):
    return None if param is None else (param.storage_offset(), tuple(param.shape), param.stride(), param.dtype)


def unrecoverable_columns(weight, bias, offset, casting, dtype):
    """reference.unrecoverable_columns, remembered per weight and bias state: int64 [K].

    Computing K reads a count back from the device (the host must know K to size the
    [M, K] fallback, and torch.compile sees it as a data-dependent size). A branch-free
    kernel cannot avoid that: it has no place to put x̂ of unrecoverable columns unless
    K is known, and reserving room for all H columns would save the input again. So the
    decision is cached instead, keyed on the parameters' storages (held weakly), their
    view geometry, the options and the parameters' version counters: a training step
    with unchanged weights pays no readback. It is recomputed after any in-place change
    the version counter records (optimizer steps, in-place ops under no_grad,
    load_state_dict) and after every torch.optim optimizer step that covers the weight
    or bias, also when the step does not bump the counter (fused AdamW does not).
    Writes through ``.data`` are invisible to both, as they are to autograd's own checks;
    a weight that becomes exactly zero that way gives NaN gradients, not silent ones.
    """
    anchor = weight if weight is not None else bias
    if anchor is None:
        return reference.unrecoverable_columns(weight, bias, offset, casting, dtype)
    entries = _UNRECOVERABLE.get(anchor.untyped_storage())
    if entries is None:
        entries = _UNRECOVERABLE[anchor.untyped_storage()] = {}
    key = (_geometry(weight), _geometry(bias), offset, casting, dtype)
    versions = (weight._version if weight is not None else None, bias._version if bias is not None else None)
    bias_storage = bias.untyped_storage() if bias is not None and weight is not None else None
    entry = entries.get(key)
    if entry is not None and id(entry) in _PENDING:
        _refresh_pending()
    if (entry is None or not entry.valid or entry.versions != versions
            or (bias_storage is not None and entry.bias_storage() is not bias_storage)):
        entry = _CachedColumns(versions, None if weight is None else weakref.ref(weight.untyped_storage()),
                               None if bias is None else weakref.ref(bias.untyped_storage()), key,
                               reference.unrecoverable_columns(weight, bias, offset, casting, dtype))
        entries[key] = entry
        if bias_storage is not None:  # an optimizer step over the bias alone must find it too
            _UNRECOVERABLE.setdefault(bias_storage, {})[("bias of",) + key] = entry
    # A fresh tensor per call: the op's outputs must not be shared (torch.compile may reuse them).
    return entry.columns.clone()


def _read_masks(masks):
    """The masks, concatenated, as one numpy bool array: the one device-to-host read of a step."""
    return torch.cat(masks).cpu().numpy()


# Decisions an optimizer step made stale, refreshed together by the next forward that needs one.
_PENDING = {}


def _mark_stepped_parameters(optimizer, args, kwargs):
    """Optimizer step post-hook: the decisions of every parameter the step touched are stale.

    The step may change a parameter without bumping its version counter (fused AdamW). The
    decisions are not recomputed one layer at a time in the next forward (a readback per
    norm layer): the first layer that needs one refreshes all of them with one readback.
    """
    if not _UNRECOVERABLE:
        return
    stepped = {}  # storage address -> the stepped parameter's version after the step
    for group in optimizer.param_groups:
        for param in group["params"]:
            found = _UNRECOVERABLE.get(param.untyped_storage())
            if found:
                stepped[param.untyped_storage().data_ptr()] = param._version
                _PENDING.update((id(entry), entry) for entry in found.values())
    for entry in _PENDING.values():
        entry.valid = False
        params = entry.parameters()
        if params is not None:
            entry.versions = tuple(None if p is None else stepped.get(p.untyped_storage().data_ptr(), version)
                                   for p, version in zip(params, entry.versions))


def _refresh_pending():
    """Recompute every stale decision with a single device-to-host read (the concatenated masks)."""
    jobs = []
    for entry in _PENDING.values():
        params = entry.parameters()
        if params is not None:
            _, _, offset, casting, dtype = entry.key
            jobs.append((entry, reference.unrecoverable_mask(*params, offset, casting, dtype)))
    _PENDING.clear()
    if not jobs:
        return
    flags = _read_masks([mask for _, mask in jobs])
    start = 0
    for entry, mask in jobs:
        columns = torch.from_numpy(flags[start:start + mask.numel()].nonzero()[0].astype("int64"))
        start += mask.numel()
        entry.columns = columns.to(mask.device, non_blocking=True)
        entry.valid = True


register_optimizer_step_post_hook(_mark_stepped_parameters)


def _norm_forward(x, residual, weight, bias, eps, offset, is_rms, casting, memory_efficient, in_place, backend):
    """Returns (y, residual_out, mean, rstd, unrecoverable_cols, fallback); absent ones are None.

    The eager path returns these as they are: an empty placeholder per absent output cost
    ~2.7 us of host time each (six a step). The custom op (:func:`_norm_forward_op`) fills
    them in, as its schema needs tensors. ``in_place`` is a backward option (write dx into
    dy's buffer when safe), carried here because the autograd context is built from the op's
    inputs.
    """
    unsafe_cols = unrecoverable_columns(weight, bias, offset, casting, x.dtype).to(x.device) \
        if memory_efficient else None
    y, residual_out, mean, rstd, fallback = _implementation(backend).norm_forward(
        x, residual, weight, bias, eps, offset, is_rms, casting, memory_efficient, unsafe_cols)
    return y, residual_out, mean, rstd, unsafe_cols, fallback


def _norm_forward_op(x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                     bias: Optional[torch.Tensor], eps: float, offset: float, is_rms: bool, casting: int,
                     memory_efficient: bool, in_place: bool, backend: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """_norm_forward with every absent output an empty tensor (a custom op returns no None)."""
    y, residual_out, mean, rstd, unsafe_cols, fallback = _norm_forward(
        x, residual, weight, bias, eps, offset, is_rms, casting, memory_efficient, in_place, backend)
    return (y, _empty(x) if residual_out is None else residual_out,
            _empty(x, torch.float32) if mean is None else mean, rstd,
            _empty(x, torch.int64) if unsafe_cols is None else unsafe_cols,
            _empty(x) if fallback is None else fallback)


def _norm_forward_fake(x, residual, weight, bias, eps, offset, is_rms, casting, memory_efficient, in_place, backend):
    rows = x.shape[0]
    unrecoverable = torch.library.get_ctx().new_dynamic_size() if memory_efficient else 0
    return (torch.empty_like(x), torch.empty_like(x) if residual is not None else _empty(x),
            x.new_empty(rows if not (is_rms or memory_efficient) else 0, dtype=torch.float32),
            x.new_empty(rows, dtype=torch.float32), x.new_empty(unrecoverable, dtype=torch.int64),
            x.new_empty((rows, unrecoverable)) if memory_efficient else _empty(x))


def _norm_backward(dy, dresidual_out, saved, mean, rstd, weight, bias, unsafe_cols, fallback, eps, offset, is_rms,
                   casting, memory_efficient, needs_dx, needs_dw, needs_db, backend):
    """Returns (dx, dw, db); gradients not asked for are None (the eager path's; see _norm_forward)."""
    return _implementation(backend).norm_backward(
        dy, dresidual_out, saved, mean, rstd, weight, bias, eps, offset, is_rms, casting,
        memory_efficient, unsafe_cols, fallback, needs_dx, needs_dw, needs_db)


def _norm_backward_op(dy: torch.Tensor, dresidual_out: Optional[torch.Tensor], saved: torch.Tensor,
                      mean: Optional[torch.Tensor], rstd: torch.Tensor, weight: Optional[torch.Tensor],
                      bias: Optional[torch.Tensor], unsafe_cols: Optional[torch.Tensor],
                      fallback: Optional[torch.Tensor], eps: float, offset: float, is_rms: bool, casting: int,
                      memory_efficient: bool, needs_dx: bool, needs_dw: bool, needs_db: bool, backend: str
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_norm_backward with gradients not asked for as empty tensors."""
    dx, dw, db = _norm_backward(dy, dresidual_out, saved, mean, rstd, weight, bias, unsafe_cols, fallback, eps,
                                offset, is_rms, casting, memory_efficient, needs_dx, needs_dw, needs_db, backend)
    return (_empty(dy) if dx is None else dx, _empty(dy) if dw is None else dw,
            _empty(dy) if db is None else db)


def _norm_backward_fake(dy, dresidual_out, saved, mean, rstd, weight, bias, unsafe_cols, fallback, eps, offset,
                        is_rms, casting, memory_efficient, needs_dx, needs_dw, needs_db, backend):
    return (torch.empty_like(dy) if needs_dx else _empty(dy),
            torch.empty_like(weight) if needs_dw else _empty(dy),
            torch.empty_like(bias) if needs_db else _empty(dy))


def _norm_backward_into_dy(dy, dresidual_out, saved, mean, rstd, weight, bias, unsafe_cols, fallback, eps, offset,
                           is_rms, casting, memory_efficient, needs_dw, needs_db, backend):
    """_norm_backward that writes dx over dy (each row is read before it is written). Returns (dw, db)."""
    _, dw, db = _implementation(backend).norm_backward(
        dy, dresidual_out, saved, mean, rstd, weight, bias, eps, offset, is_rms, casting,
        memory_efficient, unsafe_cols, fallback, True, needs_dw, needs_db, dx_out=dy)
    return dw, db


def _norm_backward_into_dy_op(dy: torch.Tensor, dresidual_out: Optional[torch.Tensor], saved: torch.Tensor,
                              mean: Optional[torch.Tensor], rstd: torch.Tensor, weight: Optional[torch.Tensor],
                              bias: Optional[torch.Tensor], unsafe_cols: Optional[torch.Tensor],
                              fallback: Optional[torch.Tensor], eps: float, offset: float, is_rms: bool,
                              casting: int, memory_efficient: bool, needs_dw: bool, needs_db: bool, backend: str
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """_norm_backward_into_dy with gradients not asked for as empty tensors."""
    dw, db = _norm_backward_into_dy(dy, dresidual_out, saved, mean, rstd, weight, bias, unsafe_cols, fallback, eps,
                                    offset, is_rms, casting, memory_efficient, needs_dw, needs_db, backend)
    return _empty(dy) if dw is None else dw, _empty(dy) if db is None else db


def _norm_backward_into_dy_fake(dy, dresidual_out, saved, mean, rstd, weight, bias, unsafe_cols, fallback, eps,
                                offset, is_rms, casting, memory_efficient, needs_dw, needs_db, backend):
    return (torch.empty_like(weight) if needs_dw else _empty(dy),
            torch.empty_like(bias) if needs_db else _empty(dy))


def _private_gradient(dy):
    """True when writing into dy cannot be seen by anyone else (opt-in in_place backward).

    The gradient reaching a registered backward is a view of the engine's tensor. That
    tensor has exactly two references when the engine hands it to this node alone: the
    view's and the engine's. A third means another node has yet to read it (a gradient
    shared by two branches), the caller keeps it (``y.backward(g)``), or it is a leaf's
    .grad; an expanded or non-contiguous gradient, a tensor subclass (torch.compile's
    tracing) or any other layout is not written either. Anything unexpected means no.
    """
    base = dy._base
    return (type(dy) is torch.Tensor and type(base) is torch.Tensor and not torch.compiler.is_compiling()
            and dy.is_contiguous() and base.is_contiguous() and base.shape == dy.shape
            and base.data_ptr() == dy.data_ptr() and base._use_count() == 2
            and torch._C._storage_Use_Count(base.untyped_storage()._cdata) <= 3)


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, offset, is_rms, casting, memory_efficient, in_place, backend = inputs
    y, residual_out, mean, rstd, unsafe_cols, fallback = output
    has_residual = residual is not None
    if memory_efficient:
        # y is what the next layer keeps anyway; x̂ = (y - bias) / (offset + weight).
        saved, mean = y, None
    else:
        saved = residual_out if has_residual else x
        mean = None if is_rms else mean
    ctx.save_for_backward(saved, mean, rstd, weight, bias, *((unsafe_cols, fallback) if memory_efficient
                                                              else (None, None)))
    ctx.options = (in_place, eps, offset, is_rms, casting, memory_efficient, backend, has_residual,
                   weight is not None, bias is not None)
    # Outputs with no gradient (mean, rstd, the fallback, an unused residual_out) arrive as None
    # instead of zero tensors: autograd would otherwise launch a fill for each.
    ctx.set_materialize_grads(False)


def _backward_formula(ctx, steps, dy, dresidual_out, _dmean, _drstd, _dcols, _dfallback):
    saved, mean, rstd, weight, bias, unsafe_cols, fallback = ctx.saved_tensors
    in_place, eps, offset, is_rms, casting, memory_efficient, backend, has_residual, has_weight, has_bias = \
        ctx.options
    needs_x, needs_residual, needs_w, needs_b = ctx.needs_input_grad[:4]
    needs_dx = needs_x or needs_residual
    needs_dw = has_weight and needs_w
    needs_db = has_bias and needs_b
    if not (needs_dx or needs_dw or needs_db):
        return (None,) * 11
    if dy is None:  # only residual_out reached the loss: y's gradient is zero
        dy = torch.zeros_like(saved)
    dresidual_out = dresidual_out.contiguous() if has_residual and dresidual_out is not None else None
    if in_place and needs_dx and _private_gradient(dy):
        dw, db = steps.backward_into_dy(dy, dresidual_out, saved, mean, rstd, weight, bias, unsafe_cols, fallback,
                                        eps, offset, is_rms, casting, memory_efficient, needs_dw, needs_db, backend)
        dx = dy
    else:
        dx, dw, db = steps.backward(dy.contiguous(), dresidual_out, saved, mean, rstd, weight, bias, unsafe_cols,
                                    fallback, eps, offset, is_rms, casting, memory_efficient, needs_dx, needs_dw,
                                    needs_db, backend)
    # x and residual get the same gradient tensor, as eager's add gives both its inputs; when both
    # are leaves, normalize() routes residual through _SeparateGradient so their .grads do not share.
    return (dx if needs_x else None, dx if needs_residual else None, dw if needs_dw else None,
            db if needs_db else None) + (None,) * 7


NORM = OpSpec(
    "norm",
    Step("norm_fwd", _norm_forward, _norm_forward_fake, custom_op_run=_norm_forward_op),
    steps={"backward": Step("norm_bwd", _norm_backward, _norm_backward_fake, custom_op_run=_norm_backward_op),
           "backward_into_dy": Step("norm_bwd_into_dy", _norm_backward_into_dy, _norm_backward_into_dy_fake,
                                    custom_op_run=_norm_backward_into_dy_op, mutates_args=("dy",))},
    setup_context=_setup_context, backward=_backward_formula,
    # PyTorch's autocast policy for layer_norm and rms_norm: float32 on CUDA, the inputs' dtype on CPU.
    autocast={"cpu": None, "cuda": "fp32"}, casts=(0, 1, 2, 3), triton_dtypes=SUPPORTED_DTYPES, fake_on_meta=True)


class _SeparateGradient(torch.autograd.Function):
    """Identity whose backward copies the gradient.

    The norm returns one dx for x and residual. If both lead straight to leaves (a leaf, or
    a view of one: the engine hands each leaf its own view of dx), each leaf would adopt its
    view as .grad and the two .grads would share memory, so accumulating into one would change
    the other. Only then is the copy needed; in a model, x and residual come out of other
    layers and share dx for free, as eager ``x + residual`` shares its gradient.
    """

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


def _gradient_goes_to_a_leaf(tensor):
    if torch.compiler.is_compiling():
        return True  # grad_fn is not traceable: copy, as the safe side
    root = tensor if tensor._base is None else tensor._base
    return tensor.requires_grad and root.grad_fn is None


def _check_param(name, param, x, normalized_shape):
    if param is None:
        return None
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(param).__name__}")
    if tuple(param.shape) != tuple(normalized_shape):
        raise ValueError(f"{name} has shape {tuple(param.shape)} but the normalized shape is "
                         f"{tuple(normalized_shape)} (the trailing dims of x); pass a {name} of that shape")
    if param.device != x.device:
        raise ValueError(f"{name} is on {param.device} but x is on {x.device}; move {name} to {x.device}")
    if param.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"{name} has dtype {param.dtype}; use x's dtype ({x.dtype}) or torch.float32")
    return param.reshape(-1)


# (hidden, device) -> a float32 zero weight: what weight=None with an offset means, kept so that a
# memory_efficient norm's cached decision (keyed by the weight's storage) holds across calls.
_ZERO_WEIGHTS = {}


def _zero_weight(hidden, device):
    """[hidden] float32 zeros that never require grad: the scale (offset + weight) is the offset alone."""
    if torch.compiler.is_compiling():
        return torch.zeros(hidden, dtype=torch.float32, device=device)
    key = (hidden, device)
    weight = _ZERO_WEIGHTS.get(key)
    if weight is None:
        weight = _ZERO_WEIGHTS[key] = torch.zeros(hidden, dtype=torch.float32, device=device)
    return weight


def _normalize_dtensor(op_name, x, residual, weight, bias, normalized_shape, run):
    """The norm of a DTensor ``x`` (tensor parallelism): each rank normalizes its own rows, so ``x`` must hold whole
    rows on every rank (sharded over token dims, as sequence parallelism does, or replicated); ``residual`` is laid
    out as x; a DTensor weight or bias must be replicated, and its gradient is each rank's partial sum when the rows
    are sharded. Returns (y, residual_out or None) laid out as x."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if normalized_shape is None:
        normalized_shape = weight.shape if isinstance(weight, torch.Tensor) else x.shape[-1:]
    row_dims = x.dim() - (1 if isinstance(normalized_shape, int) else len(tuple(normalized_shape)))
    placements = tuple(x.placements)
    if not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim % x.dim() < row_dims) for p in placements):
        raise ValueError(f"{op_name}: x is a DTensor placed {placements}; the norm needs whole rows on every rank: "
                         "redistribute x to Shard a token dim (sequence parallelism) or Replicate first")
    if residual is not None and (not is_dtensor(residual) or tuple(residual.placements) != placements
                                 or residual.device_mesh != x.device_mesh):
        raise ValueError(f"{op_name}: x is a DTensor placed {placements}; residual must be a DTensor on the same "
                         "mesh with the same placements")
    # A parameter's gradient is a partial sum over the mesh dims whose ranks hold different rows.
    param_grad = [Partial() if isinstance(p, Shard) else Replicate() for p in placements]

    def local(param, name):
        if not is_dtensor(param):
            return param
        if not all(isinstance(p, Replicate) for p in param.placements) or param.device_mesh != x.device_mesh:
            raise ValueError(f"{op_name}: {name} is a DTensor placed {tuple(param.placements)}; a norm's {name} must "
                             "be replicated on x's mesh (SequenceParallel leaves it so)")
        return param.to_local(grad_placements=param_grad)

    y, residual_out = run(x.to_local(), None if residual is None else residual.to_local(), local(weight, "weight"),
                          local(bias, "bias"))

    def wrap(tensor):
        return dtensor_class().from_local(tensor, x.device_mesh, placements, shape=x.shape,
                                          stride=contiguous_stride(x.shape))

    return wrap(y), None if residual_out is None else wrap(residual_out)


def normalize(op_name, x, residual, weight, bias, eps, offset, is_rms, casting_mode, memory_efficient,
              normalized_shape, in_place=False, backend=None):
    """Validate, flatten to [M, H], run the custom op, reshape back. Returns (y, residual_out or None).

    A DTensor x runs on each rank's rows (:func:`_normalize_dtensor`)."""
    if not is_dtensor(x) and any(is_dtensor(t) for t in (residual, weight, bias)):
        raise ValueError(f"{op_name}: x is a plain tensor but residual, weight or bias a DTensor; pass x as a DTensor "
                         "(SequenceParallel's input) or every tensor as a plain one (.to_local())")
    if is_dtensor(x):
        return _normalize_dtensor(op_name, x, residual, weight, bias, normalized_shape, functools.partial(
            _normalize_local, op_name, eps=eps, offset=offset, is_rms=is_rms, casting_mode=casting_mode,
            memory_efficient=memory_efficient, normalized_shape=normalized_shape, in_place=in_place,
            backend=backend))
    return _normalize_local(op_name, x, residual, weight, bias, eps=eps, offset=offset, is_rms=is_rms,
                            casting_mode=casting_mode, memory_efficient=memory_efficient,
                            normalized_shape=normalized_shape, in_place=in_place, backend=backend)


def _normalize_local(op_name, x, residual, weight, bias, *, eps, offset, is_rms, casting_mode, memory_efficient,
                     normalized_shape, in_place, backend):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op_name}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op_name}: x has dtype {x.dtype}; supported are float32, float16 and bfloat16")
    if normalized_shape is None:
        normalized_shape = weight.shape if isinstance(weight, torch.Tensor) else x.shape[-1:]
    elif isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    normalized_shape = tuple(normalized_shape)
    if not normalized_shape or tuple(x.shape[x.dim() - len(normalized_shape):]) != normalized_shape \
            or len(normalized_shape) > x.dim():
        raise ValueError(f"{op_name}: x has shape {tuple(x.shape)}, whose trailing dims must equal the "
                         f"normalized shape {normalized_shape} (weight.shape, or normalized_shape=)")
    hidden = math.prod(normalized_shape)
    if hidden == 0:
        raise ValueError(f"{op_name}: the normalized shape {normalized_shape} has no elements; "
                         "normalize over at least one element")
    weight = _check_param(f"{op_name}: weight", weight, x, normalized_shape)
    bias = _check_param(f"{op_name}: bias", bias, x, normalized_shape)
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"{op_name}: residual must be a torch.Tensor, got {type(residual).__name__}")
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"{op_name}: residual is {tuple(residual.shape)} {residual.dtype} on "
                             f"{residual.device} but x is {tuple(x.shape)} {x.dtype} on {x.device}; "
                             "they must match")
    if casting_mode not in reference.CASTING_MODES:
        raise ValueError(f"{op_name}: casting_mode={casting_mode!r}; use one of "
                         f"{', '.join(map(repr, reference.CASTING_MODES))}")
    eps = float(eps)
    if not eps >= 0.0:
        raise ValueError(f"{op_name}: eps={eps} must be a non-negative number")
    offset = float(offset)
    if weight is None and offset != 0.0:
        weight = _zero_weight(hidden, x.device)  # the scale is offset + 0
    backend = NORM.backend(backend, x, op_name, "x")

    x2d = x.reshape(-1, hidden).contiguous()
    residual2d = residual.reshape(-1, hidden).contiguous() if residual is not None else None
    if residual is not None and _gradient_goes_to_a_leaf(x) and _gradient_goes_to_a_leaf(residual):
        residual2d = _SeparateGradient.apply(residual2d)
    y, residual_out, *_ = NORM(x2d, residual2d, weight, bias, eps, offset, is_rms,
                               reference.CASTING_MODES[casting_mode], bool(memory_efficient), bool(in_place), backend)
    y = y.view(x.shape)
    return y, (residual_out.view(x.shape) if residual is not None else None)
