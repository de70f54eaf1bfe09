// The law a target row is sampled from (llama.cpp's sampling chain), over a whole row of logits or
// over the row's best candidates alone (what the graph returns in place of the row), and the
// greedy token. Verification (spec/verify.h) checks drafts against these laws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pyspec {

// The law the target samples a row from (pyspec/sampling.py, llama.cpp's chain and order):
// top-k -> top-p -> min-p -> temperature over the candidates sorted by (logit desc, id asc).
// top_k <= 0, top_p >= 1 and min_p <= 0 turn a stage off, and a stage that is off does not run, so
// with every filter off the law is softmax(logits / T) over the whole vocabulary (invariant 5).
// top-p keeps the shortest sorted prefix whose mass (softmax at temperature 1 over what top-k
// kept) reaches top_p; min-p keeps the candidates with logit >= best + log(min_p) (at least one).
// The kept logits are divided by T and softmaxed in double. T <= 0: the
// first-index argmax with probability 1. Outputs: the kept ids (sorted by logit when a filter ran,
// else id order) and their probabilities. Throws std::invalid_argument for n < 1, NaN logits or
// top_p / min_p outside [0, 1].
void processed_candidates(const double* logits, int64_t n, double temperature, int64_t top_k, double top_p,
                          double min_p, std::vector<int32_t>* ids, std::vector<double>* probs);

// processed_candidates of a float row (widened exactly to double) as a full row of n floats
// (zeros outside the kept candidates): the p row verification uses.
void processed_law(const float* logits, int64_t n, double temperature, int64_t top_k, double top_p, double min_p,
                   float* out);

// The most candidates (top_k plus banned ids) a sampled row asks the graph for in place of its
// logits; beyond it, or without top-k, the row is read whole. 64: llama.cpp's default top-k 40
// with room, and the largest k the CUDA TOP_K narrows by its filter (cuda/ops_basic.cu).
constexpr int64_t kMaxSampledCandidates = 64;

// A row's processed law over its candidates only: ids ascending, with the probabilities
// processed_law gives them; every other token has probability 0.
struct SparseLaw {
    std::vector<int32_t> ids;
    std::vector<float> probs;
};

// The law of a row from its m best candidates alone: ids in (logit desc, id asc) order (TOP_K's)
// with their logits. Whenever top_k is in [1, m] it equals processed_law of the whole row at
// those ids (top-k keeps only candidates; min-p and top-p look only at what top-k kept), and the
// processing costs m entries instead of the vocabulary. Throws std::invalid_argument otherwise.
SparseLaw candidate_law(const int32_t* ids, const float* logits, int64_t m, double temperature, int64_t top_k,
                        double top_p, double min_p);

// A row's candidates (TOP_K's ids and their logits, k of them) less TOP_K's -1 padding and the n
// banned ids, in order, into ids / logits (cleared first): what candidate_law is given.
void candidates_less_bans(const int32_t* cand, const float* values, int64_t k, const int32_t* bans, size_t n_bans,
                          std::vector<int32_t>* ids, std::vector<float>* logits);

// The first index of the largest value; NaN throws.
int32_t argmax_first(const float* x, int64_t n);

}  // namespace pyspec
