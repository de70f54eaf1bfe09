// MUL_MAT on tensor cores for narrow batches (M <= 16: decode, verify, drafting), with the bits of
// the wide kernel (cuda/matmul_tc.cu) for every output, so which of the two runs is a speed choice
// only (design.md invariant 7).
//
// Same computation. An output (n, m) is the sum, in segment order, of one partial per K segment
// (tc::n_segments), each an F32 accumulator set to +0.0f and updated by one m16n8k16 mma per
// k-chunk of its segment in increasing order, the weight rows as the mma's A, the activation
// columns as its B, the values of a 32-k tile in the mma's k slots by tc::tile_slot, exactly as in
// the wide kernel. The operands are the same bits: float weights as stored; block types
// dequantized value by value through the same deq_half; activations rounded by the same
// conversion (f2h, or f2bf for BF16 weights); k past K is zero on both sides.
//
// Different schedule. The wide kernel stages a 32-k tile of 128 rows at a time through shared
// memory, which keeps too few bytes in flight to stream a weight matrix at HBM speed when M is
// small (decode is bound by reading the weights once). Here a warp owns 16 weight rows and one K
// segment (512 values), and the segments of a row tile run as separate blocks (grid.y), each
// writing its partial to the backend's scratch; the last to finish (an atomic count per tile) adds
// the partials in segment order, exactly as the wide kernel adds them in registers, and stores the
// output. A launch takes up to kMaxMatmulParts weight matrices over the same activations (q/k/v,
// gate/up).
//   - Float weights (k_mul_mat_tc_narrow_f): a lane loads its 16 bytes of each 32-k tile of its two
//     rows straight into registers (tile_slot makes them the lane's mma operands as loaded), 8
//     tiles at a time; the block's 4 warps share the segment's activations, rounded to halves once
//     in shared memory. About 4 instructions per 32 k per lane: ncu showed the staged version
//     bound by instruction issue (8 cycles per instruction at 11 warps per SM, 2.6 TB/s).
//   - Block types (k_mul_mat_tc_narrow_q): the segment's raw blocks go to shared memory by
//     cp.async (16 or 4 bytes per copy, by the rows' alignment) and are dequantized from there.
#include <mutex>
#include <type_traits>

#include "cuda/matmul_tc_common.cuh"
#include "cuda/launch.cuh"

