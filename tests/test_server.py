"""`pyspec-server` as a real process on 127.0.0.1 (issue 7's checks):

- the `openai` client: chat and completions, streamed and not (SmolLM2);
- 8 concurrent greedy requests with a drafter give exactly the content and draft_n_accepted of
  the same 8 requests sent one at a time (tiny known-acceptance pair, acceptance far from 0);
- a table of bad input, each with llama-server's status code and error type, and the server
  still serving afterwards; the API key;
- a stream cancelled mid-way leaves its slot idle (/slots) and no drafter state behind;
- /metrics counters move by the amounts the requests' timings report.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

import pyspec  # noqa: E402
from server_process import ServerProcess
from test_speculative import Pairs  # noqa: E402  (tests/ is on sys.path under pytest)

N_SLOTS = 8
PROMPTS = [[7 + 5 * i, 9 + i, 11] for i in range(N_SLOTS)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pairs = Pairs(tmp_path_factory.mktemp("server"))
    target, drafter, _, _, _ = pairs.known_acceptance(0.7, True, seed=3)
    srv = ServerProcess(["-m", target, "-md", drafter, "-np", str(N_SLOTS), "-c",
                         str(256 * N_SLOTS), "--spec-draft-n-max", "5", "--metrics", "-t", "2",
                         "--temp", "0"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory):
    """The tiny pair with room for long generations: a cancelled stream must still be running
    when the server notices its client is gone (the tiny pair decodes ~9k tokens/s)."""
    pairs = Pairs(tmp_path_factory.mktemp("server-long"))
    target, drafter, _, _, _ = pairs.known_acceptance(0.7, True, seed=3)
    srv = ServerProcess(["-m", target, "-md", drafter, "-np", "2", "-c", str(2 * 16384),
                         "--spec-draft-n-max", "5", "--metrics", "-t", "2", "--temp", "0"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def smol():
    srv = ServerProcess(["-np", "2", "-c", "1024", "-t", "2", "--metrics"])
    yield srv
    srv.stop()


def metrics(srv) -> dict:
    r = srv.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for line in r.text.splitlines():
        m = re.match(r"^(llamacpp:[a-z_]+|pyspec:[a-z_]+)(\{[^}]*\})? ([-+0-9.eE]+|NaN)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def complete(srv, prompt, n=40, **kw):
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True}
    r = srv.post("/completion", dict(body, **kw))
    assert r.status_code == 200, r.text
    return r.json()


# --- OpenAI clients ----------------------------------------------------------------------------

def test_openai_client_chat_and_completions(smol):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=smol.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model="any", messages=messages, max_tokens=16,
                                          temperature=0)
    text = chat.choices[0].message.content
    assert text and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 16 or chat.choices[0].finish_reason == "stop"
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    stream = client.chat.completions.create(model="any", messages=messages, max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0

    cmpl = client.completions.create(model="any", prompt="The capital of France is",
                                     max_tokens=12, temperature=0)
    assert cmpl.choices[0].text and cmpl.object == "text_completion"
    streamed = client.completions.create(model="any", prompt="The capital of France is",
                                         max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cmpl.choices[0].text


# --- concurrency with a drafter ---------------------------------------------------------------

def test_concurrent_requests_equal_sequential_with_drafter(tiny):
    alone = [complete(tiny, p) for p in PROMPTS]
    with ThreadPoolExecutor(N_SLOTS) as pool:
        together = list(pool.map(lambda p: complete(tiny, p), PROMPTS))
    for a, b in zip(alone, together):
        assert b["content"] == a["content"]
        assert b["tokens_predicted"] == a["tokens_predicted"] == 40
        assert b["timings"]["draft_n_accepted"] == a["timings"]["draft_n_accepted"]
        assert b["timings"]["draft_n"] == a["timings"]["draft_n"]
    accepted = sum(a["timings"]["draft_n_accepted"] for a in alone)
    drafted = sum(a["timings"]["draft_n"] for a in alone)
    assert accepted / drafted > 0.3  # the pair's acceptance is far from 0
    # They did run concurrently: more than one slot was used.
    assert len({b["id_slot"] for b in together}) > 1


def test_ngram_simple_without_a_drafter(tmp_path_factory, tiny):
    """--spec-type ngram-simple alone: the same greedy content as the drafter's server (both equal
    plain greedy), concurrent = one at a time, and the looked-up drafts are counted in timings."""
    pairs = Pairs(tmp_path_factory.mktemp("server-ngram"))
    target, _, _, _, _ = pairs.known_acceptance(0.7, True, seed=3)
    srv = ServerProcess(["-m", target, "--spec-type", "ngram-simple", "--spec-ngram-size-n", "2",
                         "-np", "4", "-c", "1024", "-t", "2", "--temp", "0"])
    try:
        alone = [complete(srv, p, n=60) for p in PROMPTS[:4]]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda p: complete(srv, p, n=60), PROMPTS[:4]))
        for a, b, ref in zip(alone, together, [complete(tiny, p, n=60) for p in PROMPTS[:4]]):
            assert a["content"] == b["content"] == ref["content"]
            assert a["timings"].get("draft_n") == b["timings"].get("draft_n")
        drafted = sum(a["timings"].get("draft_n", 0) for a in alone)
        accepted = sum(a["timings"].get("draft_n_accepted", 0) for a in alone)
        assert drafted > 0 and accepted > 0.5 * drafted   # the tiny target's greedy output cycles
        # /slots tells the lookups' part: here all of it.
        stats = [s["speculative_stats"] for s in srv.get("/slots").json() if "speculative_stats" in s]
        assert stats and all(x["ngram_draft_n"] == x["draft_n"] for x in stats)
        assert sum(x["ngram_rounds"] for x in stats) > 0
    finally:
        srv.stop()


def test_slots_show_acceptance(tiny):
    complete(tiny, PROMPTS[0], id_slot=3)
    slots = tiny.get("/slots").json()
    assert len(slots) == N_SLOTS and all(s["n_ctx"] == 256 for s in slots)
    s3 = slots[3]
    assert s3["speculative"] and not s3["is_processing"]
    st = s3["speculative_stats"]
    assert st["draft_n"] > 0 and 0 < st["acceptance_rate"] <= 1


# --- bad input --------------------------------------------------------------------------------

BAD = [
    ("invalid JSON", "/completion", b"{not json", 500, "server_error"),
    ("chat without messages", "/v1/chat/completions", {"max_tokens": 4}, 400,
     "invalid_request_error"),
    ("messages not a list", "/v1/chat/completions", {"messages": "hi"}, 400,
     "invalid_request_error"),
    ("completion without prompt", "/completion", {"n_predict": 4}, 400, "invalid_request_error"),
    ("wrong type", "/completion", {"prompt": "a", "n_predict": "many"}, 400,
     "invalid_request_error"),
    ("wrong temperature type", "/v1/completions", {"prompt": "a", "temperature": [1]}, 400,
     "invalid_request_error"),
    ("prompt longer than the slot", "/completion", {"prompt": [5] * 300, "n_predict": 4}, 400,
     "exceed_context_size_error"),
    ("negative n_predict", "/completion", {"prompt": "a", "n_predict": -5}, 400,
     "invalid_request_error"),
    ("json_schema", "/completion", {"prompt": "a", "json_schema": {"type": "object"}}, 400,
     "invalid_request_error"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(tiny, case):
    _, path, body, status, etype = case
    if isinstance(body, bytes):
        r = requests.post(tiny.url + path, data=body, timeout=30,
                          headers={"Content-Type": "application/json"})
    else:
        r = tiny.post(path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == etype and err["code"] == status and err["message"]
    if etype == "exceed_context_size_error":
        assert err["n_prompt_tokens"] == 300 and err["n_ctx"] == 256
    # The server keeps serving.
    assert complete(tiny, PROMPTS[1], n=4)["tokens_predicted"] == 4


def test_unknown_endpoint(tiny):
    r = tiny.get("/no/such/thing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_api_key(tmp_path_factory):
    srv = ServerProcess(["-np", "1", "-c", "512", "-t", "1", "--api-key", "s3cret"])
    try:
        assert srv.get("/health").status_code == 200
        r = srv.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert srv.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert srv.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert srv.get("/v1/models", headers={"X-Api-Key": "s3cret"}).status_code == 200
    finally:
        srv.stop()


# --- a client that goes away ------------------------------------------------------------------

def test_cancelled_stream_frees_slot_and_draft_state(tiny_long):
    tiny = tiny_long
    with requests.post(tiny.url + "/completion", stream=True, timeout=60,
                       json={"prompt": PROMPTS[2], "n_predict": 16000, "temperature": 0,
                             "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                json.loads(line[6:])
                events += 1
                if events == 3:
                    break
    # The connection is closed: the slot is released at the next step.
    deadline = time.time() + 30
    while time.time() < deadline:
        busy = [s["id"] for s in tiny.get("/slots").json() if s["is_processing"]]
        if not busy:
            break
        time.sleep(0.05)
    assert not busy
    m = metrics(tiny)
    assert m["pyspec:draft_registry_size"] == 0
    assert m["llamacpp:requests_processing"] == 0
    # It was a cancellation, not a request that ran to its end.
    assert "cancelled (client gone)" in tiny.output()


# --- metrics ----------------------------------------------------------------------------------

def test_metrics_move_by_the_requests(tiny):
    before = metrics(tiny)
    done = [complete(tiny, p, n=20 + 5 * i) for i, p in enumerate(PROMPTS[:3])]
    after = metrics(tiny)

    def moved(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    t = [d["timings"] for d in done]
    assert moved("llamacpp:prompt_tokens_total") == sum(x["prompt_n"] for x in t)
    assert moved("llamacpp:tokens_predicted_total") == sum(x["predicted_n"] for x in t) == 75
    assert moved("llamacpp:spec_decode_num_draft_tokens_total") == sum(x["draft_n"] for x in t)
    assert moved("llamacpp:spec_decode_num_accepted_tokens_total") == sum(
        x["draft_n_accepted"] for x in t)
    assert moved("llamacpp:n_decode_total") > 0
    assert after["llamacpp:requests_processing"] == 0
    per_pos = sum(v for k, v in after.items()
                  if k.startswith("llamacpp:spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == after["llamacpp:spec_decode_num_accepted_tokens_total"]


def test_the_default_model_drafts_with_its_embedded_drafter(smol):
    """No -m: the embedded DSpark drafter drafts for greedy requests (timings.draft_n, the same
    text as plain decoding) and for sampled ones (llama-server's default chain at T 0.8, where it
    measured x0.99-1.30 after the host sampling work)."""
    if pyspec.model.default_drafter_path() is None:
        pytest.skip("this install has no embedded drafter")
    if not pyspec.model.embedded_drafter_by_default("cpu"):
        pytest.skip("the embedded drafter is off by default with this CPU's kernels")
    prompt = "The three primary colours are"
    greedy = complete(smol, prompt, n=24)
    assert greedy["timings"].get("draft_n", 0) > 0, greedy["timings"]
    plain = pyspec.LLM(n_ctx=256, n_threads=1).generate(prompt, max_tokens=24, temperature=0,
                                                         ignore_eos=True)
    assert greedy["content"] == plain
    sampled = complete(smol, prompt, n=24, temperature=0.8, seed=7)
    assert sampled["timings"].get("draft_n", 0) > 0, sampled["timings"]
    assert smol.get("/slots").json()[0]["speculative"] is True


# --- prompt cache (cache_prompt) --------------------------------------------------------------

def test_chat_turns_reuse_the_slot_cache(smol):
    """The second turn's prompt extends the first exchange: it lands in the slot holding it
    (longest cached prefix), decodes only the new part (timings.cache_n > 0, prompt_n = the
    rest, usage cached_tokens), and answers exactly as without the cache; /metrics count the
    reused tokens in prompt_tokens_cached_total and the decoded ones in prompt_tokens_total."""
    def chat(messages, **kw):
        r = smol.post("/v1/chat/completions", dict({"messages": messages, "max_tokens": 12,
                                                    "temperature": 0}, **kw))
        assert r.status_code == 200, r.text
        return r.json()

    turn1 = [{"role": "user", "content": "Name three colours of the rainbow."}]
    first = chat(turn1)
    turn2 = turn1 + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And two more?"}]
    before = metrics(smol)
    second = chat(turn2)
    after = metrics(smol)
    t = second["timings"]
    assert t["cache_n"] >= first["usage"]["prompt_tokens"] - 1 > 0
    assert t["prompt_n"] == second["usage"]["prompt_tokens"] - t["cache_n"] > 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == t["cache_n"]
    assert (after["llamacpp:prompt_tokens_cached_total"]
            - before["llamacpp:prompt_tokens_cached_total"]) == t["cache_n"]
    assert (after["llamacpp:prompt_tokens_total"]
            - before["llamacpp:prompt_tokens_total"]) == t["prompt_n"]
    slot = [s for s in smol.get("/slots").json() if s.get("id_task") is not None
            and s["n_prompt_tokens"] == second["usage"]["prompt_tokens"]]
    assert slot and slot[0]["n_prompt_tokens_cache"] == t["cache_n"]
    # Without the cache: the same answer, every prompt token decoded, nothing counted as cached.
    before = after
    uncached = chat(turn2, cache_prompt=False)
    after = metrics(smol)
    assert uncached["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
    assert uncached["timings"]["cache_n"] == 0
    assert uncached["timings"]["prompt_n"] == second["usage"]["prompt_tokens"]
    assert (after["llamacpp:prompt_tokens_cached_total"]
            == before["llamacpp:prompt_tokens_cached_total"])
    # ... and the slot it ran in kept nothing: the same request again reuses nothing there, or
    # goes to the other slot, whose cache (the first exchange) covers part of it.
    again = chat(turn2)
    assert again["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]


def test_completion_reuses_the_whole_prompt(tiny):
    """/completion twice with one prompt (pinned slot): all but the last prompt token come from
    the cache the first request left, and the output is the same."""
    prompt = [40, 41, 42, 43, 44, 45, 46, 47]
    a = complete(tiny, prompt, n=10, id_slot=5)
    b = complete(tiny, prompt, n=10, id_slot=5)
    assert b["timings"]["cache_n"] == len(prompt) - 1 and b["timings"]["prompt_n"] == 1
    assert b["content"] == a["content"]
    assert b["tokens_cached"] == len(prompt) + b["tokens_predicted"] - 1
    c = complete(tiny, prompt, n=10, id_slot=5, cache_prompt=False)
    assert c["timings"]["cache_n"] == 0 and c["content"] == a["content"]
