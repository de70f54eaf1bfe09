"""The draft state registry (design.md invariants 3 and 4): request id -> drafter slot.

Random schedules of add / step (a subset scheduled, rows permuted) / pause / resume / finish /
cancel events run against an independent model of the rules written here, through three
registries in lockstep: rows in one random order, rows in another, and the per-request API
(touch the holders, then acquire the others by ascending id). Hand-written scenarios cover the
issue's cases and the errors.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyspec._core import DraftStateRegistry

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class ModelRegistry:
    """The rules, stated plainly: holders keep their slot; a request without one takes the lowest
    free slot, else the slot of the holder with the oldest last scheduled step (ties: smallest id)
    among those not scheduled in this step, which is parked; requests of a step are served
    holders first, then by ascending id."""

    def __init__(self, n_slots):
        self.n_slots = n_slots
        self.slot = {}  # holders: id -> slot
        self.last = {}  # holders and parked: id -> last scheduled step
        self.parked = set()

    def step(self, step, ids):
        scheduled = set(ids)
        out = {}
        for i in ids:
            if i in self.slot:
                self.last[i] = step
                out[i] = (self.slot[i], False, False, None)
        for i in sorted(i for i in ids if i not in self.slot):
            free = sorted(set(range(self.n_slots)) - set(self.slot.values()))
            evicted = None
            if free:
                s = free[0]
            else:
                victim = min((h for h in self.slot if h not in scheduled), key=lambda h: (self.last[h], h))
                s = self.slot.pop(victim)
                self.parked.add(victim)
                evicted = victim
            restage = i in self.parked
            self.parked.discard(i)
            self.slot[i] = s
            self.last[i] = step
            out[i] = (s, True, restage, evicted)
        return out

    def release(self, i):
        self.last.pop(i, None)
        self.parked.discard(i)
        return self.slot.pop(i, -1)


def grant_tuple(g):
    return (g.slot, g.fresh, g.restage, g.evicted)


def schedule_one_by_one(reg, step, ids):
    """The per-request API used as the docs say: holders first, then the rest by ascending id."""
    out = {}
    for i in ids:
        if reg.slot_of(i) is not None:
            reg.touch(i, step)
            out[i] = (reg.slot_of(i), False, False, None)
    for i in sorted(i for i in ids if i not in out):
        out[i] = grant_tuple(reg.acquire(i, step))
    return out


def assert_state(regs, model, pool):
    for reg in regs:
        assert reg.n_slots == model.n_slots
        assert len(reg) == reg.size() == len(model.last)
        assert reg.parked() == sorted(model.parked)
        assert reg.n_held == len(model.slot)
        for s in range(model.n_slots):
            expected = [i for i, t in model.slot.items() if t == s]
            assert reg.holder_of(s) == (expected[0] if expected else None)
        for i in pool:
            assert reg.slot_of(i) == model.slot.get(i)
            assert reg.last_step(i) == model.last.get(i)
        # no two live requests share a slot
        slots = [reg.slot_of(i) for i in pool if reg.slot_of(i) is not None]
        assert len(slots) == len(set(slots))


EVENTS = ["add", "step", "step", "step", "step", "pause", "resume", "finish", "cancel", "cancel_unknown"]


@PROPERTY
@given(n_slots=st.integers(1, 4), data=st.data())
def test_random_schedules_follow_the_rules(n_slots, data):
    pool = data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=10, max_size=10, unique=True), label="ids")
    regs = [DraftStateRegistry(n_slots) for _ in range(3)]
    model = ModelRegistry(n_slots)
    unused = list(pool)
    live, paused, ended = [], set(), set()
    step = 0
    for _ in range(data.draw(st.integers(1, 40), label="n_events")):
        kind = data.draw(st.sampled_from(EVENTS), label="event")
        before = {i: regs[0].slot_of(i) for i in pool}
        evicted_now = set()
        if kind == "add" and unused:
            live.append(unused.pop(0))  # a new request holds nothing until it is scheduled
        elif kind == "step":
            step += data.draw(st.integers(1, 3), label="step gap")
            ready = [i for i in live if i not in paused]
            k = data.draw(st.integers(0, min(n_slots, len(ready))), label="n scheduled")
            chosen = data.draw(st.permutations(ready), label="rows")[:k]
            other_rows = data.draw(st.permutations(chosen), label="other rows")
            parked_before = set(regs[0].parked())
            expected = model.step(step, chosen)
            got = [
                {g.request_id: grant_tuple(g) for g in regs[0].schedule(step, chosen)},
                {g.request_id: grant_tuple(g) for g in regs[1].schedule(step, other_rows)},
                schedule_one_by_one(regs[2], step, chosen),
            ]
            # grants depend on ids and the step only: rows in any order, or one request at a time
            for g in got:
                assert g == expected
            for i in chosen:
                slot, fresh, restage, evicted = expected[i]
                assert fresh == (before[i] is None)
                assert restage == (i in parked_before)
                if not fresh:
                    assert slot == before[i]
                if evicted is not None:
                    evicted_now.add(evicted)
            # a request scheduled in this step is never evicted by a peer of the same step
            assert not (evicted_now & set(chosen))
            assert all(regs[0].slot_of(i) is not None for i in chosen)
        elif kind == "pause" and live:
            paused.add(data.draw(st.sampled_from(live), label="pause"))
        elif kind == "resume" and paused:
            paused.discard(data.draw(st.sampled_from(sorted(paused)), label="resume"))
        elif kind in ("finish", "cancel") and live:
            i = data.draw(st.sampled_from(live), label=kind)
            live.remove(i)
            paused.discard(i)
            ended.add(i)
            expected_slot = model.release(i)
            for reg in regs:
                assert reg.release(i) == expected_slot
                assert reg.release(i) == -1  # a second release is a no-op
        elif kind == "cancel_unknown" and (unused or ended):
            i = data.draw(st.sampled_from(unused + sorted(ended)), label="cancel unknown")
            for reg in regs:
                assert reg.release(i) == -1
        # a holder keeps its slot until it is evicted or released
        for i, s in before.items():
            now = regs[0].slot_of(i)
            if s is not None and now != s:
                assert now is None and (i in evicted_now or i in ended)
        assert_state(regs, model, pool)

    for i in live:
        model.release(i)
        for reg in regs:
            reg.release(i)
    for reg in regs:
        assert len(reg) == 0 and reg.n_held == 0 and reg.parked() == []
        assert all(reg.holder_of(s) is None for s in range(n_slots))


def test_requests_finishing_out_of_order_keep_the_others_slots():
    reg = DraftStateRegistry(4)
    ids = [101, 7, 55, 2**63 + 3]
    first = {g.request_id: g.slot for g in reg.schedule(0, ids)}
    assert sorted(first.values()) == [0, 1, 2, 3]
    # ascending ids take ascending free slots, whatever the rows
    assert [first[i] for i in sorted(ids)] == [0, 1, 2, 3]

    # 55 finishes first; the survivors are compacted into rows 0..2 in a new order
    assert reg.release(55) == first[55]
    rows = [2**63 + 3, 101, 7]
    grants = reg.schedule(1, rows)
    assert [g.slot for g in grants] == [first[i] for i in rows]
    assert not any(g.fresh or g.evicted is not None for g in grants)

    # a new request fills the hole; a prefill-only step (nobody drafts) frees nothing
    newcomer = reg.acquire(900, 2)
    assert (newcomer.slot, newcomer.fresh, newcomer.restage, newcomer.evicted) == (first[55], True, False, None)
    assert reg.schedule(3, []) == []
    assert [reg.slot_of(i) for i in rows] == [first[i] for i in rows]

    # the oldest request finishes next, then the newest; every step drafts every scheduled request
    reg.release(2**63 + 3)
    for step, rows in [(4, [900, 7, 101]), (5, [101, 900, 7])]:
        grants = reg.schedule(step, rows)
        assert len(grants) == len(rows)
        assert all(not g.fresh for g in grants)
        assert reg.slot_of(7) == first[7] and reg.slot_of(101) == first[101]
    reg.release(900)
    assert [g.slot for g in reg.schedule(6, [7, 101])] == [first[7], first[101]]
    reg.release(7)
    reg.release(101)
    assert len(reg) == 0 and reg.parked() == [] and reg.n_held == 0


def test_paused_request_keeps_its_slot_while_others_come_and_go():
    reg = DraftStateRegistry(2)
    a = reg.acquire(1, 0).slot
    for step in range(1, 20):
        other = 100 + step
        assert reg.acquire(other, step).evicted is None  # the free slot is reused, 1 is not touched
        reg.release(other)
        assert reg.slot_of(1) == a
    assert reg.last_step(1) == 0
    g = reg.acquire(1, 20)
    assert (g.slot, g.fresh, g.restage) == (a, False, False)


def test_more_requests_than_slots_reclaim_the_least_recently_scheduled():
    reg = DraftStateRegistry(2)
    reg.acquire(10, 0)  # slot 0
    reg.acquire(20, 1)  # slot 1
    g = reg.acquire(30, 2)
    assert (g.slot, g.fresh, g.restage, g.evicted) == (0, True, False, 10)
    assert reg.parked() == [10] and reg.slot_of(10) is None and len(reg) == 3

    # 10 returns: 20 (step 1) is older than 30 (step 2), so 20 loses slot 1; 10 must restage
    g = reg.acquire(10, 3)
    assert (g.slot, g.fresh, g.restage, g.evicted) == (1, True, True, 20)
    assert reg.parked() == [20]
    assert reg.last_step(20) == 1  # a parked request remembers when it last ran

    # a tie on the last step goes to the smaller id
    reg.schedule(4, [30, 10])
    g = reg.acquire(20, 5)
    assert (g.slot, g.restage, g.evicted) == (1, True, 10)

    # a parked request that is cancelled leaves no trace
    assert reg.release(10) == -1
    assert reg.parked() == [] and len(reg) == 2


def test_a_request_of_the_step_is_never_reclaimed_by_a_peer():
    reg = DraftStateRegistry(2)
    reg.acquire(1, 0)  # slot 0, last step 0: the least recently scheduled
    reg.acquire(2, 1)  # slot 1
    # 1 is in this step's batch, so the newcomer must take 2's slot although 1 is older
    grants = reg.schedule(2, [3, 1])
    assert [(g.request_id, g.slot, g.fresh, g.evicted) for g in grants] == [(3, 1, True, 2), (1, 0, False, None)]

    # a lone acquire protects what is already marked at this step: 1 and 3 both ran at step 2
    with pytest.raises(ValueError, match="drafter slots"):
        reg.acquire(4, 2)
    assert reg.parked() == [2] and reg.holder_of(0) == 1 and reg.holder_of(1) == 3
    reg.touch(3, 3)  # 3 runs at step 3, so at step 3 only 1 can be reclaimed
    g = reg.acquire(4, 3)
    assert (g.slot, g.evicted) == (0, 1)

    # a later call for the same step counts the earlier calls' requests as scheduled too: 3 runs
    # at step 4 and 4 is in this call, so 5 has no slot to take
    reg.touch(3, 4)
    with pytest.raises(ValueError, match="drafter slots"):
        reg.schedule(4, [4, 5])
    assert [reg.holder_of(0), reg.holder_of(1)] == [4, 3] and reg.parked() == [1, 2]
    assert reg.last_step(4) == 3 and reg.last_step(3) == 4


def test_errors_are_clear_and_change_nothing():
    with pytest.raises(ValueError, match="n_slots"):
        DraftStateRegistry(0)
    reg = DraftStateRegistry(2)
    reg.schedule(5, [1, 2])
    with pytest.raises(ValueError, match="only 2 drafter slots"):
        reg.schedule(6, [1, 2, 3])
    with pytest.raises(ValueError, match="twice"):
        reg.schedule(6, [3, 3])
    with pytest.raises(ValueError, match="backwards"):
        reg.schedule(4, [1])
    with pytest.raises(ValueError, match="backwards"):
        reg.touch(1, 4)
    with pytest.raises(ValueError, match="holds no drafter slot"):
        reg.touch(3, 6)
    with pytest.raises(IndexError):
        reg.holder_of(2)
    # nothing moved: the refused steps neither advanced time nor evicted anyone
    assert [reg.holder_of(0), reg.holder_of(1)] == [1, 2]
    assert reg.last_step(1) == reg.last_step(2) == 5 and reg.parked() == []
    reg.schedule(5, [2])  # step 5 is still allowed, nothing went forward
    assert reg.release(12345) == -1
