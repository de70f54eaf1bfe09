// Vectorised exp and softmax for the CPU kernels. exp(x) = 2^n * p(r) with n = round(x / ln 2),
// r = x - n ln 2 (|r| <= ln2 / 2) and p the degree-6 Taylor polynomial (relative error < 2e-7).
// The lane layout, and so the summation order, depends only on the row length, never on the
// batch or the thread, which keeps rows batch-invariant.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
// GCC 12 warns about the intrinsics' own undefined pass-through operands (GCC PR 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define PYSPEC_VEC_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PYSPEC_VEC_AVX2 1
#endif

namespace pyspec {
namespace vec {

constexpr float kExpHi = 88.3f;   // 2^127 * p(r) stays finite
constexpr float kExpLo = -87.3f;  // 2^-126: smallest normal
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;            // ln 2 split so n * kLn2Hi is exact
constexpr float kLn2Lo = -2.12194440e-4f;

inline float exp_scalar(float x) {
    x = std::fmin(std::fmax(x, kExpLo), kExpHi);
    const float n = std::nearbyint(x * kLog2e);
    const float r = std::fma(-n, kLn2Lo, std::fma(-n, kLn2Hi, x));
    float p = 1.0f / 720;
    p = std::fma(p, r, 1.0f / 120);
    p = std::fma(p, r, 1.0f / 24);
    p = std::fma(p, r, 1.0f / 6);
    p = std::fma(p, r, 0.5f);
    p = std::fma(p, r, 1.0f);
    p = std::fma(p, r, 1.0f);
    return std::ldexp(p, static_cast<int>(n));
}

#if PYSPEC_VEC_AVX512
inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLo)), _mm512_set1_ps(kExpHi));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x));
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#elif PYSPEC_VEC_AVX2
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLo)), _mm256_set1_ps(kExpHi));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x));
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// The largest non-NaN entry of x[0..n) (-inf when there is none; -0 and +0 compare equal, so
// either may come back), and whether any entry is NaN. AVX2 where built.
inline float max_skipping_nan(const float* x, int64_t n, bool* saw_nan) {
    float m = -std::numeric_limits<float>::infinity();
    bool nan = false;
    int64_t t = 0;
#if defined(__AVX2__)
    if (n >= 8) {
        __m256 vm = _mm256_set1_ps(m);
        __m256 vnan = _mm256_setzero_ps();
        for (; t + 8 <= n; t += 8) {
            const __m256 v = _mm256_loadu_ps(x + t);
            vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            vm = _mm256_max_ps(v, vm);  // a NaN v gives the second operand: vm
        }
        nan = _mm256_movemask_ps(vnan) != 0;
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, vm);
        for (float l : lanes) m = l > m ? l : m;
    }
#endif
    for (; t < n; ++t) {
        nan = nan || std::isnan(x[t]);
        m = x[t] > m ? x[t] : m;
    }
    if (saw_nan) *saw_nan = nan;
    return m;
}

// The first i with x[i] == v, or -1. AVX2 where built: 8 comparisons per step, the first match
// found from the step's mask.
inline int64_t first_index_of(const float* x, int64_t n, float v) {
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 vv = _mm256_set1_ps(v);
    for (; i + 8 <= n; i += 8) {
        const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vv, _CMP_EQ_OQ));
        if (mask) return i + __builtin_ctz(static_cast<unsigned>(mask));
    }
#endif
    for (; i < n; ++i) {
        if (x[i] == v) return i;
    }
    return -1;
}

// The first i with x[i] > v, or n (NaN is not > v). AVX2 where built.
inline int64_t first_above(const float* x, int64_t n, float v) {
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 vv = _mm256_set1_ps(v);
    for (; i + 8 <= n; i += 8) {
        const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vv, _CMP_GT_OQ));
        if (mask) return i + __builtin_ctz(static_cast<unsigned>(mask));
    }
#endif
    for (; i < n; ++i) {
        if (x[i] > v) return i;
    }
    return n;
}

// The first i with x[i] > 0, or n.
inline int64_t first_positive(const float* x, int64_t n) { return first_above(x, n, 0.0f); }

