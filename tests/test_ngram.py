"""Draftless speculation: llama-server's ngram-simple in the SpecEngine (csrc/spec/ngram.h).

- The lookup against a brute-force reference: the tokens after the most recent earlier
  occurrence of the history's last n tokens, at most m.
- T = 0: outputs equal plain greedy decoding, alone and ahead of a drafter, and on a target whose
  greedy output cycles (the "known" pair: successor f[t]) the looked-up drafts are accepted.
- T > 0: looked-up drafts have a one-hot proposal, so rejection and block verification keep the
  target's law (chi-square of the first two tokens, with a negative control), and concurrent
  requests give what each gives alone (invariant 7).
"""
from __future__ import annotations

import numpy as np
import pytest

import pyspec
from pyspec import _core

from test_spec_engine import PROMPTS, known_requests, make_engine, models, one_at_a_time, run  # noqa: E402
from test_speculative import ALPHA, Pairs, chi2_pvalue, prefix_law, second_pair_law  # noqa: E402
from conftest import run_requests  # noqa: E402


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return Pairs(tmp_path_factory.mktemp("ngram"))


def reference_draft(history, n, m):
    key = history[len(history) - n:]
    for j in range(len(history) - n - 1, -1, -1):
        if history[j:j + n] == key:
            return history[j + n:j + n + m]
    return []


def test_lookup_matches_the_reference():
    rng = np.random.default_rng(7)
    found = 0
    for _ in range(3000):
        history = [int(t) for t in rng.integers(0, int(rng.integers(2, 6)), size=int(rng.integers(0, 40)))]
        n, m = int(rng.integers(1, 5)), int(rng.integers(1, 7))
        got = _core.spec.ngram_simple_draft(history, n, m)
        assert got == reference_draft(history, n, m), (history, n, m)
        found += bool(got)
    assert found > 1000   # the cases are not all misses
    assert _core.spec.ngram_simple_draft([1, 2, 3, 1, 2], 2, 5) == [3, 1, 2]   # runs into the key itself
    assert _core.spec.ngram_simple_draft([1, 2, 9, 1, 2, 8, 1, 2], 2, 1) == [8]  # the most recent match
    with pytest.raises(ValueError):
        _core.spec.ngram_simple_draft([1, 2], 0, 3)


def ngram_engine(target, drafter, n=2, m=8, n_seq_max=8, n_slots=8, draft_n_max=-1):
    model = _core.Model(target) if drafter is None else models(target, drafter)[0]
    return _core.SpecEngine(model, None if drafter is None else models(target, drafter)[1],
                            n_ctx=256 * n_seq_max, n_seq_max=n_seq_max, n_draft_slots=n_slots, n_batch=64,
                            draft_n_batch=128, n_threads=2, draft_n_max=draft_n_max, prefill_chunk=16,
                            ngram_n=n, ngram_m=m)


@pytest.mark.parametrize("with_drafter", [False, True])
def test_greedy_equals_plain_and_lookups_are_accepted(pairs, with_drafter):
    target, drafter, reqs, f = known_requests(pairs)
    engine = ngram_engine(target, drafter if with_drafter else None)
    got = run(engine, reqs, list(reqs)[::-1])
    for rid, (prompt, n, _) in reqs.items():
        expect = [prompt[-1]]
        for _ in range(n):
            expect.append(int(f[expect[-1]]))
        assert got[rid][0] == expect[1:], rid
    stats = [s for _, _, s in got.values()]
    ngram_rounds = sum(s["ngram_rounds"] for s in stats)
    assert ngram_rounds > 0
    # f's chains cycle, so once a cycle repeats every looked-up token is right.
    assert sum(s["ngram_draft_n_accepted"] for s in stats) > 0.8 * sum(s["ngram_draft_n"] for s in stats)
    assert all(s["ngram_draft_n"] <= s["draft_n"] for s in stats)
    if with_drafter:   # the drafter drafts the rounds the lookup misses
        assert sum(s["n_rounds"] for s in stats) > ngram_rounds
        assert sum(s["draft_n"] - s["ngram_draft_n"] for s in stats) > 0
    else:
        assert all(s["draft_n"] == s["ngram_draft_n"] for s in stats)


def test_ngram_drafts_respect_max_tokens_and_the_context(pairs):
    target, drafter, _, f = known_requests(pairs)
    engine = ngram_engine(target, None, n=1, m=40, n_seq_max=1)
    prompt = [7, int(f[7]), int(f[int(f[7])])]
    got = run(engine, {1: (prompt, 5, {})})
    assert len(got[1][0]) == 5
    assert all(len(b) <= 4 for b in got[1][1])   # never drafts past max_tokens
    # A full context ends the request where plain decoding ends it, with stop reason "context".
    def until_full(e):
        e.add_request(2, prompt, max_tokens=-1)
        got = run_requests(e)[2]
        return got.tokens, got.stop_reason
    looked_up, reason = until_full(engine)
    assert reason == "context" and (looked_up, reason) == until_full(ngram_engine(target, None, n=0, n_seq_max=1))


