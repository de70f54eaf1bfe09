"""Block drafters (GGUF arch dflash: DFlash and DSpark) in pyspec's core: DraftModel and DraftContext.

Tiny random drafters from tools/make_tiny_models.py, converted with pyspec.convert against tiny
converted targets, are checked against a float64 numpy drafter written here straight from the
Hugging Face safetensors weights (shared/docs/reference/dflash-dspark.md §1-§2): fc, hidden_norm,
k_norm and RoPE (rotate-half, i.e. NEOX) of the injected context; the noise block [id_last, MASK...]
through Qwen3 layers attending over context + block (non-causal unless the file says causal);
final norm; the target's head; DSpark's Markov chain and confidence head. The feature rows fed to
both are the target's layer inputs as pyspec's target context returns them.
Also: bad drafter files and mismatched targets are refused with their messages, and the drafter
window (design.md invariant 2) rebases long contexts without growing any buffer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import make_tiny_models as tiny  # noqa: E402
from pyspec import _core  # noqa: E402
from pyspec.convert import convert  # noqa: E402

# max|pyspec - reference| / std(reference). Both round K/V to the F16 cache and the reference
# rounds the weights as the file stores them; what is left is F32 arithmetic and, against F16
# weights, F16 activations (measured <= 4e-6 and <= 3e-5). A wrong norm, rope, mask or head
# costs O(1).
TOL = {"f32": 1e-4, "f16": 5e-4}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("dflash")


_targets = {}


def target(root, arch, **overrides):
    """(HF checkpoint, converted F32 GGUF path, loaded _core.Model)."""
    key = (arch, tuple(sorted(overrides.items())))
    if key not in _targets:
        name = f"{arch}-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
        ckpt = tiny.make_target(root / f"hf-{name}", arch, seed=5, **overrides)
        path = root / f"{name}.gguf"
        convert(ckpt.path, path, "f32", progress=False)
        _targets[key] = (ckpt, path, _core.Model(str(path)))
    return _targets[key]


def make_drafter(root, name, tm, outtype="f32", **kwargs):
    ckpt = tiny.make_drafter(root / f"hf-{name}", tm, **kwargs)
    path = root / f"{name}-{outtype}.gguf"
    convert(ckpt.path, path, outtype, target_model_dir=tm.path, progress=False)
    return ckpt, path


def features(model, tokens, layers):
    """The target's layer inputs for tokens at positions 0.., concatenated in `layers` order."""
    n = len(tokens)
    ctx = _core.Context(model, n_ctx=256, n_seq_max=1, n_batch=256, check_plans=False, n_threads=2)
    _, _, inputs = ctx.decode(np.asarray(tokens, np.int32), np.arange(n, dtype=np.int32),
                              np.zeros(n, np.int32), np.zeros(n, np.uint8), list(layers))
    return np.concatenate([inputs[lid] for lid in layers], axis=1)


# ---------------------------------------------------------------------------------------------
# float64 reference from the Hugging Face weights

