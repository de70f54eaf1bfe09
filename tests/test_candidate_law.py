"""A sampled row's law from its best candidates alone (csrc/spec/verify.h candidate_law) and
verification over such laws (verify with SparseLaw rows).

The engine asks the graph for each sampled row's top_k (+ bans) best ids and their logits instead
of the whole row (TOP_K + GATHER). That is only lossless if the law over the candidates is the
whole row's processed law (processed_law, itself checked against pyspec/sampling.py) and if
verification over candidate laws draws the same tokens as over the full rows. Both are checked
here against the full-row functions, bit for bit, on rows with ties and -0.
"""
import numpy as np
import pytest

from pyspec import _core

spec = _core.spec
NEG_INF = np.float32(-np.inf)


def best_ids(row, m):
    """TOP_K's order: logit descending, then id ascending."""
    idx = np.arange(row.size)
    return np.lexsort((idx, -row.astype(np.float64)))[:m].astype(np.int32)


def rows(rng, n):
    yield rng.standard_normal(n).astype(np.float32) * 3
    yield (np.round(rng.standard_normal(n) * 4) / 4).astype(np.float32)  # ties among the best
    z = np.where(rng.random(n) < 0.5, np.float32(0.0), np.float32(-0.0)).astype(np.float32)
    z[rng.integers(0, n, 3)] = 0.5
    yield z  # -0 and +0 tie


FILTERS = [(1, 1.0, 0.0), (5, 1.0, 0.0), (40, 1.0, 0.0), (40, 0.9, 0.05), (40, 0.5, 0.0),
           (12, 1.0, 0.2), (40, 0.95, 0.1)]


@pytest.mark.parametrize("n", [64, 1000, 49152])
def test_candidate_law_is_the_rows_processed_law(n):
    rng = np.random.default_rng(n)
    checked = 0
    for row in rows(rng, n):
        for top_k, top_p, min_p in FILTERS:
            for T in (0.3, 0.8, 1.5):
                full = spec.processed_law(row, T, top_k, top_p, min_p)
                for extra in (0, 7):
                    cand = best_ids(row, top_k + extra)
                    ids, probs = spec.candidate_law(cand, row[cand], T, top_k, top_p, min_p)
                    assert np.all(np.diff(ids) > 0)
                    want_ids = np.flatnonzero(full).astype(np.int32)
                    assert np.array_equal(ids[probs > 0], want_ids), (top_k, top_p, min_p, T)
                    assert np.array_equal(probs, full[ids])  # the same float32 bits
                    checked += 1
    assert checked == 3 * len(FILTERS) * 3 * 2


def test_candidate_law_with_banned_ids_left_out():
    """A ban is a -inf logit: the processed row's best top_k are the first top_k unbanned
    candidates of the raw row's best top_k + bans, as the engine takes them."""
    rng = np.random.default_rng(3)
    row = rng.standard_normal(5000).astype(np.float32)
    bans = best_ids(row, 6)[[0, 2, 5]]  # among the very best
    banned = row.copy()
    banned[bans] = NEG_INF
    for top_k, top_p, min_p in FILTERS:
        cand = best_ids(row, top_k + bans.size)
        keep = cand[~np.isin(cand, bans)]
        ids, probs = spec.candidate_law(keep, row[keep], 0.8, top_k, top_p, min_p)
        full = spec.processed_law(banned, 0.8, top_k, top_p, min_p)
        assert np.array_equal(probs, full[ids]) and full.sum(dtype=np.float64) == pytest.approx(
            probs.sum(dtype=np.float64))
        assert not np.isin(ids, bans).any()


def test_candidate_law_refuses_what_it_cannot_know():
    row = np.arange(10, dtype=np.float32)
    cand = best_ids(row, 4)
    with pytest.raises(ValueError, match="top_k"):
        spec.candidate_law(cand, row[cand], 0.8, 5)  # top-k reaches past the candidates
    with pytest.raises(ValueError, match="top_k"):
        spec.candidate_law(cand, row[cand], 0.8, 0)  # no top-k: the whole row's law
    with pytest.raises(ValueError, match="top_p"):
        spec.candidate_law(cand, row[cand], 0.8, 2, 1.5)


def softmax(z):
    e = np.exp(z - z.max())
    return (e / e.sum()).astype(np.float32)


