"""Hyperparameters of a Qwen3/Llama-style decoder read from a Hugging Face config, the standard GGUF
keys they become, and the per-layer tensor mapping shared by targets and drafters."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from .checkpoint import Checkpoint
from .errors import ConversionError
from .gguf_out import Plan, Tensor

_MISSING = object()


def cfg_value(cfg: dict, key: str, where: Path, default=_MISSING, kind=int):
    value = cfg.get(key, default)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise ConversionError(f"{where} has no '{key}'")
        return default
    try:
        if kind is int and (isinstance(value, bool) or int(value) != value):
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise ConversionError(f"{where}: '{key}' = {value!r} is not a valid {kind.__name__}") from None


@dataclass
class Hparams:
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_explicit: bool
    n_rot: int
    n_ctx: Optional[int]
    rms_eps: float
    rope_theta: float
    rope_type: Optional[str]       # None, "linear", "yarn", "llama3"
    rope: dict                     # the scaling parameters of rope_type


def rope_parameters(cfg: dict) -> Tuple[float, dict]:
    """(rope_theta, scaling dict) from either transformers' older rope_theta + rope_scaling or
    the newer rope_parameters."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    scaling = cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), dict) else params
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    return float(theta), scaling or {}


def read_hparams(cfg: dict, where: Path) -> Hparams:
    n_embd = cfg_value(cfg, "hidden_size", where)
    n_head = cfg_value(cfg, "num_attention_heads", where)
    n_head_kv = cfg_value(cfg, "num_key_value_heads", where, default=n_head)
    head_dim = cfg_value(cfg, "head_dim", where, default=0)
    explicit = head_dim > 0
    if not explicit:
        if n_head <= 0 or n_embd % n_head:
            raise ConversionError(f"{where}: hidden_size {n_embd} is not a multiple of "
                                  f"num_attention_heads {n_head} and no head_dim is given")
        head_dim = n_embd // n_head
    for key, value in (("hidden_size", n_embd), ("num_attention_heads", n_head),
                       ("num_key_value_heads", n_head_kv)):
        if value <= 0:
            raise ConversionError(f"{where}: '{key}' must be positive, got {value}")
    if n_head % n_head_kv:
        raise ConversionError(f"{where}: num_attention_heads {n_head} is not a multiple of "
                              f"num_key_value_heads {n_head_kv}")
    partial = cfg_value(cfg, "partial_rotary_factor", where, default=1.0, kind=float)
    n_rot = int(head_dim * partial)
    theta, scaling = rope_parameters(cfg)
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        rope_type = None
    elif rope_type not in ("linear", "yarn", "llama3"):
        raise ConversionError(f"{where}: rope scaling type '{rope_type}' is not supported "
                              "(supported: linear, yarn, llama3)")
    return Hparams(
        n_embd=n_embd,
        n_layer=cfg_value(cfg, "num_hidden_layers", where),
        n_ff=cfg_value(cfg, "intermediate_size", where),
        n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, head_dim_explicit=explicit,
        n_rot=n_rot,
        n_ctx=cfg_value(cfg, "max_position_embeddings", where, default=None),
        rms_eps=cfg_value(cfg, "rms_norm_eps", where, default=1e-6, kind=float),
        rope_theta=theta, rope_type=rope_type, rope=scaling)


def llama3_rope_factors(hp: Hparams) -> np.ndarray:
    """The per-frequency divisors of Llama 3.1's rope scaling (llama.cpp's rope_freqs tensor):
    long wavelengths are slowed by `factor`, short ones kept, the band between interpolated."""
    factor = float(hp.rope.get("factor", 8.0))
    low = float(hp.rope.get("low_freq_factor", 1.0))
    high = float(hp.rope.get("high_freq_factor", 4.0))
    old_ctx = float(hp.rope.get("original_max_position_embeddings", 8192))
    freqs = hp.rope_theta ** -(np.arange(0, hp.n_rot, 2, dtype=np.float64) / hp.n_rot)
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, mid))
    return out.astype(np.float32)


def add_hparams(plan: Plan, arch: str, hp: Hparams, key_length: bool) -> None:
    k = arch + "."
    if hp.n_ctx is not None:
        plan.u32(k + "context_length", hp.n_ctx)
    plan.u32(k + "embedding_length", hp.n_embd)
    plan.u32(k + "block_count", hp.n_layer)
    plan.u32(k + "feed_forward_length", hp.n_ff)
    plan.u32(k + "attention.head_count", hp.n_head)
    plan.u32(k + "attention.head_count_kv", hp.n_head_kv)
    plan.f32(k + "rope.freq_base", hp.rope_theta)
    plan.f32(k + "attention.layer_norm_rms_epsilon", hp.rms_eps)
    plan.u32(k + "rope.dimension_count", hp.n_rot)
    if key_length or hp.head_dim_explicit or hp.head_dim * hp.n_head != hp.n_embd:
        plan.u32(k + "attention.key_length", hp.head_dim)
        plan.u32(k + "attention.value_length", hp.head_dim)
    if hp.rope_type in ("linear", "yarn"):
        plan.string(k + "rope.scaling.type", hp.rope_type)
        plan.f32(k + "rope.scaling.factor", float(hp.rope.get("factor", 1.0)))
        if hp.rope_type == "yarn" and "original_max_position_embeddings" in hp.rope:
            plan.u32(k + "rope.scaling.original_context_length",
                     hp.rope["original_max_position_embeddings"])
    elif hp.rope_type == "llama3":
        factors = llama3_rope_factors(hp)
        plan.add(Tensor("rope_freqs.weight", factors.shape, lambda: factors, kind="f32",
                        source="rope_scaling (llama3)"))