def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, theta):
    """HF rotate_half RoPE over the whole head; x [n, heads, d]."""
    d = x.shape[-1]
    ang = np.asarray(pos, np.float64)[:, None] * theta ** (-np.arange(0, d, 2) / d)[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, axis=-1)[:, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * cos + rot * sin


def f16(x):
    return x.astype(np.float16).astype(np.float64)


def reference(draft, tm, outtype, feats, ctx_pos, id_last, block_pos, causal=False):
    """{logits (drafting logits), base, hidden, w1} for the block [id_last, MASK, ...]."""
    cfg = dict(draft.config)
    cfg.update(cfg.get("transformer_layer_config") or {})
    dcfg = cfg.get("dflash_config") or cfg
    w = {k: (f16(v) if outtype == "f16" and v.ndim == 2 else v.astype(np.float64))
         for k, v in draft.weights.items()}
    p = "model." if "model.fc.weight" in w else ""
    e, nh, nkv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    temb = tm.weights["model.embed_tokens.weight"].astype(np.float64)
    head = temb if tm.config["tie_word_embeddings"] else tm.weights["lm_head.weight"].astype(np.float64)
    emb = w.get(p + "embed_tokens.weight", temb)

    g = rms(feats.astype(np.float64) @ w[p + "fc.weight"].T, w[p + "hidden_norm.weight"], eps)
    n = len(block_pos)
    tokens = [id_last] + [dcfg["mask_token_id"]] * (n - 1)
    x = emb[tokens]
    nc = len(ctx_pos)
    allowed = np.ones((n, nc + n), bool)
    if causal:
        allowed[:, nc:] = np.tril(np.ones((n, n), bool))
    for il in range(cfg["num_hidden_layers"]):
        lp = f"{p}layers.{il}."
        wk, wv = w[lp + "self_attn.k_proj.weight"], w[lp + "self_attn.v_proj.weight"]
        kn, qn = w[lp + "self_attn.k_norm.weight"], w[lp + "self_attn.q_norm.weight"]
        # Context K/V from the fused features: no input_layernorm (reference §1.2).
        kc = rope(rms((g @ wk.T).reshape(nc, nkv, d), kn, eps), ctx_pos, theta)
        vc = (g @ wv.T).reshape(nc, nkv, d)
        h = rms(x, w[lp + "input_layernorm.weight"], eps)
        q = rope(rms((h @ w[lp + "self_attn.q_proj.weight"].T).reshape(n, nh, d), qn, eps), block_pos, theta)
        kb = rope(rms((h @ wk.T).reshape(n, nkv, d), kn, eps), block_pos, theta)
        vb = (h @ wv.T).reshape(n, nkv, d)
        k_all, v_all = f16(np.concatenate([kc, kb])), f16(np.concatenate([vc, vb]))
        out = np.empty((n, nh, d))
        for hh in range(nh):
            s = np.where(allowed, q[:, hh] @ k_all[:, hh // (nh // nkv)].T / np.sqrt(d), -np.inf)
            pr = np.exp(s - s.max(axis=1, keepdims=True))
            out[:, hh] = pr / pr.sum(axis=1, keepdims=True) @ v_all[:, hh // (nh // nkv)]
        x = x + out.reshape(n, nh * d) @ w[lp + "self_attn.o_proj.weight"].T
        h = rms(x, w[lp + "post_attention_layernorm.weight"], eps)
        gt, up = h @ w[lp + "mlp.gate_proj.weight"].T, h @ w[lp + "mlp.up_proj.weight"].T
        x = x + (gt / (1 + np.exp(-gt)) * up) @ w[lp + "mlp.down_proj.weight"].T
    hidden = rms(x, w[p + "norm.weight"], eps)
    return dict(base=hidden @ head.T, hidden=hidden, w=w)


def rel_err(got, ref):
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.std(ref))


def check_markov(out, ref, offset, id_last, tol):
    """DSpark: along the engine's own greedy chain, biased logits and confidences equal the
    reference's, and each chosen token is the reference argmax unless the top two are within
    float noise."""
    w = ref["w"]
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    n = out["logits"].shape[0]
    logits = ref["base"].copy()
    conf = np.full(n, np.nan)
    prev = id_last
    for i in range(offset, n):
        e = w1[prev]
        logits[i] = ref["base"][i] + w2 @ e
        if "confidence_head.proj.weight" in w:
            z = np.concatenate([ref["hidden"][i], e]) @ w["confidence_head.proj.weight"][0]
            conf[i] = 1 / (1 + np.exp(-(z + w["confidence_head.proj.bias"][0])))
        top2 = np.sort(logits[i])[-2:]
        if top2[1] - top2[0] > 1e-2:
            assert out["tokens"][i] == np.argmax(logits[i]), f"slot {i}"
        prev = int(out["tokens"][i])
    assert rel_err(out["logits"], logits) < tol
    assert rel_err(out["base_logits"], ref["base"]) < tol
    if "confidence_head.proj.weight" in w:
        got = out["confidence"]
        assert np.all(np.isnan(got[:offset]))
        np.testing.assert_allclose(got[offset:], conf[offset:], atol=tol)
    else:
        assert "confidence" not in out
    # Bonus-anchor slot 0 passes through unbiased.
    if offset == 1:
        np.testing.assert_array_equal(out["logits"][0], out["base_logits"][0])


# name: (target arch, make_drafter kwargs, expected (is_dspark, draft_offset, has_conf))
VARIANTS = {
    "dflash": ("qwen3", dict(kind="dflash", seed=11), (False, 1, False)),
    "dflash-causal-own-embd-2layers": ("qwen3", dict(kind="dflash", seed=12, causal=True, own_embedding=True,
                                                     num_layers=2, target_layer_ids=[1, -1, 0]),
                                       (False, 1, False)),
    "dspark-anchor-conf": ("qwen3", dict(kind="dspark", seed=13), (True, 0, True)),
    "dspark-bonus-conf": ("qwen3", dict(kind="dspark", seed=14, sample_from_anchor=False), (True, 1, True)),
    "dspark-anchor-noconf-llama": ("llama", dict(kind="dspark", seed=15, confidence_head=False),
                                   (True, 0, False)),
}


@pytest.mark.parametrize("outtype", ["f32", "f16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_block_logits_match_reference(root, variant, outtype):
    arch, kwargs, (dspark, offset, conf) = VARIANTS[variant]
    tm, _, tmodel = target(root, arch)
    draft, path = make_drafter(root, variant, tm, outtype, **kwargs)
    dm = _core.DraftModel(str(path), tmodel)
    cfg = draft.config
    block = (cfg.get("dflash_config") or cfg)["block_size"]
    assert (dm.is_dspark, dm.draft_offset, dm.has_confidence_head) == (dspark, offset, conf)
    assert dm.block_size == block and dm.n_draft_max == block - offset
    assert dm.target_layers == [lid + 1 for lid in kwargs.get("target_layer_ids", [-1, 0])]
    assert dm.causal == bool(kwargs.get("causal", False))

    rng = np.random.default_rng(kwargs["seed"])
    n_ctx = 23
    tokens = rng.integers(0, tm.n_vocab, n_ctx + 1)
    feats = features(tmodel, tokens[:n_ctx], dm.target_layers)
    dc = _core.DraftContext(dm, n_seq_max=2, n_batch=128, n_threads=2, check_plans=True)
    # Sequence 1 gets other context: sequences must not see each other's rows.
    dc.inject(1, np.arange(5, dtype=np.int32), feats[:5][::-1].copy())
    dc.inject(0, np.arange(n_ctx, dtype=np.int32), feats)
    id_last, pos0 = int(tokens[n_ctx]), n_ctx
    tol = TOL[outtype]
    for n_block in sorted({block, block - 2}):
        out = dc.draft_logits(0, id_last, pos0, n_block)
        assert out["logits"].shape == (n_block, tm.n_vocab)
        ref = reference(draft, tm, outtype, feats, np.arange(n_ctx), id_last, pos0 + np.arange(n_block),
                        causal=dm.causal)
        if dspark:
            check_markov(out, ref, offset, id_last, tol)
        else:
            assert rel_err(out["logits"], ref["base"]) < tol
            np.testing.assert_array_equal(out["tokens"], np.argmax(out["logits"], axis=1))
            assert "base_logits" not in out and "confidence" not in out
        # The noise rows are gone: the draft KV holds the committed context only.
        assert dc.seq_pos_max(0) == n_ctx - 1 and dc.n_rows(0) == n_ctx
        assert dc.seq_pos_max(1) == 4

    # Roll back, re-inject: the same block sees the same context, so the same logits.
    again = dc.draft_logits(0, id_last, pos0, block)
    dc.remove(0, 10, -1)
    assert dc.seq_pos_max(0) == 9
    dc.inject(0, np.arange(10, n_ctx, dtype=np.int32), feats[10:])
    with pytest.raises(ValueError, match="holds context at position 22 >= pos0 22"):
        dc.draft_logits(0, id_last, n_ctx - 1, block)
    np.testing.assert_array_equal(dc.draft_logits(0, id_last, pos0, block)["logits"], again["logits"])


def test_context_rows_change_the_block(root):
    """Guards the reference test against a drafter that ignores its context."""
    tm, _, tmodel = target(root, "qwen3")
    _, path = make_drafter(root, "dflash-ctx", tm, kind="dflash", seed=21)
    dm = _core.DraftModel(str(path), tmodel)
    feats = features(tmodel, np.arange(3, 15), dm.target_layers)
    dc = _core.DraftContext(dm, n_seq_max=1, n_batch=64, n_threads=1)
    dc.inject(0, np.arange(12, dtype=np.int32), feats)
    full = dc.draft_logits(0, 7, 12, 16)["logits"]
    dc.remove(0, 0, 6)
    part = dc.draft_logits(0, 7, 12, 16)["logits"]
    assert rel_err(part, full.astype(np.float64)) > 0.05


def test_op_profile_counts_the_passes_run_while_profiling(root):
    tm, _, tmodel = target(root, "qwen3")
    _, path = make_drafter(root, "dflash-prof", tm, kind="dflash", seed=22)
    dm = _core.DraftModel(str(path), tmodel)
    dc = _core.DraftContext(dm, n_seq_max=1, n_batch=64, n_threads=1)
    dc.inject(0, np.arange(8, dtype=np.int32), features(tmodel, np.arange(3, 11), dm.target_layers))
    dc.draft_logits(0, 7, 8, 16)
    assert dc.op_profile() == []                      # off by default
    dc.set_profiling(True)
    for _ in range(3):
        dc.draft_logits(0, 7, 8, 16)
    dc.set_profiling(False)
    dc.draft_logits(0, 7, 8, 16)
    prof = {name: (sec, calls) for name, sec, calls in dc.op_profile()}
    # Each pass runs every layer's q/k/v/o and FFN products: whole multiples of 3 passes.
    assert prof["MUL_MAT"][1] > 0 and prof["MUL_MAT"][1] % 3 == 0
    assert prof["ATTENTION"][1] == 3 * dm.n_layer
    assert all(sec >= 0 for sec, _ in prof.values())


# ---------------------------------------------------------------------------------------------
# window (design.md invariant 2)

def test_window_rebases_long_contexts_without_growing_buffers(root):
    tm, _, tmodel = target(root, "qwen3")
    draft, path = make_drafter(root, "dspark-window", tm, kind="dspark", seed=31)
    dm = _core.DraftModel(str(path), tmodel)
    assert dm.n_ctx_train == 256
    n_ctx, block = 150, 7
    tokens = np.random.default_rng(3).integers(0, tm.n_vocab, n_ctx + 1)
    feats = features(tmodel, tokens[:n_ctx], dm.target_layers)
    id_last = int(tokens[n_ctx])

    small = _core.DraftContext(dm, n_seq_max=1, n_batch=40, n_threads=2, check_plans=True)
    assert small.window == 40
    # A short context first: the buffers it needs are all the long one may use.
    small.inject(0, np.arange(10, dtype=np.int32), feats[:10])
    small.draft_logits(0, id_last, 10, block)
    kv_bytes, compute_bytes = small.kv_cache_bytes, small.compute_buffer_bytes
    small.clear(0)
    # Committed in verify-sized steps, drafting after each, like the speculative loop.
    for start in range(0, n_ctx, 8):
        stop = min(n_ctx, start + 8)
        small.inject(0, np.arange(start, stop, dtype=np.int32), feats[start:stop])
        small.draft_logits(0, id_last, stop, block)
    out = small.draft_logits(0, id_last, n_ctx, block)
    base, lo = small.pos_base(0), small.seq_pos_min(0)
    # Context and block live at drafter positions [0, window).
    assert base <= lo and n_ctx + block - base <= small.window
    assert small.seq_pos_max(0) == n_ctx - 1 and small.n_rows(0) == n_ctx - lo
    assert 0 < n_ctx - lo < small.window
    assert small.kv_cache_bytes == kv_bytes and small.compute_buffer_bytes == compute_bytes
    width = dm.n_layer * 2 * 2 * 16 * 2  # layers x (K, V) x kv heads x head_dim x f16 bytes
    assert kv_bytes == width * small.window

    # The drafter saw the retained rows at rebased positions: equal to the reference there (K
    # was rotated once more and re-rounded to F16, hence the looser tolerance; measured 5e-4).
    ref = reference(draft, tm, "f32", feats[lo:], np.arange(lo, n_ctx) - base, id_last,
                    n_ctx - base + np.arange(block))
    check_markov(out, ref, 0, id_last, 3e-3)

    # A window of min(n_ctx_train, n_batch): a huge n_batch does not make a huge cache.
    big = _core.DraftContext(dm, n_seq_max=1, n_batch=100000, n_threads=1)
    assert big.window == 256 and big.kv_cache_bytes == width * 256


def test_reused_drafter_graphs_give_fresh_graphs_bits(root):
    """A DraftContext reuses the shift, inject and block graphs of parameters it ran before
    (core/built_graphs.h). Against one that builds and plans every call (check_plans), the loop of
    the window test (inject in verify-sized steps, rebasing the window, drafting after each, two
    block lengths) gives the same bits, and a repeated shape does not ask the planner again."""
    tm, _, tmodel = target(root, "qwen3")
    _, path = make_drafter(root, "dspark-reuse", tm, kind="dspark", seed=33)
    dm = _core.DraftModel(str(path), tmodel)
    n_ctx = 90
    tokens = np.random.default_rng(4).integers(0, tm.n_vocab, n_ctx + 1)
    feats = features(tmodel, tokens[:n_ctx], dm.target_layers)
    fresh = _core.DraftContext(dm, n_seq_max=1, n_batch=40, n_threads=2, check_plans=True)
    reusing = _core.DraftContext(dm, n_seq_max=1, n_batch=40, n_threads=2)
    reused = 0
    for start in range(0, n_ctx, 6):
        stop = min(n_ctx, start + 6)
        for block in (dm.block_size, dm.block_size - 3):
            planner, base = (reusing.plans_built, reusing.cache_hits), reusing.pos_base(0)
            outs = []
            for dc in (fresh, reusing):
                if block == dm.block_size:
                    dc.inject(0, np.arange(start, stop, dtype=np.int32), feats[start:stop])
                outs.append(dc.draft_logits(0, int(tokens[stop]), stop, block))
            # Every graph of a step without a rebase (whose shift has its own row count) ran before.
            if start >= 12 and stop - start == 6 and reusing.pos_base(0) == base:
                assert (reusing.plans_built, reusing.cache_hits) == planner, (start, block)
                reused += 1
            for key in outs[0]:
                np.testing.assert_array_equal(outs[1][key], outs[0][key], err_msg=f"{key} at {start}, {block}")
    assert fresh.pos_base(0) == reusing.pos_base(0) > 0  # the window was rebased
    assert reused >= 10


@pytest.mark.parametrize("n_batch,ok", [(14, False), (15, True)])
def test_window_must_exceed_two_blocks(root, n_batch, ok):
    tm, _, tmodel = target(root, "qwen3")
    _, path = make_drafter(root, "dspark-small-window", tm, kind="dspark", seed=32)
    dm = _core.DraftModel(str(path), tmodel)
    if ok:
        assert _core.DraftContext(dm, 1, n_batch, 1).window == n_batch
    else:
        with pytest.raises(ValueError, match=r"window 14 .* must be larger than 2 x block_size \(14\)"):
            _core.DraftContext(dm, 1, n_batch, 1)


def test_bad_calls_are_refused(root):
    tm, _, tmodel = target(root, "qwen3")
    _, path = make_drafter(root, "dflash-calls", tm, kind="dflash", seed=33)
    dm = _core.DraftModel(str(path), tmodel)
    dc = _core.DraftContext(dm, 1, 64, 1)
    feats = np.zeros((3, 2 * 64), np.float32)
    with pytest.raises(ValueError, match="seq_id 1 out of range"):
        dc.inject(1, np.arange(3, dtype=np.int32), feats)
    with pytest.raises(ValueError, match="features must be"):
        dc.inject(0, np.arange(3, dtype=np.int32), feats[:, :64])
    with pytest.raises(ValueError, match="strictly increasing"):
        dc.inject(0, np.array([0, 2, 1], np.int32), feats)
    with pytest.raises(ValueError, match="n_block 17"):
        dc.draft_logits(0, 1, 0, 17)
    with pytest.raises(ValueError, match="id_last"):
        dc.draft_logits(0, tm.n_vocab, 0, 4)


# ---------------------------------------------------------------------------------------------
# refusing bad files and mismatched targets

def rewrite(src, dst, *, set_keys=None, drop_keys=(), drop_tensors=(), add_tensors=None):
    """Copy of an F32 GGUF with keys/tensors changed."""
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    set_keys = dict(set_keys or {})
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys:
            continue
        val = set_keys.pop(key, f.contents())
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, val, f.types[0], sub_type=sub)
    for key, (val, vtype, sub) in set_keys.items():
        w.add_key_value(key, val, vtype, sub_type=sub)
    for t in r.tensors:
        if t.name not in drop_tensors:
            w.add_tensor(t.name, np.array(t.data))
    for name, arr in (add_tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


def test_bad_drafters_are_refused(root):
    tm, tpath, tmodel = target(root, "qwen3")
    _, path = make_drafter(root, "dflash-bad", tm, kind="dflash", seed=41)
    _, dspark = make_drafter(root, "dspark-bad", tm, kind="dspark", seed=42)
    V = gguf.GGUFValueType
    e = 64
    cases = [
        (str(tpath), "architecture 'qwen3', expected 'dflash'"),
        (rewrite(path, root / "b1.gguf", set_keys={"dflash.target_layers": [0, 3]}),
         r"target layer 3 is outside what the target exposes: layer inputs 0 \(embeddings\) to 2"),
        (rewrite(path, root / "b2.gguf", set_keys={"tokenizer.ggml.mask_token_id": 100000}),
         r"mask_token_id 100000 is outside the target vocabulary \(320 tokens\)"),
        (rewrite(path, root / "b3.gguf", drop_tensors=("blk.0.attn_k_norm.weight",)),
         "missing tensor blk.0.attn_k_norm.weight"),
        (rewrite(path, root / "b4.gguf", drop_keys=("dflash.context_length",)), "no dflash.context_length"),
        (rewrite(path, root / "b5.gguf", add_tensors={"output.weight": np.zeros((64, e), np.float32)}),
         "output.weight has 64 rows but the target vocabulary has 320 tokens"),
        (rewrite(path, root / "b6.gguf", add_tensors={"selector_hidden.weight": np.zeros((4, e), np.float32)}),
         "DFlash2"),
        (rewrite(path, root / "b7.gguf", drop_tensors=("blk.0.attn_v.weight",)), "K=V sharing is not supported"),
        (rewrite(path, root / "b8.gguf", drop_tensors=("fc.weight",), add_tensors={
            "fc.weight": np.zeros((e, 3 * e), np.float32)}), r"fc.weight has shape \[192, 64\], expected \[128, 64\]"),
        (rewrite(path, root / "b9.gguf", set_keys={"dflash.attention.sliding_window": (8, V.UINT32, None)}),
         "sliding-window attention"),
        (rewrite(dspark, root / "b10.gguf", drop_tensors=("conf_proj.weight", "conf_proj.bias")),
         "has_confidence_head = true but has no conf_proj.weight"),
        (rewrite(dspark, root / "b11.gguf", drop_tensors=("markov_w1.weight",)),
         "DSpark head tensors .* but no markov_w1.weight"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            _core.DraftModel(bad, tmodel)
    # The unmodified files load: the refusals above are the edits'.
    assert _core.DraftModel(str(path), tmodel).block_size == 16
    assert _core.DraftModel(rewrite(path, root / "ok.gguf"), tmodel).block_size == 16


def test_mismatched_targets_are_refused(root):
    tm, _, tmodel = target(root, "qwen3")
    _, path = make_drafter(root, "dflash-mismatch", tm, kind="dflash", seed=51, target_layer_ids=[-1, 1])
    assert _core.DraftModel(str(path), tmodel).target_layers == [0, 2]
    _, _, narrow = target(root, "llama", hidden_size=32)
    with pytest.raises(ValueError, match="drafter hidden size 64 != target hidden size 32"):
        _core.DraftModel(str(path), narrow)
    _, _, shallow = target(root, "llama", num_hidden_layers=1)
    with pytest.raises(ValueError, match="target layer 2 is outside what the target exposes"):
        _core.DraftModel(str(path), shallow)


def test_reduced_vocabulary_drafter_matches_reference(root):
    """speculators-style DSpark drafters carry d2t (I64, absolute target ids in the GGUF): the
    draft head's Vd logits land at their target ids in a -inf row, and the Markov chain embeds
    the target token of each greedy draft id (reference §1.4, §2.1)."""
    tm, _, tmodel = target(root, "qwen3")
    vd = 40
    draft, path = make_drafter(root, "speculators", tm, kind="speculators", seed=61, draft_vocab=vd)
    dm = _core.DraftModel(str(path), tmodel)
    draft_ids = draft.weights["d2t"] + np.arange(vd)  # HF d2t holds offsets
    assert dm.n_vocab_draft == vd and dm.n_vocab == tm.n_vocab and dm.d2t == draft_ids.tolist()
    assert dm.is_dspark and dm.owns_output
    offset = dm.draft_offset
    block = dm.block_size

    rng = np.random.default_rng(61)
    n_ctx = 17
    tokens = rng.integers(0, tm.n_vocab, n_ctx + 1)
    feats = features(tmodel, tokens[:n_ctx], dm.target_layers)
    dc = _core.DraftContext(dm, n_seq_max=1, n_batch=64, n_threads=2, check_plans=True)
    dc.inject(0, np.arange(n_ctx, dtype=np.int32), feats)
    # An anchor outside the draft vocabulary: W1 is indexed by target ids.
    id_last = int(np.setdiff1d(np.arange(tm.n_vocab), draft_ids)[3])
    out = dc.draft_logits(0, id_last, n_ctx, block)
    ref = reference(draft, tm, "f32", feats, np.arange(n_ctx), id_last, n_ctx + np.arange(block))
    w = ref["w"]
    base_d = ref["hidden"] @ w["lm_head.weight"].T
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    outside = np.ones(tm.n_vocab, bool)
    outside[draft_ids] = False
    for key in ("logits", "base_logits"):
        assert out[key].shape == (block, tm.n_vocab)
        assert np.all(np.isneginf(out[key][:, outside])) and np.all(np.isfinite(out[key][:, draft_ids]))
    assert rel_err(out["base_logits"][:, draft_ids], base_d) < TOL["f32"]
    biased = base_d.copy()
    conf = np.full(block, np.nan)
    prev = id_last
    for i in range(offset, block):
        e = w1[prev]
        biased[i] = base_d[i] + w2 @ e
        z = np.concatenate([ref["hidden"][i], e]) @ w["confidence_head.proj.weight"][0]
        conf[i] = 1 / (1 + np.exp(-(z + w["confidence_head.proj.bias"][0])))
        top2 = np.sort(biased[i])[-2:]
        if top2[1] - top2[0] > 1e-2:
            assert out["tokens"][i] == draft_ids[np.argmax(biased[i])], f"slot {i}"
        prev = int(out["tokens"][i])
        assert prev in set(draft_ids.tolist())
    assert rel_err(out["logits"][:, draft_ids], biased) < TOL["f32"]
    np.testing.assert_allclose(out["confidence"][offset:], conf[offset:], atol=TOL["f32"])
    np.testing.assert_array_equal(out["tokens"], np.argmax(out["logits"], axis=1))
    # The Markov chain must embed the target id: had it used the draft id as a W1 row, slot
    # offset + 1's bias would be this instead, which is far from the engine's.
    i = offset + 1
    wrong = base_d[i] + w2 @ w1[int(np.argmax(biased[i - 1]))]
    assert rel_err(out["logits"][i, draft_ids], wrong) > 0.05


def test_bad_d2t_is_refused(root):
    tm, _, tmodel = target(root, "qwen3")
    draft, path = make_drafter(root, "speculators-bad", tm, kind="speculators", seed=62, draft_vocab=40)
    good = (draft.weights["d2t"] + np.arange(40)).astype(np.int64)
    v = tm.n_vocab

    def with_d2t(name, arr, drop=()):
        return rewrite(path, root / name, drop_tensors=("d2t",) + tuple(drop), add_tensors={"d2t": arr})

    out_of_range, dup = good.copy(), good.copy()
    out_of_range[5] = v
    dup[7] = dup[6]
    cases = [
        (with_d2t("d1.gguf", out_of_range), f"d2t maps draft id 5 to {v}, outside the target vocabulary"),
        (with_d2t("d2.gguf", dup), f"d2t maps two draft ids to target id {dup[6]}"),
        (with_d2t("d3.gguf", good[:-1]), "output.weight has 40 rows but d2t maps 39 draft tokens"),
        (with_d2t("d4.gguf", good.astype(np.float32)), "d2t has type F32, expected I64"),
        (with_d2t("d5.gguf", good, drop=("output.weight",)), "has d2t but no output.weight"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            _core.DraftModel(bad, tmodel)
    assert _core.DraftModel(with_d2t("d0.gguf", good), tmodel).d2t == good.tolist()


# ---------------------------------------------------------------------------------------------
# batched drafting (design.md data flow and invariant 7)

BATCH_VARIANTS = dict(VARIANTS, speculators=("qwen3", dict(kind="speculators", seed=63, draft_vocab=40), None))
DRAFT_KEYS = ("logits", "tokens", "candidates", "candidate_logits", "probs", "base_logits", "confidence", "q")


def batch_variant(root, variant, name, seed_offset):
    """(target checkpoint, target Model, DraftModel, rng) of a BATCH_VARIANTS drafter made as
    `variant + name`, the rng seeded from the variant's seed."""
    arch, kwargs, _ = BATCH_VARIANTS[variant]
    tm, _, tmodel = target(root, arch)
    _, path = make_drafter(root, variant + name, tm, **kwargs)
    return tm, tmodel, _core.DraftModel(str(path), tmodel), np.random.default_rng(kwargs["seed"] + seed_offset)


@pytest.mark.parametrize("variant", list(BATCH_VARIANTS))
def test_batched_draft_equals_each_sequence_drafted_alone(root, variant):
    """One drafter pass over 3-8 sequences' blocks gives each sequence, bit for bit, what drafting
    it alone gives: tokens, q rows, logits, chain outputs, confidences. The sequences have their
    own contexts (some empty, some past the window, so the draft rebases them), anchors,
    temperatures (0 and > 0 mixed) and seeds, and come in shuffled slot orders."""
    tm, tmodel, dm, rng = batch_variant(root, variant, "-batch", 100)
    block = dm.block_size
    n_seq, n_batch = 8, 48
    lens = [0, 3, 9, 17, 25, 31, 40, 44]
    rng.shuffle(lens)
    feats = [features(tmodel, rng.integers(0, tm.n_vocab, max(n, 1)), dm.target_layers)[:n] for n in lens]

    def filled():
        dc = _core.DraftContext(dm, n_seq_max=n_seq, n_batch=n_batch, n_threads=2, check_plans=True)
        for s, n in enumerate(lens):
            if n:
                dc.inject(s, np.arange(n, dtype=np.int32), feats[s])
        return dc

    batched, alone = filled(), filled()
    temps = [0.0, 0.0, 0.7, 1.3, 0.0, 0.9, 0.5, 0.0]
    n_rebased = 0
    for n_seqs in (3, 5, 8):
        for n_block in sorted({block, block - 2}):
            seqs = rng.permutation(n_seq)[:n_seqs]
            reqs = [dict(seq=int(s), id_last=int(rng.integers(0, tm.n_vocab)), pos0=lens[s],
                         temperature=temps[s], seed=int(rng.integers(0, 2**32)), offset=int(rng.integers(0, 100)))
                    for s in seqs]
            got = batched.draft_logits_many(reqs, n_block)
            assert len(got) == n_seqs
            for r, g in zip(reqs, got):
                want = alone.draft_logits(r["seq"], r["id_last"], r["pos0"], n_block, r["temperature"], r["seed"],
                                          r["offset"])
                assert set(g) == set(want), (r, set(g) ^ set(want))
                assert ("q" in g) == (r["temperature"] > 0)
                for key in DRAFT_KEYS:
                    if key in want:
                        assert g[key].dtype == want[key].dtype and g[key].shape == want[key].shape, key
                        np.testing.assert_array_equal(g[key], want[key], err_msg=f"{variant} {key} {r}")
                assert batched.pos_base(r["seq"]) == alone.pos_base(r["seq"])
                n_rebased += batched.pos_base(r["seq"]) > 0
            # The blocks are not all alike: a mix-up of sequences would not go unnoticed.
            assert len({g["logits"].tobytes() for g in got}) == n_seqs
            # The blocks' rows are gone again; the contexts match cell for cell in what they hold.
            for s in range(n_seq):
                assert batched.n_rows(s) == alone.n_rows(s) and batched.seq_pos_max(s) == alone.seq_pos_max(s) == lens[s] - 1
    assert n_rebased > 0
    assert batched.max_pos_written == alone.max_pos_written < batched.window


def filled_sequences(tm, tmodel, dm, rng, lens, temps, seed0):
    """A DraftContext whose sequence s holds lens[s] injected rows, and one draft request per
    sequence (random anchor, temperature temps[s], seed seed0 + s)."""
    dc = _core.DraftContext(dm, n_seq_max=len(lens), n_batch=64, n_threads=2, check_plans=True)
    for s, n in enumerate(lens):
        dc.inject(s, np.arange(n, dtype=np.int32), features(tmodel, rng.integers(0, tm.n_vocab, n), dm.target_layers))
    reqs = [dict(seq=s, id_last=int(rng.integers(0, tm.n_vocab)), pos0=lens[s], temperature=t, seed=seed0 + s)
            for s, t in zip(range(len(lens)), temps)]
    return dc, reqs


@pytest.mark.parametrize("variant", [v for v in BATCH_VARIANTS if BATCH_VARIANTS[v][1]["kind"] == "dspark"])
def test_dspark_pass_without_chains_gives_the_same_drafts(root, variant):
    """DraftContext.draft_many(with_chains=False), the speculative engine's DSpark pass: no
    sampling chains run, and the draft slots' tokens (the Markov chain's ARGMAX or draw), q rows,
    logits and confidences are bit for bit those of the pass with chains, at T = 0 and T > 0."""
    tm, tmodel, dm, rng = batch_variant(root, variant, "-nochains", 21)
    block = dm.block_size
    offset = 0 if dm.sample_from_anchor else 1
    dc, reqs = filled_sequences(tm, tmodel, dm, rng, [6, 14, 33], (0.0, 0.9, 0.0), 3)
    with_chains = dc.draft_logits_many(reqs, block)
    without = dc.draft_logits_many(reqs, block, with_chains=False)
    for g, w in zip(without, with_chains):
        np.testing.assert_array_equal(g["tokens"][offset:], w["tokens"][offset:])
        assert (g["tokens"][:offset] == -1).all() and g["candidates"].size == 0
        for key in ("logits", "base_logits", "q", "confidence"):
            assert (key in g) == (key in w), key
            if key in w:
                np.testing.assert_array_equal(g[key], w[key], err_msg=f"{variant} {key}")
    assert len({tuple(w["tokens"][offset:]) for w in with_chains}) > 1   # not one constant draft


def test_dflash_pass_needs_its_chains(root):
    tm, tmodel, dm, rng = batch_variant(root, "dflash", "-chains", 22)
    dc = _core.DraftContext(dm, n_seq_max=1, n_batch=64, n_threads=2)
    dc.inject(0, np.arange(4, dtype=np.int32), features(tmodel, rng.integers(0, tm.n_vocab, 4), dm.target_layers))
    with pytest.raises(ValueError, match="chains"):
        dc.draft_logits_many([dict(seq=0, id_last=1, pos0=4)], dm.block_size, with_chains=False)


@pytest.mark.parametrize("variant", list(BATCH_VARIANTS))
def test_output_slots_are_the_whole_blocks_first_slots(root, variant):
    """n_out < n_block decodes the whole block and returns its first n_out slots: bit for bit the
    first rows of what returning every slot gives (tokens, q, logits, chains, confidences), at
    T = 0 and T > 0, batched. The other slots still attend and are attended to; only the work no
    kept slot reads is skipped (the last layer's queries and FFN, the head, the chains)."""
    tm, tmodel, dm, rng = batch_variant(root, variant, "-out", 7)
    block = dm.block_size
    lens = [5, 12, 30]
    dc, reqs = filled_sequences(tm, tmodel, dm, rng, lens, (0.0, 0.8, 1.2), 9)
    whole = dc.draft_logits_many(reqs, block)
    for n_out in sorted({1, 2, block - 1}):
        got = dc.draft_logits_many(reqs, block, n_out=n_out)
        for g, w in zip(got, whole):
            assert set(g) == set(w)
            for key in DRAFT_KEYS:
                if key in w:
                    assert g[key].shape[0] == n_out, key
                    np.testing.assert_array_equal(g[key], w[key][:n_out], err_msg=f"{variant} {key} n_out {n_out}")
    # ... and a shorter block is another computation where slots see later ones (non-causal):
    # its slots differ from the whole block's. Causal slots see only earlier ones: the same.
    short = dc.draft_logits_many(reqs, 2)
    same = [np.array_equal(s["logits"], w["logits"][:2]) for s, w in zip(short, whole)]
    assert all(same) if dm.causal else not any(same)
    # One-row blocks (the graph's row views are then whole tensors), one sequence and several.
    assert all(o["logits"].shape[0] == 1 for o in dc.draft_logits_many(reqs, 1))
    assert dc.draft_logits(0, 1, lens[0], 1)["logits"].shape[0] == 1
    with pytest.raises(ValueError, match="n_out"):
        dc.draft_logits(0, 1, lens[0], block, n_out=block + 1)


def test_batched_draft_refuses_bad_batches(root):
    tm, _, tmodel = target(root, "qwen3")
    _, path = make_drafter(root, "dspark-batch-calls", tm, kind="dspark", seed=34)
    dm = _core.DraftModel(str(path), tmodel)
    dc = _core.DraftContext(dm, 3, 64, 1)
    feats = features(tmodel, np.arange(5), dm.target_layers)
    dc.inject(1, np.arange(5, dtype=np.int32), feats)
    ok = dict(seq=0, id_last=1, pos0=70)  # would rebase sequence 0 if the batch ran
    with pytest.raises(ValueError, match="sequence 1 appears twice"):
        dc.draft_logits_many([dict(seq=1, id_last=1, pos0=5), ok, dict(seq=1, id_last=2, pos0=5)], 7)
    with pytest.raises(ValueError, match="holds context at position 4 >= pos0 3"):
        dc.draft_logits_many([ok, dict(seq=1, id_last=1, pos0=3)], 7)
    with pytest.raises(ValueError, match="seq_id 3 out of range"):
        dc.draft_logits_many([ok, dict(seq=3, id_last=1, pos0=3)], 7)
    # Nothing changed: every request is checked before any sequence is touched.
    assert dc.pos_base(0) == 0 and dc.max_pos_written == 4
    assert dc.draft_logits_many([], 7) == []
