// qwen3: like llama plus a per-head RMSNorm of Q and K before RoPE, and NEOX RoPE
// (pairs (i, i + n/2)); the head size may differ from n_embd / n_head.
#include "model/decoder_blocks.h"

namespace pyspec {

DecoderGraph build_qwen3_graph(const Model& model, const KvCacheView& kv, const DecoderGraphParams& p) {
    const Hparams& hp = model.hparams();
    DecoderGraph dg;
    Graph& g = dg.graph;
    dg.in = add_decoder_inputs(g, p);

    int x = g.get_rows(add_weight(g, model.tok_embd), dg.in.tokens);
    for (int il = 0; il < hp.n_layer; ++il) {
        const LayerWeights& w = model.layers[static_cast<size_t>(il)];
        record_layer_input(dg, p, il, x);
        int h = g.rms_norm(x, add_weight(g, w.attn_norm), hp.rms_eps);
        x = g.add(x, self_attention(g, model, il, h, dg.in, kv, /*qk_norm=*/true));
        h = g.rms_norm(x, add_weight(g, w.ffn_norm), hp.rms_eps);
        x = g.add(x, swiglu_ffn(g, w, h, dg.in.n_prompt_rows));
    }
    record_layer_input(dg, p, static_cast<int>(hp.n_layer), x);
    output_logits(dg, model, x, p);
    return dg;
}

}  // namespace pyspec
