// MUL_MAT: dst[n, m] = sum_k w[k, n] * x[k, m], batch-invariant by construction (design.md
// invariant 7): every output is reduced in one order that depends only on K and the weight type.
// A weight row is cut into units of 8 values (load_unit, quantized weights dequantized on the fly,
// activations kept F32); lane l of a warp sums the units u = l, l + 32, l + 64, ... in increasing u,
// each unit's 8 products in the order t = 0..7, as one fmaf chain from 0; the 32 lane partials are
// then added along the xor tree of distances 16, 8, 4, 2, 1 (warp_sum, or the reduce-scatter below,
// which builds the same tree). One kernel family serves every M: a warp carries R weight rows times
// C activation columns at once (R x C accumulators, each weight unit loaded once for the C columns,
// the block's columns shared through L1), and the launch shape (R, C, grid) only decides how many
// outputs run side by side, never the order inside one. So a column's bits do not depend on M, on
// its place in the batch or on its neighbours. No cuBLAS: its kernels (and their split-K and
// reduction orders) change with M. These kernels serve output rows (decode, verify, drafts); prompt
// rows take a tensor-core GEMM with a fixed k order per output (cuda/matmul_tc.cu), every row of
// that kind the same computation, so a row's bits still depend on itself alone.
#include <algorithm>
#include <mutex>
#include <type_traits>
#include <vector>

#include "cuda/async_copy.cuh"
#include "cuda/graph_cache.cuh"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "cuda/matmul_tc_wide.cuh"
#include "cuda/phase_stamps.cuh"
#include "cuda/tma.cuh"

namespace pyspec {
namespace cuda {

namespace {

constexpr int kWarps = 4;  // warps per block; a warp owns R weight rows of the block's tile

// Whether a launch whose longest weight row has `row_bytes` prefetches its rows before the PDL
// wait (the kernels' weight prefetch below): rows of up to 1 KiB, at most 8 lines, which a warp
// reads in one or two rounds of loads, so the launch is a chain of DRAM round trips and the
// prefetch takes the first one off it, behind the kernel before. H200, tg128 in alternating runs:
// SmolLM2 Q4_1 (rows of 360-960 bytes, its Q8_0 output head 612) 992-1005 -> 1059-1071 t/s.
// Long rows stream with many loads in flight already, and there the prefetch competed with the
// running kernel's reads: Qwen3-4B F16 (rows of 5-19 KiB) 266-274 -> 237-238 t/s with it.
bool prefetch_weights(int64_t row_bytes) { return prefetch_enabled() && row_bytes <= 1024; }

// The 8 values of a 16-bit float unit from its 16 bytes (values 2t and 2t + 1 in word t).
template <DType T>
__device__ __forceinline__ void halves_unit(uint4 a, float v[8]) {
    const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        const uint16_t lo = static_cast<uint16_t>(w[t] & 0xffffu), hi = static_cast<uint16_t>(w[t] >> 16);
        v[2 * t] = T == DType::F16 ? h2f(lo) : bf2f(lo);
        v[2 * t + 1] = T == DType::F16 ? h2f(hi) : bf2f(hi);
    }
}

// The 8 values of unit u of a row: v[t] belongs at column pos0 + t for t < 4, pos1 + t - 4 after.
template <DType T, bool kAligned>
__device__ __forceinline__ void load_unit(const char* row, int64_t u, float v[8], int64_t& pos0, int64_t& pos1) {
    if constexpr (T == DType::F32) {
        pos0 = u * 8;
        pos1 = pos0 + 4;
        const float* p = reinterpret_cast<const float*>(row) + u * 8;
        if constexpr (kAligned) {
            const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        } else {
#pragma unroll
            for (int t = 0; t < 8; ++t) v[t] = p[t];
        }
    } else if constexpr (T == DType::F16 || T == DType::BF16) {
        pos0 = u * 8;
        pos1 = pos0 + 4;
        const uint16_t* p = reinterpret_cast<const uint16_t*>(row) + u * 8;
        if constexpr (kAligned) {
            halves_unit<T>(*reinterpret_cast<const uint4*>(p), v);
        } else {
#pragma unroll
            for (int t = 0; t < 8; ++t) v[t] = T == DType::F16 ? h2f(p[t]) : bf2f(p[t]);
        }
    } else if constexpr (T == DType::Q8_0) {
        const int64_t b = u >> 2;
        const int part = static_cast<int>(u & 3);
        const char* blk = row + b * static_cast<int64_t>(sizeof(BlockQ8_0));
        const float d = h2f(ld16(blk));
        // A 34-byte block's quants are 2-byte aligned: four 16-bit loads instead of eight byte
        // loads (the head of SmolLM2, 49,152 rows, was bound by load instructions), the same values.
        const char* qs = blk + 2 + part * 8;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const uint16_t two = ld16(qs + 2 * t);
            v[2 * t] = static_cast<float>(static_cast<int8_t>(two & 0xffu)) * d;
            v[2 * t + 1] = static_cast<float>(static_cast<int8_t>(two >> 8)) * d;
        }
        pos0 = b * QK + part * 8;
        pos1 = pos0 + 4;
    } else if constexpr (T == DType::Q4_0) {
        const int64_t b = u >> 2;
        const int part = static_cast<int>(u & 3);
        const char* blk = row + b * static_cast<int64_t>(sizeof(BlockQ4_0));
        const float d = h2f(ld16(blk));
        // 18-byte blocks: the 4 quant bytes in two 16-bit loads.
        const uint32_t four = ld16(blk + 2 + part * 4) | static_cast<uint32_t>(ld16(blk + 4 + part * 4)) << 16;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const uint32_t q = (four >> (8 * t)) & 0xffu;
            v[t] = d * static_cast<float>(static_cast<int>(q & 15) - 8);
            v[t + 4] = d * static_cast<float>(static_cast<int>(q >> 4) - 8);
        }
        pos0 = b * QK + part * 4;
        pos1 = pos0 + 16;
    } else {  // Q4_1
        const int64_t b = u >> 2;
        const int part = static_cast<int>(u & 3);
        const char* blk = row + b * static_cast<int64_t>(sizeof(BlockQ4_1));
        const float d = h2f(ld16(blk)), mn = h2f(ld16(blk + 2));
        // 20-byte blocks keep the quants 4-byte aligned: one load for the unit's 4 bytes.
        const uint32_t four = *reinterpret_cast<const uint32_t*>(blk + 4 + part * 4);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const uint32_t q = (four >> (8 * t)) & 0xffu;
            v[t] = __fmul_rn(d, static_cast<float>(q & 15)) + mn;
            v[t + 4] = __fmul_rn(d, static_cast<float>(q >> 4)) + mn;
        }
        pos0 = b * QK + part * 4;
        pos1 = pos0 + 16;
    }
}

