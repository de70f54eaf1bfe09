"""A trained drafter on held-out prompts (issue 9): acceptance and speed against plain decoding.

Prompts: three sets the drafter never saw in training (HELD_OUT below) - chat requests (rendered
with the target's chat template), code requests and raw code, and raw prose continuations. The
training data generator drops any prompt containing one of pyspec.train.data.HELD_OUT_MARKERS,
and `--check-data DIR...` proves the rest against the actual training shards: no 12-token window
of any held-out prompt's text occurs in any training prompt. (The target's own generations in
the data may of course contain common phrases such as "The best way to learn".)

For every set and every mode (greedy T = 0; T = 0.8 with rejection verification; T = 0.8 with
block verification), one request at a time (the latency a user of the CLI sees), through
`_core.SpecEngine` (the server's path):
- plain: the same engine without a drafter (one target decode per token);
- spec: with the drafter at each --draft-n-max value.
Printed per set and mode: mean accepted length per round (accepted drafts + 1; sampled modes
with its standard error over the rounds of every repeat, each repeat drawn with its own seeds),
acceptance per block position (the share of rounds whose draft k was accepted, with every draft
before it), tokens/s of both and the ratio (plain and speculative runs alternate --repeats times,
default 3, each side's best rate counts).
Greedy outputs must equal plain greedy (checked). Also where a round's time goes (the engines'
op profiles, greedy, the first set): a plain decode step, and per speculative round the target's
verify pass and the drafter's passes (its context rows and the drafting pass), the latter as a
share of a plain step (the issue's "drafter cost per pass"); then the same split in wall-clock
time, unprofiled (SpecEngine.phase_times: target pass, staging rows into the drafter, drafter
passes, the rest), which on a GPU also holds the launches, copies and waits the op profile misses.

    PYTHONPATH=. python bench/bench_drafter.py --drafter D.gguf [-n 128] [-t 2] [--repeats 3]
        [--draft-n-max 3,5] [--draft-p-min 0,0.5] [--modes greedy,rejection,block]
        [--check-data DIR ...] [--json F]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pyspec  # noqa: E402
from pyspec import _core  # noqa: E402

# Held-out prompts, written for this bench (kind "chat": a user message; "raw": plain text).
HELD_OUT: Dict[str, List[tuple]] = {
    "chat": [
        ("chat", "What is the capital of France, and what is it famous for?"),
        ("chat", "My favourite colour is green. Suggest three ways to decorate a bedroom with it."),
        ("chat", "Write a haiku about autumn leaves falling in the rain."),
        ("chat", "What is the best way to learn to cook if I have never cooked before?"),
        ("chat", "Water boils at 100 degrees Celsius at sea level. Why is it lower on a mountain?"),
        ("chat", "Tell me a short story that begins with 'Once upon a time' about a lighthouse keeper."),
        ("chat", "In 1969, the first people walked on the Moon. How did they get back to Earth?"),
        ("chat", "Summarise the Python Software Foundation License in plain words."),
    ],
    "code": [
        ("chat", "Write a Python function def fibonacci(n) that returns the n-th Fibonacci number "
                 "without recursion."),
        ("chat", "Write a Python function that checks whether a string is a palindrome, ignoring "
                 "case and spaces, and show two examples."),
        ("chat", "Explain what a Python list comprehension is, with an example that squares the "
                 "even numbers of a list."),
        ("chat", "Write a Python class Stack with push, pop and peek methods."),
        ("raw", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
        ("raw", "# Count the words of a text file and print the ten most common ones.\n"
                "import collections\n\n\ndef count_words(path):\n"),
        ("raw", "def binary_search(items, target):\n    \"\"\"Return the index of target in the "
                "sorted list items, or -1.\"\"\"\n    lo, hi = 0, len(items) - 1\n"),
        ("raw", "class Temperature:\n    \"\"\"A temperature that converts between Celsius and "
                "Fahrenheit.\"\"\"\n\n    def __init__(self, celsius):\n"),
    ],
    "prose": [
        ("raw", "Once upon a time, in a village at the edge of a great forest, there lived"),
        ("raw", "In 1969, the first crewed landing on the Moon"),
        ("raw", "Water boils at a lower temperature at high altitude because"),
        ("raw", "The capital of France is Paris. The city is known for"),
        ("raw", "The best way to learn a new language is"),
        ("raw", "My favourite colour is blue, because it reminds me of"),
        ("raw", "A haiku about autumn:\n"),
        ("raw", "The Python Software Foundation License is a permissive license that"),
    ],
}
MODES = {"greedy": (0.0, "greedy"), "rejection": (0.8, "rejection"), "block": (0.8, "block")}


def encode_prompts(llm, sets: Dict[str, List[tuple]]) -> Dict[str, List[List[int]]]:
    from pyspec.chat import ChatTemplate
    template = ChatTemplate.from_tokenizer(llm.tokenizer)
    out = {}
    for name, items in sets.items():
        out[name] = []
        for kind, text in items:
            if kind == "chat":
                rendered = template.render([{"role": "user", "content": text}],
                                           add_generation_prompt=True)
                out[name].append(llm.tokenizer.encode(rendered, add_special=True, parse_special=True))
            else:
                out[name].append(llm.tokenizer.encode(text, add_special=True))
    return out


def check_held_out(llm, sets, data: Sequence[str], window: int = 12) -> int:
    """Number of held-out prompts sharing a `window`-token run with any training prompt."""
    from pyspec.train.shards import load_shards
    seqs, prompt_lens, info = load_shards(list(data), llm.tokenizer.n_vocab)
    grams = set()
    for s, pl in zip(seqs, prompt_lens):
        a = np.asarray(s[:pl], dtype=np.int64)      # the training prompts (not the generations)
        if len(a) >= window:
            w = np.lib.stride_tricks.sliding_window_view(a, window)
            grams.update(map(bytes, w.astype(np.int32)))
    hits = 0
    for name, items in sets.items():
        for kind, text in items:
            ids = np.asarray(llm.tokenizer.encode(text, add_special=False), dtype=np.int32)
            if len(ids) < window:
                continue
            w = np.lib.stride_tricks.sliding_window_view(ids, window)
            seen = [g for g in w if bytes(g) in grams]
            if seen:
                hits += 1
                print(f"  in a training prompt: [{name}] {text[:40]!r}: "
                      f"{llm.tokenizer.decode([int(t) for t in seen[0]])!r}")
    print(f"held-out check: {len(seqs)} training prompts from {info['files']} files, "
          f"{sum(len(v) for v in sets.values())} bench prompts, {hits} share a {window}-token run")
    return hits


def add_counts(a: Optional[np.ndarray], b: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """Per-position counts added, the shorter padded with zeros (None: no counts yet)."""
    if a is None or b is None:
        return b if a is None else a
    m = max(len(a), len(b))
    return np.pad(a, (0, m - len(a))) + np.pad(b, (0, m - len(b)))


def merge_totals(a: Optional[dict], b: dict) -> dict:
    """run_set's totals of two runs together."""
    if a is None:
        return dict(b)
    out = {k: a[k] + b[k] for k in ("rounds", "drafted", "accepted")}
    for k in ("drafted_at", "accepted_at"):
        out[k] = add_counts(a[k], b[k])
    return out


