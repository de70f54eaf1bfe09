// A fixed pool of worker threads that run one parallel task at a time. The calling thread takes
// part as worker 0, so a pool of n threads starts n - 1 helpers. Workers spin briefly between
// tasks (ops in a graph follow each other within microseconds) and then sleep.
//
// CPU backends share one pool per thread count (shared()): a speculative engine's target and
// drafter take turns, and with a pool each the idle one's workers spun on the cores the busy
// one needed (the drafter's passes cost 30-38% of a plain SmolLM2 step on 2 cores with two
// pools, 20-29% with one). run() is serialised, so backends used from different threads at the
// same time stay correct; they take turns op by op.
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace pyspec {

class ThreadPool {
public:
    explicit ThreadPool(int n_threads);
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    int size() const { return n_threads_; }

    // The process's pool of n_threads workers, started on first use and kept while any holder
    // keeps it. A forked child starts its own (the parent's workers do not exist there).
    static std::shared_ptr<ThreadPool> shared(int n_threads);

    // Runs fn(ith, nth) for ith in [0, nth) with nth = size(), and returns when all are done.
    // An exception thrown by any part is rethrown here (the first one) after all parts finish.
    // Not reentrant: fn must not call run() on the same pool.
    void run(const std::function<void(int ith, int nth)>& fn);

private:
    void worker(int ith);
    void run_part(int ith);

    std::mutex run_mutex_;   // one task at a time, whoever calls
    std::exception_ptr error_;
    std::mutex error_mutex_;
    int n_threads_;
    std::vector<std::thread> threads_;
    const std::function<void(int, int)>* task_ = nullptr;
    std::atomic<uint64_t> generation_{0};
    std::atomic<int> pending_{0};
    std::atomic<bool> stop_{false};
    std::mutex mutex_;
    std::condition_variable wake_;
};

// Splits [0, n) into nth nearly equal contiguous parts and returns part ith as [begin, end).
inline void split_range(int64_t n, int ith, int nth, int64_t& begin, int64_t& end) {
    const int64_t per = (n + nth - 1) / nth;
    begin = per * ith < n ? per * ith : n;
    end = begin + per < n ? begin + per : n;
}

}  // namespace pyspec
