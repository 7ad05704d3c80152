"""The lean HTTP/1.1 client of the proxy's engine legs (``upstream_client: lean``, the default).

One :class:`UpstreamClient` per router process keeps, per engine ``host:port``, a pool of
keep-alive connections, each an :class:`asyncio.Protocol` whose responses are parsed by
``httptools`` (llhttp, the parser uvicorn uses; no HTTP parsing of our own). It does only what the
proxy needs of aiohttp's client: ``POST`` a body with a few headers and read the answer whole
(:meth:`UpstreamResponse.read`) or as it arrives (``resp.content.iter_any()``), and does it with
far fewer Python objects per request (no request/response object trees, multidicts, URL objects,
timers, trace hooks or cookie handling). docs/serving.md, "Upstream client", has the measurements.

Semantics (those of the aiohttp session ``app.make_client_session`` builds, unless said):

* Responses: ``Content-Length``, chunked and (``Connection: close``) read-until-close bodies;
  ``1xx`` interim answers (``100``, ``103``) are skipped, ``101`` is a protocol error (the legs
  never upgrade); ``204`` and ``304`` have no body. Bodies are relayed as sent (no decompression).
* Pool: connections are reused last-in first-out and closed after ``keepalive_s`` idle (60 s,
  as the aiohttp connector), when the engine closes them, when the answer said
  ``Connection: close`` (or was HTTP/1.0 without keep-alive), when its body was not read to its
  end, after any error and when the caller is cancelled mid-request (a client disconnect): a
  connection goes back to the pool only after a complete, well-formed answer. ``limit_per_host``
  bounds the connections (in use, idle and connecting) to one engine; a request beyond it waits
  for one (aiohttp's ``limit_per_host``; ``0``: no limit, what the router sets, as aiohttp's
  ``limit=0``). At most ``max_idle_per_host`` idle connections are kept per engine (aiohttp keeps
  every one).
* Bounds: a response head (status line and headers) over ``max_head_bytes`` and a body read whole
  over ``max_body_bytes`` are protocol errors (the connection is closed); a streamed body is held
  at most ``stream_buffer_bytes`` (plus one socket read) before the connection stops reading until
  the consumer catches up (TCP flow control holds the engine back). aiohttp bounds lines and
  fields at 8,190 bytes and a whole body not at all.
* Stale pooled connections. A connection that served an answer can be closed by the engine while
  idle (its keep-alive timer; uvicorn's default is 5 s). The client (1) never writes a request on
  a pooled connection it knows to be closed: one whose end (EOF or reset) the event loop has
  seen, or whose socket a zero-timeout ``poll``, just before the write, finds at EOF,
  reset or holding unexpected bytes (readable at all); such a connection is discarded and the next one (or a new
  one) used; (2) never sends a written request again: a request that went out and whose
  connection then ended (EOF or reset) before the answer fails with :class:`UpstreamDisconnected`
  and the proxy's own retry on a new route applies, as with aiohttp (which resends only idempotent
  methods) and Go's net/http (never a written POST that cannot be replayed). A reset does not
  prove the engine left the request unread: one that reads it and then aborts the connection
  (``SO_LINGER`` 0) resets too, and resending on a reset would run such a request twice
  (``tests/service/test_upstream_client.py``).
* Errors are :class:`UpstreamError` subclasses, all :class:`OSError` (the proxy's handlers catch
  ``OSError`` for both clients, so failure kinds, retries and breakers are the same):
  :class:`UpstreamConnectError` (connect refused/unreachable), :class:`UpstreamConnectTimeout`
  (also a :class:`TimeoutError`, as aiohttp's ``ConnectionTimeoutError`` is), 
  :class:`UpstreamDisconnected` (closed or reset before the answer was complete) and
  :class:`UpstreamProtocolError` (malformed or oversize answer).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import ipaddress
import select
import socket
from typing import Any

import httptools

DEFAULT_MAX_HEAD_BYTES = 65_536
"""Largest response head (status line + headers) accepted, bytes (engines send a few hundred)."""
DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024
"""Largest body read whole (:meth:`UpstreamResponse.read`), bytes: an engine answer with every
token's logprobs for a long generation is tens of MB."""
DEFAULT_STREAM_BUFFER_BYTES = 1024 * 1024
"""Streamed bytes held unread before the connection stops reading from the engine."""
DEFAULT_MAX_IDLE_PER_HOST = 1024
"""Idle keep-alive connections kept per engine; more are closed when released."""

