"""The speculative step over many requests (csrc/spec/spec_engine.h): design invariants 3, 4, 6
and 7 with the tiny pairs of test_speculative.py.

- T = 0 with drafters: 8 concurrent requests give plain greedy output token for token.
- Invariant 7: 8 requests drafted at once give, per request, the same draft blocks, accepted
  counts and tokens as the same requests one at a time, whatever order (hence target sequence and
  drafter slot) they are added in; at T > 0 too (keyed noise).
- Registry (invariants 3, 4): with fewer drafter slots than requests, waiting requests reclaim
  the slot of a paused holder (least recently scheduled), which resumes with the same drafts and
  tokens as an uninterrupted run, also when it was reclaimed after its drafter context rebased
  (the slot is parked and restored cell for cell); past a drafter rebase the output stays plain
  greedy; requests finishing out of order leave the others drafting at every step;
  after all requests end, or are cancelled, the registry, target and drafter caches are empty.
- Confidence pruning (draft_p_min / draft_n_min / mode) in generate_many drafts and accepts
  exactly as the Python loop with the same options; T = 0 output stays plain greedy.
- Filters: the C++ target law (top-k -> top-p -> min-p -> temperature) equals a plain reference
  of llama.cpp's chain; generate_many with top_k / top_p / min_p at T > 0 gives per prompt the
  same tokens and draft stats as the Python loop (same seed and options).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import pyspec
from pyspec import _core
from pyspec.sampling import Sampler, SamplingParams
from pyspec.speculative import SpecStats

from test_speculative import Pairs  # noqa: E402  (tests/ is on sys.path under pytest)
from conftest import drain, run_requests  # noqa: E402

PROMPTS = [[5], [17, 3], [40, 41, 42, 43, 44, 45, 46], list(range(100, 160)), [9, 9, 9],
           [1, 2, 3, 4], list(range(200, 230)), [77, 78]]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return Pairs(tmp_path_factory.mktemp("engine"))


_models = {}


def models(target, drafter):
    if (target, drafter) not in _models:
        model = _core.Model(target)
        _models[(target, drafter)] = (model, _core.DraftModel(drafter, model))
    return _models[(target, drafter)]


def make_engine(target, drafter, n_seq_max=8, n_slots=8, draft_n_max=-1, n_ctx_seq=256):
    model, dm = models(target, drafter)
    return _core.SpecEngine(model, dm, n_ctx=n_ctx_seq * n_seq_max, n_seq_max=n_seq_max,
                            n_draft_slots=n_slots, n_batch=64, draft_n_batch=128, n_threads=2,
                            draft_n_max=draft_n_max, prefill_chunk=16)


def run(engine, requests, order=None, hook=None):
    """Adds `requests` ({id: (prompt, max_tokens, kwargs)}) in `order` and steps until all end.
    Per id: emitted tokens, the drafted block each of its rounds verified, final stats."""
    order = list(requests) if order is None else order
    for rid in order:
        prompt, n, kw = requests[rid]
        engine.add_request(rid, prompt, max_tokens=n, **kw)

    def between(outs):
        assert outs, "a step with active requests ran none"
        for o in outs:
            if not o["finished"]:
                assert o["n_drafted"] == len(engine.pending_drafts(o["request_id"]))
        if hook:
            hook(engine, outs)

    runs = run_requests(engine, between)
    assert all(runs[rid].stop_reason for rid in order)
    return {rid: (runs[rid].tokens, runs[rid].blocks, runs[rid].stats) for rid in order}


def one_at_a_time(engine, requests):
    out = {}
    for rid in requests:
        out.update(run(engine, {rid: requests[rid]}))
    return out


def assert_empty(engine, n_seq=8, n_slots=8):
    assert engine.n_requests == 0 and engine.registry_size == 0 and engine.registry_held == 0
    assert all(engine.target_pos_max(s) == -1 for s in range(n_seq))
    assert all(engine.draft_n_rows(s) == 0 for s in range(n_slots))


@pytest.mark.parametrize("layout", ["dflash", "dspark-anchor", "dspark-bonus"])
def test_greedy_equals_plain_greedy_concurrent(pairs, layout):
    target, drafters = pairs.small_vocab()
    prompts = [[p % 8 for p in q] for q in PROMPTS]
    model = pyspec.Model(target, n_threads=2)
    ctx = pyspec.Context(model, n_ctx=256, n_seq_max=1, n_batch=64)
    want = []
    for p in prompts:
        ctx.kv_clear()
        want.append(pyspec.generate(ctx, p, 30))
    engine = make_engine(target, drafters[layout])
    got = run(engine, {i: (p, 30, {}) for i, p in enumerate(prompts)})
    for i in range(len(prompts)):
        assert got[i][0] == want[i], (layout, i)
    # With 8 tokens random drafts do get accepted: the commit path is exercised.
    assert sum(st["draft_n_accepted"] for _, _, st in got.values()) > 0
    assert_empty(engine)


def known_requests(pairs, n=80):
    target, drafter, f, h, agree = pairs.known_acceptance(0.7, True, seed=3)
    reqs = {100 + i: ([7 + 5 * i, 9 + i, 11], n - 7 * i, {}) for i in range(8)}
    return target, drafter, reqs, f


def random_requests(pairs, layout="dflash"):
    """A random drafter on the 8-token target: its drafts depend on the staged context."""
    target, drafters = pairs.small_vocab()
    reqs = {200 + i: ([p % 8 for p in PROMPTS[i]], 24 + 3 * i, {}) for i in range(8)}
    return target, drafters[layout], reqs


@pytest.mark.parametrize("pair", ["known", "dflash", "dspark-bonus"])
def test_invariant7_concurrent_equals_one_at_a_time(pairs, pair):
    if pair == "known":
        target, drafter, reqs, f = known_requests(pairs)
    else:
        target, drafter, reqs = random_requests(pairs, pair)
    alone = one_at_a_time(make_engine(target, drafter, n_seq_max=1, n_slots=1, draft_n_max=5), reqs)
    if pair == "known":
        for rid, (prompt, n, _) in reqs.items():
            expect = [prompt[-1]]
            for _ in range(n):
                expect.append(int(f[expect[-1]]))
            assert alone[rid][0] == expect[1:]
    rate = (sum(a[2]["draft_n_accepted"] for a in alone.values())
            / sum(a[2]["draft_n"] for a in alone.values()))
    assert 0.2 < rate < 0.95 if pair == "known" else rate > 0
    ids = list(reqs)
    placements = set()
    # Orders move requests between target sequences; renaming them (the registry hands out slots
    # by ascending id) moves them between drafter slots.
    for order, rename in ((ids, 0), (ids[::-1], 0), ([ids[i] for i in (3, 0, 7, 5, 1, 6, 2, 4)], 0),
                          (ids, 1000)):
        name = {rid: (rename - rid if rename else rid) for rid in ids}
        engine = make_engine(target, drafter, draft_n_max=5)
        where = {}
        got = run(engine, {name[rid]: reqs[rid] for rid in ids}, [name[rid] for rid in order],
                  hook=lambda e, outs: where.update({o["request_id"]: (e.target_seq(o["request_id"]),
                                                                       e.draft_slot(o["request_id"]))
                                                     for o in outs if not o["finished"]}))
        for rid in ids:
            assert got[name[rid]] == alone[rid], (order, rid)
        placements.add(tuple(where[name[rid]] for rid in ids))
        assert_empty(engine)
    seqs = {tuple(s for s, _ in p) for p in placements}
    slots = {tuple(d for _, d in p) for p in placements}
    assert len(seqs) >= 3 and len(slots) == 2


@pytest.mark.parametrize("verify", ["rejection", "block"])
def test_invariant7_sampling(pairs, verify):
    target, drafters = pairs.small_vocab()
    kw = dict(temperature=0.8, verify=verify)
    reqs = {i: ([p % 8 for p in PROMPTS[i]], 25, dict(kw, seed=1000 + i)) for i in range(8)}
    alone = one_at_a_time(make_engine(target, drafters["dspark-anchor"], 1, 1), reqs)
    got = run(make_engine(target, drafters["dspark-anchor"]), reqs, list(reqs)[::-1])
    assert got == alone
    assert all(len(t) == 25 for t, _, _ in got.values())
    # Different seeds draw different continuations: the comparison is not between constants.
    assert len({tuple(t) for t, _, _ in got.values()}) > 1


@pytest.mark.parametrize("layout", ["dflash", "dspark-anchor"])
def test_reclaim_and_pause_keep_results(pairs, layout):
    target, drafter, reqs = random_requests(pairs, layout)
    alone = one_at_a_time(make_engine(target, drafter, n_seq_max=1, n_slots=1, draft_n_max=5), reqs)
    engine = make_engine(target, drafter, n_seq_max=8, n_slots=3, draft_n_max=5)
    seen = []

    def hook(e, outs):
        seen.append(len(outs))
        assert e.registry_held <= 3
        if e.steps == 4 and e.has_request(201):
            e.pause(201)
        if e.steps == 12 and e.has_request(201):
            assert e.draft_slot(201) is None  # reclaimed while it sat out
            e.resume(201)

    got = run(engine, reqs, hook=hook)
    assert max(seen) == 3
    for rid in reqs:
        assert got[rid][:2] == alone[rid][:2], rid
        st, ref = dict(got[rid][2]), dict(alone[rid][2])
        # Only the paused request lost its slot (to a waiting one) and was restaged.
        assert st.pop("n_restaged") == (1 if rid == 201 else 0), rid
        ref.pop("n_restaged")
        assert st == ref
    assert_empty(engine, 8, 3)


def test_out_of_order_finish_keeps_drafting(pairs):
    target, drafter, reqs, _ = known_requests(pairs)
    lengths = {rid: n for rid, (_, n, _) in reqs.items()}
    engine = make_engine(target, drafter, draft_n_max=5)
    done = {rid: 0 for rid in reqs}
    per_step = []

    def hook(e, outs):
        proposals = 0
        for o in outs:
            rid = o["request_id"]
            done[rid] += len(o["tokens"])
            if o["finished"]:
                continue
            # Every request still generating drafts a block sized by the tokens it still wants.
            assert o["n_drafted"] == min(5, lengths[rid] - done[rid] - 1), (e.steps, rid)
            proposals += o["n_drafted"] > 0
        per_step.append(proposals)

    got = run(engine, reqs, list(reqs)[::-1], hook=hook)
    ends = sorted(len(t) for t, _, _ in got.values())
    assert ends == sorted(lengths.values()) and len(set(ends)) == 8
    assert per_step[0] == 8 and 0 < min(per_step[:-1])
    assert_empty(engine)


def test_cancel_frees_everything(pairs):
    target, drafter, reqs = random_requests(pairs)
    alone = one_at_a_time(make_engine(target, drafter, n_seq_max=1, n_slots=1, draft_n_max=5), reqs)
    engine = make_engine(target, drafter, n_seq_max=4, n_slots=4, draft_n_max=5)
    ids = list(reqs)[:4]
    for rid in ids:
        engine.add_request(rid, reqs[rid][0], max_tokens=reqs[rid][1])
    tokens = {rid: [] for rid in ids}
    for _ in range(3):
        for o in engine.step():
            tokens[o["request_id"]] += o["tokens"]
    seq, slot = engine.target_seq(ids[1]), engine.draft_slot(ids[1])
    assert engine.target_pos_max(seq) > 0 and engine.draft_n_rows(slot) > 0
    assert engine.cancel(ids[1]) and not engine.cancel(ids[1])
    assert engine.registry_size == 3 and engine.target_pos_max(seq) == -1
    assert engine.draft_n_rows(slot) == 0
    # The freed sequence and slot serve a new request with the same result as alone.
    late = list(reqs)[5]
    engine.add_request(late, reqs[late][0], max_tokens=reqs[late][1])
    tokens[late] = []
    for o in drain(engine):
        tokens[o["request_id"]] += o["tokens"]
    for rid in ids[:1] + ids[2:] + [late]:
        assert tokens[rid] == alone[rid][0], rid
    assert_empty(engine, 4, 4)


def test_bad_requests(pairs):
    target, drafters = pairs.small_vocab()
    engine = make_engine(target, drafters["dflash"], n_seq_max=2, n_slots=1)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(1, [], max_tokens=4)
    with pytest.raises(ValueError, match="greedy"):
        engine.add_request(1, [1, 2], max_tokens=4, temperature=0.5, verify="greedy")
    engine.add_request(1, [1, 2], max_tokens=4)
    with pytest.raises(ValueError, match="already"):
        engine.add_request(1, [1, 2], max_tokens=4)
    engine.add_request(2, [1, 2], max_tokens=4)
    with pytest.raises(ValueError, match="sequence"):
        engine.add_request(3, [1, 2], max_tokens=4)
    with pytest.raises(ValueError, match="unknown"):
        engine.pause(99)


def test_llm_generate_many(pairs):
    plain = pyspec.LLM(pairs.target, n_ctx=256, n_threads=2)
    spec = pyspec.LLM(pairs.target, n_ctx=256, n_threads=2,
                      draft_model=pairs.drafters["dspark-bonus"], draft_n_max=4)
    prompts = ["The quick brown fox", "Hello, world!", "a", "One two three four five six"]
    want = [plain.generate(p, max_tokens=30, temperature=0, ignore_eos=True) for p in prompts]
    alone = []
    for p in prompts:
        spec.generate(p, max_tokens=30, temperature=0, ignore_eos=True)
        alone.append(spec.last_stats)
    for kw in ({}, dict(draft_slots=2), dict(n_parallel=3, draft_n_batch=64)):
        res = spec.generate_many(prompts, max_tokens=30, temperature=0, ignore_eos=True, **kw)
        assert [r.text for r in res] == want, kw
        for r, st in zip(res, alone):
            assert r.stop_reason == "length" and len(r.tokens) == 30
            assert r.draft_n_accepted <= r.draft_n <= 4 * r.n_rounds
            assert len(r.tokens) == r.draft_n_accepted + r.n_rounds
            # The C++ step drafts and accepts exactly as the one-sequence Python loop.
            assert (r.draft_n, r.draft_n_accepted) == (st.draft_n, st.draft_n_accepted)
            assert r.accepted_at == st.spec.accepted_at
    # T > 0: reproducible per prompt whatever runs alongside.
    many = spec.generate_many(prompts, max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)
    solo = spec.generate_many(prompts[2:3], max_tokens=20, temperature=0.8, seed=7,
                              ignore_eos=True)
    assert many[2].tokens == solo[0].tokens and len(solo[0].tokens) == 20
    assert spec.generate_many(prompts[:1], max_tokens=0)[0].text == ""
    with pytest.raises(ValueError, match="draft_model"):
        plain.generate_many(prompts)


def test_long_prompts_past_the_drafter_window(pairs):
    """Prompts several times the drafter window (rebased drafter rows, chunked prefill) with
    fewer slots than requests: still plain greedy output, and the drafter never holds more rows
    than its window."""
    target, drafters = pairs.small_vocab()
    model, dm = models(target, drafters["dflash"])
    engine = _core.SpecEngine(model, dm, n_ctx=4 * 512, n_seq_max=4, n_draft_slots=2, n_batch=64,
                              draft_n_batch=48, n_threads=2, prefill_chunk=40)
    assert engine.window == 48
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 8, n).tolist() for n in (300, 170, 5, 420)]
    ref = pyspec.Context(pyspec.Model(target, n_threads=2), n_ctx=512, n_seq_max=1, n_batch=64)
    want = []
    for p in prompts:
        ref.kv_clear()
        want.append(pyspec.generate(ref, p, 40))
    rows = []

    def hook(e, outs):
        rows.extend(e.draft_n_rows(s) for s in range(2))
        # Request 0 sits out a while past its first rebase; a waiting request takes its slot.
        if e.steps == 9:
            e.pause(0)
        if e.steps == 14:
            assert e.draft_slot(0) is None
            e.resume(0)

    got = run(engine, {i: (p, 40, {}) for i, p in enumerate(prompts)}, hook=hook)
    for i in range(len(prompts)):
        assert got[i][0] == want[i], i
    assert 0 < max(rows) <= 48
    assert got[0][2]["n_restaged"] == 1
    assert_empty(engine, 4, 2)


def test_reclaim_after_rebase_resumes_identical(pairs):
    """Invariant 4 past a rebase: a request whose drafter context was rebased (K re-rotated in
    steps) is reclaimed while paused and resumes with the same drafts, accepted counts and tokens
    as an uninterrupted run: its slot is parked cell for cell and restored, not rebuilt."""
    model, dm = models(pairs.target, pairs.drafters["dflash"])
    n_vocab = 256

    def engine(n_seq, n_slots):
        return _core.SpecEngine(model, dm, n_ctx=n_seq * 512, n_seq_max=n_seq,
                                n_draft_slots=n_slots, n_batch=64, draft_n_batch=48, n_threads=2,
                                draft_n_max=5, prefill_chunk=40)

    rng = np.random.default_rng(1)
    reqs = {i: (rng.integers(0, n_vocab, n).tolist(), 40, {}) for i, n in enumerate((300, 170, 5, 420))}
    alone = one_at_a_time(engine(1, 1), reqs)
    e = engine(4, 2)
    based = []

    def hook(e, outs):
        if e.steps == 9:
            based.append(e.draft_pos_base(e.draft_slot(0)))
            e.pause(0)
        if e.steps == 14:
            assert e.draft_slot(0) is None
            e.resume(0)

    got = run(e, reqs, hook=hook)
    assert based and based[0] > 0  # parked after its drafter context was rebased
    assert got[0][2]["n_restaged"] == 1
    for rid in reqs:
        assert got[rid][:2] == alone[rid][:2], rid
        st, ref = dict(got[rid][2]), dict(alone[rid][2])
        st.pop("n_restaged"), ref.pop("n_restaged")
        assert st == ref, rid
    assert_empty(e, 4, 2)


PRUNING = [dict(draft_p_min=0.5), dict(draft_p_min=0.3, draft_p_min_mode="cumulative"),
           dict(draft_p_min=0.3, draft_n_min=2)]


@pytest.mark.parametrize("layout", ["known", "dflash", "dspark-bonus"])
def test_generate_many_pruning_matches_the_python_loop(pairs, layout):
    """Confidence pruning in the C++ step (per-request draft_p_min / draft_n_min / mode, the rule
    of csrc/spec/prune.h that the Python loop's prune_length also calls): per prompt,
    generate_many drafts and accepts exactly as the one-sequence Python loop with the same
    options (draft_n, draft_n_accepted, drafted_at, accepted_at), the pruning really cuts drafts,
    and T = 0 output stays plain greedy."""
    if layout == "known":
        target, drafter, f, _, _ = pairs.known_acceptance(0.7, True, seed=3)
        prompts = [[7], [11, 12], [100, 101, 102], [5, 6, 7, 8]]
    else:
        target, drafter = pairs.target, pairs.drafters[layout]
        prompts = ["The quick brown fox", "Hello, world!", "a", "One two three four five six"]
    plain = pyspec.LLM(target, n_ctx=256, n_threads=2)
    want = [plain.generate(p, max_tokens=30, temperature=0, ignore_eos=True) for p in prompts]
    spec = pyspec.LLM(target, n_ctx=256, n_threads=2, draft_model=drafter, draft_n_max=4)
    unpruned = spec.generate_many(prompts, max_tokens=30, temperature=0, ignore_eos=True)
    if layout == "known":
        # Acceptance is far from 0 here, so accepted_at is a real check.
        assert sum(r.draft_n_accepted for r in unpruned) > 0.2 * sum(r.draft_n for r in unpruned)
        for p, r in zip(prompts, unpruned):
            chain = [p[-1]]
            for _ in range(30):
                chain.append(int(f[chain[-1]]))
            assert r.tokens == chain[1:]
    for opts in PRUNING:
        loop = pyspec.LLM(target, n_ctx=256, n_threads=2, draft_model=drafter, draft_n_max=4,
                          **opts)
        alone = []
        for p in prompts:
            assert loop.generate(p, max_tokens=30, temperature=0, ignore_eos=True) == \
                want[len(alone)]
            alone.append(loop.last_stats.spec)
        # The options given to generate_many, and the LLM's own settings as the default.
        for res in (spec.generate_many(prompts, max_tokens=30, temperature=0, ignore_eos=True,
                                       draft_slots=2, **opts),
                    loop.generate_many(prompts, max_tokens=30, temperature=0, ignore_eos=True)):
            assert [r.text for r in res] == want, opts
            for r, st in zip(res, alone):
                assert (r.draft_n, r.draft_n_accepted) == (st.draft_n, st.draft_n_accepted), opts
                assert r.drafted_at == st.drafted_at and r.accepted_at == st.accepted_at, opts
                assert len(r.tokens) == 30 == r.draft_n_accepted + r.n_rounds
        pruned, full = sum(r.draft_n for r in res), sum(r.draft_n for r in unpruned)
        assert 0 < pruned < full, (opts, pruned, full)
    with pytest.raises(ValueError, match="draft_p_min"):
        spec.generate_many(prompts, draft_p_min=1.5)
    e = make_engine(target, drafter, n_seq_max=1, n_slots=1)
    for bad in (dict(draft_p_min=-0.1), dict(draft_p_min=1.5), dict(draft_n_min=-1),
                dict(draft_p_min_mode="product")):
        with pytest.raises(ValueError, match="p_min mode" if "mode" in str(bad) else "draft_"):
            e.add_request(1, [5, 6], max_tokens=4, verify="greedy", **bad)
    assert e.n_requests == 0
    with pytest.raises(ValueError, match="draft_p_min_mode"):
        spec.generate_many(prompts, draft_p_min=0.5, draft_p_min_mode="product")


def test_processed_law_matches_the_reference():
    """The C++ target law (verify.h processed_candidates / processed_law, what SpecEngine builds
    its p rows from and Sampler.candidates calls) against test_sampling's plain reference of
    llama.cpp's chain, on random rows with ties: same kept ids in the same order, probabilities
    softmax(kept / T), zeros elsewhere; T = 0 is the one-hot first argmax."""
    from test_sampling import reference_candidates, softmax

    rng = np.random.default_rng(11)
    n_filtered = 0
    for case in range(400):
        n = int(rng.choice([3, 8, 300, 3000, 20000]))   # 20000: 79 chunks, top-k's prefilter
        logits = (rng.normal(size=n) * [0.3, 1.0, 3.0, 8.0][case % 4]).astype(np.float32)
        if case % 3 == 0:
            logits[rng.integers(n, size=max(2, n // 3))] = logits.max()           # ties at the top
        if case % 3 == 1:
            logits[rng.integers(n, size=max(2, n // 2))] = np.float32(rng.normal()) # ties inside
        top_k = int(rng.choice([0, -1, 1, 2, 5, 40, n + 3]))
        top_p = float(rng.choice([1.0, 0.95, 0.5, 0.99, 0.0]))
        min_p = float(rng.choice([0.0, 0.05, 0.2, 1.0]))
        T = float(rng.choice([0.0, 0.6, 1.0, 1.7]))
        ids, probs = _core.spec.processed_candidates(logits.astype(np.float64), T, top_k, top_p, min_p)
        row = _core.spec.processed_law(logits, T, top_k, top_p, min_p)
        if T <= 0.0:
            ref = [int(np.argmax(logits))]
        elif top_k <= 0 and top_p >= 1.0 and min_p <= 0.0:
            ref = list(range(n))
        else:
            ref = reference_candidates(logits, top_k, top_p, min_p)
            n_filtered += len(ref) < n
        assert ids.tolist() == ref, (case, n, top_k, top_p, min_p, T)
        want = np.ones(1) if T <= 0.0 else softmax(logits.astype(np.float64)[ref] / T)
        np.testing.assert_allclose(probs, want, rtol=1e-10)
        full = np.zeros(n, np.float32)
        full[ref] = want.astype(np.float32)
        np.testing.assert_allclose(row, full, rtol=1e-6, atol=0)
        assert np.count_nonzero(row[np.setdiff1d(np.arange(n), ref)]) == 0
        # The Python sampler draws from the same law.
        s_ids, s_probs = Sampler(SamplingParams(T, top_k, top_p, min_p, seed=0)).candidates(logits)
        assert s_ids.tolist() == ref and np.array_equal(s_probs, probs)
    assert n_filtered > 100
    with pytest.raises(ValueError, match="top_p"):
        _core.spec.processed_law(np.zeros(4, np.float32), 1.0, 0, 1.5, 0.0)


def test_the_laws_softmax_is_double_precision_wherever_a_token_sits():
    """The law's exponentials are vectorised in double (cpu/vec_exp_f64.h: a row at temperature
    alone keeps the whole vocabulary, and std::exp over 49k entries was most of its host time).
    Against numpy's float64 softmax over gaps of up to 700 T: within 1e-13 relative; a logit that
    sits in the vector body and one in the scalar tail give the same bits when they are equal;
    a token more than 708 T below the best gets exactly 0 (its share is under 1e-307)."""
    rng = np.random.default_rng(5)
    for n in list(range(1, 40)) + [257, 49152]:
        for T in (0.6, 1.0, 1.7):
            z = -rng.uniform(0, 700 * T, size=n)
            z[rng.integers(n)] = 0.0
            ids, probs = _core.spec.processed_candidates(z, T, 0, 1.0, 0.0)
            assert ids.tolist() == list(range(n))
            want = np.exp(z / T - (z / T).max())
            want /= want.sum()
            np.testing.assert_allclose(probs, want, rtol=1e-13, atol=0)
            # Equal logits, one in each place: the first and the last entry of a row whose length
            # leaves a scalar tail, each value repeated at both ends.
            row = rng.normal(size=n) * 5
            row[-1] = row[0]
            _, p_row = _core.spec.processed_candidates(row, T, 0, 1.0, 0.0)
            assert p_row[-1] == p_row[0], (n, T)
    ids, probs = _core.spec.processed_candidates(np.array([0.0, -709.0, -707.0, -np.inf]), 1.0, 0, 1.0, 0.0)
    assert probs[1] == 0.0 and probs[3] == 0.0 and 0.0 < probs[2] < 1e-306 and probs[0] == 1.0


def test_top_p_and_min_p_without_top_k_find_their_tokens_in_a_whole_vocabulary():
    """top-p with top-k off looks at the whole row: its nucleus is found from a histogram of the
    logits below the best and only that prefix is sorted (target_law.cpp nucleus_superset; a flat
    row's nucleus of thousands took a heap sort of the vocabulary, ~6 ms). Against the plain
    reference on 49k-token rows: peaked (a nucleus of a few), flat (thousands), ties at the top
    and on a histogram bin's edge (logits 1/8 apart, the bins' width), a tail longer than the
    histogram's 64 (the sort-as-you-go fallback), and with min-p after it; min-p alone too (its
    survivors moved to the front by one pass, then sorted)."""
    from test_sampling import reference_candidates

    rng = np.random.default_rng(17)
    n = 49152
    rows = {
        "peaked": rng.normal(size=n) * 3 + np.where(rng.random(n) < 1e-3, 12.0, 0.0),
        "flat": rng.normal(size=n) * 1.5,
        "ties": np.round(rng.normal(size=n) * 8) / 8,
        "long_tail": -rng.uniform(0, 200, size=n),
    }
    rows["ties"][rng.integers(n, size=50)] = rows["ties"].max()
    for name, z in rows.items():
        z = z.astype(np.float32)
        for top_p, min_p in ((0.9, 0.0), (0.95, 0.0), (0.999999, 0.0), (0.95, 1e-4), (1.0, 0.05), (1.0, 1e-6)):
            ref = reference_candidates(z, 0, top_p, min_p)
            ids, probs = _core.spec.processed_candidates(z.astype(np.float64), 0.8, 0, top_p, min_p)
            assert ids.tolist() == ref, (name, top_p, min_p, len(ids), len(ref))
            row = _core.spec.processed_law(z, 0.8, 0, top_p, min_p)
            assert np.flatnonzero(row).tolist() == sorted(ref), (name, top_p, min_p)


FILTERS = [dict(top_k=5, top_p=0.9, min_p=0.05), dict(top_k=0, top_p=0.7, min_p=0.0),
           dict(top_k=0, top_p=1.0, min_p=0.2), dict(top_k=3, top_p=1.0, min_p=0.0), {}]


@pytest.mark.parametrize("layout", ["dflash", "dspark-bonus"])
@pytest.mark.parametrize("verify", ["rejection", "block"])
def test_generate_many_filters_match_the_python_loop(pairs, layout, verify):
    """top_k / top_p / min_p in the C++ step: both loops key every draw by (seed, offset = pos0,
    slot, stream), so per prompt generate_many (prompt i seeded seed + i) gives the same tokens,
    draft counts and per-position acceptance as LLM.generate's Python loop with seed + i and the
    same options ({}: the LLM's defaults, llama.cpp's). top_k = 1 at T > 0 is greedy output, and
    the filters change what is sampled (the test can tell filtered from unfiltered)."""
    spec = pyspec.LLM(pairs.target, n_ctx=256, n_threads=2, draft_model=pairs.drafters[layout],
                      draft_n_max=4, verify=verify)
    prompts = ["The quick brown fox", "Hello, world!", "a", "One two three four five six"]
    T, seed, n = 1.1, 40, 24
    unfiltered = spec.generate_many(prompts, max_tokens=n, temperature=T, seed=seed,
                                    ignore_eos=True, top_k=0, top_p=1.0, min_p=0.0)
    n_differ = 0
    for opts in FILTERS:
        res = spec.generate_many(prompts, max_tokens=n, temperature=T, seed=seed, ignore_eos=True,
                                 draft_slots=2, **opts)
        for i, (p, r) in enumerate(zip(prompts, res)):
            assert r.seed == seed + i
            ids = spec.prompt_ids(p)
            st = SpecStats()
            want = list(spec.speculative.tokens(ids, SamplingParams(temperature=T, **opts), n,
                                                stats=st, seed=seed + i))
            assert r.tokens == want, (opts, i)
            assert (r.draft_n, r.draft_n_accepted) == (st.draft_n, st.draft_n_accepted), (opts, i)
            assert r.drafted_at == st.drafted_at and r.accepted_at == st.accepted_at, (opts, i)
            text = spec.generate(p, max_tokens=n, temperature=T, seed=seed + i, ignore_eos=True,
                                 **opts)
            assert r.text == text, (opts, i)
            n_differ += r.tokens != unfiltered[i].tokens
    assert n_differ > 0
    plain = pyspec.LLM(pairs.target, n_ctx=256, n_threads=2)
    greedy = [plain.generate(p, max_tokens=n, temperature=0, ignore_eos=True) for p in prompts]
    assert [r.text for r in spec.generate_many(prompts, max_tokens=n, temperature=T, seed=seed,
                                               ignore_eos=True, top_k=1)] == greedy
    # T = 0 ignores the filters.
    assert [r.text for r in spec.generate_many(prompts, max_tokens=n, temperature=0,
                                               ignore_eos=True, top_k=2, top_p=0.5)] == greedy
    with pytest.raises(ValueError, match="top_p"):
        spec.generate_many(prompts, temperature=T, top_p=1.5)



@pytest.mark.parametrize("layout", ["dflash", "dspark-anchor", "dspark-bonus"])
def test_drafts_come_from_the_drafters_whole_block(pairs, layout):
    """The engine drafts the drafter's whole trained block [id_last, MASK x (block_size - 1)] and
    keeps the round's first n_max drafts. The block's rows attend to each other, so a block cut to
    n_max is one the drafter never saw in training (SmolLM2's drafter accepted ~9% fewer drafts
    with it). Reference: a DraftContext fed the prompt's target features by hand."""
    model, dm = models(pairs.target, pairs.drafters[layout])
    n_max = 2
    off = int(dm.draft_offset)
    assert dm.block_size > n_max + off
    ctx = _core.Context(model, 256, 1, 256, False, 2, "f16")
    dc = _core.DraftContext(dm, n_seq_max=1, n_batch=128, n_threads=2)
    differs = 0
    for i, prompt in enumerate(p for p in PROMPTS if len(p) > 3):
        engine = make_engine(pairs.target, pairs.drafters[layout], draft_n_max=n_max)
        engine.add_request(0, prompt, max_tokens=8)
        run = run_requests(engine)[0]
        first, emitted = run.blocks[0] if run.blocks else None, run.tokens
        # The prompt's pass gives the first token; the first round drafts from the rows of the
        # whole prompt, anchored at that token.
        n = len(prompt)
        ctx.kv_clear(0)
        _, _, inputs = ctx.decode(np.asarray(prompt, np.int32), np.arange(n, dtype=np.int32),
                                  np.zeros(n, np.int32), np.zeros(n, np.uint8), list(dm.target_layers))
        feats = np.concatenate([np.asarray(dict(inputs)[l]) for l in dm.target_layers], axis=1)
        dc.clear(0)
        dc.inject(0, np.arange(n, dtype=np.int32), np.ascontiguousarray(feats, np.float32))
        whole = dc.draft_logits(0, emitted[0], n, dm.block_size)["tokens"][off:off + n_max]
        cut = dc.draft_logits(0, emitted[0], n, n_max + off)["tokens"][off:off + n_max]
        assert first == [int(t) for t in whole], (i, first, whole)
        differs += list(whole) != list(cut)
    assert differs > 0, "the cut block drafts as the whole one here: the test cannot tell them apart"


