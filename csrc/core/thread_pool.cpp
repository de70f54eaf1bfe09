#include "core/thread_pool.h"

namespace pyspec {

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

void ThreadPool::run(const std::function<void(int, int)>& fn) {
    if (n_threads_ == 1) {
        fn(0, 1);
        return;
    }
    error_ = nullptr;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        task_ = &fn;
        pending_.store(n_threads_ - 1);
        generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    run_part(0);
    while (pending_.load(std::memory_order_acquire) != 0) {
        std::this_thread::yield();
    }
    if (error_) {
        std::exception_ptr e = error_;
        error_ = nullptr;
        std::rethrow_exception(e);
    }
}

void ThreadPool::worker(int ith) {
    uint64_t seen = 0;
    for (;;) {
        // Spin a little first: the next op usually arrives within microseconds.
        uint64_t gen = generation_.load(std::memory_order_acquire);
        for (int spin = 0; gen == seen && spin < 20000; ++spin) {
            std::this_thread::yield();
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
