// The block drafter of GGUF architecture "dflash": DFlash, and DSpark (DFlash plus a Markov head
// and an optional confidence head). Weights point into the drafter's mapped GGUF file; the token
// embedding and the output matrix come from the target unless the drafter carries its own.
// Loading validates the file and its fit to the target (reference/dflash-dspark.md §1-§3).
//
// Three graphs, all over a drafter KV cache laid out like the target's (KvCacheView):
//   injection: target feature rows -> fc -> hidden_norm -> per layer K (k_norm, RoPE), V -> cache
//   block:     noise block [id_last, MASK, ...] -> Qwen3-style layers over context + block
//              -> final norm -> output head; DSpark: Markov chain and confidence head in-graph
//   shift:     moves cached rows down by `delta` positions and re-rotates K (window rebase)
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "model/decoder_graph.h"
#include "model/model.h"

namespace pyspec {

struct DraftHparams {
    int64_t n_embd = 0;
    int64_t n_layer = 0;
    int64_t n_ff = 0;
    int64_t n_head = 0;
    int64_t n_head_kv = 0;
    int64_t head_dim = 0;
    int64_t n_rot = 0;
    int64_t n_ctx_train = 0;      // dflash.context_length: the positions the drafter was trained on
    float rope_freq_base = 10000.0f;
    float rope_freq_scale = 1.0f;
    float rms_eps = 1e-6f;
    float attn_scale = 0.0f;      // dflash.attention.scale, else 1/sqrt(head_dim)
    float embedding_scale = 1.0f; // dflash.embedding_scale
    std::vector<int> target_layers;  // target layer-input ids (0 = embeddings)
    int64_t block_size = 16;
    // pyspec.drafter.block_size_min (pyspec-train-drafter --block-size-min): the drafter was also
    // trained on blocks cut to this many rows or more, so a round may decode just the rows it
    // drafts; 0: whole blocks only (every other drafter), which the engine then always decodes.
    int64_t block_size_min = 0;
    int32_t mask_token_id = 0;
    bool causal = false;             // dflash.attention.causal: causal within the block
    bool is_dspark = false;          // markov_w1.weight present
    bool sample_from_anchor = true;  // DSpark layout: anchor-first (true) or bonus-anchor (false)
    bool has_confidence_head = false;
    int64_t markov_rank = 0;
    int64_t n_vocab = 0;             // the target's vocabulary (logits are this wide)
    int64_t n_vocab_draft = 0;       // the drafter head's vocabulary: n_vocab, or |d2t| when the
                                     // file carries a reduced draft vocabulary

    // First block slot whose output is a draft: 0 for DSpark anchor-first, else 1 (§1.5).
    int draft_offset() const { return is_dspark && sample_from_anchor ? 0 : 1; }
    // Most drafts per block: block_size (DSpark anchor-first) or block_size - 1.
    int64_t n_draft_max() const { return block_size - draft_offset(); }
    // The rows a pass decodes when its first n_slots slots (the drafts' and, for bonus-anchor
    // layouts, the anchor's) come out: the whole block, or for a drafter trained on cut blocks
    // just those rows (at least block_size_min).
    int64_t block_rows(int64_t n_slots) const {
        if (block_size_min <= 0) return block_size;
        return std::min(block_size, std::max(block_size_min, n_slots));
    }
};

struct DraftLayerWeights {
    Weight attn_norm, wq, wk, wv, wo, q_norm, k_norm;
    Weight ffn_norm, ffn_gate, ffn_up, ffn_down;
};

class DraftModel {
public:
    // Throws std::invalid_argument naming the problem for a bad file or a drafter that does not
    // fit `target`.
    DraftModel(const std::string& path, std::shared_ptr<const Model> target);

    const DraftHparams& hparams() const { return hp_; }
    const Model& target() const { return *target_; }
    const GgufFile& gguf() const { return *file_; }
    // The drafter's attention shape in the target's Hparams form (sizes a KvCache).
    Hparams cache_hparams() const;

