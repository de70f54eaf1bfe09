// The CPU backend: an arena for planned tensors, a thread pool, and the op kernels.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/backend.h"
#include "core/thread_pool.h"
#include "cpu/ops.h"

namespace pyspec {

class CpuBackend final : public Backend {
public:
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

    ThreadPool& pool() { return pool_; }

private:
    struct FreeDeleter {
        void operator()(void* p) const;
    };
    ThreadPool pool_;
    std::unique_ptr<uint8_t, FreeDeleter> arena_;
    size_t arena_size_ = 0;
    std::vector<std::unique_ptr<uint8_t, FreeDeleter>> persistent_;
    std::vector<KernelScratch> scratch_;       // one per thread
    std::vector<uint8_t> matmul_scratch_;      // prepared activations, shared by all threads
    bool poison_ = false;
};

}  // namespace pyspec
