// Attention for single rows (decode): each warp's chunk of K and V rows is copied into shared
// memory by cp.async, all of a chunk's copies in flight at once, and a long row's pages are
// computed by separate blocks.
//
// Why: a decode step's attention is a chain of memory round trips, not a bandwidth problem
// (SmolLM2: 9 blocks, a few chunks per row). The per-row kernel (ops_attention.cu) waits for q,
// then for each lane's K row, then for the chunk's V rows in batches of 8 behind the softmax (ncu,
// warm L2, H200: 15.7 us of a 1.34 ms SmolLM2 step, 35% of its kernel time). Here the warp's first
// chunk is requested before q is waited for, V arrives while the scores are computed, and with
// two stages (head_dim <= 64) the next page's copies overlap this page's arithmetic.
// Measured on the H200 (2026-11-30, ncu with warm caches, per layer; PYSPEC_CUDA_ATT_STAGED 0
// against 1): SmolLM2 at 64 cells 15.9 -> 5.5 us, at 4000 cells 193 -> 37 us; Qwen3-4B at 4000
// cells 303 -> 61 us. tg128: SmolLM2 Q4_1 777 -> 1005 t/s, Qwen3-4B F16 239 -> 281 (one build,
// one run after the other; llama.cpp: 921 and 273).
// A block walking a long row still takes its pages one after another on kWarps warps (9 blocks
// for SmolLM2), so a single row over more than two pages (256 cells each) is split: block z
// computes page z's state into the backend's split scratch and the row's last block combines them
// in page order, exactly as a walking block would.
//
// The bits are k_attention's (test_staged_attention_gives_the_unstaged_kernels_bits): chunk c
// belongs to warp c mod kWarps; lane i scores cell 32c + i with the same fmaf sequence over the head
// dim (q from shared memory, K converted from the same F16 values); each chunk is folded from the
// empty state with the same formulas, V rows in cell order, rows with p = 0 skipped; the page's
// warps merge and the pages combine with attention_common.cuh's functions in their fixed order.
// Staging and splitting change where values are read from and which block computes a page, never
// which values or in what order they are combined, so invariant 7 holds across the choice of
// kernel (the row-tiled kernel gives the same bits again).
#include <mutex>
#include <stdexcept>

#include "cuda/async_copy.cuh"
#include "cuda/attention_common.cuh"
#include "cuda/graph_cache.cuh"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "cuda/phase_stamps.cuh"
#include "cuda/rope_common.cuh"

namespace pyspec {
namespace cuda {
namespace {

constexpr int kKPad = 8;  // halves after each staged K row: the lanes' 16-byte row reads hit distinct banks
[[maybe_unused]] constexpr int kPhaseSlots = 9;  // PHASE_STAMP slots 0-8 (the diagnostic build's timeline)

// Two stages where they fit the shared memory comfortably (head_dim <= 64), else one.
constexpr int stages_for(int nc) { return nc <= 2 ? 2 : 1; }

// Shared memory: q [hd] floats; the warps' states acc [kWarps][hd] and (m, l) [kWarps][2] floats,
// and their chunks' weights p [kWarps][kChunk] floats; with the row's RoPE (DecodeRope), its
// angles [hd] floats, the q and k heads as read and their norms' weights [4][hd] floats, the
// first page's mask window [2 * kPageCells] floats, and the new cell's K and V rows [2][hd] halves;
// per warp and stage, K [32][hd + kKPad] (unless each lane holds its K row in registers) and V
// [32][hd] halves.
inline size_t staged_smem_bytes(int hd, int stages, bool reg_k, bool rope) {
    const size_t floats = static_cast<size_t>(hd) + static_cast<size_t>(kWarps) * hd + 2 * kWarps + kWarps * kChunk +
                          (rope ? 5 * hd + 2 * kPageCells : 0);
    const size_t stage = static_cast<size_t>(kChunk) * (reg_k ? hd : 2 * hd + kKPad) * sizeof(uint16_t);
    return floats * sizeof(float) + (rope ? 2 * static_cast<size_t>(hd) * sizeof(uint16_t) : 0) +
           static_cast<size_t>(kWarps) * stages * stage;
}

// The NC halves at p (4- or 8-byte aligned) as floats.
template <int NC>
__device__ __forceinline__ void load_halves(const uint16_t* p, float (&v)[NC]) {
    static_assert(NC == 2 || NC == 4, "a lane's dims: 2 or 4 halves");
    if constexpr (NC == 4) {
        const uint2 raw = *reinterpret_cast<const uint2*>(p);
        const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
        const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
        v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
    } else {
        const uint32_t raw = *reinterpret_cast<const uint32_t*>(p);
        const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&raw));
        v[0] = a.x, v[1] = a.y;
    }
}

// Scores and folds warp's chunk ch (staged in sk / sv) from the empty state into (m, l, acc).
// k_unit(d0): the 16 bytes of this lane's K row at head dim d0 (from shared memory or registers).
// acc[c] is head dim NC * lane + c (the lane's NC consecutive dims: one 4- or 8-byte load a V row);
// s_p: the warp's kChunk floats of shared memory, where the cells' weights are passed.
// kKStaged: K comes from shared memory (k_unit loads it), so the full head's dot may issue its
// loads ahead; with K in registers (kRegK) that lookahead pushed the 128-register variant to spill.
template <int NC, bool kKStaged, typename KUnit>
__device__ __forceinline__ void fold_staged_chunk(KUnit k_unit, const uint16_t* sv, const float* s_q, float* s_p,
                                                  int hd, int lane, bool in_span, float mj, float scale, float& m,
                                                  float& l, float (&acc)[NC]) {
    float s = -INFINITY;
    if (in_span && mj != -INFINITY) {
        float dot = 0.0f;
        // The chain runs d = 0 .. hd-1 as everywhere, 8 dims (one 16-byte K unit) at a time.
        const auto dot_unit = [&](int d0) {
            const uint4 raw = k_unit(d0);
            const uint16_t* hv = reinterpret_cast<const uint16_t*>(&raw);
#pragma unroll
            for (int e = 0; e < 8; ++e) dot = fmaf(s_q[d0 + e], h2f(hv[e]), dot);
        };
        if (kKStaged && hd == 32 * NC) {
            // The instantiation's widest head (Qwen3's 128, SmolLM2's 64): no bound to test, so
            // ptxas issues the units' shared-memory loads ahead of the chain. With the test below
            // each unit's loads sat behind its branch (sm_90a SASS: LDS, then the unit's 8 FFMA
            // waiting for it, 16 times in a row). The same chain: the same bits.
#pragma unroll
            for (int d0 = 0; d0 < 32 * NC; d0 += 8) dot_unit(d0);
        } else {
            // Bounded by the widest head so the loop unrolls. (The counts here and for the V rows
            // are written out: with a bare `#pragma unroll` ptxas spilled 8 bytes in the split rope
            // variant, <4, 1, true, true>, at its 128-register bound.)
#pragma unroll(4 * NC)
            for (int d0 = 0; d0 < 32 * NC; d0 += 8) {
                if (d0 >= hd) break;
                dot_unit(d0);
            }
        }
        s = fmaf(dot, scale, mj);
    }
    PHASE_STAMP(5, s);
    float p, corr;
    if (!fold_chunk(s, m, l, p, corr)) return;  // nothing unmasked in the chunk (warp-uniform)
    PHASE_STAMP(6, p);
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[c] *= corr;
    // V rows in cell order. A row with p = 0 adds nothing (a select, not a branch, so the unrolled
    // loop can issue its loads ahead; its value may be anything). The weights come four at a time
    // from shared memory, and each row's NC values in one load: with a shuffle and NC 2-byte loads
    // a row, this loop took ~2.4 us of a Qwen3-4B decode launch's ~10 (H200, globaltimer stamps).
    // Each dim's chain is the same fmaf sequence either way: the same bits.
    s_p[lane] = p;
    __syncwarp();
    if (NC * lane < hd) {
        const uint16_t* vr = sv + NC * lane;
#pragma unroll(kChunk / 4)
        for (int i0 = 0; i0 < kChunk; i0 += 4) {
            const float4 p4 = *reinterpret_cast<const float4*>(s_p + i0);
            const float pv[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v[NC];
                load_halves<NC>(vr + (i0 + e) * hd, v);
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    const float t = fmaf(pv[e], v[c], acc[c]);
                    acc[c] = pv[e] != 0.0f ? t : acc[c];
                }
            }
        }
    }
    PHASE_STAMP(7, acc[0]);
}