// The activations that unit (p0, p1) meets: x[p0 .. p0 + 4) then x[p1 .. p1 + 4).
template <bool kVec>
__device__ __forceinline__ void load_x(const float* xc, int64_t p0, int64_t p1, float xv[8]) {
    if constexpr (kVec) {
        const float4 a = *reinterpret_cast<const float4*>(xc + p0), b = *reinterpret_cast<const float4*>(xc + p1);
        xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w; xv[4] = b.x; xv[5] = b.y; xv[6] = b.z; xv[7] = b.w;
    } else {
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            xv[t] = xc[p0 + t];
            xv[t + 4] = xc[p1 + t];
        }
    }
}

// One level of k_mul_mat's reduce-scatter: p[0, 2D) -> p[0, D), D a compile-time constant so that
// p stays in registers.
template <int D>
__device__ __forceinline__ void reduce_scatter_level(float (&p)[32], int lane) {
    const bool hi = (lane & D) != 0;
#pragma unroll
    for (int i = 0; i < D; ++i) {
        const float keep = hi ? p[i + D] : p[i];
        const float send = hi ? p[i] : p[i + D];
        p[i] = keep + __shfl_xor_sync(0xffffffffu, send, D);
    }
}

// The weight matrices of one launch, stacked along rows: part j holds global rows
// [row0[j], row0[j + 1]). One part for a plain MUL_MAT; q/k/v or gate/up of one activation
// batch as several (launch_matmul_group), so they cost one launch.
struct Parts {
    const char* w[kMaxMatmulParts];
    int64_t rb[kMaxMatmulParts];
    float* y[kMaxMatmulParts];
    int64_t ys[kMaxMatmulParts];
    const float* add[kMaxMatmulParts];  // residual added before the store, or nullptr
    int64_t as[kMaxMatmulParts];
    int64_t row0[kMaxMatmulParts + 1];
    int n;
    const float* norm_w;  // the norm prologue's weights (kNorm kernels only)
    float norm_eps;
    bool prefetch;        // prefetch_enabled() (cuda/launch.cuh)
    bool early;           // every part's weights MatmulPart::constant (k_mul_mat_rows)
    bool evict_first;     // the weight loads L2 evict-first (k_mul_mat_rows: kRowEvictFirst)
    bool norm_constant;   // MatmulNorm::constant
    bool norm_early;      // norm_w staged before the PDL wait (k_mul_mat_rows: stage_norm_weights)
    int light;            // the balanced grid's blocks that take half a share (block_items, kRowRoom)
};

__device__ __forceinline__ int part_of(const Parts& p, int64_t row) {
    int j = 0;
#pragma unroll
    for (int i = 1; i < kMaxMatmulParts; ++i) j += (i < p.n && row >= p.row0[i]) ? 1 : 0;
    return j;
}

__device__ __forceinline__ void store(const Parts& p, int64_t row, int64_t col, float v) {
    const int j = part_of(p, row);
    const int64_t i = row - p.row0[j];
    if (p.add[j]) v += p.add[j][col * p.as[j] + i];
    p.y[j][col * p.ys[j] + i] = v;
}

// Weight prefetch ahead of the PDL wait. A kernel launched with PDL (cuda/launch.cuh) is resident
// while the kernel before it still runs and waits for it in pdl_enter(); the weights it will read
// are constant, so before waiting each warp asks L2 for its rows (prefetch.global.L2, a hint: no
// value changes, so no bits do). In a decode step of a small model every MUL_MAT otherwise starts
// by waiting out DRAM latency after the previous kernel finished; now that wait overlaps the
// previous kernel. PYSPEC_CUDA_PREFETCH=0 turns it off (A/B runs).
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// The 128-byte lines of `bytes` bytes from `row`, spread over the warp's lanes.
__device__ __forceinline__ void prefetch_row(const char* row, int64_t bytes, int lane) {
    for (int64_t off = static_cast<int64_t>(lane) * 128; off < bytes; off += 32 * 128) prefetch_l2(row + off);
}

// R weight rows from global row r0 (clamped to the last, as k_mul_mat reads them).
template <int R>
__device__ __forceinline__ void prefetch_weight_rows(const Parts& p, int64_t r0, int lane) {
    const int64_t n_rows = p.row0[p.n];
    if (r0 >= n_rows) return;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int64_t row = min(r0 + r, n_rows - 1);
        const int j = part_of(p, row);
        prefetch_row(p.w[j] + (row - p.row0[j]) * p.rb[j], p.rb[j], lane);
    }
}

