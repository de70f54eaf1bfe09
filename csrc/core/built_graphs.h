// Graphs a context built and planned before, kept for reuse under their build parameters.
// A context's graph builders are pure functions of its model and its KV cache view (both fixed
// for the context's life) and of the parameters they are given, so a graph built for the same
// parameters again would be the same graph: the context reuses it with its plan instead of
// rebuilding and re-keying hundreds of tensors per step (host time the GPU waits for: a decode
// step cannot start before the previous token is known). Only the inputs change between steps, and
// the caller writes them every time; it also applies the plan every time, since another graph may
// have grown the arena since. With checking on (a context's check_plans), every call builds and
// plans afresh, so every plan is checked.
#pragma once

#include <cstddef>
#include <list>
#include <memory>
#include <utility>

#include "core/planner.h"

namespace pyspec {

// Params: the builder's parameters (operator==); Built: what the builder returns (a .graph member).
template <typename Params, typename Built>
class BuiltGraphs {
public:
    struct Entry {
        Params params;
        Built built;
        std::shared_ptr<const AllocationPlan> plan;
    };

    explicit BuiltGraphs(size_t capacity = 4) : capacity_(capacity) {}

    // The entry for `params`: a kept one (now the most recently used), or build() planned by
    // `planner` (the least recently used one dropped beyond the capacity). References stay valid
    // until the entry is dropped.
    template <typename Build>
    Entry& get(const Params& params, AllocationPlanner& planner, Build build) {
        if (!planner.checking()) {
            for (auto it = entries_.begin(); it != entries_.end(); ++it) {
                if (!(it->params == params)) continue;
                entries_.splice(entries_.begin(), entries_, it);
                return entries_.front();
            }
        }
        entries_.push_front(Entry{params, build(), nullptr});
        entries_.front().plan = planner.plan(entries_.front().built.graph);
        while (entries_.size() > capacity_) entries_.pop_back();
        return entries_.front();
    }

private:
    size_t capacity_;
    std::list<Entry> entries_;  // most recently used first
};

}  // namespace pyspec
