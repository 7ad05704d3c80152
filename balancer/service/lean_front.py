"""A lean HTTP/1.1 front for the generation endpoints (``http_front: lean``; issue 26).

aiohttp's server costs ~57 µs per request over a bare ``httptools`` protocol on the development
host (docs/serving.md, "What the service path's own code still gives"). :class:`LeanProtocol`
serves the common generation request itself, on ``httptools``' parser (llhttp, the parser Node.js
uses; already pdlb's dependency for the upstream client), and hands the connection to aiohttp's
protocol (:meth:`RouterServer.aiohttp_protocol`) for anything else, with every byte received since
the current request began. So aiohttp keeps answering (and the tests keep proving) every case the
lean path does not take, with its own limits and errors.

A request is served here when all of these hold, else the connection is handed over for good:

* its head (request line and headers) ends within :data:`MAX_HEAD_BYTES` (aiohttp's header line
  limit: no head aiohttp refuses for length is served here), has at most :data:`MAX_HEADERS`
  headers, and ``httptools`` parses it (a malformed request gets aiohttp's JSON 400 and metric);
* ``POST`` on a path of ``routes`` exactly (no query string), ``HTTP/1.1``, one ``Host`` header and
  no other of :data:`_SINGLETONS` given twice;
* a ``Content-Length`` under ``max_body_bytes`` (below the body-offload threshold, so large
  bodies keep aiohttp's path), no ``Transfer-Encoding``, ``Expect``, ``Content-Encoding`` or
  ``Upgrade``.

What this protocol keeps itself (each proven by ``tests/service/test_lean_front.py`` and by the
service tests run on this front): the connection cap and graceful shutdown (it registers with
the :class:`~balancer.service.app_server.RouterServer` as aiohttp's connections do:
``close()``, ``shutdown(timeout)``); the idle timeout (``idle_timeout_s`` from the connection's
start or its last answer until a whole head arrives: slowloris); the body timeout (a 408 JSON
error and close after ``body_timeout_s`` without the whole body); keep-alive and
``Connection: close``; pipelining (one request at a time, in order; reading pauses while more than
:data:`MAX_PIPELINED_BYTES` wait); handler cancellation when the client disconnects; write
backpressure (a streamed answer waits while the transport's buffer is over its high-water mark).

Answers: a :class:`aiohttp.web.Response` the handler returns is serialized as aiohttp would
(status line, its headers, ``Content-Length``, ``Date``, ``Connection: close`` when the
connection closes after it); a streamed answer is a :class:`LeanStream` (chunked transfer
encoding), which the proxy opens through :meth:`LeanRequest.open_stream`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

import httptools
from aiohttp import web
from aiohttp.http import HttpVersion11
from multidict import CIMultiDict, CIMultiDictProxy

from balancer.service.log_limit import RateLimitedLog

__all__ = ["LeanProtocol", "LeanRequest", "LeanStream", "MAX_HEAD_BYTES", "MAX_HEADERS", "MAX_PIPELINED_BYTES"]

log = logging.getLogger("pdlb.service")
#: errors here are bugs, but a client could repeat one at will: one line per kind per 10 s
_errors_log = RateLimitedLog(log, interval_s=10.0)

MAX_HEAD_BYTES = 8190
"""Longest request head (request line + headers, bytes) served here: aiohttp's ``max_line_size``
and ``max_field_size`` (8190). A longer head goes to aiohttp, which applies its own limits."""
MAX_HEADERS = 100
"""Most header lines served here (aiohttp refuses more than its ``max_headers``, 128)."""
MAX_PIPELINED_BYTES = 256 * 1024
"""Bytes of pipelined requests buffered while one is served; reading pauses beyond."""
_SINGLETONS = frozenset({b"host", b"content-type", b"content-location", b"content-range", b"etag", b"max-forwards",
                         b"server", b"user-agent"})
"""Header fields a request may carry once (RFC 9110 §5.5; aiohttp 3.14's ``SINGLETON_HEADERS`` less
``Content-Length`` and ``Transfer-Encoding``, checked on their own): one given twice, or no ``Host``
(RFC 9112 §3.2), sends the request to aiohttp, which answers 400 (since 3.13.4) as it decides."""

Handler = Callable[["LeanRequest", str], Awaitable[Any]]

_IDLE, _BODY, _BUSY, _GONE = 0, 1, 2, 3  # waiting for a head, for a body, serving, handed over / closed

_date_cache: list[Any] = [0, b""]


def _date_header() -> bytes:
    """``Date: <IMF-fixdate>\\r\\n`` (RFC 9110 §6.6.1), made once per second."""
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache[0] = now
        _date_cache[1] = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
    return _date_cache[1]


def _reason(status: int) -> str:
    """The reason phrase aiohttp writes for ``status`` (``http.HTTPStatus``'s; empty if unknown)."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


_SKIPPED = frozenset(("content-length", "transfer-encoding", "connection", "date"))


def _head_bytes(status: int, reason: str, headers: Any, tail: str) -> bytes:
    """The status line and header block, ``tail`` (the framing headers) last.

    Raises:
        ValueError: a header name or value, or the reason, holds a CR or LF (as aiohttp refuses)."""
    lines = [f"{k}: {v}\r\n" for k, v in headers.items() if k.lower() not in _SKIPPED]
    text = "".join(lines)
    # each line has one CR and one LF, its end: any other is in a name or value (header injection)
    if text.count("\r") != len(lines) or text.count("\n") != len(lines) or "\r" in reason or "\n" in reason:
        raise ValueError("newline or carriage return in an HTTP header or reason")
    return f"HTTP/1.1 {status} {reason}\r\n{text}{tail}".encode("utf-8")


def response_bytes(resp: web.Response, keep_alive: bool) -> bytes:
    """``resp`` (a :class:`aiohttp.web.Response` with a bytes body or none) as HTTP/1.1 bytes.

    Raises:
        TypeError: the body is not bytes (a payload object: not produced on the generation path).
        ValueError: a header holds CR or LF."""
    body = resp.body
    if body is None:
        body = b""
    elif type(body) is not bytes:
        if isinstance(body, (bytearray, memoryview)):
            body = bytes(body)
        else:
            raise TypeError(f"the lean front writes bytes bodies only, got {type(body).__name__}")
    status = resp.status
    no_body = status < 200 or status in (204, 304)
    tail = ("" if no_body else f"Content-Length: {len(body)}\r\n") + ("" if keep_alive else "Connection: close\r\n")
    head = _head_bytes(status, resp.reason or "", resp.headers, tail)
    return head + _date_header() + b"\r\n" + (b"" if no_body else body)


class LeanStream:
    """A streamed answer on a lean connection (chunked transfer encoding): the part of
    :class:`aiohttp.web.StreamResponse` the proxy uses (``status``, ``headers``, ``prepared``,
    ``write``, ``write_eof``). Its head is written when it is made."""

    __slots__ = ("status", "headers", "_protocol", "_eof")

    prepared = True

    def __init__(self, protocol: LeanProtocol, status: int, headers: Any, keep_alive: bool) -> None:
        self.status = status
        self.headers = CIMultiDict(headers)
        self._protocol = protocol
        self._eof = False
        reason = _reason(status)
        tail = "Transfer-Encoding: chunked\r\n" + ("" if keep_alive else "Connection: close\r\n")
        protocol.write(_head_bytes(status, reason, self.headers, tail) + _date_header() + b"\r\n")

    @property
    def keep_alive(self) -> bool:
        return self._protocol.keep_alive

    async def write(self, data: bytes) -> None:
        """Send ``data`` as one chunk (nothing for empty data); waits while the client is slow.

        Raises:
            ConnectionResetError: the client is gone.
            RuntimeError: after :meth:`write_eof`."""
        if self._eof:
            raise RuntimeError("write after write_eof")
        if not data:
            return
        p = self._protocol
        p.write(b"%x\r\n%b\r\n" % (len(data), data))
        if p.paused_writing:
            await p.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        """End the stream (``data`` first, if any)."""
        if self._eof:
            return
        if data:
            await self.write(data)
        self._eof = True
        self._protocol.write(b"0\r\n\r\n")

    @property
    def finished(self) -> bool:
        return self._eof


class LeanRequest:
    """A generation request as the service reads it (the members of :class:`aiohttp.web.Request`
    the fast path, the proxy and the admission gate use): ``method``, ``path``, ``headers`` (a
    case-insensitive multidict proxy), ``version``, ``content_length``, ``content`` (itself:
    ``is_eof()`` is always true, ``read_nowait()`` the whole body), ``read()``, ``protocol`` (with
    ``force_close()``), and item access for per-request keys (``STREAM_STATUS``)."""

    __slots__ = ("method", "path", "headers", "content_length", "_body", "_protocol", "_items", "__weakref__")

    version = HttpVersion11

    def __init__(self, path: str, headers: CIMultiDictProxy, body: bytes, protocol: LeanProtocol) -> None:
        self.method = "POST"
        self.path = path
        self.headers = headers
        self.content_length = len(body)
        self._body = body
        self._protocol = protocol
        self._items: dict[Any, Any] | None = None

    @property
    def content(self) -> LeanRequest:
        return self

    @property
    def protocol(self) -> LeanProtocol:
        return self._protocol

    def is_eof(self) -> bool:
        return True

    def read_nowait(self, n: int = -1) -> bytes:
        return self._body

    async def read(self) -> bytes:
        return self._body

    def __setitem__(self, key: Any, value: Any) -> None:
        if self._items is None:
            self._items = {}
        self._items[key] = value

    def __getitem__(self, key: Any) -> Any:
        if self._items is None:
            raise KeyError(key)
        return self._items[key]

    def get(self, key: Any, default: Any = None) -> Any:
        return default if self._items is None else self._items.get(key, default)

    def open_stream(self, status: int, headers: Any) -> LeanStream:
        """Start a streamed answer: its head is written now."""
        return self._protocol.open_stream(status, headers)


class _NoCallbacks:
    pass


def _may_start_a_request(partial: bytes) -> bool:
    """Whether the start of a head (no blank line yet) parses so far: a malformed one is handed to
    aiohttp now, which answers it at once, rather than after the idle timeout. Runs only for a head
    split across reads."""
    try:
        httptools.HttpRequestParser(_NoCallbacks()).feed_data(partial)
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):
        return False
    return True


