// pdl_enabled(): see launch.cuh.
#include "cuda/launch.cuh"

namespace pyspec {
namespace cuda {

namespace {

// Whether the current device has compute capability 9.0 or newer (griddepcontrol), asked once
// per device: the backend drives one device per process.
bool device_has_pdl() {
    static const bool has = [] {
        int dev = 0, major = 0;
        if (cudaGetDevice(&dev) != cudaSuccess) return false;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
        return major >= 9;
    }();
    return has;
}

}  // namespace

// Read at every launch, as the other launch switches, so a test can compare both settings in
// one process; the graph cache's key holds it, so a graph captured under one setting is never
// replayed under the other.
bool pdl_enabled() { return env_switch("PYSPEC_CUDA_PDL") != 0 && device_has_pdl(); }

bool prefetch_enabled() { return env_switch("PYSPEC_CUDA_PREFETCH") != 0; }

bool flag_kernel_writes_one(void (*flag)(int*)) {
    int* out = nullptr;
    int v = 0;
    if (cudaMalloc(&out, sizeof(int)) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    flag<<<1, 1>>>(out);
    const bool ok = cudaGetLastError() == cudaSuccess && cudaMemcpy(&v, out, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess;
    cudaFree(out);
    return ok && v == 1;
}

}  // namespace cuda
}  // namespace pyspec
