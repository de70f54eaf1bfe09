// The wide tensor-core GEMM on Hopper's wgmma (sm_90a), fed by cp.async: the same outputs, bit for
// bit, as the mma.sync GEMM of cuda/matmul_tc.cu, which stays for other GPUs and for
// PYSPEC_CUDA_WGMMA=0. The TMA-fed GEMM (cuda/matmul_tc_tma.cu) takes its calls where the driver
// makes tensor maps and PYSPEC_CUDA_WGMMA_TMA is not 0; this one serves the rest.
//
// Why the bits are the same. The fixed order (cuda/matmul_tc.cu) is: per output, chunks of 16
// products (chunk 0 of a 32-value tile holds values 8q .. 8q + 3, chunk 1 values 8q + 4 .. 8q + 7,
// q = 0..3), one k16 tensor-core step per chunk in increasing order into an F32 accumulator set to
// +0 at each 512-value segment, the segments' partials added in order. Measured on the H200
// (tools/device/probe_wgmma_bits.cu, 2M outputs with wide exponent ranges, 2026-11-30): a k16
// wgmma step gives exactly the bits of a k16 mma.sync with the same C and the same 16 products; the
// width N of the wgmma does not change a column's bits; and which k slot a product takes inside
// the step does not change them either (the step's sum does not depend on the slots' order). So
// this kernel only has to feed each k16 step the same 16 products: the converted operands are
// stored "arranged" (arranged_index: each chunk's 16 values consecutive), and F16/BF16 weights,
// read in place, are arranged on their way to shared memory by 8-byte copies.
//
// The kernel. A block of two warpgroups takes 128 weight rows (64 each: the wgmma's M) by BN
// activation columns (its N, 64, 96 or 128), a ring of kStages stages of 64 values of K: the weights'
// 128 rows x 128 bytes and the activations' BN rows x 128 bytes, each row's 16-byte units swizzled
// by the 128-byte pattern wgmma's descriptors name (unit u of row r at u ^ (r % 8)). All 256
// threads copy (cp.async), then each warpgroup runs a stage's four k16 steps (two where the last
// stage's second tile lies past K, as the mma.sync GEMM skips it) with one wgmma group in flight.
// Every eighth stage ends a segment: the accumulators go into the running totals (registers) and
// restart from +0. Split K (batches up to kWideSplitMaxM columns whose grid leaves SMs idle) stores
// each segment's partial apart, as the mma.sync GEMM does, for the same k_wide_split_sum.
#include <algorithm>
#include <cstdlib>
#include <stdexcept>

#include "cuda/cuda_backend.h"
#include "cuda/launch.cuh"
#include "cuda/matmul_tc_wide.cuh"
#include "cuda/wgmma.cuh"

namespace pyspec {
namespace cuda {
namespace tc {

namespace {

constexpr int kGK = 64;                           // k per stage: two 32-value tiles, four chunks
constexpr int kGRow = kGK * 2;                    // bytes of a row per stage (one 128-byte swizzle row)
constexpr int kGSegStages = kSegChunks * 16 / kGK;  // stages per K segment (8)
static_assert(kSegChunks * 16 % kGK == 0, "a segment is whole stages");

extern __shared__ unsigned char wgmma_smem[];

// One thread's share of a stage's copies, for kThreads copying threads: the weights' kRowsA rows
// and the activations' BN rows of 64 values, into a stage at `base` (weights, then activations;
// rows of 128 bytes, 16-byte units swizzled). Arranged rows: unit u = tid % 8 of rows
// tid / 8 + kPass16 i, 16-byte copies. Weights in place: the 8-byte piece pc = tid % 16 (values
// 4 pc .. 4 pc + 3 of the stage) of rows tid / 16 + kPass8 i, stored where arranged_index puts it.
// Either way a thread's rows share r % 8, so one swizzle serves them all. Rows past n, columns
// past m and tiles past K are zero-filled.
template <int kRowsA, int BN, int kThreads, bool kArrangedA>
struct StageCopier {
    static constexpr int kPass16 = kThreads / 8, kPass8 = kThreads / 16;  // rows one round of copies covers
    static constexpr int kAPass = kArrangedA ? kPass16 : kPass8;
    static constexpr int kACopies = kRowsA / kAPass, kBCopies = BN / kPass16;
    static constexpr uint32_t kStageBytes = static_cast<uint32_t>((kRowsA + BN) * kGRow);
    static_assert(kACopies * kAPass == kRowsA && kBCopies * kPass16 == BN, "whole copy rounds");

