// Hopper's warpgroup MMA (wgmma, sm_90a) as the wide tensor-core GEMMs use it: the shared-memory
// matrix descriptor, one k16 step with A from shared memory (cuda/matmul_tc_wgmma.cu) or from
// registers (cuda/matmul_tc_tma.cu), B from shared memory, F32 accumulators, N = 64, 96 or 128.
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PYSPEC_HAS_WGMMA 1
#endif

namespace pyspec {
namespace cuda {
namespace tc {

// The shared-memory matrix descriptor: K-major rows of 128 bytes, 128-byte swizzle (16-byte unit
// u of row r at u ^ (r % 8), 1024-byte atoms of 8 rows; the leading offset is unused there).
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr) {
    return static_cast<uint64_t>((addr >> 4) & 0x3fffu) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
           (uint64_t{1} << 62);
}

// Keeps the compiler from moving accesses to registers an in-flight wgmma reads or writes (it
// cannot see the instruction's asynchronous use of them) across this point.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_operands(uint32_t (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

#ifdef PYSPEC_HAS_WGMMA
// The accumulator operands of an m64nN wgmma (N / 2 floats a thread): the register list, and the
// asm operands d[0] .. d[N / 2 - 1] numbered from 0.
#define PYSPEC_WG_R16(b) "%" #b "0, %" #b "1, %" #b "2, %" #b "3, %" #b "4, %" #b "5, %" #b "6, %" #b "7, %" #b "8, %" #b "9"
#define PYSPEC_WG_ACC32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, " PYSPEC_WG_R16(1) ", " PYSPEC_WG_R16(2) ", %30, %31"
#define PYSPEC_WG_ACC48 PYSPEC_WG_ACC32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define PYSPEC_WG_ACC64 PYSPEC_WG_ACC48 ", %48, %49, " PYSPEC_WG_R16(5) ", %60, %61, %62, %63"
#define PYSPEC_WG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                         "+f"(d[i + 6]), "+f"(d[i + 7])
#define PYSPEC_WG_OUT32 PYSPEC_WG_D8(0), PYSPEC_WG_D8(8), PYSPEC_WG_D8(16), PYSPEC_WG_D8(24)
#define PYSPEC_WG_OUT48 PYSPEC_WG_OUT32, PYSPEC_WG_D8(32), PYSPEC_WG_D8(40)
#define PYSPEC_WG_OUT64 PYSPEC_WG_OUT48, PYSPEC_WG_D8(48), PYSPEC_WG_D8(56)

// D += A B, A and B from shared memory (descriptors a, b).
#define PYSPEC_WGMMA_SS(N, TY, ACC, OUT, A, B)                                                               \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY \
                 "." TY " {" ACC "}, %" A ", %" B ", p, 1, 1, 0, 0;\n}\n"                                       \
                 : OUT                                                                                       \
                 : "l"(a), "l"(b))
// D += A B, A from registers (the m16n8k16 A fragment of each warp's 16 rows), B from shared memory.
#define PYSPEC_WGMMA_RS(N, TY, ACC, OUT, A0, A1, A2, A3, B)                                                   \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY \
                 "." TY " {" ACC "}, {%" A0 ", %" A1 ", %" A2 ", %" A3 "}, %" B ", p, 1, 1, 0;\n}\n"             \
                 : OUT                                                                                       \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))

template <bool kBF16, int N>
__device__ __forceinline__ void wgmma_step(float (&d)[N / 2], uint64_t a, uint64_t b) {
    static_assert(N == 64 || N == 96 || N == 128, "the widths the GEMMs instantiate");
    if constexpr (N == 64) {
        if constexpr (kBF16) PYSPEC_WGMMA_SS(64, "bf16", PYSPEC_WG_ACC32, PYSPEC_WG_OUT32, "32", "33");
        else PYSPEC_WGMMA_SS(64, "f16", PYSPEC_WG_ACC32, PYSPEC_WG_OUT32, "32", "33");
    } else if constexpr (N == 96) {
        if constexpr (kBF16) PYSPEC_WGMMA_SS(96, "bf16", PYSPEC_WG_ACC48, PYSPEC_WG_OUT48, "48", "49");
        else PYSPEC_WGMMA_SS(96, "f16", PYSPEC_WG_ACC48, PYSPEC_WG_OUT48, "48", "49");
    } else {
        if constexpr (kBF16) PYSPEC_WGMMA_SS(128, "bf16", PYSPEC_WG_ACC64, PYSPEC_WG_OUT64, "64", "65");
        else PYSPEC_WGMMA_SS(128, "f16", PYSPEC_WG_ACC64, PYSPEC_WG_OUT64, "64", "65");
    }
}

template <bool kBF16, int N>
__device__ __forceinline__ void wgmma_step_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {
    static_assert(N == 64 || N == 96 || N == 128, "the widths the GEMMs instantiate");
    if constexpr (N == 64) {
        if constexpr (kBF16) PYSPEC_WGMMA_RS(64, "bf16", PYSPEC_WG_ACC32, PYSPEC_WG_OUT32, "32", "33", "34", "35", "36");
        else PYSPEC_WGMMA_RS(64, "f16", PYSPEC_WG_ACC32, PYSPEC_WG_OUT32, "32", "33", "34", "35", "36");
    } else if constexpr (N == 96) {
        if constexpr (kBF16) PYSPEC_WGMMA_RS(96, "bf16", PYSPEC_WG_ACC48, PYSPEC_WG_OUT48, "48", "49", "50", "51", "52");
        else PYSPEC_WGMMA_RS(96, "f16", PYSPEC_WG_ACC48, PYSPEC_WG_OUT48, "48", "49", "50", "51", "52");
    } else {
        if constexpr (kBF16) PYSPEC_WGMMA_RS(128, "bf16", PYSPEC_WG_ACC64, PYSPEC_WG_OUT64, "64", "65", "66", "67", "68");
        else PYSPEC_WGMMA_RS(128, "f16", PYSPEC_WG_ACC64, PYSPEC_WG_OUT64, "64", "65", "66", "67", "68");
    }
}
#endif  // PYSPEC_HAS_WGMMA

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

}  // namespace tc
}  // namespace cuda
}  // namespace pyspec
