// Gumbel noise of many uniforms at once on the host: noise_math::gumbel_of_u01, lane by lane, in
// AVX-512 (8 lanes) or AVX2 + FMA (4 lanes) where the build targets them. Every lane runs the
// scalar function's IEEE operations in its order (integer exponent split, exact float -> double
// conversion, one correctly rounded division, fused multiply-adds, the final rounding to float
// under the same round-to-nearest mode), so each value is the scalar function's bits; the two
// logarithms are most of a sampled drafter pass's noise (tests/test_cpu_ops.py checks every
// possible uniform against the scalar path).
#pragma once

#include <cstddef>

#include "runtime/noise_math.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace pyspec {
namespace noise_simd {

#if defined(__AVX512F__)
constexpr size_t kLanes = 8;

inline __m256 log_lanes(__m256 x) {
    const __m256i ix = _mm256_castps_si256(x);
    const __m256i e = _mm256_srai_epi32(_mm256_sub_epi32(ix, _mm256_set1_epi32(0x3F3504F3)), 23);
    const __m256 m = _mm256_castsi256_ps(_mm256_sub_epi32(ix, _mm256_slli_epi32(e, 23)));
    const __m512d f = _mm512_sub_pd(_mm512_cvtps_pd(m), _mm512_set1_pd(1.0));
    const __m512d s = _mm512_div_pd(f, _mm512_add_pd(_mm512_set1_pd(2.0), f));
    const __m512d z = _mm512_mul_pd(s, s);
    __m512d p = _mm512_set1_pd(1.0 / 19.0);
    p = _mm512_fmadd_pd(p, z, _mm512_set1_pd(1.0 / 17.0));
    p = _mm512_fmadd_pd(p, z, _mm512_set1_pd(1.0 / 15.0));
    p = _mm512_fmadd_pd(p, z, _mm512_set1_pd(1.0 / 13.0));
    p = _mm512_fmadd_pd(p, z, _mm512_set1_pd(1.0 / 11.0));
    p = _mm512_fmadd_pd(p, z, _mm512_set1_pd(1.0 / 9.0));
    p = _mm512_fmadd_pd(p, z, _mm512_set1_pd(1.0 / 7.0));
    p = _mm512_fmadd_pd(p, z, _mm512_set1_pd(1.0 / 5.0));
    p = _mm512_fmadd_pd(p, z, _mm512_set1_pd(1.0 / 3.0));
    const __m512d two_s = _mm512_add_pd(s, s);
    const __m512d log_m = _mm512_fmadd_pd(_mm512_mul_pd(two_s, z), p, two_s);
    return _mm512_cvtpd_ps(_mm512_fmadd_pd(_mm512_cvtepi32_pd(e), _mm512_set1_pd(0.69314718055994530942), log_m));
}

inline void gumbel_lanes(const float* u, float* out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 inner = _mm256_xor_ps(log_lanes(_mm256_loadu_ps(u)), sign);   // -log(u)
    _mm256_storeu_ps(out, _mm256_xor_ps(log_lanes(inner), sign));              // -log(-log(u))
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr size_t kLanes = 4;

inline __m128 log_lanes(__m128 x) {
    const __m128i ix = _mm_castps_si128(x);
    const __m128i e = _mm_srai_epi32(_mm_sub_epi32(ix, _mm_set1_epi32(0x3F3504F3)), 23);
    const __m128 m = _mm_castsi128_ps(_mm_sub_epi32(ix, _mm_slli_epi32(e, 23)));
    const __m256d f = _mm256_sub_pd(_mm256_cvtps_pd(m), _mm256_set1_pd(1.0));
    const __m256d s = _mm256_div_pd(f, _mm256_add_pd(_mm256_set1_pd(2.0), f));
    const __m256d z = _mm256_mul_pd(s, s);
    __m256d p = _mm256_set1_pd(1.0 / 19.0);
    p = _mm256_fmadd_pd(p, z, _mm256_set1_pd(1.0 / 17.0));
    p = _mm256_fmadd_pd(p, z, _mm256_set1_pd(1.0 / 15.0));
    p = _mm256_fmadd_pd(p, z, _mm256_set1_pd(1.0 / 13.0));
    p = _mm256_fmadd_pd(p, z, _mm256_set1_pd(1.0 / 11.0));
    p = _mm256_fmadd_pd(p, z, _mm256_set1_pd(1.0 / 9.0));
    p = _mm256_fmadd_pd(p, z, _mm256_set1_pd(1.0 / 7.0));
    p = _mm256_fmadd_pd(p, z, _mm256_set1_pd(1.0 / 5.0));
    p = _mm256_fmadd_pd(p, z, _mm256_set1_pd(1.0 / 3.0));
    const __m256d two_s = _mm256_add_pd(s, s);
    const __m256d log_m = _mm256_fmadd_pd(_mm256_mul_pd(two_s, z), p, two_s);
    return _mm256_cvtpd_ps(_mm256_fmadd_pd(_mm256_cvtepi32_pd(e), _mm256_set1_pd(0.69314718055994530942), log_m));
}

inline void gumbel_lanes(const float* u, float* out) {
    const __m128 sign = _mm_set1_ps(-0.0f);
    const __m128 inner = _mm_xor_ps(log_lanes(_mm_loadu_ps(u)), sign);
    _mm_storeu_ps(out, _mm_xor_ps(log_lanes(inner), sign));
}
#else
constexpr size_t kLanes = 1;

inline void gumbel_lanes(const float* u, float* out) { out[0] = noise_math::gumbel_of_u01(u[0]); }
#endif

// out[i] = noise_math::gumbel_of_u01(u[i]) for i < n (out may be u).
inline void gumbel_of_u01_n(const float* u, float* out, size_t n) {
    size_t i = 0;
    for (; i + kLanes <= n; i += kLanes) gumbel_lanes(u + i, out + i);
    for (; i < n; ++i) out[i] = noise_math::gumbel_of_u01(u[i]);
}

}  // namespace noise_simd
}  // namespace pyspec
