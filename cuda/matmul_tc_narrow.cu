// MUL_MAT on tensor cores for narrow batches (M <= 16: decode, verify, drafting), with the bits of
// the wide kernel (cuda/matmul_tc.cu) for every output, so which of the two runs is a speed choice
// only (design.md invariant 7).
//
// Same computation. An output (n, m) is one F32 accumulator set to +0.0f and updated by one
// m16n8k16 mma per k-chunk c = 0 .. ceil(K / 32) * 2 - 1 in increasing c, the weight rows as the
// mma's A, the activation columns as its B, exactly as in the wide kernel. The operands are built
// by the same functions (cuda/matmul_tc_common.cuh): float weights go to shared memory as stored
// and are read by the same ldmatrix; block types are converted by load_w + w_halves, stored as
// halves and read by the same ldmatrix; activations are rounded by the same conversion (f2h, or
// f2bf for BF16 weights); k past K is zero on both sides.
//
// Different schedule. The wide kernel stages a 32-k tile of 128 rows at a time through registers,
// which keeps too few bytes in flight to stream a weight matrix at HBM speed when M is small
// (decode is bound by reading the weights once). Here one warp owns 16 weight rows and all of K,
// and keeps 8 stages of its rows in flight with cp.async (16, 8 or 4 bytes per copy,
// by the rows' alignment), so the loads need no registers and a warp has ~30 KB on the way. A
// launch takes up to kMaxMatmulParts weight matrices over the same activations (q/k/v, gate/up).
#include <mutex>
#include <type_traits>

#include "cuda/matmul_tc_common.cuh"

