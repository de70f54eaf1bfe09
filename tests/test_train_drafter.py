"""pyspec-train-drafter (pyspec/train): the torch target equals pyspec's engine, the torch DSpark
drafter equals pyspec's C++ drafter (csrc/model/dflash.cpp) once its checkpoint is converted with
pyspec-convert --target-model-dir, and --smoke trains, converts and serves a drafter whose greedy
speculative output equals plain greedy output (lossless verification)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tools"))

import tiny_models  # noqa: E402
from conftest import run_requests  # noqa: E402
from pyspec import _core  # noqa: E402
from pyspec.convert import convert  # noqa: E402
from pyspec.train import cli  # noqa: E402
from pyspec.train.drafter import DSparkDrafter  # noqa: E402
from pyspec.train.loop import auto_target_layers  # noqa: E402
from pyspec.train.target import TargetModel  # noqa: E402


def probe_logits(target, *drafters):
    """Each drafter's training-forward logits on one fixed random sequence of `target`."""
    tm = TargetModel.from_gguf(target)
    layers = drafters[0].c.target_layers
    tokens = torch.randint(0, tm.hp.n_vocab, (1, 40), generator=torch.Generator().manual_seed(0))
    _, inp = tm(tokens, layers=layers, logits=False)
    feats = torch.cat([inp[l] for l in layers], -1)
    anchors = torch.tensor([[3, 10, 20]])
    return [d(feats, tokens, anchors, tm.embedding, tm.head)["logits"] for d in drafters]


def run_greedy(engine, prompt, n):
    """(tokens, final stats) of one greedy request run alone on a SpecEngine."""
    engine.add_request(0, prompt, max_tokens=n, temperature=0.0, verify="greedy")
    run = run_requests(engine)[0]
    assert run.stop_reason
    return run.tokens, run.stats


def engine_against_simulation(model, dm, tm, drafter, n_max, block_len=None, n_tok=40):
    """([rounds, accepted] of the C++ engine, the same of the validator's simulation) over three
    greedy requests of the smoke target at n_max drafts a round; each speculative run must equal
    plain decoding. block_len: the simulation's blocks cut to that many rows."""
    from pyspec.train.loop import _batch, target_features
    from pyspec.train.validation import Validator, simulate_rounds
    spec = _core.SpecEngine(model, dm, n_ctx=512, n_seq_max=1, n_draft_slots=1, n_threads=2,
                            draft_n_max=n_max)
    plain = _core.SpecEngine(model, None, n_ctx=512, n_seq_max=1, n_threads=2)
    eng, sim = [0, 0], [0, 0]
    for p in ([1, 17, 42, 99, 5], [1, 230, 64, 7], [1, 3, 3, 3, 9, 12]):
        # the greedy sequence, longer than the speculative run so its last round sees drafts
        seq = p + run_greedy(plain, p, n_tok + n_max + 1)[0]
        got, st = run_greedy(spec, p, n_tok)
        assert got == seq[len(p):len(p) + n_tok]
        tokens, lengths = _batch([seq], [0], torch.device("cpu"))
        feats, t_logits = target_features(tm, tokens, lengths, drafter.c.target_layers)
        (h,) = Validator.continuation_hits(drafter, feats, t_logits, tokens, lengths, [len(p)],
                                           tm.embedding, tm.head, None, drafter.c.block_size,
                                           torch.device("cpu"), block_len=block_len)
        rounds, acc = simulate_rounds(h, n_max, max_tokens=n_tok)
        eng[0] += st["n_rounds"]
        eng[1] += st["draft_n_accepted"]
        sim[0] += rounds
        sim[1] += acc
    return eng, sim


def rel_err(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref)) / np.std(ref))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    t0 = time.time()
    assert cli.main(["--smoke", "--out", str(out), "--no-progress"]) == 0
    elapsed = time.time() - t0
    assert elapsed < 60, f"--smoke took {elapsed:.0f}s"
    return out


DRAFT_VOCAB = 128        # of the tiny target's ~300 tokens


@pytest.fixture(scope="module")
def smoke_dv(tmp_path_factory, smoke):
    """--smoke with a reduced draft vocabulary (--draft-vocab), on the smoke run's target."""
    out = tmp_path_factory.mktemp("train_dv")
    assert cli.main(["--smoke", "--out", str(out), "--no-progress", "--draft-vocab",
                     str(DRAFT_VOCAB), "--target", str(smoke / "smoke-target.gguf")]) == 0
    return out


@pytest.fixture(params=[0, DRAFT_VOCAB], ids=["full-vocab", "draft-vocab"])
def smoke_run(request):
    """(run directory, target GGUF) of the smoke run with the full or a reduced vocabulary."""
    if request.param == 0:
        out = request.getfixturevalue("smoke")
    else:
        out = request.getfixturevalue("smoke_dv")
    return out, request.getfixturevalue("smoke") / "smoke-target.gguf"


def engine_forward(path, tokens, layers, kv="f32"):
    model = _core.Model(str(path))
    n = len(tokens)
    ctx = _core.Context(model, 256, 1, 256, False, 2, kv)
    logits, _, inputs = ctx.decode(np.asarray(tokens, np.int32), np.arange(n, dtype=np.int32),
                                   np.zeros(n, np.int32), np.ones(n, np.uint8), list(layers))
    return model, np.asarray(logits), {k: np.asarray(v) for k, v in dict(inputs).items()}


@pytest.mark.parametrize("arch,wtype", [("llama", "F32"), ("qwen3", "F32"), ("llama", "Q8_0"),
                                        ("qwen3", "Q4_0")])
def test_target_forward_matches_engine(tmp_path, arch, wtype):
    tm = tiny_models.write_tiny_model(tmp_path / f"{arch}.gguf", arch, wtype, seed=4)
    n_layer = tm.hparams["n_layer"]
    layers = list(range(n_layer + 1))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, tm.hparams["n_vocab"], 37)
    _, ref_logits, ref_inputs = engine_forward(tm.path, tokens, layers)
    target = TargetModel.from_gguf(str(tm.path))
    logits, inputs = target(torch.tensor(tokens)[None], layers=layers)
    # Against quantized weights the engine also quantizes activations to 8 bits in its dot
    # products (as llama.cpp), which tests/test_model_reference.py bounds by 0.2 end to end.
    tol = 1e-4 if wtype == "F32" else 0.2
    assert rel_err(logits[0].numpy(), ref_logits) < tol
    for lid in layers:
        assert rel_err(inputs[lid][0].numpy(), ref_inputs[lid]) < tol, lid
    ref_logits = logits[0].numpy()   # the torch paths below must agree with themselves exactly
    # padded batches and the KV-cached path give the same logits
    pad = torch.zeros(2, 40, dtype=torch.long)
    pad[0, :37] = torch.tensor(tokens)
    valid = torch.arange(40)[None] < torch.tensor([[37], [40]])
    lg2, _ = target(pad, valid=valid)
    assert rel_err(lg2[0, :37].numpy(), ref_logits) < 1e-4
    from pyspec.train.target import KVCache
    cache = KVCache(target.hp, 1, 64, "cpu", torch.float32)
    t = torch.tensor(tokens)[None]
    target(t[:, :30], cache=cache)
    lg3, _ = target(t[:, 30:], torch.arange(30, 37)[None], cache=cache)
    assert rel_err(lg3[0].numpy(), ref_logits[30:]) < 1e-4


