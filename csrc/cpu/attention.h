// The CPU attention kernel (Op::ATTENTION), split from ops.cpp because it is the one op besides
// matmul whose cost grows with the context.
#pragma once

#include "core/graph.h"
#include "cpu/ops.h"

namespace pyspec {

void attention_op(const Graph& g, int id, int ith, int nth, KernelScratch& s);

}  // namespace pyspec