// The fmaf chains of one warp: R weight rows (wr) times C activation columns (xc), lane `lane`
// summing units u = lane, lane + 32, ... in increasing order into acc (from 0). The unit loop is
// unrolled for small tiles so that a lane has several loads in flight; the fmaf chain of every
// output still runs in increasing u, so unrolling changes timing, never bits.
template <DType T, bool kVec, int R, int C>
__device__ __forceinline__ void accumulate(const char* const (&wr)[R], const float* const (&xc)[C], int64_t k,
                                           int lane, float (&acc)[R][C]) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int c = 0; c < C; ++c) acc[r][c] = 0.0f;
    }
    const int64_t units = k / 8;
#pragma unroll(R * C <= 4 ? 4 : 1)
    for (int64_t u = lane; u < units; u += 32) {
        float v[R][8];
        int64_t p0 = 0, p1 = 0;
#pragma unroll
        for (int r = 0; r < R; ++r) load_unit<T, kVec>(wr[r], u, v[r], p0, p1);
#pragma unroll
        for (int c = 0; c < C; ++c) {
            float xv[8];
            load_x<kVec>(xc[c], p0, p1, xv);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float a = acc[r][c];
#pragma unroll
                for (int t = 0; t < 8; ++t) a = fmaf(v[r][t], xv[t], a);
                acc[r][c] = a;
            }
        }
    }
}

#include "cuda/matmul_column.cuh"  // the column staging: copy_column, norm_prologue

// Block (blockIdx.x, blockIdx.y) computes columns [C * blockIdx.x, + C) of the global weight rows
// row_base + [R * kWarps * blockIdx.y, + R * kWarps); warp w of it R rows from
// row_base + R * (kWarps * blockIdx.y + w). Rows and columns past the ends are clamped to the last
// one (computed, never stored), which keeps the inner loop free of branches. kVec: 16-byte loads
// of float weights and of activations.
template <DType T, bool kVec, int R, int C, bool kNorm>
__global__ void __launch_bounds__(kWarps * 32) k_mul_mat(Parts p, int64_t row_base, int64_t k, const float* x,
                                                          int64_t x_stride, int64_t m) {
    const int lane = threadIdx.x & 31;
    const int64_t n_rows = p.row0[p.n];
    const int64_t r0 = row_base + (static_cast<int64_t>(blockIdx.y) * kWarps + (threadIdx.x >> 5)) * R;
    // The small-M tiles (decode, verify, draft blocks), where latency is the cost; one column tile asks.
    if constexpr (R == 1) {
        if (p.prefetch && blockIdx.x == 0) prefetch_weight_rows<R>(p, r0, lane);
    }
    pdl_enter();
    const int64_t c0 = static_cast<int64_t>(blockIdx.x) * C;
    const float* xc[C];
#pragma unroll
    for (int c = 0; c < C; ++c) xc[c] = x + min(c0 + c, m - 1) * x_stride;
    if constexpr (kNorm) norm_prologue<C>(xc, k, p.norm_w, p.norm_eps);  // before any warp leaves
    if (r0 >= n_rows) return;
    const char* wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int64_t row = min(r0 + r, n_rows - 1);
        const int j = part_of(p, row);
        wr[r] = p.w[j] + (row - p.row0[j]) * p.rb[j];
    }
    float acc[R][C];
    accumulate<T, kVec, R, C>(wr, xc, k, lane, acc);
    if constexpr (R * C % 32 == 0) {
        // Reduce-scatter, 32 outputs at a time: at distance d a lane keeps the half of its outputs
        // whose bit d matches its own and adds the partner's partial of each (own + partner, as
        // warp_sum adds), so output o ends on lane o % 32 after the same xor tree, in 31 shuffles
        // instead of 5 per output.
#pragma unroll
        for (int g = 0; g < R * C / 32; ++g) {
            float q[32];
#pragma unroll
            for (int o = 0; o < 32; ++o) q[o] = acc[(32 * g + o) / C][(32 * g + o) % C];
            reduce_scatter_level<16>(q, lane);
            reduce_scatter_level<8>(q, lane);
            reduce_scatter_level<4>(q, lane);
            reduce_scatter_level<2>(q, lane);
            reduce_scatter_level<1>(q, lane);
            const int o = 32 * g + lane;
            const int64_t row = r0 + o / C, col = c0 + o % C;
            if (row < n_rows && col < m) store(p, row, col, q[0]);
        }
    } else {
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int c = 0; c < C; ++c) {
                const float s = warp_sum(acc[r][c]);
                if (lane == 0 && r0 + r < n_rows && c0 + c < m) store(p, r0 + r, c0 + c, s);
            }
        }
    }
}

// Float weights whose K is not a multiple of 8: element by element, one warp per weight row, lane
// l summing elements l, l + 32, ... then warp_sum; the same order for every column, any M.
__global__ void __launch_bounds__(kWarps * 32) k_mul_mat_generic(DType t, const char* w, int64_t n_rows, int64_t k,
                                                                  int64_t row_bytes, const float* x, int64_t x_stride,
                                                                  int64_t m, float* y, int64_t y_stride) {
    pdl_enter();
    const int lane = threadIdx.x & 31;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
    if (row >= n_rows) return;
    const char* wr = w + row * row_bytes;
    for (int64_t c = 0; c < m; ++c) {
        float a = 0.0f;
        for (int64_t i = lane; i < k; i += 32) a = fmaf(load_elem(t, wr, i), x[c * x_stride + i], a);
        a = warp_sum(a);
        if (lane == 0) y[c * y_stride + row] = a;
    }
}

