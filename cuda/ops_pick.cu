// ARGMAX and TOP_K: each row's best id, or its k best in order, under cpu/ops.cpp's order (larger
// value first, then smaller index; -0 equals +0; NaN is never picked, and ids past a row's
// non-NaN entries are -1 for TOP_K, the row's id 0 for ARGMAX).
//
// A row is read by one block, or, for the few long rows of a decode step (a vocabulary's logits),
// split: block g of the row takes the contiguous slice g, leaves its best (ARGMAX) or its k best in
// order (TOP_K) in the split scratch, and the row's last block to finish merges the slices.
// Why: one block reading a 151,936-entry row is a long chain of L2 round trips on one SM, on every
// decode step's critical path (the next step's token): ~18 us of a Qwen3-4B step (below). The order is total on the entries that can
// be picked, so the best (and the k best, each ranked among entries that contain everything better
// than it) are the same whichever blocks read which entries: the same ids either way.
// PYSPEC_CUDA_SPLIT_PICK=0 keeps one block a row (read once per process).
#include <algorithm>
#include <climits>

#include "cuda/kernels.h"
#include "cuda/launch.cuh"

namespace pyspec {
namespace cuda {
namespace {

constexpr int kArgmaxThreads = 512;
constexpr int kTopKThreads = 1024;
constexpr int kTopKChunks = 1024;      // at most this many chunk maxima (one per thread)
constexpr int kTopKCollected = 2048;   // entries collected at most (and slice candidates merged)
constexpr int64_t kTopKFiltered = 64;  // the largest k the filter serves (spec/target_law.h's kMaxSampledCandidates)

// Splitting: rows of at least 2 slices of kSliceMin entries, when a launch has at most
// kSplitRowsMax rows (a decode or verify step's few; a batch's many rows already fill the GPU).
// TOP_K splits only rows of kTopKSplitMin entries or more: its slices' second read and the merge
// cost more than they save on shorter rows. H200, tg128 on the engine path, two alternating rounds
// (split / one block a row): greedy (ARGMAX) SmolLM2 Q4_1 (49,152 ids) 1,583 / 1,587 against 1,576
// / 1,576 t/s, Qwen3-4B F16 (151,936 ids) 360.7 / 360.7 against 358.3 / 358.3; llama-server's
// sampling chain (TOP_K of 40) Qwen3-4B 353.9 / 354.0 against 352.3 / 352.4, SmolLM2 1,511 / 1,509
// against 1,518 / 1,517 (so SmolLM2's rows are not split for TOP_K).
constexpr int64_t kSliceMin = 4096;
constexpr int64_t kSplitRowsMax = 8;
constexpr int64_t kSlicesMax = 32;
constexpr int64_t kTopKSplitMin = 65536;

// (value, index) order of argmax / top_k: larger value first, then smaller index.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

// The warp's best (value, index); all lanes get it.
__device__ __forceinline__ void warp_best(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
}

// Block-wide best (value, index); all threads get it.
__device__ void block_best(float& v, int& i, float* sv, int* si) {
    warp_best(v, i);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    v = lane < nw ? sv[lane] : -INFINITY;
    i = lane < nw ? si[lane] : INT_MAX;
    warp_best(v, i);
}

// The block's smallest v; all threads get it.
__device__ float block_min(float v, float* sv) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) sv[warp] = v;
    __syncthreads();
    v = lane < nw ? sv[lane] : INFINITY;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The best (value, index) of ar[lo, hi) (indices of ar), INT_MAX when none can be picked; all
// threads get it. Four loads a thread are in flight before their comparisons.
__device__ void block_argmax(const float* ar, int64_t lo, int64_t hi, float& bv, int& bi, float* sv, int* si) {
    bv = -INFINITY;
    bi = INT_MAX;
    const int64_t step = blockDim.x;
    int64_t i = lo + threadIdx.x;
    for (; i + 3 * step < hi; i += 4 * step) {
        float v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = ar[i + u * step];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int ii = static_cast<int>(i + u * step);
            if (better(v[u], ii, bv, bi)) {
                bv = v[u];
                bi = ii;
            }
        }
    }
    for (; i < hi; i += step) {
        if (better(ar[i], static_cast<int>(i), bv, bi)) {
            bv = ar[i];
            bi = static_cast<int>(i);
        }
    }
    block_best(bv, bi, sv, si);
}

// Whether this block is the last of `blocks` to count in at *counter (all threads get it). The
// fence makes this block's stores visible before its count; the last block reads the others'
// through L2 (ld.cg) after seeing every count, and leaves the counter zero for the next launch.
__device__ bool last_to_finish(unsigned* counter, unsigned blocks, bool* s_last) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        *s_last = atomicAdd(counter, 1u) == blocks - 1;
        if (*s_last) *counter = 0;
    }
    __syncthreads();
    if (*s_last) __threadfence();
    return *s_last;
}

