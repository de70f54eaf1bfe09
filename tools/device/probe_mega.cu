// Probe: Qwen3-4B's 144 decode matvecs (F16 weights, F32 activations; per layer q/k/v 6144 x 2560,
// o 2560 x 4096, gate/up 19456 x 2560, down 2560 x 9728) as ONE persistent launch in which the
// weights never wait for the activations: each SM's producer warp streams the SM's share of every
// job's weight rows (one contiguous byte range a job) through a ring of shared-memory stages with
// the copy engine (cp.async.bulk), running ahead into the next jobs while the SM's consumer warps
// wait for the previous job's output (a per-job completion counter over all SMs, not a barrier
// that holds the loads). DRAM stays busy across the job boundaries as long as the ring has room
// (S stages of T bytes: ~5 us of an SM's share of the bandwidth at 10 x 16 KiB).
//
// The question: how close does a decode step's matvec chain come to one read of the same bytes
// (1,593 us in one launch on the H200, probe_gemv_f16.cu) when the loads never stop at job
// boundaries, against the production kernels' 144 PDL launches (bal8x2r2, 2,139 us)? The earlier
// persistent probes (probe_gemv_f16.cu pers*) held a grid barrier and a few units a warp in flight
// across it, and lost. Timing only: the products are summed per row in another order than the
// production kernels (the bits differ); a check against a plain per-row reference over the first
// jobs makes sure the sums are right.
//
// Measured (H200, thirty-fourth session, us a step of the 144 matvecs; the production launches
// bal8x2r2 2,141-2,151, a read in the same launches 1,843-1,858, one read 1,592-1,630):
// - every consumer warp on every tile (a 128-unit slice each, two warp sums a slice): 3,340-3,356
//   at 4-11 stages, 3,568 with 12 consumer warps, 4,966 with 4. The stage count did not matter:
//   each tile waited for one latency-bound pass of all the warps.
// - a tile to one consumer warp in turn (below): 11 stages 2,372, 8 stages 2,525, 4 consumer warps
//   3,163-3,167. Closer, still behind the launches; shared memory caps the ring at 11 stages of
//   16 KiB beside down's 38 KiB of activations. With the guard against a fast warp passing a
//   stage early (below) 2,405.
// - What holds it back (11 stages, 8 consumer warps, the modes below, results wrong): without the
//   wait for the previous job 2,302; without the arithmetic 1,914; without either 1,718 (4.23
//   TB/s: the copy-engine ring streams about as fast as one plain read). So the consumers are the
//   limit, not the ring or the dependencies: every 16-byte weight unit reads 32 bytes of x from
//   shared memory (the lanes' x reads, 32 bytes apart, also conflict two-way), which nearly fills
//   the SM's shared-memory bandwidth; the production kernels read x once for two rows.
// - The row-group consumers (thirty-fifth session; x read once for 8 rows, each lane's units in
//   k_mul_mat's order: every variant's check is bit for bit), us a step:
//   - `rows` (a stage one bulk copy per row piece: 8 x 1 KiB from the row-major weights): 3,107-3,168
//     at any consumer count, 3,047 with neither the wait nor the arithmetic: 1-KiB copies cap the
//     copy engine at ~2.4 TB/s.
//   - `packed` (the weights repacked so that a stage is one 8 KiB copy): 2,014 (1,959 in another
//     run) at 22 stages; modes 1 / 2 / 3: 1,879 / 1,954 / 1,746.
//   - One launch a job with PDL, as the backend launches (`lrows`, `lpacked`, `ltmap`): `ltmap`
//     takes a stage as two 2-D boxes (8 rows x 256 columns) through a tensor map of the row-major
//     weights, no repacking: 16 stages, 12 consumers 1,929-1,931, 8 consumers 1,944-1,950, 16
//     consumers 1,985; 8 stages 4 consumers 2,065-2,070; in the same runs bal8x2r2 2,143-2,147, a
//     read in the same launches 1,834, one read 1,598. Without the PDL wait 1,731; without it and
//     the arithmetic 1,714 (4.24 TB/s). `lpacked` 2,113-2,143, `lrows` 3,310.
//   - Built into the backend from `ltmap` (cuda/matmul_rows_tma.cuh, opt-in PYSPEC_CUDA_ROW_TMA=1):
//     same bits, but Qwen3-4B tg128 315 t/s against 363 without (see docs/cuda-probes.md).
// Nothing else of it is in the backend (docs/cuda-probes.md).
//
// usage: probe_mega [layers, default 36] [stages, default 10] [consumer warps <= stages, default 8]
//                   [mode, default 0: 1 no wait for the previous job, 2 no arithmetic, 3 neither]
//                   [consumer: tiles (default); the row-group consumer (up to 26 stages) in one
//                    persistent launch: rows, packed; one launch a job: lrows, lpacked, ltmap]
//                   [attention stand-in us after each q/k/v, one launch a job only, default 0]
// mode bit 2 (one launch a job): the backend's PDL trigger, after the wait, not at the start.
// Compare with: probe_gemv_f16 36 bal8x2r2 <the same stand-in us>
// Build: nvcc -O3 -gencode=arch=compute_90a,code=sm_90a probe_mega.cu -o probe_mega
#include <cuda.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "probe_common.cuh"
#include "probe_f16_rows.cuh"
#include "probe_pdl.cuh"