// Whether every entry of x[0..n) is finite and >= 0 (*any_positive: whether one is > 0). AVX2
// where built.
inline bool all_finite_nonnegative(const float* x, int64_t n, bool* any_positive) {
    bool ok = true, pos = false;
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 zero = _mm256_setzero_ps();
    const __m256 big = _mm256_set1_ps(std::numeric_limits<float>::max());
    __m256 vbad = _mm256_setzero_ps(), vpos = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 in_range = _mm256_and_ps(_mm256_cmp_ps(v, zero, _CMP_GE_OQ), _mm256_cmp_ps(v, big, _CMP_LE_OQ));
        vbad = _mm256_or_ps(vbad, _mm256_xor_ps(in_range, _mm256_castsi256_ps(_mm256_set1_epi32(-1))));
        vpos = _mm256_or_ps(vpos, _mm256_cmp_ps(v, zero, _CMP_GT_OQ));
    }
    ok = _mm256_movemask_ps(vbad) == 0;
    pos = _mm256_movemask_ps(vpos) != 0;
#endif
    for (; i < n; ++i) {
        ok = ok && x[i] >= 0.0f && x[i] <= std::numeric_limits<float>::max();
        pos = pos || x[i] > 0.0f;
    }
    if (any_positive) *any_positive = pos;
    return ok;
}

// The largest entry of x[0..n) (-inf when n = 0; NaN entries are skipped; which zero comes back
// when +0 and -0 tie is unspecified) in 8 independent lanes: one running maximum is a chain of
// dependent max instructions, ~4 cycles an entry, and softmax and the sampler's law take one
// over every 49k-entry row.
template <typename T>
inline T max_of(const T* x, int64_t n) {
    T lane[8];
    for (int j = 0; j < 8; ++j) lane[j] = -std::numeric_limits<T>::infinity();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int j = 0; j < 8; ++j) lane[j] = x[i + j] > lane[j] ? x[i + j] : lane[j];
    }
    for (; i < n; ++i) lane[0] = x[i] > lane[0] ? x[i] : lane[0];
    T m = lane[0];
    for (int j = 1; j < 8; ++j) m = lane[j] > m ? lane[j] : m;
    return m;
}

// y[i] = exp(y[i] - shift) in place (exactly 0 for -inf); returns the sum (lane-wise partial sums folded at the end).
inline float exp_shift_sum(float* y, int64_t n, float shift) {
    int64_t i = 0;
    float total = 0.0f;
#if PYSPEC_VEC_AVX512
    __m512 acc = _mm512_setzero_ps();
    const __m512 s = _mm512_set1_ps(shift);
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(y + i);
        const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, neg_inf, _CMP_NEQ_OQ), exp16(_mm512_sub_ps(v, s)));
        _mm512_storeu_ps(y + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    total = _mm512_reduce_add_ps(acc);
#elif PYSPEC_VEC_AVX2
    __m256 acc = _mm256_setzero_ps();
    const __m256 s = _mm256_set1_ps(shift);
    const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(y + i);
        const __m256 e = _mm256_and_ps(_mm256_cmp_ps(v, neg_inf, _CMP_NEQ_OQ), exp8(_mm256_sub_ps(v, s)));
        _mm256_storeu_ps(y + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    for (float l : lanes) total += l;
#endif
    for (; i < n; ++i) {
        y[i] = y[i] == -std::numeric_limits<float>::infinity() ? 0.0f : exp_scalar(y[i] - shift);
        total += y[i];
    }
    return total;
}

// SiLU gate: y[i] = silu(a[i]) * b[i] (b == nullptr: silu(a[i])), silu(x) = x / (1 + exp(-x)) with
// the exp above. Every element takes the same arithmetic wherever it sits (vector body or scalar
// tail give equal bits), so a row's result does not depend on its length's split.
inline void silu_mul(const float* a, const float* b, float* y, int64_t n) {
    int64_t i = 0;
#if PYSPEC_VEC_AVX512
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(a + i);
        __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        if (b) s = _mm512_mul_ps(s, _mm512_loadu_ps(b + i));
        _mm512_storeu_ps(y + i, s);
    }
#elif PYSPEC_VEC_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(a + i);
        __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        if (b) s = _mm256_mul_ps(s, _mm256_loadu_ps(b + i));
        _mm256_storeu_ps(y + i, s);
    }
#endif
    for (; i < n; ++i) {
        const float s = a[i] / (1.0f + exp_scalar(0.0f - a[i]));
        y[i] = b ? s * b[i] : s;
    }
}

// Softmax of n finite-or--inf values in place (all -inf gives zeros).
inline void softmax(float* y, int64_t n) {
    const float m = max_of(y, n);
    if (m == -std::numeric_limits<float>::infinity()) {
        for (int64_t i = 0; i < n; ++i) y[i] = 0.0f;
        return;
    }
    const float inv = 1.0f / exp_shift_sum(y, n, m);
    for (int64_t i = 0; i < n; ++i) y[i] *= inv;
}

}  // namespace vec
}  // namespace pyspec