    Weight fc, hidden_norm, output_norm;
    Weight tok_embd, output;            // the drafter's own or the target's
    bool owns_tok_embd = false, owns_output = false;
    std::vector<DraftLayerWeights> layers;
    // Reduced draft vocabulary (reference §1.4): d2t[d] is the target id of draft id d (the GGUF
    // stores absolute ids; the converter added arange to the HF offsets). Empty: Vd = V.
    std::vector<int32_t> d2t;
    // d2t strictly increasing (pyspec-train-drafter's maps are): then the first maximum and the
    // top-k order (ties: lower id first) are the same over draft ids as over the scattered
    // target-vocabulary row, so the sampling chains can run over the draft vocabulary.
    bool d2t_ascending = false;
    Weight markov_w1, markov_w2;        // DSpark: W1 {R, V} (target ids), W2 {R, Vd}
    // W1's rows at d2t (W1[d2t[d]] for draft id d), so the Markov chain, which passes on draft
    // ids between slots, embeds the right target token; markov_w1 itself without d2t.
    Weight markov_w1_draft;
    float markov_w2_scale = 1.0f;
    // conf_proj split into its hidden-state and Markov-feature parts, as F32 [n, 1] columns, so
    // the graph can apply it without a concat op; plus the bias.
    std::vector<float> conf_w_h, conf_w_e;
    float conf_bias = 0.0f;

private:
    void load_d2t();
    void load_hparams();
    void load_weights();
    Weight require(const std::string& name, std::initializer_list<int64_t> ne, bool vector_f32 = false) const;
    Weight optional(const std::string& name, std::initializer_list<int64_t> ne, bool vector_f32 = false) const;

    std::shared_ptr<const Model> target_;
    std::unique_ptr<GgufFile> file_;
    DraftHparams hp_;
    std::vector<uint8_t> w1_draft_rows_;  // storage of markov_w1_draft when d2t is present
};

// Injection of n_rows committed context rows.
struct DraftInjectGraph {
    Graph graph;
    int features = -1;   // F32 [n_target_layers * n_embd, n_rows] input
    int positions = -1;  // I32 [n_rows] drafter positions
    int kv_cells = -1;   // I32 [n_rows] cache cells
};
DraftInjectGraph build_dflash_inject_graph(const DraftModel& model, const KvCacheView& kv, int64_t n_rows);

// n_blocks noise blocks of `block` rows each, block-major, plus the backend sampling chains
// (design.md invariant 1): n_chain_slots chains, each bound to one batch row by the input
// chain_rows, so the graph (and its allocation plan) does not depend on which sequences are in
// the batch. Every chain's outputs are pinned, bound to a live row or not. n_chain_slots = 0
// builds no chains (a DSpark pass whose drafts and confidences come from its Markov chain alone).
struct DraftBlockGraph {
    Graph graph;
    int tokens = -1, positions = -1, kv_cells = -1, mask = -1, kv_base = -1;  // as in a decoder
    int anchors = -1;     // I32 [n_blocks] id_last of each block (the Markov chain's start)
    int logits = -1;      // F32 [n_vocab_draft, n_rows] backbone logits of every slot (draft ids)
    // F32 [n_vocab, n_rows]: the logits each slot drafts from, over the target vocabulary
    // (DSpark draft slots: Markov-biased; with d2t: scattered, -inf outside the draft vocabulary).
    // With chain_draft_ids: F32 [n_vocab_draft, n_rows] over draft ids, never scattered in the
    // graph; the host scatters what it reads.
    int final_logits = -1;
    // The sampling chains run over draft ids (d2t ascending and n_candidates <= n_vocab_draft):
    // their candidates and drawn tokens are draft ids, which the host maps through d2t. The same
    // outputs as chains over the scattered row, without the scatter (an [n_vocab, n_rows] -inf
    // fill uploaded per pass) and with TOP_K/ARGMAX over Vd entries instead of V.
    bool chain_draft_ids = false;
    int markov_rows = -1;  // DSpark: I32 [n_blocks, n_markov_slots]; column k = rows of slot
                           // draft_offset + k (b * n_out + slot), where its biased logits go
    int fill = -1;         // d2t: F32 [n_vocab, n_rows] input, -inf; the scatter's destination
    int scatter_ids = -1;  // d2t: I32 [n_vocab_draft * n_rows], r * n_vocab + d2t[d]
    // DSpark, per Markov slot k: the confidence head's Markov-feature term F32 [1, n_blocks].
    std::vector<int> conf_e;
    // DSpark ancestral drafting (design.md invariant 5, verification.md §6). Markov slot k draws
    // d_k = argmax(z_k + g_k) with z_k = (base_k + bias(d_{k-1})) * inv_temp, and d_k is the
    // next slot's Markov predecessor, so each slot's bias follows the drawn chain. At T = 0 the
    // host writes inv_temp = 1 and the noise rows are off (g = 0), which leaves the argmax chain
    // bit for bit (x * 1 = x, x + 0 = x). One topology for every temperature, so one allocation
    // plan. The noise is drawn in the graph (GUMBEL), from keys the host writes: the bits the
    // host's Philox would give, without the host drawing vocabulary-sized vectors every round.
    int inv_temp = -1;  // F32 [n_vocab_draft, n_blocks] input: column b = 1/T of block b
                        // in every entry (1 at T = 0)
    int noise_keys = -1;      // I32 [5, n_blocks * n_markov_slots] input: row k * n_blocks + b is
                              // slot k of block b's key (seed, offset, position, on; GUMBEL)
    int noise_elements = -1;  // I32 [n_vocab_draft] input: the target id of each draft id
    int gumbel = -1;    // F32 [n_vocab_draft, n_blocks, n_markov_slots] GUMBEL: the Gumbel noise
                        // of slot k over the draft vocabulary (0 at T = 0)
    std::vector<int> markov_tokens;  // per Markov slot: I32 [n_blocks] drawn draft ids
    std::vector<int> markov_z;       // per Markov slot: F32 [n_vocab_draft, n_blocks] z_k, the
                                     // exact float vector the noise perturbed
    int conf_h = -1;      // F32 [1, n_rows] confidence head's hidden-state term

