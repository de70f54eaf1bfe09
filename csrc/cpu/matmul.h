// Multi-threaded matrix multiply with weights in any supported DType.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/thread_pool.h"

namespace pyspec {

struct WeightMatrix {
    DType dtype;
    const void* data;
    int64_t n_rows;      // N: output features
    int64_t n_cols;      // K: input features (multiple of 32 for quantized types)
    size_t row_bytes;    // stride between weight rows in bytes
    // The same rows packed (pack_weights, whole 16-row panels), or nullptr: then dot_rows_packed
    // reads them instead, with the same bits.
    const void* packed = nullptr;
};

// Y[m][n] = dot(W row n, X row m) for m < M, n < N. X rows are K floats with stride x_stride
// floats; Y rows have stride y_stride floats. Every Y element is bit-identical whatever M, the
// position of row m in X, and the number of threads (batch invariance, design.md invariant 7).
// scratch holds the prepared activations and is grown as needed.
void matmul(const WeightMatrix& w, const float* x, int64_t x_stride, int64_t m, float* y,
            int64_t y_stride, ThreadPool& pool, std::vector<uint8_t>& scratch);

// One weight matrix of a group and where its product goes.
struct MatmulPart {
    WeightMatrix w;
    float* y;
    int64_t y_stride;
};
constexpr int kMaxMatmulParts = 4;

// Several products of the same activations (q/k/v, gate/up) in one pass through the pool: the
// weights must share their type and K; the activations are prepared once. Each Y element has the
// bits matmul gives it alone (its weight rows are cut into the same panels).
void matmul_group(const MatmulPart* parts, int n_parts, const float* x, int64_t x_stride, int64_t m,
                  ThreadPool& pool, std::vector<uint8_t>& scratch);

// The same product by the scalar definitions (prepare_activation_row_reference,
// dot_row_reference), one thread; tests hold matmul to it bit for bit.
void matmul_reference(const WeightMatrix& w, const float* x, int64_t x_stride, int64_t m, float* y,
                      int64_t y_stride);

}  // namespace pyspec
