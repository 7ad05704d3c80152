"""The facts a router keeps of what it routed itself (issue 23 part 3): the prompts each replica
prefills at once (``LoadTracker.prefill_inflight``) and the returning-session forecast
(:mod:`balancer.session_forecast`), the router feeding them, and ``ep_aware``'s two options that
read them (``session_forecast``, ``prefill_at_once``).

Expected values are hand-computed from the formulas in the module docstrings (the arithmetic is in
the comments): the linear decay ``sum_j (1 - age_j / H)``, the per-step token rise ``min(C, L (m +
1)) - max_r min(C, L m_r)``. With both options off (the default) every score is bit-identical to the
policy without the columns (random pools).
"""

from __future__ import annotations

import dataclasses
import pickle
import random

import numpy as np
import pytest

from balancer import kernels
from balancer.cost_model import CostModel, DecodeStepCost, EngineCost, PrefillStepCost
from balancer.load import LoadTracker
from balancer.policies import make_policy
from balancer.policies.base import Policy, SelectContext
from balancer.policies.ep_aware import EpAware, at_once_step_rise_s
from balancer.prefill_cadence import at_once_tokens
from balancer.router import Router
from balancer.session_forecast import ReturningSessions, SessionFacts
from balancer.types import Choice, ReplicaId, Request, Role
from tests.balancer_factories import DC440, PF440, cands, random_ep_views, random_request, view


