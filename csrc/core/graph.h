// Tensors and the op graph. A model builder appends tensors in execution order; a tensor is
// identified by its dense index in the graph (its "value id"). Memory for computed tensors and
// inputs comes from an AllocationPlan; weights and caches are external (their data is preset).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace pyspec {

constexpr int kMaxSrc = 5;
constexpr int kMaxDims = 4;

enum class Op : uint8_t {
    NONE,       // leaf: an input (filled by the caller) or external memory (weights, KV cache)
    VIEW,       // strided view into src0: no compute, no memory of its own
    CPY,        // dst = src0 converted to dst's dtype (dst contiguous; src0 any strides)
    GET_ROWS,   // dst[:, i] = float(src0[:, src1[i]]); src1 I32 row ids
    MUL_MAT,    // dst[n, m] = sum_k src0[k, n] * src1[k, m]; src0 weights (any dtype), src1 F32;
                // iparams {prompt_cols}: columns m < prompt_cols are prompt rows (their products
                // feed only the KV cache and later rows, never logits), which a backend may run on a
                // path of their own (the CUDA backend: tensor cores); still one fixed computation per
                // kind of row, so a row's bits never depend on its neighbours (invariant 7)
    RMS_NORM,   // x / sqrt(mean(x^2) + eps) over ne0, times src1 if given; fparams[0] = eps
    ADD,        // src0 + src1 (src1 broadcast over rows when it has one row)
    MUL,        // src0 * src1 (src1 broadcast over rows when it has one row)
    SCALE,      // src0 * fparams[0]
    ROPE,       // src0 [head_dim, n_head, n_rows], src1 I32 positions [n_rows], optional src2 F32
                // [n_rot / 2] frequency divisors (llama 3.1's rope_freqs);
                // iparams: {n_rot, mode (0 = normal pairs (2i, 2i+1), 2 = NEOX pairs (i, i+n/2))}
                // fparams: {freq_base, freq_scale}
    SILU,       // x * sigmoid(x)
    SWIGLU,     // silu(src0) * src1
    SOFTMAX,    // softmax(src0 * fparams[0]) over ne0
    ATTENTION,  // src0 Q [hd, n_head, n_rows], src1 K cache [hd * n_kv_head, n_cells],
                // src2 V cache (same shape), src3 mask F32 [span, n_rows], src4 I32 [n_rows]
                // first cell of each row's span. Row r attends cells base[r] + j, j < span,
                // with mask[r][j] added to the score (0 or -inf). iparams {n_kv_head,
                // prompt_rows}: rows r < prompt_rows are prompt rows (as MUL_MAT's prompt
                // columns), which a backend may run on a path of their own (the CUDA backend:
                // tensor cores); one fixed computation per kind of row, so a row's bits never
                // depend on its neighbours (invariant 7). fparams {scale}. dst F32 [hd, n_head, n_rows].
    SET_ROWS,   // writes src1 rows (F32) into rows src2 (I32) of src0 (converting to src0's
                // dtype); the node is a view of src0, so consumers are ordered after the write
    ARGMAX,     // I32 [1, n_rows]: index of the max over ne0 (first on ties)
    TOP_K,      // I32 [k, n_rows]: indices of the k largest over ne0, descending; iparams {k}
    SUM,        // F32 [1]: sum of all elements
    GUMBEL,     // F32 [n, rows]: the Gumbel noise -log(-log u) of Philox uniforms, computed as the
                // host computes it (runtime/noise_math.h), so the same bits on every backend.
                // src0 I32 [5, rows]: each row's key {seed low word, seed high word, offset,
                // position, on} (on = 0: the row is zeros); src1 I32 [n]: the element of each
                // column (element e is word e % 4 of counter block e / 4). iparams {stream}
    GATHER,     // F32 [k, n_rows]: dst[j, r] = src0[src1[j, r], r], each row's entries at its own
                // ids (numpy's take_along_axis over ne0); src0 F32, src1 I32 [k, n_rows] (TOP_K's
                // output); an id of -1 (TOP_K past a row's end) gives -inf
    SAMPLE,     // I32 [1, n_rows]: each row's token as a plain sampled step draws it from the row's
                // candidates (spec/verify.h draw_from_candidates: the target law over them,
                // then verification's bonus draw, key {seed, offset, slot 0, NoiseStream::Target}).
                // src0 I32 [k, n_rows] ids in TOP_K's order, src1 F32 [k, n_rows] their logits
                // (GATHER's), src2 I32 [kSamplerWords, n_rows] each row's sampler (SamplerWords),
                // src3 I32 [kSampleBans, n_rows] ids each row bans (-inf biases; -1 pads): they
                // are left out of its candidates, as the engine's verification leaves them out.
                // A row with temperature <= 0 gets its first id not banned; one whose draw is
                // undefined (top_k outside [1, its candidates], a NaN logit) gets -1. A backend may compute the law's
                // exponentials and logs with its own libm: the result is a prediction that the
                // host's own draw confirms (the engine's sampled decode-ahead).
    COUNT
};

const char* op_name(Op op);