// kRope's prologue, after the PDL wait (the angles in s_cs, or read here from the step's table):
// this block's q head rotated into s_q, and its kv head's new K row (rotated) and V row, as F16,
// into s_new ([K: hd][V: hd]), every value as the RoPE kernel and SET_ROWS compute it. Block z = 0
// of each q head also writes what the ROPE of q writes for it, and block z = 0 of each kv head's
// first q head what the ROPE of k and the two SET_ROWS write for that kv head. Returns the new
// cell, or -1 when it lies outside the cache (the error bit is set and nothing is stored, as
// SET_ROWS does).
// With rope.early every global value it reads (q's and k's heads, the norms' weights, the V row)
// is requested in one round, into s_x ([q | k | q weights | k weights], hd floats each) and s_new:
// one L2 round trip on the launch's critical path instead of three (the norms' reads, the
// rotation's, V's). The norms then read their inputs from shared memory in the same order, so the
// bits are the same.
// Where rope_prologue reads and writes: plain arithmetic on the launch's parameters (two integer
// divisions among it), so the kernel works it out before its PDL wait, off the critical path.
struct RopeRows {
    const float *xq, *xk, *xv;  // q's head, k's head and the V row as the RoPE reads them
    float *yq, *yk;             // the ROPEs' outputs (written by the writer blocks)
    uint16_t *ck, *cv;          // the new cell's cache rows (null unless this block writes them)
    bool cell_ok, q_writer, kv_writer;
};
__device__ __forceinline__ RopeRows rope_rows(const DecodeRope& rope, const TDesc& q, const TDesc& kc,
                                              const TDesc& vc, int n_kv_head, int64_t cell) {
    const int hd = static_cast<int>(q.ne[0]), h = blockIdx.x;
    const int group = static_cast<int>(q.ne[1]) / n_kv_head, kvh = h / group;
    RopeRows w;
    w.cell_ok = cell >= 0 && cell < kc.ne[1];
    w.q_writer = blockIdx.z == 0;
    w.kv_writer = w.q_writer && h % group == 0;
    w.xq = reinterpret_cast<const float*>(rope.q_src.data + h * rope.q_src.nb[1]);
    w.yq = reinterpret_cast<float*>(rope.q_dst.data + h * rope.q_dst.nb[1]);
    w.xk = reinterpret_cast<const float*>(rope.k_src.data + kvh * rope.k_src.nb[1]);
    w.yk = reinterpret_cast<float*>(rope.k_dst.data + kvh * rope.k_dst.nb[1]);
    w.xv = reinterpret_cast<const float*>(rope.v_src.data) + static_cast<int64_t>(kvh) * hd;
    const bool writes = w.kv_writer && w.cell_ok;
    w.ck = writes ? reinterpret_cast<uint16_t*>(kc.data + cell * kc.nb[1]) + kvh * hd : nullptr;
    w.cv = writes ? reinterpret_cast<uint16_t*>(vc.data + cell * vc.nb[1]) + kvh * hd : nullptr;
    return w;
}

