"""Block drafters: DFlash (DFlashDraftModel) and DSpark (DSparkDraftModel, Qwen3DSparkModel,
DSparkSpeculator) -> GGUF arch "dflash", with the keys and tensor names llama.cpp reads
(shared/docs/reference/dflash-dspark.md §3).

A drafter is converted against its target (--target-model-dir: the target's Hugging Face directory
or its GGUF file), which supplies the tokenizer (copied into the drafter), the hidden size and
layer count the drafter's configuration is checked against, M-RoPE detection and, when the drafter
ships a trained mask embedding, the embedding and output matrices that the drafter then owns.

Index convention: Hugging Face configs name target layers by the index of the layer whose output
is read (-1: the embeddings); GGUF stores the index of the layer whose input that is, one more.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import gguf
import numpy as np
from safetensors import safe_open

from ..gguf_fields import field_value, open_gguf
from .checkpoint import Checkpoint, read_config
from .errors import ConversionError
from .gguf_out import Plan, Tensor
from .hparams import (TensorMapper, add_hparams, permute_pairs_to_rotate_half, read_hparams,
                      rope_parameters)
from .tokenizer import add_hf_tokenizer, copy_gguf_tokenizer

log = logging.getLogger("pyspec.convert")

DFLASH_ARCHS = ("DFlashDraftModel",)
DSPARK_ARCHS = ("DSparkDraftModel", "Qwen3DSparkModel", "DSparkSpeculator")
DRAFTER_ARCHS = DFLASH_ARCHS + DSPARK_ARCHS
MASK_EMBEDDING_FILES = ("mask_embedding.safetensors", "mask_embedding.npy", "mask_embedding.pt")
MASK_KEY = gguf.Keys.Tokenizer.MASK_ID
# pyspec's own key: the drafter was trained on blocks cut to this many rows or more too, so the
# engine may decode just the rows a round drafts (pyspec.train: --block-size-min).
BLOCK_SIZE_MIN_KEY = "pyspec.drafter.block_size_min"


@dataclass
class TargetInfo:
    """What a drafter conversion needs from its target."""
    source: Path
    n_embd: int
    n_layer: int
    n_vocab: int
    tied: bool
    mrope: bool
    add_tokenizer: Callable[[Plan], int]
    embedding: Callable[[], np.ndarray]      # [n_vocab, n_embd] float32
    head: Callable[[], np.ndarray]           # the output matrix, [n_vocab, n_embd] float32


def _hf_target(path: Path) -> TargetInfo:
    config = read_config(path)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    where = path / "config.json"
    for key in ("hidden_size", "num_hidden_layers"):
        if not isinstance(text.get(key), int):
            raise ConversionError(f"target {where} has no integer '{key}'")
    _, scaling = rope_parameters(text)
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    ckpt_box: List[Checkpoint] = []

    def ckpt() -> Checkpoint:
        if not ckpt_box:
            ckpt_box.append(Checkpoint(path))
        return ckpt_box[0]

    def embedding() -> np.ndarray:
        names = [n for n in ckpt().names() if n.endswith("embed_tokens.weight")]
        if not names:
            raise ConversionError(f"target {path} has no embed_tokens.weight tensor")
        return ckpt().load(min(names, key=len))

    def head() -> np.ndarray:
        if tied or "lm_head.weight" not in ckpt().tensors:
            return embedding()
        return ckpt().load("lm_head.weight")

    n_vocab = text.get("vocab_size")
    if not isinstance(n_vocab, int):
        n_vocab = embedding().shape[0]
    return TargetInfo(source=path, n_embd=text["hidden_size"], n_layer=text["num_hidden_layers"],
                      n_vocab=n_vocab, tied=tied, mrope="mrope_section" in scaling,
                      add_tokenizer=lambda plan: add_hf_tokenizer(plan, path, config, n_vocab),
                      embedding=embedding, head=head)


def _gguf_target(path: Path) -> TargetInfo:
    reader = open_gguf(path, "the target GGUF", ConversionError)

    def value(key, default=None):
        return field_value(reader, key, default)

    arch = value("general.architecture")
    n_embd, n_layer = value(f"{arch}.embedding_length"), value(f"{arch}.block_count")
    if arch is None or n_embd is None or n_layer is None:
        raise ConversionError(f"target GGUF {path} lacks general.architecture, "
                              f"{arch}.embedding_length or {arch}.block_count")
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise ConversionError(f"target GGUF {path} has no tokenizer (tokenizer.ggml.tokens)")
    tensors = {t.name: t for t in reader.tensors}

    def load(name: str) -> np.ndarray:
        t = tensors[name]
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.asarray(data, dtype=np.float32).reshape(int(t.shape[1]), int(t.shape[0]))

    if "token_embd.weight" not in tensors:
        raise ConversionError(f"target GGUF {path} has no token_embd.weight")
    tied = "output.weight" not in tensors
    return TargetInfo(
        source=path, n_embd=int(n_embd), n_layer=int(n_layer),
        n_vocab=len(reader.fields["tokenizer.ggml.tokens"].data), tied=tied,
        mrope=f"{arch}.rope.dimension_sections" in reader.fields,
        add_tokenizer=lambda plan: copy_gguf_tokenizer(plan, reader, skip=(MASK_KEY,)),
        embedding=lambda: load("token_embd.weight"),
        head=lambda: load("token_embd.weight" if tied else "output.weight"))


def target_info(path: Path) -> TargetInfo:
    if path.is_dir():
        return _hf_target(path)
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ConversionError(f"--target-model-dir {path} is a file but not a GGUF file")
        return _gguf_target(path)
    raise ConversionError(f"--target-model-dir {path} does not exist")


def _load_mask_embedding(path: Path, n_embd: int) -> Tuple[np.ndarray, Optional[int]]:
    """(embedding [n_embd], mask token id if the file carries one)."""
    mask_id = None
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="np") as f:
            names = list(f.keys())
        ckpt = Checkpoint(path.parent, files=[path])
        vec_names = [n for n in ("embedding", "mask_embedding") if n in names]
        if not vec_names:
            raise ConversionError(f"{path} has no 'embedding' (or 'mask_embedding') tensor; it has "
                                  f"{', '.join(names) or 'none'}")
        vec = ckpt.load(vec_names[0])
        if "mask_token_id" in names:
            mask_id = int(np.asarray(ckpt.load("mask_token_id")).reshape(-1)[0])
    elif path.suffix == ".npy":
        try:
            vec = np.load(path, allow_pickle=False)
        except ValueError as e:
            raise ConversionError(f"{path} is not a plain numpy array: {e}") from None
    else:
        if importlib.util.find_spec("torch") is None:
            raise ConversionError(f"{path} needs torch to read; install torch, or save the "
                                  "embedding as mask_embedding.safetensors or mask_embedding.npy")
        import torch
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
        if isinstance(obj, dict):
            tensor = obj.get("embedding", obj.get("mask_embedding"))
            if tensor is None:
                raise ConversionError(f"{path} holds a dict without 'embedding'/'mask_embedding'")
            if obj.get("mask_token_id") is not None:
                mask_id = int(obj["mask_token_id"])
        else:
            tensor = obj
        vec = tensor.detach().float().cpu().numpy()
    vec = np.asarray(vec, dtype=np.float32).reshape(-1)
    if vec.shape[0] != n_embd:
        raise ConversionError(f"the mask embedding in {path} has {vec.shape[0]} values, expected "
                              f"the hidden size {n_embd}")
    return vec, mask_id


@dataclass
class DrafterConfig:
    """A drafter's config.json, read once. DFlash fields live in `dflash_config` or at the top
    level; speculators exports keep the backbone's hyperparameters in `transformer_layer_config`."""
    where: Path
    hf_arch: str
    is_dspark: bool
    speculators: bool
    hp_cfg: dict
    dflash_cfg: dict

    @classmethod
    def read(cls, model_dir: Path, config: dict, hf_arch: str) -> "DrafterConfig":
        layer_cfg = config.get("transformer_layer_config")
        hp_cfg = dict(config, **layer_cfg) if isinstance(layer_cfg, dict) else dict(config)
        dcfg = config.get("dflash_config")
        return cls(where=model_dir / "config.json", hf_arch=hf_arch,
                   is_dspark=hf_arch in DSPARK_ARCHS,
                   speculators=isinstance(layer_cfg, dict) or "aux_hidden_state_layer_ids" in config,
                   hp_cfg=hp_cfg, dflash_cfg=dcfg if isinstance(dcfg, dict) else {})

    def opt(self, key: str, default=None):
        return self.dflash_cfg[key] if key in self.dflash_cfg else self.hp_cfg.get(key, default)

    def target_layer_ids(self, target: TargetInfo) -> List[int]:
        ids = self.opt("target_layer_ids")
        if ids is None and self.opt("aux_hidden_state_layer_ids") is not None:
            ids = [int(a) - 1 for a in self.opt("aux_hidden_state_layer_ids")]
        if not isinstance(ids, list) or not ids:
            raise ConversionError(f"{self.where} has no target_layer_ids (in dflash_config or at "
                                  "the top level) nor aux_hidden_state_layer_ids")
        for lid in ids:
            if not isinstance(lid, int) or not -1 <= lid < target.n_layer:
                raise ConversionError(f"target layer id {lid} is out of range: the target has "
                                      f"{target.n_layer} layers, so ids run from -1 (the "
                                      f"embeddings) to {target.n_layer - 1}")
            if lid == target.n_layer - 1:
                log.warning("target layer id %d reads the output of the last layer, which "
                            "llama.cpp's llama and qwen3 graphs do not expose", lid)
        return ids