// SAMPLE's per-row sampler: the doubles as their IEEE words (the law's thresholds are the
// request's doubles, not floats), then top_k, the seed's two words and the step offset (the
// row's position: the committed length before the token it draws).
constexpr int kSamplerWords = 10;
constexpr int kSampleBans = 8;  // banned ids a row may give SAMPLE (ignore_eos bans 1-3)
struct SamplerWords {
    static constexpr int kTemperature = 0, kTopP = 2, kMinP = 4, kTopK = 6, kSeedLo = 7, kSeedHi = 8, kOffset = 9;
};

enum TensorFlags : uint8_t {
    kInput = 1,     // filled by the caller before compute; memory from the plan, live from start
    kOutput = 2,    // read by the caller after compute; never freed or reused within the graph
    kPinned = 4,    // like an output for the planner: memory is never reused (kept for later)
    kExternal = 8,  // memory owned elsewhere (weights, KV cache); data is set by the builder
};

using Shape = std::array<int64_t, kMaxDims>;

struct Tensor {
    DType dtype = DType::F32;
    Op op = Op::NONE;
    uint8_t flags = 0;
    Shape ne{1, 1, 1, 1};                  // elements per dim, ne[0] innermost
    std::array<size_t, kMaxDims> nb{};     // bytes per step in each dim (nb[0] = unit bytes)
    std::array<int, kMaxSrc> src{-1, -1, -1, -1, -1};
    int view_src = -1;                     // for views: the tensor viewed (may itself be a view)
    size_t view_offset = 0;                // bytes from view_src's data
    std::array<int32_t, 4> iparams{};
    std::array<float, 4> fparams{};
    void* data = nullptr;                  // external: preset; others: set when a plan is applied
    std::string name;

    int64_t nelements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
    int64_t nrows() const { return ne[1] * ne[2] * ne[3]; }
    size_t nbytes() const;  // bytes spanned by the tensor's layout
    bool is_contiguous() const;
    bool is_view() const { return view_src >= 0; }
    bool has(uint8_t f) const { return (flags & f) != 0; }
    template <typename T> T* as() const { return static_cast<T*>(data); }
};

class Graph {
public:
    int size() const { return static_cast<int>(tensors_.size()); }
    Tensor& operator[](int id) { return tensors_.at(static_cast<size_t>(id)); }
    const Tensor& operator[](int id) const { return tensors_.at(static_cast<size_t>(id)); }
    const std::vector<Tensor>& tensors() const { return tensors_; }

    // Leaves.
    int input(DType dtype, Shape ne, const std::string& name);
    int external(DType dtype, Shape ne, void* data, const std::string& name);
    // External tensor with explicit strides (e.g. a GGUF weight or a cache slice).
    int external_strided(DType dtype, Shape ne, std::array<size_t, kMaxDims> nb, void* data,
                         const std::string& name);

    // Views.
    int view(int src, Shape ne, std::array<size_t, kMaxDims> nb, size_t offset);
    int reshape(int src, Shape ne);  // src must be contiguous

    // Ops; each returns the id of the new tensor.
    int cpy(int src, DType dtype);
    int get_rows(int table, int ids);
    int mul_mat(int weight, int x, int64_t prompt_cols = 0);
    int rms_norm(int x, int weight, float eps);  // weight may be -1
    int add(int a, int b);
    int mul(int a, int b);
    int scale(int a, float s);
    int rope(int x, int positions, int n_rot, int mode, float freq_base, float freq_scale,
             int freq_factors = -1);
    int silu(int a);
    int swiglu(int gate, int up);
    int softmax(int a, float scale);
    int attention(int q, int k_cache, int v_cache, int mask, int kv_base, int n_kv_head,
                  float scale, int64_t prompt_rows = 0);
    int set_rows(int dst, int rows, int ids);
    int argmax(int a);
    int top_k(int a, int k);
    int gather(int a, int ids);  // GATHER: a's entries at ids, row by row
    int sum(int a);
    int gumbel(int keys, int elements, int stream);
    int sample(int ids, int logits, int samplers, int bans);  // SAMPLE: each row's drawn token

    // Generic node creation (used by the ops above and by tests of the planner).
    int add_node(Op op, DType dtype, Shape ne, std::initializer_list<int> srcs,
                 const std::string& name = "");

    void set_output(int id) { (*this)[id].flags |= kOutput; }
    void set_pinned(int id) { (*this)[id].flags |= kPinned; }
    void set_name(int id, const std::string& name) { (*this)[id].name = name; }

    // The tensor whose memory a view ultimately lives in (itself when not a view).
    int root_of(int id) const;

private:
    int push(Tensor t);
    std::vector<Tensor> tensors_;
};

std::array<size_t, kMaxDims> contiguous_strides(DType dtype, const Shape& ne);

// The MUL_MAT at id and the ones right after it (only leaves and views between) that multiply
// the same activations by weights of the same type and K, with the same prompt columns (q/k/v,
// gate/up): what a backend may
// run as one grouped product. Writes up to max_parts node ids to out and returns how many. A
// backend still checks the members' memory (their outputs against the activations and each
// other) before running them together.
int matmuls_sharing_activations(const Graph& g, int id, int* out, int max_parts);

}  // namespace pyspec
