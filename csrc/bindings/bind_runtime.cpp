// Bindings for models and decode contexts. Arrays cross as numpy; decode releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "bindings/kv_cache_type.h"
#include "model/model.h"
#include "runtime/context.h"

namespace py = pybind11;

namespace pyspec {
namespace {

template <typename T>
std::vector<T> to_vector(const py::array_t<T, py::array::c_style | py::array::forcecast>& a) {
    if (a.ndim() != 1) throw std::invalid_argument("expected a 1-D array");
    return std::vector<T>(a.data(), a.data() + a.size());
}

// A vector's contents as a numpy array without a copy: the array owns the moved vector.
template <typename T>
py::array_t<T> array_owning(std::vector<T>&& v, std::vector<py::ssize_t> shape) {
    if (v.empty()) return py::array_t<T>(std::move(shape));
    auto* owned = new std::vector<T>(std::move(v));
    py::capsule free_when_done(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
    return py::array_t<T>(std::move(shape), owned->data(), free_when_done);
}

// (logits [n_out, n_vocab], output rows, {layer id: inputs}); with argmax_only the first is the
// output rows' greedy ids [n_out] (the graph's ARGMAX) instead of their logits; with candidates =
// k > 0 it is (each row's k best ids [n_out, k] in TOP_K's order, their logits [n_out, k] by
// GATHER): all a sampler with top-k needs.
py::tuple decode(Context& ctx, const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& tokens,
                 const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& positions,
                 const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& seq_ids,
                 const py::array_t<uint8_t, py::array::c_style | py::array::forcecast>& output,
                 const std::vector<int>& layer_ids,
                 const py::array_t<uint8_t, py::array::c_style | py::array::forcecast>& prompt, bool argmax_only,
                 int64_t candidates) {
    const int64_t n_vocab = ctx.model().hparams().n_vocab;
    if (candidates < 0 || candidates > n_vocab)
        throw std::invalid_argument("candidates must be in [0, n_vocab = " + std::to_string(n_vocab) + "]");
    Batch b;
    b.argmax_only = argmax_only || candidates > 0;
    b.argmax_k = std::max<int64_t>(1, candidates);
    b.argmax_values = candidates > 0;
    b.tokens = to_vector(tokens);
    b.positions = to_vector(positions);
    b.seq_ids = to_vector(seq_ids);
    b.output = to_vector(output);
    b.prompt = to_vector(prompt);  // empty: the rows without logits
    DecodeOutput out;
    {
        py::gil_scoped_release release;
        out = ctx.decode(b, layer_ids);
    }
    const auto n_out = static_cast<py::ssize_t>(out.output_rows.size());
    // Moved, not copied: a SmolLM2 row of logits is 192 KiB a token.
    py::object first;
    if (candidates > 0) {
        const std::vector<py::ssize_t> shape{n_out, static_cast<py::ssize_t>(candidates)};
        first = py::make_tuple(array_owning(std::move(out.argmax), shape), array_owning(std::move(out.argmax_values), shape));
    } else if (argmax_only) {
        first = array_owning(std::move(out.argmax), {n_out});
    } else {
        out.logits.resize(static_cast<size_t>(n_out) * static_cast<size_t>(out.n_vocab));  // no outputs: empty
        first = array_owning(std::move(out.logits), {n_out, static_cast<py::ssize_t>(out.n_vocab)});
    }
    py::array_t<int32_t> rows = array_owning(std::move(out.output_rows), {n_out});
    py::dict inputs;
    for (auto& li : out.layer_inputs) {
        const auto n_rows = static_cast<py::ssize_t>(li.second.size() / static_cast<size_t>(out.n_embd));
        inputs[py::int_(li.first)] = array_owning(std::move(li.second), {n_rows, static_cast<py::ssize_t>(out.n_embd)});
    }
    return py::make_tuple(first, rows, inputs);
}

}  // namespace

void bind_runtime(py::module_& m) {
    py::class_<Model, std::shared_ptr<Model>>(m, "Model")
        .def(py::init<const std::string&>(), py::arg("path"), py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("arch", [](const Model& mo) { return std::string(arch_name(mo.hparams().arch)); })
        .def_property_readonly("n_vocab", [](const Model& mo) { return mo.hparams().n_vocab; })
        .def_property_readonly("n_embd", [](const Model& mo) { return mo.hparams().n_embd; })
        .def_property_readonly("n_layer", [](const Model& mo) { return mo.hparams().n_layer; })
        .def_property_readonly("n_head", [](const Model& mo) { return mo.hparams().n_head; })
        .def_property_readonly("n_head_kv", [](const Model& mo) { return mo.hparams().n_head_kv; })
        .def_property_readonly("head_dim", [](const Model& mo) { return mo.hparams().head_dim; })
        .def_property_readonly("n_ff", [](const Model& mo) { return mo.hparams().n_ff; })
        .def_property_readonly("n_ctx_train", [](const Model& mo) { return mo.hparams().n_ctx_train; })
        .def_property_readonly("tied_output", [](const Model& mo) { return mo.hparams().tied_output; });

    py::class_<Context>(m, "Context")
        .def(py::init([](std::shared_ptr<Model> model, int64_t n_ctx, int64_t n_seq_max, int64_t n_batch,
                         bool check_plans, int n_threads, const std::string& kv_dtype, const std::string& backend) {
                 ContextParams p;
                 p.backend = parse_backend(backend);
                 p.kv_dtype = parse_kv_cache_type(kv_dtype);
                 p.n_ctx = n_ctx;
                 p.n_seq_max = n_seq_max;
                 p.n_batch = n_batch;
                 p.check_plans = check_plans;
                 p.n_threads = n_threads;
                 return std::make_unique<Context>(*model, p);
             }),
             py::arg("model"), py::arg("n_ctx"), py::arg("n_seq_max"), py::arg("n_batch"),
             py::arg("check_plans"), py::arg("n_threads"), py::arg("kv_dtype") = "f16", py::arg("backend") = "cpu", py::keep_alive<1, 2>(),
             "backend: \"cpu\", \"cuda\" or \"cuda:N\" (a RuntimeError with the reason when CUDA cannot be used)")
        .def("decode", &decode, py::arg("tokens"), py::arg("positions"), py::arg("seq_ids"), py::arg("output"),
             py::arg("layer_ids"), py::arg("prompt") = py::array_t<uint8_t>(0), py::arg("argmax_only") = false,
             py::arg("candidates") = 0)
        .def("kv_remove", [](Context& c, int32_t seq, int64_t p0, int64_t p1) { c.kv().remove(seq, p0, p1); })
        .def("kv_clear", [](Context& c, int32_t seq) { c.kv().clear(seq); })
        .def("seq_pos_max", [](Context& c, int32_t seq) {
            if (seq < 0 || seq >= c.kv().n_seq_max()) throw std::invalid_argument("seq_id " + std::to_string(seq) + " out of range");
            return c.kv().pos_max(seq);
        })
        .def_property_readonly("n_ctx", [](Context& c) { return c.params().n_ctx; })
        .def_property_readonly("n_seq_max", [](Context& c) { return c.params().n_seq_max; })
        .def_property_readonly("n_batch", [](Context& c) { return c.params().n_batch; })
        .def_property_readonly("n_ctx_seq", &Context::n_ctx_seq)
        .def_property_readonly("compute_buffer_bytes", &Context::compute_buffer_bytes)
        .def_property_readonly("backend", [](Context& c) { return std::string(c.backend_name()); })
        .def_property_readonly("kv_cache_bytes", [](Context& c) { return c.kv().bytes(); })
        .def("set_profiling", &Context::set_profiling)
        .def("op_profile", &Context::op_profile)
        .def_property_readonly("plans_built", [](Context& c) { return c.planner().plans_built(); })
        .def_property_readonly("cache_hits", [](Context& c) { return c.planner().cache_hits(); });
}

}  // namespace pyspec
