// The Gumbel-max draw a drafter samples with (design invariant 5) and the exact law it draws from,
// which verification takes as the proposal q.
#pragma once

#include <cstdint>

#include "runtime/philox.h"

namespace pyspec {

// One draw from softmax(logits / T) by Gumbel-max: argmax(logits / T + g) with g the Gumbel noise
// of `key` (element = token id). T = 0 is the first-index argmax and uses no noise. Logits may be
// -inf (masked), not NaN or +inf.
int32_t gumbel_max(const float* logits, int64_t n, float temperature, const NoiseKey& key);

// The exact law gumbel_max draws from: softmax(logits / T) with the same float division, or the
// one-hot argmax at T = 0. out has n entries. Store this as q for the drafted token.
void proposal_distribution(const float* logits, int64_t n, float temperature, float* out);

}  // namespace pyspec
