"""The GGUF tokenizer against llama.cpp: reference ids for SmolLM2, round trips, streaming, the
pre-tokenizer split rules, tiny BPE and SentencePiece vocabularies written to GGUF, and the
`pyspec-tokenize` / `pyspec-perplexity -f` command lines.

Reference ids come from ../shared/data (README.md there says how llama.cpp produced them).
"""

import json
import logging
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

from pyspec import perplexity  # noqa: E402
from pyspec.model import default_model_path  # noqa: E402
from pyspec.tokenizer import (  # noqa: E402
    PRE_TOKENIZER_RULES, TOKEN_TYPE_BYTE, TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED, Tokenizer, clean_up_spaces, split_pieces)
from pyspec.tokenize_cli import process_escapes  # noqa: E402
from conftest import subprocess_env  # noqa: E402
from default_model import require_default_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parents[2] / "shared/data"
LICENSE_TXT = DATA / "eval_psf_license.txt"
LICENSE_IDS = DATA / "eval_psf_license.ids.json"
GREEDY_REF = DATA / "smollm2_greedy_reference.json"

# Text that exercises every part of the tokenizers: scripts, emoji (multi-codepoint ones too),
# code, whitespace runs of every kind, digit runs, contractions, and special-token text that must
# stay plain text when special tokens are not parsed.
CORPUS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces, three trailing   ",
    "tabs\tand\t\tmore\ttabs",
    "\n\nnewlines first\n\n\nand last\n",
    "windows\r\nline\r\nendings\r\n",
    "mixed \t \n \r\n  whitespace\u00a0nbsp\u3000ideographic\u2003em",
    "digits 0 12 345 6789 1234567890 3.14159 1,000,000 ²³ ½ ٣٤",
    "I'm sure you're right; they've said it's what we'd do. DON'T SHOUT, I'LL LISTEN.",
    "Ünïcödé façade naïve résumé coöperate — “curly quotes” ‘single’ «guillemets»",
    "日本語のテキスト、中文文本，한국어 텍스트도 있습니다。",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी",
    "emoji 😀 🎉👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 keycap 1️⃣ heart ❤️",
    "def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    return n if n < 2 else fib(n-1) + fib(n-2)\n",
    "if (x != 0 && y >= 10) { z = x ** 2 / y; } // comment\n#include <stdio.h>",
    "special text as plain text: <|im_start|>user\nhi<|im_end|> <|endoftext|> <s> </s> <unk>",
    "combining e\u0301 and precomposed \u00e9, zero\u200bwidth, soft\u00adhyphen",
    "ascii control \x00\x01\x07\x1b[0m \x7f end",
    "a" * 300 + " " + "ab" * 100,
]


# ---------------------------------------------------------------------------------------------
# GGUF writing helpers (tokenizer metadata only; our reader needs no tensors for it)
# ---------------------------------------------------------------------------------------------

