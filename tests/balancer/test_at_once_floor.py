"""The eager-step floor in ``prefill_at_once``'s step rise (issue 23 part 3, session 17):
:func:`balancer.policies.ep_aware.at_once_floor_rise_s`. On an engine whose steps with prefill last
at least ``floor`` seconds, a prompt whose chunks run while no rank prefills turns decode steps into
mixed ones (it pays the floor), and prompts at once on different ranks share one floor.

Expected values are hand-computed (arithmetic in the comments) from the formula in the function's
docstring: ``rise_i = mixed(max(top, x_i')) - (mixed(top) if top > 0 else T_d)`` with ``mixed(x) =
max(floor, T_d + overhead + x tok_i)``, ``tok_i = per_token + per_attn_pair (p_i + u_i / 2)``.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np

from balancer.cost_model import CostModel, DecodeStepCost, EngineCost, PrefillStepCost
from balancer.policies import make_policy
from balancer.policies.base import SelectContext
from balancer.policies.ep_aware import at_once_floor_rise_s, at_once_step_rise_s
from balancer.types import Request, Role
from tests.balancer_factories import cands, view

C1 = PrefillStepCost(overhead_s=0.01, per_token_s=1e-4, per_attn_pair_s=1e-9, per_group_token_s=1e-5)


def test_the_floor_rise_by_hand():
    # one wide-EP engine of 4 ranks; prompts at once m = 0, 1, 3, 2 -> tokens per step x = 0, 512, 1,536, 1,024
    # (busiest 1,536); with the prompt x' = 512, 1,024, 2,048, 1,536. u = 2,048 everywhere, cached 0, 0, 1,024, 0:
    # tok = 1e-4 + 1e-9 (p + 1,024) = 1.01024e-4 (p = 0) and 1.02048e-4 (p = 1,024). T_d = 0.05 s: base 0.06 s.
    m = np.array([0, 1, 3, 2])
    u, cached = np.full(4, 2048.0), np.array([0.0, 0.0, 1024.0, 0.0])
    idx = np.zeros(4, dtype=np.int64)
    td = np.full(4, 0.05)
    # floor 0.25: the busiest step now 0.06 + 1,536 x 1.01024e-4 = 0.21517 s -> 0.25 (the floor). Ranks 0, 1, 3
    # stay at or under 1,536 tokens: 0. Rank 2: 0.06 + 2,048 x 1.02048e-4 = 0.268994 s against
    # max(0.25, 0.06 + 1,536 x 1.02048e-4 = 0.216746) = 0.25: 0.018994 s (linear: 512 x 1.02048e-4 = 0.052249)
    rise = at_once_floor_rise_s(m, u, cached, C1, 8192, 512, idx, None, True, 0.25, td)
    np.testing.assert_allclose(rise, [0.0, 0.0, 0.06 + 2048 * 1.02048e-4 - 0.25, 0.0], rtol=1e-12, atol=1e-15)
    # a floor under both steps (0.1 s): the linear rise, 512 tokens x tok, as at_once_step_rise_s
    low = at_once_floor_rise_s(m, u, cached, C1, 8192, 512, idx, None, True, 0.1, td)
    np.testing.assert_allclose(low, at_once_step_rise_s(m, u, cached, C1, 8192, 512, idx, None, True), rtol=1e-12)
    np.testing.assert_allclose(low, [0.0, 0.0, 512 * 1.02048e-4, 0.0], rtol=1e-12)
    # nobody prefilling at once: every rank's placement turns decode steps (0.05 s) into mixed ones:
    # max(0.25, 0.06 + 512 x tok) - 0.05 = 0.2 s per step on every rank (linear: 512 x tok ~ 0.052 s)
    idle = at_once_floor_rise_s(np.zeros(4), u, cached, C1, 8192, 512, idx, None, True, 0.25, td)
    np.testing.assert_allclose(idle, [0.2] * 4, rtol=1e-12)
    # dense ranks (each its own step): top = the rank's own tokens. Rank 0 (idle): 0.25 - 0.05 = 0.2; rank 1:
    # 0.06 + 1,024 x 1.01024e-4 = 0.163449 -> 0.25 against 0.25: 0; rank 2: 0.268994 - 0.25 = 0.018994;
    # rank 3: 0.06 + 1,536 x 1.01024e-4 = 0.215173 -> 0.25 against 0.25: 0
    dense = at_once_floor_rise_s(m, u, cached, C1, 8192, 512, np.arange(4), None, False, 0.25, td)
    np.testing.assert_allclose(dense, [0.2, 0.0, 0.06 + 2048 * 1.02048e-4 - 0.25, 0.0], rtol=1e-12, atol=1e-15)
    assert (rise >= 0).all() and (dense >= 0).all()


# ---------------------------------------------------------------- in ep_aware's cost (prefill_at_once)
PF = PrefillStepCost(overhead_s=0.01, per_token_s=1e-4, per_attn_pair_s=0.0, per_group_token_s=1e-5)
DC = DecodeStepCost(overhead_s=0.03, per_seq_s=1e-3, per_kv_token_s=0.0, per_group_seq_s=0.0)
REQ = Request("r", 0.0, 2048, max_output_tokens=160)


def model(floor_s: float) -> CostModel:
    e = EngineCost(PF, DC, 8192, True, 16, 512, 8, prefill_step_floor_s=floor_s)
    return CostModel(prefill=e, decode=e)


def three(inflight):
    # ranks with 4, 6, 10 requests, 0 / 3,000 / 9,000 tokens queued, rank 2 with a 1,024-token hit
    c = cands(*(view("e", Role.MIXED, dp=i, num_requests=b, prefill_tokens=q, decode_kv_tokens=0,
                     kv_capacity_tokens=10**7, matched_tokens=m, block_size=256)
                for i, (b, q, m) in enumerate(((4, 0, 0), (6, 3000, 0), (10, 9000, 1024)))))
    return dataclasses.replace(c, prefill_inflight=np.array(inflight, dtype=np.int64))


def diff(floor_s: float, inflight) -> np.ndarray:
    """Scores with prefill_at_once minus without, on the same floored model."""
    cm = model(floor_s)
    out = []
    for pol in (make_policy("ep_aware", prefill_at_once=True), make_policy("ep_aware")):
        c = three(inflight)
        ch = pol.select(REQ, c, SelectContext(random.Random(0), 0.0, 0, cm))
        out.append(np.array([ch.scores[x] for x in c.replicas]))
    return out[0] - out[1]


def test_prefill_at_once_prices_the_floor_in_its_step_rise():
    # u = 2,048, 2,048, 1,024 -> n = 4, 4, 2 steps; n_e = 4 + 6 + 10 = 20 running sequences; T_d = 0.03 + 1e-3 x 10
    # = 0.04 s (the busiest rank's 10 sequences); tok = 1e-4 (no attention pairs); base = 0.04 + 0.01 = 0.05 s.
    # In flight 0, 1, 2: x = 0, 512, 1,024 (busiest 1,024), x' = 512, 1,024, 1,536.
    # Floor 0.2 s: the busiest step now max(0.2, 0.05 + 0.1024) = 0.2; only rank 2 passes it:
    # max(0.2, 0.05 + 0.1536) = 0.2036 -> 0.0036 s x 20 x 2 steps = 0.144 s (without the floor 2.048 s).
    np.testing.assert_allclose(diff(0.2, (0, 1, 2)), [0.0, 0.0, 0.144], rtol=1e-9, atol=1e-12)
    # Nobody prefilling at once: every placement turns its steps from decode (0.04) into mixed ones at the floor
    # (0.05 + 0.0512 = 0.1012 < 0.2): 0.16 s x 20 x n = 12.8, 12.8, 6.4 s (the hit on rank 2 saves 2 such steps)
    np.testing.assert_allclose(diff(0.2, (0, 0, 0)), [12.8, 12.8, 6.4], rtol=1e-9)
    # no floor: the linear rise, as before the floor (test_session_facts' hand values)
    np.testing.assert_allclose(diff(0.0, (0, 1, 2)), [0.0, 0.0, 2.048], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(diff(0.0, (0, 0, 0)), 20 * np.array([4, 4, 2]) * 0.0512, rtol=1e-9)
