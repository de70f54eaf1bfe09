"""Decode speed through `pyspec-server` against the engine alone, in one run.

The server's engine thread calls the same C++ step (`_core.SpecEngine.step`) a Python loop can
call; everything else it does per step (the outputs' detokenising and stop strings, handing
pieces to the HTTP side, the event loop's work) competes with the compute threads for the cores.
This prints, alternating in one run, the engine alone (a Python loop over `SpecEngine.step`, no
drafter, greedy) and the server (no drafter, greedy, `/v1/chat/completions` with and without
`stream`), each as ms a generated token, and the server's cost over the engine's.

    python bench/bench_server_decode.py [MODEL.gguf] [--tokens 96] [--rounds 3] [-t 2]
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


def engine_ms(model, prompt_ids, n_tokens, threads):
    """ms a token of the engine alone, best of 3, the prompt's step not counted."""
    from pyspec import _core
    eng = _core.SpecEngine(model._model, None, n_ctx=4096, n_seq_max=1, n_draft_slots=1, n_batch=512,
                           draft_n_batch=512, n_threads=threads, draft_n_max=2, prefill_chunk=512,
                           kv_dtype="f16", backend="cpu", ngram_n=0, ngram_m=48)
    best = float("inf")
    for r in range(3):
        eng.add_request(r + 1, list(prompt_ids), max_tokens=n_tokens, temperature=0.0, seq=0, draft=False,
                        keep_cache=False, reuse_cache=False, stop_ids=[])
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


def server_ms(url, n_tokens, stream):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": n_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream, "cache_prompt": False}
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="GGUF path (default: the embedded default model)")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-np", "--parallel", type=int, default=0, help="server slots (default: the server's)")
    args = ap.parse_args(argv)
    import pyspec
    model = pyspec.Model(args.model, n_threads=args.threads)
    from pyspec.tokenizer import Tokenizer
    prompt_ids = Tokenizer.from_gguf(model.path).encode(PROMPT, add_special=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "pyspec.server.main", "--port", str(port), "--spec-type", "none",
           "-t", str(args.threads), "-m", model.path] + (["-np", str(args.parallel)] if args.parallel else [])
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT),
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                log.seek(0)
                print(f"pyspec-server exited with {proc.returncode}:\n{log.read()}", file=sys.stderr)
                return 1
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.1)
        server_ms(url, 8, False)  # warm-up
        for r in range(args.rounds):
            e = engine_ms(model, prompt_ids, args.tokens, args.threads)
            whole = min(server_ms(url, args.tokens, False) for _ in range(2))
            streamed = min(server_ms(url, args.tokens, True) for _ in range(2))
            print(f"round {r + 1}: engine {e:.2f} ms/token | server, whole reply {whole:.2f} ({whole / e:.2f}x)"
                  f" | server, streamed {streamed:.2f} ({streamed / e:.2f}x)", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        os.unlink(log.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
