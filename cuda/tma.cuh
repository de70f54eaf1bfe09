// The Tensor Memory Accelerator's pieces (sm_90), shared by the kernels that stream weights with it
// (the TMA-fed tensor-core GEMM, cuda/matmul_tc_tma.cu; the one-column row groups,
// cuda/matmul_rows_tma.cuh): shared-memory mbarriers, a 2-D tensor-map copy, and the host's map
// encoder (cuTensorMapEncodeTiled, from the driver through the runtime: no libcuda link).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace pyspec {
namespace cuda {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Returns once the phase of the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\nwait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// Box (c0, c1) of a 2-D tensor map into shared memory; the bytes count on mbarrier bar.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}

// Whether this driver hands out cuTensorMapEncodeTiled.
bool tensor_maps_available();

// A 2-D map of `rows` rows of `cols` 16-bit values (BF16 or F16), `pitch` bytes apart, read in
// boxes of box_cols x box_rows, into the 128-byte-swizzled layout (swizzle128) or as they lie;
// reads past either edge give zeros. Throws when the driver refuses it.
void make_map_2d(CUtensorMap* map, bool bf16, const void* base, int64_t cols, int64_t rows, int64_t pitch, int box_cols,
                 int box_rows, bool swizzle128);

}  // namespace cuda
}  // namespace pyspec
