// Confidence pruning of a drafted block (llama.cpp's draft p_min / n_min rules), the one place the
// rule lives: SpecEngine applies it per request, and pyspec.speculative.prune_length (the
// single-request Python loop) calls it through _core.spec.prune_length.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace pyspec {

enum class PMinMode { First, Cumulative };

inline PMinMode p_min_mode_of(const std::string& s) {
    if (s == "first") return PMinMode::First;
    if (s == "cumulative") return PMinMode::Cumulative;
    throw std::invalid_argument("unknown p_min mode '" + s + "' (one of first, cumulative)");
}

// How many of the n drafts to keep: stop at the first position k whose confidence (First) or
// product of confidences 0..k (Cumulative, accumulated in double) is below p_min; a result below
// n_min becomes 0. p_min <= 0 keeps all n (then only n_min applies). Comparisons are in double, so
// float and double confidences give the same answer as the Python rule on the same values.
template <class T>
int64_t prune_length(const T* confidence, size_t n, double p_min, PMinMode mode, int64_t n_min) {
    int64_t keep = static_cast<int64_t>(n);
    if (p_min > 0.0) {
        double prod = 1.0;
        for (size_t k = 0; k < n; ++k) {
            const double c = static_cast<double>(confidence[k]);
            prod *= c;
            if ((mode == PMinMode::First ? c : prod) < p_min) {
                keep = static_cast<int64_t>(k);
                break;
            }
        }
    }
    return keep < n_min ? 0 : keep;
}

}  // namespace pyspec
