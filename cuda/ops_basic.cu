// Row-wise and element-wise ops: cpy, get_rows, set_rows, rms_norm, add/mul/swiglu, scale/silu,
// rope, softmax, gather, sum (argmax and top_k: cuda/ops_pick.cu). Each follows the CPU kernel in
// cpu/ops.cpp: rows are walked through their byte strides (views are common inputs), values
// inside a row are contiguous.
#include <algorithm>
#include <cfloat>

#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "cuda/rope_common.cuh"

namespace pyspec {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// The jobs of one launch of a row-wise op: one, or a pair of independent nodes of the same op
// and parameters (q/k RoPE, K/V SET_ROWS, q/k norms), job blockIdx.y.
struct Jobs {
    OpJob j[kMaxOpJobs];
};

// ggml's reference quantizers (cpu/quant_rows.cpp), one 32-value block; __fmul_rn keeps the
// products that the CPU rounds on their own from being fused.
__device__ void quantize_block(DType t, const float* x, char* out) {
    if (t == DType::Q8_0) {
        float amax = 0.0f;
        for (int j = 0; j < QK; ++j) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        *reinterpret_cast<uint16_t*>(out) = f2h(d);
        for (int j = 0; j < QK; ++j) out[2 + j] = static_cast<char>(static_cast<int8_t>(roundf(__fmul_rn(x[j], id))));
    } else if (t == DType::Q4_0) {
        float amax = 0.0f, mx = 0.0f;
        for (int j = 0; j < QK; ++j) {
            if (amax < fabsf(x[j])) {
                amax = fabsf(x[j]);
                mx = x[j];
            }
        }
        const float d = mx / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        *reinterpret_cast<uint16_t*>(out) = f2h(d);
        for (int j = 0; j < QK / 2; ++j) {
            const int q0 = min(15, static_cast<int>(__fmul_rn(x[j], id) + 8.5f));
            const int q1 = min(15, static_cast<int>(__fmul_rn(x[j + QK / 2], id) + 8.5f));
            out[2 + j] = static_cast<char>(static_cast<uint8_t>(q0 | q1 << 4));
        }
    } else if (t == DType::Q4_1) {
        float mn = FLT_MAX, mx = -FLT_MAX;
        for (int j = 0; j < QK; ++j) {
            if (x[j] < mn) mn = x[j];
            if (x[j] > mx) mx = x[j];
        }
        const float d = (mx - mn) / 15.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        *reinterpret_cast<uint16_t*>(out) = f2h(d);
        *reinterpret_cast<uint16_t*>(out + 2) = f2h(mn);
        for (int j = 0; j < QK / 2; ++j) {
            const int q0 = min(15, static_cast<int>(__fmul_rn(x[j] - mn, id) + 0.5f));
            const int q1 = min(15, static_cast<int>(__fmul_rn(x[j + QK / 2] - mn, id) + 0.5f));
            out[4 + j] = static_cast<char>(static_cast<uint8_t>(q0 | q1 << 4));
        }
    }
}

__device__ __forceinline__ void store_elem(DType t, char* row, int64_t i, float v) {
    switch (t) {
        case DType::F32: reinterpret_cast<float*>(row)[i] = v; break;
        case DType::F16: reinterpret_cast<uint16_t*>(row)[i] = f2h(v); break;
        case DType::BF16: reinterpret_cast<uint16_t*>(row)[i] = f2bf(v); break;
        default: break;
    }
}

// ---------------------------------------------------------------------------------------------
// cpy: src any type and row strides -> dst's type.

__global__ void k_cpy_elem(TDesc dst, TDesc src) {
    pdl_enter();
    const int64_t n0 = src.ne[0], total = n0 * src.nrows();
    for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t r = e / n0, i = e % n0;
        if (src.dtype == DType::I32 && dst.dtype == DType::I32) {
            reinterpret_cast<int32_t*>(dst.row(r))[i] = reinterpret_cast<const int32_t*>(src.row(r))[i];
        } else {
            store_elem(dst.dtype, dst.row(r), i, load_elem(src.dtype, src.row(r), i));
        }
    }
}

