// Bindings for the op graph and the allocation planner: enough to build graphs by hand from
// Python (tests of the planner, experiments) and to plan and check them. Tensors are named by
// their integer id; dtypes and ops by the strings dtype_name() and op_name() return.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/graph.h"
#include "core/planner.h"

namespace py = pybind11;

namespace pyspec {
namespace {

DType parse_dtype(const std::string& s) {
    for (int i = 0; i < static_cast<int>(DType::COUNT); ++i) {
        if (s == dtype_name(static_cast<DType>(i))) return static_cast<DType>(i);
    }
    throw std::invalid_argument("unknown dtype '" + s + "' (expected F32, F16, BF16, Q8_0, Q4_0, Q4_1, I32 or I64)");
}

Op parse_op(const std::string& s) {
    for (int i = 0; i < static_cast<int>(Op::COUNT); ++i) {
        if (s == op_name(static_cast<Op>(i))) return static_cast<Op>(i);
    }
    throw std::invalid_argument("unknown op '" + s + "'");
}

Shape parse_shape(const std::vector<int64_t>& dims) {
    if (dims.empty() || dims.size() > kMaxDims) {
        throw std::invalid_argument("shape must have 1 to 4 dimensions, got " + std::to_string(dims.size()));
    }
    Shape ne{1, 1, 1, 1};
    for (size_t d = 0; d < dims.size(); ++d) ne[d] = dims[d];
    return ne;
}

void check_id(const Graph& g, int id, const char* what) {
    if (id < 0 || id >= g.size()) {
        throw std::invalid_argument(std::string(what) + ": no tensor " + std::to_string(id) + " in a graph of " +
                                    std::to_string(g.size()));
    }
}

int add_view(Graph& g, int src, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
             size_t offset) {
    check_id(g, src, "view");
    if (strides.size() != shape.size()) throw std::invalid_argument("view: strides and shape differ in length");
    const Shape ne = parse_shape(shape);
    std::array<size_t, kMaxDims> nb{};
    for (size_t d = 0; d < kMaxDims; ++d) {
        if (d < strides.size()) {
            if (strides[d] < 0) throw std::invalid_argument("view: negative stride");
            nb[d] = static_cast<size_t>(strides[d]);
        } else {
            nb[d] = nb[d - 1] * static_cast<size_t>(ne[d - 1]);  // trailing unit dims: contiguous
        }
    }
    return g.view(src, ne, nb, offset);
}

int add_node(Graph& g, const std::string& op_str, const std::string& dtype, const std::vector<int64_t>& shape,
             const std::vector<int>& srcs, const std::string& name) {
    const Op op = parse_op(op_str);
    if (op == Op::NONE || op == Op::VIEW || op == Op::SET_ROWS) {
        throw std::invalid_argument("add_node: " + op_str + " tensors are made by input/external, view or set_rows");
    }
    if (srcs.size() > static_cast<size_t>(kMaxSrc)) throw std::invalid_argument("add_node: more than 5 sources");
    for (int s : srcs) check_id(g, s, "add_node");
    const int id = g.add_node(op, parse_dtype(dtype), parse_shape(shape), {}, name);
    for (size_t i = 0; i < srcs.size(); ++i) g[id].src[i] = srcs[i];
    return id;
}

std::shared_ptr<AllocationPlan> mutable_plan(std::shared_ptr<const AllocationPlan> p) {
    // Plans are immutable once made; Python only reads them, and pybind11 needs a non-const holder.
    return std::const_pointer_cast<AllocationPlan>(std::move(p));
}

}  // namespace

void bind_graph(py::module_& m) {
    py::class_<Graph>(m, "Graph", "An op graph built in execution order; tensors are named by integer ids.")
        .def(py::init<>())
        .def(
            "input",
            [](Graph& g, const std::string& dtype, const std::vector<int64_t>& shape, const std::string& name) {
                return g.input(parse_dtype(dtype), parse_shape(shape), name);
            },
            py::arg("dtype"), py::arg("shape"), py::arg("name") = "",
            "A leaf the caller fills before compute; its memory comes from the plan.")
        .def(
            "external",
            [](Graph& g, const std::string& dtype, const std::vector<int64_t>& shape, const std::string& name) {
                return g.external(parse_dtype(dtype), parse_shape(shape), nullptr, name);
            },
            py::arg("dtype"), py::arg("shape"), py::arg("name") = "",
            "A leaf whose memory is owned elsewhere (no data: for planning only).")
        .def("view", &add_view, py::arg("src"), py::arg("shape"), py::arg("strides"), py::arg("offset") = 0,
             "A strided view of src; strides in bytes, one per listed dimension, nb[0] first.")
        .def(
            "reshape",
            [](Graph& g, int src, const std::vector<int64_t>& shape) {
                check_id(g, src, "reshape");
                return g.reshape(src, parse_shape(shape));
            },
            py::arg("src"), py::arg("shape"))
        .def(
            "set_rows",
            [](Graph& g, int dst, int rows, int ids) {
                check_id(g, dst, "set_rows");
                check_id(g, rows, "set_rows");
                check_id(g, ids, "set_rows");
                return g.set_rows(dst, rows, ids);
            },
            py::arg("dst"), py::arg("rows"), py::arg("ids"), "A computed view of dst that writes rows into it.")
        .def("add_node", &add_node, py::arg("op"), py::arg("dtype"), py::arg("shape"), py::arg("srcs"),
             py::arg("name") = "")
        .def(
            "set_output", [](Graph& g, int id) { check_id(g, id, "set_output"); g.set_output(id); }, py::arg("id"))
        .def(
            "set_pinned", [](Graph& g, int id) { check_id(g, id, "set_pinned"); g.set_pinned(id); }, py::arg("id"))
        .def_property_readonly("size", &Graph::size)
        .def("__len__", &Graph::size)
        .def(
            "nbytes", [](const Graph& g, int id) { check_id(g, id, "nbytes"); return g[id].nbytes(); },
            py::arg("id"))
        .def(
            "root_of", [](const Graph& g, int id) { check_id(g, id, "root_of"); return g.root_of(id); },
            py::arg("id"))
        .def("op", [](const Graph& g, int id) { check_id(g, id, "op"); return std::string(op_name(g[id].op)); })
        .def("dtype",
             [](const Graph& g, int id) { check_id(g, id, "dtype"); return std::string(dtype_name(g[id].dtype)); })
        .def("shape",
             [](const Graph& g, int id) {
                 check_id(g, id, "shape");
                 return std::vector<int64_t>(g[id].ne.begin(), g[id].ne.end());
             })
        .def("strides",
             [](const Graph& g, int id) {
                 check_id(g, id, "strides");
                 return std::vector<size_t>(g[id].nb.begin(), g[id].nb.end());
             })
        .def("srcs",
             [](const Graph& g, int id) {
                 check_id(g, id, "srcs");
                 std::vector<int> out;
                 for (int s : g[id].src) {
                     if (s >= 0) out.push_back(s);
                 }
                 return out;
             })
        .def("view_src", [](const Graph& g, int id) { check_id(g, id, "view_src"); return g[id].view_src; })
        .def("view_offset", [](const Graph& g, int id) { check_id(g, id, "view_offset"); return g[id].view_offset; })
        .def("name", [](const Graph& g, int id) { check_id(g, id, "name"); return g[id].name; })
        .def("is_input", [](const Graph& g, int id) { check_id(g, id, "is_input"); return g[id].has(kInput); })
        .def("is_output", [](const Graph& g, int id) { check_id(g, id, "is_output"); return g[id].has(kOutput); })
        .def("is_pinned", [](const Graph& g, int id) { check_id(g, id, "is_pinned"); return g[id].has(kPinned); })
        .def("is_external",
             [](const Graph& g, int id) { check_id(g, id, "is_external"); return g[id].has(kExternal); });

    py::class_<AllocationPlan, std::shared_ptr<AllocationPlan>>(
        m, "AllocationPlan", "Byte offsets per tensor id in one arena (-1 for views and external tensors).")
        .def(py::init([](std::vector<int64_t> offsets, size_t arena_bytes, size_t alignment) {
                 auto p = std::make_shared<AllocationPlan>();
                 p->offset = std::move(offsets);
                 p->arena_bytes = arena_bytes;
                 p->alignment = alignment;
                 return p;
             }),
             py::arg("offsets"), py::arg("arena_bytes"), py::arg("alignment") = 1,
             "A hand-made plan, e.g. to test check_plan.")
        .def_property_readonly("offsets", [](const AllocationPlan& p) { return p.offset; })
        .def_readonly("arena_bytes", &AllocationPlan::arena_bytes)
        .def_readonly("alignment", &AllocationPlan::alignment)
        .def_readonly("key_hash", &AllocationPlan::key_hash);

    py::class_<AllocationPlanner>(m, "AllocationPlanner",
                                  "Plans graphs and caches plans (LRU) under each graph's full key.")
        .def(py::init<size_t, size_t>(), py::arg("cache_capacity") = 4, py::arg("alignment") = 64)
        .def(
            "plan", [](AllocationPlanner& p, const Graph& g) { return mutable_plan(p.plan(g)); }, py::arg("graph"))
        .def_property("checking", &AllocationPlanner::checking, &AllocationPlanner::set_checking)
        .def_property_readonly("plans_built", &AllocationPlanner::plans_built)
        .def_property_readonly("cache_hits", &AllocationPlanner::cache_hits)
        .def_property_readonly("alignment", &AllocationPlanner::alignment)
        .def_property_readonly("cache_capacity", &AllocationPlanner::cache_capacity)
        .def_property_readonly("cache_size", &AllocationPlanner::cache_size);

    m.def(
        "make_plan",
        [](const Graph& g, size_t alignment) { return std::make_shared<AllocationPlan>(make_plan(g, alignment)); },
        py::arg("graph"), py::arg("alignment") = 64, "A fresh plan (no cache).");
    m.def("check_plan", &check_plan, py::arg("graph"), py::arg("plan"),
          "Raises RuntimeError naming both tensors when the plan breaks liveness, bounds, alignment or views.");
    m.def("graph_plan_key", &graph_plan_key, py::arg("graph"), "The key plans are cached under.");
}

}  // namespace pyspec
