// MUL_MAT on tensor cores, batch-invariant (design.md invariant 7): by default for prompt rows
// (MUL_MAT's prompt columns; faster for prefill, slower for one sequence's decode) and for every row
// of a float weight in a backend for wide batches (see matmul_tc_rows), for every row with
// PYSPEC_CUDA_TC=1, for none with PYSPEC_CUDA_TC=0. This file is the wide kernel (M > 16)
// and the settings; cuda/matmul_tc_narrow.cu computes the same outputs for M <= 16,
// cuda/matmul_tc_wgmma.cu the same outputs on Hopper's wgmma for large calls, and
// cuda/matmul_tc_fallback.cu where none of them takes the rows.
//
// What is computed. dst[n, m] = sum_k w[k, n] * x[k, m] with one mma.sync.m16n8k16 family (F32
// accumulators): the weight rows are the mma's A (rows = n, "row" layout, k contiguous), the
// activation columns its B ("col" layout, k contiguous), an output (n, m) one element of D.
//   - F16 weights: the weights as stored; activations rounded to F16 (round to nearest even).
//   - BF16 weights: the weights as stored; activations rounded to BF16 (round to nearest even, the
//     bits of core/dtype.h's fp32_to_bf16), BF16 mma.
//   - Q8_0 / Q4_0 / Q4_1 weights: each value dequantized in F32 exactly as load_elem does
//     (q * d, d * (q - 8), d * q + m with the product rounded first), then rounded to F16 (as
//     llama.cpp's dequantize-to-F16 + GEMM path does); activations rounded to F16.
//     Error per product <= 2^-10 |x w| (two F16 roundings), inside the Q8-activation bound the
//     tests hold the GPU to (tests/test_cuda_ops.py mul_mat_bound), and far inside its 6 sigma.
//   - F32 weights never come here (TF32 would break the F32 tolerance): CUDA cores.
// Known limits of F16 activations / dequantized weights: |x| > 65504 becomes inf, |x| < 2^-14 loses
// relative precision (subnormal F16); the CUDA-core path keeps activations in F32.
//
// The reduction order (why a row's bits cannot depend on its batch). Inside a 32-value tile the
// values sit in the mma's k slots by tc::tile_slot (one permutation of k for A and B). The k-chunks
// c = 0, 1, ..., ceil(K / 32) * 2 - 1 (two per 32-value tile; chunks past K are zeros, and which
// chunks those are depends on K only) fall into fixed segments of 32 chunks (tc::n_segments).
// Segment s's partial is one F32 register of one warp, set to +0.0f, then updated by one
// m16n8k16 mma per chunk of the segment in increasing c; the output is p_0 + p_1 + ... in segment
// order. Here a block owns all of K for its tile and adds each partial into a running total as its
// segment ends; the narrow kernel computes the partials in separate blocks and adds them in the
// same order (the segments depend on K only, so M never changes the sums). The
// A and B values of chunk c are the same bits whatever M is: A is a function of the weight row
// (and its type) only, B of the activation column only (a deterministic rounding of x). An mma
// computes D[i][j] from row i of A, column j of B and C[i][j] alone, the same way for every
// (i, j) (a fixed-function dot-product unit; the invariance test checks it), so where the output
// lands (which block, warp, fragment, lane or register; which launch configuration; the neighbour
// columns, including the pad columns of a partial tile, zeros or clamped copies of the last
// column) cannot change its bits. The launch configuration (tile sizes below) is chosen by the
// shape for speed only; every configuration issues the same mma shape and the same chunk sequence
// per output. M = 1 runs the same instruction as M = 512.
//
// Two implementations of that computation, with the same bits:
//   - The GEMM (k_mul_mat_tc_wide). The operands first become halves in the backend's scratch:
//     the activations once per group (k_wide_x_halves: x_pair_halves, the rounding above), and
//     block-type weights (k_wide_w_halves: load_w + w_halves, the dequantization above, the same
//     halves the other kernels build); float weights are read in place. The rows then travel to
//     shared memory unchanged, by 16-byte cp.async into a ring of 64-k stages, and a lane
//     takes its fragments with 16-byte shared loads: by tile_slot, the 16 bytes at byte 16t of a
//     row's 32-value tile are lane t's A (or B) words of both chunks of the tile, in the order the
//     mma wants them ({W.x, V.x, W.y, V.y} for chunk 0, {W.z, V.z, W.w, V.w} for chunk 1, W and V
//     the lane's rows g and g + 8; B {U.x, U.y} and {U.z, U.w}): exactly the registers ldmatrix
//     gave the first kernel from its tile_slot-permuted rows. A 64-k stage is two such tiles run
//     in order; eight stages make a segment; a last stage whose second tile lies past n_chunks(K)
//     runs only its first (a zero mma is not run: it could turn a -0 partial into +0).
//   - The first kernel (cuda/matmul_tc_fallback.cu), the fallback where the GEMM does not apply:
//     M <= 16 (the narrow kernel refused the rows), float weights not 16-byte aligned, or a scratch
//     too small.
// Speed (H200, 2026-11-30, Qwen3-4B F16 at M = 512, the x conversion included): q/k/v 78 us
// (206 TFLOP/s), o 64 (168), gate/up 212 (240), down 145 (176); the first kernel took 272, 189,
// 651 and 501 (57-78 TFLOP/s). o and down (2560 rows) give too few blocks at M = 512 for every SM
// to run at its best rate. For batches up to kWideSplitMaxM (128) K is split over blocks where the
// grid would leave SMs idle, each segment's partial stored apart and added in order by a second
// kernel (k_wide_split_sum): at M = 64 (Qwen3-4B, 64 sequences) o and down had 40 blocks for 132
// SMs; par64 6172 -> 8549 t/s on the H200.
#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>