__global__ void k_cpy_quant(TDesc dst, TDesc src) {
    pdl_enter();
    const int64_t nbk = src.ne[0] / QK, total = nbk * src.nrows();
    const int64_t unit = static_cast<int64_t>(dtype_unit_bytes(dst.dtype));
    for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t r = e / nbk, b = e % nbk;
        float x[QK];
        const char* sr = src.row(r);
        for (int j = 0; j < QK; ++j) x[j] = load_elem(src.dtype, sr, b * QK + j);
        quantize_block(dst.dtype, x, dst.row(r) + b * unit);
    }
}

// ---------------------------------------------------------------------------------------------

__global__ void k_get_rows(TDesc dst, TDesc table, const int32_t* ids, unsigned* err) {
    pdl_enter();
    const int64_t n0 = dst.ne[0], total = n0 * dst.ne[1], tab_rows = table.nrows();
    for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t r = e / n0, i = e % n0;
        const int32_t row = ids[r];
        float v = 0.0f;
        if (row < 0 || row >= tab_rows) {
            if (i == 0) atomicOr(err, kErrGetRowsId);
        } else {
            v = load_elem(table.dtype, table.row(row), i);
        }
        reinterpret_cast<float*>(dst.row(r))[i] = v;
    }
}

__global__ void k_set_rows_elem(const __grid_constant__ Jobs jobs, const int32_t* ids, unsigned* err) {
    pdl_enter();
    const TDesc& dst = jobs.j[blockIdx.y].dst;
    const TDesc& rows = jobs.j[blockIdx.y].src;
    const int64_t n0 = rows.ne[0], total = n0 * rows.nrows();
    for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t r = e / n0, i = e % n0;
        const int32_t id = ids[r];
        if (id < 0 || id >= dst.ne[1]) {
            if (i == 0) atomicOr(err, kErrSetRowsId);
            continue;
        }
        store_elem(dst.dtype, dst.data + static_cast<int64_t>(id) * dst.nb[1], i, load_elem(rows.dtype, rows.row(r), i));
    }
}

__global__ void k_set_rows_quant(const __grid_constant__ Jobs jobs, const int32_t* ids, unsigned* err) {
    pdl_enter();
    const TDesc& dst = jobs.j[blockIdx.y].dst;
    const TDesc& rows = jobs.j[blockIdx.y].src;
    const int64_t nbk = rows.ne[0] / QK, total = nbk * rows.nrows();
    const int64_t unit = static_cast<int64_t>(dtype_unit_bytes(dst.dtype));
    for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t r = e / nbk, b = e % nbk;
        const int32_t id = ids[r];
        if (id < 0 || id >= dst.ne[1]) {
            if (b == 0) atomicOr(err, kErrSetRowsId);
            continue;
        }
        float x[QK];
        const char* sr = rows.row(r);
        for (int j = 0; j < QK; ++j) x[j] = load_elem(rows.dtype, sr, b * QK + j);
        quantize_block(dst.dtype, x, dst.data + static_cast<int64_t>(id) * dst.nb[1] + b * unit);
    }
}

// ---------------------------------------------------------------------------------------------

// RMS_NORM, in the summation order common.cuh fixes by row length (so a row's bits do not depend
// on its batch, and the matmul's norm prologue computes the same). Short rows (Qwen3's per-head
// q/k norms: 32 or 8 rows of 128): a warp per row, eight rows per block, no block-wide barrier, x
// and the weights both loaded into registers before the reduction (a decode step's norms wait on
// memory, not on arithmetic); the same fmaf chain as warp_rms_scale.
constexpr int64_t kWarpNormRegs = kWarpNormMax / 32;

