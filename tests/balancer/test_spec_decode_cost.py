"""Speculative decoding's accepted tokens per decode step in ``ep_aware``'s cost model (issue 23 part 3):
``EngineCost.decode_tokens_per_step`` (``tau``), ``ep_aware:spec_decode``, the slot wait and the forced
prefill steps, the table key, the simulator's hand-over and the online fit.

Expected values are hand-computed from the formulas in the docstrings (the arithmetic is in the
comments), with round coefficients: a decode step of 30 ms + 1 ms per sequence of the busiest rank
(one wide-EP engine of two DP ranks), a prefill step of 10 ms + 0.1 ms per token.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from balancer import kernels
from balancer.cost_model import (
    CostLearner,
    CostModel,
    DecodeStepCost,
    EngineCost,
    PrefillStepCost,
    engine_groups,
    slot_wait_s,
)
from balancer.policies import make_policy
from balancer.policies.base import SelectContext
from balancer.prefill_cadence import forced_prefill_steps
from balancer.types import Request, Role
from tests.balancer_factories import cands, view

PF = PrefillStepCost(overhead_s=0.01, per_token_s=1e-4, per_attn_pair_s=0.0, per_group_token_s=0.0)
DC = DecodeStepCost(overhead_s=0.03, per_seq_s=1e-3, per_kv_token_s=0.0, per_group_seq_s=0.0)


def model(tau: float = 1.0, cap: int | None = None, limit: int | None = None, interval: int = 1) -> CostModel:
    e = EngineCost(PF, DC, 8192, True, cap, limit, interval, tau)
    return CostModel(prefill=e, decode=e)


def ctx(cm: CostModel, seed: int = 0) -> SelectContext:
    return SelectContext(random.Random(seed), 0.0, seed, cm)


def exact(**kw):
    return make_policy("ep_aware", horizon_weight=0.0, tie_tolerance=0.0, slo_margin=1.0, **{"spec_decode": True, **kw})


def dview(dp: int, b: int, role: Role = Role.DECODE, q: int = 0):
    return view("e", role, dp=dp, num_requests=b, prefill_tokens=q, decode_kv_tokens=0, kv_capacity_tokens=10**7,
                matched_tokens=0, block_size=256)


@pytest.mark.parametrize("compiled", [False, True])
def test_decode_cost_counts_the_requests_steps_not_its_tokens(compiled: bool):
    # one EP engine, ranks with 4 and 10 requests: B = 10, n_e = 14, T_e = 0.03 + 0.010 = 0.040 s.
    # out = 100 tokens at tau = 2.5 -> 40 steps. Rank 0: T_after = T_e (B stays 10): 40 x 0.040 = 1.6 s;
    # rank 1: T_after = 0.041, externality 14 x 0.001: 40 x (0.041 + 0.014) = 2.2 s (transfer 0)
    if compiled and kernels.compiled() is None:
        pytest.skip("numba (the fast extra) is not installed: the compiled path is not there")
    was = kernels.compiled() is not None
    kernels.use_compiled(compiled)
    try:
        c = cands(dview(0, 4), dview(1, 10))
        r = Request("r", 0.0, 1000, max_output_tokens=100)
        pol = make_policy("ep_aware", spec_decode=True)  # (no tie: the compiled select answers on its own)
        got = pol.select(r, c, ctx(model(2.5)))
        np.testing.assert_allclose([got.scores[x] for x in c.replicas], [1.6, 2.2], rtol=1e-12)
        assert got.replica.dp_rank == 0
        # the decode cost alone (the kernel decode_cost_rows or numpy)
        names, idx, rows = engine_groups(c.replicas)
        np.testing.assert_allclose(pol.decode_cost(r, c, model(2.5), names, idx, rows, transfer=True), [1.6, 2.2],
                                   rtol=1e-12)
        # one token per step (tau 1, the flag off, or the default policy): 100 steps, 4.0 / 5.5 s
        for cm, pol in ((model(1.0), exact()), (model(2.5), exact(spec_decode=False)),
                        (model(2.5), make_policy("ep_aware"))):
            got = pol.select(r, c, ctx(cm))
            np.testing.assert_allclose([got.scores[x] for x in c.replicas], [4.0, 5.5], rtol=1e-12)
    finally:
        kernels.use_compiled(was)


def test_slot_wait_and_forced_steps_by_hand():
    # k = b + 1 - S = 2 ahead in the waiting queue; slots free every out / (S tau) steps:
    # 2 x (100 / 2.5 / 16) x 0.04 s = 2 x 2.5 x 0.04 = 0.2 s (tau 1: 0.5 s)
    np.testing.assert_allclose(slot_wait_s(np.array([17.0, 3.0]), 0.04, 100.0, 16, 2.5), [0.2, 0.0], rtol=1e-12)
    np.testing.assert_allclose(slot_wait_s(np.array([17.0]), 0.04, 100.0, 16), [0.5], rtol=1e-12)
    # forced = (1 - 1/8)(min(ceil(q / L), wait_steps) + 1), wait_steps = 2 x 100 / 2.5 / 16 = 5:
    # q = 10,000 -> ceil(10,000 / 512) = 20 -> min 5 -> 0.875 x 6 = 5.25 (tau 1: wait 12.5 -> 0.875 x 13.5)
    np.testing.assert_allclose(forced_prefill_steps(np.array([10_000.0]), np.array([17.0]), 16, 8192, 512, 100.0, 8,
                                                    2.5), [5.25], rtol=1e-12)
    np.testing.assert_allclose(forced_prefill_steps(np.array([10_000.0]), np.array([17.0]), 16, 8192, 512, 100.0, 8),
                               [0.875 * 13.5], rtol=1e-12)
    for bad in (0.5, float("nan")):
        with pytest.raises(ValueError, match="tokens_per_step"):
            slot_wait_s(np.array([17.0]), 0.04, 100.0, 16, bad)
        with pytest.raises(ValueError, match="tokens_per_step"):
            forced_prefill_steps(np.array([0.0]), np.array([17.0]), 16, 8192, 512, 100.0, 8, bad)


def test_mixed_pool_slot_wait_in_the_predicted_ttft_runs_tau_times_shorter():
    # vLLM options of 440246 (cap 16, chunk limit 512, cadence 8); rank 0: 4 requests, rank 1 full (16).
    # Only the slot wait depends on tau: rank 1 waits 1 x (160 / tau / 16) x T_e with T_e = 0.03 + 0.016
    # = 0.046 s (the busiest rank runs 16): tau 1: 0.46 s, tau 2: 0.23 s; rank 0 has a free slot: 0
    r = Request("r", 0.0, 2048, max_output_tokens=160)
    c = cands(dview(0, 4, Role.MIXED), dview(1, 16, Role.MIXED, q=1000))
    t1, _ = exact().predict_prefill_s(r, c, ctx(model(1.0, 16, 512, 8)))
    t2, _ = exact().predict_prefill_s(r, c, ctx(model(2.0, 16, 512, 8)))
    np.testing.assert_allclose(t1 - t2, [0.0, 0.23], rtol=1e-9, atol=1e-12)


def test_decode_pool_costs_scale_by_one_over_tau_and_choices_stay():
    # the decode cost without transfer is out / tau steps x (step terms): every score divides by tau exactly
    # (up to rounding) and the choice (cheapest, ties relative) is the same; 200 random pools, two EP engines
    rng = np.random.default_rng(5)
    pol = make_policy("ep_aware", spec_decode=True)
    for trial in range(200):
        vs = [view(f"e{i // 4}", Role.DECODE, dp=i % 4, num_requests=int(rng.integers(0, 24)),
                   decode_kv_tokens=int(rng.integers(0, 10**6)), kv_capacity_tokens=4 * 10**6, block_size=256)
              for i in range(8)]
        r = Request(f"r{trial}", 0.0, int(rng.integers(1, 30_000)), max_output_tokens=int(rng.integers(1, 2000)))
        tau = float(rng.uniform(1.0, 4.0))
        a = pol.select(r, cands(*vs), ctx(model(1.0), trial))
        b = pol.select(r, cands(*vs), ctx(model(tau), trial))
        reps = cands(*vs).replicas
        np.testing.assert_allclose([b.scores[x] * tau for x in reps], [a.scores[x] for x in reps], rtol=1e-12)
        assert a.replica == b.replica


def test_where_nothing_sets_it_the_flag_changes_nothing():
    # random mixed, prefill and decode pools with the 440246 options on and off and tau 1: the
    # spec_decode flag gives the same scores (bit for bit) and choices
    rng = np.random.default_rng(9)
    on, off = make_policy("ep_aware", spec_decode=True), make_policy("ep_aware", spec_decode=False)
    roles = (Role.MIXED, Role.PREFILL, Role.DECODE)
    for trial in range(150):
        role = roles[trial % 3]
        cm = model(1.0, 16, 512, 8) if trial % 2 else model(1.0, 16)
        vs = [view(f"e{i // 4}", role, dp=i % 4, num_requests=int(rng.integers(0, 24)),
                   prefill_tokens=int(rng.integers(0, 50_000)), decode_kv_tokens=int(rng.integers(0, 10**6)),
                   kv_capacity_tokens=2 * 10**6, matched_tokens=int(rng.integers(0, 4)) * 4096, block_size=256)
              for i in range(8)]
        r = Request(f"r{trial}", 0.0, int(rng.integers(1, 30_000)), max_output_tokens=int(rng.integers(1, 2000)))
        a = on.select(r, cands(*vs), ctx(cm, trial))
        b = off.select(r, cands(*vs), ctx(cm, trial))
        assert a.replica == b.replica and a.reason == b.reason
        assert [a.scores[x] for x in cands(*vs).replicas] == [b.scores[x] for x in cands(*vs).replicas]


def test_the_key_round_trips_and_bad_values_are_refused():
    cm = model(2.49, 16, 512, 8)
    d = cm.to_dict()
    assert d["decode"]["decode_tokens_per_step"] == 2.49
    assert CostModel.from_dict(d) == cm
    assert "decode_tokens_per_step" not in model(1.0).to_dict()["decode"]  # unset: absent (tables as before)
    assert CostModel.from_dict({"decode": {"decode_tokens_per_step": 3}}).decode.decode_tokens_per_step == 3.0
    for bad in (0.5, 0, True, "2", float("nan"), float("inf"), 2000.0):
        with pytest.raises(ValueError, match="cost_model.decode.decode_tokens_per_step"):
            CostModel.from_dict({"decode": {"decode_tokens_per_step": bad}})
        with pytest.raises(ValueError, match="decode_tokens_per_step must be a number"):
            EngineCost(decode_tokens_per_step=bad)
    assert EngineCost(decode_tokens_per_step=np.float64(2.5)).decode_tokens_per_step == 2.5


def test_the_simulator_hands_the_acceptance_length_to_the_cost_model():
    from sim.run.router_cost import cost_model_for
    from sim.scenario import PRESETS
    from sim.validation.agentx import MTP_ACCEPTANCE_LENGTH, perf_factory_440246, scenario_440246

    # 440246: MTP verified on every step (StepClassPerf), 2.49 accepted: the fitted step is a real one
    assert cost_model_for(scenario_440246(), perf_factory_440246()).decode.decode_tokens_per_step == MTP_ACCEPTANCE_LENGTH
    assert cost_model_for(scenario_440246(), perf_factory_440246(mtp=False)).decode.decode_tokens_per_step == 1.0
    for name in ("dsv3-pd-h200", "llama8b-agg-h100", "deepinfer-sm100"):  # none, or mean-field MTP (deepinfer): 1
        cm = cost_model_for(PRESETS[name])
        assert cm.prefill.decode_tokens_per_step == cm.decode.decode_tokens_per_step == 1.0, name


def test_the_online_fit_learns_the_step_not_the_inter_token_latency():
    # an engine decoding tau = 2.5 tokens per step of DC: the observed ITL is step / 2.5; the learner
    # multiplies it back, so the learned step model predicts DC's steps (not 2.5x shorter ones)
    cm = model(2.5)
    learner = CostLearner(cm)
    rng = np.random.default_rng(2)
    t = 0.0
    for i in range(600):
        b, n = float(rng.integers(1, 64)), float(rng.integers(1, 256))
        x = np.array([1.0, b, float(rng.integers(0, 10**6)), n])
        step = float(DC.coef() @ x)
        out = int(rng.integers(50, 500))
        learner.on_decode_dispatch(f"r{i}", x)
        learner.on_first_token(f"r{i}", t)
        learner.on_decode_finished(f"r{i}", t + (out - 1) * step / 2.5, out)
        t += 1.0
    got = learner.model.decode
    assert got.decode_tokens_per_step == 2.5
    for batch in (4.0, 32.0):
        assert got.decode_step_time_s(batch, 0.0) == pytest.approx(EngineCost(PF, DC).decode_step_time_s(batch, 0.0),
                                                                    rel=0.02)
