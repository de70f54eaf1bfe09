"""`pyspec-server`'s command line: llama-server's flags, short forms, defaults and env vars.

The rules follow llama.cpp's common/arg.cpp (reference §2):
- long options have `_` normalised to `-` (`--n_predict` == `--n-predict`); the value is the
  next argv item, or (our extension) after `=` in `--port=8080`;
- every option with an env var can be set through it, and the command line wins: an env var is
  read only when none of its option's spellings appeared on the command line;
- boolean env values are on|enabled|true|1 / off|disabled|false|0, anything else is an error;
- unknown options are `invalid argument: X`.

Every llama-server flag we know of falls in one of four classes, each kept in one table:
- supported (_OPTIONS): parsed into a ServerConfig field;
- ignored (_IGNORED): hardware/feature tuning that changes no output here; accepted, its value
  consumed, and a warning queued for main to print;
- unsupported (_UNSUPPORTED): behaviour we do not implement; rejected rather than silently
  producing different results than llama-server would;
- removed (_REMOVED): flags llama.cpp itself removed; rejected with llama.cpp's hint.

Parsing is a small hand-written loop, not argparse: llama.cpp's rules (normalise only option
names, never values; `-1` is a value, not an option; env fallbacks per option) are easier to
follow exactly this way. Errors are ArgError (main prints `error: <message>` and exits 1); -h and
--version print to stdout and raise SystemExit(0).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..cli_common import UserError, read_user_file


class ArgError(UserError, ValueError):
    """A bad command line or env var: main prints `error: <message>` and exits with code 1."""


# --------------------------------------------------------------------------------------------
# The result

_SPEC_TYPES = ("none", "draft-dflash", "draft-dspark", "ngram-simple")
_SPEC_DRAFT_TYPES = ("draft-dflash", "draft-dspark")
# llama.cpp's other speculative types: rejected by name rather than as unknown values.
_SPEC_TYPES_UNSUPPORTED = ("draft-simple", "draft-eagle3", "draft-mtp",
                           "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
# What the core's KV cache can store (csrc/bindings/kv_cache_type.h).
_KV_TYPES = ("f16", "f32")
_KV_TYPES_LLAMA = ("bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def _pad256(n: int) -> int:
    return (n + 255) // 256 * 256


@dataclass
class ServerConfig:
    """Everything the command line and env say. Defaults are llama-server's."""

    # model sources
    model: Optional[str] = None          # None and no hf_repo: the embedded default model
    hf_repo: Optional[str] = None        # user/model[:quant]
    hf_file: Optional[str] = None
    hf_repo_draft: Optional[str] = None
    hf_token: Optional[str] = None
    offline: bool = False
    model_draft: Optional[str] = None
    # speculative decoding
    spec_type: Optional[str] = None      # the drafter's type; None: from the drafter file
    spec_ngram: bool = False             # ngram-simple listed in --spec-type (set by _validate)
    spec_ngram_size_n: int = 12
    spec_ngram_size_m: int = 48
    spec_draft_n_max: Optional[int] = None   # None: 3, or the embedded drafter's tuned value
    spec_draft_n_min: int = 0
    spec_draft_p_min: float = 0.0
    spec_verify: Optional[str] = None    # None: greedy at T=0, rejection at T>0
    # context, batching, slots
    ctx_size: int = 0                    # 0: the model's n_ctx_train
    n_predict: int = -1
    batch_size: int = 2048
    ubatch_size: int = 512
    parallel: int = -1                   # -1: auto (4 slots, unified KV)
    kv_unified: Optional[bool] = None    # None: llama's default (on when -np is auto)
    kv_unified_per_slot: int = 0         # 0: no per-slot cap
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    threads: int = -1                    # -1: all cores
    threads_batch: int = -1              # -1: same as threads
    n_gpu_layers: Optional[str] = None   # "auto" | "all" | N, as given
    n_gpu_layers_draft: Optional[str] = None
    warmup: bool = True                  # a throwaway request at load (llama-server's warmup run)
    # HTTP
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: List[str] = field(default_factory=list)
    metrics: bool = False
    slots: bool = True
    props: bool = False
    alias: List[str] = field(default_factory=list)
    tags: List[str] = field(default_factory=list)
    timeout: int = 3600
    cors_origins: str = "*"
    # sampling defaults for requests
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_last_n: int = 64
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1
    ignore_eos: bool = False
    # chat
    jinja: bool = True
    spm_infill: bool = False             # /infill: suffix before prefix (SPM order)
    chat_template: Optional[str] = None
    chat_template_file: Optional[str] = None
    reasoning_format: str = "none"       # only "none" is supported (no reasoning extraction)
    # behaviour
    cache_prompt: bool = True
    slot_prompt_similarity: float = 0.1  # -sps: reuse a slot's cache above this prompt overlap
    cont_batching: bool = True           # -nocb is accepted; requests are still batched
    verbose: bool = False
    warnings: List[str] = field(default_factory=list)  # accepted-but-ignored flags, for main

    def model_name(self) -> str:
        """llama-server's model_name: the first alias in sorted order (llama keeps them in a
        std::set), else the HF repo string, else the -m path as given, else the embedded model's
        file name."""
        if self.alias:
            return sorted(self.alias)[0]
        if self.hf_repo:
            return self.hf_repo
        if self.model:
            return self.model
        from ..model import default_model_path
        return os.path.basename(default_model_path())

    def slot_layout(self, n_ctx_train: int) -> Tuple[int, int, bool]:
        """(n_slots, n_ctx_per_slot, unified), by llama-server's rules (reference §2).

        -np auto forces 4 slots over one unified KV pool whatever -kvu says (server.cpp:156-161).
        The total -c is padded to 256; split per slot it is divided then padded again
        (llama-context.cpp:290-305), so `-c 2000 -np 3` gives 768 per slot. A unified pool lets
        each slot use all of it. The per-slot size is finally capped by --kv-unified-per-slot
        and by n_ctx_train (server-context.cpp:4007-4015).
        """
        auto = self.parallel == -1
        n_slots = 4 if auto else self.parallel
        unified = True if auto else bool(self.kv_unified)
        n_ctx = self.ctx_size
        if n_ctx == 0:
            # --kv-unified-per-slot without -c sizes the pool for every slot (server.cpp:164-174).
            n_ctx = n_slots * self.kv_unified_per_slot if self.kv_unified_per_slot > 0 \
                else n_ctx_train
        n_ctx = _pad256(n_ctx)
        per_slot = n_ctx if unified else _pad256(n_ctx // n_slots)
        if self.kv_unified_per_slot > 0:
            per_slot = min(per_slot, self.kv_unified_per_slot)
        if n_ctx_train > 0:
            per_slot = min(per_slot, n_ctx_train)
        return n_slots, per_slot, unified


# --------------------------------------------------------------------------------------------
# Value parsers: (option name, text) -> value; they raise ArgError naming the option.

def _int(name: str, text: str) -> int:
    try:
        return int(text.strip(), 10)
    except ValueError:
        raise ArgError(f"invalid value for {name}: '{text}' (expected an integer)") from None


def _float(name: str, text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ArgError(f"invalid value for {name}: '{text}' (expected a number)")
    return value


def _str(name: str, text: str) -> str:
    return text


def _csv(name: str, text: str) -> List[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _gpu_layers(name: str, text: str) -> str:
    if text not in ("auto", "all"):
        _int(name, text)
    return text


def _kv_type(name: str, text: str) -> str:
    if text in _KV_TYPES:
        return text
    if text in _KV_TYPES_LLAMA:
        raise ArgError(f"{name} {text} is not supported yet by pyspec-server "
                       f"(KV cache types: {', '.join(_KV_TYPES)})")
    raise ArgError(f"invalid value for {name}: '{text}' (supported: {', '.join(_KV_TYPES)})")


def _spec_type(name: str, text: str) -> str:
    """llama.cpp's comma list (the flag may repeat): at most one drafter type (or none), and
    ngram-simple, which runs ahead of the drafter. Kept as the list's text; _validate splits it
    into spec_type (the drafter's) and spec_ngram."""
    kinds = _csv(name, text) or ["none"]
    for kind in kinds:
        if kind in _SPEC_TYPES_UNSUPPORTED:
            raise ArgError(f"{name} {kind} is not supported yet by pyspec-server "
                           f"(supported: {', '.join(_SPEC_TYPES)})")
        if kind not in _SPEC_TYPES:
            raise ArgError(f"invalid value for {name}: '{kind}'")
    drafters = sorted({k for k in kinds if k in _SPEC_DRAFT_TYPES})
    if len(drafters) > 1:
        raise ArgError(f"{name} with several drafter types ({text}) is not supported yet by "
                       "pyspec-server: give one")
    if "none" in kinds and len(set(kinds)) > 1:
        raise ArgError(f"{name} none cannot be combined with other types ({text})")
    return ",".join(dict.fromkeys(kinds))


def _choice(*allowed: str, unsupported: Tuple[str, ...] = ()) -> Callable[[str, str], str]:
    def parse(name: str, text: str) -> str:
        if text in allowed:
            return text
        if text in unsupported:
            raise ArgError(f"{name} {text} is not supported yet by pyspec-server "
                           f"(supported: {', '.join(allowed)})")
        raise ArgError(f"invalid value for {name}: '{text}' (expected {'|'.join(allowed)})")
    return parse


def _api_key_file(name: str, path: str) -> List[str]:
    """One key per line; blank lines are skipped, as llama.cpp does."""
    text = read_user_file(path, "API key file", error=ArgError)
    return [line.strip() for line in text.splitlines() if line.strip()]


_TRUE = ("on", "enabled", "true", "1")
_FALSE = ("off", "disabled", "false", "0")


def _env_bool(env: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ArgError(f"invalid boolean value for environment variable {env}: '{text}' "
                   f"(expected {'|'.join(_TRUE)} or {'|'.join(_FALSE)})")


# --------------------------------------------------------------------------------------------
# Supported options

@dataclass(frozen=True)
class _Opt:
    names: Tuple[str, ...]
    dest: str
    parse: Optional[Callable[[str, str], Any]]   # None: a flag (no value)
    help: str
    env: Optional[str] = None
    neg: Tuple[str, ...] = ()                    # negative spellings of a flag (store False)
    metavar: str = "N"
    append: bool = False                         # list values accumulate over repeats


_OPTIONS: Tuple[_Opt, ...] = (
    _Opt(("-m", "--model"), "model", _str, "GGUF model path (default: the embedded model)",
         env="LLAMA_ARG_MODEL", metavar="FNAME"),
    _Opt(("-hf", "-hfr", "--hf-repo"), "hf_repo", _str,
         "Hugging Face model repository, <user>/<model>[:quant]", env="LLAMA_ARG_HF_REPO",
         metavar="REPO"),
    _Opt(("-hff", "--hf-file"), "hf_file", _str, "file in the HF repository (overrides :quant)",
         env="LLAMA_ARG_HF_FILE", metavar="FILE"),
    _Opt(("-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf"), "hf_repo_draft", _str,
         "Hugging Face repository of the draft model", env="LLAMA_ARG_SPEC_DRAFT_HF_REPO",
         metavar="REPO"),
    _Opt(("-hft", "--hf-token"), "hf_token", _str, "Hugging Face access token", env="HF_TOKEN",
         metavar="TOKEN"),
    _Opt(("--offline",), "offline", None, "use only the local HF cache, no network",
         env="LLAMA_ARG_OFFLINE"),
    _Opt(("-md", "--model-draft", "--spec-draft-model"), "model_draft", _str,
         "DFlash/DSpark drafter GGUF for speculative decoding",
         env="LLAMA_ARG_SPEC_DRAFT_MODEL", metavar="FNAME"),
    _Opt(("--spec-type",), "spec_type", _spec_type,
         "speculative decoding types, a comma list: none|draft-dflash|draft-dspark|ngram-simple "
         "(default: the drafter's, from its file; ngram-simple drafts from the request's own "
         "history, ahead of any drafter)",
         env="LLAMA_ARG_SPEC_TYPE", metavar="TYPE"),
    _Opt(("--spec-draft-n-max",), "spec_draft_n_max", _int,
         "max drafted tokens per round (default: 3; 2 with the embedded drafter)",
         env="LLAMA_ARG_SPEC_DRAFT_N_MAX"),
    _Opt(("--spec-ngram-size-n",), "spec_ngram_size_n", _int,
         "ngram-simple: length of the lookup n-gram (default: 12)"),
    _Opt(("--spec-ngram-size-m",), "spec_ngram_size_m", _int,
         "ngram-simple: most tokens drafted from a match (default: 48)"),
    _Opt(("--spec-draft-n-min",), "spec_draft_n_min", _int,
         "min drafted tokens to use a draft (default: 0)", env="LLAMA_ARG_SPEC_DRAFT_N_MIN"),
    _Opt(("-sps", "--slot-prompt-similarity"), "slot_prompt_similarity", _float,
         "how much of a prompt a slot's cached tokens must cover for the slot to be chosen "
         "(default: 0.1; 0: never pick by similarity)"),
    _Opt(("--spec-draft-p-min", "--draft-p-min"), "spec_draft_p_min", _float,
         "stop drafting below this confidence (default: 0.0)", env="LLAMA_ARG_SPEC_DRAFT_P_MIN",
         metavar="P"),
    _Opt(("--spec-verify",), "spec_verify", _choice("greedy", "rejection", "block"),
         "verification rule: greedy|rejection|block (default: greedy at temp 0, else "
         "rejection)", env="LLAMA_ARG_SPEC_VERIFY", metavar="RULE"),
    _Opt(("-c", "--ctx-size"), "ctx_size", _int,
         "total KV size, 0 = the model's training context (default: 0)",
         env="LLAMA_ARG_CTX_SIZE"),
    _Opt(("-n", "--predict", "--n-predict"), "n_predict", _int,
         "tokens to predict, -1 = until the end (default: -1)", env="LLAMA_ARG_N_PREDICT"),
    _Opt(("-b", "--batch-size"), "batch_size", _int, "logical batch size (default: 2048)",
         env="LLAMA_ARG_BATCH"),
    _Opt(("-ub", "--ubatch-size"), "ubatch_size", _int, "physical batch size (default: 512)",
         env="LLAMA_ARG_UBATCH"),
    _Opt(("-np", "--parallel"), "parallel", _int,
         "number of slots, -1 = auto: 4 slots over a unified KV (default: -1)",
         env="LLAMA_ARG_N_PARALLEL"),
    _Opt(("-kvu", "--kv-unified"), "kv_unified", None,
         "one KV pool shared by all slots (default: on when -np is auto)",
         env="LLAMA_ARG_KV_UNIFIED", neg=("-no-kvu", "--no-kv-unified")),
    _Opt(("--kv-unified-per-slot",), "kv_unified_per_slot", _int,
         "cap on each slot's context in a unified KV, 0 = none (default: 0)",
         env="LLAMA_ARG_KV_UNIFIED_PER_SLOT"),
    _Opt(("-ctk", "--cache-type-k"), "cache_type_k", _kv_type, "KV cache type for K: f16|f32",
         env="LLAMA_ARG_CACHE_TYPE_K", metavar="TYPE"),
    _Opt(("-ctv", "--cache-type-v"), "cache_type_v", _kv_type, "KV cache type for V: f16|f32",
         env="LLAMA_ARG_CACHE_TYPE_V", metavar="TYPE"),
    _Opt(("-t", "--threads"), "threads", _int, "CPU threads, -1 = all cores (default: -1)",
         env="LLAMA_ARG_THREADS"),
    _Opt(("-tb", "--threads-batch"), "threads_batch", _int,
         "threads for batches (default: same as --threads)"),
    _Opt(("-ngl", "--gpu-layers", "--n-gpu-layers"), "n_gpu_layers", _gpu_layers,
         "layers on the GPU: N|auto|all", env="LLAMA_ARG_N_GPU_LAYERS"),
    _Opt(("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "--spec-draft-ngl"),
         "n_gpu_layers_draft", _gpu_layers, "draft model layers on the GPU: N|auto|all",
         env="LLAMA_ARG_N_GPU_LAYERS_DRAFT"),
    _Opt(("--warmup",), "warmup", None,
         "run a throwaway request at load, so the first client does not pay for packing or "
         "uploading the weights and capturing graphs (default: enabled)", neg=("--no-warmup",)),
    _Opt(("--host",), "host", _str, "address to listen on (default: 127.0.0.1)",
         env="LLAMA_ARG_HOST", metavar="HOST"),
    _Opt(("--port",), "port", _int, "port to listen on, 0 = any (default: 8080)",
         env="LLAMA_ARG_PORT", metavar="PORT"),
    _Opt(("--api-key",), "api_keys", _csv, "API key(s), comma separated", env="LLAMA_API_KEY",
         metavar="KEY", append=True),
    _Opt(("--api-key-file",), "api_keys", _api_key_file, "file with one API key per line",
         env="LLAMA_ARG_API_KEY_FILE", metavar="FNAME", append=True),
    _Opt(("--metrics",), "metrics", None, "enable /metrics", env="LLAMA_ARG_ENDPOINT_METRICS"),
    _Opt(("--props",), "props", None, "enable POST /props", env="LLAMA_ARG_ENDPOINT_PROPS"),
    _Opt(("--slots",), "slots", None, "enable /slots (default: enabled)",
         env="LLAMA_ARG_ENDPOINT_SLOTS", neg=("--no-slots",)),
    _Opt(("-a", "--alias"), "alias", _csv, "model name(s) for the API, comma separated",
         env="LLAMA_ARG_ALIAS", metavar="NAME"),
    _Opt(("--tags",), "tags", _csv, "model tags, comma separated", env="LLAMA_ARG_TAGS",
         metavar="TAGS"),
    _Opt(("-to", "--timeout"), "timeout", _int, "HTTP read/write timeout in s (default: 3600)",
         env="LLAMA_ARG_TIMEOUT"),
    _Opt(("--cors-origins",), "cors_origins", _str, "allowed CORS origins (default: *)",
         env="LLAMA_ARG_CORS_ORIGINS", metavar="ORIGINS"),
    _Opt(("--temp", "--temperature"), "temp", _float, "temperature (default: 0.8)",
         env="LLAMA_ARG_TEMPERATURE"),
    _Opt(("--top-k",), "top_k", _int, "top-k sampling, 0 = off (default: 40)",
         env="LLAMA_ARG_TOP_K"),
    _Opt(("--top-p",), "top_p", _float, "top-p sampling, 1.0 = off (default: 0.95)",
         env="LLAMA_ARG_TOP_P"),
    _Opt(("--min-p",), "min_p", _float, "min-p sampling, 0.0 = off (default: 0.05)",
         env="LLAMA_ARG_MIN_P"),
    _Opt(("--repeat-last-n",), "repeat_last_n", _int,
         "penalty window, 0 = off, -1 = context (default: 64)", env="LLAMA_ARG_REPEAT_LAST_N"),
    _Opt(("--repeat-penalty",), "repeat_penalty", _float, "repeat penalty (default: 1.0 = off)",
         env="LLAMA_ARG_REPEAT_PENALTY"),
    _Opt(("--presence-penalty",), "presence_penalty", _float,
         "presence penalty (default: 0.0 = off)", env="LLAMA_ARG_PRESENCE_PENALTY"),
    _Opt(("--frequency-penalty",), "frequency_penalty", _float,
         "frequency penalty (default: 0.0 = off)", env="LLAMA_ARG_FREQUENCY_PENALTY"),
    _Opt(("-s", "--seed"), "seed", _int, "default seed, -1 = random (default: -1)",
         metavar="SEED"),
    _Opt(("--ignore-eos",), "ignore_eos", None, "keep generating past end-of-generation"),
    _Opt(("--spm-infill",), "spm_infill", None,
         "/infill prompts in Suffix/Prefix/Middle order, as some models want (default: "
         "Prefix/Suffix/Middle)"),
    _Opt(("--jinja",), "jinja", None, "use the Jinja chat template engine (default: enabled)",
         env="LLAMA_ARG_JINJA", neg=("--no-jinja",)),
    _Opt(("--chat-template",), "chat_template", _str, "chat template: Jinja source or a name",
         env="LLAMA_ARG_CHAT_TEMPLATE", metavar="TEMPLATE"),
    _Opt(("--chat-template-file",), "chat_template_file", _str, "read the chat template from "
         "a file", env="LLAMA_ARG_CHAT_TEMPLATE_FILE", metavar="FNAME"),
    _Opt(("--reasoning-format",), "reasoning_format",
         _choice("none", unsupported=("auto", "deepseek", "deepseek-legacy")),
         "reasoning extraction: none (others not supported yet)", env="LLAMA_ARG_THINK",
         metavar="FORMAT"),
    _Opt(("--cache-prompt",), "cache_prompt", None, "reuse a slot's cached prompt prefix "
         "(default: enabled)", env="LLAMA_ARG_CACHE_PROMPT", neg=("--no-cache-prompt",)),
    _Opt(("-cb", "--cont-batching"), "cont_batching", None, "continuous batching (default: "
         "enabled; -nocb is accepted but requests are still batched)",
         env="LLAMA_ARG_CONT_BATCHING", neg=("-nocb", "--no-cont-batching")),
    _Opt(("-v", "--verbose", "--log-verbose"), "verbose", None, "verbose logging"),
)


# --------------------------------------------------------------------------------------------
# Accepted and ignored: (spellings, takes a value, why it changes nothing here)

_IGNORED: Tuple[Tuple[Tuple[str, ...], bool, str], ...] = (
    (("--mlock",), False, "pyspec does not pin model memory"),
    (("--spec-ngram-check-rate",), True, "ngram-simple looks up every round (same tokens)"),
    (("--spec-ngram-min-hits",), True, "it applies to ngram-map-k, which pyspec does not have"),
    (("--mmap",), False, "pyspec decides how it maps the model file"),
    (("--no-mmap",), False, "pyspec decides how it maps the model file"),
    (("-fa", "--flash-attn"), True, "pyspec picks its own attention kernels"),
    (("--threads-http",), True, "the HTTP server sizes its own worker pool"),
    (("--ui", "--webui", "--no-ui", "--no-webui"), False, "pyspec-server has no web UI"),
    (("-cram", "--cache-ram"), True, "there is no host-side prompt cache"),
    (("--no-cache-idle-slots",), False, "there is no host-side prompt cache"),
    (("--numa",), True, "NUMA placement is left to the OS"),
    (("-dev", "--device"), True, "pyspec chooses its own device"),
    (("-devd", "--device-draft"), True, "pyspec chooses its own device"),
    (("-sm", "--split-mode"), True, "pyspec runs on one device"),
    (("-ts", "--tensor-split"), True, "pyspec runs on one device"),
    (("-mg", "--main-gpu"), True, "pyspec runs on one device"),
    (("-nkvo", "--no-kv-offload"), False, "pyspec decides where the KV cache lives"),
    (("--no-op-offload",), False, "pyspec decides where operations run"),
    (("--no-repack",), False, "pyspec uses its own weight layouts"),
    (("-cmoe", "--cpu-moe"), False, "pyspec decides where weights live"),
    (("-ncmoe", "--n-cpu-moe"), True, "pyspec decides where weights live"),
    (("-ot", "--override-tensor"), True, "pyspec decides where weights live"),
    (("-fit", "--fit"), True, "the context is never shrunk to fit device memory"),
    (("-fitt", "--fit-target"), True, "the context is never shrunk to fit device memory"),
    (("-fitc", "--fit-ctx"), True, "the context is never shrunk to fit device memory"),
    (("--check-tensors",), False, "pyspec validates tensors while loading"),
    (("-C", "--cpu-mask"), True, "thread affinity is left to the OS"),
    (("-Cr", "--cpu-range"), True, "thread affinity is left to the OS"),
    (("--cpu-strict",), True, "thread affinity is left to the OS"),
    (("--prio",), True, "thread priority is left to the OS"),
    (("--poll",), True, "pyspec's threads do not busy-poll"),
    (("-Cb", "--cpu-mask-batch"), True, "thread affinity is left to the OS"),
    (("-Crb", "--cpu-range-batch"), True, "thread affinity is left to the OS"),
    (("--cpu-strict-batch",), True, "thread affinity is left to the OS"),
    (("--prio-batch",), True, "thread priority is left to the OS"),
    (("--poll-batch",), True, "pyspec's threads do not busy-poll"),
    (("--sleep-idle-seconds",), True, "the model stays loaded while the server runs"),
    (("--swa-full",), False, "the KV cache already keeps every position"),
    (("--no-context-shift",), False, "context shift is off, as it is by default"),
    (("--no-mmproj",), False, "no multimodal projector is ever loaded"),
    (("--no-models-autoload",), False, "there is no router mode"),
    (("--backend-sampling",), False, "sampling always runs in pyspec's own sampler"),
    (("-dt", "--defrag-thold"), True, "deprecated in llama.cpp, no KV defragmentation needed"),
    (("--perf", "--no-perf"), False, "timings are always collected"),
    (("--log-disable",), False, "logging goes to stderr"),
    (("--log-file",), True, "logging goes to stderr"),
    (("--log-colors",), True, "logging goes to stderr"),
    (("--log-prefix",), False, "logging goes to stderr"),
    (("--log-timestamps",), False, "logging goes to stderr"),
    (("-lv", "--verbosity", "--log-verbosity"), True, "use -v for verbose logging"),
)


# --------------------------------------------------------------------------------------------
# Known llama-server flags whose behaviour we do not implement: spelling -> (env var, feature).
# Rejected, because accepting them would silently change what the server answers. An env var
# here is an error only when it is set to something other than a false boolean.

_UNSUPPORTED: Dict[str, Tuple[Optional[str], str]] = {}
for _names, _env, _what in (
    (("--embedding", "--embeddings"), "LLAMA_ARG_EMBEDDINGS", "embeddings"),
    (("--rerank", "--reranking"), "LLAMA_ARG_RERANKING", "reranking"),
    (("--pooling",), "LLAMA_ARG_POOLING", "embedding pooling"),
    (("--lora", "--lora-scaled", "--lora-init-without-apply"), None, "LoRA adapters"),
    (("--control-vector", "--control-vector-scaled", "--control-vector-layer-range"), None,
     "control vectors"),
    (("--context-shift",), "LLAMA_ARG_CONTEXT_SHIFT", "context shift"),
    (("--keep",), None, "context shift (--keep)"),
    (("--grp-attn-n", "-gan", "--grp-attn-w", "-gaw"), None, "self-extend (group attention)"),
    (("--rope-scaling", "--rope-scale", "--rope-freq-base", "--rope-freq-scale",
      "--yarn-orig-ctx", "--yarn-ext-factor", "--yarn-attn-factor", "--yarn-beta-slow",
      "--yarn-beta-fast"), None, "RoPE overrides"),
    (("--override-kv",), None, "GGUF metadata overrides"),
    (("-mm", "--mmproj", "-mmu", "--mmproj-url", "--mmproj-offload", "--no-mmproj-offload",
      "--image-min-tokens", "--image-max-tokens"), "LLAMA_ARG_MMPROJ", "multimodal input"),
    (("--media-path",), None, "multimodal input"),
    (("-mu", "--model-url"), "LLAMA_ARG_MODEL_URL", "downloading a model from a URL"),
    (("--slot-save-path",), None, "saving and restoring slots"),
    (("--cache-reuse",), "LLAMA_ARG_CACHE_REUSE", "KV cache reuse by shifting"),
    (("--samplers", "--sampling-seq", "--sampler-seq"), None, "custom sampler chains"),
    (("--mirostat", "--mirostat-lr", "--mirostat-ent"), None, "mirostat sampling"),
    (("--dry-multiplier", "--dry-base", "--dry-allowed-length", "--dry-penalty-last-n",
      "--dry-sequence-breaker"), None, "DRY sampling"),
    (("--xtc-probability", "--xtc-threshold"), None, "XTC sampling"),
    (("--typical", "--top-nsigma", "--dynatemp-range", "--dynatemp-exp"), None,
     "this sampler"),
    (("-l", "--logit-bias"), None, "server-wide logit bias"),
    (("--grammar", "--grammar-file", "-j", "--json-schema", "-jf", "--json-schema-file"), None,
     "grammar-constrained sampling"),
    (("--api-prefix",), "LLAMA_ARG_API_PREFIX", "an API path prefix"),
    (("--path",), "LLAMA_ARG_STATIC_PATH", "serving static files"),
    (("--ui-config", "--ui-config-file", "--ui-mcp-proxy"), None, "web UI settings"),
    (("--tools", "--tools-runtime", "--mcp-servers-config", "--mcp-servers-json"), None,
     "server-side tools"),
    (("--models-dir", "--models-max", "--models-preset"), None, "router mode"),
    (("--ssl-key-file", "--ssl-cert-file"), None, "HTTPS"),
    (("-rea", "--reasoning", "--reasoning-budget", "--chat-template-kwargs"), None,
     "reasoning controls"),
    (("--spec-default", "--spec-draft-p-split", "--draft-p-split", "--spec-synth-len",
      "--spec-synth-rates", "-cd", "--ctx-size-draft", "-ctkd", "--cache-type-k-draft",
      "-ctvd", "--cache-type-v-draft"), None, "this speculative-decoding option"),
    (("--rpc",), None, "RPC backends"),
):
    for _name in _names:
        _UNSUPPORTED[_name] = (_env, _what)
del _names, _env, _what, _name

# llama.cpp removed these in favour of --spec-draft-n-*; like llama.cpp, say so.
_REMOVED: Dict[str, str] = {
    "--draft": "--spec-draft-n-max",
    "--draft-n": "--spec-draft-n-max",
    "--draft-max": "--spec-draft-n-max",
    "--draft-min": "--spec-draft-n-min",
    "--draft-n-min": "--spec-draft-n-min",
}
_REMOVED_ENV = {"LLAMA_ARG_DRAFT_MAX": "LLAMA_ARG_SPEC_DRAFT_N_MAX",
                "LLAMA_ARG_DRAFT_MIN": "LLAMA_ARG_SPEC_DRAFT_N_MIN"}


def _index() -> Dict[str, Tuple[str, Any]]:
    """Every accepted spelling -> (kind, entry)."""
    table: Dict[str, Tuple[str, Any]] = {}
    for opt in _OPTIONS:
        for name in opt.names:
            table[name] = ("pos", opt)
        for name in opt.neg:
            table[name] = ("neg", opt)
    for entry in _IGNORED:
        for name in entry[0]:
            table[name] = ("ignored", entry)
    return table


_INDEX = _index()


# --------------------------------------------------------------------------------------------
# Parsing

def _store(values: Dict[str, Any], opt: _Opt, value: Any) -> None:
    if opt.append:
        values.setdefault(opt.dest, []).extend(value)
    else:
        values[opt.dest] = value


def _takes_value(opt: _Opt) -> bool:
    return opt.parse is not None


def parse_args(argv: Optional[Sequence[str]] = None,
               environ: Optional[Mapping[str, str]] = None) -> ServerConfig:
    """The ServerConfig for a command line (default: sys.argv[1:]) and environment (default:
    os.environ). Raises ArgError; -h/--help and --version print and raise SystemExit(0)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    values: Dict[str, Any] = {}
    warnings: List[str] = []
    seen: set = set()   # ids of options given on the command line: their env vars are not read

    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        inline: Optional[str] = None
        if arg.startswith("--"):
            # Only the option name is normalised, as llama.cpp does; a value never is.
            name, eq, rest = arg.partition("=")
            name = name.replace("_", "-")
            inline = rest if eq else None
        else:
            name = arg
        if name in ("-h", "--help", "--usage"):
            print(format_help())
            raise SystemExit(0)
        if name == "--version":
            from .. import __version__
            print(f"pyspec-server {__version__}")
            raise SystemExit(0)
        if name in _REMOVED:
            raise ArgError(f"the argument {name} has been removed. use {_REMOVED[name]} instead")
        if name in _UNSUPPORTED:
            raise ArgError(f"{name} is not supported yet by pyspec-server "
                           f"({_UNSUPPORTED[name][1]})")
        if name not in _INDEX:
            raise ArgError(f"invalid argument: {arg}")
        kind, entry = _INDEX[name]

        def take_value() -> str:
            nonlocal i
            if inline is not None:
                return inline
            if i >= len(argv):
                raise ArgError(f"expected value for argument: {name}")
            i += 1
            return argv[i - 1]

        if kind == "ignored":
            spellings, has_value, why = entry
            if has_value:
                take_value()
            elif inline is not None:
                raise ArgError(f"option {name} takes no value")
            warnings.append(f"flag {name} is accepted and ignored: {why}")
            continue
        opt: _Opt = entry
        seen.add(id(opt))
        if _takes_value(opt):
            _store(values, opt, opt.parse(name, take_value()))
        else:
            if inline is not None:
                raise ArgError(f"option {name} takes no value")
            _store(values, opt, kind == "pos")

    _apply_env(environ, values, seen)
    _check_env_unsupported(environ)
    config = ServerConfig(**values)
    config.warnings = warnings
    if not config.cont_batching:
        config.warnings.append("flag --no-cont-batching is accepted and ignored: requests are "
                               "still batched (results do not depend on it)")
    _validate(config)
    return config


def _apply_env(environ: Mapping[str, str], values: Dict[str, Any], seen: set) -> None:
    for env, hint in _REMOVED_ENV.items():
        if env in environ:
            raise ArgError(f"the environment variable {env} has been removed. use {hint} "
                           "instead")
    for opt in _OPTIONS:
        if opt.env is None or opt.env not in environ or id(opt) in seen:
            continue
        # The command line wins: an env var is skipped if its option, or another option
        # filling the same field from its own env var (api keys), was given.
        text = environ[opt.env]
        if _takes_value(opt):
            if opt.append and opt.dest in values and any(
                    id(o) in seen for o in _OPTIONS if o.dest == opt.dest):
                continue
            _store(values, opt, opt.parse(opt.env, text))
        else:
            _store(values, opt, _env_bool(opt.env, text))


def _check_env_unsupported(environ: Mapping[str, str]) -> None:
    for env, what in {e: w for e, w in _UNSUPPORTED.values() if e}.items():
        if env in environ and environ[env].strip().lower() not in _FALSE + ("",):
            raise ArgError(f"environment variable {env} asks for {what}, which is not "
                           "supported yet by pyspec-server")


def _validate(c: ServerConfig) -> None:
    """Values llama-server would reject, or that we cannot honour, with one clear line."""
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ArgError(message)

    need(0 <= c.port <= 65535, f"--port must be in [0, 65535], got {c.port}")
    need(c.parallel == -1 or c.parallel >= 1,
         f"--parallel must be at least 1 (or -1 for auto), got {c.parallel}")
    need(c.ctx_size >= 0, f"--ctx-size must be >= 0, got {c.ctx_size}")
    need(c.kv_unified_per_slot >= 0,
         f"--kv-unified-per-slot must be >= 0, got {c.kv_unified_per_slot}")
    need(c.n_predict >= -1, f"--n-predict must be -1 (no limit) or >= 0, got {c.n_predict}")
    need(c.batch_size >= 1, f"--batch-size must be at least 1, got {c.batch_size}")
    need(c.ubatch_size >= 1, f"--ubatch-size must be at least 1, got {c.ubatch_size}")
    # llama.cpp: any thread count <= 0 means "all cores"; keep one spelling of that.
    c.threads = c.threads if c.threads > 0 else -1
    c.threads_batch = c.threads_batch if c.threads_batch > 0 else -1
    need(c.timeout >= 0, f"--timeout must be >= 0, got {c.timeout}")
    need(c.seed == -1 or 0 <= c.seed < 2 ** 32, f"--seed must be -1 or in [0, 2^32), got {c.seed}")
    need(c.spec_draft_n_max is None or c.spec_draft_n_max >= 0,
         f"--spec-draft-n-max must be >= 0, got {c.spec_draft_n_max}")
    need(c.spec_draft_n_min >= 0, f"--spec-draft-n-min must be >= 0, got {c.spec_draft_n_min}")
    need(0.0 <= c.slot_prompt_similarity <= 1.0,
         f"--slot-prompt-similarity must be in [0, 1], got {c.slot_prompt_similarity}")
    need(0.0 <= c.spec_draft_p_min <= 1.0,
         f"--spec-draft-p-min must be in [0, 1], got {c.spec_draft_p_min}")
    need(c.repeat_last_n >= -1, f"--repeat-last-n must be >= -1, got {c.repeat_last_n}")
    # The core keeps one KV cache type for both K and V.
    need(c.cache_type_k == c.cache_type_v,
         f"-ctk {c.cache_type_k} with -ctv {c.cache_type_v} is not supported yet by "
         "pyspec-server: K and V must use the same cache type")
    need(not (c.chat_template and c.chat_template_file),
         "give --chat-template or --chat-template-file, not both")
    need(c.spec_ngram_size_n >= 1, f"--spec-ngram-size-n must be >= 1, got {c.spec_ngram_size_n}")
    need(c.spec_ngram_size_m >= 1, f"--spec-ngram-size-m must be >= 1, got {c.spec_ngram_size_m}")
    if c.spec_type is not None:
        # The list: its drafter type (or none); ngram-simple alone runs without a drafter unless
        # one is given (-md / -hfd: its type from the file), mixed as llama-server mixes them.
        kinds = c.spec_type.split(",")
        c.spec_ngram = "ngram-simple" in kinds
        drafter = [k for k in kinds if k in _SPEC_DRAFT_TYPES]
        if drafter:
            c.spec_type = drafter[0]
        elif c.spec_ngram and (c.model_draft is not None or c.hf_repo_draft is not None):
            c.spec_type = None
        else:
            c.spec_type = "none"
    need(not (c.spec_type in ("draft-dflash", "draft-dspark")
              and c.model_draft is None and c.hf_repo_draft is None and (c.model or c.hf_repo)),
         f"--spec-type {c.spec_type} needs a draft model (-md or -hfd)")
    need(not (c.hf_file and not c.hf_repo), "--hf-file needs --hf-repo")
    need(not c.host.endswith(".sock"),
         "--host with a unix socket is not supported yet by pyspec-server")
    from ..sampling import SamplingParams   # the one place sampling values are checked
    try:
        SamplingParams(c.temp, c.top_k, c.top_p, c.min_p, None)
    except ValueError as exc:
        raise ArgError(str(exc)) from None


# --------------------------------------------------------------------------------------------
# Help

def format_help() -> str:
    lines = ["usage: pyspec-server [options]", "",
             "A drop-in for llama.cpp's llama-server (same flags, endpoints and JSON).", "",
             "options:"]
    rows = [("-h, --help", "print this help and exit"), ("--version", "print the version and exit")]
    for opt in _OPTIONS:
        spelling = ", ".join(opt.names + opt.neg)
        if _takes_value(opt):
            spelling += f" {opt.metavar}"
        text = opt.help + (f" [env: {opt.env}]" if opt.env else "")
        rows.append((spelling, text))
    width = min(max(len(s) for s, _ in rows) + 2, 44)
    for spelling, text in rows:
        if len(spelling) + 2 > width:
            lines.append(f"  {spelling}")
            lines.append(" " * (width + 2) + text)
        else:
            lines.append(f"  {spelling.ljust(width)}{text}")
    lines += ["", "accepted and ignored (no effect on results): " +
              " ".join(n for names, _, _ in _IGNORED for n in names)]
    return "\n".join(lines)
