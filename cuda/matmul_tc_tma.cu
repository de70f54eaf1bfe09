// The wide tensor-core GEMM fed by the Tensor Memory Accelerator (TMA, sm_90a): the same outputs,
// bit for bit, as the mma.sync GEMM (cuda/matmul_tc.cu) and the cp.async-fed wgmma GEMM
// (cuda/matmul_tc_wgmma.cu), which stays for PYSPEC_CUDA_WGMMA_TMA=0 and where a tensor map cannot
// be made.
//
// Why it exists. The cp.async GEMM's threads both copy and multiply, and F16/BF16 weights read in
// place have to be arranged on their way to shared memory by 8-byte copies (a k16 step's 16
// values are 4-value runs of a 32-value tile, tc::tile_slot). ncu: its tensor pipes sat far from
// busy behind address arithmetic, barriers and copy waits. Here one thread issues a stage's two
// bulk copies (weights and activations, each one TMA instruction into the 128-byte-swizzled
// layout), an mbarrier per stage says when they landed and another when both warpgroups are done
// with the slot, and the two warpgroups only load fragments and multiply.
//
// Why the bits are the same. The weights arrive in their natural order, so the wgmma takes them
// from registers (its A operand as an m16n8k16 fragment per warp), loaded exactly as the mma.sync
// GEMM loads its fragments: lane t's 16 bytes at byte 16 t of a row's 32-value tile are its words
// of both chunks (pairs 4t, 4t + 1 into chunk 0's slots 2t and 2t + 8, pairs 4t + 2, 4t + 3 into
// chunk 1's). The activations (B, from shared memory through the descriptor) are stored by the
// conversion in that same slot order (k_wide_x_halves, layout Slots: pair pp of a tile at slot
// tile_slot(pp)), so every k16 step multiplies the same pairs of values in the same slots as the
// mma.sync GEMM's step, and a k16 wgmma step gives an mma.sync step's bits
// (tools/device/probe_wgmma_bits.cu). Segments, the skipped half stage at the end of K, split K and
// the epilogue are the other GEMMs'.
//
// Shared-memory banks. A warp's 16 weight rows are taken in the order sigma(g) = g / 2 + 4 (g % 2)
// (g = lane / 4), so the 8 lanes of one 16-byte load phase read rows q and q + 4, whose swizzled
// units fall in different halves of the 128-byte bank line: no conflicts. The accumulators' rows
// follow the same order (row g of the wgmma's D is weight row sigma(g)).
#include <cuda.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>

#include "cuda/cuda_backend.h"
#include "cuda/launch.cuh"
#include "cuda/matmul_tc_wide.cuh"
#include "cuda/tma.cuh"
#include "cuda/wgmma.cuh"