#include "cuda/launch.cuh"
#include "cuda/matmul_tc_wide.cuh"

namespace pyspec {
namespace cuda {

namespace {

using namespace tc;

// ---- the GEMM ------------------------------------------------------------------------------
//
// Operands as halves in global memory: weight rows (float weights in place; block types
// dequantized by k_wide_w_halves), activation columns (k_wide_x_halves), k contiguous. By
// tile_slot, the 16 bytes at byte 16t of a row's 32-value tile are exactly lane t's words of the
// two chunks' fragments (see run_mmas), so the rows go to shared memory unpermuted, by 16-byte
// cp.async, and each fragment is one 16-byte shared load.

constexpr int kWK = 64;                           // k per pipeline stage: two 32-value tiles
constexpr int kWRow = kWK * 2;                    // bytes of a row per stage
constexpr int kWSegStages = kSegChunks * 16 / kWK;  // stages per K segment (8)
static_assert(kSegChunks * 16 % kWK == 0, "a segment is whole stages");

extern __shared__ __align__(128) unsigned char wide_smem[];

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

// Shared memory of k_mul_mat_tc_wide: kStages stages of [BN weight rows][kWRow] then
// [BM columns][kWRow], then the segment totals.
template <int BN, int BM, int kStages>
constexpr size_t wide_smem_bytes() {
    return static_cast<size_t>(kStages) * (BN + BM) * kWRow + static_cast<size_t>(BN) * BM * 4;
}

// Block tile BN weight rows x BM activation columns, WN x WM warps, warp (wn, wm) owning TN x TM
// mma tiles (rows wn * TN * 16 .., columns wm * TM * 8 ..); kStages-deep cp.async ring of 64-k
// stages, one barrier per stage. Rows past n and columns past m are zero-filled (computed, never
// stored), as are k values past K.
//
// Bank conflicts: the 16-byte piece q of a stored row r sits at piece q ^ 4 (r & 1). A fragment
// load's quarter warp reads pieces t (or 4 + t) of two neighbouring rows, one even and one odd,
// which so cover the 32 banks once (unswizzled 128-byte rows would put both on the same 16 banks);
// the 8 copies of a row still fill one 128-byte line.
//
// The running total p_0 + ... + p_s of each output lives in shared memory (thread-private, float4
// per mma tile, laid out so a quarter warp's accesses are contiguous): in registers beside the
// accumulators it left too few for the fragments. It is touched once per segment.
//
// Split K (partial != nullptr): block z of grid.z runs segments [z * seg_per_split, + seg_per_split)
// only and stores each segment's partial p_s apart, at partial[(s * m + c) * (gridDim.y * BN) + row]
// (row: tile * BN + the row in the tile); k_wide_split_sum then adds them in segment order and
// stores the outputs. The same accumulators, the same adds in the same order: the same bits.
template <bool kBF16, int BN, int BM, int WN, int WM, int kStages, int kMinBlocks>
__global__ void __launch_bounds__(WN * WM * 32, kMinBlocks)
    k_mul_mat_tc_wide(WideParts p, int64_t k, const uint16_t* __restrict__ xh, int64_t m, int seg_per_split,
                      float* __restrict__ partial) {
    pdl_enter();
    constexpr int kThreads = WN * WM * 32;
    constexpr int TN = BN / (WN * 16), TM = BM / (WM * 8);
    constexpr int kPass = kThreads / 8;  // rows one round of copies covers (8 pieces per row)
    constexpr int kACopies = BN / kPass, kBCopies = BM / kPass;
    constexpr int kStageBytes = (BN + BM) * kWRow;
    static_assert(TN * WN * 16 == BN && TM * WM * 8 == BM, "whole mma tiles per warp");
    static_assert(kACopies * kPass == BN && kBCopies * kPass == BM && kPass % 2 == 0, "whole copy rounds");
    static_assert(kACopies <= 32 && kBCopies <= 32, "a bit per copied row");

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wn = warp % WN, wm = warp / WN;
    const int tile = static_cast<int>(blockIdx.y);
    const int j = wide_part_of(p, tile);
    const int64_t n = pick(p.n, j), n0 = static_cast<int64_t>(tile - pick(p.tile0, j)) * BN;
    const int64_t m0 = static_cast<int64_t>(blockIdx.x) * BM;
    // This block's stages [st_begin, st_end): all of K, or its split's segments.
    const int n_stages_k = static_cast<int>((k + kWK - 1) / kWK);
    const int st_begin = partial ? static_cast<int>(blockIdx.z) * seg_per_split * kWSegStages : 0;
    const int st_end = partial ? min(n_stages_k, st_begin + seg_per_split * kWSegStages) : n_stages_k;
    const int n_stages = st_end - st_begin;  // local stage ls is stage st_begin + ls of K
    const char* const a_base = pick(p.a, j);
    const int64_t ars = pick(p.ars, j);

    // Copies: this thread moves piece q = tid % 8 of rows tid / 8 + i * kPass (all of one parity).
    // Rows past the end read nothing (zeros); their address is kept in bounds anyway.
    const int q = tid & 7, r0 = tid >> 3;
    const uint32_t smem0 = smem_addr(wide_smem);
    const uint32_t st_off = smem0 + static_cast<uint32_t>(r0 * kWRow + ((q ^ ((r0 & 1) << 2)) << 4));
    const char* const a_src = a_base + (n0 + r0) * ars + q * 16;
    const int64_t a_step = kPass * ars;
    const char* const b_src = reinterpret_cast<const char*>(xh + (m0 + r0) * k + q * 8);
    const int64_t b_step = kPass * k * 2;
    uint32_t a_rows = 0, b_rows = 0;  // which of this thread's rows exist, a bit each
#pragma unroll
    for (int i = 0; i < kACopies; ++i) a_rows |= (n0 + r0 + i * kPass < n ? 1u : 0u) << i;
#pragma unroll
    for (int i = 0; i < kBCopies; ++i) b_rows |= (m0 + r0 + i * kPass < m ? 1u : 0u) << i;

    auto load_stage = [&](int slot, int st) {
        const uint32_t base = st_off + static_cast<uint32_t>(slot * kStageBytes);
        const int64_t koff = static_cast<int64_t>(st) * kWRow;
        const bool in_k = static_cast<int64_t>(st) * kWK + q * 8 < k;  // K % 8 == 0: a piece is all in or all out
#pragma unroll
        for (int i = 0; i < kACopies; ++i) {
            const bool v = in_k && ((a_rows >> i) & 1u);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(base + i * kPass * kWRow),
                         "l"(v ? a_src + i * a_step + koff : a_base), "r"(v ? 16 : 0)
                         : "memory");
        }
#pragma unroll
        for (int i = 0; i < kBCopies; ++i) {
            const bool v = in_k && ((b_rows >> i) & 1u);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(base + (BN + i * kPass) * kWRow),
                         "l"(v ? b_src + i * b_step + koff : reinterpret_cast<const char*>(xh)), "r"(v ? 16 : 0)
                         : "memory");
        }
    };

