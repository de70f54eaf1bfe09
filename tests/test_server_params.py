"""Request parsing for pyspec-server (pyspec/server/params.py) against llama-server's schema
(reference §1.3-1.5, §1.14): names, aliases, null, soft/hard limits, logit_bias, stop, prompts,
chat rendering, and the `generation_settings` JSON. Uses SmolLM2's real tokenizer."""

import math

import pytest

from default_model import require_default_model

require_default_model()

import pyspec
from pyspec.chat import ChatTemplate
from pyspec.model import default_model_path
from pyspec.server.params import (RequestDefaults, generation_settings, parse_chat,
                                  parse_completion, parse_logit_bias, parse_prompts, parse_stop,
                                  render_chat)
from pyspec.server.types import ServerError
from pyspec.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def meta():
    return dict(pyspec._core.GgufFile(default_model_path()).metadata)


@pytest.fixture(scope="module")
def tok(meta):
    return Tokenizer.from_metadata(meta)


@pytest.fixture(scope="module")
def tok_bos(meta):
    # SmolLM2 does not add BOS; the same vocabulary with add_bos_token shows llama's BOS rules
    return Tokenizer.from_metadata(dict(meta, **{"tokenizer.ggml.add_bos_token": True}))


@pytest.fixture(scope="module")
def template(tok):
    return ChatTemplate.from_tokenizer(tok)


D = RequestDefaults()


def parse(tok, body, n_slots=4):
    return parse_completion(body, tok, D, n_slots)


def error_of(fn, *args, **kw) -> ServerError:
    with pytest.raises(ServerError) as info:
        fn(*args, **kw)
    return info.value


# -- names, aliases, null -------------------------------------------------------------------------

def test_defaults_come_from_the_cli(tok):
    d = RequestDefaults(n_predict=7, temperature=0.1, top_k=3, seed=42, stop=["X"])
    p = parse_completion({"prompt": "hi"}, tok, d, 1)
    b = p.base
    assert (b.n_predict, b.temperature, b.top_k, b.seed, b.stop) == (7, 0.1, 3, 42, ["X"])
    assert (p.stream, p.n_cmpl, p.include_usage, b.cache_prompt, b.id_slot) == \
        (False, 1, False, True, -1)


@pytest.mark.parametrize("body,expected", [
    ({"max_tokens": 5}, 5),
    ({"max_completion_tokens": 6}, 6),
    ({"n_predict": 3, "max_tokens": 5, "max_completion_tokens": 6}, 3),  # n_predict wins
    ({"n_predict": None, "max_tokens": 5}, 5),                            # null = absent
    ({"n_predict": None}, -1),
])
def test_n_predict_aliases(tok, body, expected):
    assert parse(tok, dict(body, prompt="x")).base.n_predict == expected


def test_null_means_default(tok):
    b = parse(tok, {"prompt": "x", "temperature": None, "top_k": None, "stop": None,
                    "seed": None, "stream": None, "logit_bias": None}).base
    assert (b.temperature, b.top_k, b.stop, b.seed) == (D.temperature, D.top_k, [], -1)


def test_soft_limits_clamp(tok):
    b = parse(tok, {"prompt": "x", "top_k": -3, "top_p": 1.5, "min_p": -0.2,
                    "temperature": -1}).base
    assert (b.top_k, b.top_p, b.min_p, b.temperature) == (0, 1.0, 0.0, 0.0)


@pytest.mark.parametrize("body,message", [
    ({"n_predict": -5},
     "Field 'n_predict': Value must be between -1 <= value <= 2147483647, but got -5"),
    ({"max_tokens": -2},
     "Field 'max_tokens': Value must be between -1 <= value <= 2147483647, but got -2"),
    ({"n": 3}, "Field 'n': Value must be between 1 <= value <= 2, but got 3"),
    ({"n_cmpl": 0}, "Field 'n_cmpl': Value must be between 1 <= value <= 2, but got 0"),
])
def test_hard_limits_answer_400_with_the_field_name_as_sent(tok, body, message):
    err = error_of(parse, tok, dict(body, prompt="x"), n_slots=2)
    assert (err.code, err.type, err.message) == (400, "invalid_request_error", message)


@pytest.mark.parametrize("body", [
    {"n_predict": "5"}, {"temperature": "hot"}, {"stream": 1}, {"top_k": [1]},
    {"stop": 5}, {"stop": ["a", 1]}, {"logit_bias": 3}, {"stream_options": []},
    {"cache_prompt": "yes"},
])
def test_wrong_types_are_400(tok, body):
    err = error_of(parse, tok, dict(body, prompt="x"))
    assert (err.code, err.type) == (400, "invalid_request_error")


def test_numbers_convert_as_nlohmann_does(tok):
    assert parse(tok, {"prompt": "x", "n_predict": 8.7}).base.n_predict == 8
    # OAI clients send `logprobs: true` to /v1/completions; llama reads it as n_probs 1
    assert parse(tok, {"prompt": "x", "logprobs": True}).base.n_probs == 1


