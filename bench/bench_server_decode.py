"""Decode speed through `pyspec-server` against the engine alone, in one run.

The server's engine thread calls the same C++ step (`_core.SpecEngine.step`) a Python loop can
call; everything else it does per step (the outputs' detokenising and stop strings, handing
pieces to the HTTP side, the event loop's work) competes with the compute threads for the cores.
This prints, alternating in one run, the engine alone (a Python loop over `SpecEngine.step`, no
drafter, greedy) and the server (no drafter, greedy, `/v1/chat/completions` with and without
`stream`), each as ms a generated token, and the server's cost over the engine's. On Linux it
also prints the CPU time the server's event-loop thread spent a streamed token (from /proc).
--sampled samples every request with llama-server's default chain (top-k 40, top-p 0.95, min-p 0.05,
T 0.8; a fixed seed) instead of greedily: what a client that sends no sampling fields gets.
--compare-loop runs a second server on plain asyncio and h11 (PYSPEC_SERVER_LOOP/HTTP) and
alternates the two servers' streamed replies. --compare-ahead runs a second server (and the engine
alone a second time) without decoding ahead (PYSPEC_DECODE_AHEAD=0: each step waits for the host
to read the step before), which on a GPU (-ngl all) shows what overlapping the host's per-token
work with the kernels gives.

    python bench/bench_server_decode.py [MODEL.gguf] [--tokens 96] [--rounds 3] [-t 2] [-ngl all]
        [--compare-loop] [--compare-ahead] [--sampled]
(from the repo root; default model: the embedded SmolLM2)
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = "Tell me about the sea."
GREEDY = {"temperature": 0.0}
# llama-server's default chain, seeded so every run and path draws alike (--sampled).
SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 1234}
SAMPLING = dict(GREEDY)  # what every path asks for (main sets it)


def engine_ms(model, prompt_ids, n_tokens, threads, ahead=True):
    """ms a token of the engine alone, best of 3, the prompt's step not counted."""
    from pyspec import _core
    eng = _core.SpecEngine(model._model, None, n_ctx=4096, n_seq_max=1, n_draft_slots=1, n_batch=512,
                           draft_n_batch=512, n_threads=threads, draft_n_max=2, prefill_chunk=512,
                           kv_dtype="f16", backend=model.backend, ngram_n=0, ngram_m=48,
                           decode_ahead=ahead)
    best = float("inf")
    for r in range(3):
        eng.add_request(r + 1, list(prompt_ids), max_tokens=n_tokens, seq=0, draft=False,
                        keep_cache=False, reuse_cache=False, stop_ids=[], **SAMPLING)
        n, t0 = 0, None
        while True:
            outs = eng.step()
            if t0 is None:  # the prompt's step gave the first token
                t0, n = time.perf_counter(), sum(len(o["tokens"]) for o in outs)
                continue
            n += sum(len(o["tokens"]) for o in outs)
            if any(o["finished"] for o in outs):
                break
        best = min(best, (time.perf_counter() - t0) / max(1, n - 1) * 1e3)
    return best


def scheduler_ms(model, tokenizer, prompt_ids, n_tokens, threads, ahead, stream=True):
    """ms a streamed token through the server's engine thread (pyspec.server.scheduler) without the
    HTTP layer: its per-token detokenising, stop strings and hand-over to an asyncio reader, for
    machines without the server's web dependencies. Best of 3, by the reply's own timings."""
    import asyncio
    from pyspec.server.scheduler import Scheduler, SchedulerConfig
    from pyspec.server.types import Final, GenerationRequest
    prev = os.environ.get("PYSPEC_DECODE_AHEAD")
    os.environ["PYSPEC_DECODE_AHEAD"] = "1" if ahead else "0"  # read when the engine is made
    try:
        sched = Scheduler(model._model, tokenizer, None,
                          SchedulerConfig(n_slots=1, n_ctx_slot=4096, n_threads=threads, backend=model.backend))
    finally:
        if prev is None:
            os.environ.pop("PYSPEC_DECODE_AHEAD")
        else:
            os.environ["PYSPEC_DECODE_AHEAD"] = prev
    sched.start()

    async def one():
        # Not ignore_eos: that biases the end-of-generation ids (llama.cpp's way), and a request
        # whose logits the host processes reads them and never takes the graph's greedy id.
        h = sched.submit(GenerationRequest(prompt_ids=list(prompt_ids), n_predict=n_tokens, cache_prompt=False,
                                           **SAMPLING), stream=stream)
        async for item in h:
            if isinstance(item, Final):
                return item.predicted_ms / max(1, item.n_predicted)
    try:
        return min(asyncio.run(one()) for _ in range(3))
    finally:
        sched.stop()


def server_ms(url, n_tokens, stream):
    body = dict({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": n_tokens,
                 "ignore_eos": True, "stream": stream, "cache_prompt": False}, **SAMPLING)
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=300, stream=stream)
    r.raise_for_status()
    timings = None
    if stream:
        # Only the bytes as they come (the client shares the cores with the server here): the
        # last event with timings is parsed after the reply ends.
        raw = b"".join(r.iter_content(chunk_size=None))
        for line in reversed(raw.split(b"\n")):
            if line.startswith(b"data: {") and b'"timings"' in line:
                timings = json.loads(line[6:])["timings"]
                break
    else:
        timings = r.json()["timings"]
    return timings["predicted_per_token_ms"]