def test_learning_rate_decays_by_the_steps_or_by_the_time_limit():
    """The cosine reaches 0.1 peak at the last step, or when a time limit's budget is spent,
    whichever comes first; the warm-up is by steps. A run stopped by its time limit must end
    decayed, not near the peak (a resumed run with a larger --steps did: run s9)."""
    from pyspec.train.loop import lr_at
    peak, total, warm = 1e-3, 1000, 0.04
    w = int(total * warm)
    assert lr_at(0, total, peak, warm) == pytest.approx(peak / w)
    assert lr_at(w, total, peak, warm) == pytest.approx(peak)
    assert lr_at(total, total, peak, warm) == pytest.approx(0.1 * peak)
    # Halfway in time, a tenth of the way in steps: the rate is the halfway one.
    half = lr_at(w + (total - w) // 2, total, peak, warm)
    assert lr_at(100, total, peak, warm, time_frac=0.5) == pytest.approx(half)
    assert lr_at(100, total, peak, warm, time_frac=0.0) > half
    # Spent budget: the floor, at any step past the warm-up; the time term never raises the rate.
    assert lr_at(2000, 30000, peak, warm, time_frac=1.0) == pytest.approx(0.1 * peak)  # s9's resume
    assert lr_at(w + 1, total, peak, warm, time_frac=2.0) == pytest.approx(0.1 * peak)
    for step in (w, 300, 700, total):
        for tf in (0.0, 0.3, 0.9):
            assert lr_at(step, total, peak, warm, tf) <= lr_at(step, total, peak, warm) + 1e-15
    # Within the warm-up the steps decide.
    assert lr_at(5, total, peak, warm, time_frac=0.9) == lr_at(5, total, peak, warm)


def test_auto_target_layers():
    assert auto_target_layers(30) == [2, 9, 15, 22, 29]
    assert auto_target_layers(2) == [0, 1]
    assert all(0 <= l <= 8 for l in auto_target_layers(8))


def randomize(drafter: DSparkDrafter, seed: int) -> DSparkDrafter:
    """Large random weights everywhere (a trained-for-30-steps drafter is still near its
    initialisation, where e.g. the Markov head is ~0 and would hide a wrong head)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.ndim == 1 and "bias" not in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.2 if "markov" in name else 0.15))
    return drafter


@pytest.mark.parametrize("which", ["trained", "random", "last-layer"])
def test_torch_drafter_equals_engine_drafter(smoke_run, tmp_path, which):
    """The engine's drafting pass equals the torch reference's; "last-layer" also reads the
    target's last layer output (layer input n_layer), which the graph records apart."""
    run, target_path = smoke_run
    drafter = DSparkDrafter.load_hf(run / "hf")
    gguf_path = run / "drafter-f32.gguf"
    target = TargetModel.from_gguf(str(target_path))
    if which == "last-layer":
        drafter = drafter.add_target_layers([target.hp.n_layer])
    if which != "trained":
        randomize(drafter, 7)
        hf = drafter.save_hf(tmp_path / "hf", head=target.head)
        gguf_path = tmp_path / "drafter.gguf"
        convert(hf, gguf_path, "f32", target_model_dir=target_path, progress=False)
    c = drafter.c
    v = target.hp.n_vocab
    d2t = np.arange(v) if drafter.d2t is None else drafter.d2t.numpy()
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, target.hp.n_vocab, 30)
    model, _, inputs = engine_forward(target_path, tokens, c.target_layers, kv="f16")
    dm = _core.DraftModel(str(gguf_path), model)
    assert (dm.is_dspark, dm.draft_offset, dm.has_confidence_head) == (True, 0, True)
    assert dm.block_size == c.block_size == 7 and dm.target_layers == c.target_layers
    assert dm.n_vocab_draft == c.vd == len(d2t)
    n_ctx = 24
    feats = np.concatenate([inputs[l] for l in c.target_layers], axis=1)[:n_ctx]
    # the torch target gives the engine's features too (up to the engine's F16 KV cache)
    _, t_inputs = target(torch.tensor(tokens[:n_ctx])[None], layers=c.target_layers, logits=False)
    t_feats = torch.cat([t_inputs[l][0] for l in c.target_layers], -1).numpy()
    assert rel_err(t_feats, feats) < 5e-3
    dc = _core.DraftContext(dm, n_seq_max=1, n_batch=64, n_threads=2, check_plans=True)
    dc.inject(0, np.arange(n_ctx, dtype=np.int32), np.ascontiguousarray(feats, np.float32))
    id_last, pos0 = int(tokens[n_ctx]), n_ctx
    out = dc.draft_logits(0, id_last, pos0, c.block_size)
    ref = drafter.draft_block(torch.tensor(feats), id_last, pos0, c.block_size,
                              target.embedding, target.head)
    # Both give [n_block, V] rows, -inf off the draft vocabulary; compare on it.
    off = np.ones(v, bool)
    off[d2t] = False
    for k in ("base_logits", "logits"):
        assert out[k].shape == tuple(ref[k].shape) == (c.block_size, v)
        assert np.isneginf(out[k][:, off]).all() and np.isneginf(ref[k].numpy()[:, off]).all()
    # The engine keeps K/V in an F16 cache; everything else is F32.
    tol = 2e-3
    base = ref["base_logits"][:, d2t]
    assert rel_err(out["base_logits"][:, d2t], base.numpy()) < tol
    # Along the engine's own greedy chain the Markov-biased logits and confidences match.
    e_w1 = drafter.markov_w1.detach()
    logits = base.clone()
    conf = []
    prev = id_last
    for i in range(c.block_size):
        e = e_w1[prev]
        logits[i] = base[i] + drafter.markov_w2.detach() @ e
        conf.append(float(torch.sigmoid(drafter.conf_proj(torch.cat([ref["hidden"][i], e]))).detach()))
        top2 = torch.sort(logits[i]).values[-2:]
        if float(top2[1] - top2[0]) > 1e-2:
            assert int(out["tokens"][i]) == int(d2t[int(logits[i].argmax())]), i
        prev = int(out["tokens"][i])
        assert prev in set(d2t.tolist())
    assert rel_err(out["logits"][:, d2t], logits.detach().numpy()) < tol
    np.testing.assert_allclose(out["confidence"], conf, atol=tol)
    if which != "trained":
        np.testing.assert_array_equal(out["tokens"], ref["tokens"].numpy())


def test_training_reduces_the_loss(smoke):
    import json
    log = json.loads((smoke / "train_log.json").read_text())
    assert log["step"] == 30 and np.isfinite(log["ema"]["loss"])
    assert (smoke / "train_state.pt").exists() and (smoke / "data" / "data-00000.npz").exists()
    assert log["best"]["step"] in (10, 20, 30) and "accept_len" in log["best"]["val"]


def test_resume_continues_from_the_checkpoint(smoke):
    st = torch.load(smoke / "train_state.pt", weights_only=False)
    assert st["step"] == 30
    # --resume with more steps picks up at 30 (data.pt reused, nothing regenerated)
    t0 = time.time()
    assert cli.main(["--smoke", "--out", str(smoke), "--no-progress", "--resume",
                     "--target", str(smoke / "smoke-target.gguf"), "--steps", "30"]) == 0
    assert torch.load(smoke / "train_state.pt", weights_only=False)["step"] == 30
    assert time.time() - t0 < 30


