#!/usr/bin/env python3
"""pyspec on the CUDA backend against llama.cpp's H200 figures (issue 8, "Speed").

Models: random-weight GGUFs shaped like SmolLM2-135M Q4_1 and Qwen3-4B F16 (tools/make_random_gguf.py;
--make DIR writes them there unless present), or GGUF paths given as arguments (a llama file is
compared with SmolLM2's figures, a qwen3 file with Qwen3-4B's).

tg128: after an 8-token prompt (not timed), 128 single-token decodes, each feeding the greedy
       choice of the previous step; tokens / s. Two paths, as par64: "context" (pyspec.Context.decode,
       the logits copied to the host and numpy's argmax) and "engine" (_core.SpecEngine without a
       drafter, one request, the argmax in the graph: the server's path); the faster is the row's
       figure, both are printed (--tg-mode picks one).
tg32@dN (--only ...,tgdepth; --depth N, default 4096): 32 single-token decodes after an N-token
       prompt (not timed), as llama-bench's -d N: what long-context attention costs a step.
pp512: one 512-token prompt from an empty cache (logits of the last row); tokens / s.
par64: 64 sequences with a --par-prompt token prompt each (not timed), then 128 steps, each one
       decode of one token per sequence, greedy; generated tokens / s in total. Two honest paths:
       "context" (pyspec.Context(n_seq_max=64).decode + numpy argmax over the 64 rows) and
       "engine" (_core.SpecEngine without a drafter, greedy, draft=False: the server's path); the
       faster is the row's figure, both are printed.
Each figure is the best of --repeats runs after a warm-up run (which also uploads the weights).
Timing is time.perf_counter around calls that return host logits (the backend's read()
synchronises), so no torch.cuda is needed. Bandwidth: bytes of weights one decode step reads
(every matrix once; the tied embedding once as the output matrix) / tg128 time per token.

    python bench/bench_cuda.py --make /tmp/models                     # both presets, on the GPU
    python bench/bench_cuda.py /tmp/models/qwen3-4b-f16.gguf --only tg128,par64
    python bench/bench_cuda.py --cpu --make /tmp/tiny --preset tiny   # CPU smoke test
(with an in-place build, from the repo root: PYTHONPATH=. python bench/bench_cuda.py ...)
"""

from __future__ import annotations

import argparse
import os
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# llama.cpp 0c1e570, -ngl 99 -fa 1, one H200 (issue 8).
REFERENCE = {
    "smollm2": {"tg128": 921.0, "pp512": 55300.0},
    "qwen3": {"tg128": 273.0, "pp512": 30000.0, "par64": 6557.0},
}
# (arch, n_layer, n_embd, n_vocab) a model must have to be compared with the figures.
FULL_SHAPES = {"smollm2": ("llama", 30, 576, 49152), "qwen3": ("qwen3", 36, 2560, 151936)}
GOALS = {"tg128": 1.5, "pp512": 1.0, "par64": 1.2}
PEAK_BW = 4.3e12   # bytes/s the H200 copies at (device-to-device, read + write)
PRESET_SETS = {
    "full": [("smollm2", "smollm2-135m-q4_1"), ("qwen3", "qwen3-4b-f16")],
    "tiny": [("smollm2", "tiny-llama-q4_1"), ("qwen3", "tiny-qwen3-f16")],
}


def load_tool():
    spec = importlib.util.spec_from_file_location("make_random_gguf",
                                                  ROOT / "tools" / "make_random_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_random_gguf"] = mod
    spec.loader.exec_module(mod)
    return mod


def weight_bytes_per_token(path: str) -> int:
    """Bytes of weights one decode step reads: every tensor but token_embd (a row lookup), plus
    token_embd again when it is also the output matrix (tied)."""
    import gguf
    r = gguf.GGUFReader(path)
    names = {t.name: int(t.n_bytes) for t in r.tensors}
    total = sum(v for k, v in names.items() if k != "token_embd.weight")
    if "output.weight" not in names:
        total += names["token_embd.weight"]
    return total


