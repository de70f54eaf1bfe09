"""`pyspec-perplexity`: perplexity of a model over a text or token file, by llama-perplexity's method.

The input is a text file (`-f`, tokenized with the model's own tokenizer as llama-perplexity does:
one trailing newline dropped, BOS added only if the vocabulary adds one, special-token text left as
plain text) or a JSON list of token ids (`--ids`).

The ids are cut into chunks of `n_ctx` tokens (a tail that does not fill a chunk is dropped). Each
chunk is evaluated on its own from an empty cache, and only the second half of it is scored: for
positions j = n_ctx/2 .. n_ctx-2 we take -log softmax(logits_j)[id_{j+1}], so every scored token
sees at least half a context of history. PPL = exp(mean NLL) over all scored positions, and its
uncertainty is PPL times the standard error of the mean NLL, as llama-perplexity reports it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import numpy as np

from .cli_common import UserArgumentParser, UserError, read_user_file


class PerplexityError(UserError):
    """A user-facing problem (bad file, too few tokens, ...): printed as one line, exit code 1."""


@dataclass
class PerplexityResult:
    ppl: float
    ppl_stderr: float           # PPL * standard error of the mean NLL
    n_chunks: int
    n_scored: int               # number of (position, next token) pairs that were scored
    running_ppl: List[float] = field(default_factory=list)  # PPL after each chunk
    n_tokens_evaluated: int = 0
    seconds: float = 0.0


def nll_of_next_tokens(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits[i])[targets[i]] per row, computed in float64 so that summing thousands
    of them does not lose the digits that PPL comparisons look at."""
    z = np.asarray(logits, dtype=np.float64)
    zmax = z.max(axis=1, keepdims=True)
    log_sum = np.log(np.exp(z - zmax).sum(axis=1)) + zmax[:, 0]
    picked = z[np.arange(z.shape[0]), targets]
    return log_sum - picked


def ppl_with_stderr(nll_sum: float, nll2_sum: float, count: int) -> tuple:
    """exp(mean NLL) and PPL * sqrt(var(NLL) / (count - 1)), the uncertainty llama-perplexity
    prints: var is the population variance E[x^2] - E[x]^2 of the per-token NLLs."""
    mean = nll_sum / count
    ppl = math.exp(mean)
    if count < 2:
        return ppl, float("nan")
    var = nll2_sum / count - mean * mean
    if var <= 0:
        return ppl, float("nan")
    return ppl, ppl * math.sqrt(var / (count - 1))


def _check_enough_tokens(n_tokens: int, n_ctx: int, source: str = "") -> None:
    if n_tokens < 2 * n_ctx:
        where = f" in {source}" if source else ""
        raise PerplexityError(
            f"need at least {2 * n_ctx} tokens to evaluate perplexity with a context of {n_ctx} "
            f"(2 chunks), got {n_tokens}{where}")


def compute_perplexity(ctx, ids: Sequence[int], n_ctx: int, n_batch: Optional[int] = None,
                       bos_id: Optional[int] = None,
                       on_chunk: Optional[Callable[[int, float], None]] = None) -> PerplexityResult:
    """Perplexity of `ids` with chunks of `n_ctx` tokens on the decode context `ctx` (sequence 0).

    `bos_id`, when the vocabulary adds a BOS token, replaces the first token of every chunk, as
    llama-perplexity does. `on_chunk(i, running_ppl)` is called after each chunk (1-based i).
    """
    if n_ctx < 4:
        raise PerplexityError(f"context size must be at least 4, got {n_ctx}")
    tokens = np.asarray(ids, dtype=np.int64)
    _check_enough_tokens(tokens.shape[0], n_ctx)
    n_batch = min(n_batch or n_ctx, n_ctx)
    n_chunks = tokens.shape[0] // n_ctx
    first = n_ctx // 2
    positions = np.arange(n_ctx, dtype=np.int32)
    # Rows first .. n_ctx-2 predict the token after them; the last row has no target in the chunk.
    scored = (positions >= first) & (positions <= n_ctx - 2)

    nll_sum = 0.0
    nll2_sum = 0.0
    count = 0
    running: List[float] = []
    t0 = time.perf_counter()
    for c in range(n_chunks):
        chunk = tokens[c * n_ctx:(c + 1) * n_ctx].copy()
        if bos_id is not None:
            chunk[0] = bos_id
        ctx.kv_clear()
        rows_logits = []
        for b0 in range(0, n_ctx, n_batch):
            b1 = min(b0 + n_batch, n_ctx)
            # Every row is text being scored, not generated: prompt rows (the GPU's tensor cores).
            res = ctx.decode(chunk[b0:b1], positions=positions[b0:b1], output=scored[b0:b1],
                             prompt=True)
            if res.logits.shape[0] != int(scored[b0:b1].sum()):
                raise RuntimeError(
                    f"decode returned {res.logits.shape[0]} logit rows, expected "
                    f"{int(scored[b0:b1].sum())}")
            if res.logits.shape[0]:
                rows_logits.append(res.logits)
        logits = np.concatenate(rows_logits, axis=0)
        targets = chunk[first + 1:n_ctx]
        nll = nll_of_next_tokens(logits, targets)
        nll_sum += float(nll.sum())
        nll2_sum += float((nll * nll).sum())
        count += nll.shape[0]
        running.append(math.exp(nll_sum / count))
        if on_chunk is not None:
            on_chunk(c + 1, running[-1])
    seconds = time.perf_counter() - t0

    ppl, err = ppl_with_stderr(nll_sum, nll2_sum, count)
    return PerplexityResult(ppl=ppl, ppl_stderr=err, n_chunks=n_chunks, n_scored=count,
                            running_ppl=running, n_tokens_evaluated=n_chunks * n_ctx,
                            seconds=seconds)


