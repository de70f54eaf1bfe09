// Attention of prompt rows on tensor cores (flash-attention style): ATTENTION's rows r < prompt_rows
// (core/graph.h; rows that want no logits) when the default setting gives prompt rows their own path
// (matmul_tc_prompt_path). Output rows keep the CUDA-core kernels (ops_attention*.cu) and their bits.
//
// What it computes. A block takes kv head g, up to four of its query heads and a tile of 16 or more
// prompt rows; a warp owns one query head over 16 rows of the tile (the m16 rows of every mma). The
// cells are walked in blocks of kCells by ABSOLUTE index (block b holds cells 64b .. 64b + 63), in
// increasing b, visiting the blocks that hold an unmasked cell of some row of the tile. Per block:
//   S = Q K^T      mma.sync m16n8k16, Q rounded to F16 once, K as stored (F16), F32 accumulators
//                  from +0, the head dim's 16-wide chunks in increasing order;
//   s = mask == -inf ? -inf : fmaf(S, scale, mask)      (cells outside the row's span: -inf)
//   per (row, head): mx = the block's max s; when mx == -inf nothing changes (below), else
//   m' = max(m, mx), corr = exp(m - m'), p = s == -inf ? 0 : exp(s - m'),
//   l' = fmaf(l, corr, sum p)  (the lane's 16 p in cell order, then the quad's butterfly),
//   pv = P V       P rounded to F16, mma.sync from +0 over the block's four 16-cell chunks in order,
//   acc' = fmaf(acc, corr, pv).
// The row's output is acc * (l > 0 ? 1 / l : 0), a zero stored as +0.
//
// Why a row's bits are its own (invariant 7, for prompt rows; the tests: tests/test_cuda_ops.py
// test_prompt_rows_attention_*): every mma output element is a function of its own row of the A
// operand and column of B, so a row's scores depend on its q and the K rows of its cells only, and
// its P V on its p and V rows; which rows share the tile never enters. The blocks follow absolute
// cell indices, the same for every row, and a block in which the row has no unmasked cell (fully
// masked, or outside its span but needed by a tile-mate of another sequence or position) leaves
// its (m, l, acc) as they were: selected, never recomputed, so not even a zero's sign changes. A
// masked cell's p is 0 exactly, so its product with V is a zero whatever V holds; V and K rows that
// no row of the tile may read (outside every row's first..last unmasked cell, or past the cache)
// are zero-filled, never read. The one thing tile-mates can change is the sign of such a zero
// product (V's sign, or 0 from the zero fill), which reaches the output only when the row's whole
// sum for that element is zero; storing every zero as +0 removes it. A row whose span leaves the
// cache gets zeros and the error bit, as in the other kernels. The row tile, the warps and the
// number of rows are launch choices that change no row's operations.
//
// Performance: K, V and the tile's mask values of the next block are copied by cp.async into the
// second of two shared-memory stages while this block is computed; blocks no row of the tile needs
// (a causal chunk's upper triangle, the gap between two sequences' cells) are never visited.
#include <climits>
#include <mutex>
#include <stdexcept>

#include "cuda/async_copy.cuh"
#include "cuda/attention_common.cuh"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "cuda/matmul_tc_common.cuh"

