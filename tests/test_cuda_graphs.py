"""CUDA graphs (issue 8, item 2): the CUDA backend captures a graph's launch sequence the second
time it sees the same (graph structure, op parameters, device addresses) and replays it after that;
replays must give exactly what eager execution gives.

Runs anywhere (CPU-only builds included): the switch and the counters exist and behave
(`_core.set_cuda_graphs`, `cuda_graphs_enabled`, `cuda_graph_stats`, `reset_cuda_graph_stats`).

On the GPU (skipped with the reason when _core.cuda_available() is false):
- decode steps of tiny llama / qwen3 models (F32, F16, Q4_1 weights) with identical shapes and
  different tokens, positions and sequences (prompt chunks, single-token decode, verify-shaped
  batches of two sequences, a rollback, layer-input outputs, a span bucket crossed): the logits
  (and layer inputs) of a context running with graphs equal those of one running eagerly bit for
  bit, and the counters show captures and replays and no capture failure;
- SpecEngine (target verify steps and drafter steps, greedy and sampled): the same tokens and
  verified blocks with graphs on as off, with replays;
- PYSPEC_CUDA_GRAPHS=0 in a subprocess runs everything eagerly (no capture, no replay) and gives
  the same bits as graphs in this process; PYSPEC_CUDA_GRAPH_CACHE=1 evicts and still matches.

PYSPEC_TEST_DEVICE_BACKEND=cpu runs the GPU tests with the CPU in the device's place (counters are
then not checked), which checks the tests themselves on a machine without a GPU.

On the GPU machine (after building with -DPYSPEC_CUDA=ON):
    python -m pytest -q tests/test_cuda_graphs.py
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pyspec
from pyspec import _core
from tiny_models import write_tiny_model

from conftest import drain, run_requests, subprocess_env  # noqa: E402
from cuda_status import CUDA_OK, CUDA_REASON, DEVICE, gpu, real_gpu  # noqa: E402

HAS_SWITCH = hasattr(_core, "set_cuda_graphs")
needs_switch = pytest.mark.skipif(
    not HAS_SWITCH, reason="pyspec._core has no set_cuda_graphs (csrc/bindings/module.cpp does not call bind_cuda)")
# Counters only move when the device really is the GPU.
ON_GPU = DEVICE == "cuda" and CUDA_OK
TESTS_DIR = Path(__file__).resolve().parent


@contextlib.contextmanager
def graphs(on: bool):
    """Graphs on/off for the block (every backend, from its next compute); restores the setting."""
    if not HAS_SWITCH:
        yield
        return
    prev = _core.cuda_graphs_enabled()
    _core.set_cuda_graphs(on)
    try:
        yield
    finally:
        _core.set_cuda_graphs(prev)


def stats() -> dict:
    return dict(_core.cuda_graph_stats())


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after if k != "live"}


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ---------------------------------------------------------------------------------------------
# Everywhere


@needs_switch
def test_switch_and_counters():
    keys = {"captures", "replays", "eager", "capture_failures", "evictions", "live", "early_weight_launches",
            "rope_attention_launches", "early_copy_attention_launches", "stored_angles_attention_launches",
            "row_tma_launches", "norm_prologue_launches", "early_norm_launches", "deep_row_launches",
            "piped_row_launches", "one_block_row_launches", "room_row_launches", "batched_copy_launches", "timed_replays",
            "replay_gpu_ns"}
    assert set(stats()) == keys
    with graphs(False):
        assert _core.cuda_graphs_enabled() is False
    with graphs(True):
        # Only a build with the CUDA backend has graphs to turn on.
        assert _core.cuda_graphs_enabled() is (CUDA_OK or "without CUDA" not in CUDA_REASON)
    _core.reset_cuda_graph_stats()
    s = stats()
    assert all(s[k] == 0 for k in keys - {"live"})
    assert s["live"] >= 0


# ---------------------------------------------------------------------------------------------
# A decode schedule with repeated shapes and changing inputs.

N_SEQ = 2
N_CTX_SEQ = 512  # span buckets of 256: a sequence crossing position 256 changes the graph's shape
N_BATCH = 64


def schedule(n_vocab: int, seed: int = 0):
    """[(rows [(seq, pos, token)], output mask or None = last row, layer ids)]: prompts in chunks of
    N_BATCH rows, single-token steps, verify-shaped steps (4 rows of each of two sequences), a
    rollback and re-decode, layer-input outputs, and single-token steps across position 256."""
    rng = np.random.default_rng(seed)

    def toks(n):
        return [int(t) for t in rng.integers(0, n_vocab, n)]

    steps = []
    # Prompts: 200 rows of seq 0 (chunks 64, 64, 64, 8), 70 of seq 1.
    steps.append(([(0, p, t) for p, t in enumerate(toks(200))], None, []))
    steps.append(([(1, p, t) for p, t in enumerate(toks(70))], None, []))
    pos = {0: 200, 1: 70}
    for _ in range(12):  # decode seq 0
        steps.append(([(0, pos[0], toks(1)[0])], None, []))
        pos[0] += 1
    for i in range(8):  # verify-shaped: 4 rows of each sequence, every row an output
        rows = []
        for s in (0, 1):
            rows += [(s, pos[s] + j, t) for j, t in enumerate(toks(4))]
            pos[s] += 4
        steps.append((rows, [True] * len(rows), [1] if i % 3 == 2 else []))
    # Roll back seq 1 by 6 positions (kv_remove is done by the runner) and re-decode the same shape.
    steps.append(("rollback", 1, pos[1] - 6))
    pos[1] -= 6
    for _ in range(4):
        rows = [(0, pos[0], toks(1)[0]), (1, pos[1], toks(1)[0])]
        pos[0] += 1
        pos[1] += 1
        steps.append((rows, [True, True], []))
    while pos[0] < 262:  # seq 0 across position 256: a new span bucket, its own capture
        steps.append(([(0, pos[0], toks(1)[0])], None, []))
        pos[0] += 1
    return steps


def run_step(ctx, step):
    """Runs one step of schedule(); returns the arrays to compare."""
    if step[0] == "rollback":
        ctx.kv_remove(step[1], step[2])
        return []
    rows, output, layers = step
    seq, pos, tok = (np.array(c) for c in zip(*rows))
    out = np.zeros(len(rows), bool)
    if output is None:
        out[-1] = True
    else:
        out[:] = output
    r = ctx.decode(tok, positions=pos, seq_ids=seq, output=out, layer_inputs=layers)
    return [r.logits] + [r.layer_inputs[k] for k in sorted(r.layer_inputs)]


def make_context(model, backend):
    return pyspec.Context(model, n_ctx=N_CTX_SEQ * N_SEQ, n_seq_max=N_SEQ, n_batch=N_BATCH, backend=backend)


_models = {}


def tiny(model_dir, arch, wt):
    if (arch, wt) not in _models:
        tm = write_tiny_model(model_dir / f"{arch}-{wt}.gguf", arch, wt, seed=29)
        _models[(arch, wt)] = (tm, pyspec.Model(str(tm.path), n_threads=2))
    return _models[(arch, wt)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models_graphs")


# ---------------------------------------------------------------------------------------------
# On the GPU


@gpu
@needs_switch
@pytest.mark.parametrize("arch,wt", [("llama", "F32"), ("llama", "Q4_1"), ("qwen3", "F16")])
def test_decode_replay_equals_eager(model_dir, arch, wt):
    tm, model = tiny(model_dir, arch, wt)
    eager = make_context(model, DEVICE)
    graphed = make_context(model, DEVICE)
    before = stats()
    for i, step in enumerate(schedule(model.n_vocab, seed=1)):
        with graphs(False):
            want = run_step(eager, step)
        with graphs(True):
            got = run_step(graphed, step)
        assert len(got) == len(want)
        for k, (g, w) in enumerate(zip(got, want)):
            assert np.all(np.isfinite(w)), f"step {i}"
            assert same_bits(g, w), f"{arch} {wt} step {i} output {k}: replay differs from eager " \
                                    f"(max |diff| {np.max(np.abs(g.astype(np.float64) - w)):.3g})"
    d = delta(stats(), before)
    if ON_GPU:
        assert d["capture_failures"] == 0, d
        # 64-row prompt chunks, 1-row decode (two span buckets), 8-row verify (with and without
        # layer inputs), 2-row steps: each shape seen at least twice is captured once.
        assert d["captures"] >= 4, d
        # 12 + 6 single-token steps, 8 verify steps, 4 two-row steps: most of them replays.
        assert d["replays"] >= 15, d
        assert stats()["live"] >= 1


@gpu
@needs_switch
def test_same_shape_different_inputs_are_not_stale(model_dir):
    """The same single-token step replayed with different tokens gives different logits (each equal
    to eager): a replay reads this call's inputs, not the captured call's."""
    tm, model = tiny(model_dir, "llama", "F32")
    graphed = make_context(model, DEVICE)
    eager = make_context(model, DEVICE)
    prompt = [(0, p, (7 * p + 3) % model.n_vocab) for p in range(10)]
    for ctx, on in ((eager, False), (graphed, True)):
        with graphs(on):
            run_step(ctx, (prompt, None, []))
    seen = []
    for p, tok in enumerate([1, 2, 1, 5, 9, 2], start=10):
        for ctx in (eager, graphed):  # branch both from the same prompt: clear position p first
            ctx.kv_remove(0, 10)
        with graphs(False):
            want = run_step(eager, ([(0, 10, tok)], None, []))[0]
        with graphs(True):
            got = run_step(graphed, ([(0, 10, tok)], None, []))[0]
        assert same_bits(got, want), tok
        seen.append((tok, got))
    for (t1, a), (t2, b) in zip(seen, seen[1:]):
        assert same_bits(a, b) == (t1 == t2)


@gpu
@needs_switch
def test_step_times_count_the_replays_gpu_time(model_dir, monkeypatch):
    """PYSPEC_CUDA_STEP_TIMES=1 (read when a backend is made): replays are timed by events around
    their graph launch (each counted at the next replay), the same bits as without; a backend made
    without it times nothing."""
    tm, model = tiny(model_dir, "llama", "Q4_1")
    prompt = [(0, p, (7 * p + 3) % model.n_vocab) for p in range(10)]
    outs, timed = {}, {}
    for value in ("1", "0"):
        monkeypatch.setenv("PYSPEC_CUDA_STEP_TIMES", value)
        ctx = make_context(model, DEVICE)
        _core.reset_cuda_graph_stats()
        with graphs(True):
            run_step(ctx, (prompt, None, []))
            outs[value] = [run_step(ctx, ([(0, p, 5 + p)], None, []))[0] for p in range(10, 30)]
        timed[value] = stats()
    for a, b in zip(outs["1"], outs["0"]):
        assert same_bits(a, b)
    if ON_GPU:
        on, off = timed["1"], timed["0"]
        assert off["timed_replays"] == 0 and off["replay_gpu_ns"] == 0, off
        # 20 one-row steps: the first two are the warm-up and the capture, the last replay's time
        # is counted at the next one
        assert on["timed_replays"] == on["replays"] - 1 >= 15, on
        assert 0 < on["replay_gpu_ns"] / on["timed_replays"] < 50e6, on


def same_bits_either_way(model_dir, monkeypatch, arch, wt, switch):
    """Every step of the schedule, eager and replayed (twice over, so the graphs are replayed many
    times), with the environment switch on gives exactly the bits of the switch off."""
    tm, model = tiny(model_dir, arch, wt)
    outs = {}
    for value, on in (("0", False), ("1", False), ("1", True)):
        monkeypatch.setenv(switch, value)
        ctx = make_context(model, DEVICE)
        got = []
        with graphs(on):
            for rnd in range(2):
                ctx.kv_clear()
                got += [run_step(ctx, step) for step in schedule(model.n_vocab, seed=3)]
        outs[(value, on)] = got
    want = outs[("0", False)]
    for key in (("1", False), ("1", True)):
        for i, (g, w) in enumerate(zip(outs[key], want)):
            assert len(g) == len(w)
            for k, (a, b) in enumerate(zip(g, w)):
                assert same_bits(a, b), f"{arch} {wt} {switch} on, graphs {key[1]}: step {i} output {k}"


@gpu
@needs_switch
@pytest.mark.parametrize("arch,wt", [("llama", "Q4_1"), ("qwen3", "F16")])
def test_programmatic_launches_give_the_same_bits(model_dir, monkeypatch, arch, wt):
    """Programmatic dependent launch (cuda/launch.cuh; PYSPEC_CUDA_PDL=0 turns it off) starts a
    kernel's launch while the previous one runs and makes it wait on the device: it must change
    timing only. A kernel that read or wrote before waiting would race its predecessor and
    differ here."""
    same_bits_either_way(model_dir, monkeypatch, arch, wt, "PYSPEC_CUDA_PDL")


@gpu
@needs_switch
@pytest.mark.parametrize("arch,wt", [("llama", "Q4_1"), ("qwen3", "F16")])
def test_prefetch_before_the_wait_gives_the_same_bits(model_dir, monkeypatch, arch, wt):
    """The MUL_MATs' weight rows and the staged attention's first K/V chunk are prefetched into L2
    before the PDL wait (PYSPEC_CUDA_PREFETCH=0 turns it off): a hint, so the same bits."""
    same_bits_either_way(model_dir, monkeypatch, arch, wt, "PYSPEC_CUDA_PREFETCH")


@real_gpu
@needs_switch
def test_graphs_captured_under_one_row_group_setting_are_never_replayed_under_another(tmp_path, monkeypatch):
    """A graph's key holds the launch choices read from the environment at each compute, the
    copy-engine row groups' setting among them (matmul_row_tma_setting()): a decode step captured
    with them on is not replayed once they are off; that setting captures its own graph, and
    turning them on again replays the first one. A model whose one-row MUL_MATs all fit the row
    groups (F16, K of 1024 and 2048, whole groups of 8 rows)."""
    tm = write_tiny_model(tmp_path / "rows.gguf", "qwen3", "F16", seed=7, n_vocab=256, n_embd=1024, n_layer=1,
                          n_head=8, n_head_kv=2, head_dim=128, n_ff=2048)
    monkeypatch.setenv("PYSPEC_CUDA_TC", "0")
    ctx = pyspec.Context(pyspec.Model(str(tm.path), n_threads=2), n_ctx=256, n_seq_max=1, n_batch=32, backend="cuda")
    ctx.decode(list(range(1, 9)))
    pos, seen, logits = 8, [], []
    with graphs(True):
        for on in ("1", "0", "1"):
            monkeypatch.setenv("PYSPEC_CUDA_ROW_TMA", on)
            _core.reset_cuda_graph_stats()
            for _ in range(3):  # eager (first sighting), captured, replayed
                logits.append(ctx.decode([5], positions=[pos]).logits)
                pos += 1
            seen.append(stats())
    first, off, again = seen
    assert first["captures"] == 1 and first["row_tma_launches"] > 0, first
    assert off["captures"] == 1 and off["row_tma_launches"] == 0, off  # not the first graph replayed
    assert again["captures"] == 0 and again["replays"] == 3 and again["row_tma_launches"] == 0, again
    assert all(np.isfinite(x).all() for x in logits)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from test_speculative import Pairs

    return Pairs(tmp_path_factory.mktemp("graphs_spec"))


_known = {}


def known_pair(pairs):
    """(target, drafter) paths of the known-acceptance pair, written once (rewriting the files
    would pull them from under models that have them mapped)."""
    if id(pairs) not in _known:
        target, drafter, f, h, agree = pairs.known_acceptance(0.6, True, seed=3)
        _known[id(pairs)] = (target, drafter)
    return _known[id(pairs)]


def _known_engine(pairs, n_seq, draft_n_max, backend=DEVICE):
    """A SpecEngine over the known-acceptance pair with n_seq sequences and drafter slots."""
    target, drafter = known_pair(pairs)
    model = _core.Model(target)
    return _core.SpecEngine(model, _core.DraftModel(drafter, model), n_ctx=256 * n_seq, n_seq_max=n_seq,
                            n_draft_slots=n_seq, n_batch=64, draft_n_batch=128, n_threads=2, draft_n_max=draft_n_max,
                            prefill_chunk=16, backend=backend)


def _tokens_of(engine, requests):
    """Adds {request id: (prompt, add_request options)} and steps until all finish: their tokens."""
    for rid, (prompt, kw) in requests.items():
        engine.add_request(rid, prompt, **kw)
    runs = run_requests(engine)
    return {rid: runs[rid].tokens for rid in requests}


def _engine_run(pairs, backend, sampled):
    engine = _known_engine(pairs, 3, 5, backend)
    prompts = {1: [5], 2: [17, 3, 4], 3: list(range(100, 130))}
    for rid, prompt in prompts.items():
        if sampled:
            engine.add_request(rid, prompt, max_tokens=24, temperature=0.8, seed=100 + rid, verify="rejection")
        else:
            engine.add_request(rid, prompt, max_tokens=24, verify="greedy")
    runs = run_requests(engine)
    return {rid: runs[rid].tokens for rid in prompts}, {rid: runs[rid].blocks for rid in prompts}


@gpu
@needs_switch
@pytest.mark.parametrize("sampled", [False, True])
def test_spec_engine_replay_equals_eager(pairs, sampled):
    with graphs(False):
        want = _engine_run(pairs, DEVICE, sampled)
    before = stats()
    with graphs(True):
        got = _engine_run(pairs, DEVICE, sampled)
    d = delta(stats(), before)
    assert got == want
    assert all(len(t) > 0 for t in got[0].values())
    if ON_GPU:
        assert d["capture_failures"] == 0, d
        assert d["captures"] >= 1 and d["replays"] >= 5, d


def _plain_engine_run(pairs, ahead, lengths=(20, 31, 9)):
    target, _ = known_pair(pairs)
    model = _core.Model(target)
    engine = _core.SpecEngine(model, None, n_ctx=512 * 3, n_seq_max=3, n_batch=64, n_threads=2,
                              prefill_chunk=16, backend=DEVICE, decode_ahead=ahead)
    prompts = {1: [5], 2: [17, 3, 4], 3: [(7 * i) % 200 + 3 for i in range(250)]}  # 3 crosses 256 cells
    tokens = _tokens_of(engine, {rid: (p, dict(max_tokens=lengths[rid - 1], verify="greedy"))
                                 for rid, p in prompts.items()})
    return tokens, engine.n_decoded_ahead


@gpu
@needs_switch
def test_decoding_ahead_feeds_the_same_tokens_on_the_device(pairs):
    """Greedy steps queued before the host read the step before (tokens copied from its ARGMAX on
    the device, its outputs read behind an event): the tokens of the engine without it, replayed."""
    want, n0 = _plain_engine_run(pairs, False)
    before = stats()
    with graphs(True):
        got, n_ahead = _plain_engine_run(pairs, True)
    d = delta(stats(), before)
    assert got == want and [len(v) for v in got.values()] == [20, 31, 9]
    assert n0 == 0 and n_ahead >= 8
    if ON_GPU:
        assert d["capture_failures"] == 0 and d["replays"] >= 10, d
        # each step's inputs and fed tokens went as one launch, with the step before's reads
        assert d["batched_copy_launches"] >= n_ahead, d


def _sampled_engine_run(pairs, ahead):
    target, _ = known_pair(pairs)
    engine = _core.SpecEngine(_core.Model(target), None, n_ctx=512 * 3, n_seq_max=3, n_batch=64, n_threads=2,
                              prefill_chunk=16, backend=DEVICE, decode_ahead=ahead)
    chains = {1: dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=21, verify="rejection"),
              2: dict(verify="greedy", logit_bias=[(t, float("-inf")) for t in (3, 5, 17)]),
              3: dict(temperature=1.1, top_k=48, seed=22, verify="block", logit_bias=[(40, float("-inf"))])}
    prompts = {1: [5], 2: [17, 3, 4], 3: [(7 * i) % 200 + 3 for i in range(250)]}
    tokens = _tokens_of(engine, {rid: (p, dict(max_tokens=24, **chains[rid])) for rid, p in prompts.items()})
    return tokens, engine.n_decoded_ahead, engine.n_ahead_overruled


@gpu
@needs_switch
def test_sampled_rows_decode_ahead_on_the_devices_draws(pairs):
    """Sampled steps, and greedy ones that ban ids, queued on the token SAMPLE drew on the device:
    the engine's tokens without decoding ahead (a draw the host overrules is decoded again, and is
    rare), replayed."""
    want, n0, _ = _sampled_engine_run(pairs, False)
    before = stats()
    with graphs(True):
        got, n_ahead, overruled = _sampled_engine_run(pairs, True)
    d = delta(stats(), before)
    assert got == want and all(len(v) == 24 for v in got.values())
    assert n0 == 0 and n_ahead >= 8 and overruled <= 2
    if ON_GPU:
        assert d["capture_failures"] == 0 and d["replays"] >= 10, d


def _banned_run(pairs, backend):
    target, _ = known_pair(pairs)
    engine = _core.SpecEngine(_core.Model(target), None, n_ctx=256 * 2, n_seq_max=2, n_batch=64, n_threads=2,
                              prefill_chunk=16, backend=backend)
    bans = [(t, float("-inf")) for t in (3, 5, 17, 40, 41)]
    return _tokens_of(engine, {1: ([5, 6, 7], dict(max_tokens=24, verify="greedy", logit_bias=bans)),
                               2: ([9, 8], dict(max_tokens=24, verify="greedy"))})


@gpu
def test_banned_ids_take_the_graphs_best_ids_on_the_device(pairs):
    """-inf biases alone (ignore_eos) keep the greedy ids in the graph (TOP_K of bans + 1 per
    row): the tokens of the CPU, where the same path is checked against a numpy loop
    (test_engine_requests.py), with graphs replayed."""
    with graphs(True):
        got = _banned_run(pairs, DEVICE)
    assert got == _banned_run(pairs, "cpu")
    assert not {3, 5, 17, 40, 41} & set(got[1]) and len(got[1]) == 24


def _candidates_run(pairs, n_probs):
    engine = _known_engine(pairs, 3, 5)
    opts = {1: dict(top_k=40), 2: dict(top_k=5, top_p=0.9, min_p=0.05), 3: dict(top_k=40, verify="block")}
    prompts = {1: [5], 2: [17, 3, 4], 3: list(range(100, 130))}
    for rid, prompt in prompts.items():
        kw = dict(dict(verify="rejection"), **opts[rid])
        engine.add_request(rid, prompt, max_tokens=24, temperature=0.8, seed=100 + rid, n_probs=n_probs,
                           logit_bias=[(7, float("-inf"))], **kw)
    tokens = {rid: [] for rid in prompts}
    for o in drain(engine):
        tokens[o["request_id"]].append((list(o["tokens"]), list(o["verified"])))
    return tokens, engine.n_candidate_steps


@gpu
def test_sampled_rows_draw_from_the_graphs_candidates_on_the_device(pairs):
    """Sampled requests with top-k take their best ids and logits from the graph (TOP_K + GATHER
    on the device): the tokens and verified blocks of the same requests reading whole logit rows
    (n_probs forces that), replayed."""
    with graphs(True):
        got, n_fast = _candidates_run(pairs, 0)
        want, n_slow = _candidates_run(pairs, 1)
    assert got == want
    assert n_fast > 5 and n_slow == 0
    assert all(7 not in toks for steps in got.values() for toks, _ in steps)


def _mixed_run(pairs, rids):
    engine = _known_engine(pairs, 4, 3)
    opts = {1: dict(verify="greedy"), 2: dict(temperature=0.8, top_k=40, seed=2, verify="rejection"),
            3: dict(verify="greedy", repeat_penalty=1.2), 4: dict(temperature=0.8, top_k=0, seed=4, verify="block")}
    prompts = {1: [5], 2: [17, 3, 4], 3: list(range(100, 130)), 4: [9, 9, 2]}
    tokens = _tokens_of(engine, {rid: (prompts[rid], dict(opts[rid], max_tokens=20)) for rid in rids})
    return tokens, engine.n_logit_rows


@gpu
def test_mixed_steps_read_only_their_logit_rows_on_the_device(pairs):
    """Requests reading their logits (penalties, no top-k) beside greedy and top-k ones: only
    their rows are read whole (at their offsets in the device's logits), and each request gets
    what it gets alone, replayed."""
    with graphs(True):
        got, n_rows = _mixed_run(pairs, [1, 2, 3, 4])
        alone = {rid: _mixed_run(pairs, [rid]) for rid in (1, 2, 3, 4)}
    assert got == {rid: alone[rid][0][rid] for rid in alone}
    assert n_rows == alone[3][1] + alone[4][1] and alone[1][1] == alone[2][1] == 0 < alone[3][1]


# ---------------------------------------------------------------------------------------------
# The environment switch, in a subprocess.

CHILD = r"""
import json, sys
import numpy as np
import pyspec
from pyspec import _core
import test_cuda_graphs as t
model = pyspec.Model(sys.argv[1], n_threads=2)
ctx = t.make_context(model, sys.argv[2])
_core.reset_cuda_graph_stats()
outs = []
for step in t.schedule(model.n_vocab, seed=4):
    outs += t.run_step(ctx, step)
np.savez(sys.argv[3], *outs)
print(json.dumps({"enabled": _core.cuda_graphs_enabled(), "stats": dict(_core.cuda_graph_stats())}))
"""


def _child(model_path, out, **env):
    e = subprocess_env()
    e["PYTHONPATH"] = str(TESTS_DIR) + os.pathsep + e["PYTHONPATH"]
    e.update(env)
    r = subprocess.run([sys.executable, "-c", CHILD, str(model_path), DEVICE, str(out)], env=e, cwd=str(out.parent),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@gpu
@needs_switch
def test_env_switch_in_a_subprocess(model_dir, tmp_path):
    tm, model = tiny(model_dir, "qwen3", "F16")
    ctx = make_context(model, DEVICE)
    with graphs(True):
        mine = []
        for step in schedule(model.n_vocab, seed=4):
            mine += run_step(ctx, step)

    off = _child(tm.path, tmp_path / "off.npz", PYSPEC_CUDA_GRAPHS="0")
    assert off["enabled"] is False
    assert off["stats"]["captures"] == 0 and off["stats"]["replays"] == 0
    tiny_cache = _child(tm.path, tmp_path / "lru.npz", PYSPEC_CUDA_GRAPHS="1", PYSPEC_CUDA_GRAPH_CACHE="1")
    if ON_GPU:
        assert off["stats"]["eager"] > 0
        assert tiny_cache["enabled"] is True
        s = tiny_cache["stats"]
        assert s["capture_failures"] == 0 and s["captures"] >= 2 and s["evictions"] >= 1 and s["replays"] >= 1, s
    for name in ("off.npz", "lru.npz"):
        with np.load(tmp_path / name) as z:
            theirs = [z[f"arr_{i}"] for i in range(len(z.files))]
        assert len(theirs) == len(mine)
        for i, (a, b) in enumerate(zip(theirs, mine)):
            assert same_bits(a, b), f"{name}: output {i} differs from graphs in this process"
