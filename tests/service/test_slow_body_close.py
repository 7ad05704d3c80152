"""A 408 for a body that does not arrive closes the connection at once with ``Connection: close``
(RFC 9110 §15.5.9; issue 25 review finding F3: it was sent without, and aiohttp's lingering read
held the socket 10 s more)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from balancer.service.config import ServiceConfig


async def test_408_says_connection_close_and_closes_at_once():
    from balancer.service.app import create_app, json_parser_errors, limit_connections, make_runner

    cfg = ServiceConfig.model_validate({"pd_protocol": "none", "port": 0, "client_idle_timeout_s": 5,
                                        "body_read_timeout_s": 0.5, "health_check": {"enabled": False}})
    runner = make_runner(create_app(cfg), cfg)
    await runner.setup()
    limit_connections(runner, cfg.max_connections)
    json_parser_errors(runner)
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{\"prompt\"")  # 9 of 100 bytes, then nothing
        await w.drain()
        t0 = time.monotonic()
        raw = await asyncio.wait_for(r.read(), 5.0)  # to EOF: the server closed (was at 0.5 + 10 s)
        took = time.monotonic() - t0
        w.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), raw
        assert b"\r\nConnection: close" in head, raw
        assert b"\r\nX-Request-Id: pdlb-" in head, raw  # the middleware's headers are still added
        assert json.loads(body)["error"]["code"] == 408
        # body_read_timeout_s is 0.5 s; 3 s leaves room for a loaded host and is far below 10.5 s
        assert 0.4 < took < 3.0, took
    finally:
        await runner.cleanup()
