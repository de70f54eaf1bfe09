"""MUL_MAT on the CUDA backend (issue 8): every weight type, batch sizes M = 1, 4, 16, 64, 300 (every
launch shape of the fixed-order kernels), strided operands, both paths (CUDA cores, tensor cores),
and the fusions around it (groups, the residual and SwiGLU epilogues, the norm prologue).

MUL_MAT may round activations as the GPU chooses (F16 for F16 weights, BF16 for BF16 weights, Q8
blocks or F16 for quantized weights), so it is held to the error that choice allows against a
float64 product with the dequantized weights, and to the CPU within the sum of both bounds. A
row's result must not depend on its batch (design.md invariant 7, "on the CPU and on the GPU"):
rows are compared bit for bit alone and in batches. Shared pieces: tests/cuda_op_helpers.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import test_cpu_ops as cpu  # the CPU tests' helpers, references and op cases
from cuda_op_helpers import ALL_W, BATCHES, FLOAT_W, assert_close_bound, dev_and_cpu, run_on
from cuda_status import DEVICE, gpu, real_gpu, rows_on_the_balanced_grid
from pyspec import _core as core


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


@gpu
@pytest.mark.parametrize("balance", ["1", "0", "evict_first"])
@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_long_row_streams_over_many_rows_give_the_batched_bits(dtype, balance, monkeypatch):
    """One column over many long 16-bit rows takes the row-streaming kernels (cuda/matmul_rows.cuh),
    whose balanced grid gives each warp several items (two rows, or a gate and an up row) once the
    rows outnumber 2 blocks x 8 warps a SM: every row of a plain MUL_MAT (an odd row count, so the
    last item's second row is a clamped read) and of the fused gate/up/SWIGLU equals, bit for bit,
    the same row in a batch of 5 (another kernel), on both grids (PYSPEC_CUDA_ROW_BALANCE), with
    and without the weight loads' L2 evict-first hint (PYSPEC_CUDA_L2_EVICT_FIRST); and the product
    is within rounding of the CPU's."""
    monkeypatch.setenv("PYSPEC_CUDA_TC", "0")
    monkeypatch.setenv("PYSPEC_CUDA_ROW_BALANCE", "0" if balance == "0" else "1")
    monkeypatch.setenv("PYSPEC_CUDA_L2_EVICT_FIRST", "1" if balance == "evict_first" else "0")
    n_rows, k = 6151, 640
    stored, x = mm_inputs(dtype, n_rows, k, 5, seed=41)
    (one,) = run_on(DEVICE, matmul_build(stored, dtype, x[:1], n_rows))
    (five,) = run_on(DEVICE, matmul_build(stored, dtype, x, n_rows))
    np.testing.assert_array_equal(one.reshape(n_rows), five.reshape(5, n_rows)[0])
    (ref,) = run_on("cpu", matmul_build(stored, dtype, x[:1], n_rows))
    np.testing.assert_allclose(one.reshape(n_rows), ref.reshape(n_rows), rtol=2e-2,
                               atol=2e-2 * np.abs(ref).max())
    n_ff = 4363
    stored_g, _ = mm_inputs(dtype, n_ff, k, 1, seed=42)
    stored_u, _ = mm_inputs(dtype, n_ff, k, 1, seed=43)
    (g1,) = run_on(DEVICE, swiglu_ffn_build(stored_g, stored_u, dtype, x[:1], n_ff))
    (g5,) = run_on(DEVICE, swiglu_ffn_build(stored_g, stored_u, dtype, x, n_ff))
    np.testing.assert_array_equal(g1.reshape(n_ff), g5.reshape(5, n_ff)[0])
    (gref,) = run_on("cpu", swiglu_ffn_build(stored_g, stored_u, dtype, x[:1], n_ff))
    np.testing.assert_allclose(g1.reshape(n_ff), gref.reshape(n_ff), rtol=2e-2,
                               atol=2e-2 * np.abs(gref).max())


def off_and_on(monkeypatch, var, counter, builds):
    """Runs each of builds (name -> graph) with var=0 and then var=1: the outputs by (value, name),
    and the CUDA graph counter `counter` over each value's runs (0 off the GPU)."""
    out, counted = {}, {}
    for on in ("0", "1"):
        monkeypatch.setenv(var, on)
        if DEVICE == "cuda":
            core.reset_cuda_graph_stats()
        for name, build in builds.items():
            (out[on, name],) = run_on(DEVICE, build)
        counted[on] = core.cuda_graph_stats()[counter] if DEVICE == "cuda" else 0
    return out, counted


@gpu
@pytest.mark.parametrize("grid", ["one_block", "two_blocks"])
@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_row_streams_fed_piped_give_the_same_bits(dtype, grid, monkeypatch):
    """One column over long 16-bit rows with several items a warp (a plain MUL_MAT of 3,001 rows,
    an odd count so the last item's second row is a clamped read, and a gate/up/SWIGLU of 2,051),
    each row 325 units long so that a lane's last round of 4 units is partly past the row's end,
    and lanes differ in how much: with PYSPEC_CUDA_ROW_PIPED on (the default) the launches are fed
    piped (counted by piped_row_launches), each warp's items one stream of rounds, the next item's
    first round asked for during this item's last, on one block of 16 warps a SM (the default,
    counted by one_block_row_launches) or two of 8 (PYSPEC_CUDA_ROW_PIPED_ONE_BLOCK=0). Every row
    equals, bit for bit, the plain feed's (=0) and the same row in a batch of 5 (another
    kernel), and is within rounding of the CPU's."""
    monkeypatch.setenv("PYSPEC_CUDA_TC", "0")
    monkeypatch.setenv("PYSPEC_CUDA_ROW_PIPED_ONE_BLOCK", "1" if grid == "one_block" else "0")
    k, n_rows, n_ff = 2600, 3001, 2051
    stored, x = mm_inputs(dtype, n_rows, k, 5, seed=59)
    stored_g, _ = mm_inputs(dtype, n_ff, k, 1, seed=61)
    stored_u, _ = mm_inputs(dtype, n_ff, k, 1, seed=67)
    out, piped = off_and_on(monkeypatch, "PYSPEC_CUDA_ROW_PIPED", "piped_row_launches", {
        "mm": matmul_build(stored, dtype, x[:1], n_rows),
        "glu": swiglu_ffn_build(stored_g, stored_u, dtype, x[:1], n_ff)})
    assert piped["0"] == 0 and piped["1"] == (2 if rows_on_the_balanced_grid() else 0), piped
    if DEVICE == "cuda":  # the last value's runs (piped on): on the grid asked for
        one_block = core.cuda_graph_stats()["one_block_row_launches"]
        assert one_block == (piped["1"] if grid == "one_block" else 0), one_block
    for name, n, build in (("mm", n_rows, lambda xx: matmul_build(stored, dtype, xx, n_rows)),
                           ("glu", n_ff, lambda xx: swiglu_ffn_build(stored_g, stored_u, dtype, xx, n_ff))):
        np.testing.assert_array_equal(out["1", name], out["0", name], err_msg=name)
        (five,) = run_on(DEVICE, build(x))
        np.testing.assert_array_equal(out["1", name].reshape(n), five.reshape(5, n)[0], err_msg=name)
        (ref,) = run_on("cpu", build(x[:1]))
        np.testing.assert_allclose(out["1", name].reshape(n), ref.reshape(n), rtol=2e-2,
                                   atol=2e-2 * np.abs(ref).max(), err_msg=name)


@gpu
@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_row_streams_on_the_deep_grid_give_the_same_bits(dtype, monkeypatch):
    """One column over long 16-bit rows few enough for one block of 10 warps a SM at one item a
    warp (Qwen3-4B's down is 2,560 rows of 9,728; here 1,201 rows, an odd count so the last item's
    second row is a clamped read): with PYSPEC_CUDA_ROW_DEEP on (the default) the launch takes that
    grid (counted by deep_row_launches), each warp keeping 8 units a lane in flight. Every row
    equals, bit for bit, the launch without it (=0) and the same row in a batch of 5 (another
    kernel), and is within rounding of the CPU's."""
    monkeypatch.setenv("PYSPEC_CUDA_TC", "0")
    n_rows, k = 1201, 9728
    stored, x = mm_inputs(dtype, n_rows, k, 5, seed=53)
    runs, deep = off_and_on(monkeypatch, "PYSPEC_CUDA_ROW_DEEP", "deep_row_launches",
                            {"mm": matmul_build(stored, dtype, x[:1], n_rows)})
    out = {on: runs[on, "mm"] for on in ("0", "1")}
    assert deep["0"] == 0 and (deep["1"] > 0) == rows_on_the_balanced_grid(), deep
    np.testing.assert_array_equal(out["1"], out["0"])
    (five,) = run_on(DEVICE, matmul_build(stored, dtype, x, n_rows))
    np.testing.assert_array_equal(out["1"].reshape(n_rows), five.reshape(5, n_rows)[0])
    (ref,) = run_on("cpu", matmul_build(stored, dtype, x[:1], n_rows))
    np.testing.assert_allclose(out["1"].reshape(n_rows), ref.reshape(n_rows), rtol=2e-2,
                               atol=2e-2 * np.abs(ref).max())


@real_gpu
@pytest.mark.parametrize("ring", ["16", "8", "8-start"])
@pytest.mark.parametrize("tail", ["plain", "group", "glu", "residual"])
@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_row_groups_through_the_copy_engine_give_the_row_streams_bits(dtype, tail, ring, monkeypatch):
    """One column over long 16-bit rows, every part whole groups of 8 rows and K whole stages (512
    columns, 256 for gate/up), takes the row groups the copy engine feeds (k_mul_mat_rows_tma,
    counted by row_tma_launches): its bits equal the row-streaming kernel's (PYSPEC_CUDA_ROW_TMA=0)
    and the same row's in a batch of 5, plain (12,048 rows: two waves of groups on some blocks), for
    a q/k/v-like group, gate/up with SwiGLU and one MUL_MAT with the residual (those three with
    the norm prologue), with either ring (PYSPEC_CUDA_ROW_TMA_STAGES) and the next launch let in
    first (PYSPEC_CUDA_ROW_TMA_TRIGGER=start); and within rounding of the CPU."""
    monkeypatch.setenv("PYSPEC_CUDA_TC", "0")
    stages, _, trigger = ring.partition("-")
    monkeypatch.setenv("PYSPEC_CUDA_ROW_TMA_STAGES", stages)
    monkeypatch.setenv("PYSPEC_CUDA_ROW_TMA_TRIGGER", trigger)
    k = 1280 if tail == "glu" else 1536
    _, x = mm_inputs(dtype, 8, k, 5, seed=90)
    if tail == "plain":
        stored, _ = mm_inputs(dtype, 12048, k, 1, seed=91)
        build = lambda xs: matmul_build(stored, dtype, xs, 12048)  # noqa: E731
    else:
        rng = np.random.default_rng(92)
        norm_w = (1.0 + 0.3 * rng.standard_normal(k)).astype(np.float32)
        rows = {"group": [1024, 256, 256], "glu": [2048, 2048], "residual": [1536]}[tail]
        weights = [(f"w{i}", mm_inputs(dtype, n, k, 1, seed=93 + i)[0], n) for i, n in enumerate(rows)]
        build = lambda xs: norm_then_matmuls_build(dtype, xs, norm_w, weights, tail)  # noqa: E731
    out, launches, prologues = {}, {}, {}
    for on in ("0", "1"):  # the kernel under test last: a graph replayed from the other run would show
        monkeypatch.setenv("PYSPEC_CUDA_ROW_TMA", on)
        core.reset_cuda_graph_stats()
        out[on] = run_on(DEVICE, build(x[:1]))
        launches[on] = core.cuda_graph_stats()["row_tma_launches"]
        prologues[on] = core.cuda_graph_stats()["norm_prologue_launches"]
    assert launches["1"] > 0 and launches["0"] == 0, launches
    assert (prologues["1"] > 0) == (tail != "plain"), prologues
    five = run_on(DEVICE, build(x))
    ref = run_on("cpu", build(x[:1]))
    for i, (a, b, f, r) in enumerate(zip(out["1"], out["0"], five, ref)):
        np.testing.assert_array_equal(a, b, err_msg=f"output {i}: row groups against row streams")
        np.testing.assert_array_equal(a.reshape(-1), f.reshape(5, -1)[0], err_msg=f"output {i}: against M=5")
        np.testing.assert_allclose(a, r, rtol=3e-2, atol=3e-2 * np.abs(r).max(), err_msg=f"output {i}")


@real_gpu
@pytest.mark.parametrize("tail", ["plain", "group", "glu"])
def test_row_group_kinds_pick_which_matmuls_take_them(tail, monkeypatch):
    """PYSPEC_CUDA_ROW_TMA_KINDS (with PYSPEC_CUDA_ROW_TMA=1) narrows the copy-engine row groups
    to some kinds of MUL_MAT, for A/B in the model: n those with the norm prologue (q/k/v), g
    gate/up with SwiGLU, p the rest (o, down, the output head). A kind named takes them, a kind
    left out keeps the row-streaming kernel: counted by row_tma_launches, the same bits either way."""
    monkeypatch.setenv("PYSPEC_CUDA_TC", "0")
    monkeypatch.setenv("PYSPEC_CUDA_ROW_TMA", "1")
    mine = {"plain": "p", "group": "n", "glu": "g"}[tail]
    k = 1024
    _, x = mm_inputs("F16", 8, k, 1, seed=95)
    if tail == "plain":
        stored, _ = mm_inputs("F16", 1024, k, 1, seed=96)
        build = lambda: matmul_build(stored, "F16", x, 1024)  # noqa: E731
    else:
        norm_w = (1.0 + 0.3 * np.random.default_rng(97).standard_normal(k)).astype(np.float32)
        rows = [512, 128, 128] if tail == "group" else [512, 512]
        weights = [(f"w{i}", mm_inputs("F16", n, k, 1, seed=98 + i)[0], n) for i, n in enumerate(rows)]
        build = lambda: norm_then_matmuls_build("F16", x, norm_w, weights, tail)  # noqa: E731
    out, launches = {}, {}
    for kinds in ("ngp".replace(mine, ""), mine):
        monkeypatch.setenv("PYSPEC_CUDA_ROW_TMA_KINDS", kinds)
        core.reset_cuda_graph_stats()
        out[kinds] = run_on(DEVICE, build())
        launches[kinds] = core.cuda_graph_stats()["row_tma_launches"]
    others = "ngp".replace(mine, "")
    assert launches[mine] > 0 and launches[others] == 0, launches
    for i, (a, b) in enumerate(zip(out[mine], out[others])):
        np.testing.assert_array_equal(a, b, err_msg=f"output {i}")


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
@pytest.mark.parametrize("early", ["0", "1"], ids=["", "norm_early"])
@pytest.mark.parametrize("tail", ["group", "glu", "residual", "norm fetched"])
@pytest.mark.parametrize("dtype", ALL_W)
def test_norm_prologue_gives_the_unfused_bits(dtype, tail, early, monkeypatch):
    """An RMS_NORM whose only readers are the MUL_MATs right after it runs inside their launch at
    M = 1 to 4 (decode, verify, draft blocks; the kernel normalises the norm's inputs as the norm
    kernel does, M = 3 in a tile of 4): the bits of the nodes run apart (PYSPEC_CUDA_FUSE=0) for a
    q/k/v-like group, gate/up with the SwiGLU epilogue and one MUL_MAT with the residual epilogue,
    each row equal to the same row inside a batch (M = 5, no prologue), and where the norm's output
    is fetched (it must then be stored: no prologue). Each way also with the norm's weights copied
    into shared memory before the PDL wait (PYSPEC_CUDA_NORM_EARLY, on by default: the row-streaming
    launches, 16-bit weights at M = 1, counted by early_norm_launches) and without."""
    monkeypatch.setenv("PYSPEC_CUDA_NORM_EARLY", early)
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
    staged_any = False
    for fuse in ("1", "0"):
        monkeypatch.setenv("PYSPEC_CUDA_FUSE", fuse)
        for m in (1, 2, 3, 4, 5):
            b = norm_then_matmuls_build(dtype, x[:m], norm_w, weights, tail.split()[0],
                                        fetch_norm=tail == "norm fetched")
            core.reset_cuda_graph_stats()
            out[fuse, m] = run_on(DEVICE, b)
            if DEVICE == "cuda":  # the prologue ran where it should (the comparison is not vacuous)
                ran = core.cuda_graph_stats()["norm_prologue_launches"] > 0
                assert ran == (fuse == "1" and m <= 4 and tail != "norm fetched"), (fuse, m)
                staged = core.cuda_graph_stats()["early_norm_launches"] > 0
                assert not staged or (ran and early == "1" and m == 1), (fuse, m)
                staged_any = staged_any or staged
    # The row-streaming kernels take 16-bit weights' M = 1 unless the environment sends rows elsewhere.
    rows_stream = DEVICE == "cuda" and dtype in ("F16", "BF16") and tail != "norm fetched" and all(
        os.environ.get(v) != off for v, off in (("PYSPEC_CUDA_TC", "1"), ("PYSPEC_CUDA_ROW_STREAM", "0"),
                                                ("PYSPEC_CUDA_ROW_TMA", "1")))
    if early == "1" and rows_stream:
        assert staged_any, "no launch staged the norm's weights"
    for m in (1, 2, 3, 4):
        for i, (a, b) in enumerate(zip(out["1", m], out["0", m])):
            np.testing.assert_array_equal(a, b, err_msg=f"output {i}, M={m}, fused against apart")
        for i, (a, b) in enumerate(zip(out["1", m], out["1", 5])):
            np.testing.assert_array_equal(a.reshape(m, -1), b.reshape(5, -1)[:m],
                                          err_msg=f"output {i}, M={m} against M=5")
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


def written_weights_case(dtype, n_rows=96, k=2048):
    """A graph whose MUL_MAT reads weights that a SET_ROWS writes right before it (a zero matrix
    filled with random rows), and the same product over the rows as a plain leaf."""
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((n_rows, k)).astype(np.float32)
    x = rng.standard_normal((1, k)).astype(np.float32)
    zeros = cpu.encode(np.zeros((n_rows, k), np.float32), dtype)

    def written():
        g = core.Graph()
        tw = g.external(dtype, [k, n_rows], "w")
        tr = g.input("F32", [k, n_rows], "rows")
        ti = g.input("I32", [n_rows], "ids")
        tx = g.input("F32", [k, 1], "x")
        ts = g.set_rows(tw, tr, ti)
        out = cpu.node(g, "MUL_MAT", "F32", [n_rows, 1], [ts, tx])
        return g, {tw: zeros.copy(), tr: rows, ti: np.arange(n_rows, dtype=np.int32), tx: x}, [out]

    return written, matmul_build(cpu.encode(rows, dtype), dtype, x, n_rows)


@gpu
@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_weights_written_in_the_graph_are_read_after_the_write(dtype):
    """A one-row MUL_MAT over long 16-bit rows loads its first weight units before waiting for the
    kernel before it, but only for weights no node of the graph writes: here SET_ROWS fills a zero
    matrix right before the MUL_MAT reads it, so weights loaded early would be zeros. The result
    is the CPU backend's for the written rows (and for the same weights as a plain leaf, bit for
    bit the same as here). The GPU rarely shows that race by itself (the SET_ROWS is done before
    the MUL_MAT's blocks start): the test below checks the launch decision itself."""
    written, leaf_build = written_weights_case(dtype)
    (got,), (ref,) = dev_and_cpu(written)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    (leaf,) = run_on(DEVICE, leaf_build)
    np.testing.assert_array_equal(got.reshape(-1), leaf.reshape(-1))


@real_gpu
@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_weights_a_node_writes_are_never_loaded_early(dtype):
    """The backend's launch decision behind the test above, counted (cuda_graph_stats'
    early_weight_launches): the leaf weights' MUL_MAT loads before its PDL wait, the written
    weights' never does. Treating every leaf as constant, SET_ROWS's target included, fails here."""
    written, leaf_build = written_weights_case(dtype)
    core.reset_cuda_graph_stats()
    run_on(DEVICE, leaf_build)
    if core.cuda_graph_stats()["early_weight_launches"] == 0:
        pytest.skip("this mode sends one-row MUL_MATs elsewhere (tensor cores, no row streaming)")
    core.reset_cuda_graph_stats()
    run_on(DEVICE, written)
    assert core.cuda_graph_stats()["early_weight_launches"] == 0


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


WGMMA = bool(getattr(core, "cuda_wgmma_gemm", lambda: False)())


@real_gpu
@pytest.mark.skipif(not WGMMA, reason="the wide tensor-core MUL_MAT does not run on wgmma here (Hopper, sm_90a)")
@pytest.mark.parametrize("feed", ["tma", "cp.async"])
@pytest.mark.parametrize("cfg", ["L", "M", "S"])
@pytest.mark.parametrize("k", [200, 576, 2560])
@pytest.mark.parametrize("dtype", [d for d in ALL_W if d != "F32"])  # F32 never takes the tensor cores
def test_wgmma_gemm_gives_the_mma_sync_bits(dtype, k, cfg, feed, monkeypatch):
    """The wide tensor-core MUL_MAT on wgmma, fed by TMA (cuda/matmul_tc_tma.cu) or by cp.async
    (cuda/matmul_tc_wgmma.cu, PYSPEC_CUDA_WGMMA_TMA=0), gives every output the bits of
    the mma.sync GEMM (PYSPEC_CUDA_WGMMA=0), in every launch configuration (forced by
    PYSPEC_CUDA_WGMMA_CFG: by default such small matrices stay on mma.sync): K split over blocks
    (M = 17, 64: 3 row tiles leave the GPU idle) and not (M = 130, 600), partial row and column
    tiles, a last stage of one 32-value tile (K = 576) and a partial one (K = 200, float weights),
    weights read in place (F16, BF16) and converted (block types). The bits the narrow kernel and
    the M = 300 batch give are checked by the batch-invariance tests above (cuda_check.sh's mode
    `wgmma` runs them with every wide call on wgmma)."""
    if k % 32 and dtype not in FLOAT_W:
        pytest.skip("block types need K % 32 == 0")
    n_rows = 300
    monkeypatch.setenv("PYSPEC_CUDA_TC", "1")
    for m in [17, 64, 130, 600]:
        stored, x = mm_inputs(dtype, n_rows, k, m, seed=k + m)
        monkeypatch.setenv("PYSPEC_CUDA_WGMMA", "0")
        (ref,) = run_on(DEVICE, matmul_build(stored, dtype, x, n_rows))
        monkeypatch.delenv("PYSPEC_CUDA_WGMMA")
        monkeypatch.setenv("PYSPEC_CUDA_WGMMA_CFG", cfg)
        monkeypatch.setenv("PYSPEC_CUDA_WGMMA_TMA", "1" if feed == "tma" else "0")
        (got,) = run_on(DEVICE, matmul_build(stored, dtype, x, n_rows))
        monkeypatch.delenv("PYSPEC_CUDA_WGMMA_CFG")
        monkeypatch.delenv("PYSPEC_CUDA_WGMMA_TMA")
        bad = np.flatnonzero(got.reshape(-1).view(np.uint32) != ref.reshape(-1).view(np.uint32))
        assert bad.size == 0, (m, bad.size, bad[:8])


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