def _make_task(loop: asyncio.AbstractEventLoop, coro: Any) -> asyncio.Task:
    if sys.version_info >= (3, 12):  # as aiohttp starts its handlers: run to the first suspension now
        return asyncio.Task(coro, loop=loop, eager_start=True)
    return loop.create_task(coro)


class LeanProtocol(asyncio.Protocol):
    """One client connection (see the module docstring).

    ``server``: the :class:`~balancer.service.app_server.RouterServer` (connection registry and
    cap, :meth:`~balancer.service.app_server.RouterServer.aiohttp_protocol` for hand-overs and
    :meth:`~balancer.service.app_server.RouterServer.give_back`, asked once per keep-alive answer);
    ``handler(request, endpoint)``: serves a request, returns a :class:`aiohttp.web.Response` or
    the :class:`LeanStream` it wrote; ``routes``: request path bytes -> endpoint name;
    ``max_body_bytes``: bodies at or over this go to aiohttp; ``idle_timeout_s``,
    ``body_timeout_s``, ``body_timeout_answer(path, headers)``: the 408
    :class:`aiohttp.web.Response` to send when a body is late."""

    def __init__(self, server: Any, handler: Handler, routes: dict[bytes, str], *, max_body_bytes: int,
                 idle_timeout_s: float, body_timeout_s: float,
                 body_timeout_answer: Callable[[str, Any], web.Response]) -> None:
        self._server = server
        #: the server's placement hook (RouterServer.give_back): close after this answer?
        self._give_back: Callable[[], bool] = server.give_back
        self._handler = handler
        self._routes = routes
        self._max_body = max_body_bytes
        self._idle_s = idle_timeout_s
        self._body_s = body_timeout_s
        self._late_body = body_timeout_answer
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._parser: httptools.HttpRequestParser | None = None
        self._state = _IDLE
        self._need = 0  # BODY: bytes of the buffer that make the request
        self._head_len = 0
        self._endpoint = ""
        self._path = ""
        self._headers: CIMultiDictProxy | None = None
        self._url = b""
        self._hdrs: list[tuple[bytes, bytes]] = []
        self._complete = False
        self.keep_alive = True
        self._closing = False
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self.paused_writing = False
        self._drain: asyncio.Future | None = None
        self._reading_paused = False
        #: the running request's task (aiohttp's Server reads this name when the connection ends)
        self._task_handler: asyncio.Task | None = None

    # ---------------------------------------------------------------- httptools callbacks
    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._hdrs.append((name, value))

    def on_message_complete(self) -> None:
        self._complete = True

    # ---------------------------------------------------------------- asyncio protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self._server.connection_made(self, transport)  # may abort it: over max_connections
        if transport.is_closing():
            return
        self._set_deadline(self._idle_s)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._state == _GONE and self.transport is None:
            return
        self._server.connection_lost(self, exc)
        self.transport = None
        self._state = _GONE
        self._buf.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client closed the connection"))
            self._drain.exception()  # retrieved here: the writer may be gone
        task = self._task_handler
        if task is not None and not task.done():
            task.cancel()  # handler cancellation: a client disconnect aborts the request's legs

    def pause_writing(self) -> None:
        self.paused_writing = True

    def resume_writing(self) -> None:
        self.paused_writing = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    async def drain(self) -> None:
        """Wait until the transport's buffer is below its low-water mark.

        Raises:
            ConnectionResetError: the connection is gone."""
        if self.transport is None:
            raise ConnectionResetError("the client closed the connection")
        if not self.paused_writing:
            return
        if self._drain is None:
            self._drain = self._loop.create_future()
        await self._drain

    def write(self, data: bytes) -> None:
        """Write to the client.

        Raises:
            ConnectionResetError: the connection is closed or closing."""
        tr = self.transport
        if tr is None or tr.is_closing():
            raise ConnectionResetError("cannot write to a closing transport")
        tr.write(data)

    def data_received(self, data: bytes) -> None:
        if self._state == _GONE:
            return
        self._buf += data
        if self._state == _BUSY:
            if len(self._buf) > MAX_PIPELINED_BYTES and not self._reading_paused:
                self._reading_paused = True
                assert self.transport is not None
                self.transport.pause_reading()
            return
        self._advance()

    def eof_received(self) -> bool | None:
        return None  # close when the client half-closes (a request in flight is cancelled)

    # ---------------------------------------------------------------- requests
    def _advance(self) -> None:
        """Parse and start the next request in the buffer, if it is all here."""
        buf = self._buf
        if self._state == _IDLE:
            if not buf:
                return
            end = buf.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES or b"\n\n" in buf or not _may_start_a_request(bytes(buf)):
                    self._hand_over()  # aiohttp's limits and answers (431/400), at once
                return
            head_len = end + 4
            if not self._start_head(bytes(buf[:head_len])):
                self._hand_over()
                return
            self._head_len = head_len
            self._state = _BODY
            if len(buf) < self._need:
                self._set_deadline(self._body_s)
                return
        if self._state != _BODY or len(buf) < self._need:
            return
        head_len, need = self._head_len, self._need
        body = bytes(buf[head_len:need])
        del buf[:need]
        if body:
            try:
                self._parser.feed_data(body)  # type: ignore[union-attr]
            except httptools.HttpParserError:  # cannot happen for a Content-Length body: be safe
                self._abort()
                return
        if not self._complete:  # llhttp did not see the message end where Content-Length said
            self._abort()
            return
        self._state = _BUSY
        request = LeanRequest(self._path, self._headers, body, self)  # type: ignore[arg-type]
        self._task_handler = _make_task(self._loop, self._serve(request, self._endpoint))

    def _start_head(self, head: bytes) -> bool:
        """Parse one head; whether the request is served here (else it is handed over)."""
        parser = self._parser
        if parser is None:
            parser = self._parser = httptools.HttpRequestParser(self)
        self._url, self._hdrs, self._complete = b"", [], False
        try:
            parser.feed_data(head)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            return False
        if parser.get_method() != b"POST" or parser.get_http_version() != "1.1" or parser.should_upgrade():
            return False
        endpoint = self._routes.get(self._url)
        hdrs = self._hdrs
        if endpoint is None or len(hdrs) > MAX_HEADERS:
            return False
        length = -1
        once: set[bytes] = set()
        for name, value in hdrs:
            n = name.lower()
            if n == b"content-length":
                if length >= 0 or not value.isdigit() or len(value) > 12:
                    return False
                length = int(value)
            elif n in (b"transfer-encoding", b"expect", b"content-encoding", b"upgrade"):
                return False
            elif n in _SINGLETONS:
                if n in once:
                    return False
                once.add(n)
        if length < 0 or length >= self._max_body or b"host" not in once:
            return False
        if length == 0 and not self._complete:
            return False
        try:
            headers = CIMultiDict([(n.decode("latin-1"), v.decode("utf-8", "surrogateescape")) for n, v in hdrs])
        except UnicodeError:
            return False
        self.keep_alive = parser.should_keep_alive()
        self._headers = CIMultiDictProxy(headers)
        self._path = self._url.decode("ascii")
        self._endpoint = endpoint
        self._need = len(head) + length
        return True

    async def _serve(self, request: LeanRequest, endpoint: str) -> None:
        try:
            resp = await self._handler(request, endpoint)
        except asyncio.CancelledError:
            self._task_handler = None
            if self.transport is not None:  # cancelled by a shutdown: nothing more to say
                self.transport.close()
            return
        except Exception:  # the handler answers its own errors (500 included): a bug here
            if _errors_log.log(logging.ERROR, "lean_front_handler", time.monotonic(), "lean front: error serving a request"):
                log.error("traceback of the error above", exc_info=True)
            self._task_handler = None
            self._abort()
            return
        self._task_handler = None
        tr = self.transport
        if tr is None:
            return
        keep = self.keep_alive and not self._closing
        if isinstance(resp, LeanStream):
            if not resp.finished:  # a stream the handler left open: its end is unknown to the client
                tr.close()
                return
        else:
            try:
                keep = keep and resp.keep_alive is not False and not self._giving_back()
                data = response_bytes(resp, keep)
            except Exception:  # not a web.Response with a bytes body, or a header with CR/LF: a bug
                if _errors_log.log(logging.ERROR, "lean_front_answer", time.monotonic(),
                                   "lean front: the answer cannot be written"):
                    log.error("traceback of the error above", exc_info=True)
                self._abort()
                return
            if tr.is_closing():
                return
            tr.write(data)
        if not keep:
            tr.close()
            self._state = _GONE
            return
        self._state = _IDLE
        self._set_deadline(self._idle_s)
        if self._reading_paused:
            self._reading_paused = False
            tr.resume_reading()
        if self._buf:  # a pipelined request waits (else _advance has nothing to do)
            self._advance()

    def open_stream(self, status: int, headers: Any) -> LeanStream:
        return LeanStream(self, status, headers, self.keep_alive and not self._closing and not self._giving_back())

    def _giving_back(self) -> bool:
        """The connection placement wants this connection back: this answer says
        ``Connection: close`` and the connection closes after it (no later request is taken)."""
        if not self._buf and self._give_back():  # never with a pipelined request waiting
            self._closing = True
            return True
        return False

    def _abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        self._state = _GONE

    def force_close(self) -> None:
        """Close the connection now (what aiohttp's protocol offers as ``force_close``)."""
        self._closing = True
        if self.transport is not None:
            self.transport.close()

    # ---------------------------------------------------------------- timers
    def _set_deadline(self, after_s: float) -> None:
        now = self._loop.time()
        self._deadline = now + after_s
        if self._timer is None or self._deadline < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = self._deadline
            self._timer = self._loop.call_at(self._deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        state = self._state
        if state in (_BUSY, _GONE) or self.transport is None:
            return  # re-armed when the answer is written
        if self._loop.time() < self._deadline:
            self._timer_at = self._deadline
            self._timer = self._loop.call_at(self._deadline, self._on_timer)
            return
        tr = self.transport
        if state == _BODY:  # 408 (RFC 9110 §15.5.9: and close)
            self._state = _GONE
            try:
                tr.write(response_bytes(self._late_body(self._path, self._headers), False))
            except (TypeError, ValueError):
                pass
        tr.close()
        self._state = _GONE

    # ---------------------------------------------------------------- aiohttp's Server hooks
    def close(self) -> None:
        """Stop taking requests: close now when idle, else after the answer in progress."""
        self._closing = True
        if self._task_handler is None and self.transport is not None:
            self.transport.close()

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        """Wait at most ``timeout`` for the request in progress, cancel it after, then close."""
        self._closing = True
        task = self._task_handler
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()
        if self.transport is not None:
            self.transport.close()

    # ---------------------------------------------------------------- hand-over
    def _hand_over(self) -> None:
        """Give the connection to aiohttp's protocol with the bytes of the request begun."""
        tr = self.transport
        if tr is None:
            return
        data = bytes(self._buf)
        self._buf.clear()
        self._state = _GONE
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._server.connection_lost(self, None)
        self.transport = None
        proto = self._server.aiohttp_protocol()
        tr.set_protocol(proto)
        proto.connection_made(tr)
        if self._reading_paused:
            tr.resume_reading()
        if data and not tr.is_closing():
            proto.data_received(data)
