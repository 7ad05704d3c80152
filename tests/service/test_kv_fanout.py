"""The KV fan-out ring (:mod:`balancer.service.processes.kv_fanout`): one subscriber's translated events read
by every router process.

Expected record bytes are spelled out by hand from the format table in the module docstring
(little-endian fields), the checksum computed with the ``xxhash`` library; ring behaviour (wrap,
a reader lapped, an oversize event, a torn record, a writer taking over) is checked against the
events written, counted by hand.
"""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.hashing import hash_token_blocks
from balancer.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from balancer.router import Router
from balancer.service.config import KvEventsConfig
from balancer.service.processes.kv_fanout import FanoutFollower, KvFanout
from balancer.service.processes.kv_ring import (HEADER_BYTES, TORN_RETRIES, RingReader, RingWriter, decode_body, encode_record,
                                      fanout_ring_path, split_event)
from balancer.service.kv_metrics import KvEventsFilesCollector, write_stats_file
from balancer.service.kv_subscriber import KvEventSource
from balancer.types import ReplicaId
from tests.kv_publisher import FakeEngine

REP = ReplicaId("http://e", 3)



async def _until(pred, timeout_s: float = 15.0) -> bool:  # noqa: ANN001
    """Poll ``pred`` every 20 ms until it holds or ``timeout_s`` passes; its last value."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        await asyncio.sleep(0.02)
    return pred()

def test_record_bytes_match_the_format_table():
    ev = BlockStored((1, 2**64 - 1), "GPU", 7)
    body = (b"\x05\x00\x00\x00\x00\x00\x00\x00"  # seq 5
            b"\x01"  # kind BlockStored
            b"\x03"  # flags: parent + medium
            b"\x03\x00\x00\x00"  # dp_rank 3
            b"\x08\x00" b"http://e"  # engine
            b"\x03" b"GPU"  # medium
            b"\x07\x00\x00\x00\x00\x00\x00\x00"  # parent 7
            b"\x02\x00\x00\x00"  # 2 hashes
            b"\x01\x00\x00\x00\x00\x00\x00\x00" b"\xff\xff\xff\xff\xff\xff\xff\xff")
    want = len(body).to_bytes(4, "little") + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little") + body
    assert encode_record(5, REP, ev) == want
    assert decode_body(body) == (5, REP, ev)
    # a removal without medium, a clear: flags 0, no optional fields
    rm = b"\x00" * 8 + b"\x02\x00" + b"\x00" * 4 + b"\x01\x00x" + b"\x01\x00\x00\x00" + b"\x2a" + b"\x00" * 7
    assert encode_record(0, ReplicaId("x", 0), BlockRemoved((42,)))[12:] == rm
    cl = b"\x09" + b"\x00" * 7 + b"\x03\x02" + b"\x01\x00\x00\x00" + b"\x01\x00y" + b"\x03CPU" + b"\x00" * 4
    assert encode_record(9, ReplicaId("y", 1), AllBlocksCleared("CPU"))[12:] == cl
    with pytest.raises(ValueError):
        encode_record(0, ReplicaId("x" * 65536, 0), ev)
    with pytest.raises(ValueError):
        decode_body(body[:-1])  # a hash cut short
    with pytest.raises(ValueError):
        decode_body(b"\x00" * 8 + b"\x09" + body[9:])  # unknown kind


def _stored(i: int, n: int = 3) -> BlockStored:
    return BlockStored(tuple(range(i * 100, i * 100 + n)), "GPU", None if i == 0 else i * 100 - 1)


def test_ring_wraps_and_a_reader_sees_every_record_in_order(tmp_path):
    path = str(tmp_path / "r")
    w = RingWriter(path, ring_bytes=4096)
    r = RingReader(path)
    got = []
    sent = []
    for i in range(200):  # records of 76 bytes (68 the first, no parent): the ring wraps 3 times; read every 10
        ev = _stored(i)
        w.write([(REP, ev)])
        sent.append(ev)
        if i % 10 == 9:
            items, more = r.poll()
            assert not more
            assert {rep for rep, _ in items} == {REP}
            got += [e for _, e in items]
    assert w.head > 3 * 4096 and got == sent
    assert r.records == 200 and r.lost_records == 0 and r.laps == 0 and r.corrupt_records == 0
    w.close()
    r.close()


def test_a_lapped_reader_counts_what_it_lost_and_goes_on(tmp_path):
    path = str(tmp_path / "r")
    w = RingWriter(path, ring_bytes=4096)
    r = RingReader(path)
    w.write([(REP, _stored(0))])
    assert [e for _, e in r.poll()[0]] == [_stored(0)]
    rec = 12 + 16 + 8 + 4 + 8 + 4 + 3 * 8  # head, fixed body, engine, medium, parent, count, hashes: 76
    assert len(encode_record(0, REP, _stored(1))) == rec
    k = 4096 // rec + 1  # more than the ring holds
    w.write([(REP, _stored(i)) for i in range(1, 1 + k)])
    items, _ = r.poll()
    assert items == [] and r.laps == 1 and r.lost_bytes == k * rec
    w.write([(REP, _stored(100))])
    items, _ = r.poll()
    assert [e for _, e in items] == [_stored(100)]
    assert r.lost_records == k  # records 1..k never applied, known from the sequence numbers
    w.close()
    r.close()


def test_an_event_larger_than_a_record_is_split_along_its_chain(tmp_path):
    """A BlockStored of 5,000 hashes in records of at most 1,024 bytes (124 hashes each): the
    parts chain by parent, and a router given the parts indexes the same as given the whole."""
    hs = tuple(hash_token_blocks(list(range(5000 * 4)), 4))
    ev = BlockStored(hs, None, None)
    parts = split_event(REP, ev, 1024)
    room = (1024 - (16 + 8 + 8 + 4)) // 8  # fixed body fields, engine, parent, count: 124
    assert [len(p.block_hashes) for p in parts] == [room] * (5000 // room) + [5000 % room]
    assert parts[1].parent_block_hash == hs[room - 1] and parts[0].parent_block_hash is None
    path = str(tmp_path / "r")
    w = RingWriter(path, ring_bytes=65536, max_record_bytes=1024)
    r = RingReader(path)
    routers = [Router("cache_aware", "cache_aware", block_size=4, index_mode="events") for _ in range(2)]
    for rt in routers:
        rt.add_replica(REP, "mixed")
    routers[0].on_kv_event(REP, ev)
    assert w.write([(REP, ev)]) == len(parts) == 41  # 41 KB in 41 records, published an eighth ring at a time
    got = []
    while True:
        items, more = r.poll()
        got += [e for _, e in items]
        if not more:
            break
    assert got == parts and r.laps == 0
    for e in got:
        routers[1].on_kv_event(REP, e)
    assert routers[1].index.match(hs) == routers[0].index.match(hs) == {REP: 5000}
    assert w.split_events == 1 and w.records == len(parts)
    w.close()
    r.close()


def test_a_record_not_yet_whole_is_never_applied(tmp_path):
    path = str(tmp_path / "r")
    w = RingWriter(path, ring_bytes=4096)
    r = RingReader(path)
    rec = bytearray(encode_record(0, REP, _stored(0)))
    mm = w._mm
    # bytes written, head not moved: nothing to read
    mm[HEADER_BYTES:HEADER_BYTES + len(rec)] = bytes(rec)
    assert r.poll() == ([], False)
    # head moved but one hash byte not (yet) what the writer wrote: checksum fails, retried
    bad = bytearray(rec)
    bad[-1] ^= 0xFF
    mm[HEADER_BYTES:HEADER_BYTES + len(bad)] = bytes(bad)
    w._head_word[0] = len(bad)
    assert r.poll() == ([], False) and r.pos == 0
    mm[HEADER_BYTES:HEADER_BYTES + len(rec)] = bytes(rec)  # the bytes arrive
    assert [e for _, e in r.poll()[0]] == [_stored(0)]
    # a record that stays broken is skipped after TORN_RETRIES polls, the next one applied
    w.head = w._head_word[0]
    w.seq = 1
    start = w.head
    w.write([(REP, _stored(1))])
    mm[HEADER_BYTES + start + 20] ^= 0xFF
    for _ in range(TORN_RETRIES):
        assert r.poll()[0] == []
    assert r.poll()[0] == [] and r.corrupt_records == 1 and r.pos == w.head
    w.write([(REP, _stored(2))])
    assert [e for _, e in r.poll()[0]] == [_stored(2)]
    assert r.lost_records == 1  # record 1
    w.close()
    r.close()


def test_a_second_writer_takes_the_ring_over_and_a_reader_may_come_first(tmp_path):
    path = str(tmp_path / "r")
    r = RingReader(path)
    assert r.poll() == ([], False)  # no ring yet
    w = RingWriter(path, ring_bytes=4096)
    assert not w.resumed
    w.write([(REP, _stored(0))])
    w.close()
    w2 = RingWriter(path, ring_bytes=999_999)  # an existing ring keeps its capacity and numbering
    assert w2.resumed and w2.capacity == 4096 and w2.seq == 1
    w2.write([(REP, _stored(1))])
    assert [e for _, e in r.poll()[0]] == [_stored(0), _stored(1)] and r.lost_records == 0
    w2.close()
    r.close()


def test_an_event_the_format_cannot_hold_is_skipped_and_counted_not_raised(tmp_path):
    path = str(tmp_path / "r")
    w = RingWriter(path, ring_bytes=4096)
    r = RingReader(path)
    assert w.write([(ReplicaId("x" * 70_000, 0), _stored(0)), (REP, _stored(1))]) == 1
    assert w.unencodable == 1 and [e for _, e in r.poll()[0]] == [_stored(1)] and r.lost_records == 0
    w.close()
    r.close()


async def test_one_subscriber_feeds_two_routers_and_is_restarted_when_it_dies(tmp_path):
    """Process 0's KvFanout (the subscriber child writing the ring) and process 1's follower, in one
    loop: an engine batch decoded once reaches both routers; the child killed, it is started again
    and the replica's view is cleared, then rebuilt from the engine's replay buffer."""
    eng = FakeEngine("map", "int", block_size=16)
    src = KvEventSource(REP, eng.endpoint, eng.replay_endpoint)
    routers = [Router("cache_aware", "cache_aware", block_size=16, index_mode="events") for _ in range(2)]
    for rt in routers:
        rt.add_replica(REP, "mixed")
    path = fanout_ring_path(str(tmp_path))
    loop = asyncio.get_running_loop()
    owner = KvFanout(path, routers[0].on_kv_event, True, [src], 16, KvEventsConfig())
    other = KvFanout(path, routers[1].on_kv_event, False, [src], 16, KvEventsConfig())
    t = list(range(64))
    want = tuple(hash_token_blocks(t, 16))

    try:
        await loop.run_in_executor(None, owner.start_subscriber)
        owner.follower.start()
        owner.supervise()
        other.follower.start()
        await asyncio.sleep(0.4)  # the SUB socket joins
        eng.publish([eng.stored(t)[1]])
        assert await _until(lambda: all(rt.index.match(want) == {REP: 4} for rt in routers))
        assert await _until(lambda: owner.stats().get(REP, {}).get("batches") == 1)
        assert other.stats() == {}  # decoded in the owner's subscriber only
        assert owner.fanout_stats()["applied"] == other.fanout_stats()["applied"] == 1
        assert owner.health()["subscriber"] == "running" and owner.health()["restarts"] == 0
        assert other.health() == {"subscriber": "process 0"}
        pid = owner.subscriber.pid
        os.kill(pid, signal.SIGKILL)
        assert await _until(lambda: owner.subscriber_restarts == 1 and owner.subscriber is not None
                           and owner.subscriber.pid != pid and owner.subscriber_alive())
        assert owner.health()["subscriber"] == "running" and owner.health()["restarts"] == 1
        # the other processes read process 0's state from the stats file it writes
        stats_dir = tmp_path / "prom"
        stats_dir.mkdir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(stats_dir)
        try:
            write_stats_file(str(stats_dir), 0, owner, fanout=owner.fanout_stats())
            assert other.health() == {"subscriber": "process 0", "up": True, "restarts": 1}
            text = "".join(f"{m.name} {s.labels} {s.value}\n" for m in KvEventsFilesCollector(str(stats_dir)).collect()
                           for s in m.samples)
            assert "kv_events_subscriber_up {'process': '0'} 1.0" in text
        finally:
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        # the new subscriber cleared the replica (2 media) and replayed the engine's buffer (seq 0)
        assert await _until(lambda: all(f.fanout_stats()["applied"] == 4 for f in (owner, other)))
        assert all(rt.index.match(want) == {REP: 4} for rt in routers)
        await asyncio.sleep(0.4)
        t2 = list(range(1000, 1032))
        eng.publish([eng.stored(t2)[1]])
        want2 = tuple(hash_token_blocks(t2, 16))
        assert await _until(lambda: all(rt.index.match(want2) == {REP: 2} for rt in routers))
        assert other.fanout_stats()["lost_records"] == 0
    finally:
        await loop.run_in_executor(None, owner.stop)
        other.stop()
        eng.close()


def test_follower_applies_in_bounded_passes(tmp_path):
    """A follower far behind applies at most READ_BYTES_PER_PASS per pass and says more is waiting."""
    path = str(tmp_path / "r")
    w = RingWriter(path, ring_bytes=1 << 20)
    applied = []
    f = FanoutFollower(path, lambda rep, ev: applied.append(ev))
    f.reader.read_bytes = 4096
    w.write([(REP, _stored(i)) for i in range(200)])  # 68 + 199 * 76 = 15,192 bytes
    passes = 0
    while f.drain():
        passes += 1
    # whole records per 4,096-byte pass: 54 (68 + 53 * 76 = 4,096), 53, 53, then the last 40
    assert len(applied) == 200 and passes == 4 and f.pending == 0
    w.close()
    f.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.booleans(), st.integers(0, 3)), min_size=1, max_size=60),
       st.integers(0, 2**32 - 1))
def test_ring_property_a_reader_gets_a_gapless_prefix_free_ordered_subsequence(steps, seed):
    """Random rounds (each: an event of 0-40 hashes, stored or removed, then 0-3 reader polls) on a
    4 KB ring: whatever the reader's pace, what it applies is exactly the written events in order
    minus the ones it counts as lost (records + lost_records = written), never a made-up one; a
    reader that polls after every round loses nothing. Then random bytes flipped in the unread
    span: nothing that was not written is ever returned."""
    import random as _random

    rng = _random.Random(seed)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "r")
        w = RingWriter(path, ring_bytes=4096)
        slow, fast = RingReader(path), RingReader(path)
        written, got_slow, got_fast = [], [], []
        for i, (n, stored, polls) in enumerate(steps):
            hs = tuple(rng.getrandbits(64) for _ in range(n))
            ev = BlockStored(hs, "GPU", i) if stored else BlockRemoved(hs, None)
            w.write([(ReplicaId(f"http://e{i % 3}", i % 2), ev)])
            written.append(ev)
            for _ in range(polls):
                got_slow += [e for _, e in slow.poll()[0]]
            while True:
                items, more = fast.poll()
                got_fast += [e for _, e in items]
                if not more:
                    break
        while True:
            items, more = slow.poll()
            got_slow += [e for _, e in items]
            if not more:
                break
        assert got_fast == written and fast.lost_records == 0
        it = iter(written)
        assert all(any(e == x for x in it) for e in got_slow)  # an ordered subsequence
        assert slow.records == len(got_slow) and slow.records + slow.lost_records == slow.next_seq
        assert slow.next_seq == len(written) or slow.laps > 0  # lapped at the very end: the rest unread
        # corruption: flip bits in records a third reader has not read yet
        third = RingReader(path)
        assert third.poll() is not None  # maps the ring
        mark = w.head
        third.pos, third.next_seq = mark, w.seq
        z = BlockStored((1, 2, 3), None, None)
        w.write([(ReplicaId("http://z", 0), z) for _ in range(5)])
        for _ in range(3):
            at = mark + rng.randrange(w.head - mark)
            w._mm[HEADER_BYTES + at % w.capacity] ^= 1 << rng.randrange(8)
        seen = []
        for _ in range(TORN_RETRIES + 3):
            seen += [e for _, e in third.poll()[0]]
        assert all(e == z for e in seen) and len(seen) <= 4 and third.pos == w.head
        for x in (w, slow, fast, third):
            x.close()


async def test_a_worker_removed_and_added_again_does_not_inherit_its_predecessors_events(tmp_path):
    """One subscriber writing the ring; the worker at REP's URL announces prefix A, is removed, and
    a new engine at the same URL is added and announces prefix B. A reader that reads the ring
    from its start afterwards (a lagging or restarted router process) applies the old worker's
    A, then the clear written before the new worker's first event, then B: its index holds B for
    REP and nothing of A, as a router that followed live does (the clear was the fix: before it,
    the reader from the start kept A on the new worker)."""
    old_eng = FakeEngine("map", "int", block_size=16)
    new_eng = FakeEngine("map", "int", block_size=16)
    from balancer.service.kv_subscriber import KvEventSubscriber

    path = fanout_ring_path(str(tmp_path))
    writer = RingWriter(path, 1 << 16)
    sub = KvEventSubscriber([KvEventSource(REP, old_eng.endpoint)], 16, writer.write)
    live = Router("cache_aware", "cache_aware", block_size=16, index_mode="events")
    live.add_replica(REP, "mixed")
    follower = RingReader(path)
    a, b = list(range(64)), list(range(500, 532))
    want_a, want_b = tuple(hash_token_blocks(a, 16)), tuple(hash_token_blocks(b, 16))

    def drain_live() -> None:
        for rep, ev in follower.poll()[0]:
            live.on_kv_event(rep, ev)

    async def until_drained(pred, timeout_s: float = 10.0) -> bool:  # noqa: ANN001
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            drain_live()
            if pred():
                return True
            await asyncio.sleep(0.02)
        return pred()

    try:
        sub.start()
        await asyncio.sleep(0.3)  # the SUB socket joins
        old_eng.publish([old_eng.stored(a)[1]])
        assert await until_drained(lambda: live.index.match(want_a) == {REP: 4})
        sub.remove_replicas([REP])
        live.remove_replica(REP)  # as the admin removal does in every process
        await asyncio.sleep(0.3)
        live.add_replica(REP, "mixed")
        sub.add_sources([KvEventSource(REP, new_eng.endpoint)])
        await asyncio.sleep(0.4)
        new_eng.publish([new_eng.stored(b)[1]])
        assert await until_drained(lambda: live.index.match(want_b) == {REP: 2})
        assert live.index.match(want_a) == {}
        fresh = Router("cache_aware", "cache_aware", block_size=16, index_mode="events")
        fresh.add_replica(REP, "mixed")
        from_start = RingReader(path)
        kinds = []
        for rep, ev in from_start.poll()[0]:
            kinds.append(type(ev).__name__)
            fresh.on_kv_event(rep, ev)
        assert kinds == ["BlockStored", "AllBlocksCleared", "AllBlocksCleared", "BlockStored"]
        assert fresh.index.match(want_b) == {REP: 2} and fresh.index.match(want_a) == {}
        from_start.close()
    finally:
        sub.stop()
        writer.close()
        follower.close()
        old_eng.close()
        new_eng.close()


# ---------------------------------------------------------------------- resync of a lapped reader
_REPS = [ReplicaId(f"http://r{k}", 0) for k in range(3)]
_PROMPTS = [[1000 * p + t for t in range(16 * (1 + p % 4))] for p in range(12)]  # 1-4 blocks of 16 tokens
_HASHES = [tuple(hash_token_blocks(p, 16)) for p in _PROMPTS]


def _events_router() -> Router:
    rt = Router("cache_aware", "cache_aware", block_size=16, index_mode="events")
    for rep in _REPS:
        rt.add_replica(rep, "mixed")
    return rt


def _random_batch(rng, n: int) -> list:  # noqa: ANN001
    """Engine-like pdlb events: a prompt's leading blocks stored, its rest as a continuation,
    blocks removed (a prompt's tail, as LRU evicts leaves), rarely a replica cleared."""
    out = []
    for _ in range(n):
        rep, p = rng.choice(_REPS), rng.randrange(len(_HASHES))
        hs = _HASHES[p]
        x = rng.random()
        if x < 0.5:
            k = rng.randrange(1, len(hs) + 1)
            out.append((rep, BlockStored(hs[:k])))
            if k < len(hs):
                out.append((rep, BlockStored(hs[k:], None, hs[k - 1])))
        elif x < 0.95:
            out.append((rep, BlockRemoved(hs[rng.randrange(len(hs)):])))
        else:
            out.append((rep, AllBlocksCleared()))
    return out


def _run_slow_reader(tmp: str, seed: int, slow_pace: float, index: int | None):  # noqa: ANN202
    """Write random batches; a fast reader polls after each, a slow one with probability
    ``slow_pace``; at the end both drain. Returns (reference, fast, slow routers, slow reader)."""
    import random

    rng = random.Random(seed)
    path = fanout_ring_path(tmp)
    w = RingWriter(path, 8192, mirror_capacity_blocks=4096)  # holds every live block (at most 3 x 30)
    fast, slow = RingReader(path, index=0), RingReader(path, index=index)
    ref, rt_fast, rt_slow = _events_router(), _events_router(), _events_router()

    def drain(reader: RingReader, rt: Router, until_idle: bool) -> None:
        for _ in range(1000 if until_idle else 1):
            items, more = reader.poll()
            for rep, ev in items:
                rt.on_kv_event(rep, ev)
            if not more and (not until_idle or reader.lag_bytes() == 0):
                return

    for _ in range(120):
        batch = _random_batch(rng, rng.randrange(1, 12))
        for rep, ev in batch:
            ref.on_kv_event(rep, ev)
        w.write(batch)
        drain(fast, rt_fast, False)
        if rng.random() < slow_pace:
            drain(slow, rt_slow, False)
    w.serve_resyncs()
    drain(fast, rt_fast, True)
    drain(slow, rt_slow, True)
    w.serve_resyncs()  # a lap in the final drain: its snapshot
    drain(slow, rt_slow, True)
    drain(fast, rt_fast, True)
    w.close()
    fast.close()
    slow.close()
    return ref, rt_fast, rt_slow, slow


def _views(rt: Router) -> list[dict]:
    return [rt.index.match(hs) for hs in _HASHES]


def test_a_lapped_reader_resyncs_to_the_view_of_one_that_missed_nothing(tmp_path):
    """A reader polled on 1 write in 25 falls more than the 8 KiB ring's safe lag behind (lapped, counted);
    it asks for a resync, the writer answers with a snapshot of its mirror for that reader only
    (clears, then the stored blocks), and after draining its index matches every prompt exactly
    as a router fed every event directly (the reference, an independent path) and as the fast
    reader, which never saw the snapshot (targeted records skipped). Without an index (it cannot
    ask) the same slow reader ends with a different view: what the resync fixes."""
    os.makedirs(tmp_path / "a")
    ref, fast, slow, reader = _run_slow_reader(str(tmp_path / "a"), 11, 0.04, 1)
    assert reader.laps >= 1 and reader.resyncs == reader.laps and reader.snapshot_records > 0
    assert _views(slow) == _views(ref) == _views(fast)
    os.makedirs(tmp_path / "b")
    ref2, _, lost, reader2 = _run_slow_reader(str(tmp_path / "b"), 11, 0.04, None)
    assert reader2.laps >= 1 and reader2.resyncs == 0
    assert _views(ref2) == _views(ref) and _views(lost) != _views(ref2)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([0.03, 0.1, 0.3, 1.0]))
