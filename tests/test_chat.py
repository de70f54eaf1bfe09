"""Chat templates: HF conventions, SmolLM2's own template, errors and the sandbox."""

import json
from pathlib import Path

import pytest
from jinja2.sandbox import SecurityError

from pyspec.chat import (CHATML_TEMPLATE, ChatTemplate, ChatTemplateError,
                         ChatTemplateSecurityError, InvalidMessagesError, validate_messages)

from default_model import require_default_model

DATA = Path(__file__).resolve().parents[2] / "shared/data"
GREEDY_REF = DATA / "smollm2_greedy_reference.json"

# A Qwen2.5-style ChatML template (written for this test): default system message when none is
# given, tools listed as JSON in the system turn.
QWEN_STYLE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}{{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'system' and loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def _smollm2_template():
    require_default_model()
    import pyspec

    meta = pyspec._core.GgufFile(pyspec.default_model_path()).metadata
    tokens = meta["tokenizer.ggml.tokens"]
    return ChatTemplate(meta["tokenizer.chat_template"],
                        bos_token=tokens[meta["tokenizer.ggml.bos_token_id"]],
                        eos_token=tokens[meta["tokenizer.ggml.eos_token_id"]], name="model")


def test_smollm2_template_renders_the_reference_prompt():
    case = next(c for c in json.loads(GREEDY_REF.read_text())["cases"] if "chat_messages" in c)
    text = _smollm2_template().render(case["chat_messages"], add_generation_prompt=True)
    assert text == case["templated_prompt"]


def test_smollm2_template_keeps_a_given_system_message_and_history():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Bye"}]
    text = _smollm2_template().render(messages, add_generation_prompt=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n")


def test_qwen_style_template_with_system_message():
    t = ChatTemplate(QWEN_STYLE)
    messages = [{"role": "system", "content": "You answer in French."},
                {"role": "user", "content": "Hello"}]
    assert t.render(messages) == ("<|im_start|>system\nYou answer in French.<|im_end|>\n"
                                  "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    # Without one the template's default system message appears; no generation prompt asked.
    assert t.render(messages[1:], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello<|im_end|>\n")


def test_tools_reach_the_template_as_plain_json():
    tool = {"type": "function",
            "function": {"name": "get_weather", "description": "Weather <now> & 'here'",
                         "parameters": {"city": "Zürich"}}}
    text = ChatTemplate(QWEN_STYLE).render([{"role": "user", "content": "Weather?"}], tools=[tool])
    # HF's tojson: no HTML escaping, non-ASCII kept.
    assert "\n" + json.dumps(tool, ensure_ascii=False) + "\n</tools>" in text
    assert text.startswith(
        "<|im_start|>system\nYou are Qwen, a helpful assistant.\n\n# Tools\n<tools>")


def test_bos_eos_strftime_and_extra_variables():
    t = ChatTemplate("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"
                     "|{{ strftime_now('%Y') }}|{{ enable_thinking }}",
                     bos_token="<s>", eos_token="</s>")
    import datetime
    year = datetime.datetime.now().strftime("%Y")
    text = t.render([{"role": "user", "content": "x"}], enable_thinking=False)
    assert text == f"<s>x</s>|{year}|False"


def test_raise_exception_gives_chat_template_error_with_the_templates_text():
    t = ChatTemplate("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
                     "{{ raise_exception('Only user and assistant roles are supported!') }}"
                     "{% endif %}{{ m.content }}{% endfor %}")
    assert t.render([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(ChatTemplateError) as info:
        t.render([{"role": "system", "content": "no"}])
    assert str(info.value) == "Only user and assistant roles are supported!"
    assert isinstance(info.value, ValueError)


def test_chatml_fallback_when_the_model_has_no_template():
    class NoTemplateTokenizer:
        chat_template = None
        bos_id, eos_id = 1, 2

        def token_to_piece(self, i):
            return {1: b"<s>", 2: b"</s>"}[i]

    t = ChatTemplate.from_tokenizer(NoTemplateTokenizer())
    assert t.name == "chatml" and t.source == CHATML_TEMPLATE
    assert (t.bos_token, t.eos_token) == ("<s>", "</s>")
    text = t.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                    "<|im_start|>assistant\n")
    # The built-in name gives the same template, and overrides the model's own.
    builtin = ChatTemplate.from_name_or_source("chatml")
    assert builtin.render([{"role": "user", "content": "U"}]) == \
        "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"


def test_template_from_file_and_from_string(tmp_path):
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                    "{% if add_generation_prompt %}[assistant]{% endif %}", encoding="utf-8")

    class Tok:
        chat_template = CHATML_TEMPLATE
        bos_id, eos_id = -1, None

    msgs = [{"role": "user", "content": "héllo"}]
    from_file = ChatTemplate.from_tokenizer(Tok(), override_file=path)
    assert from_file.render(msgs) == "[user]héllo[assistant]"
    assert from_file.name == "mine.jinja" and from_file.bos_token == ""
    from_string = ChatTemplate.from_tokenizer(Tok(), override=path.read_text())
    assert from_string.render(msgs, add_generation_prompt=False) == "[user]héllo"
    with pytest.raises(ChatTemplateError, match="cannot read chat template file"):
        ChatTemplate.from_file(tmp_path / "missing.jinja")
    with pytest.raises(ChatTemplateError, match="unknown chat template 'llama9'"):
        ChatTemplate.from_name_or_source("llama9")


def test_syntax_errors_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        ChatTemplate("ok\n{% for m in messages %}{{ m.content }}")
    with pytest.raises(ChatTemplateError, match="empty"):
        ChatTemplate("   ")


def test_trim_and_lstrip_blocks_as_hf():
    t = ChatTemplate("{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n"
                     "    {% endif %}\n{% endfor %}")
    # The block tags' own lines vanish; only the content lines remain.
    two = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert t.render(two) == "a\nb\n"


def test_loop_controls_are_available():
    t = ChatTemplate("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                     "{{ m.content }}{% endfor %}")
    assert t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a"


@pytest.mark.parametrize("source", [
    "{{ messages.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ raise_exception.__globals__ }}",
    "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}",
    "{% for m in messages %}{% set _ = m.update({'content': 'x'}) %}{% endfor %}",
])
def test_sandbox_blocks_unsafe_access_and_mutation(source):
    with pytest.raises(ChatTemplateSecurityError) as info:
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    assert isinstance(info.value.__cause__, SecurityError)
    assert "sandbox" in str(info.value)


def test_runtime_errors_in_templates_are_wrapped():
    with pytest.raises(ChatTemplateError, match="failed to render"):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])


def test_content_parts_are_joined_and_other_keys_pass_through():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    msgs = validate_messages([{"role": "user", "content": parts, "name": "n"},
                              {"role": "assistant", "content": None}])
    assert msgs == [{"role": "user", "content": "a\nb", "name": "n"},
                    {"role": "assistant", "content": ""}]


@pytest.mark.parametrize("messages, message", [
    ("hello", "must be a list"),
    ([], "empty"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"content": "x"}], r"messages\[0\] needs a non-empty string 'role'"),
    ([{"role": "user"}], r"messages\[0\] \(user\) has no 'content'"),
    ([{"role": "user", "content": 3}], r"messages\[0\].content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}], "only text parts"),
])
def test_invalid_messages_have_clear_errors(messages, message):
    with pytest.raises(InvalidMessagesError, match=message):
        ChatTemplate(CHATML_TEMPLATE).render(messages)
