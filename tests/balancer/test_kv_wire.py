"""KV events from engines: wire decoding, engine-hash -> pdlb-hash translation, the ZMQ subscriber.

Payloads come from :class:`tests.kv_publisher.FakeEngine`, written from the format description
(not from pdlb code). Expected pdlb hashes are :func:`balancer.hashing.hash_token_blocks` of the
*whole* prompt at the router's block size, i.e. what the router computes for a routed request:
the translator reaches them incrementally, event by event, from another block size.
"""

from __future__ import annotations

import random
import time

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.hashing import hash_token_blocks
from balancer.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from balancer.kv_translate import KvEventTranslator, chain_root
from balancer.kv_wire import (EngineAllBlocksCleared, EngineBlockRemoved, EngineBlockStored, KvWireError, decode_batch,
                              decode_seq, encode_seq, offset_port)
from balancer.router import Router
from balancer.service.kv_subscriber import KvEventSource, KvEventSubscriber, sources_for_worker
from balancer.types import ReplicaId, Request
from tests.kv_publisher import FakeEngine

ENCODINGS = [("array", "int"), ("array", "bytes"), ("map", "int"), ("map", "bytes")]


def toks(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def decode(engine: FakeEngine, events: list):  # noqa: ANN201
    return decode_batch(engine.payload(events)).events


# ---------------------------------------------------------------------- decoding
@pytest.mark.parametrize("encoding,hash_kind", ENCODINGS)
def test_decode_both_encodings_and_hash_kinds(encoding, hash_kind):
    eng = FakeEngine(encoding, hash_kind, block_size=16, dp_rank=3)
    try:
        t = toks(48)
        hs, ev = eng.stored(t, lora_name="ad1" if encoding == "map" else None)
        payload = eng.payload([ev, eng.removed(hs[1:]), eng.cleared()], ts=12.5)
        b = decode_batch(payload)
        assert b.ts == 12.5 and b.data_parallel_rank == 3 and len(b.events) == 3
        s, r, c = b.events
        assert isinstance(s, EngineBlockStored) and s.block_hashes == tuple(hs) and s.parent_block_hash is None
        assert list(s.token_ids) == t and s.block_size == 16 and s.medium == "GPU"
        assert all(isinstance(h, bytes if hash_kind == "bytes" else int) for h in s.block_hashes)
        assert s.lora_name == ("ad1" if encoding == "map" else None)
        assert isinstance(r, EngineBlockRemoved) and r.block_hashes == tuple(hs[1:]) and r.medium == "GPU"
        assert isinstance(c, EngineAllBlocksCleared)
    finally:
        eng.close()


def test_decode_sglang_shape_and_seq_frames():
    eng = FakeEngine("array", "int", block_size=1, sglang=True)
    try:
        hs, ev = eng.stored([5, 6, 7], parent=-42)  # SGLang hashes are Python hash(): may be negative
        b = decode_batch(eng.payload([ev, eng.removed(hs[:1])]))
        assert b.data_parallel_rank is None
        s, r = b.events
        assert s.parent_block_hash == -42 and s.medium is None and s.lora_id is None and s.block_size == 1
        assert r.block_hashes == (hs[0],) and r.medium is None
    finally:
        eng.close()
    assert decode_seq((7).to_bytes(8, "big")) == 7 and decode_seq(encode_seq(-1)) == -1
    assert encode_seq(258) == b"\x00" * 6 + b"\x01\x02"
    with pytest.raises(KvWireError, match="8 bytes"):
        decode_seq(b"\x01")
    assert offset_port("tcp://10.0.0.1:5557", 3) == "tcp://10.0.0.1:5560"
    assert offset_port("tcp://*:5557", 0) == "tcp://*:5557" and offset_port("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2"
    with pytest.raises(ValueError, match="no port"):
        offset_port("tcp://host", 1)


@pytest.mark.parametrize("payload,match", [
    (b"\xc1", "not msgpack"),
    (msgpack.packb(5), "a batch must be"),
    (msgpack.packb([1.0, [["Nope"]]]), "unknown event type 'Nope'"),
    (msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2], "x", None]]]), "block_size"),
    (msgpack.packb([1.0, [["BlockStored", [1.5], None, [1], 1, None]]]), "block_hashes\\[0\\]"),
    (msgpack.packb({"ts": 1.0, "events": [{"type": "BlockStored", "block_hashes": [1]}]}), "without token_ids"),
    (msgpack.packb({"ts": "x", "events": []}), "ts must be a number"),
    (msgpack.packb([1.0, [{"type": "BlockRemoved"}]]), "without block_hashes"),
])
def test_malformed_payloads_name_the_problem(payload, match):
    with pytest.raises(KvWireError, match=match):
        decode_batch(payload)


