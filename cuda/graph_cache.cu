// CUDA graph cache of the CUDA backend, the process-wide switch and counters (cuda/cuda_graphs.h).
#include "cuda/graph_cache.cuh"
#include "cuda/launch.cuh"

#include <atomic>
#include <iterator>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda/cuda_graphs.h"
#include "cuda/attention_common.cuh"
#include "cuda/kernels.h"

namespace pyspec {
namespace {

std::atomic<int> g_mode{-1};  // -1: not decided yet (read the environment), 0 off, 1 on
std::atomic<uint64_t> g_captures{0}, g_replays{0}, g_eager{0}, g_failures{0}, g_evictions{0}, g_live{0};

}  // namespace

void set_cuda_graphs(bool on) { g_mode.store(on ? 1 : 0); }

bool cuda_graphs_enabled() {
    int m = g_mode.load();
    if (m < 0) {
        const int from_env = cuda::env_switch("PYSPEC_CUDA_GRAPHS") == 0 ? 0 : 1;
        g_mode.compare_exchange_strong(m, from_env);
        m = g_mode.load();
    }
    return m == 1;
}

CudaGraphStats cuda_graph_stats() {
    CudaGraphStats s;
    s.captures = g_captures.load();
    s.replays = g_replays.load();
    s.eager = g_eager.load();
    s.capture_failures = g_failures.load();
    s.evictions = g_evictions.load();
    s.live = g_live.load();
    return s;
}

void reset_cuda_graph_stats() {
    g_captures = 0;
    g_replays = 0;
    g_eager = 0;
    g_failures = 0;
    g_evictions = 0;
}

namespace cuda {

void count_graph_event(GraphEvent e) {
    switch (e) {
        case GraphEvent::Capture: ++g_captures; break;
        case GraphEvent::Replay: ++g_replays; break;
        case GraphEvent::Eager: ++g_eager; break;
        case GraphEvent::CaptureFailure: ++g_failures; break;
        case GraphEvent::Eviction: ++g_evictions; break;
    }
}

size_t graph_cache_capacity_from_env() {
    const char* v = std::getenv("PYSPEC_CUDA_GRAPH_CACHE");
    if (!v || !*v) return 64;
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (end == v || n < 0) return 64;
    return static_cast<size_t>(n);
}

namespace {

inline uint64_t mix(uint64_t h, uint64_t v) {
    // splitmix64 finaliser over the running hash and the next word.
    uint64_t z = h ^ (v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2));
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

inline uint64_t pack2(uint32_t a, uint32_t b) { return (static_cast<uint64_t>(a) << 32) | b; }

inline uint32_t fbits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    return u;
}

}  // namespace

uint64_t graph_exec_key(const Graph& g, const std::vector<char*>& resolved, std::vector<uint64_t>& key) {
    key.clear();
    const int n = g.size();
    key.reserve(static_cast<size_t>(n) * 18 + 2);
    key.push_back(static_cast<uint64_t>(n));
    // The launch choices read from the environment at each compute: a graph captured under one
    // setting is never replayed under another.
    key.push_back(static_cast<uint64_t>(matmul_tc_setting() + 1) | (matmul_fusion_enabled() ? 4u : 0u) |
                  (attention_tiled_enabled() ? 8u : 0u) | (pdl_enabled() ? 16u : 0u) |
                  (attention_tc_enabled() ? 32u : 0u));
    for (int id = 0; id < n; ++id) {
        const Tensor& t = g[id];
        key.push_back((static_cast<uint64_t>(t.op) << 16) | (static_cast<uint64_t>(t.flags) << 8) |
                      static_cast<uint64_t>(t.dtype));
        for (int i = 0; i < kMaxDims; ++i) key.push_back(static_cast<uint64_t>(t.ne[static_cast<size_t>(i)]));
        for (int i = 0; i < kMaxDims; ++i) key.push_back(static_cast<uint64_t>(t.nb[static_cast<size_t>(i)]));
        key.push_back(pack2(static_cast<uint32_t>(t.src[0]), static_cast<uint32_t>(t.src[1])));
        key.push_back(pack2(static_cast<uint32_t>(t.src[2]), static_cast<uint32_t>(t.src[3])));
        key.push_back(pack2(static_cast<uint32_t>(t.src[4]), static_cast<uint32_t>(t.view_src)));
        key.push_back(static_cast<uint64_t>(t.view_offset));
        key.push_back(pack2(static_cast<uint32_t>(t.iparams[0]), static_cast<uint32_t>(t.iparams[1])));
        key.push_back(pack2(static_cast<uint32_t>(t.iparams[2]), static_cast<uint32_t>(t.iparams[3])));
        key.push_back(pack2(fbits(t.fparams[0]), fbits(t.fparams[1])));
        key.push_back(pack2(fbits(t.fparams[2]), fbits(t.fparams[3])));
        key.push_back(reinterpret_cast<uintptr_t>(resolved[static_cast<size_t>(id)]));
    }
    uint64_t h = 0x6a09e667f3bcc909ull;
    for (uint64_t w : key) h = mix(h, w);
    return h;
}

GraphCache::GraphCache(size_t capacity) : capacity_(capacity) {}

GraphCache::~GraphCache() { clear(); }

void GraphCache::drop(std::list<Entry>::iterator it) {
    if (it->exec) {
        cudaGraphExecDestroy(it->exec);
        --g_live;
    }
    index_.erase(it->hash);
    lru_.erase(it);
}

cudaGraphExec_t GraphCache::find(uint64_t hash, const std::vector<uint64_t>& key) {
    auto it = index_.find(hash);
    if (it == index_.end()) return nullptr;
    if (it->second->key != key) return nullptr;  // a hash collision: not this graph
    lru_.splice(lru_.begin(), lru_, it->second);
    return it->second->exec;
}

void GraphCache::insert(uint64_t hash, const std::vector<uint64_t>& key, cudaGraphExec_t exec) {
    if (capacity_ == 0) {
        cudaGraphExecDestroy(exec);
        return;
    }
    auto old = index_.find(hash);
    if (old != index_.end()) drop(old->second);  // a colliding key: the newer one wins
    while (lru_.size() >= capacity_) {
        drop(std::prev(lru_.end()));
        count_graph_event(GraphEvent::Eviction);
    }
    lru_.push_front(Entry{hash, key, exec});
    index_[hash] = lru_.begin();
    ++g_live;
}

bool GraphCache::sighted_before(uint64_t hash) {
    if (seen_.count(hash)) return true;
    const size_t bound = 4 * (capacity_ < 64 ? 64 : capacity_);
    while (seen_order_.size() >= bound) {
        seen_.erase(seen_order_.front());
        seen_order_.pop_front();
    }
    seen_.insert(hash);
    seen_order_.push_back(hash);
    return false;
}

void GraphCache::clear() {
    while (!lru_.empty()) drop(lru_.begin());
    seen_.clear();
    seen_order_.clear();
    failed_.clear();
}

}  // namespace cuda
}  // namespace pyspec
