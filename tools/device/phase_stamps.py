#!/usr/bin/env python3
"""When a kernel's phases happen inside its launch, in a replayed decode step (cuda/phase_stamps.cuh).

step_trace.py gives each launch's start and end in the pipeline; this looks inside one launch. It
needs the diagnostic build, whose kernels stamp %globaltimer at their phases (the decode attention:
0 start, 1 the work before the PDL wait done, 2 the wait over, 3 the prologue done, 4 the first
chunk's copies landed, 5 its K dot, 6 its softmax, 7 its V rows, 8 the output stored):

    cmake -S . -B build/cuda-phases -G Ninja -DPYSPEC_CUDA=ON -DPYSPEC_INPLACE=ON \\
      -DPYSPEC_CUDA_PHASE_STAMPS=ON -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" &&
      cmake --build build/cuda-phases -j"$(nproc)" --target _core
    python3 tools/device/phase_stamps.py MODEL.gguf [--layer 5] [--context 64] [--steps 8]

(The build puts its extension into pyspec/, in place of the normal one: rebuild that afterwards,
e.g. with cuda_check.sh.) It decodes one sequence, and for layer L's decode attention in steps
20..20+steps-1 prints each phase's earliest and latest time over the launch's blocks, in ns from
the first block's start, as the median over the steps. The kernels' row-streaming MUL_MATs are
not stamped: the attention's slot 2 (its wait over) marks when the launch before it ended.
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
NAMES = ["start", "pre-wait work done", "wait over", "prologue done", "copies landed", "K dot",
         "softmax", "V rows", "output stored"]


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
    env = dict(os.environ, **{CHILD: "1", "PYSPEC_CUDA_PHASE_EVERY": str(n_layers(args.model)),
                              "PYSPEC_CUDA_PHASE_AT": str(args.layer), "PYSPEC_CUDA_PHASE_FROM": str(FIRST_STEP),
                              "PYSPEC_CUDA_PHASE_COUNT": str(args.steps)})
    out = subprocess.run([sys.executable, *sys.argv], env=env, capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("PHASES ")]
    if out.returncode != 0 or not lines:
        sys.stderr.write(out.stderr[-3000:])
        print("no PHASES lines: is this the diagnostic build (-DPYSPEC_CUDA_PHASE_STAMPS=ON)?")
        return 1
    slots: dict[int, list[tuple[int, int]]] = {}
    for ln in lines:
        for slot, lo, hi in re.findall(r" (\d+):(-?\d+)\.\.(-?\d+)", ln):
            slots.setdefault(int(slot), []).append((int(lo), int(hi)))
    print(f"{lines[0].split()[1]}, layer {args.layer}, {len(lines)} steps (median ns from the first block's start)")
    print(f"{'#':>2} {'phase':<22} {'earliest':>9} {'latest':>9}")
    for slot in sorted(slots):
        lo = statistics.median(v[0] for v in slots[slot])
        hi = statistics.median(v[1] for v in slots[slot])
        name = NAMES[slot] if slot < len(NAMES) else ""
        print(f"{slot:>2} {name:<22} {lo:>9.0f} {hi:>9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