def accepted_length(tot: dict) -> tuple:
    """(mean accepted length, its standard error) over the rounds of run_set's totals. A round's
    accepted drafts A satisfy P(A >= j + 1) = accepted_at[j] / rounds, so E[A^2] = sum over j of
    (2 j + 1) accepted_at[j] / rounds."""
    rounds = max(1, tot["rounds"])
    a_at = tot["accepted_at"] if tot["accepted_at"] is not None else np.zeros(0)
    mean = tot["accepted"] / rounds
    second = sum((2 * j + 1) * float(c) for j, c in enumerate(a_at)) / rounds
    return 1.0 + mean, math.sqrt(max(0.0, second - mean * mean) / rounds)


def run_set(engine, prompts, n, temperature, verify, seed0=1, profile=False, prune=None, sampler=None,
            phases=None):
    """Runs the prompts one at a time; returns (outputs, decode seconds, totals dict). profile:
    the engine's op profiles cover each request's decoding (from its first token on). phases: a
    dict that gathers the engine's wall-clock phase times (SpecEngine.phase_times) over the same
    span."""
    outs, t_total = [], 0.0
    tot = dict(rounds=0, drafted=0, accepted=0, drafted_at=None, accepted_at=None)
    for i, p in enumerate(prompts):
        engine.add_request(i, p, max_tokens=n, temperature=temperature, seed=seed0 + i,
                           verify=verify, **(prune or {}), **(sampler or {}))
        toks: List[int] = []
        t0 = None
        while engine.n_requests:
            res = engine.step()
            for o in res:
                if t0 is None and o["tokens"]:
                    t0 = time.perf_counter()     # decode time: from the first token on
                    n_first = len(o["tokens"])
                    ph0 = engine.phase_times()
                    if profile:
                        engine.set_profiling(True)
                toks += o["tokens"]
                if o["finished"]:
                    st = o["stats"]
                    tot["rounds"] += st["n_rounds"]
                    tot["drafted"] += st["draft_n"]
                    tot["accepted"] += st["draft_n_accepted"]
                    for key in ("drafted_at", "accepted_at"):
                        tot[key] = add_counts(tot[key], np.asarray(st[key], dtype=np.int64))
        t_total += time.perf_counter() - t0
        engine.set_profiling(False)
        if phases is not None:
            for k, v in engine.phase_times().items():
                phases[k] = phases.get(k, 0) + v - ph0[k]
        outs.append((toks, len(toks) - n_first))
    return outs, t_total, tot