// Grid (slices, rows). One slice: the row's best. More: slice g's best into part[r][g] (value, id
// bits), and the row's last block the best of those.
__global__ void k_argmax(TDesc dst, TDesc a, float* part, unsigned* counters) {
    pdl_enter();
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ bool s_last;
    const int64_t r = blockIdx.y, n = a.ne[0], slices = gridDim.x, g = blockIdx.x;
    const float* ar = reinterpret_cast<const float*>(a.row(r));
    float bv;
    int bi;
    block_argmax(ar, n * g / slices, n * (g + 1) / slices, bv, bi, sv, si);
    if (slices > 1) {
        float* pr = part + 2 * r * slices;
        if (threadIdx.x == 0) {
            pr[2 * g] = bv;
            pr[2 * g + 1] = __int_as_float(bi);
        }
        if (!last_to_finish(&counters[r], static_cast<unsigned>(slices), &s_last)) return;
        bv = threadIdx.x < slices ? __ldcg(pr + 2 * threadIdx.x) : -INFINITY;
        bi = threadIdx.x < slices ? __float_as_int(__ldcg(pr + 2 * threadIdx.x + 1)) : INT_MAX;
        block_best(bv, bi, sv, si);
    }
    if (threadIdx.x == 0) reinterpret_cast<int32_t*>(dst.data)[r] = bi == INT_MAX ? 0 : bi;
}

struct TopKShared {
    float sv[32];
    int si[32];
    float cmax[kTopKChunks];
    float cv[kTopKCollected];
    int ci[kTopKCollected];
    int n_collected;
    int counts[kSlicesMax];
    bool last;
};

// k rounds of a block-wide best over the entries of ar[0, n) that come after the previous pick in
// the order: emit(rank, value, id), id -1 past the row's pickable entries. Every round reads the
// whole row: the way for short rows and for rows the filter below cannot narrow.
template <typename Emit>
__device__ void top_k_rounds(const float* ar, int64_t n, int64_t k, Emit emit, TopKShared& sh) {
    float pv = INFINITY;
    int pi = -1;
    bool first = true;
    for (int64_t round = 0; round < k; ++round) {
        float bv = -INFINITY;
        int bi = INT_MAX;
        if (round < n) {
            for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
                const float v = ar[i];
                const int ii = static_cast<int>(i);
                const bool after = first || better(pv, pi, v, ii);
                if (after && better(v, ii, bv, bi)) {
                    bv = v;
                    bi = ii;
                }
            }
        }
        block_best(bv, bi, sh.sv, sh.si);
        if (threadIdx.x == 0) emit(round, bv, bi == INT_MAX ? -1 : bi);
        pv = bv;
        pi = bi;
        first = false;
    }
}

