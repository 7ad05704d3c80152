"""What the router recorded of a request an engine refused (review finding: the prefix index kept
the blocks of engine-rejected requests). ``Router.on_rejected`` forgets the blocks ``route()``
added on the replicas that will not hold them; blocks a replica held before, and blocks another
request touched since, stay. Expected block counts are hand counts of the prompts' blocks
(16-token blocks; comments give each)."""

from __future__ import annotations

from balancer.router import Router
from balancer.types import Role
from balancer_factories import blocks, req, rid

BS = 16
P, D, M = rid("p", 0), rid("d", 0), rid("m", 0)


def prompt(n_blocks: int, tail: int = 0) -> tuple[int, ...]:
    """Chained hashes: a shared first block 7, then ``n_blocks - 1`` blocks (distinct per ``tail``)."""
    return blocks([7] + [1000 * (tail + 1) + i for i in range(n_blocks - 1)])


def pd(**kw) -> Router:
    r = Router("round_robin", "round_robin", block_size=BS, **kw)
    r.add_replica(P, Role.PREFILL)
    r.add_replica(D, Role.DECODE)
    return r


def test_a_decode_rejection_forgets_the_decode_replicas_new_blocks_only():
    r = pd()
    held = prompt(2)  # 2 blocks, served earlier: cached on both
    r.route(req("a", 2 * BS, block_hashes=held), 1.0)
    r.on_finished("a", 1.5)
    big = held + prompt(6, tail=1)[2:]  # the same 2 blocks, then 4 new ones: 6 blocks
    route = r.route(req("b", 6 * BS, block_hashes=big), 2.0)
    assert route.decode_matched_tokens == 2 * BS
    assert r.index.num_blocks(D) == 6 and r.index.num_blocks(P) == 6  # what route() recorded
    dropped = r.on_rejected(route, big, 2.0, by_prefill=False)
    assert dropped == 4  # the 4 new blocks on the decode replica
    assert r.index.num_blocks(D) == 2 and r.index.match_replica(D, big) == 2  # the 2 it held stay
    assert r.index.num_blocks(P) == 6  # the prefill may have computed the prompt: kept


def test_a_prefill_rejection_forgets_both_replicas_new_blocks():
    r = pd()
    big = prompt(5)
    route = r.route(req("b", 5 * BS - 3, block_hashes=big), 2.0)  # 77 tokens: 5 blocks, the last partial
    assert r.on_rejected(route, big, 2.0, by_prefill=True) == 10  # 5 on each
    assert r.index.num_blocks(P) == 0 and r.index.num_blocks(D) == 0


def test_blocks_touched_by_a_later_request_stay():
    r = pd()
    big = prompt(4)
    first = r.route(req("b", 4 * BS, block_hashes=big), 2.0)
    r.route(req("c", 3 * BS, block_hashes=big[:3]), 2.5)  # routed there meanwhile: its 3 blocks touched again
    assert r.on_rejected(first, big, 2.0, by_prefill=True) == 2  # only the 4th block, on each replica
    assert r.index.match_replica(D, big) == 3 and r.index.match_replica(P, big) == 3


def test_aggregated_and_hybrid_speculative_index():
    r = Router("round_robin", "round_robin", block_size=BS, index_mode="hybrid")
    r.add_replica(M, Role.MIXED)
    big = prompt(3)
    route = r.route(req("b", 3 * BS, block_hashes=big), 2.0)
    assert r.speculative is not None and r.speculative.num_blocks(M) == 3
    assert r.on_rejected(route, big, 2.0, by_prefill=False) == 3
    assert r.speculative.num_blocks(M) == 0


def test_events_mode_has_nothing_to_forget():
    r = pd(index_mode="events")
    big = prompt(3)
    route = r.route(req("b", 3 * BS, block_hashes=big), 2.0)
    assert r.on_rejected(route, big, 2.0, by_prefill=True) == 0


def test_a_request_routed_at_the_same_instant_keeps_its_blocks():
    # review finding R7: the review's own case, one decode replica, 10-block prompt routed twice at
    # now_s=5.0; refusing the first must keep the second's 10 blocks (it is computing them). Hand
    # count: a recorded 10 new blocks, b touched all 10 (matched 10 * BS) -> nothing to drop.
    r = Router("round_robin", "round_robin", block_size=BS)
    r.add_replica(D, Role.DECODE)
    big = prompt(10)
    a = r.route(req("a", 10 * BS, block_hashes=big), 5.0)
    b = r.route(req("b", 10 * BS, block_hashes=big), 5.0)
    assert b.decode_matched_tokens == 10 * BS and a.touch_id != b.touch_id
    assert r.on_rejected(a, big, 5.0, by_prefill=False) == 0
    assert r.route(req("c", 10 * BS, block_hashes=big), 6.0).decode_matched_tokens == 10 * BS
    # a partial overlap at one instant: d records 4 new blocks, e touches the first 2 again.
    # Refusing d drops the 2 blocks only d touched (e keeps its 2). Refusing e then drops none:
    # e matched those 2 when routed (d's record), and what a replica held then stays.
    r2 = Router("round_robin", "round_robin", block_size=BS)
    r2.add_replica(D, Role.DECODE)
    four = prompt(4, tail=3)
    d = r2.route(req("d", 4 * BS, block_hashes=four), 7.0)
    e = r2.route(req("e", 2 * BS, block_hashes=four[:2]), 7.0)
    assert r2.on_rejected(d, four, 7.0, by_prefill=False) == 2
    assert r2.index.match_replica(D, four) == 2
    assert e.decode_matched_tokens == 2 * BS
    assert r2.on_rejected(e, four[:2], 7.0, by_prefill=False) == 0
    assert r2.index.num_blocks(D) == 2


def test_a_route_without_touch_id_compares_times_only():
    # a Route the caller built (touch_id None): the old rule, a same-instant touch is not told apart
    # (hand: both routes' 3 blocks were last touched at 5.0 -> all 3 dropped)
    from balancer.types import Route
    r = Router("round_robin", "round_robin", block_size=BS)
    r.add_replica(D, Role.DECODE)
    big = prompt(3)
    a = r.route(req("a", 3 * BS, block_hashes=big), 5.0)
    r.route(req("b", 3 * BS, block_hashes=big), 5.0)
    bare = Route(a.request_id, a.prefill, a.decode, a.prefill_matched_tokens, a.decode_matched_tokens)
    assert bare.touch_id is None
    assert r.on_rejected(bare, big, 5.0, by_prefill=False) == 3


def test_touch_ids_survive_a_snapshot():
    # the router pickles its index flat (PrefixIndex.to_flat): the touch ids go with it, so a
    # same-instant route still keeps its blocks after a restore (hand: 0 dropped, as above)
    r = Router("round_robin", "round_robin", block_size=BS)
    r.add_replica(D, Role.DECODE)
    big = prompt(5)
    a = r.route(req("a", 5 * BS, block_hashes=big), 5.0)
    r.route(req("b", 5 * BS, block_hashes=big), 5.0)
    restored = Router.restore(r.snapshot())
    assert restored.on_rejected(a, big, 5.0, by_prefill=False) == 0
    c = restored.route(req("c", 5 * BS, block_hashes=big), 6.0)
    assert c.decode_matched_tokens == 5 * BS and c.touch_id == 3  # the route counter went along
