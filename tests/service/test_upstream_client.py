"""The lean upstream client (balancer/service/upstream.py): a fault matrix by failure point against
raw asyncio servers written here (no pdlb code and no HTTP library on the server side), the pool's
bookkeeping after each fault (nothing leaked, no broken connection reused), a property test that
an answer delivered in random pieces reassembles to the same body, and the proxy's failure kinds
being the same with either upstream client.

Expected values come from the wire scripts: each server case sends known bytes, so the body, the
status, the number of connections the server saw and the error class are fixed by the script.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import struct

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from balancer.service.app import create_app
from balancer.service.config import ServiceConfig
from balancer.service.upstream import (
    UpstreamClient,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamProtocolError,
    _Connection,
    _HostPool,
)

OK_BODY = b'{"ok": true}'


def ok(body: bytes = OK_BODY, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n" % (
        len(body), extra) + body


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """One request (head, body) off the stream, ``None`` at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    m = re.search(rb"(?i)content-length: *(\d+)", head)
    body = await reader.readexactly(int(m.group(1))) if m else b""
    return head, body


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0)."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class RawServer:
    """A TCP server running ``script(reader, writer, conn_no, server)`` per connection; counts
    connections and the requests it read (``requests``: (conn_no, head, body))."""

    def __init__(self, script) -> None:  # noqa: ANN001
        self.script = script
        self.connections = 0
        self.requests: list[tuple[int, bytes, bytes]] = []
        self.eofs = 0  # connections the client closed (EOF seen by the server)
        self.srv: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> RawServer:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.script(reader, writer, self.connections, self)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                if not writer.transport.is_closing():
                    writer.close()

        self.srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:  # noqa: ANN002
        assert self.srv is not None
        self.srv.close()

    @property
    def url(self) -> str:
        assert self.srv is not None
        return f"http://127.0.0.1:{self.srv.sockets[0].getsockname()[1]}/v1/completions"

    async def request(self, reader: asyncio.StreamReader, conn_no: int) -> bool:
        got = await read_request(reader)
        if got is None:
            self.eofs += 1
            return False
        self.requests.append((conn_no, *got))
        return True


def keepalive(answer: bytes):  # noqa: ANN201
    """Answer every request on the connection with ``answer``."""
    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        while await srv.request(reader, n):
            writer.write(answer)
            await writer.drain()
    return script


async def settle(client: UpstreamClient, open_: int, idle: int) -> None:
    """Within 1 s the pool holds ``open_`` connections, ``idle`` of them idle (a closed
    connection's bookkeeping runs on the next loop iterations)."""
    for _ in range(100):
        if client.stats() == {"open": open_, "idle": idle}:
            return
        await asyncio.sleep(0.01)
    assert client.stats() == {"open": open_, "idle": idle}


# ------------------------------------------------------------------ fault matrix (client level)
async def test_connect_refused_is_a_connect_error_and_leaks_nothing():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there
    c = UpstreamClient()
    with pytest.raises(UpstreamConnectError) as e:
        await c.post(f"http://127.0.0.1:{port}/x", b"{}")
    assert isinstance(e.value, OSError) and e.value.before_response
    await settle(c, 0, 0)


async def test_connect_timeout_is_a_timeout_error(monkeypatch):
    c = UpstreamClient(connect_timeout_s=0.05)

    async def never(sock, addr):  # noqa: ANN001, ANN202
        await asyncio.sleep(10)

    monkeypatch.setattr(c.loop, "sock_connect", never)
    with pytest.raises(UpstreamConnectTimeout) as e:
        await c.post("http://127.0.0.1:9/x", b"{}")
    assert isinstance(e.value, TimeoutError)  # as aiohttp's ConnectionTimeoutError: the proxy's first-byte kind
    await settle(c, 0, 0)


