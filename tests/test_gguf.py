"""The GGUF reader (csrc/gguf/gguf_file.cpp) through pyspec._core.GgufFile.

Valid files are written with the `gguf` package's GGUFWriter; bad files are made by patching
fields of valid files, located by a small independent walker of the GGUF layout (`Layout`), or
by building raw bytes with struct.
"""

import gc
import math
import pathlib
import re
import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from hypothesis import given, settings
from hypothesis import strategies as st

from pyspec import _core

from default_model import require_default_model

GgufFile = _core.GgufFile

# struct formats of the fixed-size GGUF value types, by type id
SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B",
              10: "<Q", 11: "<q", 12: "<d"}


def align_up(x, a):
    return (x + a - 1) // a * a


# ---------------------------------------------------------------------------------------------
# Writing valid files and finding their fields


def write_gguf(path, setup=None, tensors=(), alignment=None):
    """Write a GGUF file: `setup(writer)` adds metadata; tensors are (name, array, raw_dtype)."""
    w = gguf.GGUFWriter(str(path), arch="test")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    if setup is not None:
        setup(w)
    for name, arr, raw_dtype in tensors:
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return pathlib.Path(path).read_bytes()


class Layout:
    """Byte positions of every field of a well-formed little-endian GGUF file."""

    def __init__(self, buf):
        self.buf = buf
        self.version = self.u32(4)
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        pos = 24
        self.kv = {}
        for _ in range(n_kv):
            key_at = pos
            klen = self.u64(pos)
            key = buf[pos + 8:pos + 8 + klen].decode()
            pos += 8 + klen
            vtype = self.u32(pos)
            entry = {"key_at": key_at, "type_at": pos, "value_at": pos + 4, "type": vtype}
            self.kv[key] = entry
            pos = self._skip_value(vtype, pos + 4)
        self.alignment = 32
        if "general.alignment" in self.kv:
            self.alignment = self.u32(self.kv["general.alignment"]["value_at"])
        self.tensors = {}
        for _ in range(n_tensors):
            name_at = pos
            nlen = self.u64(pos)
            name = buf[pos + 8:pos + 8 + nlen].decode()
            pos += 8 + nlen
            n_dims = self.u32(pos)
            dims_at = pos + 4
            ne = list(struct.unpack_from(f"<{n_dims}q", buf, dims_at))
            pos = dims_at + 8 * n_dims
            self.tensors[name] = {"name_at": name_at, "n_dims_at": dims_at - 4, "dims_at": dims_at,
                                  "ne": ne, "type_at": pos, "offset_at": pos + 4,
                                  "offset": self.u64(pos + 4)}
            pos += 12
        self.infos_end = pos
        self.data_start = align_up(pos, self.alignment)

    def u32(self, at):
        return struct.unpack_from("<I", self.buf, at)[0]

    def u64(self, at):
        return struct.unpack_from("<Q", self.buf, at)[0]

    def _skip_value(self, vtype, pos):
        if vtype in SCALAR_FMT:
            return pos + struct.calcsize(SCALAR_FMT[vtype])
        if vtype == VT.STRING:
            return pos + 8 + self.u64(pos)
        assert vtype == VT.ARRAY
        etype, count = self.u32(pos), self.u64(pos + 4)
        pos += 12
        for _ in range(count):
            pos = self._skip_value(etype, pos)
        return pos


def patch(buf, at, fmt, value):
    out = bytearray(buf)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


def load_bytes(path, data):
    path.write_bytes(data)
    return GgufFile(str(path))


def expect_error(path, data, *fragments):
    """Loading `data` raises ValueError whose message names the file and holds every fragment."""
    with pytest.raises(ValueError) as info:
        load_bytes(path, data)
    msg = str(info.value)
    assert msg.startswith(str(path) + ": "), msg
    for fragment in fragments:
        assert fragment in msg, msg
    return msg


# ---------------------------------------------------------------------------------------------
# Raw files, for layouts GGUFWriter cannot produce


def raw_str(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def raw_kv(key, vtype, payload):
    return raw_str(key) + struct.pack("<I", vtype) + payload


def raw_gguf(kvs=(), infos=(), data=b"", version=3, alignment=32):
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos), len(kvs)) + b"".join(kvs)
    head += b"".join(infos)
    return head + b"\0" * (align_up(len(head), alignment) - len(head)) + data


