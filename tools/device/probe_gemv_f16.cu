// Probe (H200): how fast can a one-row F16 decode step's matrix-vector products go, with the
// batch-invariant order pyspec's MUL_MAT keeps (cuda/ops_matmul.cu: lane l sums the 8-value units
// u = l, l + 32, ... in increasing u, each unit's products t = 0..7 as one fmaf chain, then the
// xor tree)? Every variant here keeps that order, so each could replace the kernel bit for bit;
// they differ in how loads are issued and how a block starts.
//
// One "step" is Qwen3-4B's 36 layers of q/k/v (N 6144, K 2560, RMS-norm prologue), o (2560 x
// 4096), gate/up (2 x 9728 x 2560, norm prologue, two rows a warp as k_mul_mat_glu) and down
// (2560 x 9728), every layer its own weights (7.3 GB, far beyond L2), captured in one CUDA graph
// with programmatic dependent launch as the backend launches. Per variant: microseconds a step and
// the weights' bytes over that time. A plain read of the same bytes in the same 144 launches, and
// one read of them all in a single launch, bound what a kernel boundary and DRAM allow.
//
//   base       the kernel before the twenty-first session: 4 warps a block, a warp a row, the
//              unit loop unrolled 4, x read through L1 (nofma / nox: without the fmaf chains / the
//              x loads, to see what each costs)
//   batchN     a lane loads N units into registers, then runs their fmaf chains (N = 8 / 16)
//   earlyN     batchN whose first batch is loaded before the PDL wait and the norm prologue
//              (weights are constant, so reading them early is safe); hintN with L2::256B hints
//   streamN    persistent warps over contiguous rows, double-buffered batches, x in shared memory
//   sWrR[e]    blocks of W warps, R rows a warp, x staged in shared memory once a block, weights
//              past L1; e: the first 4 units loaded before the PDL wait (s16r2e became
//              k_mul_mat_rows in cuda/ops_matmul.cu); pWrR[e] with x as two conflict-free planes
//   gN[e]      the base shape with each group of N units loaded by volatile loads first
//   bulkX      each warp streams its rows through a ring of shared-memory stages filled by
//              cp.async.bulk (the copy engine), x in shared memory
//   balW[xB]   balanced grids: B blocks of W warps a SM, each block an equal contiguous share
//              of the rows, warps round-robin over it (o and down leave 52 of 132 SMs idle in
//              s16r2e, gate/up runs 1.15 waves); bal8x2r2 became the row-streaming kernels' grid
// Every variant but read/nofma/nox checks its o and down outputs against base bit for bit.
// Measured (H200, 36 layers, us a step of the 144 launches): read 1,830-1,870, base 2,723-2,795,
// nox 2,246-2,334, batch16 2,504-2,516, stream8 2,454-2,472, s16r2e 2,354-2,382, g6e 2,439,
// bulkA 2,619, p16r2e 2,446; one read of all 7.27 GB in one launch 1,594-1,651 (4.4-4.6 TB/s).
// Twenty-sixth session (same machine kind): s16r2e 2,424; with each warp's rows asked into L2 by
// the copy engine before the PDL wait (cp.async.bulk.prefetch) F 2,737 (whole rows), G 2,483
// (first 4 KiB), the next kernel triggered before the wait T 2,379 (its down alone 685 against
// 552), FT 2,838; with a 6 us attention stand-in before each o (DRAM idle there) prefetching only
// o's rows (oF / oFT) 2,622 / 2,593 against 2,655, and with a 3 us one no gain: nothing kept.
// Twenty-seventh session: s16r2e 2,353-2,356; balanced grids bal8x2r2 2,152-2,157 (kept: the
// model's tg128 322 -> 350 t/s), bal20 2,450, bal32 2,584, bal16x2 2,901, bal8x4 2,964, bal10x3
// 3,826; the sum of the kinds alone moved little (2,165 -> 2,153): the boundaries are the gain.
// Twenty-eighth session, around bal8x2r2 (2,150): bal16r2 2,145, bal4x4r2 2,367, bal8x3r2 2,654,
// bal8x2r4 2,653, bal4x4r4 2,661 (read 1,854, s16r2e 2,358): 16 warps a SM in any split of two
// rows a warp is as good as it gets here; nothing changed.
// Thirty-third session: one persistent launch a step (pers*, a grid barrier between jobs) lost to
// the 144 PDL launches in every form (two runs each, us a step): bal8x2r2 2,139-2,140, pers0
// 2,672-2,674 (the barrier alone), pers4 2,839-2,840, pers8 3,070-3,080 (each warp's next-job rows
// prefetched into shared memory with cp.async before the barrier: more prefetch, slower), persnb
// 2,529 (no barrier at all, jobs back to back: what one resident grid streams by itself); read
// 1,830, one read 1,593. Under PDL the next kernel's blocks sit beside the running ones (32 warps a
// SM at the boundary, their first loads already out), which a persistent grid of 16 warps a SM,
// each block finishing one job before staging the next, does not match. Also lost: balN, each
// warp's next item's first 4 units loaded before this item's reduction (bal8x2r2 2,151-2,152,
// balN8x2r2 3,345-3,353 at 80 registers with a spill against 128 without, balN16r2 2,258,
// balN8x3r2 3,130). Nothing kept.
// Thirty-fourth session: x staged by cp.async, every 16-byte copy of a thread in flight at once
// (bal8x2r2v), lost: 2,207-2,211 against bal8x2r2 2,141-2,146 (read 1,843, one read 1,592-1,598);
// the 4-byte staging loop was not what separates the kernels from the reads. A persistent launch
// that streams weights through a copy-engine ring across the job boundaries: probe_mega.cu.
// usage: probe [layers, default 36] [comma-separated variants, default all] [attention us, default 0]
// With an attention time, a stand-in kernel (k_att) runs that long before each layer's o.
// Build: nvcc -O3 -gencode=arch=compute_90a,code=sm_90a probe_gemv_f16.cu -o probe
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "probe_common.cuh"
#include "probe_f16_rows.cuh"
#include "probe_pdl.cuh"

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;


template <int kHint>
__device__ __forceinline__ uint4 ldw(const uint4* p) {
    if constexpr (kHint) {
        uint4 r;
        asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
        return r;
    } else {
        return __ldg(p);
    }
}

