// memkernels._C: marshalling only. Each area binds itself in its own file.
#include <pybind11/pybind11.h>

#include "common/check.hpp"

namespace py = pybind11;

void bind_device(py::module_& m);       // bindings/device.cpp
void bind_pool(py::module_& m);         // bindings/pool.cpp
void bind_device_pool(py::module_& m);  // bindings/device_pool.cpp
void bind_offload(py::module_& m);      // bindings/offload.cpp

PYBIND11_MODULE(_C, m) {
  m.doc() = "memkernels C++ core (no torch, no CUDA linkage)";
  static py::exception<mk::cuda_error> cuda_exc(m, "CudaError", PyExc_RuntimeError);
  static py::exception<mk::out_of_memory> oom_exc(m, "OutOfMemoryError", PyExc_MemoryError);
  // user_error derives from std::invalid_argument -> ValueError; logic_error -> RuntimeError
  // (pybind11's built-in translations).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const mk::cuda_error& e) {
      py::set_error(cuda_exc, e.what());
    } catch (const mk::out_of_memory& e) {
      py::set_error(oom_exc, e.what());
    } catch (const mk::logic_error& e) {
      py::set_error(PyExc_RuntimeError, e.what());
    }
  });
  bind_device(m);
  bind_pool(m);
  bind_device_pool(m);
  bind_offload(m);
}
