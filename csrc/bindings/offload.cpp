// Bindings of the offload copy engine (memkernels._C.offload): marshalling
// only. Addresses and streams cross as Python ints; memkernels/offload.py is
// the documented Python surface.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>

#include "bindings/handles.hpp"
#include "cuda/offload_engine.hpp"

namespace py = pybind11;

namespace {

using mk::cuda::OffloadEngine;

using mk::bindings::as_ptr;
using mk::bindings::as_stream;

py::dict stats_dict(const mk::cuda::OffloadEngineStats& s) {
  py::dict pool;
  pool["pinned_bytes"] = s.pool.pinned_bytes;
  pool["peak_pinned_bytes"] = s.pool.peak_pinned_bytes;
  pool["bytes_in_use"] = s.pool.bytes_in_use;
  pool["slabs"] = s.pool.slabs;
  pool["slab_allocations"] = s.pool.slab_allocations;
  pool["slab_frees"] = s.pool.slab_frees;
  pool["hits"] = s.pool.hits;
  pool["misses"] = s.pool.misses;
  pool["refusals"] = s.pool.refusals;
  py::dict out;
  out["offloads"] = s.offloads;
  out["bytes_offloaded"] = s.bytes_offloaded;
  out["kept"] = s.kept;
  out["bytes_kept"] = s.bytes_kept;
  out["prefetches"] = s.prefetches;
  out["bytes_prefetched"] = s.bytes_prefetched;
  out["live_handles"] = s.live_handles;
  out["retiring_blocks"] = s.retiring_blocks;
  out["reused_behind_wait"] = s.reused_behind_wait;
  out["pool"] = pool;
  return out;
}

}  // namespace

void bind_offload(py::module_& m) {
  using py::arg;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  py::module_ o = m.def_submodule("offload", "The activation-offload copy engine; see memkernels.offload");
  o.def("class_size", &mk::cuda::PinnedPool::class_size, arg("nbytes"));
  py::class_<OffloadEngine>(o, "Engine")
      .def(py::init([](std::optional<std::size_t> max_pinned_bytes, std::optional<int> d2h_priority,
                       std::optional<int> h2d_priority) {
             OffloadEngine::Options options;
             options.max_pinned_bytes = max_pinned_bytes.value_or(SIZE_MAX);
             options.has_d2h_priority = d2h_priority.has_value();
             options.d2h_priority = d2h_priority.value_or(0);
             options.has_h2d_priority = h2d_priority.has_value();
             options.h2d_priority = h2d_priority.value_or(0);
             return new OffloadEngine(options);
           }),
           arg("max_pinned_bytes") = py::none(), arg("d2h_priority") = py::none(), arg("h2d_priority") = py::none())
      .def("offload", [](OffloadEngine& e, std::uintptr_t src, std::size_t nbytes, std::uintptr_t stream) {
        return e.offload(as_ptr<void>(src), nbytes, as_stream(stream));
      }, arg("src"), arg("nbytes"), arg("stream"))
      .def("offload_done", &OffloadEngine::offload_done, arg("handle"))
      .def("prefetch", [](OffloadEngine& e, std::uint64_t handle, std::uintptr_t dst, std::uintptr_t stream) {
        e.prefetch(handle, as_ptr<void>(dst), as_stream(stream));
      }, arg("handle"), arg("dst"), arg("stream"))
      .def("prefetch_done", &OffloadEngine::prefetch_done, arg("handle"))
      .def("wait", [](OffloadEngine& e, std::uint64_t handle, std::uintptr_t stream) {
        e.wait(handle, as_stream(stream));
      }, arg("handle"), arg("stream"))
      .def("synchronize", &OffloadEngine::synchronize, arg("handle"), nogil)
      .def("release", &OffloadEngine::release, arg("handle"))
      .def("nbytes", &OffloadEngine::nbytes, arg("handle"))
      .def("synchronize_all", &OffloadEngine::synchronize_all, nogil)
      .def("idle", &OffloadEngine::idle)
      .def("trim", &OffloadEngine::trim, nogil)
      .def("close", &OffloadEngine::close, nogil)
      .def_property_readonly("closed", &OffloadEngine::closed)
      .def_property_readonly("priorities", &OffloadEngine::priorities)
      .def("stats", [](OffloadEngine& e) { return stats_dict(e.stats()); });
}
