"""The tokenizer stored in a GGUF file's metadata, tokenizing exactly as llama.cpp does.

Two vocabulary kinds are supported, named by `tokenizer.ggml.model`:

- `gpt2`: byte-level BPE (`tokenizer.ggml.tokens` + `tokenizer.ggml.merges`). Text is first split
  by a list of regexes chosen by `tokenizer.ggml.pre` (each regex splits every piece the previous
  one produced, keeping both the matches and the text between them), then each piece is mapped
  to GPT-2's byte alphabet and merged by rank.
- `llama`: SentencePiece-style BPE (`tokenizer.ggml.scores`, byte fallback `<0xNN>`): spaces
  become U+2581, a space is prefixed to the text (`tokenizer.ggml.add_space_prefix`), and adjacent
  symbols are merged highest score first when their concatenation is a token.

The merging itself is done by the `tokenizers` library. For `llama` vocabularies, which carry
scores instead of merges, the merges are derived: every split of a token into two tokens is a
merge, ranked by the score of the token it makes. This equals llama.cpp's score-ordered merging
whenever distinct tokens have distinct scores, which holds for vocabularies converted from
SentencePiece models.

Special tokens (CONTROL, UNKNOWN and USER_DEFINED types) are cut out of the text before
tokenization, longest first, as llama.cpp's `tokenizer_st_partition` does. CONTROL and UNKNOWN
tokens are recognised only with `parse_special=True`; USER_DEFINED tokens always are (llama.cpp
and Hugging Face both treat added non-special tokens that way).
"""

from __future__ import annotations

import codecs
import logging
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

log = logging.getLogger(__name__)

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
TOKEN_TYPE_UNDEFINED = 0
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

_SPACE_MARK = "\u2581"  # SentencePiece's visible space
# C's isspace() in the "C" locale: what llama.cpp strips around lstrip/rstrip special tokens.
_C_SPACE = " \t\n\v\f\r"


# ---------------------------------------------------------------------------------------------
# Pre-tokenizer split rules, per `tokenizer.ggml.pre`
# ---------------------------------------------------------------------------------------------

# GPT-2's rule: contractions, letters and numbers with an optional leading space, other symbols
# with an optional leading space, and whitespace runs that leave their last space to the next
# word (`\s+(?!\S)`). Whitespace that no alternative matches stays a piece of its own.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

# Llama 3 / Qwen 2 style: case-insensitive contractions (spelled out per letter as llama.cpp
# does, so only ASCII case folds), a word may take one leading non-letter non-digit (not a
# newline), numbers in groups, punctuation runs keep trailing newlines, newline runs keep the
# whitespace before them.
_CONTRACTIONS_CI = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"


def _llama3_style(digits: str) -> str:
    return (_CONTRACTIONS_CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|" + digits +
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


_LLAMA3 = _llama3_style(r"\p{N}{1,3}")   # digits in groups of up to three
_QWEN2 = _llama3_style(r"\p{N}")         # every digit on its own

# Mistral's tekken and OpenAI's o200k (gpt-4o, llama4) split words at case changes. llama.cpp
# runs an adapted form that is the rule here: an "upper" letter is any letter but a-z, a "lower"
# one any letter but A-Z, combining marks are not letters, and contractions fold ASCII case only.
_UPPER = r"[\p{L}&&[^a-z]]"
_LOWER = r"[\p{L}&&[^A-Z]]"
_TAIL_O200K = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?" + _UPPER + "*" + _LOWER + "+|" +
           r"[^\r\n\p{L}\p{N}]?" + _UPPER + "+" + _LOWER + "*|" + r"\p{N}" + _TAIL_O200K)
_GPT4O = (r"[^\r\n\p{L}\p{N}]?" + _UPPER + "*" + _LOWER + "+" + _CONTRACTIONS_CI + "?|" +
          r"[^\r\n\p{L}\p{N}]?" + _UPPER + "+" + _LOWER + "*" + _CONTRACTIONS_CI + "?|" +
          r"\p{N}{1,3}" + _TAIL_O200K)

_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"


