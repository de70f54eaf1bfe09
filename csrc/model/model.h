// A target model: hyperparameters (llama.cpp's GGUF key names) and weights that point into the
// memory-mapped GGUF file. Loading validates every tensor the graph builders will use.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/graph.h"
#include "gguf/gguf_file.h"

namespace pyspec {

enum class Arch { LLAMA, QWEN3 };

const char* arch_name(Arch arch);

struct Hparams {
    Arch arch = Arch::LLAMA;
    int64_t n_vocab = 0;
    int64_t n_embd = 0;
    int64_t n_layer = 0;
    int64_t n_ff = 0;
    int64_t n_head = 0;
    int64_t n_head_kv = 0;
    int64_t head_dim = 0;     // attention.key_length, n_embd / n_head by default
    int64_t n_rot = 0;        // rope.dimension_count, head_dim by default
    int64_t n_ctx_train = 0;
    float rope_freq_base = 10000.0f;
    float rope_freq_scale = 1.0f;
    float rms_eps = 1e-5f;
    int rope_mode = 0;        // 0: pairs (2i, 2i+1) (llama); 2: NEOX pairs (i, i + n/2) (qwen3)
    bool tied_output = false; // output matrix is token_embd
};

// A weight tensor inside the mapping.
struct Weight {
    std::string name;
    DType dtype = DType::F32;
    Shape ne{1, 1, 1, 1};
    const void* data = nullptr;

    bool present() const { return data != nullptr; }
};

struct LayerWeights {
    Weight attn_norm, wq, wk, wv, wo;
    Weight q_norm, k_norm;  // qwen3 only
    Weight ffn_norm, ffn_gate, ffn_up, ffn_down;
};

class Model {
public:
    explicit Model(const std::string& path);

    const Hparams& hparams() const { return hp_; }
    const GgufFile& gguf() const { return *file_; }

    Weight tok_embd, output_norm, output;
    Weight rope_freqs;  // optional [n_rot / 2] frequency divisors (llama 3.1 rope scaling)
    std::vector<LayerWeights> layers;

private:
    void load_hparams();
    void load_weights();
    Weight require(const std::string& name, std::initializer_list<int64_t> ne, bool vector_f32 = false) const;

    std::unique_ptr<GgufFile> file_;
    Hparams hp_;
};

// Adds a weight to a graph as an external tensor.
int add_weight(Graph& g, const Weight& w);

// "[a, b, c]" for error messages.
std::string format_shape(const int64_t* ne, size_t n);

// A weight of a mapped file, checked: present, of shape `ne` (innermost first), F32 when
// `vector_f32`, not an integer type. `owner` prefixes messages ("" for targets, "drafter ").
Weight load_weight(const GgufFile& f, const std::string& name, std::initializer_list<int64_t> ne,
                   bool vector_f32, const std::string& owner);

// RoPE frequency base and scale from `{prefix}rope.freq_base` and `{prefix}rope.scaling.*`
// (none or linear; anything else is refused with a message). Shared by targets and drafters.
void read_rope_frequencies(const GgufFile& f, const std::string& prefix, float& freq_base, float& freq_scale);

}  // namespace pyspec
