#!/usr/bin/env python3
"""Where a speculative round's wall-clock time goes, greedy against sampled, without the real
target: any target of the drafter's shapes serves (a random SmolLM2-shaped GGUF from
tools/make_random_gguf.py with the shipped drafter), since a round's cost does not depend on what
it accepts when every round drafts n_max (no confidence pruning here).

    python3 tools/device/round_phases.py /tmp/pyspec-models/smollm2-135m-q4_1.gguf \
        pyspec/data/SmolLM2-135M-Instruct-DSpark.Q4_1.gguf [--backend cuda] [--profile]

Prints milliseconds a round by phase (SpecEngine.phase_times: target pass, staging rows into the
drafter, drafter pass, the host's verification and bookkeeping) for greedy requests and for
llama-server's default sampling chain; --profile adds each side's op profile (the backend's own
events, which slow small GPU kernels: read it for shares, not totals).
"""
from __future__ import annotations

import argparse

import pyspec
from pyspec import _core

MODES = {
    "greedy": dict(temperature=0.0, verify="greedy"),
    "sampled": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, verify="rejection"),
}
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8] * 4, [100 + i for i in range(40)], [7, 7, 7, 9, 11, 13]]


def rounds_of(engine, kw, n_tokens):
    """Runs the prompts one at a time; returns how many steps (rounds) they took."""
    n = 0
    for i, p in enumerate(PROMPTS):
        engine.add_request(i, p, max_tokens=n_tokens, seed=i, draft_p_min=0.0, **kw)
        while engine.n_requests:
            engine.step()
            n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target")
    ap.add_argument("drafter")
    ap.add_argument("--backend", default="cpu", help="cpu or cuda")
    ap.add_argument("--n-max", type=int, default=2)
    ap.add_argument("-n", type=int, default=96, help="tokens per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    gpu = args.backend != "cpu"
    model = pyspec.Model(args.target, n_threads=args.threads, n_gpu_layers="all" if gpu else 0)._model
    dm = _core.DraftModel(args.drafter, model)
    for mode, kw in MODES.items():
        e = _core.SpecEngine(model, dm, n_ctx=2048, n_seq_max=1, n_draft_slots=1, n_batch=512, draft_n_batch=512,
                             n_threads=args.threads, draft_n_max=args.n_max, prefill_chunk=512, backend=args.backend)
        e.set_profiling(args.profile)
        n_warm = rounds_of(e, kw, args.n)  # warm-up: plans built, graphs captured
        ph0 = e.phase_times()
        n = rounds_of(e, kw, args.n)
        ph = e.phase_times()
        ms = {k: (ph[k] - ph0[k]) / n * 1e3 for k in ph if k != "steps"}
        print(f"{mode:8s} {n} rounds, ms a round: " + "  ".join(f"{k[:-2]} {v:.3f}" for k, v in ms.items()) +
              f"  total {sum(ms.values()):.3f}")
        if args.profile:
            for part, ops in e.op_profile().items():
                top = sorted(ops, key=lambda o: -o[1])[:8]
                # The profile covers the warm-up's rounds too.
                print(f"  {part}: " + ", ".join(f"{name} {t / (n + n_warm) * 1e3:.3f}" for name, t, _ in top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
