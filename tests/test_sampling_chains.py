"""Backend sampling chains in the drafter graph (design.md invariant 1).

Every drafter pass carries n_seq_max x n_block chains (TOP_K candidates, their logits by GET_ROWS,
SOFTMAX probabilities, ARGMAX draw), each bound to a batch row by an input row index, and every
chain's outputs are pinned whether or not its sequence is in the batch. So the graph key, and the
allocation plan, do not depend on which sequence is drafted: drafting two sequences in separate
batches reuses one plan, and each still gets its own, correct candidates at every block position.
(Pinning only the drafted sequence's chains makes the key depend on the sequence: a second plan
is built and the plan-reuse assertions below fail; checked by hand.)
"""

from __future__ import annotations

import numpy as np
import pytest

from test_dflash import features, make_drafter, rewrite, target
from pyspec import _core


def numpy_topk(row, k):
    """Indices of the k largest, descending; equal values keep the lower index first."""
    return np.argsort(-row, kind="stable")[:k]


def check_chains(out, k):
    logits = out["logits"]
    n_block = logits.shape[0]
    assert out["candidates"].shape == (n_block, k)
    for i in range(n_block):
        row = logits[i]
        cand = out["candidates"][i]
        np.testing.assert_array_equal(cand, numpy_topk(row, k), err_msg=f"slot {i}")
        np.testing.assert_array_equal(out["candidate_logits"][i], row[cand])
        z = row[cand].astype(np.float64)
        p = np.exp(z - z.max())
        np.testing.assert_allclose(out["probs"][i], p / p.sum(), rtol=1e-5, atol=1e-7)
        assert out["tokens"][i] == cand[0] == np.argmax(row)
    # Distinct block positions keep distinct candidates (the allocator bug gives every position
    # of a sequence the same bytes).
    assert len({tuple(c) for c in out["candidates"]}) > 1


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("chains")


@pytest.mark.parametrize("kind", ["dflash", "dspark", "speculators"])
def test_two_sequences_in_separate_batches_share_one_plan(root, kind):
    tm, _, tmodel = target(root, "qwen3")
    _, path = make_drafter(root, f"chain-{kind}", tm, kind=kind, seed=71, draft_vocab=40)
    dm = _core.DraftModel(str(path), tmodel)
    k = 6
    n_block = dm.block_size
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, tm.n_vocab, 24)
    feats = features(tmodel, tokens, dm.target_layers)
    dc = _core.DraftContext(dm, n_seq_max=3, n_batch=64, n_threads=2, check_plans=True, n_candidates=k)
    assert dc.n_candidates == k
    # Different contexts, so the sequences draft different logits.
    dc.inject(0, np.arange(20, dtype=np.int32), feats[:20])
    dc.inject(1, np.arange(12, dtype=np.int32), feats[12:24])
    dc.inject(2, np.arange(9, dtype=np.int32), feats[3:12])

    out0 = dc.draft_logits(0, int(tokens[20]), 20, n_block)
    built, hits = dc.plans_built, dc.cache_hits
    out1 = dc.draft_logits(1, int(tokens[5]), 12, n_block)
    assert dc.plans_built == built, "drafting another sequence built a new plan"
    assert dc.cache_hits == hits + 1
    out2 = dc.draft_logits(2, int(tokens[9]), 9, n_block)
    again0 = dc.draft_logits(0, int(tokens[20]), 20, n_block)
    assert dc.plans_built == built and dc.cache_hits == hits + 3

    for out in (out0, out1, out2, again0):
        check_chains(out, k)
    assert not np.array_equal(out0["candidates"], out1["candidates"])
    assert not np.array_equal(out1["candidates"], out2["candidates"])
    for key in ("logits", "candidates", "candidate_logits", "probs", "tokens"):
        np.testing.assert_array_equal(again0[key], out0[key])
    if kind == "speculators":  # d2t: candidates are target ids of the draft vocabulary
        assert set(out0["candidates"].ravel()) <= set(dm.d2t)

    # A shorter block is another graph (its own plan), with the same per-slot chains.
    short = dc.draft_logits(1, int(tokens[5]), 12, n_block - 2)
    check_chains(short, k)
    np.testing.assert_array_equal(dc.draft_logits(2, int(tokens[9]), 9, n_block - 2)["logits"].shape,
                                  (n_block - 2, tm.n_vocab))
    assert dc.plans_built == built + 1