__device__ __forceinline__ int64_t rope_prologue(const DecodeRope& rope, const RopeRows& rows, int hd, int64_t cell,
                                                 float* s_cs, float* s_x, float* s_q, uint16_t* s_new,
                                                 unsigned* err) {
    const int half = rope.n_rot / 2;
    const bool cell_ok = rows.cell_ok, q_writer = rows.q_writer, kv_writer = rows.kv_writer;
    const float *xq = rows.xq, *xk = rows.xk, *xv = rows.xv;
    float *yq = rows.yq, *yk = rows.yk;
    uint16_t *ck = rows.ck, *cv = rows.cv;
    const auto store_v = [&](int d) {
        const uint16_t v = f2h(xv[d]);
        s_new[hd + d] = v;
        if (cv) cv[d] = v;
    };
    const bool one_round = rope.early;
    // With rope.angles_stored the angles come from the step's first launch, in this same round.
    const bool read_angles = rope.angles_stored;
    if (one_round) {
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            if (read_angles && d < rope.n_rot) s_cs[d] = rope.angles[d];
            s_x[d] = xq[d];
            s_x[hd + d] = xk[d];
            if (rope.q_norm) {
                s_x[2 * hd + d] = rope.q_norm[d];
                s_x[3 * hd + d] = rope.k_norm[d];
            }
            store_v(d);
        }
        __syncthreads();  // the heads as read
    } else if (read_angles) {
        for (int d = threadIdx.x; d < rope.n_rot; d += blockDim.x) s_cs[d] = rope.angles[d];
    }
    // The q/k norms' scales (warp 0: q's head, warp 1: k's), with the norm kernel's reduction, from
    // shared memory (one round) or, as before, from global memory: the same values in the same
    // order. (Each read below names its memory, so neither path takes generic loads.)
    __shared__ float s_scale[2];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (rope.q_norm && warp < 2) {
        const float sc = one_round ? warp_rms_scale(s_x + warp * hd, hd, lane, rope.norm_eps)
                                   : warp_rms_scale(warp == 0 ? xq : xk, hd, lane, rope.norm_eps);
        if (lane == 0) s_scale[warp] = sc;
    }
    __syncthreads();  // the angles and the scales
    // The step's first launch stores its angles for the others (after its PDL wait: every launch
    // that read the table before has completed).
    if (rope.angles && !read_angles && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        for (int d = threadIdx.x; d < rope.n_rot; d += blockDim.x) rope.angles[d] = s_cs[d];
    }
    // Element i of q's / k's head as the ROPE reads it: the norm's output, x * scale * w.
    const auto qv = [&](int i) {
        const float x = one_round ? s_x[i] : xq[i];
        return rope.q_norm ? x * s_scale[0] * (one_round ? s_x[2 * hd + i] : rope.q_norm[i]) : x;
    };
    const auto kv = [&](int i) {
        const float x = one_round ? s_x[hd + i] : xk[i];
        return rope.k_norm ? x * s_scale[1] * (one_round ? s_x[3 * hd + i] : rope.k_norm[i]) : x;
    };
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        int i0, i1;
        rope_pair(i, half, rope.neox != 0, i0, i1);
        const float cs = s_cs[i], sn = s_cs[half + i];
        float y0, y1;
        rope_rotate(qv(i0), qv(i1), cs, sn, y0, y1);
        s_q[i0] = y0;
        s_q[i1] = y1;
        if (q_writer) {
            yq[i0] = y0;
            yq[i1] = y1;
        }
        rope_rotate(kv(i0), kv(i1), cs, sn, y0, y1);
        const uint16_t h0 = f2h(y0), h1 = f2h(y1);
        s_new[i0] = h0;
        s_new[i1] = h1;
        if (kv_writer) {
            yk[i0] = y0;
            yk[i1] = y1;
        }
        if (ck) {
            ck[i0] = h0;
            ck[i1] = h1;
        }
    }
    for (int i = rope.n_rot + threadIdx.x; i < hd; i += blockDim.x) {  // the unrotated tail
        const float a = qv(i), b = kv(i);
        const uint16_t hb = f2h(b);
        s_q[i] = a;
        if (q_writer) yq[i] = a;
        s_new[i] = hb;
        if (kv_writer) yk[i] = b;
        if (ck) ck[i] = hb;
    }
    if (!one_round) {
        for (int d = threadIdx.x; d < hd; d += blockDim.x) store_v(d);
    }
    if (kv_writer && !cell_ok && threadIdx.x == 0) atomicOr(err, kErrSetRowsId);
    return cell_ok ? cell : -1;
}

// Grid (n_head, rows, Z). Z = 1: the block walks the row's pages in order. Z > 1 (one row): block z
// takes the row's page z alone and stores its state in part ([n_head][Z][2 + hd] floats: m, l,
// acc); the row's last block to finish (counters[h], left zero again) combines the pages in order.
// kRegK (the split instantiation for wide heads): each lane loads its cell's K row straight into
// registers and only V is staged, which halves the shared memory so two blocks share an SM.
// Blocks per SM: the staged variants are held to one by their shared memory (~135-140 KB), the
// register-K split variant is sized for two. Without the minimum, CUDA 13's ptxas held the staged
// variants to 64 registers and spilled (sm_90a, -Xptxas -v: <4,1,0> and <2,2,0> 64 registers, 12
// and 8 bytes of spill stores; ncu counted 896 spill requests in a Qwen3-4B decode launch); with it,
// 87-92 registers and no spills. The arithmetic and its order are the same either way.
// H200 (2026-12-01, two alternating rounds, tg128): SmolLM2 1,376 / 1,314 -> 1,392 / 1,379 t/s,
// Qwen3-4B 331 / 328 -> 330 / 330; the CUDA tests pass either way.
// The chunk of kChunk cells a warp copies first (in its block's first page) and whether it lies
// in the row's span: the L2 prefetch and the early mask read work on it before the PDL wait.
struct FirstChunk {
    int64_t b0, span, ch;
    bool in_span;
};
__device__ inline FirstChunk first_chunk(const int32_t* base, const TDesc& mask, int warp) {
    FirstChunk f;
    f.b0 = base[blockIdx.y];
    f.span = mask.ne[0];
    const int64_t c_first = f.b0 / kChunk, c_last = (f.b0 + f.span - 1) / kChunk;
    f.ch = (c_first / kWarps + blockIdx.z) * kWarps + warp;
    f.in_span = f.span > 0 && f.b0 >= 0 && f.ch >= c_first && f.ch <= c_last;
    return f;
}

