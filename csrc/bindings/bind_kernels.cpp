// pyspec._core.kernels: the CPU weight kernels (quants.h, matmul.h) on numpy arrays, for tests
// and benchmarks. Quantized data travels as uint8 arrays in ggml's block layout.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/immutable_memory.h"
#include "core/thread_pool.h"
#include "cpu/matmul.h"
#include "cpu/quants.h"

namespace py = pybind11;

namespace pyspec {

namespace {

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;
using ByteArray = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>;

DType parse_dtype(const std::string& name) {
    for (int i = 0; i < static_cast<int>(DType::COUNT); ++i) {
        const DType t = static_cast<DType>(i);
        if (!dtype_is_integer(t) && name == dtype_name(t)) return t;
    }
    throw std::invalid_argument("unknown weight type '" + name + "' (expected F32, F16, BF16, Q8_0, Q4_0 or Q4_1)");
}

// One pool per thread count, made on first use and kept: a pool runs one task at a time, so each
// has a lock that a call holds while it uses the pool.
struct CachedPool {
    explicit CachedPool(int n) : pool(n) {}
    ThreadPool pool;
    std::mutex busy;
    std::vector<uint8_t> scratch;
};

CachedPool& pool_for(int n_threads) {
    if (n_threads < 1 || n_threads > 256) throw std::invalid_argument("n_threads must be in [1, 256]");
    static std::mutex lock;
    static std::map<int, std::unique_ptr<CachedPool>> pools;
    std::lock_guard<std::mutex> guard(lock);
    auto& p = pools[n_threads];
    if (!p) p = std::make_unique<CachedPool>(n_threads);
    return *p;
}

// A half-precision vector given as float16 or uint16 (same bits).
const uint16_t* half_data(const py::array& a, int64_t& n) {
    if (a.itemsize() != 2 || a.ndim() != 1 || !(a.flags() & py::array::c_style)) {
        throw std::invalid_argument("expected a contiguous 1-D float16 or uint16 array");
    }
    n = a.shape(0);
    return static_cast<const uint16_t*>(a.data());
}

const float* float_vector(const FloatArray& a, int64_t n_expected, const char* what) {
    if (a.ndim() != 1 || (n_expected >= 0 && a.shape(0) != n_expected)) {
        throw std::invalid_argument(std::string(what) + ": expected a 1-D float32 array" +
                                    (n_expected >= 0 ? " of " + std::to_string(n_expected) + " values" : ""));
    }
    return a.data();
}

// Validates a matmul's shapes against w (whole copies of n_rows packed rows) and x; returns the
// WeightMatrix of the first copy and the number of copies.
WeightMatrix weight_matrix(DType t, const ByteArray& w, int64_t n_rows, int64_t n_cols, const FloatArray& x,
                           int64_t* copies = nullptr) {
    if (n_rows < 0 || n_cols < 0) throw std::invalid_argument("matmul: negative shape");
    if (n_cols % dtype_block_size(t) != 0) {
        throw std::invalid_argument("matmul: n_cols must be a multiple of " + std::to_string(dtype_block_size(t)));
    }
    if (x.ndim() != 2 || x.shape(1) != n_cols) {
        throw std::invalid_argument("matmul: x must be float32 [M, " + std::to_string(n_cols) + "]");
    }
    const size_t row_bytes = dtype_row_bytes(t, n_cols);
    const size_t matrix_bytes = static_cast<size_t>(n_rows) * row_bytes;
    const size_t have = static_cast<size_t>(w.size());
    const bool whole = copies ? matrix_bytes > 0 && have > 0 && have % matrix_bytes == 0 : have == matrix_bytes;
    if (!whole) {
        throw std::invalid_argument("matmul: w holds " + std::to_string(have) + " bytes; " + std::to_string(n_rows) +
                                    " rows of " + dtype_name(t) + "[" + std::to_string(n_cols) + "] take " +
                                    std::to_string(matrix_bytes));
    }
    if (copies) *copies = static_cast<int64_t>(have / matrix_bytes);
    return WeightMatrix{t, w.data(), n_rows, n_cols, row_bytes};
}

}  // namespace

void bind_kernels(py::module_& parent) {
    py::module_ m = parent.def_submodule(
        "kernels", "CPU weight kernels: ggml-compatible quantization and the batch-invariant matmul");

    m.def("isa", &kernel_isa, "Vector instruction set the kernels were compiled for");

    m.def(
        "quantize",
        [](const std::string& dtype, const FloatArray& x) {
            const DType t = parse_dtype(dtype);
            const int64_t n = x.size();
            if (x.ndim() != 1) throw std::invalid_argument("quantize: expected a 1-D float32 array");
            if (n % dtype_block_size(t) != 0) {
                throw std::invalid_argument("quantize: length must be a multiple of " + std::to_string(dtype_block_size(t)));
            }
            py::array_t<uint8_t> out(static_cast<py::ssize_t>(dtype_row_bytes(t, n)));
            quantize_row(t, x.data(), out.mutable_data(), n);
            return out;
        },
        py::arg("dtype"), py::arg("x"), "One row of float32 values to dtype's bytes (ggml's rounding)");

    m.def(
        "dequantize",
        [](const std::string& dtype, const ByteArray& data, int64_t n) {
            const DType t = parse_dtype(dtype);
            if (n < 0 || n % dtype_block_size(t) != 0) {
                throw std::invalid_argument("dequantize: n must be a multiple of " + std::to_string(dtype_block_size(t)));
            }
            if (static_cast<size_t>(data.size()) != dtype_row_bytes(t, n)) {
                throw std::invalid_argument("dequantize: " + std::to_string(n) + " values of " + dtype_name(t) + " take " +
                                            std::to_string(dtype_row_bytes(t, n)) + " bytes, got " + std::to_string(data.size()));
            }
            py::array_t<float> out(static_cast<py::ssize_t>(n));
            dequantize_row(t, data.data(), out.mutable_data(), n);
            return out;
        },
        py::arg("dtype"), py::arg("data"), py::arg("n"), "n values of dtype (packed bytes) to float32");

    m.def(
        "prepare_activation",
        [](const std::string& weight_dtype, const FloatArray& x, bool reference) {
            const DType t = parse_dtype(weight_dtype);
            const float* src = float_vector(x, -1, "prepare_activation");
            const int64_t n = x.shape(0);
            py::array_t<uint8_t> out(static_cast<py::ssize_t>(activation_row_bytes(t, n)));
            if (reference) {
                prepare_activation_row_reference(t, src, out.mutable_data(), n);
            } else {
                prepare_activation_row(t, src, out.mutable_data(), n);
            }
            return out;
        },
        py::arg("weight_dtype"), py::arg("x"), py::arg("reference") = false,
        "An activation row in the form weight_dtype's dot product reads: Q8_0 blocks {f32 d, i32 sum, "
        "i8 qs[32]} for Q8_0/Q4_0 weights, Q8_1 blocks {f32 d, f32 s, i8 qs[32]} for Q4_1, float32 otherwise");

    m.def(
        "matmul",
        [](const std::string& dtype, const ByteArray& w, int64_t n_rows, int64_t n_cols, const FloatArray& x,
           int n_threads, bool packed) {
            WeightMatrix wm = weight_matrix(parse_dtype(dtype), w, n_rows, n_cols, x);
            std::vector<uint8_t> panels;
            if (packed) {
                panels.resize(packed_weight_bytes(wm.dtype, n_rows, n_cols));
                pack_weights(wm.dtype, wm.data, wm.row_bytes, n_rows, n_cols, panels.data());
                wm.packed = panels.data();
            }
            const int64_t m = x.shape(0);
            py::array_t<float> y({static_cast<py::ssize_t>(m), static_cast<py::ssize_t>(n_rows)});
            CachedPool& cp = pool_for(n_threads);
            float* yp = y.mutable_data();
            {
                py::gil_scoped_release release;
                std::lock_guard<std::mutex> guard(cp.busy);
                matmul(wm, x.data(), n_cols, m, yp, n_rows, cp.pool, cp.scratch);
            }
            return y;
        },
        py::arg("dtype"), py::arg("w"), py::arg("n_rows"), py::arg("n_cols"), py::arg("x"), py::arg("n_threads") = 1,
        py::arg("packed") = false,
        "Y[m, n] = dot(W row n, X row m): W is n_rows rows of dtype's blocks, X float32 [M, n_cols]; packed: "
        "through the packed panel layout (weights_packable types on AVX-512 VNNI builds; ValueError elsewhere)");
    m.def("weights_packable", [](const std::string& dtype) { return weights_packable(parse_dtype(dtype)); },
          py::arg("dtype"), "Whether this build packs dtype's weights into 16-row panels for matmul");
    m.def(
        "packed_copy_stats",
        [] {
            const ImmutableCopyStats st = immutable_copy_stats();
            py::dict d;
            d["regions"] = st.regions;
            d["copies"] = st.copies;
            d["bytes"] = st.bytes;
            return d;
        },
        "The copies kept from read-only GGUF mappings (the CPU's packed weights): {regions (mapped files), "
        "copies, bytes}");

    m.def(
        "time_matmul",
        [](const std::string& dtype, const ByteArray& w, int64_t n_rows, int64_t n_cols, const FloatArray& x,
           int n_threads, int repeats, bool packed) {
            if (repeats < 1) throw std::invalid_argument("time_matmul: repeats must be >= 1");
            int64_t copies = 0;
            WeightMatrix wm = weight_matrix(parse_dtype(dtype), w, n_rows, n_cols, x, &copies);
            const size_t matrix_bytes = static_cast<size_t>(n_rows) * wm.row_bytes;
            // Packed: each copy packed once, before the clock starts.
            const size_t packed_bytes = packed ? packed_weight_bytes(wm.dtype, n_rows, n_cols) : 0;
            std::vector<uint8_t> panels(packed_bytes * static_cast<size_t>(copies));
            for (int64_t c = 0; packed && c < copies; ++c) {
                pack_weights(wm.dtype, w.data() + static_cast<size_t>(c) * matrix_bytes, wm.row_bytes, n_rows, n_cols,
                             panels.data() + static_cast<size_t>(c) * packed_bytes);
            }
            const int64_t m = x.shape(0);
            std::vector<float> y(static_cast<size_t>(m * n_rows));
            CachedPool& cp = pool_for(n_threads);
            py::gil_scoped_release release;
            std::lock_guard<std::mutex> guard(cp.busy);
            const auto start = std::chrono::steady_clock::now();
            for (int r = 0; r < repeats; ++r) {
                wm.data = w.data() + static_cast<size_t>(r % copies) * matrix_bytes;
                if (packed) wm.packed = panels.data() + static_cast<size_t>(r % copies) * packed_bytes;
                matmul(wm, x.data(), n_cols, m, y.data(), n_rows, cp.pool, cp.scratch);
            }
            return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / repeats;
        },
        py::arg("dtype"), py::arg("w"), py::arg("n_rows"), py::arg("n_cols"), py::arg("x"), py::arg("n_threads"),
        py::arg("repeats"), py::arg("packed") = false,
        "Seconds per matmul over `repeats` calls, cycling through the copies of the matrix that w holds "
        "(several copies larger than the last-level cache measure weights streamed from memory)");

    m.def(
        "matmul_reference",
        [](const std::string& dtype, const ByteArray& w, int64_t n_rows, int64_t n_cols, const FloatArray& x) {
            const WeightMatrix wm = weight_matrix(parse_dtype(dtype), w, n_rows, n_cols, x);
            const int64_t m = x.shape(0);
            py::array_t<float> y({static_cast<py::ssize_t>(m), static_cast<py::ssize_t>(n_rows)});
            float* yp = y.mutable_data();
            {
                py::gil_scoped_release release;
                matmul_reference(wm, x.data(), n_cols, m, yp, n_rows);
            }
            return y;
        },
        py::arg("dtype"), py::arg("w"), py::arg("n_rows"), py::arg("n_cols"), py::arg("x"),
        "matmul by the scalar definition of the reduction order (single thread, slow)");

    m.def(
        "dot_f16_f32",
        [](const py::array& a, const FloatArray& b) {
            int64_t n;
            const uint16_t* ap = half_data(a, n);
            return dot_f16_f32(ap, float_vector(b, n, "dot_f16_f32"), n);
        },
        py::arg("a"), py::arg("b"), "dot(float16 a, float32 b) in the fixed 32-lane order");

    m.def(
        "dot_f32",
        [](const FloatArray& a, const FloatArray& b) {
            const int64_t n = a.size();
            return dot_f32(float_vector(a, -1, "dot_f32"), float_vector(b, n, "dot_f32"), n);
        },
        py::arg("a"), py::arg("b"), "dot(float32 a, float32 b) in the fixed 32-lane order");

    m.def(
        "axpy_f16",
        [](float alpha, const py::array& x, const FloatArray& y) {
            int64_t n;
            const uint16_t* xp = half_data(x, n);
            py::array_t<float> out(static_cast<py::ssize_t>(n));
            std::memcpy(out.mutable_data(), float_vector(y, n, "axpy_f16"), static_cast<size_t>(n) * sizeof(float));
            axpy_f16(alpha, xp, out.mutable_data(), n);
            return out;
        },
        py::arg("alpha"), py::arg("x"), py::arg("y"), "fma(alpha, float16 x, y) elementwise, as a new array");

    m.def(
        "axpy_f32",
        [](float alpha, const FloatArray& x, const FloatArray& y) {
            const int64_t n = x.size();
            py::array_t<float> out(static_cast<py::ssize_t>(n));
            std::memcpy(out.mutable_data(), float_vector(y, n, "axpy_f32"), static_cast<size_t>(n) * sizeof(float));
            axpy_f32(alpha, float_vector(x, -1, "axpy_f32"), out.mutable_data(), n);
            return out;
        },
        py::arg("alpha"), py::arg("x"), py::arg("y"), "fma(alpha, x, y) elementwise, as a new array");
}

}  // namespace pyspec