def test_smoke_drafter_serves_losslessly(smoke_run):
    import pyspec
    run, target = smoke_run
    draft = run / "drafter-f32.gguf"
    prompt = [1, 17, 42, 99, 5, 230, 64]
    plain = pyspec.LLM(str(target), n_ctx=256)
    spec = pyspec.LLM(str(target), n_ctx=256, draft_model=str(draft))
    for ids in (prompt, prompt[:3]):
        a = plain.generate(ids, max_tokens=40, temperature=0.0, ignore_eos=True)
        b = spec.generate(ids, max_tokens=40, temperature=0.0, ignore_eos=True)
        assert a == b
        assert spec.last_stats.spec is not None and spec.last_stats.draft_n > 0


def test_shards_round_trip_and_drop_duplicates(tmp_path):
    from pyspec.train.shards import load_shards, save_shards
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 50000, rng.integers(3, 400)).tolist() for _ in range(300)]
    pls = [int(rng.integers(1, 3)) for _ in seqs]
    files = save_shards(seqs, pls, tmp_path / "a", dict(n_vocab=50000), max_mib=0.05)
    assert len(files) > 1 and all(f.stat().st_size <= 0.05 * 2 ** 20 for f in files)
    save_shards(seqs[:10] + [[1, 2, 3]], pls[:10] + [1], tmp_path / "b", dict(n_vocab=50000))
    got, got_pls, info = load_shards([tmp_path / "a", tmp_path / "b"], n_vocab=50000)
    assert got == seqs + [[1, 2, 3]] and got_pls == pls + [1] and info["duplicates"] == 10
    with pytest.raises(ValueError):
        load_shards(tmp_path / "a", n_vocab=301)


def test_seeds_give_different_prompts():
    import itertools
    from pyspec.train.data import prompt_requests
    a, b = (set(r[:2] for r in itertools.islice(prompt_requests(seed), 3000)) for seed in (0, 1))
    assert len(a) == len(b) == 3000 and len(a & b) < 60


def test_generate_only_then_data_trains_on_the_same_sequences(smoke, tmp_path, monkeypatch):
    """--generate-only writes the smoke run's sequences (same seed); --data trains on them, and
    no validation sequence is ever in a training batch."""
    from pyspec.train import loop
    from pyspec.train.shards import load_shards
    from pyspec.train.validation import split
    target = str(smoke / "smoke-target.gguf")
    gen_out = tmp_path / "gen"
    assert cli.main(["--smoke", "--target", target, "--out", str(gen_out), "--no-progress",
                     "--generate-only"]) == 0
    assert not (gen_out / "hf").exists()
    seqs, pls, _ = load_shards(gen_out / "data")
    ref, ref_pls, _ = load_shards(smoke / "data")
    assert seqs == ref and pls == ref_pls and len(seqs) == 16
    _, val_idx = split(seqs, pls, 0.25)
    val = {tuple(seqs[i]) for i in val_idx}
    assert val
    seen = []
    real_batch = loop._batch

    def spy(batch_seqs, idx, device):
        if batch_seqs is not None and len(batch_seqs) == len(seqs):   # the training data
            seen.extend(tuple(batch_seqs[i]) for i in idx)
        return real_batch(batch_seqs, idx, device)
    monkeypatch.setattr(loop, "_batch", spy)
    out = tmp_path / "train"
    assert cli.main(["--smoke", "--target", target, "--out", str(out), "--no-progress",
                     "--data", str(gen_out / "data"), "--steps", "12"]) == 0
    assert len(seen) == 12 * 4 and not (set(seen) & val)
    assert not (out / "data").exists()         # --data is read, not copied


