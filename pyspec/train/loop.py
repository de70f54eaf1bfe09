"""The training loop and its checkpoints.

Files in --out:
    data.pt            the generated training sequences (token ids), reused on --resume
    train_state.pt     drafter weights, optimizer and scheduler state, step, RNG state (--resume)
    hf/                the Hugging Face checkpoint (config.json + model.safetensors)
    drafter-<type>.gguf  hf/ converted with pyspec-convert --target-model-dir TARGET
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
from .loss import dspark_loss
from .target import TargetModel


@dataclass
class TrainOptions:
    target: str
    out: str
    steps: int = 2000
    block_size: int = 7
    layers: int = 3
    target_layers: str = "auto"
    markov_rank: int = 128
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


def _anchors(lengths: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    rows = []
    for ln in lengths.tolist():
        m = max(1, ln - 1)                     # anchors 0..ln-2 have a label
        if m >= n:
            a = torch.randperm(m, generator=gen)[:n]
        else:
            a = torch.randint(0, m, (n,), generator=gen)
        rows.append(a.sort().values)
    return torch.stack(rows)


def target_features(target: TargetModel, tokens, lengths, layers: List[int]):
    valid = torch.arange(tokens.shape[1], device=tokens.device)[None] < lengths[:, None]
    logits, inp = target(tokens, valid=valid, layers=layers)
    feats = torch.cat([inp[l] for l in layers], -1)
    return feats, logits


def lr_at(step: int, total: int, peak: float, warmup: float) -> float:
    w = max(1, int(total * warmup))
    if step < w:
        return peak * (step + 1) / w
    t = (step - w) / max(1, total - w)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def train(opt: TrainOptions, log=print) -> Path:
    from ..tokenizer import Tokenizer
    from .data import generate_dataset
    out = Path(opt.out)
    out.mkdir(parents=True, exist_ok=True)
    if opt.threads:
        torch.set_num_threads(opt.threads)
    device = torch.device(opt.device)
    torch.manual_seed(opt.seed)
    cuda = device.type == "cuda"
    amp = torch.bfloat16 if (opt.dtype == "bf16" or (opt.dtype == "auto" and cuda)) else None

    t0 = time.time()
    target = TargetModel.from_gguf(opt.target).to(device)
    if amp is not None:
        target = target.to(amp)
    hp = target.hp
    tok = Tokenizer.from_gguf(opt.target)
    layers = parse_target_layers(opt.target_layers, hp.n_layer)
    mask_id = opt.mask_token_id if opt.mask_token_id is not None else choose_mask_token(tok)
    log(f"target {opt.target}: {hp.arch}, {hp.n_layer} layers, hidden {hp.n_embd}, vocab "
        f"{hp.n_vocab}; drafter reads layer inputs {layers}; mask token {mask_id} "
        f"({tok.token_text(mask_id)!r}); loaded in {time.time() - t0:.1f}s")

    data_path = out / "data.pt"
    if data_path.exists() and opt.resume:
        seqs = torch.load(data_path)["seqs"]
        log(f"{len(seqs)} training sequences from {data_path}")
    else:
        t0 = time.time()
        seqs = generate_dataset(target, tok, opt.data_prompts, opt.seq_len, device,
                                opt.gen_batch, opt.seed, progress=opt.progress)
        torch.save({"seqs": seqs, "target": str(opt.target)}, data_path)
        n_tok = sum(len(s) for s in seqs)
        log(f"generated {len(seqs)} sequences ({n_tok} tokens) in {time.time() - t0:.1f}s")
    seqs = [s for s in seqs if len(s) >= 3]

    cfg = DrafterConfig(hidden_size=hp.n_embd, intermediate_size=hp.n_ff,
                        num_hidden_layers=opt.layers, num_attention_heads=hp.n_head,
                        num_key_value_heads=hp.n_head_kv, head_dim=hp.head_dim,
                        vocab_size=hp.n_vocab, target_layers=layers, mask_token_id=mask_id,
                        block_size=opt.block_size, markov_rank=opt.markov_rank,
                        rms_norm_eps=hp.rms_eps, rope_theta=hp.rope_freq_base,
                        max_position_embeddings=hp.n_ctx_train,
                        extra=dict(target=Path(opt.target).name, seq_len=opt.seq_len,
                                   mask_choice="rare control token (see pyspec.train)"))
    drafter = DSparkDrafter(cfg).to(device)
    optim = torch.optim.AdamW(drafter.parameters(), lr=opt.lr, weight_decay=0.0,
                              betas=(0.9, 0.95))
    step = 0
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
        log(f"resumed at step {step} from {state_path}")

    def save(final: bool = False):
        torch.save({"drafter": drafter.state_dict(), "optim": optim.state_dict(), "step": step,
                    "gen": gen.get_state(), "rng": rng.getstate(),
                    "config": cfg.hf_config()}, state_path)
        drafter.save_hf(out / "hf", opt.max_shard_mib)

    embedding, head = target.embedding.detach(), target.head.detach()
    drafter.train()
    bar = tqdm(total=opt.steps, initial=step, desc="training", unit="step",
               disable=not opt.progress)
    ema = None
    order: List[int] = []
    t_train, step0 = time.time(), step
    while step < opt.steps:
        if len(order) < opt.batch:
            order += rng.sample(range(len(seqs)), len(seqs))
        idx, order = order[:opt.batch], order[opt.batch:]
        tokens, lengths = _batch(seqs, idx, device)
        anchors = _anchors(lengths.cpu(), opt.anchors, gen).to(device)
        for g in optim.param_groups:
            g["lr"] = lr_at(step, opt.steps, opt.lr, opt.warmup)
        with torch.no_grad():
            feats, t_logits = target_features(target, tokens, lengths, layers)
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            res = drafter(feats, tokens, anchors, embedding, head)
        losses = dspark_loss(res, t_logits, tokens, lengths, anchors, opt.gamma)
        optim.zero_grad(set_to_none=True)
        losses["loss"].backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optim.step()
        step += 1
        vals = {k: float(v.detach()) for k, v in losses.items() if k != "slot_acc"}
        ema = vals if ema is None else {k: 0.9 * ema[k] + 0.1 * v for k, v in vals.items()}
        bar.set_postfix(loss=f"{ema['loss']:.3f}", ce=f"{ema['ce']:.2f}",
                        tv=f"{ema['l1'] / 2:.3f}", acc_len=f"{ema['accept_len']:.2f}")
        bar.update(1)
        if step % opt.save_every == 0 or step == opt.steps:
            save()
            slots = " ".join(f"{x:.2f}" for x in losses["slot_acc"].tolist())
            rate = (step - step0) / max(1e-9, time.time() - t_train)
            log(f"step {step} ({rate:.2f} steps/s): loss {ema['loss']:.4f} greedy accepted length ~{ema['accept_len']:.2f}"
                f" per-slot top-1 agreement [{slots}]")
    bar.close()
    if not state_path.exists():
        save()
    (out / "train_log.json").write_text(json.dumps({"step": step, "ema": ema}, indent=1))
    return out / "hf"


def convert_checkpoint(hf_dir: Path, target: str, outfile: Path, outtype: str = "f16") -> Path:
    from ..convert import convert
    convert(hf_dir, outfile, outtype, target_model_dir=target, progress=False)
    return outfile
