"""Decoding ahead (SpecEngineParams::decode_ahead, csrc/spec/spec_engine.cpp): plain greedy rows
queue their next step before the host reads this step's tokens, the next tokens copied from this
step's ARGMAX on the device (Context::launch with a feed). It must change nothing a caller sees:

- The same tokens, stop reasons and stats as the engine without it, and as an independent
  reference (a one-sequence Context loop taking numpy's argmax of the logits), for concurrent
  requests that end by length and by stop ids in the middle of the stream; and it does run
  (n_decoded_ahead > 0), so these tests fail if it silently stops applying.
- Whatever the caller does between steps while a step is in flight: cancelling a request, pausing
  and resuming one, adding one: the outputs equal those of the engine without it under the same
  calls, and no cell is left behind (every target sequence empty after the requests end).
- The kept prompt cache (keep_cache) holds exactly the committed rows, as without it.
- Across the attention span's 256-cell steps (another graph: the fed launch is refused and that
  step goes plainly).
- pyspec-server without a drafter (the GPU's default) gives the same replies with it forced on
  and off: concurrent requests, a stop string, a client leaving mid-stream, a kept cache reused.
- Sampled rows on the graph's top-k candidates decode ahead too, fed the token the graph draws
  (SAMPLE): the same tokens and stats as without, greedy and sampled requests mixed, both
  verification rules, with the caller pausing, cancelling and adding requests between steps; and
  where the host's draw overrules the graph's (forced here by PYSPEC_SAMPLED_AHEAD=2, whose graph
  predicts the greedy token) the row ahead is dropped and decoded again, still the same tokens.
- Requests that draft, sample without top-k or post-process logits never decode ahead, and on the
  CPU (where a step computed ahead only delays its predecessor's tokens) nothing does unless
  asked; the tests ask (decode_ahead=True).
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
    return Pairs(tmp_path_factory.mktemp("ahead"))


@pytest.fixture(scope="module")
def loaded(pairs):
    model = _core.Model(pairs.target)
    return model, _core.DraftModel(pairs.drafters["dflash"], model)


def engine(loaded, ahead, drafter=False, n_seq=4, n_ctx_seq=256):
    model, dm = loaded
    return _core.SpecEngine(model, dm if drafter else None, n_ctx=n_ctx_seq * n_seq, n_seq_max=n_seq,
                            n_draft_slots=n_seq, n_batch=64, draft_n_batch=128, n_threads=2,
                            draft_n_max=3, prefill_chunk=16, decode_ahead=ahead)


def run(e, reqs, hook=None):
    """reqs: id -> (prompt, add_request kwargs). hook(e, step_index) runs between steps."""
    out = {rid: {"tokens": [], "reason": None, "stats": None} for rid in reqs}
    for rid, (prompt, kw) in reqs.items():
        e.add_request(rid, prompt, **kw)
    steps = 0

    def between(outs):
        nonlocal steps
        steps += 1
        if hook:
            hook(e, steps, out)

    for o in drain(e, between):
        r = out.setdefault(o["request_id"], {"tokens": [], "reason": None, "stats": None})
        r["tokens"] += o["tokens"]
        if o["finished"]:
            r["reason"] = o["stop_reason"]
        r["stats"] = o["stats"]
    return out


def reference(model_path, prompt, n, stop_ids=()):
    """Greedy decoding of one sequence by a Context loop and numpy's argmax (the first maximum)."""
    ctx = pyspec.Context(pyspec.Model(model_path, n_threads=2), n_ctx=512, n_seq_max=1)
    logits = ctx.decode(prompt).logits[-1]
    out = []
    for _ in range(n):
        tok = int(np.argmax(logits))
        if tok in stop_ids:
            return out, "stop"
        out.append(tok)
        logits = ctx.decode([tok]).logits[-1]
    return out, "length"


def assert_same(got, want):
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid]["tokens"] == want[rid]["tokens"], rid
        assert got[rid]["reason"] == want[rid]["reason"], rid
        for k in ("n_rounds", "draft_n", "draft_n_accepted"):
            assert got[rid]["stats"][k] == want[rid]["stats"][k], (rid, k)


def assert_cells_free(e, n_seq=4):
    for s in range(n_seq):
        assert e.target_pos_max(s) == -1, s


def test_same_tokens_as_without_and_as_a_reference_loop(pairs, loaded):
    lengths = [12, 20, 7, 16]
    refs = [reference(pairs.target, p, n) for p, n in zip(PROMPTS, lengths)]
    # A stop id from the middle of request 1's output, so it ends early with the others running.
    stop = refs[1][0][9]
    refs[1] = reference(pairs.target, PROMPTS[1], lengths[1], stop_ids=(stop,))
    reqs = {i: (p, dict(max_tokens=n, verify="greedy", stop_ids=[stop] if i == 1 else []))
            for i, (p, n) in enumerate(zip(PROMPTS, lengths))}
    e = engine(loaded, True)
    got = run(e, reqs)
    want = run(engine(loaded, False), reqs)
    assert_same(got, want)
    for i, (toks, reason) in enumerate(refs):
        assert got[i]["tokens"] == toks and got[i]["reason"] == reason, i
    assert got[1]["reason"] == "stop" and len(got[1]["tokens"]) < lengths[1]
    assert e.n_decoded_ahead > 0 and not e.has_step_ahead
    assert_cells_free(e)


