"""``Policy.prefill_head_roles``: a router's decision gathers the in-service prefill columns
(``Candidates.prefill_head_*``) only for the pools whose policy reads them; the public
``Router.candidates`` snapshot always has them. Expected values: the load tracker's own columns
(:mod:`balancer.load`), read directly."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from balancer.policies import Policy, available_policies, make_policy
from balancer.router import Router
from balancer.types import Choice, ReplicaId, Request, Role


@dataclass(frozen=True)
class _Spy(Policy):
    """The first candidate; records what it saw (a policy of one's own: the default roles)."""

    name = ""
    seen: list = None  # type: ignore[assignment]

    def select(self, request, cands, ctx):  # noqa: ANN001, ANN201
        self.seen.append((cands.role, cands.prefill_head_start_s, cands.prefill_head_tokens,
                          cands.prefill_head_pairs))
        return Choice(cands.replicas[0], reason="spy")


def _router(prefill_policy, decode_policy) -> Router:
    r = Router(prefill_policy, decode_policy, block_size=16, seed=0)
    for e in range(2):
        for k in range(2):
            r.add_replica(ReplicaId(f"p{e}", k), "prefill")
            r.add_replica(ReplicaId(f"d{e}", k), "decode")
    return r


def _route_capturing(r):  # noqa: ANN001, ANN202
    """Route one 64-token request through ``r`` and return the candidate snapshots its decision
    gathered, in the order the router took them (decode pool, then prefill pool)."""
    captured = []
    orig = r._candidates

    def capture(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        c = orig(*args, **kwargs)
        captured.append(c)
        return c

    r._candidates = capture
    r.route(Request("a", 0.0, 64, (), 8, 8), 1.0)
    r._candidates = orig
    return captured


def test_a_policy_of_ones_own_sees_the_columns_on_every_pool():
    seen: list = []
    spy = _Spy(seen=seen)
    r = _router(spy, spy)
    r.route(Request("a", 0.0, 64, (), 8, 8), 1.0)  # 64 uncached tokens on p0:0 (its head from t = 1)
    r.route(Request("b", 0.0, 64, (), 8, 8), 2.0)
    assert [s[0] for s in seen] == [Role.DECODE, Role.PREFILL] * 2
    load = r.load
    slots = r.registry.pools()["prefill"].slots
    _, start, tokens, pairs = seen[3]  # the prefill pool at the second decision: a's prompt pending on p0:0
    assert np.array_equal(start, load.prefill_head_start_s[slots]) and start[0] == 1.0
    assert np.array_equal(tokens, load.prefill_head_tokens[slots]) and tokens[0] == 64
    assert np.array_equal(pairs, load.prefill_head_pairs[slots]) and pairs[0] == 64 * 65 / 2  # u (u + 1) / 2


def test_built_in_policies_declare_what_they_read_and_get_none_elsewhere():
    assert make_policy("ep_aware").prefill_head_roles == frozenset({Role.PREFILL})
    for name in available_policies():
        if name != "ep_aware":
            assert make_policy(name).prefill_head_roles == frozenset(), name
    seen: list = []
    spy = _Spy(seen=seen)
    r = _router(spy, "kv_cost")  # decode pool: kv_cost (reads none); prefill pool: the spy (reads all)
    decode_cands, prefill_cands = _route_capturing(r)
    assert decode_cands.role is Role.DECODE and decode_cands.prefill_head_start_s is None
    assert decode_cands.prefill_head_tokens is None and decode_cands.prefill_head_pairs is None
    assert prefill_cands.prefill_head_start_s is not None and seen[0][1] is prefill_cands.prefill_head_start_s
    public = r.candidates(Request("z", 0.0, 64, (), 8, 8), "decode")  # the public snapshot: every column
    assert public.prefill_head_start_s is not None and public.prefill_head_tokens is not None


def test_ep_aware_reads_them_on_prefill_pools_only():
    r = _router("ep_aware", "ep_aware")
    decode_cands, prefill_cands = _route_capturing(r)
    assert decode_cands.prefill_head_start_s is None
    assert prefill_cands.prefill_head_start_s is not None and prefill_cands.prefill_head_pairs is not None
