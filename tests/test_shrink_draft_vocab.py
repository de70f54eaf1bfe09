"""tools/shrink_draft_vocab.py: a DSpark drafter's draft vocabulary cut to the ids its target
generates most, with the embedded SmolLM2 and its shipped drafter.

- The ranking: generated counts first, then prompt counts, then the smaller id; end ids always
  kept; positions come back ascending (d2t stays ascending).
- The cut file: d2t and the output head's and markov_w2's rows at the kept positions, byte for
  byte; every other tensor and key unchanged; it loads as a drafter.
- Behaviour: dropping an id the drafter never drafted in a run leaves that run's drafts, accepted
  counts and tokens unchanged (the kept rows stay aligned with their ids); the tool end to end
  keeps the end ids and reports what the kept ids cover.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

import pyspec
from pyspec import _core

from default_model import require_default_model  # noqa: E402
from conftest import run_requests  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import shrink_draft_vocab as shrink  # noqa: E402

MODEL = require_default_model()
DRAFTER = str(Path(pyspec.__file__).parent / "data" / "SmolLM2-135M-Instruct-DSpark.Q4_1.gguf")


def tensors(path):
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def test_ranking_orders_by_generated_then_prompt_counts_then_id():
    d2t = np.array([2, 5, 7, 9, 11])
    gen = np.zeros(16, np.int64)
    prm = np.zeros(16, np.int64)
    gen[[5, 9, 11]] = [3, 3, 1]
    prm[[9, 2, 7]] = [1, 4, 4]
    # 5 and 9 tie on generation, 9 wins by the prompt; 11 next; 2 and 7 tie on both: 2 first.
    assert shrink.kept_positions(d2t, gen, prm, set(), 3).tolist() == [1, 3, 4]
    assert shrink.kept_positions(d2t, gen, prm, set(), 4).tolist() == [0, 1, 3, 4]
    # An end id is kept whatever its counts.
    assert shrink.kept_positions(d2t, gen, prm, {7}, 2).tolist() == [2, 3]


def _drafts(drafter_path):
    model = _core.Model(MODEL)
    dm = _core.DraftModel(drafter_path, model)
    e = _core.SpecEngine(model, dm, n_ctx=512, n_seq_max=1, n_threads=2, draft_n_max=3)
    e.add_request(1, [1, 504, 3458, 314, 2, 1069, 48], max_tokens=40, verify="greedy")
    run = run_requests(e)[1]
    return run.tokens, run.blocks, run.stats["draft_n_accepted"]


def test_cut_rows_keep_their_ids(tmp_path):
    want_tokens, want_blocks, want_acc = _drafts(DRAFTER)
    src = tensors(DRAFTER)
    d2t = np.array(src["d2t"].data, np.int64)
    drafted = {t for b in want_blocks for t in b}
    # Drop four ids the run never drafted, among them the first and the last (the edges of
    # the row arithmetic).
    unused = [i for i, t in enumerate(d2t.tolist()) if t not in drafted]
    drop = {unused[0], unused[1], unused[len(unused) // 2], unused[-1]}
    keep = np.array([i for i in range(len(d2t)) if i not in drop])
    out = str(tmp_path / "cut.gguf")
    shrink.write_cut(DRAFTER, out, keep)
    got = tensors(out)
    assert np.array_equal(np.array(got["d2t"].data), d2t[keep])
    for name in shrink.CUT_ROWS:
        rows = np.array(src[name].data).reshape(int(src[name].shape[1]), -1)
        assert np.array_equal(np.array(got[name].data).reshape(len(keep), -1), rows[keep]), name
        assert got[name].tensor_type == src[name].tensor_type
    for name, t in src.items():
        if name not in shrink.CUT_ROWS and name != "d2t":
            assert np.array_equal(np.array(got[name].data), np.array(t.data)), name
    r0, r1 = gguf.GGUFReader(DRAFTER), gguf.GGUFReader(out)
    keys = [k for k in r0.fields if not k.startswith("GGUF.")]
    assert keys == [k for k in r1.fields if not k.startswith("GGUF.")]
    assert all(r0.fields[k].contents() == r1.fields[k].contents() for k in keys)
    tokens, blocks, acc = _drafts(out)
    assert (tokens, blocks, acc) == (want_tokens, want_blocks, want_acc)


def test_the_tool_end_to_end(tmp_path, capsys):
    out = str(tmp_path / "small.gguf")
    assert shrink.main(["--drafter", DRAFTER, "--out", out, "--keep", "1000", "--prompts", "6",
                        "--tokens", "12"]) == 0
    printed = capsys.readouterr().out
    assert "generated tokens counted" in printed and "wrote" in printed
    d2t = np.array(tensors(out)["d2t"].data)
    full = set(np.array(tensors(DRAFTER)["d2t"].data).tolist())
    assert len(d2t) == 1000 and np.all(np.diff(d2t) > 0) and set(d2t.tolist()) <= full
    from pyspec.tokenizer import Tokenizer
    eog = set(Tokenizer.from_gguf(MODEL).eog_ids) & full
    assert eog <= set(d2t.tolist())
    _core.DraftModel(out, _core.Model(MODEL))   # loads
    with pytest.raises(SystemExit):
        shrink.main(["--drafter", DRAFTER, "--out", out])
    assert shrink.main(["--drafter", DRAFTER, "--out", out, "--keep", "0"]) == 2
