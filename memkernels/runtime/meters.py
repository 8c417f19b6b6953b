"""Meters of tensor memory: bytes saved for backward, and peak live bytes.

Both meters learn which storages are *created inside* the metered region from a
``TorchDispatchMode`` that looks at the output of every aten op run in the region
(forward, backward, custom ``autograd.Function`` bodies, and Triton launchers,
which allocate their outputs with ``torch.empty``). An output storage that none
of the op's inputs held was allocated by that op. This works the same on CPU,
``meta`` and any other device: storages are keyed by identity
(``untyped_storage()._cdata``, the address of the C++ StorageImpl), not by data
pointer, which is 0 on ``meta``.

An address can be reused once a storage dies, so every tracked storage carries
a weak reference whose callback forgets it the moment it dies. PyTorch keeps a
storage's Python object alive for as long as its StorageImpl lives (PyObject
preservation), so the callback fires exactly when the memory is released, not
when the last Python handle goes away; tests/test_meters.py pins this.

Custom ops (``torch.library`` ops outside ``aten``, e.g. ``memkernels::norm_fwd``)
reach a dispatch mode as one opaque call: PyTorch pops the mode before calling
``__torch_dispatch__``, so running the op there would hide every tensor its
implementation allocates and frees (scratch, temporaries of a reference path)
and only its outputs would be seen. The watch therefore runs such an op with
itself back on the mode stack, redispatched to the backend kernel below the
Python key (which also keeps the op from reaching the watch again): the aten ops
inside are metered like any other, and the op's outputs, already tracked when
they were allocated inside, are not counted twice. When another kind of mode
is on the stack or an argument is a tensor subclass (fake tensors, functional
tensors during torch.compile tracing), skipping the Python key would bypass
them, so the op is then run as a single call and only its outputs are seen.

The ops in :data:`ONE_KERNEL_OPS` are run as one call all the same: each stands
for one GPU kernel, and its CPU implementation's temporaries are not memory a GPU
asks for.

What is *not* seen: memory a kernel allocates internally without returning it
as a tensor (e.g. a CPU BLAS workspace, or a C++ aten kernel's internal
buffers), and tensors made outside the dispatcher. The meters count tensor
storages, which is what a caching allocator is asked for on the GPU.

Usage::

    with SavedBytesMeter() as saved:
        loss = model(x).sum()
    saved.new_bytes        # activations the backward pass will hold
    with PeakBytesMeter() as peak:
        loss.backward()
    peak.peak_bytes        # extra memory backward needed at its worst moment
"""
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

__all__ = ["SavedBytesMeter", "PeakBytesMeter"]

_PYTHON_KEY = torch._C.DispatchKey.Python
_KEYS_BELOW_PYTHON = torch._C._dispatch_keyset_full_after(_PYTHON_KEY)
_CORE_NAMESPACES = ("aten", "prim", "prims")
# Custom ops that stand for one GPU kernel, whose CPU implementation may allocate what the GPU's does not
# (memkernels::addmm_float32_ widens its half operands where aten has no float32-result GEMM, as on the CPU):
# run as one call, their outputs alone seen, as a GPU's allocator would see them.
ONE_KERNEL_OPS = frozenset({"memkernels::addmm_float32_"})


def _leaves(values, into):
    """The leaves of ``values``, an op's arguments or outputs (tensors and scalars in tuples and lists, as aten's
    schemas nest them), appended to ``into``. Not pytree's tree_leaves: every op of a planner's profile passes
    here (10^5-10^6 a plan), and pytree's generality (dicts, namedtuples, registered classes) cost a fifth of a
    profile's time."""
    for value in values:
        if isinstance(value, (tuple, list)):  # torch.return_types are tuples too
            _leaves(value, into)
        else:
            into.append(value)
    return into


