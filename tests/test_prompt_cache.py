"""The engine's prompt cache (llama-server's cache_prompt; csrc/spec/spec_engine.h):

- keep_cache: a request that ends (finished or cancelled) leaves its target sequence's KV rows
  and the engine records the tokens they hold (positions 0..n-1); nothing else stays behind
  (no request, no drafter state).
- reuse_cache on a pinned sequence: the rows of the longest common prefix with the recorded
  tokens are kept, never the last prompt token's (n_cached = min(prefix, len(prompt) - 1)).
- The output with reuse is the output without, token for token and log-probability for
  log-probability (reused rows equal recomputed ones bit for bit): whole prefix plus new turn,
  partial prefix, a prompt equal to (or a prefix of) the recorded tokens, after a cancel, at
  T > 0 without drafting.
- The drafter of a reusing request starts with the rows it decodes itself: its drafts are
  exactly those of the one-sequence Python loop whose drafter context starts at n_cached, and
  past the drafter window the drafter positions stay inside it.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyspec
from pyspec import _core
from pyspec.sampling import SamplingParams
from pyspec.speculative import Drafter, SpeculativeGenerator

from test_speculative import Pairs  # noqa: E402  (tests/ is on sys.path under pytest)

GREEDY = SamplingParams(temperature=0.0)
P1 = [3, 17, 29, 3, 3, 100, 101, 102, 7, 40, 41, 42, 43, 44, 45, 46, 9, 9, 12, 13]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return Pairs(tmp_path_factory.mktemp("prompt-cache"))


@pytest.fixture(scope="module")
def loaded(pairs):
    model = _core.Model(pairs.target)
    return model, _core.DraftModel(pairs.drafters["dflash"], model)


def engine(loaded, n_seq=2, drafter=True, draft_n_batch=128, n_ctx_seq=256, prefill_chunk=16):
    model, dm = loaded
    return _core.SpecEngine(model, dm if drafter else None, n_ctx=n_ctx_seq * n_seq,
                            n_seq_max=n_seq, n_draft_slots=n_seq, n_batch=64,
                            draft_n_batch=draft_n_batch, n_threads=2, draft_n_max=4,
                            prefill_chunk=prefill_chunk)


def run_one(e, rid, prompt, n, **kw):
    """Runs one request to its end: tokens, verified blocks, probs, stats."""
    e.add_request(rid, prompt, max_tokens=n, **kw)
    toks, blocks, probs, stats = [], [], [], None
    while e.has_request(rid):
        for o in e.step():
            assert o["request_id"] == rid
            toks += o["tokens"]
            probs += o.get("probs", [])
            if o["verified"]:
                blocks.append(list(o["verified"]))
            stats = o["stats"]
    return toks, blocks, probs, stats


def assert_idle(e, n_seq):
    assert e.n_requests == 0
    if e.has_drafter:
        assert e.registry_size == 0 and e.registry_held == 0
        assert all(e.draft_n_rows(s) == 0 for s in range(n_seq))
    for s in range(n_seq):
        assert e.target_pos_max(s) == len(e.cached_tokens(s)) - 1, s


def fresh(loaded, prompt, n, **kw):
    e = engine(loaded, n_seq=1)
    out = run_one(e, 1, prompt, n, **kw)
    assert_idle(e, 1)
    return out


def test_reuse_equals_fresh_and_records_the_cache(loaded):
    e = engine(loaded)
    keep = dict(seq=0, keep_cache=True, reuse_cache=True, n_probs=3)
    out1, _, _, st1 = run_one(e, 1, P1, 12, **keep)
    assert st1["n_cached"] == 0
    # The sequence holds prompt + output rows; the last emitted token has no row unless a later
    # token of its round was committed too (max_tokens cut the round).
    cached = e.cached_tokens(0)
    full = P1 + out1
    assert cached == full[:len(cached)] and len(cached) in (len(full) - 1, len(full))
    assert e.cached_tokens(1) == [] and e.target_pos_max(1) == -1
    assert_idle(e, 2)

    # A second turn: the whole first exchange, then new tokens.
    extra = [(t + 1) % 200 for t in out1[5:6]] + [50, 51, 52]
    p2 = P1 + out1[:5] + extra
    got = run_one(e, 2, p2, 15, **keep)
    assert got[3]["n_cached"] == len(P1) + 5
    want = fresh(loaded, p2, 15, n_probs=3)
    assert want[3]["n_cached"] == 0
    assert got[0] == want[0]
    assert got[2] == want[2]  # log-probabilities bit for bit: the reused rows are exact
    assert e.cached_tokens(0)[:len(p2)] == p2
    assert_idle(e, 2)


def test_partial_prefix_equal_prompt_and_no_reuse(loaded):
    e = engine(loaded)
    keep = dict(seq=1, keep_cache=True, reuse_cache=True)
    run_one(e, 1, P1, 10, **keep)
    cached = list(e.cached_tokens(1))

    # Diverges inside the first prompt.
    p2 = P1[:7] + [60, 61, 62, 63]
    got = run_one(e, 2, p2, 12, **keep)
    assert got[3]["n_cached"] == 7
    assert got[0] == fresh(loaded, p2, 12)[0]

    # A prompt equal to the recorded tokens: all rows but the last prompt token's are reused, and
    # the first step decodes that row alone and emits the first token.
    cached = list(e.cached_tokens(1))
    e.add_request(3, cached, max_tokens=9, **keep)
    assert e.stats(3)["n_cached"] == len(cached) - 1
    o = e.step()[0]
    assert o["n_prompt_processed"] == 1 and len(o["tokens"]) == 1
    toks = o["tokens"]
    while e.has_request(3):
        toks += e.step()[0]["tokens"]
    assert toks == fresh(loaded, cached, 9)[0]

    # A strict prefix of the recorded tokens.
    cached = list(e.cached_tokens(1))
    p4 = cached[:len(cached) - 6]
    got = run_one(e, 4, p4, 8, **keep)
    assert got[3]["n_cached"] == len(p4) - 1
    assert got[0] == fresh(loaded, p4, 8)[0]

    # reuse_cache off, or not pinned: nothing reused, the sequence is cleared.
    cached = list(e.cached_tokens(1))
    got = run_one(e, 5, cached, 4, seq=1, keep_cache=True)
    assert got[3]["n_cached"] == 0
    got = run_one(e, 6, e.cached_tokens(1), 4, keep_cache=True, reuse_cache=True)
    assert got[3]["n_cached"] == 0
    # keep_cache off: the sequence is cleared when the request ends.
    run_one(e, 7, P1, 4, seq=1)
    assert e.cached_tokens(1) == [] and e.target_pos_max(1) == -1
    assert_idle(e, 2)


def test_one_token_prompt_and_single_token_overlap(loaded):
    e = engine(loaded)
    keep = dict(seq=0, keep_cache=True, reuse_cache=True)
    out, _, _, _ = run_one(e, 1, [5], 6, **keep)
    assert e.cached_tokens(0)[0] == 5
    # One-token prompt matching the cache: nothing can be reused (the last token is decoded).
    got = run_one(e, 2, [5], 6, **keep)
    assert got[3]["n_cached"] == 0 and got[0] == out
    got = run_one(e, 3, [5, 77], 6, **keep)
    assert got[3]["n_cached"] == 1 and got[0] == fresh(loaded, [5, 77], 6)[0]
    assert_idle(e, 2)


@pytest.mark.parametrize("when", [1, 3, 5])
def test_cancel_leaves_a_consistent_cache(loaded, when):
    """Cancelled while prefilling (step 1: 16 of 40 prompt rows), right after it (step 3: the
    last 8 rows, whose last one gave the first token) or while generating (step 5): the cache
    holds exactly the recorded tokens, and a request reusing it gives the fresh output."""
    e = engine(loaded)
    keep = dict(seq=0, keep_cache=True, reuse_cache=True)
    prompt = P1 + P1[::-1]
    e.add_request(1, prompt, max_tokens=30, **keep)
    emitted = []
    for _ in range(when):
        emitted += e.step()[0]["tokens"]
    assert e.cancel(1) and not e.has_request(1)
    cached = e.cached_tokens(0)
    if when == 1:
        assert cached == prompt[:16]
    elif when == 3:
        assert len(emitted) == 1 and cached == prompt
    else:
        assert emitted and cached == (prompt + emitted)[:len(cached)]
        assert len(cached) >= len(prompt) + len(emitted) - 1
    assert_idle(e, 2)
    p2 = list(cached) + [8, 8]
    got = run_one(e, 2, p2, 10, **keep)
    assert got[3]["n_cached"] == len(cached)
    assert got[0] == fresh(loaded, p2, 10)[0]
    assert_idle(e, 2)


def test_idle_cache_reporting_and_clear(loaded):
    e = engine(loaded, n_seq=3)
    for s in range(3):
        run_one(e, 10 + s, P1[s:], 5 + s, seq=s, keep_cache=(s != 1), reuse_cache=True)
    assert_idle(e, 3)
    assert e.cached_tokens(1) == [] and len(e.cached_tokens(0)) >= len(P1) + 4
    assert e.cached_prefix(2, P1[2:9] + [0]) == 7 and e.cached_prefix(1, P1) == 0
    e.add_request(20, [1, 2, 3], max_tokens=50, seq=0, keep_cache=True, reuse_cache=True)
    assert e.cached_tokens(0) == []  # busy: what it held is being replaced
    e.step()
    with pytest.raises(ValueError, match="busy"):
        e.clear_cache(0)
    e.clear_cache()  # every idle one
    assert e.target_pos_max(2) == -1 and e.cached_tokens(2) == []
    assert e.target_pos_max(0) >= 0  # the busy one is left alone
    e.cancel(20)
    e.clear_cache(0)
    assert_idle(e, 3)
    assert all(e.target_pos_max(s) == -1 for s in range(3))


def test_sampling_without_drafting_equals_fresh(loaded):
    """T > 0, no drafts: the same seed gives the same tokens with and without reuse."""
    e = engine(loaded)
    kw = dict(temperature=0.9, seed=11, verify="rejection", draft=False)
    keep = dict(seq=0, keep_cache=True, reuse_cache=True)
    out1, _, _, _ = run_one(e, 1, P1, 10, **kw, **keep)
    p2 = P1 + out1 + [4, 4, 4]
    got = run_one(e, 2, p2, 20, **kw, **keep)
    assert got[3]["n_cached"] >= len(P1) + len(out1) - 1
    assert got[0] == fresh(loaded, p2, 20, **kw)[0]


class _FromPosition(SpeculativeGenerator):
    """The one-sequence loop whose drafter context starts at `start`: prompt rows before it are
    decoded into the target but not injected into the drafter."""

    start = 0

    def _commit(self, tokens, pos, n, logits=False):
        output = np.zeros(n, np.bool_)
        output[-1] = logits
        res = self.ctx.decode(tokens, positions=np.arange(pos, pos + n), output=output,
                              layer_inputs=self.layers, prompt=True)
        keep = np.arange(pos, pos + n) >= self.start
        if keep.any():
            feats = np.concatenate([res.layer_inputs[lid] for lid in self.layers], axis=1)
            self.drafter.context.inject(0, np.arange(pos, pos + n, dtype=np.int32)[keep],
                                        feats[keep])
        return res.logits


@pytest.mark.parametrize("layout", ["dflash", "dspark-bonus"])
def test_drafts_with_reuse_start_at_the_reused_prefix(pairs, layout):
    model = _core.Model(pairs.target)
    dm = _core.DraftModel(pairs.drafters[layout], model)
    e = engine((model, dm))
    keep = dict(seq=0, keep_cache=True, reuse_cache=True)
    out1, _, _, _ = run_one(e, 1, P1, 12, **keep)
    p2 = P1 + out1[:8] + [90, 91, 92, 93, 94]
    got_tokens, got_blocks, _, st = run_one(e, 2, p2, 24, **keep)
    start = st["n_cached"]
    assert start == len(P1) + 8

    pm = pyspec.Model(pairs.target, n_threads=2)
    gen = _FromPosition(pyspec.Context(pm, n_ctx=256, n_seq_max=1, n_batch=64),
                        Drafter(pairs.drafters[layout], pm, n_batch=128), draft_n_max=4)
    gen.start = start
    blocks = []
    real = gen._draft

    def spy(*a):
        d, q = real(*a)
        if len(d):
            blocks.append(d.tolist())
        return d, q

    gen._draft = spy
    want = list(gen.tokens(p2, GREEDY, max_tokens=24))
    assert got_tokens == want
    assert len(got_blocks) > 3 and got_blocks == blocks
    # ... and not what a drafter holding the whole prompt drafts (the prefix rows do matter).
    full = run_one(engine((model, dm), n_seq=1), 1, p2, 24)
    assert full[0] == want
    assert full[1] != got_blocks


def test_reuse_past_the_drafter_window(pairs, loaded):
    """A reused prefix longer than the drafter window: the drafter's first rows land past the
    window's reach, it rebases inside it, and the output is still the fresh one."""
    e = engine(loaded, draft_n_batch=48, n_ctx_seq=512, prefill_chunk=40)
    assert e.window == 48
    rng = np.random.default_rng(2)
    p1 = rng.integers(0, 256, 150).tolist()
    keep = dict(seq=0, keep_cache=True, reuse_cache=True)
    out1, _, _, _ = run_one(e, 1, p1, 10, **keep)
    p2 = p1 + out1 + rng.integers(0, 256, 70).tolist()
    got = run_one(e, 2, p2, 30, **keep)
    assert got[3]["n_cached"] >= 159
    assert 0 <= e.draft_max_pos_written < e.window
    want = run_one(engine(loaded, n_seq=1, draft_n_batch=48, n_ctx_seq=512, prefill_chunk=40),
                   1, p2, 30)
    assert got[0] == want[0]
    assert_idle(e, 2)
