"""``pdlb serve`` fed by engines' KV events over ZMQ (index_mode events / hybrid) and by scraped
engine metrics: in-process router in front of emulated engines, each paired with a stand-in KV
event publisher (:class:`tests.kv_publisher.FakeEngine`) on its ``events=`` endpoint.
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from balancer.load import LoadReport
from balancer.service.app import SERVICE, create_app
from balancer.service.config import ServiceConfig, config_warnings, parse_worker_spec
from balancer.service.load_scraper import parse_load_metrics
from balancer.types import ReplicaId
from sim.emulator.app import STATE, create_engine_app
from sim.emulator.config import EmulatorConfig
from tests.kv_publisher import FakeEngine

BS = 16  # router block size; the stand-in engines use vLLM's 16 too (other sizes: test_kv_wire)


async def _cluster(n: int, mode: str, pubs: list[FakeEngine] | None, **router):  # noqa: ANN003, ANN202
    engines = []
    for _ in range(n):
        s = TestServer(create_engine_app(EmulatorConfig(role="mixed", speed=50.0)), host="127.0.0.1")
        await s.start_server()
        s.app[STATE].port = s.port
        engines.append(s)
    workers = []
    for i, s in enumerate(engines):
        w = {"url": f"http://127.0.0.1:{s.port}", "role": "mixed"}
        if pubs is not None:
            w |= {"events": pubs[i].endpoint, "replay": pubs[i].replay_endpoint}
        workers.append(w)
    cfg = ServiceConfig.model_validate({"pd_protocol": "none", "workers": workers, "port": 0, "block_size": BS,
                                        "index_mode": mode, "health_check": {"enabled": False},
                                        "prefill_policy": {"name": "cache_aware"},
                                        "decode_policy": {"name": "cache_aware"}, **router})
    r = TestServer(create_app(cfg), host="127.0.0.1")
    await r.start_server()
    return r, engines


def _served_by(engines, rid_prefix: str = "") -> list[int]:  # noqa: ANN001
    """Which engine (index) served each logged request, in log order per engine."""
    return [i for i, s in enumerate(engines) for e in s.app[STATE].log]


async def _wait(pred, timeout_s: float = 5.0) -> bool:  # noqa: ANN001
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        await asyncio.sleep(0.02)
    return False


@pytest.mark.parametrize("encoding,hash_kind", [("array", "int"), ("map", "bytes")])
async def test_engines_announce_prefixes_the_router_never_routed(encoding, hash_kind):
    """Each of 3 engines announces its own 256-token prefix over ZMQ; a request with engine k's
    prefix (plus its own suffix) goes to engine k. The router never routed any of them."""
    pubs = [FakeEngine(encoding, hash_kind, block_size=16) for _ in range(3)]
    router, engines = await _cluster(3, "events", pubs)
    try:
        await asyncio.sleep(0.4)  # SUB sockets join
        rng = random.Random(3)
        prefixes = [[rng.randrange(30_000) for _ in range(256)] for _ in range(3)]
        for pub, pre in zip(pubs, prefixes):
            pub.publish([pub.stored(pre)[1]])
        svc = router.app[SERVICE]
        assert await _wait(lambda: svc.router.index.num_blocks() == 3 * 256 // BS), svc.router.index.num_blocks()
        async with aiohttp.ClientSession() as s:
            for k in (2, 0, 1, 2):
                prompt = prefixes[k] + [rng.randrange(30_000) for _ in range(40)]
                r = await s.post(f"http://127.0.0.1:{router.port}/v1/completions", json={"prompt": prompt, "max_tokens": 2})
                assert r.status == 200
                await r.read()
                assert [len(e.app[STATE].log) for e in engines][k] >= 1
            counts = [len(e.app[STATE].log) for e in engines]
            assert counts == [1, 1, 2]
            # the subscriber runs in a child process: its counters arrive every 0.5 s
            assert await _wait(lambda: all(d.get("batches") == 1 for d in svc.kv_subscriber.stats().values())
                               and len(svc.kv_subscriber.stats()) == 3)
            text = await (await s.get(f"http://127.0.0.1:{router.port}/metrics")).text()
            assert 'pdlb_kv_events_batches_total{dp_rank="0",worker="http://127.0.0.1:%d"} 1.0' % engines[0].port in text
        m = svc.router.metrics()
        assert m["decisions"]["decode"].get("cache_hit") == 4 and m["kv_events"]["applied"] == 3
    finally:
        await router.close()
        for e in engines:
            await e.close()
        for p in pubs:
            p.close()


async def test_hybrid_mode_sends_a_burst_of_siblings_together_before_any_event():
    """hybrid: the first request of a burst is placed by load; its siblings follow it from the
    router's own speculative entry (no engine has announced anything yet). In events mode, with
    no event, the siblings spread by load instead (cache_aware's least-loaded fallback)."""
    rng = random.Random(5)
    shared = [rng.randrange(30_000) for _ in range(320)]
    placements = {}
    for mode in ("hybrid", "events"):
        pubs = [FakeEngine("map", "int") for _ in range(3)]
        router, engines = await _cluster(3, mode, pubs)
        try:
            async with aiohttp.ClientSession() as s:
                async def one(i: int) -> None:
                    prompt = shared + [rng.randrange(30_000) for _ in range(30)]
                    r = await s.post(f"http://127.0.0.1:{router.port}/v1/completions",
                                     json={"prompt": prompt, "max_tokens": 50})
                    assert r.status == 200
                    await r.read()
                await asyncio.gather(*(one(i) for i in range(6)))
            placements[mode] = sorted(len(e.app[STATE].log) for e in engines)
        finally:
            await router.close()
            for e in engines:
                await e.close()
            for p in pubs:
                p.close()
    assert placements["hybrid"] == [0, 0, 6]
    assert placements["events"] == [2, 2, 2]


def test_worker_spec_events_keys_and_config_warnings():
    w = parse_worker_spec("http://10.0.0.1:8000,dp=4,events=tcp://10.0.0.1:5557,replay=tcp://10.0.0.1:5657", "decode")
    assert w == {"url": "http://10.0.0.1:8000", "role": "decode", "dp_size": 4, "events": "tcp://10.0.0.1:5557",
                 "replay": "tcp://10.0.0.1:5657"}
    for bad, why in (("http://h:1,events=10.0.0.1:5557", "must be tcp://"), ("http://h:1,events=tcp://h", "port"),
                     ("http://h:1,replay=tcp://h:99999", "port")):
        with pytest.raises(ValueError, match=why):
            parse_worker_spec(bad, "mixed")
    with pytest.raises(ValueError, match="replay is set but events is not"):
        ServiceConfig.model_validate({"workers": [{"url": "http://h:1", "role": "mixed", "replay": "tcp://h:2"}],
                                      "pd_protocol": "none"})
    cfg = ServiceConfig.model_validate({"pd_protocol": "none", "router": {"index_mode": "events"}, "workers": [
        {"url": "http://h:1", "role": "mixed", "events": "tcp://h:5557"}, {"url": "http://h:2", "role": "mixed"}]})
    (warning,) = config_warnings(cfg)
    assert "no events endpoint for http://h:2" in warning
    cfg = ServiceConfig.model_validate({"pd_protocol": "none", "workers": [
        {"url": "http://h:1", "role": "mixed", "events": "tcp://h:5557"}]})
    assert "index_mode is approximate" in config_warnings(cfg)[0]
    with pytest.raises(ValueError):
        ServiceConfig.model_validate({"index_mode": "exact"})


# ---------------------------------------------------------------------- load reports
def test_parse_load_metrics_vllm_and_sglang_names():
    vllm = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="m"} 3\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 1\n'
            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0",model_name="m"} 7\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n')
    assert parse_load_metrics(vllm) == {0: LoadReport(3, 7, 0.25), 1: LoadReport(1, 0, None)}
    sglang = ('# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{dp_rank="2"} 5\n'
              '# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{dp_rank="2"} 1\n'
              '# TYPE sglang:token_usage gauge\nsglang:token_usage{dp_rank="2"} 0.5\n')
    assert parse_load_metrics(sglang) == {2: LoadReport(5, 1, 0.5)}
    assert parse_load_metrics("# nothing here\n") == {}


