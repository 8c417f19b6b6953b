"""Asynchronous activation offload behind ``saved_tensors_hooks``.

``OffloadActivations`` moves what autograd saves for backward to pinned host
memory while forward runs, and brings it back (prefetched, ahead of need)
while backward runs. The copies are made by memkernels' C++ engine
(``csrc/cuda/offload_engine.*``): one device-to-host and one host-to-device
stream with priorities, a pinned pool reused from step to step, and events
(never ``record_stream``) to decide when memory may be freed or reused.

Where it runs:

* **Simulated device** (``MEMKERNELS_DEVICE=sim`` or
  ``memkernels.device.use_sim()``): CPU tensors stand for device tensors. The
  engine copies their bytes on the simulator's stream threads into pinned
  blocks the simulator allocated (and checks), with the simulator's events,
  delays and held events. Compute (CPU ops) is synchronous, so "the compute
  stream" is the simulator's default stream and waiting for a prefetch is a
  host wait. This is the tested path.
* **CUDA**: tensors on the current CUDA device are offloaded; the compute
  stream is ``torch.cuda.current_stream()``. Ordering is stream-side
  (``cudaStreamWaitEvent``), with no host synchronization in forward or
  backward. *Unverified*: no GPU was available where this was written.
* **Plain CPU** (no simulator, no CUDA): a documented no-op. The context
  manager installs no hooks and ``stats()["enabled"]`` is False. The first
  instance of the process warns (RuntimeWarning) and says why: a CPU-only torch
  build, or no visible CUDA device.

How much is offloaded: by default (``budget="auto"``) what the link can hide,
the device-to-host bandwidth (measured once per process and device) times the
forward pass's compute time (measured with stream events over the first
blocks), filled in the order tensors are saved; what comes after is kept
(``"budget"``). The first block, with no forward time known yet, offloads
everything. ``budget=None`` offloads everything eligible; an int is bytes.

Low-precision casts of parameters (autocast's bf16 copy of a weight, saved for
the input's gradient) are neither kept nor copied: backward casts the
parameter again, which gives the same bits (``recast_parameters``; counted in
``stats()["bytes_recast"]``).

What is not offloaded (kept where it is, counted in ``stats()["kept_by_reason"]``):
parameters and buffers of any module called inside the block, recognised by
storage so that views of a flat parameter (FSDP-style) count too, and leaf
tensors that require grad (``"parameter"``); storages smaller than
``min_offload_bytes`` (``"small"``); tensors on another device
(``"other_device"``); anything saved under :func:`no_offload`
(``"no_offload"``); sparse, conjugate/negative-bit views and tensor subclasses
(``"unsupported"``); with ``pageable_fallback=False``, what the pinned pool
refused (``"cap"``; by default such tensors go to pageable host memory,
synchronously, counted in ``stats()["bytes_pageable"]``); what the budget
left out (``"budget"``); and, unless
``offload_last_module=True``, what was saved since the last module call began
(``"last_module"``: backward needs it first, so copying it out and back would
only cost time).

How a saved tensor is handled:

* The whole storage is copied once, however many views of it are saved (a
  storage modified in place between saves is copied again); each view is
  restored with its size, stride and storage offset, so non-contiguous and
  expanded (stride-0) tensors come back exactly.
* A saved tensor modified in place raises at backward, as without hooks
  (PyTorch does not check when saved-tensor hooks are set; memkernels checks
  while the tensor is still referenced somewhere).
* The device copy is released only after its device-to-host copy completed
  (polled with event queries at each save; :meth:`wait_for_offloads` blocks).
* Unpacking is idempotent (``retain_graph=True``, double backward): the
  pinned copy lives as long as the autograd graph holds the saved tensor; a
  restored storage is shared while alive and restored again otherwise. It
  stays alive until every save of it that autograd holds has been unpacked:
  a tensor saved by two ops (one op's output, the next op's input) comes back
  once per backward pass, not once per op.
* Prefetch: each unpack (of an offloaded tensor, or of one still on the
  device) also starts restoring the tensors packed just before the one
  unpacked, up to the prefetch window in flight: by default
  (``prefetch_bytes="auto"``) the largest layer's offloaded bytes, so that
  backward restores one layer ahead (see the class). It does not rely on
  backward unpacking in reverse pack order: whatever is unpacked without a
  prefetch is restored on demand. A tensor whose device copy is still alive
  when it is unpacked (its device-to-host copy running, or done since the
  last look) is read there: no copy back, no wait. A prefetched tensor is
  allocated on the compute stream, which waits for its copy before using it,
  so the caching allocator cannot hand the memory out while the copy still
  writes it.
* An exception inside the block discards everything the block offloaded:
  pinned blocks go back to the pool, handles are released, the copy streams
  are drained.

Non-reentrant ``torch.utils.checkpoint`` works inside and around the block:
inside a checkpointed region checkpoint's own hooks take over (the region is
recomputed, not offloaded); an ``OffloadActivations`` opened inside a
checkpointed function offloads what would otherwise be saved there.
"""
import collections
import contextlib
import math
import statistics
import sys
import threading
import types
import warnings
import weakref

import torch

__all__ = ["OffloadActivations", "no_offload", "offload_checkpoints", "OffloadedCheckpoints"]

_local = threading.local()

# How far back from an unpacked stash to look for prefetch candidates: bounds
# the work per unpack when backward runs out of order over a long forward.
_PREFETCH_SCAN_LIMIT = 256

_KEEP_REASONS = ("parameter", "small", "other_device", "no_offload", "unsupported", "cap", "last_module", "budget",
                 "not_checkpoint_input")

# The pinned buffer bandwidth() copies through, once per process and device: large enough for the link's
# steady rate (a few ms on PCIe), small enough to cost nothing next to a training step.
_BANDWIDTH_PROBE_BYTES = 64 << 20
_measured_bandwidth = {}  # torch.device -> bytes per second, device to host

# The smallest "auto" prefetch window: the fixed window "auto" replaced, so that prefetch never runs
# shallower than it did (and about 0.2% of an 80 GB device).
_AUTO_PREFETCH_FLOOR = 128 << 20

# Forward times kept for the "auto" budget: the median of the last few blocks (a step slowed by a host
# hiccup or a recompile does not shrink the budget for good).
_FORWARD_TIMES_KEPT = 5


@contextlib.contextmanager
def no_offload():
    """Inside this block, tensors saved for backward stay on the device.

    Use it around the parts of a model whose activations backward needs
    immediately, or that are cheaper to keep than to move. Nests; thread-local.
    """
    _local.no_offload = getattr(_local, "no_offload", 0) + 1
    try:
        yield
    finally:
        _local.no_offload -= 1


_warned_disabled = False