def permute_rotate_half_to_pairs(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder the rows of each head so that llama.cpp's NORMAL rope (which rotates pairs
    (2i, 2i+1)) computes what Hugging Face's rotate_half rope (pairs (i, i + d/2)) computes:
    new row 2i is old row i, new row 2i+1 is old row i + d/2."""
    rows = w.shape[0]
    d = rows // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_pairs_to_rotate_half(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse: for a model trained with interleaved pairs that llama.cpp runs as NEOX."""
    rows = w.shape[0]
    d = rows // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Hugging Face per-layer name (after "layers.N.") -> GGUF per-layer name, kind.
LAYER_TENSORS = {
    "input_layernorm.weight": ("attn_norm.weight", "f32"),
    "self_attn.q_proj.weight": ("attn_q.weight", "weight"),
    "self_attn.k_proj.weight": ("attn_k.weight", "weight"),
    "self_attn.v_proj.weight": ("attn_v.weight", "weight"),
    "self_attn.o_proj.weight": ("attn_output.weight", "weight"),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", "f32"),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", "f32"),
    "post_attention_layernorm.weight": ("ffn_norm.weight", "f32"),
    "mlp.gate_proj.weight": ("ffn_gate.weight", "weight"),
    "mlp.up_proj.weight": ("ffn_up.weight", "weight"),
    "mlp.down_proj.weight": ("ffn_down.weight", "weight"),
}


def layer_shapes(hp: Hparams) -> Dict[str, Tuple[int, ...]]:
    """Expected Hugging Face shapes ([out, in]) of each per-layer tensor."""
    e, d = hp.n_embd, hp.head_dim
    return {
        "input_layernorm.weight": (e,),
        "self_attn.q_proj.weight": (hp.n_head * d, e),
        "self_attn.k_proj.weight": (hp.n_head_kv * d, e),
        "self_attn.v_proj.weight": (hp.n_head_kv * d, e),
        "self_attn.o_proj.weight": (e, hp.n_head * d),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "post_attention_layernorm.weight": (e,),
        "mlp.gate_proj.weight": (hp.n_ff, e),
        "mlp.up_proj.weight": (hp.n_ff, e),
        "mlp.down_proj.weight": (e, hp.n_ff),
    }


IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class TensorMapper:
    """Maps checkpoint tensors to GGUF tensors, checking shapes, and remembers which checkpoint
    tensors were used so that anything left over can be reported by name."""

    def __init__(self, ckpt: Checkpoint, plan: Plan):
        self.ckpt = ckpt
        self.plan = plan
        self.by_short: Dict[str, str] = {}
        for name in ckpt.names():
            short = name[len("model."):] if name.startswith("model.") else name
            if short in self.by_short:
                raise ConversionError(f"{ckpt.dir} has both {self.by_short[short]} and {name}")
            self.by_short[short] = name
        self.used: set = set()

    def has(self, short: str) -> bool:
        return short in self.by_short

    def shape(self, short: str) -> Tuple[int, ...]:
        return self.ckpt.shape(self.by_short[short])

    def use(self, short: str) -> str:
        self.used.add(short)
        return self.by_short[short]

    def check_shape(self, short: str, expected: Tuple[int, ...]) -> None:
        got = self.shape(short)
        if tuple(got) != tuple(expected):
            raise ConversionError(f"tensor {self.by_short[short]} in {self.ckpt.dir} has shape "
                                  f"{list(got)}, expected {list(expected)} from config.json")

    def map(self, short: str, gguf_name: str, kind: str, expected: Optional[Tuple[int, ...]] = None,
            transform: Optional[Callable[[np.ndarray], np.ndarray]] = None) -> None:
        if expected is not None:
            self.check_shape(short, expected)
        full = self.use(short)
        ckpt = self.ckpt

        def load(full=full, transform=transform):
            data = ckpt.load(full)
            return transform(data) if transform is not None else data

        self.plan.add(Tensor(gguf_name, tuple(self.shape(short)), load, kind=kind, source=full))

    def map_layers(self, hp: Hparams, qk_norm: bool,
                   qk_transform: Optional[Callable[[np.ndarray, int], np.ndarray]] = None,
                   optional: Tuple[str, ...] = ()) -> None:
        """Every per-layer tensor; qk_transform(w, n_heads) reorders the rows of Q and K (and of
        the per-head q/k norm vectors, one "head") for the rope convention the GGUF runs with."""
        shapes = layer_shapes(hp)
        heads = {"self_attn.q_proj.weight": hp.n_head, "self_attn.k_proj.weight": hp.n_head_kv,
                 "self_attn.q_norm.weight": 1, "self_attn.k_norm.weight": 1}
        missing: List[str] = []
        for il in range(hp.n_layer):
            for hf, (gg, kind) in LAYER_TENSORS.items():
                if hf in ("self_attn.q_norm.weight", "self_attn.k_norm.weight") and not qk_norm:
                    continue
                short = f"layers.{il}.{hf}"
                if not self.has(short):
                    if hf not in optional:
                        missing.append(short)
                    continue
                transform = None
                if qk_transform is not None and hf in heads:
                    transform = lambda w, n=heads[hf]: qk_transform(w, n)
                self.map(short, f"blk.{il}.{gg}", kind, shapes[hf], transform)
        if missing:
            raise ConversionError(f"{self.ckpt.dir} is missing tensors: {', '.join(missing)}")

    def reject_unknown(self) -> None:
        unknown = [self.by_short[s] for s in self.by_short
                   if s not in self.used and not s.endswith(IGNORED_SUFFIXES)]
        if unknown:
            raise ConversionError(f"{len(unknown)} tensor(s) in {self.ckpt.dir} that the mapping "
                                  f"does not know: {', '.join(unknown)}")