namespace pyspec {
namespace cuda {
namespace {

constexpr int kCells = 64;        // cells per block, by absolute index
constexpr int kPad = 8;           // halves after each staged K/V row: ldmatrix rows land in distinct banks
constexpr int kMaskStride = 72;   // floats per staged mask row: the lanes' float2 reads are conflict-free
constexpr int kMaxWarps = 4;      // warps per block (a query head over 16 rows each)
constexpr int kStages = 2;
constexpr int64_t kNoBlock = LLONG_MAX;

// How a kv head's query heads and the prompt rows are cut into blocks: `heads` query heads per block
// (slices blocks per kv head when the group has more), 16 * row_groups rows per tile. A function of
// the group size only; which rows share a tile never changes a row's bits anyway.
struct Tiling {
    int n_rep;
    int heads;
    int row_groups;
    int slices;
};

Tiling tiling_for(int n_rep) {
    Tiling t;
    t.n_rep = n_rep;
    t.heads = n_rep < kMaxWarps ? n_rep : kMaxWarps;
    t.row_groups = kMaxWarps / t.heads;
    t.slices = (n_rep + t.heads - 1) / t.heads;
    return t;
}

// Shared memory: per tile row its first and last unmasked cell and its base (int64 each); then per
// stage the block's K rows and V rows [kCells][hd + kPad] halves and the tile's mask values
// [rows][kMaskStride] floats.
__host__ __device__ inline size_t info_bytes(int rows) { return (static_cast<size_t>(rows) * 3 * sizeof(int64_t) + 15) / 16 * 16; }
__host__ __device__ inline size_t kv_stage_bytes(int hd) { return static_cast<size_t>(kCells) * (hd + kPad) * sizeof(uint16_t); }
__host__ __device__ inline size_t mask_stage_bytes(int rows) { return static_cast<size_t>(rows) * kMaskStride * sizeof(float); }
__host__ __device__ inline size_t stage_bytes(int hd, int rows) { return 2 * kv_stage_bytes(hd) + mask_stage_bytes(rows); }
__host__ __device__ inline size_t tc_smem_bytes(int hd, int rows) { return info_bytes(rows) + kStages * stage_bytes(hd, rows); }

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                                  const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_addr(p))
                 : "memory");
}

__device__ __forceinline__ int64_t warp_min_i64(int64_t v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const int64_t w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w < v ? w : v;
    }
    return v;
}

// Bits a .. b (0 <= a <= b < 64).
__device__ __forceinline__ uint64_t bit_range(int a, int b) { return (~0ull >> (63 - b)) & (~0ull << a); }

// The first j in [from, span) and the last j < below with m[j] != -inf (-1: none), for the whole
// warp, 128 values a step (four loads per lane in flight): the rare rows the first look misses.
__device__ int64_t first_unmasked(const float* m, int64_t from, int64_t span, int lane) {
    for (int64_t j0 = from; j0 < span; j0 += 128) {
        unsigned bal[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int64_t j = j0 + 32 * u + lane;
            bal[u] = __ballot_sync(0xffffffffu, j < span && __ldg(m + j) != -INFINITY);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            if (bal[u] != 0u) return j0 + 32 * u + __ffs(static_cast<int>(bal[u])) - 1;
        }
    }
    return -1;
}
__device__ int64_t last_unmasked(const float* m, int64_t below, int lane) {
    for (int64_t j1 = below; j1 > 0; j1 -= 128) {  // the window [j1 - 128, j1)
        unsigned bal[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int64_t j = j1 - 128 + 32 * u + lane;
            bal[u] = __ballot_sync(0xffffffffu, j >= 0 && __ldg(m + j) != -INFINITY);
        }
#pragma unroll
        for (int u = 3; u >= 0; --u) {
            if (bal[u] != 0u) return j1 - 128 + 32 * u + 31 - __clz(static_cast<int>(bal[u]));
        }
    }
    return -1;
}

// The first look at a mask row: its first 32 values and its last kBackLook, read at once for up to
// kLookRows rows of a warp. The engine's causal and block rows start unmasked and end unmasked
// within a chunk and the span's padding (256) of the span's end, so most rows need nothing more, and
// a light tile of a causal chunk (a long masked tail) does not wait for one round trip per row.
constexpr int kBackLook = 256;
constexpr int kLookRows = 2;

