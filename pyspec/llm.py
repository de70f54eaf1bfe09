"""`pyspec.LLM`: text in, text out. Loads a GGUF model with its tokenizer and chat template and
generates with llama.cpp's sampling chain.

Each call starts from an empty cache (prefix reuse across calls may come later), so calls are
independent; one LLM runs one generation at a time.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Union

import numpy as np

from . import _core
from .chat import ChatTemplate
from .many import ManyResult, generate_many
from .model import Context, Model
from .sampling import Sampler, SamplingParams
from .stops import StopMatcher, stop_list
from .speculative import Drafter, SpeculativeGenerator, SpecStats
from .tokenizer import Tokenizer

_D = SamplingParams()
# The most best ids a sampled step asks the graph for (the engine's limit,
# csrc/spec/target_law.h); a larger top_k, or none, reads the whole row of logits.
_BEST_IDS_MAX = _core.spec.MAX_SAMPLED_CANDIDATES


@dataclass
class GenerationStats:
    """Counts and timings of the latest generation, for llama.cpp-style perf lines."""

    n_prompt: int = 0
    prompt_seconds: float = 0.0
    n_generated: int = 0        # tokens returned (an end-of-generation token is not counted)
    n_decoded: int = 0          # single-token decode calls after the prompt (speculating: rounds)
    n_decode_tokens: int = 0    # tokens those calls produced (plain decoding: one per call)
    decode_seconds: float = 0.0
    sample_seconds: float = 0.0
    seed: int = 0
    stop_reason: str = ""       # eog | stop | length | context | interrupted | closed
    spec: Optional[SpecStats] = None  # drafting and acceptance, when speculating

    @property
    def draft_n(self) -> int:
        return self.spec.draft_n if self.spec else 0

    @property
    def draft_n_accepted(self) -> int:
        return self.spec.draft_n_accepted if self.spec else 0

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.n_prompt / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.n_decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


class LLM:
    """A model ready to generate text.

    model: a GGUF path or a loaded `pyspec.Model`; None loads the embedded default.
    n_ctx: context size in tokens (prompt plus generated); 0 uses the model's training context.
    chat_template: None uses the model's template (ChatML if it has none); otherwise a built-in
        name ("chatml"), Jinja source, or a `ChatTemplate`.
    draft_model: a DFlash/DSpark drafter GGUF made for this target; generate and chat then
        speculate (pyspec.speculative), with the drafting stats in `last_stats.spec`.
    spec_type: "draft-dflash" or "draft-dspark" (None: from the drafter file; a mismatch is an
        error). draft_n_max: drafts per round (None: the drafter's block allows, i.e. block_size
        or block_size - 1). verify: "greedy" (T = 0 only), "rejection" or "block"; None is greedy
        at T = 0 and rejection at T > 0. All are lossless.
    draft_p_min, draft_p_min_mode, draft_n_min: confidence pruning (pyspec.speculative): stop
        the draft at the first position whose confidence (DSpark's confidence head; DFlash: the
        top-1 probability of its slot) is below draft_p_min ("first"), or whose running product
        of confidences is ("cumulative"); drop drafts shorter than draft_n_min. 0 disables.
    n_gpu_layers (llama.cpp's -ngl): 0 / None (default) runs on the CPU; "all" or N >= the
        model's layers on the GPU (CUDA; RuntimeError with the reason when it cannot be used);
        "auto" (or -1) on the GPU when available, else the CPU. Partial offload is not supported
        yet (ValueError). With a loaded `Model`, its own n_gpu_layers applies.
    n_gpu_layers_draft (-ngld): the same for the drafter; None follows the target.
    """

    def __init__(self, model: Union[str, os.PathLike, Model, None] = None, n_ctx: int = 4096,
                 n_threads: Optional[int] = None, n_batch: int = 512,
                 chat_template: Union[str, ChatTemplate, None] = None,
                 draft_model: Union[str, os.PathLike, None] = None,
                 spec_type: Optional[str] = None, draft_n_max: Optional[int] = None,
                 verify: Optional[str] = None, draft_p_min: float = 0.0,
                 draft_n_min: int = 0, draft_p_min_mode: str = "first",
                 n_gpu_layers: Union[int, str, None] = None,
                 n_gpu_layers_draft: Union[int, str, None] = None):
        if isinstance(model, Model):
            if n_gpu_layers is not None:
                raise ValueError("n_gpu_layers goes to Model(...) when a loaded Model is given "
                                 f"(this one runs on {model.backend})")
            self.model = model
        else:
            self.model = Model(None if model is None else os.fspath(model), n_threads=n_threads,
                               n_gpu_layers=n_gpu_layers)
        n_ctx = int(n_ctx)
        if n_ctx < 0:
            raise ValueError(f"n_ctx must be >= 0 (0 = the model's {self.model.n_ctx_train}), "
                             f"got {n_ctx}")
        if n_ctx == 0:
            n_ctx = self.model.n_ctx_train
        if int(n_batch) < 1:
            raise ValueError(f"n_batch must be at least 1, got {n_batch}")
        self.tokenizer = Tokenizer.from_gguf(self.model.path)
        self.context = Context(self.model, n_ctx=n_ctx, n_seq_max=1, n_batch=int(n_batch))
        self.n_ctx = self.context.n_ctx
        self.speculative: Optional[SpeculativeGenerator] = None
        if draft_model is not None:
            drafter = Drafter(os.fspath(draft_model), self.model, spec_type=spec_type,
                              n_gpu_layers=n_gpu_layers_draft)
            self.speculative = SpeculativeGenerator(self.context, drafter,
                                                    draft_n_max=draft_n_max, verify=verify,
                                                    draft_p_min=draft_p_min,
                                                    draft_n_min=draft_n_min,
                                                    draft_p_min_mode=draft_p_min_mode)
        elif (spec_type is not None or draft_n_max is not None or verify is not None
              or draft_p_min or draft_n_min or draft_p_min_mode != "first"
              or n_gpu_layers_draft is not None):
            raise ValueError("spec_type, draft_n_max, verify, draft_p_min, draft_n_min, "
                             "draft_p_min_mode and n_gpu_layers_draft need a draft_model")
        self.last_stats: Optional[GenerationStats] = None
        self._running = False
        # A user's template is compiled now so that mistakes show at once; the model's own only
        # when chat is used, so a broken template in a file does not stop plain generation.
        if isinstance(chat_template, ChatTemplate):
            self._chat_template: Optional[ChatTemplate] = chat_template
        elif chat_template is not None:
            self._chat_template = ChatTemplate.from_tokenizer(self.tokenizer,
                                                              override=chat_template)
        else:
            self._chat_template = None

    @property
    def chat_template(self) -> ChatTemplate:
        if self._chat_template is None:
            self._chat_template = ChatTemplate.from_tokenizer(self.tokenizer)
        return self._chat_template

    @chat_template.setter
    def chat_template(self, template: ChatTemplate) -> None:
        if not isinstance(template, ChatTemplate):
            raise TypeError("chat_template must be a ChatTemplate "
                            "(see ChatTemplate.from_tokenizer)")
        self._chat_template = template

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> List[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int], skip_special: bool = False,
                   continuation: bool = False) -> str:
        """Text of `ids`; `continuation=True` joins the pieces as they are, as generated text
        is returned (see Tokenizer.decode)."""
        return self.tokenizer.decode(list(ids), skip_special=skip_special,
                                     continuation=continuation)

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True,
                            tools: Optional[list] = None, tokenize: bool = False, **template_vars):
        """The prompt text for a conversation, or its token ids with `tokenize=True`.

        Ids are tokenized with special tokens parsed; a BOS is added when the vocabulary wants
        one and the template did not already write it.
        """
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **template_vars)
        if not tokenize:
            return text
        ids = self.tokenizer.encode(text, add_special=False, parse_special=True)
        bos = self.tokenizer.bos_id
        if self.tokenizer.add_bos and bos is not None and bos >= 0 and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def generate(self, prompt: Union[str, Sequence[int]], max_tokens: Optional[int] = 128,
                 temperature: float = _D.temperature, top_k: int = _D.top_k,
                 top_p: float = _D.top_p, min_p: float = _D.min_p, seed: Optional[int] = None,
                 stop: Union[str, Sequence[str], None] = None, stream: bool = False,
                 ignore_eos: bool = False) -> Union[str, Iterator[str]]:
        """Continues `prompt` (text, tokenized with BOS per the model and special tokens parsed,
        as llama.cpp does; or a list of token ids).

        Stops at an end-of-generation token (unless `ignore_eos`), at the first `stop` string
        (which is not returned), after `max_tokens` tokens (None or -1: no limit), or when the
        context is full. Returns the text, or with `stream=True` an iterator of text pieces as
        they decode (never splitting a UTF-8 character).
        """
        params = SamplingParams(temperature, top_k, top_p, min_p, seed)
        return self._run(self.prompt_ids(prompt), params, max_tokens, stop, stream, ignore_eos)

    def prompt_ids(self, prompt: Union[str, Sequence[int]]) -> List[int]:
        """A prompt as token ids: text is tokenized as llama.cpp does (BOS per the model,
        special tokens parsed); ids are checked against the vocabulary."""
        if isinstance(prompt, str):
            return self.tokenize(prompt, add_special=True, parse_special=True)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.tokenizer.n_vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.tokenizer.n_vocab})")
        return ids

    def generate_many(self, prompts: Sequence[Union[str, Sequence[int]]],
                      max_tokens: Optional[int] = 128, temperature: float = 0.0,
                      top_k: int = _D.top_k, top_p: float = _D.top_p, min_p: float = _D.min_p,
                      seed: Optional[int] = None, ignore_eos: bool = False,
                      n_parallel: Optional[int] = None, draft_slots: Optional[int] = None,
                      draft_n_batch: int = 2048, draft_p_min: Optional[float] = None,
                      draft_n_min: Optional[int] = None,
                      draft_p_min_mode: Optional[str] = None, ngram_n: int = 0,
                      ngram_m: int = 48) -> List["ManyResult"]:
        """Continues several prompts concurrently with the drafter (needs `draft_model`): one
        C++ step per round over up to `n_parallel` prompts (default: all), each holding a drafter
        slot of `draft_slots` (default: n_parallel; fewer makes prompts share slots, reclaimed
        least recently scheduled first); `draft_n_batch` is the drafter's batch size, which caps
        its window. draft_p_min / draft_n_min / draft_p_min_mode: confidence pruning per request,
        the rule of the single-request loop (default: this LLM's settings). ngram_n > 0: llama-server's
        ngram-simple ahead of the drafter (up to ngram_m tokens that followed the latest earlier
        occurrence of a prompt's last ngram_n tokens; the engine's csrc/spec/ngram.h). Sampling as `generate`
        (temperature after top_k / top_p / min_p, same defaults; verification keeps that law);
        prompt i is seeded seed + i. Returns per prompt
        a `pyspec.many.ManyResult` (text, tokens, stop_reason, draft_n, draft_n_accepted, ...),
        in prompt order; the output of each prompt does not depend on the others."""
        return generate_many(self, prompts, max_tokens=max_tokens, temperature=temperature,
                             top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, ignore_eos=ignore_eos, n_parallel=n_parallel,
                             draft_slots=draft_slots, draft_n_batch=draft_n_batch,
                             draft_p_min=draft_p_min, draft_n_min=draft_n_min,
                             draft_p_min_mode=draft_p_min_mode, ngram_n=ngram_n, ngram_m=ngram_m)

    def chat(self, messages: Any, max_tokens: Optional[int] = 128,
             temperature: float = _D.temperature, top_k: int = _D.top_k, top_p: float = _D.top_p,
             min_p: float = _D.min_p, seed: Optional[int] = None,
             stop: Union[str, Sequence[str], None] = None, stream: bool = False,
             tools: Optional[list] = None, **template_vars) -> Union[str, Iterator[str]]:
        """The assistant's reply to `messages` ([{"role": ..., "content": ...}, ...]), rendered
        with the chat template and a generation prompt; arguments as for `generate`."""
        params = SamplingParams(temperature, top_k, top_p, min_p, seed)
        ids = self.apply_chat_template(messages, add_generation_prompt=True, tools=tools,
                                       tokenize=True, **template_vars)
        return self._run(ids, params, max_tokens, stop, stream, False)

    def _run(self, ids: List[int], params: SamplingParams, max_tokens: Optional[int],
             stop, stream: bool, ignore_eos: bool) -> Union[str, Iterator[str]]:
        if not ids:
            raise ValueError("the prompt is empty (no tokens): give some text")
        if len(ids) >= self.n_ctx:
            raise ValueError(f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx} "
                             "(prompt and output together): shorten the prompt or raise n_ctx")
        if max_tokens is not None:
            max_tokens = int(max_tokens)
            if max_tokens < -1:
                raise ValueError("max_tokens must be >= 0, or -1/None for no limit, "
                                 f"got {max_tokens}")
            if max_tokens == -1:
                max_tokens = None
        stops = stop_list(stop)
        pieces = self._text_pieces(ids, params, max_tokens, stops, ignore_eos)
        if stream:
            return pieces
        return "".join(pieces)

    def _text_pieces(self, ids, params, max_tokens, stops, ignore_eos) -> Iterator[str]:
        # Generated text as llama.cpp shows it: each token's piece appended as is (no clean-up of
        # spaces against the prompt), control tokens hidden.
        decoder = self.tokenizer.stream_decoder(skip_special=True, continuation=True)
        matcher = StopMatcher(stops)
        with contextlib.closing(self._tokens(ids, params, max_tokens, ignore_eos)) as tokens:
            for tok in tokens:
                text, hit = matcher.feed(decoder.push(tok))
                if text:
                    yield text
                if hit:
                    self.last_stats.stop_reason = "stop"
                    return
        text, hit = matcher.feed(decoder.flush())
        if hit:
            self.last_stats.stop_reason = "stop"
        else:
            text += matcher.finish()
        if text:
            yield text

    def _tokens(self, ids: List[int], params: SamplingParams, max_tokens: Optional[int],
                ignore_eos: bool) -> Iterator[int]:
        if self._running:
            raise RuntimeError("this LLM is already generating: finish or close the other "
                               "stream first")
        self._running = True
        sampler = Sampler(params)
        stats = GenerationStats(n_prompt=len(ids), seed=sampler.seed)
        self.last_stats = stats
        ctx = self.context
        try:
            if max_tokens == 0:
                stats.stop_reason = "length"
                return
            if self.speculative is not None:
                yield from self._spec_tokens(ids, params, sampler.seed, max_tokens, ignore_eos,
                                             stats)
                return
            # Greedy: each step's token is the argmax taken in the graph (Context.decode's
            # argmax; the first maximum, as Sampler's), so no row of logits crosses from the
            # backend and none is widened on the host. Sampled with top-k (llama.cpp's chain
            # starts with top-k 40): only the row's best top_k ids and logits cross, which give
            # the same law and the same draw (Sampler.sample_best).
            greedy = sampler.params.greedy
            top_k = sampler.params.top_k
            best = 0 if greedy or not 1 <= top_k <= min(_BEST_IDS_MAX, self.model.n_vocab) else top_k

            def step(r):
                if greedy:
                    return int(r.tokens[-1])
                return (r.candidates[-1], r.candidate_logits[-1]) if best else r.logits[-1]

            def draw(out):
                if greedy:
                    return out
                return sampler.sample_best(*out) if best else sampler.sample(out)
            ctx.kv_clear()
            t = time.perf_counter()
            out = step(ctx.decode(np.asarray(ids, dtype=np.int32), prompt=True, argmax=greedy, candidates=best))
            stats.prompt_seconds = time.perf_counter() - t
            while True:
                t = time.perf_counter()
                tok = draw(out)
                stats.sample_seconds += time.perf_counter() - t
                if not ignore_eos and self.tokenizer.is_eog(tok):
                    stats.stop_reason = "eog"
                    return
                stats.n_generated += 1
                yield tok
                if max_tokens is not None and stats.n_generated >= max_tokens:
                    stats.stop_reason = "length"
                    return
                if len(ids) + stats.n_generated >= self.n_ctx:
                    stats.stop_reason = "context"
                    return
                t = time.perf_counter()
                out = step(ctx.decode([tok], argmax=greedy, candidates=best))
                stats.decode_seconds += time.perf_counter() - t
                stats.n_decoded += 1
                stats.n_decode_tokens += 1
        except KeyboardInterrupt:
            stats.stop_reason = "interrupted"
            raise
        except GeneratorExit:
            if not stats.stop_reason:
                stats.stop_reason = "closed"
            raise
        finally:
            self._running = False

    def _spec_tokens(self, ids, params, seed, max_tokens, ignore_eos, stats):
        spec = stats.spec = SpecStats()
        limit = self.n_ctx - len(ids)
        if max_tokens is not None:
            limit = min(limit, max_tokens)
        is_eog = (lambda t: False) if ignore_eos else self.tokenizer.is_eog
        try:
            for tok in self.speculative.tokens(ids, params, limit, spec, is_eog, seed):
                stats.n_generated += 1
                yield tok
        finally:
            # Drafting and verification only: not the time the caller held the tokens.
            stats.prompt_seconds = spec.prompt_seconds
            stats.decode_seconds = spec.draft_seconds + spec.verify_seconds
            # The first token comes from the prompt's own pass (its round is prompt time), every
            # later one out of a draft / verify round.
            stats.n_decoded = max(0, spec.n_rounds - 1)
            stats.n_decode_tokens = max(0, stats.n_generated - 1)
        if not stats.stop_reason:
            if max_tokens is not None and stats.n_generated >= max_tokens:
                stats.stop_reason = "length"
            elif stats.n_generated >= self.n_ctx - len(ids):
                stats.stop_reason = "context"
            else:
                stats.stop_reason = "eog"

    def __repr__(self) -> str:
        return f"LLM({self.model.path!r}, n_ctx={self.n_ctx}, backend={self.model.backend})"
