"""End-to-end checks on the real SmolLM2-135M-Instruct Q4_1 model against llama.cpp's numbers.

Reference values come from ../shared/data (README.md there says how they were measured).
"""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from default_model import require_default_model

require_default_model()

import pyspec  # noqa: E402
from pyspec import perplexity  # noqa: E402

DATA = Path(__file__).parents[2] / "shared/data"
EVAL_IDS = DATA / "eval_psf_license.ids.json"
GREEDY_REF = DATA / "smollm2_greedy_reference.json"

LLAMA_CPP_PPL = 11.6892
LLAMA_CPP_PPL_STDERR = 0.788
LLAMA_CPP_RUNNING = [9.5235, 16.4192, 13.8962, 12.9222, 13.2070, 12.4830, 11.6892]
N_COMPARE = 16
# The reference was decoded by llama.cpp with flash attention (its CPU default), which keeps Q and
# the V accumulation in F16; its own non-flash path leaves that reference at a step-9 near-tie
# of the "Once upon a time" prompt, and the two llama.cpp paths differ by up to ~1.2 in logits
# on these prompts. A 0.15 near-tie margin admits that rounding noise and nothing more: a real
# numeric bug moves logits by far more.
NEAR_TIE = 0.15
N_THREADS = 2


@pytest.fixture(scope="module")
def model():
    return pyspec.Model(pyspec.default_model_path(), n_threads=N_THREADS)


def test_perplexity_matches_llama_cpp(capsys):
    rc = perplexity.main(["--ids", str(EVAL_IDS), "-c", "512", "-t", str(N_THREADS)])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = [ln for ln in out.splitlines() if ln.strip()]

    running_line = next(ln for ln in lines if ln.startswith("[1]"))
    running = re.findall(r"\[(\d+)\](\d+\.\d{4}),", running_line)
    assert re.fullmatch(r"(\[\d+\]\d+\.\d{4},)+", running_line), running_line
    assert [int(i) for i, _ in running] == list(range(1, 8))
    for (_, ours), ref in zip(running, LLAMA_CPP_RUNNING):
        # Single chunks average fewer tokens than the final value, so allow a little more slack.
        assert float(ours) == pytest.approx(ref, rel=0.02), (running_line, LLAMA_CPP_RUNNING)

    assert re.fullmatch(r"Final estimate: PPL = \d+\.\d{4} \+/- \d+\.\d{5}", lines[-1]), lines[-1]
    m = re.fullmatch(r"Final estimate: PPL = (\S+) \+/- (\S+)", lines[-1])
    ppl, err = float(m.group(1)), float(m.group(2))
    assert ppl == pytest.approx(LLAMA_CPP_PPL, rel=0.01)
    assert float(running[-1][1]) == pytest.approx(ppl, abs=1e-4)
    assert err == pytest.approx(LLAMA_CPP_PPL_STDERR, rel=0.05)


def test_perplexity_stderr_formula():
    # Three NLLs 1, 2, 3: mean 2, population variance 2/3, stderr sqrt((2/3)/2) = 1/sqrt(3).
    ppl, err = perplexity.ppl_with_stderr(6.0, 14.0, 3)
    assert ppl == pytest.approx(np.exp(2.0))
    assert err == pytest.approx(np.exp(2.0) / np.sqrt(3.0))


def test_nll_is_float64_log_softmax():
    logits = np.array([[1000.0, 1000.0, 0.0], [0.0, 1e-7, -3.0]], dtype=np.float32)
    nll = perplexity.nll_of_next_tokens(logits, np.array([0, 2]))
    z = logits.astype(np.float64)
    expect0 = np.log(2.0 + np.exp(-1000.0))
    expect1 = -(z[1, 2] - np.log(np.exp(z[1]).sum()))
    assert nll.dtype == np.float64
    assert nll[0] == pytest.approx(expect0, rel=1e-12)
    assert nll[1] == pytest.approx(expect1, rel=1e-12)


