// The speculative step over many requests (design.md data flow; invariants 3, 4 and 7). One
// step() runs ONE target decode over every scheduled request -- prompt chunks of prefilling
// requests and verify rows [id_last, drafts...] of generating ones, each tagged with the request's
// own target sequence; a prompt's rows are all prompt rows, the last one with the logits of the
// request's first token, so one pass over the weights prefills and starts it -- then per request: stages its committed rows' layer inputs into its
// drafter slot, verifies, accepts, rolls back the rejected target rows, and finally drafts the
// next block of every drafting request (one DraftContext::draft call per request).
//
// Requests are known by id only. A request's rows in the target batch are located through a table
// keyed by request id built with the batch, and its drafter slot comes from the
// DraftStateRegistry, so neither depends on which rows or slots its neighbours take.
//
// A request's committed feature rows (the target layer inputs the drafter reads) wait on the
// host until they are staged into its drafter slot, which happens in the same step. When the
// registry reclaims a request's slot, the slot's cells are parked (DraftContext::park: K/V as
// stored, pos_base, occupancy) and restored into whichever slot the request gets when it returns,
// so it resumes with exactly the drafter state of an uninterrupted run, rebased or not.
//
// Scheduling: every scheduled request that drafts stages into its drafter slot, so at most
// n_draft_slots drafting requests take part in a step: the requests holding a slot first, then
// the others least recently scheduled first, ties by smaller id; the rest sit the step out
// unchanged, prompt included. (Prefilling without a slot and staging the rows later would change
// the drafter's rebase history -- rows staged in one go instead of step by step -- and with it the
// drafts, breaking invariant 7; a server gives each of its slots a drafter slot, so its requests
// never wait for one.) Requests that do not draft (no drafter, drafting switched off or stopped)
// run every step. A slot thus changes hands only when its holder is
// paused or leaves, and a request's sequence of rounds is the same whoever shares its steps.
//
// Prompt cache (llama-server's cache_prompt): a request with keep_cache leaves its target
// sequence's KV rows in place when it ends and the engine records the tokens they hold -- prompt
// and committed output, positions 0..n-1 (the last emitted token has no row yet). The next
// request pinned to that sequence with reuse_cache keeps the rows of the longest common prefix of
// its prompt and those tokens, but never the last prompt token's (its row gives the first token's
// logits), removes the rest and prefills from there. Kept rows equal recomputed ones bit for bit
// (batch invariance), so the output is what a fresh request gives. Where the backend computes
// prompt rows on a path of their own (Backend::prompt_rows_have_own_path), only the prompt rows
// are kept: the others were decoded as output rows, with other bits. The drafter keeps nothing
// (the drafter slot is cleared when a request ends): the reusing request's drafter context
// starts with the rows it decodes itself, which only weakens its first drafts.
//
// Drafter failures (a drafter pass or a rebase that throws) stop drafting for the request that
// failed -- found by drafting the others again one by one -- with one log line and a flag in its
// stats; its slot is cleared (a rebase rotates K in place, so a half-done one leaves nothing worth
// keeping) and it goes on decoding plainly. No error reaches the other requests.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/context.h"
#include "spec/draft_context.h"
#include "spec/draft_state_registry.h"
#include "spec/logit_processing.h"
#include "spec/ngram.h"
#include "spec/prune.h"
#include "spec/verify.h"

