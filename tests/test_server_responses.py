"""Response JSON, SSE framing and /metrics text of pyspec-server against llama-server's shapes
(reference §1.0-1.10), plus the routes of app.py that need no generation (loading gate, auth,
CORS, errors, tokenize/detokenize/apply-template). Generation through a real Scheduler is
tested at process level elsewhere."""

import math
import re

import pytest

from default_model import require_default_model

require_default_model()

from fastapi.testclient import TestClient

from pyspec.chat import ChatTemplate
from pyspec.model import default_model_path
from pyspec.server.app import AppSettings, create_app
from pyspec.server.metrics import MetricsExporter
from pyspec.server.params import RequestDefaults
from pyspec.server.responses import (SSE_DONE, ResponseContext, chat_completion,
                                     chat_stream_events, dumps, finish_reason, native_final,
                                     native_partial, oai_completion, oai_completion_chunk,
                                     oai_completion_final_chunk, sse, token_prob_json)
from pyspec.server.types import Chunk, Final, GenerationRequest, TokenProb
from pyspec.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture
def ctx(tok):
    return ResponseContext(tok, "smollm2", "b0.1.0-pyspec")


def final(stop_type="eos", n_prompt=5, n_cached=2, probs=()):
    return Final(content="Hi!\n", tokens=[10, 11], stop_type=stop_type, stopping_word="",
                 truncated=False, id_slot=1, n_prompt=n_prompt, n_cached=n_cached,
                 n_predicted=2, prompt_ms=30.0, predicted_ms=20.0, draft_n=4,
                 draft_n_accepted=3, seed=7, probs=list(probs))


TIMINGS_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
                "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second",
                "draft_n", "draft_n_accepted"}
USAGE = {"completion_tokens": 2, "prompt_tokens": 5, "total_tokens": 7,
         "prompt_tokens_details": {"cached_tokens": 2}}


def test_ids_framing_and_finish_reason():
    ctx = ResponseContext(None, "m")
    assert re.fullmatch(r"chatcmpl-[A-Za-z0-9]{32}", ctx.id)
    assert sse({"a": [1, "é"]}) == 'data: {"a":[1,"é"]}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"
    assert dumps({"x": -math.inf, "y": [math.nan]}) == '{"x":null,"y":[null]}'
    assert [finish_reason(s) for s in ("eos", "word", "limit")] == ["stop", "stop", "length"]


def test_token_probabilities_entry(tok):
    hello = tok.encode(" hello", add_special=False)[0]
    e = token_prob_json(tok, TokenProb(hello, -0.25, [(hello, -0.25), (11, -3.0)]))
    assert e == {"id": hello, "token": " hello", "bytes": list(b" hello"), "logprob": -0.25,
                 "top_logprobs": [
                     {"id": hello, "token": " hello", "bytes": list(b" hello"),
                      "logprob": -0.25},
                     {"id": 11, "token": tok.token_to_piece(11).decode(),
                      "bytes": list(tok.token_to_piece(11)), "logprob": -3.0}]}


def test_native_final_and_partial(ctx):
    req = GenerationRequest(prompt_ids=[1, 2, 3, 4, 5], n_probs=1)
    f = final(probs=[TokenProb(10, -0.1, [(10, -0.1)]), TokenProb(11, -0.2, [(11, -0.2)])])
    out = native_final(ctx, f, req, 0, {"n_predict": -1}, return_tokens=True)
    assert list(out) == ["index", "content", "tokens", "id_slot", "stop", "model",
                         "tokens_predicted", "tokens_evaluated", "generation_settings",
                         "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
                         "tokens_cached", "timings", "completion_probabilities"]
    assert (out["content"], out["tokens"], out["stop"], out["model"], out["id_slot"]) == \
        ("Hi!\n", [10, 11], True, "smollm2", 1)
    assert (out["tokens_predicted"], out["tokens_evaluated"], out["tokens_cached"]) == (2, 5, 6)
    assert out["has_new_line"] is True and out["stop_type"] == "eos"
    assert set(out["timings"]) == TIMINGS_KEYS and out["timings"]["draft_n_accepted"] == 3
    assert len(out["completion_probabilities"]) == 2
    # the last stream event: the final object without the text already sent
    last = native_final(ctx, f, req, 0, {}, return_tokens=True, stream=True)
    assert (last["content"], last["tokens"], last["stop"]) == ("", [], True)
    part = native_partial(ctx, Chunk("Hi", [10], [TokenProb(10, -0.1, [])]), 0, 1, 5, n_probs=1)
    assert part == {"index": 0, "content": "Hi", "tokens": [10], "stop": False, "id_slot": -1,
                    "tokens_predicted": 1, "tokens_evaluated": 5,
                    "completion_probabilities": [token_prob_json(ctx.tokenizer,
                                                                 TokenProb(10, -0.1, []))]}


