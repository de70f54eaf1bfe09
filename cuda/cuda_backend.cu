// The CUDA backend: memory (device arena, persistent buffers, uploads of host-resident external
// tensors), host <-> device copies, and the op dispatch onto one stream.
//
// External tensors. A graph's external tensors carry the pointer their builder set: KV caches
// come from alloc_persistent (device memory already), weights point into the host-mmapped GGUF
// (and feeds from numpy in op tests point at host arrays). Tensor::data is never rewritten for
// external tensors, because Model/DraftModel and graph builders keep and reuse those host
// pointers (e.g. building each step's graph from them, dflash's d2t rows read on the host).
// Instead, compute() resolves every operand's device address: a pointer inside the arena or a
// persistent buffer is used as is; any other pointer belongs to a host external tensor (the root
// of the view chain), which is uploaded once, keyed by (host address, bytes), and the operand
// gets the device copy + its offset. Uploads live as long as the backend: weights never change
// while a backend lives (a host external that is rewritten in place would be seen stale). Results
// that SET_ROWS writes into a host external land in its device copy: read() of that tensor (or a
// view of it) returns them; the host array itself is not updated.
//
// Ordering: everything (kernels, uploads, memsets, write/read copies) goes on the backend's
// one non-blocking stream, so nothing relies on the legacy default stream's implicit syncs.
//
// Errors: CUDA API failures and launch errors throw std::runtime_error naming the op (and the
// tensor). Faults inside kernels surface at the next synchronising call (read). Kernels that find
// bad indices (get_rows/set_rows ids, attention spans outside the cache) set bits in a device
// error word; read() checks it after synchronising and throws, as the CPU backend would have.
//
// CUDA graphs (issue 8 item 2; cuda/cuda_graphs.h, cuda/graph_cache.cuh). compute() keys the
// launch sequence by the graph's full structure, op parameters and data pointers (a replay needs
// nothing else); on a miss it resolves every operand's device address (the pre-pass: weight
// uploads happen here, never inside a capture). First sighting of a key: eager (warm-up). Second: the ops are
// captured on the stream (thread-local capture mode, so an allocation by this thread would fail the
// capture instead of going unnoticed), instantiated and launched. Later: cudaGraphLaunch of the
// cached exec. Nothing in the launch path allocates (the arena only grows in apply_plan, which
// clears the cache; profiling events are created outside captures) or reads device data on the host, and
// every per-call value (tokens, positions, masks, bases, cells, noise) is an input tensor written
// before compute(), so a replay launches exactly what the eager run would. A failed capture runs the
// graph eagerly, logs one line and never retries that key. The error word is not reset by the
// graph: kernels OR bits into it in replays as in eager runs, and read() clears it when it reports,
// so errors surface at the same read() either way. PYSPEC_CUDA_GRAPHS=0 (or set_cuda_graphs(false))
// runs everything eagerly; PYSPEC_CUDA_GRAPH_CACHE bounds the instantiated graphs per backend (64).
#include "cuda/cuda_backend.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/cuda_graphs.h"
#include "cuda/graph_cache.cuh"
#include "cuda/kernels.h"

namespace pyspec {
namespace {

using cuda::TDesc;
using cuda::check;

class CudaBackend final : public Backend {
public:
    CudaBackend(int device, bool wide_batches)
        : device_(device),
          wide_batches_(wide_batches),
          step_times_(cuda::env_switch("PYSPEC_CUDA_STEP_TIMES") == 1),
          graphs_(cuda::graph_cache_capacity_from_env()) {
        check(cudaSetDevice(device_), "cudaSetDevice");
        check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
        cudaError_t e = cudaMalloc(&err_, sizeof(unsigned));
        if (e == cudaSuccess) e = cudaMemsetAsync(err_, 0, sizeof(unsigned), stream_);
        if (e == cudaSuccess) e = cudaMallocHost(&err_host_, sizeof(unsigned));
        if (e == cudaSuccess) e = cudaMallocHost(&staging_, kStagingBytes);
        if (e != cudaSuccess) {
            if (staging_) cudaFreeHost(staging_);
            if (err_host_) cudaFreeHost(err_host_);
            if (err_) cudaFree(err_);
            cudaStreamDestroy(stream_);
            cuda::throw_cuda("allocating the error word and the input staging", e);
        }
        *err_host_ = 0;
    }

    ~CudaBackend() override {
        cudaSetDevice(device_);
        cudaStreamSynchronize(stream_);
        graphs_.clear();
        for (auto& u : uploads_) cudaFree(u.second);
        for (auto& p : persistent_) cudaFree(p.first);
        if (arena_) cudaFree(arena_);
        if (scratch_.partial) cudaFree(scratch_.partial);
        if (scratch_.counters) cudaFree(scratch_.counters);
        if (scratch_.halves) cudaFree(scratch_.halves);
        if (err_) cudaFree(err_);
        if (err_host_) cudaFreeHost(err_host_);
        if (staging_) cudaFreeHost(staging_);
        if (read_staging_) cudaFreeHost(read_staging_);
        for (auto* list : {&in_flight_reads_, &free_read_slots_}) {
            for (AsyncRead& a : *list) {
                if (a.done) cudaEventDestroy(a.done);
                if (a.err) cudaFreeHost(a.err);
                if (a.staging) cudaFreeHost(a.staging);
            }
        }
        for (cudaEvent_t ev : events_) cudaEventDestroy(ev);
        for (cudaEvent_t ev : replay_events_) {
            if (ev) cudaEventDestroy(ev);
        }
        cudaStreamDestroy(stream_);
    }

    const char* name() const override { return "CUDA"; }

    void* alloc_persistent(size_t bytes) override {
        check(cudaSetDevice(device_), "cudaSetDevice");
        const size_t n = bytes == 0 ? 256 : bytes;
        void* p = nullptr;
        check(cudaMalloc(&p, n), "alloc_persistent: cudaMalloc");
        const cudaError_t e = cudaMemsetAsync(p, 0, n, stream_);
        if (e != cudaSuccess) {
            cudaFree(p);
            cuda::throw_cuda("alloc_persistent: cudaMemset", e);
        }
        persistent_.emplace(static_cast<char*>(p), n);
        return p;
    }

    void apply_plan(Graph& graph, const AllocationPlan& plan) override {
        if (plan.offset.size() != static_cast<size_t>(graph.size())) {
            throw std::logic_error("apply_plan: the plan was made for a different graph");
        }
        check(cudaSetDevice(device_), "cudaSetDevice");
        if (plan.arena_bytes > arena_size_) {  // grow-only; cudaFree waits for work in flight
            graphs_.clear();  // their addresses point into the old arena
            if (arena_) check(cudaFree(arena_), "apply_plan: cudaFree");
            arena_ = nullptr;
            arena_size_ = 0;
            void* p = nullptr;
            check(cudaMalloc(&p, plan.arena_bytes), "apply_plan: cudaMalloc");
            arena_ = static_cast<char*>(p);
            arena_size_ = plan.arena_bytes;
            check(cudaMemsetAsync(arena_, 0, arena_size_, stream_), "apply_plan: cudaMemset");
        }
        assign_addresses(graph, plan, arena_);
    }

    void compute(Graph& graph) override {
        check(cudaSetDevice(device_), "cudaSetDevice");
        tc_setting_ = cuda::matmul_tc_setting();
        reserve_split_scratch(graph);
        resolved_.assign(static_cast<size_t>(graph.size()), nullptr);
        if (profiling_) {  // op by op between events: a replay would hide the ops
            run_profiled(graph);
            return;
        }
        if (!cuda_graphs_enabled() || graphs_.capacity() == 0) {
            run_eager(graph);
            return;
        }
        // The key holds the tensors' data pointers as the graph has them, not their resolved
        // device addresses: resolving is a function of those pointers that holds while the cache
        // holds graphs (arena and persistent pointers are their own device addresses, a host
        // external's copy is made once and kept; a moved arena gives new pointers, new scratch
        // empties the cache), so an equal key means equal addresses and a replay resolves
        // nothing. Resolving every tensor took ~30 us of a SmolLM2 step's host time (H200).
        cudaGraphExec_t exec = graphs_.find_recent(graph);  // a step like the one before
        if (!exec) {
            const uint64_t h = cuda::graph_exec_key(graph, key_);
            exec = graphs_.find(h, key_);
            if (!exec) {
                capture_or_run_eager(graph, h);
                return;
            }
        }
        if (step_times_) replay_timing_begin();
        check(cudaGraphLaunch(exec, stream_), "cudaGraphLaunch");
        if (step_times_) replay_timing_end();
        cuda::count_graph_event(cuda::GraphEvent::Replay);
    }

