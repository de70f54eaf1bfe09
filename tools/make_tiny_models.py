#!/usr/bin/env python3
"""Tiny random-weight Hugging Face checkpoints for tests: config.json + safetensors (+ tokenizer),
written with numpy, reproducible from a seed, made in well under a second.

    make_tokenizer(dir, style)                 byte-level BPE trained with `tokenizers`
    make_target(dir, "llama" | "qwen3", ...)   LlamaForCausalLM / Qwen3ForCausalLM
    make_drafter(dir, target, kind, ...)       DFlash ("dflash"), DeepSpec-style DSpark ("dspark"),
                                               speculators-style DSpark ("speculators")
    write_mask_embedding(dir, ...)             a trained mask-token embedding file for a drafter

Every function returns a TinyCheckpoint whose `weights` are float32 copies of exactly what the
files hold (after rounding to the storage dtype), keyed by the Hugging Face tensor names, so a
reference computed from them needs no knowledge of the storage type.

Command line: python tools/make_tiny_models.py OUT_DIR [--seed N] writes one of each.
"""

from __future__ import annotations

import argparse
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
from safetensors.numpy import save_file

# Hugging Face spellings of the split rules of well-known tokenizers.
_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
LLAMA3_REGEX = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")

# A fixed training text: letters, digits, punctuation, newlines and runs of spaces, so that the
# merges exercise every branch of the split rules.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and we'll see 12345 dogs!",
    "Speculative decoding drafts a block of tokens and the target verifies them in one pass.",
    "def add(a, b):\n    return a + b\n\nprint(add(3, 4))  # 7\n",
    "Hello, world! Hello again; hello once more... 3.14159 is pi, 2.71828 is e.",
    "She said: \"they're here\" -- and I'd agree; you've seen it, haven't you?",
    "<think> step one, step two, step three </think> The answer is 42.",
    "Tiny models for tests: hidden 64, two layers, a vocabulary of about three hundred tokens.",
    "   indented line\n\ttabbed line\r\nwindows line end\n\n\nmany blank lines",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 10000 and words alpha beta gamma delta epsilon.",
    "café naïve résumé — unicode letters and ümlauts, 東京 and Привет.",
] * 4

# style -> (special tokens, bos, eos, pad)
_TOKENIZER_STYLES = {
    "llama-bpe": (["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>",
                   "<|mask|>"], "<|begin_of_text|>", "<|end_of_text|>", None),
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"], None, "<|im_end|>",
              "<|endoftext|>"),
    "smollm": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_start|>", "<|im_end|>",
               "<|im_end|>"),
    "gpt-2": (["<|endoftext|>"], "<|endoftext|>", "<|endoftext|>", None),
    # A pre-tokenizer llama.cpp has no rule for: the converter must warn and fall back.
    "whitespace": (["<|endoftext|>"], None, "<|endoftext|>", None),
}
TOKENIZER_STYLES = tuple(_TOKENIZER_STYLES)
USER_TOKEN = "<think>"  # an added, non-special token (llama.cpp type USER_DEFINED)


@dataclass
class TinyCheckpoint:
    path: Path
    config: dict
    weights: Dict[str, np.ndarray] = field(default_factory=dict)   # HF name -> float32 as stored
    n_vocab: int = 0                                                # tokens (targets)


