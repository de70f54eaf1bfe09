#include "spec/ngram.h"

#include <algorithm>
#include <stdexcept>

namespace pyspec {

std::vector<int32_t> ngram_simple_draft(const std::vector<int32_t>& history, int64_t n, int64_t m) {
    if (n < 1 || m < 1) throw std::invalid_argument("ngram_simple_draft: n and m must be >= 1");
    const int64_t len = static_cast<int64_t>(history.size());
    if (len <= n) return {};
    const int32_t* key = history.data() + (len - n);
    // Newest first: a start j < len - n leaves at least one token after the match. The last key
    // token is compared first, the one most likely to differ among candidates that share the start.
    for (int64_t j = len - n - 1; j >= 0; --j) {
        if (history[static_cast<size_t>(j + n - 1)] != key[n - 1]) continue;
        if (!std::equal(key, key + n, history.data() + j)) continue;
        const int64_t from = j + n, to = std::min(len, from + m);
        return {history.begin() + from, history.begin() + to};
    }
    return {};
}

}  // namespace pyspec
