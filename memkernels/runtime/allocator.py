"""memkernels' caching pool allocator at run time: PyTorch's CUDA allocator, and its statistics.

``install()`` makes the pool PyTorch's CUDA allocator (``CUDAPluggableAllocator``); ``stats()``,
``memory_summary()``, ``snapshot()``, ``empty_cache()``, ``set_memory_cap()`` and ``reserve()``
give back what PyTorch's own functions lose under a pluggable allocator (docs/allocator.md).
Replaying recorded traces through the same pool, and the comparison with PyTorch's policy, is
:mod:`memkernels.forensics.replay` (``memkernels replay``).

The C++ pool is in ``csrc/core/`` (policy and the reasons for it: ``csrc/core/policy.hpp``).
"""
import os

from memkernels.runtime.sizes import format_size, text_table

_POLICY_KEYS = (
    "min_block",
    "small_request",
    "small_segment",
    "segment_granularity",
    "fitted_request_limit",
    "fitted_segment_max",
    "large_split_min",
    "release_before_growth",
    "oversize_block",
    "oversize_ratio",
)
_POOL_KEYS = (
    "memory_cap_bytes",
    "memory_cap_fraction",
    "gc_threshold",
    "trace_capacity",
    "expandable_segments",
    "expandable_range_bytes",
)


def core():
    from memkernels import _C as extension

    return extension


# ---------------------------------------------------------------------- pool configuration


def pool_config(policy="memkernels", **config):
    C = core()
    if policy not in ("memkernels", "pytorch"):
        raise ValueError(f"policy must be 'memkernels' or 'pytorch', got {policy!r}")
    unknown = sorted(set(config) - set(_POLICY_KEYS) - set(_POOL_KEYS))
    if unknown:
        raise TypeError(
            f"unknown allocator option(s) {unknown}; valid options: {sorted(_POLICY_KEYS + _POOL_KEYS)}"
        )
    pool_config = C.PoolConfig()
    rules = C.PoolPolicy.pytorch() if policy == "pytorch" else C.PoolPolicy()
    for key in _POLICY_KEYS:
        if key in config:
            setattr(rules, key, config[key])
    pool_config.policy = rules
    for key in _POOL_KEYS:
        if key in config:
            setattr(pool_config, key, config[key])
    pool_config.validate()
    return pool_config




# ---------------------------------------------------------------------- snapshots


def pool_snapshot(pool):
    """A snapshot of ``pool`` (a ``memkernels._C.Pool``) in PyTorch's format.

    ``segments``: every segment of every device with its ``blocks`` (states
    ``active_allocated`` / ``active_pending_free`` / ``inactive``); ``device_traces[d]``: the
    trace ring of device d (empty unless tracing was enabled with ``trace_capacity``).
    ``torch.cuda._memory_viz`` renders it (``segment_plot``, ``trace_plot``, ``segsum``, ``trace``).
    """
    devices = pool.devices()
    segments = [segment for d in devices for segment in pool.segments(d)]
    traces = [[] for _ in range(max(devices) + 1 if devices else 0)]
    for d in devices:
        traces[d] = pool.trace(d)
    return {"segments": segments, "device_traces": traces}


# ---------------------------------------------------------------------- summaries

# Above this share of reserved memory held but unusable, memory_summary warns; the monitor and explain use the
# same line.
FRAGMENTATION_WARNING = 0.30
# What memory_summary() says without CUDA.
NO_CUDA_MESSAGE = ("memory_summary: no CUDA device on this machine (torch.cuda.is_available() is False), so there "
                   "is no device memory to summarize. activation_ledger(), evaluate() and estimate() work on the "
                   "CPU and meta device.")


