"""Request bodies -> GenerationRequest, with llama-server's field names, aliases, limits and
defaults (reference §1.3 table, llama.cpp's `server-schema.cpp` and `oaicompat_chat_params_parse`).

Rules copied from llama.cpp:
- JSON `null` means "use the default" for every field.
- soft limits clamp (top_k >= 0, top_p/min_p in [0, 1], temperature >= 0);
- hard limits answer 400 "Field '<name as sent>': Value must be between <lo> <= value <= <hi>,
  but got <v>" (n_predict -1..INT32_MAX, n/n_cmpl 1..n_parallel);
- `n_predict` wins over its aliases `max_tokens` / `max_completion_tokens`;
- a wrong JSON type is a 400 invalid_request_error (llama's json type_error is caught before the
  task is submitted and answered as 400).
Features we do not run yet (grammar, JSON schema, tools) answer 400 "... not supported yet" so a
client never silently gets unconstrained output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..chat import ChatTemplate, ChatTemplateError, InvalidMessagesError
from .types import GenerationRequest, ServerError

INT32_MAX = 2147483647


@dataclass
class RequestDefaults:
    """The server's defaults for request fields (from the CLI: -n, --temp, --top-k, ...)."""

    n_predict: int = -1
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = -1
    repeat_last_n: int = 64
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    cache_prompt: bool = True
    stop: List[str] = field(default_factory=list)  # llama's -r reverse prompts
    n_probs: int = 0


@dataclass
class CompletionParams:
    """A parsed completion-type request: one GenerationRequest per (prompt, choice) pair plus
    the request-level options that only shape the HTTP answer."""

    prompts: List[List[int]]          # token ids of each prompt (a list: /completion takes many)
    base: GenerationRequest           # sampling/output settings shared by every prompt
    n_cmpl: int = 1                   # choices per prompt (`n` / `n_cmpl`)
    stream: bool = False
    include_usage: bool = False       # stream_options.include_usage (OAI chat)
    return_tokens: bool = False
    timings_per_token: bool = False
    speculative_types: List[str] = field(default_factory=list)

    def tasks(self) -> List[GenerationRequest]:
        """The requests to submit, prompt-major: result index = i_prompt * n_cmpl + j."""
        out = []
        for ids in self.prompts:
            for _ in range(self.n_cmpl):
                out.append(replace(self.base, prompt_ids=list(ids),
                                   logit_bias=dict(self.base.logit_bias),
                                   stop=list(self.base.stop)))
        return out


# -- typed field access ------------------------------------------------------------------------

def _bad(msg: str) -> ServerError:
    return ServerError(msg, "invalid_request_error", 400)


def _lookup(body: dict, names: Sequence[str]) -> Tuple[Optional[str], Any]:
    """The first of `names` present with a non-null value (null means default, as in llama)."""
    for name in names:
        if name in body and body[name] is not None:
            return name, body[name]
    return None, None


def _get_int(body: dict, names: Sequence[str], default: int) -> Tuple[str, int]:
    name, v = _lookup(body, names)
    if name is None:
        return names[0], default
    # nlohmann's get<int> truncates a float and turns a bool into 0/1; a string is a type error.
    if not isinstance(v, (int, float)):
        raise _bad(f"Field '{name}': expected an integer, got {type(v).__name__}")
    if isinstance(v, float):
        if not math.isfinite(v):
            raise _bad(f"Field '{name}': expected an integer, got {v}")
        v = int(v)
    return name, int(v)


def _get_float(body: dict, names: Sequence[str], default: float) -> float:
    name, v = _lookup(body, names)
    if name is None:
        return default
    if not isinstance(v, (int, float)):  # bools convert, as nlohmann's get<float> does
        raise _bad(f"Field '{name}': expected a number, got {type(v).__name__}")
    return float(v)


def _get_bool(body: dict, names: Sequence[str], default: bool) -> bool:
    name, v = _lookup(body, names)
    if name is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"Field '{name}': expected a boolean, got {type(v).__name__}")
    return v


def _hard_limit(name: str, v: int, lo: int, hi: int) -> int:
    if not lo <= v <= hi:
        raise _bad(f"Field '{name}': Value must be between {lo} <= value <= {hi}, but got {v}")
    return v


def _clamp(v: float, lo: float, hi: float) -> float:
    return min(max(v, lo), hi)


# -- prompts -----------------------------------------------------------------------------------

def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_mixed(p: Any) -> bool:
    # llama's json_is_array_of_mixed_numbers_strings: at least one string and one number.
    return (isinstance(p, list) and any(isinstance(e, str) for e in p)
            and any(_is_int(e) for e in p))


