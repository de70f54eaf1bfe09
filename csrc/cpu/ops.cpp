#include "cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

#include "core/thread_pool.h"
#include "cpu/attention.h"
#include "cpu/quants.h"
#include "cpu/top_k.h"
#include "cpu/vec_math.h"
#include "runtime/philox.h"
#include "spec/verify.h"

namespace pyspec {
namespace {

// Address of flattened row r (over ne[1] * ne[2] * ne[3]) of a tensor with any row strides.
inline char* row_ptr(const Tensor& t, int64_t r) {
    const int64_t i1 = r % t.ne[1];
    const int64_t rest = r / t.ne[1];
    const int64_t i2 = rest % t.ne[2];
    const int64_t i3 = rest / t.ne[2];
    return static_cast<char*>(t.data) + i1 * t.nb[1] + i2 * t.nb[2] + i3 * t.nb[3];
}

inline float* frow(const Tensor& t, int64_t r) { return reinterpret_cast<float*>(row_ptr(t, r)); }

[[noreturn]] void unsupported(const Graph& g, int id, const std::string& why) {
    const Tensor& t = g[id];
    throw std::logic_error(std::string("cpu backend: ") + op_name(t.op) + " (" + t.name + "): " + why);
}

void op_cpy(const Graph& g, int id, int ith, int nth, KernelScratch& s) {
    const Tensor& dst = g[id];
    const Tensor& src = g[dst.src[0]];
    const int64_t n = src.ne[0];
    s.f.resize(static_cast<size_t>(n));
    int64_t r0, r1;
    split_range(src.nrows(), ith, nth, r0, r1);
    for (int64_t r = r0; r < r1; ++r) {
        dequantize_row(src.dtype, row_ptr(src, r), s.f.data(), n);
        quantize_row(dst.dtype, s.f.data(), row_ptr(dst, r), n);
    }
}

void op_get_rows(const Graph& g, int id, int ith, int nth) {
    const Tensor& dst = g[id];
    const Tensor& table = g[dst.src[0]];
    const Tensor& ids = g[dst.src[1]];
    int64_t r0, r1;
    split_range(dst.ne[1], ith, nth, r0, r1);
    for (int64_t r = r0; r < r1; ++r) {
        const int32_t row = ids.as<int32_t>()[r];
        if (row < 0 || row >= table.nrows()) unsupported(g, id, "row id " + std::to_string(row) + " out of range");
        dequantize_row(table.dtype, row_ptr(table, row), frow(dst, r), dst.ne[0]);
    }
}

void op_rms_norm(const Graph& g, int id, int ith, int nth) {
    const Tensor& dst = g[id];
    const Tensor& x = g[dst.src[0]];
    const float* w = dst.src[1] >= 0 ? g[dst.src[1]].as<float>() : nullptr;
    const float eps = dst.fparams[0];
    const int64_t n = x.ne[0];
    int64_t r0, r1;
    split_range(x.nrows(), ith, nth, r0, r1);
    for (int64_t r = r0; r < r1; ++r) {
        const float* xr = frow(x, r);
        float* yr = frow(dst, r);
        const float mean_sq = dot_f32(xr, xr, n) / static_cast<float>(n);
        const float inv = 1.0f / std::sqrt(mean_sq + eps);
        if (w) {
            for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * inv * w[i];
        } else {
            for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * inv;
        }
    }
}

template <typename F>
void binary_rows(const Graph& g, int id, int ith, int nth, F f) {
    const Tensor& dst = g[id];
    const Tensor& a = g[dst.src[0]];
    const Tensor& b = g[dst.src[1]];
    const int64_t n = a.ne[0];
    if (b.ne[0] != n || (b.nrows() != 1 && b.nrows() != a.nrows())) unsupported(g, id, "shapes do not broadcast");
    int64_t r0, r1;
    split_range(a.nrows(), ith, nth, r0, r1);
    for (int64_t r = r0; r < r1; ++r) {
        const float* ar = frow(a, r);
        const float* br = frow(b, b.nrows() == 1 ? 0 : r);
        float* yr = frow(dst, r);
        for (int64_t i = 0; i < n; ++i) yr[i] = f(ar[i], br[i]);
    }
}

template <typename F>
void unary_rows(const Graph& g, int id, int ith, int nth, F f) {
    const Tensor& dst = g[id];
    const Tensor& a = g[dst.src[0]];
    const int64_t n = a.ne[0];
    int64_t r0, r1;
    split_range(a.nrows(), ith, nth, r0, r1);
    for (int64_t r = r0; r < r1; ++r) {
        const float* ar = frow(a, r);
        float* yr = frow(dst, r);
        for (int64_t i = 0; i < n; ++i) yr[i] = f(ar[i]);
    }
}

// SILU and SWIGLU rows (vec::silu_mul).
void op_silu(const Graph& g, int id, int ith, int nth, bool gated) {
    const Tensor& dst = g[id];
    const Tensor& a = g[dst.src[0]];
    const Tensor* b = gated ? &g[dst.src[1]] : nullptr;
    const int64_t n = a.ne[0];
    if (b && (b->ne[0] != n || (b->nrows() != 1 && b->nrows() != a.nrows()))) unsupported(g, id, "shapes do not broadcast");
    int64_t r0, r1;
    split_range(a.nrows(), ith, nth, r0, r1);
    for (int64_t r = r0; r < r1; ++r) {
        vec::silu_mul(frow(a, r), b ? frow(*b, b->nrows() == 1 ? 0 : r) : nullptr, frow(dst, r), n);
    }
}

// Rotary embedding. Angles are computed in double from the position so that they do not
// depend on how a position's angle was reached (no recurrences across rows).
void op_rope(const Graph& g, int id, int ith, int nth, KernelScratch& s) {
    const Tensor& dst = g[id];
    const Tensor& x = g[dst.src[0]];
    const int32_t* pos = g[dst.src[1]].as<int32_t>();
    const int n_rot = dst.iparams[0];
    const bool neox = dst.iparams[1] == 2;
    const double base = dst.fparams[0];
    const double fscale = dst.fparams[1];
    const float* factors = dst.src[2] >= 0 ? g[dst.src[2]].as<float>() : nullptr;
    const int64_t hd = x.ne[0];
    const int half = n_rot / 2;
    RopeAngles& c = s.rope;
    const bool same = c.base == base && c.fscale == fscale && c.n_rot == n_rot &&
                      (factors ? c.factors.size() == static_cast<size_t>(half) &&
                                     std::equal(c.factors.begin(), c.factors.end(), factors)
                               : c.factors.empty());
    if (!same) {
        c.base = base;
        c.fscale = fscale;
        c.n_rot = n_rot;
        c.factors.assign(factors ? factors : nullptr, factors ? factors + half : nullptr);
        c.valid.assign(c.valid.size(), 0);
    }
    int64_t t0, t1;
    split_range(x.ne[2], ith, nth, t0, t1);
    if (c.valid.size() < static_cast<size_t>(t1)) {
        c.valid.resize(static_cast<size_t>(t1), 0);
        c.pos.resize(static_cast<size_t>(t1));
        c.cs_sn.resize(static_cast<size_t>(t1) * static_cast<size_t>(2 * half));
    }
    for (int64_t t = t0; t < t1; ++t) {
        float* cs = c.cs_sn.data() + t * 2 * half;
        float* sn = cs + half;
        if (!c.valid[static_cast<size_t>(t)] || c.pos[static_cast<size_t>(t)] != pos[t]) {
            for (int i = 0; i < half; ++i) {
                double theta = fscale * pos[t] * std::pow(base, -2.0 * i / n_rot);
                if (factors) theta /= factors[i];
                cs[i] = static_cast<float>(std::cos(theta));
                sn[i] = static_cast<float>(std::sin(theta));
            }
            c.pos[static_cast<size_t>(t)] = pos[t];
            c.valid[static_cast<size_t>(t)] = 1;
        }
        for (int64_t h = 0; h < x.ne[1]; ++h) {
            const float* xr = frow(x, t * x.ne[1] + h);
            float* yr = frow(dst, t * x.ne[1] + h);
            for (int i = 0; i < half; ++i) {
                const int i0 = neox ? i : 2 * i;
                const int i1 = neox ? i + half : 2 * i + 1;
                const float a = xr[i0], b = xr[i1];
                yr[i0] = a * cs[i] - b * sn[i];
                yr[i1] = a * sn[i] + b * cs[i];
            }
            for (int64_t i = n_rot; i < hd; ++i) yr[i] = xr[i];
        }
    }
}

void op_softmax(const Graph& g, int id, int ith, int nth) {
    const Tensor& dst = g[id];
    const Tensor& a = g[dst.src[0]];
    const float sc = dst.fparams[0];
    const int64_t n = a.ne[0];
    int64_t r0, r1;
    split_range(a.nrows(), ith, nth, r0, r1);
    for (int64_t r = r0; r < r1; ++r) {
        const float* ar = frow(a, r);
        float* yr = frow(dst, r);
        for (int64_t i = 0; i < n; ++i) yr[i] = ar[i] * sc;
        vec::softmax(yr, n);
    }
}

void op_set_rows(const Graph& g, int id, int ith, int nth, KernelScratch& s) {
    const Tensor& node = g[id];
    const Tensor& dst = g[node.src[0]];
    const Tensor& rows = g[node.src[1]];
    const int32_t* ids = g[node.src[2]].as<int32_t>();
    const int64_t n = rows.ne[0];
    s.f.resize(static_cast<size_t>(n));
    int64_t r0, r1;
    split_range(rows.nrows(), ith, nth, r0, r1);
    for (int64_t r = r0; r < r1; ++r) {
        if (ids[r] < 0 || ids[r] >= dst.ne[1]) unsupported(g, id, "row id " + std::to_string(ids[r]) + " out of range");
        char* out = static_cast<char*>(dst.data) + static_cast<int64_t>(ids[r]) * dst.nb[1];
        if (rows.dtype == DType::F32) {
            quantize_row(dst.dtype, frow(rows, r), out, n);
        } else {
            dequantize_row(rows.dtype, row_ptr(rows, r), s.f.data(), n);
            quantize_row(dst.dtype, s.f.data(), out, n);
        }
    }
}

void op_argmax(const Graph& g, int id, int ith, int nth) {
    const Tensor& dst = g[id];
    const Tensor& a = g[dst.src[0]];
    int64_t r0, r1;
    split_range(a.nrows(), ith, nth, r0, r1);
    // What one scan keeping i when ar[i] > ar[best] gives: the first index of the largest non-NaN
    // value, or 0 when ar[0] is NaN (nothing compares greater than it); two vectorised passes.
    for (int64_t r = r0; r < r1; ++r) {
        const float* ar = frow(a, r);
        int64_t best = 0;
        if (!std::isnan(ar[0])) best = vec::first_index_of(ar, a.ne[0], vec::max_skipping_nan(ar, a.ne[0], nullptr));
        dst.as<int32_t>()[r] = static_cast<int32_t>(best);
    }
}

// Up to this many candidates, top-k keeps a sorted list in one pass over the row (most values
// lose one comparison against the current k-th) instead of sorting a full index array.
constexpr int64_t kInsertionTopK = 32;

// The k (<= kInsertionTopK) largest of ar[0..n) into out, in the order below. An entry enters
// only when it beats the current k-th strictly: a later equal value has the higher index.
void top_k_insertion(const float* ar, int64_t n, int64_t k, int32_t* out) {
    float val[kInsertionTopK];
    int64_t have = 0;
    for (int64_t i = 0; i < n; ++i) {
        const float x = ar[i];
        if (have == k && !(x > val[k - 1])) continue;
        int64_t j = have < k ? have++ : k - 1;   // the slot it takes, then moves up
        while (j > 0 && x > val[j - 1]) {
            val[j] = val[j - 1];
            out[j] = out[j - 1];
            --j;
        }
        val[j] = x;
        out[j] = static_cast<int32_t>(i);
    }
}

// Indices of the k largest values, descending; equal values keep the lower index first.
void op_top_k(const Graph& g, int id, int ith, int nth) {
    const Tensor& dst = g[id];
    const Tensor& a = g[dst.src[0]];
    const int64_t n = a.ne[0];
    const int64_t k = std::min<int64_t>(dst.ne[0], n);
    int64_t r0, r1;
    split_range(a.nrows(), ith, nth, r0, r1);
    if (k <= kInsertionTopK) {
        for (int64_t r = r0; r < r1; ++r) {
            int32_t* out = reinterpret_cast<int32_t*>(row_ptr(dst, r));
            top_k_insertion(frow(a, r), n, k, out);
            std::fill(out + k, out + dst.ne[0], -1);  // k > n: no candidate
        }
        return;
    }
    for (int64_t r = r0; r < r1; ++r) {
        const float* ar = frow(a, r);
        // Only entries that can be among the k best are sorted (a few hundred of a vocabulary);
        // all of them where the filter cannot narrow the row (or NaN defeats it).
        std::vector<int32_t> idx = top_k_superset(ar, n, k);
        if (static_cast<int64_t>(idx.size()) < k) {
            idx.resize(static_cast<size_t>(n));
            std::iota(idx.begin(), idx.end(), 0);
        }
        std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [ar](int32_t x, int32_t y) {
            return ar[x] > ar[y] || (ar[x] == ar[y] && x < y);
        });
        int32_t* out = reinterpret_cast<int32_t*>(row_ptr(dst, r));
        std::copy(idx.begin(), idx.begin() + k, out);
        std::fill(out + k, out + dst.ne[0], -1);  // k > n: no candidate
    }
}

// Each row's entries at its own ids (TOP_K's candidates with their logits); -1 gives -inf.
void op_gather(const Graph& g, int id, int ith, int nth) {
    const Tensor& dst = g[id];
    const Tensor& a = g[dst.src[0]];
    const Tensor& ids = g[dst.src[1]];
    const int64_t n = a.ne[0], k = dst.ne[0];
    int64_t r0, r1;
    split_range(dst.nrows(), ith, nth, r0, r1);
    for (int64_t r = r0; r < r1; ++r) {
        const float* ar = frow(a, r);
        const int32_t* ir = reinterpret_cast<const int32_t*>(row_ptr(ids, r));
        float* out = frow(dst, r);
        for (int64_t j = 0; j < k; ++j) {
            const int32_t t = ir[j];
            if (t == -1) {
                out[j] = -std::numeric_limits<float>::infinity();
                continue;
            }
            if (t < 0 || t >= n) unsupported(g, id, "id " + std::to_string(t) + " out of range");
            out[j] = ar[t];
        }
    }
}

void op_sum(const Graph& g, int id, int ith) {
    if (ith != 0) return;  // tiny op; one thread keeps the order fixed
    const Tensor& dst = g[id];
    const Tensor& a = g[dst.src[0]];
    double total = 0.0;
    for (int64_t r = 0; r < a.nrows(); ++r) {
        const float* ar = frow(a, r);
        for (int64_t i = 0; i < a.ne[0]; ++i) total += ar[i];
    }
    dst.as<float>()[0] = static_cast<float>(total);
}

// GUMBEL: elements split among the threads, each row's part drawn by the host's own routine
// (fill_gumbel_at: Philox shared by the elements of one counter block, the logs of
// runtime/noise_math.h), so the values are the host's and the CUDA kernel's, whatever the split.
void op_gumbel(const Graph& g, int id, int ith, int nth) {
    const Tensor& dst = g[id];
    const int32_t* keys = g[dst.src[0]].as<int32_t>();
    const int32_t* elems = g[dst.src[1]].as<int32_t>();
    const int64_t n = dst.ne[0];
    const NoiseStream stream = static_cast<NoiseStream>(dst.iparams[0]);
    int64_t e0, e1;
    split_range(dst.nelements(), ith, nth, e0, e1);
    for (int64_t r = e0 / n; r * n < e1; ++r) {
        const int64_t i0 = std::max<int64_t>(e0 - r * n, 0), i1 = std::min<int64_t>(e1 - r * n, n);
        const uint32_t* k = reinterpret_cast<const uint32_t*>(keys + 5 * r);
        float* out = reinterpret_cast<float*>(row_ptr(dst, r));
        if (k[4] == 0) {
            std::fill(out + i0, out + i1, 0.0f);
            continue;
        }
        const NoiseKey key{static_cast<uint64_t>(k[0]) | (static_cast<uint64_t>(k[1]) << 32), k[2], k[3], stream};
        fill_gumbel_at(key, elems + i0, static_cast<size_t>(i1 - i0), out + i0);
    }
}

// SAMPLE: rows split among the threads, each drawn by the host's own routine
// (draw_from_candidates) over its candidates less its bans, so this is exactly the token the
// engine's verification draws.
void op_sample(const Graph& g, int id, int ith, int nth) {
    const Tensor& dst = g[id];
    const Tensor& ids = g[dst.src[0]];
    const Tensor& logits = g[dst.src[1]];
    const Tensor& samplers = g[dst.src[2]];
    const Tensor& bans = g[dst.src[3]];
    const int64_t k = ids.ne[0];
    int64_t r0, r1;
    split_range(dst.ne[1], ith, nth, r0, r1);
    std::vector<int32_t> cand;
    std::vector<float> vals;
    for (int64_t r = r0; r < r1; ++r) {
        const int32_t* ir = ids.as<int32_t>() + r * k;
        const float* vr = logits.as<float>() + r * k;
        const uint32_t* w = reinterpret_cast<const uint32_t*>(samplers.as<int32_t>() + r * kSamplerWords);
        const auto f64 = [w](int at) {
            const uint64_t bits = static_cast<uint64_t>(w[at]) | (static_cast<uint64_t>(w[at + 1]) << 32);
            double d;
            std::memcpy(&d, &bits, sizeof d);
            return d;
        };
        // TOP_K's -1 padding and the bans' own (-1 never matches a kept id) drop out.
        candidates_less_bans(ir, vr, k, bans.as<int32_t>() + r * kSampleBans, kSampleBans, &cand, &vals);
        int32_t token = -1;
        const bool nan = std::any_of(vals.begin(), vals.end(), [](float v) { return v != v; });
        if (!cand.empty() && !nan) {
            try {
                token = draw_from_candidates(cand.data(), vals.data(), static_cast<int64_t>(cand.size()),
                                             f64(SamplerWords::kTemperature), static_cast<int32_t>(w[SamplerWords::kTopK]),
                                             f64(SamplerWords::kTopP), f64(SamplerWords::kMinP),
                                             static_cast<uint64_t>(w[SamplerWords::kSeedLo]) |
                                                 (static_cast<uint64_t>(w[SamplerWords::kSeedHi]) << 32),
                                             w[SamplerWords::kOffset]);
            } catch (const std::invalid_argument&) {
                token = -1;  // an undefined draw (top_k outside the candidates): no prediction
            }
        }
        dst.as<int32_t>()[r] = token;
    }
}

}  // namespace