__global__ void k_rms_norm_warp(const __grid_constant__ Jobs jobs, float eps) {
    pdl_enter();
    const TDesc& dst = jobs.j[blockIdx.y].dst;
    const TDesc& x = jobs.j[blockIdx.y].src;
    const float* w = jobs.j[blockIdx.y].w;
    const int64_t r = blockIdx.x * static_cast<int64_t>(kThreads / 32) + (threadIdx.x >> 5);
    if (r >= x.nrows()) return;  // past the rows, or a pair's shorter job
    const int lane = threadIdx.x & 31;
    const int64_t n = x.ne[0];  // <= kWarpNormMax (launch_rms_norm)
    const float* xr = reinterpret_cast<const float*>(x.row(r));
    float* yr = reinterpret_cast<float*>(dst.row(r));
    float xv[kWarpNormRegs], wv[kWarpNormRegs];
#pragma unroll
    for (int c = 0; c < kWarpNormRegs; ++c) {
        const int64_t i = lane + 32 * c;
        xv[c] = i < n ? xr[i] : 0.0f;
        wv[c] = w && i < n ? w[i] : 0.0f;
    }
    float acc = 0.0f;
#pragma unroll
    for (int c = 0; c < kWarpNormRegs; ++c) {
        if (lane + 32 * c < n) acc = fmaf(xv[c], xv[c], acc);
    }
    const float scale = rms_scale(acc, n, eps);
#pragma unroll
    for (int c = 0; c < kWarpNormRegs; ++c) {
        const int64_t i = lane + 32 * c;
        if (i < n) yr[i] = w ? xv[c] * scale * wv[c] : xv[c] * scale;
    }
}

// Longer rows: kNormBlockThreads threads per row (block x = row, y = job). Rows of up to
// kBlockNormMax values keep each thread's values (and weights) in registers, all loaded before the
// reduction and stored from there: a prompt pass's norms (512 rows of 2560) wait on memory, and one
// load at a time per thread left the SMs a quarter full of requests (11.5 us a norm on the H200).
// Longer rows loop as the arithmetic is written. Either way the same fmaf chain per thread.
constexpr int kBlockNormRegs = 32;
constexpr int64_t kBlockNormMax = int64_t{kBlockNormRegs} * kNormBlockThreads;

__global__ void __launch_bounds__(kNormBlockThreads) k_rms_norm_block(const __grid_constant__ Jobs jobs, float eps) {
    pdl_enter();
    const TDesc& dst = jobs.j[blockIdx.y].dst;
    const TDesc& x = jobs.j[blockIdx.y].src;
    const float* w = jobs.j[blockIdx.y].w;
    const int64_t r = blockIdx.x;
    if (r >= x.nrows()) return;  // a pair's shorter job: the whole block
    const int64_t n = x.ne[0];
    const float* xr = reinterpret_cast<const float*>(x.row(r));
    float* yr = reinterpret_cast<float*>(dst.row(r));
    __shared__ float sums[kNormBlockThreads / 32];
    float acc = 0.0f;
    if (n <= kBlockNormMax) {
        float xv[kBlockNormRegs], wv[kBlockNormRegs];
#pragma unroll
        for (int c = 0; c < kBlockNormRegs; ++c) {
            const int64_t i = threadIdx.x + static_cast<int64_t>(kNormBlockThreads) * c;
            xv[c] = i < n ? xr[i] : 0.0f;
            wv[c] = w && i < n ? w[i] : 0.0f;
        }
#pragma unroll
        for (int c = 0; c < kBlockNormRegs; ++c) {
            if (threadIdx.x + static_cast<int64_t>(kNormBlockThreads) * c < n) acc = fmaf(xv[c], xv[c], acc);
        }
        acc = warp_sum(acc);
        if ((threadIdx.x & 31) == 0) sums[threadIdx.x >> 5] = acc;
        __syncthreads();
        const float scale = rms_scale_of_warp_sums(sums, n, eps);
#pragma unroll
        for (int c = 0; c < kBlockNormRegs; ++c) {
            const int64_t i = threadIdx.x + static_cast<int64_t>(kNormBlockThreads) * c;
            if (i < n) yr[i] = w ? xv[c] * scale * wv[c] : xv[c] * scale;
        }
        return;
    }
#pragma unroll 8
    for (int64_t i = threadIdx.x; i < n; i += kNormBlockThreads) acc = fmaf(xr[i], xr[i], acc);
    acc = warp_sum(acc);
    if ((threadIdx.x & 31) == 0) sums[threadIdx.x >> 5] = acc;
    __syncthreads();
    const float scale = rms_scale_of_warp_sums(sums, n, eps);
    for (int64_t i = threadIdx.x; i < n; i += kNormBlockThreads) yr[i] = w ? xr[i] * scale * w[i] : xr[i] * scale;
}

