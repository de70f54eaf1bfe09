"""Held-out validation: which sequences are never trained on, and the proxies measured on them.

The split hashes each sequence's prompt (not its position in the data), so it is the same however
shard sets are combined or reordered and across --resume / --init-from sessions: a sequence held
out once stays held out, and the greedy and sampled continuations of one prompt land on the same
side (otherwise the drafter would have seen a validation prompt's text).

The proxies are the training loss's own (dspark_loss: loss, greedy accepted length, per-slot top-1
agreement with the target) on a fixed subset of validation sequences with fixed anchors, so values
logged at different steps, and in different sessions, are comparable.
"""

from __future__ import annotations

import hashlib
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .loss import dspark_loss

VAL_ANCHOR_SEED = 12345     # fixed: validation anchors do not depend on --seed


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
                 batch: int, anchors: int, device):
        # The n with the lowest hashes: a fixed subset, and the same one when data is added.
        order = sorted(val_idx, key=lambda i: _unit_hash(seqs[i], 0))[:n]
        self.seqs = [list(seqs[i]) for i in order]
        self.batch, self.n_anchors, self.device = batch, anchors, device

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
        slot = None
        weight = 0.0
        for b0 in range(0, len(self.seqs), self.batch):
            idx = list(range(b0, min(b0 + self.batch, len(self.seqs))))
            tokens, lengths = _batch(self.seqs, idx, self.device)
            anchors = _anchors(lengths.cpu(), self.n_anchors, gen).to(self.device)
            feats, t_logits = target_features(target, tokens, lengths, layers)
            with torch.autocast(self.device.type, dtype=amp, enabled=amp is not None):
                res = drafter(feats, tokens, anchors, emb, head)
            losses = dspark_loss(res, t_logits, tokens, lengths, anchors, gamma)
            w = float(len(idx))
            for k, v in losses.items():
                if k != "slot_acc" and torch.isfinite(v):
                    tot[k] = tot.get(k, 0.0) + w * float(v)
            sa = losses["slot_acc"].float().cpu() * w
            slot = sa if slot is None else slot + sa
            weight += w
        drafter.train(was_training)
        out: Dict[str, object] = {k: v / max(weight, 1e-9) for k, v in tot.items()}
        out["slot_acc"] = (slot / max(weight, 1e-9)).tolist() if slot is not None else []
        return out
