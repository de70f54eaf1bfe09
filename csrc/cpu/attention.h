// The CPU attention kernel (Op::ATTENTION), split from ops.cpp because it is the one op besides
// matmul whose cost grows with the context.
#pragma once

#include <cstdint>
#include <vector>

#include "core/graph.h"
#include "core/thread_pool.h"
#include "cpu/ops.h"

namespace pyspec {

void attention_op(const Graph& g, int id, int ith, int nth, KernelScratch& s);

// The phased form for decode-shaped calls (fewer (row, kv head) pairs than twice the threads)
// over spans of at least kPhasedMinSpan cells: three pool runs (scores in blocks of kPhaseCells
// valid cells, softmax per head, V sums in slices of head dims), the bits of attention_op.
constexpr int64_t kPhasedMinSpan = 1024;
constexpr int64_t kPhaseCells = 256;
struct AttentionPhaseScratch {
    std::vector<int32_t> valid;    // [rows][span] each row's unmasked cells
    std::vector<int64_t> n_valid;  // [rows]
    std::vector<float> scores;     // [rows][n_head][span]
    std::vector<float> rows;       // [threads][head_dim] converted V slices
};
bool attention_phased_applies(const Graph& g, int id, int n_threads);
void attention_phased(const Graph& g, int id, ThreadPool& pool, AttentionPhaseScratch& s);

}  // namespace pyspec
