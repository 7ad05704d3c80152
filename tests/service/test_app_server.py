"""``balancer.service.app_server``: the app served on aiohttp's documented parts behaves as on
aiohttp's own ``web.AppRunner`` (the independent implementation the tests compare with): the same
lifecycle order on shutdown, the same answers through the wrapped handler; and its two
additions refuse bad arguments."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from balancer.service.app import json_parser_errors, limit_connections
from balancer.service.app_server import AppServerRunner, RouterServer


def _app(events: list[str], release: asyncio.Event, started: asyncio.Event) -> web.Application:
    async def slow(request: web.Request) -> web.Response:
        events.append("request started")
        started.set()
        await release.wait()
        events.append("request finished")
        return web.Response(text="done")

    async def on_startup(app: web.Application) -> None:
        events.append("startup")

    async def on_shutdown(app: web.Application) -> None:
        events.append("shutdown")
        release.set()  # the service drains here: the in-flight request may finish now

    async def on_cleanup(app: web.Application) -> None:
        events.append("cleanup")

    app = web.Application()
    app.router.add_get("/slow", slow)
    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


async def _lifecycle(make_runner) -> tuple[list[str], int, str]:  # noqa: ANN001
    """Start a runner, send one slow request, clean the runner up while it is in flight: the
    lifecycle events in order, and the request's status and body."""
    events: list[str] = []
    release, started = asyncio.Event(), asyncio.Event()
    runner = make_runner(_app(events, release, started))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/slow"
    async with aiohttp.ClientSession() as s:
        async def get() -> tuple[int, str]:
            async with s.get(url) as r:
                return r.status, await r.text()

        task = asyncio.create_task(get())
        await asyncio.wait_for(started.wait(), 5)
        await runner.cleanup()
        status, body = await asyncio.wait_for(task, 5)
    return events, status, body


async def test_shutdown_keeps_the_app_runners_order() -> None:
    # aiohttp's AppRunner: startup, the request, then on cleanup: on_shutdown while the request is
    # in flight, the request finishes within shutdown_timeout, then on_cleanup
    expected = await _lifecycle(lambda app: web.AppRunner(app, shutdown_timeout=5))
    assert expected == (["startup", "request started", "shutdown", "request finished", "cleanup"], 200, "done")
    wrapped: list[str] = []

    def wrap(app_handler):  # noqa: ANN001, ANN202
        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            wrapped.append(request.path)
            return await app_handler(request)
        return handle

    got = await _lifecycle(lambda app: AppServerRunner(app, wrap, shutdown_timeout=5))
    assert got == expected
    assert wrapped == ["/slow"]  # the request went through the wrapper to the app's own handler


async def test_the_server_is_the_runners_and_its_additions_check_their_arguments() -> None:
    app = web.Application()
    runner = AppServerRunner(app, lambda h: h)
    assert runner.server is None and runner.app is app  # as AppRunner: no server before setup()
    await runner.setup()
    try:
        server = runner.server
        assert isinstance(server, RouterServer)
        with pytest.raises(ValueError, match="at least 1"):
            server.limit_connections(0)
        with pytest.raises(TypeError, match="RequestHandler"):
            server.use_connection_class(dict)  # type: ignore[arg-type]
        assert isinstance(server(), web.RequestHandler)  # the protocol factory
    finally:
        await runner.cleanup()
    # pdlb's helpers refuse a runner that does not serve with a RouterServer
    plain = web.AppRunner(web.Application())
    await plain.setup()
    try:
        with pytest.raises(TypeError, match="make_runner"):
            json_parser_errors(plain)
        with pytest.raises(TypeError, match="make_runner"):
            limit_connections(plain, 4)
    finally:
        await plain.cleanup()
