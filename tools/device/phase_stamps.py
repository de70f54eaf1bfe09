#!/usr/bin/env python3
"""When a decoder layer's kernels run their phases, in a replayed decode step (cuda/phase_stamps.cuh).

step_trace.py gives each launch's start and end in the pipeline; this looks inside the launches.
It needs the diagnostic build, whose kernels stamp %globaltimer at their phases. The decode
attention: 0 start, 1 the work before the PDL wait done, 2 the wait over, 3 the prologue done,
4 the first chunk's copies landed, 5 its K dot, 6 its softmax, 7 its V rows, 8 the output stored.
The row-streaming MUL_MATs (q/k/v, o, gate/up, down at one column of 16-bit weights): 0 start,
1 early weight loads issued, 2 the wait over, 3 the column staged (normalised), 4 warp 0's first
item stored, 5 the block's last warp done.

    cmake -S . -B build/cuda-phases -G Ninja -DPYSPEC_CUDA=ON -DPYSPEC_INPLACE=ON \\
      -DPYSPEC_CUDA_PHASE_STAMPS=ON -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" &&
      cmake --build build/cuda-phases -j"$(nproc)" --target _core
    python3 tools/device/phase_stamps.py MODEL.gguf [--layer 5] [--context 64] [--steps 8]

(The build puts its extension into pyspec/, in place of the normal one: rebuild that afterwards,
e.g. with cuda_check.sh.) It decodes one sequence, and for layer L's launches in steps
20..20+steps-1 (q/k/v, the attention, o, gate/up, down: a Qwen3 or llama model whose MUL_MATs
all stream rows, so four row launches a layer and one for the output head) prints each phase's
earliest and latest time over each launch's blocks, in ns from the q/k/v launch's first block
start, as the median over the steps.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

CHILD = "PYSPEC_PHASE_STAMPS_CHILD"
FIRST_STEP = 20  # steps before: the graph captured, replays settled
ATTENTION = ["start", "pre-wait work done", "wait over", "prologue done", "copies landed", "K dot",
             "softmax", "V rows", "output stored"]
ROWS = ["start", "early loads issued", "wait over", "column staged", "first item stored", "block done"]
LAYER_ROWS = ["q/k/v", "o", "gate/up", "down"]  # the row launches of a layer, in order
LINE = re.compile(r"PHASES (\S+) launch (\d+) step (\d+) at (\d+) t0 (\d+):(.*)")


def decode(path: str, context: int, steps: int) -> None:
    """The child: one sequence's prompt, then decode steps (the kernels print as they replay)."""
    sys.path.insert(0, os.getcwd())
    import pyspec

    model = pyspec.Model(path, n_gpu_layers="all")
    ctx = pyspec.Context(model, n_ctx=max(1024, context + steps + 64), n_seq_max=1, n_batch=512)
    ctx.decode([(i * 7919) % 1000 + 10 for i in range(context)], prompt=True)
    tok = 11
    for _ in range(steps):
        tok = int(ctx.decode([tok], argmax=True).tokens[-1])


def n_layers(path: str) -> int:
    import gguf

    reader = gguf.GGUFReader(path)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    field = reader.fields[f"{arch}.block_count"]
    return int(field.parts[-1][0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--layer", type=int, default=5)
    ap.add_argument("--context", type=int, default=64, help="prompt cells before the decode steps")
    ap.add_argument("--steps", type=int, default=8, help="steps stamped (after the first 20)")
    args = ap.parse_args()
    if os.environ.get(CHILD):
        decode(args.model, args.context, FIRST_STEP + args.steps + 1)
        return 0
    n = n_layers(args.model)
    select = {"ATT": (n, args.layer, 1), "ROWS": (4 * n + 1, 4 * args.layer, 4)}
    env = dict(os.environ, **{CHILD: "1"})
    for tag, (every, at, span) in select.items():
        for key, value in (("EVERY", every), ("AT", at), ("SPAN", span), ("FROM", FIRST_STEP),
                           ("COUNT", args.steps)):
            env[f"PYSPEC_CUDA_PHASE_{tag}_{key}"] = str(value)
    out = subprocess.run([sys.executable, *sys.argv], env=env, capture_output=True, text=True)
    # (step, launch name) -> (t0, {slot: (earliest, latest)})
    launches: dict[tuple[int, str], tuple[int, dict[int, tuple[int, int]]]] = {}
    for ln in out.stdout.splitlines():
        m = LINE.match(ln)
        if not m:
            continue
        kernel, step, at, t0 = m.group(1), int(m.group(3)), int(m.group(4)), int(m.group(5))
        name = "attention" if kernel == "attention_staged" else LAYER_ROWS[at - 4 * args.layer]
        slots = {int(a): (int(b), int(c)) for a, b, c in re.findall(r" (\d+):(-?\d+)\.\.(-?\d+)", m.group(6))}
        launches[step, name] = (t0, slots)
    steps = sorted({step for step, name in launches if (step, "q/k/v") in launches})
    if out.returncode != 0 or not steps:
        sys.stderr.write(out.stderr[-3000:])
        print("no PHASES lines for the layer: is this the diagnostic build (-DPYSPEC_CUDA_PHASE_STAMPS=ON), "
              "and does the model stream its rows (16-bit weights)?")
        return 1
    print(f"layer {args.layer}, {len(steps)} steps: median ns from the q/k/v launch's first block start")
    print(f"{'launch':<10} {'#':>2} {'phase':<20} {'earliest':>9} {'latest':>9}")
    for name in ["q/k/v", "attention", "o", "gate/up", "down"]:
        names = ATTENTION if name == "attention" else ROWS
        for slot in range(len(names)):
            lo, hi = [], []
            for step in steps:
                if (step, name) not in launches:
                    continue
                t0, slots = launches[step, name]
                if slot in slots:
                    shift = t0 - launches[step, "q/k/v"][0]
                    lo.append(slots[slot][0] + shift)
                    hi.append(slots[slot][1] + shift)
            if lo:
                print(f"{name:<10} {slot:>2} {names[slot]:<20} {statistics.median(lo):>9.0f} "
                      f"{statistics.median(hi):>9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
