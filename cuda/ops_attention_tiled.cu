// Attention for batches of rows, with the K/V of each chunk read from global memory once per
// block instead of once per (query head, row): a block takes kv head g and a tile of R rows, i.e.
// the jobs (row, query head) of g's group over those rows (at most kJobs), and walks the pages the
// tile reaches; in each, every warp stages its chunk's K and V rows in shared memory and runs all
// the jobs over them together.
//
// Inside a warp the jobs run side by side, since one job alone is a chain of dependent fmafs: a
// lane scores its cell for every job at once (kJobs independent dot chains, its K row read once
// for all of them, q read as broadcast float4s); the jobs' folds are issued together
// (fold_empty_chunks); then each V row is read once and added into every job's accumulators, held
// in registers (kJobs x NC per lane: head dims NC * lane .. NC * lane + NC - 1), with cell i's
// weights for all jobs read from shared memory. A warp copies (cp.async) the next page's chunk into
// each buffer as soon as it is done with it: K while it folds and sums V, V while the pages merge.
// A chunk with no unmasked cell for any job is neither copied nor computed.
//
// It gives each row exactly the bits of k_attention (ops_attention.cu), so either kernel may serve
// any batch (invariant 7 holds across the choice): chunk c goes to warp c mod kWarps in both; a
// lane scores its cell with the same fmaf sequence (d = 0 .. hd-1 from 0, q from shared memory, K
// converted from the same F16 values; only different jobs' chains interleave); a warp folds its
// chunk into a job's empty state with fold_chunk's operations, and element d of the job's
// accumulator is the fmaf chain over the chunk's cells in increasing order from +0 (fold_chunk's
// 0 * corr), skipping cells whose p is 0, as k_attention's is; the page's warps merge and the pages
// combine in order with attention_common.cuh's functions. A chunk or page outside a row's span (the
// tile's other rows reach it) leaves that job's state empty, and an empty page changes nothing.
#include <cstdlib>
#include <mutex>

#include "cuda/async_copy.cuh"
#include "cuda/attention_common.cuh"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"

