"""Who waits for a prompt's group tokens when vLLM's chunks run in parallel (issue 23 part 3):
:func:`balancer.prefill_cadence.queued_requests` and ``ep_aware:parallel_chunks``.

Where a mixed pool's cost model sets the per-request chunk limit ``L`` with ``S L <= C`` (the
cadence's parallel case), a prompt starts at once beside its rank's queue, so its group tokens
delay every request of the engine with queued prefill, wherever it is placed: with
``parallel_chunks=true`` (opt-in) ``ep_aware`` prices ``externality_weight per_group_token u N_q``
there instead of FIFO draining's ``N_after`` and horizon terms (the default). Expected values are hand-computed from those formulas (the
arithmetic is in the comments) with round coefficients; the decision test uses the AgentX 440246
cost model's coefficients rounded to two digits.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from balancer.cost_model import CostModel, DecodeStepCost, EngineCost, PrefillStepCost
from balancer.policies import make_policy
from balancer.policies.base import SelectContext
from balancer.prefill_cadence import queued_requests
from balancer.types import Request, Role
from tests.balancer_factories import DC440, PF440, cands, random_ep_views, random_request, view

# a prefill step of 10 ms + 0.1 ms per token of the busiest rank + 0.01 ms per token of the group;
# a decode step of 30 ms + 1 ms per sequence of the busiest rank
PF = PrefillStepCost(overhead_s=0.01, per_token_s=1e-4, per_attn_pair_s=0.0, per_group_token_s=1e-5)
DC = DecodeStepCost(overhead_s=0.03, per_seq_s=1e-3, per_kv_token_s=0.0, per_group_seq_s=0.0)


def model(cap: int | None = 16, limit: int | None = 512, interval: int = 8, chunk: int = 8192) -> CostModel:
    e = EngineCost(PF, DC, chunk, True, cap, limit, interval)
    return CostModel(prefill=e, decode=e)


def ctx(cm: CostModel, seed: int = 0) -> SelectContext:
    return SelectContext(random.Random(seed), 0.0, 0, cm)


def scores(pol, r: Request, c, cm: CostModel) -> np.ndarray:
    ch = pol.select(r, c, ctx(cm))
    return np.array([ch.scores[x] for x in c.replicas])


def test_queued_requests_by_hand():
    q = np.array([0.0, 3000.0, 9000.0, 0.0, 5.0])
    b = np.array([4, 6, 10, 7, 2])
    # one wide-EP engine of 3 ranks (0-2) and one of 2 (3-4): 6 + 10 = 16 and 2 (rank 3 queues nothing)
    np.testing.assert_array_equal(queued_requests(q, b, np.array([0, 0, 0, 1, 1]), True), [16, 16, 16, 2, 2])
    # dense ranks: each its own requests where it has queued prefill
    np.testing.assert_array_equal(queued_requests(q, b, np.array([0, 0, 0, 1, 1]), False), [0, 6, 10, 0, 2])
    assert queued_requests(np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64), True).shape == (0,)
    with pytest.raises(ValueError, match="one shape"):
        queued_requests(q, b[:3], np.zeros(5, dtype=np.int64), True)
    with pytest.raises(ValueError, match=">= 0"):
        queued_requests(q, b, np.array([0, 0, -1, 1, 1]), True)


# one wide-EP engine of 3 mixed ranks: (requests, queued prefill tokens, hit tokens)
RANKS = ((4, 0, 0), (6, 3000, 0), (10, 9000, 1024))
REQ = Request("r", 0.0, 2048, max_output_tokens=160)


def three_ranks(role: Role = Role.MIXED):
    return cands(*(view("e", role, dp=i, num_requests=b, prefill_tokens=q, decode_kv_tokens=0,
                        kv_capacity_tokens=10**7, matched_tokens=m, block_size=256)
                   for i, (b, q, m) in enumerate(RANKS)))


def test_the_group_term_counts_every_queued_request_of_the_engine():
    # u = 2,048, 2,048, 1,024 uncached tokens. Parallel chunks: N_q = 6 + 10 = 16 on every rank, group =
    # 1e-5 x u x 16 = 0.32768, 0.32768, 0.16384 s.
    # FIFO draining (parallel_chunks=false): N_after_i = sum_{r != i} b_r clip((q_r - q_i) / q_r, 0, 1):
    # rank 0 (q 0): 6 + 10 = 16; rank 1 (q 3,000): 10 x 6,000 / 9,000 = 6.667; rank 2 (the longest queue): 0;
    # ext = 1e-5 x u x N_after = 0.32768, 0.136533, 0 s (horizon off: horizon_weight 0).
    # Everything else (the cadence TTFT, decode, the batch stall) is the same in both, so the scores differ by
    # group - ext = 0, 0.191147, 0.16384 s.
    cm = model()
    on = make_policy("ep_aware", horizon_weight=0.0, parallel_chunks=True)
    off = make_policy("ep_aware", horizon_weight=0.0)  # the default: FIFO draining's terms
    diff = scores(on, REQ, three_ranks(), cm) - scores(off, REQ, three_ranks(), cm)
    np.testing.assert_allclose(diff, [0.0, 0.32768 - 2048e-5 * 10 * 2 / 3, 0.16384], rtol=1e-9, atol=1e-12)


def test_the_horizon_has_no_part_where_chunks_run_in_parallel():
    # the drain model's horizon (how far the prompt pushes its rank's FIFO queue past the slowest rank's)
    # changes the scores under parallel_chunks=false only: rank 2 holds the longest queue (9,000 + 1,024
    # tokens against 3,000), so its horizon is positive there
    cm = model()
    r, c = REQ, three_ranks()
    on = [scores(make_policy("ep_aware", horizon_weight=h, parallel_chunks=True), r, c, cm) for h in (0.0, 4.0)]
    off = [scores(make_policy("ep_aware", horizon_weight=h), r, c, cm) for h in (0.0, 4.0)]
    np.testing.assert_array_equal(on[0], on[1])
    assert off[1][2] > off[0][2]


@pytest.mark.parametrize("cm", [model(cap=None), model(limit=None), model(cap=32), model(limit=1024),
                                model(limit=None, interval=1)], ids=["no-cap", "no-limit", "S-L-above-C",
                                                                      "L-above-C-over-S", "no-options"])
def test_where_chunks_do_not_run_in_parallel_the_option_changes_nothing(cm):
    # without a cap, a limit, or with S L > C the queue ahead takes the budget (FIFO draining holds):
    # scores bit-identical either way, mixed and prefill pools
    for role in (Role.MIXED, Role.PREFILL):
        a = scores(make_policy("ep_aware", parallel_chunks=True), REQ, three_ranks(role), cm)
        b = scores(make_policy("ep_aware"), REQ, three_ranks(role), cm)
        np.testing.assert_array_equal(a, b)


def test_a_prefill_pool_keeps_the_drain_terms_even_with_the_options():
    # a PD prefill pool (nothing decodes there, no sequence cap on its slots): the chunk limit's step
    # overheads only, the group terms as before, bit for bit
    cm = model()
    a = scores(make_policy("ep_aware", parallel_chunks=True), REQ, three_ranks(Role.PREFILL), cm)
    b = scores(make_policy("ep_aware"), REQ, three_ranks(Role.PREFILL), cm)
    np.testing.assert_array_equal(a, b)




def test_a_new_session_goes_to_the_rank_with_the_fewest_requests_though_it_prefills_the_most():
    # the 440246 decision the diagnosis found (docs/policies/ep_aware.md): a new session (a 60k-token miss
    # everywhere) and 8 ranks; rank 7 holds the fewest requests (8) because it is prefilling other new
    # sessions (600k tokens queued), the others 12-14 requests with short queues. FIFO draining prices the
    # prompt behind rank 7's queue as sparing the others (N_after = 0) but as pushing the engine's slowest
    # rank (the horizon, about 4 rho x 600k tokens' drain): rank 7 is avoided and the session lands on a
    # rank 4-6 requests fuller. In parallel the prompt runs at once on any rank: the group terms are equal,
    # the costs tie within 5% and the fewest requests win (rank 7).
    e = EngineCost(PF440, DC440, 8192, True, 16, 512, 8)
    cm = CostModel(prefill=e, decode=e)
    b = [12, 13, 14, 12, 13, 14, 12, 8]
    q = [0, 20_000, 0, 50_000, 0, 10_000, 0, 600_000]
    c = cands(*(view("e", Role.MIXED, dp=i, num_requests=b[i], prefill_tokens=q[i], decode_kv_tokens=b[i] * 120_000,
                     kv_capacity_tokens=2_745_677, matched_tokens=0, block_size=256) for i in range(8)))
    r = Request("new", 0.0, 60_000, max_output_tokens=900)
    assert make_policy("ep_aware", parallel_chunks=True).select(r, c, ctx(cm)).replica.dp_rank == 7
    default = make_policy("ep_aware").select(r, c, ctx(cm)).replica.dp_rank  # FIFO draining's terms (the default)
    assert default != 7 and b[default] >= 12


def test_engines_without_parallel_chunks_price_and_pick_as_before():
    # random mixed, prefill and decode pools of two EP engines with options that keep FIFO draining (or none):
    # the flag changes no score and no choice
    rng = np.random.default_rng(5)
    models = [model(cap=None), model(limit=None), model(cap=32), model(limit=None, interval=1),
              CostModel(prefill=EngineCost(PF, DC, 8192, True), decode=EngineCost(PF, DC, 8192, True))]
    on, off = make_policy("ep_aware", parallel_chunks=True), make_policy("ep_aware")
    for trial in range(150):
        role = (Role.MIXED, Role.PREFILL, Role.DECODE)[trial % 3]
        cm = models[trial % len(models)]
        vs = random_ep_views(rng, role)
        r = random_request(rng, f"r{trial}")
        a = on.select(r, cands(*vs), SelectContext(random.Random(trial), 0.0, trial, cm))
        b = off.select(r, cands(*vs), SelectContext(random.Random(trial), 0.0, trial, cm))
        assert a.replica == b.replica and a.reason == b.reason
        assert [a.scores[x] for x in cands(*vs).replicas] == [b.scores[x] for x in cands(*vs).replicas]
