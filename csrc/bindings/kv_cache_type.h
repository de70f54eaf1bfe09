// The KV cache type flag every context binding accepts ("f16" as llama.cpp's default, "f32").
#pragma once

#include <stdexcept>
#include <string>

#include "core/dtype.h"

namespace pyspec {

inline DType parse_kv_cache_type(const std::string& name) {
    if (name == "f16") return DType::F16;
    if (name == "f32") return DType::F32;
    throw std::invalid_argument("unsupported KV cache type '" + name + "' (supported: f16, f32)");
}

}  // namespace pyspec
