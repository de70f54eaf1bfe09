"""Speculative generation for one sequence with a block drafter (DFlash or DSpark).

The loop (docs/reference/dflash-dspark.md §4, verification.md §0-§1):

    decode the whole prompt into the target as prompt rows, collecting the layer inputs the
    drafter reads; its last row's logits give the first token, drawn as a round without drafts
    draws it (the same keys); inject the prompt's feature rows into the drafter;
    id_last = the first token at pos0 = len(prompt)
    each round:
        draft d_1..d_γ from the block [id_last, MASK, ...] at pos0        (one drafter pass)
        decode [id_last, d_1..d_γ] at pos0..pos0+γ in the target           (one target pass)
        verify: keep τ drafts and emit τ + 1 tokens                         (greedy / rejection / block)
        roll back the target rows after pos0 + τ; inject the committed rows' features
        id_last = the last emitted token; pos0 += τ + 1

One pass over the weights turns the prompt into its first token, as in plain decoding (the
engine, csrc/spec/spec_engine.h, does the same); on a GPU every prompt row, the last included,
runs on the prompt rows' path (Context.decode(prompt=True)).

Randomness (T > 0) is keyed, never stateful: drafts are drawn by Gumbel-max from
(seed, offset = pos0, position = the drafted token's position, stream = draft), and the verifier
keys its acceptance, correction and bonus draws by (seed, offset = pos0, slot) on streams of its
own (csrc/spec/verify.h). pos0 grows every round, so no round reuses noise.

Proposals (the contract of verification.md §1.3: q_k is exactly the law d_k was drawn from):
- T = 0: drafts are the drafter's greedy chain and verification is the argmax match.
- T > 0, DFlash: d_k ~ softmax(logits_k / T) of its slot, drawn independently per slot (a slot's
  logits do not depend on earlier drafts); q_k is that softmax.
- T > 0, DSpark: ancestral drafting (design.md invariant 5, verification.md §6), inside the
  drafter graph: d_k = argmax((base_k + bias(d_{k-1})) / T + g_k), and the drawn d_k is the next
  slot's Markov predecessor; q_k = softmax((base_k + bias(d_{k-1})) / T) of the exact float vector
  the noise perturbed. Both draws come from DraftContext.draft_logits(temperature=, seed=,
  offset=), keyed as above.

Confidence pruning (reference/dflash-dspark.md §2.3, §4.3), decided from drafter-side information
only, so verification stays lossless for the shorter draft: with p_min > 0 the draft stops at the
first position whose confidence is below p_min (mode "first", llama.cpp's rule) or whose running
product of confidences is (mode "cumulative"). DSpark uses its confidence head (a drafter without
one is refused); DFlash uses the top-1 probability of its slot's sampling chain (softmax over the
chain's candidates), as llama.cpp does. n_min: a draft shorter than n_min is dropped whole.

p rows are what the request would sample from without a drafter: softmax(logits / T) over the
whole vocabulary for temperature-only sampling, else the top-k/top-p/min-p filtered law of
`pyspec.sampling.Sampler` (zeros outside the kept candidates).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence

import numpy as np

from . import _core
from .model import Context, Model, resolve_gpu_layers
from .sampling import Sampler, SamplingParams

_spec = _core.spec

SPEC_TYPES = ("draft-dflash", "draft-dspark")
VERIFY_METHODS = ("greedy", "rejection", "block")
P_MIN_MODES = ("first", "cumulative")


def check_pruning_options(p_min, n_min, mode):
    """Validated confidence-pruning options (p_min in [0, 1], n_min >= 0, a known mode)."""
    p_min, n_min = float(p_min), int(n_min)
    if not 0.0 <= p_min <= 1.0:
        raise ValueError(f"draft_p_min must be in [0, 1], got {p_min}")
    if n_min < 0:
        raise ValueError(f"draft_n_min must be >= 0, got {n_min}")
    if mode not in P_MIN_MODES:
        raise ValueError(f"unknown draft_p_min_mode {mode!r} (one of {', '.join(P_MIN_MODES)})")
    return p_min, n_min


def prune_length(confidence: Sequence[float], p_min: float, mode: str = "first",
                 n_min: int = 0) -> int:
    """How many drafts to keep of len(confidence): stop at the first position k whose confidence
    (mode "first") or product of confidences 0..k (mode "cumulative") is below p_min; a result
    below n_min becomes 0. p_min <= 0 keeps everything (then only n_min applies). Comparisons are in
    double (float32 confidences are widened exactly)."""
    if mode not in P_MIN_MODES:
        raise ValueError(f"unknown p_min mode {mode!r} (one of {', '.join(P_MIN_MODES)})")
    # The rule lives once, in C++ (csrc/spec/prune.h), shared with the multi-request SpecEngine.
    return int(_spec.prune_length(np.asarray(confidence, np.float64).ravel().tolist(), float(p_min),
                                  mode, int(n_min)))


@dataclass
class SpecStats:
    """Drafting and acceptance counts of one generation."""

    n_rounds: int = 0            # target passes that emitted tokens (the prompt's, then verify
                                 # passes): each emits accepted + 1
    draft_n: int = 0             # tokens drafted
    draft_n_accepted: int = 0    # drafted tokens kept
    drafted_at: List[int] = field(default_factory=list)   # rounds that drafted position i
    accepted_at: List[int] = field(default_factory=list)  # rounds that accepted position i
    prompt_seconds: float = 0.0  # the prompt's pass (which also gives the first token)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    zero_q: int = 0              # verifier events that consistent inputs never produce
    empty_residual: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.draft_n_accepted / self.draft_n if self.draft_n else 0.0

    @property
    def acceptance_per_position(self) -> List[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify pass: 1 + accepted drafts per round (llama.cpp's mean len)."""
        return 1.0 + self.draft_n_accepted / self.n_rounds if self.n_rounds else 0.0

    def add_round(self, n_draft: int, n_accepted: int) -> None:
        self.n_rounds += 1
        self.draft_n += n_draft
        self.draft_n_accepted += n_accepted
        while len(self.drafted_at) < n_draft:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(n_draft):
            self.drafted_at[i] += 1
            self.accepted_at[i] += int(i < n_accepted)


