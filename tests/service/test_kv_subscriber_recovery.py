"""The KV-event subscriber's recovery, case by case, against the stand-in publisher
(:class:`tests.kv_publisher.FakeEngine`, which answers replays in the engines' 4-frame framing):
live batches held during a replay and merged by sequence, a timestamp going back, a disconnect
without a replay endpoint, a replay that never answers (back-off; other sources unaffected),
the hold bound, and a dead subscriber under ``pdlb serve --processes 1`` (restarted, in
``/health`` and the metrics). The same cases against the engines' own publishers:
``tests/service/test_engine_conformance.py``. Expected values come from the scenario (which batches were
published, lost or refused), counted by hand in each test.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from balancer.hashing import hash_token_blocks
from balancer.kv_events import AllBlocksCleared, BlockStored
from balancer.service import kv_subscriber as ks
from balancer.service.app import SERVICE, create_app
from balancer.service.config import ServiceConfig
from balancer.service.kv_subscriber import KvEventSource, KvEventSubscriber
from balancer.types import ReplicaId
from tests.kv_publisher import FakeEngine, free_port
from tests.balancer.test_kv_wire import Collect, _connect, _stored_hashes, toks

REP = ReplicaId("http://w", 0)


def _sub(eng: FakeEngine, got: Collect, replay: str | None = "engine", **kw) -> KvEventSubscriber:  # noqa: ANN003
    ep = eng.replay_endpoint if replay == "engine" else replay
    sub = KvEventSubscriber([KvEventSource(REP, eng.endpoint, ep)], 16, got, **kw)
    sub.start()
    return sub


@pytest.mark.parametrize("frames", [4, 3])
def test_live_batches_during_a_replay_are_held_and_merged_in_sequence(frames):
    """Late start, both reply framings: 3 batches only in the buffer; the replay answered only
    after 2 more were published live (held meanwhile, nothing applied): all 5 applied once, in
    order (the replay returns all 5; the 2 held are duplicates)."""
    import threading

    eng = FakeEngine("map", "int", block_size=16, replay_frames=frames)
    eng.replay_gate = threading.Event()
    t = toks(16 * 5)
    parent = None
    for i in range(3):
        hs, ev = eng.stored(t[16 * i:16 * (i + 1)], parent=parent)
        parent = hs[-1]
        eng.publish([ev], send=False)
    got = Collect()
    sub = _sub(eng, got)
    try:
        eng.wait_subscribed()
        end = time.monotonic() + 5
        while not eng.replay_requests and time.monotonic() < end:
            time.sleep(0.01)
        for i in range(3, 5):
            hs, ev = eng.stored(t[16 * i:16 * (i + 1)], parent=parent)
            parent = hs[-1]
            eng.publish([ev])
        time.sleep(0.3)
        assert got.items == []  # held: nothing applied before the replay
        assert sub.stats()[REP]["replaying"]
        eng.replay_gate.set()
        assert got.wait(lambda items: _stored_hashes(items) == hash_token_blocks(t, 16))
        s = sub.stats()[REP]
        assert s["batches"] == 5 and s["last_seq"] == 4 and s["duplicates"] == 2 and s["gaps_unrecovered"] == 0
        assert not s["replaying"]
    finally:
        sub.stop()
        eng.close()


def test_held_live_batches_merge_with_a_slow_replay():
    """One subscriber: its start replay answered late (the engine silent at first, then the
    subscriber's replay times out and is asked again on the next gap): the live batches held
    are applied right after the timeout, the lost one comes back by the later replay."""
    eng = FakeEngine("map", "int", block_size=16)
    eng.replay_silent = True
    got = Collect()
    sub = _sub(eng, got, replay_timeout_s=0.5)
    try:
        eng.wait_subscribed()
        t = toks(16 * 4)
        hs0, ev0 = eng.stored(t[:16])
        t0 = time.monotonic()
        eng.publish([ev0])                                     # seq 0: held during the hung start replay
        assert got.wait(lambda items: len(_stored_hashes(items)) == 1)
        held_for = time.monotonic() - t0
        assert 0.3 < held_for < 2.0, held_for                 # released at the 0.5 s timeout
        s = sub.stats()[REP]
        assert s["replay_failures"] == 1 and not s["replaying"]
        eng.replay_silent = False
        hs1, ev1 = eng.stored(t[16:32], parent=hs0[-1])
        eng.publish([ev1], send=False)                         # seq 1: lost on the wire
        _, ev2 = eng.stored(t[32:48], parent=hs1[-1])
        time.sleep(0.6)                                        # past the back-off (0.5 s)
        eng.publish([ev2])                                     # seq 2: gap -> replay from 0 (verify)
        assert got.wait(lambda items: _stored_hashes(items) == hash_token_blocks(t[:48], 16))
        s = sub.stats()[REP]
        assert s["gaps"] == 1 and s["gaps_unrecovered"] == 0 and s["replays"] == 2
    finally:
        sub.stop()
        eng.close()


def test_timestamp_going_back_is_a_restart():
    """A batch numbered in sequence whose ts is 60 s older than the last one's: another engine
    process publishes there; the view is cleared and the new stream taken up."""
    eng = FakeEngine("array", "int", block_size=16)
    got = Collect()
    sub = _sub(eng, got, replay=None)
    try:
        eng.wait_subscribed()
        t = toks(32)
        now = time.time()
        eng.publish([eng.stored(t)[1]], ts=now)
        eng.publish([eng.stored(t[:16])[1]], ts=now - 60)
        assert got.wait(lambda items: sub.stats()[REP]["restarts"] == 1 and len(_stored_hashes(items)) == 3)
        kinds = [type(e).__name__ for _, e in got.items]
        assert kinds == ["BlockStored", "AllBlocksCleared", "AllBlocksCleared", "BlockStored"]
    finally:
        sub.stop()
        eng.close()


def test_far_future_timestamp_is_refused_and_the_source_inconsistent_until_in_sequence():
    eng = FakeEngine("map", "int", block_size=16)
    got = Collect()
    sub = _sub(eng, got, replay=None, max_future_s=300)
    try:
        eng.wait_subscribed()
        t = toks(48)
        eng.publish([eng.stored(t[:16])[1]])                   # seq 0 applied
        eng.publish([eng.stored(t[:32])[1]], ts=time.time() + 3600)  # seq 1: an hour ahead: refused
        assert got.wait(lambda items: sub.stats()[REP]["refused_batches"] == 1)
        s = sub.stats()[REP]
        assert s["inconsistent"] and s["stale"] and s["last_seq"] == 1 and s["gaps"] == 0
        eng.publish([eng.stored(t)[1]])                        # seq 2: in sequence (1 taken): consistent
        # the stats turn consistent before the batch reaches the collector: wait for both
        assert got.wait(lambda items: not sub.stats()[REP]["inconsistent"] and len(_stored_hashes(items)) >= 1 + 3)
        assert sub.stats()[REP]["gaps"] == 0 and len(_stored_hashes(got.items)) == 1 + 3  # seq 0: 1 block, seq 2: 3
    finally:
        sub.stop()
        eng.close()


def test_a_run_of_jumped_numbers_is_taken_as_a_restart():
    """3 batches numbered one after another, each 10**9 past the last applied (limit 10**6): the
    first two refused, the third makes the run a restart; the run's batches are applied."""
    eng = FakeEngine("map", "int", block_size=16)
    got = Collect()
    sub = _sub(eng, got, replay=None, max_seq_jump=10**6)
    try:
        eng.wait_subscribed()
        t = toks(16 * 4)
        eng.publish([eng.stored(t[:16])[1]])                   # seq 0
        eng.seq = 10**9
        for i in range(1, 4):
            eng.publish([eng.stored(t[16 * i:16 * (i + 1)])[1]])
        assert got.wait(lambda items: sub.stats()[REP]["restarts"] == 1 and len(_stored_hashes(items)) == 4)
        s = sub.stats()[REP]
        assert s["refused_batches"] == 3 and s["last_seq"] == 10**9 + 2 and not s["inconsistent"]
    finally:
        sub.stop()
        eng.close()


def test_disconnect_without_replay_endpoint_then_a_jump_is_a_restart():
    """No replay endpoint: the publisher's socket goes away and comes back (a new engine on the
    same port) and the next batch is not last + 1: a restart (nothing to check it against)."""
    port = free_port()
    eng = FakeEngine("map", "int", block_size=16, port=port)
    got = Collect()
    sub = _sub(eng, got, replay=None)
    try:
        eng.wait_subscribed()
        t = toks(32)
        eng.publish([eng.stored(t[:16])[1]])
        eng.publish([eng.stored(t)[1]])
        assert got.wait(lambda items: len(_stored_hashes(items)) == 3)  # 1 block, then 2 (announced again)
        eng.close()
        eng = FakeEngine("map", "int", block_size=16, port=port)
        eng.wait_subscribed()
        assert got.wait(lambda items: sub.stats()[REP]["disconnects"] >= 1)
        eng.seq = 5
        eng.publish([eng.stored(t[:16])[1]])
        assert got.wait(lambda items: sub.stats()[REP]["restarts"] == 1 and len(_stored_hashes(items)) == 4)
    finally:
        sub.stop()
        eng.close()


def test_replays_of_several_sources_run_at_once_and_are_bounded():
    """4 engines, each with a hung replay; max_concurrent_replays 2: two replays run, two wait;
    the waiting ones start as the first time out; every source's live batch is then applied.
    The replay timeout (2 s) leaves room for a loaded host to subscribe all four before the first two
    time out (at 0.5 s a host at load ~15 saw all four replays started by the first check)."""
    engs = [FakeEngine("map", "int", block_size=16) for _ in range(4)]
    for e in engs:
        e.replay_silent = True
    got = Collect()
    reps = [ReplicaId(f"http://w{i}", 0) for i in range(4)]
    sub = KvEventSubscriber([KvEventSource(r, e.endpoint, e.replay_endpoint) for r, e in zip(reps, engs)], 16, got,
                            replay_timeout_s=2.0, max_concurrent_replays=2)
    sub.start()
    try:
        for e in engs:
            e.wait_subscribed()
        time.sleep(0.2)
        assert sorted(len(e.replay_requests) for e in engs) == [0, 0, 1, 1]
        assert all(d["replaying"] for d in sub.stats().values())
        t = toks(16)
        for e in engs:
            e.publish([e.stored(t)[1]])
        assert got.wait(lambda items: len(_stored_hashes(items)) == 4, timeout_s=15)
        assert [len(e.replay_requests) for e in engs] == [1, 1, 1, 1]
        assert all(d["replay_failures"] == 1 and not d["replaying"] for d in sub.stats().values())
    finally:
        sub.stop()
        for e in engs:
            e.close()


def test_hold_is_bounded_and_drops_the_oldest_batches(monkeypatch):
    """Hold bound 3 (monkeypatched), the start replay hangs, 5 chained batches come live: the 2
    oldest held are dropped and counted; at the replay timeout the 3 kept are applied; their
    blocks continue blocks never seen, so the translator places none (counted as unknown parents)
    rather than guess."""
    monkeypatch.setattr(ks, "MAX_HELD_BATCHES", 3)
    eng = FakeEngine("map", "int", block_size=16)
    eng.replay_silent = True
    got = Collect()
    sub = _sub(eng, got, replay_timeout_s=1.0)
    try:
        eng.wait_subscribed()
        t = toks(16 * 5)
        parent = None
        for i in range(5):
            hs, ev = eng.stored(t[16 * i:16 * (i + 1)], parent=parent)
            parent = hs[-1]
            eng.publish([ev])
        assert got.wait(lambda items: sub.stats()[REP]["batches"] == 3, timeout_s=5)
        s = sub.stats()[REP]
        assert s["held_dropped"] == 2 and s["last_seq"] == 4 and s["replay_failures"] == 1
        assert s["pdlb_events"] == 0 and s["translator_unknown_parent_blocks"] == 3 and got.items == []
    finally:
        sub.stop()
        eng.close()


# ---------------------------------------------------------------------- pdlb serve, one process
async def test_a_killed_subscriber_process_is_logged_restarted_and_shown(caplog):
    """``--processes 1``: the subscriber's child process SIGKILLed: within the supervision interval
    it is logged at ERROR, started again (the replica cleared, then caught up by replay), and
    ``/health`` and ``/metrics`` show it."""
    from sim.emulator.app import STATE, create_engine_app
    from sim.emulator.config import EmulatorConfig

    eng = FakeEngine("map", "int", block_size=16)
    es = TestServer(create_engine_app(EmulatorConfig(role="mixed", speed=50.0)), host="127.0.0.1")
    await es.start_server()
    es.app[STATE].port = es.port
    url = f"http://127.0.0.1:{es.port}"
    cfg = ServiceConfig.model_validate({"pd_protocol": "none", "port": 0, "block_size": 16, "index_mode": "events",
                                        "health_check": {"enabled": False},
                                        "workers": [{"url": url, "role": "mixed", "events": eng.endpoint,
                                                     "replay": eng.replay_endpoint}]})
    r = TestServer(create_app(cfg), host="127.0.0.1")
    await r.start_server()
    svc = r.app[SERVICE]
    rep = ReplicaId(url, 0)
    t = toks(64)
    want = tuple(hash_token_blocks(t, 16))

    async def until(pred, timeout_s: float = 15.0) -> bool:  # noqa: ANN001
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if pred():
                return True
            await asyncio.sleep(0.05)
        return False

    try:
        async with aiohttp.ClientSession() as s:
            assert await until(lambda: eng.replays_answered >= 1)
            await asyncio.sleep(0.3)
            eng.publish([eng.stored(t)[1]])
            assert await until(lambda: svc.router.index.match(want) == {rep: 4})
            async with s.get(f"http://127.0.0.1:{r.port}/health") as h:
                body = await h.json()
            assert body["kv_events"]["subscriber"] == "running" and body["kv_events"]["restarts"] == 0
            pid = svc.kv_subscriber.subscriber.pid
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            assert await until(lambda: svc.kv_subscriber.restarts == 1 and svc.kv_subscriber.alive())
            took = time.monotonic() - t0
            print(f"dead subscriber process restarted after {took:.2f} s")
            assert any(rec.levelname == "ERROR" and "KV event subscriber died" in rec.getMessage()
                       for rec in caplog.records)
            # cleared, then rebuilt from the engine's replay buffer (seq 0)
            assert await until(lambda: svc.router.index.match(want) == {rep: 4})
            async with s.get(f"http://127.0.0.1:{r.port}/health") as h:
                body = await h.json()
            assert h.status == 200 and body["kv_events"]["subscriber"] == "running"
            assert body["kv_events"]["restarts"] == 1 and "exited" in body["kv_events"]["last_error"]
            async with s.get(f"http://127.0.0.1:{r.port}/metrics") as m:
                text = await m.text()
            assert "pdlb_kv_events_subscriber_restarts_total 1.0" in text
            assert "pdlb_kv_events_subscriber_up 1.0" in text
    finally:
        await r.close()
        await es.close()
        eng.close()
