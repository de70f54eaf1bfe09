"""The allocation planner: design.md invariant 1, graph-allocator.md §4.

A plan is only correct for the liveness it was computed from, and liveness depends on output
flags. These tests rebuild graphs the way a decode loop does (fresh graph per step, same node
count and sizes, different flags) and check every plan against the graph it is used with, using
a checker written here independently of the C++ check_plan.
"""

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyspec import _core as core

INF = float("inf")
# dtype -> (elements per block, bytes per block), as in csrc/core/dtype.h
UNIT = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "I32": (1, 4),
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
}
PLAIN = ["F32", "F16", "BF16", "I32"]
QUANT = ["Q8_0", "Q4_0", "Q4_1"]


# --------------------------------------------------------------------------------------------
# Independent checker (graph-allocator.md §4.3 invariants 1, 2 and 5)
# --------------------------------------------------------------------------------------------


def pad4(dims):
    return list(dims) + [1] * (4 - len(dims))


def py_nbytes(dtype, ne, nb):
    if any(n == 0 for n in ne):
        return 0
    blk, unit = UNIT[dtype]
    return ne[0] // blk * unit + sum((ne[d] - 1) * nb[d] for d in range(1, 4))


def contiguous_strides(dtype, ne):
    blk, unit = UNIT[dtype]
    nb1 = ne[0] // blk * unit
    return [unit, nb1, nb1 * ne[1], nb1 * ne[1] * ne[2]]


class Liveness:
    """Roots, owned tensors and [def, last] intervals, derived from the graph's edges and flags."""

    def __init__(self, g):
        n = g.size
        self.n = n
        self.root = list(range(n))
        self.size = [py_nbytes(g.dtype(i), g.shape(i), g.strides(i)) for i in range(n)]
        self.owned = [False] * n
        self.defn = [0] * n
        self.last = [0] * n
        for i in range(n):
            vs = g.view_src(i)
            if vs >= 0:
                self.root[i] = self.root[vs]
            self.owned[i] = vs < 0 and not g.is_external(i)
            leaf = g.op(i) == "NONE" or g.is_input(i)
            self.defn[i] = -1 if leaf else i
            self.last[i] = self.defn[i]
        for i in range(n):
            used = list(g.srcs(i))
            if g.view_src(i) >= 0:
                used.append(g.view_src(i))
            for s in used:
                r = self.root[s]
                if r != i:
                    self.last[r] = max(self.last[r], i)
        for i in range(n):
            if g.is_output(i) or g.is_pinned(i):
                self.last[self.root[i]] = INF

    def live_together(self, a, b):
        return max(self.defn[a], self.defn[b]) <= min(self.last[a], self.last[b])


def byte_range(lv, plan, t):
    off = plan.offsets[t]
    return off, off + lv.size[t]


def disjoint(r1, r2):
    return r1[1] <= r2[0] or r2[1] <= r1[0] or r1[0] == r1[1] or r2[0] == r2[1]


def py_check(g, plan):
    """All violations as (kind, ids) tuples; empty when the plan is valid for this graph."""
    lv = Liveness(g)
    out = []
    offs = plan.offsets
    if len(offs) != lv.n:
        return [("length", ())]
    in_root = [0] * lv.n
    for i in range(lv.n):
        if not lv.owned[i]:
            if offs[i] != -1:
                out.append(("offset_on_unowned", (i,)))
            vs = g.view_src(i)
            if vs >= 0:
                in_root[i] = in_root[vs] + g.view_offset(i)
                r = lv.root[i]
                if in_root[i] + lv.size[i] > lv.size[r]:
                    out.append(("view_outside_root", (i, r)))
            continue
        if offs[i] < 0:
            out.append(("no_offset", (i,)))
        elif offs[i] % plan.alignment:
            out.append(("misaligned", (i,)))
        elif offs[i] + lv.size[i] > plan.arena_bytes:
            out.append(("outside_arena", (i,)))
    # Sorted by offset, each tensor is compared with every later-starting tensor that begins
    # inside its bytes: that visits each byte-overlapping pair exactly once.
    placed = sorted((offs[i], i) for i in range(lv.n) if lv.owned[i] and lv.size[i] > 0 and offs[i] >= 0)
    for pos, (begin, x) in enumerate(placed):
        end = begin + lv.size[x]
        for other_begin, y in placed[pos + 1:]:
            if other_begin >= end:
                break
            if lv.live_together(x, y):
                out.append(("overlap", (min(x, y), max(x, y))))
    return sorted(out)


def named_ids(message):
    return {int(m) for m in re.findall(r"tensor (\d+) '", message)}


# --------------------------------------------------------------------------------------------
# §4.1 minimal reproduction
# --------------------------------------------------------------------------------------------


def build_minimal(active, flag_all):
    g = core.Graph()
    x = g.input("F32", [16, 2], "X")
    c = [[0, 0], [0, 0]]
    d = [[0, 0], [0, 0]]
    for s in range(2):
        for r in range(2):
            row = g.view(x, [16], [4], r * 16 * 4)
            c[s][r] = g.add_node("CPY", "F32", [16], [row], f"c{s}{r}")  # stands in for candidates
            d[s][r] = g.add_node("SUM", "F32", [1], [c[s][r]], f"d{s}{r}")  # its in-chain consumer
            if s == active or flag_all:
                g.set_output(c[s][r])
                g.set_output(d[s][r])
    return g, c, d