constexpr int kTile = 16384;      // bytes a stage
constexpr int kMaxStages = 12;
constexpr int kMaxK = 9728;       // the widest input (down)
constexpr int kMaxRowsSm = 160;   // rows of one job on one SM at most (gate/up: 19456 / 132 = 148)

struct Job {
    const __half* w;  // rows x k, row-major
    int rows, k;
    const float* x;   // k inputs (the previous job's output)
    float* y;         // rows outputs
    const __half* wp; // the same weights packed box by box (k_pack), for the `packed` consumer
};

// Rows [r0, r1) of a job of `rows` rows on SM b of G.
__device__ __forceinline__ void sm_rows(int rows, int b, int G, int& r0, int& r1) {
    r0 = static_cast<int>(static_cast<int64_t>(rows) * b / G);
    r1 = static_cast<int>(static_cast<int64_t>(rows) * (b + 1) / G);
}

// The ring's barriers: full[s] completes when stage s has landed (the producer's one arrival and
// the copies' bytes), empty[s] when its one consumer warp has released it. Then the block syncs.
__device__ __forceinline__ void init_ring(uint64_t* full, uint64_t* empty, int S) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            mbar_init(saddr(&full[s]), 1);
            mbar_init(saddr(&empty[s]), 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
}

// The consumer warps (threads 32 .. 32 (C + 1) - 1) before job j: the previous job's output
// complete on every SM (unless mode bit 0), then job j's input x in shared memory. Named barrier 1
// holds the consumers only (the producer warp never waits on them).
template <int C>
__device__ __forceinline__ void job_input(const Job& jb, int j, const unsigned* done, int mode, float* xs) {
    constexpr int kCT = C * 32;
    const int ct = threadIdx.x - 32;
    if (j > 0 && !(mode & 1)) {
        if (ct == 0) {
            unsigned v;
            do {
                asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(done + j - 1) : "memory");
            } while (v < gridDim.x);
        }
        asm volatile("bar.sync 1, %0;" ::"r"(kCT) : "memory");
    }
    for (int i = ct; i < jb.k / 4; i += kCT) {
        reinterpret_cast<float4*>(xs)[i] = __ldcg(reinterpret_cast<const float4*>(jb.x) + i);
    }
    asm volatile("bar.sync 1, %0;" ::"r"(kCT) : "memory");
}

// The consumers after job j: its outputs visible, then this SM counted in done[j].
template <int C>
__device__ __forceinline__ void job_done(int j, unsigned* done) {
    __threadfence();
    asm volatile("bar.sync 1, %0;" ::"r"(C * 32) : "memory");
    if (threadIdx.x == 32) atomicAdd(done + j, 1u);
}

