// Weight rows to and from float (ggml's quantizers), activation rows quantized for the dot
// products, and the half-precision row helpers.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cpu/kernel_internal.h"

namespace pyspec {

void check_blocks(DType t, int64_t n) {
    if (n < 0 || n % dtype_block_size(t) != 0) {
        throw std::invalid_argument(std::string("row length ") + std::to_string(n) + " is not a multiple of " +
                                    dtype_name(t) + "'s block size");
    }
}

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

}  // namespace pyspec
