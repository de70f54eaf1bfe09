"""Whole models on the CUDA backend (issue 8): the backend choice of every front end and the
model-level checks on the GPU.

Runs anywhere (CPU-only builds included):
- n_gpu_layers=0 (and None) is the CPU everywhere: Model, Context, Drafter, LLM, pyspec-cli -ngl 0,
  pyspec-server -ngl 0.
- llama.cpp's -ngl values: 1 <= N < n_layer is refused (partial offload is not supported yet);
  "all" / N >= n_layer without a usable CUDA backend raises a RuntimeError with the reason
  _core.cuda_available() gives (also backend="cuda" on _core.Context / DraftContext / SpecEngine);
  "auto" falls back to the CPU.

On the GPU (skipped with the reason when _core.cuda_available() is false):
- logits of tiny llama / qwen3 models with F32 / F16 / Q8_0 / Q4_1 weights on CUDA vs the CPU,
  within a tolerance fitting the type (the GPU may round activations differently: F16 for F16
  weights, Q8 blocks or F16 for quantized ones), over mixed batches (prompt chunks and single
  tokens of several sequences, batches past 16 rows and past n_batch);
- mixed batches on CUDA against each sequence decoded alone on CUDA (within the tolerance: the
  kernels are not batch-invariant yet, see tests/test_cuda_matmul.py);
- SpecEngine greedy output on CUDA equals plain greedy decoding on CUDA and the known chain
  (test_speculative.Pairs' known-acceptance pair, whose margins make argmax robust);
- drafter park / restore on CUDA (the KV cache is device memory, read and written through the
  backend): a drafter state parked and restored drafts bit for bit as before, and a SpecEngine
  request reclaimed after a rebase resumes exactly as an uninterrupted run;
- pyspec.LLM / Model(n_gpu_layers=...) and pyspec-server -ngl all on the GPU.

PYSPEC_TEST_DEVICE_BACKEND=cpu runs the GPU tests with the CPU backend in the device's place (the
comparisons then hold trivially), which checks the tests themselves on a machine without a GPU.

On the GPU machine (after building with -DPYSPEC_CUDA=ON):
    python -m pytest -q tests/test_cuda_models.py
"""

from __future__ import annotations


import os

import numpy as np
import pytest

import pyspec
from pyspec import _core
from pyspec.model import resolve_gpu_layers
from pyspec.speculative import Drafter
from tiny_models import write_tiny_model

from test_speculative import Pairs  # noqa: E402  (tests/ is on sys.path under pytest)
from conftest import run_requests  # noqa: E402


from cuda_status import CUDA_OK, CUDA_REASON, DEVICE, gpu, no_cuda, real_gpu, rows_on_the_balanced_grid  # noqa: E402
from default_model import require_default_model  # noqa: E402

# Max |GPU - CPU| logit difference allowed, as a fraction of the largest |logit| of the batch.
LOGIT_TOL = {"F32": 2e-3, "F16": 1e-2, "Q8_0": 4e-2, "Q4_1": 4e-2}
N_CTX_SEQ = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models_cuda")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return Pairs(tmp_path_factory.mktemp("cuda_spec"))


_known = {}


def known_pair(pairs):
    """(target, drafter, f): made once (rewriting the files would pull them from under models
    that have them mapped)."""
    if id(pairs) not in _known:
        target, drafter, f, h, agree = pairs.known_acceptance(0.6, True, seed=3)
        _known[id(pairs)] = (target, drafter, f)
    return _known[id(pairs)]


_tiny = {}


def tiny(model_dir, arch, wt):
    if (arch, wt) not in _tiny:
        tm = write_tiny_model(model_dir / f"{arch}-{wt}.gguf", arch, wt, seed=23)
        _tiny[(arch, wt)] = (tm, pyspec.Model(str(tm.path), n_threads=2))
    return _tiny[(arch, wt)]


# ---------------------------------------------------------------------------------------------
# Backend choice (runs everywhere)


def test_resolve_gpu_layers():
    assert resolve_gpu_layers(None, 4) == "cpu"
    assert resolve_gpu_layers(0, 4) == "cpu"
    assert resolve_gpu_layers("0", 4) == "cpu"
    assert resolve_gpu_layers("auto", 4) == ("cuda" if CUDA_OK else "cpu")
    assert resolve_gpu_layers(-1, 4) == ("cuda" if CUDA_OK else "cpu")
    for partial in (1, 3, "2"):
        with pytest.raises(ValueError, match="partial offload is not supported yet"):
            resolve_gpu_layers(partial, 4)
    for bad in (-2, "lots", 1.5, True):
        with pytest.raises(ValueError, match="n_gpu_layers"):
            resolve_gpu_layers(bad, 4)
    for full in ("all", 4, 99, "99"):
        if CUDA_OK:
            assert resolve_gpu_layers(full, 4) == "cuda"
        else:
            with pytest.raises(RuntimeError, match="CUDA backend cannot be used: " + CUDA_REASON[:20]):
                resolve_gpu_layers(full, 4)


def test_n_gpu_layers_zero_is_the_cpu(pairs):
    default = pyspec.Model(pairs.target, n_threads=2)
    model = pyspec.Model(pairs.target, n_threads=2, n_gpu_layers=0)
    assert default.backend == model.backend == "cpu"
    ctx0, ctx1 = (pyspec.Context(m, n_ctx=64, n_batch=32) for m in (default, model))
    assert ctx0._ctx.backend == ctx1._ctx.backend == "CPU"
    prompt = [3, 9, 27, 81]
    assert np.array_equal(ctx0.decode(prompt).logits, ctx1.decode(prompt).logits)
    dr = Drafter(pairs.drafters["dflash"], model, n_batch=128)
    assert dr.backend == "cpu" and dr.context.backend == "CPU"
    plain = pyspec.LLM(pairs.target, n_ctx=128, n_threads=2)
    llm = pyspec.LLM(pairs.target, n_ctx=128, n_threads=2, n_gpu_layers=0,
                     draft_model=pairs.drafters["dflash"], n_gpu_layers_draft=0)
    assert llm.model.backend == "cpu" and llm.speculative.drafter.backend == "cpu"
    assert llm.generate("Hello", max_tokens=6, temperature=0.0) == \
        plain.generate("Hello", max_tokens=6, temperature=0.0)
    with pytest.raises(ValueError, match="need a draft_model"):
        pyspec.LLM(pairs.target, n_ctx=64, n_threads=1, n_gpu_layers_draft=0)
    with pytest.raises(ValueError, match="n_gpu_layers goes to Model"):
        pyspec.LLM(model, n_ctx=64, n_gpu_layers=0)


