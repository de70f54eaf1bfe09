// Work is split over (row, kv head) pairs. Each pair converts a cache row to F32 once and uses it
// for all query heads of its group. A row visits its unmasked cells in ascending order with the
// same dot/exp/axpy code whatever the span (padding) and whoever shares the batch, so its result
// is batch-invariant; masked (-inf) cells are skipped entirely.
//
// A decode step has fewer pairs than a machine has threads (SmolLM2: 3 kv heads), so over a long
// span most threads would wait on one pair's cells. There the op runs in phases over the pool
// (attention_phased): scores in blocks of cells, softmax per head, V sums in slices of head dims.
// Each score, each softmax and each output element is computed by the same code in the same
// order as in one pair's pass, so the bits are the same (test_long_decode_attention_phases).
//
// Cache rows are prefetched a few cells ahead: a cell's slice of one kv head is a short read at
// a large stride (all kv heads share a cell's row), which the hardware prefetcher does not
// stream, so without it both loops waited on memory latency cell by cell (SmolLM2 at 2k cells:
// 19 ms of attention per token before, 7.4-8.6 ms after; prefetching changes no value).
#include "cpu/attention.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>

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

// The V sums of dims [d0, d0 + dn) of the group's heads (out[h] + d0 written); true when an
// AVX-512 tile did it (dn a multiple of 16 up to 128), else false with nothing done.
bool weighted_v_sums(const Tensor& vc, int64_t b0, const int32_t* valid, int64_t n_valid, int64_t col0, int64_t d0,
                     int64_t dn, const float* p, int64_t span, float* const* out, int64_t n_heads) {
#if PYSPEC_AVX512
    float* o[64];
    for (int64_t h = 0; h < n_heads; ++h) o[h] = out[h] + d0;
    const int64_t c = col0 + d0;
    switch (dn) {
        case 32:  // one cache line of F16 per cell: 2 row registers, 2 per head
            if (n_heads == 3) weighted_v_tile<2, 3>(vc, b0, valid, n_valid, c, p, span, o);
            else if (n_heads % 4 == 0) weighted_v_heads<2, 4>(vc, b0, valid, n_valid, c, p, span, o, n_heads);
            else weighted_v_heads<2, 2>(vc, b0, valid, n_valid, c, p, span, o, n_heads);
            return true;
        case 64:  // 4 heads: 16 accumulators and 4 row registers
            if (n_heads % 4 == 0 || n_heads > 4) weighted_v_heads<4, 4>(vc, b0, valid, n_valid, c, p, span, o, n_heads);
            else if (n_heads == 3) weighted_v_tile<4, 3>(vc, b0, valid, n_valid, c, p, span, o);
            else weighted_v_heads<4, 2>(vc, b0, valid, n_valid, c, p, span, o, n_heads);
            return true;
        case 128:  // 2 heads: 16 accumulators and 8 row registers
            weighted_v_heads<8, 2>(vc, b0, valid, n_valid, c, p, span, o, n_heads);
            return true;
        default: return false;
    }
#else
    (void)vc, (void)b0, (void)valid, (void)n_valid, (void)col0, (void)d0, (void)dn, (void)p, (void)span, (void)out,
        (void)n_heads;
    return false;
#endif
}

// The same sums without AVX-512: each cell's row slice converted once, then axpy_f32 per head
// (the same fma per element in the same order as the tiles).
void weighted_v_rows(const Tensor& vc, int64_t b0, const int32_t* valid, int64_t n_valid, int64_t col0, int64_t d0,
                     int64_t dn, const float* p, int64_t span, float* const* out, int64_t n_heads, float* row) {
    for (int64_t h = 0; h < n_heads; ++h) std::fill(out[h] + d0, out[h] + d0 + dn, 0.0f);
    for (int64_t v = 0; v < n_valid; ++v) {
        if (v + kPrefetchCells < n_valid) prefetch_row(vc, b0 + valid[v + kPrefetchCells], col0 + d0, dn);
        load_row(vc, b0 + valid[v], col0 + d0, dn, row);
        for (int64_t h = 0; h < n_heads; ++h) axpy_f32(p[h * span + v], row, out[h] + d0, dn);
    }
}

// What a (row, kv head) needs: the row's mask and base, the group's query rows and output rows.
struct Group {
    const float* mrow;
    int64_t b0;
    const float* q0;        // the group's first query head; heads q_stride floats apart
    size_t q_stride;
    float* out[64];         // the group's output rows
};

struct AttentionShape {
    const Tensor& dst;
    const Tensor& q;
    const Tensor& kc;
    const Tensor& vc;
    const Tensor& mask;
    const int32_t* base;
    int64_t hd, n_head, n_kv_head, n_rep, n_rows, span;
    float scale;

