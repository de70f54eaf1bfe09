"""Float64 numpy forward pass of the llama / qwen3 architectures, written from the math, not from
the engine: the independent reference that tests/test_model_reference.py compares pyspec against.

Conventions (llama.cpp's): RMSNorm is x / sqrt(mean(x^2) + eps) * w; llama applies RoPE in the
NORMAL mode (rotates pairs (2i, 2i+1)), qwen3 in the NEOX mode (pairs (i, i + d/2)), both with
theta_i = pos * base^(-2i/d); qwen3 RMS-normalizes every q and k head (attn_q_norm / attn_k_norm)
before RoPE; attention is causal by position with grouped-query heads (query head h reads kv head
h // (n_head / n_head_kv)) and scale 1/sqrt(head_dim); the FFN is SwiGLU: down(silu(gate) * up).
K (after RoPE) and V are rounded to the KV cache's storage type, F16 by default as in llama.cpp:
that rounding is what the cache really holds, not an arithmetic error to hide in a tolerance.

With act_quant the reference also reproduces llama.cpp's treatment of the input of a product with
a block-quantized weight matrix. "Q8_0" (used with Q8_0 and Q4_0 weights): each row is quantized
in blocks of 32 to q = round(x / d), d = max|x| / 127, and read back as q * fp16(d). "Q8_1" (used
with Q4_1 weights, w = d_w * q_w + m_w): the same values plus the block sum s = fp16(d * sum(q)),
which the dot product uses for the m_w term: y = sum_j d_w q_wj * a_j + m_w * s. That error is
systematic and large next to float rounding, so emulating it lets the quantized types be held to
tight tolerances too.

Reference.forward runs a whole sequence; Reference.layer / head run one stage on given inputs (for
layer-by-layer checks); ReferenceSequence decodes through a KV cache of its own (for rollback).
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


def _f16(x):
    return np.asarray(x).astype(np.float16).astype(np.float64)


def quantize_q8(x: np.ndarray):
    """x [n_rows, n] (n a multiple of 32) as ggml's Q8_0 / Q8_1 blocks hold it: returns the
    dequantized values [n_rows, n] and the Q8_1 block sums s [n_rows, n / 32]."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = np.max(np.abs(blocks), axis=-1, keepdims=True) / 127.0
    v = blocks / np.where(d == 0, 1.0, d)
    q = np.sign(v) * np.floor(np.abs(v) + 0.5)  # roundf: halves away from zero
    s = _f16(d[..., 0] * q.sum(axis=-1))
    return (q * _f16(d)).reshape(x.shape), s


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


ACT_QUANT_FOR_WEIGHT = {"Q8_0": "Q8_0", "Q4_0": "Q8_0", "Q4_1": "Q8_1"}