// Block: warp 0's lane 0 produces, warps 1..C consume. done[j] counts the SMs that finished job j.
template <int C>
// mode (what to leave out, for timing only: results wrong): bit 0 the wait for the previous job,
// bit 1 the arithmetic (a consumer releases each tile as soon as it has landed).
__global__ void __launch_bounds__((C + 1) * 32, 1) k_mega(const Job* jobs, int n_jobs, int S, unsigned* done, int mode) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) uint64_t full[kMaxStages], empty[kMaxStages];
    __shared__ float acc[kMaxRowsSm];
    unsigned char* ring = smem;
    float* xs = reinterpret_cast<float*>(smem + static_cast<size_t>(S) * kTile);
    const int G = gridDim.x, b = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int i = threadIdx.x; i < kMaxRowsSm; i += blockDim.x) acc[i] = 0.0f;
    init_ring(full, empty, S);
    if (warp == 0) {  // the producer: every job's byte range, tile by tile, as far ahead as the ring allows
        if (lane != 0) return;
        int it = 0;
        for (int j = 0; j < n_jobs; ++j) {
            const Job jb = jobs[j];
            int r0, r1;
            sm_rows(jb.rows, b, G, r0, r1);
            const char* src = reinterpret_cast<const char*>(jb.w) + static_cast<int64_t>(r0) * jb.k * 2;
            const int64_t bytes = static_cast<int64_t>(r1 - r0) * jb.k * 2;
            for (int64_t off = 0; off < bytes; off += kTile, ++it) {
                const int st = it % S;
                mbar_wait(saddr(&empty[st]), static_cast<uint32_t>(((it / S) & 1) ^ 1));
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                const uint32_t n = static_cast<uint32_t>(bytes - off < kTile ? bytes - off : kTile);
                bulk_load(saddr(ring + static_cast<size_t>(st) * kTile), src + off, n, saddr(&full[st]));
            }
        }
        return;
    }
    // The consumers: tile it goes to consumer warp it % C (C tiles in work at once). Rows start at
    // multiples of 32 units (every shape's row has a multiple of 32 units) and tiles at multiples
    // of 1024, so a warp's 32 lanes always work in one row: each lane sums its units of the row,
    // and at the row's end (or the tile's) one warp sum goes into the row's shared-memory total
    // (atomic: a row's two pieces may sit in tiles of two warps).
    const int cw = warp - 1;
    constexpr int kCT = C * 32;
    const int ct = threadIdx.x - 32;
    int it = 0;
    for (int j = 0; j < n_jobs; ++j) {
        const Job jb = jobs[j];
        int r0, r1;
        sm_rows(jb.rows, b, G, r0, r1);
        job_input<C>(jb, j, done, mode, xs);
        const int units_row = jb.k / 8;
        const int64_t bytes = static_cast<int64_t>(r1 - r0) * jb.k * 2;
        for (int64_t off = 0; off < bytes; off += kTile, ++it) {
            if (it % C != cw) continue;
            const int st = it % S;
            // The stage's previous tile (it - S, another warp's) released first: its fill has
            // landed then, so the parity below names this tile's fill and not that earlier phase
            // (a fast warp would otherwise pass a stage whose previous fill is still in flight).
            // It assumes the stage's tile before that (it - 2S) was released, which holds while no
            // warp runs a whole ring ahead of the slowest; good enough for a timing probe.
            if (it >= S) mbar_wait(saddr(&empty[st]), static_cast<uint32_t>(((it / S) - 1) & 1));
            mbar_wait(saddr(&full[st]), static_cast<uint32_t>((it / S) & 1));
            const int n_units = mode & 2 ? 0 : static_cast<int>((bytes - off < kTile ? bytes - off : kTile) / 16);
            const uint4* tile = reinterpret_cast<const uint4*>(ring + static_cast<size_t>(st) * kTile);
            const int64_t g0 = off / 16;
            int ra = static_cast<int>(g0 / units_row), col = static_cast<int>(g0 % units_row);
            float pa = 0.0f;
#pragma unroll 4
            for (int i = 0; i < n_units; i += 32) {
                pa = unit_fma(tile[i + lane], xs + (col + lane) * 8, pa);
                col += 32;
                if (col == units_row) {  // the row ends (warp-uniform)
                    const float sum = warp_sum(pa);
                    if (lane == 0) atomicAdd(&acc[ra], sum);
                    pa = 0.0f;
                    col = 0;
                    ++ra;
                }
            }
            if (col != 0) {  // the tile ends inside a row
                const float sum = warp_sum(pa);
                if (lane == 0) atomicAdd(&acc[ra], sum);
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(saddr(&empty[st]));
        }
        asm volatile("bar.sync 1, %0;" ::"r"(kCT) : "memory");
        for (int r = ct; r < r1 - r0; r += kCT) {
            jb.y[r0 + r] = acc[r];
            acc[r] = 0.0f;
        }
        job_done<C>(j, done);
    }
}

