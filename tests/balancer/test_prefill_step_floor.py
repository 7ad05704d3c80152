"""The eager-step floor in ``ep_aware``'s cost model (issue 23 part 3): ``EngineCost.prefill_step_floor_s``,
priced in the chunk-limit and cadence terms (a prompt's ``n`` prefill steps last at least ``n``
floors, a forced mixed step at least one floor).

Expected values are hand-computed (arithmetic in the comments) on the round coefficients of
``tests/balancer/test_prefill_cadence.py``: a prefill step of 10 ms + 0.1 ms per token, a decode step
of 30 ms + 1 ms per sequence of the busiest rank, one wide-EP engine of two DP ranks, chunk limit
512, cadence 8, 16 sequences per rank.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from balancer.cost_model import CostModel, DecodeStepCost, EngineCost, PrefillStepCost
from balancer.policies import make_policy
from balancer.policies.base import SelectContext
from balancer.types import Request, Role
from tests.balancer_factories import cands, view

PF = PrefillStepCost(overhead_s=0.01, per_token_s=1e-4, per_attn_pair_s=0.0, per_group_token_s=0.0)
DC = DecodeStepCost(overhead_s=0.03, per_seq_s=1e-3, per_kv_token_s=0.0, per_group_seq_s=0.0)
REQ = Request("r", 0.0, 2048, max_output_tokens=160)


def model(floor_s: float = 0.0, cap: int | None = 16) -> CostModel:
    e = EngineCost(PF, DC, 8192, True, cap, 512, 8, prefill_step_floor_s=floor_s)
    return CostModel(prefill=e, decode=e)


def ctx(cm: CostModel) -> SelectContext:
    return SelectContext(random.Random(0), 0.0, 0, cm)


def exact(**kw):
    return make_policy("ep_aware", horizon_weight=0.0, tie_tolerance=0.0, slo_margin=1.0, **kw)


def two_ranks():
    # rank 0: 4 requests, nothing queued, no hit; rank 1: full (16 requests), 1,000 tokens queued, 1,024 hit
    def v(dp: int, b: int, q: int, matched: int):
        return view("e", Role.MIXED, dp=dp, num_requests=b, prefill_tokens=q, decode_kv_tokens=0,
                    kv_capacity_tokens=10**7, matched_tokens=matched, block_size=256)
    return cands(v(0, 4, 0, 0), v(1, 16, 1000, 1024))


def scores(cm: CostModel, **kw) -> np.ndarray:
    c = two_ranks()
    got = exact(**kw).select(REQ, c, ctx(cm))
    return np.array([got.scores[r] for r in c.replicas])


def test_a_floor_above_the_step_prices_each_prefill_step_at_the_floor():
    # chunks in parallel (16 x 512 <= 8,192): the prompt's own steps. Without a floor (test_prefill_cadence):
    # rank 0: 4 steps, 4 x 0.01 + 2,048 x 1e-4 = 0.2448 s; rank 1: 2 steps, 0.02 + 1,024 x 1e-4 = 0.1224 s.
    # A 0.1 s floor: max(0.2448, 4 x 0.1) = 0.4 (+0.1552), max(0.1224, 2 x 0.1) = 0.2 (+0.0776)
    off, _ = exact().predict_prefill_s(REQ, two_ranks(), ctx(model()))
    on, _ = exact().predict_prefill_s(REQ, two_ranks(), ctx(model(0.1)))
    np.testing.assert_allclose(off, [1.3718, 1.0654], rtol=1e-12)  # test_prefill_cadence's hand values
    np.testing.assert_allclose(on - off, [0.1552, 0.0776], rtol=1e-9)
    # the cost: the TTFT's change, and rank 1's forced mixed steps (0.875 x 3 = 2.625 steps x 20 running
    # sequences) each at max(one chunk 0.01 + 512 x 1e-4 = 0.0612 s, floor 0.1 s): 5.25 s instead of 3.213 s
    np.testing.assert_allclose(scores(model(0.1)) - scores(model()), [0.1552, 0.0776 + 5.25 - 3.213], rtol=1e-9)


def test_a_floor_below_every_priced_step_or_absent_changes_nothing():
    # 0.05 s: rank 0 max(0.2448, 0.2), rank 1 max(0.1224, 0.1), a chunk max(0.0612, 0.05): all unchanged
    np.testing.assert_array_equal(scores(model(0.05)), scores(model()))
    assert EngineCost().prefill_step_floor_s == 0.0  # the default: no floor
    # the cadence pricing off: the floor is not used either
    np.testing.assert_array_equal(scores(model(0.1), cadence=False), scores(model(), cadence=False))


def test_the_drain_model_takes_the_floor_as_a_lower_bound_of_the_prompts_steps():
    # no sequence cap: the FIFO drain's TTFT with ceil(u / 512) steps; rank 0 (nothing queued, u = 2,048):
    # 0.01 + 0.2048 + 3 x 0.01 = 0.2448 < 4 x 0.1 -> +0.1552; rank 1 (1,000 queued, u = 1,024, 2 steps):
    # at least 0.01 + 2,024 x 1e-4 + 0.01 = 0.2224 > 2 x 0.1 -> unchanged
    off, _ = exact().predict_prefill_s(REQ, two_ranks(), ctx(model(cap=None)))
    on, _ = exact().predict_prefill_s(REQ, two_ranks(), ctx(model(0.1, cap=None)))
    np.testing.assert_allclose(on - off, [0.1552, 0.0], rtol=1e-9, atol=1e-12)


def test_the_floor_round_trips_through_the_table_and_bad_values_are_refused():
    cm = model(0.11594)
    d = cm.to_dict()
    assert d["prefill"]["prefill_step_floor_s"] == 0.11594
    assert CostModel.from_dict(d) == cm
    assert "prefill_step_floor_s" not in model().to_dict()["prefill"]  # absent = no floor: tables as before
    for bad in (-0.1, 10.5, float("nan"), float("inf"), True, "0.1"):
        d = model().to_dict()
        d["prefill"]["prefill_step_floor_s"] = bad
        with pytest.raises(ValueError, match="prefill_step_floor_s"):
            CostModel.from_dict(d)
        with pytest.raises(ValueError, match="prefill_step_floor_s"):
            EngineCost(PF, DC, prefill_step_floor_s=bad)