def test_candidate_count_is_checked(root):
    tm, _, tmodel = target(root, "qwen3")
    _, path = make_drafter(root, "chain-k", tm, kind="dflash", seed=72)
    dm = _core.DraftModel(str(path), tmodel)
    with pytest.raises(ValueError, match=r"n_candidates 0 must be in \[1, n_vocab"):
        _core.DraftContext(dm, n_seq_max=1, n_batch=64, n_threads=1, n_candidates=0)
    with pytest.raises(ValueError, match="must be in"):
        _core.DraftContext(dm, n_seq_max=1, n_batch=64, n_threads=1, n_candidates=tm.n_vocab + 1)
    # k = n_vocab: the candidates are the full sorted vocabulary.
    dc = _core.DraftContext(dm, n_seq_max=1, n_batch=64, n_threads=1, n_candidates=tm.n_vocab)
    feats = features(tmodel, np.arange(5, 10), dm.target_layers)
    dc.inject(0, np.arange(5, dtype=np.int32), feats)
    check_chains(dc.draft_logits(0, 3, 5, 4), tm.n_vocab)



def reduced_vocabulary_drafters(root, name, tm, seed, draft_vocab, perm_seed):
    """A DSpark drafter over a reduced vocabulary (ascending d2t, as the converter writes it) and
    the same drafter with its draft ids permuted (d2t, the head's and W2's rows alike)."""
    from pathlib import Path

    import gguf
    _, path = make_drafter(root, name, tm, kind="speculators", seed=seed, draft_vocab=draft_vocab)
    t = {x.name: np.array(x.data) for x in gguf.GGUFReader(str(path)).tensors}
    perm = np.random.default_rng(perm_seed).permutation(draft_vocab)
    permuted = rewrite(path, root / f"{name}-permuted.gguf",
                       drop_tensors=("d2t", "output.weight", "markov_w2.weight"),
                       add_tensors={"d2t": t["d2t"][perm], "output.weight": t["output.weight"][perm],
                                    "markov_w2.weight": t["markov_w2.weight"][perm]})
    return path, permuted


def test_reduced_vocabulary_chains_in_either_d2t_order(root):
    """With an ascending d2t (what the converter and pyspec-train-drafter write) the chains run
    over draft ids and the host maps their ids through d2t; in any other order they run over the
    scattered target-vocabulary row. The same drafter with its draft ids permuted (d2t, the head's
    and W2's rows alike) takes the other path: both must give the chains numpy gives over the
    target-vocabulary logits, and the same tokens and candidates as each other."""
    tm, _, tmodel = target(root, "qwen3")
    vd, k = 40, 5
    path, permuted = reduced_vocabulary_drafters(root, "chain-d2t", tm, seed=73, draft_vocab=vd, perm_seed=3)
    rng = np.random.default_rng(9)
    tokens = rng.integers(0, tm.n_vocab, 20)
    outs = []
    for p, ascending in ((path, True), (permuted, False)):
        dm = _core.DraftModel(str(p), tmodel)
        assert bool((np.diff(dm.d2t) > 0).all()) == ascending
        feats = features(tmodel, tokens, dm.target_layers)
        dc = _core.DraftContext(dm, n_seq_max=2, n_batch=64, n_threads=2, check_plans=True, n_candidates=k)
        dc.inject(0, np.arange(16, dtype=np.int32), feats[:16])
        out = dc.draft_logits(0, int(tokens[16]), 16, dm.block_size)
        check_chains(out, k)
        assert set(out["candidates"].ravel()) <= set(dm.d2t)
        outside = np.setdiff1d(np.arange(tm.n_vocab), dm.d2t)
        assert np.all(np.isneginf(out["logits"][:, outside]))
        outs.append(out)
    np.testing.assert_array_equal(outs[1]["tokens"], outs[0]["tokens"])
    np.testing.assert_array_equal(outs[1]["candidates"], outs[0]["candidates"])
    np.testing.assert_allclose(outs[1]["logits"], outs[0]["logits"], rtol=1e-5, atol=1e-5)


