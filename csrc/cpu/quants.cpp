// Numeric kernels for weights: row conversions, activation quantization and the dot products of
// every weight type, each as plain scalar code (the definition, see quants.h) and as AVX-512 or
// AVX2 code that gives the same bits.
//
// Quantized dot products work on panels of weight rows (16 with AVX-512 VNNI, 8 with AVX2) so
// that the float work of a block (scale, convert, fma) runs once per panel instead of once per
// row: per block, the integer partial sums of the panel's rows are reduced into one vector with
// a lane per row, then y = fma(d_w * d_a, isum, y) runs lane-wise, which is exactly the scalar
// definition for every row.
#include "cpu/quants.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
// GCC 12 warns about the self-initialised "undefined" vectors inside its own intrinsic headers
// when they are inlined (GCC bug 105593); the warning is about the header, not this file.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PYSPEC_AVX512 1
#if defined(__AVX512VNNI__)
#define PYSPEC_AVX512VNNI 1
#endif
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PYSPEC_AVX2 1
#endif

namespace pyspec {
namespace {

// GCC fuses a * b + c into one FMA by default (GNU mode); ggml's quantizers round the product
// first, so products that must round on their own pass through this.
template <typename T>
inline T rounded(T v) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    asm("" : "+v"(v));
#elif defined(__GNUC__)
    asm("" : "+w"(v));
#endif
    return v;
}

void check_blocks(DType t, int64_t n) {
    if (n < 0 || n % dtype_block_size(t) != 0) {
        throw std::invalid_argument(std::string("row length ") + std::to_string(n) + " is not a multiple of " +
                                    dtype_name(t) + "'s block size");
    }
}

// ---------------------------------------------------------------------------------------------
// Scalar quantizers (ggml's reference rounding: the gguf package reproduces them bit for bit).

// d = amax / 127, q = roundf(x * (1 / d)) (half away from zero).
void quantize_row_q8_0(const float* x, BlockQ8_0* y, int64_t nb) {
    for (int64_t b = 0; b < nb; ++b, x += QK) {
        float amax = 0.0f;
        for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(x[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = fp32_to_fp16(d);
        for (int j = 0; j < QK; ++j) y[b].qs[j] = static_cast<int8_t>(std::roundf(x[j] * id));
    }
}

void quantize_row_q4_0(const float* x, BlockQ4_0* y, int64_t nb) {
    for (int64_t b = 0; b < nb; ++b, x += QK) {
        float amax = 0.0f, max = 0.0f;  // the value of largest magnitude, sign kept, first wins
        for (int j = 0; j < QK; ++j) {
            if (amax < std::fabs(x[j])) {
                amax = std::fabs(x[j]);
                max = x[j];
            }
        }
        const float d = max / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = fp32_to_fp16(d);
        for (int j = 0; j < QK / 2; ++j) {
            const int q0 = std::min(15, static_cast<int>(rounded(x[j] * id) + 8.5f));
            const int q1 = std::min(15, static_cast<int>(rounded(x[j + QK / 2] * id) + 8.5f));
            y[b].qs[j] = static_cast<uint8_t>(q0 | q1 << 4);
        }
    }
}

void quantize_row_q4_1(const float* x, BlockQ4_1* y, int64_t nb) {
    for (int64_t b = 0; b < nb; ++b, x += QK) {
        float min = FLT_MAX, max = -FLT_MAX;
        for (int j = 0; j < QK; ++j) {
            if (x[j] < min) min = x[j];
            if (x[j] > max) max = x[j];
        }
        const float d = (max - min) / 15.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = fp32_to_fp16(d);
        y[b].m = fp32_to_fp16(min);
        for (int j = 0; j < QK / 2; ++j) {
            const int q0 = std::min(15, static_cast<int>(rounded((x[j] - min) * id) + 0.5f));
            const int q1 = std::min(15, static_cast<int>(rounded((x[j + QK / 2] - min) * id) + 0.5f));
            y[b].qs[j] = static_cast<uint8_t>(q0 | q1 << 4);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Activation quantization: Q8 blocks as llama.cpp's CPU backend makes them for its dot products
// (x86 quantize_row_q8_0 / q8_1), so our logits track llama.cpp's: d = amax / 127 stored as fp16,
// q = round-half-even(x * (127 / amax)), s = fp16(d * sum(q)). (Weight quantization above follows
// ggml's reference instead: 1 / d and half away from zero, which is what GGUF files hold.)

// v rounded to the nearest fp16 (ties to even), back as float.
inline float round_to_fp16(float v) {
#if defined(__F16C__)
    return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    return fp16_to_fp32(fp32_to_fp16(v));
#endif
}

template <typename Block>
void finish_activation_block(Block& blk, float amax, int32_t sum);

template <>
inline void finish_activation_block(BlockQ8_0Sum& blk, float amax, int32_t sum) {
    blk.d = round_to_fp16(amax / 127.0f);
    blk.sum = sum;
}

template <>
inline void finish_activation_block(BlockQ8_1& blk, float amax, int32_t sum) {
    const float d = amax / 127.0f;
    blk.d = round_to_fp16(d);
    blk.s = round_to_fp16(d * static_cast<float>(sum));
}

inline float activation_scale(float amax) { return amax != 0.0f ? 127.0f / amax : 0.0f; }

template <typename Block>
void quantize_activation_scalar(const float* x, Block* y, int64_t nb) {
    for (int64_t b = 0; b < nb; ++b, x += QK) {
        float amax = 0.0f;
        for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(x[j]));
        const float id = activation_scale(amax);
        int32_t sum = 0;
        for (int j = 0; j < QK; ++j) {
            y[b].qs[j] = static_cast<int8_t>(std::nearbyint(x[j] * id));  // default mode: ties to even
            sum += y[b].qs[j];
        }
        finish_activation_block(y[b], amax, sum);
    }
}

#if PYSPEC_AVX512
template <typename Block>
void quantize_activation(const float* x, Block* y, int64_t nb) {
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int64_t b = 0; b < nb; ++b, x += QK) {
        const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const __m512 id = _mm512_set1_ps(activation_scale(amax));
        const __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x0, id), kNearest);
        const __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x1, id), kNearest);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(y[b].qs), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(y[b].qs + 16), _mm512_cvtepi32_epi8(q1));
        finish_activation_block(y[b], amax, _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
    }
}
#elif PYSPEC_AVX2
template <typename Block>
void quantize_activation(const float* x, Block* y, int64_t nb) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < nb; ++b, x += QK) {
        __m256 v[4];
        __m256 amax8 = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
            v[i] = _mm256_loadu_ps(x + 8 * i);
            amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const __m256 id = _mm256_set1_ps(activation_scale(amax));
        __m256i q[4];
        for (int i = 0; i < 4; ++i) {
            q[i] = _mm256_cvttps_epi32(
                _mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
        s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
        // int32 -> int8 (values are within [-127, 127], so saturation never triggers).
        const __m256i w16 = _mm256_packs_epi32(q[0], q[1]);  // per 128-bit lane: q0 lo, q1 lo | q0 hi, q1 hi
        const __m256i z16 = _mm256_packs_epi32(q[2], q[3]);
        const __m256i b8 = _mm256_packs_epi16(w16, z16);
        const __m256i ordered = _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[b].qs), ordered);
        finish_activation_block(y[b], amax, _mm_cvtsi128_si32(s4));
    }
}
#else
template <typename Block>
void quantize_activation(const float* x, Block* y, int64_t nb) {
    quantize_activation_scalar(x, y, nb);
}
#endif