def test_n_probs_is_not_limited(tok):
    assert parse(tok, {"prompt": "x", "n_probs": -4}).base.n_probs == 0
    assert parse(tok, {"prompt": "x", "n_probs": 10 ** 9}).base.n_probs == tok.n_vocab
    assert parse(tok, {"prompt": "x", "logprobs": 3}).base.n_probs == 3  # OAI completion alias


def test_request_level_options(tok):
    p = parse(tok, {"prompt": "x", "stream": True, "stream_options": {"include_usage": True},
                    "seed": 9, "id_slot": 1, "cache_prompt": False, "ignore_eos": True,
                    "return_tokens": True, "n": 2})
    assert (p.stream, p.include_usage, p.return_tokens, p.n_cmpl) == (True, True, True, 2)
    assert (p.base.seed, p.base.id_slot, p.base.cache_prompt, p.base.ignore_eos) == \
        (9, 1, False, True)
    tasks = p.tasks()
    assert len(tasks) == 2 and tasks[0] is not tasks[1]
    assert tasks[0].prompt_ids == tasks[1].prompt_ids == p.prompts[0]


# -- prompts ---------------------------------------------------------------------------------------

def test_prompt_forms(tok):
    hello = tok.encode("Hello", add_special=False, parse_special=True)
    assert parse_prompts(tok, "Hello") == [hello]
    assert parse_prompts(tok, [1, 2, 3]) == [[1, 2, 3]]
    assert parse_prompts(tok, [5, "Hello", 6]) == [[5] + hello + [6]]        # mixed: one prompt
    assert parse_prompts(tok, ["Hello", [7, 8], [9, "Hello"]]) == \
        [hello, [7, 8], [9] + hello]                                           # several prompts
    # special tokens are parsed in prompts, as llama-server does
    assert parse_prompts(tok, "<|im_start|>") == [[tok.token_to_id("<|im_start|>")]]


def test_bos_only_when_the_prompt_starts_with_a_string(tok_bos):
    bos = tok_bos.bos_id
    hello = tok_bos.encode("Hello", add_special=False)
    assert parse_prompts(tok_bos, "Hello") == [[bos] + hello]
    assert parse_prompts(tok_bos, ["Hello", 5]) == [[bos] + hello + [5]]
    assert parse_prompts(tok_bos, [5, "Hello"]) == [[5] + hello]
    assert parse_prompts(tok_bos, [5, 6]) == [[5, 6]]


@pytest.mark.parametrize("prompt", [5, {"a": 1}, [["x", {}]], [1.5], [], [10 ** 7]])
def test_bad_prompts_are_400(tok, prompt):
    err = error_of(parse_prompts, tok, prompt)
    assert (err.code, err.type) == (400, "invalid_request_error")


def test_missing_prompt(tok):
    err = error_of(parse, tok, {"n_predict": 3})
    assert (err.code, err.message) == (400, "key 'prompt' not found")


def test_several_prompts_times_n(tok):
    p = parse(tok, {"prompt": ["a", "b"], "n": 2})
    assert [t.prompt_ids for t in p.tasks()] == [p.prompts[0]] * 2 + [p.prompts[1]] * 2


# -- logit_bias, stop ------------------------------------------------------------------------------

def test_logit_bias_list_format(tok):
    hello = tok.encode(" Hello", add_special=False)
    bias = parse_logit_bias(tok, [[15, 2.5], [" Hello", -1], [16, False], [17, True],
                                  [10 ** 7, 1.0], ["bad"], 3])
    assert bias[15] == 2.5 and bias[16] == -math.inf
    assert all(bias[t] == -1 for t in hello)
    assert 17 not in bias and 10 ** 7 not in bias  # `true` and out-of-vocab are skipped


def test_logit_bias_oai_object_format(tok):
    hello = tok.encode("Hello", add_special=False)
    bias = parse_logit_bias(tok, {"15": 1.0, "Hello": -2, "16": False, "99999999": 1})
    assert bias[15] == 1.0 and bias[16] == -math.inf
    assert all(bias[t] == -2 for t in hello)
    assert 99999999 not in bias


def test_stop_forms():
    assert parse_stop("x", []) == ["x"]
    assert parse_stop(["a", "b"], []) == ["a", "b"]
    assert parse_stop([], ["R"]) == ["R"]       # empty -> the CLI's reverse prompts
    assert parse_stop(None, ["R"]) == ["R"]


# -- unsupported features --------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [
    {"json_schema": {"type": "object"}},
    {"grammar": "root ::= \"a\""},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_object", "schema": {}}},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
])
def test_constrained_output_is_not_supported_yet(tok, extra):
    err = error_of(parse, tok, dict(extra, prompt="x"))
    assert err.code == 400 and "not supported yet" in err.message


def test_response_format_text_is_fine_and_a_bad_type_is_400(tok):
    parse(tok, {"prompt": "x", "response_format": {"type": "text"}, "grammar": ""})
    err = error_of(parse, tok, {"prompt": "x", "response_format": {"type": "sound"}})
    assert err.code == 400 and "sound" in err.message


# -- chat ------------------------------------------------------------------------------------------

def chat(tok, template, body, n_slots=4, jinja=False):
    return parse_chat(body, tok, template, D, n_slots, jinja)


