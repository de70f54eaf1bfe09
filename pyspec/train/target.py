"""The frozen target in torch: a llama / qwen3 GGUF dequantized with the `gguf` package and run
exactly as pyspec's engine runs it (csrc/model/{llama,qwen3,decoder_blocks}.cpp):

    x = token_embd[tokens]
    per layer il:  record x as "layer input il"
                   h = RMSNorm(x) * attn_norm; q, k, v = Wq h, Wk h, Wv h
                   (qwen3: per-head RMSNorm q_norm / k_norm)
                   RoPE on q, k (llama: mode 0, adjacent pairs, on the GGUF's permuted weights;
                   qwen3: NEOX, rotate-half), freq_base / linear scale / rope_freqs from the GGUF
                   x += Wo softmax(q k^T / sqrt(head_dim) + causal mask) v        (GQA)
                   x += Wdown(silu(Wgate h2) * Wup h2),  h2 = RMSNorm(x) * ffn_norm
    record x as "layer input n_layer"
    logits = output · (RMSNorm(x) * output_norm)     (output = token_embd when tied)

"Layer input i" is llama.cpp's t_layer_inp[i] (reference §1.1): 0 is the embedding output,
n_layer the last layer's output. A drafter's GGUF `dflash.target_layers` lists these indices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from ..gguf_fields import field_value, open_gguf


@dataclass
class TargetHparams:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    n_ctx_train: int
    rope_freq_base: float
    rope_freq_scale: float
    rms_eps: float
    rope_neox: bool


def read_gguf(path: str) -> Tuple[TargetHparams, Dict[str, np.ndarray]]:
    """(hyperparameters, name -> float32 array) of a llama / qwen3 GGUF. Matrices are
    [out_features, in_features] (numpy view of GGUF's ne = [in, out])."""
    reader = open_gguf(path)
    arch = field_value(reader, "general.architecture")
    if arch not in ("llama", "qwen3"):
        raise ValueError(f"{path}: architecture {arch!r} is not supported (llama, qwen3)")
    k = arch + "."
    n_embd = int(field_value(reader, k + "embedding_length"))
    n_head = int(field_value(reader, k + "attention.head_count"))
    head_dim = int(field_value(reader, k + "attention.key_length", n_embd // n_head))
    scaling = field_value(reader, k + "rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"{path}: rope scaling {scaling!r} is not supported (none, linear)")
    scale = 1.0 / float(field_value(reader, k + "rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
    weights: Dict[str, np.ndarray] = {}
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = [int(s) for s in reversed(list(t.shape))]
        weights[t.name] = np.asarray(data, dtype=np.float32).reshape(shape)
    hp = TargetHparams(
        arch=arch, n_vocab=weights["token_embd.weight"].shape[0], n_embd=n_embd,
        n_layer=int(field_value(reader, k + "block_count")),
        n_ff=int(field_value(reader, k + "feed_forward_length")), n_head=n_head,
        n_head_kv=int(field_value(reader, k + "attention.head_count_kv", n_head)), head_dim=head_dim,
        n_rot=int(field_value(reader, k + "rope.dimension_count", head_dim)),
        n_ctx_train=int(field_value(reader, k + "context_length", 4096)),
        rope_freq_base=float(field_value(reader, k + "rope.freq_base", 10000.0)),
        rope_freq_scale=scale,
        rms_eps=float(field_value(reader, k + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_neox=arch == "qwen3")
    return hp, weights


def rms_norm(x: torch.Tensor, w: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = y.to(x.dtype)
    return y * w.to(x.dtype) if w is not None else y


def rope_angles(positions: torch.Tensor, n_rot: int, base: float, scale: float = 1.0,
                factors: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape positions.shape + [n_rot/2] (float32)."""
    inv = base ** (-torch.arange(0, n_rot, 2, device=positions.device, dtype=torch.float64) / n_rot)
    if factors is not None:
        inv = inv / factors.to(positions.device, torch.float64)
    ang = (positions.to(torch.float64)[..., None] * scale) * inv
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x [..., T, H, D]; cos/sin [..., T, n_rot/2]; the first n_rot dims rotate."""
    n_rot = cos.shape[-1] * 2
    xr, rest = x[..., :n_rot].float(), x[..., n_rot:]
    c, s = cos[..., None, :], sin[..., None, :]
    if neox:
        a, b = xr[..., : n_rot // 2], xr[..., n_rot // 2:]
        out = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    else:
        a, b = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    return torch.cat([out.to(x.dtype), rest], dim=-1)


# Cached steps of at most this many tokens (decoding) use grouped_attention.
GROUPED_DECODE_MAX_T = 16


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Attention for a few query tokens over a long KV cache with grouped KV heads, without
    repeating K and V per query head (what scaled_dot_product_attention's enable_gqa does with
    a boolean mask): the rep query heads of a KV head become rep x T query rows against it.
    q [B, nh, T, hd], k/v [B, nkv, S, hd], mask [B, 1, T, S] bool -> [B, nh, T, hd]."""
    B, nh, T, hd = q.shape
    nkv, S = k.shape[1], k.shape[2]
    rep = nh // nkv
    qg = q.reshape(B, nkv, rep * T, hd)                 # head h = kv * rep + r
    scores = (qg @ k.transpose(-1, -2)).float() * scale
    m = mask.expand(B, 1, T, S)[:, :, None].expand(B, 1, rep, T, S).reshape(B, 1, rep * T, S)
    scores = scores.masked_fill(~m, float("-inf"))
    p = torch.softmax(scores, -1).to(v.dtype)
    return (p @ v).reshape(B, nh, T, hd)


class KVCache:
    """Per-layer K/V [B, n_kv, T_max, hd] for incremental decoding; `valid` [B, T_max] marks real
    (non-padding) cells."""

    def __init__(self, hp: TargetHparams, batch: int, t_max: int, device, dtype):
        shape = (batch, hp.n_head_kv, t_max, hp.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(hp.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(hp.n_layer)]
        self.valid = torch.zeros(batch, t_max, dtype=torch.bool, device=device)
        self.n = 0


class TargetModel(torch.nn.Module):
    """A frozen llama / qwen3 target. forward() returns logits and the requested layer inputs."""

    def __init__(self, hp: TargetHparams, weights: Dict[str, np.ndarray]):
        super().__init__()
        self.hp = hp
        self.w = torch.nn.ParameterDict()
        for name, arr in weights.items():
            self.w[name.replace(".", "__")] = torch.nn.Parameter(torch.from_numpy(arr.copy()),
                                                                requires_grad=False)
        self.tied = "output.weight" not in weights

    @classmethod
    def from_gguf(cls, path: str) -> "TargetModel":
        hp, weights = read_gguf(path)
        return cls(hp, weights).eval()

    def W(self, name: str) -> torch.Tensor:
        return self.w[name.replace(".", "__")]

    def has(self, name: str) -> bool:
        return name.replace(".", "__") in self.w

    @property
    def embedding(self) -> torch.Tensor:
        return self.W("token_embd.weight")

    @property
    def head(self) -> torch.Tensor:
        return self.W("token_embd.weight") if self.tied else self.W("output.weight")

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None,
                layers: Sequence[int] = (), cache: Optional[KVCache] = None,
                valid: Optional[torch.Tensor] = None, logits: bool = True,
                last_only: bool = False) -> Tuple[Optional[torch.Tensor], Dict[int, torch.Tensor]]:
        """tokens [B, T] -> (logits [B, T, V] (float32), {layer id: layer input [B, T, E]}).

        positions [B, T] default 0..T-1. Without a cache attention is causal over the T tokens,
        restricted to `valid` [B, T] keys if given (padding). With a cache the tokens go to
        cells cache.n.. and attend to every valid earlier cell."""
        hp = self.hp
        B, T = tokens.shape
        dev = tokens.device
        if positions is None:
            positions = torch.arange(T, device=dev).expand(B, T)
        factors = self.W("rope_freqs.weight") if self.has("rope_freqs.weight") else None
        cos, sin = rope_angles(positions, hp.n_rot, hp.rope_freq_base, hp.rope_freq_scale, factors)
        if cache is not None:
            n0 = cache.n
            cache.valid[:, n0:n0 + T] = True if valid is None else valid
            S = n0 + T
            qpos = torch.arange(n0, S, device=dev)
            mask = (torch.arange(S, device=dev)[None, :] <= qpos[:, None])[None] & cache.valid[:, None, :S]
        else:
            causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
            mask = causal[None] if valid is None else causal[None] & valid[:, None, :]
        # A padding query row with no allowed key would give NaN: let it see itself.
        eye = torch.eye(mask.shape[1], mask.shape[2], dtype=torch.bool, device=dev,
                        ).roll(mask.shape[2] - mask.shape[1], dims=1)[None]
        mask = (mask | eye)[:, None]
        want = set(int(l) for l in layers)
        out: Dict[int, torch.Tensor] = {}
        x = F.embedding(tokens, self.embedding)
        hd, nh, nkv = hp.head_dim, hp.n_head, hp.n_head_kv
        for il in range(hp.n_layer):
            if il in want:
                out[il] = x
            p = f"blk.{il}."
            h = rms_norm(x, self.W(p + "attn_norm.weight"), hp.rms_eps)
            q = (h @ self.W(p + "attn_q.weight").T).view(B, T, nh, hd)
            k = (h @ self.W(p + "attn_k.weight").T).view(B, T, nkv, hd)
            v = (h @ self.W(p + "attn_v.weight").T).view(B, T, nkv, hd)
            if self.has(p + "attn_q_norm.weight"):
                q = rms_norm(q, self.W(p + "attn_q_norm.weight"), hp.rms_eps)
                k = rms_norm(k, self.W(p + "attn_k_norm.weight"), hp.rms_eps)
            q = apply_rope(q, cos, sin, hp.rope_neox).transpose(1, 2)
            k = apply_rope(k, cos, sin, hp.rope_neox).transpose(1, 2)
            v = v.transpose(1, 2)
            if cache is not None:
                cache.k[il][:, :, n0:S] = k
                cache.v[il][:, :, n0:S] = v
                k, v = cache.k[il][:, :, :S], cache.v[il][:, :, :S]
            if cache is not None and T <= GROUPED_DECODE_MAX_T:
                att = grouped_attention(q, k, v, mask, 1.0 / math.sqrt(hd))
            else:
                att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nh != nkv,
                                                     scale=1.0 / math.sqrt(hd))
            x = x + att.transpose(1, 2).reshape(B, T, nh * hd) @ self.W(p + "attn_output.weight").T
            h = rms_norm(x, self.W(p + "ffn_norm.weight"), hp.rms_eps)
            g = h @ self.W(p + "ffn_gate.weight").T
            u = h @ self.W(p + "ffn_up.weight").T
            x = x + (F.silu(g) * u) @ self.W(p + "ffn_down.weight").T
        if hp.n_layer in want:
            out[hp.n_layer] = x
        if cache is not None:
            cache.n = S
        if not logits:
            return None, out
        if last_only:
            x = x[:, -1:]
        h = rms_norm(x, self.W("output_norm.weight"), hp.rms_eps)
        return (h @ self.head.T).float(), out


@torch.no_grad()
def generate(model: TargetModel, prompts: List[List[int]], max_new: int,
             temperatures: Sequence[float], eog: Sequence[int], generator: torch.Generator,
             device) -> List[List[int]]:
    """Continue each prompt (left-padded into one batch, KV-cached) for up to max_new tokens,
    greedy where the temperature is 0, else sampled; a sequence stops after an end-of-generation
    token. Returns prompt + continuation per sequence."""
    B = len(prompts)
    P = max(len(p) for p in prompts)
    pad = torch.zeros(B, P, dtype=torch.long)
    valid = torch.zeros(B, P, dtype=torch.bool)
    for i, p in enumerate(prompts):
        pad[i, P - len(p):] = torch.tensor(p)
        valid[i, P - len(p):] = True
    pad, valid = pad.to(device), valid.to(device)
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)
    dtype = model.embedding.dtype
    cache = KVCache(model.hp, B, P + max_new, device, dtype)
    logits, _ = model(pad, pos, cache=cache, valid=valid, last_only=True)
    temps = torch.tensor(list(temperatures), dtype=torch.float32, device=device)[:, None]
    eog_t = torch.tensor(sorted(set(eog)) or [-1], device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    next_pos = pos[:, -1] + 1
    outs = []
    for step in range(max_new):
        lg = logits[:, -1].float()
        greedy = lg.argmax(-1)
        probs = torch.softmax(lg / temps.clamp(min=1e-4), -1)
        sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        tok = torch.where(temps[:, 0] > 0, sampled, greedy)
        tok = torch.where(done, torch.zeros_like(tok), tok)
        outs.append(torch.where(done, torch.full_like(tok, -1), tok))
        done = done | torch.isin(tok, eog_t)
        # Reading `done` back synchronises with the device: every 8 steps only (steps after
        # every sequence ended add -1s, which are dropped below).
        if step % 8 == 7 and bool(done.all()):
            break
        logits, _ = model(tok[:, None], next_pos[:, None], cache=cache,
                          valid=(~done)[:, None] | True, last_only=True)
        next_pos = next_pos + 1
    gen = torch.stack(outs, 1).cpu().tolist() if outs else [[] for _ in range(B)]
    return [list(p) + [t for t in g if t >= 0] for p, g in zip(prompts, gen)]
