// memkernels._C: marshalling only. Each area binds itself in its own file, and this file compiles them
// as one translation unit (setup.py compiles no other file of bindings/): pybind11's headers cost
// about 15 s of compile a unit (g++ 12 -O3, 2 GHz Xeon: a 38-line binding file took 17 s), which five
// units paid five times in every build (install, wheel, the two sanitizer builds).
#include <pybind11/pybind11.h>

#include "common/check.hpp"

#include "bindings/device.cpp"
#include "bindings/device_pool.cpp"
#include "bindings/offload.cpp"
#include "bindings/plan.cpp"
#include "bindings/pool.cpp"  // last: it says `using namespace mk::core;`

namespace py = pybind11;

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
  bind_plan(m);
}