async def test_scraped_engine_load_steers_an_independent_router():
    """Another router's traffic keeps engine 0 busy; this router never routed there, but with
    load scraping it sees engine 0's queue (emulator metrics, vLLM names) and avoids it."""
    router, engines = await _cluster(2, "approximate", None, load_scrape={"enabled": True, "interval_s": 0.05},
                                     decode_policy={"name": "least_load"}, prefill_policy={"name": "least_load"})
    try:
        busy = f"http://127.0.0.1:{engines[0].port}"
        async with aiohttp.ClientSession() as s:
            async def other_router(i: int) -> None:  # straight to engine 0, slow requests
                r = await s.post(busy + "/v1/completions", json={"prompt": "x " * 50, "max_tokens": 400})
                await r.read()
            bg = [asyncio.create_task(other_router(i)) for i in range(4)]
            svc = router.app[SERVICE]
            rep0 = ReplicaId(busy, 0)
            slot = svc.router.load.slot(rep0)
            assert await _wait(lambda: svc.router.load.external_requests[slot] >= 3), svc.router.load.external_requests
            for _ in range(3):
                r = await s.post(f"http://127.0.0.1:{router.port}/v1/completions", json={"prompt": "y " * 50, "max_tokens": 1})
                await r.read()
            assert len(engines[1].app[STATE].log) == 3  # all of this router's requests avoided engine 0
            for t in bg:
                t.cancel()
            await asyncio.gather(*bg, return_exceptions=True)
    finally:
        await router.close()
        for e in engines:
            await e.close()


