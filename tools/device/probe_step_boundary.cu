// Probe (H200): what does one dependent step cost as a kernel boundary, and as a grid barrier?
//
// A decode step of a small model is a chain of ~180 kernels, each reading what the one before
// wrote (SmolLM2: 183 kernels, 0.89 ms a step, ~4.8 us a kernel, while each kernel's own work is
// a few L2 round trips). This probe times a chain of N steps of nearly no work three ways, each
// step reading values other blocks wrote in the step before (so the dependency is real):
//   launch+PDL  N kernels captured in a CUDA graph, launched with programmatic dependent launch
//               (griddepcontrol.wait, then launch_dependents: what cuda/launch.cuh does)
//   launch      the same without PDL
//   barrier     one kernel of N phases separated by a software grid barrier (a release-add on a
//               counter, an acquire spin until every block has arrived), every block resident
// for grids of 144, 240 and 384 blocks of 128 threads (SmolLM2's o/down, q/k/v and gate/up
// launches). Per step in microseconds, the least of several replays.
// Build: nvcc -O2 -gencode=arch=compute_90a,code=sm_90a probe_step_boundary.cu -o probe
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_common.cuh"

constexpr int kThreads = 128;

__device__ __forceinline__ float step_work(const float* in, int n_in, int step) {
    const int g = blockIdx.x * kThreads + threadIdx.x;
    // Two values from other blocks' part of the previous step's output.
    const float a = in[(g * 7 + 131 * step + 97) % n_in];
    const float b = in[(g * 13 + 61 * step + 5) % n_in];
    return fmaf(a, 0.5f, b * 0.25f) + 1.0f;
}

__global__ void k_step(const float* in, float* out, int n, int step, int pdl) {
    if (pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    out[blockIdx.x * kThreads + threadIdx.x] = step_work(in, n, step);
}

__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
        unsigned v = 0;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
        } while (v < target);
    }
    __syncthreads();
}

__global__ void k_phases(float* a, float* b, int n, int steps, unsigned* counter) {
    for (int s = 0; s < steps; ++s) {
        const float* in = (s & 1) ? b : a;
        float* out = (s & 1) ? a : b;
        out[blockIdx.x * kThreads + threadIdx.x] = step_work(in, n, s);
        grid_barrier(counter, static_cast<unsigned>((s + 1) * gridDim.x));
    }
}

int main() {
    const int steps = 200;
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    float *a, *b;
    unsigned* counter;
    const int max_blocks = 384;
    CK(cudaMalloc(&a, max_blocks * kThreads * sizeof(float)));
    CK(cudaMalloc(&b, max_blocks * kThreads * sizeof(float)));
    CK(cudaMalloc(&counter, sizeof(unsigned)));
    CK(cudaMemset(a, 0, max_blocks * kThreads * sizeof(float)));
    CK(cudaMemset(b, 0, max_blocks * kThreads * sizeof(float)));
    int per_sm = 0, n_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_phases, kThreads, 0));
    CK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, 0));
    printf("k_phases: %d blocks per SM x %d SMs resident at most\n", per_sm, n_sm);
    for (int blocks : {144, 240, 384}) {
        const int n = blocks * kThreads;
        float us[3];
        for (int mode = 0; mode < 3; ++mode) {
            cudaGraph_t graph;
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
            if (mode < 2) {
                const int pdl = mode == 0;
                for (int st = 0; st < steps; ++st) {
                    cudaLaunchAttribute attr[1];
                    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                    attr[0].val.programmaticStreamSerializationAllowed = pdl;
                    cudaLaunchConfig_t cfg = {};
                    cfg.gridDim = dim3(blocks);
                    cfg.blockDim = dim3(kThreads);
                    cfg.stream = s;
                    cfg.attrs = attr;
                    cfg.numAttrs = 1;
                    const float* in = (st & 1) ? b : a;
                    float* out = (st & 1) ? a : b;
                    CK(cudaLaunchKernelEx(&cfg, k_step, in, out, n, st, pdl));
                }
            } else {
                CK(cudaMemsetAsync(counter, 0, sizeof(unsigned), s));
                k_phases<<<blocks, kThreads, 0, s>>>(a, b, n, steps, counter);
            }
            CK(cudaStreamEndCapture(s, &graph));
            cudaGraphExec_t exec;
            CK(cudaGraphInstantiate(&exec, graph, 0));
            time_graph(exec, s, 3);  // warm-up
            us[mode] = time_graph(exec, s, 20) * 1000.0f / steps;
            CK(cudaGraphExecDestroy(exec));
            CK(cudaGraphDestroy(graph));
        }
        printf("%3d blocks: launch+PDL %.2f us/step, launch %.2f us/step, barrier %.2f us/step\n", blocks, us[0], us[1],
               us[2]);
    }
    CK(cudaDeviceSynchronize());
    return 0;
}