def test_oai_completion_shapes(ctx):
    out = oai_completion(ctx, [final("limit")])
    assert set(out) == {"choices", "created", "model", "system_fingerprint", "object", "usage",
                        "id", "timings"}
    assert out["object"] == "text_completion" and out["system_fingerprint"].startswith("b")
    assert out["choices"] == [{"text": "Hi!\n", "index": 0, "logprobs": None,
                               "finish_reason": "length"}]
    assert out["usage"] == USAGE
    chunk = oai_completion_chunk(ctx, Chunk("Hi", [10]), 0)
    assert chunk["choices"] == [{"text": "Hi", "index": 0, "logprobs": None,
                                 "finish_reason": None}]
    assert chunk["id"] == out["id"] and "usage" not in chunk
    last = oai_completion_final_chunk(ctx, final(), 0)
    assert last["choices"][0]["text"] == "" and last["choices"][0]["finish_reason"] == "stop"
    assert last["usage"] == USAGE and set(last["timings"]) == TIMINGS_KEYS


def test_usage_counts_a_prompt_once_for_n_choices(ctx):
    a, b = final(), final()
    out = chat_completion(ctx, [a, b], prompt_finals=[a])
    assert out["usage"] == {"completion_tokens": 4, "prompt_tokens": 5, "total_tokens": 9,
                            "prompt_tokens_details": {"cached_tokens": 2}}
    assert [c["index"] for c in out["choices"]] == [0, 1]


def test_chat_completion_shape(ctx):
    out = chat_completion(ctx, [final("word", probs=[TokenProb(10, -0.5, [(10, -0.5)])])],
                          logprobs=True)
    assert out["object"] == "chat.completion" and out["model"] == "smollm2"
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["index"] == 0
    assert choice["message"] == {"role": "assistant", "content": "Hi!\n"}
    assert list(choice["logprobs"]["content"][0]) == ["id", "token", "bytes", "logprob",
                                                      "top_logprobs"]
    assert out["usage"] == USAGE and set(out["timings"]) == TIMINGS_KEYS
    assert "logprobs" not in chat_completion(ctx, [final()])["choices"][0]


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_sequence(ctx, include_usage):
    items = [Chunk("Hi", [10]), Chunk("", []), Chunk("!\n", [11]), final("limit")]
    events = list(chat_stream_events(ctx, items, include_usage=include_usage))
    assert events[0]["choices"] == [{"finish_reason": None, "index": 0,
                                     "delta": {"role": "assistant", "content": None}}]
    contents = events[1:3]
    assert [e["choices"][0]["delta"] for e in contents] == [{"content": "Hi"},
                                                            {"content": "!\n"}]
    finish = events[3]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "length"
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == ctx.id for e in events)
    # timings only on the very last JSON event; a usage chunk has choices [] and both
    assert [("timings" in e) for e in events] == [False] * (len(events) - 1) + [True]
    if include_usage:
        assert len(events) == 5 and events[4]["choices"] == [] and events[4]["usage"] == USAGE
    else:
        assert len(events) == 4 and "usage" not in events[3]


# -- metrics ---------------------------------------------------------------------------------------

