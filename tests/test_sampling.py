"""Host sampling: llama.cpp's chain (top-k -> top-p -> min-p -> temperature -> draw), checked
against a plain numpy reference and, for the draws, by chi-square tests."""

import math

import numpy as np
import pytest

from pyspec.sampling import Sampler, SamplingParams


def chi2_pvalue(statistic: float, dof: int) -> float:
    """Upper-tail p-value of a chi-square statistic by the Wilson-Hilferty approximation:
    (X/k)^(1/3) is close to normal with mean 1 - 2/(9k) and variance 2/(9k). For dof >= 3 it is
    within ~15% (relative) of the exact tail down to p = 1e-3, plenty for thresholds of 1e-3."""
    v = 2.0 / (9.0 * dof)
    z = ((statistic / dof) ** (1.0 / 3.0) - (1.0 - v)) / math.sqrt(v)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def chi2_test(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """p-value that `counts` were drawn from `probs`; cells expecting fewer than `min_expected`
    draws are pooled into one cell so the chi-square approximation holds."""
    counts = np.asarray(counts, dtype=np.float64)
    n = counts.sum()
    expected = np.asarray(probs, dtype=np.float64) * n
    small = expected < min_expected
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    stat = float(((counts - expected) ** 2 / expected).sum())
    return chi2_pvalue(stat, len(counts) - 1)


def reference_candidates(logits, top_k, top_p, min_p):
    """llama.cpp's filters written out plainly: full stable sort by (-logit, id), then each stage
    on what the previous one kept."""
    z = np.asarray(logits, dtype=np.float64)
    order = sorted(range(len(z)), key=lambda i: (-z[i], i))
    if top_k > 0:
        order = order[:top_k]
    if top_p < 1.0:
        kz = np.array([z[i] for i in order])
        p = np.exp(kz - kz.max())
        p /= p.sum()
        cum, keep = 0.0, len(order)
        for i, pi in enumerate(p):
            cum += pi
            if cum >= top_p:
                keep = i + 1
                break
        order = order[:keep]
    if min_p > 0.0:
        best = z[order[0]]
        order = [i for i in order if z[i] >= best + math.log(min_p)]
    return order


def draw_counts(sampler, logits, n_draws):
    counts = np.zeros(len(logits), dtype=np.int64)
    for _ in range(n_draws):
        counts[sampler.sample(logits)] += 1
    return counts


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_chi2_pvalue_approximation():
    # Tabulated chi-square quantiles: P(X > x) for (x, dof).
    table = [(7.815, 3, 0.05), (23.209, 10, 0.01), (124.342, 100, 0.05), (16.266, 3, 0.001)]
    for x, dof, p in table:
        assert chi2_pvalue(x, dof) == pytest.approx(p, rel=0.15)
    scipy_stats = pytest.importorskip("scipy.stats")
    for x, dof in [(5.0, 4), (40.0, 30), (300.0, 250), (12.0, 3)]:
        assert chi2_pvalue(x, dof) == pytest.approx(scipy_stats.chi2.sf(x, dof), rel=0.05, abs=1e-4)


def test_defaults_are_llama_cpp_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed) == (0.8, 40, 0.95, 0.05, None)
    assert Sampler(p).stages == ("top-k", "top-p", "min-p", "temperature", "dist")


def test_disabled_stages_do_not_run():
    assert Sampler(SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0)).stages == \
        ("temperature", "dist")
    assert Sampler(SamplingParams(top_k=-1, top_p=0.9, min_p=0.0)).stages == \
        ("top-p", "temperature", "dist")
    assert Sampler(SamplingParams(temperature=0.0)).stages == ("greedy",)


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_greedy_is_argmax(temperature):
    rng = np.random.default_rng(0)
    s = Sampler(SamplingParams(temperature=temperature, seed=1))
    for _ in range(50):
        logits = rng.normal(size=1000).astype(np.float32)
        assert s.sample(logits) == int(np.argmax(logits))
    tied = np.array([0.0, 3.0, 1.0, 3.0], dtype=np.float32)
    assert s.sample(tied) == 1


def test_hand_made_candidate_sets():
    logits = np.log(np.array([0.05, 0.40, 0.03, 0.25, 0.15, 0.10, 0.02]))
    def ids(**kw):
        return Sampler(SamplingParams(temperature=1.0, **kw)).candidates(logits)[0].tolist()
    assert ids(top_k=2, top_p=1.0, min_p=0.0) == [1, 3]
    assert ids(top_k=0, top_p=0.85, min_p=0.0) == [1, 3, 4, 5]         # 0.40+0.25+0.15+0.10
    assert ids(top_k=0, top_p=0.0, min_p=0.0) == [1]
    assert ids(top_k=0, top_p=1.0, min_p=0.3) == [1, 3, 4]             # p >= 0.3 * 0.40
    # top-p renormalises over top-k's survivors: of {0.40, 0.25, 0.15} 0.40+0.25 is 0.8125.
    assert ids(top_k=3, top_p=0.8, min_p=0.0) == [1, 3]
    assert ids(top_k=3, top_p=0.82, min_p=0.0) == [1, 3, 4]


