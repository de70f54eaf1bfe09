// What llama.cpp's sampler chain does to a row of logits before its filters run (the server's
// default chain: logit_bias first, then penalties, then top-k/top-p/min-p/temperature, which are
// target_law.h's processed_candidates). SpecEngine applies it per verify row with the history that row
// would have seen -- the committed tokens plus the drafts before it -- so verification keeps the
// law the request would sample from without a drafter (design invariant 6).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace pyspec {

struct LogitProcessing {
    std::vector<std::pair<int32_t, float>> logit_bias;  // added to the raw logit; -inf bans
    // llama.cpp's penalties sampler: over the last repeat_last_n tokens of the history (< 0: all
    // of it, 0: off), a token seen c > 0 times gets its logit divided by repeat_penalty (multiplied
    // when <= 0), then minus c * frequency_penalty + presence_penalty.
    int64_t repeat_last_n = 64;
    float repeat_penalty = 1.0f;
    float frequency_penalty = 0.0f;
    float presence_penalty = 0.0f;

    bool penalties_on() const {
        return repeat_last_n != 0 && (repeat_penalty != 1.0f || frequency_penalty != 0.0f || presence_penalty != 0.0f);
    }
    bool active() const { return !logit_bias.empty() || penalties_on(); }
    // The ids a -inf bias bans, when bans are all the processing does (no finite bias, no
    // penalties; empty otherwise, and when nothing is banned): greedy decoding then takes the
    // best id outside them, which needs only the graph's best bans + 1 ids (Batch::argmax_k).
    std::vector<int32_t> bans_only() const {
        std::vector<int32_t> out;
        if (penalties_on()) return {};
        for (const auto& [id, v] : logit_bias) {
            if (!(std::isinf(v) && v < 0)) return {};
            if (std::find(out.begin(), out.end(), id) == out.end()) out.push_back(id);
        }
        return out;
    }
};

// Throws std::invalid_argument for a bias token outside [0, n_vocab), a NaN or +inf bias, or a
// repeat_penalty <= 0.
void check_logit_processing(const LogitProcessing& lp, int64_t n_vocab);

// Applies lp to row (n_vocab floats) in place. history, then extra (the drafts before this row),
// are the tokens already in the sequence, oldest first.
void apply_logit_processing(const LogitProcessing& lp, const std::vector<int32_t>& history, const int32_t* extra,
                            int64_t n_extra, float* row, int64_t n_vocab);

// The top n entries of log_softmax(row) (most likely first, ties by smaller id) and the
// log-probability of `chosen`: llama-server's n_probs, taken from the raw logits.
struct TokenLogprobs {
    int32_t id = 0;
    float logprob = 0.0f;
    std::vector<std::pair<int32_t, float>> top;
};
TokenLogprobs token_logprobs(const float* row, int64_t n_vocab, int32_t chosen, int64_t n);

}  // namespace pyspec