def raw_info(name, ne, type_id, offset):
    return raw_str(name) + struct.pack(f"<I{len(ne)}qIQ", len(ne), *ne, type_id, offset)


# ---------------------------------------------------------------------------------------------
# Round trips


def all_types_setup(w):
    w.add_uint8("t.u8", 255)
    w.add_int8("t.i8", -128)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -32768)
    w.add_uint32("t.u32", 2**32 - 1)
    w.add_int32("t.i32", -2**31)
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -2**63)
    w.add_float32("t.f32", 0.1)
    w.add_float64("t.f64", math.pi)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_string("t.str", "héllo ✓ <|im_start|>")
    w.add_key_value("t.empty_str", "", VT.STRING)
    w.add_array("t.arr_i32", [1, -2, 3, 2**31 - 1])
    w.add_array("t.arr_f32", [0.5, -1.25, 1e-6])
    w.add_array("t.arr_str", ["a", "", "ü", "<0x0A>"])
    w.add_array("t.arr_bool", [True, False, True])
    w.add_key_value("t.arr_u64", [0, 2**64 - 1], VT.ARRAY, sub_type=VT.UINT64)
    w.add_key_value("t.arr_i8", [-1, 127], VT.ARRAY, sub_type=VT.INT8)
    w.add_key_value("t.arr_u8", [0, 200], VT.ARRAY, sub_type=VT.UINT8)
    w.add_key_value("t.arr_f64", [math.e], VT.ARRAY, sub_type=VT.FLOAT64)
    w.add_array("t.nested", [[1, 2], ["x"], [[0.5]]])


ALL_TYPES_EXPECTED = {
    "general.architecture": ("test", "STRING"),
    "t.u8": (255, "UINT8"),
    "t.i8": (-128, "INT8"),
    "t.u16": (65535, "UINT16"),
    "t.i16": (-32768, "INT16"),
    "t.u32": (2**32 - 1, "UINT32"),
    "t.i32": (-2**31, "INT32"),
    "t.u64": (2**64 - 1, "UINT64"),
    "t.i64": (-2**63, "INT64"),
    "t.f32": (float(np.float32(0.1)), "FLOAT32"),
    "t.f64": (math.pi, "FLOAT64"),
    "t.true": (True, "BOOL"),
    "t.false": (False, "BOOL"),
    "t.str": ("héllo ✓ <|im_start|>", "STRING"),
    "t.empty_str": ("", "STRING"),
    "t.arr_i32": ([1, -2, 3, 2**31 - 1], "ARRAY[INT32]"),
    "t.arr_f32": ([0.5, -1.25, float(np.float32(1e-6))], "ARRAY[FLOAT32]"),
    "t.arr_str": (["a", "", "ü", "<0x0A>"], "ARRAY[STRING]"),
    "t.arr_bool": ([True, False, True], "ARRAY[BOOL]"),
    "t.arr_u64": ([0, 2**64 - 1], "ARRAY[UINT64]"),
    "t.arr_i8": ([-1, 127], "ARRAY[INT8]"),
    "t.arr_u8": ([0, 200], "ARRAY[UINT8]"),
    "t.arr_f64": ([math.e], "ARRAY[FLOAT64]"),
    "t.nested": ([[1, 2], ["x"], [[0.5]]], "ARRAY[ARRAY]"),
}


def test_metadata_round_trip_every_type(tmp_path):
    path = tmp_path / "m.gguf"
    buf = write_gguf(path, all_types_setup)
    f = GgufFile(str(path))
    assert f.version == 3
    assert f.path == str(path)
    assert f.file_size == len(buf)
    assert f.alignment == 32
    assert f.tensors == []
    md, types = f.metadata, f.metadata_types
    assert set(md) == set(ALL_TYPES_EXPECTED)
    for key, (value, type_name) in ALL_TYPES_EXPECTED.items():
        assert md[key] == value, key
        assert type(md[key]) is type(value), key
        assert types[key] == type_name, key
    # bools stay bools inside lists, ints stay ints
    assert [type(x) for x in md["t.arr_bool"]] == [bool, bool, bool]
    assert [type(x) for x in md["t.arr_u8"]] == [int, int]