def profile_seconds(engine) -> Dict[str, float]:
    prof = engine.op_profile()
    return {k: sum(sec for _, sec, _ in rows) for k, rows in prof.items()}


def cost_split(plain_engine, spec_engine, prompts, n) -> Dict[str, float]:
    """Time in ops per plain decode step, and per speculative round in the target (verify) and
    in the drafter (context rows + the drafting pass), greedy, from the engines' op profiles."""
    p0, s0 = profile_seconds(plain_engine), profile_seconds(spec_engine)
    plain, _, _ = run_set(plain_engine, prompts, n, 0.0, "greedy", profile=True)
    _, _, tot = run_set(spec_engine, prompts, n, 0.0, "greedy", profile=True)
    p1, s1 = profile_seconds(plain_engine), profile_seconds(spec_engine)
    steps = sum(k for _, k in plain)
    rounds = max(1, tot["rounds"])
    step = (p1["target"] - p0["target"]) / max(1, steps)
    return dict(plain_step_s=step, verify_s=(s1["target"] - s0["target"]) / rounds,
                drafter_s=(s1["drafter"] - s0["drafter"]) / rounds)


def wall_split(plain_engine, spec_engine, prompts, n) -> Dict[str, float]:
    """Wall-clock seconds per plain decode step and per speculative round, by phase
    (SpecEngine.phase_times), greedy, ops not profiled: on a GPU the launches, copies and waits
    the op profile cannot see."""
    plain_ph: Dict[str, float] = {}
    spec_ph: Dict[str, float] = {}
    run_set(plain_engine, prompts, n, 0.0, "greedy", phases=plain_ph)
    run_set(spec_engine, prompts, n, 0.0, "greedy", phases=spec_ph)
    return per_step(plain_ph, spec_ph)


