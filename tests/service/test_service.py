"""In-process tests of the router service (``pdlb serve``) in front of emulated engines."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp.test_utils import make_mocked_request

from balancer.service.app import SERVICE, admin_denied
from balancer.service.config import ServiceConfig, load_service_config
from balancer.service.prompt import Prompt, PromptHasher, extract_prompt
from balancer.service.proxy import encode_with
from balancer.service.workers import BreakerState, CircuitBreaker
from balancer.service.config import CircuitBreakerConfig
from sim.emulator.testing import inprocess_cluster

FAST = {"speed": 20.0}


async def _logs(session: aiohttp.ClientSession, servers) -> list[list[dict]]:
    out = []
    for s in servers:
        async with session.get(f"http://127.0.0.1:{s.port}/emulator/requests") as r:
            out.append(await r.json())
    return out


def _load(cluster) -> int:
    router = cluster.router.app[SERVICE].router
    return router.load.num_in_flight + int(router.load.num_requests.sum())


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_pd_flow_non_streaming_and_streaming(protocol):
    async with inprocess_cluster(protocol, engine=FAST) as c, aiohttp.ClientSession() as s:
        r = await s.post(c.url + "/v1/completions", json={"prompt": "hello " * 300, "max_tokens": 6},
                         headers={"X-Request-Id": "client-1"})
        assert r.status == 200
        body = await r.json()
        r_first_id = r.headers["X-Request-Id"]
        assert body["choices"][0]["text"] == " t0 t1 t2 t3 t4 t5" and body["usage"]["completion_tokens"] == 6
        r = await s.post(c.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi " * 200}],
                                                                "max_tokens": 5, "stream": True})
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        lines = [ln for ln in (await r.text()).splitlines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        content = "".join(json.loads(ln[6:])["choices"][0]["delta"].get("content", "") for ln in lines[:-1])
        assert content == " t0 t1 t2 t3 t4"
        p_logs, d_logs = await _logs(s, c.prefill), await _logs(s, c.decode)
        p_all = [e for log in p_logs for e in log]
        d_all = [e for log in d_logs for e in log]
        assert len(p_all) == 2 and len(d_all) == 2
        # the engines never see the client's id (issue 14, item 1): the router's own, the same on both
        # legs of one attempt, while the client sees its own id in the body and X-Request-Id
        assert not [e for e in p_all + d_all if "client-1" in (e["rid"], e["x_request_id"])]
        assert body["id"] == "client-1" and r_first_id == "client-1"
        first_p = next(e for e in p_all if not e["stream"] or protocol == "vllm")
        first_d = next(e for e in d_all if not e["stream"])
        assert first_d["x_request_id"] == first_p["x_request_id"] and first_d["x_request_id"].startswith("pdlb-")
        if protocol == "sglang":  # same room on both legs, prefill host/port as bootstrap
            assert first_p["bootstrap_room"] == first_d["bootstrap_room"] is not None
            p_port = int(first_p["bootstrap_port"])
            assert p_port in [srv.port for srv in c.prefill]
            assert first_d["mode"] == "remote"
        else:  # prefill got do_remote_decode, decode got the prefill's answer, same X-Request-Id
            assert first_p["kv_transfer_params"]["do_remote_decode"] is True
            assert first_p["output_tokens"] == 1 and first_p["stream"] is False
            assert first_d["kv_transfer_params"]["do_remote_prefill"] is True
            assert first_d["kv_transfer_params"]["remote_port"] in [srv.port for srv in c.prefill]
            assert first_p["x_request_id"] == first_d["x_request_id"]
        assert _load(c) == 0


async def test_sglang_generate_and_models():
    async with inprocess_cluster("sglang", engine=FAST, router={"served_model_name": "m1"}) as c, aiohttp.ClientSession() as s:
        r = await s.post(c.url + "/generate", json={"text": "abc " * 50, "sampling_params": {"max_new_tokens": 3}})
        assert (await r.json())["meta_info"]["completion_tokens"] == 3
        assert (await (await s.get(c.url + "/v1/models")).json())["data"][0]["id"] == "m1"


async def test_vllm_has_no_generate_and_none_protocol_uses_mixed():
    async with inprocess_cluster("vllm", engine=FAST) as c, aiohttp.ClientSession() as s:
        r = await s.post(c.url + "/generate", json={"text": "x"})
        assert r.status == 404 and "generate" in (await r.json())["error"]["message"]
    async with inprocess_cluster("none", engine=FAST) as c, aiohttp.ClientSession() as s:
        r = await s.post(c.url + "/v1/completions", json={"prompt": "q" * 100, "max_tokens": 2})
        assert r.status == 200
        logs = await _logs(s, c.decode)
        assert sum(len(x) for x in logs) == 1 and [e for x in logs for e in x][0]["mode"] == "local"


async def test_bad_inputs_are_openai_errors():
    async with inprocess_cluster("sglang", engine=FAST, router={"max_body_bytes": 4096}) as c, aiohttp.ClientSession() as s:
        cases = [
            (s.post(c.url + "/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}), 400),
            (s.post(c.url + "/v1/completions", json={"max_tokens": 3}), 400),
            (s.post(c.url + "/v1/chat/completions", json={"messages": []}), 400),
            (s.post(c.url + "/v1/completions", json={"prompt": "x", "max_tokens": -1}), 400),
            (s.post(c.url + "/v1/completions", json=[1, 2]), 400),
            (s.get(c.url + "/v1/nope"), 404),
            (s.get(c.url + "/v1/completions"), 405),
            (s.post(c.url + "/v1/completions", json={"prompt": "x" * 10_000}), 413),
        ]
        for coro, status in cases:
            r = await coro
            body = await r.json()
            assert r.status == status, body
            assert set(body["error"]) == {"message", "type", "code"} and body["error"]["code"] == status
            assert "Traceback" not in body["error"]["message"]
        metrics = await (await s.get(c.url + "/metrics")).text()
        assert 'pdlb_requests_total{endpoint="/v1/completions",status="413"} 1.0' in metrics
        # a known path with the wrong method keeps its name; an unknown path is one label (bounded)
        assert 'pdlb_requests_total{endpoint="/v1/completions",status="405"} 1.0' in metrics
        assert 'pdlb_requests_total{endpoint="unmatched",status="404"} 1.0' in metrics
        # the engines never saw any of them
        assert sum(len(x) for x in await _logs(s, c.engines)) == 0


async def test_admin_api_requires_key_and_manages_workers():
    async with inprocess_cluster("sglang", engine=FAST, router={"admin_api_key": "sekret"}) as c, aiohttp.ClientSession() as s:
        assert (await s.get(c.url + "/workers")).status == 401
        assert (await s.get(c.url + "/workers", headers={"Authorization": "Bearer wrong"})).status == 401
        auth = {"Authorization": "Bearer sekret"}
        ws = (await (await s.get(c.url + "/workers", headers=auth)).json())["workers"]
        assert sorted(w["role"] for w in ws) == ["decode", "decode", "prefill", "prefill"]
        d0 = c.decode[0]
        url = f"http://127.0.0.1:{d0.port}"
        r = await s.delete(c.url + "/workers", params={"url": url}, headers=auth)
        assert r.status == 200
        for _ in range(4):  # all decode traffic now goes to the remaining decode engine
            assert (await s.post(c.url + "/v1/completions", json={"prompt": "z" * 300, "max_tokens": 2})).status == 200
        logs = await _logs(s, c.decode)
        assert len(logs[0]) == 0 and len(logs[1]) == 4
        assert (await s.post(c.url + "/workers", json={"url": url, "role": "decode"}, headers=auth)).status == 201
        assert (await s.post(c.url + "/workers", json={"url": url, "role": "decode"}, headers=auth)).status == 409
        assert (await s.post(c.url + "/workers", json={"url": "ftp://x", "role": "decode"}, headers=auth)).status == 400
        assert (await s.delete(c.url + "/workers", params={"url": "http://nope:1"}, headers=auth)).status == 404


def test_admin_without_key_is_loopback_only():
    class T:
        def __init__(self, peer):
            self.peer = peer

        def get_extra_info(self, name, default=None):
            return self.peer if name == "peername" else default

        def is_closing(self):
            return False

    local = make_mocked_request("GET", "/workers", transport=T(("127.0.0.1", 5555)))
    remote = make_mocked_request("GET", "/workers", transport=T(("10.1.2.3", 5555)))
    assert admin_denied(local, None) is None
    assert admin_denied(remote, None).status == 403
    assert admin_denied(remote, "k").status == 401


async def test_retries_on_503_and_breaker_opens():
    router = {"retry": {"max_retries": 5, "initial_backoff_s": 0.001, "max_backoff_s": 0.01},
              "circuit_breaker": {"failure_threshold": 2, "open_duration_s": 60}}
    async with inprocess_cluster("sglang", engine=FAST, router=router) as c, aiohttp.ClientSession() as s:
        bad = c.decode[0]
        await s.post(f"http://127.0.0.1:{bad.port}/emulator/faults", json={"error_rate": 1.0})
        for i in range(10):
            r = await s.post(c.url + "/v1/completions", json={"prompt": f"{i} " * 200, "max_tokens": 2})
            assert r.status == 200
        bad_url = f"http://127.0.0.1:{bad.port}"
        metrics = await (await s.get(c.url + "/metrics")).text()
        assert f'pdlb_circuit_breaker_state{{worker="{bad_url}"}} 2.0' in metrics
        stats = c.state(bad).counts
        assert stats["injected_error"] == 2  # the breaker opened after 2 failures: no more traffic
        assert 'pdlb_retries_total{reason="http_503"} 2.0' in metrics
        assert _load(c) == 0


def _metric(text: str, line_prefix: str) -> float:
    """The value of the Prometheus sample line starting with ``line_prefix`` (0 if absent)."""
    for ln in text.splitlines():
        if ln.startswith(line_prefix + " "):
            return float(ln.split()[-1])
    return 0.0


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_retries_avoid_the_worker_that_failed(protocol):
    # a decode worker with nothing listening (a bound, non-listening socket: connection refused),
    # the breaker off so that only the retry exclusion keeps requests away from it. least_load
    # breaks the 0-load tie at random, so without exclusion about half of the retries would go
    # back to the dead worker (fixed seed: several of these 20 requests would need 2+ retries).
    import socket

    router = {"retry": {"max_retries": 5, "initial_backoff_s": 0.001, "max_backoff_s": 0.002},
              "circuit_breaker": {"enabled": False}, "decode_policy": {"name": "least_load"}}
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{hole.getsockname()[1]}"
        async with inprocess_cluster(protocol, num_decode=1, engine=FAST, router=router) as c, \
                aiohttp.ClientSession() as s:
            r = await s.post(c.url + "/workers", json={"url": dead, "role": "decode"})
            assert r.status == 201
            n, failed_before = 20, 0.0
            for i in range(n):
                r = await s.post(c.url + "/v1/completions", json={"prompt": f"{i} " * 200, "max_tokens": 2})
                assert r.status == 200, await r.text()
                metrics = await (await s.get(c.url + "/metrics")).text()
                failed = _metric(metrics, f'pdlb_upstream_failures_total{{kind="connect",worker="{dead}"}}')
                assert failed - failed_before <= 1  # at most one attempt of each request on the dead worker
                failed_before = failed
            retries = _metric(metrics, 'pdlb_retries_total{reason="connect"}')
            assert retries == failed_before >= 1  # every retry followed exactly one dead-worker failure
            # the healthy decode engine served each request exactly once (no failed attempt on it)
            assert sum(len(x) for x in await _logs(s, c.decode)) == n
            assert _load(c) == 0


async def test_admin_add_sglang_prefill_without_bootstrap_warns(caplog):
    async with inprocess_cluster("sglang", engine=FAST) as c, aiohttp.ClientSession() as s:
        r = await s.post(c.url + "/workers", json={"url": "http://127.0.0.1:31999", "role": "prefill"})
        assert r.status == 201
        msg = ("prefill worker http://127.0.0.1:31999 has no bootstrap port: with pd_protocol sglang its requests "
               "carry bootstrap_port null and decode engines that need it fail every PD request (502); give the "
               "engine's --disaggregation-bootstrap-port as http://127.0.0.1:31999,bootstrap=PORT (bootstrap_port: "
               "PORT in a config file), or bootstrap=none to send null on purpose")
        assert (await r.json())["warnings"] == [msg]
        assert msg in [rec.getMessage() for rec in caplog.records if rec.levelname == "WARNING"]
        r = await s.post(c.url + "/workers", json={"url": "http://127.0.0.1:31998", "role": "prefill",
                                                   "bootstrap_port": 31998})
        assert r.status == 201 and "warnings" not in await r.json()


async def test_all_workers_failing_gives_503_after_retries():
    router = {"retry": {"max_retries": 2, "initial_backoff_s": 0.001}, "circuit_breaker": {"enabled": False}}
    async with inprocess_cluster("vllm", engine=FAST, router=router) as c, aiohttp.ClientSession() as s:
        for d in c.decode:
            await s.post(f"http://127.0.0.1:{d.port}/emulator/faults", json={"error_rate": 1.0})
        r = await s.post(c.url + "/v1/completions", json={"prompt": "p" * 300, "max_tokens": 2})
        assert r.status == 503 and (await r.json())["error"]["type"] == "server_error"
        assert sum(c.state(d).counts["injected_error"] for d in c.decode) == 3  # 1 try + 2 retries
        assert _load(c) == 0


async def test_conditional_disaggregation_skips_prefill_for_short_prompts():
    async with inprocess_cluster("sglang", engine=FAST, router={"pd_min_uncached_tokens": 200}) as c, aiohttp.ClientSession() as s:
        assert (await s.post(c.url + "/v1/completions", json={"prompt": "short", "max_tokens": 2})).status == 200
        assert (await s.post(c.url + "/v1/completions", json={"prompt": "L" * 4000, "max_tokens": 2})).status == 200
        p = [e for x in await _logs(s, c.prefill) for e in x]
        d = [e for x in await _logs(s, c.decode) for e in x]
        assert len(p) == 1 and p[0]["prompt_tokens"] == 1000
        assert sorted(e["mode"] for e in d) == ["local", "remote"]


async def test_hanging_engine_times_out_and_is_aborted():
    router = {"request_timeout_s": 0.5, "retry": {"max_retries": 0}}
    async with inprocess_cluster("sglang", engine=FAST, num_decode=1, router=router) as c, aiohttp.ClientSession() as s:
        d = c.decode[0]
        await s.post(f"http://127.0.0.1:{d.port}/emulator/faults", json={"hang": True})
        t0 = time.monotonic()
        r = await s.post(c.url + "/v1/completions", json={"prompt": "h" * 400, "max_tokens": 2})
        assert r.status == 504 and time.monotonic() - t0 < 2.0
        await asyncio.sleep(0.2)
        assert c.state(d).counts["aborted"] == 1 and not c.state(d).tasks
        assert _load(c) == 0


async def test_client_disconnect_aborts_both_legs():
    # slow engines: the client leaves while the prefill runs and the decode leg waits for it
    async with inprocess_cluster("sglang", engine={"speed": 0.02}) as c, aiohttp.ClientSession() as s:
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(c.url + "/v1/completions", json={"prompt": "d" * 8000, "max_tokens": 4, "stream": True},
                              timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                await r.read()
        for _ in range(30):
            p_ab = sum(c.state(p).counts["aborted"] for p in c.prefill)
            d_ab = sum(c.state(d).counts["aborted"] for d in c.decode)
            if p_ab == 1 and d_ab == 1:
                break
            await asyncio.sleep(0.1)
        assert (p_ab, d_ab) == (1, 1)
        assert _load(c) == 0


async def test_health_and_metrics():
    async with inprocess_cluster("sglang", engine=FAST) as c, aiohttp.ClientSession() as s:
        h = await s.get(c.url + "/health")
        assert h.status == 200 and (await h.json())["routable_workers"] == {"prefill": 2, "decode": 2, "mixed": 0}
        await s.post(c.url + "/v1/completions", json={"prompt": "m" * 600, "max_tokens": 3, "stream": True})
        text = await (await s.get(c.url + "/metrics")).text()
        for name in ("pdlb_requests_total", "pdlb_request_duration_seconds_bucket", "pdlb_time_to_first_token_seconds_count",
                     "pdlb_worker_in_flight_requests", "pdlb_routing_decisions_total", "pdlb_prefix_match_ratio_bucket",
                     "pdlb_circuit_breaker_state", "pdlb_worker_healthy"):
            assert name in text, name
        assert 'pdlb_time_to_first_token_seconds_count{endpoint="completions"} 1.0' in text
        # no prometheus-client *_created series (F9/R9: disable_created_metrics): counters and
        # histograms had one per child, e.g. pdlb_requests_created{...} 1.7e9
        assert "_created" not in text, [ln for ln in text.splitlines() if "_created" in ln][:3]
        # health checks mark dead workers unroutable; no decode worker -> 503
        svc = c.router.app[SERVICE]
        for d in c.decode:
            await d.close()
        for _ in range(svc.cfg.health_check.failure_threshold):
            await svc.check_health_once()
        h = await s.get(c.url + "/health")
        assert h.status == 503 and (await h.json())["routable_workers"]["decode"] == 0


async def test_health_is_unavailable_while_every_decode_worker_refuses_connections():
    """The proxy marks a worker unreachable at a refused connection, before its breaker opens
    (10 failures) or a health round notices: /health counts only routable and reachable workers,
    so with both decode workers refusing it answers 503 at once (it said "ok" before)."""
    async with inprocess_cluster("sglang", engine=FAST) as c, aiohttp.ClientSession() as s:
        svc = c.router.app[SERVICE]
        decode = [w for w in svc.pool.workers.values() if w.role.value == "decode"]
        now = time.monotonic()
        svc.pool.record_connect_failure(decode[0], now, "UpstreamConnectError")
        h = await s.get(c.url + "/health")  # one of two decode workers left: still serving
        assert h.status == 200 and (await h.json())["routable_workers"]["decode"] == 1
        svc.pool.record_connect_failure(decode[1], now, "UpstreamConnectError")
        h = await s.get(c.url + "/health")
        body = await h.json()
        assert h.status == 503 and body["status"] == "unavailable" and body["routable_workers"]["decode"] == 0


def test_circuit_breaker_half_open_cycle():
    b = CircuitBreaker(CircuitBreakerConfig(failure_threshold=2, success_threshold=2, open_duration_s=10))
    b.record_failure(0.0)
    assert b.allows(0.0)
    b.record_failure(1.0)
    assert b.state is BreakerState.OPEN and not b.allows(5.0)
    assert b.allows(11.0) and b.state is BreakerState.HALF_OPEN
    b.record_failure(11.5)  # one failure in half-open reopens
    assert b.state is BreakerState.OPEN and not b.allows(12.0)
    assert b.allows(21.5)
    b.record_success()
    b.record_success()
    assert b.state is BreakerState.CLOSED


def test_prompt_hashing_and_config(tmp_path):
    h = PromptHasher(block_size=4, chars_per_token=4)
    n, hashes = h.hash(extract_prompt("completions", {"prompt": "a" * 40}))
    assert n == 10 and len(hashes) == 2  # 16-char chunks
    n, hashes = h.hash(extract_prompt("generate", {"input_ids": list(range(9))}))
    assert n == 9 and len(hashes) == 2
    chat = extract_prompt("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert chat == Prompt(text="user: hi\n")
    f = tmp_path / "pdlb.yaml"
    f.write_text("pd_protocol: vllm\nworkers:\n  - {url: 'http://a:1/', role: prefill}\n  - {url: 'http://b:2', role: decode, dp_size: 2}\n"
                 "decode_policy: {name: power_of_two}\nretry: {max_retries: 1}\n")
    cfg = load_service_config(f, {"port": 9000})
    assert cfg.workers[0].url == "http://a:1" and cfg.workers[1].dp_size == 2 and cfg.port == 9000
    with pytest.raises(ValueError, match="valid policies"):
        ServiceConfig.model_validate({"decode_policy": {"name": "nope"}})
    with pytest.raises(ValueError, match="mixed workers"):
        ServiceConfig.model_validate({"pd_protocol": "none", "workers": [{"url": "http://a:1", "role": "prefill"}]})


@pytest.mark.parametrize("protocol,hang_role,fault,stream", [
    ("sglang", "decode", "hang", False),               # decode accepts, sends no headers
    ("sglang", "decode", "hang_after_headers", True),  # decode sends headers, then no first chunk
    ("vllm", "prefill", "hang", False),                # prefill leg never answers
])
async def test_first_byte_timeout_retries_on_a_new_pair_and_trips_breaker(protocol, hang_role, fault, stream):
    router = {"first_byte_timeout_s": 0.3, "request_timeout_s": 30,
              "retry": {"max_retries": 3, "initial_backoff_s": 0.001, "max_backoff_s": 0.01},
              "circuit_breaker": {"failure_threshold": 1, "open_duration_s": 60},
              "prefill_policy": {"name": "round_robin"}, "decode_policy": {"name": "round_robin"}}
    async with inprocess_cluster(protocol, engine=FAST, router=router) as c, aiohttp.ClientSession() as s:
        hung = (c.decode if hang_role == "decode" else c.prefill)[0]
        hung_url = f"http://127.0.0.1:{hung.port}"
        await s.post(hung_url + "/emulator/faults", json={fault: True})
        for i in range(4):  # round robin sends one of the first two to the hung engine
            r = await s.post(c.url + "/v1/completions", json={"prompt": f"{i} " * 200, "max_tokens": 3, "stream": stream})
            assert r.status == 200
            text = await r.text()
            if stream:
                assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
            else:
                assert json.loads(text)["usage"]["completion_tokens"] == 3
        metrics = await (await s.get(c.url + "/metrics")).text()
        # exactly one attempt went to the hung engine: it timed out, was retried on a new pair, and
        # the breaker (threshold 1) took the engine out of rotation
        assert f'pdlb_circuit_breaker_state{{worker="{hung_url}"}} 2.0' in metrics
        assert 'pdlb_retries_total{reason="first_byte_timeout"} 1.0' in metrics
        assert f'pdlb_upstream_failures_total{{kind="first_byte_timeout",worker="{hung_url}"}} 1.0' in metrics
        for _ in range(20):  # the hung leg was aborted (connection closed), observed on the engine
            if c.state(hung).counts["aborted"] == 1:
                break
            await asyncio.sleep(0.05)
        assert c.state(hung).counts["aborted"] == 1 and not c.state(hung).tasks
        assert c.state(hung).counts["ok"] == 0
        assert _load(c) == 0


async def test_first_byte_timeout_exhausted_retries_give_504():
    router = {"first_byte_timeout_s": 0.2, "retry": {"max_retries": 1, "initial_backoff_s": 0.001},
              "circuit_breaker": {"enabled": False}}
    async with inprocess_cluster("sglang", engine=FAST, router=router) as c, aiohttp.ClientSession() as s:
        for d in c.decode:
            await s.post(f"http://127.0.0.1:{d.port}/emulator/faults", json={"hang": True})
        r = await s.post(c.url + "/v1/completions", json={"prompt": "z" * 400, "max_tokens": 2})
        err = (await r.json())["error"]
        assert r.status == 504 and "first_byte_timeout_s=0.2" in err["message"]
        metrics = await (await s.get(c.url + "/metrics")).text()
        assert 'pdlb_retries_total{reason="first_byte_timeout"} 1.0' in metrics  # 1 try + 1 retry
        assert _load(c) == 0


def test_encode_with_passes_the_client_body_through():
    # expected values: the JSON object {**body, **extra} (json.loads of the result compared with the
    # dict merge computed by hand), and byte identity of the client's own text where it is kept
    raw = b'{"prompt": "a\\u00e9",  "max_tokens": 2}\n'
    body = json.loads(raw)
    assert encode_with(raw, body, {}) is raw  # nothing added: forwarded as sent
    out = encode_with(raw, body, {"rid": "r1", "bootstrap_port": None})
    assert out == b'{"prompt": "a\\u00e9",  "max_tokens": 2, "rid": "r1", "bootstrap_port": null}'
    assert json.loads(out) == {"prompt": "a\u00e9", "max_tokens": 2, "rid": "r1", "bootstrap_port": None}
    assert encode_with(b" {} ", {}, {"rid": "r1"}) == b' {"rid": "r1"}'
    # a key the client already set: re-encoded with the router's value in the client's position
    body2 = {"rid": "client", "prompt": "p"}
    out2 = encode_with(json.dumps(body2).encode(), body2, {"rid": "r2"})
    assert list(json.loads(out2).items()) == [("rid", "r2"), ("prompt", "p")]
    # UTF-16 (which json.loads accepts) and unknown raw bodies are re-encoded as UTF-8
    body3 = {"prompt": "x"}
    out3 = encode_with(json.dumps(body3).encode("utf-16"), body3, {"rid": "r3"})
    assert json.loads(out3.decode("utf-8")) == {"prompt": "x", "rid": "r3"}
    assert json.loads(encode_with(None, body3, {})) == body3


def test_processes_setting_and_busy_port(capsys):
    import socket

    from balancer.service.launch import _reserve_port
    from pdlb_cli.main import main

    with pytest.raises(ValueError, match="processes"):
        ServiceConfig(processes=0)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError):  # not silently joined as another SO_REUSEPORT listener
            _reserve_port("127.0.0.1", port)
        code = main(["serve", "--processes", "2", "--port", str(port), "--pd-protocol", "none",
                     "--mixed", "http://127.0.0.1:9"])
    err = capsys.readouterr().err  # less the host-dependent open-file warning (tests/service/test_fd_limit.py)
    err = "".join(line for line in err.splitlines(keepends=True) if not line.startswith("warning: the open-file limit ("))
    assert code == 2 and err == (
        f"error: port {port} is already in use on 127.0.0.1 (another pdlb serve or engine still running?)\n")
    free = _reserve_port("127.0.0.1", 0)
    try:
        assert free.getsockname()[1] > 0
    finally:
        free.close()


def test_max_output_tokens_reads_each_api_spelling():
    # shared by the router (load accounting) and the emulated engine (output length)
    from balancer.service.prompt import PromptError, max_output_tokens

    assert max_output_tokens("generate", {"sampling_params": {"max_new_tokens": 7}}, 16) == 7
    assert max_output_tokens("generate", {"sampling_params": "junk"}, 16) == 16
    assert max_output_tokens("chat", {"max_completion_tokens": 5, "max_tokens": 9}, 16) == 5
    assert max_output_tokens("completions", {"max_tokens": 9}, 16) == 9
    assert max_output_tokens("completions", {}, 16) == 16
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(PromptError, match="positive integer"):
            max_output_tokens("completions", {"max_tokens": bad}, 16)


def test_cost_model_is_learned_only_for_policies_that_read_it():
    """The online cost-model fit is skipped when no pool's policy reads the model: that is every
    policy whose module never mentions ``cost_model`` (checked over all policies, so a new
    cost-based policy cannot be missed), and the prefill policy of a ``pd_protocol: none`` router
    (no prefill pool)."""
    import inspect

    from balancer.policies import available_policies, make_policy
    from balancer.service.app import COST_MODEL_POLICIES, Service

    reads = {n for n in available_policies()
             if "cost_model" in inspect.getsource(inspect.getmodule(type(make_policy(n))))}
    assert reads == COST_MODEL_POLICIES == {"ep_aware"}
    w = [{"url": "http://127.0.0.1:9", "role": "mixed"}]
    for decode, prefill, proto, learns in [("round_robin", "ep_aware", "none", False), ("ep_aware", "round_robin", "none", True),
                                           ("round_robin", "ep_aware", "sglang", True),
                                           ("round_robin", "least_load", "sglang", False)]:
        cfg = ServiceConfig.model_validate({"pd_protocol": proto, "workers": w if proto == "none" else [],
                                            "decode_policy": {"name": decode}, "prefill_policy": {"name": prefill}})
        assert (Service(cfg).router.cost_learner is not None) is learns, (decode, prefill, proto)
    cfg = ServiceConfig.model_validate({"decode_policy": {"name": "ep_aware"}, "learn_cost_model": False})
    assert Service(cfg).router.cost_learner is None


@pytest.mark.parametrize("field, value", [("stale_after_s", 1e308), ("stale_after_s", float("inf")),
                                          ("replay_timeout_s", 601.0), ("replay_timeout_s", float("nan"))])
def test_kv_event_timers_are_bounded(field, value):
    # 1e308 and inf are refused: every timer of the subscriber must stay finite
    from pydantic import ValidationError

    from balancer.service.config import KvEventsConfig

    with pytest.raises(ValidationError, match=field):
        KvEventsConfig(**{field: value})
    assert getattr(KvEventsConfig(**{field: 600.0}), field) == 600.0


async def test_session_header_reaches_the_router_as_request_session_id():
    # issue 23: vllm-router keys its DP-aware ring on x-session-id; pdlb's service passes the
    # header (else the body's session_id / user) to the Router as Request.session_id, so
    # session-affine policies keep a conversation on one replica
    from balancer.service.request_checks import session_id_of
    from balancer.service.prompt import PromptError
    assert session_id_of({}, {"X-Session-Id": "s1", "X-User-Id": "u"}) == "s1"
    assert session_id_of({"user": "u2"}, {}) == "u2" and session_id_of({"session_id": "s", "user": "u"}, {}) == "s"
    assert session_id_of({"user": None}, {}) is None and session_id_of({}, {}) is None
    with pytest.raises(PromptError):
        session_id_of({}, {"X-Session-Id": "x" * 10_000})
    async with inprocess_cluster("none", num_decode=4, engine=FAST,
                                 router={"decode_policy": "dp_consistent_hash"}) as c, aiohttp.ClientSession() as s:
        for k in range(6):  # different prompts, one session: one engine
            r = await s.post(c.url + "/v1/completions", json={"prompt": f"turn {k} " * (20 + k), "max_tokens": 2},
                             headers={"X-Session-Id": "agent-7"})
            assert r.status == 200
        counts = sorted(len(x) for x in await _logs(s, c.decode))
        assert counts == [0, 0, 0, 6]
        r = await s.post(c.url + "/v1/completions", json={"prompt": "p", "max_tokens": 1, "session_id": "bad\x01id"})
        assert r.status == 400 and "session id" in (await r.json())["error"]["message"]