template <int HD>
__global__ void __launch_bounds__(kMaxWarps * 32) k_attention_tc(TDesc dst, TDesc q, TDesc kc, TDesc vc, TDesc mask,
                                                                   const int32_t* base, float scale, Tiling tl,
                                                                   unsigned* err) {
    static_assert(HD % 16 == 0 && HD <= 128, "head dims in 16-wide mma chunks, at most 128");
    constexpr int KS = HD / 16;     // k16 chunks of a score
    constexpr int NT = HD / 8;      // n8 tiles of an output row
    constexpr int RS = HD + kPad;   // a staged K/V row, in halves
    constexpr int U = HD / 8;       // 16-byte units of a K/V row
    pdl_enter();
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_warps = static_cast<int>(blockDim.x >> 5);
    const int rows = 16 * tl.row_groups;
    const int64_t n_rows = q.ne[2];
    // Later tiles first: in a causal chunk they walk the most cells.
    const int64_t r0 = static_cast<int64_t>(gridDim.y - 1 - blockIdx.y) * rows;
    const int tile_rows = static_cast<int>(n_rows - r0 < rows ? n_rows - r0 : rows);
    const int g = static_cast<int>(blockIdx.x) / tl.slices;
    const int slice = static_cast<int>(blockIdx.x) % tl.slices;
    const int h_rep = slice * tl.heads + warp % tl.heads;
    const int rg = warp / tl.heads;  // the warp's 16 rows: rg * 16 .. rg * 16 + 15 of the tile
    const bool has_head = h_rep < tl.n_rep;
    const int h = g * tl.n_rep + h_rep;
    const int64_t span = mask.ne[0];
    const int64_t n_cells = kc.ne[1];

    int64_t* s_lo = reinterpret_cast<int64_t*>(smem);  // [rows] first unmasked cell (LLONG_MAX: none)
    int64_t* s_hi = s_lo + rows;                         // [rows] last unmasked cell (-1: none)
    int64_t* s_b0 = s_hi + rows;                         // [rows] base
    unsigned char* stage_base = smem + info_bytes(rows);
    const size_t sbytes = stage_bytes(HD, rows);
    auto stage_k = [&](int st) { return reinterpret_cast<uint16_t*>(stage_base + st * sbytes); };
    auto stage_v = [&](int st) { return reinterpret_cast<uint16_t*>(stage_base + st * sbytes + kv_stage_bytes(HD)); };
    auto stage_m = [&](int st) { return reinterpret_cast<float*>(stage_base + st * sbytes + 2 * kv_stage_bytes(HD)); };

    // Each tile row's unmasked cells lie in [lo, hi]; a row past the tile, a row whose span leaves the
    // cache and a fully masked row take part in nothing. A warp takes rows warp + n_warps * t,
    // kLookRows at a time.
    for (int i0 = warp; i0 < rows; i0 += kLookRows * n_warps) {
        const float* mrow[kLookRows];
        int64_t b0[kLookRows];
        float front[kLookRows], back[kLookRows][kBackLook / 32];
#pragma unroll
        for (int u = 0; u < kLookRows; ++u) {
            const int i = i0 + u * n_warps;
            mrow[u] = nullptr;
            b0[u] = 0;
            if (i < tile_rows) {
                b0[u] = base[r0 + i];
                if (b0[u] >= 0 && b0[u] + span <= n_cells) {
                    mrow[u] = reinterpret_cast<const float*>(mask.data + (r0 + i) * mask.nb[1]);
                }
            }
            // every load first, the ballots after: one round trip for all the rows
            front[u] = mrow[u] != nullptr && lane < span ? __ldg(mrow[u] + lane) : -INFINITY;
#pragma unroll
            for (int w = 0; w < kBackLook / 32; ++w) {
                const int64_t j = span - kBackLook + 32 * w + lane;
                back[u][w] = mrow[u] != nullptr && j >= 0 ? __ldg(mrow[u] + j) : -INFINITY;
            }
        }
#pragma unroll
        for (int u = 0; u < kLookRows; ++u) {
            const int i = i0 + u * n_warps;
            int64_t lo = kNoBlock, hi = -1;
            if (mrow[u] != nullptr) {
                const unsigned f = __ballot_sync(0xffffffffu, front[u] != -INFINITY);
                const int64_t jf = f != 0u ? __ffs(static_cast<int>(f)) - 1 : first_unmasked(mrow[u], 32, span, lane);
                if (jf >= 0) {
                    int64_t jl = -1;
#pragma unroll
                    for (int w = 0; w < kBackLook / 32; ++w) {
                        const unsigned bw = __ballot_sync(0xffffffffu, back[u][w] != -INFINITY);
                        if (bw != 0u) jl = span - kBackLook + 32 * w + 31 - __clz(static_cast<int>(bw));
                    }
                    if (jl < 0) jl = last_unmasked(mrow[u], span - kBackLook, lane);
                    lo = b0[u] + jf;
                    hi = b0[u] + jl;
                }
            }
            if (lane == 0 && i < rows) {
                s_lo[i] = lo;
                s_hi[i] = hi;
                s_b0[i] = b0[u];
            }
        }
    }
    // q of the warp's rows g = lane / 4 and g + 8 as the S mma's A fragments (rows past the tile: 0).
    uint32_t qa[KS][4];
    {
        const int i0 = rg * 16 + (lane >> 2);
        const int qd = 2 * (lane & 3);
        const float* qrow[2] = {nullptr, nullptr};
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int i = i0 + 8 * e;
            if (has_head && i < tile_rows) {
                qrow[e] = reinterpret_cast<const float*>(q.data + h * q.nb[1] + (r0 + i) * q.nb[2]);
            }
        }
        auto qpair = [&](int e, int d) -> uint32_t {
            if (qrow[e] == nullptr) return 0u;
            return tc::pack2(f2h(qrow[e][d]), f2h(qrow[e][d + 1]));
        };
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            qa[kk][0] = qpair(0, 16 * kk + qd);
            qa[kk][1] = qpair(1, 16 * kk + qd);
            qa[kk][2] = qpair(0, 16 * kk + 8 + qd);
            qa[kk][3] = qpair(1, 16 * kk + 8 + qd);
        }
    }
    __syncthreads();

    // The next block after `after` that holds some row's unmasked range (kNoBlock: none), and the
    // cells of block b that some row's range covers: the same in every warp (warp reductions over
    // the rows, lanes taking rows lane and lane + 32).
    auto next_block = [&](int64_t after) -> int64_t {
        int64_t best = kNoBlock;
        for (int i = lane; i < rows; i += 32) {
            const int64_t hi = s_hi[i];
            if (hi < 0 || hi / kCells <= after) continue;
            const int64_t blo = s_lo[i] / kCells;
            const int64_t b = blo > after ? blo : after + 1;
            best = b < best ? b : best;
        }
        return warp_min_i64(best);
    };
    auto used_cells = [&](int64_t b) -> uint64_t {
        const int64_t c0 = b * kCells;
        uint64_t used = 0;
        for (int i = lane; i < rows; i += 32) {
            const int64_t hi = s_hi[i];
            if (hi < 0) continue;
            const int64_t a = s_lo[i] > c0 ? s_lo[i] : c0;
            const int64_t z = hi < c0 + kCells - 1 ? hi : c0 + kCells - 1;
            if (a <= z) used |= bit_range(static_cast<int>(a - c0), static_cast<int>(z - c0));
        }
        const unsigned lo32 = __reduce_or_sync(0xffffffffu, static_cast<unsigned>(used & 0xffffffffu));
        const unsigned hi32 = __reduce_or_sync(0xffffffffu, static_cast<unsigned>(used >> 32));
        return (static_cast<uint64_t>(hi32) << 32) | lo32;
    };
    // Whether block b holds some unmasked range of the warp's 16 rows (warp-uniform). If not, every
    // one of its rows would keep its state: the warp skips the block.
    auto warp_touches = [&](int64_t b) -> bool {
        bool t = false;
        if (lane < 16) {
            const int i = rg * 16 + lane;
            const int64_t hi = s_hi[i];
            t = hi >= 0 && s_lo[i] / kCells <= b && b <= hi / kCells;
        }
        return __any_sync(0xffffffffu, t);
    };

    const int64_t kcol = static_cast<int64_t>(g) * HD * static_cast<int64_t>(sizeof(uint16_t));  // the kv head's bytes
    // Block b's K and V rows and the tile's mask values into stage st. Cells no row's range covers
    // are zero-filled (nothing is read from them); a mask value outside the row's range is -inf.
    auto stage = [&](int64_t b, int st) {
        const uint64_t used = used_cells(b);
        uint16_t* sk = stage_k(st);
        uint16_t* sv = stage_v(st);
        float* sm = stage_m(st);
        const int64_t c0 = b * kCells;
        for (int u = threadIdx.x; u < kCells * U; u += blockDim.x) {
            const int i = u / U, col = u % U;
            const bool ok = ((used >> i) & 1ull) != 0;
            const int64_t c = ok ? c0 + i : 0;  // a used cell lies in some row's span, so in the cache
            cp_async<16>(sk + i * RS + col * 8, kc.data + c * kc.nb[1] + kcol + col * 16, ok);
            cp_async<16>(sv + i * RS + col * 8, vc.data + c * vc.nb[1] + kcol + col * 16, ok);
        }
        for (int e = threadIdx.x; e < rows * kCells; e += blockDim.x) {
            const int i = e / kCells, cl = e % kCells;
            const int64_t c = c0 + cl;
            float* d = sm + i * kMaskStride + cl;
            if (c >= s_lo[i] && c <= s_hi[i]) {
                cp_async<4>(d, mask.data + (r0 + i) * mask.nb[1] + (c - s_b0[i]) * static_cast<int64_t>(sizeof(float)),
                            true);
            } else {
                *d = -INFINITY;
            }
        }
    };

    // The warp's rows' running states: acc[nt][0..1] row g, head dims 8 nt + 2 (lane % 4) + {0, 1};
    // acc[nt][2..3] row g + 8, the same dims; (m, l) per row.
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[nt][j] = 0.0f;
    }
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

    auto compute = [&](int st) {
        const uint16_t* sk = stage_k(st);
        const uint16_t* sv = stage_v(st);
        const float* sm = stage_m(st);
        // S: 8 n-tiles of 8 cells; each score's chain over the head dim's chunks kk = 0 .. KS-1.
        float s[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int j = 0; j < 4; ++j) s[nt][j] = 0.0f;
        }
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                uint32_t b0[2], b1[2];
                const int cell = 16 * np + (lane & 7) + ((lane >> 4) << 3);
                const int dim = 16 * kk + (((lane >> 3) & 1) << 3);
                tc::ldmatrix_x4(b0[0], b0[1], b1[0], b1[1], sk + cell * RS + dim);
                tc::mma16816<false>(s[2 * np], qa[kk], b0);
                tc::mma16816<false>(s[2 * np + 1], qa[kk], b1);
            }
        }
        // Scale and mask in F32, the rows' maxima (rows g and g + 8: e = 0, 1).
        const int i0 = rg * 16 + (lane >> 2);
        const int cq = 2 * (lane & 3);
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float2 mv = *reinterpret_cast<const float2*>(sm + (i0 + 8 * e) * kMaskStride + 8 * nt + cq);
                float& s0 = s[nt][2 * e];
                float& s1 = s[nt][2 * e + 1];
                s0 = mv.x == -INFINITY ? -INFINITY : fmaf(s0, scale, mv.x);
                s1 = mv.y == -INFINITY ? -INFINITY : fmaf(s1, scale, mv.y);
                mx[e] = fmaxf(mx[e], fmaxf(s0, s1));
            }
        }
        bool has[2];
        float mn[2], corr[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 1));
            mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 2));
            has[e] = mx[e] != -INFINITY;
            mn[e] = fmaxf(m_run[e], mx[e]);
            corr[e] = expf(m_run[e] - mn[e]);  // m = -inf: 0; used only when has[e]
        }
        // p, and the rows' sums: the lane's 16 values in cell order, then the quad's butterfly
        // (x + y in either lane is the same float: every lane of the quad ends with the same bits).
        float sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int e = j >> 1;
                s[nt][j] = s[nt][j] == -INFINITY ? 0.0f : expf(s[nt][j] - mn[e]);
            }
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                sum[e] += s[nt][2 * e];
                sum[e] += s[nt][2 * e + 1];
            }
            sum[e] += __shfl_xor_sync(0xffffffffu, sum[e], 1);
            sum[e] += __shfl_xor_sync(0xffffffffu, sum[e], 2);
        }
        // P in F16 as the P V mma's A fragments: 16-cell chunk ks is n-tiles 2 ks and 2 ks + 1.
        uint32_t pa[4][4];
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            pa[ks][0] = tc::pack2(f2h(s[2 * ks][0]), f2h(s[2 * ks][1]));
            pa[ks][1] = tc::pack2(f2h(s[2 * ks][2]), f2h(s[2 * ks][3]));
            pa[ks][2] = tc::pack2(f2h(s[2 * ks + 1][0]), f2h(s[2 * ks + 1][1]));
            pa[ks][3] = tc::pack2(f2h(s[2 * ks + 1][2]), f2h(s[2 * ks + 1][3]));
        }
        // P V per pair of n-tiles (16 head dims), the four chunks in cell order from +0; then into
        // the running state, or not at all for a row with nothing unmasked here.
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            float pv[2][4];
#pragma unroll
            for (int u = 0; u < 2; ++u) {
#pragma unroll
                for (int j = 0; j < 4; ++j) pv[u][j] = 0.0f;
            }
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) {
                uint32_t b0[2], b1[2];
                const int cell = 16 * ks + (lane & 7) + (((lane >> 3) & 1) << 3);
                const int dim = 16 * np + ((lane >> 4) << 3);
                ldmatrix_x4_trans(b0[0], b0[1], b1[0], b1[1], sv + cell * RS + dim);
                tc::mma16816<false>(pv[0], pa[ks], b0);
                tc::mma16816<false>(pv[1], pa[ks], b1);
            }
