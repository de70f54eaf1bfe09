// The first wide tensor-core MUL_MAT kernel, now the fallback of launch_matmul_tc_wide
// (cuda/matmul_tc.cu) where its GEMM does not apply: M <= 16 rows the narrow kernel refused, float
// weights not 16-byte aligned, or a scratch too small. It reads any row alignment and needs no
// scratch, converting each chunk in registers and storing it by tile_slot for ldmatrix; it runs the
// same per-output mma sequence as the GEMM and the narrow kernel (cuda/matmul_tc.cu explains the
// order), so the same bits.
#include <algorithm>

#include "cuda/matmul_tc_common.cuh"
#include "cuda/launch.cuh"

namespace pyspec {
namespace cuda {
namespace tc {
namespace {

constexpr int kBK = 32;          // k per block tile: two m16n8k16 chunks, in increasing k
constexpr int kLd = kBK + 8;     // shared-memory row in halves: 80 bytes, ldmatrix conflict-free

// Block tile: BN = WN * TN * 16 weight rows x BM = WM * TM * 8 activation columns x kBK, WN x WM
// warps, warp (wn, wm) owning TN x TM mma tiles (rows wn * TN * 16 .., columns wm * TM * 8 ..).
// Two shared-memory stages; the next tile's global loads go to registers before this tile's mmas
// and to the other stage after them, one barrier per tile. Rows past n and columns past m are
// clamped to the last one (loaded and computed, never stored); k past K is zero-filled.
template <DType T, int WN, int WM, int TN, int TM>
__global__ void __launch_bounds__(WN * WM * 32)
    k_mul_mat_tc(const char* __restrict__ w, int64_t n, int64_t k, int64_t rb, bool w_vec, const float* __restrict__ x,
                 int64_t xs, bool x_vec, int64_t m, float* __restrict__ y, int64_t ys, const float* __restrict__ add,
                 int64_t as) {
    pdl_enter();
    constexpr int kThreads = WN * WM * 32;
    constexpr int BN = WN * TN * 16, BM = WM * TM * 8;
    constexpr int kWChunks = BN * (kBK / 8), kXChunks = BM * (kBK / 4);
    constexpr int kWIt = (kWChunks + kThreads - 1) / kThreads, kXIt = (kXChunks + kThreads - 1) / kThreads;
    constexpr bool kBF16 = T == DType::BF16;
    static_assert(TM == 1 || TM % 2 == 0, "B fragments load in pairs");

    __shared__ __align__(16) uint16_t As[2][BN][kLd];
    __shared__ __align__(16) uint16_t Bs[2][BM][kLd];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wn = warp % WN, wm = warp / WN;
    const int64_t n0 = static_cast<int64_t>(blockIdx.y) * BN, m0 = static_cast<int64_t>(blockIdx.x) * BM;
    const int64_t n_tiles = (k + kBK - 1) / kBK;

    // This thread's load slots: weight chunk (row, 8-value chunk) and activation chunk (column,
    // 4-value chunk) of every tile.
    const char* wrow[kWIt];
    int ws_row[kWIt], ws_c[kWIt];
    bool w_on[kWIt];
#pragma unroll
    for (int i = 0; i < kWIt; ++i) {
        const int c = tid + i * kThreads;
        w_on[i] = kWChunks % kThreads == 0 || c < kWChunks;
        ws_row[i] = w_on[i] ? c / (kBK / 8) : 0;
        ws_c[i] = c % (kBK / 8);
        wrow[i] = w + min(n0 + ws_row[i], n - 1) * rb;
    }
    const float* xcol[kXIt];
    int xs_col[kXIt], xs_c[kXIt];
    bool x_on[kXIt];
#pragma unroll
    for (int i = 0; i < kXIt; ++i) {
        const int c = tid + i * kThreads;
        x_on[i] = kXChunks % kThreads == 0 || c < kXChunks;
        xs_col[i] = x_on[i] ? c / (kBK / 4) : 0;
        xs_c[i] = c % (kBK / 4);
        xcol[i] = x + min(m0 + xs_col[i], m - 1) * xs;
    }

    WRaw wst[kWIt];
    float4 xst[kXIt];
    auto load_tile = [&](int64_t kt) {
#pragma unroll
        for (int i = 0; i < kWIt; ++i) {
            const int64_t kc8 = kt * (kBK / 8) + ws_c[i];
            wst[i] = load_w<T>(wrow[i], kc8, kc8 * 8 < k, w_vec);
        }
#pragma unroll
        for (int i = 0; i < kXIt; ++i) {
            const int64_t k0 = kt * kBK + xs_c[i] * 4;
            xst[i] = load_x4(xcol[i], k0, k0 < k, x_vec);
        }
    };
    // Stored pairs go to their mma k slots (tile_slot), 4 bytes at a time.
    auto store_tile = [&](int buf) {
#pragma unroll
        for (int i = 0; i < kWIt; ++i) {
            if (w_on[i]) {
                const uint4 h = w_halves<T>(wst[i], ws_c[i]);
                uint32_t* row = reinterpret_cast<uint32_t*>(&As[buf][ws_row[i]][0]);
                row[tile_slot(4 * ws_c[i]) / 2] = h.x;
                row[tile_slot(4 * ws_c[i] + 1) / 2] = h.y;
                row[tile_slot(4 * ws_c[i] + 2) / 2] = h.z;
                row[tile_slot(4 * ws_c[i] + 3) / 2] = h.w;
            }
        }
#pragma unroll
        for (int i = 0; i < kXIt; ++i) {
            if (x_on[i]) {
                const uint2 h = x_halves<T>(xst[i]);
                uint32_t* col = reinterpret_cast<uint32_t*>(&Bs[buf][xs_col[i]][0]);
                col[tile_slot(2 * xs_c[i]) / 2] = h.x;
                col[tile_slot(2 * xs_c[i] + 1) / 2] = h.y;
            }
        }
    };

    float acc[TN][TM][4];
#pragma unroll
    for (int i = 0; i < TN; ++i) {
#pragma unroll
        for (int j = 0; j < TM; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
        }
    }

    float tot[TN][TM][4];  // p_0 + ... of the segments done so far
    constexpr int kSegTiles = kSegChunks / (kBK / 16);

    load_tile(0);
    store_tile(0);
    __syncthreads();
    for (int64_t kt = 0; kt < n_tiles; ++kt) {
        const int buf = static_cast<int>(kt & 1);
        const bool more = kt + 1 < n_tiles;
        if (more) load_tile(kt + 1);
#pragma unroll
        for (int ks = 0; ks < kBK / 16; ++ks) {  // the tile's two k-chunks, in increasing k
            uint32_t a[TN][4], b[TM][2];
#pragma unroll
            for (int i = 0; i < TN; ++i) {
                ldmatrix_x4(a[i][0], a[i][1], a[i][2], a[i][3],
                            &As[buf][wn * TN * 16 + i * 16 + (lane & 15)][ks * 16 + (lane >> 4) * 8]);
            }
            if constexpr (TM == 1) {
                ldmatrix_x2(b[0][0], b[0][1], &Bs[buf][wm * 8 + (lane & 7)][ks * 16 + ((lane >> 3) & 1) * 8]);
            } else {
#pragma unroll
                for (int j = 0; j < TM; j += 2) {
                    ldmatrix_x4(b[j][0], b[j][1], b[j + 1][0], b[j + 1][1],
                                &Bs[buf][wm * TM * 8 + j * 8 + (lane & 7) + ((lane >> 4) << 3)]
                                   [ks * 16 + ((lane >> 3) & 1) * 8]);
                }
            }
#pragma unroll
            for (int i = 0; i < TN; ++i) {
#pragma unroll
                for (int j = 0; j < TM; ++j) mma16816<kBF16>(acc[i][j], a[i], b[j]);
            }
        }
        if (!more || (kt + 1) % kSegTiles == 0) {  // segment kt / kSegTiles ends: p_0 as is, then adds
            const bool first = kt < kSegTiles;
#pragma unroll
            for (int i = 0; i < TN; ++i) {
#pragma unroll
                for (int j = 0; j < TM; ++j) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        tot[i][j][e] = first ? acc[i][j][e] : __fadd_rn(tot[i][j][e], acc[i][j][e]);
                        acc[i][j][e] = 0.0f;
                    }
                }
            }
        }
        if (more) store_tile(buf ^ 1);
        __syncthreads();
    }