    // Fragments: lane (g, t) = (lane / 4, lane % 4) reads piece t (tile h = 0 of the stage) or 4 + t
    // (h = 1) of rows g and g + 8 of each m16 tile and of column g of each n8 tile; all of them have
    // g's parity, so one swizzled offset per h serves all.
    const int g = lane >> 2, t = lane & 3;
    const uint32_t fr_off = static_cast<uint32_t>(g * kWRow + ((t ^ ((g & 1) << 2)) << 4));
    const uint32_t a_fr = static_cast<uint32_t>(wn * TN * 16 * kWRow), b_fr = static_cast<uint32_t>((BN + wm * TM * 8) * kWRow);
    float4* const tot = reinterpret_cast<float4*>(wide_smem + kStages * kStageBytes) + tid;  // [TN * TM][kThreads]

    float acc[TN][TM][4];
#pragma unroll
    for (int i = 0; i < TN; ++i) {
#pragma unroll
        for (int jj = 0; jj < TM; ++jj) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][jj][e] = 0.0f;
        }
    }

    // A 32-value tile's fragments (h: which tile of the stage) and its mmas: chunk 2 (2 st + h) for
    // the whole warp tile, then chunk 2 (2 st + h) + 1, so an accumulator's two mmas are TN * TM
    // apart and their latency hides behind the others.
    struct Frags {
        uint4 b[TM], w0[TN], w1[TN];  // column g of each n8 tile; rows g and g + 8 of each m16 tile
    };
    auto load_frags = [&](Frags& f, uint32_t sbase, int h) {
        const uint32_t off = sbase + (fr_off ^ static_cast<uint32_t>(h << 6));
#pragma unroll
        for (int jj = 0; jj < TM; ++jj) f.b[jj] = lds128(off + b_fr + jj * 8 * kWRow);
#pragma unroll
        for (int i = 0; i < TN; ++i) {
            f.w0[i] = lds128(off + a_fr + i * 16 * kWRow);
            f.w1[i] = lds128(off + a_fr + (i * 16 + 8) * kWRow);
        }
    };
    auto run_mmas = [&](const Frags& f) {
#pragma unroll
        for (int i = 0; i < TN; ++i) {
            const uint32_t c0[4] = {f.w0[i].x, f.w1[i].x, f.w0[i].y, f.w1[i].y};  // stored pairs 4t, 4t + 1
#pragma unroll
            for (int jj = 0; jj < TM; ++jj) {
                const uint32_t b0[2] = {f.b[jj].x, f.b[jj].y};
                mma16816<kBF16>(acc[i][jj], c0, b0);
            }
        }
#pragma unroll
        for (int i = 0; i < TN; ++i) {
            const uint32_t c1[4] = {f.w0[i].z, f.w1[i].z, f.w0[i].w, f.w1[i].w};  // stored pairs 4t + 2, 4t + 3
#pragma unroll
            for (int jj = 0; jj < TM; ++jj) {
                const uint32_t b1[2] = {f.b[jj].z, f.b[jj].w};
                mma16816<kBF16>(acc[i][jj], c1, b1);
            }
        }
    };
    // After the last segment the outputs stay in acc for the stores. Split: segment seg's partial
    // goes to its place in `partial` instead.
    auto end_segment = [&](bool first, bool last, int seg) {
        if (partial) {
            const int64_t pitch = static_cast<int64_t>(gridDim.y) * BN;
#pragma unroll
            for (int i = 0; i < TN; ++i) {
#pragma unroll
                for (int jj = 0; jj < TM; ++jj) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int64_t row = static_cast<int64_t>(tile) * BN + wn * TN * 16 + i * 16 + g + (e >> 1) * 8;
                        const int64_t c = m0 + wm * TM * 8 + jj * 8 + 2 * t + (e & 1);
                        if (c < m) partial[(static_cast<int64_t>(seg) * m + c) * pitch + row] = acc[i][jj][e];
                        acc[i][jj][e] = 0.0f;
                    }
                }
            }
            return;
        }