def _is_ids(p: Any) -> bool:
    return isinstance(p, list) and all(_is_int(e) for e in p)


def tokenize_mixed(tokenizer, p: Any, add_special: bool, parse_special: bool) -> List[int]:
    """A string or a mixed list of strings and ids -> ids. Only a leading string gets BOS
    (llama's tokenize_mixed: later strings are tokenized without special tokens)."""
    if isinstance(p, str):
        p = [p]
    out: List[int] = []
    for k, e in enumerate(p):
        if isinstance(e, str):
            out.extend(tokenizer.encode(e, add_special=add_special and k == 0,
                                        parse_special=parse_special))
        elif _is_int(e):
            out.append(e)
        else:
            raise _bad("a prompt list may only hold strings and token ids")
    return out


def _check_ids(tokenizer, ids: List[int]) -> List[int]:
    n_vocab = tokenizer.n_vocab
    for t in ids:
        if not 0 <= t < n_vocab:
            raise _bad(f"invalid token id {t} in the prompt (the vocabulary has {n_vocab} tokens)")
    if not ids:
        raise _bad("the prompt is empty")
    return ids


def parse_prompts(tokenizer, prompt: Any) -> List[List[int]]:
    """`prompt` as llama-server reads it: a string, a list of ids, a mixed list, or a list of
    those (several prompts). Text is tokenized with BOS per the model and special tokens parsed."""
    if isinstance(prompt, str) or _is_mixed(prompt):
        prompts = [tokenize_mixed(tokenizer, prompt, True, True)]
    elif _is_ids(prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list):
        prompts = []
        for p in prompt:
            if isinstance(p, str) or _is_mixed(p):
                prompts.append(tokenize_mixed(tokenizer, p, True, True))
            elif _is_ids(p):
                prompts.append(list(p))
            else:
                raise _bad('element of "prompt" must be a string, an list of tokens, or a list '
                           'of mixed strings & tokens')
    else:
        raise _bad('"prompt" must be a string, an list of tokens, a list of mixed strings & '
                   'tokens, or a list of prompts')
    return [_check_ids(tokenizer, ids) for ids in prompts]


# -- logit bias, stop, unsupported features -----------------------------------------------------

def _bias_value(v: Any) -> Optional[float]:
    if isinstance(v, bool):
        return -math.inf if v is False else None  # `true` is ignored, as in llama
    if isinstance(v, (int, float)):
        return float(v)
    return None


def parse_logit_bias(tokenizer, value: Any) -> Dict[int, float]:
    """llama's two formats: [[id_or_string, bias_or_false], ...] and OAI {"id_or_string": bias}.
    A string is tokenized (no special tokens) and every one of its tokens gets the bias; ids
    outside the vocabulary and malformed entries are skipped, as llama does."""
    n_vocab = tokenizer.n_vocab
    out: Dict[int, float] = {}

    def add(key: Any, bias: Optional[float]) -> None:
        if bias is None:
            return
        if _is_int(key):
            if 0 <= key < n_vocab:
                out[key] = bias
        elif isinstance(key, str):
            for t in tokenizer.encode(key, add_special=False, parse_special=False):
                out[t] = bias

    if value is None:
        return out
    if isinstance(value, list):
        for el in value:
            if isinstance(el, list) and len(el) == 2:
                add(el[0], _bias_value(el[1]))
    elif isinstance(value, dict):
        for key, v in value.items():
            try:
                key = int(key, 10)  # OAI gives ids as strings ("15043")
            except ValueError:
                pass
            add(key, _bias_value(v))
    else:
        raise _bad("Field 'logit_bias': expected an array or an object")
    return out


def parse_stop(value: Any, default: List[str]) -> List[str]:
    if value is None:
        return list(default)
    if isinstance(value, str):
        return [value] if value else list(default)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        stops = [s for s in value if s]
        return stops if stops else list(default)
    raise _bad("Field 'stop': expected a string or an array of strings")


def not_supported(what: str) -> ServerError:
    return ServerError(f"{what} is not supported yet", "invalid_request_error", 400)


def check_unsupported(body: dict) -> None:
    """Constrained output is a later issue: refuse it loudly rather than ignore it."""
    if body.get("json_schema") is not None:
        raise not_supported("json_schema")
    grammar = body.get("grammar")
    if grammar is not None and grammar != "":
        raise not_supported("grammar")
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise _bad("response_format must be an object")
        t = rf.get("type", "text")
        if t == "text":
            pass
        elif t in ("json_object", "json_schema"):
            raise not_supported(f"response_format type {t!r}")
        else:
            raise _bad('response_format type must be one of "text" or "json_object", '
                       f"but got: {t}")