def best_of(fn, repeats: int, warmup: int = 1, prep=None):
    """(best time, all times) of fn after `warmup` untimed runs (weight upload, graph capture);
    prep, if given, runs untimed before every call (resetting the cache)."""
    for _ in range(warmup):
        if prep:
            prep()
        fn()
    times = []
    for _ in range(repeats):
        if prep:
            prep()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), times


def bench_pp(model, ids, repeats):
    import pyspec
    n = len(ids)
    ctx = pyspec.Context(model, n_ctx=max(1024, 2 * n), n_seq_max=1, n_batch=n)

    def run():
        ctx.kv_clear()
        # Every row a prompt row, the last with logits, as the engine prefills (returns host
        # logits: synchronised).
        ctx.decode(ids, prompt=True)
    t, _ = best_of(run, repeats)
    return n / t


def bench_tg(model, ids, n_gen, repeats):
    import pyspec
    ctx = pyspec.Context(model, n_ctx=1024, n_seq_max=1, n_batch=512)
    prompt = ids[:8]
    state = {}

    def prep():
        ctx.kv_clear()
        state["tok"] = int(np.argmax(ctx.decode(prompt).logits[-1]))

    def run():
        tok = state["tok"]
        for _ in range(n_gen):
            tok = int(np.argmax(ctx.decode([tok]).logits[-1]))

    return n_gen / best_of(run, repeats, prep=prep)[0]


def bench_tg_engine(model, ids, n_gen, repeats):
    """tg128 on the server's path: one greedy request on a SpecEngine without a drafter; the steps
    after the one that prefilled the prompt and gave the first token are timed."""
    from pyspec import _core
    engine = _core.SpecEngine(model._model, None, n_ctx=1024, n_seq_max=1, n_draft_slots=1,
                              n_batch=512, draft_n_batch=512, n_threads=model.n_threads,
                              draft_n_max=-1, prefill_chunk=512, backend=model.backend)
    prompt = [int(x) for x in ids[:8]]

    def one_run() -> float:
        engine.add_request(0, prompt, max_tokens=n_gen + 1, draft=False, **ENGINE_REQUEST_OPTIONS)
        n_first = 0
        while not n_first:  # the prompt's pass gives the first token (not timed)
            n_first = sum(len(o["tokens"]) for o in engine.step())
        n, t0 = 0, time.perf_counter()
        while engine.n_requests:
            n += sum(len(o["tokens"]) for o in engine.step())
        t = time.perf_counter() - t0
        if n != n_gen:
            raise RuntimeError(f"engine gave {n} timed tokens, expected {n_gen}")
        return n / t

    one_run()
    best = max(one_run() for _ in range(repeats))
    note_ahead(engine)
    return best


def bench_tg_depth(model, n_vocab, depth, n_gen, repeats):
    """Decode n_gen tokens after a prompt of depth tokens (llama-bench's tg at -d depth): what
    long-context attention costs a decode step."""
    import pyspec
    rng = np.random.default_rng(1)
    prompt = [int(x) for x in rng.integers(256, n_vocab - 3, size=depth)]
    ctx = pyspec.Context(model, n_ctx=depth + n_gen + 64, n_seq_max=1, n_batch=512)
    state = {}

    def prep():
        ctx.kv_clear()
        for p0 in range(0, depth, 512):
            logits = ctx.decode(prompt[p0:p0 + 512]).logits
        state["tok"] = int(np.argmax(logits[-1]))

    def run():
        tok = state["tok"]
        for _ in range(n_gen):
            tok = int(np.argmax(ctx.decode([tok]).logits[-1]))

    return n_gen / best_of(run, repeats, prep=prep)[0]