def assert_alone_in_its_bytes(g, plan, t):
    """t shares no byte with any owned tensor that is live at the same time."""
    lv = Liveness(g)
    assert lv.size[t] > 0
    for other in range(g.size):
        if other != t and lv.owned[other] and lv.live_together(t, other):
            assert disjoint(byte_range(lv, plan, t), byte_range(lv, plan, other)), (
                f"{g.name(t)} {byte_range(lv, plan, t)} overlaps {g.name(other)} {byte_range(lv, plan, other)}"
            )


def assert_active_pair_safe(g, plan, c, active):
    lv = Liveness(g)
    a, b = c[active]
    assert disjoint(byte_range(lv, plan, a), byte_range(lv, plan, b))
    assert_alone_in_its_bytes(g, plan, a)
    assert_alone_in_its_bytes(g, plan, b)
    assert py_check(g, plan) == []
    core.check_plan(g, plan)


@pytest.mark.parametrize("checking", [False, True])
def test_minimal_reproduction_second_sequence_keeps_distinct_candidates(checking):
    planner = core.AllocationPlanner()
    planner.checking = checking
    g0, c0, _ = build_minimal(0, flag_all=False)
    plan0 = planner.plan(g0)
    assert_active_pair_safe(g0, plan0, c0, 0)

    g1, c1, _ = build_minimal(1, flag_all=False)  # fresh graph, same shapes, other flags
    plan1 = planner.plan(g1)
    assert_active_pair_safe(g1, plan1, c1, 1)
    assert planner.plans_built == 2
    assert plan1.offsets == core.make_plan(g1).offsets


def test_minimal_reproduction_after_reserve():
    # llama.cpp reserves with a seq-0-active worst case and then allocates real graphs.
    planner = core.AllocationPlanner()
    planner.checking = True
    reserve, _, _ = build_minimal(0, flag_all=False)
    planner.plan(reserve)
    for active in (1, 0, 1, 1, 0):
        g, c, _ = build_minimal(active, flag_all=False)
        assert_active_pair_safe(g, planner.plan(g), c, active)
    assert planner.plans_built == 2
    assert planner.cache_hits == 4


def test_minimal_flag_all_is_one_plan_for_every_active_sequence():
    planner = core.AllocationPlanner()
    graphs = [build_minimal(active, flag_all=True) for active in (0, 1, 0)]
    plans = [planner.plan(g) for g, _, _ in graphs]
    assert planner.plans_built == 1 and planner.cache_hits == 2
    for (g, c, _), plan in zip(graphs, plans):
        for active in (0, 1):
            assert_active_pair_safe(g, plan, c, active)


def test_key_depends_on_output_flags_only_through_flags():
    k0 = core.graph_plan_key(build_minimal(0, False)[0])
    k1 = core.graph_plan_key(build_minimal(1, False)[0])
    assert k0 != k1
    assert core.graph_plan_key(build_minimal(0, True)[0]) == core.graph_plan_key(build_minimal(1, True)[0])


def test_reused_plan_detected_by_both_checkers():
    # The bug itself: seq 0's plan applied to seq 1's graph. Both checkers must see it.
    g0, _, _ = build_minimal(0, False)
    g1, c1, _ = build_minimal(1, False)
    stale = core.make_plan(g0)
    assert stale.offsets[c1[1][0]] == stale.offsets[c1[1][1]]  # the aliasing gallocr produced
    violations = py_check(g1, stale)
    assert ("overlap", (c1[1][0], c1[1][1])) in violations
    with pytest.raises(RuntimeError, match="overlaps") as err:
        core.check_plan(g1, stale)
    pair = named_ids(str(err.value))
    assert len(pair) == 2 and ("overlap", tuple(sorted(pair))) in violations


# --------------------------------------------------------------------------------------------
# §4.2 realistic reproduction: top-k sampling chains
# --------------------------------------------------------------------------------------------

V, K = 64, 8


def add_chain(g, logits, row, tag):
    """top_k -> get_rows -> scale -> soft_max -> cumsum -> sub(uniform) -> step -> sum -> clamp
    -> scale_bias -> cast -> get_rows(candidates). Our op set has no CUMSUM/STEP/CLAMP; unary
    stand-ins of the same shape and dtype give the planner the same sizes and edges."""
    row_view = g.view(logits, [V], [4], row * V * 4)
    cand = g.add_node("TOP_K", "I32", [K], [row_view], f"{tag}.candidates")
    picked = g.add_node("GET_ROWS", "F32", [K], [row_view, cand], f"{tag}.get_rows")
    logit = g.add_node("SCALE", "F32", [K], [picked], f"{tag}.logits")
    probs = g.add_node("SOFTMAX", "F32", [K], [logit], f"{tag}.probs")
    cum = g.add_node("SCALE", "F32", [K], [probs], f"{tag}.cumsum")
    uniform = g.input("F32", [1], f"{tag}.uniform")
    sub = g.add_node("ADD", "F32", [K], [cum, uniform], f"{tag}.sub")
    step = g.add_node("SILU", "F32", [K], [sub], f"{tag}.step")
    total = g.add_node("SUM", "F32", [1], [step], f"{tag}.sum")
    clamp = g.add_node("SCALE", "F32", [1], [total], f"{tag}.clamp")
    bias = g.add_node("SCALE", "F32", [1], [clamp], f"{tag}.scale_bias")
    idx = g.add_node("CPY", "I32", [1], [bias], f"{tag}.idx")
    sampled = g.add_node("GET_ROWS", "I32", [1], [cand, idx], f"{tag}.sampled")
    return {"sampled": sampled, "probs": probs, "logits": logit, "candidates": cand}


