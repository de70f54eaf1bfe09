// The CUDA backend's class (cuda/cuda_backend.h makes it): its state, and its members, defined in
// three files along the backend's seam:
// - cuda/cuda_backend.cu: the backend itself: device memory, host <-> device copies, CUDA graphs
//   (capture, replay, their cache) and the loop that runs a graph's nodes in order (run_ops);
// - cuda/backend_copies.cu: the small copies queued and run as one launch (queue_piece);
// - cuda/backend_dispatch.cu: what each node launches (run_node), and the fusions that launch
//   several nodes at once (MUL_MAT groups with their norm prologue and residual / SwiGLU
//   epilogues, pairs of row-wise ops, the decode row's RoPE + K/V store + attention).
// Only those files include this header.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/backend.h"
#include "cuda/graph_cache.cuh"
#include "cuda/kernels.h"

namespace pyspec {
namespace cuda_backend {

using cuda::TDesc;
using cuda::check;

class CudaBackend final : public Backend {
public:
    CudaBackend(int device, bool wide_batches);

    ~CudaBackend() override;

    const char* name() const override { return "CUDA"; }

    void* alloc_persistent(size_t bytes) override;

    void apply_plan(Graph& graph, const AllocationPlan& plan) override;

    void compute(Graph& graph) override;

    // PYSPEC_CUDA_STEP_TIMES=1: events around each replay's launch (after the inputs' copies, so
    // they time the graph alone). A replay's time is collected at the next one, whose step has
    // normally been read by then; otherwise this waits for it (the timing mode only).
    void replay_timing_begin();
    void replay_timing_end();

    // A compute whose key has no instantiated graph: eager on a first sighting or after a failed
    // capture, else captured, instantiated and launched.
    void capture_or_run_eager(Graph& graph, uint64_t h);

    void write(const Tensor& t, const void* src, size_t bytes, size_t offset) override;

    void read(const Tensor& t, void* dst, size_t bytes, size_t offset) override;

    // Every copy into pinned memory, the error word with them, one wait, then out to dst.
    void read_many(const std::vector<ReadRequest>& reads) override;

    // read_many's copies and the error word, queued into a pinned slot of their own behind an
    // event; finish_reads waits for that event only, so the work queued after the reads (the next
    // step, already launched) keeps running. The input staging is not reset here (later copies
    // may still read it); stage() starts over after a full synchronisation.
    ReadTicket read_many_async(const std::vector<ReadRequest>& reads) override;

    // The pinned staging the reads take, each at a 64-byte boundary (bounds checked here).
    static constexpr size_t kReadAlign = 64;
    static size_t staged_size(size_t bytes) { return (bytes + kReadAlign - 1) / kReadAlign * kReadAlign; }
    static size_t staging_bytes_for(const std::vector<ReadRequest>& reads);

    // Queues each read's copy into staging (staging_dev: its mapped address, for queue_piece); a
    // host external never uploaded stays where it is (host[i], read in place at delivery).
    void queue_reads(const std::vector<ReadRequest>& reads, char* staging, char* staging_dev,
                     std::vector<const char*>& host);

    // Out of staging (or the host external) to each read's destination, once its copies are done.
    static void deliver_reads(const std::vector<ReadRequest>& reads, const char* staging,
                              const std::vector<const char*>& host);

    void finish_reads(ReadTicket ticket) override;

    void copy(const Tensor& dst, const Tensor& src, size_t bytes) override;

    size_t arena_bytes() const override { return arena_size_; }
    bool computes_asynchronously() const override { return true; }
    // By default prompt rows take the tensor cores and output rows the CUDA cores (cuda/kernels.h).
    bool prompt_rows_have_own_path() const override { return cuda::matmul_tc_prompt_path(); }

    void set_profiling(bool on) override { profiling_ = on; }

    OpProfile op_profile() const override;

private:
    // --- execution ---------------------------------------------------------------------------

    // Which rows of the MUL_MATs over weight w take the tensor cores in this compute.
    cuda::TcRows tc_rows(const Tensor& w) const {
        return cuda::matmul_tc_rows(tc_setting_, w.dtype, w.ne[0], wide_batches_);
    }