def test_partial_offload_is_refused(pairs):
    n_layer = pyspec.Model(pairs.target, n_threads=1).n_layer
    assert n_layer >= 2
    with pytest.raises(ValueError, match="partial offload is not supported yet"):
        pyspec.Model(pairs.target, n_threads=1, n_gpu_layers=1)
    with pytest.raises(ValueError, match="partial offload is not supported yet"):
        pyspec.LLM(pairs.target, n_ctx=64, n_threads=1, n_gpu_layers=n_layer - 1)


@no_cuda
def test_gpu_request_without_cuda_raises_with_the_reason(pairs):
    for ngl in ("all", 99):
        with pytest.raises(RuntimeError, match="CUDA backend cannot be used") as e:
            pyspec.Model(pairs.target, n_threads=1, n_gpu_layers=ngl)
        assert CUDA_REASON in str(e.value)
    with pytest.raises(RuntimeError, match="CUDA backend cannot be used"):
        pyspec.LLM(pairs.target, n_ctx=64, n_threads=1, n_gpu_layers="all")
    with pytest.raises(RuntimeError, match="n_gpu_layers_draft=all"):
        pyspec.LLM(pairs.target, n_ctx=64, n_threads=1, draft_model=pairs.drafters["dflash"],
                   n_gpu_layers_draft="all")
    # "auto" falls back to the CPU.
    assert pyspec.Model(pairs.target, n_threads=1, n_gpu_layers="auto").backend == "cpu"
    model = _core.Model(pairs.target)
    dm = _core.DraftModel(pairs.drafters["dflash"], model)
    for make in (lambda: _core.Context(model, 64, 1, 32, False, 1, "f16", "cuda"),
                 lambda: _core.DraftContext(dm, 1, 64, 1, backend="cuda"),
                 lambda: _core.SpecEngine(model, dm, n_ctx=64, n_seq_max=1, backend="cuda")):
        with pytest.raises(RuntimeError, match="the CUDA backend cannot be used: ") as e:
            make()
        assert CUDA_REASON in str(e.value)
    with pytest.raises(ValueError, match="unknown backend"):
        _core.Context(model, 64, 1, 32, False, 1, "f16", "tpu")


def test_cli_gpu_layers(pairs, capsys):
    from pyspec import cli

    base = ["-m", pairs.target, "-p", "Hi", "-n", "3", "--temp", "0", "-c", "64", "-t", "1"]
    assert cli.main(base + ["-ngl", "0"]) == 0
    err = capsys.readouterr().err
    assert "load: backend CPU" in err and "Traceback" not in err
    assert cli.main(base + ["-ngl", "1"]) == 1
    assert "partial offload is not supported yet" in capsys.readouterr().err
    assert cli.main(base + ["-ngl", "many"]) == 1
    assert "-ngl must be a number of layers" in capsys.readouterr().err
    assert cli.main(base + ["-ngld", "0"]) == 1
    assert "-ngld needs a draft model" in capsys.readouterr().err
    if not CUDA_OK:
        assert cli.main(base + ["-ngl", "all"]) == 1
        err = capsys.readouterr().err
        assert "CUDA backend cannot be used" in err and CUDA_REASON in err
        assert cli.main(base + ["-ngl", "auto"]) == 0
        assert f"load: backend CPU (-ngl auto: {CUDA_REASON})" in capsys.readouterr().err


def _loaded(argv):
    from pyspec.server.args import parse_args
    from pyspec.server.main import Loaded

    return Loaded(parse_args(argv, environ={}))


def test_server_gpu_layers(pairs):
    base = ["-m", pairs.target, "-c", "128", "-t", "1"]
    loaded = _loaded(base + ["-ngl", "0", "-md", pairs.drafters["dflash"]])
    assert loaded.backend == "cpu" and loaded.model.backend == "cpu"
    assert _loaded(base).backend == "cpu"  # not given: the CPU
    with pytest.raises(ValueError, match="partial offload is not supported yet"):
        _loaded(base + ["-ngl", "1"])
    if not CUDA_OK:
        with pytest.raises(RuntimeError, match="CUDA backend cannot be used"):
            _loaded(base + ["-ngl", "all"])
        with pytest.raises(RuntimeError, match="n_gpu_layers_draft=99"):
            _loaded(base + ["-md", pairs.drafters["dflash"], "-ngld", "99"])
        assert _loaded(base + ["-ngl", "auto"]).backend == "cpu"


# ---------------------------------------------------------------------------------------------
# On the GPU

@gpu
@real_gpu
def test_the_default_model_decodes_plainly_on_the_gpu():
    """On the GPU the embedded drafter is slower than plain decoding, so the default model runs
    without it unless speculation is asked for (pyspec.model.embedded_drafter_by_default)."""
    require_default_model()  # the default model's package (absent on bare GPU hosts)
    if pyspec.model.default_drafter_path() is None:
        pytest.skip("this install has no embedded drafter")
    base = ["-c", "256", "-t", "1", "-np", "1", "-ngl", "all"]
    held = _loaded(base)
    assert held.backend == "cuda" and held.drafter is None and held.embedded_drafter_held_back
    on = _loaded(base + ["--spec-type", "draft-dspark"])
    assert on.backend == "cuda" and on.drafter is not None and on.embedded_drafter


