"""The generation endpoints' fast path (``balancer.service.app._fast_path``): ``pdlb serve``'s
runner sends generation POSTs straight to their handler, bypassing the app's route resolution and
middleware chain. Every answer and every metric must be what the app itself gives: each case is sent
to the same router config served both ways (the app under aiohttp's TestServer, i.e. the slow path;
the runner of ``make_runner``, the fast path) and the answers compared (an independent
implementation of the same behaviour: the app's own routing)."""

from __future__ import annotations

import json
import re

import aiohttp
from aiohttp.test_utils import TestServer

from balancer.service.app import SERVICE, create_app, json_parser_errors, make_runner
from balancer.service.config import ServiceConfig
from sim.emulator.testing import inprocess_cluster

BODY = {"model": "emu", "prompt": "hello " * 40, "max_tokens": 4}


def _requests_total(text: str) -> dict[tuple[str, str], float]:
    out = {}
    for m in re.finditer(r'^pdlb_requests_total\{endpoint="([^"]*)",status="(\d+)"\} (\S+)$', text, re.M):
        out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


async def _cases(s: aiohttp.ClientSession, url: str) -> list:
    """(status, content type, JSON body less request-specific fields) of each case."""
    out = []

    def keep(status, ctype, body):  # noqa: ANN001, ANN202
        if isinstance(body, dict):
            body = {k: v for k, v in body.items() if k not in ("id", "created", "choices", "usage", "process")}
            if isinstance(body.get("meta_info"), dict):
                body["meta_info"] = {k: v for k, v in body["meta_info"].items() if k != "id"}
        out.append((status, ctype, body))

    async def send(method, path, **kw):  # noqa: ANN001, ANN003, ANN202
        async with s.request(method, url + path, **kw) as r:
            raw = await r.read()
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode(errors="replace")
            keep(r.status, r.content_type, body)
            return r

    r = await send("POST", "/v1/completions", json=BODY)
    assert r.headers["X-Request-Id"].startswith("pdlb-")
    await send("POST", "/v1/completions", json={**BODY, "rid": "client-1"})
    await send("POST", "/v1/chat/completions", json={"model": "emu", "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 3})
    await send("POST", "/generate", json={"text": "hi there", "sampling_params": {"max_new_tokens": 2}})
    await send("POST", "/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"})
    await send("POST", "/v1/completions", data=b"[1, 2]", headers={"Content-Type": "application/json"})
    await send("POST", "/v1/completions", json={"model": "emu", "max_tokens": 4})  # no prompt: 400
    await send("POST", "/v1/completions", data=b"x" * 5000, headers={"Content-Type": "application/json"})  # 413
    await send("GET", "/v1/completions")  # 405 (app path)
    await send("POST", "/v1/completions/", json=BODY)  # 404 (app path)
    await send("POST", "/v1/completions", json=BODY, headers={"Expect": "100-continue"})  # app path
    await send("GET", "/health")
    stream = []
    async with s.post(url + "/v1/completions", json={**BODY, "stream": True}) as r:
        async for chunk in r.content.iter_any():
            stream.append(chunk)
        out.append((r.status, r.content_type, b"".join(stream).count(b"data: ")))
    return out


async def test_fast_path_answers_and_counts_as_the_app_does():
    async with inprocess_cluster("none", num_decode=2) as cluster:
        workers = [{"url": f"http://127.0.0.1:{e.port}", "role": "mixed"} for e in cluster.decode]
        cfg = ServiceConfig.model_validate({"pd_protocol": "none", "workers": workers, "port": 0,
                                            "max_body_bytes": 4096, "health_check": {"enabled": False}})
        slow = TestServer(create_app(cfg), host="127.0.0.1")
        await slow.start_server()
        runner = make_runner(create_app(cfg), cfg)
        await runner.setup()
        json_parser_errors(runner)
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        fast_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            assert runner.server.request_handler is not runner.app._handle  # the fast path is installed
            async with aiohttp.ClientSession() as s:
                slow_url = f"http://127.0.0.1:{slow.port}"
                got_slow = await _cases(s, slow_url)
                got_fast = await _cases(s, fast_url)
                assert got_fast == got_slow
                statuses = [c[0] for c in got_fast]
                assert statuses == [200, 200, 200, 200, 400, 400, 400, 413, 405, 404, 200, 200, 200], statuses
                assert all(c[1] == "application/json" for c in got_fast[:-1]), got_fast
                assert got_fast[-1][2] >= 2  # streamed: token events and [DONE]
                m_slow = _requests_total(await (await s.get(slow_url + "/metrics")).text())
                m_fast = _requests_total(await (await s.get(fast_url + "/metrics")).text())
                assert m_fast == m_slow
                # by hand: 4 completions answered 200 (plain, client rid, Expect, stream), one of each other
                assert m_fast[("/v1/completions", "200")] == 4.0
                assert m_fast[("/v1/completions", "400")] == 3.0 and m_fast[("/v1/completions", "413")] == 1.0
                assert m_fast[("/v1/chat/completions", "200")] == 1.0 and m_fast[("/generate", "200")] == 1.0
                assert runner.app[SERVICE].in_flight == 0
        finally:
            await runner.cleanup()
            await slow.close()