namespace pyspec {
namespace cuda {
namespace {

using namespace tc;

constexpr int kRows = 16;    // weight rows per warp: one m16 tile
// Stages in flight per warp. 16 measured slower than 8 on the H200 (Qwen3-4B tg128 112 against
// 135 t/s): fewer blocks fit an SM, and a warp's throughput is bound by its own chain, not by
// the bytes it has on the way.
constexpr int kStages = 8;

template <DType T>
constexpr bool float_weights() { return T == DType::F16 || T == DType::BF16; }

// k per stage: 8 chunks for float weights (256 bytes of a row), 16 chunks (8 blocks) for block
// types, whose rows are 3.5-8x denser.
template <DType T>
constexpr int stage_k() { return float_weights<T>() ? 128 : 256; }

template <DType T>
constexpr int stage_bytes() {  // bytes of one row per stage
    if constexpr (float_weights<T>()) return stage_k<T>() * 2;
    else if constexpr (T == DType::Q8_0) return 8 * static_cast<int>(sizeof(BlockQ8_0));
    else if constexpr (T == DType::Q4_0) return 8 * static_cast<int>(sizeof(BlockQ4_0));
    else return 8 * static_cast<int>(sizeof(BlockQ4_1));
}

// The weight matrices of one launch; part j's tiles of 16 rows are blocks tile0[j] .. tile0[j+1]-1.
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

// G bytes from global to shared memory, asynchronously; !valid fills zeros (src-size 0).
template <int G>
__device__ __forceinline__ void cp_async(void* dst, const void* src, bool valid) {
    const uint32_t d = smem_addr(dst);
    const int n = valid ? G : 0;
    if constexpr (G == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(n) : "memory");
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(d), "l"(src), "n"(G), "r"(n) : "memory");
    }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Shared memory of one block: kStages stages, each the 16 rows' raw bytes (a row's pitch of SB + 16
// keeps 16-byte alignment and puts the 8 rows of an ldmatrix on distinct banks) and the m
// activation columns' SK floats.
template <DType T>
constexpr int w_pitch() { return stage_bytes<T>() + 16; }
template <DType T>
size_t narrow_smem_bytes(int64_t m) {
    return static_cast<size_t>(kStages) * (kRows * w_pitch<T>() + static_cast<size_t>(m) * stage_k<T>() * 4);
}

// The A fragment of mma chunk ks of a stage of block-type rows, dequantized straight from the raw
// blocks: a[0] = row g, chunk columns 2t, 2t + 1; a[1] = row g + 8, same columns; a[2], a[3] = the
// same rows at columns 2t + 8, 2t + 9 (g = lane / 4, t = lane % 4). Chunk ks is half ks & 1 of
// block ks / 2 of the stage: values 16 (ks & 1) + column.
template <DType T>
__device__ __forceinline__ void a_from_blocks(uint32_t (&a)[4], const unsigned char* wst, int ks, int lane) {
    constexpr int kPitch = w_pitch<T>();
    const int g = lane >> 2, c = 2 * (lane & 3), half = ks & 1;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const unsigned char* row = wst + (g + 8 * rr) * kPitch;
        uint16_t h[4];
        if constexpr (T == DType::Q8_0) {
            const char* blk = reinterpret_cast<const char*>(row) + (ks >> 1) * static_cast<int>(sizeof(BlockQ8_0));
            const float d = h2f(ld16(blk));
            const char* q = blk + 2 + 16 * half + c;
            h[0] = deq_half<T>(d, 0.0f, static_cast<int8_t>(q[0]));
            h[1] = deq_half<T>(d, 0.0f, static_cast<int8_t>(q[1]));
            h[2] = deq_half<T>(d, 0.0f, static_cast<int8_t>(q[8]));
            h[3] = deq_half<T>(d, 0.0f, static_cast<int8_t>(q[9]));
        } else {
            constexpr int kBlk = T == DType::Q4_0 ? static_cast<int>(sizeof(BlockQ4_0)) : static_cast<int>(sizeof(BlockQ4_1));
            constexpr int kQs = T == DType::Q4_0 ? 2 : 4;
            const char* blk = reinterpret_cast<const char*>(row) + (ks >> 1) * kBlk;
            const float d = h2f(ld16(blk));
            const float mn = T == DType::Q4_1 ? h2f(ld16(blk + 2)) : 0.0f;
            const unsigned char* q = reinterpret_cast<const unsigned char*>(blk) + kQs + c;
            const int sh = 4 * half;  // values 0..15: low nibbles of qs[j]; 16..31: high nibbles of qs[j - 16]
            h[0] = deq_half<T>(d, mn, (q[0] >> sh) & 15);
            h[1] = deq_half<T>(d, mn, (q[1] >> sh) & 15);
            h[2] = deq_half<T>(d, mn, (q[8] >> sh) & 15);
            h[3] = deq_half<T>(d, mn, (q[9] >> sh) & 15);
        }
        a[rr] = pack2(h[0], h[1]);
        a[2 + rr] = pack2(h[2], h[3]);
    }
}

// One block = one warp = 16 rows of one part and NT tiles of 8 activation columns (m <= 8 NT).
// G: the weight copies' size; XG: the activation copies' size.
template <DType T, int G, int XG, int NT>
__global__ void __launch_bounds__(32) k_mul_mat_tc_narrow(NarrowParts p, int64_t k, const float* __restrict__ x,
                                                          int64_t xs, int m) {
    constexpr bool kFloat = float_weights<T>();
    constexpr int SK = stage_k<T>(), SB = stage_bytes<T>(), kPitch = w_pitch<T>();
    constexpr int SC = SK / 16;  // mma chunks per stage
    constexpr int kPiecesPerRow = SB / G, kPieces = kRows * kPiecesPerRow, kPerLane = (kPieces + 31) / 32;
    constexpr int kXPieces = SK * 4 / XG;  // activation copies per column and stage
    static_assert(SB % G == 0, "a stage is whole copies");
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char* wring = smem;                                                  // [kStages][kRows][kPitch]
    float* xring = reinterpret_cast<float*>(smem + kStages * kRows * kPitch);    // [kStages][m][SK]

    const int lane = threadIdx.x;
    const int64_t tile = blockIdx.x;
    int j = 0;
    while (j + 1 < p.np && tile >= p.tile0[j + 1]) ++j;
    const int64_t n = p.n[j], n0 = (tile - p.tile0[j]) * kRows, rb = p.rb[j];
    const char* w = p.w[j];

    const int64_t n_chunks = (k + 31) / 32 * 2;  // the wide kernel's chunks: two per 32-k tile
    const int64_t n_stages = (n_chunks + SC - 1) / SC;
    const int64_t row_bytes = kFloat ? k * 2 : (k / QK) * (SB / 8);  // the row's values, in bytes

    // Rows past n are clamped to the last (loaded, computed, never stored); k past K is zeros.
    auto issue = [&](int64_t st) {
        if (st < n_stages) {
            unsigned char* ws = wring + (st % kStages) * (kRows * kPitch);
#pragma unroll
            for (int q = 0; q < kPerLane; ++q) {
                const int i = lane + 32 * q;
                if (kPieces % 32 != 0 && i >= kPieces) break;
                const int r = i / kPiecesPerRow, c = i % kPiecesPerRow;
                const int64_t off = st * SB + c * G;
                const bool valid = off < row_bytes;
                const char* src = w + min(n0 + r, n - 1) * rb + (valid ? off : 0);
                cp_async<G>(ws + r * kPitch + c * G, src, valid);
            }
            float* xst = xring + (st % kStages) * m * SK;
            for (int i = lane; i < m * kXPieces; i += 32) {
                const int col = i / kXPieces, c = i % kXPieces;
                const int64_t k0 = st * SK + c * (XG / 4);
                const bool valid = k0 < k;  // K % 8 == 0 and XG <= 16: a copy is all in or all out
                cp_async<XG>(xst + col * SK + c * (XG / 4), x + col * xs + (valid ? k0 : 0), valid);
            }
        }
        cp_async_commit();  // an empty group past the end keeps the wait count below uniform
    };

    // This lane's B columns: nt * 8 + lane / 4, past m clamped to the last (computed, never stored);
    // its k pairs start at 2 (lane % 4) and 2 (lane % 4) + 8 of each chunk.
    int xcol[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) xcol[nt] = min(nt * 8 + (lane >> 2), m - 1);
    const int kl = 2 * (lane & 3);

    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
    }

#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) issue(st);
    for (int64_t st = 0; st < n_stages; ++st) {
        issue(st + kStages - 1);
        cp_async_wait<kStages - 1>();  // this lane's copies of stage st have landed
        __syncwarp();                  // and every lane's
        const unsigned char* ws = wring + (st % kStages) * (kRows * kPitch);
        const float* xst = xring + (st % kStages) * m * SK;
        // All operands of the stage first, then its mma chain: a chunk's loads never wait on the
        // chunk before (the chain of one accumulator is the path a warp cannot shorten). Only the
        // last stage may hold chunks past the wide kernel's count; they are skipped, not added
        // as zeros (an mma adding +0 turns a -0 accumulator into +0).
        auto run_stage = [&](auto guarded) {
            constexpr bool kGuarded = decltype(guarded)::value;
            uint32_t a[SC][4], b[SC][NT][2];
#pragma unroll
            for (int ks = 0; ks < SC; ++ks) {
                if (kGuarded && st * SC + ks >= n_chunks) continue;
                if constexpr (kFloat) {
                    ldmatrix_x4(a[ks][0], a[ks][1], a[ks][2], a[ks][3],
                                ws + (lane & 15) * kPitch + (ks * 16 + (lane >> 4) * 8) * 2);
                } else {
                    a_from_blocks<T>(a[ks], ws, ks, lane);
                }
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const float* xc = xst + xcol[nt] * SK + ks * 16 + kl;
                    const float2 lo = *reinterpret_cast<const float2*>(xc);
                    const float2 hi = *reinterpret_cast<const float2*>(xc + 8);
                    b[ks][nt][0] = x_pair_halves<T>(lo.x, lo.y);
                    b[ks][nt][1] = x_pair_halves<T>(hi.x, hi.y);
                }
            }
#pragma unroll
            for (int ks = 0; ks < SC; ++ks) {
                if (kGuarded && st * SC + ks >= n_chunks) continue;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) mma16816<T == DType::BF16>(acc[nt], a[ks], b[ks][nt]);
            }
        };
        if ((st + 1) * SC <= n_chunks) {
            run_stage(std::false_type{});
        } else {
            run_stage(std::true_type{});
        }
        __syncwarp();  // every lane is done with the slot before the next issue refills it
    }

    // D fragment: e = 0, 1 at row lane / 4, columns 2 (lane % 4) + {0, 1}; e = 2, 3 at row + 8.
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

