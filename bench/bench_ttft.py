"""Time to the first token: the target work that turns a prompt into its first token's logits.

Three ways, alternating in one run, at each prompt length:
  two passes  prompt[:-1] as prompt rows, then the last token as one output row: what the engine
              did before its prompt pass gave the first token (every weight read a second time
              for one row; on a GPU the second pass runs on the CUDA cores);
  output row  one pass whose last row is an output row (Context.decode's default): on a GPU the
              prompt rows run on tensor cores and the last row's products on the CUDA cores;
  one pass    one pass, every row a prompt row, the last with logits (Context.decode(prompt=True)):
              what the engine and the Python loops do now.
Then the engine's own time to the first token (SpecEngine without a drafter: add_request, step
until a token comes out), which takes the one-pass path.

    python bench/bench_ttft.py [MODEL.gguf] [-ngl all] [--lengths 16,64,256,512]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="GGUF path (default: the embedded default model)")
    ap.add_argument("-ngl", "--n-gpu-layers", default="0", help="0: CPU, all: the GPU")
    ap.add_argument("--lengths", default="16,64,256,512")
    ap.add_argument("--repeats", type=int, default=5, help="alternating rounds; the best of each")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    import pyspec
    from pyspec import _core

    ngl = args.n_gpu_layers if args.n_gpu_layers in ("all", "auto") else int(args.n_gpu_layers)
    model = pyspec.Model(args.model, n_threads=args.threads, n_gpu_layers=ngl)  # None: the default
    lengths = [int(x) for x in args.lengths.split(",")]
    n_ctx = 2 * max(lengths) + 64
    ctx = pyspec.Context(model, n_ctx=n_ctx, n_seq_max=1, n_batch=max(lengths))
    rng = np.random.default_rng(0)
    print(f"# {Path(model.path).name}: {model!r}", flush=True)

    def two_passes(ids):
        ctx.kv_clear()
        if len(ids) > 1:
            ctx.decode(ids[:-1], output=np.zeros(len(ids) - 1, np.bool_))
        return ctx.decode(ids[-1:]).logits[-1]

    def output_row(ids):
        ctx.kv_clear()
        return ctx.decode(ids).logits[-1]

    def one_pass(ids):
        ctx.kv_clear()
        return ctx.decode(ids, prompt=True).logits[-1]

    ways = [("two passes", two_passes), ("output row", output_row), ("one pass", one_pass)]
    engine = _core.SpecEngine(model._model, None, n_ctx=n_ctx, n_seq_max=1, n_batch=max(lengths),
                              prefill_chunk=max(lengths), n_threads=args.threads,
                              backend=model.backend)
    req = [0]

    def engine_first_token(ids):
        req[0] += 1
        engine.add_request(req[0], ids, max_tokens=1)
        while engine.n_requests:
            for o in engine.step():
                if o["tokens"]:
                    first = o["tokens"][0]
        return first

    print(f"{'tokens':>6} " + " ".join(f"{w:>12}" for w, _ in ways) + f" {'engine':>9}"
          + "   one pass vs two passes / vs output row", flush=True)
    for n in lengths:
        ids = [int(x) for x in rng.integers(256, model.n_vocab - 3, size=n)]
        for _, fn in ways:       # warm: weight uploads, graph captures
            fn(ids)
        engine_first_token(ids)
        best = {w: float("inf") for w, _ in ways}
        best["engine"] = float("inf")
        for _ in range(args.repeats):
            for w, fn in ways + [("engine", engine_first_token)]:
                t0 = time.perf_counter()
                fn(ids)
                best[w] = min(best[w], time.perf_counter() - t0)
        ms = {w: 1e3 * t for w, t in best.items()}
        print(f"{n:6d} " + " ".join(f"{ms[w]:9.2f} ms" for w, _ in ways) + f" {ms['engine']:6.2f} ms"
              f"   x{best['two passes'] / best['one pass']:.2f} / x{best['output row'] / best['one pass']:.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