// The row-group consumer ("rows"; not yet run on a GPU when written): rows go to SMs in groups
// of kGroupRows, a stage holds a box of the group's kGroupRows rows x kBoxCols columns (a bulk copy
// a row piece, one barrier), and a group's boxes, in column order, go to one consumer warp. Lane l
// takes units l and l + 32 of each box for every row of the group, reading x once for all of them,
// and carries each row's sum across the boxes, so every lane sums its units u = l (mod 32) in
// increasing u and a row ends in warp_sum's tree: k_ref's order (and k_mul_mat's), checked bit for
// bit. An SM's groups are taken C at a time (a wave); the producer issues a wave's boxes column by
// column across its groups, so the wave's warps work side by side.
constexpr int kGroupRows = 8;
constexpr int kBoxCols = 512;                    // every K here is a multiple of it
constexpr int kBox = kGroupRows * kBoxCols * 2;  // bytes a stage: 8 KiB
constexpr int kMaxRowStages = 26;

// Row groups [g0, g1) of a job of `rows` rows on SM b of G.
__device__ __forceinline__ void sm_groups(int rows, int b, int G, int& g0, int& g1) {
    const int n = rows / kGroupRows;
    g0 = static_cast<int>(static_cast<int64_t>(n) * b / G);
    g1 = static_cast<int>(static_cast<int64_t>(n) * (b + 1) / G);
}

// The packed layout: group g's box bx is kBox contiguous bytes, its rows one after the other, so
// the producer issues one bulk copy a stage instead of kGroupRows (the weights repacked once).
__global__ void k_pack(Job j) {
    const int64_t n = int64_t{j.rows} * j.k;
    const int nb = j.k / kBoxCols;
    __half* out = const_cast<__half*>(j.wp);
    for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
        const int64_t row = i / j.k;
        const int col = static_cast<int>(i % j.k);
        const int64_t g = row / kGroupRows;
        const int r = static_cast<int>(row % kGroupRows), bx = col / kBoxCols, c = col % kBoxCols;
        out[((g * nb + bx) * kGroupRows + r) * kBoxCols + c] = j.w[i];
    }
}

// Where a stage's box comes from: kRowCopies one bulk copy a row piece from the row-major weights,
// kPacked one bulk copy from the packed layout, kTensorMap two 2-D boxes (8 rows x 256 columns) of
// the row-major weights through a tensor map (in shared memory [half][row][256 columns]).
enum BoxSource { kRowCopies = 0, kPacked = 1, kTensorMap = 2 };

// The producer's part of one job on block b of G: the block's row groups, a wave of C groups at a
// time, box by box in column order across the wave's groups. `it` counts stages over the jobs.
template <int C, int Src>
__device__ __forceinline__ void produce_rows(const Job& jb, const CUtensorMap* map, int b, int G, int S, int& it,
                                             uint64_t* full, uint64_t* empty, unsigned char* ring) {
    int g0, g1;
    sm_groups(jb.rows, b, G, g0, g1);
    const int nb = jb.k / kBoxCols;
    const int64_t row_bytes = int64_t{jb.k} * 2;
    for (int w0 = g0; w0 < g1; w0 += C) {
        const int wn = g1 - w0 < C ? g1 - w0 : C;
        for (int bx = 0; bx < nb; ++bx) {
            for (int gi = 0; gi < wn; ++gi, ++it) {
                const int st = it % S;
                mbar_wait(saddr(&empty[st]), static_cast<uint32_t>(((it / S) & 1) ^ 1));
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                const uint32_t bar = saddr(&full[st]);
                const uint32_t dst = saddr(ring + static_cast<size_t>(st) * kBox);
                mbar_expect_tx(bar, kBox);
                if (Src == kPacked) {
                    bulk_copy(dst, reinterpret_cast<const char*>(jb.wp) + (int64_t{w0 + gi} * nb + bx) * kBox, kBox, bar);
                } else if (Src == kTensorMap) {
                    for (int h = 0; h < 2; ++h) {
                        tma_load_2d(dst + h * (kBox / 2), map, bx * kBoxCols + h * (kBoxCols / 2), (w0 + gi) * kGroupRows, bar);
                    }
                } else {
                    const char* src = reinterpret_cast<const char*>(jb.w) + (w0 + gi) * kGroupRows * row_bytes +
                                      int64_t{bx} * kBoxCols * 2;
                    for (int r = 0; r < kGroupRows; ++r) {
                        bulk_copy(dst + r * kBoxCols * 2, src + r * row_bytes, kBoxCols * 2, bar);
                    }
                }
            }
        }
    }
}