def build_sampling(n_seq, rows, active, topology, flag_all):
    """Topology 'a': a chain for every (seq, row). Topology 'b': the active sequence gets a
    chain per row, every inactive one a single chain on dummy row 0. Only the active
    sequence's chains are flagged unless flag_all (the design's fix)."""
    g = core.Graph()
    hidden = g.input("F32", [V, rows], "hidden")
    logits = g.add_node("SCALE", "F32", [V, rows], [hidden], "t_logits")
    g.set_output(logits)
    active_chains = []
    for s in range(n_seq):
        chain_rows = range(rows) if (topology == "a" or s == active) else [0]
        for r in chain_rows:
            chain = add_chain(g, logits, r, f"s{s}r{r}")
            if s == active or flag_all:
                for t in chain.values():
                    g.set_output(t)
            if s == active:
                active_chains.append(chain)
    return g, active_chains


ACTIVE_SCHEDULE = [0, 1, 0, 2, 1, 3, 2, 0, 3, 1]


@pytest.mark.parametrize("flag_all", [False, True])
@pytest.mark.parametrize("topology", ["a", "b"])
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("n_seq", [2, 3, 4])
def test_sampling_chains_keep_distinct_outputs(n_seq, rows, topology, flag_all):
    planner = core.AllocationPlanner(cache_capacity=4)
    schedule = [a % n_seq for a in ACTIVE_SCHEDULE]
    sizes, keys = set(), set()
    for active in schedule:
        g, chains = build_sampling(n_seq, rows, active, topology, flag_all)
        sizes.add(g.size)
        keys.add(tuple(core.graph_plan_key(g)))
        plan = planner.plan(g)
        assert py_check(g, plan) == []
        core.check_plan(g, plan)
        assert len({plan.offsets[c["candidates"]] for c in chains}) == rows
        lv = Liveness(g)
        outputs = [t for c in chains for t in c.values()]
        ranges = sorted(byte_range(lv, plan, t) for t in outputs)
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), "active chain outputs share bytes"
    assert len(sizes) == 1  # node count constant, as in the decode loop
    if flag_all and (topology == "a" or rows == 1):
        assert len(keys) == 1  # the design's fix: one plan for every active choice
    elif not flag_all:
        assert len(keys) == len(set(schedule))  # flags differ per active sequence
    # Every distinct key is planned once (the cache holds them all), then served from the cache.
    assert planner.plans_built == len(keys)
    assert planner.plans_built + planner.cache_hits == len(schedule)


@pytest.mark.parametrize("topology", ["a", "b"])
def test_sampling_stale_plan_is_caught(topology):
    # Negative control for the test above: reusing seq 0's plan for a seq-1-active graph is the
    # reported bug, and both checkers must reject it.
    n_seq = 3 if topology == "b" else 2
    g0, _ = build_sampling(n_seq, 4, 0, topology, False)
    g1, _ = build_sampling(n_seq, 4, 1, topology, False)
    assert g0.size == g1.size
    stale = core.make_plan(g0)
    assert any(kind == "overlap" for kind, _ in py_check(g1, stale))
    with pytest.raises(RuntimeError, match="overlaps"):
        core.check_plan(g1, stale)


# --------------------------------------------------------------------------------------------
# Unit tests of planning and caching
# --------------------------------------------------------------------------------------------


def test_chain_of_equal_tensors_needs_two_slots():
    g = core.Graph()
    t = g.input("F32", [100], "x")
    for i in range(20):
        t = g.add_node("SCALE", "F32", [100], [t], f"n{i}")
    g.set_output(t)
    plan = core.make_plan(g, 64)
    assert plan.arena_bytes == 2 * 448  # 400 bytes rounded up to 64
    assert py_check(g, plan) == []


def test_unconsumed_tensor_lives_only_at_its_def_and_sinks_flagged_output_persist():
    g = core.Graph()
    x = g.input("F32", [16], "x")
    dead = g.add_node("SCALE", "F32", [16], [x], "dead")  # consumed by nobody, not an output
    later = g.add_node("SILU", "F32", [16], [x], "later")
    kept = g.add_node("SCALE", "F32", [16], [later], "kept")
    g.set_output(kept)
    after = g.add_node("SILU", "F32", [16], [x], "after")
    plan = core.make_plan(g, 64)
    off = plan.offsets
    assert off[later] == off[dead]  # dead's bytes are free once it is computed
    assert len({off[x], off[later], off[kept]}) == 3
    assert off[after] not in (off[x], off[kept])  # x is still read by it, kept is an output
    assert py_check(g, plan) == []


def test_pinned_tensor_is_never_reused():
    g = core.Graph()
    x = g.input("F32", [16], "x")
    a = g.add_node("SCALE", "F32", [16], [x], "a")
    g.set_pinned(a)
    b = g.add_node("SILU", "F32", [16], [a], "b")
    c = g.add_node("SILU", "F32", [16], [b], "c")
    d = g.add_node("SILU", "F32", [16], [c], "d")
    plan = core.make_plan(g, 64)
    assert plan.offsets[a] not in {plan.offsets[t] for t in (x, b, c, d)}
    unpinned = core.Graph()
    x = unpinned.input("F32", [16], "x")
    a = unpinned.add_node("SCALE", "F32", [16], [x], "a")
    b = unpinned.add_node("SILU", "F32", [16], [a], "b")
    c = unpinned.add_node("SILU", "F32", [16], [b], "c")
    assert core.make_plan(unpinned, 64).offsets[c] == core.make_plan(unpinned, 64).offsets[a]


