// GGUF reader. The file is mapped read-only and parsed with a bounds-checked cursor: every
// count, length and offset taken from the file is compared with the bytes that are actually
// left before it is used, with overflow-safe arithmetic, so a hostile or truncated file ends in
// std::invalid_argument and never in a read outside the mapping or a huge allocation.
#include "gguf/gguf_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <utility>

#include "core/immutable_memory.h"

namespace pyspec {

namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read as a little-endian uint32
constexpr int kMaxDims = 4;
// Nested arrays are legal, but each level recurses; a small bound keeps a crafted file from
// exhausting the stack. Real files never nest at all.
constexpr int kMaxArrayDepth = 16;
constexpr uint32_t kNumGgufTypes = 13;

// Names of the ggml tensor type ids, so that an error can say "Q5_K" rather than "13". Ids that
// ggml has retired are still named: old files carry them.
const char* ggml_type_name(uint32_t id) {
    switch (id) {
        case 0: return "F32";
        case 1: return "F16";
        case 2: return "Q4_0";
        case 3: return "Q4_1";
        case 4: return "Q4_2";
        case 5: return "Q4_3";
        case 6: return "Q5_0";
        case 7: return "Q5_1";
        case 8: return "Q8_0";
        case 9: return "Q8_1";
        case 10: return "Q2_K";
        case 11: return "Q3_K";
        case 12: return "Q4_K";
        case 13: return "Q5_K";
        case 14: return "Q6_K";
        case 15: return "Q8_K";
        case 16: return "IQ2_XXS";
        case 17: return "IQ2_XS";
        case 18: return "IQ3_XXS";
        case 19: return "IQ1_S";
        case 20: return "IQ4_NL";
        case 21: return "IQ3_S";
        case 22: return "IQ2_S";
        case 23: return "IQ4_XS";
        case 24: return "I8";
        case 25: return "I16";
        case 26: return "I32";
        case 27: return "I64";
        case 28: return "F64";
        case 29: return "IQ1_M";
        case 30: return "BF16";
        case 31: return "Q4_0_4_4";
        case 32: return "Q4_0_4_8";
        case 33: return "Q4_0_8_8";
        case 34: return "TQ1_0";
        case 35: return "TQ2_0";
        case 36: return "IQ4_NL_4_4";
        case 37: return "IQ4_NL_4_8";
        case 38: return "IQ4_NL_8_8";
        case 39: return "MXFP4";
        case 40: return "NVFP4";
        case 41: return "Q1_0";
        default: return nullptr;
    }
}

// The ggml types we compute with, plus the index types I32 and I64; false for every other id.
bool dtype_from_ggml(uint32_t id, DType* out) {
    switch (id) {
        case 0: *out = DType::F32; return true;
        case 1: *out = DType::F16; return true;
        case 2: *out = DType::Q4_0; return true;
        case 3: *out = DType::Q4_1; return true;
        case 8: *out = DType::Q8_0; return true;
        case 26: *out = DType::I32; return true;
        case 27: *out = DType::I64; return true;
        case 30: *out = DType::BF16; return true;
        default: return false;
    }
}

// Bytes of one scalar value of a fixed-size type; 0 for STRING and ARRAY.
size_t fixed_size(GgufType t) {
    switch (t) {
        case GgufType::UINT8:
        case GgufType::INT8:
        case GgufType::BOOL: return 1;
        case GgufType::UINT16:
        case GgufType::INT16: return 2;
        case GgufType::UINT32:
        case GgufType::INT32:
        case GgufType::FLOAT32: return 4;
        case GgufType::UINT64:
        case GgufType::INT64:
        case GgufType::FLOAT64: return 8;
        default: return 0;
    }
}

bool is_integer_type(GgufType t) {
    switch (t) {
        case GgufType::UINT8:
        case GgufType::INT8:
        case GgufType::UINT16:
        case GgufType::INT16:
        case GgufType::UINT32:
        case GgufType::INT32:
        case GgufType::UINT64:
        case GgufType::INT64: return true;
        default: return false;
    }
}

// Names and keys come from the file and may hold any bytes; messages show them escaped and
// shortened so an error is always printable ASCII of reasonable length.
std::string printable(const std::string& s) {
    constexpr size_t kMaxShown = 200;
    static const char hex[] = "0123456789abcdef";
    std::string out;
    const size_t n = s.size() < kMaxShown ? s.size() : kMaxShown;
    for (size_t i = 0; i < n; ++i) {
        const auto c = static_cast<unsigned char>(s[i]);
        if (c >= 0x20 && c < 0x7f) {
            out += static_cast<char>(c);
        } else {
            out += "\\x";
            out += hex[c >> 4];
            out += hex[c & 15];
        }
    }
    if (n < s.size()) out += "...";
    return out;
}

[[noreturn]] void fail(const std::string& path, const std::string& msg) {
    throw std::invalid_argument(path + ": " + msg);
}

// What the parser produced; moved into the GgufFile once the whole file has been validated.
struct Parsed {
    uint32_t version = 0;
    size_t alignment = 32;
    std::map<std::string, GgufValue> metadata;
    std::vector<GgufTensorInfo> tensors;
    std::map<std::string, size_t> tensor_index;
};

class Parser {
public:
    Parser(const std::string& path, const uint8_t* base, size_t size)
        : path_(path), base_(base), size_(size) {}

