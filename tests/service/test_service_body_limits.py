"""A declared request body over ``max_body_bytes`` is refused at once (413, connection closed),
with or without ``Expect: 100-continue`` (no ``100 Continue`` is sent for it), instead of the
router waiting ``body_read_timeout_s`` for a body it would refuse (a
``Content-Length: 999999999999`` with no body held the connection 30 s and then got 408). Raw
sockets, so that exactly what the router sends back is seen."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from sim.emulator.testing import inprocess_cluster

FAST = {"speed": 20.0}
LIMIT = 4096


async def _exchange(url: str, head: str, body: bytes | None = None, wait_continue: bool = False) -> tuple[bytes, float]:
    """Send ``head`` (and ``body`` after the first answer when ``wait_continue``); read until the
    router closes or 3 s pass; returns the bytes and the seconds to the first byte."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    t0 = time.monotonic()
    writer.write(head.encode())
    await writer.drain()
    first = await asyncio.wait_for(reader.read(4096), 5)
    took = time.monotonic() - t0
    out = first
    if wait_continue and first.startswith(b"HTTP/1.1 100") and body is not None:
        writer.write(body)
        await writer.drain()
    try:
        while not out.endswith(b"}") or out.startswith(b"HTTP/1.1 100") and out.count(b"HTTP/1.1") < 2:
            chunk = await asyncio.wait_for(reader.read(4096), 3)
            if not chunk:
                break
            out += chunk
    except asyncio.TimeoutError:
        pass
    writer.close()
    return out, took


def _head(url: str, length: int, expect: bool = False) -> str:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {url.removeprefix('http://')}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n"
            + ("Expect: 100-continue\r\n" if expect else "") + "\r\n")


@pytest.mark.parametrize("expect", [False, True])
async def test_a_declared_body_over_the_limit_gets_413_at_once_and_the_connection_closed(expect: bool):
    async with inprocess_cluster("none", engine=FAST, router={"max_body_bytes": LIMIT}) as c:
        out, took = await _exchange(c.url, _head(c.url, 999_999_999_999, expect))
        assert out.startswith(b"HTTP/1.1 413 "), out[:200]  # no "100 Continue" first
        assert b"Connection: close" in out.split(b"\r\n\r\n")[0]
        assert b"request body too large (limit 4096 bytes)" in out
        assert took < 2.0  # body_read_timeout_s is 30 s: it was not waited for
        async with aiohttp.ClientSession() as s:
            metrics = await (await s.get(c.url + "/metrics")).text()
        assert 'pdlb_requests_total{endpoint="/v1/completions",status="413"} 1.0' in metrics


async def test_expect_100_continue_within_the_limit_is_continued_and_served():
    body = b'{"model": "m", "prompt": "hello there", "max_tokens": 2}'
    async with inprocess_cluster("none", engine=FAST, router={"max_body_bytes": LIMIT}) as c:
        out, _ = await _exchange(c.url, _head(c.url, len(body), expect=True), body, wait_continue=True)
        assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 "), out[:200]
        assert b'"completion_tokens": 2' in out or b'"completion_tokens":2' in out
        # exactly at the limit is allowed (the check is "over", as aiohttp's client_max_size)
        out, _ = await _exchange(c.url, _head(c.url, LIMIT, expect=True), b" " * (LIMIT - len(body)) + body,
                                 wait_continue=True)
        assert out.startswith(b"HTTP/1.1 100 Continue"), out[:200]
        assert b"HTTP/1.1 413" not in out


def _chunked(url: str, body: bytes) -> str:
    """A chunked request carrying ``body`` in 1000-byte chunks, the last chunk included (the whole
    body arrives with the head: the router reads it without waiting)."""
    parts = [body[i:i + 1000] for i in range(0, len(body), 1000)]
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {url.removeprefix('http://')}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            + "".join(f"{len(p):x}\r\n{p.decode()}\r\n" for p in parts) + "0\r\n\r\n")


async def test_a_chunked_body_over_the_limit_gets_413_and_one_within_it_is_served():
    # no Content-Length to refuse at once: the router reads the body that arrived and checks its
    # length itself (the limit aiohttp's request.read() applied as client_max_size)
    prompt = "hello there " * 400  # a valid JSON body of ~4.9 KB: over the 4096-byte limit
    big = f'{{"model": "m", "prompt": "{prompt}", "max_tokens": 2}}'.encode()
    small = b'{"model": "m", "prompt": "hello there", "max_tokens": 2}'
    assert len(big) > LIMIT
    async with inprocess_cluster("none", engine=FAST, router={"max_body_bytes": LIMIT}) as c:
        out, _ = await _exchange(c.url, _chunked(c.url, big))
        assert out.startswith(b"HTTP/1.1 413 "), out[:200]
        assert b"request body too large (limit 4096 bytes)" in out
        out, _ = await _exchange(c.url, _chunked(c.url, small))
        assert out.startswith(b"HTTP/1.1 200 "), out[:200]
        assert b'"completion_tokens": 2' in out or b'"completion_tokens":2' in out
