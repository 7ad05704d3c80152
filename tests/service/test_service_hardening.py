"""Router hardening, round 2 (issue 25): no client can freeze, bloat or crash the router.

Fast tests, one or more per item of the issue; the "Done when" test (a ``/health`` probe and the
router's RSS while each hostile action runs against a real ``pdlb serve``) is
``tests/service/test_service_hostile.py`` (slow).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import re
import time
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from balancer.router import Router
from balancer.service.app import SERVICE, create_app, json_parser_errors, make_runner
from balancer.service.body_offload import (ELIDE_VALUE_BYTES, MAX_TOP_LEVEL_FIELDS, OFFLOAD_BODY_BYTES, Analysis,
                                           Elided, analyze, encode_body)
from balancer.service.config import ServiceConfig, WorkerConfig
from balancer.service.metrics import PER_RANK_SERIES_MAX
from balancer.service.prompt import PromptHasher, extract_prompt
from balancer.service.proxy import MAX_SSE_LINE_BYTES, _LineTooLong, _SwapLines, encode_with
from balancer.service.request_checks import parse_json_body
from balancer.service.workers import MAX_REPLICAS, WorkerPool
from sim.emulator.hostile import _fake_app
from sim.emulator.testing import inprocess_cluster

FAST = {"speed": 50.0}


@asynccontextmanager
async def served(cfg: ServiceConfig):
    """The app for ``cfg`` on ``pdlb serve``'s own runner (no request decompression, JSON parser
    errors), on 127.0.0.1; yields its URL and service."""
    app = create_app(cfg)
    runner = make_runner(app, cfg)
    await runner.setup()
    json_parser_errors(runner)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", app[SERVICE]
    finally:
        await runner.cleanup()


@asynccontextmanager
async def fake_engines(n: int):
    """``n`` in-process fake engines (:func:`sim.emulator.hostile._fake_app`): (servers, states)."""
    servers = [TestServer(_fake_app(), host="127.0.0.1") for _ in range(n)]
    for s in servers:
        await s.start_server()
    try:
        yield servers
    finally:
        for s in servers:
            await s.close()


async def _raw(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    r, w = await asyncio.open_connection(host, int(port))
    w.write(data)
    await w.drain()
    out = await asyncio.wait_for(r.read(), 5)
    w.close()
    return out


# ---------------------------------------------------------------------- item 1: memory
async def test_a_failed_large_request_leaves_no_reference_to_its_body(monkeypatch):
    # the legs' tasks hold their exceptions, whose tracebacks hold the frames that hold the body:
    # the attempt drops them, so with the collector off the body is freed by reference counting
    import gc
    import weakref

    freed = []

    class Body(dict):  # a dict subclass can be weakly referenced (the parsed body sits beside the raw one)
        pass

    async with fake_engines(3) as engines:
        workers = [{"url": f"http://127.0.0.1:{engines[0].port}", "role": "prefill", "bootstrap_port": 1},
                   *({"url": f"http://127.0.0.1:{e.port}", "role": "decode"} for e in engines[1:])]
        cfg = ServiceConfig.model_validate({"pd_protocol": "sglang", "workers": workers, "port": 0,
                                            "health_check": {"enabled": False}, "retry": {"max_retries": 0}})
        async with served(cfg) as (url, svc), aiohttp.ClientSession() as s:
            for e in engines:
                await s.post(f"http://127.0.0.1:{e.port}/fake/mode", json={"mode": "reject"})
            from aiohttp.test_utils import make_mocked_request

            for rid in (None, "mine"):  # with a client rid the legs' bodies are re-encoded
                body = Body({"prompt": "x" * 2000, "max_tokens": 2, **({"rid": rid} if rid else {})})
                raw = json.dumps(body).encode()
                ref = weakref.ref(body, lambda _: freed.append(1))
                gc.disable()
                try:
                    req = make_mocked_request("POST", "/v1/completions", headers={"Content-Type": "application/json"})
                    resp = await svc.proxy.handle(req, "completions", body, raw)
                    assert resp.status == 400  # the engines' refusal, relayed
                    del body, raw, resp, req
                    await asyncio.sleep(0.05)  # the aborts' background tasks end
                    assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]
                finally:
                    gc.enable()
            assert freed == [1, 1]


# ---------------------------------------------------------------------- item 2: work off the event loop
def _hasher() -> PromptHasher:
    return PromptHasher(16)


def test_analyze_matches_the_event_loop_path():
    # expected values: the on-loop path (json.loads + extract_prompt + PromptHasher.hash) on the same body
    body = {"prompt": list(range(5000)), "max_tokens": 7, "rid": "mine", "logit_bias": {str(i): 1 for i in range(300)},
            "stream": False, "model": "m"}
    raw = json.dumps(body).encode()
    a = analyze(raw, "completions", None, 4096, 16, _hasher(), {})
    assert isinstance(a, Analysis)
    n, hashes = _hasher().hash(extract_prompt("completions", body))
    assert (a.n_tokens, a.hashes, a.max_out, a.client_id, a.tokenized, a.raw) == (5000, tuple(hashes), 7, "mine", True, None)
    # small values are values; large ones spans of raw whose bytes parse to the value
    assert {k: v for k, v in a.body.items() if type(v) is not Elided} == {"max_tokens": 7, "rid": "mine", "stream": False,
                                                                           "model": "m"}
    for key in ("prompt", "logit_bias"):
        span = a.body[key]
        assert type(span) is Elided and span.end - span.start > ELIDE_VALUE_BYTES
        assert json.loads(raw[span.start:span.end]) == body[key]


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b'{"prompt": NaN}', b'{"a": 1} x', b"\xff\xfe\x00", b'{"a" 1}',
                                 b"[" * 100_000 + b"]" * 100_000, b'{"prompt": "x",}', b'\xef\xbb\xbf{"prompt": "x"}'])
def test_analyze_refuses_what_the_event_loop_path_refuses(raw):
    out = analyze(raw, "completions", None, 4096, 16, _hasher(), {})
    try:  # the on-loop parser's verdict (an independent implementation: json.loads underneath)
        doc = parse_json_body(raw)
    except (ValueError, UnicodeDecodeError) as e:
        assert out == f"invalid JSON body: {str(e)[:200]}"
    else:
        if isinstance(doc, dict):  # a UTF-8 BOM: accepted on both paths, forwarded without it
            assert isinstance(out, Analysis) and json.loads(out.raw) == doc
        else:
            assert out == "the JSON body must be an object"


def test_analyze_checks_and_bounds_the_body():
    many = {f"f{i}": 1 for i in range(MAX_TOP_LEVEL_FIELDS + 1)} | {"prompt": "x"}
    assert analyze(json.dumps(many).encode(), "completions", None, 4096, 16, _hasher(), {}) == \
        f"the JSON body has more than {MAX_TOP_LEVEL_FIELDS} top-level fields"
    assert "set by the router" in analyze(b'{"prompt": "x", "bootstrap_host": "h"}', "completions", None, 4096, 16,
                                          _hasher(), {})
    # duplicate keys: the last wins, as json.loads has it
    a = analyze(b'{"prompt": "a", "max_tokens": 1, "max_tokens": 3}', "completions", None, 4096, 16, _hasher(), {})
    assert a.max_out == 3 == json.loads(b'{"max_tokens": 1, "max_tokens": 3}')["max_tokens"]


def test_a_utf16_body_comes_back_as_utf8_with_spans_into_it():
    body = {"prompt": "é✓" * 2000, "max_tokens": 2}
    raw = json.dumps(body, ensure_ascii=False).encode("utf-16")
    a = analyze(raw, "completions", None, 4096, 16, _hasher(), {})
    assert a.raw is not None and json.loads(a.raw) == body
    span = a.body["prompt"]
    assert json.loads(a.raw[span.start:span.end]) == body["prompt"]
    # non-ASCII UTF-8: spans are byte offsets (a character is 2-3 bytes)
    raw8 = json.dumps(body, ensure_ascii=False).encode()
    a8 = analyze(raw8, "completions", None, 4096, 16, _hasher(), {})
    s = a8.body["prompt"]
    assert a8.raw is None and raw8[s.start:s.end].decode() == json.dumps(body["prompt"], ensure_ascii=False)


def test_encode_body_copies_elided_values_from_raw():
    body = {"prompt": "p" * 3000, "rid": "client", "n": 1}
    raw = json.dumps(body).encode()
    light = analyze(raw, "completions", None, 4096, 16, _hasher(), {}).body
    # expected: json.dumps of the full body with the same changes (independent of the splicing)
    changed = {**light, "rid": "pdlb-x", "bootstrap_room": 5}
    changed.pop("n")
    assert json.loads(encode_body(changed, raw)) == {"prompt": body["prompt"], "rid": "pdlb-x", "bootstrap_room": 5}
    assert json.loads(encode_with(raw, light, {"rid": "pdlb-y"})) == {**body, "rid": "pdlb-y"}
    assert json.loads(encode_with(raw, light, {"bootstrap_room": 9})) == {**body, "bootstrap_room": 9}


async def test_a_large_body_is_served_through_the_worker_process_and_forwarded_unchanged():
    prompt = "big prompt " * (OFFLOAD_BODY_BYTES // 10)
    async with inprocess_cluster("sglang", num_prefill=1, num_decode=1, engine=FAST,
                                 router={"max_body_bytes": 4 * OFFLOAD_BODY_BYTES}) as c, aiohttp.ClientSession() as s:
        svc = c.router.app[SERVICE]
        for rid in (None, "client-1"):  # with a client rid, the legs re-encode: elided values copied from raw
            body = {"prompt": prompt, "max_tokens": 2, **({"rid": rid} if rid else {})}
            r = await s.post(c.url + "/v1/completions", json=body)
            assert r.status == 200, await r.text()
            assert (await r.json())["choices"][0]["text"]
        assert svc.offload.pids(), "the body was not parsed in the worker process"
        # a bad large body: the same 400 as on the event loop
        r = await s.post(c.url + "/v1/completions", data=b'{"prompt": "' + b"x" * OFFLOAD_BODY_BYTES + b'"',
                         headers={"Content-Type": "application/json"})
        assert r.status == 400 and "invalid JSON body" in (await r.json())["error"]["message"]


# ---------------------------------------------------------------------- item 3: compressed bodies
@pytest.mark.parametrize("encoding,data", [("gzip", gzip.compress(b'{"prompt": "' + b"a" * 1_000_000 + b'"}')),
                                           ("gzip", b"\x1f\x8b this is not gzip"), ("deflate", b"\x00\x01"),
                                           ("br", b"zz"), ("GZIP", b"\x1f\x8b")])
async def test_a_compressed_body_gets_415_unread(encoding, data):
    async with fake_engines(1) as (engine,):
        cfg = ServiceConfig.model_validate({"pd_protocol": "none", "port": 0, "health_check": {"enabled": False},
                                            "workers": [{"url": f"http://127.0.0.1:{engine.port}", "role": "mixed"}]})
        async with served(cfg) as (url, _), aiohttp.ClientSession(auto_decompress=False) as s:
            r = await s.post(url + "/v1/completions", data=data,
                             headers={"Content-Encoding": encoding, "Content-Type": "application/json"})
            err = (await r.json())["error"]
            assert r.status == 415 and "Content-Encoding" in err["message"]
            assert r.headers["Accept-Encoding"] == "identity"
            health = await (await s.get(f"http://127.0.0.1:{engine.port}/health")).json()
            assert health["requests"] == 0  # nothing reached the engine
            # identity is no encoding: served
            r = await s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                             headers={"Content-Encoding": "identity"})
            assert r.status == 200


# ---------------------------------------------------------------------- item 4: malformed credentials
@pytest.mark.parametrize("credential", [b"Bearer s3cret\xff", b"Bearer \xc3\x28", b"Basic \xff\xfe", b"Bearer",
                                        b"bearer s3cret", b"Bearer  s3cret", b"Bearer s3cr\xc3\xa9t"])
async def test_any_malformed_credential_is_401(credential):
    cfg = ServiceConfig.model_validate({"pd_protocol": "none", "port": 0, "admin_api_key": "s3cret",
                                        "health_check": {"enabled": False}})
    async with served(cfg) as (url, _):
        out = await _raw(url, b"GET /workers HTTP/1.1\r\nHost: x\r\nAuthorization: " + credential +
                         b"\r\nConnection: close\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 401"), out[:200]
        ok = await _raw(url, b"GET /workers HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\nConnection: close\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200")


# ---------------------------------------------------------------------- item 5: admin at scale
def test_registering_many_ranks_costs_the_same_each_time():
    # before: each rank registered walked every other rank (the global index bound's share):
    # 4,096 ranks next to 12k others took 3 s, each add slower than the last
    pool = WorkerPool(Router(index_total_capacity_blocks=1 << 22), ServiceConfig().circuit_breaker,
                      ServiceConfig().health_check)
    took = []
    for i in range(MAX_REPLICAS // 1024):
        t0 = time.perf_counter()
        pool.add(WorkerConfig(url=f"http://10.0.0.{i}:9", role="decode", dp_size=1024))
        took.append(time.perf_counter() - t0)
    assert pool.num_replicas == MAX_REPLICAS
    # linear: the last adds cost about what the first did (quadratic made the 16th ~16x the first);
    # medians of 4 against noise on a busy machine
    first, last = sorted(took[:4])[2], sorted(took[-4:])[2]
    assert last < 4 * first + 0.02, took


async def test_metrics_of_a_large_fleet_are_per_worker_and_rendered_at_most_once_a_second():
    cfg = ServiceConfig.model_validate({"pd_protocol": "none", "port": 0, "health_check": {"enabled": False}})
    async with served(cfg) as (url, svc), aiohttp.ClientSession() as s:
        for i in range(66):
            svc.pool.add(WorkerConfig(url=f"http://10.0.{i}.1:9", role="mixed", dp_size=16))
        assert svc.pool.num_replicas > PER_RANK_SERIES_MAX
        text = await (await s.get(url + "/metrics")).text()
        ranks = re.findall(r'pdlb_worker_in_flight_requests\{dp_rank="([^"]+)"', text)
        assert len(ranks) == 66 and set(ranks) == {"all"}  # one series per worker, not 1,056
        svc.pool.add(WorkerConfig(url="http://10.1.0.1:9", role="mixed"))
        again = await (await s.get(url + "/metrics")).text()
        assert "10.1.0.1" not in again  # the render of < 1 s ago
        await asyncio.sleep(1.05)
        assert "10.1.0.1" in await (await s.get(url + "/metrics")).text()


async def test_an_admin_body_over_64_kib_is_413():
    cfg = ServiceConfig.model_validate({"pd_protocol": "none", "port": 0, "health_check": {"enabled": False}})
    async with served(cfg) as (url, _), aiohttp.ClientSession() as s:
        body = {"url": "http://10.0.0.1:9", "role": "mixed", "pad": "x" * 70_000}
        r = await s.post(url + "/workers", json=body)
        assert r.status == 413


# ---------------------------------------------------------------------- item 6: SSE line buffers
def _reference_swap(chunks: list[bytes], swap: tuple[bytes, bytes]) -> bytes:
    """The whole stream with the id swapped in complete lines (an independent, quadratic-free
    statement of what the relay must produce, its incomplete last line swapped at the end)."""
    data = b"".join(chunks)
    return data.replace(*swap)


@pytest.mark.parametrize("seed", range(5))
def test_swap_lines_equals_a_whole_stream_replace(seed):
    import random

    rng = random.Random(seed)
    swap = (b"pdlb-abc", b"client-1")
    stream = b"".join(b'data: {"id": "pdlb-abc", "t": "%d"}\n\n' % i for i in range(200)) + b'data: {"id": "pdlb-abc"'
    cuts = sorted(rng.sample(range(1, len(stream)), 60))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    lines = _SwapLines(lambda data: data.replace(*swap))
    out = b"".join(lines.feed(c) for c in chunks) + lines.rest()
    assert out == _reference_swap(chunks, swap)


def test_swap_lines_is_linear_and_bounded():
    lines = _SwapLines(lambda data: data.replace(b"a", b"b"))
    piece = b"x" * 4096
    t0 = time.perf_counter()
    with pytest.raises(_LineTooLong):
        for _ in range(MAX_SSE_LINE_BYTES // len(piece) + 2):
            assert lines.feed(piece) == b""
    took = time.perf_counter() - t0
    # 1,025 chunks: linear is ~1 ms; re-joining per chunk copied ~2 GB (seconds)
    assert took < 0.5
    assert lines.held_bytes <= MAX_SSE_LINE_BYTES + len(piece)


async def test_an_endless_sse_line_ends_the_stream_with_an_error():
    async with fake_engines(1) as (engine,), aiohttp.ClientSession() as s:
        await s.post(f"http://127.0.0.1:{engine.port}/fake/mode", json={"mode": "sse_no_newline",
                                                                         "sse_bytes": 3 * MAX_SSE_LINE_BYTES})
        cfg = ServiceConfig.model_validate({"pd_protocol": "none", "port": 0, "health_check": {"enabled": False},
                                            "workers": [{"url": f"http://127.0.0.1:{engine.port}", "role": "mixed"}]})
        async with served(cfg) as (url, svc):
            t0 = time.process_time()
            r = await s.post(url + "/v1/completions", json={"prompt": "x", "stream": True, "rid": "mine"})
            data = await r.read()
            assert r.status == 200
            events = [ln[6:] for ln in data.splitlines() if ln.startswith(b"data: ")]
            assert events[-1] == b"[DONE]"  # after the error event, as SGLang's servers end theirs
            last = json.loads(events[-2])
            assert last["error"]["code"] == 502 and "SSE line over" in last["error"]["message"]
            assert len(data) < 4096  # nothing of the unfinished line was relayed
            assert time.process_time() - t0 < 2.0
            text = svc.metrics.render(svc.router, svc.pool).decode()
            assert 'kind="sse_line_too_long"' in text


# ---------------------------------------------------------------------- item 7: log amplification
async def test_malformed_requests_log_one_short_line_per_10_s(caplog):
    cfg = ServiceConfig.model_validate({"pd_protocol": "none", "port": 0, "health_check": {"enabled": False}})
    caplog.set_level(logging.DEBUG)
    async with served(cfg) as (url, _):
        for _ in range(200):
            out = await _raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}")
            assert out.split(b" ", 2)[1] == b"400", out[:100]
        lines = [r for r in caplog.records if r.name.startswith(("pdlb", "aiohttp"))]  # before shutdown's
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert "malformed HTTP request" in lines[0].getMessage() and lines[0].exc_info is None
    assert len(lines[0].getMessage()) < 300


def test_rate_limited_log_counts_what_it_left_out(caplog):
    from balancer.service.log_limit import RateLimitedLog

    log = logging.getLogger("pdlb.test")
    lim = RateLimitedLog(log, interval_s=10.0)
    caplog.set_level(logging.INFO, "pdlb.test")
    assert lim.log(logging.INFO, "k", 0.0, "bad %s", "one")
    assert not any(lim.log(logging.INFO, "k", t, "bad") for t in (1.0, 5.0, 9.9))
    assert lim.log(logging.INFO, "other", 2.0, "other kind")  # kinds are limited apart
    assert lim.log(logging.INFO, "k", 10.0, "bad again")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["bad one", "other kind", "bad again (3 similar lines left out in the last 10 s)"]


# ---------------------------------------------------------------------- item 8: wedged engine
async def test_a_wedged_non_streaming_engine_is_retried_elsewhere_and_charged():
    router = {"nonstream_timeout_s": 0.3, "nonstream_timeout_per_token_s": 0.0, "retry": {"initial_backoff_s": 0.001},
              "circuit_breaker": {"failure_threshold": 2}}
    async with inprocess_cluster("none", num_decode=2, engine=FAST, router=router) as c, aiohttp.ClientSession() as s:
        wedged = c.decode[0]
        await s.post(f"http://127.0.0.1:{wedged.port}/emulator/faults", json={"hang": True})
        svc = c.router.app[SERVICE]
        w = svc.pool.get(f"http://127.0.0.1:{wedged.port}")
        sent = 0
        while w.breaker.state.name != "OPEN":  # each request that met it charged it once
            assert sent < 20, "the wedged engine's breaker never opened"
            t0 = time.monotonic()
            r = await s.post(c.url + "/v1/completions", json={"prompt": f"hello {sent}", "max_tokens": 2})
            sent += 1
            assert r.status == 200  # served by the other engine
            assert time.monotonic() - t0 < 0.3 + 1.5  # at most one 0.3 s wait, not request_timeout_s
        text = svc.metrics.render(svc.router, svc.pool).decode()
        assert re.search(r'pdlb_upstream_failures_total\{kind="first_byte_timeout",worker="[^"]+"\} 2\.0', text)


async def test_a_request_timeout_charges_the_legs_that_never_answered():
    router = {"nonstream_timeout_s": None, "request_timeout_s": 0.4, "retry": {"max_retries": 0}}
    async with inprocess_cluster("none", num_decode=1, engine=FAST, router=router) as c, aiohttp.ClientSession() as s:
        eng = c.decode[0]
        await s.post(f"http://127.0.0.1:{eng.port}/emulator/faults", json={"hang": True})
        r = await s.post(c.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert r.status == 504
        svc = c.router.app[SERVICE]
        w = svc.pool.get(f"http://127.0.0.1:{eng.port}")
        assert w.breaker.failures == 1
        text = svc.metrics.render(svc.router, svc.pool).decode()
        assert re.search(r'pdlb_upstream_failures_total\{kind="request_timeout",worker="[^"]+"\} 1\.0', text), text


def test_the_non_streamed_timeout_grows_with_the_output_limit():
    from balancer.service.proxy import Proxy

    cfg = ServiceConfig.model_validate({"pd_protocol": "none", "port": 0})
    p = Proxy.__new__(Proxy)
    p.cfg = cfg
    # default: 60 s + 0.25 s per output token (hand calculation: 60 + 0.25 * 400 = 160)
    assert p._first_byte_timeout(False, 400)[1] == 160.0
    assert p._first_byte_timeout(True, 400) == ("stream_first_chunk_timeout_s", 120.0)
    assert p._first_byte_timeout(False, None) is None  # prefill legs: prefill_timeout_s instead


# ---------------------------------------------------------------------- item 9: request ids
async def test_request_ids_are_unguessable():
    async with inprocess_cluster("none", num_decode=1, engine=FAST) as c, aiohttp.ClientSession() as s:
        ids = []
        for _ in range(50):
            r = await s.post(c.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
            ids.append(r.headers["X-Request-Id"])
    assert all(re.fullmatch(r"pdlb-[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == len(ids)
    # consecutive ids share no counter: independent 96-bit values differ in ~22.5 of 24 hex digits
    # (a counter would differ in 1-2); fewer than 12 for any pair has probability < 1e-6
    for a, b in zip(ids, ids[1:]):
        assert sum(x != y for x, y in zip(a[5:], b[5:])) >= 12, (a, b)