template <DType T, int G, int XG, int NT>
void narrow_launch(const NarrowParts& p, int64_t k, const float* x, int64_t xs, int64_t m, cudaStream_t s) {
    // Above 48 KiB a kernel must ask for its dynamic shared memory; ask once for the most (m = 16).
    static std::once_flag once;
    std::call_once(once, [] {
        check(cudaFuncSetAttribute(k_mul_mat_tc_narrow<T, G, XG, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(narrow_smem_bytes<T>(kMatmulTcNarrowMaxM))),
              "mul_mat (tensor cores, narrow): cudaFuncSetAttribute");
    });
    k_mul_mat_tc_narrow<T, G, XG, NT><<<static_cast<unsigned>(p.tile0[p.np]), 32, narrow_smem_bytes<T>(m), s>>>(
        p, k, x, xs, static_cast<int>(m));
}

template <DType T, int G>
void narrow_x(bool x16, const NarrowParts& p, int64_t k, const float* x, int64_t xs, int64_t m, cudaStream_t s) {
    if (m <= 8) {
        if (x16) narrow_launch<T, G, 16, 1>(p, k, x, xs, m, s);
        else narrow_launch<T, G, 4, 1>(p, k, x, xs, m, s);
    } else {
        if (x16) narrow_launch<T, G, 16, 2>(p, k, x, xs, m, s);
        else narrow_launch<T, G, 4, 2>(p, k, x, xs, m, s);
    }
}