def _stored_payload(encoding: str, n_hashes: int, n_tokens: int, block_size: int, kind: str | None = None) -> bytes:
    hs, tokens = list(range(1, n_hashes + 1)), list(range(n_tokens))
    if encoding == "map":
        ev = {"type": "BlockStored", "block_hashes": hs, "parent_block_hash": None, "token_ids": tokens,
              "block_size": block_size}
        if kind is not None:
            ev |= {"group_idx": 1, "kv_cache_spec_kind": kind}
        return msgpack.packb({"ts": 1.0, "events": [ev]})
    ev = ["BlockStored", hs, None, tokens, block_size, None]
    if kind is not None:
        ev += ["GPU", None, None, 1, kind]
    return msgpack.packb([1.0, [ev]])


@pytest.mark.parametrize("encoding", ["map", "array"])
@pytest.mark.parametrize("n_hashes, n_tokens, block_size", [
    (2, 3, 16),    # 2 blocks of 16 are 32 tokens, not 3
    (2, 31, 16), (2, 33, 16), (2, 48, 16), (1, 0, 16), (0, 16, 16), (3, 2, 1), (1, 4, 2),
])
def test_block_stored_whose_tokens_are_not_its_blocks_is_malformed(encoding, n_hashes, n_tokens, block_size):
    # vLLM: token_ids = all_token_ids[cached * block_size : full * block_size], one block_size per hash
    with pytest.raises(KvWireError) as e:
        decode_batch(_stored_payload(encoding, n_hashes, n_tokens, block_size))
    assert str(e.value) == (f"event 0: BlockStored has {n_tokens} token_ids for {n_hashes} block hashes of block_size "
                            f"{block_size} (expected len(block_hashes) * block_size = {n_hashes * block_size})")


@pytest.mark.parametrize("encoding", ["map", "array"])
@pytest.mark.parametrize("n_hashes, block_size", [(0, 16), (1, 16), (2, 16), (5, 1), (3, 7)])
def test_block_stored_with_one_block_of_tokens_per_hash_decodes(encoding, n_hashes, block_size):
    [ev] = decode_batch(_stored_payload(encoding, n_hashes, n_hashes * block_size, block_size)).events
    assert len(ev.block_hashes) == n_hashes and len(ev.token_ids) == n_hashes * block_size


@pytest.mark.parametrize("n_tokens, ok", [(48, True), (64, True), (32, True), (40, False), (16, False), (3, False)])
def test_sliding_window_groups_may_span_skipped_null_blocks(n_tokens, ok):
    # vLLM leaves a sliding-window / Mamba group's null blocks out of block_hashes while token_ids
    # still spans them: whole blocks more are well formed there, fewer or a partial block are not
    payload = _stored_payload("map", 2, n_tokens, 16, kind="sliding_window")
    if ok:
        [ev] = decode_batch(payload).events
        tr = KvEventTranslator(16)  # a group's own blocks are recorded, never announced by themselves
        assert tr.translate(ev) == [] and tr.stats.group_blocks_stored == 2 and tr.hybrid
    else:
        with pytest.raises(KvWireError, match=f"has {n_tokens} token_ids for 2 block hashes of block_size 16 "
                                              r"\(expected len\(block_hashes\) \* block_size = 32, or whole blocks "
                                              r"more for a sliding_window group\)"):
            decode_batch(payload)
    with pytest.raises(KvWireError, match="= 32\\)$"):  # full attention: exactly one block per hash
        decode_batch(_stored_payload("map", 2, 48, 16, kind="full_attention"))


_LEAF = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
         | st.binary(max_size=8) | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "GPU"]))
_EVENT = st.lists(_LEAF | st.lists(st.integers(-5, 2**33), max_size=40), max_size=12).map(
    lambda xs: ["BlockStored", *xs]) | st.dictionaries(
    st.sampled_from(["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "extra_keys",
                     "lora_name", "kv_cache_spec_kind"]),
    _LEAF | st.lists(st.integers(-5, 2**33), max_size=40) | st.lists(_LEAF, max_size=4), max_size=9)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200)
       | st.recursive(_LEAF, lambda c: st.lists(c, max_size=6) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                      max_leaves=30).map(msgpack.packb)
       | st.tuples(st.floats(allow_nan=False), st.lists(_EVENT, max_size=4)).map(lambda t: msgpack.packb([t[0], t[1]])))
