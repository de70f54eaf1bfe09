// Vectorised dot products of quantized weights (Q8_0, Q4_0, Q4_1), and dot_rows, which hands
// every weight type to its kernel.
//
// Quantized dot products work on panels of weight rows (16 with AVX-512 VNNI, 8 with AVX2) so
// that the float work of a block (scale, convert, fma) runs once per panel instead of once per
// row: per block, the integer partial sums of the panel's rows are reduced into one vector with
// a lane per row, then y = fma(d_w * d_a, isum, y) runs lane-wise, which is exactly the scalar
// definition for every row.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/kernel_internal.h"

namespace pyspec {
namespace {

// ---------------------------------------------------------------------------------------------
// Vectorised quantized dot products over panels of weight rows.
//
// Per block, a panel's weight quants are loaded as unsigned bytes in vectors lo[i] / hi[i]
// (i < 4) whose 128-bit lane k holds elements 0-15 / 16-31 of row 4k + i. Multiplying by the
// activation's 16-byte halves broadcast to every lane gives, per lane k of D[i], four int32 partial
// sums of row 4k + i; a 4x4 transpose-add inside each 128-bit lane turns D[0..3] into one vector
// whose lane 4k + i is row 4k + i's block sum. Signed Q8_0 weights are biased by 128 (VNNI)
// and Q4_0 quants are used as 0..15; both subtract bias * sum(a) afterwards, exactly.

template <DType T>
struct QuantTraits;
template <>
struct QuantTraits<DType::Q8_0> {
    using Act = BlockQ8_0Sum;
    static constexpr size_t kBlockBytes = sizeof(BlockQ8_0);
    static constexpr size_t kQsOffset = 2;
    static constexpr int kBiasShift = 7;  // bias 128 (VNNI paths only)
};
template <>
struct QuantTraits<DType::Q4_0> {
    using Act = BlockQ8_0Sum;
    static constexpr size_t kBlockBytes = sizeof(BlockQ4_0);
    static constexpr size_t kQsOffset = 2;
    static constexpr int kBiasShift = 3;  // bias 8
};
template <>
struct QuantTraits<DType::Q4_1> {
    using Act = BlockQ8_1;
    static constexpr size_t kBlockBytes = sizeof(BlockQ4_1);
    static constexpr size_t kQsOffset = 4;
    static constexpr int kBiasShift = -1;  // no bias; the min is the m * s term
};

#if PYSPEC_AVX512VNNI || PYSPEC_AVX2
// A panel's rows are read a block at a time, 16 or 8 short strided streams that the hardware
// prefetcher does not follow; so while a panel is computed, the next one (contiguous bytes) is
// prefetched into L2, a slice per block. (Into L1 measured 30% slower on Zen 4: the strided
// panel reads then evict each other.)
struct Prefetch {
    const uint8_t* begin = nullptr;
    size_t bytes = 0;
    int64_t steps = 1;
    void step(int64_t b) const {
        if (!begin) return;
        const size_t lines = (bytes + 63) / 64;
        const size_t from = lines * static_cast<size_t>(b) / static_cast<size_t>(steps);
        const size_t to = lines * static_cast<size_t>(b + 1) / static_cast<size_t>(steps);
        for (size_t l = from; l < to; ++l) _mm_prefetch(reinterpret_cast<const char*>(begin + l * 64), _MM_HINT_T1);
    }
};
#endif

#if PYSPEC_AVX512VNNI
constexpr int kPanelRows = 16;
#elif PYSPEC_AVX2
constexpr int kPanelRows = 8;
#endif

#if PYSPEC_AVX512VNNI || PYSPEC_AVX2
// Packed panels (pack_weights). A kernel panel's block is [d of its rows, fp16][m of its rows,
// fp16: Q4_1 only][quants]: for Q4_0/Q4_1 four vectors, vector i holding in its 128-bit lane k the
// 16 quant bytes of row 4k + i (load_panel's lo[i] / hi[i] source); for Q8_0 eight, lo[0..3] then
// hi[0..3], biased by 128 where the kernel multiplies unsigned by signed bytes (VNNI; AVX2's
// maddubs takes the signs apart instead). So a block is read in 5 to 9 contiguous loads instead of
// 16 or 32 strided 16-byte ones, and its headers need no transpose. The panel vectors hold the
// same values as load_panel's, so every sum and scale is the strided kernel's. A packed panel
// (kPackedPanelRows, what matmul hands a thread) is kPackedPanelRows / kPanelRows kernel panels,
// each one contiguous run of its blocks.
static_assert(kPackedPanelRows % kPanelRows == 0, "a packed panel is whole kernel panels");
constexpr size_t kPackedVecBytes = 4 * kPanelRows;  // 16 quant bytes of each of a quarter of the rows
constexpr int64_t kPackedCachedTiles = 4;           // packed_dot_rows caches unpacked panels past this many tiles
#if PYSPEC_AVX512VNNI || PYSPEC_AVX2VNNI
constexpr uint8_t kPackedQ8Bias = 0x80;
#else
constexpr uint8_t kPackedQ8Bias = 0;
#endif

template <DType T>
constexpr size_t packed_block_bytes() {
    return QuantTraits<T>::kBlockBytes * kPanelRows;
}

template <DType T>
constexpr size_t packed_quants_offset() {  // past the panel's d (and m) headers
    return (T == DType::Q4_1 ? 4 : 2) * kPanelRows;
}
#endif

#if PYSPEC_AVX512VNNI
// Four 16-byte rows into one vector. Built from two 256-bit halves: on Zen 4 inserting 128-bit
// lanes into a 512-bit register directly costs about twice as much.
inline __m512i load_4x128(const uint8_t* p0, const uint8_t* p1, const uint8_t* p2, const uint8_t* p3) {
    const __m256i a = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p1), reinterpret_cast<const __m128i*>(p0));
    const __m256i b = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p3), reinterpret_cast<const __m128i*>(p2));
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

