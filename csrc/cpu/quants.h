// Row conversions and dot products for every weight type, scalar and vectorised (AVX2/F16C,
// AVX-512 where the compiler targets it). Activations are quantized per row (Q8_0 for Q8_0 and
// Q4_0 weights, Q8_1 = Q8_0 plus the block sum for Q4_1), as llama.cpp does, so a row's result
// never depends on other rows.
//
// The reduction order of a dot product is part of its definition (batch invariance, design.md
// invariant 7); dot_row_reference states it in scalar code and every vectorised kernel (dot_row,
// matmul's tiles) reproduces it bit for bit:
// - Quantized weights: per block b of 32, the exact integer isum_b = sum_j w_j * a_j (w_j the
//   weight quant as a signed value: q for Q8_0, q - 8 for Q4_0, q for Q4_1), then in block order
//   y = fma(d_w * d_a, (float)isum_b, y), and for Q4_1 also y = fma(m_w, s_a, y); y starts at +0.
// - F32/F16/BF16 weights: 32 partial sums, p[k % 32] = fma(w_k, x_k, p[k % 32]) in k order over
//   k < K rounded up to a multiple of 32 (missing elements are zeros), then folded in halves:
//   p[i] += p[i + 16], p[i] += p[i + 8], p[i] += p[i + 4], p[i] += p[i + 2], y = p[0] + p[1].
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace pyspec {

// Activation rows are quantized as llama.cpp's CPU backend does before its dot products (x86
// quantize_row_q8_0 / q8_1), so results track llama.cpp's: per block of 32, d = amax / 127 rounded
// to fp16, q = round-half-even(x * (127 / amax)). Scales are widened to float so a kernel can
// broadcast them straight from memory.

// The activation side of Q4_1 dot products: s = fp16(d * sum(qs)) with the unrounded d (ggml's
// block_q8_1), which carries Q4_1's offset term m * sum(x).
struct BlockQ8_1 {
    float d;
    float s;
    int8_t qs[QK];
};

// The activation side of Q8_0 and Q4_0 dot products, plus the sum of the quants: it lets a kernel
// multiply unsigned (biased) weight bytes and subtract the bias exactly:
// sum_j (w_j + c) * a_j - c * sum.
struct BlockQ8_0Sum {
    float d;
    int32_t sum;
    int8_t qs[QK];
};
static_assert(sizeof(BlockQ8_1) == 40 && sizeof(BlockQ8_0Sum) == 40, "activation blocks are packed");

// Row of n values of type t (any DType but I32) to float.
void dequantize_row(DType t, const void* src, float* dst, int64_t n);
// n floats to a row of type t (F32, F16, BF16, Q8_0, Q4_0, Q4_1) with ggml's rounding
// (bit-identical to ggml's reference quantizers and to the gguf Python package).
void quantize_row(DType t, const float* src, void* dst, int64_t n);

// Bytes of one activation row prepared for weight_type's dot product: n floats for F32/F16/BF16
// weights, n/32 BlockQ8_0Sum for Q8_0 and Q4_0, n/32 BlockQ8_1 for Q4_1.
size_t activation_row_bytes(DType weight_type, int64_t n);
// Converts one float row into the form weight_type's dot product consumes.
void prepare_activation_row(DType weight_type, const float* src, void* dst, int64_t n);
// dot(weight row, prepared activation row) over n elements. Fixed reduction order: the result
// depends only on the two rows, never on threading or batch size.
float dot_row(DType weight_type, const void* w_row, const void* act_row, int64_t n);
// The same value computed by plain scalar code that spells out the reduction order above; tests
// hold every vectorised kernel to it bit for bit.
float dot_row_reference(DType weight_type, const void* w_row, const void* act_row, int64_t n);
// prepare_activation_row in plain scalar code (same bytes).
void prepare_activation_row_reference(DType weight_type, const float* src, void* dst, int64_t n);

// Y[m][i] = dot_row(weight_type, W row i, activation row m, n) for i < n_w and m < n_a: the block
// of outputs matmul gives each thread. W rows are w_stride bytes apart, prepared activation rows
// act_stride bytes apart, Y rows y_stride floats apart. Weight rows are taken in panels (16 or 8)
// and activation rows a few at a time, so each weight block is unpacked once per few rows.
void dot_rows(DType weight_type, const void* w, size_t w_stride, int64_t n_w, const void* act, size_t act_stride,
              int64_t n_a, int64_t n, float* y, int64_t y_stride);

// Packed weights (AVX-512 VNNI and AVX2 builds; Q8_0, Q4_0 and Q4_1): a matrix rearranged so that
// each block of a kernel panel (16 rows, or 8 with AVX2) is one contiguous run of bytes in the order
// the kernel's vectors take it (the rows' scales side by side, then their quants lane by lane)
// instead of 16 or 8 strided reads of 16 bytes each. The same values in the same arithmetic, so the
// same bits as dot_rows. The layout differs between the two instruction sets; a copy never leaves
// the process that made it.
// weights_packable: whether this build packs `weight_type` (false elsewhere: callers keep dot_rows).
bool weights_packable(DType weight_type);
// Rows of a packed panel: a packed matrix is read from panel boundaries only (matmul hands its
// threads whole panels).
constexpr int64_t kPackedPanelRows = 16;
// Bytes of the packed copy of n_rows rows of n values (whole panels: a last partial panel repeats
// its last row, as dot_rows reads it).
size_t packed_weight_bytes(DType weight_type, int64_t n_rows, int64_t n);
// Packs n_rows rows (row_bytes apart) into out (packed_weight_bytes of them).
void pack_weights(DType weight_type, const void* w, size_t row_bytes, int64_t n_rows, int64_t n, void* out);
// Bytes of one packed panel of rows of n values: panel p of a packed matrix starts p of them in.
size_t packed_panel_bytes(DType weight_type, int64_t n);
// dot_rows over packed weights: rows [0, n_w) of the panels starting at `packed` (n_w rows from a
// panel's first row), the same bits as dot_rows over the rows themselves.
void dot_rows_packed(DType weight_type, const void* packed, int64_t n_w, const void* act, size_t act_stride,
                     int64_t n_a, int64_t n, float* y, int64_t y_stride);

// Half-precision helpers for the F16 KV cache. The dots use the F32/F16 reduction order above.
void fp32_to_fp16_row(const float* src, uint16_t* dst, int64_t n);
void fp16_to_fp32_row(const uint16_t* src, float* dst, int64_t n);
float dot_f16_f32(const uint16_t* a, const float* b, int64_t n);
void axpy_f16(float alpha, const uint16_t* x, float* y, int64_t n);  // y += alpha * x (fma)
float dot_f32(const float* a, const float* b, int64_t n);
void axpy_f32(float alpha, const float* x, float* y, int64_t n);

// Names of the vector instruction sets the kernels were compiled for, e.g. "avx512vnni avx2".
const char* kernel_isa();

}  // namespace pyspec