def _warn_disabled_once():
    """A CPU-only torch installed by mistake would otherwise turn offload off without a word."""
    global _warned_disabled
    if _warned_disabled:
        return
    _warned_disabled = True
    if torch.version.cuda is None and torch.version.hip is None:
        why = (f"this torch ({torch.__version__}) is a CPU-only build; install a CUDA build of torch "
               "(see the README's install section) to offload on a GPU")
    else:
        why = "torch.cuda.is_available() is False: no CUDA device or driver is visible to this process"
    warnings.warn(f"memkernels.OffloadActivations is disabled (a no-op): {why}. Set MEMKERNELS_DEVICE=sim to "
                  "exercise it on the simulated device.", RuntimeWarning, stacklevel=4)


def _nonnegative_int(name, value, allow_none=False, expected=None):
    if value is None and allow_none:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        expected = expected or ("a non-negative int or None" if allow_none else "a non-negative int")
        raise ValueError(f"{name} must be {expected} (bytes), got {value!r}")
    return value


def _positive_number(name, value, unit):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be a positive, finite number of {unit} or None (measured), got {value!r}")
    return float(value)


def _layer_stack(module):
    """The layers under `module`, for the "auto" prefetch window: the children of one class, at least two,
    of an ``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict`` (how models hold their layers), that
    hold the most parameters among such groups (a model's layer stack holds more than any group inside one
    of its layers, such as an MoE layer's experts). A WeakSet, empty when there is none."""
    layers, most = (), 0
    for container in module.modules():
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)):
            continue
        by_class = collections.defaultdict(list)
        for child in container.children():
            by_class[type(child)].append(child)
        for children in by_class.values():
            parameters = sum(p.numel() for child in children for p in child.parameters())
            if len(children) >= 2 and parameters > most:
                layers, most = children, parameters
    return weakref.WeakSet(layers)


def _storage_key(storage):
    return storage._cdata


def _device_sim():
    from memkernels.runtime.device import sim  # imported late: device imports the C++ core

    return sim


def _sim_link_bandwidth():
    """The simulated link's bytes per second, timed on the simulator's modelled clock by a 4 KiB copy
    on a stream of its own (the rate is exact at any size, and a small copy moves the modelled host
    clock by almost nothing). Between two CPU tensors: the simulator allocates nothing for them, and
    every copy that is not device-to-device crosses its link. math.inf when it models no link."""
    from memkernels.runtime import device

    sim = _device_sim()
    source, target = torch.zeros(4096, dtype=torch.uint8), torch.empty(4096, dtype=torch.uint8)
    stream = device.stream_create()
    try:
        start = max(sim.clock(stream), sim.host_clock())
        device.memcpy_async(target.data_ptr(), source.data_ptr(), source.numel(), "default", stream)
        elapsed = sim.clock(stream) - start
        device.stream_synchronize(stream)  # the tensors must outlive the copy
    finally:
        device.stream_destroy(stream)
    return source.numel() / elapsed if elapsed > 0 else math.inf


def _cuda_link_bandwidth(where):
    """Device-to-host bytes per second into pinned memory: the best of three 64 MiB copies on a side
    stream, timed with events (one host synchronization, at the first block that needs it)."""
    source = torch.empty(_BANDWIDTH_PROBE_BYTES, dtype=torch.uint8, device=where)
    target = torch.empty(_BANDWIDTH_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream(where)
    stream.wait_stream(torch.cuda.current_stream(where))
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    with torch.cuda.stream(stream):
        events[0].record()
        for event in events[1:]:
            target.copy_(source, non_blocking=True)
            event.record()
    events[-1].synchronize()
    best = min(a.elapsed_time(b) for a, b in zip(events, events[1:])) / 1000.0
    return _BANDWIDTH_PROBE_BYTES / best


_checkpoint_saver_codes = None


def _saved_by_checkpoint(frame):
    """Is the save whose pack hook was called from `frame` torch.utils.checkpoint saving a region's
    inputs for its recompute? Non-reentrant: ``_CheckpointFrame.save_inputs`` (or the comprehension in
    it); reentrant: ``CheckpointFunction``'s ``save_for_backward``, packed in ``Function.apply``.

    These are torch's own names (checked against the torch this was built for, 2.13, by the tests);
    a torch that renames them is not recognized, and a block that then finds no checkpoint input says
    so once (``OffloadActivations(only_checkpoint_inputs=True)``)."""
    global _checkpoint_saver_codes
    if _checkpoint_saver_codes is None:
        from torch.utils import checkpoint

        save_inputs = getattr(getattr(checkpoint, "_CheckpointFrame", None), "save_inputs", None)
        codes = set()
        if save_inputs is not None:
            codes.add(save_inputs.__code__)
            codes.update(c for c in save_inputs.__code__.co_consts if isinstance(c, types.CodeType))
        _checkpoint_saver_codes = (frozenset(codes), getattr(checkpoint, "CheckpointFunction", None),
                                   torch.autograd.Function.apply.__func__.__code__)
    codes, reentrant, apply_code = _checkpoint_saver_codes
    for _ in range(3):
        if frame is None:
            return False
        if frame.f_code in codes:
            return True
        if frame.f_code is apply_code:
            return reentrant is not None and frame.f_locals.get("cls") is reentrant
        frame = frame.f_back
    return False


class _Order(list):
    """Weak references to one block's stashes in pack order, the index of the last one offloaded, and
    a weak reference to the block entered before it (alive while any of its stashes is): backward
    reaches that block's saves next, so prefetching continues into it (one block, no further)."""

    __slots__ = ("last_offloaded", "previous", "__weakref__")

    def __init__(self, previous=None):
        super().__init__()
        self.last_offloaded = -1
        self.previous = weakref.ref(previous) if previous is not None else None


class _Stash:
    """One storage's bytes: on the device, in flight, or in a pinned block; and its readers, the saves of
    it that autograd holds (one op saving its output and the next saving it as its input: two)."""

    __slots__ = ("owner", "nbytes", "version", "order", "index", "handle", "state", "source", "restored",
                 "resident", "readers", "unread", "prefetched", "pageable", "storage_ref", "__weakref__")

    DEFERRED, OFFLOADING, OFFLOADED, KEPT, DISCARDED = "deferred", "offloading", "offloaded", "kept", "discarded"

    def __init__(self, owner, storage, version, order):
        self.owner = owner
        self.nbytes = storage.nbytes()
        self.version = version
        self.order = order           # weakrefs to the stashes of its forward block, in pack order
        self.index = len(order)      # its place there
        order.append(weakref.ref(self))
        self.handle = 0              # engine handle once offloaded
        self.state = self.DEFERRED
        self.source = storage        # the device storage, held until its D2H copy completed
        self.restored = None         # weakref to the restored storage
        self.resident = None         # the restored storage, held while a reader has not read it
        self.readers = weakref.WeakSet()  # the _Packed that autograd holds of it
        self.unread = None           # the readers that have not read the restored storage (a WeakSet)
        self.prefetched = None       # (restored storage not yet handed to autograd, its stream)
        self.pageable = None         # the bytes in pageable host memory, when pinned memory was refused
        self.storage_ref = weakref.ref(storage)

    def __del__(self):
        owner = self.owner
        if owner is not None:
            try:
                owner._retire(self)
            except Exception as exc:  # a finalizer must not raise
                warnings.warn(f"memkernels.OffloadActivations: releasing a saved tensor failed: {exc}")


class _Packed:
    """What autograd holds instead of a saved tensor: the stash and the view's geometry."""

    __slots__ = ("stash", "dtype", "size", "stride", "storage_offset", "tensor_ref", "version", "__weakref__")

    def __init__(self, stash, tensor):
        self.stash = stash
        self.dtype = tensor.dtype
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.storage_offset = tensor.storage_offset()
        # Autograd skips its in-place check when saved-tensor hooks are set;
        # this restores it for as long as the saved tensor is referenced.
        self.tensor_ref = weakref.ref(tensor)
        self.version = tensor._version

    def check_version(self):
        tensor = self.tensor_ref()
        if tensor is not None and tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"a {self.dtype} tensor of shape {tuple(self.size)} was saved at version {self.version} and is now "
                f"at version {tensor._version} (detected by memkernels.OffloadActivations). Clone it before "
                "modifying it, or do the in-place operation out of place.")


