// GUMBEL: the Gumbel noise of Philox uniforms, one thread per value, computed by the same
// functions as the host (csrc/runtime/noise_math.h: integer Philox, a logarithm of IEEE double
// operations), so a draw keyed alike is the same bits on the GPU and the CPU.
#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "runtime/noise_math.h"

namespace pyspec {
namespace cuda {

namespace {

constexpr int kThreads = 256;

__global__ void k_gumbel(TDesc dst, const int32_t* keys, const int32_t* elems, uint32_t stream) {
    pdl_enter();
    const int64_t n = dst.ne[0], total = n * dst.nrows();
    for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t r = e / n, i = e % n;
        const int32_t* k = keys + 5 * r;
        float v = 0.0f;
        if (k[4] != 0) {
            const uint32_t el = static_cast<uint32_t>(elems[i]);
            uint32_t c[4] = {el >> 2, static_cast<uint32_t>(k[3]), static_cast<uint32_t>(k[2]), stream};
            noise_math::philox4x32(c, static_cast<uint32_t>(k[0]), static_cast<uint32_t>(k[1]));
            v = noise_math::gumbel_of_u01(noise_math::u01_open(c[el & 3u]));
        }
        reinterpret_cast<float*>(dst.row(r))[i] = v;
    }
}

}  // namespace

void launch_gumbel(const TDesc& dst, const int32_t* keys, const int32_t* elems, uint32_t stream, cudaStream_t s) {
    const int64_t total = dst.ne[0] * dst.nrows();
    launch(k_gumbel, grid_for(total, kThreads), kThreads, 0, s, dst, keys, elems, stream);
}

}  // namespace cuda
}  // namespace pyspec