def _decode_all(ctx, rows):
    """Decodes rows [(seq, pos, token)] in one call, every row output; logits [n, n_vocab]."""
    seq, pos, tok = (np.array(c) for c in zip(*rows))
    r = ctx.decode(tok, positions=pos, seq_ids=seq, output=np.ones(len(rows), bool))
    return r.logits


def _mixed_steps(rng, n_vocab):
    """Batches of (seq, pos, token): prompts of several sequences, then single tokens mixed with
    prompt chunks; one batch of 40 rows (past the matvec sizes)."""
    def run(seq, p0, n):
        return [(seq, p0 + i, int(t)) for i, t in enumerate(rng.integers(0, n_vocab, n))]
    return [run(0, 0, 7) + run(1, 0, 3),
            run(0, 7, 1) + run(1, 3, 4) + run(2, 0, 20),
            run(2, 20, 1) + run(0, 8, 1) + run(1, 7, 1),
            run(3, 0, 40)]


def _assert_close(got, want, tol, what):
    scale = max(1.0, float(np.max(np.abs(want))))
    diff = float(np.max(np.abs(got.astype(np.float64) - want)))
    assert np.all(np.isfinite(got)), what
    assert diff <= tol * scale, f"{what}: max |diff| {diff:.3g} > {tol} x {scale:.3g}"


@gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("wt", list(LOGIT_TOL))
def test_logits_match_the_cpu(model_dir, arch, wt):
    tm, model = tiny(model_dir, arch, wt)
    kw = dict(n_ctx=N_CTX_SEQ * 4, n_seq_max=4, n_batch=32, check_plans=True)
    cpu = pyspec.Context(model, backend="cpu", **kw)
    dev = pyspec.Context(model, backend=DEVICE, **kw)
    assert dev._ctx.backend == ("CUDA" if DEVICE == "cuda" else "CPU")
    rng = np.random.default_rng(5)
    for i, rows in enumerate(_mixed_steps(rng, model.n_vocab)):  # the 40-row batch is split (n_batch 32)
        _assert_close(_decode_all(dev, rows), _decode_all(cpu, rows), LOGIT_TOL[wt],
                      f"{arch} {wt} batch {i}")
    # Rollback then re-decode on both: the cache bookkeeping is the host's, the cells the device's.
    for ctx in (cpu, dev):
        ctx.kv_remove(0, 4)
    rows = [(0, 4, 11), (0, 5, 12), (1, 8, 13)]
    _assert_close(_decode_all(dev, rows), _decode_all(cpu, rows), LOGIT_TOL[wt], f"{arch} {wt} after rollback")


@gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_qkv_leaves_room_for_the_attention(model_dir, monkeypatch, arch):
    """A one-row decode step's q/k/v launch streams its 16-bit rows (rows over 1 KiB: n_embd 640
    here) and, with PYSPEC_CUDA_ROW_ROOM on (the default), gives as many of its blocks half a
    share of the rows as the decode attention after it has q heads (counted by room_row_launches),
    so that their SMs come free for the attention's blocks while q/k/v runs. Only the items' split
    over blocks changes: the logits of every step equal, bit for bit, those with it off (=0), and
    are within rounding of the CPU's."""
    path = model_dir / f"{arch}-wide-F16.gguf"
    write_tiny_model(path, arch, "F16", seed=29, n_embd=640, n_head=10, n_head_kv=2, head_dim=64, n_ff=768,
                     n_layer=2)
    model = pyspec.Model(str(path), n_threads=2)
    kw = dict(n_ctx=N_CTX_SEQ, n_seq_max=1, n_batch=32)
    prompt, steps = [5, 17, 29, 41, 53, 65, 77], [3, 99, 42, 7, 120]

    def run(backend):
        ctx = pyspec.Context(model, backend=backend, **kw)   # a fresh backend: its graphs captured anew
        out = [ctx.decode(prompt, output=np.ones(len(prompt), bool)).logits]
        out += [ctx.decode([t], output=np.ones(1, bool)).logits for t in steps]
        return out

    logits, room = {}, {}
    for on in ("0", "1"):
        monkeypatch.setenv("PYSPEC_CUDA_ROW_ROOM", on)
        if DEVICE == "cuda":
            _core.reset_cuda_graph_stats()
        logits[on] = run(DEVICE)
        if DEVICE == "cuda":
            room[on] = _core.cuda_graph_stats()["room_row_launches"]
    for a, b in zip(logits["0"], logits["1"]):
        np.testing.assert_array_equal(a, b)
    if DEVICE == "cuda":
        # the group's launch (fusions on) on the CUDA cores' row grid
        streams = rows_on_the_balanced_grid() and all(
            os.environ.get(v) != off for v, off in (("PYSPEC_CUDA_FUSE", "0"), ("PYSPEC_CUDA_TC", "1")))
        assert room["0"] == 0 and (room["1"] >= model.n_layer) == streams, room
    for i, (got, want) in enumerate(zip(logits["1"], run("cpu"))):
        _assert_close(got, want, LOGIT_TOL["F16"], f"{arch} step {i}")


@gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("wt", list(LOGIT_TOL))
def test_matmul_groups_give_the_same_bits(model_dir, monkeypatch, arch, wt):
    """The backend's fusions (PYSPEC_CUDA_FUSE=0 turns them off) change launches, not bits: MUL_MAT
    groups (q/k/v and gate/up as one launch each), the residual ADD in the o/down MUL_MAT's store,
    the SWIGLU in the gate/up launch's store, pairs of row-wise ops (q/k RoPE, K/V SET_ROWS,
    q/k norms), the RoPE pair with the K/V SET_ROWS after it, and in a one-row step those with the
    attention after them. Every batch of the mixed steps (matvec and tiled sizes) gives exactly the unfused
    logits, with 3 MUL_MAT launches fewer per layer on the GPU and, in a 3-row step, no ADD,
    SWIGLU or SET_ROWS launch of their own and one RoPE launch per layer, which also stores K and
    V (the planner keeps those fusions' operands apart); in a one-row step the attention and FFN
    norms run inside their matmuls' launches."""
    tm, model = tiny(model_dir, arch, wt)
    kw = dict(n_ctx=N_CTX_SEQ * 4, n_seq_max=4, n_batch=32, check_plans=True)
    logits, launches = {}, {}
    for fuse in ("0", "1"):
        monkeypatch.setenv("PYSPEC_CUDA_FUSE", fuse)
        ctx = pyspec.Context(model, backend=DEVICE, **kw)   # a fresh backend: no graphs captured yet
        rng = np.random.default_rng(5)
        logits[fuse] = [_decode_all(ctx, rows) for rows in _mixed_steps(rng, model.n_vocab)]
        ctx.kv_clear()
        # prompt rows among output rows: the prompt columns take their own path (tensor cores
        # by default), the output rows the fused kernels
        r = ctx.decode(np.arange(40, 60) % model.n_vocab, output=np.arange(20) % 3 == 0,
                       layer_inputs=[model.n_layer])
        logits[fuse] += [r.logits, r.layer_inputs[model.n_layer]]
        ctx.kv_clear()
        ctx._ctx.set_profiling(True)
        ctx.decode([3, 9, 27], output=np.ones(3, bool))  # three output rows, as a verify step
        ctx._ctx.set_profiling(False)
        launches[fuse] = dict((name, calls) for name, _, calls in ctx._ctx.op_profile())
        ctx.kv_clear()
        ctx.decode([3, 9, 27], output=np.zeros(3, bool))
        ctx._ctx.set_profiling(True)
        logits[fuse].append(ctx.decode([81], output=np.ones(1, bool)).logits)  # a decode step
        ctx._ctx.set_profiling(False)
        total = dict((name, calls) for name, _, calls in ctx._ctx.op_profile())  # profiles add up
        launches[fuse, 1] = {name: n - launches[fuse].get(name, 0) for name, n in total.items()}
    for a, b in zip(logits["0"], logits["1"]):
        np.testing.assert_array_equal(a, b)
    if DEVICE == "cuda":
        # one row: the attention and FFN norms run as their matmuls' prologues (on the CUDA
        # cores: not with every row on tensor cores); Qwen3's q/k norms stay a pair. The output
        # norm runs in the output head's launch too: it is its input's last reader, and the
        # planner keeps that input apart from the logits (a prologue reads it while the head
        # stores; the backend checks).
        qk_pairs = model.n_layer if arch == "qwen3" else 0
        on_cores = not (os.environ.get("PYSPEC_CUDA_TC") == "1" and wt != "F32")
        left = launches["1", 1].get("RMS_NORM", 0) - qk_pairs
        assert left == (0 if on_cores else 2 * model.n_layer + 1), launches["1", 1]
        assert launches["0", 1]["RMS_NORM"] == 2 * qk_pairs + 2 * model.n_layer + 1
        # one row: the q/k RoPE, the K/V store and the attention (and Qwen3's q/k norms, whose pair
        # the launch then replaces) are one launch of the attention kernel (cuda::DecodeRope),
        # counted under the first of them
        rope_attention = all(os.environ.get(v) != "0" for v in ("PYSPEC_CUDA_ATT_ROPE", "PYSPEC_CUDA_ATT_STAGED"))
        one = launches["1", 1]
        assert one.get("ROPE", 0) == (0 if rope_attention and qk_pairs else model.n_layer), one
        assert one.get("ATTENTION", 0) == (0 if rope_attention else model.n_layer), one
        fused, apart = launches["1"], launches["0"]
        # three rows (a verify step): the norms are prologues too (tiles of up to 4 columns)
        left3 = fused.get("RMS_NORM", 0) - qk_pairs
        assert left3 in ((0, 1) if on_cores else (2 * model.n_layer + 1,)), fused
        assert apart["MUL_MAT"] - fused["MUL_MAT"] == 3 * model.n_layer
        # the SwiGLU epilogue is the CUDA-core kernel's; output rows take the tensor cores only
        # with PYSPEC_CUDA_TC=1 (every weight type here but F32), which keeps SWIGLU a launch of
        # its own
        tensor_cores = os.environ.get("PYSPEC_CUDA_TC") == "1" and wt != "F32"
        assert fused.get("ADD", 0) == 0, fused
        assert fused.get("SWIGLU", 0) == (model.n_layer if tensor_cores else 0), fused
        assert fused["ROPE"] == model.n_layer and fused.get("SET_ROWS", 0) == 0, fused
        assert apart["ROPE"] == apart["SET_ROWS"] == apart["ADD"] == 2 * model.n_layer, apart
        assert apart["SWIGLU"] == model.n_layer, apart


@gpu
def test_op_profile_on_the_device(model_dir, monkeypatch):
    """The device backend's op profile lists the ops the CPU's lists, with the same call counts
    (one entry per op run), positive times, and profiling leaves the results unchanged."""
    monkeypatch.setenv("PYSPEC_CUDA_FUSE", "0")   # one launch per MUL_MAT, as the CPU
    tm, model = tiny(model_dir, "llama", "F16")
    kw = dict(n_ctx=N_CTX_SEQ, n_seq_max=1, n_batch=32)
    plain = pyspec.Context(model, backend=DEVICE, **kw).decode([3, 9, 27, 81]).logits
    profs = {}
    for backend in ("cpu", DEVICE):
        ctx = pyspec.Context(model, backend=backend, **kw)
        ctx._ctx.set_profiling(True)
        for _ in range(2):
            ctx.kv_clear()
            logits = ctx.decode([3, 9, 27, 81]).logits
        ctx._ctx.set_profiling(False)
        ctx.kv_clear()
        ctx.decode([3, 9, 27, 81])                  # not counted
        profs[backend] = {name: (sec, calls) for name, sec, calls in ctx._ctx.op_profile()}
        if backend == DEVICE:
            np.testing.assert_array_equal(logits, plain)
    assert {k: v[1] for k, v in profs["cpu"].items()} == {k: v[1] for k, v in profs[DEVICE].items()}
    assert profs[DEVICE]["MUL_MAT"][1] % 2 == 0 and all(sec > 0 for sec, _ in profs[DEVICE].values())


@gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_batches_on_the_device(model_dir, arch):
    """A mixed batch on the device gives each row what decoding its sequence alone gives (within
    the tolerance while the kernels are not batch-invariant), also with its rows shuffled."""
    tm, model = tiny(model_dir, arch, "F16")
    rng = np.random.default_rng(9)
    steps = _mixed_steps(rng, model.n_vocab)
    kw = dict(n_ctx=N_CTX_SEQ * 4, n_seq_max=4, n_batch=64, backend=DEVICE)
    mixed = pyspec.Context(model, **kw)
    alone = pyspec.Context(model, **kw)
    shuffled = pyspec.Context(model, **kw)
    for rows in steps:
        got = _decode_all(mixed, rows)
        perm = rng.permutation(len(rows))
        got_shuffled = _decode_all(shuffled, [rows[i] for i in perm])
        want = np.empty_like(got)
        for s in sorted({r[0] for r in rows}):
            idx = [i for i, r in enumerate(rows) if r[0] == s]
            want[idx] = _decode_all(alone, [rows[i] for i in idx])
        _assert_close(got, want, 1e-2, f"{arch} mixed vs alone")
        _assert_close(got_shuffled, got[perm], 1e-2, f"{arch} shuffled")


def _prompt_case(model_dir, arch, seed, n):
    """A tiny F16 model, an n-token prompt (sequence 0), 12 tokens of another sequence, the layer
    inputs to compare and the context's settings."""
    tm, model = tiny(model_dir, arch, "F16")
    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(0, model.n_vocab, n)]
    other = [int(t) for t in rng.integers(0, model.n_vocab, 12)]
    kw = dict(n_ctx=N_CTX_SEQ * 2, n_seq_max=2, n_batch=64, backend=DEVICE)
    return model, rng, prompt, other, [1, model.n_layer], kw


def _prompt_in_shuffled_chunks(ctx, prompt, other, sizes, layers, rng, marked=False):
    """Decodes `prompt` (sequence 0) in chunks of `sizes` rows, each chunk shuffled with one output
    row of sequence 1 (`other`); the prompt's last row wants logits. marked: sequence 0's rows are
    marked prompt rows (Context.decode's prompt=), its last one with logits too. Returns sequence
    0's layer inputs by position and the logits of its last row."""
    n = len(prompt)
    got = {il: None for il in layers}
    last, p0 = None, 0
    for o, size in enumerate(sizes):
        rows = [(0, p, prompt[p], p == n - 1) for p in range(p0, p0 + size)] + [(1, o, other[o], True)]
        rows = [rows[i] for i in rng.permutation(len(rows))]
        seq, pos, tok, want_out = (np.array(c) for c in zip(*rows))
        r = ctx.decode(tok, positions=pos, seq_ids=seq, output=want_out, layer_inputs=layers,
                       prompt=(seq == 0) if marked else None)
        assert list(r.output_rows) == sorted(r.output_rows), "logits must come back in batch order"
        for i, (s_, p_) in enumerate(zip(seq, pos)):
            if s_ == 0:
                for il in layers:
                    if got[il] is None:
                        got[il] = np.zeros((n, r.layer_inputs[il].shape[1]), r.layer_inputs[il].dtype)
                    got[il][p_] = r.layer_inputs[il][i]
                if p_ == n - 1:
                    last = r.logits[list(r.output_rows).index(i)]
        p0 += size
    assert p0 == n
    return got, last


@gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prompt_rows_keep_their_bits_in_any_batch(model_dir, arch, monkeypatch):
    """Rows that want no logits are prompt rows (runtime/context.h): by default the GPU runs their
    matrix products on tensor cores and output rows on CUDA cores. A prompt row's bits are its own:
    its layer inputs and the logits after it are the same decoding the prompt in one call, or in
    chunks mixed with another sequence's output rows in shuffled order. The same rows decoded as
    output rows take the other path: close, and the same bits once PYSPEC_CUDA_TC=0 puts every row
    on the CUDA cores."""
    monkeypatch.delenv("PYSPEC_CUDA_TC", raising=False)
    model, rng, prompt, other, layers, kw = _prompt_case(model_dir, arch, seed=21, n=37)
    n = len(prompt)

    def one_call(outputs):
        ctx = pyspec.Context(model, **kw)
        out = np.zeros(n, bool) if not outputs else np.ones(n, bool)
        out[-1] = True
        r = ctx.decode(prompt, output=out, layer_inputs=layers)
        return r.layer_inputs, r.logits[-1]

    alone, last = one_call(False)
    got, mixed_last = _prompt_in_shuffled_chunks(pyspec.Context(model, **kw), prompt, other,
                                                 (5, 1, 16, 9, 6), layers, rng)
    for il in layers:
        np.testing.assert_array_equal(got[il], alone[il], err_msg=f"layer {il} input")
    np.testing.assert_array_equal(mixed_last, last)

    as_outputs, _ = one_call(True)
    _assert_close(as_outputs[model.n_layer], alone[model.n_layer], 2e-2, "prompt rows against output rows")
    if CUDA_OK and DEVICE == "cuda":
        assert not np.array_equal(as_outputs[model.n_layer][:-1], alone[model.n_layer][:-1]), \
            "prompt rows took the output rows' path"
    monkeypatch.setenv("PYSPEC_CUDA_TC", "0")
    cores, _ = one_call(False)
    cores_as_outputs, _ = one_call(True)
    np.testing.assert_array_equal(cores[model.n_layer], cores_as_outputs[model.n_layer])


@gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prompt_rows_with_logits_keep_their_bits_in_any_batch(model_dir, arch, monkeypatch):
    """A prompt's last row marked a prompt row (Context.decode(prompt=True)) gives its logits from
    the prompt rows' path: the prompt pass itself yields the first token, with no second pass over
    every weight for one output row. Its bits are its own: one call, or chunks shuffled among
    another sequence's output rows (logits back in batch order), give the same logits and layer
    inputs; the last row decoded as an output row instead takes the other path (close, and not
    the same bits on a GPU), and PYSPEC_CUDA_TC=0 puts both on the CUDA cores, bit for bit."""
    monkeypatch.delenv("PYSPEC_CUDA_TC", raising=False)
    model, rng, prompt, other, layers, kw = _prompt_case(model_dir, arch, seed=23, n=29)

    def one_call(marked):
        r = pyspec.Context(model, **kw).decode(prompt, layer_inputs=layers, prompt=True if marked else None)
        return r.layer_inputs, r.logits[-1]

    alone, last = one_call(True)
    got, mixed_last = _prompt_in_shuffled_chunks(pyspec.Context(model, **kw), prompt, other,
                                                 (4, 1, 11, 8, 5), layers, rng, marked=True)
    for il in layers:
        np.testing.assert_array_equal(got[il], alone[il], err_msg=f"layer {il} input")
    np.testing.assert_array_equal(mixed_last, last)
    default, default_last = one_call(False)
    np.testing.assert_array_equal(default[1][:-1], alone[1][:-1])  # the other prompt rows: one path
    _assert_close(default_last, last, 2e-2, "the last row as an output row against as a prompt row")
    if CUDA_OK and DEVICE == "cuda":
        assert not np.array_equal(default[model.n_layer][-1], alone[model.n_layer][-1]), \
            "the marked last row took the output rows' path"
    monkeypatch.setenv("PYSPEC_CUDA_TC", "0")
    np.testing.assert_array_equal(one_call(True)[1], one_call(False)[1])


@gpu
@pytest.mark.parametrize("wt", ["F16", "Q8_0"])
def test_wide_batch_backend_keeps_one_path_per_row(model_dir, wt, monkeypatch):
    """A context made for 8 sequences or more (cuda/kernels.h, kTcAllRowsMinSeqs; 16 here) runs every row of
    a float weight on tensor cores: its steps (output rows only) give a sequence the same logits
    alone or batched with 15 others (invariant 7 with that backend), those of a one-sequence context
    with PYSPEC_CUDA_TC=1, and logits close to but not the bits of a one-sequence context's
    CUDA-core output rows. Block-type weights keep the CUDA cores for output rows in either
    context."""
    monkeypatch.delenv("PYSPEC_CUDA_TC", raising=False)
    tm, model = tiny(model_dir, "qwen3", wt)
    rng = np.random.default_rng(77)
    prompts = [[int(t) for t in rng.integers(0, model.n_vocab, 5 + s)] for s in range(16)]

    def steps(n_seq_max, batched):
        """Sequence 0's logits over 3 decode steps after its prompt, with the other 15 sequences in
        the same calls (batched) or not decoded at all."""
        ctx = pyspec.Context(model, n_ctx=N_CTX_SEQ * n_seq_max, n_seq_max=n_seq_max, n_batch=128,
                             backend=DEVICE)
        seqs = range(16) if batched else range(1)
        rows = [(s, p, t) for s in seqs for p, t in enumerate(prompts[s])]
        seq, pos, tok = (np.array(c) for c in zip(*rows))
        # every row an output row: no prompt rows, whose attention has a path of its own by default
        # but not under PYSPEC_CUDA_TC=1
        ctx.decode(tok, positions=pos, seq_ids=seq, output=np.ones(len(rows), bool))
        out = []
        for step in range(3):
            rows = [(s, len(prompts[s]) + step, 7 * s + step + 1) for s in seqs]
            out.append(_decode_all(ctx, rows)[0])
        return np.stack(out)

    wide_alone, wide_batched = steps(16, False), steps(16, True)
    np.testing.assert_array_equal(wide_alone, wide_batched)
    narrow = steps(1, False)
    _assert_close(wide_alone, narrow, LOGIT_TOL[wt], "wide-batch backend against one sequence's")
    monkeypatch.setenv("PYSPEC_CUDA_TC", "1")
    all_tc = steps(1, False)
    if wt == "F16":
        np.testing.assert_array_equal(wide_alone, all_tc)
        if CUDA_OK and DEVICE == "cuda":
            assert not np.array_equal(wide_alone, narrow), "the wide-batch backend took the CUDA cores"
    else:
        np.testing.assert_array_equal(wide_alone, narrow)


@gpu
@pytest.mark.parametrize("arch,hp", [("qwen3", dict(head_dim=64)),
                                     ("llama", dict(n_embd=256, n_head=2, n_head_kv=1, n_ff=128))],
                         ids=["qwen3-d64", "llama-d128"])