namespace pyspec {
namespace cuda {
namespace tc {

namespace {

constexpr int kTK = 64;                               // k per stage: two 32-value tiles, four k16 steps
constexpr int kTRow = kTK * 2;                        // bytes of a row per stage (one 128-byte swizzle row)
constexpr int kTSegStages = kSegChunks * 16 / kTK;    // stages per K segment (8)
constexpr int kTRows = 128;                           // weight rows a block: two warpgroups of 64
constexpr int kTConsumers = 256;                      // the two warpgroups' threads
constexpr int kTThreads = kTConsumers + 128;          // + a warpgroup whose first thread issues the copies
static_assert(kSegChunks * 16 % kTK == 0, "a segment is whole stages");

// The tensor maps of one launch: the weights of each part (rows of K halves) and the activations.
struct TmaMaps {
    CUtensorMap a[kMaxMatmulParts];
    CUtensorMap b;
};

extern __shared__ unsigned char tma_smem[];

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}

// A stage of kStages: the weights' 128 rows, then the activations' BN rows, 128 bytes each.
template <int BN>
constexpr uint32_t stage_bytes() {
    return static_cast<uint32_t>((kTRows + BN) * kTRow);
}

template <bool kBF16, int BN, int kStages, int kMinBlocks>
__global__ void __launch_bounds__(kTThreads, kMinBlocks)
    k_mul_mat_wgmma_tma(const __grid_constant__ TmaMaps maps, WideParts p, int64_t k, int64_t m, int seg_per_split,
                        float* __restrict__ partial) {
#ifdef PYSPEC_HAS_WGMMA
    pdl_enter();
    static_assert(kStages >= 2, "a stage loads while another is read");
    constexpr int kAcc = BN / 2;
    constexpr uint32_t kStage = stage_bytes<BN>();
    static_assert(kStage % 1024 == 0, "every stage's rows start a swizzle atom");
    const int tid = threadIdx.x;
    const int tile = static_cast<int>(blockIdx.y);
    const int j = wide_part_of(p, tile);
    const int64_t n0 = static_cast<int64_t>(tile - pick(p.tile0, j)) * kTRows;
    const int64_t m0 = static_cast<int64_t>(blockIdx.x) * BN;
    const int n_stages_k = static_cast<int>((k + kTK - 1) / kTK);
    const int st_begin = partial ? static_cast<int>(blockIdx.z) * seg_per_split * kTSegStages : 0;
    const int st_end = partial ? min(n_stages_k, st_begin + seg_per_split * kTSegStages) : n_stages_k;
    const int n_stages = st_end - st_begin;
    const uint32_t smem0 = (smem_addr(tma_smem) + 1023u) & ~1023u;  // the swizzle's 1024-byte atoms
    const uint32_t full0 = smem0 + kStages * kStage, empty0 = full0 + 8 * kStages;  // mbarriers

    if (tid == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full0 + 8 * s, 1);  // the copying thread's expect_tx; the copies' bytes
            mbar_init(empty0 + 8 * s, kTConsumers / 32);  // one arrival per consuming warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    // The registers go to the multiplying warpgroups (the copying one needs few; the SM's register
    // file is split by warpgroup-sized quarters, so without this a 3-warpgroup block gets 168 each).
    if (tid >= kTConsumers) {  // the copying warpgroup
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (tid == kTConsumers) {
            const CUtensorMap* amap = &maps.a[0];
#pragma unroll
            for (int i = 1; i < kMaxMatmulParts; ++i) amap = j == i ? &maps.a[i] : amap;
            for (int ls = 0; ls < n_stages; ++ls) {
                const int slot = ls % kStages;
                const uint32_t use = static_cast<uint32_t>(ls / kStages);
                mbar_wait(empty0 + 8 * slot, (use & 1u) ^ 1u);  // the slot's previous stage is done (none at first)
                const uint32_t full = full0 + 8 * slot, base = smem0 + static_cast<uint32_t>(slot) * kStage;
                mbar_expect_tx(full, kStage);
                const int kc = (st_begin + ls) * kTK;
                tma_load_2d(base, amap, kc, static_cast<int>(n0), full);
                tma_load_2d(base + kTRows * kTRow, &maps.b, kc, static_cast<int>(m0), full);
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int sg = (g >> 1) | ((g & 1) << 2);  // sigma(g): conflict-free 16-byte loads
    // This lane's two weight rows (sigma(g) and sigma(g) + 8 of its warp's 16) within the block.
    const int r_lo = wg * 64 + warp * 16 + sg, r_hi = r_lo + 8;

    float acc[kAcc], tot[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
        acc[i] = 0.0f;
        tot[i] = 0.0f;
    }
    // Accumulator i of this thread: row sigma(g) + 8 ((i / 2) % 2) of its warp's 16, column
    // 8 (i / 4) + 2 t + i % 2.
    auto end_segment = [&](bool first, bool last, int seg) {
        if (partial) {
            const int64_t pitch = static_cast<int64_t>(gridDim.y) * kTRows;
#pragma unroll
            for (int i = 0; i < kAcc; ++i) {
                const int64_t row = static_cast<int64_t>(tile) * kTRows + (((i >> 1) & 1) ? r_hi : r_lo);
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

    // A fragments of a stage: steps 0..3, four words each (a0 row lo, a1 row hi, a2 row lo, a3
    // row hi); two sets, so a stage's loads never touch registers the previous stage's wgmmas read.
    uint32_t fa[2][16];
    int released = 0;  // stages whose slot was handed back to the copying thread
    auto run_stage = [&](int ls, uint32_t (&f)[16]) {
        const int slot = ls % kStages;
        mbar_wait(full0 + 8 * slot, static_cast<uint32_t>(ls / kStages) & 1u);
        const uint32_t base = smem0 + static_cast<uint32_t>(slot) * kStage;
        const int st = st_begin + ls;
#pragma unroll
        for (int tau = 0; tau < 2; ++tau) {
            const int u = 4 * tau + t;  // this lane's 16-byte unit of the 64-value row
            const uint4 lo = lds128(base + r_lo * kTRow + ((u ^ (r_lo & 7)) << 4));
            const uint4 hi = lds128(base + r_hi * kTRow + ((u ^ (r_hi & 7)) << 4));
            uint32_t* s0 = f + 8 * tau;  // step 2 tau: pairs 4t (slot 2t), 4t + 1 (slot 2t + 8)
            s0[0] = lo.x; s0[1] = hi.x; s0[2] = lo.y; s0[3] = hi.y;
            uint32_t* s1 = s0 + 4;       // step 2 tau + 1: pairs 4t + 2, 4t + 3
            s1[0] = lo.z; s1[1] = hi.z; s1[2] = lo.w; s1[3] = hi.w;
        }
        // Tile 1 of the last stage may lie past the row's last chunk: skipped, not run as zeros.
        const bool two = static_cast<int64_t>(st) * kTK + 32 < k;
        const uint32_t b_s = base + kTRows * kTRow;
        fence_operands(acc);
        fence_operands(f);
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            if (s < 2 || two) {
                const uint32_t fs[4] = {f[4 * s], f[4 * s + 1], f[4 * s + 2], f[4 * s + 3]};
                wgmma_step_rs<kBF16, BN>(acc, fs, wgmma_desc(b_s + 32 * s));
            }
        }
        wgmma_commit();
        const bool last = ls + 1 == n_stages;
        int done_to;  // stages before this one are complete
        if (last || (st + 1) % kTSegStages == 0) {
            wgmma_wait<0>();
            fence_operands(acc);
            done_to = ls + 1;
        } else {
            wgmma_wait<1>();  // stage ls - 1 is done
            done_to = ls;
        }
        fence_operands(f);
        for (; released < done_to; ++released) {
            if (lane == 0) mbar_arrive(empty0 + 8 * (released % kStages));
        }
        if (done_to == ls + 1) end_segment(st < kTSegStages, last, st / kTSegStages);
    };
    for (int ls = 0; ls < n_stages; ls += 2) {
        run_stage(ls, fa[0]);
        if (ls + 1 < n_stages) run_stage(ls + 1, fa[1]);
    }
    if (partial) return;  // k_wide_split_sum stores

    const WideOut out(p, j);
    const int64_t n = pick(p.n, j);
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
        const int64_t r = n0 + (((i >> 1) & 1) ? r_hi : r_lo), c = m0 + 8 * (i >> 2) + 2 * t + (i & 1);
        if (r < n && c < m) out.store(r, c, tot[i]);
    }
#else
    (void)maps; (void)p; (void)k; (void)m; (void)seg_per_split; (void)partial;
    __trap();  // not built for sm_90a: wgmma_tma_ready() never selects it
#endif
}

// A 2-D map of `rows` rows of `cols` halves, `pitch` bytes apart, read in boxes of 64 halves x
// box_rows rows into the 128-byte-swizzled layout; reads past either edge give zeros.
void make_map(CUtensorMap* map, bool bf16, const void* base, int64_t cols, int64_t rows, int64_t pitch, int box_rows) {
    make_map_2d(map, bf16, base, cols, rows, pitch, kTK, box_rows, true);
}

// One launch configuration: 128 weight rows x BN columns, kStages stages.
template <bool kBF16, int BN, int kStages, int kMinBlocks>
struct TmaConfig {
    static constexpr size_t kSmem = static_cast<size_t>(kStages) * stage_bytes<BN>() + 16 * kStages + 1024;  // + barriers, alignment
    static constexpr auto kernel = k_mul_mat_wgmma_tma<kBF16, BN, kStages, kMinBlocks>;
    static int blocks_per_sm() {
        static const int b = resident_blocks(kernel, kTThreads, kSmem);
        return b;
    }
    // The time of the launch's last wave, in units of one block column's work (waves x columns).
    static double cost(const MatmulPart* parts, int n_parts, int64_t r0, int64_t r1, int64_t m) {
        const WideParts p = wide_parts(parts, n_parts, r0, r1, nullptr, 0, kTRows);
        const int64_t blocks = static_cast<int64_t>(p.tile0[p.np]) * ((m + BN - 1) / BN);
        const int64_t slots = static_cast<int64_t>(sm_count()) * blocks_per_sm();
        return static_cast<double>((blocks + slots - 1) / slots) * blocks_per_sm() * BN;
    }
    static void run(const WideParts& p, int64_t k, const uint16_t* xh, int64_t m, const SplitScratch& ws, cudaStream_t s) {
        TmaMaps maps{};
        for (int i = 0; i < p.np; ++i) make_map(&maps.a[i], kBF16, p.a[i], k, p.n[i], p.ars[i], kTRows);
        for (int i = p.np; i < kMaxMatmulParts; ++i) maps.a[i] = maps.a[0];
        make_map(&maps.b, kBF16, xh, arranged_pitch(k), m, arranged_pitch(k) * 2, BN);
        const int64_t tiles = p.tile0[p.np];
        const WideSplit sp = wide_split(m, tiles, kTRows, BN, static_cast<int64_t>(sm_count()) * blocks_per_sm(), k, ws);
        const dim3 grid(static_cast<unsigned>((m + BN - 1) / BN), static_cast<unsigned>(tiles), static_cast<unsigned>(sp.splits));
        if (sp.splits == 1) {
            launch(kernel, grid, kTThreads, kSmem, s, maps, p, k, m, sp.per, static_cast<float*>(nullptr));
            return;
        }
        launch(kernel, grid, kTThreads, kSmem, s, maps, p, k, m, sp.per, ws.partial);
        launch_wide_split_sum(p, kTRows, static_cast<int>(n_segments(k)), m, ws.partial, s);
    }
};

// The configurations, as the cp.async GEMM's (cuda/matmul_tc_wgmma.cu): L 128 x 128, M 128 x 96
// and S 128 x 64, one block per SM (the multiplying warpgroups take 232 registers a thread). The
// choice is the cp.async GEMM's (the last wave's end). Measured and dropped (H200, 2026-11-30,
// Qwen3-4B pp512): weighting a column of M by 1.35 and of S by 1.5 against L's (their ncu rates),
// which put every call on L: MUL_MAT 11.8 -> 12.3 ms (o and down at 80 blocks of L for 132 SMs).
template <bool kBF16>
struct TmaConfigs {
    using L = TmaConfig<kBF16, 128, 5, 1>;
    using M = TmaConfig<kBF16, 96, 6, 1>;
    using S = TmaConfig<kBF16, 64, 6, 1>;
};

template <bool kBF16>
void tma_choose(char forced, const MatmulPart* parts, int n_parts, int64_t r0, int64_t r1, const char* a, int64_t ars,
                int64_t k, const uint16_t* xh, int64_t m, const SplitScratch& ws, cudaStream_t s) {
    using C = TmaConfigs<kBF16>;
    char cfg = forced;
    if (!cfg) {
        const double l = C::L::cost(parts, n_parts, r0, r1, m), sc = C::S::cost(parts, n_parts, r0, r1, m),
                     mc = env_switch("PYSPEC_CUDA_WGMMA_M") != 0 ? C::M::cost(parts, n_parts, r0, r1, m) : 1e300;
        cfg = l <= sc && l <= mc ? 'L' : sc <= mc ? 'S' : 'M';
    }
    if (cfg == 'S') return C::S::run(wide_parts(parts, n_parts, r0, r1, a, ars, kTRows), k, xh, m, ws, s);
    if (cfg == 'M') return C::M::run(wide_parts(parts, n_parts, r0, r1, a, ars, kTRows), k, xh, m, ws, s);
    C::L::run(wide_parts(parts, n_parts, r0, r1, a, ars, kTRows), k, xh, m, ws, s);
}

}  // namespace

bool wgmma_tma_ready() {
    return wgmma_gemm_ready() && env_switch("PYSPEC_CUDA_WGMMA_TMA") != 0 && tensor_maps_available();
}

void wgmma_tma_gemm(bool bf16, char forced, const MatmulPart* parts, int n_parts, int64_t r0, int64_t r1, const char* a,
                    int64_t ars, int64_t k, const uint16_t* xh, int64_t m, const SplitScratch& ws, cudaStream_t s) {
    if (bf16) return tma_choose<true>(forced, parts, n_parts, r0, r1, a, ars, k, xh, m, ws, s);
    tma_choose<false>(forced, parts, n_parts, r0, r1, a, ars, k, xh, m, ws, s);
}

}  // namespace tc
}  // namespace cuda
}  // namespace pyspec
