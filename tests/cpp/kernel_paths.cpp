// Built by tests/test_kernels.py once per instruction set (AVX-512 VNNI, AVX2, plain x86-64):
// every kernel path (packed weights too, where the instruction set has a packed layout) must give
// the bits of the scalar definitions (quants.h), so a model computes the same numbers on every CPU. Prints a digest of all results (equal across builds) and exits
// non-zero on the first mismatch.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/matmul.h"
#include "cpu/quants.h"

using namespace pyspec;

namespace {

uint64_t digest = 1469598103934665603ull;  // FNV-1a over every result's bits
void mix(const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) digest = (digest ^ static_cast<const uint8_t*>(p)[i]) * 1099511628211ull;
}

int fail(const char* what, DType t, int64_t n, int64_t m, int64_t k) {
    std::printf("MISMATCH %s %s N=%lld M=%lld K=%lld\n", what, dtype_name(t), static_cast<long long>(n),
                static_cast<long long>(m), static_cast<long long>(k));
    return 1;
}

}  // namespace

int main() {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    ThreadPool one(1), two(2);
    std::vector<uint8_t> scratch;
    for (DType t : {DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::Q4_1}) {
        for (int64_t k : {32, 96, 576, 40, 7}) {
            if (dtype_is_quantized(t) && k % QK != 0) continue;
            for (int64_t n : {1, 9, 16, 33, 40}) {
                for (int64_t m : {1, 3, 5, 70}) {
                    std::vector<float> wf(static_cast<size_t>(n * k)), x(static_cast<size_t>(m * k));
                    for (float& v : wf) v = normal(rng);
                    for (float& v : x) v = normal(rng) * 4.0f;
                    const size_t row = dtype_row_bytes(t, k);
                    std::vector<uint8_t> w(static_cast<size_t>(n) * row);
                    for (int64_t i = 0; i < n; ++i) quantize_row(t, &wf[static_cast<size_t>(i * k)], &w[static_cast<size_t>(i) * row], k);
                    const WeightMatrix wm{t, w.data(), n, k, row};
                    std::vector<float> ref(static_cast<size_t>(m * n)), y1(ref.size()), y2(ref.size());
                    matmul_reference(wm, x.data(), k, m, ref.data(), n);
                    matmul(wm, x.data(), k, m, y1.data(), n, one, scratch);
                    matmul(wm, x.data(), k, m, y2.data(), n, two, scratch);
                    const size_t bytes = ref.size() * sizeof(float);
                    if (std::memcmp(ref.data(), y1.data(), bytes) || std::memcmp(ref.data(), y2.data(), bytes)) {
                        return fail("matmul", t, n, m, k);
                    }
                    if (weights_packable(t)) {  // the packed layout of this instruction set, same bits
                        std::vector<uint8_t> packed(packed_weight_bytes(t, n, k));
                        pack_weights(t, w.data(), row, n, k, packed.data());
                        WeightMatrix pm = wm;
                        pm.packed = packed.data();
                        matmul(pm, x.data(), k, m, y1.data(), n, one, scratch);
                        matmul(pm, x.data(), k, m, y2.data(), n, two, scratch);
                        if (std::memcmp(ref.data(), y1.data(), bytes) || std::memcmp(ref.data(), y2.data(), bytes)) {
                            return fail("packed matmul", t, n, m, k);
                        }
                    }
                    mix(ref.data(), bytes);
                }
            }
        }
        if (dtype_is_quantized(t)) {
            std::vector<float> x(576);
            for (float& v : x) v = normal(rng);
            std::vector<uint8_t> a(activation_row_bytes(t, 576)), b(a.size());
            prepare_activation_row(t, x.data(), a.data(), 576);
            prepare_activation_row_reference(t, x.data(), b.data(), 576);
            if (a != b) return fail("activation", t, 1, 1, 576);
            mix(a.data(), a.size());
        }
    }
    for (int64_t n : {1, 7, 64, 100}) {
        std::vector<float> a(static_cast<size_t>(n)), b(a.size()), y(a.size());
        std::vector<uint16_t> h(a.size());
        for (float& v : a) v = normal(rng);
        for (float& v : b) v = normal(rng);
        fp32_to_fp16_row(a.data(), h.data(), n);
        for (int64_t i = 0; i < n; ++i) {
            if (h[static_cast<size_t>(i)] != fp32_to_fp16(a[static_cast<size_t>(i)])) return fail("fp16", DType::F16, n, 1, 1);
        }
        const float d16 = dot_f16_f32(h.data(), b.data(), n), r16 = dot_row_reference(DType::F16, h.data(), b.data(), n);
        const float d32 = dot_f32(a.data(), b.data(), n), r32 = dot_row_reference(DType::F32, a.data(), b.data(), n);
        if (std::memcmp(&d16, &r16, 4) || std::memcmp(&d32, &r32, 4)) return fail("dot", DType::F16, n, 1, 1);
        mix(&d16, 4);
        mix(&d32, 4);
        y = b;
        axpy_f16(0.3f, h.data(), y.data(), n);
        mix(y.data(), y.size() * sizeof(float));
    }
    std::printf("%016llx %s\n", static_cast<unsigned long long>(digest), kernel_isa());
    return 0;
}
