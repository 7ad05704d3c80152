"""Deadline admission with the routing policy's TTFT prediction (issue 28, open item 1): the core
with a :class:`~balancer.deadline_admission.TtftPrediction` in place of ``B / R`` and ``P / r``
(hand-computed), ``ep_aware``'s prediction on a real Router (its own prefill by the cost model's
formula, by hand), the wait models in the simulator, the setting and the flag."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from balancer.cost_model import DEFAULT_COST_MODEL
from balancer.deadline_admission import (
    AdmissionConfig,
    DeadlineAdmission,
    TtftPrediction,
    predict_pool_wait_s,
    predict_ttft,
    predictor_of,
    prefill_rate_tokens_per_s,
)
from balancer.router import Router
from balancer.service.admission_config import AdmissionSettings
from balancer.types import ReplicaId, Request, Role, TtftSlo
from pdlb_cli.admission_args import add_admission_args, admission_overrides
from sim.run.cluster import simulate
from sim.experiments.overload import TENANTS, capacity_rps, small_pd_scenario, tenant_workload

SLO = TtftSlo(2.0)  # dispatch_wait_s = 0.5 s


def _core(wait_model: str = "policy") -> DeadlineAdmission:
    return DeadlineAdmission(AdmissionConfig(SLO, wait_model=wait_model), rate_tokens_per_s=1000.0, num_replicas=1)


def test_prediction_replaces_the_fluid_wait_both_ways():
    # hand: 500 tokens at 1,000 tokens/s: P / r = 0.5 s. Backlog 1,800 tokens: W = 1.8 s, 1.8 + 0.5 = 2.3 > 2 -> shed
    assert _core().offer("a", "t", None, 500, 0.0, 1800).action == "shed"
    # the policy sees most of that backlog already prefilled: wait 0.4 + own 0.5 = 0.9 <= 2 -> held
    out = _core().offer("a", "t", None, 500, 0.0, 1800, prediction=TtftPrediction(0.4, 0.5))
    assert out.action == "hold"
    # the other way: an idle pool by the backlog (W = 0, 0.5 <= 2: held), but the policy predicts 1.8 + 0.3 = 2.1 > 2
    assert _core().offer("a", "t", None, 500, 0.0, 0).action == "hold"
    out = _core().offer("a", "t", None, 500, 0.0, 0, prediction=TtftPrediction(1.8, 0.3))
    assert out.action == "shed" and out.reason == "deadline" and out.retry_after_s == 2.0  # ceil(1.8)
    # "max": term by term, wait max(0.4, 1.8) = 1.8, own max(0.3, 0.5) = 0.5: 2.3 > 2 -> shed
    assert _core("max").offer("a", "t", None, 500, 0.0, 1800, prediction=TtftPrediction(0.4, 0.3)).action == "shed"
    # an over-budget prompt's deadline counts from the predicted own prefill: 0 + 3.0 + 2.0 = 5.0 s
    out = _core().offer("a", "t", None, 500, 0.0, 0, prediction=TtftPrediction(0.0, 3.0))
    assert out.action == "hold" and out.held.deadline_s == pytest.approx(5.0)


def test_drain_holds_a_head_whose_own_wait_is_long_and_keeps_its_turn():
    core = _core()
    a = core.offer("A1", "A", None, 100, 0.0, 0, prediction=TtftPrediction(0.0, 0.1)).held
    core.offer("B1", "B", None, 100, 0.0, 0, prediction=TtftPrediction(0.0, 0.1))
    waits = {"A1": 0.6, "B1": 0.1}

    def predict(h):
        return TtftPrediction(waits[h.key], 0.1)

    # DRR visits A first: its own wait 0.6 >= dispatch_wait 0.5 and 0.6 + 0.1 <= 2: held, B waits behind it
    assert core.drain(0.0, 0, wait_s=0.0, predict=predict) == []
    assert core.num_held == 2 and not a.done
    waits["A1"] = 0.2
    # A's turn was kept: A then B; B's wait 0.1 + A's 100 tokens at 1,000 tokens/s = 0.2 < 0.5
    outs = core.drain(0.1, 0, wait_s=0.0, predict=predict)
    assert [(o.held.key, o.action) for o in outs] == [("A1", "dispatch"), ("B1", "dispatch")]


def test_dispatch_time_shed_and_max_dispatch():
    core = _core()
    for k in ("x", "y", "z"):
        core.offer(k, "t", None, 100, 0.0, 0, prediction=TtftPrediction(0.0, 0.1))
    waits = {"x": 1.95, "y": 0.0, "z": 0.0}  # x: 1.95 + 0.1 > 2 s: shed at dispatch, though its wait >= 0.5
    outs = core.drain(0.0, 0, wait_s=0.0, predict=lambda h: TtftPrediction(waits[h.key], 0.1), max_dispatch=1)
    assert [(o.held.key, o.action) for o in outs] == [("x", "shed"), ("y", "dispatch")]  # stops after one dispatch
    assert core.num_held == 1


def _pd_router(prefill_policy: str = "ep_aware") -> Router:
    r = Router(prefill_policy, "least_load", block_size=16)
    for name in ("p0", "p1"):
        r.add_replica(ReplicaId(name), Role.PREFILL)
    r.add_replica(ReplicaId("d0"), Role.DECODE)
    return r


def test_ep_aware_prediction_on_a_real_router():
    r = _pd_router()
    assert predictor_of(r) is r.prefill_policy
    eng = DEFAULT_COST_MODEL.prefill
    c = eng.prefill
    u = 3000
    # hand (the cost model's formula, docs/policies/ep_aware.md): ceil(u / C) step overheads + (per_token +
    # per_group_token) u + per_attn_pair u (u + 1) / 2 with nothing cached
    own = math.ceil(u / eng.chunk_tokens) * c.overhead_s + (c.per_token_s + c.per_group_token_s) * u \
        + c.per_attn_pair_s * u * (u + 1) / 2
    p = predict_ttft(r, Request("q", 0.0, u), 0.0)
    assert p is not None and p.own_s == pytest.approx(own, rel=1e-9) and p.wait_s == pytest.approx(0.0, abs=1e-9)
    assert predict_pool_wait_s(r, 0.0) == pytest.approx(0.0, abs=1e-9)
    r.route(Request("big0", 0.0, 20000), 0.0)  # one prefill rank busy: the other is still idle, no wait
    assert predict_ttft(r, Request("q", 0.0, u), 0.0).wait_s == pytest.approx(0.0, abs=1e-9)
    r.route(Request("big1", 0.0, 20000), 0.0)  # both busy: a wait
    p = predict_ttft(r, Request("q", 0.0, u), 0.0)
    assert p.wait_s > 0 and p.own_s == pytest.approx(own, rel=1e-9)
    # the wait is the queued 20,000-token prompt's own prefill (the same formula, by hand; its chunks' steps may
    # carry the new prompt's first tokens: within 5%), attention's quadratic term included: more than the fluid
    # backlog / rate (40,000 tokens over 2 ranks at a full chunk's rate), which is what makes that optimistic
    q = 20000
    queued = math.ceil(q / eng.chunk_tokens) * c.overhead_s + (c.per_token_s + c.per_group_token_s) * q \
        + c.per_attn_pair_s * q * (q + 1) / 2
    assert p.wait_s == pytest.approx(queued, rel=0.05)
    assert p.wait_s > 40000 / (2 * prefill_rate_tokens_per_s(DEFAULT_COST_MODEL, True))
    # the prediction changed nothing: only the two routed requests' decisions are counted
    assert r.metrics()["decisions"] == {"prefill": {"ep_aware:prefill": 2}, "decode": {"least_load": 2}}


def test_policies_without_a_prediction_keep_the_backlog():
    r = _pd_router("least_load")
    assert predictor_of(r) is None and predict_ttft(r, Request("q", 0.0, 100), 0.0) is None


@pytest.mark.parametrize("wait_model", ["policy", "max"])
def test_simulator_wait_models_answer_every_request(wait_model):
    sc = small_pd_scenario()
    cap = capacity_rps(sc, 2000.0)
    light = tenant_workload({t: cap / 10 for t in TENANTS}, 10.0, seed=3)
    base = simulate(sc, light, "ep_aware", "least_load")
    on = simulate(sc, light, "ep_aware", "least_load", admission=AdmissionConfig(TtftSlo(1.0), wait_model=wait_model))
    # light load (30% of capacity): nothing held or shed, the same timings as without admission
    assert on.records.num_shed == 0
    np.testing.assert_allclose(on.records.first_token_s, base.records.first_token_s)
    # the policy's prediction at dispatch against the simulator's own step model (the cost model is fitted
    # to it, an independent implementation of the prefill steps): at light load the median error is 0 to
    # within 1 ms and no prediction is short by more than 10 ms
    adm = on.extra["admission"]
    err = (on.records.prefill_end_s - adm.dispatch_s) - adm.predicted_prefill_s
    assert not np.isnan(err).any()
    assert abs(float(np.median(err))) < 1e-3 and float(err.max()) < 0.01
    over = tenant_workload({t: 2 * cap / 3 for t in TENANTS}, 10.0, seed=4)
    res = simulate(sc, over, "ep_aware", "least_load", admission=AdmissionConfig(TtftSlo(1.0), wait_model=wait_model))
    served = ~np.isnan(res.records.first_token_s)
    shed = ~np.isnan(res.extra["admission"].shed_s)
    assert shed.any() and np.all(served ^ shed)  # each request served xor shed, none lost
    dl = res.extra["admission"].deadline_s
    assert np.all(np.isfinite(dl)) and np.all(dl >= res.records.arrival_s + 1.0 - 1e-9)


def test_wait_model_setting_and_flag():
    assert AdmissionSettings().wait_model == "backlog" and AdmissionSettings().to_core().wait_model == "backlog"
    assert AdmissionSettings(wait_model="max").to_core().wait_model == "max"
    with pytest.raises(ValueError, match="wait_model"):
        AdmissionSettings(wait_model="oracle")
    with pytest.raises(ValueError, match="wait_model"):
        AdmissionConfig(SLO, wait_model="oracle")
    p = argparse.ArgumentParser()
    add_admission_args(p, serve=True)
    assert admission_overrides(p.parse_args(["--admission", "--admission-wait-model", "policy"])) == {
        "wait_model": "policy", "enabled": True}
    with pytest.raises(SystemExit):
        p.parse_args(["--admission-wait-model", "oracle"])