namespace pyspec {

struct SpecEngineParams {
    int64_t n_ctx = 4096;        // target cells in all; each request slot holds n_ctx / n_seq_max
    int64_t n_seq_max = 1;       // target sequences = concurrent requests
    int64_t n_draft_slots = 1;   // drafter sequences (DraftStateRegistry slots)
    int64_t n_batch = 512;       // target rows per graph (larger batches are split)
    int64_t draft_n_batch = 512; // drafter rows per graph; caps the drafter window (invariant 2)
    int n_threads = 1;
    int64_t draft_n_max = -1;    // drafts per round; < 0: the drafter's block allows
    int64_t prefill_chunk = 256; // prompt rows a request adds to one step
    DType kv_dtype = DType::F16;
    BackendChoice backend;       // target and drafter contexts: CPU (default) or a CUDA device
    // Draftless drafts from each request's own history (spec/ngram.h), ahead of the drafter:
    // a round whose lookup finds a match verifies those tokens and runs no drafter pass. The
    // drafter (if any) still takes in every committed row, so it drafts whenever no match is found.
    NgramParams ngram;
    // Greedy plain rows (no drafts, the greedy id taken in the graph) queue their next step
    // before the host has read this one's tokens: the next step's tokens are this step's ARGMAX
    // ids, copied on the device (Context::launch with a feed), so on a GPU the host's work
    // between steps (reading, emitting, the caller's handling of the outputs) overlaps the
    // kernels instead of leaving the GPU idle. The same tokens either way. -1: where the
    // backend computes asynchronously (the GPU; on the CPU a step computed ahead only delays its
    // predecessor's tokens), 0: never, 1: always (tests run it on the CPU so);
    // PYSPEC_DECODE_AHEAD=0/1 overrides it.
    int decode_ahead = -1;
    // Sampled plain rows decode ahead too (with decode_ahead; rows on the graph's top-k
    // candidates, nothing else processing their logits): the step draws each row's token in the
    // graph (SAMPLE) and feeds it to the next step; the host's own draw confirms it, and a row
    // whose draws differ (the GPU's libm on a knife edge) has its step ahead dropped and decodes
    // again. The same tokens either way. 1: on, 0: off, 2: the graph predicts the greedy token
    // instead (nearly every row then decodes again: tests of that path); PYSPEC_SAMPLED_AHEAD
    // (0/1/2) overrides it.
    int sampled_ahead = 1;
};

struct RequestParams {
    int64_t max_tokens = -1;     // < 0: until a stop id or a full context
    // The target law (target_law.h processed_candidates, pyspec/sampling.py's chain): temperature
    // after top-k -> top-p -> min-p; a filter that is off (top_k <= 0, top_p >= 1, min_p <= 0)
    // does not run, so with all three off it is softmax(logits / T) (design invariant 5).
    double temperature = 0.0;
    int64_t top_k = 0;
    double top_p = 1.0;
    double min_p = 0.0;
    uint64_t seed = 0;
    VerifyMethod method = VerifyMethod::Greedy;  // Greedy needs temperature 0
    std::vector<int32_t> stop_ids;               // ending tokens; not emitted
    // Confidence pruning of each drafted block (spec/prune.h, the rule the Python loop uses):
    // confidences are DSpark's confidence head, or for DFlash each slot's top-1 candidate
    // probability. p_min in [0, 1], 0: off (then only n_min applies); n_min >= 0.
    double draft_p_min = 0.0;
    PMinMode draft_p_min_mode = PMinMode::First;
    int64_t draft_n_min = 0;
    // Logit bias and repetition penalties, applied before the filters (spec/logit_processing.h)
    // to every verify row with the history that row would have seen.
    LogitProcessing processing;
    int64_t n_probs = 0;   // > 0: StepOutput::probs carries the top-n log-probabilities per token
    int32_t seq = -1;      // the target sequence to run in (a server slot); < 0: any free one
    bool draft = true;     // false: this request never drafts (plain decoding in the same step)
    // Prompt cache (llama-server's cache_prompt). keep_cache: when the request ends (finished or
    // cancelled) its target sequence keeps its KV rows and records the tokens they hold, instead
    // of being cleared. reuse_cache: with a pinned seq, the rows of the longest common prefix of
    // the prompt and the tokens that sequence recorded are kept (all but the last prompt token at
    // most) and prefill starts after them; stats.n_cached reports how many.
    bool keep_cache = false;
    bool reuse_cache = false;
};

struct RequestStats {
    int64_t n_rounds = 0;          // target passes that emitted tokens (the prompt's last, then verify passes)
    int64_t draft_n = 0;           // tokens drafted (and verified)
    int64_t draft_n_accepted = 0;  // drafted tokens kept
    std::vector<int64_t> drafted_at;   // rounds that drafted block position i
    std::vector<int64_t> accepted_at;  // rounds that accepted block position i
    int64_t n_cached = 0;          // prompt rows reused from the sequence's kept cache
    int64_t n_restaged = 0;        // times the drafter context was restored after a reclaim
    int64_t ngram_rounds = 0;      // rounds that verified n-gram drafts (counted in the totals above too)
    int64_t ngram_draft_n = 0;
    int64_t ngram_draft_n_accepted = 0;
    bool draft_stopped = false;    // drafting failed once and stopped; the request goes on plainly
    std::string draft_stop_reason;
    double mean_accepted_length() const {  // tokens per verify pass
        return n_rounds ? 1.0 + static_cast<double>(draft_n_accepted) / static_cast<double>(n_rounds) : 0.0;
    }
};

struct StepOutput {
    uint64_t request_id = 0;
    std::vector<int32_t> tokens;  // emitted in this step
    bool finished = false;
    std::string stop_reason;      // "length", "stop", "context" when finished
    int32_t stop_token = -1;      // the stop id that ended it (stop_reason "stop"; not emitted)
    int64_t n_drafted = 0;        // drafts proposed for this request at the end of this step
    int64_t n_prompt_processed = 0;  // prompt rows this step decoded for the request
    std::vector<int32_t> verified;   // the drafted block this step verified (empty: none)
    std::vector<TokenLogprobs> probs;  // one per emitted token when n_probs > 0 (raw logits)
    RequestStats stats;           // the request's totals after this step
};

class SpecEngine {
public:
    // Throws std::invalid_argument for inconsistent parameters (as Context / DraftContext do).
    // drafter may be null: every request then decodes plainly (one verify row, no drafts), which
    // is how a server without a drafter runs its slots through the same step.
    SpecEngine(const Model& target, const DraftModel* drafter, const SpecEngineParams& params);
    ~SpecEngine();
    SpecEngine(const SpecEngine&) = delete;
    SpecEngine& operator=(const SpecEngine&) = delete;