// The norm prologue's shape (not its exact order; the cost is what matters here): the block's
// 128 threads copy x to shared memory summing squares, a barrier, then x * scale * w, a barrier.
extern __shared__ float hs[];
__device__ __forceinline__ const float* norm_prologue(const float* x, const float* nw, int k) {
    __shared__ float sums[kWarps];
    float acc = 0.0f;
    for (int i = threadIdx.x; i < k; i += kThreads) {
        const float v = x[i];
        hs[i] = v;
        acc = fmaf(v, v, acc);
    }
    acc = warp_sum(acc);
    if ((threadIdx.x & 31) == 0) sums[threadIdx.x >> 5] = acc;
    __syncthreads();
    const float scale = rsqrtf((sums[0] + sums[1] + sums[2] + sums[3]) / k + 1e-6f);
    for (int i = threadIdx.x; i < k; i += kThreads) hs[i] = hs[i] * scale * nw[i];
    __syncthreads();
    return hs;
}

struct Job {
    const __half* w;  // rows x k, row-major
    int64_t rows;     // rows (R rows a warp: row pairs r, r + rows / 2 for R = 2)
    int k;
    const float* x;
    const float* nw;  // norm weights or nullptr
    float* y;
};

// One unit without the fmaf chain (kMode 1: the x values and weights xor-ed as bits) or without
// the activations (kMode 2: the weights' own products), to see what the arithmetic and the x
// loads cost.
template <int kMode>
__device__ __forceinline__ float unit_op(uint4 w, const float* xu, float acc) {
    if constexpr (kMode == 0) return unit_fma(w, xu, acc);
    if constexpr (kMode == 1) {
        const float4 a = *reinterpret_cast<const float4*>(xu), b = *reinterpret_cast<const float4*>(xu + 4);
        const uint32_t v = w.x ^ w.y ^ w.z ^ w.w ^ __float_as_uint(a.x) ^ __float_as_uint(a.y) ^ __float_as_uint(a.z) ^
                           __float_as_uint(a.w) ^ __float_as_uint(b.x) ^ __float_as_uint(b.y) ^ __float_as_uint(b.z) ^
                           __float_as_uint(b.w);
        return __uint_as_float(__float_as_uint(acc) ^ v);
    }
    const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        const float lo = __half2float(__ushort_as_half(static_cast<uint16_t>(ws[t] & 0xffffu)));
        const float hi = __half2float(__ushort_as_half(static_cast<uint16_t>(ws[t] >> 16)));
        acc = fmaf(lo, hi, acc);
        acc = fmaf(hi, lo, acc);
    }
    return acc;
}

// This warp's row (warps_per_block warps a block) and the pointers to its R weight rows, rows
// row + r * rows / R (row 0's where the warp is past the end); whether it has a row.
template <int R>
__device__ __forceinline__ bool warp_rows(const Job& j, int warps_per_block, int64_t& row, const uint4* (&wr)[R]) {
    const int64_t half = j.rows / R;
    row = static_cast<int64_t>(blockIdx.x) * warps_per_block + (threadIdx.x >> 5);
    const bool live = row < half;
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = reinterpret_cast<const uint4*>(j.w + (live ? row + r * half : 0) * j.k);
    return live;
}

// Row r of this warp's R rows gets the warp's sum of acc[r] (lane 0 stores it).
template <int R>
__device__ __forceinline__ void store_rows(const Job& j, int64_t row, const float (&acc)[R]) {
    const int64_t half = j.rows / R;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float s = warp_sum(acc[r]);
        if ((threadIdx.x & 31) == 0) j.y[row + r * half] = s;
    }
}

// base: the production loop (unroll 4 over a lane's units).
template <int R, int kMode = 0>
__global__ void __launch_bounds__(kThreads) k_base(Job j) {
    pdl_wait();
    pdl_go();
    const float* x = j.nw ? norm_prologue(j.x, j.nw, j.k) : j.x;
    const int lane = threadIdx.x & 31;
    int64_t row;
    const uint4* wr[R];
    if (!warp_rows<R>(j, kWarps, row, wr)) return;
    float acc[R] = {};
    const int units = j.k / 8;
#pragma unroll 4
    for (int u = lane; u < units; u += 32) {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = unit_op<kMode>(__ldg(wr[r] + u), x + u * 8, acc[r]);
    }
    store_rows<R>(j, row, acc);
}

// batch / early / hint: a lane's units in batches of N, each batch's loads issued before its
// fmaf chains; kEarly loads the first batch before the PDL wait and the prologue.
template <int R, int N, bool kEarly, int kHint>
__global__ void __launch_bounds__(kThreads) k_batch(Job j) {
    const int lane = threadIdx.x & 31;
    int64_t row;
    const uint4* wr[R];
    const bool live = warp_rows<R>(j, kWarps, row, wr);
    const int units = j.k / 8;
    const int mine = (units - lane + 31) / 32;  // units of this lane
    uint4 buf[R][N];
    auto fill = [&](int b0) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            if (b0 + i < mine) {
#pragma unroll
                for (int r = 0; r < R; ++r) buf[r][i] = ldw<kHint>(wr[r] + lane + 32 * (b0 + i));
            }
        }
    };
    if (kEarly && live) fill(0);
    pdl_wait();
    pdl_go();
    const float* x = j.nw ? norm_prologue(j.x, j.nw, j.k) : j.x;
    if (!live) return;
    if (!kEarly) fill(0);
    float acc[R] = {};
    for (int b0 = 0; b0 < mine; b0 += N) {
        if (b0 > 0) fill(b0);
#pragma unroll
        for (int i = 0; i < N; ++i) {
            if (b0 + i < mine) {
                const int u = lane + 32 * (b0 + i);
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r] = unit_fma(buf[r][i], x + u * 8, acc[r]);
            }
        }
    }
    store_rows<R>(j, row, acc);
}

