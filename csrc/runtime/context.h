// A decode context: the KV cache, the backend and the planner. decode() runs a batch whose rows
// may belong to several sequences and mix prompt chunks with single tokens; every row's result
// equals decoding its sequence alone. Prompt rows (by default the rows that want no logits; a
// batch may mark them, Batch::prompt) may run on a path of their own on a backend
// (Backend::prompt_rows_have_own_path), the same for every prompt row wherever it sits.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/backend.h"
#include "core/built_graphs.h"
#include "core/planner.h"
#include "model/decoder_graph.h"
#include "cpu/cpu_backend.h"
#include "runtime/backend_choice.h"
#include "runtime/kv_cache.h"

namespace pyspec {

// A row's sampling chain for SAMPLE (llama.cpp's top-k -> top-p -> min-p -> temperature, the
// target law of spec/target_law.h) and the seed its draws are keyed by.
struct RowSampler {
    double temperature = 0.0;  // <= 0: the greedy token
    double top_p = 1.0;
    double min_p = 0.0;
    int32_t top_k = 0;
    uint64_t seed = 0;
    std::vector<int32_t> bans;  // ids left out of the candidates (-inf biases), at most kSampleBans
};

struct Batch {
    std::vector<int32_t> tokens;
    std::vector<int32_t> positions;
    std::vector<int32_t> seq_ids;
    std::vector<uint8_t> output;  // nonzero: the row wants logits
    // Empty: the rows without logits are the prompt rows. Else one entry per row, nonzero marking a
    // prompt row, which may want logits too: a prompt's last token gives the first token's logits
    // from the prompt pass, on the prompt rows' path, instead of a second pass over every weight
    // for one output row. A row's kind is the caller's word about the row alone (invariant 7).
    std::vector<uint8_t> prompt;
    // Output rows get their greedy token (DecodeOutput::argmax, the first maximum of the row, as
    // argmax_first) in place of their logits: what greedy decoding and verification need.
    bool argmax_only = false;
    // With argmax_only, > 1: each output row's argmax_k best ids (TOP_K's order), for a caller
    // that bans a few ids (DecoderGraphParams::argmax_k).
    int64_t argmax_k = 1;
    // With argmax_only: the logits at those ids too (DecodeOutput::argmax_values), for callers
    // that sample from each row's top-k candidates.
    bool argmax_values = false;
    // With argmax_only: empty, or one entry per row, nonzero marking an output row whose logits
    // are read too (DecodeOutput::logits at logits_slot): a request that processes its logits
    // on the host, beside rows that need only the graph's ids, crosses alone.
    std::vector<uint8_t> logits_rows;
    // With argmax_values: each output row's token drawn in the graph as the host would draw it
    // from the candidates (DecodeOutput::sampled; SAMPLE), by samplers[row] with the row's
    // position as the step offset, so a step launched after this one can be fed it.
    bool sample = false;
    std::vector<RowSampler> samplers;  // one per row with sample (a greedy row: temperature 0)
    size_t size() const { return tokens.size(); }
};

struct DecodeOutput {
    int64_t n_vocab = 0;
    int64_t n_embd = 0;
    std::vector<int32_t> output_rows;  // batch rows with logits, in batch order (within each n_batch chunk)
    std::vector<float> logits;         // [output_rows.size(), n_vocab]; with argmax_only empty, or
                                       // the rows of Batch::logits_rows (logits_slot)
    std::vector<int32_t> argmax;       // [output_rows.size(), argmax_k] with Batch::argmax_only
    int64_t argmax_k = 1;
    std::vector<float> argmax_values;  // [output_rows.size(), argmax_k] with Batch::argmax_values
    std::vector<int32_t> sampled;      // [output_rows.size()] with Batch::sample (-1: no draw)
    // With Batch::logits_rows: output row j's logits are row logits_slot[j] of `logits` (-1: not
    // read), those rows in batch order; empty otherwise (logits row j is output row j).
    std::vector<int32_t> logits_slot;
    const float* logits_of(size_t j) const {
        if (logits.empty()) return nullptr;
        if (logits_slot.empty()) return logits.data() + j * static_cast<size_t>(n_vocab);
        const int32_t s = logits_slot[j];
        return s < 0 ? nullptr : logits.data() + static_cast<size_t>(s) * static_cast<size_t>(n_vocab);
    }
    // (layer id, [n_rows, n_embd]) for every requested layer input, rows in batch order
    std::vector<std::pair<int, std::vector<float>>> layer_inputs;
};

// A chunk launched and not collected yet: what collect() needs to put its outputs in place.
struct PendingDecode {
    DecodeOutput own;               // Context::launch: the outputs land here
    DecodeOutput* out = nullptr;    // where they land (own, or decode()'s output)
    size_t begin = 0;               // the chunk's first batch row
    std::vector<size_t> order;      // graph row -> batch row
    std::vector<int32_t> out_rows;  // graph rows with logits
    std::vector<size_t> logits_order;  // logits row -> its rank in batch order (empty: in order)
    bool reordered = false;
    DecoderGraphParams params;      // the graph's build parameters (a feed must match them)
    const DecoderGraph* graph = nullptr;
    std::vector<std::pair<int32_t, int32_t>> newly_occupied;  // cells to free if it fails
    struct Reorder {
        std::vector<float> rows;
        float* dst;
    };
    std::vector<Reorder> reorders;  // layer inputs read in graph order, put in batch order after
    struct Permute {
        void* base;
        size_t row_bytes;
    };
    std::vector<Permute> permutes;  // logits / ids / values read in graph order, put in batch order after
    Backend::ReadTicket ticket = 0;
    bool collected = false;
};


struct ContextParams {
    int64_t n_ctx = 4096;     // cells in all; each sequence holds n_ctx / n_seq_max positions
    int64_t n_seq_max = 1;
    int64_t n_batch = 512;    // rows per graph; larger batches are split
    int n_threads = 1;
    bool check_plans = false; // verify every allocation plan and poison the arena (tests)
    DType kv_dtype = DType::F16;
    BackendChoice backend;    // CPU (default) or a CUDA device: weights, KV cache and compute there
};

class Context {
public:
    Context(const Model& model, const ContextParams& params);
    const Model& model() const { return model_; }

