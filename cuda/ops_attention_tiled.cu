// Attention for batches of rows, with the K/V of each chunk read from global memory once per
// block instead of once per (query head, row): a block takes kv head g and a tile of R rows, i.e.
// the jobs (row, query head) of g's group over those rows (at most kJobs), and walks the pages the
// tile reaches; in each, every warp stages its chunk's K and V rows in shared memory and runs every
// job over them.
//
// It gives each row exactly the bits of k_attention (ops_attention.cu), so either kernel may serve
// any batch (invariant 7 holds across the choice): chunk c goes to warp c mod kWarps in both; a
// lane scores its cell with the same fmaf sequence (q from shared memory, K converted from the
// same F16 values); a warp folds its chunk into a job's empty state with the same formulas; the
// page's warps merge and the pages combine in order with attention_common.cuh's functions. A chunk
// or page outside a row's span (the tile's other rows reach it) leaves that job's state empty, and
// an empty page changes nothing.
#include <cstdlib>
#include <mutex>

#include "cuda/attention_common.cuh"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"

namespace pyspec {
namespace cuda {
namespace {

constexpr int kJobs = 8;        // (row, query head) jobs per block: registers hold kJobs states
constexpr int kKPad = 8;        // halves after each staged K row: lanes' 16-byte reads hit distinct banks

// Shared memory: q of every job [kJobs][hd] floats; the warps' job states for the current page, acc
// [kWarps][kJobs][hd] and (m, l) [kWarps][kJobs][2] floats (a lane keeps only the job it is working
// on in registers); the jobs' running states over the pages, acc [kJobs][hd] and (m, l) [kJobs][2];
// per warp, the staged chunk: K [32][hd + kKPad] and V [32][hd] halves.
inline size_t tiled_smem_bytes(int hd) {
    const size_t q = static_cast<size_t>(kJobs) * hd * sizeof(float);
    const size_t states = static_cast<size_t>(kWarps + 1) * kJobs * (hd + 2) * sizeof(float);
    const size_t stage = static_cast<size_t>(kWarps) * kChunk * (2 * hd + kKPad) * sizeof(uint16_t);
    return q + states + stage;
}

template <int NC>
__global__ void __launch_bounds__(kWarps * 32) k_attention_tiled(TDesc dst, TDesc q, TDesc kc, TDesc vc, TDesc mask,
                                                                   const int32_t* base, int n_kv_head, float scale,
                                                                   int rows_per_block, unsigned* err) {
    pdl_enter();
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int hd = static_cast<int>(q.ne[0]);
    const int n_head = static_cast<int>(q.ne[1]);
    const int n_rep = n_head / n_kv_head;
    const int g = blockIdx.x;
    const int64_t n_rows = q.ne[2];
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_block;
    const int tile_rows = static_cast<int>(n_rows - r0 < rows_per_block ? n_rows - r0 : rows_per_block);
    const int n_jobs = tile_rows * n_rep;
    const int64_t span = mask.ne[0];
    const int64_t n_cells = kc.ne[1];

    float* s_q = reinterpret_cast<float*>(smem);
    float* s_acc = s_q + static_cast<size_t>(kJobs) * hd;          // [kWarps][kJobs][hd]
    float* s_ml = s_acc + static_cast<size_t>(kWarps) * kJobs * hd;  // [kWarps][kJobs][2]
    const int ks = hd + kKPad;
    float* s_run_acc = s_ml + kWarps * kJobs * 2;                  // [kJobs][hd]
    float* s_run_ml = s_run_acc + static_cast<size_t>(kJobs) * hd;   // [kJobs][2]
    uint16_t* s_k = reinterpret_cast<uint16_t*>(s_run_ml + kJobs * 2) +
                    static_cast<size_t>(warp) * kChunk * (ks + hd);
    uint16_t* s_v = s_k + static_cast<size_t>(kChunk) * ks;

    for (int j = warp; j < n_jobs; j += kWarps) {
        const int64_t r = r0 + j / n_rep;
        const int h = g * n_rep + j % n_rep;
        const float* qr = reinterpret_cast<const float*>(q.data + h * q.nb[1] + r * q.nb[2]);
        for (int d = lane; d < hd; d += 32) s_q[j * hd + d] = qr[d];
    }
    for (int j = warp; j < n_jobs; j += kWarps) {  // the jobs' running states: empty
        for (int d = lane; d < hd; d += 32) s_run_acc[j * hd + d] = 0.0f;
        if (lane == 0) {
            s_run_ml[j * 2] = -INFINITY;
            s_run_ml[j * 2 + 1] = 0.0f;
        }
    }
    // The chunks the tile reaches. A row whose span leaves the cache gets zeros and the error
    // bit, as in k_attention, and takes no part.
    int64_t c_lo = INT64_MAX, c_hi = -1;
    for (int ri = 0; ri < tile_rows; ++ri) {
        const int64_t b0 = base[r0 + ri];
        if (b0 < 0 || b0 + span > n_cells || span <= 0) continue;
        c_lo = min(c_lo, b0 / kChunk);
        c_hi = max(c_hi, (b0 + span - 1) / kChunk);
    }
    __syncthreads();

    const int64_t col0 = static_cast<int64_t>(g) * hd;  // the kv head's columns of a cache row
    const int units = hd / 8;                             // 16-byte units per row
    // Page by page (attention_common.cuh): warp w folds chunk kWarps * pg + w into every job's
    // empty state, then each job's page state is combined into its running state.
    for (int64_t pg = c_lo / kWarps; c_hi >= 0 && pg <= c_hi / kWarps; ++pg) {
        for (int j = 0; j < n_jobs; ++j) {  // this warp's states for the page: empty
            for (int d = lane; d < hd; d += 32) s_acc[(warp * kJobs + j) * hd + d] = 0.0f;
            if (lane == 0) {
                s_ml[(warp * kJobs + j) * 2] = -INFINITY;
                s_ml[(warp * kJobs + j) * 2 + 1] = 0.0f;
            }
        }
        __syncwarp();
        const int64_t ch = pg * kWarps + warp;
        if (ch >= c_lo && ch <= c_hi) {
            // Stage the chunk's K and V rows (cells past the cache's end are never read).
            for (int u = lane; u < kChunk * units; u += 32) {
                const int i = u / units, col = u % units;
                const int64_t cell = ch * kChunk + i;
                if (cell >= n_cells) continue;
                const uint4 kv = *reinterpret_cast<const uint4*>(kc.data + cell * kc.nb[1] + col0 * 2 + col * 16);
                const uint4 vv = *reinterpret_cast<const uint4*>(vc.data + cell * vc.nb[1] + col0 * 2 + col * 16);
                *reinterpret_cast<uint4*>(s_k + i * ks + col * 8) = kv;
                *reinterpret_cast<uint4*>(s_v + i * hd + col * 8) = vv;
            }
            __syncwarp();
            const int64_t cell = ch * kChunk + lane;
            for (int j = 0; j < n_jobs; ++j) {
                const int64_t r = r0 + j / n_rep;
                const int64_t b0 = base[r];
                if (b0 < 0 || b0 + span > n_cells) continue;
                const int64_t jj = cell - b0;
                float s = -INFINITY;
                if (jj >= 0 && jj < span) {
                    const float mj = reinterpret_cast<const float*>(mask.data + r * mask.nb[1])[jj];
                    if (mj != -INFINITY) {
                        const float* qs = s_q + j * hd;
                        const uint16_t* kr = s_k + lane * ks;
                        float dot = 0.0f;
                        for (int d0 = 0; d0 < hd; d0 += 8) {
                            const uint4 raw = *reinterpret_cast<const uint4*>(kr + d0);
                            const uint32_t w4[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                dot = fmaf(qs[d0 + 2 * e], h2f(static_cast<uint16_t>(w4[e] & 0xffffu)), dot);
                                dot = fmaf(qs[d0 + 2 * e + 1], h2f(static_cast<uint16_t>(w4[e] >> 16)), dot);
                            }
                        }
                        s = fmaf(dot, scale, mj);
                    }
                }
                float* ml = s_ml + (warp * kJobs + j) * 2;
                float mc = ml[0], l_new = ml[1], p, corr;
                if (!fold_chunk(s, mc, l_new, p, corr)) continue;  // nothing unmasked yet (warp-uniform)
                float* accp = s_acc + (warp * kJobs + j) * hd;
                float acc[NC];
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    const int d = lane + 32 * c;
                    acc[c] = d < hd ? accp[d] * corr : 0.0f;
                }
                for (int i = 0; i < kChunk; ++i) {
                    const float pi = __shfl_sync(0xffffffffu, p, i);
                    if (pi == 0.0f) continue;  // masked, out of range or underflowed: adds nothing
#pragma unroll
                    for (int c = 0; c < NC; ++c) {
                        const int d = lane + 32 * c;
                        if (d < hd) acc[c] = fmaf(pi, h2f(s_v[i * hd + d]), acc[c]);
                    }
                }
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    const int d = lane + 32 * c;
                    if (d < hd) accp[d] = acc[c];
                }
                __syncwarp();  // every lane has read (m, l) before lane 0 replaces them
                if (lane == 0) {
                    ml[0] = mc;
                    ml[1] = l_new;
                }
            }
            __syncwarp();  // every lane is done with the staged rows and the states are written
        }
        __syncthreads();
        for (int j = warp; j < n_jobs; j += kWarps) {  // job j's page state into its running state
            const PageWeights pw = page_weights([&](int w) { return s_ml[(w * kJobs + j) * 2]; },
                                                [&](int w) { return s_ml[(w * kJobs + j) * 2 + 1]; });
            float m_run = s_run_ml[j * 2], l_run = s_run_ml[j * 2 + 1], fa, fb;
            if (combine_page(m_run, l_run, pw.m, pw.l, fa, fb)) {
                for (int d = lane; d < hd; d += 32) {
                    const float acc_g = page_acc(pw, d, [&](int w, int dd) { return s_acc[(w * kJobs + j) * hd + dd]; });
                    s_run_acc[j * hd + d] = combine_acc(s_run_acc[j * hd + d], acc_g, fa, fb);
                }
                __syncwarp();  // every lane has read (m, l) before lane 0 replaces them
                if (lane == 0) {
                    s_run_ml[j * 2] = m_run;
                    s_run_ml[j * 2 + 1] = l_run;
                }
            }
        }
        __syncthreads();  // the page's states are read before the next page's replace them
    }
    for (int j = warp; j < n_jobs; j += kWarps) {
        const int64_t r = r0 + j / n_rep;
        const int h = g * n_rep + j % n_rep;
        float* o = reinterpret_cast<float*>(dst.data + h * dst.nb[1] + r * dst.nb[2]);
        const int64_t b0 = base[r];
        if (b0 < 0 || b0 + span > n_cells) {
            if (lane == 0) atomicOr(err, kErrAttentionSpan);
            for (int d = lane; d < hd; d += 32) o[d] = 0.0f;
            continue;
        }
        const float inv = row_scale(s_run_ml[j * 2 + 1]);
        for (int d = lane; d < hd; d += 32) o[d] = s_run_acc[j * hd + d] * inv;
    }
}

template <int NC>
void launch_nc(const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v, const TDesc& mask,
               const int32_t* base, int n_kv_head, float scale, unsigned* err, cudaStream_t s) {
    const int hd = static_cast<int>(q.ne[0]);
    const int n_rep = static_cast<int>(q.ne[1]) / n_kv_head;
    const int rows_per_block = kJobs / n_rep;
    const size_t smem = tiled_smem_bytes(hd);
    // Above 48 KiB a kernel must ask for its dynamic shared memory; the most it uses is the
    // largest head dim of this instantiation.
    static std::once_flag once;
    std::call_once(once, [] {
        check(cudaFuncSetAttribute(k_attention_tiled<NC>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(tiled_smem_bytes(32 * NC))),
              "attention (tiled): cudaFuncSetAttribute");
    });
    const dim3 grid(static_cast<unsigned>(n_kv_head),
                    static_cast<unsigned>((q.ne[2] + rows_per_block - 1) / rows_per_block));
    launch(k_attention_tiled<NC>, grid, kWarps * 32, smem, s, dst, q, k, v, mask, base, n_kv_head, scale, rows_per_block,
            err);
}

}  // namespace