// stream: each warp a contiguous range of rows (rows_per_warp), its units in batches of N per
// lane, double-buffered across batches and rows (the next batch's loads issued before this one's
// fmaf chains), x (normalised where the job has a norm) staged once per block in shared memory
// after the first batch's loads are in flight. The grid is sized to what is resident at once.
template <int R, int N>
__global__ void __launch_bounds__(kThreads) k_stream(Job j, int rows_per_warp) {
    const int lane = threadIdx.x & 31;
    const int64_t half = j.rows / R;
    const int64_t gw = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
    const int64_t row0 = gw * rows_per_warp;
    const int64_t row1 = row0 + rows_per_warp < half ? row0 + rows_per_warp : half;
    const int units = j.k / 8;
    const int mine = (units - lane + 31) / 32;
    const int nb = (mine + N - 1) / N;  // batches a row
    const int n_items = row1 > row0 ? static_cast<int>(row1 - row0) * nb : 0;
    uint4 a[R][N], b[R][N];
    auto fill = [&](uint4 (&buf)[R][N], int item) {
        const int64_t row = row0 + item / nb;
        const int b0 = (item % nb) * N;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            if (b0 + i < mine) {
#pragma unroll
                for (int r = 0; r < R; ++r)
                    buf[r][i] = __ldg(reinterpret_cast<const uint4*>(j.w + (row + r * half) * j.k) + lane + 32 * (b0 + i));
            }
        }
    };
    if (n_items > 0) fill(a, 0);
    pdl_wait();
    pdl_go();
    const float* x = hs;
    if (j.nw) {
        norm_prologue(j.x, j.nw, j.k);
    } else {
        for (int i = threadIdx.x; i < j.k; i += kThreads) hs[i] = j.x[i];
        __syncthreads();
    }
    float acc[R] = {};
    auto run = [&](const uint4 (&buf)[R][N], int item) {
        const int64_t row = row0 + item / nb;
        const int bi = item % nb, b0 = bi * N;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            if (b0 + i < mine) {
                const int u = lane + 32 * (b0 + i);
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r] = unit_fma(buf[r][i], x + u * 8, acc[r]);
            }
        }
        if (bi == nb - 1) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float s = warp_sum(acc[r]);
                if (lane == 0) j.y[row + r * half] = s;
                acc[r] = 0.0f;
            }
        }
    };
    for (int item = 0; item < n_items; item += 2) {
        if (item + 1 < n_items) fill(b, item + 1);
        run(a, item);
        if (item + 2 < n_items) fill(a, item + 2);
        if (item + 1 < n_items) run(b, item + 1);
    }
}

// The job's x into shared memory by a block of W warps, normalised where the job has a norm
// (the norm prologue's shape, its order the block's: the cost is what matters here).
// kVec: x comes by cp.async, 16 bytes a copy, every copy of the thread in flight at once (one L2
// round trip), instead of a loop of 4-byte loads, each stored before the next few go out.
template <int W, bool kVec = false>
__device__ __forceinline__ void stage_x(const Job& j, float* dst) {
    __shared__ float sums[W];
    float acc = 0.0f;
    if constexpr (kVec) {
        for (int i = threadIdx.x; i < j.k / 4; i += W * 32) cp16(dst + 4 * i, j.x + 4 * i);
        asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
        __syncthreads();
        if (j.nw) {
            for (int i = threadIdx.x; i < j.k; i += W * 32) acc = fmaf(dst[i], dst[i], acc);
        }
    } else {
        for (int i = threadIdx.x; i < j.k; i += W * 32) {
            const float v = j.x[i];
            dst[i] = v;
            acc = fmaf(v, v, acc);
        }
    }
    if (j.nw) {
        acc = warp_sum(acc);
        if ((threadIdx.x & 31) == 0) sums[threadIdx.x >> 5] = acc;
        __syncthreads();
        float t = 0.0f;
        for (int w = 0; w < W; ++w) t += sums[w];
        const float scale = rsqrtf(t / j.k + 1e-6f);
        for (int i = threadIdx.x; i < j.k; i += W * 32) dst[i] = dst[i] * scale * j.nw[i];
    }
    __syncthreads();
}

// A lane's first 4 units of each of its R rows: the loads issued before the PDL wait.
template <int R>
__device__ __forceinline__ void load_first_units(const uint4* const (&wr)[R], int lane, int units, uint4 (&pre)[R][4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (lane + 32 * i < units) {
#pragma unroll
            for (int r = 0; r < R; ++r) pre[r][i] = ldw<1>(wr[r] + lane + 32 * i);
        }
    }
}

// Their fmaf chains (fma_unit(w, u, acc): one unit's), u stepping past them.
template <int R, typename F>
__device__ __forceinline__ void fma_first_units(const uint4 (&pre)[R][4], int units, int& u, float (&acc)[R], F fma_unit) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (u < units) {
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = fma_unit(pre[r][i], u, acc[r]);
        }
        u += 32;
    }
}

// smem: blocks of W warps stage x (normalised where the job has a norm) in shared memory once,
// then each warp runs the production loop (unroll 4) over R rows at once, x from shared memory
// (a load serves R rows) and the weights past L1 (no_allocate, so they do not evict anything);
// kEarly loads a lane's first 4 units of each row before the PDL wait and the staging.
template <int W, int R, bool kEarly, bool kPlanes = false, int kPf = 0, bool kTrigFirst = false>
__global__ void __launch_bounds__(W * 32) k_smem(Job j) {
    const int lane = threadIdx.x & 31;
    int64_t row;
    const uint4* wr[R];
    const bool live = warp_rows<R>(j, W, row, wr);
    const int units = j.k / 8;
    if constexpr (kTrigFirst) pdl_go();
    if (kPf && live && lane < R) {  // lane r asks the copy engine for row r into L2
        const uint32_t row_bytes = static_cast<uint32_t>(j.k) * 2;
        const uint32_t bytes = kPf == 1 ? row_bytes : (row_bytes < 4096u ? row_bytes : 4096u);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r == lane) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(wr[r]), "r"(bytes) : "memory");
        }
    }
    uint4 pre[R][4];
    if (kEarly && live) load_first_units<R>(wr, lane, units, pre);
    pdl_wait();
    if constexpr (!kTrigFirst) pdl_go();
    {
        stage_x<W>(j, hs);
        if constexpr (kPlanes) {  // x[8u + t] -> plane t / 4 at 4u + t % 4, after hs[0, k)
            float* pl = hs + j.k;
            const int n = j.k / 8;
            for (int uu = threadIdx.x; uu < n; uu += W * 32) {
#pragma unroll
                for (int t = 0; t < 8; ++t) pl[(t / 4) * (j.k / 2) + 4 * uu + t % 4] = hs[8 * uu + t];
            }
            __syncthreads();
        }
    }
    if (!live) return;
    const float4* pa = reinterpret_cast<const float4*>(hs + j.k);
    const float4* pb = reinterpret_cast<const float4*>(hs + j.k + j.k / 2);
    auto fma_unit = [&](uint4 w, int uu, float a) {
        if constexpr (kPlanes) return unit_fma2(w, pa[uu], pb[uu], a);
        else return unit_fma(w, hs + uu * 8, a);
    };
    float acc[R] = {};
    int u = lane;
    if (kEarly) fma_first_units<R>(pre, units, u, acc, fma_unit);
#pragma unroll 4
    for (; u < units; u += 32) {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = fma_unit(ldw<1>(wr[r] + u), u, acc[r]);
    }
    store_rows<R>(j, row, acc);
}