def test_fuzz_decoder_and_translator_raise_only_wire_errors(payload):
    """Any bytes: either a batch, or KvWireError; a decoded batch's events translate or raise KvWireError."""
    try:
        batch = decode_batch(payload)
    except KvWireError:
        return
    tr = KvEventTranslator(4)
    for ev in batch.events:
        try:
            tr.translate(ev)
        except KvWireError:
            pass


# ---------------------------------------------------------------------- translation
@pytest.mark.parametrize("engine_bs,router_bs", [(16, 64), (64, 16), (16, 16), (24, 16), (1, 8)])
def test_translation_matches_the_routers_own_hashes_across_block_sizes(engine_bs, router_bs):
    """A prompt announced in three events (from the root, then two continuations) yields exactly
    the router's hashes of the whole prompt at its block size, each announced once all its tokens are."""
    eng = FakeEngine("map", "int", block_size=engine_bs)
    try:
        t = toks(engine_bs * 20, seed=engine_bs)
        tr = KvEventTranslator(router_bs)
        out = []
        parent = None
        for lo, hi in ((0, 7), (7, 8), (8, 20)):  # engine blocks [lo, hi)
            hs, ev = eng.stored(t[lo * engine_bs:hi * engine_bs], parent=parent)
            out += tr.translate(decode(eng, [ev])[0])
            parent = hs[-1]
        expected = hash_token_blocks(t, router_bs)
        got = [h for e in out for h in e.block_hashes]
        assert got == expected  # every router block once, in order
        # each event continues under the last router block announced before it
        k = 0
        for e in out:
            assert isinstance(e, BlockStored)
            assert e.parent_block_hash == (expected[k - 1] if k else None)
            k += len(e.block_hashes)
    finally:
        eng.close()


def test_removal_removes_every_router_block_the_engine_block_overlaps():
    eng = FakeEngine("array", "int", block_size=16)
    try:
        t = toks(16 * 8)
        tr = KvEventTranslator(64)  # router blocks: engine blocks 0-3 and 4-7
        hs, ev = eng.stored(t)
        tr.translate(decode(eng, [ev])[0])
        want = hash_token_blocks(t, 64)
        (r,) = tr.translate(decode(eng, [eng.removed([hs[5]])])[0])
        assert isinstance(r, BlockRemoved) and r.block_hashes == (want[1],)
        (r,) = tr.translate(decode(eng, [eng.removed([hs[0], hs[2]])])[0])
        assert r.block_hashes == (want[0],)
        assert tr.translate(decode(eng, [eng.removed([12345])])[0]) == []
        assert tr.stats.unknown_removed_blocks == 1
    finally:
        eng.close()


def test_a_continuation_whose_router_block_lost_a_piece_is_dropped():
    """Engine 16, router 64: blocks 0-2 stored (router block 0 pending), block 1 evicted, then
    block 3 arrives: router block 0 is not whole on the engine, so nothing is announced."""
    eng = FakeEngine("array", "int", block_size=16)
    try:
        t = toks(64)
        tr = KvEventTranslator(64)
        hs, ev = eng.stored(t[:48])
        assert tr.translate(decode(eng, [ev])[0]) == []
        tr.translate(decode(eng, [eng.removed([hs[1]])])[0])
        _, ev = eng.stored(t[48:], parent=hs[2])
        assert tr.translate(decode(eng, [ev])[0]) == []
        assert tr.stats.unknown_parent_blocks == 1
        # never-seen parent (cached before the router subscribed): dropped and counted
        _, ev = eng.stored(t[:16], parent=999)
        assert tr.translate(decode(eng, [ev])[0]) == [] and tr.stats.unknown_parent_blocks == 2
    finally:
        eng.close()


