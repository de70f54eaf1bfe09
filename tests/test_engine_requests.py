"""Per-request options of the serving step (csrc/spec/spec_engine.h, csrc/spec/logit_processing.h),
each against an independent reference:

- Without a drafter the engine decodes plainly: 4 concurrent greedy requests give what a
  one-sequence Context loop gives.
- logit_bias and llama.cpp's repetition penalties (over prompt + output, window repeat_last_n)
  shape the law: greedy output equals a numpy loop applying them to the raw logits, with and
  without a drafter (verification checks each draft against the processed row it would have been
  sampled from, the drafts before it counted in the history).
- n_probs: each emitted token's log-probability and top-n alternatives equal numpy's
  log_softmax of the raw logits at its position.
- A drafter failure stops drafting for that request only: one flag, its slot given back, and its
  output unchanged (plain greedy); the others keep drafting with the drafts of an untroubled run.
- A request can be placed in a chosen target sequence (a server slot); a busy one is refused.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyspec
from pyspec import _core

from test_speculative import Pairs  # noqa: E402  (tests/ is on sys.path under pytest)
from conftest import drain  # noqa: E402

PROMPTS = [[3, 17, 29, 3, 3], [100, 101, 102], [7], list(range(40, 70))]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return Pairs(tmp_path_factory.mktemp("engine-req"))


@pytest.fixture(scope="module")
def loaded(pairs):
    model = _core.Model(pairs.target)
    return model, _core.DraftModel(pairs.drafters["dflash"], model)


def engine(loaded, drafter=True, n_seq=4, n_slots=4):
    model, dm = loaded
    return _core.SpecEngine(model, dm if drafter else None, n_ctx=256 * n_seq, n_seq_max=n_seq,
                            n_draft_slots=n_slots, n_batch=64, draft_n_batch=128, n_threads=2,
                            draft_n_max=4, prefill_chunk=16)


def run(e, reqs, hook=None):
    out = {rid: {"tokens": [], "probs": []} for rid in reqs}
    for rid, (prompt, n, kw) in reqs.items():
        e.add_request(rid, prompt, max_tokens=n, **kw)
    for o in drain(e, (lambda outs: hook(e, outs)) if hook else None):
        r = out[o["request_id"]]
        r["tokens"] += o["tokens"]
        r["probs"] += o.get("probs", [])
        r["stats"] = o["stats"]
    return out


def penalize(logits, history, bias, last_n, repeat, freq, presence):
    """llama.cpp's logit_bias then penalties sampler, written from its description."""
    x = logits.astype(np.float32).copy()
    for t, b in bias:
        x[t] += np.float32(b)
    if last_n != 0 and (repeat != 1.0 or freq != 0.0 or presence != 0.0):
        window = history if last_n < 0 else history[-last_n:]
        ids, counts = np.unique(np.asarray(window, np.int64), return_counts=True)
        for t, c in zip(ids, counts):
            x[t] = x[t] * np.float32(repeat) if x[t] <= 0 else x[t] / np.float32(repeat)
            x[t] -= np.float32(c * freq + presence)
    return x


def reference(model_path, prompt, n, bias=(), last_n=64, repeat=1.0, freq=0.0, presence=0.0):
    """Greedy decoding one token at a time; returns tokens and the raw logits of each step."""
    ctx = pyspec.Context(pyspec.Model(model_path, n_threads=2), n_ctx=256)
    logits = ctx.decode(prompt).logits[-1]
    history, toks, raw = list(prompt), [], []
    for _ in range(n):
        raw.append(logits.copy())
        t = int(np.argmax(penalize(logits, history, bias, last_n, repeat, freq, presence)))
        toks.append(t)
        history.append(t)
        logits = ctx.decode([t]).logits[-1]
    return toks, raw


def test_plain_engine_equals_one_sequence_loop(pairs, loaded):
    e = engine(loaded, drafter=False)
    assert not e.has_drafter
    got = run(e, {i: (p, 12, {}) for i, p in enumerate(PROMPTS)})
    for i, p in enumerate(PROMPTS):
        assert got[i]["tokens"] == reference(pairs.target, p, 12)[0], i
        assert got[i]["stats"]["draft_n"] == 0
    assert e.n_requests == 0
    with pytest.raises(RuntimeError, match="no drafter"):
        e.registry_size