def plan_drafter(model_dir: Path, config: dict, hf_arch: str, name: str,
                 target_dir: Optional[Path]) -> Plan:
    if target_dir is None:
        raise ConversionError(f"{hf_arch} is a drafter: --target-model-dir is required (the "
                              "target's Hugging Face directory or its GGUF file)")
    cfg = DrafterConfig.read(model_dir, config, hf_arch)
    hp = read_hparams(cfg.hp_cfg, cfg.where)
    if hp.n_ctx is None:
        raise ConversionError(f"{cfg.where} has no 'max_position_embeddings' (the drafter's "
                              "trained context length, written as dflash.context_length)")
    target = target_info(target_dir)
    if hp.n_embd != target.n_embd:
        raise ConversionError(f"drafter hidden_size {hp.n_embd} != target hidden size "
                              f"{target.n_embd} ({target.source}): the drafter reads the target's "
                              "hidden states and shares its embeddings, so they must be equal")
    layer_ids = cfg.target_layer_ids(target)
    if cfg.is_dspark and cfg.opt("markov_head_type", "vanilla") != "vanilla":
        raise ConversionError(f"markov_head_type '{cfg.opt('markov_head_type')}' is not "
                              "supported: only 'vanilla' (a first-order low-rank Markov head) is")

    plan = Plan(arch="dflash", name=name)
    add_hparams(plan, "dflash", hp, key_length=True)
    plan.i32_array("dflash.target_layers", [lid + 1 for lid in layer_ids])
    plan.u32("dflash.block_size", cfg.opt("block_size", 16))
    if cfg.opt("block_size_min"):   # pyspec-train-drafter --block-size-min; other engines ignore it
        plan.u32(BLOCK_SIZE_MIN_KEY, int(cfg.opt("block_size_min")))
    plan.boolean("dflash.attention.causal",
                 bool(cfg.opt("causal", cfg.hp_cfg.get("is_causal", False))))
    if cfg.is_dspark:
        anchor = cfg.opt("sample_from_anchor")
        plan.boolean("dflash.sample_from_anchor",
                     (not cfg.speculators) if anchor is None else bool(anchor))
    _optional_keys(plan, hp, cfg, target)

    m = TensorMapper(Checkpoint(model_dir, exclude=MASK_EMBEDDING_FILES), plan)
    mask_id, mask = _mask_token(model_dir, cfg, target, hp.n_embd)
    _add_embedding(plan, m, target, hp.n_embd, mask_id, mask)
    for required in ("fc.weight", "hidden_norm.weight", "norm.weight"):
        if not m.has(required):
            raise ConversionError(f"{model_dir} is missing the drafter tensor {required}")
    e = hp.n_embd
    m.map("fc.weight", "fc.weight", "weight", (e, len(layer_ids) * e))
    m.map("hidden_norm.weight", "enc.output_norm.weight", "f32", (e,))
    qk = permute_pairs_to_rotate_half if cfg.opt("rope_is_neox_style", True) is False else None
    m.map_layers(hp, qk_norm=True, qk_transform=qk, optional=("self_attn.v_proj.weight",))
    m.map("norm.weight", "output_norm.weight", "f32", (e,))
    n_vocab_draft = _add_output(plan, m, cfg, target, e, mask is not None)
    _add_dspark_heads(plan, m, cfg, target, e, n_vocab_draft)
    m.reject_unknown()

    target.add_tokenizer(plan)
    plan.u32(MASK_KEY, mask_id)
    return plan