def write_gguf(path: Path, *, model: str, tokens, types, merges=None, scores=None, pre=None,
               **keys) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    for key, value in keys.items():
        name = "tokenizer.ggml." + key
        if isinstance(value, bool):
            w.add_bool(name, value)
        elif isinstance(value, int):
            w.add_uint32(name, value)
        else:
            w.add_string(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


TRAIN_TEXT = LICENSE_TXT.read_text(encoding="utf-8").splitlines() + CORPUS[1:]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Hugging Face's own pre-tokenizer patterns, as they appear in the models' tokenizer.json files
# (written independently of pyspec's table, which spells them the way llama.cpp runs them).
HF_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
HF_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_byte_level(pre_tokenizer, vocab_size=600):
    """A small byte-level BPE trained by `tokenizers` on the license text."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    hf.train_from_iterator(TRAIN_TEXT, trainer)
    return hf


def byte_level_gguf(hf, path: Path, pre: str, extra=(), **keys) -> Path:
    """The trained tokenizer as a GGUF vocabulary; `extra` appends (text, type) tokens."""
    spec = json.loads(hf.to_str())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    types = [TOKEN_TYPE_CONTROL if t in SPECIALS else TOKEN_TYPE_NORMAL for t in tokens]
    for text, ttype in extra:
        tokens.append(text)
        types.append(ttype)
    return write_gguf(path, model="gpt2", pre=pre, tokens=tokens, types=types, merges=merges,
                      eos_token_id=tokens.index("<|endoftext|>"), **keys)


@pytest.fixture(scope="module")
def gpt2_pair(tmp_path_factory):
    """A ByteLevel BPE trained with GPT-2's split rule, and the same vocabulary via GGUF."""
    from tokenizers import pre_tokenizers

    hf = train_byte_level(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    path = byte_level_gguf(hf, tmp_path_factory.mktemp("bpe") / "gpt2.gguf", "gpt-2",
                           extra=[("<tool>", TOKEN_TYPE_USER_DEFINED)])
    return hf, Tokenizer.from_gguf(path)


# ---------------------------------------------------------------------------------------------
# SmolLM2 against llama.cpp's reference ids
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol():
    require_default_model()
    return Tokenizer.from_gguf(default_model_path())


def _greedy_cases():
    return json.loads(GREEDY_REF.read_text())["cases"]


def test_smollm2_vocabulary(smol):
    assert smol.model == "gpt2" and smol.pre == "smollm"
    assert smol.n_vocab == 49152
    assert (smol.bos_id, smol.eos_id) == (1, 2)
    assert smol.add_bos is False and smol.add_eos is False
    assert smol.eot_id == 2  # no eot key in the file: found by the text <|im_end|>
    assert smol.token_text(2) == "<|im_end|>"
    # EOS/EOT, <|endoftext|> and the FIM repo-name token end generation, as in llama.cpp.
    assert smol.eog_ids == {0, 2, 4}
    assert smol.is_eog(2) and smol.is_eog(0) and not smol.is_eog(1) and not smol.is_eog(504)
    assert smol.token_type(1) == TOKEN_TYPE_CONTROL and smol.token_type(504) == TOKEN_TYPE_NORMAL
    assert "<|im_start|>" in smol.chat_template
    assert smol.token_to_piece(504) == b"The" and smol.token_to_piece(198) == b"\n"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        smol.token_to_piece(49152)


def test_smollm2_license_file_matches_llama_cpp(smol):
    text = LICENSE_TXT.read_text(encoding="utf-8")
    ids = smol.encode(text)
    assert ids == json.loads(LICENSE_IDS.read_text())
    assert smol.decode(ids) == text


@pytest.mark.parametrize("case", _greedy_cases(), ids=lambda c: c.get("prompt", "chat")[:20])
def test_smollm2_reference_prompts(smol, case):
    if "templated_prompt" in case:
        text = case["templated_prompt"]
        assert smol.encode(text, parse_special=True) == case["prompt_ids"]
        # Without special-token parsing the same text is plain text: no control ids appear.
        plain = smol.encode(text)
        assert not any(smol.token_type(t) == TOKEN_TYPE_CONTROL for t in plain)
        assert smol.decode(plain) == text
    else:
        assert smol.encode(case["prompt"]) == case["prompt_ids"]
        assert smol.encode(case["prompt"], parse_special=True) == case["prompt_ids"]


@pytest.mark.parametrize("case", _greedy_cases(), ids=lambda c: c.get("prompt", "chat")[:20])
def test_smollm2_reference_continuations_decode(smol, case):
    ids, text = case["greedy_ids"], case["greedy_text"]
    if smol.is_eog(ids[-1]):
        # llama-server stops at the end-of-generation token and does not return its text.
        assert smol.decode(ids[:-1]) == text
        assert smol.decode(ids, skip_special=True) == text
        assert smol.decode(ids) == text + smol.token_text(ids[-1])
    else:
        assert smol.decode(ids) == text
        assert smol.decode(ids, continuation=True) == text
    decoder = smol.stream_decoder(continuation=True)
    assert "".join(decoder.push(t) for t in ids) + decoder.flush() == smol.decode(ids)


@pytest.mark.parametrize("parse_special", [False, True])
@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_smollm2_round_trip(smol, text, parse_special):
    assert smol.decode(smol.encode(text, parse_special=parse_special)) == text


def test_special_tokens_parsed_only_when_asked(smol):
    text = "<|im_start|>user\nhi<|im_end|>"
    assert smol.encode(text, parse_special=True) == [1] + smol.encode("user\nhi") + [2]
    plain = smol.encode(text)
    assert 1 not in plain and 2 not in plain
    assert smol.decode(plain) == text
    # Rendered by default, dropped with skip_special.
    ids = smol.encode(text, parse_special=True)
    assert smol.decode(ids) == text
    assert smol.decode(ids, skip_special=True) == "user\nhi"
    assert smol.token_to_piece(1, skip_special=True) == b""


# ---------------------------------------------------------------------------------------------
# Streaming
# ---------------------------------------------------------------------------------------------

def _stream(tok, ids, **kw):
    decoder = tok.stream_decoder(**kw)
    pieces = [decoder.push(t) for t in ids]
    return pieces, decoder.flush()


def test_stream_holds_back_split_emoji(smol):
    text = "x 🎉👍🏽 y"
    ids = smol.encode(text)
    # Each emoji's four bytes are spread over three tokens (the first also carries the space):
    # text appears only when a character is complete, never as U+FFFD.
    assert [smol.token_to_piece(t) for t in ids] == [
        b"x", b" \xf0\x9f", b"\x8e", b"\x89", b"\xf0\x9f", b"\x91", b"\x8d",
        b"\xf0\x9f", b"\x8f", b"\xbd", b" y"]
    pieces, tail = _stream(smol, ids)
    assert pieces == ["x", " ", "", "🎉", "", "", "👍", "", "", "🏽", " y"]
    assert tail == ""


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_smollm2_stream_equals_decode(smol, text):
    ids = smol.encode(text)
    pieces, tail = _stream(smol, ids)
    assert "".join(pieces) + tail == smol.decode(ids) == text


def test_stream_flush_replaces_unfinished_character(smol):
    first = smol.encode("😀")[0]  # a token holding only the start of the emoji's bytes
    assert not _is_utf8(smol.token_to_piece(first))
    pieces, tail = _stream(smol, [first])
    assert pieces == [""] and tail == "\ufffd" == smol.decode([first])


# ---------------------------------------------------------------------------------------------
# Pre-tokenizer split rules
# ---------------------------------------------------------------------------------------------

def _split(pre, text):
    return split_pieces(text, PRE_TOKENIZER_RULES[pre].regexes)


@pytest.mark.parametrize("text, llama3, qwen2, smollm", [
    # digits: llama3 groups up to three, qwen2 and smollm split every digit
    ("12345678", ["123", "456", "78"], list("12345678"), list("12345678")),
    # a space before digits never joins them; smollm cuts digits out first, so the spaces before
    # them stay one piece
    ("x  1234", ["x", " ", " ", "123", "4"], ["x", " ", " ", "1", "2", "3", "4"],
     ["x", "  ", "1", "2", "3", "4"]),
    # contractions: case-insensitive for llama3/qwen2, lower-case only for GPT-2's rule
    ("I'M here, it's", ["I", "'M", " here", ",", " it", "'s"],
     ["I", "'M", " here", ",", " it", "'s"], ["I", "'", "M", " here", ",", " it", "'s"]),
    # newline runs keep together in llama3/qwen2; GPT-2's rule gives whitespace runs their own
    # piece but leaves the last space to the next word
    ("a\n\n  b  ", ["a", "\n\n", " ", " b", "  "], ["a", "\n\n", " ", " b", "  "],
     ["a", "\n\n ", " b", "  "]),
    # a word may take one leading punctuation character in llama3/qwen2; punctuation runs keep
    # their newlines
    ("hello,world!!\n", ["hello", ",world", "!!\n"], ["hello", ",world", "!!\n"],
     ["hello", ",", "world", "!!", "\n"]),
    ("Ünïcödé 中文 x2", ["Ünïcödé", " 中文", " x", "2"], ["Ünïcödé", " 中文", " x", "2"],
     ["Ünïcödé", " 中文", " x", "2"]),
])
def test_pre_tokenizer_splits(text, llama3, qwen2, smollm):
    assert _split("llama3", text) == llama3
    assert _split("llama-bpe", text) == llama3
    assert _split("qwen2", text) == qwen2
    assert _split("smollm", text) == smollm
    for pieces in (llama3, qwen2, smollm):
        assert "".join(pieces) == text


def test_pre_tokenizer_rule_flags():
    assert PRE_TOKENIZER_RULES["llama3"].ignore_merges and PRE_TOKENIZER_RULES["llama3"].add_bos
    assert not PRE_TOKENIZER_RULES["qwen2"].clean_spaces
    assert not PRE_TOKENIZER_RULES["smollm"].clean_spaces
    assert PRE_TOKENIZER_RULES["gpt-2"].clean_spaces


def test_unknown_pre_tokenizer_warns_and_uses_gpt2(gpt2_pair, tmp_path, caplog):
    hf, _ = gpt2_pair
    path = byte_level_gguf(hf, tmp_path / "unknown.gguf", "no-such-pre")
    with caplog.at_level(logging.WARNING, logger="pyspec.tokenizer"):
        tok = Tokenizer.from_gguf(path)
    assert "unknown pre-tokenizer 'no-such-pre'" in caplog.text
    text = "It's 12345 apples, isn't it?"
    assert tok.encode(text) == hf.encode(text).ids


def test_clean_up_spaces_rules():
    assert clean_up_spaces("Hello , world . Yes ? No ! ") == "Hello, world. Yes? No! "
    assert clean_up_spaces("it 's I 'm we 're you 've") == "it's I'm we're you've"
    assert clean_up_spaces("don 't he 'd we 'll") == "don 't he 'd we 'll"
    assert clean_up_spaces("a ' b") == "a'b"
    assert clean_up_spaces(" ,x") == ",x"


# ---------------------------------------------------------------------------------------------
# A BPE trained with `tokenizers`, written to GGUF and read back
# ---------------------------------------------------------------------------------------------

SAMPLES = CORPUS[1:] + ["Permission to use, copy, modify, and distribute this software",
                        "PSF LICENSE AGREEMENT FOR PYTHON 3.11.7 (c) 2001-2023 <tool> x"]


def test_trained_bpe_matches_tokenizers(gpt2_pair):
    hf, tok = gpt2_pair
    assert tok.n_vocab == hf.get_vocab_size() + 1  # + the user-defined <tool>
    for text in SAMPLES:
        want = hf.encode(text).ids
        if "<tool>" not in text:
            # Hugging Face always splits out added special tokens: our parse_special=True.
            assert tok.encode(text, parse_special=True) == want, text
            if not any(sp in text for sp in SPECIALS):
                assert tok.encode(text) == want, text
        # GPT-2-rule vocabularies detokenize with llama.cpp's clean-up of spaces.
        assert tok.decode(tok.encode(text)) == clean_up_spaces(text), text
    chat = "<|im_start|>user\nIt's 42.<|im_end|><|endoftext|>"
    assert tok.encode(chat, parse_special=True) == hf.encode(chat).ids
    assert [t for t in hf.encode(chat).ids if tok.token_type(t) == TOKEN_TYPE_CONTROL] == \
        [tok.token_to_id(sp) for sp in ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]]


def test_user_defined_tokens_always_parsed(gpt2_pair):
    _, tok = gpt2_pair
    tool = tok.token_to_id("<tool>")
    for parse_special in (False, True):
        ids = tok.encode("call <tool> now", parse_special=parse_special)
        assert tool in ids
    assert tok.decode(tok.encode("call <tool> now")) == "call <tool> now"
    assert tok.token_to_piece(tool, skip_special=True) == b"<tool>"  # not a control token


@pytest.mark.parametrize("pre, hf_regex, ignore_merges", [("qwen2", HF_QWEN2, False),
                                                          ("llama3", HF_LLAMA3, True)])
def test_trained_bpe_with_llama3_style_split(tmp_path, pre, hf_regex, ignore_merges):
    from tokenizers import Regex, pre_tokenizers

    hf = train_byte_level(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(hf_regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    if ignore_merges:
        spec = json.loads(hf.to_str())
        spec["model"]["ignore_merges"] = True
        hf = type(hf).from_str(json.dumps(spec))
    tok = Tokenizer.from_gguf(byte_level_gguf(hf, tmp_path / f"{pre}.gguf", pre,
                                              add_bos_token=False))
    for text in SAMPLES:
        if "<tool>" not in text:
            assert tok.encode(text, parse_special=True) == hf.encode(text).ids, text


# ---------------------------------------------------------------------------------------------
# A SentencePiece vocabulary with scores and byte fallback
# ---------------------------------------------------------------------------------------------

SPM_PIECES = [  # (text, score): distinct scores, as SentencePiece gives them
    ("▁", -1.0), ("h", -2.0), ("e", -3.0), ("l", -4.0), ("o", -5.0), ("ll", -6.0), ("he", -7.0),
    ("▁he", -8.0), ("llo", -9.0), ("▁hello", -10.0), ("lo", -11.0), ("w", -12.0), ("▁w", -13.0),
    ("or", -14.0), ("r", -15.0), ("d", -16.0), ("▁wor", -17.0), ("ld", -18.0), ("▁world", -19.0),
    ("a", -20.0), ("b", -21.0), ("ab", -22.0), ("▁a", -23.0), ("aa", -24.0), ("aaa", -25.0),
    ("▁▁", -26.0), ("▁▁▁▁", -27.0), ("▁ab", -28.0), ("ba", -29.0), ("中", -30.0), ("文", -31.0),
    ("中文", -32.0), ("\n", -33.0), ("▁\n", -34.0), ("<tool>", 0.0),
]


def spm_tokens():
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL] + [TOKEN_TYPE_BYTE] * 256
    scores = [0.0] * len(tokens)
    for text, score in SPM_PIECES:
        tokens.append(text)
        types.append(TOKEN_TYPE_USER_DEFINED if text == "<tool>" else TOKEN_TYPE_NORMAL)
        scores.append(score)
    return tokens, types, scores


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    tokens, types, scores = spm_tokens()
    path = write_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", model="llama",
                      tokens=tokens, types=types, scores=scores)
    return Tokenizer.from_gguf(path)


def spm_reference(text, tokens, scores, add_space_prefix=True):
    """llama.cpp's SentencePiece merge written plainly: start from characters, repeatedly merge
    the adjacent pair whose concatenation is a token with the highest score (the leftmost on a
    tie), then spell symbols that are not tokens as <0xNN> byte tokens."""
    if not text:
        return []
    ids = {t: i for i, t in enumerate(tokens)}
    symbols = list(((" " if add_space_prefix else "") + text).replace(" ", "▁"))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            joined = symbols[i] + symbols[i + 1]
            if joined in ids and (best is None or scores[ids[joined]] > best[0]):
                best = (scores[ids[joined]], i)
        if best is None:
            break
        i = best[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    out = []
    for s in symbols:
        if s in ids:
            out.append(ids[s])
        else:
            out.extend(ids[f"<0x{b:02X}>"] for b in s.encode("utf-8"))
    return out


def test_spm_hand_checked(spm):
    tid = spm.token_to_id
    assert spm.model == "llama" and spm.add_bos and not spm.add_eos and spm.add_space_prefix
    assert (spm.bos_id, spm.eos_id, spm.unk_id) == (1, 2, 0)  # llama.cpp's defaults
    # "▁hello": ll, he, ▁he, llo, ▁hello by falling score.
    assert spm.encode("hello") == [1, tid("▁hello")]
    assert spm.encode("hello world", add_special=False) == [tid("▁hello"), tid("▁world")]
    # 'i' is no token: byte fallback; so are both bytes of 'é'.
    assert spm.encode("hi", add_special=False) == [tid("▁"), tid("h"), tid("<0x69>")]
    assert spm.encode("é", add_special=False) == [tid("▁"), tid("<0xC3>"), tid("<0xA9>")]
    assert spm.encode("", add_special=True) == [1]
    assert spm.encode("", add_special=False) == []
    # Pieces: U+2581 is a space, byte tokens are their byte, control tokens their text.
    assert spm.token_to_piece(tid("▁hello")) == b" hello"
    assert spm.token_to_piece(tid("<0xC3>")) == b"\xc3"
    assert spm.token_to_piece(1) == b"<s>" and spm.token_to_piece(1, skip_special=True) == b""
    # Detokenizing drops the space the tokenizer put in front, as llama.cpp does: the first
    # token's leading space, even when that token is BOS (which then has none to drop).
    assert spm.decode([tid("▁hello"), tid("▁world")]) == "hello world"
    assert spm.decode(spm.encode("hello")) == "<s> hello"
    assert spm.decode(spm.encode("hello"), skip_special=True) == " hello"
    assert spm.decode([tid("▁hello")], continuation=True) == " hello"


def test_spm_special_tokens_and_space_prefix(spm):
    tid = spm.token_to_id
    # After a special token the next text fragment gets its own space prefix.
    ids = spm.encode("hello</s>world", add_special=False, parse_special=True)
    assert ids == [tid("▁hello"), 2, tid("▁world")]
    # Without parse_special "</s>" is plain text (byte-fallback pieces here), but the
    # user-defined <tool> is always a token, and it too is followed by a space prefix.
    plain = spm.encode("a</s><tool>b", add_special=False)
    assert 2 not in plain and tid("<tool>") in plain
    assert plain[-2:] == [tid("▁"), tid("b")]
    assert spm.decode(plain) == "a</s><tool> b"


def test_spm_matches_reference_algorithm(spm):
    tokens, _, scores = spm_tokens()
    rng = random.Random(7)
    alphabet = ["h", "e", "l", "o", "w", "r", "d", "a", "b", " ", "  ", "\n", "中", "文", "é", "😀",
                "hello", "world", "aaa", "ab"]
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        want = spm_reference(text, tokens, scores)
        assert spm.encode(text, add_special=False) == want, repr(text)
        assert spm.decode(want) == text


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_spm_round_trip_and_stream(spm, text):
    ids = spm.encode(text, add_special=False)
    assert spm.decode(ids) == text
    pieces, tail = _stream(spm, ids)
    assert "".join(pieces) + tail == text
    assert all("\ufffd" not in p for p in pieces)


def test_spm_stream_emoji_over_byte_tokens(spm):
    ids = spm.encode("😀", add_special=False)
    assert ids[1:] == [spm.token_to_id(f"<0x{b:02X}>") for b in "😀".encode()]
    pieces, tail = _stream(spm, ids)
    assert pieces == ["", "", "", "", "😀"] and tail == ""  # "▁" loses its space: first token


def test_spm_without_space_prefix(tmp_path):
    tokens, types, scores = spm_tokens()
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "np.gguf", model="llama", tokens=tokens,
                                         types=types, scores=scores, add_space_prefix=False,
                                         add_bos_token=False, add_eos_token=True))
    tid = tok.token_to_id
    assert tok.encode("hello world") == [tid("he"), tid("llo"), tid("▁world"), 2]
    assert tok.encode("hello world") == spm_reference("hello world", tokens, scores, False) + [2]
    for text in CORPUS:
        assert tok.decode(tok.encode(text, add_special=False)) == text