def test_empty_and_deeply_nested_arrays(tmp_path):
    empty = raw_kv("e.empty", VT.ARRAY, struct.pack("<IQ", VT.INT32, 0))
    inner = struct.pack("<IQ", VT.UINT8, 1) + b"\x07"
    for _ in range(5):  # [[[[[[7]]]]]]
        inner = struct.pack("<IQ", VT.ARRAY, 1) + inner
    nested = raw_kv("e.nested", VT.ARRAY, inner)
    f = load_bytes(tmp_path / "e.gguf", raw_gguf([empty, nested]))
    assert f.metadata == {"e.empty": [], "e.nested": [[[[[[7]]]]]]}
    assert f.metadata_types == {"e.empty": "ARRAY[INT32]", "e.nested": "ARRAY[ARRAY]"}
    assert f.get_int_array("e.empty") == []


def test_nesting_depth_is_bounded(tmp_path):
    inner = struct.pack("<IQ", VT.UINT8, 0)
    for _ in range(40):
        inner = struct.pack("<IQ", VT.ARRAY, 1) + inner
    expect_error(tmp_path / "n.gguf", raw_gguf([raw_kv("deep", VT.ARRAY, inner)]),
                 "key deep has arrays nested deeper than")


def test_getters(tmp_path):
    path = tmp_path / "g.gguf"
    write_gguf(path, all_types_setup)
    f = GgufFile(str(path))
    for key in ["t.u8", "t.i8", "t.u16", "t.i16", "t.u32", "t.i32", "t.i64"]:
        assert f.get_int(key) == ALL_TYPES_EXPECTED[key][0]
        assert f.get_float(key) == float(ALL_TYPES_EXPECTED[key][0])
    with pytest.raises(ValueError, match="value 18446744073709551615 of key t.u64 does not fit"):
        f.get_int("t.u64")
    assert f.get_float("t.u64") == float(2**64 - 1)
    assert f.get_float("t.f32") == pytest.approx(0.1, rel=1e-7)
    assert f.get_float("t.f64") == math.pi
    with pytest.raises(ValueError, match=r"missing key llama\.block_count$"):
        f.get_int("llama.block_count")
    assert f.get_int("llama.block_count", 30) == 30
    assert f.get_int("t.u8", 3) == 255
    assert f.get_float("nope", 2.5) == 2.5
    with pytest.raises(ValueError, match="key t.str has type STRING, expected an integer"):
        f.get_int("t.str")
    with pytest.raises(ValueError, match="key t.str has type STRING, expected an integer"):
        f.get_int("t.str", 1)  # a default covers a missing key, never a wrong type
    with pytest.raises(ValueError, match="key t.true has type BOOL, expected an integer"):
        f.get_int("t.true")
    with pytest.raises(ValueError, match="key t.f32 has type FLOAT32, expected an integer"):
        f.get_int("t.f32")
    with pytest.raises(ValueError, match=r"key t.arr_i32 has type ARRAY\[INT32\], expected a float"):
        f.get_float("t.arr_i32")
    assert f.get_string("t.str") == "héllo ✓ <|im_start|>"
    assert f.get_string("nope", "dflt") == "dflt"
    with pytest.raises(ValueError, match="key t.u8 has type UINT8, expected STRING"):
        f.get_string("t.u8")
    assert f.get_bool("t.true", False) is True
    assert f.get_bool("t.false", True) is False
    assert f.get_bool("nope", True) is True
    with pytest.raises(ValueError, match="key t.u8 has type UINT8, expected BOOL"):
        f.get_bool("t.u8", True)
    assert f.get_int_array("t.arr_i32") == [1, -2, 3, 2**31 - 1]
    assert f.get_int_array("t.arr_i8") == [-1, 127]
    with pytest.raises(ValueError, match="of key t.arr_u64 does not fit"):
        f.get_int_array("t.arr_u64")
    with pytest.raises(ValueError, match=r"key t.arr_str has type ARRAY\[STRING\], expected an array"):
        f.get_int_array("t.arr_str")
    with pytest.raises(ValueError, match="missing key nope"):
        f.get_int_array("nope")
    assert f.has("t.u8") and not f.has("nope")