// ---------------------------------------------------------------------------------------------
// Scalar dot products: the definition of the reduction order (quants.h).

template <DType T>
float weight_at(const void* w, int64_t k);
template <>
inline float weight_at<DType::F32>(const void* w, int64_t k) { return static_cast<const float*>(w)[k]; }
template <>
inline float weight_at<DType::F16>(const void* w, int64_t k) { return fp16_to_fp32(static_cast<const uint16_t*>(w)[k]); }
template <>
inline float weight_at<DType::BF16>(const void* w, int64_t k) { return bf16_to_fp32(static_cast<const uint16_t*>(w)[k]); }

constexpr int kLanes = 32;  // partial sums of a float dot product

float fold_lanes(float* p) {
    for (int half = kLanes / 2; half >= 2; half /= 2) {
        for (int i = 0; i < half; ++i) p[i] += p[i + half];
    }
    return p[0] + p[1];
}

template <DType T>
float float_dot_reference(const void* w, const float* x, int64_t n) {
    float p[kLanes] = {};
    const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
    for (int64_t k = 0; k < padded; ++k) {
        const float wk = k < n ? weight_at<T>(w, k) : 0.0f;
        const float xk = k < n ? x[k] : 0.0f;
        p[k % kLanes] = std::fma(wk, xk, p[k % kLanes]);
    }
    return fold_lanes(p);
}

float q8_0_dot_reference(const BlockQ8_0* w, const BlockQ8_0Sum* a, int64_t nb) {
    float y = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        int32_t isum = 0;
        for (int j = 0; j < QK; ++j) isum += w[b].qs[j] * a[b].qs[j];
        y = std::fma(fp16_to_fp32(w[b].d) * a[b].d, static_cast<float>(isum), y);
    }
    return y;
}

float q4_0_dot_reference(const BlockQ4_0* w, const BlockQ8_0Sum* a, int64_t nb) {
    float y = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        int32_t isum = 0;
        for (int j = 0; j < QK / 2; ++j) {
            isum += ((w[b].qs[j] & 15) - 8) * a[b].qs[j] + ((w[b].qs[j] >> 4) - 8) * a[b].qs[j + QK / 2];
        }
        y = std::fma(fp16_to_fp32(w[b].d) * a[b].d, static_cast<float>(isum), y);
    }
    return y;
}

