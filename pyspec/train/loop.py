"""The training loop and its checkpoints.

Files in --out:
    data/data-*.npz    the generated sequences (shards.py), reused on --resume; with
                       --generate-only the only output (carry it, train later with --data)
    train_state.pt     the latest drafter weights, optimizer, step, RNG state, best-so-far (--resume)
    hf/                the Hugging Face checkpoint (config.json + safetensors) of the drafter that
                       did best on the validation sequences so far (the latest one without them)
    eval_log.jsonl     one line per evaluation: step, training and validation proxies
    train_log.json     the last step's numbers and the chosen (best) step
    drafter-<type>.gguf  hf/ converted with pyspec-convert --target-model-dir TARGET

Validation (validation.py): --val-fraction of the sequences, chosen by prompt hash, are never
trained on; every --eval-every steps the loss proxies are measured on up to --val-seqs of them,
hf/ is rewritten whenever the validation greedy accepted length improves, and --patience stops a
run that stopped improving. Training on the data's own batches overstates how far the drafter
drafts on new prompts once it starts to memorise them; the held-out numbers do not.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from .drafter import DrafterConfig, DSparkDrafter
from .from_gguf import gguf_block_size, is_gguf, load_drafter_gguf
from .loss import SLOT_KEYS, dspark_loss
from .target import TargetModel


@dataclass
class TrainOptions:
    target: str
    out: str
    steps: int = 2000
    block_size: Optional[int] = None     # None: 7, or with init_from the checkpoint's
    block_size_min: Optional[int] = None  # > 0: also train on blocks cut to this length or more
    layers: Optional[int] = None          # None: 3, or --init-from's checkpoint's
    target_layers: str = "auto"
    markov_rank: Optional[int] = None    # None: 128, or with init_from the checkpoint's (may grow)
    mask_token_id: Optional[int] = None
    lr: float = 6e-4
    warmup: float = 0.04
    batch: int = 16
    anchors: int = 64
    seq_len: int = 512
    data_prompts: int = 4000
    gen_batch: int = 256
    device: str = "cpu"
    dtype: str = "auto"           # bf16 autocast on cuda, f32 on cpu
    resume: bool = False
    seed: int = 0
    save_every: int = 500
    gamma: float = 4.0
    outtype: str = "f16"
    max_shard_mib: int = 0
    progress: bool = True
    threads: int = 0
    data: Optional[List[str]] = None     # shard sets to train on instead of generating
    generate_only: bool = False
    val_fraction: float = 0.05
    val_seqs: int = 256
    eval_every: int = 0                  # 0: save_every
    patience: int = 0                    # evaluations without improvement before stopping
    init_from: Optional[str] = None      # an hf/ checkpoint or drafter GGUF to start from (weights only)
    hf_dtype: str = "f32"
    data_shard_mib: float = 15.0
    time_limit: float = 0.0              # seconds for the whole run (0: none)
    draft_vocab: int = 0                 # 0: full target vocabulary; else the N most frequent
    chat_fraction: float = 0.6           # share of conversational prompts (data.py)
    anchor_region: str = "continuation"  # anchors in the generated part only, or "all" positions
    gen_engine: int = 0                  # > 0: generate data with pyspec's engine, this many at once
    gen_backend: str = "cpu"             # the engine's backend: cpu or cuda
    gen_sampler: str = "full"            # the engine's law at T > 0 (EngineGenerator.SAMPLERS)
    piece_weight: float = 1.0            # loss weight of slots whose label continues a word
    self_prompts: float = 0.0            # share of conversational requests the target writes itself


def auto_target_layers(n_layer: int, k: int = 5) -> List[int]:
    """GGUF layer inputs spread over the depth: HF ids (layer outputs) from 1 to n_layer - 2
    (0.. for shallow targets), k of them, each + 1."""
    lo = 1 if n_layer >= 6 else -1
    hi = max(lo, n_layer - 2)
    k = min(k, hi - lo + 1)
    ids = sorted(set(int(round(x)) for x in np.linspace(lo, hi, k)))
    return [i + 1 for i in ids]


def parse_target_layers(spec: str, n_layer: int) -> List[int]:
    """'auto' or comma-separated GGUF layer-input ids (0 = embeddings .. n_layer)."""
    if spec == "auto":
        return auto_target_layers(n_layer)
    ids = [int(s) for s in spec.split(",") if s.strip()]
    for i in ids:
        if not 0 <= i <= n_layer:
            raise ValueError(f"target layer {i} outside 0..{n_layer} (GGUF layer inputs)")
    return ids


def choose_mask_token(tokenizer) -> int:
    """A token id the target (almost) never produces in chat or prose: a '<|mask|>'-like token if
    the vocabulary has one, else the last control token that is not BOS/EOS/EOT/PAD/UNK or a
    chat-template marker, else the last id (see the package docstring)."""
    for name in ("<|mask|>", "<mask>", "[MASK]", "<|MASK|>"):
        tid = tokenizer.token_to_id(name)
        if tid is not None:
            return int(tid)
    taken = {tokenizer.bos_id, tokenizer.eos_id, tokenizer.eot_id, tokenizer.pad_id,
             tokenizer.unk_id} | set(tokenizer.eog_ids)
    best = None
    for tid in range(tokenizer.n_vocab):
        if tokenizer.token_type(tid) != 3 or tid in taken:
            continue
        text = tokenizer.token_text(tid)
        if "im_start" in text or "im_end" in text or "start_header" in text or "eot" in text:
            continue
        best = tid
    return int(best if best is not None else tokenizer.n_vocab - 1)


def _batch(seqs: List[List[int]], idx: Sequence[int], device):
    L = max(len(seqs[i]) for i in idx)
    tok = torch.zeros(len(idx), L, dtype=torch.long)
    lengths = torch.tensor([len(seqs[i]) for i in idx])
    for r, i in enumerate(idx):
        tok[r, :len(seqs[i])] = torch.tensor(seqs[i])
    return tok.to(device), lengths.to(device)


def _anchors(lengths: torch.Tensor, n: int, gen: torch.Generator,
             starts: Optional[Sequence[int]] = None) -> torch.Tensor:
    """n sorted anchor positions per sequence, from [start, length - 2] (the anchors with a
    label). starts: each sequence's first allowed anchor, or 0; a start that leaves no anchor
    falls back to 0."""
    rows = []
    for r, ln in enumerate(lengths.tolist()):
        lo = int(starts[r]) if starts is not None else 0
        if lo > ln - 2:
            lo = 0
        m = max(1, ln - 1 - lo)
        if m >= n:
            a = torch.randperm(m, generator=gen)[:n]
        else:
            a = torch.randint(0, m, (n,), generator=gen)
        rows.append(a.sort().values + lo)
    return torch.stack(rows)


def draft_vocabulary(seqs: Sequence[Sequence[int]], prompt_lens: Optional[Sequence[int]],
                     idx: Sequence[int], n: int, n_vocab: int, always: Sequence[int] = ()
                     ) -> torch.Tensor:
    """The draft vocabulary (d2t, ascending target ids): the n most frequent tokens of the
    target's generated continuations (seq[prompt_len:]) of the sequences idx (the training
    split), always including `always` (the EOS/EOG ids); ties and a shortfall (fewer distinct
    continuation tokens than n) are filled by prompt-token counts, then by the lowest ids."""
    n = min(n, n_vocab)
    gen = np.zeros(n_vocab, np.int64)
    prm = np.zeros(n_vocab, np.int64)
    for i in idx:
        s = np.asarray(seqs[i], np.int64)
        pl = prompt_lens[i] if prompt_lens is not None else 0
        gen += np.bincount(s[pl:], minlength=n_vocab)[:n_vocab]
        prm += np.bincount(s[:pl], minlength=n_vocab)[:n_vocab]
    forced = sorted({int(t) for t in always if 0 <= int(t) < n_vocab})[:n]
    score = gen.astype(np.float64) * (1 << 20) + np.minimum(prm, (1 << 20) - 1)
    score[forced] = np.inf
    order = np.lexsort((np.arange(n_vocab), -score))    # score descending, then lowest id
    return torch.from_numpy(np.sort(order[:n]).astype(np.int64))


def target_features(target: TargetModel, tokens, lengths, layers: List[int]):
    valid = torch.arange(tokens.shape[1], device=tokens.device)[None] < lengths[:, None]
    logits, inp = target(tokens, valid=valid, layers=layers)
    feats = torch.cat([inp[l] for l in layers], -1)
    return feats, logits


def lr_at(step: int, total: int, peak: float, warmup: float, time_frac: float = 0.0) -> float:
    """Linear warm-up over the first warmup share of the steps, then a cosine from peak down to
    0.1 peak at the last step, or, with a time limit, by the time it runs out (time_frac: the
    share of the training loop's time budget spent), whichever comes first. Without the time
    term a run stopped by --time-limit ended at whatever rate it had reached, and a resumed run
    given a larger --steps went back near the peak (run s9, docs/training.md)."""
    w = max(1, int(total * warmup))
    if step < w:
        return peak * (step + 1) / w
    t = max((step - w) / max(1, total - w), time_frac)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def _load_target(opt: TrainOptions, device, amp, log):
    from ..tokenizer import Tokenizer
    t0 = time.time()
    target = TargetModel.from_gguf(opt.target).to(device)
    if amp is not None:
        target = target.to(amp)
    tok = Tokenizer.from_gguf(opt.target)
    log(f"target {opt.target}: {target.hp.arch}, {target.hp.n_layer} layers, hidden "
        f"{target.hp.n_embd}, vocab {target.hp.n_vocab}; loaded in {time.time() - t0:.1f}s")
    return target, tok


def _training_data(opt: TrainOptions, target, tok, device, deadline, log):
    """(sequences, prompt lengths): --data shard sets, or the data/ of a resumed run, or freshly
    generated (and saved to out/data/)."""
    from .data import generate_dataset
    from .shards import load_shards, save_shards
    out = Path(opt.out)
    if opt.data and not opt.generate_only:
        seqs, pls, info = load_shards(opt.data, target.hp.n_vocab)
        log(f"{len(seqs)} sequences from {info['files']} shard files "
            f"({info['duplicates']} exact duplicates dropped)")
        return seqs, pls
    if opt.resume and not opt.generate_only:
        if list((out / "data").glob("data-*.npz")):
            seqs, pls, _ = load_shards(out / "data", target.hp.n_vocab)
            log(f"{len(seqs)} sequences from {out / 'data'}")
            return seqs, pls
        if (out / "data.pt").exists():      # runs from before shard files
            seqs = torch.load(out / "data.pt")["seqs"]
            log(f"{len(seqs)} sequences from {out / 'data.pt'}")
            return seqs, None
    t0 = time.time()
    generator = None
    if opt.gen_engine > 0:
        from .engine_generate import EngineGenerator
        generator = EngineGenerator(opt.target, n_slots=opt.gen_engine, max_len=opt.seq_len,
                                    n_threads=opt.threads, backend=opt.gen_backend,
                                    sampler=opt.gen_sampler)
        log(f"generating with pyspec's engine ({opt.gen_backend}, sampler {opt.gen_sampler}), "
            f"{opt.gen_engine} sequences at a time")
    seqs, pls = generate_dataset(target, tok, opt.data_prompts, opt.seq_len, device,
                                 opt.gen_batch, opt.seed, progress=opt.progress,
                                 deadline=deadline, chat_fraction=opt.chat_fraction,
                                 generator=generator, self_prompt_fraction=opt.self_prompts)
    meta = dict(target=Path(opt.target).name, n_vocab=target.hp.n_vocab, seq_len=opt.seq_len,
                seed=opt.seed, chat_fraction=opt.chat_fraction, self_prompts=opt.self_prompts)
    files = save_shards(seqs, pls, out / "data", meta, opt.data_shard_mib)
    n_tok = sum(len(s) for s in seqs)
    log(f"generated {len(seqs)} sequences ({n_tok} tokens) in {time.time() - t0:.1f}s -> "
        f"{len(files)} shard files in {out / 'data'}")
    return seqs, pls


def build_drafter(opt: TrainOptions, hp, layers: List[int], mask_id: int, log=print,
                  d2t: Optional[torch.Tensor] = None):
    """A fresh drafter for the target, or (--init-from) the checkpoint's, whose architecture,
    target layers, mask token and draft vocabulary then replace the options' (a full-vocabulary
    checkpoint with d2t given is reduced to it: markov_w2 keeps its rows at d2t)."""
    if opt.init_from:
        drafter = (load_drafter_gguf(Path(opt.init_from)) if is_gguf(Path(opt.init_from))
                   else DSparkDrafter.load_hf(Path(opt.init_from)))
        c = drafter.c
        if (c.hidden_size, c.vocab_size) != (hp.n_embd, hp.n_vocab) or \
                max(c.target_layers) > hp.n_layer:
            raise ValueError(f"{opt.init_from} was not trained for this target (hidden "
                             f"{c.hidden_size}, vocab {c.vocab_size}, layers {c.target_layers})")
        if d2t is not None and not c.reduced:
            drafter = drafter.reduce_vocab(d2t)
            log(f"draft vocabulary of {opt.init_from} reduced to {drafter.c.vd} tokens")
        elif d2t is not None and c.vd != len(d2t):
            log(f"--draft-vocab {len(d2t)} ignored: {opt.init_from} has its own draft "
                f"vocabulary of {c.vd} tokens")
        if opt.layers is not None and opt.layers < drafter.c.num_hidden_layers:
            raise ValueError(f"--layers {opt.layers}: {opt.init_from} has "
                             f"{drafter.c.num_hidden_layers} layers (a drafter can grow, not "
                             f"shrink)")
        if opt.layers is not None and opt.layers > drafter.c.num_hidden_layers:
            log(f"{opt.init_from} grown from {drafter.c.num_hidden_layers} to {opt.layers} "
                f"layers (the new ones start as identities)")
            drafter = drafter.grow(opt.layers)
        if opt.markov_rank is not None and opt.markov_rank < drafter.c.markov_rank:
            raise ValueError(f"--markov-rank {opt.markov_rank}: {opt.init_from} has rank "
                             f"{drafter.c.markov_rank} (the Markov head can grow, not shrink)")
        if opt.markov_rank is not None and opt.markov_rank > drafter.c.markov_rank:
            log(f"{opt.init_from}'s Markov head grown from rank {drafter.c.markov_rank} to "
                f"{opt.markov_rank} (the new columns start without effect)")
            drafter = drafter.grow_markov(opt.markov_rank,
                                          torch.Generator().manual_seed(opt.seed + 17))
        if opt.target_layers != "auto" and layers != drafter.c.target_layers:
            have = drafter.c.target_layers
            if layers[:len(have)] != have:   # (equal lists were excluded above: this one is longer)
                raise ValueError(f"--target-layers {','.join(map(str, layers))}: {opt.init_from} "
                                 f"reads {','.join(map(str, have))}; list those first, then the "
                                 f"layers to add (a drafter's features can grow, not change)")
            log(f"{opt.init_from} also reads layer inputs {layers[len(have):]} (fc's new "
                f"columns start at zero)")
            drafter = drafter.add_target_layers(layers[len(have):])
        if opt.block_size is not None and opt.block_size != drafter.c.block_size:
            log(f"block size {drafter.c.block_size} of {opt.init_from} becomes {opt.block_size}")
            drafter.c.block_size = opt.block_size
        if opt.block_size_min is not None:
            drafter.c.block_size_min = opt.block_size_min
        check_block_size_min(drafter.c)
        c = drafter.c
        log(f"initialised from {opt.init_from}: {c.num_hidden_layers} layers, target layers "
            f"{c.target_layers}, mask token {c.mask_token_id}, draft vocabulary {c.vd} "
            f"(fresh optimizer)")
        return drafter
    cfg = DrafterConfig(hidden_size=hp.n_embd, intermediate_size=hp.n_ff,
                        num_hidden_layers=opt.layers or 3, num_attention_heads=hp.n_head,
                        num_key_value_heads=hp.n_head_kv, head_dim=hp.head_dim,
                        vocab_size=hp.n_vocab, target_layers=layers, mask_token_id=mask_id,
                        block_size=opt.block_size or 7, block_size_min=opt.block_size_min or 0,
                        markov_rank=opt.markov_rank or 128,
                        draft_vocab_size=len(d2t) if d2t is not None else 0,
                        rms_norm_eps=hp.rms_eps, rope_theta=hp.rope_freq_base,
                        max_position_embeddings=hp.n_ctx_train,
                        extra=dict(target=Path(opt.target).name, seq_len=opt.seq_len,
                                   mask_choice="rare control token (see pyspec.train)"))
    check_block_size_min(cfg)
    drafter = DSparkDrafter(cfg)
    if cfg.reduced:
        drafter.set_d2t(d2t)
    return drafter


def _fmt(m: dict) -> str:
    slots = " ".join(f"{x:.2f}" for x in m.get("slot_acc", []))
    sampled = " ".join(f"{x:.2f}" for x in m.get("slot_sampled", []))
    engine = ""
    if math.isfinite(m.get("engine_len", math.nan)):
        engine = (f"engine-simulated mean accepted length {m['engine_len']:.2f} (n_max 3: "
                  f"{m['engine_len_3']:.2f}, on {m['engine_seqs']} greedy sequences) ")
    return (f"loss {m['loss']:.4f} {engine}greedy accepted length ~{m['accept_len']:.2f} "
            f"per-slot top-1 agreement [{slots}]" + (f" sampled (T 1) [{sampled}]" if sampled else ""))


def validation_score(val: dict) -> float:
    """What the best checkpoint is chosen by: the engine-simulated mean accepted length when
    validation has greedy sequences to simulate on, else the per-anchor proxy."""
    e = val.get("engine_len", math.nan)
    return e if math.isfinite(e) else val["accept_len"]


def check_block_size_min(c) -> None:
    if c.block_size_min and not 1 <= c.block_size_min < c.block_size:
        raise ValueError(f"--block-size-min {c.block_size_min}: must be 1 to {c.block_size - 1} "
                         f"for a block of {c.block_size} (0: whole blocks only)")


def block_lengths(c, shape, gen: torch.Generator, device) -> Optional[torch.Tensor]:
    """Each training block's length [B, A] for a drafter with block_size_min (else None): half
    of the blocks whole, as every engine without pyspec's key decodes them, the other half cut
    uniformly to block_size_min .. block_size - 1, as pyspec's engine decodes a round of fewer
    drafts."""
    if not c.block_size_min:
        return None
    K = c.block_size
    cut = torch.randint(c.block_size_min, K, shape, generator=gen)
    whole = torch.rand(shape, generator=gen) < 0.5
    return torch.where(whole, torch.full(shape, K), cut).to(device)


def block_size_of(opt: TrainOptions) -> int:
    """The block length the run trains: --block-size, else --init-from's, else 7."""
    if opt.block_size is not None:
        return opt.block_size
    if opt.init_from and is_gguf(Path(opt.init_from)):
        return gguf_block_size(Path(opt.init_from))
    if opt.init_from:
        return int(json.loads((Path(opt.init_from) / "config.json").read_text())["block_size"])
    return 7