    // D fragment: e = 0, 1 at row lane / 4, columns 2 (lane % 4) + {0, 1}; e = 2, 3 at row + 8.
#pragma unroll
    for (int i = 0; i < TN; ++i) {
#pragma unroll
        for (int j = 0; j < TM; ++j) {
            const int64_t row = n0 + wn * TN * 16 + i * 16 + (lane >> 2);
            const int64_t col = m0 + wm * TM * 8 + j * 8 + (lane & 3) * 2;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int64_t r = row + (e >> 1) * 8, c = col + (e & 1);
                if (r < n && c < m) y[c * ys + r] = add ? tot[i][j][e] + add[c * as + r] : tot[i][j][e];
            }
        }
    }
}

// Weight-row tiles on grid.y (at most 65535 per launch), column tiles on grid.x, so the blocks that
// share a weight tile run next to each other and read it from L2 once.
template <DType T, int WN, int WM, int TN, int TM>
void tc_tiles(const MatmulPart& p, int64_t k, bool w_vec, const float* x, int64_t xs, bool x_vec, int64_t m,
              cudaStream_t s) {
    constexpr int64_t BN = int64_t{WN} * TN * 16, BM = int64_t{WM} * TM * 8;
    constexpr int64_t max_rows = BN * 65535;
    const unsigned gx = grid_for(m, static_cast<int>(BM));
    const char* w = static_cast<const char*>(p.w);
    const int64_t rb = static_cast<int64_t>(p.row_bytes);
    for (int64_t r0 = 0; r0 < p.n_rows; r0 += max_rows) {
        const int64_t nr = std::min(max_rows, p.n_rows - r0);
        const dim3 grid(gx, static_cast<unsigned>((nr + BN - 1) / BN));
        launch(k_mul_mat_tc<T, WN, WM, TN, TM>, grid, WN * WM * 32, 0, s, w + r0 * rb, nr, k, rb, w_vec, x, xs, x_vec, m,
                p.y + r0, p.y_stride,
                p.add ? p.add + r0 : nullptr, p.add_stride);
    }
}

// Speed (H200, 2026-11-30): ~64 TFLOP/s at Qwen3-4B's prefill shapes (the loads go through
// registers, are converted and permuted there, then stored: too little in flight). Registers: 166
// for the 32 x 32 warp tiles with the segment totals, no spills; 30 KB shared memory.
// Launch shape by batch size: speed only (every shape runs the same per-output mma sequence).
//   M <= 32: 128 x 32 tiles, 4 warps of 32 x 32.
//   larger:  128 x 64 tiles, 8 warps of 32 x 32.
template <DType T>
void tc_typed(const MatmulPart& p, int64_t k, bool w_vec, const float* x, int64_t xs, bool x_vec, int64_t m,
              cudaStream_t s) {
    if (m <= 32) return tc_tiles<T, 4, 1, 2, 4>(p, k, w_vec, x, xs, x_vec, m, s);
    return tc_tiles<T, 4, 2, 2, 4>(p, k, w_vec, x, xs, x_vec, m, s);
}

}  // namespace

