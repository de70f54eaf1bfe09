// MUL_MAT: dst[n, m] = sum_k w[k, n] * x[k, m]. For m <= kMatvecMaxCols, custom matvec kernels
// read each weight row once for all m activation columns, dequantizing on the fly (one warp per
// weight row, each lane a unit of 8 values per step, F32 accumulation; activations stay F32, so
// quantized weights are more exact here than on the CPU, which quantizes activations to Q8).
// Larger m goes to cuBLAS: F32 weights through SGEMM; F16/BF16 weights through GemmEx with the
// activations converted to the weight type; quantized weights dequantized to F16 in chunks of rows
// (llama.cpp's approach); F32 accumulation everywhere.
#include <algorithm>

#include "cuda/kernels.h"

namespace pyspec {
namespace cuda {

void* Scratch::get(size_t n) {
    if (n > bytes) {
        if (p) check(cudaFree(p), "cudaFree (scratch)");
        p = nullptr;
        bytes = 0;
        check(cudaMalloc(&p, n), "cudaMalloc (scratch)");
        bytes = n;
    }
    return p;
}

Scratch::~Scratch() {
    if (p) cudaFree(p);
}

namespace {

constexpr int64_t kMatvecMaxCols = 16;
constexpr int kRowsPerBlock = 4;  // one warp per weight row

// The 8 values of unit u of a row: v[t] belongs at column pos0 + t for t < 4, pos1 + t - 4 after.
template <DType T, bool kAligned>
__device__ __forceinline__ void load_unit(const char* row, int64_t u, float v[8], int64_t& pos0, int64_t& pos1) {
    if constexpr (T == DType::F32) {
        pos0 = u * 8;
        pos1 = pos0 + 4;
        const float* p = reinterpret_cast<const float*>(row) + u * 8;
        if constexpr (kAligned) {
            const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        } else {
#pragma unroll
            for (int t = 0; t < 8; ++t) v[t] = p[t];
        }
    } else if constexpr (T == DType::F16 || T == DType::BF16) {
        pos0 = u * 8;
        pos1 = pos0 + 4;
        const uint16_t* p = reinterpret_cast<const uint16_t*>(row) + u * 8;
        uint16_t h[8];
        if constexpr (kAligned) {
            const uint4 a = *reinterpret_cast<const uint4*>(p);
            const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                h[2 * t] = static_cast<uint16_t>(w[t] & 0xffffu);
                h[2 * t + 1] = static_cast<uint16_t>(w[t] >> 16);
            }
        } else {
#pragma unroll
            for (int t = 0; t < 8; ++t) h[t] = p[t];
        }
#pragma unroll
        for (int t = 0; t < 8; ++t) v[t] = T == DType::F16 ? h2f(h[t]) : bf2f(h[t]);
    } else if constexpr (T == DType::Q8_0) {
        const int64_t b = u >> 2;
        const int part = static_cast<int>(u & 3);
        const char* blk = row + b * static_cast<int64_t>(sizeof(BlockQ8_0));
        const float d = h2f(ld16(blk));
        const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2 + part * 8);
#pragma unroll
        for (int t = 0; t < 8; ++t) v[t] = static_cast<float>(qs[t]) * d;
        pos0 = b * QK + part * 8;
        pos1 = pos0 + 4;
    } else if constexpr (T == DType::Q4_0) {
        const int64_t b = u >> 2;
        const int part = static_cast<int>(u & 3);
        const char* blk = row + b * static_cast<int64_t>(sizeof(BlockQ4_0));
        const float d = h2f(ld16(blk));
        const uint8_t* qs = reinterpret_cast<const uint8_t*>(blk + 2 + part * 4);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            v[t] = d * static_cast<float>((qs[t] & 15) - 8);
            v[t + 4] = d * static_cast<float>((qs[t] >> 4) - 8);
        }
        pos0 = b * QK + part * 4;
        pos1 = pos0 + 16;
    } else {  // Q4_1
        const int64_t b = u >> 2;
        const int part = static_cast<int>(u & 3);
        const char* blk = row + b * static_cast<int64_t>(sizeof(BlockQ4_1));
        const float d = h2f(ld16(blk)), mn = h2f(ld16(blk + 2));
        const uint8_t* qs = reinterpret_cast<const uint8_t*>(blk + 4 + part * 4);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            v[t] = __fmul_rn(d, static_cast<float>(qs[t] & 15)) + mn;
            v[t + 4] = __fmul_rn(d, static_cast<float>(qs[t] >> 4)) + mn;
        }
        pos0 = b * QK + part * 4;
        pos1 = pos0 + 16;
    }
}

