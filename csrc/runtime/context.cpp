#include "runtime/context.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>
#include <string>


namespace pyspec {
namespace {

// Attention spans are padded so consecutive decode steps share one graph shape (and so one
// cached allocation plan); padded columns are masked and cost nothing in the kernel.
constexpr int64_t kSpanPadding = 256;

}  // namespace

Context::Context(const Model& model, const ContextParams& params) : model_(model), params_(params) {
    if (params_.n_seq_max < 1) throw std::invalid_argument("n_seq_max must be at least 1");
    if (params_.n_ctx < params_.n_seq_max) throw std::invalid_argument("n_ctx must be at least n_seq_max");
    if (params_.n_batch < 1) throw std::invalid_argument("n_batch must be at least 1");
    if (params_.n_threads < 1) throw std::invalid_argument("n_threads must be at least 1");
    const int64_t n_ctx_seq = params_.n_ctx / params_.n_seq_max;
    if (n_ctx_seq > std::numeric_limits<int32_t>::max() / params_.n_seq_max) throw std::invalid_argument("n_ctx too large");
    backend_ = make_backend(params_.backend, params_.n_threads, params_.check_plans, params_.n_seq_max);
    kv_ = std::make_unique<KvCache>(*backend_, model_.hparams(), params_.n_seq_max, n_ctx_seq, params_.kv_dtype);
    planner_.set_checking(params_.check_plans);
}

void Context::set_profiling(bool on) { backend_->set_profiling(on); }

Backend::OpProfile Context::op_profile() const {
    return backend_->op_profile();
}

void Context::validate(const Batch& b, const std::vector<int>& layer_ids) const {
    const Hparams& hp = model_.hparams();
    const size_t n = b.size();
    if (n == 0) throw std::invalid_argument("empty batch");
    if (b.positions.size() != n || b.seq_ids.size() != n || b.output.size() != n ||
        (!b.prompt.empty() && b.prompt.size() != n) || (!b.logits_rows.empty() && b.logits_rows.size() != n)) {
        throw std::invalid_argument("batch arrays must all have one entry per token");
    }
    if (!b.logits_rows.empty() && !b.argmax_only) throw std::invalid_argument("logits_rows needs argmax_only");
    std::set<std::pair<int32_t, int32_t>> seen;
    for (size_t i = 0; i < n; ++i) {
        const std::string row = "batch row " + std::to_string(i) + ": ";
        if (b.tokens[i] < 0 || b.tokens[i] >= hp.n_vocab) {
            throw std::invalid_argument(row + "token id " + std::to_string(b.tokens[i]) + " out of range [0, " +
                                        std::to_string(hp.n_vocab) + ")");
        }
        if (b.seq_ids[i] < 0 || b.seq_ids[i] >= params_.n_seq_max) {
            throw std::invalid_argument(row + "seq_id " + std::to_string(b.seq_ids[i]) + " out of range [0, " +
                                        std::to_string(params_.n_seq_max) + ")");
        }
        if (b.positions[i] < 0 || b.positions[i] >= kv_->n_ctx_seq()) {
            throw std::invalid_argument(row + "position " + std::to_string(b.positions[i]) +
                                        " is outside the context of a sequence (n_ctx / n_seq_max = " +
                                        std::to_string(kv_->n_ctx_seq()) + ")");
        }
        if (!seen.insert({b.seq_ids[i], b.positions[i]}).second) {
            throw std::invalid_argument(row + "position " + std::to_string(b.positions[i]) + " of sequence " +
                                        std::to_string(b.seq_ids[i]) + " appears twice in the batch");
        }
    }
    // A batch larger than n_batch runs as consecutive chunks; a row can only attend to rows of
    // earlier chunks, so each sequence's positions must then increase in row order.
    if (n > static_cast<size_t>(params_.n_batch)) {
        std::map<int32_t, int32_t> last_pos;
        for (size_t i = 0; i < n; ++i) {
            auto it = last_pos.find(b.seq_ids[i]);
            if (it != last_pos.end() && b.positions[i] <= it->second) {
                throw std::invalid_argument("batch row " + std::to_string(i) + ": a batch larger than n_batch (" +
                                            std::to_string(params_.n_batch) +
                                            ") must give each sequence's positions in increasing order");
            }
            last_pos[b.seq_ids[i]] = b.positions[i];
        }
    }
    for (int l : layer_ids) {
        if (l < 0 || l > hp.n_layer) {
            throw std::invalid_argument("layer input " + std::to_string(l) + " out of range [0, " +
                                        std::to_string(hp.n_layer) + "]");
        }
    }
}

DecodeOutput Context::decode(const Batch& batch, const std::vector<int>& layer_ids_in) {
    std::vector<int> layer_ids = sorted_layers(layer_ids_in);
    validate(batch, layer_ids);
    DecodeOutput out = empty_output(layer_ids);
    const size_t n_batch = static_cast<size_t>(params_.n_batch);
    for (size_t begin = 0; begin < batch.size(); begin += n_batch) {
        PendingDecode p;
        p.out = &out;
        launch_chunk(batch, begin, std::min(batch.size(), begin + n_batch), layer_ids, p, nullptr);
        finish(p);
    }
    return out;
}

std::unique_ptr<PendingDecode> Context::launch(const Batch& batch, const std::vector<int>& layer_ids_in,
                                               const PendingDecode* feed) {
    std::vector<int> layer_ids = sorted_layers(layer_ids_in);
    validate(batch, layer_ids);
    if (batch.size() > static_cast<size_t>(params_.n_batch)) {
        throw std::invalid_argument("launch: a batch of at most n_batch rows (" + std::to_string(params_.n_batch) + ")");
    }
    if (feed) {
        // The feeding decode gives one token a row: its ARGMAX, or its SAMPLE draws.
        const bool one_token = feed->params.argmax && (feed->params.argmax_k == 1 || feed->params.sample);
        const bool rows_match = feed->order.size() == batch.size() && feed->out_rows.size() == batch.size() &&
                                batch.argmax_only && one_token && !feed->collected;
        bool all_output = true;
        for (size_t i = 0; i < batch.size(); ++i) {
            all_output = all_output && batch.output[i] && (batch.prompt.empty() || !batch.prompt[i]) && feed->order[i] == i;
        }
        if (!rows_match || !all_output) throw std::invalid_argument("launch: the fed batch must match the feeding one row for row");
    }
    auto p = std::make_unique<PendingDecode>();
    p->own = empty_output(layer_ids);
    p->out = &p->own;
    if (!launch_chunk(batch, 0, batch.size(), layer_ids, *p, feed)) return nullptr;
    return p;
}

DecodeOutput Context::collect(PendingDecode& p) {
    if (p.collected) throw std::logic_error("collect: this decode was collected already");
    finish(p);
    return std::move(p.own);
}

std::vector<int> Context::sorted_layers(const std::vector<int>& layer_ids) {
    std::vector<int> out = layer_ids;
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
}

DecodeOutput Context::empty_output(const std::vector<int>& layer_ids) const {
    DecodeOutput out;
    out.n_vocab = model_.hparams().n_vocab;
    out.n_embd = model_.hparams().n_embd;
    for (int l : layer_ids) out.layer_inputs.emplace_back(l, std::vector<float>());
    return out;
}

namespace {

// SAMPLE's words of one row (core/graph.h SamplerWords): the doubles' IEEE bits, low word first.
void sampler_words(const RowSampler& rs, uint32_t offset, uint32_t* w) {
    const auto put = [w](int at, double d) {
        uint64_t bits;
        std::memcpy(&bits, &d, sizeof bits);
        w[at] = static_cast<uint32_t>(bits);
        w[at + 1] = static_cast<uint32_t>(bits >> 32);
    };
    put(SamplerWords::kTemperature, rs.temperature);
    put(SamplerWords::kTopP, rs.top_p);
    put(SamplerWords::kMinP, rs.min_p);
    w[SamplerWords::kTopK] = static_cast<uint32_t>(rs.top_k);
    w[SamplerWords::kSeedLo] = static_cast<uint32_t>(rs.seed);
    w[SamplerWords::kSeedHi] = static_cast<uint32_t>(rs.seed >> 32);
    w[SamplerWords::kOffset] = offset;
}

}  // namespace

bool Context::launch_chunk(const Batch& b, size_t begin, size_t end, const std::vector<int>& layer_ids,
                           PendingDecode& p, const PendingDecode* feed) {
    DecodeOutput& out = *p.out;
    const int64_t n_rows = static_cast<int64_t>(end - begin);
    // The graph takes the prompt rows first, then the output rows, each kind in batch order:
    // MUL_MAT's prompt columns must be its first columns. The rows with logits are the prompt rows
    // that want them, then the output rows (the head's prompt columns first too). A row's result
    // does not depend on its place in the batch (invariant 7), so only the results that come back
    // per row are put back in batch order.
    auto is_prompt = [&b](size_t i) { return b.prompt.empty() ? !b.output[i] : b.prompt[i] != 0; };
    std::vector<size_t>& order = p.order;  // graph row -> batch row
    order.reserve(static_cast<size_t>(n_rows));
    std::vector<int32_t>& out_rows = p.out_rows;  // graph rows with logits
    int64_t max_pos = 0;
    for (size_t i = begin; i < end; ++i) {
        if (!is_prompt(i)) continue;
        if (b.output[i]) out_rows.push_back(static_cast<int32_t>(order.size()));
        order.push_back(i);
    }
    const int64_t n_prompt = static_cast<int64_t>(order.size());
    const int64_t n_prompt_outputs = static_cast<int64_t>(out_rows.size());
    for (size_t i = begin; i < end; ++i) {
        max_pos = std::max<int64_t>(max_pos, b.positions[i]);
        if (is_prompt(i)) continue;
        if (b.output[i]) out_rows.push_back(static_cast<int32_t>(order.size()));
        order.push_back(i);
    }
    // Logits rows come back in graph order; batch order differs only when an output row precedes
    // a prompt row with logits.
    {
        std::vector<size_t> by_batch(out_rows.size());
        for (size_t j = 0; j < out_rows.size(); ++j) by_batch[j] = j;
        std::sort(by_batch.begin(), by_batch.end(), [&](size_t x, size_t y) {
            return order[static_cast<size_t>(out_rows[x])] < order[static_cast<size_t>(out_rows[y])];
        });
        bool sorted = true;
        for (size_t j = 0; j < by_batch.size(); ++j) sorted = sorted && by_batch[j] == j;
        if (!sorted) {
            p.logits_order.resize(by_batch.size());
            for (size_t rank = 0; rank < by_batch.size(); ++rank) p.logits_order[by_batch[rank]] = rank;
        }
    }
    p.begin = begin;
    p.reordered = n_prompt > 0 && n_prompt < n_rows;
    DecoderGraphParams& gp = p.params;
    gp.n_rows = n_rows;
    gp.n_outputs = static_cast<int64_t>(out_rows.size());
    gp.n_prompt_rows = backend_->prompt_rows_have_own_path() ? n_prompt : 0;
    gp.n_prompt_outputs = gp.n_prompt_rows > 0 ? n_prompt_outputs : 0;
    gp.span = std::min(kv_->n_ctx_seq(), (max_pos + kSpanPadding) / kSpanPadding * kSpanPadding);
    gp.layer_ids = layer_ids;
    gp.argmax = b.argmax_only;
    gp.argmax_k = b.argmax_only ? std::max<int64_t>(1, b.argmax_k) : 1;
    gp.argmax_values = b.argmax_only && b.argmax_values;
    gp.sample = gp.argmax_values && b.sample;
    if (gp.sample && b.samplers.size() != b.size()) throw std::invalid_argument("launch: a sampled batch needs a sampler a row");
    gp.argmax_logits = b.argmax_only && !b.logits_rows.empty() &&
                       std::any_of(b.logits_rows.begin() + static_cast<std::ptrdiff_t>(begin),
                                   b.logits_rows.begin() + static_cast<std::ptrdiff_t>(end), [](uint8_t f) { return f != 0; });
    out.argmax_k = gp.argmax_k;
    // A fed batch reads the feeding decode's ARGMAX output where that graph left it: only the
    // same graph (the same build parameters) is certain to have left it there untouched.
    // (Checking plans builds every graph afresh and poisons the arena: no feed survives that.)
    if (feed && (planner_.checking() || !(feed->params == gp))) return false;

    // Rows see their own sequence's cells up to their position, including the rows of this
    // chunk (their K/V are written before attention runs).
    for (size_t i = begin; i < end; ++i) {
        if (!kv_->occupied(b.seq_ids[i], b.positions[i])) p.newly_occupied.emplace_back(b.seq_ids[i], b.positions[i]);
        kv_->occupy(b.seq_ids[i], b.positions[i]);
    }
    try {
        std::vector<int32_t> tokens(static_cast<size_t>(n_rows)), positions(static_cast<size_t>(n_rows));
        std::vector<int32_t> kv_cells(static_cast<size_t>(n_rows)), kv_base(static_cast<size_t>(n_rows));
        std::vector<float> mask(static_cast<size_t>(n_rows * gp.span), -std::numeric_limits<float>::infinity());
        for (int64_t r = 0; r < n_rows; ++r) {
            const size_t i = order[static_cast<size_t>(r)];
            const int32_t s = b.seq_ids[i];
            const int32_t pos = b.positions[i];
            tokens[static_cast<size_t>(r)] = b.tokens[i];
            positions[static_cast<size_t>(r)] = pos;
            kv_cells[static_cast<size_t>(r)] = static_cast<int32_t>(kv_->cell(s, pos));
            kv_base[static_cast<size_t>(r)] = static_cast<int32_t>(kv_->cell(s, 0));
            float* m = mask.data() + r * gp.span;
            for (int32_t j = 0; j <= pos; ++j) {
                if (kv_->occupied(s, j)) m[j] = 0.0f;
            }
        }

        auto& built = graphs_.get(gp, planner_, [&] { return build_decoder_graph(model_, kv_->view(), gp); });
        DecoderGraph& dg = built.built;
        p.graph = &dg;
        Graph& g = dg.graph;
        backend_->apply_plan(g, *built.plan);  // every time: another graph may have grown the arena
        const size_t row_bytes = static_cast<size_t>(n_rows) * sizeof(int32_t);
        if (feed) {
            // The feeding decode's ids, in its graph's ARGMAX output (the same graph: same
            // tensor), become this one's tokens: a device copy ordered after that decode.
            if (feed->graph != &dg) throw std::logic_error("launch: the feeding decode's graph is gone");
            backend_->copy(g[dg.in.tokens], g[gp.sample ? dg.sampled : dg.argmax], row_bytes);
        } else {
            backend_->write(g[dg.in.tokens], tokens.data(), row_bytes);
        }
        backend_->write(g[dg.in.positions], positions.data(), row_bytes);
        backend_->write(g[dg.in.kv_cells], kv_cells.data(), row_bytes);
        backend_->write(g[dg.in.kv_base], kv_base.data(), row_bytes);
        backend_->write(g[dg.in.mask], mask.data(), mask.size() * sizeof(float));
        if (dg.in.out_rows >= 0) backend_->write(g[dg.in.out_rows], out_rows.data(), out_rows.size() * sizeof(int32_t));
        if (dg.in.samplers >= 0) {
            std::vector<uint32_t> words(out_rows.size() * kSamplerWords, 0);
            for (size_t j = 0; j < out_rows.size(); ++j) {
                const size_t i = order[static_cast<size_t>(out_rows[j])];
                sampler_words(b.samplers[i], static_cast<uint32_t>(b.positions[i]), words.data() + j * kSamplerWords);
            }
            backend_->write(g[dg.in.samplers], words.data(), words.size() * sizeof(uint32_t));
            std::vector<int32_t> bans(out_rows.size() * kSampleBans, -1);
            for (size_t j = 0; j < out_rows.size(); ++j) {
                const std::vector<int32_t>& rb = b.samplers[order[static_cast<size_t>(out_rows[j])]].bans;
                if (rb.size() > static_cast<size_t>(kSampleBans)) {
                    throw std::invalid_argument("launch: a sampled row bans at most " + std::to_string(kSampleBans) + " ids");
                }
                std::copy(rb.begin(), rb.end(), bans.begin() + static_cast<std::ptrdiff_t>(j * kSampleBans));
            }
            backend_->write(g[dg.in.sample_bans], bans.data(), bans.size() * sizeof(int32_t));
        }
        backend_->compute(g);

        // The step's outputs come back in one read (one wait on a device backend, at collect).
        std::vector<Backend::ReadRequest> reads;
        // The logits (or ARGMAX) rows are read in graph order and put in batch order after it.
        const size_t old_rows = out.output_rows.size();
        if (dg.argmax >= 0) {
            const size_t k = static_cast<size_t>(gp.argmax_k);
            const size_t old = out.argmax.size();
            out.argmax.resize(old + out_rows.size() * k);
            reads.push_back({&g[dg.argmax], out.argmax.data() + old, out_rows.size() * k * sizeof(int32_t), 0});
            p.permutes.push_back({out.argmax.data() + old, k * sizeof(int32_t)});
            if (dg.argmax_values >= 0) {
                const size_t old_v = out.argmax_values.size();
                out.argmax_values.resize(old_v + out_rows.size() * k);
                reads.push_back({&g[dg.argmax_values], out.argmax_values.data() + old_v,
                                 out_rows.size() * k * sizeof(float), 0});
                p.permutes.push_back({out.argmax_values.data() + old_v, k * sizeof(float)});
            }
            if (dg.sampled >= 0) {
                const size_t old_s = out.sampled.size();
                out.sampled.resize(old_s + out_rows.size());
                reads.push_back({&g[dg.sampled], out.sampled.data() + old_s, out_rows.size() * sizeof(int32_t), 0});
                p.permutes.push_back({out.sampled.data() + old_s, sizeof(int32_t)});
            }
            // Rows whose logits are read too, each straight into its slot in batch order.
            const size_t lrow = static_cast<size_t>(out.n_vocab) * sizeof(float);
            if (!b.logits_rows.empty()) out.logits_slot.resize(old_rows + out_rows.size(), -1);
            if (gp.argmax_logits) {
                std::vector<size_t> wanted;  // graph logits rows, by batch rank
                for (size_t j = 0; j < out_rows.size(); ++j) {
                    const size_t batch_row = order[static_cast<size_t>(out_rows[j])];
                    if (b.logits_rows[batch_row]) wanted.push_back(j);
                }
                const auto rank = [&p](size_t j) { return p.logits_order.empty() ? j : p.logits_order[j]; };
                std::sort(wanted.begin(), wanted.end(), [&](size_t x, size_t y) { return rank(x) < rank(y); });
                const size_t first_slot = out.logits.size() / static_cast<size_t>(out.n_vocab);
                out.logits.resize(out.logits.size() + wanted.size() * static_cast<size_t>(out.n_vocab));
                for (size_t s = 0; s < wanted.size(); ++s) {
                    const size_t j = wanted[s];
                    out.logits_slot[old_rows + rank(j)] = static_cast<int32_t>(first_slot + s);
                    reads.push_back({&g[dg.logits], out.logits.data() + (first_slot + s) * static_cast<size_t>(out.n_vocab),
                                     lrow, j * lrow});
                }
            }
        } else if (dg.logits >= 0) {
            const size_t old = out.logits.size();
            const size_t lrow = static_cast<size_t>(out.n_vocab) * sizeof(float);
            out.logits.resize(old + out_rows.size() * static_cast<size_t>(out.n_vocab));
            reads.push_back({&g[dg.logits], out.logits.data() + old, out_rows.size() * lrow, 0});
            p.permutes.push_back({out.logits.data() + old, lrow});
        }
        if (dg.argmax >= 0 || dg.logits >= 0) {
            out.output_rows.resize(old_rows + out_rows.size());
            for (size_t j = 0; j < out_rows.size(); ++j) {
                const size_t rank = p.logits_order.empty() ? j : p.logits_order[j];
                out.output_rows[old_rows + rank] = static_cast<int32_t>(order[static_cast<size_t>(out_rows[j])]);
            }
        }
        // Layer inputs: straight into place, or (rows reordered) into a buffer put in place after.
        p.reorders.reserve(dg.layer_inputs.size());  // the read targets must not move
        const size_t n_embd = static_cast<size_t>(out.n_embd);
        const size_t count = static_cast<size_t>(n_rows) * n_embd;
        for (const auto& li : dg.layer_inputs) {
            auto it = std::find_if(out.layer_inputs.begin(), out.layer_inputs.end(),
                                   [&](const auto& e) { return e.first == li.first; });
            std::vector<float>& dst = it->second;
            const size_t old = dst.size();
            dst.resize(old + count);
            if (!p.reordered) {
                reads.push_back({&g[li.second], dst.data() + old, count * sizeof(float), 0});
                continue;
            }
            p.reorders.push_back({std::vector<float>(count), dst.data() + old});
            reads.push_back({&g[li.second], p.reorders.back().rows.data(), count * sizeof(float), 0});
        }
        p.ticket = backend_->read_many_async(reads);
    } catch (...) {
        for (const auto& sp : p.newly_occupied) kv_->remove(sp.first, sp.second, sp.second + 1);
        p.collected = true;
        throw;
    }
    return true;
}

void Context::finish(PendingDecode& p) {
    p.collected = true;
    try {
        backend_->finish_reads(p.ticket);
    } catch (...) {
        for (const auto& sp : p.newly_occupied) kv_->remove(sp.first, sp.second, sp.second + 1);
        throw;
    }
    for (const PendingDecode::Permute& pm : p.permutes) {
        if (p.logits_order.empty()) break;
        auto* base = static_cast<unsigned char*>(pm.base);
        const size_t n = p.out_rows.size();
        std::vector<unsigned char> rows(base, base + n * pm.row_bytes);
        for (size_t j = 0; j < n; ++j) {
            std::memcpy(base + p.logits_order[j] * pm.row_bytes, rows.data() + j * pm.row_bytes, pm.row_bytes);
        }
    }
    const size_t n_embd = static_cast<size_t>(p.out->n_embd);
    for (const PendingDecode::Reorder& ro : p.reorders) {
        for (size_t r = 0; r < p.order.size(); ++r) {
            std::copy_n(ro.rows.data() + r * n_embd, n_embd, ro.dst + (p.order[r] - p.begin) * n_embd);
        }
    }
}

}  // namespace pyspec