    // Throws std::invalid_argument on a duplicate id, an empty or too long prompt, a bad token,
    // bad sampling parameters, or when every target sequence is taken.
    void add_request(uint64_t id, const std::vector<int32_t>& prompt, const RequestParams& params);
    // Drops a request and frees its target sequence (kept as a prompt cache with keep_cache) and
    // drafter slot; unknown ids: false.
    bool cancel(uint64_t id);
    // A paused request sits out steps but keeps its target sequence and (until reclaimed) its
    // drafter slot. Unknown ids throw std::invalid_argument.
    void pause(uint64_t id);
    void resume(uint64_t id);

    // One step over the active requests. Finished requests are reported once and removed.
    std::vector<StepOutput> step();

    bool has_request(uint64_t id) const { return requests_.count(id) != 0; }
    size_t n_requests() const { return requests_.size(); }
    const RequestStats& stats(uint64_t id) const;
    // The drafts the request will verify next (empty when none), for tests of invariant 7.
    const std::vector<int32_t>& pending_drafts(uint64_t id) const;
    int32_t target_seq(uint64_t id) const;
    int64_t target_pos_max(int32_t seq);  // -1: the target sequence is empty
    // Prompt cache: the tokens whose KV rows (positions 0..n-1) an idle target sequence kept
    // (empty for a busy sequence or one that kept nothing); the length of the common prefix of
    // those and `tokens`; and dropping what idle sequences kept (seq < 0: every idle one; a busy
    // sequence throws std::invalid_argument).
    const std::vector<int32_t>& cached_tokens(int32_t seq) const;
    int64_t cached_prefix(int32_t seq, const std::vector<int32_t>& tokens) const;
    void clear_cache(int32_t seq);
    int64_t draft_n_max() const { return draft_n_max_; }
    // Rows each drafting pass decodes (DraftHparams::block_rows of the rounds' slots).
    int64_t draft_block_rows() const { return draft_block_; }
    int64_t steps() const { return step_; }
    // Steps launched ahead (SpecEngineParams::decode_ahead) so far, and whether one is in flight.
    int64_t n_decoded_ahead() const { return n_decoded_ahead_; }
    bool has_step_ahead() const { return ahead_.has_value(); }
    // Rows decoded ahead on a sampled token the host's draw then overruled (dropped, decoded again).
    int64_t n_ahead_overruled() const { return n_ahead_overruled_; }
    // Steps whose sampled rows drew from the graph's top-k candidates (candidate_law) instead of
    // whole logit rows.
    int64_t n_candidate_steps() const { return n_candidate_steps_; }
    // Output rows whose whole logits crossed from the backend so far.
    int64_t n_logit_rows() const { return n_logit_rows_; }