void launch_first_kernel(DType t, const MatmulPart& p, int64_t k, const float* x, int64_t xs, int64_t m,
                         cudaStream_t s) {
    if (p.n_rows <= 0 || m <= 0) return;
    // 16-byte loads where aligned; the choice changes how values are loaded, never which values.
    const bool x_vec = reinterpret_cast<uintptr_t>(x) % 16 == 0 && xs % 4 == 0;
    const bool w_vec = reinterpret_cast<uintptr_t>(p.w) % 16 == 0 && p.row_bytes % 16 == 0;
    switch (t) {
        case DType::F16: tc_typed<DType::F16>(p, k, w_vec, x, xs, x_vec, m, s); break;
        case DType::BF16: tc_typed<DType::BF16>(p, k, w_vec, x, xs, x_vec, m, s); break;
        case DType::Q8_0: tc_typed<DType::Q8_0>(p, k, w_vec, x, xs, x_vec, m, s); break;
        case DType::Q4_0: tc_typed<DType::Q4_0>(p, k, w_vec, x, xs, x_vec, m, s); break;
        case DType::Q4_1: tc_typed<DType::Q4_1>(p, k, w_vec, x, xs, x_vec, m, s); break;
        default: throw std::runtime_error("cuda backend: mul_mat (tensor cores): unsupported weight type");
    }
}

}  // namespace tc
}  // namespace cuda
}  // namespace pyspec