    Parsed parse() {
        Parsed out;
        read_header(out);
        read_metadata(out);
        out.alignment = alignment_from(out.metadata);
        read_tensor_infos(out);
        place_tensor_data(out);
        return out;
    }

private:
    const std::string& path_;
    const uint8_t* base_;
    size_t size_;
    size_t pos_ = 0;
    // What is being read ("key tokenizer.ggml.tokens", "tensor output.weight"), for messages.
    std::string context_;
    uint64_t n_tensors_ = 0;
    uint64_t n_kv_ = 0;

    size_t remaining() const { return size_ - pos_; }

    [[noreturn]] void fail_here(const std::string& msg) const { fail(path_, msg); }

    void need(size_t n, const char* what) const {
        if (n > remaining()) {
            fail_here("truncated file: " + std::string(what) + " of " + context_ + " needs " +
                      std::to_string(n) + " bytes at offset " + std::to_string(pos_) +
                      " but the file ends at " + std::to_string(size_));
        }
    }

    template <class T>
    T read(const char* what) {
        need(sizeof(T), what);
        T v;
        std::memcpy(&v, base_ + pos_, sizeof(T));  // memcpy: fields are not aligned in the file
        pos_ += sizeof(T);
        return v;
    }

    std::string read_string(const char* what) {
        const uint64_t len = read<uint64_t>(what);
        if (len > remaining()) {
            fail_here(std::string(what) + " of " + context_ + " has length " +
                      std::to_string(len) + ", beyond the end of the file (" +
                      std::to_string(remaining()) + " bytes left at offset " +
                      std::to_string(pos_) + ")");
        }
        std::string s(reinterpret_cast<const char*>(base_ + pos_), static_cast<size_t>(len));
        pos_ += static_cast<size_t>(len);
        return s;
    }

    GgufType read_type(const char* what) {
        const uint32_t t = read<uint32_t>(what);
        if (t >= kNumGgufTypes) {
            fail_here(context_ + " has unknown value type " + std::to_string(t));
        }
        return static_cast<GgufType>(t);
    }