async def test_reset_before_status_line_on_a_new_connection_is_not_retried():
    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        await srv.request(reader, n)
        reset(writer)

    async with RawServer(script) as srv:
        c = UpstreamClient()
        with pytest.raises(UpstreamDisconnected) as e:
            await c.post(srv.url, b"{}")
        assert e.value.reset and e.value.before_response
        assert srv.connections == 1 and len(srv.requests) == 1  # once: a new connection's reset is not stale
        await settle(c, 0, 0)


async def test_reset_mid_headers_is_a_disconnect_after_bytes():
    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        await srv.request(reader, n)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Ty")
        await writer.drain()
        await asyncio.sleep(0.05)
        reset(writer)

    async with RawServer(script) as srv:
        c = UpstreamClient()
        with pytest.raises(UpstreamDisconnected) as e:
            await c.post(srv.url, b"{}")
        assert not e.value.before_response
        assert srv.connections == 1
        await settle(c, 0, 0)


@pytest.mark.parametrize("how", ["reset", "eof"])
async def test_failure_mid_body_fails_the_read_and_closes(how):
    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        await srv.request(reader, n)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
        await writer.drain()
        await asyncio.sleep(0.05)
        if how == "reset":
            reset(writer)
        else:
            writer.close()

    async with RawServer(script) as srv:
        c = UpstreamClient()
        resp = await c.post(srv.url, b"{}")
        assert resp.status == 200
        with pytest.raises(UpstreamDisconnected) as e:
            await resp.read()
        assert not e.value.before_response and e.value.reset == (how == "reset")
        resp.release()
        await settle(c, 0, 0)


@pytest.mark.parametrize("stream", [False, True])
async def test_bad_chunk_size_is_a_protocol_error(stream):
    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        await srv.request(reader, n)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"zz\r\nbad\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with RawServer(script) as srv:
        c = UpstreamClient()
        resp = await c.post(srv.url, b"{}")
        with pytest.raises(UpstreamProtocolError):
            if stream:
                assert await resp.content.iter_any().__anext__() == b"hello"
                async for _ in resp.content.iter_any():
                    pass
            else:
                await resp.read()
        await settle(c, 0, 0)


async def test_oversize_head_is_refused_without_buffering_it():
    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        await srv.request(reader, n)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Big: ")
        for _ in range(64):  # 4 MiB of one header line, if the client kept reading
            writer.write(b"a" * 65536)
            await writer.drain()

    async with RawServer(script) as srv:
        c = UpstreamClient(max_head_bytes=8192)
        with pytest.raises(UpstreamProtocolError, match="head over 8192"):
            await c.post(srv.url, b"{}")
        await settle(c, 0, 0)


async def test_many_headers_within_one_read_over_the_bound():
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(100))
    async with RawServer(keepalive(head + b"Content-Length: 0\r\n\r\n")) as srv:
        c = UpstreamClient(max_head_bytes=4096)  # the head is ~11 KB, in one socket read
        with pytest.raises(UpstreamProtocolError):
            await c.post(srv.url, b"{}")
        await settle(c, 0, 0)


async def test_oversize_trailers_are_refused():
    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        await srv.request(reader, n)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\nX-T: ")
        await writer.drain()
        for _ in range(64):  # 4 MiB of one trailer line, if the client kept reading
            writer.write(b"a" * 65536)
            await writer.drain()

    async with RawServer(script) as srv:
        c = UpstreamClient(max_head_bytes=8192)
        resp = await c.post(srv.url, b"{}")
        with pytest.raises(UpstreamProtocolError, match="trailers"):
            await resp.read()
        await settle(c, 0, 0)


async def test_body_over_the_bound_is_a_protocol_error():
    big = b"x" * 300_000
    async with RawServer(keepalive(ok(big))) as srv:
        c = UpstreamClient(max_body_bytes=100_000, stream_buffer_bytes=32_768)
        resp = await c.post(srv.url, b"{}")
        with pytest.raises(UpstreamProtocolError, match="body over 100000"):
            await resp.read()
        await settle(c, 0, 0)
        # streamed, the same body passes (its consumer drains it) in pieces
        resp = await c.post(srv.url, b"{}")
        got = [chunk async for chunk in resp.content.iter_any()]
        assert b"".join(got) == big
        await settle(c, 1, 1)


