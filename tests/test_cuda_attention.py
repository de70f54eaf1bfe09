"""ATTENTION on the CUDA backend (issue 8): decode rows, batches, the drafter's block mask, long rows
split over pages and blocks, the staged, row-tiled and tensor-core kernels, compared with a numpy
reference and with the CPU, and a row's bits alone and in any batch (design.md invariant 7).
Shared pieces: tests/cuda_op_helpers.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import test_cpu_ops as cpu  # the CPU tests' helpers, references and op cases
from cuda_op_helpers import BATCHES, CACHE_TYPES, NEG_INF, dev_and_cpu, run_on
from cuda_status import CUDA_OK, DEVICE, gpu, real_gpu
from pyspec import _core as core


# --------------------------------------------------------------------------------------------
# ATTENTION
# --------------------------------------------------------------------------------------------

# F16 caches: the device may round Q to F16 and accumulate P.V in F16 pieces; F32 caches stay F32.
ATT_TOL = {"F16": dict(rtol=4e-3, atol=4e-3), "F32": dict(rtol=1e-4, atol=1e-5)}


def attention_both(q, k, v, mask, base, n_kv, scale, cache_dtype):
    got = cpu.attention_run(q, k, v, mask, base, n_kv, scale, cache_dtype, backend=DEVICE)
    ref = cpu.attention_run(q, k, v, mask, base, n_kv, scale, cache_dtype)
    return got, ref


def check_attention(q, k, v, mask, base, n_kv, scale, cache_dtype):
    got, ref = attention_both(q, k, v, mask, base, n_kv, scale, cache_dtype)
    want = cpu.attention_ref(q, k, v, mask, base, n_kv, np.float32(scale))
    np.testing.assert_allclose(got, want, **ATT_TOL[cache_dtype])
    np.testing.assert_allclose(got, ref, **ATT_TOL[cache_dtype])
    return got


def all_zero_layout():
    """The non-causal case at its plainest: an all-zero mask (every row sees its whole span), per-
    row bases in any order."""
    base = np.array([0, 7, 3, 20, 11], np.int32)
    return 48, np.zeros((len(base), 24), np.float32), base


@gpu
@pytest.mark.parametrize("cache_dtype", CACHE_TYPES)
@pytest.mark.parametrize("heads", cpu.HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
@pytest.mark.parametrize("pattern", cpu.LAYOUTS + ["all_zero"])
def test_attention_layouts(pattern, heads, cache_dtype):
    """The engine's batch patterns (causal, padded spans, the drafters' block mask, holes, several
    sequences with per-row bases), GQA, stale large values in cells no row may see."""
    n_head, n_kv, hd = heads
    rng = np.random.default_rng(len(pattern) * 100 + n_head * 10 + hd)
    n_cells, mask, base = all_zero_layout() if pattern == "all_zero" else cpu.layout(pattern)
    k, v = cpu.fill_caches(rng, n_cells, n_kv * hd, mask, base, cache_dtype)
    q = rng.standard_normal((mask.shape[0], n_head, hd)).astype(np.float32)
    check_attention(q, k, v, mask, base, n_kv, 1.0 / np.sqrt(hd), cache_dtype)


MODEL_HEADS = [(9, 3, 64), (32, 8, 128)]  # SmolLM2-135M, Qwen3-4B


@gpu
@pytest.mark.parametrize("kind", ["causal", "block"])
@pytest.mark.parametrize("cache_dtype", CACHE_TYPES)
@pytest.mark.parametrize("heads", MODEL_HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
@pytest.mark.parametrize("m", BATCHES)
def test_attention_batches(m, heads, cache_dtype, kind):
    """m new rows after 37 cells of context, the span padded to a multiple of 256 as the engine
    does: decode (m = 1), verify and draft blocks, prefill (m = 300)."""
    n_head, n_kv, hd = heads
    rng = np.random.default_rng(m * 1000 + hd + (kind == "block"))
    ctx, start = 37, 5
    span = (ctx + m + 255) // 256 * 256
    mask, base = cpu.seq_rows(start, ctx, m, span, block=kind == "block")
    n_cells = start + span + 3
    k, v = cpu.fill_caches(rng, n_cells, n_kv * hd, mask, base, cache_dtype)
    q = rng.standard_normal((m, n_head, hd)).astype(np.float32)
    check_attention(q, k, v, mask, base, n_kv, 1.0 / np.sqrt(hd), cache_dtype)


@gpu
@pytest.mark.parametrize("cache_dtype", CACHE_TYPES)
def test_attention_long_context_decode(cache_dtype):
    """One row over 3000 cells (span 3072): the split over the cells that decode kernels use."""
    n_head, n_kv, hd = 32, 8, 128
    rng = np.random.default_rng(3000)
    mask, base = cpu.seq_rows(0, 2999, 1, 3072)
    k, v = cpu.fill_caches(rng, 3072, n_kv * hd, mask, base, cache_dtype)
    q = (2 * rng.standard_normal((1, n_head, hd))).astype(np.float32)  # peaked scores
    check_attention(q, k, v, mask, base, n_kv, 1.0 / np.sqrt(hd), cache_dtype)


@gpu
@pytest.mark.parametrize("cache_dtype", CACHE_TYPES)
def test_attention_block_mask_differs_from_causal(cache_dtype):
    rng = np.random.default_rng(7)
    causal, base = cpu.seq_rows(0, 6, 5, span=11)
    block, _ = cpu.seq_rows(0, 6, 5, span=11, block=True)
    k, v = cpu.fill_caches(rng, 32, 64, block, base, cache_dtype)
    q = rng.standard_normal((5, 4, 32)).astype(np.float32)
    a = check_attention(q, k, v, causal, base, 2, 0.2, cache_dtype)
    b = check_attention(q, k, v, block, base, 2, 0.2, cache_dtype)
    assert np.abs(a[0] - b[0]).max() > 1e-2
    assert np.array_equal(a[-1], b[-1])


@gpu
@pytest.mark.parametrize("cache_dtype", CACHE_TYPES)
@pytest.mark.parametrize("seed", range(3))
def test_attention_row_is_batch_invariant(seed, cache_dtype):
    """A row's output bits do not depend on its neighbours, its place in the batch, the batch's
    size (1 .. 300) and span, or how far before its first cell its base points."""
    rng = np.random.default_rng(2000 + seed)
    n_head, n_kv, hd, n_cells = 8, 2, 64, 160
    dt = np.float16 if cache_dtype == "F16" else np.float32
    k = rng.standard_normal((n_cells, n_kv * hd)).astype(dt)
    v = rng.standard_normal((n_cells, n_kv * hd)).astype(dt)
    start, row_mask = cpu.random_row(rng)
    q_row = rng.standard_normal((1, n_head, hd)).astype(np.float32)
    alone = cpu.attention_run(q_row, k, v, row_mask[None], np.array([start]), n_kv, 0.125, cache_dtype,
                              backend=DEVICE)
    want = cpu.attention_ref(q_row, k, v, row_mask[None], np.array([start]), n_kv, np.float32(0.125))
    np.testing.assert_allclose(alone, want, **ATT_TOL[cache_dtype])
    for n_rows in BATCHES[1:]:
        q, mask, base, at = cpu.batch_around_row(rng, n_rows, start, row_mask, q_row, n_cells)
        got = cpu.attention_run(q, k, v, mask, base, n_kv, 0.125, cache_dtype, backend=DEVICE)
        assert np.array_equal(got[at], alone[0]), (n_rows, at)


@real_gpu
@pytest.mark.parametrize("heads", MODEL_HEADS + [(4, 4, 64), (16, 2, 128)],
                         ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
@pytest.mark.parametrize("seed", range(3))
def test_row_tiled_attention_gives_the_per_row_kernels_bits(monkeypatch, heads, seed):
    """The row-tiled kernel (cuda/ops_attention_tiled.cu: a kv head's query heads over a tile
    of rows per block, K/V staged once) gives every row exactly the bits of the per-row kernel:
    random bases, spans, masks and batch sizes (1 .. 300 rows, the tile's rows reaching chunks
    outside each other's spans), and a row alone. PYSPEC_CUDA_ATT_TILED=0: the per-row kernel."""
    n_head, n_kv, hd = heads
    rng = np.random.default_rng(4000 + seed * 7 + hd)
    n_cells = 400
    k = rng.standard_normal((n_cells, n_kv * hd)).astype(np.float16)
    v = rng.standard_normal((n_cells, n_kv * hd)).astype(np.float16)
    start, row_mask = cpu.random_row(rng)
    q_row = rng.standard_normal((1, n_head, hd)).astype(np.float32)
    monkeypatch.setenv("PYSPEC_CUDA_ATT_TILED", "0")
    alone = cpu.attention_run(q_row, k, v, row_mask[None], np.array([start]), n_kv, 0.125, "F16",
                              backend=DEVICE)
    for n_rows in (2, 3, 8, 33, 300):
        q, mask, base, at = cpu.batch_around_row(rng, n_rows, start, row_mask, q_row, n_cells)
        # spread the rows over the cache so tiles reach chunks far from some rows' spans
        base = np.where(np.arange(n_rows) == at, base,
                        rng.integers(0, n_cells - mask.shape[1], n_rows)).astype(np.int32)
        monkeypatch.setenv("PYSPEC_CUDA_ATT_TILED", "0")
        per_row = cpu.attention_run(q, k, v, mask, base, n_kv, 0.125, "F16", backend=DEVICE)
        monkeypatch.setenv("PYSPEC_CUDA_ATT_TILED", "1")
        tiled = cpu.attention_run(q, k, v, mask, base, n_kv, 0.125, "F16", backend=DEVICE)
        np.testing.assert_array_equal(tiled, per_row)
        np.testing.assert_array_equal(tiled[at], alone[0])


@real_gpu
@pytest.mark.parametrize("heads", MODEL_HEADS + [(4, 4, 64), (16, 2, 128), (6, 3, 40)],
                         ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
@pytest.mark.parametrize("seed", range(3))
def test_staged_attention_gives_the_unstaged_kernels_bits(monkeypatch, heads, seed):
    """The staged kernel (cuda/ops_attention_staged.cu: each warp's chunk of K/V copied into
    shared memory by cp.async, the next page's copies in flight during this one's arithmetic; a
    single row over more than two pages split over blocks, a page each, combined by the last)
    gives every row exactly the bits of the per-row kernel it replaces, and of the row-tiled
    kernel when the row shares a batch: single rows at random bases, spans and masks over a cache
    of several pages (walked by one block up to two pages, split beyond), and batches through the
    per-row path. PYSPEC_CUDA_ATT_STAGED=0: the unstaged kernel."""
    n_head, n_kv, hd = heads
    rng = np.random.default_rng(7000 + seed * 11 + hd)
    n_cells = 1500
    k = rng.standard_normal((n_cells, n_kv * hd)).astype(np.float16)
    v = rng.standard_normal((n_cells, n_kv * hd)).astype(np.float16)
    monkeypatch.setenv("PYSPEC_CUDA_ATT_TILED", "0")
    for span in (1, 31, 100, 700, 1200):
        start = int(rng.integers(0, n_cells - span - 8 + 1))  # room for a batch's padding
        mask = np.zeros((1, span), np.float32)
        mask[0, rng.random(span) < 0.2] = -np.inf
        mask[0, 0] = 0.0
        q = rng.standard_normal((1, n_head, hd)).astype(np.float32)
        monkeypatch.setenv("PYSPEC_CUDA_ATT_STAGED", "0")
        plain = cpu.attention_run(q, k, v, mask, np.array([start], np.int32), n_kv, 0.125, "F16", backend=DEVICE)
        monkeypatch.setenv("PYSPEC_CUDA_ATT_STAGED", "1")
        staged = cpu.attention_run(q, k, v, mask, np.array([start], np.int32), n_kv, 0.125, "F16", backend=DEVICE)
        np.testing.assert_array_equal(staged, plain, err_msg=f"span {span} at {start}")
        want = cpu.attention_ref(q, k, v, mask, np.array([start]), n_kv, np.float32(0.125))
        np.testing.assert_allclose(staged, want, **ATT_TOL["F16"])
        # the same row among others: the row-tiled kernel walks its pages in one block
        q3, mask3, base3, at = cpu.batch_around_row(rng, 3, start, mask[0], q, n_cells)
        monkeypatch.setenv("PYSPEC_CUDA_ATT_TILED", "1")
        tiled = cpu.attention_run(q3, k, v, mask3, base3, n_kv, 0.125, "F16", backend=DEVICE)
        monkeypatch.setenv("PYSPEC_CUDA_ATT_TILED", "0")
        np.testing.assert_array_equal(tiled[at], staged[0], err_msg=f"span {span} at {start}, in a batch")
    start, row_mask = cpu.random_row(rng)
    q_row = rng.standard_normal((1, n_head, hd)).astype(np.float32)
    for n_rows in (3, 40):
        q, mask, base, at = cpu.batch_around_row(rng, n_rows, start, row_mask, q_row, n_cells)
        monkeypatch.setenv("PYSPEC_CUDA_ATT_STAGED", "0")
        plain = cpu.attention_run(q, k, v, mask, base, n_kv, 0.125, "F16", backend=DEVICE)
        monkeypatch.setenv("PYSPEC_CUDA_ATT_STAGED", "1")
        staged = cpu.attention_run(q, k, v, mask, base, n_kv, 0.125, "F16", backend=DEVICE)
        np.testing.assert_array_equal(staged, plain)


# Prompt rows (ATTENTION's first iparams[1] rows, those that want no logits) take the tensor cores
# on the GPU (cuda/ops_attention_tc.cu; F16 cache, head_dim 32/64/128): the models' heads, 2 and 1
# query heads per kv head (32- and 64-row tiles), 6 and 8 (two blocks of heads per kv head).
PROMPT_HEADS = MODEL_HEADS + [(4, 2, 64), (4, 4, 32), (12, 2, 64), (8, 1, 128)]
TC_HEAD_DIMS = (32, 64, 128)


def bits(a):
    """The float32 bit patterns: equal bits rather than equal values (+0 and -0 differ)."""
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def prompt_attention(q, k, v, mask, base, n_kv, prompt_rows, scale):
    return cpu.attention_run(q, k, v, mask, base, n_kv, scale, "F16", backend=DEVICE, prompt_rows=prompt_rows)


def padded_row(mask_row, lead, pad):
    """A mask row with `lead` masked cells before it (its base that much earlier) and `pad` after."""
    return np.concatenate([np.full(lead, NEG_INF, np.float32), mask_row, np.full(pad, NEG_INF, np.float32)])


@gpu
@pytest.mark.parametrize("heads", PROMPT_HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
def test_prompt_rows_attention_is_each_rows_own(monkeypatch, heads):
    """A prompt row's attention is a function of its own q, its own cells and its own mask row, bit
    for bit: the same alone, inside a causal 512-row chunk, with its base moved earlier and its span
    padded, in tiles shared with another sequence's rows (another base, the rows shuffled, a fully
    masked row among them), and with output rows after the prompt rows. Close to the CPU and to
    float64 at F16 accuracy (the GPU rounds q and the weights to F16)."""
    monkeypatch.delenv("PYSPEC_CUDA_TC", raising=False)  # prompt rows on their own path (the default)
    monkeypatch.delenv("PYSPEC_CUDA_ATT_TC", raising=False)
    n_head, n_kv, hd = heads
    rng = np.random.default_rng(9000 + n_head * 10 + hd)
    n_cells = 1700
    k = rng.standard_normal((n_cells, n_kv * hd)).astype(np.float16)
    v = rng.standard_normal((n_cells, n_kv * hd)).astype(np.float16)
    scale = float(1.0 / np.sqrt(hd))
    # Sequence A: a causal chunk of 512 rows after 37 cells of context, its cells from cell 3.
    ctx_a, n_a, start_a = 37, 512, 3
    span = (ctx_a + n_a + 255) // 256 * 256
    mask_a, base_a = cpu.seq_rows(start_a, ctx_a, n_a, span)
    q_a = rng.standard_normal((n_a, n_head, hd)).astype(np.float32)
    chunk = prompt_attention(q_a, k, v, mask_a, base_a, n_kv, n_a, scale)
    np.testing.assert_allclose(chunk, cpu.attention_run(q_a, k, v, mask_a, base_a, n_kv, scale, "F16"),
                               **ATT_TOL["F16"])
    some = [0, 1, 15, 16, 17, 63, 64, 200, 511]
    want = cpu.attention_ref(q_a[some], k, v, mask_a[some], base_a[some], n_kv, np.float32(scale))
    np.testing.assert_allclose(chunk[some], want, **ATT_TOL["F16"])

    def alone(q_row, mask_row, b, lead=0, pad=0):
        m = padded_row(mask_row, lead, pad)[None]
        return prompt_attention(q_row[None], k, v, m, np.array([b - lead], np.int32), n_kv, 1, scale)[0]

    for at in some:
        np.testing.assert_array_equal(bits(alone(q_a[at], mask_a[at], base_a[at])), bits(chunk[at]),
                                      err_msg=f"row {at} alone")
    for at in (5, 300):  # base 0 (3 masked cells first), 100 more cells of padding
        np.testing.assert_array_equal(bits(alone(q_a[at], mask_a[at], base_a[at], lead=3, pad=100)),
                                      bits(chunk[at]), err_msg=f"row {at} padded")

    # Sequence B: 30 rows after 20 cells of context, its cells from cell 900. A batch of A's rows
    # 40..59, B's rows and a fully masked row, shuffled: the tiles straddle the two sequences.
    mask_b, base_b = cpu.seq_rows(900, 20, 30, span)
    q_b = rng.standard_normal((30, n_head, hd)).astype(np.float32)
    b_alone = np.stack([alone(q_b[i], mask_b[i], base_b[i]) for i in range(30)])
    q_m = np.concatenate([q_a[40:60], q_b, rng.standard_normal((1, n_head, hd)).astype(np.float32)])
    mask_m = np.concatenate([mask_a[40:60], mask_b, np.full((1, span), NEG_INF, np.float32)])
    base_m = np.concatenate([base_a[40:60], base_b, [500]]).astype(np.int32)
    want_m = np.concatenate([chunk[40:60], b_alone, np.zeros((1, n_head, hd), np.float32)])
    perm = rng.permutation(len(q_m))
    n_p = len(q_m)
    mixed = prompt_attention(q_m[perm], k, v, mask_m[perm], base_m[perm], n_kv, n_p, scale)
    np.testing.assert_array_equal(bits(mixed), bits(want_m[perm]), err_msg="two sequences in a batch")
    # The same prompt rows with 7 output rows after them (other rows of A, for the CUDA cores).
    outs = rng.choice(np.arange(100, 512), 7, replace=False)
    q_o = np.concatenate([q_m[perm], q_a[outs]])
    mask_o = np.concatenate([mask_m[perm], mask_a[outs]])
    base_o = np.concatenate([base_m[perm], base_a[outs]]).astype(np.int32)
    with_outputs = prompt_attention(q_o, k, v, mask_o, base_o, n_kv, n_p, scale)
    np.testing.assert_array_equal(bits(with_outputs[:n_p]), bits(want_m[perm]), err_msg="with output rows after")
    np.testing.assert_allclose(with_outputs[n_p:], chunk[outs], **ATT_TOL["F16"])


@gpu
@pytest.mark.parametrize("n_out", [1, 5])
@pytest.mark.parametrize("heads", PROMPT_HEADS + [(8, 1, 48)], ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
def test_output_rows_keep_their_bits_beside_prompt_rows(monkeypatch, heads, n_out):
    """Output rows (r >= prompt_rows) keep exactly the bits the CUDA-core kernels give them: with
    prompt rows before them, without (prompt_rows = 0), alone, and with the prompt rows' tensor cores
    off (PYSPEC_CUDA_ATT_TC=0); one output row (the staged kernel, its 1000 cells split over pages)
    or several (the row-tiled kernel). The prompt rows take the other path on a GPU where the head
    dim has one (32, 64, 128; 48 stays on the CUDA cores), close to it."""
    monkeypatch.delenv("PYSPEC_CUDA_TC", raising=False)
    monkeypatch.delenv("PYSPEC_CUDA_ATT_TC", raising=False)
    n_head, n_kv, hd = heads
    rng = np.random.default_rng(9500 + n_head * 10 + hd + n_out)
    n_cells = 1400
    k = rng.standard_normal((n_cells, n_kv * hd)).astype(np.float16)
    v = rng.standard_normal((n_cells, n_kv * hd)).astype(np.float16)
    ctx, n_p = 1000, 40  # a prompt chunk at the end of 1000 cells of context, then the output rows
    span = (ctx + n_p + n_out + 255) // 256 * 256
    mask, base = cpu.seq_rows(0, ctx, n_p + n_out, span)
    q = rng.standard_normal((n_p + n_out, n_head, hd)).astype(np.float32)
    with_prompt = prompt_attention(q, k, v, mask, base, n_kv, n_p, 0.125)
    plain = prompt_attention(q, k, v, mask, base, n_kv, 0, 0.125)
    outputs_alone = prompt_attention(q[n_p:], k, v, mask[n_p:], base[n_p:], n_kv, 0, 0.125)
    monkeypatch.setenv("PYSPEC_CUDA_ATT_TC", "0")
    off = prompt_attention(q, k, v, mask, base, n_kv, n_p, 0.125)
    monkeypatch.delenv("PYSPEC_CUDA_ATT_TC")
    for name, other in (("no prompt rows", plain[n_p:]), ("alone", outputs_alone), ("tensor cores off", off[n_p:])):
        np.testing.assert_array_equal(bits(with_prompt[n_p:]), bits(other), err_msg=name)
    np.testing.assert_array_equal(bits(off), bits(plain))
    np.testing.assert_allclose(with_prompt[:n_p], plain[:n_p], **ATT_TOL["F16"])
    if DEVICE != "cuda" or hd not in TC_HEAD_DIMS:
        np.testing.assert_array_equal(bits(with_prompt), bits(plain))
    elif CUDA_OK:
        assert not np.array_equal(with_prompt[:n_p], plain[:n_p]), "prompt rows took the output rows' path"


@gpu
@pytest.mark.parametrize("hd", TC_HEAD_DIMS)
def test_prompt_row_outside_the_cache_is_an_error(monkeypatch, hd):
    """A prompt row whose span leaves the cache is refused as any row is (the device's error bit,
    the CPU's exception), whatever rows share its batch."""
    monkeypatch.delenv("PYSPEC_CUDA_TC", raising=False)
    monkeypatch.delenv("PYSPEC_CUDA_ATT_TC", raising=False)
    rng = np.random.default_rng(hd)
    n_head, n_kv, n_cells = 8, 2, 100
    k = rng.standard_normal((n_cells, n_kv * hd)).astype(np.float16)
    v = rng.standard_normal((n_cells, n_kv * hd)).astype(np.float16)
    mask = np.zeros((3, 64), np.float32)
    q = rng.standard_normal((3, n_head, hd)).astype(np.float32)
    with pytest.raises(RuntimeError, match="span outside the cache"):
        prompt_attention(q, k, v, mask, np.array([0, 50, 10], np.int32), n_kv, 3, 0.125)


@gpu
@pytest.mark.parametrize("cache_dtype", CACHE_TYPES)
def test_set_rows_then_attention_reads_the_new_cells(cache_dtype):
    """A decode step on layer 1 of a cache stacking 3 layers: SET_ROWS through the layer's view,
    ATTENTION consuming the SET_ROWS nodes sees the new rows; only layer 1's cells change."""
    rng = np.random.default_rng(11)
    n_head, n_kv, hd, n_cells, n_new, n_layers, layer = 4, 2, 32, 24, 3, 3, 1
    width = n_kv * hd
    dt, es = (np.float16, 2) if cache_dtype == "F16" else (np.float32, 4)
    k_all = rng.standard_normal((n_layers * n_cells, width)).astype(dt)
    v_all = rng.standard_normal((n_layers * n_cells, width)).astype(dt)
    k_new = rng.standard_normal((n_new, width)).astype(np.float32)
    v_new = rng.standard_normal((n_new, width)).astype(np.float32)
    cells = np.array([9, 10, 11], np.int32)
    mask, base = cpu.seq_rows(0, 9, n_new, span=16)
    q = rng.standard_normal((n_new, n_head, hd)).astype(np.float32)
    k_want, v_want = k_all.copy(), v_all.copy()
    k_want[layer * n_cells + cells] = k_new.astype(dt)
    v_want[layer * n_cells + cells] = v_new.astype(dt)
    rows = slice(layer * n_cells, (layer + 1) * n_cells)
    want = cpu.attention_ref(q, k_want[rows], v_want[rows], mask, base, n_kv, np.float32(0.25))

    def build():
        g = core.Graph()
        tq = g.input("F32", [hd, n_head, n_new], "q")
        tkn = g.input("F32", [width, n_new], "k_new")
        tvn = g.input("F32", [width, n_new], "v_new")
        tids = g.input("I32", [n_new], "cells")
        tk = g.external(cache_dtype, [width, n_layers * n_cells], "k_cache")
        tv = g.external(cache_dtype, [width, n_layers * n_cells], "v_cache")
        tm = g.input("F32", [16, n_new], "mask")
        tb = g.input("I32", [n_new], "kv_base")
        offset = layer * n_cells * width * es
        k_layer = g.view(tk, [width, n_cells], [es, width * es], offset)
        v_layer = g.view(tv, [width, n_cells], [es, width * es], offset)
        ks = g.set_rows(k_layer, tkn, tids)
        vs = g.set_rows(v_layer, tvn, tids)
        out = cpu.node(g, "ATTENTION", "F32", [hd, n_head, n_new], [tq, ks, vs, tm, tb], [n_kv], [0.25])
        feeds = {tq: q, tkn: k_new, tvn: v_new, tids: cells, tk: k_all, tv: v_all, tm: mask, tb: base}
        return g, feeds, [out, ks, vs]

    (got, ks, vs), (ref, _, _) = dev_and_cpu(build)
    np.testing.assert_allclose(got.reshape(n_new, n_head, hd), want, **ATT_TOL[cache_dtype])
    np.testing.assert_allclose(got, ref, **ATT_TOL[cache_dtype])
    assert np.array_equal(ks.reshape(-1).view(np.uint8), cpu.raw_bytes(k_want[rows]))
    assert np.array_equal(vs.reshape(-1).view(np.uint8), cpu.raw_bytes(v_want[rows]))


@gpu
@pytest.mark.parametrize("mode", [0, 2], ids=["normal", "neox"])
@pytest.mark.parametrize("cache_dtype", CACHE_TYPES)
def test_rope_and_kv_store_as_one_launch(cache_dtype, mode, monkeypatch):
    """q/k ROPE then the K/V SET_ROWS of the rotated k and of v (a decoder layer's order) run as
    one launch: the rotated q and k, and both caches, are the bits of the four nodes run apart
    (PYSPEC_CUDA_FUSE=0); an out-of-range cell is reported either way."""
    rng = np.random.default_rng(21 + mode)
    hd, n_q, n_kv, n_new, n_cells = 64, 6, 2, 5, 40
    width = hd * n_kv
    q = rng.standard_normal((n_new, n_q, hd)).astype(np.float32)
    k = rng.standard_normal((n_new, n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((n_new, width)).astype(np.float32)
    pos = np.array([3, 4, 5, 900, 901], np.int32)
    k_all = cpu.encode(rng.standard_normal((n_cells, width)), cache_dtype)
    v_all = cpu.encode(rng.standard_normal((n_cells, width)), cache_dtype)

    def build_for(cells):
        def build():
            g = core.Graph()
            tq = g.input("F32", [hd, n_q, n_new], "q")
            tk = g.input("F32", [hd, n_kv, n_new], "k")
            tv = g.input("F32", [width, n_new], "v")
            tp = g.input("I32", [n_new], "pos")
            tc = g.input("I32", [n_new], "cells")
            rq = cpu.node(g, "ROPE", "F32", [hd, n_q, n_new], [tq, tp], [hd, mode], [10000.0, 1.0])
            rk = cpu.node(g, "ROPE", "F32", [hd, n_kv, n_new], [tk, tp], [hd, mode], [10000.0, 1.0])
            kc = g.external(cache_dtype, [width, n_cells], "k_cache")
            vc = g.external(cache_dtype, [width, n_cells], "v_cache")
            ks = g.set_rows(kc, g.reshape(rk, [width, n_new]), tc)
            vs = g.set_rows(vc, tv, tc)
            feeds = {tq: q, tk: k, tv: v, tp: pos, tc: cells, kc: k_all, vc: v_all}
            return g, feeds, [rq, rk, ks, vs]
        return build

    cells = np.array([7, 8, 9, 30, 2], np.int32)
    out = {}
    for fuse in ("1", "0"):
        monkeypatch.setenv("PYSPEC_CUDA_FUSE", fuse)
        out[fuse] = run_on(DEVICE, build_for(cells))
    for a, b, what in zip(out["1"], out["0"], ("q", "k", "k cache", "v cache")):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)), what
    k_cache = np.asarray(out["1"][2]).reshape(-1).view(np.uint8)
    want = k_all.copy()
    want[cells] = cpu.encode(np.asarray(out["1"][1]).reshape(n_new, width), cache_dtype)
    assert np.array_equal(k_cache, cpu.raw_bytes(want))
    want = v_all.copy()
    want[cells] = cpu.encode(v, cache_dtype)
    assert np.array_equal(np.asarray(out["1"][3]).reshape(-1).view(np.uint8), cpu.raw_bytes(want))
    bad = cells.copy()
    bad[3] = n_cells
    for fuse in ("1", "0"):
        monkeypatch.setenv("PYSPEC_CUDA_FUSE", fuse)
        with pytest.raises(RuntimeError, match="out of range"):
            run_on(DEVICE, build_for(bad))


ROPE_ATTENTION_CASES = ["short", "middle", "long", "neox_half", "factors", "q_kept", "qk_norm", "cache_written"]


@real_gpu
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128), (6, 3, 40)], ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
@pytest.mark.parametrize("case", ROPE_ATTENTION_CASES)
@pytest.mark.parametrize("early", ["1", "0", "nocopy"], ids=["", "noearly", "nocopy"])
def test_decode_rope_store_attention_as_one_launch(monkeypatch, heads, case, early):
    """A decode row's q/k ROPE, K/V SET_ROWS and ATTENTION (a decoder layer's order) run as one
    launch of the staged attention kernel (cuda::DecodeRope): the attention's output, the rotated q
    and k and both caches are the bits of the nodes run apart (PYSPEC_CUDA_ATT_ROPE=0), the launch
    counter says which way each ran, and an out-of-range cell is reported either way. Cases: a short
    row with the new cell last; the new cell in the middle of the span; a row long enough to be
    split over blocks (the register-K variant for 128-wide heads); neox with half the dims rotated
    (the unrotated tail); frequency factors; q's input fetched too; per-head q/k RMS_NORMs before the
    ROPEs (Qwen3's), which the launch runs too; another SET_ROWS into the K cache earlier in the
    graph (a cell the row reads), which must keep the first page's copies after the PDL wait.
    Masked cells hold NaN in both caches. Each case with the early reads (the default: the mask
    read and the first page's cache cells copied before the PDL wait, masked cells not copied, the
    prologue's inputs read in one round, and the next kernel let in before the wait), with them but
    the copies and the next kernel's start after the wait (PYSPEC_CUDA_ATT_EARLY_COPY=0,
    PYSPEC_CUDA_ATT_LET_IN_FIRST=0), and without them (PYSPEC_CUDA_ATT_EARLY=0); the counter
    early_copy_attention_launches says whether the copies went out early."""
    monkeypatch.setenv("PYSPEC_CUDA_ATT_EARLY", "0" if early == "0" else "1")
    monkeypatch.setenv("PYSPEC_CUDA_ATT_EARLY_COPY", "0" if early == "nocopy" else "1")
    monkeypatch.setenv("PYSPEC_CUDA_ATT_LET_IN_FIRST", "0" if early == "nocopy" else "1")
    if any(os.environ.get(v) == "0" for v in ("PYSPEC_CUDA_FUSE", "PYSPEC_CUDA_ATT_STAGED", "PYSPEC_CUDA_ATT_ROPE")):
        pytest.skip("the launch is off (PYSPEC_CUDA_FUSE, PYSPEC_CUDA_ATT_STAGED or PYSPEC_CUDA_ATT_ROPE is 0)")
    n_q, n_kv, hd = heads
    rng = np.random.default_rng(100 * ROPE_ATTENTION_CASES.index(case) + hd)
    n_cells = 1300
    mode = 2 if case == "neox_half" else 0
    n_rot = hd // 2 if case == "neox_half" else hd
    span = {"long": 1100}.get(case, 70)
    kv_base = 5
    new_cell = kv_base + (span // 2 if case == "middle" else span - 1)
    width = hd * n_kv
    q = rng.standard_normal((1, n_q, hd)).astype(np.float32)
    k = rng.standard_normal((1, n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((1, width)).astype(np.float32)
    pos = np.array([span + 3], np.int32)
    factors = (1.0 + rng.random(n_rot // 2)).astype(np.float32)
    norm_w = (0.5 + rng.random((2, hd))).astype(np.float32)
    k_all = cpu.encode(rng.standard_normal((n_cells, width)), "F16")
    v_all = cpu.encode(rng.standard_normal((n_cells, width)), "F16")
    mask = np.zeros((1, span), np.float32)
    mask[0, rng.random(span) < 0.1] = NEG_INF
    mask[0, new_cell - kv_base] = 0.0
    written_cell = kv_base + 1  # "cache_written": the cell the earlier SET_ROWS writes, visible
    mask[0, written_cell - kv_base] = 0.0
    written_row = rng.standard_normal((1, width)).astype(np.float32)
    # Masked cells hold NaN: they must not reach the output (the launch does not even copy them).
    masked = kv_base + np.flatnonzero(mask[0] == NEG_INF)
    k_all[masked] = cpu.encode(np.full((masked.size, width), np.nan), "F16")
    v_all[masked] = cpu.encode(np.full((masked.size, width), np.nan), "F16")

    def build_for(cells):
        def build():
            g = core.Graph()
            tq = g.input("F32", [hd, n_q, 1], "q")
            tk = g.input("F32", [hd, n_kv, 1], "k")
            tv = g.input("F32", [width, 1], "v")
            tp = g.input("I32", [1], "pos")
            tc = g.input("I32", [1], "cells")
            tm = g.input("F32", [span, 1], "mask")
            tb = g.input("I32", [1], "kv_base")
            kc = g.external("F16", [width, n_cells], "k_cache")
            vc = g.external("F16", [width, n_cells], "v_cache")
            extra = []
            if case == "cache_written":
                tw, tcw = g.input("F32", [width, 1], "written_row"), g.input("I32", [1], "written_cell")
                extra = [g.set_rows(kc, tw, tcw)]
            srcs = [tp]
            if case == "factors":
                srcs.append(g.input("F32", [n_rot // 2], "factors"))
            xq, xk = tq, tk
            if case == "qk_norm":
                twq, twk = g.input("F32", [hd], "q_norm"), g.input("F32", [hd], "k_norm")
                xq = cpu.node(g, "RMS_NORM", "F32", [hd, n_q, 1], [tq, twq], [], [1e-6])
                xk = cpu.node(g, "RMS_NORM", "F32", [hd, n_kv, 1], [tk, twk], [], [1e-6])
            rq = cpu.node(g, "ROPE", "F32", [hd, n_q, 1], [xq] + srcs, [n_rot, mode], [10000.0, 1.0])
            rk = cpu.node(g, "ROPE", "F32", [hd, n_kv, 1], [xk] + srcs, [n_rot, mode], [10000.0, 1.0])
            ks = g.set_rows(kc, g.reshape(rk, [width, 1]), tc)
            vs = g.set_rows(vc, tv, tc)
            att = cpu.node(g, "ATTENTION", "F32", [hd, n_q, 1], [rq, ks, vs, tm, tb], [n_kv], [hd ** -0.5])
            feeds = {tq: q, tk: k, tv: v, tp: pos, tc: cells, tm: mask, tb: np.array([kv_base], np.int32),
                     kc: k_all, vc: v_all}
            if case == "factors":
                feeds[srcs[1]] = factors
            if case == "qk_norm":
                feeds[twq], feeds[twk] = norm_w
            if extra:
                feeds[tw], feeds[tcw] = written_row, np.array([written_cell], np.int32)
            return g, feeds, [att, rq, rk, ks, vs] + ([tq] if case == "q_kept" else []) + extra
        return build

    cells = np.array([new_cell], np.int32)
    out, launches, copies = {}, {}, {}
    for fused in ("1", "0"):
        monkeypatch.setenv("PYSPEC_CUDA_ATT_ROPE", fused)
        core.reset_cuda_graph_stats()
        out[fused] = run_on(DEVICE, build_for(cells))
        launches[fused] = core.cuda_graph_stats()["rope_attention_launches"]
        copies[fused] = core.cuda_graph_stats()["early_copy_attention_launches"]
    assert launches["1"] > 0 and launches["0"] == 0, launches
    assert (copies["1"] > 0) == (early == "1" and case != "cache_written") and copies["0"] == 0, copies
    for a, b, what in zip(out["1"], out["0"], ("attention", "q", "k", "k cache", "v cache")):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)), what
    # And against the CPU, whose angles may differ from the device's in the last bit (so may the
    # rotated values, and the F16 cache rows one rounding step); V is only converted.
    ref = run_on("cpu", build_for(cells))
    for a, b, what in zip(out["1"][:5], ref[:5], ("attention", "q", "k", "k cache", "v cache")):
        if what.endswith("cache"):
            a, b = (np.asarray(x).reshape(-1).view(np.float16).astype(np.float32) for x in (a, b))
        tol = dict(rtol=0, atol=0) if what == "v cache" else ATT_TOL["F16"]
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), err_msg=what, **tol)
    bad = np.array([n_cells], np.int32)
    for fused in ("1", "0"):
        monkeypatch.setenv("PYSPEC_CUDA_ATT_ROPE", fused)
        with pytest.raises(RuntimeError, match="out of range"):
            run_on(DEVICE, build_for(bad))


@real_gpu
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128)], ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
def test_decode_attentions_of_a_step_share_its_angles(monkeypatch, heads):
    """The fused decode attentions of one compute with the same positions and frequencies compute
    the RoPE angles once: the first launch stores them (cuda::DecodeRope::angles) and the later ones
    read them (stored_angles_attention_launches counts those). Four layers: the first two over the
    same positions, the third with frequency factors (its own angles, which it stores), the fourth
    like the first two again (it must compute them again: the table now holds the third's). Every
    output and cache is the bits of the table off (PYSPEC_CUDA_ATT_ANGLES=0) and of the nodes run
    apart (PYSPEC_CUDA_ATT_ROPE=0), and a second graph at other positions (a new compute) gets its
    own angles, not the first one's."""
    if any(os.environ.get(v) == "0" for v in ("PYSPEC_CUDA_FUSE", "PYSPEC_CUDA_ATT_STAGED", "PYSPEC_CUDA_ATT_ROPE")):
        pytest.skip("the launch is off (PYSPEC_CUDA_FUSE, PYSPEC_CUDA_ATT_STAGED or PYSPEC_CUDA_ATT_ROPE is 0)")
    n_q, n_kv, hd = heads
    rng = np.random.default_rng(7 + hd)
    n_cells, span, kv_base, n_layers = 300, 40, 3, 4
    width = hd * n_kv
    new_cell = kv_base + span - 1
    mask = np.zeros((1, span), np.float32)
    factors = (1.0 + rng.random(hd // 2)).astype(np.float32)
    layers = [dict(q=rng.standard_normal((1, n_q, hd)).astype(np.float32),
                   k=rng.standard_normal((1, n_kv, hd)).astype(np.float32),
                   v=rng.standard_normal((1, width)).astype(np.float32),
                   k_all=cpu.encode(rng.standard_normal((n_cells, width)), "F16"),
                   v_all=cpu.encode(rng.standard_normal((n_cells, width)), "F16")) for _ in range(n_layers)]

    def build_at(position):
        def build():
            g = core.Graph()
            tp = g.input("I32", [1], "pos")
            tc = g.input("I32", [1], "cells")
            tm = g.input("F32", [span, 1], "mask")
            tb = g.input("I32", [1], "kv_base")
            tf = g.input("F32", [hd // 2], "factors")
            feeds = {tp: np.array([position], np.int32), tc: np.array([new_cell], np.int32), tm: mask,
                     tb: np.array([kv_base], np.int32), tf: factors}
            fetch = []
            for i, layer in enumerate(layers):
                tq = g.input("F32", [hd, n_q, 1], f"q{i}")
                tk = g.input("F32", [hd, n_kv, 1], f"k{i}")
                tv = g.input("F32", [width, 1], f"v{i}")
                kc = g.external("F16", [width, n_cells], f"k_cache{i}")
                vc = g.external("F16", [width, n_cells], f"v_cache{i}")
                srcs = [tp, tf] if i == 2 else [tp]
                rq = cpu.node(g, "ROPE", "F32", [hd, n_q, 1], [tq] + srcs, [hd, 2], [10000.0, 1.0])
                rk = cpu.node(g, "ROPE", "F32", [hd, n_kv, 1], [tk] + srcs, [hd, 2], [10000.0, 1.0])
                ks = g.set_rows(kc, g.reshape(rk, [width, 1]), tc)
                vs = g.set_rows(vc, tv, tc)
                att = cpu.node(g, "ATTENTION", "F32", [hd, n_q, 1], [rq, ks, vs, tm, tb], [n_kv], [hd ** -0.5])
                feeds.update({tq: layer["q"], tk: layer["k"], tv: layer["v"], kc: layer["k_all"], vc: layer["v_all"]})
                fetch += [att, rq, rk, ks, vs]
            return g, feeds, fetch
        return build

    for position in (span + 2, 9000):
        out, stored, fused_launches = {}, {}, {}
        for setting, env in (("table", {"PYSPEC_CUDA_ATT_ANGLES": "1", "PYSPEC_CUDA_ATT_ROPE": "1"}),
                             ("no table", {"PYSPEC_CUDA_ATT_ANGLES": "0", "PYSPEC_CUDA_ATT_ROPE": "1"}),
                             ("apart", {"PYSPEC_CUDA_ATT_ANGLES": "1", "PYSPEC_CUDA_ATT_ROPE": "0"})):
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            core.reset_cuda_graph_stats()
            out[setting] = run_on(DEVICE, build_at(position))
            stats = core.cuda_graph_stats()
            stored[setting] = stats["stored_angles_attention_launches"]
            fused_launches[setting] = stats["rope_attention_launches"]
        assert fused_launches == {"table": n_layers, "no table": n_layers, "apart": 0}, fused_launches
        assert stored == {"table": 1, "no table": 0, "apart": 0}, stored
        for setting in ("no table", "apart"):
            for i, (a, b) in enumerate(zip(out["table"], out[setting])):
                what = f"layer {i // 5} {('attention', 'q', 'k', 'k cache', 'v cache')[i % 5]} against {setting}"
                assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)), what
