"""The CPU's packed weights against the file layout, both in one run (cpu/quants.h pack_weights).

1. Matmul alone, SmolLM2-135M's shapes (Q4_1 matrices, the Q8_0 output head), weights streamed
   from memory (copies past the last-level cache), at M = 1 (decode), 3 (a verify pass of 2
   drafts) and 16: microseconds each way and the ratio, alternating and best of several trials.
2. The embedded default model decoding greedily (LLM.generate, 64 tokens), in child processes
   with PYSPEC_CPU_PACK=0 and the default, alternating: tokens/s each way and the ratio.

    python bench/bench_packed_weights.py [--threads 2] [--trials 5] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyspec  # noqa: E402
from pyspec._core import kernels  # noqa: E402

# The child processes import the pyspec this one imported.
PYSPEC_HOME = str(Path(pyspec.__file__).resolve().parents[1])

SHAPES = [("Q4_1", 576, 576), ("Q4_1", 192, 576), ("Q4_1", 1536, 576), ("Q4_1", 576, 1536), ("Q8_0", 49152, 576)]
STREAM_BYTES = 160 << 20

DECODE = """
import sys, time
sys.path.insert(0, {root!r})
import pyspec
llm = pyspec.LLM(n_ctx=1024, n_threads={threads})
ids = llm.tokenize("Write a short story about a robot who learns to paint. Once upon a time")
best = 0.0
for _ in range(3):
    llm.generate(ids, max_tokens=64, temperature=0.0)
    best = max(best, llm.last_stats.decode_tokens_per_second)
print(best)
"""


def matmuls(args) -> None:
    rng = np.random.default_rng(0)
    print(f"matmul, {args.threads} threads, weights streamed from memory, best of {args.trials} (us)")
    for dtype, n, k in SHAPES:
        w = np.concatenate([kernels.quantize(dtype, r) for r in (rng.standard_normal((n, k)) * 0.05).astype(np.float32)])
        copies = max(1, min(256, STREAM_BYTES // w.nbytes))
        stream = np.tile(w, copies)
        line = f"  {dtype} {n:>5}x{k:<5}"
        for m in (1, 3, 16):
            x = rng.standard_normal((m, k)).astype(np.float32)
            calls = max(copies, 200)
            plain, packed = [], []
            for _ in range(args.trials):  # alternating, so drift hits both sides
                plain.append(kernels.time_matmul(dtype, stream, n, k, x, args.threads, calls))
                packed.append(kernels.time_matmul(dtype, stream, n, k, x, args.threads, calls, packed=True))
            a, b = min(plain), min(packed)
            line += f" | M={m:<2} {a * 1e6:7.1f} -> {b * 1e6:7.1f} x{a / b:.2f}"
        print(line, flush=True)


def decode(args) -> None:
    rates = {"0": [], "1": []}
    for _ in range(args.rounds):
        for pack in ("0", "1"):
            env = dict(os.environ, PYSPEC_CPU_PACK=pack)
            res = subprocess.run([sys.executable, "-c", DECODE.format(root=PYSPEC_HOME, threads=args.threads)], env=env,
                                 capture_output=True, text=True, check=True)
            rates[pack].append(float(res.stdout.split()[-1]))
    a, b = max(rates["0"]), max(rates["1"])
    print(f"default model, greedy decode, {args.threads} threads, best of {args.rounds} alternating runs: "
          f"file layout {a:.1f} tok/s, packed {b:.1f} tok/s, x{b / a:.2f} "
          f"(runs: {', '.join(f'{x:.0f}' for x in rates['0'])} / {', '.join(f'{x:.0f}' for x in rates['1'])})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not kernels.weights_packable("Q4_1"):
        print(f"this build ({kernels.isa()}) has no packed layout: nothing to compare")
        return 0
    matmuls(args)
    decode(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