// bal: a balanced grid instead of one warp per row group. gridDim.x blocks (a whole number a
// SM, chosen at launch), block b taking the contiguous items [b n / G, (b + 1) n / G) of the job's
// n = rows / R items (an item: R rows, as warp_rows pairs them), warp w its items start + w,
// start + w + W, ...; so every SM streams the same bytes (o and down have 80 row groups of 16
// warps for 132 SMs in s16r2e, gate/up 1.15 waves). The first item's first 4 units are loaded
// before the PDL wait; x is staged in shared memory once a block. Same order as base.
template <int W, int R, bool kNext = false, bool kVec = false>
__global__ void __launch_bounds__(W * 32) k_bal(Job j) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t n = j.rows / R, half = j.rows / R;
    const int64_t start = n * blockIdx.x / gridDim.x, end = n * (blockIdx.x + 1) / gridDim.x;
    const int units = j.k / 8;
    auto rows_of = [&](int64_t item, const uint4* (&wr)[R]) {
#pragma unroll
        for (int r = 0; r < R; ++r) wr[r] = reinterpret_cast<const uint4*>(j.w + (item + r * half) * j.k);
    };
    int64_t item = start + warp;
    uint4 pre[R][4];
    const uint4* wr[R];
    if (item < end) {
        rows_of(item, wr);
        load_first_units<R>(wr, lane, units, pre);
    }
    pdl_wait();
    pdl_go();
    stage_x<W, kVec>(j, hs);
    for (bool first = true; item < end; item += W, first = false) {
        if (!first && !kNext) rows_of(item, wr);
        float acc[R] = {};
        int u = lane;
        if (first || kNext) fma_first_units<R>(pre, units, u, acc, [](uint4 w, int uu, float a) { return unit_fma(w, hs + uu * 8, a); });
#pragma unroll 4
        for (; u < units; u += 32) {
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = unit_fma(ldw<1>(wr[r] + u), hs + u * 8, acc[r]);
        }
        if constexpr (kNext) {  // the next item's first units go out before this one's reduction
            if (item + W < end) {
                rows_of(item + W, wr);
                load_first_units<R>(wr, lane, units, pre);
            }
        }
        store_rows<R>(j, item, acc);
    }
}