# -- the schema ----------------------------------------------------------------------------------

def parse_completion(body: Any, tokenizer, defaults: RequestDefaults, n_slots: int,
                     prompts: Optional[List[List[int]]] = None,
                     speculative: bool = False) -> CompletionParams:
    """A /completion, /v1/completions (or, with `prompts` given, chat) body -> CompletionParams.
    Raises ServerError (400) on bad input."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    check_unsupported(body)
    if prompts is None:
        if "prompt" not in body:
            raise _bad("key 'prompt' not found")
        prompts = parse_prompts(tokenizer, body["prompt"])

    name, n_predict = _get_int(body, ("n_predict", "max_tokens", "max_completion_tokens"),
                               defaults.n_predict)
    _hard_limit(name, n_predict, -1, INT32_MAX)
    name, n_cmpl = _get_int(body, ("n_cmpl", "n"), 1)
    _hard_limit(name, n_cmpl, 1, max(1, n_slots))
    name, repeat_last_n = _get_int(body, ("repeat_last_n",), defaults.repeat_last_n)
    _hard_limit(name, repeat_last_n, -1, INT32_MAX)
    _, top_k = _get_int(body, ("top_k",), defaults.top_k)
    _, seed = _get_int(body, ("seed",), defaults.seed)
    _, id_slot = _get_int(body, ("id_slot",), -1)
    # `logprobs` is n_probs' alias for /completion and /v1/completions (an int there); chat turns
    # its boolean `logprobs` into n_probs before calling us.
    _, n_probs = _get_int(body, ("n_probs", "logprobs"), defaults.n_probs)

    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise _bad("Field 'stream_options': expected an object")
        include_usage = _get_bool(stream_options, ("include_usage",), False)

    ignore_eos = _get_bool(body, ("ignore_eos",), False)
    base = GenerationRequest(
        prompt_ids=[],
        n_predict=n_predict,
        temperature=max(0.0, _get_float(body, ("temperature",), defaults.temperature)),
        top_k=max(0, top_k),
        top_p=_clamp(_get_float(body, ("top_p",), defaults.top_p), 0.0, 1.0),
        min_p=_clamp(_get_float(body, ("min_p",), defaults.min_p), 0.0, 1.0),
        seed=seed,
        repeat_last_n=repeat_last_n,
        repeat_penalty=_get_float(body, ("repeat_penalty",), defaults.repeat_penalty),
        presence_penalty=_get_float(body, ("presence_penalty",), defaults.presence_penalty),
        frequency_penalty=_get_float(body, ("frequency_penalty",), defaults.frequency_penalty),
        logit_bias=parse_logit_bias(tokenizer, body.get("logit_bias")),
        ignore_eos=ignore_eos,
        stop=parse_stop(body.get("stop"), defaults.stop),
        # no limit check, as llama: <= 0 disables, more than the vocabulary is capped
        n_probs=min(max(0, n_probs), tokenizer.n_vocab),
        id_slot=id_slot,
        cache_prompt=_get_bool(body, ("cache_prompt",), defaults.cache_prompt),
    )
    return CompletionParams(
        prompts=prompts, base=base, n_cmpl=n_cmpl,
        stream=_get_bool(body, ("stream",), False),
        include_usage=include_usage,
        return_tokens=_get_bool(body, ("return_tokens",), False),
        timings_per_token=_get_bool(body, ("timings_per_token",), False),
        speculative_types=["draft"] if speculative else [],
    )


# -- chat ------------------------------------------------------------------------------------------

def render_chat(body: Any, template: ChatTemplate, jinja: bool = False) -> str:
    """The prompt text of a chat body (also /apply-template), as oaicompat_chat_params_parse:
    a trailing assistant message is prefilled: rendered without it, with the generation prompt,
    and its content appended so the model continues it."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    if "messages" not in body or body["messages"] is None:
        raise _bad("'messages' is required")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise _bad("Expected 'messages' to be an array")
    tools = body.get("tools")
    if tools:
        if not jinja:
            # llama throws std::runtime_error here, which its wrapper answers with 500
            raise ServerError("tools param requires --jinja flag", "server_error", 500)
        raise not_supported("tools")
    add_generation_prompt = _get_bool(body, ("add_generation_prompt",), True)
    continue_final = _get_bool(body, ("continue_final_message",), False)
    if continue_final and "add_generation_prompt" in body and add_generation_prompt:
        raise _bad("Cannot set both add_generation_prompt and continue_final_message")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _bad("Field 'chat_template_kwargs': expected an object")
    kwargs = {k: v for k, v in kwargs.items()
              if k not in ("messages", "add_generation_prompt", "tools")}

    prefill = None
    if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        prefill = messages[-1]
        messages = messages[:-1]
        if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
            raise _bad("Cannot have 2 or more assistant messages at the end of the list.")
        add_generation_prompt = True
    try:
        if prefill is not None and not messages:
            text = ""  # only an assistant message: the prompt is its content
        else:
            text = template.render(messages, add_generation_prompt=add_generation_prompt,
                                   **kwargs)
        if prefill is not None:
            content = prefill.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            text += content if isinstance(content, str) else ""
    except InvalidMessagesError as exc:
        raise _bad(str(exc)) from None
    except ChatTemplateError as exc:
        raise ServerError(str(exc), "server_error", 500) from None
    return text