# ---------------------------------------------------------------------------------------------
# Streaming equals one-shot decoding for any ids
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def clean_spaces_tok(gpt2_pair):
    return gpt2_pair[1]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stream_equals_decode_any_ids(smol, spm, clean_spaces_tok, data):
    tok = data.draw(st.sampled_from([smol, spm, clean_spaces_tok]))
    # Mostly ids of spaces, punctuation, apostrophes and partial UTF-8, which are the cases
    # that streaming has to hold back; some fully random ids.
    interesting = sorted({t for s in [" ", " .", " ,", " '", "'s", "re", " ?", "!", "a", "😀",
                                      "中", "  ", "é"] for t in tok.encode(s, add_special=False)}
                         | {0, 1, 2})
    ids = data.draw(st.lists(st.one_of(st.sampled_from(interesting),
                                       st.integers(0, tok.n_vocab - 1)), max_size=30))
    skip = data.draw(st.booleans())
    cont = data.draw(st.booleans())
    pieces, tail = _stream(tok, ids, skip_special=skip, continuation=cont)
    assert "".join(pieces) + tail == tok.decode(ids, skip_special=skip, continuation=cont)


# ---------------------------------------------------------------------------------------------
# Against llama.cpp itself, when llama-cpp-python is installed (it is a bench dependency)
# ---------------------------------------------------------------------------------------------