def test_prompt_attention_on_tensor_cores_in_a_model(model_dir, monkeypatch, arch, hp):
    """Prefill then decode with heads whose prompt rows take the tensor-core attention on the GPU
    (head_dim 64 and 128; cuda/ops_attention_tc.cu): the logits of the prompt's last row and of each
    decoded token are close to the CPU's; the prompt rows' layer inputs are the same bits decoded in
    one call or in chunks beside another sequence's output rows, shuffled; PYSPEC_CUDA_ATT_TC=0 puts
    their attention back on the CUDA cores (close, other bits)."""
    monkeypatch.delenv("PYSPEC_CUDA_TC", raising=False)
    monkeypatch.delenv("PYSPEC_CUDA_ATT_TC", raising=False)
    tm = write_tiny_model(model_dir / f"{arch}-att-tc.gguf", arch, "F16", seed=31, **hp)
    model = pyspec.Model(str(tm.path), n_threads=2)
    rng = np.random.default_rng(33)
    n = 100
    prompt = [int(t) for t in rng.integers(0, model.n_vocab, n)]
    then = [int(t) for t in rng.integers(0, model.n_vocab, 6)]  # decoded one by one, teacher-forced
    other = [int(t) for t in rng.integers(0, model.n_vocab, 4)]
    layers = [1, model.n_layer]
    kw = dict(n_ctx=256, n_seq_max=2, n_batch=128)

    def prefill_and_decode(backend):
        ctx = pyspec.Context(model, backend=backend, **kw)
        r = ctx.decode(prompt, layer_inputs=layers)  # rows 0..98 prompt rows, the last an output row
        logits = [r.logits[-1]] + [ctx.decode([t]).logits[-1] for t in then]
        return r.layer_inputs, np.stack(logits)

    inputs, logits = prefill_and_decode(DEVICE)
    _, cpu_logits = prefill_and_decode("cpu")
    for i in range(len(logits)):
        _assert_close(logits[i], cpu_logits[i], LOGIT_TOL["F16"], f"{arch} step {i}")

    got, _ = _prompt_in_shuffled_chunks(pyspec.Context(model, backend=DEVICE, **kw), prompt, other,
                                        (37, 1, 40, 22), layers, rng)
    for il in layers:
        np.testing.assert_array_equal(got[il], inputs[il], err_msg=f"layer {il} input, in chunks")

    monkeypatch.setenv("PYSPEC_CUDA_ATT_TC", "0")
    cores, cores_logits = prefill_and_decode(DEVICE)
    _assert_close(cores[model.n_layer], inputs[model.n_layer], 2e-2, "attention on the CUDA cores")
    for i in range(len(logits)):
        _assert_close(cores_logits[i], cpu_logits[i], LOGIT_TOL["F16"], f"{arch} step {i}, CUDA cores")
    if CUDA_OK and DEVICE == "cuda":
        assert not np.array_equal(cores[model.n_layer][:-1], inputs[model.n_layer][:-1]), \
            "prompt rows' attention did not take the tensor cores"


@gpu
def test_prompt_cache_reuse_equals_fresh_on_the_device(pairs):
    """The engine's prompt cache on the GPU: a second turn reusing the first's cached rows gives
    the tokens of a fresh request. With the prompt rows' own path only the first turn's prompt
    rows can be reused, its last included (its output rows hold other bits); on the CPU every row
    can."""
    target, e, _ = _known_engine(pairs, DEVICE, n_seq_max=2, n_slots=2)
    keep = dict(seq=0, keep_cache=True, reuse_cache=True, verify="greedy")
    p1 = [3, 17, 29, 3, 3, 100, 101, 102, 7, 40, 41, 42, 43, 44, 45, 46, 9, 9, 12, 13]

    def run_one(eng, rid, prompt, n, **kw):
        eng.add_request(rid, prompt, max_tokens=n, **kw)
        toks, stats = [], None
        while eng.has_request(rid):
            for o in eng.step():
                toks += o["tokens"]
                stats = o["stats"]
        return toks, stats

    out1, _ = run_one(e, 1, p1, 12, **keep)
    p2 = p1 + out1[:5] + [50, 51, 52]
    got, st = run_one(e, 2, p2, 15, **keep)
    _, fresh, _ = _known_engine(pairs, DEVICE, n_seq_max=2, n_slots=2)
    want, st_fresh = run_one(fresh, 3, p2, 15, verify="greedy")
    assert st_fresh["n_cached"] == 0
    assert got == want
    own_path = CUDA_OK and DEVICE == "cuda" and os.environ.get("PYSPEC_CUDA_TC") is None
    assert st["n_cached"] == (len(p1) if own_path else len(p1) + 5)


def _known_engine(pairs, backend, n_seq_max=1, n_slots=1, **kw):
    target, drafter, f = known_pair(pairs)
    model = _core.Model(target)
    dm = _core.DraftModel(drafter, model)
    engine = _core.SpecEngine(model, dm, n_ctx=256 * n_seq_max, n_seq_max=n_seq_max,
                              n_draft_slots=n_slots, n_batch=64, draft_n_batch=128, n_threads=2,
                              draft_n_max=5, prefill_chunk=16, backend=backend, **kw)
    return target, engine, f


def _run(engine, requests, hook=None):
    """{id: (prompt, max_tokens)} -> {id: (tokens, verified blocks, stats)}."""
    for rid, (prompt, n) in requests.items():
        engine.add_request(rid, prompt, max_tokens=n, verify="greedy")
    runs = run_requests(engine, (lambda outs: hook(engine)) if hook else None)
    assert all(runs[rid].stop_reason for rid in requests)
    return {rid: (runs[rid].tokens, runs[rid].blocks, runs[rid].stats) for rid in requests}


@gpu
def test_spec_engine_greedy_equals_plain_greedy(pairs):
    target, engine, f = _known_engine(pairs, DEVICE, n_seq_max=4, n_slots=4)
    prompts = {1: [5], 2: [17, 3], 3: [40, 41, 42, 43, 44, 45, 46], 4: list(range(100, 140))}
    got = _run(engine, {rid: (p, 30) for rid, p in prompts.items()})
    model = pyspec.Model(target, n_threads=2)
    ctx = pyspec.Context(model, n_ctx=256, n_batch=64, backend=DEVICE)
    for rid, prompt in prompts.items():
        ctx.kv_clear()
        plain = pyspec.generate(ctx, prompt, 30)
        chain = [prompt[-1]]
        for _ in range(30):
            chain.append(int(f[chain[-1]]))
        assert got[rid][0] == plain == chain[1:], rid
    # The drafter helped, and was checked.
    accepted = sum(g[2]["draft_n_accepted"] for g in got.values())
    assert 0 < accepted < sum(g[2]["draft_n"] for g in got.values())


