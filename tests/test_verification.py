"""Philox noise, Gumbel-max drafting and lossless verification (design invariants 5 and 6), after
docs/reference/verification.md §3:

- Philox4x32 known-answer tests and the counter layout; uniforms strictly inside (0, 1).
- Gumbel-max draws follow softmax(logits / T); the stored proposal is that law.
- The §2.5 worked example in exact fractions, held against the C++ thresholds and draws.
- The full multi-round speculative loop, drafting with the C++ Gumbel-max and verifying with the
  C++ verifiers, emits first tokens, two- and three-token prefixes with the target's law
  (chi-square, N = 2e5, alpha = 1e-4, fixed seeds, so pass/fail is deterministic).
- Negative controls: broken verifiers and misuses fail the very same tests.
"""

import itertools
import math
from collections import defaultdict
from fractions import Fraction

import numpy as np
import pytest
from scipy.stats import chi2

from pyspec._core import spec

ALPHA = 1e-4
N = 200_000
U24 = 2.0 ** -24


def chi2_pvalue(counts, probs):
    """p-value that `counts` (any shape) were drawn from `probs` (same shape). A count in a cell of
    probability 0 is an outright failure; the other cells must expect >= 5 draws."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    counts, probs = counts[probs > 0], probs[probs > 0]
    expected = probs * counts.sum()
    assert expected.min() >= 5, "too few draws for a chi-square test"
    stat = float(((counts - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, len(counts) - 1))


def prefix_counts(tokens, length, n_vocab):
    """Counts of the emitted `length`-token prefixes as an array of shape (V,) * length."""
    flat = np.zeros(len(tokens), dtype=np.int64)
    for k in range(length):
        flat = flat * n_vocab + tokens[:, k]
    return np.bincount(flat, minlength=n_vocab ** length).reshape((n_vocab,) * length)


def markov_prefix_law(P, ctx, length):
    """Target law of the first `length` tokens of a first-order Markov chain with rows P[prev]
    (float rows are renormalised in float64; Fraction rows stay exact)."""
    P = np.asarray(P)
    if P.dtype != object:
        P = P.astype(np.float64) / P.astype(np.float64).sum(axis=1, keepdims=True)
    n_vocab = P.shape[1]
    law = P[ctx]
    for _ in range(length - 1):
        law = law[..., None] * P[:n_vocab].reshape((1,) * (law.ndim - 1) + (n_vocab, n_vocab))
    return law


def softmax(z):
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


# --------------------------------------------------------------------------------------------
# Philox4x32-10 (§4)
# --------------------------------------------------------------------------------------------

PI_COUNTER = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)
PI_KEY = (0xA4093822, 0x299F31D0)
KAT = [
    (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (10, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (10, PI_COUNTER, PI_KEY, (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    (7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    (7, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    (7, PI_COUNTER, PI_KEY, (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
]


@pytest.mark.parametrize("rounds,counter,key,expected", KAT)
def test_philox_known_answers(rounds, counter, key, expected):
    assert spec.philox4x32(counter, key, rounds) == expected
    if rounds == 10:
        assert spec.philox4x32(counter, key) == expected


def philox_reference(counter, key, rounds=10):
    """Philox4x32 written from the paper's round function, for the noise layout test."""
    c, k = list(counter), list(key)
    m32 = 0xFFFFFFFF
    for r in range(rounds):
        if r:
            k = [(k[0] + 0x9E3779B9) & m32, (k[1] + 0xBB67AE85) & m32]
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & m32, (p0 >> 32) ^ c[3] ^ k[1], p0 & m32]
    return c


