"""POST /infill (pyspec/server/infill.py) against llama-server's layout (reference §1.12): the
prompt built from the parts, cut by the batch and context sizes, in PSM and SPM order, with and
without the repo-level tokens; 501 on a model without FIM tokens, 400 on bad fields; and a real
server answering /infill exactly as /completion answers the prompt built here by hand."""

import json

import gguf
import pytest

from default_model import require_default_model
from pyspec.server.infill import check_infill_support, infill_fields, infill_tokens
from pyspec.server.types import ServerError
from pyspec.tokenizer import Tokenizer
from server_process import ServerProcess
from test_speculative import Pairs, edit_gguf  # noqa: E402  (tests/ is on sys.path under pytest)

# SmolLM2 has no FIM tokens: three of its control tokens stand in for them.
PRE, SUF, MID, SEP = 6, 7, 8, 9
REP = 4  # "<reponame>": found by its text


@pytest.fixture(scope="module")
def meta():
    import pyspec
    return dict(pyspec._core.GgufFile(require_default_model()).metadata)


def smol_with(meta, **keys):
    return Tokenizer.from_metadata(dict(meta, **{f"tokenizer.ggml.{k}_token_id": v for k, v in keys.items()}))


def test_infill_needs_the_three_fim_tokens(meta):
    for keys, missing in (({}, "prefix"), (dict(fim_pre=PRE), "suffix"),
                          (dict(fim_pre=PRE, fim_suf=SUF), "middle")):
        with pytest.raises(ServerError) as e:
            check_infill_support(smol_with(meta, **keys))
        assert e.value.code == 501 and e.value.type == "not_supported_error"
        assert str(e.value) == f"Infill is not supported by this model: {missing} token is missing."
    check_infill_support(smol_with(meta, fim_pre=PRE, fim_suf=SUF, fim_mid=MID))


def test_infill_prompt_layout(meta):
    tok = smol_with(meta, fim_pre=PRE, fim_suf=SUF, fim_mid=MID)
    assert tok.fim_ids["fim_rep"] == REP and tok.fim_ids["fim_sep"] is None
    enc = lambda s: tok.encode(s, add_special=False)  # noqa: E731
    prefix, suffix, prompt = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n", "return"
    extra = [("util.py", "import math\n"), ("b.py", "x = 1\n")]
    big = dict(n_batch=2048, n_ctx=4096, n_predict=16)
    # no FIM separator: the chunks follow a snippet separator; the repo header from <reponame>
    got = infill_tokens(tok, prefix, suffix, extra, prompt, spm=False, **big)
    snippet = enc("\n\n--- snippet ---\n\n")
    want = ([REP] + enc("myproject\n") + snippet + enc("import math\n") + snippet + enc("x = 1\n")
            + [PRE] + enc(prefix) + [SUF] + enc(suffix) + [MID] + enc(prompt))
    assert got == want
    # SPM order: the suffix first
    got = infill_tokens(tok, prefix, suffix, [], prompt, spm=True, **big)
    assert got == [REP] + enc("myproject\n") + [SUF] + enc(suffix) + [PRE] + enc(prefix) + [MID] + enc(prompt)
    # a FIM separator: each chunk under its file name, then the current file's
    tok_sep = smol_with(meta, fim_pre=PRE, fim_suf=SUF, fim_mid=MID, fim_sep=SEP)
    got = infill_tokens(tok_sep, prefix, suffix, extra, "", spm=False, **big)
    assert got == ([REP] + enc("myproject\n") + [SEP] + enc("util.py\n") + enc("import math\n")
                   + [SEP] + enc("b.py\n") + enc("x = 1\n") + [SEP] + enc("filename\n")
                   + [PRE] + enc(prefix) + [SUF] + enc(suffix) + [MID])
    # BOS where the vocabulary adds it: after the extra context, before the FIM prefix
    tok_bos = Tokenizer.from_metadata(dict(meta, **{"tokenizer.ggml.add_bos_token": True,
                                                    "tokenizer.ggml.fim_pre_token_id": PRE,
                                                    "tokenizer.ggml.fim_suf_token_id": SUF,
                                                    "tokenizer.ggml.fim_mid_token_id": MID}))
    got = infill_tokens(tok_bos, prefix, suffix, [], "", spm=False, **big)
    assert got == [REP] + enc("myproject\n") + [tok_bos.bos_id, PRE] + enc(prefix) + [SUF] + enc(suffix) + [MID]


