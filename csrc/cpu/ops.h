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
// ROPE's angles for the rows this thread rotated last, kept across ROPE nodes and computes: a
// model's graph rotates q and k of every layer at the same positions, and the angles (double pow,
// cos, sin per pair) cost more than the rotation. Row t's entry holds for position pos[t] under
// the parameters below; anything else is recomputed by the same formula, so a hit has the bits a
// fresh computation would give.
struct RopeAngles {
    double base = 0.0, fscale = 0.0;
    int n_rot = 0;
    std::vector<float> factors;       // the frequency divisors' values (empty: none)
    std::vector<int32_t> pos;         // per row: the position its angles are for
    std::vector<uint8_t> valid;       // per row: whether it holds any
    std::vector<float> cs_sn;         // per row: n_rot / 2 cosines, then n_rot / 2 sines
};

struct KernelScratch {
    std::vector<float> f;
    std::vector<int32_t> idx;
    RopeAngles rope;
};

// Runs node `id` of the graph for part ith of nth. Throws std::logic_error for an op/dtype
// combination the CPU backend does not implement.
void run_cpu_op(const Graph& g, int id, int ith, int nth, KernelScratch& scratch);

}  // namespace pyspec