// The k best of ar[0, n) in order, emit(rank, value, id) (ids of ar; -1 past the pickable
// entries), in two reads: the maxima of chunks of `chunk` entries give a floor, the k-th largest
// of them (k distinct entries reach it, so nothing below it is among the k best). The entries at
// or above it (a few hundred for a logits row) are collected in shared memory, and each one's rank
// is the number of collected entries before it in the order: the same ids in the same order as
// the rounds, which take rows whose collection does not fit (many entries equal to the floor) and
// chunk = 0.
template <typename Emit>
__device__ void block_top_k(const float* ar, int64_t n, int64_t k, int64_t chunk, Emit emit, TopKShared& sh) {
    if (chunk == 0) {
        top_k_rounds(ar, n, k, emit, sh);
        return;
    }
    const int n_chunks = static_cast<int>((n + chunk - 1) / chunk);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    for (int c = warp; c < n_chunks; c += n_warps) {
        const int64_t end = min(n, (c + 1) * chunk);
        float m = -INFINITY;
        for (int64_t i = c * chunk + lane; i < end; i += 32) m = fmaxf(m, ar[i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0) sh.cmax[c] = m;
    }
    if (threadIdx.x == 0) sh.n_collected = 0;
    __syncthreads();
    // The floor: the smallest chunk maximum with fewer than k maxima above it (the k-th largest).
    float f = INFINITY;
    if (threadIdx.x < n_chunks) {
        const float mine = sh.cmax[threadIdx.x];
        int above = 0;
        for (int c = 0; c < n_chunks; ++c) above += sh.cmax[c] > mine;
        if (above < k) f = mine;
    }
    const float floor = block_min(f, sh.sv);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = ar[i];
        if (v >= floor) {
            const int slot = atomicAdd(&sh.n_collected, 1);
            if (slot < kTopKCollected) {
                sh.cv[slot] = v;
                sh.ci[slot] = static_cast<int>(i);
            }
        }
    }
    __syncthreads();
    const int m = sh.n_collected;
    if (m > kTopKCollected) {  // block-uniform
        top_k_rounds(ar, n, k, emit, sh);
        return;
    }
    for (int s = threadIdx.x; s < m; s += blockDim.x) {
        const float v = sh.cv[s];
        const int i = sh.ci[s];
        int rank = 0;
        for (int t = 0; t < m; ++t) rank += better(sh.cv[t], sh.ci[t], v, i);
        if (rank < k) emit(rank, v, i);
    }
    for (int64_t j = m + threadIdx.x; j < k; j += blockDim.x) emit(j, -INFINITY, -1);  // only with NaN rows
}

// Grid (slices, rows); chunk as block_top_k's (for a slice's length when split). One slice: the
// row's k best. More: slice g's k best (values, then ids as bits) into part[r][g], and the row's
// last block ranks each of those among the others: a candidate's rank is its place in its own
// list plus, in every other list (sorted), the number of entries before it (a binary search).
// Everything better than one of the row's k best is among the k best of its own slice, so those
// ranks are the row's.
__global__ void k_top_k(TDesc dst, TDesc a, int64_t chunk, float* part, unsigned* counters) {
    pdl_enter();
    __shared__ TopKShared sh;
    const int64_t r = blockIdx.y, n = a.ne[0], k = dst.ne[0], slices = gridDim.x, g = blockIdx.x;
    const float* ar = reinterpret_cast<const float*>(a.row(r));
    int32_t* out = reinterpret_cast<int32_t*>(dst.row(r));
    if (slices == 1) {
        block_top_k(ar, n, k, chunk, [&](int64_t rank, float, int id) { out[rank] = id; }, sh);
        return;
    }
    const int64_t lo = n * g / slices;
    float* pr = part + 2 * k * slices * r;
    float* mine = pr + 2 * k * g;  // [k values][k ids]
    block_top_k(ar + lo, n * (g + 1) / slices - lo, k, chunk,
                [&](int64_t rank, float v, int id) {
                    mine[rank] = v;
                    mine[k + rank] = __int_as_float(id < 0 ? -1 : static_cast<int>(id + lo));
                },
                sh);
    if (!last_to_finish(&counters[r], static_cast<unsigned>(slices), &sh.last)) return;
    // The lists into shared memory (slices * k <= kTopKCollected), and each one's pickable length.
    const int total = static_cast<int>(slices * k);
    for (int t = threadIdx.x; t < total; t += blockDim.x) {
        const float* list = pr + 2 * k * (t / k);
        sh.cv[t] = __ldcg(list + t % k);
        sh.ci[t] = __float_as_int(__ldcg(list + k + t % k));
    }
    __syncthreads();
    if (threadIdx.x < slices) {
        int c = 0;
        while (c < k && sh.ci[threadIdx.x * k + c] >= 0) ++c;
        sh.counts[threadIdx.x] = c;
    }
    __syncthreads();
    int picked = 0;
    for (int s = 0; s < slices; ++s) picked += sh.counts[s];
    for (int t = threadIdx.x; t < total; t += blockDim.x) {
        const int own = t / static_cast<int>(k), place = t % static_cast<int>(k);
        if (place >= sh.counts[own]) continue;
        const float v = sh.cv[t];
        const int id = sh.ci[t];
        int64_t rank = place;
        for (int s = 0; s < slices && rank < k; ++s) {
            if (s == own) continue;
            const float* lv = sh.cv + s * k;
            const int* li = sh.ci + s * k;
            int lo_ = 0, hi_ = sh.counts[s];  // entries [0, lo_) are better than (v, id)
            while (lo_ < hi_) {
                const int mid = (lo_ + hi_) / 2;
                if (better(lv[mid], li[mid], v, id)) lo_ = mid + 1;
                else hi_ = mid;
            }
            rank += lo_;
        }
        if (rank < k) out[rank] = id;
    }
    for (int64_t j = picked + threadIdx.x; j < k; j += blockDim.x) out[j] = -1;  // only with NaN rows
}