# ---------------------------------------------------------------- the forecast by hand
def test_returning_sessions_decay_linearly_over_the_horizon():
    s = ReturningSessions(horizon_s=60.0)
    s.on_finished("a", 0, 1000, 10.0)
    s.on_finished("b", 0, 3000, 40.0)
    s.on_finished("c", 2, 500, 50.0)
    # at 70 s: a is 60 s idle (= H: dropped); b 30 s: weight 1 - 30/60 = 0.5; c 20 s: 1 - 20/60 = 2/3
    req, kv = s.forecast(np.array([0, 1, 2]), 70.0)
    np.testing.assert_allclose(req, [0.5, 0.0, 2 / 3], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(kv, [0.5 * 3000, 0.0, 2 / 3 * 500], rtol=1e-12, atol=1e-9)
    assert len(s) == 2  # a expired
    s.on_returned("b")  # b sent its next turn: not idle
    req, kv = s.forecast(np.array([0, 1, 2]), 70.0)
    np.testing.assert_allclose(req, [0.0, 0.0, 2 / 3], atol=1e-12)
    # c finishes its next turn on slot 1 with a longer context: its record moves (weight 1 at age 0)
    s.on_finished("c", 1, 800, 70.0)
    req, kv = s.forecast(np.array([0, 1, 2]), 70.0)
    np.testing.assert_allclose(req, [0.0, 1.0, 0.0], atol=1e-12)
    np.testing.assert_allclose(kv, [0.0, 800.0, 0.0], atol=1e-9)
    # 45 s later: 1 - 45/60 = 0.25
    req, kv = s.forecast(np.array([1]), 115.0)
    np.testing.assert_allclose(req, [0.25], atol=1e-12)
    np.testing.assert_allclose(kv, [200.0], atol=1e-9)
    s.on_returned("unknown")  # nothing
    assert s.forecast(np.array([0, 1]), 130.0)[0].tolist() == [0.0, 0.0] and len(s) == 0


def test_the_forecast_is_bounded_by_the_cap_and_drops_removed_replicas():
    s = ReturningSessions(horizon_s=100.0, max_sessions=3)
    for i in range(5):  # a, b, c, d, e finishing at 0..4 s on slots 0, 1, 0, 1, 0
        s.on_finished("abcde"[i], i % 2, 10, float(i))
    assert len(s) == 3 and s.evicted == 2  # the oldest two (a, b) evicted
    # at 10 s: c (age 8) 0.92 and e (age 6) 0.94 on slot 0; d (age 7) 0.93 on slot 1
    req, _ = s.forecast(np.array([0, 1]), 10.0)
    np.testing.assert_allclose(req, [0.92 + 0.94, 0.93], atol=1e-12)
    assert s.drop_slot(0) == 2 and len(s) == 1
    req, _ = s.forecast(np.array([0, 1, 40]), 10.0)  # an unseen slot: 0
    np.testing.assert_allclose(req, [0.0, 0.93, 0.0], atol=1e-12)
    # a finish time before the latest one given (4 s) is taken as 4 s (records stay in finish order): 0.94
    s.on_finished("f", 1, 10, 2.0)
    np.testing.assert_allclose(s.forecast(np.array([1]), 10.0)[0], [0.93 + 0.94], atol=1e-12)


def test_the_forecast_holds_at_a_live_clock_and_across_rebases():
    # a live router's monotonic clock is ~1e6 s: the decayed sums are kept relative to an origin, so
    # they do not cancel (absolute times gave 143.0000000000291 for 143 tokens); the origin moves once
    # the clock is 64 horizons past it (the sums rebuilt from the records)
    s = ReturningSessions(horizon_s=60.0)
    t0 = 1_234_567.891
    s.on_finished("a", 0, 143, t0)
    req, kv = s.forecast(np.array([0]), t0)
    assert req.tolist() == [1.0] and kv.tolist() == [143.0]
    s.on_finished("b", 0, 1000, t0 + 30.0)
    req, kv = s.forecast(np.array([0]), t0 + 45.0)  # a: 1 - 45/60 = 0.25; b: 1 - 15/60 = 0.75
    np.testing.assert_allclose(req, [1.0], rtol=1e-12)
    np.testing.assert_allclose(kv, [0.25 * 143 + 0.75 * 1000], rtol=1e-12)
    far = t0 + 64 * 60.0 + 100.0  # past the rebase point: a and b long gone, c fresh
    s.on_finished("c", 1, 500, far)
    assert len(s) == 3 and s.finished_s("c") == far and s.finished_s("b") == t0 + 30.0
    req, kv = s.forecast(np.array([0, 1]), far + 6.0)  # a and b expire; c: 1 - 6/60 = 0.9
    np.testing.assert_allclose(req, [0.0, 0.9], rtol=1e-12, atol=0)
    np.testing.assert_allclose(kv, [0.0, 450.0], rtol=1e-12, atol=0)
    assert s.finished_s("a") is None


def test_a_forecast_pickled_before_the_origin_reads_its_absolute_times():
    # ReturningSessions of ff249fe kept absolute finish times and had no origin: restored, they count from 0
    s = ReturningSessions(horizon_s=60.0)
    s.on_finished("a", 0, 100, 50.0)
    state = s.__dict__.copy()
    state["_idle"] = type(state["_idle"])({"a": (0, 50.0, 100.0)})  # the old layout: the absolute time
    for k, v in (("_sum_t", 50.0), ("_sum_tc", 5000.0)):
        state[k] = state[k].copy()
        state[k][0] = v
    del state["_origin_s"]
    old = ReturningSessions.__new__(ReturningSessions)
    old.__setstate__(state)
    req, kv = old.forecast(np.array([0]), 80.0)  # 30 s idle: 0.5
    np.testing.assert_allclose(req, [0.5], rtol=1e-12)
    np.testing.assert_allclose(kv, [50.0], rtol=1e-12)
    assert old.finished_s("a") == 50.0
    assert pickle.loads(pickle.dumps(s)).finished_s("a") == 50.0


@pytest.mark.parametrize("horizon, cap, match", [(0.0, 1, "horizon_s"), (float("nan"), 1, "horizon_s"),
                                                 (float("inf"), 1, "horizon_s"), (-1.0, 1, "horizon_s"),
                                                 (10.0, 0, "max_sessions"), (10.0, True, "max_sessions"),
                                                 (10.0, 2.5, "max_sessions")])
def test_bad_forecast_settings_are_refused(horizon, cap, match):
    with pytest.raises(ValueError, match=match):
        ReturningSessions(horizon, cap)


def test_bad_finish_records_are_refused_and_change_nothing():
    s = ReturningSessions(10.0)
    for slot, ctx_tokens in ((-1, 5), (0, -5), (0, float("nan"))):
        with pytest.raises(ValueError):
            s.on_finished("a", slot, ctx_tokens, 1.0)
    assert len(s) == 0


def test_session_facts_prune_requests_the_tracker_reaped():
    f = SessionFacts(60.0)
    live = {"keep"}
    f.on_route("keep", "s0", 0, 100, 1, live.__contains__)
    for i in range(1100):  # 1,100 routed requests never finished (reaped by the tracker)
        f.on_route(f"r{i}", f"s{i}", 0, 100, 1, live.__contains__)
    # the map outgrew 2 x 1 + 1,024 entries: everything the tracker no longer holds was pruned
    assert len(f._routed) < 1030 and "keep" in f._routed
    f.on_finished("keep", 5.0, 20)
    assert f.sessions._idle["s0"][0::2] == (0, 120.0) and f.sessions.finished_s("s0") == 5.0
    f.on_route("x", None, 0, 100, 1, live.__contains__)  # no session: not tracked
    assert "x" not in f._routed


# ---------------------------------------------------------------- prompts in prefill, by hand
def test_prefill_inflight_counts_routed_prompts_until_their_prefill_is_done():
    t = LoadTracker()
    A, B = ReplicaId("a", 0), ReplicaId("b", 0)
    sa, sb = t.add_replica(A), t.add_replica(B)
    t.on_dispatch("r1", None, A, 100, 100, now_s=0.0)  # mixed, 100 uncached: A 1
    t.on_dispatch("r2", None, A, 0, 100, now_s=0.0)  # all cached: nothing to prefill
    t.on_dispatch("r3", B, A, 50, 100, now_s=0.0)  # PD: prefilled on B
    assert (t.prefill_inflight[sa], t.prefill_inflight[sb]) == (1, 1)
    t.on_prefill_done("r3", 1.0)
    t.on_prefill_done("r3", 1.5)  # idempotent
    assert (t.prefill_inflight[sa], t.prefill_inflight[sb]) == (1, 0)
    t.on_dispatch("r4", None, A, 10, 10, now_s=2.0)
    t.on_dispatch("r5", None, A, 10, 10, now_s=2.0)
    assert t.prefill_inflight[sa] == 3
    t.on_prefill_done("r5", 3.0)  # out of order (behind r1 and r4)
    t.on_finished("r4", 3.0)  # finished without a prefill-done hook: released too
    assert t.prefill_inflight[sa] == 1
    state = pickle.loads(pickle.dumps(t))
    assert state.prefill_inflight[sa] == 1
    # a tracker pickled before the count existed rebuilds it from its pending prefills
    old = t.__getstate__()
    del old["prefill_inflight"]
    t2 = LoadTracker.__new__(LoadTracker)
    t2.__setstate__(old)
    assert (t2.prefill_inflight[sa], t2.prefill_inflight[sb]) == (1, 0)
    t.on_first_token = None  # (the tracker has no such hook: the router maps first token to prefill done)
    t.on_prefill_done("r1", 4.0)
    assert t.prefill_inflight[sa] == 0
    t.on_dispatch("r6", None, A, 10, 10, now_s=5.0)
    t.remove_replica(A)  # its line is cleared; r6's later hooks release nothing there
    t.on_finished("r6", 6.0)
    assert t.prefill_inflight[sa] == 0 and t.prefill_inflight.min() == 0


# ---------------------------------------------------------------- the step rise, by hand
def test_at_once_tokens_and_the_step_rise_by_hand():
    x, after = at_once_tokens(np.array([0, 3, 16, 20]), 8192, 512)
    np.testing.assert_array_equal(x, [0, 1536, 8192, 8192])
    np.testing.assert_array_equal(after, [512, 2048, 8192, 8192])
    with pytest.raises(ValueError):
        at_once_tokens(np.array([-1]), 8192, 512)
    with pytest.raises(ValueError):
        at_once_tokens(np.array([1]), 0, 512)
    c = PrefillStepCost(overhead_s=0.01, per_token_s=1e-4, per_attn_pair_s=1e-9, per_group_token_s=1e-5)
    m = np.array([0, 1, 3, 2])  # one wide-EP engine: x = 0, 512, 1536, 1024; busiest 1536
    u, cached = np.full(4, 2048.0), np.array([0.0, 0.0, 1024.0, 0.0])
    idx = np.zeros(4, dtype=np.int64)
    rise = at_once_step_rise_s(m, u, cached, c, 8192, 512, idx, None, True)
    # only rank 2 (the busiest) rises: 2,048 - 1,536 = 512 tokens x (1e-4 + 1e-9 x (1,024 + 1,024)) s
    np.testing.assert_allclose(rise, [0, 0, 512 * (1e-4 + 1e-9 * 2048), 0], rtol=1e-12)
    # dense ranks: each its own step, 512 tokens more on each (below C)
    dense = at_once_step_rise_s(m, u, cached, c, 8192, 512, np.arange(4), None, False)
    np.testing.assert_allclose(dense, 512 * (1e-4 + 1e-9 * (cached + 1024)), rtol=1e-12)


# ---------------------------------------------------------------- ep_aware with the facts
PF = PrefillStepCost(overhead_s=0.01, per_token_s=1e-4, per_attn_pair_s=0.0, per_group_token_s=1e-5)
DC = DecodeStepCost(overhead_s=0.03, per_seq_s=1e-3, per_kv_token_s=0.0, per_group_seq_s=0.0)


def model(cap: int | None = 16, limit: int | None = 512, interval: int = 8) -> CostModel:
    e = EngineCost(PF, DC, 8192, True, cap, limit, interval)
    return CostModel(prefill=e, decode=e)


def sc(pol, r: Request, c, cm: CostModel) -> np.ndarray:
    ch = pol.select(r, c, SelectContext(random.Random(0), 0.0, 0, cm))
    return np.array([ch.scores[x] for x in c.replicas])


def three(role: Role = Role.MIXED, inflight=(0, 1, 2), ret=(0.0, 0.0, 0.0), ret_kv=(0.0, 0.0, 0.0)):
    c = cands(*(view("e", role, dp=i, num_requests=b, prefill_tokens=q, decode_kv_tokens=0,
                     kv_capacity_tokens=10**7, matched_tokens=m, block_size=256)
                for i, (b, q, m) in enumerate(((4, 0, 0), (6, 3000, 0), (10, 9000, 1024)))))
    return dataclasses.replace(c, prefill_inflight=np.array(inflight, dtype=np.int64),
                               returning_requests=np.array(ret, dtype=float),
                               returning_kv_tokens=np.array(ret_kv, dtype=float))


REQ = Request("r", 0.0, 2048, max_output_tokens=160)


def test_prefill_at_once_adds_the_step_rise_times_the_engines_sequences_and_the_prompts_steps():
    # u = 2,048, 2,048, 1,024 -> n = ceil(u / 512) = 4, 4, 2 prefill steps; in flight 0, 1, 2 -> per-step tokens
    # 0, 512, 1,024 (busiest 1,024), with the prompt 512, 1,024, 1,536: only rank 2 rises, by 512 tokens x 1e-4 s.
    # The engine runs 4 + 6 + 10 = 20 sequences: 20 x 2 steps x 0.0512 s = 2.048 s on rank 2, 0 elsewhere.
    cm = model()
    on = make_policy("ep_aware", prefill_at_once=True)
    diff = sc(on, REQ, three(), cm) - sc(make_policy("ep_aware"), REQ, three(), cm)
    np.testing.assert_allclose(diff, [0.0, 0.0, 2.048], rtol=1e-9, atol=1e-9)
    # where chunks do not run in parallel (no cap, or no limit) the term has no part
    for m in (model(cap=None), model(limit=None), model(cap=32)):
        np.testing.assert_array_equal(sc(on, REQ, three(), m), sc(make_policy("ep_aware"), REQ, three(), m))


def test_session_forecast_prices_the_returning_sessions_as_occupancy():
    # with the forecast the later terms (cadence, decode, slot wait, tie rule) see b + rint(R) requests and
    # kv + rint(K) tokens: the same as the default policy on those raised columns but for two terms that price
    # what runs and queues now, from the router's own counts:
    # - the batch stall: n_e x own compute with n_e = 4 + 6 + 10 = 20, not 20 + (0 + 1 + 3) = 24; own =
    #   (1e-4 + 1e-5) u (no attention pairs), u = 2,048, 2,048, 1,024: -4 x 1.1e-4 x u = -0.90112, -0.90112, -0.45056 s
    # - FIFO draining's externality 1e-5 u N_after, N_after_i = sum_{r != i} b_r clip((q_r - q_i) / q_r, 0, 1):
    #   rank 0 16 vs 6+1 + 10+3 = 20 (-4 x 0.02048 = -0.08192 s); rank 1 10 x 2/3 vs 13 x 2/3 (-2 x 0.02048 =
    #   -0.04096 s); rank 2 0 either way.
    cm = model()
    ret, ret_kv = (0.4, 1.2, 2.6), (100.0, 5000.0, 9e3)
    on = three(ret=ret, ret_kv=ret_kv)
    raised = dataclasses.replace(three(), num_requests=three().num_requests + np.rint(ret).astype(np.int64),
                                 decode_kv_tokens=np.rint(ret_kv).astype(np.int64))
    a = sc(make_policy("ep_aware", session_forecast=True), REQ, on, cm)
    b = sc(make_policy("ep_aware"), REQ, raised, cm)
    np.testing.assert_allclose(a - b, [-0.90112 - 0.08192, -0.90112 - 0.04096, -0.45056], rtol=1e-9)
    # decode pools have no stall term: bit-identical to the raised columns
    dec_on, dec_raised = (dataclasses.replace(x, role=Role.DECODE) for x in (on, raised))
    np.testing.assert_array_equal(sc(make_policy("ep_aware", session_forecast=True), REQ, dec_on, cm),
                                  sc(make_policy("ep_aware"), REQ, dec_raised, cm))




def test_a_new_session_avoids_the_rank_its_idle_sessions_will_return_to():
    # 8 ranks, none prefilling; rank 7 runs the fewest requests (12 vs 15) but 8 idle sessions will return
    # there (a rank of 20 sessions for 16 slots). Blind to them, a new session (a 60k-token miss everywhere)
    # goes to rank 7; with the forecast it sees 20 > 16: a slot wait and forced prefill steps there, and
    # it goes to a rank of 15 (+0 returning).
    e = EngineCost(PF440, DC440, 8192, True, 16, 512, 8)
    cm = CostModel(prefill=e, decode=e)
    b = [15, 15, 15, 15, 15, 15, 15, 12]
    c = cands(*(view("e", Role.MIXED, dp=i, num_requests=b[i], prefill_tokens=0, decode_kv_tokens=b[i] * 100_000,
                     kv_capacity_tokens=10**8, matched_tokens=0, block_size=256) for i in range(8)))
    ret = np.zeros(8)
    ret[7] = 8.0
    c = dataclasses.replace(c, prefill_inflight=np.zeros(8, dtype=np.int64), returning_requests=ret,
                            returning_kv_tokens=ret * 100_000)
    r = Request("new", 0.0, 60_000, max_output_tokens=900)
    ctx = SelectContext(random.Random(0), 0.0, 0, cm)
    assert make_policy("ep_aware").select(r, c, ctx).replica.dp_rank == 7
    assert make_policy("ep_aware", session_forecast=True).select(r, c, ctx).replica.dp_rank != 7


def test_with_both_options_off_the_columns_change_nothing():
    # random mixed, prefill and decode pools (two EP engines), facts present or absent: the default policy's
    # scores and choices are bit-identical; and with session_forecast on but no session returning, too
    # (prefill_at_once prices even an idle engine's step rise: not part of this check)
    rng = np.random.default_rng(7)
    models = [model(), model(cap=None), model(limit=None), model(cap=32)]
    pol = make_policy("ep_aware")
    both = make_policy("ep_aware", session_forecast=True)
    for trial in range(120):
        role = (Role.MIXED, Role.PREFILL, Role.DECODE)[trial % 3]
        cm = models[trial % len(models)]
        vs = random_ep_views(rng, role)
        plain = cands(*vs)
        facts = dataclasses.replace(plain, prefill_inflight=rng.integers(0, 5, 8),
                                    returning_requests=rng.random(8) * 4, returning_kv_tokens=rng.random(8) * 1e5)
        zero = dataclasses.replace(plain, prefill_inflight=np.zeros(8, dtype=np.int64),
                                   returning_requests=np.zeros(8), returning_kv_tokens=np.zeros(8))
        r = random_request(rng, f"r{trial}")
        got = [p.select(r, x, SelectContext(random.Random(trial), 0.0, trial, cm))
               for p, x in ((pol, plain), (pol, facts), (both, zero))]
        for g in got[1:]:
            assert g.replica == got[0].replica and g.reason == got[0].reason
            assert [g.scores[x] for x in plain.replicas] == [got[0].scores[x] for x in plain.replicas]


@pytest.mark.skipif(kernels.compiled() is None, reason="numba not installed")
def test_the_options_choose_the_same_with_and_without_the_compiled_kernels():
    rng = np.random.default_rng(11)
    e = EngineCost(PF440, DC440, 8192, True, 16, 512, 8)
    cm = CostModel(prefill=e, decode=e)
    pol = make_policy("ep_aware", session_forecast=True, prefill_at_once=True)
    out = {}
    try:
        for on in (True, False):
            kernels.use_compiled(on)
            res = []
            for trial in range(60):
                role = (Role.MIXED, Role.DECODE)[trial % 2]
                vs = [view("e", role, dp=i, num_requests=int(rng.integers(0, 20)),
                           prefill_tokens=int(rng.integers(0, 200_000)), decode_kv_tokens=int(rng.integers(0, 2e6)),
                           kv_capacity_tokens=10**8, matched_tokens=int(rng.integers(0, 3)) * 25_600, block_size=256)
                      for i in range(8)]
                c = dataclasses.replace(cands(*vs), prefill_inflight=rng.integers(0, 6, 8),
                                        returning_requests=rng.random(8) * 6, returning_kv_tokens=rng.random(8) * 6e5)
                r = Request(f"r{trial}", 0.0, int(rng.integers(1000, 120_000)), max_output_tokens=900)
                ch = pol.select(r, c, SelectContext(random.Random(trial), 0.0, trial, cm))
                res.append((ch.replica, [ch.scores[x] for x in c.replicas]))
            out[on] = res
            rng = np.random.default_rng(11)
    finally:
        kernels.use_compiled(True)
    assert out[True] == out[False]


def test_the_options_are_checked_and_tell_the_router_to_keep_the_facts():
    assert make_policy("ep_aware").session_facts is None
    assert make_policy("ep_aware", session_forecast=True).session_facts == 60.0
    assert make_policy("ep_aware", prefill_at_once=True, return_horizon_s=30.0).session_facts == 30.0
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="return_horizon_s"):
            make_policy("ep_aware", session_forecast=True, return_horizon_s=bad)