def test_lora_extra_keys_groups_and_clears_are_never_conflated():
    eng = FakeEngine("map", "int", block_size=16)
    try:
        t = toks(64)
        plain = hash_token_blocks(t, 16)
        tr = KvEventTranslator(16)
        _, ev = eng.stored(t, lora_name="sql-adapter", extra_keys=[("sql-adapter",)] * 4)
        (e,) = tr.translate(decode(eng, [ev])[0])
        assert list(e.block_hashes) == hash_token_blocks(t, 16, chain_root("sql-adapter"))  # LoRA root, not extra
        assert not set(e.block_hashes) & set(plain) and tr.stats.extra_key_blocks == 0
        _, ev = eng.stored(t, extra_keys=[None, ("mm-hash-abc", 0), None, None])
        (e,) = tr.translate(decode(eng, [ev])[0])
        assert list(e.block_hashes[:1]) == plain[:1] and not set(e.block_hashes[1:]) & set(plain)
        assert tr.stats.extra_key_blocks == 1
        _, ev = eng.stored(t, kind="cross_attention")
        assert tr.translate(decode(eng, [ev])[0]) == [] and tr.stats.skipped_group_events == 1
        _, ev = eng.stored(t, medium="CPU")
        (e,) = tr.translate(decode(eng, [ev])[0])
        assert e.medium == "CPU" and list(e.block_hashes) == plain
        assert tr.translate(decode(eng, [eng.cleared()])[0]) == [AllBlocksCleared(None), AllBlocksCleared("CPU")]
        assert tr.num_blocks() == 0
        with pytest.raises(KvWireError, match="expected 80"):
            tr.translate(EngineBlockStored((1, 2, 3, 4, 5), None, t, 16))
        with pytest.raises(KvWireError, match="unknown KV event medium"):
            tr.translate(EngineBlockStored((1,), None, t[:16], 16, medium="TAPE"))
    finally:
        eng.close()


def test_translator_memory_is_bounded():
    eng = FakeEngine("array", "int", block_size=4)
    try:
        tr = KvEventTranslator(4, capacity_blocks=10)
        for i in range(5):
            _, ev = eng.stored(toks(16, seed=i))
            tr.translate(decode(eng, [ev])[0])
        assert tr.num_blocks() == 10 and tr.stats.evicted_blocks == 10
    finally:
        eng.close()


# ---------------------------------------------------------------------- into the router
def _events_router(n: int = 3, block_size: int = 64, mode: str = "events") -> tuple[Router, list[ReplicaId]]:
    r = Router("cache_aware", "cache_aware", block_size=block_size, index_mode=mode)
    reps = [ReplicaId(f"http://e{i}", 0) for i in range(n)]
    for rep in reps:
        r.add_replica(rep, "mixed")
    return r, reps


def test_engine_announced_prefix_wins_the_next_request():
    """Events only: engine 2 announces a 512-token prefix (vLLM block size 16) that was never
    routed; a request sharing it goes to engine 2, with the whole prefix matched."""
    eng = FakeEngine("map", "bytes", block_size=16)
    try:
        router, reps = _events_router()
        t = toks(512 + 100)
        _, ev = eng.stored(t[:512])
        tr = KvEventTranslator(router.block_size)
        for e in tr.translate(decode(eng, [ev])[0]):
            router.on_kv_event(reps[2], e, 1.0)
        hs = tuple(hash_token_blocks(t, 64))
        route = router.route(Request("q", 2.0, len(t), hs), 2.0)
        assert route.decode == reps[2] and route.decode_matched_tokens == 512
    finally:
        eng.close()


# ---------------------------------------------------------------------- the subscriber, over ZMQ
class Collect:
    def __init__(self) -> None:
        self.items: list = []

    def __call__(self, items) -> None:  # noqa: ANN001
        self.items.extend(items)

    def wait(self, pred, timeout_s: float = 5.0) -> bool:  # noqa: ANN001
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if pred(self.items):
                return True
            time.sleep(0.01)
        return False


def _stored_hashes(items, rep=None) -> list[int]:  # noqa: ANN001
    return [h for r, e in items if isinstance(e, BlockStored) and (rep is None or r == rep) for h in e.block_hashes]


def _connect(sub: KvEventSubscriber, eng: FakeEngine) -> None:
    """PUB/SUB joins asynchronously: publish nothing until the subscription is in place and the
    subscriber's replay-on-connect (from 0) has been answered."""
    eng.wait_subscribed()
    eng.wait_replays_answered(1)