def format_memory_summary(stats, device=0):
    """A readable table of one device's pool statistics (the dict of ``Pool.stats``)."""
    lines = [f"memkernels pool, device {device}", "-" * 78]
    header = f"{'':<22}{'current':>14}{'peak':>14}{'allocated':>14}{'freed':>14}"
    lines.append(header)
    rows = [
        ("allocated memory", "allocated_bytes", True),
        ("requested memory", "requested_bytes", True),
        ("active memory", "active_bytes", True),
        ("reserved memory", "reserved_bytes", True),
        ("allocations", "allocation", False),
        ("segments", "segment", False),
    ]
    for label, key, is_bytes in rows:
        for scope, source in (("", stats), (" small pool", stats["pools"]["small"]), (" large pool", stats["pools"]["large"])):
            stat = source[key]
            fmt = format_size if is_bytes else str
            lines.append(
                f"{(label if not scope else '  ' + scope.strip()):<22}"
                + "".join(f"{fmt(stat[k]):>14}" for k in ("current", "peak", "allocated", "freed"))
            )
    lines.append("-" * 78)
    lines.append(
        f"fragmentation (1 - allocated/reserved): {stats['fragmentation']:.1%}; external (1 - largest free/free): "
        f"{stats['external_fragmentation']:.1%}"
    )
    lines.append(
        f"cached free: {format_size(stats['free_bytes'])}, largest free block {format_size(stats['largest_free_block'])}"
    )
    histogram = ", ".join(f">={format_size(size)}: {count}" for size, count in sorted(stats["free_block_histogram"].items()))
    lines.append(f"free blocks by size: {histogram or 'none'}")
    lines.append(
        f"device allocations {stats['num_device_alloc']}, device frees {stats['num_device_free']}, "
        f"retries {stats['num_alloc_retries']}, OOMs {stats['num_ooms']}"
        + (f", memory cap {format_size(stats['memory_cap'])}" if stats["memory_cap"] else "")
    )
    if stats["reserved_bytes"]["current"] and stats["fragmentation"] > FRAGMENTATION_WARNING:
        lines.append(
            f"WARNING: {stats['fragmentation']:.0%} of reserved memory "
            f"({format_size(stats['reserved_bytes']['current'] - stats['allocated_bytes']['current'])}) is held "
            "but not allocated. memkernels.allocator.empty_cache() returns whole free segments to the device; "
            "a lower gc_threshold does it automatically."
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- the installed pool (PyTorch plug-in)

_plugin = None  # the CUDAPluggableAllocator handed to torch: torch must never outlive its reference
_step_hook = None  # the optimizer step hook that calls end_step(), registered once per process


def install(*, mark_steps=True, **config):
    """Make memkernels' pool PyTorch's CUDA allocator (CUDAPluggableAllocator + change_current_allocator).

    Must run before the first CUDA allocation of the process. ``**config``: pool options, as for
    :func:`replay` (e.g. ``memory_cap_fraction=0.9``, ``gc_threshold=0.8``,
    ``trace_capacity=100_000``, ``expandable_segments=True`` for segments that grow by mapping
    pages through the driver's virtual-memory API; off by default, see docs/allocator.md).
    ``mark_steps``: every optimizer step ends a step of the pool's loop (:func:`end_step`, through
    torch's global optimizer step hook), so a loop whose steps repeat makes no ``cudaMalloc`` after
    its first two steps (default True; False: call :func:`end_step` yourself, or never).
    Returns the installed ``memkernels._C.Pool``.

    Untested on a GPU (none was available): everything up to handing the entry points to torch
    is tested on the simulated device; the torch calls themselves are thin.
    """
    global _plugin, _step_hook
    import torch

    if torch.version.cuda is None:
        raise RuntimeError(
            f"memkernels.allocator.install() plugs the pool into PyTorch's CUDA allocator, but this torch "
            f"({torch.__version__}) is a build without CUDA. Install a CUDA build of torch to use it; "
            "memkernels.forensics.replay.replay() works without one."
        )
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "memkernels.allocator.install() must run before the first CUDA allocation: CUDA is already "
            "initialized in this process, so PyTorch's own allocator may hold memory. Call install() at the "
            "start of the program, before creating any CUDA tensor."
        )
    if not isinstance(mark_steps, bool):
        raise ValueError(f"mark_steps must be True or False, got {mark_steps!r}")
    C = core()
    pool = C.install_device_pool(pool_config(**config))
    if mark_steps and _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _step_hook = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: end_step())
    _raise_torch_out_of_memory_error(torch)
    _avoid_record_stream(torch)
    plugin = torch.cuda.memory.CUDAPluggableAllocator(C.__file__, C.DEVICE_POOL_ALLOC_SYMBOL, C.DEVICE_POOL_FREE_SYMBOL)
    torch.cuda.memory.change_current_allocator(plugin)
    _plugin = plugin
    return pool


# ProcessGroupNCCL reads this when a process group is created: set, it keeps references to a
# collective's tensors until the user's stream has waited for it instead of calling the
# allocator's recordStream, which a pluggable allocator cannot receive from C++.
NCCL_AVOID_RECORD_STREAMS = "TORCH_NCCL_AVOID_RECORD_STREAMS"


