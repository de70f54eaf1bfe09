"""Op-level tests of the CUDA backend (issue 8): the ops of csrc/core/graph.h's Op enum run through
pyspec._core.run_graph(..., backend="cuda") and compared with a numpy reference and with the same
graph on the CPU backend, over the types each op accepts, strided views as inputs, and the sampling
chain. MUL_MAT and its fusions are in test_cuda_matmul.py, ATTENTION in test_cuda_attention.py.

Tolerances fit the type: ops that are single float32 operations (ADD, MUL, SCALE), conversions
(CPY/GET_ROWS/SET_ROWS to and from F32, F16, BF16), ARGMAX and TOP_K are exact; reductions hold
float32 accuracy with a GPU's reduction order.

Without a usable CUDA backend (CI has no GPU) the GPU tests skip with the reason
pyspec._core.cuda_available() gives, and a test checks that backend="cuda" then raises a
RuntimeError naming that reason. PYSPEC_TEST_DEVICE_BACKEND=cpu runs the GPU tests with the CPU
backend in the device's place, which checks the tests themselves on a machine without a GPU.

On the GPU machine: python -m pytest -q tests/test_cuda_ops.py tests/test_cuda_matmul.py
tests/test_cuda_attention.py (after building with PYSPEC_CUDA=ON).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import test_cpu_ops as cpu  # the CPU tests' helpers, references and op cases
import test_sample_op as sample_op  # SAMPLE's cases and numpy reference
from cuda_op_helpers import ALL_W, BATCHES, CACHE_TYPES, NEG_INF, assert_close_bound, dev_and_cpu, run_on
from cuda_status import CUDA_OK, CUDA_REASON, DEVICE, gpu
from pyspec import _core as core


# --------------------------------------------------------------------------------------------
# Availability and the error without CUDA (run everywhere)
# --------------------------------------------------------------------------------------------


def tiny_graph():
    g = core.Graph()
    tx = g.input("F32", [4, 2], "x")
    out = cpu.node(g, "SCALE", "F32", [4, 2], [tx], fparams=[2.0])
    return g, {tx: np.arange(8, dtype=np.float32).reshape(2, 4)}, [out]


def test_cuda_available_reports_a_reason():
    ok, reason = core.cuda_available()
    assert isinstance(ok, bool) and isinstance(reason, str)
    if not ok:
        assert reason.strip(), "an unavailable CUDA backend must say why"


@pytest.mark.skipif(CUDA_OK, reason="CUDA is available here: the error path is for builds or machines without it")
def test_cuda_backend_without_cuda_raises_with_the_reason():
    g, feeds, fetch = tiny_graph()
    with pytest.raises(RuntimeError) as err:
        cpu.run(g, feeds, fetch, backend="cuda")
    assert CUDA_REASON in str(err.value)
    # The graph is untouched by the failed call: it still runs on the CPU.
    (got,) = cpu.run(g, feeds, fetch)
    assert np.array_equal(got.reshape(2, 4), 2 * feeds[fetch[0] - 1])


def test_run_graph_backend_argument():
    g, feeds, fetch = tiny_graph()
    for t in fetch:
        g.set_output(t)
    default = core.run_graph(g, feeds, fetch)
    named = core.run_graph(g, feeds, fetch, backend="cpu")
    assert np.array_equal(default[0], named[0])
    with pytest.raises(ValueError, match="unknown backend"):
        core.run_graph(g, feeds, fetch, backend="tpu")


# --------------------------------------------------------------------------------------------
# Host <-> device copies
# --------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("batched", ["1", "0"], ids=["batched", "apart"])
def test_many_small_inputs_and_outputs_arrive_whole(batched, monkeypatch):
    """21 inputs (more than the 16 pieces one launch of queued copies takes) of 1 to 24,577 values
    (one past the 64 KiB a queued piece may hold; 2-byte values in odd counts, so 16-, 4- and 1-byte
    copies), each into an output of its own, all fetched: every output is its input's values, with
    the small writes and reads queued and run as launches (PYSPEC_CUDA_BATCH_COPIES, on by default;
    counted) or each its own cudaMemcpyAsync."""
    monkeypatch.setenv("PYSPEC_CUDA_BATCH_COPIES", batched)
    sizes = [1, 2, 3, 5, 7, 8, 16, 31, 64, 100, 257, 1000, 4096, 16384, 24577, 3, 3, 5, 3, 9, 2]

    def build():
        g = core.Graph()
        feeds, outs, want = {}, [], []
        for i, n in enumerate(sizes):
            x = ((np.arange(n) * 7 + i) % 251 - 125).astype(np.float32)  # exact as F16 too
            if i % 3 == 0:  # F32 in, doubled
                t = g.input("F32", [n], f"x{i}")
                feeds[t] = x
                outs.append(cpu.node(g, "SCALE", "F32", [n], [t], fparams=[2.0]))
                want.append(2 * x)
            elif i % 3 == 1:  # F16 in (2 n bytes), F32 out
                t = g.input("F16", [n], f"x{i}")
                feeds[t] = x.astype(np.float16)
                outs.append(cpu.node(g, "CPY", "F32", [n], [t]))
                want.append(x)
            else:  # F32 in, F16 out (2 n bytes read back)
                t = g.input("F32", [n], f"x{i}")
                feeds[t] = x
                outs.append(cpu.node(g, "CPY", "F16", [n], [t]))
                want.append(x)
        build.want = want
        return g, feeds, outs

    if DEVICE == "cuda":
        core.reset_cuda_graph_stats()
    got = run_on(DEVICE, build)
    for i, (a, w) in enumerate(zip(got, build.want)):
        a = np.asarray(a).reshape(-1)
        if i % 3 == 2:  # F16 comes back as its bytes
            a = a.view(np.uint8).view(np.float16)
        np.testing.assert_array_equal(a.astype(np.float32), w, err_msg=f"output {i}")
    if DEVICE == "cuda":
        launches = core.cuda_graph_stats()["batched_copy_launches"]
        assert (launches >= 2) if batched == "1" else launches == 0, launches


# --------------------------------------------------------------------------------------------
# GET_ROWS, CPY, SET_ROWS
# --------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("n_ids", [1, 5, 300])
@pytest.mark.parametrize("dtype", ALL_W)
def test_get_rows(dtype, n_ids):
    rng = np.random.default_rng(12 + n_ids)
    n_embd, n_vocab = 320, 1000
    table = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
    stored = cpu.encode(table, dtype)
    ids = rng.integers(0, n_vocab, n_ids).astype(np.int32)
    ids[0] = n_vocab - 1  # the last row
    if n_ids > 3:
        ids[3] = ids[1]  # repeats

    def build():
        g = core.Graph()
        tt = g.external(dtype, [n_embd, n_vocab], "table")
        ti = g.input("I32", [n_ids], "ids")
        out = cpu.node(g, "GET_ROWS", "F32", [n_embd, n_ids], [tt, ti])
        return g, {tt: stored, ti: ids}, [out]

    (got,), (ref,) = dev_and_cpu(build)
    want = cpu.decode(stored, dtype)[ids]  # products d * q of a few bits: exact in float32
    assert np.array_equal(got.reshape(n_ids, n_embd), want)
    assert np.array_equal(got, ref)


def quantized_within_a_step(got_raw, want_raw, dtype, x):
    """Quantizing on the device may round a value on a tie (or under FMA contraction) the other
    way: the blocks decode to within one quantization step of ggml's, and nearly all bytes agree."""
    rows = x.shape[0]
    got = cpu.decode(np.asarray(got_raw).reshape(rows, -1), dtype).astype(np.float64)
    want = cpu.decode(np.asarray(want_raw).reshape(rows, -1), dtype).astype(np.float64)
    d = np.abs(np.ascontiguousarray(want_raw).view(np.uint8).reshape(rows, x.shape[1] // 32, -1)[..., :2]
               .copy().view(np.float16)[..., 0].astype(np.float64))
    step = np.repeat(d, 32, axis=-1) * 1.001 + 1e-30
    assert np.all(np.abs(got - want) <= step)
    same = np.mean(np.asarray(got_raw).view(np.uint8).reshape(-1) == np.asarray(want_raw).view(np.uint8).reshape(-1))
    assert same >= 0.99, same


@gpu
@pytest.mark.parametrize("dtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_cpy_round_trip(dtype):
    rng = np.random.default_rng(9)
    rows, n = 300, 256
    x = (rng.standard_normal((rows, n)) * rng.uniform(0.01, 100, (rows, 1))).astype(np.float32)
    special = np.array(cpu.special_values(dtype), np.float32)
    x.reshape(-1)[: len(special)] = special
    x[3] = 0.0  # a zero block: scale 0, no division by zero

    def build():
        g = core.Graph()
        tx = g.input("F32", [n, rows], "x")
        to = cpu.node(g, "CPY", dtype, [n, rows], [tx])
        back = cpu.node(g, "CPY", "F32", [n, rows], [to])
        return g, {tx: x}, [to, back]

    (got_raw, got_back), (ref_raw, ref_back) = dev_and_cpu(build)
    stored = cpu.encode(x, dtype)
    if dtype in ("F16", "BF16"):  # round to nearest even, subnormals and overflow included
        assert np.array_equal(got_raw.reshape(-1), cpu.raw_bytes(stored))
        assert np.array_equal(got_back.reshape(rows, n), cpu.decode(stored, dtype))
    else:
        quantized_within_a_step(got_raw, cpu.raw_bytes(stored), dtype, x)
        assert np.array_equal(got_back.reshape(rows, n), cpu.decode(got_raw.reshape(rows, -1), dtype))
    assert np.array_equal(ref_raw.reshape(-1), cpu.raw_bytes(stored))  # the CPU stays ggml's


@gpu
@pytest.mark.parametrize("dtype", ["F32", "F16"])
def test_cpy_from_strided_rows(dtype):
    rng = np.random.default_rng(10)
    x = rng.standard_normal((6, 2, 48)).astype(np.float32)

    def build():
        g = core.Graph()
        tx = g.input("F32", [48, 2, 6], "x")
        # a 3-D view: columns 16..47 of row 1 of slices 1, 3, 5
        odd = g.view(tx, [32, 1, 3], [4, 48 * 4, 2 * 2 * 48 * 4], 2 * 48 * 4 + 48 * 4 + 16 * 4)
        out = cpu.node(g, "CPY", dtype, [32, 1, 3], [odd])
        return g, {tx: x}, [out]

    (got,), (ref,) = dev_and_cpu(build)
    want = x[1::2, 1:2, 16:].astype(np.float16 if dtype == "F16" else np.float32)
    assert np.array_equal(got.reshape(-1).view(np.uint8), cpu.raw_bytes(want))
    assert np.array_equal(got, ref)


@gpu
@pytest.mark.parametrize("n_new", [1, 4, 64])
@pytest.mark.parametrize("dtype", CACHE_TYPES)
def test_set_rows(dtype, n_new):
    """SET_ROWS into an external cache; the node (a view of the whole cache) is fetched, since the
    device writes its copy of the cache, not the host array."""
    rng = np.random.default_rng(13 + n_new)
    n, n_cells = 256, 100
    cache = cpu.encode(rng.standard_normal((n_cells, n)), dtype)
    rows = rng.standard_normal((n_new, n)).astype(np.float32)
    rows[0, :4] = [1 + 2**-11, 65519.0, 2**-25, -0.0]  # F16 rounding cases
    ids = rng.choice(n_cells, n_new, replace=False).astype(np.int32)

    def build():
        g = core.Graph()
        td = g.external(dtype, [n, n_cells], "cache")
        tr = g.input("F32", [n, n_new], "rows")
        ti = g.input("I32", [n_new], "ids")
        ts = g.set_rows(td, tr, ti)
        return g, {td: cache, tr: rows, ti: ids}, [ts]

    (got,), (ref,) = dev_and_cpu(build)
    want = cache.copy()
    want[ids] = cpu.encode(rows, dtype)
    assert np.array_equal(got.reshape(-1).view(np.uint8), cpu.raw_bytes(want))
    assert np.array_equal(got.reshape(-1).view(np.uint8), ref.reshape(-1).view(np.uint8))


# --------------------------------------------------------------------------------------------
# ROPE, RMS_NORM
# --------------------------------------------------------------------------------------------


def rope_bound(x, pos, fscale):
    """float32 angles (pos * fscale * base^(-2i/n) rounded a few times) err by a few ulps of the
    angle: at position 33000 that is ~1e-2 radians times the pair's length."""
    theta = np.abs(pos.astype(np.float64) * fscale)[:, None, None]
    norm = np.sqrt(np.sum(np.asarray(x, np.float64) ** 2, axis=-1, keepdims=True))
    return 1e-5 + 1e-5 * np.abs(x) + 2.0**-21 * theta * norm


def rope_build(x, pos, n_rot, mode, base, fscale, factors=None):
    n_rows, n_head, hd = x.shape

    def build():
        g = core.Graph()
        tx = g.input("F32", [hd, n_head, n_rows], "x")
        tp = g.input("I32", [n_rows], "pos")
        srcs, feeds = [tx, tp], {tx: x, tp: pos}
        if factors is not None:
            tf = g.external("F32", [n_rot // 2], "rope_freqs")
            srcs.append(tf)
            feeds[tf] = factors
        out = cpu.node(g, "ROPE", "F32", [hd, n_head, n_rows], srcs, [n_rot, mode], [base, fscale])
        return g, feeds, [out]

    return build


@gpu
@pytest.mark.parametrize("mode", [0, 2], ids=["normal", "neox"])
@pytest.mark.parametrize("n_rot", [64, 32, 16])
@pytest.mark.parametrize("base,fscale", [(10000.0, 1.0), (1000000.0, 0.25)])
def test_rope(mode, n_rot, base, fscale):
    rng = np.random.default_rng(n_rot + mode)
    hd, n_head, n_rows = 64, 3, 6
    x = rng.standard_normal((n_rows, n_head, hd)).astype(np.float32)
    pos = np.array([0, 1, 7, 100, 4095, 33000], np.int32)
    (got,), (ref,) = dev_and_cpu(rope_build(x, pos, n_rot, mode, base, fscale))
    got = got.reshape(x.shape)
    want = cpu.rope_ref(x, pos, n_rot, mode, base, fscale)
    assert_close_bound(got, want, rope_bound(want, pos, fscale), "rope vs float64")
    assert_close_bound(got, ref.reshape(x.shape), 2 * rope_bound(want, pos, fscale), "rope vs CPU")
    assert np.array_equal(got[..., n_rot:], x[..., n_rot:])  # the tail passes through untouched
    assert np.array_equal(got[0], x[0])  # position 0 is the identity


@gpu
@pytest.mark.parametrize("m", BATCHES)
@pytest.mark.parametrize("mode", [0, 2], ids=["normal", "neox"])
def test_rope_batches(mode, m):
    rng = np.random.default_rng(40 + m + mode)
    hd, n_head = 128, 32
    x = rng.standard_normal((m, n_head, hd)).astype(np.float32)
    pos = (np.arange(m) + 17).astype(np.int32)
    (got,), (ref,) = dev_and_cpu(rope_build(x, pos, hd, mode, 1000000.0, 1.0))
    want = cpu.rope_ref(x, pos, hd, mode, 1000000.0, 1.0)
    assert_close_bound(got.reshape(x.shape), want, rope_bound(want, pos, 1.0), "rope vs float64")
    assert_close_bound(got, ref, 2 * rope_bound(want, pos, 1.0).reshape(got.shape), "rope vs CPU")


@gpu
@pytest.mark.parametrize("mode", [0, 2], ids=["normal", "neox"])
def test_rope_with_frequency_factors(mode):
    rng = np.random.default_rng(11 + mode)
    hd, n_head, n_rows, n_rot = 64, 2, 4, 64
    x = rng.standard_normal((n_rows, n_head, hd)).astype(np.float32)
    pos = np.array([0, 5, 100, 8000], np.int32)
    factors = rng.uniform(1.0, 8.0, n_rot // 2).astype(np.float32)
    (got,), (ref,) = dev_and_cpu(rope_build(x, pos, n_rot, mode, 500000.0, 1.0, factors))
    got = got.reshape(x.shape)
    want = cpu.rope_ref(x, pos, n_rot, mode, 500000.0, 1.0, factors)
    assert_close_bound(got, want, rope_bound(want, pos, 1.0), "rope_freqs vs float64")
    assert_close_bound(got, ref.reshape(x.shape), 2 * rope_bound(want, pos, 1.0), "rope_freqs vs CPU")
    assert np.abs(got - cpu.rope_ref(x, pos, n_rot, mode, 500000.0, 1.0)).max() > 0.1  # factors matter


@gpu
def test_rope_modes_rotate_different_pairs():
    x = np.arange(1, 33, dtype=np.float32).reshape(1, 1, 32)
    pos = np.array([3], np.int32)
    outs = []
    for mode in (0, 2):
        (got,) = run_on(DEVICE, rope_build(x, pos, 16, mode, 10000.0, 1.0))
        outs.append(got.reshape(1, 1, 32))
        np.testing.assert_allclose(outs[-1], cpu.rope_ref(x, pos, 16, mode, 10000.0, 1.0), rtol=1e-5, atol=1e-4)
    assert np.abs(outs[0] - outs[1]).max() > 1.0


def rms_norm_build(x, w, eps):
    n_rows, n_head, hd = x.shape

    def build():
        g = core.Graph()
        tx = g.input("F32", [hd, n_head, n_rows], "x")
        srcs, feeds = [tx], {tx: x}
        if w is not None:
            tw = g.input("F32", [hd], "w")
            srcs.append(tw)
            feeds[tw] = w
        out = cpu.node(g, "RMS_NORM", "F32", [hd, n_head, n_rows], srcs, fparams=[eps])
        return g, feeds, [out]

    return build


@gpu
@pytest.mark.parametrize("with_weight", [False, True])
@pytest.mark.parametrize("hd", [16, 64, 100, 128])
def test_rms_norm_per_head(with_weight, hd):
    rng = np.random.default_rng(hd)
    n_head, n_rows, eps = 3, 4, 1e-6
    x = rng.standard_normal((n_rows, n_head, hd)).astype(np.float32)
    x[1, 2] *= 300.0
    x[2, 0] = 0.0  # an all-zero row stays zero
    w = rng.uniform(0.5, 1.5, hd).astype(np.float32) if with_weight else None
    (got,), (ref,) = dev_and_cpu(rms_norm_build(x, w, eps))
    want = cpu.rms_norm_ref(x, w, np.float32(eps))
    np.testing.assert_allclose(got.reshape(x.shape), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert np.all(got.reshape(x.shape)[2, 0] == 0.0)


@gpu
@pytest.mark.parametrize("m", BATCHES)
@pytest.mark.parametrize("n_embd", [576, 2560])
def test_rms_norm_model_rows(n_embd, m):
    rng = np.random.default_rng(n_embd + m)
    x = (rng.standard_normal((m, 1, n_embd)) * rng.uniform(0.01, 100, (m, 1, 1))).astype(np.float32)
    w = rng.uniform(0.5, 1.5, n_embd).astype(np.float32)
    (got,), (ref,) = dev_and_cpu(rms_norm_build(x, w, 1e-5))
    want = cpu.rms_norm_ref(x, w, np.float32(1e-5))
    np.testing.assert_allclose(got.reshape(x.shape), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


@gpu
def test_qk_norm_and_rope_on_a_fused_qkv_view():
    """qwen3's q path on strided views of a fused QKV row: RMS_NORM per head, ROPE (NEOX)."""
    rng = np.random.default_rng(5)
    hd, n_head, n_kv, n_rows = 128, 4, 2, 17
    width = hd * (n_head + 2 * n_kv)
    qkv = rng.standard_normal((n_rows, width)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, hd).astype(np.float32)
    pos = np.arange(4, 4 + n_rows).astype(np.int32)

    def build():
        g = core.Graph()
        tqkv = g.input("F32", [width, n_rows], "qkv")
        tw = g.input("F32", [hd], "q_norm")
        tp = g.input("I32", [n_rows], "pos")
        tkv = g.view(tqkv, [hd, n_kv, n_rows], [4, hd * 4, width * 4], n_head * hd * 4)
        tq = g.view(tqkv, [hd, n_head, n_rows], [4, hd * 4, width * 4], 0)
        qn = cpu.node(g, "RMS_NORM", "F32", [hd, n_head, n_rows], [tq, tw], fparams=[1e-6])
        qr = cpu.node(g, "ROPE", "F32", [hd, n_head, n_rows], [qn, tp], [hd, 2], [1000000.0, 1.0])
        kn = cpu.node(g, "RMS_NORM", "F32", [hd, n_kv, n_rows], [tkv], fparams=[1e-6])
        # ROPE straight on a strided view too (llama's k path without a norm)
        kr = cpu.node(g, "ROPE", "F32", [hd, n_kv, n_rows], [tkv, tp], [hd, 0], [10000.0, 1.0])
        return g, {tqkv: qkv, tw: w, tp: pos}, [qr, kn, kr]

    (got_q, got_k, got_kr), (ref_q, ref_k, ref_kr) = dev_and_cpu(build)
    q_in = qkv[:, : n_head * hd].reshape(n_rows, n_head, hd)
    k_in = qkv[:, n_head * hd: (n_head + n_kv) * hd].reshape(n_rows, n_kv, hd)
    want_q = cpu.rope_ref(cpu.rms_norm_ref(q_in, w, 1e-6), pos, hd, 2, 1e6, 1.0)
    assert_close_bound(got_q.reshape(want_q.shape), want_q, 2 * rope_bound(want_q, pos, 1.0), "q")
    np.testing.assert_allclose(got_k.reshape(n_rows, n_kv, hd), cpu.rms_norm_ref(k_in, None, 1e-6),
                               rtol=1e-5, atol=1e-6)
    want_kr = cpu.rope_ref(k_in, pos, hd, 0, 10000.0, 1.0)
    assert_close_bound(got_kr.reshape(want_kr.shape), want_kr, rope_bound(want_kr, pos, 1.0), "k rope")
    np.testing.assert_allclose(got_q, ref_q, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_k, ref_k, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_kr, ref_kr, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------
# SOFTMAX and the element-wise ops
# --------------------------------------------------------------------------------------------


def assert_softmax_close(got, z, rel=4e-6):
    """As the CPU test's check, with room for the device's exp and summation order."""
    z = np.asarray(z, np.float64)
    want = cpu.softmax64(z)
    shift = np.where(np.isfinite(z), np.abs(z - np.max(z, axis=-1, keepdims=True)), 0.0)
    tol = want * (rel + 2.0**-23 * shift) + 1e-37
    bad = np.abs(np.asarray(got, np.float64) - want) > tol
    assert not bad.any(), f"{np.asarray(got)[bad][:5]} != {want[bad][:5]}"


@gpu
@pytest.mark.parametrize("scale", [1.0, 0.7])
@pytest.mark.parametrize("n", [1, 5, 31, 64, 100, 1024, 4097, 49152])
def test_softmax(n, scale):
    rows = 4
    x = cpu.softmax_input(n, rows)

    def build():
        g = core.Graph()
        tx = g.input("F32", [n, rows], "x")
        out = cpu.node(g, "SOFTMAX", "F32", [n, rows], [tx], fparams=[scale])
        return g, {tx: x}, [out]

    (got,), (ref,) = dev_and_cpu(build)
    got = got.reshape(rows, n)
    assert_softmax_close(got, x * np.float32(scale))
    assert np.all(got[x == NEG_INF] == 0.0)
    if n > 1:
        assert got[2, n - 1] == 1.0
    np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(got, ref.reshape(rows, n), rtol=1e-5, atol=1e-30)


@gpu
def test_softmax_on_a_strided_view():
    rng = np.random.default_rng(21)
    x = (rng.standard_normal((6, 80)) * 3).astype(np.float32)

    def build():
        g = core.Graph()
        tx = g.input("F32", [80, 6], "x")
        view = g.view(tx, [64, 3], [4, 2 * 80 * 4], 80 * 4 + 8 * 4)  # rows 1, 3, 5, columns 8..71
        out = cpu.node(g, "SOFTMAX", "F32", [64, 3], [view], fparams=[0.5])
        return g, {tx: x}, [out]

    (got,), (ref,) = dev_and_cpu(build)
    assert_softmax_close(got.reshape(3, 64), x[1::2, 8:72] * np.float32(0.5))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-30)


@gpu
@pytest.mark.parametrize("shape", [(3, 2, 37), (300, 1, 2560)], ids=["small", "m300"])
def test_silu_and_swiglu(shape):
    rng = np.random.default_rng(3)
    a = (rng.standard_normal(shape) * 5).astype(np.float32)
    a.reshape(-1)[:6] = [0.0, -0.0, 20.0, -20.0, 88.0, -80.0]
    b = rng.standard_normal(shape).astype(np.float32)
    for op, inputs, want in (("SILU", [a], cpu.silu64(a)), ("SWIGLU", [a, b], cpu.silu64(a) * b)):
        got = cpu.elementwise(op, inputs, backend=DEVICE)
        np.testing.assert_allclose(got, want, rtol=4e-6, atol=1e-37)
        np.testing.assert_allclose(got, cpu.elementwise(op, inputs), rtol=4e-6, atol=1e-37)


@gpu
@pytest.mark.parametrize("op,fn", [("ADD", np.add), ("MUL", np.multiply)])
def test_add_mul_exact_with_row_broadcast(op, fn):
    rng = np.random.default_rng(4)
    # contiguous operands run flat: 16-byte accesses (240 and 768,000 elements) or not (111)
    for shape in ((2, 3, 40), (3, 1, 37), (300, 1, 2560)):
        a = rng.standard_normal(shape).astype(np.float32)
        full = rng.standard_normal(shape).astype(np.float32)
        row = rng.standard_normal((1, 1, shape[-1])).astype(np.float32)
        assert np.array_equal(cpu.elementwise(op, [a, full], backend=DEVICE), fn(a, full))
        assert np.array_equal(cpu.elementwise(op, [a, row], backend=DEVICE), fn(a, row))
        assert np.array_equal(cpu.elementwise(op, [a, row.reshape(-1)], backend=DEVICE), fn(a, row))


@gpu
def test_elementwise_ops_on_strided_views():
    """ADD, MUL, SCALE, SILU, SWIGLU reading strided views (the gate and up halves of a fused
    gate_up row, every other row), writing contiguous results."""
    rng = np.random.default_rng(22)
    n, rows = 96, 8
    gu = rng.standard_normal((rows, 2 * n)).astype(np.float32)
    other = rng.standard_normal((rows, n)).astype(np.float32)

    def build():
        g = core.Graph()
        tgu = g.input("F32", [2 * n, rows], "gate_up")
        to = g.input("F32", [n, rows], "other")
        gate = g.view(tgu, [n, rows], [4, 2 * n * 4], 0)
        up = g.view(tgu, [n, rows], [4, 2 * n * 4], n * 4)
        half_rows = g.view(to, [n, rows // 2], [4, 2 * n * 4], n * 4)  # rows 1, 3, 5, 7
        outs = [
            cpu.node(g, "SWIGLU", "F32", [n, rows], [gate, up]),
            cpu.node(g, "SILU", "F32", [n, rows], [gate]),
            cpu.node(g, "ADD", "F32", [n, rows], [up, to]),
            cpu.node(g, "MUL", "F32", [n, rows], [gate, to]),
            cpu.node(g, "SCALE", "F32", [n, rows // 2], [half_rows], fparams=[0.37]),
        ]
        return g, {tgu: gu, to: other}, outs

    got, ref = dev_and_cpu(build)
    gate, up = gu[:, :n], gu[:, n:]
    np.testing.assert_allclose(got[0].reshape(rows, n), cpu.silu64(gate) * up, rtol=4e-6, atol=1e-37)
    np.testing.assert_allclose(got[1].reshape(rows, n), cpu.silu64(gate), rtol=4e-6, atol=1e-37)
    assert np.array_equal(got[2].reshape(rows, n), up + other)
    assert np.array_equal(got[3].reshape(rows, n), gate * other)
    assert np.array_equal(got[4].reshape(rows // 2, n), other[1::2] * np.float32(0.37))
    for a, b in zip(got[2:], ref[2:]):
        assert np.array_equal(a, b)


@gpu
def test_scale_exact():
    x = np.random.default_rng(6).standard_normal((300, 33)).astype(np.float32)
    assert np.array_equal(cpu.elementwise("SCALE", [x], [0.37], backend=DEVICE), x * np.float32(0.37))


# --------------------------------------------------------------------------------------------
# SUM, ARGMAX, TOP_K
# --------------------------------------------------------------------------------------------


def sum_bound(part):
    """float32 summation in any tree order: (log2 n + 2) roundings of partial sums."""
    part = np.asarray(part, np.float64).ravel()
    return (math.ceil(math.log2(max(part.size, 2))) + 2) * 2.0**-24 * np.abs(part).sum() + 1e-30


@gpu
@pytest.mark.parametrize("outlier", [False, True])
@pytest.mark.parametrize("shape", [(3, 4, 50), (4, 300, 2560)], ids=["small", "large"])
def test_sum_contiguous_and_strided(shape, outlier):
    rng = np.random.default_rng(8)
    x = rng.standard_normal(shape).astype(np.float32)
    if outlier:
        x[1, 2, 7] = 1e6
    d2, d1, d0 = shape

    def build():
        g = core.Graph()
        tx = g.input("F32", [d0, d1, d2], "x")
        whole = cpu.node(g, "SUM", "F32", [1], [tx])
        view = g.view(tx, [20, d1 * d2 // 2], [4, 2 * d0 * 4], 0)  # every other row, 20 columns
        part = cpu.node(g, "SUM", "F32", [1], [view])
        return g, {tx: x}, [whole, part]

    got, _ = dev_and_cpu(build)
    flat = x.reshape(d1 * d2, d0)
    for value, part in zip(got, (flat, flat[::2, :20])):
        want = math.fsum(part.astype(np.float64).ravel().tolist())
        assert abs(float(value.reshape(())) - want) <= sum_bound(part) + abs(want) * 2.0**-24


@gpu
@pytest.mark.parametrize("rows", [1, 6, 64])
@pytest.mark.parametrize("n", [1, 7, 40, 257, 4096, 49152, 151936])
def test_argmax_first_index_on_ties(n, rows):
    """The first index of each row's largest value, NaN skipped; a few long rows are split over
    blocks (cuda/ops_pick.cu), many rows or short ones are not: the same ids either way."""
    rng = np.random.default_rng(n + rows)
    with_nan = rng.standard_normal((rows, n)).astype(np.float32)
    with_nan[:, 1:][rng.random((rows, n - 1)) < 0.01] = np.nan
    for x in (cpu.tie_heavy_rows(rng, rows, n), rng.standard_normal((rows, n)).astype(np.float32),
              cpu.signed_zero_rows(rng, rows, n)):
        got = cpu.reduce_run("ARGMAX", x, backend=DEVICE)[:, 0]
        assert np.array_equal(got, np.argmax(x, axis=1))
    got = cpu.reduce_run("ARGMAX", with_nan, backend=DEVICE)[:, 0]
    assert np.array_equal(got, np.nanargmax(with_nan, axis=1))


@gpu
@pytest.mark.parametrize("rows", [6, 64])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (40, 1), (40, 8), (40, 40), (257, 16), (4096, 40),
                                 (49152, 64), (151936, 40)])
def test_top_k_descending_ties_keep_lower_index(n, k, rows):
    rng = np.random.default_rng(n * 100 + k + rows)
    for x in (cpu.tie_heavy_rows(rng, rows, n), rng.standard_normal((rows, n)).astype(np.float32)):
        got = cpu.reduce_run("TOP_K", x, k, backend=DEVICE)
        assert np.array_equal(got, cpu.top_k_ref(x, k))


@gpu
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("n,k", [(300, 40), (49152, 40), (151936, 64), (151936, 100)])
def test_top_k_then_gather_equal_the_cpu(n, k, rows):
    """The filtered TOP_K (chunk maxima, then the entries at or above the k-th of them ranked)
    and its fallbacks give the CPU's ids, -0 equal to +0; GATHER gives the logits at them."""
    rng = np.random.default_rng(n + k + rows)
    for x in (cpu.tie_heavy_rows(rng, rows, n), rng.standard_normal((rows, n)).astype(np.float32),
              cpu.signed_zero_rows(rng, rows, n), cpu.quarter_rows(rng, rows, n)):
        ids, vals = cpu.top_k_gather_run(x, k, backend=DEVICE)
        assert np.array_equal(ids, cpu.top_k_ref(x, k))
        assert np.array_equal(vals, np.take_along_axis(x, ids.astype(np.int64), axis=1))
    _, vals = cpu.top_k_gather_run(x[:1, :6], 3, ids=[[5, -1, 0]], backend=DEVICE)
    assert vals.tolist() == [[x[0, 5], cpu.NEG_INF, x[0, 0]]]


@gpu
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6])
def test_sample_draws_the_cpus_tokens(seed):
    """SAMPLE on the device (the GPU's double exp and log): the tokens of the CPU's op, which is
    the host's own draw, and of the numpy reference, on 256 rows of each chain; no row undefined."""
    ids, vals, words, params, bans = sample_op.random_case(seed, rows=256)
    got = sample_op.run_sample(ids, vals, words, bans, backend=DEVICE)
    assert got.tolist() == sample_op.run_sample(ids, vals, words, bans).tolist()
    want = [sample_op.reference_draw(ids[r], vals[r], *p) for r, p in enumerate(params)]
    assert got.tolist() == want


@gpu
def test_sample_gives_minus_one_for_undefined_draws_on_the_device():
    ids, vals, words, _, bans = sample_op.random_case(7, rows=4, k=8)
    words[0] = sample_op.sampler_words(0.8, 1.0, 0.0, 9, 1, 0)  # top_k past the candidates
    words[3] = sample_op.sampler_words(0.8, 1.0, 0.0, 6, 1, 0)  # 6 of the 8 left by 3 bans
    bans[3] = ids[3, :3].tolist()
    vals = vals.copy()
    vals[1, 3] = np.nan
    got = sample_op.run_sample(ids, vals, words, bans, backend=DEVICE)
    assert got[0] == -1 and got[1] == -1 and got[3] == -1
    assert got[2] == sample_op.run_sample(ids, vals, words, bans)[2]


@gpu
@pytest.mark.parametrize("rows,n", [(1, 1), (3, 7), (6, 300), (4, 8192), (2, 151936)])
def test_gumbel_equals_the_cpus_bits(rows, n):
    """GUMBEL on the device: the host's noise (spec.gumbel) bit for bit, zeros for rows that are
    off; the draws of a DSpark drafter's Markov slots are the same on either backend."""
    rng = np.random.default_rng(rows * 7 + n)
    keys, elems, seeds = cpu.gumbel_case(rng, rows, n)
    for stream in (1, 3):
        got = cpu.gumbel_run(keys, elems, stream, backend=DEVICE)
        assert np.array_equal(got, cpu.gumbel_ref(keys, elems, seeds, stream)), stream


# --------------------------------------------------------------------------------------------
# The sampling chain (graph-allocator.md §4.2) on the device equals the CPU's
# --------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("n_cols", [1, 4, 16])
def test_sampling_chains_match_the_cpu(n_cols):
    """Per logits row: TOP_K on a view, GET_ROWS through a [1, V] table view, SCALE, SOFTMAX, and
    Gumbel-max (ADD of given noise, ARGMAX). Same logits in, so candidates, scaled logits and the
    draw must equal the CPU's exactly; probabilities within float32 accuracy."""
    V, K = cpu.V, cpu.K
    rng = np.random.default_rng(30 + n_cols)
    logits = rng.standard_normal((n_cols, V)).astype(np.float32)
    logits[:, 9], logits[:, 20] = logits[:, 5], logits[:, 3]  # ties in every row
    noise = {c: cpu.chain_noise(1, c % 4, c) for c in range(n_cols)}

    def build():
        g = core.Graph()
        tl = g.input("F32", [V, n_cols], "logits")
        feeds, fetch = {tl: logits}, []
        for c in range(n_cols):
            tn, outs = cpu.add_sampling_chain(g, tl, c, cpu.TEMPS[c % 4], f"c{c}")
            feeds[tn] = noise[c]
            fetch += [outs["candidates"], outs["logits"], outs["probs"], outs["sampled"]]
        return g, feeds, fetch

    got, ref = dev_and_cpu(build)
    for c in range(n_cols):
        cand, lg, probs, sampled = got[4 * c: 4 * c + 4]
        rcand, rlg, rprobs, rsampled = ref[4 * c: 4 * c + 4]
        want_cand = np.lexsort((np.arange(V), -logits[c].astype(np.float64)))[:K]
        assert np.array_equal(cand.reshape(K), want_cand)
        assert np.array_equal(cand, rcand)
        scaled = logits[c][want_cand] * np.float32(1.0 / cpu.TEMPS[c % 4])
        assert np.array_equal(lg.reshape(K), scaled)
        assert_softmax_close(probs.reshape(K), scaled)
        assert int(sampled.reshape(())) == int(np.argmax(scaled + noise[c])) == int(rsampled.reshape(()))