def test_noise_layout_is_the_documented_counter_and_key():
    # key = (seed lo, seed hi); counter = (element / 4, position, offset, stream); word element % 4;
    # uniform = ((x >> 8) | 1) * 2^-24.
    seed, offset, position = 0x0123456789ABCDEF, 4711, 33
    for stream in range(4):
        u = spec.uniforms(seed, offset, position, 10, stream)
        for e in range(10):
            word = philox_reference((e // 4, position, offset, stream), (seed & 0xFFFFFFFF, seed >> 32))[e % 4]
            assert u[e] == np.float32(((word >> 8) | 1) * U24)


def test_uniforms_strictly_inside_unit_interval_and_uniform():
    u = spec.uniforms(7, 3, 0, 1_000_000)
    assert u.dtype == np.float32
    assert u.min() >= U24 and u.max() <= 1 - U24
    # odd multiples of 2^-24: never 0, 1/2 or 1
    assert np.all(np.mod(u.astype(np.float64) / U24, 2) == 1)
    assert chi2_pvalue(np.bincount((u * 1000).astype(np.int64), minlength=1000), np.ones(1000)) > ALPHA
    # the first draw of many keys is uniform too, and draws under neighbouring offsets are independent
    first = np.array([spec.uniforms(s, 0, 0, 1)[0] for s in range(50_000)])
    assert chi2_pvalue(np.bincount((first * 100).astype(np.int64), minlength=100), np.ones(100)) > ALPHA
    a, b = spec.uniforms(11, 100, 2, 100_000), spec.uniforms(11, 101, 2, 100_000)
    joint = np.bincount((a * 10).astype(np.int64) * 10 + (b * 10).astype(np.int64), minlength=100)
    assert chi2_pvalue(joint, np.ones(100)) > ALPHA


def test_same_key_same_draws_any_change_new_draws():
    base = spec.uniforms(5, 10, 3, 64, spec.STREAM_ACCEPT)
    assert np.array_equal(base, spec.uniforms(5, 10, 3, 64, spec.STREAM_ACCEPT))
    # a draw depends on its key and element only, not on how many are drawn with it
    assert np.array_equal(base[:7], spec.uniforms(5, 10, 3, 7, spec.STREAM_ACCEPT))
    for other in [(6, 10, 3, 2), (5, 11, 3, 2), (5, 10, 4, 2), (5, 10, 3, 3), (5 + 2 ** 32, 10, 3, 2)]:
        changed = spec.uniforms(*other[:3], 64, other[3])
        assert not np.any(changed == base)


def test_gumbel_noise_is_minus_log_minus_log_u():
    u = spec.uniforms(9, 1, 2, 4096, spec.STREAM_DRAFT).astype(np.float64)
    g = spec.gumbel(9, 1, 2, 4096)  # the draft stream by default
    np.testing.assert_allclose(g, -np.log(-np.log(u)), rtol=1e-5, atol=1e-6)
    lo, hi = -np.log(-np.log(U24)), -np.log(-np.log(1 - U24))
    assert np.all(np.isfinite(g)) and g.min() >= lo - 1e-5 and g.max() <= hi + 1e-3


# --------------------------------------------------------------------------------------------
# Gumbel-max drafting (§5) and the proposal contract (§1.3)
# --------------------------------------------------------------------------------------------

def test_gumbel_max_is_argmax_of_scaled_logits_plus_noise():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=37).astype(np.float32)
    for position in range(200):
        g = spec.gumbel(3, 8, position, 37)
        expected = int(np.argmax(logits / np.float32(0.6) + g))
        assert spec.gumbel_max(logits, 0.6, 3, 8, position) == expected


@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_gumbel_max_follows_softmax(temperature):
    logits = np.array([1.0, 0.2, -0.5, 0.8, -1.3], dtype=np.float32)
    draws = np.array([spec.gumbel_max(logits, temperature, 1234, 17, k) for k in range(N)])
    law = softmax(logits.astype(np.float64) / temperature)
    p = chi2_pvalue(np.bincount(draws, minlength=5), law)
    assert p > ALPHA
    np.testing.assert_allclose(spec.proposal(logits, temperature), law, rtol=1e-6, atol=1e-7)
    # the same law at a wrong temperature is rejected by the same test
    assert chi2_pvalue(np.bincount(draws, minlength=5), softmax(logits / (temperature * 1.25))) < ALPHA


def test_gumbel_max_masked_and_underflowing_tokens():
    # -inf logits are never drawn and get q = 0; so are tokens whose probability underflows float,
    # because the 24-bit noise is bounded: a drawn token always has q(x) > 0 (§1.4).
    logits = np.full(64, -400.0, dtype=np.float32)
    logits[[5, 9]] = [0.0, 0.3]
    logits[[0, 1]] = -np.inf
    q = spec.proposal(logits, 1.0)
    assert q[0] == q[1] == 0 and np.all(q[10:] == 0) and q[5] > 0 and q[9] > 0
    draws = [spec.gumbel_max(logits, 1.0, s, 0, 0) for s in range(5000)]
    assert set(draws) == {5, 9}
    assert all(q[x] > 0 for x in draws)


def test_gumbel_max_temperature_zero_is_first_index_argmax():
    logits = np.array([0.5, 2.0, -1.0, 2.0, 1.9], dtype=np.float32)
    assert all(spec.gumbel_max(logits, 0.0, s, s, s) == 1 for s in range(50))
    assert np.array_equal(spec.proposal(logits, 0.0), [0, 1, 0, 0, 0])


def test_gumbel_max_rejects_bad_input():
    with pytest.raises(ValueError):
        spec.gumbel_max(np.array([0.0, np.nan], np.float32), 1.0, 0, 0, 0)
    with pytest.raises(ValueError):
        spec.gumbel_max(np.array([-np.inf, -np.inf], np.float32), 1.0, 0, 0, 0)
    with pytest.raises(ValueError):
        spec.gumbel_max(np.array([0.0, 1.0], np.float32), -0.5, 0, 0, 0)
    with pytest.raises(ValueError):
        spec.proposal(np.array([0.0, np.inf], np.float32), 1.0)


# --------------------------------------------------------------------------------------------
# Exact reference in fractions (§2, §3.1)
# --------------------------------------------------------------------------------------------

def residual(p, q, scale):
    return [max(0 * a, scale * a - b) for a, b in zip(p, q)]


def token_round_law(p_rows, q_rows, drafts, resample_from_p=False):
    """{(tau, y): probability} of one round of token-level rejection sampling."""
    law = defaultdict(lambda: 0 * p_rows[0][0])
    reach = 1 + 0 * p_rows[0][0]
    for i, x in enumerate(drafts):
        p, q = p_rows[i], q_rows[i]
        accept = min(1, p[x] / q[x])
        if reach * (1 - accept):
            w = list(p) if resample_from_p else residual(p, q, 1)
            for y, wy in enumerate(w):
                if wy:
                    law[(i, y)] += reach * (1 - accept) * wy / sum(w)
        reach *= accept
    for y, py in enumerate(p_rows[-1]):
        law[(len(drafts), y)] += reach * py / sum(p_rows[-1])
    return law


def block_thresholds_exact(p_rows, q_rows, drafts, z_from_current_rows=False):
    pis, pi = [], 1 + 0 * p_rows[0][0]
    for i, x in enumerate(drafts):
        pi = min(1, pi * p_rows[i][x] / q_rows[i][x])
        pis.append(pi)
    hs = []
    for i in range(len(drafts) - 1):
        row = i if z_from_current_rows else i + 1
        z = sum(residual(p_rows[row], q_rows[row], pis[i]))
        hs.append(z / (z + 1 - pis[i]) if z + 1 - pis[i] else 0 * z)
    return pis, hs + [pis[-1]]


def block_round_law(p_rows, q_rows, drafts, variant="correct"):
    """{(tau, y): probability} of one round of block verification, or of a broken variant:
    'unscaled' residual, 'current_rows' for Z, 'early_exit' scan. An empty residual is drawn from p
    (and would show up as a wrong law)."""
    gamma = len(drafts)
    pis, hs = block_thresholds_exact(p_rows, q_rows, drafts, variant == "current_rows")
    law = defaultdict(lambda: 0 * p_rows[0][0])
    for tau in range(gamma + 1):
        if variant == "early_exit":
            prob = math.prod(hs[:tau]) * (1 - hs[tau] if tau < gamma else 1)
        else:
            prob = (hs[tau - 1] if tau else 1) * math.prod(1 - h for h in hs[tau:])
        if not prob:
            continue
        if tau == gamma:
            w = list(p_rows[gamma])
        else:
            scale = 1 if (tau == 0 or variant == "unscaled") else pis[tau - 1]
            w = residual(p_rows[tau], q_rows[tau], scale)
            if not sum(w):
                w = list(p_rows[tau])
        for y, wy in enumerate(w):
            if wy:
                law[(tau, y)] += prob * wy / sum(w)
    return law


def loop_prefix_law(round_law, P, Q, ctx, gamma, length):
    """Exact law of the first `length` emitted tokens of the speculative loop: drafts drawn from the
    Markov rows Q, verified against the rows P, new rounds until `length` tokens exist."""
    n_vocab = len(P[0])
    memo = {}

    def suffix_law(prev, remaining):
        if (prev, remaining) in memo:
            return memo[(prev, remaining)]
        law = defaultdict(lambda: 0 * P[0][0])
        for drafts in itertools.product(range(n_vocab), repeat=gamma):
            rows, weight = [prev, *drafts], 1 + 0 * P[0][0]
            for i, x in enumerate(drafts):
                weight *= Q[rows[i]][x]
            if not weight:
                continue
            outcome = round_law([P[r] for r in rows], [Q[r] for r in rows[:-1]], drafts)
            for (tau, y), prob in outcome.items():
                emitted = (*drafts[:tau], y)
                if len(emitted) >= remaining:
                    law[emitted[:remaining]] += weight * prob
                else:
                    for rest, pr in suffix_law(y, remaining - len(emitted)).items():
                        law[emitted + rest] += weight * prob * pr
        memo[(prev, remaining)] = law
        return law

    return suffix_law(ctx, length)


def mean_accepted(round_law, P, Q, ctx, gamma):
    n_vocab = len(P[0])
    total = 0 * P[0][0]
    for drafts in itertools.product(range(n_vocab), repeat=gamma):
        rows, weight = [ctx, *drafts], 1 + 0 * P[0][0]
        for i, x in enumerate(drafts):
            weight *= Q[rows[i]][x]
        if weight:
            outcome = round_law([P[r] for r in rows], [Q[r] for r in rows[:-1]], drafts)
            total += weight * sum(tau * pr for (tau, _), pr in outcome.items())
    return total


# §2.5: V = {A, B, C}, rows indexed by the previous token, the context c is row 3.
A, B, C, CTX = 0, 1, 2, 3
F = Fraction
P_TOY = [[F(2, 10), F(5, 10), F(3, 10)], [F(5, 10), F(2, 10), F(3, 10)], [F(3, 10), F(3, 10), F(4, 10)],
         [F(5, 10), F(3, 10), F(2, 10)]]
Q_TOY = [[F(5, 10), F(3, 10), F(2, 10)], [F(2, 10), F(6, 10), F(2, 10)], [F(3, 10), F(3, 10), F(4, 10)],
         [F(3, 10), F(6, 10), F(1, 10)]]
P_TOY32 = np.array(P_TOY, dtype=np.float32)
Q_TOY32 = np.array(Q_TOY, dtype=np.float32)


def toy_rows(drafts, table=P_TOY):
    rows = [CTX, *drafts]
    return [table[r] for r in rows]


def test_worked_example_exact_numbers():
    p, q = toy_rows([B, B]), toy_rows([B, B], Q_TOY)[:2]
    pis, hs = block_thresholds_exact(p, q, [B, B])
    assert pis == [F(1, 2), F(1, 6)] and hs == [F(1, 11), F(1, 6)]
    assert sum(residual(p[1], q[1], pis[0])) == F(1, 20)  # Z_2
    law = block_round_law(p, q, [B, B])
    tau_law = [sum(v for (t, _), v in law.items() if t == k) for k in range(3)]
    assert tau_law == [F(25, 33), F(5, 66), F(1, 6)]
    assert law[(1, A)] == F(5, 66)  # the tau = 1 correction is A
    assert law[(0, A)] == F(25, 33) * F(2, 3) and law[(0, C)] == F(25, 33) * F(1, 3)
    tok = token_round_law(p, q, [B, B])
    assert [sum(v for (t, _), v in tok.items() if t == k) for k in range(3)] == [F(1, 2), F(1, 3), F(1, 6)]
    assert tok[(1, A)] == F(1, 3) * F(3, 4) and tok[(1, C)] == F(1, 3) * F(1, 4)
    # BA: tau = 2 always under block verification; BC: 3/4, 1/44, 5/22
    law_ba = block_round_law(toy_rows([B, A]), toy_rows([B, A], Q_TOY)[:2], [B, A])
    assert sum(v for (t, _), v in law_ba.items() if t == 2) == 1
    law_bc = block_round_law(toy_rows([B, C]), toy_rows([B, C], Q_TOY)[:2], [B, C])
    assert [sum(v for (t, _), v in law_bc.items() if t == k) for k in range(3)] == [F(5, 22), F(1, 44), F(3, 4)]
    # invariant P(tau >= 1 | x_1 = B) = pi_1 = 1/2
    reach = sum(Q_TOY[B][x2] * sum(v for (t, _), v in block_round_law(
        toy_rows([B, x2]), toy_rows([B, x2], Q_TOY)[:2], [B, x2]).items() if t >= 1) for x2 in range(3))
    assert reach == F(1, 2)
    # C.: the rows after C are equal, h_1 = 0/0 -> 0 and h_2 = 1; no division by zero
    assert block_thresholds_exact(toy_rows([C, A]), toy_rows([C, A], Q_TOY)[:2], [C, A]) == ([1, 1], [0, 1])


def test_worked_example_expected_acceptance_and_exactness():
    e = {(g, name): mean_accepted(fn, P_TOY, Q_TOY, CTX, g)
         for g in (2, 3) for name, fn in (("token", token_round_law), ("block", block_round_law))}
    assert round(float(e[(2, "token")]), 2) == 1.19 and round(float(e[(2, "block")]), 2) == 1.28
    assert round(float(e[(3, "token")]), 3) == 1.563 and round(float(e[(3, "block")]), 3) == 1.767
    target2 = markov_prefix_law(np.array(P_TOY, dtype=object), CTX, 2)
    assert [float(v) for v in target2.ravel()] == pytest.approx([.10, .25, .15, .15, .06, .09, .06, .06, .08])
    for gamma in (2, 3):
        for fn in (token_round_law, block_round_law):
            law = loop_prefix_law(fn, P_TOY, Q_TOY, CTX, gamma, 2)
            assert all(law[(a, b)] == target2[a, b] for a in range(3) for b in range(3))  # TV = 0, exactly


def test_exact_reference_sees_the_known_bugs():
    """The exact enumeration itself tells the broken rules apart (§2.3): the unscaled residual keeps
    the first-token law and breaks the joint one; Z from the current rows and the early exit break
    both; resampling from p breaks token-level."""
    target1 = [P_TOY[CTX][a] for a in range(3)]
    target2 = markov_prefix_law(np.array(P_TOY, dtype=object), CTX, 2)

    def variant(name):
        return lambda p, q, d: block_round_law(p, q, d, name)

    for name, fn, first_ok in [("unscaled", variant("unscaled"), True),
                               ("current_rows", variant("current_rows"), False),
                               ("early_exit", variant("early_exit"), False),
                               ("resample_p", lambda p, q, d: token_round_law(p, q, d, True), False)]:
        law2 = loop_prefix_law(fn, P_TOY, Q_TOY, CTX, 2, 2)
        first = [sum(law2[(a, b)] for b in range(3)) for a in range(3)]
        assert (first == target1) == first_ok, name
        assert any(law2[(a, b)] != target2[a, b] for a in range(3) for b in range(3)), name


# --------------------------------------------------------------------------------------------
# The C++ verifiers on the worked example, draft by draft
# --------------------------------------------------------------------------------------------

def test_cpp_thresholds_match_fractions():
    for drafts in ([B, B], [B, A], [B, C], [C, A], [A, B], [C, C]):
        p = np.array(toy_rows(drafts), dtype=np.float32)
        q = np.array(toy_rows(drafts, Q_TOY)[:2], dtype=np.float32)
        pis, hs = spec.block_thresholds(p, q, np.array(drafts))
        epis, ehs = block_thresholds_exact(toy_rows(drafts), toy_rows(drafts, Q_TOY)[:2], drafts)
        np.testing.assert_allclose(pis, [float(v) for v in epis], rtol=1e-6)
        np.testing.assert_allclose(hs, [float(v) for v in ehs], rtol=1e-6, atol=1e-7)
        assert np.all(np.isfinite(hs))


@pytest.mark.parametrize("method", ["rejection", "block"])
@pytest.mark.parametrize("drafts", [[B, B], [B, C]])
def test_cpp_round_law_matches_fractions(method, drafts):
    """One round with fixed drafts, many seeds: the joint law of (tau, emitted token) equals the
    exact one, so acceptance, correction (with the pi_tau scaling) and bonus are all right."""
    p = np.array(toy_rows(drafts), dtype=np.float32)
    q = np.array(toy_rows(drafts, Q_TOY)[:2], dtype=np.float32)
    fn = spec.verify_rejection if method == "rejection" else spec.verify_block
    exact = (token_round_law if method == "rejection" else block_round_law)(
        toy_rows(drafts), toy_rows(drafts, Q_TOY)[:2], drafts)
    counts = np.zeros((3, 3), dtype=np.int64)
    d = np.array(drafts, dtype=np.int32)
    for seed in range(N // 4):
        tau, tokens, events = fn(p, q, d, seed, 40)
        assert list(tokens[:tau]) == drafts[:tau] and len(tokens) == tau + 1
        assert events == {"zero_q": 0, "empty_residual": 0}
        counts[tau, tokens[-1]] += 1
    probs = np.array([[float(exact[(t, y)]) for y in range(3)] for t in range(3)])
    assert chi2_pvalue(counts, probs) > ALPHA
    # the other rule's law is a different one, and the same test says so
    other = (block_round_law if method == "rejection" else token_round_law)(
        toy_rows(drafts), toy_rows(drafts, Q_TOY)[:2], drafts)
    assert chi2_pvalue(counts, np.array([[float(other[(t, y)]) for y in range(3)] for t in range(3)])) < ALPHA


# --------------------------------------------------------------------------------------------
# The speculative loop: chi-square on emitted prefixes (§3.2)
# --------------------------------------------------------------------------------------------

PROMPT_LEN = 9  # the committed length before the first round: the first step offset


def speculate(n, gamma, length, ctx, draft, verify):
    """Runs n independent requests of a Markov toy (rows indexed by the previous token, the context
    is row `ctx`) until each has emitted `length` tokens. draft(prev, trials, offsets) -> drafts
    (m, gamma); verify(rows, drafts, trials, offsets) -> (tau, last emitted token) with rows =
    [prev, drafts...]. The step offset of a round is the committed length at its start. Returns the
    tokens (n, length) and the first round's tau (n,)."""
    tokens = np.full((n, length), -1, dtype=np.int64)
    filled = np.zeros(n, dtype=np.int64)
    prev = np.full(n, ctx, dtype=np.int64)
    first_tau = None
    while True:
        active = np.nonzero(filled < length)[0]
        if active.size == 0:
            return tokens, first_tau
        offsets = PROMPT_LEN + filled[active]
        drafts = draft(prev[active], active, offsets)
        rows = np.concatenate([prev[active][:, None], drafts], axis=1)
        tau, last = verify(rows, drafts, active, offsets)
        assert np.all((tau >= 0) & (tau <= gamma))
        emitted = np.concatenate([drafts, np.zeros((active.size, 1), dtype=np.int64)], axis=1)
        emitted[np.arange(active.size), tau] = last
        for k in range(gamma + 1):
            slot = filled[active] + k
            keep = (k <= tau) & (slot < length)
            tokens[active[keep], slot[keep]] = emitted[keep, k]
        if first_tau is None:
            first_tau = tau
        filled[active] += tau + 1
        prev[active] = last


class Toy:
    """A first-order Markov target P and drafter logits L, rows: the V tokens, then the context
    (row V). The C++ drafter samples L / T with Gumbel-max; Q holds the law of each such draw."""

    def __init__(self, P, draft_logits, temperature):
        self.P = np.ascontiguousarray(P, dtype=np.float32)
        self.V = self.P.shape[1]
        self.ctx = self.V
        self.L = [np.ascontiguousarray(r, dtype=np.float32) for r in draft_logits]
        self.T = temperature
        self.Q = self.proposals(temperature)

    def proposals(self, temperature):
        return np.stack([spec.proposal(r, temperature) for r in self.L])

    def law(self, length):
        return markov_prefix_law(self.P, self.ctx, length)

    def gumbel_drafter(self, gamma, seed_base, temperature=None):
        T = self.T if temperature is None else temperature

        def draft(prev, trials, offsets):
            out = []
            for r, trial, off in zip(prev.tolist(), trials.tolist(), offsets.tolist()):
                row = []
                for j in range(gamma):
                    r = spec.gumbel_max(self.L[r], T, seed_base + trial, off, j)
                    row.append(r)
                out.append(row)
            return np.array(out, dtype=np.int64).reshape(len(out), gamma)
        return draft

    def cpp_verifier(self, fn, seed_base, q_table=None, fixed_offset=None, events=None):
        q_table = self.Q if q_table is None else q_table

        def verify(rows, drafts, trials, offsets):
            m, gamma = drafts.shape
            p_all, q_all = self.P[rows], q_table[rows[:, :-1]]
            d32 = drafts.astype(np.int32)
            tau = np.empty(m, dtype=np.int64)
            emitted = np.full((m, gamma + 1), -1, dtype=np.int64)
            n_events = 0
            for k, (trial, off) in enumerate(zip(trials.tolist(), offsets.tolist())):
                off = off if fixed_offset is None else fixed_offset
                t, toks, ev = fn(p_all[k], q_all[k], d32[k], seed_base + trial, off)
                tau[k] = t
                emitted[k, :len(toks)] = toks
                n_events += ev["zero_q"] + ev["empty_residual"]
            # tau + 1 tokens: the accepted drafts, then one more
            cols = np.arange(gamma + 1)
            assert np.all((emitted >= 0) == (cols <= tau[:, None]))
            assert np.all(np.where(cols[:gamma] < tau[:, None], emitted[:, :gamma] == drafts, True))
            if events is not None:
                events[0] += n_events
            return tau, emitted[np.arange(m), tau]
        return verify

    def run_cpp(self, method, gamma, length, seed_base, n=N, **verifier_args):
        """The loop with the C++ drafter and verifier: p-values of the 1..length-token prefixes
        and the first round's tau."""
        fn = {"rejection": spec.verify_rejection, "block": spec.verify_block}[method]
        events = [0]
        tokens, first_tau = speculate(n, gamma, length, self.ctx, self.gumbel_drafter(gamma, seed_base),
                                      self.cpp_verifier(fn, seed_base, events=events, **verifier_args))
        assert events[0] == 0, "impossible events (q(x) = 0 or an empty residual) were counted"
        return [chi2_pvalue(prefix_counts(tokens, k, self.V), self.law(k)) for k in range(1, length + 1)], first_tau


TOY_25 = Toy(P_TOY32, np.log(Q_TOY32), 1.0)


def random_toy(n_vocab, seed, temperature, closeness, scale=0.8):
    """Target rows softmax(logits / T); drafter logits the target's plus noise of scale
    `closeness`, sampled at the same T."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=scale, size=(n_vocab + 1, n_vocab))
    P = np.stack([softmax(r / temperature) for r in logits])
    return Toy(P, logits + rng.normal(scale=closeness, size=logits.shape), temperature)


@pytest.mark.parametrize("method,gamma,length", [("rejection", 2, 2), ("block", 2, 2), ("block", 3, 3)])
def test_loop_is_lossless_on_worked_example(method, gamma, length):
    pvalues, first_tau = TOY_25.run_cpp(method, gamma, length, seed_base=1000 * gamma)
    assert min(pvalues) > ALPHA, pvalues
    # mean accepted length of the first round: a z-test against the exact expectation
    exact = float(mean_accepted(token_round_law if method == "rejection" else block_round_law,
                                P_TOY, Q_TOY, CTX, gamma))
    assert abs(first_tau.mean() - exact) < 4.5 * first_tau.std() / np.sqrt(first_tau.size)


@pytest.mark.parametrize("method", ["rejection", "block"])
def test_loop_is_lossless_at_temperature_on_five_tokens(method):
    toy = random_toy(5, seed=5, temperature=0.7, closeness=1.0)
    pvalues, first_tau = toy.run_cpp(method, 4, 2, seed_base=77, n=N // 2)
    assert min(pvalues) > ALPHA, pvalues
    assert 0.5 < first_tau.mean() < 3.5  # the drafts are neither all accepted nor all rejected


def test_position_only_noise_is_caught():
    """Negative control with the real kernel (§2.3 item 7): keying the verifier's noise without the
    step offset reuses, next round, the noise block verification looked at and did not consume."""
    pvalues, _ = TOY_25.run_cpp("block", 3, 3, seed_base=3000, n=N // 4, fixed_offset=PROMPT_LEN)
    assert min(pvalues) < ALPHA, pvalues


def test_proposal_at_the_wrong_temperature_is_caught():
    """Negative control (§1.3): drafts drawn at T = 0.7 verified against q computed at T = 1."""
    toy = random_toy(5, seed=5, temperature=0.7, closeness=1.0)
    pvalues, _ = toy.run_cpp("rejection", 4, 2, seed_base=77, n=N // 4, q_table=toy.proposals(1.0))
    assert min(pvalues) < ALPHA, pvalues


@pytest.mark.parametrize("method", ["rejection", "block"])
def test_greedy_drafts_need_one_hot_q(method):
    """§1.2: drafts taken by argmax have the one-hot proposal; with it the emitted law is exact,
    with the drafter's softmax as q the first token follows (1/3, 1/2, 1/6) instead of p."""
    fn = {"rejection": spec.verify_rejection, "block": spec.verify_block}[method]
    n = N // 4
    for q_table, lossless in ((TOY_25.proposals(0.0), True), (TOY_25.Q, False)):
        tokens, _ = speculate(n, 2, 2, TOY_25.ctx, TOY_25.gumbel_drafter(2, 50, temperature=0.0),
                              TOY_25.cpp_verifier(fn, 50, q_table=q_table))
        pvalues = [chi2_pvalue(prefix_counts(tokens, k, 3), TOY_25.law(k)) for k in (1, 2)]
        assert (min(pvalues) > ALPHA) == lossless, pvalues
    if method == "rejection":
        assert chi2_pvalue(np.bincount(tokens[:, 0], minlength=3), [1 / 3, 1 / 2, 1 / 6]) > ALPHA


# --------------------------------------------------------------------------------------------
# Negative controls: broken verifiers fail the same chi-square tests (§3.5)
# --------------------------------------------------------------------------------------------

def numpy_drafter(Q, gamma, rng):
    cdf = np.cumsum(Q / Q.sum(axis=1, keepdims=True), axis=1)

    def draft(prev, trials, offsets):
        out = np.empty((prev.size, gamma), dtype=np.int64)
        r = prev
        for j in range(gamma):
            r = np.minimum((rng.random(prev.size)[:, None] >= cdf[r]).sum(axis=1), Q.shape[1] - 1)
            out[:, j] = r
        return out
    return draft


def numpy_verifier(P, Q, rule, rng):
    """An independent float64 verifier, vectorised over requests: the correct rules 'token' and
    'block', and the broken ones the reference lists."""
    P = P.astype(np.float64) / P.sum(axis=1, keepdims=True)
    Q = Q.astype(np.float64) / Q.sum(axis=1, keepdims=True)

    def verify(rows, drafts, trials, offsets):
        m, g = drafts.shape
        p, q = P[rows], Q[rows[:, :-1]]
        at = np.arange(m)
        ratio = p[at[:, None], np.arange(g), drafts] / q[at[:, None], np.arange(g), drafts]
        u = rng.random((m, g))
        scale = np.ones(m)
        if rule.startswith("token"):
            accepted = u < ratio
            tau = np.where(accepted.all(axis=1), g, np.argmin(accepted, axis=1))
        elif rule == "block_product_of_uniforms":  # the pre-fix vllm-ascend rule
            ok = np.cumprod(np.minimum(1, ratio), axis=1) >= np.cumprod(u, axis=1)
            tau = np.where(ok.any(axis=1), g - np.argmax(ok[:, ::-1], axis=1), 0)
        else:
            pi = np.empty((m, g))
            acc = np.ones(m)
            for i in range(g):
                acc = acc * ratio[:, i] if rule == "block_uncapped" else np.minimum(1, acc * ratio[:, i])
                pi[:, i] = acc
            h = np.empty((m, g))
            for i in range(g - 1):
                j = i if rule == "block_current_rows" else i + 1
                z = np.maximum(0, pi[:, i, None] * p[:, j] - q[:, j]).sum(axis=1)
                den = z + 1 - pi[:, i]
                h[:, i] = np.clip(np.divide(z, den, out=np.zeros(m), where=den > 0), 0, 1)
            h[:, g - 1] = np.minimum(1, pi[:, g - 1])
            passes = u <= h
            if rule == "block_early_exit":
                tau = np.where(passes.all(axis=1), g, np.argmin(passes, axis=1))
            else:
                tau = np.where(passes.any(axis=1), g - np.argmax(passes[:, ::-1], axis=1), 0)
            if rule != "block_unscaled":
                scale = np.where(tau > 0, np.minimum(1, pi[at, np.maximum(tau - 1, 0)]), 1)
        at_tau = np.minimum(tau, g - 1)
        pt, qt = p[at, tau], q[at, at_tau]
        if rule == "token_resample_p":
            w = pt.copy()
        else:
            w = np.maximum(0, scale[:, None] * pt - qt)
        bonus = tau == g
        w[bonus] = pt[bonus]
        empty = w.sum(axis=1) <= 0
        w[empty] = pt[empty]
        cdf = np.cumsum(w / w.sum(axis=1, keepdims=True), axis=1)
        last = np.minimum((rng.random(m)[:, None] >= cdf).sum(axis=1), P.shape[1] - 1)
        return tau, last
    return verify


def numpy_pvalues(rule, gamma, length, seed):
    rng = np.random.default_rng(seed)
    tokens, first_tau = speculate(N, gamma, length, CTX, numpy_drafter(Q_TOY32, gamma, rng),
                                  numpy_verifier(P_TOY32, Q_TOY32, rule, rng))
    return [chi2_pvalue(prefix_counts(tokens, k, 3), TOY_25.law(k)) for k in range(1, length + 1)], first_tau


@pytest.mark.parametrize("rule", ["token", "block"])
def test_independent_numpy_verifier_passes(rule):
    pvalues, first_tau = numpy_pvalues(rule, 2, 2, seed=5)
    assert min(pvalues) > ALPHA, pvalues
    exact = float(mean_accepted(token_round_law if rule == "token" else block_round_law, P_TOY, Q_TOY, CTX, 2))
    assert abs(first_tau.mean() - exact) < 4.5 * first_tau.std() / np.sqrt(first_tau.size)


@pytest.mark.parametrize("rule,first_token_exact", [
    ("token_resample_p", False),           # resample from p instead of the residual
    ("block_unscaled", True),              # residual without the pi_tau scaling: only the joint test sees it
    ("block_current_rows", False),         # Z_{i+1} from the rows of x_i (off by one)
    ("block_early_exit", False),           # stop the scan at the first failure
    ("block_product_of_uniforms", False),  # the pre-fix vllm-ascend rule
    ("block_uncapped", True),              # cumulative ratio without min(1, .): the marginal survives here
])
def test_broken_verifiers_fail(rule, first_token_exact):
    (p_first, p_joint), _ = numpy_pvalues(rule, 2, 2, seed=5)
    assert p_joint < ALPHA
    assert (p_first > ALPHA) == first_token_exact


# --------------------------------------------------------------------------------------------
# Block verification accepts at least as much as token-level, on the same inputs (§2.2)
# --------------------------------------------------------------------------------------------

def test_block_accepts_at_least_as_much_as_token_level():
    toy = random_toy(6, seed=11, temperature=1.0, closeness=0.8)
    gamma, n = 4, 40_000
    P = [list(map(float, r)) for r in toy.P / toy.P.sum(axis=1, keepdims=True)]
    Q = [list(map(float, r)) for r in toy.Q]
    means = {}
    for method, round_law in (("rejection", token_round_law), ("block", block_round_law)):
        tokens, tau = speculate(n, gamma, 1, toy.ctx, toy.gumbel_drafter(gamma, 500),
                                toy.cpp_verifier(getattr(spec, "verify_" + method), 500))
        exact = mean_accepted(round_law, P, Q, toy.ctx, gamma)
        assert abs(tau.mean() - exact) < 4.5 * tau.std() / np.sqrt(n), (method, tau.mean(), exact)
        means[method] = (tau.mean(), exact, tau.std() / np.sqrt(n))
    (tok, tok_exact, tok_se), (blk, blk_exact, blk_se) = means["rejection"], means["block"]
    assert blk_exact > tok_exact + 0.05  # the theorem, with a visible margin on these inputs
    assert blk - tok > 4 * np.hypot(tok_se, blk_se)


def test_one_hot_drafts_give_block_the_token_level_acceptance():
    """§2.2: with one-hot q both rules have P(tau >= i) = prod p_j(x_j), exactly."""
    rng = np.random.default_rng(2)
    for _ in range(20):
        V, gamma = 4, 3
        P = [[Fraction(int(v), 100) for v in row] for row in rng.multinomial(100, np.ones(V) / V, size=V + 1)]
        P = [[v if sum(row) else Fraction(1, V) for v in row] for row in P]
        Q = [[Fraction(int(i == (r * 7 + 1) % V)) for i in range(V)] for r in range(V + 1)]
        assert mean_accepted(token_round_law, P, Q, V, gamma) == mean_accepted(block_round_law, P, Q, V, gamma)


# --------------------------------------------------------------------------------------------
# Greedy verification (T = 0) equals plain greedy decoding (§1.2)
# --------------------------------------------------------------------------------------------

def test_greedy_verification_equals_plain_greedy():
    """A second-order toy model with many ties (first index wins); a drafter right 60% of the
    time. Speculative greedy decoding reproduces plain greedy decoding token for token."""
    rng = np.random.default_rng(4)
    V, gamma, length = 12, 4, 60
    W = np.round(rng.normal(size=(V, V, V)) * 2) / 2  # logits on a 0.5 grid: frequent ties
    W = W.astype(np.float32)
    probs = np.exp(W - W.max(axis=2, keepdims=True))
    probs = (probs / probs.sum(axis=2, keepdims=True)).astype(np.float32)
    seen_tau = set()
    for prompt in range(30):
        start = [int(t) for t in rng.integers(V, size=2)]
        plain = list(start)
        while len(plain) < length + 2:
            plain.append(int(np.argmax(W[plain[-2], plain[-1]])))
        for rows_of in (W, probs):  # logits or probabilities: only the argmax matters
            seq = list(start)
            while len(seq) < length + 2:
                ctx, drafts = list(seq), []
                for _ in range(gamma):
                    good = int(np.argmax(W[ctx[-2], ctx[-1]]))
                    ctx.append(good if rng.random() < 0.6 else int(rng.integers(V)))
                    drafts.append(ctx[-1])
                p_rows = np.stack([rows_of[ctx[i - 2], ctx[i - 1]] for i in range(len(seq), len(seq) + gamma + 1)])
                tau, tokens, events = spec.verify_greedy(p_rows, np.array(drafts))
                assert list(tokens[:tau]) == drafts[:tau] and len(tokens) == tau + 1
                seen_tau.add(tau)
                seq.extend(int(t) for t in tokens)
            assert seq[:length + 2] == plain[:length + 2]
    assert seen_tau == set(range(gamma + 1))


def test_stochastic_verifiers_on_one_hot_targets_equal_greedy():
    """T = 0 as a limit: with one-hot p both rules accept while x_i = argmax and correct to the
    argmax, for any q and any noise."""
    rng = np.random.default_rng(6)
    V, gamma = 7, 3
    for seed in range(300):
        top = rng.integers(V, size=gamma + 1)
        p = np.zeros((gamma + 1, V), np.float32)
        p[np.arange(gamma + 1), top] = 1
        q = rng.dirichlet(np.ones(V), size=gamma).astype(np.float32)
        drafts = np.where(rng.random(gamma) < 0.7, top[:gamma], rng.integers(V, size=gamma)).astype(np.int32)
        tau, tokens, _ = spec.verify_greedy(p, drafts)
        for fn in (spec.verify_rejection, spec.verify_block):
            t, toks, events = fn(p, q, drafts, seed, 3)
            assert t == tau and np.array_equal(toks, tokens)
            assert events == {"zero_q": 0, "empty_residual": 0}


# --------------------------------------------------------------------------------------------
# Edge cases and input checks (§1.4)
# --------------------------------------------------------------------------------------------

def test_padding_verifies_the_drafts_before_it():
    rng = np.random.default_rng(8)
    V = 6
    p = rng.dirichlet(np.ones(V), size=5).astype(np.float32)
    q = rng.dirichlet(np.ones(V), size=4).astype(np.float32)
    drafts = np.array([2, 4, -1, -1], np.int32)
    for seed in range(200):
        for fn in (spec.verify_rejection, spec.verify_block):
            padded = fn(p, q, drafts, seed, 12)
            short = fn(p[:3], q[:2], drafts[:2], seed, 12)
            assert padded[0] == short[0] and np.array_equal(padded[1], short[1])
        assert np.array_equal(spec.verify_greedy(p, drafts)[1], spec.verify_greedy(p[:3], drafts[:2])[1])


def test_no_drafts_draws_the_bonus_from_p():
    p = np.array([[0.1, 0.6, 0.3]], np.float32)
    q = np.zeros((0, 3), np.float32)
    for fn in (spec.verify_rejection, spec.verify_block):
        draws = [fn(p, q, np.zeros(0, np.int32), seed, 1) for seed in range(20_000)]
        assert all(tau == 0 and len(tokens) == 1 for tau, tokens, _ in draws)
        assert chi2_pvalue(np.bincount([t[0] for _, t, _ in draws], minlength=3), p[0]) > ALPHA


def test_bonus_draw_is_the_exponential_race_over_the_positive_entries():
    """The bonus token is argmax p(t) / -log u(t) over the tokens with p(t) > 0, u the Target-stream
    uniforms of the round, and a correction the same race over max(0, p - q) with the Correction
    stream: exactly, on sparse rows (a sampled law keeps 1-40 of 49k tokens) whose zero runs the
    sampler skips without drawing their noise. The reference draws every uniform."""
    rng = np.random.default_rng(8)
    n = 1000
    q = np.zeros((0, n), np.float32)
    for case in range(60):
        p = np.zeros(n, np.float32)
        k = int(rng.choice([1, 2, 5, 40]))
        idx = rng.choice(n, size=k, replace=False)
        if case % 3 == 0:
            idx[0] = n - 1                      # the row's last entry, in a partial vector step
        p[idx] = rng.uniform(0.1, 1.0, k).astype(np.float32)
        p /= p.sum()
        seed, offset = int(rng.integers(1 << 40)), int(rng.integers(1 << 20))
        u = spec.uniforms(seed, offset, 0, n, 0).astype(np.float64)   # position 0 (no drafts), Target
        vals = np.where(p > 0, p.astype(np.float64) / -np.log(u), -np.inf)
        want = int(np.argmax(vals))
        for fn in (spec.verify_rejection, spec.verify_block):
            tau, tokens, _ = fn(p[None, :], q, np.zeros(0, np.int32), seed, offset)
            assert tau == 0 and list(tokens) == [want], (case, fn.__name__)
        # A rejected draft x (p(x) = 0, q one-hot at x): the correction is the same race over
        # max(0, p - q) with the Correction stream's uniforms of slot 0.
        x = int(np.flatnonzero(p == 0)[case % 7])
        qx = np.zeros((1, n), np.float32)
        qx[0, x] = 1.0
        uc = spec.uniforms(seed, offset, 0, n, 3).astype(np.float64)
        resid = np.maximum(0.0, p.astype(np.float64) - qx[0])
        want_c = int(np.argmax(np.where(resid > 0, resid / -np.log(uc), -np.inf)))
        p2 = np.stack([p, p])
        tau, tokens, _ = spec.verify_rejection(p2, qx, np.array([x], np.int32), seed, offset)
        assert tau == 0 and list(tokens) == [want_c], case


def race_winner(w, u):
    """argmax w(t) / -log u(t) over the tokens with w(t) > 0, in float64, ties to the smallest."""
    vals = np.where(w > 0, w / -np.log(u.astype(np.float64)), -np.inf)
    return int(np.argmax(vals))


def test_race_on_dense_rows_skips_no_winner():
    """Temperature-only laws are dense (every one of 49k tokens has p > 0), and the sampler rules
    most tokens out without their log or their noise (verify.cpp sample_weights: w / -log u <
    w / (1 - u) <= 2^24 w). Those bounds must never skip the winner: the bonus and the correction
    are exactly the race over every token, on dense rows of every spread, with the top token
    repeated (equal weights), and with the winner far from the largest p."""
    rng = np.random.default_rng(21)
    n = 20_000
    q0 = np.zeros((0, n), np.float32)
    for case in range(120):
        z = rng.normal(size=n) * [0.5, 2.0, 6.0, 15.0][case % 4]
        if case % 5 == 0:
            z[rng.integers(n, size=6)] = z.max()                 # equal top weights
        p = softmax(z / [0.7, 1.0, 1.5][case % 3]).astype(np.float32)
        seed, offset = int(rng.integers(1 << 40)), int(rng.integers(1 << 20))
        want = race_winner(p.astype(np.float64), spec.uniforms(seed, offset, 0, n, 0))
        for fn in (spec.verify_rejection, spec.verify_block):
            tau, tokens, _ = fn(p[None, :], q0, np.zeros(0, np.int32), seed, offset)
            assert tau == 0 and list(tokens) == [want], (case, fn.__name__)
        # A dense proposal that drafted a token the target all but rules out: rejected, and the
        # correction is the race over max(0, p - q) with the Correction stream.
        q = softmax(z / 2.0 + rng.normal(size=n)).astype(np.float32)
        x = int(np.argmin(p / np.maximum(q, 1e-30)))
        tau, tokens, _ = spec.verify_rejection(np.stack([p, p]), q[None, :], np.array([x], np.int32), seed, offset)
        if tau == 0:
            resid = np.maximum(0.0, p.astype(np.float64) - q.astype(np.float64))
            assert list(tokens) == [race_winner(resid, spec.uniforms(seed, offset, 0, n, 3))], case


def test_counted_events_never_nan():
    # q(x) = 0 for a drafted token: an inconsistent q; counted, the ratio is taken as unbounded.
    p = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], np.float32)
    q = np.array([[0.0, 1.0, 0.0]], np.float32)
    for fn in (spec.verify_rejection, spec.verify_block):
        tau, tokens, events = fn(p, q, np.array([0], np.int32), 1, 1)
        assert tau == 1 and events["zero_q"] == 1
    pis, hs = spec.block_thresholds(p, q, np.array([0]))
    assert np.all(np.isfinite(pis)) and np.all(np.isfinite(hs))
    # p <= q everywhere (unnormalised rows): a rejection finds an empty residual and draws from p
    p = np.array([[0.25, 0.25, 0.0], [1.0, 0.0, 0.0]], np.float32)
    q = np.array([[0.5, 0.5, 0.0]], np.float32)
    empty = 0
    for seed in range(400):
        tau, tokens, events = spec.verify_rejection(p, q, np.array([0], np.int32), seed, 0)
        empty += events["empty_residual"]
        assert events["empty_residual"] == (tau == 0) and tokens[-1] in ((0, 1) if tau == 0 else (0,))
    assert 120 < empty < 280