// One block of a 16-row panel, ready for the dot: quants as described above, scales per row.
struct Panel {
    __m512i lo[4], hi[4];
    __m512 d, m;
};

template <DType T>
inline void load_panel(const uint8_t* blk, const size_t* off, Panel& p) {
    constexpr size_t q = QuantTraits<T>::kQsOffset;
    for (int i = 0; i < 4; ++i) {
        if constexpr (T == DType::Q8_0) {
            const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
            p.lo[i] = _mm512_xor_si512(bias, load_4x128(blk + off[i] + q, blk + off[4 + i] + q, blk + off[8 + i] + q,
                                                        blk + off[12 + i] + q));
            p.hi[i] = _mm512_xor_si512(bias, load_4x128(blk + off[i] + q + 16, blk + off[4 + i] + q + 16,
                                                        blk + off[8 + i] + q + 16, blk + off[12 + i] + q + 16));
        } else {
            const __m512i nib = _mm512_set1_epi8(0x0f);
            const __m512i v = load_4x128(blk + off[i] + q, blk + off[4 + i] + q, blk + off[8 + i] + q, blk + off[12 + i] + q);
            p.lo[i] = _mm512_and_si512(v, nib);
            p.hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        }
    }
    // The block headers (d, then m for Q4_1), lane = row: dword 0 of each 128-bit lane of h[i]
    // transposed like the sums below (cheaper than a gather on Zen 4).
    __m512i h[4];
    for (int i = 0; i < 4; ++i) h[i] = load_4x128(blk + off[i], blk + off[4 + i], blk + off[8 + i], blk + off[12 + i]);
    const __m512i hdr = _mm512_unpacklo_epi64(_mm512_unpacklo_epi32(h[0], h[1]), _mm512_unpacklo_epi32(h[2], h[3]));
    p.d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hdr));
    if constexpr (T == DType::Q4_1) p.m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(hdr, 16)));
}

// The block sums of the panel's 16 rows against one activation block.
template <DType T>
inline __m512i panel_block_sums(const Panel& p, const typename QuantTraits<T>::Act& a) {
    const __m512i alo = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.qs)));
    const __m512i ahi = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.qs + 16)));
    __m512i s[4];
    for (int i = 0; i < 4; ++i) {
        s[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), p.lo[i], alo), p.hi[i], ahi);
    }
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(s[0], s[1]), _mm512_unpackhi_epi32(s[0], s[1]));
    const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2], s[3]), _mm512_unpackhi_epi32(s[2], s[3]));
    __m512i sums = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
    if constexpr (QuantTraits<T>::kBiasShift >= 0) {
        sums = _mm512_sub_epi32(sums, _mm512_set1_epi32(a.sum * (1 << QuantTraits<T>::kBiasShift)));
    }
    return sums;
}