// gate and up (equal shapes, one weight type and K) over the same activations, with the SWIGLU
// that follows them as the epilogue: warp w of block (blockIdx.x, blockIdx.y) takes row
// row_base + kWarps * blockIdx.y + w of both matrices and columns [C * blockIdx.x, + C), runs each
// output's fmaf chain exactly as k_mul_mat does (accumulate, then warp_sum: the same xor tree),
// and stores silu(gate) * up, the SWIGLU op's formula. So the bits are those of the three nodes
// run apart, and the two products never reach memory. (Two rows of each per warp measured slower
// on the H200: Qwen3-4B's gate/up 34.2 -> 37.5 us a call.)
// kSplit (small_tile's split: one column a warp for each of m > 1 columns, a verify pass's rows)
// holds the kernel to 56 registers so that kGluSplitBlocksPerSm blocks fit an SM: left to itself
// ptxas took 80 (Q4_1 with the norm prologue), 6 blocks an SM, and SmolLM2's 3-row verify split
// into 1,152 blocks ran in 1.45 waves of 792 (the 56 cost 84-128 bytes of spills, which L1
// holds). H200, one build, alternating runs: ncu 11.3 -> 7.7 us a call; a speculative round's
// target pass (3 rows) 1.04-1.08 -> 0.95 ms by the wall clock. A decode's one column (384 blocks)
// keeps its registers: it fits an SM's blocks either way.
constexpr int kGluSplitBlocksPerSm = 9;

template <DType T, bool kVec, int C, bool kNorm, bool kSplit = false>
__global__ void __launch_bounds__(kWarps * 32, kSplit ? kGluSplitBlocksPerSm : 1)
    k_mul_mat_glu(const char* wg, const char* wu, int64_t rb_g, int64_t rb_u, int64_t n_rows, int64_t row_base,
                  int64_t k, const float* x, int64_t x_stride, int64_t m, float* y, int64_t y_stride,
                  const float* norm_w, float norm_eps, bool prefetch) {
    const int lane = threadIdx.x & 31;
    const int64_t row = row_base + static_cast<int64_t>(blockIdx.y) * kWarps + (threadIdx.x >> 5);
    if (prefetch && blockIdx.x == 0 && row < n_rows) {  // as k_mul_mat, before the wait
        prefetch_row(wg + row * rb_g, rb_g, lane);
        prefetch_row(wu + row * rb_u, rb_u, lane);
    }
    pdl_enter();
    const int64_t c0 = static_cast<int64_t>(blockIdx.x) * C;
    const float* xc[C];
#pragma unroll
    for (int c = 0; c < C; ++c) xc[c] = x + min(c0 + c, m - 1) * x_stride;
    if constexpr (kNorm) norm_prologue<C>(xc, k, norm_w, norm_eps);  // before any warp leaves
    if (row >= n_rows) return;
    const char* const wr[2] = {wg + row * rb_g, wu + row * rb_u};
    float acc[2][C];
    accumulate<T, kVec, 2, C>(wr, xc, k, lane, acc);
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const float g = warp_sum(acc[0][c]), u = warp_sum(acc[1][c]);
        if (lane == 0 && c0 + c < m) y[(c0 + c) * y_stride + row] = silu_f(g) * u;
    }
}

#include "cuda/matmul_rows.cuh"  // the one-column long-row kernels (this translation unit's)

// The column tile of the small-M kernels (mul_mat_typed, mul_mat_glu_typed) up to 8 columns.
// Short weight rows (at most 1 KiB, as prefetch_weights: a warp's loads are one or two DRAM round
// trips, the launch latency-bound) take one column per warp for any m <= 4, and for m <= 8 (two
// or more requests' verify rows, several sequences decoding): m times the warps, each as short as
// a decode's, the weight rows read from L2 by the blocks after the first (grid.x next to each
// other). Longer rows stream: m's columns per warp load each weight unit once. ncu on the H200,
// SmolLM2's 3-row verify pass with 4-column tiles: 6.3-6.6 us per plain MUL_MAT and 9.0-11.0 with
// the norm prologue, against 4.3-4.6 and 6.0-7.1 for a decode's one column; by the wall clock a
// speculative round of SmolLM2 went 1.79-1.84 -> 1.39-1.42 ms with one column per warp (n_max 2).
// PYSPEC_CUDA_COLUMN_SPLIT=0 keeps m's columns per warp, PYSPEC_CUDA_COLUMN_SPLIT_WIDE=0 only for
// m of 5-8 (A/B); either way the same bits.
int64_t small_tile(DType t, int64_t k, int64_t m) {
    static const bool split = env_switch("PYSPEC_CUDA_COLUMN_SPLIT") != 0;
    static const bool split_wide = split && env_switch("PYSPEC_CUDA_COLUMN_SPLIT_WIDE") != 0;
    const bool short_rows = static_cast<int64_t>(dtype_row_bytes(t, k)) <= 1024;
    if (m <= 1 || (short_rows && ((m <= 4 && split) || (m <= 8 && split_wide)))) return 1;
    return m == 2 ? 2 : m <= 4 ? 4 : 8;
}