def test_view_keeps_root_alive_until_its_last_consumer():
    g = core.Graph()
    x = g.input("F32", [32], "x")
    a = g.add_node("SCALE", "F32", [32], [x], "a")
    v = g.view(a, [8], [4], 64)
    vv = g.view(v, [4], [4], 16)  # a view of a view
    b = g.add_node("SILU", "F32", [32], [x], "b")
    c = g.add_node("SILU", "F32", [32], [b], "c")
    s = g.add_node("SUM", "F32", [1], [vv], "s")
    g.set_output(s)
    assert g.root_of(vv) == a
    plan = core.make_plan(g, 64)
    assert plan.offsets[v] == plan.offsets[vv] == -1
    assert plan.offsets[a] not in (plan.offsets[x], plan.offsets[b], plan.offsets[c])
    assert py_check(g, plan) == []


def _overlap(plan, g, a, b):
    oa, ob = plan.offsets[a], plan.offsets[b]
    return oa < ob + g.nbytes(b) and ob < oa + g.nbytes(a)


def _matmuls_of_fresh_activations(g, n):
    """x (an input of 64), act = SCALE(x) and n MUL_MATs of act by their own 64 x 64 weights."""
    x = g.input("F32", [64], "x")
    act = g.add_node("SCALE", "F32", [64], [x], "act")
    return x, act, [g.add_node("MUL_MAT", "F32", [64], [g.external("F32", [64, 64], f"w{i}"), act], f"mm{i}")
                    for i in range(n)]


def test_sources_outlive_a_fusable_next_node():
    """A node's sources stay live through the next node when a backend may fuse the two: a
    MUL_MAT and the consumer of its product (CUDA's residual and SwiGLU epilogues store the
    consumer's output while the matmul still reads its activations), two ROPEs (one launch).
    Without the rule the second node takes the slot the first one's sources just freed."""
    g = core.Graph()
    x = g.input("F32", [64, 2], "x")
    w = g.external("F32", [64, 64], "w")
    act = g.add_node("SCALE", "F32", [64, 2], [x], "act")
    mm = g.add_node("MUL_MAT", "F32", [64, 2], [w, act], "mm")
    mmv = g.reshape(mm, [128])                      # consumed through a view
    res = g.reshape(x, [128])
    add = g.add_node("ADD", "F32", [128], [mmv, res], "add")
    g.set_output(add)
    plan = core.make_plan(g, 64)
    assert not _overlap(plan, g, add, act)
    assert py_check(g, plan) == []
    # gate and up read h; SWIGLU follows up: h must outlive it
    g = core.Graph()
    _, h, (gate, up) = _matmuls_of_fresh_activations(g, 2)
    glu = g.add_node("SWIGLU", "F32", [64], [gate, up], "glu")
    g.set_output(glu)
    plan = core.make_plan(g, 64)
    assert not _overlap(plan, g, glu, h)
    # two ROPEs in a row (q then k: one launch on CUDA): k's output must not take q's bytes
    g = core.Graph()
    q = g.add_node("SCALE", "F32", [8, 4, 1], [g.input("F32", [8, 4, 1], "xq")], "q")
    k = g.add_node("SCALE", "F32", [8, 2, 1], [g.input("F32", [8, 2, 1], "xk")], "k")
    pos = g.input("I32", [1], "pos")
    rq = g.add_node("ROPE", "F32", [8, 4, 1], [q, pos], "rq")
    rk = g.add_node("ROPE", "F32", [8, 2, 1], [k, pos], "rk")
    g.set_output(rq)
    g.set_output(rk)
    plan = core.make_plan(g, 64)
    assert not _overlap(plan, g, rk, q)
    assert py_check(g, plan) == []
    # a node that does not consume the product may reuse the activations' bytes as before
    g = core.Graph()
    x, act, (mm,) = _matmuls_of_fresh_activations(g, 1)
    other = g.add_node("SILU", "F32", [64], [x], "other")
    out = g.add_node("ADD", "F32", [64], [mm, other], "out")
    g.set_output(out)
    assert core.make_plan(g, 64).offsets[other] == core.make_plan(g, 64).offsets[act]


def test_norm_input_outlives_the_matmuls_that_take_the_norm_as_prologue():
    """An RMS_NORM read by the MUL_MATs right after it: the CUDA backend runs the norm inside their
    launch, which reads the norm's input while it stores the products, and stores the node after
    them (residual ADD, SWIGLU) as the epilogue. So neither the products nor that node may share
    bytes with the norm's input, even where the input dies at the norm (the final norm before the
    output head). Without the rule the first product took the input's bytes."""
    def norm_then(tail):
        g = core.Graph()
        x = g.input("F32", [64, 1], "x")
        h = g.add_node("RMS_NORM", "F32", [64, 1], [x, g.external("F32", [64], "nw")], "h")
        n_mm = {"group": 3, "glu": 2, "residual": 1, "head": 1}[tail]
        mms = [g.add_node("MUL_MAT", "F32", [64, 1], [g.external("F32", [64, 64], f"w{i}"), h], f"mm{i}")
               for i in range(n_mm)]
        if tail == "glu":
            outs = [g.add_node("SWIGLU", "F32", [64, 1], mms, "glu")]
        elif tail == "residual":
            outs = [g.add_node("ADD", "F32", [64, 1], [mms[0], g.input("F32", [64, 1], "r")], "add")]
        else:
            outs = mms
        for t in outs:
            g.set_output(t)
        return g, x, mms, outs

    for tail in ("group", "glu", "residual", "head"):
        g, x, mms, outs = norm_then(tail)
        plan = core.make_plan(g, 64)
        for t in mms + outs:
            assert not _overlap(plan, g, t, x), (tail, g.name(t))
        assert py_check(g, plan) == []
    # a node after the norm that is not one of its MUL_MATs may take the input's bytes as before
    g = core.Graph()
    x = g.input("F32", [64], "x")
    h = g.add_node("RMS_NORM", "F32", [64], [x, g.external("F32", [64], "nw")], "h")
    y = g.add_node("SILU", "F32", [64], [h], "y")
    g.set_output(y)
    plan = core.make_plan(g, 64)
    assert plan.offsets[y] == plan.offsets[x]


