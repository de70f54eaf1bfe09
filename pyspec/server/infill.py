"""POST /infill: llama-server's fill-in-the-middle completion (reference llama-server-api.md
§1.12), which code-completion editor plugins call.

The model needs the FIM prefix, suffix and middle tokens (GGUF tokenizer.ggml.fim_*_token_id, or
found by their text: pyspec/tokenizer.py), else 501 before the body is read. The prompt is
llama-server's repo-level layout:

    [FIM_REP]myproject\\n [FIM_SEP]filename\\n extra text ...  [FIM_SEP]filename\\n
    [BOS] [FIM_PRE] prefix [FIM_SUF] suffix [FIM_MID] prompt

with the `input_extra` chunks first (a "--- snippet ---" separator instead of FIM_SEP where the
model has none, no repo header without FIM_REP), suffix before prefix with --spm-infill, and the
parts cut as llama-server cuts them: the prefix's last 3/4 of a batch, the suffix's first
(1/4 batch - 2 - prompt tokens), and the extra chunks' last (n_ctx - n_batch - 2 n_predict)
tokens. The request then runs as a /completion request on those token ids.
"""

from __future__ import annotations

from typing import Any, List, Tuple

from .types import ServerError

# What is cut where the model lacks a FIM token, in llama-server's message.
_REQUIRED = (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle"))
_SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"
_REPO_NAME = "myproject\n"
_CURRENT_FILE = "filename\n"


def _bad(message: str) -> ServerError:
    return ServerError(message, "invalid_request_error", 400)


def check_infill_support(tokenizer) -> None:
    """501 unless the model has the FIM prefix, suffix and middle tokens."""
    fim = tokenizer.fim_ids
    for key, what in _REQUIRED:
        if fim.get(key) is None:
            raise ServerError(f"Infill is not supported by this model: {what} token is missing.",
                              "not_supported_error", 501)


def infill_fields(body: Any) -> Tuple[str, str, List[Tuple[str, str]], str]:
    """(input_prefix, input_suffix, [(filename, text)] of input_extra, prompt) of a request."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    fields = []
    for name in ("input_prefix", "input_suffix"):
        if name not in body:
            raise _bad(f'"{name}" is required')
        if not isinstance(body[name], str):
            raise _bad(f'"{name}" must be a string')
        fields.append(body[name])
    extra = body.get("input_extra", [])
    shape = '"input_extra" must be an array of {"filename": string, "text": string}'
    if not isinstance(extra, list):
        raise _bad(shape)
    chunks = []
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text", ""), str) or \
                not isinstance(chunk.get("filename", "tmp"), str):
            raise _bad(shape)
        chunks.append((chunk.get("filename", "tmp"), chunk.get("text", "")))
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise _bad('"prompt" must be a string in an infill request')
    return fields[0], fields[1], chunks, prompt


def infill_tokens(tokenizer, prefix: str, suffix: str, extra: List[Tuple[str, str]], prompt: str,
                  n_batch: int, n_ctx: int, n_predict: int, spm: bool) -> List[int]:
    """The token ids of the infill prompt (the layout in the module docstring)."""
    def tok(text: str) -> List[int]:
        return tokenizer.encode(text, add_special=False, parse_special=False)

    fim = tokenizer.fim_ids
    extra_ids: List[int] = []
    if fim.get("fim_rep") is not None:
        extra_ids += [fim["fim_rep"]] + tok(_REPO_NAME)
    for filename, text in extra:
        if fim.get("fim_sep") is not None:
            extra_ids += [fim["fim_sep"]] + tok(filename + "\n")
        else:
            extra_ids += tok(_SNIPPET_SEPARATOR)
        extra_ids += tok(text)
    if fim.get("fim_sep") is not None:
        extra_ids += [fim["fim_sep"]] + tok(_CURRENT_FILE)

    prefix_ids, suffix_ids, prompt_ids = tok(prefix), tok(suffix), tok(prompt)
    n_prefix = min(len(prefix_ids), 3 * (n_batch // 4))
    n_suffix = min(len(suffix_ids), max(0, n_batch // 4 - (2 + len(prompt_ids))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_ids))
    pre = [fim["fim_pre"]] + prefix_ids[len(prefix_ids) - n_prefix:]
    suf = [fim["fim_suf"]] + suffix_ids[:n_suffix]
    first, second = (suf, pre) if spm else (pre, suf)
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    kept_extra = extra_ids[len(extra_ids) - n_extra:] if n_extra else []
    return kept_extra + bos + first + second + [fim["fim_mid"]] + prompt_ids
