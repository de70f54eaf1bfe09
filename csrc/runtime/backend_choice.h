// Which compute backend a decode context runs on (issue 8): the CPU backend, or the CUDA backend
// on one device. Contexts (Context, DraftContext, SpecEngine's two) take a BackendChoice in their
// params and create their backend with make_backend(); everything the host reads or writes of
// the backend's memory (inputs, outputs, KV cells) goes through Backend::read/write, so the same
// code runs on either.
//
// Weights stay in the host-mmapped GGUF; the CUDA backend uploads each weight once, on first use
// (cuda/cuda_backend.cu). Two contexts over one model on the GPU (a target Context and a
// DraftContext sharing the target's embeddings, or two Contexts) each hold their own copy.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/backend.h"

namespace pyspec {

enum class BackendKind : uint8_t { Cpu, Cuda };

struct BackendChoice {
    BackendKind kind = BackendKind::Cpu;
    int device = 0;  // CUDA device ordinal (ignored on the CPU)
    bool operator==(const BackendChoice& o) const { return kind == o.kind && (kind == BackendKind::Cpu || device == o.device); }
    bool operator!=(const BackendChoice& o) const { return !(*this == o); }
};

// "cpu", "cuda" (device 0) or "cuda:N". Throws std::invalid_argument on anything else.
BackendChoice parse_backend(const std::string& name);
// The inverse: "cpu", "cuda:N".
std::string backend_string(const BackendChoice& choice);

// A new backend for a context of n_seq_max sequences. CPU: a CpuBackend with n_threads workers,
// poisoning its arena when `poison` (tests). CUDA: make_cuda_backend(device, n_seq_max), which
// throws std::runtime_error with the reason when CUDA was not built in or no usable device is
// visible.
std::unique_ptr<Backend> make_backend(const BackendChoice& choice, int n_threads, bool poison, int n_seq_max);

}  // namespace pyspec
