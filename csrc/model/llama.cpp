// llama (e.g. SmolLM2, Llama 3): pre-norm decoder, RoPE on pairs (2i, 2i+1) (llama.cpp's
// converter permutes Q/K so this equals Hugging Face's rotate-half), SwiGLU FFN.
#include "model/decoder_blocks.h"

namespace pyspec {

DecoderGraph build_llama_graph(const Model& model, const KvCacheView& kv, const DecoderGraphParams& p) {
    return pre_norm_decoder(model, kv, p, /*qk_norm=*/false);
}

}  // namespace pyspec
