// Lossless verification of drafted tokens (design invariant 6) and the Gumbel-max draw the drafter
// samples with (invariant 5). The math follows docs/reference/verification.md: greedy matching
// (§1.2), token-level rejection sampling (§1.1) and block verification (Sun et al., §2).
//
// Inputs of one round: drafts x_1..x_γ, the processed target rows p_1..p_{γ+1} (p_i is the row
// the target would sample position i from, after temperature and filters) and the proposal rows
// q_1..q_γ (q_i is exactly the law x_i was drawn from). A round emits τ + 1 tokens: the τ accepted
// drafts, then a correction (after a rejection) or a bonus token (all accepted).
//
// Noise: every draw of a round is keyed by (seed, offset, slot, stream) with offset the committed
// length at the start of the round and slot j = 0..γ the output position inside the round (the
// one x_{j+1} and p_{j+1} belong to). Acceptance uniforms use NoiseStream::Accept, corrections
// NoiseStream::Correction and the bonus NoiseStream::Target, so no two consumers share noise and
// a new round (a larger offset) draws everything afresh.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/philox.h"

namespace pyspec {

// A row-major [n_rows, n_vocab] float matrix, not owned.
struct ProbRows {
    const float* data = nullptr;
    int64_t n_rows = 0;
    int64_t n_vocab = 0;
    const float* row(int64_t i) const { return data + i * n_vocab; }
};

// Proposal rows q: full rows over the target vocabulary, or (a drafter with a reduced draft
// vocabulary) each row's entries at `ids`, ascending target ids shared by every row (the
// drafter's d2t), every other token having q = 0. Not owned.
struct ProposalRows {
    const float* data = nullptr;
    int64_t n_rows = 0;
    int64_t n_vocab = 0;           // the target vocabulary
    int64_t width = 0;             // entries a row: n_vocab without ids, else the length of ids
    const int32_t* ids = nullptr;  // null: entry t is token t
    const float* row(int64_t i) const { return data + i * width; }
    float at(int64_t i, int32_t t) const;  // q_i(t)
    std::vector<float> spread() const;     // the rows as full rows [n_rows, n_vocab]
    static ProposalRows full(const ProbRows& q) { return ProposalRows{q.data, q.n_rows, q.n_vocab, q.n_vocab, nullptr}; }
};

// Events that cannot happen with consistent inputs; counted rather than hidden (§1.4, §2.4).
struct VerifyEvents {
    int64_t zero_q = 0;          // a draft whose proposal probability is 0 (stale or misprocessed q)
    int64_t empty_residual = 0;  // a correction whose residual had no mass; drawn from p instead
};

struct VerifyResult {
    int accepted = 0;             // τ, the number of drafts kept
    std::vector<int32_t> tokens;  // τ + 1 tokens: x_1..x_τ, then the correction or the bonus
    VerifyEvents events;
};

enum class VerifyMethod { Greedy, Rejection, Block };

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

// Drafts may end in padding (-1) for a ragged γ: the round then verifies only the drafts before
// the first -1, and p still carries γ + 1 rows, q γ rows. Token ids must lie in [0, n_vocab).
// Bad shapes, ids or rows (negative or non-finite probabilities, an all-zero p row) throw
// std::invalid_argument.

// T = 0: accept while x_i is the first-index argmax of p_i; emit the argmax of the first row that
// disagrees, or of p_{γ+1}. Rows may hold probabilities or logits (only the argmax matters); no
// noise is used. q is not needed.
VerifyResult verify_greedy(const ProbRows& p, const int32_t* drafts, int gamma);
// The same decision from each row's greedy token (argmax[i] = argmax_first of row i, computed
// where the logits live: the decode graph's ARGMAX), for steps that copy no logits.
VerifyResult verify_greedy_ids(const int32_t* argmax, int64_t n_vocab, const int32_t* drafts, int gamma);

// Token-level rejection sampling: accept x_i iff u_i < p_i(x_i) / q_i(x_i); on the first
// rejection draw from norm(max(0, p_i - q_i)); if all are accepted, the bonus from p_{γ+1}.
VerifyResult verify_rejection(const ProbRows& p, const ProbRows& q, const int32_t* drafts, int gamma, uint64_t seed,
                              uint32_t offset);

// Block verification (Sun et al., ICLR 2025): thresholds h_i from the cumulative ratios π_i and the
// next position's residual mass, τ = the largest i with η_i <= h_i (a full backward scan), then a
// correction from norm(max(0, π_τ p_{τ+1} - q_{τ+1})) or the bonus.
VerifyResult verify_block(const ProbRows& p, const ProbRows& q, const int32_t* drafts, int gamma, uint64_t seed,
                          uint32_t offset);

// One switch for the three rules; q is ignored by Greedy.
VerifyResult verify(VerifyMethod method, const ProbRows& p, const ProbRows& q, const int32_t* drafts, int gamma,
                    uint64_t seed, uint32_t offset);
// Rejection or block verification with candidate laws as the target rows (gamma + 1 of them):
// the same tokens and events as over the full rows processed_law gives (the same values in the
// same order: the tokens outside the candidates have p = 0, add nothing to a sum and never win a
// draw).
// q may hold its rows' entries at ids (ProposalRows): the same tokens and events again.
VerifyResult verify(VerifyMethod method, const std::vector<SparseLaw>& p, int64_t n_vocab, const ProposalRows& q,
                    const int32_t* drafts, int gamma, uint64_t seed, uint32_t offset);

// The quantities block verification decides with, one per verified draft: pi[i-1] = π_i and
// h[i-1] = h_i. Exposed so tests can hold them against exact fractions.
struct BlockThresholds {
    std::vector<double> pi;
    std::vector<double> h;
};
BlockThresholds block_thresholds(const ProbRows& p, const ProbRows& q, const int32_t* drafts, int gamma);

// The first index of the largest value; NaN throws.
int32_t argmax_first(const float* x, int64_t n);

// One draw from softmax(logits / T) by Gumbel-max: argmax(logits / T + g) with g the Gumbel noise
// of `key` (element = token id). T = 0 is the first-index argmax and uses no noise. Logits may be
// -inf (masked), not NaN or +inf.
int32_t gumbel_max(const float* logits, int64_t n, float temperature, const NoiseKey& key);

// The exact law gumbel_max draws from: softmax(logits / T) with the same float division, or the
// one-hot argmax at T = 0. out has n entries. Store this as q for the drafted token.
void proposal_distribution(const float* logits, int64_t n, float temperature, float* out);

}  // namespace pyspec
