// What the wide tensor-core GEMMs share: the mma.sync GEMM (cuda/matmul_tc.cu) and the wgmma GEMM
// (cuda/matmul_tc_wgmma.cu), which compute the same bits for every output (the wgmma file says
// why): the parts of a launch, the split-K sum, the activation pitch of the converted operands.
#pragma once

#include <algorithm>

#include "cuda/launch.cuh"
#include "cuda/matmul_tc_common.cuh"

namespace pyspec {
namespace cuda {
namespace tc {

// The parts of one GEMM launch (a group's weight matrices, or a piece of them), their row tiles
// concatenated on grid.y: part j owns tiles tile0[j] .. tile0[j + 1] - 1.
struct WideParts {
    const char* a[kMaxMatmulParts];  // row r of part j: a[j] + r * ars[j] bytes (halves, 16-byte aligned)
    int64_t ars[kMaxMatmulParts];
    int64_t n[kMaxMatmulParts];
    float* y[kMaxMatmulParts];
    int64_t ys[kMaxMatmulParts];
    const float* add[kMaxMatmulParts];
    int64_t as[kMaxMatmulParts];
    int tile0[kMaxMatmulParts + 1];
    int np;
};

// Element j of a parameter array, read with constant indices (a dynamic index would copy the
// kernel's parameters to local memory).
template <class V, int N>
__device__ __forceinline__ V pick(const V (&v)[N], int j) {
    V r = v[0];
#pragma unroll
    for (int i = 1; i < N; ++i) r = j == i ? v[i] : r;
    return r;
}

__device__ __forceinline__ int wide_part_of(const WideParts& p, int tile) {
    int j = 0;
#pragma unroll
    for (int i = 1; i < kMaxMatmulParts; ++i) j += (i < p.np && tile >= p.tile0[i]) ? 1 : 0;
    return j;
}

// Where part j's outputs go: output (row r, column c) at y[c * ys + r], plus the residual add[c * as + r]
// where there is one.
struct WideOut {
    float* y;
    const float* add;
    int64_t ys, as;
    __device__ __forceinline__ WideOut(const WideParts& p, int j)
        : y(pick(p.y, j)), add(pick(p.add, j)), ys(pick(p.ys, j)), as(pick(p.as, j)) {}
    __device__ __forceinline__ void store(int64_t r, int64_t c, float v) const {
        y[c * ys + r] = add ? v + add[c * as + r] : v;
    }
};

constexpr int64_t kWideSplitMaxM = 128;  // the widest batch whose K may be split

int sm_count();

// The parts of rows [r0, r1) of a group (its parts' rows concatenated) for a row tile of bn: weight
// row i of the piece at a + (i - r0) * ars where a is not null (the converted piece), else in place.
WideParts wide_parts(const MatmulPart* parts, int n_parts, int64_t r0, int64_t r1, const char* a, int64_t ars, int bn);

// Split K where a launch of blocks of bn weight rows x bm columns would leave some of the GPU's
// slots idle: batches up to kWideSplitMaxM columns, each split a run of `per` whole segments (one
// split of all of them otherwise, or where the scratch is too small).
struct WideSplit {
    int per;
    int splits;
};
WideSplit wide_split(int64_t m, int64_t tiles, int bn, int bm, int64_t slots, int64_t k, const SplitScratch& ws);

// Blocks of `kernel` an SM holds at `threads` threads and `smem` bytes of dynamic shared memory
// (asked once per configuration; the shared-memory opt-in first).
template <class Kernel>
int resident_blocks(Kernel kernel, int threads, size_t smem) {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
          "mul_mat (tensor cores): cudaFuncSetAttribute");
    int v = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, kernel, threads, smem), "mul_mat (tensor cores): occupancy");
    return std::max(v, 1);
}

void launch_wide_split_sum(const WideParts& p, int bn, int n_seg, int64_t m, const float* partial, cudaStream_t s);