namespace pyspec {
namespace cuda {
namespace {

using namespace tc;

constexpr int kRows = 16;  // weight rows per warp: one m16 tile

// The weight matrices of one launch; part j's tiles of 16 rows are tiles tile0[j] .. tile0[j+1]-1.
struct NarrowParts {
    const char* w[kMaxMatmulParts];
    int64_t rb[kMaxMatmulParts];
    int64_t n[kMaxMatmulParts];
    float* y[kMaxMatmulParts];
    int64_t ys[kMaxMatmulParts];
    const float* add[kMaxMatmulParts];
    int64_t as[kMaxMatmulParts];
    int64_t tile0[kMaxMatmulParts + 1];
    int np;
};

__device__ __forceinline__ int part_of(const NarrowParts& p, int64_t tile) {
    int j = 0;
    while (j + 1 < p.np && tile >= p.tile0[j + 1]) ++j;
    return j;
}

// The end of a (tile, segment) block's work, both kernels: with one segment the warp stores its
// accumulators (plus the residual); with several it publishes them as the segment's partial, and
// the tile's last segment to finish sums all partials in segment order and stores the outputs.
// acc[nt][e]: the D fragment, e = 0, 1 at row lane / 4, columns 8 nt + 2 (lane % 4) + {0, 1};
// e = 2, 3 at row + 8. partial: [tile][segment][column][16 rows]; counters: one per tile, zero
// between launches (the summing block resets its own).
template <int NT>
__device__ __forceinline__ void finish_tile(float (&acc)[NT][4], const NarrowParts& p, int j, int64_t tile, int seg,
                                            int n_seg, int m, int lane, float* __restrict__ partial,
                                            unsigned* __restrict__ counters) {
    const int kl = 2 * (lane & 3);
    if (n_seg > 1) {
        float* mine = partial + (tile * n_seg + seg) * static_cast<int64_t>(m) * kRows;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = nt * 8 + kl + (e & 1);
                if (c < m) mine[c * kRows + (lane >> 2) + (e >> 1) * 8] = acc[nt][e];
            }
        }
        __threadfence();
        __syncwarp();
        unsigned done = 0;
        if (lane == 0) done = atomicAdd(&counters[tile], 1u);
        done = __shfl_sync(0xffffffffu, done, 0);
        if (done != static_cast<unsigned>(n_seg - 1)) return;
        __threadfence();  // the other segments' partials, published before their counts
        const float* all = partial + tile * n_seg * static_cast<int64_t>(m) * kRows;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = min(nt * 8 + kl + (e & 1), m - 1);
                const int r = (lane >> 2) + (e >> 1) * 8;
                float t = __ldcg(all + c * kRows + r);
                for (int q = 1; q < n_seg; ++q) {
                    t = __fadd_rn(t, __ldcg(all + (q * static_cast<int64_t>(m) + c) * kRows + r));
                }
                acc[nt][e] = t;
            }
        }
        if (lane == 0) counters[tile] = 0u;  // ready for the next launch
    }
    const int64_t n = p.n[j], n0 = (tile - p.tile0[j]) * kRows;
    float* y = p.y[j];
    const float* add = p.add[j];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int64_t r = n0 + (lane >> 2) + (e >> 1) * 8;
            const int c = nt * 8 + kl + (e & 1);
            if (r < n && c < m) y[c * p.ys[j] + r] = add ? acc[nt][e] + add[c * p.as[j] + r] : acc[nt][e];
        }
    }
}

// ---- float weights --------------------------------------------------------------------------

constexpr int kFWarps = 4;                     // warps (row tiles) per block, sharing a segment
constexpr int kSegTiles32 = kSegChunks / 2;    // 32-k tiles per segment (16)
constexpr int kFBatch = 8;                     // 32-k tiles whose loads a lane issues together