// Element-wise kernels: block (x, y) takes columns x * blockDim + thread, stepping by the grid's
// width, of rows y, y + gridDim.y, ..., so a row's address is found once per row rather than per
// element (row() divides by the shape: 2-D tensors, the common case, skip it). Each element's
// arithmetic is unchanged.
__device__ __forceinline__ const float* row_f(const TDesc& t, int64_t r) {
    return reinterpret_cast<const float*>(t.ne[2] * t.ne[3] == 1 ? t.data + r * t.nb[1] : t.row(r));
}

// ADD (0), MUL (1), SWIGLU (2) of one element pair.
__device__ __forceinline__ float binary_op(int kind, float x, float w) {
    if (kind == 0) return x + w;
    if (kind == 1) return x * w;
    return silu_f(x) * w;
}

__global__ void k_binary(int kind, TDesc dst, TDesc a, TDesc b) {
    pdl_enter();
    const int64_t n0 = a.ne[0], rows = a.nrows();
    const bool bcast = b.nrows() == 1;
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
        const float* xa = row_f(a, r);
        const float* xb = row_f(b, bcast ? 0 : r);
        float* y = const_cast<float*>(row_f(dst, r));
        for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n0;
             i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
            y[i] = binary_op(kind, xa[i], xb[i]);
        }
    }
}

// The same over contiguous operands of one shape as n flat elements, grid-stride, 16-byte
// accesses where vec (n % 4 == 0, every pointer 16-byte aligned): a prompt pass's SWIGLU
// (512 x 9728 elements) took 41 us on the H200 as k_binary's 39k one-element-per-thread blocks,
// bound by block scheduling rather than bandwidth.
__global__ void k_binary_flat(int kind, float* y, const float* a, const float* b, int64_t n, bool vec) {
    pdl_enter();
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (vec) {
        for (; i < n / 4; i += stride) {
            const float4 x = reinterpret_cast<const float4*>(a)[i], w = reinterpret_cast<const float4*>(b)[i];
            reinterpret_cast<float4*>(y)[i] = make_float4(binary_op(kind, x.x, w.x), binary_op(kind, x.y, w.y),
                                                          binary_op(kind, x.z, w.z), binary_op(kind, x.w, w.w));
        }
    } else {
        for (; i < n; i += stride) y[i] = binary_op(kind, a[i], b[i]);
    }
}

__global__ void k_unary(int kind, TDesc dst, TDesc a, float f) {
    pdl_enter();
    const int64_t n0 = a.ne[0], rows = a.nrows();
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
        const float* xa = row_f(a, r);
        float* y = const_cast<float*>(row_f(dst, r));
        for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n0;
             i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
            const float x = xa[i];
            y[i] = kind == 0 ? x * f : silu_f(x);
        }
    }
}

// The jobs of one RoPE launch (launch_rope): job blockIdx.y.
struct RopeJobs {
    RopeJob j[kMaxRopeJobs];
};