async def test_slow_first_byte_past_a_deadline_closes_the_connection():
    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        while await srv.request(reader, n):
            if n == 1:
                await asyncio.sleep(0.5)  # too late: the client gave up at 0.05 s
            writer.write(ok())
            await writer.drain()

    async with RawServer(script) as srv:
        c = UpstreamClient()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await c.post(srv.url, b"{}")
        await settle(c, 0, 0)  # the late answer's connection is closed, not pooled
        resp = await c.post(srv.url, b"{}")  # a new connection gets the next answer, not the late one
        assert await resp.read() == OK_BODY
        assert srv.connections == 2


async def test_idle_connection_closed_by_the_server_is_not_reused():
    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        await srv.request(reader, n)
        writer.write(ok())
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()  # its keep-alive timer: idle close after the answer

    async with RawServer(script) as srv:
        c = UpstreamClient()
        for i in range(3):
            resp = await c.post(srv.url, b"{}")
            assert await resp.read() == OK_BODY
            await asyncio.sleep(0.2)
        assert srv.connections == 3 and len(srv.requests) == 3  # every request read once, on a new connection
        await settle(c, 0, 0)


async def test_stale_connection_found_by_peek_is_discarded_before_writing():
    """The server's FIN reached this host but not yet the event loop: the pre-write peek sees it."""
    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        await srv.request(reader, n)
        writer.write(ok())
        await writer.drain()
        writer.close()

    async with RawServer(script) as srv:
        c = UpstreamClient()
        resp = await c.post(srv.url, b"{}")
        assert await resp.read() == OK_BODY
        conn = c._pools[("127.0.0.1", int(srv.url.split(":")[2].split("/")[0]))].idle[-1]
        # wait for the FIN without letting the loop read it (the transport stops reading)
        conn.transport.pause_reading()
        await asyncio.sleep(0.1)
        assert not conn.closed and conn.peek_dead()
        resp = await c.post(srv.url, b"{}")
        assert await resp.read() == OK_BODY
        assert srv.connections == 2 and len(srv.requests) == 2


@pytest.mark.parametrize("check", ["poll", "peek_read"])
@pytest.mark.parametrize("then", ["nothing", "fin", "reset", "bytes"])
async def test_idle_connection_check_sees_what_the_server_did(monkeypatch, check, then):
    """``peek_dead`` on an idle pooled connection whose transport does not read (so the event loop
    cannot see the end first): alive while the server did nothing, dead after its FIN, its reset
    or unsolicited bytes. Expected from the server's script; the zero-timeout ``poll`` and the
    non-blocking ``MSG_PEEK`` read (the fallback, an independent way to ask) must both say so."""
    import balancer.service.upstream as up

    monkeypatch.setattr(up, "_HAVE_POLL", check == "poll")
    done = asyncio.Event()

    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        await srv.request(reader, n)
        writer.write(ok())
        await writer.drain()
        await done.wait()
        if then == "fin":
            writer.close()
        elif then == "reset":
            reset(writer)
        elif then == "bytes":
            writer.write(b"x")
            await writer.drain()
        await asyncio.sleep(1.0)

    async with RawServer(script) as srv:
        c = UpstreamClient()
        resp = await c.post(srv.url, b"{}")
        assert await resp.read() == OK_BODY
        conn = c._pools[("127.0.0.1", int(srv.url.split(":")[2].split("/")[0]))].idle[-1]
        conn.transport.pause_reading()
        assert not conn.peek_dead()  # idle and nothing pending
        done.set()
        await asyncio.sleep(0.1)
        assert not conn.closed
        assert conn.peek_dead() is (then != "nothing")
        conn.transport.resume_reading()
        await c.close()