@pytest.mark.parametrize("n_vocab", [7, 300, 5000])
def test_candidate_sets_match_the_numpy_reference(n_vocab):
    rng = np.random.default_rng(n_vocab)
    for case in range(60):
        scale = [0.3, 1.0, 3.0, 8.0][case % 4]
        logits = (rng.normal(size=n_vocab) * scale).astype(np.float32)
        if case % 5 == 0:
            logits[rng.integers(n_vocab, size=n_vocab // 3)] = logits.max()   # ties
        top_k = int(rng.choice([0, 1, 5, 40, n_vocab + 3]))
        top_p = float(rng.choice([1.0, 0.95, 0.5, 0.99, 0.0]))
        min_p = float(rng.choice([0.0, 0.05, 0.2, 1.0]))
        s = Sampler(SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p, seed=0))
        ids, probs = s.candidates(logits)
        ref = reference_candidates(logits, top_k, top_p, min_p)
        if top_k <= 0 and top_p >= 1.0 and min_p <= 0.0:
            ref = list(range(n_vocab))
        assert ids.tolist() == ref, (case, top_k, top_p, min_p)
        z = logits.astype(np.float64)[ref] / 0.7
        np.testing.assert_allclose(probs, softmax(z), rtol=1e-10)


def test_sampling_from_the_best_ids_draws_what_the_whole_row_draws():
    """Sampler.sample_best (a row's best k ids in TOP_K's order and their logits, 1 <= top_k <= k)
    makes the same draws as sample() over the whole row, seed for seed, ties and -0 included."""
    rng = np.random.default_rng(21)
    for case in range(200):
        n_vocab = int(rng.choice([50, 300, 4000]))
        logits = (rng.normal(size=n_vocab) * 3).astype(np.float32)
        if case % 4 == 0:
            logits = (np.round(logits * 2) / 2).astype(np.float32)  # ties among the best
        if case % 7 == 0:
            logits[rng.integers(n_vocab, size=8)] = np.float32(-0.0)
        top_k = int(rng.choice([1, 5, 40]))
        k = min(n_vocab, top_k + int(rng.integers(0, 10)))
        idx = np.arange(n_vocab)
        best = np.lexsort((idx, -logits.astype(np.float64)))[:k]
        params = SamplingParams(temperature=float(rng.choice([0.5, 0.9, 1.4])), top_k=top_k,
                                top_p=float(rng.choice([1.0, 0.9, 0.5])), min_p=float(rng.choice([0.0, 0.05])),
                                seed=case)
        whole, part = Sampler(params), Sampler(params)
        for _ in range(5):
            assert part.sample_best(best, logits[best]) == whole.sample(logits), case
    with pytest.raises(ValueError, match="top_k"):
        Sampler(SamplingParams(temperature=0.8, top_k=0)).sample_best(best, logits[best])


def test_draws_follow_the_renormalised_distribution():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=200) * 2.0
    s = Sampler(SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, seed=123))
    ids, probs = s.candidates(logits)
    assert 3 < len(ids) < 20
    counts = draw_counts(s, logits, 20000)
    outside = np.setdiff1d(np.arange(len(logits)), ids)
    assert counts[outside].sum() == 0
    assert chi2_test(counts[ids], probs) > 1e-3
    # The test can tell: the same draws are far from the unfiltered distribution.
    assert chi2_test(counts, softmax(logits / 0.9)) < 1e-6


def test_temperature_only_draws_match_the_full_softmax():
    # One dominant token and a long tail of small ones: any top-k/top-p/min-p cut (even llama.cpp's
    # defaults) would remove the tail, which here holds ~10% of the mass.
    logits = np.concatenate([[6.0], np.linspace(-1.0, 1.0, 99)])
    T = 1.3
    s = Sampler(SamplingParams(temperature=T, top_k=0, top_p=1.0, min_p=0.0, seed=2024))
    expected = softmax(logits / T)
    assert expected[1:].sum() > 0.1
    counts = draw_counts(s, logits, 20000)
    assert chi2_test(counts, expected) > 1e-3
    tail = counts[1:].sum() / counts.sum()
    assert tail == pytest.approx(expected[1:].sum(), abs=0.01)
    default = Sampler(SamplingParams(temperature=T, seed=2024))
    assert draw_counts(default, logits, 2000)[1:].sum() < 2000 * expected[1:].sum() / 2


def test_seeds_reproduce_and_differ():
    rng = np.random.default_rng(3)
    rows = [rng.normal(size=500) * 3 for _ in range(64)]
    def run(seed):
        s = Sampler(SamplingParams(seed=seed, top_k=0, top_p=0.99, min_p=0.0))
        return [s.sample(r) for r in rows], s.seed
    a, seed_a = run(42)
    assert seed_a == 42 and run(42)[0] == a
    assert run(43)[0] != a
    random_1, seed_1 = run(None)
    assert 0 <= seed_1 < 2 ** 32 and run(seed_1)[0] == random_1
    assert len({Sampler(SamplingParams(seed=-1)).seed for _ in range(4)}) > 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=2.5), "top_k"),
    (dict(seed=-5), "seed"),
])
def test_invalid_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
