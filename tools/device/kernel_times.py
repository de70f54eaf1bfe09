#!/usr/bin/env python3
"""Per-kernel device time of one pyspec step on the CUDA backend, measured by Nsight Compute.

The backend's own op profile (bench_cuda.py --profile) puts an event before every launch, and on
small kernels that event costs more than the kernel. This runs the step under `ncu` instead, which
times each kernel alone (gpu__time_duration), graph-replayed kernels included, and prints the
kernels by total time.

    python3 tools/device/kernel_times.py MODEL.gguf [--step decode|verify|par64|pp512] [--top 20]

--detail REGEX prints ncu's full report (stall reasons, memory throughput, occupancy) of the
first launches of the matching kernel instead, for one kernel's why.

Needs ncu on the PATH and a GPU that lets it read counters (the H200 machines on Firecracker).
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys
from collections import defaultdict

INNER = "PYSPEC_KERNEL_TIMES_INNER"


def run_step(path: str, step: str, gpu: bool = True, context: int = 64) -> None:
    """Inside ncu: warm the step up (graphs captured), then profile exactly one more of it."""
    import ctypes

    import numpy as np

    sys.path.insert(0, os.getcwd())
    import pyspec

    model = pyspec.Model(path, n_gpu_layers="all" if gpu else 0)
    ids = [(i * 7919) % 1000 + 10 for i in range(max(512, context))]
    if step == "pp512":
        ctx = pyspec.Context(model, n_ctx=1024, n_seq_max=1, n_batch=512)

        def once():
            ctx.kv_clear()
            ctx.decode(ids, prompt=True)  # as the engine prefills: every row a prompt row
    elif step == "par64":
        n = 64
        ctx = pyspec.Context(model, n_ctx=160 * n, n_seq_max=n, n_batch=512)
        for s in range(n):
            ctx.decode(ids[s:s + 16], seq_ids=[s] * 16)
        state = {"pos": np.full(n, 16, np.int32)}

        def once():
            ctx.decode(np.full(n, 11, np.int32), positions=state["pos"], seq_ids=np.arange(n, dtype=np.int32),
                       output=np.ones(n, np.bool_))
            state["pos"] += 1
    elif step == "verify":
        # A speculative round's target pass: the last token and 2 drafts, one sequence, every row
        # with logits; the drafts' rows are dropped after it as rejected ones would be.
        ctx = pyspec.Context(model, n_ctx=max(1024, context + 64), n_seq_max=1, n_batch=512)
        for p0 in range(0, context, 512):
            ctx.decode(ids[p0:min(context, p0 + 512)], prompt=True)

        def once():
            ctx.decode([11, 12, 13], positions=np.arange(context, context + 3, dtype=np.int32),
                       output=np.ones(3, np.bool_))
            ctx.kv_remove(0, context, -1)
    else:
        ctx = pyspec.Context(model, n_ctx=max(1024, context + 64), n_seq_max=1, n_batch=512)
        for p0 in range(0, context, 512):     # the prompt, in batches
            ctx.decode(ids[p0:min(context, p0 + 512)], prompt=True)
        state = {"tok": 11}

        def once():
            state["tok"] = int(np.argmax(ctx.decode([state["tok"]]).logits[-1]))
    for _ in range(3):
        once()
    if not gpu:
        return once()
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    once()
    cuda.cuProfilerStop()


def short_name(name: str) -> str:
    """'void pyspec::cuda::(anonymous namespace)::k_mul_mat<(DType)8, true, 1, 1>(TDesc, ...)' ->
    'k_mul_mat<(DType)8, true, 1, 1>'."""
    if name.startswith("void "):
        name = name[5:]
    depth, end = 0, len(name)
    for i, ch in enumerate(name):       # the argument list: the first '(' outside <...> and
        if ch == "<":                   # after the qualified name's last '::'
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and not name.startswith("(anonymous", i):
            end = i
            break
    head = name[:end]
    base, sep, args = head.partition("<")
    return base.rsplit("::", 1)[-1] + sep + args


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--step", choices=["decode", "verify", "par64", "pp512"], default="decode")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--context", type=int, default=64, help="decode: cells in the cache before the step")
    ap.add_argument("--flush-caches", action="store_true",
                    help="flush the caches before each kernel (ncu's default); without it, kernels see "
                         "the warm L2 of a real step, which is what latency-bound decode kernels get")
    ap.add_argument("--dry-run", action="store_true", help="run the step on the CPU, no ncu (checks the script)")
    ap.add_argument("--detail", metavar="REGEX", default=None,
                    help="instead of the times: ncu's full report (speed of light, memory, warp stall "
                         "reasons, occupancy, launch) of the first --detail-count launches whose kernel "
                         "name matches REGEX, e.g. 'k_mul_mat_tc_narrow_f'")
    ap.add_argument("--detail-count", type=int, default=2)
    ap.add_argument("--source", metavar="REPORT", default=None,
                    help="with --detail: also sample the warps' program counters (the smallest interval) into "
                         "REPORT.ncu-rep and print each SASS instruction of the kernel with its samples by stall "
                         "reason (ncu's source page), for where inside a launch the time goes")
    ap.add_argument("--launches", type=int, default=0, metavar="N",
                    help="also list the step's first N launches in order, each with its grid size and time "
                         "(which call of a kernel is slow: the q/k/v, o, gate/up or down of a layer)")
    args = ap.parse_args(argv)
    if args.dry_run:
        run_step(args.model, args.step, gpu=False, context=args.context)
        print(f"{args.step} ran on the CPU")
        return 0
    if os.environ.get(INNER):
        run_step(args.model, args.step, context=args.context)
        return 0
    step = [sys.executable, os.path.abspath(__file__), args.model, "--step", args.step, "--context", str(args.context)]
    if args.detail:
        cmd = ["ncu", "--clock-control", "none", "--cache-control", "all" if args.flush_caches else "none",
               "--profile-from-start", "off", "--kernel-name", f"regex:{args.detail}",
               "--launch-count", str(args.detail_count)]
        for section in ("SpeedOfLight", "MemoryWorkloadAnalysis", "WarpStateStats", "Occupancy",
                        "LaunchStats", "SchedulerStats"):
            cmd += ["--section", section]
        if args.source:
            cmd += ["--section", "SourceCounters", "--warp-sampling-interval", "0", "--import-source", "no",
                    "-f", "-o", args.source]
        res = subprocess.run(cmd + step, env=dict(os.environ, **{INNER: "1"}), capture_output=True, text=True)
        print(res.stdout[-60000:])
        if res.returncode != 0:
            print(res.stderr[-3000:], file=sys.stderr)
            return res.returncode
        if args.source:   # the report's sections, then its per-instruction page
            for page in (["--page", "details"], ["--page", "source", "--csv", "--print-source", "sass"]):
                out = subprocess.run(["ncu", "-i", args.source + ".ncu-rep"] + page, capture_output=True, text=True)
                print(out.stdout, out.stderr[-2000:], sep="\n")  # whole: the CSV page starts with its header
        return res.returncode
    cmd = ["ncu", "--clock-control", "none", "--cache-control", "all" if args.flush_caches else "none",
           "--profile-from-start", "off", "--metrics",
           "gpu__time_duration.sum,launch__grid_size", "--csv", "--print-units", "base"] + step
    res = subprocess.run(cmd, env=dict(os.environ, **{INNER: "1"}), capture_output=True, text=True)
    rows = [line for line in res.stdout.splitlines() if line.startswith('"')]
    if res.returncode != 0 or not rows:
        print(res.stdout[-3000:], res.stderr[-3000:], sep="\n", file=sys.stderr)
        return 1
    per = defaultdict(lambda: [0, 0.0])
    launches = defaultdict(dict)  # launch id -> name, metrics
    for rec in csv.DictReader(io.StringIO("\n".join(rows))):
        launch = launches[rec.get("ID", "")]
        launch["name"] = short_name(rec["Kernel Name"])
        launch[rec.get("Metric Name")] = rec["Metric Value"].replace(",", "")
        if rec.get("Metric Name") != "gpu__time_duration.sum":
            continue
        k = per[short_name(rec["Kernel Name"])]
        k[0] += 1
        k[1] += float(rec["Metric Value"].replace(",", "")) * 1e-3   # ns -> us
    total = sum(v[1] for v in per.values())
    n = sum(v[0] for v in per.values())
    at = f" at {args.context} cells" if args.step == "decode" else ""
    print(f"{os.path.basename(args.model)} {args.step}{at}: {n} kernels, {total:.1f} us of kernel time "
          f"(ncu, each kernel alone)")
    for name, (calls, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"  {us:9.1f} us  {calls:5d} x {us / calls:7.2f} us  {100 * us / total:5.1f}%  {name[:90]}")
    for i, launch in enumerate(list(launches.values())[:args.launches]):
        us = float(launch.get("gpu__time_duration.sum", "nan")) * 1e-3
        print(f"  #{i:<4d} {us:8.2f} us  grid {launch.get('launch__grid_size', '?'):>6}  {launch['name'][:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