// kRope (a decode row's DecodeRope, one row): the block computes its q head, and the new cell's K
// and V rows of its kv head, from the RoPE's inputs (rope_prologue), and stages those in place of
// the cell's cache row, which this launch itself writes.
template <int NC, int S, bool kRegK, bool kRope>
__global__ void __launch_bounds__(kWarps * 32, kRegK ? 2 : 1)
    k_attention_staged(TDesc dst, TDesc q, TDesc kc, TDesc vc, TDesc mask, const int32_t* base, int n_kv_head,
                       float scale, float* part, unsigned* counters, unsigned* err, bool prefetch,
                       const __grid_constant__ DecodeRope rope) {
    // Before the PDL wait (cuda/launch.cuh): L2 prefetch of this warp's first chunk of K and V
    // rows, one cell a lane, so their DRAM latency overlaps the kernel before. The rows are read
    // from the cache only after the wait (the previous kernel may be writing the newest one); a
    // prefetch is a hint that changes no value. base holds host-written positions.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    PHASE_STAMP(0, 0);  // the diagnostic build's timeline (cuda/phase_stamps.cuh): 0 the block's start
    // Not where the first page's copies of K and V go out before the wait themselves (kRope's
    // early_copies, K staged): there the prefetch's round trip for base, ahead of every other
    // read, only delayed them (H200 tg128, Qwen3-4B: part of 409 -> 415 t/s). With K in
    // registers (kRegK, read after the wait) the prefetch still brings its first rows.
    if (prefetch && !(kRope && rope.early_copies && !kRegK)) {
        const FirstChunk f = first_chunk(base, mask, warp);
        const int64_t cell = f.ch * kChunk + lane;
        if (f.in_span && cell < kc.ne[1]) {
            const int kvh = static_cast<int>(blockIdx.x) / (static_cast<int>(q.ne[1]) / n_kv_head);
            const int64_t col_bytes = static_cast<int64_t>(kvh) * q.ne[0] * 2;
            asm volatile("prefetch.global.L2 [%0];" ::"l"(kc.data + cell * kc.nb[1] + col_bytes));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(vc.data + cell * vc.nb[1] + col_bytes));
        }
    }
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ bool s_last;
    const int hd = static_cast<int>(q.ne[0]);
    float* s_q = reinterpret_cast<float*>(smem);
    float* s_acc = s_q + hd;                      // [kWarps][hd]
    float* s_ml = s_acc + kWarps * hd;            // [kWarps][2]
    float* s_p = s_ml + 2 * kWarps;               // [kWarps][kChunk]: the chunks' weights
    float* s_cs = s_p + kWarps * kChunk;          // kRope: the angles [hd]
    float* s_x = s_cs + (kRope ? hd : 0);         // kRope: the heads and weights as read [4][hd]
    float* s_mwin = s_x + (kRope ? 4 * hd : 0);   // kRope: the first page's mask window [2 * kPageCells]
    uint16_t* s_new = reinterpret_cast<uint16_t*>(s_mwin + (kRope ? 2 * kPageCells : 0));  // kRope: the new K, V rows
    int64_t new_cell = -1;  // kRope: the cache row this launch writes, staged from s_new instead
    // kRope with rope.early: this lane's mask value in the block's first page (-inf outside the
    // span) and the warp's cells there that are not masked, read before the wait.
    float mj_first = -INFINITY;
    uint32_t live_first = ~0u;  // the rows of the first page's chunk worth staging (all: unknown)
    [[maybe_unused]] RopeRows rows{};  // kRope: where the prologue reads and writes
    if constexpr (kRope) {
        // Graph leaves (launch_attention_rope's caller checks), so read before the PDL wait: the
        // double-precision angles overlap the kernel before (where no earlier launch of the step
        // stored them: rope.angles_stored).
        new_cell = rope.cells[0];
        if (!rope.angles_stored) {
            rope_angles(rope.pos[0], rope.factors, rope.n_rot, rope.base, rope.fscale, s_cs, threadIdx.x, blockDim.x);
        }
        if (rope.early) {
            // The mask row too: a decode step's mask covers a whole page span (256 cells a graph)
            // while the row sees fewer, so the masked rows are not copied at all (a masked cell's
            // K is never read and its V is weighted by a p of 0, dropped by a select). The mask
            // indices of block z's first page lie in (256 z - 256, 256 z + 256) whatever the base
            // (the page starts at most 255 cells before it), so that window is read together with
            // the base instead of after it: one round trip before the copies go out, not two.
            const int64_t w0 = static_cast<int64_t>(blockIdx.z) * kPageCells - kPageCells;
            const float* mrow = reinterpret_cast<const float*>(mask.data + blockIdx.y * mask.nb[1]);
            // Each thread's values asked for together (the block is kWarps * 32 threads, so the
            // count is known): a loop strided by blockDim.x loaded one value an iteration, two
            // round trips in a row on the path that decides the early copies.
            constexpr int kBlock = kWarps * 32, kPerThread = 2 * kPageCells / kBlock;
            static_assert(2 * kPageCells % kBlock == 0, "the window splits evenly over the block");
            float mv[kPerThread];
#pragma unroll
            for (int u = 0; u < kPerThread; ++u) {
                const int64_t jj = w0 + threadIdx.x + u * kBlock;
                mv[u] = jj >= 0 && jj < mask.ne[0] ? mrow[jj] : -INFINITY;
            }
#pragma unroll
            for (int u = 0; u < kPerThread; ++u) s_mwin[threadIdx.x + u * kBlock] = mv[u];
            const FirstChunk f = first_chunk(base, mask, warp);
            const int64_t j = f.ch * kChunk + lane - f.b0;
            const bool in_span = f.in_span && j >= 0 && j < f.span;
            __syncthreads();  // the window
            if (in_span) mj_first = s_mwin[j - w0];
            live_first = __ballot_sync(0xffffffffu, mj_first != -INFINITY);
        }
        rows = rope_rows(rope, q, kc, vc, n_kv_head, new_cell);
    }
    // kRope with rope.early_copies: the first page's copies go out before the wait too (below).
    const bool copy_early = kRope && rope.early_copies;
    const bool let_in_first = kRope && rope.let_next_in_first;
    if (let_in_first) pdl_let_next_in();
    const auto enter = [&] {
        PHASE_STAMP(1, live_first);  // what comes before the wait done
        if (let_in_first) {
            pdl_wait();
        } else {
            pdl_enter();
        }
        PHASE_STAMP(2, 0);
    };
    if (!copy_early) enter();
    // kRope: every block runs the prologue (it stores the new rows), here or after its first copies.
    const auto prologue = [&] {
        if constexpr (kRope) new_cell = rope_prologue(rope, rows, hd, new_cell, s_cs, s_x, s_q, s_new, err);
    };
    const int h = blockIdx.x;
    const int64_t r = blockIdx.y;
    const bool split = gridDim.z > 1;
    const int kvh = h / (static_cast<int>(q.ne[1]) / n_kv_head);
    const int64_t span = mask.ne[0];
    const int64_t n_cells = kc.ne[1];
    const int64_t b0 = base[r];
    float* o = reinterpret_cast<float*>(dst.data + h * dst.nb[1] + r * dst.nb[2]);
    const int64_t c_first = span > 0 ? b0 / kChunk : 0;
    const int64_t c_last = span > 0 ? (b0 + span - 1) / kChunk : -1;
    const int64_t g_first = c_first / kWarps, g_last = c_last >= 0 ? c_last / kWarps : -1;
    const bool bad = b0 < 0 || b0 + span > n_cells;
    if (bad || (split && g_last < 0)) {  // (a split row has cells: splits())
        if (copy_early) enter();
        prologue();
        if (blockIdx.z == 0) {
            if (bad && threadIdx.x == 0) atomicOr(err, kErrAttentionSpan);
            for (int d = threadIdx.x; d < hd; d += blockDim.x) o[d] = 0.0f;
        }
        PHASE_REPORT("attention_staged", kPhaseSlots);
        return;
    }
    int64_t g = g_first + blockIdx.z;
    const int64_t g_end = split ? g : g_last;  // the block's last page (none: an empty row's zeros)
    if (split && g > g_last) {                 // past the row's pages
        if (copy_early) enter();
        prologue();
        PHASE_REPORT("attention_staged", kPhaseSlots);
        return;
    }

    const int ks = kRegK ? 0 : hd + kKPad;  // staged K row pitch (none with K in registers)
    uint16_t* s_stage = s_new + (kRope ? 2 * hd : 0) + static_cast<size_t>(warp) * S * kChunk * (ks + hd);
    const int64_t col_bytes = static_cast<int64_t>(kvh) * hd * 2;  // the kv head's columns of a cache row
    const int units = hd / 8;                                       // 16-byte units per row
    // A chunk's copies: unit u = lane + 32 k of its kChunk x units, row-major, is row u / units,
    // column u % units. Where units divides 32 (head dims 8 to 256, powers of two) a lane keeps one column
    // and steps over rows, so its loop only adds; the division by the runtime units in every
    // iteration (~90 instructions of sm_90a SASS each, 16 iterations a warp for Qwen3's heads) took
    // most of the ~3.7 us between a block's start and its PDL wait (H200 globaltimer stamps). Other
    // head dims keep that loop. Each lane copies the same units either way.
    const bool lane_column_fixed = 32 % units == 0;
    const int row0 = lane_column_fixed ? lane / units : 0, col0 = lane_column_fixed ? lane % units : 0;
    const int row_step = lane_column_fixed ? 32 / units : 0;

    // This warp's chunk of page gg, staged into stage st when the row has it. Only the rows whose
    // bit in live is set (the others are masked), that lie inside the cache and are not the new
    // cell (staged from s_new after the wait) are copied; the others' slots keep whatever they
    // held, as nothing reads them: a lane scores only an unmasked cell of the row's span, and a
    // V row of weight 0 is dropped by a select. One group is committed either way, so the wait
    // counts stay uniform.
    auto stage_page = [&](int64_t gg, int st, uint32_t live) {
        const int64_t ch = gg * kWarps + warp;
        if (gg <= g_end && ch >= c_first && ch <= c_last) {
            uint16_t* sk = s_stage + static_cast<size_t>(st) * kChunk * (ks + hd);
            uint16_t* sv = sk + kChunk * ks;
            const int64_t cell0 = ch * kChunk;
            uint32_t rows = live;
            if (n_cells - cell0 < kChunk) rows &= n_cells <= cell0 ? 0u : (1u << (n_cells - cell0)) - 1u;
            if (new_cell >= cell0 && new_cell < cell0 + kChunk) rows &= ~(1u << (new_cell - cell0));
            if (lane_column_fixed) {
                const char* kp = kc.data + (cell0 + row0) * kc.nb[1] + col_bytes + col0 * 16;
                const char* vp = vc.data + (cell0 + row0) * vc.nb[1] + col_bytes + col0 * 16;
                const int64_t k_step = row_step * kc.nb[1], v_step = row_step * vc.nb[1];
                uint16_t* skp = sk + row0 * ks + col0 * 8;
                uint16_t* svp = sv + row0 * hd + col0 * 8;
                for (int i = row0; i < kChunk; i += row_step) {
                    if ((rows >> i) & 1u) {
                        if (!kRegK) cp_async<16>(skp, kp, true);
                        cp_async<16>(svp, vp, true);
                    }
                    kp += k_step;
                    vp += v_step;
                    skp += row_step * ks;
                    svp += row_step * hd;
                }
            } else {
                for (int u = lane; u < kChunk * units; u += 32) {
                    const int i = u / units, col = u % units;
                    if (!((rows >> i) & 1u)) continue;
                    const int64_t cell = cell0 + i;
                    if (!kRegK) cp_async<16>(sk + i * ks + col * 8, kc.data + cell * kc.nb[1] + col_bytes + col * 16, true);
                    cp_async<16>(sv + i * hd + col * 8, vc.data + cell * vc.nb[1] + col_bytes + col * 16, true);
                }
            }
        }
        cp_async_commit();
    };

    const int64_t g_start = g;
    stage_page(g, 0, live_first);  // in flight while q arrives (or is rotated: the new cell is left out of it)
    // With early copies they went out before the wait: the cells are ones no node of the graph
    // but this launch writes (DecodeRope::early_copies), and the new one is left out.
    if (copy_early) enter();
    if constexpr (kRope) {
        prologue();
    } else {
        const float* qr = reinterpret_cast<const float*>(q.data + h * q.nb[1] + r * q.nb[2]);
        for (int d = threadIdx.x; d < hd; d += blockDim.x) s_q[d] = qr[d];
    }
    __syncthreads();
    PHASE_STAMP(3, s_q[0]);  // the prologue done
    const float* mrow = reinterpret_cast<const float*>(mask.data + r * mask.nb[1]);

    // The row's running state (pages combined in order): thread d holds element d (hd <= 256).
    float acc_row = 0.0f, m_row = -INFINITY, l_row = 0.0f;
    for (int st = 0; g <= g_end; ++g, st = (st + 1) % S) {
        const int64_t ch = g * kWarps + warp;
        const bool active = ch >= c_first && ch <= c_last;
        const int64_t j = ch * kChunk + lane - b0;
        const bool in_span = active && j >= 0 && j < span;
        const float mj = kRope && rope.early && g == g_start ? mj_first : in_span ? mrow[j] : -INFINITY;
        uint4 kreg[kRegK ? 4 * NC : 1];  // kRegK: this lane's K row, loaded while V is copied
        if constexpr (kRegK) {
            if (in_span) {
                const int64_t cell = ch * kChunk + lane;
                const uint4* krow = reinterpret_cast<const uint4*>(
                    cell == new_cell ? reinterpret_cast<const char*>(s_new) : kc.data + cell * kc.nb[1] + col_bytes);
#pragma unroll
                for (int u = 0; u < 4 * NC; ++u) {
                    if (u < units) kreg[u] = krow[u];
                }
            }
        }
        if (S == 2) {
            stage_page(g + 1, st ^ 1, ~0u);  // the other stage, read by the previous page (synchronised)
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncwarp();
        // The chunk's copies landed (then 5-7 in fold_staged_chunk): tied to a value the copies
        // wrote, as the timer read alone may be scheduled ahead of the wait for them.
        PHASE_STAMP(4, s_stage[static_cast<size_t>(st) * kChunk * (ks + hd) + kChunk * ks + lane]);
        if constexpr (kRope) {
            // The new cell's rows into its slot (its copy was left out), by the warp that reads them.
            const int64_t i = new_cell - ch * kChunk;
            if (active && new_cell >= 0 && i >= 0 && i < kChunk) {
                // 16 bytes a lane (one round for heads up to 256): rows, s_new and the stage are
                // 16-byte aligned (staged_smem_bytes' layout, hd a multiple of 8). Element by
                // element it was a chain of dependent loads and stores behind a branch each, on
                // the warp every other waits for at the page's merge.
                uint16_t* sk = s_stage + static_cast<size_t>(st) * kChunk * (ks + hd);
                for (int d = 8 * lane; d < hd; d += 8 * 32) {
                    const uint4 kn = *reinterpret_cast<const uint4*>(s_new + d);
                    const uint4 vn = *reinterpret_cast<const uint4*>(s_new + hd + d);
                    if (!kRegK) *reinterpret_cast<uint4*>(sk + i * ks + d) = kn;
                    *reinterpret_cast<uint4*>(sk + kChunk * ks + i * hd + d) = vn;
                }
                __syncwarp();
            }
        }
        float acc[NC];
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[c] = 0.0f;
        float m = -INFINITY, l = 0.0f;
        if (active) {
            const uint16_t* sk = s_stage + static_cast<size_t>(st) * kChunk * (ks + hd);
            const uint16_t* kr = sk + lane * ks;
            float* sp = s_p + warp * kChunk;
            if constexpr (kRegK) {
                fold_staged_chunk<NC, false>([&](int d0) { return kreg[d0 / 8]; }, sk + kChunk * ks, s_q, sp, hd, lane,
                                      in_span, mj, scale, m, l, acc);
            } else {
                fold_staged_chunk<NC, true>([&](int d0) { return *reinterpret_cast<const uint4*>(kr + d0); },
                                      sk + kChunk * ks, s_q, sp, hd, lane, in_span, mj, scale, m, l, acc);
            }
        }
        __syncwarp();  // every lane is done with this stage before it is refilled
        if (S == 1) stage_page(g + 1, 0, ~0u);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const int d = NC * lane + c;
            if (d < hd) s_acc[warp * hd + d] = acc[c];
        }
        if (lane == 0) {
            s_ml[2 * warp] = m;
            s_ml[2 * warp + 1] = l;
        }
        __syncthreads();
        const PageWeights pw = page_weights([&](int w) { return s_ml[2 * w]; }, [&](int w) { return s_ml[2 * w + 1]; });
        const auto acc_of = [&](int w, int d) { return s_acc[w * hd + d]; };
        if (split) {  // the block's one page: its state goes to the scratch
            float* slot = part + (static_cast<size_t>(h) * gridDim.z + blockIdx.z) * (2 + hd);
            if (threadIdx.x == 0) {
                slot[0] = pw.m;
                slot[1] = pw.l;
            }
            if (threadIdx.x < hd) slot[2 + threadIdx.x] = page_acc(pw, threadIdx.x, acc_of);
        } else if (g_first == g_last) {
            // The row's only page: combining it into the empty row state would give exactly its
            // accumulator (never -0: page_acc starts from +0) and l; skip that and a barrier.
            if (threadIdx.x < hd) {
                const float out = page_acc(pw, threadIdx.x, acc_of) * row_scale(pw.l);
                o[threadIdx.x] = out;
                PHASE_STAMP(8, out);  // the output stored
            }
            cp_async_wait<0>();
            PHASE_REPORT("attention_staged", kPhaseSlots);
            return;
        } else {
            float fa, fb;
            if (combine_page(m_row, l_row, pw.m, pw.l, fa, fb) && threadIdx.x < hd) {
                acc_row = combine_acc(acc_row, page_acc(pw, threadIdx.x, acc_of), fa, fb);
            }
        }
        __syncthreads();  // the page's states are read before the next page's replace them
    }
    cp_async_wait<0>();  // no copy may land after the block has moved on
    if (split) {
        // The last of the row's blocks to store its page combines them all, in page order. The
        // fence makes this block's page visible before its count; the last block reads the
        // others' through L2 (ld.cg) after seeing every count.
        __threadfence();
        __syncthreads();
        const unsigned n_pages = static_cast<unsigned>(g_last - g_first + 1);
        if (threadIdx.x == 0) s_last = atomicAdd(&counters[h], 1u) == n_pages - 1;
        __syncthreads();
        if (!s_last) {
            PHASE_REPORT("attention_staged", kPhaseSlots);
            return;
        }
        __threadfence();
        for (unsigned z = 0; z < n_pages; ++z) {
            const float* slot = part + (static_cast<size_t>(h) * gridDim.z + z) * (2 + hd);
            float fa, fb;
            if (combine_page(m_row, l_row, __ldcg(slot), __ldcg(slot + 1), fa, fb) && threadIdx.x < hd) {
                acc_row = combine_acc(acc_row, __ldcg(slot + 2 + threadIdx.x), fa, fb);
            }
        }
        if (threadIdx.x == 0) counters[h] = 0;  // zero again for the next launch
    }
    if (threadIdx.x < hd) {
        const float out = acc_row * row_scale(l_row);
        o[threadIdx.x] = out;
        PHASE_STAMP(8, out);
    }
    PHASE_REPORT("attention_staged", kPhaseSlots);
}

