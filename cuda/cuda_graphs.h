// CUDA graph capture and replay of the CUDA backend's compute() (issue 8, item 2): the switch and
// the counters. Plain C++ (no CUDA headers), so the bindings can include it in every build; the
// definitions live in cuda/graph_cache.cu (CUDA builds) or in csrc/bindings/bind_cuda.cpp
// (CPU-only builds, where they do nothing and count nothing).
//
// What is captured: the whole launch sequence of one compute(graph), keyed by everything a kernel
// argument or a launch decision depends on (every tensor's op, type, shape, strides, sources and
// op parameters, plus the resolved device address of every operand). The first sighting of a key
// runs eagerly (the warm-up: weight uploads, cuBLAS handle, lazy kernel loading); the second is
// captured, instantiated and launched; later ones replay the instantiated graph. Inputs written
// before compute() and outputs read after it are plain copies outside the graph: the planner's
// stable addresses (design.md invariant 1) keep them where the graph's kernels look.
#pragma once

#include <cstdint>

namespace pyspec {

struct CudaGraphStats {
    uint64_t captures = 0;          // graphs captured and instantiated
    uint64_t replays = 0;           // launches of an already instantiated graph
    uint64_t eager = 0;             // compute() calls run op by op (graphs off, first sightings, failures)
    uint64_t capture_failures = 0;  // captures that failed and fell back to eager execution
    uint64_t evictions = 0;         // instantiated graphs dropped by the LRU bound
    uint64_t live = 0;              // instantiated graphs held now, over all CUDA backends
    // Launches (eager or captured, not replays) of a row-streaming MUL_MAT that loads its weights
    // before its PDL wait, i.e. that the backend judged constant: what tests check that weights a
    // node of the graph writes are never loaded early (a race the GPU rarely shows by itself).
    uint64_t early_weight_launches = 0;
    // Launches (eager or captured) of a decode row's attention that ran its q/k RoPE and K/V store
    // too (cuda::DecodeRope): what tests check that the fusion happens where it should.
    uint64_t rope_attention_launches = 0;
    // Of those, the launches that copied their first page's cache cells before the PDL wait
    // (DecodeRope::early_copies): what tests check to know the early copies ran, or were refused.
    uint64_t early_copy_attention_launches = 0;
    // Of those, the launches that read the step's RoPE angles stored by its first one
    // (DecodeRope::angles_stored) instead of computing them.
    uint64_t stored_angles_attention_launches = 0;
    // Launches (eager or captured) of the one-column row groups fed by the copy engine
    // (k_mul_mat_rows_tma): what tests check that the kernel runs where it should.
    uint64_t row_tma_launches = 0;
    // Launches (eager or captured) of a MUL_MAT group that ran the RMS_NORM before it as its
    // prologue: what tests check that the fusion they compare against the nodes run apart happens.
    uint64_t norm_prologue_launches = 0;
    // Of those, the row-streaming launches that copied the norm's weights into shared memory
    // before the PDL wait (stage_norm_weights; PYSPEC_CUDA_NORM_EARLY=0 turns it off).
    uint64_t early_norm_launches = 0;
    // Row-streaming launches on the deep grid: one block of kDeepWarps a SM, more units in flight
    // a warp (kRowDeep; PYSPEC_CUDA_ROW_DEEP=0 turns it off).
    uint64_t deep_row_launches = 0;
    // Row-streaming launches on the balanced grid fed piped: each warp's items one stream of
    // rounds (kRowPiped; PYSPEC_CUDA_ROW_PIPED=0 turns it off).
    uint64_t piped_row_launches = 0;
    // Of those, the launches on one block of 16 warps a SM instead of two of 8 (kRowPipedOneBlock;
    // PYSPEC_CUDA_ROW_PIPED_ONE_BLOCK=0 turns it off).
    uint64_t one_block_row_launches = 0;
    // Row-streaming launches that left SMs free for the decode attention after them (kRowRoom;
    // PYSPEC_CUDA_ROW_ROOM=0 turns it off).
    uint64_t room_row_launches = 0;
    // Launches that ran several of the backend's small copies at once (a step's input writes, its
    // fed tokens, its outputs' reads; cuda/backend_copies.cu; PYSPEC_CUDA_BATCH_COPIES=0 turns it off).
    uint64_t batched_copy_launches = 0;
    // With PYSPEC_CUDA_STEP_TIMES=1 in the environment when a CUDA backend is made: replays timed
    // by events around their graph launch, and their GPU time in all (nanoseconds), so a bench
    // can split a step's wall time into the GPU's and the host's (plus the gaps between them).
    uint64_t timed_replays = 0;
    uint64_t replay_gpu_ns = 0;
};

// On by default; PYSPEC_CUDA_GRAPHS=0 (or off/false/no) in the environment turns it off at start.
// set_cuda_graphs overrides the environment for every CUDA backend, from their next compute().
void set_cuda_graphs(bool on);
bool cuda_graphs_enabled();

// Totals over every CUDA backend of the process since start (or the last reset).
CudaGraphStats cuda_graph_stats();
void reset_cuda_graph_stats();  // zeroes every counter but `live`

}  // namespace pyspec