// One block per (token, job), grid-stride over tokens. A rotating job's threads first compute the
// token's angles exactly as the CPU does (in double, from the position), one per pair, into shared
// memory; then warp w rotates heads w, w + nwarps, ... (lanes over the pairs, then over the
// unrotated tail), so no thread divides to find its head. kRopeStore also writes the rotated row to
// cache row cells[t] (SET_ROWS of the rotated K, the same conversion as k_set_rows_elem); kStore
// only copies source row t to cache row cells[t] (the V of the same cells). An out-of-range cell
// sets kErrSetRowsId and is not written, as SET_ROWS does.
__global__ void k_rope(const __grid_constant__ RopeJobs jobs, const int32_t* pos, const int32_t* cells,
                       const float* factors, int n_rot, int neox, double base, double fscale, bool early,
                       unsigned* err) {
    const RopeJob& job = jobs.j[blockIdx.y];
    const TDesc& dst = job.dst;
    const TDesc& x = job.src;
    extern __shared__ float s_rope[];  // cos[half], sin[half]
    const int half = n_rot / 2;
    // Token t's angles into s_rope (the caller syncs before they are read).
    auto angles = [&](int64_t t) {
        rope_angles(pos[t], factors, n_rot, base, fscale, s_rope, threadIdx.x, blockDim.x);
    };
    // early (the positions and factors are graph leaves, which no kernel writes): the block's first
    // token's angles before the PDL wait (cuda/launch.cuh), so the double-precision pow and sincos
    // run while the kernel before still does; the rotation itself waits.
    const bool first_early = early && job.kind != RopeJob::kStore && blockIdx.x < x.ne[2];
    if (first_early) angles(blockIdx.x);
    pdl_enter();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const bool store = job.kind != RopeJob::kRope;
    if (job.kind == RopeJob::kStore) {
        const int64_t n0 = x.ne[0];
        const int64_t i0 = static_cast<int64_t>(blockIdx.z) * blockDim.x + threadIdx.x, di = static_cast<int64_t>(gridDim.z) * blockDim.x;
        for (int64_t t = blockIdx.x; t < x.nrows(); t += gridDim.x) {
            const int32_t id = cells[t];
            if (id < 0 || id >= job.cache.ne[1]) {
                if (threadIdx.x == 0) atomicOr(err, kErrSetRowsId);
                continue;
            }
            const char* xr = x.row(t);
            char* cr = job.cache.data + static_cast<int64_t>(id) * job.cache.nb[1];
            for (int64_t i = i0; i < n0; i += di) store_elem(job.cache.dtype, cr, i, load_elem(x.dtype, xr, i));
        }
        return;
    }
    const int hd = static_cast<int>(x.ne[0]), n_head = static_cast<int>(x.ne[1]);
    for (int64_t t = blockIdx.x; t < x.ne[2]; t += gridDim.x) {
        if (t != blockIdx.x || !first_early) {  // else computed before the wait
            __syncthreads();                     // the previous token's angles are no longer read
            angles(t);
        }
        __syncthreads();
        char* crow = nullptr;
        if (store) {
            const int32_t id = cells[t];
            if (id >= 0 && id < job.cache.ne[1]) {
                crow = job.cache.data + static_cast<int64_t>(id) * job.cache.nb[1];
            } else if (threadIdx.x == 0) {
                atomicOr(err, kErrSetRowsId);
            }
        }
        // Heads warp by warp over the blocks of grid z (head groups): a decode's 32 q heads take
        // 4 blocks of 8 warps, one head a warp, instead of one block whose warps did 4 in turn.
        for (int h = warp + n_warps * static_cast<int>(blockIdx.z); h < n_head; h += n_warps * static_cast<int>(gridDim.z)) {
            const float* xr = reinterpret_cast<const float*>(x.data + t * x.nb[2] + h * x.nb[1]);
            float* yr = reinterpret_cast<float*>(dst.data + t * dst.nb[2] + h * dst.nb[1]);
            const int64_t c0 = static_cast<int64_t>(h) * hd;  // the head's first element in the cache row
            for (int i = lane; i < half; i += 32) {
                int i0, i1;
                rope_pair(i, half, neox, i0, i1);
                float y0, y1;
                rope_rotate(xr[i0], xr[i1], s_rope[i], s_rope[half + i], y0, y1);
                yr[i0] = y0;
                yr[i1] = y1;
                if (crow) {
                    store_elem(job.cache.dtype, crow, c0 + i0, y0);
                    store_elem(job.cache.dtype, crow, c0 + i1, y1);
                }
            }
            for (int i = n_rot + lane; i < hd; i += 32) {
                yr[i] = xr[i];
                if (crow) store_elem(job.cache.dtype, crow, c0 + i, xr[i]);
            }
        }
    }
}

__global__ void k_softmax(TDesc dst, TDesc a, float sc) {
    pdl_enter();
    __shared__ float red[32];
    const int64_t r = blockIdx.x, n = a.ne[0];
    const float* ar = reinterpret_cast<const float*>(a.row(r));
    float* yr = reinterpret_cast<float*>(dst.row(r));
    float m = -INFINITY;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, ar[i] * sc);
    m = block_max(m, red);
    if (m == -INFINITY) {
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yr[i] = 0.0f;
        return;
    }
    float s = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = ar[i] * sc;
        s += v == -INFINITY ? 0.0f : expf(v - m);
    }
    const float inv = 1.0f / block_sum(s, red);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = ar[i] * sc;
        yr[i] = (v == -INFINITY ? 0.0f : expf(v - m)) * inv;
    }
}