// Unit u (0..63) of row r in a stage's box, by the box's layout.
template <int Src>
__device__ __forceinline__ uint4 box_unit(const unsigned char* box, int r, int u) {
    if (Src == kTensorMap) return reinterpret_cast<const uint4*>(box + (u >> 5) * (kBox / 2) + r * kBoxCols)[u & 31];
    return reinterpret_cast<const uint4*>(box + r * kBoxCols * 2)[u];
}

// Consumer warp cw's part of one job (x already in shared memory): lane l takes units l and l + 32
// of each box for every row of its group, x read once for them all, each row's sum carried across
// the boxes: k_mul_mat's order, so its bits.
template <int C, int Src>
__device__ __forceinline__ void consume_rows(const Job& jb, int b, int G, int S, int& it, int mode, const float* xs,
                                             uint64_t* full, uint64_t* empty, const unsigned char* ring) {
    const int cw = (threadIdx.x >> 5) - 1, lane = threadIdx.x & 31;
    int g0, g1;
    sm_groups(jb.rows, b, G, g0, g1);
    const int nb = jb.k / kBoxCols;
    for (int w0 = g0; w0 < g1; w0 += C) {
        const int wn = g1 - w0 < C ? g1 - w0 : C;
        if (cw < wn) {
            float acc[kGroupRows] = {};
            for (int bx = 0; bx < nb; ++bx) {
                const int mine = it + bx * wn + cw;
                const int st = mine % S;
                // The stage's previous box released first (see k_mega).
                if (mine >= S) mbar_wait(saddr(&empty[st]), static_cast<uint32_t>(((mine / S) - 1) & 1));
                mbar_wait(saddr(&full[st]), static_cast<uint32_t>((mine / S) & 1));
                if (!(mode & 2)) {
                    const unsigned char* box = ring + static_cast<size_t>(st) * kBox;
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int u = lane + 32 * h;  // the unit in the box
                        const float* xu = xs + (bx * (kBoxCols / 8) + u) * 8;
                        const float4 xa = *reinterpret_cast<const float4*>(xu);
                        const float4 xb = *reinterpret_cast<const float4*>(xu + 4);
#pragma unroll
                        for (int r = 0; r < kGroupRows; ++r) acc[r] = unit_fma2(box_unit<Src>(box, r, u), xa, xb, acc[r]);
                    }
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(saddr(&empty[st]));
            }
#pragma unroll
            for (int r = 0; r < kGroupRows; ++r) {
                const float sum = warp_sum(acc[r]);
                if (lane == 0) jb.y[(w0 + cw) * kGroupRows + r] = sum;
            }
        }
        it += nb * wn;
    }
}

// Every job in one persistent launch (the row-group consumer).
template <int C, int Src>
__global__ void __launch_bounds__((C + 1) * 32, 1)
    k_mega_rows(const Job* jobs, int n_jobs, int S, unsigned* done, int mode) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) uint64_t full[kMaxRowStages], empty[kMaxRowStages];
    unsigned char* ring = smem;
    float* xs = reinterpret_cast<float*>(smem + static_cast<size_t>(S) * kBox);
    const int G = gridDim.x, b = blockIdx.x;
    init_ring(full, empty, S);
    int it = 0;
    if (threadIdx.x < 32) {  // the producer
        if (threadIdx.x != 0) return;
        for (int j = 0; j < n_jobs; ++j) produce_rows<C, Src>(jobs[j], nullptr, b, G, S, it, full, empty, ring);
        return;
    }
    for (int j = 0; j < n_jobs; ++j) {
        const Job jb = jobs[j];
        job_input<C>(jb, j, done, mode, xs);
        consume_rows<C, Src>(jb, b, G, S, it, mode, xs, full, empty, ring);
        job_done<C>(j, done);
    }
}


