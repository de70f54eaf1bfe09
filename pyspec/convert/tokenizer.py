"""The tokenizer part of a GGUF: from a Hugging Face fast tokenizer (tokenizer.json plus
tokenizer_config.json), or copied from another GGUF file.

Only byte-level BPE tokenizers (GPT-2 style: Llama 3, Qwen, SmolLM, ...) are read; llama.cpp calls
them "gpt2". llama.cpp does not run the Hugging Face pre-tokenizer: it picks a built-in splitting
rule by the name in `tokenizer.ggml.pre`. We choose that name by comparing the tokenizer's own
pre-tokenizer description with the rules llama.cpp implements, so a tokenizer is only given a name
whose splitting is the same as its own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import gguf

from .checkpoint import read_json
from .errors import ConversionError
from .gguf_out import Plan, VT

log = logging.getLogger("pyspec.convert")

TT = gguf.TokenType

# llama.cpp writes case-insensitive contractions out as character classes; HF tokenizers use
# the (?i:...) group. Both spellings mean the same split.
_CONTRACTIONS_HF = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_CONTRACTIONS_LC = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_REGEX = (_CONTRACTIONS_LC + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (_CONTRACTIONS_LC + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                + _CONTRACTIONS_LC + r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
                r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS_LC + r"?|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# A regex split followed by a byte-level step that does no splitting of its own.
_SPLIT_THEN_BYTES = {_LLAMA3_REGEX: "llama-bpe", _QWEN2_REGEX: "qwen2", _GPT4O_REGEX: "gpt-4o"}
FALLBACK_PRE = "default"

# tokenizer_config.json entry -> GGUF key, for the special tokens llama.cpp reads.
_SPECIAL_KEYS = {
    "bos": gguf.Keys.Tokenizer.BOS_ID,
    "eos": gguf.Keys.Tokenizer.EOS_ID,
    "unk": gguf.Keys.Tokenizer.UNK_ID,
    "sep": gguf.Keys.Tokenizer.SEP_ID,
    "pad": gguf.Keys.Tokenizer.PAD_ID,
    "mask": gguf.Keys.Tokenizer.MASK_ID,
}


def _canonical_regex(pattern: str) -> str:
    return pattern.replace(_CONTRACTIONS_HF, _CONTRACTIONS_LC)


def _is_byte_level(step: dict, use_regex: bool) -> bool:
    return (step.get("type") == "ByteLevel" and bool(step.get("use_regex", True)) == use_regex
            and not step.get("add_prefix_space", False))


def _split_regex(step: dict) -> Optional[str]:
    if step.get("type") != "Split" or step.get("invert", False):
        return None
    if step.get("behavior", "Isolated") != "Isolated":
        return None
    pattern = step.get("pattern") or {}
    regex = pattern.get("Regex")
    return _canonical_regex(regex) if isinstance(regex, str) else None


def pre_tokenizer_name(pre: Optional[dict]) -> Optional[str]:
    """The llama.cpp pre-tokenizer name whose splitting equals `pre` (the "pre_tokenizer" object of
    tokenizer.json), or None if llama.cpp has no such rule."""
    if not isinstance(pre, dict):
        return None
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    if not isinstance(steps, list):
        return None
    if len(steps) == 1 and _is_byte_level(steps[0], use_regex=True):
        return "gpt-2"
    if len(steps) == 2:
        first, second = steps
        if (first.get("type") == "Digits" and first.get("individual_digits") is True
                and _is_byte_level(second, use_regex=True)):
            return "smollm"
        regex = _split_regex(first)
        if regex is not None and _is_byte_level(second, use_regex=False):
            return _SPLIT_THEN_BYTES.get(regex)
    return None


def _describe(pre) -> str:
    if not isinstance(pre, dict):
        return "none"
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    return " + ".join(str(s.get("type")) for s in steps if isinstance(s, dict)) or "empty"


def _token_content(value) -> Optional[str]:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _merges(model: dict, path: Path) -> List[str]:
    out = []
    for m in model.get("merges") or []:
        if isinstance(m, str):
            out.append(m)
        elif isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m):
            out.append(f"{m[0]} {m[1]}")
        else:
            raise ConversionError(f"{path} has a merge rule that is not 'a b' or ['a', 'b']: {m!r}")
    return out


def _add_tokens_from_post_processor(tok: dict) -> Tuple[Optional[bool], Optional[bool]]:
    """(add_bos, add_eos) as tokenizer.json's template post-processor applies them to one
    sequence, or (None, None) if it has no template."""
    post = tok.get("post_processor")
    if isinstance(post, dict) and post.get("type") == "Sequence":
        post = next((p for p in post.get("processors", []) if p.get("type") == "TemplateProcessing"),
                    None)
    if not isinstance(post, dict) or post.get("type") != "TemplateProcessing":
        return None, None
    single = post.get("single") or []
    if not single:
        return False, False
    return "SpecialToken" in single[0], "SpecialToken" in single[-1]


def _chat_templates(model_dir: Path, tok_config: dict) -> Dict[str, str]:
    """Named chat templates; the unnamed / "default" one under the key "default"."""
    tmpl = tok_config.get("chat_template")
    if tmpl is None and (model_dir / "chat_template.jinja").is_file():
        tmpl = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if tmpl is None and (model_dir / "chat_template.json").is_file():
        tmpl = read_json(model_dir / "chat_template.json", "chat template").get("chat_template")
    if isinstance(tmpl, str):
        return {"default": tmpl}
    if isinstance(tmpl, list):
        return {t["name"]: t["template"] for t in tmpl
                if isinstance(t, dict) and isinstance(t.get("name"), str)
                and isinstance(t.get("template"), str)}
    return {}


def add_hf_tokenizer(plan: Plan, model_dir: Path, config: dict, vocab_size: Optional[int]) -> int:
    """Add the tokenizer of the Hugging Face model in `model_dir` to `plan`; returns the number of
    tokens written. `vocab_size` (the embedding's rows) pads the token list with unused
    [PAD<i>] entries, as the embedding of many models is larger than the tokenizer."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ConversionError(f"no tokenizer.json in {model_dir}: the converter reads Hugging Face "
                              "fast tokenizers (byte-level BPE)")
    tok = read_json(path, "tokenizer")
    cfg_path = model_dir / "tokenizer_config.json"
    tok_config = read_json(cfg_path, "tokenizer config") if cfg_path.is_file() else {}

    model = tok.get("model") or {}
    pre = tok.get("pre_tokenizer")
    byte_level = "ByteLevel" in _describe(pre) or (tok.get("decoder") or {}).get("type") == "ByteLevel"
    if model.get("type") != "BPE" or not byte_level:
        kind = model.get("type") if model.get("type") != "BPE" else "BPE without a byte-level step"
        raise ConversionError(f"{path}: only byte-level BPE tokenizers are supported, this one is "
                              f"{kind}")

    vocab: Dict[str, int] = model.get("vocab") or {}
    added = [a for a in tok.get("added_tokens") or [] if isinstance(a, dict)]
    n_tok = 1 + max([int(i) for i in vocab.values()] + [int(a["id"]) for a in added], default=-1)
    if n_tok == 0:
        raise ConversionError(f"{path} has an empty vocabulary")
    n = n_tok
    if vocab_size is not None:
        if vocab_size < n_tok:
            raise ConversionError(f"{path} has {n_tok} tokens but the model's vocab_size is "
                                  f"{vocab_size}")
        n = vocab_size
    tokens: List[Optional[str]] = [None] * n
    types = [int(TT.UNUSED)] * n
    for text, i in vocab.items():
        tokens[int(i)] = text
        types[int(i)] = int(TT.NORMAL)
    for a in added:
        i = int(a["id"])
        tokens[i] = a["content"]
        types[i] = int(TT.CONTROL if a.get("special") else TT.USER_DEFINED)
    for i in range(n):
        if tokens[i] is None:
            tokens[i] = f"[PAD{i}]"

    pre_name = pre_tokenizer_name(pre)
    if pre_name is None:
        log.warning("unrecognised pre-tokenizer (%s) in %s: writing tokenizer.ggml.pre = '%s', "
                    "llama.cpp's generic split; tokenization may differ from Hugging Face's",
                    _describe(pre), path, FALLBACK_PRE)
        pre_name = FALLBACK_PRE

    plan.string("tokenizer.ggml.model", "gpt2")
    plan.string("tokenizer.ggml.pre", pre_name)
    plan.str_array("tokenizer.ggml.tokens", tokens)
    plan.i32_array("tokenizer.ggml.token_type", types)
    merges = _merges(model, path)
    if merges:
        plan.str_array("tokenizer.ggml.merges", merges)

    ids = dict(vocab)
    ids.update({a["content"]: int(a["id"]) for a in added})
    for kind, key in _SPECIAL_KEYS.items():
        token_id = None
        content = _token_content(tok_config.get(f"{kind}_token"))
        if content is not None:
            token_id = ids.get(content)
            if token_id is None:
                log.warning("%s_token %r of %s is not in the vocabulary; not written", kind,
                            content, cfg_path)
        if token_id is None:
            cid = config.get(f"{kind}_token_id")
            if isinstance(cid, list):
                cid = cid[0] if cid else None
            if isinstance(cid, int) and 0 <= cid < n:
                token_id = cid
        if token_id is not None:
            plan.u32(key, token_id)

    add_bos, add_eos = _add_tokens_from_post_processor(tok)
    if isinstance(tok_config.get("add_bos_token"), bool):
        add_bos = tok_config["add_bos_token"]
    if isinstance(tok_config.get("add_eos_token"), bool):
        add_eos = tok_config["add_eos_token"]
    plan.boolean("tokenizer.ggml.add_bos_token", bool(add_bos))
    plan.boolean("tokenizer.ggml.add_eos_token", bool(add_eos))

    templates = _chat_templates(model_dir, tok_config)
    if "default" in templates:
        plan.string("tokenizer.chat_template", templates["default"])
    named = sorted(k for k in templates if k != "default")
    for name in named:
        plan.string(f"tokenizer.chat_template.{name}", templates[name])
    if named:
        plan.str_array("tokenizer.chat_templates", named)
    return n


def gguf_field_value(field):
    """(value, type, sub_type) of a GGUFReader field, strings as raw bytes so nothing is
    re-encoded."""
    main = field.types[0]
    if main == VT.ARRAY:
        sub = field.types[-1]
        if sub == VT.STRING:
            return [bytes(field.parts[i]) for i in field.data], main, sub
        return [x.item() if hasattr(x, "item") else x for x in field.contents()], main, sub
    if main == VT.STRING:
        return bytes(field.parts[field.data[0]]), main, None
    return field.contents(), main, None


def copy_gguf_tokenizer(plan: Plan, reader: gguf.GGUFReader, skip=()) -> int:
    """Copy every tokenizer.* key of an existing GGUF; returns the number of tokens."""
    n = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.") or key in skip:
            continue
        value, vtype, sub = gguf_field_value(field)
        plan.set(key, value, vtype, sub)
        if key == "tokenizer.ggml.tokens":
            n = len(value)
    return n