template <DType T, bool kVec, int C, bool kNorm = false, bool kSplit = false>
void mul_mat_glu_tiles(const MatmulPart& gate, const MatmulPart& up, int64_t k, const float* x, int64_t xs, int64_t m,
                       float* y, int64_t ys, const MatmulNorm& norm, cudaStream_t s) {
    constexpr int64_t max_rows = int64_t{kWarps} * 65535;
    const unsigned gx = grid_for(m, C);
    for (int64_t r0 = 0; r0 < gate.n_rows; r0 += max_rows) {
        const int64_t nr = std::min(max_rows, gate.n_rows - r0);
        const dim3 grid(gx, static_cast<unsigned>((nr + kWarps - 1) / kWarps));
        launch(k_mul_mat_glu<T, kVec, C, kNorm, kSplit>, grid, kWarps * 32, kNorm ? C * k * sizeof(float) : 0, s,
            static_cast<const char*>(gate.w), static_cast<const char*>(up.w), static_cast<int64_t>(gate.row_bytes),
            static_cast<int64_t>(up.row_bytes), gate.n_rows, r0, k, x, xs, m, y, ys, norm.w, norm.eps,
            prefetch_weights(static_cast<int64_t>(std::max(gate.row_bytes, up.row_bytes))));
    }
}

