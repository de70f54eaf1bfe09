"""Float64 numpy forward pass of Hugging Face's LlamaForCausalLM / Qwen3ForCausalLM, computed from
the checkpoint's own tensors (Hugging Face names and layouts), for checking converted GGUF files.

It follows transformers' conventions, not llama.cpp's: RoPE rotates halves (rotate_half: pairs
(i, i + d/2)) for both architectures, with inv_freq = theta^(-2i/d) and a linear-scaling factor
dividing positions; RMSNorm is x / sqrt(mean(x^2) + eps) * w; Qwen3 RMS-normalizes each q and k
head before RoPE; attention is causal with grouped-query heads and scale 1/sqrt(head_dim); the MLP
is down(silu(gate) * up); the output is lm_head, or the embedding when tied. Because the layout
is the checkpoint's, a converter that reorders Q/K rows wrongly for llama.cpp's rope cannot agree
with it.

kv_dtype rounds K (after RoPE) and V to the storage type of the engine's KV cache, which is what
the cache really holds. act_quant (HF weight name -> "Q8_0" | "Q8_1") reproduces what llama.cpp
and pyspec do to the input of a product with a block-quantized weight: each row is quantized in
blocks of 32 to q = round(x / d), d = max|x| / 127, read back as q * fp16(d); with "Q8_1" (used for
Q4_1 weights, w = d_w * q_w + m_w) the block-minimum term m_w * sum(a) uses the stored block sum
fp16(d * sum(q)) instead of the exact one. That error is systematic and large next to float
rounding; emulating it lets quantized files be held to tight tolerances.
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _f16(x):
    return np.asarray(x).astype(np.float16).astype(np.float64)


def matmul(a, w, act_quant=None):
    """a [n, in] @ w[out, in].T, with the activation quantization described above."""
    if act_quant is None:
        return a @ w.T
    # In float32 and as x * (1 / d), like ggml's quantize_row_q8_0: activations built from
    # block-quantized embeddings and coarse norm weights often sit exactly on a rounding tie, and
    # only the same arithmetic resolves those ties the same way.
    blocks = a.reshape(a.shape[0], -1, 32).astype(np.float32)
    d = np.max(np.abs(blocks), axis=-1, keepdims=True) / np.float32(127.0)
    inv = np.where(d == 0, np.float32(0.0), np.float32(1.0) / np.where(d == 0, np.float32(1.0), d))
    v = (blocks * inv).astype(np.float64)
    d = d.astype(np.float64)
    q = np.sign(v) * np.floor(np.abs(v) + 0.5)  # roundf: halves away from zero
    aq = q * _f16(d)
    y = aq.reshape(a.shape) @ w.T
    if act_quant == "Q8_1":
        s = _f16(d[..., 0] * q.sum(axis=-1))                      # [n, blocks]
        m_w = w.reshape(w.shape[0], -1, 32).min(axis=-1)          # [out, blocks]
        y += (s - aq.sum(axis=-1)) @ m_w.T
    return y


def rotate_half_rope(x, pos, theta, n_rot, scale=1.0):
    """x [n, heads, d]: HF's rope on the first n_rot dims (pairs (i, i + n_rot/2))."""
    inv_freq = theta ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    ang = (pos.astype(np.float64) / scale)[:, None] * inv_freq[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, axis=-1)[:, None, :]
    r, rest = x[..., :n_rot], x[..., n_rot:]
    half = n_rot // 2
    rotated = np.concatenate([-r[..., half:], r[..., :half]], axis=-1)
    return np.concatenate([r * cos + rotated * sin, rest], axis=-1)


def forward(config: dict, weights: Dict[str, np.ndarray], tokens, kv_dtype=np.float16,
            act_quant: Optional[Dict[str, str]] = None):
    """Logits [n_tokens, vocab] (float64) for one sequence at positions 0..n-1."""
    arch = config["architectures"][0]
    if arch not in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        raise ValueError(f"no reference for {arch}")
    w = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    aq = act_quant or {}

    def mm(a, name):
        return matmul(a, w[name], aq.get(name))

    tokens = np.asarray(tokens, dtype=np.int64)
    n = len(tokens)
    e = config["hidden_size"]
    nh, nkv = config["num_attention_heads"], config.get("num_key_value_heads",
                                                        config["num_attention_heads"])
    d = config.get("head_dim") or e // nh
    eps, theta = config["rms_norm_eps"], config.get("rope_theta", 10000.0)
    scaling = config.get("rope_scaling") or {}
    linear = scaling.get("rope_type", scaling.get("type")) == "linear"
    scale = float(scaling.get("factor", 1.0)) if linear else 1.0
    n_rot = int(d * config.get("partial_rotary_factor", 1.0))
    pos = np.arange(n)
    causal = pos[None, :] <= pos[:, None]

    x = w["model.embed_tokens.weight"][tokens]
    for il in range(config["num_hidden_layers"]):
        p = f"model.layers.{il}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = mm(h, p + "self_attn.q_proj.weight").reshape(n, nh, d)
        k = mm(h, p + "self_attn.k_proj.weight").reshape(n, nkv, d)
        v = mm(h, p + "self_attn.v_proj.weight").reshape(n, nkv, d)
        if arch == "Qwen3ForCausalLM":
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q = rotate_half_rope(q, pos, theta, n_rot, scale)
        k = rotate_half_rope(k, pos, theta, n_rot, scale)
        if kv_dtype is not None:
            k = k.astype(kv_dtype).astype(np.float64)
            v = v.astype(kv_dtype).astype(np.float64)
        out = np.empty((n, nh, d))
        for hh in range(nh):
            kh = hh // (nh // nkv)
            s = np.where(causal, (q[:, hh] @ k[:, kh].T) / np.sqrt(d), -np.inf)
            prob = np.exp(s - s.max(axis=1, keepdims=True))
            out[:, hh] = (prob / prob.sum(axis=1, keepdims=True)) @ v[:, kh]
        x = x + mm(out.reshape(n, nh * d), p + "self_attn.o_proj.weight")
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        g = mm(h, p + "mlp.gate_proj.weight")
        u = mm(h, p + "mlp.up_proj.weight")
        x = x + mm(g / (1.0 + np.exp(-g)) * u, p + "mlp.down_proj.weight")
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    return mm(x, head)


def stored_as(weights: Dict[str, np.ndarray], outtype: str):
    """(weights, act_quant) for forward(): the checkpoint's weights rounded to the types a GGUF of
    `outtype` stores them in (llama.cpp's policy, stated here independently of the converter:
    1-D tensors F32; matrices in outtype, except F16 for block-quantized types when a row is not a
    multiple of 32 long), and the activation quantization that goes with each block-quantized
    matrix (Q8_1 for Q4_1, Q8_0 for Q8_0 and Q4_0)."""
    import gguf
    q = gguf.GGMLQuantizationType[outtype.upper()]
    block = outtype in ("q8_0", "q4_0", "q4_1")
    out, act = {}, {}
    for name, w in weights.items():
        w = np.asarray(w, dtype=np.float32)
        if w.ndim == 2:
            wq = gguf.GGMLQuantizationType.F16 if block and w.shape[1] % 32 else q
            w = gguf.quants.dequantize(gguf.quants.quantize(w, wq), wq)
            if wq == q and block:
                act[name] = "Q8_1" if outtype == "q4_1" else "Q8_0"
        out[name] = w
    return out, act
