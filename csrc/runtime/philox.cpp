#include "runtime/philox.h"

#include <stdexcept>

#include "runtime/noise_simd.h"

namespace pyspec {

namespace {

// Element indices are 32-bit counter words times four; a longer vector would wrap onto itself.
constexpr size_t kMaxNoiseElements = size_t{1} << 34;

template <typename Convert>
void fill_noise(const NoiseKey& key, float* out, size_t n, Convert convert) {
    if (n > kMaxNoiseElements) throw std::invalid_argument("noise vector longer than 2^34 elements");
    for (size_t base = 0; base < n; base += 4) {
        const PhiloxCounter block = noise_block(key, static_cast<uint32_t>(base >> 2));
        for (size_t j = 0; j < 4 && base + j < n; ++j) out[base + j] = convert(u01_open(block[j]));
    }
}

}  // namespace

void fill_uniforms(const NoiseKey& key, float* out, size_t n) {
    fill_noise(key, out, n, [](float u) { return u; });
}

// The uniforms first, then their logarithms many lanes at a time (runtime/noise_simd.h: the
// scalar gumbel_from_u01's bits).
void fill_gumbel(const NoiseKey& key, float* out, size_t n) {
    fill_uniforms(key, out, n);
    noise_simd::gumbel_of_u01_n(out, out, n);
}

void fill_gumbel_at(const NoiseKey& key, const int32_t* ids, size_t n, float* out) {
    PhiloxCounter block{};
    int64_t have = -1;  // the block index `block` holds
    for (size_t i = 0; i < n; ++i) {
        if (ids[i] < 0) throw std::invalid_argument("fill_gumbel_at: negative element index");
        const int64_t b = ids[i] >> 2;
        if (b != have) {
            block = noise_block(key, static_cast<uint32_t>(b));
            have = b;
        }
        out[i] = u01_open(block[static_cast<size_t>(ids[i] & 3)]);
    }
    noise_simd::gumbel_of_u01_n(out, out, n);
}

void gumbel_of_uniforms(const float* u, float* out, size_t n) { noise_simd::gumbel_of_u01_n(u, out, n); }

}  // namespace pyspec
