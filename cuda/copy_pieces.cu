// The backend's small copies as one launch (cuda/backend_copies.cu queues them): a decode step's
// inputs (positions, cache cells, mask, ...) from pinned host memory, its fed tokens from the
// step before, and its outputs back into pinned host memory. Each was its own cudaMemcpyAsync, a
// copy-engine operation the stream ran one after the other between two steps' graphs.
#include "cuda/kernels.h"

namespace pyspec {
namespace cuda {
namespace {

// Block i copies piece i: 16 bytes a thread where both ends and the length allow, else 4, else 1.
__global__ void k_copy_pieces(CopyPieces p) {
    const int i = blockIdx.x;
    const char* src = p.src[i];
    char* dst = p.dst[i];
    const uint32_t n = p.bytes[i];
    const uintptr_t both = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | n;
    if ((both & 15) == 0) {
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        for (uint32_t j = threadIdx.x; j < n / 16; j += blockDim.x) d[j] = s[j];
    } else if ((both & 3) == 0) {
        const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
        uint32_t* d = reinterpret_cast<uint32_t*>(dst);
        for (uint32_t j = threadIdx.x; j < n / 4; j += blockDim.x) d[j] = s[j];
    } else {
        for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) dst[j] = src[j];
    }
}

}  // namespace

void launch_copy_pieces(const CopyPieces& pieces, cudaStream_t s) {
    if (pieces.n <= 0) return;
    k_copy_pieces<<<static_cast<unsigned>(pieces.n), 256, 0, s>>>(pieces);
    check(cudaGetLastError(), "copy pieces: launch");
}

}  // namespace cuda
}  // namespace pyspec
