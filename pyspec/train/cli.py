"""pyspec-train-drafter: train a DSpark drafter for a GGUF target (see pyspec.train)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import List, Optional


def _smoke_target(out: Path) -> str:
    """A tiny random llama target with a tokenizer (tools/make_tiny_models.py, source checkouts)."""
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "tools"))
    try:
        import make_tiny_models as tiny
    except ImportError:
        raise SystemExit("--smoke without --target needs a source checkout (tools/make_tiny_models.py)")
    from ..convert import convert
    hf = tiny.make_target(out / "smoke-target-hf", "llama", seed=3)
    path = out / "smoke-target.gguf"
    convert(hf.path, path, "f32", progress=False)
    return str(path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pyspec-train-drafter",
        description="Train a DSpark drafter (block 7, anchor-first, Markov + confidence heads) for "
                    "a frozen GGUF target on sequences the target generates itself; writes a "
                    "Hugging Face checkpoint and its GGUF.")
    p.add_argument("--target", help="the target GGUF (llama or qwen3)")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--block-size", type=int, default=None,
                   help="block length: the drafter's rows per pass, and its most drafts (default "
                        "7; with --init-from the checkpoint's unless given: no weight depends on "
                        "it, so a trained drafter can be retrained for a shorter, cheaper block)")
    p.add_argument("--block-size-min", type=int, default=None, metavar="N",
                   help="also train on blocks cut to N..block_size-1 rows (half the blocks), so "
                        "pyspec's engine may decode just the rows a round drafts: a cheaper pass "
                        "at small --spec-draft-n-max (0: whole blocks only, the default; other "
                        "engines always decode whole blocks, which stay in training)")
    p.add_argument("--layers", type=int, default=None,
                   help="drafter layers (default 3; with --init-from the checkpoint's, or more: "
                        "the added layers start as identities and the trained ones are kept)")
    p.add_argument("--target-layers", default="auto",
                   help="'auto' or comma-separated GGUF layer-input ids (0 = embeddings, "
                        "n_layer = the last layer's output); with --init-from, the checkpoint's "
                        "ids first, then ids to add (their fc columns start at zero)")
    p.add_argument("--markov-rank", type=int, default=None,
                   help="rank of the Markov head's bigram bias (default 128; with --init-from "
                        "the checkpoint's, or more: the trained columns are kept and the new "
                        "ones start without effect)")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="draft only the N most frequent target tokens of the generated data "
                        "(always with EOS/EOG): the head and Markov W2 get N rows and the "
                        "checkpoint a d2t map (0: the full vocabulary)")
    p.add_argument("--gen-engine", type=int, default=0, metavar="SLOTS",
                   help="generate the data with pyspec's own engine, SLOTS sequences at a time "
                        "(0: the torch target on --device)")
    p.add_argument("--gen-backend", choices=["cpu", "cuda"], default="cpu",
                   help="where --gen-engine runs (cuda: a build with PYSPEC_CUDA)")
    p.add_argument("--gen-sampler", choices=["full", "server"], default="full",
                   help="--gen-engine's law at T > 0: full, softmax(logits / T) as the torch "
                        "generator; server, llama-server's default filters (top-k 40, top-p "
                        "0.95, min-p 0.05), which on the GPU never reads a whole logit row")
    p.add_argument("--chat-fraction", type=float, default=0.6,
                   help="share of conversational prompts (everyday requests, questions, "
                        "stories, multi-turn chats) among the generated data's prompts; the "
                        "rest are Python documentation and source prompts")
    p.add_argument("--self-prompts", type=float, default=0.0, metavar="F",
                   help="share of the conversational requests the target writes itself, continuing "
                        "the opening of a user turn at T = 0.9 (the Magpie recipe; 0 to 1)")
    p.add_argument("--anchor-region", choices=["continuation", "all"], default="continuation",
                   help="where training blocks are anchored: the generated continuation only "
                        "(where the engine drafts), or every position")
    p.add_argument("--piece-weight", type=float, default=1.0, metavar="W",
                   help="weight of the training loss's slots whose label continues a word (a "
                        "token starting with a letter or digit, no leading space), where drafts "
                        "fail most (1: every slot alike; validation always weighs them alike)")
    p.add_argument("--loss-decay-gamma", type=float, default=4.0, metavar="GAMMA",
                   help="the loss's position decay: slot k weighs exp(-k / GAMMA) (the DSpark "
                        "recipe's 4; smaller puts the first drafts' laws first, which every "
                        "round uses, over the later ones, which only long rounds reach)")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="default: a rare control token of the vocabulary")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--anchors", type=int, default=64, help="blocks per sequence per step")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--data-prompts", type=int, default=4000,
                   help="sequences to generate (when --data is not given)")
    p.add_argument("--data", nargs="+", default=None, metavar="DIR_OR_FILE",
                   help="train on these shard sets (directories of data-*.npz, files or globs, "
                        "e.g. from several --generate-only sessions) instead of generating")
    p.add_argument("--generate-only", action="store_true",
                   help="generate --data-prompts sequences into OUT/data/data-*.npz and exit")
    p.add_argument("--data-shard-mib", type=float, default=15.0,
                   help="largest data shard file (MiB)")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="share of the sequences (by prompt) held out from training")
    p.add_argument("--val-seqs", type=int, default=256,
                   help="validation sequences the proxies are measured on")
    p.add_argument("--eval-every", type=int, default=0,
                   help="steps between validations (default: --save-every)")
    p.add_argument("--patience", type=int, default=0,
                   help="stop after this many validations without improvement (0: never)")
    p.add_argument("--init-from", default=None, metavar="HF_DIR|GGUF",
                   help="start from this hf/ checkpoint or drafter GGUF (weights only, fresh "
                        "optimizer; a quantized GGUF gives its dequantized weights)")
    p.add_argument("--hf-dtype", choices=["f32", "bf16", "f16"], default="f32",
                   help="weight type of the hf/ checkpoint (bf16: half the size, to carry)")
    p.add_argument("--time-limit", type=float, default=0,
                   help="seconds for generation + training; then stop, keep the best, convert")
    p.add_argument("--gen-batch", type=int, default=256, help="sequences generated at once")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", choices=["auto", "bf16", "f32"], default="auto",
                   help="auto: bf16 autocast on cuda, f32 on cpu")
    p.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--outtype", default="f16", help="GGUF weight type (f32, f16, q8_0, ...)")
    p.add_argument("--max-shard-mib", type=int, default=0,
                   help="shard the safetensors checkpoint into files of at most this size")
    p.add_argument("--smoke", action="store_true",
                   help="a few steps on a tiny random target on the CPU (CI)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("error: pyspec-train-drafter needs PyTorch: pip install 'pyspec[train]' "
              "(or pip install torch)", file=sys.stderr)
        return 1
    from .loop import TrainOptions, convert_checkpoint, train
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        if args.target is None:
            args.target = _smoke_target(args.out)
        args.device = "cpu"
        args.steps = min(args.steps, 30)
        args.layers = args.layers or (None if args.init_from else 1)
        args.seq_len, args.batch, args.anchors = 64, 4, 8
        args.data_prompts, args.gen_batch, args.save_every = 16, 16, 10
        args.val_fraction, args.val_seqs = max(args.val_fraction, 0.25), 4
        args.markov_rank = args.markov_rank or (None if args.init_from else 32)
        args.outtype = "f32"
    if args.target is None:
        print("error: --target is required (or --smoke)", file=sys.stderr)
        return 2
    if not args.piece_weight > 0.0:
        print(f"error: --piece-weight must be > 0, got {args.piece_weight}", file=sys.stderr)
        return 2
    if not args.loss_decay_gamma > 0.0:
        print(f"error: --loss-decay-gamma must be > 0, got {args.loss_decay_gamma}", file=sys.stderr)
        return 2
    if not 0.0 <= args.self_prompts <= 1.0:
        print(f"error: --self-prompts must be in [0, 1], got {args.self_prompts}", file=sys.stderr)
        return 2
    opts = TrainOptions(
        target=args.target, out=str(args.out), steps=args.steps, block_size=args.block_size,
        block_size_min=args.block_size_min,
        layers=args.layers, target_layers=args.target_layers, markov_rank=args.markov_rank,
        mask_token_id=args.mask_token_id, lr=args.lr, batch=args.batch, anchors=args.anchors,
        seq_len=args.seq_len, data_prompts=args.data_prompts, gen_batch=args.gen_batch,
        device=args.device, dtype=args.dtype, resume=args.resume, seed=args.seed,
        save_every=args.save_every, outtype=args.outtype, max_shard_mib=args.max_shard_mib,
        progress=not args.no_progress, threads=args.threads,
        data=args.data, generate_only=args.generate_only, data_shard_mib=args.data_shard_mib,
        val_fraction=args.val_fraction, val_seqs=args.val_seqs, eval_every=args.eval_every,
        patience=args.patience, init_from=args.init_from, hf_dtype=args.hf_dtype,
        time_limit=args.time_limit, draft_vocab=args.draft_vocab,
        chat_fraction=args.chat_fraction, gen_engine=args.gen_engine, self_prompts=args.self_prompts,
        gen_backend=args.gen_backend, gen_sampler=args.gen_sampler, piece_weight=args.piece_weight,
        anchor_region=args.anchor_region, gamma=args.loss_decay_gamma)
    t0 = time.time()
    try:
        hf = train(opts)
        if hf is None:
            print(f"wrote {args.out / 'data'} in {time.time() - t0:.0f}s")
            return 0
        gguf_path = args.out / f"drafter-{args.outtype}.gguf"
        convert_checkpoint(hf, args.target, gguf_path, args.outtype)
    except (ValueError, RuntimeError, OSError) as e:
        # bad options or files (a checkpoint that cannot grow that way, a CUDA backend in a CPU
        # build, a missing target): one line, not a traceback; what was saved stays in --out
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
    print(f"wrote {hf} and {gguf_path} in {time.time() - t0:.0f}s")
    print(f"use it: pyspec-cli -m {args.target} -md {gguf_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