async def test_reused_connection_reset_after_the_request_went_out_is_not_resent():
    """The engine resets a pooled connection as the second request arrives. Whether it read the
    request first cannot be told from the reset (an engine that reads it and then aborts with
    SO_LINGER 0 resets too), so the client never sends a written request again: the leg fails
    (UpstreamDisconnected, reset, before the answer) and the proxy's retry on a new route
    decides, as with aiohttp. Both scripts: reset with the request unread, and after reading it
    whole; the engine saw the second request at most once, on one connection."""
    for read_it in (False, True):
        async def script(reader, writer, n, srv, read_it=read_it):  # noqa: ANN001, ANN202
            await srv.request(reader, n)
            writer.write(ok())
            await writer.drain()
            if read_it:
                await srv.request(reader, n)  # the whole second request, then an abort
            else:
                await reader.readuntil(b"\r\n\r\n")  # its head only
            reset(writer)

        async with RawServer(script) as srv:
            c = UpstreamClient()
            assert await (await c.post(srv.url, b"{}")).read() == OK_BODY
            with pytest.raises(UpstreamDisconnected) as e:
                await c.post(srv.url, b'{"n": 2}')
            assert e.value.reset and e.value.before_response
            assert srv.connections == 1  # not resent on a new connection
            assert len(srv.requests) == (2 if read_it else 1)
            await settle(c, 0, 0)


async def test_reused_connection_closed_after_reading_the_request_is_not_retried():
    """EOF (not a reset) after the request was read: the engine may have processed it."""
    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        await srv.request(reader, n)
        writer.write(ok())
        await writer.drain()
        await srv.request(reader, n)  # reads the whole second request, then closes without answering
        writer.close()

    async with RawServer(script) as srv:
        c = UpstreamClient()
        assert await (await c.post(srv.url, b"{}")).read() == OK_BODY
        with pytest.raises(UpstreamDisconnected) as e:
            await c.post(srv.url, b"{}")
        assert e.value.before_response and not e.value.reset
        assert srv.connections == 1 and len(srv.requests) == 2
        await settle(c, 0, 0)


@pytest.mark.parametrize("answer", [ok(extra=b"Connection: close\r\n"),
                                    b"HTTP/1.0 200 OK\r\nContent-Length: 12\r\n\r\n" + OK_BODY,
                                    b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + OK_BODY])
async def test_connection_close_answers_are_read_and_not_pooled(answer):
    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        await srv.request(reader, n)
        writer.write(answer)
        await writer.drain()
        writer.close()

    async with RawServer(script) as srv:
        c = UpstreamClient()
        for _ in range(2):
            resp = await c.post(srv.url, b"{}")
            assert resp.status == 200 and await resp.read() == OK_BODY
        assert srv.connections == 2
        await settle(c, 0, 0)


async def test_interim_and_bodiless_answers():
    answers = [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + ok(),
               b"HTTP/1.1 204 No Content\r\nX-A: 1\r\n\r\n",
               b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n",  # 304: no body whatever it says
               ok(b"after")]
    it = iter(answers)

    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        while await srv.request(reader, n):
            writer.write(next(it))
            await writer.drain()

    async with RawServer(script) as srv:
        c = UpstreamClient()
        got = []
        for _ in answers:
            resp = await c.post(srv.url, b"{}")
            got.append((resp.status, await resp.read()))
        assert got == [(200, OK_BODY), (204, b""), (304, b""), (200, b"after")]
        assert srv.connections == 1  # all on one keep-alive connection
        await settle(c, 1, 1)