// Each row's entries at its own ids (GATHER); -1 gives -inf.
__global__ void k_gather(TDesc dst, TDesc a, TDesc ids) {
    pdl_enter();
    const int64_t r = blockIdx.x, k = dst.ne[0];
    const float* ar = reinterpret_cast<const float*>(a.row(r));
    const int32_t* ir = reinterpret_cast<const int32_t*>(ids.row(r));
    float* out = reinterpret_cast<float*>(dst.row(r));
    for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
        const int32_t t = ir[j];
        out[j] = t >= 0 && t < a.ne[0] ? ar[t] : -INFINITY;
    }
}

__global__ void k_sum(TDesc dst, TDesc a) {
    pdl_enter();
    __shared__ double red[1024];
    const int64_t n0 = a.ne[0], total = n0 * a.nrows();
    double acc = 0.0;
    for (int64_t e = threadIdx.x; e < total; e += blockDim.x) {
        acc += reinterpret_cast<const float*>(a.row(e / n0))[e % n0];
    }
    red[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) reinterpret_cast<float*>(dst.data)[0] = static_cast<float>(red[0]);
}

// The element-wise kernels' grid: enough column blocks for a row, one row per block row (grid-
// stride beyond 65535 rows).
dim3 rows_grid(int64_t n0, int64_t rows) {
    const int64_t gx = std::max<int64_t>(1, std::min<int64_t>((n0 + kThreads - 1) / kThreads, 1024));
    const int64_t gy = std::max<int64_t>(1, std::min<int64_t>(rows, 65535));
    return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
}

unsigned elems_grid(int64_t n) {
    const int64_t g = (n + kThreads - 1) / kThreads;
    return static_cast<unsigned>(g < 1 ? 1 : (g > 65535 * 16 ? 65535 * 16 : g));
}

}  // namespace

void launch_cpy(const TDesc& dst, const TDesc& src, cudaStream_t s) {
    if (dtype_is_quantized(dst.dtype)) {
        launch(k_cpy_quant, elems_grid(src.nrows() * (src.ne[0] / QK)), kThreads, 0, s, dst, src);
    } else {
        launch(k_cpy_elem, elems_grid(src.nrows() * src.ne[0]), kThreads, 0, s, dst, src);
    }
}

void launch_get_rows(const TDesc& dst, const TDesc& table, const int32_t* ids, unsigned* err, cudaStream_t s) {
    launch(k_get_rows, elems_grid(dst.ne[0] * dst.ne[1]), kThreads, 0, s, dst, table, ids, err);
}

Jobs make_jobs(const OpJob* jobs, int n) {
    if (n < 1 || n > kMaxOpJobs) throw std::logic_error("cuda backend: bad job count");
    Jobs j{};
    for (int i = 0; i < n; ++i) j.j[i] = jobs[i];
    return j;
}

void launch_set_rows(const OpJob* jobs, int n, const int32_t* ids, unsigned* err, cudaStream_t s) {
    const Jobs j = make_jobs(jobs, n);
    int64_t most = 0;
    for (int i = 0; i < n; ++i) most = std::max(most, jobs[i].src.nrows() * jobs[i].src.ne[0]);
    if (dtype_is_quantized(jobs[0].dst.dtype)) {
        launch(k_set_rows_quant, dim3(elems_grid(most / QK), n), kThreads, 0, s, j, ids, err);
    } else {
        launch(k_set_rows_elem, dim3(elems_grid(most), n), kThreads, 0, s, j, ids, err);
    }
}

void launch_rms_norm(const OpJob* jobs, int n, float eps, cudaStream_t s) {
    const Jobs j = make_jobs(jobs, n);
    int64_t rows = 0;
    for (int i = 0; i < n; ++i) rows = std::max(rows, jobs[i].src.nrows());
    if (rows == 0) return;
    if (jobs[0].src.ne[0] <= kWarpNormMax) {
        launch(k_rms_norm_warp, dim3(grid_for(rows, kThreads / 32), n), kThreads, 0, s, j, eps);
    } else {
        launch(k_rms_norm_block, dim3(static_cast<unsigned>(rows), n), kNormBlockThreads, 0, s, j, eps);
    }
}

namespace {
// Whether t is one contiguous F32 block of shape `like`.
bool contiguous_like(const TDesc& t, const TDesc& like) {
    for (int d = 0; d < 4; ++d) {
        if (t.ne[d] != like.ne[d]) return false;
    }
    return t.nb[0] == 4 && t.nb[1] == 4 * t.ne[0] && t.nb[2] == t.nb[1] * t.ne[1] && t.nb[3] == t.nb[2] * t.ne[2];
}
}  // namespace

