"""SAMPLE (csrc/core/graph.h): each row's token drawn in the graph from its top-k candidates, as a
plain sampled step of the engine draws it. Checked against an independent numpy reference of the
law (llama.cpp's chain: top-k -> min-p's count -> top-p's prefix -> temperature, softmax in
float64, each probability rounded to float32) and of the draw (the exponential race w / -log(u)
with u the Philox uniform of the token's id at slot 0 of the bonus stream, ties to the smaller
id), and against the engine's own verification of a round without drafts. The CUDA twin is in
tests/test_cuda_ops.py."""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest

import test_cpu_ops as cpu
from pyspec import _core as core

WORDS = 10  # kSamplerWords
BANS = 8    # kSampleBans


def sampler_words(temperature, top_p, min_p, top_k, seed, offset):
    """SamplerWords of one row: the doubles as their IEEE words (low word first), then top_k, the
    seed's two words and the offset."""
    w = []
    for d in (temperature, top_p, min_p):
        lo, hi = struct.unpack("<II", struct.pack("<d", d))
        w += [lo, hi]
    w += [top_k & 0xFFFFFFFF, seed & 0xFFFFFFFF, seed >> 32, offset]
    return np.array(w, dtype=np.uint32).view(np.int32)


def reference_law(z, temperature, top_k, top_p, min_p):
    """The kept candidates' indices and float32 probabilities; z sorted (value desc, id asc)."""
    z = [float(v) for v in z]
    m = len(z)
    zmax = z[0]
    n_k = min(top_k, m)
    limit = n_k
    if min_p > 0.0:
        floor = zmax + math.log(min_p)
        limit = min(limit, max(sum(v >= floor for v in z), 1))
    kept = limit
    if top_p < 1.0:
        total = 0.0
        for v in z[:n_k]:
            total += math.exp(v - zmax)
        cum = 0.0
        for i in range(limit):
            cum += math.exp(z[i] - zmax) / total
            if cum >= top_p:
                kept = i + 1
                break
    x = [v / temperature for v in z[:kept]]
    mx = max(x)
    e = [math.exp(v - mx) for v in x]
    s = 0.0
    for v in e:
        s += v
    return list(range(kept)), [np.float32(v / s) for v in e]


def reference_draw(ids, z, temperature, top_k, top_p, min_p, seed, offset, bans=()):
    """The engine's draw: the candidates less the banned ids (and TOP_K's -1 padding), then the law
    over them and the race (T <= 0: the first candidate left)."""
    kept = [i for i, t in enumerate(ids) if t >= 0 and t not in bans]
    ids, z = [int(ids[i]) for i in kept], [z[i] for i in kept]
    if temperature <= 0.0:
        return ids[0]
    keep, probs = reference_law(z, temperature, top_k, top_p, min_p)
    u = core.spec.uniforms(seed, offset, 0, int(max(ids)) + 1, 0)  # slot 0, the bonus stream
    best, best_val = -1, 0.0
    for i, p in zip(keep, probs):
        w = float(p)
        if not w > 0.0:
            continue
        t = int(ids[i])
        val = w / -math.log(float(u[t]))
        if best < 0 or val > best_val or (val == best_val and t < best):
            best, best_val = t, val
    return best


def sample_rows(rng, rows, n_vocab, k):
    """Rows of candidates as TOP_K + GATHER give them: logits, then their best k in (value desc,
    id asc) order. Quarter-rounded logits make ties."""
    x = (np.round(rng.standard_normal((rows, n_vocab)) * 8) / 4).astype(np.float32)
    ids = cpu.top_k_ref(x, k).astype(np.int32)
    return ids, np.take_along_axis(x, ids.astype(np.int64), axis=1)


def ban_rows(bans, rows):
    """[rows, BANS] int32, -1 padded, from a list of id lists (None: no bans)."""
    out = np.full((rows, BANS), -1, np.int32)
    for r, b in enumerate(bans or []):
        out[r, :len(b)] = b
    return out


def run_sample(ids, vals, words, bans=None, backend="cpu"):
    rows, k = ids.shape
    g = core.Graph()
    ti = g.input("I32", [k, rows], "ids")
    tv = g.input("F32", [k, rows], "vals")
    tw = g.input("I32", [WORDS, rows], "samplers")
    tb = g.input("I32", [BANS, rows], "bans")
    out = cpu.node(g, "SAMPLE", "I32", [1, rows], [ti, tv, tw, tb])
    feeds = {ti: ids, tv: vals, tw: np.ascontiguousarray(words), tb: ban_rows(bans, rows)}
    (got,) = cpu.run(g, feeds, [out], backend=backend)
    return got.reshape(rows)