async def test_switching_protocols_is_a_protocol_error():
    async with RawServer(keepalive(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n")) as srv:
        c = UpstreamClient()
        with pytest.raises(UpstreamProtocolError):
            await c.post(srv.url, b"{}")
        await settle(c, 0, 0)


async def test_bytes_after_the_answer_keep_it_but_drop_the_connection():
    async with RawServer(keepalive(ok() + b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")) as srv:
        c = UpstreamClient()
        resp = await c.post(srv.url, b"{}")
        assert resp.status == 200 and await resp.read() == OK_BODY
        await settle(c, 0, 0)


async def test_cancelled_mid_body_closes_rather_than_pools():
    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        await srv.request(reader, n)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123")
        await writer.drain()
        await reader.read()  # until the client closes
        srv.eofs += 1

    async with RawServer(script) as srv:
        c = UpstreamClient()
        resp = await c.post(srv.url, b"{}")
        task = asyncio.create_task(resp.read())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        resp.release()
        await settle(c, 0, 0)
        await asyncio.sleep(0.05)
        assert srv.eofs == 1


async def test_close_wakes_a_pending_stream_read():
    """What the proxy does when a prefill leg fails while its decode leg streams."""
    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        await srv.request(reader, n)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\ndata: \r\n")
        await writer.drain()
        await reader.read()

    async with RawServer(script) as srv:
        c = UpstreamClient()
        resp = await c.post(srv.url, b"{}")
        it = resp.content.iter_any()
        assert await it.__anext__() == b"data: "
        asyncio.get_running_loop().call_later(0.05, resp.close)
        with pytest.raises(UpstreamDisconnected):
            await it.__anext__()
        resp.close()
        resp.release()  # both idempotent
        await settle(c, 0, 0)


async def test_limit_per_host_bounds_open_connections():
    active = {"now": 0, "max": 0}

    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        active["now"] += 1
        active["max"] = max(active["max"], active["now"])
        try:
            while await srv.request(reader, n):
                await asyncio.sleep(0.02)
                writer.write(ok())
                await writer.drain()
        finally:
            active["now"] -= 1

    async with RawServer(script) as srv:
        c = UpstreamClient(limit_per_host=2)

        async def one() -> bytes:
            resp = await c.post(srv.url, b"{}")
            return await resp.read()

        assert await asyncio.gather(*(one() for _ in range(10))) == [OK_BODY] * 10
        assert srv.connections == 2 and active["max"] == 2
        await settle(c, 2, 2)


async def test_idle_connections_expire_after_keepalive():
    async with RawServer(keepalive(ok())) as srv:
        c = UpstreamClient(keepalive_s=0.1)
        assert await (await c.post(srv.url, b"{}")).read() == OK_BODY
        await settle(c, 1, 1)
        await asyncio.sleep(0.3)
        await settle(c, 0, 0)


async def test_request_wire_format_and_header_injection():
    async with RawServer(keepalive(ok())) as srv:
        c = UpstreamClient()
        await (await c.post(srv.url, b'{"a": 1}', {"Content-Type": "application/json", "X-Request-Id": "r1"})).read()
        _, head, body = srv.requests[0]
        port = srv.url.split(":")[2].split("/")[0]
        assert head == (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                        "X-Request-Id: r1\r\nContent-Length: 8\r\n\r\n").encode()
        assert body == b'{"a": 1}'
        conn = next(iter(c._pools.values())).idle[-1]
        assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)  # no Nagle delay on the legs
        with pytest.raises(ValueError, match="line break"):
            await c.post(srv.url, b"{}", {"X-Request-Id": "a\r\nX-Evil: 1"})
        await settle(c, 1, 1)


async def test_unexpected_bytes_on_an_idle_connection_drop_it():
    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        await srv.request(reader, n)
        writer.write(ok())
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"garbage")  # unsolicited, while idle
        await writer.drain()
        while await srv.request(reader, n):
            writer.write(ok())
            await writer.drain()

    async with RawServer(script) as srv:
        c = UpstreamClient()
        assert await (await c.post(srv.url, b"{}")).read() == OK_BODY
        await asyncio.sleep(0.15)
        await settle(c, 0, 0)
        assert await (await c.post(srv.url, b"{}")).read() == OK_BODY
        assert srv.connections == 2


# ------------------------------------------------------------------ property: any split reassembles
class _FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False
        self.reading = True

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


def _wire(body: bytes, chunked: bool, sizes: list[int], interim: bool) -> bytes:
    out = b"HTTP/1.1 100 Continue\r\n\r\n" if interim else b""
    if not chunked:
        return out + b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    out += b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
    i = 0
    for n in sizes:
        if i >= len(body):
            break
        piece = body[i:i + n]
        out += b"%x;ext=1\r\n%s\r\n" % (len(piece), piece)
        i += n
    if i < len(body):
        out += b"%X\r\n%s\r\n" % (len(body) - i, body[i:])
    return out + b"0\r\nX-Trailer: t\r\n\r\n"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(min_size=0, max_size=3000), chunked=st.booleans(),
       sizes=st.lists(st.integers(1, 700), min_size=1, max_size=12),
       cuts=st.lists(st.integers(0, 4000), max_size=25), interim=st.booleans(), stream=st.booleans(),
       buffer=st.sampled_from([16, 1 << 20]))
def test_any_split_of_a_valid_answer_reassembles(body, chunked, sizes, cuts, interim, stream, buffer):
    wire = _wire(body, chunked, sizes, interim)
    points = sorted({min(c, len(wire)) for c in cuts} | {0, len(wire)})
    pieces = [wire[a:b] for a, b in zip(points, points[1:]) if b > a]

    async def run() -> tuple[int, str, bytes, bool]:
        client = UpstreamClient(stream_buffer_bytes=buffer)
        pool = _HostPool(client, "127.0.0.1", 80)
        conn = _Connection(pool)
        t = _FakeTransport()
        conn.connection_made(t)  # type: ignore[arg-type]
        pool.open = 1
        resp = conn.send(b"POST / HTTP/1.1\r\n\r\n", b"")

        async def feed() -> None:
            for p in pieces:
                await asyncio.sleep(0)
                conn.data_received(p)

        feeder = asyncio.create_task(feed())
        assert conn.head_fut is not None
        await conn.head_fut
        if stream:
            got = []
            async for chunk in resp.content.iter_any():
                assert chunk  # never an empty item
                got.append(chunk)
            data = b"".join(got)
        else:
            data = await resp.read()
        await feeder
        return resp.status, resp.headers.get("Content-Type"), data, pool.idle and pool.idle[-1] is conn

    status, ctype, data, pooled = asyncio.run(run())
    assert (status, ctype, data) == (200, "text/plain", body)
    assert pooled  # a complete keep-alive answer returns its connection


async def test_arrived_says_whether_the_whole_body_is_here():
    """``arrived()`` is true once the body ended (read then returns without waiting) or the
    connection failed, false while body bytes are still due (the script fixes which)."""
    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        await srv.request(reader, n)
        writer.write(ok())  # head and body in one write
        await writer.drain()
        await srv.request(reader, n)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n{\"ok\"")  # 5 of 12 bytes
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(b": true}")
        await writer.drain()
        await reader.read()

    async with RawServer(script) as srv:
        client = UpstreamClient()
        try:
            resp = await client.post(srv.url, b"{}")
            for _ in range(100):  # the body's bytes are in the head's segment or the next read
                if resp.arrived():
                    break
                await asyncio.sleep(0.01)
            assert resp.arrived()
            assert await resp.read() == OK_BODY
            resp = await client.post(srv.url, b"{}")
            assert not resp.arrived()  # 7 bytes due for 0.2 s
            assert await resp.read() == OK_BODY
            assert resp.arrived()
        finally:
            await client.close()


# ------------------------------------------------------------------ the proxy: same failure kinds with both clients
async def _proxy_case(script, client: str, router: dict | None = None) -> tuple[int, dict[str, float]]:
    async with RawServer(script) as srv:
        worker = srv.url.rsplit("/", 2)[0]
        cfg = ServiceConfig.model_validate({"pd_protocol": "none", "workers": [{"url": worker, "role": "mixed"}],
                                            "health_check": {"enabled": False}, "upstream_client": client,
                                            "retry": {"max_retries": 0}, **(router or {})})
        app = TestServer(create_app(cfg), host="127.0.0.1")
        await app.start_server()
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{app.port}/v1/completions",
                                  json={"prompt": "hi", "max_tokens": 2}) as r:
                    status = r.status
                    await r.read()
                async with s.get(f"http://127.0.0.1:{app.port}/metrics") as r:
                    text = await r.text()
        finally:
            await app.close()
    kinds = {m.group(1): float(m.group(2)) for m in
             re.finditer(r'pdlb_upstream_failures_total\{kind="([^"]+)"[^}]*\} ([0-9.]+)', text)}
    return status, kinds