class Reference:
    """The model's math over one sequence, layer by layer.

    kv_dtype: the cache's storage type K and V are rounded to (None: no rounding). act_quant: None,
    "Q8_0" or "Q8_1" to quantize the input of every product with a weight matrix as described
    above (norm weights and the embedding lookup are not products).
    """

    def __init__(self, hparams: dict, weights: dict, kv_dtype=np.float16, act_quant=None):
        if hparams["arch"] not in ("llama", "qwen3"):
            raise ValueError(f"reference knows no architecture {hparams['arch']!r}")
        if act_quant not in (None, "Q8_0", "Q8_1"):
            raise ValueError(f"unknown activation quantization {act_quant!r}")
        self.hp, self.w = hparams, weights
        self.kv_dtype, self.act_quant = kv_dtype, act_quant

    def mm(self, a: np.ndarray, name: str) -> np.ndarray:
        w = self.w[name]
        if self.act_quant is None:
            return a @ w.T
        aq, s = quantize_q8(a)
        y = aq @ w.T
        if self.act_quant == "Q8_1":
            # Q4_1 quantizes each block's minimum to q = 0, so m_w is the block's smallest value;
            # replace its exact term m_w * sum(a_q) by m_w * s as the Q8_1 dot product does.
            m_w = w.reshape(w.shape[0], -1, 32).min(axis=-1)  # [n_out, n_blocks]
            exact_sums = aq.reshape(aq.shape[0], -1, 32).sum(axis=-1)  # [n_rows, n_blocks]
            y += (s - exact_sums) @ m_w.T
        return y

    def embed(self, tokens) -> np.ndarray:
        return self.w["token_embd.weight"][np.asarray(tokens, dtype=np.int64)].astype(np.float64)

    def layer(self, il: int, x: np.ndarray, positions, cache: dict | None = None) -> np.ndarray:
        """Layer il on the residual stream x [n, n_embd] of rows at `positions`; row i attends to
        every row j with positions[j] <= positions[i]. With `cache` ({position: (k, v)} of this
        layer, updated in place) the rows also attend to the cached entries, as a KV cache does:
        those keep the K and V computed when they were decoded."""
        hp, w, mm = self.hp, self.w, self.mm
        n = x.shape[0]
        positions = np.asarray(positions, dtype=np.int64)
        assert positions.shape == (n,)
        n_head, n_head_kv, hd = hp["n_head"], hp["n_head_kv"], hp["head_dim"]
        eps, base = hp["rms_eps"], hp["rope_freq_base"]
        qwen3 = hp["arch"] == "qwen3"
        group = n_head // n_head_kv
        p = f"blk.{il}."
        h = rms_norm(x, w[p + "attn_norm.weight"], eps)
        q = mm(h, p + "attn_q.weight").reshape(n, n_head, hd)
        k = mm(h, p + "attn_k.weight").reshape(n, n_head_kv, hd)
        v = mm(h, p + "attn_v.weight").reshape(n, n_head_kv, hd)
        if qwen3:
            q = rms_norm(q, w[p + "attn_q_norm.weight"], eps)
            k = rms_norm(k, w[p + "attn_k_norm.weight"], eps)
        q = rope(q, positions, base, neox=qwen3)
        k = rope(k, positions, base, neox=qwen3)
        if self.kv_dtype is not None:
            k = k.astype(self.kv_dtype).astype(np.float64)
            v = v.astype(self.kv_dtype).astype(np.float64)
        key_pos = positions
        if cache is not None:
            for i, pos in enumerate(positions.tolist()):
                cache[pos] = (k[i], v[i])
            key_pos = np.array(sorted(cache), dtype=np.int64)
            k = np.stack([cache[pos][0] for pos in key_pos.tolist()])
            v = np.stack([cache[pos][1] for pos in key_pos.tolist()])
        visible = key_pos[None, :] <= positions[:, None]  # [query, key]
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
        h = rms_norm(x, w[p + "ffn_norm.weight"], eps)
        gate = mm(h, p + "ffn_gate.weight")
        up = mm(h, p + "ffn_up.weight")
        return x + mm(silu(gate) * up, p + "ffn_down.weight")

    def head(self, x: np.ndarray) -> np.ndarray:
        """Logits from the final residual stream."""
        return self.mm(rms_norm(x, self.w["output_norm.weight"], self.hp["rms_eps"]), "output.weight")

    def forward(self, tokens, positions=None, layer_ids=()):
        """tokens: the whole sequence so far; positions default to 0..n-1. Returns (logits
        [n, n_vocab] float64, {layer_id: residual stream [n, n_embd]}) where layer id 0 is the
        embedding output, id L the input of layer L, id n_layer the residual before output_norm."""
        n = len(tokens)
        positions = np.arange(n) if positions is None else np.asarray(positions, dtype=np.int64)
        wanted = set(layer_ids)
        captured = {}
        x = self.embed(tokens)
        for il in range(self.hp["n_layer"]):
            if il in wanted:
                captured[il] = x.copy()
            x = self.layer(il, x, positions)
        if self.hp["n_layer"] in wanted:
            captured[self.hp["n_layer"]] = x.copy()
        return self.head(x), captured


class ReferenceSequence:
    """One sequence decoded incrementally through a KV cache of float64 K/V, for the cache
    operations (decode in chunks, remove a range of positions, continue)."""

    def __init__(self, ref: Reference):
        self.ref = ref
        self.cache = [{} for _ in range(ref.hp["n_layer"])]

    def decode(self, tokens, positions, layer_ids=()):
        """Returns (logits, {layer id: input}) of the new rows, like Reference.forward."""
        positions = np.asarray(positions, dtype=np.int64)
        wanted = set(layer_ids)
        captured = {}
        x = self.ref.embed(tokens)
        for il in range(self.ref.hp["n_layer"]):
            if il in wanted:
                captured[il] = x.copy()
            x = self.ref.layer(il, x, positions, self.cache[il])
        if self.ref.hp["n_layer"] in wanted:
            captured[self.ref.hp["n_layer"]] = x.copy()
        return self.ref.head(x), captured

    def remove(self, p0: int, p1: int = -1):
        """Drops positions [p0, p1) (p1 < 0: to the end) from every layer's cache."""
        for c in self.cache:
            for pos in [pos for pos in c if pos >= p0 and (p1 < 0 or pos < p1)]:
                del c[pos]

    def pos_max(self) -> int:
        return max(self.cache[0], default=-1)