@pytest.mark.parametrize("encoding,hash_kind", ENCODINGS)
def test_subscriber_gap_is_answered_by_replay_and_duplicates_skipped(encoding, hash_kind):
    eng = FakeEngine(encoding, hash_kind, block_size=16)
    got = Collect()
    rep = ReplicaId("http://w", 0)
    sub = KvEventSubscriber([KvEventSource(rep, eng.endpoint, eng.replay_endpoint)], 16, got,
                            replay_timeout_s=10.0)  # a loaded CI host can take seconds to read a replay
    try:
        sub.start()
        _connect(sub, eng)
        t = toks(16 * 6)
        hs, ev = eng.stored(t[:32])
        eng.publish([ev])                       # seq 0
        hs2, ev2 = eng.stored(t[32:64], parent=hs[-1])
        eng.publish([ev2], send=False)          # seq 1: lost on the wire
        _, ev3 = eng.stored(t[64:], parent=hs2[-1])
        eng.publish([ev3])                      # seq 2: gap -> replay from 1
        want = hash_token_blocks(t, 16)
        assert got.wait(lambda items: _stored_hashes(items) == want), _stored_hashes(got.items)
        s = sub.stats()[rep]
        assert s["gaps"] == 1 and s["gaps_unrecovered"] == 0 and s["last_seq"] == 2 and s["batches"] == 3
        assert 0 in eng.replay_requests  # from the last applied batch, to check it is still the same one
    finally:
        sub.stop()
        eng.close()


def test_subscriber_counts_a_block_stored_with_the_wrong_token_count_and_applies_nothing_of_it():
    eng = FakeEngine("map", "int", block_size=16)
    got = Collect()
    rep = ReplicaId("http://w", 0)
    sub = KvEventSubscriber([KvEventSource(rep, eng.endpoint, eng.replay_endpoint)], 16, got, replay_timeout_s=10.0)
    try:
        sub.start()
        _connect(sub, eng)
        t = toks(64)
        hs, bad = eng.stored(t[:32])
        bad["token_ids"] = t[:3]  # 2 blocks of 16 with 3 token ids
        eng.publish([bad])                           # seq 0: malformed, counted, dropped
        eng.publish([eng.stored(t[:32])[1]])         # seq 1: the same blocks, well formed
        assert got.wait(lambda items: _stored_hashes(items) == hash_token_blocks(t[:32], 16)), got.items
        s = sub.stats()[rep]
        assert s["decode_errors"] == 1 and len(got.items) == 1
    finally:
        sub.stop()
        eng.close()


def test_subscriber_late_start_replays_from_zero_and_restart_clears():
    eng = FakeEngine("array", "int", block_size=16)
    t = toks(64)
    hs, ev = eng.stored(t)
    eng.publish([ev], send=False)  # published before any router listened: only the replay buffer has it
    got = Collect()
    rep = ReplicaId("http://w", 0)
    sub = KvEventSubscriber([KvEventSource(rep, eng.endpoint, eng.replay_endpoint)], 64, got, replay_timeout_s=10.0)
    try:
        sub.start()
        assert got.wait(lambda items: _stored_hashes(items) == hash_token_blocks(t, 64))
        assert eng.replay_requests[0] == 0
        _connect(sub, eng)
        t2 = toks(64, seed=9)
        _, ev = eng.stored(t2)
        eng.publish([ev])  # seq 1: in order
        assert got.wait(lambda items: len(_stored_hashes(items)) == 2)
        eng.restart()
        _, ev = eng.stored(t)
        eng.publish([ev])  # seq 0 again, newer timestamp: restart
        assert got.wait(lambda items: sub.stats()[rep]["restarts"] == 1 and len(_stored_hashes(items)) == 3)
        kinds = [type(e).__name__ for _, e in got.items]
        assert kinds == ["BlockStored", "BlockStored", "AllBlocksCleared", "AllBlocksCleared", "BlockStored"]
    finally:
        sub.stop()
        eng.close()