#pragma unroll
            for (int u = 0; u < 2; ++u) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int e = j >> 1;
                    float& a = acc[2 * np + u][j];
                    a = has[e] ? fmaf(a, corr[e], pv[u][j]) : a;
                }
            }
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float l1 = fmaf(l_run[e], corr[e], sum[e]);
            l_run[e] = has[e] ? l1 : l_run[e];
            m_run[e] = has[e] ? mn[e] : m_run[e];
        }
    };

    // The walk: block b's copies were issued one step ahead (stage st); one group is committed per
    // step in every thread, so the wait counts agree.
    int64_t b = next_block(-1);
    if (b != kNoBlock) stage(b, 0);
    cp_async_commit();
    int st = 0;
    while (b != kNoBlock) {
        const int64_t bn = next_block(b);
        if (bn != kNoBlock) stage(bn, st ^ 1);
        cp_async_commit();
        cp_async_wait<1>();  // block b's copies
        __syncthreads();     // and everyone's, with the -inf mask stores
        if (has_head && warp_touches(b)) compute(st);
        __syncthreads();     // stage st is read before it is refilled
        b = bn;
        st ^= 1;
    }
    cp_async_wait<0>();

    if (!has_head) return;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int i = rg * 16 + (lane >> 2) + 8 * e;
        if (i >= tile_rows) continue;
        const int64_t r = r0 + i;
        float* o = reinterpret_cast<float*>(dst.data + h * dst.nb[1] + r * dst.nb[2]);
        const int64_t b0 = base[r];
        const bool bad = b0 < 0 || b0 + span > n_cells;
        if (bad && (lane & 3) == 0) atomicOr(err, kErrAttentionSpan);
        const float inv = row_scale(l_run[e]);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
                const float v = acc[nt][2 * e + jj] * inv;
                // A zero is stored as +0: its sign is the one bit tile-mates could have changed.
                o[8 * nt + 2 * (lane & 3) + jj] = bad || v == 0.0f ? 0.0f : v;
            }
        }
    }
}

