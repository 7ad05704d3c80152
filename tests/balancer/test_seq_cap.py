"""The sequence cap in ``ep_aware``'s cost model (issue 23 part 3): ``EngineCost.max_num_seqs``,
:func:`balancer.cost_model.slot_wait_s` and the decode / mixed pricing of a full rank.

Expected values are hand-computed from the formulas in the docstrings (the arithmetic is in the
comments), with round coefficients: a decode step of 20 ms + 0.1 ms per sequence + 1e-8 s per KV
token on dense ranks.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from balancer.cost_model import CostModel, DecodeStepCost, EngineCost, PrefillStepCost, engine_groups, slot_wait_s
from balancer.policies import make_policy
from balancer.policies.base import SelectContext
from balancer.types import Request, Role
from tests.balancer_factories import cands, view

PF = PrefillStepCost(overhead_s=0.01, per_token_s=1e-4, per_attn_pair_s=0.0, per_group_token_s=0.0)
DC = DecodeStepCost(overhead_s=0.02, per_seq_s=1e-4, per_kv_token_s=1e-8, per_group_seq_s=0.0)


def model(cap: int | None, ep: bool = False, transfer_s_per_token: float = 0.0) -> CostModel:
    e = EngineCost(PF, DC, 8192, ep, cap)
    return CostModel(prefill=e, decode=e, transfer_s_per_token=transfer_s_per_token)


def ctx(cm: CostModel) -> SelectContext:
    return SelectContext(random.Random(0), 0.0, 0, cm)


def exact(**kw):
    return make_policy("ep_aware", horizon_weight=0.0, tie_tolerance=0.0, slo_margin=1.0, **kw)


def dview(engine: str, b: int, kv: int, matched: int = 0, role: Role = Role.DECODE):
    return view(engine, role, num_requests=b, decode_kv_tokens=kv, kv_capacity_tokens=10**7,
                matched_tokens=matched, block_size=256)


def test_slot_wait_is_the_place_in_line_times_the_renewal_interval():
    # S = 16, out = 1000 tokens, 30 ms steps: a slot frees every 1000 * 0.03 / 16 = 1.875 s;
    # 15 requests: a free slot; 16: first in line; 18: third in line
    np.testing.assert_allclose(slot_wait_s(np.array([15, 16, 18]), 0.03, 1000.0, 16), [0.0, 1.875, 5.625])
    # per-rank step times
    np.testing.assert_allclose(slot_wait_s(np.array([4, 4]), np.array([0.02, 0.04]), 100.0, 4), [0.5, 1.0])
    with pytest.raises(ValueError, match="max_num_seqs"):
        slot_wait_s(np.array([1]), 0.03, 10.0, 0)
    with pytest.raises(ValueError, match="out_tokens"):
        slot_wait_s(np.array([1]), 0.03, -1.0, 4)


def test_engine_cost_carries_the_cap_through_its_table_and_rejects_bad_values():
    cm = model(16)
    d = cm.to_dict()
    assert d["decode"]["max_num_seqs"] == 16
    assert CostModel.from_dict(d) == cm
    assert "max_num_seqs" not in model(None).to_dict()["decode"]  # no cap: the key is absent (TOML has no null)
    assert CostModel.from_dict(model(None).to_dict()).decode.max_num_seqs is None
    for bad in (0, -3, True, 2.5, "16"):
        with pytest.raises(ValueError, match="cost_model.decode.max_num_seqs"):
            CostModel.from_dict({"decode": {"max_num_seqs": bad}})
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1"):
        EngineCost(max_num_seqs=0)


def test_a_full_rank_costs_its_slot_wait_and_loses_the_hit_it_would_have_won():
    # S = 4. Rank a holds 4 requests over 40,000 KV tokens and the whole 1,000-token prompt;
    # rank b holds 2 over 20,000 and none of it. Output 100 tokens; transfer 1e-4 s per token.
    r = Request("r", 0.0, 1000, max_output_tokens=100)
    c = cands(dview("a", 4, 40_000, matched=1000), dview("b", 2, 20_000))
    names, idx, rows = engine_groups(c.replicas)
    # without the cap: a: after = 0.02 + 5 * 1e-4 + (40,000 + 1,050) * 1e-8 = 0.0209105, before 0.0208,
    # 4 sequences: 100 * (0.0209105 + 4 * 0.0001105) = 2.13525, no transfer;
    # b: after = 0.02 + 3e-4 + 21,050e-8 = 0.0205105, before 0.0204: 100 * (0.0205105 + 2 * 0.0001105)
    # = 2.07315, + 1,000 * 1e-4 transfer = 2.17315 -> a
    cm = model(4, transfer_s_per_token=1e-4)
    blind = exact()  # the default: no cap in the pricing
    np.testing.assert_allclose(blind.decode_cost(r, c, cm, names, idx, rows, transfer=True), [2.13525, 2.17315])
    assert blind.select(r, c, ctx(cm)).replica.engine == "a"
    # with the cap: a is full; the request waits 1 * 100 * 0.0208 / 4 = 0.52 s, then takes a finished
    # sequence's place: KV 40,000 + 1,050 - 10,000 below the max 40,000, 4 sequences: after = before
    # = 0.0208 -> 100 * 0.0208 + 0.52 = 2.60; b is unchanged (a free slot) -> b
    capped = exact(seq_cap=True)
    np.testing.assert_allclose(capped.decode_cost(r, c, cm, names, idx, rows, transfer=True), [2.60, 2.17315])
    assert capped.select(r, c, ctx(cm)).replica.engine == "b"
    np.testing.assert_allclose(capped.slot_wait(r, c, cm, names, idx, rows), [0.52, 0.0])
    # no rank full: the same costs as without the cap (the compiled / uncapped path)
    c2 = cands(dview("a", 3, 30_000, matched=1000), dview("b", 2, 20_000))
    n2, i2, r2 = engine_groups(c2.replicas)
    np.testing.assert_array_equal(capped.decode_cost(r, c2, cm, n2, i2, r2, transfer=True),
                                  blind.decode_cost(r, c2, cm, n2, i2, r2, transfer=True))
    assert capped.slot_wait(r, c2, cm, n2, i2, r2) is None


def test_mixed_pool_predicted_ttft_includes_the_slot_wait():
    # mixed dense ranks, S = 4, empty prefill queues; a 1,000-token prompt with no hit: own prefill
    # 0.01 + 1,000 * 1e-4 = 0.11 s on either; rank a is full (4 requests, 40,000 KV): + 0.52 s
    r = Request("r", 0.0, 1000, max_output_tokens=100)
    c = cands(dview("a", 4, 40_000, role=Role.MIXED), dview("b", 2, 20_000, role=Role.MIXED))
    ttft, own = exact(seq_cap=True).predict_prefill_s(r, c, ctx(model(4)))
    np.testing.assert_allclose(own, [0.11, 0.11])
    np.testing.assert_allclose(ttft, [0.11 + 0.52, 0.11])
    ttft_blind, _ = exact().predict_prefill_s(r, c, ctx(model(4)))
    np.testing.assert_allclose(ttft_blind, [0.11, 0.11])


def test_the_simulator_hands_the_pool_limit_to_the_cost_model():
    from sim.run.router_cost import cost_model_for
    from sim.validation.agentx import scenario_440246

    # 440246: vLLM max_num_seqs 16 (and max_decode_batch 16)
    assert cost_model_for(scenario_440246()).decode.max_num_seqs == 16
    # the smaller of the two limits
    assert cost_model_for(scenario_440246(max_num_seqs=24, max_decode_batch=20)).decode.max_num_seqs == 20


def test_each_engine_of_a_mixed_fleet_waits_by_its_own_cap():
    # engine a: cap 4, 4 requests over 40,000 KV -> 1 * 100 * 0.0208 / 4 = 0.52 s; engine b: no cap
    # known (6 requests, none waits); c: cap 8 with 9 requests over 90,000 KV tokens -> running 8 over
    # 80,000: step 0.02 + 8e-4 + 8e-4 = 0.0216, 2nd in line: 2 * 100 * 0.0216 / 8 = 0.54 s
    r = Request("r", 0.0, 1000, max_output_tokens=100)
    c = cands(dview("a", 4, 40_000), dview("b", 6, 60_000), dview("c", 9, 90_000))
    cm = CostModel(engines={"a": EngineCost(PF, DC, 8192, False, 4), "b": EngineCost(PF, DC, 8192, False),
                            "c": EngineCost(PF, DC, 8192, False, 8)})
    names, idx, rows = engine_groups(c.replicas)
    np.testing.assert_allclose(exact(seq_cap=True).slot_wait(r, c, cm, names, idx, rows), [0.52, 0.0, 0.54])
