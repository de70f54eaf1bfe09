"""The DSpark loss (reference §8): 0.1·CE + 0.9·L1(p_draft − p_target) + 1.0·BCE(conf, 1 − TV),
each slot k weighted by exp(−k/γ) (γ = 4), averaged over the valid slots.

Slot k of the block at anchor a predicts the token at a + k + 1: its label is tokens[a + k + 1] and
its target distribution is softmax(target logits at position a + k).

Reduced draft vocabulary (d2t, Vd < V). The drafter can only propose draft-vocabulary tokens, and
verification accepts a draft from q (support Vd) against the target's full p with probability
sum_x min(q_x, p_x) = 1 - TV(q, p). So the terms use the target's full softmax p, not renormalised:
    L1 = sum_{d in Vd} |q_d - p_{d2t[d]}| + (1 - sum_{d in Vd} p_{d2t[d]})
i.e. exactly ||q - p||_1 over the full vocabulary with q = 0 off Vd (the last term, the target's
mass outside the draft vocabulary, has no gradient but keeps TV and so the confidence target
1 - TV the true acceptance probability of the slot). CE: a label outside the draft vocabulary
cannot be drafted and is ignored (its slot still counts in L1 and BCE; the CE mean is over the
labels inside). The greedy proxy compares d2t[argmax q] with the target's full-vocabulary argmax
(the engine accepts a greedy draft iff it equals the target's argmax).

Label weights (token_weight, --piece-weight): a slot's weight may also be scaled by a per-token
factor of its label, e.g. up for tokens that continue a word (word_piece_ids), where a trained
drafter's first draft is accepted least (docs/training.md). Every term is then the weighted mean
over the slots, so with all factors 1 the loss is the plain one."""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

W_CE, W_L1, W_CONF = 0.1, 0.9, 1.0


def word_piece_ids(tokenizer) -> List[int]:
    """The ids of normal tokens that continue a word: their text starts with a letter or digit
    (no leading space mark, as SentencePiece's '▁', no punctuation), as "iffel" after "the E" -
    the pieces a drafter most often gets wrong. Byte-level BPE writes the bytes that are not
    printable (space, newline, tab, ...) as the characters U+0100-U+0143 ('Ġ' a space), which
    are letters to Python, so those never start a word piece there."""
    byte_level = tokenizer.model == "gpt2"
    out = []
    for tid in range(tokenizer.n_vocab):
        if tokenizer.token_type(tid) != 1:
            continue
        c = tokenizer.token_text(tid)[:1]
        if c.isalnum() and not (byte_level and 0x100 <= ord(c) <= 0x143):
            out.append(tid)
    return out


# dspark_loss's per-slot outputs (vectors over the block's slots; the rest are scalars).
SLOT_KEYS = ("slot_acc", "slot_sampled")


def dspark_loss(out: Dict[str, torch.Tensor], target_logits: torch.Tensor, tokens: torch.Tensor,
                lengths: torch.Tensor, anchors: torch.Tensor, gamma: float = 4.0,
                token_weight: Optional[torch.Tensor] = None,
                block_lens: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """out: DSparkDrafter.forward's dict; target_logits [B, L, V]; tokens [B, L]; lengths [B];
    anchors [B, A]; token_weight [V] (optional): each slot's weight times its label's factor;
    block_lens [B, A] (optional): the blocks' lengths, slots past them not counted.
    Returns loss and its parts (detached) plus per-slot acceptance proxies: slot_acc, the
    drafter's argmax equal to the target's (greedy); slot_sampled, 1 - TV = sum min(p, q), the
    chance a draft sampled from the drafter's law survives rejection against the target's at T 1
    (what the TV term trains, and what greedy agreement does not show)."""
    logits = out["logits"]                                     # [B, A, K, Vd] float32
    d2t = out.get("d2t")
    B, A, K, Vd = logits.shape
    L, V = tokens.shape[1], target_logits.shape[-1]
    dev = tokens.device
    offs = torch.arange(K, device=dev)
    pos = anchors[:, :, None] + offs                           # position of the slot's input
    valid = (pos + 1) < lengths[:, None, None]                 # label inside the sequence
    if block_lens is not None:
        valid = valid & (offs[None, None, :] < block_lens[:, :, None])
    pos_c = pos.clamp(max=L - 2)
    labels = torch.gather(tokens, 1, (pos_c + 1).reshape(B, -1)).view(B, A, K)
    t_logits = torch.gather(target_logits, 1, pos_c.reshape(B, -1, 1).expand(-1, -1, V))
    p_t = torch.softmax(t_logits.float().view(B, A, K, V), -1)
    logp_d = torch.log_softmax(logits, -1)
    p_d = logp_d.exp()
    w = torch.exp(-offs.float() / gamma)[None, None, :] * valid.float()
    if token_weight is not None:
        w = w * token_weight.to(dev)[labels]
    denom = w.sum().clamp(min=1e-6)
    if d2t is None:
        l1 = (p_d - p_t).abs().sum(-1)
        w_ce = w
    else:
        d2t = d2t.to(dev)
        p_in = p_t.index_select(-1, d2t)                       # target mass on the draft vocab
        outside = (1.0 - p_in.sum(-1)).clamp(min=0.0)
        l1 = (p_d - p_in).abs().sum(-1) + outside
        t2d = torch.full((V,), -1, dtype=torch.long, device=dev)
        t2d[d2t] = torch.arange(Vd, device=dev)
        labels = t2d[labels]
        w_ce = w * (labels >= 0).float()
        labels = labels.clamp(min=0)
    ce_denom = w_ce.sum().clamp(min=1e-6)
    ce = -torch.gather(logp_d, -1, labels[..., None]).squeeze(-1)
    tv = 0.5 * l1
    loss = W_CE * (ce * w_ce).sum() / ce_denom + W_L1 * (l1 * w).sum() / denom
    parts = dict(ce=(ce * w_ce).sum() / ce_denom, l1=(l1 * w).sum() / denom)
    if out.get("conf") is not None:
        bce = F.binary_cross_entropy_with_logits(out["conf"].float(), (1 - tv).detach(),
                                                 reduction="none")
        parts["bce"] = (bce * w).sum() / denom
        loss = loss + W_CONF * parts["bce"]
    with torch.no_grad():
        # Greedy acceptance proxy: slot k's argmax equals the target argmax, along the block.
        drafted = logits.argmax(-1)
        if d2t is not None:
            drafted = d2t[drafted]
        hit = (drafted == t_logits.view(B, A, K, V).argmax(-1)) & valid
        run = torch.cumprod(hit.float(), -1)
        vb = valid.all(-1)
        acc_len = (run.sum(-1)[vb].mean() + 1) if bool(vb.any()) else torch.tensor(math.nan)
        n_valid = valid.float().sum((0, 1)).clamp(min=1)
        per_slot = (hit.float() * valid).sum((0, 1)) / n_valid
        sampled = ((1.0 - tv.detach()) * valid).sum((0, 1)) / n_valid
    return dict(loss=loss, **{k: v.detach() for k, v in parts.items()},
                accept_len=acc_len.detach(), slot_acc=per_slot.detach(),
                slot_sampled=sampled.detach())
