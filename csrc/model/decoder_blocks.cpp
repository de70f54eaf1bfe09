#include "model/decoder_blocks.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace pyspec {

DecoderGraphInputs add_decoder_inputs(Graph& g, const DecoderGraphParams& p) {
    DecoderGraphInputs in;
    in.tokens = g.input(DType::I32, {p.n_rows, 1, 1, 1}, "inp_tokens");
    in.positions = g.input(DType::I32, {p.n_rows, 1, 1, 1}, "inp_pos");
    in.kv_cells = g.input(DType::I32, {p.n_rows, 1, 1, 1}, "inp_kv_cells");
    in.mask = g.input(DType::F32, {p.span, p.n_rows, 1, 1}, "inp_kq_mask");
    in.kv_base = g.input(DType::I32, {p.n_rows, 1, 1, 1}, "inp_kv_base");
    if (p.n_outputs > 0 && p.n_outputs < p.n_rows) {
        in.out_rows = g.input(DType::I32, {p.n_outputs, 1, 1, 1}, "inp_out_rows");
    }
    if (p.n_prompt_rows < 0 || p.n_prompt_outputs < 0 || p.n_prompt_outputs > p.n_outputs ||
        p.n_prompt_outputs > p.n_prompt_rows || p.n_prompt_rows - p.n_prompt_outputs + p.n_outputs > p.n_rows) {
        throw std::logic_error("decoder graph: prompt rows and rows with logits do not fit the batch");
    }
    if (p.n_outputs == p.n_rows && p.n_prompt_outputs != p.n_prompt_rows) {
        throw std::logic_error("decoder graph: every row wants logits, so every prompt row does");
    }
    in.n_prompt_rows = p.n_prompt_rows;
    return in;
}

void record_layer_input(DecoderGraph& dg, const DecoderGraphParams& p, int layer, int x) {
    if (std::find(p.layer_ids.begin(), p.layer_ids.end(), layer) == p.layer_ids.end()) return;
    dg.graph.set_output(x);
    dg.layer_inputs.emplace_back(layer, x);
}

int self_attention(Graph& g, const Model& model, int layer, int h, const DecoderGraphInputs& in,
                   const KvCacheView& kv, bool qk_norm) {
    const Hparams& hp = model.hparams();
    const LayerWeights& w = model.layers[static_cast<size_t>(layer)];
    const int64_t n_rows = g[h].ne[1];
    const int64_t hd = hp.head_dim;
    const int64_t pc = in.n_prompt_rows;
    int q = g.reshape(g.mul_mat(add_weight(g, w.wq), h, pc), {hd, hp.n_head, n_rows, 1});
    int k = g.reshape(g.mul_mat(add_weight(g, w.wk), h, pc), {hd, hp.n_head_kv, n_rows, 1});
    const int v = g.mul_mat(add_weight(g, w.wv), h, pc);
    if (qk_norm) {
        q = g.rms_norm(q, add_weight(g, w.q_norm), hp.rms_eps);
        k = g.rms_norm(k, add_weight(g, w.k_norm), hp.rms_eps);
    }
    const int n_rot = static_cast<int>(hp.n_rot);
    const int factors = model.rope_freqs.present() ? add_weight(g, model.rope_freqs) : -1;
    q = g.rope(q, in.positions, n_rot, hp.rope_mode, hp.rope_freq_base, hp.rope_freq_scale, factors);
    k = g.rope(k, in.positions, n_rot, hp.rope_mode, hp.rope_freq_base, hp.rope_freq_scale, factors);

    const size_t l = static_cast<size_t>(layer);
    const Shape cache_shape{hd * hp.n_head_kv, kv.n_cells, 1, 1};
    const std::string ln = std::to_string(layer);
    const int k_cache = g.external(kv.dtype, cache_shape, kv.k[l], "cache_k_l" + ln);
    const int v_cache = g.external(kv.dtype, cache_shape, kv.v[l], "cache_v_l" + ln);
    const int k_written = g.set_rows(k_cache, g.reshape(k, {hd * hp.n_head_kv, n_rows, 1, 1}), in.kv_cells);
    const int v_written = g.set_rows(v_cache, v, in.kv_cells);

    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    const int att =
        g.attention(q, k_written, v_written, in.mask, in.kv_base, static_cast<int>(hp.n_head_kv), scale, pc);
    return g.mul_mat(add_weight(g, w.wo), g.reshape(att, {hd * hp.n_head, n_rows, 1, 1}), pc);
}

int swiglu_ffn(Graph& g, const LayerWeights& w, int h, int64_t prompt_rows) {
    const int gate = g.mul_mat(add_weight(g, w.ffn_gate), h, prompt_rows);
    const int up = g.mul_mat(add_weight(g, w.ffn_up), h, prompt_rows);
    return g.mul_mat(add_weight(g, w.ffn_down), g.swiglu(gate, up), prompt_rows);
}

void output_logits(DecoderGraph& dg, const Model& model, int x, const DecoderGraphParams& p) {
    if (p.n_outputs == 0) return;
    Graph& g = dg.graph;
    if (dg.in.out_rows >= 0) x = g.get_rows(x, dg.in.out_rows);
    x = g.rms_norm(x, add_weight(g, model.output_norm), model.hparams().rms_eps);
    dg.logits = g.mul_mat(add_weight(g, model.output), x, p.n_prompt_outputs);
    g.set_name(dg.logits, "logits");
    if (p.argmax) {
        dg.argmax = p.argmax_k > 1 ? g.top_k(dg.logits, static_cast<int>(p.argmax_k)) : g.argmax(dg.logits);
        g.set_name(dg.argmax, "argmax");
        g.set_output(dg.argmax);
        if (p.argmax_logits) g.set_output(dg.logits);
        if (p.argmax_values) {
            dg.argmax_values = g.gather(dg.logits, dg.argmax);
            g.set_name(dg.argmax_values, "argmax_values");
            g.set_output(dg.argmax_values);
            if (p.sample) {
                dg.in.samplers = g.input(DType::I32, {kSamplerWords, p.n_outputs, 1, 1}, "inp_samplers");
                dg.in.sample_bans = g.input(DType::I32, {kSampleBans, p.n_outputs, 1, 1}, "inp_sample_bans");
                dg.sampled = g.sample(dg.argmax, dg.argmax_values, dg.in.samplers, dg.in.sample_bans);
                g.set_name(dg.sampled, "sampled");
                g.set_output(dg.sampled);
            }
        }
    } else {
        g.set_output(dg.logits);
    }
}

DecoderGraph pre_norm_decoder(const Model& model, const KvCacheView& kv, const DecoderGraphParams& p, bool qk_norm) {
    const Hparams& hp = model.hparams();
    DecoderGraph dg;
    Graph& g = dg.graph;
    dg.in = add_decoder_inputs(g, p);

    int x = g.get_rows(add_weight(g, model.tok_embd), dg.in.tokens);
    for (int il = 0; il < hp.n_layer; ++il) {
        const LayerWeights& w = model.layers[static_cast<size_t>(il)];
        record_layer_input(dg, p, il, x);
        int h = g.rms_norm(x, add_weight(g, w.attn_norm), hp.rms_eps);
        x = g.add(x, self_attention(g, model, il, h, dg.in, kv, qk_norm));
        h = g.rms_norm(x, add_weight(g, w.ffn_norm), hp.rms_eps);
        x = g.add(x, swiglu_ffn(g, w, h, dg.in.n_prompt_rows));
    }
    record_layer_input(dg, p, static_cast<int>(hp.n_layer), x);
    output_logits(dg, model, x, p);
    return dg;
}

}  // namespace pyspec