def metric_lines(text):
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_metrics_text_has_llamas_names_and_types():
    m = {"prompt_tokens_total": 10, "prompt_tokens_cached_total": 4,
         "prompt_seconds_total": 0.5, "tokens_predicted_total": 8,
         "tokens_predicted_seconds_total": 0.4, "n_decode_total": 9, "n_tokens_max": 33,
         "spec_decode_num_draft_tokens_total": 12, "spec_decode_num_accepted_tokens_total": 7,
         "spec_decode_num_drafts_total": 3, "spec_decode_num_accepted_tokens_per_pos": {},
         "requests_processing": 1, "requests_deferred": 0, "n_busy_slots_per_decode": 1.5}
    exporter = MetricsExporter(lambda: m)
    text = exporter.render().decode()
    values = metric_lines(text)
    counters = ["prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total",
                "tokens_predicted_total", "tokens_predicted_seconds_total", "n_decode_total",
                "n_tokens_max", "spec_decode_num_draft_tokens_total",
                "spec_decode_num_accepted_tokens_total", "spec_decode_num_drafts_total"]
    gauges = ["prompt_tokens_seconds", "predicted_tokens_seconds", "requests_processing",
              "requests_deferred", "n_busy_slots_per_decode"]
    for name in counters:
        assert f"# TYPE llamacpp:{name} counter\n" in text
        assert f"# HELP llamacpp:{name} " in text
        assert values[f"llamacpp:{name}"] == m[name]
    for name in gauges:
        assert f"# TYPE llamacpp:{name} gauge\n" in text
    assert set(values) == {f"llamacpp:{n}" for n in counters + gauges} | {
        "pyspec:draft_registry_size", "pyspec:decoded_ahead_steps_total",
        "pyspec:decoded_ahead_overruled_rows_total"}
    assert values["llamacpp:prompt_tokens_seconds"] == 20.0     # 10 tokens / 0.5 s
    assert values["llamacpp:predicted_tokens_seconds"] == 20.0  # 8 / 0.4
    assert values["llamacpp:n_busy_slots_per_decode"] == 1.5
    # throughput gauges cover only the window since the previous scrape
    m.update(prompt_tokens_total=30, prompt_seconds_total=1.5,
             spec_decode_num_accepted_tokens_per_pos={0: 5, 1: 2})
    text = exporter.render().decode()
    values = metric_lines(text)
    assert values["llamacpp:prompt_tokens_seconds"] == 20.0     # 20 / 1.0
    assert values["llamacpp:predicted_tokens_seconds"] == 0.0   # nothing new
    assert "# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter" in text
    assert values['llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] == 5
    assert values['llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"}'] == 2


# -- app routes that need no generation -----------------------------------------------------------

class NoGeneration:
    """What the routes below read from a ready Scheduler; submit must never be reached."""

    n_slots = 2
    n_ctx_slot = 256
    speculative = False

    def submit(self, req, stream=True):
        raise AssertionError("these tests must fail before generation")

    def slots(self):
        return [{"id": 0, "n_ctx": 256, "speculative": False, "is_processing": True},
                {"id": 1, "n_ctx": 256, "speculative": False, "is_processing": True}]


@pytest.fixture
def app_state(tok):
    state = {"scheduler": None}
    settings = AppSettings(model_name="smollm2", model_path="/x/model.gguf", tokenizer=tok,
                           chat_template=ChatTemplate.from_tokenizer(tok),
                           defaults=RequestDefaults(seed=42))
    return state, settings


def client(app_state, **changes):
    state, settings = app_state
    for k, v in changes.items():
        setattr(settings, k, v)
    return TestClient(create_app(settings, lambda: state["scheduler"]),
                      raise_server_exceptions=False)


def assert_error(r, code, type_, message=None):
    assert r.status_code == code
    err = r.json()["error"]
    assert (err["code"], err["type"]) == (code, type_)
    if message is not None:
        assert err["message"] == message


def test_loading_gate_then_ready(app_state):
    c = client(app_state)
    for path in ("/health", "/v1/health", "/v1/models", "/props"):
        assert_error(c.get(path), 503, "unavailable_error", "Loading model")
    assert_error(c.post("/completion", json={"prompt": "x"}), 503, "unavailable_error")
    app_state[0]["scheduler"] = NoGeneration()
    r = c.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert r.headers["server"] == "llama.cpp"
    assert r.headers["content-type"] == "application/json; charset=utf-8"


def test_unknown_path_and_bad_bodies(app_state):
    app_state[0]["scheduler"] = NoGeneration()
    c = client(app_state)
    assert_error(c.get("/nope"), 404, "not_found_error", "File Not Found")
    r = c.post("/completion", content=b"{not json")
    assert_error(r, 500, "server_error")
    assert r.json()["error"]["message"].startswith("[json.exception.parse_error.101] parse error")
    assert_error(c.post("/completion", json={"n_predict": 3}), 400, "invalid_request_error",
                 "key 'prompt' not found")
    assert_error(c.post("/v1/completions", json={"prompt": "x", "n_predict": -5}), 400,
                 "invalid_request_error",
                 "Field 'n_predict': Value must be between -1 <= value <= 2147483647, but got -5")
    assert_error(c.post("/v1/chat/completions", json={"prompt": "x"}), 400,
                 "invalid_request_error")
    assert_error(c.post("/chat/completions", json={"messages": USER_MSGS, "json_schema": {}}),
                 400, "invalid_request_error")
    assert_error(c.post("/completion", json={"prompt": "x", "n": 3}), 400,
                 "invalid_request_error")


USER_MSGS = [{"role": "user", "content": "Hi"}]


def test_api_key(app_state):
    app_state[0]["scheduler"] = NoGeneration()
    c = client(app_state, api_keys=["k1", "k2"])
    assert_error(c.get("/v1/models"), 401, "authentication_error", "Invalid API Key")
    assert_error(c.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401,
                 "authentication_error")
    assert c.get("/health").status_code == 200                      # public
    assert c.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200
    assert c.get("/v1/models", headers={"X-Api-Key": "k1"}).status_code == 200
    assert c.options("/v1/models").status_code == 200               # pre-flight bypasses


def test_cors(app_state):
    app_state[0]["scheduler"] = NoGeneration()
    c = client(app_state)
    r = c.options("/v1/chat/completions", headers={"Origin": "localhost"})
    assert r.status_code == 200 and r.content == b""
    assert r.headers["access-control-allow-origin"] == "localhost"
    assert r.headers["access-control-allow-credentials"] == "true"
    assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert r.headers["access-control-allow-headers"] == "*"
    r = c.get("/health", headers={"Origin": "http://example.com"})
    assert r.headers["access-control-allow-origin"] == "http://example.com"
    c = client(app_state, cors_origins="localhost")
    assert "access-control-allow-origin" not in c.get(
        "/health", headers={"Origin": "http://evil.com"}).headers
    assert c.get("/health", headers={"Origin": "http://localhost:8080"}).headers[
        "access-control-allow-origin"] == "http://localhost:8080"


def test_tokenize_detokenize_apply_template(app_state, tok):
    app_state[0]["scheduler"] = NoGeneration()
    c = client(app_state)
    ids = tok.encode("Hello <|im_start|>", add_special=False, parse_special=True)
    assert c.post("/tokenize", json={"content": "Hello <|im_start|>"}).json() == {"tokens": ids}
    assert c.post("/tokenize", json={}).json() == {"tokens": []}
    pieces = c.post("/tokenize", json={"content": "Hé", "with_pieces": True}).json()["tokens"]
    # a piece is its text, or its raw bytes when it is part of a UTF-8 character
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                   for p in pieces)
    assert raw == "Hé".encode() and [p["id"] for p in pieces] == tok.encode("Hé", False)
    assert all(set(p) == {"id", "piece"} for p in pieces)
    assert c.post("/detokenize", json={"tokens": ids}).json() == {"content": "Hello <|im_start|>"}
    assert_error(c.post("/detokenize", json={"tokens": [10 ** 8]}), 400, "invalid_request_error")
    r = c.post("/apply-template", json={"messages": USER_MSGS})
    assert r.json() == {"prompt": app_state[1].chat_template.render(USER_MSGS)}