template <int HD>
void launch_hd(const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v, const TDesc& mask,
               const int32_t* base, int n_kv_head, float scale, unsigned* err, cudaStream_t s) {
    const Tiling tl = tiling_for(static_cast<int>(q.ne[1] / n_kv_head));
    const int rows = 16 * tl.row_groups;
    const int threads = 32 * tl.heads * tl.row_groups;
    // Above 48 KiB a kernel must ask for its dynamic shared memory: the most this head dim uses
    // (64-row tiles).
    static std::once_flag once;
    std::call_once(once, [] {
        check(cudaFuncSetAttribute(k_attention_tc<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(tc_smem_bytes(HD, 16 * kMaxWarps))),
              "attention (tensor cores): cudaFuncSetAttribute");
    });
    const size_t smem = tc_smem_bytes(HD, rows);
    // At most 65535 tiles a launch (the grid's y); each launch takes the next rows through views.
    const int64_t n_tiles = (q.ne[2] + rows - 1) / rows;
    constexpr int64_t kMaxTiles = 65535;
    for (int64_t t0 = 0; t0 < n_tiles; t0 += kMaxTiles) {
        const int64_t nt = n_tiles - t0 < kMaxTiles ? n_tiles - t0 : kMaxTiles;
        const int64_t first = t0 * rows;
        const int64_t count = (q.ne[2] - first) < nt * rows ? q.ne[2] - first : nt * rows;
        TDesc d = dst, qq = q, mm = mask;
        d.data += first * dst.nb[2];
        d.ne[2] = count;
        qq.data += first * q.nb[2];
        qq.ne[2] = count;
        mm.data += first * mask.nb[1];
        mm.ne[1] = count;
        const dim3 grid(static_cast<unsigned>(n_kv_head * tl.slices), static_cast<unsigned>(nt));
        launch(k_attention_tc<HD>, grid, threads, smem, s, d, qq, k, v, mm, base + first, scale, tl, err);
    }
}

}  // namespace

