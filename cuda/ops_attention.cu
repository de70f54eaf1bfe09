// Fused attention (decode and prefill): one block of kWarps warps per (query head, row). Row r
// attends cells base[r] + j, j < span, with mask[r][j] added to the score; masked (-inf) cells are
// skipped, as on the CPU. GQA: query head h reads kv head h / (n_head / n_kv_head). K/V are F16 or
// F32 (the cache tensors' dtype), read through their row stride (cache views). The general kernel:
// single rows of F16 caches take ops_attention_staged.cu, batches ops_attention_tiled.cu, all three
// with the same bits.
//
// The cells are cut into chunks of 32 by absolute cell index (chunk c holds cells 32c .. 32c + 31)
// and pages of kWarps chunks; chunk c belongs to warp c mod kWarps. In a chunk, lane i scores cell
// 32c + i on its own (a sequential dot product over the head dim, q from shared memory), so 32
// cells are in flight at once rather than one. The warp folds the chunk into an empty
// online-softmax state (the chunk's max, p = exp(s - max), the chunk's p summed by a fixed
// butterfly, V rows added in cell order, lanes over the head dim); the page's warps' states merge in
// the order w = 0 .. kWarps-1 and the pages combine in increasing order (attention_common.cuh).
//
// Batch invariance (design.md invariant 7): which warp sees a cell, the lane it sits in and the
// order of every sum depend on the cell's absolute index alone, never on base[r] or on the span
// (the batch's padding). A masked or out-of-range cell has p = 0 exactly and its V row is never
// read; a chunk or page with no unmasked cell changes nothing. So a row's bits depend only on its
// own query, its unmasked cells and their mask values, whatever rows share the batch.
#include "cuda/attention_common.cuh"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"

