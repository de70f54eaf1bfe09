"""Float64 numpy forward pass of the llama / qwen3 architectures, written from the math, not from
the engine: the independent reference that tests/test_model_reference.py compares pyspec against.

Conventions (llama.cpp's): RMSNorm is x / sqrt(mean(x^2) + eps) * w; llama applies RoPE in the
NORMAL mode (rotates pairs (2i, 2i+1)), qwen3 in the NEOX mode (pairs (i, i + d/2)), both with
theta_i = pos * base^(-2i/d); qwen3 RMS-normalizes every q and k head (attn_q_norm / attn_k_norm)
before RoPE; attention is causal by position with grouped-query heads (query head h reads kv head
h // (n_head / n_head_kv)) and scale 1/sqrt(head_dim); the FFN is SwiGLU: down(silu(gate) * up).
"""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, pos: np.ndarray, base: float, neox: bool) -> np.ndarray:
    """x: [n_tokens, n_heads, d]; pos: [n_tokens]. Returns the rotated copy."""
    d = x.shape[-1]
    inv_freq = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # [d/2]: base^(-2i/d)
    theta = pos.astype(np.float64)[:, None] * inv_freq[None, :]  # [n_tokens, d/2]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    if neox:
        a, b = x[..., : d // 2], x[..., d // 2:]
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    out = np.empty_like(x)
    if neox:
        out[..., : d // 2], out[..., d // 2:] = ra, rb
    else:
        out[..., 0::2], out[..., 1::2] = ra, rb
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def forward(hparams: dict, weights: dict, tokens, positions=None, layer_ids=()):
    """Run one sequence through the model.

    tokens: token ids of the whole sequence so far; positions: their positions (default
    0..n-1). Row i attends to every row j with positions[j] <= positions[i].
    Returns (logits [n, n_vocab] float64, {layer_id: residual stream [n, n_embd]}) where layer id 0
    is the embedding output, id L the input of layer L, id n_layer the residual before output_norm.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    n = len(tokens)
    positions = np.arange(n) if positions is None else np.asarray(positions, dtype=np.int64)
    assert positions.shape == (n,)
    arch = hparams["arch"]
    if arch not in ("llama", "qwen3"):
        raise ValueError(f"reference knows no architecture {arch!r}")
    n_head, n_head_kv, hd = hparams["n_head"], hparams["n_head_kv"], hparams["head_dim"]
    eps, base = hparams["rms_eps"], hparams["rope_freq_base"]
    neox = arch == "qwen3"
    group = n_head // n_head_kv
    wanted = set(layer_ids)
    captured = {}

    x = weights["token_embd.weight"][tokens].astype(np.float64)
    visible = positions[None, :] <= positions[:, None]  # [query, key]
    for il in range(hparams["n_layer"]):
        if il in wanted:
            captured[il] = x.copy()
        p = f"blk.{il}."
        h = rms_norm(x, weights[p + "attn_norm.weight"], eps)
        q = (h @ weights[p + "attn_q.weight"].T).reshape(n, n_head, hd)
        k = (h @ weights[p + "attn_k.weight"].T).reshape(n, n_head_kv, hd)
        v = (h @ weights[p + "attn_v.weight"].T).reshape(n, n_head_kv, hd)
        if arch == "qwen3":
            q = rms_norm(q, weights[p + "attn_q_norm.weight"], eps)
            k = rms_norm(k, weights[p + "attn_k_norm.weight"], eps)
        q = rope(q, positions, base, neox)
        k = rope(k, positions, base, neox)
        attn = np.empty((n, n_head, hd))
        for hh in range(n_head):
            kv = hh // group
            scores = (q[:, hh, :] @ k[:, kv, :].T) / np.sqrt(hd)
            scores = np.where(visible, scores, -np.inf)
            scores -= scores.max(axis=1, keepdims=True)
            prob = np.exp(scores)
            prob /= prob.sum(axis=1, keepdims=True)
            attn[:, hh, :] = prob @ v[:, kv, :]
        x = x + attn.reshape(n, n_head * hd) @ weights[p + "attn_output.weight"].T
        h = rms_norm(x, weights[p + "ffn_norm.weight"], eps)
        gate = h @ weights[p + "ffn_gate.weight"].T
        up = h @ weights[p + "ffn_up.weight"].T
        x = x + (silu(gate) * up) @ weights[p + "ffn_down.weight"].T
    if hparams["n_layer"] in wanted:
        captured[hparams["n_layer"]] = x.copy()
    h = rms_norm(x, weights["output_norm.weight"], eps)
    logits = h @ weights["output.weight"].T
    return logits, captured
