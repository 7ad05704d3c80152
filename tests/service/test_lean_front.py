"""The lean HTTP front (``http_front: lean``, :mod:`balancer.service.lean_front`).

The reference is aiohttp's own server (an implementation nobody here wrote): the same raw bytes are
sent to the same router config served by ``http_front: aiohttp`` and by ``http_front: lean``, and
the answers compared (status codes in order, which headers, bodies less per-request ids), by class
of malformed or unusual request (a fault matrix: truncated, oversized, bad chunked encoding,
pipelined, slowloris, ...) and by a fuzzer of mutated requests. Besides: the lean path really serves
the common request (its protocol holds the connection), a client disconnect cancels the request,
a streamed answer waits for a slow reader (backpressure), and shutdown drains.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from balancer.service.app import SERVICE, create_app, json_parser_errors, limit_connections, make_runner
from balancer.service.config import ServiceConfig
from balancer.service.lean_front import MAX_HEAD_BYTES, LeanProtocol, LeanStream, response_bytes
from sim.emulator.testing import inprocess_cluster

BODY = json.dumps({"model": "emu", "prompt": "hello " * 20, "max_tokens": 3}).encode()


def post(body: bytes = BODY, path: str = "/v1/completions", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


@asynccontextmanager
async def fronts(workers: list[dict], **over):
    """The same router config served twice, on aiohttp's front and on the lean one: yields
    ``{"aiohttp": (port, service, runner), "lean": (...)}``."""
    out, runners = {}, []
    try:
        for front in ("aiohttp", "lean"):
            cfg = ServiceConfig.model_validate({"pd_protocol": "none", "workers": workers, "port": 0,
                                                "health_check": {"enabled": False}, "http_front": front, **over})
            app = create_app(cfg)
            runner = make_runner(app, cfg)
            await runner.setup()
            runners.append(runner)
            limit_connections(runner, cfg.max_connections)
            json_parser_errors(runner)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            out[front] = (runner.addresses[0][1], app[SERVICE], runner)
        yield out
    finally:
        for r in runners:
            await r.cleanup()


@asynccontextmanager
async def cluster_fronts(**over):
    async with inprocess_cluster("none", num_decode=1) as cluster:
        workers = [{"url": f"http://127.0.0.1:{e.port}", "role": "mixed"} for e in cluster.decode]
        async with fronts(workers, **over) as f:
            yield f


async def exchange(port: int, chunks: list[bytes], *, gap_s: float = 0.0, wait_s: float = 3.0) -> tuple[bytes, bool]:
    """Send ``chunks`` (``gap_s`` apart) on one connection, then read until the server closes it
    or ``wait_s`` passes: (what came back, whether the server closed)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    got = bytearray()
    closed = False
    try:
        for i, c in enumerate(chunks):
            if i and gap_s:
                await asyncio.sleep(gap_s)
            w.write(c)
            await w.drain()
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                data = await asyncio.wait_for(r.read(65536), left)
            except asyncio.TimeoutError:
                break
            except ConnectionError:
                closed = True
                break
            if not data:
                closed = True
                break
            got += data
    finally:
        w.close()
    return bytes(got), closed


def count_of(svc, endpoint: str, status: str) -> float:  # noqa: ANN001
    svc.metrics.flush()
    return svc.metrics.requests.labels(endpoint, status)._value.get()


_STATUS = re.compile(rb"HTTP/1\.[01] (\d{3}) ")


def answers(raw: bytes) -> list[tuple[int, frozenset, bytes]]:
    """Each answer in ``raw``: (status, header names less Date, body with ids and times blanked)."""
    out = []
    pos = 0
    while (m := _STATUS.search(raw, pos)) is not None:
        head_end = raw.find(b"\r\n\r\n", m.start())
        if head_end < 0:
            break
        head = raw[m.start():head_end].decode("latin-1").split("\r\n")[1:]
        names = {h.split(":", 1)[0].lower() for h in head}
        values = {h.split(":", 1)[0].lower(): h.split(":", 1)[1].strip() for h in head}
        start = head_end + 4
        if int(m.group(1)) < 200:  # 100 Continue: no body
            end, body = start, b""
        elif "content-length" in values:
            end = start + int(values["content-length"])
            body = raw[start:end]
        elif values.get("transfer-encoding") == "chunked":
            end = raw.find(b"0\r\n\r\n", start)
            end = len(raw) if end < 0 else end + 5
            body = b"<stream>"
        else:
            end, body = len(raw), raw[start:]
        body = re.sub(rb'"(id|created|rid|system_fingerprint)": ?("[^"]*"|\d+)', b"", body)
        body = re.sub(rb'"choices": ?\[.*\]', b"", body)
        # the parser's excerpt of the bad bytes depends on how they were split into reads
        body = re.sub(rb"(malformed HTTP request: [^:]*):.*", rb"\1", body, flags=re.S)
        out.append((int(m.group(1)), frozenset(names - {"date"}), body))
        pos = end
    return out


