// Probe (H200): does wgmma compute an output's bits as mma.sync.m16n8k16 does?
//
// The fixed-order MUL_MAT (cuda/matmul_tc*.cu) relies on "one k16 mma per chunk, the same bits for
// every output position". A wgmma GEMM may replace the mma.sync GEMM only if, per output, a k16
// wgmma step gives the bits of a k16 mma.sync with the same products in the same k slots. This
// probe compares, over many random instances with wide exponent ranges:
//   E0 mma.sync m16n8k16, natural k slots, D = C + A B (the reference; also checked against the CPU)
//   E1 wgmma m64n8k16, A and B from shared memory without swizzle, D = C + A B
//   E2 wgmma m64n16k16, the same first 8 columns (does N change a column's bits?)
//   E3 mma.sync with the two 8-slot halves of k swapped (is the k16 sum order-free?)
//   E4 mma.sync with k pairs (2,3) and (8,9) swapped (does a product's 8-slot half matter?)
//   E5 wgmma m64n8k16 over K = 64 from a 128-byte-swizzled tile (descriptor start + 32 bytes per
//      k16 step), D = C + ...; against E0 chained over the four chunks
// Build: nvcc -O2 -gencode=arch=compute_90a,code=sm_90a probe_wgmma_bits.cu -o probe
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>
#include <cuda_fp16.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

constexpr int M = 64, K = 64;  // A: M x K halves (k contiguous); B: 16 x K halves (n rows, k contiguous)

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo, uint32_t layout) {
    return static_cast<uint64_t>((addr >> 4) & 0x3fff) | (static_cast<uint64_t>((lbo >> 4) & 0x3fff) << 16) |
           (static_cast<uint64_t>((sbo >> 4) & 0x3fff) << 32) | (static_cast<uint64_t>(layout) << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit_wait() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
__device__ __forceinline__ void wg_n8(float (&d)[4], uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0,%1,%2,%3}, %4, %5, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "l"(da), "l"(db));
}
__device__ __forceinline__ void wg_n16(float (&d)[8], uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "l"(da), "l"(db));
}