#pragma unroll
        for (int i = 0; i < TN; ++i) {
#pragma unroll
            for (int jj = 0; jj < TM; ++jj) {
                float* a4 = acc[i][jj];
                float4 v = make_float4(a4[0], a4[1], a4[2], a4[3]);
                if (!first) {  // p_0 as is, then the adds in segment order
                    const float4 o = tot[(i * TM + jj) * kThreads];
                    v = make_float4(__fadd_rn(o.x, a4[0]), __fadd_rn(o.y, a4[1]), __fadd_rn(o.z, a4[2]),
                                    __fadd_rn(o.w, a4[3]));
                }
                if (last) {
                    a4[0] = v.x; a4[1] = v.y; a4[2] = v.z; a4[3] = v.w;
                } else {
                    tot[(i * TM + jj) * kThreads] = v;
                    a4[0] = 0.0f; a4[1] = 0.0f; a4[2] = 0.0f; a4[3] = 0.0f;
                }
            }
        }
    };

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < n_stages) load_stage(s, st_begin + s);
        cp_async_commit();
    }
    // Software-pipelined: a tile's fragments are loaded while the previous tile's mmas run,
    // across stage boundaries too (the barrier for stage st + 1 comes before stage st's
    // second tile, whose fragments are already in registers).
    static_assert(kStages >= 3, "the next stage is waited for while the current one is in use");
    cp_async_wait<kStages - 2>();
    __syncthreads();
    Frags f0, f1;
    load_frags(f0, smem0, 0);
    for (int ls = 0; ls < n_stages; ++ls) {
        const int st = st_begin + ls;  // the stage of K
        const uint32_t cur = smem0 + static_cast<uint32_t>((ls % kStages) * kStageBytes);
        // Tile 1 of the last stage may lie past the row's last chunk (n_chunks): skipped, not
        // run as zeros, so every output gets exactly n_chunks(K) mmas.
        const bool two = static_cast<int64_t>(st) * kWK + 32 < k;
        load_frags(f1, cur, 1);
        run_mmas(f0);
        if (ls + 1 < n_stages) {
            cp_async_wait<kStages - 3>();  // stage ls + 1 has landed (this thread's copies)
            __syncthreads();  // everyone's; and every fragment of stage ls - 1 has been read
            const int nx = ls + kStages - 1;
            if (nx < n_stages) load_stage(nx % kStages, st_begin + nx);
            cp_async_commit();
            load_frags(f0, smem0 + static_cast<uint32_t>(((ls + 1) % kStages) * kStageBytes), 0);
        }
        if (two) run_mmas(f1);
        const bool last = ls + 1 == n_stages;
        if (last || (st + 1) % kWSegStages == 0) end_segment(st < kWSegStages, last, st / kWSegStages);
    }
    cp_async_wait<0>();  // only empty groups remain; nothing may be in flight at exit
    if (partial) return;  // k_wide_split_sum stores

    // D fragment: e = 0, 1 at row g, columns 2t + {0, 1}; e = 2, 3 at row g + 8.
    const WideOut out(p, j);
#pragma unroll
    for (int i = 0; i < TN; ++i) {
#pragma unroll
        for (int jj = 0; jj < TM; ++jj) {
            const int64_t row = n0 + wn * TN * 16 + i * 16 + g;
            const int64_t col = m0 + wm * TM * 8 + jj * 8 + 2 * t;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int64_t r = row + (e >> 1) * 8, c = col + (e & 1);
                if (r < n && c < m) out.store(r, c, acc[i][jj][e]);
            }
        }
    }
}

// The outputs of a split launch: output (row, c) is p_0 + p_1 + ... + p_{n_seg - 1} added in
// segment order, as k_mul_mat_tc_wide adds them unsplit, plus the residual, stored as it stores.
// Thread x of block (x, c): padded row blockIdx.x * blockDim.x + x (tile * bn + the row in it).
__global__ void __launch_bounds__(256) k_wide_split_sum(WideParts p, int bn, int n_seg, int64_t m,
                                                        const float* __restrict__ partial) {
    pdl_enter();
    const int64_t pitch = static_cast<int64_t>(p.tile0[p.np]) * bn;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t c = blockIdx.y;
    if (row >= pitch) return;
    const int tile = static_cast<int>(row / bn);
    const int j = wide_part_of(p, tile);
    const int64_t r = static_cast<int64_t>(tile - pick(p.tile0, j)) * bn + row % bn;
    if (r >= pick(p.n, j)) return;
    float v = partial[c * pitch + row];
    for (int s = 1; s < n_seg; ++s) v = __fadd_rn(v, partial[(s * m + c) * pitch + row]);
    WideOut(p, j).store(r, c, v);
}

// ---- the operands as halves ------------------------------------------------------------------

// The layouts the GEMMs read their converted operands in: in order (the mma.sync GEMM), arranged
// (the cp.async-fed wgmma GEMM: arranged_index) or in slot order (the TMA-fed wgmma GEMM's
// activations: pair pp of a 32-value tile at k slot tile_slot(pp)).
enum class Halves { InOrder, Arranged, Slots };