// One block = kFWarps row tiles (warp w: tile 4 blockIdx.x + w) of K segment blockIdx.y, NT tiles of
// 8 activation columns (m <= 8 NT). Weight rows start 16-byte aligned with K % 8 == 0 (the
// launcher checks), so a lane's 8 values of a 32-k tile are all inside K or all past it.
template <DType T, int NT>
__global__ void __launch_bounds__(kFWarps * 32) k_mul_mat_tc_narrow_f(NarrowParts p, int64_t k, const float* __restrict__ x,
                                                                      int64_t xs, bool x_vec, int m,
                                                                      float* __restrict__ partial,
                                                                      unsigned* __restrict__ counters) {
    pdl_enter();
    constexpr bool kBF16 = T == DType::BF16;
    constexpr int kSegT = kSegTiles32;
    // The segment's activations as the mma's halves: column c, stored value i at xh[c * kSegT * 32 + i].
    extern __shared__ __align__(16) uint16_t xh[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int seg = static_cast<int>(blockIdx.y), n_seg = static_cast<int>(gridDim.y);
    const int64_t k0 = static_cast<int64_t>(seg) * kSegT * 32;
    const int nq = static_cast<int>(min(static_cast<int64_t>(kSegT), (k + 31) / 32 - k0 / 32));  // 32-k tiles here

    for (int i = threadIdx.x; i < m * nq * 8; i += blockDim.x) {  // 4 values per step, past K zeros
        const int col = i / (nq * 8), c4 = i % (nq * 8);
        const int64_t kk = k0 + c4 * 4;
        const float* src = x + col * xs + kk;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (kk < k) v = x_vec ? *reinterpret_cast<const float4*>(src) : make_float4(src[0], src[1], src[2], src[3]);
        *reinterpret_cast<uint2*>(&xh[col * kSegT * 32 + c4 * 4]) = x_halves<T>(v);
    }
    __syncthreads();

    const int64_t tile = static_cast<int64_t>(blockIdx.x) * kFWarps + warp;
    if (tile >= p.tile0[p.np]) return;
    const int j = part_of(p, tile);
    const int64_t n = p.n[j], n0 = (tile - p.tile0[j]) * kRows, rb = p.rb[j];
    const int g = lane >> 2, t = lane & 3;
    // Rows past n are clamped to the last (loaded, computed, never stored).
    const char* r0 = p.w[j] + min(n0 + g, n - 1) * rb + (k0 + 8 * t) * 2;
    const char* r1 = p.w[j] + min(n0 + g + 8, n - 1) * rb + (k0 + 8 * t) * 2;
    const int64_t lane_left = k - (k0 + 8 * t);  // values of the row from this lane's first one on

    int xcol[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) xcol[nt] = min(nt * 8 + g, m - 1);

    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
    }
    // kFBatch tiles' loads at a time, then their mmas: with 16 warps per SM the others' loads fill
    // the wait (issuing the next batch before this one's mmas measured no faster on the H200, nor
    // did 1024-value segments).
    for (int q0 = 0; q0 < nq; q0 += kFBatch) {
        uint4 a0[kFBatch], a1[kFBatch];
#pragma unroll
        for (int b = 0; b < kFBatch; ++b) {
            const int q = q0 + b;
            const bool in = q < nq && 32 * q < lane_left;
            a0[b] = in ? __ldg(reinterpret_cast<const uint4*>(r0 + q * 64)) : make_uint4(0u, 0u, 0u, 0u);
            a1[b] = in ? __ldg(reinterpret_cast<const uint4*>(r1 + q * 64)) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int b = 0; b < kFBatch; ++b) {
            const int q = q0 + b;
            if (q >= nq) break;
            uint4 xb[NT];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) xb[nt] = *reinterpret_cast<const uint4*>(&xh[xcol[nt] * kSegT * 32 + q * 32 + 8 * t]);
            const uint32_t c0[4] = {a0[b].x, a1[b].x, a0[b].y, a1[b].y};  // chunk 0: stored pairs 8t, 8t + 2
            const uint32_t c1[4] = {a0[b].z, a1[b].z, a0[b].w, a1[b].w};  // chunk 1: 8t + 4, 8t + 6
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const uint32_t b0[2] = {xb[nt].x, xb[nt].y};
                mma16816<kBF16>(acc[nt], c0, b0);
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const uint32_t b1[2] = {xb[nt].z, xb[nt].w};
                mma16816<kBF16>(acc[nt], c1, b1);
            }
        }
    }
    finish_tile<NT>(acc, p, j, tile, seg, n_seg, m, lane, partial, counters);
}

// ---- block types ----------------------------------------------------------------------------

// k per stage: 16 chunks (8 blocks of 32).
constexpr int kQStageK = 256;

// Stages per segment: the whole ring, filled at once.
constexpr int kQStages = kSegChunks / (kQStageK / 16);

template <DType T>
constexpr int stage_bytes() {  // bytes of one row per stage
    if constexpr (T == DType::Q8_0) return 8 * static_cast<int>(sizeof(BlockQ8_0));
    else if constexpr (T == DType::Q4_0) return 8 * static_cast<int>(sizeof(BlockQ4_0));
    else return 8 * static_cast<int>(sizeof(BlockQ4_1));
}

// Shared memory of one block: kQStages stages, each the 16 rows' raw bytes (a row's pitch of
// SB + 16 keeps 16-byte alignment) and the m activation columns' kQStageK floats.
template <DType T>
constexpr int w_pitch() { return stage_bytes<T>() + 16; }
template <DType T>
size_t narrow_q_smem_bytes(int64_t m) {
    return static_cast<size_t>(kQStages) * (kRows * w_pitch<T>() + static_cast<size_t>(m) * kQStageK * 4);
}