    const char* a_base;
    const char* a_src;
    const char* b_src;
    const uint16_t* xh;
    int64_t ars, kp, k, a_rows_left, b_cols_left;  // rows / columns from this thread's first to the end
    uint32_t a_dst, b_dst;
    int u, pc;

    __device__ __forceinline__ StageCopier(int tid, const char* a_base_, int64_t ars_, int64_t n, int64_t n0,
                                           const uint16_t* xh_, int64_t k_, int64_t m, int64_t m0)
        : a_base(a_base_), xh(xh_), ars(ars_), kp(arranged_pitch(k_)), k(k_), u(tid & 7), pc(tid & 15) {
        const int ru = tid >> 3, rp = tid >> 4;
        b_dst = static_cast<uint32_t>((kRowsA + ru) * kGRow + ((u ^ (ru & 7)) << 4));
        b_src = reinterpret_cast<const char*>(xh + (m0 + ru) * kp) + u * 16;
        b_cols_left = m - m0 - ru;
        if constexpr (kArrangedA) {
            a_dst = static_cast<uint32_t>(ru * kGRow + ((u ^ (ru & 7)) << 4));
            a_src = a_base + (n0 + ru) * ars + u * 16;
            a_rows_left = n - n0 - ru;
        } else {
            const int ao = (pc >> 3) * 64 + (pc & 1) * 32 + ((pc >> 1) & 3) * 8;  // arranged byte offset
            a_dst = static_cast<uint32_t>(rp * kGRow + (((ao >> 4) ^ (rp & 7)) << 4) + (ao & 15));
            a_src = a_base + (n0 + rp) * ars + pc * 8;
            a_rows_left = n - n0 - rp;
        }
    }

