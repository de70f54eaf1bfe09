// What a decoder graph builder needs from the runtime, and what it hands back. The runtime owns
// the KV cache and fills the inputs; model/ knows nothing of sequences or requests.
#pragma once

#include <utility>
#include <vector>

#include "core/graph.h"
#include "model/model.h"

namespace pyspec {

// The KV cache as the graph sees it: per layer, one K and one V matrix of
// [head_dim * n_head_kv, n_cells] in `dtype`.
struct KvCacheView {
    DType dtype = DType::F16;
    int64_t n_cells = 0;
    std::vector<void*> k, v;
};

struct DecoderGraphParams {
    int64_t n_rows = 0;          // batch rows
    int64_t n_outputs = 0;       // rows that want logits (0: no logits computed)
    // Rows [0, n_prompt_rows) are prompt rows: their matrix products and attention may run on a
    // path of their own (MUL_MAT's prompt columns, ATTENTION's prompt rows); 0 where the backend
    // has none. The first n_prompt_outputs rows with logits are prompt rows (the last ones of them,
    // a prompt's last token), so the output head takes them as its prompt columns.
    int64_t n_prompt_rows = 0;
    int64_t n_prompt_outputs = 0;
    int64_t span = 0;            // attention span: mask columns per row
    std::vector<int> layer_ids;  // layer inputs to return (0 = embeddings, n_layer = final residual)
    // Output rows return their greedy token (ARGMAX: the first maximum) instead of logits, so a
    // greedy step copies n_outputs ids from the backend rather than n_outputs x n_vocab floats.
    bool argmax = false;
    // With argmax, > 1: each output row's argmax_k best ids (TOP_K: value descending, ties by the
    // smaller id) instead of one, so a caller that bans a few ids (-inf biases, llama.cpp's
    // ignore_eos) takes the first id it allows without the logits crossing to the host.
    int64_t argmax_k = 1;
    // With argmax, the logits at those ids too (GATHER), so a sampled row's law over its top-k
    // candidates (all llama.cpp's default chain needs) is computed without the row crossing.
    bool argmax_values = false;
    // With argmax, the logits stay an output too: some rows read them (Batch::logits_rows).
    bool argmax_logits = false;
    // With argmax_values, each output row's token drawn from those candidates as the host draws
    // it (SAMPLE, with the rows' samplers and bans inputs): the token a step decoded ahead is fed.
    bool sample = false;

    bool operator==(const DecoderGraphParams& o) const {
        return n_rows == o.n_rows && n_outputs == o.n_outputs && n_prompt_rows == o.n_prompt_rows &&
               n_prompt_outputs == o.n_prompt_outputs &&
               span == o.span && layer_ids == o.layer_ids && argmax == o.argmax && argmax_k == o.argmax_k &&
               argmax_values == o.argmax_values && argmax_logits == o.argmax_logits && sample == o.sample;
    }
};

// Tensor ids of the graph's inputs (all I32 except the F32 mask).
struct DecoderGraphInputs {
    int tokens = -1;     // [n_rows]
    int positions = -1;  // [n_rows]
    int kv_cells = -1;   // [n_rows] cache cell each row's K/V is written to
    int mask = -1;       // [span, n_rows] 0 or -inf
    int kv_base = -1;    // [n_rows] first cache cell of each row's span
    int out_rows = -1;   // [n_outputs] rows that want logits (absent when all rows do), prompt rows first
    int samplers = -1;   // [kSamplerWords, n_outputs] with DecoderGraphParams::sample (SAMPLE's)
    int sample_bans = -1;  // [kSampleBans, n_outputs] with DecoderGraphParams::sample (SAMPLE's)
    int64_t n_prompt_rows = 0;  // not a tensor: DecoderGraphParams::n_prompt_rows, for the MUL_MATs and ATTENTION
};

struct DecoderGraph {
    Graph graph;
    DecoderGraphInputs in;
    int logits = -1;                               // F32 [n_vocab, n_outputs] (an output unless argmax)
    int argmax = -1;                               // I32 [argmax_k, n_outputs] with DecoderGraphParams::argmax
    int argmax_values = -1;                        // F32 [argmax_k, n_outputs]: the logits at those ids
    int sampled = -1;                              // I32 [1, n_outputs] with DecoderGraphParams::sample
    std::vector<std::pair<int, int>> layer_inputs; // (layer id, F32 [n_embd, n_rows] tensor)
};

// Builds the graph of one batch for the model's architecture.
DecoderGraph build_decoder_graph(const Model& model, const KvCacheView& kv, const DecoderGraphParams& p);

// Architecture builders (one file each).
DecoderGraph build_llama_graph(const Model& model, const KvCacheView& kv, const DecoderGraphParams& p);
DecoderGraph build_qwen3_graph(const Model& model, const KvCacheView& kv, const DecoderGraphParams& p);

}  // namespace pyspec