// bulk: each warp streams a contiguous range of rows through its own ring of S shared-memory
// stages of CH bytes, filled by its lane 0 with cp.async.bulk (the copy engine; no registers
// hold loads in flight) and signalled by one mbarrier per stage. A chunk starts at a multiple of
// CH bytes, a multiple of 512, so lane l still takes the units u = l (mod 32) of its row in
// increasing u: the production order. x (normalised where the job has a norm) sits in shared
// memory once per block. The first S chunks are asked for before the PDL wait (weights are
// constant).
template <int W, int S, int CH>
__global__ void __launch_bounds__(W * 32) k_bulk(Job j, int rows_per_warp) {
    extern __shared__ __align__(128) unsigned char bulk_smem[];
    __shared__ __align__(8) uint64_t bars[W][S];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned char* ring = bulk_smem + warp * S * CH;
    float* xs = reinterpret_cast<float*>(bulk_smem + W * S * CH);
    const int64_t gw = static_cast<int64_t>(blockIdx.x) * W + warp;
    const int64_t row0 = gw * rows_per_warp;
    const int64_t row1 = row0 + rows_per_warp < j.rows ? row0 + rows_per_warp : j.rows;
    const int64_t rb = int64_t{j.k} * 2;
    const int nc = static_cast<int>((rb + CH - 1) / CH);  // chunks a row
    const int n_items = row1 > row0 ? static_cast<int>(row1 - row0) * nc : 0;
    auto issue = [&](int item) {
        const int64_t row = row0 + item / nc;
        const int64_t off = int64_t{item % nc} * CH;
        const uint32_t bytes = static_cast<uint32_t>(rb - off < CH ? rb - off : CH);
        const int st = item % S;
        bulk_load(saddr(ring + st * CH), reinterpret_cast<const char*>(j.w) + row * rb + off, bytes, saddr(&bars[warp][st]));
    };
    if (lane == 0) {
        for (int st = 0; st < S; ++st) mbar_init(saddr(&bars[warp][st]), 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        for (int i = 0; i < S && i < n_items; ++i) issue(i);
    }
    __syncwarp();
    pdl_wait();
    pdl_go();
    stage_x<W>(j, xs);
    const int units_row = j.k / 8;
    float acc = 0.0f;
    for (int item = 0; item < n_items; ++item) {
        const int st = item % S;
        mbar_wait(saddr(&bars[warp][st]), static_cast<uint32_t>((item / S) & 1));
        const int c = item % nc;
        const int u0 = c * (CH / 16);  // first unit of the chunk
        const int un = units_row - u0 < CH / 16 ? units_row - u0 : CH / 16;
        const uint4* wst = reinterpret_cast<const uint4*>(ring + st * CH);
#pragma unroll 4
        for (int i = lane; i < un; i += 32) acc = unit_fma(wst[i], xs + (u0 + i) * 8, acc);
        __syncwarp();
        if (lane == 0 && item + S < n_items) {
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            issue(item + S);
        }
        if (c == nc - 1) {
            const float sum = warp_sum(acc);
            if (lane == 0) j.y[row0 + item / nc] = sum;
            acc = 0.0f;
        }
    }
}

// grouped: the production kernel's shape (4 warps a block, a warp R rows, x from global memory)
// with each group of G units a lane loaded by G volatile loads issued before any of the group's
// fmaf chains (ptxas otherwise reuses the first unit's registers for the last and issues that
// load one round trip late), full groups first, then the remainder one unit at a time; kEarly
// issues the first group before the PDL wait.
__device__ __forceinline__ uint4 ldv(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
template <int R, int G, bool kEarly>
__global__ void __launch_bounds__(kThreads) k_grouped(Job j) {
    const int lane = threadIdx.x & 31;
    int64_t row;
    const uint4* wr[R];
    const bool live = warp_rows<R>(j, kWarps, row, wr);
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] += lane;
    const int units = j.k / 8;
    const int mine = (units - lane + 31) / 32;
    const int full = mine / G;  // full groups
    uint4 w[R][G];
    if (kEarly && live && full > 0) {
#pragma unroll
        for (int i = 0; i < G; ++i)
#pragma unroll
            for (int r = 0; r < R; ++r) w[r][i] = ldv(wr[r] + 32 * i);
    }
    pdl_wait();
    pdl_go();
    const float* x = j.nw ? norm_prologue(j.x, j.nw, j.k) : j.x;
    if (!live) return;
    float acc[R] = {};
    for (int g = 0; g < full; ++g) {
        if (!kEarly || g > 0) {
#pragma unroll
            for (int i = 0; i < G; ++i)
#pragma unroll
                for (int r = 0; r < R; ++r) w[r][i] = ldv(wr[r] + 32 * (g * G + i));
        }
#pragma unroll
        for (int i = 0; i < G; ++i) {
            const int u = lane + 32 * (g * G + i);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = unit_fma(w[r][i], x + u * 8, acc[r]);
        }
    }
    for (int i = full * G; i < mine; ++i) {
        const int u = lane + 32 * i;
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = unit_fma(ldv(wr[r] + 32 * i), x + u * 8, acc[r]);
    }
    store_rows<R>(j, row, acc);
}

// A plain read of the job's weights (the same grid as base), summing them so nothing is elided.
__global__ void __launch_bounds__(kThreads) k_read(Job j) {
    pdl_wait();
    pdl_go();
    const int lane = threadIdx.x & 31;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
    if (row >= j.rows) return;
    const uint4* wr = reinterpret_cast<const uint4*>(j.w + row * j.k);
    uint32_t s = 0;
#pragma unroll 4
    for (int u = lane; u < j.k / 8; u += 32) {
        const uint4 v = __ldg(wr + u);
        s ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (s == 0x12345678u) j.y[row] = 1.0f;
}

// All the bytes in one grid-stride launch.
__global__ void k_read_all(const uint4* p, int64_t n, float* y) {
    uint32_t s = 0;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const uint4 v = __ldg(p + i);
        s ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (s == 0x12345678u) y[0] = 1.0f;
}


// pers: one persistent launch for a whole list of jobs (a step), its blocks the balanced grid of
// bal (W warps, 2 blocks a SM, two rows a warp, the same items and order, so the same bits), a
// software grid barrier between jobs where the launches had their boundaries. Before arriving at
// each barrier a warp asks for the first P units of both rows of its first item of the NEXT job
// with cp.async into its own shared-memory slots (weights never depend on the barrier; no
// registers hold them), so DRAM keeps streaming while the grid waits and the next job's x is
// staged. P = 0: the barrier alone. The question: do launch boundaries cost what a barrier plus
// an early shared-memory prefetch does not (one read of all the bytes in one launch runs at
// 4.4-4.6 TB/s, in 144 launches at ~3.9)? persnb drops the barrier (no dependency kept): the
// loop's own streaming bound.
__device__ __forceinline__ void grid_barrier(unsigned* bar, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(bar, 1u);
        unsigned v;
        do {
            asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(bar) : "memory");
        } while (v < target);
    }
    __syncthreads();
}
constexpr int kPersMaxK = 9728;
template <int W, int P, bool kBarrier = true>
__global__ void __launch_bounds__(W * 32, 2) k_pers(const Job* jobs, int n_jobs, unsigned* bar) {
    constexpr int R = 2;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float* xs = hs;                                                   // kPersMaxK floats
    uint4* pf = reinterpret_cast<uint4*>(hs + kPersMaxK) + warp * (R * (P > 0 ? P : 1) * 32);
    auto first_item = [&](const Job& j, int64_t& item, int64_t& end, const uint4* (&wr)[R]) {
        const int64_t n = j.rows / R;
        const int64_t start = n * blockIdx.x / gridDim.x;
        end = n * (blockIdx.x + 1) / gridDim.x;
        item = start + warp;
#pragma unroll
        for (int r = 0; r < R; ++r) wr[r] = reinterpret_cast<const uint4*>(j.w + (item + r * n) * j.k);
    };
    auto prefetch = [&](const Job& j) {
        if constexpr (P > 0) {
            int64_t item, end;
            const uint4* wr[R];
            first_item(j, item, end, wr);
            if (item < end) {
#pragma unroll
                for (int i = 0; i < P; ++i) {
                    if (lane + 32 * i < j.k / 8) {
#pragma unroll
                        for (int r = 0; r < R; ++r) cp16(pf + (r * P + i) * 32 + lane, wr[r] + lane + 32 * i);
                    }
                }
            }
            asm volatile("cp.async.commit_group;" ::: "memory");
        }
    };
    prefetch(jobs[0]);
    for (int ji = 0; ji < n_jobs; ++ji) {
        const Job j = jobs[ji];
        if (kBarrier && ji > 0) grid_barrier(bar, static_cast<unsigned>(ji) * gridDim.x);
        stage_x<W>(j, xs);
        int64_t item, end;
        const uint4* wr[R];
        first_item(j, item, end, wr);
        const int units = j.k / 8;
        const int64_t n = j.rows / R;
        if constexpr (P > 0) asm volatile("cp.async.wait_all;" ::: "memory");
        for (bool first = true; item < end; item += W, first = false) {
            if (!first) {
#pragma unroll
                for (int r = 0; r < R; ++r) wr[r] = reinterpret_cast<const uint4*>(j.w + (item + r * n) * j.k);
            }
            float acc[R] = {};
            int u = lane;
            if (P > 0 && first) {
#pragma unroll
                for (int i = 0; i < (P > 0 ? P : 1); ++i, u += 32) {
                    if (u < units) {
#pragma unroll
                        for (int r = 0; r < R; ++r) acc[r] = unit_fma(pf[(r * P + i) * 32 + lane], xs + u * 8, acc[r]);
                    }
                }
            }
#pragma unroll 4
            for (; u < units; u += 32) {
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r] = unit_fma(ldw<1>(wr[r] + u), xs + u * 8, acc[r]);
            }
            store_rows<R>(j, item, acc);
        }
        if (ji + 1 < n_jobs) prefetch(jobs[ji + 1]);
    }
}
template <int W, int P>
static size_t pers_smem() {
    return kPersMaxK * sizeof(float) + size_t{W} * 2 * (P > 0 ? P : 1) * 32 * 16;
}
// One persistent launch over the n jobs at d_jobs (device memory), the barrier counter zeroed first.
template <int W, int P, bool B = true>
static void launch_pers(const Job* d_jobs, int n, unsigned* bar, cudaStream_t s) {
    static int sms = 0;
    if (!sms) {
        CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        CK(cudaFuncSetAttribute(k_pers<W, P, B>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(pers_smem<W, P>())));
        int per_sm = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_pers<W, P, B>, W * 32, pers_smem<W, P>()));
        if (per_sm < 2) { printf("k_pers<%d,%d>: only %d blocks a SM\n", W, P, per_sm); exit(1); }
    }
    CK(cudaMemsetAsync(bar, 0, sizeof(unsigned), s));
    k_pers<W, P, B><<<static_cast<unsigned>(sms * 2), W * 32, pers_smem<W, P>(), s>>>(d_jobs, n, bar);
    CK(cudaGetLastError());
}

template <typename K, typename... A>
static void launch_pdl(K kernel, unsigned grid, size_t smem, cudaStream_t s, A... args) {
    launch_pdl_block(kernel, grid, kThreads, smem, s, args...);
}

