// What the attention kernels (ops_attention.cu: one (head, row) per block; ops_attention_staged.cu:
// the same with K/V staged by cp.async; ops_attention_tiled.cu: a kv head's query heads over a tile
// of rows per block) share: the cell chunking that fixes every row's order of operations, so all
// three give a row the same bits.
#pragma once

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace pyspec {
namespace cuda {

constexpr int kWarps = 8;    // warps per block; chunk c belongs to warp c mod kWarps
constexpr int kChunk = 32;   // cells per chunk (absolute cells 32c .. 32c + 31): one per lane

// Folds one chunk's scores into a warp's online-softmax state (m, l): s is this lane's cell's
// score (-inf when masked or outside the row). Returns false, leaving the state untouched, while
// no cell seen so far is unmasked (warp-uniform); else sets p (this cell's weight, 0 for -inf) and
// corr (the factor for what the state held, 0 from an empty state) and updates m and l. The
// caller then scales its accumulators by corr and adds the chunk's V rows weighted by p in cell
// order. Every kernel folds with this function (the tiled one with fold_empty_chunks below, its
// operations on several states at once), one source of their shared bits.
__device__ __forceinline__ bool fold_chunk(float s, float& m, float& l, float& p, float& corr) {
    const float mc = fmaxf(m, warp_max(s));
    if (mc == -INFINITY) return false;
    p = s == -INFINITY ? 0.0f : expf(s - mc);
    corr = expf(m - mc);  // m = -inf -> 0
    l = fmaf(l, corr, warp_sum(p));
    m = mc;
    return true;
}

// fold_chunk on N empty states (m = -inf, l = 0) at once, each with exactly fold_chunk's
// operations, so the same bits: the tiled kernel's jobs over one chunk. Straight-line code, so the
// N states' shuffle reductions overlap instead of following one another. A state with nothing
// unmasked stays empty and gets p = 0 (its V sum then skips every cell). fold_chunk's corr is 0
// here (m = -inf), so the caller's accumulators start at its 0 * corr = +0.
template <int N>
__device__ __forceinline__ void fold_empty_chunks(const float (&s)[N], float (&m)[N], float (&l)[N], float (&p)[N]) {
    float mc[N], sum[N];
#pragma unroll
    for (int n = 0; n < N; ++n) mc[n] = fmaxf(-INFINITY, warp_max(s[n]));
    // The exponentials are taken whatever the outcome and the unwanted ones dropped (selects, not
    // branches): a dropped value is never used, a kept one is fold_chunk's.
#pragma unroll
    for (int n = 0; n < N; ++n) {
        const float e = expf(s[n] - mc[n]);
        p[n] = s[n] == -INFINITY || mc[n] == -INFINITY ? 0.0f : e;
    }
#pragma unroll
    for (int n = 0; n < N; ++n) sum[n] = warp_sum(p[n]);
#pragma unroll
    for (int n = 0; n < N; ++n) {
        const float m0 = -INFINITY, l0 = 0.0f;
        const float corr = expf(m0 - mc[n]);
        const float l1 = fmaf(l0, corr, sum[n]);
        const bool folded = mc[n] != -INFINITY;
        m[n] = folded ? mc[n] : m0;
        l[n] = folded ? l1 : l0;
    }
}

// The order of a row's sums beyond one chunk: pages. Page g holds kWarps consecutive chunks (cells
// 256g .. 256g + 255 by absolute index), chunk kWarps * g + w belonging to warp w (so chunk c to warp
// c mod kWarps), folded from the empty state. The page's state is the warps' states merged in the
// order w = 0 .. kWarps-1 (page_weights, page_acc); the row's state is the pages' states combined in
// increasing g (combine_page, combine_acc), and its output is acc * row_scale(l). Pages are
// independent until that last fold, so a long row may compute its pages in separate blocks
// (ops_attention_staged.cu) and still get the bits of a block that walks them in order. A row whose
// cells lie in one page gets (sum_w acc_w wsc_w) / (sum_w l_w wsc_w).
constexpr int kPageCells = kChunk * kWarps;

struct PageWeights {
    float m;              // the page's max score (-inf: nothing unmasked in it)
    float l;              // its softmax denominator at that max
    float wsc[kWarps];    // each warp's factor
};

// m_of(w), l_of(w): warp w's state after folding its chunk of the page (or none).
template <typename MOf, typename LOf>
__device__ __forceinline__ PageWeights page_weights(MOf m_of, LOf l_of) {
    PageWeights pw;
    pw.m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) pw.m = fmaxf(pw.m, m_of(w));
    pw.l = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
        const float mw = m_of(w);
        pw.wsc[w] = mw == -INFINITY ? 0.0f : expf(mw - pw.m);
        pw.l = fmaf(l_of(w), pw.wsc[w], pw.l);
    }
    return pw;
}

// Element d of the page's accumulator; acc_of(w, d) reads warp w's.
template <typename AccOf>
__device__ __forceinline__ float page_acc(const PageWeights& pw, int d, AccOf acc_of) {
    float v = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v = fmaf(acc_of(w, d), pw.wsc[w], v);
    return v;
}

// Combines a page (m_g, l_g) into the row's running (m, l), pages in increasing order: false for an
// empty page (nothing changes), else a and b are the factors of what the row held and of the page.
// The row starts empty (m = -inf, l = 0, accumulators 0): the first page's factors are 0 and 1.
__device__ __forceinline__ bool combine_page(float& m, float& l, float m_g, float l_g, float& a, float& b) {
    if (m_g == -INFINITY) return false;
    const float mn = fmaxf(m, m_g);
    a = expf(m - mn);  // m = -inf -> 0
    b = expf(m_g - mn);
    l = fmaf(l_g, b, l * a);
    m = mn;
    return true;
}
__device__ __forceinline__ float combine_acc(float acc, float acc_g, float a, float b) {
    return fmaf(acc_g, b, acc * a);
}
__device__ __forceinline__ float row_scale(float l) { return l > 0.0f ? 1.0f / l : 0.0f; }

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
// A single row over more than two pages is split over blocks, a page per block, when the scratch
// holds its pages (attention_split_scratch); else one block walks the pages.
void launch_attention_staged(const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v, const TDesc& mask,
                             const int32_t* base, int n_kv_head, float scale, const SplitScratch& scratch,
                             unsigned* err, cudaStream_t s);

// Prompt rows on tensor cores (ops_attention_tc.cu): F16 cache, head_dim 32/64/128, 16-byte
// aligned cache rows. Their own computation, not the CUDA-core kernels' bits: every prompt row gets
// the same bits in any batch, as every output row does from the kernels above.
bool attention_tc_supports(const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v, const TDesc& mask,
                           int n_kv_head);
void launch_attention_tc(const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v, const TDesc& mask,
                         const int32_t* base, int n_kv_head, float scale, unsigned* err, cudaStream_t s);

void launch_attention_tiled(const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v, const TDesc& mask,
                            const int32_t* base, int n_kv_head, float scale, unsigned* err, cudaStream_t s);

}  // namespace cuda
}  // namespace pyspec
