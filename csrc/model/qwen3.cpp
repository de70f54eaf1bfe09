// qwen3: like llama plus a per-head RMSNorm of Q and K before RoPE, and NEOX RoPE
// (pairs (i, i + n/2)); the head size may differ from n_embd / n_head.
#include "model/decoder_blocks.h"

namespace pyspec {

DecoderGraph build_qwen3_graph(const Model& model, const KvCacheView& kv, const DecoderGraphParams& p) {
    return pre_norm_decoder(model, kv, p, /*qk_norm=*/true);
}

}  // namespace pyspec
