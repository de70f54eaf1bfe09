"""Where a speculative step's time goes, greedy against sampled, on one engine.

Greedy and sampled requests (llama-server's default chain at T 0.8, rejection) alternate on one
SpecEngine with the default model and its embedded drafter; every step's phase times
(SpecEngine.phase_times: the target pass, staging, the drafter's pass, the rest on the host) are
taken apart, and each mode's lower quartile and median over all its steps print side by side,
with the sampled/greedy ratio. Alternating in one process keeps a noisy machine's drift out of
the comparison; the quartiles keep out its spikes.

    python bench/bench_round_phases.py [--model M.gguf --drafter D.gguf] [-ngl all] [--reps 6]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("target_s", "stage_s", "draft_s", "other_s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="target GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--drafter", help="drafter GGUF (default: the embedded drafter)")
    ap.add_argument("-ngl", "--n-gpu-layers", default="0", help="0: CPU, all: the GPU")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--draft-n-max", type=int, default=2)
    ap.add_argument("--reps", type=int, default=6, help="requests per mode, alternating")
    ap.add_argument("-n", type=int, default=64, help="tokens per request")
    args = ap.parse_args(argv)

    import pyspec
    from pyspec import _core

    ngl = args.n_gpu_layers if args.n_gpu_layers in ("all", "auto") else int(args.n_gpu_layers)
    model = pyspec.Model(args.model, n_threads=args.threads, n_gpu_layers=ngl)
    drafter_path = args.drafter or pyspec.model.default_drafter_path()
    if drafter_path is None:
        ap.error("no drafter: give --drafter (this install has no embedded one)")
    dm = _core.DraftModel(str(drafter_path), model._model)
    engine = _core.SpecEngine(model._model, dm, n_ctx=1024, n_seq_max=1, n_threads=args.threads,
                              draft_n_max=args.draft_n_max, backend=model.backend)
    prompt = [int(t) for t in np.random.default_rng(0).integers(300, model.n_vocab - 3, 40)]
    modes = {"greedy": dict(temperature=0.0, verify="greedy"),
             "sampled": dict(temperature=0.8, verify="rejection", top_k=40, top_p=0.95, min_p=0.05)}
    steps = {m: [] for m in modes}
    rid = 0
    for _ in range(args.reps):
        for mode, kw in modes.items():
            rid += 1
            engine.add_request(rid, prompt, max_tokens=args.n, seed=rid, **kw)
            first = True
            while engine.n_requests:
                before = engine.phase_times()
                engine.step()
                after = engine.phase_times()
                if not first:  # the prompt's step is prefill, not a round
                    steps[mode].append([after[k] - before[k] for k in PHASES])
                first = False
    print(f"# {Path(model.path).name} + {Path(drafter_path).name} on {model.backend}, n_max {args.draft_n_max}, "
          f"{args.reps} x {args.n} tokens per mode; ms per step, lower quartile / median")
    stats = {m: np.percentile(np.array(v) * 1e3, [25, 50], axis=0) for m, v in steps.items()}
    print(f"{'phase':<10} {'greedy':>15} {'sampled':>15} {'sampled/greedy':>15}")
    for i, name in enumerate(PHASES):
        g, s = stats["greedy"][:, i], stats["sampled"][:, i]
        ratio = s[0] / g[0] if g[0] > 0 else float("nan")
        print(f"{name[:-2]:<10} {g[0]:7.3f} / {g[1]:5.3f} {s[0]:7.3f} / {s[1]:5.3f} {ratio:14.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