    AttentionShape(const Graph& g, int id)
        : dst(g[id]), q(g[dst.src[0]]), kc(g[dst.src[1]]), vc(g[dst.src[2]]), mask(g[dst.src[3]]),
          base(g[dst.src[4]].as<int32_t>()), hd(q.ne[0]), n_head(q.ne[1]), n_kv_head(dst.iparams[0]),
          n_rep(n_head / n_kv_head), n_rows(q.ne[2]), span(mask.ne[0]), scale(dst.fparams[0]) {
        if (kc.dtype != vc.dtype || (kc.dtype != DType::F16 && kc.dtype != DType::F32)) {
            throw std::logic_error("attention: KV cache must be F16 or F32");
        }
        if (n_rep > 64) throw std::logic_error("attention: more than 64 query heads per kv head");
    }

    Group group(int64_t r, int64_t kvh) const {
        if (base[r] < 0 || base[r] + span > kc.ne[1]) throw std::logic_error("attention: span outside the cache");
        Group gr;
        gr.mrow = reinterpret_cast<const float*>(static_cast<const char*>(mask.data) + r * mask.nb[1]);
        gr.b0 = base[r];
        gr.q0 = reinterpret_cast<const float*>(static_cast<const char*>(q.data) + kvh * n_rep * q.nb[1] + r * q.nb[2]);
        gr.q_stride = static_cast<size_t>(q.nb[1]) / sizeof(float);
        for (int64_t hr = 0; hr < n_rep; ++hr) {
            gr.out[hr] = reinterpret_cast<float*>(static_cast<char*>(dst.data) + (kvh * n_rep + hr) * dst.nb[1] +
                                                  r * dst.nb[2]);
        }
        return gr;
    }

    // The row's unmasked cells (offsets from its base), ascending; returns how many.
    int64_t valid_cells(const float* mrow, int32_t* valid) const {
        int64_t n_valid = 0;
        for (int64_t j = 0; j < span; ++j) {
            if (mrow[j] != -std::numeric_limits<float>::infinity()) valid[n_valid++] = static_cast<int32_t>(j);
        }
        return n_valid;
    }

    // Scores of valid cells [v0, v1) against the group's heads (scores[hr * span + v]): each run
    // of consecutive cells as one float_dot_rows call (K rows as the weights, converted in
    // registers; the query heads as the activations), which gives every (cell, head) the bits of
    // dot_f32 on the converted row, the same 32-lane fma order however the runs are cut; then
    // scale and mask.
    void score(const Group& gr, int64_t kvh, const int32_t* valid, int64_t v0, int64_t v1, float* scores) const {
        for (int64_t v = v0; v < v1;) {
            int64_t run = 1;
            while (v + run < v1 && valid[v + run] == valid[v] + run) ++run;
            const uint8_t* k0 = reinterpret_cast<const uint8_t*>(cache_row(kc, gr.b0 + valid[v], kvh * hd));
            if (kc.dtype == DType::F16) {
                float_dot_rows<DType::F16>(k0, kc.nb[1], run, gr.q0, gr.q_stride, n_rep, hd, scores + v, span);
            } else {
                float_dot_rows<DType::F32>(k0, kc.nb[1], run, gr.q0, gr.q_stride, n_rep, hd, scores + v, span);
            }
            v += run;
        }
        for (int64_t hr = 0; hr < n_rep; ++hr) {
            float* sc = scores + hr * span;
            for (int64_t v = v0; v < v1; ++v) sc[v] = sc[v] * scale + gr.mrow[valid[v]];
        }
    }

    // Output dims [d0, d0 + dn) of the group's heads from the softmaxed scores.
    void values(const Group& gr, int64_t kvh, const int32_t* valid, int64_t n_valid, const float* p, int64_t d0,
                int64_t dn, float* row) const {
        if (weighted_v_sums(vc, gr.b0, valid, n_valid, kvh * hd, d0, dn, p, span, gr.out, n_rep)) return;
        weighted_v_rows(vc, gr.b0, valid, n_valid, kvh * hd, d0, dn, p, span, gr.out, n_rep, row);
    }
};

// Head dims per V part of the phased kernel: one 64-byte line of an F16 cache row.
constexpr int64_t kPhaseDims = 32;

}  // namespace

