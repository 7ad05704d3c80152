"""Router: PD / aggregated routing, load at dispatch, approximate vs event-driven index,
conditional disaggregation, health, determinism, explain() and TTL.

Expected routes are worked out by hand from the policies' documented rules (comments say how).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from balancer.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from balancer.load import LoadSnapshot
from balancer.policies import make_policy
from balancer.router import NoReplicaError, Router
from balancer.types import Role
from balancer_factories import blocks, req, rid

BS = 16
P = [rid("p", i) for i in range(4)]
D = [rid("d", i) for i in range(4)]
M = [rid("m", i) for i in range(3)]


def prompt(root: int, n_blocks: int) -> tuple[int, ...]:
    """Chained hashes of a prompt whose first block id is ``root`` (distinct roots never match)."""
    return blocks([root] + list(range(1000, 1000 + n_blocks - 1)))


def rq(request_id: str, tokens: int, hashes: tuple[int, ...] = (), **kw):
    return req(request_id, tokens, block_hashes=hashes, **kw)


def make_router(n_prefill=0, n_decode=0, n_mixed=0, **kw) -> Router:
    kw.setdefault("block_size", BS)
    r = Router(**kw)
    for x in P[:n_prefill]:
        r.add_replica(x, Role.PREFILL)
    for x in D[:n_decode]:
        r.add_replica(x, "decode")
    for x in M[:n_mixed]:
        r.add_replica(x, Role.MIXED, kv_capacity_tokens=10_000)
    return r


# ---------------------------------------------------------------------------------- PD basics
def test_pd_routing_uses_each_pools_policy():
    r = make_router(3, 2, prefill_policy="round_robin", decode_policy=make_policy("least_load"))
    assert r.disaggregated
    sizes = [1000, 100, 100, 100, 100, 100]
    routes = [r.route(rq(f"r{i}", n, prompt(i, 4)), 0.0) for i, n in enumerate(sizes)]
    # hand: prefill round robin over p/dp0, p/dp1, p/dp2 by prefill decision index
    assert [x.prefill for x in routes] == [P[0], P[1], P[2], P[0], P[1], P[2]]
    # hand: decode least KV tokens: r0 (1000) on a tied-empty X; then r1..r5 (100 each) all on the
    # other one Y, whose KV stays 100..400 < 1000 before each of them
    x = routes[0].decode
    y = D[1] if x == D[0] else D[0]
    assert [z.decode for z in routes[1:]] == [y] * 5
    assert {z.prefill_choice.reason for z in routes} == {"round_robin"}
    assert {z.decode_choice.reason for z in routes} == {"least_load"}
    # hand: P0 got r0 (1000) and r3 (100): 2 requests, 1100 uncached tokens
    assert r.load.get(P[0]) == LoadSnapshot(2, 1100, 0)
    assert r.load.get(x) == LoadSnapshot(1, 0, 1000)
    assert r.load.get(y) == LoadSnapshot(5, 0, 500)


def test_round_robin_decision_index_per_pool():
    r = make_router(2, 3, prefill_policy="round_robin", decode_policy="round_robin")
    routes = [r.route(rq(f"r{i}", 10), 0.0) for i in range(6)]
    assert [x.prefill for x in routes] == [P[0], P[1]] * 3
    assert [x.decode for x in routes] == [D[0], D[1], D[2]] * 2


def test_burst_spreads_evenly_before_any_hook():
    # anchors' failure: load counted only at first byte sends a whole PD burst to worker 0.
    # hand: 40 equal distinct requests, least_load on 4+4 replicas -> exactly 10 per replica
    r = make_router(4, 4, prefill_policy="least_load", decode_policy="least_load")
    routes = [r.route(rq(f"r{i}", 512, prompt(i, 32)), 0.0) for i in range(40)]
    assert Counter(x.prefill for x in routes) == {p: 10 for p in P}
    assert Counter(x.decode for x in routes) == {d: 10 for d in D}
    for p in P:
        assert r.load.get(p) == LoadSnapshot(10, 10 * 512, 0)
    for d in D:
        assert r.load.get(d) == LoadSnapshot(10, 0, 10 * 512)


def test_hooks_release_load():
    r = make_router(1, 1)
    r.route(rq("a", 300, prompt(1, 19)), 0.0)
    assert r.load.get(P[0]) == LoadSnapshot(1, 300, 0)
    assert r.load.get(D[0]) == LoadSnapshot(1, 0, 300)
    r.on_prefill_done("a", 1.0)
    r.on_first_token("a", 1.5)  # implies prefill done: idempotent
    assert r.load.get(P[0]) == LoadSnapshot(0, 0, 0)
    assert r.load.get(D[0]) == LoadSnapshot(1, 0, 300)
    r.on_finished("a", 2.0, num_output_tokens=10)
    assert r.load.get(D[0]) == LoadSnapshot(0, 0, 0)


def test_duplicate_in_flight_id_rejected_then_reusable():
    r = make_router(1, 1)
    r.route(rq("a", 10), 0.0)
    with pytest.raises(ValueError):
        r.route(rq("a", 10), 0.0)
    r.on_finished("a", 1.0)
    r.route(rq("a", 10), 2.0)


# ---------------------------------------------------------------------------------- prefix index
def test_approximate_index_inserts_on_both_and_repeat_goes_back():
    r = make_router(3, 2, prefill_policy="cache_aware", decode_policy="cache_aware")
    x = prompt(7, 4)  # 4 blocks = 64 tokens
    first = r.route(rq("r1", 64, x), 0.0)
    pa, da = first.prefill, first.decode
    for h in x:
        assert r.index.holds(pa, h) and r.index.holds(da, h)
    assert r.index.num_blocks() == 8  # only the two chosen replicas
    r.route(rq("r2", 64, prompt(8, 4)), 0.0)  # unrelated traffic
    again = r.route(rq("r3", 64, x), 0.0)
    # hand: match rate 64/64 = 1 > 0.3, loads <= 2 apart (not imbalanced) -> same replicas
    assert (again.prefill, again.decode) == (pa, da)
    assert again.prefill_choice.reason == "cache_hit" and again.decode_choice.reason == "cache_hit"
    assert again.prefill_matched_tokens == 64 and again.decode_matched_tokens == 64
    # partial hit: first 2 blocks shared -> 32/64 = 0.5 > 0.3 -> pa, 32 matched, 32 uncached
    before = r.load.get(pa).prefill_tokens
    part = r.route(rq("r4", 64, blocks([7, 1000, 5, 6])), 0.0)
    assert part.prefill == pa and part.prefill_matched_tokens == 32
    assert r.load.get(pa).prefill_tokens == before + 32


def test_cache_aware_miss_goes_to_least_loaded_not_smallest_tree():
    # events mode so the index is set by hand: P0 holds 40 unrelated blocks, P1 holds only y.
    r = make_router(2, 1, prefill_policy="cache_aware", index_mode="events")
    y = prompt(1, 4)
    r.on_kv_event(P[0], BlockStored(prompt(2, 40)))
    r.on_kv_event(P[1], BlockStored(y))
    assert r.route(rq("a", 64, y), 0.0).prefill == P[1]  # hit; P1 now has load 1
    # hand: new prompt, no match -> miss -> least loaded P0 (load 0), not P1 (smallest cache)
    for i in range(5):
        rt = r.route(rq(f"z{i}", 64, prompt(100 + i, 4)), 0.0)
        assert rt.prefill_choice.reason == "cache_miss"
        r.on_finished(f"z{i}", 0.0)
        assert rt.prefill == P[0]


def test_events_mode_does_not_insert_and_applies_events():
    r = make_router(3, 1, prefill_policy="cache_aware", index_mode="events")
    x = prompt(3, 4)
    r.route(rq("r1", 64, x), 0.0)
    assert r.index.num_blocks() == 0  # routing does not record anything
    r.on_finished("r1", 0.0)
    r.on_kv_event(P[1], BlockStored(x), 1.0)
    r.on_kv_event(D[0], BlockStored(x[:3]), 1.0)
    rt = r.route(rq("r2", 64, x), 2.0)
    # hand: P1 holds all 4 blocks (64/64 > 0.3) -> P1; D0 holds 3 blocks = 48 tokens
    assert rt.prefill == P[1] and rt.prefill_matched_tokens == 64 and rt.prefill_choice.reason == "cache_hit"
    assert rt.decode_matched_tokens == 48
    r.on_finished("r2", 2.0)
    r.on_kv_event(P[1], BlockRemoved(x[2:]))
    assert r.index.match(x) == {P[1]: 2, D[0]: 3}
    rt = r.route(rq("r3", 64, x), 3.0)
    # hand: 2 blocks = 32/64 = 0.5 > 0.3 -> still P1
    assert rt.prefill == P[1] and rt.prefill_matched_tokens == 32
    r.on_finished("r3", 3.0)
    r.on_kv_event(P[1], AllBlocksCleared())
    assert r.index.match(x) == {D[0]: 3}
    rt = r.route(rq("r4", 64, x), 4.0)
    assert rt.prefill_matched_tokens == 0 and rt.prefill_choice.reason == "cache_miss"
    # events for unknown replicas are ignored; unknown event kinds raise
    r.on_kv_event(rid("ghost"), BlockStored(x))
    assert rid("ghost") not in r.index.replicas()
    with pytest.raises(TypeError):
        r.on_kv_event(P[0], object())


def test_ttl_expiry_through_route():
    r = make_router(2, 1, prefill_policy="cache_aware", index_ttl_s=10.0)
    x = prompt(5, 4)
    pa = r.route(rq("r1", 64, x), 0.0).prefill
    r.on_finished("r1", 0.0)
    # hand: at t=10, 10 - 0 = 10 <= ttl -> still cached -> hit (and touched again at 10)
    rt = r.route(rq("r2", 64, x), 10.0)
    assert rt.prefill == pa and rt.prefill_choice.reason == "cache_hit" and rt.decode_matched_tokens == 64
    r.on_finished("r2", 10.0)
    # hand: at t=20, 20 - 10 = 10 <= ttl -> hit
    rt = r.route(rq("r3", 64, x), 20.0)
    assert rt.prefill == pa and rt.prefill_matched_tokens == 64
    r.on_finished("r3", 20.0)
    # hand: at t=30.5, 30.5 - 20 > 10 -> everything expired inside route() -> miss, 0 matched
    rt = r.route(rq("r4", 64, x), 30.5)
    assert rt.prefill_choice.reason == "cache_miss"
    assert rt.prefill_matched_tokens == 0 and rt.decode_matched_tokens == 0
    # the route re-inserted x on its two replicas only
    assert r.index.num_blocks() == 8


# ---------------------------------------------------------------------------------- conditional PD
def test_conditional_disaggregation_threshold():
    r = make_router(2, 1, prefill_policy="least_load", decode_policy="least_load", pd_min_uncached_tokens=256)
    s1 = r.route(rq("s1", 100, prompt(1, 6)), 0.0)  # hand: 100 uncached < 256 -> decode alone
    s2 = r.route(rq("s2", 256, prompt(2, 16)), 0.0)  # hand: 256 >= 256 -> PD
    s3 = r.route(rq("s3", 255, prompt(3, 15)), 0.0)  # hand: 255 < 256 -> decode alone
    assert s1.prefill is None and s1.prefill_choice is None and "prefill" not in s1.explain()
    assert s2.prefill is not None
    assert s3.prefill is None
    l1_blocks = prompt(4, 20)  # 320 tokens
    l1 = r.route(rq("l1", 320, l1_blocks), 0.0)  # hand: 320 >= 256 -> PD; index records it on D0
    assert l1.prefill is not None
    l2 = r.route(rq("l2", 512, l1_blocks + blocks(range(12), parent=l1_blocks[-1])), 0.0)
    # hand: D0 holds 20 blocks = 320 tokens -> 512 - 320 = 192 uncached < 256 -> decode alone
    assert l2.prefill is None and l2.decode_matched_tokens == 320
    # hand: D0 prefills s1 (100) + s3 (255) + l2 (192) itself = 547 tokens; 5 requests;
    # KV = 100 + 256 + 255 + 320 + 512 = 1443
    assert r.load.get(D[0]) == LoadSnapshot(5, 547, 1443)
    # hand: prefill pool got s2 (256) and l1 (320), one each (least prefill tokens)
    assert sorted(r.load.get(p).prefill_tokens for p in P[:2]) == [256, 320]
    for rid_ in ("s1", "s2", "s3", "l1", "l2"):
        r.on_finished(rid_, 1.0)
    assert all(r.load.get(x) == LoadSnapshot(0, 0, 0) for x in (P[0], P[1], D[0]))


# ---------------------------------------------------------------------------------- aggregated
def test_aggregated_mixed_replicas():
    r = make_router(n_mixed=3, decode_policy="least_load")
    assert not r.disaggregated
    assert r.candidates(rq("x", 10), "decode").role is Role.MIXED
    first = r.route(rq("a", 300, prompt(1, 18)), 0.0)
    m = first.decode
    assert first.prefill is None and first.prefill_choice is None
    # hand: the mixed replica carries the prefill tokens itself (uncached 300) and 300 KV tokens
    assert r.load.get(m) == LoadSnapshot(1, 300, 300)
    r.on_first_token("a", 0.5)
    assert r.load.get(m) == LoadSnapshot(1, 0, 300)
    r.on_finished("a", 1.0)
    assert r.load.get(m) == LoadSnapshot(0, 0, 0)
    # hand: least_load on a mixed pool balances request count -> 9 requests = 3 per replica
    routes = [r.route(rq(f"b{i}", 50 + i, prompt(10 + i, 3)), 1.0) for i in range(9)]
    assert Counter(x.decode for x in routes) == {x: 3 for x in M}
    assert all(x.prefill is None for x in routes)


def test_aggregated_repeat_prompt_counts_only_uncached_prefill():
    r = make_router(n_mixed=2, decode_policy="cache_aware")
    x = prompt(9, 10)  # 160 tokens
    m = r.route(rq("a", 160, x), 0.0).decode
    rt = r.route(rq("b", 160, x), 0.0)
    # hand: full hit on m -> 0 uncached; m holds a: (1,160,160) + b: (1,0,160)
    assert rt.decode == m and rt.decode_matched_tokens == 160
    assert r.load.get(m) == LoadSnapshot(2, 160, 320)


# ---------------------------------------------------------------------------------- health / registry
def test_unhealthy_replicas_are_not_candidates():
    r = make_router(3, 2, prefill_policy="round_robin", decode_policy="round_robin")
    r.set_healthy(P[1], False)
    routes = [r.route(rq(f"r{i}", 10), 0.0) for i in range(6)]
    assert [x.prefill for x in routes] == [P[0], P[2]] * 3
    r.set_healthy(P[1], True)
    assert P[1] in r.candidates(rq("x", 10), "prefill").replicas
    r.set_healthy(D[0], False)
    r.set_healthy(D[1], False)
    with pytest.raises(NoReplicaError):
        r.route(rq("z", 10), 0.0)
    r.set_healthy(D[1], True)
    assert r.route(rq("z", 10), 0.0).decode == D[1]


def test_all_prefill_unhealthy_serves_on_decode_alone():
    r = make_router(2, 1)
    for p in P[:2]:
        r.set_healthy(p, False)
    assert not r.disaggregated
    rt = r.route(rq("a", 100), 0.0)
    assert rt.prefill is None and rt.decode == D[0]


def test_no_decode_replica_raises():
    with pytest.raises(NoReplicaError):
        make_router(2, 0).route(rq("a", 10), 0.0)
    with pytest.raises(NoReplicaError):
        Router().route(rq("a", 10), 0.0)


def test_remove_replica_clears_index_and_load():
    r = make_router(2, 1, prefill_policy="round_robin")
    x = prompt(1, 4)
    a = r.route(rq("a", 64, x), 0.0)
    assert a.prefill == P[0]
    r.remove_replica(P[0])
    assert r.index.match(x) == {D[0]: 4}
    assert [r.route(rq(f"b{i}", 64), 0.0).prefill for i in range(3)] == [P[1]] * 3
    r.on_finished("a", 1.0)  # its prefill replica is gone: nothing else is disturbed
    assert r.load.get(P[1]) == LoadSnapshot(3, 192, 0)
    assert r.load.get(D[0]) == LoadSnapshot(3, 0, 192)
    with pytest.raises(KeyError):
        r.remove_replica(P[0])


def test_registry_validation():
    r = make_router(1, 1)
    r.add_replica(P[0], "prefill")  # idempotent for the same role
    with pytest.raises(ValueError):
        r.add_replica(P[0], Role.DECODE)
    assert [i.replica for i in r.replicas(Role.PREFILL)] == [P[0]]
    for kw in (dict(block_size=0), dict(index_mode="exact"), dict(pd_min_uncached_tokens=-1),
               dict(prefill_policy="nope")):
        with pytest.raises(ValueError):
            Router(**kw)


# ---------------------------------------------------------------------------------- determinism
def _routes(seed, prefill_policy, decode_policy):
    r = make_router(4, 4, prefill_policy=prefill_policy, decode_policy=decode_policy, seed=seed)
    out = []
    for i in range(60):
        rt = r.route(rq(f"r{i}", 64 + i, prompt(i % 7, 4)), float(i))
        out.append((rt.prefill, rt.decode))
        if i % 3 == 0:
            r.on_finished(f"r{i}", float(i))
    return out


@pytest.mark.parametrize(
    "pp, dp",
    [("random", "random"), ("power_of_two", make_policy("kv_cost", temperature=0.7)), ("cache_aware", "least_load")],
)
def test_same_seed_same_routes(pp, dp):
    assert _routes(3, pp, dp) == _routes(3, pp, dp)


def test_different_seed_different_routes():
    assert _routes(3, "random", "random") != _routes(4, "random", "random")


# ---------------------------------------------------------------------------------- explain
def test_explain_is_json_friendly():
    r = make_router(2, 2, prefill_policy="cache_aware", decode_policy="kv_cost")
    rt = r.route(rq("a", 64, prompt(1, 4)), 0.0)
    e = rt.explain()
    assert json.loads(json.dumps(e)) == e
    assert e["request_id"] == "a"
    assert e["prefill"] == str(rt.prefill) and e["decode"] == str(rt.decode)
    assert e["prefill_reason"] == "cache_miss" and e["decode_reason"] == "min_cost"
    assert set(e["prefill_scores"]) == {"p/dp0", "p/dp1"}
    assert set(e["decode_scores"]) == {"d/dp0", "d/dp1"}
    # hand: kv cost of an empty decode replica = 1*(64/16) + 64/16 = 8 blocks
    assert e["decode_scores"] == {"d/dp0": 8.0, "d/dp1": 8.0}
    assert e["prefill_matched_tokens"] == 0 and e["decode_matched_tokens"] == 0


# ---------------------------------------------------------------------------------- retries: exclude_engines
DA, DA1, DB = rid("http://d-a", 0), rid("http://d-a", 1), rid("http://d-b", 0)
PA, PB = rid("http://p-a", 0), rid("http://p-b", 0)


def _two_engine_router(**kw) -> Router:
    """Decode engine d-a with 2 DP ranks, d-b with 1; prefill engines p-a, p-b."""
    r = Router(block_size=BS, **kw)
    for x in (PA, PB):
        r.add_replica(x, Role.PREFILL)
    for x in (DA, DA1, DB):
        r.add_replica(x, Role.DECODE)
    return r


@pytest.mark.parametrize("policy", ["round_robin", "least_load"])
def test_exclude_engines_skips_every_dp_rank_of_the_engine(policy):
    r = _two_engine_router(prefill_policy=policy, decode_policy=policy)
    cached = r.registry.pools()
    routes = [r.route(rq(f"x{i}", 32, prompt(i, 2)), 0.0, exclude_engines={"http://d-a", "http://p-a"})
              for i in range(4)]
    # hand: d-a's two ranks and p-a are out, so each pool has one candidate left
    assert [x.decode for x in routes] == [DB] * 4 and [x.prefill for x in routes] == [PB] * 4
    assert r.load.get(DB).num_requests == 4 and r.load.get(DA).num_requests == 0
    assert r.registry.pools() is cached and cached["decode"].replicas == (DA, DA1, DB)  # cache untouched
    if policy == "least_load":
        # hand: d-b now holds 4 x 32 KV tokens, d-a's ranks 0: without exclusion d-a wins
        assert r.route(rq("y", 32, prompt(9, 2)), 0.0).decode in (DA, DA1)


def test_exclude_engines_of_a_whole_pool_keeps_the_pool():
    r = _two_engine_router(prefill_policy="round_robin", decode_policy="least_load")
    for i in range(3):
        r.route(rq(f"x{i}", 32, prompt(i, 2)), 0.0, exclude_engines=("http://d-a",))  # loads d-b
    # every decode engine excluded -> whole pool; hand: least KV load is one of d-a's empty ranks
    got = r.route(rq("all", 32, prompt(5, 2)), 0.0, exclude_engines=("http://d-a", "http://d-b"))
    assert got.decode in (DA, DA1)
    # round robin over the whole prefill pool (decisions 3, 4): p-b, p-a
    assert got.prefill == PB
    assert r.route(rq("all2", 32, prompt(6, 2)), 0.0, exclude_engines={"http://p-a", "http://p-b"}).prefill == PA
    # unknown engine names change nothing
    assert r.route(rq("unk", 32, prompt(7, 2)), 0.0, exclude_engines={"http://nowhere"}).prefill == PB


def test_exclude_engines_keeps_prefix_matches_of_the_remaining_replicas():
    r = _two_engine_router(prefill_policy="cache_aware", decode_policy="cache_aware")
    x = prompt(3, 4)  # 4 blocks = 64 tokens
    first = r.route(rq("a", 64, x), 0.0, exclude_engines={"http://d-a"})
    assert first.decode == DB
    # approximate index: d-b now holds x; excluding d-b the match on d-a's ranks is 0
    second = r.route(rq("b", 64, x), 0.0, exclude_engines={"http://d-b"})
    assert second.decode in (DA, DA1) and second.decode_matched_tokens == 0
    # excluding the other engine, d-b's full 64-token hit is seen through the filtered pool
    third = r.route(rq("c", 64, x), 0.0, exclude_engines={"http://d-a"})
    assert third.decode == DB and third.decode_matched_tokens == 64
    assert third.decode_choice.reason == "cache_hit"


def test_events_mode_refuses_an_hbm_block_stored_that_is_not_a_whole_prompt():
    # The events-mode prefix tree keeps its block map, so a BlockStored whose blocks continue a
    # chain (block 1 onwards, without block 0) is a clear error rather than a silently unmatched
    # run; the router's view is unchanged (hand: replica holds the 3 blocks it stored first).
    r = Router("cache_aware", "cache_aware", index_mode="events")
    a, b = rid("a"), rid("b")
    r.add_replica(a, "decode")
    r.add_replica(b, "decode")
    x = blocks([1, 2, 3])
    r.on_kv_event(a, BlockStored(x), 0.0)
    with pytest.raises(ValueError, match="leading blocks"):
        r.on_kv_event(b, BlockStored(x[1:]), 1.0)
    assert r.index.match(x) == {a: 3}


def test_events_mode_continuation_events_name_their_parent():
    # vLLM announces new blocks only, with the parent's hash. Hand: replica a stores blocks 0-2,
    # then 3-5 under block 2 -> a matches 6; a whole-prompt event for b afterwards is accepted
    # (the continuation was not mistaken for a prompt start) and b matches 6 too. A continuation
    # of a block nobody holds changes nothing.
    r = Router("cache_aware", "cache_aware", index_mode="events")
    a, b = rid("a"), rid("b")
    r.add_replica(a, "decode")
    r.add_replica(b, "decode")
    h = blocks(list(range(10)))
    r.on_kv_event(a, BlockStored(h[:3]), 0.0)
    r.on_kv_event(a, BlockStored(h[3:6], parent_block_hash=h[2]), 0.5)
    assert r.index.match(h) == {a: 6}
    r.on_kv_event(b, BlockStored(h[:6]), 1.0)
    assert r.index.match(h) == {a: 6, b: 6}
    r.on_kv_event(b, BlockStored(h[7:], parent_block_hash=h[6]), 1.5)  # block 6 unknown
    assert r.index.match(h) == {a: 6, b: 6} and r.index.num_blocks(b) == 6


def test_add_replica_rejects_bad_ids_roles_and_capacities_up_front():
    # each bad registration is a one-line error at add_replica, and leaves the router usable
    r = Router()
    with pytest.raises(TypeError, match="ReplicaId"):
        r.add_replica(("z", 1), "decode")
    with pytest.raises(TypeError, match="ReplicaId"):
        r.add_replica("p-9", "prefill")
    with pytest.raises(ValueError, match="dp_rank must be >= 0"):
        r.add_replica(rid("d", -1), "decode")
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        r.add_replica(rid("d"), "decode", kv_capacity_tokens=-5)
    with pytest.raises(ValueError, match="valid: prefill, decode, mixed"):
        r.add_replica(rid("d"), "prefil")
    with pytest.raises(KeyError, match="unknown replica zz/dp0"):
        r.set_healthy(rid("zz"), False)
    r.add_replica(rid("d"), "decode")
    assert r.route(req("x", 100, [1]), 0.0).decode == rid("d")