constexpr int kQuantRM = 4;  // activation rows per tile

// Y rows [0, RM) x panel rows [0, rows), the panel's block b given by panel_at(b, scratch) (unpacked
// on the fly into scratch, taken from a cache, or read packed): the one accumulation every path
// shares, so each gives the same bits.
template <DType T, int RM, class PanelAt>
void tile_rows(PanelAt&& panel_at, int64_t nb, const uint8_t* act, size_t act_stride, float* y, int64_t y_stride,
               int rows) {
    using Act = typename QuantTraits<T>::Act;
    __m512 acc[RM];
    for (int r = 0; r < RM; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        Panel scratch;
        const Panel& p = panel_at(b, scratch);
        for (int r = 0; r < RM; ++r) {
            const Act& a = reinterpret_cast<const Act*>(act + r * act_stride)[b];
            const __m512 sums = _mm512_cvtepi32_ps(panel_block_sums<T>(p, a));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(p.d, _mm512_set1_ps(a.d)), sums, acc[r]);
            if constexpr (T == DType::Q4_1) acc[r] = _mm512_fmadd_ps(p.m, _mm512_set1_ps(a.s), acc[r]);
        }
    }
    const __mmask16 store = static_cast<__mmask16>((1u << rows) - 1);
    for (int r = 0; r < RM; ++r) _mm512_mask_storeu_ps(y + r * y_stride, store, acc[r]);
}

template <DType T>
inline void load_packed_panel(const uint8_t* pb, Panel& p) {
    p.d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb)));
    constexpr size_t q = packed_quants_offset<T>();
    if constexpr (T == DType::Q4_1) p.m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 32)));
    for (int i = 0; i < 4; ++i) {
        if constexpr (T == DType::Q8_0) {
            p.lo[i] = _mm512_loadu_si512(pb + q + 64 * i);
            p.hi[i] = _mm512_loadu_si512(pb + q + 4 * kPackedVecBytes + 64 * i);
        } else {
            const __m512i nib = _mm512_set1_epi8(0x0f);
            const __m512i v = _mm512_loadu_si512(pb + q + 64 * i);
            p.lo[i] = _mm512_and_si512(v, nib);
            p.hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        }
    }
}
#elif PYSPEC_AVX2

inline __m256i load_2x128(const uint8_t* p0, const uint8_t* p1) {
    return _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p1), reinterpret_cast<const __m128i*>(p0));
}

// One block of an 8-row panel. Without VNNI, Q8_0 quants stay signed (lo/hi) next to their
// magnitudes (abs_lo/abs_hi) for maddubs' unsigned x signed product, which must not overflow
// int16; with 256-bit VNNI they are biased by 128 as in the AVX-512 kernel (dpbusd sums four
// products into int32 at once, so there is no int16 step to overflow).
struct Panel {
    __m256i lo[4], hi[4];
#if !PYSPEC_AVX2VNNI
    __m256i abs_lo[4], abs_hi[4];
#endif
    __m256 d, m;
};

#if PYSPEC_AVX2VNNI
// acc + the sums of four u8 x s8 products per int32 lane: the same exact integers as maddubs +
// madd (which never saturate on these operands), in one instruction instead of three.
inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#endif

inline __m256 fp16_lanes_to_float(__m256i hdr, int byte) {  // the fp16 at byte 0 or 2 of each dword
    const __m256i pick = byte == 0 ? _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9,
                                                      12, 13, -1, -1, -1, -1, -1, -1, -1, -1)
                                   : _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7,
                                                      10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(hdr, pick), 0x08);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
}