float q4_1_dot_reference(const BlockQ4_1* w, const BlockQ8_1* a, int64_t nb) {
    float y = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        int32_t isum = 0;
        for (int j = 0; j < QK / 2; ++j) isum += (w[b].qs[j] & 15) * a[b].qs[j] + (w[b].qs[j] >> 4) * a[b].qs[j + QK / 2];
        y = std::fma(fp16_to_fp32(w[b].d) * a[b].d, static_cast<float>(isum), y);
        y = std::fma(fp16_to_fp32(w[b].m), a[b].s, y);
    }
    return y;
}

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

// ---------------------------------------------------------------------------------------------
// Vectorised quantized dot products over panels of weight rows.
//
// Per block, a panel's weight quants are loaded as unsigned bytes in vectors lo[i] / hi[i]
// (i < 4) whose 128-bit lane k holds elements 0-15 / 16-31 of row 4k + i. Multiplying by the
// activation's 16-byte halves broadcast to every lane gives, per lane k of D[i], four int32 partial
// sums of row 4k + i; a 4x4 transpose-add inside each 128-bit lane turns D[0..3] into one vector
// whose lane 4k + i is row 4k + i's block sum. Signed Q8_0 weights are biased by 128 (VNNI)
// and Q4_0 quants are used as 0..15; both subtract bias * sum(a) afterwards, exactly.

template <DType T>
struct QuantTraits;
template <>
struct QuantTraits<DType::Q8_0> {
    using Act = BlockQ8_0Sum;
    static constexpr size_t kBlockBytes = sizeof(BlockQ8_0);
    static constexpr size_t kQsOffset = 2;
    static constexpr int kBiasShift = 7;  // bias 128 (VNNI path only)
};
template <>
struct QuantTraits<DType::Q4_0> {
    using Act = BlockQ8_0Sum;
    static constexpr size_t kBlockBytes = sizeof(BlockQ4_0);
    static constexpr size_t kQsOffset = 2;
    static constexpr int kBiasShift = 3;  // bias 8
};
template <>
struct QuantTraits<DType::Q4_1> {
    using Act = BlockQ8_1;
    static constexpr size_t kBlockBytes = sizeof(BlockQ4_1);
    static constexpr size_t kQsOffset = 4;
    static constexpr int kBiasShift = -1;  // no bias; the min is the m * s term
};

#if PYSPEC_AVX512VNNI || PYSPEC_AVX2
// A panel's rows are read a block at a time, 16 or 8 short strided streams that the hardware
// prefetcher does not follow; so while a panel is computed, the next one (contiguous bytes) is
// prefetched into L2, a slice per block. (Into L1 measured 30% slower on Zen 4: the strided
// panel reads then evict each other.)
struct Prefetch {
    const uint8_t* begin = nullptr;
    size_t bytes = 0;
    int64_t steps = 1;
    void step(int64_t b) const {
        if (!begin) return;
        const size_t lines = (bytes + 63) / 64;
        const size_t from = lines * static_cast<size_t>(b) / static_cast<size_t>(steps);
        const size_t to = lines * static_cast<size_t>(b + 1) / static_cast<size_t>(steps);
        for (size_t l = from; l < to; ++l) _mm_prefetch(reinterpret_cast<const char*>(begin + l * 64), _MM_HINT_T1);
    }
};
#endif

#if PYSPEC_AVX512VNNI
constexpr int kPanelRows = 16;

// Four 16-byte rows into one vector. Built from two 256-bit halves: on Zen 4 inserting 128-bit
// lanes into a 512-bit register directly costs about twice as much.
inline __m512i load_4x128(const uint8_t* p0, const uint8_t* p1, const uint8_t* p2, const uint8_t* p3) {
    const __m256i a = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p1), reinterpret_cast<const __m128i*>(p0));
    const __m256i b = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p3), reinterpret_cast<const __m128i*>(p2));
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

// One block of a 16-row panel, ready for the dot: quants as described above, scales per row.
struct Panel {
    __m512i lo[4], hi[4];
    __m512 d, m;
};