PENALTIES = [
    dict(bias=[(5, 4.0), (9, -np.inf)], last_n=64, repeat=1.0, freq=0.0, presence=0.0),
    dict(bias=[], last_n=64, repeat=1.3, freq=0.0, presence=0.0),
    dict(bias=[(11, 1.5)], last_n=8, repeat=1.1, freq=0.4, presence=0.6),
    dict(bias=[], last_n=-1, repeat=1.0, freq=0.8, presence=0.0),
]


@pytest.mark.parametrize("drafter", [False, True])
@pytest.mark.parametrize("opts", range(len(PENALTIES)))
def test_bias_and_penalties_equal_numpy_loop(pairs, loaded, drafter, opts):
    o = PENALTIES[opts]
    kw = dict(logit_bias=o["bias"], repeat_last_n=o["last_n"], repeat_penalty=o["repeat"],
              frequency_penalty=o["freq"], presence_penalty=o["presence"])
    e = engine(loaded, drafter=drafter)
    got = run(e, {i: (p, 20, dict(kw, verify="greedy")) for i, p in enumerate(PROMPTS)})
    plain = [reference(pairs.target, p, 20)[0] for p in PROMPTS]
    want = [reference(pairs.target, p, 20, o["bias"], o["last_n"], o["repeat"], o["freq"],
                      o["presence"])[0] for p in PROMPTS]
    for i in range(len(PROMPTS)):
        assert got[i]["tokens"] == want[i], i
        assert 9 not in got[i]["tokens"] or opts != 0
    # The options change the output: the comparison is not with plain greedy decoding.
    assert want != plain
    if drafter:
        assert sum(got[i]["stats"]["draft_n"] for i in got) > 0



@pytest.mark.parametrize("drafter", [False, True])
@pytest.mark.parametrize("n_extra", [1, 20])
def test_banned_ids_take_the_graphs_best_ids(pairs, loaded, drafter, n_extra):
    """-inf biases alone (what llama.cpp's ignore_eos does to the end ids) keep the greedy path's
    ids from the graph: its best bans + 1 ids per row (TOP_K), the first one allowed taken; the
    same tokens as the numpy loop with the bans, beside a request without any. Past 15 bans the
    request reads its logits instead (no TOP_K), with the same result."""
    plain = [reference(pairs.target, p, 20)[0] for p in PROMPTS]
    # Each prompt's first two plain tokens banned: every request must go elsewhere at once.
    bans = sorted({t for toks in plain for t in toks[:2]})
    bans += [t for t in range(200, 260) if t not in bans][:n_extra]
    bias = [(t, float("-inf")) for t in bans]
    e = engine(loaded, drafter=drafter, n_seq=5, n_slots=5)
    e.set_profiling(True)
    reqs = {i: (p, 20, dict(logit_bias=bias, verify="greedy")) for i, p in enumerate(PROMPTS)}
    reqs[99] = (PROMPTS[0], 20, dict(verify="greedy"))
    got = run(e, reqs)
    want = [reference(pairs.target, p, 20, bias)[0] for p in PROMPTS]
    for i in range(len(PROMPTS)):
        assert got[i]["tokens"] == want[i], i
        assert not set(bans) & set(got[i]["tokens"])
    assert got[99]["tokens"] == plain[0]
    assert want != plain
    top_k = {name: calls for name, _, calls in e.op_profile()["target"]}.get("TOP_K", 0)
    assert (top_k > 0) == (len(bans) < 16), (len(bans), top_k)

SAMPLED = [dict(top_k=40), dict(top_k=5, top_p=0.9, min_p=0.05), dict(top_k=40, min_p=0.1),
           dict(top_k=1), dict(top_k=20, top_p=0.6)]


@pytest.fixture(scope="module")
def spread(pairs):
    """The pair cut to 128 tokens with a flatter head: sampled drafts get accepted."""
    target, drafters = pairs.small_vocab(n_vocab=128, head_scale=0.3)
    model = _core.Model(target)
    return model, _core.DraftModel(drafters["dflash"], model)


