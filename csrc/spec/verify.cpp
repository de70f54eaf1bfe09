#include "spec/verify.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "cpu/vec_math.h"

namespace pyspec {

float ProposalRows::at(int64_t i, int32_t t) const {
    const float* r = row(i);
    if (!ids) return r[t];
    const int32_t* it = std::lower_bound(ids, ids + width, t);
    return it != ids + width && *it == t ? r[it - ids] : 0.0f;
}

std::vector<float> ProposalRows::spread() const {
    if (!ids) return std::vector<float>(data, data + n_rows * width);
    std::vector<float> full(static_cast<size_t>(n_rows * n_vocab), 0.0f);
    for (int64_t i = 0; i < n_rows; ++i) {
        for (int64_t d = 0; d < width; ++d) full[static_cast<size_t>(i * n_vocab + ids[d])] = row(i)[d];
    }
    return full;
}

namespace {

// Checks the shapes and the drafts; returns how many drafts come before the padding (-1).
int checked_draft_count(int64_t p_rows, int64_t n_vocab, const ProposalRows* q, const int32_t* drafts, int gamma) {
    if (gamma < 0) throw std::invalid_argument("the number of drafts must be >= 0");
    if (n_vocab < 1) throw std::invalid_argument("target rows need at least one token");
    if (p_rows != gamma + 1)
        throw std::invalid_argument("expected " + std::to_string(gamma + 1) + " target rows for " +
                                    std::to_string(gamma) + " drafts, got " + std::to_string(p_rows));
    if (q) {
        if (q->n_rows != gamma)
            throw std::invalid_argument("expected " + std::to_string(gamma) + " proposal rows for " +
                                        std::to_string(gamma) + " drafts, got " + std::to_string(q->n_rows));
        if (q->n_vocab != n_vocab)
            throw std::invalid_argument("proposal rows have " + std::to_string(q->n_vocab) + " tokens, target rows " +
                                        std::to_string(n_vocab));
    }
    int n_valid = gamma;
    for (int i = 0; i < gamma; ++i) {
        const int32_t x = drafts[i];
        if (x == -1) {
            if (n_valid == gamma) n_valid = i;
            continue;
        }
        if (x < 0 || x >= n_vocab)
            throw std::invalid_argument("draft " + std::to_string(i) + " is token " + std::to_string(x) +
                                        ", outside [0, " + std::to_string(n_vocab) + ")");
        if (n_valid != gamma)
            throw std::invalid_argument("draft " + std::to_string(i) + " follows padding (-1); pad only at the end");
    }
    return n_valid;
}

void check_prob_row(const float* row, int64_t n, const char* what, int64_t index, bool need_mass) {
    // Entries finite and >= 0 have mass iff one is positive; flags rather than a running sum keep
    // the scan free of a chain from entry to entry (a 49k-entry row is checked every round).
    bool mass = false;
    const bool bad = !vec::all_finite_nonnegative(row, n, &mass);
    for (int64_t t = 0; bad && t < n; ++t) {
        if (!(row[t] >= 0.0f) || !std::isfinite(row[t]))
            throw std::invalid_argument(std::string(what) + " row " + std::to_string(index) + " has entry " +
                                        std::to_string(row[t]) + " at token " + std::to_string(t) +
                                        "; probabilities must be finite and >= 0");
    }
    if (need_mass && !mass)
        throw std::invalid_argument(std::string(what) + " row " + std::to_string(index) + " has no probability mass");
}


// A draw from the unnormalised weights w(t) = max(0, scale * p(t) - q(t)) (w = p when q is null)
// by the exponential race argmax w(t) / E(t), E(t) = -log u(t): it samples w / sum(w) exactly and
// needs no normalisation. Ties go to the smallest token. Returns -1 when every weight is 0.
//
// The race is decided by a few tokens, so most are ruled out without their log, and most without
// their noise: u < 1 gives E > 1 - u, so w / E < w / (1 - u), and u <= 1 - 2^-24 (u01_open) gives
// w / (1 - u) <= 2^24 w <= 2^24 p_scale p. A token whose bound is below the best value so far
// cannot win (strictly below, with a relative margin far above double rounding and far below the
// gap between E and 1 - u, so no tie is skipped either), so only tokens whose p clears
// best / (2^24 p_scale) are visited, found by a vector search, and of those only the ones whose
// w / (1 - u) clears it take a log. The race starts from the token of the largest p (its value is
// exact; the scan keeps the smallest-token tie rule), so the bar is high from the start. Same
// tokens as the plain race over every token, several times faster on a 49k vocabulary at
// temperature only (bench/bench_sampling.py).
int32_t sample_weights(const float* p, const float* q, double scale, int64_t n, const NoiseKey& key) {
    constexpr double kSlack = 1.0 + 1e-9;     // >> double rounding of the bounds, << E / (1 - u) - 1 >= 2^-25
    constexpr double kMaxBound = 16777216.0;  // 1 / (1 - the largest u) = 2^24
    const double p_scale = q ? scale : 1.0;   // w <= p_scale * p: q >= 0 (checked rows)
    if (!(p_scale > 0.0)) return -1;          // no weight is positive
    auto weight = [&](int64_t t) { return q ? scale * p[t] - q[t] : static_cast<double>(p[t]); };
    auto noise = [&](int64_t t) { return u01_open(noise_block(key, static_cast<uint32_t>(t >> 2))[t & 3]); };
    int32_t best = -1;
    double best_val = 0.0;
    const int64_t seed_t = vec::first_index_of(p, n, vec::max_of(p, n));  // the largest p's token
    if (seed_t >= 0 && weight(seed_t) > 0.0) {
        best = static_cast<int32_t>(seed_t);
        best_val = weight(seed_t) / -std::log(static_cast<double>(noise(seed_t)));
    }
    // Tokens with p at or below `bar` cannot win; it is rounded down to a float (a few more
    // visited, none skipped that could win).
    auto bar = [&] {
        return best < 0 ? 0.0f : static_cast<float>(best_val / (p_scale * kMaxBound * kSlack) * (1.0 - 1e-6));
    };
    float floor = bar();
    for (int64_t base = 0; base < n; base += 4) {
        // Token t's noise is word t % 4 of block t / 4, drawn only for blocks holding a token
        // above the bar; the same values as drawing every block.
        base = vec::first_above(p + base, n - base, floor) + base;
        if (base >= n) break;
        base &= ~int64_t{3};
        const int m = static_cast<int>(std::min<int64_t>(4, n - base));
        const PhiloxCounter block = noise_block(key, static_cast<uint32_t>(base >> 2));
        for (int j = 0; j < m; ++j) {
            const int64_t t = base + j;
            const double w = weight(t);
            if (!(w > 0.0) || t == seed_t) continue;
            const float u = u01_open(block[j]);
            if (best >= 0 && w / (1.0 - static_cast<double>(u)) * kSlack < best_val) continue;
            const double val = w / -std::log(static_cast<double>(u));
            if (best < 0 || val > best_val || (val == best_val && t < best)) {
                best = static_cast<int32_t>(t);
                best_val = val;
                floor = bar();
            }
        }
    }
    return best;
}

NoiseKey slot_key(uint64_t seed, uint32_t offset, int slot, NoiseStream stream) {
    return NoiseKey{seed, offset, static_cast<uint32_t>(slot), stream};
}

// The same race as sample_weights over a sparse row: its candidates in ascending id order, every
// other token having p = 0 and so no positive weight (q >= 0). Each visited token's value is the
// same double as the full row's race computes, so the winner, ties included, is the same token.
int32_t sample_weights_sparse(const SparseLaw& p, const ProposalRows* q, int64_t qi, double scale, const NoiseKey& key) {
    int32_t best = -1;
    double best_val = 0.0;
    for (size_t c = 0; c < p.ids.size(); ++c) {
        const int32_t t = p.ids[c];
        const double w = q ? scale * p.probs[c] - q->at(qi, t) : static_cast<double>(p.probs[c]);
        if (!(w > 0.0)) continue;
        const float u = u01_open(noise_block(key, static_cast<uint32_t>(t >> 2))[t & 3]);
        const double val = w / -std::log(static_cast<double>(u));
        if (best < 0 || val > best_val || (val == best_val && t < best)) {
            best = t;
            best_val = val;
        }
    }
    return best;
}

// The target rows a stochastic verifier reads, full rows (ProbRows) or candidate lists
// (SparseLaw): one verification written once over either. prob(i, t) is p_i(t) as the float it
// is stored as; residual(i, s, q) is Σ_t max(0, s p_i(t) - q(t)) in ascending t.
struct DenseTarget {
    const ProbRows& p;
    int64_t n_rows() const { return p.n_rows; }
    int64_t n_vocab() const { return p.n_vocab; }
    float prob(int i, int32_t t) const { return p.row(i)[t]; }
    void check(int i) const { check_prob_row(p.row(i), p.n_vocab, "target", i, true); }
    // Full rows meet full proposal rows only (the engine spreads a drafter's rows out first).
    static const float* full_row(const ProposalRows& q, int i) {
        if (q.ids) throw std::logic_error("full target rows need full proposal rows");
        return q.row(i);
    }
    int32_t draw(int i, const ProposalRows* q, double scale, const NoiseKey& key) const {
        return sample_weights(p.row(i), q ? full_row(*q, i) : nullptr, scale, p.n_vocab, key);
    }
    double residual(int i, double s, const ProposalRows& q) const {
        const float* pi = p.row(i);
        const float* qi = full_row(q, i);
        double z = 0.0;
        for (int64_t t = 0; t < p.n_vocab; ++t) z += std::max(0.0, s * pi[t] - qi[t]);
        return z;
    }
};

// Tokens outside a row's candidates add max(0, -q(t)) = +0 to a residual, which leaves the sum's
// bits alone, so summing over the candidates in ascending order gives the full row's sum.
struct SparseTarget {
    const std::vector<SparseLaw>& p;
    int64_t vocab;
    int64_t n_rows() const { return static_cast<int64_t>(p.size()); }
    int64_t n_vocab() const { return vocab; }
    float prob(int i, int32_t t) const {
        const SparseLaw& r = p[static_cast<size_t>(i)];
        const auto it = std::lower_bound(r.ids.begin(), r.ids.end(), t);
        return it != r.ids.end() && *it == t ? r.probs[static_cast<size_t>(it - r.ids.begin())] : 0.0f;
    }
    void check(int i) const {
        const SparseLaw& r = p[static_cast<size_t>(i)];
        const std::string row = "target row " + std::to_string(i);
        if (r.ids.size() != r.probs.size()) throw std::invalid_argument(row + " has as many ids as probabilities");
        bool mass = false;
        for (size_t c = 0; c < r.ids.size(); ++c) {
            if (r.ids[c] < 0 || r.ids[c] >= vocab || (c > 0 && r.ids[c] <= r.ids[c - 1]))
                throw std::invalid_argument(row + ": candidate ids must ascend within [0, " + std::to_string(vocab) + ")");
            if (!(r.probs[c] >= 0.0f) || !std::isfinite(r.probs[c]))
                throw std::invalid_argument(row + " has entry " + std::to_string(r.probs[c]) + " at token " +
                                            std::to_string(r.ids[c]) + "; probabilities must be finite and >= 0");
            mass |= r.probs[c] > 0.0f;
        }
        if (!mass) throw std::invalid_argument(row + " has no probability mass");
    }
    int32_t draw(int i, const ProposalRows* q, double scale, const NoiseKey& key) const {
        return sample_weights_sparse(p[static_cast<size_t>(i)], q, i, scale, key);
    }
    double residual(int i, double s, const ProposalRows& q) const {
        const SparseLaw& r = p[static_cast<size_t>(i)];
        double z = 0.0;
        for (size_t c = 0; c < r.ids.size(); ++c) z += std::max(0.0, s * r.probs[c] - q.at(i, r.ids[c]));
        return z;
    }
};

// The rows a stochastic verifier reads: p_1..p_{n+1} and q_1..q_n for n verified drafts.
template <typename Target>
void check_prob_rows(const Target& p, const ProposalRows& q, int n_valid) {
    for (int i = 0; i <= n_valid; ++i) p.check(i);
    for (int i = 0; i < n_valid; ++i) check_prob_row(q.row(i), q.width, "proposal", i, false);
}

// The bonus after all n drafts were accepted: a draw from p_{n+1}.
template <typename Target>
int32_t draw_bonus(const Target& p, int n, uint64_t seed, uint32_t offset) {
    return p.draw(n, nullptr, 1.0, slot_key(seed, offset, n, NoiseStream::Target));
}

// The correction at slot `slot` from max(0, scale * p - q); an empty residual (unreachable in exact
// arithmetic) falls back to p and is counted.
template <typename Target>
int32_t draw_correction(const Target& p, const ProposalRows& q, int slot, double scale, uint64_t seed, uint32_t offset,
                        VerifyEvents& events) {
    const NoiseKey key = slot_key(seed, offset, slot, NoiseStream::Correction);
    const int32_t y = p.draw(slot, &q, scale, key);
    if (y >= 0) return y;
    ++events.empty_residual;
    return p.draw(slot, nullptr, 1.0, key);
}

// π_1..π_n and h_1..h_n of block verification for n verified drafts.
template <typename Target>
BlockThresholds thresholds(const Target& p, const ProposalRows& q, const int32_t* drafts, int n, VerifyEvents& events) {
    BlockThresholds th;
    th.pi.resize(n);
    th.h.resize(n);
    // Step 1: π_i = min(1, π_{i-1} p_i(x_i) / q_i(x_i)). A zero π stays zero (no 0 * inf); q = 0
    // with p > 0 counts as an unbounded ratio, the limit of the rule.
    double pi = 1.0;
    for (int i = 0; i < n; ++i) {
        const double px = p.prob(i, drafts[i]);
        const double qx = q.at(i, drafts[i]);
        if (qx == 0.0) ++events.zero_q;
        if (pi > 0.0) pi = px == 0.0 ? 0.0 : (qx == 0.0 ? 1.0 : std::min(1.0, pi * px / qx));
        th.pi[i] = pi;
    }
    // Steps 2-3: h_i = Z_{i+1} / (Z_{i+1} + 1 - π_i) with Z_{i+1} = Σ max(0, π_i p_{i+1} - q_{i+1}), the
    // residual mass of the NEXT position: the rows conditioned on x_≤i, not the rows x_i came from.
    // With 0-based j = i - 1 below, π_i is th.pi[j] and those rows are row j + 1. h_n = π_n. A 0/0
    // gives h = 0, so the scan never stops where the residual is empty.
    for (int j = 0; j + 1 < n; ++j) {
        const double z = p.residual(j + 1, th.pi[j], q);
        const double denom = z + (1.0 - th.pi[j]);
        th.h[j] = denom > 0.0 ? std::min(1.0, z / denom) : 0.0;
    }
    if (n > 0) th.h[n - 1] = th.pi[n - 1];
    return th;
}

// Greedy acceptance over the target's tokens target(0), target(1), ...: the leading drafts equal
// to them, then the target's own token (the bonus token when every draft was accepted).
template <typename TargetToken>
VerifyResult accept_greedy(int n, const int32_t* drafts, TargetToken target) {
    VerifyResult r;
    for (int i = 0; i <= n; ++i) {
        const int32_t a = target(i);
        r.tokens.push_back(a);
        if (i == n || drafts[i] != a) break;
        ++r.accepted;
    }
    return r;
}

}  // namespace

VerifyResult verify_greedy(const ProbRows& p, const int32_t* drafts, int gamma) {
    const int n = checked_draft_count(p.n_rows, p.n_vocab, nullptr, drafts, gamma);
    return accept_greedy(n, drafts, [&p](int i) { return argmax_first(p.row(i), p.n_vocab); });
}

VerifyResult verify_greedy_ids(const int32_t* argmax, int64_t n_vocab, const int32_t* drafts, int gamma) {
    const int n = checked_draft_count(gamma + 1, n_vocab, nullptr, drafts, gamma);
    for (int i = 0; i <= n; ++i) {
        if (argmax[i] < 0 || argmax[i] >= n_vocab)
            throw std::invalid_argument("target token " + std::to_string(argmax[i]) + " outside the vocabulary");
    }
    return accept_greedy(n, drafts, [argmax](int i) { return argmax[i]; });
}

namespace {

// Token-level rejection and block verification over either kind of target rows.
template <typename Target>
VerifyResult rejection(const Target& p, const ProposalRows& q, const int32_t* drafts, int gamma, uint64_t seed,
                       uint32_t offset) {
    const int n = checked_draft_count(p.n_rows(), p.n_vocab(), &q, drafts, gamma);
    check_prob_rows(p, q, n);
    VerifyResult r;
    for (int i = 0; i < n; ++i) {
        const int32_t x = drafts[i];
        const float px = p.prob(i, x);
        const float qx = q.at(i, x);
        if (qx == 0.0f) ++r.events.zero_q;
        // u < p/q without a division: u and q carry 24-bit mantissas, so u * q is exact in double.
        // q = 0 accepts iff p > 0, the limit of the rule; u < 1 makes a ratio >= 1 always accept.
        const float u = noise_uniform(slot_key(seed, offset, i, NoiseStream::Accept), 0);
        if (static_cast<double>(u) * qx < static_cast<double>(px)) {
            r.tokens.push_back(x);
            ++r.accepted;
            continue;
        }
        r.tokens.push_back(draw_correction(p, q, i, 1.0, seed, offset, r.events));
        return r;
    }
    r.tokens.push_back(draw_bonus(p, n, seed, offset));
    return r;
}

template <typename Target>
VerifyResult block(const Target& p, const ProposalRows& q, const int32_t* drafts, int gamma, uint64_t seed,
                   uint32_t offset) {
    const int n = checked_draft_count(p.n_rows(), p.n_vocab(), &q, drafts, gamma);
    check_prob_rows(p, q, n);
    VerifyResult r;
    const BlockThresholds th = thresholds(p, q, drafts, n, r.events);
    // Step 4: τ = max{i : η_i <= h_i}, scanning every position from the back. Stopping at the first
    // failure instead is a different, lossy rule (reference §2.3 item 5).
    int tau = 0;
    for (int i = n; i >= 1; --i) {
        const float eta = noise_uniform(slot_key(seed, offset, i - 1, NoiseStream::Accept), 0);
        if (eta <= th.h[i - 1]) {
            tau = i;
            break;
        }
    }
    r.accepted = tau;
    r.tokens.assign(drafts, drafts + tau);
    // Step 5: the bonus, or the correction from the π_τ-scaled residual at slot τ (π_0 = 1).
    if (tau == n) {
        r.tokens.push_back(draw_bonus(p, n, seed, offset));
    } else {
        const double pi_tau = tau == 0 ? 1.0 : th.pi[tau - 1];
        r.tokens.push_back(draw_correction(p, q, tau, pi_tau, seed, offset, r.events));
    }
    return r;
}

template <typename Target>
VerifyResult verify_sampled(VerifyMethod method, const Target& p, const ProposalRows& q, const int32_t* drafts, int gamma,
                            uint64_t seed, uint32_t offset) {
    switch (method) {
        case VerifyMethod::Rejection:
            return rejection(p, q, drafts, gamma, seed, offset);
        case VerifyMethod::Block:
            return block(p, q, drafts, gamma, seed, offset);
        case VerifyMethod::Greedy:
            break;
    }
    throw std::invalid_argument("unknown verification method");
}

}  // namespace

VerifyResult verify_rejection(const ProbRows& p, const ProbRows& q, const int32_t* drafts, int gamma, uint64_t seed,
                              uint32_t offset) {
    return rejection(DenseTarget{p}, ProposalRows::full(q), drafts, gamma, seed, offset);
}

BlockThresholds block_thresholds(const ProbRows& p, const ProbRows& q, const int32_t* drafts, int gamma) {
    const ProposalRows qr = ProposalRows::full(q);
    const int n = checked_draft_count(p.n_rows, p.n_vocab, &qr, drafts, gamma);
    const DenseTarget target{p};
    check_prob_rows(target, qr, n);
    VerifyEvents events;
    return thresholds(target, qr, drafts, n, events);
}

VerifyResult verify_block(const ProbRows& p, const ProbRows& q, const int32_t* drafts, int gamma, uint64_t seed,
                          uint32_t offset) {
    return block(DenseTarget{p}, ProposalRows::full(q), drafts, gamma, seed, offset);
}

int32_t draw_from_candidates(const int32_t* ids, const float* logits, int64_t m, double temperature, int64_t top_k,
                             double top_p, double min_p, uint64_t seed, uint32_t offset) {
    if (m < 1) throw std::invalid_argument("a draw from no candidates");
    if (temperature <= 0.0) return ids[0];
    const std::vector<SparseLaw> law{candidate_law(ids, logits, m, temperature, top_k, top_p, min_p)};
    // The vocabulary bound only checks ids: the candidates' own.
    const int64_t vocab = static_cast<int64_t>(*std::max_element(law[0].ids.begin(), law[0].ids.end())) + 1;
    const SparseTarget target{law, vocab};
    target.check(0);
    return draw_bonus(target, 0, seed, offset);
}

VerifyResult verify(VerifyMethod method, const std::vector<SparseLaw>& p, int64_t n_vocab, const ProposalRows& q,
                    const int32_t* drafts, int gamma, uint64_t seed, uint32_t offset) {
    if (method == VerifyMethod::Greedy) throw std::invalid_argument("candidate laws are verified by rejection or block");
    return verify_sampled(method, SparseTarget{p, n_vocab}, q, drafts, gamma, seed, offset);
}

VerifyResult verify(VerifyMethod method, const ProbRows& p, const ProbRows& q, const int32_t* drafts, int gamma,
                    uint64_t seed, uint32_t offset) {
    if (method == VerifyMethod::Greedy) return verify_greedy(p, drafts, gamma);
    return verify_sampled(method, DenseTarget{p}, ProposalRows::full(q), drafts, gamma, seed, offset);
}

}  // namespace pyspec