// Stores the 8 halves of values 8 i .. 8 i + 7 of a row in layout L (lo: values 8 i .. 8 i + 3).
template <Halves L>
__device__ __forceinline__ void store_halves8(uint16_t* out, int64_t i, uint2 lo, uint2 hi) {
    if constexpr (L == Halves::Arranged) {
        *reinterpret_cast<uint2*>(out + arranged_index(8 * i)) = lo;
        *reinterpret_cast<uint2*>(out + arranged_index(8 * i + 4)) = hi;
    } else if constexpr (L == Halves::Slots) {
        uint16_t* tile = out + (i >> 2) * 32;
        const int q = static_cast<int>(i & 3);  // pairs 4q .. 4q + 3 of the tile
        *reinterpret_cast<uint32_t*>(tile + tile_slot(4 * q)) = lo.x;
        *reinterpret_cast<uint32_t*>(tile + tile_slot(4 * q + 1)) = lo.y;
        *reinterpret_cast<uint32_t*>(tile + tile_slot(4 * q + 2)) = hi.x;
        *reinterpret_cast<uint32_t*>(tile + tile_slot(4 * q + 3)) = hi.y;
    } else {
        *reinterpret_cast<uint4*>(out + 8 * i) = make_uint4(lo.x, lo.y, hi.x, hi.y);
    }
}

// Activation column c as the mma's halves: x_pair_halves of each value pair, the rounding every
// kernel applies; at xh[c * k ..] in order (the mma.sync GEMM), or in the wgmma GEMMs' layouts at
// xh[c * arranged_pitch(k) ..] with a zero tail. Blocks (c, 0 ..) of the grid = column c, each
// a share of its 8-value pieces: with one block a column, a prompt pass's 512 columns kept an SM
// a quarter full of threads (5.2 us to convert 512 x 2560 values on the H200).
template <DType T, Halves L>
__global__ void __launch_bounds__(128) k_wide_x_halves(const float* __restrict__ x, int64_t xs, bool vec, int64_t k,
                                                       uint16_t* __restrict__ xh) {
    pdl_enter();
    const int64_t pitch = L == Halves::InOrder ? k : arranged_pitch(k);
    const float* col = x + static_cast<int64_t>(blockIdx.x) * xs;
    uint16_t* out = xh + static_cast<int64_t>(blockIdx.x) * pitch;
    const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.y;
    for (int64_t i = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < pitch / 8; i += step) {
        const bool in_k = 8 * i < k;  // K % 8 == 0
        const float4 lo = load_x4(col, 8 * i, in_k, vec), hi = load_x4(col, 8 * i + 4, in_k, vec);
        store_halves8<L>(out, i, x_halves<T>(lo), x_halves<T>(hi));
    }
}

// Rows [row0[j], row0[j + 1]) of the output are rows first[j] .. of part j's weights.
struct WideSrc {
    const char* w[kMaxMatmulParts];
    int64_t rb[kMaxMatmulParts];
    int64_t row0[kMaxMatmulParts + 1];
    int np;
};

// Block-type weight rows as the halves the mma reads (w_halves, the conversion every kernel
// uses), row r at wh[r * k ..], in order or arranged (K % 32 == 0). Block r of the grid = row r.
template <DType T, Halves L>
__global__ void __launch_bounds__(128) k_wide_w_halves(WideSrc src, int64_t k, uint16_t* __restrict__ wh) {
    pdl_enter();
    const int64_t r = blockIdx.x;
    int j = 0;
#pragma unroll
    for (int i = 1; i < kMaxMatmulParts; ++i) j += (i < src.np && r >= src.row0[i]) ? 1 : 0;
    const char* row = pick(src.w, j) + (r - pick(src.row0, j)) * pick(src.rb, j);
    uint16_t* out = wh + r * k;
    for (int64_t i = threadIdx.x; i < k / 8; i += blockDim.x) {
        const WRaw raw = load_w<T>(row, i, true, false);
        const uint4 h = w_halves<T>(raw, static_cast<int>(i & 3));
        store_halves8<L>(out, i, make_uint2(h.x, h.y), make_uint2(h.z, h.w));
    }
}

// ---- launch ----------------------------------------------------------------------------------

// Block types are dequantized into the scratch at most this many halves at a time (128 MB), the
// GEMM running over each piece in turn; float weights are read where they are.
constexpr int64_t kWideWeightHalves = int64_t{1} << 26;
constexpr int64_t kWideMaxBN = 128;  // the largest row tile (the wgmma GEMM's; the mma.sync GEMM's is 64)

bool wide_dequantizes(DType t) { return t == DType::Q8_0 || t == DType::Q4_0 || t == DType::Q4_1; }

// The most weight rows one piece holds (a multiple of the largest row tile).
int64_t wide_piece_rows(int64_t k) {
    return std::max<int64_t>(kWideMaxBN, kWideWeightHalves / k / kWideMaxBN * kWideMaxBN);
}

