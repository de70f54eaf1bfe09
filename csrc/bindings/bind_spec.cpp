// pyspec._core.spec: Philox noise, the Gumbel-max draw and the three verification rules on numpy
// arrays (csrc/runtime/philox.h, csrc/spec/verify.h).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/philox.h"
#include "spec/ngram.h"
#include "spec/prune.h"
#include "spec/verify.h"

namespace py = pybind11;

namespace pyspec {

namespace {

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;
using IntArray = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

NoiseStream stream_of(int stream) {
    if (stream < 0 || stream > 3)
        throw std::invalid_argument("stream must be 0 (target), 1 (draft), 2 (accept) or 3 (correction)");
    return static_cast<NoiseStream>(stream);
}

// A [rows, n_vocab] array; an empty array of any shape is zero rows (a round without drafts).
ProbRows rows_of(const FloatArray& a, const char* name, int64_t n_vocab_if_empty) {
    if (a.size() == 0) return ProbRows{a.data(), 0, n_vocab_if_empty};
    if (a.ndim() != 2) throw std::invalid_argument(std::string(name) + " must be a 2-D array [rows, n_vocab]");
    return ProbRows{a.data(), static_cast<int64_t>(a.shape(0)), static_cast<int64_t>(a.shape(1))};
}

const float* row_of(const FloatArray& a, const char* name) {
    if (a.ndim() != 1) throw std::invalid_argument(std::string(name) + " must be a 1-D array");
    return a.data();
}

const int32_t* drafts_of(const IntArray& d, int& gamma) {
    if (d.ndim() != 1) throw std::invalid_argument("drafts must be a 1-D array of token ids");
    gamma = static_cast<int>(d.size());
    return d.data();
}

py::tuple result_tuple(const VerifyResult& r) {
    py::array_t<int32_t> tokens(static_cast<py::ssize_t>(r.tokens.size()));
    std::memcpy(tokens.mutable_data(), r.tokens.data(), r.tokens.size() * sizeof(int32_t));
    py::dict events;
    events["zero_q"] = r.events.zero_q;
    events["empty_residual"] = r.events.empty_residual;
    return py::make_tuple(r.accepted, tokens, events);
}

py::array_t<float> noise(uint64_t seed, uint32_t offset, uint32_t position, int64_t n, int stream, bool gumbel) {
    if (n < 0) throw std::invalid_argument("n must be >= 0");
    py::array_t<float> out(static_cast<py::ssize_t>(n));
    const NoiseKey key{seed, offset, position, stream_of(stream)};
    if (gumbel) {
        fill_gumbel(key, out.mutable_data(), static_cast<size_t>(n));
    } else {
        fill_uniforms(key, out.mutable_data(), static_cast<size_t>(n));
    }
    return out;
}

py::tuple stochastic(VerifyMethod method, const FloatArray& p_rows, const FloatArray& q_rows, const IntArray& drafts,
                     uint64_t seed, uint32_t offset) {
    const ProbRows p = rows_of(p_rows, "p_rows", 0);
    const ProbRows q = rows_of(q_rows, "q_rows", p.n_vocab);
    int gamma = 0;
    const int32_t* d = drafts_of(drafts, gamma);
    VerifyResult r;
    {
        py::gil_scoped_release release;
        r = verify(method, p, q, d, gamma, seed, offset);
    }
    return result_tuple(r);
}

}  // namespace

void bind_spec(py::module_& parent) {
    py::module_ m = parent.def_submodule(
        "spec", "Philox4x32-10 noise, Gumbel-max drafting and lossless verification (greedy, rejection, block)");
    m.attr("STREAM_TARGET") = static_cast<int>(NoiseStream::Target);
    m.attr("STREAM_DRAFT") = static_cast<int>(NoiseStream::Draft);
    m.attr("STREAM_ACCEPT") = static_cast<int>(NoiseStream::Accept);
    m.attr("STREAM_CORRECTION") = static_cast<int>(NoiseStream::Correction);
    m.attr("MAX_SAMPLED_CANDIDATES") = kMaxSampledCandidates;

    m.def(
        "prune_length",
        [](const std::vector<double>& confidence, double p_min, const std::string& mode, int64_t n_min) {
            return prune_length(confidence.data(), confidence.size(), p_min, p_min_mode_of(mode), n_min);
        },
        py::arg("confidence"), py::arg("p_min"), py::arg("mode") = "first", py::arg("n_min") = 0,
        "Drafts kept of len(confidence) after confidence pruning (csrc/spec/prune.h): stop at the first position "
        "whose confidence (mode 'first') or running product of confidences ('cumulative') is below p_min; a "
        "result below n_min becomes 0.");
    m.def("ngram_simple_draft", &ngram_simple_draft, py::arg("history"), py::arg("n"), py::arg("m"),
          "llama-server's ngram-simple lookup (csrc/spec/ngram.h): the up to m tokens after the latest earlier "
          "occurrence of history's last n tokens; [] when there is none.");
    m.def(
        "philox4x32",
        [](const PhiloxCounter& counter, const PhiloxKey& key, int rounds) {
            if (rounds < 0 || rounds > 16) throw std::invalid_argument("rounds must be in [0, 16]");
            const PhiloxCounter out = philox4x32(counter, key, rounds);
            return py::make_tuple(out[0], out[1], out[2], out[3]);
        },
        py::arg("counter"), py::arg("key"), py::arg("rounds") = 10,
        "Philox4x32 of a counter (4 uint32) under a key (2 uint32): a tuple of 4 uint32.");
    m.def(
        "uniforms",
        [](uint64_t seed, uint32_t offset, uint32_t position, int64_t n, int stream) {
            return noise(seed, offset, position, n, stream, false);
        },
        py::arg("seed"), py::arg("offset"), py::arg("position"), py::arg("n"), py::arg("stream") = 0,
        "Uniforms strictly inside (0, 1) of elements 0..n-1 under (seed, offset, position, stream), float32.");
    m.def(
        "gumbel",
        [](uint64_t seed, uint32_t offset, uint32_t position, int64_t n, int stream) {
            return noise(seed, offset, position, n, stream, true);
        },
        py::arg("seed"), py::arg("offset"), py::arg("position"), py::arg("n"),
        py::arg("stream") = static_cast<int>(NoiseStream::Draft),
        "Gumbel noise -log(-log(u)) of the same uniforms, float32.");
    m.def(
        "gumbel_of_u01",
        [](const FloatArray& u, bool scalar) {
            if (u.ndim() != 1) throw std::invalid_argument("expected a 1-D array of uniforms");
            py::array_t<float> out(u.size());
            const size_t n = static_cast<size_t>(u.size());
            if (scalar) {
                for (size_t i = 0; i < n; ++i) out.mutable_data()[i] = gumbel_from_u01(u.data()[i]);
            } else {
                gumbel_of_uniforms(u.data(), out.mutable_data(), n);
            }
            return out;
        },
        py::arg("u"), py::arg("scalar") = false,
        "-log(-log(u)) of uniforms in (0, 1) as the noise computes it: the host's vectorised path, or "
        "with scalar=True one value at a time (the same bits).");
    m.def(
        "gumbel_max",
        [](const FloatArray& logits, float temperature, uint64_t seed, uint32_t offset, uint32_t position, int stream) {
            const float* l = row_of(logits, "logits");
            return gumbel_max(l, static_cast<int64_t>(logits.size()), temperature,
                              NoiseKey{seed, offset, position, stream_of(stream)});
        },
        py::arg("logits"), py::arg("temperature"), py::arg("seed"), py::arg("offset"), py::arg("position"),
        py::arg("stream") = static_cast<int>(NoiseStream::Draft),
        "One token drawn from softmax(logits / T) as argmax(logits / T + Gumbel noise); T = 0 is the argmax.");
    m.def(
        "proposal",
        [](const FloatArray& logits, float temperature) {
            const float* l = row_of(logits, "logits");
            py::array_t<float> out(logits.size());
            proposal_distribution(l, static_cast<int64_t>(logits.size()), temperature, out.mutable_data());
            return out;
        },
        py::arg("logits"), py::arg("temperature"),
        "The law gumbel_max draws from: softmax(logits / T), one-hot argmax at T = 0 (float32).");
    m.def(
        "processed_candidates",
        [](const py::array_t<double, py::array::c_style | py::array::forcecast>& logits, double temperature,
           int64_t top_k, double top_p, double min_p) {
            if (logits.ndim() != 1) throw std::invalid_argument("logits must be one row");
            const double* l = logits.data();
            std::vector<int32_t> ids;
            std::vector<double> probs;
            processed_candidates(l, static_cast<int64_t>(logits.size()), temperature, top_k, top_p, min_p, &ids, &probs);
            py::array_t<int32_t> ids_out(static_cast<py::ssize_t>(ids.size()));
            py::array_t<double> probs_out(static_cast<py::ssize_t>(probs.size()));
            std::copy(ids.begin(), ids.end(), ids_out.mutable_data());
            std::copy(probs.begin(), probs.end(), probs_out.mutable_data());
            return py::make_tuple(ids_out, probs_out);
        },
        py::arg("logits"), py::arg("temperature"), py::arg("top_k") = 0, py::arg("top_p") = 1.0,
        py::arg("min_p") = 0.0,
        "The target law of a logit row (float64): (kept ids int32, probabilities float64) after llama.cpp's "
        "top-k -> top-p -> min-p -> temperature (pyspec/sampling.py); the law SpecEngine verifies against.");
    m.def(
        "processed_law",
        [](const FloatArray& logits, double temperature, int64_t top_k, double top_p, double min_p) {
            const float* l = row_of(logits, "logits");
            py::array_t<float> out(logits.size());
            processed_law(l, static_cast<int64_t>(logits.size()), temperature, top_k, top_p, min_p, out.mutable_data());
            return out;
        },
        py::arg("logits"), py::arg("temperature"), py::arg("top_k") = 0, py::arg("top_p") = 1.0,
        py::arg("min_p") = 0.0, "processed_candidates as a full float32 row (zeros outside the kept ids).");
    m.def(
        "verify_greedy",
        [](const FloatArray& p_rows, const IntArray& drafts) {
            const ProbRows p = rows_of(p_rows, "p_rows", 0);
            int gamma = 0;
            const int32_t* d = drafts_of(drafts, gamma);
            return result_tuple(verify_greedy(p, d, gamma));
        },
        py::arg("p_rows"), py::arg("drafts"),
        "Greedy matching: (accepted, tokens, events); p_rows has len(drafts) + 1 rows.");
    m.def(
        "verify_rejection",
        [](const FloatArray& p_rows, const FloatArray& q_rows, const IntArray& drafts, uint64_t seed,
           uint32_t offset) { return stochastic(VerifyMethod::Rejection, p_rows, q_rows, drafts, seed, offset); },
        py::arg("p_rows"), py::arg("q_rows"), py::arg("drafts"), py::arg("seed"), py::arg("offset"),
        "Token-level rejection sampling: (accepted, tokens, events).");
    m.def(
        "verify_block",
        [](const FloatArray& p_rows, const FloatArray& q_rows, const IntArray& drafts, uint64_t seed,
           uint32_t offset) { return stochastic(VerifyMethod::Block, p_rows, q_rows, drafts, seed, offset); },
        py::arg("p_rows"), py::arg("q_rows"), py::arg("drafts"), py::arg("seed"), py::arg("offset"),
        "Block verification (Sun et al.): (accepted, tokens, events).");
    m.def(
        "candidate_law",
        [](const IntArray& ids, const FloatArray& logits, double temperature, int64_t top_k, double top_p,
           double min_p) {
            if (ids.ndim() != 1 || logits.ndim() != 1 || ids.size() != logits.size())
                throw std::invalid_argument("ids and logits must be 1-D arrays of one length");
            const SparseLaw law = candidate_law(ids.data(), logits.data(), static_cast<int64_t>(ids.size()), temperature,
                                                top_k, top_p, min_p);
            return py::make_tuple(py::array_t<int32_t>(law.ids.size(), law.ids.data()),
                                  py::array_t<float>(law.probs.size(), law.probs.data()));
        },
        py::arg("ids"), py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p") = 1.0,
        py::arg("min_p") = 0.0,
        "The law of a row from its best candidates (ids in TOP_K's order, their logits): (ids ascending int32, "
        "probabilities float32), processed_law's values at those ids.");
    m.def(
        "verify_candidates",
        [](const std::string& method, const std::vector<std::pair<std::vector<int32_t>, std::vector<float>>>& laws,
           int64_t n_vocab, const FloatArray& q_rows, const IntArray& drafts, uint64_t seed, uint32_t offset,
           const std::optional<IntArray>& q_ids) {
            std::vector<SparseLaw> p(laws.size());
            for (size_t i = 0; i < laws.size(); ++i) p[i] = SparseLaw{laws[i].first, laws[i].second};
            const ProbRows rows = rows_of(q_rows, "q_rows", q_ids ? static_cast<int64_t>(q_ids->size()) : n_vocab);
            ProposalRows q{rows.data, rows.n_rows, n_vocab, rows.n_vocab, nullptr};
            if (q_ids) {
                if (q_ids->ndim() != 1 || static_cast<int64_t>(q_ids->size()) != rows.n_vocab)
                    throw std::invalid_argument("q_ids must give one target id per q_rows column");
                const int32_t* ids = q_ids->data();
                for (int64_t d = 0; d < rows.n_vocab; ++d) {
                    if (ids[d] < 0 || ids[d] >= n_vocab || (d > 0 && ids[d] <= ids[d - 1]))
                        throw std::invalid_argument("q_ids must ascend within the vocabulary");
                }
                q.ids = ids;
            } else if (rows.n_rows > 0 && rows.n_vocab != n_vocab) {
                throw std::invalid_argument("full q rows need n_vocab columns");
            }
            int gamma = 0;
            const int32_t* d = drafts_of(drafts, gamma);
            if (method != "rejection" && method != "block") throw std::invalid_argument("method must be rejection or block");
            const VerifyMethod m = method == "block" ? VerifyMethod::Block : VerifyMethod::Rejection;
            return result_tuple(verify(m, p, n_vocab, q, d, gamma, seed, offset));
        },
        py::arg("method"), py::arg("laws"), py::arg("n_vocab"), py::arg("q_rows"), py::arg("drafts"), py::arg("seed"),
        py::arg("offset"), py::arg("q_ids") = py::none(),
        "Rejection or block verification with target rows given as candidate laws [(ids ascending, probs)] and q "
        "as full rows or (q_ids: ascending target ids of q_rows' columns) draft-vocabulary rows: "
        "(accepted, tokens, events), as verify_rejection / verify_block over the full rows.");
    m.def(
        "block_thresholds",
        [](const FloatArray& p_rows, const FloatArray& q_rows, const IntArray& drafts) {
            const ProbRows p = rows_of(p_rows, "p_rows", 0);
            const ProbRows q = rows_of(q_rows, "q_rows", p.n_vocab);
            int gamma = 0;
            const int32_t* d = drafts_of(drafts, gamma);
            const BlockThresholds th = block_thresholds(p, q, d, gamma);
            return py::make_tuple(py::array_t<double>(th.pi.size(), th.pi.data()),
                                  py::array_t<double>(th.h.size(), th.h.data()));
        },
        py::arg("p_rows"), py::arg("q_rows"), py::arg("drafts"),
        "Block verification's cumulative ratios pi_i and thresholds h_i, one per verified draft.");
}

}  // namespace pyspec
