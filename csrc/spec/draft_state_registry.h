// Request id -> drafter slot (design.md invariants 3 and 4). A slot is a DraftContext sequence id
// in [0, n_slots). The registry knows requests only by id and never sees batch rows, so moving or
// reordering rows cannot change which slot a request drafts in.
//
// Rules:
// - A request that holds a slot keeps it until it is released; steps that do not schedule it
//   (prefill-only steps, a paused request) do not free it.
// - A request without a slot (new, or parked by an eviction) takes the lowest free slot. When no
//   slot is free, the holder scheduled least recently (smallest last step, ties: smallest request
//   id) is reclaimed, provided it was not scheduled in the current step; the reclaimed request is
//   parked and told to restage when it is next scheduled.
// - Steps never go backwards: every call that takes a step rejects one smaller than the largest
//   seen, so "scheduled in this step" means "last step == the current step".
// - Scheduling more requests in one step than there are slots is the scheduler's error and is
//   raised (std::invalid_argument) before anything changes.
#pragma once

#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

namespace pyspec {

// What acquire/schedule did for one request.
struct SlotGrant {
    uint64_t request_id = 0;
    int32_t slot = -1;
    // The slot was newly assigned to this request: whatever the slot held belongs to someone else
    // (or no one), so the caller clears the drafter sequence before staging into it.
    bool fresh = false;
    // The request had been parked by an eviction: its committed context is gone from the drafter
    // and must be restaged (e.g. from the target's layer inputs) before it drafts. Implies fresh.
    bool restage = false;
    // The slot was reclaimed from another request, which is now parked; the caller parks that
    // request's drafter state (its context rows are lost when the slot is cleared).
    std::optional<uint64_t> evicted;
};

class DraftStateRegistry {
public:
    // Throws std::invalid_argument when n_slots < 1.
    explicit DraftStateRegistry(int32_t n_slots);

    // Marks the request scheduled at `step` and returns its slot, assigning one if it holds none
    // (see the rules above). Throws std::invalid_argument when every slot is held by a request
    // scheduled at `step`, or when step goes backwards; nothing changes then. When several
    // requests share a step, use schedule(): a lone acquire protects only the requests already
    // marked at this step.
    SlotGrant acquire(uint64_t request_id, int64_t step);

    // One step's drafting requests, in any order (rows are irrelevant): first marks every request
    // that holds a slot, so none of them can be reclaimed in this step, then assigns slots to the
    // others in ascending request id order. The result depends only on the set of ids and the
    // step; grants come back in the order of `request_ids`. Throws std::invalid_argument (and
    // changes nothing) on duplicate ids, more ids than slots, or a step that goes backwards.
    std::vector<SlotGrant> schedule(int64_t step, const std::vector<uint64_t>& request_ids);

    // Marks a request that holds a slot as scheduled at `step`. Throws std::invalid_argument when
    // it holds none (use acquire) or when step goes backwards.
    void touch(uint64_t request_id, int64_t step);

    // Drops the request's entry (finished or cancelled) and returns the slot it freed, or -1 when
    // it held none. Unknown ids are a no-op returning -1: the engine releases every request that
    // leaves, including ones that never drafted or were released already.
    int32_t release(uint64_t request_id);

    std::optional<int32_t> slot_of(uint64_t request_id) const;
    std::optional<uint64_t> holder_of(int32_t slot) const;  // throws std::out_of_range on a bad slot
    std::optional<int64_t> last_step(uint64_t request_id) const;  // of a holder or a parked request
    std::vector<uint64_t> parked() const;  // ascending request ids
    size_t size() const { return entries_.size(); }  // requests known: holders and parked
    int32_t n_held() const;
    int32_t n_slots() const { return static_cast<int32_t>(holders_.size()); }

private:
    struct Entry {
        int32_t slot = -1;  // -1: parked
        int64_t last_step = 0;
    };

    void check_step(int64_t step) const;  // throws when step < the current step
    // Assigns a slot to a request that holds none. schedule() has checked that a free slot or a
    // holder not scheduled at `step` exists, and every holder of this step has last_step == step,
    // the largest value, so the least recently scheduled holder is never one of this step's.
    SlotGrant assign(uint64_t request_id, int64_t step);
    // The lowest free slot, else the slot of the least recently scheduled holder (ties: smallest
    // request id).
    int32_t pick_slot() const;

    std::vector<std::optional<uint64_t>> holders_;  // slot -> request id
    std::unordered_map<uint64_t, Entry> entries_;
    std::optional<int64_t> current_step_;
};

}  // namespace pyspec
