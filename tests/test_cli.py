"""`pyspec-cli` as a user runs it: a subprocess on SmolLM2 (greedy), plus its error paths."""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from default_model import require_default_model

require_default_model()

import pyspec  # noqa: E402
from pyspec import cli  # noqa: E402
from conftest import subprocess_env  # noqa: E402

NEUTRAL_CWD = tempfile.gettempdir()
DATA = Path(__file__).resolve().parents[2] / "shared/data"
CASES = json.loads((DATA / "smollm2_greedy_reference.json").read_text())["cases"]
FRANCE = CASES[0]
N_EXACT = 4     # leading greedy tokens every reference case shares with llama.cpp (see test_llm)
# Plain decoding (the default model otherwise speculates with its embedded drafter; tested below).
BASE = ["-t", "2", "-c", "256", "--temp", "0", "--spec-type", "none"]


def run_cli(*args, stdin=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "pyspec.cli", *args], input=stdin, cwd=NEUTRAL_CWD,
                          env=subprocess_env(), capture_output=True, text=True, encoding="utf-8",
                          timeout=timeout)


@pytest.fixture(scope="module")
def llm():
    return pyspec.LLM(n_ctx=256, n_threads=2)


def test_prompt_is_echoed_then_the_greedy_continuation(llm):
    r = run_cli("-p", FRANCE["prompt"], "-n", "16", *BASE)
    assert r.returncode == 0, r.stderr
    expected = llm.generate(FRANCE["prompt"], max_tokens=16, temperature=0)
    assert r.stdout == FRANCE["prompt"] + expected + "\n"
    reference = llm.detokenize(FRANCE["greedy_ids"][:N_EXACT], continuation=True)
    assert r.stdout.startswith(FRANCE["prompt"] + reference)
    # Logs and llama.cpp-style perf lines go to stderr.
    assert re.search(r"prompt eval time = +[\d.]+ ms / +5 tokens \( *[\d.]+ ms per token, +[\d.]+ "
                     r"tokens per second\)", r.stderr), r.stderr
    assert re.search(r" eval time = +[\d.]+ ms / +15 runs +\( *[\d.]+ ms per token, +[\d.]+ "
                     r"tokens per second\)", r.stderr), r.stderr
    assert "sampler seed: " in r.stderr and "stopped by token limit" in r.stderr


def test_warmup_runs_unless_turned_off_and_changes_no_text(llm):
    """llama-cli's warmup run (default on, --no-warmup off): a throwaway generation before the
    prompt's; the text is the same either way."""
    warm = run_cli("-p", FRANCE["prompt"], "-n", "8", *BASE)
    cold = run_cli("-p", FRANCE["prompt"], "-n", "8", "--no-warmup", *BASE)
    assert warm.returncode == 0 and cold.returncode == 0, (warm.stderr, cold.stderr)
    assert re.search(r"main: warmup [\d.]+ s", warm.stderr), warm.stderr
    assert "main: warmup" not in cold.stderr
    assert warm.stdout == cold.stdout and warm.stdout.startswith(FRANCE["prompt"])