def parse_chat(body: Any, tokenizer, template: ChatTemplate, defaults: RequestDefaults,
               n_slots: int, jinja: bool = False, speculative: bool = False) -> CompletionParams:
    """A chat body -> CompletionParams: the rendered prompt plus every /completion field
    (llama copies all other body keys into the native parameters)."""
    text = render_chat(body, template, jinja)
    body = dict(body)
    logprobs = body.pop("logprobs", None)
    top_logprobs = body.pop("top_logprobs", None)
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad("Field 'logprobs': expected a boolean")
    if logprobs:
        if "n_probs" not in body or body["n_probs"] is None:
            n = 20 if top_logprobs is None else top_logprobs
            if isinstance(n, bool) or not isinstance(n, int):
                raise _bad("Field 'top_logprobs': expected an integer")
            body["n_probs"] = n
    elif top_logprobs is not None:
        raise _bad("top_logprobs requires logprobs to be set to true")
    ids = tokenizer.encode(text, add_special=False, parse_special=True)
    # BOS as llama adds it for a string prompt, but not twice when the template wrote it.
    bos = tokenizer.bos_id
    if tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return parse_completion(body, tokenizer, defaults, n_slots,
                            prompts=[_check_ids(tokenizer, ids)], speculative=speculative)


# -- generation_settings / params JSON ----------------------------------------------------------

def _format_logit_bias(bias: Dict[int, float], eog: Sequence[int] = ()) -> List[dict]:
    out = [{"bias": (None if math.isinf(b) else b), "token": t} for t, b in bias.items()]
    # ignore_eos shows as EOG tokens biased to -inf, serialised as null (llama's to_json)
    out.extend({"bias": None, "token": t} for t in eog if t not in bias)
    return out


def generation_settings(req: GenerationRequest, eog_ids: Sequence[int] = (),
                        stream: bool = False, n_keep: int = 0,
                        speculative_types: Sequence[str] = (),
                        timings_per_token: bool = False,
                        chat_format: str = "Content-only") -> dict:
    """llama's task_params::to_json: the fields we honour from `req`, llama's defaults for the
    samplers we do not run (so clients reading them get llama's values)."""
    return {
        "seed": req.seed & 0xFFFFFFFF if req.seed >= 0 else 4294967295,
        "temperature": req.temperature,
        "dynatemp_range": 0.0,
        "dynatemp_exponent": 1.0,
        "top_k": req.top_k,
        "top_p": req.top_p,
        "min_p": req.min_p,
        "top_n_sigma": -1.0,
        "xtc_probability": 0.0,
        "xtc_threshold": 0.1,
        "typical_p": 1.0,
        "repeat_last_n": req.repeat_last_n,
        "repeat_penalty": req.repeat_penalty,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "dry_multiplier": 0.0,
        "dry_base": 1.75,
        "dry_allowed_length": 2,
        "dry_penalty_last_n": -1,
        "dry_sequence_breakers": ["\n", ":", "\"", "*"],
        "mirostat": 0,
        "mirostat_tau": 5.0,
        "mirostat_eta": 0.1,
        "adaptive_target": -1.0,
        "adaptive_decay": 0.9,
        "stop": list(req.stop),
        "max_tokens": req.n_predict,
        "n_predict": req.n_predict,
        "n_keep": n_keep,
        "n_discard": 0,
        "ignore_eos": req.ignore_eos,
        "stream": stream,
        "logit_bias": _format_logit_bias(req.logit_bias, eog_ids if req.ignore_eos else ()),
        "n_probs": req.n_probs,
        "min_keep": 0,
        "grammar": "",
        "grammar_lazy": False,
        "grammar_triggers": [],
        "preserved_tokens": [],
        "chat_format": chat_format,
        "reasoning_format": "none",
        "reasoning_in_content": False,
        "generation_prompt": "",
        "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
        "speculative.types": list(speculative_types),
        "timings_per_token": timings_per_token,
        "post_sampling_probs": False,
        "backend_sampling": False,
        "lora": [],
    }
