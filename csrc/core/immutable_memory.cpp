#include "core/immutable_memory.h"

#include <atomic>
#include <map>
#include <mutex>
#include <tuple>

namespace pyspec {
namespace {

struct Region {
    const char* end;
    // (first byte, bytes, kind) -> the copy; a std::map node never moves, so the returned
    // pointer stays valid while the region is registered.
    std::map<std::tuple<const void*, size_t, uint64_t>, std::vector<uint8_t>> copies;
};

std::mutex& registry_mutex() {
    static std::mutex m;
    return m;
}

std::atomic<uint64_t> g_generation{0};

std::map<const char*, Region>& regions() {
    static std::map<const char*, Region> r;  // by first byte
    return r;
}

}  // namespace

void register_immutable(const void* begin, size_t bytes) {
    std::lock_guard<std::mutex> lock(registry_mutex());
    const char* b = static_cast<const char*>(begin);
    regions()[b] = Region{b + bytes, {}};
}

void unregister_immutable(const void* begin) {
    std::lock_guard<std::mutex> lock(registry_mutex());
    regions().erase(static_cast<const char*>(begin));
    ++g_generation;
}

uint64_t immutable_generation() { return g_generation.load(); }

const uint8_t* immutable_derived_copy(const void* p, size_t bytes, uint64_t kind,
                                      const std::function<std::vector<uint8_t>()>& make) {
    const char* c = static_cast<const char*>(p);
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto& rs = regions();
    auto it = rs.upper_bound(c);
    if (it == rs.begin()) return nullptr;
    --it;
    Region& r = it->second;
    if (c + bytes > r.end) return nullptr;
    const auto key = std::make_tuple(p, bytes, kind);
    auto found = r.copies.find(key);
    if (found == r.copies.end()) found = r.copies.emplace(key, make()).first;
    return found->second.empty() ? nullptr : found->second.data();
}

ImmutableCopyStats immutable_copy_stats() {
    std::lock_guard<std::mutex> lock(registry_mutex());
    ImmutableCopyStats st;
    for (const auto& [begin, r] : regions()) {
        (void)begin;
        ++st.regions;
        st.copies += r.copies.size();
        for (const auto& [key, copy] : r.copies) {
            (void)key;
            st.bytes += copy.size();
        }
    }
    return st;
}

}  // namespace pyspec
