"""``pdlb engine`` (the engine emulator) answers bad PD fields, requests it does not emulate, an
unbounded long-poll timeout and bad fault settings with one clear 400, and still serves valid ones.
Expected messages are written out by hand from the inputs.
"""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from sim.emulator import EmulatorConfig, create_engine_app
from sim.emulator.app import STATE


async def _engine(**cfg) -> TestClient:
    c = TestClient(TestServer(create_engine_app(EmulatorConfig(zero_delay=True, **cfg)), host="127.0.0.1"))
    await c.start_server()
    c.app[STATE].port = c.port
    return c


@pytest.mark.parametrize("role, body, headers, needle", [
    # was a 500 ("Server got itself in trouble") from int('x') in the handler
    ("decode", {"data_parallel_rank": "x"}, {}, "data_parallel_rank must be an integer 0..1 (this engine has 2 DP ranks), got 'x'"),
    ("decode", {}, {"X-data-parallel-rank": "abc"}, "header X-data-parallel-rank must be an integer, got 'abc'"),
    # were served on rank 7 % 2 = 1, -1 % 2 = 1 and int(1.5) = 1: silently another rank than asked
    ("decode", {"data_parallel_rank": 7}, {}, "data_parallel_rank must be an integer 0..1 (this engine has 2 DP ranks), got 7"),
    ("decode", {"data_parallel_rank": -1}, {}, "got -1"),
    ("decode", {"data_parallel_rank": 1.5}, {}, "got 1.5"),
    ("decode", {}, {"X-data-parallel-rank": "2"}, "got 2"),
    ("decode", {"data_parallel_rank": True}, {}, "got True"),
    # was a 500 from int('x') on the decode leg and on the prefill leg
    ("decode", {"bootstrap_room": "x", "bootstrap_host": "127.0.0.1", "bootstrap_port": 1}, {},
     "bootstrap_room must be an integer >= 0, got 'x'"),
    ("prefill", {"bootstrap_room": "x"}, {}, "bootstrap_room must be an integer >= 0, got 'x'"),
    ("prefill", {"bootstrap_room": -3}, {}, "got -3"),
    # were answered 200 with one choice (silently fewer than asked) / one concatenated prompt
    ("mixed", {"n": 3}, {}, "'n' must be 1: pdlb engine emulates one completion per request, got 3"),
    ("mixed", {"best_of": 2}, {}, "'best_of' must be 1"),
    ("mixed", {"prompt": ["a", "b"]}, {}, "batched prompts are not emulated (2 prompts in 'prompt')"),
    ("mixed", {"prompt": [[1, 2], [3]]}, {}, "batched prompts are not emulated (2 prompts in 'prompt')"),
])
async def test_engine_answers_bad_pd_fields_and_unemulated_requests_with_400(role, body, headers, needle) -> None:
    c = await _engine(role=role, dp_ranks=2)
    try:
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2} | body, headers=headers)
        assert r.status == 400
        err = (await r.json())["error"]
        assert needle in err["message"] and err["type"] == "invalid_request_error" and err["code"] == 400
        assert c.app[STATE].counts.get("ok", 0) == 0  # nothing was run
    finally:
        await c.close()


async def test_engine_still_serves_valid_pd_fields_and_single_prompts() -> None:
    c = await _engine(role="decode", dp_ranks=2)
    try:
        for body, headers in [({"data_parallel_rank": 1}, {}), ({}, {"X-data-parallel-rank": "0"}),
                              ({"n": 1, "prompt": ["one prompt"]}, {}), ({"prompt": [[1, 2, 3]]}, {})]:
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2} | body, headers=headers)
            assert r.status == 200, await r.text()
            assert len((await r.json())["choices"]) == 1
        # SGLang's /generate: n in sampling_params
        r = await c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2, "n": 2}})
        assert r.status == 400 and "'n' must be 1" in (await r.json())["error"]["message"]
        r = await c.post("/generate", json={"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 2}})
        assert r.status == 400 and "'text' (string) or 'input_ids'" in (await r.json())["error"]["message"]
    finally:
        await c.close()


@pytest.mark.parametrize("query", ["nan", "inf", "-1", "x", "1e9"])
async def test_engine_bootstrap_long_poll_refuses_an_unbounded_or_bad_timeout(query: str) -> None:
    # timeout_s=inf held the long poll open for ever; nan and -1 reached asyncio.wait_for
    c = await _engine(role="prefill")
    try:
        r = await c.get("/bootstrap/5", params={"timeout_s": query})
        assert r.status == 400
        assert f"timeout_s must be a number of seconds 0..3600, got '{query}'" in (await r.json())["error"]["message"]
        r = await c.get("/bootstrap/5", params={"timeout_s": "0"})  # a valid one still answers: 504 at once
        assert r.status == 504
    finally:
        await c.close()


async def test_engine_fault_errors_are_one_line_naming_the_field() -> None:
    # was pydantic's multi-line dump with a documentation URL
    c = await _engine(role="mixed")
    try:
        r = await c.post("/emulator/faults", json={"error_rate": 5})
        msg = (await r.json())["error"]["message"]
        assert r.status == 400 and msg == "invalid faults: error_rate: Input should be less than or equal to 1"
        r = await c.post("/emulator/faults", json={"eror_rate": 0.5})
        msg = (await r.json())["error"]["message"]
        assert msg == "invalid faults: eror_rate: unknown field (did you mean 'error_rate'?)"
        r = await c.post("/emulator/faults", data=b"{x")
        assert r.status == 400 and (await r.json())["error"]["message"].startswith("invalid faults: invalid JSON body")
    finally:
        await c.close()