def _storage_of(value):
    """The UntypedStorage behind a tensor or storage, or None (sparse, nested, non-tensors)."""
    if isinstance(value, torch.Tensor):
        try:
            return value.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return None
    if isinstance(value, torch.UntypedStorage):
        return value
    if isinstance(value, torch.TypedStorage):
        return value.untyped_storage()
    return None


class _Allocation:
    """Bookkeeping for one storage allocated (or grown) inside the region."""

    __slots__ = ("counted_bytes", "last_nbytes", "owned", "ref")

    def __init__(self, counted_bytes, last_nbytes, owned, ref):
        self.counted_bytes = counted_bytes  # bytes this storage adds to the region's live total
        self.last_nbytes = last_nbytes      # storage size at the last look, to notice resize_
        self.owned = owned                  # created inside the region (False: pre-existing, grown)
        self.ref = ref                      # weakref whose callback reports the storage's death


class _AllocationWatch(TorchDispatchMode):
    """Tracks storages that ops inside the region create, and their deaths.

    ``live_bytes`` is the sum of bytes allocated inside the region and still
    alive; ``peak_bytes`` its maximum. A pre-existing storage that an op grows
    in place (``out=`` into a too-small tensor, ``resize_``) counts for the
    growth only.
    """

    def __init__(self):
        super().__init__()
        self.allocations = {}  # storage key -> _Allocation, alive storages only
        self.live_bytes = 0
        self.peak_bytes = 0
        self._lock = threading.RLock()  # a storage may die on another thread (autograd workers)

    def owns(self, storage):
        entry = self.allocations.get(storage._cdata)
        return entry is not None and entry.owned

    def stop(self):
        """Stop following deaths: dropping the weakrefs cancels their callbacks."""
        with self._lock:
            self.allocations.clear()

    def _on_death(self, key):
        def forget(_ref):
            with self._lock:
                entry = self.allocations.pop(key, None)
                if entry is not None:
                    self.live_bytes -= entry.counted_bytes
        return forget

    def _add(self, storage, counted_bytes, owned):
        key = storage._cdata
        nbytes = storage.nbytes()
        with self._lock:
            self.allocations[key] = _Allocation(counted_bytes, nbytes, owned,
                                                weakref.ref(storage, self._on_death(key)))
            self.live_bytes += counted_bytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _regrow(self, entry, storage):
        nbytes = storage.nbytes()
        if nbytes != entry.last_nbytes:
            with self._lock:
                entry.counted_bytes += nbytes - entry.last_nbytes
                self.live_bytes += nbytes - entry.last_nbytes
                entry.last_nbytes = nbytes
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _run(self, func, args, kwargs):
        """Run ``func``; a custom op runs with this watch on the stack so its insides are seen."""
        if not isinstance(func, torch._ops.OpOverload) or func.namespace in _CORE_NAMESPACES \
                or f"{func.namespace}::{func._opname}" in ONE_KERNEL_OPS:
            return func(*args, **kwargs)
        keys = None
        for leaf in _leaves(kwargs.values(), _leaves(args, [])):
            if isinstance(leaf, torch.Tensor):
                leaf_keys = torch._C._dispatch_keys(leaf)
                if leaf_keys.has(_PYTHON_KEY):  # a tensor subclass: it must see the op itself
                    return func(*args, **kwargs)
                keys = leaf_keys if keys is None else keys | leaf_keys
        other_modes = _get_current_dispatch_mode_stack()
        if keys is None or not all(isinstance(mode, _AllocationWatch) for mode in other_modes):
            return func(*args, **kwargs)
        # Other watches below this one see the op's insides through this one's func() calls.
        with self:
            return func.redispatch(keys & _KEYS_BELOW_PYTHON, *args, **kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Sizes of the storages the op was given, before it runs: an output storage
        # among them is not new (views, in-place, out=), unless the op grew it.
        input_nbytes = {}
        for leaf in _leaves(kwargs.values(), _leaves(args, [])):
            storage = _storage_of(leaf)
            if storage is not None:
                input_nbytes[storage._cdata] = storage.nbytes()
        out = self._run(func, args, kwargs)
        for leaf in _leaves(out, []) if isinstance(out, (tuple, list)) else (out,):
            storage = _storage_of(leaf)
            if storage is None:
                continue
            key = storage._cdata
            entry = self.allocations.get(key)
            if entry is not None:
                self._regrow(entry, storage)
            elif key not in input_nbytes:
                self._add(storage, storage.nbytes(), owned=True)
            elif storage.nbytes() > input_nbytes[key]:
                self._add(storage, storage.nbytes() - input_nbytes[key], owned=False)
        return out


class PeakBytesMeter:
    """Peak of live tensor bytes allocated inside a ``with`` block, relative to entry.

    Counts every storage an op creates inside the block (forward, backward,
    custom autograd Functions, Triton launchers) from its allocation until it
    is freed. Tensors that existed before the block are not counted, and their
    frees do not lower the count: ``peak_bytes`` is the most memory the block
    needed on top of what was already allocated. CPU, ``meta`` and any device.

    Attributes (bytes, ints): ``peak_bytes`` and ``current_bytes`` (allocated in
    the block and still alive); inside the block both are live, after exit they
    are the values at exit.
    """

    def __init__(self):
        self._watch = None
        self._peak_at_exit = 0
        self._current_at_exit = 0

    @property
    def peak_bytes(self):
        if self._watch is not None:
            return self._watch.peak_bytes
        return self._peak_at_exit

    @property
    def current_bytes(self):
        if self._watch is not None:
            return self._watch.live_bytes
        return self._current_at_exit

    def restart_peak(self):
        """Return the peak so far and start a new one from the live bytes now (inside the block).

        Phases of one region (forward, backward, optimizer) each get their own peak this way;
        after it, ``peak_bytes`` at exit is the peak since the last restart.
        """
        if self._watch is None:
            raise RuntimeError("PeakBytesMeter.restart_peak() needs the meter's with-block to be active")
        with self._watch._lock:
            peak = self._watch.peak_bytes
            self._watch.peak_bytes = self._watch.live_bytes
        return peak

    def __enter__(self):
        if self._watch is not None:
            raise RuntimeError("PeakBytesMeter is already active; use a new meter for a nested region")
        self._watch = _AllocationWatch()
        self._watch.__enter__()
        return self

    def __exit__(self, *exc):
        watch, self._watch = self._watch, None
        watch.__exit__(*exc)
        watch.stop()
        self._peak_at_exit = watch.peak_bytes
        self._current_at_exit = watch.live_bytes
        return False

    def __repr__(self):
        return f"PeakBytesMeter(peak_bytes={self.peak_bytes}, current_bytes={self.current_bytes})"


_active_saved_meters = threading.local()


def _saved_meter_stack():
    if not hasattr(_active_saved_meters, "stack"):
        _active_saved_meters.stack = []
    return _active_saved_meters.stack


class SavedBytesMeter:
    """Bytes of tensors saved for backward inside a ``with`` block.

    Every tensor autograd saves (``ctx.save_for_backward``, built-in ops'
    saved inputs and outputs) passes through a ``saved_tensors_hooks`` pack
    hook that records it and returns the tensor itself, so what autograd keeps
    is unchanged. Records are deduplicated by storage: a storage saved through
    several views, or by several ops, counts once, with its *whole* size
    (``storage.nbytes()``), because the whole storage is what stays allocated
    while any view of it is saved.

    Each storage is ``new`` (created inside the block: activations, the op's own
    buffers) or aliased (existed before: inputs, parameters). Storages are
    distinguished while alive; a storage that dies and whose address is reused
    is a different storage.

    Attributes after (and during) the block:
      - ``records``: list of dicts, one per saved storage, in save order:
        ``shape``, ``dtype``, ``device`` (of the first tensor saved from it),
        ``nbytes`` (whole storage), ``new`` (bool), ``label``, ``saves``
        (how many times a tensor on that storage was saved).
      - ``new_bytes``, ``aliased_bytes``, ``total_bytes`` (ints).

    ``label``: set it (e.g. from module forward pre-hooks) to tag the records
    saved from then on; a storage saved under several labels belongs to the
    first. ``bytes_by_label()`` sums by tag.

    Nesting: meters nest (the innermost records into every enclosing meter).
    Another ``saved_tensors_hooks`` opened inside the block (activation
    offload, non-reentrant checkpointing) hides its saves from the meter.
    """

    def __init__(self):
        self.records = []
        self.label = None
        self._record_of_key = {}  # storage key -> (record, weakref to the storage), alive storages only
        self._watch = None
        self._hooks = None

    @property
    def new_bytes(self):
        return sum(r["nbytes"] for r in self.records if r["new"])

    @property
    def aliased_bytes(self):
        return sum(r["nbytes"] for r in self.records if not r["new"])

    @property
    def total_bytes(self):
        return sum(r["nbytes"] for r in self.records)

    def bytes_by_label(self, new_only=False):
        """{label: bytes} over the records (only new storages if ``new_only``)."""
        totals = {}
        for record in self.records:
            if record["new"] or not new_only:
                totals[record["label"]] = totals.get(record["label"], 0) + record["nbytes"]
        return totals

    def bytes_per_token(self, num_tokens, new_only=True):
        """Saved bytes divided by ``num_tokens`` (e.g. batch * sequence length)."""
        if not isinstance(num_tokens, int) or num_tokens <= 0:
            raise ValueError(f"bytes_per_token(num_tokens={num_tokens!r}): num_tokens must be a positive int")
        return (self.new_bytes if new_only else self.total_bytes) / num_tokens

    def _forget(self, key):
        def forget(_ref):
            self._record_of_key.pop(key, None)
        return forget

    def _record(self, tensor):
        storage = _storage_of(tensor)
        if storage is None:  # sparse or nested: no single storage to dedupe on
            self.records.append(self._make_record(tensor, tensor.nbytes, new=False))
            return
        key = storage._cdata
        seen = self._record_of_key.get(key)
        if seen is not None:
            seen[0]["saves"] += 1
            return
        record = self._make_record(tensor, storage.nbytes(), new=self._watch.owns(storage))
        self._record_of_key[key] = (record, weakref.ref(storage, self._forget(key)))
        self.records.append(record)

    def _make_record(self, tensor, nbytes, new):
        return {"shape": tuple(tensor.shape), "dtype": tensor.dtype, "device": tensor.device,
                "nbytes": nbytes, "new": new, "label": self.label, "saves": 1}

    def _pack(self, tensor):
        stack = _saved_meter_stack()
        # Only the innermost saved_tensors_hooks run, so this meter's hook records
        # for itself and every meter opened around it (on this thread).
        enclosing = stack[: stack.index(self)] if self in stack else []
        for meter in enclosing + [self]:
            meter._record(tensor)
        return tensor

    def __enter__(self):
        if self._watch is not None:
            raise RuntimeError("SavedBytesMeter is already active; use a new meter for a nested region")
        self._watch = _AllocationWatch()
        self._watch.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        _saved_meter_stack().append(self)
        return self

    def __exit__(self, *exc):
        _saved_meter_stack().remove(self)
        self._hooks.__exit__(*exc)
        self._watch.__exit__(*exc)
        self._watch.stop()
        self._watch = self._hooks = None
        # Records stay; the storage keys may be reused by anything from now on.
        self._record_of_key.clear()
        return False

    def __repr__(self):
        return (f"SavedBytesMeter(new_bytes={self.new_bytes}, aliased_bytes={self.aliased_bytes}, "
                f"records={len(self.records)})")


def _unpack(tensor):
    return tensor
