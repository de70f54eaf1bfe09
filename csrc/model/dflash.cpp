// dflash drafters (DFlash, DSpark): loading and the three graph builders (see dflash.h).
//
// The DSpark Markov head runs in-graph: slot i's bias depends on the argmax of slot i-1's biased
// logits, so on the host it would cost one round trip per slot; in-graph it is a short chain of
// get_rows -> mul_mat -> add -> argmax nodes in the same pass (as llama.cpp does), and a sampling
// chain can later replace the argmax by a draw without changing the shape of the pass. The
// confidence head is split into two dot products computed in-graph; the host adds them and the
// bias and applies the sigmoid (there is no concat or sigmoid op, and it is B scalars).
#include "model/dflash.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "cpu/quants.h"
#include "runtime/philox.h"

namespace pyspec {
namespace {

// Features llama.cpp's dflash graph has that this engine does not run; refused by name.
const char* const kUnsupportedKeys[][2] = {
    {"dflash.attention.sliding_window", "sliding-window attention"},
    {"dflash.hidden_activation", "a GELU activation"},
    {"dflash.attention.value_scale", "attention.value_scale"},
    {"dflash.hyper_connection_count", "the DeepSeek-V4 backbone"},
    {"dflash.selector_top_k", "DFlash2 (selector lattice)"},
};
const char* const kUnsupportedTensors[][2] = {
    {"selector_hidden.weight", "DFlash2 (selector lattice)"},
    {"fc.scale", "per-tensor scales"},
    {"rope_freqs.weight", "rope frequency factors"},
};
const char* const kUnsupportedLayerTensors[][2] = {
    {"attn_sinks.weight", "attention sinks"},
    {"attn_post_norm.weight", "post-attention norms"},
    {"ffn_post_norm.weight", "post-FFN norms"},
    {"layer_output_scale.weight", "per-layer output scales"},
    {"attn_conv_base.weight", "DFlash2 convolutions"},
};

}  // namespace

DraftModel::DraftModel(const std::string& path, std::shared_ptr<const Model> target)
    : target_(std::move(target)) {
    if (!target_) throw std::invalid_argument("DraftModel: no target model");
    file_ = std::make_unique<GgufFile>(path);
    load_hparams();
    load_weights();
}

Hparams DraftModel::cache_hparams() const {
    Hparams h;
    h.n_embd = hp_.n_embd;
    h.n_layer = hp_.n_layer;
    h.n_head = hp_.n_head;
    h.n_head_kv = hp_.n_head_kv;
    h.head_dim = hp_.head_dim;
    h.n_rot = hp_.n_rot;
    h.n_vocab = hp_.n_vocab;
    return h;
}

void DraftModel::load_hparams() {
    const GgufFile& f = *file_;
    const Hparams& th = target_->hparams();
    const std::string arch = f.get_string("general.architecture");
    if (arch != "dflash") {
        throw std::invalid_argument("drafter " + f.path() + " has architecture '" + arch + "', expected 'dflash'");
    }
    for (const auto& k : kUnsupportedKeys) {
        if (f.has(k[0])) throw std::invalid_argument("drafter " + f.path() + " uses " + k[1] + " (" + k[0] + "), which is not supported");
    }
    const std::string k = "dflash.";
    hp_.n_embd = f.get_int(k + "embedding_length");
    hp_.n_layer = f.get_int(k + "block_count");
    hp_.n_ff = f.get_int(k + "feed_forward_length");
    hp_.n_head = f.get_int(k + "attention.head_count");
    hp_.n_head_kv = f.get_int_or(k + "attention.head_count_kv", hp_.n_head);
    if (!f.has(k + "context_length")) {
        throw std::invalid_argument("drafter " + f.path() + " has no dflash.context_length (its trained context)");
    }
    hp_.n_ctx_train = f.get_int(k + "context_length");
    if (hp_.n_embd <= 0 || hp_.n_layer <= 0 || hp_.n_ff <= 0 || hp_.n_head <= 0 || hp_.n_head_kv <= 0 ||
        hp_.n_ctx_train <= 0) {
        throw std::invalid_argument("invalid hyperparameters in drafter " + f.path() +
                                    ": sizes, head counts and context_length must be positive");
    }
    if (hp_.n_head % hp_.n_head_kv != 0) {
        throw std::invalid_argument("drafter attention.head_count (" + std::to_string(hp_.n_head) +
                                    ") is not a multiple of attention.head_count_kv (" + std::to_string(hp_.n_head_kv) + ")");
    }
    hp_.head_dim = f.get_int_or(k + "attention.key_length", hp_.n_embd / hp_.n_head);
    if (f.get_int_or(k + "attention.value_length", hp_.head_dim) != hp_.head_dim) {
        throw std::invalid_argument("drafter attention.value_length != key_length is not supported");
    }
    hp_.n_rot = f.get_int_or(k + "rope.dimension_count", hp_.head_dim);
    if (hp_.head_dim <= 0 || hp_.n_rot <= 0 || hp_.n_rot > hp_.head_dim || hp_.n_rot % 2 != 0) {
        throw std::invalid_argument("drafter has invalid rope.dimension_count " + std::to_string(hp_.n_rot) +
                                    " for head size " + std::to_string(hp_.head_dim));
    }
    if (f.has(k + "rope.dimension_sections")) {
        // M-RoPE drafts use degenerate sections [n_rot/2, 0, 0, 0]: plain NEOX for text positions.
        const std::vector<int64_t> s = f.get_int_array(k + "rope.dimension_sections");
        for (size_t i = 1; i < s.size(); ++i) {
            if (s[i] != 0) throw std::invalid_argument("drafter M-RoPE sections other than [n_rot/2, 0, 0, 0] are not supported");
        }
    }
    read_rope_frequencies(f, k, hp_.rope_freq_base, hp_.rope_freq_scale);
    hp_.rms_eps = static_cast<float>(f.get_float_or(k + "attention.layer_norm_rms_epsilon", 1e-6));
    if (!(hp_.rms_eps > 0) || !std::isfinite(hp_.rms_eps)) throw std::invalid_argument("drafter has an invalid layer_norm_rms_epsilon");
    hp_.attn_scale = static_cast<float>(f.get_float_or(k + "attention.scale", 1.0 / std::sqrt(static_cast<double>(hp_.head_dim))));
    hp_.embedding_scale = static_cast<float>(f.get_float_or(k + "embedding_scale", 1.0));
    if (!std::isfinite(hp_.attn_scale) || !std::isfinite(hp_.embedding_scale)) {
        throw std::invalid_argument("drafter attention.scale / embedding_scale must be finite");
    }

    if (!f.has(k + "target_layers")) throw std::invalid_argument("drafter " + f.path() + " has no dflash.target_layers");
    const std::vector<int64_t> layers = f.get_int_array(k + "target_layers");
    if (layers.empty()) throw std::invalid_argument("drafter dflash.target_layers is empty");
    for (int64_t l : layers) {
        if (l < 0 || l > th.n_layer) {
            throw std::invalid_argument("drafter target layer " + std::to_string(l) + " is outside what the target exposes: "
                                        "layer inputs 0 (embeddings) to " + std::to_string(th.n_layer) +
                                        " (output of its last layer)");
        }
        hp_.target_layers.push_back(static_cast<int>(l));
    }
    if (hp_.n_embd != th.n_embd) {
        throw std::invalid_argument("drafter hidden size " + std::to_string(hp_.n_embd) + " != target hidden size " +
                                    std::to_string(th.n_embd) + ": the drafter reads the target's hidden states");
    }
    hp_.n_vocab = th.n_vocab;
    hp_.block_size = f.get_int_or(k + "block_size", 16);
    hp_.block_size_min = f.get_int_or("pyspec.drafter.block_size_min", 0);
    const int64_t mask = f.get_int("tokenizer.ggml.mask_token_id");
    if (mask < 0 || mask >= th.n_vocab) {
        throw std::invalid_argument("drafter mask_token_id " + std::to_string(mask) + " is outside the target vocabulary (" +
                                    std::to_string(th.n_vocab) + " tokens)");
    }
    hp_.mask_token_id = static_cast<int32_t>(mask);
    hp_.causal = f.get_bool_or(k + "attention.causal", false);
    hp_.sample_from_anchor = f.get_bool_or(k + "sample_from_anchor", true);
}

Weight DraftModel::require(const std::string& name, std::initializer_list<int64_t> ne, bool vector_f32) const {
    return load_weight(*file_, name, ne, vector_f32, "drafter ");
}

Weight DraftModel::optional(const std::string& name, std::initializer_list<int64_t> ne, bool vector_f32) const {
    return file_->find_tensor(name) ? require(name, ne, vector_f32) : Weight{};
}

void DraftModel::load_d2t() {
    const int64_t v = hp_.n_vocab;
    hp_.n_vocab_draft = v;
    const GgufTensorInfo* t = file_->find_tensor("d2t");
    if (!t) return;
    if (t->dtype != DType::I64 && t->dtype != DType::I32) {
        throw std::invalid_argument(std::string("drafter tensor d2t has type ") + dtype_name(t->dtype) + ", expected I64");
    }
    if (t->n_dims != 1 || t->ne[0] < 1 || t->ne[0] > v) {
        throw std::invalid_argument("drafter tensor d2t has shape " + format_shape(t->ne, static_cast<size_t>(t->n_dims)) +
                                    ", expected [Vd] with 1 <= Vd <= " + std::to_string(v) + " (the target vocabulary)");
    }
    if (!file_->find_tensor("output.weight")) {
        throw std::invalid_argument("drafter has d2t but no output.weight (the head over its draft vocabulary)");
    }
    const int64_t vd = t->ne[0];
    d2t.resize(static_cast<size_t>(vd));
    std::vector<bool> seen(static_cast<size_t>(v), false);
    for (int64_t d = 0; d < vd; ++d) {
        int64_t id;
        if (t->dtype == DType::I64) {
            std::memcpy(&id, t->data + d * 8, 8);
        } else {
            int32_t x;
            std::memcpy(&x, t->data + d * 4, 4);
            id = x;
        }
        if (id < 0 || id >= v) {
            throw std::invalid_argument("drafter d2t maps draft id " + std::to_string(d) + " to " + std::to_string(id) +
                                        ", outside the target vocabulary (" + std::to_string(v) + " tokens)");
        }
        if (seen[static_cast<size_t>(id)]) {
            throw std::invalid_argument("drafter d2t maps two draft ids to target id " + std::to_string(id));
        }
        seen[static_cast<size_t>(id)] = true;
        d2t[static_cast<size_t>(d)] = static_cast<int32_t>(id);
    }
    d2t_ascending = std::is_sorted(d2t.begin(), d2t.end());  // injective, so strictly increasing
    hp_.n_vocab_draft = vd;
}

void DraftModel::load_weights() {
    const GgufFile& f = *file_;
    load_d2t();
    for (const auto& t : kUnsupportedTensors) {
        if (f.find_tensor(t[0])) throw std::invalid_argument("drafter " + f.path() + " uses " + t[1] + " (" + t[0] + "), which is not supported");
    }
    const int64_t e = hp_.n_embd, hd = hp_.head_dim, v = hp_.n_vocab, vd = hp_.n_vocab_draft;
    const int64_t n_tl = static_cast<int64_t>(hp_.target_layers.size());
    fc = require("fc.weight", {n_tl * e, e});
    hidden_norm = require("enc.output_norm.weight", {e}, true);
    output_norm = require("output_norm.weight", {e}, true);

    // Embedding: the drafter's own, else the target's. Output: the drafter's own, else the
    // target's real head (reference §3.4: a drafter's token_embd is not a head for an untied target).
    owns_tok_embd = f.find_tensor("token_embd.weight") != nullptr;
    tok_embd = owns_tok_embd ? require("token_embd.weight", {e, v}) : target_->tok_embd;
    owns_output = f.find_tensor("output.weight") != nullptr;
    if (owns_output) {
        const GgufTensorInfo* t = f.find_tensor("output.weight");
        if (t->ne[1] != vd) {
            throw std::invalid_argument("drafter output.weight has " + std::to_string(t->ne[1]) + " rows but " +
                                        (d2t.empty() ? "the target vocabulary has " + std::to_string(v) + " tokens (and no d2t maps them)"
                                                     : "d2t maps " + std::to_string(vd) + " draft tokens"));
        }
        output = require("output.weight", {e, vd});
    } else {
        output = target_->output;
    }

    layers.resize(static_cast<size_t>(hp_.n_layer));
    for (int64_t il = 0; il < hp_.n_layer; ++il) {
        const std::string p = "blk." + std::to_string(il) + ".";
        for (const auto& t : kUnsupportedLayerTensors) {
            if (f.find_tensor(p + t[0])) throw std::invalid_argument("drafter " + f.path() + " uses " + t[1] + " (" + p + t[0] + "), which is not supported");
        }
        DraftLayerWeights& l = layers[static_cast<size_t>(il)];
        l.attn_norm = require(p + "attn_norm.weight", {e}, true);
        l.wq = require(p + "attn_q.weight", {e, hp_.n_head * hd});
        l.wk = require(p + "attn_k.weight", {e, hp_.n_head_kv * hd});
        if (!f.find_tensor(p + "attn_v.weight")) {
            throw std::invalid_argument("drafter " + f.path() + " has no " + p + "attn_v.weight: K=V sharing is not supported");
        }
        l.wv = require(p + "attn_v.weight", {e, hp_.n_head_kv * hd});
        l.wo = require(p + "attn_output.weight", {hp_.n_head * hd, e});
        l.q_norm = require(p + "attn_q_norm.weight", {hd}, true);
        l.k_norm = require(p + "attn_k_norm.weight", {hd}, true);
        l.ffn_norm = require(p + "ffn_norm.weight", {e}, true);
        l.ffn_gate = require(p + "ffn_gate.weight", {e, hp_.n_ff});
        l.ffn_up = require(p + "ffn_up.weight", {e, hp_.n_ff});
        l.ffn_down = require(p + "ffn_down.weight", {hp_.n_ff, e});
    }

    const GgufTensorInfo* w1 = f.find_tensor("markov_w1.weight");
    hp_.is_dspark = w1 != nullptr;
    if (hp_.is_dspark) {
        hp_.markov_rank = w1->ne[0];
        const int64_t r = hp_.markov_rank;
        if (r <= 0) throw std::invalid_argument("drafter markov_w1.weight has rank 0");
        markov_w1 = require("markov_w1.weight", {r, v});
        markov_w2 = require("markov_w2.weight", {r, vd});
        markov_w1_draft = markov_w1;
        if (!d2t.empty()) {
            if (markov_w1.ne[0] % dtype_block_size(markov_w1.dtype) != 0) {
                throw std::invalid_argument("drafter markov_w1.weight rank is not a whole number of blocks");
            }
            const size_t row = dtype_row_bytes(markov_w1.dtype, r);
            w1_draft_rows_.resize(row * d2t.size());
            for (size_t d = 0; d < d2t.size(); ++d) {
                std::memcpy(w1_draft_rows_.data() + d * row, static_cast<const uint8_t*>(markov_w1.data) + static_cast<size_t>(d2t[d]) * row, row);
            }
            markov_w1_draft.name = "markov_w1_draft";
            markov_w1_draft.ne = {r, vd, 1, 1};
            markov_w1_draft.data = w1_draft_rows_.data();
        }
        if (const Weight s = optional("markov_w2.scale", {1}, true); s.present()) {
            markov_w2_scale = *static_cast<const float*>(s.data);
        }
        const bool key = f.get_bool_or("dflash.has_confidence_head", true);
        const bool tensor = f.find_tensor("conf_proj.weight") != nullptr;
        if (key && tensor) {
            const Weight c = require("conf_proj.weight", {e + r, 1});
            std::vector<float> all(static_cast<size_t>(e + r));
            dequantize_row(c.dtype, c.data, all.data(), e + r);
            conf_w_h.assign(all.begin(), all.begin() + e);
            conf_w_e.assign(all.begin() + e, all.end());
            if (const Weight b = optional("conf_proj.bias", {1}, true); b.present()) conf_bias = *static_cast<const float*>(b.data);
            hp_.has_confidence_head = true;
        } else if (key && f.has("dflash.has_confidence_head")) {
            throw std::invalid_argument("drafter says dflash.has_confidence_head = true but has no conf_proj.weight");
        }
    } else if (f.find_tensor("markov_w2.weight") || f.find_tensor("conf_proj.weight")) {
        throw std::invalid_argument("drafter has DSpark head tensors (markov_w2 / conf_proj) but no markov_w1.weight");
    }
    if (hp_.block_size < 1 || hp_.n_draft_max() < 1) {
        throw std::invalid_argument("drafter dflash.block_size " + std::to_string(hp_.block_size) +
                                    " leaves no draft slot in its block layout");
    }
    if (hp_.block_size_min < 0 || hp_.block_size_min >= hp_.block_size) {
        throw std::invalid_argument("drafter pyspec.drafter.block_size_min " + std::to_string(hp_.block_size_min) +
                                    " must be 0 (whole blocks) or below dflash.block_size " +
                                    std::to_string(hp_.block_size));
    }
}

namespace {

// The K/V cache matrices of one layer as graph leaves.
std::pair<int, int> cache_leaves(Graph& g, const DraftHparams& hp, const KvCacheView& kv, int layer) {
    const Shape shape{hp.head_dim * hp.n_head_kv, kv.n_cells, 1, 1};
    const std::string ln = std::to_string(layer);
    return {g.external(kv.dtype, shape, kv.k[static_cast<size_t>(layer)], "draft_cache_k_l" + ln),
            g.external(kv.dtype, shape, kv.v[static_cast<size_t>(layer)], "draft_cache_v_l" + ln)};
}

bool d2t_free(const DraftModel& m) { return m.d2t.empty(); }

int f32_column(Graph& g, const std::vector<float>& w, const std::string& name) {
    return g.external(DType::F32, {static_cast<int64_t>(w.size()), 1, 1, 1}, const_cast<float*>(w.data()), name);
}

}  // namespace

DraftInjectGraph build_dflash_inject_graph(const DraftModel& model, const KvCacheView& kv, int64_t n_rows) {
    const DraftHparams& hp = model.hparams();
    DraftInjectGraph ig;
    Graph& g = ig.graph;
    const int64_t n_tl = static_cast<int64_t>(hp.target_layers.size());
    ig.features = g.input(DType::F32, {n_tl * hp.n_embd, n_rows, 1, 1}, "inp_features");
    ig.positions = g.input(DType::I32, {n_rows, 1, 1, 1}, "inp_pos");
    ig.kv_cells = g.input(DType::I32, {n_rows, 1, 1, 1}, "inp_kv_cells");

    // No attn_norm on the fused context (reference §1.2).
    const int h = g.rms_norm(g.mul_mat(add_weight(g, model.fc), ig.features), add_weight(g, model.hidden_norm), hp.rms_eps);
    for (int il = 0; il < hp.n_layer; ++il) {
        const DraftLayerWeights& w = model.layers[static_cast<size_t>(il)];
        int k = g.reshape(g.mul_mat(add_weight(g, w.wk), h), {hp.head_dim, hp.n_head_kv, n_rows, 1});
        k = g.rms_norm(k, add_weight(g, w.k_norm), hp.rms_eps);
        k = g.rope(k, ig.positions, static_cast<int>(hp.n_rot), 2, hp.rope_freq_base, hp.rope_freq_scale);
        const int v = g.mul_mat(add_weight(g, w.wv), h);
        const auto [k_cache, v_cache] = cache_leaves(g, hp, kv, il);
        g.set_rows(k_cache, g.reshape(k, {hp.head_dim * hp.n_head_kv, n_rows, 1, 1}), ig.kv_cells);
        g.set_rows(v_cache, v, ig.kv_cells);
    }
    return ig;
}

namespace {

// The first n rows of the batch, as views: contiguous, so every op reads them as it would a
// tensor of its own. leading_rows: the first n columns of a [width, rows] tensor; leading_entries:
// the first n entries of a per-row vector (positions, kv_base). Both return t itself for all rows.
int leading_rows(Graph& g, int t, int64_t n) {
    const Tensor& src = g[t];
    if (n == src.ne[1]) return t;
    const size_t all = src.nb[1] * static_cast<size_t>(n);
    return g.view(t, {src.ne[0], n, 1, 1}, {src.nb[0], src.nb[1], all, all}, 0);
}

int leading_entries(Graph& g, int t, int64_t n) {
    const Tensor& src = g[t];
    if (n == src.ne[0]) return t;
    const size_t all = src.nb[0] * static_cast<size_t>(n);
    return g.view(t, {n, 1, 1, 1}, {src.nb[0], all, all, all}, 0);
}

}  // namespace

DraftBlockGraph build_dflash_block_graph(const DraftModel& model, const KvCacheView& kv, int64_t n_blocks,
                                         int64_t block, int64_t n_out, int64_t span, int64_t n_chain_slots,
                                         int64_t n_candidates) {
    const DraftHparams& hp = model.hparams();
    if (n_out < 1 || n_out > block) throw std::invalid_argument("draft block graph: n_out must be in [1, block]");
    const int64_t n_rows = n_blocks * block, hd = hp.head_dim;
    // Rows [0, n_kept) are the output slots (block-major), the rest only serve as keys and values.
    const int64_t n_kept = n_blocks * n_out;
    DraftBlockGraph bg;
    Graph& g = bg.graph;
    bg.tokens = g.input(DType::I32, {n_rows, 1, 1, 1}, "inp_tokens");
    bg.positions = g.input(DType::I32, {n_rows, 1, 1, 1}, "inp_pos");
    bg.kv_cells = g.input(DType::I32, {n_rows, 1, 1, 1}, "inp_kv_cells");
    bg.mask = g.input(DType::F32, {span, n_rows, 1, 1}, "inp_kq_mask");
    bg.kv_base = g.input(DType::I32, {n_rows, 1, 1, 1}, "inp_kv_base");

    int x = g.get_rows(add_weight(g, model.tok_embd), bg.tokens);
    if (hp.embedding_scale != 1.0f) x = g.scale(x, hp.embedding_scale);
    for (int il = 0; il < hp.n_layer; ++il) {
        const DraftLayerWeights& w = model.layers[static_cast<size_t>(il)];
        // The last layer writes every row's K and V (the kept rows attend to them) but computes
        // the rest -- queries, attention, output projection, FFN -- for the kept rows alone: no
        // later op reads the others. A kept row's ops are the same either way (batch invariance).
        const int64_t n_q = il + 1 == hp.n_layer ? n_kept : n_rows;
        int h = g.rms_norm(x, add_weight(g, w.attn_norm), hp.rms_eps);
        int q = g.reshape(g.mul_mat(add_weight(g, w.wq), leading_rows(g, h, n_q)), {hd, hp.n_head, n_q, 1});
        int k = g.reshape(g.mul_mat(add_weight(g, w.wk), h), {hd, hp.n_head_kv, n_rows, 1});
        const int v = g.mul_mat(add_weight(g, w.wv), h);
        q = g.rms_norm(q, add_weight(g, w.q_norm), hp.rms_eps);
        k = g.rms_norm(k, add_weight(g, w.k_norm), hp.rms_eps);
        q = g.rope(q, leading_entries(g, bg.positions, n_q), static_cast<int>(hp.n_rot), 2, hp.rope_freq_base, hp.rope_freq_scale);
        k = g.rope(k, bg.positions, static_cast<int>(hp.n_rot), 2, hp.rope_freq_base, hp.rope_freq_scale);
        const auto [k_cache, v_cache] = cache_leaves(g, hp, kv, il);
        const int k_written = g.set_rows(k_cache, g.reshape(k, {hd * hp.n_head_kv, n_rows, 1, 1}), bg.kv_cells);
        const int v_written = g.set_rows(v_cache, v, bg.kv_cells);
        const int att = g.attention(q, k_written, v_written, leading_rows(g, bg.mask, n_q), leading_entries(g, bg.kv_base, n_q),
                                    static_cast<int>(hp.n_head_kv), hp.attn_scale);
        x = g.add(leading_rows(g, x, n_q), g.mul_mat(add_weight(g, w.wo), g.reshape(att, {hd * hp.n_head, n_q, 1, 1})));
        h = g.rms_norm(x, add_weight(g, w.ffn_norm), hp.rms_eps);
        const int gate = g.mul_mat(add_weight(g, w.ffn_gate), h);
        const int up = g.mul_mat(add_weight(g, w.ffn_up), h);
        x = g.add(x, g.mul_mat(add_weight(g, w.ffn_down), g.swiglu(gate, up)));
    }
    const int h_final = g.rms_norm(x, add_weight(g, model.output_norm), hp.rms_eps);
    const int64_t v = hp.n_vocab, vd = hp.n_vocab_draft;
    bg.logits = g.mul_mat(add_weight(g, model.output), h_final);
    g.set_name(bg.logits, "draft_logits");
    g.set_output(bg.logits);
    int final_d = bg.logits;  // the drafting logits over the draft vocabulary

    if (hp.is_dspark) {
        // Markov chain (reference §2.1): prev starts at each block's anchor (a target id); slot i
        // gets base_i + W2 * W1[prev_i] and passes its argmax (a draft id) on as prev_{i+1}, whose
        // embedding is W1[d2t[prev]] = markov_w1_draft[prev]. The biased rows are written over
        // a copy of the backbone logits, so final_d holds every slot's drafting logits.
        const int64_t n_markov = std::max<int64_t>(0, n_out - hp.draft_offset());
        bg.anchors = g.input(DType::I32, {n_blocks, 1, 1, 1}, "inp_anchors");
        if (n_markov > 0) bg.markov_rows = g.input(DType::I32, {n_blocks, n_markov, 1, 1}, "inp_markov_rows");
        const int w1 = add_weight(g, model.markov_w1);
        const int w1_draft = d2t_free(model) ? w1 : add_weight(g, model.markov_w1_draft);
        const int w2 = add_weight(g, model.markov_w2);
        const int ce_w = hp.has_confidence_head ? f32_column(g, model.conf_w_e, "conf_w_e") : -1;
        const size_t col_bytes = static_cast<size_t>(vd) * sizeof(float);
        const size_t stride = static_cast<size_t>(n_out) * col_bytes;
        final_d = g.cpy(bg.logits, DType::F32);
        g.set_name(final_d, "drafting_logits");
        if (n_markov > 0) {
            bg.inv_temp = g.input(DType::F32, {vd, n_blocks, 1, 1}, "inp_inv_temp");
            bg.noise_keys = g.input(DType::I32, {5, n_blocks * n_markov, 1, 1}, "inp_noise_keys");
            bg.noise_elements = g.input(DType::I32, {vd, 1, 1, 1}, "inp_noise_elements");
            bg.gumbel = g.gumbel(bg.noise_keys, bg.noise_elements, static_cast<int>(NoiseStream::Draft));
            g.set_name(bg.gumbel, "draft_gumbel");
        }
        const size_t noise_slot_bytes = static_cast<size_t>(vd * n_blocks) * sizeof(float);
        int prev = bg.anchors;
        for (int64_t i = hp.draft_offset(); i < n_out; ++i) {
            const int64_t k = i - hp.draft_offset();
            const int e = g.get_rows(k == 0 ? w1 : w1_draft, prev);
            int bias = g.mul_mat(w2, e);
            if (model.markov_w2_scale != 1.0f) bias = g.scale(bias, model.markov_w2_scale);
            const int base = g.view(bg.logits, {vd, n_blocks, 1, 1}, {sizeof(float), stride, stride * n_blocks, stride * n_blocks},
                                    static_cast<size_t>(i) * col_bytes);
            const int biased = g.add(base, bias);
            // Ancestral draw: z = biased / T (as a multiplication by 1/T), d = argmax(z + g).
            const int z = g.mul(biased, bg.inv_temp);
            const int noise = g.view(bg.gumbel, {vd, n_blocks, 1, 1},
                                     {sizeof(float), col_bytes, noise_slot_bytes, noise_slot_bytes},
                                     static_cast<size_t>(k) * noise_slot_bytes);
            const int ids = g.argmax(g.add(z, noise));
            g.set_name(z, "markov_z_" + std::to_string(k));
            g.set_name(ids, "markov_drawn_" + std::to_string(k));
            g.set_output(z);
            g.set_output(ids);
            bg.markov_z.push_back(z);
            bg.markov_tokens.push_back(ids);
            const size_t ids_bytes = static_cast<size_t>(n_blocks) * sizeof(int32_t);
            const int rows = g.view(bg.markov_rows, {n_blocks, 1, 1, 1}, {sizeof(int32_t), ids_bytes, ids_bytes, ids_bytes},
                                    static_cast<size_t>(k) * ids_bytes);
            final_d = g.set_rows(final_d, biased, rows);
            if (ce_w >= 0) {
                const int ce = g.mul_mat(ce_w, e);
                g.set_output(ce);
                bg.conf_e.push_back(ce);
            }
            prev = g.reshape(ids, {n_blocks, 1, 1, 1});
        }
        if (hp.has_confidence_head) {
            bg.conf_h = g.mul_mat(f32_column(g, model.conf_w_h, "conf_w_h"), h_final);
            g.set_output(bg.conf_h);
        }
    }

    bg.chain_draft_ids = !d2t_free(model) && model.d2t_ascending && n_candidates <= vd;
    if (d2t_free(model) || bg.chain_draft_ids) {
        bg.final_logits = final_d;
    } else {
        // d2t scatter (reference §1.4): each draft logit goes to its target id in a row that is
        // -inf elsewhere; element-wise as SET_ROWS of one-element rows into the flattened fill.
        bg.fill = g.input(DType::F32, {v, n_kept, 1, 1}, "inp_logits_fill");
        bg.scatter_ids = g.input(DType::I32, {vd * n_kept, 1, 1, 1}, "inp_d2t_scatter");
        const int scattered = g.set_rows(g.reshape(bg.fill, {1, v * n_kept, 1, 1}),
                                         g.reshape(final_d, {1, vd * n_kept, 1, 1}), bg.scatter_ids);
        bg.final_logits = g.reshape(scattered, {v, n_kept, 1, 1});
    }
    g.set_output(g.root_of(bg.final_logits));

    // Backend sampling chains, one per slot, bound to rows through chain_rows (none: a DSpark pass
    // whose tokens and confidences come from the Markov chain alone).
    bg.n_candidates = n_candidates;
    if (n_chain_slots == 0) return bg;
    bg.chain_rows = g.input(DType::I32, {n_chain_slots, 1, 1, 1}, "inp_chain_rows");
    const int64_t vc = bg.chain_draft_ids ? vd : v;  // the chains' vocabulary
    const int rows = g.get_rows(bg.final_logits, bg.chain_rows);  // F32 [vc, n_chain_slots]
    const size_t row_bytes = static_cast<size_t>(vc) * sizeof(float);
    for (int64_t j = 0; j < n_chain_slots; ++j) {
        const size_t off = static_cast<size_t>(j) * row_bytes;
        const int row = g.view(rows, {vc, 1, 1, 1}, {sizeof(float), row_bytes, row_bytes, row_bytes}, off);
        // The same row as a table of one-element rows, for GET_ROWS at the candidate ids.
        const int table = g.view(rows, {1, vc, 1, 1}, {sizeof(float), sizeof(float), row_bytes, row_bytes}, off);
        const int cand = g.top_k(row, static_cast<int>(n_candidates));
        const int cand_logits = g.get_rows(table, g.reshape(cand, {n_candidates, 1, 1, 1}));
        const int probs = g.softmax(g.reshape(cand_logits, {n_candidates, 1, 1, 1}), 1.0f);
        const int sampled = g.argmax(row);
        const std::string js = std::to_string(j);
        g.set_name(cand, "chain_candidates_" + js);
        g.set_name(cand_logits, "chain_logits_" + js);
        g.set_name(probs, "chain_probs_" + js);
        g.set_name(sampled, "chain_sampled_" + js);
        for (int t : {cand, cand_logits, probs, sampled}) g.set_pinned(t);
        bg.chain_candidates.push_back(cand);
        bg.chain_logits.push_back(cand_logits);
        bg.chain_probs.push_back(probs);
        bg.chain_sampled.push_back(sampled);
    }
    return bg;
}

DraftShiftGraph build_dflash_shift_graph(const DraftModel& model, const KvCacheView& kv, int64_t n_rows) {
    const DraftHparams& hp = model.hparams();
    DraftShiftGraph sg;
    Graph& g = sg.graph;
    sg.src = g.input(DType::I32, {n_rows, 1, 1, 1}, "inp_src_cells");
    sg.dst = g.input(DType::I32, {n_rows, 1, 1, 1}, "inp_dst_cells");
    sg.rotate = g.input(DType::I32, {n_rows, 1, 1, 1}, "inp_rotate");
    const int64_t width = hp.head_dim * hp.n_head_kv;
    for (int il = 0; il < hp.n_layer; ++il) {
        const auto [k_cache, v_cache] = cache_leaves(g, hp, kv, il);
        int k = g.reshape(g.get_rows(k_cache, sg.src), {hp.head_dim, hp.n_head_kv, n_rows, 1});
        k = g.rope(k, sg.rotate, static_cast<int>(hp.n_rot), 2, hp.rope_freq_base, hp.rope_freq_scale);
        const int v = g.get_rows(v_cache, sg.src);
        // Every row is read before any is written, so overlapping src/dst ranges are safe.
        g.set_rows(k_cache, g.reshape(k, {width, n_rows, 1, 1}), sg.dst);
        g.set_rows(v_cache, v, sg.dst);
    }
    return sg;
}

}  // namespace pyspec