    __device__ __forceinline__ void load(uint32_t base, int st) const {
        const int64_t koff = static_cast<int64_t>(st) * kGRow;
        const bool b_in_k = static_cast<int64_t>(st) * kGK + (u >> 2) * 32 < k;  // whole tiles (zero tails)
        const bool a_in_k = kArrangedA ? b_in_k : static_cast<int64_t>(st) * kGK + pc * 4 < k;
#pragma unroll
        for (int i = 0; i < kACopies; ++i) {
            const bool v = a_in_k && i * kAPass < a_rows_left;
            const char* src = v ? a_src + i * kAPass * ars + koff : a_base;
            const uint32_t dst = base + a_dst + static_cast<uint32_t>(i * kAPass * kGRow);
            if constexpr (kArrangedA) {
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(v ? 16 : 0) : "memory");
            } else {
                asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(v ? 8 : 0) : "memory");
            }
        }
#pragma unroll
        for (int i = 0; i < kBCopies; ++i) {
            const bool v = b_in_k && i * kPass16 < b_cols_left;
            const char* src = v ? b_src + i * kPass16 * kp * 2 + koff : reinterpret_cast<const char*>(xh);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(base + b_dst + i * kPass16 * kGRow), "l"(src),
                         "r"(v ? 16 : 0)
                         : "memory");
        }
    }
};

// Block tile kGRows weight rows x BN activation columns; kStages-deep ring (kStages - 2 stages
// loading while one is read and one may still be in a wgmma). kArrangedA: the weight rows are
// arranged halves (converted); else F16/BF16 rows in place, arranged by 8-byte copies.
template <bool kBF16, int kWG, int BN, int kStages, bool kArrangedA, int kMinBlocks>
__global__ void __launch_bounds__(kWG * 128, kMinBlocks)
    k_mul_mat_wgmma(WideParts p, int64_t k, const uint16_t* __restrict__ xh, int64_t m, int seg_per_split,
                    float* __restrict__ partial) {
#ifdef PYSPEC_HAS_WGMMA
    pdl_enter();
    static_assert(kStages >= 3, "a stage loads while one is read and one may be in a wgmma");
    constexpr int kAcc = BN / 2;
    constexpr int kGRows = 64 * kWG, kThreads = 128 * kWG;
    using Copier = StageCopier<kGRows, BN, kThreads, kArrangedA>;
    constexpr uint32_t kStageBytes = Copier::kStageBytes;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int tile = static_cast<int>(blockIdx.y);
    const int j = wide_part_of(p, tile);
    const int64_t n = pick(p.n, j), n0 = static_cast<int64_t>(tile - pick(p.tile0, j)) * kGRows;
    const int64_t m0 = static_cast<int64_t>(blockIdx.x) * BN;
    const int n_stages_k = static_cast<int>((k + kGK - 1) / kGK);
    const int st_begin = partial ? static_cast<int>(blockIdx.z) * seg_per_split * kGSegStages : 0;
    const int st_end = partial ? min(n_stages_k, st_begin + seg_per_split * kGSegStages) : n_stages_k;
    const int n_stages = st_end - st_begin;
    const uint32_t smem0 = (smem_addr(wgmma_smem) + 1023u) & ~1023u;  // the swizzle's 1024-byte atoms
    const Copier copier(tid, pick(p.a, j), pick(p.ars, j), n, n0, xh, k, m, m0);
    auto load_stage = [&](int slot, int st) { copier.load(smem0 + static_cast<uint32_t>(slot) * kStageBytes, st); };

    float acc[kAcc], tot[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
        acc[i] = 0.0f;
        tot[i] = 0.0f;
    }
    // Accumulator i of this thread: row 16 warp + g + 8 ((i / 2) % 2) of the warpgroup's 64,
    // column 8 (i / 4) + 2 t + i % 2.
    const int g = lane >> 2, t = lane & 3;
    const int64_t row_base = wg * 64 + warp * 16 + g;
    auto end_segment = [&](bool first, bool last, int seg) {
        if (partial) {
            const int64_t pitch = static_cast<int64_t>(gridDim.y) * kGRows;
#pragma unroll
            for (int i = 0; i < kAcc; ++i) {
                const int64_t row = static_cast<int64_t>(tile) * kGRows + row_base + 8 * ((i >> 1) & 1);
                const int64_t c = m0 + 8 * (i >> 2) + 2 * t + (i & 1);
                if (c < m) partial[(static_cast<int64_t>(seg) * m + c) * pitch + row] = acc[i];
                acc[i] = 0.0f;
            }
            return;
        }
#pragma unroll
        for (int i = 0; i < kAcc; ++i) {
            tot[i] = first ? acc[i] : __fadd_rn(tot[i], acc[i]);  // p_0 as is, then the adds in segment order
            if (!last) acc[i] = 0.0f;
        }
    };

#pragma unroll
    for (int s = 0; s < kStages - 2; ++s) {
        if (s < n_stages) load_stage(s, st_begin + s);
        cp_async_commit();
    }
    for (int ls = 0; ls < n_stages; ++ls) {
        cp_async_wait<kStages - 3>();  // stage ls has landed (this thread's copies)
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async wrote it; wgmma reads it
        __syncthreads();  // everyone's copies; and every warpgroup is done with stage ls - 2
        const int st = st_begin + ls;
        const uint32_t cur = smem0 + static_cast<uint32_t>(ls % kStages) * kStageBytes;
        const uint32_t a_s = cur + static_cast<uint32_t>(wg * 64 * kGRow), b_s = cur + static_cast<uint32_t>(kGRows * kGRow);
        // Tile 1 of the last stage may lie past the row's last chunk: skipped, not run as zeros.
        const bool two = static_cast<int64_t>(st) * kGK + 32 < k;
        fence_operands(acc);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        wgmma_step<kBF16, BN>(acc, wgmma_desc(a_s), wgmma_desc(b_s));
        wgmma_step<kBF16, BN>(acc, wgmma_desc(a_s + 32), wgmma_desc(b_s + 32));
        if (two) {
            wgmma_step<kBF16, BN>(acc, wgmma_desc(a_s + 64), wgmma_desc(b_s + 64));
            wgmma_step<kBF16, BN>(acc, wgmma_desc(a_s + 96), wgmma_desc(b_s + 96));
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        // The copies of stage ls + kStages - 2 (into the slot of stage ls - 2) go out while the
        // tensor cores run this stage: issued first, the wgmmas need not wait for them.
        const int nx = ls + kStages - 2;
        if (nx < n_stages) load_stage(nx % kStages, st_begin + nx);
        cp_async_commit();
        const bool last = ls + 1 == n_stages;
        if (last || (st + 1) % kGSegStages == 0) {
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            fence_operands(acc);
            end_segment(st < kGSegStages, last, st / kGSegStages);
        } else {
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // stage ls - 1 is done
        }
    }
    cp_async_wait<0>();  // only empty groups remain; nothing may be in flight at exit
    if (partial) return;  // k_wide_split_sum stores

    const WideOut out(p, j);
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
        const int64_t r = n0 + row_base + 8 * ((i >> 1) & 1), c = m0 + 8 * (i >> 2) + 2 * t + (i & 1);
        if (r < n && c < m) out.store(r, c, tot[i]);
    }
#else
    (void)p; (void)k; (void)xh; (void)m; (void)seg_per_split; (void)partial;
    __trap();  // not built for sm_90a: wgmma_gemm_ready() never selects it
#endif
}

// Writes 1 where this build has the kernel's sm_90a code for the running GPU.
__global__ void k_wgmma_built(int* out) {
#ifdef PYSPEC_HAS_WGMMA
    *out = 1;
#else
    *out = 0;
#endif
}

// One launch configuration: kWG warpgroups of 64 weight rows, BN columns.
template <bool kBF16, int kWG, int BN, int kStages, bool kArrangedA, int kMinBlocks>
struct WgmmaConfig {
    static constexpr int kRows = 64 * kWG, kThreads = 128 * kWG;
    static constexpr size_t kSmem = static_cast<size_t>(kStages) * (kRows + BN) * kGRow + 1024;  // + alignment
    static constexpr auto kernel = k_mul_mat_wgmma<kBF16, kWG, BN, kStages, kArrangedA, kMinBlocks>;
    static int blocks_per_sm() {
        static const int b = resident_blocks(kernel, kThreads, kSmem);
        return b;
    }
    static void run(const WideParts& p, int64_t k, const uint16_t* xh, int64_t m, const SplitScratch& ws, cudaStream_t s) {
        launch_wide(kernel, kThreads, kSmem, blocks_per_sm(), kRows, BN, p, k, xh, m, ws, s);
    }
    // The time of the launch's last wave, in units of one block's work at rate 1 (waves of SMs x
    // blocks per SM, a wave taking blocks per SM x block tile / rate).
    static double cost(const MatmulPart* parts, int n_parts, int64_t r0, int64_t r1, int64_t m, double rate) {
        const WideParts p = wide_parts(parts, n_parts, r0, r1, nullptr, 0, kRows);
        const int64_t blocks = static_cast<int64_t>(p.tile0[p.np]) * ((m + BN - 1) / BN);
        const int64_t slots = static_cast<int64_t>(sm_count()) * blocks_per_sm();
        return static_cast<double>((blocks + slots - 1) / slots) * blocks_per_sm() * kRows * BN / rate;
    }
};

// The configurations (speed only; every one runs each output's steps unchanged), measured on the
// H200 (2026-11-30, Qwen3-4B F16 pp512, MUL_MAT time of the prompt pass; the mma.sync GEMM 22.0 ms):
//   L: 2 warpgroups, 128 rows x 128 columns, 4 stages, 129 KB: one block per SM (18.4-18.5 ms).
//   S: 2 warpgroups, 128 x 64, 4 stages, 97 KB: two blocks per SM (20.3 ms; for narrow batches, where
//      L's columns would be mostly padding).
// Measured and dropped: L with 6 stages (18.5 ms), 1 warpgroup of 64 x 128 with two blocks per SM
// (19.2-19.6 ms), and a warp-specialized kernel (a copying warpgroup, two wgmma warpgroups,
// mbarriers, setmaxnreg: 22.5 ms). Issuing a stage's copies after its wgmmas instead of before
// changed nothing. ncu (L, the q/k/v launch at M = 512: 62 us, 260 TFLOP/s): 1.45 waves, the
// SMs active 69% of the time, 2 warps per scheduler issuing every 2.4 cycles, the tensor pipes far
// from busy; the bound is feeding shared memory by cp.async (TMA cannot arrange the in-place
// weights' 8-byte pieces).
//   M: 2 warpgroups, 128 x 96, 4 stages, 113 KB: one block per SM, for grids L leaves short of a
//      wave: Qwen3-4B's o and down (2560 rows) at M = 512 are 80 blocks of L for 132 SMs, 120 of M.
template <bool kBF16, bool kArrangedA>
struct WgmmaConfigs {
    using L = WgmmaConfig<kBF16, 2, 128, 4, kArrangedA, 1>;
    using M = WgmmaConfig<kBF16, 2, 96, 4, kArrangedA, 1>;
    using S = WgmmaConfig<kBF16, 2, 64, 4, kArrangedA, 2>;
};

// PYSPEC_CUDA_WGMMA_CFG=L, M or S forces a configuration (measurements); by default the one whose
// last wave ends first (L on ties, then S), M left out with PYSPEC_CUDA_WGMMA_M=0 (A/B runs).
char forced_config() {
    const char* v = std::getenv("PYSPEC_CUDA_WGMMA_CFG");
    return v && (v[0] == 'L' || v[0] == 'M' || v[0] == 'S') ? v[0] : 0;
}

template <bool kBF16, bool kArrangedA>
void wgmma_choose(const MatmulPart* parts, int n_parts, int64_t r0, int64_t r1, const char* a, int64_t ars, int64_t k,
                  const uint16_t* xh, int64_t m, const SplitScratch& ws, cudaStream_t s) {
    using C = WgmmaConfigs<kBF16, kArrangedA>;
    char pick_cfg = forced_config();
    if (!pick_cfg) {
        const double l = C::L::cost(parts, n_parts, r0, r1, m, 1.0), sc = C::S::cost(parts, n_parts, r0, r1, m, 1.0),
                     mc = env_switch("PYSPEC_CUDA_WGMMA_M") != 0 ? C::M::cost(parts, n_parts, r0, r1, m, 1.0) : 1e300;
        pick_cfg = l <= sc && l <= mc ? 'L' : sc <= mc ? 'S' : 'M';
    }
    if (pick_cfg == 'S') return C::S::run(wide_parts(parts, n_parts, r0, r1, a, ars, C::S::kRows), k, xh, m, ws, s);
    if (pick_cfg == 'M') return C::M::run(wide_parts(parts, n_parts, r0, r1, a, ars, C::M::kRows), k, xh, m, ws, s);
    C::L::run(wide_parts(parts, n_parts, r0, r1, a, ars, C::L::kRows), k, xh, m, ws, s);
}

// Shorter rows stay on the mma.sync GEMM: measured on the H200 (2026-11-30, bench_cuda.py, one
// run), SmolLM2-135M Q4_1 pp512 lost 81.5k -> 76.3k t/s with its K = 576 gate/up on wgmma (nine
// stages a block: the ring barely fills). Qwen3-4B's K (2560 and up) gains: pp512 17.3k -> 20.4k,
// par64 7,444 -> 7,739.
constexpr int64_t kWgmmaMinK = 1024;

// Blocks of the configuration with the most of them (S) over rows [0, rows) of a group.
int64_t wgmma_blocks(const MatmulPart* parts, int n_parts, int64_t rows, int64_t m) {
    const WideParts p = wide_parts(parts, n_parts, 0, rows, nullptr, 0, WgmmaConfigs<false, false>::S::kRows);
    return static_cast<int64_t>(p.tile0[p.np]) * ((m + 63) / 64);
}

}  // namespace

