"""The device memkernels' C++ core talks to: real CUDA or the simulated device.

Every CUDA call the package makes goes through one C++ table of function
pointers (``csrc/cuda/api.hpp``). It is filled at first use either from the
real ``libcudart``/``libcuda`` (those torch already loaded, else the
system's), or by the in-process simulator (``csrc/sim/``), which needs no
GPU. The choice is made once per process:

* ``MEMKERNELS_DEVICE=sim`` (or ``cuda``, the default) read at first use, or
* :func:`use_sim` / :func:`use_cuda` before first use.

After first use, switching raises ``ValueError``. A failed real load does not
count as use: :func:`use_sim` still works after it.

The functions below are thin wrappers of the table for tests and tools:
pointers, streams, events and VMM handles are plain ``int``\\ s. Failures raise
:class:`memkernels._C.CudaError` with ``.code`` (the CUDA error number) and
``.call`` (the failing CUDA function). :data:`sim` steers the simulator:
capacity, granularity, backed vs. virtual memory, fault injection, counters.
In the simulator's backed mode device memory is host memory, so a test may
also read or write it directly (e.g. with ctypes); in virtual mode it must not.
"""
import math

from memkernels import _C

_table = _C.device
CudaError = _C.CudaError

# cudaMemcpyKind values, by name.
MEMCPY_KINDS = {
    "host_to_host": 0,
    "host_to_device": 1,
    "device_to_host": 2,
    "device_to_device": 3,
    "default": 4,
}
# CUDA error numbers the tests and the pool look for.
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1  # cudaErrorInvalidValue == CUDA_ERROR_INVALID_VALUE
CUDA_ERROR_OUT_OF_MEMORY = 2  # cudaErrorMemoryAllocation == CUDA_ERROR_OUT_OF_MEMORY
CUDA_ERROR_ALREADY_MAPPED = 208
CUDA_ERROR_NOT_MAPPED = 211
CUDA_ERROR_INVALID_HANDLE = 400  # cudaErrorInvalidResourceHandle == CUDA_ERROR_INVALID_HANDLE
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_LAUNCH_TIMEOUT = 702  # the sim's answer to a blocking call that waited too long