// Whether name is one of the comma-separated list's entries (exactly, not as a prefix).
static bool listed(const char* list, const char* name) {
    const size_t n = strlen(name);
    for (const char* p = list; *p;) {
        const char* e = strchr(p, ',');
        const size_t len = e ? static_cast<size_t>(e - p) : strlen(p);
        if (len == n && strncmp(p, name, n) == 0) return true;
        if (!e) break;
        p = e + 1;
    }
    return false;
}

struct Layer {
    Job qkv, o, gu, down;
};

template <int R, int M = 0>
static void run_base(const Job& j, cudaStream_t s) {
    const unsigned grid = static_cast<unsigned>((j.rows / R + kWarps - 1) / kWarps);
    launch_pdl(k_base<R, M>, grid, j.nw ? j.k * sizeof(float) : 0, s, j);
}
template <int R, int N, bool E, int H>
static void run_batch(const Job& j, cudaStream_t s) {
    const unsigned grid = static_cast<unsigned>((j.rows / R + kWarps - 1) / kWarps);
    launch_pdl(k_batch<R, N, E, H>, grid, j.nw ? j.k * sizeof(float) : 0, s, j);
}
template <int R, int N>
static void run_stream(const Job& j, cudaStream_t s) {
    static int per_sm = -1, sms = 0;
    const size_t smem = 9728 * sizeof(float);
    if (per_sm < 0) {
        CK(cudaFuncSetAttribute(k_stream<R, N>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_stream<R, N>, kThreads, smem));
        CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        printf("[stream<%d,%d>: %d blocks/SM] ", R, N, per_sm);
    }
    const int64_t warps_cap = int64_t{sms} * per_sm * kWarps;
    const int64_t n = j.rows / R;
    const int64_t rpw = (n + warps_cap - 1) / warps_cap;
    const int64_t warps = (n + rpw - 1) / rpw;
    launch_pdl(k_stream<R, N>, static_cast<unsigned>((warps + kWarps - 1) / kWarps), j.k * sizeof(float), s, j,
               static_cast<int>(rpw));
}
template <int W, int R, bool E, bool P = false, int F = 0, bool T = false>
static void run_smem(const Job& j, cudaStream_t s) {
    static bool once = false;
    if (!once) {
        once = true;
        CK(cudaFuncSetAttribute(k_smem<W, R, E, P, F, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * 9728 * 4));
    }
    const int64_t n = j.rows / R;
    launch_pdl_block(k_smem<W, R, E, P, F, T>, static_cast<unsigned>((n + W - 1) / W), W * 32,
                     (P ? 2 : 1) * j.k * sizeof(float), s, j);
}
template <int W, int R, int BPS, bool N = false, bool V = false>
static void run_bal(const Job& j, cudaStream_t s) {
    static int sms = 0;
    if (!sms) {
        CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        CK(cudaFuncSetAttribute(k_bal<W, R, N, V>, cudaFuncAttributeMaxDynamicSharedMemorySize, 9728 * 4));
    }
    launch_pdl_block(k_bal<W, R, N, V>, static_cast<unsigned>(sms * BPS), W * 32, j.k * sizeof(float), s, j);
}
template <int W, int S, int CH>
static void run_bulk(const Job& j, cudaStream_t s) {
    static int per_sm = -1, sms = 0;
    const size_t smem = size_t{W} * S * CH + 9728 * sizeof(float);
    if (per_sm < 0) {
        CK(cudaFuncSetAttribute(k_bulk<W, S, CH>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_bulk<W, S, CH>, W * 32, smem));
        CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        printf("[bulk<%d,%d,%d>: %d blocks/SM] ", W, S, CH, per_sm);
    }
    const int64_t warps_cap = int64_t{sms} * per_sm * W;
    const int64_t rpw = (j.rows + warps_cap - 1) / warps_cap;
    const int64_t warps = (j.rows + rpw - 1) / rpw;
    launch_pdl_block(k_bulk<W, S, CH>, static_cast<unsigned>((warps + W - 1) / W), W * 32, smem, s, j,
                     static_cast<int>(rpw));
}
template <int R, int G, bool E>
static void run_grouped(const Job& j, cudaStream_t s) {
    const unsigned grid = static_cast<unsigned>((j.rows / R + kWarps - 1) / kWarps);
    launch_pdl(k_grouped<R, G, E>, grid, j.nw ? j.k * sizeof(float) : 0, s, j);
}
static void run_read(const Job& j, cudaStream_t s) {
    launch_pdl(k_read, static_cast<unsigned>((j.rows + kWarps - 1) / kWarps), 0, s, j);
}


static Job* g_jobs = nullptr;
static unsigned* g_bar = nullptr;
template <int W, int P>
static void run_pers_one(const Job& j, cudaStream_t s) {
    CK(cudaMemcpyAsync(g_jobs, &j, sizeof(Job), cudaMemcpyHostToDevice, s));
    launch_pers<W, P>(g_jobs, 1, g_bar, s);
}

struct Variant {
    const char* name;
    void (*r1)(const Job&, cudaStream_t);
    void (*r2)(const Job&, cudaStream_t);
    void (*ro)(const Job&, cudaStream_t) = nullptr;  // the o launch, when not r1's
    void (*list)(const Job*, int, unsigned*, cudaStream_t) = nullptr;  // one launch for a job list
};