def test_the_default_model_speculates_with_its_embedded_drafter(llm):
    """No -m: the embedded DSpark drafter drafts (2 per round), the greedy text is plain
    decoding's, and the perf lines report the prompt and the acceptance; sampling drafts too;
    --spec-type none turns it off."""
    if pyspec.model.default_drafter_path() is None:
        pytest.skip("this install has no embedded drafter")
    if not pyspec.model.embedded_drafter_by_default("cpu"):
        pytest.skip("the embedded drafter is off by default with this CPU's kernels")
    r = run_cli("-p", FRANCE["prompt"], "-n", "16", *BASE[:-2])
    assert r.returncode == 0, r.stderr
    assert r.stdout == FRANCE["prompt"] + llm.generate(FRANCE["prompt"], max_tokens=16, temperature=0) + "\n"
    assert "embedded drafter" in r.stderr and "up to 2 drafts per round" in r.stderr, r.stderr
    assert re.search(r"prompt eval time = +[\d.]+ ms / +5 tokens", r.stderr), r.stderr
    m = re.search(r"draft acceptance = [\d.]+ \((\d+) accepted / (\d+) generated\), mean len = "
                  r"([\d.]+) over (\d+) rounds", r.stderr)
    assert m, r.stderr
    accepted, drafted, rounds = int(m[1]), int(m[2]), int(m[4])
    assert 0 < drafted <= 2 * rounds and rounds + accepted >= 16
    # Speculating, the eval line counts the tokens the rounds produced, so its rates are per token;
    # the first token came from the prompt's pass, as in plain decoding.
    assert re.search(r" eval time = +[\d.]+ ms / +15 tokens +\( *[\d.]+ ms per token, +[\d.]+ "
                     r"tokens per second\)", r.stderr), r.stderr
    off = run_cli("-p", FRANCE["prompt"], "-n", "16", *BASE)
    assert off.returncode == 0 and off.stdout == r.stdout
    assert "draft acceptance" not in off.stderr and "embedded drafter" not in off.stderr
    # Sampling speculates too (llama-cli's default chain at T 0.8).
    sampled = run_cli("-p", FRANCE["prompt"], "-n", "16", "-t", "2", "-c", "256", "--temp", "0.8", "-s", "3")
    assert sampled.returncode == 0, sampled.stderr
    assert "embedded drafter" in sampled.stderr and "draft acceptance" in sampled.stderr, sampled.stderr
    # More drafts than the drafter's block holds: clamped (as llama.cpp), and the log says so.
    block = pyspec.LLM(draft_model=pyspec.model.default_drafter_path(), n_ctx=64).speculative.drafter.n_draft_max
    wide = run_cli("-p", FRANCE["prompt"], "-n", "4", "--draft-max", str(block + 3), *BASE[:-2])
    assert wide.returncode == 0, wide.stderr
    assert (f"up to {block} drafts per round (--draft-max {block + 3} clamped to the drafter's block)"
            in wide.stderr), wide.stderr


def test_the_embedded_drafter_stays_off_where_it_does_not_pay(llm, monkeypatch, capsys):
    """Where the embedded drafter was measured slower than plain decoding (the GPU, CPUs whose
    quantized kernels have no VNNI: pyspec.model.embedded_drafter_by_default), the
    default model decodes plainly unless speculation is asked for (--spec-type draft-dspark,
    --draft-max, ...); the same text either way. Played on this CPU by declaring no kernels the
    drafter pays with."""
    if pyspec.model.default_drafter_path() is None:
        pytest.skip("this install has no embedded drafter")
    isa = pyspec._core.kernels.isa()
    assert pyspec.model.embedded_drafter_by_default("cpu") == (isa in ("avx512vnni", "avx2+vnni"))
    assert not pyspec.model.embedded_drafter_by_default("cuda")
    monkeypatch.setattr(pyspec.model, "EMBEDDED_DRAFTER_CPU_KERNELS", ())
    assert not pyspec.model.embedded_drafter_by_default("cpu")
    args = ["-p", FRANCE["prompt"], "-n", "12", "-t", "2", "-c", "256", "--temp", "0"]
    assert cli.main(args) == 0
    held = capsys.readouterr()
    assert f"speculative decoding: off on CPU ({isa} kernels) by default" in held.err, held.err
    assert "draft acceptance" not in held.err and "embedded drafter '" not in held.err
    for asked in (["--spec-type", "draft-dspark"], ["--draft-max", "3"]):
        assert cli.main(args + asked) == 0
        on = capsys.readouterr()
        assert "embedded drafter" in on.err and "draft acceptance" in on.err, on.err
        assert on.out == held.out
    assert held.out == FRANCE["prompt"] + llm.generate(FRANCE["prompt"], max_tokens=12, temperature=0) + "\n"


