// Bindings of the device-backed pool (csrc/cuda/device_pool.*): the process-wide
// pool behind the CUDAPluggableAllocator entry points, and standalone pools over
// the device table (real or simulated), e.g. for replay on the simulated device.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/allocator.hpp"
#include "cuda/device_pool.hpp"
#include "cuda/torch_error.hpp"

namespace py = pybind11;

void bind_device_pool(py::module_& m) {
  m.def("install_device_pool", &mk::cuda::install_pool, py::arg("config"),
        "Make a pool over the device table the one mk_pool_alloc/mk_pool_free use; returns it.");
  m.def("installed_device_pool", &mk::cuda::installed_pool, "The installed pool, or None.");
  m.def(
      "make_device_pool",
      [](const mk::core::PoolConfig& config) {
        return std::make_shared<mk::core::Allocator>(config, std::make_shared<mk::cuda::DeviceUpstream>(),
                                                     std::make_shared<mk::cuda::DeviceEvents>());
      },
      py::arg("config"), "A standalone pool over the device table (cudaMalloc segments, cudaEvent ordering).");
  m.def("device_pool_counters", [] {
    py::dict d;
    d["bad_frees"] = mk::cuda::bad_free_count();
    d["failed_allocs"] = mk::cuda::failed_alloc_count();
    return d;
  });
  m.def("use_torch_out_of_memory_error", &mk::cuda::use_torch_out_of_memory_error, py::arg("libc10_path"),
        "Make mk_pool_alloc throw c10::OutOfMemoryError, resolved from the already loaded libc10 at this path; "
        "returns '' on success, else why not (mk_pool_alloc then throws a plain C++ runtime error).");
  m.def("forget_torch_out_of_memory_error", &mk::cuda::forget_torch_out_of_memory_error);
  m.def("torch_out_of_memory_error_resolved", &mk::cuda::torch_out_of_memory_error_resolved);
  m.attr("TORCH_ERROR_BYTES") = mk::cuda::kTorchErrorBytes;
  m.attr("DEVICE_POOL_ALLOC_SYMBOL") = "mk_pool_alloc";
  m.attr("DEVICE_POOL_FREE_SYMBOL") = "mk_pool_free";
}
