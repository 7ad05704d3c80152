"""What a client is told when an engine fails (review findings F5 and F10).

Fault matrix, both PD protocols, one prefill and one decode engine and no retries (so every fault
reaches the client): the faulty engine answers 503 or 500, refuses connections, hangs before or
after its headers, dies mid-stream, or is too slow for the request timeout; each cell streamed and
not. Every answer (JSON error or the SSE error event ending a stream) must be an error naming no
engine URL, host or port (they were in every message: ``worker http://127.0.0.1:42020 failed
mid-stream``); the URL is in the router's log instead, with the answer's request id. A timeout's
error ``type`` is ``timeout`` streamed or not (it was ``server_error`` in a stream).
Expected values: the answer statuses are the documented ones (docs/serving.md, "Limits and
hardening": 502 failed leg, 503 answered, 504 timeouts). Each cell well under two seconds.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest

from sim.emulator.testing import inprocess_cluster

ROUTER = {"first_byte_timeout_s": 0.4, "prefill_timeout_s": 0.6, "request_timeout_s": 1.5,
          "retry": {"max_retries": 0}, "circuit_breaker": {"failure_threshold": 1000}}

FAULTS = [
    ("http_503", "prefill", {"error_rate": 1.0, "error_status": 503}, {503}),
    ("http_503", "decode", {"error_rate": 1.0, "error_status": 503}, {503}),
    ("http_500", "decode", {"error_rate": 1.0, "error_status": 500}, {500}),
    ("refused", "prefill", None, {502}),
    ("refused", "decode", None, {502}),
    ("hang", "prefill", {"hang": True}, {504}),
    ("hang", "decode", {"hang": True}, {504}),
    ("hang_after_headers", "decode", {"hang_after_headers": True}, {504}),  # streams only (a JSON answer is whole)
    ("die_mid_stream", "decode", {"die_after_tokens": 2}, {502}),
]


def _error_of(status: int, text: str, stream: bool) -> dict:
    """The error object of an answer: its JSON body, or a stream's error event (the last before
    ``[DONE]``)."""
    if status != 200:
        return json.loads(text)["error"]
    assert stream, text
    events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]", text
    return json.loads(events[-2])["error"]


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
@pytest.mark.parametrize("name,role,faults,statuses", FAULTS, ids=[f"{n}-{r}" for n, r, _, _ in FAULTS])
async def test_errors_name_no_engine_address(protocol, name, role, faults, statuses, caplog):
    caplog.set_level(logging.WARNING, "pdlb.service")
    async with inprocess_cluster(protocol, num_prefill=1, num_decode=1, engine={"speed": 20.0, "bootstrap_timeout_s": 1.0},
                                 router=ROUTER) as c, aiohttp.ClientSession() as s:
        bad = (c.prefill if role == "prefill" else c.decode)[0]
        bad_port = bad.port  # (a closed TestServer forgets it)
        secrets_ = [f"127.0.0.1:{e.port}" for e in c.engines] + [str(e.port) for e in c.engines] + ["http://"]
        if faults is None:
            await bad.close()
        else:
            async with s.post(f"http://127.0.0.1:{bad_port}/emulator/faults", json=faults) as r:
                assert r.status == 200
        ids = []
        for stream in (True, False) if name != "hang_after_headers" else (True,):
            body = {"prompt": "hello " * 40, "max_tokens": 4, "stream": stream}
            async with s.post(c.url + "/v1/completions", json=body) as r:
                text = await r.text()
                ids.append(r.headers["X-Request-Id"])
            err = _error_of(r.status, text, stream)
            assert err["code"] in statuses, (stream, text)
            assert err["message"] and not any(x in text for x in secrets_), (stream, text)
            if err["code"] >= 502 and name != "http_503" and name != "http_500":  # pdlb's own message
                assert f"{role} worker" in err["message"], err
        # the operator still learns which engine failed: the log line has its URL and the request id
        logged = [r.getMessage() for r in caplog.records if f"127.0.0.1:{bad_port}" in r.getMessage()]
        assert any(i in m for m in logged for i in ids), (ids, [r.getMessage() for r in caplog.records])


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_a_timeout_has_one_error_type_streamed_or_not(protocol):
    # a decode long enough to outlast request_timeout_s: the stream has started (its error is an
    # SSE event), the non-streamed answer is a JSON 504; the same condition, the same type
    router = {"request_timeout_s": 0.8, "retry": {"max_retries": 0}}
    async with inprocess_cluster(protocol, num_prefill=1, num_decode=1, engine={"speed": 5.0},
                                 router=router) as c, aiohttp.ClientSession() as s:
        got = []
        for stream in (True, False):
            body = {"prompt": "hello " * 40, "max_tokens": 20000, "stream": stream, "ignore_eos": True}
            async with s.post(c.url + "/v1/completions", json=body) as r:
                text = await r.text()
            if stream:
                assert r.status == 200 and text.count("data: ") > 2, text[:300]  # it was streaming
            else:
                assert r.status == 504, text
            err = _error_of(r.status, text, stream)
            assert err["code"] == 504 and "timed out" in err["message"], err
            got.append(err["type"])
        assert got == ["timeout", "timeout"]  # was ["server_error", "timeout"]
        await asyncio.sleep(0)

