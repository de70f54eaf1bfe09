// Work is split over (row, kv head) pairs. Each pair converts a cache row to F32 once and uses it
// for all query heads of its group. A row visits its unmasked cells in ascending order with the
// same dot/exp/axpy code whatever the span (padding) and whoever shares the batch, so its result
// is batch-invariant; masked (-inf) cells are skipped entirely.
//
// Cache rows are prefetched a few cells ahead: a cell's slice of one kv head is a short read at
// a large stride (all kv heads share a cell's row), which the hardware prefetcher does not
// stream, so without it both loops waited on memory latency cell by cell (SmolLM2 at 2k cells:
// 19 ms of attention per token before, 7.4-8.6 ms after; prefetching changes no value).
#include "cpu/attention.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

#include "core/thread_pool.h"
#include "cpu/kernel_internal.h"
#include "cpu/quants.h"
#include "cpu/vec_math.h"

namespace pyspec {
namespace {

inline const char* cache_row(const Tensor& c, int64_t cell, int64_t col0) {
    return static_cast<const char*>(c.data) + cell * c.nb[1] + col0 * c.nb[0];
}

constexpr int64_t kPrefetchCells = 8;

inline void prefetch_row(const Tensor& c, int64_t cell, int64_t col0, int64_t n) {
    const char* p = cache_row(c, cell, col0);
    const int64_t bytes = n * static_cast<int64_t>(c.nb[0]);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

inline void load_row(const Tensor& c, int64_t cell, int64_t col0, int64_t n, float* out) {
    const char* p = cache_row(c, cell, col0);
    if (c.dtype == DType::F16) {
        fp16_to_fp32_row(reinterpret_cast<const uint16_t*>(p), out, n);
    } else {
        std::copy_n(reinterpret_cast<const float*>(p), n, out);
    }
}

// out[h] = sum over the unmasked cells v, ascending, of p[h][v] * V[v]: the fma chain axpy_f32
// runs per element (from +0, y = fma(p, v, y)), with NH heads' rows held in registers across the
// cells instead of loaded and stored per cell, and each V row converted once for them. The same
// operations on every element in the same order, so the same bits. AVX-512, head_dim 64 or 128;
// false (nothing done) elsewhere.
#if PYSPEC_AVX512
template <int D, int NH>
void weighted_v_tile(const Tensor& vc, int64_t b0, const int32_t* valid, int64_t n_valid, int64_t col0,
                     const float* p, int64_t span, float* const* out) {
    __m512 acc[NH][D];
    for (int h = 0; h < NH; ++h)
        for (int d = 0; d < D; ++d) acc[h][d] = _mm512_setzero_ps();
    const bool f16 = vc.dtype == DType::F16;
    for (int64_t v = 0; v < n_valid; ++v) {
        if (v + kPrefetchCells < n_valid) prefetch_row(vc, b0 + valid[v + kPrefetchCells], col0, 16 * D);
        const char* row = cache_row(vc, b0 + valid[v], col0);
        __m512 x[D];
        for (int d = 0; d < D; ++d) {
            x[d] = f16 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row) + d))
                       : _mm512_loadu_ps(reinterpret_cast<const float*>(row) + 16 * d);
        }
        for (int h = 0; h < NH; ++h) {
            const __m512 a = _mm512_set1_ps(p[h * span + v]);
            for (int d = 0; d < D; ++d) acc[h][d] = _mm512_fmadd_ps(a, x[d], acc[h][d]);
        }
    }
    for (int h = 0; h < NH; ++h)
        for (int d = 0; d < D; ++d) _mm512_storeu_ps(out[h] + 16 * d, acc[h][d]);
}

template <int D, int NH>
void weighted_v_heads(const Tensor& vc, int64_t b0, const int32_t* valid, int64_t n_valid, int64_t col0,
                      const float* p, int64_t span, float* const* out, int64_t n_heads) {
    int64_t h = 0;
    for (; h + NH <= n_heads; h += NH) weighted_v_tile<D, NH>(vc, b0, valid, n_valid, col0, p + h * span, span, out + h);
    for (; h < n_heads; ++h) weighted_v_tile<D, 1>(vc, b0, valid, n_valid, col0, p + h * span, span, out + h);
}
#endif

bool weighted_v_sums(const Tensor& vc, int64_t b0, const int32_t* valid, int64_t n_valid, int64_t col0, int64_t hd,
                     const float* p, int64_t span, float* const* out, int64_t n_heads) {
#if PYSPEC_AVX512
    if (hd == 64) {  // 4 heads: 16 accumulators and 4 row registers
        if (n_heads % 4 == 0 || n_heads > 4) weighted_v_heads<4, 4>(vc, b0, valid, n_valid, col0, p, span, out, n_heads);
        else if (n_heads == 3) weighted_v_tile<4, 3>(vc, b0, valid, n_valid, col0, p, span, out);
        else weighted_v_heads<4, 2>(vc, b0, valid, n_valid, col0, p, span, out, n_heads);
        return true;
    }
    if (hd == 128) {  // 2 heads: 16 accumulators and 8 row registers
        weighted_v_heads<8, 2>(vc, b0, valid, n_valid, col0, p, span, out, n_heads);
        return true;
    }
#else
    (void)vc, (void)b0, (void)valid, (void)n_valid, (void)col0, (void)hd, (void)p, (void)span, (void)out, (void)n_heads;
#endif
    return false;
}

}  // namespace