bool wgmma_gemm_suits(const MatmulPart* parts, int n_parts, int64_t rows, int64_t k, int64_t m) {
    if (!wgmma_gemm_ready()) return false;
    return forced_config() || (k >= kWgmmaMinK && wgmma_blocks(parts, n_parts, rows, m) >= sm_count());
}

bool wgmma_gemm_ready() {
    static const bool built = [] {
        int dev = 0, major = 0, minor = 0;
        if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess || major != 9 || minor != 0) {
            return false;
        }
        return flag_kernel_writes_one(k_wgmma_built);
    }();
    return built && env_switch("PYSPEC_CUDA_WGMMA") != 0;
}

void wgmma_gemm(bool bf16, const MatmulPart* parts, int n_parts, int64_t r0, int64_t r1, const char* a, int64_t ars,
                int64_t k, const uint16_t* xh, int64_t m, const SplitScratch& ws, cudaStream_t s) {
    if (wgmma_tma_ready()) return wgmma_tma_gemm(bf16, forced_config(), parts, n_parts, r0, r1, a, ars, k, xh, m, ws, s);
    if (bf16) {
        if (a) return wgmma_choose<true, true>(parts, n_parts, r0, r1, a, ars, k, xh, m, ws, s);
        return wgmma_choose<true, false>(parts, n_parts, r0, r1, a, ars, k, xh, m, ws, s);
    }
    if (a) return wgmma_choose<false, true>(parts, n_parts, r0, r1, a, ars, k, xh, m, ws, s);
    wgmma_choose<false, false>(parts, n_parts, r0, r1, a, ars, k, xh, m, ws, s);
}

}  // namespace tc
}  // namespace cuda

bool cuda_wgmma_gemm() { return cuda::tc::wgmma_gemm_ready(); }

}  // namespace pyspec