def _avoid_record_stream(torch):
    """Keep blocks used on side streams safe under the pool (docs/allocator.md, "record_stream").

    - ``Tensor.record_stream`` from Python (FSDP1, DataParallel, user code) is routed to the
      pool's own record_stream: the block is not reused until those streams finished with it.
    - C++ callers cannot be reached: ProcessGroupNCCL (DDP, FSDP) is told to stash references
      instead (``TORCH_NCCL_AVOID_RECORD_STREAMS=1``), with a warning where that cannot hold.
    """
    import warnings

    value = os.environ.get(NCCL_AVOID_RECORD_STREAMS)
    if value is None:
        os.environ[NCCL_AVOID_RECORD_STREAMS] = "1"
    elif value.strip().lower() not in ("1", "true", "yes", "y", "on"):
        warnings.warn(
            f"memkernels.allocator.install(): {NCCL_AVOID_RECORD_STREAMS}={value} makes NCCL process groups "
            "call the allocator's recordStream, which does nothing under a pluggable allocator: a tensor "
            "used by an asynchronous collective could be reused before the collective ends. Unset it or set "
            "it to 1.",
            RuntimeWarning,
            stacklevel=3,
        )
    distributed = getattr(torch, "distributed", None)
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        warnings.warn(
            "memkernels.allocator.install(): a torch.distributed process group already exists; NCCL groups "
            f"created before install() did not see {NCCL_AVOID_RECORD_STREAMS}=1 and call recordStream, "
            "which does nothing under a pluggable allocator. Call install() before init_process_group().",
            RuntimeWarning,
            stacklevel=3,
        )
    if not getattr(torch.Tensor.record_stream, "_memkernels", False):
        torch.Tensor.record_stream = _pool_record_stream(torch.Tensor.record_stream)


def _pool_record_stream(original):
    warned = []

    def record_stream(tensor, stream):
        if _plugin is not None and tensor.device.type == "cuda":
            address = tensor.untyped_storage().data_ptr()
            try:
                installed_pool().record_stream(address, stream.cuda_stream, tensor.device.index)
            except ValueError as error:  # memory the pool did not allocate (from_blob, DLPack)
                if not warned:
                    warned.append(True)
                    import warnings

                    warnings.warn(f"memkernels: record_stream on memory the pool does not own: {error}",
                                  RuntimeWarning, stacklevel=2)
        return original(tensor, stream)

    record_stream._memkernels = True
    record_stream.__doc__ = original.__doc__
    return record_stream


def _raise_torch_out_of_memory_error(torch):
    """Make the pool's out of memory raise ``torch.OutOfMemoryError`` (else RuntimeError, with a warning).

    The pool's entry point throws a real ``c10::OutOfMemoryError`` built by the libc10 torch has
    loaded (csrc/cuda/torch_error.hpp); this hands it that library's path.
    """
    libc10 = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    reason = core().use_torch_out_of_memory_error(libc10 if os.path.isfile(libc10) else "libc10.so")
    if reason:
        import warnings

        warnings.warn(
            f"memkernels.allocator.install(): out of memory under the pool raises RuntimeError instead of "
            f"torch.OutOfMemoryError ({reason}). `except RuntimeError` catches both; "
            "memkernels.allocator.is_out_of_memory(error) tells them apart.",
            RuntimeWarning,
            stacklevel=3,
        )


def installed():
    """True once :func:`install` has made the pool PyTorch's CUDA allocator in this process."""
    return _plugin is not None


def is_out_of_memory(error):
    """True for an out-of-memory error from PyTorch's allocator or from memkernels' installed pool.

    ``torch.OutOfMemoryError`` covers both where install() could resolve torch's type; otherwise
    the pool's error reaches Python as a RuntimeError whose message starts with
    ``memkernels: out of memory``.
    """
    import torch

    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and str(error).startswith("memkernels: out of memory")
    )


class CudaMemoryCounters:
    """Allocated-bytes counters of the CUDA allocator in use: the installed pool's or PyTorch's.

    ``torch.cuda.memory_allocated()`` and friends raise under a pluggable allocator, so every tool
    reads memory through this. ``device``: index, or None for the current device.
    """

    def __init__(self, device=None):
        self.device = device

    def allocated(self):
        if installed():
            return stats(self.device)["allocated_bytes"]["current"]
        import torch

        return torch.cuda.memory_allocated(self.device)

    def peak_allocated(self):
        if installed():
            return stats(self.device)["allocated_bytes"]["peak"]
        import torch

        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self):
        if installed():
            reset_peak_stats(self.device)
        else:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)


def installed_pool():
    pool = core().installed_device_pool()
    if pool is None:
        raise RuntimeError("memkernels' pool is not installed: call memkernels.allocator.install() first")
    return pool