// The A fragment of mma chunk ks of a stage of block-type rows, dequantized straight from the raw
// blocks: a[0] = row g, k slots 2t, 2t + 1; a[1] = row g + 8, same slots; a[2], a[3] = the same rows
// at slots 2t + 8, 2t + 9 (g = lane / 4, t = lane % 4). Chunk ks is half h = ks & 1 of block
// ks / 2 of the stage, and by tile_slot its slots hold the block's values 8t + 4h + {0, 1} and
// 8t + 4h + {2, 3}.
template <DType T>
__device__ __forceinline__ void a_from_blocks(uint32_t (&a)[4], const unsigned char* wst, int ks, int lane) {
    constexpr int kPitch = w_pitch<T>();
    const int g = lane >> 2, v0 = 8 * (lane & 3) + 4 * (ks & 1);  // the 4 values v0 .. v0 + 3
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const unsigned char* row = wst + (g + 8 * rr) * kPitch;
        uint16_t h[4];
        if constexpr (T == DType::Q8_0) {
            const char* blk = reinterpret_cast<const char*>(row) + (ks >> 1) * static_cast<int>(sizeof(BlockQ8_0));
            const float d = h2f(ld16(blk));
            const char* q = blk + 2 + v0;
#pragma unroll
            for (int e = 0; e < 4; ++e) h[e] = deq_half<T>(d, 0.0f, static_cast<int8_t>(q[e]));
        } else {
            constexpr int kBlk = T == DType::Q4_0 ? static_cast<int>(sizeof(BlockQ4_0)) : static_cast<int>(sizeof(BlockQ4_1));
            constexpr int kQs = T == DType::Q4_0 ? 2 : 4;
            const char* blk = reinterpret_cast<const char*>(row) + (ks >> 1) * kBlk;
            const float d = h2f(ld16(blk));
            const float mn = T == DType::Q4_1 ? h2f(ld16(blk + 2)) : 0.0f;
            // values 0..15: low nibbles of qs[v]; 16..31: high nibbles of qs[v - 16]
            const int sh = v0 >= 16 ? 4 : 0;
            const unsigned char* q = reinterpret_cast<const unsigned char*>(blk) + kQs + (v0 & 15);
#pragma unroll
            for (int e = 0; e < 4; ++e) h[e] = deq_half<T>(d, mn, (q[e] >> sh) & 15);
        }
        a[rr] = pack2(h[0], h[1]);
        a[2 + rr] = pack2(h[2], h[3]);
    }
}