def _llama_cpp_vocab(path):
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)

    def tokenize(text, add_special, parse_special):
        data = text.encode()
        buf = (llama_cpp.llama_token * (len(data) + 8))()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, len(buf), add_special,
                                     parse_special)
        assert n >= 0
        return list(buf[:n])

    def detokenize(ids, special):
        import ctypes

        arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
        out = ctypes.create_string_buffer(64 * len(ids) + 64)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), out, len(out), False, special)
        assert n >= 0
        return out.raw[:n].decode("utf-8", errors="replace")

    return llm, tokenize, detokenize


def _random_texts(seed, n):
    rng = random.Random(seed)
    ranges = [(0x20, 0x7E), (0x9, 0xD), (0xA0, 0x2FF), (0x300, 0x36F), (0x400, 0x4FF),
              (0x600, 0x6FF), (0x2000, 0x206F), (0x3000, 0x303F), (0x4E00, 0x4E80),
              (0x1F300, 0x1F64F), (0x1D400, 0x1D4FF)]
    words = [" ", "  ", "\n", "'s", "'RE", "123", "4567", "<tool>", "<|im_end|>", "<s>", " .",
             " ,", "hello", " world"]
    texts = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 30)):
            if rng.random() < 0.4:
                parts.append(rng.choice(words))
            else:
                lo, hi = rng.choice(ranges)
                parts.append(chr(rng.randint(lo, hi)))
        texts.append("".join(parts))
    return texts