def test_decode_attention_chain_stays_live_through_the_attention():
    """A single-row ATTENTION over a ROPE's q and the K/V SET_ROWS before it (a decode step's layer):
    CUDA runs the q/k ROPEs, the SET_ROWS and the ATTENTION as one launch, which reads the ROPEs'
    and SET_ROWS' sources and writes the k ROPE's output while the attention's output is stored.
    So the output shares bytes with none of them. Without the rule it took the q norm's output (the
    q ROPE's source, dead at that ROPE), as in Qwen3's layers."""
    n_q, n_kv, hd, n_cells = 4, 2, 32, 64
    g = core.Graph()
    x = g.input("F32", [hd * n_q + 2 * hd * n_kv, 1], "x")
    xq = g.view(x, [hd, n_q, 1], [4, hd * 4, hd * n_q * 4], 0)
    xk = g.view(x, [hd, n_kv, 1], [4, hd * 4, hd * n_kv * 4], hd * n_q * 4)
    v = g.view(x, [hd * n_kv, 1], [4, hd * n_kv * 4], (hd * n_q + hd * n_kv) * 4)
    q = g.add_node("RMS_NORM", "F32", [hd, n_q, 1], [xq, g.input("F32", [hd], "wq")], "q_norm")
    k = g.add_node("RMS_NORM", "F32", [hd, n_kv, 1], [xk, g.input("F32", [hd], "wk")], "k_norm")
    pos, cells = g.input("I32", [1], "pos"), g.input("I32", [1], "cells")
    mask, base = g.input("F32", [70, 1], "mask"), g.input("I32", [1], "kv_base")
    rq = g.add_node("ROPE", "F32", [hd, n_q, 1], [q, pos], "rq")
    rk = g.add_node("ROPE", "F32", [hd, n_kv, 1], [k, pos], "rk")
    kc = g.external("F16", [hd * n_kv, n_cells], "k_cache")
    vc = g.external("F16", [hd * n_kv, n_cells], "v_cache")
    ks = g.set_rows(kc, g.reshape(rk, [hd * n_kv, 1]), cells)
    vs = g.set_rows(vc, v, cells)
    att = g.add_node("ATTENTION", "F32", [hd, n_q, 1], [rq, ks, vs, mask, base], "att")
    g.set_output(att)
    plan = core.make_plan(g, 64)
    for t in (q, k, rk, x, pos, cells, mask, base):
        assert not _overlap(plan, g, att, t), g.name(t)
    assert py_check(g, plan) == []


def test_output_view_pins_its_root():
    g = core.Graph()
    x = g.input("F32", [32], "x")
    a = g.add_node("SCALE", "F32", [32], [x], "a")
    v = g.view(a, [8], [4], 0)
    g.set_output(v)
    b = g.add_node("SILU", "F32", [32], [x], "b")
    c = g.add_node("SILU", "F32", [32], [b], "c")
    plan = core.make_plan(g, 64)
    assert plan.offsets[a] not in (plan.offsets[b], plan.offsets[c])
    assert py_check(g, plan) == []


def test_zero_size_tensors():
    g = core.Graph()
    x = g.input("F32", [0, 4], "empty")
    y = g.add_node("SCALE", "F32", [0, 4], [x], "empty2")
    z = g.add_node("SCALE", "F32", [8], [g.input("F32", [8], "w")], "z")
    g.set_output(y)
    g.set_output(z)
    plan = core.make_plan(g, 64)
    assert plan.offsets[x] == plan.offsets[y] == 0
    assert g.nbytes(x) == 0
    core.check_plan(g, plan)
    assert py_check(g, plan) == []


def test_set_rows_into_external_and_owned():
    g = core.Graph()
    cache = g.external("F16", [16, 8], "k_cache")
    rows = g.input("F32", [16, 2], "rows")
    ids = g.input("I32", [2], "ids")
    w = g.set_rows(cache, rows, ids)
    owned = g.add_node("SCALE", "F32", [16, 8], [rows], "scratch")
    w2 = g.set_rows(owned, rows, ids)
    s = g.add_node("SUM", "F32", [1], [w2], "s")
    g.set_output(s)
    g.set_output(w)
    plan = core.make_plan(g, 64)
    assert plan.offsets[cache] == plan.offsets[w] == plan.offsets[w2] == -1
    assert g.root_of(w2) == owned
    assert Liveness(g).last[owned] == s
    assert py_check(g, plan) == []
    core.check_plan(g, plan)


def test_alignment():
    g = core.Graph()
    a = g.input("F32", [3], "a")
    b = g.input("F16", [5], "b")
    c = g.add_node("ADD", "F32", [3], [a, a], "c")
    g.set_output(b)
    g.set_output(c)
    for align in (1, 4, 64, 256, 48):
        plan = core.make_plan(g, align)
        assert plan.alignment == align
        assert all(o % align == 0 for o in plan.offsets if o >= 0)
        assert py_check(g, plan) == []
    with pytest.raises(ValueError):
        core.make_plan(g, 0)
    with pytest.raises(ValueError):
        core.AllocationPlanner(alignment=0)