def test_resync_property_any_reader_pace_ends_with_the_reference_view(seed, pace):
    """Property: whatever the slow reader's pace (lapped many times, or never), after the writes
    stop and it drains, its view equals the reference's and the fast reader's."""
    with tempfile.TemporaryDirectory() as tmp:
        ref, fast, slow, reader = _run_slow_reader(tmp, seed, pace, 1)
        assert reader.resyncs == reader.laps
        assert _views(slow) == _views(ref) == _views(fast)


def test_view_mirror_snapshot_puts_parents_first_joins_runs_and_is_bounded():
    """By hand: [1, 2] stored, 3 continuing 2, 5 continuing 4 (4 unknown), 1 stored again (moved to
    the newest, after its children), 2 removed: the snapshot clears REP's HBM and host views, then
    stores [1] (root), [3] under 2 (2 is gone: a continuation of a removed block, as the engine
    announced it), [5] under 4. Over the bound the oldest stored block goes first."""
    from balancer.service.processes.kv_ring import ViewMirror

    m = ViewMirror(capacity_blocks=10)
    for ev in (BlockStored((1, 2)), BlockStored((3,), None, 2), BlockStored((5,), None, 4), BlockStored((1,)),
               BlockRemoved((2,))):
        m.apply(REP, ev)
    assert m.blocks == 3
    assert m.snapshot() == [(REP, AllBlocksCleared(None)), (REP, AllBlocksCleared("CPU")),
                            (REP, BlockStored((3,), None, 2)), (REP, BlockStored((5,), None, 4)),
                            (REP, BlockStored((1,), None, None))]
    m2 = ViewMirror(capacity_blocks=3)
    m2.apply(REP, BlockStored((10, 11, 12)))
    m2.apply(REP, BlockStored((13,), "CPU", None))
    m2.apply(REP, BlockStored((14,), None, 12))  # 4 + 1 blocks: 10, then 11 evicted (oldest of HBM)
    assert (m2.blocks, m2.evicted) == (3, 2)
    assert m2.snapshot()[2:] == [(REP, BlockStored((12, 14), None, 11)), (REP, BlockStored((13,), "CPU", None))]
    m2.apply(REP, AllBlocksCleared())
    assert m2.blocks == 1 and m2.snapshot()[2:] == [(REP, BlockStored((13,), "CPU", None))]


