// cuda_available() / make_cuda_backend() when the CUDA backend is not built in (PYSPEC_CUDA=OFF):
// callers can always ask, and get a clear reason.
#ifndef PYSPEC_WITH_CUDA

#include <memory>
#include <stdexcept>
#include <string>

#include "cuda/cuda_backend.h"

namespace pyspec {

namespace {
constexpr const char* kNotBuilt = "pyspec was built without CUDA (rebuild with -DPYSPEC_CUDA=ON)";
}  // namespace

bool cuda_available(std::string* reason) {
    if (reason) *reason = kNotBuilt;
    return false;
}

std::unique_ptr<Backend> make_cuda_backend(int /*device*/, int /*n_seq_max*/) { throw std::runtime_error(kNotBuilt); }

bool cuda_wgmma_gemm() { return false; }

}  // namespace pyspec

#endif  // PYSPEC_WITH_CUDA
