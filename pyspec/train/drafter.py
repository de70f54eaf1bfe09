"""The DSpark drafter in torch, the same model pyspec serves (csrc/model/dflash.cpp, reference
§1-§2), and its Hugging Face checkpoint (what `pyspec-convert --target-model-dir` converts).

Per target position p the feature row f_p = [layer input t0 | t1 | ...] (the target's layer inputs
at the GGUF target_layers, in that order) is fused: g_p = RMSNorm(fc f_p) * hidden_norm. For each
draft layer the context keys and values are K = RoPE(k_norm(Wk g_p), p), V = Wv g_p (no
input_layernorm on g). The block [anchor, MASK x (B-1)] at positions pos0..pos0+B-1 goes through
Qwen3 layers (pre-norm, per-head q_norm/k_norm, NEOX RoPE, GQA, SwiGLU) attending, non-causally,
to the context rows < pos0 plus the whole block; h = RMSNorm(x) * norm; base logits = target
head · h (embedding and head are the target's, frozen). Anchor-first layout: slot k predicts the
token at pos0 + k + 1. Markov head: e_k = W1[prev_k], logits_k = base_k + W2 e_k with prev_0 the
anchor and prev_k the previous slot's token (teacher-forced in training, the argmax of slot k-1
when drafting). Confidence head: c_k = sigmoid(conf · [h_k ; e_k] + b).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from .target import apply_rope, rms_norm, rope_angles

HF_ARCH = "DSparkDraftModel"
HF_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layers: List[int]          # GGUF convention: layer inputs (HF ids + 1)
    mask_token_id: int
    block_size: int = 7
    # 0: the drafter was trained on whole blocks only, which the engine then always decodes. Else
    # it was trained on blocks of every length from block_size_min to block_size (the trailing
    # slots cut), so the engine may decode just the rows a round drafts (pyspec's GGUF key
    # pyspec.drafter.block_size_min): a short round costs a short pass.
    block_size_min: int = 0
    markov_rank: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    confidence_head: bool = True
    draft_vocab_size: int = 0         # 0 (or vocab_size): the full target vocabulary, no d2t
    extra: Dict = field(default_factory=dict)

    @property
    def vd(self) -> int:
        """The draft vocabulary size (rows of the head and of markov_w2)."""
        return self.draft_vocab_size if 0 < self.draft_vocab_size < self.vocab_size \
            else self.vocab_size

    @property
    def reduced(self) -> bool:
        return self.vd < self.vocab_size

    def hf_config(self) -> dict:
        return dict(
            architectures=[HF_ARCH], model_type="qwen3",
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            vocab_size=self.vocab_size, max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, hidden_act="silu",
            tie_word_embeddings=False, torch_dtype="float32",
            block_size=self.block_size, mask_token_id=self.mask_token_id,
            **({"block_size_min": self.block_size_min} if self.block_size_min else {}),
            target_layer_ids=[int(t) - 1 for t in self.target_layers],
            markov_rank=self.markov_rank, markov_head_type="vanilla",
            sample_from_anchor=True, causal=False,
            enable_confidence_head=self.confidence_head,
            confidence_head_with_markov=self.confidence_head,
            **({"draft_vocab_size": self.vd} if self.reduced else {}),
            pyspec_train=self.extra)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "DrafterConfig":
        return cls(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                   num_hidden_layers=cfg["num_hidden_layers"],
                   num_attention_heads=cfg["num_attention_heads"],
                   num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
                   vocab_size=cfg["vocab_size"],
                   target_layers=[int(t) + 1 for t in cfg["target_layer_ids"]],
                   mask_token_id=cfg["mask_token_id"], block_size=cfg["block_size"],
                   block_size_min=int(cfg.get("block_size_min") or 0),
                   markov_rank=cfg["markov_rank"], rms_norm_eps=cfg["rms_norm_eps"],
                   rope_theta=cfg["rope_theta"],
                   max_position_embeddings=cfg["max_position_embeddings"],
                   confidence_head=cfg.get("enable_confidence_head", True),
                   draft_vocab_size=int(cfg.get("draft_vocab_size") or 0),
                   extra=cfg.get("pyspec_train", {}))


class DraftLayer(torch.nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        e, hd = c.hidden_size, c.head_dim
        self.input_layernorm = torch.nn.Parameter(torch.ones(e))
        self.post_attention_layernorm = torch.nn.Parameter(torch.ones(e))
        self.q_proj = torch.nn.Linear(e, c.num_attention_heads * hd, bias=False)
        self.k_proj = torch.nn.Linear(e, c.num_key_value_heads * hd, bias=False)
        self.v_proj = torch.nn.Linear(e, c.num_key_value_heads * hd, bias=False)
        self.o_proj = torch.nn.Linear(c.num_attention_heads * hd, e, bias=False)
        self.q_norm = torch.nn.Parameter(torch.ones(hd))
        self.k_norm = torch.nn.Parameter(torch.ones(hd))
        self.gate_proj = torch.nn.Linear(e, c.intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(e, c.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(c.intermediate_size, e, bias=False)


class DSparkDrafter(torch.nn.Module):
    """Trainable parameters only; the embedding and head are the target's, passed in."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        e, r = c.hidden_size, c.markov_rank
        self.fc = torch.nn.Linear(len(c.target_layers) * e, e, bias=False)
        self.hidden_norm = torch.nn.Parameter(torch.ones(e))
        self.layers = torch.nn.ModuleList([DraftLayer(c) for _ in range(c.num_hidden_layers)])
        self.norm = torch.nn.Parameter(torch.ones(e))
        self.markov_w1 = torch.nn.Parameter(torch.zeros(c.vocab_size, r))   # prev: target ids
        self.markov_w2 = torch.nn.Parameter(torch.zeros(c.vd, r))           # out: draft ids
        if c.confidence_head:
            self.conf_proj = torch.nn.Linear(e + r, 1, bias=True)
        # Reduced draft vocabulary: d2t[d] = the target id of draft id d (ascending target ids,
        # so argmax ties resolve to the lowest target id as in the engine's scattered row).
        if c.reduced:
            self.register_buffer("d2t", torch.arange(c.vd, dtype=torch.long))
        else:
            self.d2t = None
        self.reset_parameters()

    def set_d2t(self, d2t) -> None:
        d2t = torch.as_tensor(d2t, dtype=torch.long).flatten()
        if not self.c.reduced or d2t.numel() != self.c.vd:
            raise ValueError(f"d2t has {d2t.numel()} ids, the drafter's draft vocabulary "
                             f"{self.c.vd} of {self.c.vocab_size}")
        if bool((d2t[1:] <= d2t[:-1]).any()) or int(d2t[0]) < 0 or \
                int(d2t[-1]) >= self.c.vocab_size:
            raise ValueError("d2t must hold distinct ascending target ids")
        self.d2t.copy_(d2t.to(self.d2t.device))

    def draft_head(self, head: torch.Tensor) -> torch.Tensor:
        """The drafter's output matrix: the target's head, or its rows at d2t."""
        return head if self.d2t is None else head.index_select(0, self.d2t.to(head.device))

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.d2t is None else self.d2t.to(ids.device)[ids]

    def reduce_vocab(self, d2t) -> "DSparkDrafter":
        """A copy over the draft vocabulary d2t of this full-vocabulary drafter (markov_w2 keeps
        its rows at d2t; everything else is shared as is) - for --init-from --draft-vocab."""
        if self.c.reduced:
            raise ValueError("the drafter already has a reduced draft vocabulary")
        d2t = torch.as_tensor(d2t, dtype=torch.long)
        c = DrafterConfig(**{**self.c.__dict__, "draft_vocab_size": int(d2t.numel())})
        m = DSparkDrafter(c).to(self.markov_w1.device)
        sd = {k: v for k, v in self.state_dict().items() if k != "markov_w2"}
        m.load_state_dict(sd, strict=False)
        with torch.no_grad():
            m.markov_w2.copy_(self.markov_w2[d2t.to(self.markov_w2.device)])
        m.set_d2t(d2t)
        return m

    def grow(self, n_layers: int) -> "DSparkDrafter":
        """A copy with n_layers layers (more than this drafter's): the trained layers are kept and
        the new ones appended after them, their residual outputs (o_proj, down_proj) zero, so the
        copy computes exactly what this drafter does and training starts from there - capacity
        added to a trained drafter (--init-from --layers) without losing what it learned."""
        if n_layers <= self.c.num_hidden_layers:
            raise ValueError(f"grow to {n_layers} layers: the drafter already has "
                             f"{self.c.num_hidden_layers}")
        c = DrafterConfig(**{**self.c.__dict__, "num_hidden_layers": n_layers})
        m = DSparkDrafter(c).to(self.markov_w1.device)
        missing, unexpected = m.load_state_dict(self.state_dict(), strict=False)
        fresh = {f"layers.{i}." for i in range(self.c.num_hidden_layers, n_layers)}
        assert not unexpected and all(k[:k.index(".", 7) + 1] in fresh for k in missing), \
            (missing, unexpected)
        with torch.no_grad():
            for l in m.layers[self.c.num_hidden_layers:]:
                l.o_proj.weight.zero_()
                l.down_proj.weight.zero_()
        return m

    def add_target_layers(self, extra: List[int]) -> "DSparkDrafter":
        """A copy that also reads the target's layer inputs `extra`, appended after this
        drafter's (the GGUF order is the features' order): fc's columns for the new segments
        start at zero, so the copy computes exactly what this drafter does and training starts
        from there. Why: a trained drafter can be given a feature it lacked, e.g. the last
        layer's output (input n_layer), without losing what it learned (--init-from
        --target-layers)."""
        extra = [int(t) for t in extra]
        if not extra or len(set(extra)) != len(extra) or set(extra) & set(self.c.target_layers):
            raise ValueError(f"add target layers {extra}: they must be new and distinct (the "
                             f"drafter reads {self.c.target_layers})")
        c = DrafterConfig(**{**self.c.__dict__, "target_layers": list(self.c.target_layers) + extra})
        m = DSparkDrafter(c).to(self.markov_w1.device)
        if self.d2t is not None:
            m.set_d2t(self.d2t)
        sd = {k: v for k, v in self.state_dict().items() if k != "fc.weight"}
        missing, unexpected = m.load_state_dict(sd, strict=False)
        assert missing == ["fc.weight"] and not unexpected, (missing, unexpected)
        with torch.no_grad():
            n_old = self.fc.weight.shape[1]
            m.fc.weight.zero_()
            m.fc.weight[:, :n_old].copy_(self.fc.weight)
        return m

    def grow_markov(self, rank: int, generator: Optional[torch.Generator] = None) -> "DSparkDrafter":
        """A copy whose Markov head has rank `rank` (more than this drafter's): the trained
        columns of markov_w1 and markov_w2 are kept; the new columns of markov_w2 and the
        confidence head's weights on them start at zero, so the copy computes exactly what this
        drafter does, while the new columns of markov_w1 start random (std 0.02) so that
        gradients reach the new markov_w2 columns from the first step. The bigram bias is what
        continues a word's pieces (docs/training.md), so its rank is capacity worth adding."""
        r = self.c.markov_rank
        if rank <= r:
            raise ValueError(f"grow the Markov rank to {rank}: the drafter already has {r}")
        c = DrafterConfig(**{**self.c.__dict__, "markov_rank": int(rank)})
        m = DSparkDrafter(c).to(self.markov_w1.device)
        sd = self.state_dict()
        resized = {"markov_w1", "markov_w2", "conf_proj.weight"}
        m.load_state_dict({k: v for k, v in sd.items() if k not in resized}, strict=False)
        with torch.no_grad():
            w1 = torch.empty(c.vocab_size, rank - r, device=self.markov_w1.device)
            torch.nn.init.normal_(w1, std=0.02, generator=generator)
            m.markov_w1.copy_(torch.cat([self.markov_w1, w1.to(self.markov_w1.dtype)], 1))
            m.markov_w2.zero_()
            m.markov_w2[:, :r].copy_(self.markov_w2)
            if c.confidence_head:
                e = c.hidden_size
                m.conf_proj.weight.zero_()
                m.conf_proj.weight[:, :e + r].copy_(self.conf_proj.weight)
        return m

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, torch.nn.Linear):
                torch.nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    torch.nn.init.zeros_(m.bias)
        for l in self.layers:   # residual outputs start small (GPT-2 style)
            torch.nn.init.normal_(l.o_proj.weight, std=std / math.sqrt(2 * len(self.layers)))
            torch.nn.init.normal_(l.down_proj.weight, std=std / math.sqrt(2 * len(self.layers)))
        torch.nn.init.normal_(self.markov_w1, std=0.02)
        torch.nn.init.zeros_(self.markov_w2)    # no bias at the start: the backbone learns first

    # -- pieces shared by training and the reference drafting pass ----------------------------

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        return rms_norm(self.fc(feats), self.hidden_norm, self.c.rms_eps)

    def _rope(self, positions):
        return rope_angles(positions, self.c.head_dim, self.c.rope_theta)

    def _context_kv(self, layer: DraftLayer, g: torch.Tensor, cos, sin):
        c = self.c
        shp = g.shape[:-1] + (c.num_key_value_heads, c.head_dim)
        k = rms_norm(layer.k_proj(g).view(shp), layer.k_norm, c.rms_eps)
        k = apply_rope(k, cos, sin, neox=True)
        v = layer.v_proj(g).view(shp)
        return k, v

    def backbone(self, g: torch.Tensor, ctx_pos: torch.Tensor, x: torch.Tensor,
                 blk_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """g [B, Lc, E] fused context rows at ctx_pos [B, Lc]; x [B, N, E] block embeddings at
        blk_pos [B, N]; mask [B, N, Lc + N] bool (True: may attend). Returns h [B, N, E]."""
        c = self.c
        B, N, _ = x.shape
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        ccos, csin = self._rope(ctx_pos)
        bcos, bsin = self._rope(blk_pos)
        m = mask[:, None]
        for layer in self.layers:
            kc, vc = self._context_kv(layer, g, ccos, csin)
            h = rms_norm(x, layer.input_layernorm, c.rms_eps)
            q = rms_norm(layer.q_proj(h).view(B, N, nh, hd), layer.q_norm, c.rms_eps)
            kb = rms_norm(layer.k_proj(h).view(B, N, nkv, hd), layer.k_norm, c.rms_eps)
            vb = layer.v_proj(h).view(B, N, nkv, hd)
            q = apply_rope(q, bcos, bsin, neox=True)
            kb = apply_rope(kb, bcos, bsin, neox=True)
            k = torch.cat([kc.to(kb.dtype), kb], 1).transpose(1, 2)
            v = torch.cat([vc.to(vb.dtype), vb], 1).transpose(1, 2)
            att = F.scaled_dot_product_attention(q.transpose(1, 2), k.to(q.dtype), v.to(q.dtype),
                                                 attn_mask=m, enable_gqa=nh != nkv,
                                                 scale=1.0 / math.sqrt(hd))
            x = x + layer.o_proj(att.transpose(1, 2).reshape(B, N, nh * hd))
            h = rms_norm(x, layer.post_attention_layernorm, c.rms_eps)
            x = x + layer.down_proj(F.silu(layer.gate_proj(h)) * layer.up_proj(h))
        return rms_norm(x, self.norm, c.rms_eps)

    def markov(self, prev: torch.Tensor):
        """(e = W1[prev], bias = W2 e)."""
        e = F.embedding(prev, self.markov_w1)
        return e, e @ self.markov_w2.T

    def confidence_logit(self, h: torch.Tensor, e: torch.Tensor) -> Optional[torch.Tensor]:
        if not self.c.confidence_head:
            return None
        return self.conf_proj(torch.cat([h, e.to(h.dtype)], -1)).squeeze(-1)

    # -- training: many anchors per sequence in one pass ---------------------------------------

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                embedding: torch.Tensor, head: torch.Tensor,
                block_lens: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        """feats [B, L, n_tl*E], tokens [B, L], anchors [B, A] (positions, each block fully inside
        the sequence or its tail slots ignored by the loss). Teacher-forced Markov predecessors:
        prev_k = tokens[anchor + k]. block_lens [B, A] (optional): each block's length, its slots
        from there on neither seen by the others nor meant to be used (the loss drops them), as
        the engine decodes a shorter block. Returns logits [B, A, K, V] (base + Markov bias), h,
        conf logits [B, A, K] (or None)."""
        c = self.c
        B, L = tokens.shape
        A, K = anchors.shape[1], c.block_size
        dev = tokens.device
        offs = torch.arange(K, device=dev)
        blk_pos = (anchors[:, :, None] + offs).reshape(B, A * K)
        blk_tok = torch.full((B, A, K), c.mask_token_id, dtype=torch.long, device=dev)
        blk_tok[:, :, 0] = torch.gather(tokens, 1, anchors)
        x = F.embedding(blk_tok.reshape(B, A * K), embedding)
        g = self.fuse(feats)
        ctx_pos = torch.arange(L, device=dev).expand(B, L)
        # context key j visible to anchor a's block iff j < a; block keys iff same anchor.
        ctx_ok = torch.arange(L, device=dev)[None, None, :] < anchors[:, :, None]      # [B, A, L]
        ctx_ok = ctx_ok[:, :, None, :].expand(B, A, K, L).reshape(B, A * K, L)
        same = torch.eye(A, dtype=torch.bool, device=dev)[:, None, :, None].expand(A, K, A, K)
        blk_ok = same.reshape(1, A * K, A * K).expand(B, A * K, A * K)
        if block_lens is not None:   # key slot j of a block only where j < its length
            key_in = (offs[None, None, :] < block_lens[:, :, None]).reshape(B, 1, A * K)
            blk_ok = blk_ok & key_in
        mask = torch.cat([ctx_ok, blk_ok], -1)
        h = self.backbone(g, ctx_pos, x, blk_pos, mask).view(B, A, K, -1)
        base = h @ self.draft_head(head).T.to(h.dtype)
        prev_idx = (anchors[:, :, None] + offs).clamp(max=L - 1)
        prev = torch.gather(tokens, 1, prev_idx.reshape(B, A * K)).view(B, A, K)
        e, bias = self.markov(prev)
        logits = base.float() + bias.float()
        return dict(logits=logits, h=h, conf=self.confidence_logit(h, e), d2t=self.d2t)

    # -- the drafting pass as the engine runs it (one block, greedy Markov chain) ---------------

    @torch.no_grad()
    def draft_block(self, feats: torch.Tensor, id_last: int, pos0: int, n_block: int,
                    embedding: torch.Tensor, head: torch.Tensor) -> Dict[str, torch.Tensor]:
        """feats [n_ctx, n_tl*E] of positions 0..n_ctx-1 (n_ctx <= pos0); the block
        [id_last, MASK...] of n_block tokens at pos0... Returns base_logits, logits (Markov-biased
        along the greedy chain; [n_block, V], -inf outside the draft vocabulary as the engine's),
        tokens (argmax chain, target ids) and confidence, each per slot."""
        c = self.c
        dev = feats.device
        n_ctx = feats.shape[0]
        tok = torch.full((1, n_block), c.mask_token_id, dtype=torch.long, device=dev)
        tok[0, 0] = id_last
        x = F.embedding(tok, embedding)
        mask = torch.ones(1, n_block, n_ctx + n_block, dtype=torch.bool, device=dev)
        g = self.fuse(feats[None])
        h = self.backbone(g, torch.arange(n_ctx, device=dev)[None], x,
                          pos0 + torch.arange(n_block, device=dev)[None], mask)[0]
        base = (h @ self.draft_head(head).T).float()
        logits = base.clone()
        tokens = torch.zeros(n_block, dtype=torch.long)
        conf = torch.full((n_block,), float("nan"))
        prev = torch.tensor([id_last], device=dev)
        for i in range(n_block):
            e, bias = self.markov(prev)
            logits[i] = base[i] + bias[0].float()
            cl = self.confidence_logit(h[i:i + 1], e)
            if cl is not None:
                conf[i] = torch.sigmoid(cl.float())[0].cpu()
            prev = self.to_target_ids(logits[i].argmax()[None])
            tokens[i] = int(prev)
        out = dict(base_logits=base, logits=logits, tokens=tokens, confidence=conf, hidden=h)
        if self.d2t is not None:      # as the engine returns them: -inf off the draft vocabulary
            for k in ("base_logits", "logits"):
                full = torch.full((n_block, c.vocab_size), float("-inf"), device=dev)
                full[:, self.d2t] = out[k]
                out[k] = full
        return out

    # -- Hugging Face checkpoint ---------------------------------------------------------------

    def hf_state_dict(self, head: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        """The trained weights under their Hugging Face names; with a reduced draft vocabulary
        also d2t (as offsets: target id - draft id, EAGLE3/DFlash style, which pyspec-convert
        and llama.cpp's converter turn into absolute ids) and lm_head.weight = the target head's
        rows at d2t (head: the target's full output matrix), the drafter's own output.weight in
        the GGUF (the engine needs a head of Vd rows with d2t)."""
        sd: Dict[str, torch.Tensor] = {"fc.weight": self.fc.weight,
                                       "hidden_norm.weight": self.hidden_norm,
                                       "norm.weight": self.norm,
                                       "markov_head.markov_w1.weight": self.markov_w1,
                                       "markov_head.markov_w2.weight": self.markov_w2}
        for i, l in enumerate(self.layers):
            p = f"layers.{i}."
            sd[p + "input_layernorm.weight"] = l.input_layernorm
            sd[p + "post_attention_layernorm.weight"] = l.post_attention_layernorm
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                sd[p + f"self_attn.{n}.weight"] = getattr(l, n).weight
            sd[p + "self_attn.q_norm.weight"] = l.q_norm
            sd[p + "self_attn.k_norm.weight"] = l.k_norm
            for n in ("gate_proj", "up_proj", "down_proj"):
                sd[p + f"mlp.{n}.weight"] = getattr(l, n).weight
        if self.c.confidence_head:
            sd["confidence_head.proj.weight"] = self.conf_proj.weight
            sd["confidence_head.proj.bias"] = self.conf_proj.bias
        sd = {k: v.detach().float().cpu().contiguous() for k, v in sd.items()}
        if self.d2t is not None and head is not None:
            d2t = self.d2t.cpu()
            sd["lm_head.weight"] = self.draft_head(head.detach().float().cpu()).contiguous()
            sd["d2t"] = (d2t - torch.arange(d2t.numel())).contiguous()
        return sd

    def load_hf_state_dict(self, sd: Dict[str, torch.Tensor]) -> None:
        """Loads the weights (and d2t); lm_head.weight is not loaded: the drafter's head is
        always the target's (rows at d2t), passed to forward / draft_block."""
        own = {k: v for k, v in zip(self.hf_state_dict().keys(), self._hf_params())}
        missing = set(own) - set(sd)
        if self.d2t is not None and "d2t" not in sd:
            missing.add("d2t")
        if missing:
            raise ValueError(f"checkpoint lacks {sorted(missing)}")
        with torch.no_grad():
            for k, p in own.items():
                p.copy_(sd[k].to(p.dtype))
        if self.d2t is not None:
            off = sd["d2t"].to(torch.long)
            self.set_d2t(off + torch.arange(off.numel()))

    def _hf_params(self) -> List[torch.nn.Parameter]:
        ps = [self.fc.weight, self.hidden_norm, self.norm, self.markov_w1, self.markov_w2]
        for l in self.layers:
            ps += [l.input_layernorm, l.post_attention_layernorm, l.q_proj.weight, l.k_proj.weight,
                   l.v_proj.weight, l.o_proj.weight, l.q_norm, l.k_norm, l.gate_proj.weight,
                   l.up_proj.weight, l.down_proj.weight]
        if self.c.confidence_head:
            ps += [self.conf_proj.weight, self.conf_proj.bias]
        return ps

    def save_hf(self, out_dir: Path, max_shard_mib: int = 0, dtype: str = "f32",
                head: Optional[torch.Tensor] = None) -> Path:
        """config.json + model.safetensors (or shards of at most max_shard_mib MiB with
        model.safetensors.index.json), weights in dtype (f32, or bf16/f16 for a checkpoint half
        the size that is carried to a later session and continued with --init-from). A drafter
        with a reduced draft vocabulary needs head (the target's output matrix) for its
        lm_head.weight."""
        from safetensors.torch import save_file
        if self.d2t is not None and head is None:
            raise ValueError("a drafter with a reduced draft vocabulary is saved with the "
                             "target's head (its lm_head.weight are the head's rows at d2t)")
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tdt = HF_DTYPES[dtype]
        sd = {k: (v if k == "d2t" else v.to(tdt)).contiguous()
              for k, v in self.hf_state_dict(head).items()}
        nbytes = lambda v: v.numel() * v.element_size()   # noqa: E731
        for old in list(out_dir.glob("model*.safetensors")) + list(out_dir.glob("model.safetensors.index.json")):
            old.unlink()
        if max_shard_mib <= 0 or sum(nbytes(v) for v in sd.values()) <= max_shard_mib << 20:
            save_file(sd, str(out_dir / "model.safetensors"))
        else:
            shards: List[Dict[str, torch.Tensor]] = [{}]
            size = 0
            for k, v in sd.items():
                if shards[-1] and size + nbytes(v) > max_shard_mib << 20:
                    shards.append({})
                    size = 0
                shards[-1][k] = v
                size += nbytes(v)
            weight_map = {}
            for i, s in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(s, str(out_dir / name))
                weight_map.update({k: name for k in s})
            (out_dir / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {}, "weight_map": weight_map}, indent=1))
        cfg = self.c.hf_config()
        cfg["torch_dtype"] = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}[dtype]
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
        return out_dir

    @classmethod
    def load_hf(cls, model_dir: Path) -> "DSparkDrafter":
        from safetensors.torch import load_file
        model_dir = Path(model_dir)
        cfg = DrafterConfig.from_hf_config(json.loads((model_dir / "config.json").read_text()))
        m = cls(cfg)
        sd: Dict[str, torch.Tensor] = {}
        files = sorted(model_dir.glob("model*.safetensors"))
        for f in files:
            sd.update(load_file(str(f)))
        m.load_hf_state_dict(sd)
        return m


# c.rms_eps alias used above
DrafterConfig.rms_eps = property(lambda self: self.rms_norm_eps)  # type: ignore[attr-defined]
