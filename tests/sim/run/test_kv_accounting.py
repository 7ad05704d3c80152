"""KV accounting of mixed ranks: ``Scenario.kv_accounting`` "reserve" vs "shared" (vLLM / SGLang
paged KV: a running prompt's blocks are the prefix cache's, pinned, counted once, and released as
most recently used). Expected values are counted by hand from the inputs written here."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.types import ReplicaId, Role
from sim.run.cluster import simulate
from sim.run.engine.kv_cache import BlockCache
from sim.run.engine.rank import PrefillJob, Rank
from sim.scenario import PoolConfig, Scenario
from sim.workload import read_trace, spread_batches, take_slice


def test_block_cache_pins_count_once_and_are_never_evicted() -> None:
    c = BlockCache(4)
    c.insert((1, 2))
    assert c.pin((1, 2, 3)) == []  # 1, 2 leave the LRU, 3 is new: 3 blocks held
    assert len(c) == 3 and c.num_pinned == 3
    # two more unpinned blocks: 5 > 4, the LRU front goes (insert is deepest first: 11 then 10)
    assert c.insert((10, 11)) == [11]
    assert c.match((1, 2, 3, 99)) == 3  # pinned blocks match
    # released deepest first: the LRU is now 10, 3, 2, 1 (1 = most recently used)
    assert c.unpin((1, 2, 3)) == []
    assert c.num_pinned == 0 and len(c) == 4
    assert c.insert((20,)) == [10]
    assert c.insert((21,)) == [3]
    # a block pinned twice stays pinned after one release
    c.pin((1,))
    c.pin((1,))
    c.unpin((1,))
    assert c.num_pinned == 1
    with pytest.raises(ValueError, match="not pinned"):
        c.unpin((77,))


def _rank(shared: bool, capacity_blocks: int = 10) -> Rank:
    # 4-token blocks, a budget large enough for every prompt here in one step
    return Rank(ReplicaId("m", 0), 0, Role.MIXED, capacity_blocks, 4, max_prefill_tokens=100,
                max_decode_batch=8, share_prompt_blocks=shared)


@pytest.mark.parametrize("shared", [False, True])
def test_shared_prompt_blocks_are_counted_once(shared: bool) -> None:
    r = _rank(shared)
    a = PrefillJob(0, 8, 4, (1, 2))  # 8 prompt tokens = 2 blocks, 4 output: 12 tokens = 3 blocks
    r.enqueue_prefill(a)
    r.apply_prefill(r.plan())
    seq_a = r.start_decode_local(a, 3)
    if shared:  # its 2 prompt blocks pinned in the cache, 1 output block reserved: 10 - 2 - 1
        assert (r.reserved_blocks, r.cache.num_pinned, r.free_blocks()) == (1, 2, 7)
    else:  # 3 reserved; the cache holds the 2 prompt blocks again, within 10 - 3 = 7
        assert (r.reserved_blocks, len(r.cache), r.free_blocks()) == (3, 2, 7)
    b = PrefillJob(1, 12, 4, (1, 2, 3))  # shares a's 2 blocks; 16 tokens = 4 blocks
    r.enqueue_prefill(b)
    plan = r.plan()
    assert b.cached_tokens == 8  # both modes: the 2 leading blocks hit
    r.apply_prefill(plan)
    if shared:  # b pins 1, 2 (held already) and 3; reserves 4 - 3 = 1: 10 - 2 - 3
        assert (r.reserved_blocks, r.cache.num_pinned, r.free_blocks()) == (2, 3, 5)
    else:  # b reserves all 4 of its blocks: 10 - 3 - 4; the cache's 3 blocks fit in that 3
        assert (r.reserved_blocks, len(r.cache), r.free_blocks()) == (7, 3, 3)
    seq_b = r.start_decode_local(b, 3)
    assert r.apply_decode(3) == [seq_a, seq_b]  # both finish
    assert r.reserved_blocks == 0 and r.cache.num_pinned == 0 and len(r.cache) == 3
    assert r.free_blocks() == 10


@pytest.mark.parametrize("shared,kept", [(False, 2), (True, 1)])
def test_shared_blocks_take_their_recency_from_the_finish(shared: bool, kept: int) -> None:
    # x and y prefill in one step (x first); y finishes first, x later. Under "reserve" the
    # cache ranks them by prefill end (x older), under "shared" by release (y older): one of
    # them is evicted when 7 new blocks arrive in an 8-block cache.
    r = _rank(shared, capacity_blocks=8)
    x = PrefillJob(0, 4, 9, (1,))  # 13 tokens: 4 blocks; y: 6 tokens: 2 blocks; 4 + 2 <= 8
    y = PrefillJob(1, 4, 2, (2,))
    r.enqueue_prefill(x)
    r.enqueue_prefill(y)
    assert r.apply_prefill(r.plan()) == [x, y]
    r.start_decode_local(x, 8)
    r.start_decode_local(y, 1)
    assert [s.index for s in r.apply_decode(1)] == [1]
    assert [s.index for s in r.apply_decode(7)] == [0]
    assert len(r.cache) == 2 and r.free_blocks() == 8
    r.cache_insert((3, 4, 5, 6, 7, 8, 9))
    assert r.cache.match((kept,)) == 1 and r.cache.match((3 - kept,)) == 0


def _agg(accounting: str, fast_forward: bool = True) -> Scenario:
    return Scenario(name="agg", model="llama-3.1-8b", hardware="h100",
                    mixed=PoolConfig(num_engines=2, max_prefill_tokens=2048, kv_capacity_tokens=120_000),
                    kv_accounting=accounting, fast_forward=fast_forward)


def test_shared_accounting_conserves_work_and_matches_step_by_step() -> None:
    reqs = spread_batches(take_slice(read_trace(), 0, 150), 3.0, seed=0)
    ff = simulate(_agg("shared", True), reqs, "round_robin")
    ex = simulate(_agg("shared", False), reqs, "round_robin")
    for name, col in ff.records.columns().items():
        np.testing.assert_allclose(col, ex.records.columns()[name], rtol=1e-9, atol=1e-9, err_msg=name)
    r = ff.records
    assert r.num_finished == r.num_routed == len(reqs) - 1  # one prompt is over the 8B model's max length
    assert ff.rank_prefill_tokens.sum() == (r.prompt_tokens - r.cached_tokens).sum()
    # a small cache (234 blocks of 512 per engine) under pressure: sharing running prompts' blocks
    # leaves more room for cached ones, so it hits at least as much as reserving them twice
    rs = simulate(_agg("reserve", True), reqs, "round_robin").records
    assert r.cached_tokens.sum() >= rs.cached_tokens.sum()


# ----------------------------------------------------------------- invariants, by class
@settings(max_examples=200, deadline=None)
@given(st.integers(0, 12), st.lists(st.tuples(st.sampled_from(["insert", "pin", "unpin", "cap"]),
                                               st.lists(st.integers(0, 15), min_size=0, max_size=5, unique=True),
                                               st.integers(0, 12)), max_size=60))
def test_block_cache_pin_invariants_under_random_operations(cap: int, ops) -> None:
    # a reference count per pinned block kept here independently; pinned blocks are never
    # evicted, unpinned ones fill at most the capacity left by the pinned ones
    c = BlockCache(cap)
    ref: dict[int, int] = {}
    for op, hashes, n in ops:
        if op == "insert":
            evicted = c.insert(tuple(hashes))
        elif op == "pin":
            evicted = c.pin(tuple(hashes))
            for h in hashes:
                ref[h] = ref.get(h, 0) + 1
        elif op == "unpin":
            held = tuple(h for h in hashes if ref.get(h))
            evicted = c.unpin(held)
            for h in held:
                ref[h] -= 1
                if not ref[h]:
                    del ref[h]
        else:
            evicted = c.set_capacity(n)
        assert not set(evicted) & set(ref)  # a pinned block is never evicted
        assert all(h in c for h in ref)
        assert c.num_pinned == len(ref)
        assert len(c) <= max(c.capacity_blocks, len(ref))


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_shared_accounting_releases_every_block_under_pressure(policy: str) -> None:
    # 2 mixed engines of 24 blocks of 512 tokens (12,288 tokens) on 300 trace requests that fit
    # one engine: heavy eviction and head-of-line waits; at the end nothing is reserved or
    # pinned, the cache is within capacity, and every request finished once
    from balancer.config import RouterConfig
    from sim.run.cluster import Cluster
    from sim.run.router_config import router_factory

    sc = Scenario(name="tight", model="llama-3.1-8b", hardware="h100",
                  mixed=PoolConfig(num_engines=2, max_prefill_tokens=2048, kv_capacity_tokens=24 * 512),
                  kv_accounting="shared")
    reqs = [r for r in spread_batches(take_slice(read_trace(), 0, 300), 3.0, seed=1)
            if r.prompt_tokens + r.max_output_tokens <= 24 * 512]
    assert len(reqs) > 100
    cl = Cluster(sc, router_factory(sc, RouterConfig(prefill_policy=policy, decode_policy=policy, block_size=512)))
    rec = cl.run(reqs)
    assert rec.num_finished == len(reqs) and not np.isnan(rec.finish_s).any()
    for rank in cl.ranks:
        assert rank.reserved_blocks == 0 and rank.cache.num_pinned == 0
        assert len(rank.cache) <= rank.kv_capacity_blocks == 24
        assert rank.cache.evicted_blocks > 0  # the pressure was real