bool attention_tc_enabled() { return matmul_tc_prompt_path() && env_switch("PYSPEC_CUDA_ATT_TC") != 0; }

bool attention_tc_shape(int64_t hd, DType kv_dtype) {
    return kv_dtype == DType::F16 && (hd == 32 || hd == 64 || hd == 128);
}

bool attention_tc_supports(const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v, const TDesc& mask,
                           int n_kv_head) {
    const int64_t hd = q.ne[0];
    return attention_tc_shape(hd, k.dtype) && v.dtype == k.dtype && k.nb[0] == 2 && v.nb[0] == 2 &&
           k.nb[1] % 16 == 0 && v.nb[1] % 16 == 0 && reinterpret_cast<uintptr_t>(k.data) % 16 == 0 &&
           reinterpret_cast<uintptr_t>(v.data) % 16 == 0 && k.ne[0] == v.ne[0] && k.ne[1] == v.ne[1] &&
           q.nb[0] == sizeof(float) && dst.nb[0] == sizeof(float) && mask.nb[0] == sizeof(float) &&
           n_kv_head > 0 && q.ne[1] % n_kv_head == 0 && k.ne[0] >= hd * n_kv_head;
}

void launch_attention_tc(const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v, const TDesc& mask,
                         const int32_t* base, int n_kv_head, float scale, unsigned* err, cudaStream_t s) {
    if (!attention_tc_supports(dst, q, k, v, mask, n_kv_head)) {
        throw std::logic_error("attention (tensor cores): unsupported layout");
    }
    if (q.ne[2] == 0 || q.ne[1] == 0) return;
    switch (q.ne[0]) {
        case 32: launch_hd<32>(dst, q, k, v, mask, base, n_kv_head, scale, err, s); return;
        case 64: launch_hd<64>(dst, q, k, v, mask, base, n_kv_head, scale, err, s); return;
        default: launch_hd<128>(dst, q, k, v, mask, base, n_kv_head, scale, err, s); return;
    }
}

}  // namespace cuda
}  // namespace pyspec
