// What the attention kernels (ops_attention.cu: one (head, row) per block; ops_attention_staged.cu:
// the same with K/V staged by cp.async; ops_attention_tiled.cu: a kv head's query heads over a tile
// of rows per block) share: the cell chunking that fixes every row's order of operations, so all
// three give a row the same bits.
#pragma once

#include "cuda/common.cuh"

namespace pyspec {
namespace cuda {

constexpr int kWarps = 8;    // warps per block; chunk c belongs to warp c mod kWarps
constexpr int kChunk = 32;   // cells per chunk (absolute cells 32c .. 32c + 31): one per lane

// Folds one chunk's scores into a warp's online-softmax state (m, l): s is this lane's cell's
// score (-inf when masked or outside the row). Returns false, leaving the state untouched, while
// no cell seen so far is unmasked (warp-uniform); else sets p (this cell's weight, 0 for -inf) and
// corr (the factor for what the state held, 0 from an empty state) and updates m and l. The
// caller then scales its accumulators by corr and adds the chunk's V rows weighted by p in cell
// order. Every kernel folds with this function, one source of their shared bits.
__device__ __forceinline__ bool fold_chunk(float s, float& m, float& l, float& p, float& corr) {
    const float mc = fmaxf(m, warp_max(s));
    if (mc == -INFINITY) return false;
    p = s == -INFINITY ? 0.0f : expf(s - mc);
    corr = expf(m - mc);  // m = -inf -> 0
    l = fmaf(l, corr, warp_sum(p));
    m = mc;
    return true;
}

// The row's output from the warps' states, merged in the order w = 0 .. kWarps-1: element d of
// o for d = first, first + step, ... < hd. m_of(w), l_of(w) and acc_of(w, d) read warp w's state.
template <typename MOf, typename LOf, typename AccOf>
__device__ __forceinline__ void merge_warps(float* o, int hd, int first, int step, MOf m_of, LOf l_of,
                                            AccOf acc_of) {
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mm = fmaxf(mm, m_of(w));
    float wsc[kWarps];
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
        const float mw = m_of(w);
        wsc[w] = mw == -INFINITY ? 0.0f : expf(mw - mm);
        total = fmaf(l_of(w), wsc[w], total);
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int d = first; d < hd; d += step) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) v = fmaf(acc_of(w, d), wsc[w], v);
        o[d] = v * inv;
    }
}

// The row-tiled kernel serves batches (rows > 1, F16 cache, head_dim <= 128, 16-byte rows);
// PYSPEC_CUDA_ATT_TILED=0 turns it off. Checked on the H200: the per-row kernel's bits for every
// row, and every CUDA op and model test passes with it.
bool attention_tiled_enabled();
bool attention_tiled_supports(const TDesc& q, const TDesc& k, const TDesc& v, int n_kv_head);
// Single rows (decode) take the staged kernel (ops_attention_staged.cu: a warp's chunk of K/V copied
// into shared memory by cp.async; F16 cache, head_dim <= 128, 16-byte rows): the same bits again.
// PYSPEC_CUDA_ATT_STAGED=0 turns it off.
bool attention_staged_enabled();
bool attention_staged_supports(const TDesc& q, const TDesc& k, const TDesc& v);
void launch_attention_staged(const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v, const TDesc& mask,
                             const int32_t* base, int n_kv_head, float scale, unsigned* err, cudaStream_t s);

void launch_attention_tiled(const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v, const TDesc& mask,
                            const int32_t* base, int n_kv_head, float scale, unsigned* err, cudaStream_t s);

}  // namespace cuda
}  // namespace pyspec
