"""Host-side token sampling with llama.cpp's parameters, defaults and chain order.

llama.cpp's default chain (common/sampling.cpp) runs, for the knobs we expose:

    top-k -> top-p -> min-p -> temperature -> draw

over the candidates sorted by logit, each stage seeing what the previous one kept:

- top-k keeps the k highest logits; k <= 0 turns it off.
- top-p renormalises the current candidates (softmax of their logits at temperature 1) and keeps
  the shortest prefix whose cumulative probability reaches p; p >= 1 turns it off.
- min-p keeps the candidates whose probability is at least min_p times the best one's, i.e.
  logit >= max_logit + log(min_p); min_p <= 0 turns it off.
- temperature divides the kept logits by T; T <= 0 means greedy (the argmax of the raw logits,
  which every filter keeps).
- the draw samples from the softmax of what is left.

A stage that is off does not run at all, so temperature-only sampling draws from exactly
softmax(logits / T) over the whole vocabulary (design invariant 5). Ties between equal logits are
ordered by token id, so the kept sets never depend on the sort's whims.

The candidate law is computed in C++ (csrc/spec/target_law.h processed_candidates), the one function
the multi-request SpecEngine also builds its verification rows from, so the rule exists once.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from . import _core


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's sampling knobs with its defaults. `seed` None (or -1) draws a random seed."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: Optional[int] = None

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, (int, np.integer))
                                      or self.seed < -1):
            raise ValueError(f"seed must be a non-negative integer, -1 or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Sampler:
    """Draws token ids from logits with a seeded numpy generator (one per generation)."""

    def __init__(self, params: SamplingParams = SamplingParams()):
        self.params = params
        seed = params.seed
        # A random seed is still chosen explicitly so that it can be reported and replayed.
        self.seed = secrets.randbits(32) if seed is None or seed == -1 else int(seed)
        self.rng = np.random.default_rng(self.seed)
        p = params
        if p.greedy:
            self.stages: Tuple[str, ...] = ("greedy",)
        else:
            stages = []
            if p.top_k > 0:
                stages.append("top-k")
            if p.top_p < 1.0:
                stages.append("top-p")
            if p.min_p > 0.0:
                stages.append("min-p")
            self.stages = tuple(stages) + ("temperature", "dist")

    def candidates(self, logits: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """The ids the draw chooses from and their probabilities (sum 1).

        Filtered candidates come sorted by logit (highest first, ties by id); with no filter the
        whole vocabulary is returned in id order. The rule is written once, in C++
        (csrc/spec/target_law.h processed_candidates), which the multi-request SpecEngine verifies
        against too; logits are widened to float64 first.
        """
        z = np.asarray(logits, dtype=np.float64).reshape(-1)
        if z.shape[0] == 0:
            raise ValueError("cannot sample from empty logits")
        p = self.params
        ids, probs = _core.spec.processed_candidates(z, float(p.temperature), int(p.top_k),
                                                     float(p.top_p), float(p.min_p))
        return ids.astype(np.int64), probs

    def sample(self, logits: np.ndarray) -> int:
        z = np.asarray(logits, dtype=np.float64).reshape(-1)
        if self.params.greedy:
            if z.shape[0] == 0:
                raise ValueError("cannot sample from empty logits")
            return int(np.argmax(z))
        return self._draw(*self.candidates(z))

    def sample_best(self, ids: np.ndarray, logits: np.ndarray) -> int:
        """sample() of a row given only its best len(ids) ids (logit descending, ties by the
        smaller id: Context.decode(candidates=k)) and their logits, for a chain with 1 <= top_k <=
        len(ids): top-k keeps only such ids, and top-p and min-p look only at what it kept, so the
        law, and the draw, are the whole row's."""
        p = self.params
        if not 1 <= p.top_k <= len(ids) or p.greedy:
            raise ValueError(f"sampling from {len(ids)} best ids needs temperature > 0 and top_k in [1, {len(ids)}]")
        local, probs = _core.spec.processed_candidates(np.asarray(logits, dtype=np.float64).reshape(-1),
                                                       float(p.temperature), int(p.top_k), float(p.top_p),
                                                       float(p.min_p))
        return self._draw(np.asarray(ids, dtype=np.int64)[local], probs)

    def _draw(self, ids: np.ndarray, probs: np.ndarray) -> int:
        cdf = np.cumsum(probs)
        i = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
        return int(ids[min(i, ids.shape[0] - 1)])
