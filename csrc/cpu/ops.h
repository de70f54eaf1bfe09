// CPU kernels for every op except MUL_MAT (matmul.h). Each kernel computes part ith of nth of
// its node, so the backend can run it on a thread pool; every output row is computed by exactly
// one thread with a fixed reduction order, so results never depend on the number of threads or
// on the other rows of the batch (design.md invariant 7).
#pragma once

#include <cstdint>
#include <vector>

#include "core/graph.h"

namespace pyspec {

// Per-thread scratch memory that kernels may use (sized on demand, reused across nodes).
// RoPE's cos/sin table of one run of positions under one set of parameters, kept by a thread
// from one ROPE op to the next: a graph's ROPE ops (q and k of every layer) share positions and
// parameters, so the table (a double pow, cos and sin per position and pair) is computed once
// per graph instead of once per op. Keyed by value (positions, parameters, factor values), so a
// hit is the same numbers by definition.
struct RopeAngles {
    int n_rot = 0;
    double base = 0.0, fscale = 0.0;
    std::vector<float> factors;   // empty: none
    std::vector<int32_t> pos;
    std::vector<float> cs_sn;     // [pos.size()][n_rot]: n_rot / 2 cosines, then n_rot / 2 sines
};

struct KernelScratch {
    std::vector<float> f;
    std::vector<int32_t> idx;
    RopeAngles rope[2];   // two: a target's and a drafter's graphs alternate on the same threads
    int rope_next = 0;
};

// Runs node `id` of the graph for part ith of nth. Throws std::logic_error for an op/dtype
// combination the CPU backend does not implement.
void run_cpu_op(const Graph& g, int id, int ith, int nth, KernelScratch& scratch);

}  // namespace pyspec
