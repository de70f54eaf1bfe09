// Attention for single rows (decode) with each warp's chunk of K and V rows copied into shared
// memory by cp.async, all of a chunk's copies in flight at once.
//
// Why: a decode step's attention is a chain of memory round trips, not a bandwidth problem
// (SmolLM2: 9 blocks, a few chunks per row). The per-row kernel (ops_attention.cu) waits for q,
// then for each lane's K row, then for the chunk's V rows in batches of 8 behind the softmax (ncu,
// warm L2, H200: 15.7 us of a 1.34 ms SmolLM2 step, 35% of its kernel time). Here the warp's first
// chunk is requested before q is waited for, V arrives while the scores are computed, and with
// two stages (head_dim <= 64) the next chunk's copies overlap this chunk's arithmetic.
// Measured on the H200 (2026-11-30, ncu with warm caches, per layer; PYSPEC_CUDA_ATT_STAGED 0
// against 1): SmolLM2 at 64 cells 15.9 -> 5.5 us, at 4000 cells 193 -> 37 us; Qwen3-4B at 4000
// cells 303 -> 61 us. tg128: SmolLM2 Q4_1 777 -> 1005 t/s, Qwen3-4B F16 239 -> 281 (one build,
// one run after the other; llama.cpp: 921 and 273).
//
// The bits are k_attention's (test_staged_attention_gives_the_unstaged_kernels_bits): chunk c
// belongs to warp c mod kWarps; lane i scores cell 32c + i with the same fmaf sequence over the head
// dim (q from shared memory, K converted from the same F16 values); the chunk is folded into the
// warp's state with the same formulas, V rows in cell order, rows with p = 0 skipped; the warps
// merge in the order w = 0 .. kWarps-1 with the same formula. Staging changes where values are read
// from, never which values or in what order they are combined, so invariant 7 holds across the
// choice of kernel (the row-tiled kernel gives the same bits again).
#include <mutex>
#include <stdexcept>

#include "cuda/async_copy.cuh"
#include "cuda/attention_common.cuh"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"

namespace pyspec {
namespace cuda {
namespace {

constexpr int kKPad = 8;  // halves after each staged K row: the lanes' 16-byte row reads hit distinct banks

// Two stages where they fit the shared memory comfortably (head_dim <= 64), else one.
constexpr int stages_for(int nc) { return nc <= 2 ? 2 : 1; }

// Shared memory: q [hd] floats; the warps' states acc [kWarps][hd] and (m, l) [kWarps][2] floats;
// per warp and stage, K [32][hd + kKPad] and V [32][hd] halves.
inline size_t staged_smem_bytes(int hd, int stages) {
    const size_t floats = static_cast<size_t>(hd) + static_cast<size_t>(kWarps) * hd + 2 * kWarps;
    const size_t stage = static_cast<size_t>(kChunk) * (2 * hd + kKPad) * sizeof(uint16_t);
    return floats * sizeof(float) + static_cast<size_t>(kWarps) * stages * stage;
}

template <int NC>
__global__ void __launch_bounds__(kWarps * 32) k_attention_staged(TDesc dst, TDesc q, TDesc kc, TDesc vc, TDesc mask,
                                                                    const int32_t* base, int n_kv_head, float scale,
                                                                    unsigned* err) {
    constexpr int S = stages_for(NC);
    pdl_enter();
    extern __shared__ __align__(16) unsigned char smem[];
    const int h = blockIdx.x;
    const int64_t r = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int hd = static_cast<int>(q.ne[0]);
    const int kvh = h / (static_cast<int>(q.ne[1]) / n_kv_head);
    const int64_t span = mask.ne[0];
    const int64_t n_cells = kc.ne[1];
    const int64_t b0 = base[r];
    float* o = reinterpret_cast<float*>(dst.data + h * dst.nb[1] + r * dst.nb[2]);
    if (b0 < 0 || b0 + span > n_cells) {
        if (threadIdx.x == 0) atomicOr(err, kErrAttentionSpan);
        for (int d = threadIdx.x; d < hd; d += blockDim.x) o[d] = 0.0f;
        return;
    }
    float* s_q = reinterpret_cast<float*>(smem);
    float* s_acc = s_q + hd;                      // [kWarps][hd]
    float* s_ml = s_acc + kWarps * hd;            // [kWarps][2]
    const int ks = hd + kKPad;
    uint16_t* s_stage = reinterpret_cast<uint16_t*>(s_ml + 2 * kWarps) +
                        static_cast<size_t>(warp) * S * kChunk * (ks + hd);
    const int64_t col_bytes = static_cast<int64_t>(kvh) * hd * 2;  // the kv head's columns of a cache row
    const int units = hd / 8;                                       // 16-byte units per row

    // Every lane copies units of the chunk's rows (rows past the cache's end are zero-filled and
    // never used), then commits one group: a stage is complete when the lane's group is and the
    // warp has synchronised.
    auto stage_chunk = [&](int64_t ch, int st) {
        uint16_t* sk = s_stage + static_cast<size_t>(st) * kChunk * (ks + hd);
        uint16_t* sv = sk + kChunk * ks;
        for (int u = lane; u < kChunk * units; u += 32) {
            const int i = u / units, col = u % units;
            const int64_t cell = ch * kChunk + i;
            const bool ok = cell < n_cells;
            const int64_t c = ok ? cell : 0;
            cp_async<16>(sk + i * ks + col * 8, kc.data + c * kc.nb[1] + col_bytes + col * 16, ok);
            cp_async<16>(sv + i * hd + col * 8, vc.data + c * vc.nb[1] + col_bytes + col * 16, ok);
        }
        cp_async_commit();
    };

    const int64_t c_first = span > 0 ? b0 / kChunk : 0;
    const int64_t c_last = span > 0 ? (b0 + span - 1) / kChunk : -1;
    int64_t ch = c_first + (warp - c_first % kWarps + kWarps) % kWarps;
    if (ch <= c_last) stage_chunk(ch, 0);  // in flight while q arrives

    const float* qr = reinterpret_cast<const float*>(q.data + h * q.nb[1] + r * q.nb[2]);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) s_q[d] = qr[d];
    __syncthreads();
    const float* mrow = reinterpret_cast<const float*>(mask.data + r * mask.nb[1]);