def _device_index(device):
    if device is None:
        from memkernels.runtime import device as device_module

        return device_module.get_device()
    index = getattr(device, "index", device)  # a torch.device or an int
    if not isinstance(index, int) or index < 0:
        raise ValueError(f"device must be a non-negative int or a torch.device with an index, got {device!r}")
    return index


def stats(device=None):
    """Statistics of the installed pool on ``device`` (default: the current device); see docs/allocator.md."""
    result = installed_pool().stats(_device_index(device))
    result.update(core().device_pool_counters())  # bad_frees, failed_allocs of the C entry points
    return result


class MemorySummary:
    """Device memory right now. ``available`` is False (with ``message``) without CUDA.

    Bytes (ints): ``allocated`` (held by live tensors), ``reserved`` (held by the
    allocator), ``peak_allocated``, ``peak_reserved``. ``fragmentation`` =
    (reserved − allocated) / reserved: the share of reserved memory no tensor uses.
    ``source``: ``'torch'`` (PyTorch's caching allocator) or ``'memkernels'`` (the pool, whose whole
    :func:`stats` dict is ``pool_stats`` and whose table has the pool's detail: pools, segments,
    free blocks by size, retries, the cap).
    """

    def __init__(self, device, available, message="", source=None, allocated=0, reserved=0, peak_allocated=0,
                 peak_reserved=0, pool_stats=None):
        self.device, self.available, self.message, self.source = device, available, message, source
        self.allocated, self.reserved = allocated, reserved
        self.peak_allocated, self.peak_reserved = peak_allocated, peak_reserved
        self.pool_stats = pool_stats
        self.fragmentation = (reserved - allocated) / reserved if reserved > 0 else 0.0

    @property
    def fragmented(self):
        return self.fragmentation > FRAGMENTATION_WARNING

    def to_dict(self):
        return {"device": str(self.device), "available": self.available, "message": self.message,
                "source": self.source, "allocated": self.allocated, "reserved": self.reserved,
                "peak_allocated": self.peak_allocated, "peak_reserved": self.peak_reserved,
                "fragmentation": self.fragmentation}

    def table(self):
        if not self.available:
            return self.message
        if self.pool_stats is not None:
            return format_memory_summary(self.pool_stats, getattr(self.device, "index", self.device))
        rows = [("allocated", format_size(self.allocated)), ("reserved", format_size(self.reserved)),
                ("peak allocated", format_size(self.peak_allocated)),
                ("peak reserved", format_size(self.peak_reserved)),
                ("fragmentation", f"{self.fragmentation:.1%}"
                 + (f"  (above {FRAGMENTATION_WARNING:.0%}!)" if self.fragmented else ""))]
        return f"memory on {self.device} ({self.source} allocator)\n" + text_table(("", "bytes"), rows)

    __str__ = table

    def __repr__(self):
        return f"MemorySummary({self.to_dict()})"


def _summary_from_stats(device, stats, source, pool_stats=None):
    """A :class:`MemorySummary` of ``stats`` (``allocated_bytes``, ``reserved_bytes``, ``peak_allocated_bytes``,
    ``peak_reserved_bytes``); warns (RuntimeWarning) when fragmentation is above :data:`FRAGMENTATION_WARNING`."""
    import warnings

    summary = MemorySummary(device, True, source=source, allocated=stats["allocated_bytes"],
                            reserved=stats["reserved_bytes"], peak_allocated=stats["peak_allocated_bytes"],
                            peak_reserved=stats["peak_reserved_bytes"], pool_stats=pool_stats)
    if summary.fragmented:
        remedy = ("memkernels.allocator.empty_cache() returns whole free segments to the device, a lower "
                  "gc_threshold does it automatically, install(expandable_segments=True) maps pages instead"
                  if source == "memkernels" else
                  "try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or memkernels' pool allocator "
                  "(memkernels.allocator.install())")
        warnings.warn(
            f"memkernels.memory_summary: {summary.fragmentation:.0%} of the memory reserved on {device} is not "
            f"used by any tensor (fragmentation above {FRAGMENTATION_WARNING:.0%}). Large allocations may fail "
            f"with memory to spare: {remedy}.", RuntimeWarning, stacklevel=3)
    return summary


