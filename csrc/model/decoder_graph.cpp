#include "model/decoder_graph.h"

#include <stdexcept>

namespace pyspec {

DecoderGraph build_decoder_graph(const Model& model, const KvCacheView& kv, const DecoderGraphParams& p) {
    switch (model.hparams().arch) {
        case Arch::LLAMA: return build_llama_graph(model, kv, p);
        case Arch::QWEN3: return build_qwen3_graph(model, kv, p);
    }
    throw std::logic_error("build_decoder_graph: unknown architecture");
}

}  // namespace pyspec