    // Grows the split scratch to what this graph's largest launch needs (the narrow tensor-core
    // MUL_MAT's K segments, the wide one's halves and split-K partials, a group's parts together; a
    // long decode row's attention pages; a long row's ARGMAX / TOP_K slices), before anything runs
    // or is captured. Grow-only; captured graphs point at the old buffers, so they go with them.
    void reserve_split_scratch(const Graph& g);

    // The pre-pass: resolves the device address of every tensor an op reads or writes (uploading
    // host externals on first use), so that nothing allocates while a capture is open. False when
    // something failed (the eager run then meets the same failure and reports it with the op's
    // name).
    bool resolve_all(const Graph& g);

    void run_eager(Graph& graph);

    // Captures run_ops(graph) into an instantiated graph; nullptr (logged, key marked) on failure.
    // Nothing runs during a capture, so the caller may then run the graph eagerly.
    cudaGraphExec_t capture(Graph& graph, uint64_t h);

    void capture_failed(uint64_t h, const std::string& why);

    // Eager execution with an event before every op and one after the last; after one
    // synchronisation each op's device time is the gap between its event and the next.
    // A fused launch (matmul groups) counts once, under its first node's op.
    void run_profiled(Graph& graph);

    // Executes every computed node in order on the stream (eagerly, or into an open capture);
    // before(id) runs ahead of each launch.
    void run_ops(Graph& graph);

    template <typename BeforeOp>
    void run_ops(Graph& graph, BeforeOp before);

    // Bytes [first, second) a tensor spans on the device (span() below): the fusions' safety checks.
    using Span = std::pair<const char*, const char*>;

    // The MUL_MAT at id and the next ones (up to kMaxMatmulParts) that read the same activations
    // with weights of the same type and K (matmuls_sharing_activations: q/k/v, gate/up), as one
    // launch. Running them early is safe: no node computes between them, so no
    // tensor dies there whose memory a later member's output could have been planned into; and
    // member outputs that overlap what the launch reads (act) or each other (never planned so)
    // end the group. Returns the number of members taken, their parts and the last one's id.
    int group_parts(const Graph& g, int id, const Span& act, std::vector<cuda::MatmulPart>& parts, int& last);

    // The RMS_NORM at id as the prologue of the MUL_MAT group right after it (cuda::MatmulNorm:
    // a decode step's attention and FFN norms cost no launch of their own; the output norm's
    // input usually shares memory with the logits, so it stays apart): returns that group's first
    // node, or -1 where the norm runs apart. The group's parts are collected again when it runs
    // (eager runs and captures only: replays skip all of this). The group's kernel reads the norm's
    // input instead of its output, so: nothing computes between them (the input is as the norm
    // saw it), every reader of the output is in the group and the output is no graph output (it
    // is never written), no member's output (nor the residual's or SwiGLU's, checked where those
    // are fused) overlaps the input, and the kernel path has a norm prologue for this batch.
    int norm_prologue_target(const Graph& g, int id);

    // The blocks of the decode attention that the MUL_MAT group ending at `last` feeds (its q
    // heads: the walking launch's grid, and the first wave of a split one), when the nodes after
    // the group up to a one-row ATTENTION are only its row-wise ops (q/k norms, RoPE, K/V store);
    // else 0. The group's launch leaves that many SMs free for them (cuda::kRowRoom).
    static int attention_room(const Graph& g, int last);

    // The MUL_MAT group at id (group_parts) in one launch, with the residual ADD or the SwiGLU
    // after it as the epilogue where they fit, and with the RMS_NORM `norm` (norm_prologue_target
    // said yes) as its prologue when norm >= 0. Returns the last node run.
    int run_mul_mat_group(const Graph& g, int id, int norm = -1);

    // --- row-wise ops, alone or in pairs -----------------------------------------------------

    // The job of a ROPE, RMS_NORM or SET_ROWS node (SET_ROWS writes its source 0, the cache),
    // after the checks that op gets.
    cuda::OpJob op_job(const Graph& g, int id);

    // One launch of n jobs of node id's op, with id's parameters (a pair shares them).
    void launch_jobs(const Graph& g, int id, const cuda::OpJob* jobs, int n);

