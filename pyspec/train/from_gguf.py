"""A DSpark drafter GGUF (pyspec-convert's output, or llama.cpp's converter's) back into the
trainer's torch model, so that `pyspec-train-drafter --init-from DRAFTER.gguf` continues training
from a shipped drafter when its Hugging Face checkpoint is not at hand. Tensors are dequantized
with the gguf package (a quantized file gives the weights it serves, rounding included); names and
keys are those pyspec/convert/drafters.py writes, mapped back.

Only what the trainer's model is can be read: a DSpark drafter (Markov head) with non-causal
blocks sampled from the anchor, SiLU, no trained mask embedding, no sliding window, scales or
softcapping; anything else is refused with the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import gguf
import numpy as np
import torch

from ..convert.drafters import BLOCK_SIZE_MIN_KEY
from ..gguf_fields import field_value, open_gguf
from .drafter import DrafterConfig, DSparkDrafter

# GGUF layer tensor -> Hugging Face name (layers.{i}.), as pyspec/convert/hparams.py maps them.
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES = {
    "fc.weight": "fc.weight",
    "enc.output_norm.weight": "hidden_norm.weight",
    "output_norm.weight": "norm.weight",
    "markov_w1.weight": "markov_head.markov_w1.weight",
    "markov_w2.weight": "markov_head.markov_w2.weight",
    "conf_proj.weight": "confidence_head.proj.weight",
    "conf_proj.bias": "confidence_head.proj.bias",
}
# Keys of features the trainer's model does not have.
UNSUPPORTED_KEYS = ("dflash.embedding_scale", "dflash.final_logit_softcapping",
                    "dflash.attention.value_scale", "dflash.hidden_activation",
                    "dflash.attention.sliding_window", "dflash.rope.dimension_sections")


def is_gguf(path: Path) -> bool:
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def gguf_block_size(path: Path) -> int:
    """The block length a drafter GGUF was trained for (dflash.block_size)."""
    size = field_value(open_gguf(path), "dflash.block_size")
    if size is None:
        raise ValueError(f"{path} has no dflash.block_size (not a drafter GGUF)")
    return int(size)


def load_drafter_gguf(path: Path) -> DSparkDrafter:
    """The drafter in `path` as the trainer's model (extra["init_from_gguf"] names the file).
    Raises ValueError when the file is not a drafter the trainer can continue."""
    path = Path(path)
    reader = open_gguf(path)

    def value(key, default=None):
        return field_value(reader, key, default)

    def need(key):
        v = value(key)
        if v is None:
            raise ValueError(f"{path} has no {key}")
        return v

    if value("general.architecture") != "dflash":
        raise ValueError(f"{path} is not a drafter GGUF (general.architecture "
                         f"{value('general.architecture')!r}, expected 'dflash')")
    for key in UNSUPPORTED_KEYS:
        if key in reader.fields:
            raise ValueError(f"{path} uses {key}, which pyspec-train-drafter's model does not have")
    if value("dflash.attention.causal", False) or not value("dflash.sample_from_anchor", True):
        raise ValueError(f"{path} is a causal or non-anchor-first drafter; the trainer's drafter is "
                         "non-causal and samples from the anchor")
    tensors = {t.name: t for t in reader.tensors}
    if "markov_w1.weight" not in tensors:
        raise ValueError(f"{path} has no Markov head (markov_w1.weight): a plain DFlash drafter, "
                         "which pyspec-train-drafter does not train")
    if "token_embd.weight" in tensors:
        raise ValueError(f"{path} has its own token_embd (a trained mask embedding), which "
                         "pyspec-train-drafter does not train")

    def load(name: str) -> torch.Tensor:
        t = tensors[name]
        data = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        return torch.from_numpy(data.reshape([int(d) for d in reversed(t.shape)]).copy())

    n_layer = int(need("dflash.block_count"))
    hd = int(need("dflash.attention.key_length"))
    w1 = load("markov_w1.weight")                       # [n_vocab, rank]
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in \
        reader.fields else int(w1.shape[0])
    vd = int(tensors["output.weight"].shape[1]) if "output.weight" in tensors else n_vocab
    if (vd < n_vocab) != ("d2t" in tensors):
        raise ValueError(f"{path}: a draft vocabulary of {vd} tokens needs d2t, and only it")
    cfg = DrafterConfig(
        hidden_size=int(need("dflash.embedding_length")),
        intermediate_size=int(need("dflash.feed_forward_length")),
        num_hidden_layers=n_layer, num_attention_heads=int(need("dflash.attention.head_count")),
        num_key_value_heads=int(need("dflash.attention.head_count_kv")), head_dim=hd,
        vocab_size=n_vocab, target_layers=[int(t) for t in need("dflash.target_layers")],
        mask_token_id=int(need("tokenizer.ggml.mask_token_id")),
        block_size=int(need("dflash.block_size")), markov_rank=int(w1.shape[1]),
        block_size_min=int(value(BLOCK_SIZE_MIN_KEY, 0)),
        rms_norm_eps=float(need("dflash.attention.layer_norm_rms_epsilon")),
        rope_theta=float(value("dflash.rope.freq_base", 10000.0)),
        max_position_embeddings=int(value("dflash.context_length", 8192)),
        confidence_head=bool(value("dflash.has_confidence_head", "conf_proj.weight" in tensors)),
        draft_vocab_size=vd if vd < n_vocab else 0,
        extra={"init_from_gguf": path.name})

    sd: Dict[str, torch.Tensor] = {}
    for gg, hf in GLOBAL_NAMES.items():
        if gg in tensors:
            sd[hf] = w1 if gg == "markov_w1.weight" else load(gg)
    for il in range(n_layer):
        for gg, hf in LAYER_NAMES.items():
            if f"blk.{il}.{gg}" in tensors:
                sd[f"layers.{il}.{hf}"] = load(f"blk.{il}.{gg}")
    if "d2t" in tensors:  # absolute ids in the GGUF, offsets in the checkpoint
        ids = torch.from_numpy(np.asarray(tensors["d2t"].data, dtype=np.int64).reshape(-1).copy())
        sd["d2t"] = ids - torch.arange(ids.numel())
    drafter = DSparkDrafter(cfg)
    own = drafter.hf_state_dict()
    for name, t in sd.items():
        if name in own and tuple(own[name].shape) != tuple(t.shape):
            raise ValueError(f"{path}: {name} has shape {list(t.shape)}, the configuration "
                             f"gives {list(own[name].shape)}")
    drafter.load_hf_state_dict(sd)
    return drafter