def _answer_then(action: str):  # noqa: ANN202
    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        if not await srv.request(reader, n):
            return
        if action == "reset":
            reset(writer)
        elif action == "mid_body":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"id\":")
            await writer.drain()
            await asyncio.sleep(0.05)
            reset(writer)
        elif action in ("bad_chunk", "bad_chunk_with_head"):
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            if action == "bad_chunk":  # apart: the head is answered, the body fails
                await writer.drain()
                await asyncio.sleep(0.05)
            writer.write(b"zz\r\n")
            await writer.drain()
            await reader.read()
        elif action == "big_head":
            writer.write(b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 200_000 + b"\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            await reader.read()
        elif action == "slow":
            await asyncio.sleep(1.0)
        elif action == "stall_body":  # the head and part of the body in time, the rest never
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"id\":")
            await writer.drain()
            await asyncio.sleep(1.0)
        elif action == "503":
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 2\r\n\r\n{}")
            await writer.drain()
            await reader.read()
    return script


@pytest.mark.parametrize("action,status,kind,router", [
    ("reset", 502, "connect", None),
    ("mid_body", 502, "read", None),
    ("bad_chunk", 502, "read", None),
    ("bad_chunk_with_head", 502, "connect", None),  # in the head's own packet: the POST fails (both clients)
    ("big_head", 502, "connect", None),
    ("slow", 504, "first_byte_timeout", {"first_byte_timeout_s": 0.2}),
    # the proxy sets no timer for a body that came with its head (UpstreamResponse.arrived), but
    # one that has not keeps the deadline for the whole answer
    ("stall_body", 504, "first_byte_timeout", {"first_byte_timeout_s": 0.2}),
    ("503", 503, "http_503", None),
])
@pytest.mark.parametrize("client", ["lean", "aiohttp"])
async def test_proxy_failure_kinds_are_the_same_with_both_clients(client, action, status, kind, router):
    if client == "aiohttp" and action == "bad_chunk":
        # aiohttp 3.14 does not fail a read whose chunk size line is malformed after the head
        # arrived: it waits for its total timeout (seen here: 300 s), the router's request_timeout_s
        pytest.skip("aiohttp hangs on a malformed chunk after the head")
    got_status, kinds = await _proxy_case(_answer_then(action), client, router)
    assert (got_status, kinds) == (status, {kind: 1.0})


