#include "spec/gumbel_draw.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "spec/target_law.h"

namespace pyspec {

namespace {

float scaled_logit(float logit, float temperature) { return logit / temperature; }

void check_temperature(float temperature) {
    if (!std::isfinite(temperature) || temperature < 0.0f)
        throw std::invalid_argument("temperature must be finite and >= 0, got " + std::to_string(temperature));
}

}  // namespace

int32_t gumbel_max(const float* logits, int64_t n, float temperature, const NoiseKey& key) {
    check_temperature(temperature);
    if (n < 1) throw std::invalid_argument("gumbel_max over an empty row");
    if (temperature == 0.0f) return argmax_first(logits, n);
    int32_t best = -1;
    float best_val = 0.0f;
    for (int64_t base = 0; base < n; base += 4) {
        // The block's noise only where one of its logits is finite (as sample_weights, spec/verify.cpp).
        const int m = static_cast<int>(std::min<int64_t>(4, n - base));
        bool any = false;
        for (int j = 0; j < m; ++j) {
            const float l = logits[base + j];
            if (std::isnan(l) || l == std::numeric_limits<float>::infinity())
                throw std::invalid_argument("logit " + std::to_string(l) + " at token " + std::to_string(base + j) +
                                            "; logits must be finite or -inf");
            any |= l != -std::numeric_limits<float>::infinity();
        }
        if (!any) continue;
        const PhiloxCounter block = noise_block(key, static_cast<uint32_t>(base >> 2));
        for (int j = 0; j < m; ++j) {
            const int64_t t = base + j;
            const float l = logits[t];
            if (l == -std::numeric_limits<float>::infinity()) continue;
            const float z = scaled_logit(l, temperature);
            if (!std::isfinite(z))
                throw std::invalid_argument("logits / temperature overflows at token " + std::to_string(t));
            const float val = z + gumbel_from_u01(u01_open(block[j]));
            if (best < 0 || val > best_val) {
                best = static_cast<int32_t>(t);
                best_val = val;
            }
        }
    }
    if (best < 0) throw std::invalid_argument("every logit is -inf");
    return best;
}

void proposal_distribution(const float* logits, int64_t n, float temperature, float* out) {
    check_temperature(temperature);
    const int32_t top = argmax_first(logits, n);
    if (logits[top] == std::numeric_limits<float>::infinity())
        throw std::invalid_argument("logit +inf at token " + std::to_string(top) + "; logits must be finite or -inf");
    if (logits[top] == -std::numeric_limits<float>::infinity()) throw std::invalid_argument("every logit is -inf");
    if (temperature == 0.0f) {
        std::fill(out, out + n, 0.0f);
        out[top] = 1.0f;
        return;
    }
    // The same float z = logit / T that gumbel_max perturbs; the normalisation runs in double.
    const double z_max = scaled_logit(logits[top], temperature);
    if (!std::isfinite(z_max))
        throw std::invalid_argument("logits / temperature overflows at token " + std::to_string(top));
    double sum = 0.0;
    for (int64_t t = 0; t < n; ++t) sum += std::exp(static_cast<double>(scaled_logit(logits[t], temperature)) - z_max);
    for (int64_t t = 0; t < n; ++t)
        out[t] = static_cast<float>(std::exp(static_cast<double>(scaled_logit(logits[t], temperature)) - z_max) / sum);
}

}  // namespace pyspec
