"""What sampling costs next to greedy decoding, in one run: plain decoding (`SpecEngine` without a
drafter) of the same prompts greedy, at temperature only (T 0.8, every token of the vocabulary
in the law: invariant 5 runs no filter), with top-p 0.95 or min-p 0.05 alone (top-k 0: the whole
row is filtered) and with llama-server's default chain (top-k 40, top-p 0.95, min-p 0.05, T 0.8).
Prints tok/s, the host time per step that is not the target pass (`SpecEngine.phase_times`: the
law and the draw), and the ratio to greedy; then the two host parts alone on a real logit row:
the law (`processed_law`) and one draw from it (a verify round without drafts: the exponential
race).

    PYTHONPATH=. python bench/bench_sampling.py [--model M.gguf] [-ngl all] [-n 128] [--repeats 3]
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyspec  # noqa: E402
from pyspec import _core  # noqa: E402

PROMPTS = ["Write a short story about a robot who learns to paint.",
           "Explain how a hash table works.",
           "def merge_sort(xs):"]
MODES = {"greedy": dict(temperature=0.0),
         "temperature": dict(temperature=0.8),
         "top-p only": dict(temperature=0.8, top_k=0, top_p=0.95),
         "min-p only": dict(temperature=0.8, top_k=0, min_p=0.05),
         "server chain": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)}


def run(model, prompts, n, threads, sampling):
    """Tokens/s and host seconds per step outside the target pass, all prompts one at a time."""
    e = _core.SpecEngine(model._model, None, n_ctx=2048, n_seq_max=1, n_draft_slots=1, n_threads=threads,
                         draft_n_max=-1, prefill_chunk=512, backend=model.backend)
    tokens, seconds, other, steps = 0, 0.0, 0.0, 0
    for i, p in enumerate(prompts):
        e.add_request(i, p, max_tokens=n, seed=i, **sampling)
        before = e.phase_times()
        t = time.perf_counter()
        while e.n_requests:
            for o in e.step():
                tokens += len(o["tokens"])
        seconds += time.perf_counter() - t
        after = e.phase_times()
        other += after["other_s"] - before["other_s"]
        steps += after["steps"] - before["steps"]
    return tokens / seconds, other / max(steps, 1)


def time_call(f, reps=200):
    f()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t) / reps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="target GGUF (default: the embedded SmolLM2)")
    ap.add_argument("-ngl", "--n-gpu-layers", default=0)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=128, help="tokens per prompt")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per mode; the best counts")
    args = ap.parse_args()
    path = args.model or pyspec.model.default_model_path()
    model = pyspec.Model(path, n_threads=args.threads, n_gpu_layers=args.n_gpu_layers)
    llm = pyspec.LLM(path, n_ctx=64)
    prompts = [llm.tokenize(t) for t in PROMPTS]
    print(f"{Path(path).name} on {model.backend}, {len(prompts)} prompts x {args.n} tokens, plain decoding")
    run(model, prompts[:1], 8, args.threads, MODES["greedy"])  # allocation plans
    best = {m: (0.0, 0.0) for m in MODES}
    for _ in range(args.repeats):
        for mode, sampling in MODES.items():
            tps, other = run(model, prompts, args.n, args.threads, sampling)
            if tps > best[mode][0]:
                best[mode] = (tps, other)
    for mode, (tps, other) in best.items():
        print(f"{mode:<13} {tps:8.1f} tok/s  host per step outside the target pass {other * 1e3:6.3f} ms  "
              f"x{tps / best['greedy'][0]:.2f} of greedy")

    ctx = pyspec.Context(model, n_ctx=256)
    p = prompts[0]
    logits = np.ascontiguousarray(ctx.decode(p, positions=np.arange(len(p)), seq_ids=np.zeros(len(p), int)).logits[-1],
                                  dtype=np.float32)
    none_q, none_d = np.zeros((0, logits.size), np.float32), np.zeros(0, np.int32)
    for mode in [m for m in MODES if m != "greedy"]:
        s = MODES[mode]
        law = _core.spec.processed_law(logits, s["temperature"], s.get("top_k", 0), s.get("top_p", 1.0),
                                       s.get("min_p", 0.0))
        t_law = time_call(lambda: _core.spec.processed_law(logits, s["temperature"], s.get("top_k", 0),
                                                           s.get("top_p", 1.0), s.get("min_p", 0.0)))
        seeds = iter(range(10**9))
        t_draw = time_call(lambda: _core.spec.verify_rejection(law[None, :], none_q, none_d, next(seeds), 7))
        print(f"{mode:<13} one row of {logits.size}: the law {t_law * 1e3:.3f} ms ({np.count_nonzero(law)} tokens "
              f"kept), a draw from it {t_draw * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
