// The activation column a MUL_MAT's block stages in shared memory before its sums: copied
// (copy_column) or normalised as an RMS_NORM would (norm_prologue). Part of ops_matmul.cu's
// translation unit (included inside its anonymous namespace, after kWarps): the small-M tiles and
// the row-streaming kernels (cuda/matmul_rows.cuh) share it.
#pragma once

// Copies k floats of an activation column from global memory (written by the kernel before,
// after the PDL wait) into shared memory with each thread's loads for up to kCopyBatch slots asked
// for before any is stored: one L2 round trip for a column of up to kCopyBatch * kThreads slots.
// A plain strided loop came out of ptxas as a remainder loop of one load and its store an
// iteration, then unrolled blocks, each waiting for its loads: 2 round trips for Qwen3-4B's 2,560
// over 512 threads, 3 for o's 4,096 and 6 for down's 9,728 over 320, all on the launch's critical
// path between its PDL wait and its first sums. 16-byte slots where x and k allow. A copy: the
// values, and so the bits, are the same. kBatch: the slots a thread holds at once (registers: 4
// each); the quantised tiles, capped at 56 registers, take fewer.
constexpr int kCopyBatch = 8;
template <int kThreads, int kBatch, typename V>
__device__ __forceinline__ void copy_slots(V* dst, const V* src, int64_t n) {
    for (int64_t i0 = threadIdx.x; i0 < n; i0 += int64_t{kBatch} * kThreads) {
        V v[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
            const int64_t i = i0 + int64_t{j} * kThreads;
            if (i < n) v[j] = src[i];
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
            const int64_t i = i0 + int64_t{j} * kThreads;
            if (i < n) dst[i] = v[j];
        }
    }
}
template <int kThreads, int kBatch = kCopyBatch>
__device__ __forceinline__ void copy_column(float* hs, const float* x, int64_t k) {
    if ((reinterpret_cast<uintptr_t>(x) & 15) == 0 && (reinterpret_cast<uintptr_t>(hs) & 15) == 0 && k % 4 == 0) {
        copy_slots<kThreads, kBatch>(reinterpret_cast<float4*>(hs), reinterpret_cast<const float4*>(x), k / 4);
    } else {
        copy_slots<kThreads, kBatch>(hs, x, k);
    }
}

// The norm prologue (kNorm kernels): the block normalises its C activation columns, an RMS_NORM's
// inputs, into shared memory exactly as the RMS_NORM kernels would (common.cuh: the summation
// order by row length, then x * scale * w), and points xc at those rows; every thread of the block
// (kThreads, at least the long-row order's kNormBlockThreads) must call it. Long rows are summed
// by the block's first kNormBlockThreads threads in that order; all of them scale.
// nw_staged: nw is shared memory this thread's cp.async copies are filling (stage_norm_weights,
// before the PDL wait), waited for here.
extern __shared__ float4 normed_rows[];  // C * k floats

template <int C, int kThreads = kWarps * 32>
__device__ __forceinline__ void norm_prologue(const float* (&xc)[C], int64_t k, const float* nw, float eps,
                                              bool nw_staged = false) {
    static_assert(kThreads % kNormBlockThreads == 0, "the norm prologue sums in the norm kernel's order");
    float* hs = reinterpret_cast<float*>(normed_rows);
    const int tid = threadIdx.x, lane = tid & 31;
    if (nw_staged && k <= kWarpNormMax) {  // (longer rows wait at the barrier after their sums)
        cp_async_wait<0>();
        __syncthreads();
    }
    if (k > kWarpNormMax) {
        __shared__ float sums[C][kNormBlockThreads / 32];
        // A wider block first copies the columns with all its threads (one round of loads each
        // instead of k / 128), and the summing threads then read them from shared memory: the
        // same values in the same order.
        constexpr bool kCopyFirst = kThreads > kNormBlockThreads;
        if constexpr (kCopyFirst) {
#pragma unroll
            for (int c = 0; c < C; ++c) {
                // 4 slots a thread (8,192 floats a round) for the row kernels' 512 threads, 2 for
                // the tiles' 256 (2,048: SmolLM2's 576 in one round)
                copy_column<kThreads, (kThreads >= 512 ? 4 : 2)>(hs + c * k, xc[c], k);
            }
            __syncthreads();
        }
        if (tid < kNormBlockThreads) {
#pragma unroll
            for (int c = 0; c < C; ++c) {
                float acc = 0.0f;
                if constexpr (kThreads >= 512) {
                    // The row kernels: batches of values read before their fmafs (the chain's order
                    // is i = tid, tid + 128, ... as ever); with `#pragma unroll 8` the count's
                    // remainder came first, one load and its fmaf at a time. (The tiles keep that
                    // loop: at their 56 registers a batch spilled more.)
                    constexpr int kSumBatch = 8;
                    for (int64_t i0 = tid; i0 < k; i0 += int64_t{kSumBatch} * kNormBlockThreads) {
                        float v[kSumBatch];
#pragma unroll
                        for (int j = 0; j < kSumBatch; ++j) {
                            const int64_t i = i0 + int64_t{j} * kNormBlockThreads;
                            v[j] = i < k ? (kCopyFirst ? hs[c * k + i] : xc[c][i]) : 0.0f;
                        }
#pragma unroll
                        for (int j = 0; j < kSumBatch; ++j) {
                            const int64_t i = i0 + int64_t{j} * kNormBlockThreads;
                            if (i < k) {
                                if (!kCopyFirst) hs[c * k + i] = v[j];
                                acc = fmaf(v[j], v[j], acc);
                            }
                        }
                    }
                } else {
#pragma unroll 8
                    for (int64_t i = tid; i < k; i += kNormBlockThreads) {
                        const float v = kCopyFirst ? hs[c * k + i] : xc[c][i];
                        if (!kCopyFirst) hs[c * k + i] = v;
                        acc = fmaf(v, v, acc);
                    }
                }
                acc = warp_sum(acc);
                if (lane == 0) sums[c][tid >> 5] = acc;
            }
        }
        if (nw_staged) cp_async_wait<0>();
        __syncthreads();
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const float scale = rms_scale_of_warp_sums(sums[c], k, eps);
            for (int64_t i = tid; i < k; i += kThreads) hs[c * k + i] = hs[c * k + i] * scale * nw[i];
        }
    } else {
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const float scale = warp_rms_scale(xc[c], k, lane, eps);  // each warp the same value
            for (int64_t i = tid; i < k; i += kThreads) hs[c * k + i] = xc[c][i] * scale * nw[i];
        }
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < C; ++c) xc[c] = hs + c * k;
}
