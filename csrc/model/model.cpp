#include "model/model.h"

#include <cmath>
#include <stdexcept>

namespace pyspec {

const char* arch_name(Arch arch) {
    switch (arch) {
        case Arch::LLAMA: return "llama";
        case Arch::QWEN3: return "qwen3";
    }
    return "?";
}

int add_weight(Graph& g, const Weight& w) {
    // Weights are read-only; the graph's tensor type holds a mutable pointer for outputs.
    return g.external(w.dtype, w.ne, const_cast<void*>(w.data), w.name);
}

void read_rope_frequencies(const GgufFile& f, const std::string& prefix, float& freq_base, float& freq_scale) {
    freq_base = static_cast<float>(f.get_float_or(prefix + "rope.freq_base", 10000.0));
    if (!(freq_base > 0) || !std::isfinite(freq_base)) throw std::invalid_argument(prefix + "rope.freq_base must be positive");
    freq_scale = 1.0f;
    const std::string scaling = f.get_string_or(prefix + "rope.scaling.type", "none");
    if (scaling == "linear") {
        const double factor = f.get_float_or(prefix + "rope.scaling.factor", 1.0);
        if (!(factor > 0)) throw std::invalid_argument(prefix + "rope.scaling.factor must be positive");
        freq_scale = static_cast<float>(1.0 / factor);
    } else if (scaling != "none") {
        throw std::invalid_argument("unsupported rope scaling '" + scaling + "' (supported: none, linear)");
    }
}

Model::Model(const std::string& path) : file_(std::make_unique<GgufFile>(path)) {
    load_hparams();
    load_weights();
}

void Model::load_hparams() {
    const GgufFile& f = *file_;
    const std::string arch = f.get_string("general.architecture");
    if (arch == "llama") {
        hp_.arch = Arch::LLAMA;
        hp_.rope_mode = 0;
    } else if (arch == "qwen3") {
        hp_.arch = Arch::QWEN3;
        hp_.rope_mode = 2;
    } else {
        throw std::invalid_argument("unknown architecture '" + arch + "' in " + f.path() +
                                    " (supported: llama, qwen3)");
    }
    const std::string k = arch + ".";
    hp_.n_embd = f.get_int(k + "embedding_length");
    hp_.n_layer = f.get_int(k + "block_count");
    hp_.n_ff = f.get_int(k + "feed_forward_length");
    hp_.n_head = f.get_int(k + "attention.head_count");
    hp_.n_head_kv = f.get_int_or(k + "attention.head_count_kv", hp_.n_head);
    hp_.n_ctx_train = f.get_int_or(k + "context_length", 4096);
    if (hp_.n_embd <= 0 || hp_.n_layer <= 0 || hp_.n_ff <= 0 || hp_.n_head <= 0 || hp_.n_head_kv <= 0) {
        throw std::invalid_argument("invalid hyperparameters in " + f.path() +
                                    ": embedding_length, block_count, feed_forward_length and head counts must be positive");
    }
    if (hp_.n_head % hp_.n_head_kv != 0) {
        throw std::invalid_argument("attention.head_count (" + std::to_string(hp_.n_head) +
                                    ") is not a multiple of attention.head_count_kv (" +
                                    std::to_string(hp_.n_head_kv) + ")");
    }
    hp_.head_dim = f.get_int_or(k + "attention.key_length", hp_.n_embd / hp_.n_head);
    const int64_t v_len = f.get_int_or(k + "attention.value_length", hp_.head_dim);
    if (v_len != hp_.head_dim) throw std::invalid_argument("attention.value_length != key_length is not supported");
    hp_.n_rot = f.get_int_or(k + "rope.dimension_count", hp_.head_dim);
    if (hp_.head_dim <= 0 || hp_.n_rot <= 0 || hp_.n_rot > hp_.head_dim || hp_.n_rot % 2 != 0) {
        throw std::invalid_argument("invalid rope.dimension_count " + std::to_string(hp_.n_rot) +
                                    " for head size " + std::to_string(hp_.head_dim));
    }
    read_rope_frequencies(f, k, hp_.rope_freq_base, hp_.rope_freq_scale);
    hp_.rms_eps = static_cast<float>(f.get_float_or(k + "attention.layer_norm_rms_epsilon", 1e-5));
    if (!(hp_.rms_eps > 0) || !std::isfinite(hp_.rms_eps)) throw std::invalid_argument("invalid layer_norm_rms_epsilon");
}

std::string format_shape(const int64_t* ne, size_t n) {
    std::string s = "[";
    for (size_t i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
    return s + "]";
}

Weight load_weight(const GgufFile& f, const std::string& name, std::initializer_list<int64_t> ne,
                   bool vector_f32, const std::string& owner) {
    const GgufTensorInfo* t = f.find_tensor(name);
    if (!t) throw std::invalid_argument("missing tensor " + name + " in " + owner + f.path());
    const std::vector<int64_t> want(ne);
    for (size_t d = 0; d < 4; ++d) {
        if (t->ne[d] != (d < want.size() ? want[d] : 1)) {
            throw std::invalid_argument(owner + "tensor " + name + " has shape " +
                                        format_shape(t->ne, static_cast<size_t>(t->n_dims)) + ", expected " +
                                        format_shape(want.data(), want.size()));
        }
    }
    if (vector_f32 && t->dtype != DType::F32) {
        throw std::invalid_argument(owner + "tensor " + name + " has type " + dtype_name(t->dtype) + ", expected F32");
    }
    if (dtype_is_integer(t->dtype)) {
        throw std::invalid_argument(owner + "tensor " + name + " has integer type " + dtype_name(t->dtype));
    }
    Weight w;
    w.name = name;
    w.dtype = t->dtype;
    w.ne = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
    w.data = t->data;
    return w;
}

Weight Model::require(const std::string& name, std::initializer_list<int64_t> ne, bool vector_f32) const {
    return load_weight(*file_, name, ne, vector_f32, "");
}

void Model::load_weights() {
    const int64_t n_embd = hp_.n_embd, hd = hp_.head_dim;
    const GgufTensorInfo* emb = file_->find_tensor("token_embd.weight");
    if (!emb) throw std::invalid_argument("missing tensor token_embd.weight in " + file_->path());
    const std::string arch = arch_name(hp_.arch);
    hp_.n_vocab = file_->get_int_or(arch + ".vocab_size", emb->ne[1]);
    tok_embd = require("token_embd.weight", {n_embd, hp_.n_vocab});
    output_norm = require("output_norm.weight", {n_embd}, true);
    hp_.tied_output = file_->find_tensor("output.weight") == nullptr;
    output = hp_.tied_output ? tok_embd : require("output.weight", {n_embd, hp_.n_vocab});

    if (file_->find_tensor("rope_freqs.weight")) rope_freqs = require("rope_freqs.weight", {hp_.n_rot / 2}, true);

    layers.resize(static_cast<size_t>(hp_.n_layer));
    for (int64_t il = 0; il < hp_.n_layer; ++il) {
        const std::string p = "blk." + std::to_string(il) + ".";
        LayerWeights& l = layers[static_cast<size_t>(il)];
        l.attn_norm = require(p + "attn_norm.weight", {n_embd}, true);
        l.wq = require(p + "attn_q.weight", {n_embd, hp_.n_head * hd});
        l.wk = require(p + "attn_k.weight", {n_embd, hp_.n_head_kv * hd});
        l.wv = require(p + "attn_v.weight", {n_embd, hp_.n_head_kv * hd});
        l.wo = require(p + "attn_output.weight", {hp_.n_head * hd, n_embd});
        if (hp_.arch == Arch::QWEN3) {
            l.q_norm = require(p + "attn_q_norm.weight", {hd}, true);
            l.k_norm = require(p + "attn_k_norm.weight", {hd}, true);
        }
        l.ffn_norm = require(p + "ffn_norm.weight", {n_embd}, true);
        l.ffn_gate = require(p + "ffn_gate.weight", {n_embd, hp_.n_ff});
        l.ffn_up = require(p + "ffn_up.weight", {n_embd, hp_.n_ff});
        l.ffn_down = require(p + "ffn_down.weight", {hp_.n_ff, n_embd});
    }
}

}  // namespace pyspec