async def both(f: dict, chunks: list[bytes], **kw) -> dict:
    """The answers of each front to the same bytes, sent at the same time."""
    got = await asyncio.gather(*(exchange(f[name][0], chunks, **kw) for name in ("aiohttp", "lean")))
    return {name: (answers(raw), closed) for name, (raw, closed) in zip(("aiohttp", "lean"), got)}


# ---------------------------------------------------------------------- the lean path is used
async def test_the_common_request_is_served_by_the_lean_protocol_and_others_handed_to_aiohttp():
    async with cluster_fronts() as f:
        port, svc, runner = f["lean"]
        r, w = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(3):  # keep-alive: three requests on one connection
                w.write(post())
                await w.drain()
                head = await r.readuntil(b"\r\n\r\n")
                n = int(re.search(rb"Content-Length: (\d+)", head).group(1))
                await r.readexactly(n)
                assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            # the connection is still the lean protocol's
            assert [type(c).__name__ for c in runner.server.connections] == ["LeanProtocol"]
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # not a generation request: aiohttp's
            await w.drain()
            head = await r.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            n = int(re.search(rb"Content-Length: (\d+)", head).group(1))
            assert json.loads(await r.readexactly(n))["status"] == "ok"
            await asyncio.sleep(0)
            assert [type(c).__name__ for c in runner.server.connections] == ["JsonErrorHandler"]
            w.write(post())  # still served, by aiohttp now
            await w.drain()
            assert (await r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 OK\r\n")
        finally:
            w.close()
        # the metrics counted the lean path's requests as aiohttp's would (by hand: 4 completions)
        assert count_of(svc, "/v1/completions", "200") == 4.0


# ---------------------------------------------------------------------- fault matrix by class
GOOD = post()
CASES = {
    # the common cases
    "one request": [GOOD],
    "keep-alive twice": [GOOD, GOOD],
    "connection close": [post(extra="Connection: close\r\n")],
    "chat": [post(json.dumps({"model": "emu", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2}).encode(), "/v1/chat/completions")],
    "generate": [post(json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 2}}).encode(), "/generate")],
    "stream": [post(json.dumps({"model": "emu", "prompt": "hi", "max_tokens": 3, "stream": True}).encode())],
    "bad json": [post(b"{nope")],
    "not an object": [post(b"[1]")],
    "no prompt": [post(b'{"max_tokens": 2}')],
    "empty body": [post(b"")],
    "query string": [post(path="/v1/completions?x=1")],
    "unknown path": [post(path="/v1/other")],
    "GET on a generation path": [b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n"],
    "HTTP/1.0": [GOOD.replace(b"HTTP/1.1", b"HTTP/1.0", 1)],
    # truncated
    "head cut": [GOOD[:30]],
    "body cut": [GOOD[:-10]],
    "head cut then more": [GOOD[:30], GOOD[30:]],
    "body in two parts": [GOOD[:-10], GOOD[-10:]],
    # oversized
    "body over max_body_bytes": [post(b'{"prompt": "' + b"x" * 5000 + b'"}')],
    # the fault matrix's max_body_bytes is 4096: a body of exactly that many bytes is the lean front's
    # largest (it takes the body as is, where aiohttp's path reads and checks it: the same answer)
    # (padded with JSON whitespace: a long prompt would hit the shared engine's prefix cache on the second front)
    "body at max_body_bytes": [post(b'{"model": "emu", "max_tokens": 2, "prompt": "hi"}'.ljust(4096))],
    "declared over max_body_bytes": [post(extra="").replace(b"Content-Length: %d" % len(BODY), b"Content-Length: 999999")],
    "long header": [post(extra="X-Long: " + "a" * (MAX_HEAD_BYTES + 10) + "\r\n")],
    "many headers": [post(extra="".join(f"X-H{i}: v\r\n" for i in range(200)))],
    "long request line": [post(path="/v1/completions" + "a" * 9000)],
    # bad framing
    "bad chunked": [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n"],
    "chunked ok": [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                   + b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n"],
    "two content lengths": [post(extra="Content-Length: 5\r\n")],
    "length and chunked": [post(extra="Transfer-Encoding: chunked\r\n")],
    "negative length": [GOOD.replace(b"Content-Length: %d" % len(BODY), b"Content-Length: -1")],
    "bare LF": [GOOD.replace(b"\r\n", b"\n")],
    "space in header name": [post(extra="Bad Name: x\r\n")],
    "NUL in header": [post(extra="X-A: a\x00b\r\n")],
    "not HTTP": [b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40],
    "gzip body": [post(extra="Content-Encoding: gzip\r\n")],
    "expect continue": [post(extra="Expect: 100-continue\r\n")],
    "expect other": [post(extra="Expect: teapot\r\n")],
    # the Host header (RFC 9112 §3.2: a 400 for an HTTP/1.1 request without one or with two) and
    # the other singleton fields (RFC 9110 §5.5; aiohttp >= 3.13.4 refuses them given twice)
    "no Host": [GOOD.replace(b"Host: x\r\n", b"")],
    "two Hosts": [post(extra="Host: y\r\n")],
    "two Hosts, two spellings": [post(extra="HOST: y\r\n")],
    "two Content-Types": [post(extra="Content-Type: text/plain\r\n")],
    "two User-Agents": [post(extra="User-Agent: a\r\nUser-Agent: b\r\n")],
    # pipelined
    "pipelined three": [GOOD * 3],
    "pipelined then bad": [GOOD + b"GARBAGE\r\n\r\n"],
    "pipelined then health": [GOOD + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + GOOD],
    "pipelined close": [GOOD + post(extra="Connection: close\r\n") + GOOD],
}


#: where aiohttp's server is not the reference: it parses a whole pipeline before answering, and a
#: malformed request (or one after ``Connection: close``, which llhttp refuses) makes it answer one
#: 400 for the lot, the good request before it unanswered. The lean front answers each request in
#: order (RFC 9112 §9.3), the malformed one with aiohttp's 400, and nothing after a close (§9.6).
PIPELINE_BY_HAND = {"pipelined then bad": ([200, 400], True), "pipelined close": ([200, 200], True)}


@pytest.mark.parametrize("name", list(CASES))
async def test_fault_matrix_answers_as_aiohttp_does(name):
    async with cluster_fronts(max_body_bytes=4096, body_read_timeout_s=0.5, client_idle_timeout_s=1.0) as f:
        got = await both(f, CASES[name], gap_s=0.05, wait_s=2.5)
        if name in PIPELINE_BY_HAND:
            assert ([a[0] for a in got["aiohttp"][0]], got["aiohttp"][1]) == ([400], True)  # see above
            assert ([a[0] for a in got["lean"][0]], got["lean"][1]) == PIPELINE_BY_HAND[name]
            if name == "pipelined then bad":  # aiohttp's JSON 400 for the malformed one
                assert b"malformed HTTP request: Invalid method" in got["lean"][0][-1][2]
        else:
            assert got["lean"] == got["aiohttp"], (name, got)
        for _port, svc, _runner in f.values():
            assert svc.in_flight == 0


async def test_fault_matrix_statuses_by_hand():
    # what each class gets (independently of the comparison above: by the limits' definitions)
    async with cluster_fronts(max_body_bytes=4096, body_read_timeout_s=0.5, client_idle_timeout_s=2.0) as f:
        port = f["lean"][0]

        async def statuses(chunks: list[bytes], **kw) -> tuple[list[int], bool]:
            raw, closed = await exchange(port, chunks, **kw)
            return [a[0] for a in answers(raw)], closed

        assert await statuses([GOOD * 3], wait_s=1.5) == ([200, 200, 200], False)  # pipelined, kept alive
        assert await statuses([post(extra="Connection: close\r\n")]) == ([200], True)
        assert await statuses([GOOD[:-10]], wait_s=2.0) == ([408], True)  # body late: 408 and close
        assert await statuses([GOOD[:30]], wait_s=4.0) == ([], True)  # head never completes: closed (idle)
        assert (await statuses([post(b"x" * 5000)]))[0] == [413]
        assert (await statuses([CASES["bad chunked"][0]]))[0] == [400]
        assert (await statuses([CASES["long header"][0]]))[0][0] in (400, 431)
        # RFC 9112 §3.2: "A server MUST respond with a 400 (Bad Request) status code to any HTTP/1.1
        # request message that lacks a Host header field and to any request message that contains
        # more than one Host header field line"
        assert await statuses([CASES["no Host"][0]]) == ([400], True)
        assert await statuses([CASES["two Hosts"][0]]) == ([400], True)


async def test_slowloris_is_closed_after_the_idle_timeout():
    # one header byte every 0.2 s: the idle timeout (1 s) counts from the connection's start,
    # not from the last byte
    async with cluster_fronts(client_idle_timeout_s=1.0) as f:
        port = f["lean"][0]
        r, w = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        w.write(b"POST /v1/completions HTTP/1.1\r\n")
        closed_after = None
        for _ in range(40):
            try:
                w.write(b"X")
                await w.drain()
            except ConnectionError:
                closed_after = time.monotonic() - t0
                break
            try:
                data = await asyncio.wait_for(r.read(100), 0.2)
            except asyncio.TimeoutError:
                continue
            if data == b"":
                closed_after = time.monotonic() - t0
                break
        w.close()
        assert closed_after is not None and closed_after < 4.0, closed_after


# ---------------------------------------------------------------------- fuzzer
def _mutate(rng: random.Random, data: bytes) -> list[bytes]:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:  # flip a byte
            b[min(i, len(b) - 1)] = rng.randrange(256)
        elif op == 1:  # insert bytes
            b[i:i] = bytes(rng.choice([b"\r\n", b":", b" ", b"\x00", b"0", b"\n", b"chunked", b"Content-Length: 9\r\n"]))
        elif op == 2 and b:  # delete a span
            del b[i:i + rng.randint(1, 8)]
        elif op == 3:  # duplicate a span
            j = rng.randrange(len(b) + 1)
            b[i:i] = b[j:j + rng.randint(1, 30)]
        else:  # truncate
            del b[i:]
    out = bytes(b)
    if rng.random() < 0.3:  # pipelined after a good request
        out = GOOD + out
    if rng.random() < 0.3:  # cut in two sends
        k = rng.randrange(len(out) + 1)
        return [out[:k], out[k:]]
    return [out]


def _same_but_pipelining(got: dict) -> bool:
    """The lean front's answers are aiohttp's, or they differ only by aiohttp's pipelining (see
    :data:`PIPELINE_BY_HAND`): aiohttp answered the malformed request that ends a read with its
    400 and left unanswered the requests of that read before it, which the lean front answered
    in order (then the same 400); or, data after ``Connection: close``, aiohttp answered one 400
    where the lean front answered the requests up to the close."""
    if got["lean"] == got["aiohttp"]:
        return True
    (aio, aio_closed), (lean, lean_closed) = got["aiohttp"], got["lean"]
    if not (aio and lean and aio_closed and lean_closed):
        return False
    if aio[-1] == lean[-1] and len(lean) > len(aio) and lean[:len(aio) - 1] == aio[:-1]:
        return True
    return len(aio) == 1 and aio[0][0] == 400 and b"Data after `Connection: close`" in aio[0][2] and \
        all(a[0] == 200 for a in lean)


async def test_fuzzed_requests_get_the_answers_aiohttp_gives_and_the_router_stays_up():
    rng = random.Random(26)
    cases = [_mutate(rng, GOOD) for _ in range(60)]
    async with cluster_fronts(max_body_bytes=4096, body_read_timeout_s=0.5, client_idle_timeout_s=1.0) as f:
        differ = []
        for lo in range(0, len(cases), 12):  # 12 at a time
            got = await asyncio.gather(*(both(f, c, gap_s=0.02, wait_s=2.0) for c in cases[lo:lo + 12]))
            differ += [(c, g) for c, g in zip(cases[lo:lo + 12], got) if not _same_but_pipelining(g)]
        assert not differ, differ[:3]
        # still serving, nothing left in flight
        raw, _ = await exchange(f["lean"][0], [post(extra="Connection: close\r\n")])
        assert answers(raw)[0][0] == 200
        assert f["lean"][1].in_flight == 0


# ---------------------------------------------------------------------- disconnects, backpressure, shutdown
async def test_a_client_disconnect_cancels_the_request():
    async with inprocess_cluster("none", num_decode=1, engine={"speed": 2.0}) as cluster:  # slow engine: 0.5 s per token
        workers = [{"url": f"http://127.0.0.1:{e.port}", "role": "mixed"} for e in cluster.decode]
        async with fronts(workers) as f:
            port, svc, _ = f["lean"]
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(post(json.dumps({"model": "emu", "prompt": "hi", "max_tokens": 50, "stream": True}).encode()))
            await w.drain()
            await r.readuntil(b"\r\n\r\n")  # the stream began
            assert svc.in_flight == 1
            w.close()
            for _ in range(100):
                if svc.in_flight == 0:
                    break
                await asyncio.sleep(0.02)
            assert svc.in_flight == 0
            await asyncio.sleep(0.05)
            assert count_of(svc, "/v1/completions", "499") == 1.0


class _Transport:
    """A transport whose buffer is full until told otherwise (records writes)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return False


async def test_a_stream_waits_while_the_client_reads_slowly():
    class _Server:
        def connection_made(self, *a): pass  # noqa: E704, ANN002

        def connection_lost(self, *a): pass  # noqa: E704, ANN002

        def give_back(self) -> bool: return False  # noqa: E704

    proto = LeanProtocol(_Server(), None, {}, max_body_bytes=10, idle_timeout_s=5, body_timeout_s=5,  # type: ignore
                         body_timeout_answer=None)  # type: ignore[arg-type]
    proto.transport = _Transport()  # type: ignore[assignment]
    stream = LeanStream(proto, 200, {"Content-Type": "text/event-stream"}, True)
    proto.pause_writing()  # the transport's buffer went over its high-water mark
    writer = asyncio.ensure_future(stream.write(b"data: 1\n\n"))
    await asyncio.sleep(0.05)
    assert not writer.done()  # held until the client has read
    assert proto.transport.data.endswith(b"9\r\ndata: 1\n\n\r\n")  # written (the transport buffers), then waited
    proto.resume_writing()
    await asyncio.wait_for(writer, 1)
    await stream.write_eof()
    assert proto.transport.data.endswith(b"0\r\n\r\n")
    head = bytes(proto.transport.data).split(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Transfer-Encoding: chunked" in head


async def test_shutdown_waits_for_the_request_in_flight():
    async with inprocess_cluster("none", num_decode=1, engine={"speed": 0.05}) as cluster:  # a slow engine
        workers = [{"url": f"http://127.0.0.1:{e.port}", "role": "mixed"} for e in cluster.decode]
        async with fronts(workers, shutdown_timeout_s=20.0) as f:
            port, svc, runner = f["lean"]
            body = json.dumps({"model": "emu", "prompt": "hi", "max_tokens": 3, "stream": True}).encode()
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(post(body))
            await w.drain()
            await r.readuntil(b"\r\n\r\n")  # the stream began
            assert svc.in_flight == 1
            t0 = time.monotonic()
            await runner.cleanup()  # drains: the stream in flight ends, then the connection closes
            rest = await asyncio.wait_for(r.read(), 5)
            w.close()
            assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), rest[-200:]  # the whole stream
            assert svc.in_flight == 0 and time.monotonic() - t0 < 20.0


def test_response_bytes_frame_the_body_as_aiohttp_does():
    resp = web.json_response({"a": 1}, status=404, headers={"X-Request-Id": "r1"})
    raw = response_bytes(resp, keep_alive=False)
    head, body = raw.split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 404 Not Found"
    assert b"Content-Length: 8" in lines and b"Connection: close" in lines and b"X-Request-Id: r1" in lines
    assert b"Content-Type: application/json; charset=utf-8" in lines
    assert body == b'{"a": 1}'
    with pytest.raises(ValueError):
        response_bytes(web.Response(body=b"x", headers={"X-Evil": "a\r\nSet-Cookie: b"}), True)


# ---------------------------------------------------------------------- event loop default
def test_the_event_loop_is_uvloop_where_installed_else_asyncio(monkeypatch):
    import sys

    from balancer.service.launch import event_loop_factory

    uvloop = pytest.importorskip("uvloop")  # in the serve extra
    assert event_loop_factory("auto") is uvloop.new_event_loop
    assert event_loop_factory("uvloop") is uvloop.new_event_loop
    assert event_loop_factory("asyncio") is None
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not installed: import fails
    assert event_loop_factory("auto") is None
    with pytest.raises(ValueError, match="needs the 'uvloop' package"):
        event_loop_factory("uvloop")
    with pytest.raises(ValueError, match="unknown event loop"):
        event_loop_factory("trio")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("front", ["aiohttp", "lean"])
def test_pdlb_serve_on_each_loop_and_front_serves_and_hands_over(loop, front):
    # the standard loop stays tested in a real pdlb serve (the default is uvloop where installed)
    import urllib.request

    from sim.emulator.testing import _spawn, spawn_engines

    pytest.importorskip("uvloop")
    engines = spawn_engines([("mixed", "--zero-delay")])
    try:
        r = _spawn(["serve", "--port", "0", "--pd-protocol", "none", "--mixed", engines[0].url, "--processes", "1",
                    "--event-loop", loop, "--http-front", front])
        try:
            for _ in range(3):
                req = urllib.request.Request(r.url + "/v1/completions", data=BODY,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=10) as resp:
                    assert resp.status == 200 and json.loads(resp.read())["object"] == "text_completion"
            with urllib.request.urlopen(r.url + "/health", timeout=10) as resp:
                assert json.loads(resp.read())["status"] == "ok"
        finally:
            r.stop()
    finally:
        for e in engines:
            e.stop()