# (temperature, top_k, top_p, min_p): llama-server's default chain, each filter alone, none.
CHAINS = [(0.8, 40, 0.95, 0.05), (1.0, 40, 1.0, 0.0), (0.7, 10, 0.9, 0.0), (1.3, 64, 1.0, 0.1),
          (0.5, 1, 1.0, 0.0), (2.0, 64, 0.5, 0.02), (0.0, 40, 0.95, 0.05)]


def random_case(seed, rows=64, n_vocab=700, k=72):
    """Rows of candidates, each chain in turn, every third row banning 1-3 ids (its best one
    among them, as ignore_eos bans an end id the target favours, and ids outside its candidates).
    72 candidates: top_k (64 at most) plus the bans, rounded up to 8, as the engine asks."""
    rng = np.random.default_rng(seed)
    ids, vals = sample_rows(rng, rows, n_vocab, k)
    words, params, bans = [], [], []
    for r in range(rows):
        t, top_k, top_p, min_p = CHAINS[r % len(CHAINS)]
        s = int(rng.integers(0, 2**64, dtype=np.uint64))
        off = int(rng.integers(0, 5000))
        words.append(sampler_words(t, top_p, min_p, top_k, s, off))
        b = [int(ids[r, 0]), n_vocab + 5, int(ids[r, 3])][:1 + (r // 3) % 3] if r % 3 == 0 else []
        bans.append(b)
        params.append((t, top_k, top_p, min_p, s, off, tuple(b)))
    return ids, vals, np.stack(words), params, bans


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sample_draws_the_reference_token(seed):
    ids, vals, words, params, bans = random_case(seed)
    got = run_sample(ids, vals, words, bans)
    want = [reference_draw(ids[r], vals[r], *p) for r, p in enumerate(params)]
    assert got.tolist() == want
    # Not a constant: sampled rows draw other tokens than their first candidate.
    sampled = [r for r, p in enumerate(params) if p[0] > 0 and p[1] > 1]
    assert sum(got[r] != ids[r, 0] for r in sampled) >= len(sampled) // 4
    # A banned id is never drawn; a greedy row with its best id banned takes the next.
    for r, b in enumerate(bans):
        assert got[r] not in b
        if params[r][0] <= 0.0 and b:
            assert got[r] == ids[r, 1]


def test_sample_is_the_engines_draw_of_a_round_without_drafts():
    """Verification of a round without drafts over the same candidates' law draws the same token."""
    ids, vals, words, params, bans = random_case(4, rows=40)
    got = run_sample(ids, vals, words, bans)
    for r, (t, k, p, mp, s, off, b) in enumerate(params):
        keep = np.array([t_ not in b for t_ in ids[r]])
        cand, cvals = ids[r][keep], vals[r][keep]
        if t <= 0.0:
            assert got[r] == cand[0]
            continue
        law_ids, law_probs = core.spec.candidate_law(cand, cvals, t, k, p, mp)
        _, tokens, _ = core.spec.verify_candidates("rejection", [(list(law_ids), list(law_probs))], 700,
                                                   np.zeros((0, 700), np.float32), np.zeros(0, np.int32), s, off)
        assert got[r] == tokens[-1]


def test_sample_gives_minus_one_for_undefined_draws():
    """top_k past the candidates, NaN logits or ids past a row's end (TOP_K's -1 padding count as
    absent) or banned: no prediction rather than a wrong one."""
    ids, vals, _, _, _ = random_case(5, rows=4, k=8)
    words = np.stack([sampler_words(0.8, 1.0, 0.0, 9, 1, 0),    # top_k 9 > 8 candidates
                      sampler_words(0.8, 1.0, 0.0, 4, 1, 0),    # NaN below
                      sampler_words(0.8, 1.0, 0.0, 6, 1, 0),    # 6 valid ids, top_k 6: defined
                      sampler_words(0.8, 1.5, 0.0, 4, 1, 0)])   # top_p outside [0, 1]
    vals = vals.copy()
    ids = ids.copy()
    vals[1, 3] = np.nan
    ids[2, 6:] = -1
    got = run_sample(ids, vals, words)
    assert got[0] == -1 and got[1] == -1 and got[3] == -1
    assert got[2] == reference_draw(ids[2, :6], vals[2, :6], 0.8, 6, 1.0, 0.0, 1, 0)
    # Banning 3 of 8 candidates leaves 5: top_k 6 is then undefined, top_k 5 is not.
    words = np.stack([sampler_words(0.8, 1.0, 0.0, 6, 1, 0), sampler_words(0.8, 1.0, 0.0, 5, 1, 0)])
    bans = [ids[0, :3].tolist(), ids[1, 2:5].tolist()]
    got = run_sample(ids[:2], vals[:2], words, bans)
    assert got[0] == -1
    assert got[1] == reference_draw(ids[1], vals[1], 0.8, 5, 1.0, 0.0, 1, 0, tuple(bans[1]))