def load_ids(path: str) -> List[int]:
    """A JSON list of token ids (or an object with an "ids" list)."""
    raw = read_user_file(path, "ids file", binary=True, error=PerplexityError)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PerplexityError(f"ids file {path} is not valid JSON: {exc}") from None
    if isinstance(data, dict) and "ids" in data:
        data = data["ids"]
    if not isinstance(data, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in data):
        raise PerplexityError(f"ids file {path} must hold a JSON list of integer token ids")
    return data


def load_text_ids(path: str, tokenizer) -> List[int]:
    """The token ids of a text file, as llama-perplexity -f gets them: the file's bytes (invalid
    UTF-8 replaced) less one trailing newline, tokenized with add_special=True and no special-token
    parsing."""
    data = read_user_file(path, "text file", binary=True, error=PerplexityError)
    if data.endswith(b"\n"):
        data = data[:-1]
    return tokenizer.encode(data.decode("utf-8", errors="replace"), add_special=True,
                            parse_special=False)


def _vocab_bos(metadata: dict) -> Optional[int]:
    """The BOS id when the vocabulary adds one (tokenizer.ggml.add_bos_token), else None."""
    if not metadata.get("tokenizer.ggml.add_bos_token", False):
        return None
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    return int(bos) if bos is not None else None


def _parser() -> argparse.ArgumentParser:
    p = UserArgumentParser(
        prog="pyspec-perplexity",
        description="Perplexity of a GGUF model over a text (llama-perplexity's method: chunks "
                    "of -c tokens, each from an empty cache, second half scored).")
    p.add_model_argument()
    p.add_argument("--ids", default=None, help="JSON file with a list of token ids")
    p.add_argument("-f", "--file", default=None,
                   help="text file, tokenized with the model's tokenizer")
    p.add_argument("-c", "--ctx-size", type=int, default=512, help="chunk size (default 512)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")
    p.add_argument("-b", "--batch-size", type=int, default=None,
                   help="tokens per decode call (default and maximum: the chunk size)")
    return p


def _run(args) -> int:
    if args.file is not None and args.ids is not None:
        raise PerplexityError("give either -f TEXTFILE or --ids IDS.json, not both")
    if args.file is None and args.ids is None:
        raise PerplexityError("no input: pass -f TEXTFILE or --ids IDS.json (a JSON list of "
                              "token ids)")
    if args.ctx_size < 4:
        raise PerplexityError(f"-c must be at least 4, got {args.ctx_size}")
    if args.threads is not None and args.threads < 1:
        raise PerplexityError(f"-t must be at least 1, got {args.threads}")
    if args.batch_size is not None and args.batch_size < 1:
        raise PerplexityError(f"-b must be at least 1, got {args.batch_size}")

    n_ctx = args.ctx_size
    import pyspec

    if args.ids is not None:
        source = args.ids
        ids = load_ids(args.ids)
        _check_enough_tokens(len(ids), n_ctx, source)
    try:
        path = args.model if args.model is not None else pyspec.default_model_path()
        if args.file is not None:
            from .tokenizer import Tokenizer

            tokenizer = Tokenizer.from_gguf(path)
    except (ValueError, RuntimeError, OSError) as exc:
        raise PerplexityError(f"cannot load model: {exc}") from None
    if args.file is not None:
        source = args.file
        ids = load_text_ids(args.file, tokenizer)
        _check_enough_tokens(len(ids), n_ctx, source)
    try:
        model = pyspec.Model(path, n_threads=args.threads)
    except (ValueError, RuntimeError, OSError) as exc:
        raise PerplexityError(f"cannot load model: {exc}") from None
    bad = [t for t in ids if t < 0 or t >= model.n_vocab]
    if bad:
        raise PerplexityError(
            f"{source} has token id {bad[0]} outside the vocabulary [0, {model.n_vocab})")
    n_batch = min(args.batch_size or n_ctx, n_ctx)
    ctx = pyspec.Context(model, n_ctx=n_ctx, n_seq_max=1, n_batch=n_batch)

    n_chunks = len(ids) // n_ctx
    print(f"perplexity: model {path}", file=sys.stderr)
    print(f"perplexity: {len(ids)} tokens from {source}, {n_chunks} chunks, n_ctx={n_ctx}, "
          f"batch_size={n_batch}, n_threads={model.n_threads}", file=sys.stderr)

    def on_chunk(i: int, running: float) -> None:
        print(f"[{i}]{running:.4f},", end="", flush=True)

    res = compute_perplexity(ctx, ids, n_ctx, n_batch, bos_id=_vocab_bos(model.metadata),
                             on_chunk=on_chunk)
    print()
    print(f"Final estimate: PPL = {res.ppl:.4f} +/- {res.ppl_stderr:.5f}", flush=True)
    tps = res.n_tokens_evaluated / res.seconds if res.seconds > 0 else float("inf")
    print(f"perplexity: evaluated {res.n_tokens_evaluated} tokens in {res.seconds:.2f} s "
          f"({tps:.1f} tokens/s, {1000.0 * res.seconds / res.n_chunks:.1f} ms per chunk), "
          f"scored {res.n_scored}", file=sys.stderr)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except PerplexityError as exc:
        print(f"pyspec-perplexity: error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, RuntimeError) as exc:
        # The core's typed errors (bad model file, invalid shapes) are user-facing too.
        print(f"pyspec-perplexity: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