def test_reduced_vocabulary_sampled_draws_use_the_target_ids_noise(root):
    """At T > 0 a DSpark Markov slot over a reduced vocabulary draws argmax(z / T + g) with g the
    draft noise of the TARGET vocabulary at each draft id's target id (d2t), exactly as over the
    scattered row: the host draws that noise for the draft ids alone, in d2t's order, ascending
    or permuted."""
    tm, _, tmodel = target(root, "qwen3")
    path, permuted = reduced_vocabulary_drafters(root, "chain-d2t-sampled", tm, seed=74, draft_vocab=40,
                                                 perm_seed=4)
    tokens = np.random.default_rng(10).integers(0, tm.n_vocab, 20)
    T, seed = 0.7, 5
    inv = np.float32(1.0 / T)
    for p in (path, permuted):
        dm = _core.DraftModel(str(p), tmodel)
        feats = features(tmodel, tokens, dm.target_layers)
        dc = _core.DraftContext(dm, n_seq_max=1, n_batch=64, n_threads=2, check_plans=True)
        dc.inject(0, np.arange(16, dtype=np.int32), feats[:16])
        off, n_block = dm.draft_offset, dm.block_size
        for o in range(20):
            out = dc.draft_logits(0, int(tokens[16]), 16, n_block, temperature=T, seed=seed, offset=1000 + o)
            for k in range(n_block - off):
                i = off + k
                z = out["logits"][i].astype(np.float32) * inv
                g = _core.spec.gumbel(seed, 1000 + o, 16 + 1 + k, tm.n_vocab)
                assert out["tokens"][i] == int(np.argmax(z + g)), (str(p), o, k)
                assert out["tokens"][i] in set(dm.d2t)


@pytest.mark.parametrize("verify", ["rejection", "block"])
def test_reduced_vocabulary_sampled_engine_equals_the_python_loop(root, verify):
    """A DSpark drafter over a reduced vocabulary hands the engine its q rows over the draft ids
    alone (ascending d2t) or spread over the target vocabulary (permuted d2t); the engine's
    sampled requests (top-k: the target's law from the graph's candidates) give the tokens and
    draft statistics of LLM.generate's Python loop, which verifies full rows, for either drafter."""
    import pyspec
    from pyspec.sampling import SamplingParams
    from pyspec.speculative import SpecStats

    from pathlib import Path

    import gguf

    tm, target_path, _ = target(root, "qwen3")
    path, permuted = reduced_vocabulary_drafters(root, "engine-d2t", tm, seed=75, draft_vocab=300, perm_seed=5)

    def flattened(p, heads=("output.weight", "markov_w2.weight"), scale=0.02):
        """The model with its heads scaled down: flat laws, so drafts get accepted."""
        t = {x.name: np.array(x.data) for x in gguf.GGUFReader(str(p)).tensors}
        heads = [h for h in heads if h in t]
        return rewrite(p, root / f"flat-{Path(p).name}", drop_tensors=tuple(heads),
                       add_tensors={h: (t[h] * scale).astype(t[h].dtype) for h in heads})

    target_path = flattened(target_path, ("output.weight", "token_embd.weight"), 0.1)

    prompts = [[3, 17, 29, 3, 3], [100, 101, 102], list(range(40, 70))]
    T, seed, n = 1.0, 21, 24
    for drafter in (flattened(path), flattened(permuted)):
        llm = pyspec.LLM(str(target_path), n_ctx=256, n_threads=2, draft_model=str(drafter), draft_n_max=3,
                         verify=verify)
        accepted = 0
        for opts in (dict(top_k=64), dict(top_k=40, top_p=0.9, min_p=0.02)):
            res = llm.generate_many(prompts, max_tokens=n, temperature=T, seed=seed, ignore_eos=True, **opts)
            for i, (p, r) in enumerate(zip(prompts, res)):
                st = SpecStats()
                want = list(llm.speculative.tokens(p, SamplingParams(temperature=T, **opts), n, stats=st,
                                                   seed=seed + i))
                assert r.tokens == want, (str(drafter), opts, i)
                assert (r.draft_n, r.draft_n_accepted) == (st.draft_n, st.draft_n_accepted), (str(drafter), opts, i)
            accepted += sum(r.draft_n_accepted for r in res)
        assert accepted > 5, accepted