@pytest.mark.parametrize("pre", ["smollm", "qwen2", "llama3", "gpt-2", "tekken", "gpt-4o"])
def test_against_llama_cpp_bpe(gpt2_pair, tmp_path, pre):
    hf, _ = gpt2_pair
    path = byte_level_gguf(hf, tmp_path / f"{pre}.gguf", pre,
                           extra=[("<tool>", TOKEN_TYPE_USER_DEFINED)])
    llm, tokenize, detokenize = _llama_cpp_vocab(path)
    tok = Tokenizer.from_gguf(path)
    for text in CORPUS + _random_texts(sum(map(ord, pre)), 150):
        for parse_special in (False, True):
            ids = tokenize(text, True, parse_special)
            assert tok.encode(text, parse_special=parse_special) == ids, repr(text)
            assert tok.decode(ids) == detokenize(ids, True)
            assert tok.decode(ids, skip_special=True) == detokenize(ids, False)


def test_against_llama_cpp_spm(tmp_path):
    tokens, types, scores = spm_tokens()
    path = write_gguf(tmp_path / "spm.gguf", model="llama", tokens=tokens, types=types,
                      scores=scores, bos_token_id=1, eos_token_id=2, unknown_token_id=0)
    llm, tokenize, detokenize = _llama_cpp_vocab(path)
    tok = Tokenizer.from_gguf(path)
    for text in CORPUS + _random_texts(3, 200):
        for add_special in (False, True):
            for parse_special in (False, True):
                ids = tokenize(text, add_special, parse_special)
                assert tok.encode(text, add_special, parse_special) == ids, repr(text)
                assert tok.decode(ids) == detokenize(ids, True)
                assert tok.decode(ids, skip_special=True) == detokenize(ids, False)