USER = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("body,code", [
    ({}, 400),
    ({"messages": None}, 400),
    ({"messages": "hi"}, 400),
    ({"messages": [{"role": "user"}]}, 400),
    ({"messages": [{"role": "user", "content": 5}]}, 400),
    ({"messages": [], "x": 1}, 400),
    ({"messages": USER, "tools": [{"type": "function"}]}, 500),  # llama: needs --jinja
    ({"messages": USER, "top_logprobs": 2}, 400),
    ({"messages": USER, "logprobs": 3}, 400),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "assistant", "content": "c"}]}, 400),
    ({"messages": USER, "continue_final_message": True, "add_generation_prompt": True}, 400),
])
def test_bad_chat_bodies(tok, template, body, code):
    err = error_of(chat, tok, template, body)
    assert err.code == code
    assert err.type == ("invalid_request_error" if code == 400 else "server_error")


def test_tools_with_jinja_are_not_supported_yet(tok, template):
    err = error_of(chat, tok, template, {"messages": USER, "tools": [{"type": "function"}]},
                   jinja=True)
    assert err.code == 400 and "not supported yet" in err.message


def test_chat_prompt_is_the_rendered_template(tok, template):
    p = chat(tok, template, {"messages": USER, "max_tokens": 4, "temperature": 0})
    text = template.render(USER, add_generation_prompt=True)
    assert p.prompts == [tok.encode(text, add_special=False, parse_special=True)]
    assert (p.base.n_predict, p.base.temperature) == (4, 0.0)
    no_gen = render_chat({"messages": USER, "add_generation_prompt": False}, template)
    assert no_gen == template.render(USER, add_generation_prompt=False)


def test_trailing_assistant_message_is_prefilled(tok, template):
    msgs = USER + [{"role": "assistant", "content": "Sure, the answer is"}]
    text = render_chat({"messages": msgs}, template)
    assert text == template.render(USER, add_generation_prompt=True) + "Sure, the answer is"


def test_chat_logprobs_become_n_probs(tok, template):
    assert chat(tok, template, {"messages": USER, "logprobs": True}).base.n_probs == 20
    assert chat(tok, template, {"messages": USER, "logprobs": True,
                                "top_logprobs": 3}).base.n_probs == 3
    assert chat(tok, template, {"messages": USER, "logprobs": False}).base.n_probs == 0


def test_chat_takes_native_fields_too(tok, template):
    p = chat(tok, template, {"messages": USER, "n_probs": 2, "id_slot": 1, "n_predict": 9,
                             "max_tokens": 1, "stop": "\n", "n": 2}, n_slots=2)
    assert (p.base.n_probs, p.base.id_slot, p.base.n_predict, p.base.stop, p.n_cmpl) == \
        (2, 1, 9, ["\n"], 2)


def test_chat_adds_bos_once(tok_bos):
    t = ChatTemplate("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
                     bos_token=tok_bos.token_text(tok_bos.bos_id))
    ids = parse_chat({"messages": USER}, tok_bos, t, D, 1).prompts[0]
    assert ids[0] == tok_bos.bos_id and ids[1] != tok_bos.bos_id
    t2 = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert parse_chat({"messages": USER}, tok_bos, t2, D, 1).prompts[0][0] == tok_bos.bos_id


# -- generation_settings ---------------------------------------------------------------------------

PARAMS_KEYS = {  # reference §1.8
    "seed", "temperature", "dynatemp_range", "dynatemp_exponent", "top_k", "top_p", "min_p",
    "top_n_sigma", "xtc_probability", "xtc_threshold", "typical_p", "repeat_last_n",
    "repeat_penalty", "presence_penalty", "frequency_penalty", "dry_multiplier", "dry_base",
    "dry_allowed_length", "dry_penalty_last_n", "mirostat", "mirostat_tau", "mirostat_eta",
    "adaptive_target", "adaptive_decay", "max_tokens", "n_predict", "n_keep", "n_discard",
    "ignore_eos", "stream", "n_probs", "min_keep", "chat_format", "reasoning_format",
    "reasoning_in_content", "generation_prompt", "samplers", "speculative.types",
    "timings_per_token", "post_sampling_probs", "backend_sampling", "lora",
}


def test_generation_settings_shape(tok):
    p = parse(tok, {"prompt": "x", "n_predict": 5, "seed": 3, "logit_bias": [[15, 1.5]],
                    "ignore_eos": True, "stop": ["Q"]})
    s = generation_settings(p.base, sorted(tok.eog_ids), stream=True,
                            speculative_types=["draft"])
    assert PARAMS_KEYS <= set(s)
    assert (s["n_predict"], s["max_tokens"], s["seed"], s["stream"], s["stop"]) == \
        (5, 5, 3, True, ["Q"])
    # ignore_eos shows as EOG tokens biased to -inf, which JSON carries as null
    assert {"bias": 1.5, "token": 15} in s["logit_bias"]
    assert all({"bias": None, "token": t} in s["logit_bias"] for t in tok.eog_ids)
    assert s["speculative.types"] == ["draft"]
    assert generation_settings(parse(tok, {"prompt": "x"}).base)["seed"] == 4294967295
