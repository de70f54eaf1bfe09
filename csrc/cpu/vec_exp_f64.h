// exp in double precision, vectorised, for the sampling laws (spec/target_law.cpp): a sampled row
// at temperature alone keeps every token of the vocabulary, and its softmax in double over 49k
// entries took ~0.25 ms of std::exp a token, more than the rest of the host's work for the row.
//
// exp(x) = 2^n * p(r), n = round(x log2 e), r = x - n ln 2 in two FMAs (|r| <= ln 2 / 2), p the
// degree-13 Taylor polynomial of e^r (truncation < 5e-18 relative; with Horner's rounding the
// result is within ~2 ulp of exp). Inputs below kExpMinF64 give 0 (exp there is under 3.3e-308:
// no subnormal result, so 2^n is always an exact normal power of two), -inf included.
//
// Every element takes the same operations wherever it sits (AVX-512 body, AVX2 body or scalar
// tail give equal bits), so a row's values do not depend on its length or its position.
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu/vec_math.h"  // the ISA selection (PYSPEC_VEC_AVX512 / PYSPEC_VEC_AVX2)

namespace pyspec {
namespace vec {

constexpr double kExpMinF64 = -708.0;
constexpr double kExpMaxF64 = 709.0;
constexpr double kLog2eF64 = 1.4426950408889634;
constexpr double kLn2HiF64 = 0x1.62e42fee00000p-1;   // its low 21 bits are zero: n * hi is exact
constexpr double kLn2LoF64 = 0x1.a39ef35793c76p-33;  // ln 2 - hi
// 1 / j! for j = 13 down to 2 (Horner's order); j = 1 and 0 are the two final fma(p, r, 1).
constexpr double kExpTaylorF64[] = {1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
                                    1.0 / 362880.0,     1.0 / 40320.0,     1.0 / 5040.0,     1.0 / 720.0,
                                    1.0 / 120.0,        1.0 / 24.0,        1.0 / 6.0,        0.5};

inline double exp_f64(double x) {
    if (!(x >= kExpMinF64)) return 0.0;
    x = std::fmin(x, kExpMaxF64);
    const double n = std::nearbyint(x * kLog2eF64);
    const double r = std::fma(-n, kLn2LoF64, std::fma(-n, kLn2HiF64, x));
    double p = kExpTaylorF64[0];
    for (int j = 1; j < 12; ++j) p = std::fma(p, r, kExpTaylorF64[j]);
    p = std::fma(p, r, 1.0);
    p = std::fma(p, r, 1.0);
    return std::ldexp(p, static_cast<int>(n));
}

#if PYSPEC_VEC_AVX512
inline __m512d exp8_f64(__m512d x) {
    const __mmask8 live = _mm512_cmp_pd_mask(x, _mm512_set1_pd(kExpMinF64), _CMP_GE_OQ);
    x = _mm512_min_pd(x, _mm512_set1_pd(kExpMaxF64));
    const __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(x, _mm512_set1_pd(kLog2eF64)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(kLn2LoF64), _mm512_fnmadd_pd(n, _mm512_set1_pd(kLn2HiF64), x));
    __m512d p = _mm512_set1_pd(kExpTaylorF64[0]);
    for (int j = 1; j < 12; ++j) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(kExpTaylorF64[j]));
    p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(1.0));
    p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(1.0));
    return _mm512_maskz_mov_pd(live, _mm512_scalef_pd(p, n));  // 2^n exact: n >= -1021
}
#elif PYSPEC_VEC_AVX2
inline __m256d exp4_f64(__m256d x) {
    const __m256d live = _mm256_cmp_pd(x, _mm256_set1_pd(kExpMinF64), _CMP_GE_OQ);
    x = _mm256_min_pd(x, _mm256_set1_pd(kExpMaxF64));
    const __m256d n = _mm256_round_pd(_mm256_mul_pd(x, _mm256_set1_pd(kLog2eF64)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(kLn2LoF64), _mm256_fnmadd_pd(n, _mm256_set1_pd(kLn2HiF64), x));
    __m256d p = _mm256_set1_pd(kExpTaylorF64[0]);
    for (int j = 1; j < 12; ++j) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(kExpTaylorF64[j]));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0));
    // 2^n from n's bits: adding 1.5 * 2^52 leaves n in the low bits, and (n + 1023) << 52 is the
    // exponent field (the magic's own bits shift out).
    const __m256i bits = _mm256_castpd_si256(_mm256_add_pd(n, _mm256_set1_pd(0x1.8p52)));
    const __m256d pow2 = _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_add_epi64(bits, _mm256_set1_epi64x(1023)), 52));
    return _mm256_and_pd(live, _mm256_mul_pd(p, pow2));
}
#endif

// y[i] = exp_f64(y[i] - shift) in place; returns their sum (lane-wise partial sums in a fixed
// layout that depends only on n, then added in lane order, then the tail in order).
inline double exp_shift_sum_f64(double* y, int64_t n, double shift) {
    int64_t i = 0;
    double total = 0.0;
#if PYSPEC_VEC_AVX512
    __m512d acc = _mm512_setzero_pd();
    const __m512d s = _mm512_set1_pd(shift);
    for (; i + 8 <= n; i += 8) {
        const __m512d e = exp8_f64(_mm512_sub_pd(_mm512_loadu_pd(y + i), s));
        _mm512_storeu_pd(y + i, e);
        acc = _mm512_add_pd(acc, e);
    }
    alignas(64) double lanes[8];
    _mm512_store_pd(lanes, acc);
    for (double l : lanes) total += l;
#elif PYSPEC_VEC_AVX2
    __m256d acc = _mm256_setzero_pd();
    const __m256d s = _mm256_set1_pd(shift);
    for (; i + 4 <= n; i += 4) {
        const __m256d e = exp4_f64(_mm256_sub_pd(_mm256_loadu_pd(y + i), s));
        _mm256_storeu_pd(y + i, e);
        acc = _mm256_add_pd(acc, e);
    }
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, acc);
    for (double l : lanes) total += l;
#endif
    for (; i < n; ++i) total += (y[i] = exp_f64(y[i] - shift));
    return total;
}

}  // namespace vec
}  // namespace pyspec
