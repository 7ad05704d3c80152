"""The routing hot path's fast branches give the values of the general ones.

``Candidates.kv_usage`` (all capacities known / none / some), the policies' tie-breaking helpers,
``Scored.component_scores`` on a subset of scorers, and the router's candidate match columns
(replica without an index number, partial last block). Expected values are worked out by hand
(comments) or from an independent re-implementation of the documented rule on a fresh
``random.Random`` with the same seed.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from balancer.policies import make_policy
from balancer.policies.base import argmax_random, argmin_random, array_max, array_min
from balancer.router import Router
from balancer.types import Role
from balancer_factories import blocks, cands, req, rid, view


# ---------------------------------------------------------------------------------- kv_usage
@pytest.mark.parametrize(
    "kv, cap, expected",
    [
        # hand, every capacity known: 500/1000, 900/1000, 1500/1000 clamped to 1
        ([500, 900, 1500], [1000, 1000, 1000], [0.5, 0.9, 1.0]),
        # hand, none known: 0 everywhere whatever the KV
        ([500, 900, 0], [0, 0, 0], [0.0, 0.0, 0.0]),
        # hand, some known: 250/1000, unknown -> 0, 300/200 clamped to 1
        ([250, 700, 300], [1000, 0, 200], [0.25, 0.0, 1.0]),
    ],
)
def test_kv_usage_all_none_and_some_capacities_known(kv, cap, expected):
    cs = cands(*(view(x, Role.DECODE, decode_kv_tokens=k, kv_capacity_tokens=c) for x, k, c in zip("ABC", kv, cap)))
    u = cs.kv_usage
    assert u.dtype == np.float64 and u.tolist() == expected


# ---------------------------------------------------------------------------------- tie helpers
def test_array_min_max_are_the_extremes():
    v = np.array([3, -1, 7, -1, 7], dtype=np.int64)
    # hand: smallest -1, largest 7
    assert array_min(v) == -1 and array_max(v) == 7
    f = np.array([0.5, 0.25, 2.0])
    assert array_min(f) == 0.25 and array_max(f) == 2.0


@pytest.mark.parametrize("seed", range(6))
def test_argmin_argmax_random_draw_among_ties_like_the_rule(seed):
    # rule (independent): ties in ascending index order, pick ties[rng.randrange(len(ties))];
    # no draw at all when the extreme is unique
    v = np.array([2.0, 1.0, 5.0, 1.0, 5.0, 1.0])
    rng = random.Random(seed)
    assert argmin_random(v, rng) == [1, 3, 5][random.Random(seed).randrange(3)]
    rng = random.Random(seed)
    assert argmax_random(v, rng) == [2, 4][random.Random(seed).randrange(2)]
    # masked: among indices 0, 2, 3 the minimum is 1.0 at index 3 only -> no draw
    rng = random.Random(seed)
    state = rng.getstate()
    assert argmin_random(v, rng, mask=np.array([True, False, True, True, False, False])) == 3
    assert rng.getstate() == state
    # masked max among 0, 1, 3: 2.0 at index 0 only
    assert argmax_random(v, rng, mask=np.array([True, True, False, True, False, False])) == 0
    assert rng.getstate() == state


# ---------------------------------------------------------------------------------- scored
def test_scored_component_subset_is_the_same_as_full():
    cs = cands(
        view("A", Role.DECODE, num_requests=4, decode_kv_tokens=500, kv_capacity_tokens=1000, matched_blocks=6),
        view("B", Role.DECODE, num_requests=0, decode_kv_tokens=900, kv_capacity_tokens=1000, matched_blocks=0),
    )
    r = req("r", 800, list(range(8)))
    pol = make_policy("scored")
    only_queue = pol.component_scores(r, cs, names=("queue",))
    # hand: q = [4, 0] -> (4 - q) / 4 = [0, 1]
    assert list(only_queue) == ["queue"] and only_queue["queue"].tolist() == [0.0, 1.0]
    two = pol.component_scores(r, cs, names=("prefix", "kv_utilization"))
    # hand: prefix 6/8, 0/8; kv 1 - 0.5, 1 - 0.9
    assert two["prefix"].tolist() == [0.75, 0.0]
    assert two["kv_utilization"].tolist() == pytest.approx([0.5, 0.1])
    full = pol.component_scores(r, cs)
    assert list(full) == ["prefix", "queue", "kv_utilization", "load"]
    for name, values in {**only_queue, **two}.items():
        assert values.tolist() == full[name].tolist()


# ---------------------------------------------------------------------------------- router columns
BS = 16


def test_candidates_unnumbered_replica_and_partial_last_block():
    m0, m1 = rid("m", 0), rid("m", 1)
    r = Router("round_robin", "round_robin", block_size=BS)
    r.add_replica(m0, Role.MIXED)
    r.add_replica(m1, Role.MIXED)
    a = blocks([1, 2, 3])  # 40-token prompt: blocks of 16, 16 and a partial 8
    first = r.route(req("a1", 40, block_hashes=a), 0.0)
    assert first.decode == m0 and first.decode_matched_tokens == 0  # round robin: index 0
    # m1 holds nothing yet (no index number): m0 matches all 3 blocks, tokens min(3*16, 40) = 40
    c = r.candidates(req("q", 40, block_hashes=a), "decode")
    assert c.replicas == (m0, m1)
    assert c.matched_blocks.tolist() == [3, 0] and c.matched_tokens.tolist() == [40, 0]
    second = r.route(req("b1", 32, block_hashes=blocks([9, 8])), 0.0)
    assert second.decode == m1  # round robin: index 1; now both replicas have a number
    c = r.candidates(req("q", 40, block_hashes=a), "decode")
    assert c.matched_blocks.tolist() == [3, 0] and c.matched_tokens.tolist() == [40, 0]
    # a 48-token prompt sharing the first 2 blocks: 2 blocks = 32 tokens on m0, none clamped
    c = r.candidates(req("q", 48, block_hashes=blocks([1, 2, 4])), "decode")
    assert c.matched_blocks.tolist() == [2, 0] and c.matched_tokens.tolist() == [32, 0]
    third = r.route(req("a2", 40, block_hashes=a), 0.0)
    assert third.decode == m0 and third.decode_matched_tokens == 40  # round robin: index 2 % 2
