// What a compute backend does: own the arena that plans place tensors in, resolve every tensor's
// data pointer for a plan, run a graph, and move bytes in and out of tensors. The CPU backend
// implements it; a CUDA backend implements the same interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "core/graph.h"
#include "core/planner.h"

namespace pyspec {

class Backend {
public:
    virtual ~Backend() = default;
    virtual const char* name() const = 0;

    // Memory for long-lived tensors (KV cache); zero-filled. Owned by the backend.
    virtual void* alloc_persistent(size_t bytes) = 0;

    // Makes the arena at least plan.arena_bytes (grow-only) and sets data for every tensor of
    // the graph: owned tensors at arena + offset, views at their root's data + offset.
    virtual void apply_plan(Graph& graph, const AllocationPlan& plan) = 0;

    // Executes every computed node in order.
    virtual void compute(Graph& graph) = 0;

    // Copies into / out of a tensor's memory (host pointers on the other side).
    virtual void write(const Tensor& t, const void* src, size_t bytes, size_t offset = 0) = 0;
    virtual void read(const Tensor& t, void* dst, size_t bytes, size_t offset = 0) = 0;

    // Several reads after one computation, as read() would do them one by one (the default).
    // A device backend queues them all and waits once: a drafter pass reads a dozen small
    // outputs, and a wait per read is a host round trip each.
    struct ReadRequest {
        const Tensor* t = nullptr;
        void* dst = nullptr;
        size_t bytes = 0;
        size_t offset = 0;
    };
    virtual void read_many(const std::vector<ReadRequest>& reads) {
        for (const ReadRequest& r : reads) read(*r.t, r.dst, r.bytes, r.offset);
    }

    // read_many without the wait: the reads are queued behind the computation queued so far and
    // finish_reads(ticket) waits for them (not for what was queued after them) and delivers them;
    // until then their destinations must stay put. A launched step's outputs can so be waited
    // for while the next step is already queued. The default reads at once (a synchronous
    // backend has nothing in flight).
    using ReadTicket = uint64_t;
    virtual ReadTicket read_many_async(const std::vector<ReadRequest>& reads) {
        read_many(reads);
        return 0;
    }
    virtual void finish_reads(ReadTicket) {}

    // Copies `bytes` from the start of src's memory to the start of dst's, ordered behind the
    // computation queued so far and before what is queued next (a step's ARGMAX ids as the next
    // step's tokens, without a trip through the host). The default goes through the host.
    virtual void copy(const Tensor& dst, const Tensor& src, size_t bytes) {
        std::vector<unsigned char> tmp(bytes);
        read(src, tmp.data(), bytes);
        write(dst, tmp.data(), bytes);
    }

    // Whether compute() only queues the work (a device backend) rather than doing it before it
    // returns: only then can the host prepare the next step while this one runs.
    virtual bool computes_asynchronously() const { return false; }

    virtual size_t arena_bytes() const = 0;

    // Whether MUL_MAT's prompt columns (graph.h) run on a path of their own, so a prompt row's
    // bits differ from those of the same row decoded as an output row (both fixed per kind).
    // Callers then mark prompt rows in their graphs and never reuse an output row's cache cells
    // as a prompt row's. The CPU backend has one path for both.
    virtual bool prompt_rows_have_own_path() const { return false; }

    // Per-op time profile: while on, compute() accumulates each op kind's time and call count
    // (the CPU backend: wall time per op; the CUDA backend: device time between events, with
    // graph capture off while profiling). op_profile() lists the kinds that ran, as
    // (op name, seconds, calls); a backend without a profiler returns an empty list.
    using OpProfile = std::vector<std::tuple<std::string, double, int64_t>>;
    virtual void set_profiling(bool) {}
    virtual OpProfile op_profile() const { return {}; }
};

}  // namespace pyspec
