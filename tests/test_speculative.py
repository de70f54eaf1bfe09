"""Speculative generation (pyspec/speculative.py) with DFlash and DSpark drafters: design
invariant 6 end to end.

- T = 0: token-identical to plain greedy decoding with every drafter layout (DFlash in-place,
  DSpark anchor-first and bonus-anchor), random drafters and known-acceptance pairs.
- Known acceptance: a target whose greedy next token is a fixed permutation f(t) (built
  analytically: attention and MLP outputs zeroed, head rows = scaled embeddings of f^-1) and a
  DSpark drafter whose Markov head proposes f(t) exactly for t in a chosen set A (backbone
  silenced). Every round's accepted count is then known in advance.
- T > 0: chi-square (alpha = 1e-4, fixed seeds) that the first emitted token and the two-token
  prefix follow the target's softmax(logits / T), with rejection sampling and block verification,
  on a target cut to an 8-token vocabulary; a broken proposal (q at the wrong temperature) fails.
- Stats: draft_n_accepted <= draft_n, emitted = accepted + rounds.
- DSpark ancestral drafting (invariant 5): the drafter graph's draws at T > 0 follow
  softmax((base_0 + bias(id_last))/T) and, given d_0, softmax((base_1 + bias(d_0))/T) (chi-square);
  each draw is argmax(z + Philox Gumbel noise) under its key; q = softmax(z); same key, same draws.
- Confidence pruning: first/cumulative p_min and n_min, with T = 0 output unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from scipy.stats import chi2

import pyspec
from pyspec import _core
from pyspec.convert import convert
from pyspec.sampling import SamplingParams
from pyspec.speculative import Drafter, SpeculativeGenerator, SpecStats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import make_tiny_models as tiny  # noqa: E402

ALPHA = 1e-4
GREEDY = SamplingParams(temperature=0.0)


def edit_gguf(src, dst, tensors=None, keys=None, drop_prefix=()):
    """Copy of a GGUF with tensors replaced (any shape), keys set and key families dropped."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    keys = dict(keys or {})
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" \
                or any(key.startswith(p) for p in drop_prefix):
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, keys.pop(key, f.contents()), f.types[0], sub_type=sub)
    for key, (val, vtype) in keys.items():
        w.add_key_value(key, val, vtype)
    tensors = tensors or {}
    for t in r.tensors:
        arr = tensors.get(t.name, np.array(t.data))
        w.add_tensor(t.name, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


def tensors_of(path):
    return {t.name: np.array(t.data, np.float32) for t in gguf.GGUFReader(str(path)).tensors}


class Pairs:
    """Converted tiny targets and drafters, made once per module."""

    def __init__(self, root: Path):
        self.root = root
        self.tm = tiny.make_target(root / "hf-target", "qwen3", seed=5)
        self.target = str(root / "target.gguf")
        convert(self.tm.path, self.target, "f32", progress=False)
        self.drafters = {}
        for name, kw in {"dflash": dict(kind="dflash", seed=11),
                         "dspark-anchor": dict(kind="dspark", seed=13),
                         "dspark-bonus": dict(kind="dspark", seed=14, sample_from_anchor=False)
                         }.items():
            ckpt = tiny.make_drafter(root / f"hf-{name}", self.tm, **kw)
            self.drafters[name] = str(root / f"{name}.gguf")
            convert(ckpt.path, self.drafters[name], "f32", target_model_dir=self.tm.path,
                    progress=False)

    def small_vocab(self, n_vocab=8, head_scale=0.3):
        """The target cut to its first n_vocab tokens (head scaled so that softmax at T = 1 is
        spread), with each drafter cut to match (mask token n_vocab - 1)."""
        t = tensors_of(self.target)
        target = edit_gguf(self.target, self.root / f"target-v{n_vocab}.gguf",
                           tensors={"token_embd.weight": t["token_embd.weight"][:n_vocab],
                                    "output.weight": t["output.weight"][:n_vocab] * head_scale},
                           keys={"qwen3.vocab_size": n_vocab}, drop_prefix=("tokenizer.",))
        drafters = {}
        for name, path in self.drafters.items():
            d = tensors_of(path)
            cut = {k: d[k][:n_vocab] for k in ("markov_w1.weight", "markov_w2.weight") if k in d}
            drafters[name] = edit_gguf(path, self.root / f"{name}-v{n_vocab}.gguf", tensors=cut,
                                       keys={"tokenizer.ggml.mask_token_id": n_vocab - 1})
        return target, drafters

    def known_acceptance(self, accept_fraction, sample_from_anchor=True, seed=0):
        """(target path, drafter path, f, h): the target's greedy successor of t is f[t]; the
        drafter's greedy chain proposes h[t], equal to f[t] exactly for t in a set of about
        accept_fraction of the vocabulary."""
        rng = np.random.default_rng(seed)
        t = tensors_of(self.target)
        n_vocab, n_embd = t["token_embd.weight"].shape
        f = rng.permutation(n_vocab)
        agree = rng.random(n_vocab) < accept_fraction
        # Off the agreement set, h = f after a cyclic shift of the other tokens: never f[t].
        h = f.copy()
        others = np.flatnonzero(~agree)
        if len(others) > 1:
            h[others] = f[np.roll(others, 1)]
        else:
            agree[others] = True
        emb = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
        inv_f = np.argsort(f)
        edits = {"token_embd.weight": emb, "output.weight": 4.0 * emb[inv_f],
                 "output_norm.weight": np.ones(n_embd, np.float32)}
        for name, arr in t.items():
            # Attention and MLP add nothing: the last hidden state is the token's embedding.
            if name.endswith(("attn_output.weight", "ffn_down.weight")):
                edits[name] = np.zeros_like(arr)
        target = edit_gguf(self.target, self.root / f"known-target-{seed}.gguf", tensors=edits)
        unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
        assert np.array_equal(np.argmax(unit @ (4.0 * emb[inv_f]).T, axis=1), f)

        src = self.drafters["dspark-anchor" if sample_from_anchor else "dspark-bonus"]
        d = tensors_of(src)
        rank = d["markov_w1.weight"].shape[1]
        w1 = rng.standard_normal((n_vocab, rank)).astype(np.float32)
        w2 = 4.0 * w1[np.argsort(h)]
        # The backbone's hidden state is zeroed by its final norm: logits are the Markov bias.
        edits = {"markov_w1.weight": w1, "markov_w2.weight": w2,
                 "output_norm.weight": np.zeros_like(d["output_norm.weight"])}
        name = f"known-{'anchor' if sample_from_anchor else 'bonus'}-{accept_fraction}-{seed}"
        drafter = edit_gguf(src, self.root / f"{name}.gguf", tensors=edits)
        assert np.array_equal(np.argmax(w1 @ w2.T, axis=1), h)
        return target, drafter, f, h, agree


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return Pairs(tmp_path_factory.mktemp("spec"))


_loaded = {}


def generator(target, drafter, draft_n_max=None, verify=None, n_ctx=256):
    key = (target, drafter, n_ctx)
    if key not in _loaded:
        model = pyspec.Model(target, n_threads=2)
        ctx = pyspec.Context(model, n_ctx=n_ctx, n_seq_max=1, n_batch=64)
        _loaded[key] = (model, ctx, Drafter(drafter, model, n_batch=128))
    model, ctx, dr = _loaded[key]
    return SpeculativeGenerator(ctx, dr, draft_n_max=draft_n_max, verify=verify)


def plain_greedy(gen, prompt, n):
    gen.ctx.kv_clear()
    return pyspec.generate(gen.ctx, prompt, n)


PROMPTS = [[5], [17, 3], [40, 41, 42, 43, 44, 45, 46], list(range(100, 160))]


# ---------------------------------------------------------------------------------------------
# T = 0: lossless


@pytest.mark.parametrize("layout", ["dflash", "dspark-anchor", "dspark-bonus"])
def test_greedy_equals_plain_greedy_random_drafters(pairs, layout):
    for target, drafters, prompts in [(pairs.target, pairs.drafters, PROMPTS),
                                      (*pairs.small_vocab(), [[p % 8 for p in q] for q in PROMPTS])]:
        gen = generator(target, drafters[layout])
        accepted = 0
        for prompt in prompts:
            stats = SpecStats()
            out = list(gen.tokens(prompt, GREEDY, max_tokens=40, stats=stats))
            assert out == plain_greedy(gen, prompt, 40), (target, prompt)
            accepted += stats.draft_n_accepted
        if target != pairs.target:
            # With 8 tokens random drafts do get accepted: the commit path is exercised.
            assert accepted > 0


@pytest.mark.parametrize("anchor", [True, False], ids=["anchor-first", "bonus-anchor"])
def test_known_acceptance(pairs, anchor):
    for fraction in (0.0, 0.5, 0.9, 1.0):
        target, drafter, f, h, agree = pairs.known_acceptance(fraction, anchor, seed=3)
        gen = generator(target, drafter, draft_n_max=5)
        stats = SpecStats()
        prompt = [7, 9, 11]
        n = 120
        out = list(gen.tokens(prompt, GREEDY, max_tokens=n, stats=stats))
        assert out == plain_greedy(gen, prompt, n)
        # The target follows f; the drafter's chain agrees while the chain stays in `agree`.
        expect = [prompt[-1]]
        for _ in range(n):
            expect.append(int(f[expect[-1]]))
        assert out == expect[1:]
        rounds, pos, accepted = 1, 1, 0  # the prompt's pass gives the first token
        while pos < n:
            gamma = min(5, n - pos - 1)
            tau = 0
            while tau < gamma and agree[expect[pos + tau]]:
                tau += 1
            rounds, pos, accepted = rounds + 1, pos + tau + 1, accepted + tau
        assert (stats.n_rounds, stats.draft_n_accepted) == (rounds, accepted)
        visited = np.mean(agree[expect[:-1]])
        if fraction in (0.0, 1.0):
            assert stats.acceptance_rate == fraction
        else:
            # Per-position conditional acceptance is the share of visited tokens in the set.
            assert abs(stats.acceptance_per_position[0] - visited) < 0.15
            assert abs(visited - fraction) < 0.2


def test_rollback_is_needed(pairs, monkeypatch):
    """Negative control: a rollback that also drops the last committed row (off by one) is
    caught by the comparison with plain greedy decoding."""
    gen = generator(pairs.target, pairs.drafters["dflash"])
    prompt = PROMPTS[2]
    want = plain_greedy(gen, prompt, 30)
    assert list(gen.tokens(prompt, GREEDY, max_tokens=30)) == want
    real = pyspec.Context.kv_remove
    monkeypatch.setattr(pyspec.Context, "kv_remove",
                        lambda self, seq, p0=0, p1=-1: real(self, seq, p0 - 1, p1))
    assert list(gen.tokens(prompt, GREEDY, max_tokens=30)) != want


# ---------------------------------------------------------------------------------------------
# T > 0: the target's law, chi-square

def chi2_pvalue(counts, probs):
    """p-value of `counts` against `probs`; cells expecting fewer than 5 draws are pooled into
    one (scipy's rule of thumb), and a draw in a cell of probability 0 fails outright."""
    counts = np.asarray(counts, np.float64).ravel()
    probs = np.asarray(probs, np.float64).ravel()
    probs = probs / probs.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    stat = float(((counts - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, len(counts) - 1))


def _target_probs(ctx, tokens, temperature):
    ctx.kv_clear()
    z = ctx.decode(tokens).logits[-1].astype(np.float64) / temperature
    e = np.exp(z - z.max())
    return e / e.sum()


def prefix_law(ctx, prompt, temperature, n_vocab):
    """Target law of the first two generated tokens: softmax(logits / T) chained."""
    p1 = _target_probs(ctx, prompt, temperature)
    return p1, p1[:, None] * np.stack([_target_probs(ctx, prompt + [x], temperature)
                                       for x in range(n_vocab)])


def second_pair_law(ctx, prompt, temperature, n_vocab):
    """Target law of the second and third generated tokens (the first marginalised out). The
    first token comes from the prompt's own pass; these two from the first drafted round."""
    p1, p12 = prefix_law(ctx, prompt, temperature, n_vocab)
    p23 = np.zeros((n_vocab, n_vocab))
    for x in range(n_vocab):
        for y in range(n_vocab):
            p23[y] += p12[x, y] * _target_probs(ctx, prompt + [x, y], temperature)
    return p23


def sample_prefixes(gen, prompt, temperature, n):
    """First three tokens of n speculative generations with seeds 0..n-1."""
    out = np.empty((n, 3), np.int64)
    stats = SpecStats()
    for seed in range(n):
        it = gen.tokens(prompt, SamplingParams(temperature, 0, 1.0, 0.0, seed), stats=stats)
        out[seed] = [next(it), next(it), next(it)]
        it.close()
    return out, stats


class _WrongTemperatureProposal:
    """A draft context whose q rows are softmax(logits / 2T): the wrong temperature."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def draft_logits(self, *args, **kwargs):
        out = self._real.draft_logits(*args, **kwargs)
        if "q" in out:
            t = 2.0 * kwargs["temperature"]
            out["q"] = np.stack([_core.spec.proposal(row, t) for row in out["logits"]])
        return out


N_T = 3000
PROMPT_T = [3, 1, 4]


@pytest.mark.parametrize("layout,verify", [("dflash", "rejection"), ("dspark-anchor", "block"),
                                           ("dspark-anchor", "rejection"), ("dspark-bonus", "block")])
def test_sampling_follows_target_law(pairs, layout, verify):
    target, drafters = pairs.small_vocab()
    gen = generator(target, drafters[layout], draft_n_max=3, verify=verify)
    T = 1.0
    p1, p12 = prefix_law(gen.ctx, PROMPT_T, T, 8)
    p23 = second_pair_law(gen.ctx, PROMPT_T, T, 8)
    got, stats = sample_prefixes(gen, PROMPT_T, T, N_T)
    assert stats.draft_n_accepted > 0.2 * stats.n_rounds  # drafts are accepted, not only resampled
    assert stats.draft_n_accepted <= stats.draft_n and stats.zero_q == stats.empty_residual == 0
    assert chi2_pvalue(np.bincount(got[:, 0], minlength=8), p1) > ALPHA
    assert chi2_pvalue(np.bincount(got[:, 0] * 8 + got[:, 1], minlength=64), p12) > ALPHA
    # Tokens 2 and 3: the first drafted round's first two positions.
    assert chi2_pvalue(np.bincount(got[:, 1] * 8 + got[:, 2], minlength=64), p23.ravel()) > ALPHA


def test_wrong_proposal_fails_the_law(pairs, monkeypatch):
    """Negative control: the chi-square above rejects a proposal stored at the wrong temperature."""
    import pyspec.speculative as speculative
    target, drafters = pairs.small_vocab()
    gen = generator(target, drafters["dflash"], draft_n_max=3, verify="rejection")
    monkeypatch.setattr(gen.drafter, "context", _WrongTemperatureProposal(gen.drafter.context))
    p23 = second_pair_law(gen.ctx, PROMPT_T, 1.0, 8)
    got, _ = sample_prefixes(gen, PROMPT_T, 1.0, 1000)
    assert chi2_pvalue(np.bincount(got[:, 1] * 8 + got[:, 2], minlength=64), p23.ravel()) < ALPHA


# ---------------------------------------------------------------------------------------------
# pyspec.LLM and pyspec-cli


def test_llm_speculates_losslessly_with_consistent_stats(pairs):
    plain = pyspec.LLM(pairs.target, n_ctx=256, n_threads=2)
    spec = pyspec.LLM(pairs.target, n_ctx=256, n_threads=2, draft_model=pairs.drafters["dspark-bonus"],
                      draft_n_max=4)
    assert spec.speculative.drafter.spec_type == "draft-dspark"
    for prompt in ["The quick brown fox", "Hello, world!"]:
        want = plain.generate(prompt, max_tokens=30, temperature=0, ignore_eos=True)
        assert spec.generate(prompt, max_tokens=30, temperature=0, ignore_eos=True) == want
        st = spec.last_stats
        assert st.n_generated == 30 and st.stop_reason == "length"
        assert st.draft_n_accepted <= st.draft_n <= 4 * st.spec.n_rounds
        assert st.n_generated == st.spec.draft_n_accepted + st.spec.n_rounds
        # The decode rate is per token, not per round.
        # (the first token comes from the prompt's pass, its round counted as prompt time)
        assert st.n_decoded == st.spec.n_rounds - 1 and st.n_decode_tokens == st.n_generated - 1
        assert st.decode_tokens_per_second == pytest.approx((st.n_generated - 1) / st.decode_seconds)
        assert sum(st.spec.accepted_at) == st.draft_n_accepted
        # Every round but the prompt's and the last drafts (the last has room for one token only).
        assert st.spec.drafted_at[0] >= st.spec.n_rounds - 2
    # Sampling at T > 0 goes through rejection sampling by default and stays consistent.
    text = spec.generate("Hello", max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)
    st = spec.last_stats
    assert text and st.n_generated == st.spec.draft_n_accepted + st.spec.n_rounds == 20
    assert spec.generate("Hello", max_tokens=20, temperature=0.8, seed=3, ignore_eos=True) == text


def test_llm_refuses_bad_drafters(pairs, tmp_path):
    other = tiny.make_target(tmp_path / "hf-narrow", "llama", seed=1, hidden_size=32)
    narrow = str(tmp_path / "narrow.gguf")
    convert(other.path, narrow, "f32", progress=False)
    with pytest.raises(ValueError, match=r"cannot use draft model .* drafter hidden size 64 != "
                                         r"target hidden size 32"):
        pyspec.LLM(narrow, n_ctx=64, n_threads=1, draft_model=pairs.drafters["dflash"])
    with pytest.raises(ValueError, match="does not match the draft model .* draft-dflash"):
        pyspec.LLM(pairs.target, n_ctx=64, n_threads=1, draft_model=pairs.drafters["dflash"],
                   spec_type="draft-dspark")
    with pytest.raises(ValueError, match="need a draft_model"):
        pyspec.LLM(pairs.target, n_ctx=64, n_threads=1, draft_n_max=3)
    llm = pyspec.LLM(pairs.target, n_ctx=64, n_threads=1, draft_model=pairs.drafters["dflash"],
                     verify="greedy")
    with pytest.raises(ValueError, match="needs temperature 0"):
        llm.generate("Hi", max_tokens=3, temperature=0.5)


def test_cli_model_draft(pairs, capsys):
    from pyspec import cli
    args = ["-m", pairs.target, "-p", "The quick", "-n", "12", "--temp", "0", "-t", "2", "-c", "128",
            "--ignore-eos", "--no-display-prompt"]
    assert cli.main(args) == 0
    plain = capsys.readouterr()
    assert cli.main(args + ["-md", pairs.drafters["dflash"], "--draft-max", "3"]) == 0
    spec = capsys.readouterr()
    assert spec.out == plain.out and spec.out
    assert "draft acceptance" in spec.err and "draft acceptance" not in plain.err
    assert cli.main(args + ["--draft-max", "3"]) == 1
    assert "need a draft model" in capsys.readouterr().err
    assert cli.main(args + ["-md", pairs.drafters["dspark-anchor"], "--spec-draft-p-min", "0.3",
                            "--spec-draft-n-min", "1", "--draft-p-min-mode", "cumulative"]) == 0
    assert capsys.readouterr().out == plain.out
    assert cli.main(args + ["--draft-p-min", "0.3"]) == 1
    assert "need a draft model" in capsys.readouterr().err
    assert cli.main(args + ["-md", pairs.drafters["dflash"], "--draft-p-min", "2"]) == 1
    assert "--draft-p-min must be in [0, 1]" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# DSpark ancestral drafting (design.md invariant 5): the drafter graph's own draws


def _softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


def _dspark_small(pairs, layout="dspark-anchor"):
    """(drafter context, id_last, pos0, bias(t) = W2 W1[t], target path) over the 8-token target,
    with PROMPT_T's context injected."""
    target, drafters = pairs.small_vocab()
    gen = generator(target, drafters[layout], draft_n_max=3)
    gen.ctx.kv_clear()
    dctx = gen.drafter.context
    dctx.clear(0)
    gen._commit(PROMPT_T[:-1], 0, len(PROMPT_T) - 1)
    w = tensors_of(drafters[layout])
    w1, w2 = w["markov_w1.weight"].astype(np.float64), w["markov_w2.weight"].astype(np.float64)
    return dctx, PROMPT_T[-1], len(PROMPT_T) - 1, lambda t: w2 @ w1[t], gen


@pytest.mark.parametrize("layout", ["dspark-anchor", "dspark-bonus"])
def test_dspark_ancestral_draws(pairs, layout):
    """Position 0 follows softmax((base_0 + bias(id_last)) / T); position 1 given d_0 follows
    softmax((base_1 + bias(d_0)) / T) (chi-square at 1e-4 over draws keyed by distinct offsets);
    every draw is argmax(z + g) with g the Philox draft noise of (seed, offset, pos0 + 1 + k);
    q is softmax(z) of the returned biased logits; same key, same tokens."""
    dctx, id_last, pos0, bias, gen = _dspark_small(pairs, layout)
    off = gen.offset
    n_block, T, seed, n = 3 + off, 1.3, 7, 3000
    inv = np.float32(1.0 / T)
    greedy = dctx.draft_logits(0, id_last, pos0, n_block)
    base = greedy["base_logits"].astype(np.float64)
    d = np.empty((n, 2), np.int64)
    for o in range(n):
        out = dctx.draft_logits(0, id_last, pos0, n_block, temperature=T, seed=seed, offset=1000 + o)
        toks, logits = out["tokens"], out["logits"]
        np.testing.assert_array_equal(out["base_logits"], greedy["base_logits"])
        prev = id_last
        for k in range(3):
            i = off + k
            # The slot's logits carry the bias of the token actually drawn before it.
            np.testing.assert_allclose(logits[i], base[i] + bias(prev), rtol=0, atol=1e-4)
            z = logits[i].astype(np.float32) * inv
            g = _core.spec.gumbel(seed, 1000 + o, pos0 + 1 + k, 8)
            assert toks[i] == int(np.argmax(z + g))
            np.testing.assert_allclose(out["q"][i], _softmax(z), rtol=1e-5, atol=1e-7)
            prev = int(toks[i])
        if off:
            assert not out["q"][0].any()
        d[o] = toks[off:off + 2]
    law0 = _softmax((base[off] + bias(id_last)) / T)
    assert chi2_pvalue(np.bincount(d[:, 0], minlength=8), law0) > ALPHA
    mode = int(np.argmax(np.bincount(d[:, 0], minlength=8)))
    law1 = _softmax((base[off + 1] + bias(mode)) / T)
    given = d[d[:, 0] == mode, 1]
    assert len(given) > 300
    assert chi2_pvalue(np.bincount(given, minlength=8), law1) > ALPHA
    # Negative control: the argmax chain's bias at position 1 is a different law and is rejected
    # whenever d_0 differs from the chain's argmax.
    a0 = int(np.argmax(base[off] + bias(id_last)))
    if mode != a0:
        wrong = _softmax((base[off + 1] + bias(a0)) / T)
        assert chi2_pvalue(np.bincount(given, minlength=8), wrong) < ALPHA
    # Same key, same draws; new offsets draw anew (the draws above vary across offsets).
    a = dctx.draft_logits(0, id_last, pos0, n_block, temperature=T, seed=seed, offset=1000)
    b = dctx.draft_logits(0, id_last, pos0, n_block, temperature=T, seed=seed, offset=1000)
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    np.testing.assert_array_equal(a["q"], b["q"])
    assert len({tuple(r) for r in d[:50].tolist()}) > 1
    assert int(a["tokens"][off]) == int(d[0, 0]) and int(a["tokens"][off + 1]) == int(d[0, 1])
    # The loop keys offset = pos0 by default.
    c = dctx.draft_logits(0, id_last, pos0, n_block, temperature=T, seed=seed)
    e = dctx.draft_logits(0, id_last, pos0, n_block, temperature=T, seed=seed, offset=pos0)
    np.testing.assert_array_equal(c["tokens"], e["tokens"])
    # T = 0: the argmax chain, no q.
    assert "q" not in greedy
    prev = id_last
    for k in range(3):
        assert greedy["tokens"][off + k] == int(np.argmax(greedy["logits"][off + k]))
        np.testing.assert_allclose(greedy["logits"][off + k], base[off + k] + bias(prev), atol=1e-4)
        prev = int(greedy["tokens"][off + k])


def test_dflash_draws_match_gumbel_max(pairs):
    """DFlash slots are independent of earlier drafts: each is spec.gumbel_max of its logits with
    the draft key, and q is spec.proposal of the same row."""
    target, drafters = pairs.small_vocab()
    gen = generator(target, drafters["dflash"], draft_n_max=3)
    gen.ctx.kv_clear()
    gen.drafter.context.clear(0)
    gen._commit(PROMPT_T[:-1], 0, len(PROMPT_T) - 1)
    pos0 = len(PROMPT_T) - 1
    for o in range(20):
        out = gen.drafter.context.draft_logits(0, PROMPT_T[-1], pos0, 4, temperature=0.9, seed=3,
                                               offset=o)
        for k in range(3):
            row = out["logits"][1 + k]
            assert out["tokens"][1 + k] == _core.spec.gumbel_max(row, 0.9, 3, o, pos0 + 1 + k,
                                                                 _core.spec.STREAM_DRAFT)
            np.testing.assert_array_equal(out["q"][1 + k], _core.spec.proposal(row, 0.9))


# ---------------------------------------------------------------------------------------------
# Confidence pruning (reference/dflash-dspark.md §2.3)


def test_prune_length_rules():
    from pyspec.speculative import prune_length
    c = [0.9, 0.8, 0.3, 0.95]
    assert prune_length(c, 0.0) == 4
    assert prune_length(c, 0.5) == 2                      # first position below 0.5
    assert prune_length(c, 0.85) == 1
    assert prune_length(c, 0.95) == 0
    assert prune_length(c, 0.7, "cumulative") == 2        # 0.9, 0.72, 0.216: stops at 2
    assert prune_length(c, 0.73, "cumulative") == 1       # 0.72 < 0.73 at position 1
    assert prune_length(c, 0.2, "cumulative") == 4        # 0.216, 0.2052 >= 0.2: all kept
    assert prune_length(c, 0.21, "cumulative") == 3       # 0.2052 < 0.21 at position 3
    assert prune_length(c, 0.5, n_min=3) == 0             # 2 < n_min: dropped
    assert prune_length(c, 0.5, n_min=2) == 2
    assert prune_length(c, 0.0, n_min=5) == 0
    with pytest.raises(ValueError, match="unknown p_min mode"):
        prune_length(c, 0.5, "product")


class _Recorder:
    """A draft context that records each round's confidences."""

    def __init__(self, real):
        self._real, self.conf = real, []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def draft_logits(self, *args, **kwargs):
        out = self._real.draft_logits(*args, **kwargs)
        self.conf.append(np.array(out["confidence"]))
        return out


def _constant_confidence(pairs, c):
    """The anchor-first DSpark drafter with conf_proj zeroed and its bias at logit(c)."""
    src = pairs.drafters["dspark-anchor"]
    d = tensors_of(src)
    b = np.float32(np.log(c / (1 - c)))
    return edit_gguf(src, pairs.root / f"conf-{c}.gguf",
                     tensors={"conf_proj.weight": np.zeros_like(d["conf_proj.weight"]),
                              "conf_proj.bias": np.array([b], np.float32)})


@pytest.mark.parametrize("mode", ["first", "cumulative"])
def test_pruning_drafts_up_to_the_first_low_confidence(pairs, monkeypatch, mode):
    """Every round drafts exactly up to the first position whose confidence (or running product)
    is below p_min, as recorded from the drafter; T = 0 output stays token-identical."""
    gen = generator(pairs.target, pairs.drafters["dspark-anchor"], draft_n_max=5)
    rec = _Recorder(gen.drafter.context)
    monkeypatch.setattr(gen.drafter, "context", rec)
    prompt = PROMPTS[2]
    list(gen.tokens(prompt, GREEDY, max_tokens=40))
    allc = np.concatenate([c[:5] for c in rec.conf])
    p_min = float(np.median(allc)) if mode == "first" else float(np.median(allc) ** 2)
    rec.conf.clear()
    gen = SpeculativeGenerator(gen.ctx, gen.drafter, draft_n_max=5, draft_p_min=p_min,
                               draft_p_min_mode=mode)
    rounds = []  # (room, drafted) per round
    real = gen._draft

    def draft(id_last, pos0, n_draft, temperature, seed):
        drafts, q = real(id_last, pos0, n_draft, temperature, seed)
        rounds.append((n_draft, len(drafts)))
        return drafts, q

    gen._draft = draft
    stats = SpecStats()
    out = list(gen.tokens(prompt, GREEDY, max_tokens=40, stats=stats))
    assert out == plain_greedy(gen, prompt, 40)
    assert len(rounds) == stats.n_rounds - 1  # the prompt's round drafts nothing
    drafting = [r for r in rounds if r[0] > 0]  # a round with no room drafts nothing
    assert len(drafting) == len(rec.conf)
    pruned = 0
    for (room, drafted), c in zip(drafting, rec.conf):
        run = c[:room] if mode == "first" else np.cumprod(c[:room].astype(np.float64))
        below = np.flatnonzero(run < p_min)
        assert drafted == (int(below[0]) if len(below) else room)
        pruned += drafted < room
    assert pruned > 0 and sum(d for _, d in rounds) == stats.draft_n > 0


def test_pruning_constant_confidence(pairs):
    """conf = 0.8 everywhere: first mode with p_min 0.85 drafts nothing, with 0.75 everything;
    cumulative with 0.6 stops where 0.8^(k+1) < 0.6, i.e. after 2 drafts; n_min 3 drops those.
    Output stays token-identical to plain greedy in every case."""
    drafter = _constant_confidence(pairs, 0.8)
    prompt = PROMPTS[1]
    for p_min, mode, n_min, per_round in [(0.85, "first", 0, 0), (0.75, "first", 0, 4),
                                          (0.6, "cumulative", 0, 2), (0.6, "cumulative", 3, 0),
                                          (0.0, "first", 5, 0)]:
        base = generator(pairs.target, drafter, draft_n_max=4)
        gen = SpeculativeGenerator(base.ctx, base.drafter, draft_n_max=4, draft_p_min=p_min,
                                   draft_p_min_mode=mode, draft_n_min=n_min)
        stats = SpecStats()
        out = list(gen.tokens(prompt, GREEDY, max_tokens=30, stats=stats))
        assert out == plain_greedy(gen, prompt, 30), (p_min, mode, n_min)
        # Every round but the prompt's (no drafts) and those near the end (room < per_round)
        # drafts exactly per_round.
        full = [n for n in stats.drafted_at]
        assert stats.draft_n <= per_round * stats.n_rounds
        assert len(stats.drafted_at) == per_round
        if per_round:
            # (the last rounds have less room: 30 tokens, nothing accepted)
            assert stats.drafted_at[per_round - 1] >= stats.n_rounds - 1 - per_round, (p_min, mode, full)


def test_pruning_options_are_checked(pairs):
    base = generator(pairs.target, pairs.drafters["dspark-anchor"])
    with pytest.raises(ValueError, match="draft_p_min must be in"):
        SpeculativeGenerator(base.ctx, base.drafter, draft_p_min=1.5)
    with pytest.raises(ValueError, match="draft_n_min must be"):
        SpeculativeGenerator(base.ctx, base.drafter, draft_n_min=-1)
    with pytest.raises(ValueError, match="unknown draft_p_min_mode"):
        SpeculativeGenerator(base.ctx, base.drafter, draft_p_min_mode="sum")
    noconf = edit_gguf(pairs.drafters["dspark-anchor"], pairs.root / "noconf.gguf",
                       keys={"dflash.has_confidence_head": False})
    nc = generator(pairs.target, noconf)
    assert not nc.drafter.model.has_confidence_head
    with pytest.raises(ValueError, match="no confidence head"):
        SpeculativeGenerator(nc.ctx, nc.drafter, draft_p_min=0.5)
    with pytest.raises(ValueError, match="need a draft_model"):
        pyspec.LLM(pairs.target, n_ctx=64, n_threads=1, draft_p_min=0.5)
    llm = pyspec.LLM(pairs.target, n_ctx=128, n_threads=1, draft_model=pairs.drafters["dspark-anchor"],
                     draft_p_min=0.6, draft_n_min=1, draft_p_min_mode="cumulative")
    g = llm.speculative
    assert (g.draft_p_min, g.draft_n_min, g.draft_p_min_mode) == (0.6, 1, "cumulative")