// Whether p (nullptr: nothing to load) allows 16-byte loads.
bool aligned16(const float* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether a row-streaming launch stages its norm's weights (stage_norm_weights): asked for by the
// setting, the weights constant, 16-byte aligned and whole 16-byte units, and the column and the
// weights within the 48 KB of shared memory a launch has without asking.
inline bool stages_norm_weights(int setting, const float* nw, bool constant, int64_t k) {
    return (setting & kRowNormEarly) && nw && constant && aligned16(nw) && k % 4 == 0 &&
           2 * k * static_cast<int64_t>(sizeof(float)) <= 48 * 1024;
}

template <DType T, bool kVec>
void mul_mat_glu_typed(const MatmulPart& gate, const MatmulPart& up, int64_t k, const float* x, int64_t xs, int64_t m,
                       float* y, int64_t ys, const MatmulNorm& norm, cudaStream_t s) {
    if constexpr (kRowStreamType<T, kVec>) {
        if (streams_rows<T, kVec>(k, m)) {
            if (gate.constant && up.constant) count_graph_event(GraphEvent::EarlyWeightLaunch);
            Parts p{};  // the row groups' view: the gate's and the up's rows, SWIGLU into y
            p.n = 1;
            p.w[0] = static_cast<const char*>(gate.w);
            p.w[1] = static_cast<const char*>(up.w);
            p.rb[0] = static_cast<int64_t>(gate.row_bytes);
            p.rb[1] = static_cast<int64_t>(up.row_bytes);
            p.y[0] = y;
            p.row0[1] = gate.n_rows;
            p.norm_w = norm.w;
            p.norm_eps = norm.eps;
            p.early = gate.constant && up.constant;
            Parts both = p;  // both maps' bases and pitches checked
            both.n = 2;
            both.row0[2] = 2 * gate.n_rows;
            if (rows_tma_fits<true>(both, k)) return launch_rows_tma<T, true>(p, k, x, s);
            const auto pick = [&](auto grid) {
                using G = decltype(grid);
                constexpr bool kB = kGridBalanced<G>;
                constexpr int kW = kGridWarps<G>, kF = kGridFeed<G>;
                return norm.w ? k_mul_mat_glu_rows<T, true, kB, kW, kF> : k_mul_mat_glu_rows<T, false, kB, kW, kF>;
            };
            const int setting = matmul_row_stream_setting();
            const bool staged = stages_norm_weights(setting, norm.w, norm.constant, k);
            if (staged) count_graph_event(GraphEvent::EarlyNormLaunch);
            const size_t smem = (staged ? 2 : 1) * k * sizeof(float);  // the column, and the norm's weights
            return launch_row_stream(pick, gate.n_rows, setting, smem, s, static_cast<const char*>(gate.w),
                                     static_cast<const char*>(up.w), static_cast<int64_t>(gate.row_bytes),
                                     static_cast<int64_t>(up.row_bytes), gate.n_rows, k, x, y, norm.w, norm.eps,
                                     gate.constant && up.constant, (setting & kRowEvictFirst) != 0, staged);
        }
    }
    const int64_t tile = m <= 8 ? small_tile(T, k, m) : 8;
    if (tile == 1 && m > 1) {
        if (norm.w) return mul_mat_glu_tiles<T, kVec, 1, true, true>(gate, up, k, x, xs, m, y, ys, norm, s);
        return mul_mat_glu_tiles<T, kVec, 1, false, true>(gate, up, k, x, xs, m, y, ys, norm, s);
    }
    if (norm.w) {
        if (tile == 1) return mul_mat_glu_tiles<T, kVec, 1, true>(gate, up, k, x, xs, m, y, ys, norm, s);
        if (tile == 2) return mul_mat_glu_tiles<T, kVec, 2, true>(gate, up, k, x, xs, m, y, ys, norm, s);
        return mul_mat_glu_tiles<T, kVec, 4, true>(gate, up, k, x, xs, m, y, ys, norm, s);  // m <= kMatmulNormMaxM
    }
    if (tile == 1) return mul_mat_glu_tiles<T, kVec, 1>(gate, up, k, x, xs, m, y, ys, norm, s);
    if (tile == 2) return mul_mat_glu_tiles<T, kVec, 2>(gate, up, k, x, xs, m, y, ys, norm, s);
    if (m <= 4) return mul_mat_glu_tiles<T, kVec, 4>(gate, up, k, x, xs, m, y, ys, norm, s);
    return mul_mat_glu_tiles<T, kVec, 8>(gate, up, k, x, xs, m, y, ys, norm, s);
}

// Row tiles go on grid.y (at most 65535 per launch), column tiles on grid.x, so the blocks that
// share a weight tile run next to each other and read it from L2 once.
template <DType T, bool kVec, int R, int C, bool kNorm = false>
void mul_mat_tiles(const Parts& p, int64_t k, const float* x, int64_t xs, int64_t m, cudaStream_t s) {
    constexpr int64_t rows_per_block = int64_t{R} * kWarps;
    constexpr int64_t max_rows = rows_per_block * 65535;
    const int64_t n = p.row0[p.n];
    const unsigned gx = grid_for(m, C);
    for (int64_t r0 = 0; r0 < n; r0 += max_rows) {
        const int64_t nr = std::min(max_rows, n - r0);
        const dim3 grid(gx, static_cast<unsigned>((nr + rows_per_block - 1) / rows_per_block));
        launch(k_mul_mat<T, kVec, R, C, kNorm>, grid, kWarps * 32, kNorm ? C * k * sizeof(float) : 0, s, p, r0, k, x,
               xs, m);
    }
}

// The launch shape by batch size. It only changes how many outputs a warp carries, never an
// output's order, so these thresholds are free to tune. Small M (decode, verify, draft blocks):
// one row per warp, many warps, bandwidth-bound (2 or 4 rows per warp at M = 1 measured slower on
// the H200: Qwen3-4B's MUL_MATs 15.3 -> 19.6 us at 2). Larger M: 4 rows x 8 columns per warp, 32
// FMAs per activation load and 8 columns per weight load. The norm prologue is instantiated for
// the tiles of m <= kMatmulNormMaxM (1, 2 and 4 columns; m = 3 normalises its last column twice).
static_assert(kMatmulNormMaxM == 4, "k_mul_mat's and k_mul_mat_glu's norm prologue serve tiles of 1, 2 and 4 columns");

template <DType T, bool kVec>
void mul_mat_typed(const Parts& p, int64_t k, const float* x, int64_t xs, int64_t m, int room, cudaStream_t s) {
    if constexpr (kRowStreamType<T, kVec>) {
        if (streams_rows<T, kVec>(k, m)) {
            if (p.early) count_graph_event(GraphEvent::EarlyWeightLaunch);
            if (rows_tma_fits<false>(p, k)) return launch_rows_tma<T, false>(p, k, x, s);
            const auto pick = [&](auto grid) {
                using G = decltype(grid);
                constexpr bool kB = kGridBalanced<G>;
                constexpr int kW = kGridWarps<G>, kF = kGridFeed<G>;
                return p.norm_w ? k_mul_mat_rows<T, true, kB, kW, kF> : k_mul_mat_rows<T, false, kB, kW, kF>;
            };
            const int setting = matmul_row_stream_setting();
            Parts ps = p;
            ps.evict_first = (setting & kRowEvictFirst) != 0;
            ps.norm_early = stages_norm_weights(setting, p.norm_w, p.norm_constant, k);
            if (ps.norm_early) count_graph_event(GraphEvent::EarlyNormLaunch);
            const int64_t items = (p.row0[p.n] + 1) / 2;
            const bool deep = !p.norm_w && takes_deep_grid(setting, items, k);
            if ((setting & kRowRoom) && (setting & kRowBalanced) && room > 0) {
                // room SMs' worth of half-share blocks: one block a SM on the deep grid and the
                // piped one-block grid, kBalBlocksPerSm on the others
                const bool one_a_sm = deep || ((setting & kRowPiped) && (setting & kRowPipedOneBlock));
                ps.light = room * (one_a_sm ? 1 : kBalBlocksPerSm);
                count_graph_event(GraphEvent::RoomRowLaunch);
            }
            if (deep) {
                return launch_deep_rows(k_mul_mat_rows<T, false, true, kDeepWarps, kFeedDeep>, items, k, s, ps, x);
            }
            const size_t smem = (ps.norm_early ? 2 : 1) * k * sizeof(float);
            return launch_row_stream(pick, items, setting, smem, s, ps, k, x);
        }
    }
    const int64_t tile = m <= 8 ? small_tile(T, k, m) : 8;
    if (p.norm_w) {
        if (tile == 1) return mul_mat_tiles<T, kVec, 1, 1, true>(p, k, x, xs, m, s);
        if (tile == 2) return mul_mat_tiles<T, kVec, 1, 2, true>(p, k, x, xs, m, s);
        return mul_mat_tiles<T, kVec, 1, 4, true>(p, k, x, xs, m, s);  // m <= kMatmulNormMaxM
    }
    if (tile == 1) return mul_mat_tiles<T, kVec, 1, 1>(p, k, x, xs, m, s);
    if (tile == 2) return mul_mat_tiles<T, kVec, 1, 2>(p, k, x, xs, m, s);
    if (m <= 4) return mul_mat_tiles<T, kVec, 1, 4>(p, k, x, xs, m, s);
    if (m <= 16) return mul_mat_tiles<T, kVec, 1, 8>(p, k, x, xs, m, s);
    return mul_mat_tiles<T, kVec, 4, 8>(p, k, x, xs, m, s);
}

bool float_weights(DType t) { return t == DType::F32 || t == DType::F16 || t == DType::BF16; }

// 16-byte loads: activations (and float weights) 16-byte aligned at every row. The choice changes
// how values are loaded, not which values meet in which order.
bool sixteen_byte_loads(DType t, const float* x, int64_t xs, const MatmulPart* parts, int n) {
    bool vec = reinterpret_cast<uintptr_t>(x) % 16 == 0 && xs % 4 == 0;
    for (int j = 0; j < n && float_weights(t); ++j) {
        vec = vec && reinterpret_cast<uintptr_t>(parts[j].w) % 16 == 0 && parts[j].row_bytes % 16 == 0;
    }
    return vec;
}


// Calls f(integral_constant<DType, t>, bool_constant<vec>) for the CUDA-core kernels' weight
// types, the 16-byte-load choice being a template parameter too; false for any other type.
template <class F>
bool with_weight_type(DType t, bool vec, F&& f) {
    const auto go = [&](auto type) {
        if (vec) f(type, std::true_type{});
        else f(type, std::false_type{});
        return true;
    };
    switch (t) {
        case DType::F32: return go(std::integral_constant<DType, DType::F32>{});
        case DType::F16: return go(std::integral_constant<DType, DType::F16>{});
        case DType::BF16: return go(std::integral_constant<DType, DType::BF16>{});
        case DType::Q8_0: return go(std::integral_constant<DType, DType::Q8_0>{});
        case DType::Q4_0: return go(std::integral_constant<DType, DType::Q4_0>{});
        case DType::Q4_1: return go(std::integral_constant<DType, DType::Q4_1>{});
        default: return false;
    }
}

}  // namespace

