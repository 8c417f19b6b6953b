// Bindings of the planner's placement DP (memkernels._C.plan): marshalling only.
// memkernels/planning/placement.py prepares the figures and reads the choices.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "plan/placement_dp.hpp"

namespace py = pybind11;

void bind_plan(py::module_& m) {
  auto plan = m.def_submodule("plan", "The planner's placement DP (memkernels/planning/placement.py).");
  plan.def("cheapest_placement", &mk::plan::cheapest_placement, py::arg("needs"), py::arg("steps"),
           py::arg("seconds"), py::arg("end"), py::call_guard<py::gil_scoped_release>(),
           "Each layer's option on a cheapest path (None when none): needs is layers x options (row-major) bytes "
           "saved before the layer; steps the bytes each option saves, seconds its cost; at least end saved in all.");
}