BODY_SLICE_BYTES = 1024 * 1024
"""Request bodies larger than this are written this many bytes per event-loop pass."""
_INLINE_BODY_BYTES = 65_536  # bodies up to this size are written in one buffer with the head


class UpstreamError(OSError):
    """An engine leg failed below HTTP (connect, reset, malformed answer). ``before_response``:
    no byte of the answer had arrived."""

    before_response = False


class UpstreamConnectError(UpstreamError):
    """The TCP connection could not be opened (refused, unreachable, no address)."""

    before_response = True


class UpstreamConnectTimeout(UpstreamError, TimeoutError):
    """The TCP connection did not open within ``connect_timeout_s``."""

    before_response = True


class UpstreamDisconnected(UpstreamError):
    """The connection ended (EOF, reset, or closed by :meth:`UpstreamResponse.close`) before the
    answer was complete. ``reset``: it was reset (``ECONNRESET``/``EPIPE``)."""

    def __init__(self, message: str, before_response: bool, reset: bool) -> None:
        super().__init__(message)
        self.before_response, self.reset = before_response, reset


class UpstreamProtocolError(UpstreamError):
    """The answer is not valid HTTP/1.1 or exceeds a size bound."""


_HAVE_POLL = hasattr(select, "poll")  # not on Windows


class Headers(dict[str, str]):
    """Response headers, names lower-cased; :meth:`get` and ``in`` take any case. Repeated
    headers are joined with ``", "``."""

    __slots__ = ()

    def get(self, name: str, default: Any = None) -> Any:
        return dict.get(self, name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name.lower() if isinstance(name, str) else name)

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())


