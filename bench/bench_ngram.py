"""Draftless speculation (llama-server's ngram-simple) against plain decoding, alone and ahead of
the embedded DSpark drafter, one request at a time, greedy.

Requests stop at the end-of-generation tokens, as the server's do (a model that runs on past its
answer repeats itself, which lookups would flatter). Sets: "rewrite" asks the model to repeat a given piece of code or text with a small change (the
kind of request lookups are for: the answer quotes the prompt); "chat" is bench_drafter.py's
held-out chat set (little to look up). Printed per set and configuration: the mean accepted
length per round (all drafts), the share of rounds that verified looked-up drafts, tok/s and the
ratio to plain decoding (configurations alternate --repeats times; each keeps its best time per
token). Greedy outputs must equal plain greedy (checked); --temp T samples instead.

    PYTHONPATH=. python bench/bench_ngram.py [-n 128] [-t 2] [--ngram-n 12,4] [--ngram-m 48]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import pyspec  # noqa: E402
from pyspec import _core  # noqa: E402
from bench_drafter import HELD_OUT, encode_prompts  # noqa: E402

_CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out'''

_TEXT = ("The museum opens at nine in the morning and closes at six in the evening. Tickets cost "
         "twelve euros for adults and six euros for children under fourteen. Guided tours start "
         "every hour from the main hall, and the cafe on the second floor serves lunch until three.")

REWRITE = [
    ("chat", f"Rename the function to rolling_mean and repeat the whole code:\n\n{_CODE}"),
    ("chat", f"Add a docstring to this function and show the complete code:\n\n{_CODE}"),
    ("chat", f"Repeat this paragraph, replacing 'museum' with 'gallery':\n\n{_TEXT}"),
    ("chat", f"Copy this text exactly, then add one sentence about parking at the end:\n\n{_TEXT}"),
]


def run_set(engine, prompts, n, stop_ids=(), temperature=0.0):
    outs, t_total, rounds, ngram_rounds, accepted = [], 0.0, 0, 0, 0
    for i, p in enumerate(prompts):
        sampled = dict(temperature=temperature, verify="rejection", seed=1 + i) if temperature > 0 else {}
        engine.add_request(i, p, max_tokens=n, stop_ids=list(stop_ids), **sampled)
        toks: List[int] = []
        t0 = time.perf_counter()
        while engine.n_requests:
            for o in engine.step():
                toks += o["tokens"]
                if o["finished"]:
                    st = o["stats"]
                    rounds += st["n_rounds"]
                    ngram_rounds += st["ngram_rounds"]
                    accepted += st["draft_n_accepted"]
        t_total += time.perf_counter() - t0
        outs.append(toks)
    return outs, t_total, dict(rounds=rounds, ngram_rounds=ngram_rounds, accepted=accepted)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=128, help="tokens per prompt")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--ngram-n", default="12,4", help="lookup lengths to measure (llama-server: 12)")
    ap.add_argument("--ngram-m", type=int, default=48, help="most drafts a lookup gives (llama-server: 48)")
    ap.add_argument("--draft-n-max", type=int, default=2, help="the drafter's drafts per round")
    ap.add_argument("--temp", type=float, default=0.0,
                    help="> 0: sampled at this temperature, rejection verification (outputs then "
                         "differ from plain decoding's and are not compared; tok/s counts what each made)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)

    path = pyspec.model.default_model_path()
    llm = pyspec.LLM(path, n_ctx=64)
    prompts = encode_prompts(llm, {"rewrite": REWRITE, "chat": HELD_OUT["chat"]})
    stops = sorted(int(t) for t in llm.tokenizer.eog_ids)   # answers end where the server's would
    model = pyspec.Model(path, n_threads=args.threads)
    dm = _core.DraftModel(str(pyspec.model.default_drafter_path()), model._model)

    def engine(drafter, ngram_n):
        return _core.SpecEngine(model._model, drafter, n_ctx=2048, n_seq_max=1, n_draft_slots=1,
                                n_threads=args.threads, draft_n_max=args.draft_n_max, prefill_chunk=512,
                                ngram_n=ngram_n, ngram_m=args.ngram_m)

    configs: Dict[str, object] = {"plain": engine(None, 0), "drafter": engine(dm, 0)}
    for k in (int(x) for x in args.ngram_n.split(",")):
        configs[f"ngram n={k}"] = engine(None, k)
        configs[f"drafter + ngram n={k}"] = engine(dm, k)
    for e in configs.values():   # allocation plans of every shape
        run_set(e, prompts["chat"][:1], 8)
    print(f"{Path(path).name}, {args.threads} threads, up to {args.n} tokens per prompt (stopping at "
          f"end of generation), {'T ' + str(args.temp) if args.temp > 0 else 'greedy'}, ngram m "
          f"{args.ngram_m}, drafter n_max {args.draft_n_max}")
    for name, ps in prompts.items():
        best = {c: math.inf for c in configs}
        res = {}
        for _ in range(args.repeats):
            for c, e in configs.items():
                outs, t, tot = run_set(e, ps, args.n, stops, args.temp)
                best[c] = min(best[c], t / max(1, sum(len(o) for o in outs)))   # seconds a token
                res[c] = (outs, tot)
        plain_outs = res["plain"][0]
        for c in configs:
            outs, tot = res[c]
            assert args.temp > 0 or outs == plain_outs, f"{name}: {c} differs from plain greedy"
            mean_len = (tot["accepted"] + tot["rounds"]) / max(1, tot["rounds"])
            share = tot["ngram_rounds"] / max(1, tot["rounds"])
            print(f"{name:<8} {c:<22} mean accepted length {mean_len:5.2f}  lookup rounds {share:4.0%}  "
                  f"{1 / best[c]:7.1f} tok/s  x{best['plain'] / best[c]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