class _Recast:
    """What autograd holds instead of a low-precision copy of a parameter (autocast's cast of a weight):
    the parameter, the dtype and the saved view's geometry. Backward casts the parameter again, which
    gives the same bits, instead of copying the cast to the host and back."""

    __slots__ = ("parameter", "version", "dtype", "size", "stride", "storage_offset", "base_stride")

    def __init__(self, parameter, tensor, base):
        self.parameter = parameter
        self.version = parameter._version
        self.dtype = tensor.dtype
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.storage_offset = tensor.storage_offset()
        self.base_stride = base.stride()


def _parameter_cast_of(tensor):
    """The parameter `tensor` (or the tensor it is a view of) is a dtype cast of, or None. A parameter
    here is any leaf tensor that requires grad: the one thing autograd keeps alive until backward anyway.

    Recognized by its producer: a ``ToCopyBackward0`` node whose only input is the parameter's
    ``AccumulateGrad`` (what autocast's cached weight casts and ``weight.to(dtype)`` record), of the same
    shape and strides, owning its whole storage and not modified since. Casts of frozen parameters
    record no node and are not recognized (they are offloaded like any activation)."""
    base = tensor._base if tensor._base is not None else tensor
    node = base.grad_fn
    if node is None or base._version != 0 or node.name() != "ToCopyBackward0":
        return None
    inputs = node.next_functions
    if len(inputs) != 1 or inputs[0][0] is None:
        return None
    parameter = getattr(inputs[0][0], "variable", None)
    if (parameter is None or type(parameter) not in (torch.Tensor, torch.nn.Parameter)
            or parameter.dtype == base.dtype or parameter.device != base.device
            or parameter.shape != base.shape or parameter.stride() != base.stride() or base.storage_offset() != 0
            or base.untyped_storage().nbytes() != base.numel() * base.element_size()):
        return None
    return parameter, base


