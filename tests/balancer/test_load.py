"""LoadTracker: hand-computed counters through the hooks, and a Hypothesis check against a
reference model (sums over live request records) that load returns exactly to zero."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.load import LoadSnapshot, LoadTracker
from balancer_factories import rid

P0, P1, D0, D1, M0 = rid("p", 0), rid("p", 1), rid("d", 0), rid("d", 1), rid("m", 0)
ZERO = LoadSnapshot(0, 0, 0)


def tracker(*reps, initial_slots=16):
    t = LoadTracker(initial_slots)
    for r in reps:
        t.add_replica(r)
    return t


def test_pd_request_by_hand():
    t = tracker(P0, D0)
    t.on_dispatch("r1", P0, D0, prefill_tokens=300, decode_kv_tokens=1000)
    # hand: prefill replica +1 request, +300 uncached tokens; decode +1 request, +1000 KV tokens
    assert t.get(P0) == LoadSnapshot(1, 300, 0)
    assert t.get(D0) == LoadSnapshot(1, 0, 1000)
    assert t.num_in_flight == 1 and t.is_in_flight("r1")
    t.on_prefill_done("r1")
    assert t.get(P0) == ZERO
    assert t.get(D0) == LoadSnapshot(1, 0, 1000)
    t.on_prefill_done("r1")  # duplicate: nothing more released
    assert t.get(P0) == ZERO and t.get(D0) == LoadSnapshot(1, 0, 1000)
    t.on_finished("r1")
    assert t.get(P0) == ZERO and t.get(D0) == ZERO and t.num_in_flight == 0
    t.on_finished("r1")  # duplicate finish: no-op
    assert t.get(D0) == ZERO


def test_aggregated_request_by_hand():
    t = tracker(M0)
    t.on_dispatch("r1", None, M0, prefill_tokens=300, decode_kv_tokens=1000)
    # hand: the mixed replica carries the prefill tokens itself until prefill is done
    assert t.get(M0) == LoadSnapshot(1, 300, 1000)
    t.on_dispatch("r2", None, M0, prefill_tokens=50, decode_kv_tokens=60)
    assert t.get(M0) == LoadSnapshot(2, 350, 1060)
    t.on_prefill_done("r1")
    assert t.get(M0) == LoadSnapshot(2, 50, 1060)
    t.on_finished("r2")  # finish without prefill_done releases everything of r2
    assert t.get(M0) == LoadSnapshot(1, 0, 1000)
    t.on_finished("r1")
    assert t.get(M0) == ZERO


def test_finish_without_prefill_done_releases_prefill_replica():
    t = tracker(P0, P1, D0)
    t.on_dispatch("a", P0, D0, 100, 200)
    t.on_dispatch("b", P1, D0, 40, 50)
    # hand: D0 = 2 requests, 250 KV tokens
    assert t.get(D0) == LoadSnapshot(2, 0, 250)
    t.on_finished("a")  # e.g. aborted before prefill finished
    assert t.get(P0) == ZERO and t.get(P1) == LoadSnapshot(1, 40, 0) and t.get(D0) == LoadSnapshot(1, 0, 50)


def test_duplicate_dispatch_raises_and_leaves_state():
    t = tracker(P0, D0)
    t.on_dispatch("r1", P0, D0, 10, 20)
    with pytest.raises(ValueError):
        t.on_dispatch("r1", P0, D0, 10, 20)
    assert t.get(P0) == LoadSnapshot(1, 10, 0) and t.get(D0) == LoadSnapshot(1, 0, 20)


def test_unknown_replica_raises_and_leaves_state():
    t = tracker(P0, D0)
    with pytest.raises(KeyError):
        t.on_dispatch("r1", P0, D1, 10, 20)
    with pytest.raises(KeyError):
        t.on_dispatch("r1", P1, D0, 10, 20)
    assert t.get(P0) == ZERO and t.get(D0) == ZERO and t.num_in_flight == 0
    t.on_prefill_done("nope")
    t.on_finished("nope")  # unknown ids are ignored
    assert t.get(P0) == ZERO and t.get(D0) == ZERO


def test_remove_replica_with_in_flight_does_not_corrupt_other_slots():
    t = tracker(P0, P1, D0, D1)
    t.on_dispatch("a", P0, D0, 100, 1000)
    t.on_dispatch("b", P1, D0, 200, 2000)
    t.on_dispatch("c", P0, D1, 300, 3000)
    t.remove_replica(P0)
    # hand: other slots unchanged: P1 (1,200,0), D0 (2,0,3000), D1 (1,0,3000)
    assert t.get(P1) == LoadSnapshot(1, 200, 0)
    assert t.get(D0) == LoadSnapshot(2, 0, 3000)
    assert t.get(D1) == LoadSnapshot(1, 0, 3000)
    with pytest.raises(KeyError):
        t.get(P0)
    # a new replica reuses the freed slot, starts at zero, and is never touched by the old records
    new = rid("p", 9)
    t.add_replica(new)
    assert t.get(new) == ZERO
    t.on_dispatch("d", new, D1, 7, 8)
    t.on_prefill_done("a")
    t.on_finished("a")
    t.on_finished("c")
    assert t.get(new) == LoadSnapshot(1, 7, 0)
    assert t.get(D0) == LoadSnapshot(1, 0, 2000) and t.get(D1) == LoadSnapshot(1, 0, 8)
    for rq in ("b", "d"):
        t.on_finished(rq)
    for r in (P1, D0, D1, new):
        assert t.get(r) == ZERO
    assert t.num_in_flight == 0


def test_remove_decode_replica_of_aggregated_request():
    t = tracker(M0, D0)
    t.on_dispatch("a", None, M0, 10, 20)
    t.on_dispatch("b", None, D0, 30, 40)
    t.remove_replica(M0)
    t.add_replica(P0)  # reuses M0's slot
    t.on_prefill_done("a")
    t.on_finished("a")
    assert t.get(P0) == ZERO and t.get(D0) == LoadSnapshot(1, 30, 40)


def test_add_replica_idempotent_and_growth_keeps_values():
    t = LoadTracker(initial_slots=2)
    reps = [rid("x", i) for i in range(40)]
    for i, r in enumerate(reps):
        t.add_replica(r)
        t.on_dispatch(f"q{i}", None, r, i, 2 * i)
    assert t.add_replica(reps[3]) == t.slot(reps[3])  # idempotent, same slot, load kept
    # hand: replica i holds (1, i, 2i) after the arrays grew several times
    for i, r in enumerate(reps):
        assert t.get(r) == LoadSnapshot(1, i, 2 * i)
    for i in range(40):
        t.on_finished(f"q{i}")
    assert all(t.get(r) == ZERO for r in reps)


# ---------------------------------------------------------------------------------- property
REPS = [P0, P1, D0, D1, M0]
IDS = [f"r{i}" for i in range(6)] + ["ghost"]  # "ghost" is mostly never dispatched

op = st.one_of(
    st.tuples(st.just("dispatch"), st.sampled_from(IDS[:6]), st.sampled_from([P0, P1, None]),
              st.sampled_from([D0, D1, M0]), st.integers(0, 500), st.integers(1, 900)),
    st.tuples(st.just("prefill_done"), st.sampled_from(IDS), st.none(), st.none(), st.just(0), st.just(0)),
    st.tuples(st.just("finished"), st.sampled_from(IDS), st.none(), st.none(), st.just(0), st.just(0)),
)


def expected_loads(live):
    """Reference: counters = sums over live records (prefill share only while not released)."""
    exp = {r: [0, 0, 0] for r in REPS}
    for p, d, pt, kv, released in live.values():
        if not released:
            if p is not None:
                exp[p][0] += 1
                exp[p][1] += pt
            else:
                exp[d][1] += pt
        exp[d][0] += 1
        exp[d][2] += kv
    return {r: LoadSnapshot(*v) for r, v in exp.items()}


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(op, max_size=60))
def test_load_returns_to_zero_after_any_interleaving(ops):
    t = tracker(*REPS, initial_slots=2)
    live = {}
    for kind, req_id, p, d, pt, kv in ops:
        if kind == "dispatch":
            if req_id in live:
                with pytest.raises(ValueError):
                    t.on_dispatch(req_id, p, d, pt, kv)
            else:
                t.on_dispatch(req_id, p, d, pt, kv)
                live[req_id] = (p, d, pt, kv, False)
        elif kind == "prefill_done":
            t.on_prefill_done(req_id)
            if req_id in live:
                live[req_id] = live[req_id][:4] + (True,)
        else:
            t.on_finished(req_id)
            live.pop(req_id, None)
        exp = expected_loads(live)
        for r in REPS:
            assert t.get(r) == exp[r]
        assert t.num_in_flight == len(live)
    for req_id in IDS:  # finish everything, in id order, with a duplicate finish each
        t.on_finished(req_id)
        t.on_finished(req_id)
    for r in REPS:
        assert t.get(r) == ZERO
    assert not t.num_requests.any() and not t.prefill_tokens.any() and not t.decode_kv_tokens.any()