def test_bad_ngram_parameters(pairs):
    target, _, _, _ = known_requests(pairs)
    with pytest.raises(ValueError, match="n-gram"):
        ngram_engine(target, None, n=-1)
    with pytest.raises(ValueError, match="m >= 1"):
        ngram_engine(target, None, n=2, m=0)


@pytest.mark.parametrize("verify", ["rejection", "block"])
def test_sampling_with_lookups_concurrent_equals_alone(pairs, verify):
    target, drafters = pairs.small_vocab()
    kw = dict(temperature=0.8, verify=verify)
    reqs = {i: ([p % 8 for p in PROMPTS[i]], 25, dict(kw, seed=1000 + i)) for i in range(8)}
    alone = one_at_a_time(ngram_engine(target, drafters["dspark-anchor"], n=1, n_seq_max=1, n_slots=1), reqs)
    got = run(ngram_engine(target, drafters["dspark-anchor"], n=1), reqs, list(reqs)[::-1])
    assert got == alone
    assert sum(s["ngram_rounds"] for _, _, s in got.values()) > 0
    assert len({tuple(t) for t, _, _ in got.values()}) > 1


N_T = 3000
PROMPT_T = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5]   # the 8-token vocabulary repeats: lookups mostly match


@pytest.mark.parametrize("verify", ["rejection", "block"])
def test_sampling_with_lookups_follows_the_target_law(pairs, verify):
    target, _ = pairs.small_vocab()
    engine = ngram_engine(target, None, n=1, m=3, n_seq_max=1, n_slots=1)
    model = pyspec.Model(target, n_threads=2)
    ctx = pyspec.Context(model, n_ctx=64, n_seq_max=1, n_batch=64)
    p1, p12 = prefix_law(ctx, PROMPT_T, 1.0, 8)
    p23 = second_pair_law(ctx, PROMPT_T, 1.0, 8)
    got = np.empty((N_T, 3), np.int64)
    drafted = accepted = 0
    for seed in range(N_T):
        res = run(engine, {seed: (PROMPT_T, 3, dict(temperature=1.0, verify=verify, seed=seed))})
        toks, _, st = res[seed]
        got[seed] = toks
        drafted += st["ngram_draft_n"]
        accepted += st["ngram_draft_n_accepted"]
    # The prompt's pass gives token 1; the round after it looks up one draft whenever token 1
    # occurred before (most of the time: the prompt repeats the vocabulary), kept or rejected.
    assert N_T // 2 < drafted <= N_T and 0 < accepted < drafted
    assert chi2_pvalue(np.bincount(got[:, 0], minlength=8), p1) > ALPHA
    assert chi2_pvalue(np.bincount(got[:, 0] * 8 + got[:, 1], minlength=64), p12) > ALPHA
    assert chi2_pvalue(np.bincount(got[:, 1] * 8 + got[:, 2], minlength=64), p23.ravel()) > ALPHA
    # Negative control: the same draws against the law at another temperature fail.
    q23 = second_pair_law(ctx, PROMPT_T, 2.0, 8)
    assert chi2_pvalue(np.bincount(got[:, 1] * 8 + got[:, 2], minlength=64), q23.ravel()) < ALPHA


def test_llm_generate_many_with_lookups(pairs):
    """pyspec.LLM.generate_many(ngram_n=...): the same greedy text as without lookups, with lookups
    counted per prompt (the known target's greedy output cycles, so they match)."""
    target, drafter, _, _ = known_requests(pairs)
    llm = pyspec.LLM(target, n_ctx=256, n_threads=2, draft_model=drafter, draft_n_max=3)
    prompts = [[7 + 5 * i, 9 + i, 11] for i in range(4)]
    base = llm.generate_many(prompts, max_tokens=60, temperature=0, ignore_eos=True)
    looked = llm.generate_many(prompts, max_tokens=60, temperature=0, ignore_eos=True, ngram_n=2, ngram_m=8)
    assert [r.tokens for r in looked] == [r.tokens for r in base]
    assert all(r.ngram_rounds == 0 for r in base)
    assert sum(r.ngram_rounds for r in looked) > 0 and sum(r.ngram_draft_n_accepted for r in looked) > 0
    with pytest.raises(ValueError, match="n-gram"):
        llm.generate_many(prompts, ngram_n=-1)
