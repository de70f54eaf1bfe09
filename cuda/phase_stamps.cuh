// A diagnostic: when a kernel's phases happen, inside the launch, while the step runs in its graph
// (tools/device/phase_stamps.py). step_trace.py gives each launch's start and end in the
// pipeline and ncu each kernel alone; neither says which part of a latency-bound launch (the
// decode attention: its wait, its loads, its reductions) holds the step. Compiled in only with
// -DPYSPEC_CUDA_PHASE_STAMPS (the CMake option PYSPEC_CUDA_PHASE_STAMPS=ON); otherwise the macros
// are empty and the kernels are as they were.
//
// PHASE_STAMP(slot, dep): thread 0 of each block records %globaltimer once `dep` has been
// computed; PHASE_BLOCK_END(slot, dep): the same after every thread of the block got there (a
// barrier: where the block's last warp is done). dep is an operand of the timer read, so the
// compiler cannot move the read ahead of the work that produces dep (a stamp without one may be
// taken before a plain load or fmaf it follows in the source, which made an earlier, hand-made
// version of these stamps put the decode attention's K dot after its softmax). A block keeps its
// stamps in shared memory: under PDL the next launch's blocks stamp their start while this one's
// last blocks still run, and a table in global memory shared by the launches mixed the two.
// PHASE_REPORT(name, n_slots), by every thread on every path out of the kernel: a block of a
// selected launch copies its stamps (the first kBlocks blocks) into its launch's entry of a log
// in global memory, a few stores, so the selected launches run at their own pace and the
// transitions between them are as in a normal build; the grid's last block moves the launch
// count on, and the last selected launch's last block prints the whole log: per launch its first
// slot-0 stamp (absolute ns, so that launches of different kernels line up) and each slot's
// earliest and latest stamp over the blocks in ns from it ("-" for a slot no block reached, e.g.
// a fold its warp had no cells for). That print is slow (a few ms) and comes after the window.
// PHASE_CONFIGURE(tag), on the host before the kernels' first launch, selects them from
// PYSPEC_CUDA_PHASE_<tag>_EVERY / _AT / _SPAN / _FROM / _COUNT: the launch index i (counted per
// translation unit, over its stamped kernels) with AT <= i % EVERY < AT + SPAN and
// FROM <= i / EVERY < FROM + COUNT, e.g. one layer's launches in steps FROM..FROM+COUNT-1 (at
// most kLogLaunches in all: SPAN x COUNT beyond it are not logged).
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
constexpr int kLogLaunches = 48;

// Each translation unit has its own (static, and the CUDA build has no relocatable device code).
static __device__ unsigned long long g_log[kLogLaunches][kBlocks][kSlots];
static __device__ const char* g_log_name[kLogLaunches];
static __device__ int g_log_launch[kLogLaunches], g_log_slots[kLogLaunches];
static __device__ unsigned g_reported, g_launch;
static __device__ int g_select[5] = {1, 0, 1, 0, 0};  // every, at, span, from, count

// The block's stamps (one array a kernel: this function is not a template).
__device__ __forceinline__ unsigned long long* block_stamps() {
    __shared__ unsigned long long s_at[kSlots];
    return s_at;
}

template <class T>
__device__ __forceinline__ unsigned bits_of(T v) {
    unsigned u = 0;
    memcpy(&u, &v, sizeof(v) < sizeof(u) ? sizeof(v) : sizeof(u));
    return u;
}

template <class T>
__device__ __forceinline__ void stamp(int slot, T dep) {
    if (threadIdx.x != 0 || slot >= kSlots) return;
    unsigned long long* at = block_stamps();
    if (slot == 0) {
        for (int s = 1; s < kSlots; ++s) at[s] = 0;  // (shared memory starts undefined)
    }
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : "r"(bits_of(dep)));
    at[slot] = t;
}

template <class T>
__device__ __forceinline__ void block_end(int slot, T dep) {
    __syncthreads();
    stamp(slot, dep);
}

// The log's entry for launch i, or -1 where i is not selected or the log is full.
__device__ inline int log_entry(int i) {
    const int every = g_select[0] > 0 ? g_select[0] : 1, step = i / every, at = i % every;
    if (at < g_select[1] || at >= g_select[1] + g_select[2] || step < g_select[3] || step >= g_select[3] + g_select[4]) {
        return -1;
    }
    const int e = (step - g_select[3]) * g_select[2] + (at - g_select[1]);
    return e < kLogLaunches ? e : -1;
}

// Every logged launch, as phase_stamps.py reads them (thread 0 of the printing block).
__device__ inline void print_log(int entries) {
    for (int e = 0; e < entries; ++e) {
        const int i = g_log_launch[e];
        const int every = g_select[0] > 0 ? g_select[0] : 1;
        unsigned long long t0 = ~0ull;
        for (int b = 0; b < kBlocks; ++b) {
            const unsigned long long t = __ldcg(&g_log[e][b][0]);
            if (t != 0) t0 = min(t0, t);
        }
        printf("PHASES %s launch %d step %d at %d t0 %llu:", g_log_name[e], i, i / every, i % every, t0);
        for (int s = 0; s < g_log_slots[e] && s < kSlots; ++s) {
            long long lo = 1ll << 62, hi = -(1ll << 62);
            for (int b = 0; b < kBlocks; ++b) {
                const unsigned long long t = __ldcg(&g_log[e][b][s]);
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
}

__device__ inline void report(const char* name, int n_slots) {
    __syncthreads();  // the block's stamps are in
    const unsigned n = gridDim.x * gridDim.y * gridDim.z;
    const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (threadIdx.x == 0) {
        // This launch's index: the launch before moved the count on before it completed, and
        // this block is past its PDL wait; the launch after cannot complete before this one.
        const int i = static_cast<int>(*static_cast<volatile unsigned*>(&g_launch));
        const int e = log_entry(i);
        if (e >= 0 && block < kBlocks) {
            const unsigned long long* at = block_stamps();
            for (int s = 0; s < kSlots; ++s) g_log[e][block][s] = at[s];
            if (block == 0) {
                g_log_name[e] = name;
                g_log_launch[e] = i;
                g_log_slots[e] = n_slots;
            }
        }
        __threadfence();
        if (atomicAdd(&g_reported, 1u) == n - 1) {
            g_reported = 0;
            g_launch = static_cast<unsigned>(i + 1);
            __threadfence();
            // The window's last launch prints the log (every earlier launch has completed).
            const int last = g_select[2] * g_select[4] < kLogLaunches ? g_select[2] * g_select[4] : kLogLaunches;
            if (e >= 0 && e == last - 1) print_log(last);
        }
    }
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