@pytest.mark.parametrize("make_args, message", [
    (lambda tmp: ["--ids", str(tmp / "missing.json")], "not found"),
    (lambda tmp: ["--ids", str(_write(tmp, "bad.json", "[1, 2,"))], "not valid JSON"),
    (lambda tmp: ["--ids", str(_write(tmp, "obj.json", '{"a": 1}'))], "list of integer"),
    (lambda tmp: ["--ids", str(_write(tmp, "short.json", json.dumps(list(range(1023)))))],
     "at least 1024 tokens"),
    (lambda tmp: ["-f", str(_write(tmp, "t.txt", "hello"))], "got 1 in"),
    (lambda tmp: ["-f", str(tmp / "missing.txt")], "missing.txt' not found"),
    (lambda tmp: ["-f", str(_write(tmp, "t.txt", "hello")), "--ids", str(EVAL_IDS)], "not both"),
    (lambda tmp: ["--ids", str(EVAL_IDS), "-c", "zero"], "invalid int"),
    (lambda tmp: ["--ids", str(_write(tmp, "oov.json", json.dumps([49152] * 1024))), "-c", "512"],
     "outside the vocabulary"),
])
def test_perplexity_cli_errors(tmp_path, capsys, make_args, message):
    try:
        rc = perplexity.main(make_args(tmp_path))
    except SystemExit as exc:  # argparse rejects bad flags by exiting
        rc = exc.code
    captured = capsys.readouterr()
    assert rc == 1
    assert message in captured.err
    errors = [ln for ln in captured.err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and message in errors[0], captured.err
    assert "Traceback" not in captured.err
    assert captured.out == ""


def _write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


def _greedy_cases():
    cases = json.loads(GREEDY_REF.read_text())["cases"]
    return [pytest.param(c, id=c.get("prompt", "chat")[:24]) for c in cases if c.get("prompt_ids")]


@pytest.mark.parametrize("case", _greedy_cases())
def test_greedy_matches_llama_cpp(model, case):
    ref = case["greedy_ids"][:N_COMPARE]
    ctx = pyspec.Context(model, n_ctx=256, n_batch=64)
    logits = ctx.decode(case["prompt_ids"]).logits[-1]
    ours = []
    for step, want in enumerate(ref):
        got = int(np.argmax(logits))
        if got != want:
            # Allowed only as a near-tie that llama.cpp broke the other way: its token must be our
            # runner-up and the two logits must be within NEAR_TIE. Past it the texts diverge.
            top2 = np.argsort(logits)[::-1][:2]
            gap = float(logits[top2[0]] - logits[top2[1]])
            assert int(top2[1]) == want and gap < NEAR_TIE, (
                f"step {step}: pyspec chose {got}, llama.cpp {want}; pyspec top-2 {top2.tolist()} "
                f"gap {gap:.4f}; tokens so far {ours} vs {ref[:step]}")
            break
        ours.append(got)
        if step + 1 < len(ref):
            logits = ctx.decode([got]).logits[-1]

    # pyspec.generate is the public greedy loop: it must agree with the step-by-step decode.
    ctx.kv_clear()
    assert pyspec.generate(ctx, case["prompt_ids"], len(ours))[:len(ours)] == ours


def test_perplexity_batches_within_a_chunk(model):
    # -b smaller than the chunk splits it over several decode calls (the first one has no scored
    # rows); the cache carries the chunk across them, so the result must not change.
    ids = json.loads(EVAL_IDS.read_text())[:512]
    whole = perplexity.compute_perplexity(pyspec.Context(model, n_ctx=256, n_batch=256), ids, 256)
    split = perplexity.compute_perplexity(pyspec.Context(model, n_ctx=256, n_batch=100), ids, 256,
                                          n_batch=100)
    assert whole.n_scored == split.n_scored == 2 * 127
    assert split.running_ppl == pytest.approx(whole.running_ppl, rel=1e-5)
    assert split.ppl_stderr == pytest.approx(whole.ppl_stderr, rel=1e-4)
