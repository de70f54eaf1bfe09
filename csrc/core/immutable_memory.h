// Memory that stays unchanged while it is registered (the read-only mappings of GGUF files), and
// copies derived from it that a backend keeps for as long (the CPU backend's packed weights:
// cpu/quants.h, pack_weights). A copy is keyed by the bytes it was made from and a kind that says
// how; it is made once, on first request, shared by every context over the same file, and freed
// when the region is unregistered. Memory outside every region (numpy arrays, KV caches) gets no
// copy: it may change between computes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace pyspec {

void register_immutable(const void* begin, size_t bytes);
// Forgets the region that starts at begin and frees the copies made from it.
void unregister_immutable(const void* begin);

// The copy of [p, p + bytes) of this kind, made by make() on the first request; nullptr when
// those bytes do not lie inside one registered region, or when make() declined (returned nothing:
// remembered, so it is not asked again for those bytes).
const uint8_t* immutable_derived_copy(const void* p, size_t bytes, uint64_t kind,
                                      const std::function<std::vector<uint8_t>()>& make);

// Counts the regions unregistered so far: a caller that keeps pointers to copies (the CPU
// backend's lookup cache) drops them when it changes.
uint64_t immutable_generation();

// What the registry holds now: regions, copies and the copies' bytes (tests, diagnostics).
struct ImmutableCopyStats {
    size_t regions = 0, copies = 0, bytes = 0;
};
ImmutableCopyStats immutable_copy_stats();

}  // namespace pyspec