namespace pyspec {
namespace cuda {
namespace {

constexpr int kVBatch = 8;       // V rows whose loads are issued together
constexpr int kMaxPerLane = 8;   // head_dim <= 256

// Asks for the 128-byte line at p to be brought into L1 ahead of its load; no value changes.
__device__ __forceinline__ void prefetch_l1(const char* p) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

template <typename T>
__device__ __forceinline__ float kv_load(const char* p);
template <>
__device__ __forceinline__ float kv_load<float>(const char* p) { return *reinterpret_cast<const float*>(p); }
template <>
__device__ __forceinline__ float kv_load<uint16_t>(const char* p) { return h2f(*reinterpret_cast<const uint16_t*>(p)); }

// q . k over the head dim, in order d = 0 .. hd-1. kVec: the row is contiguous and 16-byte
// aligned, read 16 bytes at a time (the same fmaf sequence, so the same bits).
template <typename T, bool kVec>
__device__ __forceinline__ float dot_row(const float* qs, const char* krow, int64_t nb0, int hd) {
    float dot = 0.0f;
    if (kVec) {
        constexpr int kPer = 16 / sizeof(T);
        const uint4* kp = reinterpret_cast<const uint4*>(krow);
#pragma unroll 8
        for (int d0 = 0; d0 < hd; d0 += kPer) {
            const uint4 raw = kp[d0 / kPer];
            if (sizeof(T) == 2) {
                const uint16_t* hv = reinterpret_cast<const uint16_t*>(&raw);
#pragma unroll
                for (int e = 0; e < kPer; ++e) dot = fmaf(qs[d0 + e], h2f(hv[e]), dot);
            } else {
                const float* fv = reinterpret_cast<const float*>(&raw);
#pragma unroll
                for (int e = 0; e < kPer; ++e) dot = fmaf(qs[d0 + e], fv[e], dot);
            }
        }
    } else {
#pragma unroll 8
        for (int d = 0; d < hd; ++d) dot = fmaf(qs[d], kv_load<T>(krow + d * nb0), dot);
    }
    return dot;
}

// NC: head dims per lane (hd <= 32 * NC), so registers hold exactly what the head needs.
template <typename T, bool kVec, int NC>
__global__ void __launch_bounds__(kWarps * 32) k_attention(TDesc dst, TDesc q, TDesc kc, TDesc vc, TDesc mask,
                                                             const int32_t* base, int n_kv_head, float scale,
                                                             unsigned* err) {
    pdl_enter();
    __shared__ float s_q[32 * NC];
    __shared__ float s_acc[kWarps][32 * NC];
    __shared__ float s_m[kWarps], s_l[kWarps];
    const int h = blockIdx.x;
    const int64_t r = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int hd = static_cast<int>(q.ne[0]);
    const int n_head = static_cast<int>(q.ne[1]);
    const int n_rep = n_head / n_kv_head;
    const int kvh = h / n_rep;
    const int64_t span = mask.ne[0];
    const int64_t b0 = base[r];
    float* o = reinterpret_cast<float*>(dst.data + h * dst.nb[1] + r * dst.nb[2]);
    if (b0 < 0 || b0 + span > kc.ne[1]) {
        if (threadIdx.x == 0) atomicOr(err, kErrAttentionSpan);
        for (int d = threadIdx.x; d < hd; d += blockDim.x) o[d] = 0.0f;
        return;
    }
    const float* qr = reinterpret_cast<const float*>(q.data + h * q.nb[1] + r * q.nb[2]);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) s_q[d] = qr[d];
    __syncthreads();
    const float* mrow = reinterpret_cast<const float*>(mask.data + r * mask.nb[1]);
    const int64_t col0 = static_cast<int64_t>(kvh) * hd;
    // The row's running state (attention_common.cuh: pages combined in order); thread d holds
    // element d of the accumulator (hd <= 256 = the block's threads), every thread (m_row, l_row).
    float acc_row = 0.0f, m_row = -INFINITY, l_row = 0.0f;
    const int64_t c_first = span > 0 ? b0 / kChunk : 0;
    const int64_t c_last = span > 0 ? (b0 + span - 1) / kChunk : -1;
    for (int64_t g = c_first / kWarps; g <= c_last / kWarps && c_last >= 0; ++g) {
        const int64_t ch = g * kWarps + warp;  // this warp's chunk of page g
        float acc[NC];
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[c] = 0.0f;
        float m = -INFINITY, l = 0.0f;
        if (ch >= c_first && ch <= c_last) {
            const int64_t cell = ch * kChunk + lane;
            const int64_t j = cell - b0;
            float s = -INFINITY;
            if (j >= 0 && j < span) {
                // The K row is read and scored before the mask value is known, so the two loads
                // overlap instead of following each other (decode is bound by these round trips,
                // not by bandwidth); a masked cell's score is dropped unused (its cell may hold
                // anything). This cell's V row is read after the chunk's scores: its lines start
                // arriving now, behind the K loads. A contiguous row only.
                if (kVec) {
                    const char* vrow = vc.data + cell * vc.nb[1] + col0 * vc.nb[0];
                    for (int64_t off = 0; off < static_cast<int64_t>(hd) * vc.nb[0]; off += 128) prefetch_l1(vrow + off);
                }
                const char* krow = kc.data + cell * kc.nb[1] + col0 * kc.nb[0];
                const float mj = mrow[j];
                const float dot = dot_row<T, kVec>(s_q, krow, kc.nb[0], hd);
                if (mj != -INFINITY) s = fmaf(dot, scale, mj);
            }
            float p, corr;
            if (fold_chunk(s, m, l, p, corr)) {  // else nothing unmasked in the chunk (warp-uniform)
                // V rows in cell order. Loads go out kVBatch rows at a time, before their fmafs,
                // so the warp waits once per batch rather than once per row. A row with p = 0
                // (masked, out of range or underflowed) is neither read nor added.
                const char* vchunk = vc.data + (ch * kChunk) * vc.nb[1] + col0 * vc.nb[0];
#pragma unroll
                for (int i0 = 0; i0 < kChunk; i0 += kVBatch) {
                    float pv[kVBatch], vv[kVBatch][NC];
#pragma unroll
                    for (int b = 0; b < kVBatch; ++b) {
                        pv[b] = __shfl_sync(0xffffffffu, p, i0 + b);
                        const char* vrow = vchunk + (i0 + b) * vc.nb[1];
#pragma unroll
                        for (int c = 0; c < NC; ++c) {
                            const int d = lane + 32 * c;
                            vv[b][c] = pv[b] != 0.0f && d < hd ? kv_load<T>(vrow + d * vc.nb[0]) : 0.0f;
                        }
                    }
#pragma unroll
                    for (int b = 0; b < kVBatch; ++b) {
#pragma unroll
                        for (int c = 0; c < NC; ++c) {
                            if (pv[b] != 0.0f) acc[c] = fmaf(pv[b], vv[b][c], acc[c]);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int c = 0; c < NC; ++c) s_acc[warp][lane + 32 * c] = acc[c];
        if (lane == 0) {
            s_m[warp] = m;
            s_l[warp] = l;
        }
        __syncthreads();
        const PageWeights pw = page_weights([&](int w) { return s_m[w]; }, [&](int w) { return s_l[w]; });
        float fa, fb;
        if (combine_page(m_row, l_row, pw.m, pw.l, fa, fb) && threadIdx.x < hd) {
            acc_row = combine_acc(acc_row, page_acc(pw, threadIdx.x, [&](int w, int d) { return s_acc[w][d]; }), fa, fb);
        }
        __syncthreads();  // the page's states are read before the next page's replace them
    }
    if (threadIdx.x < hd) o[threadIdx.x] = acc_row * row_scale(l_row);
}

template <typename T, bool kVec>
void launch_typed(const dim3& grid, const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v,
                  const TDesc& mask, const int32_t* base, int n_kv_head, float scale, unsigned* err, cudaStream_t s) {
    // The per-lane width follows head_dim alone, never the batch: a row's bits cannot depend on it.
    if (q.ne[0] <= 64) {
        launch(k_attention<T, kVec, 2>, grid, kWarps * 32, 0, s, dst, q, k, v, mask, base, n_kv_head, scale, err);
    } else if (q.ne[0] <= 128) {
        launch(k_attention<T, kVec, 4>, grid, kWarps * 32, 0, s, dst, q, k, v, mask, base, n_kv_head, scale, err);
    } else {
        launch(k_attention<T, kVec, 8>, grid, kWarps * 32, 0, s, dst, q, k, v, mask, base, n_kv_head, scale, err);
    }
}

}  // namespace

void launch_attention(const TDesc& dst_all, const TDesc& q_all, const TDesc& k, const TDesc& v,
                      const TDesc& mask_all, const int32_t* base, int n_kv_head, float scale, int64_t prompt_rows,
                      const SplitScratch& scratch, unsigned* err, cudaStream_t s) {
    if (q_all.ne[0] > 32 * kMaxPerLane) throw std::runtime_error("cuda backend: attention: head_dim above 256");
    if (n_kv_head <= 0 || q_all.ne[1] % n_kv_head != 0) throw std::runtime_error("cuda backend: attention: bad n_kv_head");
    if (k.dtype != v.dtype || (k.dtype != DType::F16 && k.dtype != DType::F32)) {
        throw std::runtime_error("cuda backend: attention: KV cache must be F16 or F32");
    }
    if (prompt_rows < 0 || prompt_rows > q_all.ne[2]) {
        throw std::runtime_error("cuda backend: attention: prompt rows outside the rows");
    }
    if (q_all.ne[2] == 0 || q_all.ne[1] == 0) return;
    // Prompt rows [0, p) on tensor cores, each kind of row with one computation (invariant 7 per
    // kind); the output rows [p, n) through views of their rows, on the kernels below.
    TDesc dst = dst_all, q = q_all, mask = mask_all;
    if (prompt_rows > 0 && attention_tc_enabled() && attention_tc_supports(dst_all, q_all, k, v, mask_all, n_kv_head)) {
        TDesc dp = dst_all, qp = q_all, mp = mask_all;
        dp.ne[2] = qp.ne[2] = mp.ne[1] = prompt_rows;
        launch_attention_tc(dp, qp, k, v, mp, base, n_kv_head, scale, err, s);
        if (prompt_rows == q_all.ne[2]) return;
        dst.data += prompt_rows * dst.nb[2];
        q.data += prompt_rows * q.nb[2];
        mask.data += prompt_rows * mask.nb[1];
        dst.ne[2] = q.ne[2] = mask.ne[1] = q_all.ne[2] - prompt_rows;
        base += prompt_rows;
    }
    if (q.ne[2] > 65535) throw std::runtime_error("cuda backend: attention: more than 65535 rows");
    // Batches of rows take the row-tiled kernel: the same bits per row (ops_attention_tiled.cu),
    // K/V read once per kv head and tile instead of once per query head and row. Up to
    // kStagedMaxRows rows (a verify pass, a draft block) take the staged kernel row by row instead:
    // a block per (head, row) rather than one per kv head for the whole tile (SmolLM2's 3-row verify:
    // 27 blocks against 3). The same bits either way, so the choice by rows is free.
    constexpr int64_t kStagedMaxRows = 4;
    const bool staged_rows = q.ne[2] <= kStagedMaxRows && attention_staged_enabled() && attention_staged_supports(q, k, v);
    if (q.ne[2] > 1 && !staged_rows && attention_tiled_enabled() && attention_tiled_supports(q, k, v, n_kv_head)) {
        launch_attention_tiled(dst, q, k, v, mask, base, n_kv_head, scale, err, s);
        return;
    }
    if (attention_staged_enabled() && attention_staged_supports(q, k, v)) {
        launch_attention_staged(dst, q, k, v, mask, base, n_kv_head, scale, scratch, err, s);
        return;
    }
    const dim3 grid(static_cast<unsigned>(q.ne[1]), static_cast<unsigned>(q.ne[2]));
    // 16-byte K rows: every row of the view starts 16-byte aligned and is contiguous. A property
    // of the cache's layout, the same for every batch, so it cannot change a row's bits (both
    // paths run the same fmaf sequence anyway).
    const size_t el = k.dtype == DType::F16 ? 2 : 4;
    const bool vec = static_cast<size_t>(k.nb[0]) == el && (reinterpret_cast<uintptr_t>(k.data) % 16) == 0 &&
                     k.nb[1] % 16 == 0 && (q.ne[0] * el) % 16 == 0;
    if (k.dtype == DType::F16) {
        if (vec) launch_typed<uint16_t, true>(grid, dst, q, k, v, mask, base, n_kv_head, scale, err, s);
        else launch_typed<uint16_t, false>(grid, dst, q, k, v, mask, base, n_kv_head, scale, err, s);
    } else {
        if (vec) launch_typed<float, true>(grid, dst, q, k, v, mask, base, n_kv_head, scale, err, s);
        else launch_typed<float, false>(grid, dst, q, k, v, mask, base, n_kv_head, scale, err, s);
    }
}

}  // namespace cuda
}  // namespace pyspec
