#include "spec/draft_context.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "cpu/vec_math.h"
#include "runtime/philox.h"
#include "spec/verify.h"

namespace pyspec {

namespace {

// q = softmax(z) in double over the draft vocabulary, scattered to target ids through d2t
// (zeros elsewhere). z is the exact float vector the Gumbel noise perturbed.
// softmax(z) over a draft-vocabulary row into out[0..vd): the exponentials vectorised in float
// (vec::exp_shift_sum), each divided by their sum. A slot drafts every round, so its 8,192
// double exponentials were most of a sampled DSpark pass's host time.
void draft_softmax(const float* z, size_t vd, float* out) {
    float m = -std::numeric_limits<float>::infinity();
    for (size_t d = 0; d < vd; ++d) {
        if (!std::isfinite(z[d])) {
            throw std::invalid_argument("draft: logits / temperature is not finite at draft token " + std::to_string(d) +
                                        " (temperature too small?)");
        }
        m = std::max(m, z[d]);
    }
    std::copy(z, z + vd, out);
    const float sum = vec::exp_shift_sum(out, static_cast<int64_t>(vd), m);
    for (size_t d = 0; d < vd; ++d) out[d] /= sum;
}

// Rows of draft-vocabulary logits [n_rows, vd] as target-vocabulary rows [n_rows, v]: each
// value at its target id d2t[d], -inf elsewhere.
void scatter_draft_rows(const float* src, size_t n_rows, size_t vd, const std::vector<int32_t>& d2t, size_t v,
                        std::vector<float>& out) {
    out.assign(n_rows * v, -std::numeric_limits<float>::infinity());
    for (size_t r = 0; r < n_rows; ++r) {
        for (size_t d = 0; d < vd; ++d) out[r * v + static_cast<size_t>(d2t[d])] = src[r * vd + d];
    }
}

}  // namespace

DraftContext::DraftContext(const DraftModel& model, const DraftContextParams& params)
    : model_(model), params_(params) {
    const DraftHparams& hp = model_.hparams();
    if (params_.n_seq_max < 1) throw std::invalid_argument("n_seq_max must be at least 1");
    if (params_.n_batch < 1) throw std::invalid_argument("n_batch must be at least 1");
    if (params_.n_threads < 1) throw std::invalid_argument("n_threads must be at least 1");
    window_ = std::min(hp.n_ctx_train, params_.n_batch);
    if (window_ <= 2 * hp.block_size) {
        throw std::invalid_argument("drafter window " + std::to_string(window_) + " = min(drafter context_length " +
                                    std::to_string(hp.n_ctx_train) + ", n_batch " + std::to_string(params_.n_batch) +
                                    ") must be larger than 2 x block_size (" + std::to_string(2 * hp.block_size) +
                                    "): raise n_batch");
    }
    if (window_ > std::numeric_limits<int32_t>::max() / params_.n_seq_max) throw std::invalid_argument("drafter window too large");
    if (params_.n_candidates < 1 || params_.n_candidates > hp.n_vocab) {
        throw std::invalid_argument("n_candidates " + std::to_string(params_.n_candidates) + " must be in [1, n_vocab = " +
                                    std::to_string(hp.n_vocab) + "]");
    }
    if (hp.n_vocab > std::numeric_limits<int32_t>::max() / (hp.block_size * params_.n_seq_max)) {
        throw std::invalid_argument("drafter vocabulary too large for the block's logits");
    }
    // Keep half the window on a rebase (so rebases are rare), but always leave room for a block
    // and the rows a verification commits.
    keep_ = std::min(window_ / 2, window_ - 2 * hp.block_size);
    backend_ = make_backend(params_.backend, params_.n_threads, params_.check_plans, params_.n_seq_max);
    // The element of each draft id in the draft noise (GUMBEL): its target id.
    noise_elements_.resize(static_cast<size_t>(hp.n_vocab_draft));
    for (size_t d = 0; d < noise_elements_.size(); ++d) {
        noise_elements_[d] = model_.d2t.empty() ? static_cast<int32_t>(d) : model_.d2t[d];
    }
    kv_ = std::make_unique<KvCache>(*backend_, model_.cache_hparams(), params_.n_seq_max, window_, params_.kv_dtype);
    planner_.set_checking(params_.check_plans);
    pos_base_.assign(static_cast<size_t>(params_.n_seq_max), 0);
}

void DraftContext::check_seq(int32_t seq) const {
    if (seq < 0 || seq >= params_.n_seq_max) {
        throw std::invalid_argument("seq_id " + std::to_string(seq) + " out of range [0, " + std::to_string(params_.n_seq_max) + ")");
    }
}

int64_t DraftContext::pos_base(int32_t seq) const {
    check_seq(seq);
    return pos_base_[static_cast<size_t>(seq)];
}

int64_t DraftContext::pos_max(int32_t seq) const {
    check_seq(seq);
    const int64_t m = kv_->pos_max(seq);
    return m < 0 ? -1 : m + pos_base_[static_cast<size_t>(seq)];
}

int64_t DraftContext::pos_min(int32_t seq) const {
    check_seq(seq);
    for (int64_t p = 0; p < window_; ++p) {
        if (kv_->occupied(seq, static_cast<int32_t>(p))) return p + pos_base_[static_cast<size_t>(seq)];
    }
    return -1;
}

int64_t DraftContext::n_rows(int32_t seq) const {
    check_seq(seq);
    int64_t n = 0;
    for (int64_t p = 0; p < window_; ++p) n += kv_->occupied(seq, static_cast<int32_t>(p)) ? 1 : 0;
    return n;
}

void DraftContext::make_room(int32_t seq, int64_t first, int64_t end) {
    int64_t& base = pos_base_[static_cast<size_t>(seq)];
    const bool empty = kv_->pos_max(seq) < 0;
    if (first >= base && end - base <= window_) return;
    const int64_t new_base = std::max<int64_t>(0, std::max(first - keep_, end - window_));
    if (empty) {
        base = new_base;
        return;
    }
    if (first < base) {
        throw std::invalid_argument("position " + std::to_string(first) + " precedes the drafter window of sequence " +
                                    std::to_string(seq) + " (it starts at " + std::to_string(base) + ")");
    }
    shift(seq, new_base - base);
}

void DraftContext::shift(int32_t seq, int64_t delta) {
    std::vector<int32_t> src, dst, rotate;
    for (int64_t p = delta; p < window_; ++p) {
        if (!kv_->occupied(seq, static_cast<int32_t>(p))) continue;
        src.push_back(static_cast<int32_t>(kv_->cell(seq, static_cast<int32_t>(p))));
        dst.push_back(static_cast<int32_t>(kv_->cell(seq, static_cast<int32_t>(p - delta))));
        rotate.push_back(static_cast<int32_t>(-delta));
    }
    if (!src.empty()) {
        const int64_t n = static_cast<int64_t>(src.size());
        DraftShiftGraph& sg = prepared(shift_graphs_, n, [&] { return build_dflash_shift_graph(model_, kv_->view(), n); });
        const size_t bytes = src.size() * sizeof(int32_t);
        backend_->write(sg.graph[sg.src], src.data(), bytes);
        backend_->write(sg.graph[sg.dst], dst.data(), bytes);
        backend_->write(sg.graph[sg.rotate], rotate.data(), bytes);
        backend_->compute(sg.graph);
    }
    kv_->clear(seq);
    for (int32_t c : dst) kv_->occupy(seq, static_cast<int32_t>(c - kv_->cell(seq, 0)));
    pos_base_[static_cast<size_t>(seq)] += delta;
}

void DraftContext::inject(int32_t seq, const std::vector<int32_t>& positions, const float* features, size_t n_rows) {
    check_seq(seq);
    if (positions.size() != n_rows) throw std::invalid_argument("inject: one position per feature row is required");
    if (n_rows == 0) return;
    for (size_t i = 0; i < n_rows; ++i) {
        if (positions[i] < 0) throw std::invalid_argument("inject: negative position " + std::to_string(positions[i]));
        if (i > 0 && positions[i] <= positions[i - 1]) throw std::invalid_argument("inject: positions must be strictly increasing");
    }
    const size_t width = model_.hparams().target_layers.size() * static_cast<size_t>(model_.hparams().n_embd);
    // A row older than the window's reach at the last position can never be attended to.
    size_t i = 0;
    while (positions[i] <= static_cast<int64_t>(positions.back()) - window_) ++i;
    const int64_t chunk_span = window_ - keep_;
    while (i < n_rows) {
        size_t j = i;
        while (j < n_rows && positions[j] - positions[i] < chunk_span) ++j;
        make_room(seq, positions[i], static_cast<int64_t>(positions[j - 1]) + 1);
        const int64_t n = static_cast<int64_t>(j - i);
        const int64_t base = pos_base_[static_cast<size_t>(seq)];
        std::vector<int32_t> pos(static_cast<size_t>(n)), cells(static_cast<size_t>(n));
        for (int64_t r = 0; r < n; ++r) {
            pos[static_cast<size_t>(r)] = static_cast<int32_t>(positions[i + static_cast<size_t>(r)] - base);
            cells[static_cast<size_t>(r)] = static_cast<int32_t>(kv_->cell(seq, pos[static_cast<size_t>(r)]));
        }
        DraftInjectGraph& ig = prepared(inject_graphs_, n, [&] { return build_dflash_inject_graph(model_, kv_->view(), n); });
        backend_->write(ig.graph[ig.features], features + i * width, static_cast<size_t>(n) * width * sizeof(float));
        backend_->write(ig.graph[ig.positions], pos.data(), pos.size() * sizeof(int32_t));
        backend_->write(ig.graph[ig.kv_cells], cells.data(), cells.size() * sizeof(int32_t));
        backend_->compute(ig.graph);
        for (int32_t p : pos) kv_->occupy(seq, p);
        max_pos_written_ = std::max<int64_t>(max_pos_written_, pos.back());
        i = j;
    }
}

DraftOutput DraftContext::draft(int32_t seq, int32_t id_last, int32_t pos0, int64_t n_block, int64_t n_out,
                                const DraftSampling& sampling) {
    return std::move(draft_many({DraftRequest{seq, id_last, pos0, sampling}}, n_block, n_out).front());
}

std::vector<DraftOutput> DraftContext::draft_many(const std::vector<DraftRequest>& requests, int64_t n_block,
                                                  int64_t n_out, bool with_logits, bool with_chains) {
    const DraftHparams& hp = model_.hparams();
    if (requests.empty()) return {};
    if (!with_chains && !hp.is_dspark) throw std::invalid_argument("draft: a DFlash pass drafts through its sampling chains");
    if (n_block < 1 || n_block > hp.block_size) {
        throw std::invalid_argument("draft: n_block " + std::to_string(n_block) + " must be in [1, block_size = " +
                                    std::to_string(hp.block_size) + "]");
    }
    if (n_out < 0) n_out = n_block;
    if (n_out < 1 || n_out > n_block) {
        throw std::invalid_argument("draft: n_out " + std::to_string(n_out) + " must be in [1, n_block = " +
                                    std::to_string(n_block) + "]");
    }
    // Check every request before anything changes.
    std::vector<char> seen(static_cast<size_t>(params_.n_seq_max), 0);
    for (const DraftRequest& r : requests) {
        check_seq(r.seq);
        if (seen[static_cast<size_t>(r.seq)]) {
            throw std::invalid_argument("draft: sequence " + std::to_string(r.seq) + " appears twice in one batch");
        }
        seen[static_cast<size_t>(r.seq)] = 1;
        const float temp = r.sampling.temperature;
        if (!std::isfinite(temp) || temp < 0.0f) {
            throw std::invalid_argument("draft: temperature must be finite and >= 0, got " + std::to_string(temp));
        }
        if (r.id_last < 0 || r.id_last >= hp.n_vocab) {
            throw std::invalid_argument("draft: id_last " + std::to_string(r.id_last) + " out of range [0, " +
                                        std::to_string(hp.n_vocab) + ")");
        }
        if (r.pos0 < 0) throw std::invalid_argument("draft: negative pos0");
        if (pos_max(r.seq) >= r.pos0) {
            throw std::invalid_argument("draft: sequence " + std::to_string(r.seq) + " holds context at position " +
                                        std::to_string(pos_max(r.seq)) + " >= pos0 " + std::to_string(r.pos0) +
                                        "; remove it first");
        }
    }
    const int64_t n_blocks = static_cast<int64_t>(requests.size());
    const size_t nb = requests.size(), blk = static_cast<size_t>(n_block), nout = static_cast<size_t>(n_out);
    const size_t n_rows = nb * blk, n_kept = nb * nout;
    // The graph's row of block b's slot i: output slots first (see build_dflash_block_graph).
    const auto row_of = [&](size_t b, size_t i) {
        return i < nout ? b * nout + i : n_kept + b * (blk - nout) + (i - nout);
    };

    // Every block row sees its own sequence's context below the block and (non-causal) its whole
    // block, or (causal) the block up to itself. The noise rows are written to their cells by the
    // graph but never marked occupied, so they are gone from the sequence when this returns.
    const int64_t span = window_;
    std::vector<int32_t> tokens(n_rows, hp.mask_token_id), pos(n_rows), cells(n_rows), base(n_rows), anchors;
    std::vector<float> mask(n_rows * static_cast<size_t>(span), -std::numeric_limits<float>::infinity());
    for (size_t b = 0; b < nb; ++b) {
        const DraftRequest& r = requests[b];
        make_room(r.seq, r.pos0, static_cast<int64_t>(r.pos0) + n_block);
        const int32_t p0 = static_cast<int32_t>(r.pos0 - pos_base_[static_cast<size_t>(r.seq)]);
        max_pos_written_ = std::max<int64_t>(max_pos_written_, p0 + n_block - 1);
        tokens[row_of(b, 0)] = r.id_last;
        anchors.push_back(r.id_last);
        for (int64_t i = 0; i < n_block; ++i) {
            const size_t row = row_of(b, static_cast<size_t>(i));
            pos[row] = p0 + static_cast<int32_t>(i);
            cells[row] = static_cast<int32_t>(kv_->cell(r.seq, p0 + static_cast<int32_t>(i)));
            base[row] = static_cast<int32_t>(kv_->cell(r.seq, 0));
            float* m = mask.data() + row * static_cast<size_t>(span);
            for (int32_t j = 0; j < p0; ++j) {
                if (kv_->occupied(r.seq, j)) m[j] = 0.0f;
            }
            const int64_t last = hp.causal ? i : n_block - 1;
            for (int64_t j = 0; j <= last; ++j) m[p0 + j] = 0.0f;
        }
    }

    const int64_t n_chain = with_chains ? params_.n_seq_max * n_out : 0;
    DraftBlockGraph& bg = prepared(block_graphs_, std::make_tuple(n_blocks, n_block, n_out, span, n_chain, params_.n_candidates), [&] {
        return build_dflash_block_graph(model_, kv_->view(), n_blocks, n_block, n_out, span, n_chain, params_.n_candidates);
    });
    Graph& g = bg.graph;
    const size_t row_bytes = n_rows * sizeof(int32_t);
    backend_->write(g[bg.tokens], tokens.data(), row_bytes);
    backend_->write(g[bg.positions], pos.data(), row_bytes);
    backend_->write(g[bg.kv_cells], cells.data(), row_bytes);
    backend_->write(g[bg.kv_base], base.data(), row_bytes);
    backend_->write(g[bg.mask], mask.data(), mask.size() * sizeof(float));
    if (bg.anchors >= 0) backend_->write(g[bg.anchors], anchors.data(), anchors.size() * sizeof(int32_t));
    if (bg.markov_rows >= 0) {  // column k (Markov slot draft_offset + k): that slot's row of each block b
        std::vector<int32_t> rows;
        for (int64_t i = hp.draft_offset(); i < n_out; ++i) {
            for (size_t b = 0; b < nb; ++b) rows.push_back(static_cast<int32_t>(row_of(b, static_cast<size_t>(i))));
        }
        backend_->write(g[bg.markov_rows], rows.data(), rows.size() * sizeof(int32_t));
    }
    const size_t v = static_cast<size_t>(hp.n_vocab), vd = static_cast<size_t>(hp.n_vocab_draft);
    // Draft k of a request = the token at absolute position pos0 + 1 + k.
    const auto draft_key = [](const DraftRequest& r, int64_t k) {
        return NoiseKey{r.sampling.seed, r.sampling.offset, static_cast<uint32_t>(static_cast<int64_t>(r.pos0) + 1 + k),
                        NoiseStream::Draft};
    };
    if (bg.gumbel >= 0) {  // DSpark: each block's 1/T and the keys of its Markov slots' noise (off at T = 0)
        const size_t n_markov = static_cast<size_t>(std::max<int64_t>(0, n_out - hp.draft_offset()));
        std::vector<float> inv(nb * vd);
        std::vector<int32_t> keys(5 * n_markov * nb, 0);
        for (size_t b = 0; b < nb; ++b) {
            const float temp = requests[b].sampling.temperature;
            std::fill(inv.begin() + static_cast<std::ptrdiff_t>(b * vd), inv.begin() + static_cast<std::ptrdiff_t>((b + 1) * vd),
                      temp > 0.0f ? 1.0f / temp : 1.0f);
            if (temp <= 0.0f) continue;
            for (size_t k = 0; k < n_markov; ++k) {  // GUMBEL's key row k * nb + b
                const NoiseKey key = draft_key(requests[b], static_cast<int64_t>(k));
                int32_t* row = keys.data() + 5 * (k * nb + b);
                row[0] = static_cast<int32_t>(static_cast<uint32_t>(key.seed));
                row[1] = static_cast<int32_t>(static_cast<uint32_t>(key.seed >> 32));
                row[2] = static_cast<int32_t>(key.offset);
                row[3] = static_cast<int32_t>(key.position);
                row[4] = 1;
            }
        }
        backend_->write(g[bg.inv_temp], inv.data(), inv.size() * sizeof(float));
        backend_->write(g[bg.noise_keys], keys.data(), keys.size() * sizeof(int32_t));
        // The noise of the draft ids only: the target-vocabulary vector's entries at d2t.
        backend_->write(g[bg.noise_elements], noise_elements_.data(), noise_elements_.size() * sizeof(int32_t));
    }
    if (bg.fill >= 0) {
        const std::vector<float> fill(n_kept * v, -std::numeric_limits<float>::infinity());
        backend_->write(g[bg.fill], fill.data(), fill.size() * sizeof(float));
        std::vector<int32_t> ids(n_kept * vd);
        for (size_t r = 0; r < n_kept; ++r) {
            for (size_t d = 0; d < vd; ++d) ids[r * vd + d] = static_cast<int32_t>(r * v) + model_.d2t[d];
        }
        backend_->write(g[bg.scatter_ids], ids.data(), ids.size() * sizeof(int32_t));
    }
    // Chain s * n_out + i samples output slot i of sequence s's block; the chains of sequences not in
    // the batch are bound to row 0 (their outputs are computed and ignored; the topology stays
    // the same).
    if (n_chain > 0) {
        std::vector<int32_t> chain_rows(static_cast<size_t>(n_chain), 0);
        for (size_t b = 0; b < nb; ++b) {
            for (size_t i = 0; i < nout; ++i) {
                chain_rows[static_cast<size_t>(requests[b].seq) * nout + i] = static_cast<int32_t>(row_of(b, i));
            }
        }
        backend_->write(g[bg.chain_rows], chain_rows.data(), chain_rows.size() * sizeof(int32_t));
    }
    backend_->compute(g);

    // Everything the pass returns comes back in one read_many (one wait on a device backend):
    // DFlash draws T > 0 slots on the host from the logits, so it reads them whatever is asked;
    // DSpark's Markov z rows are read only where a block samples (T > 0).
    bool need_logits = with_logits;
    bool any_sampled = false;
    for (const DraftRequest& r : requests) {
        need_logits = need_logits || (!hp.is_dspark && r.sampling.temperature > 0.0f);
        any_sampled = any_sampled || r.sampling.temperature > 0.0f;
    }
    std::vector<Backend::ReadRequest> reads;
    auto read_into = [&](int t, void* dst, size_t bytes) { reads.push_back({&g[t], dst, bytes, 0}); };
    std::vector<float> all_logits, draft_rows;
    if (need_logits && bg.chain_draft_ids) {  // over draft ids: scattered below, -inf elsewhere
        draft_rows.resize(n_kept * vd);
        read_into(bg.final_logits, draft_rows.data(), draft_rows.size() * sizeof(float));
    } else if (need_logits) {
        all_logits.resize(n_kept * v);
        read_into(bg.final_logits, all_logits.data(), all_logits.size() * sizeof(float));
    }
    std::vector<float> base_d, conf_h;
    if (hp.is_dspark) {
        if (with_logits) {
            base_d.resize(n_kept * vd);
            read_into(bg.logits, base_d.data(), base_d.size() * sizeof(float));
        }
        if (hp.has_confidence_head) {
            conf_h.resize(n_kept);
            read_into(bg.conf_h, conf_h.data(), conf_h.size() * sizeof(float));
        }
    }
    const size_t k = static_cast<size_t>(bg.n_candidates);
    std::vector<DraftOutput> outs(nb);
    for (size_t b = 0; b < nb; ++b) {
        DraftOutput& out = outs[b];
        out.tokens.assign(nout, -1);
        if (n_chain == 0) continue;
        out.candidates.resize(nout * k);
        out.candidate_logits.resize(nout * k);
        out.candidate_probs.resize(nout * k);
        for (size_t i = 0; i < nout; ++i) {
            const size_t j = static_cast<size_t>(requests[b].seq) * nout + i;
            read_into(bg.chain_sampled[j], &out.tokens[i], sizeof(int32_t));
            read_into(bg.chain_candidates[j], out.candidates.data() + i * k, k * sizeof(int32_t));
            read_into(bg.chain_logits[j], out.candidate_logits.data() + i * k, k * sizeof(float));
            read_into(bg.chain_probs[j], out.candidate_probs.data() + i * k, k * sizeof(float));
        }
    }
    const size_t n_markov = bg.markov_tokens.size();
    std::vector<int32_t> markov_ids(n_markov * nb);
    std::vector<float> markov_z(any_sampled ? n_markov * nb * vd : 0), conf_e(n_markov * nb);
    for (size_t kk = 0; kk < n_markov; ++kk) {
        read_into(bg.markov_tokens[kk], markov_ids.data() + kk * nb, nb * sizeof(int32_t));
        if (any_sampled) read_into(bg.markov_z[kk], markov_z.data() + kk * nb * vd, nb * vd * sizeof(float));
        if (hp.has_confidence_head) read_into(bg.conf_e[kk], conf_e.data() + kk * nb, nb * sizeof(float));
    }
    backend_->read_many(reads);
    if (!draft_rows.empty()) scatter_draft_rows(draft_rows.data(), n_kept, vd, model_.d2t, v, all_logits);

    for (size_t b = 0; b < nb; ++b) {
        DraftOutput& out = outs[b];
        out.n_vocab = hp.n_vocab;
        out.n_block = n_out;  // the rows returned: the output slots
        if (need_logits) {
            out.logits.assign(all_logits.begin() + static_cast<std::ptrdiff_t>(b * nout * v),
                              all_logits.begin() + static_cast<std::ptrdiff_t>((b + 1) * nout * v));
        }
        out.n_candidates = n_chain > 0 ? bg.n_candidates : 0;
        if (bg.chain_draft_ids && n_chain > 0) {  // draft ids -> target ids
            for (int32_t& t : out.tokens) t = model_.d2t[static_cast<size_t>(t)];
            for (int32_t& c : out.candidates) c = model_.d2t[static_cast<size_t>(c)];
        }
        out.temperature = requests[b].sampling.temperature;
        if (out.temperature > 0.0f && !hp.is_dspark) {
            // DFlash: each slot's logits do not depend on earlier drafts, so independent
            // Gumbel-max draws per slot are already ancestral.
            out.q.assign(nout * v, 0.0f);
            for (size_t i = static_cast<size_t>(hp.draft_offset()); i < nout; ++i) {
                const int64_t kk = static_cast<int64_t>(i) - hp.draft_offset();
                const float* row = out.logits.data() + i * v;
                out.tokens[i] = gumbel_max(row, static_cast<int64_t>(v), out.temperature, draft_key(requests[b], kk));
                proposal_distribution(row, static_cast<int64_t>(v), out.temperature, out.q.data() + i * v);
            }
        }
        if (!hp.is_dspark) continue;
        // Backbone logits over the target vocabulary (scattered through d2t on the host).
        if (with_logits) {
            const float* bd = base_d.data() + b * nout * vd;
            if (model_.d2t.empty()) {
                out.base_logits.assign(bd, bd + nout * vd);
            } else {
                scatter_draft_rows(bd, nout, vd, model_.d2t, v, out.base_logits);
            }
        }
        if (out.temperature > 0.0f) {
            // Draft-vocabulary rows where d2t is ascending (verification looks them up); else
            // spread over the target vocabulary (vd == v without d2t).
            out.q_ids = !model_.d2t.empty() && model_.d2t_ascending ? &model_.d2t : nullptr;
            out.q.assign(nout * static_cast<size_t>(out.q_width()), 0.0f);
        }
        if (hp.has_confidence_head) out.confidence.assign(nout, std::numeric_limits<float>::quiet_NaN());
    }
    if (!hp.is_dspark) return outs;

    // DSpark, per Markov slot: the graph drew each block's slot (T > 0: its z is the exact vector
    // the noise perturbed) and computed its confidence term.
    for (size_t kk = 0; kk < n_markov; ++kk) {
        const size_t i = static_cast<size_t>(hp.draft_offset()) + kk;
        for (size_t b = 0; b < nb; ++b) {
            DraftOutput& out = outs[b];
            if (out.temperature > 0.0f || n_chain == 0) {  // T = 0 with chains: their ARGMAX, the same id
                const int32_t d = markov_ids[kk * nb + b];
                out.tokens[i] = model_.d2t.empty() ? d : model_.d2t[static_cast<size_t>(d)];
            }
            if (out.temperature > 0.0f) {
                const float* z = markov_z.data() + (kk * nb + b) * vd;
                const size_t w = static_cast<size_t>(out.q_width());
                if (out.q_ids || model_.d2t.empty()) {
                    draft_softmax(z, vd, out.q.data() + i * w);
                } else {
                    std::vector<float> law(vd);
                    draft_softmax(z, vd, law.data());
                    for (size_t d = 0; d < vd; ++d) out.q[i * w + static_cast<size_t>(model_.d2t[d])] = law[d];
                }
            }
            if (hp.has_confidence_head) {
                const double z = static_cast<double>(conf_h[b * nout + i]) + conf_e[kk * nb + b] + model_.conf_bias;
                out.confidence[i] = static_cast<float>(1.0 / (1.0 + std::exp(-z)));
            }
        }
    }
    return outs;
}

std::vector<float> DraftOutput::full_q() const {
    const int64_t w = q_width();
    return ProposalRows{q.data(), w ? static_cast<int64_t>(q.size()) / w : 0, n_vocab, w,
                        q_ids ? q_ids->data() : nullptr}
        .spread();
}

void DraftContext::remove(int32_t seq, int64_t p0, int64_t p1) {
    check_seq(seq);
    const int64_t base = pos_base_[static_cast<size_t>(seq)];
    const int64_t lo = std::max<int64_t>(0, p0 - base);
    const int64_t hi = p1 < 0 ? window_ : std::min(window_, p1 - base);
    if (hi > lo) kv_->remove(seq, lo, hi);
}

void DraftContext::set_profiling(bool on) { backend_->set_profiling(on); }

Backend::OpProfile DraftContext::op_profile() const { return backend_->op_profile(); }

void DraftContext::clear(int32_t seq) {
    if (seq >= 0) check_seq(seq);
    kv_->clear(seq);
    for (int64_t s = 0; s < params_.n_seq_max; ++s) {
        if (seq < 0 || s == seq) pos_base_[static_cast<size_t>(s)] = 0;
    }
}

ParkedDraftState DraftContext::park(int32_t seq) const {
    check_seq(seq);
    ParkedDraftState st;
    st.pos_base = pos_base_[static_cast<size_t>(seq)];
    for (int64_t p = 0; p < window_; ++p) {
        if (kv_->occupied(seq, static_cast<int32_t>(p))) st.positions.push_back(static_cast<int32_t>(p));
    }
    // The cache may be device memory: each matrix's span of the sequence's cells from the first
    // to the last occupied position is read through the backend in one copy, then the occupied
    // rows are picked out.
    const size_t rb = kv_->row_bytes(), n = st.positions.size();
    const int64_t n_layer = kv_->n_layer();
    st.cells.resize(static_cast<size_t>(n_layer) * 2 * n * rb);
    if (n == 0) return st;
    const int32_t lo = st.positions.front(), hi = st.positions.back();
    std::vector<uint8_t> span(static_cast<size_t>(hi - lo + 1) * rb);
    const size_t span_offset = static_cast<size_t>(kv_->cell(seq, lo)) * rb;
    uint8_t* out = st.cells.data();
    for (int64_t il = 0; il < n_layer; ++il) {
        for (bool is_v : {false, true}) {
            backend_->read(kv_->matrix(il, is_v), span.data(), span.size(), span_offset);
            for (int32_t p : st.positions) {
                std::memcpy(out, span.data() + static_cast<size_t>(p - lo) * rb, rb);
                out += rb;
            }
        }
    }
    return st;
}

void DraftContext::restore(int32_t seq, const ParkedDraftState& st) {
    check_seq(seq);
    const size_t rb = kv_->row_bytes(), n = st.positions.size();
    const int64_t n_layer = kv_->n_layer();
    if (st.cells.size() != static_cast<size_t>(n_layer) * 2 * n * rb || st.pos_base < 0) {
        throw std::invalid_argument("restore: the parked drafter state does not fit this draft context");
    }
    for (size_t i = 0; i < n; ++i) {
        if (st.positions[i] < 0 || st.positions[i] >= window_ || (i > 0 && st.positions[i] <= st.positions[i - 1])) {
            throw std::invalid_argument("restore: parked positions must be ascending and inside the window");
        }
    }
    kv_->clear(seq);
    // Runs of consecutive positions are written through the backend in one copy each (the
    // parked rows of a run are consecutive in st.cells too).
    const uint8_t* in = st.cells.data();
    for (int64_t il = 0; il < n_layer; ++il) {
        for (bool is_v : {false, true}) {
            const Tensor m = kv_->matrix(il, is_v);
            size_t i = 0;
            while (i < n) {
                size_t j = i + 1;
                while (j < n && st.positions[j] == st.positions[j - 1] + 1) ++j;
                backend_->write(m, in, (j - i) * rb, static_cast<size_t>(kv_->cell(seq, st.positions[i])) * rb);
                in += (j - i) * rb;
                i = j;
            }
        }
    }
    for (int32_t p : st.positions) kv_->occupy(seq, p);
    if (n > 0) max_pos_written_ = std::max<int64_t>(max_pos_written_, st.positions.back());
    pos_base_[static_cast<size_t>(seq)] = st.pos_base;
}

}  // namespace pyspec
