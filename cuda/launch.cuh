// Kernel launches with programmatic dependent launch (PDL, compute capability 9.0+).
//
// A decode step is a chain of ~300 small kernels, each waiting for the one before. Normally a
// kernel's launch (grid set-up, block dispatch) starts only once the previous kernel has fully
// finished and flushed; with PDL it is launched while the previous one still runs, its blocks
// wait on the device (griddepcontrol.wait) until that kernel has completed and its writes are
// visible, and then run at once. The launch latency is hidden behind the previous kernel.
//
// Safe by construction: every kernel calls pdl_enter() before it reads or writes any memory a
// kernel writes (so no read-after-write or write-after-read hazard with the previous kernel); the
// only accesses some make before it are L2 prefetches, which are hints (prefetch_enabled), reads
// of host-written inputs (an attention row's first cell) to aim them, loads of weights that no
// node of the graph writes (MatmulPart::constant, the row-streaming MUL_MATs), and a decode
// attention's copies of cache cells that no node of the graph but its own fused SET_ROWS pair
// writes, the cell those write left out (DecodeRope::early_copies), and a kernel only
// completes after its wait returned, so waiting on the
// previous kernel also waits on everything before it. pdl_enter() then lets the next kernel be
// launched: its blocks only become resident once every block of this grid has started, so they
// never take room this grid still needs. The arithmetic is untouched: PDL on or off gives the
// same bits (tests/test_cuda_graphs.py). PYSPEC_CUDA_PDL=0 turns it off.
#pragma once

#include <utility>

#include "cuda/common.cuh"

namespace pyspec {
namespace cuda {

// pdl_enter's two halves (alone: for a kernel that lets the next one be launched before it waits,
// still only once every block of this grid has started, since the trigger counts a grid's blocks:
// the next kernel's blocks never take room this grid needs, and wait for this grid in their own
// pdl_enter as before).
__device__ __forceinline__ void pdl_let_next_in() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Waits for the previous kernel in the stream (a no-op when it was not launched with PDL or on
// GPUs before compute capability 9.0), then allows the next one to be launched.
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_let_next_in();
}

// Runs flag<<<1, 1>>>(out) and says whether it wrote 1: the tiny kernels that report whether
// this build has a kernel's code for the running GPU (an architecture guard compiled in, not the
// PTX of an older one JIT-compiled). Call it outside stream capture (it allocates and copies).
bool flag_kernel_writes_one(void (*flag)(int*));

// Whether launches use PDL: PYSPEC_CUDA_PDL (default on) and a GPU of compute capability 9.0+.
bool pdl_enabled();

// Whether kernels ask L2 for the constant or long-written data they will read before their PDL
// wait (the decode MUL_MATs' weights, the attention's first K/V chunk): PYSPEC_CUDA_PREFETCH
// (default on). A prefetch is a hint: on or off gives the same bits.
bool prefetch_enabled();

// kernel<<<grid, block, smem, s>>>(args...), with the PDL attribute when pdl_enabled(); throws
// on a launch error (the op running it adds its name: run_ops).
template <typename... Params, typename... Args>
inline void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                   Args&&... args) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = pdl_enabled() ? 1 : 0;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
    if (e != cudaSuccess) {
        cudaGetLastError();  // a launch error is not sticky: clear it, so the next op is not blamed
        throw_cuda("kernel launch", e);
    }
}

}  // namespace cuda
}  // namespace pyspec
