// pyspec._core: the compiled core. Each part registers its own bindings.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace pyspec {
void bind_gguf(py::module_& m);
void bind_graph(py::module_& m);
void bind_kernels(py::module_& m);
void bind_runtime(py::module_& m);
void bind_compute(py::module_& m);
void bind_draft(py::module_& m);
void bind_spec(py::module_& m);
void bind_registry(py::module_& m);
void bind_spec_engine(py::module_& m);
void bind_cuda(py::module_& m);
}  // namespace pyspec

PYBIND11_MODULE(_core, m) {
    m.doc() = "pyspec compiled core: GGUF reader, graph planner, CPU backend, models, runtime";
    pyspec::bind_gguf(m);
    pyspec::bind_graph(m);
    pyspec::bind_kernels(m);
    pyspec::bind_runtime(m);
    pyspec::bind_compute(m);
    pyspec::bind_draft(m);
    pyspec::bind_spec(m);
    pyspec::bind_registry(m);
    pyspec::bind_spec_engine(m);
    pyspec::bind_cuda(m);
}