    // One RoPE launch of jobs with node id's positions and parameters; cells: the K/V SET_ROWS
    // cells when the jobs store into caches.
    void launch_rope(const Graph& g, int id, const cuda::RopeJob* jobs, int n, const int32_t* cells);

    // Whether optional source src (-1: none) is a graph leaf's memory (an input, a weight), which no
    // kernel of the graph writes, so a kernel may read it before its PDL wait.
    static bool is_leaf(const Graph& g, int src) { return src < 0 || g[g.root_of(src)].op == Op::NONE; }

    // The next node after i that computes (not a leaf or a view), or g.size().
    static int next_computed(const Graph& g, int i);

    // The q/k RoPE pair (a, b) and the K/V SET_ROWS pair right after it as one launch: when the
    // next computed nodes are SET_ROWS(k_cache, b's rows as one contiguous reshape, cells) and
    // SET_ROWS(v_cache, v, the same cells) into F16/F32 caches whose rows match, the k job also
    // writes its rotated rows into k_cache and a third job copies v into v_cache (the same
    // conversion as SET_ROWS). Nothing written may overlap anything read. Returns the last
    // SET_ROWS, or -1 (nothing launched) when the pattern or a check does not hold.
    int run_rope_and_store(const Graph& g, int a, int b);

    // The K/V SET_ROWS pair (c, d) that run_rope_and_store runs with the q/k RoPE pair (a, b):
    // false when the pattern or a check does not hold.
    bool rope_store_nodes(const Graph& g, int a, int b, int& c, int& d);

    // A single decode row's q/k RoPE pair (a, b), its K/V SET_ROWS pair and the ATTENTION that reads
    // them as one launch of the staged attention kernel (cuda::DecodeRope): when the SET_ROWS pair
    // fuses with the RoPE pair (rope_store_nodes), the next computed node is ATTENTION over a's rows
    // and the two SET_ROWS, with one row, no prompt rows and F16 caches, the positions, frequency
    // factors and cells are graph leaves (read before the PDL wait), and the attention's output
    // overlaps nothing the launch reads or writes (the planner keeps those live through the
    // ATTENTION: core/planner.cpp). Returns the ATTENTION's id, or -1 (nothing launched).
    // nq, nk (or -1): the per-head RMS_NORM pair whose outputs a and b rotate (Qwen3's q/k norms),
    // run by the same launch when a and b are their outputs' only readers.
    int run_rope_store_attention(const Graph& g, int a, int b, int nq = -1, int nk = -1);

    // Bytes [first, second) a tensor spans on the device, and whether two spans share a byte: the
    // fusions' safety checks.
    Span span(const Graph& g, int id);
    static bool overlaps(const Span& x, const Span& y) { return x.first < y.second && y.first < x.second; }

    // The node at id and the next computed one as one launch when that one is the same op with
    // the same parameters (q/k RoPE over the same positions, K/V SET_ROWS into the same cells,
    // Qwen3's q/k norms) and neither touches what the other writes: the second reads nothing
    // the first writes, and neither writes what the other reads or writes. The spans are checked
    // on the device addresses, so no plan can make the pair unsafe. Returns the last node run.
    int run_op_pair(const Graph& g, int id);

    bool pairable(const Graph& g, int ia, int ib);

    // The device memory every computing node of the graph writes, for constant(): a MUL_MAT may
    // load weights no node writes before its PDL wait. Kept as disjoint spans sorted by address
    // (the planner reuses memory, so the nodes' outputs merge into a few), so constant() is a
    // binary search, not a pass over every node for every MUL_MAT of an eager run or capture.
    void mark_written(const Graph& g);

    // Whether tensor id is a leaf's memory that no node of the graph writes (model weights; not a
    // KV cache, which SET_ROWS writes, through whichever tensor). Inputs written before compute()
    // are ordered by the stream.
    bool constant(const Graph& g, int id);

    // Whether no computing node of the graph but w0 and w1 writes the memory of tensors id0 and id1
    // (a decode attention's K and V caches, which only its own fused SET_ROWS pair may write: then
    // the launch may copy their old cells before its PDL wait). One pass over the graph, for the
    // 1-row launches of an eager run or a capture.
    bool written_only_by(const Graph& g, int id0, int id1, int w0, int w1);