def _mask_token(model_dir: Path, cfg: DrafterConfig, target: TargetInfo,
                n_embd: int) -> Tuple[int, Optional[Tuple[Path, np.ndarray]]]:
    """(mask token id, (file, trained embedding) if the drafter ships one)."""
    mask_file = next((model_dir / f for f in MASK_EMBEDDING_FILES if (model_dir / f).is_file()),
                     None)
    mask_id = cfg.opt("mask_token_id")
    mask = None
    if mask_file is not None:
        vec, file_id = _load_mask_embedding(mask_file, n_embd)
        mask = (mask_file, vec)
        if file_id is not None:
            if mask_id is not None and int(mask_id) != file_id:
                raise ConversionError(f"{mask_file} is for mask token {file_id} but {cfg.where} "
                                      f"says mask_token_id {mask_id}")
            mask_id = file_id
    if mask_id is None:
        raise ConversionError(f"{cfg.where} has no mask_token_id (in dflash_config or at the top "
                              "level)")
    if not 0 <= int(mask_id) < target.n_vocab:
        raise ConversionError(f"mask_token_id {mask_id} is outside the target vocabulary "
                              f"({target.n_vocab} tokens)")
    return int(mask_id), mask


def _add_embedding(plan: Plan, m: TensorMapper, target: TargetInfo, e: int, mask_id: int,
                   mask: Optional[Tuple[Path, np.ndarray]]) -> None:
    """token_embd: the drafter's own embedding if it has one, and with a trained mask embedding
    the drafter owns one in any case: its own or the target's, with the mask row replaced."""
    v = target.n_vocab
    own = m.has("embed_tokens.weight")
    if own:
        m.check_shape("embed_tokens.weight", (v, e))
    if mask is None:
        if own:
            m.map("embed_tokens.weight", "token_embd.weight", "weight", (v, e))
        return
    mask_file, vec = mask
    base = (lambda src=m.use("embed_tokens.weight"): m.ckpt.load(src)) if own else target.embedding

    def patched():
        emb = np.array(base(), dtype=np.float32)
        if emb.shape != (v, e):
            raise ConversionError(f"the embedding to patch has shape {list(emb.shape)}, "
                                  f"expected {[v, e]}")
        emb[mask_id] = vec
        return emb
    plan.add(Tensor("token_embd.weight", (v, e), patched,
                    source=f"{'embed_tokens' if own else 'target embedding'} + {mask_file.name}"))
    plan.notes.append(f"token_embd: row {mask_id} patched from {mask_file.name}")


