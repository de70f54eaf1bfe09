// The scalar dot products: the definition of every kernel's reduction order (quants.h), which
// the vectorised kernels (dot_float.cpp, dot_quant.cpp) reproduce bit for bit.
#include <cmath>
#include <stdexcept>
#include <string>

#include "cpu/kernel_internal.h"

namespace pyspec {
namespace {

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

float fold_lanes(float* p) {
    for (int half = kLanes / 2; half >= 2; half /= 2) {
        for (int i = 0; i < half; ++i) p[i] += p[i + half];
    }
    return p[0] + p[1];
}

}  // namespace

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

template float float_dot_reference<DType::F32>(const void* w, const float* x, int64_t n);
template float float_dot_reference<DType::F16>(const void* w, const float* x, int64_t n);
template float float_dot_reference<DType::BF16>(const void* w, const float* x, int64_t n);

namespace {

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

}  // namespace

// -------------------------------------------------------------------------------------------------
// Public entry points.

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

}  // namespace pyspec
