"""End-to-end: real ``pdlb serve`` and ``pdlb engine`` processes on 127.0.0.1.

Two clusters of router + 2 prefill + 2 decode engines (one per PD protocol) driven by the official
``openai`` client and raw HTTP, and a slower fault cluster (Llama-70B TP4 timing) for crashes,
503s, hangs, client disconnects and graceful shutdown. Every process is stopped in teardown.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import aiohttp
import openai
import pytest

from sim.emulator.testing import Proc, spawn_engines, spawn_router

FAST = ("--speed", "20")
SLOW = ("--model", "llama-3.1-70b", "--gpus-per-rank", "4", "--speed", "1")


def _stop_all(procs: list[Proc]) -> None:
    for p in procs:
        p.stop()


@pytest.fixture(scope="module", params=["sglang", "vllm"])
def cluster(request):
    engines = spawn_engines([("prefill", *FAST), ("prefill", *FAST), ("decode", *FAST), ("decode", *FAST)])
    procs = list(engines)
    try:
        router = spawn_router(request.param, engines[:2], engines[2:], "--served-model-name", "emu")
        procs.append(router)
        yield request.param, router, engines
    finally:
        _stop_all(procs)


@pytest.fixture(scope="module")
def fault_cluster():
    engines = spawn_engines([("prefill", *SLOW), ("prefill", *SLOW), ("decode", *SLOW), ("decode", *SLOW)])
    procs = list(engines)
    try:
        router = spawn_router("sglang", engines[:2], engines[2:], "--request-timeout-s", "3",
                              "--prefill-policy", "round_robin", "--decode-policy", "round_robin",
                              "--admin-api-key", "adm")
        procs.append(router)
        yield router, engines
    finally:
        _stop_all(procs)


async def _json(session: aiohttp.ClientSession, url: str):
    async with session.get(url) as r:
        return await r.json()


async def _metric(session: aiohttp.ClientSession, router: Proc, pattern: str) -> list[float]:
    async with session.get(router.url + "/metrics") as r:
        text = await r.text()
    return [float(m.group(1)) for m in re.finditer(pattern + r" ([0-9.e+-]+)", text)]


async def _set_faults(session: aiohttp.ClientSession, engine: Proc, **faults) -> None:
    async with session.post(engine.url + "/emulator/faults", json=faults) as r:
        assert r.status == 200


# ---------------------------------------------------------------------- both protocols
async def test_openai_client_streaming_and_not(cluster):
    protocol, router, _ = cluster
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=30)
    try:
        c = await client.completions.create(model="emu", prompt="The quick brown fox " * 40, max_tokens=7)
        assert c.choices[0].text == " t0 t1 t2 t3 t4 t5 t6" and c.usage.completion_tokens == 7
        stream = await client.chat.completions.create(
            model="emu", messages=[{"role": "user", "content": "hello " * 100}], max_tokens=5, stream=True)
        pieces = [ch.choices[0].delta.content or "" async for ch in stream if ch.choices]
        assert "".join(pieces) == " t0 t1 t2 t3 t4" and len([p for p in pieces if p]) == 5
        models = await client.models.list()
        assert [m.id for m in models.data] == ["emu"]
    finally:
        await client.close()


async def test_raw_http_bad_inputs_and_generate(cluster):
    protocol, router, _ = cluster
    async with aiohttp.ClientSession() as s:
        r = await s.post(router.url + "/v1/completions", data=b"{", headers={"Content-Type": "application/json"})
        assert r.status == 400 and (await r.json())["error"]["code"] == 400
        r = await s.post(router.url + "/v1/chat/completions", json={"model": "emu"})
        assert r.status == 400 and "messages" in (await r.json())["error"]["message"]
        r = await s.get(router.url + "/nowhere")
        assert r.status == 404 and (await r.json())["error"]["type"] == "invalid_request_error"
        r = await s.post(router.url + "/generate", json={"text": "abc " * 64, "sampling_params": {"max_new_tokens": 3}})
        if protocol == "sglang":
            assert r.status == 200 and (await r.json())["meta_info"]["completion_tokens"] == 3
        else:
            assert r.status == 404
        assert (await s.get(router.url + "/health")).status == 200


async def test_200_concurrent_requests_none_lost(cluster):
    protocol, router, engines = cluster
    n = 200

    async def one(s: aiohttp.ClientSession, i: int) -> int:
        stream = i % 2 == 0
        body = {"model": "emu", "prompt": f"shared system prompt {i % 7} " * 30 + f"question {i}",
                "max_tokens": 4 + i % 5, "stream": stream}
        async with s.post(router.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            if not stream:
                return (await r.json())["usage"]["completion_tokens"]
            text = await r.text()
            events = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]
            assert text.rstrip().endswith("data: [DONE]")
            return sum(1 for e in events if e["choices"][0]["text"])

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
        t0 = time.monotonic()
        tokens = await asyncio.gather(*(one(s, i) for i in range(n)))
        assert tokens == [4 + i % 5 for i in range(n)]
        assert time.monotonic() - t0 < 45
        # load back to zero on the router and on every engine
        assert await _metric(s, router, r"pdlb_in_flight_requests") == [0.0]
        loads = await _metric(s, router, r'pdlb_worker_in_flight_requests\{[^}]*\}')
        assert len(loads) == 4 and all(v == 0 for v in loads)
        assert sum(await _metric(s, router, r'pdlb_requests_total\{endpoint="/v1/completions",status="200"\}')) >= n
        decode_ok = 0
        for e in engines:
            st = await _json(s, e.url + "/emulator/stats")
            assert st["in_flight"] == 0 and st["num_running"] == 0 and st["num_waiting"] == 0
            if st["role"] == "decode":
                decode_ok += st["ok"]
        assert decode_ok >= n
        # both prefill engines got work (cache_aware balances when loaded)
        ok_prefill = [(await _json(s, e.url + "/emulator/stats"))["ok"] for e in engines[:2]]
        assert all(k > 0 for k in ok_prefill)


# ---------------------------------------------------------------------- faults
async def test_fault_503s_are_retried(fault_cluster):
    router, engines = fault_cluster
    async with aiohttp.ClientSession() as s:
        await _set_faults(s, engines[0], error_rate=1.0)
        try:
            rs = await asyncio.gather(*(s.post(router.url + "/v1/completions", json={"prompt": f"{i} " * 50, "max_tokens": 2})
                                        for i in range(6)))
            assert [r.status for r in rs] == [200] * 6
            st = await _json(s, engines[0].url + "/emulator/stats")
            assert st["injected_error"] >= 1
            assert sum(await _metric(s, router, r'pdlb_retries_total\{reason="http_503"\}')) >= 1
        finally:
            await _set_faults(s, engines[0])


async def test_fault_hanging_engine_times_out_and_is_aborted(fault_cluster):
    router, engines = fault_cluster
    async with aiohttp.ClientSession() as s:
        await _set_faults(s, engines[2], hang=True)  # a decode engine accepts and never answers
        before = (await _json(s, engines[2].url + "/emulator/stats"))["aborted"]
        try:
            t0 = time.monotonic()
            rs = await asyncio.gather(*(s.post(router.url + "/v1/completions", json={"prompt": f"h{i} " * 50, "max_tokens": 3})
                                        for i in range(2)))
            assert sorted(r.status for r in rs) == [200, 504]
            assert time.monotonic() - t0 < 6
            await asyncio.sleep(0.3)
            st = await _json(s, engines[2].url + "/emulator/stats")
            assert st["aborted"] == before + 1 and st["in_flight"] == 0
        finally:
            await _set_faults(s, engines[2])
        loads = await _metric(s, router, r'pdlb_worker_in_flight_requests\{[^}]*\}')
        assert all(v == 0 for v in loads)


async def test_client_disconnect_aborts_both_legs(fault_cluster):
    router, engines = fault_cluster
    async with aiohttp.ClientSession() as s:
        def ended(st: dict) -> int:  # legs that ended without success
            return st["aborted"] + st["error"]

        before = [ended(await _json(s, e.url + "/emulator/stats")) for e in engines]
        with pytest.raises(asyncio.TimeoutError):  # ~8k-token prompt: prefill takes ~1 s at this speed
            async with s.post(router.url + "/v1/completions", json={"prompt": "d" * 32000, "max_tokens": 8, "stream": True},
                              timeout=aiohttp.ClientTimeout(total=0.4)) as r:
                await r.read()
        for _ in range(30):
            stats = [await _json(s, e.url + "/emulator/stats") for e in engines]
            delta = [ended(st) - b for st, b in zip(stats, before)]
            if sum(delta) == 2 and all(st["in_flight"] == 0 and st["num_running"] == 0 for st in stats):
                break
            await asyncio.sleep(0.1)
        # the prefill leg is aborted; the decode leg is aborted too, or fails at once because its
        # prefill room was aborted (whichever the decode engine notices first); nothing is left running
        assert sum(delta[:2]) == 1 and sum(delta[2:]) == 1
        assert sum(st["aborted"] for st in stats[:2]) >= 1
        assert all(st["in_flight"] == 0 and st["num_running"] == 0 for st in stats)


async def test_admin_api_auth(fault_cluster):
    router, engines = fault_cluster
    async with aiohttp.ClientSession() as s:
        assert (await s.get(router.url + "/workers")).status == 401
        r = await s.get(router.url + "/workers", headers={"Authorization": "Bearer adm"})
        assert r.status == 200 and len((await r.json())["workers"]) == 4


async def test_engine_killed_mid_stream(fault_cluster):
    router, engines = fault_cluster
    async with aiohttp.ClientSession() as s:
        async with s.post(router.url + "/v1/completions", json={"prompt": "k " * 100, "max_tokens": 200, "stream": True}) as r:
            assert r.status == 200
            first = await r.content.readline()
            assert first.startswith(b"data: {")
            serving = []
            for e in engines[2:]:
                log = await _json(s, e.url + "/emulator/requests")
                if any(x["status"] == "running" for x in log):
                    serving.append(e)
            assert len(serving) == 1
            serving[0].kill()
            rest = (await r.read()).decode()
        # the error event, then [DONE] as SGLang's servers send after theirs (serving_chat.py 0.5.23)
        events = [ln[6:] for ln in rest.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and "mid-stream" in json.loads(events[-2])["error"]["message"]
        # the router keeps serving with the surviving decode engine
        rs = await asyncio.gather(*(s.post(router.url + "/v1/completions", json={"prompt": f"after {i}", "max_tokens": 2})
                                    for i in range(4)))
        assert [r.status for r in rs] == [200] * 4
        assert sum(await _metric(s, router, r'pdlb_upstream_failures_total\{kind="mid_stream"[^}]*\}')) == 1


async def test_graceful_shutdown_drains_in_flight(fault_cluster):
    _, engines = fault_cluster
    alive = [e for e in engines if e.alive()]
    router = spawn_router("sglang", [e for e in alive if e in engines[:2]], [e for e in alive if e in engines[2:]])
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(router.url + "/v1/completions", json={"prompt": "g " * 100, "max_tokens": 40, "stream": True}) as r:
                await r.content.readline()
                router.popen.send_signal(signal.SIGTERM)
                text = (await r.read()).decode()
            assert text.rstrip().endswith("data: [DONE]")
            assert router.popen.wait(10) == 0
    finally:
        router.stop()


# ---------------------------------------------------------------------- several router processes
async def _per_process(session: aiohttp.ClientSession, url: str, path: str, n_processes: int) -> dict[int, dict]:
    """``GET path`` on fresh connections until every router process answered once; by pid."""
    seen: dict[int, dict] = {}
    for _ in range(400):  # the kernel hashes each new connection to one SO_REUSEPORT listener
        async with session.get(url + path, headers={"Connection": "close"}) as r:
            assert r.status == 200
            body = await r.json()
        seen.setdefault(body["process"]["pid"], body)
        if len(seen) == n_processes:
            return seen
    raise AssertionError(f"only {len(seen)} of {n_processes} router processes answered")


async def test_two_router_processes_serve_all_and_return_to_zero():
    engines = spawn_engines([("prefill", *FAST), ("decode", *FAST), ("decode", *FAST), ("decode", *FAST)])
    spare = engines.pop()  # added at run time through the admin API
    procs = [*engines, spare]
    n = 200
    try:
        # connections to each process in turn (this light load would all go to one with follow_load)
        router = spawn_router("sglang", engines[:1], engines[1:], "--processes", "2", "--decode-policy", "round_robin",
                              "--connection-placement", "round_robin")
        procs.append(router)
        conn = aiohttp.TCPConnector(limit=0, force_close=True)  # a new connection per request: both processes get work
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
            async def one(i: int) -> int:
                body = {"model": "emu", "prompt": f"p{i % 5} " * 40, "max_tokens": 2 + i % 3, "stream": i % 2 == 1}
                async with s.post(router.url + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    if body["stream"]:
                        text = await r.text()
                        assert text.rstrip().endswith("data: [DONE]")
                        events = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]
                        return sum(1 for e in events if e["choices"][0]["text"])  # one token per text event
                    return (await r.json())["usage"]["completion_tokens"]

            tokens = await asyncio.gather(*(one(i) for i in range(n)))
            assert tokens == [2 + i % 3 for i in range(n)]  # every request answered in full, none lost
            health = await _per_process(s, router.url, "/health", 2)
            assert sorted(h["process"]["index"] for h in health.values()) == [0, 1]
            assert all(h["process"]["count"] == 2 and h["in_flight"] == 0 for h in health.values())
            # each process's own router state: load back to zero on every worker
            workers = await _per_process(s, router.url, "/workers", 2)
            for w in workers.values():
                assert len(w["workers"]) == 3 and all(x["in_flight"] == 0 for x in w["workers"])
            # /metrics sums the processes: exactly n completions, served by both processes' counters
            done = await _metric(s, router, r'pdlb_requests_total\{endpoint="/v1/completions",status="200"\}')
            assert done == [float(n)]
            assert await _metric(s, router, r"pdlb_in_flight_requests") == [0.0]
            # the decode engines saw all n requests (round robin in each process: both got some)
            ok = [(await _json(s, e.url + "/emulator/stats"))["ok"] for e in engines[1:]]
            assert sum(ok) == n and min(ok) > 0
            # an added worker reaches both processes before the 201: each lists it and routes to it
            r = await s.post(router.url + "/workers", json={"url": spare.url, "role": "decode"})
            assert r.status == 201 and (await r.json())["processes"] == 2
            r = await s.post(router.url + "/workers", json={"url": spare.url, "role": "decode"})
            assert r.status == 409 and (await r.json())["error"]["type"] == "conflict"
            workers = await _per_process(s, router.url, "/workers", 2)
            assert all(sorted(x["url"] for x in w["workers"]) == sorted(e.url for e in [*engines, spare])
                       for w in workers.values())
            # round robin over the 3 decode workers in each process: a process that gets k of the
            # 40 requests (fresh connections) sends floor(k/3) or ceil(k/3) of them to the spare,
            # so together at least floor(k/3) + floor((40-k)/3) >= 12
            for i in range(40):
                async with s.post(router.url + "/v1/completions", headers={"Connection": "close"},
                                  json={"model": "emu", "prompt": f"q{i} " * 20, "max_tokens": 1}) as r:
                    assert r.status == 200
            assert (await _json(s, spare.url + "/emulator/stats"))["ok"] >= 12
            assert await _metric(s, router, r'pdlb_worker_in_flight_requests\{dp_rank="0",role="decode",worker="%s"\}'
                                 % re.escape(spare.url)) == [0.0]
            # removal reaches both as well; the removed worker's gauges leave /metrics
            r = await s.delete(router.url + "/workers", params={"url": spare.url})
            assert r.status == 200 and (await r.json()) == {"removed": spare.url}
            r = await s.delete(router.url + "/workers", params={"url": spare.url})
            assert r.status == 404
            workers = await _per_process(s, router.url, "/workers", 2)
            assert all(spare.url not in [x["url"] for x in w["workers"]] for w in workers.values())
            before = (await _json(s, spare.url + "/emulator/stats"))["ok"]
            for i in range(10):
                async with s.post(router.url + "/v1/completions", headers={"Connection": "close"},
                                  json={"model": "emu", "prompt": "z " * 20, "max_tokens": 1}) as r:
                    assert r.status == 200
            assert (await _json(s, spare.url + "/emulator/stats"))["ok"] == before
            for pattern in (r'pdlb_worker_in_flight_requests\{[^}]*worker="%s"\}', r'pdlb_worker_healthy\{worker="%s"\}'):
                assert await _metric(s, router, pattern % re.escape(spare.url)) == []
        assert router.stop() == 0  # SIGTERM: both processes drain and exit, then the parent
    finally:
        _stop_all(procs)


async def test_two_router_processes_share_their_prefix_views():
    """Approximate mode, 2 router processes, 4 mixed engines: one request with a 1,000-character
    prompt (250 tokens at 4 characters per token: 3 full 64-token blocks) is routed by one
    process; 40 more with that prompt, each on a fresh connection (the kernel spreads them over
    both processes: all on one would be a 2^-39 chance), all find its blocks in their process's
    index, so /metrics, summed over the processes, shows exactly one decision with no prefix match
    (match ratio 0: the first) and 40 with 192 / 250 = 0.768 (bucket le=0.8, not le=0.7)."""
    engines = spawn_engines([("mixed", *FAST)] * 4)
    procs = list(engines)
    try:
        router = spawn_router("none", [], [], "--processes", "2", "--decode-policy", "cache_aware", mixed=engines)
        procs.append(router)
        body = {"model": "emu", "prompt": "".join(f"{i:04d} shared prefix line. "[:20] for i in range(50)), "max_tokens": 1}
        assert len(body["prompt"]) == 1000
        async with aiohttp.ClientSession() as s:
            async def one() -> None:
                async with s.post(router.url + "/v1/completions", json=body, headers={"Connection": "close"}) as r:
                    assert r.status == 200
                    await r.read()
            await one()
            await asyncio.sleep(0.2)  # the other process reads the first decision within 20 ms
            for _ in range(40):
                await one()
            zero = await _metric(s, router, r'pdlb_prefix_match_ratio_bucket\{le="0.0",pool="decode"\}')
            le07 = await _metric(s, router, r'pdlb_prefix_match_ratio_bucket\{le="0.7",pool="decode"\}')
            le08 = await _metric(s, router, r'pdlb_prefix_match_ratio_bucket\{le="0.8",pool="decode"\}')
            assert (zero, le07, le08) == ([1.0], [1.0], [41.0])
    finally:
        _stop_all(procs)
