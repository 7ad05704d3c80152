"""``ep_aware`` and its cost model (balancer/policies/ep_aware.py, balancer/cost_model.py).

Expected costs are hand-computed from the formulas in the module docstrings with round
coefficients (stated in each test); fits are checked against the coefficients that generated the
synthetic timings.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.cost_model import (
    CostLearner,
    CostModel,
    DecodeStepCost,
    EngineCost,
    OnlineFit,
    PrefillStepCost,
    fit_step_cost,
)
from balancer.policies import make_policy
from balancer.policies.base import SelectContext
from balancer.router import Router
from balancer.types import ReplicaId, Request, Role
from tests.balancer_factories import blocks, cands, view

C = 8192
# prefill: 10 ms per step + 0.1 ms per token on the slowest rank; no attention or expert terms
PF = PrefillStepCost(overhead_s=0.01, per_token_s=1e-4, per_attn_pair_s=0.0, per_group_token_s=0.0)
DC = DecodeStepCost(overhead_s=0.02, per_seq_s=1e-4, per_kv_token_s=1e-8, per_group_seq_s=0.0)


def model(ep: bool = True, pf: PrefillStepCost = PF, dc: DecodeStepCost = DC, **kw) -> CostModel:
    e = EngineCost(pf, dc, C, ep)
    return CostModel(prefill=e, decode=e, **kw)


def ctx(cm: CostModel, seed: int = 0) -> SelectContext:
    return SelectContext(random.Random(seed), 0.0, 0, cm)


def exact(**kw):
    """ep_aware without the heuristic terms, so hand computation is exact (and with the SLO test
    taken at face value, ``slo_margin=1``, unless a test says otherwise)."""
    kw.setdefault("slo_margin", 1.0)
    return make_policy("ep_aware", horizon_weight=0.0, tie_tolerance=0.0, **kw)


def pview(engine: str, dp: int, q: int = 0, n: int = 0, matched: int = 0):
    return view(engine, Role.PREFILL, dp=dp, prefill_tokens=q, num_requests=n, matched_tokens=matched,
                block_size=512)


# ---------------------------------------------------------------------- prefill
def test_avoids_an_ep_engine_with_one_loaded_rank_even_if_another_rank_is_empty():
    # engine A: rank 0 has 32,768 queued tokens, rank 1 none; engine B idle; a 1,000-token prompt.
    c = cands(pview("A", 0, 32768, 1), pview("A", 1), pview("B", 0), pview("B", 1))
    ch = exact().select(Request("r", 0.0, 1000), c, ctx(model()))
    s = {f"{r.engine}{r.dp_rank}": v for r, v in ch.scores.items()}
    # A1: S = 1 step; A0 does min(1, 8192/32768) = 1/4 of its queue = 8,192 tokens in it, the
    # slowest rank: 0.01 + 1e-4 * 8192 = 0.8292 s
    assert s["A1"] == pytest.approx(0.8292)
    # A0: 33,768 tokens, S = 5: 0.05 + 3.3768
    assert s["A0"] == pytest.approx(3.4268)
    # B: one step of 1,000 tokens: 0.01 + 0.1
    assert s["B0"] == pytest.approx(0.11) and s["B1"] == pytest.approx(0.11)
    assert ch.replica.engine == "B"
    # with the default (heuristic) terms the answer is the same
    assert make_policy("ep_aware").select(Request("r", 0.0, 1000), c, ctx(model())).replica.engine == "B"
    # an anchor that scores ranks one by one takes the empty rank of the loaded engine as readily
    assert make_policy("least_load").select(Request("r", 0.0, 1000), c, ctx(model())).replica != ReplicaId("A", 0)


def test_a_long_prompt_goes_where_it_delays_fewer_queued_requests():
    # routed experts cost 1e-5 s per token of the whole group. A: rank 0 holds 8 short requests
    # (8,000 tokens); B: rank 0 holds one request of 8,000 tokens. A 40,000-token prompt.
    pf = PrefillStepCost(0.01, 1e-4, 0.0, 1e-5)
    c = cands(pview("A", 0, 8000, 8), pview("A", 1), pview("B", 0, 8000, 1), pview("B", 1))
    ch = exact().select(Request("r", 0.0, 40000), c, ctx(model(pf=pf)))
    s = {f"{r.engine}{r.dp_rank}": v for r, v in ch.scores.items()}
    # rank 1 of either engine: S = 5, itself the slowest (4.0 s of work vs 0.8), group sum
    # 8,000 + 40,000: wait = 0.05 + 4.0 + 0.48 = 4.53; externality 1e-5 * 40,000 * N_after with
    # N_after = 8 (A) or 1 (B) requests still queued on rank 0
    assert s["A1"] == pytest.approx(4.53 + 3.2)
    assert s["B1"] == pytest.approx(4.53 + 0.4)
    # rank 0 of either: 48,000 tokens, S = 6: 0.06 + 4.8 + 0.48, nobody queued after it
    assert s["A0"] == pytest.approx(5.34) and s["B0"] == pytest.approx(5.34)
    assert ch.replica == ReplicaId("B", 1)


@pytest.mark.parametrize("queued, expect", [(4096, "hit"), (16384, "idle")])
def test_the_hit_worth_a_wait_and_the_one_that_is_not(queued, expect):
    # dense engines (each rank steps alone). A 10,240-token prompt: 8,192 tokens cached on "hit"
    # behind `queued` tokens, nothing cached on the idle rank.
    c = cands(pview("hit", 0, queued, 1, matched=8192), pview("idle", 0))
    ch = exact().select(Request("r", 0.0, 10240), c, ctx(model(ep=False)))
    s = {r.engine: v for r, v in ch.scores.items()}
    assert s["idle"] == pytest.approx(0.02 + 1.024)  # 10,240 tokens in 2 steps
    steps = math.ceil((queued + 2048) / C)
    assert s["hit"] == pytest.approx(0.01 * steps + 1e-4 * (queued + 2048))
    assert ch.replica.engine == expect


def test_later_chunks_of_a_long_prompt_cost_more_attention():
    e = EngineCost(PrefillStepCost(0.01, 1e-4, 1e-9, 0.0), DC, C, False)
    # the same 8,192 new tokens after 32,768 cached ones pay 8192 * 32768 more attention pairs
    assert e.prefill_time_s(8192, 32768) - e.prefill_time_s(8192, 0) == pytest.approx(1e-9 * 8192 * 32768)


def test_lower_tier_fetch_time_is_added():
    cm = model(ep=False, host_fetch_s_per_token=1e-5)
    c = cands(pview("a", 0), pview("b", 0))
    c.hbm_blocks = np.array([0, 0])
    c.host_blocks = np.array([4, 0])  # 4 blocks of 512 on a's host tier
    c.store_blocks = np.array([0, 0])
    s = {r.engine: v for r, v in exact().select(Request("r", 0.0, 4096), c, ctx(cm)).scores.items()}
    # a: computes 2,048 tokens (1 step) and fetches 2,048: 0.01 + 0.2048 + 0.02048
    assert s["a"] == pytest.approx(0.01 + 0.2048 + 0.02048)
    assert s["b"] == pytest.approx(0.01 + 0.4096)


# ---------------------------------------------------------------------- decode
def dview(engine: str, dp: int, b: int, kv: int, cap: int = 10**7, matched: int = 0):
    return view(engine, Role.DECODE, dp=dp, num_requests=b, decode_kv_tokens=kv, kv_capacity_tokens=cap,
                matched_tokens=matched, block_size=512)


def test_decode_avoids_an_engine_whose_busiest_rank_sets_a_slow_step():
    # A's rank 0 runs 200 sequences over 2M KV tokens, its rank 1 is empty; B's ranks are even.
    c = cands(dview("A", 0, 200, 2_000_000), dview("A", 1, 0, 0), dview("B", 0, 5, 50_000), dview("B", 1, 5, 50_000))
    r = Request("r", 0.0, 1000, max_output_tokens=100)
    ch = exact().select(r, c, ctx(model()))
    s = {f"{x.engine}{x.dp_rank}": v for x, v in ch.scores.items()}
    # A1: A steps at 0.02 + 200e-4 + 2e6 * 1e-8 = 0.06 s before and after: 100 tokens x 0.06
    assert s["A1"] == pytest.approx(6.0)
    # B0: 0.021 s before; after max seqs 6, max KV 50,000 + 1,000 + 50: 0.0211105; 10 sequences
    # share the step: 100 * (0.0211105 + 10 * 0.0001105)
    assert s["B0"] == pytest.approx(100 * (0.0211105 + 10 * 0.0001105))
    assert ch.replica.engine == "B"
    # least_load (KV tokens) takes the empty rank of the slow engine
    assert make_policy("least_load").select(r, c, ctx(model())).replica == ReplicaId("A", 1)


def test_decode_respects_kv_capacity_and_reports_when_no_rank_has_room():
    r = Request("r", 0.0, 2000, max_output_tokens=100)
    c = cands(dview("small", 0, 0, 0, cap=1000), dview("big", 0, 50, 50_000, cap=1_000_000))
    ch = exact().select(r, c, ctx(model(ep=False)))
    assert ch.replica.engine == "big" and ch.reason == "ep_aware:decode"
    # neither has room for 2,100 tokens: the one with most room, flagged
    c = cands(dview("a", 0, 0, 0, cap=1000), dview("b", 0, 0, 0, cap=1500))
    ch = exact().select(r, c, ctx(model(ep=False)))
    assert ch.replica.engine == "b" and ch.reason.endswith("no_kv_room")


def test_decode_prefers_the_rank_that_saves_the_transfer():
    cm = model(ep=False, transfer_s_per_token=1e-4)
    r = Request("r", 0.0, 4096, max_output_tokens=10)
    c = cands(dview("a", 0, 1, 1000, matched=4096), dview("b", 0, 0, 0))
    s = {x.engine: v for x, v in exact().select(r, c, ctx(cm)).scores.items()}
    # a (holds the prompt, one sequence of 1,000 KV): 0.02011 s before; after 2 sequences and
    # 1,000 + 4,096 + 5 KV: 0.02025101; 1 sequence shares it: 10 * (0.02025101 + 0.00014101)
    assert s["a"] == pytest.approx(10 * (0.02025101 + 0.00014101))
    # b (empty): 10 * 0.02014101, plus moving 4,096 tokens at 1e-4 s each
    assert s["b"] == pytest.approx(10 * 0.02014101 + 0.4096)
    assert min(s, key=s.get) == "a"


# ---------------------------------------------------------------------- no collapse
@settings(max_examples=30, deadline=None)
@given(prefix_blocks=st.integers(4, 32), question_tokens=st.integers(64, 2048), engines=st.integers(2, 4),
       ranks=st.integers(1, 4), burst=st.integers(8, 64), ep=st.booleans())
def test_shared_prefix_traffic_does_not_collapse_onto_one_replica(prefix_blocks, question_tokens, engines, ranks,
                                                                  burst, ep):
    """A burst of prompts sharing a long system prompt, all in flight at once: the holder's queue
    never grows past the cost of recomputing the prefix elsewhere, so while some rank is idle no
    rank holds more than one prompt's worth of queued tokens above the least loaded."""
    bs = 512
    router = Router("ep_aware", "ep_aware", block_size=bs, cost_model=model(ep=ep), seed=1)
    for e in range(engines):
        for d in range(ranks):
            router.add_replica(ReplicaId(f"p{e}", d), "prefill")
    router.add_replica(ReplicaId("d", 0), "decode", kv_capacity_tokens=10**9)
    prefix = list(range(1, prefix_blocks + 1))
    prompt = prefix_blocks * bs + question_tokens
    for i in range(burst):
        ids = prefix + [10_000 + i]
        r = Request(f"r{i}", 0.0, prompt, blocks(ids[: prompt // bs]), max_output_tokens=8)
        router.route(r, 0.0)
        q = np.array([router.load.get(ReplicaId(f"p{e}", d)).prefill_tokens
                      for e in range(engines) for d in range(ranks)])
        if q.min() == 0:
            assert q.max() <= prompt + C, q


# ---------------------------------------------------------------------- cost model fitting
def test_fit_step_cost_recovers_a_linear_step_model():
    true_p = np.array([0.01, 1e-4, 1e-9, 2e-5])
    true_d = np.array([0.02, 1e-4, 1e-8, 3e-5])

    def step(pt, pp, ds, dc):  # a wide-EP engine whose step is exactly linear in the features
        pt, pp, ds, dc = map(np.asarray, (pt, pp, ds, dc))
        pf = true_p[0] + true_p[1] * pt.max(-1) + true_p[2] * pp.max(-1) + true_p[3] * pt.sum(-1)
        de = true_d[0] + true_d[1] * ds.max(-1) + true_d[2] * dc.max(-1) + true_d[3] * ds.sum(-1)
        return np.where(pt.sum(-1) > 0, pf, de)

    e = fit_step_cost(step, 8, C)
    np.testing.assert_allclose(e.prefill.coef(), true_p, rtol=1e-6)
    np.testing.assert_allclose(e.decode.coef(), true_d, rtol=1e-6)
    assert e.ep_synchronous and e.chunk_tokens == C


def test_fitted_model_matches_the_simulator_perf_model_within_a_tenth():
    from sim.run.pool_perf import build_perf
    from sim.run.router_cost import cost_model_for
    from sim.scenario import load_scenario

    sc = load_scenario("dsv3-pd-h200")
    cm = cost_model_for(sc)
    perf = build_perf(sc, sc.prefill)
    # one full 8,192-token chunk on every rank after 4k cached tokens, and one alone
    for tok in (np.full(8, 8192.0), np.array([8192.0] + [0.0] * 7)):
        pairs = tok * 4096 + tok * (tok + 1) / 2
        true = float(perf.step_time_s(tok[None], pairs[None], np.zeros((1, 8)), np.zeros((1, 8)))[0])
        x = np.array([1.0, tok.max(), pairs.max(), tok.sum()])
        assert x @ cm.prefill.prefill.coef() == pytest.approx(true, rel=0.1)


def test_online_fit_converges_to_the_generating_coefficients():
    rng = np.random.default_rng(0)
    true = np.array([0.01, 1e-4, 1e-9, 2e-5])
    fits = {w: OnlineFit(2 * true, forgetting=0.999, prior_weight=w) for w in (0.0, 0.01)}
    xs = []
    for _ in range(3000):
        x = np.array([rng.integers(1, 5), rng.uniform(0, 30000), rng.uniform(0, 5e8), rng.uniform(0, 2e5)])
        xs.append(x)
        for fit in fits.values():
            fit.observe(x, float(x @ true))
    # without the prior the noise-free data give the coefficients back
    np.testing.assert_allclose(fits[0.0].refit(), true, rtol=1e-6)
    # with the default pull towards a 2x-wrong prior predictions stay within 1% on average
    # and 5% at worst (the small overhead term gives way first)
    X = np.array(xs[-500:])
    err = np.abs(X @ fits[0.01].refit() / (X @ true) - 1.0)
    assert err.mean() < 0.01 and err.max() < 0.05, (err.mean(), err.max())


def test_router_learns_the_prefill_model_from_hook_timestamps():
    """The router records the chosen placement's features at dispatch and observes the prefill
    time the hooks report; timings generated by a known model are learned back."""
    true = PrefillStepCost(0.015, 7e-5, 2e-10, 0.0)
    prior = model(ep=False, pf=PrefillStepCost(0.03, 2e-5, 1e-9, 0.0))
    router = Router("ep_aware", "ep_aware", block_size=512, cost_model=prior, learn_cost_model=True)
    router.add_replica(ReplicaId("p", 0), "prefill")
    router.add_replica(ReplicaId("d", 0), "decode", kv_capacity_tokens=10**9)
    rng = random.Random(0)
    t = 0.0
    for i in range(600):
        p = rng.randint(500, 40000)
        router.route(Request(f"r{i}", t, p, max_output_tokens=2), t)
        dt = EngineCost(true, DC, C, False).prefill_time_s(p)  # alone on an idle rank
        router.on_prefill_done(f"r{i}", t + dt)
        router.on_first_token(f"r{i}", t + dt + 0.01)
        router.on_finished(f"r{i}", t + dt + 0.05, 2)  # one gap of 40 ms
        t += dt + 1.0
    learned = EngineCost(router.cost_learner.model.prefill.prefill, DC, C, False)
    truth = EngineCost(true, DC, C, False)
    for p in (800, 5000, 20000, 38000):  # the prior was off by 2-5x; the fit predicts within 3%
        assert learned.prefill_time_s(p) == pytest.approx(truth.prefill_time_s(p), rel=0.03)
    assert router.cost_learner.num_observations["prefill"] == 600
    # decode: one sequence at a time, each with one inter-token gap of 40 ms: the fit predicts
    # 40 ms for such a step whatever its KV length
    dc = router.cost_learner.model.decode.decode.coef()
    for kv in (1000.0, 20000.0):
        assert np.array([1.0, 1.0, kv, 0.0]) @ dc == pytest.approx(0.04, rel=0.05)
    assert router.cost_learner.num_observations["decode"] == 600


def test_cost_model_round_trips_through_its_table_and_rejects_bad_terms():
    from sim.run.router_cost import cost_model_for
    from sim.scenario import load_scenario

    cm = cost_model_for(load_scenario("llama8b-agg-h100"))
    assert CostModel.from_dict(cm.to_dict()) == cm
    with pytest.raises(ValueError, match="per_tokens"):
        CostModel.from_dict({"prefill": {"prefill": {"per_tokens": 1.0}}})
    with pytest.raises(ValueError, match="transfer_s_per_token must be a finite number >= 0"):
        CostModel.from_dict({"transfer_s_per_token": -1})


# ---------------------------------------------------------------------- one core, sim and service
def test_same_decisions_in_the_simulator_router_and_the_service_router():
    """The service builds its router from its config exactly as the simulator does from a
    scenario: the same requests and hooks give the same decisions (learning on in both)."""
    from balancer.service.config import ServiceConfig
    from balancer.service.app import Service
    from sim.run.router_cost import cost_model_for
    from sim.scenario import load_scenario

    cm = cost_model_for(load_scenario("dsv3-pd-h200"))
    sim_router = Router("ep_aware", "ep_aware", block_size=64, cost_model=cm, learn_cost_model=True, seed=7)
    svc = Service(ServiceConfig(cost_model=cm.to_dict(), seed=7))
    svc_router = svc.router
    for router in (sim_router, svc_router):
        for e in range(3):
            for d in range(4):
                router.add_replica(ReplicaId(f"http://p{e}", d), "prefill")
        router.add_replica(ReplicaId("http://d0", 0), "decode", kv_capacity_tokens=10**7)
    rng = random.Random(3)
    live: list[tuple[float, str, str]] = []
    t = 0.0
    for i in range(300):
        t += rng.expovariate(4.0)
        hashes = tuple(rng.randint(1, 30) for _ in range(rng.randint(1, 40)))
        req = Request(f"r{i}", t, max(1, len(hashes) * 64 - rng.randint(0, 63)), hashes, max_output_tokens=50)
        a, b = sim_router.route(req, t), svc_router.route(req, t)
        assert (a.prefill, a.decode) == (b.prefill, b.decode), i
        live.append((t + rng.uniform(0.1, 2.0), "done", req.request_id))
        live.sort()
        while live and live[0][0] <= t:
            when, _, rid_ = live.pop(0)
            for router in (sim_router, svc_router):
                router.on_prefill_done(rid_, when)
                router.on_first_token(rid_, when)
                router.on_finished(rid_, when + 0.5, 50)
    assert svc_router.cost_learner is not None and sim_router.cost_learner.model == svc_router.cost_learner.model


def test_mixed_ranks_price_the_stall_a_prompt_causes_to_their_decode_batch():
    # dense mixed ranks with 10 running sequences each; a 10,240-token prompt, 8,192 of it cached on
    # "a": its chunks hold the batch 1e-4 s per computed token -> 10 x 0.2048 s on a, 10 x 1.024 s on b
    c = cands(view("a", Role.MIXED, num_requests=10, matched_tokens=8192, block_size=512),
              view("b", Role.MIXED, num_requests=10, block_size=512))
    cm = model(ep=False)
    names, idx, rows = ("a", "b"), np.array([0, 1]), np.array([[0], [1]])
    stall = exact()._mixed_stall(Request("r", 0.0, 10240), c, cm, names, idx, rows)
    np.testing.assert_allclose(stall, [10 * 0.2048, 10 * 1.024])
    assert exact().select(Request("r", 0.0, 10240, max_output_tokens=16), c, ctx(cm)).replica.engine == "a"


def test_default_cost_model_is_the_rounded_fit_it_claims_to_be():
    # DEFAULT_COST_MODEL's docstring: dsv3-pd-h200's fit rounded to two digits
    from balancer.cost_model import DEFAULT_COST_MODEL
    from sim.run.router_cost import cost_model_for
    from sim.scenario import load_scenario

    fit = cost_model_for(load_scenario("dsv3-pd-h200"))
    np.testing.assert_allclose(DEFAULT_COST_MODEL.prefill.prefill.coef(), fit.prefill.prefill.coef(), rtol=0.05, atol=1e-9)
    np.testing.assert_allclose(DEFAULT_COST_MODEL.decode.decode.coef(), fit.decode.decode.coef(), rtol=0.05, atol=1e-9)
    assert DEFAULT_COST_MODEL.transfer_s_per_token == pytest.approx(fit.transfer_s_per_token, rel=0.05)


# ---------------------------------------------------------------------- SLO-aware placement
def dense_model() -> CostModel:
    return model(ep=False)


def slo_ctx(cm: CostModel, ttft_s: float, per_1k: float = 0.0) -> SelectContext:
    from balancer.types import TtftSlo

    return SelectContext(random.Random(0), 0.0, 0, cm, TtftSlo(ttft_s, per_1k))


def test_slo_feasible_candidates_only_when_the_cheapest_misses_the_budget():
    # dense ranks (each its own engine): A holds 10,000 queued tokens, B 20,000; a 3,000-token
    # prompt whose first 2,000 tokens are cached on B only. Times (0.01 s/step, 1e-4 s/token, C = 8192):
    #   A: u = 3,000, q' = 13,000, 2 steps: 0.02 + 1.3 = 1.32 s
    #   B: u = 1,000, q' = 21,000, 3 steps: 0.03 + 2.1 = 2.13 s
    c = cands(pview("A", 0, 10_000, 1), pview("B", 0, 20_000, 2, matched=2000))
    req = Request("r", 0.0, 3000)
    pol = exact()
    s = {r.engine: v for r, v in pol.select(req, c, ctx(dense_model())).scores.items()}
    assert s["A"] == pytest.approx(1.32) and s["B"] == pytest.approx(2.13)
    # a budget both meet: the same answer as SLO-blind (the cheapest, A)
    assert pol.select(req, c, slo_ctx(dense_model(), 5.0)).replica.engine == "A"
    # a budget of 1.2 s: neither meets it -> doomed: no harm terms on a dense rank, so within 5x
    # the budget (6 s) the longest wait for the least own work, score 2 own - ttft: A's own
    # 0.01 + 0.3 = 0.31 s -> -0.70; B's own 0.01 + 0.1 = 0.11 s -> -1.91: B, leaving A's short
    # queue to others
    ch = pol.select(req, c, slo_ctx(dense_model(), 1.2))
    assert ch.replica.engine == "B" and ch.reason == "ep_aware:prefill:slo_doomed"
    assert ch.scores[ReplicaId("B", 0)] == pytest.approx(-1.91) and ch.scores[ReplicaId("A", 0)] == pytest.approx(-0.70)
    # the policy's own budget overrides the router's; slo_aware=false ignores the router's
    assert exact(ttft_slo_s=5.0).select(req, c, slo_ctx(dense_model(), 1.2)).replica.engine == "A"
    assert exact(slo_aware=False).select(req, c, slo_ctx(dense_model(), 1.2)).replica.engine == "A"
    # the doomed cap: with slo_doomed_cap = 1.5 (1.8 s) B (2.13 s) is past it, A (1.32 s) is not
    assert exact(slo_doomed_cap=1.5).select(req, c, slo_ctx(dense_model(), 1.2)).replica.engine == "A"
    # every queue past the cap: back to the least predicted TTFT (A)
    assert exact(slo_doomed_cap=1.0).select(req, c, slo_ctx(dense_model(), 1.2)).replica.engine == "A"


def test_slo_a_feasible_candidate_beats_a_cheaper_infeasible_one():
    # the cost includes the externality on EP engines, so the cheapest can miss the budget while
    # a dearer one meets it. Per-group 1e-5 s/token; engine A (EP2): rank 0 holds 4 requests,
    # 4,000 tokens; rank 1 empty. Engine B (EP2): rank 0 holds 9,000 tokens in 1 request.
    pf = PrefillStepCost(overhead_s=0.01, per_token_s=1e-4, per_attn_pair_s=0.0, per_group_token_s=1e-5)
    cm = model(pf=pf)
    c = cands(pview("A", 0, 4000, 4), pview("A", 1), pview("B", 0, 9000, 1), pview("B", 1))
    req = Request("r", 0.0, 4000)
    pol = exact(slo_wide_ep=True)  # both engines are wide EP: SLO-aware only when asked
    ch = pol.select(req, c, ctx(cm))
    s = {f"{r.engine}{r.dp_rank}": v for r, v in ch.scores.items()}
    # A1: 1 step; slowest rank A0 (4,000 tokens) vs A1 (4,000): 0.01 + 0.4 + group 1e-5 * 8,000 = 0.49 s
    #     + externality 1e-5 * 4,000 * N_after; N_after = 4 * clip((4000 - 0) / 4000) = 4 -> 0.16
    assert s["A1"] == pytest.approx(0.49 + 0.16)
    # B1: S = 1 step of min(9000, 8192) on B0: 0.01 + 0.8192 + 1e-5 * (8192 + 4000) = 0.95112
    #     + externality 1e-5 * 4,000 * 1 = 0.04
    assert s["B1"] == pytest.approx(0.95112 + 0.04)
    # SLO-blind: A1 (0.65). A budget of 0.6 s: A1's TTFT (0.49) meets it, so still A1; a budget
    # of 0.45 s: nothing meets it (A1 0.49, B1 0.951, A0 0.81+, B0 1.3+) -> doomed: least harm
    assert ch.replica == ReplicaId("A", 1)
    assert pol.select(req, c, slo_ctx(cm, 0.6)).replica == ReplicaId("A", 1)
    # harm = cost - TTFT = the externality: A1 0.16, B1 0.04, A0 and B0 0 (their partner ranks are
    # empty). Of A0 and B0, within 5 x 0.45 s, the longest wait for the least own work, score
    # 2 own - ttft; own (idle rank) = 0.01 + (1e-4 + 1e-5) * 4,000 = 0.45 s on both.
    # A0: 1 step of 8,000 tokens: ttft 0.01 + 0.8 + 1e-5 * 8,000 = 0.89 s, score 0.01;
    # B0: 13,000 tokens, 2 steps: 0.02 + 1.3 + 0.13 = 1.45 s, score -0.55
    doomed = pol.select(req, c, slo_ctx(cm, 0.45))
    assert doomed.reason.endswith(":slo_doomed") and doomed.replica == ReplicaId("B", 0)
    assert doomed.scores[ReplicaId("B", 0)] == pytest.approx(-0.55)
    assert doomed.scores[ReplicaId("A", 0)] == pytest.approx(0.01)
    # by default (slo_wide_ep off) a pool of wide-EP engines is routed SLO-blind: the same choice,
    # scores and reason as without a budget (A1, 0.65 s), whatever the budget
    for budget in (0.45, 0.6):
        got = exact().select(req, c, slo_ctx(cm, budget))
        assert got.replica == ReplicaId("A", 1) and got.reason == "ep_aware:prefill"
        assert dict(got.scores.items()) == pytest.approx(dict(ch.scores.items()))


def test_slo_budget_grows_with_the_prompt():
    from balancer.types import TtftSlo

    assert TtftSlo(2.0, 0.1).budget_s(30_000) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="ttft_s"):
        TtftSlo(0.0)
    with pytest.raises(ValueError, match="per_1k"):
        TtftSlo(1.0, -1.0)
    with pytest.raises(ValueError, match="needs ttft_slo_s"):
        make_policy("ep_aware", ttft_slo_per_1k_tokens_s=0.1)
    with pytest.raises(ValueError, match="slo_margin"):
        make_policy("ep_aware", slo_margin=0.0)


def test_slo_router_hands_its_budget_to_the_policy_and_the_simulator_routes_against_the_point_slo():
    from balancer.types import TtftSlo
    from sim.search.point import SLO, Point, SimOptions, evaluate_point, parse_policy
    from sim.scenario import load_scenario
    from sim.workload import read_trace

    r = Router("ep_aware", "ep_aware", ttft_slo=TtftSlo(1.0))
    assert r.ttft_slo == TtftSlo(1.0)
    with pytest.raises(TypeError, match="TtftSlo"):
        Router("ep_aware", "ep_aware", ttft_slo=1.0)  # type: ignore[arg-type]
    # an overloaded dense cluster: the SLO-aware run takes doomed decisions, the blind one none
    sc = load_scenario("llama70b-pd-h100")
    reqs = read_trace(None)[:600]
    from sim.search.point import register_workload
    register_workload("test-slo-600", reqs)
    slo = SLO(ttft_s=2.0, tpot_s=0.1, ttft_per_1k_prompt_tokens_s=0.1)
    aware = evaluate_point(Point(sc, "test-slo-600", parse_policy("ep_aware"), 1.0, slo))
    blind = evaluate_point(Point(sc, "test-slo-600", parse_policy("ep_aware"), 1.0, slo,
                                 options=SimOptions(route_slo=False)))
    assert aware.error is None and blind.error is None
    # the same requests, the same engines: only who waits differs, and SLO-aware meets more budgets
    # (measured when written: 43.2% vs 27.2% of the trace's first 600 requests, which arrive in a burst)
    assert aware.attainment > blind.attainment + 0.05


def test_slo_intrinsic_blind_places_a_prompt_too_long_for_any_budget_slo_blind():
    # budget 0.2 s; a 3,000-token prompt takes 0.31 s on an idle dense rank (0.01 + 3,000 * 1e-4),
    # so it misses everywhere whatever the load. A: 1,000 queued tokens (ttft 0.41 s), B: 5,000
    # (0.81 s). "dump" treats it as doomed (B: score 2 * 0.31 - 0.81 = -0.19 < A's 0.21);
    # "blind" places it as without an SLO (A, the cheapest). The default tail guard (0.5) keeps it
    # within 1.5 x 0.41 = 0.615 s: B (0.81 s) is out, so the doomed placement takes A; without the
    # guard (inf) it goes to B.
    c = cands(pview("A", 0, 1000, 1), pview("B", 0, 5000, 1))
    req = Request("r", 0.0, 3000)
    assert exact(slo_doomed_tail=float("inf")).select(req, c, slo_ctx(dense_model(), 0.2)).replica.engine == "B"
    ch = exact().select(req, c, slo_ctx(dense_model(), 0.2))
    assert ch.replica.engine == "A" and ch.reason == "ep_aware:prefill:slo_doomed"
    ch = exact(slo_intrinsic="blind").select(req, c, slo_ctx(dense_model(), 0.2))
    assert ch.replica.engine == "A" and ch.reason == "ep_aware:prefill"
    with pytest.raises(ValueError, match="slo_intrinsic"):
        make_policy("ep_aware", slo_intrinsic="drop")


def test_slo_doomed_cap_holds_on_wide_ep_where_the_least_harm_ranks_are_the_busiest():
    # Regression: the cap was applied inside the least-harm set, which on a
    # wide-EP engine is its busiest rank (no other rank waits behind it), so a doomed prompt went
    # into a 7 s queue while 1 s ones were free. Two EP2 engines; 0.01 s/step, 1e-4 s/token,
    # 1e-5 s/group token; a 4,000-token prompt, budget 0.3 s (its own 0.45 s already misses),
    # cap 10 budgets = 3 s. Hand-computed TTFTs:
    #   A0 (100,000 queued): 13 steps: 0.13 + 10.4 + 1e-5 * 105,000 = 11.58 s, harm 0
    #   B0 (60,000 queued): 8 steps: 0.08 + 6.4 + 1e-5 * 65,000 = 7.13 s, harm 0
    #   A1, B1 (1,000 queued): 1 step at the busy partner's pace: 0.01 + 0.8192 + 1e-5 * 13,192
    #     = 0.96112 s; harm = externality 1e-5 * 4,000 * 0.99 (A1) or * 0.98333 (B1), within 5%
    pf = PrefillStepCost(overhead_s=0.01, per_token_s=1e-4, per_attn_pair_s=0.0, per_group_token_s=1e-5)
    cm = model(pf=pf)
    c = cands(pview("A", 0, 100_000, 1), pview("A", 1, 1000, 1), pview("B", 0, 60_000, 1), pview("B", 1, 1000, 1))
    req = Request("r", 0.0, 4000)
    blind = exact().select(req, c, ctx(cm)).scores
    assert blind[ReplicaId("A", 1)] == pytest.approx(0.96112 + 0.0396)
    assert blind[ReplicaId("B", 0)] == pytest.approx(7.13)
    ch = exact(slo_doomed_cap=10.0, slo_wide_ep=True).select(req, c, slo_ctx(cm, 0.3))
    assert ch.reason.endswith(":slo_doomed")
    assert ch.replica in (ReplicaId("A", 1), ReplicaId("B", 1))  # within the cap, not the 7 s or 11.6 s queue


def test_slo_margin_default_takes_the_prediction_as_pessimistic():
    # the dense case of the first SLO test: A predicts 1.32 s, B 2.13 s; budget 1.2 s. Hand-built
    # candidates carry no in-service progress, so the default margin is 0.8: A counts as meeting it
    # (0.8 * 1.32 = 1.056 <= 1.2) and is taken as without an SLO; with 1.0 neither does and the
    # request is doomed (to B). Router-built ones on dense engines: tests/balancer/test_in_service_progress.py
    c = cands(pview("A", 0, 10_000, 1), pview("B", 0, 20_000, 2, matched=2000))
    req = Request("r", 0.0, 3000)
    assert make_policy("ep_aware").slo_margin is None  # auto
    ch = make_policy("ep_aware", horizon_weight=0.0, tie_tolerance=0.0).select(req, c, slo_ctx(dense_model(), 1.2))
    assert ch.replica.engine == "A" and ch.reason == "ep_aware:prefill"
    assert exact().select(req, c, slo_ctx(dense_model(), 1.2)).reason.endswith(":slo_doomed")


def test_sim_title_names_the_policies_that_route_against_the_slo():
    import argparse

    from pdlb_cli.sim.run import runs_slo_note as _route_slo_note

    runs = [(make_policy("ep_aware"), make_policy("ep_aware"), "ep_aware", "ep_aware"),
            (make_policy("cache_aware"), make_policy("least_load"), "cache_aware", "least_load"),
            ("ep_aware", "ep_aware", "blind", "blind")]
    on, off = argparse.Namespace(route_slo=True), argparse.Namespace(route_slo=False)
    assert _route_slo_note(off, runs) == ""
    assert _route_slo_note(on, runs) == ", routed against the TTFT SLO by ep_aware, blind"
    blind = make_policy("ep_aware", slo_aware=False)
    assert _route_slo_note(on, runs[1:2] + [(blind, blind, "x", "x")]) == ", --route-slo: no policy here routes against the SLO"
    # a policy with its own budget routes against it with or without --route-slo
    own = make_policy("ep_aware", ttft_slo_s=2.0, slo_aware=False)
    assert _route_slo_note(off, runs + [(own, own, "own", "own")]) == ", routed against their own TTFT budget: own"
    assert _route_slo_note(on, runs[1:2] + [(own, own, "own", "own")]) == ", routed against their own TTFT budget: own"


def test_router_takes_policy_specs_with_parameters():
    r = Router("ep_aware:ttft_slo_s=2,slo_margin=1", "least_load:metric=kv_tokens")
    assert r.prefill_policy.ttft_slo_s == 2.0 and r.prefill_policy.slo_margin == 1.0
    assert r.decode_policy.metric == "kv_tokens"
    with pytest.raises(ValueError, match="slo_margin"):
        Router("ep_aware:slo_margin=0")


def test_slo_doomed_tail_bounds_the_ttft_of_prompts_that_miss_even_on_an_idle_rank():
    # the dense case of the first SLO test: A predicts 1.32 s, B 2.13 s; own (idle-rank) prefill
    # A 0.31 s, B 0.11 s (hand-computed there). Budget 0.1 s: even idle both miss (intrinsically
    # doomed); no doomed cap (inf): without the guard it goes to B (score 2 own - ttft: A -0.70,
    # B -1.91); the default guard (0.5) is the case below.
    c = cands(pview("A", 0, 10_000, 1), pview("B", 0, 20_000, 2, matched=2000))
    req = Request("r", 0.0, 3000)
    inf = float("inf")
    assert exact(slo_doomed_cap=inf, slo_doomed_tail=inf).select(req, c, slo_ctx(dense_model(), 0.1)).replica.engine == "B"
    assert exact(slo_doomed_cap=inf).select(req, c, slo_ctx(dense_model(), 0.1)).replica.engine == "A"
    # tail guard 0.5: B's 2.13 s > 1.5 x 1.32 = 1.98 s is out, A is left (still a doomed decision)
    ch = exact(slo_doomed_cap=inf, slo_doomed_tail=0.5).select(req, c, slo_ctx(dense_model(), 0.1))
    assert ch.replica.engine == "A" and ch.reason.endswith(":slo_doomed")
    # 0.7: 1.7 x 1.32 = 2.244 s >= 2.13 s, B allowed again; 0: only the shortest (A)
    assert exact(slo_doomed_cap=inf, slo_doomed_tail=0.7).select(req, c, slo_ctx(dense_model(), 0.1)).replica.engine == "B"
    assert exact(slo_doomed_cap=inf, slo_doomed_tail=0.0).select(req, c, slo_ctx(dense_model(), 0.1)).replica.engine == "A"
    # doomed by queueing only (budget 1.2 s: both own times fit, both queues miss): not guarded, B
    ch = exact(slo_doomed_tail=0.0).select(req, c, slo_ctx(dense_model(), 1.2))
    assert ch.replica.engine == "B" and ch.reason.endswith(":slo_doomed")
    # requests that can still meet the budget are not touched: budget 5 s, the cheapest (A) either way
    assert exact(slo_doomed_tail=0.0).select(req, c, slo_ctx(dense_model(), 5.0)).replica.engine == "A"
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="slo_doomed_tail"):
            exact(slo_doomed_tail=bad)