def test_no_display_prompt_and_prompt_file(llm, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(FRANCE["prompt"] + "\n", encoding="utf-8")   # final newline dropped
    r = run_cli("-f", str(prompt_file), "-n", "8", "--no-display-prompt", *BASE)
    assert r.returncode == 0, r.stderr
    assert r.stdout == llm.generate(FRANCE["prompt"], max_tokens=8, temperature=0) + "\n"


def test_conversation_mode_reads_stdin_until_exit(llm):
    r = run_cli("-cnv", "-n", "12", *BASE, stdin="hello\n/exit\n")
    assert r.returncode == 0, r.stderr
    reply = llm.chat([{"role": "user", "content": "hello"}], max_tokens=12, temperature=0)
    assert reply and r.stdout == "\n> " + reply + "\n" + "\n> "
    assert "Traceback" not in r.stderr


def test_chat_alias_system_prompt_first_message_and_eof(llm):
    messages = [{"role": "system", "content": "You are a pirate."},
                {"role": "user", "content": "What is 2+2?"}]
    r = run_cli("--chat", "-sys", messages[0]["content"], "-p", messages[1]["content"],
                "-n", "10", *BASE, stdin="")
    assert r.returncode == 0, r.stderr
    reply = llm.chat(messages, max_tokens=10, temperature=0)
    # The -p message is shown as the user's turn, then the reply; EOF at the next prompt ends it.
    assert r.stdout == "> What is 2+2?\n" + reply + "\n" + "\n> " + "\n"


def test_chat_template_file_is_used(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}"
                        "{{ raise_exception('custom template: ' + m.content) }}{% endfor %}",
                        encoding="utf-8")
    r = run_cli("-cnv", "--chat-template-file", str(template), *BASE, stdin="hi\n")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == "error: custom template: hi"
    assert "Traceback" not in r.stderr and "Traceback" not in r.stderr


def test_ctrl_c_stops_generation_cleanly():
    proc = subprocess.Popen([sys.executable, "-m", "pyspec.cli", "-p", "Hello", "-n", "-1",
                             "--ignore-eos", "-t", "2", "-c", "2048"], cwd=NEUTRAL_CWD, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.read(len("Hello") + 1)[:5] == b"Hello"    # generation has begun
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode()
    assert proc.returncode == cli.EXIT_INTERRUPTED, err
    assert "stopped by interrupted" in err and "eval time" in err and "Traceback" not in err


def _main(argv, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as exc:       # argparse exits on bad flags
        rc = exc.code
    return rc, capsys.readouterr()


@pytest.mark.parametrize("argv, code, message", [
    (["-m", "/nonexistent/model.gguf", "-p", "hi"], 1,
     "error: model file '/nonexistent/model.gguf' not found"),
    (["-p", "hi", "--top-k", "many"], 2, "argument --top-k: invalid int value: 'many'"),
    (["-p", "hi", "--bogus"], 2, "unrecognized arguments: --bogus"),
    (["-f", "/nonexistent/prompt.txt"], 1,
     "error: prompt file '/nonexistent/prompt.txt' not found"),
    (["-p", "hi", "-n", "-5"], 1, "error: --n-predict must be -1"),
    (["-p", "hi", "--top-p", "2"], 1, "error: top_p must be in [0, 1]"),
    (["-p", "hi", "-f", "x.txt"], 1, "error: give the prompt with -p or -f, not both"),
])
def test_bad_flags_and_files_give_one_clear_message(argv, code, message, capsys):
    rc, captured = _main(argv, capsys)
    assert rc == code
    assert message in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_bad_model_and_template_files(tmp_path, capsys):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("this is not a GGUF file")
    rc, captured = _main(["-m", str(not_gguf), "-p", "hi"], capsys)
    assert rc == 1 and f"error: failed to load model '{not_gguf}'" in captured.err
    rc, captured = _main(["-cnv", "--chat-template-file", str(tmp_path / "none.jinja"), "-t", "2"],
                         capsys)
    assert rc == 1 and "error: cannot read chat template file" in captured.err
    rc, captured = _main(["-cnv", "--chat-template", "{% for %}", "-t", "2"], capsys)
    assert rc == 1 and "error: chat template (custom) has a syntax error" in captured.err
    assert "Traceback" not in captured.err