template <DType T>
inline void load_panel(const uint8_t* blk, const size_t* off, Panel& p) {
    constexpr size_t q = QuantTraits<T>::kQsOffset;
    for (int i = 0; i < 4; ++i) {
        if constexpr (T == DType::Q8_0) {
            const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
            p.lo[i] = _mm512_xor_si512(bias, load_4x128(blk + off[i] + q, blk + off[4 + i] + q, blk + off[8 + i] + q,
                                                        blk + off[12 + i] + q));
            p.hi[i] = _mm512_xor_si512(bias, load_4x128(blk + off[i] + q + 16, blk + off[4 + i] + q + 16,
                                                        blk + off[8 + i] + q + 16, blk + off[12 + i] + q + 16));
        } else {
            const __m512i nib = _mm512_set1_epi8(0x0f);
            const __m512i v = load_4x128(blk + off[i] + q, blk + off[4 + i] + q, blk + off[8 + i] + q, blk + off[12 + i] + q);
            p.lo[i] = _mm512_and_si512(v, nib);
            p.hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        }
    }
    // The block headers (d, then m for Q4_1), lane = row: dword 0 of each 128-bit lane of h[i]
    // transposed like the sums below (cheaper than a gather on Zen 4).
    __m512i h[4];
    for (int i = 0; i < 4; ++i) h[i] = load_4x128(blk + off[i], blk + off[4 + i], blk + off[8 + i], blk + off[12 + i]);
    const __m512i hdr = _mm512_unpacklo_epi64(_mm512_unpacklo_epi32(h[0], h[1]), _mm512_unpacklo_epi32(h[2], h[3]));
    p.d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hdr));
    if constexpr (T == DType::Q4_1) p.m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(hdr, 16)));
}

// The block sums of the panel's 16 rows against one activation block.
template <DType T>
inline __m512i panel_block_sums(const Panel& p, const typename QuantTraits<T>::Act& a) {
    const __m512i alo = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.qs)));
    const __m512i ahi = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.qs + 16)));
    __m512i s[4];
    for (int i = 0; i < 4; ++i) {
        s[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), p.lo[i], alo), p.hi[i], ahi);
    }
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(s[0], s[1]), _mm512_unpackhi_epi32(s[0], s[1]));
    const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2], s[3]), _mm512_unpackhi_epi32(s[2], s[3]));
    __m512i sums = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
    if constexpr (QuantTraits<T>::kBiasShift >= 0) {
        sums = _mm512_sub_epi32(sums, _mm512_set1_epi32(a.sum * (1 << QuantTraits<T>::kBiasShift)));
    }
    return sums;
}

constexpr int kQuantRM = 4;  // activation rows per tile

// Y rows [0, RM) x panel rows [0, rows): blocks unpacked on the fly, or taken from `cached`
// (the panel unpacked once for a long batch).
template <DType T, int RM, bool kCached>
void quant_tile(const uint8_t* w, const size_t* off, int64_t nb, const Panel* cached, const uint8_t* act,
                size_t act_stride, float* y, int64_t y_stride, int rows, const Prefetch& pf) {
    using Act = typename QuantTraits<T>::Act;
    __m512 acc[RM];
    for (int r = 0; r < RM; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        Panel fresh;
        if constexpr (!kCached) {
            pf.step(b);
            load_panel<T>(w + b * QuantTraits<T>::kBlockBytes, off, fresh);
        }
        const Panel& p = kCached ? cached[b] : fresh;
        for (int r = 0; r < RM; ++r) {
            const Act& a = reinterpret_cast<const Act*>(act + r * act_stride)[b];
            const __m512 sums = _mm512_cvtepi32_ps(panel_block_sums<T>(p, a));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(p.d, _mm512_set1_ps(a.d)), sums, acc[r]);
            if constexpr (T == DType::Q4_1) acc[r] = _mm512_fmadd_ps(p.m, _mm512_set1_ps(a.s), acc[r]);
        }
    }
    const __mmask16 store = static_cast<__mmask16>((1u << rows) - 1);
    for (int r = 0; r < RM; ++r) _mm512_mask_storeu_ps(y + r * y_stride, store, acc[r]);
}

#elif PYSPEC_AVX2
constexpr int kPanelRows = 8;

inline __m256i load_2x128(const uint8_t* p0, const uint8_t* p1) {
    return _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p1), reinterpret_cast<const __m128i*>(p0));
}

// One block of an 8-row panel. Q8_0 quants stay signed (lo/hi) next to their magnitudes
// (abs_lo/abs_hi) for maddubs' unsigned x signed product, which must not overflow int16.
struct Panel {
    __m256i lo[4], hi[4], abs_lo[4], abs_hi[4];
    __m256 d, m;
};

inline __m256 fp16_lanes_to_float(__m256i hdr, int byte) {  // the fp16 at byte 0 or 2 of each dword
    const __m256i pick = byte == 0 ? _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9,
                                                      12, 13, -1, -1, -1, -1, -1, -1, -1, -1)
                                   : _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7,
                                                      10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(hdr, pick), 0x08);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
}