def base_graph(**changes):
    """A small graph; each keyword changes one property the key must see."""
    g = core.Graph()
    a = g.input(changes.get("dtype", "F32"), [8, 2], "a")
    b = g.input("F32", [8, 2], "b")
    ext = g.external("F32", [8, 4], "w")
    v = g.view(ext, [8, 2], changes.get("strides", [4, 32]), changes.get("view_offset", 0))
    srcs = changes.get("srcs", [a, b])
    op = g.add_node(changes.get("op", "ADD"), "F32", changes.get("shape", [8, 2]), srcs, changes.get("name", "op"))
    m = g.add_node("MUL", "F32", [8, 2], [op, v], "m")
    for flag in changes.get("flags", []):
        getattr(g, flag)(op)
    g.set_output(m)
    return g


def test_key_sees_everything_that_affects_liveness_or_sizes():
    key = core.graph_plan_key(base_graph())
    assert core.graph_plan_key(base_graph()) == key
    assert core.graph_plan_key(base_graph(name="renamed")) == key  # names are not part of it
    variants = {
        "op": {"op": "MUL"},
        "dtype": {"dtype": "F16"},
        "shape": {"shape": [4, 2]},
        "srcs": {"srcs": [1, 0]},
        "strides": {"strides": [4, 64]},
        "view_offset": {"view_offset": 32},
        "output": {"flags": ["set_output"]},
        "pinned": {"flags": ["set_pinned"]},
    }
    keys = {name: tuple(core.graph_plan_key(base_graph(**c))) for name, c in variants.items()}
    for name, k in keys.items():
        assert list(k) != key, name
    assert len(set(keys.values())) == len(keys)
    inp = core.Graph()
    inp.input("F32", [8], "x")
    ext = core.Graph()
    ext.external("F32", [8], "x")
    assert core.graph_plan_key(inp) != core.graph_plan_key(ext)


def test_cache_is_lru_and_compares_keys():
    planner = core.AllocationPlanner(cache_capacity=2)
    ga, gb, gc = base_graph(), base_graph(op="MUL"), base_graph(flags=["set_output"])
    pa = planner.plan(ga)
    planner.plan(gb)
    assert planner.plan(base_graph(name="other")).offsets == pa.offsets  # hit on A
    assert (planner.plans_built, planner.cache_hits) == (2, 1)
    planner.plan(gc)  # evicts B, the least recently used
    assert planner.cache_size == 2
    planner.plan(ga)
    assert (planner.plans_built, planner.cache_hits) == (3, 2)
    planner.plan(gb)
    assert (planner.plans_built, planner.cache_hits) == (4, 2)
    uncached = core.AllocationPlanner(cache_capacity=0)
    uncached.plan(ga)
    uncached.plan(ga)
    assert (uncached.plans_built, uncached.cache_hits, uncached.cache_size) == (2, 0, 0)


def test_checking_planner_rejects_nothing_valid_and_large_graph():
    # A decoder-shaped graph of ~10k tensors: residual stream, per-layer temporaries, outputs.
    g = core.Graph()
    h = g.input("F32", [64, 4], "h")
    w = g.external("Q8_0", [64, 64], "w")
    for layer in range(1300):
        n = g.add_node("RMS_NORM", "F32", [64, 4], [h], f"norm{layer}")
        q = g.add_node("MUL_MAT", "F32", [64, 4], [w, n], f"q{layer}")
        r = g.reshape(q, [256])
        s = g.add_node("SILU", "F32", [256], [r], f"silu{layer}")
        s2 = g.reshape(s, [64, 4])
        m = g.add_node("MUL", "F32", [64, 4], [s2, n], f"mul{layer}")
        h = g.add_node("ADD", "F32", [64, 4], [h, m], f"res{layer}")
        if layer % 100 == 0:
            g.set_pinned(g.add_node("SCALE", "F32", [64, 4], [h], f"capture{layer}"))
    g.set_output(h)
    assert g.size > 9000
    planner = core.AllocationPlanner()
    planner.checking = True
    plan = planner.plan(g)
    assert planner.plan(g).offsets == plan.offsets
    assert planner.cache_hits == 1
    # 13 pinned captures + the output + a handful of live temporaries.
    assert plan.arena_bytes <= (13 + 1 + 6) * 1024


def test_check_plan_reports_each_kind_of_violation():
    g = core.Graph()
    x = g.input("F32", [16], "x")
    a = g.add_node("SCALE", "F32", [16], [x], "a")
    v = g.view(a, [4], [4], 0)
    b = g.add_node("SUM", "F32", [1], [v], "b")
    g.set_output(b)
    good = core.make_plan(g, 64)
    core.check_plan(g, good)
    offs, arena = list(good.offsets), good.arena_bytes

    def bad(offsets, arena_bytes=arena, alignment=64):
        return core.AllocationPlan(offsets, arena_bytes, alignment)

    overlap = list(offs)
    overlap[a] = offs[x]
    with pytest.raises(RuntimeError, match="overlaps") as err:
        core.check_plan(g, bad(overlap))
    assert named_ids(str(err.value)) == {x, a}
    assert "'x'" in str(err.value) and "'a'" in str(err.value)
    misaligned = list(offs)
    misaligned[b] += 4
    with pytest.raises(RuntimeError, match="multiple of 64"):
        core.check_plan(g, bad(misaligned, arena + 64))
    with pytest.raises(RuntimeError, match="exceed the arena"):
        core.check_plan(g, bad(offs, arena - 1))
    with pytest.raises(RuntimeError, match="view or external"):
        core.check_plan(g, bad([o if i != v else 0 for i, o in enumerate(offs)]))
    with pytest.raises(RuntimeError, match="no offset"):
        core.check_plan(g, bad([o if i != a else -1 for i, o in enumerate(offs)]))
    with pytest.raises(RuntimeError, match="offsets for a graph"):
        core.check_plan(g, bad(offs[:-1]))
    assert ("overlap", (x, a)) in py_check(g, bad(overlap))


