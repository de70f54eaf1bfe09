// The drafter's decode context (design.md invariants 2 and 3): a draft KV cache with one region
// per sequence id, each holding the drafter window of `window = min(n_ctx_train, n_batch)`
// positions. Rows are stored at drafter positions `abs_pos - pos_base`; when a row or a block
// would land past the window, the sequence is rebased: pos_base moves up, rows that fall below it
// are dropped and the kept rows move down in the cache with K re-rotated (RoPE composes), so the
// drafter only ever sees positions it was trained on, and the cache and compute buffers are sized
// by the window, never by the target's context.
#pragma once

#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

#include "core/built_graphs.h"
#include "core/planner.h"
#include "cpu/cpu_backend.h"
#include "model/dflash.h"
#include "runtime/backend_choice.h"
#include "runtime/kv_cache.h"

namespace pyspec {

struct DraftContextParams {
    int64_t n_seq_max = 1;
    int64_t n_batch = 512;     // rows per graph; caps the window
    int n_threads = 1;
    DType kv_dtype = DType::F16;
    bool check_plans = false;  // verify allocation plans and poison the arena (tests)
    int64_t n_candidates = 8;  // top-k of each sampling chain; 1 <= n_candidates <= n_vocab
    BackendChoice backend;     // CPU (default) or a CUDA device
};

// How the draft slots are drawn (design.md invariant 5, verification.md §4-§6). T = 0: the argmax
// chain, no noise. T > 0, temperature only (no top-k/top-p filter): draft k (block slot
// draft_offset + k, the token at absolute position pos0 + 1 + k) is drawn by Gumbel-max with the
// Philox noise of NoiseKey{seed, offset, pos0 + 1 + k, NoiseStream::Draft}, element = target
// token id -- exactly the keying of spec::gumbel_max as the Python loop used it. DFlash slots are
// independent of earlier drafts and are drawn on the host with gumbel_max; DSpark slots are drawn
// inside the graph (the noise too, by the GUMBEL op from keys written here: the host Philox's
// bits), so each slot's Markov bias follows the drawn predecessor: ancestral drafting.
struct DraftSampling {
    float temperature = 0.0f;
    uint64_t seed = 0;
    uint32_t offset = 0;  // the round's step offset (the loop passes pos0)
};

struct DraftOutput {
    int64_t n_vocab = 0;
    int64_t n_block = 0;
    // [n_block, n_vocab] the logits each slot drafts from: backbone logits, plus the Markov bias
    // along the greedy chain for DSpark draft slots.
    std::vector<float> logits;
    std::vector<float> base_logits;  // [n_block, n_vocab] backbone logits (DSpark only; with d2t
                                     // scattered like logits, -inf outside the draft vocabulary)
    std::vector<int32_t> tokens;     // [n_block] each slot's drawn token: its chain's ARGMAX at
                                     // T = 0 (DSpark: the Markov chain's greedy ids); at T > 0 the
                                     // draft slots hold the Gumbel-max draws (DSpark: the
                                     // ancestral chain; logits then follow the drawn chain)
    float temperature = 0.0f;
    // T > 0: [n_block, q_width()] q rows. Row of draft slot i is the law tokens[i] was drawn
    // from: softmax(z) of the very float vector z the noise perturbed (DSpark: the graph's
    // (base + bias(d_prev)) * (1/T), its exponentials vectorised in float; DFlash: logits / T,
    // normalised in double). Full rows over the target vocabulary (zeros outside the draft
    // vocabulary), or with q_ids (DSpark with an ascending d2t) each row's entries at those
    // target ids only: a reduced draft vocabulary's rows are not spread over the whole
    // vocabulary on the host. Rows of non-draft slots (bonus-anchor slot 0) are zero. Empty at
    // T = 0 (the proposal is the one-hot argmax).
    std::vector<float> q;
    const std::vector<int32_t>* q_ids = nullptr;
    int64_t q_width() const { return q_ids ? static_cast<int64_t>(q_ids->size()) : n_vocab; }
    std::vector<float> full_q() const;  // q as full rows [n_block, n_vocab]
    // The sampling chains' outputs for this sequence, per block slot (design.md invariant 1):
    int64_t n_candidates = 0;
    std::vector<int32_t> candidates;        // [n_block, n_candidates] top-k ids, descending
    std::vector<float> candidate_logits;    // [n_block, n_candidates] logits at those ids
    std::vector<float> candidate_probs;     // [n_block, n_candidates] softmax of those logits
    std::vector<float> confidence;   // [n_block] DSpark confidence of draft slots, NaN elsewhere;
                                     // empty without a confidence head
};

// One sequence's drafter state taken out of the cache (design.md invariant 4): its pos_base, the
// drafter positions it occupies and, per layer, the K then V cells at those positions, as stored
// (already rebased and rotated). Restoring it into any slot gives that slot exactly this state, so
// a reclaimed request resumes bit for bit as if it had never left.
struct ParkedDraftState {
    int64_t pos_base = 0;
    std::vector<int32_t> positions;  // drafter positions, ascending
    std::vector<uint8_t> cells;      // [n_layer][K, V][positions.size()] rows of row_bytes
};

// One sequence's block in a batched draft (DraftContext::draft_many).
struct DraftRequest {
    int32_t seq = 0;
    int32_t id_last = 0;
    int32_t pos0 = 0;
    DraftSampling sampling;
};

class DraftContext {
public:
    // Throws std::invalid_argument when the window is <= 2 x block_size.
    DraftContext(const DraftModel& model, const DraftContextParams& params);

