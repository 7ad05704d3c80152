"""The shared approximate prefix views' drain (:mod:`balancer.service.processes.shared_prefix`): decisions
read in one drain that repeat (same replicas, same blocks) are applied once, and the index ends
exactly as applying every decision in turn would leave it (the reference: a second router fed
the same decisions one by one through ``record_routed``, in the order the drain reads them)."""

import asyncio
import random

from balancer.router import Router
from balancer.service.processes.shared_prefix import PrefixShare
from balancer.types import ReplicaId

REPS = [ReplicaId(f"e{i}", d) for i in range(3) for d in range(2)]


def _router(capacity_blocks: int | None) -> Router:
    r = Router("round_robin", "round_robin", block_size=64, index_capacity_blocks=capacity_blocks)
    for rep in REPS:
        r.add_replica(rep, "mixed")
    return r


def _share(r: Router, *args, **kw) -> PrefixShare:  # noqa: ANN002, ANN003
    """A share whose drains record into ``r.record_routed`` (looked up at each call, so a test may
    replace it on the router to collect what is recorded)."""
    return PrefixShare(*args, record=lambda reps, hs, now_s: r.record_routed(reps, hs, now_s), **kw)


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
        shares = [_share(reader_r, str(d), 3, 0)] + [_share(w, str(d), 3, k + 1) for k, w in enumerate(writers_r)]
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
    shares = [_share(r, str(tmp_path), 4, k) for k, r in enumerate(readers)]
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


def _collecting(r: Router) -> list[tuple]:
    got: list[tuple] = []
    r.record_routed = lambda reps, hs, now_s: got.append((tuple(reps), tuple(hs), now_s))  # type: ignore[method-assign]
    return got


async def _started(share: PrefixShare) -> PrefixShare:
    share.start()
    return share


def test_a_replacement_process_reads_its_predecessors_decisions_back(tmp_path):
    """Process 1 routes 40 decisions and dies (its ring file stays); its replacement (same index)
    starts with those 40 in its index (reference: a router fed them one by one through
    record_routed, as the other processes' drains record them) and writes on after them."""
    rng = random.Random(11)
    dead = _share(_router(None), str(tmp_path), 2, 1)
    written = []
    for i in range(40):
        reps, hs = (rng.choice(REPS),), tuple(1000 * i + k for k in range(rng.randrange(1, 4)))
        dead.publish(reps, hs, float(i))
        written.append((reps, hs, float(i)))
    head_before = dead._head
    asyncio.run(dead.close())  # what a SIGKILL leaves: the file and its bytes

    new_r, reference = _router(None), _router(None)
    for reps, hs, now_s in written:
        reference.record_routed(reps, hs, now_s)

    async def main():
        share = await _started(_share(new_r, str(tmp_path), 2, 1))
        assert share.recovered == 40
        assert _state(new_r) == _state(reference)
        share.publish((REPS[0],), (7,), 41.0)  # goes on after the predecessor's records
        assert share._head > head_before
        await share.close()

    asyncio.run(main())
    # a reader joining now sees the predecessor's 40 and the replacement's one, in order
    sibling_r = _router(None)
    got = _collecting(sibling_r)
    sib = _share(sibling_r, str(tmp_path), 2, 0)
    assert sib.drain() == 41
    assert [g[1] for g in got] == [w[1] for w in written] + [(7,)]
    asyncio.run(sib.close())


def test_a_late_reader_of_a_wrapped_ring_reads_a_suffix_of_at_least_half_of_it(tmp_path):
    """A 4 KiB ring written far past its capacity: a reader that opens it late gets exactly the
    most recent decisions (a suffix of what was written, none torn, none repeated) spanning at
    least half the ring and at most all of it (the property the mark gives, checked against the
    writer's own record sizes), where before it got nothing until the next write."""
    cap = 4096
    for seed in range(20):
        rng = random.Random(seed)
        d = tmp_path / f"s{seed}"
        d.mkdir()
        w = _share(_router(None), str(d), 2, 1, ring_bytes=cap)
        starts, written = [], []
        for i in range(rng.randrange(200, 600)):
            hs = tuple(10_000 * i + k for k in range(rng.randrange(1, 30)))  # distinct: nothing folds
            starts.append(w._head)
            w.publish((REPS[i % len(REPS)],), hs, float(i))
            written.append(hs)
        assert w._head > cap  # wrapped
        reader_r = _router(None)
        got = _collecting(reader_r)
        late = _share(reader_r, str(d), 2, 0, ring_bytes=cap)
        n = late.drain()
        assert n == len(got) > 0
        assert [g[1] for g in got] == written[-n:]
        span = w._head - starts[-n]
        assert cap // 2 <= span <= cap, (seed, span)
        for sh in (w, late):
            asyncio.run(sh.close())


