// Vectorised dot products of float weights (F32, F16, BF16): register tiles of weight rows times
// activation rows that give the bits of float_dot_reference (dot_reference.cpp).
#include <cstring>
#include <type_traits>

#include "cpu/kernel_internal.h"

namespace pyspec {
namespace {

// ---------------------------------------------------------------------------------------------
// Vectorised float dot products: a tile of RN weight rows times RM activation rows, 32 partial
// sums per output in registers (2 zmm or 4 ymm), folded as fold_lanes does.

#if PYSPEC_AVX512
template <DType T>
inline __m512 load_w16(const void* w, int64_t k, __mmask16 mask) {
    if constexpr (T == DType::F32) {
        return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(w) + k);
    } else {
        const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(w) + k);
        if constexpr (T == DType::F16) return _mm512_cvtph_ps(h);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
}

inline float fold_lanes(__m512 p0, __m512 p1) {
    const __m512 s16 = _mm512_add_ps(p0, p1);
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(s16), _mm512_extractf32x8_ps(s16, 1));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

template <DType T, int RN, int RM>
void float_tile(const uint8_t* w, size_t w_stride, const float* x, size_t x_stride, int64_t n, float* y,
                int64_t y_stride) {
    // Accumulators p[(i * RM + r) * 2 + half]. GCC keeps them in registers only if every loop that
    // indexes them is unrolled early (hence the pragmas); otherwise it mirrors them to the stack on
    // every step, which halved the speed.
    __m512 p[RN * RM * 2];
    for (int j = 0; j < RN * RM * 2; ++j) p[j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; k += kLanes) {
        const int64_t left = n - k;  // the last chunk may be partial: masked loads read zeros
        const __mmask16 m0 = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
        const __mmask16 m1 = left >= 32 ? 0xffff : left <= 16 ? 0 : static_cast<__mmask16>((1u << (left - 16)) - 1);
        __m512 wv[RN * 2];
        for (int i = 0; i < RN; ++i) {
            wv[2 * i] = load_w16<T>(w + i * w_stride, k, m0);
            wv[2 * i + 1] = load_w16<T>(w + i * w_stride, k + 16, m1);
        }
        for (int r = 0; r < RM; ++r) {
            const __m512 x0 = _mm512_maskz_loadu_ps(m0, x + r * x_stride + k);
            const __m512 x1 = _mm512_maskz_loadu_ps(m1, x + r * x_stride + k + 16);
            for (int i = 0; i < RN; ++i) {
                p[(i * RM + r) * 2] = _mm512_fmadd_ps(wv[2 * i], x0, p[(i * RM + r) * 2]);
                p[(i * RM + r) * 2 + 1] = _mm512_fmadd_ps(wv[2 * i + 1], x1, p[(i * RM + r) * 2 + 1]);
            }
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < RM; ++r)
#pragma GCC unroll 16
        for (int i = 0; i < RN; ++i) y[r * y_stride + i] = fold_lanes(p[(i * RM + r) * 2], p[(i * RM + r) * 2 + 1]);
}
#elif PYSPEC_AVX2
// Loads 8 weights at k as floats; the last partial chunk of a row goes through a zeroed copy.
template <DType T>
inline __m256 load_w8(const void* w, int64_t k) {
    if constexpr (T == DType::F32) {
        return _mm256_loadu_ps(static_cast<const float*>(w) + k);
    } else {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + k));
        if constexpr (T == DType::F16) return _mm256_cvtph_ps(h);
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
}

inline float fold_lanes(const __m256* p) {
    const __m256 s8 = _mm256_add_ps(_mm256_add_ps(p[0], p[2]), _mm256_add_ps(p[1], p[3]));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// One 32-wide step of a tile: p[(i * RM + r) * 4 + q] += w_i[k + 8q ..] * x_r[k + 8q ..].
template <DType T, int RN, int RM>
__attribute__((always_inline)) inline void float_step(const void* const* wr, const float* const* xr, int64_t k,
                                                      __m256* p) {
    __m256 wv[RN * 4];
#pragma GCC unroll 16
    for (int j = 0; j < RN * 4; ++j) wv[j] = load_w8<T>(wr[j / 4], k + 8 * (j % 4));
#pragma GCC unroll 16
    for (int r = 0; r < RM; ++r) {
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
            const __m256 xv = _mm256_loadu_ps(xr[r] + k + 8 * q);
#pragma GCC unroll 16
            for (int i = 0; i < RN; ++i) p[(i * RM + r) * 4 + q] = _mm256_fmadd_ps(wv[i * 4 + q], xv, p[(i * RM + r) * 4 + q]);
        }
    }
}

template <DType T, int RN, int RM>
void float_tile(const uint8_t* w, size_t w_stride, const float* x, size_t x_stride, int64_t n, float* y,
                int64_t y_stride) {
    using WElem = std::conditional_t<T == DType::F32, float, uint16_t>;
    // Accumulators in registers only if every loop indexing them is unrolled early (see the
    // AVX-512 tile).
    __m256 p[RN * RM * 4];
#pragma GCC unroll 64
    for (int j = 0; j < RN * RM * 4; ++j) p[j] = _mm256_setzero_ps();
    const void* wr[RN];
    const float* xr[RM];
    for (int i = 0; i < RN; ++i) wr[i] = w + i * w_stride;
    for (int r = 0; r < RM; ++r) xr[r] = x + r * x_stride;
    const int64_t full = n / kLanes * kLanes;
    for (int64_t k = 0; k < full; k += kLanes) float_step<T, RN, RM>(wr, xr, k, p);
    if (full < n) {  // the last partial chunk, through zero-padded copies
        WElem wt[RN][kLanes] = {};
        float xt[RM][kLanes] = {};
        for (int i = 0; i < RN; ++i) {
            std::memcpy(wt[i], static_cast<const WElem*>(wr[i]) + full, (n - full) * sizeof(WElem));
            wr[i] = wt[i];
        }
        for (int r = 0; r < RM; ++r) {
            std::memcpy(xt[r], xr[r] + full, (n - full) * sizeof(float));
            xr[r] = xt[r];
        }
        float_step<T, RN, RM>(wr, xr, 0, p);
    }
#pragma GCC unroll 16
    for (int r = 0; r < RM; ++r)
#pragma GCC unroll 16
        for (int i = 0; i < RN; ++i) y[r * y_stride + i] = fold_lanes(p + (i * RM + r) * 4);
}
#endif

#if PYSPEC_AVX512 || PYSPEC_AVX2
// Tile shape: accumulators, weights and one activation vector must fit the register file
// (32 zmm: 2 x 4 x 2 + 4 + 2; 16 ymm: 1 x 2 x 4 + 4 + 1).
#if PYSPEC_AVX512
constexpr int kFloatRN = 2;  // weight rows per float tile
constexpr int kFloatRM = 4;  // activation rows per float tile
#else
constexpr int kFloatRN = 1;
constexpr int kFloatRM = 2;
#endif

// The last rows < kFloatRM of a batch: a tile of exactly that many.
template <DType T, int RN, int RM>
void float_tile_rest(int64_t rows, const uint8_t* w, size_t w_stride, const float* x, size_t x_stride, int64_t n,
                     float* y, int64_t y_stride) {
    if constexpr (RM > 0) {
        if (rows == RM) {
            float_tile<T, RN, RM>(w, w_stride, x, x_stride, n, y, y_stride);
        } else {
            float_tile_rest<T, RN, RM - 1>(rows, w, w_stride, x, x_stride, n, y, y_stride);
        }
    }
}

template <DType T, int RN>
void float_tiles_m(const uint8_t* w, size_t w_stride, const float* x, size_t x_stride, int64_t n_a, int64_t n,
                   float* y, int64_t y_stride) {
    int64_t m = 0;
    for (; m + kFloatRM <= n_a; m += kFloatRM) {
        float_tile<T, RN, kFloatRM>(w, w_stride, x + m * x_stride, x_stride, n, y + m * y_stride, y_stride);
    }
    float_tile_rest<T, RN, kFloatRM - 1>(n_a - m, w, w_stride, x + m * x_stride, x_stride, n, y + m * y_stride, y_stride);
}
#endif

}  // namespace