@pytest.mark.parametrize("client", ["lean", "aiohttp"])
async def test_proxy_engine_closing_idle_connections_costs_no_failure(client):
    """An engine that closes each keep-alive connection 50 ms after answering (uvicorn does after
    5 s): requests spaced wider all succeed, none counted as an upstream failure or retried."""
    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        while await srv.request(reader, n):
            body = json.dumps({"id": "x", "choices": [{"text": "ok"}]}).encode()
            writer.write(ok(body))
            await writer.drain()
            try:
                async with asyncio.timeout(0.05):
                    await reader.readuntil(b"\r\n\r\n")
            except TimeoutError:
                writer.close()
                return
            raise AssertionError("the test sends requests 200 ms apart")

    async with RawServer(script) as srv:
        cfg = ServiceConfig.model_validate({"pd_protocol": "none", "workers": [{"url": srv.url.rsplit("/", 2)[0],
                                                                               "role": "mixed"}],
                                            "health_check": {"enabled": False}, "upstream_client": client})
        app = TestServer(create_app(cfg), host="127.0.0.1")
        await app.start_server()
        try:
            async with aiohttp.ClientSession() as s:
                for _ in range(3):
                    async with s.post(f"http://127.0.0.1:{app.port}/v1/completions", json={"prompt": "hi"}) as r:
                        assert r.status == 200
                    await asyncio.sleep(0.2)
                async with s.get(f"http://127.0.0.1:{app.port}/metrics") as r:
                    text = await r.text()
        finally:
            await app.close()
        assert srv.connections == 3 and len(srv.requests) == 3
        assert "pdlb_upstream_failures_total{" not in text and "pdlb_retries_total{" not in text