    void read_header(Parsed& out) {
        context_ = "the header";
        const uint32_t magic = read<uint32_t>("magic");
        if (magic != kGgufMagic) {
            char hex[16];
            std::snprintf(hex, sizeof hex, "0x%08x", magic);
            fail_here(std::string("not a GGUF file: bad magic ") + hex +
                      " (expected the bytes 'GGUF')");
        }
        const uint32_t version = read<uint32_t>("version");
        if (version == 1) {
            fail_here("GGUF version 1 is not supported (only versions 2 and 3)");
        }
        if (version != 2 && version != 3) {
            const uint32_t swapped = __builtin_bswap32(version);
            if (swapped >= 1 && swapped <= 3) {
                fail_here("big-endian GGUF files are not supported");
            }
            fail_here("unsupported GGUF version " + std::to_string(version) +
                      " (only versions 2 and 3)");
        }
        out.version = version;
        n_tensors_ = read<uint64_t>("tensor count");
        n_kv_ = read<uint64_t>("metadata count");
        // Smallest possible entries: a key (8-byte length, >= 1 byte) with type and a 1-byte
        // value; a tensor info with a name, n_dims, type and offset. Rejecting counts that
        // cannot fit bounds the memory reserved below.
        constexpr uint64_t kMinKv = 8 + 1 + 4 + 1;
        constexpr uint64_t kMinTensor = 8 + 1 + 4 + 4 + 8;
        if (n_kv_ > remaining() / kMinKv) {
            fail_here("header claims " + std::to_string(n_kv_) +
                      " metadata entries, more than the " + std::to_string(remaining()) +
                      " bytes after it can hold (truncated or corrupt file)");
        }
        if (n_tensors_ > remaining() / kMinTensor) {
            fail_here("header claims " + std::to_string(n_tensors_) +
                      " tensors, more than the " + std::to_string(remaining()) +
                      " bytes after it can hold (truncated or corrupt file)");
        }
    }

    GgufValue read_value(GgufType type, int depth) {
        GgufValue v;
        v.type = type;
        switch (type) {
            case GgufType::UINT8: v.value = uint64_t{read<uint8_t>("value")}; break;
            case GgufType::UINT16: v.value = uint64_t{read<uint16_t>("value")}; break;
            case GgufType::UINT32: v.value = uint64_t{read<uint32_t>("value")}; break;
            case GgufType::UINT64: v.value = read<uint64_t>("value"); break;
            case GgufType::INT8: v.value = int64_t{read<int8_t>("value")}; break;
            case GgufType::INT16: v.value = int64_t{read<int16_t>("value")}; break;
            case GgufType::INT32: v.value = int64_t{read<int32_t>("value")}; break;
            case GgufType::INT64: v.value = read<int64_t>("value"); break;
            case GgufType::FLOAT32: v.value = double{read<float>("value")}; break;
            case GgufType::FLOAT64: v.value = read<double>("value"); break;
            case GgufType::BOOL: {
                const uint8_t b = read<uint8_t>("value");
                if (b > 1) {
                    fail_here(context_ + " has invalid bool value " + std::to_string(b));
                }
                v.value = b == 1;
                break;
            }
            case GgufType::STRING: v.value = read_string("string"); break;
            case GgufType::ARRAY: read_array(v, depth); break;
        }
        return v;
    }

    void read_array(GgufValue& v, int depth) {
        if (depth >= kMaxArrayDepth) {
            fail_here(context_ + " has arrays nested deeper than " +
                      std::to_string(kMaxArrayDepth) + " levels");
        }
        v.array_type = read_type("array element type");
        const uint64_t count = read<uint64_t>("array length");
        // A string needs at least its 8-byte length, an inner array its type and length.
        size_t min_elem = fixed_size(v.array_type);
        if (v.array_type == GgufType::STRING) min_elem = 8;
        if (v.array_type == GgufType::ARRAY) min_elem = 4 + 8;
        if (count > remaining() / min_elem) {
            fail_here(context_ + " has an array of " + std::to_string(count) + " " +
                      gguf_type_name(v.array_type) + " values, more than the " +
                      std::to_string(remaining()) + " bytes left in the file can hold");
        }
        std::vector<GgufValue> items;
        items.reserve(static_cast<size_t>(count));
        for (uint64_t i = 0; i < count; ++i) items.push_back(read_value(v.array_type, depth + 1));
        v.value = std::move(items);
    }

    void read_metadata(Parsed& out) {
        for (uint64_t i = 0; i < n_kv_; ++i) {
            context_ = "metadata entry #" + std::to_string(i);
            std::string key = read_string("key");
            if (key.empty()) fail_here(context_ + " has an empty key");
            context_ = "key " + printable(key);
            const GgufType type = read_type("value type");
            GgufValue value = read_value(type, 0);
            if (!out.metadata.emplace(std::move(key), std::move(value)).second) {
                fail_here("duplicate metadata " + context_);
            }
        }
    }

