"""Held-out validation: which sequences are never trained on, and the proxies measured on them.

The split hashes each sequence's prompt (not its position in the data), so it is the same however
shard sets are combined or reordered and across --resume / --init-from sessions: a sequence held
out once stays held out, and the greedy and sampled continuations of one prompt land on the same
side (otherwise the drafter would have seen a validation prompt's text).

The proxies are the training loss's own (dspark_loss: loss, greedy accepted length, per-slot top-1
agreement with the target and per-slot sampled agreement, 1 - TV) on a fixed subset of validation sequences with fixed anchors (in the
generated part, as training's), so values logged at different steps, and in different sessions,
are comparable.

The per-anchor proxy overstates what the engine sees: the engine drafts only where the previous
round stopped, which is where the drafter was just wrong, so hard positions are over-represented.
So validation also replays greedy speculative decoding itself on the validation sequences the
target generated greedily (continuation = the target's argmax at >= 95% of positions): the
drafter is run at every anchor of the continuation, and rounds are simulated as the engine runs
them (draft from the anchor, accept the leading drafts equal to the target's argmax, the next
anchor follows the last accepted token; simulate_rounds). On SmolLM2 this simulation matched the
C++ engine's measured mean accepted length to 0.002. The best checkpoint is chosen by it.
"""

from __future__ import annotations

import hashlib
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .loss import SLOT_KEYS, dspark_loss

VAL_ANCHOR_SEED = 12345     # fixed: validation anchors do not depend on --seed
GREEDY_AGREEMENT = 0.95     # a continuation this close to the target's argmax was greedy
ENGINE_CHUNK = 128          # anchors per drafter forward in the engine simulation


def simulate_rounds(hits: np.ndarray, n_max: int, max_tokens: Optional[int] = None
                    ) -> Tuple[int, int]:
    """(rounds, accepted drafts) of greedy speculative decoding along one sequence: hits[a, k]
    says whether slot k of the block anchored at continuation position a drafts the target's
    token (False past the sequence's end). A round at anchor a accepts the leading run of hits
    (at most n_max) and the next round starts after the bonus token, at a + run + 1. As the
    engine: the first round is anchored at the prompt's last token (row 0 of hits), and with
    max_tokens a round drafts at most max_tokens - emitted - 1 (the last ones none at all, and
    still count as rounds)."""
    rounds = accepted = 0
    a, n = 0, hits.shape[0]
    emitted = 0
    while a < n and (max_tokens is None or emitted < max_tokens):
        k_max = min(n_max, hits.shape[1])
        if max_tokens is not None:
            k_max = max(0, min(k_max, max_tokens - emitted - 1))
        run = 0
        while run < k_max and hits[a, run]:
            run += 1
        rounds += 1
        accepted += run
        a += run + 1
        emitted += run + 1
    return rounds, accepted


