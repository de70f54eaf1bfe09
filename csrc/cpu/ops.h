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
struct KernelScratch {
    std::vector<float> f;
    std::vector<int32_t> idx;
};

// Runs node `id` of the graph for part ith of nth. Throws std::logic_error for an op/dtype
// combination the CPU backend does not implement.
void run_cpu_op(const Graph& g, int id, int ith, int nth, KernelScratch& scratch);

}  // namespace pyspec