// The residual epilogue lives in k_mul_mat's store and in both tensor-core kernels' stores; the
// generic path has none.
bool matmul_add_epilogue(DType t, int64_t k, TcRows rows) {
    if (rows == TcRows::All) return true;
    return !(float_weights(t) && k % 8 != 0) && k % dtype_block_size(t) == 0;
}

bool matmul_norm_prologue(DType t, int64_t k, int64_t m, int64_t prompt_cols, TcRows rows) {
    static const bool enabled = env_switch("PYSPEC_CUDA_NORM_PROLOGUE") != 0;
    const int64_t held = k * small_tile(t, k, m);  // the block's normalised columns, in floats
    const bool fits = m == 1 ? held <= kMatmulNormMaxValues : held <= kMatmulNormMaxTileValues;
    return enabled && m >= 1 && m <= kMatmulNormMaxM && fits && (rows == TcRows::None || (rows == TcRows::Prompt && prompt_cols == 0)) &&
           !(float_weights(t) && k % 8 != 0) && k % dtype_block_size(t) == 0 &&
           with_weight_type(t, false, [](auto, auto) {});
}

int matmul_row_stream_setting() {
    return (env_switch("PYSPEC_CUDA_ROW_BALANCE") != 0 ? kRowBalanced : 0) |
           (env_switch("PYSPEC_CUDA_L2_EVICT_FIRST") != 0 ? kRowEvictFirst : 0) |
           (env_switch("PYSPEC_CUDA_NORM_EARLY") != 0 ? kRowNormEarly : 0) |
           (env_switch("PYSPEC_CUDA_ROW_DEEP") != 0 ? kRowDeep : 0) |
           (env_switch("PYSPEC_CUDA_ROW_PIPED") != 0 ? kRowPiped : 0) |
           (env_switch("PYSPEC_CUDA_ROW_PIPED_ONE_BLOCK") != 0 ? kRowPipedOneBlock : 0) |
           (env_switch("PYSPEC_CUDA_ROW_ROOM") != 0 ? kRowRoom : 0);
}

int matmul_row_tma_setting() {
    if (env_switch("PYSPEC_CUDA_ROW_TMA") != 1) return 0;
    const char* stages = std::getenv("PYSPEC_CUDA_ROW_TMA_STAGES");
    const char* trigger = std::getenv("PYSPEC_CUDA_ROW_TMA_TRIGGER");
    const char* kinds_env = std::getenv("PYSPEC_CUDA_ROW_TMA_KINDS");
    const std::string kinds = kinds_env && *kinds_env ? kinds_env : "ngp";
    const auto skip = [&](char kind, int bit) { return kinds.find(kind) == std::string::npos ? bit : 0; };
    return kRowTmaOn | (stages && std::string(stages) == "8" ? kRowTmaShallow : 0) |
           (trigger && std::string(trigger) == "start" ? kRowTmaTriggerFirst : 0) | skip('n', kRowTmaSkipNorm) |
           skip('g', kRowTmaSkipGlu) | skip('p', kRowTmaSkipPlain);
}

bool launch_matmul_glu(DType t, const MatmulPart& gate, const MatmulPart& up, int64_t k, const float* x, int64_t xs,
                       int64_t m, int64_t prompt_cols, TcRows rows, float* y, int64_t ys, cudaStream_t s,
                       const MatmulNorm* norm) {
    if (m <= 0 || m > kMatmulGluMaxM || rows == TcRows::All || (prompt_cols > 0 && rows == TcRows::Prompt) ||
        (float_weights(t) && k % 8 != 0) ||
        k % dtype_block_size(t) != 0 || gate.n_rows != up.n_rows || gate.n_rows <= 0 || gate.add || up.add ||
        (norm && !matmul_norm_prologue(t, k, m, prompt_cols, rows))) {
        return false;
    }
    const MatmulPart both[2] = {gate, up};
    const MatmulNorm nn = norm ? *norm : MatmulNorm{};
    const bool vec = sixteen_byte_loads(t, x, xs, both, 2) && aligned16(nn.w);
    const bool launched = with_weight_type(t, vec, [&](auto type, auto v) {
        mul_mat_glu_typed<decltype(type)::value, decltype(v)::value>(gate, up, k, x, xs, m, y, ys, nn, s);
    });
    return launched;
}