def make_tensors(rng):
    """(name, array as written, raw_dtype, ggml type name, logical numpy shape)."""
    out = []

    def add(name, arr, raw, type_name, shape):
        out.append((name, arr, raw, type_name, shape))

    add("f32.matrix", rng.standard_normal((3, 5)).astype(np.float32), None, "F32", (3, 5))
    add("f32.scalar", np.array(1.5, dtype=np.float32), None, "F32", ())
    add("f16.cube", rng.standard_normal((2, 3, 4)).astype(np.float16), None, "F16", (2, 3, 4))
    bf16 = (rng.standard_normal((4, 6)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    add("bf16.matrix", bf16, QT.BF16, "BF16", (4, 6))
    add("i32.vector", np.arange(-3, 4, dtype=np.int32), None, "I32", (7,))
    for qt, shape in [(QT.Q8_0, (2, 64)), (QT.Q4_0, (3, 32)), (QT.Q4_1, (1, 2, 2, 96))]:
        values = rng.standard_normal(shape).astype(np.float32)
        add(f"{qt.name.lower()}.weight", gguf.quants.quantize(values, qt), qt, qt.name, shape)
    # I64 (ggml type 27): index tensors such as a drafter's d2t; values beyond 32 bits survive
    add("i64.vector", np.array([-2**40, -1, 0, 7, 2**40 + 3], dtype=np.int64), None, "I64", (5,))
    return out


@pytest.mark.parametrize("alignment", [None, 1, 64, 256])
def test_tensor_round_trip(tmp_path, alignment):
    path = tmp_path / "t.gguf"
    tensors = make_tensors(np.random.default_rng(0))
    buf = write_gguf(path, tensors=[(n, a, r) for n, a, r, _, _ in tensors], alignment=alignment)
    layout = Layout(buf)
    f = GgufFile(str(path))
    align = alignment or 32
    assert f.alignment == align
    infos = f.tensors
    assert [t["name"] for t in infos] == [t[0] for t in tensors]
    for info, (name, arr, _raw, type_name, shape) in zip(infos, tensors):
        assert info["dtype"] == type_name
        assert info["shape"] == list(reversed(shape))  # ne order: innermost first
        block, unit = gguf.GGML_QUANT_SIZES[QT[type_name]]
        rows = math.prod(shape[:-1]) if shape else 1
        row_len = shape[-1] if shape else 1
        assert info["nbytes"] == row_len // block * unit * rows == arr.nbytes
        assert info["offset"] == layout.tensors[name]["offset"]
        assert info["offset"] % align == 0
        data = f.tensor_data(name)
        assert data.dtype == np.uint8 and data.shape == (arr.nbytes,)
        assert data.tobytes() == arr.tobytes()
        start = layout.data_start + info["offset"]
        assert buf[start:start + arr.nbytes] == arr.tobytes()
    # quantized bytes decode to what the quantizer produced
    q = f.tensor_data("q8_0.weight").reshape(2, 68)
    np.testing.assert_array_equal(gguf.quants.dequantize(q, QT.Q8_0),
                                  gguf.quants.dequantize(tensors[5][1], QT.Q8_0))
    assert f.tensor_data("i64.vector").view(np.int64).tolist() == [-2**40, -1, 0, 7, 2**40 + 3]


def test_tensor_data_is_a_read_only_view_that_keeps_the_file_alive(tmp_path):
    path = tmp_path / "v.gguf"
    arr = np.arange(16, dtype=np.float32)
    write_gguf(path, tensors=[("x", arr, None)])
    f = GgufFile(path)  # os.PathLike works too
    view = f.tensor_data("x")
    assert not view.flags.writeable
    with pytest.raises(ValueError):
        view[0] = 1
    del f
    gc.collect()
    np.testing.assert_array_equal(view.view(np.float32), arr)
    with pytest.raises(KeyError, match="no tensor named 'y'"):
        GgufFile(path).tensor_data("y")


def test_version_2_is_accepted(tmp_path):
    path = tmp_path / "v2.gguf"
    buf = write_gguf(path, tensors=[("x", np.ones(4, np.float32), None)])
    f = load_bytes(path, patch(buf, 4, "<I", 2))
    assert f.version == 2
    assert f.tensor_data("x").view(np.float32).tolist() == [1.0] * 4


def test_smollm2_file_loads():
    path = require_default_model()
    f = GgufFile(path)
    assert f.get_string("general.architecture") == "llama"
    assert f.get_int("llama.block_count") == 30
    assert f.get_int("llama.embedding_length") == 576
    assert f.get_float("llama.rope.freq_base") == 100000.0
    md = f.metadata
    assert len(md["tokenizer.ggml.tokens"]) == 49152
    reader = gguf.GGUFReader(path)  # the reference reader agrees on every tensor
    assert [t["name"] for t in f.tensors] == [t.name for t in reader.tensors]
    for info, ref in zip(f.tensors, reader.tensors):
        assert info["dtype"] == ref.tensor_type.name
        assert info["shape"] == [int(x) for x in ref.shape]
        assert info["nbytes"] == ref.n_bytes
        assert f.tensor_data(info["name"]).tobytes() == ref.data.tobytes()


# ---------------------------------------------------------------------------------------------
# Bad files


def small_setup(w):
    w.add_uint32("s.count", 7)
    w.add_string("s.str", "hello")
    w.add_array("s.arr", ["a", "bc"])
    w.add_key_value("s.dup1", 1, VT.UINT8)
    w.add_key_value("s.dup2", 2, VT.UINT8)
    w.add_bool("s.flag", True)


SMALL_TENSORS = [
    ("blk.0.ffn_down.weight", np.arange(8, dtype=np.float32).reshape(2, 4), None),
    ("blk.0.ffn_up.weight", gguf.quants.quantize(np.linspace(-1, 1, 128, dtype=np.float32)
                                                 .reshape(2, 64), QT.Q8_0), QT.Q8_0),
]


@pytest.fixture
def small(tmp_path):
    """A small valid file: (path to write variants to, its bytes, its layout)."""
    buf = write_gguf(tmp_path / "valid.gguf", small_setup, SMALL_TENSORS)
    GgufFile(str(tmp_path / "valid.gguf"))  # the unpatched file loads
    return tmp_path / "bad.gguf", buf, Layout(buf)


def test_truncated_at_every_byte(small):
    path, buf, layout = small
    last = layout.tensors["blk.0.ffn_up.weight"]
    end = layout.data_start + last["offset"] + 2 * 68  # the last byte any tensor uses
    assert layout.infos_end % 32 != 0  # so some cuts fall in the padding before the data
    for n in range(end):
        expect_error(path, buf[:n])
    assert load_bytes(path, buf[:end]).tensor_data("blk.0.ffn_up.weight").nbytes == 136


def test_truncation_messages(small):
    path, buf, layout = small
    expect_error(path, b"", "file is empty")
    expect_error(path, buf[:10], "truncated file", "the header")
    expect_error(path, buf[:100], "header claims 7 metadata entries, more than the 76 bytes",
                 "truncated or corrupt")
    one_key = raw_gguf([raw_kv("k.count", VT.UINT32, struct.pack("<I", 7))], alignment=1)
    expect_error(path, one_key[:-2], "truncated file: value of key k.count needs 4 bytes")
    name_at = layout.tensors["blk.0.ffn_up.weight"]["name_at"]
    expect_error(path, buf[:name_at + 12], "tensor info #1", "beyond the end of the file")
    expect_error(path, buf[:layout.infos_end + 1], "data section starts at")
    expect_error(path, buf[:layout.data_start + 40],
                 "data of tensor blk.0.ffn_up.weight", "lies outside the file")


def test_not_a_file(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        GgufFile(str(tmp_path))
    missing = str(tmp_path / "nowhere.gguf")
    with pytest.raises(ValueError, match="^" + re.escape(missing) + ": cannot open GGUF file: No such"):
        GgufFile(missing)


def test_bad_magic(small):
    path, buf, _ = small
    expect_error(path, b"GGML" + buf[4:], "not a GGUF file: bad magic 0x4c4d4747")
    expect_error(path, b"GG", "truncated file", "magic")


@pytest.mark.parametrize("version,fragment", [
    (1, "GGUF version 1 is not supported"),
    (0, "unsupported GGUF version 0"),
    (4, "unsupported GGUF version 4"),
    (0x03000000, "big-endian GGUF files are not supported"),
])
def test_bad_version(small, version, fragment):
    path, buf, _ = small
    expect_error(path, patch(buf, 4, "<I", version), fragment)


@pytest.mark.parametrize("length", [10_000, 2**63, 2**64 - 1])
def test_string_length_beyond_the_file(small, length):
    path, buf, layout = small
    at = layout.kv["s.str"]["value_at"]
    expect_error(path, patch(buf, at, "<Q", length), f"string of key s.str has length {length}",
                 "beyond the end of the file")
    expect_error(path, patch(buf, layout.kv["s.str"]["key_at"], "<Q", length),
                 "key of metadata entry #", "beyond the end of the file")
    name_at = layout.tensors["blk.0.ffn_up.weight"]["name_at"]
    expect_error(path, patch(buf, name_at, "<Q", length), "name of tensor info #1",
                 "beyond the end of the file")


@pytest.mark.parametrize("count", [1000, 2**63, 2**64 - 1])
def test_huge_array_count(small, count):
    path, buf, layout = small
    at = layout.kv["s.arr"]["value_at"] + 4
    expect_error(path, patch(buf, at, "<Q", count),
                 f"key s.arr has an array of {count} STRING values, more than")


@pytest.mark.parametrize("field,name", [(8, "tensors"), (16, "metadata entries")])
def test_huge_header_counts(small, field, name):
    path, buf, _ = small
    expect_error(path, patch(buf, field, "<Q", 2**62), f"header claims {2**62} {name}")


def test_bad_value_types(small):
    path, buf, layout = small
    expect_error(path, patch(buf, layout.kv["s.count"]["type_at"], "<I", 13),
                 "key s.count has unknown value type 13")
    expect_error(path, patch(buf, layout.kv["s.arr"]["value_at"], "<I", 99),
                 "key s.arr has unknown value type 99")
    expect_error(path, patch(buf, layout.kv["s.flag"]["value_at"], "<B", 2),
                 "key s.flag has invalid bool value 2")
    expect_error(path, patch(buf, layout.kv["s.count"]["key_at"], "<Q", 0),
                 "metadata entry #", "has an empty key")


def test_duplicate_metadata_key(small):
    path, buf, layout = small
    at = layout.kv["s.dup2"]["key_at"] + 8
    expect_error(path, buf[:at] + b"s.dup1" + buf[at + 6:], "duplicate metadata key s.dup1")


def test_duplicate_tensor_name(tmp_path):
    path = tmp_path / "d.gguf"
    buf = write_gguf(path, tensors=[("a.weight", np.ones(4, np.float32), None),
                                    ("b.weight", np.ones(4, np.float32), None)])
    at = Layout(buf).tensors["b.weight"]["name_at"] + 8
    expect_error(path, buf[:at] + b"a" + buf[at + 1:], "duplicate tensor name a.weight")


def test_tensor_offset_outside_the_file(small):
    path, buf, layout = small
    t = layout.tensors["blk.0.ffn_down.weight"]
    for offset in [align_up(len(buf), 32), 2**64 - 32]:
        expect_error(path, patch(buf, t["offset_at"], "<Q", offset),
                     "data of tensor blk.0.ffn_down.weight", f"at data offset {offset}",
                     "lies outside the file")


def test_tensor_offset_misaligned(small):
    path, buf, layout = small
    t = layout.tensors["blk.0.ffn_up.weight"]
    expect_error(path, patch(buf, t["offset_at"], "<Q", t["offset"] + 4),
                 f"tensor blk.0.ffn_up.weight has offset {t['offset'] + 4}, "
                 "not a multiple of the alignment 32")


@pytest.mark.parametrize("type_id", [QT.Q5_K, QT.Q4_K, QT.Q6_K, QT.Q5_0, QT.I8, QT.I16, QT.F64])
def test_unsupported_tensor_type(small, type_id):
    path, buf, layout = small
    at = layout.tensors["blk.0.ffn_down.weight"]["type_at"]
    expect_error(path, patch(buf, at, "<I", type_id),
                 f"unsupported tensor type {type_id.name} for tensor blk.0.ffn_down.weight")


def test_unknown_tensor_type(small):
    path, buf, layout = small
    at = layout.tensors["blk.0.ffn_down.weight"]["type_at"]
    expect_error(path, patch(buf, at, "<I", 77),
                 "unknown tensor type 77 for tensor blk.0.ffn_down.weight")


def test_too_many_dims(small):
    path, buf, layout = small
    at = layout.tensors["blk.0.ffn_down.weight"]["n_dims_at"]
    expect_error(path, patch(buf, at, "<I", 5),
                 "tensor blk.0.ffn_down.weight has 5 dimensions, at most 4")


def test_zero_dims_is_a_scalar(tmp_path):
    info = raw_info("s", [], 0, 0)
    f = load_bytes(tmp_path / "s.gguf", raw_gguf(infos=[info], data=struct.pack("<f", 2.0)))
    assert f.tensors == [{"name": "s", "dtype": "F32", "shape": [], "offset": 0, "nbytes": 4}]


@pytest.mark.parametrize("ne,type_id,fragment", [
    ([2**32, 2**32], 0, "overflow a 64-bit element count"),
    ([2**62], 0, "byte size of tensor t overflows"),
    ([2**40, 2**40, 2**40, 2**40], 1, "overflow a 64-bit element count"),
    ([2**61, 2], 0, "byte size of tensor t overflows"),
    ([4, -1], 0, "dimension 1 of tensor t is negative (-1)"),
    ([48, 2], 8, "row length 48 of tensor t is not a multiple of the block size 32 of Q8_0"),
    ([16], 3, "row length 16 of tensor t is not a multiple of the block size 32 of Q4_1"),
])
def test_bad_dims(tmp_path, ne, type_id, fragment):
    data = raw_gguf(infos=[raw_info("t", ne, type_id, 0)], data=b"\0" * 64)
    expect_error(tmp_path / "d.gguf", data, fragment)


def test_dims_patched_in_a_written_file(small):
    path, buf, layout = small
    t = layout.tensors["blk.0.ffn_up.weight"]
    assert t["ne"] == [64, 2]
    expect_error(path, patch(buf, t["dims_at"], "<q", 33), "row length 33", "block size 32")
    expect_error(path, patch(buf, t["dims_at"] + 8, "<q", 3), "data of tensor blk.0.ffn_up.weight",
                 "lies outside the file")


@pytest.mark.parametrize("value", [0, 3, 48, 2**31 + 1])
def test_bad_alignment_value(tmp_path, value):
    path = tmp_path / "a.gguf"
    buf = write_gguf(path, tensors=[("x", np.ones(4, np.float32), None)], alignment=64)
    at = Layout(buf).kv["general.alignment"]["value_at"]
    expect_error(path, patch(buf, at, "<I", value),
                 f"general.alignment must be a nonzero power of two, got {value}")


def test_alignment_of_the_wrong_type(tmp_path):
    path = tmp_path / "a.gguf"
    write_gguf(path, lambda w: w.add_key_value("general.alignment", "64", VT.STRING))
    with pytest.raises(ValueError, match="key general.alignment has type STRING, expected an integer"):
        GgufFile(str(path))
    negative = raw_kv("general.alignment", VT.INT32, struct.pack("<i", -32))
    expect_error(path, raw_gguf([negative]), "must be a nonzero power of two, got -32")


def test_every_header_word_saturated_or_zeroed(small):
    """Overwrite each 8-byte window before the data with all-ones or zeros: load or ValueError."""
    path, buf, layout = small
    loaded = 0
    for at in range(0, layout.data_start - 8):
        for word in (b"\xff" * 8, b"\0" * 8):
            try:
                load_bytes(path, buf[:at] + word + buf[at + 8:])
                loaded += 1
            except ValueError as e:
                assert str(e).startswith(str(path) + ": ")
    assert loaded > 0  # some windows only touch values, which stay valid


# ---------------------------------------------------------------------------------------------
# Fuzzing


@pytest.fixture(scope="module")
def fuzz_base(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    buf = write_gguf(d / "base.gguf", small_setup, SMALL_TENSORS)
    return d / "mutant.gguf", buf, Layout(buf)


def exercise(f):
    """Touch everything a loaded file exposes; every tensor view must lie inside the file."""
    md, _types = f.metadata, f.metadata_types
    for key in md:
        for getter in (f.get_int, f.get_float, f.get_string, f.get_int_array):
            try:
                getter(key)
            except ValueError:
                pass
    for t in f.tensors:
        data = f.tensor_data(t["name"])
        assert data.nbytes == t["nbytes"] <= f.file_size
        int(data.sum())


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_fuzz_random_mutations(fuzz_base, data):
    path, buf, layout = fuzz_base
    # Most mutations land in the header, where the parser makes its decisions.
    position = st.one_of(st.integers(0, layout.data_start - 1), st.integers(0, len(buf) - 1))
    mutations = data.draw(st.lists(st.tuples(position, st.integers(0, 255)), min_size=1,
                                   max_size=8))
    mutant = bytearray(buf)
    for at, value in mutations:
        mutant[at] = value
    cut = data.draw(st.one_of(st.just(len(buf)), st.integers(0, len(buf))))
    try:
        f = load_bytes(path, bytes(mutant[:cut]))
    except ValueError as e:
        assert str(e).startswith(str(path) + ": ")
        return
    exercise(f)