class UpstreamResponse:
    """One answer of an engine: ``status``, ``headers`` (:class:`Headers`), its body through
    :meth:`read` (whole) or ``content.iter_any()`` (chunks as they arrive, for SSE), then
    :meth:`release` (connection back to the pool when the answer was complete) or :meth:`close`
    (connection closed; a pending read fails with :class:`UpstreamDisconnected`). Both are
    idempotent and safe after the other."""

    __slots__ = ("status", "headers", "_conn", "_chunks", "_buffered", "_done", "_exc", "_waiter", "_received")

    def __init__(self, conn: _Connection) -> None:
        self.status = 0
        self.headers = Headers()
        self._conn: _Connection | None = conn
        self._chunks: list[bytes] = []
        self._buffered = 0  # bytes in _chunks
        self._received = 0  # body bytes so far
        self._done = False  # the body ended
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def content_type(self) -> str:
        """The media type of ``Content-Type`` (lower case, without parameters);
        ``application/octet-stream`` when absent (as aiohttp)."""
        v = self.headers.get("content-type")
        if not v:
            return "application/octet-stream"
        return v.split(";", 1)[0].strip().lower()

    @property
    def content(self) -> UpstreamResponse:
        """``resp.content.iter_any()`` as with aiohttp."""
        return self

    def iter_any(self) -> UpstreamResponse:
        """An async iterator over the body as it arrives: each item is every byte received since
        the last (never empty); ends with the body; raises :class:`UpstreamError` if the
        connection fails first. The connection is released when it ends."""
        return self

    def __aiter__(self) -> UpstreamResponse:
        return self

    async def __anext__(self) -> bytes:
        while True:
            if self._chunks:
                return self._take()
            if self._exc is not None:
                raise self._exc
            if self._done:
                self.release()
                raise StopAsyncIteration
            await self._wait()

    async def read(self) -> bytes:
        """The whole body (at most ``max_body_bytes``, else :class:`UpstreamProtocolError`); the
        connection is released afterwards."""
        parts: list[bytes] = []
        total = 0
        limit = self._conn.client.max_body_bytes if self._conn is not None else DEFAULT_MAX_BODY_BYTES
        while True:
            if self._chunks:
                total += self._buffered
                if total > limit:
                    self.close()
                    raise UpstreamProtocolError(f"response body over {limit} bytes")
                parts.append(self._take())
            if self._exc is not None:
                raise self._exc
            if self._done:
                self.release()
                return parts[0] if len(parts) == 1 else b"".join(parts)
            await self._wait()

    def arrived(self) -> bool:
        """Whether :meth:`read` would return (or raise) without waiting: the body has ended or the
        connection failed. A zero-delay engine's short answer usually comes with its headers."""
        return self._done or self._exc is not None

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._buffered = 0
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        return data

    async def _wait(self) -> None:
        conn = self._conn
        if conn is None:  # released or closed without an error recorded (cannot happen unfinished)
            raise UpstreamDisconnected("response closed", False, False)
        fut = self._waiter = conn.loop.create_future()
        try:
            await fut
        except BaseException:
            # cancelled (the client went away) or failed: a half-read connection is never reused
            self.close()
            raise
        finally:
            self._waiter = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None and not self._done:
            self._exc = exc
        self._wake()

    def release(self) -> None:
        """Return the connection to the pool if the answer was complete and keep-alive, else close
        it; the response no longer holds it."""
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        conn.finish(self._done and self._exc is None and not self._chunks)

    def close(self) -> None:
        """Close the connection (a pending or later read raises :class:`UpstreamDisconnected`
        unless the body had ended)."""
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        self._fail(UpstreamDisconnected("response closed", False, False))
        conn.finish(False)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an engine and its parser (one request at a time)."""

    def __init__(self, pool: _HostPool) -> None:
        self.pool = pool
        self.client = pool.client
        self.loop = pool.client.loop
        self.transport: asyncio.Transport | None = None
        self.sock: socket.socket | None = None
        self._poller: select.poll | None = None  # peek_dead's, registered for sock once
        self.parser = httptools.HttpResponseParser(self)
        # a lone LF ends a line, as aiohttp's parser reads answers (RFC 9112 sec. 2.2 allows it);
        # strict llhttp refuses them, and such an engine works with aiohttp's client
        self.parser.set_dangerous_leniencies(lenient_optional_cr_before_lf=True)  # httptools >= 0.6.2
        self.resp: UpstreamResponse | None = None  # the answer being received
        self.head_fut: asyncio.Future[None] | None = None
        self.closed = False
        self.reusable = True
        self.paused = False
        self.served = 0  # answers completed on this connection
        self.idle_since = 0.0
        self._got = 0  # bytes of the current answer received
        self._head_done = False
        self._head_len = 0
        self._framing = 0  # bytes read since the last body byte (after the head)
        self._interim = False  # parsing a 1xx answer
        self._message_done = False
        self._error: UpstreamError | None = None
        self._hdrs: Headers | None = None
        self._body: memoryview | None = None  # a large request body being written, slice by slice
        self._body_off = 0
        self._write_paused = False
        self._feed_handle: asyncio.Handle | None = None

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None or self._message_done:  # bytes nobody asked for: the connection is unusable
            self.reusable = False
            self.abort()
            return
        self._got += len(data)
        body_before = resp._received
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            self._protocol_error(self._error or UpstreamProtocolError("bad response from the engine"))
            return
        except httptools.HttpParserUpgrade:
            self._protocol_error(UpstreamProtocolError("the engine switched protocols"))
            return
        except httptools.HttpParserError as e:
            self._protocol_error(UpstreamProtocolError(f"malformed response from the engine ({e})"))
            return
        if not self._head_done:
            if self._got > self.client.max_head_bytes:
                self._protocol_error(UpstreamProtocolError(
                    f"response head over {self.client.max_head_bytes} bytes"))
        elif resp._received == body_before and not self._message_done:
            # reads without a body byte after the head: chunk framing or trailers (which the
            # parser accumulates), bounded like the head
            self._framing += len(data)
            if self._framing > self.client.max_head_bytes:
                self._protocol_error(UpstreamProtocolError(
                    f"over {self.client.max_head_bytes} bytes of chunk framing or trailers without a body byte"))
        else:
            self._framing = 0

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._drop_body()
        if self.closed:
            return
        self.closed = True
        self.pool.lost(self)
        resp = self.resp
        if resp is None:
            return
        reset = isinstance(exc, (ConnectionResetError, BrokenPipeError)) or (
            isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.EPIPE))
        if self._head_done and not self._message_done and exc is None and self._read_until_close():
            self._message_done = True  # a body delimited by the end of the connection
            resp._done = True
            resp._wake()
            return
        if self._message_done:
            return
        what = "reset" if reset else "closed"
        err = UpstreamDisconnected(
            f"the engine {what} the connection " + ("mid-response" if self._head_done else "before answering"),
            before_response=self._got == 0, reset=reset)
        self._fail(err)

    def pause_writing(self) -> None:  # a large body waits (_feed_body); a small one is buffered whole
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._body is not None and self._feed_handle is None:
            self._feed_body()

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        if self._message_done:  # a second answer to one request (or bytes after the answer)
            self._error = UpstreamProtocolError("the engine sent bytes after its answer")
            raise self._error
        self._hdrs = Headers()
        self._head_len = 0

    def on_status(self, status: bytes) -> None:
        self._head_len += len(status) + 16

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_len += len(name) + len(value) + 4
        if self._head_len > self.client.max_head_bytes:
            self._error = UpstreamProtocolError(f"response head over {self.client.max_head_bytes} bytes")
            raise self._error
        hdrs = self._hdrs
        assert hdrs is not None
        k = name.decode("latin-1").lower()
        v = value.decode("latin-1")
        old = dict.get(hdrs, k)
        dict.__setitem__(hdrs, k, v if old is None else f"{old}, {v}")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            if status == 101:
                self._error = UpstreamProtocolError("the engine switched protocols (101)")
                raise self._error
            self._interim = True  # 100 Continue, 103 Early Hints: the real answer follows
            return
        resp = self.resp
        assert resp is not None and self._hdrs is not None
        resp.status = status
        resp.headers = self._hdrs
        self._head_done = True
        if not self.parser.should_keep_alive():
            self.reusable = False
        fut = self.head_fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        assert resp is not None
        resp._chunks.append(body)
        resp._buffered += len(body)
        resp._received += len(body)
        if resp._buffered > self.client.stream_buffer_bytes and not self.paused:
            self.paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        if resp._waiter is not None:  # a reader waits (else nothing to wake: one call fewer per answer)
            resp._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            self._hdrs = None
            return
        self._message_done = True
        resp = self.resp
        assert resp is not None
        resp._done = True
        if resp._waiter is not None:
            resp._wake()

    # -- helpers
    def _read_until_close(self) -> bool:
        h = self._hdrs
        return h is not None and "content-length" not in h and "transfer-encoding" not in h

    def _fail(self, err: UpstreamError) -> None:
        resp = self.resp
        if resp is not None:
            resp._fail(err)
        fut = self.head_fut
        if fut is not None and not fut.done():
            fut.set_exception(err)

    def _protocol_error(self, err: UpstreamError) -> None:
        err.before_response = False
        self.reusable = False
        self._fail(err)
        self.abort()

    def resume(self) -> None:
        self.paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def peek_dead(self) -> bool:
        """Whether the idle connection's socket has EOF, a reset or unexpected bytes pending: one
        ``poll`` with a zero timeout (readable, hung up or in error: any of those), which answers
        what a non-blocking ``MSG_PEEK`` read would without raising an exception per live
        connection (the read is the fallback where ``select.poll`` is missing)."""
        sock = self.sock
        if sock is None:
            return False
        if _HAVE_POLL:
            poller = self._poller
            if poller is None:
                fd = sock.fileno()
                if fd < 0:  # closed under us
                    return True
                poller = self._poller = select.poll()
                poller.register(fd, select.POLLIN)
            return bool(poller.poll(0))
        try:
            sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return True  # EOF (b"") or bytes while idle

    def send(self, head: bytes, data: bytes) -> UpstreamResponse:
        """Write one request; the answer's headers resolve ``head_fut``."""
        resp = self.resp = UpstreamResponse(self)
        self.head_fut = self.loop.create_future()
        self._got = self._framing = 0
        self._head_done = self._message_done = self._interim = False
        self._error = None
        t = self.transport
        assert t is not None
        if len(data) <= _INLINE_BODY_BYTES:
            t.write(head + data)
        else:
            t.write(head)
            if len(data) <= BODY_SLICE_BYTES:
                t.write(data)
            else:  # a large body goes out a slice per loop pass (_feed_body)
                self._body, self._body_off = memoryview(data), 0
                self._feed_body()
        return resp

    def _feed_body(self) -> None:
        """Write the next :data:`BODY_SLICE_BYTES` of a large request body, then yield to the event
        loop (or wait for ``resume_writing`` if the transport's buffer is full): the transport
        copies what the socket does not take at once, and one 32 MB write was one 30 MB copy
        (tens of ms with page faults) during which no client was served (issue 25 item 2)."""
        self._feed_handle = None
        body, t = self._body, self.transport
        if body is None or t is None or self.closed:
            self._body = None
            return
        if self._write_paused:
            return  # resume_writing goes on
        end = min(self._body_off + BODY_SLICE_BYTES, len(body))
        t.write(body[self._body_off:end])
        self._body_off = end
        if end >= len(body):
            self._body = None
        elif not self._write_paused:
            self._feed_handle = self.loop.call_soon(self._feed_body)

    def _drop_body(self) -> None:
        self._body = None
        if self._feed_handle is not None:
            self._feed_handle.cancel()
            self._feed_handle = None

    def finish(self, complete: bool) -> None:
        """The response let go of the connection: back to the pool if ``complete`` and reusable."""
        self.resp = None
        self.head_fut = None
        if self._body is not None:  # answered before its body was all sent: not reusable
            self._drop_body()
            self.reusable = False
        if complete and self.reusable and not self.closed and not self.paused:
            self.served += 1
            self.pool.put(self)
        else:
            self.abort()

    def abort(self) -> None:
        """Close at once (no lingering: unsent bytes are dropped)."""
        self.reusable = False
        self._drop_body()
        t = self.transport
        if t is not None and not self.closed:
            t.abort()