template <DType T>
inline void load_panel(const uint8_t* blk, const size_t* off, Panel& p) {
    constexpr size_t q = QuantTraits<T>::kQsOffset;
    for (int i = 0; i < 4; ++i) {
        if constexpr (T == DType::Q8_0) {
            p.lo[i] = load_2x128(blk + off[i] + q, blk + off[4 + i] + q);
            p.hi[i] = load_2x128(blk + off[i] + q + 16, blk + off[4 + i] + q + 16);
#if PYSPEC_AVX2VNNI
            const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
            p.lo[i] = _mm256_xor_si256(bias, p.lo[i]);
            p.hi[i] = _mm256_xor_si256(bias, p.hi[i]);
#else
            p.abs_lo[i] = _mm256_abs_epi8(p.lo[i]);
            p.abs_hi[i] = _mm256_abs_epi8(p.hi[i]);
#endif
        } else {
            const __m256i nib = _mm256_set1_epi8(0x0f);
            const __m256i v = load_2x128(blk + off[i] + q, blk + off[4 + i] + q);
            p.lo[i] = _mm256_and_si256(v, nib);
            p.hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        }
    }
    __m256i h[4];  // block headers, transposed as in the AVX-512 kernel
    for (int i = 0; i < 4; ++i) h[i] = load_2x128(blk + off[i], blk + off[4 + i]);
    const __m256i hdr = _mm256_unpacklo_epi64(_mm256_unpacklo_epi32(h[0], h[1]), _mm256_unpacklo_epi32(h[2], h[3]));
    p.d = fp16_lanes_to_float(hdr, 0);
    if constexpr (T == DType::Q4_1) p.m = fp16_lanes_to_float(hdr, 2);
}

template <DType T>
inline __m256i panel_block_sums(const Panel& p, const typename QuantTraits<T>::Act& a) {
    const __m256i alo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.qs)));
    const __m256i ahi = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.qs + 16)));
    __m256i s[4];
#if PYSPEC_AVX2VNNI
    for (int i = 0; i < 4; ++i) s[i] = dpbusd256(dpbusd256(_mm256_setzero_si256(), p.lo[i], alo), p.hi[i], ahi);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    for (int i = 0; i < 4; ++i) {
        if constexpr (T == DType::Q8_0) {
            const __m256i l = _mm256_madd_epi16(_mm256_maddubs_epi16(p.abs_lo[i], _mm256_sign_epi8(alo, p.lo[i])), ones);
            const __m256i h = _mm256_madd_epi16(_mm256_maddubs_epi16(p.abs_hi[i], _mm256_sign_epi8(ahi, p.hi[i])), ones);
            s[i] = _mm256_add_epi32(l, h);
        } else {  // 4-bit quants: two int16 products of 2 * 15 * 127 still fit int16
            s[i] = _mm256_madd_epi16(
                _mm256_add_epi16(_mm256_maddubs_epi16(p.lo[i], alo), _mm256_maddubs_epi16(p.hi[i], ahi)), ones);
        }
    }
#endif
    const __m256i t0 = _mm256_add_epi32(_mm256_unpacklo_epi32(s[0], s[1]), _mm256_unpackhi_epi32(s[0], s[1]));
    const __m256i t1 = _mm256_add_epi32(_mm256_unpacklo_epi32(s[2], s[3]), _mm256_unpackhi_epi32(s[2], s[3]));
    __m256i sums = _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));
#if PYSPEC_AVX2VNNI
    constexpr bool kBiased = QuantTraits<T>::kBiasShift >= 0;  // Q8_0 (128) and Q4_0 (8)
#else
    constexpr bool kBiased = T == DType::Q4_0;  // maddubs takes Q8_0's signs apart
#endif
    if constexpr (kBiased) sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(a.sum * (1 << QuantTraits<T>::kBiasShift)));
    return sums;
}

constexpr int kQuantRM = 2;  // activation rows per tile (16 ymm registers)

// Y rows [0, RM) x panel rows [0, rows), the panel's block b given by panel_at(b, scratch): the one
// accumulation every path shares, as in the AVX-512 kernel.
template <DType T, int RM, class PanelAt>
void tile_rows(PanelAt&& panel_at, int64_t nb, const uint8_t* act, size_t act_stride, float* y, int64_t y_stride,
               int rows) {
    using Act = typename QuantTraits<T>::Act;
    __m256 acc[RM];
    for (int r = 0; r < RM; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        Panel scratch;
        const Panel& p = panel_at(b, scratch);
        for (int r = 0; r < RM; ++r) {
            const Act& a = reinterpret_cast<const Act*>(act + r * act_stride)[b];
            const __m256 sums = _mm256_cvtepi32_ps(panel_block_sums<T>(p, a));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(p.d, _mm256_set1_ps(a.d)), sums, acc[r]);
            if constexpr (T == DType::Q4_1) acc[r] = _mm256_fmadd_ps(p.m, _mm256_set1_ps(a.s), acc[r]);
        }
    }
    for (int r = 0; r < RM; ++r) {
        if (rows == kPanelRows) {
            _mm256_storeu_ps(y + r * y_stride, acc[r]);
        } else {
            alignas(32) float tmp[kPanelRows];
            _mm256_store_ps(tmp, acc[r]);
            std::memcpy(y + r * y_stride, tmp, static_cast<size_t>(rows) * sizeof(float));
        }
    }
}

