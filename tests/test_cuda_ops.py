"""Op-level tests of the CUDA backend (issue 8): every op of csrc/core/graph.h's Op enum run through
pyspec._core.run_graph(..., backend="cuda") and compared with a numpy reference and with the same
graph on the CPU backend, over the weight and cache types each op accepts, batch sizes M = 1, 4,
16, 64, 300 (every launch shape of the fixed-order kernel), strided views as inputs, and the sampling chain.

Tolerances fit the type: ops that are single float32 operations (ADD, MUL, SCALE), conversions
(CPY/GET_ROWS/SET_ROWS to and from F32, F16, BF16), ARGMAX and TOP_K are exact; reductions hold
float32 accuracy with a GPU's reduction order; MUL_MAT may round activations as the GPU chooses
(F16 for F16 weights, BF16 for BF16 weights, Q8 blocks or F16 for quantized weights), so it is held
to the error that choice allows against a float64 product with the dequantized weights, and to the
CPU within the sum of both bounds. A row's result must not depend on its batch (design.md
invariant 7, "on the CPU and on the GPU"): MUL_MAT and ATTENTION rows are compared bit for bit
alone and in batches.

Without a usable CUDA backend (CI has no GPU) the GPU tests skip with the reason
pyspec._core.cuda_available() gives, and a test checks that backend="cuda" then raises a
RuntimeError naming that reason. PYSPEC_TEST_DEVICE_BACKEND=cpu runs the GPU tests with the CPU
backend in the device's place, which checks the tests themselves on a machine without a GPU.

On the GPU machine: python -m pytest -q tests/test_cuda_ops.py (after building with PYSPEC_CUDA=ON).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import test_cpu_ops as cpu  # the CPU tests' helpers, references and op cases
from pyspec import _core as core

NEG_INF = -np.inf


from cuda_status import CUDA_OK, CUDA_REASON, DEVICE, gpu, real_gpu  # noqa: E402

BATCHES = [1, 4, 16, 64, 300]
FLOAT_W = cpu.FLOAT_W
QUANT_W = cpu.QUANT_W
ALL_W = FLOAT_W + QUANT_W
CACHE_TYPES = ["F16", "F32"]


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def run_on(backend, build):
    """build() -> (graph, feeds, fetch), called afresh for each run: the CPU backend writes
    SET_ROWS into external host arrays, so every run gets its own copies of the feeds."""
    g, feeds, fetch = build()
    feeds = {k: np.array(v, copy=True) for k, v in feeds.items()}
    return cpu.run(g, feeds, fetch, backend=backend)


def dev_and_cpu(build):
    """The fetched tensors on the device and on the CPU (one thread)."""
    return run_on(DEVICE, build), run_on("cpu", build)


def assert_close_bound(got, want, bound, what=""):
    got = np.asarray(got, np.float64)
    err = np.abs(got - want)
    bad = ~(err <= bound)  # NaN fails too
    if bad.any():
        i = np.flatnonzero(bad.reshape(-1))[:5]
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} outside the bound; got {got.reshape(-1)[i]}, "
                             f"want {np.asarray(want).reshape(-1)[i]}, bound {np.broadcast_to(bound, got.shape).reshape(-1)[i]}")


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
# MUL_MAT: every weight type, batch sizes 1 .. 300, strided operands, batch invariance
# --------------------------------------------------------------------------------------------

# Relative error (of sum |x| |w|) a float-weight product may have on the GPU: F32 stays F32 (no
# TF32), F16 weights may meet activations rounded to F16, BF16 weights activations rounded to BF16;
# float32 accumulation in any order adds the rest.
FLOAT_W_RTOL = {"F32": 2e-5, "F16": 2.0**-11 + 2e-5, "BF16": 2.0**-8 + 2e-5}


def mul_mat_bound(stored, dtype, x, n_rows):
    """(exact float64 product with the dequantized weights, per-element error bound, 6-sigma
    statistical bound or None) for the GPU's choices of activation rounding."""
    m, k = x.shape
    w_deq = cpu.decode(stored, dtype).astype(np.float64).reshape(n_rows, k)
    x64 = x.astype(np.float64)
    exact = x64 @ w_deq.T
    magnitude = np.abs(x64) @ np.abs(w_deq).T
    if dtype in FLOAT_W:
        return exact, FLOAT_W_RTOL[dtype] * magnitude + 1e-30, None
    # Quantized weights. Activations as Q8 blocks (d = max|x| / 127, fp16 scale, as the CPU and
    # llama.cpp's GPU kernels do) err by at most d/2 + |q| |d - fp16(d)| per element; F16
    # activations by less. Q4_1's offset term m_w * s may use s = fp16(d * sum q) (the CPU) or
    # fp16(sum x) (llama.cpp's q8_1 on the GPU): either is within 2^-10 (sum |x| + 16 d) of sum x.
    dw, mw, qw = cpu.weight_blocks(stored, dtype, n_rows, k)
    d32 = (np.abs(x.reshape(m, k // 32, 32)).max(axis=-1) / np.float32(127.0)).astype(np.float64)
    act_err = np.repeat(d32 * (0.5 + 127 * 2.0**-11), 32, axis=-1)
    w_abs = np.abs(dw[..., None] * qw).reshape(n_rows, k) + np.repeat(np.abs(mw), 32, axis=-1)
    block_abs = np.abs(x64).reshape(m, k // 32, 32).sum(-1) + 16 * d32
    s_err = block_abs @ (np.abs(mw).T * 2.0**-10)
    bound = act_err @ w_abs.T + s_err + 2e-5 * magnitude
    # Rounding errors are independent and uniform within +-d/2: 6 sigma catches a wrong scale.
    sigma = np.sqrt((np.repeat(d32, 32, axis=-1) ** 2 / 12) @ (w_deq**2).T)
    return exact, bound, 6 * sigma + s_err + 2e-5 * magnitude


def matmul_build(stored, dtype, x, n_rows, x_pad=0, w_pad_rows=0, prompt_cols=0):
    """MUL_MAT of n_rows weight rows by the rows of x. x_pad > 0 feeds x as a strided view (rows
    of a wider input, starting at column x_pad); w_pad_rows > 0 reads the weight as a view that
    skips that many leading rows of a larger matrix (a fused QKV weight's slice); prompt_cols: the
    node's prompt columns (core/graph.h), the first rows of x."""
    m, k = x.shape

    def build():
        g = core.Graph()
        row_bytes = stored.reshape(n_rows, -1).shape[1] * stored.itemsize
        if w_pad_rows:
            w_all = np.concatenate([np.zeros((w_pad_rows,) + stored.shape[1:], stored.dtype), stored])
            tw_all = g.external(dtype, [k, n_rows + w_pad_rows], "w_all")
            tw = g.view(tw_all, [k, n_rows], list(g.strides(tw_all)[:2]), w_pad_rows * row_bytes)
            feeds = {tw_all: w_all}
        else:
            tw = g.external(dtype, [k, n_rows], "w")
            feeds = {tw: stored}
        if x_pad:
            x_all = np.zeros((m, k + 2 * x_pad), np.float32)
            x_all[:, x_pad: x_pad + k] = x
            tx_all = g.input("F32", [k + 2 * x_pad, m], "x_all")
            tx = g.view(tx_all, [k, m], [4, (k + 2 * x_pad) * 4], x_pad * 4)
            feeds[tx_all] = x_all
        else:
            tx = g.input("F32", [k, m], "x")
            feeds[tx] = x
        out = cpu.node(g, "MUL_MAT", "F32", [n_rows, m], [tw, tx], iparams=(prompt_cols,) if prompt_cols else ())
        return g, feeds, [out]

    return build


def mm_inputs(dtype, n_rows, k, m, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_rows, k)).astype(np.float32)
    w[3] += 0.7  # a row with a large Q4_1 offset
    x = rng.standard_normal((m, k)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-1, 1, (m, 1))).astype(np.float32)  # rows of different scales
    x[0, :32] *= 1e-3  # blocks of very different scales
    if m > 2:
        x[2, 32:64] = 0.0  # a zero block: activation scale 0
    return cpu.encode(w, dtype), x


def check_mul_mat(dtype, n_rows, k, m, seed, **view):
    stored, x = mm_inputs(dtype, n_rows, k, m, seed)
    build = matmul_build(stored, dtype, x, n_rows, **view)
    (got,), (ref,) = dev_and_cpu(build)
    got, ref = got.reshape(m, n_rows), ref.reshape(m, n_rows)
    exact, bound, stat = mul_mat_bound(stored, dtype, x, n_rows)
    assert_close_bound(got, exact, bound, f"{dtype} M={m} vs float64")
    if stat is not None:
        assert_close_bound(got, exact, stat, f"{dtype} M={m} vs float64 (6 sigma)")
    # The CPU quantizes activations to Q8 blocks; the device may not: both within their bounds.
    assert_close_bound(got, ref, 2 * bound, f"{dtype} M={m} vs CPU")


MM_SHAPES = [(104, 512), (257, 2048)]  # (weight rows, K): partial tiles, a long reduction


@pytest.fixture(params=["cuda_cores", "tensor_cores"])
def mm_path(request, monkeypatch):
    """MUL_MAT's two CUDA paths: the default CUDA-core kernels and the opt-in tensor-core GEMM
    (cuda/matmul_tc.cu, PYSPEC_CUDA_TC=1; F16 activations for F16 and quantized weights, BF16 for
    BF16, which mul_mat_bound allows). The backend reads the variable at each MUL_MAT launch, and
    run_graph makes a new backend (and graph cache) per call. The CPU ignores it."""
    if request.param == "tensor_cores":
        monkeypatch.setenv("PYSPEC_CUDA_TC", "1")
    else:
        monkeypatch.setenv("PYSPEC_CUDA_TC", "0")
    return request.param


@gpu
@pytest.mark.parametrize("shape", MM_SHAPES, ids=lambda s: f"n{s[0]}k{s[1]}")
@pytest.mark.parametrize("m", BATCHES)
@pytest.mark.parametrize("dtype", ALL_W)
def test_mul_mat(dtype, m, shape, mm_path):
    n_rows, k = shape
    check_mul_mat(dtype, n_rows, k, m, seed=m * 7 + n_rows)


@gpu
@pytest.mark.parametrize("m", [1, 16, 300])
@pytest.mark.parametrize("dtype", ALL_W)
def test_mul_mat_strided_operands(dtype, m, mm_path):
    """Activations as a view into wider rows, weights as a row slice of a larger matrix."""
    check_mul_mat(dtype, 72, 256, m, seed=500 + m, x_pad=32, w_pad_rows=24)


@gpu
@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("dtype", FLOAT_W)
def test_mul_mat_float_weights_odd_k(dtype, m, mm_path):
    """Float weights take any K (no 32-blocks): tails of vector loads and reductions."""
    check_mul_mat(dtype, 33, 200, m, seed=900 + m)


def swiglu_ffn_build(stored_g, stored_u, dtype, x, n_rows):
    """SWIGLU(gate x, up x): the two MUL_MATs over the same activations, then the SWIGLU node."""
    m, k = x.shape

    def build():
        g = core.Graph()
        tg = g.external(dtype, [k, n_rows], "w_gate")
        tu = g.external(dtype, [k, n_rows], "w_up")
        tx = g.input("F32", [k, m], "x")
        gate = cpu.node(g, "MUL_MAT", "F32", [n_rows, m], [tg, tx])
        up = cpu.node(g, "MUL_MAT", "F32", [n_rows, m], [tu, tx])
        out = cpu.node(g, "SWIGLU", "F32", [n_rows, m], [gate, up])
        return g, {tg: stored_g, tu: stored_u, tx: x}, [out]

    return build


@gpu
@pytest.mark.parametrize("dtype", ALL_W)
def test_swiglu_epilogue_gives_the_unfused_bits(dtype, monkeypatch):
    """gate/up MUL_MATs followed by SWIGLU run as one launch that stores silu(gate) * up (M <= 16 on
    the CUDA cores): exactly the bits of the three nodes run apart (PYSPEC_CUDA_FUSE=0), at every
    batch size, and a row's bits alone equal its bits inside a batch that takes the unfused path
    (M = 17)."""
    monkeypatch.setenv("PYSPEC_CUDA_TC", "0")
    n_rows, k = 200, 576
    stored_g, x = mm_inputs(dtype, n_rows, k, 17, seed=31)
    stored_u, _ = mm_inputs(dtype, n_rows, k, 1, seed=32)
    out = {}
    for fuse in ("1", "0"):
        monkeypatch.setenv("PYSPEC_CUDA_FUSE", fuse)
        for m in (1, 2, 3, 5, 16, 17):
            (y,) = run_on(DEVICE, swiglu_ffn_build(stored_g, stored_u, dtype, x[:m], n_rows))
            out[fuse, m] = y.reshape(m, n_rows)
    for m in (1, 2, 3, 5, 16, 17):
        np.testing.assert_array_equal(out["1", m], out["0", m], err_msg=f"M={m}")
        np.testing.assert_array_equal(out["1", m], out["1", 17][:m], err_msg=f"M={m} against M=17")
    (ref,) = run_on("cpu", swiglu_ffn_build(stored_g, stored_u, dtype, x[:5], n_rows))
    np.testing.assert_allclose(out["1", 5], ref.reshape(5, n_rows), rtol=2e-2, atol=2e-2 * np.abs(ref).max())


def norm_then_matmuls_build(dtype, x, norm_w, weights, tail, fetch_norm=False, eps=1e-5):
    """RMS_NORM(x, norm_w) read by MUL_MATs over the same activations: tail "group" (q/k/v-like
    weights of different rows, each fetched), "glu" (gate, up, then SWIGLU) or "residual" (one
    MUL_MAT, then ADD of a residual input). fetch_norm: the norm's output is fetched too (so it
    must reach memory)."""
    m, k = x.shape
    rng = np.random.default_rng(3)
    residual = rng.standard_normal((m, weights[0][2])).astype(np.float32)

    def build():
        g = core.Graph()
        tx = g.input("F32", [k, m], "x")
        tw = g.external("F32", [k], "norm_w")
        h = cpu.node(g, "RMS_NORM", "F32", [k, m], [tx, tw], fparams=[eps])
        feeds = {tx: x, tw: norm_w}
        mms = []
        for name, stored, n_rows in weights:
            t = g.external(dtype, [k, n_rows], name)
            feeds[t] = stored
            mms.append(cpu.node(g, "MUL_MAT", "F32", [n_rows, m], [t, h]))
        if tail == "glu":
            out = [cpu.node(g, "SWIGLU", "F32", [weights[0][2], m], mms)]
        elif tail == "residual":
            tr = g.input("F32", [weights[0][2], m], "residual")
            feeds[tr] = residual
            out = [cpu.node(g, "ADD", "F32", [weights[0][2], m], [mms[0], tr])]
        else:
            out = mms
        return g, feeds, out + ([h] if fetch_norm else [])

    return build


@gpu
@pytest.mark.parametrize("tail", ["group", "glu", "residual", "norm fetched"])
@pytest.mark.parametrize("dtype", ALL_W)
def test_norm_prologue_gives_the_unfused_bits(dtype, tail, monkeypatch):
    """An RMS_NORM whose only readers are the MUL_MATs right after it runs inside their launch at
    M = 1 (decode; the kernel normalises the norm's input as the norm kernel does): the bits of the
    nodes run apart (PYSPEC_CUDA_FUSE=0) for a q/k/v-like group, gate/up with the SwiGLU epilogue
    and one MUL_MAT with the residual epilogue, equal to the same row inside a batch (M = 5, no
    prologue), and where the norm's output is fetched (it must then be stored: no prologue)."""
    k = 576
    rng = np.random.default_rng(41)
    norm_w = (1.0 + 0.3 * rng.standard_normal(k)).astype(np.float32)
    rows = [96, 32, 32] if tail in ("group", "norm fetched") else [80, 80] if tail == "glu" else [72]
    weights = []
    for i, n in enumerate(rows):
        stored, _ = mm_inputs(dtype, n, k, 1, seed=60 + i)
        weights.append((f"w{i}", stored, n))
    _, x = mm_inputs(dtype, 8, k, 5, seed=70)
    x *= 3.0
    out = {}
    for fuse in ("1", "0"):
        monkeypatch.setenv("PYSPEC_CUDA_FUSE", fuse)
        for m in (1, 5):
            b = norm_then_matmuls_build(dtype, x[:m], norm_w, weights, tail.split()[0],
                                        fetch_norm=tail == "norm fetched")
            out[fuse, m] = run_on(DEVICE, b)
    for i, (a, b) in enumerate(zip(out["1", 1], out["0", 1])):
        np.testing.assert_array_equal(a, b, err_msg=f"output {i}, fused against apart")
    for i, (a, b) in enumerate(zip(out["1", 1], out["1", 5])):
        np.testing.assert_array_equal(a.reshape(-1), b.reshape(5, -1)[0], err_msg=f"output {i}, M=1 against M=5")
    ref = run_on("cpu", norm_then_matmuls_build(dtype, x[:1], norm_w, weights, tail.split()[0],
                                                fetch_norm=tail == "norm fetched"))
    for a, b in zip(out["1", 1], ref):
        np.testing.assert_allclose(a, b, rtol=3e-2, atol=3e-2 * np.abs(b).max())


@gpu
@pytest.mark.parametrize("dtype", ALL_W)
def test_mul_mat_rows_are_batch_invariant(dtype, mm_path):
    """A row's result is the same bits alone (M = 1) and at any position of a batch of 4, 16, 64 or
    300 rows, whatever kernel each batch size takes (design.md invariant 7)."""
    n_rows, k = 257, 1024
    stored, x = mm_inputs(dtype, n_rows, k, 300, seed=77)
    alone = {}

    def single(i):
        if i not in alone:
            (y,) = run_on(DEVICE, matmul_build(stored, dtype, x[i: i + 1], n_rows))
            alone[i] = y.reshape(n_rows)
        return alone[i]

    for m in BATCHES[1:]:
        (got,) = run_on(DEVICE, matmul_build(stored, dtype, x[:m], n_rows))
        got = got.reshape(m, n_rows)
        for i in sorted({0, m // 2, m - 1}):
            assert np.array_equal(got[i], single(i)), (m, i)


@gpu
@pytest.mark.parametrize("k", [1024, 576, 200, 2560])
@pytest.mark.parametrize("dtype", ALL_W)
def test_mul_mat_every_row_is_batch_invariant_across_tiles(dtype, k, mm_path):
    """Every row of batches whose sizes straddle the launch shapes' and tiles' edges (1, 7, 8, 9, 31,
    33, 63, 65, 129) equals, bit for bit, the same row in a batch of 300: no row's bits depend on the
    tile, warp, fragment or lane it lands in, nor on the pad columns of a partial tile, nor on which
    tensor-core kernel runs (the narrow one for M <= 16, with 16-byte copies at K = 1024 and 4-byte
    copies for SmolLM2's K = 576 blocks; its K segments run as separate blocks whose partials the
    last one adds, where the wide kernel adds them in registers: 2 segments at K = 576 and 1024, 5
    at Qwen3's K = 2560). K = 200 (float weights only) ends in a partial k tile."""
    if k % 32 and dtype not in FLOAT_W:
        pytest.skip("block types need K % 32 == 0")
    n_rows = 200
    stored, x = mm_inputs(dtype, n_rows, k, 300, seed=k + 31)
    (full,) = run_on(DEVICE, matmul_build(stored, dtype, x, n_rows))
    full = full.reshape(300, n_rows)
    for m in [1, 7, 8, 9, 31, 33, 63, 65, 129]:
        (got,) = run_on(DEVICE, matmul_build(stored, dtype, x[:m], n_rows))
        got = got.reshape(m, n_rows)
        bad = [i for i in range(m) if not np.array_equal(got[i], full[i])]
        assert not bad, (m, bad[:8])


@gpu
@pytest.mark.parametrize("k", [1024, 576])
@pytest.mark.parametrize("dtype", ["F16", "Q4_1", "Q8_0", "F32"])
def test_mul_mat_prompt_columns_take_the_tensor_cores(dtype, k, monkeypatch):
    """By default (PYSPEC_CUDA_TC unset) a MUL_MAT's prompt columns take the tensor-core GEMM and
    the rest the CUDA cores, so a batch's rows get exactly the bits of their kind's path run alone
    over the whole batch (PYSPEC_CUDA_TC=1 and 0), whatever the split: the narrow and the wide
    tensor-core kernel, a lone output row, prompt columns only. F32 weights stay on CUDA cores."""
    n_rows = 200
    stored, x = mm_inputs(dtype, n_rows, k, 80, seed=k + 13)
    monkeypatch.setenv("PYSPEC_CUDA_TC", "1")
    (tc,) = run_on(DEVICE, matmul_build(stored, dtype, x, n_rows))
    monkeypatch.setenv("PYSPEC_CUDA_TC", "0")
    (cores,) = run_on(DEVICE, matmul_build(stored, dtype, x, n_rows))
    tc, cores = tc.reshape(80, n_rows), cores.reshape(80, n_rows)
    monkeypatch.delenv("PYSPEC_CUDA_TC")
    for p, m in [(1, 1), (1, 4), (5, 8), (16, 17), (17, 20), (40, 80), (80, 80), (0, 3)]:
        (got,) = run_on(DEVICE, matmul_build(stored, dtype, x[:m], n_rows, prompt_cols=p))
        got = got.reshape(m, n_rows)
        assert np.array_equal(got[:p], tc[:p]), (p, m, "prompt columns")
        assert np.array_equal(got[p:], cores[p:m]), (p, m, "output columns")


@real_gpu
@pytest.mark.parametrize("dtype", ["F16", "BF16", "Q8_0"])
def test_mul_mat_tensor_core_switch_takes_effect(dtype, monkeypatch):
    """PYSPEC_CUDA_TC=1 really changes the kernel (rounded activations give other low bits than the
    CUDA-core path's F32 activations), so the tensor_cores cases above test what they claim; F32
    weights stay on CUDA cores either way."""
    n_rows, k, m = 64, 512, 16
    stored, x = mm_inputs(dtype, n_rows, k, m, seed=5)
    monkeypatch.setenv("PYSPEC_CUDA_TC", "0")
    (core_out,) = run_on(DEVICE, matmul_build(stored, dtype, x, n_rows))
    monkeypatch.setenv("PYSPEC_CUDA_TC", "1")
    (tc_out,) = run_on(DEVICE, matmul_build(stored, dtype, x, n_rows))
    assert not np.array_equal(core_out, tc_out)
    stored32, x32 = mm_inputs("F32", n_rows, k, m, seed=5)
    (f32_tc,) = run_on(DEVICE, matmul_build(stored32, "F32", x32, n_rows))
    monkeypatch.setenv("PYSPEC_CUDA_TC", "0")
    (f32_core,) = run_on(DEVICE, matmul_build(stored32, "F32", x32, n_rows))
    assert np.array_equal(f32_tc, f32_core)


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
    for shape in ((2, 3, 40), (300, 1, 2560)):
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
@pytest.mark.parametrize("rows", [6, 64])
@pytest.mark.parametrize("n", [1, 7, 40, 257, 4096, 151936])
def test_argmax_first_index_on_ties(n, rows):
    rng = np.random.default_rng(n + rows)
    for x in (cpu.tie_heavy_rows(rng, rows, n), rng.standard_normal((rows, n)).astype(np.float32)):
        got = cpu.reduce_run("ARGMAX", x, backend=DEVICE)[:, 0]
        assert np.array_equal(got, np.argmax(x, axis=1))


@gpu
@pytest.mark.parametrize("rows", [6, 64])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (40, 1), (40, 8), (40, 40), (257, 16), (4096, 40),
                                 (49152, 64), (151936, 40)])
def test_top_k_descending_ties_keep_lower_index(n, k, rows):
    rng = np.random.default_rng(n * 100 + k + rows)
    for x in (cpu.tie_heavy_rows(rng, rows, n), rng.standard_normal((rows, n)).astype(np.float32)):
        got = cpu.reduce_run("TOP_K", x, k, backend=DEVICE)
        assert np.array_equal(got, cpu.top_k_ref(x, k))


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