// Pages a row of span cells can touch (it need not start at a page boundary).
inline int64_t pages_touched_max(int64_t span) { return span > 0 ? (span + kPageCells - 1) / kPageCells + 1 : 1; }

// One row over more than two pages splits (a page per block); two are walked by one block as fast.
inline bool splits(int64_t rows, int64_t span) { return rows == 1 && pages_touched_max(span) > 2; }

template <int NC, int S, bool kRegK, bool kRope>
void launch_nc(const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v, const TDesc& mask,
               const int32_t* base, int n_kv_head, float scale, unsigned z, float* part, unsigned* counters,
               unsigned* err, const DecodeRope& rope, cudaStream_t s) {
    // Above 48 KiB a kernel must ask for its dynamic shared memory; the most it uses is the
    // largest head dim of this instantiation.
    static std::once_flag once;
    std::call_once(once, [] {
        PHASE_CONFIGURE("ATT");
        check(cudaFuncSetAttribute(k_attention_staged<NC, S, kRegK, kRope>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(staged_smem_bytes(32 * NC, S, kRegK, kRope))),
              "attention (staged): cudaFuncSetAttribute");
    });
    const dim3 grid(static_cast<unsigned>(q.ne[1]), static_cast<unsigned>(q.ne[2]), z);
    launch(k_attention_staged<NC, S, kRegK, kRope>, grid, kWarps * 32,
           staged_smem_bytes(static_cast<int>(q.ne[0]), S, kRegK, kRope), s, dst, q, k, v, mask, base, n_kv_head,
           scale, part, counters, err, prefetch_enabled(), rope);
}

