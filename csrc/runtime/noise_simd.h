// Gumbel noise of many uniforms at once on the host: noise_math::gumbel_of_u01, lane by lane, in
// AVX-512 (8 lanes) or AVX2 + FMA (4 lanes) where the build targets them. Every lane runs the
// scalar function's IEEE operations in its order (integer exponent split, exact float -> double
// conversion, one correctly rounded division, fused multiply-adds, the final rounding to float
// under the same round-to-nearest mode), so each value is the scalar function's bits; the two
// logarithms are most of a sampled drafter pass's noise (tests/test_cpu_ops.py checks every
// possible uniform against the scalar path).
#pragma once

#include <cstddef>
#include <cstdint>

#include "runtime/noise_math.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace pyspec {
namespace noise_simd {

// The lanes' operations, one set per instruction width: F floats, I their int32 bits, D doubles.
#if defined(__AVX512F__)
struct Lanes {
    static constexpr size_t n = 8;
    using F = __m256;
    using I = __m256i;
    using D = __m512d;
    static F load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
    static F negate(F x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)); }
    static I bits(F x) { return _mm256_castps_si256(x); }
    static F from_bits(I x) { return _mm256_castsi256_ps(x); }
    static I sub_i(I a, I b) { return _mm256_sub_epi32(a, b); }
    static I set_i(int32_t v) { return _mm256_set1_epi32(v); }
    static I sra_23(I x) { return _mm256_srai_epi32(x, 23); }
    static I sll_23(I x) { return _mm256_slli_epi32(x, 23); }
    static D widen(F x) { return _mm512_cvtps_pd(x); }
    static D from_int(I x) { return _mm512_cvtepi32_pd(x); }
    static F narrow(D x) { return _mm512_cvtpd_ps(x); }
    static D set(double v) { return _mm512_set1_pd(v); }
    static D add(D a, D b) { return _mm512_add_pd(a, b); }
    static D sub(D a, D b) { return _mm512_sub_pd(a, b); }
    static D mul(D a, D b) { return _mm512_mul_pd(a, b); }
    static D div(D a, D b) { return _mm512_div_pd(a, b); }
    static D fma(D a, D b, D c) { return _mm512_fmadd_pd(a, b, c); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Lanes {
    static constexpr size_t n = 4;
    using F = __m128;
    using I = __m128i;
    using D = __m256d;
    static F load(const float* p) { return _mm_loadu_ps(p); }
    static void store(float* p, F x) { _mm_storeu_ps(p, x); }
    static F negate(F x) { return _mm_xor_ps(x, _mm_set1_ps(-0.0f)); }
    static I bits(F x) { return _mm_castps_si128(x); }
    static F from_bits(I x) { return _mm_castsi128_ps(x); }
    static I sub_i(I a, I b) { return _mm_sub_epi32(a, b); }
    static I set_i(int32_t v) { return _mm_set1_epi32(v); }
    static I sra_23(I x) { return _mm_srai_epi32(x, 23); }
    static I sll_23(I x) { return _mm_slli_epi32(x, 23); }
    static D widen(F x) { return _mm256_cvtps_pd(x); }
    static D from_int(I x) { return _mm256_cvtepi32_pd(x); }
    static F narrow(D x) { return _mm256_cvtpd_ps(x); }
    static D set(double v) { return _mm256_set1_pd(v); }
    static D add(D a, D b) { return _mm256_add_pd(a, b); }
    static D sub(D a, D b) { return _mm256_sub_pd(a, b); }
    static D mul(D a, D b) { return _mm256_mul_pd(a, b); }
    static D div(D a, D b) { return _mm256_div_pd(a, b); }
    static D fma(D a, D b, D c) { return _mm256_fmadd_pd(a, b, c); }
};
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
constexpr size_t kLanes = Lanes::n;

// noise_math::noise_log, lane by lane (its steps, in its order).
inline Lanes::F log_lanes(Lanes::F x) {
    using L = Lanes;
    const L::I ix = L::bits(x);
    const L::I e = L::sra_23(L::sub_i(ix, L::set_i(0x3F3504F3)));
    const L::F m = L::from_bits(L::sub_i(ix, L::sll_23(e)));
    const L::D f = L::sub(L::widen(m), L::set(1.0));
    const L::D s = L::div(f, L::add(L::set(2.0), f));
    const L::D z = L::mul(s, s);
    static constexpr double kSeries[] = {1.0 / 17.0, 1.0 / 15.0, 1.0 / 13.0, 1.0 / 11.0,
                                         1.0 / 9.0,  1.0 / 7.0,  1.0 / 5.0,  1.0 / 3.0};
    L::D p = L::set(1.0 / 19.0);
    for (const double c : kSeries) p = L::fma(p, z, L::set(c));
    const L::D two_s = L::add(s, s);
    const L::D log_m = L::fma(L::mul(two_s, z), p, two_s);
    return L::narrow(L::fma(L::from_int(e), L::set(0.69314718055994530942), log_m));
}

inline void gumbel_lanes(const float* u, float* out) {
    Lanes::store(out, Lanes::negate(log_lanes(Lanes::negate(log_lanes(Lanes::load(u))))));  // -log(-log(u))
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
