"""pyspec-convert (pyspec/convert/) on tiny random Hugging Face checkpoints (tools/make_tiny_models.py).

Targets: converted at every outtype, loaded by pyspec's core, and their logits compared with a
numpy forward pass computed from the safetensors weights in Hugging Face's own layout and rope
convention (tests/hf_reference.py), so the Q/K reordering for llama.cpp's rope is checked
independently of the converter. The stored tensors are also compared with the checkpoint value by
value. Drafters (no runtime yet) are read back with gguf.GGUFReader and checked key by key and
tensor by tensor against the table in shared/docs/reference/dflash-dspark.md §3.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from conftest import subprocess_env  # noqa: E402

import hf_reference  # noqa: E402
import make_tiny_models as tiny  # noqa: E402
import pyspec  # noqa: E402
from pyspec.convert import ConversionError, convert, main  # noqa: E402

Q = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType
OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")
QTYPE = {o: Q[o.upper()] for o in OUTTYPES}
# Relative logit tolerance, max|pyspec - reference| / std(reference). The reference rounds the
# weights as the file stores them and quantizes activations as the engine does, so what is left is
# float32 arithmetic (measured <= 1e-3 over 8 seeds per architecture) and, for block-quantized
# types, activations within float noise of an 8-bit rounding tie, which the two resolve
# differently (measured <= 2.5e-2). A layout error in the converter costs O(1).
LOGIT_TOL = {"f32": 5e-3, "f16": 5e-3, "bf16": 5e-3, "q8_0": 0.1, "q4_0": 0.1, "q4_1": 0.1}
ARCHS = ("llama", "qwen3")


# ---------------------------------------------------------------------------------------------
# helpers

def read(path):
    """(metadata {key: (value, types)}, tensors {name: (ne list, type name, reader tensor)})."""
    r = gguf.GGUFReader(str(path))
    kv = {}
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        kv[key] = (f.contents(), [t for t in f.types])
    tensors = {t.name: ([int(x) for x in t.shape], t.tensor_type.name, t) for t in r.tensors}
    return kv, tensors


def value(kv, key):
    return kv[key][0]


def dequant(t) -> np.ndarray:
    """A reader tensor as float32 in numpy order [rows, row length]."""
    data = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    return np.asarray(data, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])


def rel_err(got, ref) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.std(ref))


def rope_pairs_order(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of each head reordered from Hugging Face's halves (i, i + d/2) to llama.cpp's pairs
    (2i, 2i + 1), written index by index (independently of the converter's reshape)."""
    d = w.shape[0] // n_head
    order = []
    for h in range(n_head):
        for i in range(d // 2):
            order += [h * d + i, h * d + i + d // 2]
    return w[order]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("convert")


_targets = {}


def target(root, arch):
    if arch not in _targets:
        _targets[arch] = tiny.make_target(root / f"hf-{arch}", arch, seed=ARCHS.index(arch))
    return _targets[arch]


_converted = {}


def converted(root, arch, outtype):
    key = (arch, outtype)
    if key not in _converted:
        out = root / f"{arch}-{outtype}.gguf"
        summary = convert(target(root, arch).path, out, outtype, progress=False)
        assert summary.path == out and out.stat().st_size == summary.n_bytes
        _converted[key] = out
    return _converted[key]


# ---------------------------------------------------------------------------------------------
# targets

@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_target_logits_match_hf_reference(root, arch, outtype):
    tm = target(root, arch)
    path = converted(root, arch, outtype)
    tokens = np.random.default_rng(7).integers(0, tm.n_vocab, 16)
    weights, act = hf_reference.stored_as(tm.weights, outtype)
    ref = hf_reference.forward(tm.config, weights, tokens, act_quant=act)

    m = pyspec.Model(str(path), n_threads=2)
    cfg = tm.config
    assert (m.arch, m.n_vocab, m.n_embd, m.n_layer) == (arch, tm.n_vocab, cfg["hidden_size"],
                                                       cfg["num_hidden_layers"])
    assert (m.n_head, m.n_head_kv) == (cfg["num_attention_heads"], cfg["num_key_value_heads"])
    assert m.head_dim == cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    assert m.n_ctx_train == cfg["max_position_embeddings"]
    ctx = pyspec.Context(m, n_ctx=64, n_batch=32)
    got = ctx.decode(tokens, output=np.ones(len(tokens), bool)).logits
    err = rel_err(got, ref)
    print(f"{arch} {outtype}: logits rel err {err:.2e}")
    assert err < LOGIT_TOL[outtype]
    if outtype in ("q4_0", "q4_1"):
        # The comparison is sensitive to what the file holds: 4-bit weights are far from the
        # checkpoint's own values (measured > 1.2).
        exact = hf_reference.forward(tm.config, tm.weights, tokens)
        assert rel_err(got, exact) > 0.5


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_target_tensors_hold_the_checkpoint(root, arch, outtype):
    tm = target(root, arch)
    kv, tensors = read(converted(root, arch, outtype))
    cfg = tm.config
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if not cfg["tie_word_embeddings"]:
        names["output.weight"] = "lm_head.weight"
    layer = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    if arch == "qwen3":
        layer.update(attn_q_norm="self_attn.q_norm", attn_k_norm="self_attn.k_norm")
    for il in range(cfg["num_hidden_layers"]):
        for g, h in layer.items():
            names[f"blk.{il}.{g}.weight"] = f"model.layers.{il}.{h}.weight"
    assert set(tensors) == set(names)

    expected_weights, _ = hf_reference.stored_as(tm.weights, outtype)
    for gname, hname in names.items():
        ne, tname, t = tensors[gname]
        w = tm.weights[hname]
        assert ne == list(reversed(w.shape)), gname
        if w.ndim == 1:
            want_type = "F32"
        elif outtype in ("q8_0", "q4_0", "q4_1") and w.shape[1] % 32:
            want_type = "F16"
        else:
            want_type = QTYPE[outtype].name
        assert tname == want_type, gname
        want = expected_weights[hname]
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            want = rope_pairs_order(want, n_head if "attn_q" in gname else n_kv)
        np.testing.assert_array_equal(dequant(t), want, err_msg=gname)
    if arch == "qwen3" and outtype.startswith("q"):
        assert tensors["blk.0.ffn_down.weight"][1] == "F16"   # rows of 80: not block-quantizable

    assert value(kv, "general.architecture") == arch
    assert value(kv, "general.file_type") == {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2,
                                              "q4_1": 3}[outtype]
    a = arch + "."
    expect = {
        a + "context_length": (cfg["max_position_embeddings"], VT.UINT32),
        a + "embedding_length": (cfg["hidden_size"], VT.UINT32),
        a + "block_count": (cfg["num_hidden_layers"], VT.UINT32),
        a + "feed_forward_length": (cfg["intermediate_size"], VT.UINT32),
        a + "attention.head_count": (n_head, VT.UINT32),
        a + "attention.head_count_kv": (n_kv, VT.UINT32),
        a + "rope.dimension_count": (cfg.get("head_dim", cfg["hidden_size"] // n_head), VT.UINT32),
        a + "vocab_size": (tm.n_vocab, VT.UINT32),
    }
    if arch == "qwen3":
        expect[a + "attention.key_length"] = (cfg["head_dim"], VT.UINT32)
        expect[a + "attention.value_length"] = (cfg["head_dim"], VT.UINT32)
    else:
        assert a + "attention.key_length" not in kv
    for key, (v, t) in expect.items():
        assert kv[key] == (v, [t]), key
    assert kv[a + "rope.freq_base"][1] == [VT.FLOAT32]
    assert value(kv, a + "rope.freq_base") == pytest.approx(cfg["rope_theta"])
    assert value(kv, a + "attention.layer_norm_rms_epsilon") == pytest.approx(cfg["rms_norm_eps"])


@pytest.mark.parametrize("arch", ARCHS)
def test_target_tokenizer(root, arch):
    tm = target(root, arch)
    kv, _ = read(converted(root, arch, "f16"))
    tok = json.loads((tm.path / "tokenizer.json").read_text())
    tok_cfg = json.loads((tm.path / "tokenizer_config.json").read_text())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    added = {a["id"]: a for a in tok["added_tokens"]}
    tokens = value(kv, "tokenizer.ggml.tokens")
    types = value(kv, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == tm.n_vocab
    for i in range(tm.n_vocab):
        if i in added:
            assert tokens[i] == added[i]["content"]
            assert types[i] == (3 if added[i]["special"] else 4)      # CONTROL / USER_DEFINED
        elif i in by_id:
            assert (tokens[i], types[i]) == (by_id[i], 1)             # NORMAL
        else:
            assert (tokens[i], types[i]) == (f"[PAD{i}]", 5)          # UNUSED embedding rows
    assert types[tokens.index(tiny.USER_TOKEN)] == 4
    if arch == "qwen3":
        assert len(tokens) > len(by_id) + len(added)                  # the padded vocabulary
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    assert value(kv, "tokenizer.ggml.merges") == merges
    assert value(kv, "tokenizer.ggml.model") == "gpt2"
    assert value(kv, "tokenizer.ggml.pre") == {"llama": "llama-bpe", "qwen3": "qwen2"}[arch]
    ids = {a["content"]: a["id"] for a in tok["added_tokens"]}
    assert value(kv, "tokenizer.ggml.eos_token_id") == ids[tok_cfg["eos_token"]]
    if arch == "llama":
        assert value(kv, "tokenizer.ggml.bos_token_id") == ids["<|begin_of_text|>"]
        # Llama 3 style: BOS comes from the template post-processor, not tokenizer_config.json.
        assert "add_bos_token" not in tok_cfg and value(kv, "tokenizer.ggml.add_bos_token") is True
        assert "tokenizer.ggml.padding_token_id" not in kv
    else:
        # No bos_token in tokenizer_config.json: config.json's bos_token_id is used.
        assert value(kv, "tokenizer.ggml.bos_token_id") == tm.config["bos_token_id"]
        assert value(kv, "tokenizer.ggml.padding_token_id") == ids["<|endoftext|>"]
        assert value(kv, "tokenizer.ggml.add_bos_token") is False
    assert value(kv, "tokenizer.ggml.add_eos_token") is False
    assert value(kv, "tokenizer.chat_template") == tok_cfg["chat_template"]


@pytest.mark.parametrize("style", tiny.TOKENIZER_STYLES)
def test_pre_tokenizer_name_from_rules(root, style, caplog):
    tm = tiny.make_target(root / f"pre-{style}", "llama", seed=3, tokenizer=style)
    out = root / f"pre-{style}.gguf"
    with caplog.at_level("WARNING", logger="pyspec.convert"):
        convert(tm.path, out, "f32", progress=False)
    kv, _ = read(out)
    if style == "whitespace":
        assert value(kv, "tokenizer.ggml.pre") == "default"
        assert "unrecognised pre-tokenizer (WhitespaceSplit + ByteLevel)" in caplog.text
        assert "tokenizer.ggml.pre = 'default'" in caplog.text
    else:
        assert value(kv, "tokenizer.ggml.pre") == style
        assert "pre-tokenizer" not in caplog.text


def test_bf16_f16_storage_and_sharded_checkpoints(root):
    single = tiny.make_target(root / "st-single", "qwen3", seed=5, dtype="bfloat16")
    sharded = tiny.make_target(root / "st-sharded", "qwen3", seed=5, dtype="bfloat16", shards=3)
    assert len(list(sharded.path.glob("model-0000?-of-00003.safetensors"))) == 3
    assert (sharded.path / "model.safetensors.index.json").is_file()
    a, b = root / "st-single.gguf", root / "st-sharded.gguf"
    convert(single.path, a, "f32", progress=False)
    convert(sharded.path, b, "f32", progress=False)
    kv_a, t_a = read(a)
    kv_b, t_b = read(b)
    kv_a.pop("general.name"), kv_b.pop("general.name")
    assert kv_a == kv_b and list(t_a) == list(t_b)
    for name, (_, tname, t) in t_a.items():
        assert tname == "F32"
        np.testing.assert_array_equal(dequant(t), dequant(t_b[name][2]))
    np.testing.assert_array_equal(dequant(t_a["token_embd.weight"][2]),
                                  single.weights["model.embed_tokens.weight"])
    # bf16 storage really was bf16: the low 16 bits of every stored float32 are zero.
    assert not np.any(dequant(t_a["output.weight"][2]).view(np.uint32) & 0xFFFF)

    half = tiny.make_target(root / "st-half", "llama", seed=6, dtype="float16")
    convert(half.path, root / "st-half.gguf", "f16", progress=False)
    _, t_h = read(root / "st-half.gguf")
    np.testing.assert_array_equal(dequant(t_h["blk.1.ffn_up.weight"][2]),
                                  half.weights["model.layers.1.mlp.up_proj.weight"])


def test_conversion_is_deterministic(root):
    tm = target(root, "qwen3")
    draft = tiny.make_drafter(root / "det-draft", tm, "speculators", seed=11)
    tiny.write_mask_embedding(draft.path, 64, "npy")
    for src, kw, outtype in ((tm.path, {}, "q4_1"),
                             (draft.path, {"target_model_dir": tm.path}, "q8_0")):
        a, b = root / "det-a.gguf", root / "det-b.gguf"
        convert(src, a, outtype, progress=False, **kw)
        convert(src, b, outtype, progress=False, **kw)
        assert a.read_bytes() == b.read_bytes()


def test_rope_scaling(root):
    # linear: keys llama.cpp reads, and the logits follow (positions divided by the factor).
    tm = tiny.make_target(root / "rope-linear", "llama", seed=12,
                          rope_scaling={"rope_type": "linear", "factor": 4.0})
    out = root / "rope-linear.gguf"
    convert(tm.path, out, "f32", progress=False)
    kv, _ = read(out)
    assert value(kv, "llama.rope.scaling.type") == "linear"
    assert value(kv, "llama.rope.scaling.factor") == 4.0
    tokens = np.random.default_rng(3).integers(0, tm.n_vocab, 20)
    ref = hf_reference.forward(tm.config, tm.weights, tokens)
    unscaled = hf_reference.forward(dict(tm.config, rope_scaling=None), tm.weights, tokens)
    ctx = pyspec.Context(pyspec.Model(str(out), n_threads=2), n_ctx=64, n_batch=32)
    got = ctx.decode(tokens, output=np.ones(len(tokens), bool)).logits
    assert rel_err(got, ref) < LOGIT_TOL["f32"] < rel_err(got, unscaled)

    # yarn: type, factor and the original context length.
    tm = tiny.make_target(root / "rope-yarn", "qwen3", seed=13, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    convert(tm.path, root / "rope-yarn.gguf", "f32", progress=False)
    kv, _ = read(root / "rope-yarn.gguf")
    assert value(kv, "qwen3.rope.scaling.type") == "yarn"
    assert kv["qwen3.rope.scaling.original_context_length"] == (64, [VT.UINT32])

    # llama3 (Llama 3.1): no keys, a rope_freqs tensor of per-frequency divisors. head_dim 16,
    # theta 1e4: wavelengths 2*pi*1e4^(i/8), i = 0..7; those under 8192/4 keep 1, the one over
    # 8192 gets the factor, 2*pi*1e4^(6/8) = 6283 is interpolated:
    # s = (8192/6283 - 1) / 3, divisor 1 / ((1 - s) / 8 + s).
    tm = tiny.make_target(root / "rope-llama3", "llama", seed=14, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    convert(tm.path, root / "rope-llama3.gguf", "q8_0", progress=False)
    kv, tensors = read(root / "rope-llama3.gguf")
    assert "llama.rope.scaling.type" not in kv
    ne, tname, t = tensors["rope_freqs.weight"]
    smooth = (8192 / (2 * np.pi * 1e4 ** 0.75) - 1) / 3
    want = [1, 1, 1, 1, 1, 1, 1 / ((1 - smooth) / 8 + smooth), 8]
    assert (ne, tname) == ([8], "F32")
    np.testing.assert_allclose(dequant(t), want, rtol=1e-6)

    tm = tiny.make_target(root / "rope-dynamic", "llama", seed=15,
                          rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ConversionError, match="rope scaling type 'dynamic' is not supported"):
        convert(tm.path, root / "x.gguf", progress=False)


# ---------------------------------------------------------------------------------------------
# drafters

E, H, HKV, D, F, R = 64, 4, 2, 16, 128, 32


def drafter_tensor_table(n_tl, v, vd, *, token_embd, output, d2t, markov, conf):
    """GGUF name -> ne, from the reference's §3.3 table."""
    t = {"fc.weight": [n_tl * E, E], "enc.output_norm.weight": [E], "output_norm.weight": [E],
         "blk.0.attn_norm.weight": [E], "blk.0.attn_q.weight": [E, H * D],
         "blk.0.attn_k.weight": [E, HKV * D], "blk.0.attn_v.weight": [E, HKV * D],
         "blk.0.attn_output.weight": [H * D, E], "blk.0.attn_q_norm.weight": [D],
         "blk.0.attn_k_norm.weight": [D], "blk.0.ffn_norm.weight": [E],
         "blk.0.ffn_gate.weight": [E, F], "blk.0.ffn_up.weight": [E, F], "blk.0.ffn_down.weight": [F, E]}
    if token_embd:
        t["token_embd.weight"] = [E, v]
    if output:
        t["output.weight"] = [E, vd]
    if d2t:
        t["d2t"] = [vd]
    if markov:
        t["markov_w1.weight"] = [R, v]
        t["markov_w2.weight"] = [R, vd]
    if conf:
        t["conf_proj.weight"] = [E + R, 1]
        t["conf_proj.bias"] = [1]
    return t


def check_drafter(path, tm, draft, outtype, *, gguf_layers, block_size, mask_id, dspark=None,
                  tensors_expected):
    """Every dflash.* key (value and type) and every tensor (name, ne, type) of a drafter file."""
    kv, tensors = read(path)
    expect = {
        "dflash.context_length": (256, VT.UINT32),
        "dflash.embedding_length": (E, VT.UINT32),
        "dflash.block_count": (1, VT.UINT32),
        "dflash.feed_forward_length": (F, VT.UINT32),
        "dflash.attention.head_count": (H, VT.UINT32),
        "dflash.attention.head_count_kv": (HKV, VT.UINT32),
        "dflash.attention.key_length": (D, VT.UINT32),
        "dflash.attention.value_length": (D, VT.UINT32),
        "dflash.rope.dimension_count": (D, VT.UINT32),
        "dflash.target_layers": (gguf_layers, VT.INT32),
        "dflash.block_size": (block_size, VT.UINT32),
        "dflash.attention.causal": (False, VT.BOOL),
    }
    if dspark is not None:
        expect["dflash.sample_from_anchor"] = (dspark[0], VT.BOOL)
        expect["dflash.has_confidence_head"] = (dspark[1], VT.BOOL)
    assert value(kv, "general.architecture") == "dflash"
    assert {k for k in kv if k.startswith("dflash.")} == set(expect) | {
        "dflash.rope.freq_base", "dflash.attention.layer_norm_rms_epsilon"}
    for key, (v, t) in expect.items():
        assert kv[key][0] == v, key
        assert kv[key][1][-1] == t, key
    assert kv["dflash.rope.freq_base"] == (pytest.approx(1e6), [VT.FLOAT32])
    assert kv["dflash.attention.layer_norm_rms_epsilon"] == (pytest.approx(1e-6), [VT.FLOAT32])
    assert kv["tokenizer.ggml.mask_token_id"] == (mask_id, [VT.UINT32])

    assert {n: ne for n, (ne, _, _) in tensors.items()} == tensors_expected
    for name, (ne, tname, _) in tensors.items():
        if name == "d2t":
            want = "I64"
        elif len(ne) == 1:
            want = "F32"
        else:
            want = QTYPE[outtype].name           # every row length here is a multiple of 32
        assert tname == want, name
    return kv, tensors


def tokenizer_keys(kv):
    return {k: v for k, v in kv.items()
            if k.startswith("tokenizer.") and k != "tokenizer.ggml.mask_token_id"}


@pytest.mark.parametrize("target_form", ["dir", "gguf"])
def test_dflash_drafter(root, target_form):
    tm = target(root, "qwen3")
    draft = tiny.make_drafter(root / "dflash", tm, "dflash", seed=21)
    tdir = tm.path if target_form == "dir" else converted(root, "qwen3", "q8_0")
    out = root / f"dflash-{target_form}.gguf"
    convert(draft.path, out, "f16", target_model_dir=tdir, progress=False)
    mask_id = draft.config["dflash_config"]["mask_token_id"]
    kv, tensors = check_drafter(
        out, tm, draft, "f16", gguf_layers=[0, 1], block_size=16, mask_id=mask_id,
        tensors_expected=drafter_tensor_table(2, tm.n_vocab, tm.n_vocab, token_embd=False,
                                              output=False, d2t=False, markov=False, conf=False))
    # The target's tokenizer, whichever form the target came in.
    target_kv, _ = read(converted(root, "qwen3", "f16"))
    assert tokenizer_keys(kv) == tokenizer_keys(target_kv)
    # Weights as they are: NEOX rope needs no reordering of a Qwen3-style drafter.
    np.testing.assert_array_equal(dequant(tensors["fc.weight"][2]),
                                  draft.weights["fc.weight"].astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(dequant(tensors["blk.0.attn_q.weight"][2]),
                                  draft.weights["layers.0.self_attn.q_proj.weight"].astype(np.float16))
    np.testing.assert_array_equal(dequant(tensors["enc.output_norm.weight"][2]),
                                  draft.weights["hidden_norm.weight"])


DSPARK_VARIANTS = {
    # name: (make_drafter kwargs, sample_from_anchor, has_confidence_head)
    "deepspec": (dict(kind="dspark"), True, True),
    "deepspec-noconf-bonus": (dict(kind="dspark", confidence_head=False, sample_from_anchor=False),
                              False, False),
    "speculators": (dict(kind="speculators"), False, True),
    "speculators-anchor": (dict(kind="speculators", sample_from_anchor=True, confidence_head=False),
                           True, False),
}


@pytest.mark.parametrize("variant", list(DSPARK_VARIANTS))
def test_dspark_drafter_layouts_and_confidence_flag(root, variant):
    kwargs, anchor, conf = DSPARK_VARIANTS[variant]
    tm = target(root, "qwen3")
    draft = tiny.make_drafter(root / f"dspark-{variant}", tm, seed=31, **kwargs)
    out = root / f"dspark-{variant}.gguf"
    summary = convert(draft.path, out, "q8_0", target_model_dir=tm.path, progress=False)
    speculators = kwargs["kind"] == "speculators"
    v = tm.n_vocab
    vd = 64 if speculators else v
    kv, tensors = check_drafter(
        out, tm, draft, "q8_0", gguf_layers=[0, 1], block_size=8 if speculators else 7,
        mask_id=draft.config["mask_token_id"], dspark=(anchor, conf),
        tensors_expected=drafter_tensor_table(2, v, vd, token_embd=False, output=speculators,
                                              d2t=speculators, markov=True, conf=conf))
    if not speculators:
        # A full-vocabulary DSpark head is the target's: dropped, as llama.cpp's converter does.
        assert any("lm_head.weight not written" in n for n in summary.notes)
    else:
        d2t = tensors["d2t"][2]
        absolute = np.asarray(d2t.data).reshape(-1)
        np.testing.assert_array_equal(absolute, draft.weights["d2t"] + np.arange(vd))
        assert np.all(np.diff(absolute) > 0) and absolute[-1] < v
    w1 = dequant(tensors["markov_w1.weight"][2])
    want = gguf.quants.dequantize(gguf.quants.quantize(draft.weights["markov_head.markov_w1.weight"],
                                                       Q.Q8_0), Q.Q8_0)
    np.testing.assert_array_equal(w1, want)
    if conf:
        np.testing.assert_array_equal(dequant(tensors["conf_proj.bias"][2]),
                                      draft.weights["confidence_head.proj.bias"])


def test_drafter_interleaved_rope_is_reordered_for_neox(root):
    tm = target(root, "qwen3")
    draft = tiny.make_drafter(root / "dflash-gptj", tm, "dflash", seed=41, rope_is_neox_style=False)
    out = root / "dflash-gptj.gguf"
    convert(draft.path, out, "f32", target_model_dir=tm.path, progress=False)
    _, tensors = read(out)
    # Pairs (2i, 2i+1) become halves (i, i + d/2): the inverse of rope_pairs_order.
    for gname, hname, n in (("attn_q", "q_proj", H), ("attn_k", "k_proj", HKV),
                            ("attn_q_norm", "q_norm", 1), ("attn_k_norm", "k_norm", 1)):
        got = dequant(tensors[f"blk.0.{gname}.weight"][2])
        w = draft.weights[f"layers.0.self_attn.{hname}.weight"]
        np.testing.assert_array_equal(rope_pairs_order(got, n), w)
        assert not np.array_equal(got, w)


def test_drafter_optional_keys(root, caplog):
    tm = target(root, "qwen3")
    mrope = root / "hf-qwen3-mrope"
    mrope.mkdir(exist_ok=True)
    for f in tm.path.iterdir():
        (mrope / f.name).write_bytes(f.read_bytes())
    cfg = dict(tm.config, rope_scaling={"rope_type": "default", "mrope_section": [4, 2, 2]})
    (mrope / "config.json").write_text(json.dumps(cfg))
    draft = tiny.make_drafter(
        root / "dflash-options", tm, "dflash", seed=71, num_layers=2, target_layer_ids=[0, 1],
        hidden_act="gelu_pytorch_tanh", input_embedding_scale=8.0, final_logit_softcapping=30.0,
        use_sliding_window=True, sliding_window=32,
        layer_types=["sliding_attention", "full_attention"], is_causal=True)
    out = root / "dflash-options.gguf"
    with caplog.at_level("WARNING", logger="pyspec.convert"):
        convert(draft.path, out, "f16", target_model_dir=mrope, progress=False)
    assert "target layer id 1 reads the output of the last layer" in caplog.text
    kv, tensors = read(out)
    assert value(kv, "dflash.target_layers") == [1, 2]
    assert value(kv, "dflash.block_count") == 2 and "blk.1.ffn_down.weight" in tensors
    assert value(kv, "dflash.hidden_activation") == "gelu_pytorch_tanh"
    assert value(kv, "dflash.embedding_scale") == 8.0
    assert value(kv, "dflash.final_logit_softcapping") == 30.0
    assert kv["dflash.attention.sliding_window"] == (32, [VT.UINT32])
    assert value(kv, "dflash.attention.sliding_window_pattern") == [True, False]
    assert value(kv, "dflash.attention.causal") is True
    assert value(kv, "dflash.rope.dimension_sections") == [D // 2, 0, 0, 0]


@pytest.mark.parametrize("fmt,target_form", [("npy", "dir"), ("safetensors", "gguf")])
def test_mask_embedding_patches_a_draft_owned_token_embd(root, fmt, target_form):
    tm = target(root, "qwen3")
    draft = tiny.make_drafter(root / f"mask-{fmt}", tm, "dflash", seed=51)
    mask_id = draft.config["dflash_config"]["mask_token_id"]
    vec = tiny.write_mask_embedding(draft.path, E, fmt,
                                    mask_token_id=mask_id if fmt == "safetensors" else None)
    tdir = tm.path if target_form == "dir" else converted(root, "qwen3", "f32")
    out = root / f"mask-{fmt}.gguf"
    convert(draft.path, out, "f32", target_model_dir=tdir, progress=False)
    kv, tensors = check_drafter(
        out, tm, draft, "f32", gguf_layers=[0, 1], block_size=16, mask_id=mask_id,
        tensors_expected=drafter_tensor_table(2, tm.n_vocab, tm.n_vocab, token_embd=True,
                                              output=True, d2t=False, markov=False, conf=False))
    emb = dequant(tensors["token_embd.weight"][2])
    want = tm.weights["model.embed_tokens.weight"].copy()
    want[mask_id] = vec
    np.testing.assert_array_equal(emb, want)
    # The output is the target's unpatched head (Qwen3 here is untied: its lm_head).
    np.testing.assert_array_equal(dequant(tensors["output.weight"][2]), tm.weights["lm_head.weight"])


def test_mask_embedding_pt(root):
    torch = pytest.importorskip("torch")
    tm = target(root, "llama")
    draft = tiny.make_drafter(root / "mask-pt", tm, "dflash", seed=52, mask_token_id=None)
    vec = np.arange(E, dtype=np.float32) / E
    torch.save({"mask_token_id": 7, "embedding": torch.from_numpy(vec)},
               draft.path / "mask_embedding.pt")
    cfg = json.loads((draft.path / "config.json").read_text())
    del cfg["dflash_config"]["mask_token_id"]
    (draft.path / "config.json").write_text(json.dumps(cfg))
    out = root / "mask-pt.gguf"
    convert(draft.path, out, "f32", target_model_dir=tm.path, progress=False)
    kv, tensors = read(out)
    assert value(kv, "tokenizer.ggml.mask_token_id") == 7
    np.testing.assert_array_equal(dequant(tensors["token_embd.weight"][2])[7], vec)
    # Llama here is tied: the output is the target's unpatched embedding.
    np.testing.assert_array_equal(dequant(tensors["output.weight"][2]),
                                  tm.weights["model.embed_tokens.weight"])


# ---------------------------------------------------------------------------------------------
# errors and the command line

def test_error_missing_config_and_weights(root):
    empty = root / "err-empty"
    empty.mkdir()
    with pytest.raises(ConversionError, match=r"no config.json in .*err-empty"):
        convert(empty, root / "x.gguf", progress=False)
    tm = target(root, "llama")
    no_weights = root / "err-noweights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tm.path / "config.json").read_text())
    with pytest.raises(ConversionError,
                       match=r"no model weights \(\*\.safetensors\) in .*err-noweights"):
        convert(no_weights, root / "x.gguf", progress=False)
    assert not (root / "x.gguf").exists()


def test_error_missing_shard(root):
    tm = tiny.make_target(root / "err-shard", "llama", seed=8, shards=2)
    (tm.path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConversionError, match="names the shard model-00002-of-00002.safetensors, which "
                                              "is missing"):
        convert(tm.path, root / "x.gguf", progress=False)


def test_error_unknown_architecture(root):
    d = root / "err-arch"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ConversionError,
                       match=r"unknown architecture 'MambaForCausalLM' in .*config.json "
                             r"\(supported: LlamaForCausalLM, Qwen3ForCausalLM, "
                             r"DFlashDraftModel, DSparkDraftModel"):
        convert(d, root / "x.gguf", progress=False)


def test_error_drafter_without_target(root):
    draft = tiny.make_drafter(root / "err-notarget", target(root, "qwen3"), "dspark", seed=61)
    with pytest.raises(ConversionError, match="Qwen3DSparkModel is a drafter: --target-model-dir is "
                                              "required"):
        convert(draft.path, root / "x.gguf", progress=False)


def test_error_hidden_size_mismatch(root):
    tm = target(root, "qwen3")
    draft = tiny.make_drafter(root / "err-hidden", tm, "dflash", seed=62, hidden_size=96)
    with pytest.raises(ConversionError, match="drafter hidden_size 96 != target hidden size 64"):
        convert(draft.path, root / "x.gguf", target_model_dir=tm.path, progress=False)


@pytest.mark.parametrize("target_form", ["dir", "gguf"])
def test_error_target_layer_out_of_range(root, target_form):
    tm = target(root, "llama")
    draft = tiny.make_drafter(root / f"err-layers-{target_form}", tm, "dflash", seed=63,
                              target_layer_ids=[0, 2])
    tdir = tm.path if target_form == "dir" else converted(root, "llama", "f16")
    with pytest.raises(ConversionError, match=r"target layer id 2 is out of range: the target has 2 "
                                              r"layers, so ids run from -1 \(the embeddings\) to 1"):
        convert(draft.path, root / "x.gguf", target_model_dir=tdir, progress=False)


def test_error_markov_head_type(root):
    tm = target(root, "qwen3")
    draft = tiny.make_drafter(root / "err-markov", tm, "dspark", seed=64, markov_head_type="gated")
    with pytest.raises(ConversionError, match="markov_head_type 'gated' is not supported: only "
                                              "'vanilla'"):
        convert(draft.path, root / "x.gguf", target_model_dir=tm.path, progress=False)


def test_error_unknown_tensors_are_listed(root):
    from safetensors.numpy import save_file
    tm = tiny.make_target(root / "err-tensors", "llama", seed=9)
    save_file({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32),
               "model.vision_tower.weight": np.zeros((2, 2), np.float32)},
              str(tm.path / "extra.safetensors"))
    with pytest.raises(ConversionError, match=r"2 tensor\(s\) in .* that the mapping does not know: "
                                              r"model.layers.0.self_attn.q_proj.bias, "
                                              r"model.vision_tower.weight"):
        convert(tm.path, root / "x.gguf", progress=False)


def test_error_wrong_shape(root):
    tm = tiny.make_target(root / "err-shape", "qwen3", seed=10)
    cfg = json.loads((tm.path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tm.path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=r"tensor model.layers.0.mlp.gate_proj.weight in .* has "
                                              r"shape \[80, 64\], expected \[96, 64\] from config.json"):
        convert(tm.path, root / "x.gguf", progress=False)


def test_cli_main_and_launcher(root, capsys):
    tm = target(root, "llama")
    assert main([str(root / "does-not-exist"), "--outfile", str(root / "x.gguf")]) == 1
    assert "error: " in capsys.readouterr().err
    out = root / "cli.gguf"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_hf_to_gguf.py"), str(tm.path),
                           "--outfile", str(out), "--outtype", "q8_0", "--no-progress"],
                          capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}" in proc.stdout
    assert "20 tensors (5 F32, 15 Q8_0)" in proc.stdout
    assert out.read_bytes() == converted(root, "llama", "q8_0").read_bytes()


def test_console_script_is_declared():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["pyspec-convert"] == "pyspec.convert:main"
    deps = " ".join(project["dependencies"])
    for pkg in ("gguf", "safetensors", "tqdm"):
        assert pkg in deps