# ---------------------------------------------------------------------------------------------
# Bad metadata
# ---------------------------------------------------------------------------------------------

def test_bad_metadata_is_a_clear_error():
    with pytest.raises(ValueError, match="no tokenizer.ggml.tokens"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.model 'bert'"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ValueError, match="no tokenizer.ggml.merges"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
                                 "tokenizer.ggml.tokens": ["a", "b"]})
    with pytest.raises(ValueError, match="cannot open GGUF file"):
        Tokenizer.from_gguf("/nonexistent/model.gguf")


# ---------------------------------------------------------------------------------------------
# Command lines
# ---------------------------------------------------------------------------------------------

def _tokenize_cli(*args):
    return subprocess.run([sys.executable, "-m", "pyspec.tokenize_cli", *args], cwd=tempfile.gettempdir(),
                          env=subprocess_env(), capture_output=True, timeout=120)


def test_tokenize_cli_ids_match_llama_cpp(smol):
    cases = _greedy_cases()
    prompt = cases[1]["prompt"]  # code with quotes and newlines
    proc = _tokenize_cli("-p", prompt, "--ids")
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode() == "[" + ", ".join(map(str, cases[1]["prompt_ids"])) + "]\n"

    chat = cases[-1]
    proc = _tokenize_cli("-m", default_model_path(), "-p", chat["templated_prompt"], "--ids",
                         "--parse-special")
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout) == chat["prompt_ids"]


