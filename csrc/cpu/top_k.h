// The k best entries of a row without sorting the row: shared by the TOP_K op (cpu/ops.cpp) and
// the host's sampling law (spec/verify.cpp), so both narrow a vocabulary the same way.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "cpu/vec_math.h"

namespace pyspec {

// Ids that contain the k best of z (any order), in ascending order: the entries >= the k-th
// largest of the maxima of 256-entry chunks, which k distinct entries reach, so everything below
// it is outside the k best (only chunks whose maximum reaches it are scanned). A 49k-entry row
// keeps a few hundred, and sorting those instead of the whole row is what makes a sampled
// token's law cheap (llama-server's default top-k 40). All ids when k >= n or the row has fewer
// than k chunks.
template <typename T>
std::vector<int32_t> top_k_superset(const T* z, int64_t n, int64_t k) {
    constexpr int64_t kChunk = 256;
    const int64_t n_chunks = (n + kChunk - 1) / kChunk;
    std::vector<int32_t> ids;
    if (k < n && k >= 1 && n_chunks >= k) {
        std::vector<T> cmax(static_cast<size_t>(n_chunks));
        for (int64_t c = 0; c < n_chunks; ++c) {
            cmax[static_cast<size_t>(c)] = vec::max_of(z + c * kChunk, std::min(n, (c + 1) * kChunk) - c * kChunk);
        }
        std::vector<T> ranked = cmax;
        std::nth_element(ranked.begin(), ranked.begin() + (k - 1), ranked.end(), std::greater<T>());
        const T floor = ranked[static_cast<size_t>(k - 1)];
        for (int64_t c = 0; c < n_chunks; ++c) {
            if (!(cmax[static_cast<size_t>(c)] >= floor)) continue;
            const int64_t end = std::min(n, (c + 1) * kChunk);
            for (int64_t v = c * kChunk; v < end; ++v) {
                if (z[v] >= floor) ids.push_back(static_cast<int32_t>(v));
            }
        }
        return ids;
    }
    ids.resize(static_cast<size_t>(n));
    for (int64_t v = 0; v < n; ++v) ids[static_cast<size_t>(v)] = static_cast<int32_t>(v);
    return ids;
}

}  // namespace pyspec
