// Philox4x32-10 (Salmon, Moraes, Dror, Shaw, SC'11), the counter-based generator that keys every
// random draw of a request: the draft noise, the acceptance uniforms and the correction and bonus
// draws. A draw is a pure function of (request seed, step offset, position, stream, element
// index), so it never depends on batch rows, threads or graph replay (design invariant 5).
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "runtime/noise_math.h"

namespace pyspec {

using PhiloxCounter = std::array<uint32_t, 4>;
using PhiloxKey = std::array<uint32_t, 2>;

// `rounds` rounds of Philox4x32 (runtime/noise_math.h, which the CUDA kernels share). Ten is the
// standard generator, the known-answer tests also cover seven.
inline PhiloxCounter philox4x32(PhiloxCounter c, PhiloxKey k, int rounds = 10) {
    noise_math::philox4x32(c.data(), k[0], k[1], rounds);
    return c;
}

// Random123's u01fixedpt: odd multiples of 2^-24, all exact in float, so the value lies strictly
// inside (0, 1): never 0 (log stays finite) and never 1 (a ratio >= 1 always accepts).
inline float u01_open(uint32_t x) { return noise_math::u01_open(x); }

// Gumbel(0, 1) noise from a uniform strictly inside (0, 1); finite, in [-2.81, 16.64]. Its logs
// are noise_math's, the same bits as the CUDA backend's GUMBEL op.
inline float gumbel_from_u01(float u) { return noise_math::gumbel_of_u01(u); }

// Which consumer a draw belongs to; a proposal and the residual it is resampled from must never
// share noise. Stored in the counter's last word, whose high bits stay reserved.
enum class NoiseStream : uint32_t { Target = 0, Draft = 1, Accept = 2, Correction = 3 };

// The key of one noise vector. `offset` is the step offset (the committed length at the start of
// the round; it grows every round, so block verification never reuses noise it looked at and did
// not consume); `position` names the slot sampled in that round.
struct NoiseKey {
    uint64_t seed = 0;
    uint32_t offset = 0;
    uint32_t position = 0;
    NoiseStream stream = NoiseStream::Target;
};

// Layout: key = the 64-bit seed (low word, high word); counter = (element / 4, position, offset,
// stream); element e uses output word e % 4 of its block.
inline PhiloxCounter noise_block(const NoiseKey& key, uint32_t block) {
    return philox4x32({block, key.position, key.offset, static_cast<uint32_t>(key.stream)},
                      {static_cast<uint32_t>(key.seed), static_cast<uint32_t>(key.seed >> 32)});
}

inline uint32_t noise_bits(const NoiseKey& key, uint32_t element) {
    return noise_block(key, element >> 2)[element & 3u];
}

inline float noise_uniform(const NoiseKey& key, uint32_t element) { return u01_open(noise_bits(key, element)); }

// out[0..n) = the uniforms (resp. Gumbel noise) of elements 0..n-1 under `key`.
void fill_uniforms(const NoiseKey& key, float* out, size_t n);
void fill_gumbel(const NoiseKey& key, float* out, size_t n);
// out[i] = the Gumbel noise of element ids[i] under `key` (fill_gumbel's value there), for i < n:
// a subset of a long vector (a drafter's 8k draft ids of a 49k vocabulary) without drawing the
// rest. Consecutive ids in one block share its Philox call.
void fill_gumbel_at(const NoiseKey& key, const int32_t* ids, size_t n, float* out);
// gumbel_from_u01 of n uniforms (the host's vectorised path; out may be u).
void gumbel_of_uniforms(const float* u, float* out, size_t n);

}  // namespace pyspec