template <int NC, bool kRope>
void launch_split_or_walk(const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v, const TDesc& mask,
                          const int32_t* base, int n_kv_head, float scale, const SplitScratch& scratch, unsigned* err,
                          const DecodeRope& rope, cudaStream_t s) {
    const SplitScratchNeed need = attention_split_scratch(q.ne[0], q.ne[1], q.ne[2], mask.ne[0]);
    if (need.partial_floats > 0 && need.partial_floats <= scratch.partial_floats &&
        need.n_counters <= scratch.n_counters) {
        // K in registers where staging it would leave one block per SM (head_dim 128: 137 KB of
        // shared memory; H200, ncu, Qwen3-4B at 4000 cells 43 -> 37 us per layer); SmolLM2's
        // 64-wide heads fit three staged blocks per SM and were slower from registers (17 -> 18).
        launch_nc<NC, 1, (NC > 2), kRope>(dst, q, k, v, mask, base, n_kv_head, scale,
                                          static_cast<unsigned>(pages_touched_max(mask.ne[0])), scratch.partial,
                                          scratch.counters, err, rope, s);
    } else {
        launch_nc<NC, stages_for(NC), false, kRope>(dst, q, k, v, mask, base, n_kv_head, scale, 1, nullptr, nullptr,
                                                    err, rope, s);
    }
}

}  // namespace

