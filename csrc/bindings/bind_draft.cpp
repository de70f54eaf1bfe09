// Bindings for block drafters (DraftModel) and their context (DraftContext). Arrays cross as
// numpy; inject and draft_logits release the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <memory>

#include "bindings/kv_cache_type.h"
#include "model/dflash.h"
#include "spec/draft_context.h"

namespace py = pybind11;

namespace pyspec {
namespace {

using I32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using F32Array = py::array_t<float, py::array::c_style | py::array::forcecast>;

void inject(DraftContext& ctx, int32_t seq, const I32Array& positions, const F32Array& features) {
    if (positions.ndim() != 1) throw std::invalid_argument("inject: positions must be a 1-D array");
    const auto& hp = ctx.model().hparams();
    const auto width = static_cast<py::ssize_t>(hp.target_layers.size()) * static_cast<py::ssize_t>(hp.n_embd);
    if (features.ndim() != 2 || features.shape(0) != positions.shape(0) || features.shape(1) != width) {
        throw std::invalid_argument("inject: features must be [n_rows, n_target_layers * n_embd] = [" +
                                    std::to_string(positions.shape(0)) + ", " + std::to_string(width) + "]");
    }
    std::vector<int32_t> pos(positions.data(), positions.data() + positions.size());
    py::gil_scoped_release release;
    ctx.inject(seq, pos, features.data(), pos.size());
}

DraftSampling sampling_of(int32_t pos0, float temperature, uint64_t seed, int64_t offset) {
    DraftSampling sampling;
    sampling.temperature = temperature;
    sampling.seed = seed;
    if (offset < -1 || offset > static_cast<int64_t>(UINT32_MAX)) {
        throw std::invalid_argument("draft_logits: offset must be in [0, 2^32) (or -1 for pos0)");
    }
    sampling.offset = static_cast<uint32_t>(offset < 0 ? pos0 : offset);
    return sampling;
}

py::dict to_dict(const DraftOutput& out) {
    auto matrix = [&](const std::vector<float>& v) {
        py::array_t<float> a({static_cast<py::ssize_t>(out.n_block), static_cast<py::ssize_t>(out.n_vocab)});
        std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(float));
        return a;
    };
    py::dict d;
    d["logits"] = matrix(out.logits);
    py::array_t<int32_t> tokens(static_cast<py::ssize_t>(out.tokens.size()));
    std::memcpy(tokens.mutable_data(), out.tokens.data(), out.tokens.size() * sizeof(int32_t));
    d["tokens"] = tokens;
    if (!out.base_logits.empty()) d["base_logits"] = matrix(out.base_logits);
    if (!out.q.empty()) d["q"] = matrix(out.full_q());
    // The sampling chains' outputs: [n_block, n_candidates] each.
    const std::vector<py::ssize_t> kshape{static_cast<py::ssize_t>(out.n_block), static_cast<py::ssize_t>(out.n_candidates)};
    py::array_t<int32_t> cand(kshape);
    std::memcpy(cand.mutable_data(), out.candidates.data(), out.candidates.size() * sizeof(int32_t));
    d["candidates"] = cand;
    py::array_t<float> cl(kshape), cp(kshape);
    std::memcpy(cl.mutable_data(), out.candidate_logits.data(), out.candidate_logits.size() * sizeof(float));
    std::memcpy(cp.mutable_data(), out.candidate_probs.data(), out.candidate_probs.size() * sizeof(float));
    d["candidate_logits"] = cl;
    d["probs"] = cp;
    if (!out.confidence.empty()) {
        py::array_t<float> c(static_cast<py::ssize_t>(out.confidence.size()));
        std::memcpy(c.mutable_data(), out.confidence.data(), out.confidence.size() * sizeof(float));
        d["confidence"] = c;
    }
    return d;
}

py::dict draft_logits(DraftContext& ctx, int32_t seq, int32_t id_last, int32_t pos0, int64_t n_block,
                      float temperature, uint64_t seed, int64_t offset, int64_t n_out) {
    const DraftSampling sampling = sampling_of(pos0, temperature, seed, offset);
    DraftOutput out;
    {
        py::gil_scoped_release release;
        out = ctx.draft(seq, id_last, pos0, n_block, n_out, sampling);
    }
    return to_dict(out);
}

// requests: a list of dicts {seq, id_last, pos0[, temperature, seed, offset]}.
py::list draft_logits_many(DraftContext& ctx, const py::list& requests, int64_t n_block, int64_t n_out,
                           bool with_chains) {
    std::vector<DraftRequest> reqs;
    for (const py::handle& h : requests) {
        const py::dict r = py::reinterpret_borrow<py::dict>(h);
        DraftRequest d;
        d.seq = r["seq"].cast<int32_t>();
        d.id_last = r["id_last"].cast<int32_t>();
        d.pos0 = r["pos0"].cast<int32_t>();
        d.sampling = sampling_of(d.pos0, r.contains("temperature") ? r["temperature"].cast<float>() : 0.0f,
                                 r.contains("seed") ? r["seed"].cast<uint64_t>() : 0,
                                 r.contains("offset") ? r["offset"].cast<int64_t>() : -1);
        reqs.push_back(d);
    }
    std::vector<DraftOutput> outs;
    {
        py::gil_scoped_release release;
        outs = ctx.draft_many(reqs, n_block, n_out, /*with_logits=*/true, with_chains);
    }
    py::list l;
    for (const DraftOutput& o : outs) l.append(to_dict(o));
    return l;
}

}  // namespace