@pytest.mark.parametrize("call", [
    lambda: spec.verify_block(np.full((3, 4), .25, np.float32), np.full((2, 4), .25, np.float32), [1, 4], 0, 0),
    lambda: spec.verify_block(np.full((3, 4), .25, np.float32), np.full((2, 4), .25, np.float32), [-1, 2], 0, 0),
    lambda: spec.verify_rejection(np.full((3, 4), .25, np.float32), np.full((2, 4), .25, np.float32), [-2, 1], 0, 0),
    lambda: spec.verify_rejection(np.full((2, 4), .25, np.float32), np.full((2, 4), .25, np.float32), [1, 1], 0, 0),
    lambda: spec.verify_rejection(np.full((3, 4), .25, np.float32), np.full((2, 5), .2, np.float32), [1, 1], 0, 0),
    lambda: spec.verify_rejection(np.array([[.5, np.nan], [.5, .5]], np.float32), np.full((1, 2), .5, np.float32),
                                  [0], 0, 0),
    lambda: spec.verify_block(np.array([[.5, .5], [0, 0]], np.float32), np.full((1, 2), .5, np.float32), [0], 0, 0),
    lambda: spec.verify_block(np.array([[.5, .5], [.5, .5]], np.float32), np.array([[1.5, -.5]], np.float32), [0],
                              0, 0),
    lambda: spec.verify_greedy(np.array([[0.5, np.nan], [0.5, 0.5]], np.float32), [1]),
    lambda: spec.uniforms(0, 0, 0, 4, stream=4),
    lambda: spec.philox4x32((0, 0, 0, 0), (0, 0), rounds=17),
])
def test_bad_input_is_a_value_error(call):
    with pytest.raises(ValueError):
        call()


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 31, 64, 1000, 49152])
def test_greedy_argmax_is_the_first_index_of_the_maximum(n):
    """T = 0 (verify_greedy's and the drafts' argmax, vectorised): the first index of the row's
    maximum, whatever the ties, -inf entries, signed zeros or the row length's remainder; a NaN
    anywhere is an error naming it."""
    rng = np.random.default_rng(n)
    for trial in range(20):
        logits = rng.integers(-3, 4, n).astype(np.float32)      # many ties
        if trial % 4 == 1:
            logits[rng.random(n) < 0.5] = -np.inf
        if trial % 4 == 2:
            logits[:] = -np.inf
        if trial % 4 == 3:
            logits = np.where(rng.random(n) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
        assert spec.gumbel_max(logits, 0.0, 1, 0, 0) == int(np.argmax(logits)), (n, trial)
        at = int(rng.integers(0, n))
        bad = logits.copy()
        bad[at] = np.nan
        with pytest.raises(ValueError, match=f"NaN at token {at}"):
            spec.gumbel_max(bad, 0.0, 1, 0, 0)