def _pre_tokenizer(style: str):
    from tokenizers import Regex, pre_tokenizers as pt
    if style == "llama-bpe":
        return pt.Sequence([pt.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
                            pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    if style == "qwen2":
        return pt.Sequence([pt.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
                            pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    if style == "smollm":
        return pt.Sequence([pt.Digits(individual_digits=True),
                            pt.ByteLevel(add_prefix_space=False, use_regex=True)])
    if style == "gpt-2":
        return pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if style == "whitespace":
        return pt.Sequence([pt.WhitespaceSplit(), pt.ByteLevel(add_prefix_space=False,
                                                               use_regex=False)])
    raise ValueError(f"unknown tokenizer style {style!r} (one of {TOKENIZER_STYLES})")


def make_tokenizer(out_dir, style: str = "llama-bpe", vocab_size: int = 300) -> int:
    """Train a byte-level BPE tokenizer on CORPUS and write tokenizer.json and
    tokenizer_config.json into out_dir. Returns the number of tokens (vocab_size plus one added
    non-special token). Deterministic: the trainer's result depends only on the corpus."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors, trainers
    from tokenizers.pre_tokenizers import ByteLevel

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specials, bos, eos, pad = _TOKENIZER_STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer(style)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, min_frequency=1,
                                  initial_alphabet=ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken(USER_TOKEN, special=False, normalized=False)])
    if style == "llama-bpe":
        # Llama 3 adds BOS through its post-processor, not through tokenizer_config.json.
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(out_dir / "tokenizer.json"))

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256,
              "bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": None,
              "clean_up_tokenization_spaces": False, "chat_template": CHATML_TEMPLATE}
    if style != "llama-bpe":
        config["add_bos_token"] = False
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return tok.get_vocab_size(with_added_tokens=True)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even); returns the 16-bit words."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _save_safetensors(path: Path, tensors: Dict[str, np.ndarray], dtype: str) -> Dict[str, np.ndarray]:
    """Write tensors (float arrays stored as `dtype`, integer/bool arrays as they are) and return
    float32 copies of the stored float values."""
    stored = {}
    if dtype == "bfloat16":
        # numpy has no bfloat16, so the safetensors package cannot write it: write the format's
        # header (JSON with dtype, shape and byte offsets) ourselves.
        header, blobs, offset = {}, [], 0
        for name, arr in tensors.items():
            if arr.dtype.kind == "f":
                words = to_bf16(arr)
                stored[name] = (words.astype(np.uint32) << 16).view(np.float32)
                blob, st_dtype = words.tobytes(), "BF16"
            else:
                blob = np.ascontiguousarray(arr).tobytes()
                st_dtype = {"i": "I64", "b": "BOOL"}[arr.dtype.kind]
            header[name] = {"dtype": st_dtype, "shape": list(arr.shape),
                            "data_offsets": [offset, offset + len(blob)]}
            blobs.append(blob)
            offset += len(blob)
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
        return stored
    np_dtype = {"float32": np.float32, "float16": np.float16}[dtype]
    out = {}
    for name, arr in tensors.items():
        out[name] = np.ascontiguousarray(arr.astype(np_dtype) if arr.dtype.kind == "f" else arr)
        if arr.dtype.kind == "f":
            stored[name] = out[name].astype(np.float32)
    save_file(out, str(path), metadata={"format": "pt"})
    return stored


def _write_weights(out_dir: Path, tensors: Dict[str, np.ndarray], dtype: str,
                   shards: int) -> Dict[str, np.ndarray]:
    names = list(tensors)
    if shards <= 1:
        return _save_safetensors(out_dir / "model.safetensors", tensors, dtype)
    stored, weight_map, total = {}, {}, 0
    per = -(-len(names) // shards)
    for i in range(shards):
        part = names[i * per:(i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        stored.update(_save_safetensors(out_dir / fname, {n: tensors[n] for n in part}, dtype))
        for n in part:
            weight_map[n] = fname
            total += tensors[n].nbytes
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return stored


_TARGETS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=True, hidden_act="silu",
                  attention_bias=False, mlp_bias=False),
    # head_dim 32 != hidden / heads; intermediate 80 is not a multiple of the quantization block,
    # so ffn_down (rows of 80) exercises the converter's F16 fallback.
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64,
                  intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                  hidden_act="silu", attention_bias=False),
}
_TOKENIZER_OF = {"llama": "llama-bpe", "qwen3": "qwen2"}


def make_target(out_dir, arch: str = "llama", seed: int = 0, dtype: str = "float32",
                shards: int = 1, tokenizer: Optional[str] = None, vocab_pad: Optional[int] = None,
                **overrides) -> TinyCheckpoint:
    """A tiny LlamaForCausalLM or Qwen3ForCausalLM with its tokenizer. vocab_pad: extra unused
    embedding rows beyond the tokenizer (default 0 for llama, up to a multiple of 64 for qwen3,
    as Qwen pads its embedding). overrides replace config.json entries."""
    if arch not in _TARGETS:
        raise ValueError(f"unknown tiny target {arch!r} (llama or qwen3)")
    out_dir = Path(out_dir)
    n_tok = make_tokenizer(out_dir, tokenizer or _TOKENIZER_OF[arch])
    cfg = dict(_TARGETS[arch])
    cfg.update(overrides)
    if vocab_pad is None:
        vocab_pad = 0 if arch == "llama" else -n_tok % 64
    n_vocab = n_tok + vocab_pad
    e, f, nl = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or e // cfg["num_attention_heads"]
    nq, nkv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    special = json.loads((out_dir / "tokenizer.json").read_text())["added_tokens"]
    ids = {a["content"]: a["id"] for a in special}
    cfg.update(vocab_size=n_vocab, torch_dtype=dtype,
               bos_token_id=ids.get("<|begin_of_text|>", ids.get("<|endoftext|>")),
               eos_token_id=ids.get("<|end_of_text|>", ids.get("<|im_end|>")))

    rng = np.random.default_rng(seed)

    def mat(rows, cols, std):
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t: Dict[str, np.ndarray] = {"model.embed_tokens.weight": mat(n_vocab, e, 0.5)}
    for il in range(nl):
        p = f"model.layers.{il}."
        t[p + "input_layernorm.weight"] = norm(e)
        t[p + "self_attn.q_proj.weight"] = mat(nq, e, 0.15)
        t[p + "self_attn.k_proj.weight"] = mat(nkv, e, 0.15)
        t[p + "self_attn.v_proj.weight"] = mat(nkv, e, 0.15)
        t[p + "self_attn.o_proj.weight"] = mat(e, nq, 0.1)
        if arch == "qwen3":
            t[p + "self_attn.q_norm.weight"] = norm(d)
            t[p + "self_attn.k_norm.weight"] = norm(d)
        t[p + "post_attention_layernorm.weight"] = norm(e)
        t[p + "mlp.gate_proj.weight"] = mat(f, e, 0.15)
        t[p + "mlp.up_proj.weight"] = mat(f, e, 0.15)
        t[p + "mlp.down_proj.weight"] = mat(e, f, 0.1)
    t["model.norm.weight"] = norm(e)
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = mat(n_vocab, e, 0.5)
    weights = _write_weights(out_dir, t, dtype, shards)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return TinyCheckpoint(out_dir, cfg, weights, n_vocab)


DRAFTER_KINDS = ("dflash", "dspark", "speculators")


def make_drafter(out_dir, target: TinyCheckpoint, kind: str = "dflash", seed: int = 1,
                 dtype: str = "float32", confidence_head: bool = True,
                 sample_from_anchor: Optional[bool] = None, markov_rank: int = 32,
                 num_layers: int = 1, target_layer_ids: Optional[List[int]] = None,
                 mask_token_id: Optional[int] = None, draft_vocab: int = 64,
                 own_embedding: bool = False, **overrides) -> TinyCheckpoint:
    """A tiny drafter for `target`.

    kind "dflash": DFlashDraftModel as z-lab publishes it (dflash_config, names without "model.").
    kind "dspark": Qwen3DSparkModel as DeepSpec writes it (top-level DSpark fields, "model."
    names, full-vocabulary lm_head, Markov head, optional confidence head).
    kind "speculators": DSparkSpeculator (transformer_layer_config, aux_hidden_state_layer_ids,
    a reduced draft vocabulary of `draft_vocab` tokens with d2t/t2d).
    overrides replace top-level config entries (None removes one)."""
    if kind not in DRAFTER_KINDS:
        raise ValueError(f"unknown drafter kind {kind!r} (one of {DRAFTER_KINDS})")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tcfg = target.config
    e, v = tcfg["hidden_size"], target.n_vocab
    n_head, n_kv, d, f = 4, 2, 16, 128
    layer_ids = target_layer_ids if target_layer_ids is not None else [-1, 0]
    if mask_token_id is None:
        tok = json.loads((target.path / "tokenizer.json").read_text())
        mask_token_id = next((a["id"] for a in tok["added_tokens"] if a["content"] == "<|mask|>"),
                             v - 1)
    backbone = dict(hidden_size=e, intermediate_size=f, num_hidden_layers=num_layers,
                    num_attention_heads=n_head, num_key_value_heads=n_kv, head_dim=d,
                    max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    hidden_act="silu", vocab_size=v, torch_dtype=dtype)
    if kind == "dflash":
        cfg = dict(architectures=["DFlashDraftModel"], model_type="qwen3", **backbone,
                   dflash_config=dict(mask_token_id=mask_token_id, target_layer_ids=layer_ids,
                                      block_size=16))
        prefix = ""
    elif kind == "dspark":
        cfg = dict(architectures=["Qwen3DSparkModel"], model_type="qwen3", **backbone,
                   block_size=7, mask_token_id=mask_token_id, target_layer_ids=layer_ids,
                   num_target_layers=tcfg["num_hidden_layers"], markov_rank=markov_rank,
                   markov_head_type="vanilla", enable_confidence_head=confidence_head,
                   confidence_head_with_markov=confidence_head, num_anchors=512)
        prefix = "model."
    else:
        cfg = dict(architectures=["DSparkSpeculator"], speculators_model_type="dspark",
                   transformer_layer_config=dict(model_type="qwen3", **backbone),
                   aux_hidden_state_layer_ids=[i + 1 for i in layer_ids], block_size=8,
                   mask_token_id=mask_token_id, draft_vocab_size=draft_vocab,
                   markov_rank=markov_rank, markov_head_type="vanilla")
        prefix = ""
    if sample_from_anchor is not None:
        cfg["sample_from_anchor"] = sample_from_anchor
    for k, val in overrides.items():
        if val is None:
            cfg.pop(k, None)
        else:
            cfg[k] = val

    rng = np.random.default_rng(seed)

    def mat(rows, cols, std):
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    nq, nkvd = n_head * d, n_kv * d
    t: Dict[str, np.ndarray] = {}
    t[prefix + "fc.weight"] = mat(e, len(layer_ids) * e, 0.1)
    t[prefix + "hidden_norm.weight"] = norm(e)
    for il in range(num_layers):
        p = f"{prefix}layers.{il}."
        t[p + "input_layernorm.weight"] = norm(e)
        t[p + "self_attn.q_proj.weight"] = mat(nq, e, 0.15)
        t[p + "self_attn.k_proj.weight"] = mat(nkvd, e, 0.15)
        t[p + "self_attn.v_proj.weight"] = mat(nkvd, e, 0.15)
        t[p + "self_attn.o_proj.weight"] = mat(e, nq, 0.1)
        t[p + "self_attn.q_norm.weight"] = norm(d)
        t[p + "self_attn.k_norm.weight"] = norm(d)
        t[p + "post_attention_layernorm.weight"] = norm(e)
        t[p + "mlp.gate_proj.weight"] = mat(f, e, 0.15)
        t[p + "mlp.up_proj.weight"] = mat(f, e, 0.15)
        t[p + "mlp.down_proj.weight"] = mat(e, f, 0.1)
    t[prefix + "norm.weight"] = norm(e)
    if own_embedding:
        t[prefix + "embed_tokens.weight"] = mat(v, e, 0.5)
    if kind in ("dspark", "speculators"):
        vd = v if kind == "dspark" else draft_vocab
        t["lm_head.weight"] = mat(vd, e, 0.5)
        if kind == "speculators":
            draft_ids = np.sort(rng.choice(v, size=vd, replace=False))
            t["d2t"] = (draft_ids - np.arange(vd)).astype(np.int64)
            t2d = np.zeros(v, dtype=bool)
            t2d[draft_ids] = True
            t["t2d"] = t2d
        t["markov_head.markov_w1.weight"] = mat(v, markov_rank, 0.2)
        t["markov_head.markov_w2.weight"] = mat(vd, markov_rank, 0.2)
        if confidence_head:
            t["confidence_head.proj.weight"] = mat(1, e + markov_rank, 0.1)
            t["confidence_head.proj.bias"] = (0.1 * rng.standard_normal(1)).astype(np.float32)
    weights = _write_weights(out_dir, t, dtype, 1)
    weights.update({k: a for k, a in t.items() if a.dtype.kind != "f"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return TinyCheckpoint(out_dir, cfg, weights, v)


def write_mask_embedding(out_dir, n_embd: int, fmt: str = "safetensors", seed: int = 2,
                         mask_token_id: Optional[int] = None) -> np.ndarray:
    """Write mask_embedding.<fmt> (safetensors: tensors 'embedding' and, if given,
    'mask_token_id'; npy: the bare vector) and return the vector."""
    vec = (np.random.default_rng(seed).standard_normal(n_embd) * 0.5).astype(np.float32)
    out_dir = Path(out_dir)
    if fmt == "safetensors":
        tensors = {"embedding": vec}
        if mask_token_id is not None:
            tensors["mask_token_id"] = np.array([mask_token_id], dtype=np.int64)
        save_file(tensors, str(out_dir / "mask_embedding.safetensors"))
    elif fmt == "npy":
        np.save(out_dir / "mask_embedding.npy", vec)
    else:
        raise ValueError(f"unknown mask embedding format {fmt!r} (safetensors or npy)")
    return vec


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    root = args.out_dir
    llama = make_target(root / "llama", "llama", seed=args.seed)
    qwen3 = make_target(root / "qwen3", "qwen3", seed=args.seed + 1)
    make_drafter(root / "dflash-qwen3", qwen3, "dflash", seed=args.seed + 2)
    make_drafter(root / "dspark-qwen3", qwen3, "dspark", seed=args.seed + 3)
    make_drafter(root / "dspark-noconf-llama", llama, "dspark", seed=args.seed + 4,
                 confidence_head=False)
    make_drafter(root / "speculators-qwen3", qwen3, "speculators", seed=args.seed + 5)
    print(f"wrote tiny checkpoints under {root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