def test_phase_times_split_the_steps_wall_time(pairs):
    """SpecEngine.phase_times: every step counted once, each phase a part of the wall time the
    steps took (they cannot add up to more), and the passes that ran claimed time."""
    import gc
    import time
    target, drafter, reqs = random_requests(pairs)
    engine = make_engine(target, drafter, n_seq_max=2, n_slots=2, draft_n_max=3)
    zero = engine.phase_times()
    assert zero == dict(target_s=0.0, stage_s=0.0, draft_s=0.0, other_s=0.0, steps=0)
    for rid in list(reqs)[:2]:
        engine.add_request(rid, reqs[rid][0], max_tokens=reqs[rid][1])
    wall, n_steps = 0.0, 0
    # A garbage collection inside the timed calls would count as wall time no phase can claim (the
    # steps of these tiny models take well under a millisecond). The 0.5 bound below failed once on
    # a busy 2-core run (its numbers not kept); collections are the one Python-side pause we can
    # keep out.
    gc.disable()
    try:
        while engine.n_requests:
            t0 = time.perf_counter()
            engine.step()
            wall += time.perf_counter() - t0
            n_steps += 1
    finally:
        gc.enable()
    ph = engine.phase_times()
    assert ph["steps"] == n_steps == engine.steps
    parts = [ph[k] for k in ("target_s", "stage_s", "draft_s", "other_s")]
    assert all(p >= 0.0 for p in parts)
    assert ph["target_s"] > 0.0 and ph["stage_s"] > 0.0 and ph["draft_s"] > 0.0
    assert sum(parts) <= wall
    assert sum(parts) >= 0.5 * wall, (sum(parts), wall)  # the rest: the binding, Python