template <DType T>
inline void load_panel(const uint8_t* blk, const size_t* off, Panel& p) {
    constexpr size_t q = QuantTraits<T>::kQsOffset;
    for (int i = 0; i < 4; ++i) {
        if constexpr (T == DType::Q8_0) {
            p.lo[i] = load_2x128(blk + off[i] + q, blk + off[4 + i] + q);
            p.hi[i] = load_2x128(blk + off[i] + q + 16, blk + off[4 + i] + q + 16);
            p.abs_lo[i] = _mm256_abs_epi8(p.lo[i]);
            p.abs_hi[i] = _mm256_abs_epi8(p.hi[i]);
        } else {
            const __m256i nib = _mm256_set1_epi8(0x0f);
            const __m256i v = load_2x128(blk + off[i] + q, blk + off[4 + i] + q);
            p.lo[i] = _mm256_and_si256(v, nib);
            p.hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        }
    }
    __m256i h[4];  // block headers, transposed as in the AVX-512 kernel
    for (int i = 0; i < 4; ++i) h[i] = load_2x128(blk + off[i], blk + off[4 + i]);
    const __m256i hdr = _mm256_unpacklo_epi64(_mm256_unpacklo_epi32(h[0], h[1]), _mm256_unpacklo_epi32(h[2], h[3]));
    p.d = fp16_lanes_to_float(hdr, 0);
    if constexpr (T == DType::Q4_1) p.m = fp16_lanes_to_float(hdr, 2);
}

template <DType T>
inline __m256i panel_block_sums(const Panel& p, const typename QuantTraits<T>::Act& a) {
    const __m256i alo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.qs)));
    const __m256i ahi = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.qs + 16)));
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s[4];
    for (int i = 0; i < 4; ++i) {
        if constexpr (T == DType::Q8_0) {
            const __m256i l = _mm256_madd_epi16(_mm256_maddubs_epi16(p.abs_lo[i], _mm256_sign_epi8(alo, p.lo[i])), ones);
            const __m256i h = _mm256_madd_epi16(_mm256_maddubs_epi16(p.abs_hi[i], _mm256_sign_epi8(ahi, p.hi[i])), ones);
            s[i] = _mm256_add_epi32(l, h);
        } else {  // 4-bit quants: two int16 products of 2 * 15 * 127 still fit int16
            s[i] = _mm256_madd_epi16(
                _mm256_add_epi16(_mm256_maddubs_epi16(p.lo[i], alo), _mm256_maddubs_epi16(p.hi[i], ahi)), ones);
        }
    }
    const __m256i t0 = _mm256_add_epi32(_mm256_unpacklo_epi32(s[0], s[1]), _mm256_unpackhi_epi32(s[0], s[1]));
    const __m256i t1 = _mm256_add_epi32(_mm256_unpacklo_epi32(s[2], s[3]), _mm256_unpackhi_epi32(s[2], s[3]));
    __m256i sums = _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));
    if constexpr (T == DType::Q4_0) sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(a.sum * 8));
    return sums;
}

constexpr int kQuantRM = 2;  // activation rows per tile (16 ymm registers)

// Y rows [0, RM) x panel rows [0, rows): blocks unpacked on the fly, or taken from `cached`
// (the panel unpacked once for a long batch).
template <DType T, int RM, bool kCached>
void quant_tile(const uint8_t* w, const size_t* off, int64_t nb, const Panel* cached, const uint8_t* act,
                size_t act_stride, float* y, int64_t y_stride, int rows, const Prefetch& pf) {
    using Act = typename QuantTraits<T>::Act;
    __m256 acc[RM];
    for (int r = 0; r < RM; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        Panel fresh;
        if constexpr (!kCached) {
            pf.step(b);
            load_panel<T>(w + b * QuantTraits<T>::kBlockBytes, off, fresh);
        }
        const Panel& p = kCached ? cached[b] : fresh;
        for (int r = 0; r < RM; ++r) {
            const Act& a = reinterpret_cast<const Act*>(act + r * act_stride)[b];
            const __m256 sums = _mm256_cvtepi32_ps(panel_block_sums<T>(p, a));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(p.d, _mm256_set1_ps(a.d)), sums, acc[r]);
            if constexpr (T == DType::Q4_1) acc[r] = _mm256_fmadd_ps(p.m, _mm256_set1_ps(a.s), acc[r]);
        }
    }
    for (int r = 0; r < RM; ++r) {
        if (rows == kPanelRows) {
            _mm256_storeu_ps(y + r * y_stride, acc[r]);
        } else {
            alignas(32) float tmp[kPanelRows];
            _mm256_store_ps(tmp, acc[r]);
            std::memcpy(y + r * y_stride, tmp, static_cast<size_t>(rows) * sizeof(float));
        }
    }
}

#endif