def _nonnegative(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def _nonnegative_number(name, value):
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite non-negative number, got {value!r}")
    return value


# ------------------------------------------------------------------ selection


def use_sim(**config):
    """Select the simulated device (before first use) and, if given, configure it.

    Keyword arguments are those of :meth:`SimDevice.configure`. Raises
    ``ValueError`` if real CUDA is already in use in this process.
    """
    _table.select("sim")
    if config:
        sim.configure(**config)


def use_cuda():
    """Select real CUDA (before first use). Raises ``ValueError`` if the simulator is in use."""
    _table.select("cuda")


def backend():
    """``"sim"`` or ``"cuda"``: the selection (from MEMKERNELS_DEVICE if none was made), without loading."""
    return _table.selected()


def is_locked():
    """True once a device call has fixed the backend for this process."""
    return _table.locked()


def load():
    """Load the selected backend now (fixing the choice); returns its name.

    Raises CudaError ("no CUDA driver/library: ...") when real CUDA is
    selected but missing.
    """
    return _table.load()


def load_cuda():
    """Load the real CUDA table, whatever is selected, and describe it.

    Returns ``{"cudart": path, "libcuda": path, "driver_version": int,
    "device_count": int}``. Raises CudaError whose message names every
    library looked for and the fix, e.g. ``no CUDA driver/library: tried
    libcuda.so.1 (...); ...; install the NVIDIA driver or set
    MEMKERNELS_DEVICE=sim``. Does not fix the selection.
    """
    return _table.load_cuda()


# ------------------------------------------------------------------ the table

def error_name(code):
    """CUDA's name for a runtime error number (e.g. 2 -> 'cudaErrorMemoryAllocation')."""
    return _table.error_name(code)


def device_count():
    return _table.device_count()


def get_device():
    return _table.get_device()


def set_device(device):
    """Make ``device`` current for the calling thread (cudaSetDevice)."""
    _table.set_device(_nonnegative("device", device))


def synchronize():
    """Wait for all work on the current device (cudaDeviceSynchronize)."""
    _table.synchronize()


def mem_get_info():
    """``(free_bytes, total_bytes)`` of the current device (cudaMemGetInfo)."""
    return _table.mem_get_info()


def malloc(nbytes):
    """cudaMalloc: returns the device address as an int (0 for 0 bytes)."""
    return _table.malloc(_nonnegative("nbytes", nbytes))


def free(ptr):
    """cudaFree (synchronizes the device first, as CUDA does)."""
    _table.free(_nonnegative("ptr", ptr))


def host_alloc(nbytes, flags=0):
    """cudaHostAlloc: pinned host memory; returns its address as an int."""
    return _table.host_alloc(_nonnegative("nbytes", nbytes), _nonnegative("flags", flags))


def free_host(ptr):
    _table.free_host(_nonnegative("ptr", ptr))


def memcpy_async(dst, src, nbytes, kind="default", stream=0):
    """cudaMemcpyAsync of ``nbytes`` from address ``src`` to ``dst`` on ``stream``.

    ``kind`` is one of :data:`MEMCPY_KINDS` (``"default"`` infers the
    direction from the addresses). Host addresses may be any buffer's
    address, e.g. ``numpy_array.ctypes.data``; keep the buffer alive until
    the stream has run the copy.
    """
    if kind not in MEMCPY_KINDS:
        raise ValueError(f"kind must be one of {sorted(MEMCPY_KINDS)}, got {kind!r}")
    _table.memcpy_async(_nonnegative("dst", dst), _nonnegative("src", src), _nonnegative("nbytes", nbytes),
                        MEMCPY_KINDS[kind], _nonnegative("stream", stream))


def stream_create(priority=0):
    """cudaStreamCreateWithPriority; lower numbers are higher priority (see :func:`stream_priority_range`)."""
    if not isinstance(priority, int):
        raise ValueError(f"priority must be an int, got {priority!r}")
    return _table.stream_create(priority)


def stream_destroy(stream):
    _table.stream_destroy(_nonnegative("stream", stream))


def stream_synchronize(stream=0):
    _table.stream_synchronize(_nonnegative("stream", stream))


def stream_query(stream=0):
    """True when all work queued on ``stream`` has completed."""
    return _table.stream_query(_nonnegative("stream", stream))


def stream_priority_range():
    """``(least, greatest)`` stream priority (cudaDeviceGetStreamPriorityRange)."""
    return _table.stream_priority_range()


def event_create(flags=0):
    return _table.event_create(_nonnegative("flags", flags))


def event_destroy(event):
    _table.event_destroy(_nonnegative("event", event))


def event_record(event, stream=0):
    _table.event_record(_nonnegative("event", event), _nonnegative("stream", stream))


def event_query(event):
    """True when the event's most recent record has completed (or it was never recorded)."""
    return _table.event_query(_nonnegative("event", event))


def event_synchronize(event):
    _table.event_synchronize(_nonnegative("event", event))


def stream_wait_event(stream, event):
    """Make later work on ``stream`` wait for the event's most recent record."""
    _table.stream_wait_event(_nonnegative("stream", stream), _nonnegative("event", event))


# VMM (driver API); sizes and offsets are multiples of mem_granularity().

def mem_granularity(device=0):
    return _table.mem_granularity(_nonnegative("device", device))


def mem_address_reserve(size, alignment=0, hint=0):
    """cuMemAddressReserve: a virtual address range (nothing mapped yet)."""
    return _table.mem_address_reserve(_nonnegative("size", size), _nonnegative("alignment", alignment),
                                      _nonnegative("hint", hint))


def mem_address_free(ptr, size):
    _table.mem_address_free(_nonnegative("ptr", ptr), _nonnegative("size", size))


def mem_create(size, device=0):
    """cuMemCreate: physical memory on ``device``; returns the handle."""
    return _table.mem_create(_nonnegative("size", size), _nonnegative("device", device))


def mem_release(handle):
    _table.mem_release(_nonnegative("handle", handle))


def mem_map(ptr, size, handle, offset=0):
    _table.mem_map(_nonnegative("ptr", ptr), _nonnegative("size", size), _nonnegative("handle", handle),
                   _nonnegative("offset", offset))


def mem_unmap(ptr, size):
    _table.mem_unmap(_nonnegative("ptr", ptr), _nonnegative("size", size))


def mem_set_access(ptr, size, device=0, access="rw"):
    """cuMemSetAccess for ``device``; ``access`` is ``"rw"``, ``"r"`` or ``"none"``."""
    _table.mem_set_access(_nonnegative("ptr", ptr), _nonnegative("size", size), _nonnegative("device", device),
                          access)


# ------------------------------------------------------------------ simulator

_UNSET = object()


class SimDevice:
    """Controls of the simulated device (``memkernels.device.sim``).

    Configuration (see :meth:`configure`) survives :meth:`reset`; fault
    injection, counters, statistics and modelled time do not. Usable whichever
    backend is selected, but only affects code when the simulator is the
    selected backend.
    """

    def config(self):
        """The current configuration as a dict (the keywords of :meth:`configure`)."""
        return _C.sim.config()

    def configure(self, *, device_count=_UNSET, capacity=_UNSET, host_capacity=_UNSET, granularity=_UNSET,
                  memory=_UNSET, address_space=_UNSET, sync_timeout_s=_UNSET):
        """Change the named settings and :meth:`reset` the device (all handles become invalid).

        device_count:   number of simulated GPUs (1..64).
        capacity:       bytes per device; allocations beyond it fail with the
                        CUDA out-of-memory code.
        host_capacity:  pinned host bytes, or None for unlimited.
        granularity:    VMM granularity (a power of two >= the page size).
        memory:         "backed" (host memory, copies copy) or "virtual"
                        (addresses only; nothing touched).
        address_space:  bytes of address range reserved for virtual memory
                        and VMM reservations.
        sync_timeout_s: blocking calls fail with cudaErrorLaunchTimeout (702)
                        after this long instead of hanging.
        """
        settings = self.config()
        given = dict(device_count=device_count, capacity=capacity, host_capacity=host_capacity,
                     granularity=granularity, memory=memory, address_space=address_space,
                     sync_timeout_s=sync_timeout_s)
        for name, value in given.items():
            if value is not _UNSET:
                settings[name] = value
        for name in ("device_count", "capacity", "granularity", "address_space"):
            _nonnegative(name, settings[name])
        if settings["host_capacity"] is not None:
            _nonnegative("host_capacity", settings["host_capacity"])
        if settings["memory"] not in ("backed", "virtual"):
            raise ValueError(f"memory must be 'backed' or 'virtual', got {settings['memory']!r}")
        _C.sim.configure(**settings)

    def reset(self):
        """Drop all state (memory, streams, events, counters, faults, modelled time); keep the configuration."""
        _C.sim.reset()

    def set_capacity(self, nbytes):
        """Change the per-device capacity now, without a reset (may go below current use)."""
        _C.sim.set_capacity(_nonnegative("nbytes", nbytes))

    def fail_allocations(self, nth, count=1):
        """Make device allocation requests nth..nth+count-1 from now (1 = the next) fail with OOM."""
        if not isinstance(nth, int) or nth < 1:
            raise ValueError(f"nth must be an int >= 1 (1 is the next allocation), got {nth!r}")
        _C.sim.fail_allocations(nth, _nonnegative("count", count))

    def hold_events(self, on=True):
        """While on, each event record stalls its stream until :meth:`release_events`."""
        _C.sim.hold_events(bool(on))

    def release_events(self):
        """Let every held record complete; returns how many were held."""
        return _C.sim.release_events()

    def set_random_delays(self, max_delay_us, seed):
        """Sleep a random 0..max_delay_us (seeded) before each stream operation; 0 turns it off."""
        _C.sim.set_random_delays(_nonnegative("max_delay_us", max_delay_us), _nonnegative("seed", seed))

    # Modelled time: a virtual timeline computed when work is enqueued, so
    # tests can assert step times without measuring the machine (sim.hpp).

    def set_link_bandwidth(self, bytes_per_second):
        """Model the host-device link: each copy then takes nbytes / bytes_per_second modelled seconds.

        Device-to-device copies take none; host memory the sim did not
        allocate (e.g. a numpy array) counts as host memory. 0, the default
        (restored by :meth:`reset`), makes every copy take none.
        """
        _C.sim.set_link_bandwidth(float(_nonnegative_number("bytes_per_second", bytes_per_second)))

    def run_kernel(self, seconds, stream=0):
        """Stand in for a kernel of ``seconds`` on ``stream`` (0: the default stream): nothing runs.

        Only the modelled clocks move: it starts at the later of the stream's
        clock and :meth:`host_clock`, and the stream's clock becomes that
        start plus ``seconds``.
        """
        _C.sim.run_kernel(float(_nonnegative_number("seconds", seconds)), _nonnegative("stream", stream))

    def clock(self, stream=0):
        """Modelled seconds at which all work enqueued on ``stream`` so far completes.

        Work on a stream starts no earlier than the host issues it
        (:meth:`host_clock`); an event wait moves the stream's clock up to the
        event's record.
        """
        return _C.sim.clock(_nonnegative("stream", stream))

    def host_clock(self):
        """The host's modelled seconds: moved up only by blocking calls, to what they waited for.

        Stream, event and device synchronize, and the frees that synchronize
        the device; queries move no clock. :meth:`reset` sets every clock to 0.
        """
        return _C.sim.host_clock()

    def stats(self):
        """Memory figures: per-device bytes_in_use/peak_bytes/allocations, host bytes, VMM bytes, faults.

        Also ``modelled_link_seconds``: the modelled time of every copy enqueued since the last reset.
        """
        return _C.sim.stats()

    def reset_peak(self):
        _C.sim.reset_peak()

    def counters(self):
        """Calls made to the simulated table since the last reset, by CUDA function name."""
        return _C.sim.counters()

    def is_device_memory(self, ptr, nbytes):
        """True when [ptr, ptr+nbytes) is live device memory with read-write access."""
        return _C.sim.is_device_memory(_nonnegative("ptr", ptr), _nonnegative("nbytes", nbytes))


sim = SimDevice()
