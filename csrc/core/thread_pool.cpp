#include "core/thread_pool.h"

#include <pthread.h>

#include <cstdint>
#include <map>
#include <thread>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace pyspec {
namespace {

// One polite busy-wait step: tells the core this is a spin loop (saves power, yields the
// pipeline to a sibling hyperthread) without leaving user space.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

// Waits between ops. The next op usually follows within microseconds, so a waiting thread
// first spins in user space (a few microseconds: seeing the new task costs a cache-line round
// trip, not a system call), then yields (another process may need the core), then sleeps.
constexpr int kPauseSpins = 256;
constexpr int kYieldSpins = 20000;

// Step `spin` of a wait loop.
inline void wait_step(int spin) {
    if (spin < kPauseSpins) {
        cpu_relax();
    } else {
        std::this_thread::yield();
    }
}

}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads < 1 ? 1 : n_threads) {
    for (int i = 1; i < n_threads_; ++i) threads_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_.store(true);
        generation_.fetch_add(1);
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
}

void ThreadPool::run_part(int ith) {
    try {
        (*task_)(ith, n_threads_);
    } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
    }
}

namespace {

// The shared pools by thread count. A forked child has none of the parent's worker threads, so
// it must not be handed the parent's pools: fork bumps the generation (in the child) and the
// registry's lock is held across fork, so the child never inherits it locked.
struct PoolRegistry {
    std::mutex mutex;
    uint64_t generation = 0;
    std::map<std::pair<uint64_t, int>, std::weak_ptr<ThreadPool>> pools;
};

PoolRegistry& registry() {
    static PoolRegistry* r = [] {
        auto* reg = new PoolRegistry();  // never destroyed: pools may outlive static destruction
        pthread_atfork([] { registry().mutex.lock(); }, [] { registry().mutex.unlock(); },
                       [] {
                           registry().generation += 1;
                           registry().mutex.unlock();
                       });
        return reg;
    }();
    return *r;
}

}  // namespace

std::shared_ptr<ThreadPool> ThreadPool::shared(int n_threads) {
    PoolRegistry& reg = registry();
    const int n = n_threads < 1 ? 1 : n_threads;
    std::lock_guard<std::mutex> lock(reg.mutex);
    std::weak_ptr<ThreadPool>& slot = reg.pools[{reg.generation, n}];
    std::shared_ptr<ThreadPool> pool = slot.lock();
    if (!pool) {
        pool = std::make_shared<ThreadPool>(n);
        slot = pool;
    }
    return pool;
}

void ThreadPool::run(const std::function<void(int, int)>& fn) {
    if (n_threads_ == 1) {
        fn(0, 1);
        return;
    }
    std::lock_guard<std::mutex> serial(run_mutex_);
    error_ = nullptr;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        task_ = &fn;
        pending_.store(n_threads_ - 1);
        generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    run_part(0);
    for (int spin = 0; pending_.load(std::memory_order_acquire) != 0; ++spin) wait_step(spin);
    if (error_) {
        std::exception_ptr e = error_;
        error_ = nullptr;
        std::rethrow_exception(e);
    }
}

void ThreadPool::worker(int ith) {
    uint64_t seen = 0;
    for (;;) {
        uint64_t gen = generation_.load(std::memory_order_acquire);
        for (int spin = 0; gen == seen && spin < kPauseSpins + kYieldSpins; ++spin) {
            wait_step(spin);
            gen = generation_.load(std::memory_order_acquire);
        }
        if (gen == seen) {
            std::unique_lock<std::mutex> lock(mutex_);
            wake_.wait(lock, [&] { return generation_.load() != seen; });
            gen = generation_.load();
        }
        seen = gen;
        if (stop_.load()) return;
        run_part(ith);
        pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
}

}  // namespace pyspec