async def test_processes_share_their_approximate_prefix_views(tmp_path):
    """Two router processes' sides (two routers, one loop here): what A routes, B learns from A's
    ring, so B sends the same prompt to the replica A chose, with the whole prompt matched
    (10 blocks of 64 = 640 tokens); without the share B would see no match."""
    from balancer.router import Router
    from balancer.service.processes.shared_prefix import PrefixShare
    from balancer.types import Request
    from balancer.hashing import hash_token_blocks

    shares = [PrefixShare(str(tmp_path), 2, i) for i in range(2)]  # each a route listener of its router
    routers = []
    for seed, sh in enumerate(shares):
        r = Router("cache_aware", "cache_aware", block_size=64, seed=seed, listeners=[sh.publish])
        for i in range(4):
            r.add_replica(ReplicaId(f"e{i}", 0), "mixed")
        routers.append(r)
    a, b = routers
    recorded: list[list[tuple[int, ...]]] = [[], []]  # what each process's share recorded, in order

    def recorder(k: int, r: Router):  # noqa: ANN202
        def record(reps, hashes, now) -> None:  # noqa: ANN001
            recorded[k].append(tuple(hashes))
            r.record_routed(reps, hashes, now)
        return record

    try:
        for k, (sh, r) in enumerate(zip(shares, routers)):
            sh.start(recorder(k, r))
        toks = [random.Random(9).randrange(30_000) for _ in range(640)]
        hs = tuple(hash_token_blocks(toks, 64))
        first = a.route(Request("x", 0.0, 640, hs), 0.0)
        assert shares[0].sent == 1  # written at once
        assert await _wait(lambda: shares[1].received == 1)
        second = b.route(Request("y", 1.0, 640, hs), 1.0)
        assert second.decode == first.decode and second.decode_matched_tokens == 640
        assert await _wait(lambda: shares[0].received == 1)
        assert shares[0].sent == 1 and shares[1].sent == 1
        # decisions arrive in the order they were made, each once
        for i in range(5):
            b.route(Request(f"z{i}", 2.0, 64, (i,)), 2.0)
        assert await _wait(lambda: shares[0].received == 6)
        assert shares[1].sent == 6 and recorded[0] == [hs, (0,), (1,), (2,), (3,), (4,)]
        assert shares[0].lost_bytes == 0 and shares[1].lost_bytes == 0
    finally:
        for sh in shares:
            await sh.close()


def test_prefix_ring_wraps_and_a_lapped_reader_resumes(tmp_path):
    """A 200-byte ring: records written across its end read back whole (a one-block decision for
    engine "e0" is a 4-byte length, an 8-byte time and 9 bytes of msgpack: 9 fit before it wraps); a reader more
    than 200 bytes behind drops the lapped span (lost_bytes = the bytes it skipped) and reads what
    comes after; a record larger than the ring is not written."""
    import msgpack

    from balancer.service.processes.shared_prefix import PrefixShare

    seen: list[tuple[int, ...]] = []
    w = PrefixShare(str(tmp_path), 2, 0, ring_bytes=200)
    rd = PrefixShare(str(tmp_path), 2, 1, ring_bytes=200, record=lambda reps, hashes, now: seen.append(hashes))
    rep = [ReplicaId("e0", 0)]
    size = 4 + 8 + len(msgpack.packb([[["e0", 0]], (7,)]))
    assert size == 4 + 8 + 9  # fixarray headers 3 + "e0" 3 + 0 1 + fixarray 1 + 7 1
    for i in range(5):
        w.publish(rep, (i,), 1.0)
    assert rd.drain() == 5 and seen == [(i,) for i in range(5)]
    for i in range(5, 12):  # 12 records x size > 200: these cross the ring's end
        w.publish(rep, (i,), 1.0)
    assert rd.drain() == 7 and seen[5:] == [(i,) for i in range(5, 12)]
    for i in range(12, 30):  # 18 records: more than the ring holds before the reader looks
        w.publish(rep, (i,), 1.0)
    assert rd.drain() == 0 and rd.lost_bytes == 18 * size
    w.publish(rep, (99,), 1.0)
    assert rd.drain() == 1 and seen[-1] == (99,) and rd.received == 13
    w.publish(rep, tuple(range(1000, 1100)), 1.0)  # 100 x 3-byte ints: larger than the ring, not written
    assert w.dropped == 1 and w.sent == 31