def detect_spec_type(draft: "_core.DraftModel") -> str:
    return "draft-dspark" if draft.is_dspark else "draft-dflash"


def drafter_backend(n_gpu_layers, draft: "_core.DraftModel", target_backend: str) -> str:
    """The drafter's backend for llama.cpp's -ngld value: None follows the target's backend
    (`target_backend`, "cpu" or "cuda"); otherwise as pyspec.model.resolve_gpu_layers over the
    drafter's layers."""
    if n_gpu_layers is None:
        return target_backend
    return resolve_gpu_layers(n_gpu_layers, int(draft.n_layer), what="n_gpu_layers_draft")


def engine_backend(target_backend: str, draft_backend: Optional[str]) -> str:
    """The one backend a multi-request SpecEngine runs its target and drafter contexts on: the
    two must agree (a split, e.g. the drafter on the CPU under a GPU target, is not supported by
    the engine yet: ValueError)."""
    if draft_backend is not None and draft_backend != target_backend:
        raise ValueError(f"the target runs on {target_backend} but the drafter on {draft_backend}: "
                         "the multi-request engine needs both on one backend (set -ngl and -ngld "
                         "alike)")
    return target_backend


class Drafter:
    """A block drafter loaded against a target, with its one-sequence draft context.

    n_gpu_layers (llama.cpp's -ngld): None follows the target's backend; otherwise as
    Model(n_gpu_layers=...) over the drafter's layers. `backend` is the result.
    """

    def __init__(self, path: str, target: Model, spec_type: Optional[str] = None,
                 n_batch: int = 2048, kv_dtype: str = "f16", n_gpu_layers=None):
        try:
            self.model = _core.DraftModel(str(path), target._model)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"cannot use draft model '{path}' with target '{target.path}': "
                             f"{exc}") from None
        kind = detect_spec_type(self.model)
        if spec_type is not None:
            if spec_type not in SPEC_TYPES:
                raise ValueError(f"unknown spec_type {spec_type!r} (one of {', '.join(SPEC_TYPES)})")
            if spec_type != kind:
                raise ValueError(f"spec_type {spec_type!r} does not match the draft model "
                                 f"'{path}', which is a {kind} drafter")
        self.spec_type = kind
        self.path = str(path)
        window = min(int(self.model.n_ctx_train), int(n_batch))
        self.backend = drafter_backend(n_gpu_layers, self.model, getattr(target, "backend", "cpu"))
        self.context = _core.DraftContext(self.model, 1, window, target.n_threads, kv_dtype,
                                          backend=self.backend)

    @property
    def n_draft_max(self) -> int:
        return int(self.model.n_draft_max)


