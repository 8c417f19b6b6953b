// Bindings of the CUDA table (memkernels._C.device) and of the simulator's
// controls (memkernels._C.sim). Marshalling only: pointers, streams, events
// and VMM handles cross as Python ints; every call goes through
// mk::cuda::api(). memkernels/device.py is the documented Python surface.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>

#include "bindings/handles.hpp"
#include "cuda/api.hpp"
#include "sim/sim.hpp"

namespace py = pybind11;

namespace {

using mk::bindings::as_event;
using mk::bindings::as_int;
using mk::bindings::as_ptr;
using mk::bindings::as_stream;
using mk::cuda::api;
using mk::cuda::pinned_on;

void check(cudaError_t err, const char* call) { MK_CUDA_CHECK(err, call); }
void check(CUresult err, const char* call) { MK_CUDA_CHECK(err, call); }

// A query's "not yet" is an answer, not an error.
bool completed(cudaError_t err, const char* call) {
  if (err == cudaErrorNotReady) return false;
  check(err, call);
  return true;
}

CUmemAccess_flags access_flags(const std::string& access) {
  if (access == "rw") return CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (access == "r") return CU_MEM_ACCESS_FLAGS_PROT_READ;
  if (access == "none") return CU_MEM_ACCESS_FLAGS_PROT_NONE;
  throw mk::user_error("access must be 'rw', 'r' or 'none', got '" + access + "'");
}

mk::cuda::Backend backend_named(const std::string& name) {
  if (name == "sim") return mk::cuda::Backend::sim;
  if (name == "cuda") return mk::cuda::Backend::cuda;
  throw mk::user_error("device backend must be 'sim' or 'cuda', got '" + name + "'");
}

py::dict config_dict(const mk::sim::Config& c) {
  py::dict d;
  d["device_count"] = c.device_count;
  d["capacity"] = c.capacity;
  d["host_capacity"] = c.host_capacity == SIZE_MAX ? py::object(py::none()) : py::object(py::int_(c.host_capacity));
  d["granularity"] = c.granularity;
  d["memory"] = c.memory == mk::sim::Memory::backed ? "backed" : "virtual";
  d["address_space"] = c.address_space;
  d["sync_timeout_s"] = c.sync_timeout_s;
  return d;
}

py::dict stats_dict(const mk::sim::Stats& s) {
  py::list devices;
  for (const auto& d : s.devices) {
    py::dict entry;
    entry["bytes_in_use"] = d.bytes_in_use;
    entry["peak_bytes"] = d.peak_bytes;
    entry["allocations"] = d.allocations;
    devices.append(entry);
  }
  py::dict out;
  out["devices"] = devices;
  out["host_bytes_in_use"] = s.host_bytes_in_use;
  out["host_peak_bytes"] = s.host_peak_bytes;
  out["reserved_bytes"] = s.reserved_bytes;
  out["mapped_bytes"] = s.mapped_bytes;
  out["bytes_copied"] = s.bytes_copied;
  out["modelled_link_seconds"] = s.modelled_link_seconds;
  out["injected_failures"] = s.injected_failures;
  out["async_errors"] = s.async_errors;
  out["held_events"] = s.held_events;
  out["live_streams"] = s.live_streams;
  out["live_events"] = s.live_events;
  return out;
}

void bind_table(py::module_& d) {
  using py::arg;
  const auto nogil = py::call_guard<py::gil_scoped_release>();

  d.def("select", [](const std::string& name) { mk::cuda::select_backend(backend_named(name)); }, arg("name"));
  d.def("selected", [] { return std::string(mk::cuda::backend_name(mk::cuda::selected_backend())); });
  d.def("locked", &mk::cuda::backend_locked);
  d.def("load", [] { return std::string(api().backend); });
  d.def("load_cuda", [] {
    const mk::cuda::RealInfo info = mk::cuda::real_info();
    py::dict out;
    out["cudart"] = info.cudart_path;
    out["libcuda"] = info.libcuda_path;
    out["driver_version"] = info.runtime_driver_version;
    out["device_count"] = info.device_count;
    return out;
  });
  d.def("error_name", [](int code) { return std::string(api().cudaGetErrorName(static_cast<cudaError_t>(code))); },
        arg("code"));

  d.def("device_count", [] {
    int n = 0;
    check(api().cudaGetDeviceCount(&n), "cudaGetDeviceCount");
    return n;
  });
  d.def("get_device", [] {
    int device = 0;
    check(api().cudaGetDevice(&device), "cudaGetDevice");
    return device;
  });
  d.def("set_device", [](int device) { check(api().cudaSetDevice(device), "cudaSetDevice"); }, arg("device"));
  d.def("synchronize", [] { check(api().cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }, nogil);
  d.def("mem_get_info", [] {
    std::size_t free = 0, total = 0;
    check(api().cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    return py::make_tuple(free, total);
  });

  d.def("malloc", [](std::size_t nbytes) {
    void* p = nullptr;
    check(api().cudaMalloc(&p, nbytes), "cudaMalloc");
    return as_int(p);
  }, arg("nbytes"));
  d.def("free", [](std::uintptr_t ptr) { check(api().cudaFree(as_ptr<void>(ptr)), "cudaFree"); }, arg("ptr"), nogil);
  d.def("host_alloc", [](std::size_t nbytes, unsigned flags) {
    void* p = nullptr;
    check(api().cudaHostAlloc(&p, nbytes, flags), "cudaHostAlloc");
    return as_int(p);
  }, arg("nbytes"), arg("flags") = 0);
  d.def("free_host", [](std::uintptr_t ptr) { check(api().cudaFreeHost(as_ptr<void>(ptr)), "cudaFreeHost"); },
        arg("ptr"), nogil);
  d.def("memcpy_async", [](std::uintptr_t dst, std::uintptr_t src, std::size_t nbytes, int kind, std::uintptr_t stream) {
    check(api().cudaMemcpyAsync(as_ptr<void>(dst), as_ptr<const void>(src), nbytes, static_cast<cudaMemcpyKind>(kind),
                                as_stream(stream)),
          "cudaMemcpyAsync");
  }, arg("dst"), arg("src"), arg("nbytes"), arg("kind"), arg("stream") = 0);

  d.def("stream_create", [](int priority, unsigned flags) {
    cudaStream_t stream = nullptr;
    check(api().cudaStreamCreateWithPriority(&stream, flags, priority), "cudaStreamCreateWithPriority");
    return as_int(stream);
  }, arg("priority") = 0, arg("flags") = 0);
  d.def("stream_destroy", [](std::uintptr_t stream) {
    check(api().cudaStreamDestroy(as_stream(stream)), "cudaStreamDestroy");
  }, arg("stream"));
  d.def("stream_synchronize", [](std::uintptr_t stream) {
    check(api().cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
  }, arg("stream"), nogil);
  d.def("stream_query", [](std::uintptr_t stream) {
    return completed(api().cudaStreamQuery(as_stream(stream)), "cudaStreamQuery");
  }, arg("stream"));
  d.def("stream_priority_range", [] {
    int least = 0, greatest = 0;
    check(api().cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    return py::make_tuple(least, greatest);
  });

  d.def("event_create", [](unsigned flags) {
    cudaEvent_t event = nullptr;
    check(api().cudaEventCreateWithFlags(&event, flags), "cudaEventCreateWithFlags");
    return as_int(event);
  }, arg("flags") = 0);
  d.def("event_destroy", [](std::uintptr_t event) {
    check(api().cudaEventDestroy(as_event(event)), "cudaEventDestroy");
  }, arg("event"));
  d.def("event_record", [](std::uintptr_t event, std::uintptr_t stream) {
    check(api().cudaEventRecord(as_event(event), as_stream(stream)), "cudaEventRecord");
  }, arg("event"), arg("stream") = 0);
  d.def("event_query", [](std::uintptr_t event) {
    return completed(api().cudaEventQuery(as_event(event)), "cudaEventQuery");
  }, arg("event"));
  d.def("event_synchronize", [](std::uintptr_t event) {
    check(api().cudaEventSynchronize(as_event(event)), "cudaEventSynchronize");
  }, arg("event"), nogil);
  d.def("stream_wait_event", [](std::uintptr_t stream, std::uintptr_t event) {
    check(api().cudaStreamWaitEvent(as_stream(stream), as_event(event), 0), "cudaStreamWaitEvent");
  }, arg("stream"), arg("event"));

  d.def("mem_granularity", [](int device) {
    const CUmemAllocationProp prop = pinned_on(device);
    std::size_t granularity = 0;
    check(api().cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
          "cuMemGetAllocationGranularity");
    return granularity;
  }, arg("device") = 0);
  d.def("mem_address_reserve", [](std::size_t size, std::size_t alignment, std::uintptr_t hint) {
    CUdeviceptr ptr = 0;
    check(api().cuMemAddressReserve(&ptr, size, alignment, static_cast<CUdeviceptr>(hint), 0), "cuMemAddressReserve");
    return static_cast<std::uintptr_t>(ptr);
  }, arg("size"), arg("alignment") = 0, arg("hint") = 0);
  d.def("mem_address_free", [](std::uintptr_t ptr, std::size_t size) {
    check(api().cuMemAddressFree(static_cast<CUdeviceptr>(ptr), size), "cuMemAddressFree");
  }, arg("ptr"), arg("size"));
  d.def("mem_create", [](std::size_t size, int device) {
    const CUmemAllocationProp prop = pinned_on(device);
    CUmemGenericAllocationHandle handle = 0;
    check(api().cuMemCreate(&handle, size, &prop, 0), "cuMemCreate");
    return static_cast<std::uint64_t>(handle);
  }, arg("size"), arg("device") = 0);
  d.def("mem_release", [](std::uint64_t handle) { check(api().cuMemRelease(handle), "cuMemRelease"); },
        arg("handle"));
  d.def("mem_map", [](std::uintptr_t ptr, std::size_t size, std::uint64_t handle, std::size_t offset) {
    check(api().cuMemMap(static_cast<CUdeviceptr>(ptr), size, offset, handle, 0), "cuMemMap");
  }, arg("ptr"), arg("size"), arg("handle"), arg("offset") = 0);
  d.def("mem_unmap", [](std::uintptr_t ptr, std::size_t size) {
    check(api().cuMemUnmap(static_cast<CUdeviceptr>(ptr), size), "cuMemUnmap");
  }, arg("ptr"), arg("size"));
  d.def("mem_set_access", [](std::uintptr_t ptr, std::size_t size, int device, const std::string& access) {
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = device;
    desc.flags = access_flags(access);
    check(api().cuMemSetAccess(static_cast<CUdeviceptr>(ptr), size, &desc, 1), "cuMemSetAccess");
  }, arg("ptr"), arg("size"), arg("device") = 0, arg("access") = "rw");
}

void bind_sim(py::module_& s) {
  using py::arg;
  s.def("config", [] { return config_dict(mk::sim::config()); });
  s.def("configure", [](int device_count, std::size_t capacity, py::object host_capacity, std::size_t granularity,
                        const std::string& memory, std::size_t address_space, double sync_timeout_s) {
    MK_EXPECTS(memory == "backed" || memory == "virtual", "memory must be 'backed' or 'virtual', got '" + memory + "'");
    mk::sim::Config c;
    c.device_count = device_count;
    c.capacity = capacity;
    c.host_capacity = host_capacity.is_none() ? SIZE_MAX : host_capacity.cast<std::size_t>();
    c.granularity = granularity;
    c.memory = memory == "backed" ? mk::sim::Memory::backed : mk::sim::Memory::virtual_only;
    c.address_space = address_space;
    c.sync_timeout_s = sync_timeout_s;
    py::gil_scoped_release release;  // joins stream workers
    mk::sim::configure(c);
  }, arg("device_count"), arg("capacity"), arg("host_capacity"), arg("granularity"), arg("memory"),
     arg("address_space"), arg("sync_timeout_s"));
  s.def("reset", &mk::sim::reset, py::call_guard<py::gil_scoped_release>());
  s.def("set_capacity", &mk::sim::set_capacity, arg("nbytes"));
  s.def("fail_allocations", &mk::sim::fail_allocations, arg("nth"), arg("count") = 1);
  s.def("hold_events", &mk::sim::hold_events, arg("on"));
  s.def("release_events", &mk::sim::release_events);
  s.def("set_random_delays", &mk::sim::set_random_delays, arg("max_delay_us"), arg("seed"));
  s.def("set_link_bandwidth", &mk::sim::set_link_bandwidth, arg("bytes_per_second"));
  s.def("run_kernel", &mk::sim::run_kernel, arg("seconds"), arg("stream") = 0);
  s.def("clock", &mk::sim::clock, arg("stream") = 0);
  s.def("host_clock", &mk::sim::host_clock);
  s.def("stats", [] { return stats_dict(mk::sim::stats()); });
  s.def("reset_peak", &mk::sim::reset_peak);
  s.def("counters", &mk::sim::counters);
  s.def("is_device_memory", &mk::sim::is_device_memory, arg("ptr"), arg("nbytes"));
}

}  // namespace

void bind_device(py::module_& m) {
  // CudaError gains .code (the CUDA error number) and .call for failed calls.
  // A plain function pointer cannot capture: keep the type in a static, alive
  // for the life of the process (translators outlive the interpreter's teardown).
  static PyObject* cuda_error_type = py::object(m.attr("CudaError")).release().ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const mk::cuda::call_error& e) {
      py::object exc = py::reinterpret_borrow<py::object>(cuda_error_type)(e.what());
      exc.attr("code") = e.code;
      exc.attr("call") = e.call;
      PyErr_SetObject(cuda_error_type, exc.ptr());
    }
  });
  py::module_ device = m.def_submodule("device", "The CUDA function table (real or simulated); see memkernels.device");
  bind_table(device);
  py::module_ sim = m.def_submodule("sim", "Controls of the simulated device; see memkernels.device.sim");
  bind_sim(sim);
}
