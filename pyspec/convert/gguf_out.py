"""What a conversion writes (a `Plan`: metadata plus tensors that load on demand) and the writer
that turns a plan into a GGUF file: the per-tensor type policy, quantization, progress and the
closing summary.

Type policy (llama.cpp's): 1-D tensors and norms stay F32; integer tensors keep their type; every
other tensor takes the output type, except that a block-quantized type needs rows whose length is a
multiple of its block size (32), and tensors with other row lengths fall back to F16.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import gguf
import numpy as np
from tqdm import tqdm

from .errors import ConversionError

Q = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType

# --outtype name -> (tensor type, general.file_type)
OUTTYPES: Dict[str, Tuple[Q, int]] = {
    "f32": (Q.F32, int(gguf.LlamaFileType.ALL_F32)),
    "f16": (Q.F16, int(gguf.LlamaFileType.MOSTLY_F16)),
    "bf16": (Q.BF16, int(gguf.LlamaFileType.MOSTLY_BF16)),
    "q8_0": (Q.Q8_0, int(gguf.LlamaFileType.MOSTLY_Q8_0)),
    "q4_0": (Q.Q4_0, int(gguf.LlamaFileType.MOSTLY_Q4_0)),
    "q4_1": (Q.Q4_1, int(gguf.LlamaFileType.MOSTLY_Q4_1)),
}
BLOCK_QUANTIZED = (Q.Q8_0, Q.Q4_0, Q.Q4_1)


@dataclass
class Tensor:
    name: str                              # GGUF name
    shape: Tuple[int, ...]                 # numpy order: [..., rows, row length]
    load: Callable[[], np.ndarray]         # returns float32 (or int64 for kind "i64") data
    kind: str = "weight"                   # "weight" follows --outtype; "f32": always F32; "i64"
    source: str = ""                       # where it came from, for messages


@dataclass
class Plan:
    arch: str
    name: str
    kv: List[Tuple[str, Any, VT, Optional[VT]]] = field(default_factory=list)
    tensors: List[Tensor] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)   # facts for the summary (e.g. what was dropped)

    def set(self, key: str, value: Any, vtype: VT, sub_type: Optional[VT] = None) -> None:
        self.kv = [e for e in self.kv if e[0] != key]
        self.kv.append((key, value, vtype, sub_type))

    def u32(self, key: str, value: int) -> None:
        value = int(value)
        if not 0 <= value < 2 ** 32:
            raise ConversionError(f"{key} = {value} does not fit an unsigned 32-bit value")
        self.set(key, value, VT.UINT32)

    def f32(self, key: str, value: float) -> None:
        self.set(key, float(value), VT.FLOAT32)

    def boolean(self, key: str, value: bool) -> None:
        self.set(key, bool(value), VT.BOOL)

    def string(self, key: str, value: str) -> None:
        self.set(key, value, VT.STRING)

    def i32_array(self, key: str, values) -> None:
        self.set(key, [int(v) for v in values], VT.ARRAY, VT.INT32)

    def str_array(self, key: str, values) -> None:
        self.set(key, list(values), VT.ARRAY, VT.STRING)

    def bool_array(self, key: str, values) -> None:
        self.set(key, [bool(v) for v in values], VT.ARRAY, VT.BOOL)

    def add(self, tensor: Tensor) -> None:
        if any(t.name == tensor.name for t in self.tensors):
            raise ConversionError(f"two tensors map to {tensor.name}")
        self.tensors.append(tensor)


def tensor_type(t: Tensor, outtype: Q) -> Q:
    if t.kind == "i64":
        return Q.I64
    if t.kind == "f32" or len(t.shape) == 1:
        return Q.F32
    if outtype in BLOCK_QUANTIZED and t.shape[-1] % gguf.GGML_QUANT_SIZES[outtype][0] != 0:
        return Q.F16
    return outtype


def tensor_nbytes(shape: Tuple[int, ...], qtype: Q) -> int:
    if qtype == Q.I64:
        return 8 * int(np.prod(shape))
    return int(np.prod(gguf.quants.quant_shape_to_byte_shape(shape, qtype)))


def encode(data: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.I64:
        return np.ascontiguousarray(data, dtype=np.int64)
    return np.ascontiguousarray(gguf.quants.quantize(np.asarray(data, dtype=np.float32), qtype))


@dataclass
class Summary:
    path: Path
    arch: str
    outtype: str
    n_tensors: int
    n_params: int
    n_bytes: int
    type_counts: Dict[str, int]
    notes: List[str]

    def format(self) -> str:
        types = ", ".join(f"{n} {t}" for t, n in sorted(self.type_counts.items()))
        lines = [f"wrote {self.path}",
                 f"  architecture {self.arch}, outtype {self.outtype}",
                 f"  {self.n_tensors} tensors ({types}), {self.n_params / 1e6:.2f}M parameters",
                 f"  {self.n_bytes / 2**20:.2f} MiB"]
        lines += [f"  {n}" for n in self.notes]
        return "\n".join(lines)


def write(plan: Plan, outfile: Path, outtype: str, progress: bool = True) -> Summary:
    """Write `plan` to `outfile` through a temporary file, so a failed conversion leaves nothing
    that looks like a model behind."""
    qtype, file_type = OUTTYPES[outtype]
    types = [tensor_type(t, qtype) for t in plan.tensors]
    sizes = [tensor_nbytes(t.shape, q) for t, q in zip(plan.tensors, types)]

    outfile.parent.mkdir(parents=True, exist_ok=True)
    part = outfile.with_name(outfile.name + ".part")
    writer = gguf.GGUFWriter(str(part), plan.arch)
    writer.add_string("general.type", "model")
    writer.add_string("general.name", plan.name)
    for key, value, vtype, sub_type in plan.kv:
        writer.add_key_value(key, value, vtype, sub_type)
    writer.add_uint32("general.file_type", file_type)
    writer.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
    for t, q, n in zip(plan.tensors, types, sizes):
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), n, raw_dtype=q)

    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with tqdm(total=sum(sizes), unit="B", unit_scale=True, unit_divisor=1024,
                  desc=outfile.name, disable=not progress, leave=False) as bar:
            for t, q in zip(plan.tensors, types):
                data = t.load()
                if tuple(data.shape) != tuple(t.shape):
                    raise ConversionError(f"tensor {t.name} ({t.source}) came out with shape "
                                          f"{tuple(data.shape)}, expected {tuple(t.shape)}")
                out = encode(data, q)
                writer.write_tensor_data(out)
                bar.set_postfix_str(t.name, refresh=False)
                bar.update(out.nbytes)
        writer.close()
        os.replace(part, outfile)
    except BaseException:
        writer.close()
        part.unlink(missing_ok=True)
        raise

    counts = Counter(q.name for q in types)
    n_params = sum(int(np.prod(t.shape)) for t in plan.tensors)
    return Summary(outfile, plan.arch, outtype, len(plan.tensors), n_params,
                   outfile.stat().st_size, dict(counts), list(plan.notes))