async def test_lora_requests_follow_the_engine_holding_that_adapters_blocks():
    """Engine 0 holds a prefix computed with adapter "sql" (LoRA blocks), engine 1 the same
    tokens with the base model. A request for model "sql" goes to engine 0, a base-model request
    to engine 1: the adapter is part of the block identity on both sides."""
    pubs = [FakeEngine("map", "int", block_size=16) for _ in range(2)]
    router, engines = await _cluster(2, "events", pubs, lora_adapters=["sql"])
    try:
        await asyncio.sleep(0.4)
        rng = random.Random(11)
        prefix = [rng.randrange(30_000) for _ in range(128)]
        pubs[0].publish([pubs[0].stored(prefix, lora_name="sql")[1]])
        pubs[1].publish([pubs[1].stored(prefix)[1]])
        svc = router.app[SERVICE]
        assert await _wait(lambda: svc.router.index.num_blocks() == 2 * 128 // BS)
        async with aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            for model, want in (("sql", [1, 0]), ("base", [1, 1]), ("sql", [2, 1])):
                r = await s.post(url, json={"model": model, "prompt": prefix + [7, 8, 9], "max_tokens": 1})
                assert r.status == 200
                await r.read()
                assert [len(e.app[STATE].log) for e in engines] == want
    finally:
        await router.close()
        for e in engines:
            await e.close()
        for p in pubs:
            p.close()


async def test_workers_added_at_run_time_have_their_events_followed():
    """POST /workers with an events endpoint: the router subscribes (the first such worker starts
    the subscriber, the second is added to it) and routes to the engine that announced a prefix;
    DELETE unsubscribes."""
    pubs = [FakeEngine("map", "int", block_size=16) for _ in range(2)]
    router, engines = await _cluster(2, "events", None)
    svc = router.app[SERVICE]
    try:
        async with aiohttp.ClientSession() as s:
            base = f"http://127.0.0.1:{router.port}"
            for e in engines:  # replace the workers by the same engines with events
                assert (await s.delete(f"{base}/workers", params={"url": f"http://127.0.0.1:{e.port}"})).status == 200
            for e, p in zip(engines, pubs):
                r = await s.post(f"{base}/workers", json={"url": f"http://127.0.0.1:{e.port}", "role": "mixed",
                                                          "events": p.endpoint, "replay": p.replay_endpoint})
                assert r.status == 201
            rng = random.Random(4)
            prefix = [rng.randrange(30_000) for _ in range(128)]
            await asyncio.sleep(0.5)
            pubs[1].publish([pubs[1].stored(prefix)[1]])
            assert await _wait(lambda: svc.router.index.num_blocks() == 128 // BS, 10.0)
            r = await s.post(f"{base}/v1/completions", json={"prompt": prefix + [1, 2], "max_tokens": 1})
            assert r.status == 200
            await r.read()
            assert [len(e.app[STATE].log) for e in engines] == [0, 1]
            assert (await s.delete(f"{base}/workers", params={"url": f"http://127.0.0.1:{engines[1].port}"})).status == 200
            assert await _wait(lambda: len(svc.kv_subscriber.stats()) == 1, 5.0)
    finally:
        await router.close()
        for e in engines:
            await e.close()
        for p in pubs:
            p.close()


async def test_every_router_process_follows_the_events_and_reports_them():
    """``pdlb serve --processes 2 --index-mode events``: one subscriber (process 0's) decodes each
    engine batch once and fans the translated events out to both processes
    (:mod:`balancer.service.processes.kv_fanout`), so a prefix engine 1 announces draws requests from both
    processes there; ``/metrics`` shows the subscriber's counters once (``process="0"``: one batch,
    one event, no series of process 1) and each process's fan-out counters (one pdlb event applied
    in each). A worker with events added through the admin API is followed by both processes too."""
    from sim.emulator.testing import spawn_engines, spawn_router

    pubs = [FakeEngine("map", "int", block_size=16) for _ in range(3)]
    engines = spawn_engines([("mixed", "--zero-delay")] * 3)
    router = None
    try:
        specs = [f"{e.url},events={p.endpoint},replay={p.replay_endpoint}" for e, p in zip(engines[:2], pubs)]
        router = spawn_router("none", [], [], "--processes", "2", "--index-mode", "events", "--block-size", str(BS),
                              "--decode-policy", "cache_aware", "--mixed", *specs)
        rng = random.Random(5)
        conn = aiohttp.TCPConnector(force_close=True)  # fresh connections: both processes answer
        async with aiohttp.ClientSession(connector=conn) as s:
            async def served(prefix: list[int], k: int, n: int = 12) -> list[int]:
                before = [(await (await s.get(e.url + "/emulator/stats")).json())["ok"] for e in engines]
                for _ in range(n):
                    body = {"prompt": prefix + [rng.randrange(30_000) for _ in range(8)], "max_tokens": 1}
                    async with s.post(router.url + "/v1/completions", json=body) as r:
                        assert r.status == 200
                after = [(await (await s.get(e.url + "/emulator/stats")).json())["ok"] for e in engines]
                return [b - a for a, b in zip(before, after)]

            async def metric_lines() -> list[str]:
                text = await (await s.get(router.url + "/metrics")).text()
                return [ln for ln in text.splitlines() if ln.startswith(("pdlb_kv_events_batches_total{",
                                                                         "pdlb_kv_events_events_total{",
                                                                         "pdlb_kv_events_fanout_applied_total{"))]

            async def until(pred, timeout_s: float = 20.0):  # noqa: ANN001, ANN202
                end = time.monotonic() + timeout_s
                while time.monotonic() < end:
                    if (v := await pred()):
                        return v
                    await asyncio.sleep(0.2)
                return await pred()

            prefix = [rng.randrange(30_000) for _ in range(128)]
            await asyncio.sleep(1.0)  # the subscriber's SUB sockets join
            pubs[1].publish([pubs[1].stored(prefix)[1]])
            want = {f'pdlb_kv_events_batches_total{{dp_rank="0",process="0",worker="{engines[1].url}"}} 1.0',
                    f'pdlb_kv_events_events_total{{dp_rank="0",process="0",worker="{engines[1].url}"}} 1.0'}
            want |= {f'pdlb_kv_events_fanout_applied_total{{process="{i}"}} 1.0' for i in range(2)}
            lines = await until(lambda: _has(metric_lines, want))
            assert lines, await metric_lines()
            assert not [ln for ln in await metric_lines() if 'process="1",worker=' in ln]  # decoded once, in 0's
            assert await served(prefix, 1) == [0, 12, 0]  # 12 requests over both processes: all to engine 1
            # a worker with events added at run time: both processes subscribe to it
            r = await s.post(router.url + "/workers", json={"url": engines[2].url, "role": "mixed",
                                                             "events": pubs[2].endpoint, "replay": pubs[2].replay_endpoint})
            assert r.status == 201
            await asyncio.sleep(1.5)
            prefix2 = [rng.randrange(30_000) for _ in range(128)]
            pubs[2].publish([pubs[2].stored(prefix2)[1]])
            want2 = {f'pdlb_kv_events_batches_total{{dp_rank="0",process="0",worker="{engines[2].url}"}} 1.0'}
            # 1 + the added worker's clears (both media: it starts from an empty view) + its 1
            want2 |= {f'pdlb_kv_events_fanout_applied_total{{process="{i}"}} 4.0' for i in range(2)}
            assert await until(lambda: _has(metric_lines, want2)), await metric_lines()
            assert await served(prefix2, 2) == [0, 0, 12]
    finally:
        if router is not None:
            router.stop()
        for e in engines:
            e.stop()
        for p in pubs:
            p.close()


async def _has(lines_of, want: set[str]) -> bool:  # noqa: ANN001
    return want <= set(await lines_of())