template <DType T>
inline void load_packed_panel(const uint8_t* pb, Panel& p) {
    constexpr size_t q = packed_quants_offset<T>();
    p.d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pb)));
    if constexpr (T == DType::Q4_1) p.m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pb + 16)));
    for (int i = 0; i < 4; ++i) {
        if constexpr (T == DType::Q8_0) {
            p.lo[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + q + kPackedVecBytes * i));
            p.hi[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + q + 4 * kPackedVecBytes + kPackedVecBytes * i));
#if !PYSPEC_AVX2VNNI
            p.abs_lo[i] = _mm256_abs_epi8(p.lo[i]);
            p.abs_hi[i] = _mm256_abs_epi8(p.hi[i]);
#endif
        } else {
            const __m256i nib = _mm256_set1_epi8(0x0f);
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + q + kPackedVecBytes * i));
            p.lo[i] = _mm256_and_si256(v, nib);
            p.hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        }
    }
}
#endif

#if PYSPEC_AVX512VNNI || PYSPEC_AVX2
// Y rows [0, RM) x panel rows [0, rows): blocks unpacked on the fly, or taken from `cached`
// (the panel unpacked once for a long batch).
template <DType T, int RM, bool kCached>
void quant_tile(const uint8_t* w, const size_t* off, int64_t nb, const Panel* cached, const uint8_t* act,
                size_t act_stride, float* y, int64_t y_stride, int rows, const Prefetch& pf) {
    const auto panel_at = [&](int64_t b, Panel& fresh) -> const Panel& {
        if constexpr (kCached) {
            return cached[b];
        } else {
            pf.step(b);
            load_panel<T>(w + b * QuantTraits<T>::kBlockBytes, off, fresh);
            return fresh;
        }
    };
    tile_rows<T, RM>(panel_at, nb, act, act_stride, y, y_stride, rows);
}

// quant_tile over a packed panel (pp: its first block).
template <DType T, int RM>
void packed_tile(const uint8_t* pp, int64_t nb, const uint8_t* act, size_t act_stride, float* y, int64_t y_stride,
                 int rows, const Prefetch& pf) {
    const auto panel_at = [&](int64_t b, Panel& fresh) -> const Panel& {
        pf.step(b);
        load_packed_panel<T>(pp + b * packed_block_bytes<T>(), fresh);
        return fresh;
    };
    tile_rows<T, RM>(panel_at, nb, act, act_stride, y, y_stride, rows);
}

template <DType T, int RM>
void packed_tile_rest(int64_t rows_a, const uint8_t* pp, int64_t nb, const uint8_t* act, size_t act_stride, float* y,
                      int64_t y_stride, int rows, const Prefetch& pf) {
    if constexpr (RM > 0) {
        if (rows_a == RM) {
            packed_tile<T, RM>(pp, nb, act, act_stride, y, y_stride, rows, pf);
        } else {
            packed_tile_rest<T, RM - 1>(rows_a, pp, nb, act, act_stride, y, y_stride, rows, pf);
        }
    }
}

// One packed byte run per kernel panel block, from the matrix's rows, for whole packed panels (rows
// past n_w repeat the last row).
template <DType T>
void pack_typed(const uint8_t* w, size_t row_bytes, int64_t n_w, int64_t nb, uint8_t* out) {
    constexpr size_t kb = QuantTraits<T>::kBlockBytes;
    constexpr size_t qo = QuantTraits<T>::kQsOffset;
    constexpr size_t q = packed_quants_offset<T>();
    const int64_t panels = (n_w + kPackedPanelRows - 1) / kPackedPanelRows * (kPackedPanelRows / kPanelRows);
    for (int64_t pn = 0; pn < panels; ++pn) {
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t* o = out + (pn * nb + b) * packed_block_bytes<T>();
            for (int r = 0; r < kPanelRows; ++r) {
                const int64_t row = std::min<int64_t>(pn * kPanelRows + r, n_w - 1);
                const uint8_t* blk = w + static_cast<size_t>(row) * row_bytes + static_cast<size_t>(b) * kb;
                std::memcpy(o + 2 * r, blk, 2);                                                    // d
                if constexpr (T == DType::Q4_1) std::memcpy(o + 2 * kPanelRows + 2 * r, blk + 2, 2);  // m
                uint8_t* qs = o + q + kPackedVecBytes * (r % 4) + 16 * (r / 4);
                if constexpr (T == DType::Q8_0) {
                    for (int j = 0; j < 16; ++j) {
                        qs[j] = static_cast<uint8_t>(blk[qo + j] ^ kPackedQ8Bias);
                        qs[4 * kPackedVecBytes + j] = static_cast<uint8_t>(blk[qo + 16 + j] ^ kPackedQ8Bias);
                    }
                } else {
                    std::memcpy(qs, blk + qo, 16);
                }
            }
        }
    }
}

