"""First-token time and output tokens on real engines' streams (issue 30): the recorded answers of
transformers' server, vLLM and SGLang (``tests/engine_streams.py``, with their sources), read by
:class:`balancer.service.stream_meter.StreamMeter` alone and relayed through ``pdlb serve``."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from aiohttp.test_utils import TestServer

from balancer.service.app import SERVICE, create_app
from balancer.service.config import ServiceConfig
from balancer.service.stream_meter import StreamMeter, completion_tokens_in, event_has_content
from tests.engine_streams import STREAMS, TX_FINISH, TX_ROLE, Recorded

BY_NAME = {r.name: r for r in STREAMS}


def _first_content_write(rec: Recorded) -> tuple[int | None, int]:
    meter = StreamMeter()
    first = None
    for i, (_, data) in enumerate(rec.writes):
        if meter.feed(data):
            assert first is None, "feed() must report the first content event once"
            first = i
    return first, meter.output_tokens()


@pytest.mark.parametrize("rec", STREAMS, ids=lambda r: r.name)
def test_first_content_write_and_output_tokens(rec: Recorded):
    first, tokens = _first_content_write(rec)
    assert first is not None
    # the hand-computed TTFT is the sum of the delays through the write holding the first content
    assert sum(d for d, _ in rec.writes[:first + 1]) == pytest.approx(rec.ttft_s)
    assert tokens == rec.output_tokens
    assert rec.writes[-1][1].endswith(b"data: [DONE]\n\n") == rec.done


@pytest.mark.parametrize("rec", STREAMS, ids=lambda r: r.name)
def test_any_split_of_the_bytes_gives_the_same_answer(rec: Recorded):
    """TCP may cut the engine's writes anywhere: the count and the content event do not change. The
    first content event is recognised in the piece that completes its line."""
    whole = b"".join(d for _, d in rec.writes)
    first_write, _ = _first_content_write(rec)
    # the byte offset where the first content event's line ends (hand rule: its "\n")
    start = len(b"".join(d for _, d in rec.writes[:first_write]))
    for line_start in range(start, len(whole)):
        if whole.startswith(b"data:", line_start) and event_has_content(json.loads(
                whole[line_start + 5:whole.index(b"\n", line_start)])):
            break
    line_end = whole.index(b"\n", line_start) + 1
    rng = random.Random(7)
    for _ in range(60):
        cuts = sorted(rng.sample(range(1, len(whole)), rng.randint(1, 12)))
        pieces = [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)])]
        meter, seen = StreamMeter(), None
        pos = 0
        for p in pieces:
            if meter.feed(p):
                seen = (pos, pos + len(p))
            pos += len(p)
        assert seen is not None and seen[0] < line_end <= seen[1]  # the piece holding the line's "\n"
        assert meter.output_tokens() == rec.output_tokens
    for cut in range(1, len(whole)):  # every 2-piece split
        meter = StreamMeter()
        meter.feed(whole[:cut])
        meter.feed(whole[cut:])
        assert meter.content_seen and meter.output_tokens() == rec.output_tokens


def test_no_content_no_first_token():
    meter = StreamMeter()
    assert not meter.feed(TX_ROLE) and not meter.feed(TX_FINISH)
    assert not meter.content_seen and meter.output_tokens() == 0
    meter = StreamMeter()  # an error event is not content
    assert not meter.feed(b'data: {"error": "CUDA out of memory"}\n\n')
    assert not meter.content_seen


def test_content_rules_by_field():
    # each line: an engine event and whether it carries generated content (module docstring's rule)
    cases = [
        ({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, False),
        ({"choices": [{"delta": {}}]}, False),
        ({"choices": []}, False),
        ({"choices": [{"delta": {"reasoning_content": "think"}}]}, True),
        ({"choices": [{"delta": {"reasoning": "think"}}]}, True),
        ({"choices": [{"delta": {}, "token_ids": [42]}]}, True),  # vLLM return_token_ids, parser held the text
        ({"choices": [{"delta": {}, "logprobs": {"content": [{"token": "\u00e9"}]}}]}, True),
        ({"choices": [{"text": ""}]}, False),
        ({"choices": [{"text": "x"}]}, True),
        ({"text": "abc", "meta_info": {"completion_tokens": 1}}, True),  # SGLang /generate
        ({"text": "", "output_ids": [], "meta_info": {"completion_tokens": 0}}, False),
        ({"error": {"message": "x"}}, False),
        ([1, 2], False),
    ]
    for obj, want in cases:
        assert event_has_content(obj) is want, obj


def test_completion_tokens_of_a_json_answer():
    assert completion_tokens_in(b'{"usage": {"prompt_tokens": 9, "completion_tokens": 17}}') == 17
    assert completion_tokens_in(b'{"text": "a", "meta_info": {"completion_tokens":3}}') == 3
    assert completion_tokens_in(b'{"choices": []}') is None


# ---------------------------------------------------------------------- through pdlb serve
SCALE = 3.0
"""The replayed delays are the recorded ones times this: the 5% bound then leaves ~18 ms for
loopback and scheduling on a loaded 2-core machine (at 1x a CI run missed it by 1.2 ms)."""


def _replay_engine() -> web.Application:
    """An engine that answers with the recorded stream named by the request's ``model``, with the
    recorded delays times :data:`SCALE`, or (``stream: false``) with a JSON answer holding ``usage``."""

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            await asyncio.sleep(0.05)
            return web.json_response({"id": "x", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 11, "total_tokens": 14}})
        rec = BY_NAME[body["model"]]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for delay, data in rec.writes:
            if delay:
                await asyncio.sleep(delay * SCALE)
            await resp.write(data)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_post("/v1/completions", handle)
    app.router.add_post("/generate", handle)
    return app


def _ttft_sum_count(text: str, endpoint: str) -> tuple[float, float]:
    s = c = 0.0
    for line in text.splitlines():
        if line.startswith(f'pdlb_time_to_first_token_seconds_sum{{endpoint="{endpoint}"}}'):
            s = float(line.split()[-1])
        if line.startswith(f'pdlb_time_to_first_token_seconds_count{{endpoint="{endpoint}"}}'):
            c = float(line.split()[-1])
    return s, c


@pytest.mark.parametrize("upstream", ["lean", "aiohttp"])
async def test_pdlb_ttft_matches_the_client_on_recorded_streams(upstream):
    """Through pdlb, its TTFT metric is between the recorded delay to the first content event (not
    the role chunk's ~0 s) and the client's TTFT, within 5% of the client's over the streams; the
    output tokens handed to the router are the hand-computed ones."""
    engine = TestServer(_replay_engine(), host="127.0.0.1")
    await engine.start_server()
    cfg = ServiceConfig.model_validate({"pd_protocol": "none", "port": 0, "upstream_client": upstream,
                                        "health_check": {"enabled": False},
                                        "workers": [{"url": f"http://127.0.0.1:{engine.port}", "role": "mixed"}]})
    router = TestServer(create_app(cfg), host="127.0.0.1")
    await router.start_server()
    svc = router.app[SERVICE]
    finished: list[int | None] = []
    orig = svc.router.on_finished
    svc.router.on_finished = lambda rid, now, n=None: (finished.append(n), orig(rid, now, n))[1]
    url = f"http://127.0.0.1:{router.port}"
    pdlb_sum = client_sum = 0.0
    try:
        async with aiohttp.ClientSession() as s:
            for rec in STREAMS:
                path = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
                        "generate": "/generate"}[rec.endpoint]
                body = {"model": rec.name, "stream": True, "max_tokens": 8}
                body.update({"chat": {"messages": [{"role": "user", "content": "hi"}]}, "completions": {"prompt": "hi"},
                             "generate": {"text": "hi"}}[rec.endpoint])
                before = _ttft_sum_count(await (await s.get(url + "/metrics")).text(), rec.endpoint)
                t0 = time.monotonic()
                client_ttft = None
                async with s.post(url + path, json=body) as r:
                    assert r.status == 200
                    buf = b""
                    async for chunk in r.content.iter_any():
                        buf += chunk
                        while client_ttft is None and b"\n" in buf:
                            line, buf = buf.split(b"\n", 1)
                            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]" and \
                                    event_has_content(json.loads(line[5:])):
                                client_ttft = time.monotonic() - t0
                after = _ttft_sum_count(await (await s.get(url + "/metrics")).text(), rec.endpoint)
                assert after[1] - before[1] == 1, rec.name
                pdlb_ttft = after[0] - before[0]
                assert client_ttft is not None
                assert rec.ttft_s * SCALE <= pdlb_ttft <= client_ttft, rec.name
                pdlb_sum += pdlb_ttft
                client_sum += client_ttft
                assert finished[-1] == rec.output_tokens, rec.name
            # within 5% over all streams (one stream alone can lose more to a descheduled test
            # process on a loaded machine: client, router and engine share this event loop)
            assert abs(pdlb_sum - client_sum) <= 0.05 * client_sum, (pdlb_sum, client_sum)
            # not streamed: the router learns the usage's completion_tokens
            r = await s.post(url + "/v1/chat/completions", json={"model": "m", "messages": [
                {"role": "user", "content": "hi"}], "max_tokens": 11})
            assert r.status == 200 and finished[-1] == 11
    finally:
        await router.close()
        await engine.close()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=12))
def test_any_bytes_neither_raise_nor_count_below_zero(chunks):
    """Fuzz: whatever an engine sends (garbage, half events, nested JSON), the meter never raises,
    reports the first content event at most once, and counts 0 tokens without one."""
    meter = StreamMeter()
    firsts = sum(meter.feed(c) for c in chunks)
    assert firsts <= 1
    n = meter.output_tokens()
    assert n >= 0 and (meter.content_seen or n == 0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([TX_ROLE, TX_FINISH, b"data: [DONE]\n\n", b": keep-alive\n\n",
                                 b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n',
                                 b'data: {"choices":[{"text":"y","index":0}]}\n\n']), max_size=20))
def test_counted_tokens_are_the_content_events_between_the_first_and_the_trailing_ones(events):
    """Hand rule: a usage among the last 16 data events gives the count (the finish chunk's 4);
    else the count is the data events from the first content event to the last content event
    (non-content events in between count: they are rare and the rule keeps the hot path to two
    byte searches)."""
    meter = StreamMeter()
    for e in events:
        meter.feed(e)
    content = [i for i, e in enumerate(events) if b'"content":"x"' in e or b'"text":"y"' in e]
    if not content:
        assert meter.output_tokens() == 0
        return
    if TX_FINISH in [e for e in events if e.startswith(b"data:")][-16:]:
        assert meter.output_tokens() == 4
    else:
        between = events[content[0]:content[-1] + 1]
        assert meter.output_tokens() == sum(1 for e in between if e.startswith(b"data:"))