// One block = one warp = 16 rows of one part, K segment blockIdx.y, and NT tiles of 8 activation
// columns (m <= 8 NT). G: the weight copies' size; XG: the activation copies' size.
template <DType T, int G, int XG, int NT>
__global__ void __launch_bounds__(32) k_mul_mat_tc_narrow_q(NarrowParts p, int64_t k, const float* __restrict__ x,
                                                            int64_t xs, int m, float* __restrict__ partial,
                                                            unsigned* __restrict__ counters) {
    pdl_enter();
    constexpr int SK = kQStageK, SB = stage_bytes<T>(), kPitch = w_pitch<T>();
    constexpr int SC = SK / 16;  // mma chunks per stage
    constexpr int kPiecesPerRow = SB / G, kPieces = kRows * kPiecesPerRow, kPerLane = (kPieces + 31) / 32;
    constexpr int kXPieces = SK * 4 / XG;  // activation copies per column and stage
    static_assert(SB % G == 0, "a stage is whole copies");
    static_assert(kSegChunks % SC == 0, "a segment is whole stages");
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char* wring = smem;                                                  // [kQStages][kRows][kPitch]
    float* xring = reinterpret_cast<float*>(smem + kQStages * kRows * kPitch);   // [kQStages][m][SK]

    const int lane = threadIdx.x;
    const int64_t tile = blockIdx.x;
    const int seg = static_cast<int>(blockIdx.y), n_seg = static_cast<int>(gridDim.y);
    const int j = part_of(p, tile);
    const int64_t n = p.n[j], n0 = (tile - p.tile0[j]) * kRows, rb = p.rb[j];
    const char* w = p.w[j];

    // This segment's chunks [c_begin, c_end) of the wide kernel's n_chunks, as stages st0 + st.
    const int64_t c_begin = static_cast<int64_t>(seg) * kSegChunks;
    const int64_t c_end = min(c_begin + kSegChunks, n_chunks(k));
    const int64_t st0 = c_begin / SC;
    const int n_st = static_cast<int>((c_end - c_begin + SC - 1) / SC);
    const int64_t row_bytes = (k / QK) * (SB / 8);  // the row's blocks, in bytes

    // Rows past n are clamped to the last (loaded, computed, never stored); k past K is zeros.
    auto issue = [&](int st) {
        if (st < n_st) {
            const int64_t ast = st0 + st;
            unsigned char* ws = wring + st * (kRows * kPitch);
#pragma unroll
            for (int q = 0; q < kPerLane; ++q) {
                const int i = lane + 32 * q;
                if (kPieces % 32 != 0 && i >= kPieces) break;
                const int r = i / kPiecesPerRow, c = i % kPiecesPerRow;
                const int64_t off = ast * SB + c * G;
                const bool valid = off < row_bytes;
                const char* src = w + min(n0 + r, n - 1) * rb + (valid ? off : 0);
                cp_async<G>(ws + r * kPitch + c * G, src, valid);
            }
            float* xst = xring + st * m * SK;
            for (int i = lane; i < m * kXPieces; i += 32) {
                const int col = i / kXPieces, c = i % kXPieces;
                const int64_t k0 = ast * SK + c * (XG / 4);
                const bool valid = k0 < k;  // K % 32 == 0: a copy is all in or all out
                cp_async<XG>(xst + col * SK + c * (XG / 4), x + col * xs + (valid ? k0 : 0), valid);
            }
        }
        cp_async_commit();  // an empty group past the end keeps the wait counts below uniform
    };

    // This lane's B columns: nt * 8 + lane / 4, past m clamped to the last (computed, never stored).
    // Its k slots 2t, 2t + 1 and 2t + 8, 2t + 9 of chunk ks hold the stage's activations
    // 32 (ks / 2) + 8t + 4 (ks & 1) + {0, 1} and + {2, 3} (tile_slot).
    int xcol[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) xcol[nt] = min(nt * 8 + (lane >> 2), m - 1);
    const int xl = 8 * (lane & 3);

    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
    }

    // The whole segment is requested at once (its loads are all the warp waits for), then the
    // stages are consumed in order as they land.
#pragma unroll
    for (int st = 0; st < kQStages; ++st) issue(st);
#pragma unroll
    for (int st = 0; st < kQStages; ++st) {
        if (st >= n_st) break;
        cp_async_wait_n<kQStages>(kQStages - 1 - st);  // this lane's copies of stage st have landed
        __syncwarp();                                   // and every lane's
        const unsigned char* ws = wring + st * (kRows * kPitch);
        const float* xst = xring + st * m * SK;
        // All operands of the stage first, then its mma chain. Only the segment's last stage may
        // hold chunks past its end; they are skipped, not added as zeros (an mma adding +0 turns
        // a -0 accumulator into +0).
        auto run_stage = [&](auto guarded) {
            constexpr bool kGuarded = decltype(guarded)::value;
            uint32_t a[SC][4], b[SC][NT][2];
#pragma unroll
            for (int ks = 0; ks < SC; ++ks) {
                if (kGuarded && (st0 + st) * SC + ks >= c_end) continue;
                a_from_blocks<T>(a[ks], ws, ks, lane);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const float* xc = xst + xcol[nt] * SK + 32 * (ks >> 1) + xl + 4 * (ks & 1);
                    const float4 v = *reinterpret_cast<const float4*>(xc);
                    b[ks][nt][0] = x_pair_halves<T>(v.x, v.y);
                    b[ks][nt][1] = x_pair_halves<T>(v.z, v.w);
                }
            }
#pragma unroll
            for (int ks = 0; ks < SC; ++ks) {
                if (kGuarded && (st0 + st) * SC + ks >= c_end) continue;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) mma16816<false>(acc[nt], a[ks], b[ks][nt]);
            }
        };
        if ((st0 + st + 1) * SC <= c_end) {
            run_stage(std::false_type{});
        } else {
            run_stage(std::true_type{});
        }
    }
    finish_tile<NT>(acc, p, j, tile, seg, n_seg, m, lane, partial, counters);
}

