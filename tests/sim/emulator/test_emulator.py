"""The emulated engine: timing from the perf model, PD protocols, aborts, probe endpoints."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from sim.emulator import EmulatorConfig, create_engine_app
from sim.emulator.app import STATE
from sim.models.hardware import get_hardware
from sim.models.presets import get_model
from sim.perf.roofline import RooflinePerf


async def _client(**cfg) -> TestClient:
    c = TestClient(TestServer(create_engine_app(EmulatorConfig(**cfg)), host="127.0.0.1"))
    await c.start_server()
    c.app[STATE].port = c.port
    return c


async def _sse_times(resp: aiohttp.ClientResponse) -> tuple[list[float], list[dict]]:
    times, events = [], []
    async for line in resp.content:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            times.append(time.monotonic())
            events.append(json.loads(line[6:]))
    return times, events


async def test_mixed_engine_timing_follows_perf_model():
    # speed 0.5 makes the prefill 128 ms, so the HTTP and scheduling overhead of a busy test box
    # (measured up to ~13 ms on 2 shared cores) stays inside a relative tolerance; the emulator
    # sleeps for the perf model's time, so it can never come in early (a lower bound held tight)
    speed = 0.5
    c = await _client(role="mixed", speed=speed)
    try:
        perf = RooflinePerf.for_engine(get_model("llama-3.1-8b"), get_hardware("h100"), num_dp_ranks=1)
        prompt, out = 2000, 30
        prefill_s = float(perf.step_time_s([prompt], [prompt * (prompt + 1) / 2], [0], [0])) / speed
        decode_s = float(np.sum([perf.step_time_s([0], [0], [1], [prompt + 1 + k]) for k in range(out - 1)])) / speed
        t0 = time.monotonic()
        r = await c.post("/v1/completions", json={"prompt": list(range(prompt)), "max_tokens": out, "stream": True})
        times, events = await _sse_times(r)
        tokens = [e for e in events if e["choices"][0]["text"]]
        assert len(tokens) == out
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["usage"]["completion_tokens"] == out
        ttft = times[0] - t0
        assert prefill_s - 0.002 <= ttft <= prefill_s * 1.15 + 0.005
        assert times[out - 1] - times[0] == pytest.approx(decode_s, rel=0.1, abs=0.01)
    finally:
        await c.close()


async def test_prefix_cache_reuses_blocks():
    c = await _client(role="mixed", speed=50.0, block_size=16)
    try:
        body = {"prompt": list(range(100)), "max_tokens": 2}
        r1 = await (await c.post("/v1/completions", json=body)).json()
        r2 = await (await c.post("/v1/completions", json=body)).json()
        assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # 6 full blocks of 16
    finally:
        await c.close()


async def test_vllm_prefill_returns_kv_transfer_params_and_decode_uses_them():
    p = await _client(role="prefill", speed=20.0, engine_id="p0")
    d = await _client(role="decode", speed=20.0)
    try:
        body = {"prompt": "x" * 800, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        pr = await (await p.post("/v1/completions", json=body, headers={"X-Request-Id": "req-1"})).json()
        kv = pr["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["remote_engine_id"] == "p0"
        assert kv["remote_port"] == p.port and len(kv["remote_block_ids"]) == 4  # 200 tokens / 64
        dr = await (await d.post("/v1/completions", json={"prompt": "x" * 800, "max_tokens": 5, "kv_transfer_params": kv},
                                 headers={"X-Request-Id": "req-1"})).json()
        assert dr["usage"]["completion_tokens"] == 5
        log = (await (await d.get("/emulator/requests")).json())[-1]
        assert log["mode"] == "remote" and log["x_request_id"] == "req-1"
    finally:
        await p.close()
        await d.close()


async def test_sglang_decode_leg_waits_for_prefill_room():
    p = await _client(role="prefill", speed=20.0)
    d = await _client(role="decode", speed=20.0)
    try:
        room = 12345
        body = {"text": "hello " * 100, "sampling_params": {"max_new_tokens": 4}, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": p.port, "bootstrap_room": room}
        d_task = asyncio.create_task(d.post("/generate", json=body | {"rid": "r1"}))
        await asyncio.sleep(0.3)
        assert not d_task.done()  # waiting for the prefill leg
        pr = await p.post("/generate", json=body | {"rid": "r1"})
        assert pr.status == 200
        dr = await asyncio.wait_for(d_task, 5)
        out = await dr.json()
        assert out["meta_info"]["completion_tokens"] == 4 and out["text"] == " t0 t1 t2 t3"
        # a failed prefill leg makes the decode leg fail fast instead of waiting for a timeout
        d_task = asyncio.create_task(d.post("/generate", json=body | {"bootstrap_room": 7, "rid": "r2"}))
        await p.post("/emulator/faults", json={"error_rate": 1.0})
        r = await p.post("/generate", json=body | {"bootstrap_room": 7, "rid": "r2"})
        assert r.status == 503
        assert (await asyncio.wait_for(d_task, 5)).status == 502
        # rooms are dropped once the decode leg's bootstrap poll returned (ready or failed): a long
        # run does not accumulate them (they used to pile up and slow every new room down)
        assert p.app[STATE].rooms == {}
    finally:
        await p.close()
        await d.close()


def test_unpolled_rooms_expire_after_four_bootstrap_timeouts(monkeypatch):
    # a room nobody polls (its decode leg never came) expires 4 x bootstrap_timeout_s after its
    # creation, checked when the next room is created; times from a patched monotonic clock
    from sim.emulator import app as emu_app

    now = [1000.0]
    monkeypatch.setattr(emu_app.time, "monotonic", lambda: now[0])
    st = emu_app.EmulatorState(EmulatorConfig(role="prefill", bootstrap_timeout_s=10.0, zero_delay=True), exit_on_die=False)
    st.room(1)
    now[0] = 1020.0
    st.room(2)
    now[0] = 1040.0  # room 1 is exactly 40 s old: 4 x 10 s, not yet expired (strictly older expires)
    st.room(3)
    assert list(st.rooms) == [1, 2, 3]
    now[0] = 1040.5  # room 1 is 40.5 s old -> dropped; room 2 (20.5 s) stays
    st.room(4)
    assert list(st.rooms) == [2, 3, 4]


async def test_abort_request_and_probe_endpoints():
    c = await _client(role="mixed", speed=0.05)  # slow: the request is still running when aborted
    try:
        task = asyncio.create_task(c.post("/generate", json={"text": "y" * 4000, "rid": "slow", "sampling_params": {"max_new_tokens": 50}}))
        await asyncio.sleep(0.2)
        assert (await (await c.post("/abort_request", json={"rid": "slow"})).json())["aborted"] is True
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await asyncio.wait_for(task, 5)
        for _ in range(50):  # the engine drops an aborted request at its next step boundary
            stats = await (await c.get("/emulator/stats")).json()
            if stats["num_running"] == 0:
                break
            await asyncio.sleep(0.1)
        assert stats["aborted"] == 1 and stats["in_flight"] == 0 and stats["num_running"] == 0
        assert stats["kv_usage"] == 0.0
        assert (await c.get("/health")).status == 200
        info = await (await c.get("/server_info")).json()
        assert info["dp_size"] == 1 and info["disaggregation_mode"] == "null"
        assert (await (await c.get("/model_info")).json())["is_generation"] is True
        metrics = await (await c.get("/metrics")).text()
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            assert name in metrics
    finally:
        await c.close()


@pytest.mark.parametrize("endpoint, body, n_in, n_out", [
    ("/v1/completions", {"prompt": [1] * 10, "max_tokens": 1_000_000}, 10, 1_000_000),
    ("/generate", {"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 1_000_000}}, 10, 1_000_000),
    ("/v1/completions", {"prompt": [1] * 10, "max_tokens": 131_063}, 10, 131_063),  # 131,073: one over
    ("/v1/completions", {"prompt": [1] * 131_073, "max_tokens": 1}, 131_073, 1),    # the prompt alone is too long
    # text prompts count ceil(chars / 4) tokens of the templated chat: the count is read from the message
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 40}],
                              "max_completion_tokens": 1_000_000}, None, 1_000_000),
])
async def test_requests_over_max_model_len_get_a_400_and_run_nothing(endpoint: str, body: dict, n_in, n_out) -> None:
    import re

    c = await _client(role="mixed", zero_delay=True)
    try:
        [model] = (await (await c.get("/v1/models")).json())["data"]
        assert model["max_model_len"] == 131_072
        r = await c.post(endpoint, json=body)
        assert r.status == 400
        err = (await r.json())["error"]
        if n_in is None:
            n_in = int(re.search(r"\((\d+) in the messages", err["message"]).group(1))
            assert n_in >= 10  # at least the 40 characters' 10 tokens
        assert err == {"message": f"This model's maximum context length is 131072 tokens. However, you requested "
                                  f"{n_in + n_out} tokens ({n_in} in the messages, {n_out} in the completion). "
                                  f"Please reduce the length of the messages or completion.",
                       "type": "invalid_request_error", "code": 400}
        stats = await (await c.get("/emulator/stats")).json()
        assert stats["tokens_streamed"] == 0 and stats["in_flight"] == 0 and stats["error"] == 1
    finally:
        await c.close()


async def test_max_model_len_is_configurable_and_its_limit_is_inclusive() -> None:
    c = await _client(role="mixed", zero_delay=True, max_model_len=100)
    try:
        assert (await (await c.get("/v1/models")).json())["data"][0]["max_model_len"] == 100
        ok = await c.post("/v1/completions", json={"prompt": [1] * 10, "max_tokens": 90})  # 10 + 90 = 100: fits
        assert ok.status == 200 and (await ok.json())["usage"]["completion_tokens"] == 90
        assert (await c.post("/v1/completions", json={"prompt": [1] * 10, "max_tokens": 91})).status == 400
    finally:
        await c.close()


async def test_transformers_stream_format_sends_the_role_chunk_first_and_no_done():
    """``stream_format: transformers`` frames streams as transformers serve 5.17 does
    (``transformers/cli/serving/chat_completion.py``): a role-only chunk before any token, the
    finish chunk with usage, no ``[DONE]``; completions have no role chunk."""
    app = create_engine_app(EmulatorConfig(role="mixed", zero_delay=True, stream_format="transformers"))
    async with TestClient(TestServer(app)) as client:
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 3, "stream": True})
        events = [ln[6:] for ln in (await r.text()).splitlines() if ln.startswith("data: ")]
        assert "[DONE]" not in events
        objs = [json.loads(e) for e in events]
        assert objs[0]["choices"][0]["delta"] == {"role": "assistant"}
        assert [o["choices"][0]["delta"].get("content") for o in objs[1:4]] == [" t0", " t1", " t2"]
        assert objs[-1]["choices"][0]["finish_reason"] == "length" and objs[-1]["usage"]["completion_tokens"] == 3
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
        events = [ln[6:] for ln in (await r.text()).splitlines() if ln.startswith("data: ")]
        assert "[DONE]" not in events and json.loads(events[0])["choices"][0]["text"] == " t0"
