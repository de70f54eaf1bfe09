"""The JSON of every result, as llama-server writes it (reference §1.3-1.6, `server-task.cpp`):
native /completion (final object and stream partials), OpenAI text completion, OpenAI chat
completion (object and stream chunks), token probabilities, usage, and SSE framing.

Pure functions of the scheduler's Chunk/Final objects; app.py decides which to send when.
"""

from __future__ import annotations

import json
import math
import secrets
import string
import time
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence

from .types import Chunk, Final, GenerationRequest, TokenProb

_ALNUM = string.ascii_letters + string.digits
SSE_DONE = b"data: [DONE]\n\n"


def completion_id() -> str:
    """llama's id: "chatcmpl-" + 32 random alphanumerics (also for /v1/completions)."""
    return "chatcmpl-" + "".join(secrets.choice(_ALNUM) for _ in range(32))


def sse(obj) -> bytes:
    """One SSE event: `data: <compact json>\\n\\n` (format_oai_sse)."""
    return b"data: " + dumps(obj).encode("utf-8") + b"\n\n"


def dumps(obj) -> str:
    """Compact JSON as llama sends it; non-finite floats become null (nlohmann does the same,
    and Python's NaN/Infinity literals are not JSON). The copy that replaces them is made only
    when the encoder meets one: a streamed token's event is encoded once, not walked first."""
    try:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:  # a NaN or an infinity somewhere
        return json.dumps(_finite(obj), separators=(",", ":"), ensure_ascii=False)


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


@dataclass
class ResponseContext:
    """What every response of one HTTP request shares."""

    tokenizer: object
    model: str                                   # the server's model name, never the request's
    system_fingerprint: str = "b0-pyspec"
    id: str = field(default_factory=completion_id)
    created: int = field(default_factory=lambda: int(time.time()))


def finish_reason(stop_type: str) -> str:
    """OAI finish_reason: "stop" for EOS or a stop word, else "length"."""
    return "stop" if stop_type in ("eos", "word") else "length"


# -- probabilities -------------------------------------------------------------------------------

def _token_entry(tokenizer, tid: int, logprob: float) -> dict:
    piece = tokenizer.token_to_piece(tid)
    return {"id": tid, "token": piece.decode("utf-8", errors="replace"),
            "bytes": list(piece), "logprob": logprob}


def token_prob_json(tokenizer, p: TokenProb) -> dict:
    """{id, token, bytes, logprob, top_logprobs: [{id, token, bytes, logprob}]}: the entry of
    native `completion_probabilities` and of OAI `logprobs.content`."""
    e = _token_entry(tokenizer, p.id, p.logprob)
    e["top_logprobs"] = [_token_entry(tokenizer, t, lp) for t, lp in p.top]
    return e


def probs_json(tokenizer, probs: Sequence[TokenProb]) -> List[dict]:
    return [token_prob_json(tokenizer, p) for p in probs]


# -- usage -----------------------------------------------------------------------------------------

def usage_json(finals: Sequence[Final], prompt_finals: Optional[Sequence[Final]] = None) -> dict:
    """OAI usage. With several choices of one prompt the prompt is counted once
    (`prompt_finals`: one Final per distinct prompt; default all)."""
    pf = finals if prompt_finals is None else prompt_finals
    completion = sum(f.n_predicted for f in finals)
    prompt = sum(f.n_prompt for f in pf)
    return {"completion_tokens": completion, "prompt_tokens": prompt,
            "total_tokens": completion + prompt,
            "prompt_tokens_details": {"cached_tokens": sum(f.n_cached for f in pf)}}


# -- native /completion --------------------------------------------------------------------------

def native_final(ctx: ResponseContext, final: Final, req: GenerationRequest, index: int,
                 settings: dict, return_tokens: bool = False, stream: bool = False) -> dict:
    """to_json_non_oaicompat. In a stream it is the last event, with content "" and tokens []
    (the text was already sent)."""
    n_prompt = final.n_prompt
    out = {
        "index": index,
        "content": "" if stream else final.content,
        "tokens": list(final.tokens) if (return_tokens and not stream) else [],
        "id_slot": final.id_slot,
        "stop": True,
        "model": ctx.model,
        "tokens_predicted": final.n_predicted,
        "tokens_evaluated": n_prompt,
        "generation_settings": settings,
        "prompt": ctx.tokenizer.decode(req.prompt_ids, continuation=True),
        "has_new_line": "\n" in final.content,
        "truncated": final.truncated,
        "stop_type": final.stop_type,
        "stopping_word": final.stopping_word,
        # tokens in the slot's cache: the last sampled token was never decoded
        "tokens_cached": n_prompt + max(0, final.n_predicted - 1),
        "timings": final.timings(),
    }
    if req.n_probs > 0 and not stream:
        out["completion_probabilities"] = probs_json(ctx.tokenizer, final.probs)
    return out


def native_partial(ctx: ResponseContext, chunk: Chunk, index: int, n_predicted: int,
                   n_prompt: int, n_probs: int = 0) -> dict:
    """A native stream event; `n_predicted` counts the tokens generated so far."""
    out = {"index": index, "content": chunk.text, "tokens": list(chunk.tokens), "stop": False,
           "id_slot": -1, "tokens_predicted": n_predicted, "tokens_evaluated": n_prompt}
    if n_probs > 0:
        out["completion_probabilities"] = probs_json(ctx.tokenizer, chunk.probs)
    return out


