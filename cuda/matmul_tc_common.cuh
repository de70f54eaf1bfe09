// What the tensor-core MUL_MAT kernels share (cuda/matmul_tc.cu for batches, cuda/matmul_tc_narrow.cu
// for M <= 16): the weight chunk loads and their conversion to halves, the activation rounding, the
// fragment loads and the one mma instruction. Both kernels build every mma operand with these
// functions, so an output gets the same operands, in the same chunk order, whichever kernel runs.
#pragma once

#include "cuda/async_copy.cuh"
#include "cuda/kernels.h"

namespace pyspec {
namespace cuda {
namespace tc {

// The k-chunks of a row: two m16n8k16 chunks per 32 values of K (the wide kernel's block tile),
// chunks past K zero-filled; which chunks those are depends on K only.
__host__ __device__ constexpr int64_t n_chunks(int64_t k) { return (k + 31) / 32 * 2; }

// Fixed split-K: the chunks fall into segments of kSegChunks (512 values of K); an output is
// p_0 + p_1 + ... + p_{S-1} added in that order in F32, where p_s is one accumulator set to +0.0f
// and updated by the mmas of segment s's chunks in increasing order. The segments depend on K
// only, so every M and every kernel sums the same partials in the same order; but the partials
// may be computed side by side (different blocks of the narrow kernel, which is what lets a
// decode step put thousands of warps on a weight matrix instead of one per 16 rows).
constexpr int kSegChunks = 32;
__host__ __device__ constexpr int64_t n_segments(int64_t k) { return (n_chunks(k) + kSegChunks - 1) / kSegChunks; }

// The k order inside a 32-value tile (two chunks). An m16n8k16 mma gives lane group t = lane % 4
// the k pairs {2t, 2t + 1} and {2t + 8, 2t + 9} of its chunk, in A and in B alike. Both kernels
// put the tile's stored values 8t .. 8t + 7 there: pairs 8t and 8t + 2 into chunk 0's two slots,
// 8t + 4 and 8t + 6 into chunk 1's, so a lane's share of a weight row or of an activation column
// is 16 consecutive bytes (one load) rather than four scattered 4-byte pieces. Stored pair pp
// (values 2 pp, 2 pp + 1 of the tile) goes to the mma's k slot tile_slot(pp) (of 0..31); it is
// the same permutation of k for A and B, in every kernel, so every output still sums the same
// products in the same order.
__host__ __device__ constexpr int tile_slot(int pp) { return 16 * ((pp & 3) >> 1) + 2 * (pp >> 2) + 8 * (pp & 1); }

// One 8-value weight chunk as loaded from global memory, converted to 8 halves when it is stored
// to shared memory (after the tile's mmas, so the loads' latency hides behind them).
// F16/BF16: the 8 halves. Q*: a, b = the 8 quant bytes, c = d (| m << 16 for Q4_1).
struct WRaw {
    uint32_t a, b, c, d;
};

__device__ __forceinline__ uint32_t pack2(uint16_t lo, uint16_t hi) {
    return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

__device__ __forceinline__ uint32_t ld8x2(const char* p) {  // 4 bytes at a 2-byte aligned address
    return pack2(ld16(p), ld16(p + 2));
}

// Chunk kc8 (values 8 kc8 .. 8 kc8 + 7) of a weight row; !valid (past K) gives zeros.
template <DType T>
__device__ __forceinline__ WRaw load_w(const char* row, int64_t kc8, bool valid, bool vec) {
    WRaw r{0u, 0u, 0u, 0u};
    if constexpr (T == DType::F16 || T == DType::BF16) {
        if (!valid) return r;
        const char* p = row + kc8 * 16;
        if (vec) {
            const uint4 v = *reinterpret_cast<const uint4*>(p);
            r.a = v.x; r.b = v.y; r.c = v.z; r.d = v.w;
        } else {
            r.a = ld8x2(p); r.b = ld8x2(p + 4); r.c = ld8x2(p + 8); r.d = ld8x2(p + 12);
        }
    } else {
        (void)valid;  // K is a multiple of 32 for block types: every chunk is inside the row
        (void)vec;
        const int64_t b = kc8 >> 2;
        const int part = static_cast<int>(kc8 & 3);
        if constexpr (T == DType::Q8_0) {
            const char* blk = row + b * static_cast<int64_t>(sizeof(BlockQ8_0));
            const char* q = blk + 2 + part * 8;
            r.a = ld8x2(q); r.b = ld8x2(q + 4); r.c = ld16(blk);
        } else if constexpr (T == DType::Q4_0) {
            const char* blk = row + b * static_cast<int64_t>(sizeof(BlockQ4_0));
            const char* q = blk + 2 + (part & 1) * 8;  // values j < 16: low nibbles of qs[j]; j >= 16: high of qs[j - 16]
            r.a = ld8x2(q); r.b = ld8x2(q + 4); r.c = ld16(blk);
        } else {  // Q4_1
            const char* blk = row + b * static_cast<int64_t>(sizeof(BlockQ4_1));
            const char* q = blk + 4 + (part & 1) * 8;
            r.a = ld8x2(q); r.b = ld8x2(q + 4); r.c = pack2(ld16(blk), ld16(blk + 2));
        }
    }
    return r;
}

// One quantized weight value as the half an mma reads: q the stored integer (Q8_0: signed; Q4_*:
// the nibble 0..15), d and mn the block's scale and minimum in F32. Both kernels dequantize every
// value through this function (F32 as load_elem does, the Q4_1 product rounded before the add),
// so a weight is the same half in either.
template <DType T>
__device__ __forceinline__ uint16_t deq_half(float d, float mn, int q) {
    if constexpr (T == DType::Q8_0) {
        (void)mn;
        return f2h(static_cast<float>(q) * d);
    } else if constexpr (T == DType::Q4_0) {
        (void)mn;
        return f2h(d * static_cast<float>(q - 8));
    } else {
        return f2h(__fmul_rn(d, static_cast<float>(q)) + mn);
    }
}

// The 8 halves (F16, or BF16 for BF16 weights) of a chunk; part = kc8 & 3 (which quarter of the
// 32-value block: Q4 nibble choice).
template <DType T>
__device__ __forceinline__ uint4 w_halves(const WRaw& r, int part) {
    if constexpr (T == DType::F16 || T == DType::BF16) {
        (void)part;
        return make_uint4(r.a, r.b, r.c, r.d);
    } else {
        const uint32_t bytes[2] = {r.a, r.b};
        const float d = h2f(static_cast<uint16_t>(r.c & 0xffffu));
        const float mn = T == DType::Q4_1 ? h2f(static_cast<uint16_t>(r.c >> 16)) : 0.0f;
        uint16_t h[8];
#pragma unroll
        for (int t = 0; t < 8; ++t) {
            const uint32_t byte = (bytes[t >> 2] >> (8 * (t & 3))) & 0xffu;
            if constexpr (T == DType::Q8_0) {
                (void)part;
                h[t] = deq_half<T>(d, mn, static_cast<int8_t>(byte));
            } else {
                h[t] = deq_half<T>(d, mn, static_cast<int>(part < 2 ? byte & 15u : byte >> 4));
            }
        }
        return make_uint4(pack2(h[0], h[1]), pack2(h[2], h[3]), pack2(h[4], h[5]), pack2(h[6], h[7]));
    }
}

// Two activations -> two halves (BF16 for BF16 weights, F16 otherwise), round to nearest even.
template <DType T>
__device__ __forceinline__ uint32_t x_pair_halves(float a, float b) {
    if constexpr (T == DType::BF16) return pack2(f2bf(a), f2bf(b));
    else return pack2(f2h(a), f2h(b));
}

// 4 activations -> 4 halves.
template <DType T>
__device__ __forceinline__ uint2 x_halves(const float4 v) {
    return make_uint2(x_pair_halves<T>(v.x, v.y), x_pair_halves<T>(v.z, v.w));
}

__device__ __forceinline__ float4 load_x4(const float* col, int64_t k0, bool valid, bool vec) {
    if (!valid) return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (vec) return *reinterpret_cast<const float4*>(col + k0);
    return make_float4(col[k0], col[k0 + 1], col[k0 + 2], col[k0 + 3]);
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_addr(p))
                 : "memory");
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t& r0, uint32_t& r1, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r0), "=r"(r1)
                 : "r"(smem_addr(p))
                 : "memory");
}

// D += A * B, m16n8k16, F32 accumulate; the one instruction every output of every M goes through.
template <bool kBF16>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (kBF16) {
        asm(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
#else
    (void)d; (void)a; (void)b;
    __trap();  // built for a GPU without m16n8k16 (sm_80+ only); the host never selects it there
#endif
}

// The first wide kernel (cuda/matmul_tc_fallback.cu): one part, any row alignment, no scratch; the
// wide launcher's fallback.
void launch_first_kernel(DType t, const MatmulPart& p, int64_t k, const float* x, int64_t xs, int64_t m,
                         cudaStream_t s);

}  // namespace tc
}  // namespace cuda
}  // namespace pyspec