    size_t alignment_from(const std::map<std::string, GgufValue>& md) const {
        const auto it = md.find("general.alignment");
        if (it == md.end()) return 32;  // the GGUF default
        const GgufValue& v = it->second;
        if (!is_integer_type(v.type)) {
            fail_here(std::string("key general.alignment has type ") + gguf_value_type_name(v) +
                      ", expected an integer");
        }
        // A negative signed value can never be a valid alignment; reject it before converting.
        uint64_t a = 0;
        if (const auto* u = std::get_if<uint64_t>(&v.value)) a = *u;
        if (const auto* s = std::get_if<int64_t>(&v.value)) a = *s > 0 ? static_cast<uint64_t>(*s) : 0;
        if (a == 0 || (a & (a - 1)) != 0) {
            const auto* s = std::get_if<int64_t>(&v.value);
            fail_here("general.alignment must be a nonzero power of two, got " +
                      (s ? std::to_string(*s) : std::to_string(a)));
        }
        return static_cast<size_t>(a);
    }

    void read_tensor_infos(Parsed& out) {
        out.tensors.reserve(static_cast<size_t>(n_tensors_));
        for (uint64_t i = 0; i < n_tensors_; ++i) {
            context_ = "tensor info #" + std::to_string(i);
            GgufTensorInfo t{};
            t.name = read_string("name");
            if (t.name.empty()) fail_here(context_ + " has an empty name");
            const std::string shown = printable(t.name);
            context_ = "tensor " + shown;
            const uint32_t n_dims = read<uint32_t>("dimension count");
            // n_dims 0 is a scalar, as in ggml (all ne are 1).
            if (n_dims > kMaxDims) {
                fail_here(context_ + " has " + std::to_string(n_dims) + " dimensions, at most " +
                          std::to_string(kMaxDims) + " are supported");
            }
            t.n_dims = static_cast<int>(n_dims);
            for (int d = 0; d < kMaxDims; ++d) t.ne[d] = 1;
            for (uint32_t d = 0; d < n_dims; ++d) {
                t.ne[d] = read<int64_t>("dimension");
                if (t.ne[d] < 0) {
                    fail_here("dimension " + std::to_string(d) + " of " + context_ +
                              " is negative (" + std::to_string(t.ne[d]) + ")");
                }
            }
            const uint32_t type_id = read<uint32_t>("type");
            t.offset = read<uint64_t>("offset");

            if (!dtype_from_ggml(type_id, &t.dtype)) {
                const char* name = ggml_type_name(type_id);
                if (name) {
                    fail_here(std::string("unsupported tensor type ") + name + " for " + context_);
                }
                fail_here("unknown tensor type " + std::to_string(type_id) + " for " + context_);
            }
            t.nbytes = tensor_bytes(t);
            if (!out.tensor_index.emplace(t.name, out.tensors.size()).second) {
                fail_here("duplicate tensor name " + shown);
            }
            out.tensors.push_back(std::move(t));
        }
    }

    // nbytes = ne[0] / block * unit_bytes * ne[1] * ne[2] * ne[3], each step checked.
    size_t tensor_bytes(const GgufTensorInfo& t) const {
        int64_t elements = 1;
        for (int d = 0; d < kMaxDims; ++d) {
            if (__builtin_mul_overflow(elements, t.ne[d], &elements)) {
                fail_here("the dimensions of " + context_ +
                          " overflow a 64-bit element count (" + shape_string(t) + ")");
            }
        }
        const int64_t block = dtype_block_size(t.dtype);
        if (t.ne[0] % block != 0) {
            fail_here("row length " + std::to_string(t.ne[0]) + " of " + context_ +
                      " is not a multiple of the block size " + std::to_string(block) + " of " +
                      dtype_name(t.dtype));
        }
        // Elements fitting in int64 does not make bytes fit in size_t (F32 with ne[0] = 2^62).
        const size_t row_units = static_cast<size_t>(t.ne[0] / block);
        if (row_units > std::numeric_limits<size_t>::max() / dtype_unit_bytes(t.dtype)) {
            fail_here("the byte size of " + context_ + " overflows (" + shape_string(t) + ")");
        }
        size_t bytes = dtype_row_bytes(t.dtype, t.ne[0]);
        for (int d = 1; d < kMaxDims; ++d) {
            if (__builtin_mul_overflow(bytes, static_cast<size_t>(t.ne[d]), &bytes)) {
                fail_here("the byte size of " + context_ + " overflows (" + shape_string(t) + ")");
            }
        }
        return bytes;
    }

