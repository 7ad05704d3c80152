"""vLLM's per-request chunk limit and prefill cadence in ``ep_aware``'s cost model (issue 23 part 3):
``EngineCost.request_chunk_tokens`` / ``prefill_schedule_interval``, :mod:`balancer.prefill_cadence`
and ``ep_aware:cadence``.

Expected values are hand-computed from the formulas in the docstrings (the arithmetic is in the
comments), with round coefficients: a prefill step of 10 ms + 0.1 ms per token, a decode step of
30 ms + 1 ms per sequence of the busiest rank (one wide-EP engine of two DP ranks).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from balancer.cost_model import CostModel, DecodeStepCost, EngineCost, PrefillStepCost
from balancer.policies import make_policy
from balancer.policies.base import SelectContext
from balancer.prefill_cadence import cadence_gap_steps, chunks_in_parallel, forced_prefill_steps, prefill_steps
from balancer.types import Request, Role
from tests.balancer_factories import cands, random_ep_views, random_request, view

PF = PrefillStepCost(overhead_s=0.01, per_token_s=1e-4, per_attn_pair_s=0.0, per_group_token_s=0.0)
DC = DecodeStepCost(overhead_s=0.03, per_seq_s=1e-3, per_kv_token_s=0.0, per_group_seq_s=0.0)


def model(cap: int | None = 16, limit: int | None = 512, interval: int = 8) -> CostModel:
    e = EngineCost(PF, DC, 8192, True, cap, limit, interval)
    return CostModel(prefill=e, decode=e)


def ctx(cm: CostModel) -> SelectContext:
    return SelectContext(random.Random(0), 0.0, 0, cm)


def exact(**kw):
    return make_policy("ep_aware", horizon_weight=0.0, tie_tolerance=0.0, slo_margin=1.0, **kw)


def mview(dp: int, b: int, q: int, matched: int, role: Role = Role.MIXED):
    return view("e", role, dp=dp, num_requests=b, prefill_tokens=q, decode_kv_tokens=0, kv_capacity_tokens=10**7,
                matched_tokens=matched, block_size=256)


# rank 0: 4 requests, nothing queued, no hit; rank 1: full (16 requests), 1,000 tokens queued, 1,024 hit
REQ = Request("r", 0.0, 2048, max_output_tokens=160)


def two_ranks(role: Role = Role.MIXED):
    return cands(mview(0, 4, 0, 0, role), mview(1, 16, 1000, 1024, role))


def test_the_step_counts_by_hand():
    # ceil((q + u) / C) = ceil(3,000 / 8,192) = 1 and ceil(u / L) = ceil(2,000 / 512) = 4 -> 4;
    # a long queue: ceil(20,000 / 8,192) = 3 > ceil(100 / 512) = 1 -> 3; no limit: the budget alone
    np.testing.assert_array_equal(prefill_steps(np.array([1000.0, 19900.0]), np.array([2000.0, 100.0]), 8192, 512),
                                  [4, 3])
    np.testing.assert_array_equal(prefill_steps(np.array([1000.0]), np.array([2000.0]), 8192, None), [1])
    # (k - 1)(n - 1/2) decode steps on a rank with requests; none on an empty rank or with k = 1
    np.testing.assert_allclose(cadence_gap_steps(np.array([4.0, 4.0]), np.array([3, 0]), 8), [24.5, 0.0])
    np.testing.assert_allclose(cadence_gap_steps(np.array([4.0]), np.array([3]), 1), [0.0])
    # a full rank (S = 16): (1 - 1/8)(min(ceil(1,000 / 512), (16 + 1 - 16) 160 / 16) + 1) = 0.875 x 3;
    # a rank with a free slot: none; 20 requests, nothing queued: 0.875 (0 + 1)
    np.testing.assert_allclose(forced_prefill_steps(np.array([1000.0, 1000.0, 0.0]), np.array([16, 15, 20]), 16,
                                                    8192, 512, 160.0, 8), [2.625, 0.0, 0.875])
    assert chunks_in_parallel(16, 512, 8192) and not chunks_in_parallel(32, 512, 8192)
    assert not chunks_in_parallel(None, 512, 8192) and not chunks_in_parallel(16, None, 8192)
    for bad in ((np.zeros(1), np.zeros(1), 0, 512), (np.zeros(1), np.zeros(1), 8192, 0)):
        with pytest.raises(ValueError, match="chunk_tokens"):
            prefill_steps(*bad)
    with pytest.raises(ValueError, match="interval"):
        cadence_gap_steps(np.zeros(1), np.zeros(1), 0)
    with pytest.raises(ValueError, match="out_tokens"):
        forced_prefill_steps(np.zeros(1), np.zeros(1), 16, 8192, 512, -1.0, 8)


def test_mixed_pool_predicted_ttft_counts_the_chunk_limit_the_cadence_and_the_slot_wait():
    # S L = 16 x 512 = 8,192 <= C: the queue ahead takes no budget, the prompt needs ceil(u / 512) steps.
    # The engine's decode step now: busiest rank min(16, 16) = 16 sequences: 0.03 + 0.016 = 0.046 s.
    # rank 0: u = 2,048 -> 4 steps: 4 x 0.01 + 2,048 x 1e-4 = 0.2448 s; (8 - 1)(4 - 1/2) = 24.5 decode
    #   steps x 0.046 = 1.127 s; a free slot -> 1.3718 s
    # rank 1: u = 2,048 - 1,024 = 1,024 -> 2 steps: 0.02 + 0.1024 = 0.1224 s; 7 x 1.5 = 10.5 x 0.046 =
    #   0.483 s; full: first in line, 1 x 160 x 0.046 / 16 = 0.46 s -> 1.0654 s
    ttft, own = exact(cadence=True).predict_prefill_s(REQ, two_ranks(), ctx(model()))
    np.testing.assert_allclose(ttft, [1.3718, 1.0654], rtol=1e-12)
    # on an idle rank: every step, ceil(u / 512) overheads: 0.2448 and 0.1224
    np.testing.assert_allclose(own, [0.2448, 0.1224], rtol=1e-12)
    # without the cadence pricing: the step budget's one step each (own: 0.01 + compute)
    _, own_off = exact(cadence=False).predict_prefill_s(REQ, two_ranks(), ctx(model()))
    np.testing.assert_allclose(own_off, [0.2148, 0.1124], rtol=1e-12)


def test_without_the_sequence_cap_the_queue_ahead_counts_and_the_limit_adds_steps():
    # no cap known: the features' drain (C per step) stays, with ceil(u / 512) steps where that is more.
    # rank 0: ceil((0 + 2,048) / 8,192) = 1 step counted, 4 needed: + 3 x 0.01; gap 24.5 decode steps at
    #   the busiest rank's 16 sequences (no cap: all 16) = 1.127 s
    # rank 1: ceil((1,000 + 1,024) / 8,192) = 1, 2 needed: + 0.01; gap 10.5 x 0.046 = 0.483 s; no slot wait
    off, _ = exact(cadence=False).predict_prefill_s(REQ, two_ranks(), ctx(model(cap=None)))
    on, _ = exact(cadence=True).predict_prefill_s(REQ, two_ranks(), ctx(model(cap=None)))
    np.testing.assert_allclose(on - off, [0.03 + 1.127, 0.01 + 0.483], rtol=1e-12)
    # a prefill pool (PD): the chunk limit only (no decode steps between its prefill steps)
    p_off, _ = exact(cadence=False).predict_prefill_s(REQ, two_ranks(Role.PREFILL), ctx(model()))
    p_on, _ = exact(cadence=True).predict_prefill_s(REQ, two_ranks(Role.PREFILL), ctx(model()))
    np.testing.assert_allclose(p_on - p_off, [0.03, 0.01], rtol=1e-12)


def test_a_full_rank_is_charged_the_groups_forced_mixed_steps():
    # the cost adds the TTFT's change and, on the full rank 1, externality x forced steps x running
    # sequences of the group x one chunk's prefill: 0.875 x 3 = 2.625 steps x (4 + 16) sequences x
    # (0.01 + 512 x 1e-4 = 0.0612 s) = 3.213 s
    cm = model()
    on = exact(cadence=True).select(REQ, two_ranks(), ctx(cm))
    off = exact(cadence=False).select(REQ, two_ranks(), ctx(cm))
    ttft_on, _ = exact(cadence=True).predict_prefill_s(REQ, two_ranks(), ctx(cm))
    ttft_off, _ = exact(cadence=False).predict_prefill_s(REQ, two_ranks(), ctx(cm))
    c = two_ranks()
    diff = np.array([on.scores[r] - off.scores[r] for r in c.replicas])
    np.testing.assert_allclose(diff, (ttft_on - ttft_off) + [0.0, 3.213], rtol=1e-9)
    # half the externality weight: half the forced cost
    half_on = exact(cadence=True, externality_weight=0.5).select(REQ, two_ranks(), ctx(cm))
    half_off = exact(cadence=False, externality_weight=0.5).select(REQ, two_ranks(), ctx(cm))
    diff = np.array([half_on.scores[r] - half_off.scores[r] for r in c.replicas])
    np.testing.assert_allclose(diff, (ttft_on - ttft_off) + [0.0, 1.6065], rtol=1e-9)


def test_ties_on_a_capped_cadenced_engine_go_to_the_fewest_requests():
    # two ranks with equal costs to within the tolerance: the default rule takes the least decode KV,
    # the cadence rule the fewest requests first (then the least KV)
    def v(dp: int, b: int, kv: int):
        return view("e", Role.MIXED, dp=dp, num_requests=b, decode_kv_tokens=kv, kv_capacity_tokens=10**9,
                    block_size=256)
    c = cands(v(0, 9, 100_000), v(1, 5, 400_000))
    pol = make_policy("ep_aware", tie_tolerance=0.99)  # everything ties
    r = Request("r", 0.0, 100_000, max_output_tokens=100)
    assert pol.select(r, c, ctx(model())).replica.dp_rank == 1  # fewest requests (5)
    assert make_policy("ep_aware", tie_tolerance=0.99, cadence=False).select(r, c, ctx(model())).replica.dp_rank == 0
    # no options in the cost model: the default rule (least KV), whatever the flag
    assert pol.select(r, c, ctx(model(limit=None, interval=1))).replica.dp_rank == 0


def test_the_options_round_trip_through_the_table_and_reject_bad_values():
    cm = model()
    d = cm.to_dict()
    assert (d["decode"]["request_chunk_tokens"], d["decode"]["prefill_schedule_interval"]) == (512, 8)
    assert CostModel.from_dict(d) == cm
    plain = model(limit=None, interval=1).to_dict()["decode"]  # unset: the keys are absent (the tables as before)
    assert "request_chunk_tokens" not in plain and "prefill_schedule_interval" not in plain
    assert not CostModel.from_dict(model(limit=None, interval=1).to_dict()).decode.has_cadence
    for key, bad in (("request_chunk_tokens", 0), ("request_chunk_tokens", True), ("request_chunk_tokens", 2.5),
                     ("prefill_schedule_interval", 0), ("prefill_schedule_interval", "8"),
                     ("prefill_schedule_interval", 1 << 17)):
        with pytest.raises(ValueError, match=f"cost_model.decode.{key}"):
            CostModel.from_dict({"decode": {key: bad}})
    with pytest.raises(ValueError, match="request_chunk_tokens must be an integer >= 1"):
        EngineCost(request_chunk_tokens=0)
    with pytest.raises(ValueError, match="prefill_schedule_interval must be an integer >= 1"):
        EngineCost(prefill_schedule_interval=0)
    # built directly (not from a table): NaN, fractions and strings are refused too (review2), numpy
    # integers taken
    for key, bad in (("request_chunk_tokens", float("nan")), ("request_chunk_tokens", 1.5),
                     ("request_chunk_tokens", "abc"), ("prefill_schedule_interval", float("nan")),
                     ("max_num_seqs", 2.0)):
        with pytest.raises(ValueError, match=f"{key} must be an integer >= 1"):
            EngineCost(**{key: bad})
    assert EngineCost(request_chunk_tokens=np.int64(512)).request_chunk_tokens == 512


def test_engines_without_the_options_price_and_pick_as_before():
    # random mixed and prefill pools of two EP engines with the default cost model's coefficients: the
    # cadence flag changes no score and no choice where no engine sets the options
    rng = np.random.default_rng(3)
    e = EngineCost(PF, DC, 8192, True, 16)
    cm = CostModel(prefill=e, decode=e)
    on, off = make_policy("ep_aware", cadence=True), make_policy("ep_aware", cadence=False)
    for trial in range(200):
        role = Role.MIXED if trial % 2 else Role.PREFILL
        vs = random_ep_views(rng, role)
        r = random_request(rng, f"r{trial}")
        a = on.select(r, cands(*vs), SelectContext(random.Random(trial), 0.0, trial, cm))
        b = off.select(r, cands(*vs), SelectContext(random.Random(trial), 0.0, trial, cm))
        assert a.replica == b.replica and a.reason == b.reason
        assert [a.scores[x] for x in cands(*vs).replicas] == [b.scores[x] for x in cands(*vs).replicas]


def test_the_simulator_hands_the_pool_options_to_the_cost_model():
    from sim.run.router_cost import cost_model_for
    from sim.scenario import PRESETS
    from sim.validation.agentx import scenario_440246

    got = cost_model_for(scenario_440246()).decode
    assert (got.request_chunk_tokens, got.prefill_schedule_interval, got.max_num_seqs) == (512, 8, 16)
    # the presets set neither: nothing changes in their tables
    for name in ("dsv3-pd-h200", "llama8b-agg-h100"):
        cm = cost_model_for(PRESETS[name])
        assert not cm.prefill.has_cadence and not cm.decode.has_cadence, name


def test_any_cadence_sees_pool_defaults_and_per_engine_overrides() -> None:
    """CostModel.any_cadence (ep_aware's early-out) is true exactly when some engine sets the chunk
    limit or a cadence above 1: the four cases by hand (defaults; prefill pool; decode/mixed pool;
    one engine override), and a cadence of 1 with no limit is vLLM's default (false)."""
    assert not CostModel().any_cadence
    assert not CostModel(engines={"e0": EngineCost(prefill_schedule_interval=1)}).any_cadence
    assert CostModel(prefill=EngineCost(request_chunk_tokens=512)).any_cadence
    assert CostModel(decode=EngineCost(prefill_schedule_interval=8)).any_cadence
    assert CostModel(engines={"e3": EngineCost(request_chunk_tokens=512)}).any_cadence