@gpu
@pytest.mark.parametrize("layout", ["dflash", "dspark-anchor"])
def test_drafter_park_restore_on_the_device(pairs, layout):
    """A parked drafter state (cells read from device memory) restored into its own slot drafts
    bit for bit as before; restored into another slot, the same tokens."""
    model = pyspec.Model(pairs.target, n_threads=2)
    dm = _core.DraftModel(pairs.drafters[layout], model._model)
    dctx = _core.DraftContext(dm, 2, 48, 2, backend=DEVICE)
    assert dctx.backend == ("CUDA" if DEVICE == "cuda" else "CPU")
    ctx = pyspec.Context(model, n_ctx=256, n_batch=64, backend=DEVICE)
    layers = [int(x) for x in dm.target_layers]
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, model.n_vocab, 90).tolist()
    for p0 in range(0, 90, 30):  # past the window of 48: the slot rebases (K re-rotated on the device)
        res = ctx.decode(prompt[p0:p0 + 30], positions=np.arange(p0, p0 + 30), layer_inputs=layers)
        feats = np.concatenate([res.layer_inputs[lid] for lid in layers], axis=1)
        dctx.inject(0, np.arange(p0, p0 + 30, dtype=np.int32), feats)
    assert dctx.pos_base(0) > 0
    n_block = int(dm.block_size)
    before = dctx.draft_logits(0, prompt[-1], 90, n_block)
    state = dctx.park(0)
    assert state.n_bytes > 0 and state.pos_base == dctx.pos_base(0)
    dctx.clear(0)  # and overwrite its cells with something else
    dctx.inject(0, np.arange(0, 20, dtype=np.int32), np.ones((20, feats.shape[1]), np.float32))
    dctx.restore(0, state)
    dctx.restore(1, state)
    again = dctx.draft_logits(0, prompt[-1], 90, n_block)
    other = dctx.draft_logits(1, prompt[-1], 90, n_block)
    for key in ("logits", "tokens", "candidates"):
        assert np.array_equal(again[key], before[key]), key
    assert np.array_equal(other["tokens"], before["tokens"])
    _assert_close(other["logits"], before["logits"], 1e-4, "restored into another slot")
    assert dctx.seq_pos_max(1) == dctx.seq_pos_max(0) and dctx.n_rows(1) == dctx.n_rows(0)


@gpu
def test_spec_engine_reclaim_after_rebase_on_the_device(pairs):
    """A request whose drafter slot rebased is paused, its slot reclaimed (parked from device
    memory) by another request, and resumed (restored): its output, verified blocks and stats
    equal an uninterrupted run's. Each of its steps has the same batches in both runs, so the
    comparison is exact whatever the kernels' batch variance."""
    model = _core.Model(pairs.target)
    dm = _core.DraftModel(pairs.drafters["dflash"], model)

    def engine():
        return _core.SpecEngine(model, dm, n_ctx=2 * 512, n_seq_max=2, n_draft_slots=1,
                                n_batch=64, draft_n_batch=48, n_threads=2, draft_n_max=5,
                                prefill_chunk=40, backend=DEVICE)

    rng = np.random.default_rng(4)
    a = rng.integers(0, 256, 150).tolist()
    b = rng.integers(0, 256, 30).tolist()
    alone = _run(engine(), {0: (a, 40)})[0]

    e = engine()
    e.add_request(0, a, max_tokens=40, verify="greedy")
    based = []
    phase = "a"

    def between(outs):
        nonlocal phase
        if phase == "a" and e.steps == 6:
            based.append(e.draft_pos_base(e.draft_slot(0)))
            e.pause(0)
            e.add_request(1, b, max_tokens=12, verify="greedy")
            phase = "b"
        elif phase == "b" and not e.has_request(1):
            assert e.draft_slot(0) is None  # reclaimed by request 1
            e.resume(0)
            phase = "resumed"

    run = run_requests(e, between)[0]
    tokens, blocks, stats = run.tokens, run.blocks, run.stats
    assert run.stop_reason and phase == "resumed" and based and based[0] > 0
    assert stats["n_restaged"] == 1
    assert tokens == alone[0] and blocks == alone[1]
    st, ref = dict(stats), dict(alone[2])
    st.pop("n_restaged"), ref.pop("n_restaged")
    assert st == ref


@real_gpu
def test_front_ends_on_the_gpu(pairs):
    target, drafter, f = known_pair(pairs)
    for ngl in ("all", 99, "auto", -1):
        assert pyspec.Model(target, n_threads=1, n_gpu_layers=ngl).backend == "cuda"
    plain = pyspec.LLM(target, n_ctx=128, n_threads=2, n_gpu_layers="all")
    assert plain.context._ctx.backend == "CUDA"
    spec = pyspec.LLM(target, n_ctx=128, n_threads=2, n_gpu_layers=99, draft_model=drafter)
    assert spec.speculative.drafter.backend == "cuda"
    assert spec.speculative.drafter.context.backend == "CUDA"
    want = plain.generate("Hello", max_tokens=20, temperature=0.0, ignore_eos=True)
    assert spec.generate("Hello", max_tokens=20, temperature=0.0, ignore_eos=True) == want
    assert spec.last_stats.spec.draft_n_accepted > 0
    many = spec.generate_many(["Hello", "Hi there"], max_tokens=20, ignore_eos=True)
    assert many[0].text == want
    # The drafter on the CPU under a GPU target: fine for the one-sequence loop ...
    split = pyspec.LLM(target, n_ctx=128, n_threads=2, n_gpu_layers="all", draft_model=drafter,
                       n_gpu_layers_draft=0)
    assert split.speculative.drafter.backend == "cpu"
    assert split.generate("Hello", max_tokens=20, temperature=0.0, ignore_eos=True) == want
    # ... but the multi-request engine runs both on one backend.
    with pytest.raises(ValueError, match="needs both on one backend"):
        split.generate_many(["Hello"], max_tokens=4)
    loaded = _loaded(["-m", target, "-md", drafter, "-c", "128", "-t", "1", "-ngl", "all"])
    assert loaded.backend == "cuda"
    with pytest.raises(ValueError, match="needs both on one backend"):
        _loaded(["-m", target, "-md", drafter, "-c", "128", "-t", "1", "-ngl", "all",
                 "-ngld", "0"])