// One launch configuration of k_mul_mat_tc_wide.
template <bool kBF16, int BN, int BM, int WN, int WM, int kStages, int kMinBlocks>
struct WideConfig {
    static constexpr int kBN = BN, kBM = BM, kThreads = WN * WM * 32;
    static constexpr size_t kSmem = wide_smem_bytes<BN, BM, kStages>();
    static constexpr auto kernel = k_mul_mat_tc_wide<kBF16, BN, BM, WN, WM, kStages, kMinBlocks>;
    // Blocks per SM as the driver places them (asked once; the shared memory opt-in first).
    static int blocks_per_sm() {
        static const int b = resident_blocks(kernel, kThreads, kSmem);
        return b;
    }
    // K is split (k_mul_mat_tc_wide's split) where the grid would leave SMs idle: small batches
    // (m <= kWideSplitMaxM) over matrices of few row tiles (Qwen3-4B's o and down at M = 64: 40
    // blocks on 132 SMs), into as many splits of whole segments as fill the GPU once.
    static void run(const WideParts& p, int64_t k, const uint16_t* xh, int64_t m, const SplitScratch& ws,
                    cudaStream_t s) {
        launch_wide(kernel, kThreads, kSmem, blocks_per_sm(), BN, BM, p, k, xh, m, ws, s);
    }
};

// The launch configurations (speed only: each runs every output's mma sequence unchanged), with
// the rate of a GPU full of their blocks (H200, 2026-11-30, Qwen3-4B's F16 shapes at M = 2048, in
// TFLOP/s), registers a thread (no spills) and shared memory a block:
//   T: 64 rows x 128 columns, 4 warps of 32 x 64, 3 stages: 210 registers, 104 KB, two blocks
//      per SM (252).
//   S: 64 x 64, 4 warps of 32 x 32, 3 stages: 152 registers, 64 KB, three blocks per SM (232).
//   D: S with 4 stages: 156 registers, 80 KB, two blocks per SM (207); the deeper ring wins where
//      the grid leaves SMs a single block (M = 128: Qwen3's o and down 1.4x faster than S).
// Measured and dropped: 128 x 128 blocks of 8 warps (64 x 32 or 32 x 64 warp tiles, 4 stages:
// 212-246; fewer, larger blocks to spread), 256 x 128 of 8 warps of 64 x 64 (the totals take
// 128 KB, leaving room for 2 stages: the best at M = 2048, 263-270, the worst at M <= 512),
// 128 x 64 (233), and the same kernels without the fragment pipelining (T: 10-15% slower).
// Not the loads: ncu (the 128 x 128 configuration) shows no bank conflicts, the shared-memory pipe
// 35% busy and the tensor pipe 36%, the top stall a fixed-latency dependency (32% of the cycles
// between a warp's instructions); on Hopper the wgmma GEMM (cuda/matmul_tc_wgmma.cu) takes the large calls.
template <bool kBF16>
struct WideConfigs {
    using T = WideConfig<kBF16, 64, 128, 2, 2, 3, 2>;
    using S = WideConfig<kBF16, 64, 64, 2, 2, 3, 3>;
    using D = WideConfig<kBF16, 64, 64, 2, 2, 4, 2>;
};

// The configuration whose last wave ends first: waves of (SMs x blocks per SM) blocks, each wave
// taking (blocks per SM x block tile) / rate on an SM.
template <bool kBF16>
void wide_gemm(const MatmulPart* parts, int n_parts, int64_t r0, int64_t r1, const char* a, int64_t ars, int64_t k,
               const uint16_t* xh, int64_t m, const SplitScratch& ws, cudaStream_t s) {
    using C = WideConfigs<kBF16>;
    const int sms = sm_count();
    auto cost = [&](auto cfg, double rate) {
        using Cfg = decltype(cfg);
        const WideParts p = wide_parts(parts, n_parts, r0, r1, a, ars, Cfg::kBN);
        const int64_t blocks = static_cast<int64_t>(p.tile0[p.np]) * ((m + Cfg::kBM - 1) / Cfg::kBM);
        const int64_t slots = static_cast<int64_t>(sms) * Cfg::blocks_per_sm();
        const int64_t waves = (blocks + slots - 1) / slots;
        return static_cast<double>(waves) * Cfg::blocks_per_sm() * Cfg::kBN * Cfg::kBM / rate;
    };
    const double ct = cost(typename C::T{}, 252.0), cs = cost(typename C::S{}, 232.0), cd = cost(typename C::D{}, 207.0);
    if (ct <= cs && ct <= cd) {
        C::T::run(wide_parts(parts, n_parts, r0, r1, a, ars, C::T::kBN), k, xh, m, ws, s);
    } else if (cs <= cd) {
        C::S::run(wide_parts(parts, n_parts, r0, r1, a, ars, C::S::kBN), k, xh, m, ws, s);
    } else {
        C::D::run(wide_parts(parts, n_parts, r0, r1, a, ars, C::D::kBN), k, xh, m, ws, s);
    }
}

