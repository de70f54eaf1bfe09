// What the PDL probes share (probe_gemv_f16.cu, probe_mega.cu): the griddepcontrol halves, a
// launch with programmatic dependent launch, and a stand-in for the decode attention.
#pragma once

#include <cstdint>

#include "probe_common.cuh"

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_go() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// kernel<<<grid, block, smem, s>>>(args...) with programmatic dependent launch.
template <typename K, typename... A>
static void launch_pdl_block(K kernel, unsigned grid, unsigned block, size_t smem, cudaStream_t s, A... args) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(block);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// A stand-in for a decode step's attention between q/k/v and o: a few blocks holding an attention
// block's shared memory, busy for ns nanoseconds after the PDL wait (which lets o's blocks in), so
// DRAM idles as it does under the real attention and the SMs they hold are full.
__global__ void k_att(int64_t ns) {
    pdl_wait();
    pdl_go();
    int64_t t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
constexpr int kAttBlocks = 64;
constexpr size_t kAttSmem = 135 * 1024;

// The stand-in's shared-memory limit raised, once (call it before a stream capture).
static void size_att() {
    static const bool sized = [] {
        CK(cudaFuncSetAttribute(k_att, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kAttSmem)));
        return true;
    }();
    (void)sized;
}

// One stand-in of ns nanoseconds on s.
static void launch_att(int64_t ns, cudaStream_t s) {
    size_att();
    launch_pdl_block(k_att, kAttBlocks, 256, kAttSmem, s, ns);
}