    static std::string shape_string(const GgufTensorInfo& t) {
        std::string s = "ne = [";
        for (int d = 0; d < t.n_dims; ++d) {
            if (d) s += ", ";
            s += std::to_string(t.ne[d]);
        }
        return s + "]";
    }

    // The data section starts at the first aligned offset after the tensor infos; each tensor
    // sits at an aligned offset inside it and must end inside the file.
    void place_tensor_data(Parsed& out) {
        if (out.tensors.empty()) return;  // a metadata-only file need not have a data section
        const size_t align = out.alignment;
        size_t data_start = 0;
        if (__builtin_add_overflow(pos_, align - 1, &data_start)) {
            fail_here("the data section offset overflows");
        }
        data_start &= ~(align - 1);
        if (data_start > size_) {
            fail_here("truncated file: the data section starts at offset " +
                      std::to_string(data_start) + " but the file ends at " +
                      std::to_string(size_));
        }
        const size_t data_size = size_ - data_start;
        for (GgufTensorInfo& t : out.tensors) {
            const std::string shown = printable(t.name);
            if (t.offset % align != 0) {
                fail_here("tensor " + shown + " has offset " + std::to_string(t.offset) +
                          ", not a multiple of the alignment " + std::to_string(align));
            }
            if (t.offset > data_size || t.nbytes > data_size - t.offset) {
                fail_here("data of tensor " + shown + " (" + std::to_string(t.nbytes) +
                          " bytes at data offset " + std::to_string(t.offset) +
                          ") lies outside the file (the data section has " +
                          std::to_string(data_size) + " bytes)");
            }
            t.data = base_ + data_start + static_cast<size_t>(t.offset);
        }
    }
};

}  // namespace

const char* gguf_type_name(GgufType t) {
    switch (t) {
        case GgufType::UINT8: return "UINT8";
        case GgufType::INT8: return "INT8";
        case GgufType::UINT16: return "UINT16";
        case GgufType::INT16: return "INT16";
        case GgufType::UINT32: return "UINT32";
        case GgufType::INT32: return "INT32";
        case GgufType::FLOAT32: return "FLOAT32";
        case GgufType::BOOL: return "BOOL";
        case GgufType::STRING: return "STRING";
        case GgufType::ARRAY: return "ARRAY";
        case GgufType::UINT64: return "UINT64";
        case GgufType::INT64: return "INT64";
        case GgufType::FLOAT64: return "FLOAT64";
    }
    return "?";
}

std::string gguf_value_type_name(const GgufValue& v) {
    if (v.type != GgufType::ARRAY) return gguf_type_name(v.type);
    return std::string("ARRAY[") + gguf_type_name(v.array_type) + "]";
}

GgufFile::GgufFile(const std::string& path) : path_(path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        fail(path, std::string("cannot open GGUF file: ") + std::strerror(errno));
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
        const int err = errno;
        ::close(fd);
        throw std::runtime_error(path + ": cannot stat: " + std::strerror(err));
    }
    if (S_ISDIR(st.st_mode)) {
        ::close(fd);
        fail(path, "is a directory, not a GGUF file");
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd);
        fail(path, "is not a regular file");
    }
    if (st.st_size == 0) {
        ::close(fd);
        fail(path, "file is empty");
    }
    size_ = static_cast<size_t>(st.st_size);
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    const int map_err = errno;
    ::close(fd);  // the mapping keeps its own reference to the file
    if (p == MAP_FAILED) {
        throw std::runtime_error(path + ": cannot map " + std::to_string(size_) +
                                 " bytes: " + std::strerror(map_err));
    }
    base_ = static_cast<const uint8_t*>(p);

    // The destructor does not run when a constructor throws, so unmap here on a bad file.
    try {
        Parsed parsed = Parser(path_, base_, size_).parse();
        version_ = parsed.version;
        alignment_ = parsed.alignment;
        metadata_ = std::move(parsed.metadata);
        tensors_ = std::move(parsed.tensors);
        tensor_index_ = std::move(parsed.tensor_index);
    } catch (...) {
        ::munmap(const_cast<uint8_t*>(base_), size_);
        base_ = nullptr;
        throw;
    }
    // Mapped read-only: the bytes never change while mapped, so backends may keep copies derived
    // from them (packed weights) until the file goes.
    register_immutable(base_, size_);
}