    // PYSPEC_CUDA_STEP_TIMES=1: events around each replay's launch (after the inputs' copies, so
    // they time the graph alone). A replay's time is collected at the next one, whose step has
    // normally been read by then; otherwise this waits for it (the timing mode only).
    void replay_timing_begin() {
        if (!replay_events_[0]) {
            check(cudaEventCreate(&replay_events_[0]), "step times: cudaEventCreate");
            check(cudaEventCreate(&replay_events_[1]), "step times: cudaEventCreate");
        }
        if (replay_timed_) {
            replay_timed_ = false;
            check(cudaEventSynchronize(replay_events_[1]), "step times: cudaEventSynchronize");
            float ms = 0.0f;
            check(cudaEventElapsedTime(&ms, replay_events_[0], replay_events_[1]), "step times: cudaEventElapsedTime");
            cuda::count_replay_gpu_time(ms);
        }
        check(cudaEventRecord(replay_events_[0], stream_), "step times: cudaEventRecord");
    }
    void replay_timing_end() {
        check(cudaEventRecord(replay_events_[1], stream_), "step times: cudaEventRecord");
        replay_timed_ = true;
    }

    // A compute whose key has no instantiated graph: eager on a first sighting or after a failed
    // capture, else captured, instantiated and launched.
    void capture_or_run_eager(Graph& graph, uint64_t h) {
        if (!resolve_all(graph)) {
            run_eager(graph);  // after a failed pre-pass, the eager run raises the error in context
            return;
        }
        if (graphs_.failed(h) || !graphs_.sighted_before(h)) {
            run_eager(graph);  // first sighting: the warm-up
            return;
        }
        cudaGraphExec_t exec = capture(graph, h);
        if (!exec) {
            run_eager(graph);
            return;
        }
        const cudaError_t e = cudaGraphLaunch(exec, stream_);
        if (e != cudaSuccess) {
            cudaGraphExecDestroy(exec);
            capture_failed(h, std::string("cudaGraphLaunch: ") + cudaGetErrorString(e));
            run_eager(graph);
            return;
        }
        graphs_.insert(h, key_, exec);
        cuda::count_graph_event(cuda::GraphEvent::Capture);
    }

    void write(const Tensor& t, const void* src, size_t bytes, size_t offset) override {
        if (offset + bytes > t.nbytes()) throw std::logic_error("write past the end of tensor " + t.name);
        if (bytes == 0) return;
        check(cudaSetDevice(device_), "cudaSetDevice");
        char* p = static_cast<char*>(t.data) + offset;
        char* d = device_address(p, bytes);
        if (!d) throw std::logic_error("cuda backend: write to tensor " + t.name + " whose memory is not on the device");
        // Through the pinned staging the copy is queued at once; from pageable memory the call
        // first stages the bytes itself. Either way the caller may reuse src when it returns, and
        // the copy is ordered before the next compute on the stream.
        if (char* staged = stage(bytes)) {
            std::memcpy(staged, src, bytes);
            check(cudaMemcpyAsync(d, staged, bytes, cudaMemcpyHostToDevice, stream_), "write: cudaMemcpyAsync");
        } else {
            check(cudaMemcpyAsync(d, src, bytes, cudaMemcpyHostToDevice, stream_), "write: cudaMemcpyAsync");
        }
    }

    void read(const Tensor& t, void* dst, size_t bytes, size_t offset) override {
        if (offset + bytes > t.nbytes()) throw std::logic_error("read past the end of tensor " + t.name);
        check(cudaSetDevice(device_), "cudaSetDevice");
        char* p = static_cast<char*>(t.data) + offset;
        char* d = bytes ? device_address(p, bytes) : nullptr;
        if (d) check(cudaMemcpyAsync(dst, d, bytes, cudaMemcpyDeviceToHost, stream_), "read: cudaMemcpyAsync");
        // The error word comes back with the data: one synchronisation per read.
        check(cudaMemcpyAsync(err_host_, err_, sizeof(unsigned), cudaMemcpyDeviceToHost, stream_),
              "reading the error word");
        check(cudaStreamSynchronize(stream_), "read: synchronising with the computation");
        staged_ = 0;  // every staged write has run
        raise_error_word(*err_host_);
        if (!d && bytes) std::memcpy(dst, p, bytes);  // a host external never uploaded: unchanged
    }

    // Every copy into pinned memory, the error word with them, one wait, then out to dst.
    void read_many(const std::vector<ReadRequest>& reads) override {
        const size_t total = staging_bytes_for(reads);
        check(cudaSetDevice(device_), "cudaSetDevice");
        if (total > read_staging_bytes_) {
            check(cudaStreamSynchronize(stream_), "read: waiting before the staging grows");
            if (read_staging_) cudaFreeHost(read_staging_);
            read_staging_ = nullptr;
            read_staging_bytes_ = 0;
            check(cudaMallocHost(&read_staging_, total), "read: allocating pinned staging");
            read_staging_bytes_ = total;
        }
        std::vector<const char*> host;
        queue_reads(reads, read_staging_, host);
        check(cudaMemcpyAsync(err_host_, err_, sizeof(unsigned), cudaMemcpyDeviceToHost, stream_),
              "reading the error word");
        check(cudaStreamSynchronize(stream_), "read: synchronising with the computation");
        staged_ = 0;  // every staged write has run
        raise_error_word(*err_host_);
        deliver_reads(reads, read_staging_, host);
    }

    // read_many's copies and the error word, queued into a pinned slot of their own behind an
    // event; finish_reads waits for that event only, so the work queued after the reads (the next
    // step, already launched) keeps running. The input staging is not reset here (later copies
    // may still read it); stage() starts over after a full synchronisation.
    ReadTicket read_many_async(const std::vector<ReadRequest>& reads) override {
        const size_t total = staging_bytes_for(reads);
        check(cudaSetDevice(device_), "cudaSetDevice");
        AsyncRead slot = take_read_slot(total);
        slot.reads = reads;
        queue_reads(reads, slot.staging, slot.host);
        check(cudaMemcpyAsync(slot.err, err_, sizeof(unsigned), cudaMemcpyDeviceToHost, stream_), "reading the error word");
        check(cudaEventRecord(slot.done, stream_), "read: cudaEventRecord");
        slot.ticket = ++read_tickets_;
        in_flight_reads_.push_back(std::move(slot));
        return in_flight_reads_.back().ticket;
    }

    // The pinned staging the reads take, each at a 64-byte boundary (bounds checked here).
    static constexpr size_t kReadAlign = 64;
    static size_t staged_size(size_t bytes) { return (bytes + kReadAlign - 1) / kReadAlign * kReadAlign; }
    static size_t staging_bytes_for(const std::vector<ReadRequest>& reads) {
        size_t total = 0;
        for (const ReadRequest& r : reads) {
            if (r.offset + r.bytes > r.t->nbytes()) throw std::logic_error("read past the end of tensor " + r.t->name);
            total += staged_size(r.bytes);
        }
        return total;
    }

    // Queues each read's copy into staging; a host external never uploaded stays where it is
    // (host[i], read in place at delivery).
    void queue_reads(const std::vector<ReadRequest>& reads, char* staging, std::vector<const char*>& host) {
        host.assign(reads.size(), nullptr);
        size_t at = 0;
        for (size_t i = 0; i < reads.size(); ++i) {
            const ReadRequest& r = reads[i];
            char* p = static_cast<char*>(r.t->data) + r.offset;
            char* d = r.bytes ? device_address(p, r.bytes) : nullptr;
            if (d) {
                check(cudaMemcpyAsync(staging + at, d, r.bytes, cudaMemcpyDeviceToHost, stream_), "read: cudaMemcpyAsync");
            } else {
                host[i] = p;
            }
            at += staged_size(r.bytes);
        }
    }

    // Out of staging (or the host external) to each read's destination, once its copies are done.
    static void deliver_reads(const std::vector<ReadRequest>& reads, const char* staging,
                              const std::vector<const char*>& host) {
        size_t at = 0;
        for (size_t i = 0; i < reads.size(); ++i) {
            const ReadRequest& r = reads[i];
            if (r.bytes) std::memcpy(r.dst, host[i] ? host[i] : staging + at, r.bytes);
            at += staged_size(r.bytes);
        }
    }

    void finish_reads(ReadTicket ticket) override {
        auto it = std::find_if(in_flight_reads_.begin(), in_flight_reads_.end(),
                               [ticket](const AsyncRead& a) { return a.ticket == ticket; });
        if (it == in_flight_reads_.end()) throw std::logic_error("cuda backend: finish_reads of an unknown ticket");
        AsyncRead slot = std::move(*it);
        in_flight_reads_.erase(it);
        const cudaError_t e = cudaEventSynchronize(slot.done);
        const unsigned bits = *slot.err;
        *slot.err = 0;
        free_read_slots_.push_back(slot);  // reusable whatever happens below
        check(e, "read: waiting for the computation");
        if (bits) {
            *err_host_ = bits;
            raise_error_word(bits);
        }
        deliver_reads(slot.reads, slot.staging, slot.host);
    }