def _unit_hash(seq: Sequence[int], prompt_len: int) -> float:
    key = np.asarray(seq[:prompt_len] if prompt_len > 0 else seq, np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") / 2.0 ** 64


def split(seqs: Sequence[Sequence[int]], prompt_lens: Optional[Sequence[int]],
          fraction: float) -> Tuple[List[int], List[int]]:
    """(train indices, validation indices): a sequence is held out iff its prompt's hash falls
    below fraction. Without prompt lengths (data.pt of older runs) the whole sequence is hashed."""
    train, val = [], []
    for i, s in enumerate(seqs):
        pl = prompt_lens[i] if prompt_lens is not None else 0
        (val if fraction > 0 and _unit_hash(s, pl) < fraction else train).append(i)
    return train, val


class Validator:
    """Proxies on up to n fixed validation sequences, batch at a time."""

    def __init__(self, seqs: Sequence[Sequence[int]], val_idx: Sequence[int], n: int,
                 batch: int, anchors: int, device,
                 prompt_lens: Optional[Sequence[int]] = None, block_size: int = 7):
        # The n with the lowest hashes: a fixed subset, and the same one when data is added.
        order = sorted(val_idx, key=lambda i: _unit_hash(seqs[i], 0))[:n]
        self.seqs = [list(seqs[i]) for i in order]
        self.prompt_lens = [prompt_lens[i] for i in order] if prompt_lens is not None else None
        self.batch, self.n_anchors, self.device = batch, anchors, device
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.seqs)

    @torch.no_grad()
    def evaluate(self, drafter, target, layers, amp, gamma: float) -> Dict[str, object]:
        from .loop import _anchors, _batch, target_features
        was_training = drafter.training
        drafter.eval()
        gen = torch.Generator().manual_seed(VAL_ANCHOR_SEED)
        emb, head = target.embedding.detach(), target.head.detach()
        tot: Dict[str, float] = {}
        slots: Dict[str, torch.Tensor] = {}
        weight = 0.0
        sim = {"rounds": 0, "accepted": 0, "rounds_3": 0, "accepted_3": 0, "seqs": 0}
        for b0 in range(0, len(self.seqs), self.batch):
            idx = list(range(b0, min(b0 + self.batch, len(self.seqs))))
            tokens, lengths = _batch(self.seqs, idx, self.device)
            starts = [self.prompt_lens[i] for i in idx] if self.prompt_lens is not None else None
            anchors = _anchors(lengths.cpu(), self.n_anchors, gen,
                               [max(0, s - 1) for s in starts] if starts else None).to(self.device)
            feats, t_logits = target_features(target, tokens, lengths, layers)
            if starts is not None:
                self._simulate(drafter, feats, t_logits, tokens, lengths, starts, emb, head,
                               amp, sim)
            with torch.autocast(self.device.type, dtype=amp, enabled=amp is not None):
                res = drafter(feats, tokens, anchors, emb, head)
            losses = dspark_loss(res, t_logits, tokens, lengths, anchors, gamma)
            w = float(len(idx))
            for k, v in losses.items():
                if k in SLOT_KEYS:
                    sv = v.float().cpu() * w
                    slots[k] = slots[k] + sv if k in slots else sv
                elif torch.isfinite(v):
                    tot[k] = tot.get(k, 0.0) + w * float(v)
            weight += w
        drafter.train(was_training)
        out: Dict[str, object] = {k: v / max(weight, 1e-9) for k, v in tot.items()}
        for k in SLOT_KEYS:
            out[k] = (slots[k] / max(weight, 1e-9)).tolist() if k in slots else []
        out["engine_seqs"] = sim["seqs"]
        out["engine_len"] = (sim["accepted"] + sim["rounds"]) / sim["rounds"] \
            if sim["rounds"] else float("nan")
        out["engine_len_3"] = (sim["accepted_3"] + sim["rounds_3"]) / sim["rounds_3"] \
            if sim["rounds_3"] else float("nan")
        return out

    def _simulate(self, drafter, feats, t_logits, tokens, lengths, starts, emb, head, amp,
                  sim: Dict[str, int]) -> None:
        """Adds the engine-simulated rounds of the batch's greedy sequences to sim. A drafter
        trained on cut blocks (block_size_min) drafts 3 a round from a block of max(3, min)
        rows, as the engine then decodes it."""
        args = (drafter, feats, t_logits, tokens, lengths, starts, emb, head, amp, self.block_size,
                self.device)
        whole = self.continuation_hits(*args)
        bmin = drafter.c.block_size_min
        short = self.continuation_hits(*args, block_len=max(3, bmin)) \
            if bmin and max(3, bmin) < self.block_size else whole
        for h, h3 in zip(whole, short):
            for n_max, hits, kr, ka in ((self.block_size, h, "rounds", "accepted"),
                                        (3, h3, "rounds_3", "accepted_3")):
                rounds, acc = simulate_rounds(hits, n_max)
                sim[kr] += rounds
                sim[ka] += acc
            sim["seqs"] += 1

    @staticmethod
    @torch.no_grad()
    def continuation_hits(drafter, feats, t_logits, tokens, lengths, starts, emb, head, amp,
                          K: int, device, block_len: Optional[int] = None) -> List[np.ndarray]:
        """For each greedy sequence of the batch, hits [n anchors, K]: the drafter run at every
        anchor the engine may draft from (the prompt's last token .. length - 2), slot k compared
        with the target's argmax at anchor + k. starts: the prompt lengths. block_len: blocks cut
        to that many rows (slots past it never hit)."""
        argmax = t_logits.argmax(-1)                                   # [B, L]
        out = []
        for r, (ln, pl) in enumerate(zip(lengths.tolist(), starts)):
            if pl < 1 or ln - pl < 1:
                continue
            cont = torch.arange(pl - 1, ln - 1, device=tokens.device)
            agree = (argmax[r, cont] == tokens[r, cont + 1]).float().mean()
            if float(agree) < GREEDY_AGREEMENT:
                continue
            hits = []
            for c0 in range(0, len(cont), ENGINE_CHUNK):
                a = cont[c0:c0 + ENGINE_CHUNK][None]                     # [1, A]
                with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                    blens = None if block_len is None else torch.full_like(a, block_len)
                    res = drafter(feats[r:r + 1, :ln], tokens[r:r + 1, :ln], a, emb, head, blens)
                drafted = res["logits"][0].argmax(-1)                    # [A, K]
                if res.get("d2t") is not None:
                    drafted = res["d2t"].to(drafted.device)[drafted]
                pos = a[0][:, None] + torch.arange(K, device=a.device)   # slot k reads pos a + k
                inside = pos + 1 < ln
                want = argmax[r, pos.clamp(max=ln - 1)]
                if block_len is not None:
                    inside = inside & (torch.arange(K, device=a.device) < block_len)[None]
                hits.append(((drafted == want) & inside).cpu())
            out.append(torch.cat(hits).numpy())
        return out