// One job a launch (PDL, as the backend launches its matvecs): the producer streams the block's
// boxes from the start (weights are constant), filling the ring while the previous launch runs; the
// consumers wait for it (griddepcontrol.wait) before reading x. The next launch is let in at once,
// so its blocks sit beside this one's when shared memory allows two a SM.
// mode bit 2: the backend's trigger (cuda/launch.cuh pdl_enter: the next launch let in only after
// the wait) instead of one at the start.
template <int C, int Src>
__global__ void __launch_bounds__((C + 1) * 32, 2)
    k_launch_rows(const Job jb, const __grid_constant__ CUtensorMap map, int S, int mode) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) uint64_t full[kMaxRowStages], empty[kMaxRowStages];
    unsigned char* ring = smem;
    float* xs = reinterpret_cast<float*>(smem + static_cast<size_t>(S) * kBox);
    const int G = gridDim.x, b = blockIdx.x;
    if (!(mode & 4)) pdl_go();
    init_ring(full, empty, S);
    int it = 0;
    if (threadIdx.x < 32) {
        if (threadIdx.x == 0) produce_rows<C, Src>(jb, &map, b, G, S, it, full, empty, ring);
        return;
    }
    if (!(mode & 1)) pdl_wait();
    if (mode & 4) pdl_go();
    constexpr int kCT = C * 32;
    for (int i = threadIdx.x - 32; i < jb.k / 4; i += kCT) {
        reinterpret_cast<float4*>(xs)[i] = __ldcg(reinterpret_cast<const float4*>(jb.x) + i);
    }
    asm volatile("bar.sync 1, %0;" ::"r"(kCT) : "memory");
    consume_rows<C, Src>(jb, b, G, S, it, mode, xs, full, empty, ring);
}

// The reference: one warp a row, fp32 sums.
__global__ void k_ref(Job j) {
    const int row = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= j.rows) return;
    const uint4* w = reinterpret_cast<const uint4*>(j.w + static_cast<int64_t>(row) * j.k);
    float a = 0.0f;
    for (int u = lane; u < j.k / 8; u += 32) a = unit_fma(w[u], j.x + u * 8, a);
    a = warp_sum(a);
    if (lane == 0) j.y[row] = a;
}

// One launch of kernel over n_jobs jobs on G SMs (a block each), S stages of stage_bytes.
template <int C>
static void run_kernel(void (*kernel)(const Job*, int, int, unsigned*, int), size_t stage_bytes, const Job* d_jobs,
                       int n_jobs, int S, unsigned* done, int G, int mode, cudaStream_t s) {
    const size_t smem = static_cast<size_t>(S) * stage_bytes + kMaxK * sizeof(float);
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, (C + 1) * 32, smem));
    if (per_sm < 1) { printf("%d consumer warps and %d stages do not fit an SM\n", C, S); exit(1); }
    CK(cudaMemsetAsync(done, 0, sizeof(unsigned) * n_jobs, s));
    kernel<<<G, (C + 1) * 32, smem, s>>>(d_jobs, n_jobs, S, done, mode);
    CK(cudaGetLastError());
}
template <int C>
static void run(const Job* d_jobs, int n_jobs, int S, unsigned* done, int G, int mode, cudaStream_t s) {
    run_kernel<C>(k_mega<C>, kTile, d_jobs, n_jobs, S, done, G, mode, s);
}
template <int C>
static void run_rows(const Job* d_jobs, int n_jobs, int S, unsigned* done, int G, int mode, cudaStream_t s) {
    run_kernel<C>(k_mega_rows<C, kRowCopies>, kBox, d_jobs, n_jobs, S, done, G, mode, s);
}
template <int C>
static void run_packed(const Job* d_jobs, int n_jobs, int S, unsigned* done, int G, int mode, cudaStream_t s) {
    run_kernel<C>(k_mega_rows<C, kPacked>, kBox, d_jobs, n_jobs, S, done, G, mode, s);
}

// cuTensorMapEncodeTiled from the driver through the runtime (no libcuda link).
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                                 const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
static CUtensorMap job_map(const Job& j) {
    static EncodeTiled encode = [] {
        void* f = nullptr;
        cudaDriverEntryPointQueryResult q{};
        CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
        return reinterpret_cast<EncodeTiled>(f);
    }();
    CUtensorMap map{};
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(j.k), static_cast<cuuint64_t>(j.rows)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(j.k) * 2};
    const cuuint32_t box[2] = {kBoxCols / 2, kGroupRows}, estr[2] = {1, 1};
    const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, const_cast<__half*>(j.w), dims, strides, box, estr,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) { printf("cuTensorMapEncodeTiled failed (%d)\n", static_cast<int>(r)); exit(1); }
    return map;
}

