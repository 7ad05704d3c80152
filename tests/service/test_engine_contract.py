"""pdlb speaking to engines as they are (issue 30): capabilities discovered at registration, the
model alias rewritten to the engine's own name, abort only where an engine has it, /v1/models from
configuration, one error shape with X-Request-Id, --scrape-load saying once that an engine has no
metrics.

The fake engines answer as the real ones do (sources read): ``transformers serve`` 5.17
(``transformers/cli/serving/``: FastAPI, errors ``{"detail": ...}``, pinned to the model folder it
was started with, ``/v1/models`` 500 without a Hugging Face cache, no ``/metrics``,
``/server_info``, ``/version`` or ``/abort_request``), SGLang (``/server_info``,
``POST /abort_request``, flat ``{"object": "error", "message", "type", "param", "code"}`` errors)
and vLLM (``/version``, OpenAI-shaped ``{"error": {...}}`` errors, Prometheus ``/metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from balancer.service.app import create_app
from balancer.service.config import ServiceConfig, parse_worker_spec
from balancer.service.load_scraper import scrape_once
from balancer.router import Router
from balancer.policies import make_policy

PINNED = "/models/llama8b"


def fake_engine(kind: str) -> tuple[web.Application, dict]:
    """An engine of ``kind`` (``transformers``, ``sglang``, ``vllm``); the dict records what it got."""
    seen: dict = {"models": [], "aborts": 0, "paths": []}

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        seen["models"].append(body.get("model"))
        if kind == "transformers" and body.get("model") != PINNED:
            return web.json_response({"detail": f"Server is pinned to '{PINNED}'; requested '{body.get('model')}'"},
                                     status=400)
        if body.get("pdlb_test_error"):  # an engine-side validation error, in the engine's shape
            if kind == "sglang":
                return web.json_response({"object": "error", "message": "max_tokens must be positive",
                                          "type": "BadRequestError", "param": None, "code": 400}, status=400)
            if kind == "vllm":
                return web.json_response({"error": {"message": "max_tokens must be at least 1", "type":
                                                    "BadRequestError", "param": "max_tokens", "code": 400}}, status=400)
            return web.json_response({"detail": [{"loc": ["body", "max_tokens"], "msg": "must be >= 1"}]}, status=422)
        return web.json_response({"id": "x", "object": "chat.completion", "model": body.get("model"), "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}})

    async def models(request: web.Request) -> web.Response:
        if kind == "transformers":
            return web.Response(status=500, text="Internal Server Error")
        name = "sgl-model" if kind == "sglang" else "vllm-model"
        return web.json_response({"object": "list", "data": [{"id": name, "object": "model"}]})

    async def abort(request: web.Request) -> web.Response:
        seen["aborts"] += 1
        return web.json_response({})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"disaggregation_mode": "null"})

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": "0.33.0"})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
                                 'vllm:num_requests_running{model_name="m"} 3.0\n')

    app = web.Application()
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    if kind == "sglang":
        app.router.add_post("/abort_request", abort)
        app.router.add_get("/server_info", server_info)
    if kind == "vllm":
        app.router.add_get("/version", version)
        app.router.add_get("/metrics", metrics)
    return app, seen


@contextlib.asynccontextmanager
async def router_in_front(kind: str, router: dict | None = None, worker: dict | None = None):
    app, seen = fake_engine(kind)
    engine = TestServer(app, host="127.0.0.1")
    await engine.start_server()
    # health checks on (capabilities are probed with them), the first round an hour away
    cfg = ServiceConfig.model_validate({
        "pd_protocol": "none", "port": 0, "health_check": {"enabled": True, "interval_s": 3600}, **(router or {}),
        "workers": [{"url": f"http://127.0.0.1:{engine.port}", "role": "mixed", **(worker or {})}]})
    r = TestServer(create_app(cfg), host="127.0.0.1")
    await r.start_server()
    try:
        async with aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{r.port}"
            for _ in range(100):  # the probe runs in the background at start
                w = (await (await s.get(url + "/workers")).json())["workers"][0]
                if w["capabilities"]["probed"]:
                    break
                await asyncio.sleep(0.02)
            yield s, url, seen, w
    finally:
        await r.close()
        await engine.close()


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("kind,want", [
    ("transformers", {"engine": "openai", "served_models": [], "abort_endpoint": None, "metrics_endpoint": None}),
    ("sglang", {"engine": "sglang", "served_models": ["sgl-model"], "abort_endpoint": "/abort_request",
                "metrics_endpoint": None}),
    ("vllm", {"engine": "vllm", "served_models": ["vllm-model"], "abort_endpoint": None,
              "metrics_endpoint": "/metrics"}),
])
async def test_capabilities_are_discovered_and_shown_in_workers(kind, want):
    async with router_in_front(kind) as (_, _, _, w):
        assert w["capabilities"] == {**want, "probed": True}


async def test_alias_is_rewritten_to_the_name_a_pinned_engine_accepts():
    # configured name (transformers lists none)
    async with router_in_front("transformers", router={"served_model_name": "llama"},
                               worker={"served_model_name": PINNED}) as (s, url, seen, _):
        r = await s.post(url + "/v1/chat/completions", json={"model": "llama", **CHAT})
        assert r.status == 200 and seen["models"] == [PINNED]
        r = await s.post(url + "/v1/chat/completions", json={"model": "other", **CHAT})  # not the alias: as sent
        assert r.status == 400 and seen["models"][-1] == "other"
    # discovered name
    async with router_in_front("sglang", router={"served_model_name": "llama"}) as (s, url, seen, _):
        r = await s.post(url + "/v1/chat/completions", json={"model": "llama", **CHAT})
        assert r.status == 200 and seen["models"] == ["sgl-model"]
        r = await s.post(url + "/v1/chat/completions", json={"model": "sgl-model", **CHAT})
        assert r.status == 200 and seen["models"][-1] == "sgl-model"


def test_worker_spec_takes_a_model_name():
    assert parse_worker_spec("http://h:1,model=/m/x", "mixed") == {"url": "http://h:1", "role": "mixed",
                                                                  "served_model_name": "/m/x"}
    with pytest.raises(ValueError, match="model must be"):
        parse_worker_spec("http://h:1,model=", "mixed")


@pytest.mark.parametrize("kind,message,engine_error", [
    ("transformers", json.dumps([{"loc": ["body", "max_tokens"], "msg": "must be >= 1"}]),
     {"detail": [{"loc": ["body", "max_tokens"], "msg": "must be >= 1"}]}),
    ("sglang", "max_tokens must be positive", {"object": "error", "message": "max_tokens must be positive",
                                               "type": "BadRequestError", "param": None, "code": 400}),
    ("vllm", "max_tokens must be at least 1", None),  # already OpenAI's shape: passed through as is
])
async def test_engine_errors_come_back_in_openai_shape_with_the_request_id(kind, message, engine_error):
    worker = {"served_model_name": PINNED} if kind == "transformers" else None
    async with router_in_front(kind, router={"served_model_name": "llama"}, worker=worker) as (s, url, seen, _):
        r = await s.post(url + "/v1/chat/completions", json={"model": "llama", **CHAT, "pdlb_test_error": True},
                         headers={"X-Request-Id": "client-42"})
        body = await r.json()
        assert r.status == (422 if kind == "transformers" else 400)
        assert r.headers["X-Request-Id"] == "client-42"
        err = body["error"]
        assert err["message"] == message
        if engine_error is None:
            assert err == {"message": message, "type": "BadRequestError", "param": "max_tokens", "code": 400}
        else:
            assert err["engine_error"] == engine_error and err["code"] == r.status
            assert err["type"] == "invalid_request_error"


async def test_the_pinned_engines_refusal_keeps_its_text():
    async with router_in_front("transformers") as (s, url, _, _):
        r = await s.post(url + "/v1/chat/completions", json={"model": "llama", **CHAT})
        err = (await r.json())["error"]
        assert r.status == 400 and err["message"] == f"Server is pinned to '{PINNED}'; requested 'llama'"
        assert err["engine_error"] == {"detail": err["message"]} and r.headers["X-Request-Id"].startswith("pdlb-")


async def test_pdlbs_own_answers_have_a_request_id():
    async with router_in_front("vllm") as (s, url, _, _):
        for method, path, data, status in (("GET", "/health", None, 200), ("GET", "/nope", None, 404),
                                           ("POST", "/v1/chat/completions", b"{bad", 400),
                                           ("GET", "/metrics", None, 200)):
            r = await s.request(method, url + path, data=data, headers={"X-Request-Id": "mine-1"})
            assert r.status == status and r.headers["X-Request-Id"] == "mine-1", path
            r = await s.request(method, url + path, data=data)
            assert r.headers["X-Request-Id"].startswith("pdlb-"), path
        r = await s.post(url + "/v1/chat/completions", data=b"{bad")
        assert set((await r.json())["error"]) == {"message", "type", "code"}


@pytest.mark.parametrize("kind,aborts", [("transformers", 0), ("sglang", 1)])
async def test_abort_goes_only_to_engines_that_have_it(kind, aborts):
    worker = {"served_model_name": PINNED} if kind == "transformers" else None
    async with router_in_front(kind, worker=worker) as (s, url, seen, _):
        r = await s.post(url + "/v1/chat/completions", json={"model": PINNED, **CHAT, "pdlb_test_error": True})
        assert r.status in (400, 422)
        await asyncio.sleep(0.2)  # aborts are sent in the background
        assert seen["aborts"] == aborts


async def test_v1_models_from_configuration_when_engines_cannot_list():
    async with router_in_front("transformers", worker={"served_model_name": PINNED}) as (s, url, _, _):
        r = await s.get(url + "/v1/models")
        assert r.status == 200 and [m["id"] for m in (await r.json())["data"]] == [PINNED]
    async with router_in_front("transformers") as (s, url, _, _):  # nothing to answer from: says what to give
        r = await s.get(url + "/v1/models")
        assert r.status == 503 and "model=NAME" in (await r.json())["error"]["message"]


async def test_scrape_load_says_once_that_an_engine_has_no_metrics(caplog):
    app, _ = fake_engine("transformers")
    engine = TestServer(app, host="127.0.0.1")
    await engine.start_server()
    url = f"http://127.0.0.1:{engine.port}"
    router = Router(make_policy("round_robin"), make_policy("round_robin"))
    warned: set[str] = set()
    try:
        with caplog.at_level(logging.WARNING, logger="pdlb.load_scraper"):
            async with aiohttp.ClientSession() as s:
                for _ in range(3):
                    assert await scrape_once(s, router, [(url, 1)], 2.0, warned=warned) == 0
    finally:
        await engine.close()
    lines = [r.getMessage() for r in caplog.records if "--scrape-load" in r.getMessage()]
    assert len(lines) == 1 and url in lines[0] and "HTTP 404" in lines[0]


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_pd_reports_the_prefill_legs_cached_tokens(protocol):
    """Issue 22 item 5: the decode engine of a PD pair reports the prefix-cache hit of nobody; the
    client gets the prefill engine's ``cached_tokens`` (read from its own request log), streamed
    and not."""
    from sim.emulator.testing import inprocess_cluster

    prompt = "shared words " * 400
    async with inprocess_cluster(protocol, num_prefill=1, num_decode=1, engine={"speed": 50.0}) as c, \
            aiohttp.ClientSession() as s:
        got = []
        for stream in (False, False, True):
            r = await s.post(c.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3, "stream": stream})
            assert r.status == 200
            if stream:
                events = [json.loads(ln[6:]) for ln in (await r.text()).splitlines()
                          if ln.startswith("data: {")]
                usage = [e["usage"] for e in events if e.get("usage")][-1]
            else:
                usage = (await r.json())["usage"]
            got.append(usage["prompt_tokens_details"]["cached_tokens"])
        async with s.get(f"http://127.0.0.1:{c.prefill[0].port}/emulator/requests") as r:
            p_log = await r.json()
        async with s.get(f"http://127.0.0.1:{c.decode[0].port}/emulator/requests") as r:
            d_log = await r.json()
    p_cached = [e["cached_tokens"] for e in p_log]
    assert got == p_cached and got[1] > 0 and got[2] > 0  # the repeats hit the prefill engine's cache
    assert [e["cached_tokens"] for e in d_log] != got  # what the decode engine said (and pdlb replaced)


def test_unreachable_worker_is_marked_and_logged_once_per_burst(caplog):
    from balancer.service.config import CircuitBreakerConfig, HealthCheckConfig, WorkerConfig
    from balancer.service.workers import WorkerPool

    pool = WorkerPool(Router(make_policy("round_robin"), make_policy("round_robin")), CircuitBreakerConfig(),
                      HealthCheckConfig())
    w = pool.add(WorkerConfig(url="http://127.0.0.1:9", role="mixed"))
    with caplog.at_level(logging.INFO, logger="pdlb.service"):
        for t in (0.0, 1.0, 2.0, 30.0):  # one burst: one WARNING at its start
            pool.record_connect_failure(w, t, "UpstreamConnectError")
        assert w.describe()["reachable"] is False and w.describe()["connect_failures"] == 4
        pool.record_connect_failure(w, 61.0, "UpstreamConnectError")  # 60 s on: the count so far
        pool.record_result(w, True, 75.0)
    msgs = [(r.levelname, r.getMessage()) for r in caplog.records if "127.0.0.1:9" in r.getMessage()]
    warnings = [m for lvl, m in msgs if lvl == "WARNING"]
    assert len(warnings) == 2 and "marked unreachable" in warnings[0]
    assert "5 failed connections in 61 s" in warnings[1]
    assert ("INFO", "worker http://127.0.0.1:9 answers again after 5 failed connections in 75.0 s") in msgs
    assert w.describe()["reachable"] is True and w.describe()["connect_failures"] == 5


async def test_a_dead_worker_shows_unreachable_in_workers_and_metrics(caplog):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[1]
    cfg = ServiceConfig.model_validate({"pd_protocol": "none", "port": 0, "health_check": {"enabled": False},
                                        "retry": {"max_retries": 2, "initial_backoff_s": 0.001},
                                        "workers": [{"url": f"http://127.0.0.1:{dead}", "role": "mixed"}]})
    r = TestServer(create_app(cfg), host="127.0.0.1")
    await r.start_server()
    url = f"http://127.0.0.1:{r.port}"
    try:
        with caplog.at_level(logging.WARNING, logger="pdlb.service"):
            async with aiohttp.ClientSession() as s:
                for _ in range(2):
                    resp = await s.post(url + "/v1/chat/completions", json={"model": "m", **CHAT})
                    assert resp.status in (502, 503)
                w = (await (await s.get(url + "/workers")).json())["workers"][0]
                metrics = await (await s.get(url + "/metrics")).text()
    finally:
        await r.close()
    assert w["reachable"] is False and w["connect_failures"] >= 2
    assert f'pdlb_worker_reachable{{worker="http://127.0.0.1:{dead}"}} 0.0' in metrics
    marked = [r for r in caplog.records if "marked unreachable" in r.getMessage()]
    assert len(marked) == 1 and marked[0].levelname == "WARNING"


async def test_shutdown_says_what_it_drained(caplog):
    with caplog.at_level(logging.INFO, logger="pdlb.service"):
        async with router_in_front("vllm") as (s, url, _, _):
            r = await s.post(url + "/v1/chat/completions", json={"model": "m", **CHAT})
            assert r.status == 200
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("shutdown")]
    assert len(lines) == 1 and lines[0].startswith("shutdown: 0 requests were in flight, drained in ")


async def test_no_probe_without_health_checks():
    """With health checks off pdlb sends the engines nothing but requests: no capability probes."""
    async with router_in_front("sglang", router={"health_check": {"enabled": False}}) as (s, url, seen, w):
        await asyncio.sleep(0.1)
        w = (await (await s.get(url + "/workers")).json())["workers"][0]
    assert w["capabilities"]["probed"] is False and w["capabilities"]["engine"] == "unknown"


async def test_an_engine_still_starting_is_probed_again():
    """An engine answering 503 everywhere (still loading) is not taken for a capability-less one:
    ``probed`` stays false, so the next health-check round asks again."""
    from balancer.service.engine_caps import discover

    async def loading(request: web.Request) -> web.Response:
        return web.Response(status=503, text="loading")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", loading)
    engine = TestServer(app, host="127.0.0.1")
    await engine.start_server()
    try:
        async with aiohttp.ClientSession() as s:
            caps = await discover(s, f"http://127.0.0.1:{engine.port}", 2.0)
            dead = await discover(s, "http://127.0.0.1:9", 2.0)  # nothing listens
    finally:
        await engine.close()
    assert (caps.probed, caps.engine) == (False, "unknown") == (dead.probed, dead.engine)