void attention_op(const Graph& g, int id, int ith, int nth, KernelScratch& s) {
    const AttentionShape a(g, id);
    // scratch: scores [n_rep][span], one converted cache row [hd]
    s.f.resize(static_cast<size_t>(a.n_rep * a.span + a.hd));
    s.idx.resize(static_cast<size_t>(a.span));
    float* scores = s.f.data();
    float* row = scores + a.n_rep * a.span;
    int32_t* valid = s.idx.data();

    // Pairs kv head by kv head, every nth row to a thread: a thread's consecutive pairs read the
    // same kv head's cells (still in its cache), and causal rows, whose cells grow with the row,
    // are shared out evenly.
    for (int64_t w = ith; w < a.n_rows * a.n_kv_head; w += nth) {
        const int64_t kvh = w / a.n_rows;
        const int64_t r = w % a.n_rows;
        const Group gr = a.group(r, kvh);
        const int64_t n_valid = a.valid_cells(gr.mrow, valid);
        a.score(gr, kvh, valid, 0, n_valid, scores);
        for (int64_t hr = 0; hr < a.n_rep; ++hr) vec::softmax(scores + hr * a.span, n_valid);
        a.values(gr, kvh, valid, n_valid, scores, 0, a.hd, row);
    }
}

bool attention_phased_applies(const Graph& g, int id, int n_threads) {
    // PYSPEC_CPU_ATTENTION_PHASES=0 keeps every call in one pass per pair (for A/B runs; the same bits).
    static const bool enabled = [] {
        const char* v = std::getenv("PYSPEC_CPU_ATTENTION_PHASES");
        return !(v && std::string(v) == "0");
    }();
    if (!enabled) return false;
    const Tensor& t = g[id];
    const int64_t pairs = g[t.src[0]].ne[2] * t.iparams[0];
    return n_threads > 1 && pairs < 2 * n_threads && g[t.src[3]].ne[0] >= kPhasedMinSpan &&
           g[t.src[0]].ne[0] % kPhaseDims == 0;
}

void attention_phased(const Graph& g, int id, ThreadPool& pool, AttentionPhaseScratch& s) {
    const AttentionShape a(g, id);
    const int64_t n_pairs = a.n_rows * a.n_kv_head;
    s.valid.resize(static_cast<size_t>(a.n_rows * a.span));
    s.n_valid.assign(static_cast<size_t>(a.n_rows), 0);
    s.scores.resize(static_cast<size_t>(a.n_rows * a.n_head * a.span));
    s.rows.resize(static_cast<size_t>(pool.size() * a.hd));
    std::vector<Group> groups;
    groups.reserve(static_cast<size_t>(n_pairs));
    for (int64_t w = 0; w < n_pairs; ++w) groups.push_back(a.group(w / a.n_kv_head, w % a.n_kv_head));
    for (int64_t r = 0; r < a.n_rows; ++r) {
        s.n_valid[static_cast<size_t>(r)] = a.valid_cells(groups[static_cast<size_t>(r * a.n_kv_head)].mrow,
                                                          s.valid.data() + r * a.span);
    }
    auto scores_of = [&](int64_t w) {  // the (row, kv head) pair's scores [n_rep][span]
        return s.scores.data() + (w / a.n_kv_head * a.n_head + w % a.n_kv_head * a.n_rep) * a.span;
    };
    auto valid_of = [&](int64_t w) { return s.valid.data() + w / a.n_kv_head * a.span; };
    auto n_valid_of = [&](int64_t w) { return s.n_valid[static_cast<size_t>(w / a.n_kv_head)]; };

    // 1. Scores, in blocks of kPhaseCells valid cells per pair.
    const int64_t n_blocks = (a.span + kPhaseCells - 1) / kPhaseCells;
    pool.run([&](int ith, int nth) {
        int64_t i0, i1;
        split_range(n_pairs * n_blocks, ith, nth, i0, i1);
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t w = i / n_blocks, v0 = i % n_blocks * kPhaseCells;
            const int64_t v1 = std::min(v0 + kPhaseCells, n_valid_of(w));
            if (v0 < v1) a.score(groups[static_cast<size_t>(w)], w % a.n_kv_head, valid_of(w), v0, v1, scores_of(w));
        }
    });
    // 2. Softmax per (row, head).
    pool.run([&](int ith, int nth) {
        int64_t i0, i1;
        split_range(n_pairs * a.n_rep, ith, nth, i0, i1);
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t w = i / a.n_rep;
            vec::softmax(scores_of(w) + i % a.n_rep * a.span, n_valid_of(w));
        }
    });
    // 3. V sums, kPhaseDims head dims per part.
    const int64_t n_dim_parts = a.hd / kPhaseDims;
    pool.run([&](int ith, int nth) {
        int64_t i0, i1;
        split_range(n_pairs * n_dim_parts, ith, nth, i0, i1);
        float* row = s.rows.data() + static_cast<size_t>(ith) * a.hd;
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t w = i / n_dim_parts;
            a.values(groups[static_cast<size_t>(w)], w % a.n_kv_head, valid_of(w), n_valid_of(w), scores_of(w),
                     i % n_dim_parts * kPhaseDims, kPhaseDims, row);
        }
    });
}

}  // namespace pyspec