    void copy(const Tensor& dst, const Tensor& src, size_t bytes) override {
        if (bytes > dst.nbytes() || bytes > src.nbytes()) throw std::logic_error("copy past the end of a tensor");
        if (bytes == 0) return;
        check(cudaSetDevice(device_), "cudaSetDevice");
        char* d = device_address(static_cast<char*>(dst.data), bytes);
        char* s = device_address(static_cast<char*>(src.data), bytes);
        if (!d || !s) throw std::logic_error("cuda backend: copy between tensors not on the device");
        if (d == s) return;
        if (d < s + bytes && s < d + bytes) throw std::logic_error("cuda backend: copy between overlapping tensors");
        check(cudaMemcpyAsync(d, s, bytes, cudaMemcpyDeviceToDevice, stream_), "copy: cudaMemcpyAsync");
    }

    size_t arena_bytes() const override { return arena_size_; }
    bool computes_asynchronously() const override { return true; }
    // By default prompt rows take the tensor cores and output rows the CUDA cores (cuda/kernels.h).
    bool prompt_rows_have_own_path() const override { return cuda::matmul_tc_prompt_path(); }

    void set_profiling(bool on) override { profiling_ = on; }

    OpProfile op_profile() const override {
        OpProfile rows;
        for (size_t i = 0; i < op_seconds_.size(); ++i) {
            if (op_calls_[i] != 0) rows.emplace_back(op_name(static_cast<Op>(i)), op_seconds_[i], op_calls_[i]);
        }
        return rows;
    }

private:
    // --- execution ---------------------------------------------------------------------------

    // Which rows of the MUL_MATs over weight w take the tensor cores in this compute.
    cuda::TcRows tc_rows(const Tensor& w) const {
        return cuda::matmul_tc_rows(tc_setting_, w.dtype, w.ne[0], wide_batches_);
    }

    // Grows the split scratch to what this graph's largest launch needs (the narrow tensor-core
    // MUL_MAT's K segments, the wide one's halves and split-K partials, a group's parts together; a
    // long decode row's attention pages), before anything runs or is captured. Grow-only; captured
    // graphs point at the old buffers, so they go with them.
    void reserve_split_scratch(const Graph& g) {
        // Only the tensor-core MUL_MAT kernels use it: every row's, or the prompt columns'.
        cuda::SplitScratchNeed need;
        for (int id = 0; id < g.size(); ++id) {
            const Tensor& t = g[id];
            if (t.op == Op::ATTENTION) {
                const Tensor& q = g[t.src[0]];
                // The rows left to the CUDA-core kernels: a prompt chunk's last row alone is split.
                const bool tc_rows = t.iparams[1] > 0 && cuda::attention_tc_enabled() &&
                                     cuda::attention_tc_shape(q.ne[0], g[t.src[1]].dtype);
                const int64_t rows = q.ne[2] - (tc_rows ? t.iparams[1] : 0);
                const cuda::SplitScratchNeed n = cuda::attention_split_scratch(q.ne[0], q.ne[1], rows, g[t.src[3]].ne[0]);
                need.partial_floats = std::max(need.partial_floats, n.partial_floats);
                need.n_counters = std::max(need.n_counters, n.n_counters);
                continue;
            }
            if (t.op != Op::MUL_MAT) continue;
            const cuda::TcRows rows_on_tc = tc_rows(g[t.src[0]]);
            const int64_t tc_cols = rows_on_tc == cuda::TcRows::All      ? g[t.src[1]].ne[1]
                                    : rows_on_tc == cuda::TcRows::Prompt ? t.iparams[0]
                                                                         : 0;
            if (tc_cols <= 0) continue;
            int members[cuda::kMaxMatmulParts];
            const int n_members = matmuls_sharing_activations(g, id, members, cuda::kMaxMatmulParts);
            int64_t rows = 0;
            for (int i = 0; i < n_members; ++i) rows += g[g[members[i]].src[0]].ne[1];
            const Tensor& w = g[t.src[0]];
            const cuda::SplitScratchNeed n = cuda::matmul_tc_narrow_scratch(w.dtype, w.ne[0], rows, tc_cols);
            need.partial_floats = std::max(need.partial_floats, n.partial_floats);
            need.n_counters = std::max(need.n_counters, n.n_counters);
            const cuda::SplitScratchNeed nw = cuda::matmul_tc_wide_scratch(w.dtype, w.ne[0], rows, tc_cols);
            need.n_halves = std::max(need.n_halves, nw.n_halves);
            need.partial_floats = std::max(need.partial_floats, nw.partial_floats);
        }
        if (need.partial_floats <= scratch_.partial_floats && need.n_counters <= scratch_.n_counters &&
            need.n_halves <= scratch_.n_halves) {
            return;
        }
        graphs_.clear();
        if (need.n_halves > scratch_.n_halves) {  // the halves keep no state: replaced alone
            if (scratch_.halves) check(cudaFree(scratch_.halves), "split scratch: cudaFree");
            scratch_.halves = nullptr;
            scratch_.n_halves = 0;
            uint16_t* halves = nullptr;
            check(cudaMalloc(&halves, need.n_halves * sizeof(uint16_t)), "split scratch: cudaMalloc");
            scratch_.halves = halves;
            scratch_.n_halves = need.n_halves;
        }
        if (need.partial_floats <= scratch_.partial_floats && need.n_counters <= scratch_.n_counters) return;
        need.partial_floats = std::max(need.partial_floats, scratch_.partial_floats);
        need.n_counters = std::max(need.n_counters, scratch_.n_counters);
        if (scratch_.partial) check(cudaFree(scratch_.partial), "split scratch: cudaFree");
        if (scratch_.counters) check(cudaFree(scratch_.counters), "split scratch: cudaFree");
        scratch_.partial = nullptr;
        scratch_.partial_floats = 0;
        scratch_.counters = nullptr;
        scratch_.n_counters = 0;
        float* partial = nullptr;
        unsigned* counters = nullptr;
        check(cudaMalloc(&partial, need.partial_floats * sizeof(float)), "split scratch: cudaMalloc");
        const cudaError_t e = cudaMalloc(&counters, need.n_counters * sizeof(unsigned));
        if (e != cudaSuccess) {
            cudaFree(partial);
            cuda::throw_cuda("split scratch: cudaMalloc", e);
        }
        scratch_.partial = partial;
        scratch_.partial_floats = need.partial_floats;
        scratch_.counters = counters;
        scratch_.n_counters = need.n_counters;
        check(cudaMemsetAsync(counters, 0, need.n_counters * sizeof(unsigned), stream_), "split scratch: cudaMemset");
    }

    // The pre-pass: resolves the device address of every tensor an op reads or writes (uploading
    // host externals on first use), so that nothing allocates while a capture is open. False when
    // something failed (the eager run then meets the same failure and reports it with the op's
    // name).
    bool resolve_all(const Graph& g) {
        try {
            for (int id = 0; id < g.size(); ++id) {
                const Tensor& t = g[id];
                if (t.op == Op::NONE || t.op == Op::VIEW) continue;
                dptr(g, id);
                for (int s : t.src) {
                    if (s >= 0) dptr(g, s);
                }
            }
        } catch (const std::exception&) {
            cudaGetLastError();
            return false;
        }
        return true;
    }

    void run_eager(Graph& graph) {
        cuda::count_graph_event(cuda::GraphEvent::Eager);
        run_ops(graph);
    }

    // Captures run_ops(graph) into an instantiated graph; nullptr (logged, key marked) on failure.
    // Nothing runs during a capture, so the caller may then run the graph eagerly.
    cudaGraphExec_t capture(Graph& graph, uint64_t h) {
        std::string why;
        cudaGraph_t cg = nullptr;
        cudaError_t e = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal);
        if (e != cudaSuccess) {
            why = std::string("cudaStreamBeginCapture: ") + cudaGetErrorString(e);
        } else {
            try {
                run_ops(graph);
            } catch (const std::exception& ex) {
                why = ex.what();
            }
            e = cudaStreamEndCapture(stream_, &cg);
            if (why.empty() && e != cudaSuccess) why = std::string("cudaStreamEndCapture: ") + cudaGetErrorString(e);
        }
        cudaGraphExec_t exec = nullptr;
        if (why.empty()) {
            e = cudaGraphInstantiate(&exec, cg, 0);
            if (e != cudaSuccess) {
                exec = nullptr;
                why = std::string("cudaGraphInstantiate: ") + cudaGetErrorString(e);
            }
        }
        if (cg) cudaGraphDestroy(cg);
        if (!why.empty()) {
            capture_failed(h, why);
            return nullptr;
        }
        return exec;
    }

    void capture_failed(uint64_t h, const std::string& why) {
        cudaGetLastError();  // capture errors are not sticky: clear them before running eagerly
        graphs_.mark_failed(h);
        cuda::count_graph_event(cuda::GraphEvent::CaptureFailure);
        if (!capture_failure_logged_) {
            capture_failure_logged_ = true;
            std::fprintf(stderr,
                         "pyspec: CUDA graph capture failed (%s); running that graph eagerly (further failures "
                         "are counted in cuda_graph_stats(), not logged)\n",
                         why.c_str());
        }
    }

