"""The HTTP server ``pdlb serve`` runs its aiohttp app on, built from aiohttp's documented parts.

aiohttp documents two ways to serve: an :class:`aiohttp.web.Application` on a
:class:`aiohttp.web.AppRunner`, or a low-level :class:`aiohttp.web.Server` (a protocol factory for
``loop.create_server``, taking one request handler) on a :class:`aiohttp.web.ServerRunner`
(aiohttp docs, "Low Level Server" and "Running Applications"). :class:`AppServerRunner` joins them:

* the app's own runner (:class:`~aiohttp.web.AppRunner`) starts the app (``on_startup``, cleanup
  contexts) and yields the app's request handler and request factory, read from its server after
  ``setup()``;
* a :class:`RouterServer` of pdlb's serves the connections, with a request handler pdlb chooses
  (``wrap(app_handler)``: the service's fast path in front of the app) and two things aiohttp's
  server lacks, each a method of the subclass: a cap on open connections
  (:meth:`RouterServer.limit_connections`, in :meth:`RouterServer.connection_made`) and the class
  of the per-connection protocol (:meth:`RouterServer.use_connection_class`, in the protocol
  factory :meth:`RouterServer.__call__`);
* a request aiohttp could not parse reaches the app's handler as HTTP/1.1, so that its error
  answer's status line says ``HTTP/1.1`` (aiohttp's placeholder message says HTTP/1.0);
* shutting down keeps :class:`~aiohttp.web.AppRunner`'s order: stop listening, close idle
  connections, the app's ``on_shutdown`` (the service drains), wait at most ``shutdown_timeout``
  for in-flight requests, then the app's ``on_cleanup``.

Nothing here assigns to an aiohttp object's attributes or class (``tests/test_no_library_patches.py``
keeps it so).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web, web_protocol
from aiohttp.http import HttpVersion11

__all__ = ["AppServerRunner", "RouterServer"]

log = logging.getLogger("pdlb.service")

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]

# aiohttp answers a request it could not parse (bad request line, header, chunked encoding) on a
# placeholder request message of its own, ``web_protocol.ERROR``, whose version is HTTP/1.0: that
# answer's status line would read ``HTTP/1.0 400``. The request factory gives the app handler the
# same message with HTTP/1.1 instead (read, never assigned: the placeholder itself is unchanged).
_PARSER_ERROR: Any = web_protocol.ERROR
_PARSER_ERROR_11: Any = _PARSER_ERROR._replace(version=HttpVersion11)


class RouterServer(web.Server):
    """aiohttp's low-level server (a protocol factory for ``loop.create_server`` and
    ``loop.connect_accepted_socket``) with a connection cap and a chosen connection class.

    ``handler``, ``request_factory``, ``handler_cancellation``: as :class:`aiohttp.web.Server`;
    ``handler_kwargs``: the per-connection protocol's keyword arguments (``keepalive_timeout``,
    ``access_log``, ``auto_decompress``, ...: :class:`aiohttp.web.RequestHandler`). Build it inside
    the event loop that will serve it."""

    def __init__(self, handler: Handler, *, request_factory: Callable[..., web.BaseRequest],
                 handler_cancellation: bool = False, **handler_kwargs: Any) -> None:
        super().__init__(handler, request_factory=request_factory, handler_cancellation=handler_cancellation,
                         **handler_kwargs)
        self._serving_loop = asyncio.get_running_loop()
        self._handler_kwargs = handler_kwargs
        self._connection_class: type[web.RequestHandler] = web.RequestHandler
        self._max_connections: int | None = None
        self._on_refused: Callable[[], None] | None = None
        self._warned_full = False
        self._lean: Callable[[RouterServer], asyncio.Protocol] | None = None
        self._placement: Any = None

    def follow_placement(self, view: Any) -> None:
        """Count client connections into ``view`` and give connections back when it says so
        (:class:`balancer.service.processes.placement.PlacementView`; ``None``: never)."""
        self._placement = view

    def give_back(self) -> bool:
        """Whether the keep-alive connection answered now should be closed after its answer, so
        that its client reconnects to the process the parent places it on (the lean front asks
        once per answer; :mod:`balancer.service.processes.placement`)."""
        p = self._placement
        return p is not None and p.give_back()

    def serve_lean(self, factory: Callable[[RouterServer], asyncio.Protocol] | None) -> None:
        """Serve connections accepted from now on with ``factory(self)`` (pdlb's lean front,
        :class:`balancer.service.lean_front.LeanProtocol`, which registers with this server as
        aiohttp's connections do and hands a connection over to :meth:`aiohttp_protocol` for what
        it does not serve); ``None``: aiohttp's protocol again."""
        self._lean = factory

    def limit_connections(self, max_connections: int, on_refused: Callable[[], None] | None = None) -> None:
        """Close client connections beyond ``max_connections`` open ones as they are accepted
        (logged once per burst at warning level; ``on_refused()`` is called for each one closed,
        e.g. to count it in a metric).

        Raises:
            ValueError: ``max_connections`` < 1."""
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self._max_connections = max_connections
        self._on_refused = on_refused

    def use_connection_class(self, cls: type[web.RequestHandler]) -> None:
        """Serve connections accepted from now on with ``cls``, a subclass of
        :class:`aiohttp.web.RequestHandler` (e.g. one that answers HTTP parser errors its own way).

        Raises:
            TypeError: ``cls`` is not a subclass of :class:`aiohttp.web.RequestHandler`."""
        if not (isinstance(cls, type) and issubclass(cls, web.RequestHandler)):
            raise TypeError(f"{cls!r} is not a subclass of aiohttp.web.RequestHandler")
        self._connection_class = cls

    def __call__(self) -> Any:
        """The protocol for one new connection (asyncio's protocol factory): the lean front's when
        :meth:`serve_lean` set one, else aiohttp's (:meth:`aiohttp_protocol`)."""
        if self._lean is not None:
            return self._lean(self)
        return self._connection_class(self, loop=self._serving_loop, **self._handler_kwargs)

    def aiohttp_protocol(self) -> web.RequestHandler:
        """A new aiohttp protocol for one connection (of the class :meth:`use_connection_class` set)."""
        return self._connection_class(self, loop=self._serving_loop, **self._handler_kwargs)

    def connection_made(self, handler: Any, transport: asyncio.Transport) -> None:
        """A connection's protocol reports itself: counted, or aborted when ``max_connections``
        are open already."""
        limit = self._max_connections
        if limit is not None and len(self.connections) >= limit:
            if not self._warned_full:
                log.warning("more than %d client connections: closing new ones (max_connections)", limit)
                self._warned_full = True
            transport.abort()
            if self._on_refused is not None:
                self._on_refused()
            return
        self._warned_full = False
        super().connection_made(handler, transport)
        if self._placement is not None:
            self._placement.connection_opened()

    def connection_lost(self, handler: Any, exc: BaseException | None = None) -> None:
        """A connection's protocol reports its end (uncounted if it was refused at the cap)."""
        if self._placement is not None and handler in self._connections:
            self._placement.connection_closed()
        super().connection_lost(handler, exc)


