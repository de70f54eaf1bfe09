// The CUDA backend (issue 8): the same Backend interface as the CPU one, on one GPU. Planned
// tensors live in a device arena; persistent buffers (KV caches) are device memory; external
// tensors whose data is host memory (weights mmapped from the GGUF, numpy feeds) are uploaded once
// and then used from their device copy, keyed by their host address and size (weights never
// change while a backend lives). write/read copy between host and the tensor's device memory.
//
// Built only with -DPYSPEC_CUDA=ON; everything else includes this header only under
// PYSPEC_WITH_CUDA (defined by CMake when the backend is built).
#pragma once

#include <memory>
#include <string>

#include "core/backend.h"

namespace pyspec {

// Whether a CUDA device can be used: the backend was built and the driver sees a GPU. When it
// cannot, `reason` says why (not built in, no device, driver error).
bool cuda_available(std::string* reason = nullptr);

// A backend on `device` for a context of n_seq_max sequences (which picks the matrix kernels of
// float weights' output rows: cuda/kernels.h, matmul_tc_rows). Throws std::runtime_error with the
// reason when CUDA cannot be used.
std::unique_ptr<Backend> make_cuda_backend(int device = 0, int n_seq_max = 1);

// Whether wide tensor-core MUL_MATs run on Hopper's wgmma here (built for sm_90a, a compute
// capability 9.0 GPU, PYSPEC_CUDA_WGMMA not 0); otherwise on mma.sync, with the same bits.
bool cuda_wgmma_gemm();

}  // namespace pyspec
