#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace pyspec {
void bind_kernels(py::module_& m) { (void)m; }
}  // namespace pyspec
