"""Op-level tests of the CPU backend: every op of csrc/core/graph.h run through
pyspec._core.run_graph and compared with a numpy implementation written here (float64 unless the
op is exact in float32, when the float32 numpy result must match bit for bit). Quantized formats
are checked against the gguf package's quantizers, which reproduce ggml's.

Batch invariance (design.md invariant 7) is checked for ATTENTION and MUL_MAT: a row computed
alone and inside any batch gives the same bits, on one thread or two. The last section runs the
multi-sequence sampling chains of graph-allocator.md §4.2 at compute level (invariant 1).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from pyspec import _core as core

NEG_INF = -np.inf
QTYPE = {"F32": QT.F32, "F16": QT.F16, "BF16": QT.BF16, "Q8_0": QT.Q8_0, "Q4_0": QT.Q4_0, "Q4_1": QT.Q4_1}


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def run(g, feeds, fetch, n_threads=1, backend="cpu"):
    """Runs g on the CPU backend (or the one named: the CUDA op tests reuse these helpers through
    tests/cuda_op_helpers.py). Fetched tensors are flagged output first: the planner may reuse the
    bytes of anything else once its last consumer has run."""
    for t in fetch:
        g.set_output(t)
    if backend == "cpu":
        return core.run_graph(g, feeds, list(fetch), n_threads)
    return core.run_graph(g, feeds, list(fetch), n_threads, backend=backend)


def node(g, op, dtype, shape, srcs, iparams=(), fparams=(), name=""):
    t = g.add_node(op, dtype, list(shape), list(srcs), name)
    if iparams or fparams:
        core.set_op_params(g, t, iparams=list(iparams), fparams=list(fparams))
    return t


def encode(x, dtype):
    """Rows of float32 values (rows, n) as the storage of dtype (a C-contiguous array)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "F32":
        return x
    if dtype == "F16":
        with np.errstate(over="ignore"):  # overflow to inf is one of the cases tested
            return x.astype(np.float16)  # numpy rounds to nearest even, as IEEE does
    return gq.quantize(x, QTYPE[dtype])


def decode(stored, dtype):
    """Storage of dtype (rows, row_bytes or n) back to float32 (rows, n)."""
    if dtype == "F32":
        return np.asarray(stored, np.float32)
    if dtype == "F16":
        return np.asarray(stored).view(np.float16).astype(np.float32)
    return gq.dequantize(np.asarray(stored).view(np.uint8), QTYPE[dtype])


def raw_bytes(a):
    return np.ascontiguousarray(a).view(np.uint8).reshape(-1)


def softmax64(z):
    z = np.asarray(z, np.float64)
    m = np.max(z, axis=-1, keepdims=True)
    e = np.exp(z - m)
    return e / np.sum(e, axis=-1, keepdims=True)


def assert_softmax_close(got, z):
    """got = softmax(z) over the last axis, z the float32 values the kernel exponentiates. The
    float32 subtraction z - max(z) is off by up to half an ulp of its result, which exp turns into
    a relative error of 2^-24 |z - max|; the vectorised exp adds < 2e-7, the sum a few ulps."""
    z = np.asarray(z, np.float64)
    want = softmax64(z)
    shift = np.where(np.isfinite(z), np.abs(z - np.max(z, axis=-1, keepdims=True)), 0.0)
    tol = want * (1e-6 + 2.0**-24 * shift) + 1e-37
    bad = np.abs(np.asarray(got, np.float64) - want) > tol
    assert not bad.any(), f"{np.asarray(got)[bad]} != {want[bad]}"


# --------------------------------------------------------------------------------------------
# ATTENTION
# --------------------------------------------------------------------------------------------


def attention_run(q, k, v, mask, base, n_kv, scale, cache_dtype, n_threads=1, backend="cpu", prompt_rows=0):
    """q (n_rows, n_head, hd) F32; k, v (n_cells, n_kv * hd) caches stored as cache_dtype;
    mask (n_rows, span) F32; base (n_rows,) I32; the first prompt_rows rows are prompt rows
    (ATTENTION's iparams[1]: the CPU has one path for both kinds, the GPU its tensor cores).
    Returns (n_rows, n_head, hd)."""
    n_rows, n_head, hd = q.shape
    n_cells = k.shape[0]
    span = mask.shape[1]
    g = core.Graph()
    tq = g.input("F32", [hd, n_head, n_rows], "q")
    tk = g.external(cache_dtype, [hd * n_kv, n_cells], "k_cache")
    tv = g.external(cache_dtype, [hd * n_kv, n_cells], "v_cache")
    tm = g.input("F32", [span, n_rows], "mask")
    tb = g.input("I32", [n_rows], "kv_base")
    iparams = [n_kv, prompt_rows] if prompt_rows else [n_kv]
    out = node(g, "ATTENTION", "F32", [hd, n_head, n_rows], [tq, tk, tv, tm, tb], iparams, [scale])
    feeds = {
        tq: np.ascontiguousarray(q, np.float32),
        tk: k,
        tv: v,
        tm: np.ascontiguousarray(mask, np.float32),
        tb: np.ascontiguousarray(base, np.int32),
    }
    (y,) = run(g, feeds, [out], n_threads, backend)
    return y.reshape(n_rows, n_head, hd)