GgufFile::~GgufFile() {
    if (!base_) return;
    unregister_immutable(base_);
    ::munmap(const_cast<uint8_t*>(base_), size_);
}

const GgufValue* GgufFile::find(const std::string& key) const {
    const auto it = metadata_.find(key);
    return it == metadata_.end() ? nullptr : &it->second;
}

const GgufTensorInfo* GgufFile::find_tensor(const std::string& name) const {
    const auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

namespace {

const GgufValue& require(const GgufFile& f, const std::string& key) {
    const GgufValue* v = f.find(key);
    if (!v) fail(f.path(), "missing key " + printable(key));
    return *v;
}

[[noreturn]] void wrong_type(const GgufFile& f, const std::string& key, const GgufValue& v,
                             const char* expected) {
    fail(f.path(), "key " + printable(key) + " has type " + gguf_value_type_name(v) +
                       ", expected " + expected);
}

// An integer value as int64; a UINT64 above INT64_MAX cannot be represented and is an error.
int64_t int_value(const GgufFile& f, const std::string& key, const GgufValue& v) {
    if (const auto* s = std::get_if<int64_t>(&v.value)) return *s;
    const uint64_t u = std::get<uint64_t>(v.value);
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        fail(f.path(), "value " + std::to_string(u) + " of key " + printable(key) +
                           " does not fit in a signed 64-bit integer");
    }
    return static_cast<int64_t>(u);
}

}  // namespace

int64_t GgufFile::get_int(const std::string& key) const {
    const GgufValue& v = require(*this, key);
    if (!is_integer_type(v.type)) wrong_type(*this, key, v, "an integer");
    return int_value(*this, key, v);
}

int64_t GgufFile::get_int_or(const std::string& key, int64_t fallback) const {
    return has(key) ? get_int(key) : fallback;
}

double GgufFile::get_float(const std::string& key) const {
    const GgufValue& v = require(*this, key);
    if (v.type == GgufType::FLOAT32 || v.type == GgufType::FLOAT64) {
        return std::get<double>(v.value);
    }
    if (!is_integer_type(v.type)) wrong_type(*this, key, v, "a float or an integer");
    if (const auto* s = std::get_if<int64_t>(&v.value)) return static_cast<double>(*s);
    return static_cast<double>(std::get<uint64_t>(v.value));
}

double GgufFile::get_float_or(const std::string& key, double fallback) const {
    return has(key) ? get_float(key) : fallback;
}

bool GgufFile::get_bool_or(const std::string& key, bool fallback) const {
    const GgufValue* v = find(key);
    if (!v) return fallback;
    if (v->type != GgufType::BOOL) wrong_type(*this, key, *v, "BOOL");
    return std::get<bool>(v->value);
}

std::string GgufFile::get_string(const std::string& key) const {
    const GgufValue& v = require(*this, key);
    if (v.type != GgufType::STRING) wrong_type(*this, key, v, "STRING");
    return std::get<std::string>(v.value);
}

std::string GgufFile::get_string_or(const std::string& key, const std::string& fallback) const {
    return has(key) ? get_string(key) : fallback;
}

std::vector<int64_t> GgufFile::get_int_array(const std::string& key) const {
    const GgufValue& v = require(*this, key);
    if (v.type != GgufType::ARRAY || !is_integer_type(v.array_type)) {
        wrong_type(*this, key, v, "an array of integers");
    }
    const auto& items = std::get<std::vector<GgufValue>>(v.value);
    std::vector<int64_t> out;
    out.reserve(items.size());
    for (const GgufValue& item : items) out.push_back(int_value(*this, key, item));
    return out;
}

}  // namespace pyspec
