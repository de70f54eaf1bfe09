// Threading and activation preparation around dot_rows. Each thread owns a contiguous range of
// weight rows, in whole panels, and computes every activation row against it, so no output
// element depends on how many threads there are.
#include "cpu/matmul.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cpu/quants.h"

namespace pyspec {
namespace {

// Weight rows are handed out in multiples of the widest kernel panel (a packed panel's rows too).
constexpr int64_t kRowUnit = 16;
static_assert(kRowUnit % kPackedPanelRows == 0, "a thread's rows start a packed panel");
// Up to this many activation values, every thread quantizes all rows for itself: that costs
// less than the extra pass through the pool that sharing the work needs.
constexpr int64_t kPrivatePrepareValues = 8192;

void check(const WeightMatrix& w, int64_t m) {
    if (m < 0 || w.n_rows < 0 || w.n_cols < 0) throw std::invalid_argument("matmul: negative size");
    if (w.n_cols % dtype_block_size(w.dtype) != 0) {
        throw std::invalid_argument("matmul: " + std::to_string(w.n_cols) + " columns is not a multiple of " +
                                    dtype_name(w.dtype) + "'s block size");
    }
    if (w.row_bytes < dtype_row_bytes(w.dtype, w.n_cols)) throw std::invalid_argument("matmul: row stride is smaller than a row");
    if (w.packed && !weights_packable(w.dtype)) throw std::invalid_argument("matmul: packed weights of a type without a packed layout");
    activation_row_bytes(w.dtype, w.n_cols);  // throws for types without a dot product
}

}  // namespace

void matmul(const WeightMatrix& w, const float* x, int64_t x_stride, int64_t m, float* y, int64_t y_stride,
            ThreadPool& pool, std::vector<uint8_t>& scratch) {
    const MatmulPart part{w, y, y_stride};
    matmul_group(&part, 1, x, x_stride, m, pool, scratch);
}

void matmul_group(const MatmulPart* parts, int n_parts, const float* x, int64_t x_stride, int64_t m,
                  ThreadPool& pool, std::vector<uint8_t>& scratch) {
    if (n_parts < 1 || n_parts > kMaxMatmulParts) throw std::invalid_argument("matmul: 1 to 4 weight matrices per group");
    const WeightMatrix& w0 = parts[0].w;
    // The parts' row units one after another: a thread's share is a contiguous run of them, and
    // a part's rows are cut into panels from its own row 0 as when it runs alone.
    int64_t first_unit[kMaxMatmulParts + 1] = {0};
    for (int i = 0; i < n_parts; ++i) {
        const WeightMatrix& w = parts[i].w;
        check(w, m);
        if (w.dtype != w0.dtype || w.n_cols != w0.n_cols) throw std::invalid_argument("matmul: a group's weights differ in type or K");
        first_unit[i + 1] = first_unit[i] + (w.n_rows + kRowUnit - 1) / kRowUnit;
    }
    const int64_t units = first_unit[n_parts];
    if (m == 0 || units == 0) return;
    const int64_t k = w0.n_cols;
    auto multiply = [&](const void* act, size_t act_stride, int ith, int nth) {
        int64_t u0, u1;
        split_range(units, ith, nth, u0, u1);
        for (int i = 0; i < n_parts; ++i) {
            const int64_t a = std::max(u0, first_unit[i]), b = std::min(u1, first_unit[i + 1]);
            if (a >= b) continue;
            const WeightMatrix& w = parts[i].w;
            const int64_t r0 = (a - first_unit[i]) * kRowUnit, r1 = std::min((b - first_unit[i]) * kRowUnit, w.n_rows);
            if (w.packed) {  // r0 starts a panel (kRowUnit)
                dot_rows_packed(w.dtype,
                                static_cast<const uint8_t*>(w.packed) + (r0 / kPackedPanelRows) * packed_panel_bytes(w.dtype, k),
                                r1 - r0, act, act_stride, m, k, parts[i].y + r0, parts[i].y_stride);
            } else {
                dot_rows(w.dtype, static_cast<const uint8_t*>(w.data) + r0 * w.row_bytes, w.row_bytes, r1 - r0, act,
                         act_stride, m, k, parts[i].y + r0, parts[i].y_stride);
            }
        }
    };
    if (!dtype_is_quantized(w0.dtype)) {  // float weights take the activations as they are
        pool.run([&](int ith, int nth) { multiply(x, static_cast<size_t>(x_stride) * sizeof(float), ith, nth); });
        return;
    }
    const size_t act_row = activation_row_bytes(w0.dtype, k);
    const int n_threads = pool.size();
    if (n_threads == 1 || m * k <= kPrivatePrepareValues) {
        scratch.resize(static_cast<size_t>(n_threads) * static_cast<size_t>(m) * act_row);
        pool.run([&](int ith, int nth) {
            uint8_t* act = scratch.data() + static_cast<size_t>(ith) * static_cast<size_t>(m) * act_row;
            for (int64_t r = 0; r < m; ++r) prepare_activation_row(w0.dtype, x + r * x_stride, act + r * act_row, k);
            multiply(act, act_row, ith, nth);
        });
        return;
    }
    scratch.resize(static_cast<size_t>(m) * act_row);
    pool.run([&](int ith, int nth) {
        int64_t r0, r1;
        split_range(m, ith, nth, r0, r1);
        for (int64_t r = r0; r < r1; ++r) prepare_activation_row(w0.dtype, x + r * x_stride, scratch.data() + r * act_row, k);
    });
    pool.run([&](int ith, int nth) { multiply(scratch.data(), act_row, ith, nth); });
}

void matmul_reference(const WeightMatrix& w, const float* x, int64_t x_stride, int64_t m, float* y,
                      int64_t y_stride) {
    check(w, m);
    std::vector<uint8_t> act(activation_row_bytes(w.dtype, w.n_cols));
    for (int64_t r = 0; r < m; ++r) {
        prepare_activation_row_reference(w.dtype, x + r * x_stride, act.data(), w.n_cols);
        for (int64_t i = 0; i < w.n_rows; ++i) {
            y[r * y_stride + i] = dot_row_reference(w.dtype, static_cast<const uint8_t*>(w.data) + i * w.row_bytes,
                                                    act.data(), w.n_cols);
        }
    }
}

}  // namespace pyspec
