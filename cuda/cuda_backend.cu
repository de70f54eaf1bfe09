// The CUDA backend: memory (device arena, persistent buffers, uploads of host-resident external
// tensors), host <-> device copies, CUDA graphs, and the loop that runs a graph's nodes in order on
// one stream. What each node launches, and the fusions of several nodes into one launch, are in
// cuda/backend_dispatch.cu; the class and its state in cuda/cuda_backend_class.cuh.
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

#include "cuda/cuda_backend_class.cuh"
#include "cuda/cuda_graphs.h"
#include "cuda/graph_cache.cuh"
#include "cuda/kernels.h"

namespace pyspec {
namespace cuda_backend {

CudaBackend::CudaBackend(int device, bool wide_batches)
    : device_(device),
      wide_batches_(wide_batches),
      step_times_(cuda::env_switch("PYSPEC_CUDA_STEP_TIMES") == 1),
      batch_copies_(cuda::env_switch("PYSPEC_CUDA_BATCH_COPIES") != 0),
      graphs_(cuda::graph_cache_capacity_from_env()) {
    check(cudaSetDevice(device_), "cudaSetDevice");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    cudaError_t e = cudaMalloc(&err_, sizeof(unsigned));
    if (e == cudaSuccess) e = cudaMemsetAsync(err_, 0, sizeof(unsigned), stream_);
    if (e == cudaSuccess) e = cudaMallocHost(&err_host_, sizeof(unsigned));
    if (e == cudaSuccess) e = cudaMallocHost(&staging_, kStagingBytes);
    void* dev = nullptr;
    if (e == cudaSuccess) e = cudaHostGetDevicePointer(&dev, staging_, 0);
    staging_dev_ = static_cast<char*>(dev);
    if (e == cudaSuccess) e = cudaHostGetDevicePointer(&dev, err_host_, 0);
    err_host_dev_ = static_cast<unsigned*>(dev);
    if (e != cudaSuccess) {
        if (staging_) cudaFreeHost(staging_);
        if (err_host_) cudaFreeHost(err_host_);
        if (err_) cudaFree(err_);
        cudaStreamDestroy(stream_);
        cuda::throw_cuda("allocating the error word and the input staging", e);
    }
    *err_host_ = 0;
}

CudaBackend::~CudaBackend() {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    graphs_.clear();
    for (auto& u : uploads_) cudaFree(u.second);
    for (auto& p : persistent_) cudaFree(p.first);
    if (arena_) cudaFree(arena_);
    if (scratch_.partial) cudaFree(scratch_.partial);
    if (scratch_.counters) cudaFree(scratch_.counters);
    if (scratch_.halves) cudaFree(scratch_.halves);
    if (rope_angles_) cudaFree(rope_angles_);
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

void* CudaBackend::alloc_persistent(size_t bytes) {
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

void CudaBackend::apply_plan(Graph& graph, const AllocationPlan& plan) {
    if (plan.offset.size() != static_cast<size_t>(graph.size())) {
        throw std::logic_error("apply_plan: the plan was made for a different graph");
    }
    check(cudaSetDevice(device_), "cudaSetDevice");
    flush_pieces();  // queued writes land in the arena they were made for
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

void CudaBackend::compute(Graph& graph) {
    check(cudaSetDevice(device_), "cudaSetDevice");
    flush_pieces();  // the inputs' writes (outside any capture)
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

void CudaBackend::replay_timing_begin() {
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

void CudaBackend::replay_timing_end() {
    check(cudaEventRecord(replay_events_[1], stream_), "step times: cudaEventRecord");
    replay_timed_ = true;
}

void CudaBackend::capture_or_run_eager(Graph& graph, uint64_t h) {
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

void CudaBackend::write(const Tensor& t, const void* src, size_t bytes, size_t offset) {
    if (offset + bytes > t.nbytes()) throw std::logic_error("write past the end of tensor " + t.name);
    if (bytes == 0) return;
    check(cudaSetDevice(device_), "cudaSetDevice");
    char* p = static_cast<char*>(t.data) + offset;
    char* d = device_address(p, bytes);
    if (!d) throw std::logic_error("cuda backend: write to tensor " + t.name + " whose memory is not on the device");
    // Through the pinned staging the copy is queued at once (a small one as a piece, run with the
    // others before the next stream operation); from pageable memory the call first stages the
    // bytes itself. Either way the caller may reuse src when it returns, and the copy is ordered
    // before the next compute on the stream.
    if (char* staged = stage(bytes)) {
        std::memcpy(staged, src, bytes);
        if (queues(bytes)) return queue_piece(staging_dev_ + (staged - staging_), d, bytes);
        flush_pieces();
        check(cudaMemcpyAsync(d, staged, bytes, cudaMemcpyHostToDevice, stream_), "write: cudaMemcpyAsync");
    } else {
        flush_pieces();
        check(cudaMemcpyAsync(d, src, bytes, cudaMemcpyHostToDevice, stream_), "write: cudaMemcpyAsync");
    }
}

void CudaBackend::read(const Tensor& t, void* dst, size_t bytes, size_t offset) {
    if (offset + bytes > t.nbytes()) throw std::logic_error("read past the end of tensor " + t.name);
    check(cudaSetDevice(device_), "cudaSetDevice");
    char* p = static_cast<char*>(t.data) + offset;
    char* d = bytes ? device_address(p, bytes) : nullptr;
    flush_pieces();
    if (d) check(cudaMemcpyAsync(dst, d, bytes, cudaMemcpyDeviceToHost, stream_), "read: cudaMemcpyAsync");
    // The error word comes back with the data: one synchronisation per read.
    check(cudaMemcpyAsync(err_host_, err_, sizeof(unsigned), cudaMemcpyDeviceToHost, stream_),
          "reading the error word");
    check(cudaStreamSynchronize(stream_), "read: synchronising with the computation");
    staged_ = 0;  // every staged write has run
    raise_error_word(*err_host_);
    if (!d && bytes) std::memcpy(dst, p, bytes);  // a host external never uploaded: unchanged
}

void CudaBackend::read_many(const std::vector<ReadRequest>& reads) {
    const size_t total = staging_bytes_for(reads);
    check(cudaSetDevice(device_), "cudaSetDevice");
    if (total > read_staging_bytes_) {
        flush_pieces();
        check(cudaStreamSynchronize(stream_), "read: waiting before the staging grows");
        if (read_staging_) cudaFreeHost(read_staging_);
        read_staging_ = nullptr;
        read_staging_dev_ = nullptr;
        read_staging_bytes_ = 0;
        check(cudaMallocHost(&read_staging_, total), "read: allocating pinned staging");
        read_staging_bytes_ = total;
        read_staging_dev_ = mapped(read_staging_);
    }
    std::vector<const char*> host;
    queue_reads(reads, read_staging_, read_staging_dev_, host);
    queue_error_word_read(err_host_dev_);
    flush_pieces();
    check(cudaStreamSynchronize(stream_), "read: synchronising with the computation");
    staged_ = 0;  // every staged write has run
    raise_error_word(*err_host_);
    deliver_reads(reads, read_staging_, host);
}

CudaBackend::ReadTicket CudaBackend::read_many_async(const std::vector<ReadRequest>& reads) {
    const size_t total = staging_bytes_for(reads);
    check(cudaSetDevice(device_), "cudaSetDevice");
    AsyncRead slot = take_read_slot(total);
    slot.reads = reads;
    queue_reads(reads, slot.staging, slot.staging_dev, slot.host);
    queue_error_word_read(slot.err_dev);
    // Its event is recorded by the flush that runs these pieces: where the next step is queued
    // now (decoding ahead), that is the launch of its inputs, so one launch between two graphs.
    slot.recorded = false;
    slot.ticket = ++read_tickets_;
    in_flight_reads_.push_back(std::move(slot));
    if (!batch_copies_) flush_pieces();  // (A/B: each copy and the event as before)
    return in_flight_reads_.back().ticket;
}

size_t CudaBackend::staging_bytes_for(const std::vector<ReadRequest>& reads) {
    size_t total = 0;
    for (const ReadRequest& r : reads) {
        if (r.offset + r.bytes > r.t->nbytes()) throw std::logic_error("read past the end of tensor " + r.t->name);
        total += staged_size(r.bytes);
    }
    return total;
}

void CudaBackend::queue_reads(const std::vector<ReadRequest>& reads, char* staging, char* staging_dev,
                              std::vector<const char*>& host) {
    host.assign(reads.size(), nullptr);
    size_t at = 0;
    for (size_t i = 0; i < reads.size(); ++i) {
        const ReadRequest& r = reads[i];
        char* p = static_cast<char*>(r.t->data) + r.offset;
        char* d = r.bytes ? device_address(p, r.bytes) : nullptr;
        if (d && queues(r.bytes)) {
            queue_piece(d, staging_dev + at, r.bytes);
        } else if (d) {
            flush_pieces();
            check(cudaMemcpyAsync(staging + at, d, r.bytes, cudaMemcpyDeviceToHost, stream_), "read: cudaMemcpyAsync");
        } else {
            host[i] = p;
        }
        at += staged_size(r.bytes);
    }
}

void CudaBackend::deliver_reads(const std::vector<ReadRequest>& reads, const char* staging,
                                const std::vector<const char*>& host) {
    size_t at = 0;
    for (size_t i = 0; i < reads.size(); ++i) {
        const ReadRequest& r = reads[i];
        if (r.bytes) std::memcpy(r.dst, host[i] ? host[i] : staging + at, r.bytes);
        at += staged_size(r.bytes);
    }
}

void CudaBackend::finish_reads(ReadTicket ticket) {
    auto it = std::find_if(in_flight_reads_.begin(), in_flight_reads_.end(),
                           [ticket](const AsyncRead& a) { return a.ticket == ticket; });
    if (it == in_flight_reads_.end()) throw std::logic_error("cuda backend: finish_reads of an unknown ticket");
    if (!it->recorded) flush_pieces();  // its pieces and event (nothing queued after them yet)
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

void CudaBackend::copy(const Tensor& dst, const Tensor& src, size_t bytes) {
    if (bytes > dst.nbytes() || bytes > src.nbytes()) throw std::logic_error("copy past the end of a tensor");
    if (bytes == 0) return;
    check(cudaSetDevice(device_), "cudaSetDevice");
    char* d = device_address(static_cast<char*>(dst.data), bytes);
    char* s = device_address(static_cast<char*>(src.data), bytes);
    if (!d || !s) throw std::logic_error("cuda backend: copy between tensors not on the device");
    if (d == s) return;
    if (d < s + bytes && s < d + bytes) throw std::logic_error("cuda backend: copy between overlapping tensors");
    if (queues(bytes)) return queue_piece(s, d, bytes);
    flush_pieces();
    check(cudaMemcpyAsync(d, s, bytes, cudaMemcpyDeviceToDevice, stream_), "copy: cudaMemcpyAsync");
}

CudaBackend::OpProfile CudaBackend::op_profile() const {
    OpProfile rows;
    for (size_t i = 0; i < op_seconds_.size(); ++i) {
        if (op_calls_[i] != 0) rows.emplace_back(op_name(static_cast<Op>(i)), op_seconds_[i], op_calls_[i]);
    }
    return rows;
}

void CudaBackend::reserve_split_scratch(const Graph& g) {
    // The tensor-core MUL_MAT kernels (every row's, or the prompt columns'), the split decode
    // attention and the split ARGMAX / TOP_K use it.
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
        if (t.op == Op::ARGMAX || t.op == Op::TOP_K) {
            const Tensor& a = g[t.src[0]];
            const cuda::SplitScratchNeed n = cuda::pick_split_scratch(a.ne[0], a.ne[1] * a.ne[2] * a.ne[3],
                                                                      t.op == Op::TOP_K ? t.ne[0] : 0);
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

bool CudaBackend::resolve_all(const Graph& g) {
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

void CudaBackend::run_eager(Graph& graph) {
    cuda::count_graph_event(cuda::GraphEvent::Eager);
    run_ops(graph);
}

cudaGraphExec_t CudaBackend::capture(Graph& graph, uint64_t h) {
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

void CudaBackend::capture_failed(uint64_t h, const std::string& why) {
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

void CudaBackend::run_profiled(Graph& graph) {
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

template <typename BeforeOp>
void CudaBackend::run_ops(Graph& graph, BeforeOp before) {
    mark_written(graph);
    stored_angles_ = StoredAngles{};  // a table stored by another compute is not this one's
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

void CudaBackend::run_ops(Graph& graph) {
    run_ops(graph, [](int) {});
}

bool CudaBackend::on_device(const char* p) const {
    if (arena_ && p >= arena_ && p < arena_ + arena_size_) return true;
    auto it = persistent_.upper_bound(const_cast<char*>(p));
    if (it == persistent_.begin()) return false;
    --it;
    return p < it->first + it->second;
}

char* CudaBackend::device_address(char* p, size_t bytes) const {
    if (on_device(p)) return p;
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    for (auto it = uploads_.begin(); it != uploads_.end(); ++it) {
        const uintptr_t b = it->first.first;
        if (a >= b && a + bytes <= b + it->first.second) return it->second + (a - b);
    }
    return nullptr;
}

char* CudaBackend::upload(const void* host, size_t bytes, const std::string& name) {
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

char* CudaBackend::dptr(const Graph& g, int id) {
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

TDesc CudaBackend::desc(const Graph& g, int id) {
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

void CudaBackend::raise_error_word(unsigned bits) {
    if (!bits) return;
    *err_host_ = 0;
    flush_pieces();  // a queued read of the word (a later step's) sees the bits before they are cleared
    check(cudaMemsetAsync(err_, 0, sizeof(unsigned), stream_), "clearing the error word");
    std::string why;
    if (bits & cuda::kErrGetRowsId) why += " get_rows: row id out of range;";
    if (bits & cuda::kErrSetRowsId) why += " set_rows: row id out of range;";
    if (bits & cuda::kErrAttentionSpan) why += " attention: span outside the cache;";
    throw std::logic_error("cuda backend:" + why);
}

char* CudaBackend::stage(size_t bytes) {
    constexpr size_t kAlign = 256;
    if (bytes > kStagingBytes) return nullptr;
    if (staged_ + bytes > kStagingBytes) {
        flush_pieces();  // (queued pieces read the staging)
        check(cudaStreamSynchronize(stream_), "write: waiting for staged copies");
        staged_ = 0;
    }
    char* at = staging_ + staged_;
    staged_ += (bytes + kAlign - 1) / kAlign * kAlign;
    return at;
}

CudaBackend::AsyncRead CudaBackend::take_read_slot(size_t bytes) {
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
            slot.err_dev = reinterpret_cast<unsigned*>(mapped(slot.err));
        }
        if (slot.staging_bytes < bytes) {
            if (slot.staging) cudaFreeHost(slot.staging);
            slot.staging = nullptr;
            slot.staging_dev = nullptr;
            slot.staging_bytes = 0;
            void* p = nullptr;
            check(cudaMallocHost(&p, bytes), "read: allocating pinned staging");
            slot.staging = static_cast<char*>(p);
            slot.staging_bytes = bytes;
            slot.staging_dev = mapped(slot.staging);
        }
    } catch (...) {
        free_read_slots_.push_back(slot);
        throw;
    }
    return slot;
}

}  // namespace cuda_backend


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
    return std::make_unique<cuda_backend::CudaBackend>(device, n_seq_max >= cuda::kTcAllRowsMinSeqs);
}

}  // namespace pyspec