#if PYSPEC_AVX512VNNI || PYSPEC_AVX2
// The last rows < kQuantRM of a batch: a tile of exactly that many.
template <DType T, int RM, bool kCached>
void quant_tile_rest(int64_t rows_a, const uint8_t* w, const size_t* off, int64_t nb, const Panel* cached,
                     const uint8_t* act, size_t act_stride, float* y, int64_t y_stride, int rows, const Prefetch& pf) {
    if constexpr (RM > 0) {
        if (rows_a == RM) {
            quant_tile<T, RM, kCached>(w, off, nb, cached, act, act_stride, y, y_stride, rows, pf);
        } else {
            quant_tile_rest<T, RM - 1, kCached>(rows_a, w, off, nb, cached, act, act_stride, y, y_stride, rows, pf);
        }
    }
}

template <DType T, bool kCached>
void quant_tiles_m(const uint8_t* w, const size_t* off, int64_t nb, const Panel* cached, const uint8_t* act,
                   size_t act_stride, int64_t n_a, float* y, int64_t y_stride, int rows, const Prefetch& pf) {
    const Prefetch none{};
    int64_t m = 0;
    for (; m + kQuantRM <= n_a; m += kQuantRM) {
        quant_tile<T, kQuantRM, kCached>(w, off, nb, cached, act + m * act_stride, act_stride, y + m * y_stride, y_stride,
                                         rows, m == 0 ? pf : none);
    }
    quant_tile_rest<T, kQuantRM - 1, kCached>(n_a - m, w, off, nb, cached, act + m * act_stride, act_stride,
                                              y + m * y_stride, y_stride, rows, m == 0 ? pf : none);
}

template <DType T>
void quant_dot_rows(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* act, size_t act_stride,
                    int64_t n_a, int64_t n, float* y, int64_t y_stride) {
    const int64_t nb = n / QK;
    // With more than one tile of activation rows, each panel is unpacked once into this buffer
    // instead of once per tile.
    thread_local std::vector<Panel> cache;
    const bool cached = n_a > kQuantRM;
    if (cached && cache.size() < static_cast<size_t>(nb)) cache.resize(static_cast<size_t>(nb));
    for (int64_t i0 = 0; i0 < n_w; i0 += kPanelRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kPanelRows, n_w - i0));
        // Lanes past the last row repeat it (valid memory) and are not stored.
        size_t off[kPanelRows];
        for (int r = 0; r < kPanelRows; ++r) off[r] = static_cast<size_t>(std::min(r, rows - 1)) * w_stride;
        const uint8_t* wp = w + i0 * w_stride;
        // The first pass over this panel streams the next one into the cache.
        const Prefetch next{wp + kPanelRows * w_stride, kPanelRows * w_stride, nb};
        if (cached) {
            for (int64_t b = 0; b < nb; ++b) {
                next.step(b);
                load_panel<T>(wp + b * QuantTraits<T>::kBlockBytes, off, cache[static_cast<size_t>(b)]);
            }
            quant_tiles_m<T, true>(wp, off, nb, cache.data(), act, act_stride, n_a, y + i0, y_stride, rows, Prefetch{});
        } else {
            quant_tiles_m<T, false>(wp, off, nb, nullptr, act, act_stride, n_a, y + i0, y_stride, rows, next);
        }
    }
}
#else
template <DType T>
void quant_dot_rows(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* act, size_t act_stride,
                    int64_t n_a, int64_t n, float* y, int64_t y_stride) {
    for (int64_t m = 0; m < n_a; ++m)
        for (int64_t i = 0; i < n_w; ++i) y[m * y_stride + i] = dot_row_reference(T, w + i * w_stride, act + m * act_stride, n);
}
#endif

}  // namespace

// -------------------------------------------------------------------------------------------------
// Public entry points.

void dequantize_row(DType t, const void* src, float* dst, int64_t n) {
    check_blocks(t, n);
    switch (t) {
        case DType::F32: std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float)); return;
        case DType::F16: fp16_to_fp32_row(static_cast<const uint16_t*>(src), dst, n); return;
        case DType::BF16: {
            const uint16_t* s = static_cast<const uint16_t*>(src);
            for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(s[i]);
            return;
        }
        case DType::Q8_0: {
            const BlockQ8_0* b = static_cast<const BlockQ8_0*>(src);
            for (int64_t i = 0; i < n / QK; ++i) {
                const float d = fp16_to_fp32(b[i].d);
                for (int j = 0; j < QK; ++j) dst[i * QK + j] = static_cast<float>(b[i].qs[j]) * d;
            }
            return;
        }
        case DType::Q4_0: {
            const BlockQ4_0* b = static_cast<const BlockQ4_0*>(src);
            for (int64_t i = 0; i < n / QK; ++i) {
                const float d = fp16_to_fp32(b[i].d);
                for (int j = 0; j < QK / 2; ++j) {
                    dst[i * QK + j] = d * static_cast<float>((b[i].qs[j] & 15) - 8);
                    dst[i * QK + j + QK / 2] = d * static_cast<float>((b[i].qs[j] >> 4) - 8);
                }
            }
            return;
        }
        case DType::Q4_1: {
            const BlockQ4_1* b = static_cast<const BlockQ4_1*>(src);
            for (int64_t i = 0; i < n / QK; ++i) {
                const float d = fp16_to_fp32(b[i].d), m = fp16_to_fp32(b[i].m);
                for (int j = 0; j < QK / 2; ++j) {
                    dst[i * QK + j] = rounded(d * static_cast<float>(b[i].qs[j] & 15)) + m;
                    dst[i * QK + j + QK / 2] = rounded(d * static_cast<float>(b[i].qs[j] >> 4)) + m;
                }
            }
            return;
        }
        default: throw std::invalid_argument(std::string("dequantize_row: unsupported type ") + dtype_name(t));
    }
}