// The last rows < kQuantRM of a batch: a tile of exactly that many.
template <DType T, int RM, bool kCached>
void quant_tile_rest(int64_t rows_a, const uint8_t* w, const size_t* off, int64_t nb, const Panel* cached,
                     const uint8_t* act, size_t act_stride, float* y, int64_t y_stride, int rows, const Prefetch& pf) {
    if constexpr (RM > 0) {
        if (rows_a == RM) {
            quant_tile<T, RM, kCached>(w, off, nb, cached, act, act_stride, y, y_stride, rows, pf);
        } else {
            quant_tile_rest<T, RM - 1, kCached>(rows_a, w, off, nb, cached, act, act_stride, y, y_stride, rows, pf);
        }
    }
}

template <DType T, bool kCached>
void quant_tiles_m(const uint8_t* w, const size_t* off, int64_t nb, const Panel* cached, const uint8_t* act,
                   size_t act_stride, int64_t n_a, float* y, int64_t y_stride, int rows, const Prefetch& pf) {
    const Prefetch none{};
    int64_t m = 0;
    for (; m + kQuantRM <= n_a; m += kQuantRM) {
        quant_tile<T, kQuantRM, kCached>(w, off, nb, cached, act + m * act_stride, act_stride, y + m * y_stride, y_stride,
                                         rows, m == 0 ? pf : none);
    }
    quant_tile_rest<T, kQuantRM - 1, kCached>(n_a - m, w, off, nb, cached, act + m * act_stride, act_stride,
                                              y + m * y_stride, y_stride, rows, m == 0 ? pf : none);
}

template <DType T>
void packed_dot_rows(const uint8_t* packed, int64_t n_w, const uint8_t* act, size_t act_stride, int64_t n_a, int64_t n,
                     float* y, int64_t y_stride) {
    const int64_t nb = n / QK;
    const size_t panel_bytes = static_cast<size_t>(nb) * packed_block_bytes<T>();
    const Prefetch none{};
    for (int64_t i0 = 0; i0 < n_w; i0 += kPanelRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kPanelRows, n_w - i0));
        const uint8_t* pp = packed + (i0 / kPanelRows) * panel_bytes;
        // While this panel is computed, the next one streams into L2 (by its first tile).
        const Prefetch next{i0 + kPanelRows < n_w ? pp + panel_bytes : nullptr, panel_bytes, nb};
        // Past a few tiles each block is unpacked once, as quant_dot_rows does. For fewer, the packed
        // blocks (contiguous, a half or a quarter of an unpacked Panel's bytes) are read again per
        // tile: AVX2's 3-row verify pass (two tiles) measured 1.3x faster so (Q8_0 output head).
        if (n_a > kPackedCachedTiles * kQuantRM) {
            thread_local std::vector<Panel> cache;
            if (cache.size() < static_cast<size_t>(nb)) cache.resize(static_cast<size_t>(nb));
            for (int64_t b = 0; b < nb; ++b) {
                next.step(b);
                load_packed_panel<T>(pp + b * packed_block_bytes<T>(), cache[static_cast<size_t>(b)]);
            }
            quant_tiles_m<T, true>(nullptr, nullptr, nb, cache.data(), act, act_stride, n_a, y + i0, y_stride, rows,
                                   Prefetch{});
            continue;
        }
        int64_t m = 0;
        for (; m + kQuantRM <= n_a; m += kQuantRM) {
            packed_tile<T, kQuantRM>(pp, nb, act + m * act_stride, act_stride, y + m * y_stride + i0, y_stride, rows,
                                     m == 0 ? next : none);
        }
        packed_tile_rest<T, kQuantRM - 1>(n_a - m, pp, nb, act + m * act_stride, act_stride, y + m * y_stride + i0,
                                          y_stride, rows, m == 0 ? next : none);
    }
}