template <DType T, int G, int XG, int NT>
void narrow_q_launch(const NarrowParts& p, int64_t k, const float* x, int64_t xs, int64_t m, const SplitScratch& ws,
                     cudaStream_t s) {
    // Above 48 KiB a kernel must ask for its dynamic shared memory; ask once for the most (m = 16).
    static std::once_flag once;
    std::call_once(once, [] {
        check(cudaFuncSetAttribute(k_mul_mat_tc_narrow_q<T, G, XG, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(narrow_q_smem_bytes<T>(kMatmulTcNarrowMaxM))),
              "mul_mat (tensor cores, narrow): cudaFuncSetAttribute");
    });
    const dim3 grid(static_cast<unsigned>(p.tile0[p.np]), static_cast<unsigned>(n_segments(k)));
    launch(k_mul_mat_tc_narrow_q<T, G, XG, NT>, grid, 32, narrow_q_smem_bytes<T>(m), s, p, k, x, xs, static_cast<int>(m),
            ws.partial, ws.counters);
}

template <DType T, int G>
void narrow_q_x(bool x16, const NarrowParts& p, int64_t k, const float* x, int64_t xs, int64_t m,
                const SplitScratch& ws, cudaStream_t s) {
    if (m <= 8) {
        if (x16) narrow_q_launch<T, G, 16, 1>(p, k, x, xs, m, ws, s);
        else narrow_q_launch<T, G, 4, 1>(p, k, x, xs, m, ws, s);
    } else {
        if (x16) narrow_q_launch<T, G, 16, 2>(p, k, x, xs, m, ws, s);
        else narrow_q_launch<T, G, 4, 2>(p, k, x, xs, m, ws, s);
    }
}

template <DType T>
void narrow_q_typed(int g, bool x16, const NarrowParts& p, int64_t k, const float* x, int64_t xs, int64_t m,
                    const SplitScratch& ws, cudaStream_t s) {
    if (g == 16) narrow_q_x<T, 16>(x16, p, k, x, xs, m, ws, s);
    else narrow_q_x<T, 4>(x16, p, k, x, xs, m, ws, s);
}

template <DType T>
void narrow_f_typed(bool x16, const NarrowParts& p, int64_t k, const float* x, int64_t xs, int64_t m,
                    const SplitScratch& ws, cudaStream_t s) {
    const dim3 grid(static_cast<unsigned>((p.tile0[p.np] + kFWarps - 1) / kFWarps), static_cast<unsigned>(n_segments(k)));
    const size_t smem = static_cast<size_t>(m) * kSegTiles32 * 32 * 2;  // the activations as halves
    if (m <= 8) {
        launch(k_mul_mat_tc_narrow_f<T, 1>, grid, kFWarps * 32, smem, s, p, k, x, xs, x16, static_cast<int>(m), ws.partial,
                ws.counters);
    } else {
        launch(k_mul_mat_tc_narrow_f<T, 2>, grid, kFWarps * 32, smem, s, p, k, x, xs, x16, static_cast<int>(m), ws.partial,
                ws.counters);
    }
}

}  // namespace

