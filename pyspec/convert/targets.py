"""Target models: LlamaForCausalLM -> GGUF arch "llama", Qwen3ForCausalLM -> "qwen3", with
llama.cpp's keys and tensor names.

llama.cpp runs llama with its NORMAL rope (rotating pairs (2i, 2i+1)) but Hugging Face's Llama
rotates halves (pairs (i, i + d/2)), so the rows of Q and K are reordered per head here. Qwen3
runs with the NEOX rope, which is Hugging Face's own layout: no reordering.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .checkpoint import Checkpoint
from .errors import ConversionError
from .gguf_out import Plan
from .hparams import TensorMapper, add_hparams, permute_rotate_half_to_pairs, read_hparams
from .tokenizer import add_hf_tokenizer

log = logging.getLogger("pyspec.convert")

TARGET_ARCHS = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}


def plan_target(model_dir: Path, config: dict, hf_arch: str, name: str) -> Plan:
    arch = TARGET_ARCHS[hf_arch]
    where = model_dir / "config.json"
    hp = read_hparams(config, where)
    if hp.n_ctx is None:
        raise ConversionError(f"{where} has no 'max_position_embeddings'")
    ckpt = Checkpoint(model_dir)
    plan = Plan(arch=arch, name=name)
    mapper = TensorMapper(ckpt, plan)

    if not mapper.has("embed_tokens.weight"):
        raise ConversionError(f"{model_dir} has no embedding tensor model.embed_tokens.weight")
    n_vocab = mapper.shape("embed_tokens.weight")[0]
    vocab_size = config.get("vocab_size", n_vocab)
    if vocab_size != n_vocab:
        raise ConversionError(f"{where} says vocab_size {vocab_size} but model.embed_tokens.weight "
                              f"has {n_vocab} rows")
    tied = bool(config.get("tie_word_embeddings", False)) or not mapper.has("lm_head.weight")

    add_hparams(plan, arch, hp, key_length=arch == "qwen3")
    plan.u32(f"{arch}.vocab_size", n_vocab)
    add_hf_tokenizer(plan, model_dir, config, n_vocab)

    mapper.map("embed_tokens.weight", "token_embd.weight", "weight", (n_vocab, hp.n_embd))
    permute = permute_rotate_half_to_pairs if arch == "llama" else None
    mapper.map_layers(hp, qk_norm=arch == "qwen3", qk_transform=permute)
    mapper.map("norm.weight", "output_norm.weight", "f32", (hp.n_embd,))
    if tied:
        if mapper.has("lm_head.weight"):
            mapper.use("lm_head.weight")
            plan.notes.append("tied embeddings: lm_head.weight not written (output = token_embd)")
        else:
            plan.notes.append("tied embeddings: output = token_embd")
    else:
        mapper.map("lm_head.weight", "output.weight", "weight", (n_vocab, hp.n_embd))
    mapper.reject_unknown()
    return plan