def test_tokenize_cli_pieces_and_file(smol, tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_bytes("Hi\n😀".encode())
    proc = _tokenize_cli("-f", str(path), "--show-count")
    assert proc.returncode == 0, proc.stderr.decode()
    ids = smol.encode("Hi\n😀")
    want = b"".join(f"{t:6d} -> '".encode() + smol.token_to_piece(t) + b"'\n" for t in ids)
    assert proc.stdout == want + f"Total number of tokens: {len(ids)}\n".encode()


@pytest.mark.parametrize("args, message", [
    (["-m", "/nonexistent/model.gguf", "-p", "x"], "cannot open GGUF file"),
    (["-p", "x", "-f", "y"], "not allowed with"),
    (["--ids"], "no text"),
    (["-f", "/nonexistent/prompt.txt"], "text file '/nonexistent/prompt.txt' not found"),
])
def test_tokenize_cli_errors(args, message):
    proc = _tokenize_cli(*args)
    err = proc.stderr.decode()
    assert proc.returncode == 1
    assert proc.stdout == b""
    assert message in err and "Traceback" not in err
    assert len([ln for ln in err.splitlines() if ln.strip()]) == 1, err


def test_process_escapes_like_llama_cpp():
    assert process_escapes(rb"a\nb\tc\\d\'e\"f") == b"a\nb\tc\\d'e\"f"
    assert process_escapes(rb"\x41\x4a\xzz\q") == b"AJ\\xzz\\q"
    assert process_escapes(b"end\\") == b"end\\"
    assert process_escapes(rb"\x4") == rb"\x4"


# ---------------------------------------------------------------------------------------------
# pyspec-perplexity -f
# ---------------------------------------------------------------------------------------------

def test_perplexity_text_ids_match_llama_cpp(smol):
    # llama-perplexity -f drops the file's final newline, then tokenizes with add_special.
    ids = perplexity.load_text_ids(str(LICENSE_TXT), smol)
    assert ids == json.loads(LICENSE_IDS.read_text())[:-1]


def test_perplexity_from_text_equals_from_ids(smol, tmp_path, capsys):
    text = LICENSE_TXT.read_text(encoding="utf-8")[:1800]
    text_path = tmp_path / "part.txt"
    text_path.write_text(text, encoding="utf-8")
    ids = smol.encode(text[:-1] if text.endswith("\n") else text)
    assert len(ids) >= 2 * 128
    ids_path = tmp_path / "part.json"
    ids_path.write_text(json.dumps(ids))

    assert perplexity.main(["-f", str(text_path), "-c", "128", "-t", "2"]) == 0
    from_text = capsys.readouterr().out
    assert perplexity.main(["--ids", str(ids_path), "-c", "128", "-t", "2"]) == 0
    from_ids = capsys.readouterr().out
    final = [ln for ln in from_text.splitlines() if ln.startswith("Final estimate: PPL = ")]
    assert len(final) == 1 and from_text == from_ids