def train(opt: TrainOptions, log=print) -> Optional[Path]:
    """Trains and returns the hf/ directory (None with generate_only)."""
    from .validation import Validator, split
    t_start = time.time()
    deadline = t_start + opt.time_limit if opt.time_limit > 0 else None
    out = Path(opt.out)
    out.mkdir(parents=True, exist_ok=True)
    if opt.threads:
        torch.set_num_threads(opt.threads)
    device = torch.device(opt.device)
    torch.manual_seed(opt.seed)
    cuda = device.type == "cuda"
    amp = torch.bfloat16 if (opt.dtype == "bf16" or (opt.dtype == "auto" and cuda)) else None

    target, tok = _load_target(opt, device, amp, log)
    hp = target.hp
    seqs, prompt_lens = _training_data(opt, target, tok, device, deadline, log)
    if opt.generate_only:
        return None
    keep = [i for i, s in enumerate(seqs) if len(s) >= 3]
    seqs = [seqs[i] for i in keep]
    prompt_lens = [prompt_lens[i] for i in keep] if prompt_lens is not None else None
    train_idx, val_idx = split(seqs, prompt_lens, opt.val_fraction)
    if not train_idx:
        raise RuntimeError("no training sequences left after the validation split")
    validator = Validator(seqs, val_idx, opt.val_seqs, opt.batch, opt.anchors, device,
                          prompt_lens, block_size_of(opt)) \
        if val_idx and opt.val_seqs > 0 else None
    log(f"{len(train_idx)} training sequences, {len(val_idx)} held out for validation"
        + (f" (proxies on {len(validator)} of them)" if validator else ""))

    layers = parse_target_layers(opt.target_layers, hp.n_layer)
    mask_id = opt.mask_token_id if opt.mask_token_id is not None else choose_mask_token(tok)
    d2t = None
    if 0 < opt.draft_vocab < hp.n_vocab:
        d2t = draft_vocabulary(seqs, prompt_lens, train_idx, opt.draft_vocab, hp.n_vocab,
                               sorted(tok.eog_ids) + [tok.eos_id])
    drafter = build_drafter(opt, hp, layers, mask_id, log, d2t).to(device)
    cfg = drafter.c
    layers = cfg.target_layers
    log(f"drafter reads layer inputs {layers}; mask token {cfg.mask_token_id} "
        f"({tok.token_text(cfg.mask_token_id)!r})")
    if drafter.d2t is not None:
        n_in = n_all = 0
        mask_v = torch.zeros(hp.n_vocab, dtype=torch.bool)
        mask_v[drafter.d2t.cpu()] = True
        for i in train_idx + val_idx:
            pl = prompt_lens[i] if prompt_lens is not None else 0
            cont = torch.as_tensor(seqs[i][pl:], dtype=torch.long)
            n_in += int(mask_v[cont].sum())
            n_all += len(cont)
        cov = n_in / max(1, n_all)
        log(f"draft vocabulary: {cfg.vd} of {hp.n_vocab} tokens cover {100 * cov:.2f}% of the "
            f"generated tokens (training split counted)")
    optim = torch.optim.AdamW(drafter.parameters(), lr=opt.lr, weight_decay=0.0,
                              betas=(0.9, 0.95))
    step = 0
    best: Optional[dict] = None           # {"step", "val"}: the weights in hf/
    state_path = out / "train_state.pt"
    gen = torch.Generator().manual_seed(opt.seed)
    rng = random.Random(opt.seed)
    if opt.resume and state_path.exists():
        st = torch.load(state_path, map_location=device, weights_only=False)
        drafter.load_state_dict(st["drafter"])
        optim.load_state_dict(st["optim"])
        step = st["step"]
        gen.set_state(st["gen"].cpu())
        rng.setstate(st["rng"])
        best = st.get("best")
        log(f"resumed at step {step} from {state_path}")

    def save_state():
        torch.save({"drafter": drafter.state_dict(), "optim": optim.state_dict(), "step": step,
                    "gen": gen.get_state(), "rng": rng.getstate(), "best": best,
                    "config": cfg.hf_config()}, state_path)

    def save_hf():
        drafter.save_hf(out / "hf", opt.max_shard_mib, opt.hf_dtype, head=target.head)

    evals_since_best = 0
    last_eval_step = -1

    def evaluate(train_metrics: Optional[dict]) -> None:
        """Validation proxies; hf/ follows the best of them (or the latest without them)."""
        nonlocal best, evals_since_best, last_eval_step
        last_eval_step = step
        rec = {"step": step, "train": train_metrics}
        if validator is None:
            save_hf()
        else:
            t0 = time.time()
            val = validator.evaluate(drafter, target, layers, amp, opt.gamma)
            rec["val"] = val
            score, best_score = validation_score(val), \
                (validation_score(best["val"]) if best is not None else None)
            better = best is None or score > best_score or (
                score == best_score and val["loss"] < best["val"]["loss"])
            if better:
                best = {"step": step, "val": val}
                evals_since_best = 0
                save_hf()
            else:
                evals_since_best += 1
            log(f"step {step} validation ({time.time() - t0:.1f}s): {_fmt(val)}"
                + ("  * best so far, hf/ updated" if better else
                   f"  (best: step {best['step']}, {validation_score(best['val']):.2f})"))
        with open(out / "eval_log.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    embedding, head = target.embedding.detach(), target.head.detach()
    token_weight = None       # validation keeps the plain loss, comparable across runs
    if opt.piece_weight != 1.0:
        from .loss import word_piece_ids
        token_weight = torch.ones(hp.n_vocab, device=device)
        pieces = word_piece_ids(tok)
        token_weight[torch.tensor(pieces, dtype=torch.long, device=device)] = opt.piece_weight
        log(f"slots whose label continues a word ({len(pieces)} token ids) weigh "
            f"{opt.piece_weight:g} in the training loss")
    if opt.init_from and step == 0 and validator is not None:
        evaluate(None)       # the starting point competes too: training must beat it
    drafter.train()
    bar = tqdm(total=opt.steps, initial=step, desc="training", unit="step",
               disable=not opt.progress)
    ema = None
    last = None
    order: List[int] = []
    eval_every = opt.eval_every or opt.save_every
    t_train, step0 = time.time(), step
    stopped = ""
    while step < opt.steps:
        if deadline is not None and time.time() > deadline:
            stopped = f"time limit ({opt.time_limit:.0f}s) reached"
            break
        if opt.patience and evals_since_best >= opt.patience:
            stopped = f"no validation improvement in {opt.patience} evaluations"
            break
        if len(order) < opt.batch:
            order += rng.sample(train_idx, len(train_idx))
        idx, order = order[:opt.batch], order[opt.batch:]
        tokens, lengths = _batch(seqs, idx, device)
        # The engine drafts from the prompt's last token on (the first round's anchor).
        starts = [max(0, prompt_lens[i] - 1) for i in idx] \
            if opt.anchor_region == "continuation" and prompt_lens is not None else None
        anchors = _anchors(lengths.cpu(), opt.anchors, gen, starts).to(device)
        time_frac = 0.0 if deadline is None else (time.time() - t_train) / max(1e-9, deadline - t_train)
        for g in optim.param_groups:
            g["lr"] = lr_at(step, opt.steps, opt.lr, opt.warmup, time_frac)
        with torch.no_grad():
            feats, t_logits = target_features(target, tokens, lengths, layers)
        blens = block_lengths(drafter.c, tuple(anchors.shape), gen, device)
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            res = drafter(feats, tokens, anchors, embedding, head, blens)
        losses = dspark_loss(res, t_logits, tokens, lengths, anchors, opt.gamma, token_weight,
                             blens)
        optim.zero_grad(set_to_none=True)
        losses["loss"].backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optim.step()
        step += 1
        vals = {k: float(v.detach()) for k, v in losses.items() if k not in SLOT_KEYS}
        ema = vals if ema is None else {k: 0.9 * ema[k] + 0.1 * v for k, v in vals.items()}
        bar.set_postfix(loss=f"{ema['loss']:.3f}", ce=f"{ema['ce']:.2f}",
                        tv=f"{ema['l1'] / 2:.3f}", acc_len=f"{ema['accept_len']:.2f}")
        bar.update(1)
        last = dict(ema, **{k: losses[k].tolist() for k in SLOT_KEYS})
        if step % eval_every == 0 or step == opt.steps:
            rate = (step - step0) / max(1e-9, time.time() - t_train)
            log(f"step {step} ({rate:.2f} steps/s) training batches: {_fmt(last)}")
            evaluate(last)
        if step % opt.save_every == 0 or step == opt.steps:
            save_state()        # after evaluate: the state records the best including this step
    bar.close()
    if stopped:
        log(f"stopped at step {step}: {stopped}")
    if last_eval_step != step and (stopped or best is None or not (out / "hf").exists()):
        evaluate(last)       # the weights at the stop compete too (and hf/ must exist)
    if not state_path.exists() or stopped:
        save_state()
    if best is not None:
        log(f"final drafter (hf/): step {best['step']} of {step}, chosen by validation: "
            f"{_fmt(best['val'])}")
    else:
        log(f"final drafter (hf/): step {step} (no validation sequences)")
    (out / "train_log.json").write_text(json.dumps(
        {"step": step, "ema": ema, "best": best, "stopped": stopped or None}, indent=1))
    return out / "hf"


def convert_checkpoint(hf_dir: Path, target: str, outfile: Path, outtype: str = "f16") -> Path:
    from ..convert import convert
    convert(hf_dir, outfile, outtype, target_model_dir=target, progress=False)
    return outfile
