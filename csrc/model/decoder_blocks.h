// Pieces shared by the decoder-only architectures' graph builders.
#pragma once

#include "model/decoder_graph.h"

namespace pyspec {

// Creates the per-batch input tensors (flagged input).
DecoderGraphInputs add_decoder_inputs(Graph& g, const DecoderGraphParams& p);

// Marks x as the input residual stream of `layer` when the caller asked for it.
void record_layer_input(DecoderGraph& dg, const DecoderGraphParams& p, int layer, int x);

// Self-attention of one layer over normed input h [n_embd, n_rows]: Q/K/V projections, optional
// per-head q/k RMSNorm, RoPE, K/V written to the layer's cache cells, attention, output proj;
// the projections take in.n_prompt_rows as their prompt columns and the attention as its prompt
// rows.
int self_attention(Graph& g, const Model& model, int layer, int h, const DecoderGraphInputs& in,
                   const KvCacheView& kv, bool qk_norm);

// down(silu(gate(h)) * up(h)); the first prompt_rows columns of h are prompt rows
int swiglu_ffn(Graph& g, const LayerWeights& w, int h, int64_t prompt_rows);

// Final norm and output projection of the rows that want logits; sets dg.logits.
void output_logits(DecoderGraph& dg, const Model& model, int x, const DecoderGraphParams& p);

// The pre-norm decoder both architectures are: token embeddings, then per layer
// x += attention(rms_norm(x)) and x += swiglu_ffn(rms_norm(x)), then output_logits. qk_norm: the
// per-head RMSNorm of Q and K before RoPE (qwen3); the RoPE mode comes from the model.
DecoderGraph pre_norm_decoder(const Model& model, const KvCacheView& kv, const DecoderGraphParams& p, bool qk_norm);

}  // namespace pyspec
