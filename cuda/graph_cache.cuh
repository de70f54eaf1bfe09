// The CUDA backend's cache of instantiated CUDA graphs (see cuda/cuda_graphs.h for what is
// captured and when). One cache per backend; it is used from the thread that runs compute().
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <cuda_runtime.h>

#include "core/graph.h"

namespace pyspec {
namespace cuda {

// The counters behind cuda_graph_stats().
enum class GraphEvent { Capture, Replay, Eager, CaptureFailure, Eviction, EarlyWeightLaunch, RopeAttentionLaunch,
                        EarlyCopyAttentionLaunch, StoredAnglesAttentionLaunch, RowTmaLaunch, NormPrologueLaunch,
                        EarlyNormLaunch, DeepRowLaunch, PipedRowLaunch,
                        OneBlockRowLaunch, RoomRowLaunch, BatchedCopyLaunch };
void count_graph_event(GraphEvent e);
void count_replay_gpu_time(float ms);  // one timed replay (CudaGraphStats::replay_gpu_ns)

// The key of one compute(graph): per tensor its op, flags, type, shape, strides, sources, view
// relation, op parameters (bit patterns) and data pointer as the graph has it (device memory, or
// a host external's, which compute() maps to the same device copy every time). Everything a
// launcher decides (kernel, grid, arguments, vectorised loads by alignment) follows from these,
// so two computes with equal keys launch the same kernels with the same arguments. Returns the
// key's hash.
uint64_t graph_exec_key(const Graph& g, std::vector<uint64_t>& key);
// Whether g's key (graph_exec_key) equals key, word by word as they are made: no hash, nothing
// written, and it stops at the first tensor that differs.
bool graph_has_key(const Graph& g, const std::vector<uint64_t>& key);

class GraphCache {
public:
    // capacity: instantiated graphs kept (least recently used dropped first); 0 keeps none.
    explicit GraphCache(size_t capacity);
    ~GraphCache();
    GraphCache(const GraphCache&) = delete;
    GraphCache& operator=(const GraphCache&) = delete;

    // The instantiated graph for this key (marked most recently used), or nullptr.
    cudaGraphExec_t find(uint64_t hash, const std::vector<uint64_t>& key);
    // The most recently used graph when g's key is its key (graph_has_key), or nullptr: a step
    // like the one before replays without hashing its key (~15 us of host time on the H200
    // machine for SmolLM2's ~12k words) nor comparing it after a lookup.
    cudaGraphExec_t find_recent(const Graph& g) const;
    // Takes ownership of exec; drops the least recently used graph when full.
    void insert(uint64_t hash, const std::vector<uint64_t>& key, cudaGraphExec_t exec);
    // Records a sighting of a key without a graph; true when it was seen before (by hash; the
    // record of sightings is bounded too).
    bool sighted_before(uint64_t hash);
    bool failed(uint64_t hash) const { return failed_.count(hash) != 0; }
    void mark_failed(uint64_t hash) { failed_.insert(hash); }
    // Destroys every graph and forgets every sighting (e.g. when the arena moved).
    void clear();

    size_t size() const { return lru_.size(); }
    size_t capacity() const { return capacity_; }

private:
    struct Entry {
        uint64_t hash;
        std::vector<uint64_t> key;
        cudaGraphExec_t exec;
    };
    void drop(std::list<Entry>::iterator it);

    size_t capacity_;
    std::list<Entry> lru_;  // most recently used first
    std::unordered_map<uint64_t, std::list<Entry>::iterator> index_;
    std::unordered_set<uint64_t> seen_;
    std::deque<uint64_t> seen_order_;
    std::unordered_set<uint64_t> failed_;
};

// PYSPEC_CUDA_GRAPH_CACHE (default 64): the capacity of each backend's cache.
size_t graph_cache_capacity_from_env();

}  // namespace cuda
}  // namespace pyspec
