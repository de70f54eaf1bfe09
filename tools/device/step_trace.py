#!/usr/bin/env python3
"""Where a replayed decode step's time goes in the real pipeline, kernel by kernel.

ncu (kernel_times.py) times each kernel alone, with the GPU drained before and after it; under
programmatic dependent launch the kernels of a step overlap, so the sum of those times is not the
step. This records the step as it runs instead: the CUDA activity trace (CUPTI, through PyTorch's
profiler, which is on the device machines) gives every kernel's start and end on the GPU, replayed
graph nodes included. For each launch of the step (launches in order, the same in every step) it
prints the median over the recorded steps of

  start  when its first block began, from the step's first kernel's start (us)
  end    when its last block ended, likewise
  adds   end minus the previous launch's end: what this launch added to the step
  over   how far it began before the previous launch ended (its blocks resident early, waiting)

then the adds summed by kernel name. A decode step (one sequence, `context` cells of prompt):

    python3 tools/device/step_trace.py MODEL.gguf [--context 64] [--steps 16] [--layer 5]

--layer L also prints layer L's launches alone (the launches between the Lth and the (L+1)th
decode attention).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict


def kernel_events(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every GPU kernel the profiler saw, in start order."""
    out = []
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.elapsed_us() >= 0:
            name = e.name
            if name.startswith(("cudaGraphLaunch", "Memcpy", "Memset", "cuda")):
                continue
            out.append((name, float(e.time_range.start), float(e.time_range.end)))
    out.sort(key=lambda t: t[1])
    return out


def short(name: str) -> str:
    """A kernel's name without its template arguments and parameter list."""
    base = name.replace("(anonymous namespace)::", "").replace("void ", "")
    return base.split("(")[0].split("<")[0].replace("pyspec::cuda::", "").strip()


def split_steps(events, n_steps):
    """The events cut into n_steps equal runs of launches (every decode step replays one graph)."""
    per = len(events) // n_steps
    if per * n_steps != len(events):
        raise SystemExit(f"{len(events)} kernels do not split into {n_steps} equal steps")
    return [events[i * per:(i + 1) * per] for i in range(n_steps)], per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=64, help="prompt cells before the traced steps")
    ap.add_argument("--steps", type=int, default=16, help="decode steps recorded")
    ap.add_argument("--layer", type=int, default=None, help="also print this layer's launches alone")
    args = ap.parse_args()

    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, os.getcwd())
    import pyspec

    torch.cuda.init()  # the profiler's CUPTI needs the primary context, which the backend shares
    model = pyspec.Model(args.model, n_gpu_layers="all")
    ctx = pyspec.Context(model, n_ctx=max(1024, args.context + args.steps + 64), n_seq_max=1, n_batch=512)
    ids = [(i * 7919) % 1000 + 10 for i in range(args.context)]
    ctx.decode(ids, prompt=True)
    tok = 11

    def step():
        nonlocal tok
        tok = int(ctx.decode([tok], argmax=True).tokens[-1])

    for _ in range(4):  # the step's graph captured and replayed once
        step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    steps, per = split_steps(kernel_events(prof), args.steps)

    cols = defaultdict(list)  # launch index -> [(start, end, adds, over)]
    for s in steps:
        t0 = s[0][1]
        prev_end = None
        for i, (_, a, b) in enumerate(s):
            adds = b - t0 if prev_end is None else b - prev_end
            over = 0.0 if prev_end is None else prev_end - a
            cols[i].append((a - t0, b - t0, adds, over))
            prev_end = b if prev_end is None else max(prev_end, b)
    names = [short(n) for n, _, _ in steps[0]]
    med = [tuple(statistics.median(v[j] for v in cols[i]) for j in range(4)) for i in range(per)]
    step_us = statistics.median(s[-1][2] - s[0][1] for s in steps)
    print(f"{per} launches a step, {step_us:.1f} us from the first kernel's start to the last one's end "
          f"(median of {args.steps} steps)")

    by_name = defaultdict(lambda: [0, 0.0, 0.0])
    for n, (_, _, adds, over) in zip(names, med):
        by_name[n][0] += 1
        by_name[n][1] += adds
        by_name[n][2] += over
    print(f"{'kernel':<40} {'launches':>8} {'adds us':>9} {'a launch':>9} {'over a launch':>13}")
    for n, (c, a, o) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        print(f"{n:<40} {c:>8} {a:>9.1f} {a / c:>9.2f} {o / c:>13.2f}")

    if args.layer is not None:
        att = [i for i, n in enumerate(names) if "attention" in n]
        if args.layer + 1 < len(att):
            lo, hi = att[args.layer], att[args.layer + 1]
            print(f"\nlayer {args.layer}: launches {lo}..{hi - 1}")
            print(f"{'#':>4} {'kernel':<40} {'start':>8} {'end':>8} {'adds':>7} {'over':>7}")
            for i in range(lo, hi):
                a, b, adds, over = med[i]
                print(f"{i:>4} {names[i]:<40} {a:>8.1f} {b:>8.1f} {adds:>7.2f} {over:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