def _caller(e, i, out):
    """A server's handling between steps while a step may be in flight."""
    if i == 3:
        e.cancel(2)                  # a client goes away
        e.pause(0)
    if i == 5:
        e.resume(0)
        e.add_request(9, [11, 12, 13], max_tokens=9, verify="greedy")  # a new request joins
    if i == 6:
        e.pause(3)
    if i == 8:
        e.resume(3)


def test_cancel_pause_and_new_requests_between_steps(loaded):
    reqs = {i: (p, dict(max_tokens=18, verify="greedy")) for i, p in enumerate(PROMPTS)}
    e = engine(loaded, True)
    got = run(e, reqs, hook=_caller)
    want = run(engine(loaded, False), reqs, hook=_caller)
    assert got[2]["reason"] is None      # cancelled
    assert_same(got, want)
    assert e.n_decoded_ahead > 0
    assert_cells_free(e)


def test_kept_prompt_cache_holds_the_committed_rows(loaded):
    reqs = {i: (p, dict(max_tokens=10 + 3 * i, verify="greedy", keep_cache=True)) for i, p in enumerate(PROMPTS)}
    caches = []
    for ahead in (True, False):
        e = engine(loaded, ahead)
        run(e, reqs)
        caches.append([(e.cached_tokens(s), e.target_pos_max(s)) for s in range(4)])
        for toks, pos_max in caches[-1]:
            assert pos_max == len(toks) - 1
    assert caches[0] == caches[1]


def test_across_the_attention_spans_steps(pairs, loaded):
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 200, size=240)]
    e = engine(loaded, True, n_seq=1, n_ctx_seq=1024)
    got = run(e, {0: (prompt, dict(max_tokens=40, verify="greedy"))})
    assert got[0]["tokens"] == reference(pairs.target, prompt, 40)[0]
    # Positions 240..279 cross 256: one step there cannot be fed (another graph), the rest are.
    assert 30 <= e.n_decoded_ahead < 39


@pytest.mark.parametrize("kind", ["drafter", "sampled", "penalty", "probs"])
def test_only_plain_greedy_rows_decode_ahead(loaded, kind):
    kw = dict(max_tokens=10, verify="greedy")
    if kind == "sampled":
        kw = dict(max_tokens=10, temperature=0.7, seed=3, verify="rejection")
    elif kind == "penalty":
        kw["repeat_penalty"] = 1.2
    elif kind == "probs":
        kw["n_probs"] = 2
    e = engine(loaded, True, drafter=kind == "drafter")
    got = run(e, {0: (PROMPTS[0], kw)})
    assert len(got[0]["tokens"]) == 10
    assert e.n_decoded_ahead == 0


def greedy_favourites(loaded):
    """The first three distinct tokens PROMPTS[1] decodes greedily: ids worth banning."""
    toks = run(engine(loaded, False), {0: (PROMPTS[1], dict(max_tokens=14, verify="greedy"))})[0]["tokens"]
    return list(dict.fromkeys(toks))[:3]


