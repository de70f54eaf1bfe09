#include "spec/logit_processing.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace pyspec {

void check_logit_processing(const LogitProcessing& lp, int64_t n_vocab) {
    for (const auto& [tok, bias] : lp.logit_bias) {
        if (tok < 0 || tok >= n_vocab) {
            throw std::invalid_argument("logit_bias token id " + std::to_string(tok) + " is outside the vocabulary");
        }
        if (std::isnan(bias) || bias == INFINITY) throw std::invalid_argument("a logit_bias value must be finite or -inf");
    }
    if (!(lp.repeat_penalty > 0.0f) || !std::isfinite(lp.repeat_penalty)) {
        throw std::invalid_argument("repeat_penalty must be positive");
    }
    if (!std::isfinite(lp.frequency_penalty) || !std::isfinite(lp.presence_penalty)) {
        throw std::invalid_argument("frequency_penalty and presence_penalty must be finite");
    }
}

void apply_logit_processing(const LogitProcessing& lp, const std::vector<int32_t>& history, const int32_t* extra,
                            int64_t n_extra, float* row, int64_t n_vocab) {
    for (const auto& [tok, bias] : lp.logit_bias) row[tok] += bias;
    if (!lp.penalties_on()) return;
    const int64_t n_hist = static_cast<int64_t>(history.size()) + n_extra;
    const int64_t window = lp.repeat_last_n < 0 ? n_hist : std::min(lp.repeat_last_n, n_hist);
    // Counts over the last `window` tokens of history ++ extra.
    std::unordered_map<int32_t, int64_t> count;
    for (int64_t i = n_hist - window; i < n_hist; ++i) {
        const int32_t t = i < static_cast<int64_t>(history.size()) ? history[static_cast<size_t>(i)]
                                                                   : extra[i - static_cast<int64_t>(history.size())];
        if (t >= 0 && t < n_vocab) ++count[t];
    }
    for (const auto& [tok, c] : count) {
        float& x = row[tok];
        x = x <= 0.0f ? x * lp.repeat_penalty : x / lp.repeat_penalty;
        x -= static_cast<float>(c) * lp.frequency_penalty + lp.presence_penalty;
    }
}

TokenLogprobs token_logprobs(const float* row, int64_t n_vocab, int32_t chosen, int64_t n) {
    double mx = -INFINITY;
    for (int64_t i = 0; i < n_vocab; ++i) mx = std::max(mx, static_cast<double>(row[i]));
    double sum = 0.0;
    for (int64_t i = 0; i < n_vocab; ++i) sum += std::exp(static_cast<double>(row[i]) - mx);
    const double log_z = mx + std::log(sum);
    TokenLogprobs out;
    out.id = chosen;
    out.logprob = static_cast<float>(static_cast<double>(row[chosen]) - log_z);
    n = std::min(n, n_vocab);
    if (n <= 0) return out;
    std::vector<int32_t> ids(static_cast<size_t>(n_vocab));
    for (int64_t i = 0; i < n_vocab; ++i) ids[static_cast<size_t>(i)] = static_cast<int32_t>(i);
    std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), [row](int32_t a, int32_t b) {
        return row[a] != row[b] ? row[a] > row[b] : a < b;
    });
    for (int64_t k = 0; k < n; ++k) {
        const int32_t t = ids[static_cast<size_t>(k)];
        out.top.emplace_back(t, static_cast<float>(static_cast<double>(row[t]) - log_z));
    }
    return out;
}

}  // namespace pyspec