@pytest.mark.parametrize("drafter", [False, True])
@pytest.mark.parametrize("verify", ["rejection", "block"])
def test_sampled_requests_draw_from_the_graphs_candidates(spread, drafter, verify):
    """A sampled request with top-k and no processing but bans draws from its best top_k + bans
    ids and their logits (TOP_K + GATHER in the graph, candidate_law on the host): the same
    tokens and draft statistics as the same requests reading whole logit rows (n_probs forces
    that path and adds only log-probabilities), beside a greedy request with bans. A request
    without top-k puts its steps on the logits path."""
    loaded = spread
    bias = [(t, float("-inf")) for t in (5, 17, 101)]

    def requests(n_probs):
        reqs = {i: (p, 24, dict(SAMPLED[i % len(SAMPLED)], temperature=0.9, seed=7 + i, verify=verify,
                                n_probs=n_probs, logit_bias=bias if i % 2 else []))
                for i, p in enumerate(PROMPTS)}
        reqs[9] = (PROMPTS[1], 24, dict(verify="greedy", logit_bias=bias))
        return reqs

    fast = engine(loaded, drafter=drafter, n_seq=5, n_slots=5)
    got = run(fast, requests(0))
    assert fast.n_candidate_steps > 0
    slow = engine(loaded, drafter=drafter, n_seq=5, n_slots=5)
    want = run(slow, requests(1))
    assert slow.n_candidate_steps == 0 and slow.n_logit_rows > 0
    for rid in want:
        assert got[rid]["tokens"] == want[rid]["tokens"], rid
        assert got[rid]["stats"] == want[rid]["stats"], rid
        assert not {5, 17, 101} & set(got[rid]["tokens"]) or rid % 2 == 0
    if drafter:
        assert sum(got[r]["stats"]["draft_n_accepted"] for r in got) > 0
    # A request without top-k reads its own rows whole; its neighbour keeps the candidates.
    no_top_k = engine(loaded, drafter=False)  # both prompts in one step, one token a step each
    run(no_top_k, {0: (PROMPTS[0], 8, dict(temperature=0.9, top_k=0, verify=verify)),
                   1: (PROMPTS[1], 8, dict(temperature=0.9, top_k=40, verify=verify))})
    assert no_top_k.n_candidate_steps == 8 and no_top_k.n_logit_rows == 8


MIXED = {
    0: dict(verify="greedy"),
    1: dict(verify="greedy", logit_bias=[(5, float("-inf"))]),
    2: dict(temperature=0.9, top_k=40, seed=3, verify="rejection"),
    3: dict(verify="greedy", repeat_penalty=1.3),                              # reads its rows
    4: dict(temperature=0.9, top_k=20, seed=4, verify="block", n_probs=2),     # reads its rows
    5: dict(temperature=0.9, top_k=0, seed=5, verify="rejection"),             # reads its rows
}


@pytest.mark.parametrize("drafter", [False, True])
def test_mixed_steps_read_only_the_rows_that_need_their_logits(spread, drafter):
    """Requests that read their logits (penalties, n_probs, no top-k) beside ones that take the
    graph's ids or candidates: only their own rows cross whole (Batch::logits_rows), and every
    request gets the tokens, probabilities and stats it gets alone (design invariant 7)."""
    prompts = {0: PROMPTS[0], 1: PROMPTS[1], 2: PROMPTS[2], 3: PROMPTS[3], 4: PROMPTS[0], 5: PROMPTS[1]}
    together = engine(spread, drafter=drafter, n_seq=6, n_slots=6)
    got = run(together, {rid: (prompts[rid], 16, MIXED[rid]) for rid in MIXED})
    rows_read = 0
    for rid in MIXED:
        alone = engine(spread, drafter=drafter, n_seq=1, n_slots=1)
        want = run(alone, {rid: (prompts[rid], 16, MIXED[rid])})[rid]
        assert got[rid]["tokens"] == want["tokens"], rid
        assert got[rid]["probs"] == want["probs"], rid
        assert got[rid]["stats"] == want["stats"], rid
        assert (alone.n_logit_rows > 0) == (rid >= 3), rid
        rows_read += alone.n_logit_rows
    assert together.n_logit_rows == rows_read  # nobody else's rows
    assert together.n_candidate_steps > 0


