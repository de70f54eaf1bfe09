// Asynchronous global -> shared copies (cp.async, sm_80+), shared by the kernels that stage rows
// in shared memory ahead of their use (the narrow tensor-core MUL_MAT, the staged attention).
#pragma once

#include <cstdint>

namespace pyspec {
namespace cuda {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

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
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
// wait_group takes an immediate: pending (< kMax) picks it from an unrolled loop's constant.
template <int kMax>
__device__ __forceinline__ void cp_async_wait_n(int pending) {
    if constexpr (kMax > 0) {
        if (pending == kMax - 1) {
            cp_async_wait<kMax - 1>();
        } else {
            cp_async_wait_n<kMax - 1>(pending);
        }
    }
}

}  // namespace cuda
}  // namespace pyspec