def test_init_from_reproduces_the_checkpoint(smoke, tmp_path):
    """--init-from starts from the checkpoint's weights: with no steps the validation proxies
    equal the source run's at its chosen step, and hf/ gives the same logits."""
    import json
    target = str(smoke / "smoke-target.gguf")
    out = tmp_path / "init"
    assert cli.main(["--smoke", "--target", target, "--out", str(out), "--no-progress",
                     "--data", str(smoke / "data"), "--init-from", str(smoke / "hf"),
                     "--steps", "0"]) == 0
    src = json.loads((smoke / "train_log.json").read_text())["best"]
    first = json.loads((out / "eval_log.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0
    assert first["val"]["loss"] == pytest.approx(src["val"]["loss"], rel=1e-5)
    a, b = DSparkDrafter.load_hf(smoke / "hf"), DSparkDrafter.load_hf(out / "hf")
    la, lb = probe_logits(target, a, b)
    torch.testing.assert_close(la, lb)


def test_init_from_with_another_block_size(smoke, tmp_path):
    """--init-from with --block-size retrains a drafter for another block: the same weights (no
    weight depends on the block), and the new block in config.json and in the converted GGUF,
    which the engine then decodes whole."""
    import json
    target = str(smoke / "smoke-target.gguf")
    src = json.loads((smoke / "hf" / "config.json").read_text())["block_size"]
    out = tmp_path / "block4"
    assert cli.main(["--smoke", "--target", target, "--out", str(out), "--no-progress",
                     "--data", str(smoke / "data"), "--init-from", str(smoke / "hf"),
                     "--steps", "0", "--block-size", "4"]) == 0
    assert src != 4 and json.loads((out / "hf" / "config.json").read_text())["block_size"] == 4
    a, b = DSparkDrafter.load_hf(smoke / "hf"), DSparkDrafter.load_hf(out / "hf")
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, msg=n)
    convert(out / "hf", tmp_path / "d.gguf", "f32", target_model_dir=target, progress=False)
    model = _core.Model(target)
    assert _core.DraftModel(str(tmp_path / "d.gguf"), model).block_size == 4


def test_bf16_checkpoint_is_half_the_size_and_loads(smoke, tmp_path):
    d = DSparkDrafter.load_hf(smoke / "hf")
    d.save_hf(tmp_path / "f32")
    d.save_hf(tmp_path / "bf16", max_shard_mib=0, dtype="bf16")
    size = lambda p: sum(f.stat().st_size for f in p.glob("*.safetensors"))  # noqa: E731
    assert size(tmp_path / "bf16") < 0.55 * size(tmp_path / "f32")
    e = DSparkDrafter.load_hf(tmp_path / "bf16")
    for (n, p), q in zip(d.named_parameters(), e.parameters()):
        torch.testing.assert_close(q, p.to(torch.bfloat16).float(), msg=n)
    convert(tmp_path / "bf16", tmp_path / "d.gguf", "f16",
            target_model_dir=smoke / "smoke-target.gguf", progress=False)


def test_draft_vocab_checkpoint_and_conversion(smoke, smoke_dv):
    """--draft-vocab N: config draft_vocab_size, d2t offsets (ascending absolute ids incl. EOG)
    and lm_head.weight = the target head's rows at d2t; the GGUF gets output.weight and d2t."""
    import json
    from safetensors.torch import load_file
    from pyspec.tokenizer import Tokenizer
    target = smoke / "smoke-target.gguf"
    cfg = json.loads((smoke_dv / "hf" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB
    sd = load_file(str(smoke_dv / "hf" / "model.safetensors"))
    d2t = sd["d2t"] + torch.arange(DRAFT_VOCAB)
    assert sd["d2t"].dtype == torch.int64 and bool((d2t[1:] > d2t[:-1]).all())
    tm = TargetModel.from_gguf(str(target))
    torch.testing.assert_close(sd["lm_head.weight"], tm.head[d2t].float())
    assert sd["markov_head.markov_w2.weight"].shape[0] == DRAFT_VOCAB
    tok = Tokenizer.from_gguf(str(target))
    assert set(tok.eog_ids) <= set(d2t.tolist())
    model = _core.Model(str(target))
    dm = _core.DraftModel(str(smoke_dv / "drafter-f32.gguf"), model)
    assert dm.n_vocab_draft == DRAFT_VOCAB


def test_draft_vocabulary_counts_continuations():
    from pyspec.train.loop import draft_vocabulary
    seqs = [[9, 9, 9, 1, 1, 2], [8, 8, 8, 8, 1, 3, 3]]
    pls = [3, 4]     # prompts: 9 9 9 / 8 8 8 8 (never counted first)
    d2t = draft_vocabulary(seqs, pls, [0, 1], 3, 12, always=[11])
    assert d2t.tolist() == [1, 3, 11]           # 1 (x3), 3 (x2), EOG 11 forced; 2 left out
    assert draft_vocabulary(seqs, pls, [0, 1], 5, 12).tolist() == [1, 2, 3, 8, 9]


def random_loss_case(seed, K, V, lengths, anchors):
    """Random inputs of dspark_loss: tokens [B, L] (L the longest length), lengths, anchors
    [B, A], target logits [B, L, V] and drafter logits [B, A, K, V]."""
    g = torch.Generator().manual_seed(seed)
    B, L, A = len(lengths), max(lengths), len(anchors[0])
    tokens = torch.randint(0, V, (B, L), generator=g)
    t_logits = torch.randn(B, L, V, generator=g) * 2
    logits = torch.randn(B, A, K, V, generator=g)
    return tokens, torch.tensor(lengths), torch.tensor(anchors), t_logits, logits


def test_reduced_vocab_loss_is_the_acceptance_tv():
    """With d2t the L1 term is ||q - p||_1 over the full vocabulary (q = 0 off the draft
    vocabulary), so 1 - TV = sum min(q, p), the sampling acceptance; labels outside are ignored
    by CE; with d2t = every id the loss equals the full-vocabulary loss."""
    from pyspec.train.loss import dspark_loss
    B, L, A, K, V = 2, 20, 3, 4, 30
    tokens, lengths, anchors, t_logits, full = random_loss_case(
        0, K, V, [20, 15], [[0, 5, 9], [1, 4, 8]])
    ref = dspark_loss(dict(logits=full, conf=None), t_logits, tokens, lengths, anchors)
    same = dspark_loss(dict(logits=full, conf=None, d2t=torch.arange(V)), t_logits, tokens,
                       lengths, anchors)
    for k in ("loss", "ce", "l1", "accept_len"):
        torch.testing.assert_close(same[k], ref[k])
    d2t = torch.tensor(sorted(set(tokens[:, 1:].flatten().tolist()))[::2])
    red = full[..., d2t]
    out = dspark_loss(dict(logits=red, conf=None, d2t=d2t), t_logits, tokens, lengths, anchors)
    # explicit: scatter q into V with zeros and take the full-vocabulary L1 / CE with ignore
    q = torch.zeros(B, A, K, V)
    q[..., d2t] = torch.softmax(red, -1)
    pos = (anchors[:, :, None] + torch.arange(K)).clamp(max=L - 2)
    p = torch.softmax(torch.gather(t_logits, 1, pos.reshape(B, -1, 1).expand(-1, -1, V)), -1)
    p = p.view(B, A, K, V)
    valid = (anchors[:, :, None] + torch.arange(K) + 1) < lengths[:, None, None]
    w = torch.exp(-torch.arange(K).float() / 4)[None, None] * valid
    l1 = (q - p).abs().sum(-1)
    torch.testing.assert_close(out["l1"], (l1 * w).sum() / w.sum())
    torch.testing.assert_close(1 - 0.5 * l1, torch.minimum(q, p).sum(-1))
    labels = torch.gather(tokens, 1, (pos + 1).reshape(B, -1)).view(B, A, K)
    inside = torch.isin(labels, d2t)
    logq = torch.log(q.clamp(min=1e-30))
    ce = -torch.gather(logq, -1, labels[..., None]).squeeze(-1)
    wc = w * inside
    torch.testing.assert_close(out["ce"], (ce * wc).sum() / wc.sum())


def valid_slot_laws(tokens, lengths, anchors, t_logits, logits):
    """For every block slot whose label is inside its sequence: (k, label, q, p), the drafter's
    and the target's softmax in float64 (numpy), the reference the loss tests compare with."""
    tk, tl, lg = tokens.numpy(), t_logits.double().numpy(), logits.double().numpy()

    def softmax(x):
        e = np.exp(x - x.max())
        return e / e.sum()

    B, A, K = lg.shape[:3]
    for b in range(B):
        for a in range(A):
            for k in range(K):
                pos = int(anchors[b, a]) + k
                if pos + 1 < int(lengths[b]):
                    yield k, tk[b, pos + 1], softmax(lg[b, a, k]), softmax(tl[b, pos])


def test_label_weights_scale_each_slot_by_its_label():
    """token_weight (--piece-weight): every term is the mean over the slots weighted by the
    position decay times the label's factor, against a numpy computation; all factors 1 give
    the plain loss."""
    from pyspec.train.loss import dspark_loss
    B, L, A, K, V = 2, 16, 3, 3, 11
    tokens, lengths, anchors, t_logits, logits = random_loss_case(
        3, K, V, [16, 9], [[0, 4, 12], [1, 3, 6]])
    plain = dspark_loss(dict(logits=logits, conf=None), t_logits, tokens, lengths, anchors)
    ones = dspark_loss(dict(logits=logits, conf=None), t_logits, tokens, lengths, anchors,
                       token_weight=torch.ones(V))
    for k in ("loss", "ce", "l1"):
        torch.testing.assert_close(ones[k], plain[k], rtol=0, atol=0)
    tw = np.ones(V)
    tw[[2, 5, 7]] = 4.0
    got = dspark_loss(dict(logits=logits, conf=None), t_logits, tokens, lengths, anchors,
                      token_weight=torch.tensor(tw, dtype=torch.float32))
    num_ce = num_l1 = den = 0.0
    for k, label, q, p in valid_slot_laws(tokens, lengths, anchors, t_logits, logits):
        w = np.exp(-k / 4.0) * tw[label]
        num_ce += w * -np.log(q[label])
        num_l1 += w * np.abs(q - p).sum()
        den += w
    np.testing.assert_allclose(float(got["ce"]), num_ce / den, rtol=1e-5)
    np.testing.assert_allclose(float(got["l1"]), num_l1 / den, rtol=1e-5)
    np.testing.assert_allclose(float(got["loss"]), 0.1 * num_ce / den + 0.9 * num_l1 / den, rtol=1e-5)
    assert abs(float(got["loss"]) - float(plain["loss"])) > 1e-4


def test_position_decay_and_per_slot_proxies_against_numpy():
    """--loss-decay-gamma: slot k weighs exp(-k / gamma) in every term; the per-slot proxies are
    the share of valid slots whose argmax is the target's (slot_acc) and the mean of
    sum min(p, q) (slot_sampled, a sampled draft's chance to survive rejection at T 1)."""
    from pyspec.train.loss import dspark_loss
    B, L, A, K, V = 2, 14, 3, 4, 9
    tokens, lengths, anchors, t_logits, logits = random_loss_case(
        5, K, V, [14, 8], [[0, 6, 10], [1, 2, 5]])
    got = dspark_loss(dict(logits=logits, conf=None), t_logits, tokens, lengths, anchors, gamma=1.5)
    num_l1 = den = 0.0
    hits, sampled, count = np.zeros(K), np.zeros(K), np.zeros(K)
    for k, _, q, p in valid_slot_laws(tokens, lengths, anchors, t_logits, logits):
        w = np.exp(-k / 1.5)
        num_l1 += w * np.abs(q - p).sum()
        den += w
        hits[k] += q.argmax() == p.argmax()
        sampled[k] += np.minimum(q, p).sum()
        count[k] += 1
    np.testing.assert_allclose(float(got["l1"]), num_l1 / den, rtol=1e-5)
    np.testing.assert_allclose(got["slot_acc"].numpy(), hits / count, rtol=1e-6)
    np.testing.assert_allclose(got["slot_sampled"].numpy(), sampled / count, rtol=1e-5)
    default = dspark_loss(dict(logits=logits, conf=None), t_logits, tokens, lengths, anchors)
    assert abs(float(default["l1"]) - float(got["l1"])) > 1e-4


def test_word_pieces_of_the_default_tokenizer():
    """word_piece_ids: tokens that continue a word (a letter or digit first, no space mark), not
    the ones after a space, punctuation, newlines or control tokens."""
    import pyspec
    from pyspec.model import default_model_path
    from pyspec.train.loss import word_piece_ids
    try:
        tok = pyspec.LLM(default_model_path(), n_ctx=64).tokenizer
    except RuntimeError as e:
        pytest.skip(str(e))
    ids = set(word_piece_ids(tok))
    for piece in ("iffel", "ines", "the", "1"):
        assert tok.token_to_id(piece) in ids, piece
    for piece in ("Ġthe", ",", "Ċ", "čĊ", "Ġ", "<|im_start|>"):
        assert tok.token_to_id(piece) not in ids, piece
    assert 0.2 < len(ids) / tok.n_vocab < 0.5


def test_piece_weight_option(smoke, tmp_path):
    """--piece-weight trains with label weights (and says so); a weight <= 0 is refused."""
    target = str(smoke / "smoke-target.gguf")
    lines = []
    from pyspec.train.loop import TrainOptions, train
    opts = TrainOptions(target=target, out=str(tmp_path / "pw"), steps=3, layers=1, markov_rank=32,
                        seq_len=64, batch=4, anchors=8, data=[str(smoke / "data")], save_every=3,
                        val_fraction=0.25, val_seqs=4, progress=False, outtype="f32",
                        piece_weight=3.0)
    train(opts, log=lines.append)
    assert any("continues a word" in line and "weigh 3" in line for line in lines)
    assert cli.main(["--smoke", "--target", target, "--out", str(tmp_path / "bad"),
                     "--no-progress", "--piece-weight", "0"]) == 2


def test_loss_decay_gamma_option(smoke, tmp_path, monkeypatch, capsys):
    """--loss-decay-gamma reaches the training loss; validation logs both per-slot proxies; a
    gamma <= 0 is refused."""
    from pyspec.train import loop
    target = str(smoke / "smoke-target.gguf")
    seen = []
    real = loop.dspark_loss

    def spy(*a, **kw):
        seen.append(a[5] if len(a) > 5 else kw.get("gamma"))
        return real(*a, **kw)

    monkeypatch.setattr(loop, "dspark_loss", spy)
    assert cli.main(["--smoke", "--target", target, "--out", str(tmp_path / "g"), "--no-progress",
                     "--data", str(smoke / "data"), "--steps", "2", "--loss-decay-gamma", "2.5"]) == 0
    assert seen and set(seen) == {2.5}
    out = capsys.readouterr().out
    assert "per-slot top-1 agreement [" in out and "sampled (T 1) [" in out
    assert cli.main(["--smoke", "--target", target, "--out", str(tmp_path / "bad"),
                     "--no-progress", "--loss-decay-gamma", "0"]) == 2


def test_init_from_full_vocab_reduces_markov_w2(smoke, tmp_path):
    """--init-from a full-vocabulary checkpoint with --draft-vocab: same backbone, markov_w2
    rows at d2t, so the draft logits are the full ones at d2t."""
    target = str(smoke / "smoke-target.gguf")
    out = tmp_path / "init_dv"
    assert cli.main(["--smoke", "--target", target, "--out", str(out), "--no-progress",
                     "--data", str(smoke / "data"), "--init-from", str(smoke / "hf"),
                     "--steps", "0", "--draft-vocab", str(DRAFT_VOCAB)]) == 0
    a, b = DSparkDrafter.load_hf(smoke / "hf"), DSparkDrafter.load_hf(out / "hf")
    assert b.c.vd == DRAFT_VOCAB and a.c.vd == a.c.vocab_size
    la, lb = probe_logits(target, a, b)
    torch.testing.assert_close(lb, la[..., b.d2t])


def test_conversational_prompts_and_held_out_text():
    import itertools
    from pyspec.train.data import HELD_OUT_MARKERS, prompt_requests
    reqs = list(itertools.islice(prompt_requests(3, chat_fraction=0.6), 2000))
    conv = [t for k, t, _ in reqs if k == "chat" and "```" not in t and "\n\n" not in t]
    assert 0.5 < len(conv) / len(reqs) < 0.7
    assert not any(m in t.lower() for _, t, _ in reqs for m in HELD_OUT_MARKERS)
    a = {t for _, t, _ in itertools.islice(prompt_requests(4, chat_fraction=1.0), 1000)}
    b = {t for _, t, _ in itertools.islice(prompt_requests(5, chat_fraction=1.0), 1000)}
    assert len(a) == len(b) == 1000 and len(a & b) < 30


def test_engine_generator_is_plain_decoding_with_eog_kept(smoke):
    """--gen-engine continues prompts with pyspec's engine: at T = 0 each continuation is plain
    greedy decoding (a one-sequence Context loop), an end-of-generation token ends it and is
    kept, and a prompt's sampled continuation does not depend on which prompts share its steps."""
    import pyspec
    from pyspec.train.engine_generate import EngineGenerator
    target = str(smoke / "smoke-target.gguf")
    prompts = [[5, 6, 7], [9], list(range(20, 45)), [3, 3, 3, 3]]
    gen = EngineGenerator(target, n_slots=3, max_len=64, n_threads=2)
    ctx = pyspec.Context(pyspec.Model(target, n_threads=2), n_ctx=64)
    greedy = gen(prompts, 12, [0.0] * 4, [], seed=1)
    for p, s in zip(prompts, greedy):
        ctx.kv_clear()
        assert s == p + pyspec.generate(ctx, p, 12)
    # An end-of-generation id: the first greedy token of prompt 0 becomes one.
    eog = greedy[0][3]
    ended = gen(prompts[:1], 12, [0.0], [eog], seed=1)[0]
    assert ended == prompts[0] + [eog]
    sampled = gen(prompts, 12, [0.9] * 4, [], seed=5)
    alone = [gen([p], 12, [0.9], [], seed=5)[0] for p in prompts[:1]]
    assert sampled[0] == alone[0] and sampled != greedy


def test_engine_generator_server_sampler_draws_within_the_filters(smoke):
    """sampler="server" samples with llama-server's filters: every sampled token is among the
    target's 40 most likely at its position, with at least 5% of the most likely token's
    probability (min-p); the "full" law, at the same temperature, leaves those bounds (so the
    check can fail); greedy continuations are the same under both."""
    import pyspec
    from pyspec.train.engine_generate import EngineGenerator
    target = str(smoke / "smoke-target.gguf")
    prompts = [[5, 6, 7], [9], list(range(20, 45)), [3, 3, 3, 3]]
    server = EngineGenerator(target, n_slots=4, max_len=64, n_threads=2, sampler="server")
    full = EngineGenerator(target, n_slots=4, max_len=64, n_threads=2, sampler="full")
    assert server(prompts, 12, [0.0] * 4, [], seed=1) == full(prompts, 12, [0.0] * 4, [], seed=1)
    ctx = pyspec.Context(pyspec.Model(target, n_threads=2), n_ctx=64)

    def outside(seqs):
        n = 0
        for p, s in zip(prompts, seqs):
            ctx.kv_clear()
            logits = ctx.decode(tokens=s[:-1], output=[True] * (len(s) - 1)).logits
            for i in range(len(p), len(s)):
                row = np.asarray(logits[i - 1], np.float64)
                rank = int((row > row[s[i]]).sum())
                n += rank >= 40 or row[s[i]] < row.max() + np.log(0.05)
        return n

    assert outside(server(prompts, 12, [1.5] * 4, [], seed=3)) == 0
    assert outside(full(prompts, 12, [1.5] * 4, [], seed=3)) > 0
    with pytest.raises(ValueError, match="unknown sampler"):
        EngineGenerator(target, n_slots=1, sampler="nucleus")


def test_gen_engine_writes_loadable_shards(smoke, tmp_path):
    from pyspec.train.shards import load_shards
    target = str(smoke / "smoke-target.gguf")
    out = tmp_path / "gen-engine"
    assert cli.main(["--smoke", "--target", target, "--out", str(out), "--no-progress",
                     "--generate-only", "--gen-engine", "4"]) == 0
    seqs, pls, _ = load_shards(out / "data")
    assert len(seqs) == 16 and all(len(s) > p for s, p in zip(seqs, pls))


def test_gen_backend_cuda_without_cuda_is_a_clear_error(smoke, tmp_path, capsys):
    """--gen-backend cuda in a build without CUDA: one error line and exit status 1, no
    traceback."""
    if _core.cuda_available()[0]:
        pytest.skip("this build has CUDA")
    target = str(smoke / "smoke-target.gguf")
    assert cli.main(["--smoke", "--target", target, "--out", str(tmp_path / "g"), "--no-progress",
                     "--generate-only", "--gen-engine", "2", "--gen-backend", "cuda"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "without CUDA" in err and "Traceback" not in err


def test_anchors_stay_in_the_continuation():
    from pyspec.train.loop import _anchors
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([50, 50, 10])
    a = _anchors(lengths, 16, gen, starts=[30, 0, 9])
    assert a.shape == (3, 16)
    assert int(a[0].min()) >= 30 and int(a[0].max()) <= 48
    assert int(a[1].min()) >= 0 and int(a[1].max()) <= 48 and int(a[1].min()) < 30
    assert int(a[2].max()) <= 8        # no anchor left after 9: the whole sequence is used
    assert bool((a[:, 1:] >= a[:, :-1]).all())


def test_simulate_rounds_by_hand():
    from pyspec.train.validation import simulate_rounds
    h = np.zeros((8, 3), bool)
    h[0] = [True, True, False]     # round at 0 accepts 2 -> next anchor 3
    h[3] = [True, True, True]      # accepts 3 (n_max 3) -> next anchor 7
    h[7] = [True, False, False]    # accepts 1 -> 9: done
    assert simulate_rounds(h, 3) == (3, 6)
    assert simulate_rounds(h, 2) == (4, 5)     # at 0: 2, at 3: 2, at 6: 0, at 7: 1
    assert simulate_rounds(h, 1) == (6, 3)     # at 0: 1, 2: 0, 3: 1, 5: 0, 6: 0, 7: 1
    # max_tokens 5: at 0 drafts 3 (accepts 2, 3 out), at 3 drafts only 1 (accepts 1, 5 out)
    assert simulate_rounds(h, 3, max_tokens=5) == (2, 3)
    # max_tokens 4: at 3 no room to draft (5 - 3 - 1 = 0 ... 4 - 3 - 1 = 0): a round of 0
    assert simulate_rounds(h, 3, max_tokens=4) == (2, 2)


def test_engine_simulation_matches_the_engine(smoke):
    """The validation's replay of greedy speculative decoding (simulate_rounds over the torch
    drafter's hits along a greedy sequence) gives the C++ engine's own rounds and accepted
    drafts for the same prompts."""
    target_path = smoke / "smoke-target.gguf"
    drafter = DSparkDrafter.load_hf(smoke / "hf").eval()
    tm = TargetModel.from_gguf(str(target_path))
    model = _core.Model(str(target_path))
    dm = _core.DraftModel(str(smoke / "drafter-f32.gguf"), model)
    eng, sim = engine_against_simulation(model, dm, tm, drafter, drafter.c.block_size)
    assert eng[1] > 0, "the smoke drafter should accept something on its own target"
    # Torch (F32 throughout) and the engine (F16 KV cache) may rarely break an argmax tie apart.
    eng_len = sum(eng) / eng[0]
    sim_len = sum(sim) / sim[0]
    assert abs(eng_len - sim_len) < 0.02, (eng, sim)


def test_grouped_attention_equals_sdpa():
    """The cached decode path's grouped attention (no K/V repeat per query head) gives what
    scaled_dot_product_attention with enable_gqa gives, masked keys included."""
    import torch.nn.functional as F
    from pyspec.train.target import grouped_attention
    g = torch.Generator().manual_seed(0)
    B, nh, nkv, T, S, hd = 3, 6, 2, 2, 11, 8
    q = torch.randn(B, nh, T, hd, generator=g)
    k = torch.randn(B, nkv, S, hd, generator=g)
    v = torch.randn(B, nkv, S, hd, generator=g)
    mask = torch.rand(B, 1, T, S, generator=g) > 0.4
    mask[..., -1] = True                      # every row sees at least one key
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.3)
    got = grouped_attention(q, k, v, mask, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_self_prompts_are_the_targets_own_finished_user_turns():
    """--self-prompts (the Magpie recipe) on the embedded SmolLM2: the target continues the
    opening of a user turn, and each request is a turn it finished itself, with the chat
    template's system prompt before it and nothing of the assistant's; the requests are distinct,
    held-out text is never among them, the same seed gives the same requests and another seed
    others, and the rendered training prompts carry each request as the user message."""
    import pyspec
    from pyspec.model import default_model_path
    from pyspec.train.data import HELD_OUT_MARKERS, self_prompt_prefix, self_prompt_records, self_prompts
    from pyspec.train.engine_generate import EngineGenerator
    try:
        path = default_model_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    tok = pyspec.LLM(path, n_ctx=64).tokenizer
    prefix = self_prompt_prefix(tok)
    opening = tok.decode(prefix, skip_special=False)
    assert opening.endswith("<|im_start|>user\n") and "<|im_start|>system\n" in opening
    assert "assistant" not in opening.split("<|im_start|>")[-1]
    gen = EngineGenerator(path, n_slots=16, max_len=len(prefix) + 96, n_threads=2)
    first = self_prompts(None, tok, 12, "cpu", 16, seed=5, generator=gen)
    assert len(first) == 12 and len({t.lower() for t in first}) == 12
    for text in first:
        assert len(text.split()) >= 3 and "<|im_end|>" not in text and "<|im_start|>" not in text
        assert not any(m in text.lower() for m in HELD_OUT_MARKERS)
    assert self_prompts(None, tok, 12, "cpu", 16, seed=5, generator=gen) == first
    assert not set(self_prompts(None, tok, 12, "cpu", 16, seed=6, generator=gen)) & set(first)
    records = self_prompt_records(None, tok, 6, 256, "cpu", 16, seed=5, generator=gen)
    assert records and all(msgs == [{"role": "user", "content": t}] for (_, msgs), t in zip(records, first))
    for ids, msgs in records:
        text = tok.decode(ids, skip_special=False)
        assert msgs[0]["content"] in text and text.endswith("<|im_start|>assistant\n")


def test_grown_drafter_computes_the_same_and_trains_its_new_layer(smoke, tmp_path, capsys):
    """--init-from --layers N (more than the checkpoint's): the trained layers are kept and the
    appended ones start as identities, so the grown drafter's logits equal the checkpoint's;
    training then moves the new layer (its zeroed residual outputs get gradients)."""
    target = str(smoke / "smoke-target.gguf")
    src = DSparkDrafter.load_hf(smoke / "hf")
    n = src.c.num_hidden_layers
    grown = src.grow(n + 1)
    assert grown.c.num_hidden_layers == n + 1
    la, lb = probe_logits(target, src, grown)
    torch.testing.assert_close(la, lb, rtol=0, atol=0)
    with pytest.raises(ValueError):
        src.grow(n)

    out = tmp_path / "grow"
    assert cli.main(["--smoke", "--target", target, "--out", str(out), "--no-progress",
                     "--data", str(smoke / "data"), "--init-from", str(smoke / "hf"),
                     "--layers", str(n + 1), "--steps", "6", "--save-every", "3"]) == 0
    trained = torch.load(out / "train_state.pt", weights_only=False)["drafter"]
    assert float(trained[f"layers.{n}.o_proj.weight"].abs().max()) > 0
    assert float(trained[f"layers.{n}.down_proj.weight"].abs().max()) > 0
    torch.testing.assert_close(trained["fc.weight"].shape, src.fc.weight.shape)
    assert cli.main(["--smoke", "--target", target, "--out", str(tmp_path / "shrink"),
                     "--no-progress", "--data", str(smoke / "data"), "--init-from",
                     str(out / "hf"), "--layers", str(n)]) == 2
    assert "grow, not shrink" in capsys.readouterr().err


def test_grown_markov_head_computes_the_same_and_trains_its_new_columns(smoke, tmp_path, capsys):
    """--init-from --markov-rank R (more than the checkpoint's): the trained columns are kept and
    the new ones start without effect, so the grown drafter's logits and confidence equal the
    checkpoint's; training then moves the new markov_w2 columns; the engine loads the converted
    GGUF with the new rank; a smaller rank is refused."""
    from pyspec.train.from_gguf import load_drafter_gguf
    target = str(smoke / "smoke-target.gguf")
    src = DSparkDrafter.load_hf(smoke / "hf")
    r = src.c.markov_rank
    grown = src.grow_markov(2 * r, torch.Generator().manual_seed(1))
    assert grown.markov_w1.shape[1] == grown.markov_w2.shape[1] == 2 * r
    assert float(grown.markov_w1[:, r:].detach().abs().max()) > 0   # the new W1 columns are not zero
    # equal up to the summation order of the longer dot products (the added terms are zeros)
    la, lb = probe_logits(target, src, grown)
    torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-6)
    prev = torch.tensor([1, 5, 9])
    h = torch.randn(3, src.c.hidden_size, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(src.confidence_logit(h, src.markov(prev)[0]),
                               grown.confidence_logit(h, grown.markov(prev)[0]), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError):
        src.grow_markov(r)

    out = tmp_path / "grow-markov"
    assert cli.main(["--smoke", "--target", target, "--out", str(out), "--no-progress",
                     "--data", str(smoke / "data"), "--init-from", str(smoke / "hf"),
                     "--markov-rank", str(2 * r), "--steps", "6", "--save-every", "3"]) == 0
    trained = torch.load(out / "train_state.pt", weights_only=False)["drafter"]
    assert trained["markov_w2"].shape[1] == 2 * r
    assert float(trained["markov_w2"][:, r:].abs().max()) > 0
    path = out / "drafter-f32.gguf"
    assert load_drafter_gguf(path).c.markov_rank == 2 * r
    _core.DraftModel(str(path), _core.Model(target))   # the engine takes the new rank
    assert cli.main(["--smoke", "--target", target, "--out", str(tmp_path / "shrink"),
                     "--no-progress", "--data", str(smoke / "data"), "--init-from",
                     str(out / "hf"), "--markov-rank", str(r)]) == 2
    assert "grow, not shrink" in capsys.readouterr().err


def test_added_target_layer_computes_the_same_and_trains_its_fc_columns(smoke, tmp_path, capsys):
    """--init-from --target-layers (the checkpoint's ids, then new ones, here the last layer's
    output n_layer): fc's new columns start at zero, so the drafter's logits equal the
    checkpoint's whatever the new feature holds; training then moves those columns; the engine
    loads the converted GGUF and drafts from the wider features; ids that change or drop the
    checkpoint's are refused."""
    from pyspec.train.from_gguf import load_drafter_gguf
    target = str(smoke / "smoke-target.gguf")
    src = DSparkDrafter.load_hf(smoke / "hf")
    tm = TargetModel.from_gguf(target)
    have, last = list(src.c.target_layers), tm.hp.n_layer
    assert last not in have
    wide = src.add_target_layers([last])
    assert wide.c.target_layers == have + [last]
    tokens = torch.randint(0, tm.hp.n_vocab, (1, 40), generator=torch.Generator().manual_seed(0))
    _, inp = tm(tokens, layers=have + [last], logits=False)
    anchors = torch.tensor([[3, 10, 20]])
    la = src(torch.cat([inp[l] for l in have], -1), tokens, anchors, tm.embedding, tm.head)["logits"]
    lb = wide(torch.cat([inp[l] for l in have + [last]], -1), tokens, anchors, tm.embedding,
              tm.head)["logits"]
    torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-6)
    for bad in ([have[0]], []):
        with pytest.raises(ValueError):
            src.add_target_layers(bad)

    out = tmp_path / "wide"
    ids = ",".join(map(str, have + [last]))
    assert cli.main(["--smoke", "--target", target, "--out", str(out), "--no-progress",
                     "--data", str(smoke / "data"), "--init-from", str(smoke / "hf"),
                     "--target-layers", ids, "--steps", "6", "--save-every", "3"]) == 0
    trained = torch.load(out / "train_state.pt", weights_only=False)["drafter"]
    n_old = src.fc.weight.shape[1]
    assert trained["fc.weight"].shape[1] == n_old + src.c.hidden_size
    assert float(trained["fc.weight"][:, n_old:].abs().max()) > 0
    path = out / "drafter-f32.gguf"
    assert load_drafter_gguf(path).c.target_layers == have + [last]
    d = _core.DraftModel(str(path), _core.Model(target))
    assert list(d.target_layers) == have + [last]
    changed = ",".join(map(str, [last] + have[1:]))
    assert cli.main(["--smoke", "--target", target, "--out", str(tmp_path / "changed"),
                     "--no-progress", "--data", str(smoke / "data"), "--init-from",
                     str(smoke / "hf"), "--target-layers", changed]) == 2
    assert "can grow, not change" in capsys.readouterr().err


def test_cut_blocks_train_and_draft_as_the_engine_decodes_them(smoke, tmp_path, capsys):
    """--block-size-min N: training also sees blocks cut to N..K-1 rows, whose masks match a
    drafting pass over that many rows (the trailing mask slots invisible); the checkpoint and its
    GGUF carry N (pyspec.drafter.block_size_min) and the engine then decodes just the rows a
    round drafts, so its acceptance is the simulation's over cut blocks, and stays lossless;
    an N outside 1..K-1 is refused."""
    import pyspec
    from pyspec.train.from_gguf import load_drafter_gguf
    target = str(smoke / "smoke-target.gguf")
    tm = TargetModel.from_gguf(target)
    src = randomize(DSparkDrafter.load_hf(smoke / "hf"), 3).eval()
    K = src.c.block_size
    # the training mask of a cut block is the drafting pass over that many rows
    tokens = torch.randint(0, tm.hp.n_vocab, (1, 40), generator=torch.Generator().manual_seed(0))
    _, inp = tm(tokens, layers=src.c.target_layers, logits=False)
    feats = torch.cat([inp[l] for l in src.c.target_layers], -1)
    anchors = torch.tensor([[12, 20]])
    with torch.no_grad():
        cut = src(feats, tokens, anchors, tm.embedding, tm.head, torch.tensor([[3, 5]]))["h"]
        whole = src(feats, tokens, anchors, tm.embedding, tm.head)["h"]
    for a, n in ((0, 3), (1, 5)):
        pos0 = int(anchors[0, a])
        ref = src.draft_block(feats[0, :pos0], int(tokens[0, pos0]), pos0, n, tm.embedding, tm.head)
        torch.testing.assert_close(cut[0, a, :n], ref["hidden"], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(cut[0, 0, :3], whole[0, 0, :3], atol=1e-3)   # the mask matters

    out = tmp_path / "cut"
    assert cli.main(["--smoke", "--target", target, "--out", str(out), "--no-progress",
                     "--data", str(smoke / "data"), "--init-from", str(smoke / "hf"),
                     "--block-size-min", "2", "--steps", "6", "--save-every", "3"]) == 0
    assert DSparkDrafter.load_hf(out / "hf").c.block_size_min == 2
    path = out / "drafter-f32.gguf"
    assert load_drafter_gguf(path).c.block_size_min == 2
    model = _core.Model(target)
    dm = _core.DraftModel(str(path), model)
    assert (dm.block_size_min, dm.block_rows(1), dm.block_rows(3), dm.block_rows(K + 4)) == (2, 2, 3, K)
    whole_dm = _core.DraftModel(str(smoke / "drafter-f32.gguf"), model)
    assert (whole_dm.block_size_min, whole_dm.block_rows(2)) == (0, K)

    # the engine at n_max 2 decodes 2-row blocks: its acceptance is the simulation's over them
    drafter = DSparkDrafter.load_hf(out / "hf").eval()
    n_max = 2
    assert _core.SpecEngine(model, dm, n_ctx=512, n_seq_max=1, n_draft_slots=1, n_threads=2,
                            draft_n_max=n_max).draft_block_rows == n_max
    assert _core.SpecEngine(model, whole_dm, n_ctx=512, n_seq_max=1, n_draft_slots=1, n_threads=2,
                            draft_n_max=n_max).draft_block_rows == K
    eng, sim = engine_against_simulation(model, dm, tm, drafter, n_max, block_len=n_max)
    assert eng[1] > 0
    assert abs(sum(eng) / eng[0] - sum(sim) / sim[0]) < 0.02, (eng, sim)
    # the Python loop decodes the same rows, and both stay lossless
    ids = [1, 17, 42, 99, 5, 230, 64]
    a = pyspec.LLM(target, n_ctx=256).generate(ids, max_tokens=30, temperature=0.0, ignore_eos=True)
    llm = pyspec.LLM(target, n_ctx=256, draft_model=str(path), draft_n_max=2)
    assert llm.speculative.block_size == 2
    assert llm.generate(ids, max_tokens=30, temperature=0.0, ignore_eos=True) == a
    assert cli.main(["--smoke", "--target", target, "--out", str(tmp_path / "bad"), "--no-progress",
                     "--data", str(smoke / "data"), "--init-from", str(smoke / "hf"),
                     "--block-size-min", str(K)]) == 2
    assert "--block-size-min" in capsys.readouterr().err


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_drafter_gguf_loads_back_as_its_checkpoint(smoke_run, tmp_path, outtype):
    """A converted drafter GGUF read back (pyspec/train/from_gguf.py) is the checkpoint it was
    converted from: the same configuration and d2t, the same weights (F32 exactly; Q8_0 within its
    rounding), for the full and a reduced draft vocabulary."""
    from pyspec.train.from_gguf import load_drafter_gguf
    run, target = smoke_run
    src = DSparkDrafter.load_hf(run / "hf")
    path = tmp_path / f"d-{outtype}.gguf"
    convert(run / "hf", path, outtype, target_model_dir=target, progress=False)
    got = load_drafter_gguf(path)
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "target_layers", "mask_token_id",
                  "block_size", "markov_rank", "max_position_embeddings", "confidence_head", "vd"):
        assert getattr(got.c, field) == getattr(src.c, field), field
    assert got.c.rms_norm_eps == pytest.approx(src.c.rms_norm_eps, rel=1e-6)
    assert got.c.extra == {"init_from_gguf": path.name}
    if src.d2t is not None:
        assert torch.equal(got.d2t, src.d2t)
    import gguf
    for (n, p), q in zip(src.named_parameters(), got.parameters()):
        w, q = p.detach().numpy(), q.detach().numpy()
        if outtype == "f32" or p.ndim < 2:
            np.testing.assert_array_equal(q, w, err_msg=n)
            continue
        # a weight the converter quantized gives gguf's own round trip of it, bit for bit (or it
        # kept the weight in F16 where the rows do not split into Q8_0 blocks)
        q8 = gguf.quants.dequantize(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                                    gguf.GGMLQuantizationType.Q8_0)
        assert np.array_equal(q, q8) or np.array_equal(q, w.astype(np.float16).astype(np.float32)), n


def test_init_from_a_drafter_gguf(smoke, tmp_path):
    """--init-from DRAFTER.gguf continues from the file's weights: with no steps hf/ holds exactly
    the checkpoint the F32 GGUF was converted from."""
    target = str(smoke / "smoke-target.gguf")
    out = tmp_path / "from-gguf"
    assert cli.main(["--smoke", "--target", target, "--out", str(out), "--no-progress",
                     "--data", str(smoke / "data"), "--init-from", str(smoke / "drafter-f32.gguf"),
                     "--steps", "0"]) == 0
    a, b = DSparkDrafter.load_hf(smoke / "hf"), DSparkDrafter.load_hf(out / "hf")
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=n)


def test_init_from_refuses_other_ggufs(smoke, tmp_path):
    from pyspec.train.from_gguf import load_drafter_gguf
    with pytest.raises(ValueError, match="not a drafter GGUF"):
        load_drafter_gguf(smoke / "smoke-target.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((smoke / "drafter-f32.gguf").read_bytes()[:4000])
    with pytest.raises(ValueError, match="cannot read"):
        load_drafter_gguf(cut)
