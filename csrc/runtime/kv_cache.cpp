#include "runtime/kv_cache.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace pyspec {

KvCache::KvCache(Backend& backend, const Hparams& hp, int64_t n_seq_max, int64_t n_ctx_seq, DType dtype)
    : n_seq_max_(n_seq_max), n_ctx_seq_(n_ctx_seq) {
    view_.dtype = dtype;
    view_.n_cells = n_seq_max * n_ctx_seq;
    row_elems_ = hp.head_dim * hp.n_head_kv;
    row_bytes_ = dtype_row_bytes(dtype, row_elems_);
    const size_t matrix_bytes = row_bytes_ * static_cast<size_t>(view_.n_cells);
    for (int64_t il = 0; il < hp.n_layer; ++il) {
        view_.k.push_back(backend.alloc_persistent(matrix_bytes));
        view_.v.push_back(backend.alloc_persistent(matrix_bytes));
        bytes_ += 2 * matrix_bytes;
    }
    occ_.assign(static_cast<size_t>(n_seq_max), std::vector<uint8_t>(static_cast<size_t>(n_ctx_seq), 0));
    pos_max_.assign(static_cast<size_t>(n_seq_max), -1);
}

Tensor KvCache::matrix(int64_t il, bool v) const {
    if (il < 0 || il >= n_layer()) throw std::out_of_range("kv cache: layer " + std::to_string(il) + " out of range");
    Tensor t;
    t.dtype = view_.dtype;
    t.flags = kExternal;
    t.ne = {row_elems_, view_.n_cells, 1, 1};
    t.nb = contiguous_strides(view_.dtype, t.ne);  // nb[1] = row_bytes_
    t.data = v ? view_.v[static_cast<size_t>(il)] : view_.k[static_cast<size_t>(il)];
    t.name = std::string(v ? "cache_v" : "cache_k") + std::to_string(il);
    return t;
}

void KvCache::occupy(int32_t seq, int32_t pos) {
    occ_[static_cast<size_t>(seq)][static_cast<size_t>(pos)] = 1;
    pos_max_[static_cast<size_t>(seq)] = std::max<int64_t>(pos_max_[static_cast<size_t>(seq)], pos);
}

void KvCache::remove(int32_t seq, int64_t p0, int64_t p1) {
    if (seq < 0 || seq >= n_seq_max_) throw std::invalid_argument("kv_remove: seq_id " + std::to_string(seq) + " out of range");
    if (p1 < 0 || p1 > n_ctx_seq_) p1 = n_ctx_seq_;
    if (p0 < 0) p0 = 0;
    auto& occ = occ_[static_cast<size_t>(seq)];
    for (int64_t p = p0; p < p1; ++p) occ[static_cast<size_t>(p)] = 0;
    int64_t& mx = pos_max_[static_cast<size_t>(seq)];
    while (mx >= 0 && occ[static_cast<size_t>(mx)] == 0) --mx;
}

void KvCache::clear(int32_t seq) {
    if (seq >= n_seq_max_) throw std::invalid_argument("kv_clear: seq_id " + std::to_string(seq) + " out of range");
    for (int64_t s = 0; s < n_seq_max_; ++s) {
        if (seq >= 0 && s != seq) continue;
        std::fill(occ_[static_cast<size_t>(s)].begin(), occ_[static_cast<size_t>(s)].end(), 0);
        pos_max_[static_cast<size_t>(s)] = -1;
    }
}

}  // namespace pyspec