    // How many nodes read each tensor (as a source or as a view's base), for run_mul_mat_group.
    void count_uses(const Graph& g);

    // The residual epilogue: when the next computed node after MUL_MAT id is an ADD of its product
    // and a residual of the same shape, and nothing else reads the product (not an output, no
    // view of it), part is changed to store product + residual straight into the ADD's output and
    // the ADD's id is returned (it runs with the MUL_MAT); else -1 and part is left alone. The
    // ADD's output must not overlap the activations (still being read); it may be the residual
    // itself (each output reads its own residual element before storing), or apart from it.
    int residual_add_after(const Graph& g, int id, const Span& act, cuda::MatmulPart& part);

    // The SwiGLU epilogue: when the next computed node after MUL_MATs gate and up (one group) is
    // SWIGLU(gate, up), nothing else reads either product, and its output is F32 rows of their
    // shape apart from the activations, returns its id (launch_matmul_glu stores silu(gate) * up
    // there and the products never reach memory); else -1.
    int swiglu_after(const Graph& g, int gate, int up, const Span& act);

    // A MUL_MAT node's launch parameters, after the checks every MUL_MAT gets.
    cuda::MatmulPart matmul_part(const Graph& g, int id);

    // --- memory ------------------------------------------------------------------------------

    bool on_device(const char* p) const;

    // Device address of [p, p + bytes): p itself on the device, else inside an upload (nullptr
    // when none holds it).
    char* device_address(char* p, size_t bytes) const;

    char* upload(const void* host, size_t bytes, const std::string& name);

    // The device address of tensor id's data for this compute.
    char* dptr(const Graph& g, int id);

    TDesc desc(const Graph& g, int id);

    // Throws for the device error bits a read brought back, after clearing them on the device.
    void raise_error_word(unsigned bits);

    // Room for `bytes` of input in the pinned staging buffer, or nullptr (too large for it: the
    // caller copies from pageable memory). The room is free again after the next
    // synchronisation: when full, this one runs the queued pieces, waits for the queued copies and
    // starts over.
    char* stage(size_t bytes);

    // --- small copies as one launch (cuda/backend_copies.cu) ----------------------------------
    // Between two decode steps' graphs the stream ran each input write, the fed tokens' copy and
    // each output read as its own cudaMemcpyAsync, one after the other. Copies of up to
    // kPieceMaxBytes are queued instead and run together by one launch (cuda::launch_copy_pieces)
    // before the next stream operation: every member that queues work on the stream runs
    // flush_pieces() first, so the stream's order is the order of the calls.
    static constexpr size_t kPieceMaxBytes = size_t{64} << 10;
    // Whether a copy of `bytes` is queued (PYSPEC_CUDA_BATCH_COPIES=0 queues none, for A/B).
    bool queues(size_t bytes) const { return batch_copies_ && bytes <= kPieceMaxBytes; }
    // Queues a copy from src to dst (addresses the device can use; pinned host memory's mapped
    // address); runs the queue first where it is full or a queued piece's bytes overlap this one's.
    void queue_piece(const char* src, char* dst, size_t bytes);
    // Runs the queued pieces (one cudaMemcpyAsync for one, one launch for more), then records the
    // events of the asynchronous reads queued before (AsyncRead::recorded).
    void flush_pieces();
    // Queues the error word's copy into dst (a pinned word's mapped address) behind a read's pieces.
    void queue_error_word_read(unsigned* dst);
    // The address the device uses for pinned host memory from cudaMallocHost.
    static char* mapped(void* host);

    // --- ops ---------------------------------------------------------------------------------

    static void require(bool ok, const Tensor& t, const char* why);

    void run_node(const Graph& g, int id);