def memory_summary(device=None):
    """Allocated, reserved and peak bytes and fragmentation of a CUDA device: a :class:`MemorySummary`
    (``str()`` of it is a readable table; ``memkernels.memory_summary`` is this function).

    ``device``: None (the current CUDA device), an int, ``'cuda:N'`` or a ``torch.device``. Reads memkernels'
    pool when it is the installed allocator (on the simulated device too), else PyTorch's caching allocator.
    Warns (RuntimeWarning) when fragmentation is above 30%. Without CUDA it returns a summary with
    ``available=False`` and a plain message instead of raising.
    """
    import torch

    if device is not None and (isinstance(device, bool) or not isinstance(device, (int, str, torch.device))):
        raise ValueError(f"memory_summary(device={device!r}): pass None, an int, 'cuda:N' or a torch.device")
    if isinstance(device, (str, torch.device)):
        try:
            parsed = torch.device(device)
        except RuntimeError:
            raise ValueError(f"memory_summary(device={device!r}) is not a device name; use 'cuda' or 'cuda:N'") from None
        if parsed.type != "cuda":
            return MemorySummary(parsed, False, f"memory_summary: {parsed} is not a CUDA device; device memory "
                                 "is summarized for CUDA only (use activation_ledger or evaluate on the CPU).")
        device = parsed.index
    if _pool_installed():
        index = _device_index(device)
        pool = stats(index)
        return _summary_from_stats(
            torch.device("cuda", index),
            {"allocated_bytes": pool["allocated_bytes"]["current"],
             "reserved_bytes": pool["reserved_bytes"]["current"],
             "peak_allocated_bytes": pool["allocated_bytes"]["peak"],
             "peak_reserved_bytes": pool["reserved_bytes"]["peak"]},
            "memkernels", pool_stats=pool)
    if not torch.cuda.is_available():
        return MemorySummary(device, False, NO_CUDA_MESSAGE)
    index = torch.cuda.current_device() if device is None else device
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"memory_summary(device={device!r}): there are {torch.cuda.device_count()} CUDA devices")
    raw = torch.cuda.memory_stats(index)
    return _summary_from_stats(torch.device("cuda", index), {
        "allocated_bytes": raw.get("allocated_bytes.all.current", 0),
        "reserved_bytes": raw.get("reserved_bytes.all.current", 0),
        "peak_allocated_bytes": raw.get("allocated_bytes.all.peak", 0),
        "peak_reserved_bytes": raw.get("reserved_bytes.all.peak", 0)}, "torch")


def _pool_installed():
    """Whether memkernels' pool is PyTorch's allocator (False where the C++ core is not built)."""
    try:
        return core().installed_device_pool() is not None
    except ImportError:
        return False


def snapshot():
    """The installed pool's state in PyTorch's snapshot format (``torch.cuda._memory_viz`` renders it)."""
    return pool_snapshot(installed_pool())


def empty_cache():
    """Return every whole free segment of every device to the device (after pending frees complete)."""
    pool = installed_pool()
    for device in pool.devices():
        pool.empty_cache(device)


def end_step():
    """A step of the training loop ended: tell the installed pool (every device it serves).

    ``install()`` calls it on every optimizer step. While a step's requests so far repeat the last
    step's, in order, the pool serves it as a repeating loop: nothing is released before the pool
    grows, and a request takes any free block that fits rather than a new segment, so after its
    first two steps such a loop makes no ``cudaMalloc`` or ``cudaFree`` (docs/allocator.md,
    "Repeating loops"). From the first request that differs (another batch shape) to the step's
    end, the peak-lowering rules hold as without step ends.
    Call it yourself where a step ends without an optimizer step, or after ``install(mark_steps=False)``.
    """
    pool = installed_pool()
    for device in pool.devices():
        pool.end_step(device)


def reset_peak_stats(device=None):
    installed_pool().reset_peak_stats(_device_index(device))


def set_memory_cap(bytes=None, *, fraction=None, device=None):
    """Cap the pool's reserved memory on ``device`` at ``bytes`` and/or ``fraction`` of its memory.

    ``None`` for both removes the cap. Allocations past the cap go through the OOM path.
    """
    if bytes is not None and (not isinstance(bytes, int) or bytes <= 0):
        raise ValueError(f"bytes must be a positive int or None, got {bytes!r}")
    if fraction is not None and not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1] or None, got {fraction!r}")
    installed_pool().set_memory_cap(bytes or 0, fraction or 0.0, _device_index(device))


def reserve(bytes, *, device=None):
    """Allocate ``bytes`` now and keep them in the pool for the rest of the run (empty_cache keeps them)."""
    if not isinstance(bytes, int) or bytes <= 0:
        raise ValueError(f"bytes must be a positive int, got {bytes!r}")
    installed_pool().reserve(bytes, 0, _device_index(device))
