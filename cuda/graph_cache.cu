// CUDA graph cache of the CUDA backend, the process-wide switch and counters (cuda/cuda_graphs.h).
#include "cuda/graph_cache.cuh"
#include "cuda/launch.cuh"

#include <atomic>
#include <iterator>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cuda/cuda_graphs.h"
#include "cuda/attention_common.cuh"
#include "cuda/kernels.h"

namespace pyspec {
namespace {

std::atomic<int> g_mode{-1};  // -1: not decided yet (read the environment), 0 off, 1 on
std::atomic<uint64_t> g_captures{0}, g_replays{0}, g_eager{0}, g_failures{0}, g_evictions{0}, g_live{0}, g_early{0},
    g_rope_attention{0}, g_early_copy_attention{0}, g_stored_angles_attention{0}, g_row_tma{0}, g_norm_prologue{0},
    g_early_norm{0}, g_deep_rows{0}, g_piped_rows{0}, g_one_block_rows{0}, g_room_rows{0}, g_batched_copies{0}, g_timed_replays{0}, g_replay_gpu_ns{0};

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
    s.early_weight_launches = g_early.load();
    s.rope_attention_launches = g_rope_attention.load();
    s.early_copy_attention_launches = g_early_copy_attention.load();
    s.stored_angles_attention_launches = g_stored_angles_attention.load();
    s.row_tma_launches = g_row_tma.load();
    s.norm_prologue_launches = g_norm_prologue.load();
    s.early_norm_launches = g_early_norm.load();
    s.deep_row_launches = g_deep_rows.load();
    s.piped_row_launches = g_piped_rows.load();
    s.one_block_row_launches = g_one_block_rows.load();
    s.room_row_launches = g_room_rows.load();
    s.batched_copy_launches = g_batched_copies.load();
    s.timed_replays = g_timed_replays.load();
    s.replay_gpu_ns = g_replay_gpu_ns.load();
    return s;
}

void reset_cuda_graph_stats() {
    g_captures = 0;
    g_replays = 0;
    g_eager = 0;
    g_failures = 0;
    g_evictions = 0;
    g_early = 0;
    g_rope_attention = 0;
    g_early_copy_attention = 0;
    g_stored_angles_attention = 0;
    g_row_tma = 0;
    g_norm_prologue = 0;
    g_early_norm = 0;
    g_deep_rows = 0;
    g_piped_rows = 0;
    g_one_block_rows = 0;
    g_room_rows = 0;
    g_batched_copies = 0;
    g_timed_replays = 0;
    g_replay_gpu_ns = 0;
}

namespace cuda {

void count_graph_event(GraphEvent e) {
    switch (e) {
        case GraphEvent::Capture: ++g_captures; break;
        case GraphEvent::Replay: ++g_replays; break;
        case GraphEvent::Eager: ++g_eager; break;
        case GraphEvent::CaptureFailure: ++g_failures; break;
        case GraphEvent::Eviction: ++g_evictions; break;
        case GraphEvent::EarlyWeightLaunch: ++g_early; break;
        case GraphEvent::RopeAttentionLaunch: ++g_rope_attention; break;
        case GraphEvent::EarlyCopyAttentionLaunch: ++g_early_copy_attention; break;
        case GraphEvent::StoredAnglesAttentionLaunch: ++g_stored_angles_attention; break;
        case GraphEvent::RowTmaLaunch: ++g_row_tma; break;
        case GraphEvent::NormPrologueLaunch: ++g_norm_prologue; break;
        case GraphEvent::EarlyNormLaunch: ++g_early_norm; break;
        case GraphEvent::DeepRowLaunch: ++g_deep_rows; break;
        case GraphEvent::PipedRowLaunch: ++g_piped_rows; break;
        case GraphEvent::OneBlockRowLaunch: ++g_one_block_rows; break;
        case GraphEvent::RoomRowLaunch: ++g_room_rows; break;
        case GraphEvent::BatchedCopyLaunch: ++g_batched_copies; break;
    }
}

void count_replay_gpu_time(float ms) {
    ++g_timed_replays;
    g_replay_gpu_ns += static_cast<uint64_t>(static_cast<double>(ms) * 1e6);
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

// The key's hash, recomputed at every compute (a SmolLM2 decode step's key is ~12k words): four
// independent multiply-rotate lanes, folded by mix at the end. A hit compares the whole key
// anyway, so the hash only has to spread keys over the index. One mix chain over every word (each
// word waiting on the last: three dependent multiplies) made graph_exec_key 129 us of the H200
// machine's host time per SmolLM2 step, before the launch; this way 15 us. Same machine, tg128
// alternating (2026-12-01): SmolLM2 Q4_1 1,117-1,165 -> 1,296-1,315 t/s, Qwen3-4B F16 281-287 ->
// 298-300.
inline uint64_t hash_words(const std::vector<uint64_t>& key) {
    constexpr uint64_t kMul = 0x9e3779b97f4a7c15ull;
    uint64_t lane[4] = {0x6a09e667f3bcc909ull, 0xbb67ae8584caa73bull, 0x3c6ef372fe94f82bull, 0xa54ff53a5f1d36f1ull};
    const size_t n = key.size();
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        for (int j = 0; j < 4; ++j) {
            const uint64_t z = (lane[j] ^ key[i + static_cast<size_t>(j)]) * kMul;
            lane[j] = (z << 31) | (z >> 33);
        }
    }
    uint64_t h = mix(static_cast<uint64_t>(n), lane[0]);
    for (int j = 1; j < 4; ++j) h = mix(h, lane[j]);
    for (; i < n; ++i) h = mix(h, key[i]);
    return h;
}

inline uint64_t pack2(uint32_t a, uint32_t b) { return (static_cast<uint64_t>(a) << 32) | b; }

inline uint32_t fbits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    return u;
}

constexpr size_t kWordsPerTensor = 1 + 2 * kMaxDims + 9;

size_t key_words(const Graph& g) { return static_cast<size_t>(g.size()) * kWordsPerTensor + 2; }

// The key's words in order, each handed to sink(word); stops early (false) when sink says so.
template <class Sink>
inline bool for_each_key_word(const Graph& g, Sink&& sink) {
    const int n = g.size();
    if (!sink(static_cast<uint64_t>(n))) return false;
    // The launch choices read from the environment at each compute: a graph captured under one
    // setting is never replayed under another.
    if (!sink(static_cast<uint64_t>(matmul_tc_setting() + 1) | (matmul_fusion_enabled() ? 4u : 0u) |
              (attention_tiled_enabled() ? 8u : 0u) | (pdl_enabled() ? 16u : 0u) |
              (attention_tc_enabled() ? 32u : 0u) | (attention_rope_enabled() ? 64u : 0u) |
              static_cast<uint64_t>(matmul_row_tma_setting()) << 7 |
              static_cast<uint64_t>(matmul_row_stream_setting()) << 16 |
              static_cast<uint64_t>(attention_rope_setting()) << 32)) {
        return false;
    }
    for (int id = 0; id < n; ++id) {
        const Tensor& t = g[id];
        bool same = sink((static_cast<uint64_t>(t.op) << 16) | (static_cast<uint64_t>(t.flags) << 8) |
                         static_cast<uint64_t>(t.dtype));
        for (int i = 0; i < kMaxDims; ++i) same = sink(static_cast<uint64_t>(t.ne[static_cast<size_t>(i)])) && same;
        for (int i = 0; i < kMaxDims; ++i) same = sink(static_cast<uint64_t>(t.nb[static_cast<size_t>(i)])) && same;
        same = sink(pack2(static_cast<uint32_t>(t.src[0]), static_cast<uint32_t>(t.src[1]))) && same;
        same = sink(pack2(static_cast<uint32_t>(t.src[2]), static_cast<uint32_t>(t.src[3]))) && same;
        same = sink(pack2(static_cast<uint32_t>(t.src[4]), static_cast<uint32_t>(t.view_src))) && same;
        same = sink(static_cast<uint64_t>(t.view_offset)) && same;
        same = sink(pack2(static_cast<uint32_t>(t.iparams[0]), static_cast<uint32_t>(t.iparams[1]))) && same;
        same = sink(pack2(static_cast<uint32_t>(t.iparams[2]), static_cast<uint32_t>(t.iparams[3]))) && same;
        same = sink(pack2(fbits(t.fparams[0]), fbits(t.fparams[1]))) && same;
        same = sink(pack2(fbits(t.fparams[2]), fbits(t.fparams[3]))) && same;
        same = sink(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(t.data))) && same;
        if (!same) return false;  // checked once a tensor: a branch a word would cost more
    }
    return true;
}

}  // namespace

uint64_t graph_exec_key(const Graph& g, std::vector<uint64_t>& key) {
    key.resize(key_words(g));  // written in place: no push_back checks
    uint64_t* k = key.data();
    for_each_key_word(g, [&k](uint64_t w) {
        *k++ = w;
        return true;
    });
    if (k != key.data() + key.size()) throw std::logic_error("graph_exec_key: words per tensor");
    return hash_words(key);
}

bool graph_has_key(const Graph& g, const std::vector<uint64_t>& key) {
    if (key.size() != key_words(g)) return false;
    const uint64_t* k = key.data();
    return for_each_key_word(g, [&k](uint64_t w) { return *k++ == w; });
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

cudaGraphExec_t GraphCache::find_recent(const Graph& g) const {
    if (lru_.empty() || !graph_has_key(g, lru_.front().key)) return nullptr;
    return lru_.front().exec;
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