template <DType T, bool kAligned, int NC>
__global__ void __launch_bounds__(kRowsPerBlock * 32) k_matvec(const char* w, int64_t n_rows, int64_t k,
                                                                 int64_t row_bytes, const float* x, int64_t x_stride,
                                                                 float* y, int64_t y_stride) {
    const int lane = threadIdx.x & 31;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
    if (row >= n_rows) return;
    const char* wr = w + row * row_bytes;
    const int64_t units = k / 8;
    float acc[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[c] = 0.0f;
    for (int64_t u = lane; u < units; u += 32) {
        float v[8];
        int64_t p0, p1;
        load_unit<T, kAligned>(wr, u, v, p0, p1);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const float* xc = x + c * x_stride;
            float a = acc[c];
#pragma unroll
            for (int t = 0; t < 4; ++t) a = fmaf(v[t], xc[p0 + t], a);
#pragma unroll
            for (int t = 0; t < 4; ++t) a = fmaf(v[t + 4], xc[p1 + t], a);
            acc[c] = a;
        }
    }
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const float s = warp_sum(acc[c]);
        if (lane == 0) y[c * y_stride + row] = s;
    }
}

// Any row length (float types whose k is not a multiple of 8): element by element.
__global__ void k_matvec_generic(DType t, const char* w, int64_t n_rows, int64_t k, int64_t row_bytes, const float* x,
                                 int64_t x_stride, int64_t m, float* y, int64_t y_stride) {
    const int lane = threadIdx.x & 31;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
    if (row >= n_rows) return;
    const char* wr = w + row * row_bytes;
    for (int64_t c = 0; c < m; ++c) {
        float a = 0.0f;
        for (int64_t i = lane; i < k; i += 32) a = fmaf(load_elem(t, wr, i), x[c * x_stride + i], a);
        a = warp_sum(a);
        if (lane == 0) y[c * y_stride + row] = a;
    }
}

template <DType T, bool kAligned>
void matvec_typed(const void* w, int64_t n, int64_t k, size_t rb, const float* x, int64_t xs, int64_t m, float* y,
                  int64_t ys, cudaStream_t s) {
    const unsigned grid = grid_for(n, kRowsPerBlock);
    const char* wp = static_cast<const char*>(w);
    const int64_t rbi = static_cast<int64_t>(rb);
    int64_t c = 0;
    while (c < m) {
        const int64_t left = m - c;
        const float* xc = x + c * xs;
        float* yc = y + c * ys;
        if (left >= 8) {
            k_matvec<T, kAligned, 8><<<grid, kRowsPerBlock * 32, 0, s>>>(wp, n, k, rbi, xc, xs, yc, ys);
            c += 8;
        } else if (left >= 4) {
            k_matvec<T, kAligned, 4><<<grid, kRowsPerBlock * 32, 0, s>>>(wp, n, k, rbi, xc, xs, yc, ys);
            c += 4;
        } else if (left >= 2) {
            k_matvec<T, kAligned, 2><<<grid, kRowsPerBlock * 32, 0, s>>>(wp, n, k, rbi, xc, xs, yc, ys);
            c += 2;
        } else {
            k_matvec<T, kAligned, 1><<<grid, kRowsPerBlock * 32, 0, s>>>(wp, n, k, rbi, xc, xs, yc, ys);
            c += 1;
        }
    }
}

void matvec(DType t, const void* w, int64_t n, int64_t k, size_t rb, const float* x, int64_t xs, int64_t m, float* y,
            int64_t ys, cudaStream_t s) {
    const bool float_type = t == DType::F32 || t == DType::F16 || t == DType::BF16;
    if (float_type && k % 8 != 0) {
        k_matvec_generic<<<grid_for(n, kRowsPerBlock), kRowsPerBlock * 32, 0, s>>>(
            t, static_cast<const char*>(w), n, k, static_cast<int64_t>(rb), x, xs, m, y, ys);
        return;
    }
    const bool aligned = reinterpret_cast<uintptr_t>(w) % 16 == 0 && rb % 16 == 0;
    switch (t) {
        case DType::F32:
            return aligned ? matvec_typed<DType::F32, true>(w, n, k, rb, x, xs, m, y, ys, s)
                           : matvec_typed<DType::F32, false>(w, n, k, rb, x, xs, m, y, ys, s);
        case DType::F16:
            return aligned ? matvec_typed<DType::F16, true>(w, n, k, rb, x, xs, m, y, ys, s)
                           : matvec_typed<DType::F16, false>(w, n, k, rb, x, xs, m, y, ys, s);
        case DType::BF16:
            return aligned ? matvec_typed<DType::BF16, true>(w, n, k, rb, x, xs, m, y, ys, s)
                           : matvec_typed<DType::BF16, false>(w, n, k, rb, x, xs, m, y, ys, s);
        case DType::Q8_0: return matvec_typed<DType::Q8_0, false>(w, n, k, rb, x, xs, m, y, ys, s);
        case DType::Q4_0: return matvec_typed<DType::Q4_0, false>(w, n, k, rb, x, xs, m, y, ys, s);
        case DType::Q4_1: return matvec_typed<DType::Q4_1, false>(w, n, k, rb, x, xs, m, y, ys, s);
        default: throw std::runtime_error(std::string("cuda backend: mul_mat: unsupported weight type ") + dtype_name(t));
    }
}