namespace {

// The parts over columns [c, ...): x, y and add start c columns further on.
std::vector<MatmulPart> parts_from_column(const MatmulPart* parts, int n_parts, int64_t c) {
    std::vector<MatmulPart> out(parts, parts + n_parts);
    for (MatmulPart& q : out) {
        q.y += c * q.y_stride;
        if (q.add) q.add += c * q.add_stride;
    }
    return out;
}

// The tensor-core computation: narrow batches on the narrow kernel, the rest on the wide one (a
// whole group per call either way; the same bits either way).
void matmul_tc(DType t, const MatmulPart* parts, int n_parts, int64_t k, const float* x, int64_t xs, int64_t m,
               const SplitScratch& scratch, cudaStream_t s) {
    if (m <= kMatmulTcNarrowMaxM && launch_matmul_tc_narrow(t, parts, n_parts, k, x, xs, m, scratch, s)) return;
    launch_matmul_tc_wide(t, parts, n_parts, k, x, xs, m, scratch, s);
}

// The CUDA-core computation (this file's kernels).
void matmul_cores(DType t, const MatmulPart* parts, int n_parts, int64_t k, const float* x, int64_t xs, int64_t m,
                  const MatmulNorm* norm, int room, cudaStream_t s) {
    if (norm && !matmul_norm_prologue(t, k, m, 0, TcRows::None)) {
        throw std::logic_error("cuda backend: mul_mat: a norm prologue on a path without one");
    }
    if (float_weights(t) && k % 8 != 0) {
        for (int j = 0; j < n_parts; ++j) {
            if (parts[j].add) throw std::logic_error("cuda backend: mul_mat: an add epilogue on a path without one");
        }
        for (int j = 0; j < n_parts; ++j) {
            const MatmulPart& q = parts[j];
            if (q.n_rows <= 0) continue;
            launch(k_mul_mat_generic, grid_for(q.n_rows, kWarps), kWarps * 32, 0, s,
                t, static_cast<const char*>(q.w), q.n_rows, k, static_cast<int64_t>(q.row_bytes), x, xs, m, q.y,
                q.y_stride);
        }
        return;
    }
    Parts p{};
    p.n = n_parts;
    p.row0[0] = 0;
    for (int j = 0; j < n_parts; ++j) {
        const MatmulPart& q = parts[j];
        p.w[j] = static_cast<const char*>(q.w);
        p.rb[j] = static_cast<int64_t>(q.row_bytes);
        p.y[j] = q.y;
        p.ys[j] = q.y_stride;
        p.add[j] = q.add;
        p.as[j] = q.add_stride;
        p.row0[j + 1] = p.row0[j] + std::max<int64_t>(0, q.n_rows);
    }
    if (p.row0[n_parts] == 0) return;
    p.norm_w = norm ? norm->w : nullptr;
    p.norm_eps = norm ? norm->eps : 0.0f;
    p.norm_constant = norm && norm->constant;
    int64_t longest_row = 0;
    for (int j = 0; j < n_parts; ++j) longest_row = std::max(longest_row, static_cast<int64_t>(parts[j].row_bytes));
    p.prefetch = prefetch_weights(longest_row);
    p.early = true;
    for (int j = 0; j < n_parts; ++j) p.early = p.early && parts[j].constant;
    const bool vec = sixteen_byte_loads(t, x, xs, parts, n_parts) && aligned16(p.norm_w);
    const bool launched = with_weight_type(t, vec, [&](auto type, auto vec) {
        mul_mat_typed<decltype(type)::value, decltype(vec)::value>(p, k, x, xs, m, room, s);
    });
    if (!launched) throw std::runtime_error(std::string("cuda backend: mul_mat: unsupported weight type ") + dtype_name(t));
}

}  // namespace

// Speed: output rows run on CUDA cores (FP32 FMA, ~67 TFLOP/s peak on the H200) and prompt rows on
// tensor cores, unless the backend serves wide batches (matmul_tc_rows; the measurements there).
void launch_matmul_group(DType t, const MatmulPart* parts, int n_parts, int64_t k, const float* x, int64_t xs,
                         int64_t m, int64_t prompt_cols, TcRows rows, const SplitScratch& scratch, cudaStream_t s,
                         const MatmulNorm* norm, int room) {
    if (n_parts < 1 || n_parts > kMaxMatmulParts) throw std::runtime_error("cuda backend: mul_mat: bad part count");
    if (m <= 0) return;
    if (norm) {
        if (!matmul_norm_prologue(t, k, m, prompt_cols, rows)) {
            throw std::logic_error("cuda backend: mul_mat: a norm prologue on a path without one");
        }
        return matmul_cores(t, parts, n_parts, k, x, xs, m, norm, room, s);
    }
    if (k % dtype_block_size(t) != 0) throw std::runtime_error("cuda backend: mul_mat: k is not a multiple of the block size");
    if (prompt_cols < 0 || prompt_cols > m) throw std::logic_error("cuda backend: mul_mat: bad prompt columns");
    // Tensor cores: chosen by the weight type and K, the backend and the kind of row, never by M or
    // by a row's neighbours, so every row of a kind takes the same computation in any batch.
    if (rows == TcRows::All) return matmul_tc(t, parts, n_parts, k, x, xs, m, scratch, s);
    if (prompt_cols > 0 && rows == TcRows::Prompt) {
        matmul_tc(t, parts, n_parts, k, x, xs, prompt_cols, scratch, s);
        if (prompt_cols == m) return;
        const std::vector<MatmulPart> rest = parts_from_column(parts, n_parts, prompt_cols);
        return matmul_cores(t, rest.data(), n_parts, k, x + prompt_cols * xs, xs, m - prompt_cols, nullptr, room, s);
    }
    matmul_cores(t, parts, n_parts, k, x, xs, m, nullptr, room, s);
}

}  // namespace cuda
}  // namespace pyspec