template <DType T>
void wide_typed(const MatmulPart* parts, int n_parts, int64_t rows, int64_t k, const float* x, int64_t xs, int64_t m,
                const SplitScratch& ws, cudaStream_t s) {
    constexpr bool kBF16 = T == DType::BF16;
    uint16_t* xh = ws.halves;
    const bool x_vec = reinterpret_cast<uintptr_t>(x) % 16 == 0 && xs % 4 == 0;
    // The wgmma GEMM where the GPU has it (the same bits; cuda/matmul_tc_wgmma.cu), fed by TMA where
    // it can be (its activations in slot order, cuda/matmul_tc_tma.cu), else by cp.async (arranged).
    const bool wg = wgmma_gemm_suits(parts, n_parts, rows, k, m), tma = wg && wgmma_tma_ready();
    const dim3 cols(static_cast<unsigned>(m), static_cast<unsigned>(std::min<int64_t>(8, (arranged_pitch(k) / 8 + 127) / 128)));
    if (tma) {
        launch(k_wide_x_halves<T, Halves::Slots>, cols, 128, 0, s, x, xs, x_vec, k, xh);
    } else if (wg) {
        launch(k_wide_x_halves<T, Halves::Arranged>, cols, 128, 0, s, x, xs, x_vec, k, xh);
    } else {
        launch(k_wide_x_halves<T, Halves::InOrder>, cols, 128, 0, s, x, xs, x_vec, k, xh);
    }
    auto gemm = [&](int64_t r0, int64_t r1, const char* a, int64_t ars) {
        if (wg) return wgmma_gemm(kBF16, parts, n_parts, r0, r1, a, ars, k, xh, m, ws, s);
        wide_gemm<kBF16>(parts, n_parts, r0, r1, a, ars, k, xh, m, ws, s);
    };
    if constexpr (T == DType::F16 || T == DType::BF16) {
        // Grid.y holds at most 65535 row tiles (of 64 rows or more, plus a partial one per part).
        const int64_t piece = int64_t{1} << 21;
        for (int64_t r0 = 0; r0 < rows; r0 += piece) gemm(r0, std::min(rows, r0 + piece), nullptr, 0);
    } else {
        uint16_t* wh = ws.halves + m * arranged_pitch(k);
        // Pieces of equal size (whole row tiles), none above the cap matmul_tc_wide_scratch reserves.
        const int64_t cap = wide_piece_rows(k);
        const int64_t n_pieces = (rows + cap - 1) / cap;
        const int64_t even = ((rows + n_pieces - 1) / n_pieces + kWideMaxBN - 1) / kWideMaxBN * kWideMaxBN;
        const int64_t per = std::min(cap, even);
        for (int64_t r0 = 0; r0 < rows; r0 += per) {
            const int64_t r1 = std::min(rows, r0 + per);
            WideSrc src{};
            int64_t base = 0;
            src.row0[0] = 0;
            for (int j = 0; j < n_parts; ++j) {
                const int64_t nr = std::max<int64_t>(0, parts[j].n_rows);
                const int64_t lo = std::max(r0, base), hi = std::min(r1, base + nr);
                if (lo < hi) {
                    const int i = src.np++;
                    src.w[i] = static_cast<const char*>(parts[j].w) + (lo - base) * static_cast<int64_t>(parts[j].row_bytes);
                    src.rb[i] = static_cast<int64_t>(parts[j].row_bytes);
                    src.row0[i + 1] = src.row0[i] + (hi - lo);
                }
                base += nr;
            }
            const dim3 rws(static_cast<unsigned>(r1 - r0));
            if (wg && !tma) {
                launch(k_wide_w_halves<T, Halves::Arranged>, rws, 128, 0, s, src, k, wh);
            } else {
                launch(k_wide_w_halves<T, Halves::InOrder>, rws, 128, 0, s, src, k, wh);
            }
            gemm(r0, r1, reinterpret_cast<const char*>(wh), k * 2);
        }
    }
}

}  // namespace

namespace tc {

int sm_count() {
    static const int n = [] {
        int dev = 0, v = 0;
        if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
            return 132;
        }
        return v > 0 ? v : 132;
    }();
    return n;
}

// The parts of rows [r0, r1) of a group (its parts' rows concatenated) for a configuration of
// row tile bn: weight row i of the piece at a + (i - r0) * ars where a is not null (the
// dequantized piece), else in place.
WideParts wide_parts(const MatmulPart* parts, int n_parts, int64_t r0, int64_t r1, const char* a, int64_t ars, int bn) {
    WideParts p{};
    p.tile0[0] = 0;
    int64_t base = 0;
    for (int j = 0; j < n_parts; ++j) {
        const MatmulPart& q = parts[j];
        const int64_t nr = std::max<int64_t>(0, q.n_rows);
        const int64_t lo = std::max(r0, base), hi = std::min(r1, base + nr);
        if (lo < hi) {
            const int i = p.np++;
            const int64_t off = lo - base;  // the piece's first row in this part
            p.a[i] = a ? a + (lo - r0) * ars : static_cast<const char*>(q.w) + off * static_cast<int64_t>(q.row_bytes);
            p.ars[i] = a ? ars : static_cast<int64_t>(q.row_bytes);
            p.n[i] = hi - lo;
            p.y[i] = q.y + off;
            p.ys[i] = q.y_stride;
            p.add[i] = q.add ? q.add + off : nullptr;
            p.as[i] = q.add_stride;
            p.tile0[i + 1] = p.tile0[i] + static_cast<int>((hi - lo + bn - 1) / bn);
        }
        base += nr;
    }
    return p;
}

WideSplit wide_split(int64_t m, int64_t tiles, int bn, int bm, int64_t slots, int64_t k, const SplitScratch& ws) {
    const int64_t blocks = ((m + bm - 1) / bm) * tiles;
    const int n_seg = static_cast<int>(n_segments(k));
    WideSplit sp{n_seg, 1};
    if (m <= kWideSplitMaxM && n_seg > 1 && blocks < slots && ws.partial &&
        static_cast<size_t>(n_seg) * static_cast<size_t>(m * tiles * bn) <= ws.partial_floats) {
        const int64_t want = std::min<int64_t>(n_seg, (slots + blocks - 1) / blocks);
        sp.per = static_cast<int>((n_seg + want - 1) / want);
        sp.splits = (n_seg + sp.per - 1) / sp.per;
    }
    return sp;
}

