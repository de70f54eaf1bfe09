// pyspec._core.SpecEngine: the speculative step over many requests (csrc/spec/spec_engine.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "bindings/kv_cache_type.h"
#include "spec/spec_engine.h"

namespace py = pybind11;

namespace pyspec {

namespace {

VerifyMethod method_of(const std::string& name) {
    if (name == "greedy") return VerifyMethod::Greedy;
    if (name == "rejection") return VerifyMethod::Rejection;
    if (name == "block") return VerifyMethod::Block;
    throw std::invalid_argument("unknown verify method '" + name + "' (one of greedy, rejection, block)");
}

py::dict stats_dict(const RequestStats& s) {
    py::dict d;
    d["n_rounds"] = s.n_rounds;
    d["draft_n"] = s.draft_n;
    d["draft_n_accepted"] = s.draft_n_accepted;
    d["drafted_at"] = s.drafted_at;
    d["accepted_at"] = s.accepted_at;
    d["mean_accepted_length"] = s.mean_accepted_length();
    d["n_cached"] = s.n_cached;
    d["n_restaged"] = s.n_restaged;
    d["draft_stopped"] = s.draft_stopped;
    d["draft_stop_reason"] = s.draft_stop_reason;
    d["ngram_rounds"] = s.ngram_rounds;
    d["ngram_draft_n"] = s.ngram_draft_n;
    d["ngram_draft_n_accepted"] = s.ngram_draft_n_accepted;
    return d;
}

}  // namespace

void bind_spec_engine(py::module_& m) {
    py::class_<SpecEngine>(m, "SpecEngine",
                           "Speculative decoding over many requests: one target decode per step, request-keyed "
                           "drafter slots (DraftStateRegistry), verification and rollback per request.")
        .def(py::init([](std::shared_ptr<Model> target, std::shared_ptr<DraftModel> drafter, int64_t n_ctx,
                         int64_t n_seq_max, int64_t n_draft_slots, int64_t n_batch, int64_t draft_n_batch,
                         int n_threads, int64_t draft_n_max, int64_t prefill_chunk, const std::string& kv_dtype, const std::string& backend,
                         int64_t ngram_n, int64_t ngram_m, std::optional<bool> decode_ahead) {
                 SpecEngineParams p;
                 p.backend = parse_backend(backend);
                 p.kv_dtype = parse_kv_cache_type(kv_dtype);
                 p.n_ctx = n_ctx;
                 p.n_seq_max = n_seq_max;
                 p.n_draft_slots = n_draft_slots;
                 p.n_batch = n_batch;
                 p.draft_n_batch = draft_n_batch;
                 p.n_threads = n_threads;
                 p.draft_n_max = draft_n_max;
                 p.prefill_chunk = prefill_chunk;
                 p.ngram.n = ngram_n;
                 p.ngram.m = ngram_m;
                 p.decode_ahead = decode_ahead ? (*decode_ahead ? 1 : 0) : -1;
                 return std::make_unique<SpecEngine>(*target, drafter.get(), p);
             }),
             py::arg("target_model"), py::arg("draft_model"), py::arg("n_ctx"), py::arg("n_seq_max"),
             py::arg("n_draft_slots") = 1, py::arg("n_batch") = 512, py::arg("draft_n_batch") = 512,
             py::arg("n_threads") = 1, py::arg("draft_n_max") = -1, py::arg("prefill_chunk") = 256,
             py::arg("kv_dtype") = "f16", py::arg("backend") = "cpu", py::arg("ngram_n") = 0, py::arg("ngram_m") = 48,
             py::arg("decode_ahead") = py::none(), py::keep_alive<1, 2>(), py::keep_alive<1, 3>(),
             "ngram_n > 0: llama-server's ngram-simple ahead of the drafter (drafts: the up to ngram_m tokens that "
             "followed the latest earlier occurrence of a request's last ngram_n tokens); draft_model may be None. "
             "decode_ahead: plain greedy rows queue their next step before this one's tokens are read (the "
             "tokens fed on the device), so the host's work between steps overlaps the GPU's; the same tokens. "
             "None: where the backend computes asynchronously (the GPU); PYSPEC_DECODE_AHEAD=0/1 overrides.")
        .def(
            "add_request",
            [](SpecEngine& e, uint64_t id, const std::vector<int32_t>& prompt, int64_t max_tokens, double temperature,
               int64_t top_k, double top_p, double min_p, uint64_t seed, const std::string& verify, const std::vector<int32_t>& stop_ids, double draft_p_min,
               int64_t draft_n_min, const std::string& draft_p_min_mode, const std::vector<std::pair<int32_t, float>>& logit_bias,
               int64_t repeat_last_n, float repeat_penalty, float presence_penalty, float frequency_penalty, int64_t n_probs,
               int32_t seq, bool draft, bool keep_cache, bool reuse_cache) {
                RequestParams p;
                p.processing.logit_bias = logit_bias;
                p.processing.repeat_last_n = repeat_last_n;
                p.processing.repeat_penalty = repeat_penalty;
                p.processing.presence_penalty = presence_penalty;
                p.processing.frequency_penalty = frequency_penalty;
                p.n_probs = n_probs;
                p.seq = seq;
                p.draft = draft;
                p.keep_cache = keep_cache;
                p.reuse_cache = reuse_cache;
                p.draft_p_min = draft_p_min;
                p.draft_n_min = draft_n_min;
                p.draft_p_min_mode = p_min_mode_of(draft_p_min_mode);
                p.max_tokens = max_tokens;
                p.temperature = temperature;
                p.top_k = top_k;
                p.top_p = top_p;
                p.min_p = min_p;
                p.seed = seed;
                p.method = method_of(verify);
                p.stop_ids = stop_ids;
                e.add_request(id, prompt, p);
            },
            py::arg("request_id"), py::arg("prompt"), py::arg("max_tokens") = -1, py::arg("temperature") = 0.0,
            py::arg("top_k") = 0, py::arg("top_p") = 1.0, py::arg("min_p") = 0.0, py::arg("seed") = 0, py::arg("verify") = "rejection", py::arg("stop_ids") = std::vector<int32_t>(),
            py::arg("draft_p_min") = 0.0, py::arg("draft_n_min") = 0, py::arg("draft_p_min_mode") = "first",
            py::arg("logit_bias") = std::vector<std::pair<int32_t, float>>(), py::arg("repeat_last_n") = 64,
            py::arg("repeat_penalty") = 1.0f, py::arg("presence_penalty") = 0.0f, py::arg("frequency_penalty") = 0.0f,
            py::arg("n_probs") = 0, py::arg("seq") = -1, py::arg("draft") = true, py::arg("keep_cache") = false,
            py::arg("reuse_cache") = false,
            "Adds a request. logit_bias: [(token id, bias)] (-inf bans); penalties as llama.cpp's (over the "
            "prompt and the output); n_probs > 0: step() reports top-n log-probabilities of each token; seq: the "
            "target sequence (server slot) to use, -1 any; draft=False: never draft; keep_cache: when the request "
            "ends its sequence keeps its KV rows as a prompt cache; reuse_cache (with seq >= 0): reuse the rows of "
            "the longest common prefix with what that sequence kept (stats n_cached).")
        .def("cancel", &SpecEngine::cancel, py::arg("request_id"))
        .def("pause", &SpecEngine::pause, py::arg("request_id"))
        .def("resume", &SpecEngine::resume, py::arg("request_id"))
        .def(
            "step",
            [](SpecEngine& e) {
                std::vector<StepOutput> outs;
                {
                    py::gil_scoped_release release;
                    outs = e.step();
                }
                py::list l;
                for (const StepOutput& o : outs) {
                    py::dict d;
                    d["request_id"] = o.request_id;
                    d["tokens"] = o.tokens;
                    d["finished"] = o.finished;
                    d["stop_reason"] = o.stop_reason;
                    d["stop_token"] = o.stop_token;
                    d["n_drafted"] = o.n_drafted;
                    d["n_prompt_processed"] = o.n_prompt_processed;
                    d["verified"] = o.verified;
                    if (!o.probs.empty()) {
                        py::list probs;
                        for (const TokenLogprobs& t : o.probs) probs.append(py::make_tuple(t.id, t.logprob, t.top));
                        d["probs"] = probs;
                    }
                    d["stats"] = stats_dict(o.stats);
                    l.append(d);
                }
                return l;
            },
            "One step over the active requests: a list of {request_id, tokens, finished, stop_reason, n_drafted, "
            "n_prompt_processed, verified (the block verified), stats[, probs: [(id, logprob, [(id, logprob)...])]]} for the requests that ran.")
        .def_property_readonly("has_drafter", &SpecEngine::has_drafter)
        .def("set_profiling", &SpecEngine::set_profiling, py::arg("on"),
             "Per-op time profiles of the target's and the drafter's passes while on.")
        .def(
            "op_profile",
            [](const SpecEngine& e) {
                py::dict d;
                d["target"] = e.target_op_profile();
                d["drafter"] = e.draft_op_profile();
                return d;
            },
            "{target, drafter}: [(op name, seconds, calls)] of the passes run while profiling.")
        .def(
            "phase_times",
            [](const SpecEngine& e) {
                const SpecEngine::PhaseTimes& t = e.phase_times();
                py::dict d;
                d["target_s"] = t.target_s;
                d["stage_s"] = t.stage_s;
                d["draft_s"] = t.draft_s;
                d["other_s"] = t.other_s;
                d["steps"] = t.steps;
                return d;
            },
            "Wall-clock seconds step() spent since construction, by phase: {target_s (the target's pass), "
            "stage_s (committed rows into the drafter), draft_s (the drafter's passes), other_s "
            "(scheduling, verification), steps}.")
        .def("inject_draft_failure", &SpecEngine::inject_draft_failure, py::arg("request_id"),
             "Test hook: the next drafter pass including this request fails as a broken drafter would.")
        .def_property_readonly("n_ctx_seq", [](const SpecEngine& e) { return e.target_context().n_ctx_seq(); })
        .def("has_request", &SpecEngine::has_request, py::arg("request_id"))
        .def_property_readonly("n_requests", &SpecEngine::n_requests)
        .def("stats", [](const SpecEngine& e, uint64_t id) { return stats_dict(e.stats(id)); }, py::arg("request_id"))
        .def("pending_drafts", &SpecEngine::pending_drafts, py::arg("request_id"))
        .def("target_seq", &SpecEngine::target_seq, py::arg("request_id"))
        .def("draft_slot", [](const SpecEngine& e, uint64_t id) { return e.registry().slot_of(id); }, py::arg("request_id"))
        .def_property_readonly("registry_size", [](const SpecEngine& e) { return e.registry().size(); })
        .def_property_readonly("registry_held", [](const SpecEngine& e) { return e.registry().n_held(); })
        .def("target_pos_max", &SpecEngine::target_pos_max, py::arg("seq"))
        .def("cached_tokens", &SpecEngine::cached_tokens, py::arg("seq"),
             "The tokens whose KV rows an idle target sequence kept (prompt cache); [] when busy or none.")
        .def("cached_prefix", &SpecEngine::cached_prefix, py::arg("seq"), py::arg("tokens"),
             "Length of the common prefix of `tokens` and cached_tokens(seq).")
        .def("clear_cache", &SpecEngine::clear_cache, py::arg("seq") = -1,
             "Drops the prompt cache of an idle target sequence (-1: every idle one); a busy one raises.")
        .def("draft_n_rows", [](const SpecEngine& e, int32_t slot) { return e.draft_context().n_rows(slot); })
        .def_property_readonly("draft_n_max", &SpecEngine::draft_n_max)
        .def_property_readonly("draft_block_rows", &SpecEngine::draft_block_rows,
                               "rows each drafting pass decodes: the drafter's block, or fewer for "
                               "one trained on cut blocks (pyspec.drafter.block_size_min)")
        .def_property_readonly("window", [](const SpecEngine& e) { return e.draft_context().window(); })
        .def("draft_pos_base", [](const SpecEngine& e, int32_t slot) { return e.draft_context().pos_base(slot); })
        .def_property_readonly("draft_max_pos_written", [](const SpecEngine& e) { return e.draft_context().max_pos_written(); })
        .def_property_readonly("kv_cache_bytes",
                               [](const SpecEngine& e) { return e.target_context().kv().bytes(); },
                               "Bytes the target KV cache reserves (committed only as cells are written).")
        .def_property_readonly("draft_kv_cache_bytes", [](const SpecEngine& e) { return e.draft_context().kv_bytes(); })
        .def_property_readonly("draft_compute_buffer_bytes",
                               [](const SpecEngine& e) { return e.draft_context().compute_buffer_bytes(); })
        .def_property_readonly("steps", &SpecEngine::steps)
        .def_property_readonly("n_decoded_ahead", &SpecEngine::n_decoded_ahead,
                               "steps launched before the host read the step before them (decode_ahead)")
        .def_property_readonly("n_ahead_overruled", &SpecEngine::n_ahead_overruled,
                               "rows decoded ahead on a token the graph drew that the host's own draw overruled "
                               "(dropped and decoded again; sampled decode-ahead)")
        .def_property_readonly("has_step_ahead", &SpecEngine::has_step_ahead)
        .def_property_readonly("n_candidate_steps", &SpecEngine::n_candidate_steps,
                               "steps whose sampled rows drew from the graph's top-k candidates, not whole logit rows")
        .def_property_readonly("n_logit_rows", &SpecEngine::n_logit_rows,
                               "output rows whose whole logits crossed from the backend so far");
}

}  // namespace pyspec
