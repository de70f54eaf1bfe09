"""Two builds of pyspec's core on one CPU, in one run: e.g. AVX2 against AVX2 with 256-bit VNNI.

Each build is a pyspec tree whose `pyspec/_core*.so` was compiled for its instruction set (a
non-in-place CMake build with its own CMAKE_CXX_FLAGS, the .so copied into a copy of the tree).
Child processes of each build alternate, round after round, so the machine's drift hits both:

1. packed matmuls of SmolLM2-135M's shapes (Q4_1 matrices, the Q8_0 output head), weights
   streamed from memory, at M = 1 (decode), 3 (a verify pass of 2 drafts) and 64 (a prompt chunk);
2. the embedded default model: greedy decode tok/s (64 tokens, best of 3 in the child), plainly
   and speculating with its embedded drafter (n_max 2, a chat request), and the prompt's tok/s.

Prints each build's best figures and the ratio b / a (above 1: b is faster).

    python bench/bench_isa_builds.py --a /tmp/avx2 --b /tmp/avx2vnni [--rounds 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, time
sys.path.insert(0, {root!r})
import numpy as np
import pyspec
from pyspec._core import kernels
from pyspec.model import default_drafter_path

threads = {threads}
out = {{"isa": kernels.isa(), "us": {{}}}}
rng = np.random.default_rng(0)
for dtype, n, k in [("Q4_1", 576, 576), ("Q4_1", 1536, 576), ("Q4_1", 576, 1536), ("Q8_0", 49152, 576)]:
    w = np.concatenate([kernels.quantize(dtype, r) for r in (rng.standard_normal((n, k)) * 0.05).astype(np.float32)])
    copies = max(1, min(256, (160 << 20) // w.nbytes))
    stream = np.tile(w, copies)
    for m in (1, 3, 64):
        x = rng.standard_normal((m, k)).astype(np.float32)
        t = min(kernels.time_matmul(dtype, stream, n, k, x, threads, max(copies, 100 if m < 64 else 20), packed=True)
                for _ in range(3))
        out["us"][f"{{dtype}} {{n}}x{{k}} M={{m}}"] = t * 1e6

def best_decode(llm, ids, chat):
    best = 0.0
    for _ in range(3):
        if chat:
            llm.chat([{{"role": "user", "content": "Write a haiku about autumn leaves falling in the rain."}}],
                     max_tokens=64, temperature=0.0)
        else:
            llm.generate(ids, max_tokens=64, temperature=0.0)
        best = max(best, llm.last_stats.decode_tokens_per_second)
    return best

plain = pyspec.LLM(n_ctx=1024, n_threads=threads)
ids = plain.tokenize("Write a short story about a robot who learns to paint. Once upon a time")
out["decode"] = best_decode(plain, ids, False)
out["chat plain"] = best_decode(plain, ids, True)
prompt = plain.tokenize(open(pyspec.__file__).read())[:384]
pp = 0.0
for _ in range(3):
    plain.generate(prompt, max_tokens=1, temperature=0.0)
    pp = max(pp, plain.last_stats.prompt_tokens_per_second)
out["prompt 384"] = pp
spec = pyspec.LLM(n_ctx=1024, n_threads=threads, draft_model=default_drafter_path(), draft_n_max=2)
out["chat spec"] = best_decode(spec, ids, True)
print(json.dumps(out))
"""


def run_child(root: str, threads: int) -> dict:
    res = subprocess.run([sys.executable, "-c", CHILD.format(root=root, threads=threads)], capture_output=True,
                         text=True, cwd=root)
    if res.returncode != 0:
        raise SystemExit(f"{root}: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="the first build's pyspec tree")
    ap.add_argument("--b", required=True, help="the second build's pyspec tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    runs = {"a": [], "b": []}
    for r in range(args.rounds):
        for side in ("a", "b"):
            runs[side].append(run_child(getattr(args, side), args.threads))
        print(f"round {r + 1}: {runs['a'][-1]['isa']} / {runs['b'][-1]['isa']} done", flush=True)
    isa_a, isa_b = runs["a"][0]["isa"], runs["b"][0]["isa"]
    print(f"\n{args.threads} threads, best of {args.rounds} alternating rounds: a = {isa_a}, b = {isa_b}")
    print("packed matmul, us (lower is better)")
    for key in runs["a"][0]["us"]:
        a = min(x["us"][key] for x in runs["a"])
        b = min(x["us"][key] for x in runs["b"])
        print(f"  {key:<22} {a:9.1f} {b:9.1f}  b/a speed x{a / b:.2f}")
    print("default model, tok/s (higher is better)")
    for key in ("decode", "prompt 384", "chat plain", "chat spec"):
        a = max(x[key] for x in runs["a"])
        b = max(x[key] for x in runs["b"])
        print(f"  {key:<22} {a:9.1f} {b:9.1f}  b/a x{b / a:.2f}")
    for side, isa in (("a", isa_a), ("b", isa_b)):
        ratios = [x["chat spec"] / x["chat plain"] for x in runs[side]]
        print(f"speculation over plain decoding, chat, {isa}: "
              + " ".join(f"x{q:.2f}" for q in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