template <DType T>
void quant_dot_rows(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* act, size_t act_stride,
                    int64_t n_a, int64_t n, float* y, int64_t y_stride) {
    const int64_t nb = n / QK;
    // With more than one tile of activation rows, each panel is unpacked once into this buffer
    // instead of once per tile.
    thread_local std::vector<Panel> cache;
    const bool cached = n_a > kQuantRM;
    if (cached && cache.size() < static_cast<size_t>(nb)) cache.resize(static_cast<size_t>(nb));
    for (int64_t i0 = 0; i0 < n_w; i0 += kPanelRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kPanelRows, n_w - i0));
        // Lanes past the last row repeat it (valid memory) and are not stored.
        size_t off[kPanelRows];
        for (int r = 0; r < kPanelRows; ++r) off[r] = static_cast<size_t>(std::min(r, rows - 1)) * w_stride;
        const uint8_t* wp = w + i0 * w_stride;
        // The first pass over this panel streams the next one into the cache.
        const Prefetch next{wp + kPanelRows * w_stride, kPanelRows * w_stride, nb};
        if (cached) {
            for (int64_t b = 0; b < nb; ++b) {
                next.step(b);
                load_panel<T>(wp + b * QuantTraits<T>::kBlockBytes, off, cache[static_cast<size_t>(b)]);
            }
            quant_tiles_m<T, true>(wp, off, nb, cache.data(), act, act_stride, n_a, y + i0, y_stride, rows, Prefetch{});
        } else {
            quant_tiles_m<T, false>(wp, off, nb, nullptr, act, act_stride, n_a, y + i0, y_stride, rows, next);
        }
    }
}
#else
template <DType T>
void quant_dot_rows(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* act, size_t act_stride,
                    int64_t n_a, int64_t n, float* y, int64_t y_stride) {
    for (int64_t m = 0; m < n_a; ++m)
        for (int64_t i = 0; i < n_w; ++i) y[m * y_stride + i] = dot_row_reference(T, w + i * w_stride, act + m * act_stride, n);
}
#endif

}  // namespace

// -------------------------------------------------------------------------------------------------
// Public entry points.

namespace {

// Activation rows go in chunks small enough to stay in L2 while every weight panel meets them; a
// long batch would otherwise be streamed from memory once per panel.
int64_t activation_chunk(DType weight_type, int64_t n) {
    constexpr size_t kChunkBytes = 192 << 10;
    const size_t act_bytes = std::max<size_t>(1, activation_row_bytes(weight_type, n));
    return std::max<int64_t>(8, static_cast<int64_t>(kChunkBytes / act_bytes));
}

}  // namespace

void dot_rows(DType weight_type, const void* w, size_t w_stride, int64_t n_w, const void* act, size_t act_stride,
              int64_t n_a, int64_t n, float* y, int64_t y_stride) {
    const int64_t chunk = activation_chunk(weight_type, n);
    const uint8_t* wb = static_cast<const uint8_t*>(w);
    for (int64_t m0 = 0; m0 < n_a; m0 += chunk) {
        const int64_t rows = std::min(chunk, n_a - m0);
        const uint8_t* ab = static_cast<const uint8_t*>(act) + m0 * act_stride;
        const float* xf = reinterpret_cast<const float*>(ab);
        const size_t xs = act_stride / sizeof(float);
        float* yc = y + m0 * y_stride;
        switch (weight_type) {
            case DType::F32: float_dot_rows<DType::F32>(wb, w_stride, n_w, xf, xs, rows, n, yc, y_stride); break;
            case DType::F16: float_dot_rows<DType::F16>(wb, w_stride, n_w, xf, xs, rows, n, yc, y_stride); break;
            case DType::BF16: float_dot_rows<DType::BF16>(wb, w_stride, n_w, xf, xs, rows, n, yc, y_stride); break;
            case DType::Q8_0: quant_dot_rows<DType::Q8_0>(wb, w_stride, n_w, ab, act_stride, rows, n, yc, y_stride); break;
            case DType::Q4_0: quant_dot_rows<DType::Q4_0>(wb, w_stride, n_w, ab, act_stride, rows, n, yc, y_stride); break;
            case DType::Q4_1: quant_dot_rows<DType::Q4_1>(wb, w_stride, n_w, ab, act_stride, rows, n, yc, y_stride); break;
            default: throw std::invalid_argument(std::string("no dot product for weight type ") + dtype_name(weight_type));
        }
    }
}

