// KV cache for up to n_seq_max sequences. Sequence s owns the cells
// [s * n_ctx_seq, (s + 1) * n_ctx_seq) and position p lives in cell s * n_ctx_seq + p, so a
// row's K/V location never depends on which other sequences share the cache, and rollback is
// just marking positions empty.
#pragma once

#include <cstdint>
#include <vector>

#include "core/backend.h"
#include "model/decoder_graph.h"

namespace pyspec {

class KvCache {
public:
    KvCache(Backend& backend, const Hparams& hp, int64_t n_seq_max, int64_t n_ctx_seq, DType dtype);

    const KvCacheView& view() const { return view_; }
    int64_t n_seq_max() const { return n_seq_max_; }
    int64_t n_ctx_seq() const { return n_ctx_seq_; }
    size_t bytes() const { return bytes_; }
    size_t row_bytes() const { return row_bytes_; }  // one cell of one layer's K (or V)
    int64_t n_layer() const { return static_cast<int64_t>(view_.k.size()); }

    // Layer il's K (v = false) or V matrix, [row elements, n_cells] rows of row_bytes, as an
    // external tensor: the handle for Backend::read/write of its cells (host code never touches
    // cache memory directly: on a GPU backend it is device memory).
    Tensor matrix(int64_t il, bool v) const;

    int64_t cell(int32_t seq, int32_t pos) const { return static_cast<int64_t>(seq) * n_ctx_seq_ + pos; }
    bool occupied(int32_t seq, int32_t pos) const { return occ_[static_cast<size_t>(seq)][static_cast<size_t>(pos)] != 0; }
    void occupy(int32_t seq, int32_t pos);
    // Removes positions [p0, p1) of a sequence (p1 < 0: to the end).
    void remove(int32_t seq, int64_t p0, int64_t p1);
    void clear(int32_t seq);  // seq < 0: every sequence
    int64_t pos_max(int32_t seq) const { return pos_max_[static_cast<size_t>(seq)]; }  // -1: empty

private:
    int64_t n_seq_max_;
    int64_t n_ctx_seq_;
    size_t bytes_ = 0;
    size_t row_bytes_ = 0;
    int64_t row_elems_ = 0;
    KvCacheView view_;
    std::vector<std::vector<uint8_t>> occ_;
    std::vector<int64_t> pos_max_;
};

}  // namespace pyspec