template <DType T>
void narrow_typed(int g, bool x16, const NarrowParts& p, int64_t k, const float* x, int64_t xs, int64_t m,
                  cudaStream_t s) {
    if (g == 16) narrow_x<T, 16>(x16, p, k, x, xs, m, s);
    else narrow_x<T, 4>(x16, p, k, x, xs, m, s);
}

}  // namespace

bool launch_matmul_tc_narrow(DType t, const MatmulPart* parts, int n_parts, int64_t k, const float* x, int64_t xs,
                             int64_t m, cudaStream_t s) {
    if (m <= 0 || m > kMatmulTcNarrowMaxM || n_parts < 1 || n_parts > kMaxMatmulParts) return false;
    if (!matmul_tc_supports(t, k)) return false;
    // Copy size: 16 bytes where every row start and the row length allow it, else 4; rows that are
    // not 4-byte aligned (odd Q8_0/Q4_0 block counts) go to the wide kernel, the same computation.
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
    if (p.tile0[n_parts] == 0) return true;
    if (p.tile0[n_parts] > 0x7fffffff) return false;
    // Activation copies: 16 bytes where every column starts 16-byte aligned (K % 8 == 0 here).
    const bool x16 = reinterpret_cast<uintptr_t>(x) % 16 == 0 && xs % 4 == 0;
    if (reinterpret_cast<uintptr_t>(x) % 4 != 0) return false;
    switch (t) {
        case DType::F16: narrow_typed<DType::F16>(g, x16, p, k, x, xs, m, s); break;
        case DType::BF16: narrow_typed<DType::BF16>(g, x16, p, k, x, xs, m, s); break;
        case DType::Q8_0: narrow_typed<DType::Q8_0>(g, x16, p, k, x, xs, m, s); break;
        case DType::Q4_0: narrow_typed<DType::Q4_0>(g, x16, p, k, x, xs, m, s); break;
        case DType::Q4_1: narrow_typed<DType::Q4_1>(g, x16, p, k, x, xs, m, s); break;
        default: return false;
    }
    check_launch("mul_mat (tensor cores, narrow)");
    return true;
}

}  // namespace cuda
}  // namespace pyspec