void quantize_row(DType t, const float* src, void* dst, int64_t n) {
    check_blocks(t, n);
    switch (t) {
        case DType::F32: std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float)); return;
        case DType::F16: fp32_to_fp16_row(src, static_cast<uint16_t*>(dst), n); return;
        case DType::BF16: {
            uint16_t* d = static_cast<uint16_t*>(dst);
            for (int64_t i = 0; i < n; ++i) d[i] = fp32_to_bf16(src[i]);
            return;
        }
        case DType::Q8_0: quantize_row_q8_0(src, static_cast<BlockQ8_0*>(dst), n / QK); return;
        case DType::Q4_0: quantize_row_q4_0(src, static_cast<BlockQ4_0*>(dst), n / QK); return;
        case DType::Q4_1: quantize_row_q4_1(src, static_cast<BlockQ4_1*>(dst), n / QK); return;
        default: throw std::invalid_argument(std::string("quantize_row: unsupported type ") + dtype_name(t));
    }
}

size_t activation_row_bytes(DType weight_type, int64_t n) {
    check_blocks(weight_type, n);
    switch (weight_type) {
        case DType::F32:
        case DType::F16:
        case DType::BF16: return static_cast<size_t>(n) * sizeof(float);
        case DType::Q8_0:
        case DType::Q4_0: return static_cast<size_t>(n / QK) * sizeof(BlockQ8_0Sum);
        case DType::Q4_1: return static_cast<size_t>(n / QK) * sizeof(BlockQ8_1);
        default: throw std::invalid_argument(std::string("no dot product for weight type ") + dtype_name(weight_type));
    }
}

void prepare_activation_row(DType weight_type, const float* src, void* dst, int64_t n) {
    check_blocks(weight_type, n);
    switch (weight_type) {
        case DType::F32:
        case DType::F16:
        case DType::BF16: std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float)); return;
        case DType::Q8_0:
        case DType::Q4_0: quantize_activation(src, static_cast<BlockQ8_0Sum*>(dst), n / QK); return;
        case DType::Q4_1: quantize_activation(src, static_cast<BlockQ8_1*>(dst), n / QK); return;
        default: throw std::invalid_argument(std::string("no dot product for weight type ") + dtype_name(weight_type));
    }
}

void prepare_activation_row_reference(DType weight_type, const float* src, void* dst, int64_t n) {
    check_blocks(weight_type, n);
    switch (weight_type) {
        case DType::Q8_0:
        case DType::Q4_0: quantize_activation_scalar(src, static_cast<BlockQ8_0Sum*>(dst), n / QK); return;
        case DType::Q4_1: quantize_activation_scalar(src, static_cast<BlockQ8_1*>(dst), n / QK); return;
        default: prepare_activation_row(weight_type, src, dst, n);
    }
}

void dot_rows(DType weight_type, const void* w, size_t w_stride, int64_t n_w, const void* act, size_t act_stride,
              int64_t n_a, int64_t n, float* y, int64_t y_stride) {
    // Activation rows go in chunks small enough to stay in L2 while every weight panel meets
    // them; a long batch would otherwise be streamed from memory once per panel.
    constexpr size_t kChunkBytes = 192 << 10;
    const size_t act_bytes = std::max<size_t>(1, activation_row_bytes(weight_type, n));
    const int64_t chunk = std::max<int64_t>(8, static_cast<int64_t>(kChunkBytes / act_bytes));
    const uint8_t* wb = static_cast<const uint8_t*>(w);
    for (int64_t m0 = 0; m0 < n_a; m0 += chunk) {
        const int64_t rows = std::min(chunk, n_a - m0);
        const uint8_t* ab = static_cast<const uint8_t*>(act) + m0 * act_stride;
        const float* xf = reinterpret_cast<const float*>(ab);
        const size_t xs = act_stride / sizeof(float);
        float* yc = y + m0 * y_stride;
        switch (weight_type) {
            case DType::F32: float_dot_rows<DType::F32>(wb, w_stride, n_w, xf, xs, rows, n, yc, y_stride); break;
            case DType::F16: float_dot_rows<DType::F16>(wb, w_stride, n_w, xf, xs, rows, n, yc, y_stride); break;
            case DType::BF16: float_dot_rows<DType::BF16>(wb, w_stride, n_w, xf, xs, rows, n, yc, y_stride); break;
            case DType::Q8_0: quant_dot_rows<DType::Q8_0>(wb, w_stride, n_w, ab, act_stride, rows, n, yc, y_stride); break;
            case DType::Q4_0: quant_dot_rows<DType::Q4_0>(wb, w_stride, n_w, ab, act_stride, rows, n, yc, y_stride); break;
            case DType::Q4_1: quant_dot_rows<DType::Q4_1>(wb, w_stride, n_w, ab, act_stride, rows, n, yc, y_stride); break;
            default: throw std::invalid_argument(std::string("no dot product for weight type ") + dtype_name(weight_type));
        }
    }
}

