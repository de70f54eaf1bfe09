// Device helpers of the F16 matvec probes (probe_gemv_f16.cu, probe_mega.cu): a warp's sum, a
// 16-byte unit of eight F16 weights against eight F32 activations in the production order, and
// the bulk-copy (copy engine) primitives that fill shared-memory stages (the mbarriers and the
// tensor-map copy are the backend's, cuda/tma.cuh).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "../../cuda/tma.cuh"  // the backend's mbarrier and 2-D tensor-map copy (header-only device parts)
#include "probe_common.cuh"

using pyspec::cuda::mbar_arrive;
using pyspec::cuda::mbar_expect_tx;
using pyspec::cuda::mbar_init;
using pyspec::cuda::mbar_wait;
using pyspec::cuda::tma_load_2d;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int d = 16; d >= 1; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
    return v;
}

// One unit's 8 products on acc, in order t = 0..7, its x as two halves a, b.
__device__ __forceinline__ float unit_fma2(uint4 w, float4 a, float4 b, float acc) {
    const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        acc = fmaf(__half2float(__ushort_as_half(static_cast<uint16_t>(ws[t] & 0xffffu))), xv[2 * t], acc);
        acc = fmaf(__half2float(__ushort_as_half(static_cast<uint16_t>(ws[t] >> 16))), xv[2 * t + 1], acc);
    }
    return acc;
}

// unit_fma2 with the unit's 8 x values at xu.
__device__ __forceinline__ float unit_fma(uint4 w, const float* xu, float acc) {
    return unit_fma2(w, *reinterpret_cast<const float4*>(xu), *reinterpret_cast<const float4*>(xu + 4), acc);
}

// One bulk copy global -> shared whose bytes count on the barrier.
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
// One bulk copy that alone completes the barrier's phase.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    mbar_expect_tx(bar, bytes);
    bulk_copy(dst, src, bytes, bar);
}
// One 16-byte copy global -> shared by cp.async (in flight until the thread's wait_group).
__device__ __forceinline__ void cp16(void* dst, const void* src) {
    const uint32_t sa = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(src) : "memory");
}
__device__ __forceinline__ uint32_t saddr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }


// Random weights in [-0.025, 0.025), a hash of the index and seed.
__global__ void k_fill(__half* p, int64_t n, uint32_t seed) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        p[i] = __float2half((static_cast<float>(h & 0xffff) / 65536.0f - 0.5f) * 0.05f);
    }
}

// Qwen3-4B's decode matvecs: hidden 2560, q 4096, k and v 1024 each, FFN 9728; a layer's F16
// weights (q/k/v, o, gate/up, down) in halves.
constexpr int kHidden = 2560, kQ = 4096, kKV = 1024, kFfn = 9728;
constexpr int64_t kLayerHalves = int64_t{kHidden} * (kQ + 2 * kKV) + int64_t{kQ} * kHidden + int64_t{2} * kFfn * kHidden +
                                 int64_t{kFfn} * kHidden;

// n_layer layers of random weights, back to back, filled on s.
inline __half* qwen3_weights(int n_layer, cudaStream_t s) {
    __half* w = nullptr;
    CK(cudaMalloc(&w, kLayerHalves * n_layer * sizeof(__half)));
    k_fill<<<1024, 256, 0, s>>>(w, kLayerHalves * n_layer, 1234u);
    return w;
}
