// Lossless verification of drafted tokens (design invariant 6). The math follows docs/reference/verification.md: greedy matching
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
#include "spec/gumbel_draw.h"
#include "spec/target_law.h"

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

// Drafts may end in padding (-1) for a ragged γ: the round then verifies only the drafts before
// the first -1, and p still carries γ + 1 rows, q γ rows. Token ids must lie in [0, n_vocab).
// Bad shapes, ids or rows (negative or non-finite probabilities, an all-zero p row) throw
// std::invalid_argument.

// The token a plain sampled step (a round without drafts) draws from a row's m best candidates
// (ids in TOP_K's order, with their logits): candidate_law, then the bonus draw every sampled
// round ends with (slot 0 of {seed, offset}, NoiseStream::Target); T <= 0: ids[0]. What the
// engine's verification of such a step gives, and what the SAMPLE op computes in a graph.
int32_t draw_from_candidates(const int32_t* ids, const float* logits, int64_t m, double temperature, int64_t top_k,
                             double top_p, double min_p, uint64_t seed, uint32_t offset);

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

}  // namespace pyspec
