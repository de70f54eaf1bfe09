"""Reading a Hugging Face checkpoint directory: config.json and the safetensors weights (one file
or shards listed by model.safetensors.index.json), without torch.

Tensors are read lazily, one at a time, so converting a large model never holds more than one
tensor in memory. numpy has no bfloat16, so BF16 tensors (the usual storage type of published
checkpoints) are read as raw 16-bit words and widened to float32 here.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
from safetensors import safe_open

from .errors import ConversionError

INDEX_NAME = "model.safetensors.index.json"


def read_json(path: Path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConversionError(f"{what} {path} is not valid JSON: {e}") from None


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConversionError(f"no config.json in {model_dir}: not a Hugging Face model directory")
    config = read_json(path, "config")
    if not isinstance(config, dict):
        raise ConversionError(f"{path} does not hold a JSON object")
    return config


def architecture_of(config: dict, model_dir: Path) -> str:
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ConversionError(f"{model_dir / 'config.json'} has no 'architectures' list naming the "
                              "model class")
    return archs[0]


def natural_key(name: str) -> Tuple:
    """Sort key that orders layers.2 before layers.10."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


@dataclass(frozen=True)
class TensorRef:
    name: str
    file: Path
    dtype: str          # safetensors dtype name: F32, F16, BF16, I64, ...
    shape: Tuple[int, ...]


class Checkpoint:
    """The weights of one Hugging Face model directory: the index's shards, else every
    *.safetensors file except those named in `exclude` (side files such as a mask embedding);
    or exactly `files`."""

    def __init__(self, model_dir: Path, files: Optional[List[Path]] = None,
                 exclude: Tuple[str, ...] = ()):
        self.dir = model_dir
        self.tensors: Dict[str, TensorRef] = {}
        files = self._weight_files(exclude) if files is None else files
        for file in files:
            with safe_open(str(file), framework="np") as f:
                for name in f.keys():
                    if name in self.tensors:
                        raise ConversionError(f"tensor {name} appears in both "
                                              f"{self.tensors[name].file.name} and {file.name}")
                    sl = f.get_slice(name)
                    self.tensors[name] = TensorRef(name, file, sl.get_dtype(),
                                                   tuple(int(d) for d in sl.get_shape()))
        self._offsets: Dict[Path, Tuple[int, dict]] = {}

    def _weight_files(self, exclude: Tuple[str, ...]) -> List[Path]:
        index = self.dir / INDEX_NAME
        if index.is_file():
            weight_map = read_json(index, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConversionError(f"{index} has no 'weight_map'")
            files = []
            for shard in sorted(set(weight_map.values()), key=natural_key):
                path = self.dir / shard
                if not path.is_file():
                    raise ConversionError(f"{index.name} names the shard {shard}, which is "
                                          f"missing from {self.dir}")
                files.append(path)
            return files
        files = sorted((p for p in self.dir.glob("*.safetensors") if p.name not in exclude),
                       key=lambda p: natural_key(p.name))
        if not files:
            has_bin = any(self.dir.glob("*.bin")) or any(self.dir.glob("*.pt"))
            hint = (" (PyTorch .bin/.pt weights are not supported: save the model with "
                    "safe_serialization=True)") if has_bin else ""
            raise ConversionError(f"no model weights (*.safetensors) in {self.dir}{hint}")
        return files

    def names(self) -> List[str]:
        return sorted(self.tensors, key=natural_key)

    def shape(self, name: str) -> Tuple[int, ...]:
        return self.tensors[name].shape

    def load(self, name: str) -> np.ndarray:
        """The tensor as float32 (floating types) or int64 (integer types)."""
        ref = self.tensors[name]
        if ref.dtype == "BF16":
            words = self._raw(ref, np.uint16)
            return (words.astype(np.uint32) << 16).view(np.float32)
        with safe_open(str(ref.file), framework="np") as f:
            arr = f.get_tensor(name)
        if arr.dtype.kind == "f":
            return arr.astype(np.float32)
        if arr.dtype.kind in "iub":
            return arr.astype(np.int64)
        raise ConversionError(f"tensor {name} has unsupported type {ref.dtype}")

    def _raw(self, ref: TensorRef, dtype) -> np.ndarray:
        """Read a tensor's bytes straight from the file (for types numpy cannot name)."""
        if ref.file not in self._offsets:
            with open(ref.file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                self._offsets[ref.file] = (8 + n, json.loads(f.read(n)))
        base, header = self._offsets[ref.file]
        begin, end = header[ref.name]["data_offsets"]
        data = np.fromfile(ref.file, dtype=np.uint8, count=end - begin, offset=base + begin)
        return data.view(dtype).reshape(ref.shape)