async def test_proxy_connect_refused_with_the_lean_client():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    cfg = ServiceConfig.model_validate({"pd_protocol": "none", "workers": [{"url": f"http://127.0.0.1:{port}",
                                                                           "role": "mixed"}],
                                        "health_check": {"enabled": False}, "retry": {"max_retries": 0}})
    assert cfg.upstream_client == "lean"  # the default
    app = TestServer(create_app(cfg), host="127.0.0.1")
    await app.start_server()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{app.port}/v1/completions", json={"prompt": "hi"}) as r:
                assert r.status == 502 and "unreachable" in (await r.json())["error"]["message"]
            async with s.get(f"http://127.0.0.1:{app.port}/metrics") as r:
                assert 'pdlb_upstream_failures_total{kind="connect"' in await r.text()
    finally:
        await app.close()


async def test_proxy_sends_https_workers_through_aiohttp():
    """The lean client refuses https URLs; the proxy's legs to an https worker use the aiohttp
    session (a TLS handshake answered in plain text fails: aiohttp's connect error, 502)."""
    async def script(reader, writer, n, srv):  # noqa: ANN001, ANN202
        writer.write(ok())  # before the ClientHello is even read
        await writer.drain()
        await reader.read()

    async with RawServer(script) as srv:
        worker = srv.url.rsplit("/", 2)[0].replace("http://", "https://")
        cfg = ServiceConfig.model_validate({"pd_protocol": "none", "workers": [{"url": worker, "role": "mixed"}],
                                            "health_check": {"enabled": False}, "retry": {"max_retries": 0}})
        app = TestServer(create_app(cfg), host="127.0.0.1")
        await app.start_server()
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{app.port}/v1/completions", json={"prompt": "hi"}) as r:
                    assert r.status == 502 and "unreachable (Client" in (await r.json())["error"]["message"]
        finally:
            await app.close()
    c = UpstreamClient()
    with pytest.raises(ValueError, match="plain http"):
        await c.post("https://127.0.0.1:1/x", b"")


def test_errors_are_oserrors():
    """The proxy catches ``(aiohttp.ClientError, OSError)`` around both clients' calls."""
    for cls in (UpstreamConnectError, UpstreamConnectTimeout, UpstreamDisconnected, UpstreamProtocolError):
        assert issubclass(cls, UpstreamError) and issubclass(cls, OSError)
    assert not issubclass(UpstreamDisconnected, ConnectionResetError)  # the proxy's client-gone handler
    assert json.loads(OK_BODY) == {"ok": True}


async def test_bare_lf_line_endings_are_accepted_as_by_aiohttp():
    """An engine whose answer ends its head lines with LF alone (RFC 9112 sec. 2.2: a
    recipient MAY take a lone LF as a line terminator) was relayed by aiohttp's client and refused
    by the lean one (strict llhttp: 502 'unreachable'). Expected: aiohttp's reading, status 200 and
    the body, on both clients; the lean connection is then reused (the answer was complete)."""
    answer = b"HTTP/1.1 200 OK\nContent-Type: application/json\nContent-Length: %d\n\n" % len(OK_BODY) + OK_BODY
    async with RawServer(keepalive(answer)) as srv:
        async with aiohttp.ClientSession() as s:
            async with s.post(srv.url, data=b"{}") as r:
                assert (r.status, await r.read()) == (200, OK_BODY)
        c = UpstreamClient()
        try:
            for _ in range(2):
                resp = await c.post(srv.url, b"{}")
                assert (resp.status, resp.headers["content-type"], await resp.read()) == (200, "application/json", OK_BODY)
        finally:
            await c.close()
        assert srv.connections == 2  # one for aiohttp, one reused by the lean client