    int device_;
    // Made for wide batches (kTcAllRowsMinSeqs sequences or more): float weights' output rows take
    // the tensor cores too (cuda::matmul_tc_rows). Fixed for the backend's life.
    bool wide_batches_;
    bool step_times_;                    // PYSPEC_CUDA_STEP_TIMES=1 when made: replays timed by events
    cudaEvent_t replay_events_[2] = {nullptr, nullptr};
    bool replay_timed_ = false;          // replay_events_ hold a replay not yet counted
    int tc_setting_ = -1;  // PYSPEC_CUDA_TC, read at each compute
    cudaStream_t stream_ = nullptr;
    unsigned* err_ = nullptr;
    unsigned* err_host_ = nullptr;                                 // pinned: where reads bring the word back
    static constexpr size_t kStagingBytes = size_t{4} << 20;      // pinned input staging (stage())
    char* staging_ = nullptr;
    char* staging_dev_ = nullptr;                                  // mapped(staging_)
    size_t staged_ = 0;                                            // bytes of staging_ in use
    char* read_staging_ = nullptr;                                 // pinned: where read_many lands
    char* read_staging_dev_ = nullptr;                             // mapped(read_staging_)
    unsigned* err_host_dev_ = nullptr;                             // mapped(err_host_)
    bool batch_copies_ = true;                                     // PYSPEC_CUDA_BATCH_COPIES, read when made
    cuda::CopyPieces pending_;                                     // the queued pieces (queue_piece)
    // read_many_async's slots: pinned staging, the error word and an event each (a decode step
    // launched ahead of the one being waited for holds a second one).
    struct AsyncRead {
        uint64_t ticket = 0;
        cudaEvent_t done = nullptr;
        char* staging = nullptr;
        char* staging_dev = nullptr;  // mapped(staging)
        size_t staging_bytes = 0;
        unsigned* err = nullptr;
        unsigned* err_dev = nullptr;  // mapped(err)
        bool recorded = false;        // done is recorded (after its pieces ran: flush_pieces)
        std::vector<ReadRequest> reads;
        std::vector<const char*> host;
    };
    std::vector<AsyncRead> in_flight_reads_, free_read_slots_;
    uint64_t read_tickets_ = 0;

    // A free slot whose staging holds `bytes` (made or grown here: nothing reads it now).
    AsyncRead take_read_slot(size_t bytes);
    size_t read_staging_bytes_ = 0;
    char* arena_ = nullptr;
    size_t arena_size_ = 0;
    cuda::SplitScratch scratch_;                                   // split partials (reserve_split_scratch)
    std::map<char*, size_t> persistent_;                           // device base -> bytes
    std::map<std::pair<uintptr_t, size_t>, char*> uploads_;        // (host address, bytes) -> device copy
    std::vector<char*> resolved_;                                  // per tensor, during compute
    std::vector<int> uses_;                                        // readers per tensor (count_uses)
    std::vector<std::pair<const char*, const char*>> written_;    // what the graph's nodes write, disjoint, sorted (mark_written)
    cuda::GraphCache graphs_;                                      // instantiated graphs by key
    std::vector<uint64_t> key_;                                    // the key of this compute
    bool capture_failure_logged_ = false;
    // The decode RoPE's angle table (cuda::DecodeRope::angles, kMaxRopeAngles floats, made at first
    // use) and what the table holds in this compute: the positions and frequencies of the launch
    // that stored it, valid from that launch to the end of the compute (run_ops clears it).
    static constexpr int kMaxRopeAngles = 256;
    float* rope_angles_ = nullptr;
    struct StoredAngles {
        bool valid = false;
        const int32_t* pos = nullptr;
        const float* factors = nullptr;
        int n_rot = 0;
        double base = 0.0, fscale = 0.0;
        bool operator==(const StoredAngles& o) const {
            return valid == o.valid && pos == o.pos && factors == o.factors && n_rot == o.n_rot && base == o.base &&
                   fscale == o.fscale;
        }
    };
    StoredAngles stored_angles_;
    bool profiling_ = false;
    std::vector<cudaEvent_t> events_;                              // reused by run_profiled
    std::vector<double> op_seconds_ = std::vector<double>(static_cast<size_t>(Op::COUNT), 0.0);
    std::vector<int64_t> op_calls_ = std::vector<int64_t>(static_cast<size_t>(Op::COUNT), 0);
};

}  // namespace cuda_backend
}  // namespace pyspec