def _add_output(plan: Plan, m: TensorMapper, cfg: DrafterConfig, target: TargetInfo, e: int,
                owns_embedding: bool) -> int:
    """output (and d2t for a reduced draft vocabulary); returns the draft vocabulary size.

    A DSpark head over the full vocabulary is the target's and is dropped, as llama.cpp's
    converter does; llama.cpp then takes the output from the drafter's token_embd if it has one,
    else from the target."""
    v = target.n_vocab
    has_head, has_d2t = m.has("lm_head.weight"), m.has("d2t")
    vd = m.shape("lm_head.weight")[0] if has_head else v
    if has_d2t:
        if not has_head:
            raise ConversionError(f"{m.ckpt.dir} has d2t but no lm_head.weight for the draft "
                                  "vocabulary it maps")
        m.check_shape("d2t", (vd,))
    elif vd != v:
        raise ConversionError(f"lm_head.weight has {vd} rows but the target vocabulary has {v} "
                              "tokens and there is no d2t mapping the draft vocabulary to it")
    if has_head and cfg.is_dspark and vd == v and not has_d2t:
        m.use("lm_head.weight")
        plan.notes.append("lm_head.weight not written: a full-vocabulary DSpark head is the "
                          "target's")
        if m.has("embed_tokens.weight") and not owns_embedding and not target.tied:
            log.warning("the drafter has its own token_embd but no output: llama.cpp then uses "
                        "token_embd as the output, which is wrong for this untied target")
    elif has_head:
        m.map("lm_head.weight", "output.weight", "weight", (vd, e))
    if owns_embedding and not any(t.name == "output.weight" for t in plan.tensors):
        # The drafter's token_embd is patched, so the tie to it would be wrong: the output is
        # the target's own, unpatched.
        plan.add(Tensor("output.weight", (v, e), target.head, source="target output matrix"))
    if has_d2t:
        src = m.use("d2t")

        def absolute_ids():
            offsets = m.ckpt.load(src).astype(np.int64)
            return offsets + np.arange(offsets.shape[0], dtype=np.int64)
        plan.add(Tensor("d2t", (vd,), absolute_ids, kind="i64", source=src))
    if m.has("t2d"):
        m.use("t2d")    # the inverse map; llama.cpp does not use it
    return vd


