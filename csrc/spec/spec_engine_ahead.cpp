// Decoding ahead (SpecEngineParams::decode_ahead; docs/internals.md): a step of plain greedy rows
// queues the next one before its own tokens are read, the next tokens fed on the device from its
// ARGMAX (Context::launch with a feed); the step after collects it.
#include <algorithm>
#include <chrono>

#include "spec/phase_clock.h"
#include "spec/spec_engine.h"

namespace pyspec {

bool SpecEngine::in_ahead(uint64_t id) const {
    return ahead_ && std::find(ahead_->ids.begin(), ahead_->ids.end(), id) != ahead_->ids.end();
}

bool SpecEngine::may_decode_ahead(const Request& r) const {
    // A plain greedy row whose next step is certain to follow (no drafts, no lookup, nothing the
    // host must do to the logits, a next cell, and not its last token by max_tokens); a stop id
    // may still end it, and then the step ahead's row is dropped.
    // A sampled row, or one that bans a few ids (ignore_eos), may too where the graph draws its
    // token (sampled_ahead: SAMPLE over the graph's top-k candidates less the bans).
    const RequestParams& q = r.params;
    const std::vector<int32_t> bans = q.processing.bans_only();
    const bool few_bans = !q.processing.active() || (!bans.empty() && bans.size() <= static_cast<size_t>(kSampleBans));
    const bool needs_sample = q.temperature > 0.0 || !bans.empty();
    const bool token_in_graph = few_bans && !reads_logits(r) && (!needs_sample || params_.sampled_ahead > 0);
    return r.generating && !r.paused && !r.drafting && !r.needs_draft && r.drafts.empty() && token_in_graph &&
           q.n_probs == 0 && (params_.ngram.n <= 0 || !q.draft) &&
           r.pos0 + 1 < ctx_->n_ctx_seq() && !(q.max_tokens > 0 && r.n_out + 1 >= q.max_tokens);
}

bool SpecEngine::launch_ahead(const std::vector<Request*>& run, PendingDecode& now) {
    // The row after each one in flight: the token there is the one `now` computes.
    Batch next;
    std::vector<uint64_t> ids;
    for (const Request* r : run) {
        next.tokens.push_back(0);  // fed on the device
        next.positions.push_back(static_cast<int32_t>(r->pos0 + 1));
        next.seq_ids.push_back(r->seq);
        next.output.push_back(1);
        next.prompt.push_back(0);
        ids.push_back(r->id);
    }
    // The same kind of step as `now` (the same graph: a feed reads now's outputs where that graph
    // left them): its candidates and draws where `now` has them.
    next.argmax_only = true;
    next.argmax_k = now.params.argmax_k;
    next.argmax_values = now.params.argmax_values;
    next.sample = now.params.sample;
    if (next.sample) {
        for (const Request* r : run) next.samplers.push_back(row_sampler(*r));
    }
    std::unique_ptr<PendingDecode> p = ctx_->launch(next, layers_, &now);
    if (!p) return false;  // another graph (the attention span grew): this step goes plainly
    ahead_ = Ahead{std::move(p), std::move(ids)};
    ++n_decoded_ahead_;
    return true;
}

RowSampler SpecEngine::row_sampler(const Request& r) const {
    const RequestParams& q = r.params;
    RowSampler rs;
    rs.bans = q.processing.bans_only();
    if (q.temperature <= 0.0 || params_.sampled_ahead == 2) return rs;  // 2: predicts the greedy token
    rs.temperature = q.temperature;
    rs.top_p = q.top_p;
    rs.min_p = q.min_p;
    rs.top_k = static_cast<int32_t>(q.top_k);
    rs.seed = q.seed;
    return rs;
}

void SpecEngine::check_fed_token(Request& r, const DecodeOutput& out, size_t row, const VerifyResult& vr) {
    // Rows fed their ARGMAX are fed their greedy token by definition; SAMPLE's (a greedy row's
    // first id not banned, or a sampled row's draw) is checked.
    if (out.sampled.empty()) return;
    if (out.sampled[row] == vr.tokens.back()) return;
    r.ahead_stale = true;
    ++n_ahead_overruled_;
}

std::vector<StepOutput> SpecEngine::step_ahead() {
    Ahead a = std::move(*ahead_);
    ahead_.reset();
    // The launched rows' requests as they are now: one that finished in the step before or was
    // cancelled is gone with its cells, and its row is dropped; a paused one frees its row's cell
    // (its next step decodes that token again).
    std::vector<Request*> run;
    std::vector<size_t> rows;
    for (size_t i = 0; i < a.ids.size(); ++i) {
        auto it = requests_.find(a.ids[i]);
        if (it == requests_.end()) continue;
        Request& r = it->second;
        if (r.paused || r.ahead_stale) {
            ctx_->kv().remove(r.seq, r.pos0, r.pos0 + 1);
            r.ahead_stale = false;
            continue;
        }
        run.push_back(&r);
        rows.push_back(i);
    }
    ++step_;
    const PhaseTimes before = phase_times_;
    OtherClock<PhaseTimes> other_clock{phase_times_, before, std::chrono::steady_clock::now()};
    DecodeOutput out;
    {
        PhaseClock clock(phase_times_.target_s);
        // The step after, queued again while every runnable request is in this one and may go on.
        size_t runnable = 0;
        for (const auto& kv : requests_) runnable += kv.second.paused ? 0 : 1;
        const bool chain = params_.decode_ahead && rows.size() == a.ids.size() && runnable == run.size() &&
                           std::all_of(run.begin(), run.end(), [this](const Request* r) { return may_decode_ahead(*r); });
        try {
            if (chain) launch_ahead(run, *a.pending);
        } catch (...) {
            ctx_->collect(*a.pending);
            throw;
        }
        out = ctx_->collect(*a.pending);
    }
    std::vector<StepOutput> result;
    std::vector<float> processed;
    for (size_t j = 0; j < run.size(); ++j) {
        Request* r = run[j];
        StepOutput so;
        so.request_id = r->id;
        // Row rows[j] is this request's only row: its greedy id, as a round without drafts.
        const VerifyResult vr = verify_rows(*r, out, static_cast<int64_t>(rows[j]), true, processed);
        ++r->stats.n_rounds;
        if (!in_ahead(r->id)) ctx_->kv().remove(r->seq, r->pos0 + 1, -1);
        if (in_ahead(r->id)) check_fed_token(*r, out, rows[j], vr);
        emit(*r, vr, out, static_cast<int64_t>(rows[j]), so);
        result.push_back(std::move(so));
    }
    finish_step(result);
    return result;
}

}  // namespace pyspec