int main(int argc, char** argv) {
    const int n_layer = argc > 1 ? atoi(argv[1]) : 36;
    const int64_t att_ns = argc > 3 ? static_cast<int64_t>(atof(argv[3]) * 1000) : 0;  // the stand-in's time
    const int hidden = kHidden, q = kQ, kv = kKV, ffn = kFfn;
    const int64_t per_layer = kLayerHalves;
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    __half* w = qwen3_weights(n_layer, s);
    float *x = nullptr, *nw = nullptr, *y = nullptr;
    CK(cudaMalloc(&x, ffn * 2 * sizeof(float)));
    CK(cudaMalloc(&nw, hidden * sizeof(float)));
    CK(cudaMalloc(&y, int64_t{2} * ffn * sizeof(float)));
    {
        std::vector<float> hx(ffn * 2), hn(hidden);
        for (size_t i = 0; i < hx.size(); ++i) hx[i] = 0.01f * static_cast<float>((i * 37) % 101) - 0.5f;
        for (size_t i = 0; i < hn.size(); ++i) hn[i] = 1.0f + 0.001f * static_cast<float>(i % 7);
        CK(cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(nw, hn.data(), hn.size() * 4, cudaMemcpyHostToDevice));
    }
    std::vector<Layer> layers(n_layer);
    for (int l = 0; l < n_layer; ++l) {
        __half* p = w + per_layer * l;
        Layer& L = layers[l];
        L.qkv = {p, q + 2 * kv, hidden, x, nw, y};
        p += int64_t{hidden} * (q + 2 * kv);
        L.o = {p, hidden, q, x, nullptr, y};
        p += int64_t{q} * hidden;
        L.gu = {p, 2 * ffn, hidden, x, nw, y};
        p += int64_t{2} * ffn * hidden;
        L.down = {p, hidden, ffn, x, nullptr, y};
    }
    const double bytes = static_cast<double>(per_layer) * n_layer * 2;
    CK(cudaMalloc(&g_jobs, sizeof(Job) * 4 * n_layer));
    CK(cudaMalloc(&g_bar, sizeof(unsigned)));
    const Variant variants[] = {
        {"read", run_read, run_read},
        {"base", run_base<1>, run_base<2>},
        {"nofma", run_base<1, 1>, run_base<2, 1>},
        {"nox", run_base<1, 2>, run_base<2, 2>},
        {"batch8", run_batch<1, 8, false, 0>, run_batch<2, 8, false, 0>},
        {"batch16", run_batch<1, 16, false, 0>, run_batch<2, 16, false, 0>},
        {"early8", run_batch<1, 8, true, 0>, run_batch<2, 8, true, 0>},
        {"early16", run_batch<1, 16, true, 0>, run_batch<2, 16, true, 0>},
        {"hint8", run_batch<1, 8, true, 1>, run_batch<2, 8, true, 1>},
        {"hint16", run_batch<1, 16, true, 1>, run_batch<2, 16, true, 1>},
        {"stream4", run_stream<1, 4>, run_stream<2, 4>},
        {"stream8", run_stream<1, 8>, run_stream<2, 4>},
        {"streamX", run_stream<1, 12>, run_stream<2, 6>},
        {"s4r1", run_smem<4, 1, false>, run_smem<4, 2, false>},
        {"s8r1", run_smem<8, 1, false>, run_smem<8, 2, false>},
        {"s16r1", run_smem<16, 1, false>, run_smem<16, 2, false>},
        {"s8r2", run_smem<8, 2, false>, run_smem<8, 2, false>},
        {"s16r2", run_smem<16, 2, false>, run_smem<16, 2, false>},
        {"s8r1e", run_smem<8, 1, true>, run_smem<8, 2, true>},
        {"s16r1e", run_smem<16, 1, true>, run_smem<16, 2, true>},
        {"s16r2e", run_smem<16, 2, true>, run_smem<16, 2, true>},
        {"s32r1e", run_smem<32, 1, true>, run_smem<32, 2, true>},
        // balanced grids: W warps a block, BPS blocks a SM, each block an equal share of the items
        {"bal20", run_bal<20, 1, 1>, run_bal<20, 2, 1>},
        {"bal32", run_bal<32, 1, 1>, run_bal<32, 2, 1>},
        {"bal16x2", run_bal<16, 1, 2>, run_bal<16, 2, 2>},
        {"bal10x3", run_bal<10, 1, 3>, run_bal<10, 2, 3>},
        {"bal8x4", run_bal<8, 1, 4>, run_bal<8, 2, 4>},
        {"bal8x2r2", run_bal<8, 2, 2>, run_bal<8, 2, 2>},
        // x staged by cp.async, every 16-byte copy of a thread in flight at once
        {"bal8x2r2v", run_bal<8, 2, 2, false, true>, run_bal<8, 2, 2, false, true>},
        // balN: each warp's next item's first 4 units loaded before this item's reduction
        {"balN8x2r2", run_bal<8, 2, 2, true>, run_bal<8, 2, 2, true>},
        {"balN16r2", run_bal<16, 2, 1, true>, run_bal<16, 2, 1, true>},
        {"balN8x3r2", run_bal<8, 2, 3, true>, run_bal<8, 2, 3, true>},
        // around bal8x2r2 (kept): other splits of 16 warps a SM, 24 warps, 4 rows a warp
        {"bal16r2", run_bal<16, 2, 1>, run_bal<16, 2, 1>},
        {"bal4x4r2", run_bal<4, 2, 4>, run_bal<4, 2, 4>},
        {"bal8x3r2", run_bal<8, 2, 3>, run_bal<8, 2, 3>},
        {"bal8x2r4", run_bal<8, 4, 2>, run_bal<8, 2, 2>},
        {"bal4x4r4", run_bal<4, 4, 4>, run_bal<4, 2, 4>},
        {"oF", run_smem<16, 2, true>, run_smem<16, 2, true>, run_smem<16, 2, true, false, 1>},
        {"oFT", run_smem<16, 2, true>, run_smem<16, 2, true>, run_smem<16, 2, true, false, 1, true>},
        // F: each warp's rows prefetched into L2 by the copy engine before the PDL wait (whole
        // rows, or their first 4 KiB: G); T: the next kernel triggered before the wait.
        {"s16r2F", run_smem<16, 2, true, false, 1>, run_smem<16, 2, true, false, 1>},
        {"s16r2G", run_smem<16, 2, true, false, 2>, run_smem<16, 2, true, false, 2>},
        {"s16r2T", run_smem<16, 2, true, false, 0, true>, run_smem<16, 2, true, false, 0, true>},
        {"s16r2FT", run_smem<16, 2, true, false, 1, true>, run_smem<16, 2, true, false, 1, true>},
        {"s8r2F", run_smem<8, 2, true, false, 1>, run_smem<8, 2, true, false, 1>},
        {"s8r1F", run_smem<8, 1, true, false, 1>, run_smem<8, 2, true, false, 1>},
        {"s4r1F", run_smem<4, 1, true, false, 1>, run_smem<4, 2, true, false, 1>},
        {"s4r1FT", run_smem<4, 1, true, false, 1, true>, run_smem<4, 2, true, false, 1, true>},
        {"g4", run_grouped<1, 4, false>, run_grouped<2, 4, false>},
        {"g4e", run_grouped<1, 4, true>, run_grouped<2, 4, true>},
        {"g8", run_grouped<1, 8, false>, run_grouped<2, 8, false>},
        {"g8e", run_grouped<1, 8, true>, run_grouped<2, 8, true>},
        {"g6e", run_grouped<1, 6, true>, run_grouped<2, 6, true>},
        {"g10e", run_grouped<1, 10, true>, run_grouped<2, 5, true>},
        {"p8r1", run_smem<8, 1, false, true>, run_smem<8, 2, false, true>},
        {"p8r1e", run_smem<8, 1, true, true>, run_smem<8, 2, true, true>},
        {"p16r1e", run_smem<16, 1, true, true>, run_smem<16, 2, true, true>},
        {"p16r2e", run_smem<16, 2, true, true>, run_smem<16, 2, true, true>},
        {"p8r2e", run_smem<8, 2, true, true>, run_smem<8, 2, true, true>},
        {"p4r1e", run_smem<4, 1, true, true>, run_smem<4, 2, true, true>},
        {"bulkA", run_bulk<4, 4, 4096>, run_bulk<4, 4, 4096>},
        {"bulkB", run_bulk<8, 3, 4096>, run_bulk<8, 3, 4096>},
        {"bulkC", run_bulk<4, 6, 2048>, run_bulk<4, 6, 2048>},
        {"bulkD", run_bulk<4, 3, 8192>, run_bulk<4, 3, 8192>},
        {"bulkE", run_bulk<2, 8, 4096>, run_bulk<2, 8, 4096>},
        // one persistent launch a step, a grid barrier between jobs, P units prefetched across it
        {"pers0", run_pers_one<8, 0>, run_pers_one<8, 0>, nullptr, launch_pers<8, 0>},
        {"pers4", run_pers_one<8, 4>, run_pers_one<8, 4>, nullptr, launch_pers<8, 4>},
        {"pers8", run_pers_one<8, 8>, run_pers_one<8, 8>, nullptr, launch_pers<8, 8>},
        // the same with no barrier at all (jobs back to back, no dependency): what streaming allows
        {"persnb", run_pers_one<8, 8>, run_pers_one<8, 8>, nullptr, launch_pers<8, 8, false>},
    };
    // Per kind alone too (every layer's launches of one kind), to see which ones lag.
    const char* kinds[] = {"all", "qkv", "o", "gate/up", "down"};
    // The bits: o and down (no norm) of layer 0 by each variant against base, bit for bit.
    std::vector<float> ref_o(hidden), ref_d(hidden), got(hidden);
    auto out_of = [&](void (*r)(const Job&, cudaStream_t), const Job& jb, std::vector<float>& dst) {
        CK(cudaMemsetAsync(y, 0xff, hidden * sizeof(float), s));
        r(jb, s);
        CK(cudaStreamSynchronize(s));
        CK(cudaMemcpy(dst.data(), y, hidden * sizeof(float), cudaMemcpyDeviceToHost));
    };
    out_of(run_base<1>, layers[0].o, ref_o);
    out_of(run_base<1>, layers[0].down, ref_d);
    const char* only = argc > 2 ? argv[2] : nullptr;  // a comma-separated list of variants
    if (att_ns) {  // the stand-ins alone, to subtract
        size_att();
        cudaGraph_t g;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int l = 0; l < n_layer; ++l) launch_att(att_ns, s);
        CK(cudaStreamEndCapture(s, &g));
        cudaGraphExec_t exec;
        CK(cudaGraphInstantiate(&exec, g, 0));
        time_graph(exec, s, 2);
        printf("attention stand-ins alone (%d x %.1f us): %.1f us\n", n_layer, att_ns / 1e3, time_graph(exec, s, 8) * 1e3);
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(g));
    }
    for (const Variant& v : variants) {
        if (only && !listed(only, v.name)) continue;
        printf("%-8s", v.name);
        if (strcmp(v.name, "read") && strcmp(v.name, "nofma") && strcmp(v.name, "nox")) {
            out_of(v.r1, layers[0].o, got);
            const bool same_o = memcmp(got.data(), ref_o.data(), hidden * 4) == 0;
            out_of(v.r1, layers[0].down, got);
            const bool same_d = memcmp(got.data(), ref_d.data(), hidden * 4) == 0;
            printf(" bits %s", same_o && same_d ? "same" : "DIFFER");
        }
        for (int kind = 0; kind < 5; ++kind) {
            double kb = 0;
            cudaGraph_t g;
            std::vector<Job> list;
            if (v.list) {
                for (const Layer& L : layers) {
                    if (kind == 0 || kind == 1) list.push_back(L.qkv);
                    if (kind == 0 || kind == 2) list.push_back(L.o);
                    if (kind == 0 || kind == 3) list.push_back(L.gu);
                    if (kind == 0 || kind == 4) list.push_back(L.down);
                }
                for (const Job& jb : list) kb += double(jb.rows) * jb.k * 2;
                CK(cudaMemcpy(g_jobs, list.data(), sizeof(Job) * list.size(), cudaMemcpyHostToDevice));
            }
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            if (v.list) v.list(g_jobs, static_cast<int>(list.size()), g_bar, s);
            for (const Layer& L : (v.list ? std::vector<Layer>{} : layers)) {
                const bool read = v.r1 == run_read;
                if (kind == 0 || kind == 1) { v.r1(L.qkv, s); kb += double(L.qkv.rows) * L.qkv.k * 2; }
                if (att_ns && (kind == 0 || kind == 2)) launch_att(att_ns, s);
                if (kind == 0 || kind == 2) { (v.ro ? v.ro : v.r1)(L.o, s); kb += double(L.o.rows) * L.o.k * 2; }
                if (kind == 0 || kind == 3) { (read ? v.r1 : v.r2)(L.gu, s); kb += double(L.gu.rows) * L.gu.k * 2; }
                if (kind == 0 || kind == 4) { v.r1(L.down, s); kb += double(L.down.rows) * L.down.k * 2; }
            }
            CK(cudaStreamEndCapture(s, &g));
            cudaGraphExec_t exec;
            CK(cudaGraphInstantiate(&exec, g, 0));
            time_graph(exec, s, 2);
            const float ms = time_graph(exec, s, 8);
            printf("  %s %7.1f us %5.2f TB/s", kinds[kind], ms * 1e3, kb / (ms * 1e-3) / 1e12);
            CK(cudaGraphExecDestroy(exec));
            CK(cudaGraphDestroy(g));
        }
        printf("\n");
    }
    {
        float best = 1e30f;
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        int sms = 0;
        CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        for (int r = 0; r < 6; ++r) {
            CK(cudaEventRecord(e0, s));
            k_read_all<<<sms * 8, 256, 0, s>>>(reinterpret_cast<const uint4*>(w), static_cast<int64_t>(bytes / 16), y);
            CK(cudaEventRecord(e1, s));
            CK(cudaEventSynchronize(e1));
            float ms = 0;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            best = ms < best ? ms : best;
        }
        printf("one read of %.2f GB: %.1f us, %.2f TB/s\n", bytes / 1e9, best * 1e3, bytes / (best * 1e-3) / 1e12);
    }
    CK(cudaDeviceSynchronize());
    return 0;
}