def test_binding_rejects_bad_input():
    g = core.Graph()
    x = g.input("F32", [4], "x")
    with pytest.raises(ValueError):
        g.input("F64", [4])
    with pytest.raises(ValueError):
        g.add_node("NOPE", "F32", [4], [x])
    with pytest.raises(ValueError):
        g.add_node("SCALE", "F32", [4], [5])
    with pytest.raises(ValueError):
        g.add_node("VIEW", "F32", [4], [x])
    with pytest.raises(ValueError):
        g.input("F32", [1, 1, 1, 1, 1])
    with pytest.raises(ValueError):
        g.input("Q8_0", [16])  # not a whole block
    with pytest.raises(RuntimeError):
        g.view(x, [8], [4], 0)  # larger than its source
    with pytest.raises(ValueError):
        g.view(x, [2], [4, 8], 0)
    assert g.size == len(g) == 1


# --------------------------------------------------------------------------------------------
# §4.3 property tests on random DAGs
# --------------------------------------------------------------------------------------------


def draw_view(draw, dtype, ne, nb):
    """A 1-D or 2-D strided view (shape, strides, offset) that fits inside a tensor's bytes."""
    blk, unit = UNIT[dtype]
    units = py_nbytes(dtype, ne, nb) // unit
    if units == 0 or draw(st.integers(0, 7)) == 0:
        return [0], [unit], draw(st.integers(0, units)) * unit
    if draw(st.booleans()):
        length = draw(st.integers(1, units))
        return [length * blk], [unit], draw(st.integers(0, units - length)) * unit
    width = draw(st.integers(1, units))
    height = draw(st.integers(1, max(1, units // width)))
    stride = width if height == 1 else draw(st.integers(width, (units - width) // (height - 1)))
    offset = draw(st.integers(0, units - width - (height - 1) * stride))
    return [width * blk, height], [unit, stride * unit], offset * unit


@st.composite
def dag_recipes(draw, max_ops=30):
    """Replayable steps of a random graph plus output and pinned flag sets."""
    steps, meta = [], []  # meta per id: (dtype, ne, nb)

    def add(step, dtype, ne, nb=None):
        ne = pad4(ne)
        steps.append(step)
        meta.append((dtype, ne, nb if nb is not None else contiguous_strides(dtype, ne)))

    dim = st.sampled_from([0, 1, 2, 3, 5, 8, 16])
    for _ in range(draw(st.integers(1, 3))):
        dtype, shape = draw(st.sampled_from(PLAIN)), draw(st.lists(dim, min_size=1, max_size=2))
        add(("input", dtype, shape), dtype, shape)
    ids_len = draw(st.sampled_from([0, 1, 2, 4]))
    add(("input", "I32", [ids_len]), "I32", [ids_len])
    for _ in range(draw(st.integers(0, 2))):
        dtype = draw(st.sampled_from(PLAIN + QUANT))
        shape = [UNIT[dtype][0] * draw(st.integers(1, 4)), draw(st.integers(1, 4))]
        add(("external", dtype, shape), dtype, shape)

    kinds = ["unary", "unary", "binary", "cpy", "sum", "get_rows", "view", "views", "reshape", "set_rows", "input"]
    for _ in range(draw(st.integers(1, max_ops))):
        kind = draw(st.sampled_from(kinds))
        src = draw(st.integers(0, len(meta) - 1))
        dtype, ne, nb = meta[src]
        if kind == "unary" or (kind == "reshape" and nb != contiguous_strides(dtype, ne)):
            op = draw(st.sampled_from(["SCALE", "SILU", "SOFTMAX"]))
            add(("node", op, "F32", ne, [src]), "F32", ne)
        elif kind == "binary":
            partners = [i for i, m in enumerate(meta) if m[1] == ne or m[1] == [ne[0], 1, 1, 1]]
            other = draw(st.sampled_from(partners))  # may be src itself: a repeated edge
            add(("node", draw(st.sampled_from(["ADD", "MUL"])), "F32", ne, [src, other]), "F32", ne)
        elif kind == "cpy":
            targets = PLAIN + (QUANT if ne[0] % 32 == 0 else [])
            out = draw(st.sampled_from(targets))
            add(("node", "CPY", out, ne, [src]), out, ne)
        elif kind == "sum":
            add(("node", "SUM", "F32", [1], [src]), "F32", [1])
        elif kind == "get_rows":
            ids = draw(st.sampled_from([i for i, m in enumerate(meta) if m[0] == "I32"]))
            shape = [ne[0], meta[ids][1][0]]
            add(("node", "GET_ROWS", "F32", shape, [src, ids]), "F32", shape)
        elif kind in ("view", "views"):
            for _ in range(1 if kind == "view" else draw(st.integers(2, 4))):
                shape, strides, offset = draw_view(draw, dtype, ne, nb)
                full_nb = strides + [0] * (4 - len(strides))
                full_ne = pad4(shape)
                for d in range(len(strides), 4):
                    full_nb[d] = full_nb[d - 1] * full_ne[d - 1]
                add(("view", src, shape, strides, offset), dtype, full_ne, full_nb)
        elif kind == "reshape":
            flat = [ne[0] * ne[1] * ne[2] * ne[3]]
            add(("reshape", src, flat), dtype, flat)
        elif kind == "set_rows":
            rows = draw(st.integers(0, len(meta) - 1))
            ids = draw(st.sampled_from([i for i, m in enumerate(meta) if m[0] == "I32"]))
            add(("set_rows", src, rows, ids), dtype, ne, nb)
        else:
            shape = draw(st.lists(dim, min_size=1, max_size=2))
            add(("input", "F32", shape), "F32", shape)

    n = len(steps)
    outputs = draw(st.sets(st.integers(0, n - 1), max_size=max(1, n // 3)))
    pinned = draw(st.sets(st.integers(0, n - 1), max_size=max(1, n // 6)))
    return steps, outputs, pinned


def build(steps, outputs=(), pinned=(), prefix="t"):
    g = core.Graph()
    for i, step in enumerate(steps):
        kind, name = step[0], f"{prefix}{i}"
        if kind == "input":
            tid = g.input(step[1], step[2], name)
        elif kind == "external":
            tid = g.external(step[1], step[2], name)
        elif kind == "node":
            tid = g.add_node(step[1], step[2], step[3], step[4], name)
        elif kind == "view":
            tid = g.view(step[1], step[2], step[3], step[4])
        elif kind == "reshape":
            tid = g.reshape(step[1], step[2])
        else:
            tid = g.set_rows(step[1], step[2], step[3])
        assert tid == i
    for t in outputs:
        g.set_output(t)
    for t in pinned:
        g.set_pinned(t)
    return g


PROPERTY = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(recipe=dag_recipes(), alignment=st.sampled_from([1, 16, 64, 100]))
def test_random_plans_satisfy_invariants(recipe, alignment):
    steps, outputs, pinned = recipe
    g = build(steps, outputs, pinned)
    lv = Liveness(g)
    assert [g.nbytes(i) for i in range(g.size)] == lv.size
    plan = core.make_plan(g, alignment)
    assert py_check(g, plan) == []
    core.check_plan(g, plan)
    aligned = sum(-(-lv.size[i] // alignment) * alignment for i in range(g.size) if lv.owned[i])
    assert plan.arena_bytes <= aligned  # never worse than giving every tensor its own bytes
    planner = core.AllocationPlanner(alignment=alignment)
    planner.checking = True
    assert planner.plan(g).offsets == plan.offsets


@PROPERTY
@given(recipe=dag_recipes(), data=st.data())
def test_check_plan_catches_any_overlap_of_live_tensors(recipe, data):
    steps, outputs, pinned = recipe
    g = build(steps, outputs, pinned)
    lv = Liveness(g)
    plan = core.make_plan(g, 64)
    pairs = [
        (x, y)
        for x in range(g.size)
        for y in range(g.size)
        if x != y and lv.owned[x] and lv.owned[y] and lv.size[x] and lv.size[y] and lv.live_together(x, y)
    ]
    if not pairs:
        return
    x, y = data.draw(st.sampled_from(pairs))
    offsets = list(plan.offsets)
    offsets[y] = offsets[x]  # move y onto x: they are live together, so this must be caught
    arena = max(plan.arena_bytes, offsets[y] + lv.size[y])
    corrupt = core.AllocationPlan(offsets, arena, 64)
    violations = py_check(g, corrupt)
    assert ("overlap", tuple(sorted((x, y)))) in violations
    with pytest.raises(RuntimeError, match="overlaps") as err:
        core.check_plan(g, corrupt)
    named = named_ids(str(err.value))
    assert ("overlap", tuple(sorted(named))) in violations


@PROPERTY
@given(recipe=dag_recipes(), data=st.data())
def test_permuted_output_flags_replan_or_still_valid(recipe, data):
    # §4.3 invariant 3: same shapes and edges, output flags moved to other tensors.
    steps, outputs, pinned = recipe
    g = build(steps, outputs, pinned)
    planner = core.AllocationPlanner(cache_capacity=4)
    planner.plan(g)
    built = planner.plans_built
    order = data.draw(st.permutations(range(g.size)))
    moved = set(order[: len(outputs)])
    g2 = build(steps, moved, pinned)
    plan2 = planner.plan(g2)
    replanned = planner.plans_built > built
    assert replanned or py_check(g2, plan2) == []
    # Stronger, for this planner: flags are in the key, so a different flag set always
    # re-plans, and what comes back equals a fresh plan of g2.
    assert py_check(g2, plan2) == []
    assert replanned == (core.graph_plan_key(g2) != core.graph_plan_key(g))
    assert plan2.offsets == core.make_plan(g2, 64).offsets


@PROPERTY
@given(recipe=dag_recipes())
def test_same_graph_same_plan_and_identical_rebuild_hits_cache(recipe):
    # §4.3 invariant 4.
    steps, outputs, pinned = recipe
    g = build(steps, outputs, pinned)
    first = core.make_plan(g, 64)
    assert core.make_plan(g, 64).offsets == first.offsets
    planner = core.AllocationPlanner()
    planner.checking = True
    p1 = planner.plan(g)
    rebuilt = build(steps, outputs, pinned, prefix="other_name_")
    p2 = planner.plan(rebuilt)
    assert (planner.plans_built, planner.cache_hits) == (1, 1)
    assert p2.offsets == p1.offsets == first.offsets
    assert p2.key_hash == p1.key_hash == first.key_hash