bool attention_tiled_enabled() { return env_switch("PYSPEC_CUDA_ATT_TILED") != 0; }

bool attention_tiled_supports(const TDesc& q, const TDesc& k, const TDesc& v, int n_kv_head) {
    const int64_t hd = q.ne[0];
    return k.dtype == DType::F16 && v.dtype == DType::F16 && hd % 8 == 0 && hd <= 128 && k.nb[0] == 2 &&
           v.nb[0] == 2 && k.nb[1] % 16 == 0 && v.nb[1] % 16 == 0 &&
           reinterpret_cast<uintptr_t>(k.data) % 16 == 0 && reinterpret_cast<uintptr_t>(v.data) % 16 == 0 &&
           n_kv_head > 0 && q.ne[1] % n_kv_head == 0 && q.ne[1] / n_kv_head <= kJobs &&
           (q.ne[2] + kJobs / (q.ne[1] / n_kv_head) - 1) / (kJobs / (q.ne[1] / n_kv_head)) <= 65535;
}

void launch_attention_tiled(const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v, const TDesc& mask,
                            const int32_t* base, int n_kv_head, float scale, unsigned* err, cudaStream_t s) {
    if (!attention_tiled_supports(q, k, v, n_kv_head)) throw std::logic_error("attention (tiled): unsupported layout");
    if (q.ne[0] <= 64) {
        launch_nc<2>(dst, q, k, v, mask, base, n_kv_head, scale, err, s);
    } else {
        launch_nc<4>(dst, q, k, v, mask, base, n_kv_head, scale, err, s);
    }
}

}  // namespace cuda
}  // namespace pyspec
