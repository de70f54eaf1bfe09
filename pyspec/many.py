"""Several prompts at once through the C++ speculative step (`_core.SpecEngine`,
csrc/spec/spec_engine.h): one target decode per step over every running request, a drafter slot
per request (reclaimed least recently scheduled first when there are fewer slots than requests),
per-request verification and rollback. `LLM.generate_many` is the user-facing entry.

Sampling follows `LLM.generate`: temperature after llama.cpp's top-k -> top-p -> min-p filters
(pyspec/sampling.py; disabled filters do not run, so with all off it is softmax(logits / T)), and
verification keeps that processed law (invariant 6): the p rows are built in C++ by the same
function `Sampler.candidates` calls. At T = 0 the output equals plain greedy decoding, and whatever
the temperature a prompt's output does not depend on which other prompts share its steps
(invariant 7): prompt i is seeded seed + i, the seed `LLM.generate` would be given for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional, Sequence, Union

from . import _core
from .sampling import Sampler, SamplingParams
from .speculative import check_pruning_options, engine_backend

if TYPE_CHECKING:
    from .llm import LLM


@dataclass
class ManyResult:
    """One prompt's output and drafting stats."""

    text: str
    tokens: List[int]
    stop_reason: str             # eog | length | context
    n_prompt: int
    seed: int
    n_rounds: int = 0            # verify passes (each emits accepted + 1 tokens)
    draft_n: int = 0             # tokens drafted
    draft_n_accepted: int = 0    # drafted tokens kept
    drafted_at: List[int] = field(default_factory=list)   # rounds that drafted position i
    accepted_at: List[int] = field(default_factory=list)  # rounds that accepted position i
    n_restaged: int = 0          # times its drafter context was restored after a slot reclaim
    ngram_rounds: int = 0        # rounds that verified ngram-simple's lookups (ngram_n > 0)
    ngram_draft_n_accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.draft_n_accepted / self.draft_n if self.draft_n else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.draft_n_accepted / self.n_rounds if self.n_rounds else 0.0