@dataclass(frozen=True)
class PreTokenizerRule:
    """How llama.cpp pre-tokenizes and detokenizes one family of `tokenizer.ggml.pre` names."""
    regexes: Tuple[str, ...]
    ignore_merges: bool = False   # a piece that is itself a token is taken whole
    add_bos: bool = False         # llama.cpp's default when tokenizer.ggml.add_bos_token is absent
    clean_spaces: bool = True     # detokenize removes " ." " ," " 's" ... (clean_up_tokenization)


_RULE_DEFAULT = PreTokenizerRule((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_RULE_GPT2 = PreTokenizerRule((_GPT2,))

_PRE_FAMILIES: Tuple[Tuple[Tuple[str, ...], PreTokenizerRule], ...] = (
    (("default",), _RULE_DEFAULT),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
     PreTokenizerRule((_LLAMA3,), ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe"), PreTokenizerRule((_LLAMA3,))),
    (("qwen2", "deepseek-r1-qwen"), PreTokenizerRule((_QWEN2,), clean_spaces=False)),
    (("stablelm2", "megrez"), PreTokenizerRule((_QWEN2,))),
    (("starcoder", "refact", "codeshell", "exaone", "minerva-7b"),
     PreTokenizerRule((r"\p{N}", _GPT2))),
    (("smollm", "command-r"), PreTokenizerRule((r"\p{N}", _GPT2), clean_spaces=False)),
    (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v1-en", "jina-v2-es",
      "jina-v2-de", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais"), _RULE_GPT2),
    (("falcon",),
     PreTokenizerRule((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"))),
    (("bloom", "gpt3-finnish"), PreTokenizerRule((_BLOOM,))),
    (("poro-chat",), PreTokenizerRule((_BLOOM,), clean_spaces=False)),
    (("viking",), PreTokenizerRule((_BLOOM, r"\p{N}"), clean_spaces=False)),
    (("tekken",), PreTokenizerRule((_TEKKEN,), ignore_merges=True, add_bos=True,
                                   clean_spaces=False)),
    (("gpt-4o", "llama4"), PreTokenizerRule((_GPT4O,), clean_spaces=False)),
)
PRE_TOKENIZER_RULES: Dict[str, PreTokenizerRule] = {
    name: rule for names, rule in _PRE_FAMILIES for name in names}


def pre_tokenizer_rule(pre: Optional[str]) -> PreTokenizerRule:
    """The split rule for a `tokenizer.ggml.pre` value. A missing value is llama.cpp's 'default';
    an unknown name falls back to GPT-2's rule with a warning (llama.cpp refuses to load it)."""
    if not pre:
        log.warning("GGUF has no tokenizer.ggml.pre: using llama.cpp's 'default' pre-tokenizer "
                    "(tokenization may differ from the model's own)")
        return _RULE_DEFAULT
    rule = PRE_TOKENIZER_RULES.get(pre)
    if rule is None:
        log.warning("unknown pre-tokenizer %r in tokenizer.ggml.pre: using GPT-2's split rule "
                    "(tokenization may differ from the model's own)", pre)
        return _RULE_GPT2
    return rule


def split_pieces(text: str, regexes: Sequence[str]) -> List[str]:
    """`text` cut by the regexes in turn (each one splits every piece of the previous one,
    matches and the text between them both kept): the words BPE merges within."""
    return [piece for piece, _ in _regex_splitter(regexes).pre_tokenize_str(text)] if text else []


def _regex_splitter(regexes: Sequence[str]):
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes])


# ---------------------------------------------------------------------------------------------
# GPT-2's byte alphabet
# ---------------------------------------------------------------------------------------------

def _byte_alphabet() -> List[str]:
    """The character GPT-2's byte-level BPE uses for each byte: printable Latin-1 bytes stand for
    themselves, the others are moved to U+0100 and up, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | \
        set(range(0xAE, 0xFF + 1))
    chars = []
    shifted = 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


_BYTE_OF_CHAR: Dict[str, int] = {c: b for b, c in enumerate(_byte_alphabet())}


def _byte_level_decode(token_text: str) -> bytes:
    """The bytes a byte-level BPE token stands for. A character outside the byte alphabet (only
    in hand-made vocabularies) stands for its own UTF-8."""
    out = bytearray()
    for ch in token_text:
        b = _BYTE_OF_CHAR.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# Detokenizer clean-up (llama.cpp's clean_spaces, HF's clean_up_tokenization_spaces)
# ---------------------------------------------------------------------------------------------

def clean_up_spaces(text: str) -> str:
    """llama.cpp's three detokenizer passes for vocabularies with clean_spaces: drop the space
    before ? ! . , ; turn " ' " into "'"; drop the space before 's 'm 're 've."""
    if not text:
        return text
    # Pass 1: " ?", " !", " .", " ," lose the space.
    out = [text[0]]
    for i in range(1, len(text)):
        x = text[i]
        if text[i - 1] == " " and x in "?!.,":
            out.pop()
        out.append(x)
    # Pass 2: a lone apostrophe between spaces loses both spaces. The space after it is consumed,
    # so it cannot also be the space before a later apostrophe.
    t = out
    n = len(t)
    out = [t[0]]
    consumed = -1
    i = 1
    while i < n:
        x = t[i]
        if x == "'" and i + 1 < n and t[i - 1] == " " and consumed != i - 1 and t[i + 1] == " ":
            out.pop()
            out.append(x)
            consumed = i + 1
            i += 2
            continue
        out.append(x)
        i += 1
    # Pass 3: contractions " 's", " 'm", " 're", " 've" lose the space (" 't", " 'd", " 'll"
    # keep it).
    t = out
    n = len(t)
    out = [t[0]]
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == " " and x == "'" and i + 1 < n:
            x1 = t[i + 1]
            if x1 in "sm":
                out.pop()
            elif x1 not in "td" and i + 2 < n and (x1, t[i + 2]) in (("r", "e"), ("v", "e")):
                out.pop()
        out.append(x)
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------

# Texts llama.cpp recognises as special tokens when the GGUF does not name them (its loader
# forces such tokens to CONTROL).
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# Every token with one of these texts ends generation.
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")


def _meta_id(md: Mapping, key: str, n_vocab: int) -> Optional[int]:
    v = md.get(key)
    if v is None:
        return None
    v = int(v)
    if not 0 <= v < n_vocab:
        log.warning("ignoring %s = %d: outside the vocabulary [0, %d)", key, v, n_vocab)
        return None
    return v


class Tokenizer:
    """Text <-> token ids for a GGUF model, matching llama.cpp's llama_tokenize/llama_detokenize.

    Build it with `Tokenizer.from_gguf(path)` or `Tokenizer.from_metadata(metadata)`.
    """

    def __init__(self, metadata: Mapping):
        md = metadata
        tokens = md.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens: the file carries no "
                             "vocabulary")
        model = md.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise ValueError(f"unsupported tokenizer.ggml.model {model!r}: pyspec reads 'gpt2' "
                             f"(byte-level BPE) and 'llama' (SentencePiece) vocabularies")
        n = len(tokens)
        # llama.cpp gives empty token texts a placeholder so that every text names one token.
        texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = md.get("tokenizer.ggml.token_type")
        types = [int(t) for t in types] if types is not None else [TOKEN_TYPE_NORMAL] * n
        if len(types) != n:
            raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")

        self._model = model
        self._texts = texts
        self._types = types
        self._id_of: Dict[str, int] = {}
        for i, t in enumerate(texts):
            self._id_of[t] = i   # a repeated text names its last id, as in llama.cpp

        self.pre: Optional[str] = md.get("tokenizer.ggml.pre") if model == "gpt2" else None
        if model == "gpt2":
            rule = pre_tokenizer_rule(self.pre)
            add_bos_default = rule.add_bos
            self._add_space_prefix = False
            self._clean_spaces = rule.clean_spaces
            # llama.cpp's defaults for BPE vocabularies (GPT-NeoX's <|endoftext|>), used when
            # the file names no BOS/EOS.
            self._bos_id = 11 if n > 11 else None
            self._eos_id = 11 if n > 11 else None
            self._unk_id = None
        else:
            rule = None
            add_bos_default = True
            self._add_space_prefix = True
            self._clean_spaces = False
            # llama.cpp's defaults for SentencePiece vocabularies.
            self._bos_id = 1 if n > 1 else None
            self._eos_id = 2 if n > 2 else None
            self._unk_id = 0
        self._add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix",
                                             self._add_space_prefix))

        for attr, key in (("_bos_id", "bos_token_id"), ("_eos_id", "eos_token_id"),
                          ("_unk_id", "unknown_token_id")):
            v = _meta_id(md, "tokenizer.ggml." + key, n)
            if v is not None:
                setattr(self, attr, v)
        self._pad_id = _meta_id(md, "tokenizer.ggml.padding_token_id", n)
        self._add_bos = bool(md.get("tokenizer.ggml.add_bos_token", add_bos_default))
        self._add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))

        self._find_special_tokens(md)
        self._lstrip, self._rstrip = self._strip_attributes(md)
        # Specials are cut out longest first (ties in id order).
        self._special_ids = sorted(
            (i for i, t in enumerate(types)
             if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN)),
            key=lambda i: -len(texts[i].encode("utf-8")))

        self._pieces = [self._make_piece(i) for i in range(n)]
        self._hidden_when_skipping = bytearray(
            1 if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN) else 0 for t in types)
        self.chat_template: Optional[str] = md.get("tokenizer.chat_template")
        self._hf = self._build_bpe(md, rule)

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path) -> "Tokenizer":
        """The tokenizer of the GGUF file at `path` (only its metadata is read)."""
        from . import _core

        # The core's errors already name the file and the problem (missing, not GGUF, ...).
        return cls(_core.GgufFile(str(path)).metadata)

    @classmethod
    def from_metadata(cls, metadata: Mapping) -> "Tokenizer":
        """The tokenizer described by a GGUF metadata mapping (key -> value)."""
        return cls(metadata)

    def _find_special_tokens(self, md: Mapping) -> None:
        """EOT/EOM/FIM tokens by key or, failing that, by text; the set of end-of-generation
        tokens; and llama.cpp's promotion of such tokens to CONTROL."""
        n = len(self._texts)

        def by_text(candidates: Iterable[str]) -> Optional[int]:
            for text in candidates:
                tid = self._id_of.get(text)
                if tid is not None:
                    return tid
            return None

        def promote(tid: Optional[int]) -> None:
            if tid is not None and self._types[tid] != TOKEN_TYPE_CONTROL:
                log.debug("token %d %r looks like a control token: treating it as one",
                          tid, self._texts[tid])
                self._types[tid] = TOKEN_TYPE_CONTROL

        found = {}
        for name, key, candidates in (
                ("eot", "eot_token_id", _EOT_TEXTS), ("eom", "eom_token_id", _EOM_TEXTS),
                *((name, name + "_token_id", texts) for name, texts in _FIM_TEXTS.items())):
            tid = _meta_id(md, "tokenizer.ggml." + key, n)
            if tid is None:
                tid = by_text(candidates)
                promote(tid)
            found[name] = tid
        self._eot_id = found["eot"]
        self._fim = {name: found[name] for name in _FIM_TEXTS}

        eog = {found[k] for k in ("fim_pad", "fim_rep", "fim_sep")}
        for text in _EOG_TEXTS:
            tid = self._id_of.get(text)
            if tid is not None:
                eog.add(tid)
                promote(tid)
        eog |= {self._eos_id, self._eot_id, found["eom"]}
        eog.discard(None)
        self._eog_ids = frozenset(eog)

    def _strip_attributes(self, md: Mapping) -> Tuple[frozenset, frozenset]:
        """Special tokens that swallow whitespace beside them (llama.cpp sets these by model name
        for jina-v2 and Phi-3)."""
        pre = md.get("tokenizer.ggml.pre") or ""
        name = str(md.get("general.name") or "").lower()
        specials = [i for i, t in enumerate(self._types)
                    if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN)]
        if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")):
            mask = self._id_of.get("<mask>")
            return frozenset([mask] if mask is not None else []), frozenset()
        if "phi-3" in name or "phi3" in name:
            rstrip = set(specials)
            if "</s>" in self._id_of:
                rstrip.add(self._id_of["</s>"])
            for text in ("<unk>", "<s>", "<|endoftext|>"):
                rstrip.discard(self._id_of.get(text))
            return frozenset(), frozenset(rstrip)
        return frozenset(), frozenset()

    def _make_piece(self, tid: int) -> bytes:
        """What llama.cpp's token_to_piece(special=True) gives for a token."""
        text, ttype = self._texts[tid], self._types[tid]
        if ttype in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED):
            return text.encode("utf-8")
        if ttype == TOKEN_TYPE_NORMAL:
            if self._model == "gpt2":
                return _byte_level_decode(text)
            return text.replace(_SPACE_MARK, " ").encode("utf-8")
        if ttype == TOKEN_TYPE_BYTE and self._model == "llama":
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                raise ValueError(f"byte token {tid} has text {text!r}, expected <0xNN>") from None
        return b""  # unused/undefined tokens (and BYTE tokens in a BPE vocabulary) render empty

    def _build_bpe(self, md: Mapping, rule: Optional[PreTokenizerRule]):
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, pre_tokenizers

        if self._model == "gpt2":
            merges_meta = md.get("tokenizer.ggml.merges")
            if merges_meta is None:
                raise ValueError("GGUF metadata has no tokenizer.ggml.merges, which a 'gpt2' "
                                 "vocabulary needs")
            merges = []
            dropped = 0
            for m in merges_meta:
                # llama.cpp splits at the first space after the first character.
                pos = m.find(" ", 1)
                if pos < 0:
                    dropped += 1
                    continue
                a, b = m[:pos], m[pos + 1:]
                if a in self._id_of and b in self._id_of and a + b in self._id_of:
                    merges.append((a, b))
                else:
                    dropped += 1
            if dropped:
                log.warning("%d of %d BPE merges name tokens missing from the vocabulary; "
                            "they are ignored", dropped, len(merges_meta))
            bpe = models.BPE(vocab=dict(self._id_of), merges=merges,
                             ignore_merges=rule.ignore_merges)
            hf = HFTokenizer(bpe)
            hf.pre_tokenizer = pre_tokenizers.Sequence(
                [_regex_splitter(rule.regexes),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            return hf

        scores = md.get("tokenizer.ggml.scores")
        if scores is None:
            scores = [0.0] * len(self._texts)
            log.warning("SentencePiece vocabulary without tokenizer.ggml.scores: merges are "
                        "ranked by token id")
        if len(scores) != len(self._texts):
            raise ValueError(f"tokenizer.ggml.scores has {len(scores)} entries for "
                             f"{len(self._texts)} tokens")
        ranked = []
        for text, tid in self._id_of.items():
            for k in range(1, len(text)):
                a, b = text[:k], text[k:]
                if a in self._id_of and b in self._id_of:
                    ranked.append((-float(scores[tid]), tid, k, a, b))
        ranked.sort()
        unk = self._texts[self._unk_id] if self._unk_id is not None else None
        bpe = models.BPE(vocab=dict(self._id_of), merges=[(a, b) for *_, a, b in ranked],
                         byte_fallback=True, unk_token=unk, fuse_unk=False)
        return HFTokenizer(bpe)

    # -- properties ----------------------------------------------------------------------------

    @property
    def model(self) -> str:
        """`gpt2` (byte-level BPE) or `llama` (SentencePiece)."""
        return self._model

    @property
    def n_vocab(self) -> int:
        return len(self._texts)

    @property
    def bos_id(self) -> Optional[int]:
        return self._bos_id

    @property
    def eos_id(self) -> Optional[int]:
        return self._eos_id

    @property
    def fim_ids(self) -> Dict[str, Optional[int]]:
        """The fill-in-the-middle tokens (fim_pre, fim_suf, fim_mid, fim_pad, fim_rep, fim_sep),
        None where the vocabulary has none."""
        return dict(self._fim)

    @property
    def eot_id(self) -> Optional[int]:
        """`tokenizer.ggml.eot_token_id`, else the first token found among the texts llama.cpp
        treats as end-of-turn (<|eot_id|>, <|im_end|>, ...), else None."""
        return self._eot_id

    @property
    def unk_id(self) -> Optional[int]:
        return self._unk_id

    @property
    def pad_id(self) -> Optional[int]:
        return self._pad_id

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @property
    def add_eos(self) -> bool:
        return self._add_eos

    @property
    def add_space_prefix(self) -> bool:
        return self._add_space_prefix

    @property
    def eog_ids(self) -> frozenset:
        """Every token that ends generation."""
        return self._eog_ids

    def is_eog(self, token_id: int) -> bool:
        return token_id in self._eog_ids

    def token_type(self, token_id: int) -> int:
        """The token's type (TOKEN_TYPE_*), after llama.cpp's promotion of control-looking
        end-of-turn and fill-in-the-middle tokens to CONTROL."""
        return self._types[self._check_id(token_id)]

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary (byte-level or with U+2581 spaces)."""
        return self._texts[self._check_id(token_id)]

    def token_to_id(self, text: str) -> Optional[int]:
        """The id of the token whose vocabulary text is `text`, or None."""
        return self._id_of.get(text)

    def _check_id(self, token_id) -> int:
        tid = int(token_id)
        if not 0 <= tid < len(self._texts):
            raise ValueError(f"token id {tid} is outside the vocabulary [0, {len(self._texts)})")
        return tid

    # -- text -> ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> List[int]:
        """Token ids of `text`, as llama_tokenize(text, add_special, parse_special).

        add_special adds BOS/EOS as the vocabulary asks (tokenizer.ggml.add_bos_token /
        add_eos_token). parse_special turns the text of CONTROL/UNKNOWN tokens (e.g.
        "<|im_start|>") into those tokens; without it that text is tokenized as plain text.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        out: List[int] = []
        if add_special and self._add_bos:
            if self._bos_id is None:
                raise ValueError("the vocabulary asks for a BOS token but names none")
            out.append(self._bos_id)
        prev_special = True  # a SentencePiece text fragment after a special gets a space prefix
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self._model == "llama":
                if self._add_space_prefix and prev_special:
                    frag = " " + frag
                frag = frag.replace(" ", _SPACE_MARK)
            out.extend(self._hf.encode(frag, add_special_tokens=False).ids)
            prev_special = False
        if add_special and self._add_eos:
            if self._eos_id is None:
                raise ValueError("the vocabulary asks for an EOS token but names none")
            out.append(self._eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> List[Union[str, int]]:
        """`text` cut into raw-text fragments (str) and special tokens (int), one special token
        at a time, longest first, each over all fragments left by the longer ones."""
        frags: List[Union[str, int]] = [text] if text else []
        for tid in self._special_ids:
            if not parse_special and self._types[tid] != TOKEN_TYPE_USER_DEFINED:
                continue
            s = self._texts[tid]
            if not any(isinstance(f, str) and s in f for f in frags):
                continue
            lstrip, rstrip = tid in self._lstrip, tid in self._rstrip
            cut: List[Union[str, int]] = []
            for f in frags:
                if isinstance(f, int) or s not in f:
                    cut.append(f)
                    continue
                parts = f.split(s)
                for k, part in enumerate(parts):
                    if k > 0:
                        cut.append(tid)
                        if rstrip:
                            part = part.lstrip(_C_SPACE)
                    if lstrip and k < len(parts) - 1:
                        part = part.rstrip(_C_SPACE)
                    if part:
                        cut.append(part)
            frags = cut
        return frags

    # -- ids -> text ---------------------------------------------------------------------------

    def token_to_piece(self, token_id: int, skip_special: bool = False) -> bytes:
        """The raw bytes of one token (llama.cpp's token_to_piece): byte-level decoded for `gpt2`
        vocabularies, U+2581 -> space and <0xNN> -> that byte for `llama` ones. Special tokens
        give their text, or nothing with skip_special. A piece may be part of a UTF-8 character."""
        tid = self._check_id(token_id)
        if skip_special and self._hidden_when_skipping[tid]:
            return b""
        return self._pieces[tid]

    def decode(self, ids: Iterable[int], skip_special: bool = False, *,
               continuation: bool = False) -> str:
        """The text of `ids`, as llama_detokenize(remove_special=False,
        unparse_special=not skip_special): control tokens give their text unless skip_special;
        with add_space_prefix (SentencePiece) the first token's leading space is dropped, and
        vocabularies with clean_spaces (gpt2, llama3 and default pre-tokenizers) drop spaces
        before punctuation and contractions. Bytes that are not valid UTF-8 become U+FFFD.

        continuation=True is for ids that continue earlier text (a completion after its prompt):
        the pieces are joined as they are, with no leading-space removal and no clean-up, which is
        what llama-server returns for generated tokens.
        """
        strip = self._add_space_prefix and not continuation
        parts = []
        for t in ids:
            piece = self.token_to_piece(t, skip_special)
            if strip:
                if piece[:1] == b" ":
                    piece = piece[1:]
                strip = False
            parts.append(piece)
        text = b"".join(parts).decode("utf-8", errors="replace")
        if self._clean_spaces and not continuation:
            text = clean_up_spaces(text)
        return text

    def stream_decoder(self, skip_special: bool = False, *,
                       continuation: bool = False) -> "StreamDecoder":
        """An incremental decoder: push ids one at a time, get text as soon as it is complete.
        Its output, flushed, equals decode(ids, skip_special, continuation=continuation)."""
        return StreamDecoder(self, skip_special=skip_special, continuation=continuation)

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self._model!r}, pre={self.pre!r}, n_vocab={self.n_vocab}, "
                f"bos={self._bos_id}, eos={self._eos_id}, add_bos={self._add_bos})")


class StreamDecoder:
    """Turns token ids into text as they arrive (e.g. while generating).

    A token may end in the middle of a UTF-8 character (byte tokens, or byte-level BPE pieces of
    an emoji); those bytes are held back until the character is complete. For vocabularies that
    clean up spaces, text is also held back while the next token could still remove a space in
    it. `flush()` returns whatever is left; the concatenated output equals Tokenizer.decode of
    all pushed ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False,
                 continuation: bool = False):
        self._tok = tokenizer
        self._skip_special = skip_special
        self._strip_first = tokenizer._add_space_prefix and not continuation
        self._clean = tokenizer._clean_spaces and not continuation
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded text that clean-up may still change (only when cleaning)

    def push(self, token_id: int) -> str:
        """The new text that token_id completes (possibly empty)."""
        piece = self._tok.token_to_piece(token_id, self._skip_special)
        if self._strip_first:
            if piece[:1] == b" ":
                piece = piece[1:]
            self._strip_first = False
        return self._emit(self._utf8.decode(piece, final=False), final=False)

    def flush(self) -> str:
        """Everything held back (an unfinished UTF-8 sequence becomes U+FFFD)."""
        return self._emit(self._utf8.decode(b"", final=True), final=True)

    def _emit(self, text: str, final: bool) -> str:
        if not self._clean:
            return text
        self._pending += text
        cut = len(self._pending) if final else self._safe_cut()
        done, self._pending = self._pending[:cut], self._pending[cut:]
        return clean_up_spaces(done)

    def _safe_cut(self) -> int:
        """The longest prefix of the held-back text that the next tokens cannot change.

        Clean-up only removes spaces, each judged by at most the three characters after it (and
        by spaces it removes, which are among those). Text whose last three characters are not
        spaces therefore cleans the same whatever follows, so it can be cleaned on its own. What
        was emitted before always ended that way, so characters before the held-back text count
        as non-spaces.
        """
        text = self._pending
        end = len(text)
        while end > 0:
            space = text.rfind(" ", 0, end)
            if space < 0 or space + 4 <= end:
                return end
            end = space
        return 0