def test_view_mirror_one_event_over_the_bound_keeps_its_newest_blocks():
    from balancer.service.processes.kv_ring import ViewMirror

    m = ViewMirror(capacity_blocks=2)
    m.apply(ReplicaId("http://other", 0), AllBlocksCleared())  # a known replica with an empty view
    m.apply(ReplicaId("http://other", 0), BlockStored((7,)))
    m.apply(ReplicaId("http://other", 0), BlockRemoved((7,)))
    m.apply(REP, BlockStored((1, 2, 3, 4)))
    assert (m.blocks, m.evicted) == (2, 2) and m.snapshot()[4:] == [(REP, BlockStored((3, 4), None, 2))]


async def test_a_router_process_that_starts_after_the_ring_wrapped_resyncs_from_the_subscriber(tmp_path):
    """Process 0's KvFanout (subscriber child) writes an 8 KiB ring; 150 prompts are stored and
    removed again (the ring wraps several times, the live view stays small), then 3 kept. A
    process-1 follower that starts only now (a replacement router process) is lapped at its first
    look, asks for a resync, and the subscriber child answers with a snapshot for it alone: its
    router then matches the 3 kept prompts exactly as process 0's does, and nothing removed."""
    eng = FakeEngine("map", "int", block_size=16)
    src = KvEventSource(REP, eng.endpoint)
    routers = [Router("cache_aware", "cache_aware", block_size=16, index_mode="events") for _ in range(2)]
    for rt in routers:
        rt.add_replica(REP, "mixed")
    path = fanout_ring_path(str(tmp_path))
    loop = asyncio.get_running_loop()
    owner = KvFanout(path, routers[0].on_kv_event, True, [src], 16, KvEventsConfig(), ring_bytes=8192, index=0)
    late = KvFanout(path, routers[1].on_kv_event, False, [src], 16, KvEventsConfig(), index=1)
    prompts = [[10_000 * p + t for t in range(64)] for p in range(153)]
    hashes = [tuple(hash_token_blocks(p, 16)) for p in prompts]

    try:
        await loop.run_in_executor(None, owner.start_subscriber)
        owner.follower.start()
        await loop.run_in_executor(None, eng.wait_subscribed)  # the SUB socket has joined
        for p in prompts[:150]:
            hs, ev = eng.stored(p)
            eng.publish([ev, eng.removed(hs)])
            await asyncio.sleep(0.005)  # process 0's follower keeps up (it polls every 5 ms)
        for p in prompts[150:]:
            eng.publish([eng.stored(p)[1]])
        assert await _until(lambda: all(routers[0].index.match(h) == {REP: 4} for h in hashes[150:]))
        assert owner.follower.reader.next_seq >= 303 and owner.follower.reader.head_bytes() > 8192
        late.follower.start()
        assert await _until(lambda: all(routers[1].index.match(h) == {REP: 4} for h in hashes[150:]))
        st = late.fanout_stats()
        assert st["laps"] == st["resyncs"] == 1 and st["snapshot_records"] == 2 + 3  # 2 clears, 3 stores
        assert all(routers[1].index.match(h) == {} for h in hashes[:150])
        assert owner.fanout_stats()["laps"] == owner.fanout_stats()["snapshot_records"] == 0  # not for it: skipped
        # the child's writer counters reach the owner (its stats come every 0.5 s): one snapshot
        # written, the mirror holds the 3 kept prompts' 4 blocks each and never reached its bound
        # (8192 / 64 = 128 blocks; at most 3 x 4 + 4 live at once)
        assert await _until(lambda: owner.fanout_stats().get("snapshots_written") == 1)
        w = owner.fanout_stats()
        assert (w["mirror_blocks"], w["mirror_evicted"]) == (12, 0) and w["writer_records"] >= 303
    finally:
        await loop.run_in_executor(None, owner.stop)
        late.stop()
        eng.close()