class OffloadActivations:
    """Context manager: offload tensors saved for backward to pinned host memory.

    Args:
        budget: the bytes a block may offload. ``"auto"`` (default): what
            the link can hide, ``link_bandwidth`` x the forward pass's compute
            time (measured over the first blocks, or ``forward_seconds``),
            filled in the order tensors are saved (earliest first: their copies
            have the most compute to hide behind); what comes after the budget
            is spent stays on the device, counted as ``"budget"``. The first
            block, before any forward time is known, offloads everything (as
            ``None`` would). ``None``: offload everything eligible, whatever it
            costs in time. An int: that many bytes per block.
        only_checkpoint_inputs: offloaded checkpoints. Offload only what
            ``torch.utils.checkpoint`` saves for a region's recompute (its
            inputs, reentrant or not: what Hugging Face's
            ``gradient_checkpointing_enable()`` checkpoints per layer); every
            other save stays on the device (``"not_checkpoint_input"``). Each
            region's input is copied out once the next region's is saved; the
            last one stays (``"last_module"``) and, when backward recomputes its
            region, starts restoring the one before, one region ahead.
        link_bandwidth: bytes per second a device-to-host copy moves, for
            ``"auto"``. ``None``: measured once per process and device with a
            64 MiB pinned copy (a host synchronization at the first block).
        forward_seconds: the forward pass's compute time, for ``"auto"``.
            ``None``: measured (stream events, read at the next block, no
            synchronization), the median of the last five blocks.
        recast_parameters: restore low-precision casts of parameters (what
            autocast saves for a weight's gradient) by casting the parameter
            again in backward instead of copying them (default True: the same
            bits for a fraction of the time, and no device memory held between
            forward and backward). Turn it off if parameters change in place
            between a forward and its backward.
        min_offload_bytes: storages smaller than this stay on the device
            (default 1 MiB: small copies cost more in latency than they save).
        max_pinned_bytes: cap on the pinned host memory the pool may hold.
            ``None``: no cap (the host may still refuse to pin more).
        pageable_fallback: what happens to a tensor the pinned pool refuses
            (the cap, or the host): copied to pageable host memory,
            synchronously, with one warning (default True: it still leaves
            the device); False keeps it on the device (counted as ``"cap"``).
            Never an error either way.
        prefetch_bytes: during backward, restore ahead of need at most this
            many bytes that autograd has not asked for yet, and always at
            least the next tensor, however large. ``"auto"`` (default): the
            largest layer's offloaded bytes seen so far (this step's forward
            included), so that backward restores one layer ahead, never below
            128 MiB. A layer is a block (one ``with``); in a block that calls a
            model holding its layers in an ``nn.ModuleList``, ``nn.Sequential``
            or ``nn.ModuleDict``, one of those (from its call to the next
            one's: a block that is the whole forward would otherwise bring
            the whole step's bytes back at backward's first unpack, and its
            peak would be no lower than without offload); with
            ``only_checkpoint_inputs``, one region's input. Only bytes copied
            to pinned memory count: pageable copies are restored on demand,
            never prefetched. The 128 MiB floor is the fixed window ``"auto"``
            replaced: small layers are prefetched no less deep than before, for
            about 0.2% of an 80 GB device. An int: that many bytes, fixed; 0
            restores every tensor on demand. ``stats()["prefetch_window_bytes"]``
            is the window in effect.
        offload_last_module: also offload what is saved after the last module
            call in the block began (default False: backward needs it first).

    One instance is meant to be reused for every training step (its pinned
    pool is reused too, and "auto" learns the step's time)::

        offload = memkernels.OffloadActivations()
        for batch in loader:
            with offload:
                loss = model(batch)
            loss.backward()
        offload.close()

    Saved tensors of any dtype and layout-preserving strided view are
    supported; shapes are unchanged (each saved tensor is restored with its
    own size, stride and storage offset).
    """

    def __init__(self, budget="auto", *, only_checkpoint_inputs=False, link_bandwidth=None, forward_seconds=None,
                 recast_parameters=True, min_offload_bytes=1 << 20, max_pinned_bytes=None, pageable_fallback=True,
                 prefetch_bytes="auto", offload_last_module=False):
        if budget != "auto":
            _nonnegative_int("budget", budget, allow_none=True, expected="'auto', None or a non-negative int")
        self.budget = budget
        self.link_bandwidth = _positive_number("link_bandwidth", link_bandwidth, "bytes per second")
        self.forward_seconds = _positive_number("forward_seconds", forward_seconds, "seconds")
        if not isinstance(recast_parameters, bool):
            raise ValueError(f"recast_parameters must be True or False, got {recast_parameters!r}")
        self.recast_parameters = recast_parameters
        if not isinstance(pageable_fallback, bool):
            raise ValueError(f"pageable_fallback must be True or False, got {pageable_fallback!r}")
        self.pageable_fallback = pageable_fallback
        if not isinstance(only_checkpoint_inputs, bool):
            raise ValueError(f"only_checkpoint_inputs must be True or False, got {only_checkpoint_inputs!r}")
        self.only_checkpoint_inputs = only_checkpoint_inputs
        self.min_offload_bytes = _nonnegative_int("min_offload_bytes", min_offload_bytes)
        self.max_pinned_bytes = _nonnegative_int("max_pinned_bytes", max_pinned_bytes, allow_none=True)
        if prefetch_bytes != "auto":
            _nonnegative_int("prefetch_bytes", prefetch_bytes, expected="'auto' or a non-negative int")
        self.prefetch_bytes = prefetch_bytes
        if not isinstance(offload_last_module, bool):
            raise ValueError(f"offload_last_module must be True or False, got {offload_last_module!r}")
        self.offload_last_module = offload_last_module
        self._mode = self._resolve_mode()
        # The device is taken at the first __enter__ (the current one then), not here: a manager built
        # before torch.cuda.set_device(rank) would otherwise serve cuda:0 on every rank.
        self._device = torch.device("cpu") if self._mode == "sim" else None
        self._warned_devices = set()
        self._warned_no_checkpoints = False
        self._warned_pageable = False
        self._engine = None
        self._final_engine_stats = None  # the engine's counters, kept after close()
        self._lock = threading.RLock()
        self._active = False
        self._closed = False
        self._hooks = None
        self._module_hook = None
        self._reset_block_state()
        self._pending = collections.deque()  # stashes whose D2H copy may still run (they hold their source)
        self._live = weakref.WeakSet()   # every stash some autograd graph may still hold, all blocks
        self._prefetched_bytes = 0
        self._orphans = []  # (storage, handle, stream) of retired prefetches: freed at an explicit point
        self._refusals_seen = 0  # the pinned pool's refusals already answered with a trim (between steps)
        self._drain_queued = False
        self._counts = {"bytes_offloaded": 0, "storages_offloaded": 0, "prefetch_hits": 0, "restores_on_demand": 0,
                        "restores_from_device": 0, "bytes_recast": 0, "storages_recast": 0, "bytes_pageable": 0}
        self._kept = dict.fromkeys(_KEEP_REASONS, 0)
        self._recasts = {}  # (parameter storage key, version, dtype) -> weakref to the recast storage
        self._forward_times = collections.deque(maxlen=_FORWARD_TIMES_KEPT)
        self._forward_timer = None  # how the last block's forward is being timed (see _start_timer)
        self._block_budget = None   # bytes this block may still offload; None: no limit
        self._last_budget = None    # what the latest block started with
        self._last_bandwidth = None  # the link's bytes per second, once "auto" measured it
        self._largest_layer_offload = 0  # pinned bytes of the largest layer so far: the "auto" prefetch window
        self._layer_stacks = weakref.WeakKeyDictionary()  # module called -> _layer_stack(module)

    # ------------------------------------------------------------ public API

    @property
    def enabled(self):
        """True on the simulated device or with CUDA; False on plain CPU (no-op)."""
        return self._mode is not None

    def __enter__(self):
        if self._closed:
            raise RuntimeError("this OffloadActivations was closed; create a new one")
        if self._active:
            raise RuntimeError("OffloadActivations is already active; it cannot be nested in itself")
        if not self.enabled:
            self._active = True
            return self
        if self._mode == "cuda":
            current = torch.device("cuda", torch.cuda.current_device())
            if self._device is not None and current != self._device:
                raise RuntimeError(
                    f"this OffloadActivations serves {self._device} (the current device at its first block), but "
                    f"{current} is current now; its copy streams live on one device: use one OffloadActivations "
                    "per device (per rank)")
            self._device = current
        if self._engine is None:
            from memkernels import _C

            self._engine = _C.offload.Engine(max_pinned_bytes=self.max_pinned_bytes)
        with self._lock:
            self._release_orphans()
            self._trim_after_refusals()
        self._reset_block_state()
        self._block_budget = self._last_budget = self._budget_for_this_block()
        self._start_timer()
        self._active = True  # only now: a failure above leaves the manager usable
        self._module_hook = torch.nn.modules.module.register_module_forward_pre_hook(self._on_module_call)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        self._active = False
        if not self.enabled:
            return False
        self._hooks.__exit__(exc_type, exc, tb)
        self._module_hook.remove()
        self._hooks = self._module_hook = None
        self._stop_timer(completed=exc_type is None)
        with self._lock:
            self._release_orphans()
            if exc_type is not None:
                self._discard_block()
                return False
            if self.offload_last_module or not (self._modules_called or self.only_checkpoint_inputs):
                self._flush_deferred()
            else:
                for stash in self._deferred:
                    self._keep(stash, "last_module")
            self._deferred.clear()
            self._drain()
            if self.only_checkpoint_inputs and not self._checkpoint_inputs_seen:
                self._warn_no_checkpoint_inputs()
        return False

    def _warn_no_checkpoint_inputs(self):
        if self._warned_no_checkpoints or not self._kept["not_checkpoint_input"]:
            return
        self._warned_no_checkpoints = True
        warnings.warn(
            "memkernels.OffloadActivations(only_checkpoint_inputs=True): this block saved tensors for backward "
            "but none as a torch.utils.checkpoint input, so nothing was offloaded. Checkpoint the layers "
            "(model.gradient_checkpointing_enable(), or torch.utils.checkpoint.checkpoint around each), or if "
            f"they are checkpointed, this torch ({torch.__version__}) saves checkpoint inputs in a way memkernels "
            "does not recognize: use only_checkpoint_inputs=False.", RuntimeWarning, stacklevel=3)

    def wait_for_offloads(self):
        """Block until every device-to-host copy issued so far completed, and free the device copies
        (and the prefetched copies of graphs dropped unused)."""
        if self._engine is None:
            return
        with self._lock:
            self._engine.synchronize_all()
            self._drain()
            self._release_orphans()

    def offloads_in_flight(self):
        """How many device-to-host copies issued so far have not completed yet (0: none), after freeing
        the device copies of those that have. Never waits, where :meth:`wait_for_offloads` blocks: a
        caller can poll it until 0 to wait in its own way (memkernels.testing.settle_offload_copies does,
        on the simulated device, to leave the modelled clocks where they are)."""
        with self._lock:
            if self._engine is not None and not self._engine.closed:
                self._drain()
            return len(self._pending)

    def empty_cache(self):
        """Return the pinned host memory no saved tensor uses to the host (``cudaFreeHost``).

        ``cudaFreeHost`` synchronizes the device, so the pool never does this by itself in the middle
        of a step: it refuses what would cross ``max_pinned_bytes`` (the tensor goes to pageable memory,
        or stays on the device) and trims at the first block's start once no graph holds a saved tensor
        (the next step's first block, not a later block of the same forward). Call this outside the
        training step.
        """
        if self._active:
            raise RuntimeError("empty_cache() inside the OffloadActivations block; leave the block first")
        if self._engine is None or self._engine.closed:
            return
        with self._lock:
            self._release_orphans()
            self._engine.trim()

    def stats(self):
        """Counters since creation, as a dict.

        ``enabled``, ``mode`` ("sim", "cuda" or None); ``bytes_offloaded`` and
        ``storages_offloaded`` (each storage once); ``bytes_kept`` (saved bytes
        left on the device) and ``kept_by_reason`` (see the module docstring);
        ``prefetch_hits`` (unpacks whose copy was already issued),
        ``restores_on_demand`` (unpacks that had to start their copy),
        ``restores_from_device`` (unpacks served by the device copy, still
        alive); ``pinned_bytes`` (held by the pool), ``pinned_allocations``
        (cudaHostAlloc calls so far), ``pool_hits``, ``pool_misses``;
        ``live_handles``, ``engine`` (the engine's own counters);
        ``bytes_recast`` and ``storages_recast`` (parameter casts restored by
        casting again, not offloaded; each storage once a block);
        ``budget_bytes`` (what the latest block could offload; None: no
        limit), ``forward_seconds`` (the forward time "auto" uses: given, or
        the median measured, None before the first), ``link_bandwidth``
        (bytes/s: given, or measured once "auto" needed it; None before);
        ``prefetch_window_bytes`` (the prefetch window in effect: for
        ``prefetch_bytes="auto"``, the largest layer's pinned bytes so far,
        at least 128 MiB).
        """
        with self._lock:
            out = {"enabled": self.enabled, "mode": self._mode, **self._counts,
                   "bytes_kept": sum(self._kept.values()), "kept_by_reason": dict(self._kept),
                   "budget_bytes": self._last_budget,
                   "forward_seconds": self.forward_seconds if self.forward_seconds is not None else (
                       statistics.median(self._forward_times) if self._forward_times else None),
                   "link_bandwidth": self.link_bandwidth if self.link_bandwidth is not None else (
                       self._last_bandwidth),
                   "prefetch_window_bytes": self._prefetch_window()}
            if self._engine is not None and not self._engine.closed:
                self._drain()
                self._final_engine_stats = self._engine.stats()
            engine = self._final_engine_stats
        pool = engine["pool"] if engine else {}
        out.update(pinned_bytes=pool.get("pinned_bytes", 0), pinned_allocations=pool.get("slab_allocations", 0),
                   pool_hits=pool.get("hits", 0), pool_misses=pool.get("misses", 0),
                   live_handles=engine["live_handles"] if engine else 0, engine=engine)
        return out

    def close(self):
        """Discard every saved tensor still held, drain the streams and free the pinned pool."""
        if self._active:
            raise RuntimeError("close() inside the OffloadActivations block; leave the block first")
        with self._lock:
            self._closed = True
            if self._engine is not None and not self._engine.closed:
                self._discard(list(self._live))
                self._engine.close()
                self._final_engine_stats = self._engine.stats()

    # ------------------------------------------------------------ internals

    @staticmethod
    def _resolve_mode():
        from memkernels.runtime import device

        if device.backend() == "sim":
            return "sim"
        if torch.cuda.is_available():
            return "cuda"
        _warn_disabled_once()
        return None

    def _budget_for_this_block(self):
        """Bytes this block may offload (None: no limit): ``budget`` as given, or for "auto" the link's
        bandwidth times the forward's compute time, the time the device-to-host copies overlap (backward,
        about twice as long, restores the same bytes)."""
        if self.budget != "auto":
            return self.budget
        forward = self.forward_seconds if self.forward_seconds is not None else self._measured_forward_seconds()
        if forward is None:
            return None  # the first block: no forward time known yet
        bandwidth = self.link_bandwidth if self.link_bandwidth is not None else self._bandwidth()
        return None if bandwidth == math.inf else int(bandwidth * forward)

    def _bandwidth(self):
        """Device-to-host bytes per second, measured once per process and device."""
        if self._mode == "sim":
            if self._last_bandwidth is None:  # per manager: the simulator's link is set per test
                self._last_bandwidth = _sim_link_bandwidth()
        else:
            if self._device not in _measured_bandwidth:
                _measured_bandwidth[self._device] = _cuda_link_bandwidth(self._device)
            self._last_bandwidth = _measured_bandwidth[self._device]
        return self._last_bandwidth

    def _start_timer(self):
        if self.budget != "auto" or self.forward_seconds is not None:
            return
        self._collect_forward_time()
        if self._mode == "sim":
            sim = _device_sim()
            self._forward_timer = ("sim", max(sim.clock(0), sim.host_clock()))  # when a kernel issued now starts
        else:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._forward_timer = ("cuda", start)

    def _stop_timer(self, completed):
        timer, self._forward_timer = self._forward_timer, None
        if timer is None or not completed:
            return
        kind, start = timer
        if kind == "sim":
            self._forward_times.append(_device_sim().clock(0) - start)
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._forward_timer = ("cuda-pending", (start, end))  # read at the next block, without a sync

    def _collect_forward_time(self):
        timer = self._forward_timer
        if timer is not None and timer[0] == "cuda-pending":
            start, end = timer[1]
            if end.query():
                self._forward_times.append(start.elapsed_time(end) / 1000.0)
            self._forward_timer = None

    def _measured_forward_seconds(self):
        self._collect_forward_time()
        return statistics.median(self._forward_times) if self._forward_times else None

    def _trim_after_refusals(self):
        """At a block's start between steps: if the pinned pool refused memory since the last trim, free
        the cached slabs nothing uses so that the right sizes fit this time.

        Only when no graph holds a saved tensor of ours (no live stash but discarded ones has a reader):
        ``trim()`` waits for every copy in flight (and ``cudaFreeHost`` synchronizes the device). With a
        block per layer, every later block of a forward finds the earlier blocks' saves held there, so
        it never trims mid-step behind their copies; the refusal is answered at the first block after
        the step's backward released them, when no copy the step still needs is in flight (one left
        running is of a tensor no graph reads any more). Until then refused tensors go to pageable
        memory (or stay, ``"cap"``) as they would anyway."""
        refusals = self._engine.stats()["pool"]["refusals"]
        if refusals == self._refusals_seen:
            return
        if any(stash.readers and stash.state != _Stash.DISCARDED for stash in self._live):
            return  # inside a step (or a graph is still held): wait for the next block between steps
        self._refusals_seen = refusals
        # trim() would wait for them anyway; drained first, a copy left running by the last backward (its
        # tensor read on the device) gives its pinned block back too, so that its slab can go.
        self._engine.synchronize_all()
        self._drain()
        self._engine.trim()

    def _reset_block_state(self):
        self._by_storage = {}            # storage key -> weakref to its live stash (this block)
        self._order = _Order(getattr(self, "_order", None))  # weakrefs to this block's stashes, in pack order
        self._deferred = []              # saved since the last module call began
        self._param_storages = {}        # storage key -> weakref to the storage
        self._unscanned = []             # modules called whose parameters are not yet recorded
        self._modules_called = False
        self._checkpoint_inputs_seen = False
        self._counted = set()            # (reason, storage key) already counted as kept
        self._layers = None              # the layers of the model this block runs, once a module call shows them
        self._layer_offload = 0          # pinned bytes offloaded since the current layer began

    def _stream(self):
        if self._mode == "cuda":
            return torch.cuda.current_stream(self._device).cuda_stream
        return 0  # the simulator's default stream: CPU compute is already complete when a save happens

    def _on_module_call(self, module, args):
        # Parameters are recorded lazily (at the next save): wrappers such as
        # FSDP swap in unsharded parameter views in their own pre-hooks, which
        # run after this global one.
        self._unscanned.append(module)
        self._modules_called = True
        if self.only_checkpoint_inputs:
            return  # there the last region's input, not the last module's saves, is what backward needs first
        with self._lock:
            self._flush_deferred()  # the saves so far belong to the layer before, if this call starts one
            if self._starts_a_layer(module):
                self._layer_offload = 0

    def _starts_a_layer(self, module):
        """Is this call one of the block's layers? The first module called whose subtree holds a layer
        stack (the model, usually) names them; a module's stack is looked up once per manager."""
        if not self._layers:
            layers = self._layer_stacks.get(module)
            if layers is None:
                layers = self._layer_stacks[module] = _layer_stack(module)
            if layers:
                self._layers = layers
        return self._layers is not None and module in self._layers

    def _scan_modules(self):
        for module in self._unscanned:
            for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                try:
                    storage = tensor.untyped_storage()
                except (RuntimeError, NotImplementedError, TypeError):
                    continue
                self._param_storages[_storage_key(storage)] = weakref.ref(storage)
        self._unscanned.clear()

    def _is_parameter(self, tensor, storage):
        if tensor.is_leaf and tensor.requires_grad:
            return True
        if self._unscanned:
            self._scan_modules()
        ref = self._param_storages.get(_storage_key(storage))
        return ref is not None and ref() is storage

    def _skip_reason(self, tensor):
        """Why `tensor` stays on the device, or None; and its storage."""
        if getattr(_local, "no_offload", 0) > 0:
            return "no_offload", None
        if tensor.device != self._device:
            self._warn_other_device(tensor.device)
            return "other_device", None
        if (type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided
                or tensor.is_conj() or tensor.is_neg()):
            return "unsupported", None
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # e.g. functional or fake tensors
            return "unsupported", None
        if self._is_parameter(tensor, storage):
            return "parameter", storage
        nbytes = storage.nbytes()
        if nbytes == 0 or nbytes < self.min_offload_bytes:
            return "small", storage
        return None, storage

    def _warn_other_device(self, device):
        if device.type != "cuda" or device in self._warned_devices:
            return  # CPU tensors saved in a GPU model are not activations to offload
        self._warned_devices.add(device)
        warnings.warn(
            f"memkernels.OffloadActivations handles {self._device} (the current device when the block was "
            f"entered); tensors saved on {device} stay there. Call torch.cuda.set_device() for this process's GPU "
            "before entering the block, or use one OffloadActivations per device.",
            RuntimeWarning,
            stacklevel=4,
        )

    def _count_kept(self, reason, tensor, storage):
        key = (reason, _storage_key(storage) if storage is not None else id(tensor))
        if key not in self._counted:
            self._counted.add(key)
            self._kept[reason] += storage.nbytes() if storage is not None else tensor.nbytes

    def _pack(self, tensor):
        with self._lock:
            reason, storage = self._skip_reason(tensor)
            if reason is not None:
                self._count_kept(reason, tensor, storage)
                return tensor
            key = _storage_key(storage)
            cast = _parameter_cast_of(tensor) if self.recast_parameters else None
            if cast is not None:
                if ("recast", key) not in self._counted:
                    self._counted.add(("recast", key))
                    self._counts["bytes_recast"] += storage.nbytes()
                    self._counts["storages_recast"] += 1
                parameter, base = cast
                return _Recast(parameter, tensor, base)
            if self.only_checkpoint_inputs:
                if not _saved_by_checkpoint(sys._getframe(1)):
                    self._count_kept("not_checkpoint_input", tensor, storage)
                    return tensor
                self._checkpoint_inputs_seen = True
            ref = self._by_storage.get(key)
            stash = ref() if ref is not None else None
            if (stash is None or stash.storage_ref() is not storage or stash.version != tensor._version
                    or stash.state == _Stash.DISCARDED):
                if self.only_checkpoint_inputs:
                    self._flush_deferred()  # a region's input waits only until the next region's is saved
                stash = _Stash(self, storage, tensor._version, self._order)
                self._live.add(stash)
                self._by_storage[key] = weakref.ref(stash)
                self._deferred.append(stash)
                if self.offload_last_module:
                    self._flush_deferred()
            self._drain()
            packed = _Packed(stash, tensor)
            stash.readers.add(packed)
            return packed

    def _flush_deferred(self):
        """Start the D2H copies of everything deferred so far."""
        stream = self._stream() if self._deferred else None
        for stash in self._deferred:
            if self._block_budget is not None:
                if stash.nbytes > self._block_budget:
                    self._block_budget = 0  # spent: what is saved later stays, to keep the earliest-first order
                    self._keep(stash, "budget")
                    continue
                self._block_budget -= stash.nbytes
            handle = self._engine.offload(stash.source.data_ptr(), stash.nbytes, stream)
            if handle == 0:
                if self.pageable_fallback:
                    self._offload_pageable(stash)
                else:
                    self._keep(stash, "cap")
                continue
            stash.handle = handle
            stash.state = _Stash.OFFLOADING
            stash.order.last_offloaded = max(stash.order.last_offloaded, stash.index)
            self._pending.append(stash)
            self._counts["bytes_offloaded"] += stash.nbytes
            self._counts["storages_offloaded"] += 1
            # Pinned copies only (pageable ones never take window room). With only_checkpoint_inputs each
            # checkpoint input is its region's whole offload: a layer's.
            self._layer_offload = stash.nbytes if self.only_checkpoint_inputs else self._layer_offload + stash.nbytes
            self._largest_layer_offload = max(self._largest_layer_offload, self._layer_offload)
        self._deferred.clear()

    def _offload_pageable(self, stash):
        """The pinned pool refused (its cap, or the host pins no more): copy to pageable host memory.
        The copy is ordered on the compute stream and the host waits for it (pageable memory cannot be
        the target of an asynchronous copy), so it costs step time; it is said once."""
        if not self._warned_pageable:
            self._warned_pageable = True
            cap = f"max_pinned_bytes={self.max_pinned_bytes}" if self.max_pinned_bytes is not None else "no cap set"
            warnings.warn(
                f"memkernels.OffloadActivations: pinned host memory refused a {stash.nbytes}-byte copy ({cap}, "
                "or the host pins no more: WSL caps pinned memory at 1-2 GB); what does not fit goes to pageable "
                "memory, copied synchronously (slower). Raise max_pinned_bytes, lower the budget, or pass "
                "pageable_fallback=False to keep such tensors on the device instead.", RuntimeWarning, stacklevel=4)
        source = torch.empty((0,), dtype=torch.uint8, device=self._device).set_(stash.source)
        stash.pageable = torch.empty((stash.nbytes,), dtype=torch.uint8).copy_(source)
        stash.source = None
        stash.state = _Stash.OFFLOADED
        self._counts["bytes_offloaded"] += stash.nbytes
        self._counts["storages_offloaded"] += 1
        self._counts["bytes_pageable"] += stash.nbytes

    def _keep(self, stash, reason):
        stash.state = _Stash.KEPT
        self._kept[reason] += stash.nbytes

    def _drain(self):
        """Free the device copies whose D2H copy completed (in issue order, as the stream runs them)."""
        while self._pending and self._engine.offload_done(self._pending[0].handle):
            stash = self._pending.popleft()
            stash.source = None
            stash.state = _Stash.OFFLOADED

    def _drain_when_backward_ends(self):
        # Copies still running at an unpack hold their device source; look
        # again when this backward pass is over rather than at the next step.
        if self._drain_queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._drain_after_backward)
        except RuntimeError:  # unpacked outside a backward pass (e.g. grad_fn._saved_*)
            return
        self._drain_queued = True

    def _drain_after_backward(self):
        with self._lock:
            self._drain_queued = False
            if self._engine is not None and not self._engine.closed:
                self._drain()
                self._release_orphans()

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Recast):
            storage = self._recast(packed)
        else:
            packed.check_version()
            storage = self._materialize(packed)
        out = torch.empty((0,), dtype=packed.dtype, device=self._device)
        out.set_(storage, packed.storage_offset, packed.size, packed.stride)
        return out

    def _recast(self, packed):
        """The parameter cast again (one storage for every saved view of the same cast while it lives)."""
        parameter = packed.parameter
        if parameter._version != packed.version:
            raise RuntimeError(
                f"a {parameter.dtype} parameter of shape {tuple(parameter.shape)} changed in place between the "
                f"forward pass and its backward; memkernels.OffloadActivations restores its {packed.dtype} cast "
                "by casting it again, which would now differ. Run backward before changing parameters, or pass "
                "recast_parameters=False to copy such casts instead.")
        key = (_storage_key(parameter.untyped_storage()), packed.version, packed.dtype)
        with self._lock:
            ref = self._recasts.get(key)
            storage = ref() if ref is not None else None
            if storage is None:
                self._recasts = {k: r for k, r in self._recasts.items() if r() is not None}
                cast = parameter.detach().to(packed.dtype)
                if cast.stride() != packed.base_stride:
                    raise RuntimeError(f"memkernels.OffloadActivations: recasting a parameter gave strides "
                                       f"{cast.stride()}, its forward cast had {packed.base_stride}")
                storage = cast.untyped_storage()
                self._recasts[key] = weakref.ref(storage)
            return storage

    def _new_device_storage(self, nbytes):
        return torch.empty((nbytes,), dtype=torch.uint8, device=self._device).untyped_storage()

    def _materialize(self, reader):
        """The device storage of `reader`'s stash: the device copy while alive, else the restored one."""
        stash = reader.stash
        with self._lock:
            if stash.state == _Stash.DISCARDED:
                raise RuntimeError(
                    "memkernels.OffloadActivations: this saved tensor was discarded (the forward pass under "
                    "OffloadActivations raised, or the manager was closed); run the forward pass again")
            # Taken before the drain below, which drops it if its D2H copy completed since the last look:
            # while it lives it is read here, not copied back and waited for.
            source = stash.source
            if self._engine is not None and not self._engine.closed:
                self._drain()
                self._release_orphans()
                self._drain_when_backward_ends()
            if source is not None:  # deferred, kept, or its D2H copy still running (or just completed)
                self._counts["restores_from_device"] += 1
                # The offloaded stashes before it (kept under a budget, or copies still running) must start
                # coming back now, behind this part of backward, not on demand when it reaches them.
                self._prefetch_before(stash)
                return self._hand_out(reader, source)  # once drained, the stash holds it only for other readers
            storage = stash.restored() if stash.restored is not None else None
            if storage is not None:
                return self._hand_out(reader, storage)
            if stash.pageable is not None:
                restored = torch.empty((stash.nbytes,), dtype=torch.uint8, device=self._device)
                restored.copy_(stash.pageable, non_blocking=True)  # staged by the driver: safe from pageable
                self._counts["restores_on_demand"] += 1
                return self._hand_out(reader, restored.untyped_storage())
            if stash.prefetched is not None:
                (storage, _), stash.prefetched = stash.prefetched, None
                self._prefetched_bytes -= stash.nbytes
                self._counts["prefetch_hits"] += 1
            else:
                storage = self._new_device_storage(stash.nbytes)
                self._engine.prefetch(stash.handle, storage.data_ptr(), self._stream())
                self._counts["restores_on_demand"] += 1
            self._prefetch_before(stash)
            self._wait(stash.handle)
            return self._hand_out(reader, storage)

    @staticmethod
    def _hand_out(reader, storage):
        """Give `storage`, the device storage of `reader`'s stash, to `reader`. The stash holds it until every
        other reader has read it too (or was dropped by autograd unread): autograd frees the first reader's
        tensor once its node ran, and the next reader of the same storage would otherwise copy it back from
        the host again. With one reader (the common case) the stash never holds it; a later pass
        (``retain_graph=True``) finds it freed, restores it again and holds it again for its other readers."""
        stash = reader.stash
        if stash.restored is None or stash.restored() is not storage:  # a new copy: nobody has read it yet
            stash.restored = weakref.ref(storage)
            stash.unread = weakref.WeakSet(stash.readers)
        stash.unread.discard(reader)
        stash.resident = storage if stash.unread else None
        return storage

    def _wait(self, handle, stream=None):
        if self._mode == "cuda":
            self._engine.wait(handle, self._stream() if stream is None else stream)
        else:
            self._engine.synchronize(handle)  # CPU compute reads the bytes right after we return

    def _prefetch_window(self):
        if self.prefetch_bytes == "auto":
            return max(_AUTO_PREFETCH_FLOOR, self._largest_layer_offload)
        return self.prefetch_bytes

    def _prefetch_before(self, unpacked):
        """Start restoring the stashes packed before `unpacked` (latest first) in its block, within budget;
        at a block's first stash (the last its backward needs), the block entered before it: a plan's
        offloaded layers are a block each, and the previous layer's restore then runs while this
        layer's backward ends, not on demand. One block, not further, and only once this block's own
        restores are done, so that restored copies of two blocks never pile up on the device."""
        stream, limit = None, self._prefetch_window()
        order, index, scanned = unpacked.order, unpacked.index, 0
        blocks = 2 if unpacked.index == 0 else 1
        while order is not None and scanned < _PREFETCH_SCAN_LIMIT and blocks:
            blocks -= 1
            index = min(index, order.last_offloaded + 1)  # nothing later is on the host
            window = order[max(0, index - (_PREFETCH_SCAN_LIMIT - scanned)):index]
            scanned += len(window)
            for ref in reversed(window):
                stash = ref()
                if (stash is None or stash.state != _Stash.OFFLOADED or stash.prefetched is not None
                        or stash.pageable is not None
                        or (stash.restored is not None and stash.restored() is not None)):
                    continue
                # At least one tensor ahead, however large: a window smaller than one layer's saves would
                # otherwise restore every one on demand.
                if limit == 0 or (self._prefetched_bytes and self._prefetched_bytes + stash.nbytes > limit):
                    return
                stream = self._stream() if stream is None else stream
                storage = self._new_device_storage(stash.nbytes)
                self._engine.prefetch(stash.handle, storage.data_ptr(), stream)
                stash.prefetched = (storage, stream)  # the stream the storage belongs to: its free waits there
                self._prefetched_bytes += stash.nbytes
            order = order.previous() if order.previous is not None else None
            index = len(order) if order is not None else 0

    def _retire(self, stash):
        """A stash nobody holds any more: give its pinned block back.

        It runs from ``__del__``, in whichever thread collects garbage, so it makes no CUDA call for
        a prefetch still in flight: that storage and its handle wait in ``_orphans`` for an explicit
        point (an unpack, the end of backward, the next block, close()), which orders the free after
        the copy on the stream the storage was allocated on."""
        with self._lock:
            live = stash.state != _Stash.DISCARDED and not self._engine.closed
            if stash.prefetched is not None:
                if live:
                    storage, stream = stash.prefetched
                    self._orphans.append((storage, stash.handle, stream))
                stash.prefetched = None
                self._prefetched_bytes -= stash.nbytes
            elif stash.handle and live:
                self._engine.release(stash.handle)
            stash.state = _Stash.DISCARDED
            stash.owner = None

    def _release_orphans(self):
        """Free retired prefetches: the storage's stream waits for the copy, then the handle goes."""
        orphans, self._orphans = self._orphans, []  # holds the storages until every wait is issued
        for _, handle, stream in orphans:
            self._wait(handle, stream)
            self._engine.release(handle)

    def _discard_block(self):
        """Drop everything this block offloaded (after an exception inside it)."""
        self._discard([ref() for ref in self._order] + self._deferred)

    def _discard(self, stashes):
        self._engine.synchronize_all()  # no copy may still read a source or write a block
        for _, handle, _ in self._orphans:
            self._engine.release(handle)
        self._orphans = []
        for stash in stashes:
            if stash is None or stash.state == _Stash.DISCARDED:
                continue
            if stash.prefetched is not None:
                stash.prefetched = None
                self._prefetched_bytes -= stash.nbytes
            if stash.handle:
                self._engine.release(stash.handle)
            stash.source = stash.pageable = stash.resident = None
            stash.state = _Stash.DISCARDED
        self._pending = collections.deque(s for s in self._pending if s.state != _Stash.DISCARDED)
        self._reset_block_state()