def _add_dspark_heads(plan: Plan, m: TensorMapper, cfg: DrafterConfig, target: TargetInfo,
                      e: int, vd: int) -> None:
    """The Markov head (markov_w1 {R, V}, markov_w2 {R, Vd}) and the confidence head
    (conf_proj {E+R, 1}, bias {1}), and the has_confidence_head flag."""
    v = target.n_vocab
    has_conf = False
    if m.has("markov_head.markov_w1.weight"):
        if not cfg.is_dspark:
            raise ConversionError(f"{cfg.hf_arch} has Markov head tensors; a DSpark drafter's "
                                  f"config names a DSpark architecture ({', '.join(DSPARK_ARCHS)})")
        w1 = m.shape("markov_head.markov_w1.weight")
        if len(w1) != 2 or w1[0] != v:
            raise ConversionError(f"markov_head.markov_w1.weight has shape {list(w1)}, expected "
                                  f"[{v}, rank] (one row per target token)")
        rank = w1[1]
        m.map("markov_head.markov_w1.weight", "markov_w1.weight", "weight")
        m.map("markov_head.markov_w2.weight", "markov_w2.weight", "weight", (vd, rank))
        if m.has("markov_head.markov_w2.scale"):
            m.map("markov_head.markov_w2.scale", "markov_w2.scale", "f32", (1,))
        if m.has("confidence_head.proj.weight"):
            has_conf = True
            m.map("confidence_head.proj.weight", "conf_proj.weight", "weight", (1, e + rank))
            if m.has("confidence_head.proj.bias"):
                m.map("confidence_head.proj.bias", "conf_proj.bias", "f32", (1,))
    elif cfg.is_dspark:
        plan.notes.append("no Markov head (markov_head.markov_w1.weight): llama.cpp runs this "
                          "file as a plain DFlash drafter")
    if cfg.is_dspark:
        plan.boolean("dflash.has_confidence_head", has_conf)


def _optional_keys(plan: Plan, hp, cfg: DrafterConfig, target: TargetInfo) -> None:
    """Keys llama.cpp reads when present: embedding/value scales, logit softcapping, a GELU
    activation, sliding-window attention, and M-RoPE sections for drafts of M-RoPE targets."""
    opt, where = cfg.opt, cfg.where
    for key, gguf_key in (("input_embedding_scale", "dflash.embedding_scale"),
                          ("final_logit_softcapping", "dflash.final_logit_softcapping"),
                          ("attention_value_scale", "dflash.attention.value_scale")):
        if opt(key) is not None:
            plan.f32(gguf_key, float(opt(key)))
    act = cfg.hp_cfg.get("hidden_act", "silu")
    if act in ("gelu", "gelu_pytorch_tanh"):
        plan.string("dflash.hidden_activation", act)
    elif act != "silu":
        raise ConversionError(f"{where}: hidden_act '{act}' is not supported (silu, gelu, "
                              "gelu_pytorch_tanh)")
    if bool(opt("use_swa", opt("use_sliding_window", False))):
        window = opt("swa_window_size", opt("sliding_window"))
        if not isinstance(window, int) or window <= 0:
            raise ConversionError(f"{where} enables sliding-window attention without a window size "
                                  "(swa_window_size or sliding_window)")
        plan.u32("dflash.attention.sliding_window", window)
        types = opt("layer_types")
        pattern = ([t == "sliding_attention" for t in types] if isinstance(types, list)
                   else [True] * hp.n_layer)
        if len(pattern) != hp.n_layer:
            raise ConversionError(f"{where}: layer_types has {len(pattern)} entries for "
                                  f"{hp.n_layer} layers")
        plan.bool_array("dflash.attention.sliding_window_pattern", pattern)
    if target.mrope:
        plan.i32_array("dflash.rope.dimension_sections", [hp.n_rot // 2, 0, 0, 0])
