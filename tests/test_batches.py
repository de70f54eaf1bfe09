"""Batches, KV-cache bookkeeping and input validation of pyspec.Context on tiny random models.

Batch invariance (design.md invariant 7) is asserted bit-exact: a row's logits may not depend on
which rows share its batch, how the batch is ordered or split, or which slot holds its sequence.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyspec
from numpy_reference import ACT_QUANT_FOR_WEIGHT, Reference, ReferenceSequence
from tiny_models import ARCHS, write_tiny_model, write_unknown_arch_model

N_CTX_SEQ = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models_batches")


_cache = {}


def tiny(model_dir, arch, wt):
    if (arch, wt) not in _cache:
        tm = write_tiny_model(model_dir / f"{arch}-{wt}.gguf", arch, wt, seed=11)
        _cache[(arch, wt)] = (tm, pyspec.Model(str(tm.path), n_threads=2))
    return _cache[(arch, wt)]


def make_ctx(model, n_seq_max=1, n_batch=512):
    return pyspec.Context(model, n_ctx=N_CTX_SEQ * n_seq_max, n_seq_max=n_seq_max,
                          n_batch=n_batch, check_plans=True)


def decode_rows(ctx, rows, layers=()):
    """Decode rows [(seq_id, pos, token)] in one call with every row output; returns
    {(seq_id, pos): (logits row, {layer: input row})}."""
    seq, pos, tok = (np.array(c) for c in zip(*rows))
    r = ctx.decode(tok, positions=pos, seq_ids=seq, output=np.ones(len(rows), bool),
                   layer_inputs=layers)
    assert r.logits.shape == (len(rows), ctx.model.n_vocab)
    np.testing.assert_array_equal(r.output_rows, np.arange(len(rows)))
    out = {}
    for i, (s, p, _) in enumerate(rows):
        out[(int(s), int(p))] = (r.logits[i], {il: r.layer_inputs[il][i] for il in layers})
    return out


def assert_same_rows(got, want, key_map=lambda k: k):
    """Bit-exact equality of logits and layer inputs for every row of `got`."""
    for key, (logits, layers) in got.items():
        ref_logits, ref_layers = want[key_map(key)]
        assert np.array_equal(logits, ref_logits), f"logits of row {key} differ by " \
            f"{np.max(np.abs(logits - ref_logits)):.3g}"
        for il in layers:
            assert np.array_equal(layers[il], ref_layers[il]), f"layer {il} input of row {key}"


# Three sequences of different lengths and, per step, the [start, end) positions each decodes and
# how the step lays its rows out.
LENGTHS = {"a": 11, "b": 6, "c": 16}
SCHEDULE = [
    ("blocks", {"a": (0, 5), "b": (0, 2), "c": (0, 9)}),
    ("interleave", {"c": (9, 11), "a": (5, 8), "b": (2, 3)}),
    ("shuffle", {"b": (3, 6), "a": (8, 11), "c": (11, 16)}),
]


def step_rows(layout, segs, slot, toks, rng):
    per_seq = [[(slot[name], p, int(toks[name][p])) for p in range(*span)]
               for name, span in segs.items()]
    if layout == "blocks":
        return [row for rows in per_seq for row in rows]
    if layout == "interleave":
        out = []
        while any(per_seq):
            for rows in per_seq:
                if rows:
                    out.append(rows.pop(0))
        return out
    rows = [row for rows in per_seq for row in rows]
    return [rows[i] for i in rng.permutation(len(rows))]


@pytest.mark.parametrize("wt", ["F32", "Q4_1"])
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_sequences_equal_alone(model_dir, arch, wt):
    tm, model = tiny(model_dir, arch, wt)
    rng = np.random.default_rng(5)
    toks = {name: rng.integers(0, model.n_vocab, n) for name, n in LENGTHS.items()}
    layers = (0, model.n_layer)

    # Batched: all three in one context, sequences in slots other than their "alone" slot 0.
    slot = {"a": 2, "b": 0, "c": 1}
    ctx = make_ctx(model, n_seq_max=3)
    batched = {}
    for layout, segs in SCHEDULE:
        batched.update(decode_rows(ctx, step_rows(layout, segs, slot, toks, rng), layers))
    for name, n in LENGTHS.items():
        assert ctx.seq_pos_max(slot[name]) == n - 1
        # equal results must also be right ones (tests/test_model_reference.py for the bounds)
        want, _ = Reference(tm.hparams, tm.weights, act_quant=ACT_QUANT_FOR_WEIGHT.get(wt)) \
            .forward(toks[name])
        got = np.stack([batched[(slot[name], p)][0] for p in range(n)])
        assert np.max(np.abs(got - want)) / np.std(want) < (0.2 if wt == "Q4_1" else 5e-3)

    for name, n in LENGTHS.items():
        key_map = lambda k, name=name: (0, k[1])  # noqa: E731
        mine = {k: v for k, v in batched.items() if k[0] == slot[name]}
        assert len(mine) == n
        # Alone with the same chunks.
        alone = {}
        ctx1 = make_ctx(model)
        for _, segs in SCHEDULE:
            alone.update(decode_rows(ctx1, [(0, p, int(toks[name][p])) for p in range(*segs[name])],
                                     layers))
        assert_same_rows(mine, alone, key_map)
        # Alone, one token per call, as a non-speculative decode would run.
        ctx1.kv_clear()
        alone = {}
        for p in range(n):
            alone.update(decode_rows(ctx1, [(0, p, int(toks[name][p]))], layers))
        assert_same_rows(mine, alone, key_map)
        # Alone, the whole sequence as one prompt.
        ctx1.kv_clear()
        alone = decode_rows(ctx1, [(0, p, int(toks[name][p])) for p in range(n)], layers)
        assert_same_rows(mine, alone, key_map)


@pytest.mark.parametrize("arch", ARCHS)
def test_reused_graphs_give_fresh_graphs_bits(model_dir, arch):
    """A Context reuses the graph and plan of a shape it decoded before (csrc/runtime/context.h
    graph_for). Against a context that builds and plans every step (check_plans), the same schedule
    gives the same bits: single-token steps, a batch of another shape in between that grows the
    arena (the reused graph must be placed in the new one), other layer inputs (another graph),
    then single tokens again. And a repeated shape really is reused: the planner is not asked."""
    _, model = tiny(model_dir, arch, "Q4_1")
    rng = np.random.default_rng(23)
    n_seq = 3
    fresh = make_ctx(model, n_seq_max=n_seq)
    reusing = pyspec.Context(model, n_ctx=N_CTX_SEQ * n_seq, n_seq_max=n_seq, n_batch=512)
    nxt = [0] * n_seq

    def rows_of(counts):
        rows = []
        for s, c in enumerate(counts):
            rows += [(s, nxt[s] + i, int(rng.integers(0, model.n_vocab))) for i in range(c)]
        for s, c in enumerate(counts):
            nxt[s] += c
        return rows

    schedule = [((3, 0, 0), ()), ((1, 0, 0), ()), ((1, 0, 0), ()),
                ((2, 9, 9), ()),                      # a larger batch: the arena grows
                ((1, 0, 0), ()), ((1, 0, 0), (0,)),   # the old shape again; other layer inputs
                ((1, 0, 0), ()), ((1, 1, 1), ()), ((1, 0, 0), ())]
    for step, (counts, layers) in enumerate(schedule):
        rows = rows_of(counts)
        planner = (reusing._ctx.plans_built, reusing._ctx.cache_hits)
        got = decode_rows(reusing, rows, layers)
        if step in (2, 4, 8):  # shapes this context has run before
            assert (reusing._ctx.plans_built, reusing._ctx.cache_hits) == planner, step
        assert_same_rows(got, decode_rows(fresh, rows, layers))


def interleaved_rows(rng, n_vocab, lengths):
    """Rows of len(lengths) sequences, each in increasing position order, mixed at random."""
    order = rng.permutation(np.repeat(np.arange(len(lengths)), lengths))
    nxt = [0] * len(lengths)
    rows = []
    for s in order.tolist():
        rows.append((s, nxt[s], int(rng.integers(0, n_vocab))))
        nxt[s] += 1
    return rows


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_larger_than_n_batch_is_split(model_dir, arch):
    tm, model = tiny(model_dir, arch, "Q8_0")
    rows = interleaved_rows(np.random.default_rng(9), model.n_vocab, [7, 9, 5])
    layers = (0, 1, model.n_layer)
    big = decode_rows(make_ctx(model, n_seq_max=3, n_batch=512), rows, layers)
    small_ctx = make_ctx(model, n_seq_max=3, n_batch=4)
    small = decode_rows(small_ctx, rows, layers)
    assert_same_rows(small, big)
    assert [small_ctx.seq_pos_max(s) for s in range(3)] == [6, 8, 4]

    # Only some rows output: they come back in batch order, after splitting too. The graph takes
    # the rows without logits (prompt rows) first (runtime/context.cpp); the layer inputs still come
    # back row for row in batch order.
    tok, pos, seq = [r[2] for r in rows], [r[1] for r in rows], [r[0] for r in rows]
    want = np.zeros(len(rows), bool)
    want[[1, 4, 5, 13, 20]] = True
    for ctx in (small_ctx, make_ctx(model, n_seq_max=3, n_batch=512)):
        ctx.kv_clear()
        r = ctx.decode(tok, positions=pos, seq_ids=seq, output=want, layer_inputs=layers)
        np.testing.assert_array_equal(r.output_rows, [1, 4, 5, 13, 20])
        for i, row in zip(r.output_rows, r.logits):
            assert np.array_equal(row, big[(seq[i], pos[i])][0])
        for il in layers:
            assert r.layer_inputs[il].shape == (len(rows), model.n_embd)
            for i in range(len(rows)):
                assert np.array_equal(r.layer_inputs[il][i], big[(seq[i], pos[i])][1][il]), (il, i)


@pytest.mark.parametrize("arch", ARCHS)
def test_argmax_gives_each_output_rows_first_maximum(model_dir, arch):
    """decode(argmax=True): each output row's greedy id, taken in the graph, equals numpy's argmax
    of the same row's logits (the first maximum), in batch order, over split batches too; the
    logits themselves are not returned, the layer inputs still are."""
    tm, model = tiny(model_dir, arch, "Q8_0")
    rows = interleaved_rows(np.random.default_rng(12), model.n_vocab, [6, 8, 5])
    tok, pos, seq = [r[2] for r in rows], [r[1] for r in rows], [r[0] for r in rows]
    want = np.zeros(len(rows), bool)
    want[[0, 3, 4, 10, 17, 18]] = True
    full = decode_rows(make_ctx(model, n_seq_max=3), rows, (1,))
    for n_batch in (512, 4):
        ctx = make_ctx(model, n_seq_max=3, n_batch=n_batch)
        r = ctx.decode(tok, positions=pos, seq_ids=seq, output=want, layer_inputs=(1,), argmax=True)
        assert r.logits is None
        np.testing.assert_array_equal(r.output_rows, [0, 3, 4, 10, 17, 18])
        assert r.tokens.dtype == np.int32
        np.testing.assert_array_equal(
            r.tokens, [int(np.argmax(full[(seq[i], pos[i])][0])) for i in r.output_rows])
        for i in range(len(rows)):
            assert np.array_equal(r.layer_inputs[1][i], full[(seq[i], pos[i])][1][1])
    # The greedy loop of pyspec.generate takes the same tokens either way.
    ctx = make_ctx(model)
    greedy = pyspec.generate(ctx, [1, 2, 3], 10)
    ctx.kv_clear()
    logits = ctx.decode([1, 2, 3], prompt=True).logits[-1]
    by_logits = []
    for _ in range(10):
        by_logits.append(int(np.argmax(logits)))
        logits = ctx.decode([by_logits[-1]]).logits[-1]
    assert greedy == by_logits


@pytest.mark.parametrize("arch", ARCHS)
def test_candidates_give_each_output_rows_best_ids_and_logits(model_dir, arch):
    """decode(candidates=k): each output row's k best ids (logit descending, ties by the smaller
    id) and their logits, taken in the graph (TOP_K, GATHER), equal the same rows' logits sorted by
    numpy, in batch order (rows reordered in the graph, both arrays put back), over split batches
    too; more candidates than the vocabulary is refused."""
    tm, model = tiny(model_dir, arch, "Q8_0")
    rows = interleaved_rows(np.random.default_rng(13), model.n_vocab, [6, 8, 5])
    tok, pos, seq = [r[2] for r in rows], [r[1] for r in rows], [r[0] for r in rows]
    want = np.zeros(len(rows), bool)
    want[[1, 3, 4, 9, 17, 18]] = True
    prompt = ~want
    prompt[[4, 9, 17, 18]] = True  # prompt rows with logits go first in the graph: 1 and 3 move
    full = decode_rows(make_ctx(model, n_seq_max=3), rows, ())
    for k in (5, 40):
        for n_batch in (512, 4):
            ctx = make_ctx(model, n_seq_max=3, n_batch=n_batch)
            r = ctx.decode(tok, positions=pos, seq_ids=seq, output=want, prompt=prompt, candidates=k)
            np.testing.assert_array_equal(r.output_rows, [1, 3, 4, 9, 17, 18])
            assert r.logits is None and r.candidates.shape == (6, k) and r.candidate_logits.shape == (6, k)
            for j, i in enumerate(r.output_rows):
                row = full[(seq[i], pos[i])][0]
                best = np.lexsort((np.arange(row.size), -row.astype(np.float64)))[:k]
                np.testing.assert_array_equal(r.candidates[j], best)
                np.testing.assert_array_equal(r.candidate_logits[j], row[best])
    with pytest.raises(ValueError, match="candidates"):
        make_ctx(model).decode([1, 2], candidates=model.n_vocab + 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_split_batch_with_unordered_positions(model_dir, arch):
    # A sequence's rows out of position order: unsplit, every row sees all of its sequence's
    # rows at lower positions. Split into n_batch chunks, the engine must give the same logits
    # or refuse the batch with a ValueError, never silently attend to a partial context.
    tm, model = tiny(model_dir, arch, "Q8_0")
    rng = np.random.default_rng(9)
    rows = interleaved_rows(rng, model.n_vocab, [7, 9, 5])
    rows = [rows[i] for i in rng.permutation(len(rows))]
    big = decode_rows(make_ctx(model, n_seq_max=3, n_batch=512), rows)
    small_ctx = make_ctx(model, n_seq_max=3, n_batch=4)
    try:
        small = decode_rows(small_ctx, rows)
    except ValueError:
        assert [small_ctx.seq_pos_max(s) for s in range(3)] == [-1, -1, -1]
        return
    assert_same_rows(small, big)


@pytest.mark.parametrize("arch", ARCHS)
def test_thread_count_does_not_change_results(model_dir, arch):
    tm, model = tiny(model_dir, arch, "Q4_1")
    rows = interleaved_rows(np.random.default_rng(3), model.n_vocab, [9, 12])
    layers = (0, model.n_layer)
    results = []
    for n_threads in (1, 2, 3):
        m = pyspec.Model(str(tm.path), n_threads=n_threads)
        results.append(decode_rows(make_ctx(m, n_seq_max=2), rows, layers))
    assert_same_rows(results[1], results[0])
    assert_same_rows(results[2], results[0])


@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_redecodes_identically(model_dir, arch):
    tm, model = tiny(model_dir, arch, "Q4_0")
    rng = np.random.default_rng(2)
    toks = rng.integers(0, model.n_vocab, 12)
    other = rng.integers(0, model.n_vocab, 6)
    ctx = make_ctx(model, n_seq_max=2)
    layers = (0, model.n_layer)
    first = decode_rows(ctx, [(0, p, int(toks[p])) for p in range(6)], layers)
    first.update(decode_rows(ctx, [(0, p, int(toks[p])) for p in range(6, 12)], layers))
    neighbour = decode_rows(ctx, [(1, p, int(toks[p])) for p in range(12)], layers)

    # Roll back the tail, decode something else there (a rejected draft), roll back again and
    # decode the original tokens: the rejected rows must leave no trace.
    ctx.kv_remove(0, 6, -1)
    assert ctx.seq_pos_max(0) == 5
    assert ctx.seq_pos_max(1) == 11
    decode_rows(ctx, [(0, 6 + i, int(t)) for i, t in enumerate(other)])
    assert ctx.seq_pos_max(0) == 11
    ctx.kv_remove(0, 6)
    again = decode_rows(ctx, [(0, p, int(toks[p])) for p in range(6, 12)], layers)
    assert_same_rows(again, first)

    # The neighbour sequence was untouched by all of it.
    ctx.kv_remove(1, 11, -1)
    again = decode_rows(ctx, [(1, 11, int(toks[11]))], layers)
    assert_same_rows(again, neighbour)


@pytest.mark.parametrize("arch", ARCHS)
def test_remove_middle_range_matches_reference(model_dir, arch):
    # kv_remove(seq, p0, p1) with p1 >= 0 drops exactly [p0, p1); the positions after the hole
    # keep the K/V computed when they were decoded (with the removed rows still in context).
    tm, model = tiny(model_dir, arch, "F32")
    toks = np.random.default_rng(4).integers(0, model.n_vocab, 12)
    ctx = make_ctx(model)
    ref = ReferenceSequence(Reference(tm.hparams, tm.weights))
    ctx.decode(toks[:8])
    ref.decode(toks[:8], np.arange(8))
    ctx.kv_remove(0, 3, 5)
    ref.remove(3, 5)
    assert ctx.seq_pos_max(0) == ref.pos_max() == 7
    r = ctx.decode(toks[8:], output=np.ones(4, bool))  # default positions continue at 8
    want, _ = ref.decode(toks[8:], np.arange(8, 12))
    assert np.max(np.abs(r.logits - want)) / np.std(want) < 5e-3
    # without the removal the logits differ: the test sees the hole
    full = ReferenceSequence(Reference(tm.hparams, tm.weights))
    full.decode(toks[:8], np.arange(8))
    other, _ = full.decode(toks[8:], np.arange(8, 12))
    assert np.max(np.abs(r.logits - other)) / np.std(other) > 3e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_clear(model_dir, arch):
    tm, model = tiny(model_dir, arch, "F16")
    rng = np.random.default_rng(8)
    t0, t1 = rng.integers(0, model.n_vocab, 9), rng.integers(0, model.n_vocab, 7)
    ctx = make_ctx(model, n_seq_max=2)
    a0 = decode_rows(ctx, [(0, p, int(t0[p])) for p in range(9)])
    a1 = decode_rows(ctx, [(1, p, int(t1[p])) for p in range(7)])

    ctx.kv_clear()
    assert (ctx.seq_pos_max(0), ctx.seq_pos_max(1)) == (-1, -1)
    b1 = decode_rows(ctx, [(1, p, int(t1[p])) for p in range(7)])
    assert_same_rows(b1, a1)

    # Clearing one sequence leaves the other.
    ctx.kv_clear(0)
    assert (ctx.seq_pos_max(0), ctx.seq_pos_max(1)) == (-1, 6)
    assert_same_rows(decode_rows(ctx, [(0, p, int(t0[p])) for p in range(9)]), a0)
    ctx.kv_clear(0)
    ctx.kv_remove(1, 6)
    assert (ctx.seq_pos_max(0), ctx.seq_pos_max(1)) == (-1, 5)
    assert_same_rows(decode_rows(ctx, [(1, 6, int(t1[6]))]), a1)


@pytest.mark.parametrize("arch", ARCHS)
def test_marked_prompt_rows_give_logits_in_batch_order(model_dir, arch):
    """Context.decode(prompt=...): the graph takes the prompt rows first, so rows with logits
    leave it as [marked prompt rows, output rows]; they come back in batch order all the same,
    each row's logits and layer inputs those of the row decoded any other way (one path here)."""
    tm, model = tiny(model_dir, arch, "Q8_0")
    rng = np.random.default_rng(5)
    rows = interleaved_rows(rng, model.n_vocab, [9, 6, 4])
    want = decode_rows(make_ctx(model, n_seq_max=3), rows, layers=[1])
    seq, pos, tok = (np.array(c) for c in zip(*rows))
    wants = rng.random(len(rows)) < 0.6
    marked = rng.random(len(rows)) < 0.5
    wants[np.flatnonzero(~marked)[0]] = wants[np.flatnonzero(marked)[-1]] = True  # both kinds
    # an output row ahead of a marked row with logits: graph order is not batch order
    assert any(wants[i] and not marked[i] and (wants & marked)[i + 1:].any() for i in range(len(rows)))
    r = make_ctx(model, n_seq_max=3).decode(tok, positions=pos, seq_ids=seq, output=wants,
                                            layer_inputs=[1], prompt=marked)
    np.testing.assert_array_equal(r.output_rows, np.flatnonzero(wants))
    for j, i in enumerate(r.output_rows):
        key = (int(seq[i]), int(pos[i]))
        np.testing.assert_array_equal(r.logits[j], want[key][0], err_msg=str(key))
        np.testing.assert_array_equal(r.layer_inputs[1][i], want[key][1][1], err_msg=str(key))