def test_ring_writer_stats_count_the_mirror_bound_and_reach_the_metrics(tmp_path):
    """A writer whose resync mirror holds 3 blocks: HBM (10, 11, 12), host (13), then 14 under 12:
    10 and 11 evicted (hand count, as test_view_mirror_... above); its counters go out as
    pdlb_kv_events_fanout_mirror_* for the owner's process, not for processes without a writer."""
    from prometheus_client.core import Metric

    from balancer.service.kv_metrics import _fanout_families

    w = RingWriter(fanout_ring_path(str(tmp_path)), 8192, mirror_capacity_blocks=3)
    try:
        w.write([(REP, BlockStored((10, 11, 12))), (REP, BlockStored((13,), "CPU", None)),
                 (REP, BlockStored((14,), None, 12))])
        st = w.stats()
        assert st == {"writer_records": 3, "snapshots_written": 0, "mirror_blocks": 3, "mirror_evicted": 2}
    finally:
        w.close()
    fams: list[Metric] = list(_fanout_families([("0", {"records": 3, **st}), ("1", {"records": 3})]))
    by = {(s.name, s.labels["process"]): s.value for f in fams for s in f.samples}
    assert by[("pdlb_kv_events_fanout_mirror_evicted_total", "0")] == 2
    assert by[("pdlb_kv_events_fanout_mirror_blocks", "0")] == 3
    assert by[("pdlb_kv_events_fanout_snapshots_written_total", "0")] == 0
    assert ("pdlb_kv_events_fanout_mirror_blocks", "1") not in by


def test_a_thread_subscriber_taking_an_existing_ring_over_first_clears_its_replicas(tmp_path):
    """``runner="thread"`` (the subscriber in the owner's own process): on a ring an earlier writer
    left, the new writer first writes ``AllBlocksCleared`` for each replica's HBM (medium None) and
    host (``"CPU"``) views, as the child process does (kv_subscriber's process target); expected
    records from the module docstring's Failures paragraph."""
    eng = FakeEngine("map", "int", block_size=16)
    src = KvEventSource(REP, eng.endpoint, eng.replay_endpoint)
    path = fanout_ring_path(str(tmp_path))
    old = RingWriter(path, ring_bytes=8192)
    old.write([(REP, _stored(0))])
    old.close()
    reader = RingReader(path)
    fan = KvFanout(path, lambda rep, ev: None, True, [src], 16, KvEventsConfig(runner="thread"), ring_bytes=8192)
    try:
        fan.start_subscriber()
        events, _ = reader.poll()
        assert events[:3] == [(REP, _stored(0)), (REP, AllBlocksCleared(None)), (REP, AllBlocksCleared("CPU"))]
    finally:
        fan.stop()
        reader.close()
        eng.close()