namespace pyspec {
namespace cuda {
namespace {

constexpr int kJobs = 8;        // (row, query head) jobs per block: a lane holds every job's score and accumulators
constexpr int kKPad = 8;        // halves after each staged K row: lanes' 16-byte reads hit distinct banks
static_assert(kJobs % 4 == 0, "a cell's weights are read as float4s");

// Shared memory: q of every job [hd / 4][kJobs][4] floats (zeros past the tile's jobs); the warps' job
// states for the current page, acc [kWarps][kJobs][hd] and (m, l) [kWarps][kJobs][2] floats; the
// jobs' running states over the pages, acc [kJobs][hd] and (m, l) [kJobs][2]; per warp, its chunk's
// weights [kChunk][kJobs] floats (a cell's weights for all jobs in one broadcast read); per job, its
// row's first cell and mask row; per warp, the staged chunk: K [32][hd + kKPad] and V [32][hd] halves.
inline size_t tiled_smem_bytes(int hd) {
    const size_t q = static_cast<size_t>(kJobs) * hd * sizeof(float);
    const size_t states = static_cast<size_t>(kWarps + 1) * kJobs * (hd + 2) * sizeof(float);
    const size_t weights = static_cast<size_t>(kWarps) * kChunk * kJobs * sizeof(float);
    const size_t jobs = static_cast<size_t>(kJobs) * (sizeof(int64_t) + sizeof(const float*));
    const size_t stage = static_cast<size_t>(kWarps) * kChunk * (2 * hd + kKPad) * sizeof(uint16_t);
    return q + states + weights + jobs + stage;
}

// A lane's NC consecutive head dims (4- or 8-byte aligned): read from a staged V row (load_v),
// written to a page state (store_acc).
template <int NC>
__device__ __forceinline__ void load_v(const uint16_t* p, float (&f)[NC]) {
    if constexpr (NC == 4) {
        const uint2 raw = *reinterpret_cast<const uint2*>(p);
        f[0] = h2f(static_cast<uint16_t>(raw.x & 0xffffu));
        f[1] = h2f(static_cast<uint16_t>(raw.x >> 16));
        f[2] = h2f(static_cast<uint16_t>(raw.y & 0xffffu));
        f[3] = h2f(static_cast<uint16_t>(raw.y >> 16));
    } else {
        const uint32_t raw = *reinterpret_cast<const uint32_t*>(p);
        f[0] = h2f(static_cast<uint16_t>(raw & 0xffffu));
        f[1] = h2f(static_cast<uint16_t>(raw >> 16));
    }
}
template <int NC>
__device__ __forceinline__ void store_acc(float* p, const float (&f)[NC]) {
    if constexpr (NC == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]);
    } else {
        *reinterpret_cast<float2*>(p) = make_float2(f[0], f[1]);
    }
}

template <int NC>
__global__ void __launch_bounds__(kWarps * 32) k_attention_tiled(TDesc dst, TDesc q, TDesc kc, TDesc vc, TDesc mask,
                                                                   const int32_t* base, int n_kv_head, float scale,
                                                                   int rows_per_block, unsigned* err) {
    static_assert(NC == 2 || NC == 4, "a lane's head dims of a V row are one 4- or 8-byte read");
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

    float* s_q = reinterpret_cast<float*>(smem);                   // [hd / 4][kJobs][4]
    float* s_acc = s_q + static_cast<size_t>(kJobs) * hd;          // [kWarps][kJobs][hd]
    float* s_ml = s_acc + static_cast<size_t>(kWarps) * kJobs * hd;  // [kWarps][kJobs][2]
    const int ks = hd + kKPad;
    float* s_run_acc = s_ml + kWarps * kJobs * 2;                  // [kJobs][hd]
    float* s_run_ml = s_run_acc + static_cast<size_t>(kJobs) * hd;   // [kJobs][2]
    float* s_p = s_run_ml + kJobs * 2;                             // [kWarps][kChunk][kJobs]
    int64_t* s_jb0 = reinterpret_cast<int64_t*>(s_p + kWarps * kChunk * kJobs);  // [kJobs]
    const float** s_jmask = reinterpret_cast<const float**>(s_jb0 + kJobs);     // [kJobs]
    uint16_t* s_k = reinterpret_cast<uint16_t*>(s_jmask + kJobs) + static_cast<size_t>(warp) * kChunk * (ks + hd);
    uint16_t* s_v = s_k + static_cast<size_t>(kChunk) * ks;

    // Element d of job j's q: the same four elements of every job side by side, so a lane reads
    // all jobs' elements d0 .. d0 + 7 at fixed offsets from one address.
    auto q_at = [](int j, int d) { return ((d >> 2) * kJobs + j) * 4 + (d & 3); };
    // Every job slot gets a q: the dot chains of slots past the tile's jobs run on zeros, their
    // scores unused, so no lane branches on the job count.
    for (int j = warp; j < kJobs; j += kWarps) {
        if (j < n_jobs) {
            const int64_t r = r0 + j / n_rep;
            const int h = g * n_rep + j % n_rep;
            const float* qr = reinterpret_cast<const float*>(q.data + h * q.nb[1] + r * q.nb[2]);
            for (int d = lane; d < hd; d += 32) s_q[q_at(j, d)] = qr[d];
        } else {
            for (int d = lane; d < hd; d += 32) s_q[q_at(j, d)] = 0.0f;
        }
    }
    for (int j = warp; j < n_jobs; j += kWarps) {  // the jobs' running states: empty
        for (int d = lane; d < hd; d += 32) s_run_acc[j * hd + d] = 0.0f;
        if (lane == 0) {
            s_run_ml[j * 2] = -INFINITY;
            s_run_ml[j * 2 + 1] = 0.0f;
        }
    }
    // A job takes part through its row's mask row; none for a slot past the tile's jobs or a row
    // whose span leaves the cache (that row gets zeros and the error bit, as in k_attention).
    if (threadIdx.x < kJobs) {
        const int j = threadIdx.x;
        const float* mrow = nullptr;
        int64_t b0 = 0;
        if (j < n_jobs) {
            const int64_t r = r0 + j / n_rep;
            b0 = base[r];
            if (!(b0 < 0 || b0 + span > n_cells)) mrow = reinterpret_cast<const float*>(mask.data + r * mask.nb[1]);
        }
        s_jb0[j] = b0;
        s_jmask[j] = mrow;
    }
    // The chunks the tile reaches (its rows that take part).
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
    // This lane's head dims in the V sum; lanes past hd read lane 0's and keep nothing.
    const bool has_dims = NC * lane < hd;
    const int dv = has_dims ? NC * lane : 0;

    // This lane's cell's mask value in chunk ch for every job, -inf where the job takes no part
    // (outside the tile's chunks, the row's span, or the job's row): a -inf score then stands for
    // all of these, as k_attention leaves such a cell's score.
    auto load_mask = [&](int64_t ch, float (&mv)[kJobs]) {
#pragma unroll
        for (int j = 0; j < kJobs; ++j) mv[j] = -INFINITY;
        if (ch < c_lo || ch > c_hi) return;
        const int64_t cell = ch * kChunk + lane;
#pragma unroll
        for (int j = 0; j < kJobs; ++j) {
            const float* mrow = s_jmask[j];
            const int64_t jj = cell - s_jb0[j];
            if (mrow != nullptr && jj >= 0 && jj < span) mv[j] = __ldg(mrow + jj);  // a global load, not a generic one
        }
    };
    // Whether any cell of the warp's chunk is unmasked for any job (warp-uniform): if not, every
    // job's fold would leave its state empty.
    auto any_unmasked = [&](const float (&mv)[kJobs]) {
        bool any = false;
#pragma unroll
        for (int j = 0; j < kJobs; ++j) any = any || mv[j] != -INFINITY;
        return __any_sync(0xffffffffu, any) != 0;
    };
    // A lane copies units u = lane + 32t (t < units) of a chunk's kChunk * units: row u / units,
    // unit u % units, stepped without dividing.
    static_assert(kChunk == 32, "a lane copies units of the chunk's rows");
    const int units_div = units > 0 ? units : 1;  // (hd = 0: no units, nothing divided by 0)
    const int i_first = lane / units_div, col_first = lane % units_div;
    const int i_step = 32 / units_div, col_step = 32 % units_div;
    // Chunk ch's K (or V) rows into this warp's buffer, when on. One group is committed either
    // way, so every lane's wait counts are the same in every page. Cells past the cache's end are
    // zero-filled, and never scored.
    auto stage = [&](const TDesc& src, uint16_t* dst_rows, int stride, int64_t ch, bool on) {
        if (on) {
            int i = i_first, col = col_first;
            for (int t = 0; t < units; ++t) {
                const int64_t cell = ch * kChunk + i;
                const bool ok = cell < n_cells;
                const int64_t c = ok ? cell : 0;
                cp_async<16>(dst_rows + i * stride + col * 8, src.data + c * src.nb[1] + col0 * 2 + col * 16, ok);
                i += i_step;
                col += col_step;
                if (col >= units) {
                    col -= units;
                    ++i;
                }
            }
        }
        cp_async_commit();
    };

    // Page by page (attention_common.cuh): warp w folds chunk kWarps * pg + w into every job's
    // empty state, then each job's page state is combined into its running state. The groups in
    // flight, oldest first: this chunk's K and V on entering a page; its V and the next chunk's K
    // from the K buffer's refill on.
    int64_t pg = c_lo / kWarps;
    float mv[kJobs];
    load_mask(pg * kWarps + warp, mv);
    bool act = any_unmasked(mv);
    stage(kc, s_k, ks, pg * kWarps + warp, act);
    stage(vc, s_v, hd, pg * kWarps + warp, act);
    for (; c_hi >= 0 && pg <= c_hi / kWarps; ++pg) {
        const int64_t ch = pg * kWarps + warp;
        float mv_next[kJobs];
        load_mask(ch + kWarps, mv_next);  // arrives while this chunk is scored

        float s[kJobs];
#pragma unroll
        for (int j = 0; j < kJobs; ++j) s[j] = -INFINITY;
        if (act) {
            cp_async_wait<1>();  // this chunk's K
            __syncwarp();
            // Every job's score for this lane's cell: per job the chain over d = 0 .. hd-1 of
            // k_attention, the jobs' chains side by side.
            const uint16_t* kr = s_k + lane * ks;
            float dot[kJobs];
#pragma unroll
            for (int j = 0; j < kJobs; ++j) dot[j] = 0.0f;
#pragma unroll 2
            for (int d0 = 0; d0 < hd; d0 += 8) {
                const uint4 raw = *reinterpret_cast<const uint4*>(kr + d0);
                const uint32_t w4[4] = {raw.x, raw.y, raw.z, raw.w};
                float kf[8];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    kf[2 * e] = h2f(static_cast<uint16_t>(w4[e] & 0xffffu));
                    kf[2 * e + 1] = h2f(static_cast<uint16_t>(w4[e] >> 16));
                }
                const float* qd = s_q + q_at(0, d0);
#pragma unroll
                for (int j = 0; j < kJobs; ++j) {
                    const float4 qa = *reinterpret_cast<const float4*>(qd + 4 * j);
                    const float4 qb = *reinterpret_cast<const float4*>(qd + 4 * (kJobs + j));
                    const float qv[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
#pragma unroll
                    for (int e = 0; e < 8; ++e) dot[j] = fmaf(qv[e], kf[e], dot[j]);
                }
            }
#pragma unroll
            for (int j = 0; j < kJobs; ++j) {
                if (mv[j] != -INFINITY) s[j] = fmaf(dot[j], scale, mv[j]);
            }
        }
        const bool act_next = any_unmasked(mv_next);
        __syncwarp();  // every lane has read its K row before the next chunk's replace them
        stage(kc, s_k, ks, ch + kWarps, act_next);

        float m[kJobs], l[kJobs], acc[kJobs][NC];
#pragma unroll
        for (int j = 0; j < kJobs; ++j) {
            m[j] = -INFINITY;
            l[j] = 0.0f;
#pragma unroll
            for (int c = 0; c < NC; ++c) acc[j][c] = 0.0f;
        }
        if (act) {
            float p[kJobs];
            fold_empty_chunks(s, m, l, p);
            float* pl = s_p + (warp * kChunk + lane) * kJobs;
#pragma unroll
            for (int j = 0; j < kJobs; j += 4) {
                *reinterpret_cast<float4*>(pl + j) = make_float4(p[j], p[j + 1], p[j + 2], p[j + 3]);
            }
            cp_async_wait<1>();  // this chunk's V
            __syncwarp();        // and every lane's weights, visible to the warp
            // V rows in cell order, each read once for all jobs; a job skips a cell whose weight
            // is 0 (masked, out of range or underflowed), as k_attention does.
            const float* pw = s_p + warp * kChunk * kJobs;
#pragma unroll 8
            for (int i = 0; i < kChunk; ++i) {
                float pi[kJobs];
#pragma unroll
                for (int j = 0; j < kJobs; j += 4) {
                    const float4 t = *reinterpret_cast<const float4*>(pw + i * kJobs + j);
                    pi[j] = t.x;
                    pi[j + 1] = t.y;
                    pi[j + 2] = t.z;
                    pi[j + 3] = t.w;
                }
                float vf[NC];
                load_v<NC>(s_v + i * hd + dv, vf);
#pragma unroll
                for (int j = 0; j < kJobs; ++j) {
                    if (pi[j] != 0.0f) {
#pragma unroll
                        for (int c = 0; c < NC; ++c) acc[j][c] = fmaf(pi[j], vf[c], acc[j][c]);
                    }
                }
            }
        }
        __syncwarp();  // every lane has read the V rows and weights before they are replaced
        stage(vc, s_v, hd, ch + kWarps, act_next);
        // The warp's page states, empty for a job (or the whole warp) with nothing unmasked.
        if (has_dims) {
#pragma unroll
            for (int j = 0; j < kJobs; ++j) store_acc<NC>(s_acc + (warp * kJobs + j) * hd + dv, acc[j]);
        }
        if (lane == 0) {
#pragma unroll
            for (int j = 0; j < kJobs; ++j) {
                *reinterpret_cast<float2*>(s_ml + (warp * kJobs + j) * 2) = make_float2(m[j], l[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < kJobs; ++j) mv[j] = mv_next[j];
        act = act_next;
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