    bool has_drafter() const { return drafter_ != nullptr; }
    const Context& target_context() const { return *ctx_; }
    // Both throw std::logic_error without a drafter.
    const DraftContext& draft_context() const;
    const DraftStateRegistry& registry() const;

    // Per-op profiles of the target's and the drafter's passes (Backend::op_profile).
    void set_profiling(bool on) {
        ctx_->set_profiling(on);
        if (dctx_) dctx_->set_profiling(on);
    }
    Backend::OpProfile target_op_profile() const { return ctx_->op_profile(); }
    Backend::OpProfile draft_op_profile() const { return dctx_ ? dctx_->op_profile() : Backend::OpProfile{}; }

    // Wall-clock seconds step() spent, by phase, since construction: the target's pass (run
    // and read back), staging committed rows into the drafter (inject), the
    // drafter's passes, and the rest (scheduling, verification, bookkeeping). A GPU's queued
    // work is waited for where results are read, so each phase holds what it waited for: the
    // split of a speculative round that matters on a GPU, where launches and copies are a large
    // part of it and the op profile (which runs ops one by one) cannot see them.
    struct PhaseTimes {
        double target_s = 0.0, stage_s = 0.0, draft_s = 0.0, other_s = 0.0;
        int64_t steps = 0;
    };
    const PhaseTimes& phase_times() const { return phase_times_; }

    // Fault injection for tests of the graceful stop: the next drafter pass that includes this
    // request throws as a failing drafter would (the failure path is the real one).
    void inject_draft_failure(uint64_t id) { get(id).inject_failure = true; }

private:
    struct Request {
        uint64_t id = 0;
        RequestParams params;
        std::vector<int32_t> prompt;
        int32_t seq = -1;
        int64_t n_prefilled = 0;  // prompt rows decoded so far
        bool generating = false;  // prefill done (its last row gave the first token): draft / verify rounds
        bool paused = false;
        // Its row in the step decoded ahead was fed another token than the one drawn (sampled
        // decode-ahead): that row is dropped and the token decoded again.
        bool ahead_stale = false;
        bool needs_draft = false; // generating without a drafted block yet (a prompt prefilled
                                  // while no drafter slot was free)
        bool drafting = false;    // drafts (a drafter is loaded, the request wants it, not stopped)
        bool inject_failure = false;
        std::vector<int32_t> history;  // prompt + emitted tokens (the penalties' window)
        int32_t id_last = 0;
        int64_t pos0 = 0;
        int64_t n_out = 0;
        std::vector<int32_t> drafts;  // the block to verify next
        bool ngram_drafts = false;    // ... found by the n-gram lookup (not drafted by the drafter)
        std::vector<float> q;         // [drafts, q width] proposals (T > 0): full rows, or entries at q_ids
        const std::vector<int32_t>* q_ids = nullptr;  // DraftOutput::q_ids of the drafter's rows
        // Committed feature rows not yet staged into the drafter slot (positions and rows).
        std::deque<int32_t> pending_pos;
        std::deque<std::vector<float>> pending_rows;
        // The drafter state while the request's slot is reclaimed.
        std::optional<ParkedDraftState> parked;
        int64_t last_step = -1;
        RequestStats stats;
    };