bool weights_packable(DType weight_type) {
#if PYSPEC_AVX512VNNI || PYSPEC_AVX2
    return weight_type == DType::Q8_0 || weight_type == DType::Q4_0 || weight_type == DType::Q4_1;
#else
    (void)weight_type;
    return false;
#endif
}

namespace {

void require_packable(DType weight_type) {
    if (!weights_packable(weight_type)) throw std::invalid_argument(std::string("no packed layout for ") + dtype_name(weight_type));
}

}  // namespace

size_t packed_panel_bytes(DType weight_type, int64_t n) {
    require_packable(weight_type);
    return dtype_row_bytes(weight_type, n) * kPackedPanelRows;
}

size_t packed_weight_bytes(DType weight_type, int64_t n_rows, int64_t n) {
    return static_cast<size_t>((n_rows + kPackedPanelRows - 1) / kPackedPanelRows) * packed_panel_bytes(weight_type, n);
}

void pack_weights(DType weight_type, const void* w, size_t row_bytes, int64_t n_rows, int64_t n, void* out) {
    require_packable(weight_type);
    if (n % QK != 0 || n_rows < 1) throw std::invalid_argument("pack_weights: rows must be whole blocks");
#if PYSPEC_AVX512VNNI || PYSPEC_AVX2
    const auto* wb = static_cast<const uint8_t*>(w);
    auto* ob = static_cast<uint8_t*>(out);
    switch (weight_type) {
        case DType::Q8_0: pack_typed<DType::Q8_0>(wb, row_bytes, n_rows, n / QK, ob); break;
        case DType::Q4_0: pack_typed<DType::Q4_0>(wb, row_bytes, n_rows, n / QK, ob); break;
        default: pack_typed<DType::Q4_1>(wb, row_bytes, n_rows, n / QK, ob); break;
    }
#else
    (void)w, (void)row_bytes, (void)out;
#endif
}

void dot_rows_packed(DType weight_type, const void* packed, int64_t n_w, const void* act, size_t act_stride,
                     int64_t n_a, int64_t n, float* y, int64_t y_stride) {
    require_packable(weight_type);
#if PYSPEC_AVX512VNNI || PYSPEC_AVX2
    const int64_t chunk = activation_chunk(weight_type, n);
    const auto* pb = static_cast<const uint8_t*>(packed);
    for (int64_t m0 = 0; m0 < n_a; m0 += chunk) {
        const int64_t rows = std::min(chunk, n_a - m0);
        const uint8_t* ab = static_cast<const uint8_t*>(act) + m0 * act_stride;
        float* yc = y + m0 * y_stride;
        switch (weight_type) {
            case DType::Q8_0: packed_dot_rows<DType::Q8_0>(pb, n_w, ab, act_stride, rows, n, yc, y_stride); break;
            case DType::Q4_0: packed_dot_rows<DType::Q4_0>(pb, n_w, ab, act_stride, rows, n, yc, y_stride); break;
            default: packed_dot_rows<DType::Q4_1>(pb, n_w, ab, act_stride, rows, n, yc, y_stride); break;
        }
    }
#else
    (void)packed, (void)n_w, (void)act, (void)act_stride, (void)n_a, (void)n, (void)y, (void)y_stride;
#endif
}

float dot_row(DType weight_type, const void* w_row, const void* act_row, int64_t n) {
    float y;
    dot_rows(weight_type, w_row, 0, 1, act_row, 0, 1, n, &y, 0);
    return y;
}

const char* kernel_isa() {
#if PYSPEC_AVX512VNNI
    return "avx512vnni";
#elif PYSPEC_AVX512
    return "avx512 (quantized dots: avx2)";
#elif PYSPEC_AVX2VNNI
    return "avx2+vnni";
#elif PYSPEC_AVX2
    return "avx2";
#else
    return "scalar";
#endif
}

}  // namespace pyspec