def attention_ref(q, k, v, mask, base, n_kv, scale):
    """Float64 attention from the definition: row r, head h attends cells base[r] + j with score
    scale * q.k + mask[r, j], through kv head h // (n_head / n_kv)."""
    n_rows, n_head, hd = q.shape
    rep = n_head // n_kv
    k64 = np.asarray(k, np.float64)
    v64 = np.asarray(v, np.float64)
    out = np.zeros((n_rows, n_head, hd))
    for r in range(n_rows):
        seen = np.flatnonzero(mask[r] != NEG_INF)
        cells = base[r] + seen
        for h in range(n_head):
            cols = slice((h // rep) * hd, (h // rep + 1) * hd)
            scores = scale * (k64[cells, cols] @ q[r, h].astype(np.float64)) + mask[r, seen]
            out[r, h] = softmax64(scores) @ v64[cells, cols]
    return out


def seq_rows(start, ctx, n_new, span, block=False, holes=()):
    """Mask rows for n_new tokens of one sequence whose cells begin at `start`, with ctx cells of
    context before them. Causal: token i sees cells j <= ctx + i. Block (the drafters' mask): every
    token sees the whole block and the context, j < ctx + n_new. Holes are masked everywhere."""
    mask = np.full((n_new, span), NEG_INF, np.float32)
    for i in range(n_new):
        mask[i, : (ctx + n_new if block else ctx + i + 1)] = 0.0
    mask[:, list(holes)] = NEG_INF
    return mask, np.full(n_new, start, np.int32)


def layout(name):
    """(n_cells, mask, base) of the batch patterns the engine builds."""
    if name == "causal":
        return (32,) + seq_rows(0, 5, 7, span=12)
    if name == "causal_padded":
        return (32,) + seq_rows(0, 5, 7, span=20)
    if name == "block":
        return (32,) + seq_rows(0, 9, 6, span=15, block=True)
    if name == "block_padded":
        return (40,) + seq_rows(3, 9, 6, span=24, block=True)
    if name == "holes":
        return (32,) + seq_rows(2, 10, 4, span=24, holes=(0, 3, 4, 11))
    if name == "multi_seq":
        # Three sequences in one batch, one span padded to the longest: a decoding sequence, a
        # drafter block after 20 cells of context, and a one-token sequence; rows interleaved.
        parts = [
            seq_rows(0, 8, 2, span=32),
            seq_rows(16, 20, 4, span=32, block=True, holes=(6,)),
            seq_rows(50, 3, 1, span=32),
        ]
        mask = np.concatenate([p[0] for p in parts])
        base = np.concatenate([p[1] for p in parts])
        order = np.array([2, 0, 6, 3, 1, 5, 4])
        return 82, mask[order], base[order]
    raise ValueError(name)


def fill_caches(rng, n_cells, width, mask, base, cache_dtype):
    """Random K and V; cells no row may see hold large stale values, which masking must hide."""
    k = rng.uniform(-3e4, 3e4, (n_cells, width))
    v = rng.uniform(-3e4, 3e4, (n_cells, width))
    for r in range(mask.shape[0]):
        cells = base[r] + np.flatnonzero(mask[r] != NEG_INF)
        k[cells] = rng.standard_normal((len(cells), width))
        v[cells] = rng.standard_normal((len(cells), width))
    dt = np.float16 if cache_dtype == "F16" else np.float32
    return k.astype(dt), v.astype(dt)


LAYOUTS = ["causal", "causal_padded", "block", "block_padded", "holes", "multi_seq"]
HEADS = [(4, 1, 32), (4, 2, 64), (8, 2, 32), (8, 1, 48)]  # (n_head, n_kv_head, head_dim)


@pytest.mark.parametrize("cache_dtype", ["F16", "F32"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
@pytest.mark.parametrize("pattern", LAYOUTS)
def test_attention_matches_numpy(pattern, heads, cache_dtype):
    n_head, n_kv, hd = heads
    rng = np.random.default_rng(LAYOUTS.index(pattern) * 100 + n_head * 10 + hd)
    n_cells, mask, base = layout(pattern)
    assert int(base.max()) + mask.shape[1] <= n_cells
    k, v = fill_caches(rng, n_cells, n_kv * hd, mask, base, cache_dtype)
    q = rng.standard_normal((mask.shape[0], n_head, hd)).astype(np.float32)
    scale = 1.0 / np.sqrt(hd)
    got = attention_run(q, k, v, mask, base, n_kv, scale, cache_dtype)
    want = attention_ref(q, k, v, mask, base, n_kv, np.float32(scale))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.array_equal(got, attention_run(q, k, v, mask, base, n_kv, scale, cache_dtype, n_threads=2))


@pytest.mark.parametrize("hd,n_head,n_kv", [(64, 9, 3), (64, 8, 2), (64, 16, 2), (128, 8, 2), (128, 6, 2), (32, 4, 2)])
@pytest.mark.parametrize("cache_dtype", ["F16", "F32"])
def test_attention_value_sum_is_the_axpy_chain(hd, n_head, n_kv, cache_dtype):
    """The output is sum over the unmasked cells, in ascending order, of p * V row as axpy_f32's fma
    chain from +0, bit for bit, whatever grouping of heads the kernel keeps in registers (head dims
    64 and 128 take the register path, 32 the row-by-row one). The probabilities p are read back
    from the op itself: with one-hot V rows (cell v's row is the unit vector e_v) each output
    element is one probability exactly; the same q, K and mask with random V then must give the
    chain over those p."""
    rng = np.random.default_rng(hd + n_head)
    n_rows, n_cells = 2, min(40, hd)   # one unit vector per cell
    span = n_cells
    q = rng.standard_normal((n_rows, n_head, hd)).astype(np.float32)
    k = rng.standard_normal((n_cells, n_kv * hd)).astype(np.float32)
    mask = np.zeros((n_rows, span), np.float32)
    mask[0, 5:9] = NEG_INF                     # a gap splits the unmasked cells into two runs
    mask[1, ::3] = NEG_INF
    mask[1, 1] = -2.5
    base = np.zeros(n_rows, np.int32)
    onehot = np.zeros((n_cells, n_kv * hd), np.float32)
    for c in range(n_cells):
        for g in range(n_kv):
            onehot[c, g * hd + c] = 1.0
    v = rng.standard_normal((n_cells, n_kv * hd)).astype(np.float32)
    store = (lambda a: a.astype(np.float16)) if cache_dtype == "F16" else (lambda a: a)
    probs = attention_run(q, store(k), store(onehot), mask, base, n_kv, 0.125, cache_dtype)
    got = attention_run(q, store(k), store(v), mask, base, n_kv, 0.125, cache_dtype)
    v32 = store(v).astype(np.float32)
    rep = n_head // n_kv
    for r in range(n_rows):
        for h in range(n_head):
            g = h // rep
            want = np.zeros(hd, np.float32)
            for c in np.flatnonzero(mask[r] != NEG_INF):
                want = core.kernels.axpy_f32(float(probs[r, h, c]), v32[c, g * hd:(g + 1) * hd], want)
            assert np.array_equal(got[r, h], want), (r, h)


def test_attention_block_mask_differs_from_causal():
    # Negative control for the mask: the first row of a block sees later block cells only under
    # the block mask, so the two results must differ there and agree on the last row.
    rng = np.random.default_rng(7)
    n_cells, causal, base = 32, *seq_rows(0, 6, 5, span=11)
    block, _ = seq_rows(0, 6, 5, span=11, block=True)
    k, v = fill_caches(rng, n_cells, 32, block, base, "F32")
    q = rng.standard_normal((5, 2, 32)).astype(np.float32)
    a = attention_run(q, k, v, causal, base, 1, 0.2, "F32")
    b = attention_run(q, k, v, block, base, 1, 0.2, "F32")
    np.testing.assert_allclose(b, attention_ref(q, k, v, block, base, 1, np.float32(0.2)), rtol=1e-5, atol=1e-6)
    assert np.abs(a[0] - b[0]).max() > 1e-2
    assert np.array_equal(a[-1], b[-1])


def random_row(rng):
    """A random row: its first cell (< 48) and a visible run of up to 40 cells with a few holes
    (never all masked)."""
    length = int(rng.integers(1, 41))
    m = np.zeros(length, np.float32)
    m[rng.random(length) < 0.2] = NEG_INF
    m[rng.integers(0, length)] = 0.0
    return int(rng.integers(0, 48)), m


def batch_around_row(rng, n_rows, start, row_mask, q_row, n_cells):
    """A batch of n_rows random attention rows with (start, row_mask, q_row) placed at a random
    index `at`, its base moved a random distance earlier (masked lead-in columns) and the span
    padded at random. Returns (q, mask, base, at)."""
    n_head, hd = q_row.shape[1:]
    at = int(rng.integers(0, n_rows))
    shift = int(rng.integers(0, start + 1))
    rows = [random_row(rng) for _ in range(n_rows)]
    rows[at] = (start - shift, np.concatenate([np.full(shift, NEG_INF, np.float32), row_mask]))
    span = max(len(m) for _, m in rows) + int(rng.integers(0, 9))
    assert all(b + span <= n_cells for b, _ in rows)
    mask = np.full((n_rows, span), NEG_INF, np.float32)
    for r, (_, m) in enumerate(rows):
        mask[r, : len(m)] = m
    base = np.array([b for b, _ in rows], np.int32)
    q = rng.standard_normal((n_rows, n_head, hd)).astype(np.float32)
    q[at] = q_row[0]
    return q, mask, base, at


@pytest.mark.parametrize("cache_dtype", ["F16", "F32"])
@pytest.mark.parametrize("seed", range(4))
def test_attention_row_is_batch_invariant(seed, cache_dtype):
    """A row's output bits do not depend on its neighbours, its place in the batch, the batch's
    span (padding), how far before its first cell the row's base points, or the thread count."""
    rng = np.random.default_rng(1000 + seed)
    n_head, n_kv, hd, n_cells = 8, 2, 32, 144  # base < 48, span <= 48 + 40 + 8
    dt = np.float16 if cache_dtype == "F16" else np.float32
    k = rng.standard_normal((n_cells, n_kv * hd)).astype(dt)
    v = rng.standard_normal((n_cells, n_kv * hd)).astype(dt)
    start, row_mask = random_row(rng)
    q_row = rng.standard_normal((1, n_head, hd)).astype(np.float32)
    alone = attention_run(q_row, k, v, row_mask[None], np.array([start]), n_kv, 0.125, cache_dtype)
    want = attention_ref(q_row, k, v, row_mask[None], np.array([start]), n_kv, np.float32(0.125))
    np.testing.assert_allclose(alone, want, rtol=1e-5, atol=1e-6)

    for trial in range(3):
        n_rows = int(rng.integers(2, 7))
        q, mask, base, at = batch_around_row(rng, n_rows, start, row_mask, q_row, n_cells)
        for n_threads in (1, 2):
            got = attention_run(q, k, v, mask, base, n_kv, 0.125, cache_dtype, n_threads)
            assert np.array_equal(got[at], alone[0]), (trial, n_threads)
        np.testing.assert_allclose(got, attention_ref(q, k, v, mask, base, n_kv, np.float32(0.125)),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cache_dtype", ["F16", "F32"])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (8, 1, 48), (32, 1, 32)],
                         ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
def test_verify_rows_keep_their_own_bits(heads, cache_dtype):
    """A verify pass's rows (causal rows of one sequence, each seeing the previous row's cells and
    one more) are each bit for bit the row alone: next to another sequence's rows, a block-masked
    row of the same base, a fully masked row, with masked holes in the shared cells, at 1 and 2
    threads; and close to numpy."""
    n_head, n_kv, hd = heads
    rng = np.random.default_rng(400 + n_head + hd)
    n_cells = 320
    dt = np.float16 if cache_dtype == "F16" else np.float32
    k = rng.standard_normal((n_cells, n_kv * hd)).astype(dt)
    v = rng.standard_normal((n_cells, n_kv * hd)).astype(dt)
    span = 160
    verify_mask, verify_base = seq_rows(10, 120, 7, span=span, holes=(3, 40, 41))   # 7 causal rows
    other_mask, other_base = seq_rows(150, 30, 3, span=span)                         # another sequence
    block_mask, block_base = seq_rows(10, 120, 2, span=span, block=True)             # same base, not nested
    dead = np.full((1, span), NEG_INF, np.float32)
    mask = np.concatenate([verify_mask[:2], block_mask[:1], verify_mask[2:], other_mask, dead, block_mask[1:]])
    base = np.concatenate([verify_base[:2], block_base[:1], verify_base[2:], other_base, [7], block_base[1:]]
                          ).astype(np.int32)
    q = rng.standard_normal((len(mask), n_head, hd)).astype(np.float32)
    alone = np.stack([attention_run(q[i:i + 1], k, v, mask[i:i + 1], base[i:i + 1], n_kv, 0.125, cache_dtype, 1)[0]
                      for i in range(len(mask))])
    for n_threads in (1, 2):
        got = attention_run(q, k, v, mask, base, n_kv, 0.125, cache_dtype, n_threads)
        bad = [i for i in range(len(mask)) if not np.array_equal(got[i], alone[i])]
        assert not bad, (n_threads, bad)
    live = mask.max(axis=1) != NEG_INF
    np.testing.assert_allclose(got[live], attention_ref(q[live], k, v, mask[live], base[live], n_kv,
                                                        np.float32(0.125)), rtol=1e-5, atol=1e-6)
    assert np.all(got[~live] == 0)


@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (6, 1, 32)],
                         ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
@pytest.mark.parametrize("cache_dtype", ["F16", "F32"])
def test_long_decode_attention_phases(heads, cache_dtype):
    """Decode rows over long spans (few (row, kv head) pairs, span >= cpu/attention.h's
    kPhasedMinSpan) run in phases over the thread pool (scores in blocks of cells, softmax per
    head, V sums in slices of head dims): the bits of the one-thread pass, for one row and two,
    with masked holes and blocks cut inside runs of cells."""
    n_head, n_kv, hd = heads
    rng = np.random.default_rng(77 + hd + n_kv)
    n_cells, span = 3000, 2600
    dt = np.float16 if cache_dtype == "F16" else np.float32
    k = rng.standard_normal((n_cells, n_kv * hd)).astype(dt)
    v = rng.standard_normal((n_cells, n_kv * hd)).astype(dt)
    for n_rows in (1, 2):
        q = rng.standard_normal((n_rows, n_head, hd)).astype(np.float32)
        mask = np.zeros((n_rows, span), np.float32)
        mask[rng.random((n_rows, span)) < 0.1] = NEG_INF
        mask[:, -300:] = NEG_INF  # a row's unmasked cells need not reach the span's end
        base = rng.integers(0, n_cells - span + 1, n_rows).astype(np.int32)
        one = attention_run(q, k, v, mask, base, n_kv, 0.125, cache_dtype, 1)
        np.testing.assert_allclose(one, attention_ref(q, k, v, mask, base, n_kv, np.float32(0.125)),
                                   rtol=1e-5, atol=1e-6)
        for n_threads in (2, 3, 4):
            got = attention_run(q, k, v, mask, base, n_kv, 0.125, cache_dtype, n_threads)
            assert np.array_equal(got, one), (n_rows, n_threads)


def test_set_rows_then_attention_reads_the_new_cells():
    """A decode step on layer 1 of a cache that stacks 3 layers in one F16 buffer: new K/V rows
    are written through SET_ROWS on the layer's view, and the ATTENTION that consumes the SET_ROWS
    nodes sees them (ordering through the view). The buffer is written in place, in layer 1 only."""
    rng = np.random.default_rng(11)
    n_head, n_kv, hd, n_cells, n_new, n_layers, layer = 4, 2, 32, 24, 3, 3, 1
    width = n_kv * hd
    k_all = rng.standard_normal((n_layers * n_cells, width)).astype(np.float16)
    v_all = rng.standard_normal((n_layers * n_cells, width)).astype(np.float16)
    k_new = rng.standard_normal((n_new, width)).astype(np.float32)
    v_new = rng.standard_normal((n_new, width)).astype(np.float32)
    cells = np.array([9, 10, 11], np.int32)
    mask, base = seq_rows(0, 9, n_new, span=16)
    q = rng.standard_normal((n_new, n_head, hd)).astype(np.float32)

    k_want, v_want = k_all.copy(), v_all.copy()
    k_want[layer * n_cells + cells] = k_new.astype(np.float16)
    v_want[layer * n_cells + cells] = v_new.astype(np.float16)
    rows = slice(layer * n_cells, (layer + 1) * n_cells)
    want = attention_ref(q, k_want[rows], v_want[rows], mask, base, n_kv, np.float32(0.25))

    g = core.Graph()
    tq = g.input("F32", [hd, n_head, n_new], "q")
    tkn = g.input("F32", [width, n_new], "k_new")
    tvn = g.input("F32", [width, n_new], "v_new")
    tids = g.input("I32", [n_new], "cells")
    tk = g.external("F16", [width, n_layers * n_cells], "k_cache")
    tv = g.external("F16", [width, n_layers * n_cells], "v_cache")
    tm = g.input("F32", [16, n_new], "mask")
    tb = g.input("I32", [n_new], "kv_base")
    offset = layer * n_cells * width * 2
    k_layer = g.view(tk, [width, n_cells], [2, width * 2], offset)
    v_layer = g.view(tv, [width, n_cells], [2, width * 2], offset)
    ks = g.set_rows(k_layer, tkn, tids)
    vs = g.set_rows(v_layer, tvn, tids)
    out = node(g, "ATTENTION", "F32", [hd, n_head, n_new], [tq, ks, vs, tm, tb], [n_kv], [0.25])
    feeds = {tq: q, tkn: k_new, tvn: v_new, tids: cells, tk: k_all, tv: v_all, tm: mask, tb: base}
    (got,) = run(g, feeds, [out])
    np.testing.assert_allclose(got.reshape(n_new, n_head, hd), want, rtol=1e-5, atol=1e-6)
    assert np.array_equal(raw_bytes(k_all), raw_bytes(k_want))
    assert np.array_equal(raw_bytes(v_all), raw_bytes(v_want))


# --------------------------------------------------------------------------------------------
# ROPE, RMS_NORM
# --------------------------------------------------------------------------------------------


def rope_ref(x, pos, n_rot, mode, base, fscale, factors=None):
    """x (n_rows, n_head, hd) float64; theta_i = fscale * pos * base^(-2i / n_rot) / factors_i,
    i < n_rot/2, rotating pairs (2i, 2i+1) (mode 0) or (i, i + n_rot/2) (mode 2, NEOX); dims >=
    n_rot pass."""
    half = n_rot // 2
    i = np.arange(half, dtype=np.float64)
    theta = np.float64(fscale) * pos.astype(np.float64)[:, None] * np.float64(base) ** (-2.0 * i / n_rot)
    if factors is not None:
        theta = theta / np.asarray(factors, np.float64)[None, :]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    first = i.astype(int) if mode == 2 else 2 * i.astype(int)
    second = first + half if mode == 2 else first + 1
    out = np.array(x, np.float64)
    a, b = out[..., first].copy(), out[..., second].copy()
    out[..., first] = a * c - b * s
    out[..., second] = a * s + b * c
    return out


@pytest.mark.parametrize("mode", [0, 2])
@pytest.mark.parametrize("n_rot", [64, 32, 16])
@pytest.mark.parametrize("base,fscale", [(10000.0, 1.0), (1000000.0, 0.25)])
def test_rope(mode, n_rot, base, fscale):
    rng = np.random.default_rng(n_rot + mode)
    hd, n_head, n_rows = 64, 3, 6
    x = rng.standard_normal((n_rows, n_head, hd)).astype(np.float32)
    pos = np.array([0, 1, 7, 100, 4095, 33000], np.int32)
    g = core.Graph()
    tx = g.input("F32", [hd, n_head, n_rows], "x")
    tp = g.input("I32", [n_rows], "pos")
    out = node(g, "ROPE", "F32", [hd, n_head, n_rows], [tx, tp], [n_rot, mode], [base, fscale])
    (got,) = run(g, {tx: x, tp: pos}, [out])
    got = got.reshape(n_rows, n_head, hd)
    np.testing.assert_allclose(got, rope_ref(x, pos, n_rot, mode, base, fscale), rtol=1e-6, atol=1e-6)
    assert np.array_equal(got[..., n_rot:], x[..., n_rot:])  # the tail passes through untouched
    assert np.array_equal(got[0], x[0])  # position 0 is the identity


@pytest.mark.parametrize("mode", [0, 2])
def test_rope_with_frequency_factors(mode):
    # llama 3.1's rope_freqs: per-frequency divisors given as a third source.
    rng = np.random.default_rng(11 + mode)
    hd, n_head, n_rows, n_rot = 32, 2, 4, 32
    x = rng.standard_normal((n_rows, n_head, hd)).astype(np.float32)
    pos = np.array([0, 5, 100, 8000], np.int32)
    factors = rng.uniform(1.0, 8.0, n_rot // 2).astype(np.float32)
    g = core.Graph()
    tx = g.input("F32", [hd, n_head, n_rows], "x")
    tp = g.input("I32", [n_rows], "pos")
    tf = g.external("F32", [n_rot // 2], "rope_freqs")
    out = node(g, "ROPE", "F32", [hd, n_head, n_rows], [tx, tp, tf], [n_rot, mode], [10000.0, 1.0])
    (got,) = run(g, {tx: x, tp: pos, tf: factors}, [out])
    got = got.reshape(n_rows, n_head, hd)
    want = rope_ref(x, pos, n_rot, mode, 10000.0, 1.0, factors)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(got - rope_ref(x, pos, n_rot, mode, 10000.0, 1.0)).max() > 0.1  # factors matter


def test_rope_angles_kept_between_nodes_are_fresh_angles():
    """The CPU keeps each thread's ROPE angles across nodes and computes (KernelScratch's
    RopeAngles). One graph interleaves nodes that change the positions, the base, the scale,
    n_rot and the frequency factors, and repeats them: each node's output equals, bit for bit, the
    same node alone in a graph of its own (fresh angles), with 1 and 2 threads."""
    rng = np.random.default_rng(5)
    hd, n_head, n_rows = 32, 2, 5
    x = rng.standard_normal((n_rows, n_head, hd)).astype(np.float32)
    pos_a = np.array([0, 3, 9, 70, 5000], np.int32)
    pos_b = np.array([0, 3, 10, 70, 4999], np.int32)  # some rows equal, some not
    f1 = rng.uniform(1.0, 4.0, 16).astype(np.float32)
    f2 = f1.copy()
    f2[7] *= 2.0  # one divisor differs
    nodes = [("a", 32, 10000.0, 1.0, None), ("b", 32, 10000.0, 1.0, None), ("a", 32, 10000.0, 1.0, None),
             ("a", 32, 500000.0, 1.0, None), ("a", 32, 500000.0, 0.5, None), ("a", 16, 500000.0, 0.5, None),
             ("a", 32, 10000.0, 1.0, f1), ("a", 32, 10000.0, 1.0, f2), ("b", 32, 10000.0, 1.0, f2),
             ("a", 32, 10000.0, 1.0, None)]

    def build(items):
        g = core.Graph()
        tx = g.input("F32", [hd, n_head, n_rows], "x")
        tp = {"a": g.input("I32", [n_rows], "pos_a"), "b": g.input("I32", [n_rows], "pos_b")}
        tf = {"f1": g.input("F32", [16], "f1"), "f2": g.input("F32", [16], "f2")}
        outs = []
        for which, n_rot, base, fscale, fac in items:
            srcs = [tx, tp[which]] + ([tf["f1" if fac is f1 else "f2"]] if fac is not None else [])
            outs.append(node(g, "ROPE", "F32", [hd, n_head, n_rows], srcs, [n_rot, 0], [base, fscale]))
        return g, {tx: x, tp["a"]: pos_a, tp["b"]: pos_b, tf["f1"]: f1, tf["f2"]: f2}, outs

    for n_threads in (1, 2):
        g, feeds, outs = build(nodes)
        together = run(g, feeds, outs, n_threads=n_threads)
        for item, got in zip(nodes, together):
            g1, feeds1, (out1,) = build([item])
            (alone,) = run(g1, feeds1, [out1], n_threads=n_threads)
            assert np.array_equal(got, alone), (n_threads, item[:4])
    # the nodes do differ (a stale angle would show)
    assert not np.array_equal(together[0], together[1]) and not np.array_equal(together[6], together[7])


def test_rope_modes_rotate_different_pairs():
    # Negative control: with n_rot < hd the two modes must disagree (a swapped mode would pass a
    # test that only ran one of them against a reference with the same swap).
    x = np.arange(1, 33, dtype=np.float32).reshape(1, 1, 32)
    pos = np.array([3], np.int32)
    outs = []
    for mode in (0, 2):
        g = core.Graph()
        tx = g.input("F32", [32, 1, 1], "x")
        tp = g.input("I32", [1], "pos")
        out = node(g, "ROPE", "F32", [32, 1, 1], [tx, tp], [16, mode], [10000.0, 1.0])
        outs.append(run(g, {tx: x, tp: pos}, [out])[0].reshape(1, 1, 32))
        np.testing.assert_allclose(outs[-1], rope_ref(x, pos, 16, mode, 10000.0, 1.0), rtol=1e-6, atol=1e-5)
    assert np.abs(outs[0] - outs[1]).max() > 1.0


def rms_norm_ref(x, w, eps):
    x = np.asarray(x, np.float64)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * np.asarray(w, np.float64)


@pytest.mark.parametrize("with_weight", [False, True])
@pytest.mark.parametrize("hd", [16, 64, 100])
def test_rms_norm_per_head(with_weight, hd):
    rng = np.random.default_rng(hd)
    n_head, n_rows, eps = 3, 4, 1e-6
    x = rng.standard_normal((n_rows, n_head, hd)).astype(np.float32)
    x[1, 2] *= 300.0  # rows are normalised independently
    x[2, 0] = 0.0  # an all-zero row stays zero (eps keeps it finite)
    w = rng.uniform(0.5, 1.5, hd).astype(np.float32)
    g = core.Graph()
    tx = g.input("F32", [hd, n_head, n_rows], "x")
    srcs = [tx]
    feeds = {tx: x}
    if with_weight:
        tw = g.input("F32", [hd], "w")
        srcs.append(tw)
        feeds[tw] = w
    out = node(g, "RMS_NORM", "F32", [hd, n_head, n_rows], srcs, fparams=[eps])
    (got,) = run(g, feeds, [out])
    want = rms_norm_ref(x, w if with_weight else None, np.float32(eps))
    np.testing.assert_allclose(got.reshape(x.shape), want, rtol=2e-6, atol=1e-7)
    assert np.all(got.reshape(x.shape)[2, 0] == 0.0)


def test_qk_norm_and_rope_on_a_fused_qkv_view():
    """qwen3's q path: the q heads are a strided view of a fused QKV row, normalised per head and
    rotated in NEOX mode; the kernels must follow the view's row strides."""
    rng = np.random.default_rng(5)
    hd, n_head, n_kv, n_rows = 32, 4, 2, 5
    width = hd * (n_head + 2 * n_kv)
    qkv = rng.standard_normal((n_rows, width)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, hd).astype(np.float32)
    pos = np.array([4, 5, 6, 7, 8], np.int32)
    g = core.Graph()
    tqkv = g.input("F32", [width, n_rows], "qkv")
    tw = g.input("F32", [hd], "q_norm")
    tp = g.input("I32", [n_rows], "pos")
    # the k heads: after the q heads in each fused row
    tkv = g.view(tqkv, [hd, n_kv, n_rows], [4, hd * 4, width * 4], n_head * hd * 4)
    tq = g.view(tqkv, [hd, n_head, n_rows], [4, hd * 4, width * 4], 0)
    qn = node(g, "RMS_NORM", "F32", [hd, n_head, n_rows], [tq, tw], fparams=[1e-6])
    qr = node(g, "ROPE", "F32", [hd, n_head, n_rows], [qn, tp], [hd, 2], [1000000.0, 1.0])
    kn = node(g, "RMS_NORM", "F32", [hd, n_kv, n_rows], [tkv], fparams=[1e-6])
    got_q, got_k = run(g, {tqkv: qkv, tw: w, tp: pos}, [qr, kn])
    q_in = qkv[:, : n_head * hd].reshape(n_rows, n_head, hd)
    k_in = qkv[:, n_head * hd: (n_head + n_kv) * hd].reshape(n_rows, n_kv, hd)
    want_q = rope_ref(rms_norm_ref(q_in, w, 1e-6), pos, hd, 2, 1e6, 1.0)
    np.testing.assert_allclose(got_q.reshape(n_rows, n_head, hd), want_q, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(got_k.reshape(n_rows, n_kv, hd), rms_norm_ref(k_in, None, 1e-6), rtol=2e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------
# SOFTMAX and the element-wise ops
# --------------------------------------------------------------------------------------------


def softmax_input(n, rows=4):
    """Rows of logits for softmax tests: random, half -inf, all -inf but one (probability
    exactly 1), random."""
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((rows, n)) * 4).astype(np.float32)
    if n > 1:
        x[1, rng.choice(n, size=n // 2, replace=False)] = NEG_INF
        x[2, :] = NEG_INF
        x[2, n - 1] = 3.0
    return x


@pytest.mark.parametrize("scale", [1.0, 0.7, 2.5])
@pytest.mark.parametrize("n", [1, 5, 16, 31, 64, 100])
def test_softmax(n, scale):
    rows = 4
    x = softmax_input(n, rows)
    g = core.Graph()
    tx = g.input("F32", [n, rows], "x")
    out = node(g, "SOFTMAX", "F32", [n, rows], [tx], fparams=[scale])
    (got,) = run(g, {tx: x}, [out])
    got = got.reshape(rows, n)
    assert_softmax_close(got, x * np.float32(scale))  # the scaled value is rounded to float32 first
    assert np.all(got[x == NEG_INF] == 0.0)
    if n > 1:
        assert got[2, n - 1] == 1.0
    np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=2e-6)


def test_softmax_scale_sharpens():
    # Negative control: the scale is applied before the exponent (softmax(s * x), not s * softmax(x)).
    x = np.array([[0.0, 1.0, 2.0]], np.float32)
    g = core.Graph()
    tx = g.input("F32", [3, 1], "x")
    out = node(g, "SOFTMAX", "F32", [3, 1], [tx], fparams=[3.0])
    (got,) = run(g, {tx: x}, [out])
    assert_softmax_close(got.reshape(1, 3), 3.0 * x)


def silu64(x):
    x = np.asarray(x, np.float64)
    return x / (1.0 + np.exp(-x))


def elementwise(op, inputs, params=(), backend="cpu"):
    """Runs one element-wise op over F32 inputs of shapes given by the arrays (numpy order)."""
    g = core.Graph()
    ids = [g.input("F32", list(a.shape[::-1]), f"in{i}") for i, a in enumerate(inputs)]
    out = node(g, op, "F32", list(inputs[0].shape[::-1]), ids, fparams=list(params))
    (got,) = run(g, dict(zip(ids, inputs)), [out], backend=backend)
    return got.reshape(inputs[0].shape)


def test_silu_and_swiglu():
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((3, 2, 37)) * 5).astype(np.float32)
    a[0, 0, :6] = [0.0, -0.0, 20.0, -20.0, 88.0, -80.0]
    b = rng.standard_normal((3, 2, 37)).astype(np.float32)
    np.testing.assert_allclose(elementwise("SILU", [a]), silu64(a), rtol=1e-6, atol=1e-37)
    np.testing.assert_allclose(elementwise("SWIGLU", [a, b]), silu64(a) * b, rtol=1e-6, atol=1e-37)


def test_silu_does_not_depend_on_where_a_value_sits():
    """The vector body and the scalar tail give the same bits for the same value: a value's SiLU
    is the same in a row of 37 (tail) and at the front of a row of 64 (body)."""
    rng = np.random.default_rng(9)
    a = (rng.standard_normal((1, 64)) * 6).astype(np.float32)
    long = elementwise("SILU", [a])
    short = elementwise("SILU", [np.ascontiguousarray(a[:, 27:])])        # 37: 32 body + 5 tail
    np.testing.assert_array_equal(short[0], long[0, 27:])
    shifted = elementwise("SILU", [np.ascontiguousarray(a[:, 59:])])      # 5: all tail
    np.testing.assert_array_equal(shifted[0], long[0, 59:])


@pytest.mark.parametrize("op,fn", [("ADD", np.add), ("MUL", np.multiply)])
def test_add_mul_exact_with_row_broadcast(op, fn):
    """Single float32 operations are exactly rounded, so the float32 numpy result is the answer."""
    rng = np.random.default_rng(4)
    a = rng.standard_normal((2, 3, 40)).astype(np.float32)
    full = rng.standard_normal((2, 3, 40)).astype(np.float32)
    row = rng.standard_normal((1, 1, 40)).astype(np.float32)
    assert np.array_equal(elementwise(op, [a, full]), fn(a, full))
    assert np.array_equal(elementwise(op, [a, row]), fn(a, row))  # one row, broadcast over rows
    assert np.array_equal(elementwise(op, [a, row.reshape(40)]), fn(a, row))


def test_scale_exact():
    x = np.random.default_rng(6).standard_normal((5, 33)).astype(np.float32)
    assert np.array_equal(elementwise("SCALE", [x], [0.37]), x * np.float32(0.37))


def reduce_run(op, x, k=None, backend="cpu"):
    rows, n = x.shape
    g = core.Graph()
    tx = g.input("F32", [n, rows], "x")
    if op == "TOP_K":
        out = node(g, "TOP_K", "I32", [k, rows], [tx], [k])
    else:
        out = node(g, "ARGMAX", "I32", [1, rows], [tx])
    (got,) = run(g, {tx: x}, [out], backend=backend)
    return got.reshape(rows, -1)


def tie_heavy_rows(rng, rows, n):
    x = rng.integers(0, 4, (rows, n)).astype(np.float32)  # many equal values
    x[0] = 1.0  # a row of ties only
    if rows > 2:
        x[2, ::3] = NEG_INF
    return x


@pytest.mark.parametrize("n", [1, 7, 40, 257])
def test_argmax_first_index_on_ties(n):
    rng = np.random.default_rng(n)
    for x in (tie_heavy_rows(rng, 6, n), rng.standard_normal((6, n)).astype(np.float32)):
        got = reduce_run("ARGMAX", x)[:, 0]
        assert np.array_equal(got, np.argmax(x, axis=1))  # numpy returns the first maximum


def test_argmax_skips_nan_as_one_comparing_scan_does():
    """ARGMAX is what a scan keeping i when x[i] > x[best] gives: NaN never wins, except at index
    0, which nothing compares greater than (vectorised passes must keep that)."""
    for n in (5, 8, 40, 257):
        x = np.random.default_rng(n).standard_normal((3, n)).astype(np.float32)
        x[0, n // 2] = np.nan          # ignored
        x[1, 0] = np.nan               # nothing beats it
        x[2, :] = NEG_INF
        x[2, n - 1] = np.nan
        got = reduce_run("ARGMAX", x)[:, 0]
        assert got[0] == np.nanargmax(x[0]) and got[1] == 0 and got[2] == 0


def top_k_ref(x, k):
    """Descending by value; equal values in ascending index order."""
    idx = np.arange(x.shape[1])
    return np.stack([np.lexsort((idx, -row.astype(np.float64)))[:k] for row in x])


@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (40, 1), (40, 8), (40, 40), (257, 16), (300, 32), (300, 33)])
def test_top_k_descending_ties_keep_lower_index(n, k):
    rng = np.random.default_rng(n * 100 + k)
    for x in (tie_heavy_rows(rng, 6, n), rng.standard_normal((6, n)).astype(np.float32)):
        got = reduce_run("TOP_K", x, k)
        assert np.array_equal(got, top_k_ref(x, k))
        vals = np.take_along_axis(x, got, axis=1)
        assert np.all(vals[:, :-1] >= vals[:, 1:])


def top_k_gather_run(x, k, ids=None, backend="cpu"):
    """TOP_K of x's rows, then GATHER of x at those ids (or at `ids`, an I32 input [rows, k])."""
    rows, n = x.shape
    g = core.Graph()
    tx = g.input("F32", [n, rows], "x")
    if ids is None:
        tids = node(g, "TOP_K", "I32", [k, rows], [tx], [k])
        feeds = {tx: x}
    else:
        tids = g.input("I32", [k, rows], "ids")
        feeds = {tx: x, tids: np.ascontiguousarray(ids, np.int32)}
    vals = node(g, "GATHER", "F32", [k, rows], [tx, tids])
    got_ids, got_vals = run(g, feeds, [tids, vals], backend=backend)
    return got_ids.reshape(rows, k), got_vals.reshape(rows, k)


def signed_zero_rows(rng, rows, n):
    """Rows of +0 and -0 (equal, so ties by index) with a few larger values."""
    x = np.where(rng.random((rows, n)) < 0.5, np.float32(0.0), np.float32(-0.0)).astype(np.float32)
    x[:, rng.integers(0, n, 5)] = 1.0
    return x


def quarter_rows(rng, rows, n):
    """Normal values rounded to quarters: ties among the best few, which the filter ranks."""
    return (np.round(rng.standard_normal((rows, n)) * 4) / 4).astype(np.float32)


@pytest.mark.parametrize("n,k", [(40, 40), (4096, 40), (49152, 40), (49152, 64), (151936, 64)])
def test_top_k_of_long_rows_and_gather_its_values(n, k):
    """TOP_K past the insertion sort's k (a vocabulary narrowed to its possible best first) keeps
    the (value desc, index asc) order, -0 equal to +0; GATHER returns the logits at those ids."""
    rng = np.random.default_rng(n + k)
    for x in (tie_heavy_rows(rng, 3, n), rng.standard_normal((3, n)).astype(np.float32),
              signed_zero_rows(rng, 2, n), quarter_rows(rng, 3, n)):
        ids, vals = top_k_gather_run(x, k)
        assert np.array_equal(ids, top_k_ref(x, k))
        assert np.array_equal(vals, np.take_along_axis(x, ids.astype(np.int64), axis=1))


def test_gather_minus_one_is_minus_inf_and_refuses_other_ids():
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    _, vals = top_k_gather_run(x, 3, ids=[[5, -1, 0], [-1, 2, 2]])
    assert vals.tolist() == [[5.0, NEG_INF, 0.0], [NEG_INF, 8.0, 8.0]]
    with pytest.raises(Exception, match="out of range"):
        top_k_gather_run(x, 3, ids=[[6, 0, 0], [0, 0, 0]])


def gumbel_case(rng, rows, n):
    """Keys I32 [rows, 5] (seeds over all 64 bits, every third row off) and elements I32 [n]
    (ids anywhere in a 152k vocabulary, in no order, some in one counter block)."""
    keys = np.zeros((rows, 5), np.int64)
    seeds = rng.integers(0, 1 << 63, rows, dtype=np.int64).astype(np.uint64) * np.uint64(2) + np.uint64(1)
    keys[:, 0] = (seeds & np.uint64(0xFFFFFFFF)).astype(np.int64)
    keys[:, 1] = (seeds >> np.uint64(32)).astype(np.int64)
    keys[:, 2] = rng.integers(0, 1 << 31, rows)
    keys[:, 3] = rng.integers(0, 1 << 31, rows)
    keys[:, 4] = [0 if r % 3 == 2 else 1 for r in range(rows)]
    elems = rng.integers(0, 151936, n)
    elems[: min(n, 4)] = [8, 9, 10, 11][: min(n, 4)]
    return keys.astype(np.uint32).view(np.int32), elems.astype(np.int32), seeds


def gumbel_ref(keys, elems, seeds, stream):
    """spec.gumbel (the host's noise: philox.h, fill_gumbel) at each element, per row; 0 when off."""
    out = np.zeros((len(keys), len(elems)), np.float32)
    top = int(elems.max()) + 1
    for r, k in enumerate(keys.view(np.uint32)):
        if k[4]:
            out[r] = core.spec.gumbel(int(seeds[r]), int(k[2]), int(k[3]), top, stream)[elems]
    return out


def gumbel_run(keys, elems, stream, n_threads=1, backend="cpu"):
    g = core.Graph()
    tk = g.input("I32", [5, len(keys)], "keys")
    te = g.input("I32", [len(elems)], "elements")
    out = node(g, "GUMBEL", "F32", [len(elems), len(keys)], [tk, te], [stream])
    (got,) = run(g, {tk: keys, te: elems}, [out], n_threads=n_threads, backend=backend)
    return np.asarray(got).reshape(len(keys), len(elems))


@pytest.mark.parametrize("rows,n", [(1, 1), (3, 7), (6, 300), (4, 8192)])
def test_gumbel_is_the_hosts_noise(rows, n):
    """GUMBEL draws in the graph exactly the noise the host's Philox gives (spec.gumbel) for each
    row's key and each column's element, zeros where a row is off, on 1 and 3 threads."""
    rng = np.random.default_rng(rows * 1000 + n)
    keys, elems, seeds = gumbel_case(rng, rows, n)
    for stream in (1, 3):
        want = gumbel_ref(keys, elems, seeds, stream)
        for threads in (1, 3):
            assert np.array_equal(gumbel_run(keys, elems, stream, threads), want), (stream, threads)


def test_vectorised_noise_is_the_scalar_noise_for_every_uniform():
    """The host's noise takes its logarithms many lanes at a time (runtime/noise_simd.h, AVX-512 or
    AVX2 where built for them): every one of the 2^23 uniforms the noise can draw, (2k + 1) 2^-24,
    gets the scalar function's bits, so the CPU, the GPU and the verifier's own draws agree."""
    u = ((2 * np.arange(1 << 23, dtype=np.int64) + 1) * 2.0 ** -24).astype(np.float32)
    assert u[0] > 0 and u[-1] < 1 and len(np.unique(u)) == 1 << 23
    got = core.spec.gumbel_of_u01(u)
    want = core.spec.gumbel_of_u01(u, scalar=True)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # odd lengths leave a scalar tail
    assert np.array_equal(core.spec.gumbel_of_u01(u[5:16]), want[5:16])


def test_gumbel_logs_are_correctly_rounded():
    """The noise's logarithms (runtime/noise_math.h, IEEE double operations only, so the CUDA
    kernel computes the same bits) round like a correctly rounded float log: 2M draws against
    float64 logs rounded to float32 at each step, as the noise takes them."""
    u = core.spec.uniforms(7, 3, 0, 2_000_000).astype(np.float64)
    inner = np.log(u).astype(np.float32).astype(np.float64)
    want = -np.log(-inner).astype(np.float32)
    got = core.spec.gumbel(7, 3, 0, 2_000_000, 0)
    assert np.count_nonzero(got != want) <= 2   # only where float64's own log sits on a tie


def test_sum_contiguous_and_strided():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 4, 50)).astype(np.float32)
    x[1, 2, 7] = 1e6
    g = core.Graph()
    tx = g.input("F32", [50, 4, 3], "x")
    whole = node(g, "SUM", "F32", [1], [tx])
    # every other row of the [50, 12] flattening, first 20 elements of each
    view = g.view(tx, [20, 6], [4, 2 * 50 * 4], 0)
    part = node(g, "SUM", "F32", [1], [view])
    got_whole, got_part = run(g, {tx: x}, [whole, part])
    flat = x.reshape(12, 50)
    for got, part in ((got_whole, flat), (got_part, flat[::2, :20])):
        want = np.float32(math.fsum(part.ravel().tolist()))  # the exactly rounded sum
        assert abs(got.reshape(()) - want) <= np.spacing(want)


# --------------------------------------------------------------------------------------------
# CPY, GET_ROWS, SET_ROWS
# --------------------------------------------------------------------------------------------


def special_values(dtype):
    """Rounding cases for the float formats: exact halfway ties (to even), subnormals, overflow."""
    if dtype == "F16":
        return [1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 2**-25, 3 * 2**-25, 2**-24, 6e-8,
                65504.0, 65519.0, 65520.0, -1e6, 0.0, -0.0, 1e-12]
    if dtype == "BF16":
        return [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.0e38, 3.4e38, 1e-40, -0.0, 0.0]
    return []


@pytest.mark.parametrize("dtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_cpy_round_trip(dtype):
    rng = np.random.default_rng(9)
    rows, n = 5, 64
    x = (rng.standard_normal((rows, n)) * rng.uniform(0.01, 100, (rows, 1))).astype(np.float32)
    special = np.array(special_values(dtype), np.float32)
    x.reshape(-1)[: len(special)] = special
    x[3] = 0.0  # a zero block: scale 0, no division by zero
    g = core.Graph()
    tx = g.input("F32", [n, rows], "x")
    to = node(g, "CPY", dtype, [n, rows], [tx])
    back = node(g, "CPY", "F32", [n, rows], [to])
    got_raw, got_back = run(g, {tx: x}, [to, back])
    stored = encode(x, dtype)
    assert np.array_equal(got_raw.reshape(-1), raw_bytes(stored))
    assert np.array_equal(got_back.reshape(rows, n), decode(stored, dtype))


def test_cpy_from_strided_rows():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((6, 48)).astype(np.float32)
    g = core.Graph()
    tx = g.input("F32", [48, 6], "x")
    odd = g.view(tx, [32, 3], [4, 2 * 48 * 4], 48 * 4 + 16 * 4)  # rows 1, 3, 5, columns 16..47
    out = node(g, "CPY", "F16", [32, 3], [odd])
    (got,) = run(g, {tx: x}, [out])
    assert np.array_equal(got.reshape(-1), raw_bytes(x[1::2, 16:].astype(np.float16)))


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_get_rows(dtype):
    rng = np.random.default_rng(12)
    n_embd, n_vocab = 64, 12
    table = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
    stored = encode(table, dtype)
    ids = np.array([3, 0, 11, 3, 7], np.int32)  # repeats and any order
    g = core.Graph()
    tt = g.external(dtype, [n_embd, n_vocab], "table")
    ti = g.input("I32", [len(ids)], "ids")
    out = node(g, "GET_ROWS", "F32", [n_embd, len(ids)], [tt, ti])
    (got,) = run(g, {tt: stored, ti: ids}, [out])
    assert np.array_equal(got.reshape(len(ids), n_embd), decode(stored, dtype)[ids])


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16", "Q8_0"])
def test_set_rows_writes_external_matrix_in_place(dtype):
    rng = np.random.default_rng(13)
    n, n_cells = 64, 10
    dst = encode(rng.standard_normal((n_cells, n)), dtype)
    before = dst.copy()
    rows = rng.standard_normal((3, n)).astype(np.float32)
    ids = np.array([7, 2, 5], np.int32)
    g = core.Graph()
    td = g.external(dtype, [n, n_cells], "cache")
    tr = g.input("F32", [n, 3], "rows")
    ti = g.input("I32", [3], "ids")
    ts = g.set_rows(td, tr, ti)
    g.set_output(ts)
    run(g, {td: dst, tr: rows, ti: ids}, [])
    want = before.copy()
    want[ids] = encode(rows, dtype)
    assert np.array_equal(raw_bytes(dst), raw_bytes(want))
    untouched = np.setdiff1d(np.arange(n_cells), ids)
    assert np.array_equal(raw_bytes(dst[untouched]), raw_bytes(before[untouched]))


# --------------------------------------------------------------------------------------------
# MUL_MAT
# --------------------------------------------------------------------------------------------


def matmul_run(w_stored, dtype, x, n_rows, n_threads=1, backend="cpu"):
    m, k = x.shape
    g = core.Graph()
    tw = g.external(dtype, [k, n_rows], "w")
    tx = g.input("F32", [k, m], "x")
    out = node(g, "MUL_MAT", "F32", [n_rows, m], [tw, tx])
    (got,) = run(g, {tw: w_stored, tx: x}, [out], n_threads, backend)
    return got.reshape(m, n_rows)


def weight_blocks(stored, dtype, n_rows, k):
    """Parses ggml block bytes: per (row, block) the fp16 scale d, the offset m (Q4_1, else 0)
    and the 32 integer quants as they enter the dot product (Q4_0 quants minus 8)."""
    raw = np.ascontiguousarray(stored).view(np.uint8).reshape(n_rows, k // 32, -1)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    if dtype == "Q8_0":
        return d, np.zeros_like(d), raw[..., 2:].copy().view(np.int8).astype(np.int64)
    off = 4 if dtype == "Q4_1" else 2
    nib = raw[..., off:].astype(np.int64)
    q = np.concatenate([nib & 15, nib >> 4], axis=-1)
    if dtype == "Q4_0":
        return d, np.zeros_like(d), q - 8
    return d, raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64), q


def activation_blocks(x):
    """ggml's Q8_0 quantization of each activation row (the gguf package reproduces it bit for
    bit): fp16 scale, quants, the unrounded float32 scale, and Q8_1's s = fp16(d * sum(q))."""
    m, k = x.shape
    raw = gq.quantize(x, QT.Q8_0).reshape(m, k // 32, 34)
    d16 = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    q = raw[..., 2:].copy().view(np.int8).astype(np.int64)
    d32 = np.abs(x.reshape(m, k // 32, 32)).max(axis=-1) / np.float32(127.0)
    s16 = (q.sum(axis=-1).astype(np.float32) * d32).astype(np.float16).astype(np.float64)
    return d16, q, d32.astype(np.float64), s16


FLOAT_W = ["F32", "F16", "BF16"]
QUANT_W = ["Q8_0", "Q4_0", "Q4_1"]


@pytest.mark.parametrize("dtype", FLOAT_W + QUANT_W)
def test_mul_mat(dtype):
    rng = np.random.default_rng(14)
    n_rows, k, m = 40, 128, 5  # 40 weight rows: full 16-row panels plus a partial one
    w = rng.standard_normal((n_rows, k)).astype(np.float32)
    w[3] += 0.7  # a row with a large Q4_1 offset
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[1, :32] *= 1e-3  # blocks of very different scales
    x[2, 32:64] = 0.0  # a zero block: activation scale 0
    stored = encode(w, dtype)
    w_deq = decode(stored, dtype).astype(np.float64)
    got = matmul_run(stored, dtype, x, n_rows).astype(np.float64)
    x64 = x.astype(np.float64)
    exact = x64 @ w_deq.T
    magnitude = np.abs(x64) @ np.abs(w_deq).T
    if dtype in FLOAT_W:
        assert np.all(np.abs(got - exact) <= 2e-6 * magnitude + 1e-30)
        return
    # Tight: the products of the integer quants, as llama.cpp defines them for quantized weights.
    dw, mw, qw = weight_blocks(stored, dtype, n_rows, k)
    da, qa, d32, sa = activation_blocks(x)
    isum = np.einsum("nbj,mbj->mnb", qw, qa)
    terms = dw[None] * da[:, None] * isum + mw[None] * sa[:, None]
    emulated = terms.sum(axis=-1)
    assert np.all(np.abs(got - emulated) <= 2e-6 * np.abs(terms).sum(axis=-1) + 1e-30)
    # Loose: against the float64 product with unquantized activations, within the error that
    # 8-bit activations allow: |x - d16 q| <= d/2 + |q| |d - d16| per element (d16 is d to fp16),
    # and Q4_1's block sum s is rounded to fp16 (relative 2^-11) on top.
    act_err = np.repeat(d32 * (0.5 + 127 * 2.0**-11), 32, axis=-1)  # (m, k)
    w_abs = np.abs(dw[..., None] * qw).reshape(n_rows, k) + np.repeat(np.abs(mw), 32, axis=-1)
    s_err = (np.abs(mw)[None] * (np.abs(qa.sum(-1)) * d32)[:, None] * 2.0**-10).sum(-1)
    bound = act_err @ w_abs.T + s_err + 2e-6 * magnitude
    assert np.all(np.abs(got - exact) <= bound)
    # That worst case adds every rounding error with the same sign; rounding errors are uniform on
    # [-d/2, d/2] and independent, so with fixed seeds the error also stays within 6 sigma, a
    # tolerance small enough to catch a wrong activation scale.
    sigma = np.sqrt((np.repeat(d32, 32, axis=-1) ** 2 / 12) @ (w_deq**2).T)
    assert np.all(np.abs(got - exact) <= 6 * sigma + s_err + 2e-6 * magnitude)
    assert np.all(6 * sigma <= 0.05 * np.sqrt(np.mean(exact**2)))


@pytest.mark.parametrize("dtype", FLOAT_W + QUANT_W)
def test_mul_mat_rows_are_batch_and_thread_invariant(dtype):
    """Each activation row's result is the same bits alone, in a batch of 3 or 40 rows, and on
    one or two threads (40 x 256 values on two threads takes the shared-preparation path)."""
    rng = np.random.default_rng(15)
    n_rows, k = 40, 256
    stored = encode(rng.standard_normal((n_rows, k)), dtype)
    x = rng.standard_normal((40, k)).astype(np.float32)
    alone = np.concatenate([matmul_run(stored, dtype, x[i: i + 1], n_rows) for i in (0, 1, 2, 39)])
    small = matmul_run(stored, dtype, x[:3], n_rows)
    big1 = matmul_run(stored, dtype, x, n_rows, n_threads=1)
    big2 = matmul_run(stored, dtype, x, n_rows, n_threads=2)
    assert np.array_equal(small, alone[:3])
    assert np.array_equal(big1[[0, 1, 2, 39]], alone)
    assert np.array_equal(big1, big2)


@pytest.mark.parametrize("dtype", ["F16", "Q4_1"])
@pytest.mark.parametrize("m", [1, 3, 40])
def test_mul_mats_sharing_activations_run_as_one_group_with_their_own_bits(dtype, m):
    """Consecutive MUL_MATs of the same activations (q/k/v, gate/up) run as one group through
    the pool; each product keeps the bits it has alone, on one thread or two, with a member of
    another type or K ending the group and the odd row counts that leave partial panels."""
    rng = np.random.default_rng(16)
    k = 128
    shapes = [(40, dtype, k), (24, dtype, k), (17, dtype, k), (33, "F32", k)]
    ws = [encode(rng.standard_normal((n, kk)), dt) for n, dt, kk in shapes]
    x = rng.standard_normal((m, k)).astype(np.float32)
    alone = [matmul_run(w, dt, x, n) for w, (n, dt, _) in zip(ws, shapes)]
    for n_threads in (1, 2):
        g = core.Graph()
        tx = g.input("F32", [k, m], "x")
        feeds, outs = {tx: x}, []
        for i, (w, (n, dt, kk)) in enumerate(zip(ws, shapes)):
            tw = g.external(dt, [kk, n], f"w{i}")
            feeds[tw] = w
            outs.append(node(g, "MUL_MAT", "F32", [n, m], [tw, tx]))
        got = run(g, feeds, outs, n_threads)
        for i, (n, _, _) in enumerate(shapes):
            assert np.array_equal(got[i].reshape(m, n), alone[i]), (i, n_threads)


# --------------------------------------------------------------------------------------------
# graph-allocator.md §4.2 at compute level: multi-sequence top-k sampling chains
# --------------------------------------------------------------------------------------------

V, K, H = 64, 8, 32
TEMPS = [0.5, 0.8, 1.0, 1.7]


def chain_noise(step, seq, row):
    return np.random.default_rng([step, seq, row]).gumbel(size=K).astype(np.float32)


def add_sampling_chain(g, logits, col, temp, tag):
    """view of a logits row -> TOP_K -> GET_ROWS of those logits -> SCALE (1/T) -> SOFTMAX, and
    Gumbel-max over the candidates: ARGMAX(scaled logits + noise), an index into candidates."""
    as_vector = g.view(logits, [V], [4], col * V * 4)
    as_table = g.view(logits, [1, V], [4, 4], col * V * 4)  # V rows of one value: GET_ROWS picks values
    cand = node(g, "TOP_K", "I32", [K], [as_vector], [K], name=f"{tag}.candidates")
    picked = g.reshape(node(g, "GET_ROWS", "F32", [1, K], [as_table, cand], name=f"{tag}.picked"), [K])
    logit = node(g, "SCALE", "F32", [K], [picked], fparams=[1.0 / temp], name=f"{tag}.logits")
    probs = node(g, "SOFTMAX", "F32", [K], [logit], fparams=[1.0], name=f"{tag}.probs")
    noise = g.input("F32", [K], f"{tag}.noise")
    perturbed = node(g, "ADD", "F32", [K], [logit, noise], name=f"{tag}.perturbed")
    sampled = node(g, "ARGMAX", "I32", [1], [perturbed], name=f"{tag}.sampled")
    return noise, {"candidates": cand, "logits": logit, "probs": probs, "sampled": sampled}


def run_sampling(w_out, hidden, chains, active, flag_all, step):
    """hidden (n_cols, H). chains: [(seq, row, col)]. Runs one graph with a chain per entry; the
    outputs of the active sequence's chains are flagged, or every chain's when flag_all (the
    design's fix). Returns the logits and, per chain of the active sequence, its outputs."""
    g = core.Graph()
    tw = g.external("F32", [H, V], "output.weight")
    th = g.input("F32", [H, hidden.shape[0]], "hidden")
    logits = node(g, "MUL_MAT", "F32", [V, hidden.shape[0]], [tw, th], name="logits")
    feeds = {tw: w_out, th: hidden}
    fetch, keys = [logits], []
    for seq, row, col in chains:
        noise, outs = add_sampling_chain(g, logits, col, TEMPS[seq], f"s{seq}r{row}")
        feeds[noise] = chain_noise(step, seq, row)
        for t in outs.values():
            if flag_all or seq == active:
                g.set_output(t)
        if seq == active:
            keys.append((seq, row))
            fetch += list(outs.values())
    got = run(g, feeds, fetch)
    result = {}
    for i, key in enumerate(keys):
        c, lg, p, s = got[1 + 4 * i: 5 + 4 * i]
        result[key] = {"candidates": c.reshape(K), "logits": lg.reshape(K), "probs": p.reshape(K),
                       "sampled": int(s.reshape(()))}
    return got[0].reshape(hidden.shape[0], V), result


@pytest.mark.parametrize("flag_all", [True, False])
@pytest.mark.parametrize("topology", ["a", "b"])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("n_seq", [2, 4])
def test_sampling_chains_compute_like_chains_run_alone(n_seq, rows, topology, flag_all):
    """Topology a: a chain for every (seq, row). Topology b: the active sequence has a chain per
    row, every other sequence one chain on its row 0. Each step rebuilds the graph with another
    active sequence; every active row's outputs must equal the same chain run alone on a fresh
    graph, bit for bit, and numpy."""
    rng = np.random.default_rng(16)
    w_out = rng.standard_normal((V, H)).astype(np.float32)
    w_out[9], w_out[20] = w_out[5], w_out[3]  # tied logits in every row: top-k order by index
    alone_cache = {}
    sizes = set()
    ties_seen = 0
    for step, active in enumerate(a % n_seq for a in [0, 1, 0, 2, 1, 3, 2, 0]):
        hidden = np.random.default_rng([17, step]).standard_normal((n_seq * rows, H)).astype(np.float32)
        chains = [(s, r, s * rows + r) for s in range(n_seq)
                  for r in (range(rows) if topology == "a" or s == active else [0])]
        sizes.add(len(chains))
        logits, result = run_sampling(w_out, hidden, chains, active, flag_all, step)
        assert sorted(result) == [(active, r) for r in range(rows)]

        exact = hidden.astype(np.float64) @ w_out.astype(np.float64).T
        bound = 2e-6 * (np.abs(hidden.astype(np.float64)) @ np.abs(w_out.astype(np.float64)).T)
        assert np.all(np.abs(logits - exact) <= bound + 1e-30)

        for (seq, row), out in result.items():
            col = seq * rows + row
            key = (step, seq, row)
            if key not in alone_cache:
                alone_cache[key] = run_sampling(w_out, hidden[col: col + 1], [(seq, row, 0)], seq, False, step)[1][
                    (seq, row)]
            alone = alone_cache[key]
            for name in ("candidates", "logits", "probs"):
                assert np.array_equal(out[name], alone[name]), (step, seq, row, name)
            assert out["sampled"] == alone["sampled"]

            lrow = logits[col]
            cand = np.lexsort((np.arange(V), -lrow.astype(np.float64)))[:K]
            assert np.array_equal(out["candidates"], cand)
            ties_seen += int(np.any(lrow[cand][:-1] == lrow[cand][1:]))
            scaled = lrow[cand] * np.float32(1.0 / TEMPS[seq])
            assert np.array_equal(out["logits"], scaled)
            assert_softmax_close(out["probs"], scaled)
            assert out["sampled"] == int(np.argmax(scaled + chain_noise(step, seq, row)))
    assert len(sizes) == 1  # the node count is the same for every active sequence
    assert ties_seen > 0  # the tie order was exercised