    // Stores committed context rows of a sequence: features is [n_rows, n_target_layers * n_embd]
    // (the target's layer inputs concatenated in target_layers order), positions absolute and
    // strictly increasing. Rows too old to stay in the window are skipped.
    void inject(int32_t seq, const std::vector<int32_t>& positions, const float* features, size_t n_rows);

    // Decodes the block [id_last, MASK, ...] (n_block tokens) at absolute positions pos0.. over the
    // sequence's context (rows < pos0) and returns its first n_out slots (n_out < 0: all). The
    // other slots are decoded as context for those (the block attends to itself), so the outputs
    // are the whole block's first slots, not a shorter block's. The block's rows are not kept in
    // the cache afterwards. The graph carries n_seq_max x n_out sampling chains, every
    // sequence's, bound to this sequence's rows (others to row 0) through an input, so drafting
    // any sequence with a given (n_block, n_out) uses one allocation plan.
    // The one-sequence case of draft_many.
    DraftOutput draft(int32_t seq, int32_t id_last, int32_t pos0, int64_t n_block, int64_t n_out = -1,
                      const DraftSampling& sampling = DraftSampling());

    // One drafter pass over the blocks of several distinct sequences (design.md data flow: one
    // drafter pass for every drafting request): block b is requests[b]'s, with its own cells,
    // mask, positions, id_last, temperature and noise, and the sampling chains of
    // requests[b].seq bound to block b's rows. Returns, in request order, exactly what drafting
    // each sequence alone returns (invariant 7: the kernels are batch invariant). All requests
    // are checked before anything changes; throws std::invalid_argument on a bad or repeated seq.
    // with_logits = false: DraftOutput::logits and base_logits stay empty (the speculative engine
    // uses the tokens, candidates, q and confidences only), sparing the host two copies and a
    // scatter of [n_block, n_vocab] floats per block; everything else is the same.
    // with_chains = false (DSpark only; std::invalid_argument for DFlash): the pass runs no
    // sampling chains, so DraftOutput::candidates and its logits and probabilities stay empty and
    // the tokens of slots before draft_offset() are -1; the draft slots' tokens, q and confidences
    // are the same (the Markov chain's own ARGMAX is the chains' ARGMAX of the same row).
    std::vector<DraftOutput> draft_many(const std::vector<DraftRequest>& requests, int64_t n_block, int64_t n_out,
                                        bool with_logits = true, bool with_chains = true);

    // Removes absolute positions [p0, p1) of a sequence (p1 < 0: to the end).
    void remove(int32_t seq, int64_t p0, int64_t p1);
    void clear(int32_t seq);  // seq < 0: every sequence

    // Copies a sequence's state out (the sequence is left as it is) and back into any sequence,
    // replacing what that one held. restore throws std::invalid_argument on a state that does not
    // fit this context (another drafter, dtype or window).
    ParkedDraftState park(int32_t seq) const;
    void restore(int32_t seq, const ParkedDraftState& state);

    int64_t window() const { return window_; }
    int64_t pos_base(int32_t seq) const;
    int64_t pos_min(int32_t seq) const;  // absolute; -1 when empty
    int64_t pos_max(int32_t seq) const;  // absolute; -1 when empty
    int64_t n_rows(int32_t seq) const;   // context rows held
    // The largest drafter position any row (context or block) was ever written at, -1 before the
    // first write: a debug counter for invariant 2 (it must stay below window()).
    int64_t max_pos_written() const { return max_pos_written_; }
    const DraftModel& model() const { return model_; }
    const DraftContextParams& params() const { return params_; }
    size_t kv_bytes() const { return kv_->bytes(); }
    size_t compute_buffer_bytes() const { return backend_->arena_bytes(); }
    const char* backend_name() const { return backend_->name(); }
    const AllocationPlanner& planner() const { return planner_; }
    // Per-op time profile as Context's (Backend::op_profile).
    void set_profiling(bool on);
    Backend::OpProfile op_profile() const;

private:
    void check_seq(int32_t seq) const;
    // Rebases seq so that absolute positions [first, end) fit the window.
    void make_room(int32_t seq, int64_t first, int64_t end);
    void shift(int32_t seq, int64_t delta);
    // The kept graph for these parameters (core/built_graphs.h), built by build() if there is
    // none, with its plan applied.
    template <typename Graphs, typename Params, typename Build>
    auto& prepared(Graphs& graphs, const Params& params, Build build) {
        auto& e = graphs.get(params, planner_, build);
        backend_->apply_plan(e.built.graph, *e.plan);  // every time: another graph may have grown the arena
        return e.built;
    }

    const DraftModel& model_;
    DraftContextParams params_;
    int64_t window_ = 0;
    int64_t keep_ = 0;  // context rows a rebase keeps
    std::unique_ptr<Backend> backend_;
    std::unique_ptr<KvCache> kv_;
    AllocationPlanner planner_;
    BuiltGraphs<int64_t, DraftShiftGraph> shift_graphs_;    // by rows
    BuiltGraphs<int64_t, DraftInjectGraph> inject_graphs_;  // by rows
    // by (blocks, block length, output slots, span, chains, candidates)
    BuiltGraphs<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>, DraftBlockGraph> block_graphs_;
    std::vector<int64_t> pos_base_;
    int64_t max_pos_written_ = -1;
    std::vector<int32_t> noise_elements_;  // [n_vocab_draft]: each draft id's target id
};

}  // namespace pyspec
