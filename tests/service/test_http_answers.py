"""What the HTTP layer of ``pdlb serve`` answers on its own (review findings F4, F6 and the log
limiter's order dependence, issue 25 follow-up):

* malformed HTTP requests and connections closed at ``max_connections`` are counted on
  ``/metrics`` (``pdlb_http_parse_errors_total{status}``, ``pdlb_client_connections_rejected_total``);
* a malformed request's answer: ``HTTP/1.1`` status line, ``X-Request-Id: pdlb-<24 hex digits>``
  (docs/serving.md, "Request ids"), ``Connection: close``;
* no answer names the Python or aiohttp version in ``Server`` (aiohttp's default
  ``Python/3.x aiohttp/3.y``): parser errors, routed answers (fast path, streamed and not), the
  app's own routes, 404s;
* each app has its own limiter of client-triggered log lines (the module-level one carried a
  previous app's 10 s window into the next: a test order dependence).

Expected values: counts of the requests each test sends (hand count); the id format from
docs/serving.md; the status-line version and ``Connection: close`` from RFC 9112 §2.3/§9.6.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from balancer.service.app import SERVICE, create_app, json_parser_errors, limit_connections, make_runner
from balancer.service.config import ServiceConfig
from sim.emulator.app import STATE, create_engine_app
from sim.emulator.config import EmulatorConfig

MALFORMED = (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
             b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}")


@asynccontextmanager
async def served(cfg: dict, engine: bool = False):
    """``pdlb serve``'s runner for ``cfg`` (connection cap, JSON parser errors) on 127.0.0.1, with
    one emulated mixed engine if ``engine``; yields (port, service)."""
    eng = None
    workers = []
    if engine:
        eng = TestServer(create_engine_app(EmulatorConfig(role="mixed", speed=50.0)), host="127.0.0.1")
        await eng.start_server()
        eng.app[STATE].port = eng.port
        workers = [{"url": f"http://127.0.0.1:{eng.port}", "role": "mixed"}]
    config = ServiceConfig.model_validate({"pd_protocol": "none", "port": 0, "workers": workers,
                                           "health_check": {"enabled": False}, **cfg})
    runner = make_runner(create_app(config), config)
    await runner.setup()
    limit_connections(runner, config.max_connections)
    json_parser_errors(runner)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1], runner.app[SERVICE]
    finally:
        await runner.cleanup()
        if eng is not None:
            await eng.close()


async def _raw(port: int, data: bytes) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(data)
    await w.drain()
    out = await asyncio.wait_for(r.read(), 5)
    w.close()
    return out


def _metric(svc, line_start: str) -> float | None:
    text = svc.metrics.render(svc.router, svc.pool).decode()
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    return None


async def test_malformed_requests_are_counted_and_answered_as_http_1_1_with_a_full_request_id():
    async with served({}) as (port, svc):
        ids = set()
        for bad in MALFORMED:
            raw = await _raw(port, bad)
            head, _, body = raw.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            assert lines[0].startswith("HTTP/1.1 400 "), lines[0]  # was HTTP/1.0
            headers = dict(ln.split(": ", 1) for ln in lines[1:])
            assert re.fullmatch(r"pdlb-[0-9a-f]{24}", headers["X-Request-Id"]), headers  # was 12 hex digits
            ids.add(headers["X-Request-Id"])
            assert headers["Connection"] == "close" and headers["Server"] == "pdlb", headers
            assert json.loads(body)["error"]["code"] == 400
        assert len(ids) == len(MALFORMED)
        # three malformed requests sent, three counted (was: no series)
        assert _metric(svc, 'pdlb_http_parse_errors_total{status="400"}') == len(MALFORMED)
        assert _metric(svc, 'pdlb_client_connections_rejected_total{reason="max_connections"}') is None


async def test_connections_closed_at_max_connections_are_counted():
    async with served({"max_connections": 2}) as (port, svc):
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
        await asyncio.sleep(0.2)
        closed = 0
        for r, w in conns:
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                data = await asyncio.wait_for(r.read(12), 3.0)
            except ConnectionError:
                data = b""
            closed += data == b""
            w.close()
        assert closed == 3
        # five connections, a cap of two: three closed at accept, three counted (was: no series)
        assert _metric(svc, 'pdlb_client_connections_rejected_total{reason="max_connections"}') == 3
        assert _metric(svc, 'pdlb_http_parse_errors_total{status="400"}') is None


async def test_no_answer_names_the_python_or_aiohttp_version():
    async with served({}, engine=True) as (port, _), aiohttp.ClientSession() as s:
        url = f"http://127.0.0.1:{port}"
        answers = []
        for stream in (False, True):  # the generation fast path: a relayed answer and a relayed stream
            async with s.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": stream}) as r:
                await r.read()
                answers.append((r.status, r.headers.getall("Server")))
        for method, path in (("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/nowhere"),
                             ("DELETE", "/v1/completions")):
            async with s.request(method, url + path) as r:
                await r.read()
                answers.append((r.status, r.headers.getall("Server")))
        async with s.post(url + "/v1/completions", data=b"{not json") as r:  # pdlb's own 400, fast path
            answers.append((r.status, r.headers.getall("Server")))
        assert [a[0] for a in answers] == [200, 200, 200, 200, 200, 404, 405, 400]
        async with s.request("DELETE", url + "/v1/completions") as r:  # RFC 9110 §15.5.6: a 405 says Allow (review R8)
            assert r.status == 405 and r.headers.get("Allow") == "POST", dict(r.headers)
        assert all(a[1] == ["pdlb"] for a in answers), answers  # was Python/3.x aiohttp/3.y
        raw = await _raw(port, MALFORMED[0])
        assert b"\r\nServer: pdlb\r\n" in raw and b"aiohttp" not in raw


async def test_each_app_limits_its_own_client_error_log_lines(caplog):
    # two apps one after the other, within 10 s: each logs its first malformed request (the limiter
    # was one per module, so the second app's line was left out: the test order dependence)
    caplog.set_level(logging.INFO, "pdlb.service")
    for _ in range(2):
        async with served({}) as (port, _):
            for _ in range(3):
                assert (await _raw(port, MALFORMED[2])).split(b" ", 2)[1] == b"400"
    lines = [r.getMessage() for r in caplog.records if "malformed HTTP request" in r.getMessage()]
    assert len(lines) == 2, lines