# -- OAI /v1/completions ---------------------------------------------------------------------------

def _oai_logprobs(ctx: ResponseContext, probs: Sequence[TokenProb], n_probs: int):
    if n_probs <= 0:
        return None
    return {"content": probs_json(ctx.tokenizer, probs)}


def oai_completion(ctx: ResponseContext, finals: Sequence[Final], n_probs: int = 0,
                   prompt_finals: Optional[Sequence[Final]] = None) -> dict:
    """The /v1/completions object; several results (n > 1, several prompts) are its choices."""
    choices = [{"text": f.content, "index": i, "logprobs": _oai_logprobs(ctx, f.probs, n_probs),
                "finish_reason": finish_reason(f.stop_type)} for i, f in enumerate(finals)]
    return {"choices": choices, "created": ctx.created, "model": ctx.model,
            "system_fingerprint": ctx.system_fingerprint, "object": "text_completion",
            "usage": usage_json(finals, prompt_finals), "id": ctx.id,
            "timings": finals[-1].timings()}


def oai_completion_chunk(ctx: ResponseContext, chunk: Chunk, index: int, n_probs: int = 0) -> dict:
    return {"choices": [{"text": chunk.text, "index": index,
                         "logprobs": _oai_logprobs(ctx, chunk.probs, n_probs),
                         "finish_reason": None}],
            "created": ctx.created, "model": ctx.model,
            "system_fingerprint": ctx.system_fingerprint, "object": "text_completion",
            "id": ctx.id}


def oai_completion_final_chunk(ctx: ResponseContext, final: Final, index: int) -> dict:
    return {"choices": [{"text": "", "index": index, "logprobs": None,
                         "finish_reason": finish_reason(final.stop_type)}],
            "created": ctx.created, "model": ctx.model,
            "system_fingerprint": ctx.system_fingerprint, "object": "text_completion",
            "usage": usage_json([final]), "id": ctx.id, "timings": final.timings()}


# -- OAI chat --------------------------------------------------------------------------------------

def chat_completion(ctx: ResponseContext, finals: Sequence[Final], logprobs: bool = False,
                    prompt_finals: Optional[Sequence[Final]] = None) -> dict:
    """The chat.completion object; n > 1 gives several choices."""
    choices = []
    for i, f in enumerate(finals):
        choice = {"finish_reason": finish_reason(f.stop_type), "index": i,
                  "message": {"role": "assistant", "content": f.content}}
        if logprobs:
            choice["logprobs"] = {"content": probs_json(ctx.tokenizer, f.probs)}
        choices.append(choice)
    return {"choices": choices, "created": ctx.created, "model": ctx.model,
            "system_fingerprint": ctx.system_fingerprint, "object": "chat.completion",
            "usage": usage_json(finals, prompt_finals), "id": ctx.id,
            "timings": finals[-1].timings()}


def _chat_chunk(ctx: ResponseContext, choices: list) -> dict:
    return {"choices": choices, "created": ctx.created, "id": ctx.id, "model": ctx.model,
            "system_fingerprint": ctx.system_fingerprint, "object": "chat.completion.chunk"}


def chat_role_chunk(ctx: ResponseContext, index: int = 0) -> dict:
    """The first event: role assistant, content null (clients test both)."""
    return _chat_chunk(ctx, [{"finish_reason": None, "index": index,
                              "delta": {"role": "assistant", "content": None}}])


def chat_content_chunk(ctx: ResponseContext, chunk: Chunk, index: int = 0,
                       logprobs: bool = False) -> dict:
    choice = {"finish_reason": None, "index": index, "delta": {"content": chunk.text}}
    if logprobs:
        choice["logprobs"] = {"content": probs_json(ctx.tokenizer, chunk.probs)}
    return _chat_chunk(ctx, [choice])


def chat_finish_chunk(ctx: ResponseContext, final: Final, index: int = 0,
                      with_timings: bool = True) -> dict:
    """delta {} and the finish_reason; carries `timings` when it is the last JSON event."""
    out = _chat_chunk(ctx, [{"finish_reason": finish_reason(final.stop_type), "index": index,
                             "delta": {}}])
    if with_timings:
        out["timings"] = final.timings()
    return out


def chat_usage_chunk(ctx: ResponseContext, finals: Sequence[Final],
                     prompt_finals: Optional[Sequence[Final]] = None) -> dict:
    """stream_options.include_usage: choices [] with usage, and the timings (last JSON event)."""
    out = _chat_chunk(ctx, [])
    out["usage"] = usage_json(finals, prompt_finals)
    out["timings"] = finals[-1].timings()
    return out


def chat_stream_events(ctx: ResponseContext, items: Iterable, include_usage: bool = False,
                       logprobs: bool = False) -> Iterable[dict]:
    """The chunk sequence of a one-choice chat stream, from the scheduler's Chunk...Final
    sequence (a helper for tests and for app.py's single-choice path)."""
    yield chat_role_chunk(ctx)
    for item in items:
        if isinstance(item, Final):
            yield chat_finish_chunk(ctx, item, with_timings=not include_usage)
            if include_usage:
                yield chat_usage_chunk(ctx, [item])
        elif item.text or item.probs:
            yield chat_content_chunk(ctx, item, logprobs=logprobs)