// x rows (F32, stride xs) -> contiguous F16 or BF16 [m][k].
__global__ void k_act_convert(const float* x, int64_t xs, int64_t k, int64_t m, uint16_t* out, int bf16) {
    const int64_t total = k * m;
    for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t r = e / k, i = e % k;
        const float v = x[r * xs + i];
        out[e] = bf16 ? f2bf(v) : f2h(v);
    }
}

// Weight rows [r0, r0 + nr) of any type -> contiguous F16 [nr][k].
__global__ void k_weight_to_f16(DType t, const char* w, int64_t rb, int64_t k, int64_t nr, uint16_t* out) {
    const int64_t total = k * nr;
    for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t r = e / k, i = e % k;
        out[e] = f2h(load_elem(t, w + r * rb, i));
    }
}

unsigned elems_grid(int64_t n) {
    const int64_t g = (n + 255) / 256;
    return static_cast<unsigned>(g < 1 ? 1 : (g > 65535 * 16 ? 65535 * 16 : g));
}

void check_blas(cublasStatus_t st, const char* what) {
    if (st != CUBLAS_STATUS_SUCCESS) {
        throw std::runtime_error(std::string("cuda backend: mul_mat: ") + what + " failed (cublas status " +
                                 std::to_string(static_cast<int>(st)) + ")");
    }
}

}  // namespace

void launch_matmul(DType t, const void* w, int64_t n, int64_t k, size_t rb, const float* x, int64_t xs, int64_t m,
                   float* y, int64_t ys, cublasHandle_t blas, Scratch& scratch, cudaStream_t s) {
    if (m <= 0 || n <= 0) return;
    if (k % dtype_block_size(t) != 0) throw std::runtime_error("cuda backend: mul_mat: k is not a multiple of the block size");
    if (m <= kMatvecMaxCols || k == 0) {
        matvec(t, w, n, k, rb, x, xs, m, y, ys, s);
        check_launch("mul_mat (matvec)");
        return;
    }
    check_blas(cublasSetStream(blas, s), "cublasSetStream");
    const float one = 1.0f, zero = 0.0f;
    const int ni = static_cast<int>(n), mi = static_cast<int>(m), ki = static_cast<int>(k);
    if (t == DType::F32 && rb % sizeof(float) == 0) {
        check_blas(cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, ni, mi, ki, &one, static_cast<const float*>(w),
                               static_cast<int>(rb / sizeof(float)), x, static_cast<int>(xs), &zero, y,
                               static_cast<int>(ys)),
                   "cublasSgemm");
        return;
    }
    const bool direct = (t == DType::F16 || t == DType::BF16) && rb % 2 == 0;
    const size_t act_bytes = (static_cast<size_t>(k) * static_cast<size_t>(m) * 2 + 255) / 256 * 256;
    // Quantized (or oddly strided) weights: dequantize chunks of rows to F16, <= 128 MiB each.
    int64_t chunk = direct ? n : std::max<int64_t>(1, std::min<int64_t>(n, (int64_t{64} << 20) / std::max<int64_t>(k, 1)));
    const size_t wbytes = direct ? 0 : static_cast<size_t>(chunk) * static_cast<size_t>(k) * 2;
    char* base = static_cast<char*>(scratch.get(act_bytes + wbytes));
    uint16_t* act = reinterpret_cast<uint16_t*>(base);
    uint16_t* wtmp = reinterpret_cast<uint16_t*>(base + act_bytes);
    const bool bf16 = direct && t == DType::BF16;
    k_act_convert<<<elems_grid(k * m), 256, 0, s>>>(x, xs, k, m, act, bf16 ? 1 : 0);
    check_launch("mul_mat (activation conversion)");
    const cudaDataType_t ab = bf16 ? CUDA_R_16BF : CUDA_R_16F;
    if (direct) {
        check_blas(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, ni, mi, ki, &one, w, ab, static_cast<int>(rb / 2), act,
                                ab, ki, &zero, y, CUDA_R_32F, static_cast<int>(ys), CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT),
                   "cublasGemmEx");
        return;
    }
    for (int64_t r0 = 0; r0 < n; r0 += chunk) {
        const int64_t nr = std::min(chunk, n - r0);
        k_weight_to_f16<<<elems_grid(nr * k), 256, 0, s>>>(t, static_cast<const char*>(w) + r0 * static_cast<int64_t>(rb),
                                                           static_cast<int64_t>(rb), k, nr, wtmp);
        check_launch("mul_mat (weight dequantization)");
        check_blas(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(nr), mi, ki, &one, wtmp, CUDA_R_16F,
                                ki, act, CUDA_R_16F, ki, &zero, y + r0, CUDA_R_32F, static_cast<int>(ys),
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                   "cublasGemmEx");
    }
}

}  // namespace cuda
}  // namespace pyspec