    // Sampling chains: chain_rows I32 [n_chain_slots] binds chain j to a row of final_logits.
    // Per chain j (all pinned): candidates I32 [k, 1] (TOP_K), their logits F32 [1, k]
    // (GET_ROWS of the row at the candidates), their probabilities F32 [k, 1] (SOFTMAX of the
    // candidate logits) and the drawn token I32 [1, 1] (ARGMAX: T = 0).
    int64_t n_candidates = 0;
    int chain_rows = -1;
    std::vector<int> chain_candidates, chain_logits, chain_probs, chain_sampled;
};
// Rows: n_blocks blocks of `block` tokens. The first n_out slots of each block are its output
// slots, and they come first: rows [0, n_blocks * n_out) hold them block-major (row b * n_out + i),
// the other slots follow (also block-major). The others only lend their keys and values, so the
// last layer's queries, FFN, the head, the Markov chain and the sampling chains cover the output
// rows alone; everything indexed by row below (logits, markov_rows, fill, scatter_ids) counts them.
DraftBlockGraph build_dflash_block_graph(const DraftModel& model, const KvCacheView& kv, int64_t n_blocks,
                                         int64_t block, int64_t n_out, int64_t span, int64_t n_chain_slots,
                                         int64_t n_candidates);

// Moves n_rows cache rows (cells src -> dst, both I32 [n_rows] inputs) and rotates K by
// `rotate` (I32 [n_rows], the position change): RoPE composes, rope(rope(k, p), d) = rope(k, p + d).
struct DraftShiftGraph {
    Graph graph;
    int src = -1, dst = -1, rotate = -1;
};
DraftShiftGraph build_dflash_shift_graph(const DraftModel& model, const KvCacheView& kv, int64_t n_rows);

}  // namespace pyspec