// out[e][inst][row][col] (col < 8): E0..E5.
__global__ void __launch_bounds__(128) probe(const __half* A, const __half* B, const float* C, float* out, int n_inst) {
    const int inst = blockIdx.x;
    const __half* a = A + static_cast<size_t>(inst) * M * K;
    const __half* b = B + static_cast<size_t>(inst) * 16 * K;
    const float* c = C + static_cast<size_t>(inst) * M * 8;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    auto o = [&](int e, int r, int col) -> float& { return out[((static_cast<size_t>(e) * n_inst + inst) * M + r) * 8 + col]; };
    auto A2 = [&](int r, int k) { return *reinterpret_cast<const uint32_t*>(a + r * K + k); };
    auto B2 = [&](int n, int k) { return *reinterpret_cast<const uint32_t*>(b + n * K + k); };

    // mma.sync: warp w takes rows 16w..16w+15; chunk 0 only (E0, E3, E4), and all 4 chunks (E0c).
    auto run_mma = [&](int e, int n_chunks, const int (&slot_k)[16]) {
        float d[4] = {c[(16 * warp + g) * 8 + 2 * t], c[(16 * warp + g) * 8 + 2 * t + 1], c[(16 * warp + g + 8) * 8 + 2 * t],
                      c[(16 * warp + g + 8) * 8 + 2 * t + 1]};
        for (int ch = 0; ch < n_chunks; ++ch) {
            const int k0 = 16 * ch;
            // slot s holds k = k0 + slot_k[s]; slots come in pairs (slot_k[2i+1] = slot_k[2i] + 1)
            const uint32_t af[4] = {A2(16 * warp + g, k0 + slot_k[2 * t]), A2(16 * warp + g + 8, k0 + slot_k[2 * t]),
                                    A2(16 * warp + g, k0 + slot_k[2 * t + 8]), A2(16 * warp + g + 8, k0 + slot_k[2 * t + 8])};
            const uint32_t bf[2] = {B2(g, k0 + slot_k[2 * t]), B2(g, k0 + slot_k[2 * t + 8])};
            mma(d, af, bf);
        }
        o(e, 16 * warp + g, 2 * t) = d[0];
        o(e, 16 * warp + g, 2 * t + 1) = d[1];
        o(e, 16 * warp + g + 8, 2 * t) = d[2];
        o(e, 16 * warp + g + 8, 2 * t + 1) = d[3];
    };
    const int natural[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const int halves_swapped[16] = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
    const int pair_swapped[16] = {0, 1, 8, 9, 4, 5, 6, 7, 2, 3, 10, 11, 12, 13, 14, 15};
    run_mma(0, 1, natural);
    run_mma(3, 1, halves_swapped);
    run_mma(4, 1, pair_swapped);
    run_mma(6, 4, natural);  // E0 over all of K, for E5

    // Shared memory: no-swizzle core matrices (8 rows x 16 bytes, 128 contiguous bytes) for chunk 0:
    // A core (rg, kg) at (rg * 2 + kg) * 128; B (16 rows) core (rg, kg) at 8192 + (rg * 2 + kg) * 128.
    // 128B-swizzled tiles for K = 64: A at 16384 (64 rows x 128 bytes), B at 24576 (8 rows).
    __shared__ __align__(1024) unsigned char sm[32768];
    for (int i = tid; i < M * 2; i += 128) {  // A chunk 0: row r, 8-value group kg
        const int r = i >> 1, kg = i & 1;
        *reinterpret_cast<uint4*>(sm + ((r >> 3) * 2 + kg) * 128 + (r & 7) * 16) = *reinterpret_cast<const uint4*>(a + r * K + kg * 8);
    }
    for (int i = tid; i < 16 * 2; i += 128) {
        const int r = i >> 1, kg = i & 1;
        *reinterpret_cast<uint4*>(sm + 8192 + ((r >> 3) * 2 + kg) * 128 + (r & 7) * 16) = *reinterpret_cast<const uint4*>(b + r * K + kg * 8);
    }
    for (int i = tid; i < M * 8; i += 128) {  // A swizzled: 16-byte unit u of row r at unit u ^ (r & 7)
        const int r = i >> 3, u = i & 7;
        *reinterpret_cast<uint4*>(sm + 16384 + r * 128 + ((u ^ (r & 7)) << 4)) = *reinterpret_cast<const uint4*>(a + r * K + u * 8);
    }
    for (int i = tid; i < 8 * 8; i += 128) {
        const int r = i >> 3, u = i & 7;
        *reinterpret_cast<uint4*>(sm + 24576 + r * 128 + ((u ^ (r & 7)) << 4)) = *reinterpret_cast<const uint4*>(b + r * K + u * 8);
    }
    __syncthreads();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    const uint32_t s0 = smem_u32(sm);
    // wgmma accumulator: row 16 warp + g + 8 (i / 2 % 2), column 8 (i / 4) + 2 t + i % 2.
    const int r0 = 16 * warp + g;
    {
        float d[4] = {c[r0 * 8 + 2 * t], c[r0 * 8 + 2 * t + 1], c[(r0 + 8) * 8 + 2 * t], c[(r0 + 8) * 8 + 2 * t + 1]};
        wg_fence();
        wg_n8(d, desc(s0, 128, 256, 0), desc(s0 + 8192, 128, 256, 0));
        wg_commit_wait();
        o(1, r0, 2 * t) = d[0]; o(1, r0, 2 * t + 1) = d[1]; o(1, r0 + 8, 2 * t) = d[2]; o(1, r0 + 8, 2 * t + 1) = d[3];
    }
    {
        float d[8] = {c[r0 * 8 + 2 * t], c[r0 * 8 + 2 * t + 1], c[(r0 + 8) * 8 + 2 * t], c[(r0 + 8) * 8 + 2 * t + 1],
                      0.f, 0.f, 0.f, 0.f};
        wg_fence();
        wg_n16(d, desc(s0, 128, 256, 0), desc(s0 + 8192, 128, 256, 0));
        wg_commit_wait();
        o(2, r0, 2 * t) = d[0]; o(2, r0, 2 * t + 1) = d[1]; o(2, r0 + 8, 2 * t) = d[2]; o(2, r0 + 8, 2 * t + 1) = d[3];
    }
    {
        float d[4] = {c[r0 * 8 + 2 * t], c[r0 * 8 + 2 * t + 1], c[(r0 + 8) * 8 + 2 * t], c[(r0 + 8) * 8 + 2 * t + 1]};
        wg_fence();
        for (int kk = 0; kk < 4; ++kk) wg_n8(d, desc(s0 + 16384 + 32 * kk, 16, 1024, 1), desc(s0 + 24576 + 32 * kk, 16, 1024, 1));
        wg_commit_wait();
        o(5, r0, 2 * t) = d[0]; o(5, r0, 2 * t + 1) = d[1]; o(5, r0 + 8, 2 * t) = d[2]; o(5, r0 + 8, 2 * t + 1) = d[3];
    }
}

static uint64_t rng = 88172645463325252ull;
static double urand() { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return (rng >> 11) * (1.0 / 9007199254740992.0); }
static float wide() { return static_cast<float>((urand() < 0.5 ? -1 : 1) * std::ldexp(1.0 + urand(), static_cast<int>(urand() * 16) - 8)); }

int main() {
    const int n = 4096;
    std::vector<__half> A(static_cast<size_t>(n) * M * K), B(static_cast<size_t>(n) * 16 * K);
    std::vector<float> C(static_cast<size_t>(n) * M * 8);
    for (auto& v : A) v = __float2half(wide());
    for (auto& v : B) v = __float2half(wide());
    for (auto& v : C) v = urand() < 0.25 ? 0.0f : wide() * 64.0f;
    __half *dA, *dB; float *dC, *dO;
    CK(cudaMalloc(&dA, A.size() * 2)); CK(cudaMalloc(&dB, B.size() * 2)); CK(cudaMalloc(&dC, C.size() * 4));
    const size_t per = static_cast<size_t>(n) * M * 8;
    CK(cudaMalloc(&dO, 7 * per * 4));
    CK(cudaMemcpy(dA, A.data(), A.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dB, B.data(), B.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dC, C.data(), C.size() * 4, cudaMemcpyHostToDevice));
    probe<<<n, 128>>>(dA, dB, dC, dO, n);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<float> O(7 * per);
    CK(cudaMemcpy(O.data(), dO, O.size() * 4, cudaMemcpyDeviceToHost));
    // CPU check of E0 (chunk 0) and E6 (all chunks): relative to the sum of |terms|.
    double worst0 = 0, worst6 = 0;
    for (int i = 0; i < n; ++i)
        for (int r = 0; r < M; ++r)
            for (int col = 0; col < 8; ++col) {
                const size_t ci = (static_cast<size_t>(i) * M + r) * 8 + col;
                double s = C[ci], mag = std::fabs(C[ci]);
                for (int k = 0; k < K; ++k) {
                    const double p = static_cast<double>(__half2float(A[(static_cast<size_t>(i) * M + r) * K + k])) *
                                     __half2float(B[(static_cast<size_t>(i) * 16 + col) * K + k]);
                    s += p; mag += std::fabs(p);
                    if (k == 15) {
                        worst0 = std::max(worst0, std::fabs(O[0 * per + ci] - s) / mag);
                    }
                }
                worst6 = std::max(worst6, std::fabs(O[6 * per + ci] - s) / mag);
            }
    printf("E0 vs CPU (chunk 0): worst |err| / sum|terms| = %.3g\n", worst0);
    printf("E0 over K=64 vs CPU: %.3g\n", worst6);
    auto diff = [&](int e, int f, const char* what) {
        size_t bad = 0; double worst = 0;
        for (size_t j = 0; j < per; ++j) {
            uint32_t x, y; memcpy(&x, &O[e * per + j], 4); memcpy(&y, &O[f * per + j], 4);
            if (x != y) { ++bad; worst = std::max(worst, std::fabs(static_cast<double>(O[e * per + j]) - O[f * per + j]) / (std::fabs(O[f * per + j]) + 1e-30)); }
        }
        printf("%-58s %8zu of %zu differ (worst rel %.3g)\n", what, bad, per, worst);
    };
    diff(1, 0, "E1 wgmma n8 (no swizzle) vs E0 mma.sync:");
    diff(2, 1, "E2 wgmma n16 vs E1 wgmma n8 (first 8 columns):");
    diff(3, 0, "E3 mma.sync, k halves swapped vs natural:");
    diff(4, 0, "E4 mma.sync, pairs (2,3)<->(8,9) vs natural:");
    diff(5, 6, "E5 wgmma 128B-swizzled K=64 vs mma.sync K=64:");
    return 0;
}