# ---------------------------------------------------------------- the router feeds them
class _Recorder(Policy):
    """Picks the rank named by the request id's last digit; records the facts it was given."""

    name = "recorder_test"
    seen: list

    def __init__(self) -> None:
        self.seen = []

    @property
    def session_facts(self) -> float | None:
        return 60.0

    def select(self, request, cands, ctx):  # noqa: ANN001, ANN201
        self.seen.append((request.request_id, cands.prefill_inflight.tolist(), cands.returning_requests.tolist(),
                          cands.returning_kv_tokens.tolist()))
        return Choice(cands.replicas[int(request.request_id[-1]) % len(cands)], {})


def test_the_router_feeds_the_facts_from_what_it_routes():
    pol = _Recorder()
    router = Router(pol, pol)
    for i in range(2):
        router.add_replica(ReplicaId("e", i), Role.MIXED)
    r = lambda rid, t, s, p=1000: Request(rid, t, p, max_output_tokens=100, session_id=s)  # noqa: E731
    router.route(r("a0", 0.0, "A"), 0.0)  # session A to rank 0: 1,000 uncached tokens there
    router.route(r("b1", 1.0, "B", 2000), 1.0)  # session B to rank 1
    assert pol.seen[-1][1] == [1, 0]  # b1 saw a0's prompt in prefill on rank 0
    router.on_first_token("a0", 2.0)
    router.on_finished("a0", 10.0, 100)  # A idle on rank 0, context 1,000 + 100
    router.route(r("c1", 40.0, None), 40.0)  # (no session) at 40 s: A 30 s idle -> 1 - 30/60 = 0.5
    assert pol.seen[-1][1] == [0, 1] and pol.seen[-1][2] == [0.5, 0.0]
    assert pol.seen[-1][3] == pytest.approx([550.0, 0.0])
    router.on_finished("b1", 41.0, 50)  # B idle on rank 1, context 2,050
    router.route(r("a2", 46.0, "A", 1200), 46.0)  # A returns: its own record is gone before it is priced
    assert pol.seen[-1][2] == [0.0, pytest.approx(1 - 5 / 60)]
    assert pol.seen[-1][3] == [0.0, pytest.approx((1 - 5 / 60) * 2050)]
    router.on_finished("c1", 47.0, 3)  # no session: nothing recorded
    assert sorted(router.session_facts.sessions._idle) == ["B"]
    # pickled and restored, the facts come along
    again = pickle.loads(pickle.dumps(router))
    assert sorted(again.session_facts.sessions._idle) == ["B"]
    router.remove_replica(ReplicaId("e", 1))  # B's rank removed: B forgotten
    assert len(router.session_facts.sessions) == 0


def test_a_router_whose_policies_read_no_facts_keeps_none():
    router = Router("ep_aware", "ep_aware")
    router.add_replica(ReplicaId("e", 0), Role.MIXED)
    router.route(Request("x", 0.0, 100, session_id="s"), 0.0)
    router.on_finished("x", 1.0, 1)
    assert router.session_facts is None
    c = router.candidates(Request("y", 2.0, 100), "decode")
    assert c.prefill_inflight is None and c.returning_requests is None
    assert isinstance(Router("ep_aware:session_forecast=true", "ep_aware").session_facts, SessionFacts)
    assert isinstance(Router("round_robin", "ep_aware:prefill_at_once=true").decode_policy, EpAware)