class _HostPool:
    """The connections to one ``host:port``."""

    def __init__(self, client: UpstreamClient, host: str, port: int) -> None:
        self.client = client
        self.host, self.port = host, port
        self.idle: collections.deque[_Connection] = collections.deque()
        self.open = 0  # connections open or connecting
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.sweep: asyncio.TimerHandle | None = None
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
            self.addrs: list[tuple[int, tuple]] | None = [
                (socket.AF_INET6 if ip.version == 6 else socket.AF_INET, (str(ip), port))]
        except ValueError:
            self.addrs = None  # a host name: resolved per new connection

    async def acquire(self) -> tuple[_Connection, bool]:
        """``(connection, reused)``: an idle connection known alive, else a new one (waiting
        while ``limit_per_host`` connections are open)."""
        limit = self.client.limit_per_host
        while True:
            conn = self._pop_idle()
            if conn is not None:
                return conn, True
            if not limit or self.open < limit:
                return await self.connect(), False
            fut = self.client.loop.create_future()
            self.waiters.append(fut)
            try:
                await fut
            except BaseException:
                if fut.done() and not fut.cancelled():
                    self._wake()  # pass the turn on
                raise
            finally:
                if not fut.done():
                    fut.cancel()

    def _pop_idle(self) -> _Connection | None:
        idle = self.idle
        now = self.client.loop.time()
        keep = self.client.keepalive_s
        while idle:
            conn = idle.pop()
            if conn.closed or now - conn.idle_since > keep or conn.peek_dead():
                conn.abort()
                continue
            return conn
        return None

    async def connect(self) -> _Connection:
        """A new connection (counted in ``open`` until it is lost)."""
        client = self.client
        loop = client.loop
        self.open += 1
        conn = _Connection(self)
        try:
            try:
                async with asyncio.timeout(client.connect_timeout_s):
                    addrs = self.addrs
                    if addrs is None:
                        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
                        addrs = [(fam, addr) for fam, _, _, _, addr in infos]
                        if not addrs:
                            raise OSError(f"no address for {self.host}")
                    last: OSError | None = None
                    for fam, addr in addrs:
                        sock = socket.socket(fam, socket.SOCK_STREAM)
                        try:
                            sock.setblocking(False)
                            # asyncio sets it only on sockets made with proto=IPPROTO_TCP: without it,
                            # Nagle + delayed ACK can hold a request's last segment for ~40 ms
                            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                            await loop.sock_connect(sock, addr)
                        except BaseException as e:
                            sock.close()
                            if not isinstance(e, OSError):
                                raise
                            last = e
                            continue
                        conn.sock = sock
                        await loop.create_connection(lambda: conn, sock=sock)
                        return conn
                    assert last is not None
                    raise last
            except TimeoutError:
                raise UpstreamConnectTimeout(
                    f"connect to {self.host}:{self.port} timed out after {client.connect_timeout_s:g} s") from None
            except OSError as e:
                raise UpstreamConnectError(f"cannot connect to {self.host}:{self.port}: {e}") from e
        except BaseException:
            if conn.transport is None:  # never connected: connection_lost will not come
                self.open -= 1
                self._wake()
            else:
                conn.abort()
            raise

    def put(self, conn: _Connection) -> None:
        conn.idle_since = self.client.loop.time()
        if self.client.closed or (len(self.idle) >= self.client.max_idle_per_host and not self.waiters):
            conn.abort()
            return
        self.idle.append(conn)
        if self.waiters:
            self._wake()
        if self.sweep is None:
            self.sweep = self.client.loop.call_later(self.client.keepalive_s, self._sweep)

    def lost(self, conn: _Connection) -> None:
        self.open -= 1
        self._wake()

    def _wake(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def _sweep(self) -> None:
        """Close idle connections past ``keepalive_s`` (oldest first) and dead ones."""
        self.sweep = None
        now = self.client.loop.time()
        keep = self.client.keepalive_s
        idle = self.idle
        alive = collections.deque(c for c in idle if not c.closed)
        while alive and now - alive[0].idle_since > keep:
            alive.popleft().abort()
        self.idle = alive
        if alive:
            delay = max(0.05, keep - (now - alive[0].idle_since))
            self.sweep = self.client.loop.call_later(delay, self._sweep)

    def close(self) -> None:
        if self.sweep is not None:
            self.sweep.cancel()
            self.sweep = None
        while self.idle:
            self.idle.pop().abort()


class UpstreamClient:
    """Keep-alive connection pools to the engines (module docstring); one per event loop.

    Args:
        connect_timeout_s: bound on opening a TCP connection (resolution included).
        keepalive_s: idle connections are closed after this long.
        limit_per_host: most connections open to one ``host:port`` at once (in use, idle or
            connecting); more requests wait. ``0``: no limit.
        max_idle_per_host: most idle connections kept per ``host:port``.
        max_head_bytes / max_body_bytes / stream_buffer_bytes: size bounds (module docstring).
    """

    def __init__(self, connect_timeout_s: float = 5.0, keepalive_s: float = 60.0, limit_per_host: int = 0,
                 max_idle_per_host: int = DEFAULT_MAX_IDLE_PER_HOST, max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 stream_buffer_bytes: int = DEFAULT_STREAM_BUFFER_BYTES) -> None:
        if connect_timeout_s <= 0 or keepalive_s <= 0 or limit_per_host < 0 or max_idle_per_host < 0:
            raise ValueError("connect_timeout_s and keepalive_s must be > 0, the limits >= 0")
        self.loop = asyncio.get_running_loop()
        self.connect_timeout_s, self.keepalive_s = connect_timeout_s, keepalive_s
        self.limit_per_host, self.max_idle_per_host = limit_per_host, max_idle_per_host
        self.max_head_bytes, self.max_body_bytes = max_head_bytes, max_body_bytes
        self.stream_buffer_bytes = stream_buffer_bytes
        self._pools: dict[tuple[str, int], _HostPool] = {}
        self._targets: dict[Any, tuple[_HostPool, bytes]] = {}
        self.closed = False

    def _target(self, url: Any) -> tuple[_HostPool, bytes]:
        from yarl import URL

        u = url if isinstance(url, URL) else URL(str(url))
        if u.scheme != "http" or not u.raw_host:
            raise ValueError(f"the lean upstream client speaks plain http only, not {str(u)!r}")
        port = u.port or 80
        host = u.raw_host
        key = (host, port)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _HostPool(self, host, port)
        hostport = f"[{host}]" if ":" in host else host
        prefix = f"POST {u.raw_path_qs or '/'} HTTP/1.1\r\nHost: {hostport}:{port}\r\n".encode("latin-1")
        if len(self._targets) < 65_536:  # distinct URLs are a few per worker
            self._targets[url] = (pool, prefix)
        return pool, prefix

    async def post(self, url: Any, data: bytes, headers: dict[str, str] | None = None) -> UpstreamResponse:
        """``POST data`` to ``url`` (``http://host:port/path``, a string or :class:`yarl.URL`) with
        ``headers`` (``Content-Length`` is added); returns once the answer's status and headers
        arrived. Raises :class:`UpstreamError` (module docstring), ``ValueError`` for a header
        with a line break in it."""
        if self.closed:
            raise UpstreamDisconnected("the upstream client is closed", True, False)
        target = self._targets.get(url)
        pool, prefix = target if target is not None else self._target(url)
        lines = [prefix]
        if headers:
            for k, v in headers.items():
                if "\n" in k or "\r" in k or "\n" in v or "\r" in v:
                    raise ValueError(f"header {k!r} has a line break")
                lines.append(f"{k}: {v}\r\n".encode("latin-1"))
        lines.append(b"Content-Length: %d\r\n\r\n" % len(data))
        head = b"".join(lines)
        # an idle connection known alive (what acquire() returns first) without acquire's coroutine
        conn = pool._pop_idle()
        if conn is None:
            conn, _reused = await pool.acquire()
        # the exchange, in this coroutine (one frame fewer per leg); never resent (module docstring)
        resp = conn.send(head, data)
        fut = conn.head_fut
        assert fut is not None
        try:
            await fut
        except BaseException:
            resp.close()
            raise
        if resp._exc is not None:  # the bytes that completed the head also broke the body (as aiohttp)
            resp.close()
            raise resp._exc
        return resp

    async def close(self) -> None:
        """Close every idle connection; later requests fail (open responses close as they end)."""
        self.closed = True
        for pool in self._pools.values():
            pool.close()

    def stats(self) -> dict[str, int]:
        """``{"open": connections open or connecting, "idle": idle ones}`` over all engines."""
        return {"open": sum(p.open for p in self._pools.values()),
                "idle": sum(sum(1 for c in p.idle if not c.closed) for p in self._pools.values())}