def test_late_readers_with_records_up_to_half_the_ring_get_a_nonempty_suffix(tmp_path):
    """Records of random sizes up to about half the ring (marks then lie more than a ring apart)
    and readers joining at random points, some draining on as the writer goes: every reader's
    decisions are records that were written, in order, none torn or repeated, and a
    reader that joins a wrapped ring gets at least the newest record (it is intact: the ring holds
    the last ``cap`` bytes and every record is smaller). Expected values: the writer's own list."""
    cap = 4096
    for seed in range(30):
        rng = random.Random(seed)
        d = tmp_path / f"s{seed}"
        d.mkdir()
        w = _share(_router(None), str(d), 2, 1, ring_bytes=cap)
        written: list[tuple] = []
        readers: list[tuple[PrefixShare, list, int]] = []  # share, collected, index at join
        for i in range(rng.randrange(20, 120)):
            hs = tuple(10_000 * i + k for k in range(rng.randrange(1, 220)))  # up to ~2 KB records
            w.publish((REPS[i % len(REPS)],), hs, float(i))
            written.append(hs)
            if rng.random() < 0.08:
                r = _router(None)
                readers.append((_share(r, str(d), 2, 0, ring_bytes=cap), _collecting(r), len(written)))
                readers[-1][0].drain()
                if w._head > cap:
                    assert readers[-1][1], (seed, i)  # the newest record at least
            for sh, _, _ in readers:
                if rng.random() < 0.5:
                    sh.drain()
        for sh, got, _ in readers:
            sh.drain()
            idx = [written.index(g[1]) for g in got]  # a torn record would not be found
            assert idx == sorted(set(idx)), seed  # in order, none repeated (lapped readers skip)
            asyncio.run(sh.close())
        asyncio.run(w.close())


def test_the_read_timer_backs_off_while_the_rings_are_quiet(tmp_path):
    """Issue 26 (cost of being up): with nothing written, the reader's timer doubles its period from
    DRAIN_INTERVAL_S (20 ms) to DRAIN_IDLE_INTERVAL_S (320 ms): in 1 s it reads at start and then
    at 20, 60, 140, 300, 620, 940 ms (hand sum of 20 x 1, 2, 4, 8, 16, 16), 7 reads, not 51. A
    decision written then is read within one idle period, and while decisions keep coming the
    period is 20 ms again."""
    from balancer.service.processes.shared_prefix import DRAIN_IDLE_INTERVAL_S, DRAIN_INTERVAL_S

    assert (DRAIN_INTERVAL_S, DRAIN_IDLE_INTERVAL_S) == (0.02, 0.32)
    reader_r = _router(None)
    reader, writer = _share(reader_r, str(tmp_path), 2, 0), _share(_router(None), str(tmp_path), 2, 1)

    async def run() -> tuple[int, float, int]:
        reader.start()
        await asyncio.sleep(1.0)
        quiet = reader.ticks
        writer.publish((REPS[0],), (1, 2, 3), 1.0)
        t0 = asyncio.get_running_loop().time()
        while reader.received == 0 and asyncio.get_running_loop().time() - t0 < 2.0:
            await asyncio.sleep(0.005)
        seen_after = asyncio.get_running_loop().time() - t0
        before = reader.ticks
        for k in range(50):  # a decision every 10 ms for 0.5 s
            writer.publish((REPS[k % len(REPS)],), (1, 2, 3 + k), 2.0 + k)
            await asyncio.sleep(0.01)
        return quiet, seen_after, reader.ticks - before

    quiet, seen_after, busy_ticks = asyncio.run(run())
    assert 5 <= quiet <= 10, quiet  # 7 by the hand count; the host may delay a timer, never add one
    assert seen_after <= DRAIN_IDLE_INTERVAL_S + 0.25, seen_after
    assert busy_ticks >= 10, busy_ticks  # ~25 at 20 ms; 320 ms would give at most 2
    # REPS[0] got (1, 2, 3) and, from the loop, (1, 2, 3 + k) for k = 0, 6, ..., 48: blocks 1, 2 and
    # nine third blocks (3 among them) = 11, all read
    assert reader_r.index.num_blocks(REPS[0]) == 11
    for sh in (reader, writer):
        asyncio.run(sh.close())