    Request& get(uint64_t id);
    const Request& get(uint64_t id) const;
    void commit_rows(Request& r, const DecodeOutput& out, size_t row0, int64_t pos, size_t n);
    // Verifies r's drafts (none after its prompt pass) against the target's rows for [id_last,
    // drafts...], which start at logits (or ARGMAX) row `first`.
    // Whether r's rows are read whole (token probabilities, processing beyond bans, sampling
    // without top-k or past kMaxSampledCandidates), and otherwise how many of each row's best ids
    // (TOP_K) it needs: one greedy, bans + 1 with bans, top_k + bans sampled.
    bool reads_logits(const Request& r) const;
    int64_t ids_needed(const Request& r) const;
    // r's proposal rows (T > 0) for verification.
    ProposalRows proposals(const Request& r) const;
    VerifyResult verify_rows(const Request& r, const DecodeOutput& out, int64_t first, bool argmax_only,
                             std::vector<float>& processed) const;
    // Emits what a verification of the rows from logits row `first` gave: history, stop ids,
    // log-probabilities, max_tokens; id_last and pos0 move past the accepted tokens; a full
    // context finishes r.
    void emit(Request& r, const VerifyResult& vr, const DecodeOutput& out, int64_t first, StepOutput& so);
    // Stages r's waiting feature rows into its slot (restoring a parked state first); a failure
    // stops r's drafting instead of escaping.
    void stage(Request& r, SlotGrant& grant);
    void stage_rows(Request& r, SlotGrant& grant);
    // How many drafts r's next round may verify, at most cap: the room left in its context and
    // under its max_tokens.
    int64_t draft_room(const Request& r, int64_t cap) const;
    // The n-gram lookup's drafts for r's next round (with one-hot proposals at T > 0); false when
    // it is off for r or finds nothing.
    bool propose_ngram(Request& r);
    // Drafts the next block of every (request, drafter slot) pair in one drafter pass.
    void draft(const std::vector<std::pair<Request*, int32_t>>& todo);
    void release(Request& r);
    // Decoding ahead (SpecEngineParams::decode_ahead): whether r's next step may be queued before
    // this one's token is read, queueing it for `run` (one row each, in the order of `now`'s
    // rows), the step that collects it, and whether r has a row in it.
    bool may_decode_ahead(const Request& r) const;
    bool launch_ahead(const std::vector<Request*>& run, PendingDecode& now);
    std::vector<StepOutput> step_ahead();
    bool in_ahead(uint64_t id) const;
    // r's sampler for the graph's SAMPLE (a greedy row: temperature 0).
    RowSampler row_sampler(const Request& r) const;
    // After r's step was verified: whether the step decoded ahead was fed the token r emitted
    // (the graph's draw, out.sampled[row]); else r's row there is marked stale.
    void check_fed_token(Request& r, const DecodeOutput& out, size_t row, const VerifyResult& vr);
    // A step's last part: the outputs' stats, and the finished requests released.
    void finish_step(std::vector<StepOutput>& result);
    // Ends drafting for r after a drafter failure: one log line, the flag in its stats, its slot
    // cleared and given back; r goes on decoding without drafts.
    void stop_drafting(Request& r, const std::string& why);

    const Model& target_;
    const DraftModel* drafter_;
    SpecEngineParams params_;
    std::unique_ptr<Context> ctx_;
    std::unique_ptr<DraftContext> dctx_;
    std::unique_ptr<DraftStateRegistry> registry_;
    std::map<uint64_t, Request> requests_;
    std::vector<uint8_t> seq_used_;
    // Per target sequence: the tokens at positions 0..n-1 of the KV rows it kept after its last
    // request ended with keep_cache (empty while a request runs in it, or when it kept nothing).
    std::vector<std::vector<int32_t>> cached_;
    std::vector<int> layers_;
    int64_t n_embd_ = 0;
    int64_t n_vocab_ = 0;
    int64_t draft_n_max_ = 0;
    int64_t offset_ = 0;
    int64_t draft_block_ = 0;
    int64_t step_ = 0;
    PhaseTimes phase_times_;
    struct Ahead {
        std::unique_ptr<PendingDecode> pending;  // launched, not collected
        std::vector<uint64_t> ids;               // its rows' requests, in row order
    };
    std::optional<Ahead> ahead_;
    int64_t n_decoded_ahead_ = 0;
    int64_t n_ahead_overruled_ = 0;
    int64_t n_candidate_steps_ = 0;
    int64_t n_logit_rows_ = 0;
};

}  // namespace pyspec
