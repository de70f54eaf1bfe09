// The RoPE's arithmetic, shared by the RoPE kernel (ops_basic.cu: k_rope) and the decode attention
// that rotates its own row (ops_attention_staged.cu, DecodeRope), so a row rotated by either gets
// the same bits (invariant 7: a decode row and the same row inside a batch see the same values).
#pragma once

#include "cuda/common.cuh"

namespace pyspec {
namespace cuda {

// Position p's angles, as the CPU computes them (in double): s_cs[i] = cos, s_cs[half + i] = sin of
// pair i, for i = tid, tid + n_threads, ... below n_rot / 2. factors: per-pair frequency divisors
// (rope_freqs), or nullptr.
__device__ __forceinline__ void rope_angles(int32_t p, const float* factors, int n_rot, double base, double fscale,
                                            float* s_cs, int tid, int n_threads) {
    const int half = n_rot / 2;
    for (int i = tid; i < half; i += n_threads) {
        double theta = fscale * p * pow(base, -2.0 * i / n_rot);
        if (factors) theta /= factors[i];
        double sn, cs;
        sincos(theta, &sn, &cs);
        s_cs[i] = static_cast<float>(cs);
        s_cs[half + i] = static_cast<float>(sn);
    }
}

// The two elements of a head that pair i rotates: adjacent (GPT-J style, "normal") or half a
// rotation apart (neox).
__device__ __forceinline__ void rope_pair(int i, int half, bool neox, int& i0, int& i1) {
    i0 = neox ? i : 2 * i;
    i1 = neox ? i + half : 2 * i + 1;
}

// (a, b) rotated by the angle whose cosine and sine are cs and sn, rounded step by step as the CPU
// does (no fused multiply-add).
__device__ __forceinline__ void rope_rotate(float a, float b, float cs, float sn, float& y0, float& y1) {
    y0 = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
    y1 = __fadd_rn(__fmul_rn(a, sn), __fmul_rn(b, cs));
}

}  // namespace cuda
}  // namespace pyspec
