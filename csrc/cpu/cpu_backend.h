// The CPU backend: an arena for planned tensors, a thread pool, and the op kernels.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "core/backend.h"
#include "core/thread_pool.h"
#include "cpu/attention.h"
#include "cpu/ops.h"

namespace pyspec {

// The packed copies (cpu/quants.h, pack_weights) a CPU backend has looked up, by the weights'
// first byte; `packed` is nullptr where none is kept (other types, memory that may change).
struct PackedLookups {
    struct Entry {
        uint64_t kind;
        size_t bytes;
        const void* packed;
    };
    std::unordered_map<const void*, Entry> by_data;
    uint64_t generation = 0;  // core/immutable_memory.h's when by_data was last emptied
};

class CpuBackend final : public Backend {
public:
    // Runs on the process's shared pool of n_threads workers (ThreadPool::shared).
    explicit CpuBackend(int n_threads);
    ~CpuBackend() override;

    const char* name() const override { return "CPU"; }
    void* alloc_persistent(size_t bytes) override;
    void apply_plan(Graph& graph, const AllocationPlan& plan) override;
    void compute(Graph& graph) override;
    void write(const Tensor& t, const void* src, size_t bytes, size_t offset) override;
    void read(const Tensor& t, void* dst, size_t bytes, size_t offset) override;
    size_t arena_bytes() const override { return arena_size_; }

    // Debug aid for tests: fill the arena with NaNs whenever a plan is applied (before the caller
    // writes the inputs), so a kernel that reads
    // memory no earlier node wrote (or that a plan wrongly shared) produces NaNs, not plausible
    // values.
    void set_poison(bool on) { poison_ = on; }

    ThreadPool& pool() { return *pool_; }

    // Per-op wall time, accumulated while profiling is on (indexed by Op).
    void set_profiling(bool on) override { profiling_ = on; }
    OpProfile op_profile() const override;

private:
    struct FreeDeleter {
        void operator()(void* p) const;
    };
    std::shared_ptr<ThreadPool> pool_;
    std::unique_ptr<uint8_t, FreeDeleter> arena_;
    size_t arena_size_ = 0;
    // Persistent buffers (KV caches) are anonymous mappings: zero pages that the kernel commits
    // only when written, so a cache sized for a slot's whole context costs memory only for the
    // cells in use (how a server's slots can each be allowed the full context).
    struct Mapping {
        void* p = nullptr;
        size_t bytes = 0;
        Mapping(size_t n);
        ~Mapping();
        Mapping(const Mapping&) = delete;
        Mapping& operator=(const Mapping&) = delete;
    };
    std::vector<std::unique_ptr<Mapping>> persistent_;
    std::vector<KernelScratch> scratch_;       // one per thread
    std::vector<uint8_t> matmul_scratch_;      // prepared activations, shared by all threads
    // Packed weights this backend has looked up (cpu_backend.cpp, packed_copy), by the weights'
    // first byte: the registry's lock and search once per matrix, not once per MUL_MAT. Emptied
    // when any mapping has gone since (core/immutable_memory.h, immutable_generation).
    PackedLookups packed_;
    AttentionPhaseScratch attention_scratch_;  // the phased attention's buffers
    bool poison_ = false;
    bool profiling_ = false;
    std::vector<double> op_seconds_ = std::vector<double>(static_cast<size_t>(Op::COUNT), 0.0);
    std::vector<int64_t> op_calls_ = std::vector<int64_t>(static_cast<size_t>(Op::COUNT), 0);
};

}  // namespace pyspec
