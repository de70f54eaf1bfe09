"""pyspec's llama / qwen3 runtime against the float64 numpy reference (tests/numpy_reference.py)
on tiny random-weight GGUF models (tests/tiny_models.py), for every supported weight type.

Errors are measured relative to the reference's scale: max |pyspec - ref| / std(ref). The weights
are identical on both sides (the reference uses the dequantized stored values), so what is left is
float32 arithmetic, plus for the quantized types the 8-bit block quantization of activations that
pyspec (like llama.cpp) applies before a quantized dot product.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyspec
from numpy_reference import forward
from tiny_models import ARCHS, WEIGHT_TYPES, write_tiny_model

# Relative tolerances on logits (max abs diff / std of the reference logits) and on the layer
# inputs (same, per layer). Set from measured errors with a safety factor of ~3-5; see the report
# in the commit for the measured values.
LOGIT_TOL = {"F32": 1e-4, "F16": 2e-3, "BF16": 2e-2, "Q8_0": 3e-2, "Q4_0": 3e-2, "Q4_1": 3e-2}
LAYER_TOL = {"F32": 1e-4, "F16": 2e-3, "BF16": 2e-2, "Q8_0": 3e-2, "Q4_0": 3e-2, "Q4_1": 3e-2}

PROMPT_LEN = 13
N_DECODE = 3


def rel_err(got, ref) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.std(ref))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models")


_cache = {}


def tiny(model_dir, arch, wt, tied=True, seed=0):
    key = (arch, wt, tied, seed)
    if key not in _cache:
        path = model_dir / f"{arch}-{wt}-{'tied' if tied else 'untied'}-{seed}.gguf"
        _cache[key] = write_tiny_model(path, arch, wt, seed=seed, tied=tied)
    return _cache[key]


def sequence(n_vocab, n, seed=0):
    return np.random.default_rng(1000 + seed).integers(0, n_vocab, n)


def run_and_compare(tm, seed=0):
    """Prompt (all rows out, every layer input) then N_DECODE single-token steps; returns the
    relative errors (logits, layer inputs) as the max over all rows."""
    hp = tm.hparams
    n_layer = hp["n_layer"]
    toks = sequence(hp["n_vocab"], PROMPT_LEN + N_DECODE, seed)
    ref_logits, ref_layers = forward(hp, tm.weights, toks, layer_ids=range(n_layer + 1))

    m = pyspec.Model(str(tm.path), n_threads=2)
    ctx = pyspec.Context(m, n_ctx=64, n_seq_max=1, n_batch=32, check_plans=True)
    r = ctx.decode(toks[:PROMPT_LEN], output=np.ones(PROMPT_LEN, bool),
                   layer_inputs=range(n_layer + 1))
    assert r.logits.dtype == np.float32 and r.logits.shape == (PROMPT_LEN, hp["n_vocab"])
    np.testing.assert_array_equal(r.output_rows, np.arange(PROMPT_LEN))
    assert sorted(r.layer_inputs) == list(range(n_layer + 1))
    err_logits = rel_err(r.logits, ref_logits[:PROMPT_LEN])
    err_layers = 0.0
    for il in range(n_layer + 1):
        li = r.layer_inputs[il]
        assert li.dtype == np.float32 and li.shape == (PROMPT_LEN, hp["n_embd"])
        err_layers = max(err_layers, rel_err(li, ref_layers[il][:PROMPT_LEN]))
    assert ctx.seq_pos_max(0) == PROMPT_LEN - 1

    for i in range(PROMPT_LEN, PROMPT_LEN + N_DECODE):
        r = ctx.decode([toks[i]], layer_inputs=(0, n_layer // 2, n_layer))
        assert r.logits.shape == (1, hp["n_vocab"])
        assert ctx.seq_pos_max(0) == i
        err_logits = max(err_logits, rel_err(r.logits[0], ref_logits[i]))
        for il in (0, n_layer // 2, n_layer):
            assert r.layer_inputs[il].shape == (1, hp["n_embd"])
            err_layers = max(err_layers, rel_err(r.layer_inputs[il][0], ref_layers[il][i]))
    return err_logits, err_layers, r.logits[0], ref_logits[-1]


@pytest.mark.parametrize("wt", WEIGHT_TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_layer_inputs_match_reference(model_dir, arch, wt):
    tm = tiny(model_dir, arch, wt)
    err_logits, err_layers, _, _ = run_and_compare(tm)
    print(f"{arch} {wt}: logits rel err {err_logits:.2e}, layer inputs rel err {err_layers:.2e}")
    assert err_logits < LOGIT_TOL[wt]
    assert err_layers < LAYER_TOL[wt]


@pytest.mark.parametrize("wt", ["F32", "Q8_0", "Q4_1"])
@pytest.mark.parametrize("arch", ARCHS)
def test_untied_output_matrix(model_dir, arch, wt):
    tm = tiny(model_dir, arch, wt, tied=False)
    assert not np.array_equal(tm.weights["output.weight"], tm.weights["token_embd.weight"])
    err_logits, err_layers, got_last, _ = run_and_compare(tm)
    assert err_logits < LOGIT_TOL[wt]
    assert err_layers < LAYER_TOL[wt]
    # The same model read as if tied is far off: the engine really uses output.weight.
    tied_weights = dict(tm.weights, **{"output.weight": tm.weights["token_embd.weight"]})
    toks = sequence(tm.hparams["n_vocab"], PROMPT_LEN + N_DECODE)
    wrong, _ = forward(tm.hparams, tied_weights, toks)
    assert rel_err(got_last, wrong[-1]) > 0.5


@pytest.mark.parametrize("arch", ARCHS)
def test_model_attributes(model_dir, arch):
    tm = tiny(model_dir, arch, "Q8_0")
    hp = tm.hparams
    m = pyspec.Model(str(tm.path), n_threads=1)
    assert m.arch == arch
    assert (m.n_vocab, m.n_embd, m.n_layer) == (hp["n_vocab"], hp["n_embd"], hp["n_layer"])
    assert (m.n_head, m.n_head_kv, m.head_dim) == (hp["n_head"], hp["n_head_kv"], hp["head_dim"])
    assert m.n_ctx_train == hp["n_ctx_train"]
    md = m.metadata
    assert isinstance(md, dict)
    assert md["general.architecture"] == arch
    assert md[f"{arch}.block_count"] == hp["n_layer"]


def test_head_dim_from_key_length_and_other_seed(model_dir):
    # llama with head_dim != n_embd / n_head given by attention.key_length, and a second seed.
    path = model_dir / "llama-wide-heads.gguf"
    tm = write_tiny_model(path, "llama", "F16", seed=7, head_dim=32, n_layer=3, n_ff=128)
    assert tm.hparams["head_dim"] * tm.hparams["n_head"] != tm.hparams["n_embd"]
    err_logits, err_layers, _, _ = run_and_compare(tm, seed=7)
    assert err_logits < LOGIT_TOL["F16"]
    assert err_layers < LAYER_TOL["F16"]


@pytest.mark.parametrize("arch", ARCHS)
def test_positions_not_starting_at_zero(model_dir, arch):
    # The cache rows' positions, not their order, drive RoPE and the causal mask.
    tm = tiny(model_dir, arch, "F32")
    hp = tm.hparams
    toks = sequence(hp["n_vocab"], 9, seed=3)
    pos = np.array([5, 6, 7, 8, 9, 12, 13, 20, 21])
    ref, _ = forward(hp, tm.weights, toks, positions=pos)
    ctx = pyspec.Context(pyspec.Model(str(tm.path), n_threads=2), n_ctx=64, check_plans=True)
    r = ctx.decode(toks[:5], positions=pos[:5], output=np.ones(5, bool))
    assert rel_err(r.logits, ref[:5]) < LOGIT_TOL["F32"]
    r = ctx.decode(toks[5:], positions=pos[5:], output=np.ones(4, bool))
    assert rel_err(r.logits, ref[5:]) < LOGIT_TOL["F32"]
    assert ctx.seq_pos_max(0) == 21


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generate_matches_reference(model_dir, arch):
    tm = tiny(model_dir, arch, "F32")
    hp = tm.hparams
    prompt = [int(t) for t in sequence(hp["n_vocab"], 8, seed=5)]
    seq = list(prompt)
    for _ in range(6):
        logits, _ = forward(hp, tm.weights, seq)
        top2 = np.sort(logits[-1])[-2:]
        # the F32 error is ~1e-5 of the logit scale; a closer race would make the test arbitrary
        assert top2[1] - top2[0] > 1e-3
        seq.append(int(np.argmax(logits[-1])))
    ctx = pyspec.Context(pyspec.Model(str(tm.path), n_threads=2), n_ctx=64, check_plans=True)
    assert pyspec.generate(ctx, prompt, 6) == seq[len(prompt):]
