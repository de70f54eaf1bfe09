// A GGUF (v2/v3) file mapped read-only. Every count, length, offset and size read from the file
// is checked against the file before use; a bad file raises std::invalid_argument with a message
// naming the problem and never reads outside the mapping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "core/dtype.h"

namespace pyspec {

enum class GgufType : uint32_t {
    UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6, BOOL = 7,
    STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};

struct GgufArray;
// A metadata value. Integers are widened to int64/uint64, floats to double; the original
// GGUF type is kept in GgufValue::type.
struct GgufValue {
    GgufType type = GgufType::UINT8;
    std::variant<uint64_t, int64_t, double, bool, std::string, std::vector<GgufValue>> value;
    GgufType array_type = GgufType::UINT8;  // element type when type == ARRAY
};

// "UINT32", "STRING", ...; for a value, arrays name their element type: "ARRAY[STRING]".
const char* gguf_type_name(GgufType t);
std::string gguf_value_type_name(const GgufValue& v);

struct GgufTensorInfo {
    std::string name;
    DType dtype;
    int n_dims;
    int64_t ne[4];         // ne[0] innermost, unused dims 1
    uint64_t offset;       // from the start of the data section
    size_t nbytes;
    const uint8_t* data;   // inside the mapping
};

class GgufFile {
public:
    explicit GgufFile(const std::string& path);  // throws std::invalid_argument / runtime_error
    ~GgufFile();
    GgufFile(const GgufFile&) = delete;
    GgufFile& operator=(const GgufFile&) = delete;

    const std::string& path() const { return path_; }
    uint32_t version() const { return version_; }
    size_t alignment() const { return alignment_; }
    size_t file_size() const { return size_; }

    const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
    bool has(const std::string& key) const { return metadata_.count(key) != 0; }
    const GgufValue* find(const std::string& key) const;

    // Typed getters: throw std::invalid_argument naming the key when it is missing or has an
    // incompatible type. The *_or forms return the fallback when the key is missing.
    int64_t get_int(const std::string& key) const;
    int64_t get_int_or(const std::string& key, int64_t fallback) const;
    double get_float(const std::string& key) const;
    double get_float_or(const std::string& key, double fallback) const;
    bool get_bool_or(const std::string& key, bool fallback) const;
    std::string get_string(const std::string& key) const;
    std::string get_string_or(const std::string& key, const std::string& fallback) const;
    std::vector<int64_t> get_int_array(const std::string& key) const;

    const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
    const GgufTensorInfo* find_tensor(const std::string& name) const;  // nullptr when absent

private:
    std::string path_;
    uint32_t version_ = 0;
    size_t alignment_ = 32;
    const uint8_t* base_ = nullptr;
    size_t size_ = 0;
    std::map<std::string, GgufValue> metadata_;
    std::vector<GgufTensorInfo> tensors_;
    std::map<std::string, size_t> tensor_index_;
};

}  // namespace pyspec