class OffloadedCheckpoints:
    """What :func:`offload_checkpoints` attached: ``offload`` (the :class:`OffloadActivations`, for its
    ``stats()``), :meth:`remove`."""

    def __init__(self, model, offload):
        self.offload = offload
        self._depth = 0
        self._handles = [model.register_forward_pre_hook(self._enter),
                         model.register_forward_hook(self._exit, always_call=True)]

    def _enter(self, module, args):
        # Only training forwards save anything; a nested call of the model runs in the outer block.
        if self._depth or torch.is_grad_enabled():
            if self._depth == 0:
                self.offload.__enter__()
            self._depth += 1

    def _exit(self, module, args, output):
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            # Called from Module's exception handler when forward raised (always_call): the block is then
            # discarded, as a `with` block's would be.
            exc = sys.exc_info() if output is None else (None, None, None)
            self.offload.__exit__(*exc)

    def stats(self):
        return self.offload.stats()

    def remove(self):
        """Detach from the model and free the pinned memory (after the last backward)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.offload.close()


def offload_checkpoints(model, **options):
    """Offloaded checkpoints for a model whose layers are checkpointed, without touching the training
    loop (a Hugging Face ``Trainer``'s included): every forward of ``model`` with grad enabled runs
    inside ``OffloadActivations(only_checkpoint_inputs=True, **options)``, so each checkpointed layer's
    input goes to pinned host memory and comes back one layer ahead of its recompute::

        model.activation_checkpointing_enable()   # or torch.utils.checkpoint around each layer
        handle = memkernels.offload_checkpoints(model)
        trainer.train()                           # or any loop: loss = model(...); loss.backward()
        print(handle.stats()["bytes_offloaded"])
        handle.remove()

    ``options``: keyword arguments of :class:`OffloadActivations` (``min_offload_bytes``,
    ``max_pinned_bytes``, ``budget``...). Returns an :class:`OffloadedCheckpoints`. A forward that
    raises discards what its block offloaded; forwards without grad (evaluation, generation) are left
    alone. Where the layers are not checkpointed, the first block says so (a RuntimeWarning)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"offload_checkpoints(model): needs an nn.Module, got {type(model).__name__}")
    if "only_checkpoint_inputs" in options:
        raise ValueError("offload_checkpoints(only_checkpoint_inputs=...): always True here; use "
                         "OffloadActivations directly to offload other saved tensors")
    return OffloadedCheckpoints(model, OffloadActivations(only_checkpoint_inputs=True, **options))