def test_props_models_slots_metrics_switches(app_state):
    app_state[0]["scheduler"] = NoGeneration()
    c = client(app_state)
    props = c.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 256
    assert props["default_generation_settings"]["params"]["seed"] == 42
    assert (props["total_slots"], props["model_alias"], props["model_path"]) == \
        (2, "smollm2", "/x/model.gguf")
    models = c.get("/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "smollm2"
    assert models["data"][0]["owned_by"] == "llamacpp"
    assert models["data"][0]["meta"]["n_ctx"] == 256
    assert models["models"][0]["name"] == "smollm2"
    assert_error(c.post("/props", json={}), 501, "not_supported_error")
    assert_error(c.get("/metrics"), 501, "not_supported_error")
    assert c.get("/slots").json()[0]["id"] == 0
    assert_error(c.get("/slots?fail_on_no_slot=1"), 503, "unavailable_error")
    assert c.post("/props", json={}).status_code == 501
    c = client(app_state, enable_slots=False, enable_props=True)
    assert_error(c.get("/slots"), 501, "not_supported_error")
    assert c.post("/props", json={}).json() == {"success": True}


def test_metrics_route(app_state):
    sched = NoGeneration()
    sched.metrics = lambda: {"prompt_tokens_total": 3}
    app_state[0]["scheduler"] = sched
    c = client(app_state, enable_metrics=True)
    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == "text/plain; version=0.0.4"
    assert "llamacpp:prompt_tokens_total 3.0\n" in r.text


def test_features_we_do_not_have_answer_501(app_state):
    app_state[0]["scheduler"] = NoGeneration()
    c = client(app_state)
    for path in ("/embedding", "/embeddings", "/v1/embeddings", "/rerank", "/v1/rerank"):
        assert_error(c.post(path, json={"input": "x"}), 501, "not_supported_error")
    assert_error(c.post("/slots/0?action=save", json={"filename": "a.bin"}), 501,
                 "not_supported_error")


def test_api_key_any_offered_header_may_match(app_state):
    app_state[0]["scheduler"] = NoGeneration()
    c = client(app_state, api_keys=["k1"])
    assert c.get("/props", headers={"Authorization": "k1"}).status_code == 200  # no "Bearer "
    assert c.get("/props", headers={"X-Api-Key": "bad", "Authorization": "Bearer k1"}
                 ).status_code == 200


def test_an_unexpected_exception_is_a_500_json_error(app_state):
    class Broken(NoGeneration):
        def slots(self):
            raise RuntimeError("engine state unreadable")

    app_state[0]["scheduler"] = Broken()
    c = client(app_state)
    r = c.get("/slots")
    assert_error(r, 500, "server_error", "RuntimeError: engine state unreadable")
    assert r.headers["server"] == "llama.cpp"