#if PYSPEC_AVX512 || PYSPEC_AVX2
template <DType T>
void float_dot_rows(const uint8_t* w, size_t w_stride, int64_t n_w, const float* x, size_t x_stride, int64_t n_a,
                    int64_t n, float* y, int64_t y_stride) {
    // Rows four tiles ahead go to L2 first: with only the hardware prefetcher, F16 rows streamed
    // from memory at half the speed (Zen 4).
    const size_t row_bytes = static_cast<size_t>(n) * (T == DType::F32 ? sizeof(float) : sizeof(uint16_t));
    int64_t i = 0;
    for (; i + kFloatRN <= n_w; i += kFloatRN) {
        const uint8_t* ahead = w + (i + 4 * kFloatRN) * w_stride;
        for (int j = 0; j < kFloatRN; ++j) {
            for (size_t l = 0; l < row_bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * w_stride + l), _MM_HINT_T1);
        }
        float_tiles_m<T, kFloatRN>(w + i * w_stride, w_stride, x, x_stride, n_a, n, y + i, y_stride);
    }
    for (; i < n_w; ++i) float_tiles_m<T, 1>(w + i * w_stride, w_stride, x, x_stride, n_a, n, y + i, y_stride);
}
#else
template <DType T>
void float_dot_rows(const uint8_t* w, size_t w_stride, int64_t n_w, const float* x, size_t x_stride, int64_t n_a,
                    int64_t n, float* y, int64_t y_stride) {
    for (int64_t m = 0; m < n_a; ++m)
        for (int64_t i = 0; i < n_w; ++i) y[m * y_stride + i] = float_dot_reference<T>(w + i * w_stride, x + m * x_stride, n);
}
#endif

template void float_dot_rows<DType::F32>(const uint8_t* w, size_t w_stride, int64_t n_w, const float* x,
                                         size_t x_stride, int64_t n_a, int64_t n, float* y, int64_t y_stride);
template void float_dot_rows<DType::F16>(const uint8_t* w, size_t w_stride, int64_t n_w, const float* x,
                                         size_t x_stride, int64_t n_a, int64_t n, float* y, int64_t y_stride);
template void float_dot_rows<DType::BF16>(const uint8_t* w, size_t w_stride, int64_t n_w, const float* x,
                                          size_t x_stride, int64_t n_a, int64_t n, float* y, int64_t y_stride);

// -------------------------------------------------------------------------------------------------
// Public entry points.

float dot_f16_f32(const uint16_t* a, const float* b, int64_t n) {
    float y;
    float_dot_rows<DType::F16>(reinterpret_cast<const uint8_t*>(a), 0, 1, b, 0, 1, n, &y, 0);
    return y;
}

// Straight to the 1 x 1 tile that float_dot_rows would reach for one row (same bits): attention
// calls this once per cache cell and head, where the dispatch and prefetch setup of the general
// path cost more than the 64-long dot itself.
float dot_f32(const float* a, const float* b, int64_t n) {
#if PYSPEC_AVX512 || PYSPEC_AVX2
    float y;
    float_tile<DType::F32, 1, 1>(reinterpret_cast<const uint8_t*>(a), 0, b, 0, n, &y, 0);
    return y;
#else
    return float_dot_reference<DType::F32>(a, b, n);
#endif
}

}  // namespace pyspec