bool attention_staged_enabled() { return env_switch("PYSPEC_CUDA_ATT_STAGED") != 0; }

bool attention_staged_supports(const TDesc& q, const TDesc& k, const TDesc& v) {
    const int64_t hd = q.ne[0];
    return k.dtype == DType::F16 && v.dtype == DType::F16 && hd % 8 == 0 && hd <= 128 && k.nb[0] == 2 &&
           v.nb[0] == 2 && k.nb[1] % 16 == 0 && v.nb[1] % 16 == 0 &&
           reinterpret_cast<uintptr_t>(k.data) % 16 == 0 && reinterpret_cast<uintptr_t>(v.data) % 16 == 0 &&
           k.ne[1] == v.ne[1];
}

SplitScratchNeed attention_split_scratch(int64_t hd, int64_t n_head, int64_t rows, int64_t span) {
    SplitScratchNeed need;
    if (!splits(rows, span)) return need;
    need.partial_floats = static_cast<size_t>(n_head) * static_cast<size_t>(pages_touched_max(span)) * (2 + hd);
    need.n_counters = static_cast<size_t>(n_head);
    return need;
}

void launch_attention_staged(const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v, const TDesc& mask,
                             const int32_t* base, int n_kv_head, float scale, const SplitScratch& scratch,
                             unsigned* err, cudaStream_t s) {
    if (!attention_staged_supports(q, k, v)) throw std::logic_error("attention (staged): unsupported layout");
    if (mask.ne[0] / kPageCells + 2 > 65535) throw std::runtime_error("cuda backend: attention: span too long");
    const DecodeRope none{};
    if (q.ne[0] <= 64) {
        launch_split_or_walk<2, false>(dst, q, k, v, mask, base, n_kv_head, scale, scratch, err, none, s);
    } else {
        launch_split_or_walk<4, false>(dst, q, k, v, mask, base, n_kv_head, scale, scratch, err, none, s);
    }
}

