// The allocation planner (design.md invariant 1): graph -> byte offsets in one arena, chosen by
// liveness. A plan is cached under the graph's full key (op, dtype, shape, edges, view relation
// and input/output/pinned/external flags of every tensor), never under sizes alone, so a graph
// whose output flags differ can never reuse another graph's plan.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <vector>

#include "core/graph.h"

namespace pyspec {

struct AllocationPlan {
    // Per tensor id: byte offset in the arena for owned tensors (inputs and computed non-views),
    // -1 for views and external tensors.
    std::vector<int64_t> offset;
    size_t arena_bytes = 0;  // bytes the arena must have for this plan
    size_t alignment = 1;    // every owned offset is a multiple of it (check_plan verifies)
    uint64_t key_hash = 0;
};

// The key a plan is cached under. Two graphs with equal keys have identical liveness and sizes.
std::vector<int64_t> graph_plan_key(const Graph& graph);
uint64_t hash_plan_key(const std::vector<int64_t>& key);

// Computes a fresh plan (no cache). alignment: every offset is a multiple of it.
AllocationPlan make_plan(const Graph& graph, size_t alignment);

// Throws std::logic_error naming the two tensors when the plan lets tensors that are live at
// the same time overlap, reuses an output/pinned tensor's bytes, or places a tensor outside the
// arena (graph-allocator.md §4.3 invariants 1, 2 and 5); also when an offset is misaligned, a
// view does not lie inside its root, or the plan does not match the graph's tensor count.
void check_plan(const Graph& graph, const AllocationPlan& plan);

// Sets every planned tensor's data for a backend whose arena starts at `arena` (host or device
// address alike): owned tensors at arena + offset, views at their root's data + view_offset;
// external tensors keep theirs. Throws std::logic_error for an owned tensor the plan left out.
void assign_addresses(Graph& graph, const AllocationPlan& plan, char* arena);

class AllocationPlanner {
public:
    // cache_capacity 0 disables caching (every call plans afresh); alignment must be positive.
    explicit AllocationPlanner(size_t cache_capacity = 4, size_t alignment = 64);

    // The plan for this graph: from the cache when a graph with the same full key was planned
    // before, else planned now (least recently used entry evicted). When checking is on, every
    // returned plan is verified against this graph with check_plan.
    std::shared_ptr<const AllocationPlan> plan(const Graph& graph);

    void set_checking(bool on) { checking_ = on; }
    bool checking() const { return checking_; }
    size_t plans_built() const { return plans_built_; }
    size_t cache_hits() const { return cache_hits_; }
    size_t alignment() const { return alignment_; }
    size_t cache_capacity() const { return capacity_; }
    size_t cache_size() const { return cache_.size(); }

private:
    struct Entry {
        std::vector<int64_t> key;
        std::shared_ptr<const AllocationPlan> plan;
    };
    size_t capacity_;
    size_t alignment_;
    bool checking_ = false;
    size_t plans_built_ = 0;
    size_t cache_hits_ = 0;
    std::list<Entry> cache_;  // most recently used first
};

}  // namespace pyspec