def sampled_requests(favourites=None):
    """Greedy and sampled requests (llama-server's chain and others, both rules) together; with
    favourites, two of them ban those ids (-inf biases, as ignore_eos bans the end ids)."""
    chains = [dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=11, verify="rejection"),
              dict(verify="greedy"),
              dict(temperature=1.2, top_k=8, seed=12, verify="block"),
              dict(temperature=0.6, top_k=64, top_p=0.9, seed=13, verify="rejection")]
    if favourites:
        chains[1]["logit_bias"] = [(t, float("-inf")) for t in favourites]
        chains[2]["logit_bias"] = [(t, float("-inf")) for t in favourites[:2]]
    return {i: (p, dict(max_tokens=14 + 2 * i, **chains[i])) for i, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("with_bans", [False, True])
@pytest.mark.parametrize("hook", [None, _caller])
def test_sampled_rows_decode_ahead_on_the_graphs_draws(loaded, hook, with_bans):
    """Also requests that ban a few ids (ignore_eos): SAMPLE leaves them out as the host does."""
    reqs = sampled_requests(greedy_favourites(loaded) if with_bans else None)
    e = engine(loaded, True)
    got = run(e, reqs, hook=hook)
    assert_same(got, run(engine(loaded, False), reqs, hook=hook))
    assert e.n_decoded_ahead > 0
    assert e.n_ahead_overruled == 0  # the CPU's SAMPLE is the host's own draw
    assert_cells_free(e)
    for rid in (0, 1):  # a sampled request alone decodes ahead, and a greedy one with bans
        alone = engine(loaded, True)
        run(alone, {rid: reqs[rid]})
        assert alone.n_decoded_ahead > 0, rid
    if with_bans:  # the bans matter: the greedy request decodes other tokens than without them
        assert got[1]["tokens"] != run(engine(loaded, False), {1: sampled_requests()[1]})[1]["tokens"]


def test_overruled_draws_are_decoded_again(loaded, monkeypatch):
    reqs = sampled_requests(greedy_favourites(loaded))
    want = run(engine(loaded, False), reqs)
    monkeypatch.setenv("PYSPEC_SAMPLED_AHEAD", "2")  # the graph predicts the greedy token
    e = engine(loaded, True)
    got = run(e, reqs, hook=_caller)
    assert_same(got, run(engine(loaded, False), reqs, hook=_caller))
    assert e.n_decoded_ahead > 0 and e.n_ahead_overruled > 0
    assert_cells_free(e)
    monkeypatch.setenv("PYSPEC_SAMPLED_AHEAD", "0")  # off: sampled rows keep every step plain
    e = engine(loaded, True)
    assert_same(run(e, reqs), want)
    assert e.n_ahead_overruled == 0


def test_off_by_default_where_compute_is_synchronous(loaded):
    """On the CPU a step computed ahead only delays its predecessor's tokens: off unless asked."""
    model, _ = loaded
    e = _core.SpecEngine(model, None, n_ctx=256, n_seq_max=1, n_threads=2)
    run(e, {0: (PROMPTS[0], dict(max_tokens=8, verify="greedy"))})
    assert e.n_decoded_ahead == 0


def _server_session(target, ahead, sampled_ahead="1"):
    """Requests against a drafterless pyspec-server (the GPU's default), decoding ahead forced
    on or off: concurrent greedy requests, one cut by a stop string, a stream its client drops,
    a request on a slot's kept cache, then seeded sampled requests alone and beside a greedy one.
    Returns the replies, and /metrics' decoding-ahead counters (steps, overruled rows) apart."""
    from concurrent.futures import ThreadPoolExecutor

    from server_process import ServerProcess
    srv = ServerProcess(["-m", target, "-np", "3", "-c", str(3 * 512), "-t", "2", "--temp", "0", "--metrics"],
                        env={"PYSPEC_DECODE_AHEAD": "1" if ahead else "0",
                             "PYSPEC_SAMPLED_AHEAD": sampled_ahead})
    try:
        def complete(prompt, **kw):
            r = srv.post("/completion", dict({"prompt": prompt, "n_predict": 24, "temperature": 0}, **kw))
            assert r.status_code == 200, r.text
            j = r.json()
            return j["content"], j["tokens_predicted"], j["stop_type"]
        prompts = [[7, 9, 11], [12, 10, 11], [17, 11, 11]]
        alone = [complete(p) for p in prompts]
        stop = alone[1][0][len(alone[1][0]) // 2:][:3]
        with ThreadPoolExecutor(3) as pool:
            futs = [pool.submit(complete, prompts[0]), pool.submit(complete, prompts[1], stop=[stop]),
                    pool.submit(complete, prompts[2], n_predict=40, ignore_eos=True)]
            together = [f.result() for f in futs]
        with srv.post("/completion", {"prompt": prompts[0], "n_predict": 400, "stream": True,
                                      "temperature": 0}, stream=True) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 4:
                    break   # the client goes away mid-stream
        after = complete(prompts[0] + [3, 4], cache_prompt=True)
        # Sampled with llama-server's default chain (top-k 40, top-p, min-p, T 0.8), seeded: alone,
        # then together beside a greedy request.
        sampled = [complete(p, temperature=0.8, seed=100 + i) for i, p in enumerate(prompts)]
        with ThreadPoolExecutor(3) as pool:
            futs = [pool.submit(complete, prompts[0], temperature=0.8, seed=100),
                    pool.submit(complete, prompts[1]), pool.submit(complete, prompts[2], temperature=0.8, seed=102)]
            sampled_together = [f.result() for f in futs]
        metrics = srv.get("/metrics").text
        counters = [float(line.split()[1]) for line in metrics.splitlines()
                    for name in ("pyspec:decoded_ahead_steps_total ",
                                 "pyspec:decoded_ahead_overruled_rows_total ")
                    if line.startswith(name)]
        return (alone, together, after, sampled, sampled_together), counters
    finally:
        srv.stop()


def test_the_server_gives_the_same_replies(pairs):
    """Decoding ahead on (the graph's sampled draws as predictions, or with PYSPEC_SAMPLED_AHEAD=2
    greedy predictions the host overrules) gives the replies of decoding ahead off, and /metrics
    counts the steps decoded ahead and the rows overruled."""
    got, (steps, overruled) = _server_session(pairs.target, True)
    forced, (steps_forced, overruled_forced) = _server_session(pairs.target, True, sampled_ahead="2")
    want, (steps_off, overruled_off) = _server_session(pairs.target, False)
    assert got == want and forced == want
    assert steps > 0 and steps_forced > 0 and steps_off == 0 and overruled_off == 0
    assert overruled_forced > overruled
    alone, together, _, sampled, sampled_together = got
    assert together[0] == alone[0] and together[1][2] == "word"
    assert sampled_together[0] == sampled[0] and sampled_together[2] == sampled[2]
    assert sampled_together[1] == alone[1] and sampled[0] != alone[0]
