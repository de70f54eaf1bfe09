"""Float64 numpy forward pass of the llama / qwen3 architectures, written from the math, not from
the engine: the independent reference that tests/test_model_reference.py compares pyspec against.

Conventions (llama.cpp's): RMSNorm is x / sqrt(mean(x^2) + eps) * w; llama applies RoPE in the
NORMAL mode (rotates pairs (2i, 2i+1)), qwen3 in the NEOX mode (pairs (i, i + d/2)), both with
theta_i = pos * base^(-2i/d); qwen3 RMS-normalizes every q and k head (attn_q_norm / attn_k_norm)
before RoPE; attention is causal by position with grouped-query heads (query head h reads kv head
h // (n_head / n_head_kv)) and scale 1/sqrt(head_dim); the FFN is SwiGLU: down(silu(gate) * up).
K (after RoPE) and V are rounded to the KV cache's storage type, F16 by default as in llama.cpp:
that rounding is what the cache really holds, not an arithmetic error to hide in a tolerance.

With act_quant="Q8_0" the reference also reproduces llama.cpp's treatment of the input of a
product with a block-quantized weight matrix: each row is quantized in blocks of 32 to
round(x / d) * fp16(d), d = max|x| / 127 (ggml's Q8_0; Q8_1, used with Q4_1 weights, has the same
values). That error is systematic and large next to float rounding, so emulating it lets the
quantized types be held to tight tolerances too.
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


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """x [..., n] (n a multiple of 32) as ggml's Q8_0 blocks hold it, dequantized."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    d = np.max(np.abs(blocks), axis=-1, keepdims=True) / 127.0
    safe = np.where(d == 0, 1.0, d)
    v = blocks / safe
    q = np.sign(v) * np.floor(np.abs(v) + 0.5)  # roundf: halves away from zero
    d16 = d.astype(np.float16).astype(np.float64)
    return (q * d16).reshape(x.shape)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def forward(hparams: dict, weights: dict, tokens, positions=None, layer_ids=(), kv_dtype=np.float16,
            act_quant=None):
    """Run one sequence through the model.

    tokens: token ids of the whole sequence so far; positions: their positions (default
    0..n-1). Row i attends to every row j with positions[j] <= positions[i]. kv_dtype: the cache's
    storage type K and V are rounded to (None: no rounding). act_quant: None, or "Q8_0" to quantize
    the input of every product with a weight matrix as described above (norm weights and the
    embedding lookup are not products).
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
    if act_quant not in (None, "Q8_0"):
        raise ValueError(f"unknown activation quantization {act_quant!r}")

    def mm(a, name):
        if act_quant is not None:
            a = quantize_q8_0(a)
        return a @ weights[name].T

    wanted = set(layer_ids)
    captured = {}

    x = weights["token_embd.weight"][tokens].astype(np.float64)
    visible = positions[None, :] <= positions[:, None]  # [query, key]
    for il in range(hparams["n_layer"]):
        if il in wanted:
            captured[il] = x.copy()
        p = f"blk.{il}."
        h = rms_norm(x, weights[p + "attn_norm.weight"], eps)
        q = mm(h, p + "attn_q.weight").reshape(n, n_head, hd)
        k = mm(h, p + "attn_k.weight").reshape(n, n_head_kv, hd)
        v = mm(h, p + "attn_v.weight").reshape(n, n_head_kv, hd)
        if arch == "qwen3":
            q = rms_norm(q, weights[p + "attn_q_norm.weight"], eps)
            k = rms_norm(k, weights[p + "attn_k_norm.weight"], eps)
        q = rope(q, positions, base, neox)
        k = rope(k, positions, base, neox)
        if kv_dtype is not None:
            k = k.astype(kv_dtype).astype(np.float64)
            v = v.astype(kv_dtype).astype(np.float64)
        attn = np.empty((n, n_head, hd))
        for hh in range(n_head):
            kv = hh // group
            scores = (q[:, hh, :] @ k[:, kv, :].T) / np.sqrt(hd)
            scores = np.where(visible, scores, -np.inf)
            scores -= scores.max(axis=1, keepdims=True)
            prob = np.exp(scores)
            prob /= prob.sum(axis=1, keepdims=True)
            attn[:, hh, :] = prob @ v[:, kv, :]
        x = x + mm(attn.reshape(n, n_head * hd), p + "attn_output.weight")
        h = rms_norm(x, weights[p + "ffn_norm.weight"], eps)
        gate = mm(h, p + "ffn_gate.weight")
        up = mm(h, p + "ffn_up.weight")
        x = x + mm(silu(gate) * up, p + "ffn_down.weight")
    if hparams["n_layer"] in wanted:
        captured[hparams["n_layer"]] = x.copy()
    h = rms_norm(x, weights["output_norm.weight"], eps)
    logits = mm(h, "output.weight")
    return logits, captured