void launch_binary(int kind, const TDesc& dst, const TDesc& a, const TDesc& b, cudaStream_t s) {
    if (contiguous_like(a, a) && contiguous_like(b, a) && contiguous_like(dst, a)) {
        const int64_t n = a.ne[0] * a.nrows();
        if (n == 0) return;
        const bool vec = n % 4 == 0 && reinterpret_cast<uintptr_t>(a.data) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(b.data) % 16 == 0 && reinterpret_cast<uintptr_t>(dst.data) % 16 == 0;
        const int64_t units = vec ? n / 4 : n;
        const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((units + kThreads - 1) / kThreads, 2048));
        launch(k_binary_flat, blocks, kThreads, 0, s, kind, reinterpret_cast<float*>(dst.data),
               reinterpret_cast<const float*>(a.data), reinterpret_cast<const float*>(b.data), n, vec);
        return;
    }
    launch(k_binary, rows_grid(a.ne[0], a.nrows()), kThreads, 0, s, kind, dst, a, b);
}

void launch_unary(int kind, const TDesc& dst, const TDesc& a, float f, cudaStream_t s) {
    launch(k_unary, rows_grid(a.ne[0], a.nrows()), kThreads, 0, s, kind, dst, a, f);
}

void launch_rope(const RopeJob* jobs, int n, const int32_t* pos, const int32_t* cells, const float* factors, int n_rot,
                 bool neox, float freq_base, float freq_scale, bool inputs_fixed, unsigned* err, cudaStream_t s) {
    if (n < 1 || n > kMaxRopeJobs) throw std::logic_error("cuda backend: bad RoPE job count");
    RopeJobs j{};
    for (int i = 0; i < n; ++i) {
        if (jobs[i].kind != RopeJob::kRope && !cells) throw std::logic_error("cuda backend: RoPE store without cells");
        j.j[i] = jobs[i];
    }
    const int64_t tokens = jobs[0].src.ne[2];
    if (tokens == 0 || jobs[0].src.ne[1] == 0) return;
    const unsigned grid = static_cast<unsigned>(tokens < 65535 * 16 ? tokens : 65535 * 16);
    // Few tokens (decode, verify, drafts): the heads spread over head groups (grid z), one head a
    // warp, so no warp rotates several heads one after the other, each a chain of loads and stores.
    // H200, Qwen3-4B decode (q/k RoPE + K/V store, 32 + 8 heads): one block a job took 5.6-6.5 us
    // (ncu) on 3 SMs, head groups 4.2; tg128 319-322 -> 328-331 t/s in three alternating rounds.
    // SmolLM2 (9 + 3 heads, 2 groups): within the noise.
    int64_t heads = 1;
    for (int i = 0; i < n; ++i) heads = std::max<int64_t>(heads, jobs[i].src.ne[1]);
    const int64_t warps = kThreads / 32;
    const unsigned groups = tokens >= 64 ? 1u : static_cast<unsigned>((heads + warps - 1) / warps);
    launch(k_rope, dim3(grid, n, groups), kThreads, static_cast<size_t>(n_rot) * sizeof(float), s,
        j, pos, cells, factors, n_rot, neox ? 1 : 0, static_cast<double>(freq_base), static_cast<double>(freq_scale),
        inputs_fixed, err);
}

void launch_softmax(const TDesc& dst, const TDesc& a, float scale, cudaStream_t s) {
    if (a.nrows() == 0) return;
    launch(k_softmax, static_cast<unsigned>(a.nrows()), kThreads * 2, 0, s, dst, a, scale);
}

void launch_gather(const TDesc& dst, const TDesc& a, const TDesc& ids, cudaStream_t s) {
    if (dst.nrows() == 0) return;
    launch(k_gather, static_cast<unsigned>(dst.nrows()), 64, 0, s, dst, a, ids);
}

void launch_sum(const TDesc& dst, const TDesc& a, cudaStream_t s) { launch(k_sum, 1, 1024, 0, s, dst, a); }

}  // namespace cuda
}  // namespace pyspec