def bench_par_context(model, ids, n_par, n_prompt, n_steps, repeats):
    import pyspec
    n_ctx_seq = n_prompt + n_steps + 16
    ctx = pyspec.Context(model, n_ctx=n_ctx_seq * n_par, n_seq_max=n_par,
                         n_batch=max(512, n_par))
    seqs = np.arange(n_par, dtype=np.int32)
    state = {}

    def prep():
        ctx.kv_clear()
        last = np.empty(n_par, np.int64)
        for s in range(n_par):
            prompt = [ids[(s * 7 + j) % len(ids)] for j in range(n_prompt)]
            last[s] = int(np.argmax(ctx.decode(prompt, seq_ids=[s] * n_prompt).logits[-1]))
        state["tok"] = last
        state["pos"] = np.full(n_par, n_prompt, np.int32)

    def run():
        tok, pos = state["tok"], state["pos"].copy()
        out = np.ones(n_par, np.bool_)
        for _ in range(n_steps):
            logits = ctx.decode(tok, positions=pos, seq_ids=seqs, output=out).logits
            tok = np.argmax(logits, axis=1)
            pos += 1

    return n_par * n_steps / best_of(run, repeats, prep=prep)[0]


# What the last engine bench's engine did ahead (decoding ahead: steps queued before the host read
# the one before; overruled: sampled rows whose graph draw the host's own draw overruled), printed
# beside its figure.
ENGINE_NOTE: dict = {}


def note_ahead(engine) -> None:
    ENGINE_NOTE["text"] = (f"{engine.n_decoded_ahead} steps decoded ahead, "
                           f"{engine.n_ahead_overruled} rows overruled")


# add_request options of the engine paths: greedy, or (--sample) llama-server's default chain;
# --ignore-eos adds the server's -inf bias on the end ids.
GREEDY = dict(temperature=0.0, verify="greedy")
SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, verify="rejection")
ENGINE_REQUEST_OPTIONS: dict = dict(GREEDY)
PENALISE_FIRST = False  # --penalise-one


def bench_par_engine(model, ids, n_par, n_prompt, n_steps, repeats):
    from pyspec import _core
    n_ctx_seq = n_prompt + n_steps + 16
    engine = _core.SpecEngine(model._model, None, n_ctx=n_ctx_seq * n_par, n_seq_max=n_par,
                              n_draft_slots=1, n_batch=max(512, n_par), draft_n_batch=512,
                              n_threads=model.n_threads, draft_n_max=-1, prefill_chunk=256,
                              kv_dtype="f16", backend=model.backend)

    def one_run() -> float:
        # max_tokens leaves room past n_steps: every timed step runs all n_par sequences; the
        # requests are cancelled once n_steps steps with all of them generating were timed.
        for s in range(n_par):
            prompt = [int(ids[(s * 7 + j) % len(ids)]) for j in range(n_prompt)]
            opts = dict(ENGINE_REQUEST_OPTIONS)
            if s == 0 and PENALISE_FIRST:
                opts["repeat_penalty"] = 1.1  # reads its logits: a serving mix, one client's setting
            engine.add_request(s, prompt, max_tokens=n_steps + 64, draft=False, seed=s, **opts)
        started = set()        # requests that emitted their first token (prefill done)
        t_gen, n_gen, n_timed = 0.0, 0, 0
        while engine.n_requests and n_timed < n_steps:
            all_generating = len(started) == n_par
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            emitted = 0
            for o in outs:
                emitted += len(o["tokens"])
                if o["tokens"]:
                    started.add(int(o["request_id"]))
            if all_generating:
                t_gen += dt
                n_gen += emitted
                n_timed += 1
        for s in range(n_par):
            engine.cancel(s)
        while engine.n_requests:
            engine.step()
        if n_timed < n_steps or n_gen != n_steps * n_par:
            raise RuntimeError(f"engine ran {n_timed} full steps giving {n_gen} tokens, expected "
                               f"{n_steps} and {n_steps * n_par}")
        return n_gen / t_gen

    one_run()
    best = max(one_run() for _ in range(repeats))
    note_ahead(engine)
    return best