def test_n_probs_equal_log_softmax_of_raw_logits(pairs, loaded):
    e = engine(loaded, drafter=True)
    got = run(e, {0: (PROMPTS[0], 10, dict(n_probs=5)), 1: (PROMPTS[3], 10, {})})
    toks, raw = reference(pairs.target, PROMPTS[0], 10)
    assert got[0]["tokens"] == toks and got[1]["probs"] == []
    assert len(got[0]["probs"]) == 10
    for (tid, lp, top), t, row in zip(got[0]["probs"], toks, raw):
        ls = row.astype(np.float64) - np.logaddexp.reduce(row.astype(np.float64))
        assert tid == t and lp == pytest.approx(ls[t], abs=1e-4)
        order = sorted(range(len(row)), key=lambda k: (-row[k], k))[:5]
        assert [k for k, _ in top] == order
        assert [v for _, v in top] == pytest.approx([ls[k] for k in order], abs=1e-4)


def test_drafter_failure_stops_drafting_for_that_request_only(pairs, loaded, capfd):
    reqs = {i: (p, 24, {}) for i, p in enumerate(PROMPTS)}
    calm = run(engine(loaded), reqs)
    e = engine(loaded)
    drafted = {i: [] for i in reqs}

    def hook(e, outs):
        if e.steps == 3:
            e.inject_draft_failure(1)
        for o in outs:
            drafted[o["request_id"]].append(o["stats"]["draft_n"])

    got = run(e, reqs, hook=hook)
    plain = [reference(pairs.target, p, 24)[0] for p in PROMPTS]
    for i in reqs:
        assert got[i]["tokens"] == plain[i], i
    st = got[1]["stats"]
    assert st["draft_stopped"] and "injected drafter failure" in st["draft_stop_reason"]
    # Request 1 drafts no more after the failure (the block drafted before it is still verified
    # in step 4); the others draft as if nothing happened.
    assert len(set(drafted[1][3:])) == 1 and len(drafted[1]) > 6
    for i in (0, 2, 3):
        assert not got[i]["stats"]["draft_stopped"]
        assert got[i]["stats"] == calm[i]["stats"], i
    err = capfd.readouterr().err
    assert err.count("drafting stopped") == 1
    assert e.registry_size == 0


def test_chosen_target_sequence(loaded):
    e = engine(loaded, drafter=False)
    e.add_request(1, [1, 2, 3], max_tokens=4, seq=2)
    assert e.target_seq(1) == 2
    with pytest.raises(ValueError, match="busy"):
        e.add_request(2, [1, 2], max_tokens=4, seq=2)
    with pytest.raises(ValueError, match="out of range"):
        e.add_request(3, [1, 2], max_tokens=4, seq=9)
    e.add_request(4, [1, 2], max_tokens=4)
    assert e.target_seq(4) == 0


def test_op_profiles_split_target_and_drafter(loaded):
    """set_profiling covers both passes while on: the target's verify rows and the drafter's
    passes land in separate profiles, and nothing is counted while off."""
    e = engine(loaded)
    run(e, {1: ([5, 6, 7], 6, {"temperature": 0.0})})
    assert e.op_profile() == {"target": [], "drafter": []}
    e.set_profiling(True)
    out = run(e, {2: ([5, 6, 7], 12, {"temperature": 0.0})})
    e.set_profiling(False)
    before = e.op_profile()
    run(e, {3: ([5, 6, 7], 6, {"temperature": 0.0})})
    assert e.op_profile() == before
    target = {name: calls for name, _, calls in before["target"]}
    drafter = {name: calls for name, _, calls in before["drafter"]}
    model, dm = loaded
    # every target pass runs each target layer's attention once, every drafter pass each of the
    # drafter's: whole passes; a target pass per round at least, a drafter pass per drafting one
    rounds = out[2]["stats"]["n_rounds"]
    assert rounds > 0 and target["ATTENTION"] % model.n_layer == 0
    assert target["ATTENTION"] // model.n_layer >= rounds
    assert drafter["ATTENTION"] % dm.n_layer == 0
    assert 0 < drafter["ATTENTION"] // dm.n_layer <= target["ATTENTION"] // model.n_layer


def test_bad_processing_options_are_refused(loaded):
    e = engine(loaded, drafter=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        e.add_request(1, [1], logit_bias=[(10**6, 1.0)])
    with pytest.raises(ValueError, match="repeat_penalty"):
        e.add_request(1, [1], repeat_penalty=0.0)
    with pytest.raises(ValueError, match="n_probs"):
        e.add_request(1, [1], n_probs=-1)
    assert e.n_requests == 0
