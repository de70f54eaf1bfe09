// The arithmetic of a noise value, shared by the host (runtime/philox.h) and the CUDA backend's
// GUMBEL kernel, so that a draw is the same bits wherever it is computed (design invariant 5;
// the "Gumbel-max kernels whose draws equal the CPU's"): integer Philox, and a logarithm
// built from IEEE double operations alone (explicit fma, one correctly rounded division), never a
// math library's log, whose last bit differs between libm and CUDA.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define PYSPEC_HD __host__ __device__ __forceinline__
#else
#define PYSPEC_HD inline
#endif

namespace pyspec {
namespace noise_math {

// `rounds` rounds of Philox4x32 (Salmon et al., SC'11) of counter c under key (k0, k1), in place;
// round r uses key + r * Weyl. Ten is the standard generator.
PYSPEC_HD void philox4x32(uint32_t c[4], uint32_t k0, uint32_t k1, int rounds = 10) {
    for (int r = 0; r < rounds; ++r) {
        if (r > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const uint64_t prod0 = static_cast<uint64_t>(0xD2511F53u) * c[0];
        const uint64_t prod1 = static_cast<uint64_t>(0xCD9E8D57u) * c[2];
        const uint32_t c1 = c[1], c3 = c[3];
        c[0] = static_cast<uint32_t>(prod1 >> 32) ^ c1 ^ k0;
        c[1] = static_cast<uint32_t>(prod1);
        c[2] = static_cast<uint32_t>(prod0 >> 32) ^ c3 ^ k1;
        c[3] = static_cast<uint32_t>(prod0);
    }
}

// Random123's u01fixedpt: odd multiples of 2^-24, strictly inside (0, 1).
PYSPEC_HD float u01_open(uint32_t x) { return static_cast<float>((x >> 8) | 1u) * 0x1p-24f; }

PYSPEC_HD uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    return u;
#endif
}

PYSPEC_HD float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
#endif
}

// log(x) for a positive normal float, rounded to float: x = 2^e m with m in [sqrt(1/2), sqrt(2)),
// log(m) = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.172, by its odd series to s^19 in double
// (truncation ~1e-14 relative, far below a float's rounding, so the result is the correctly
// rounded log except within ~1e-14 of a rounding boundary). Every step is an IEEE operation
// written out (fma where a product is added), so a compiler's contraction cannot change it.
PYSPEC_HD float noise_log(float x) {
    const uint32_t ix = float_bits(x);
    const int32_t e = static_cast<int32_t>(ix - 0x3F3504F3u) >> 23;  // 0x3F3504F3: sqrt(1/2)
    const float m = bits_float(ix - (static_cast<uint32_t>(e) << 23));
    const double f = static_cast<double>(m) - 1.0;                   // exact
    const double s = f / (2.0 + f);
    const double z = s * s;
    double p = 1.0 / 19.0;
    p = fma(p, z, 1.0 / 17.0);
    p = fma(p, z, 1.0 / 15.0);
    p = fma(p, z, 1.0 / 13.0);
    p = fma(p, z, 1.0 / 11.0);
    p = fma(p, z, 1.0 / 9.0);
    p = fma(p, z, 1.0 / 7.0);
    p = fma(p, z, 1.0 / 5.0);
    p = fma(p, z, 1.0 / 3.0);
    const double two_s = s + s;
    const double log_m = fma(two_s * z, p, two_s);                   // 2s (1 + z p)
    return static_cast<float>(fma(static_cast<double>(e), 0.69314718055994530942, log_m));
}

// Gumbel(0, 1) noise from a uniform strictly inside (0, 1); finite, in [-2.81, 16.64].
PYSPEC_HD float gumbel_of_u01(float u) { return -noise_log(-noise_log(u)); }

}  // namespace noise_math
}  // namespace pyspec
