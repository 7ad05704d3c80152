"""Memory bounds of the router's state (issue 14, item 15): a global prefix-index bound,
continuation events that merge into one run, and consistent_hash's weight cache."""

from __future__ import annotations

import tracemalloc

from balancer.hashing import chain_block_ids
from balancer.policies import consistent_hash as ch
from balancer.prefix_index import PrefixIndex
from balancer.router import Router
from balancer.types import ReplicaId


def test_global_bound_gives_each_replica_an_even_share():
    # hand: total 100 blocks; 1 replica may hold 60 (its own bound), 4 replicas 25 each
    idx = PrefixIndex(capacity_blocks=60, total_capacity_blocks=100)
    a = ReplicaId("a", 0)
    idx.insert(a, chain_block_ids(range(80)))
    assert idx.num_blocks(a) == 60 and idx.effective_capacity_blocks() == 60
    others = [ReplicaId(x, 0) for x in "bcd"]
    for r in others:
        idx.register(r)
    assert idx.effective_capacity_blocks() == 25 and idx.num_blocks(a) == 25  # shrunk at registration
    # a's 25 most recently used blocks are its first 25 (inserted deepest-first)
    assert idx.match(chain_block_ids(range(80))) == {a: 25}
    for k, r in enumerate(others):
        idx.insert(r, chain_block_ids(range(1000 * (k + 1), 1000 * (k + 1) + 50)))
    assert idx.num_blocks() == 100 and all(idx.num_blocks(r) == 25 for r in others)
    router = Router(index_total_capacity_blocks=7)
    assert router.index.total_capacity_blocks == 7


def test_continuation_events_of_one_chain_merge_into_one_run():
    # before: 1,000 BlockStored events of one chain (each naming the previous block as parent)
    # stayed 1,000 nodes and a route walked all of them; now one run
    idx = PrefixIndex(block_map=True)
    r = ReplicaId("e", 0)
    hs = chain_block_ids(range(1000))
    idx.insert(r, hs[:1], 0.0)
    for k in range(1, 1000):
        idx.insert(r, hs[k:k + 1], float(k), parent_block_hash=hs[k - 1])
    assert idx.num_nodes() == 1 and idx.match(hs) == {r: 1000} and idx.num_blocks(r) == 1000


def test_consistent_hash_weight_cache_stays_near_its_budget():
    # before: the bound counted weights only (2**19 of them), so 2-replica pools kept 262,144
    # entries, ~45 MB; now entries and their objects are counted: peak below 5 MB
    for n in (2, 512):
        ch._WEIGHTS_CACHE.clear()
        reps = tuple(ReplicaId(f"e{i}", 0) for i in range(n))
        tracemalloc.start()
        for k in range(60_000 if n == 2 else 5_000):
            ch.rendezvous_weights(b"b:" + k.to_bytes(8, "little"), reps)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 5e6, (n, peak)
    ch._WEIGHTS_CACHE.clear()