void attention_op(const Graph& g, int id, int ith, int nth, KernelScratch& s) {
    const Tensor& dst = g[id];
    const Tensor& q = g[dst.src[0]];
    const Tensor& kc = g[dst.src[1]];
    const Tensor& vc = g[dst.src[2]];
    const Tensor& mask = g[dst.src[3]];
    const int32_t* base = g[dst.src[4]].as<int32_t>();
    const int64_t n_kv_head = dst.iparams[0];
    const float scale = dst.fparams[0];
    const int64_t hd = q.ne[0];
    const int64_t n_head = q.ne[1];
    const int64_t n_rows = q.ne[2];
    const int64_t span = mask.ne[0];
    const int64_t n_rep = n_head / n_kv_head;
    if (kc.dtype != vc.dtype || (kc.dtype != DType::F16 && kc.dtype != DType::F32)) {
        throw std::logic_error("attention: KV cache must be F16 or F32");
    }

    // scratch: scores [n_rep][span], one converted cache row [hd]
    s.f.resize(static_cast<size_t>(n_rep * span + hd));
    s.idx.resize(static_cast<size_t>(span));
    float* scores = s.f.data();
    float* row = scores + n_rep * span;
    int32_t* valid = s.idx.data();

    int64_t w0, w1;
    split_range(n_rows * n_kv_head, ith, nth, w0, w1);
    for (int64_t w = w0; w < w1; ++w) {
        const int64_t r = w / n_kv_head;
        const int64_t kvh = w % n_kv_head;
        if (base[r] < 0 || base[r] + span > kc.ne[1]) throw std::logic_error("attention: span outside the cache");
        const float* mrow = reinterpret_cast<const float*>(static_cast<const char*>(mask.data) + r * mask.nb[1]);
        int64_t n_valid = 0;
        for (int64_t j = 0; j < span; ++j) {
            if (mrow[j] != -std::numeric_limits<float>::infinity()) valid[n_valid++] = static_cast<int32_t>(j);
        }
        // The group's query heads, rows of q.nb[1] bytes from q0; their output rows.
        const float* q0 = reinterpret_cast<const float*>(static_cast<const char*>(q.data) + kvh * n_rep * q.nb[1] +
                                                         r * q.nb[2]);
        const size_t q_head_stride = static_cast<size_t>(q.nb[1]) / sizeof(float);
        float* oh[64];
        if (n_rep > 64) throw std::logic_error("attention: more than 64 query heads per kv head");
        for (int64_t hr = 0; hr < n_rep; ++hr) {
            const int64_t h = kvh * n_rep + hr;
            oh[hr] = reinterpret_cast<float*>(static_cast<char*>(dst.data) + h * dst.nb[1] + r * dst.nb[2]);
        }
        // Scores: each run of consecutive unmasked cells against the group's query heads as one
        // float_dot_rows call (K rows as the weights, converted in registers; the query heads
        // as the activations), which gives every (cell, head) the bits of dot_f32 on the
        // converted row: the same 32-lane fma order whatever the tile.
        for (int64_t v = 0; v < n_valid;) {
            int64_t run = 1;
            while (v + run < n_valid && valid[v + run] == valid[v] + run) ++run;
            const uint8_t* k0 = reinterpret_cast<const uint8_t*>(cache_row(kc, base[r] + valid[v], kvh * hd));
            if (kc.dtype == DType::F16) {
                float_dot_rows<DType::F16>(k0, kc.nb[1], run, q0, q_head_stride, n_rep, hd, scores + v, span);
            } else {
                float_dot_rows<DType::F32>(k0, kc.nb[1], run, q0, q_head_stride, n_rep, hd, scores + v, span);
            }
            v += run;
        }
        for (int64_t hr = 0; hr < n_rep; ++hr) {
            float* sc = scores + hr * span;
            for (int64_t v = 0; v < n_valid; ++v) sc[v] = sc[v] * scale + mrow[valid[v]];
        }
        for (int64_t hr = 0; hr < n_rep; ++hr) vec::softmax(scores + hr * span, n_valid);
        if (weighted_v_sums(vc, base[r], valid, n_valid, kvh * hd, hd, scores, span, oh, n_rep)) continue;
        for (int64_t hr = 0; hr < n_rep; ++hr) std::fill(oh[hr], oh[hr] + hd, 0.0f);
        for (int64_t v = 0; v < n_valid; ++v) {
            if (v + kPrefetchCells < n_valid) prefetch_row(vc, base[r] + valid[v + kPrefetchCells], kvh * hd, hd);
            load_row(vc, base[r] + valid[v], kvh * hd, hd, row);
            for (int64_t hr = 0; hr < n_rep; ++hr) axpy_f32(scores[hr * span + v], row, oh[hr], hd);
        }
    }
}

}  // namespace pyspec
