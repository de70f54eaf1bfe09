// Fused attention (decode and prefill): one block of kWarps warps per (query head, row). Row r
// attends cells base[r] + j, j < span, with mask[r][j] added to the score; masked (-inf) cells are
// skipped, as on the CPU. Warp w walks the cells whose absolute index is w mod kWarps, in increasing
// order, with an online softmax (running max, running sum, running weighted V in registers: head
// dim up to 32 * kMaxPerLane), then the warps' partial states are merged in the order w = 0..3.
// Batch invariance (design.md invariant 7): which warp sees a cell, and in what order, depends on
// the cell's index in the cache alone, never on base[r] or on the span (the batch's padding), and
// masked cells are skipped outright, so a row's bits depend only on its own query, its unmasked
// cells and their mask values, whatever rows share the batch. GQA: query head h reads kv head
// h / (n_head / n_kv_head). K/V are F16 or F32 (the cache tensors' dtype), read through their row
// stride (cache views).
#include "cuda/kernels.h"

namespace pyspec {
namespace cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxPerLane = 8;  // head_dim <= 256

template <typename T>
__device__ __forceinline__ float kv_load(const char* p);
template <>
__device__ __forceinline__ float kv_load<float>(const char* p) { return *reinterpret_cast<const float*>(p); }
template <>
__device__ __forceinline__ float kv_load<uint16_t>(const char* p) { return h2f(*reinterpret_cast<const uint16_t*>(p)); }

template <typename T>
__global__ void __launch_bounds__(kWarps * 32) k_attention(TDesc dst, TDesc q, TDesc kc, TDesc vc, TDesc mask,
                                                             const int32_t* base, int n_kv_head, float scale,
                                                             unsigned* err) {
    __shared__ float s_acc[kWarps][32 * kMaxPerLane];
    __shared__ float s_m[kWarps], s_l[kWarps];
    const int h = blockIdx.x;
    const int64_t r = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int hd = static_cast<int>(q.ne[0]);
    const int n_head = static_cast<int>(q.ne[1]);
    const int n_rep = n_head / n_kv_head;
    const int kvh = h / n_rep;
    const int64_t span = mask.ne[0];
    const int64_t b0 = base[r];
    if (b0 < 0 || b0 + span > kc.ne[1]) {
        if (threadIdx.x == 0) atomicOr(err, kErrAttentionSpan);
        float* o = reinterpret_cast<float*>(dst.data + h * dst.nb[1] + r * dst.nb[2]);
        for (int d = threadIdx.x; d < hd; d += blockDim.x) o[d] = 0.0f;
        return;
    }
    const float* qr = reinterpret_cast<const float*>(q.data + h * q.nb[1] + r * q.nb[2]);
    const float* mrow = reinterpret_cast<const float*>(mask.data + r * mask.nb[1]);
    float qv[kMaxPerLane], acc[kMaxPerLane];
#pragma unroll
    for (int c = 0; c < kMaxPerLane; ++c) {
        const int d = lane + 32 * c;
        qv[c] = d < hd ? qr[d] : 0.0f;
        acc[c] = 0.0f;
    }
    const int64_t col0 = static_cast<int64_t>(kvh) * hd;
    float m = -INFINITY, l = 0.0f;
    // The first j >= 0 whose cell b0 + j is this warp's (b0 >= 0 here).
    const int64_t j0 = (warp - b0 % kWarps + kWarps) % kWarps;
    for (int64_t j = j0; j < span; j += kWarps) {
        const float mj = mrow[j];
        if (mj == -INFINITY) continue;
        const int64_t cell = b0 + j;
        const char* krow = kc.data + cell * kc.nb[1] + col0 * kc.nb[0];
        float dot = 0.0f;
#pragma unroll
        for (int c = 0; c < kMaxPerLane; ++c) {
            const int d = lane + 32 * c;
            if (d < hd) dot = fmaf(qv[c], kv_load<T>(krow + d * kc.nb[0]), dot);
        }
        const float s = warp_sum(dot) * scale + mj;
        const char* vrow = vc.data + cell * vc.nb[1] + col0 * vc.nb[0];
        float p;
        if (s > m) {
            const float corr = expf(m - s);  // m = -inf -> 0
            l *= corr;
#pragma unroll
            for (int c = 0; c < kMaxPerLane; ++c) acc[c] *= corr;
            m = s;
            p = 1.0f;
        } else {
            p = expf(s - m);
        }
        l += p;
#pragma unroll
        for (int c = 0; c < kMaxPerLane; ++c) {
            const int d = lane + 32 * c;
            if (d < hd) acc[c] = fmaf(p, kv_load<T>(vrow + d * vc.nb[0]), acc[c]);
        }
    }
#pragma unroll
    for (int c = 0; c < kMaxPerLane; ++c) s_acc[warp][lane + 32 * c] = acc[c];
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
    __syncthreads();
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mm = fmaxf(mm, s_m[w]);
    float wsc[kWarps];
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
        wsc[w] = s_m[w] == -INFINITY ? 0.0f : expf(s_m[w] - mm);
        total += s_l[w] * wsc[w];
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    float* o = reinterpret_cast<float*>(dst.data + h * dst.nb[1] + r * dst.nb[2]);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) v += s_acc[w][d] * wsc[w];
        o[d] = v * inv;
    }
}

}  // namespace

void launch_attention(const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v, const TDesc& mask,
                      const int32_t* base, int n_kv_head, float scale, unsigned* err, cudaStream_t s) {
    if (q.ne[0] > 32 * kMaxPerLane) throw std::runtime_error("cuda backend: attention: head_dim above 256");
    if (n_kv_head <= 0 || q.ne[1] % n_kv_head != 0) throw std::runtime_error("cuda backend: attention: bad n_kv_head");
    if (k.dtype != v.dtype || (k.dtype != DType::F16 && k.dtype != DType::F32)) {
        throw std::runtime_error("cuda backend: attention: KV cache must be F16 or F32");
    }
    if (q.ne[2] == 0 || q.ne[1] == 0) return;
    if (q.ne[2] > 65535) throw std::runtime_error("cuda backend: attention: more than 65535 rows");
    const dim3 grid(static_cast<unsigned>(q.ne[1]), static_cast<unsigned>(q.ne[2]));
    if (k.dtype == DType::F16) {
        k_attention<uint16_t><<<grid, kWarps * 32, 0, s>>>(dst, q, k, v, mask, base, n_kv_head, scale, err);
    } else {
        k_attention<float><<<grid, kWarps * 32, 0, s>>>(dst, q, k, v, mask, base, n_kv_head, scale, err);
    }
}

}  // namespace cuda
}  // namespace pyspec