def test_subscriber_dp_ranks_on_port_plus_rank_and_staleness():
    for _attempt in range(20):  # rank r publishes on the base port + r: find a free pair
        base = FakeEngine("map", "int", block_size=16, dp_rank=0)
        try:
            r1 = FakeEngine("map", "int", block_size=16, dp_rank=1, port=base.port + 1,
                            replay_port=base.replay_port + 1)
            break
        except Exception:  # noqa: BLE001 - port + 1 taken by chance: try another pair
            base.close()
    else:
        pytest.fail("no free port pair")
    got = Collect()
    srcs = sources_for_worker("http://w", 2, base.endpoint, base.replay_endpoint)
    assert [s.endpoint for s in srcs] == [base.endpoint, r1.endpoint]
    assert [s.replay_endpoint for s in srcs] == [base.replay_endpoint, r1.replay_endpoint]
    sub = KvEventSubscriber(srcs, 16, got, stale_after_s=0.5)
    try:
        sub.start()
        _connect(sub, base)
        _connect(sub, r1)
        a, b = toks(32, 1), toks(32, 2)
        base.publish([base.stored(a)[1]])
        r1.publish([r1.stored(b)[1]])
        assert got.wait(lambda items: len(items) == 2)
        by = {rep.dp_rank: [h for h in e.block_hashes] for rep, e in got.items}
        assert by == {0: hash_token_blocks(a, 16), 1: hash_token_blocks(b, 16)}
        assert all(s["dp_rank_mismatches"] == 0 for s in sub.stats().values())
        assert got.wait(lambda items: all(s["stale"] for s in sub.stats().values()), 3.0)
        base.publish([base.stored(a)[1]])
        assert got.wait(lambda items: not sub.stats()[ReplicaId("http://w", 0)]["stale"], 3.0)
    finally:
        sub.stop()
        base.close()
        r1.close()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 24), st.integers(1, 24), st.integers(0, 2**32), st.lists(st.tuples(st.integers(0, 50),
                                                                                   st.integers(1, 6)), min_size=1, max_size=12))
def test_property_translation_equals_the_routers_hashes_of_every_announced_prefix(e_size, b_size, seed, steps):
    """Random chains with branches, announced event by event (each continues a random block seen
    so far, or starts anew), at random engine and router block sizes: the router blocks announced
    are exactly, and only once each, the router's own hashes of every announced prefix
    (independent model: hash_token_blocks of each whole prefix); removing an engine block then
    removes exactly the router blocks whose tokens it overlaps."""
    eng = FakeEngine("array", "int", block_size=e_size)
    try:
        rng = random.Random(seed)
        tr = KvEventTranslator(b_size)
        prefix_of = {}  # engine hash -> all token ids from the root to the end of that block
        announced: list[int] = []
        for pick, nblocks in steps:
            parents = list(prefix_of)
            parent = parents[pick % len(parents)] if parents and pick % 3 else None
            base = prefix_of[parent] if parent is not None else []
            # token ids from a wide range: with randrange(1000), two chains started anew could share
            # their first router block (router block size 1), legitimately announced once per chain
            t = [rng.randrange(1 << 30) for _ in range(nblocks * e_size)]
            hs, ev = eng.stored(t, parent=parent)
            for k, h in enumerate(hs):
                prefix_of[h] = base + t[:(k + 1) * e_size]
            for e in tr.translate(decode(eng, [ev])[0]):
                announced += e.block_hashes
        expected = set()
        for p in prefix_of.values():
            expected |= set(hash_token_blocks(p, b_size))
        assert sorted(announced) == sorted(expected)
        victim = rng.choice(list(prefix_of))
        p = prefix_of[victim]
        lo, hi = len(p) - e_size, len(p)
        want = set()  # router blocks over its tokens, in every announced chain through it
        for q in prefix_of.values():
            if q[:len(p)] == p:
                router = hash_token_blocks(q, b_size)
                want |= {router[j] for j in range(len(router)) if j * b_size < hi and (j + 1) * b_size > lo}
        got = tr.translate(decode(eng, [eng.removed([victim])])[0])
        assert {h for e in got for h in e.block_hashes} == want
    finally:
        eng.close()


def test_subscriber_process_delivers_the_same_events_and_reports_stats():
    """The child-process runner (what pdlb serve uses) gives the same pdlb events as the thread."""
    eng = FakeEngine("map", "int", block_size=16)
    t = toks(128)
    eng.publish([eng.stored(t)[1]], send=False)  # only in the replay buffer: caught up at start
    got = Collect()
    rep = ReplicaId("http://w", 0)
    from balancer.service.kv_subscriber import KvEventSubscriberProcess

    sub = KvEventSubscriberProcess([KvEventSource(rep, eng.endpoint, eng.replay_endpoint)], 32, got,
                                   stats_interval_s=0.05)
    try:
        sub.start()
        assert got.wait(lambda items: _stored_hashes(items) == hash_token_blocks(t, 32), 10.0)
        assert got.wait(lambda items: sub.stats().get(rep, {}).get("batches") == 1, 5.0)
    finally:
        sub.stop()
        eng.close()
