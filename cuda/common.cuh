// Shared pieces of the CUDA backend's kernels: a tensor descriptor passed by value to kernels,
// error checking, element conversions (bit-compatible with core/dtype.h) and the block formats.
#pragma once

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include "core/dtype.h"

namespace pyspec {
namespace cuda {

// An environment switch: 1 when name is set to 1/on/true/yes, 0 for 0/off/false/no, else -1.
inline int env_switch(const char* name) {
    const char* v = std::getenv(name);
    if (!v) return -1;
    std::string s(v);
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (s == "1" || s == "on" || s == "true" || s == "yes") return 1;
    if (s == "0" || s == "off" || s == "false" || s == "no") return 0;
    return -1;
}

// What a kernel needs of a tensor: its device address, type, shape and byte strides.
struct TDesc {
    char* data;
    DType dtype;
    int64_t ne[4];
    int64_t nb[4];
    __host__ __device__ int64_t nrows() const { return ne[1] * ne[2] * ne[3]; }
    // Flattened row r over ne[1] * ne[2] * ne[3], any row strides (the CPU's row_ptr).
    __host__ __device__ char* row(int64_t r) const {
        const int64_t i1 = r % ne[1];
        const int64_t rest = r / ne[1];
        const int64_t i2 = rest % ne[2];
        const int64_t i3 = rest / ne[2];
        return data + i1 * nb[1] + i2 * nb[2] + i3 * nb[3];
    }
};

// Bits a kernel sets in the backend's device error word (checked at the next synchronising call).
enum ErrorBits : unsigned {
    kErrGetRowsId = 1u,
    kErrSetRowsId = 2u,
    kErrAttentionSpan = 4u,
    kErrBadType = 8u,
};

[[noreturn]] inline void throw_cuda(const char* what, cudaError_t e) {
    throw std::runtime_error(std::string("cuda backend: ") + what + ": " + cudaGetErrorString(e));
}

inline void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw_cuda(what, e);
}

inline unsigned grid_for(int64_t n, int threads) {
    const int64_t g = (n + threads - 1) / threads;
    return static_cast<unsigned>(g < 1 ? 1 : (g > 0x7fffffff ? 0x7fffffff : g));
}

// ---------------------------------------------------------------------------------------------
// Element conversions on the device.

__device__ __forceinline__ float h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ uint16_t f2h(float f) { return __half_as_ushort(__float2half_rn(f)); }
__device__ __forceinline__ float bf2f(uint16_t h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }
// Round to nearest even, NaN kept quiet: the same bits as core/dtype.h's fp32_to_bf16.
__device__ __forceinline__ uint16_t f2bf(float f) {
    const uint32_t x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 64);
    return static_cast<uint16_t>((x + (0x7fffu + ((x >> 16) & 1u))) >> 16);
}

// Unaligned-safe 16-bit load (blocks are 2-byte aligned only).
__device__ __forceinline__ uint16_t ld16(const char* p) { return *reinterpret_cast<const uint16_t*>(p); }

// Element i of a row of type t (quantized types: i indexes the row's values).
__device__ __forceinline__ float load_elem(DType t, const char* row, int64_t i) {
    switch (t) {
        case DType::F32: return reinterpret_cast<const float*>(row)[i];
        case DType::F16: return h2f(reinterpret_cast<const uint16_t*>(row)[i]);
        case DType::BF16: return bf2f(reinterpret_cast<const uint16_t*>(row)[i]);
        case DType::Q8_0: {
            const char* b = row + (i / QK) * sizeof(BlockQ8_0);
            const int j = static_cast<int>(i % QK);
            return static_cast<float>(static_cast<int8_t>(b[2 + j])) * h2f(ld16(b));
        }
        case DType::Q4_0: {
            const char* b = row + (i / QK) * sizeof(BlockQ4_0);
            const int j = static_cast<int>(i % QK);
            const uint8_t q = static_cast<uint8_t>(b[2 + (j & 15)]);
            const int v = (j < 16 ? (q & 15) : (q >> 4)) - 8;
            return h2f(ld16(b)) * static_cast<float>(v);
        }
        case DType::Q4_1: {
            const char* b = row + (i / QK) * sizeof(BlockQ4_1);
            const int j = static_cast<int>(i % QK);
            const uint8_t q = static_cast<uint8_t>(b[4 + (j & 15)]);
            const int v = j < 16 ? (q & 15) : (q >> 4);
            return __fmul_rn(h2f(ld16(b)), static_cast<float>(v)) + h2f(ld16(b + 2));
        }
        default: return 0.0f;
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The RMS norm's scale of a row (1 / sqrt(mean of squares + eps)) is summed in one of two fixed
// orders, chosen by the row length alone: rows of up to kWarpNormMax values by one warp (lane l
// sums x[i]^2 over i = l, l + 32, ... in increasing i as one fmaf chain from 0, then warp_sum),
// longer rows by kNormBlockThreads threads (thread t over i = t, t + 128, ..., then warp_sum in
// each warp, then the four warp sums as ((s0 + s1) + s2) + s3). The RMS_NORM kernels and the
// matmul's norm prologue (cuda/ops_matmul.cu) both use these and both normalise a value as
// x * scale * w, so a norm fused into the matmul that reads it gives the bits of the two apart.
constexpr int64_t kWarpNormMax = 256;
constexpr int kNormBlockThreads = 128;
static_assert(kNormBlockThreads == 4 * 32, "rms_scale_of_warp_sums adds four warp sums");

__device__ __forceinline__ float rms_scale(float lane_sum, int64_t n, float eps) {
    return 1.0f / sqrtf(warp_sum(lane_sum) / static_cast<float>(n) + eps);
}
__device__ __forceinline__ float warp_rms_scale(const float* x, int64_t n, int lane, float eps) {
    float acc = 0.0f;
#pragma unroll 8
    for (int64_t i = lane; i < n; i += 32) acc = fmaf(x[i], x[i], acc);
    return rms_scale(acc, n, eps);
}
__device__ __forceinline__ float rms_scale_of_warp_sums(const float* s, int64_t n, float eps) {
    return 1.0f / sqrtf((((s[0] + s[1]) + s[2]) + s[3]) / static_cast<float>(n) + eps);
}

// silu(x) = x * sigmoid(x), one formula for the SWIGLU/SILU ops and the matmul's SwiGLU epilogue
// (the same bits either way).
__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

// Block-wide sum / max for blockDim.x a multiple of 32 (<= 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* shared32) {
    v = warp_sum(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    v = lane < nw ? shared32[lane] : 0.0f;
    return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* shared32) {
    v = warp_max(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    v = lane < nw ? shared32[lane] : -INFINITY;
    return warp_max(v);
}

}  // namespace cuda
}  // namespace pyspec