def profile_steps(model, ids, n_gen: int, n_prompt: int, top: int = 12) -> dict:
    """Where a decode step and a prompt pass spend their time: wall time per call (host +
    device, synchronised by the logits read) against the device time of each op kind (the
    backend's op profile: CUDA events around every op, graph replay off while profiling), and the
    CUDA-graph counters over an unprofiled decode run (are steps replayed?)."""
    import pyspec
    from pyspec import _core
    out = {}
    ctx = pyspec.Context(model, n_ctx=1024, n_seq_max=1, n_batch=512)
    tok = int(np.argmax(ctx.decode(ids[:8]).logits[-1]))
    if hasattr(_core, "reset_cuda_graph_stats"):
        _core.reset_cuda_graph_stats()
    t0 = time.perf_counter()
    for _ in range(n_gen):
        tok = int(np.argmax(ctx.decode([tok]).logits[-1]))
    wall = (time.perf_counter() - t0) / n_gen
    if hasattr(_core, "cuda_graph_stats"):
        out["graph_stats_decode"] = dict(_core.cuda_graph_stats())
    for label, run, n in (("decode step", lambda: ctx.decode([tok]), n_gen),
                          (f"prompt pass ({n_prompt} tokens)", None, 3)):
        if run is None:
            pctx = pyspec.Context(model, n_ctx=max(1024, 2 * n_prompt), n_seq_max=1,
                                  n_batch=n_prompt)
            pctx.decode(ids[:n_prompt], prompt=True)

            def run(pctx=pctx):
                pctx.kv_clear()
                pctx.decode(ids[:n_prompt], prompt=True)
            c = pctx._ctx
        else:
            c = ctx._ctx
        c.set_profiling(True)
        t0 = time.perf_counter()
        for _ in range(n):
            run()
        w = (time.perf_counter() - t0) / n
        c.set_profiling(False)
        prof = sorted(c.op_profile(), key=lambda r: -r[1])
        dev = sum(r[1] for r in prof) / n
        print(f"  profile, {label}: wall {w * 1e3:.3f} ms (unprofiled decode step "
              f"{wall * 1e3:.3f} ms), device time in ops {dev * 1e3:.3f} ms, "
              f"{sum(r[2] for r in prof) // n} ops per call", flush=True)
        for name, sec, calls in prof[:top]:
            print(f"    {name:<14} {sec / n * 1e3:8.3f} ms  {calls // n:5d} calls  "
                  f"{100 * sec / max(1e-12, sum(r[1] for r in prof)):5.1f}%", flush=True)
        out[label] = {"wall_s": w, "device_s": dev,
                      "ops": [(nm, s / n, cl // n) for nm, s, cl in prof]}
    if "graph_stats_decode" in out:
        print(f"  CUDA graphs over {n_gen} unprofiled decode steps: {out['graph_stats_decode']}",
              flush=True)
    return out


def run_paths(test, choice, fns, call):
    """{path: t/s} of each of test's paths ("context", "engine"; choice "both" or one of them);
    one path failing must not lose the other's figure."""
    per = {}
    for mode in (list(fns) if choice == "both" else [choice]):
        t0 = time.perf_counter()
        try:
            per[mode] = call(fns[mode])
        except Exception as e:
            print(f"  {test} {mode}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        note = f"; {ENGINE_NOTE.pop('text')}" if mode == "engine" and "text" in ENGINE_NOTE else ""
        print(f"  {test} {mode}: {per[mode]:.1f} t/s ({time.perf_counter() - t0:.1f}s{note})", flush=True)
    return per


def print_step_times(stats, tokens_per_s):
    """A decode token's wall time (the best repeat) split into the GPU's time for its replayed
    graph (mean over every timed replay of the run) and the rest: host work and gaps."""
    n = stats.get("timed_replays", 0)
    if not n or not tokens_per_s:
        print("    step times: no replay was timed", flush=True)
        return
    gpu = stats["replay_gpu_ns"] / n / 1e3
    wall = 1e6 / tokens_per_s
    print(f"    step times: GPU {gpu:.0f} us a replayed step ({n} timed), wall {wall:.0f} us a token: "
          f"host and gaps {wall - gpu:.0f} us ({100 * (wall - gpu) / wall:.0f}%)", flush=True)


def fmt_rate(x):
    if x is None:
        return "-"
    return f"{x / 1000:.1f}k" if x >= 10000 else f"{x:.0f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("models", nargs="*", help="GGUF paths (default: --make's)")
    ap.add_argument("--make", metavar="DIR", help="write the preset models into DIR (kept if present)")
    ap.add_argument("--preset", choices=sorted(PRESET_SETS), default="full",
                    help="with --make: full-size presets or tiny ones (CPU smoke test)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU backend (smoke test)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (model n_threads)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="tg128,pp512,par64",
                    help="comma list of tg128, pp512, par64, tgdepth (tg32 after --depth prompt tokens)")
    ap.add_argument("--depth", type=int, default=4096, help="prompt tokens before tgdepth's decode")
    ap.add_argument("--par", type=int, default=64, help="parallel sequences for par64")
    ap.add_argument("--par-prompt", type=int, default=32, help="prompt tokens per sequence (par64)")
    ap.add_argument("--par-steps", type=int, default=128)
    ap.add_argument("--par-mode", choices=["context", "engine", "both"], default="both")
    ap.add_argument("--par-all", action="store_true", help="par64 for every model, not only qwen3")
    ap.add_argument("--tg-mode", choices=["context", "engine", "both"], default="both")
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--profile", action="store_true",
                    help="also print where a decode step and a prompt pass spend their time "
                         "(per-op device time, CUDA-graph replays)")
    ap.add_argument("--step-times", action="store_true",
                    help="tg128: also time each replayed step's graph on the GPU (events; "
                         "PYSPEC_CUDA_STEP_TIMES=1) and print the host's share of a token's wall time")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="engine paths: requests ban the end-of-generation ids with -inf biases, as "
                         "pyspec-server does for ignore_eos (what serving benchmarks send)")
    ap.add_argument("--sample", action="store_true",
                    help="engine paths sample with llama-server's defaults (T 0.8, top-k 40, top-p 0.95, "
                         "min-p 0.05) instead of decoding greedily")
    ap.add_argument("--penalise-one", action="store_true",
                    help="par64's first request sets repeat_penalty 1.1, so its rows are read whole")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    if args.step_times:
        os.environ["PYSPEC_CUDA_STEP_TIMES"] = "1"  # read by each CUDA backend when it is made

    import pyspec
    from pyspec import _core

    todo = []   # (label, path)
    if args.make:
        tool = load_tool()
        d = Path(args.make)
        d.mkdir(parents=True, exist_ok=True)
        for label, preset in PRESET_SETS[args.preset]:
            path = d / f"{preset}.gguf"
            if not path.exists():
                t0 = time.perf_counter()
                tool.write_random_gguf(path, tool.PRESETS[preset], threads=args.threads)
                print(f"made {path} ({path.stat().st_size / 2**30:.2f} GiB) in "
                      f"{time.perf_counter() - t0:.1f}s", flush=True)
            todo.append((label, str(path)))
    for p in args.models:
        arch = _core.Model(p).arch
        todo.append(("qwen3" if arch == "qwen3" else "smollm2" if arch == "llama" else arch, p))
    if not todo:
        ap.error("give GGUF paths or --make DIR")

    ngl = 0 if args.cpu else "all"
    if not args.cpu:
        ok, why = pyspec.model.cuda_available()
        if not ok:
            print(f"CUDA backend unavailable: {why} (use --cpu for a smoke test)", file=sys.stderr)
            return 1
    rng = np.random.default_rng(0)
    rows = []
    results = {}
    for label, path in todo:
        model = pyspec.Model(path, n_threads=args.threads, n_gpu_layers=ngl)
        ENGINE_REQUEST_OPTIONS.clear()
        ENGINE_REQUEST_OPTIONS.update(SAMPLED if args.sample else GREEDY)
        global PENALISE_FIRST
        PENALISE_FIRST = args.penalise_one
        if args.ignore_eos:
            from pyspec.tokenizer import Tokenizer
            eog = sorted(Tokenizer.from_gguf(path).eog_ids)
            ENGINE_REQUEST_OPTIONS["logit_bias"] = [(int(t), float("-inf")) for t in eog]
            print(f"# engine requests ban {len(eog)} end ids (--ignore-eos)", flush=True)
        ids = [int(x) for x in rng.integers(256, model.n_vocab - 3, size=args.n_prompt)]
        name = Path(path).name
        print(f"# {name}: {model!r}", flush=True)
        res = results.setdefault(name, {"label": label})
        wbytes = weight_bytes_per_token(path)
        res["weight_bytes_per_token"] = wbytes
        full = FULL_SHAPES.get(label)
        ref = REFERENCE[label] if full == (model.arch, model.n_layer, model.n_embd,
                                           model.n_vocab) else {}
        if "tg128" in only:
            def tg(fn):
                if args.step_times:
                    _core.reset_cuda_graph_stats()
                v = fn(model, ids, args.n_gen, args.repeats)
                if args.step_times:
                    print_step_times(_core.cuda_graph_stats(), v)
                return v
            per = run_paths(f"tg{args.n_gen}", args.tg_mode,
                            {"context": bench_tg, "engine": bench_tg_engine}, tg)
            if per:
                v = max(per.values())
                res["tg128"] = v
                res["tg128_modes"] = per
                bw = wbytes * v
                res["tg128_bandwidth"] = bw
                rows.append((name, f"tg{args.n_gen}", v, ref.get("tg128"), GOALS["tg128"],
                             f"{bw / 1e12:.2f} TB/s weights ({100 * bw / PEAK_BW:.0f}% of 4.3); "
                             + ", ".join(f"{k} {fmt_rate(x)}" for k, x in per.items())))
        if "tgdepth" in only:
            t0 = time.perf_counter()
            v = bench_tg_depth(model, model.n_vocab, args.depth, 32, args.repeats)
            res[f"tg32_d{args.depth}"] = v
            rows.append((name, f"tg32@d{args.depth}", v, None, None, "no llama.cpp figure here"))
            print(f"  tg32@d{args.depth}: {v:.1f} t/s ({time.perf_counter() - t0:.1f}s)", flush=True)
        if "pp512" in only:
            t0 = time.perf_counter()
            v = bench_pp(model, ids, args.repeats)
            res["pp512"] = v
            rows.append((name, f"pp{args.n_prompt}", v, ref.get("pp512"), GOALS["pp512"], ""))
            print(f"  pp{args.n_prompt}: {v:.1f} t/s ({time.perf_counter() - t0:.1f}s)", flush=True)
        if "par64" in only and (label == "qwen3" or args.par_all):
            per = run_paths(f"par{args.par}", args.par_mode,
                            {"context": bench_par_context, "engine": bench_par_engine},
                            lambda fn: fn(model, ids, args.par, args.par_prompt, args.par_steps,
                                          args.repeats))
            if per:
                mode = max(per, key=per.get)
                res["par64"] = per[mode]
                res["par64_modes"] = per
                note = ", ".join(f"{k} {fmt_rate(v)}" for k, v in per.items())
                # llama.cpp's figure (and the goal) are for 64 sequences: other widths get none
                at_64 = args.par == 64
                rows.append((name, f"par{args.par}x{args.par_steps}", per[mode],
                             ref.get("par64") if at_64 else None, GOALS["par64"] if at_64 else None, note))
        if args.profile:
            res["profile"] = profile_steps(model, ids, min(args.n_gen, 64), args.n_prompt)
        del model

    backend = "CPU" if args.cpu else "CUDA"
    print(f"\npyspec ({backend}) vs llama.cpp 0c1e570 on one H200 (-ngl 99 -fa 1); t/s, "
          f"best of {args.repeats}")
    head = f"{'model':<24} {'test':<12} {'pyspec':>9} {'llama.cpp':>10} {'ratio':>7} {'goal':>6} {'met':>4}  note"
    print(head)
    print("-" * len(head))
    for name, test, v, r, goal, note in rows:
        ratio = v / r if r else None
        met = "-" if ratio is None else ("yes" if ratio >= goal else "no")
        print(f"{name:<24} {test:<12} {fmt_rate(v):>9} {fmt_rate(r):>10} "
              f"{'-' if ratio is None else f'{ratio:.2f}x':>7} {'-' if goal is None else f'{goal:.1f}x':>6} "
              f"{met:>4}  {note}")
    if args.cpu:
        print("(CPU run: the llama.cpp figures are the H200's; ratios mean nothing here)")
    print("(llama.cpp figures only for models of the full SmolLM2-135M / Qwen3-4B shapes)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