void run_cpu_op(const Graph& g, int id, int ith, int nth, KernelScratch& s) {
    const Tensor& t = g[id];
    switch (t.op) {
        case Op::NONE:
        case Op::VIEW: return;
        case Op::CPY: return op_cpy(g, id, ith, nth, s);
        case Op::GET_ROWS: return op_get_rows(g, id, ith, nth);
        case Op::RMS_NORM: return op_rms_norm(g, id, ith, nth);
        case Op::ADD: return binary_rows(g, id, ith, nth, [](float a, float b) { return a + b; });
        case Op::MUL: return binary_rows(g, id, ith, nth, [](float a, float b) { return a * b; });
        case Op::SCALE: {
            const float f = t.fparams[0];
            return unary_rows(g, id, ith, nth, [f](float a) { return a * f; });
        }
        case Op::ROPE: return op_rope(g, id, ith, nth, s);
        case Op::SILU: return op_silu(g, id, ith, nth, false);
        case Op::SWIGLU: return op_silu(g, id, ith, nth, true);
        case Op::SOFTMAX: return op_softmax(g, id, ith, nth);
        case Op::ATTENTION: return attention_op(g, id, ith, nth, s);
        case Op::SET_ROWS: return op_set_rows(g, id, ith, nth, s);
        case Op::ARGMAX: return op_argmax(g, id, ith, nth);
        case Op::TOP_K: return op_top_k(g, id, ith, nth);
        case Op::SUM: return op_sum(g, id, ith);
        case Op::GUMBEL: return op_gumbel(g, id, ith, nth);
        case Op::GATHER: return op_gather(g, id, ith, nth);
        case Op::SAMPLE: return op_sample(g, id, ith, nth);
        default: unsupported(g, id, "not implemented on the CPU");
    }
}

}  // namespace pyspec