static int64_t g_att_ns = 0;  // the attention stand-in's time after each q/k/v job (one launch a job only)

// Jobs [0, n) one launch each (PDL), G blocks of C + 1 warps, S stages.
template <int C, int Src>
static void run_launches(const std::vector<Job>& jobs, const std::vector<CUtensorMap>& maps, int n, int S, int G, int mode,
                         cudaStream_t s) {
    auto kernel = k_launch_rows<C, Src>;
    for (int i = 0; i < n; ++i) {
        const size_t smem = static_cast<size_t>(S) * kBox + jobs[i].k * sizeof(float);
        CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
        launch_pdl_block(kernel, G, (C + 1) * 32, smem, s, jobs[i], maps[i], S, mode);
        if (g_att_ns && i % 4 == 0) launch_att(g_att_ns, s);  // after q/k/v
    }
}

int main(int argc, char** argv) {
    const int n_layer = argc > 1 ? atoi(argv[1]) : 36;
    const int S = argc > 2 ? atoi(argv[2]) : 10;
    const int C = argc > 3 ? atoi(argv[3]) : 8;
    const int mode = argc > 4 ? atoi(argv[4]) : 0;
    const std::string consumer = argc > 5 ? argv[5] : "tiles";
    // One launch a job (PDL): lrows / lpacked / ltmap, the row-group consumer's box sources.
    g_att_ns = argc > 6 ? static_cast<int64_t>(atof(argv[6]) * 1000) : 0;  // one launch a job only
    if (g_att_ns) size_att();
    const int per_launch = consumer == "lrows" ? kRowCopies : consumer == "lpacked" ? kPacked : consumer == "ltmap" ? kTensorMap : -1;
    const bool packed = consumer == "packed" || consumer == "lpacked";  // the row-group consumer on packed weights
    const bool rows = consumer == "rows" || packed || per_launch >= 0;  // the row-group consumer
    const int max_stages = rows ? kMaxRowStages : kMaxStages;
    if (S < 2 || S > max_stages) { printf("stages: 2..%d\n", max_stages); return 1; }
    // More consumer warps than stages would hold a stage's tile and the next one at once.
    if (C > S) { printf("consumer warps (%d) must not exceed the stages (%d)\n", C, S); return 1; }
    const int hidden = kHidden, q = kQ, kv = kKV, ffn = kFfn;
    const int64_t per_layer = kLayerHalves;
    int G = 0;
    CK(cudaDeviceGetAttribute(&G, cudaDevAttrMultiProcessorCount, 0));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    __half* w = qwen3_weights(n_layer, s);
    __half* wp = nullptr;
    if (packed) CK(cudaMalloc(&wp, per_layer * n_layer * sizeof(__half)));
    float* buf[2];
    for (float*& p : buf) CK(cudaMalloc(&p, int64_t{2} * ffn * sizeof(float)));
    {
        std::vector<float> hx(2 * ffn);
        for (size_t i = 0; i < hx.size(); ++i) hx[i] = 0.01f * static_cast<float>((i * 37) % 101) - 0.5f;
        CK(cudaMemcpy(buf[0], hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
    }
    // Jobs in order, ping-ponging between the buffers: job i reads buf[i % 2], writes buf[(i + 1) % 2].
    std::vector<Job> jobs;
    const __half* p = w;
    const int shape[4][2] = {{q + 2 * kv, hidden}, {hidden, q}, {2 * ffn, hidden}, {hidden, ffn}};
    for (int l = 0; l < n_layer; ++l) {
        for (const auto& sh : shape) {
            const int i = static_cast<int>(jobs.size());
            jobs.push_back({p, sh[0], sh[1], buf[i % 2], buf[(i + 1) % 2], wp ? wp + (p - w) : nullptr});
            if (wp) k_pack<<<1024, 256, 0, s>>>(jobs.back());
            p += static_cast<int64_t>(sh[0]) * sh[1];
        }
    }
    const int n_jobs = static_cast<int>(jobs.size());
    std::vector<CUtensorMap> maps;
    for (const Job& j : jobs) maps.push_back(job_map(j));
    Job* d_jobs = nullptr;
    unsigned* done = nullptr;
    CK(cudaMalloc(&d_jobs, sizeof(Job) * n_jobs));
    CK(cudaMemcpy(d_jobs, jobs.data(), sizeof(Job) * n_jobs, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&done, sizeof(unsigned) * n_jobs));
    auto launch = [&](int nj, int m) {
        if (per_launch >= 0) {
            const int key = C * 4 + per_launch;
            switch (key) {
#define PROBE_CASE(c, src) case c * 4 + src: run_launches<c, src>(jobs, maps, nj, S, G, m, s); return;
                PROBE_CASE(4, 0) PROBE_CASE(4, 1) PROBE_CASE(4, 2) PROBE_CASE(8, 0) PROBE_CASE(8, 1) PROBE_CASE(8, 2)
                PROBE_CASE(12, 0) PROBE_CASE(12, 1) PROBE_CASE(12, 2) PROBE_CASE(16, 2)
#undef PROBE_CASE
                default: printf("consumer warps for one launch a job: 4, 8, 12 (16: ltmap)\n"); exit(1);
            }
        }
        switch (C) {
            case 4: (packed ? run_packed<4> : rows ? run_rows<4> : run<4>)(d_jobs, nj, S, done, G, m, s); break;
            case 8: (packed ? run_packed<8> : rows ? run_rows<8> : run<8>)(d_jobs, nj, S, done, G, m, s); break;
            case 12: (packed ? run_packed<12> : rows ? run_rows<12> : run<12>)(d_jobs, nj, S, done, G, m, s); break;
            case 16: (packed ? run_packed<16> : rows ? run_rows<16> : run<16>)(d_jobs, nj, S, done, G, m, s); break;
            default: printf("consumer warps: 4, 8, 12 or 16\n"); exit(1);
        }
    };

    // Check: the first 4 jobs against the reference (the same input, fresh buffers each way).
    {
        const int nj = 4;
        std::vector<float> x0(2 * ffn);
        CK(cudaMemcpy(x0.data(), buf[0], x0.size() * 4, cudaMemcpyDeviceToHost));
        launch(nj, 0);
        CK(cudaStreamSynchronize(s));
        std::vector<float> got(hidden);
        CK(cudaMemcpy(got.data(), buf[nj % 2], hidden * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(buf[0], x0.data(), x0.size() * 4, cudaMemcpyHostToDevice));
        for (int i = 0; i < nj; ++i) k_ref<<<(jobs[i].rows + 7) / 8, 256, 0, s>>>(jobs[i]);
        CK(cudaStreamSynchronize(s));
        std::vector<float> want(hidden);
        CK(cudaMemcpy(want.data(), buf[nj % 2], hidden * 4, cudaMemcpyDeviceToHost));
        double worst = 0.0, scale = 0.0;
        for (int i = 0; i < hidden; ++i) {
            worst = fmax(worst, fabs(static_cast<double>(got[i]) - want[i]));
            scale = fmax(scale, fabs(static_cast<double>(want[i])));
        }
        // The row-group consumer sums in the reference's order: equal bits. The tile consumer does not.
        const bool ok = rows ? worst == 0.0 : worst <= 1e-3 * scale + 1e-6;
        printf("check over %d jobs: max |mega - ref| %.3g (outputs up to %.3g)%s\n", nj, worst, scale,
               ok ? (rows ? ", bits same" : "") : "  MISMATCH");
        CK(cudaMemcpy(buf[0], x0.data(), x0.size() * 4, cudaMemcpyHostToDevice));
    }

    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    launch(n_jobs, mode);
    CK(cudaStreamEndCapture(s, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    for (int r = 0; r < 3; ++r) CK(cudaGraphLaunch(exec, s));
    CK(cudaStreamSynchronize(s));
    const double bytes = static_cast<double>(per_layer) * n_layer * 2;
    const float ms = time_graph(exec, s, 20);
    printf("mega %s (%d SMs, %d stages of %d KiB, %d consumer warps, mode %d): %.1f us a step, %.2f TB/s over %.2f GB\n",
           consumer.c_str(), G, S, (rows ? kBox : kTile) / 1024, C, mode, ms * 1e3, bytes / (ms * 1e-3) / 1e12,
           bytes / 1e9);
    return 0;
}