def test_infill_prompt_cuts(meta):
    """The prefix keeps its last 3/4 batch of tokens, the suffix its first (1/4 batch - 2 -
    prompt tokens), the extra context its last (n_ctx - n_batch - 2 n_predict)."""
    tok = smol_with(meta, fim_pre=PRE, fim_suf=SUF, fim_mid=MID)
    enc = lambda s: tok.encode(s, add_special=False)  # noqa: E731
    prefix = " ".join(f"a{i}" for i in range(40))
    suffix = " ".join(f"b{i}" for i in range(40))
    chunk = " ".join(f"c{i}" for i in range(40))
    p, s, c, pr = enc(prefix), enc(suffix), enc(chunk), enc(" go")
    extra_all = [REP] + enc("myproject\n") + enc("\n\n--- snippet ---\n\n") + c
    n_batch, n_ctx, n_predict = 32, 60, 5
    got = infill_tokens(tok, prefix, suffix, [("f", chunk)], " go", n_batch=n_batch, n_ctx=n_ctx,
                        n_predict=n_predict, spm=False)
    n_extra = n_ctx - n_batch - 2 * n_predict
    n_suf = n_batch // 4 - 2 - len(pr)
    assert len(p) > 24 and len(s) > n_suf and len(extra_all) > n_extra
    assert got == extra_all[-n_extra:] + [PRE] + p[-24:] + [SUF] + s[:n_suf] + [MID] + pr
    # no room: no suffix and no extra context at all
    got = infill_tokens(tok, prefix, suffix, [("f", chunk)], " go", n_batch=8, n_ctx=8,
                        n_predict=5, spm=False)
    assert got == [PRE] + p[-6:] + [SUF] + [MID] + pr


@pytest.mark.parametrize("body,message", [
    ({"input_suffix": "b"}, '"input_prefix" is required'),
    ({"input_prefix": "a"}, '"input_suffix" is required'),
    ({"input_prefix": 1, "input_suffix": "b"}, '"input_prefix" must be a string'),
    ({"input_prefix": "a", "input_suffix": "b", "input_extra": {"text": "x"}}, "input_extra"),
    ({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"text": 3}]}, "input_extra"),
    ({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"filename": 1}]}, "input_extra"),
    ({"input_prefix": "a", "input_suffix": "b", "input_extra": ["x"]}, "input_extra"),
    ({"input_prefix": "a", "input_suffix": "b", "prompt": [1, 2]}, '"prompt" must be a string'),
    ([1, 2], "JSON object"),
])
def test_infill_bad_fields_are_400(body, message):
    with pytest.raises(ServerError) as e:
        infill_fields(body)
    assert e.value.code == 400 and e.value.type == "invalid_request_error"
    assert message in str(e.value)


# --- a real server ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The tiny target served as it is (no FIM tokens) and with three of its tokens named the FIM
    prefix, suffix and middle (a random model: what it writes does not matter, only that /infill
    runs the prompt built here)."""
    root = tmp_path_factory.mktemp("infill")
    pairs = Pairs(root)
    fim = edit_gguf(pairs.target, root / "target-fim.gguf", keys={
        f"tokenizer.ggml.{k}_token_id": (v, gguf.GGUFValueType.UINT32)
        for k, v in (("fim_pre", 20), ("fim_suf", 21), ("fim_mid", 22))})
    plain = ServerProcess(["-m", pairs.target, "-np", "1", "-c", "512", "-t", "1"])
    with_fim = ServerProcess(["-m", str(fim), "-np", "1", "-c", "512", "-t", "1", "-b", "64"])
    yield plain, with_fim
    plain.stop()
    with_fim.stop()


def test_infill_on_a_server(servers):
    plain, srv = servers
    body = {"input_prefix": "def f(x):\n    return", "input_suffix": "\nprint(f(2))\n",
            "input_extra": [{"filename": "a.py", "text": "y = 3\n"}], "prompt": " x",
            "n_predict": 6, "temperature": 0}
    r = plain.post("/infill", body)
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    assert "prefix token is missing" in r.json()["error"]["message"]

    def tokens(text):
        r = srv.post("/tokenize", {"content": text})
        assert r.status_code == 200
        return r.json()["tokens"]

    # llama-server's layout, by hand: no repo or file-separator tokens in this vocabulary
    want = (tokens("\n\n--- snippet ---\n\n") + tokens("y = 3\n") + [20] + tokens(body["input_prefix"])
            + [21] + tokens(body["input_suffix"]) + [22] + tokens(" x"))
    got = srv.post("/infill", body)
    assert got.status_code == 200, got.text
    ref = srv.post("/completion", {"prompt": want, "n_predict": 6, "temperature": 0})
    assert ref.status_code == 200
    g, w = got.json(), ref.json()
    assert g["tokens_evaluated"] == w["tokens_evaluated"] == len(want)
    assert g["content"] == w["content"] and g["tokens_predicted"] == 6
    for bad in ({"input_suffix": "x"}, dict(body, input_extra="x")):
        r = srv.post("/infill", bad)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # streamed: the same content
    r = srv.post("/infill", dict(body, stream=True))
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.content.decode("utf-8").splitlines()
              if line.startswith("data: {")]
    assert "".join(e.get("content", "") for e in events) == w["content"]
