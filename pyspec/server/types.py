"""What the HTTP layer (app.py) and the engine thread (scheduler.py) hand each other.

A request is parsed into a GenerationRequest (params.py), submitted to the Scheduler, and its
results come back through a RequestHandle as zero or more Chunk objects followed by exactly one
Final (or a ServerError raised from the iteration). Everything here is plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


class ServerError(Exception):
    """An error with llama-server's error JSON: {"error": {"code", "message", "type", **extra}}."""

    def __init__(self, message: str, type: str = "invalid_request_error", code: int = 400,
                 **extra):
        super().__init__(message)
        self.message = message
        self.type = type
        self.code = code
        self.extra = extra

    def to_json(self) -> dict:
        err = {"code": self.code, "message": self.message, "type": self.type}
        err.update(self.extra)
        return {"error": err}


def context_exceeded(n_prompt: int, n_ctx: int) -> ServerError:
    """llama-server's answer to a prompt that does not fit the slot (reference §1.14)."""
    return ServerError(f"request ({n_prompt} tokens) exceeds the available context size "
                       f"({n_ctx} tokens), try increasing it",
                       type="exceed_context_size_error", code=400,
                       n_prompt_tokens=n_prompt, n_ctx=n_ctx)


@dataclass
class GenerationRequest:
    """One completion to run. Defaults are llama-server's CLI defaults; params.py fills them
    from the server's flags and the request body."""

    prompt_ids: List[int]
    n_predict: int = -1                  # -1: until EOS, a stop string or the slot's context
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = -1                       # -1: a random seed, drawn at submit (reported back)
    repeat_last_n: int = 64              # penalty window (-1: the slot's context, 0: off)
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Dict[int, float] = field(default_factory=dict)  # -inf bans a token
    ignore_eos: bool = False
    stop: List[str] = field(default_factory=list)
    n_probs: int = 0                     # > 0: top-n probabilities of each generated token
    id_slot: int = -1                    # -1: any idle slot
    cache_prompt: bool = True
    speculative: bool = True             # draft when the server has a drafter


@dataclass
class TokenProb:
    """One generated token with its log-probability and the top-n alternatives, from the
    softmax of the target's raw logits at that position (llama-server's default,
    post_sampling_probs false)."""

    id: int
    logprob: float
    top: List[Tuple[int, float]]        # (token id, logprob), most likely first, n_probs long


@dataclass
class Chunk:
    """Newly generated output. `text` is safe to show: a possible start of a stop string is
    held back until it is resolved, and incomplete UTF-8 is held back."""

    text: str
    tokens: List[int]
    probs: List[TokenProb] = field(default_factory=list)  # one per token when n_probs > 0


@dataclass
class Final:
    """The end of one request (llama-server's final result)."""

    content: str                  # the whole generated text (stop string excluded)
    tokens: List[int]             # the whole generated token ids
    stop_type: str                # "eos" | "limit" | "word"
    stopping_word: str            # the stop string matched ("" unless stop_type == "word")
    truncated: bool               # ran into the slot's context
    id_slot: int
    n_prompt: int                 # prompt tokens of the request
    n_cached: int                 # of which reused from the slot's cache (cache_n)
    n_predicted: int              # generated tokens
    prompt_ms: float
    predicted_ms: float
    draft_n: int = 0
    draft_n_accepted: int = 0
    seed: int = 0                 # the seed used (drawn when the request gave -1)
    probs: List[TokenProb] = field(default_factory=list)

    def timings(self) -> dict:
        """llama-server's `timings` object (reference §1.6, exact names and formulas)."""
        prompt_n = self.n_prompt - self.n_cached
        t = {
            "cache_n": self.n_cached,
            "prompt_n": prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / prompt_n if prompt_n > 0 else 0.0,
            "prompt_per_second": 1e3 / self.prompt_ms * prompt_n if self.prompt_ms > 0 else 0.0,
            "predicted_n": self.n_predicted,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": (self.predicted_ms / (self.n_predicted - 1)
                                       if self.n_predicted > 1 else 0.0),
            "predicted_per_second": (1e3 / self.predicted_ms * (self.n_predicted - 1)
                                     if self.predicted_ms > 0 and self.n_predicted > 1 else 0.0),
        }
        if self.draft_n > 0:
            t["draft_n"] = self.draft_n
            t["draft_n_accepted"] = self.draft_n_accepted
        return t