def loop_thread_cpu(pid):
    """CPU seconds of the process's main thread (the event loop's), or None off Linux: from
    schedstat (nanoseconds) where the kernel has it, else from stat (clock ticks, 10 ms)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            return int(f.read().split()[0]) * 1e-9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            st = f.read()
    except OSError:
        return None
    fields = st[st.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def streamed_loop_ms(proc, url, n_tokens):
    """(ms a streamed token by the server's timings, event-loop CPU ms a token or None)."""
    c0 = loop_thread_cpu(proc.pid)
    ms = server_ms(url, n_tokens, True)
    c1 = loop_thread_cpu(proc.pid)
    return ms, None if c0 is None or c1 is None else (c1 - c0) / n_tokens * 1e3


def start_server(model_path, threads, parallel, env_extra, ngl="0"):
    """(process, url, log file) of a pyspec-server without a drafter, once it answers /health."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "pyspec.server.main", "--port", str(port), "--spec-type", "none",
           "-t", str(threads), "-m", model_path, "-ngl", str(ngl)] + (["-np", str(parallel)] if parallel else [])
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT),
                            env=dict(os.environ, PYTHONPATH=str(ROOT), **env_extra))
    url = f"http://127.0.0.1:{port}"
    why = "pyspec-server did not answer /health in 60 s"
    for _ in range(600):
        if proc.poll() is not None:
            log.seek(0)
            why = f"pyspec-server exited with {proc.returncode}:\n{log.read()}"
            break
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except requests.ConnectionError:
            pass
        time.sleep(0.1)
    proc.terminate()
    proc.wait(timeout=30)
    log.close()
    os.unlink(log.name)
    raise RuntimeError(why)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="GGUF path (default: the embedded default model)")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-np", "--parallel", type=int, default=0, help="server slots (default: the server's)")
    ap.add_argument("-ngl", "--n-gpu-layers", default="0", help="0: CPU; all: the GPU (llama.cpp's -ngl)")
    ap.add_argument("--compare-loop", action="store_true",
                    help="also a server on plain asyncio and h11, alternating with the default one")
    ap.add_argument("--compare-ahead", action="store_true",
                    help="also a server and an engine without decoding ahead (PYSPEC_DECODE_AHEAD=0)")
    ap.add_argument("--scheduler-only", action="store_true",
                    help="the server's engine thread without HTTP (no web dependencies needed), with "
                         "and without decoding ahead, against the engine alone")
    ap.add_argument("--sampled", action="store_true",
                    help="sample with llama-server's default chain (seeded) instead of greedily")
    args = ap.parse_args(argv)
    SAMPLING.clear()
    SAMPLING.update(SAMPLED if args.sampled else GREEDY)
    import pyspec
    model = pyspec.Model(args.model, n_threads=args.threads, n_gpu_layers=args.n_gpu_layers)
    from pyspec.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_gguf(model.path)
    prompt_ids = tokenizer.encode(PROMPT, add_special=True)
    if args.scheduler_only:
        for r in range(args.rounds):
            line = f"round {r + 1}:"
            for ahead in (True, False):
                e = engine_ms(model, prompt_ids, args.tokens, args.threads, ahead=ahead)
                sch = scheduler_ms(model, tokenizer, prompt_ids, args.tokens, args.threads, ahead)
                whole = scheduler_ms(model, tokenizer, prompt_ids, args.tokens, args.threads, ahead, stream=False)
                line += (f" | {'ahead' if ahead else 'not ahead'}: engine {e:.3f} ms/token, server's engine "
                         f"thread {sch:.3f} streamed ({sch / e:.2f}x), {whole:.3f} whole ({whole / e:.2f}x)")
            print(line, flush=True)
        return 0
    servers = []  # (label, process, url, log)
    try:
        try:
            ngl = args.n_gpu_layers
            servers.append(("auto",) + start_server(model.path, args.threads, args.parallel, {}, ngl))
            if args.compare_loop:
                servers.append(("asyncio+h11",) + start_server(
                    model.path, args.threads, args.parallel,
                    {"PYSPEC_SERVER_LOOP": "asyncio", "PYSPEC_SERVER_HTTP": "h11"}, ngl))
            if args.compare_ahead:
                servers.append(("not ahead",) + start_server(
                    model.path, args.threads, args.parallel, {"PYSPEC_DECODE_AHEAD": "0"}, ngl))
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 1
        for _, _, url, _ in servers:
            server_ms(url, 8, False)  # warm-up
        for r in range(args.rounds):
            e = engine_ms(model, prompt_ids, args.tokens, args.threads)
            line = f"round {r + 1}: engine {e:.3f} ms/token"
            if args.compare_ahead:
                e0 = engine_ms(model, prompt_ids, args.tokens, args.threads, ahead=False)
                line += f" (not ahead {e0:.3f}: {e0 / e:.2f}x)"
            for label, proc, url, _ in servers:
                whole = min(server_ms(url, args.tokens, False) for _ in range(2))
                runs = [streamed_loop_ms(proc, url, args.tokens) for _ in range(2)]
                streamed = min(ms for ms, _ in runs)
                loop = [c for _, c in runs if c is not None]
                line += (f" | [{label}] whole reply {whole:.3f} ({whole / e:.2f}x), streamed {streamed:.3f}"
                         f" ({streamed / e:.2f}x)" + (f", event loop {min(loop):.2f} ms CPU a token" if loop else ""))
            print(line, flush=True)
    finally:
        for _, proc, _, log in servers:
            proc.terminate()
            proc.wait(timeout=30)
            log.close()
            os.unlink(log.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