def test_invalid_inputs_raise_value_error(model_dir):
    tm, model = tiny(model_dir, "llama", "Q8_0")
    ctx = make_ctx(model, n_seq_max=2)
    toks = np.random.default_rng(0).integers(0, model.n_vocab, 5)
    good = decode_rows(ctx, [(0, p, int(toks[p])) for p in range(5)])

    bad_calls = [
        dict(tokens=[1], positions=[N_CTX_SEQ], seq_ids=[1]),           # beyond the context
        dict(tokens=[1, 2], positions=[3, 40], seq_ids=[1, 1]),
        dict(tokens=[1], positions=[-1], seq_ids=[1]),
        dict(tokens=[1], positions=[0], seq_ids=[2]),                    # seq_id >= n_seq_max
        dict(tokens=[1], positions=[0], seq_ids=[-1]),
        dict(tokens=[model.n_vocab], positions=[0], seq_ids=[1]),        # token >= n_vocab
        dict(tokens=[3, -1], positions=[0, 1], seq_ids=[1, 1]),
        dict(tokens=[1], positions=[0], seq_ids=[1], layer_inputs=[model.n_layer + 1]),
        dict(tokens=[1], positions=[0], seq_ids=[1], layer_inputs=[-1]),
        dict(tokens=[1, 2], positions=[0], seq_ids=[1, 1]),              # ragged arrays
        dict(tokens=[1, 2], positions=[0, 1], seq_ids=[1, 1], prompt=[True]),
        dict(tokens=[], positions=[], seq_ids=[]),
        dict(tokens=[2 ** 40], positions=[0], seq_ids=[1]),              # beyond int32
        dict(tokens=[1], positions=[2 ** 33], seq_ids=[1]),
        dict(tokens=[1], seq_ids=[2 ** 31]),
    ]
    for kwargs in bad_calls:
        with pytest.raises(ValueError):
            ctx.decode(**kwargs)
    # The core checks the prompt flags' length itself (a caller of pyspec._core directly).
    with pytest.raises(ValueError, match="one entry per token"):
        ctx._ctx.decode(np.array([1, 2], np.int32), np.array([0, 1], np.int32), np.array([1, 1], np.int32),
                        np.array([1, 1], np.uint8), [], np.array([1, 0, 1], np.uint8))
    # Nothing of a rejected batch reached the cache: seq 1 is empty, seq 0 as it was.
    assert (ctx.seq_pos_max(0), ctx.seq_pos_max(1)) == (4, -1)

    # Continuing past the end of a full sequence is refused too.
    ctx.decode(np.ones(N_CTX_SEQ, np.int64), seq_ids=np.ones(N_CTX_SEQ, np.int64))
    assert ctx.seq_pos_max(1) == N_CTX_SEQ - 1
    with pytest.raises(ValueError):
        ctx.decode([1], seq_ids=[1])

    # The context still works and gives what it gave before.
    ctx.kv_remove(0, 4)
    assert_same_rows(decode_rows(ctx, [(0, 4, int(toks[4]))]), good)

    for call in (lambda: ctx.kv_remove(2, 0), lambda: ctx.kv_clear(2), lambda: ctx.seq_pos_max(2),
                 lambda: pyspec.Context(model, n_ctx=64, n_seq_max=0)):
        with pytest.raises(ValueError):
            call()