def generate_many(llm: "LLM", prompts: Sequence[Union[str, Sequence[int]]],
                  max_tokens: Optional[int] = 128, temperature: float = 0.0,
                  top_k: int = SamplingParams.top_k, top_p: float = SamplingParams.top_p,
                  min_p: float = SamplingParams.min_p, seed: Optional[int] = None,
                  ignore_eos: bool = False,
                  n_parallel: Optional[int] = None, draft_slots: Optional[int] = None,
                  draft_n_batch: int = 2048, draft_p_min: Optional[float] = None,
                  draft_n_min: Optional[int] = None,
                  draft_p_min_mode: Optional[str] = None, ngram_n: int = 0,
                  ngram_m: int = 48) -> List[ManyResult]:
    spec = llm.speculative
    if spec is None:
        raise ValueError("generate_many needs a draft_model (LLM(..., draft_model=...))")
    prompts = list(prompts)
    if not prompts:
        return []
    temperature = float(temperature)
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if max_tokens is None or int(max_tokens) == -1:
        max_tokens = None
    elif int(max_tokens) < -1:
        raise ValueError(f"max_tokens must be >= 0, or -1/None for no limit, got {max_tokens}")
    else:
        max_tokens = int(max_tokens)
    n_parallel = len(prompts) if n_parallel is None else int(n_parallel)
    if n_parallel < 1:
        raise ValueError(f"n_parallel must be at least 1, got {n_parallel}")
    n_parallel = min(n_parallel, len(prompts))
    draft_slots = n_parallel if draft_slots is None else int(draft_slots)
    if draft_slots < 1:
        raise ValueError(f"draft_slots must be at least 1, got {draft_slots}")
    if int(draft_n_batch) < 1:
        raise ValueError(f"draft_n_batch must be at least 1, got {draft_n_batch}")
    # Confidence pruning: the LLM's settings unless given; the same rule as the Python loop
    # (csrc/spec/prune.h), checked again by the engine.
    draft_p_min_mode = spec.draft_p_min_mode if draft_p_min_mode is None else draft_p_min_mode
    draft_p_min, draft_n_min = check_pruning_options(
        spec.draft_p_min if draft_p_min is None else draft_p_min,
        spec.draft_n_min if draft_n_min is None else draft_n_min, draft_p_min_mode)
    # Validated as LLM.generate validates them.
    params = SamplingParams(temperature, top_k, top_p, min_p, seed)
    method = spec.method(params)
    base_seed = Sampler(params).seed

    ids_of = []
    for p in prompts:
        ids = llm.prompt_ids(p)
        if not ids:
            raise ValueError("a prompt is empty (no tokens): give some text")
        if len(ids) >= llm.n_ctx:
            raise ValueError(f"a prompt has {len(ids)} tokens but the context holds {llm.n_ctx} "
                             "(prompt and output together): shorten the prompt or raise n_ctx")
        ids_of.append(ids)

    results: List[Optional[ManyResult]] = [None] * len(prompts)
    tokens: List[List[int]] = [[] for _ in prompts]
    seeds = [(base_seed + i) % (1 << 64) for i in range(len(prompts))]
    stop_ids = [] if ignore_eos else sorted(int(t) for t in llm.tokenizer.eog_ids)
    engine = _core.SpecEngine(llm.model._model, spec.drafter.model, n_ctx=llm.n_ctx * n_parallel,
                              n_seq_max=n_parallel, n_draft_slots=draft_slots,
                              n_batch=llm.context.n_batch, draft_n_batch=int(draft_n_batch),
                              n_threads=llm.model.n_threads, draft_n_max=spec.draft_n_max,
                              backend=engine_backend(llm.model.backend, spec.drafter.backend),
                              ngram_n=int(ngram_n), ngram_m=int(ngram_m))

    def finish(i: int, reason: str, stats: Optional[dict]) -> None:
        st = stats or {}
        results[i] = ManyResult(
            text=llm.detokenize(tokens[i], skip_special=True, continuation=True),
            tokens=tokens[i], stop_reason=reason, n_prompt=len(ids_of[i]), seed=seeds[i],
            n_rounds=int(st.get("n_rounds", 0)), draft_n=int(st.get("draft_n", 0)),
            draft_n_accepted=int(st.get("draft_n_accepted", 0)),
            drafted_at=list(st.get("drafted_at", [])), accepted_at=list(st.get("accepted_at", [])),
            n_restaged=int(st.get("n_restaged", 0)), ngram_rounds=int(st.get("ngram_rounds", 0)),
            ngram_draft_n_accepted=int(st.get("ngram_draft_n_accepted", 0)))

    pending = list(range(len(prompts)))
    while pending or engine.n_requests:
        while pending and engine.n_requests < n_parallel:
            i = pending.pop(0)
            # As LLM.generate: at most the room the context leaves after the prompt.
            limit = llm.n_ctx - len(ids_of[i])
            if max_tokens is not None:
                limit = min(limit, max_tokens)
            if limit == 0:
                finish(i, "length" if max_tokens == 0 else "context", None)
                continue
            engine.add_request(i, ids_of[i], max_tokens=limit, temperature=temperature,
                               top_k=int(top_k), top_p=float(top_p), min_p=float(min_p),
                               seed=seeds[i], verify=method, stop_ids=stop_ids,
                               draft_p_min=draft_p_min, draft_n_min=draft_n_min,
                               draft_p_min_mode=draft_p_min_mode)
        if not engine.n_requests:
            break
        for out in engine.step():
            i = int(out["request_id"])
            tokens[i].extend(int(t) for t in out["tokens"])
            if out["finished"]:
                reason = out["stop_reason"]
                if reason == "stop":
                    reason = "eog"
                elif reason == "length" and (max_tokens is None or len(tokens[i]) < max_tokens):
                    reason = "context"
                finish(i, reason, out["stats"])
    return [r for r in results if r is not None]
