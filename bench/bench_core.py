"""Prompt processing (pp512) and decode (tg128) speed of pyspec against llama.cpp, same run.

Both engines load the same GGUF (default: the embedded SmolLM2-135M-Instruct Q4_1), use the same
thread count and the same prompt tokens, and pay the same Python cost per step (one decode call and
a numpy argmax over the last row's logits). llama.cpp is driven through llama-cpp-python, once
without and once with flash attention; the ratios are against each and against the faster one.

pp512: one 512-token prompt evaluated from an empty cache (logits of the last row only).
tg128: 128 single-token decodes from an empty cache, each token the greedy choice of the previous
step (as llama-bench's tg starts from an empty context).
Each figure is the best of --repeats runs, engines interleaved so that background load hits both.
Load time is excluded. Run by hand; on a shared machine the numbers are noisy.

    python bench/bench_core.py [-m MODEL] [-t 2] [--repeats 5] [--ids IDS.json]
(with an in-place build, from the repo root: PYTHONPATH=. python bench/bench_core.py)
"""

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

N_PROMPT = 512
N_GEN = 128
N_CTX = 1024
DEFAULT_IDS = Path(__file__).resolve().parents[2] / "shared/data/eval_psf_license.ids.json"


def rss_bytes() -> int:
    """Resident set size of this process, from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class PyspecRunner:
    name = "pyspec"

    def __init__(self, path: str, n_threads: int):
        import pyspec
        self.model = pyspec.Model(path, n_threads=n_threads)
        self.ctx = pyspec.Context(self.model, n_ctx=N_CTX, n_seq_max=1, n_batch=N_PROMPT)

    def prompt(self, ids) -> None:
        self.ctx.kv_clear()
        self.ctx.decode(ids)

    def generate(self, first: int, n: int) -> list:
        self.ctx.kv_clear()
        tok, out = first, []
        for _ in range(n):
            logits = self.ctx.decode([tok]).logits[-1]
            tok = int(np.argmax(logits))
            out.append(tok)
        return out


class LlamaCppRunner:
    """llama.cpp with or without flash attention: llama-cpp-python defaults to off, while
    llama.cpp's own tools default to auto (on for the CPU), so both are peers worth beating."""

    def __init__(self, path: str, n_threads: int, flash_attn: bool):
        import llama_cpp
        self.lib = llama_cpp
        self.name = "llama.cpp+FA" if flash_attn else "llama.cpp"
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=N_CTX, n_batch=N_PROMPT,
                                   n_ubatch=N_PROMPT, n_threads=n_threads,
                                   n_threads_batch=n_threads, flash_attn=flash_attn,
                                   logits_all=False, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def _last_logits(self) -> np.ndarray:
        ptr = self.lib.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                     shape=(self.n_vocab,))

    def prompt(self, ids) -> None:
        self.llm.reset()
        self.llm.eval(ids)

    def generate(self, first: int, n: int) -> list:
        self.llm.reset()
        tok, out = first, []
        for _ in range(n):
            self.llm.eval([tok])
            tok = int(np.argmax(self._last_logits()))
            out.append(tok)
        return out


def timed(fn, *args):
    t0 = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - t0, result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default=None, help="GGUF path (default: embedded SmolLM2)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ids", default=str(DEFAULT_IDS), help="JSON list of prompt token ids")
    args = p.parse_args(argv)

    ids = json.loads(Path(args.ids).read_text())[:N_PROMPT]
    if len(ids) < N_PROMPT:
        print(f"need {N_PROMPT} prompt ids, {args.ids} has {len(ids)}", file=sys.stderr)
        return 1

    # pyspec is loaded first, alone, so its memory figures are not mixed with llama.cpp's.
    import pyspec
    path = args.model or pyspec.default_model_path()
    file_size = os.path.getsize(path)
    rss0 = rss_bytes()
    t_load, ours = timed(PyspecRunner, path, args.threads)
    rss_load = rss_bytes()
    ours.prompt(ids)
    rss_warm = rss_bytes()
    compute_buf = getattr(ours.ctx, "compute_buffer_bytes", None)
    kv_bytes = getattr(ours.ctx, "kv_cache_bytes", None)

    rss1 = rss_bytes()
    t0 = time.perf_counter()
    peers = [LlamaCppRunner(path, args.threads, flash_attn=fa) for fa in (False, True)]
    t_load_peer = (time.perf_counter() - t0) / len(peers)
    for r in peers:
        r.prompt(ids)
    rss_peers = rss_bytes() - rss1

    runners = [ours] + peers
    pp = {r.name: float("inf") for r in runners}
    tg = {r.name: float("inf") for r in runners}
    gen = {}
    for r in runners:  # warm-up: page in weights, build plans, grow buffers
        r.generate(ids[0], 4)
    for _ in range(args.repeats):
        for r in runners:
            dt, _ = timed(r.prompt, ids)
            pp[r.name] = min(pp[r.name], dt)
            dt, gen[r.name] = timed(r.generate, ids[0], N_GEN)
            tg[r.name] = min(tg[r.name], dt)

    print(f"model: {path} ({mib(file_size)}), threads: {args.threads}, "
          f"best of {args.repeats}, cpu cores online: {os.cpu_count()}")
    print(f"{'engine':<13} {'pp512 tok/s':>12} {'tg128 tok/s':>12} {'load s':>8}")
    for r in runners:
        t_l = t_load if r is ours else t_load_peer
        print(f"{r.name:<13} {N_PROMPT / pp[r.name]:>12.1f} {N_GEN / tg[r.name]:>12.1f} "
              f"{t_l:>8.2f}")
    for r in peers:
        print(f"ratio pyspec/{r.name}: pp512 {pp[r.name] / pp[ours.name]:.2f}x, "
              f"tg128 {tg[r.name] / tg[ours.name]:.2f}x")
    best_pp = min(pp[r.name] for r in peers)
    best_tg = min(tg[r.name] for r in peers)
    print(f"ratio pyspec/best llama.cpp: pp512 {best_pp / pp[ours.name]:.2f}x, "
          f"tg128 {best_tg / tg[ours.name]:.2f}x")

    for r in peers:
        same = next((i for i, (a, b) in enumerate(zip(gen[ours.name], gen[r.name])) if a != b),
                    N_GEN)
        print(f"greedy tg128 tokens: pyspec and {r.name} agree for the first {same} of {N_GEN}")

    print(f"pyspec memory: RSS after load {mib(rss_load)} (+{mib(rss_load - rss0)} over the "
          f"interpreter), after the first pp512 {mib(rss_warm)} (+{mib(rss_warm - rss0)}); "
          f"file {mib(file_size)}")
    extra = []
    if compute_buf is not None:
        extra.append(f"compute buffer {mib(compute_buf)}")
    if kv_bytes is not None:
        extra.append(f"KV cache {mib(kv_bytes)} (n_ctx {N_CTX})")
    if extra:
        print("pyspec buffers: " + ", ".join(extra))
    print(f"llama.cpp memory (both contexts): +{mib(rss_peers)} RSS after load and the first "
          f"pp512")
    return 0


if __name__ == "__main__":
    sys.exit(main())