def test_default_positions_continue_each_sequence(model_dir):
    # Without positions, rows continue their sequence from its last cell (sequence 0 without
    # seq_ids): the same bits as the positions given explicitly.
    _, model = tiny(model_dir, "llama", "Q8_0")
    toks = [5, 9, 3, 7]
    a, b = make_ctx(model, n_seq_max=2), make_ctx(model, n_seq_max=2)
    got = [a.decode(toks[:2]).logits, a.decode([toks[2]]).logits, a.decode([toks[3]], seq_ids=[1]).logits,
           a.decode([toks[0], toks[1]], seq_ids=[1, 0]).logits]
    want = [b.decode(toks[:2], positions=[0, 1], seq_ids=[0, 0]).logits,
            b.decode([toks[2]], positions=[2], seq_ids=[0]).logits,
            b.decode([toks[3]], positions=[0], seq_ids=[1]).logits,
            b.decode([toks[0], toks[1]], positions=[1, 3], seq_ids=[1, 0]).logits]
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)
    assert (a.seq_pos_max(0), a.seq_pos_max(1)) == (3, 1)
    with pytest.raises(ValueError, match="32-bit range"):
        a.decode([2 ** 40])


def test_unknown_architecture_is_named(tmp_path):
    path = write_unknown_arch_model(tmp_path / "odd.gguf", "mamba7")
    with pytest.raises(ValueError, match="mamba7"):
        pyspec.Model(str(path), n_threads=1)