SplitScratchNeed matmul_tc_narrow_scratch(DType t, int64_t k, int64_t rows, int64_t m) {
    if (m <= 0 || m > kMatmulTcNarrowMaxM || rows <= 0 || !matmul_tc_supports(t, k) || n_segments(k) < 2) return {};
    const int64_t tiles = (rows + 15) / 16;
    return {static_cast<size_t>(tiles * n_segments(k) * m * kRows), static_cast<size_t>(tiles)};
}

bool launch_matmul_tc_narrow(DType t, const MatmulPart* parts, int n_parts, int64_t k, const float* x, int64_t xs,
                             int64_t m, const SplitScratch& ws, cudaStream_t s) {
    if (m <= 0 || m > kMatmulTcNarrowMaxM || n_parts < 1 || n_parts > kMaxMatmulParts) return false;
    if (!matmul_tc_supports(t, k)) return false;
    const bool floats = t == DType::F16 || t == DType::BF16;
    // Copy size: 16 bytes where every row start and the row length allow it, else 4 (block types);
    // rows the kernels cannot read so (odd Q8_0/Q4_0 block counts; float rows not 16-byte aligned)
    // go to the wide kernel, the same computation.
    const int64_t row_bytes = static_cast<int64_t>(dtype_row_bytes(t, k));
    int g = 16;
    NarrowParts p{};
    p.np = n_parts;
    p.tile0[0] = 0;
    for (int j = 0; j < n_parts; ++j) {
        const MatmulPart& q = parts[j];
        const uintptr_t a = reinterpret_cast<uintptr_t>(q.w);
        if (a % 16 != 0 || q.row_bytes % 16 != 0 || row_bytes % 16 != 0) g = 4;
        if (a % 4 != 0 || q.row_bytes % 4 != 0 || row_bytes % 4 != 0) return false;
        p.w[j] = static_cast<const char*>(q.w);
        p.rb[j] = static_cast<int64_t>(q.row_bytes);
        p.n[j] = std::max<int64_t>(0, q.n_rows);
        p.y[j] = q.y;
        p.ys[j] = q.y_stride;
        p.add[j] = q.add;
        p.as[j] = q.add_stride;
        p.tile0[j + 1] = p.tile0[j] + (p.n[j] + 15) / 16;
    }
    if (floats && g != 16) return false;
    if (p.tile0[n_parts] == 0) return true;
    if (p.tile0[n_parts] > 0x7fffffff || n_segments(k) > 65535) return false;
    if (n_segments(k) > 1) {  // the partials' room (the backend sizes it before the compute)
        const int64_t tiles = p.tile0[n_parts];
        if (!ws.partial || !ws.counters || ws.n_counters < static_cast<size_t>(tiles) ||
            ws.partial_floats < static_cast<size_t>(tiles * n_segments(k) * m * kRows)) {
            return false;
        }
    }
    // Activation loads: 16 bytes where every column starts 16-byte aligned (K % 8 == 0 here).
    const bool x16 = reinterpret_cast<uintptr_t>(x) % 16 == 0 && xs % 4 == 0;
    if (reinterpret_cast<uintptr_t>(x) % 4 != 0) return false;
    switch (t) {
        case DType::F16: narrow_f_typed<DType::F16>(x16, p, k, x, xs, m, ws, s); break;
        case DType::BF16: narrow_f_typed<DType::BF16>(x16, p, k, x, xs, m, ws, s); break;
        case DType::Q8_0: narrow_q_typed<DType::Q8_0>(g, x16, p, k, x, xs, m, ws, s); break;
        case DType::Q4_0: narrow_q_typed<DType::Q4_0>(g, x16, p, k, x, xs, m, ws, s); break;
        case DType::Q4_1: narrow_q_typed<DType::Q4_1>(g, x16, p, k, x, xs, m, ws, s); break;
        default: return false;
    }
    return true;
}

}  // namespace cuda
}  // namespace pyspec
