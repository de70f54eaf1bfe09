"""Chat templates: render a model's Jinja chat template the way Hugging Face transformers does.

A GGUF file carries its template in `tokenizer.chat_template`. We render it in jinja2's immutable
sandbox (templates come from downloaded files, so they must not reach Python internals or mutate
our objects) with HF's conventions: `trim_blocks`/`lstrip_blocks`, the `loopcontrols` extension, a
`tojson` filter that does not HTML-escape, and the variables `messages`, `add_generation_prompt`,
`bos_token`, `eos_token`, `tools`, `raise_exception(msg)` and `strftime_now(fmt)`. A file without
a template gets ChatML, as llama.cpp falls back to it.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

# llama.cpp's `chatml` built-in, written as a template so both paths render the same way.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

BUILTIN_TEMPLATES = {"chatml": CHATML_TEMPLATE}


class ChatTemplateError(ValueError):
    """A template that does not compile, fails while rendering, or rejects the conversation (its
    `raise_exception(msg)` gives this error with exactly `msg` as the message)."""


class ChatTemplateSecurityError(ChatTemplateError):
    """The template tried something the sandbox forbids (private attributes, mutating inputs)."""


class InvalidMessagesError(ValueError):
    """The conversation is not a list of {"role": str, "content": str | text parts}."""


def _raise_exception(message: Any) -> None:
    raise ChatTemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators=None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML; chat prompts need the plain JSON text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, except that touching an unsafe attribute fails at once: jinja's
    default hands back an Undefined that prints as an empty string, which would hide the
    attempt."""

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _make_environment() -> jinja2.Environment:
    env = _ChatSandbox(trim_blocks=True, lstrip_blocks=True,
                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def validate_messages(messages: Any) -> List[Dict[str, Any]]:
    """Checks a conversation and returns a copy the template can read.

    Each message is a mapping with a string `role` and a `content` that is a string or a list of
    text parts ({"type": "text", "text": ...}); a list is joined with newlines into one string, as
    llama.cpp does for templates that expect plain text. Other keys (name, tool_calls, ...) pass
    through unchanged.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidMessagesError(
            "messages must be a list of {'role', 'content'} objects, "
            f"got {type(messages).__name__}")
    if len(messages) == 0:
        raise InvalidMessagesError("messages is empty: give at least one message")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise InvalidMessagesError(
                f"messages[{i}] must be an object with 'role' and 'content', "
                f"got {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidMessagesError(f"messages[{i}] needs a non-empty string 'role'")
        if "content" not in msg:
            raise InvalidMessagesError(f"messages[{i}] ({role}) has no 'content'")
        content = msg["content"]
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise InvalidMessagesError(
                        f"messages[{i}].content[{j}] must be {{'type': 'text', 'text': str}}; "
                        "only text parts are supported")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise InvalidMessagesError(
                f"messages[{i}].content must be a string or a list of text parts, "
                f"got {type(content).__name__}")
        copy = dict(msg)
        copy["content"] = content
        out.append(copy)
    return out


class ChatTemplate:
    """A compiled chat template plus the special-token strings it is rendered with."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "",
                 name: str = "custom"):
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("chat template is empty")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name
        try:
            self._template = _make_environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"chat template ({name}) has a syntax error at line {exc.lineno}: {exc.message}"
            ) from None

    @classmethod
    def from_file(cls, path: Union[str, os.PathLike], bos_token: str = "",
                  eos_token: str = "") -> "ChatTemplate":
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except OSError as exc:
            raise ChatTemplateError(
                f"cannot read chat template file {os.fspath(path)!r}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ChatTemplateError(
                f"chat template file {os.fspath(path)!r} is not UTF-8 text") from None
        return cls(source, bos_token, eos_token, name=os.path.basename(os.fspath(path)))

    @classmethod
    def from_tokenizer(cls, tokenizer, override: Optional[str] = None,
                       override_file: Optional[Union[str, os.PathLike]] = None) -> "ChatTemplate":
        """The template to use for a model: `override_file`, else `override` (a built-in name
        such as "chatml" or Jinja source), else the model's own, else ChatML."""
        bos = _token_text(tokenizer, tokenizer.bos_id)
        eos = _token_text(tokenizer, tokenizer.eos_id)
        if override_file is not None:
            return cls.from_file(override_file, bos, eos)
        if override is not None:
            return cls.from_name_or_source(override, bos, eos)
        source = tokenizer.chat_template
        if source:
            return cls(source, bos, eos, name="model")
        return cls(CHATML_TEMPLATE, bos, eos, name="chatml")

    @classmethod
    def from_name_or_source(cls, text: str, bos_token: str = "",
                            eos_token: str = "") -> "ChatTemplate":
        """`text` is a built-in name (`chatml`) or Jinja source (anything with {{ or {%)."""
        if text in BUILTIN_TEMPLATES:
            return cls(BUILTIN_TEMPLATES[text], bos_token, eos_token, name=text)
        if "{{" in text or "{%" in text:
            return cls(text, bos_token, eos_token)
        raise ChatTemplateError(
            f"unknown chat template {text!r}: give Jinja source or one of "
            f"{', '.join(sorted(BUILTIN_TEMPLATES))}")

    def render(self, messages: Any, add_generation_prompt: bool = True,
               tools: Optional[List[Any]] = None, **extra: Any) -> str:
        """The prompt text for a conversation. `extra` reaches the template as variables (e.g.
        `enable_thinking` for Qwen3)."""
        msgs = validate_messages(messages)
        variables = dict(extra)
        variables.update(messages=msgs, add_generation_prompt=bool(add_generation_prompt),
                         bos_token=self.bos_token, eos_token=self.eos_token)
        if tools is not None:
            variables["tools"] = tools
        try:
            return self._template.render(**variables)
        except ChatTemplateError:
            raise
        except SecurityError as exc:
            raise ChatTemplateSecurityError(
                f"chat template ({self.name}) was stopped by the sandbox: {exc}") from exc
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(
                f"chat template ({self.name}) failed to render: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(
                f"chat template ({self.name}) failed to render: {type(exc).__name__}: {exc}"
            ) from exc

    def __repr__(self) -> str:
        return f"ChatTemplate(name={self.name!r}, {len(self.source)} chars)"


def _token_text(tokenizer, token_id: Optional[int]) -> str:
    if token_id is None or token_id < 0:
        return ""
    return tokenizer.token_to_piece(token_id).decode("utf-8", errors="replace")