    // Eager execution with an event before every op and one after the last; after one
    // synchronisation each op's device time is the gap between its event and the next.
    // A fused launch (matmul groups) counts once, under its first node's op.
    void run_profiled(Graph& graph) {
        cuda::count_graph_event(cuda::GraphEvent::Eager);
        size_t n_ops = 0;
        for (int id = 0; id < graph.size(); ++id) n_ops += graph[id].op != Op::NONE && graph[id].op != Op::VIEW;
        while (events_.size() < n_ops + 1) {
            cudaEvent_t ev = nullptr;
            check(cudaEventCreate(&ev), "profiling: cudaEventCreate");
            events_.push_back(ev);
        }
        std::vector<Op> ops;
        size_t k = 0;
        run_ops(graph, [&](int id) {
            ops.push_back(graph[id].op);
            check(cudaEventRecord(events_[k++], stream_), "profiling: cudaEventRecord");
        });
        check(cudaEventRecord(events_[k], stream_), "profiling: cudaEventRecord");
        check(cudaEventSynchronize(events_[k]), "profiling: cudaEventSynchronize");
        for (size_t i = 0; i < ops.size(); ++i) {
            float ms = 0.0f;
            check(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]), "profiling: cudaEventElapsedTime");
            op_seconds_[static_cast<size_t>(ops[i])] += 1e-3 * ms;
            ++op_calls_[static_cast<size_t>(ops[i])];
        }
    }

    // Executes every computed node in order on the stream (eagerly, or into an open capture);
    // before(id) runs ahead of each launch.
    void run_ops(Graph& graph) {
        run_ops(graph, [](int) {});
    }

    template <typename BeforeOp>
    void run_ops(Graph& graph, BeforeOp before) {
        mark_written(graph);
        const bool fuse = cuda::matmul_fusion_enabled();
        if (fuse) count_uses(graph);
        for (int id = 0; id < graph.size(); ++id) {
            const Tensor& t = graph[id];
            if (t.op == Op::NONE || t.op == Op::VIEW) continue;
            // A norm run as its matmuls' prologue counts as the matmuls (profiles).
            const int norm_into = fuse && t.op == Op::RMS_NORM ? norm_prologue_target(graph, id) : -1;
            before(norm_into >= 0 ? norm_into : id);
            int last = id;
            try {
                if (norm_into >= 0) {
                    last = run_mul_mat_group(graph, norm_into, id);
                } else if (fuse && t.op == Op::MUL_MAT) {
                    last = run_mul_mat_group(graph, id);
                } else if (fuse && (t.op == Op::ROPE || t.op == Op::SET_ROWS || t.op == Op::RMS_NORM)) {
                    last = run_op_pair(graph, id);
                } else {
                    run_node(graph, id);
                }
            } catch (const std::runtime_error& e) {
                throw std::runtime_error(std::string(e.what()) + " [" + op_name(t.op) + " '" + t.name + "']");
            }
            const cudaError_t e = cudaGetLastError();
            if (e != cudaSuccess) {
                throw std::runtime_error(std::string("cuda backend: ") + op_name(t.op) + " ('" + t.name +
                                         "'): " + cudaGetErrorString(e));
            }
            id = last;  // the nodes of a fused launch ran with the first
        }
    }

    // Bytes [first, second) a tensor spans on the device (span() below): the fusions' safety checks.
    using Span = std::pair<const char*, const char*>;

    // The MUL_MAT at id and the next ones (up to kMaxMatmulParts) that read the same activations
    // with weights of the same type and K (matmuls_sharing_activations: q/k/v, gate/up), as one
    // launch. Running them early is safe: no node computes between them, so no
    // tensor dies there whose memory a later member's output could have been planned into; and
    // member outputs that overlap what the launch reads (act) or each other (never planned so)
    // end the group. Returns the number of members taken, their parts and the last one's id.
    int group_parts(const Graph& g, int id, const Span& act, std::vector<cuda::MatmulPart>& parts, int& last) {
        int members[cuda::kMaxMatmulParts];
        const int n_members = matmuls_sharing_activations(g, id, members, cuda::kMaxMatmulParts);
        std::vector<Span> spans{act};
        parts.clear();
        last = id;
        for (int m = 0; m < n_members; ++m) {
            const int j = members[m];
            const cuda::MatmulPart part = matmul_part(g, j);
            const char* b = reinterpret_cast<const char*>(part.y);
            const char* e = b + g[j].nbytes();
            bool hit = false;
            for (const Span& sp : spans) hit = hit || overlaps({b, e}, sp);
            if (hit) break;
            spans.emplace_back(b, e);
            parts.push_back(part);
            last = j;
        }
        return n_members;
    }

    // The RMS_NORM at id as the prologue of the MUL_MAT group right after it (cuda::MatmulNorm:
    // a decode step's attention and FFN norms cost no launch of their own; the output norm's
    // input usually shares memory with the logits, so it stays apart): returns that group's first
    // node, or -1 where the norm runs apart. The group's parts are collected again when it runs
    // (eager runs and captures only: replays skip all of this). The group's kernel reads the norm's
    // input instead of its output, so: nothing computes between them (the input is as the norm
    // saw it), every reader of the output is in the group and the output is no graph output (it
    // is never written), no member's output (nor the residual's or SwiGLU's, checked where those
    // are fused) overlaps the input, and the kernel path has a norm prologue for this batch.
    int norm_prologue_target(const Graph& g, int id) {
        const Tensor& t = g[id];
        const int mm = next_computed(g, id);
        if (mm >= g.size() || g[mm].op != Op::MUL_MAT || g[mm].src[1] != id || t.src[1] < 0) return -1;
        if (t.has(kOutput) || t.has(kPinned)) return -1;
        const Tensor& x = g[t.src[0]];
        const Tensor& w = g[t.src[1]];
        const Tensor& wm = g[g[mm].src[0]];
        if (x.dtype != DType::F32 || x.nb[0] != sizeof(float) || x.nb[1] % sizeof(float) != 0 || x.ne[2] != 1 ||
            x.ne[3] != 1 || w.dtype != DType::F32 || w.nb[0] != sizeof(float) || w.ne[0] != x.ne[0] ||
            w.nrows() != 1 || t.ne[0] != x.ne[0] || t.ne[1] != x.ne[1] || wm.ne[0] != x.ne[0]) {
            return -1;
        }
        if (!cuda::matmul_norm_prologue(wm.dtype, wm.ne[0], x.ne[1], g[mm].iparams[0], tc_rows(wm))) return -1;
        std::vector<cuda::MatmulPart> parts;
        int last = mm;
        const int n_members = group_parts(g, mm, span(g, t.src[0]), parts, last);
        if (static_cast<int>(parts.size()) != n_members || uses_[static_cast<size_t>(id)] != n_members) return -1;
        return mm;
    }

    // The MUL_MAT group at id (group_parts) in one launch, with the residual ADD or the SwiGLU
    // after it as the epilogue where they fit, and with the RMS_NORM `norm` (norm_prologue_target
    // said yes) as its prologue when norm >= 0. Returns the last node run.
    int run_mul_mat_group(const Graph& g, int id, int norm = -1) {
        const Tensor& t0 = g[id];
        const Tensor& w0 = g[t0.src[0]];
        const Tensor& x = g[t0.src[1]];
        cuda::MatmulNorm nn;
        const cuda::MatmulNorm* pn = nullptr;
        int act_id = t0.src[1];
        if (norm >= 0) {
            act_id = g[norm].src[0];
            nn.w = reinterpret_cast<const float*>(dptr(g, g[norm].src[1]));
            nn.eps = g[norm].fparams[0];
            pn = &nn;
        }
        const Span act = span(g, act_id);
        const float* xp = reinterpret_cast<const float*>(dptr(g, act_id));
        const int64_t xs = static_cast<int64_t>(g[act_id].nb[1] / sizeof(float));
        std::vector<cuda::MatmulPart> parts;
        int last = id;
        group_parts(g, id, act, parts, last);
        if (parts.empty()) {  // the first output overlaps its activations: never planned so
            if (norm >= 0) throw std::logic_error("cuda backend: norm prologue without its matmuls");
            run_node(g, id);
            return id;
        }
        if (parts.size() == 1) {
            const int add = residual_add_after(g, id, act, parts[0]);
            if (add >= 0) last = add;
        }
        if (parts.size() == 2) {
            const int glu = swiglu_after(g, id, last, act);
            if (glu >= 0 && cuda::launch_matmul_glu(w0.dtype, parts[0], parts[1], w0.ne[0], xp, xs, x.ne[1],
                                                    t0.iparams[0], tc_rows(w0), reinterpret_cast<float*>(dptr(g, glu)),
                                                    static_cast<int64_t>(g[glu].nb[1] / sizeof(float)), stream_, pn)) {
                return glu;
            }
        }
        cuda::launch_matmul_group(w0.dtype, parts.data(), static_cast<int>(parts.size()), w0.ne[0], xp, xs, x.ne[1],
                                  t0.iparams[0], tc_rows(w0), scratch_, stream_, pn);
        return last;
    }

    // --- row-wise ops, alone or in pairs -----------------------------------------------------

    // The job of a ROPE, RMS_NORM or SET_ROWS node (SET_ROWS writes its source 0, the cache),
    // after the checks that op gets.
    cuda::OpJob op_job(const Graph& g, int id) {
        const Tensor& t = g[id];
        cuda::OpJob job;
        if (t.op == Op::SET_ROWS) {
            const Tensor& dst = g[t.src[0]];
            require(!dtype_is_integer(dst.dtype), t, "integer destination");
            require(!dtype_is_quantized(dst.dtype) || g[t.src[1]].ne[0] % QK == 0, t,
                    "row not a multiple of the block size");
            job.dst = desc(g, t.src[0]);
            job.src = desc(g, t.src[1]);
            return job;
        }
        if (t.op == Op::ROPE) {
            require(t.iparams[0] >= 0 && t.iparams[0] <= g[t.src[0]].ne[0] && t.iparams[0] % 2 == 0, t, "bad n_rot");
            require(g[t.src[0]].ne[3] == 1 && g[t.src[0]].nb[0] == sizeof(float), t, "rows must be [head_dim, n_head, n_rows] F32");
        }
        job.dst = desc(g, id);
        job.src = desc(g, t.src[0]);
        if (t.op == Op::RMS_NORM && t.src[1] >= 0) job.w = reinterpret_cast<const float*>(dptr(g, t.src[1]));
        return job;
    }

    // One launch of n jobs of node id's op, with id's parameters (a pair shares them).
    void launch_jobs(const Graph& g, int id, const cuda::OpJob* jobs, int n) {
        const Tensor& t = g[id];
        switch (t.op) {
            case Op::RMS_NORM: cuda::launch_rms_norm(jobs, n, t.fparams[0], stream_); return;
            case Op::ROPE: {
                cuda::RopeJob rj[cuda::kMaxOpJobs];
                for (int i = 0; i < n; ++i) {
                    rj[i].dst = jobs[i].dst;
                    rj[i].src = jobs[i].src;
                }
                launch_rope(g, id, rj, n, nullptr);
                return;
            }
            case Op::SET_ROWS:
                cuda::launch_set_rows(jobs, n, reinterpret_cast<const int32_t*>(dptr(g, t.src[2])), err_, stream_);
                return;
            default: throw std::logic_error("cuda backend: launch_jobs: not a row-wise op");
        }
    }

    // One RoPE launch of jobs with node id's positions and parameters; cells: the K/V SET_ROWS
    // cells when the jobs store into caches.
    void launch_rope(const Graph& g, int id, const cuda::RopeJob* jobs, int n, const int32_t* cells) {
        const Tensor& t = g[id];
        const float* ff = t.src[2] >= 0 ? reinterpret_cast<const float*>(dptr(g, t.src[2])) : nullptr;
        cuda::launch_rope(jobs, n, reinterpret_cast<const int32_t*>(dptr(g, t.src[1])), cells, ff, t.iparams[0],
                          t.iparams[1] == 2, t.fparams[0], t.fparams[1], is_leaf(g, t.src[1]) && is_leaf(g, t.src[2]),
                          err_, stream_);
    }

    // Whether optional source src (-1: none) is a graph leaf's memory (an input, a weight), which no
    // kernel of the graph writes, so a kernel may read it before its PDL wait.
    static bool is_leaf(const Graph& g, int src) { return src < 0 || g[g.root_of(src)].op == Op::NONE; }

    // The next node after i that computes (not a leaf or a view), or g.size().
    static int next_computed(const Graph& g, int i) {
        int j = i + 1;
        while (j < g.size() && (g[j].op == Op::NONE || g[j].op == Op::VIEW)) ++j;
        return j;
    }

    // The q/k RoPE pair (a, b) and the K/V SET_ROWS pair right after it as one launch: when the
    // next computed nodes are SET_ROWS(k_cache, b's rows as one contiguous reshape, cells) and
    // SET_ROWS(v_cache, v, the same cells) into F16/F32 caches whose rows match, the k job also
    // writes its rotated rows into k_cache and a third job copies v into v_cache (the same
    // conversion as SET_ROWS). Nothing written may overlap anything read. Returns the last
    // SET_ROWS, or -1 (nothing launched) when the pattern or a check does not hold.
    int run_rope_and_store(const Graph& g, int a, int b) {
        int c = -1, d = -1;
        if (!rope_store_nodes(g, a, b, c, d)) return -1;
        cuda::RopeJob jobs[3];
        const int ids[2] = {a, b};
        for (int i = 0; i < 2; ++i) {
            const cuda::OpJob j = op_job(g, ids[i]);
            jobs[i].dst = j.dst;
            jobs[i].src = j.src;
        }
        jobs[1].kind = cuda::RopeJob::kRopeStore;
        jobs[1].cache = desc(g, g[c].src[0]);
        jobs[2].kind = cuda::RopeJob::kStore;
        jobs[2].src = desc(g, g[d].src[1]);
        jobs[2].cache = desc(g, g[d].src[0]);
        launch_rope(g, a, jobs, 3, reinterpret_cast<const int32_t*>(dptr(g, g[c].src[2])));
        return d;
    }

    // The K/V SET_ROWS pair (c, d) that run_rope_and_store runs with the q/k RoPE pair (a, b):
    // false when the pattern or a check does not hold.
    bool rope_store_nodes(const Graph& g, int a, int b, int& c, int& d) {
        c = next_computed(g, b);
        d = c < g.size() ? next_computed(g, c) : g.size();
        if (d >= g.size() || g[c].op != Op::SET_ROWS || g[d].op != Op::SET_ROWS || g[c].src[2] != g[d].src[2]) {
            return false;
        }
        const Tensor& rk = g[b];
        const Tensor& kv = g[g[c].src[1]];  // b's rows, [head_dim * n_head, n_rows]
        const Tensor& kc = g[g[c].src[0]];
        const Tensor& vc = g[g[d].src[0]];
        const Tensor& v = g[g[d].src[1]];
        const size_t f = sizeof(float);
        const bool contiguous_b = rk.nb[0] == f && rk.nb[1] == static_cast<size_t>(rk.ne[0]) * f &&
                                  rk.nb[2] == static_cast<size_t>(rk.ne[1]) * rk.nb[1] && rk.ne[3] == 1;
        if (!contiguous_b || kv.view_src != b || kv.view_offset != 0 || kv.ne[0] != rk.ne[0] * rk.ne[1] ||
            kv.ne[1] != rk.ne[2] || kv.nb[0] != f || kv.nb[1] != static_cast<size_t>(kv.ne[0]) * f) {
            return false;
        }
        for (const Tensor* cache : {&kc, &vc}) {
            if (cache->dtype != DType::F16 && cache->dtype != DType::F32) return false;
        }
        if (kc.ne[0] != kv.ne[0] || vc.ne[0] != v.ne[0] || v.dtype != DType::F32 || v.nrows() != kv.ne[1]) return false;
        const Span written[] = {span(g, a), span(g, b), span(g, g[c].src[0]), span(g, g[d].src[0])};
        const Span read[] = {span(g, g[a].src[0]), span(g, g[b].src[0]), span(g, g[d].src[1]), span(g, g[a].src[1]),
                             span(g, g[c].src[2])};
        for (size_t i = 0; i < std::size(written); ++i) {
            for (size_t j = i + 1; j < std::size(written); ++j) {
                if (overlaps(written[i], written[j])) return false;
            }
            for (const Span& r : read) {
                if (overlaps(written[i], r)) return false;
            }
        }
        return true;
    }

    // A single decode row's q/k RoPE pair (a, b), its K/V SET_ROWS pair and the ATTENTION that reads
    // them as one launch of the staged attention kernel (cuda::DecodeRope): when the SET_ROWS pair
    // fuses with the RoPE pair (rope_store_nodes), the next computed node is ATTENTION over a's rows
    // and the two SET_ROWS, with one row, no prompt rows and F16 caches, the positions, frequency
    // factors and cells are graph leaves (read before the PDL wait), and the attention's output
    // overlaps nothing the launch reads or writes (the planner keeps those live through the
    // ATTENTION: core/planner.cpp). Returns the ATTENTION's id, or -1 (nothing launched).
    // nq, nk (or -1): the per-head RMS_NORM pair whose outputs a and b rotate (Qwen3's q/k norms),
    // run by the same launch when a and b are their outputs' only readers.
    int run_rope_store_attention(const Graph& g, int a, int b, int nq = -1, int nk = -1) {
        if (!cuda::attention_rope_enabled()) return -1;
        int c = -1, d = -1;
        if (!rope_store_nodes(g, a, b, c, d)) return -1;
        const int e = next_computed(g, d);
        if (e >= g.size()) return -1;
        const Tensor& att = g[e];
        if (att.op != Op::ATTENTION || att.src[0] != a || att.src[1] != c || att.src[2] != d || att.iparams[1] != 0 ||
            g[a].ne[2] != 1 || g[g[c].src[0]].dtype != DType::F16 || g[g[d].src[0]].dtype != DType::F16) {
            return -1;
        }
        const Tensor& ra = g[a];
        if (!is_leaf(g, ra.src[1]) || !is_leaf(g, ra.src[2]) || !is_leaf(g, g[c].src[2])) return -1;
        const bool norms = nq >= 0;
        if (norms) {
            for (int n : {nq, nk}) {
                const Tensor& t = g[n];
                const Tensor& x = g[t.src[0]];
                if (t.op != Op::RMS_NORM || t.src[1] < 0 || t.has(kOutput) || t.has(kPinned) ||
                    uses_[static_cast<size_t>(n)] != 1 || g[t.src[1]].dtype != DType::F32 ||
                    g[t.src[1]].nelements() != t.ne[0] || x.dtype != DType::F32 || x.ne != t.ne ||
                    x.nb[0] != sizeof(float)) {
                    return -1;
                }
            }
            if (ra.src[0] != nq || g[b].src[0] != nk || g[nq].fparams[0] != g[nk].fparams[0]) return -1;
        }
        const Span out = span(g, e);
        for (int i : {a, b, g[c].src[0], g[d].src[0], ra.src[0], g[b].src[0], g[d].src[1], ra.src[1], ra.src[2],
                      g[c].src[2], att.src[3], att.src[4], norms ? g[nq].src[0] : -1, norms ? g[nk].src[0] : -1,
                      norms ? g[nq].src[1] : -1, norms ? g[nk].src[1] : -1}) {
            if (i >= 0 && overlaps(out, span(g, i))) return -1;
        }
        for (int i : {att.src[3], att.src[4]}) {  // the mask and the first cells: read, never written here
            for (int w : {a, b, g[c].src[0], g[d].src[0]}) {
                if (overlaps(span(g, i), span(g, w))) return -1;
            }
        }
        cuda::DecodeRope rope;
        rope.q_src = desc(g, norms ? g[nq].src[0] : ra.src[0]);
        rope.k_src = desc(g, norms ? g[nk].src[0] : g[b].src[0]);
        if (norms) {
            rope.q_norm = reinterpret_cast<const float*>(dptr(g, g[nq].src[1]));
            rope.k_norm = reinterpret_cast<const float*>(dptr(g, g[nk].src[1]));
            rope.norm_eps = g[nq].fparams[0];
        }
        rope.v_src = desc(g, g[d].src[1]);
        rope.q_dst = desc(g, a);
        rope.k_dst = desc(g, b);
        rope.pos = reinterpret_cast<const int32_t*>(dptr(g, ra.src[1]));
        rope.cells = reinterpret_cast<const int32_t*>(dptr(g, g[c].src[2]));
        rope.factors = ra.src[2] >= 0 ? reinterpret_cast<const float*>(dptr(g, ra.src[2])) : nullptr;
        rope.early = cuda::env_switch("PYSPEC_CUDA_ATT_EARLY") != 0 && is_leaf(g, att.src[3]) && is_leaf(g, att.src[4]);
        rope.n_rot = ra.iparams[0];
        rope.neox = ra.iparams[1] == 2 ? 1 : 0;
        rope.base = ra.fparams[0];
        rope.fscale = ra.fparams[1];
        const bool launched = cuda::launch_attention_rope(
            desc(g, e), desc(g, c), desc(g, d), desc(g, att.src[3]), reinterpret_cast<const int32_t*>(dptr(g, att.src[4])),
            att.iparams[0], att.fparams[0], rope, scratch_, err_, stream_);
        return launched ? e : -1;
    }

    // Bytes [first, second) a tensor spans on the device, and whether two spans share a byte: the
    // fusions' safety checks.
    Span span(const Graph& g, int id) {
        const char* b = dptr(g, id);
        return {b, b + g[id].nbytes()};
    }
    static bool overlaps(const Span& x, const Span& y) { return x.first < y.second && y.first < x.second; }

    // The node at id and the next computed one as one launch when that one is the same op with
    // the same parameters (q/k RoPE over the same positions, K/V SET_ROWS into the same cells,
    // Qwen3's q/k norms) and neither touches what the other writes: the second reads nothing
    // the first writes, and neither writes what the other reads or writes. The spans are checked
    // on the device addresses, so no plan can make the pair unsafe. Returns the last node run.
    int run_op_pair(const Graph& g, int id) {
        const int b = next_computed(g, id);
        if (b >= g.size() || !pairable(g, id, b)) {
            run_node(g, id);
            return id;
        }
        if (g[id].op == Op::RMS_NORM) {
            // Qwen3's q/k norms, then the RoPE pair over their outputs: all of it in the decode
            // attention's launch where that applies (run_rope_store_attention).
            const int ra = next_computed(g, b);
            const int rb = ra < g.size() ? next_computed(g, ra) : g.size();
            if (rb < g.size() && g[ra].op == Op::ROPE && g[rb].op == Op::ROPE && g[ra].src[0] == id &&
                g[rb].src[0] == b && pairable(g, ra, rb)) {
                const int last = run_rope_store_attention(g, ra, rb, id, b);
                if (last >= 0) return last;
            }
        }
        if (g[id].op == Op::ROPE) {
            int last = run_rope_store_attention(g, id, b);
            if (last < 0) last = run_rope_and_store(g, id, b);
            if (last >= 0) return last;
        }
        const cuda::OpJob jobs[2] = {op_job(g, id), op_job(g, b)};
        launch_jobs(g, id, jobs, 2);
        return b;
    }

    bool pairable(const Graph& g, int ia, int ib) {
        const Tensor& a = g[ia];
        const Tensor& b = g[ib];
        if (b.op != a.op) return false;
        switch (a.op) {
            case Op::ROPE:  // the same positions and frequency factors
                if (b.src[1] != a.src[1] || b.src[2] != a.src[2] || b.iparams[0] != a.iparams[0] || b.iparams[1] != a.iparams[1] || b.fparams[0] != a.fparams[0] ||
                    b.fparams[1] != a.fparams[1] || g[b.src[0]].ne[2] != g[a.src[0]].ne[2] ||
                    b.iparams[0] > g[b.src[0]].ne[0] || b.iparams[0] % 2 != 0) {
                    return false;
                }
                break;
            case Op::RMS_NORM:
                // the same row length: the same kernel, so both jobs fit one launch
                if (b.fparams[0] != a.fparams[0] || g[b.src[0]].ne[0] != g[a.src[0]].ne[0]) return false;
                break;
            case Op::SET_ROWS:  // the same cells
                if (b.src[2] != a.src[2] || dtype_is_quantized(g[a.src[0]].dtype) != dtype_is_quantized(g[b.src[0]].dtype) ||
                    dtype_is_integer(g[b.src[0]].dtype) || g[a.src[1]].nrows() != g[b.src[1]].nrows() ||
                    (dtype_is_quantized(g[b.src[0]].dtype) && g[b.src[1]].ne[0] % QK != 0)) {
                    return false;
                }
                break;
            default: return false;
        }
        const auto written = [&](int i) { return g[i].op == Op::SET_ROWS ? span(g, g[i].src[0]) : span(g, i); };
        const auto wa = written(ia), wb = written(ib);
        if (overlaps(wa, wb)) return false;
        for (int s : b.src) {
            if (s >= 0 && overlaps(span(g, s), wa)) return false;
        }
        for (int s : a.src) {
            if (s >= 0 && overlaps(span(g, s), wb)) return false;
        }
        return true;
    }

    // The device memory every computing node of the graph writes, for constant(): a MUL_MAT may
    // load weights no node writes before its PDL wait. Kept as disjoint spans sorted by address
    // (the planner reuses memory, so the nodes' outputs merge into a few), so constant() is a
    // binary search, not a pass over every node for every MUL_MAT of an eager run or capture.
    void mark_written(const Graph& g) {
        written_.clear();
        for (int j = 0; j < g.size(); ++j) {
            const Op op = g[j].op;
            if (op == Op::NONE || op == Op::VIEW) continue;
            const Span s = span(g, j);
            if (s.first < s.second) written_.push_back(s);
        }
        std::sort(written_.begin(), written_.end());
        size_t n = 0;
        for (const Span& s : written_) {
            if (n > 0 && s.first <= written_[n - 1].second) {
                written_[n - 1].second = std::max(written_[n - 1].second, s.second);
            } else {
                written_[n++] = s;
            }
        }
        written_.resize(n);
    }

    // Whether tensor id is a leaf's memory that no node of the graph writes (model weights; not a
    // KV cache, which SET_ROWS writes, through whichever tensor). Inputs written before compute()
    // are ordered by the stream.
    bool constant(const Graph& g, int id) {
        if (g[g.root_of(id)].op != Op::NONE) return false;
        const Span w = span(g, id);
        // The first written span that ends after w starts (ends increase with starts: disjoint).
        const auto it = std::upper_bound(written_.begin(), written_.end(), w.first,
                                         [](const char* p, const Span& x) { return p < x.second; });
        return it == written_.end() || !overlaps(w, *it);
    }

    // How many nodes read each tensor (as a source or as a view's base), for run_mul_mat_group.
    void count_uses(const Graph& g) {
        uses_.assign(static_cast<size_t>(g.size()), 0);
        for (int j = 0; j < g.size(); ++j) {
            const Tensor& t = g[j];
            for (int s : t.src) {
                if (s >= 0) ++uses_[static_cast<size_t>(s)];
            }
            if (t.view_src >= 0) ++uses_[static_cast<size_t>(t.view_src)];
        }
    }

    // The residual epilogue: when the next computed node after MUL_MAT id is an ADD of its product
    // and a residual of the same shape, and nothing else reads the product (not an output, no
    // view of it), part is changed to store product + residual straight into the ADD's output and
    // the ADD's id is returned (it runs with the MUL_MAT); else -1 and part is left alone. The
    // ADD's output must not overlap the activations (still being read); it may be the residual
    // itself (each output reads its own residual element before storing), or apart from it.
    int residual_add_after(const Graph& g, int id, const Span& act, cuda::MatmulPart& part) {
        const Tensor& mm = g[id];
        const Tensor& w = g[mm.src[0]];
        if (!cuda::matmul_add_epilogue(w.dtype, w.ne[0], tc_rows(w))) return -1;
        if (mm.has(kOutput) || mm.has(kPinned) || uses_[static_cast<size_t>(id)] != 1) return -1;
        const int a = next_computed(g, id);
        if (a >= g.size() || g[a].op != Op::ADD) return -1;
        const Tensor& add = g[a];
        int other = -1;
        if (add.src[0] == id && add.src[1] != id) other = add.src[1];
        if (add.src[1] == id && add.src[0] != id) other = add.src[0];
        if (other < 0) return -1;
        const Tensor& r = g[other];
        for (int d = 0; d < 4; ++d) {
            if (r.ne[d] != mm.ne[d] || add.ne[d] != mm.ne[d]) return -1;
        }
        if (r.dtype != DType::F32 || add.dtype != DType::F32 || r.nb[0] != sizeof(float) ||
            add.nb[0] != sizeof(float) || r.nb[1] % sizeof(float) != 0 || add.nb[1] % sizeof(float) != 0) {
            return -1;
        }
        const Span out = span(g, a), res = span(g, other);
        if (overlaps(out, act)) return -1;
        const bool same = res.first == out.first && r.nb[1] == add.nb[1];
        if (!same && overlaps(out, res)) return -1;
        const char* rb = res.first;
        part.y = reinterpret_cast<float*>(dptr(g, a));
        part.y_stride = static_cast<int64_t>(add.nb[1] / sizeof(float));
        part.add = reinterpret_cast<const float*>(rb);
        part.add_stride = static_cast<int64_t>(r.nb[1] / sizeof(float));
        return a;
    }

    // The SwiGLU epilogue: when the next computed node after MUL_MATs gate and up (one group) is
    // SWIGLU(gate, up), nothing else reads either product, and its output is F32 rows of their
    // shape apart from the activations, returns its id (launch_matmul_glu stores silu(gate) * up
    // there and the products never reach memory); else -1.
    int swiglu_after(const Graph& g, int gate, int up, const Span& act) {
        const int a = next_computed(g, up);
        if (a >= g.size() || g[a].op != Op::SWIGLU || g[a].src[0] != gate || g[a].src[1] != up) return -1;
        const Tensor& glu = g[a];
        for (int id : {gate, up}) {
            const Tensor& mm = g[id];
            if (mm.has(kOutput) || mm.has(kPinned) || uses_[static_cast<size_t>(id)] != 1) return -1;
            for (int d = 0; d < 4; ++d) {
                if (mm.ne[d] != glu.ne[d]) return -1;
            }
        }
        if (glu.dtype != DType::F32 || glu.nb[0] != sizeof(float) || glu.nb[1] % sizeof(float) != 0) return -1;
        if (overlaps(span(g, a), act)) return -1;
        return a;
    }

    // A MUL_MAT node's launch parameters, after the checks every MUL_MAT gets.
    cuda::MatmulPart matmul_part(const Graph& g, int id) {
        const Tensor& t = g[id];
        const Tensor& w = g[t.src[0]];
        const Tensor& x = g[t.src[1]];
        require(w.ne[2] == 1 && w.ne[3] == 1, t, "weights must be 2-D");
        require(x.ne[2] == 1 && x.ne[3] == 1 && x.nb[0] == sizeof(float) && x.dtype == DType::F32, t,
                "activations must be 2-D F32 rows");
        require(!dtype_is_integer(w.dtype), t, "integer weights");
        require(w.nb[1] >= dtype_row_bytes(w.dtype, w.ne[0]), t, "row stride is smaller than a row");
        require(x.nb[1] % sizeof(float) == 0 && t.nb[1] % sizeof(float) == 0, t, "row strides not in floats");
        cuda::MatmulPart part{dptr(g, t.src[0]), w.ne[1], w.nb[1], reinterpret_cast<float*>(dptr(g, id)),
                              static_cast<int64_t>(t.nb[1] / sizeof(float))};
        part.constant = constant(g, t.src[0]);
        return part;
    }

    // --- memory ------------------------------------------------------------------------------

    bool on_device(const char* p) const {
        if (arena_ && p >= arena_ && p < arena_ + arena_size_) return true;
        auto it = persistent_.upper_bound(const_cast<char*>(p));
        if (it == persistent_.begin()) return false;
        --it;
        return p < it->first + it->second;
    }

    // Device address of [p, p + bytes): p itself on the device, else inside an upload (nullptr
    // when none holds it).
    char* device_address(char* p, size_t bytes) const {
        if (on_device(p)) return p;
        const uintptr_t a = reinterpret_cast<uintptr_t>(p);
        for (auto it = uploads_.begin(); it != uploads_.end(); ++it) {
            const uintptr_t b = it->first.first;
            if (a >= b && a + bytes <= b + it->first.second) return it->second + (a - b);
        }
        return nullptr;
    }

    char* upload(const void* host, size_t bytes, const std::string& name) {
        const auto key = std::make_pair(reinterpret_cast<uintptr_t>(host), bytes);
        auto it = uploads_.find(key);
        if (it != uploads_.end()) return it->second;
        // Inside an earlier upload (two external tensors over one host buffer, e.g. a cache and
        // a slice of it): share that copy, so writes through one are seen through the other.
        const uintptr_t a = reinterpret_cast<uintptr_t>(host);
        for (const auto& u : uploads_) {
            if (a >= u.first.first && a + bytes <= u.first.first + u.first.second) return u.second + (a - u.first.first);
        }
        void* d = nullptr;
        check(cudaMalloc(&d, bytes == 0 ? 256 : bytes), ("upload of " + name + ": cudaMalloc").c_str());
        if (bytes) {
            const cudaError_t e = cudaMemcpyAsync(d, host, bytes, cudaMemcpyHostToDevice, stream_);
            if (e != cudaSuccess) {
                cudaFree(d);
                cuda::throw_cuda(("upload of " + name).c_str(), e);
            }
        }
        uploads_.emplace(key, static_cast<char*>(d));
        return static_cast<char*>(d);
    }

    // The device address of tensor id's data for this compute.
    char* dptr(const Graph& g, int id) {
        char*& r = resolved_[static_cast<size_t>(id)];
        if (r) return r;
        const Tensor& t = g[id];
        if (!t.data) throw std::logic_error("cuda backend: tensor " + t.name + " has no data");
        char* p = static_cast<char*>(t.data);
        if (on_device(p)) return r = p;
        const int root = g.root_of(id);
        const Tensor& rt = g[root];
        if (!rt.has(kExternal)) {
            throw std::logic_error("cuda backend: tensor " + t.name + " lives in host memory that is not an external tensor's");
        }
        char* base = upload(rt.data, rt.nbytes(), rt.name);
        return r = base + (p - static_cast<char*>(rt.data));
    }

    TDesc desc(const Graph& g, int id) {
        const Tensor& t = g[id];
        TDesc d{};
        d.data = dptr(g, id);
        d.dtype = t.dtype;
        for (int i = 0; i < 4; ++i) {
            d.ne[i] = t.ne[i];
            d.nb[i] = static_cast<int64_t>(t.nb[i]);
        }
        return d;
    }

    // Throws for the device error bits a read brought back, after clearing them on the device.
    void raise_error_word(unsigned bits) {
        if (!bits) return;
        *err_host_ = 0;
        check(cudaMemsetAsync(err_, 0, sizeof(unsigned), stream_), "clearing the error word");
        std::string why;
        if (bits & cuda::kErrGetRowsId) why += " get_rows: row id out of range;";
        if (bits & cuda::kErrSetRowsId) why += " set_rows: row id out of range;";
        if (bits & cuda::kErrAttentionSpan) why += " attention: span outside the cache;";
        throw std::logic_error("cuda backend:" + why);
    }

    // Room for `bytes` of input in the pinned staging buffer, or nullptr (too large for it: the
    // caller copies from pageable memory). The room is free again after the next
    // synchronisation: when full, this one waits for the queued copies and starts over.
    char* stage(size_t bytes) {
        constexpr size_t kAlign = 256;
        if (bytes > kStagingBytes) return nullptr;
        if (staged_ + bytes > kStagingBytes) {
            check(cudaStreamSynchronize(stream_), "write: waiting for staged copies");
            staged_ = 0;
        }
        char* at = staging_ + staged_;
        staged_ += (bytes + kAlign - 1) / kAlign * kAlign;
        return at;
    }

    // --- ops ---------------------------------------------------------------------------------

    static void require(bool ok, const Tensor& t, const char* why) {
        if (!ok) throw std::logic_error(std::string("cuda backend: ") + op_name(t.op) + " (" + t.name + "): " + why);
    }

    void run_node(const Graph& g, int id) {
        const Tensor& t = g[id];
        auto src = [&](int i) { return t.src[static_cast<size_t>(i)]; };
        switch (t.op) {
            case Op::CPY: {
                const Tensor& s = g[src(0)];
                require(s.nelements() == t.nelements() && s.ne[0] == t.ne[0], t, "shapes differ");
                require(!dtype_is_quantized(t.dtype) || s.ne[0] % QK == 0, t, "row not a multiple of the block size");
                require((dtype_is_integer(s.dtype) == dtype_is_integer(t.dtype)) &&
                            (!dtype_is_integer(s.dtype) || (s.dtype == DType::I32 && t.dtype == DType::I32)),
                        t, "unsupported type pair");
                require(s.nrows() == t.nrows(), t, "row counts differ");
                cuda::launch_cpy(desc(g, id), desc(g, src(0)), stream_);
                return;
            }
            case Op::GET_ROWS: {
                const Tensor& tab = g[src(0)];
                require(!dtype_is_integer(tab.dtype), t, "integer table");
                require(t.dtype == DType::F32, t, "dst must be F32");
                cuda::launch_get_rows(desc(g, id), desc(g, src(0)), reinterpret_cast<const int32_t*>(dptr(g, src(1))), err_,
                                      stream_);
                return;
            }
            case Op::MUL_MAT: {
                const Tensor& w = g[src(0)];
                const Tensor& x = g[src(1)];
                const cuda::MatmulPart part = matmul_part(g, id);
                cuda::launch_matmul_group(w.dtype, &part, 1, w.ne[0], reinterpret_cast<const float*>(dptr(g, src(1))),
                                          static_cast<int64_t>(x.nb[1] / sizeof(float)), x.ne[1], t.iparams[0],
                                          tc_rows(w), scratch_, stream_);
                return;
            }
            case Op::RMS_NORM:
            case Op::ROPE:
            case Op::SET_ROWS: {
                const cuda::OpJob job = op_job(g, id);
                launch_jobs(g, id, &job, 1);
                return;
            }
            case Op::ADD:
            case Op::MUL:
            case Op::SWIGLU: {
                const Tensor& a = g[src(0)];
                const Tensor& b = g[src(1)];
                require(b.ne[0] == a.ne[0] && (b.nrows() == 1 || b.nrows() == a.nrows()), t, "shapes do not broadcast");
                const int kind = t.op == Op::ADD ? 0 : t.op == Op::MUL ? 1 : 2;
                cuda::launch_binary(kind, desc(g, id), desc(g, src(0)), desc(g, src(1)), stream_);
                return;
            }
            case Op::SCALE: cuda::launch_unary(0, desc(g, id), desc(g, src(0)), t.fparams[0], stream_); return;
            case Op::SILU: cuda::launch_unary(1, desc(g, id), desc(g, src(0)), 0.0f, stream_); return;
            case Op::SOFTMAX: cuda::launch_softmax(desc(g, id), desc(g, src(0)), t.fparams[0], stream_); return;
            case Op::ATTENTION:
                require(t.iparams[1] >= 0 && t.iparams[1] <= g[src(0)].ne[2], t, "prompt rows outside the rows");
                cuda::launch_attention(desc(g, id), desc(g, src(0)), desc(g, src(1)), desc(g, src(2)), desc(g, src(3)),
                                       reinterpret_cast<const int32_t*>(dptr(g, src(4))), t.iparams[0], t.fparams[0],
                                       t.iparams[1], scratch_, err_, stream_);
                return;
            case Op::ARGMAX: cuda::launch_argmax(desc(g, id), desc(g, src(0)), stream_); return;
            case Op::TOP_K: cuda::launch_top_k(desc(g, id), desc(g, src(0)), stream_); return;
            case Op::GATHER: cuda::launch_gather(desc(g, id), desc(g, src(0)), desc(g, src(1)), stream_); return;
            case Op::SAMPLE:
                cuda::launch_sample(desc(g, id), desc(g, src(0)), desc(g, src(1)), desc(g, src(2)), desc(g, src(3)),
                                    stream_);
                return;
            case Op::SUM: cuda::launch_sum(desc(g, id), desc(g, src(0)), stream_); return;
            case Op::GUMBEL:
                cuda::launch_gumbel(desc(g, id), reinterpret_cast<const int32_t*>(dptr(g, src(0))),
                                    reinterpret_cast<const int32_t*>(dptr(g, src(1))),
                                    static_cast<uint32_t>(t.iparams[0]), stream_);
                return;
            default: require(false, t, "not implemented on the GPU");
        }
    }

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
    size_t staged_ = 0;                                            // bytes of staging_ in use
    char* read_staging_ = nullptr;                                 // pinned: where read_many lands
    // read_many_async's slots: pinned staging, the error word and an event each (a decode step
    // launched ahead of the one being waited for holds a second one).
    struct AsyncRead {
        uint64_t ticket = 0;
        cudaEvent_t done = nullptr;
        char* staging = nullptr;
        size_t staging_bytes = 0;
        unsigned* err = nullptr;
        std::vector<ReadRequest> reads;
        std::vector<const char*> host;
    };
    std::vector<AsyncRead> in_flight_reads_, free_read_slots_;
    uint64_t read_tickets_ = 0;

    // A free slot whose staging holds `bytes` (made or grown here: nothing reads it now).
    AsyncRead take_read_slot(size_t bytes) {
        AsyncRead slot;
        if (!free_read_slots_.empty()) {
            slot = std::move(free_read_slots_.back());
            free_read_slots_.pop_back();
        }
        try {
            if (!slot.done) check(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming), "read: cudaEventCreate");
            if (!slot.err) {
                void* e = nullptr;
                check(cudaMallocHost(&e, sizeof(unsigned)), "read: allocating the pinned error word");
                slot.err = static_cast<unsigned*>(e);
                *slot.err = 0;
            }
            if (slot.staging_bytes < bytes) {
                if (slot.staging) cudaFreeHost(slot.staging);
                slot.staging = nullptr;
                slot.staging_bytes = 0;
                void* p = nullptr;
                check(cudaMallocHost(&p, bytes), "read: allocating pinned staging");
                slot.staging = static_cast<char*>(p);
                slot.staging_bytes = bytes;
            }
        } catch (...) {
            free_read_slots_.push_back(slot);
            throw;
        }
        return slot;
    }
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
    bool profiling_ = false;
    std::vector<cudaEvent_t> events_;                              // reused by run_profiled
    std::vector<double> op_seconds_ = std::vector<double>(static_cast<size_t>(Op::COUNT), 0.0);
    std::vector<int64_t> op_calls_ = std::vector<int64_t>(static_cast<size_t>(Op::COUNT), 0);
};

}  // namespace

bool cuda_available(std::string* reason) {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError();  // clear
        if (reason) *reason = std::string("CUDA driver error: ") + cudaGetErrorString(e);
        return false;
    }
    if (n == 0) {
        if (reason) *reason = "no CUDA device is visible";
        return false;
    }
    if (reason) reason->clear();
    return true;
}

std::unique_ptr<Backend> make_cuda_backend(int device, int n_seq_max) {
    std::string why;
    if (!cuda_available(&why)) throw std::runtime_error("CUDA backend unavailable: " + why);
    int n = 0;
    cudaGetDeviceCount(&n);
    if (device < 0 || device >= n) {
        throw std::runtime_error("CUDA backend unavailable: device " + std::to_string(device) + " does not exist (" +
                                 std::to_string(n) + " visible)");
    }
    return std::make_unique<CudaBackend>(device, n_seq_max >= cuda::kTcAllRowsMinSeqs);
}

}  // namespace pyspec
