#include "spec/spec_engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <unordered_map>

#include "spec/phase_clock.h"

namespace pyspec {

namespace {

// The most ids a greedy step asks the graph for per row (Batch::argmax_k): requests that ban
// more ids than this less one read their logits instead.
constexpr int kMaxGreedyIds = 16;

ContextParams target_params(const SpecEngineParams& p) {
    ContextParams c;
    c.n_ctx = p.n_ctx;
    c.n_seq_max = p.n_seq_max;
    c.n_batch = p.n_batch;
    c.n_threads = p.n_threads;
    c.kv_dtype = p.kv_dtype;
    c.backend = p.backend;
    return c;
}

DraftContextParams draft_params(const SpecEngineParams& p) {
    if (p.n_draft_slots < 1) throw std::invalid_argument("n_draft_slots must be at least 1");
    DraftContextParams d;
    d.n_seq_max = p.n_draft_slots;
    d.n_batch = p.draft_n_batch;
    d.n_threads = p.n_threads;
    d.kv_dtype = p.kv_dtype;
    d.backend = p.backend;
    return d;
}

// The processed law of each row (target_law.h processed_law): what the request would sample from
// without a drafter, so verification keeps it (design invariant 6).
std::vector<float> target_law(const float* logits, int64_t n_rows, int64_t n_vocab, const RequestParams& r) {
    std::vector<float> p(static_cast<size_t>(n_rows * n_vocab));
    for (int64_t i = 0; i < n_rows; ++i) {
        processed_law(logits + i * n_vocab, n_vocab, r.temperature, r.top_k, r.top_p, r.min_p,
                      p.data() + i * n_vocab);
    }
    return p;
}

}  // namespace

SpecEngine::SpecEngine(const Model& target, const DraftModel* drafter, const SpecEngineParams& params)
    : target_(target), drafter_(drafter), params_(params) {
    if (drafter_ && &drafter_->target() != &target) {
        throw std::invalid_argument("the drafter was loaded for another target model");
    }
    if (params_.prefill_chunk < 1) throw std::invalid_argument("prefill_chunk must be at least 1");
    if (params_.ngram.n < 0) throw std::invalid_argument("the n-gram lookup length must be >= 0 (0: off)");
    if (params_.ngram.n > 0 && params_.ngram.m < 1) throw std::invalid_argument("n-gram drafts need m >= 1");
    ctx_ = std::make_unique<Context>(target_, target_params(params_));
    // PYSPEC_DECODE_AHEAD=0/1 decides in every front end (A/B runs, a way out).
    if (const char* v = std::getenv("PYSPEC_DECODE_AHEAD"); v && (std::string(v) == "0" || std::string(v) == "1")) {
        params_.decode_ahead = v[0] == '1';
    }
    if (params_.decode_ahead < 0) params_.decode_ahead = ctx_->computes_asynchronously() ? 1 : 0;
    if (const char* v = std::getenv("PYSPEC_SAMPLED_AHEAD"); v && std::string(v).size() == 1 && v[0] >= '0' && v[0] <= '2') {
        params_.sampled_ahead = v[0] - '0';
    }
    seq_used_.assign(static_cast<size_t>(params_.n_seq_max), 0);
    cached_.assign(static_cast<size_t>(params_.n_seq_max), {});
    n_embd_ = target_.hparams().n_embd;
    n_vocab_ = target_.hparams().n_vocab;
    if (!drafter_) return;
    dctx_ = std::make_unique<DraftContext>(*drafter_, draft_params(params_));
    registry_ = std::make_unique<DraftStateRegistry>(static_cast<int32_t>(params_.n_draft_slots));
    const DraftHparams& hp = drafter_->hparams();
    layers_ = hp.target_layers;
    offset_ = hp.draft_offset();
    draft_n_max_ = std::min<int64_t>(hp.n_draft_max(), params_.n_batch - 1);
    if (params_.draft_n_max >= 0) draft_n_max_ = std::min(draft_n_max_, params_.draft_n_max);
    draft_n_max_ = std::max<int64_t>(draft_n_max_, 0);
    draft_block_ = hp.block_rows(draft_n_max_ + offset_);
}

const DraftContext& SpecEngine::draft_context() const {
    if (!dctx_) throw std::logic_error("this engine has no drafter");
    return *dctx_;
}

const DraftStateRegistry& SpecEngine::registry() const {
    if (!registry_) throw std::logic_error("this engine has no drafter");
    return *registry_;
}

SpecEngine::Request& SpecEngine::get(uint64_t id) {
    auto it = requests_.find(id);
    if (it == requests_.end()) throw std::invalid_argument("unknown request id " + std::to_string(id));
    return it->second;
}

const SpecEngine::Request& SpecEngine::get(uint64_t id) const {
    auto it = requests_.find(id);
    if (it == requests_.end()) throw std::invalid_argument("unknown request id " + std::to_string(id));
    return it->second;
}

void SpecEngine::add_request(uint64_t id, const std::vector<int32_t>& prompt, const RequestParams& params) {
    if (requests_.count(id)) throw std::invalid_argument("request id " + std::to_string(id) + " is already active");
    if (prompt.empty()) throw std::invalid_argument("the prompt is empty (no tokens)");
    if (static_cast<int64_t>(prompt.size()) > ctx_->n_ctx_seq()) {
        throw std::invalid_argument("the prompt has " + std::to_string(prompt.size()) + " tokens but a request's context holds " +
                                    std::to_string(ctx_->n_ctx_seq()));
    }
    for (int32_t t : prompt) {
        if (t < 0 || t >= n_vocab_) throw std::invalid_argument("prompt token id " + std::to_string(t) + " is outside the vocabulary");
    }
    if (params.max_tokens == 0) throw std::invalid_argument("max_tokens must be positive, or negative for no limit");
    if (!std::isfinite(params.temperature) || params.temperature < 0.0) {
        throw std::invalid_argument("temperature must be finite and >= 0");
    }
    if (!(params.top_p >= 0.0 && params.top_p <= 1.0)) throw std::invalid_argument("top_p must be in [0, 1]");
    if (!(params.min_p >= 0.0 && params.min_p <= 1.0)) throw std::invalid_argument("min_p must be in [0, 1]");
    if (params.temperature > 0.0 && params.method == VerifyMethod::Greedy) {
        throw std::invalid_argument("greedy verification needs temperature 0: use rejection or block");
    }
    if (!(params.draft_p_min >= 0.0 && params.draft_p_min <= 1.0)) {
        throw std::invalid_argument("draft_p_min must be in [0, 1]");
    }
    if (params.draft_n_min < 0) throw std::invalid_argument("draft_n_min must be >= 0");
    if (params.draft_p_min > 0.0 && drafter_ && drafter_->hparams().is_dspark && !drafter_->hparams().has_confidence_head) {
        throw std::invalid_argument("DSpark draft has no confidence head: please set draft_p_min 0");
    }
    check_logit_processing(params.processing, n_vocab_);
    if (params.n_probs < 0) throw std::invalid_argument("n_probs must be >= 0");
    auto free_seq = std::find(seq_used_.begin(), seq_used_.end(), 0);
    if (params.seq >= 0) {
        if (params.seq >= params_.n_seq_max) {
            throw std::invalid_argument("target sequence " + std::to_string(params.seq) + " is out of range (n_seq_max = " +
                                        std::to_string(params_.n_seq_max) + ")");
        }
        free_seq = seq_used_.begin() + params.seq;
        if (*free_seq) throw std::invalid_argument("target sequence " + std::to_string(params.seq) + " is busy");
    }
    if (free_seq == seq_used_.end()) {
        throw std::invalid_argument("every target sequence is taken (n_seq_max = " + std::to_string(params_.n_seq_max) + ")");
    }
    Request r;
    r.id = id;
    r.params = params;
    r.prompt = prompt;
    r.seq = static_cast<int32_t>(free_seq - seq_used_.begin());
    r.drafting = drafter_ != nullptr && params.draft;
    r.history = prompt;
    // Prompt cache: keep the rows of the common prefix with what a pinned sequence recorded, but
    // never the last prompt token's (its row is decoded again: its pass gives the first logits).
    std::vector<int32_t>& cached = cached_[static_cast<size_t>(r.seq)];
    int64_t n_keep = 0;
    if (params.reuse_cache && params.seq >= 0) {
        n_keep = std::min(cached_prefix(r.seq, prompt), static_cast<int64_t>(prompt.size()) - 1);
    }
    if (n_keep > 0) {
        ctx_->kv().remove(r.seq, n_keep, -1);
    } else {
        ctx_->kv().clear(r.seq);
    }
    cached.clear();
    r.n_prefilled = n_keep;
    r.stats.n_cached = n_keep;
    *free_seq = 1;
    requests_.emplace(id, std::move(r));
}

const std::vector<int32_t>& SpecEngine::cached_tokens(int32_t seq) const {
    if (seq < 0 || seq >= params_.n_seq_max) throw std::invalid_argument("target sequence " + std::to_string(seq) + " out of range");
    return cached_[static_cast<size_t>(seq)];
}

int64_t SpecEngine::cached_prefix(int32_t seq, const std::vector<int32_t>& tokens) const {
    const std::vector<int32_t>& c = cached_tokens(seq);
    const size_t n = std::min(c.size(), tokens.size());
    size_t p = 0;
    while (p < n && c[p] == tokens[p]) ++p;
    return static_cast<int64_t>(p);
}

void SpecEngine::clear_cache(int32_t seq) {
    if (seq >= params_.n_seq_max) throw std::invalid_argument("target sequence " + std::to_string(seq) + " out of range");
    if (seq >= 0 && seq_used_[static_cast<size_t>(seq)]) {
        throw std::invalid_argument("target sequence " + std::to_string(seq) + " is busy");
    }
    for (int32_t s = 0; s < params_.n_seq_max; ++s) {
        if ((seq < 0 || s == seq) && !seq_used_[static_cast<size_t>(s)]) {
            ctx_->kv().clear(s);
            cached_[static_cast<size_t>(s)].clear();
        }
    }
}

void SpecEngine::release(Request& r) {
    std::vector<int32_t>& cached = cached_[static_cast<size_t>(r.seq)];
    cached.clear();
    if (r.params.keep_cache) {
        // The sequence holds rows 0..n-1: the prefilled prompt rows, or once generating every
        // committed token before id_last (whose row the next round would decode). history is
        // prompt + emitted tokens, so a prefix of the tokens at those positions -- except that a
        // stop id or max_tokens may cut it inside the last round; rows past it go.
        int64_t n_rows = r.generating ? r.pos0 : r.n_prefilled;
        // Where prompt rows have a path of their own (the GPU's tensor cores), the rows decoded
        // as output rows (the committed tokens') hold other bits than a fresh request's prefill
        // would give them: only the prompt rows are kept.
        if (ctx_->prompt_rows_have_own_path()) n_rows = std::min(n_rows, r.n_prefilled);
        const int64_t n = std::min<int64_t>(n_rows, static_cast<int64_t>(r.history.size()));
        ctx_->kv().remove(r.seq, n, -1);
        cached.assign(r.history.begin(), r.history.begin() + n);
    } else {
        ctx_->kv().clear(r.seq);
    }
    seq_used_[static_cast<size_t>(r.seq)] = 0;
    if (!registry_) return;
    const int32_t slot = registry_->release(r.id);
    if (slot >= 0) dctx_->clear(slot);
}

void SpecEngine::stop_drafting(Request& r, const std::string& why) {
    if (!r.drafting) return;
    r.drafting = false;
    r.needs_draft = false;
    r.stats.draft_stopped = true;
    r.stats.draft_stop_reason = why;
    std::fprintf(stderr, "pyspec: request %llu: drafting stopped (%s); it continues without drafts\n",
                 static_cast<unsigned long long>(r.id), why.c_str());
    const int32_t slot = registry_->release(r.id);
    if (slot >= 0) dctx_->clear(slot);
    r.drafts.clear();
    r.q.clear();
    r.q_ids = nullptr;
    r.pending_pos.clear();
    r.pending_rows.clear();
    r.parked.reset();
}

bool SpecEngine::cancel(uint64_t id) {
    auto it = requests_.find(id);
    if (it == requests_.end()) return false;
    release(it->second);
    requests_.erase(it);
    return true;
}

void SpecEngine::pause(uint64_t id) { get(id).paused = true; }
void SpecEngine::resume(uint64_t id) { get(id).paused = false; }

const RequestStats& SpecEngine::stats(uint64_t id) const { return get(id).stats; }
const std::vector<int32_t>& SpecEngine::pending_drafts(uint64_t id) const { return get(id).drafts; }
int32_t SpecEngine::target_seq(uint64_t id) const { return get(id).seq; }

int64_t SpecEngine::target_pos_max(int32_t seq) {
    if (seq < 0 || seq >= params_.n_seq_max) throw std::invalid_argument("target sequence " + std::to_string(seq) + " out of range");
    return ctx_->kv().pos_max(seq);
}

void SpecEngine::commit_rows(Request& r, const DecodeOutput& out, size_t row0, int64_t pos, size_t n) {
    const size_t width = layers_.size() * static_cast<size_t>(n_embd_);
    for (size_t i = 0; i < n; ++i) {
        std::vector<float> row(width);
        for (size_t l = 0; l < layers_.size(); ++l) {
            const std::vector<float>& src = out.layer_inputs[l].second;
            std::copy_n(src.data() + (row0 + i) * static_cast<size_t>(n_embd_), static_cast<size_t>(n_embd_),
                        row.data() + l * static_cast<size_t>(n_embd_));
        }
        r.pending_pos.push_back(static_cast<int32_t>(pos + static_cast<int64_t>(i)));
        r.pending_rows.push_back(std::move(row));
    }
    // Rows older than the drafter window are never read again (DraftContext::inject skips them).
    const size_t window = static_cast<size_t>(dctx_->window());
    while (r.pending_pos.size() > window) {
        r.pending_pos.pop_front();
        r.pending_rows.pop_front();
    }
}

void SpecEngine::stage(Request& r, SlotGrant& grant) {
    if (!r.drafting) return;
    PhaseClock clock(phase_times_.stage_s);
    try {
        stage_rows(r, grant);
    } catch (const std::exception& e) {
        // A failed inject (or the rebase inside it) leaves the slot in no known state.
        stop_drafting(r, std::string("staging into the drafter failed: ") + e.what());
    }
}

void SpecEngine::stage_rows(Request& r, SlotGrant& grant) {
    // A fresh slot holds someone else's rows (or none); a request coming back from a reclaim gets
    // its parked state restored into it. Either way this happens once per grant.
    if (grant.fresh) {
        dctx_->clear(grant.slot);
        if (grant.restage) {
            if (!r.parked) throw std::runtime_error("request " + std::to_string(r.id) + " returns without a parked drafter state");
            dctx_->restore(grant.slot, *r.parked);
            r.parked.reset();
            ++r.stats.n_restaged;
        }
        grant.fresh = grant.restage = false;
    }
    const size_t n = r.pending_pos.size();
    if (n == 0) return;
    const size_t width = layers_.size() * static_cast<size_t>(n_embd_);
    std::vector<int32_t> pos(r.pending_pos.begin(), r.pending_pos.end());
    std::vector<float> feats(n * width);
    for (size_t i = 0; i < n; ++i) {
        std::copy(r.pending_rows[i].begin(), r.pending_rows[i].end(), feats.begin() + static_cast<std::ptrdiff_t>(i * width));
    }
    dctx_->inject(grant.slot, pos, feats.data(), n);
    r.pending_pos.clear();
    r.pending_rows.clear();
}

int64_t SpecEngine::draft_room(const Request& r, int64_t cap) const {
    // A round emits its accepted drafts and one more token, whose row must fit the context too;
    // the verify rows (1 + drafts) must fit one target graph.
    int64_t n = std::min<int64_t>({cap, ctx_->n_ctx_seq() - 1 - r.pos0, params_.n_batch - 1});
    if (r.params.max_tokens > 0) n = std::min<int64_t>(n, r.params.max_tokens - r.n_out - 1);
    return n;
}

bool SpecEngine::propose_ngram(Request& r) {
    if (params_.ngram.n <= 0 || !r.params.draft) return false;
    const int64_t room = draft_room(r, params_.ngram.m);
    if (room <= 0) return false;
    std::vector<int32_t> found = ngram_simple_draft(r.history, params_.ngram.n, room);
    if (found.empty()) return false;
    r.drafts = std::move(found);
    r.ngram_drafts = true;
    r.q.clear();
    r.q_ids = nullptr;
    if (r.params.temperature > 0.0) {
        // A looked-up draft is deterministic: its proposal is the point mass on it, and rejection
        // (or block) verification with that q stays exactly the target's law (verification.md §2.2).
        r.q.assign(r.drafts.size() * static_cast<size_t>(n_vocab_), 0.0f);
        for (size_t k = 0; k < r.drafts.size(); ++k) r.q[k * static_cast<size_t>(n_vocab_) + static_cast<size_t>(r.drafts[k])] = 1.0f;
    }
    return true;
}

void SpecEngine::draft(const std::vector<std::pair<Request*, int32_t>>& todo) {
    std::vector<DraftRequest> reqs;
    std::vector<std::pair<Request*, int64_t>> who;  // request, drafts it keeps
    for (const auto& [r, slot] : todo) {
        r->drafts.clear();
        r->q.clear();
        r->ngram_drafts = false;
        const int64_t n_draft = draft_room(*r, draft_n_max_);
        if (n_draft <= 0) continue;
        DraftRequest d;
        d.seq = slot;
        d.id_last = r->id_last;
        d.pos0 = static_cast<int32_t>(r->pos0);
        d.sampling.temperature = static_cast<float>(r->params.temperature);
        d.sampling.seed = r->params.seed;
        d.sampling.offset = static_cast<uint32_t>(r->pos0);
        reqs.push_back(d);
        who.emplace_back(r, n_draft);
    }
    if (reqs.empty()) return;
    PhaseClock clock(phase_times_.draft_s);
    // The drafter's whole trained block is decoded, and its first draft_n_max_ draft slots come
    // out (then cut to the round's room). The block's rows attend to each other, so a shorter
    // block [id_last, MASK x (n_max - 1)] is one the drafter never saw in training: SmolLM2's
    // drafter accepted ~9% fewer drafts at n_max 3 with it. The slots past n_max only lend keys
    // and values (DraftContext::draft). A fixed block also keeps a slot's logits independent of
    // how much room this round has. One
    // pass drafts every request, and batch invariance (invariant 7) makes each block what
    // drafting it alone would give -- which is also why, when the pass fails, drafting each
    // request alone finds the one that failed without changing anyone else's drafts.
    // A drafter trained on cut blocks too (pyspec.drafter.block_size_min) decodes just the rows
    // this engine's rounds draft (draft_block_): every round the same block, so the above holds
    // as well.
    const int64_t block = draft_block_;
    // The engine reads the draft slots' tokens, q and confidences: a DSpark pass gives them
    // without the sampling chains (DraftContext::draft_many), unless its chains would break an
    // ARGMAX tie another way (a d2t that does not keep the vocabulary's order). DFlash prunes
    // with the chains' top-1 probabilities and draws through them.
    const DraftModel& dm = *drafter_;
    const bool chains = !(dm.hparams().is_dspark && (dm.d2t.empty() || dm.d2t_ascending));
    auto pass = [&](const std::vector<DraftRequest>& rs, const std::vector<Request*>& owners) {
        for (Request* r : owners) {
            if (r->inject_failure) {  // stays set: the request's drafting is broken for good
                throw std::runtime_error("injected drafter failure");
            }
        }
        return dctx_->draft_many(rs, block, draft_n_max_ + offset_, /*with_logits=*/false, chains);
    };
    std::vector<Request*> owners;
    for (const auto& w : who) owners.push_back(w.first);
    std::vector<DraftOutput> outs;
    std::vector<bool> ok(reqs.size(), true);
    try {
        outs = pass(reqs, owners);
    } catch (const std::exception& e) {
        outs.assign(reqs.size(), DraftOutput{});
        for (size_t i = 0; i < reqs.size(); ++i) {
            try {
                outs[i] = pass({reqs[i]}, {owners[i]}).at(0);
            } catch (const std::exception& e1) {
                ok[i] = false;
                stop_drafting(*owners[i], std::string("drafter pass failed: ") + e1.what());
            }
        }
    }
    for (size_t i = 0; i < outs.size(); ++i) {
        if (!ok[i]) continue;
        Request& r = *who[i].first;
        const DraftOutput& o = outs[i];
        // Confidence pruning of the slots this round has room for (spec/prune.h).
        std::vector<float> conf(static_cast<size_t>(who[i].second));
        for (int64_t k = 0; k < who[i].second && r.params.draft_p_min > 0.0; ++k) {
            const int64_t slot = offset_ + k;
            conf[static_cast<size_t>(k)] = drafter_->hparams().is_dspark
                                                ? o.confidence[static_cast<size_t>(slot)]
                                                : o.candidate_probs[static_cast<size_t>(slot * o.n_candidates)];
        }
        const int64_t n_draft = prune_length(conf.data(), conf.size(), r.params.draft_p_min,
                                             r.params.draft_p_min_mode, r.params.draft_n_min);
        r.drafts.assign(o.tokens.begin() + offset_, o.tokens.begin() + offset_ + n_draft);
        if (r.params.temperature > 0.0) {
            const int64_t w = o.q_width();
            r.q.assign(o.q.begin() + offset_ * w, o.q.begin() + (offset_ + n_draft) * w);
            r.q_ids = o.q_ids;
        }
    }
}

bool SpecEngine::reads_logits(const Request& r) const {
    if (r.params.n_probs != 0) return true;
    size_t n_bans = 0;
    if (r.params.processing.active()) {
        n_bans = r.params.processing.bans_only().size();
        if (n_bans == 0) return true;  // finite biases or penalties
    }
    if (r.params.temperature > 0.0) {
        const int64_t k = r.params.top_k + static_cast<int64_t>(n_bans);
        return r.params.top_k < 1 || k > std::min(kMaxSampledCandidates, n_vocab_);
    }
    return n_bans >= static_cast<size_t>(kMaxGreedyIds);
}

int64_t SpecEngine::ids_needed(const Request& r) const {
    const int64_t n_bans = static_cast<int64_t>(r.params.processing.bans_only().size());
    return r.params.temperature > 0.0 ? r.params.top_k + n_bans : n_bans + 1;
}

ProposalRows SpecEngine::proposals(const Request& r) const {
    const int64_t w = r.q_ids ? static_cast<int64_t>(r.q_ids->size()) : n_vocab_;
    return ProposalRows{r.q.data(), static_cast<int64_t>(r.drafts.size()), n_vocab_, w, r.q_ids ? r.q_ids->data() : nullptr};
}

VerifyResult SpecEngine::verify_rows(const Request& r, const DecodeOutput& out, int64_t first, bool argmax_only,
                                     std::vector<float>& processed) const {
    // Row j is what the request would sample from after committing drafts[0..j).
    const int gamma = static_cast<int>(r.drafts.size());
    const bool from_ids = argmax_only && !reads_logits(r);
    if (from_ids && out.argmax_k == 1 && r.params.temperature <= 0.0) return verify_greedy_ids(out.argmax.data() + first, n_vocab_, r.drafts.data(), gamma);
    if (from_ids) {
        // Each row's best argmax_k ids (value descending, ties by the smaller id), less the ones
        // the request bans: its greedy id is the first; a sampled row's law is over its top_k.
        const std::vector<int32_t> bans = r.params.processing.bans_only();
        const size_t k = static_cast<size_t>(out.argmax_k);
        const auto banned = [&bans](int32_t t) { return std::find(bans.begin(), bans.end(), t) != bans.end(); };
        if (r.params.temperature > 0.0) {
            std::vector<SparseLaw> laws(static_cast<size_t>(gamma) + 1);
            std::vector<int32_t> ids;
            std::vector<float> values;
            for (size_t j = 0; j < laws.size(); ++j) {
                const size_t row = (static_cast<size_t>(first) + j) * k;
                const float* v = out.argmax_values.data() + row;
                if (std::any_of(v, v + k, [](float x) { return std::isnan(x); })) {
                    throw std::runtime_error("the target's logits hold NaN");
                }
                candidates_less_bans(out.argmax.data() + row, v, static_cast<int64_t>(k), bans.data(), bans.size(), &ids,
                                     &values);
                laws[j] = candidate_law(ids.data(), values.data(), static_cast<int64_t>(ids.size()), r.params.temperature,
                                        r.params.top_k, r.params.top_p, r.params.min_p);
            }
            return verify(r.params.method, laws, n_vocab_, proposals(r), r.drafts.data(), gamma, r.params.seed,
                          static_cast<uint32_t>(r.pos0));
        }
        std::vector<int32_t> ids(static_cast<size_t>(gamma) + 1);
        for (size_t j = 0; j < ids.size(); ++j) {
            const int32_t* best = out.argmax.data() + (static_cast<size_t>(first) + j) * k;
            size_t i = 0;
            while (i + 1 < k && banned(best[i])) ++i;
            ids[j] = best[i];
        }
        return verify_greedy_ids(ids.data(), n_vocab_, r.drafts.data(), gamma);
    }
    const float* logits = out.logits_of(static_cast<size_t>(first));
    if (!logits) throw std::logic_error("verify_rows: the request's logits were not read");
    const float* rows = logits;
    const LogitProcessing& lp = r.params.processing;
    if (lp.active()) {
        processed.assign(logits, logits + static_cast<int64_t>(gamma + 1) * n_vocab_);
        for (int j = 0; j <= gamma; ++j) {
            apply_logit_processing(lp, r.history, r.drafts.data(), j, processed.data() + j * n_vocab_, n_vocab_);
        }
        rows = processed.data();
    }
    if (r.params.temperature <= 0.0) return verify_greedy(ProbRows{rows, gamma + 1, n_vocab_}, r.drafts.data(), gamma);
    const std::vector<float> p = target_law(rows, gamma + 1, n_vocab_, r.params);
    // Full target rows meet full proposal rows: a drafter's draft-vocabulary rows spread out
    // (full ones are used where they are).
    const std::vector<float> spread = r.q_ids ? proposals(r).spread() : std::vector<float>();
    return verify(r.params.method, ProbRows{p.data(), gamma + 1, n_vocab_},
                  ProbRows{r.q_ids ? spread.data() : r.q.data(), gamma, n_vocab_},
                  r.drafts.data(), gamma, r.params.seed, static_cast<uint32_t>(r.pos0));
}

void SpecEngine::emit(Request& r, const VerifyResult& vr, const DecodeOutput& out, int64_t first, StepOutput& so) {
    // (rows that were not read whole have no logits; reads_logits has every n_probs request's
    // rows read)
    const float* logits = out.logits_of(static_cast<size_t>(first));
    for (size_t k = 0; k < vr.tokens.size(); ++k) {
        const int32_t tok = vr.tokens[k];
        r.history.push_back(tok);
        if (std::find(r.params.stop_ids.begin(), r.params.stop_ids.end(), tok) != r.params.stop_ids.end()) {
            so.finished = true;
            so.stop_reason = "stop";
            so.stop_token = tok;
            break;
        }
        so.tokens.push_back(tok);
        if (r.params.n_probs > 0) {
            so.probs.push_back(token_logprobs(logits + static_cast<int64_t>(k) * n_vocab_, n_vocab_, tok, r.params.n_probs));
        }
        ++r.n_out;
        if (r.params.max_tokens > 0 && r.n_out >= r.params.max_tokens) {
            so.finished = true;
            so.stop_reason = "length";
            break;
        }
    }
    r.id_last = vr.tokens.back();
    r.pos0 += vr.accepted + 1;
    if (!so.finished && r.pos0 >= ctx_->n_ctx_seq()) {
        so.finished = true;
        so.stop_reason = "context";
    }
}

std::vector<StepOutput> SpecEngine::step() {
    if (ahead_) return step_ahead();
    // Who runs (see the header): drafting requests up to one per drafter slot, holders first, then
    // least recently scheduled; the requests that do not draft always run.
    std::vector<Request*> cands, run;
    for (auto& kv : requests_) {
        Request& r = kv.second;
        if (r.paused) continue;
        (r.drafting ? cands : run).push_back(&r);
    }
    std::vector<uint64_t> granted_ids;
    if (!cands.empty()) {
        const DraftStateRegistry& reg = *registry_;
        std::sort(cands.begin(), cands.end(), [&reg](const Request* a, const Request* b) {
            const bool ha = reg.slot_of(a->id).has_value(), hb = reg.slot_of(b->id).has_value();
            if (ha != hb) return ha;
            return a->last_step != b->last_step ? a->last_step < b->last_step : a->id < b->id;
        });
        if (cands.size() > static_cast<size_t>(params_.n_draft_slots)) cands.resize(static_cast<size_t>(params_.n_draft_slots));
        for (Request* r : cands) {
            granted_ids.push_back(r->id);
            run.push_back(r);
        }
    }
    if (run.empty()) return {};
    ++step_;
    // Whatever the phases below do not claim is "other" (see PhaseTimes).
    const PhaseTimes before = phase_times_;
    const auto t_step = std::chrono::steady_clock::now();
    OtherClock<PhaseTimes> other_clock{phase_times_, before, t_step};
    std::unordered_map<uint64_t, SlotGrant> grant_of;
    if (!granted_ids.empty()) {
        for (const SlotGrant& g : registry_->schedule(step_, granted_ids)) {
            // The reclaimed holder sits this step out; its cells are parked before anyone stages
            // into the slot.
            if (g.evicted) get(*g.evicted).parked = dctx_->park(g.slot);
            grant_of.emplace(g.request_id, g);
        }
    }
    auto grant = [&grant_of](const Request* r) -> SlotGrant* {
        auto it = grant_of.find(r->id);
        return it == grant_of.end() ? nullptr : &it->second;
    };

    // One target batch; each request's rows are found through its id.
    struct Span {
        size_t row0 = 0, n = 0;
    };
    std::unordered_map<uint64_t, Span> span_of;
    // A request generating without a drafted block (a one-token prompt, or a prompt prefilled
    // while it had no slot) gets its first block drafted here, from the rows staged so far, as
    // the one-sequence loop does (all such requests in one pass).
    std::vector<std::pair<Request*, int32_t>> first_blocks;
    for (Request* r : run) {
        SlotGrant* g = grant(r);
        // A first round (its prompt was cached, or prefilled in the step before) looks up too.
        if (r->generating && r->drafts.empty()) propose_ngram(*r);
        if (r->generating && r->needs_draft && g) {
            stage(*r, *g);
            r->needs_draft = false;
            if (r->drafting && !r->ngram_drafts) first_blocks.emplace_back(r, g->slot);
        }
    }
    draft(first_blocks);
    Batch batch;
    for (Request* r : run) {
        if (grant(r)) r->last_step = step_;
        Span sp{batch.size(), 0};
        if (!r->generating) {
            // Prompt rows, every one of them (the last one with logits when this chunk ends the
            // prompt): one pass over the weights gives the first token.
            const int64_t n_prompt = static_cast<int64_t>(r->prompt.size());
            const int64_t n = std::min(params_.prefill_chunk, n_prompt - r->n_prefilled);
            for (int64_t i = 0; i < n; ++i) {
                batch.tokens.push_back(r->prompt[static_cast<size_t>(r->n_prefilled + i)]);
                batch.positions.push_back(static_cast<int32_t>(r->n_prefilled + i));
                batch.seq_ids.push_back(r->seq);
                batch.output.push_back(r->n_prefilled + i == n_prompt - 1 ? 1 : 0);
                batch.prompt.push_back(1);
            }
            sp.n = static_cast<size_t>(n);
        } else {
            batch.tokens.push_back(r->id_last);
            batch.tokens.insert(batch.tokens.end(), r->drafts.begin(), r->drafts.end());
            sp.n = 1 + r->drafts.size();
            for (size_t i = 0; i < sp.n; ++i) {
                batch.positions.push_back(static_cast<int32_t>(r->pos0 + static_cast<int64_t>(i)));
                batch.seq_ids.push_back(r->seq);
                batch.output.push_back(1);
                batch.prompt.push_back(0);
            }
        }
        span_of.emplace(r->id, sp);
    }
    // Rows that verify greedily, with nothing that reads the logits themselves (logit processing,
    // token probabilities), take their greedy token from the graph's ARGMAX: n ids cross from the
    // backend instead of n x n_vocab floats (on a GPU with a large vocabulary, the copy is a large
    // part of a step). Same tokens: ARGMAX is argmax_first's first maximum; only a row holding
    // NaN, which argmax_first refuses, is not reported here. Requests that ban ids or sample with
    // top-k take the graph's best ids (and logits) instead (ids_needed). A request that reads its
    // logits (reads_logits) has only its own rows read whole (Batch::logits_rows), so one such
    // request does not put its neighbours' rows on the host.
    int64_t argmax_k = 1;
    bool sampled = false, any_ids = false;
    std::vector<const Request*> reading;  // requests whose rows are read whole this step
    for (const Request* r : run) {
        const bool wants_logits =
            r->generating || r->n_prefilled + static_cast<int64_t>(span_of.at(r->id).n) == static_cast<int64_t>(r->prompt.size());
        if (!wants_logits) continue;
        if (reads_logits(*r)) {
            reading.push_back(r);
            continue;
        }
        any_ids = true;
        argmax_k = std::max(argmax_k, ids_needed(*r));
        sampled = sampled || r->params.temperature > 0.0;
    }
    batch.argmax_only = any_ids || reading.empty();
    // k in steps of 8: a few graph variants for any mix of top_k and bans (the built-graph cache
    // is small), and more ids than a row needs change nothing it takes from them.
    if (argmax_k > 1) argmax_k = std::min(n_vocab_, (argmax_k + 7) / 8 * 8);
    batch.argmax_k = batch.argmax_only ? argmax_k : 1;
    batch.argmax_values = batch.argmax_only && sampled;
    if (batch.argmax_values) ++n_candidate_steps_;
    if (batch.argmax_only && !reading.empty()) {
        batch.logits_rows.assign(batch.size(), 0);
        for (const Request* r : reading) {
            const Span& sp = span_of.at(r->id);
            std::fill_n(batch.logits_rows.begin() + static_cast<std::ptrdiff_t>(sp.row0), sp.n, 1);
        }
    }
    DecodeOutput out;
    {
        PhaseClock clock(phase_times_.target_s);
        const bool ahead = params_.decode_ahead && batch.argmax_only && batch.logits_rows.empty() && granted_ids.empty() &&
                           batch.size() == run.size() && batch.size() <= static_cast<size_t>(params_.n_batch) &&
                           std::all_of(run.begin(), run.end(), [this](const Request* r) { return may_decode_ahead(*r); });
        if (ahead) {
            // Sampled rows and rows with bans (more than one id a row): the graph draws their
            // tokens, which the step ahead is fed.
            batch.sample = batch.argmax_k > 1 || batch.argmax_values;
            if (batch.sample) {
                batch.argmax_values = true;
                for (const Request* r : run) batch.samplers.push_back(row_sampler(*r));
            }
            std::unique_ptr<PendingDecode> now = ctx_->launch(batch, layers_);
            try {
                launch_ahead(run, *now);
            } catch (...) {
                ctx_->collect(*now);  // nothing left in flight; the launch's error is the one raised
                throw;
            }
            out = ctx_->collect(*now);
        } else {
            out = ctx_->decode(batch, layers_);
        }
    }
    n_logit_rows_ += static_cast<int64_t>(out.logits.size() / static_cast<size_t>(n_vocab_));
    std::vector<int64_t> logits_row(batch.size(), -1);
    for (size_t i = 0; i < out.output_rows.size(); ++i) logits_row[static_cast<size_t>(out.output_rows[i])] = static_cast<int64_t>(i);

    std::vector<StepOutput> result;
    std::vector<std::pair<Request*, int32_t>> next_blocks;  // drafted together after verification
    std::vector<float> processed;
    for (Request* r : run) {
        const Span sp = span_of.at(r->id);
        StepOutput so;
        so.request_id = r->id;
        if (!r->generating) {
            if (r->drafting) commit_rows(*r, out, sp.row0, r->n_prefilled, sp.n);
            r->n_prefilled += static_cast<int64_t>(sp.n);
            so.n_prompt_processed = static_cast<int64_t>(sp.n);
            if (r->n_prefilled == static_cast<int64_t>(r->prompt.size())) {
                // The prompt's last row gave the first token's logits: the first token is drawn
                // as a round without drafts would draw it (same key, position of id_last), and
                // the request generates from there.
                r->generating = true;
                r->id_last = r->prompt.back();
                r->pos0 = r->n_prefilled - 1;
                const size_t last = sp.row0 + sp.n - 1;
                const VerifyResult vr = verify_rows(*r, out, logits_row[last], batch.argmax_only, processed);
                ++r->stats.n_rounds;  // a round without drafts: tokens = accepted drafts + rounds
                emit(*r, vr, out, logits_row[last], so);
                // Without a slot there is no block to verify next: draft one once a slot comes.
                if (r->drafting && !grant(r) && !so.finished) r->needs_draft = true;
            }
        } else {
            const int gamma = static_cast<int>(r->drafts.size());
            so.verified = r->drafts;
            const VerifyResult vr = verify_rows(*r, out, logits_row[sp.row0], batch.argmax_only, processed);
            const int tau = vr.accepted;
            RequestStats& st = r->stats;
            ++st.n_rounds;
            st.draft_n += gamma;
            st.draft_n_accepted += tau;
            if (st.drafted_at.size() < static_cast<size_t>(gamma)) {
                st.drafted_at.resize(static_cast<size_t>(gamma), 0);
                st.accepted_at.resize(static_cast<size_t>(gamma), 0);
            }
            for (int i = 0; i < gamma; ++i) {
                ++st.drafted_at[static_cast<size_t>(i)];
                if (i < tau) ++st.accepted_at[static_cast<size_t>(i)];
            }
            if (r->ngram_drafts) {
                ++st.ngram_rounds;
                st.ngram_draft_n += gamma;
                st.ngram_draft_n_accepted += tau;
            }
            // Keep id_last and the accepted drafts in the target; the rest never happened. The
            // drafter keeps no block rows, so only committed rows ever reach it.
            // (A row decoded ahead holds the cell after id_last: it is the next step's.)
            if (gamma > 0 || !in_ahead(r->id)) ctx_->kv().remove(r->seq, r->pos0 + tau + 1, -1);
            if (in_ahead(r->id)) check_fed_token(*r, out, static_cast<size_t>(logits_row[sp.row0]), vr);
            if (r->drafting) commit_rows(*r, out, sp.row0, r->pos0, static_cast<size_t>(tau) + 1);
            r->drafts.clear();
            r->q.clear();
            r->ngram_drafts = false;
            emit(*r, vr, out, logits_row[sp.row0], so);
        }
        if (!so.finished) {
            // The lookup goes first (llama-server's precedence); the drafter drafts when it finds
            // nothing. Either way the drafter takes in the committed rows.
            const bool looked_up = r->generating && propose_ngram(*r);
            if (SlotGrant* g = grant(r)) {
                stage(*r, *g);
                if (r->generating && r->drafting && !looked_up) next_blocks.emplace_back(r, g->slot);
            }
        }
        result.push_back(std::move(so));
    }
    draft(next_blocks);
    finish_step(result);
    return result;
}

void SpecEngine::finish_step(std::vector<StepOutput>& result) {
    for (StepOutput& so : result) {
        const Request& r = requests_.at(so.request_id);
        if (!so.finished) so.n_drafted = static_cast<int64_t>(r.drafts.size());
        so.stats = r.stats;
    }
    // A finished request's row in a step decoded ahead goes with its cells (release): the step
    // that collects it drops the row.
    for (const StepOutput& so : result) {
        if (so.finished) {
            auto it = requests_.find(so.request_id);
            release(it->second);
            requests_.erase(it);
        }
    }
}

SpecEngine::~SpecEngine() {
    if (!ahead_) return;
    try {
        ctx_->collect(*ahead_->pending);  // nothing may stay in flight past the context
    } catch (...) {
    }
}

}  // namespace pyspec