def per_step(plain_ph, spec_ph) -> Dict[str, float]:
    """Gathered phase times (run_set's phases) as seconds per plain step and per round."""
    per = lambda ph, k: ph[k] / max(1, ph["steps"])  # noqa: E731
    out = {f"plain_{k}": per(plain_ph, k) for k in ("target_s", "other_s")}
    out.update({f"round_{k}": per(spec_ph, k) for k in ("target_s", "stage_s", "draft_s", "other_s")})
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="target GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--drafter", required=True, help="drafter GGUF (pyspec-train-drafter's output)")
    ap.add_argument("-n", type=int, default=128, help="tokens per prompt")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-ngl", "--n-gpu-layers", default="0",
                    help="llama.cpp's -ngl for the target and the drafter: 0 (CPU) or all (the CUDA backend)")
    ap.add_argument("--draft-n-max", default="3,5", help="comma-separated values to measure")
    ap.add_argument("--draft-p-min", default="0",
                    help="comma-separated confidence thresholds to measure (llama.cpp's --draft-p-min, "
                         "'first' mode: drafts stop at the first slot the DSpark confidence head puts "
                         "below it); 0 drafts n_max always")
    ap.add_argument("--modes", default="greedy,rejection,block")
    ap.add_argument("--sampler", choices=["temperature", "server"], default="temperature",
                    help="sampled modes: temperature alone, or llama-server's default chain "
                         "(top-k 40, top-p 0.95, min-p 0.05) before it")
    ap.add_argument("--sets", default="chat,code,prose")
    ap.add_argument("--check-data", nargs="+", default=None, metavar="DIR",
                    help="training data shard sets to prove the prompts held out against")
    ap.add_argument("--repeats", type=int, default=3,
                    help="alternating plain/speculative runs per set; each side's best counts")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args(argv)

    model_path = args.model or pyspec.model.default_model_path()
    drafter_path = args.drafter
    llm = pyspec.LLM(model_path, n_ctx=64)
    sets = {k: HELD_OUT[k] for k in args.sets.split(",")}
    if args.check_data:
        if check_held_out(llm, sets, args.check_data):
            print("error: some bench prompts occur in the training data", file=sys.stderr)
            return 1
    prompts = encode_prompts(llm, sets)
    model = pyspec.Model(model_path, n_threads=args.threads, n_gpu_layers=args.n_gpu_layers)
    dm = _core.DraftModel(drafter_path, model._model)
    gammas = [int(g) for g in args.draft_n_max.split(",")]
    p_mins = [float(p) for p in args.draft_p_min.split(",")]
    # (n_max, p_min) configurations; the engine is per n_max, the threshold per request
    configs = [(g, p) for g in gammas for p in p_mins]
    prune_of = {p: (dict(draft_p_min=p) if p > 0 else None) for p in p_mins}

    def engine(drafter, gamma):
        return _core.SpecEngine(model._model, drafter, n_ctx=2048, n_seq_max=1, n_draft_slots=1,
                                n_threads=args.threads, draft_n_max=gamma, prefill_chunk=512,
                                backend=model.backend)

    plain_engine = engine(None, -1)
    spec_engines = {g: engine(dm, g) for g in gammas}
    # Warm-up: allocation plans of every shape the runs use.
    for e in [plain_engine, *spec_engines.values()]:
        run_set(e, prompts[next(iter(prompts))][:1], 16, 0.0, "greedy")

    results = []
    where = f"{args.threads} threads" if model.backend == "cpu" else model.backend
    print(f"target {Path(model_path).name}, drafter {Path(drafter_path).name}, {where}, "
          f"{args.n} tokens per prompt, one request at a time, sampled modes: "
          f"{'top-k 40, top-p 0.95, min-p 0.05, then ' if args.sampler == 'server' else ''}temperature")
    first = next(iter(prompts))
    costs = {}
    for g in gammas:
        # Each part's least time over --repeats measurements: one measurement of these few-ms
        # quantities moved by +-5 points of the drafter's share on a shared machine.
        runs = [cost_split(plain_engine, spec_engines[g], prompts[first], args.n) for _ in range(args.repeats)]
        c = {key: min(r[key] for r in runs) for key in runs[0]}
        costs[g] = c
        print(f"cost, n_max {g} ({first} prompts, greedy; time in ops): plain step "
              f"{c['plain_step_s'] * 1e3:.2f} ms; per round: verify {c['verify_s'] * 1e3:.2f} ms "
              f"({c['verify_s'] / c['plain_step_s']:.2f} plain steps), drafter "
              f"{c['drafter_s'] * 1e3:.2f} ms ({100 * c['drafter_s'] / c['plain_step_s']:.0f}% of a "
              f"plain step)", flush=True)
        w = [wall_split(plain_engine, spec_engines[g], prompts[first], args.n) for _ in range(args.repeats)]
        w = {key: min(r[key] for r in w) for key in w[0]}
        c.update(w)
        step = w["plain_target_s"] + w["plain_other_s"]
        rnd = sum(w[f"round_{k}"] for k in ("target_s", "stage_s", "draft_s", "other_s"))
        print(f"wall, n_max {g}: plain step {step * 1e3:.3f} ms (target pass {w['plain_target_s'] * 1e3:.3f}); "
              f"per round {rnd * 1e3:.3f} ms ({rnd / step:.2f} plain steps) = target pass "
              f"{w['round_target_s'] * 1e3:.3f} + staging {w['round_stage_s'] * 1e3:.3f} + drafter "
              f"{w['round_draft_s'] * 1e3:.3f} + other {w['round_other_s'] * 1e3:.3f}", flush=True)
    sampler = dict(top_k=40, top_p=0.95, min_p=0.05) if args.sampler == "server" else None
    for mode in args.modes.split(","):
        temperature, verify = MODES[mode]
        chain = sampler if temperature > 0 else None
        for name, ps in prompts.items():
            # Plain and speculative runs alternate, --repeats times, and each side keeps its best
            # rate: on a shared machine a single pair of runs drifts by +-10-15%. Sampled modes
            # draw each repeat with its own seeds and count acceptance over all of them: one
            # seed set's mean accepted length on chat moved by +-0.05 (several drafters measured
            # 1.58-1.68 on one seed set, 1.63-1.64 each over four).
            sampled = temperature > 0
            r_plain = 0.0
            r_spec = {c: 0.0 for c in configs}
            tots: Dict[tuple, Optional[dict]] = {c: None for c in configs}
            plain_ph: Dict[str, float] = {}
            spec_ph: Dict[tuple, Dict[str, float]] = {c: {} for c in configs}
            for rep in range(args.repeats):
                seed0 = 1 + 1000 * rep if sampled else 1
                plain, t, _ = run_set(plain_engine, ps, args.n, temperature, verify, seed0=seed0, sampler=chain,
                                      phases=plain_ph)
                r_plain = max(r_plain, sum(k for _, k in plain) / t)
                for g, p in configs:
                    spec, t, tot = run_set(spec_engines[g], ps, args.n, temperature, verify, seed0=seed0,
                                           sampler=chain, prune=prune_of[p], phases=spec_ph[g, p])
                    r_spec[g, p] = max(r_spec[g, p], sum(k for _, k in spec) / t)
                    tots[g, p] = merge_totals(tots[g, p], tot) if sampled else tot
                    if not sampled:
                        assert [s for s, _ in spec] == [s for s, _ in plain], \
                            f"{name}: speculative greedy output differs from plain greedy"
            for g, p in configs:
                tot = tots[g, p]
                mean_len, mean_se = accepted_length(tot)
                d_at = tot["drafted_at"] if tot["drafted_at"] is not None else np.zeros(0)
                a_at = tot["accepted_at"] if tot["accepted_at"] is not None else np.zeros(0)
                per_pos = [float(a) / max(1, float(d)) for a, d in zip(a_at, d_at)]
                r = dict(mode=mode, set=name, draft_n_max=g, draft_p_min=p, mean_accepted_length=mean_len,
                         mean_accepted_length_se=mean_se, rounds=tot["rounds"],
                         acceptance=tot["accepted"] / max(1, tot["drafted"]),
                         acceptance_per_position=per_pos, plain_tps=r_plain, spec_tps=r_spec[g, p])
                r["speedup"] = r["spec_tps"] / r["plain_tps"]
                results.append(r)
                pos = " ".join(f"{x:.2f}" for x in per_pos)
                p_min = (f" p_min {p:g} ({tot['drafted'] / max(1, tot['rounds']):.2f} drafts/round)"
                         if len(p_mins) > 1 or p > 0 else "")
                se = f" +-{mean_se:.2f} ({tot['rounds']} rounds)" if sampled else ""
                print(f"{mode:<9} {name:<5} n_max {g}{p_min}  mean accepted length {mean_len:4.2f}{se}  "
                      f"per position [{pos}]  plain {r['plain_tps']:6.1f} tok/s  spec "
                      f"{r['spec_tps']:6.1f} tok/s  x{r['speedup']:.2f}", flush=True)
                if temperature > 0:  # where a sampled step goes (greedy: the wall lines above)
                    w = per_step(plain_ph, spec_ph[g, p])
                    r["wall"] = w
                    print(f"  wall ms: plain step target {w['plain_target_s'] * 1e3:.3f} + host "
                          f"{w['plain_other_s'] * 1e3:.3f}; round target {w['round_target_s'] * 1e3:.3f} + staging "
                          f"{w['round_stage_s'] * 1e3:.3f} + drafter {w['round_draft_s'] * 1e3:.3f} + host "
                          f"{w['round_other_s'] * 1e3:.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "costs": costs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