    float acc[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[c] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int st = 0; ch <= c_last; ch += kWarps, st = (st + 1) % S) {
        const int64_t cell = ch * kChunk + lane;
        const int64_t j = cell - b0;
        const bool in_span = j >= 0 && j < span;
        const float mj = in_span ? mrow[j] : -INFINITY;
        if (S == 2) {
            // The next chunk goes to the other stage (read by the previous iteration, which ended
            // with a warp synchronisation); an empty group past the last keeps the count uniform.
            if (ch + kWarps <= c_last) stage_chunk(ch + kWarps, st ^ 1);
            else cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncwarp();
        const uint16_t* sk = s_stage + static_cast<size_t>(st) * kChunk * (ks + hd);
        const uint16_t* sv = sk + kChunk * ks;
        float s = -INFINITY;
        if (in_span && mj != -INFINITY) {
            const uint16_t* kr = sk + lane * ks;
            float dot = 0.0f;
            // Bounded by the instantiation's widest head so the loop unrolls (smem loads hoisted
            // ahead of the fmaf chain); the chain itself runs d = 0 .. hd-1 as everywhere.
#pragma unroll
            for (int d0 = 0; d0 < 32 * NC; d0 += 8) {
                if (d0 >= hd) break;
                const uint4 raw = *reinterpret_cast<const uint4*>(kr + d0);
                const uint16_t* hv = reinterpret_cast<const uint16_t*>(&raw);
#pragma unroll
                for (int e = 0; e < 8; ++e) dot = fmaf(s_q[d0 + e], h2f(hv[e]), dot);
            }
            s = fmaf(dot, scale, mj);
        }
        float p, corr;
        if (fold_chunk(s, m, l, p, corr)) {  // else nothing unmasked yet (warp-uniform)
#pragma unroll
            for (int c = 0; c < NC; ++c) acc[c] *= corr;
            // V rows in cell order. A row with p = 0 adds nothing (a select, not a branch, so the
            // unrolled loop can issue its shuffles and loads ahead; its value may be anything).
#pragma unroll 8
            for (int i = 0; i < kChunk; ++i) {
                const float pi = __shfl_sync(0xffffffffu, p, i);
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    const int d = lane + 32 * c;
                    if (d < hd) {
                        const float t = fmaf(pi, h2f(sv[i * hd + d]), acc[c]);
                        acc[c] = pi != 0.0f ? t : acc[c];
                    }
                }
            }
        }
        __syncwarp();  // every lane is done with this stage before it is refilled
        if (S == 1 && ch + kWarps <= c_last) stage_chunk(ch + kWarps, 0);
    }
    cp_async_wait<0>();  // no copy may land after the block has moved on

#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const int d = lane + 32 * c;
        if (d < hd) s_acc[warp * hd + d] = acc[c];
    }
    if (lane == 0) {
        s_ml[2 * warp] = m;
        s_ml[2 * warp + 1] = l;
    }
    __syncthreads();
    merge_warps(o, hd, threadIdx.x, blockDim.x, [&](int w) { return s_ml[2 * w]; },
                [&](int w) { return s_ml[2 * w + 1]; }, [&](int w, int d) { return s_acc[w * hd + d]; });
}

template <int NC>
void launch_nc(const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v, const TDesc& mask,
               const int32_t* base, int n_kv_head, float scale, unsigned* err, cudaStream_t s) {
    constexpr int S = stages_for(NC);
    // Above 48 KiB a kernel must ask for its dynamic shared memory; the most it uses is the
    // largest head dim of this instantiation.
    static std::once_flag once;
    std::call_once(once, [] {
        check(cudaFuncSetAttribute(k_attention_staged<NC>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(staged_smem_bytes(32 * NC, S))),
              "attention (staged): cudaFuncSetAttribute");
    });
    const dim3 grid(static_cast<unsigned>(q.ne[1]), static_cast<unsigned>(q.ne[2]));
    launch(k_attention_staged<NC>, grid, kWarps * 32, staged_smem_bytes(static_cast<int>(q.ne[0]), S), s, dst, q, k,
           v, mask, base, n_kv_head, scale, err);
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

void launch_attention_staged(const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v, const TDesc& mask,
                             const int32_t* base, int n_kv_head, float scale, unsigned* err, cudaStream_t s) {
    if (!attention_staged_supports(q, k, v)) throw std::logic_error("attention (staged): unsupported layout");
    if (q.ne[0] <= 64) {
        launch_nc<2>(dst, q, k, v, mask, base, n_kv_head, scale, err, s);
    } else {
        launch_nc<4>(dst, q, k, v, mask, base, n_kv_head, scale, err, s);
    }
}

}  // namespace cuda
}  // namespace pyspec