// One launch of a wide GEMM kernel (both GEMMs' signature) over blocks of `rows` weight rows x
// `cols` columns, K split where wide_split says, then the split's sum.
template <class Kernel>
void launch_wide(Kernel kernel, int threads, size_t smem, int per_sm, int rows, int cols, const WideParts& p, int64_t k,
                 const uint16_t* xh, int64_t m, const SplitScratch& ws, cudaStream_t s) {
    const int64_t tiles = p.tile0[p.np];
    const WideSplit sp = wide_split(m, tiles, rows, cols, static_cast<int64_t>(sm_count()) * per_sm, k, ws);
    const dim3 grid(static_cast<unsigned>((m + cols - 1) / cols), static_cast<unsigned>(tiles), static_cast<unsigned>(sp.splits));
    if (sp.splits == 1) {
        launch(kernel, grid, threads, smem, s, p, k, xh, m, sp.per, static_cast<float*>(nullptr));
        return;
    }
    launch(kernel, grid, threads, smem, s, p, k, xh, m, sp.per, ws.partial);
    launch_wide_split_sum(p, rows, static_cast<int>(n_segments(k)), m, ws.partial, s);
}

// (launch_wide_split_sum: the outputs of a split launch of row tile bn, p_0 + p_1 + ... in segment
// order, plus the residual.)

// Halves per activation column of the wgmma GEMM's operands (K rounded up to whole 32-value tiles,
// the tail zero-filled), and of the layout it reads: within each 32-value tile, chunk 0's values
// (8q .. 8q + 3, q = 0..3) then chunk 1's (8q + 4 .. 8q + 7), so a chunk is 16 consecutive halves.
__host__ __device__ constexpr int64_t arranged_pitch(int64_t k) { return (k + 31) / 32 * 32; }
// Where value i of a row lands in that layout.
__host__ __device__ constexpr int64_t arranged_index(int64_t i) {
    return i / 32 * 32 + ((i % 8) / 4) * 16 + (i % 32) / 8 * 4 + i % 4;
}

// Whether the wgmma GEMM serves the wide batches: built for sm_90a, running on a compute
// capability 9.0 GPU, and not turned off (PYSPEC_CUDA_WGMMA=0, for A/B runs; read at each call).
bool wgmma_gemm_ready();
// Whether a group of `rows` weight rows of K values over m columns takes it: where it is ready, its
// grid fills the GPU and K is long enough to fill its ring (smaller matrices, e.g. SmolLM2-135M's,
// run faster on the mma.sync GEMM's smaller tiles; the bits are the same either way), or where
// PYSPEC_CUDA_WGMMA_CFG forces a configuration.
bool wgmma_gemm_suits(const MatmulPart* parts, int n_parts, int64_t rows, int64_t k, int64_t m);
// The wgmma GEMM fed by TMA (cuda/matmul_tc_tma.cu): where wgmma_gemm_ready(), the driver makes
// tensor maps and PYSPEC_CUDA_WGMMA_TMA is not 0 (read at each call). Its activations are stored in
// slot order (xh: pair pp of each 32-value tile at k slot tile_slot(pp)), block-type weights
// dequantized in order; wgmma_gemm runs it where it is ready. forced: a configuration letter or 0.
bool wgmma_tma_ready();
void wgmma_tma_gemm(bool bf16, char forced, const MatmulPart* parts, int n_parts, int64_t r0, int64_t r1, const char* a,
                    int64_t ars, int64_t k, const uint16_t* xh, int64_t m, const SplitScratch& ws, cudaStream_t s);
// Rows [r0, r1) of a group over m activation columns xh (arranged_pitch(k) halves each): weight
// rows from a (halves, ars bytes apart) where a is not null, else in place (F16 or BF16 rows,
// 16-byte aligned). On the TMA-fed GEMM where wgmma_tma_ready() (xh in slot order, a's rows in
// order), else on the cp.async-fed one (xh and a's rows arranged).
void wgmma_gemm(bool bf16, const MatmulPart* parts, int n_parts, int64_t r0, int64_t r1, const char* a, int64_t ars,
                int64_t k, const uint16_t* xh, int64_t m, const SplitScratch& ws, cudaStream_t s);

}  // namespace tc
}  // namespace cuda
}  // namespace pyspec