void bind_draft(py::module_& m) {
    py::class_<DraftModel, std::shared_ptr<DraftModel>>(m, "DraftModel")
        .def(py::init([](const std::string& path, std::shared_ptr<Model> target) {
                 return std::make_shared<DraftModel>(path, std::move(target));
             }),
             py::arg("path"), py::arg("target_model"), py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("block_size", [](const DraftModel& d) { return d.hparams().block_size; })
        .def_property_readonly("block_size_min", [](const DraftModel& d) { return d.hparams().block_size_min; })
        .def("block_rows", [](const DraftModel& d, int64_t n_slots) { return d.hparams().block_rows(n_slots); },
             py::arg("n_slots"), "rows a pass decodes when its first n_slots slots come out")
        .def_property_readonly("target_layers", [](const DraftModel& d) { return d.hparams().target_layers; })
        .def_property_readonly("mask_token_id", [](const DraftModel& d) { return d.hparams().mask_token_id; })
        .def_property_readonly("n_layer", [](const DraftModel& d) { return d.hparams().n_layer; })
        .def_property_readonly("n_embd", [](const DraftModel& d) { return d.hparams().n_embd; })
        .def_property_readonly("n_vocab", [](const DraftModel& d) { return d.hparams().n_vocab; })
        .def_property_readonly("n_vocab_draft", [](const DraftModel& d) { return d.hparams().n_vocab_draft; })
        .def_property_readonly("d2t", [](const DraftModel& d) { return d.d2t; })
        .def_property_readonly("n_ctx_train", [](const DraftModel& d) { return d.hparams().n_ctx_train; })
        .def_property_readonly("is_dspark", [](const DraftModel& d) { return d.hparams().is_dspark; })
        .def_property_readonly("sample_from_anchor", [](const DraftModel& d) { return d.hparams().sample_from_anchor; })
        .def_property_readonly("has_confidence_head", [](const DraftModel& d) { return d.hparams().has_confidence_head; })
        .def_property_readonly("causal", [](const DraftModel& d) { return d.hparams().causal; })
        .def_property_readonly("markov_rank", [](const DraftModel& d) { return d.hparams().markov_rank; })
        .def_property_readonly("draft_offset", [](const DraftModel& d) { return d.hparams().draft_offset(); })
        .def_property_readonly("n_draft_max", [](const DraftModel& d) { return d.hparams().n_draft_max(); })
        .def_property_readonly("owns_tok_embd", [](const DraftModel& d) { return d.owns_tok_embd; })
        .def_property_readonly("owns_output", [](const DraftModel& d) { return d.owns_output; });

    py::class_<ParkedDraftState>(m, "ParkedDraftState", "One drafter sequence's cells, pos_base and occupancy, parked.")
        .def_readonly("pos_base", &ParkedDraftState::pos_base)
        .def_readonly("positions", &ParkedDraftState::positions)
        .def_property_readonly("n_bytes", [](const ParkedDraftState& s) { return s.cells.size(); });

    py::class_<DraftContext>(m, "DraftContext")
        .def(py::init([](std::shared_ptr<DraftModel> model, int64_t n_seq_max, int64_t n_batch, int n_threads,
                         const std::string& kv_dtype, bool check_plans, int64_t n_candidates, const std::string& backend) {
                 DraftContextParams p;
                 p.backend = parse_backend(backend);
                 p.kv_dtype = parse_kv_cache_type(kv_dtype);
                 p.n_seq_max = n_seq_max;
                 p.n_batch = n_batch;
                 p.n_threads = n_threads;
                 p.check_plans = check_plans;
                 p.n_candidates = n_candidates;
                 return std::make_unique<DraftContext>(*model, p);
             }),
             py::arg("draft_model"), py::arg("n_seq_max"), py::arg("n_batch"), py::arg("n_threads"),
             py::arg("kv_dtype") = "f16", py::arg("check_plans") = false,
             py::arg("n_candidates") = 8, py::arg("backend") = "cpu", py::keep_alive<1, 2>())
        .def("inject", &inject, py::arg("seq"), py::arg("positions"), py::arg("features"))
        .def("draft_logits", &draft_logits, py::arg("seq"), py::arg("id_last"), py::arg("pos0"), py::arg("n_block"),
             py::arg("temperature") = 0.0f, py::arg("seed") = 0, py::arg("offset") = -1, py::arg("n_out") = -1,
             "Drafts the block [id_last, MASK, ...] (n_block tokens) at pos0 and returns its first n_out slots "
             "(-1: all; the others are decoded as the kept slots' context). temperature > 0: draft slots are drawn by "
             "Gumbel-max with Philox noise keyed (seed, offset (-1: pos0), pos0 + 1 + k, draft stream); "
             "DSpark draws ancestrally in the graph (each slot's Markov bias follows the drawn token). "
             "Returns logits, tokens, candidates, candidate_logits, probs, and when present base_logits, "
             "confidence, q (T > 0: the exact law of each draft slot's token).")
        .def("draft_logits_many", &draft_logits_many, py::arg("requests"), py::arg("n_block"), py::arg("n_out") = -1,
             py::arg("with_chains") = true,
             "One drafter pass over the blocks of several distinct sequences: requests is a list of dicts "
             "{seq, id_last, pos0[, temperature, seed, offset]}; returns one draft_logits dict per request, "
             "in order, each exactly what draft_logits returns for that sequence alone. with_chains=False "
             "(DSpark): no sampling chains (empty candidates, -1 tokens before the draft slots), the rest the same.")
        .def("remove", &DraftContext::remove, py::arg("seq"), py::arg("p0"), py::arg("p1") = -1)
        .def("clear", &DraftContext::clear, py::arg("seq") = -1)
        .def("park", &DraftContext::park, py::arg("seq"))
        .def("restore", &DraftContext::restore, py::arg("seq"), py::arg("state"))
        .def_property_readonly("max_pos_written", &DraftContext::max_pos_written)
        .def("set_profiling", &DraftContext::set_profiling, py::arg("on"))
        .def("op_profile", &DraftContext::op_profile, "[(op name, seconds, calls)] while profiling (CPU only)")
        .def("pos_base", &DraftContext::pos_base)
        .def("seq_pos_min", &DraftContext::pos_min)
        .def("seq_pos_max", &DraftContext::pos_max)
        .def("n_rows", &DraftContext::n_rows)
        .def_property_readonly("window", &DraftContext::window)
        .def_property_readonly("kv_cache_bytes", &DraftContext::kv_bytes)
        .def_property_readonly("compute_buffer_bytes", &DraftContext::compute_buffer_bytes)
        .def_property_readonly("backend", [](const DraftContext& c) { return std::string(c.backend_name()); })
        .def_property_readonly("n_candidates", [](const DraftContext& c) { return c.params().n_candidates; })
        .def_property_readonly("plans_built", [](const DraftContext& c) { return c.planner().plans_built(); })
        .def_property_readonly("cache_hits", [](const DraftContext& c) { return c.planner().cache_hits(); });
}

}  // namespace pyspec