void launch_wide_split_sum(const WideParts& p, int bn, int n_seg, int64_t m, const float* partial, cudaStream_t s) {
    const int64_t tiles = p.tile0[p.np];
    const dim3 grid(static_cast<unsigned>((tiles * bn + 255) / 256), static_cast<unsigned>(m));
    launch(k_wide_split_sum, grid, 256, 0, s, p, bn, n_seg, m, partial);
}

}  // namespace tc

int matmul_tc_setting() { return env_switch("PYSPEC_CUDA_TC"); }

bool matmul_tc_supports(DType t, int64_t k) {
    switch (t) {
        case DType::F16:
        case DType::BF16: return k % 8 == 0;
        case DType::Q8_0:
        case DType::Q4_0:
        case DType::Q4_1: return k % QK == 0;
        default: return false;
    }
}

// Every row on tensor cores with PYSPEC_CUDA_TC=1, none with 0. By default the prompt columns, and
// every row of a float weight in a backend for wide batches. Measured on the H200 (2026-11-30,
// bench_cuda.py; ncu per kernel): one sequence decodes faster on the CUDA cores (Qwen3-4B F16
// tg128 272-277 against 229-231 t/s: the narrow float kernel takes 22.5 us a MUL_MAT on average,
// the CUDA-core kernels 17.8; SmolLM2 Q4_1 858-952 against 502, 10.9 us a call against 4.3), and 64
// sequences far slower (Qwen3-4B par64 2315-2345 against 6154 t/s: at M = 64 the CUDA-core kernel
// is compute-bound, 172 us a MUL_MAT against 52 for the wide tensor-core GEMM). Earlier attempts to
// bring the narrow float kernel to the CUDA cores' bandwidth (registers instead of staging, 1024-value
// segments, the whole segment's loads issued before the wait on the previous kernel, two batches in
// flight) all measured within 1% of each other.
TcRows matmul_tc_rows(int setting, DType t, int64_t k, bool wide_batches) {
    if (!matmul_tc_supports(t, k) || setting == 0) return TcRows::None;
    if (setting == 1) return TcRows::All;
    const bool floats = t == DType::F16 || t == DType::BF16;
    return wide_batches && floats ? TcRows::All : TcRows::Prompt;
}

bool matmul_tc_prompt_path() { return matmul_tc_setting() == -1; }

SplitScratchNeed matmul_tc_wide_scratch(DType t, int64_t k, int64_t rows, int64_t m) {
    SplitScratchNeed need;
    if (m <= kMatmulTcNarrowMaxM || rows <= 0 || k <= 0 || !matmul_tc_supports(t, k)) return need;
    const int64_t w = wide_dequantizes(t) ? std::min(rows, wide_piece_rows(k)) * k : 0;
    need.n_halves = static_cast<size_t>(m * arranged_pitch(k) + w);  // either GEMM's activations
    if (m <= kWideSplitMaxM && n_segments(k) > 1) {  // split K: every segment's partials, tiles padded
        const int64_t padded = rows + kMaxMatmulParts * kWideMaxBN;
        need.partial_floats = static_cast<size_t>(n_segments(k) * m * padded);
    }
    return need;
}

void launch_matmul_tc_wide(DType t, const MatmulPart* parts, int n_parts, int64_t k, const float* x, int64_t xs,
                           int64_t m, const SplitScratch& ws, cudaStream_t s) {
    if (n_parts < 1 || n_parts > kMaxMatmulParts) throw std::runtime_error("cuda backend: mul_mat (tensor cores): bad part count");
    if (!matmul_tc_supports(t, k)) throw std::runtime_error("cuda backend: mul_mat (tensor cores): unsupported type or K");
    int64_t rows = 0;
    for (int j = 0; j < n_parts; ++j) rows += std::max<int64_t>(0, parts[j].n_rows);
    if (m <= 0 || rows == 0) return;
    const bool floats = t == DType::F16 || t == DType::BF16;
    bool gemm = m > kMatmulTcNarrowMaxM && k > 0 && reinterpret_cast<uintptr_t>(x) % 4 == 0 && ws.halves &&
                ws.n_halves >= matmul_tc_wide_scratch(t, k, rows, m).n_halves;
    for (int j = 0; j < n_parts && floats; ++j) {  // cp.async reads 16-byte pieces of the rows in place
        gemm = gemm && reinterpret_cast<uintptr_t>(parts[j].w) % 16 == 0 && parts[j].row_bytes % 16 == 0;
    }
    if (gemm) {
        switch (t) {
            case DType::F16: return wide_typed<DType::F16>(parts, n_parts, rows, k, x, xs, m, ws, s);
            case DType::BF16: return wide_typed<DType::BF16>(parts, n_parts, rows, k, x, xs, m, ws, s);
            case DType::Q8_0: return wide_typed<DType::Q8_0>(parts, n_parts, rows, k, x, xs, m, ws, s);
            case DType::Q4_0: return wide_typed<DType::Q4_0>(parts, n_parts, rows, k, x, xs, m, ws, s);
            case DType::Q4_1: return wide_typed<DType::Q4_1>(parts, n_parts, rows, k, x, xs, m, ws, s);
            default: break;
        }
    }
    // The fallback (cuda/matmul_tc_fallback.cu), part by part.
    for (int j = 0; j < n_parts; ++j) launch_first_kernel(t, parts[j], k, x, xs, m, s);
}

}  // namespace cuda
}  // namespace pyspec