class SpeculativeGenerator:
    """Speculative generation on sequence 0 of `ctx` with `drafter`.

    draft_n_max: drafts per round (clamped to the drafter's block, reference §4.4).
    verify: "greedy" (T = 0 only), "rejection", "block", or None (greedy at T = 0, rejection
    at T > 0). At T = 0 every rule reduces to the argmax match (verification.md §1.2).
    """

    def __init__(self, ctx: Context, drafter: Drafter, draft_n_max: Optional[int] = None,
                 verify: Optional[str] = None, draft_p_min: float = 0.0, draft_n_min: int = 0,
                 draft_p_min_mode: str = "first"):
        if ctx.n_seq_max != 1:
            raise ValueError("speculative generation runs one sequence: use a context with "
                             "n_seq_max = 1")
        if verify is not None and verify not in VERIFY_METHODS:
            raise ValueError(f"unknown verify method {verify!r} (one of "
                             f"{', '.join(VERIFY_METHODS)})")
        n_max = drafter.n_draft_max if draft_n_max is None else int(draft_n_max)
        if n_max < 0:
            raise ValueError(f"draft_n_max must be >= 0, got {n_max}")
        draft_p_min, draft_n_min = check_pruning_options(draft_p_min, draft_n_min, draft_p_min_mode)
        if draft_p_min > 0.0 and drafter.model.is_dspark and not drafter.model.has_confidence_head:
            raise ValueError("DSpark draft has no confidence head: please set draft_p_min 0 "
                             "(--spec-draft-p-min 0)")
        self.draft_p_min = draft_p_min
        self.draft_n_min = draft_n_min
        self.draft_p_min_mode = draft_p_min_mode
        self.ctx = ctx
        self.drafter = drafter
        self.draft_n_max = min(n_max, drafter.n_draft_max, ctx.n_batch - 1)
        self.verify = verify
        self.layers = [int(x) for x in drafter.model.target_layers]
        self.offset = int(drafter.model.draft_offset)
        # The whole trained block, or for a drafter trained on cut blocks just the rows a round
        # drafts (DraftHparams::block_rows), as the engine decodes it.
        self.block_size = int(drafter.model.block_rows(self.draft_n_max + self.offset))

    def method(self, params: SamplingParams) -> str:
        if params.greedy:
            return "greedy"
        if self.verify == "greedy":
            raise ValueError("verify='greedy' needs temperature 0 (greedy matching keeps the "
                             "target's law only for the argmax): use 'rejection' or 'block'")
        return self.verify or "rejection"

    def tokens(self, prompt: Sequence[int], params: SamplingParams,
               max_tokens: Optional[int] = None, stats: Optional[SpecStats] = None,
               is_eog: Callable[[int], bool] = lambda t: False,
               seed: Optional[int] = None) -> Iterator[int]:
        """Yields generated tokens until `max_tokens`, an end-of-generation token (not yielded)
        or a full context. Starts from empty caches. `seed` overrides the params' seed."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty (no tokens)")
        n_ctx = self.ctx.n_ctx_seq
        if len(prompt) > n_ctx:
            raise ValueError(f"the prompt has {len(prompt)} tokens but the context holds {n_ctx}")
        stats = stats if stats is not None else SpecStats()
        method = self.method(params)
        sampler = Sampler(params if seed is None else
                          SamplingParams(params.temperature, params.top_k, params.top_p,
                                         params.min_p, seed))
        temperature = float(params.temperature)
        ctx, dctx = self.ctx, self.drafter.context
        ctx.kv_clear()
        dctx.clear(0)

        if max_tokens is not None and max_tokens <= 0:
            return
        # One pass over the prompt, every row a prompt row, the last with logits: it gives the
        # first token, drawn as a round without drafts would draw it (the engine does the same).
        t = time.perf_counter()
        first = self._commit(prompt, 0, len(prompt), logits=True)
        stats.prompt_seconds += time.perf_counter() - t
        no_drafts = np.zeros(0, np.int32)
        _, out, _ = self._verify(method, sampler, first, no_drafts, np.zeros((0, 0), np.float32),
                                 len(prompt) - 1)
        stats.add_round(0, 0)
        id_last, pos0, n_out = int(out[0]), len(prompt), 0
        if is_eog(id_last):
            return
        n_out += 1
        yield id_last
        while max_tokens is None or n_out < max_tokens:
            if pos0 >= n_ctx:
                return
            # Room: the verify rows pos0..pos0+γ must fit the context, and drafts past the
            # tokens still wanted would be thrown away.
            n_draft = min(self.draft_n_max, n_ctx - 1 - pos0)
            if max_tokens is not None:
                n_draft = min(n_draft, max_tokens - n_out - 1)

            t = time.perf_counter()
            drafts, q_rows = self._draft(id_last, pos0, n_draft, temperature, sampler.seed)
            stats.draft_seconds += time.perf_counter() - t

            t = time.perf_counter()
            batch = [id_last] + drafts.tolist()
            res = ctx.decode(batch, positions=np.arange(pos0, pos0 + len(batch)),
                             output=np.ones(len(batch), np.bool_), layer_inputs=self.layers)
            n_acc, out, events = self._verify(method, sampler, res.logits, drafts, q_rows, pos0)
            stats.zero_q += int(events["zero_q"])
            stats.empty_residual += int(events["empty_residual"])
            # Keep id_last and the accepted drafts in both caches; the rest never happened.
            ctx.kv_remove(0, pos0 + n_acc + 1, -1)
            feats = np.concatenate([res.layer_inputs[lid][:n_acc + 1] for lid in self.layers],
                                   axis=1)
            dctx.inject(0, np.arange(pos0, pos0 + n_acc + 1, dtype=np.int32), feats)
            stats.verify_seconds += time.perf_counter() - t
            stats.add_round(len(drafts), int(n_acc))

            for tok in out.tolist():
                if is_eog(tok):
                    return
                n_out += 1
                yield tok
            id_last, pos0 = int(out[-1]), pos0 + n_acc + 1

    def _commit(self, tokens: List[int], pos: int, n: int, logits: bool = False):
        """Decodes prompt tokens into the target as prompt rows, as the engine prefills them (a
        GPU computes those on tensor cores), and injects their features; with logits, returns
        the last row's ([1, n_vocab])."""
        output = np.zeros(n, np.bool_)
        output[-1] = logits
        res = self.ctx.decode(tokens, positions=np.arange(pos, pos + n), output=output,
                              layer_inputs=self.layers, prompt=True)
        feats = np.concatenate([res.layer_inputs[lid] for lid in self.layers], axis=1)
        self.drafter.context.inject(0, np.arange(pos, pos + n, dtype=np.int32), feats)
        return res.logits

    def _verify(self, method: str, sampler: Sampler, logits: np.ndarray, drafts: np.ndarray,
                q_rows, pos0: int):
        """(accepted, emitted tokens, events) of the target rows [id_last, drafts...]."""
        if method == "greedy":
            return _spec.verify_greedy(logits, drafts)
        p_rows = self._target_rows(sampler, logits)
        verify = _spec.verify_rejection if method == "rejection" else _spec.verify_block
        return verify(p_rows, q_rows, drafts, sampler.seed, pos0)

    def _draft(self, id_last: int, pos0: int, n_draft: int, temperature: float, seed: int):
        """(drafts [γ] int32, q rows [γ, V] float32 or None at T = 0)."""
        if n_draft == 0:
            return np.zeros(0, np.int32), np.zeros((0, 0), np.float32)
        # The drafter's whole trained block is decoded and its first draft_n_max draft slots
        # come out, as in the engine: the block's rows attend to each other, so a shorter block
        # is one it never saw in training, and a fixed one keeps a slot's logits independent of
        # this round's room.
        out = self.drafter.context.draft_logits(0, id_last, pos0, self.block_size,
                                                temperature=max(temperature, 0.0), seed=seed,
                                                offset=pos0, n_out=self.draft_n_max + self.offset)
        n_draft = self._pruned(out, n_draft)
        slots = slice(self.offset, self.offset + n_draft)
        drafts = np.ascontiguousarray(out["tokens"][slots], np.int32)
        if temperature <= 0.0:
            return drafts, None
        return drafts, np.ascontiguousarray(out["q"][slots], np.float32)

    def _pruned(self, out, n_draft: int) -> int:
        """The draft length after confidence pruning and n_min (module docstring)."""
        if self.draft_p_min <= 0.0:
            return 0 if n_draft < self.draft_n_min else n_draft
        slots = slice(self.offset, self.offset + n_draft)
        if self.drafter.model.is_dspark:
            conf = out["confidence"][slots]
        else:
            conf = out["probs"][slots, 0]
        return prune_length(conf, self.draft_p_min, self.draft_p_min_mode, self.draft_n_min)

    @staticmethod
    def _target_rows(sampler: Sampler, logits: np.ndarray) -> np.ndarray:
        """The law the non-speculative sampler draws each row from, as full-vocabulary rows."""
        rows = np.zeros(logits.shape, np.float32)
        for i in range(logits.shape[0]):
            ids, probs = sampler.candidates(logits[i])
            rows[i, ids] = probs
        return rows
