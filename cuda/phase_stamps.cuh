// A diagnostic: when a kernel's phases happen, inside the launch, while the step runs in its graph
// (tools/device/phase_stamps.py). step_trace.py gives each launch's start and end in the
// pipeline and ncu each kernel alone; neither says which part of a latency-bound launch (the
// decode attention: its wait, its loads, its reductions) holds the step. Compiled in only with
// -DPYSPEC_CUDA_PHASE_STAMPS (the CMake option PYSPEC_CUDA_PHASE_STAMPS=ON); otherwise the macros
// are empty and the kernels are as they were.
//
// PHASE_STAMP(slot, dep): thread 0 of each of the first kBlocks blocks records %globaltimer once
// `dep` has been computed; PHASE_BLOCK_END(slot, dep): the same after every thread of the block
// got there (a barrier: where the block's last warp is done). dep is an operand of the timer
// read, so the compiler cannot move the read ahead of the work that produces dep (a stamp
// without one may be taken before a plain load or fmaf it follows in the source, which made an
// earlier, hand-made version of these stamps put the decode attention's K dot after its softmax). PHASE_REPORT(name, n_slots), by every thread
// on every path out of the kernel: the grid's last block to report prints, for the launches
// selected, the launch's first slot-0 stamp (absolute ns, so that launches of different kernels
// line up) and each slot's earliest and latest stamp over the blocks in ns from it ("-" for a
// slot no block reached, e.g. a fold its warp had no cells for), then clears the stamps.
// PHASE_CONFIGURE(tag), on the host before the kernels' first launch, selects them from
// PYSPEC_CUDA_PHASE_<tag>_EVERY / _AT / _SPAN / _FROM / _COUNT: the launch index i (counted per
// translation unit, over its stamped kernels) with AT <= i % EVERY < AT + SPAN and
// FROM <= i / EVERY < FROM + COUNT, e.g. one layer's launches in steps FROM..FROM+COUNT-1.
#pragma once

#ifdef PYSPEC_CUDA_PHASE_STAMPS
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

namespace pyspec {
namespace cuda {
namespace phase_stamps {

constexpr int kSlots = 12, kBlocks = 512;  // (the row streams' balanced grid: 264 blocks)

// Each translation unit has its own (static, and the CUDA build has no relocatable device code).
static __device__ unsigned long long g_at[kBlocks][kSlots];
static __device__ unsigned g_reported, g_launch;
static __device__ int g_select[5] = {1, 0, 1, 0, 0};  // every, at, span, from, count

template <class T>
__device__ __forceinline__ unsigned bits_of(T v) {
    unsigned u = 0;
    memcpy(&u, &v, sizeof(v) < sizeof(u) ? sizeof(v) : sizeof(u));
    return u;
}

template <class T>
__device__ __forceinline__ void stamp(int slot, T dep) {
    const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (threadIdx.x != 0 || block >= kBlocks || slot >= kSlots) return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : "r"(bits_of(dep)));
    g_at[block][slot] = t;
}

template <class T>
__device__ __forceinline__ void block_end(int slot, T dep) {
    __syncthreads();
    stamp(slot, dep);
}

__device__ inline void report(const char* name, int n_slots) {
    __shared__ bool s_last;
    __syncthreads();
    const unsigned n = gridDim.x * gridDim.y * gridDim.z;
    if (threadIdx.x == 0) {
        __threadfence();
        s_last = atomicAdd(&g_reported, 1u) == n - 1;
    }
    __syncthreads();
    if (!s_last) return;
    const unsigned blocks = n < kBlocks ? n : kBlocks;
    const unsigned nt = blockDim.x * blockDim.y * blockDim.z;
    if (threadIdx.x == 0) {
        g_reported = 0;
        __threadfence();
    }
    const int i = static_cast<int>(g_launch);  // (read by every thread before thread 0 moves it on)
    const int every = g_select[0] > 0 ? g_select[0] : 1, step = i / every, at = i % every;
    if (threadIdx.x == 0 && at >= g_select[1] && at < g_select[1] + g_select[2] && step >= g_select[3] &&
        step < g_select[3] + g_select[4]) {
        unsigned long long t0 = ~0ull;
        for (unsigned b = 0; b < blocks; ++b) {
            const unsigned long long t = __ldcg(&g_at[b][0]);
            if (t != 0) t0 = min(t0, t);
        }
        printf("PHASES %s launch %d step %d at %d t0 %llu:", name, i, step, at, t0);
        for (int s = 0; s < n_slots && s < kSlots; ++s) {
            long long lo = 1ll << 62, hi = -(1ll << 62);
            for (unsigned b = 0; b < blocks; ++b) {
                const unsigned long long t = __ldcg(&g_at[b][s]);
                if (t == 0) continue;
                const long long v = static_cast<long long>(t - t0);
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
            }
            if (hi < lo) {
                printf(" %d:-", s);
            } else {
                printf(" %d:%lld..%lld", s, lo, hi);
            }
        }
        printf("\n");
    }
    __syncthreads();  // every thread has read the launch index and thread 0 has printed
    if (threadIdx.x == 0) g_launch = static_cast<unsigned>(i + 1);
    // Cleared by the whole block: one thread's 6,000 stores would hold up the next launch.
    for (unsigned j = threadIdx.x; j < blocks * kSlots; j += nt) g_at[j / kSlots][j % kSlots] = 0;
}

// The launch selection from the environment, into this translation unit's copy (host, before the
// stamped kernels' first launch; later calls return at once). static: one copy, and one flag, a
// translation unit, as g_select is.
static inline void configure(const char* tag) {
    static std::once_flag once;
    std::call_once(once, [tag] {
        int sel[5] = {1, 0, 1, 0, 0};
        const char* names[5] = {"EVERY", "AT", "SPAN", "FROM", "COUNT"};
        for (int i = 0; i < 5; ++i) {
            const std::string name = std::string("PYSPEC_CUDA_PHASE_") + tag + "_" + names[i];
            if (const char* v = std::getenv(name.c_str())) sel[i] = std::atoi(v);
        }
        cudaMemcpyToSymbol(g_select, sel, sizeof(sel));
    });
}

}  // namespace phase_stamps
}  // namespace cuda
}  // namespace pyspec

#define PHASE_STAMP(slot, dep) ::pyspec::cuda::phase_stamps::stamp(slot, dep)
#define PHASE_BLOCK_END(slot, dep) ::pyspec::cuda::phase_stamps::block_end(slot, dep)
#define PHASE_REPORT(name, n_slots) ::pyspec::cuda::phase_stamps::report(name, n_slots)
#define PHASE_CONFIGURE(tag) ::pyspec::cuda::phase_stamps::configure(tag)
#else
#define PHASE_STAMP(slot, dep) ((void)0)
#define PHASE_BLOCK_END(slot, dep) ((void)0)
#define PHASE_REPORT(name, n_slots) ((void)0)
#define PHASE_CONFIGURE(tag) ((void)0)
#endif
