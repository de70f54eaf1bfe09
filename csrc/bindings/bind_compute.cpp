// Running a hand-built graph on the CPU or the CUDA backend from Python, so tests can check each op
// against numpy (and the GPU against the CPU) and check that planned graphs compute the same
// values as freshly planned ones.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/planner.h"
#include "cpu/cpu_backend.h"
#include "cuda/cuda_backend.h"

namespace py = pybind11;

namespace pyspec {
namespace {

void check_id(const Graph& g, int id) {
    if (id < 0 || id >= g.size()) throw std::invalid_argument("no tensor " + std::to_string(id) + " in the graph");
}

py::array fetch_tensor(Backend& backend, const Tensor& t) {
    if (!t.is_contiguous()) throw std::invalid_argument("fetch: tensor " + t.name + " is not contiguous");
    std::vector<py::ssize_t> shape;
    for (int d = kMaxDims - 1; d >= 0; --d) shape.push_back(static_cast<py::ssize_t>(t.ne[static_cast<size_t>(d)]));
    py::array out;
    if (t.dtype == DType::F32) {
        out = py::array_t<float>(shape);
    } else if (t.dtype == DType::I32) {
        out = py::array_t<int32_t>(shape);
    } else {
        out = py::array_t<uint8_t>(static_cast<py::ssize_t>(t.nbytes()));
    }
    backend.read(t, out.mutable_data(), t.nbytes(), 0);
    return out;
}

// The backend named `name`: "cpu" (n_threads workers, arena poisoned with NaN so reads of
// unwritten memory show) or "cuda" (device 0; a RuntimeError with the reason when CUDA was not
// built in or no GPU is visible).
std::unique_ptr<Backend> make_backend(const std::string& name, int n_threads) {
    if (name == "cpu") {
        auto cpu = std::make_unique<CpuBackend>(n_threads);
        cpu->set_poison(true);
        return cpu;
    }
    if (name == "cuda") {
        std::string reason;
        if (!cuda_available(&reason)) throw std::runtime_error("the CUDA backend cannot be used: " + reason);
        return make_cuda_backend(0);
    }
    throw std::invalid_argument("unknown backend '" + name + "' (expected \"cpu\" or \"cuda\")");
}

std::vector<py::array> run_graph(Graph& g, const std::map<int, py::array>& feeds, const std::vector<int>& fetch,
                                 int n_threads, const std::string& backend_name) {
    // First, so an unknown or unavailable backend fails before the graph is touched.
    std::unique_ptr<Backend> owned = make_backend(backend_name, n_threads);
    Backend& backend = *owned;
    std::vector<py::buffer_info> keep;  // external feeds stay borrowed during the call
    for (const auto& kv : feeds) {
        check_id(g, kv.first);
        Tensor& t = g[kv.first];
        py::buffer_info info = kv.second.request();
        const size_t bytes = static_cast<size_t>(info.size * info.itemsize);
        if (bytes != t.nbytes()) {
            throw std::invalid_argument("feed for tensor " + std::to_string(kv.first) + " has " + std::to_string(bytes) +
                                        " bytes, the tensor needs " + std::to_string(t.nbytes()));
        }
        if (!(kv.second.flags() & py::array::c_style)) throw std::invalid_argument("feeds must be C-contiguous");
        if (t.has(kExternal)) t.data = info.ptr;
        keep.push_back(std::move(info));
    }
    for (int i = 0; i < g.size(); ++i) {
        if (g[i].has(kExternal) && g[i].data == nullptr && g[i].nbytes() > 0) {
            throw std::invalid_argument("external tensor " + std::to_string(i) + " (" + g[i].name + ") has no data");
        }
    }
    const AllocationPlan plan = make_plan(g, 64);
    check_plan(g, plan);
    backend.apply_plan(g, plan);
    for (const auto& kv : feeds) {
        const Tensor& t = g[kv.first];
        if (t.has(kInput)) backend.write(t, kv.second.data(), t.nbytes(), 0);
    }
    {
        py::gil_scoped_release release;
        backend.compute(g);
    }
    std::vector<py::array> out;
    for (int id : fetch) {
        check_id(g, id);
        out.push_back(fetch_tensor(backend, g[id]));
    }
    return out;
}

}  // namespace

void bind_compute(py::module_& m) {
    m.def(
        "set_op_params",
        [](Graph& g, int id, const std::vector<int32_t>& iparams, const std::vector<float>& fparams) {
            check_id(g, id);
            if (iparams.size() > 4 || fparams.size() > 4) throw std::invalid_argument("at most 4 params of each kind");
            for (size_t i = 0; i < iparams.size(); ++i) g[id].iparams[i] = iparams[i];
            for (size_t i = 0; i < fparams.size(); ++i) g[id].fparams[i] = fparams[i];
        },
        py::arg("graph"), py::arg("id"), py::arg("iparams") = std::vector<int32_t>(),
        py::arg("fparams") = std::vector<float>(), "Sets an op's integer and float parameters.");
    m.def("run_graph", &run_graph, py::arg("graph"), py::arg("feeds"), py::arg("fetch"), py::arg("n_threads") = 1,
          py::arg("backend") = "cpu",
          "Plans (checked), runs the graph on a fresh backend and returns the fetched tensors (numpy shape = "
          "reversed ne). feeds: id -> array for inputs and external tensors. backend: \"cpu\" (n_threads "
          "workers, arena poisoned with NaN first) or \"cuda\" (device 0: external tensors are uploaded, so "
          "writes into them, e.g. SET_ROWS, show in fetched tensors but not in the host arrays; RuntimeError "
          "with the reason when CUDA is not available).");
    m.def(
        "cuda_available",
        []() {
            std::string reason;
            const bool ok = cuda_available(&reason);
            return py::make_tuple(ok, reason);
        },
        "(available, reason): whether the CUDA backend was built in and a GPU is visible; reason says why "
        "not (empty when available).");
    m.def("cuda_wgmma_gemm", []() { return cuda_available() && cuda_wgmma_gemm(); },
          "Whether the wide tensor-core MUL_MAT runs on wgmma here (sm_90a build, Hopper GPU, "
          "PYSPEC_CUDA_WGMMA not 0); the mma.sync GEMM otherwise, with the same bits.");
}

}  // namespace pyspec
