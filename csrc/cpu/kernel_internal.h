// Private to the CPU weight kernels (quant_rows.cpp, dot_reference.cpp, dot_float.cpp,
// dot_quant.cpp), which implement quants.h: row conversions, activation quantization and the dot
// products of every weight type, each as plain scalar code (the definition, see quants.h) and as
// AVX-512 or AVX2 code that gives the same bits. This header holds what they share: the
// instruction-set macros and the pieces one file defines for another.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu/quants.h"

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
// GCC 12 warns about the self-initialised "undefined" vectors inside its own intrinsic headers
// when they are inlined (GCC bug 105593); the warning is about the header, not this file.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PYSPEC_AVX512 1
#if defined(__AVX512VNNI__)
#define PYSPEC_AVX512VNNI 1
#endif
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PYSPEC_AVX2 1
// 256-bit VNNI (vpdpbusd on ymm registers) for the AVX2 quantized kernels: AVX-VNNI (Intel's
// client cores since Alder Lake, VEX-encoded) or AVX-512 VNNI with VL (EVEX-encoded) where the
// 512-bit kernels are not built (no AVX512BW).
#if !defined(PYSPEC_AVX512VNNI) && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
#define PYSPEC_AVX2VNNI 1
#endif
#endif

namespace pyspec {

// Throws unless n is a whole number of t's blocks (quant_rows.cpp).
void check_blocks(DType t, int64_t n);

constexpr int kLanes = 32;  // partial sums of a float dot product

// The scalar definition of a float dot product (dot_reference.cpp), for F32, F16 and BF16.
template <DType T>
float float_dot_reference(const void* w, const float* x, int64_t n);

// Y[m][i] = dot(W row i, x row m) for float weights (dot_float.cpp), for F32, F16 and BF16;
// dot_rows' float half.
template <DType T>
void float_dot_rows(const uint8_t* w, size_t w_stride, int64_t n_w, const float* x, size_t x_stride, int64_t n_a,
                    int64_t n, float* y, int64_t y_stride);

}  // namespace pyspec
