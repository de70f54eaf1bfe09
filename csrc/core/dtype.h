// Element types and their storage layout. Quantized types are stored in blocks of 32 values,
// with the same byte layout as ggml's so that GGUF tensors are used in place (mmap, no copy).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace pyspec {

// I32 and I64 are index types (row ids, positions, d2t maps), never compute types: matmul,
// get_rows tables and dequantize_row refuse them.
enum class DType : uint8_t { F32, F16, BF16, Q8_0, Q4_0, Q4_1, I32, I64, COUNT };

constexpr int QK = 32;  // values per quantized block

// Q8_0: x = d * q
struct BlockQ8_0 {
    uint16_t d;  // fp16 scale
    int8_t qs[QK];
};
// Q4_0: x = d * (q - 8); byte j holds element j (low nibble) and element j + 16 (high nibble)
struct BlockQ4_0 {
    uint16_t d;
    uint8_t qs[QK / 2];
};
// Q4_1: x = d * q + m, same nibble order as Q4_0
struct BlockQ4_1 {
    uint16_t d;
    uint16_t m;
    uint8_t qs[QK / 2];
};
static_assert(sizeof(BlockQ8_0) == 34, "Q8_0 block must match ggml");
static_assert(sizeof(BlockQ4_0) == 18, "Q4_0 block must match ggml");
static_assert(sizeof(BlockQ4_1) == 20, "Q4_1 block must match ggml");

// Elements per storage unit and bytes per unit.
inline int dtype_block_size(DType t) {
    switch (t) {
        case DType::Q8_0:
        case DType::Q4_0:
        case DType::Q4_1: return QK;
        case DType::F32:
        case DType::F16:
        case DType::BF16:
        case DType::I32:
        case DType::I64:
        case DType::COUNT: return 1;
    }
    return 1;
}
// constexpr: the CUDA kernels call it too (nvcc --expt-relaxed-constexpr).
constexpr size_t dtype_unit_bytes(DType t) {
    switch (t) {
        case DType::F32: return 4;
        case DType::F16: return 2;
        case DType::BF16: return 2;
        case DType::Q8_0: return sizeof(BlockQ8_0);
        case DType::Q4_0: return sizeof(BlockQ4_0);
        case DType::Q4_1: return sizeof(BlockQ4_1);
        case DType::I32: return 4;
        case DType::I64: return 8;
        case DType::COUNT: break;
    }
    return 0;
}
inline bool dtype_is_integer(DType t) {
    switch (t) {
        case DType::I32:
        case DType::I64: return true;
        case DType::F32:
        case DType::F16:
        case DType::BF16:
        case DType::Q8_0:
        case DType::Q4_0:
        case DType::Q4_1:
        case DType::COUNT: return false;
    }
    return false;
}
inline bool dtype_is_quantized(DType t) { return dtype_block_size(t) > 1; }

// Bytes of a row of n elements (n must be a multiple of the block size for quantized types).
inline size_t dtype_row_bytes(DType t, int64_t n) {
    return static_cast<size_t>(n / dtype_block_size(t)) * dtype_unit_bytes(t);
}

inline const char* dtype_name(DType t) {
    switch (t) {
        case DType::F32: return "F32";
        case DType::F16: return "F16";
        case DType::BF16: return "BF16";
        case DType::Q8_0: return "Q8_0";
        case DType::Q4_0: return "Q4_0";
        case DType::Q4_1: return "Q4_1";
        case DType::I32: return "I32";
        case DType::I64: return "I64";
        case DType::COUNT: break;
    }
    return "?";
}

// Scalar half/bfloat16 conversions (kernels use vector versions where the CPU has them).
inline float fp16_to_fp32(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    const uint32_t exp = (h >> 10) & 0x1f;
    const uint32_t man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            int e = -1;
            uint32_t m = man;
            do { m <<= 1; ++e; } while ((m & 0x400) == 0);
            bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (m & 0x3ff) << 13;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | man << 13;
    } else {
        bits = sign | (exp + 127 - 15) << 23 | man << 13;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t fp32_to_fp16(float f) {  // round to nearest even
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    const uint32_t absx = x & 0x7fffffff;
    if (absx >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00 | (absx > 0x7f800000u ? 0x200 : 0));
    if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00);  // overflow to inf
    if (absx < 0x38800000u) {  // subnormal or zero in half
        if (absx < 0x33000000u) return static_cast<uint16_t>(sign);
        const uint32_t e = absx >> 23;
        const uint32_t m = (absx & 0x7fffff) | 0x800000;
        const uint32_t shift = 126 - e;  // 14..24
        uint32_t r = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1);
        const uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) ++r;
        return static_cast<uint16_t>(sign | r);
    }
    uint32_t r = ((absx - 0x38000000u) >> 13);
    const uint32_t rem = absx & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) ++r;
    return static_cast<uint16_t>(sign | r);
}

inline float bf16_to_fp32(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t fp32_to_bf16(float f) {  // round to nearest even, NaN kept quiet
    uint32_t x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 64);
    return static_cast<uint16_t>((x + (0x7fff + ((x >> 16) & 1))) >> 16);
}

}  // namespace pyspec