@pytest.mark.parametrize("method", ["rejection", "block"])
def test_verification_over_candidate_laws_equals_the_full_rows(method):
    """Many rounds, drafts inside and outside the candidates, q near p (long acceptances) and far
    from it (corrections): the same (accepted, tokens, events) as over processed_law's full rows."""
    rng = np.random.default_rng(11)
    n = 3000
    n_accepted = n_corrected = 0
    for round_ in range(300):
        gamma = int(rng.integers(0, 6))
        base = rng.standard_normal(n).astype(np.float32) * 2
        logits = [base + rng.standard_normal(n).astype(np.float32) * 0.3 for _ in range(gamma + 1)]
        top_k, top_p, min_p = FILTERS[round_ % len(FILTERS)]
        T = float(rng.choice([0.5, 0.8, 1.2]))
        full = np.stack([spec.processed_law(z, T, top_k, top_p, min_p) for z in logits])
        laws = []
        for z in logits:
            cand = best_ids(z, top_k)
            laws.append(tuple(spec.candidate_law(cand, z[cand], T, top_k, top_p, min_p)))
        q = np.stack([softmax(z / T + rng.standard_normal(n).astype(np.float32) * (0.1 if round_ % 2 else 2))
                      for z in logits[:gamma]]) if gamma else np.zeros((0, n), np.float32)
        drafts = np.array([int(rng.choice(n, p=row / row.sum(dtype=np.float64))) for row in q], np.int32)
        seed, offset = int(rng.integers(0, 2**63)), int(rng.integers(0, 2**31))
        want = getattr(spec, f"verify_{method}")(full, q, drafts, seed, offset)
        got = spec.verify_candidates(method, laws, n, q, drafts, seed, offset)
        assert got[0] == want[0] and np.array_equal(got[1], want[1]) and got[2] == want[2], round_
        n_accepted += got[0]
        n_corrected += got[0] < gamma
    assert n_accepted > 100 and n_corrected > 50


def test_candidate_laws_are_checked():
    q = np.zeros((0, 10), np.float32)
    drafts = np.zeros(0, np.int32)
    for law, match in [(([3, 1], [0.5, 0.5]), "ascend"), (([1, 12], [0.5, 0.5]), "ascend"),
                       (([1, 2], [0.5, -0.1]), "finite"), (([1, 2], [0.0, 0.0]), "mass")]:
        with pytest.raises(ValueError, match=match):
            spec.verify_candidates("rejection", [law], 10, q, drafts, 1, 0)
    with pytest.raises(ValueError, match="rejection or block"):
        spec.verify_candidates("greedy", [([1], [1.0])], 10, q, drafts, 1, 0)


@pytest.mark.parametrize("method", ["rejection", "block"])
def test_draft_vocabulary_q_rows_verify_as_their_full_rows(method):
    """q rows of a drafter's reduced vocabulary (entries at its ascending d2t only, as DSpark
    drafters hand them to the engine) verify to the same tokens and events as the same rows
    spread over the whole vocabulary, with the target's candidates partly outside d2t."""
    rng = np.random.default_rng(12)
    n, w = 3000, 400
    n_accepted = 0
    for round_ in range(200):
        ids = np.sort(rng.choice(n, w, replace=False)).astype(np.int32)
        gamma = int(rng.integers(1, 5))
        base = rng.standard_normal(n).astype(np.float32) * 2
        base[ids] += 2.0  # the target favours the draft vocabulary, not only it
        logits = [base + rng.standard_normal(n).astype(np.float32) * 0.3 for _ in range(gamma + 1)]
        top_k, top_p, min_p = FILTERS[round_ % len(FILTERS)]
        laws = []
        for z in logits:
            cand = best_ids(z, top_k)
            laws.append(tuple(spec.candidate_law(cand, z[cand], 0.8, top_k, top_p, min_p)))
        q_sub = np.stack([softmax(z[ids] / 0.8 + rng.standard_normal(w).astype(np.float32) * 0.2)
                          for z in logits[:gamma]])
        q_full = np.zeros((gamma, n), np.float32)
        q_full[:, ids] = q_sub
        drafts = np.array([int(ids[rng.choice(w, p=r / r.sum(dtype=np.float64))]) for r in q_sub], np.int32)
        seed, offset = int(rng.integers(0, 2**63)), int(rng.integers(0, 2**31))
        want = spec.verify_candidates(method, laws, n, q_full, drafts, seed, offset)
        got = spec.verify_candidates(method, laws, n, q_sub, drafts, seed, offset, q_ids=ids)
        assert got[0] == want[0] and np.array_equal(got[1], want[1]) and got[2] == want[2], round_
        n_accepted += got[0]
    assert n_accepted > 50
    with pytest.raises(ValueError, match="ascend"):
        spec.verify_candidates(method, laws, n, q_sub, drafts, 1, 0, q_ids=ids[::-1].copy())
