"""In-service prefill progress: the load tracker's per-replica head of line
(balancer/load.py) and ``ep_aware``'s estimate of what it has computed
(balancer/policies/ep_aware.py, ``in_service_queue``).

Expected values are hand-computed from the formulas in those docstrings with round coefficients
(stated in each test).
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from balancer.cost_model import CostModel, DecodeStepCost, EngineCost, PrefillStepCost
from balancer.load import LoadTracker
from balancer.policies import make_policy
from balancer.policies.base import SelectContext
from balancer.policies.ep_aware import in_service_queue
from balancer.router import Router
from balancer.types import ReplicaId, Request, Role, TtftSlo

A, B, D = ReplicaId("A", 0), ReplicaId("B", 0), ReplicaId("D", 0)
# 10 ms per step + 0.1 ms per token; chunk 4,096 tokens
PF = PrefillStepCost(overhead_s=0.01, per_token_s=1e-4, per_attn_pair_s=0.0, per_group_token_s=0.0)
DC = DecodeStepCost(overhead_s=0.02, per_seq_s=1e-4, per_kv_token_s=1e-8, per_group_seq_s=0.0)
CHUNK = 4096


def dense(pf: PrefillStepCost = PF) -> CostModel:
    e = EngineCost(pf, DC, CHUNK, False)
    return CostModel(prefill=e, decode=e)


def tracker() -> LoadTracker:
    t = LoadTracker(initial_slots=2)  # grows past 2: the head arrays grow with the others
    for r in (A, B, D):
        t.add_replica(r)
    return t


def head(t: LoadTracker, r: ReplicaId) -> tuple[float, int, float]:
    s = t.slot(r)
    return float(t.prefill_head_start_s[s]), int(t.prefill_head_tokens[s]), float(t.prefill_head_pairs[s])


# ---------------------------------------------------------------------- the tracker's head of line
def test_head_of_line_follows_dispatch_order_and_prefill_done_times():
    t = tracker()
    assert head(t, A) == (math.inf, 0, 0.0)
    t.on_dispatch("x", A, D, 1000, 1000, prefill_attn_pairs=5.0, now_s=1.0)
    t.on_dispatch("y", A, D, 300, 300, prefill_attn_pairs=7.0, now_s=2.0)
    assert head(t, A) == (1.0, 1000, 5.0)  # x is first in line since its dispatch
    t.on_prefill_done("x", now_s=4.5)
    assert head(t, A) == (4.5, 300, 7.0)  # y begins when x is done, not at its own dispatch
    t.on_dispatch("z", A, D, 50, 50, now_s=5.0)
    t.on_prefill_done("z", now_s=5.5)  # done out of order: y stays in service since 4.5
    assert head(t, A) == (4.5, 300, 7.0)
    t.on_finished("y", now_s=6.0)  # released by finish (no prefill hook): the line empties
    assert head(t, A) == (math.inf, 0, 0.0)
    # a request dispatched after the previous one finished begins at its own dispatch
    t.on_dispatch("w", A, D, 10, 10, now_s=9.0)
    assert head(t, A) == (9.0, 10, 0.0)
    t.on_finished("w")  # no time given: the latest seen
    assert t.prefill_tokens[t.slot(A)] == 0 and head(t, A) == (math.inf, 0, 0.0)


def test_head_of_line_on_mixed_replicas_removal_and_fully_cached_prompts():
    t = tracker()
    t.on_dispatch("m", None, B, 400, 400, now_s=1.0)  # mixed: the decode replica prefills it
    assert head(t, B) == (1.0, 400, 0.0)
    t.on_dispatch("c", A, D, 0, 400, now_s=1.0)  # nothing to compute: never in line
    assert head(t, A) == (math.inf, 0, 0.0)
    t.on_dispatch("a", A, D, 100, 100, now_s=2.0)
    t.on_dispatch("b", A, D, 100, 100, now_s=3.0)
    t.remove_replica(A)  # its records stay, its line is gone
    t.add_replica(A)
    assert head(t, A) == (math.inf, 0, 0.0)
    t.on_prefill_done("a", now_s=4.0)  # hooks of the removed replica's requests touch nothing
    t.on_dispatch("n", A, D, 70, 70, now_s=5.0)
    assert head(t, A) == (5.0, 70, 0.0)
    for rid in ("m", "c", "a", "b", "n"):
        t.on_finished(rid, now_s=6.0)
    assert t.num_in_flight == 0 and all(len(q) == 0 for q in t._pending)


# ---------------------------------------------------------------------- the estimate
def test_in_service_queue_on_dense_ranks_by_hand():
    eng = EngineCost(PF, DC, CHUNK, False)
    # rank 0: 20,000 queued tokens, all of one prompt with 1,000 cached tokens in front, in service
    # for 1.0 s; rank 1: 3,000 queued, in service 0.05 s; rank 2: idle
    u = 20_000.0
    pairs0 = u * 1000 + u * (u + 1) / 2
    q = np.array([20_000.0, 3000.0, 0.0])
    a = np.array([pairs0, 3000 * 3001 / 2, 0.0])
    q2, a2 = in_service_queue(q, a, np.array([2.0, 2.95, np.inf]), np.array([20_000, 3000, 0]),
                              np.array([pairs0, 3000 * 3001 / 2, 0.0]), 3.0, eng, np.arange(3), None)
    # rank 0 steps at 0.01 + 1e-4 * 4096 = 0.4196 s: floor(1.0 / 0.4196) = 2 steps = 8,192 tokens
    assert q2[0] == pytest.approx(20_000 - 8192)
    assert a2[0] == pytest.approx(pairs0 - (8192 * 1000 + 8192 * 8193 / 2))
    # rank 1 steps at 0.01 + 1e-4 * 3000 = 0.31 s: no step done in 0.05 s
    assert q2[1] == 3000 and a2[1] == a[1]
    assert q2[2] == 0
    # far longer in service: one token is left until the engine reports it done
    q3, _ = in_service_queue(q, a, np.array([-100.0, 2.95, np.inf]), np.array([20_000, 3000, 0]),
                             a.copy(), 3.0, eng, np.arange(3), None)
    assert q3[0] == 1


def test_in_service_queue_on_a_wide_ep_engine_steps_at_its_slowest_rank():
    pf = PrefillStepCost(overhead_s=0.02, per_token_s=1e-5, per_attn_pair_s=0.0, per_group_token_s=1e-6)
    eng = EngineCost(pf, DC, CHUNK, True)
    # one engine, two ranks: x = min(q, C) = [4096, 2048]; T = 0.02 + 1e-5 * 4096 + 1e-6 * 6144
    # = 0.067104 s; 0.2 s in service = 2 steps; rank 0's head: 2 * 4096 = 8,192 of 10,000
    q = np.array([10_000.0, 2048.0])
    q2, _ = in_service_queue(q, np.zeros(2), np.array([0.0, 0.0]), np.array([10_000, 2048]), np.zeros(2),
                             0.2, eng, np.array([0, 0]), np.array([[0, 1]]))
    assert q2[0] == pytest.approx(10_000 - 8192)
    assert q2[1] == 1  # its 2,048-token head is computed but not reported done: one token left


# ---------------------------------------------------------------------- the policy
def dense_router(**kw) -> Router:
    """Prefill replicas A and B, decode D, ``ep_aware`` without its heuristic terms, on :func:`dense`."""
    r = Router("ep_aware:horizon_weight=0,tie_tolerance=0", "round_robin", cost_model=dense(), **kw)
    for x, role in ((A, "prefill"), (B, "prefill"), (D, "decode")):
        r.add_replica(x, role)
    return r


def test_a_rank_far_into_a_long_prompt_is_cheaper_than_one_that_just_took_a_shorter_one():
    r = dense_router()
    r.load.on_dispatch("long", A, D, 20_000, 20_000, now_s=0.0)
    r.load.on_dispatch("short", B, D, 8000, 8000, now_s=7.0)
    req = Request("n", 7.5, 1000)
    c = r.candidates(req, "prefill")
    ch = r.prefill_policy.select(req, c, SelectContext(random.Random(0), 7.5, 0, dense()))
    s = {k.engine: v for k, v in ch.scores.items()}
    # both step at 0.01 + 1e-4 * 4096 = 0.4196 s. A, 7.5 s in service: floor(7.5 / 0.4196) = 17
    # steps, more than its 20,000 tokens: 1 left; with the new 1,000: 1 step, 0.01 + 0.1001 s.
    # B, 0.5 s: 1 step, 4,096 done, 3,904 left; with the new prompt 4,904: 2 steps, 0.02 + 0.4904 s
    assert s["A"] == pytest.approx(0.01 + 1e-4 * 1001)
    assert s["B"] == pytest.approx(0.02 + 1e-4 * 4904)
    assert ch.replica == A
    # at face value (in_service_progress=false): A 21,000 tokens, 6 steps, 0.06 + 2.1 = 2.16 s;
    # B 9,000, 3 steps, 0.03 + 0.9 = 0.93 s: B
    blind = make_policy("ep_aware", horizon_weight=0.0, tie_tolerance=0.0, in_service_progress=False)
    ch = blind.select(req, c, SelectContext(random.Random(0), 7.5, 0, dense()))
    s = {k.engine: v for k, v in ch.scores.items()}
    assert s["A"] == pytest.approx(2.16) and s["B"] == pytest.approx(0.93) and ch.replica == B
    # the same state without a clock (now_s unknown to the policy): no progress either
    assert r.prefill_policy.prefill_cost(req, c, dense(), ("A", "B"), np.array([0, 1]), None, "prefill",
                                         False)[0] == pytest.approx([2.16, 0.93])


def test_slo_margin_is_one_where_progress_is_counted_and_0_8_elsewhere():
    # dense pool, router-built candidates (they carry the head of line), both queues dispatched
    # just now (no progress yet)
    r = dense_router(ttft_slo=TtftSlo(1.2))
    r.load.on_dispatch("qa", A, D, 10_000, 10_000, now_s=5.0)
    r.load.on_dispatch("qb", B, D, 11_000, 11_000, now_s=5.0)
    req = Request("n", 5.0, 3000)
    c = r.candidates(req, "prefill")
    # A: 13,000 tokens, 4 steps: 0.04 + 1.3 = 1.34 s; B: 14,000, 4 steps: 1.44 s. Budget 1.2 s.
    pol = r.prefill_policy
    ch = pol.select(req, c, SelectContext(random.Random(0), 5.0, 0, dense(), TtftSlo(1.2)))
    assert ch.reason.endswith(":slo_doomed")  # margin 1: 1.34 > 1.2, both miss
    ch = make_policy("ep_aware", horizon_weight=0.0, tie_tolerance=0.0, slo_margin=0.8).select(
        req, c, SelectContext(random.Random(0), 5.0, 0, dense(), TtftSlo(1.2)))
    assert ch.reason == "ep_aware:prefill" and ch.replica == A  # 0.8 * 1.34 = 1.072 <= 1.2
    # on a wide-EP model progress is not counted and the default margin stays 0.8
    ep = CostModel(prefill=EngineCost(PF, DC, CHUNK, True), decode=EngineCost(PF, DC, CHUNK, True))
    assert pol._progress_applies(c, dense(), ("A", "B")) and not pol._progress_applies(c, ep, ("A", "B"))
    assert make_policy("ep_aware").slo_margin is None
    with pytest.raises(ValueError, match="slo_margin"):
        make_policy("ep_aware", slo_margin=0.0)


def test_simulated_dense_cluster_meets_more_budgets_with_in_service_progress():
    from sim.search.point import SLO, Point, evaluate_point, parse_policy, register_workload
    from sim.scenario import load_scenario
    from sim.workload import read_trace

    sc = load_scenario("llama70b-pd-h100")
    register_workload("test-progress-mooncake", read_trace(None))  # the whole embedded trace, ~3 s a run
    slo = SLO(ttft_s=2.0, tpot_s=0.1, ttft_per_1k_prompt_tokens_s=0.1)
    on = evaluate_point(Point(sc, "test-progress-mooncake", parse_policy("ep_aware"), 1.0, slo))
    off = evaluate_point(Point(sc, "test-progress-mooncake", parse_policy("ep_aware:in_service_progress=false"), 1.0, slo))
    assert on.error is None and off.error is None
    # the same requests and engines; measured when written: 73.9% vs 61.9% (bench/policy_goodput.py's
    # dense row at the trace rate, TPOT 50 ms); asserted: at least 5 points
    assert on.attainment > off.attainment + 0.05, (on.attainment, off.attainment)


# ---------------------------------------------------------------------- bounds and old snapshots
def test_head_of_line_matches_a_plain_list_model_under_random_hook_orders():
    # the reference: a list in dispatch order, removed from directly; the head begins at
    # max(its dispatch, the time the previous head left). Independent of the lazy deque.
    rng = random.Random(7)
    t = tracker()
    ref: list[tuple[str, float, int]] = []  # (id, dispatch time, tokens) on replica A
    ref_start = math.inf
    live: list[str] = []
    now = 0.0
    for i in range(3000):
        now += rng.random()
        if not live or rng.random() < 0.5:
            rid = f"r{i}"
            tokens = rng.randrange(1, 5000)
            t.on_dispatch(rid, A, D, tokens, tokens, now_s=now)
            ref.append((rid, now, tokens))
            live.append(rid)
            if len(ref) == 1:
                ref_start = now
        else:
            rid = live.pop(rng.randrange(len(live)))
            was_head = ref[0][0] == rid
            ref = [r for r in ref if r[0] != rid]
            (t.on_prefill_done if rng.random() < 0.7 else t.on_finished)(rid, now_s=now)
            if was_head:
                ref_start = max(ref[0][1], now) if ref else math.inf
        start, tokens, _ = head(t, A)
        assert start == ref_start and tokens == (ref[0][2] if ref else 0)
        assert t.prefill_tokens[t.slot(A)] == sum(r[2] for r in ref)
        # bounded: the records that left out of order never outnumber the live ones by much
        assert len(t._pending[t.slot(A)]) <= 2 * len(ref) + 33


def test_prefills_done_in_reverse_order_cost_amortised_constant_work():
    # 20,000 pending on one replica, done newest first: every record is visited O(1) times
    # (counted through the deque sizes, not timed): the deque is compacted as dead ones pile up
    t = tracker()
    n = 20_000
    for i in range(n):
        t.on_dispatch(f"r{i}", A, D, 10, 10, now_s=float(i))
    sizes = []
    for i in reversed(range(n)):
        t.on_prefill_done(f"r{i}", now_s=float(n + i))
        sizes.append(len(t._pending[t.slot(A)]))
    assert sizes[-1] == 0 and head(t, A) == (math.inf, 0, 0.0)
    live_after = [n - 1 - k for k in range(n)]
    assert all(s <= 2 * live + 34 for s, live in zip(sizes, live_after))


def test_a_tracker_pickled_before_the_head_of_line_existed_restores_and_routes():
    import pickle

    t = tracker()
    t.on_dispatch("x", A, D, 100, 100, now_s=1.0)
    state = t.__getstate__()
    for k in ("prefill_head_start_s", "prefill_head_tokens", "prefill_head_pairs", "_pending", "_dead", "_now_s"):
        state.pop(k)
    old = LoadTracker.__new__(LoadTracker)
    old.__setstate__(state)
    old = pickle.loads(pickle.dumps(old))
    assert head(old, A) == (math.inf, 0, 0.0)  # its pending prefill counts in full, as it did then
    old.on_dispatch("y", A, D, 50, 50, now_s=2.0)
    assert head(old, A) == (2.0, 50, 0.0)
    old.on_prefill_done("x", now_s=3.0)  # not in line: nothing moves
    old.on_prefill_done("y", now_s=4.0)
    assert head(old, A) == (math.inf, 0, 0.0) and old.prefill_tokens[old.slot(A)] == 0
