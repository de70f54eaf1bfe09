// Draftless speculation: llama.cpp's `ngram-simple` (docs/speculative.md there). The drafts of a
// round are the tokens that followed the most recent earlier occurrence of the request's last n
// tokens in its own history (prompt + output), at most m of them. No model runs, so a round costs
// only the lookup; it pays where the output repeats what came before (rewriting code, quoting the
// prompt, summaries). SpecEngine uses it ahead of the drafter, as llama-server does ("the
// draftless decoding has higher precedence").
#pragma once

#include <cstdint>
#include <vector>

namespace pyspec {

struct NgramParams {
    int64_t n = 0;   // lookup n-gram length; 0: off (llama-server's --spec-ngram-size-n, 12)
    int64_t m = 48;  // drafts at most (--spec-ngram-size-m)
};

// The tokens after the most recent occurrence of history's last n tokens that starts before
// them, at most m (and never past the end of history); empty when there is none or history is
// too short. n >= 1 and m >= 1, else std::invalid_argument.
std::vector<int32_t> ngram_simple_draft(const std::vector<int32_t>& history, int64_t n, int64_t m);

}  // namespace pyspec
