"""Tiny random-weight llama / qwen3 models written as GGUF with llama.cpp's key and tensor names.

`write_tiny_model` returns the weights exactly as the file stores them (dequantized with
gguf.quants), so tests/numpy_reference.py computes what the engine should compute from the very
same numbers; quantization error in the weights is then not part of any tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

WEIGHT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
ARCHS = ("llama", "qwen3")

# Small but not degenerate: GQA (2 query heads per kv head), dims multiples of 32 so every
# matrix can be block-quantized, qwen3 with head_dim != n_embd / n_head.
_DEFAULTS = {
    "llama": dict(n_vocab=128, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=16,
                  n_ff=96, n_ctx_train=256, rope_freq_base=10000.0, rms_eps=1e-5),
    "qwen3": dict(n_vocab=128, n_embd=64, n_layer=3, n_head=4, n_head_kv=2, head_dim=32,
                  n_ff=128, n_ctx_train=256, rope_freq_base=1000000.0, rms_eps=1e-6),
}


@dataclass
class TinyModel:
    path: Path
    arch: str
    weight_type: str
    tied: bool
    hparams: dict
    # name -> float64 array; matrices are [out_features, in_features] (numpy view of GGUF's
    # [ne0 = in, ne1 = out]); token_embd is [n_vocab, n_embd]; "output.weight" is present even when
    # tied (then it is token_embd), so the reference never needs to know.
    weights: dict = field(default_factory=dict)


def _store(writer: gguf.GGUFWriter, name: str, w: np.ndarray, qtype: gguf.GGMLQuantizationType):
    """Write `w` as `qtype` and return what the file now holds, dequantized to float64."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, w)
        return w.astype(np.float64)
    data = gguf.quants.quantize(w, qtype)
    writer.add_tensor(name, data, raw_dtype=qtype)
    back = gguf.quants.dequantize(data, qtype)
    assert back.shape == w.shape, (name, back.shape, w.shape)
    return back.astype(np.float64)


def write_tiny_model(path, arch="llama", weight_type="F32", seed=0, tied=True,
                     write_key_length=None, **hparams) -> TinyModel:
    """Write a tiny model to `path` and return its hyperparameters and stored weights.

    hparams override _DEFAULTS[arch]: n_vocab, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff,
    n_ctx_train, rope_freq_base, rms_eps. `write_key_length` (default: only for qwen3 or when
    head_dim != n_embd / n_head) writes attention.key_length / value_length.
    """
    if arch not in _DEFAULTS:
        raise ValueError(f"unknown tiny-model architecture {arch!r}")
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"unknown weight type {weight_type!r}")
    hp = dict(_DEFAULTS[arch])
    unknown = set(hparams) - set(hp)
    if unknown:
        raise ValueError(f"unknown hparams {sorted(unknown)}")
    hp.update(hparams)
    if "head_dim" not in hparams and arch == "llama":
        hp["head_dim"] = hp["n_embd"] // hp["n_head"]
    if write_key_length is None:
        write_key_length = arch == "qwen3" or hp["head_dim"] * hp["n_head"] != hp["n_embd"]
    hp["arch"] = arch

    path = Path(path)
    qtype = gguf.GGMLQuantizationType[weight_type]
    rng = np.random.default_rng(seed)
    n_embd, n_ff, hd = hp["n_embd"], hp["n_ff"], hp["head_dim"]
    n_q, n_kv = hp["n_head"] * hd, hp["n_head_kv"] * hd

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}-{weight_type}")
    w.add_block_count(hp["n_layer"])
    w.add_context_length(hp["n_ctx_train"])
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(hp["n_head"])
    w.add_head_count_kv(hp["n_head_kv"])
    w.add_rope_freq_base(hp["rope_freq_base"])
    w.add_layer_norm_rms_eps(hp["rms_eps"])
    w.add_rope_dimension_count(hd)
    if write_key_length:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_vocab_size(hp["n_vocab"])
    w.add_file_type({"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32}[weight_type])

    def mat(n_out, n_in, std):
        return rng.standard_normal((n_out, n_in)) * std

    def norm(n):
        return 1.0 + 0.1 * rng.standard_normal(n)

    f32 = gguf.GGMLQuantizationType.F32
    weights = {}
    # Embedding rows of norm ~4 and a tied output giving logits with std of a few units: the
    # softmax is neither flat nor one-hot.
    weights["token_embd.weight"] = _store(w, "token_embd.weight",
                                          mat(hp["n_vocab"], n_embd, 0.5), qtype)
    for il in range(hp["n_layer"]):
        p = f"blk.{il}."
        weights[p + "attn_norm.weight"] = _store(w, p + "attn_norm.weight", norm(n_embd), f32)
        weights[p + "attn_q.weight"] = _store(w, p + "attn_q.weight", mat(n_q, n_embd, 0.15), qtype)
        weights[p + "attn_k.weight"] = _store(w, p + "attn_k.weight", mat(n_kv, n_embd, 0.15), qtype)
        weights[p + "attn_v.weight"] = _store(w, p + "attn_v.weight", mat(n_kv, n_embd, 0.15), qtype)
        weights[p + "attn_output.weight"] = _store(w, p + "attn_output.weight",
                                                   mat(n_embd, n_q, 0.1), qtype)
        if arch == "qwen3":
            weights[p + "attn_q_norm.weight"] = _store(w, p + "attn_q_norm.weight", norm(hd), f32)
            weights[p + "attn_k_norm.weight"] = _store(w, p + "attn_k_norm.weight", norm(hd), f32)
        weights[p + "ffn_norm.weight"] = _store(w, p + "ffn_norm.weight", norm(n_embd), f32)
        weights[p + "ffn_gate.weight"] = _store(w, p + "ffn_gate.weight", mat(n_ff, n_embd, 0.15), qtype)
        weights[p + "ffn_up.weight"] = _store(w, p + "ffn_up.weight", mat(n_ff, n_embd, 0.15), qtype)
        weights[p + "ffn_down.weight"] = _store(w, p + "ffn_down.weight", mat(n_embd, n_ff, 0.1), qtype)
    weights["output_norm.weight"] = _store(w, "output_norm.weight", norm(n_embd), f32)
    if tied:
        weights["output.weight"] = weights["token_embd.weight"]
    else:
        weights["output.weight"] = _store(w, "output.weight", mat(hp["n_vocab"], n_embd, 0.5), qtype)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return TinyModel(path=path, arch=arch, weight_type=weight_type, tied=tied, hparams=hp,
                     weights=weights)


def write_unknown_arch_model(path, arch_name="mamba7"):
    """A well-formed GGUF whose general.architecture no engine knows."""
    w = gguf.GGUFWriter(str(path), arch_name)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_vocab_size(32)
    w.add_tensor("token_embd.weight", np.zeros((32, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