float dot_row(DType weight_type, const void* w_row, const void* act_row, int64_t n) {
    float y;
    dot_rows(weight_type, w_row, 0, 1, act_row, 0, 1, n, &y, 0);
    return y;
}

float dot_row_reference(DType weight_type, const void* w_row, const void* act_row, int64_t n) {
    check_blocks(weight_type, n);
    const float* x = static_cast<const float*>(act_row);
    switch (weight_type) {
        case DType::F32: return float_dot_reference<DType::F32>(w_row, x, n);
        case DType::F16: return float_dot_reference<DType::F16>(w_row, x, n);
        case DType::BF16: return float_dot_reference<DType::BF16>(w_row, x, n);
        case DType::Q8_0:
            return q8_0_dot_reference(static_cast<const BlockQ8_0*>(w_row), static_cast<const BlockQ8_0Sum*>(act_row), n / QK);
        case DType::Q4_0:
            return q4_0_dot_reference(static_cast<const BlockQ4_0*>(w_row), static_cast<const BlockQ8_0Sum*>(act_row), n / QK);
        case DType::Q4_1:
            return q4_1_dot_reference(static_cast<const BlockQ4_1*>(w_row), static_cast<const BlockQ8_1*>(act_row), n / QK);
        default: throw std::invalid_argument(std::string("no dot product for weight type ") + dtype_name(weight_type));
    }
}

void fp32_to_fp16_row(const float* src, uint16_t* dst, int64_t n) {
    int64_t i = 0;
#if PYSPEC_AVX512
    for (; i + 16 <= n; i += 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    }
#elif PYSPEC_AVX2
    for (; i + 8 <= n; i += 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    }
#endif
    for (; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}

void fp16_to_fp32_row(const uint16_t* src, float* dst, int64_t n) {
    int64_t i = 0;
#if PYSPEC_AVX512
    for (; i + 16 <= n; i += 16) {
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
    }
#elif PYSPEC_AVX2
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    }
#endif
    for (; i < n; ++i) dst[i] = fp16_to_fp32(src[i]);
}

float dot_f16_f32(const uint16_t* a, const float* b, int64_t n) {
    float y;
    float_dot_rows<DType::F16>(reinterpret_cast<const uint8_t*>(a), 0, 1, b, 0, 1, n, &y, 0);
    return y;
}

float dot_f32(const float* a, const float* b, int64_t n) {
    float y;
    float_dot_rows<DType::F32>(reinterpret_cast<const uint8_t*>(a), 0, 1, b, 0, 1, n, &y, 0);
    return y;
}

void axpy_f16(float alpha, const uint16_t* x, float* y, int64_t n) {
    int64_t i = 0;
#if PYSPEC_AVX512
    const __m512 a16 = _mm512_set1_ps(alpha);
    for (; i + 16 <= n; i += 16) {
        const __m512 xv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)));
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(a16, xv, _mm512_loadu_ps(y + i)));
    }
#elif PYSPEC_AVX2
    const __m256 a8 = _mm256_set1_ps(alpha);
    for (; i + 8 <= n; i += 8) {
        const __m256 xv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a8, xv, _mm256_loadu_ps(y + i)));
    }
#endif
    for (; i < n; ++i) y[i] = std::fma(alpha, fp16_to_fp32(x[i]), y[i]);
}

void axpy_f32(float alpha, const float* x, float* y, int64_t n) {
    int64_t i = 0;
#if PYSPEC_AVX512
    const __m512 a16 = _mm512_set1_ps(alpha);
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(a16, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#elif PYSPEC_AVX2
    const __m256 a8 = _mm256_set1_ps(alpha);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a8, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; ++i) y[i] = std::fma(alpha, x[i], y[i]);
}

const char* kernel_isa() {
#if PYSPEC_AVX512VNNI
    return "avx512vnni";
#elif PYSPEC_AVX512
    return "avx512 (quantized dots: avx2)";
#elif PYSPEC_AVX2
    return "avx2";
#else
    return "scalar";
#endif
}

}  // namespace pyspec
