// Host-side launchers of the CUDA backend's kernels, one per graph op (cuda/ops_*.cu). All run
// asynchronously on `stream`; `err` is the backend's device error word (see common.cuh).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/common.cuh"

namespace pyspec {
namespace cuda {

void launch_cpy(const TDesc& dst, const TDesc& src, cudaStream_t s);

// Up to kMaxCopyPieces small copies as one launch (block i copies piece i): each address is one
// the device can use (device memory, or pinned host memory's mapped address), and no piece's
// destination overlaps another piece's source or destination. Launched without PDL: the launch
// waits for everything queued before it on the stream, and what is queued after waits for it.
constexpr int kMaxCopyPieces = 16;
struct CopyPieces {
    const char* src[kMaxCopyPieces];
    char* dst[kMaxCopyPieces];
    uint32_t bytes[kMaxCopyPieces];
    int n = 0;
};
void launch_copy_pieces(const CopyPieces& pieces, cudaStream_t s);
void launch_get_rows(const TDesc& dst, const TDesc& table, const int32_t* ids, unsigned* err, cudaStream_t s);

// Row-wise ops that take a list of jobs: one node, or a pair of independent nodes of the same op
// and parameters run as one launch (job i on blockIdx.y = i). Each job is computed exactly as it
// would be alone.
constexpr int kMaxOpJobs = 2;
struct OpJob {
    TDesc dst;
    TDesc src;
    const float* w = nullptr;  // RMS_NORM's weight, or nullptr
};
void launch_set_rows(const OpJob* jobs, int n, const int32_t* ids, unsigned* err, cudaStream_t s);
void launch_rms_norm(const OpJob* jobs, int n, float eps, cudaStream_t s);

// kind: 0 add, 1 mul, 2 swiglu (silu(a) * b)
void launch_binary(int kind, const TDesc& dst, const TDesc& a, const TDesc& b, cudaStream_t s);
// kind: 0 scale (by f), 1 silu
void launch_unary(int kind, const TDesc& dst, const TDesc& a, float f, cudaStream_t s);
// ROPE of one node or a q/k pair (same positions and parameters), optionally with the K/V
// SET_ROWS pair that follows as the same launch: the k job (kRopeStore) also writes its rotated
// rows to cache rows cells[t], and a kStore job copies the V rows to cells[t] of its cache (F16 or
// F32 caches; the bits SET_ROWS would store).
constexpr int kMaxRopeJobs = 3;
struct RopeJob {
    enum Kind : int { kRope = 0, kRopeStore = 1, kStore = 2 };
    TDesc dst;    // the rotated rows (kRope, kRopeStore)
    TDesc src;    // [head_dim, n_head, n_rows] (kStore: any rows)
    TDesc cache;  // kRopeStore, kStore: the cache, rows of head_dim * n_head (kStore: src's row length)
    int kind = kRope;
};
// inputs_fixed: pos and factors are graph leaves (inputs, weights), written by no kernel of the
// graph, so the kernel may read them before its PDL wait.
void launch_rope(const RopeJob* jobs, int n, const int32_t* pos, const int32_t* cells, const float* factors, int n_rot,
                 bool neox, float freq_base, float freq_scale, bool inputs_fixed, unsigned* err, cudaStream_t s);
void launch_softmax(const TDesc& dst, const TDesc& a, float scale, cudaStream_t s);
// GATHER: dst[j, r] = a[ids[j, r], r]; an id outside the row (TOP_K's -1) gives -inf.
void launch_gather(const TDesc& dst, const TDesc& a, const TDesc& ids, cudaStream_t s);
void launch_sum(const TDesc& dst, const TDesc& a, cudaStream_t s);
// GUMBEL (cuda/ops_noise.cu): keys I32 [5, rows], elems I32 [n]; the host's bits.
void launch_gumbel(const TDesc& dst, const int32_t* keys, const int32_t* elems, uint32_t stream, cudaStream_t s);
// SAMPLE (cuda/ops_sample.cu): each row's drawn token from its candidates (ids I32 [k, rows],
// logits F32 [k, rows], samplers I32 [kSamplerWords, rows], bans I32 [kSampleBans, rows]).
void launch_sample(const TDesc& dst, const TDesc& ids, const TDesc& logits, const TDesc& samplers, const TDesc& bans,
                   cudaStream_t s);

// Device scratch of the kernels that split one reduction over several blocks (the narrow
// tensor-core MUL_MAT's K segments, the wide one's split K, the decode attention's pages, a long
// row's ARGMAX / TOP_K slices), owned by the backend and sized before a compute (so nothing allocates inside a CUDA graph capture):
// partial_floats floats and
// n_counters unsigned counters that are zero between launches (each launch leaves them zero);
// and n_halves 16-bit values, the wide tensor-core MUL_MAT's operands converted to halves (no
// state between launches). Launches run one after another on the backend's stream, so they share it.
struct SplitScratch {
    float* partial = nullptr;
    size_t partial_floats = 0;
    unsigned* counters = nullptr;
    size_t n_counters = 0;
    uint16_t* halves = nullptr;
    size_t n_halves = 0;
};
struct SplitScratchNeed {
    size_t partial_floats = 0;
    size_t n_counters = 0;
    size_t n_halves = 0;
};
// ARGMAX and TOP_K (cuda/ops_pick.cu): each row's first best id, or its k best ids in order (-1
// past a row's non-NaN entries). A few long rows are split over blocks through the scratch (what
// pick_split_scratch says a row of n entries in a launch of `rows` rows needs; k: TOP_K's k, 0 for
// ARGMAX); with less scratch than that, a row takes one block. The ids are the same either way.
SplitScratchNeed pick_split_scratch(int64_t n, int64_t rows, int64_t k);
void launch_argmax(const TDesc& dst, const TDesc& a, const SplitScratch& scratch, cudaStream_t s);
void launch_top_k(const TDesc& dst, const TDesc& a, const SplitScratch& scratch, cudaStream_t s);
// prompt_rows: ATTENTION's prompt rows (core/graph.h), its first rows; they take the tensor-core
// kernel where attention_tc_enabled() and the layout suits it (cuda/ops_attention_tc.cu), the rest
// the CUDA-core kernels every row takes otherwise.
void launch_attention(const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v, const TDesc& mask,
                      const int32_t* base, int n_kv_head, float scale, int64_t prompt_rows,
                      const SplitScratch& scratch, unsigned* err, cudaStream_t s);
// Whether prompt rows' attention takes the tensor cores: only where prompt rows have their own path
// (matmul_tc_prompt_path(), the default), and PYSPEC_CUDA_ATT_TC=0 turns it off (A/B runs). Read at
// each call; part of the CUDA graph key.
bool attention_tc_enabled();
// Which shapes it serves (F16 cache, head_dim 32, 64 or 128): a shape always takes the same kernel,
// whatever the batch. Rows of other shapes stay on the CUDA-core kernels.
bool attention_tc_shape(int64_t hd, DType kv_dtype);
// A single decode row's q/k RoPE and K/V store (the ROPE pair and the SET_ROWS pair before its
// ATTENTION), run by the attention launch itself instead of a launch of their own: each block
// rotates its q head, and the new cell's K and V rows as the RoPE kernel would (cuda/rope_common.cuh,
// the same bits), uses them in place of the cache's row, and the first block of each kv head
// stores them (and the ROPEs' outputs). For the staged kernel's layouts (attention_staged_supports)
// with F16 caches; pos, cells and factors must be graph leaves (read before the PDL wait).
// Returns false, launching nothing, for other layouts (the caller runs the nodes apart).
// PYSPEC_CUDA_ATT_ROPE=0 turns it off (read at each compute; part of the CUDA graph key).
struct DecodeRope {
    TDesc q_src, k_src;  // the ROPEs' inputs: [hd, n_head, 1] and [hd, n_kv_head, 1] F32 (with q_norm:
                         // the inputs of the per-head RMS_NORMs before them, Qwen3's q/k norms)
    TDesc v_src;         // the V row stored: [hd * n_kv_head, 1] F32
    TDesc q_dst, k_dst;  // the ROPEs' outputs, written as the RoPE kernel writes them
    const int32_t* pos = nullptr;
    const int32_t* cells = nullptr;
    const float* factors = nullptr;
    int n_rot = 0;
    int neox = 0;
    double base = 0.0, fscale = 1.0;
    // Per-head RMS_NORMs of q and k run first, as the norm kernel does (warp_rms_scale, then
    // x * scale * w), or none (nullptr); their outputs are read by the ROPEs alone and not written.
    const float* q_norm = nullptr;
    const float* k_norm = nullptr;
    float norm_eps = 0.0f;
    // Early reads (on unless PYSPEC_CUDA_ATT_EARLY=0; +2% tg128 on the H200, docs/internals-cuda.md):
    // the ATTENTION's mask and first cells are graph leaves (nothing in the graph writes them), so
    // the launch reads the mask before the PDL wait and copies only the cells it leaves visible,
    // and after the wait it requests all the prologue's inputs in one round. The same bits either
    // way.
    bool early = false;
    // With early: the first page's K/V copies go out before the PDL wait as well, where no node of
    // the graph but this launch's SET_ROWS pair writes the caches (the backend checks), so every
    // cell but the new one (left out of the copies) was written by kernels that have completed
    // (docs/internals-cuda.md). PYSPEC_CUDA_ATT_EARLY_COPY=0 turns it off. The same bits either way.
    bool early_copies = false;
    // The next kernel (the o projection) let in before this launch's PDL wait rather than after it,
    // so its blocks load their first weights while this one waits and copies; it still waits for
    // this whole grid before it reads anything a kernel writes (cuda/launch.cuh).
    // PYSPEC_CUDA_ATT_LET_IN_FIRST=0 turns it off. H200 tg128, two alternating rounds: with the
    // early copies, Qwen3-4B 363.5 -> 366.0-366.2 t/s (the copies alone lost 0.7% by delaying
    // o's start), SmolLM2 1,621 -> 1,662-1,664 (docs/internals-cuda.md).
    bool let_next_in_first = false;
    // The position's angles are the same for every layer of a step, and computing them (in double,
    // as the CPU does) took ~2.5 us of each launch's start (H200, Qwen3-4B decode, globaltimer
    // stamps). So the step's first launch computes them and its block (0, 0, 0) stores them into
    // angles (n_rot floats: cos, then sin, as s_cs holds them) after its PDL wait; the later
    // launches of the compute with the same positions and frequencies (angles_stored) read them in
    // the same round as the prologue's other inputs, after theirs, when every kernel before has
    // completed. The same values either way. PYSPEC_CUDA_ATT_ANGLES=0 turns it off.
    float* angles = nullptr;
    bool angles_stored = false;
};
bool attention_rope_enabled();
// The decode attention's angle table (DecodeRope::angles): on unless PYSPEC_CUDA_ATT_ANGLES=0.
bool attention_angles_enabled();
// The decode attention's launch choices read at each compute (PYSPEC_CUDA_ATT_EARLY,
// _EARLY_COPY, _LET_IN_FIRST, _ANGLES), as bits for the CUDA graphs' key.
int attention_rope_setting();
bool launch_attention_rope(const TDesc& dst, const TDesc& k, const TDesc& v, const TDesc& mask, const int32_t* base,
                           int n_kv_head, float scale, const DecodeRope& rope, const SplitScratch& scratch,
                           unsigned* err, cudaStream_t s);
// What an ATTENTION over q [hd, n_head, rows] with a mask span of span cells needs of the scratch
// (a single row over more than two pages is split over blocks, a page per block).
SplitScratchNeed attention_split_scratch(int64_t hd, int64_t n_head, int64_t rows, int64_t span);

// dst[n, m] = sum_k w[k, n] * x[k, m] (MUL_MAT) is launch_matmul_group with one part: w rows of
// row_bytes, x rows of x_stride floats, y rows of y_stride floats. Batch-invariant: one reduction
// order per output, fixed by K and the weight type.
// Several weight matrices of one type and K applied to the same activations (q/k/v, gate/up) in
// one launch: part j writes its n_rows outputs per column to its own y. Each output is reduced
// exactly as launch_matmul reduces it alone (same order, same bits); only the launch count drops.
constexpr int kMaxMatmulParts = 3;
// add (optional): a residual added to each output before it is stored, y = w x + add, rows of
// add_stride floats (the graph's MUL_MAT -> ADD, one launch; fp32 addition commutes, so the bits
// are the ADD's whichever side the product was on). Only where matmul_add_epilogue(wtype, k).
struct MatmulPart {
    const void* w;
    int64_t n_rows;
    size_t row_bytes;
    float* y;
    int64_t y_stride;
    const float* add = nullptr;
    int64_t add_stride = 0;
    bool constant = false;  // nothing in the graph writes w: a kernel may load it before its PDL wait
};
// Which rows of a weight's MUL_MATs take the tensor cores (matmul_tc_rows): none, the prompt
// columns only (the rest the CUDA cores), or all.
enum class TcRows : uint8_t { None, Prompt, All };
bool matmul_add_epilogue(DType wtype, int64_t k, TcRows rows);
// prompt_cols: MUL_MAT's prompt columns (core/graph.h), the first columns of x and of every y (and
// add); they take the tensor cores where rows is Prompt, the rest the kernel every row of the
// weight takes otherwise.
// norm (optional): x holds an RMS_NORM's inputs and each column is normalised in the kernel, as
// the norm kernel does it (warp_rms_scale, then x * scale * w: the same bits), so the norm's output
// never reaches memory and its launch is saved. Only where matmul_norm_prologue says (the CUDA-core
// path, m <= kMatmulNormMaxM: decode steps, verify passes and draft blocks of up to 4 rows; since
// the bits are the same, choosing by M is free).
// PYSPEC_CUDA_NORM_PROLOGUE=0 turns it off (read once), PYSPEC_CUDA_FUSE=0 with the other fusions.
struct MatmulNorm {
    const float* w = nullptr;  // the norm's weights (required)
    float eps = 0.0f;
    bool constant = false;     // no node of the graph writes w: it may be read before the PDL wait
};
constexpr int64_t kMatmulNormMaxM = 4;
// The normalised columns a block holds in shared memory: one column in up to 48 KB; the tiles of 2
// or 4 columns (m = 2..4) in up to 16 KB, so that blocks still fit on an SM side by side.
constexpr int64_t kMatmulNormMaxValues = 12288;
constexpr int64_t kMatmulNormMaxTileValues = 4096;
bool matmul_norm_prologue(DType wtype, int64_t k, int64_t m, int64_t prompt_cols, TcRows rows);
// room: the blocks of the launch that comes next (a decode attention) that should find SMs free
// while this one runs (kRowRoom: where the launch streams rows on the balanced grid, that many
// SMs' worth of its blocks, at most a third of them, take half a share; elsewhere it is ignored).
void launch_matmul_group(DType wtype, const MatmulPart* parts, int n_parts, int64_t k, const float* x,
                         int64_t x_stride, int64_t m, int64_t prompt_cols, TcRows rows, const SplitScratch& scratch,
                         cudaStream_t s, const MatmulNorm* norm = nullptr, int room = 0);
// gate and up (MatmulParts of equal rows, no add) over the same activations with the SWIGLU that
// follows them as the epilogue: y[i, c] = silu(gate_i . x_c) * (up_i . x_c), the bits of the three
// nodes run apart (each product reduced exactly as launch_matmul_group reduces it). For the
// CUDA-core path at M <= kMatmulGluMaxM without prompt columns there; returns false (nothing
// launched) elsewhere.
constexpr int64_t kMatmulGluMaxM = 16;
bool launch_matmul_glu(DType wtype, const MatmulPart& gate, const MatmulPart& up, int64_t k, const float* x,
                       int64_t x_stride, int64_t m, int64_t prompt_cols, TcRows rows, float* y, int64_t y_stride,
                       cudaStream_t s, const MatmulNorm* norm = nullptr);
// Whether the backend groups consecutive MUL_MATs over the same activations into one launch
// (on by default since the H200 run: the same bits, 3 launches fewer per layer, tg +5-6%;
// PYSPEC_CUDA_FUSE=0 turns it off). Read at each compute: a backend's captured CUDA graphs keep the
// launches they were captured with.
inline bool matmul_fusion_enabled() { return env_switch("PYSPEC_CUDA_FUSE") != 0; }

// MUL_MAT on tensor cores, batch-invariant by a fixed per-output mma sequence (cuda/matmul_tc.cu);
// for a supported type (matmul_tc_supports: F16/BF16 with K % 8 == 0, Q8_0/Q4_0/Q4_1; F32 never)
// launch_matmul_group uses it for the rows matmul_tc_rows gives: by PYSPEC_CUDA_TC, for every row
// at every M (1), for no row (0), or by default for the prompt columns, output rows taking the CUDA
// cores, except in a backend made for wide batches (kTcAllRowsMinSeqs sequences or more), where
// every row of a float weight takes the tensor cores. A row's kind is its own (whether it wants
// logits), never its neighbours', and a backend's choice is fixed when it is made, so invariant 7
// holds: each kind of row has one computation in any batch. The setting is read at each compute (a
// backend's captured CUDA graphs keep the kernel they were captured with; matmul_tc_setting() is
// part of their key).
// Two kernels compute it, with the same bits for every output: the wide one (a whole group per
// call) and, for M <= kMatmulTcNarrowMaxM, the narrow one (cuda/matmul_tc_narrow.cu: a warp per 16
// weight rows and K segment, a whole group per launch), which returns false where the rows'
// alignment does not suit it or the scratch is too small.
int matmul_tc_setting();
// The copy-engine row groups for one-column 16-bit MUL_MATs (cuda/matmul_rows_tma.cuh), read from
// the environment at each compute and part of the CUDA graphs' key: 0 off (the default;
// PYSPEC_CUDA_ROW_TMA=1 turns them on), else kRowTmaOn plus kRowTmaShallow for the 8-stage ring
// (PYSPEC_CUDA_ROW_TMA_STAGES=8) and kRowTmaTriggerFirst for the next launch let in before the
// wait (PYSPEC_CUDA_ROW_TMA_TRIGGER=start). PYSPEC_CUDA_ROW_TMA_KINDS narrows which MUL_MATs take
// them, for A/B (any of n: with the norm prologue, e.g. q/k/v; g: gate/up SWIGLU; p: the others,
// e.g. o, down, the output head; default all): a kind left out sets its kRowTmaSkip* bit.
constexpr int kRowTmaOn = 1, kRowTmaShallow = 2, kRowTmaTriggerFirst = 4;
constexpr int kRowTmaSkipNorm = 8, kRowTmaSkipGlu = 16, kRowTmaSkipPlain = 32;
int matmul_row_tma_setting();
// The row-streaming kernels' grid (cuda/matmul_rows.cuh), read from the environment at each
// compute and part of the CUDA graphs' key: kRowBalanced for the balanced grid (the default;
// PYSPEC_CUDA_ROW_BALANCE=0 gives one item a warp). Both grids give the same bits.
// kRowEvictFirst (on unless PYSPEC_CUDA_L2_EVICT_FIRST=0; H200 Qwen3-4B tg128 +0.8%): their
// weight loads mark the lines L2 evict-first (weight_policy). A cache hint: the same bits.
// kRowNormEarly (on unless PYSPEC_CUDA_NORM_EARLY=0; H200 Qwen3-4B tg128 +6.3%): a norm
// prologue's weights, where constant, are copied into shared memory before the PDL wait
// (stage_norm_weights). The same values: the same bits.
// kRowDeep (on unless PYSPEC_CUDA_ROW_DEEP=0; H200 Qwen3-4B tg128 +3.1%): a launch without the
// norm prologue whose items fit one block of kDeepWarps a SM at one item a warp (Qwen3-4B's o and
// down: 1,280 items each, which leave 40% of the balanced grid's warps idle) runs on that grid
// instead, each warp keeping 8 units a lane of both rows in flight (two rounds of 4, the next
// round's loads issued before the current one's sums; 8 KB) where the balanced grid asks for 4
// and then waits for them: the registers that one block a SM frees go to bytes in flight, which
// at one item a warp is what the launch lacks. The same units in the same order: the same bits.
// kRowPiped (on unless PYSPEC_CUDA_ROW_PIPED=0; H200 Qwen3-4B tg128 +3.7%): every other balanced
// launch (q/k/v, gate/up, the head: several items a warp, the norm prologue) feeds each warp's
// items as one stream of rounds of 4 units, the next round (the next item's first, at an item's
// end) asked for before this one's sums, where the plain feed stops at every round
// (stream_items_piped). The same grid, the same units in the same order: the same bits.
// kRowPipedOneBlock (on unless PYSPEC_CUDA_ROW_PIPED_ONE_BLOCK=0; H200 Qwen3-4B tg128 +2.2%):
// the piped launches on one block of 16 warps a SM instead of two of 8: the same 2,112 warps, but
// each SM stages (and normalises) the column once, not twice. The piped kernels' 96-114
// registers let 16 warps fit. The same bits.
// kRowRoom (on unless PYSPEC_CUDA_ROW_ROOM=0; H200 Qwen3-4B tg128 +1.8%): a balanced launch
// asked to leave room (launch_matmul_group's room: the q/k/v launch of a decode step, whose
// outputs the attention reads next) gives that many SMs' worth of its blocks half a share of the
// items (Parts::light, block_items), so those SMs come free halfway through it. The decode
// attention's blocks (~140 KB of shared memory) cannot sit beside a row launch's block (its
// registers fill the SM), so they used to become resident only as q/k/v's blocks left, and their
// work before the PDL wait (the mask read, the first page's copies) ran after q/k/v, on the
// step's critical path; on the SMs freed early they start while q/k/v streams. The same items in
// the same order, only over blocks differently: the same bits.
constexpr int kRowBalanced = 1, kRowEvictFirst = 2, kRowNormEarly = 4, kRowDeep = 8, kRowPiped = 16,
              kRowPipedOneBlock = 32, kRowRoom = 64;
int matmul_row_stream_setting();
// What a narrow tensor-core launch over `rows` weight rows in all (the parts of a group together)
// at batch m needs; zeros where it needs none.
SplitScratchNeed matmul_tc_narrow_scratch(DType wtype, int64_t k, int64_t rows, int64_t m);
// The same for a wide launch (the halves of the activations, and of block-type weights up to a
// cap); zeros where it needs none (m <= kMatmulTcNarrowMaxM). Without it the wide call still runs,
// on a slower kernel with the same bits.
SplitScratchNeed matmul_tc_wide_scratch(DType wtype, int64_t k, int64_t rows, int64_t m);
// Decode steps of this many sequences or more make a batch of output rows compute-bound on the CUDA
// cores: a backend made for that many takes the tensor cores for every row of a float weight.
// Measured on the H200 (Qwen3-4B F16, every sequence decoding; default against PYSPEC_CUDA_TC=1):
// 2 sequences 386-392 against 382-391 t/s, 3: 414 against 549-571, 4: 567 against 729, 8: 704
// against 1,364; one sequence alone in such a context decodes ~15% slower (the narrow kernel). 8
// takes the large gain; 3-4 (smaller gains at full occupancy, the same loss with one busy slot)
// stay on the CUDA cores for now.
constexpr int kTcAllRowsMinSeqs = 8;
TcRows matmul_tc_rows(int setting, DType wtype, int64_t k, bool wide_batches);
// Whether prompt columns take the tensor cores apart from the other rows (the default setting).
bool matmul_tc_prompt_path();
bool matmul_tc_supports(DType wtype, int64_t k);
constexpr int64_t kMatmulTcNarrowMaxM = 16;
void launch_matmul_tc_wide(DType wtype, const MatmulPart* parts, int n_parts, int64_t k, const float* x,
                           int64_t x_stride, int64_t m, const SplitScratch& scratch, cudaStream_t s);
bool launch_matmul_tc_narrow(DType wtype, const MatmulPart* parts, int n_parts, int64_t k, const float* x,
                             int64_t x_stride, int64_t m, const SplitScratch& scratch, cudaStream_t s);

}  // namespace cuda
}  // namespace pyspec
