#include "spec/target_law.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cpu/top_k.h"
#include "cpu/vec_exp_f64.h"
#include "cpu/vec_math.h"

namespace pyspec {

namespace {

// Moves to the front of order (every id, any order) the tokens whose logit is at least an edge
// above which the shares w[v] = exp(z[v] - zmax) sum past `need` (with room for rounding), and
// returns how many: a prefix of the (logit desc, id asc) order that holds top-p's nucleus, found
// by a histogram of the logits below the best instead of a sort (0 when the edge would take in
// the whole row, or the shares fall short: the caller sorts as it goes then).
template <typename T>
int64_t nucleus_superset(const T* z, const double* w, int64_t n, double zmax, double need, std::vector<int32_t>* order) {
    constexpr int kBins = 512;
    constexpr double kSpan = 64.0;  // logits more than 64 below the best share under e^-64 each
    const double scale = kBins / kSpan;
    // d = (zmax - z) * scale is monotone in z (equal for equal logits); bin floor(d), the last
    // bin also holding every d past it (most of a row: summed in a register, not through memory).
    double mass[kBins] = {};
    double far = 0.0;
    for (int64_t v = 0; v < n; ++v) {
        const double d = (zmax - static_cast<double>(z[v])) * scale;
        if (d < kBins - 1) {
            mass[static_cast<int>(d)] += w[v];
        } else {
            far += w[v];
        }
    }
    mass[kBins - 1] += far;
    double cum = 0.0;
    int last = 0;
    for (; last < kBins - 1; ++last) {
        cum += mass[last];
        if (cum >= need * (1.0 + 1e-9)) break;
    }
    if (last == kBins - 1) return 0;
    const double edge = last + 1;  // bins 0..last: d < last + 1
    const auto head = std::partition(order->begin(), order->end(),
                                     [&](int32_t v) { return (zmax - static_cast<double>(z[v])) * scale < edge; });
    return head - order->begin();
}

// processed_candidates over logits of type T (double, or float read as its exact double value:
// every comparison and every difference below is the same on either, so the engine's float rows
// need no widened copy).
template <typename T>
void candidates_of(const T* z, int64_t n, double temperature, int64_t top_k, double top_p, double min_p,
                   std::vector<int32_t>* ids, std::vector<double>* probs) {
    if (n < 1) throw std::invalid_argument("cannot sample from empty logits");
    if (!(top_p >= 0.0 && top_p <= 1.0)) throw std::invalid_argument("top_p must be in [0, 1]");
    if (!(min_p >= 0.0 && min_p <= 1.0)) throw std::invalid_argument("min_p must be in [0, 1]");
    ids->clear();
    probs->clear();
    // The first index of the maximum, as a scan keeping z[v] > z[best] finds it, in two passes
    // (the maximum, then where it first occurs) that carry no dependency from one entry to the
    // next: the scan's chain through z[best] cost ~150 us on a 49k-entry row.
    bool nan = false;
    T top;
    int64_t best = 0;
    if constexpr (std::is_same_v<T, float>) {  // the engine's rows: vectorised passes
        top = vec::max_skipping_nan(z, n, &nan);
        if (nan) throw std::invalid_argument("NaN logit");
        best = vec::first_index_of(z, n, top);
    } else {
        for (int64_t v = 0; v < n; ++v) nan |= z[v] != z[v];
        if (nan) throw std::invalid_argument("NaN logit");
        top = vec::max_of(z, n);
        while (z[best] != top) ++best;
    }
    if (temperature <= 0.0) {
        ids->push_back(static_cast<int32_t>(best));
        probs->push_back(1.0);
        return;
    }
    const bool use_k = top_k > 0, use_p = top_p < 1.0, use_min = min_p > 0.0;
    if (!use_k && !use_p && !use_min) {
        ids->resize(static_cast<size_t>(n));
        for (int64_t v = 0; v < n; ++v) (*ids)[static_cast<size_t>(v)] = static_cast<int32_t>(v);
    } else {
        auto before = [z](int32_t a, int32_t b) { return z[a] != z[b] ? z[a] > z[b] : a < b; };
        const int64_t n_k = use_k ? std::min(top_k, n) : n;  // what top-k keeps
        std::vector<int32_t> order = top_k_superset(z, n, use_k ? n_k : n);
        const double zmax = z[best];
        // Only what can survive is sorted: top-k's k best; min-p's survivors are a prefix of the
        // sorted order (logit >= the best + log(min_p)) whose length needs no sort.
        int64_t limit = n_k;
        const double min_floor = use_min ? zmax + std::log(min_p) : -INFINITY;
        if (use_min) {
            int64_t count = 0;
            for (int64_t v = 0; v < n; ++v) count += z[v] >= min_floor;
            limit = std::min(limit, std::max<int64_t>(count, 1));
        }
        int64_t kept = limit;
        // order[0, sorted) holds the best `sorted` ids in order; sort_to extends it to `want`: the
        // next best go in front of the rest (nth_element), then are sorted among themselves. The
        // order (logit desc, id asc) is total, so the prefix is the one a full sort gives.
        int64_t sorted = 0;
        const auto sort_to = [&](int64_t want) {
            want = std::min<int64_t>(want, static_cast<int64_t>(order.size()));
            if (want <= sorted) return;
            std::nth_element(order.begin() + sorted, order.begin() + want, order.end(), before);
            std::sort(order.begin() + sorted, order.begin() + want, before);
            sorted = want;
        };
        if (use_p) {
            // top-p renormalises top-k's survivors at temperature 1. The best few are sorted first
            // and the sorted prefix grows fourfold as the sum needs it: a flat row's nucleus of
            // thousands costs a sort of those, not a heap sort of the vocabulary (~6 ms).
            double total = 0.0;
            if (use_k) {
                sort_to(n_k);
                for (int64_t i = 0; i < n_k; ++i) total += std::exp(z[order[static_cast<size_t>(i)]] - zmax);
            } else {  // every token's share, the exponentials vectorised (probs is scratch here)
                probs->resize(static_cast<size_t>(n));
                for (int64_t v = 0; v < n; ++v) (*probs)[static_cast<size_t>(v)] = static_cast<double>(z[v]);
                total = vec::exp_shift_sum_f64(probs->data(), n, zmax);
                const int64_t head = nucleus_superset(z, probs->data(), n, zmax, top_p * total, &order);
                std::sort(order.begin(), order.begin() + head, before);
                sorted = head;
                if (head == 0) sort_to(std::min<int64_t>(limit, 256));
            }
            // The shares summed into total (top-k's recomputed: there are k of them).
            const double* shares = use_k ? nullptr : probs->data();
            double cum = 0.0;
            for (int64_t i = 0; i < limit; ++i) {
                if (i == sorted) sort_to(std::min(limit, 4 * sorted));
                const int32_t t = order[static_cast<size_t>(i)];
                cum += (shares ? shares[t] : std::exp(z[t] - zmax)) / total;
                if (cum >= top_p) {
                    kept = i + 1;
                    break;
                }
            }
            // Not reached within min-p's survivors: min-p keeps them all (kept = limit), and the
            // loop sorted up to it.
        } else if (use_min && !use_k) {
            // min-p's survivors are the tokens at or above its floor (the best among them): one
            // pass moves them to the front, then only they are sorted.
            std::partition(order.begin(), order.end(), [&](int32_t v) { return z[v] >= min_floor; });
            std::sort(order.begin(), order.begin() + limit, before);
        } else {
            sort_to(limit);
        }
        ids->assign(order.begin(), order.begin() + kept);
    }
    // Temperature and the softmax of what is left, in double, the exponentials vectorised
    // (cpu/vec_exp_f64.h). The largest z / T is the best's: dividing by T > 0 keeps the order,
    // and every filter keeps the best. Without a filter the kept ids are 0..n-1, read in place.
    const double mx = static_cast<double>(z[best]) / temperature;
    probs->resize(ids->size());
    double* pr = probs->data();
    if (!use_k && !use_p && !use_min) {
        for (int64_t v = 0; v < n; ++v) pr[v] = static_cast<double>(z[v]) / temperature;
    } else {
        for (size_t i = 0; i < ids->size(); ++i) pr[i] = static_cast<double>(z[(*ids)[i]]) / temperature;
    }
    const double sum = vec::exp_shift_sum_f64(probs->data(), static_cast<int64_t>(probs->size()), mx);
    for (double& x : *probs) x /= sum;
}

}  // namespace

void processed_candidates(const double* z, int64_t n, double temperature, int64_t top_k, double top_p, double min_p,
                          std::vector<int32_t>* ids, std::vector<double>* probs) {
    candidates_of(z, n, temperature, top_k, top_p, min_p, ids, probs);
}

void processed_law(const float* logits, int64_t n, double temperature, int64_t top_k, double top_p, double min_p,
                   float* out) {
    std::vector<int32_t> ids;
    std::vector<double> probs;
    candidates_of(logits, n, temperature, top_k, top_p, min_p, &ids, &probs);
    std::fill(out, out + n, 0.0f);
    for (size_t i = 0; i < ids.size(); ++i) out[ids[i]] = static_cast<float>(probs[i]);
}

SparseLaw candidate_law(const int32_t* ids, const float* logits, int64_t m, double temperature, int64_t top_k,
                        double top_p, double min_p) {
    if (top_k < 1 || top_k > m)
        throw std::invalid_argument("a law from " + std::to_string(m) + " candidates needs top_k in [1, " +
                                    std::to_string(m) + "], got " + std::to_string(top_k));
    // The candidates are the row's m best in (logit desc, id asc) order, so index order among
    // equal logits is id order: processed_candidates over them sorts, keeps and weighs them as
    // over the whole row, whose other entries top-k drops before top-p and min-p look.
    std::vector<int32_t> local;
    std::vector<double> probs;
    candidates_of(logits, m, temperature, top_k, top_p, min_p, &local, &probs);
    std::vector<size_t> by_id(local.size());
    for (size_t i = 0; i < by_id.size(); ++i) by_id[i] = i;
    std::sort(by_id.begin(), by_id.end(), [&](size_t a, size_t b) { return ids[local[a]] < ids[local[b]]; });
    SparseLaw law;
    for (size_t i : by_id) {
        law.ids.push_back(ids[local[i]]);
        law.probs.push_back(static_cast<float>(probs[i]));  // processed_law's float
    }
    return law;
}

void candidates_less_bans(const int32_t* cand, const float* values, int64_t k, const int32_t* bans, size_t n_bans,
                          std::vector<int32_t>* ids, std::vector<float>* logits) {
    ids->clear();
    logits->clear();
    for (int64_t i = 0; i < k; ++i) {
        if (cand[i] < 0 || std::find(bans, bans + n_bans, cand[i]) != bans + n_bans) continue;
        ids->push_back(cand[i]);
        logits->push_back(values[i]);
    }
}

// The first index of the row's maximum (ties: the smaller index, -0 and +0 equal), as one scan
// comparing x[t] > x[best] would give. Two passes: the maximum, then its first index; the first
// is vectorised (a greedy verify takes the argmax of every row over the whole vocabulary, which
// as a scalar loop cost about 40 us per 49k-entry row).
int32_t argmax_first(const float* x, int64_t n) {
    if (n < 1) throw std::invalid_argument("argmax of an empty row");
    bool nan = false;
    const float m = vec::max_skipping_nan(x, n, &nan);
    if (nan) {
        for (int64_t i = 0; i < n; ++i) {
            if (std::isnan(x[i])) throw std::invalid_argument("row has NaN at token " + std::to_string(i));
        }
    }
    return static_cast<int32_t>(vec::first_index_of(x, n, m));  // found: no NaN, so m is an entry
}

}  // namespace pyspec