bool attention_rope_enabled() { return env_switch("PYSPEC_CUDA_ATT_ROPE") != 0; }

bool attention_angles_enabled() { return env_switch("PYSPEC_CUDA_ATT_ANGLES") != 0; }

int attention_rope_setting() {
    return (env_switch("PYSPEC_CUDA_ATT_EARLY") != 0 ? 1 : 0) |
           (env_switch("PYSPEC_CUDA_ATT_EARLY_COPY") != 0 ? 2 : 0) |
           (env_switch("PYSPEC_CUDA_ATT_LET_IN_FIRST") != 0 ? 4 : 0) | (attention_angles_enabled() ? 8 : 0);
}

bool launch_attention_rope(const TDesc& dst, const TDesc& k, const TDesc& v, const TDesc& mask, const int32_t* base,
                           int n_kv_head, float scale, const DecodeRope& rope, const SplitScratch& scratch,
                           unsigned* err, cudaStream_t s) {
    const TDesc& q = rope.q_dst;
    const int64_t hd = q.ne[0];
    const auto f32_heads = [hd](const TDesc& t) { return t.dtype == DType::F32 && t.ne[0] == hd && t.nb[0] == 4; };
    if (!attention_staged_enabled() || !attention_staged_supports(q, k, v) || q.ne[2] != 1 || n_kv_head <= 0 ||
        q.ne[1] % n_kv_head != 0 || !f32_heads(q) || !f32_heads(rope.q_src) || !f32_heads(rope.k_dst) ||
        !f32_heads(rope.k_src) || rope.q_src.ne[1] != q.ne[1] || rope.k_src.ne[1] != n_kv_head ||
        rope.k_dst.ne[1] != n_kv_head || rope.v_src.dtype != DType::F32 || rope.v_src.ne[0] != hd * n_kv_head ||
        rope.v_src.nb[0] != 4 || k.ne[0] != hd * n_kv_head || v.ne[0] != hd * n_kv_head || rope.n_rot < 0 ||
        rope.n_rot > hd || rope.n_rot % 2 != 0 || mask.ne[0] / kPageCells + 2 > 65535 ||
        (rope.q_norm == nullptr) != (rope.k_norm == nullptr) || (rope.q_norm && hd > kWarpNormMax)) {
        return false;
    }
    count_graph_event(GraphEvent::RopeAttentionLaunch);
    if (rope.early_copies) count_graph_event(GraphEvent::EarlyCopyAttentionLaunch);
    if (rope.angles_stored) count_graph_event(GraphEvent::StoredAnglesAttentionLaunch);
    if (hd <= 64) {
        launch_split_or_walk<2, true>(dst, q, k, v, mask, base, n_kv_head, scale, scratch, err, rope, s);
    } else {
        launch_split_or_walk<4, true>(dst, q, k, v, mask, base, n_kv_head, scale, scratch, err, rope, s);
    }
    return true;
}

}  // namespace cuda
}  // namespace pyspec