    // Validates the whole batch first (clear std::invalid_argument, cache untouched), then runs
    // it in chunks of n_batch rows.
    DecodeOutput decode(const Batch& batch, const std::vector<int>& layer_ids);

    // decode() in two halves, for a batch of at most n_batch rows: launch() queues the step and
    // returns without waiting for it (on a device backend the host may prepare the next step
    // while this one runs); collect() waits for it and returns what decode() would have. The
    // batch's rows occupy their cells at launch. With `feed` (a decode launched before and not
    // collected yet, with argmax_only, whose rows were all output rows), the batch must be the
    // same rows' next step, row for row, every one an output row with argmax_only: each row's
    // token is then the feeding row's ARGMAX id, copied on the device (batch.tokens are not
    // read), so the next greedy step goes in before the host knows the token. Returns nullptr,
    // having changed nothing, where the fed step needs another graph than the feeding one (its
    // attention span grew): the caller collects the feeding step first and launches plainly.
    std::unique_ptr<PendingDecode> launch(const Batch& batch, const std::vector<int>& layer_ids,
                                          const PendingDecode* feed = nullptr);
    DecodeOutput collect(PendingDecode& pending);

    KvCache& kv() { return *kv_; }
    const KvCache& kv() const { return *kv_; }
    const ContextParams& params() const { return params_; }
    int64_t n_ctx_seq() const { return kv_->n_ctx_seq(); }
    size_t compute_buffer_bytes() const { return backend_->arena_bytes(); }
    const char* backend_name() const { return backend_->name(); }
    // Backend::prompt_rows_have_own_path: rows without logits then differ in bits from output rows.
    bool prompt_rows_have_own_path() const { return backend_->prompt_rows_have_own_path(); }
    bool computes_asynchronously() const { return backend_->computes_asynchronously(); }
    const AllocationPlanner& planner() const { return planner_; }

    // Per-op time profile (Backend::op_profile); off by default.
    void set_profiling(bool on);
    Backend::OpProfile op_profile() const;

private:
    void validate(const Batch& batch, const std::vector<int>& layer_ids) const;
    static std::vector<int> sorted_layers(const std::vector<int>& layer_ids);
    DecodeOutput empty_output(const std::vector<int>& layer_ids) const;
    // Queues one chunk (graph, inputs, the reads of its outputs into *p.out); false where feed
    // needs another graph (nothing done then).
    bool launch_chunk(const Batch& batch, size_t begin, size_t end, const std::vector<int>& layer_ids,
                      PendingDecode& p, const PendingDecode* feed);
    // Waits for a launched chunk's reads and puts its outputs in batch order.
    void finish(PendingDecode& p);

    const Model& model_;
    ContextParams params_;
    std::unique_ptr<Backend> backend_;
    std::unique_ptr<KvCache> kv_;
    AllocationPlanner planner_;
    BuiltGraphs<DecoderGraphParams, DecoderGraph> graphs_;  // core/built_graphs.h
};

}  // namespace pyspec
