"""A client that names the router's alias (``--served-model-name``) is answered under it (S7).

The alias reaches each engine under the engine's own name (test_engine_contract.py); before this
fix the answer came back under that name too (``"model": "pdlb-emulated"`` for a request that named
``llama``). The engines' own rule, read from their wheels (tests/engine_publishers.py downloads
them): vLLM 0.33.0 answers under its first served name whatever the request named
(``vllm/entrypoints/openai/models/serving.py``: ``model_name()`` returns
``self.base_model_paths[0].name``; the completion and chat servers put it in every response and
chunk), SGLang 0.5.23 under the name the request gave (``model=request.model`` in
``serving_completions.py`` / ``serving_chat.py``). A router that lists one name (the alias) in
``/v1/models`` is therefore answered under the alias by both rules when the client names it, and
by vLLM's when the client names no model.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from balancer.service.app import create_app
from balancer.service.config import ServiceConfig
from sim.emulator.testing import inprocess_cluster

ALIAS = "llama"
ENGINE = "pdlb-emulated"  # the emulated engines' own served name (EmulatorConfig default)
#: health checks on, so that the engines' names are probed; the first round an hour away
PROBED = {"served_model_name": ALIAS, "health_check": {"enabled": True, "interval_s": 3600}}


def _models_in(text: str, stream: bool) -> list[str]:
    """The ``model`` of the JSON answer, or of every SSE event that has one."""
    if not stream:
        return [json.loads(text)["model"]]
    events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    assert events, text
    return [m for e in events if (m := json.loads(e).get("model")) is not None]


async def _probed(s: aiohttp.ClientSession, url: str) -> None:
    for _ in range(200):
        workers = (await (await s.get(url + "/workers")).json())["workers"]
        if all(w["capabilities"]["probed"] for w in workers):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the engines were not probed")


@pytest.mark.parametrize("protocol", ["none", "sglang", "vllm"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_a_request_naming_the_alias_is_answered_under_it(protocol, stream, endpoint):
    body = ({"prompt": "hello " * 8} if endpoint == "/v1/completions"
            else {"messages": [{"role": "user", "content": "hello " * 8}]}) | {"max_tokens": 3, "stream": stream}
    async with inprocess_cluster(protocol, engine={"speed": 20.0}, router=PROBED) as c, aiohttp.ClientSession() as s:
        await _probed(s, c.url)
        for model, want in ((ALIAS, ALIAS), ("absent", ALIAS), (None, ALIAS), ("", ALIAS), (ENGINE, ENGINE)):
            # fails before the fix for the alias and no model (absent, null or "", which vLLM's
            # check_model takes alike: `not model_name`): every answer said "pdlb-emulated" (the
            # engine's own name); a name that is not the alias passes through both ways
            sent = body if model == "absent" else body | {"model": model}
            async with s.post(c.url + endpoint, json=sent) as r:
                text = await r.text()
            assert r.status == 200, text
            models = _models_in(text, stream)
            assert models and set(models) == {want}, (model, text)
        # (that the engines get their own name for the alias is test_engine_contract.py's)


async def test_compact_json_answers_are_rewritten_too():
    # vLLM's and SGLang's servers write pydantic's compact JSON ("model":"x", model_dump_json); the
    # emulator above writes json.dumps' spaced form: both are rewritten, a "model" inside generated
    # text (escaped quotes) is not
    text_out = 'the \\"model\\":\\"vllm-model\\" key'

    async def generate(request: web.Request) -> web.StreamResponse:
        got = await request.json()
        assert got["model"] == "vllm-model"
        if not got.get("stream"):
            return web.Response(text='{"id":"x","model":"vllm-model","choices":[{"text":"%s"}]}' % text_out,
                                content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(2):
            await resp.write(b'data: {"id":"x","model":"vllm-model","choices":[{"text":"%s"}]}\n\n' % text_out.encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "vllm-model", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", lambda r: web.json_response({}))
    engine = TestServer(app, host="127.0.0.1")
    await engine.start_server()
    cfg = ServiceConfig.model_validate({"pd_protocol": "none", "port": 0, **PROBED,
                                        "workers": [{"url": f"http://127.0.0.1:{engine.port}", "role": "mixed"}]})
    router = TestServer(create_app(cfg), host="127.0.0.1")
    await router.start_server()
    try:
        async with aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}"
            await _probed(s, url)
            for stream in (False, True):
                async with s.post(url + "/v1/completions", json={"model": ALIAS, "prompt": "p", "max_tokens": 2,
                                                                 "stream": stream}) as r:
                    text = await r.text()
                assert r.status == 200, text
                assert _models_in(text, stream) == [ALIAS] * (2 if stream else 1), text
                assert text.count(text_out) == (2 if stream else 1), text  # generated text untouched
    finally:
        await router.close()
        await engine.close()


async def test_an_engine_that_starts_after_the_router_is_answered_under_the_alias_within_seconds():
    """review5 U7 (session 17): the engines' names are read once at start and then at each health
    round (``health_check.interval_s``, 60 s by default). An engine that came up after the router
    was served as soon as the 1 s probe found it healthy, but its name stayed unknown until the next
    round, so a request naming no model came back under the engine's own name (``pdlb-emulated``),
    not the alias, for up to a minute. Now a probe that finds an unprobed engine healthy reads its
    names at once. Expected: the alias on the first answer (the names are read on the first passing probe, the
    worker routable after the second)."""
    import socket

    from sim.emulator.app import STATE, create_engine_app
    from sim.emulator.config import EmulatorConfig

    with socket.socket() as free:  # a port nothing listens on yet: the engine's, later
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cfg = ServiceConfig.model_validate({"pd_protocol": "none", "workers": [{"url": url, "role": "mixed"}], "port": 0,
                                        "retry": {"max_retries": 0}} | PROBED)
    body = {"prompt": "hello " * 8, "max_tokens": 3}
    router = TestServer(create_app(cfg), host="127.0.0.1")
    engine = TestServer(create_engine_app(EmulatorConfig(role="mixed", speed=20.0)), host="127.0.0.1", port=port)
    await router.start_server()
    try:
        async with aiohttp.ClientSession() as s:
            base = f"http://127.0.0.1:{router.port}"
            async with s.post(base + "/v1/completions", json=body) as r:  # no engine yet: refused, marked down
                assert r.status >= 500
            await engine.start_server()
            engine.app[STATE].port = engine.port
            for _ in range(300):  # up to ~6 s: routable again after 2 passing 1 s probes
                async with s.post(base + "/v1/completions", json=body) as r:  # names no model
                    if r.status == 200:
                        assert _models_in(await r.text(), False) == [ALIAS]
                        break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the late engine was not served within 6 s")
            workers = (await (await s.get(base + "/workers")).json())["workers"]
            assert workers[0]["capabilities"]["probed"]
    finally:
        await engine.close()
        await router.close()
