"""The shared approximate prefix views' drain (:mod:`balancer.service.shared_prefix`): decisions
read in one drain that repeat (same replicas, same blocks) are applied once, and the index ends
exactly as applying every decision in turn would leave it (the reference: a second router fed
the same decisions one by one through ``record_routed``, in the order the drain reads them)."""

import asyncio
import random

from balancer.router import Router
from balancer.service.shared_prefix import PrefixShare
from balancer.types import ReplicaId

REPS = [ReplicaId(f"e{i}", d) for i in range(3) for d in range(2)]


def _router(capacity_blocks: int | None) -> Router:
    r = Router("round_robin", "round_robin", block_size=64, index_capacity_blocks=capacity_blocks)
    for rep in REPS:
        r.add_replica(rep, "mixed")
    return r


def _state(r: Router) -> dict:
    return {rep: (r.index.lru_order(rep), r.index.num_blocks(rep)) for rep in REPS}


def test_a_drain_folds_repeated_decisions_and_leaves_the_index_as_one_by_one(tmp_path):
    rng = random.Random(5)
    # 12 prompts sharing prefixes (chained-looking block lists: a common root, then branches)
    prompts = [tuple([1, 2] + [100 * b + k for k in range(rng.randrange(1, 5))]) for b in range(6)]
    prompts += [tuple([1] + [1000 * b + k for k in range(rng.randrange(1, 7))]) for b in range(6)]
    for capacity in (None, 9):  # unbounded, and small enough that decisions evict each other
        d = tmp_path / f"cap{capacity}"
        d.mkdir()
        writers_r = [_router(capacity) for _ in range(2)]
        reader_r, reference = _router(capacity), _router(capacity)
        shares = [PrefixShare(reader_r, str(d), 3, 0)] + [PrefixShare(w, str(d), 3, k + 1) for k, w in enumerate(writers_r)]
        per_ring: list[list[tuple]] = [[], []]
        t = 0.0
        for _ in range(300):
            k = rng.randrange(2)
            reps = tuple(rng.sample(REPS, rng.choice((1, 2))))  # mixed, or a PD pair
            hs = rng.choice(prompts)
            t += 0.001
            shares[1 + k].publish(reps, hs, t)
            per_ring[k].append((reps, hs, t))
        assert shares[0].drain() == 300
        for ring in per_ring:  # the drain reads ring 1, then ring 2
            for reps, hs, now_s in ring:
                reference.record_routed(reps, hs, now_s)
        assert _state(reader_r) == _state(reference)
        distinct = len({(reps, hs) for ring in per_ring for reps, hs, _ in ring})
        # 12 prompts x (6 single replicas + 30 ordered pairs) = 432 keys > 300 draws: repeats
        # happen (birthday bound) but not all draws repeat; each distinct one is applied once
        assert shares[0].received == 300 and shares[0].folded == 300 - distinct
        assert 0 < shares[0].folded < 300
        # a second drain with nothing new applies nothing
        assert shares[0].drain() == 0
        for sh in shares:
            asyncio.run(sh.close())


def test_the_same_decision_from_every_process_is_one_insert(tmp_path):
    """4 processes route one hot prompt to the same replica 50 times each: the reader records it
    once per drain (record_routed counted), at the latest of the 150 times."""
    readers = [_router(None) for _ in range(4)]
    shares = [PrefixShare(r, str(tmp_path), 4, k) for k, r in enumerate(readers)]
    calls: list[float] = []
    readers[0].record_routed = lambda reps, hs, now_s: calls.append(now_s)  # type: ignore[method-assign]
    t = 0.0
    for i in range(50):
        for k in (1, 2, 3):
            t += 1.0
            shares[k].publish((REPS[0],), (1, 2, 3), t)
    assert shares[0].drain() == 150 and calls == [150.0] and shares[0].folded == 149
    shares[2].publish((REPS[1],), (1, 2, 3), 151.0)  # another replica: another decision
    shares[1].publish((REPS[0],), (1, 2, 3), 152.0)
    assert shares[0].drain() == 2 and calls == [150.0, 152.0, 151.0]  # rings read in process order
    for sh in shares:
        asyncio.run(sh.close())