bool split_pick_enabled() {
    static const bool on = env_switch("PYSPEC_CUDA_SPLIT_PICK") != 0;
    return on;
}

// Slices a row of n entries is split into for a launch of `rows` rows (k: TOP_K's k, 0 for ARGMAX).
int64_t pick_slices(int64_t n, int64_t rows, int64_t k) {
    if (!split_pick_enabled() || rows > kSplitRowsMax || k > kTopKFiltered || (k > 0 && n < kTopKSplitMin)) return 1;
    int64_t slices = std::min(n / kSliceMin, kSlicesMax);
    if (k > 0) slices = std::min<int64_t>(slices, kTopKCollected / k);
    return slices >= 2 ? slices : 1;
}

// TOP_K's filter chunk for rows (or slices) of n entries: chunks of at least min_chunk entries,
// at most kTopKChunks of them and at least k, or 0 (the rounds).
int64_t top_k_chunk(int64_t n, int64_t k, int64_t min_chunk) {
    int64_t chunk = std::max<int64_t>(min_chunk, (n + kTopKChunks - 1) / kTopKChunks);
    chunk = (chunk + 31) / 32 * 32;
    return k > kTopKFiltered || (n + chunk - 1) / chunk < k ? 0 : chunk;
}

}  // namespace

SplitScratchNeed pick_split_scratch(int64_t n, int64_t rows, int64_t k) {
    SplitScratchNeed need;
    const int64_t slices = pick_slices(n, rows, k);
    if (slices > 1) {
        need.partial_floats = static_cast<size_t>(2 * std::max<int64_t>(k, 1) * slices * rows);
        need.n_counters = static_cast<size_t>(rows);
    }
    return need;
}

namespace {

// The slices a launch takes: pick_slices', or 1 where the scratch is smaller than they need (the
// backend sizes it by pick_split_scratch before a compute, so only a caller that did not would see
// this).
int64_t launch_slices(int64_t n, int64_t rows, int64_t k, const SplitScratch& scratch) {
    const SplitScratchNeed need = pick_split_scratch(n, rows, k);
    const bool fits = need.partial_floats <= scratch.partial_floats && need.n_counters <= scratch.n_counters;
    return fits ? pick_slices(n, rows, k) : 1;
}

}  // namespace

void launch_argmax(const TDesc& dst, const TDesc& a, const SplitScratch& scratch, cudaStream_t s) {
    const int64_t rows = a.nrows();
    if (rows == 0) return;
    const int64_t slices = launch_slices(a.ne[0], rows, 0, scratch);
    launch(k_argmax, dim3(static_cast<unsigned>(slices), static_cast<unsigned>(rows)), kArgmaxThreads, 0, s, dst, a,
           scratch.partial, scratch.counters);
}

void launch_top_k(const TDesc& dst, const TDesc& a, const SplitScratch& scratch, cudaStream_t s) {
    const int64_t rows = a.nrows();
    if (rows == 0) return;
    const int64_t n = a.ne[0], k = dst.ne[0];
    const int64_t slices = launch_slices(n, rows, k, scratch);
    // Whole rows: chunks of at least 256 entries (whole warps). Slices: of a warp's 32 entries, so
    // a slice of kSliceMin entries still has k chunks.
    const int64_t chunk = slices > 1 ? top_k_chunk(n / slices, k, 32) : top_k_chunk(n, k, 256);
    launch(k_top_k, dim3(static_cast<unsigned>(slices), static_cast<unsigned>(rows)), kTopKThreads, 0, s, dst, a, chunk,
           scratch.partial, scratch.counters);
}

}  // namespace cuda
}  // namespace pyspec
