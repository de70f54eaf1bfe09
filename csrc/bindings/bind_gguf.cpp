// Python view of GgufFile: metadata as plain Python values, tensor data as read-only numpy views
// of the mapping. std::invalid_argument from the reader reaches Python as ValueError.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include <filesystem>
#include <memory>

#include "gguf/gguf_file.h"

namespace py = pybind11;

namespace pyspec {

namespace {

// GGUF strings should be UTF-8 but the reader does not insist (llama.cpp does not either);
// surrogateescape turns stray bytes into lone surrogates instead of failing, and
// s.encode("utf-8", "surrogateescape") gives the exact bytes back.
py::str to_py_str(const std::string& s) {
    PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "surrogateescape");
    if (!o) throw py::error_already_set();
    return py::reinterpret_steal<py::str>(o);
}

// The inverse, so every name shown in metadata or tensors can be looked up again.
std::string from_py_str(const py::str& s) {
    PyObject* b = PyUnicode_AsEncodedString(s.ptr(), "utf-8", "surrogateescape");
    if (!b) throw py::error_already_set();
    const auto bytes = py::reinterpret_steal<py::bytes>(b);
    return static_cast<std::string>(bytes);
}

py::object to_py(const GgufValue& v) {
    switch (v.type) {
        case GgufType::FLOAT32:
        case GgufType::FLOAT64: return py::float_(std::get<double>(v.value));
        case GgufType::BOOL: return py::bool_(std::get<bool>(v.value));
        case GgufType::STRING: return to_py_str(std::get<std::string>(v.value));
        case GgufType::ARRAY: {
            const auto& items = std::get<std::vector<GgufValue>>(v.value);
            py::list out(items.size());
            for (size_t i = 0; i < items.size(); ++i) out[i] = to_py(items[i]);
            return std::move(out);
        }
        default:
            if (const auto* s = std::get_if<int64_t>(&v.value)) return py::int_(*s);
            return py::int_(std::get<uint64_t>(v.value));
    }
}

py::dict tensor_dict(const GgufTensorInfo& t) {
    py::list shape;
    for (int d = 0; d < t.n_dims; ++d) shape.append(t.ne[d]);
    py::dict out;
    out["name"] = to_py_str(t.name);
    out["dtype"] = dtype_name(t.dtype);
    out["shape"] = shape;
    out["offset"] = t.offset;
    out["nbytes"] = t.nbytes;
    return out;
}

}  // namespace

void bind_gguf(py::module_& m) {
    // shared_ptr holder: C++ objects that point into the mapping (model weights) can share
    // ownership of the file with Python.
    py::class_<GgufFile, std::shared_ptr<GgufFile>>(m, "GgufFile",
        "A GGUF (v2/v3) file mapped read-only and fully validated on open.\n"
        "A malformed file raises ValueError naming the problem.")
        .def(py::init([](const std::filesystem::path& path) {
                 // Parsing touches no Python objects, so other threads may run meanwhile.
                 py::gil_scoped_release release;
                 return std::make_shared<GgufFile>(path.string());
             }),
             py::arg("path"))
        .def_property_readonly("path", &GgufFile::path)
        .def_property_readonly("version", &GgufFile::version)
        .def_property_readonly("alignment", &GgufFile::alignment)
        .def_property_readonly("file_size", &GgufFile::file_size)
        .def_property_readonly(
            "metadata",
            [](const GgufFile& f) {
                py::dict out;
                for (const auto& kv : f.metadata()) out[to_py_str(kv.first)] = to_py(kv.second);
                return out;
            },
            "Key -> value (int, float, bool, str or nested lists). Builds a new dict on every "
            "access; keep it in a variable rather than reading it in a loop.")
        .def_property_readonly(
            "metadata_types",
            [](const GgufFile& f) {
                py::dict out;
                for (const auto& kv : f.metadata()) {
                    out[to_py_str(kv.first)] = gguf_value_type_name(kv.second);
                }
                return out;
            },
            "Key -> GGUF type name, e.g. 'UINT32' or 'ARRAY[STRING]'.")
        .def_property_readonly(
            "tensors",
            [](const GgufFile& f) {
                py::list out;
                for (const GgufTensorInfo& t : f.tensors()) out.append(tensor_dict(t));
                return out;
            },
            "Tensor infos in file order: dicts with name, dtype, shape (ne order, innermost "
            "first), offset (from the data section) and nbytes.")
        .def(
            "tensor_data",
            [](py::object self, const py::str& name) {
                const auto& f = self.cast<const GgufFile&>();
                const GgufTensorInfo* t = f.find_tensor(from_py_str(name));
                if (!t) throw py::key_error("no tensor named " + py::repr(name).cast<std::string>());
                // The array's base is the GgufFile object, so the mapping outlives the view.
                py::array_t<uint8_t> arr({static_cast<py::ssize_t>(t->nbytes)}, {1}, t->data, self);
                // The mapping is PROT_READ: a write through the view would fault.
                arr.attr("setflags")(py::arg("write") = false);
                return arr;
            },
            py::arg("name"), "The tensor's bytes as a read-only uint8 view of the mapping.")
        .def("has", [](const GgufFile& f, const py::str& key) { return f.has(from_py_str(key)); },
             py::arg("key"))
        .def(
            "get_int",
            [](const GgufFile& f, const py::str& key, const py::object& fallback) {
                const std::string k = from_py_str(key);
                return fallback.is_none() ? f.get_int(k) : f.get_int_or(k, fallback.cast<int64_t>());
            },
            py::arg("key"), py::arg("default") = py::none(),
            "An integer value (any GGUF integer type). Without a default a missing key raises "
            "ValueError; a key of another type always does.")
        .def(
            "get_float",
            [](const GgufFile& f, const py::str& key, const py::object& fallback) {
                const std::string k = from_py_str(key);
                return fallback.is_none() ? f.get_float(k) : f.get_float_or(k, fallback.cast<double>());
            },
            py::arg("key"), py::arg("default") = py::none(),
            "A float or integer value as float.")
        .def(
            "get_bool",
            [](const GgufFile& f, const py::str& key, bool fallback) {
                return f.get_bool_or(from_py_str(key), fallback);
            },
            py::arg("key"), py::arg("default"))
        .def(
            "get_string",
            [](const GgufFile& f, const py::str& key, const py::object& fallback) {
                const std::string k = from_py_str(key);
                if (fallback.is_none()) return to_py_str(f.get_string(k));
                return to_py_str(f.get_string_or(k, from_py_str(fallback.cast<py::str>())));
            },
            py::arg("key"), py::arg("default") = py::none())
        .def(
            "get_int_array",
            [](const GgufFile& f, const py::str& key) { return f.get_int_array(from_py_str(key)); },
            py::arg("key"))
        .def("__repr__", [](const GgufFile& f) {
            return "<GgufFile " + py::repr(to_py_str(f.path())).cast<std::string>() +
                   " v" + std::to_string(f.version()) + ", " +
                   std::to_string(f.metadata().size()) + " keys, " +
                   std::to_string(f.tensors().size()) + " tensors>";
        });
}

}  // namespace pyspec
