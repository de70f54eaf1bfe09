// Row conversions and dot products for every weight type, scalar and vectorised (AVX2/F16C,
// AVX-512 where the compiler targets it). Activations are quantized per row (Q8_0 for Q8_0 and
// Q4_0 weights, Q8_1 = Q8_0 plus the block sum for Q4_1), as llama.cpp does, so a row's result
// never depends on other rows.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace pyspec {

// Q8_1: like Q8_0 plus s = d * sum(qs), so Q4_1's offset term costs one multiply per block.
struct BlockQ8_1 {
    float d;
    float s;
    int8_t qs[QK];
};

// Row of n values of type t (any DType but I32) to float.
void dequantize_row(DType t, const void* src, float* dst, int64_t n);
// n floats to a row of type t (F32, F16, BF16, Q8_0, Q4_0, Q4_1) with ggml's rounding.
void quantize_row(DType t, const float* src, void* dst, int64_t n);

// Bytes of one activation row prepared for weight_type's dot product: n floats for F32/F16/BF16
// weights, n/32 BlockQ8_0 for Q8_0 and Q4_0, n/32 BlockQ8_1 for Q4_1.
size_t activation_row_bytes(DType weight_type, int64_t n);
// Converts one float row into the form weight_type's dot product consumes.
void prepare_activation_row(DType weight_type, const float* src, void* dst, int64_t n);
// dot(weight row, prepared activation row) over n elements. Fixed reduction order: the result
// depends only on the two rows, never on threading or batch size.
float dot_row(DType weight_type, const void* w_row, const void* act_row, int64_t n);

// Half-precision helpers for the F16 KV cache.
void fp32_to_fp16_row(const float* src, uint16_t* dst, int64_t n);
void fp16_to_fp32_row(const uint16_t* src, float* dst, int64_t n);
float dot_f16_f32(const uint16_t* a, const float* b, int64_t n);
void axpy_f16(float alpha, const uint16_t* x, float* y, int64_t n);  // y += alpha * x
float dot_f32(const float* a, const float* b, int64_t n);
void axpy_f32(float alpha, const float* x, float* y, int64_t n);

}  // namespace pyspec