class _AppEntry:
    """The app's request handler and request factory, as the app's own runner's server has them
    after ``setup()`` (no connection is served before: a site needs a set-up runner)."""

    __slots__ = ("handler", "factory")

    def __init__(self) -> None:
        self.handler: Handler | None = None
        self.factory: Callable[..., web.BaseRequest] | None = None

    def bind(self, server: web.Server) -> None:
        self.handler, self.factory = server.request_handler, server.request_factory

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        return await self.handler(request)  # type: ignore[misc]

    def make_request(self, message: Any, *args: Any) -> web.BaseRequest:
        if message is _PARSER_ERROR:  # an unparsable request: answered as the HTTP/1.1 server this is
            message = _PARSER_ERROR_11
        return self.factory(message, *args)  # type: ignore[misc]


class AppServerRunner(web.ServerRunner):
    """Serve ``app`` on a :class:`RouterServer` whose request handler is ``wrap(app_handler)``
    (``app_handler`` answers any request as the app would). Use it as an
    :class:`aiohttp.web.AppRunner`: ``setup()``, a site (``web.TCPSite(runner, ...)``), ``cleanup()``;
    :attr:`server` is the :class:`RouterServer` once ``setup()`` has run.

    ``shutdown_timeout``: seconds to wait for in-flight requests on ``cleanup()``;
    ``handler_cancellation``: a client disconnect cancels its handler; ``handler_kwargs``: the
    per-connection protocol's keyword arguments (as :class:`aiohttp.web.AppRunner` takes them; the
    app's own ``handler_args`` are not read: give them here). Build it inside the event loop that
    will serve it."""

    __slots__ = ("_app_runner", "_entry", "_router_server")

    def __init__(self, app: web.Application, wrap: Callable[[Handler], Handler], *, shutdown_timeout: float = 60.0,
                 handler_cancellation: bool = False, **handler_kwargs: Any) -> None:
        self._app_runner = web.AppRunner(app)
        self._entry = _AppEntry()
        handler_kwargs.setdefault("debug", asyncio.get_running_loop().get_debug())  # as the app's server
        server = RouterServer(wrap(self._entry.handle), request_factory=self._entry.make_request,
                              handler_cancellation=handler_cancellation, **handler_kwargs)
        self._router_server = server
        super().__init__(server, shutdown_timeout=shutdown_timeout)

    @property
    def router_server(self) -> RouterServer:
        """The :class:`RouterServer` (also before ``setup()``, unlike :attr:`server`)."""
        return self._router_server

    @property
    def app(self) -> web.Application:
        """The application served."""
        return self._app_runner.app

    async def setup(self) -> None:
        """Start the app (its ``on_startup`` signals and cleanup contexts), then the server."""
        await self._app_runner.setup()
        app_server = self._app_runner.server
        assert app_server is not None  # AppRunner.setup() made it
        self._entry.bind(app_server)
        await super().setup()

    async def shutdown(self) -> None:
        """The app's ``on_shutdown`` signals (``cleanup()`` calls this after closing idle
        connections, before waiting for in-flight requests)."""
        await self.app.shutdown()

    async def cleanup(self) -> None:
        """Stop the sites, close connections (in-flight requests get ``shutdown_timeout``), then
        the app's ``on_cleanup`` signals and cleanup contexts."""
        await super().cleanup()
        await self.app.cleanup()
