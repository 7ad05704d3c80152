"""``pdlb engine --kv-events``: the emulator publishes KV cache events on vLLM's wire
(:mod:`sim.emulator.kv_events`), so that events mode can be tried with the emulator alone.

Checked against (1) pdlb's own subscriber and router (events mode): each engine's prompts are
credited to that engine and to no other, first through replay (the subscriber starts after the
requests), then live; and (2) vLLM 0.33's OWN decoder (``msgspec`` with its ``KVEventBatch``
type, from its wheel: :func:`tests.engine_publishers.load_vllm`; ``slow``, as the other vLLM
cases): every published batch, live and replayed, decodes into vLLM's event classes with the
fields expected by hand (the prompt's tokens, one hash per full block, the block size, ``GPU``).
Expected values come from the prompts each engine was given (by construction).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from balancer.hashing import hash_token_blocks
from balancer.router import Router
from balancer.service.kv_subscriber import KvEventSource, KvEventSubscriber
from balancer.types import ReplicaId
from sim.emulator import EmulatorConfig, create_engine_app
from sim.emulator.kv_events import offset_endpoint
from tests.engine_publishers import free_port_pair

ENGINE_BLOCK = 16
ROUTER_BLOCK = 64
PROMPT_TOKENS = 256  # 16 engine blocks, 4 router blocks


def prompt(i: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(1, 50_000) for _ in range(PROMPT_TOKENS)]


async def _engine(pub: int, replay: int, **cfg) -> TestServer:  # noqa: ANN003
    c = EmulatorConfig(speed=50.0, block_size=ENGINE_BLOCK, kv_events_endpoint=f"tcp://127.0.0.1:{pub}",
                       kv_events_replay_endpoint=f"tcp://127.0.0.1:{replay}", **cfg)
    server = TestServer(create_engine_app(c), host="127.0.0.1")
    await server.start_server()
    return server


async def _complete(s: aiohttp.ClientSession, server: TestServer, tokens: list[int]) -> None:
    r = await s.post(str(server.make_url("/v1/completions")), json={"prompt": tokens, "max_tokens": 2})
    assert r.status == 200, await r.text()
    await r.read()


def test_offset_endpoint_by_hand() -> None:
    assert offset_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert offset_endpoint("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"
    with pytest.raises(ValueError, match="expected tcp://HOST:PORT"):
        offset_endpoint("ipc:///tmp/x", 1)


async def test_pdlbs_subscriber_credits_each_engines_prompts_to_it() -> None:
    ports = {k: free_port_pair() for k in "ab"}
    rep = {k: ReplicaId(f"http://engine-{k}", 0) for k in "ab"}
    router = Router("cache_aware", "cache_aware", block_size=ROUTER_BLOCK, index_mode="events")
    for r in rep.values():
        router.add_replica(r, "mixed")
    lock = threading.Lock()

    def deliver(items) -> None:  # noqa: ANN001
        with lock:
            for replica, ev in items:
                router.on_kv_event(replica, ev, 0.0)

    def depths(tokens: list[int]) -> dict[str, int]:
        with lock:
            m = router.index.match(tuple(hash_token_blocks(tokens, ROUTER_BLOCK)))
        return {k: m.get(rep[k], 0) for k in "ab"}

    async def until(pred, timeout_s: float = 20.0) -> bool:  # noqa: ANN001
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if pred():
                return True
            await asyncio.sleep(0.05)
        return pred()

    engines = {k: await _engine(*ports[k]) for k in "ab"}
    sub = None
    try:
        async with aiohttp.ClientSession() as s:
            # before any subscriber: prompts 0, 1 on a and 2, 3 on b (published, buffered for replay)
            for i, k in ((0, "a"), (1, "a"), (2, "b"), (3, "b")):
                await _complete(s, engines[k], prompt(i))
            sources = [KvEventSource(rep[k], f"tcp://127.0.0.1:{ports[k][0]}", f"tcp://127.0.0.1:{ports[k][1]}")
                       for k in "ab"]
            sub = KvEventSubscriber(sources, ROUTER_BLOCK, deliver, replay_timeout_s=2.0)
            sub.start()
            want = {0: "a", 1: "a", 2: "b", 3: "b"}
            full = PROMPT_TOKENS // ROUTER_BLOCK  # 4 router blocks per prompt

            def right(ws: dict[int, str]) -> bool:
                return all(depths(prompt(i)) == {k: (full if k == ws[i] else 0) for k in "ab"} for i in ws)

            assert await until(lambda: right(want)), {i: depths(prompt(i)) for i in want}
            # live: prompt 4 on b, prompt 5 on a
            for i, k in ((4, "b"), (5, "a")):
                await _complete(s, engines[k], prompt(i))
                want[i] = k
            assert await until(lambda: right(want)), {i: depths(prompt(i)) for i in want}
            # a prompt nobody was given is credited to nobody
            assert depths(prompt(99)) == {"a": 0, "b": 0}
    finally:
        if sub is not None:
            sub.stop()
        for e in engines.values():
            await e.close()


def test_the_emulator_refuses_a_bad_events_endpoint(capsys) -> None:  # noqa: ANN001
    from pdlb_cli.main import main

    rc = main(["engine", "--port", "0", "--kv-events", "localhost:5557"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected tcp://HOST:PORT" in err


@pytest.mark.slow
async def test_vllms_own_decoder_reads_every_batch_live_and_replayed() -> None:
    # about 5 s (vLLM's wheel cached; a first run downloads it)
    import msgspec
    import zmq
    import zmq.asyncio

    from tests.engine_publishers import load_vllm

    kv = load_vllm().kv_events
    decoder = msgspec.msgpack.Decoder(type=kv.KVEventBatch)
    pub, replay = free_port_pair()
    # a cache of 40 engine blocks: the third 16-block prompt evicts the first one's blocks
    server = await _engine(pub, replay, kv_capacity_tokens=40 * ENGINE_BLOCK)
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{pub}")
    live: list[tuple[int, object]] = []
    try:
        await asyncio.sleep(0.5)  # PUB/SUB joins asynchronously
        async with aiohttp.ClientSession() as s:
            for i in range(3):
                await _complete(s, server, prompt(i))
        stored: dict[tuple[int, ...], object] = {}
        removed: set[int] = set()
        end = time.monotonic() + 20
        while time.monotonic() < end and (len(stored) < 3 or not removed):
            if not await sub.poll(500):
                continue
            topic, seq, payload = await sub.recv_multipart()
            batch = decoder.decode(payload)  # vLLM's own types: raises on anything it cannot read
            live.append((int.from_bytes(seq, "big"), payload))
            assert topic == b"" and batch.data_parallel_rank == 0
            for ev in batch.events:
                if isinstance(ev, kv.BlockStored):
                    stored[tuple(ev.token_ids)] = ev
                elif isinstance(ev, kv.BlockRemoved):
                    assert ev.medium == "GPU"
                    removed.update(ev.block_hashes)
        for i in range(3):
            ev = stored[tuple(prompt(i))]  # one event per prompt: its 16 full blocks, in order
            assert len(ev.block_hashes) == PROMPT_TOKENS // ENGINE_BLOCK and ev.parent_block_hash is None
            assert ev.block_size == ENGINE_BLOCK and ev.medium == "GPU" and ev.lora_id is None
        # evicted: blocks of prompt 0 (least recently used), never of prompt 2 (just stored)
        assert removed and removed <= set(stored[tuple(prompt(0))].block_hashes) | set(stored[tuple(prompt(1))].block_hashes)
        assert not removed & set(stored[tuple(prompt(2))].block_hashes)
        assert [q for q, _ in live] == list(range(len(live)))  # numbered 0, 1, ... per rank
        # replay from 1, with vLLM's request framing: the buffered batches from seq 1, then the end marker
        req = ctx.socket(zmq.DEALER)
        req.connect(f"tcp://127.0.0.1:{replay}")
        await req.send_multipart((b"", (1).to_bytes(8, "big")))
        got = []
        while True:
            assert await req.poll(5000)
            _, topic, seq, payload = await req.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            decoder.decode(payload)
            got.append((int.from_bytes(seq, "big"), payload))
        assert got == live[1:]
        req.close(0)
    finally:
        sub.close(0)
        ctx.term()
        await server.close()
