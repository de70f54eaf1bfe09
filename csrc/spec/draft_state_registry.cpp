#include "spec/draft_state_registry.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <unordered_set>

namespace pyspec {

DraftStateRegistry::DraftStateRegistry(int32_t n_slots) {
    if (n_slots < 1) throw std::invalid_argument("DraftStateRegistry needs n_slots >= 1, got " + std::to_string(n_slots));
    holders_.resize(static_cast<size_t>(n_slots));
}

void DraftStateRegistry::check_step(int64_t step) const {
    if (current_step_ && step < *current_step_)
        throw std::invalid_argument("step " + std::to_string(step) + " goes backwards (current step " +
                                    std::to_string(*current_step_) + ")");
}

int32_t DraftStateRegistry::pick_slot() const {
    for (size_t s = 0; s < holders_.size(); ++s)
        if (!holders_[s]) return static_cast<int32_t>(s);
    int32_t victim = -1;
    int64_t victim_step = 0;
    uint64_t victim_id = 0;
    for (size_t s = 0; s < holders_.size(); ++s) {
        const uint64_t id = *holders_[s];
        const int64_t last = entries_.at(id).last_step;
        if (victim < 0 || last < victim_step || (last == victim_step && id < victim_id)) {
            victim = static_cast<int32_t>(s);
            victim_step = last;
            victim_id = id;
        }
    }
    return victim;
}

SlotGrant DraftStateRegistry::assign(uint64_t request_id, int64_t step) {
    const int32_t slot = pick_slot();
    SlotGrant g;
    g.request_id = request_id;
    g.slot = slot;
    g.fresh = true;
    if (holders_[slot]) {
        g.evicted = *holders_[slot];
        entries_.at(*g.evicted).slot = -1;
    }
    auto it = entries_.find(request_id);
    if (it != entries_.end()) {
        g.restage = true;  // only parked requests reach assign with an entry
        it->second = Entry{slot, step};
    } else {
        entries_.emplace(request_id, Entry{slot, step});
    }
    holders_[slot] = request_id;
    return g;
}

SlotGrant DraftStateRegistry::acquire(uint64_t request_id, int64_t step) {
    return schedule(step, {request_id}).front();
}

std::vector<SlotGrant> DraftStateRegistry::schedule(int64_t step, const std::vector<uint64_t>& request_ids) {
    // Validate everything first so a refused step leaves the registry as it was.
    check_step(step);
    if (request_ids.size() > holders_.size())
        throw std::invalid_argument("step " + std::to_string(step) + " schedules " +
                                    std::to_string(request_ids.size()) + " drafting requests but there are only " +
                                    std::to_string(holders_.size()) + " drafter slots");
    std::unordered_set<uint64_t> ids;
    size_t missing = 0;
    for (uint64_t id : request_ids) {
        if (!ids.insert(id).second)
            throw std::invalid_argument("request " + std::to_string(id) + " appears twice in step " +
                                        std::to_string(step));
        if (slot_of(id) == std::nullopt) ++missing;
    }
    // Slots that a request of this step may take: free ones, and holders neither in this call nor
    // already scheduled at this step by an earlier call.
    size_t available = 0;
    for (const auto& h : holders_)
        if (!h || (!ids.count(*h) && entries_.at(*h).last_step < step)) ++available;
    if (missing > available)
        throw std::invalid_argument("step " + std::to_string(step) + " needs " + std::to_string(missing) +
                                    " more drafter slots but only " + std::to_string(available) + " of " +
                                    std::to_string(holders_.size()) +
                                    " are free or held by requests not scheduled in this step");

    current_step_ = step;
    std::vector<SlotGrant> grants(request_ids.size());
    std::vector<size_t> need;  // indices into request_ids of requests without a slot
    for (size_t i = 0; i < request_ids.size(); ++i) {
        auto it = entries_.find(request_ids[i]);
        if (it != entries_.end() && it->second.slot >= 0) {
            it->second.last_step = step;
            grants[i].request_id = request_ids[i];
            grants[i].slot = it->second.slot;
        } else {
            need.push_back(i);
        }
    }
    std::sort(need.begin(), need.end(), [&](size_t a, size_t b) { return request_ids[a] < request_ids[b]; });
    for (size_t i : need) grants[i] = assign(request_ids[i], step);
    return grants;
}

void DraftStateRegistry::touch(uint64_t request_id, int64_t step) {
    auto it = entries_.find(request_id);
    if (it == entries_.end() || it->second.slot < 0)
        throw std::invalid_argument("request " + std::to_string(request_id) +
                                    " holds no drafter slot; acquire one instead of touching");
    check_step(step);
    current_step_ = step;
    it->second.last_step = step;
}

int32_t DraftStateRegistry::release(uint64_t request_id) {
    auto it = entries_.find(request_id);
    if (it == entries_.end()) return -1;
    const int32_t slot = it->second.slot;
    if (slot >= 0) holders_[slot].reset();
    entries_.erase(it);
    return slot;
}

std::optional<int32_t> DraftStateRegistry::slot_of(uint64_t request_id) const {
    auto it = entries_.find(request_id);
    if (it == entries_.end() || it->second.slot < 0) return std::nullopt;
    return it->second.slot;
}

std::optional<uint64_t> DraftStateRegistry::holder_of(int32_t slot) const {
    if (slot < 0 || slot >= n_slots())
        throw std::out_of_range("slot " + std::to_string(slot) + " out of range [0, " + std::to_string(n_slots()) + ")");
    return holders_[slot];
}

std::optional<int64_t> DraftStateRegistry::last_step(uint64_t request_id) const {
    auto it = entries_.find(request_id);
    if (it == entries_.end()) return std::nullopt;
    return it->second.last_step;
}

std::vector<uint64_t> DraftStateRegistry::parked() const {
    std::vector<uint64_t> out;
    for (const auto& [id, e] : entries_)
        if (e.slot < 0) out.push_back(id);
    std::sort(out.begin(), out.end());
    return out;
}

int32_t DraftStateRegistry::n_held() const {
    int32_t n = 0;
    for (const auto& h : holders_) n += h.has_value();
    return n;
}

}  // namespace pyspec
