"""Reliability and security of the router service (issue 14, items 1-10), on emulated engines.

Each test names the item it pins; the fuzzers and the fault matrix that cover whole classes of
failure are in ``tests/service/test_service_fuzz.py`` and ``tests/service/test_service_faults.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import tracemalloc

import aiohttp
import pytest
from aiohttp.test_utils import make_mocked_request

from balancer.prefix_index import PrefixIndex
from balancer.router import Router
from balancer.service.app import SERVICE, admin_denied, is_loopback
from balancer.service.config import ServiceConfig, WorkerConfig, load_service_config
from balancer.service.workers import MAX_REPLICAS, WorkerPool
from balancer.types import ReplicaId
from sim.emulator.testing import inprocess_cluster

FAST = {"speed": 20.0}
NO_BACKOFF = {"initial_backoff_s": 0.001, "max_backoff_s": 0.005}


def _load(cluster) -> int:
    router = cluster.router.app[SERVICE].router
    return router.load.num_in_flight + int(router.load.num_requests.sum())


async def _engine_log(s: aiohttp.ClientSession, servers) -> list[dict]:
    out: list[dict] = []
    for srv in servers:
        async with s.get(f"http://127.0.0.1:{srv.port}/emulator/requests") as r:
            out += await r.json()
    return out


def _url(server) -> str:
    return f"http://127.0.0.1:{server.port}"


async def _workers(s: aiohttp.ClientSession, c) -> dict[str, dict]:
    return {w["url"]: w for w in (await (await s.get(c.url + "/workers")).json())["workers"]}


# ---------------------------------------------------------------------- item 1: request ids
@pytest.mark.parametrize("protocol", ["sglang", "none"])
async def test_same_client_id_twice_neither_request_is_hurt(protocol):
    # before: both requests reached the engine as rid "same"; the second got 400 from the engine and
    # its cleanup sent /abort_request for "same", killing the first one's stream
    async with inprocess_cluster(protocol, num_prefill=1, num_decode=1, engine={"speed": 2.0}) as c, \
            aiohttp.ClientSession() as s:
        async def one(how: str) -> tuple[int, str, str]:
            body = {"prompt": "p " * 100, "max_tokens": 8, "stream": True}
            headers = {}
            if how == "rid":
                body["rid"] = "same"
            else:
                headers["X-Request-Id"] = "same"
            async with s.post(c.url + "/v1/completions", json=body, headers=headers) as r:
                return r.status, await r.text(), r.headers.get("X-Request-Id", "")
        results = await asyncio.gather(one("rid"), one("header"), one("rid"))
        for status, text, rid in results:
            assert status == 200 and rid == "same"
            assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
            events = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]
            assert len(events) >= 8 and all(e["id"] == "same" for e in events)  # the client's id, mapped back
        log = await _engine_log(s, c.engines)
        decode_ids = [e["rid"] for e in log if e["endpoint"] == "completions" and e["mode"] != "prefill"]
        assert len(decode_ids) == 3 and len(set(decode_ids)) == 3 and "same" not in decode_ids
        assert all(e["status"] == "ok" for e in log if "status" in e)
        assert _load(c) == 0


async def test_retry_gets_a_new_upstream_id_and_the_client_sees_none_of_them():
    # one decode engine always answers 503: the retry goes to the other with a new id; the client's
    # response id has no retry suffix (item 9) and is the first attempt's id when it gave none
    router = {"retry": {"max_retries": 3, **NO_BACKOFF}, "decode_policy": {"name": "round_robin"}}
    async with inprocess_cluster("sglang", num_prefill=1, num_decode=2, engine=FAST, router=router) as c, \
            aiohttp.ClientSession() as s:
        await s.post(_url(c.decode[0]) + "/emulator/faults", json={"error_rate": 1.0})
        seen = set()
        for _ in range(4):
            r = await s.post(c.url + "/v1/completions", json={"prompt": "x " * 50, "max_tokens": 2})
            body = await r.json()
            assert r.status == 200
            assert body["id"] == r.headers["X-Request-Id"] and "-r" not in body["id"].rpartition("-")[2]
            seen.add(body["id"])
        assert len(seen) == 4
        # one id per attempt, on both of its legs: every attempt that reached a decode engine has its own
        # (the failing emulated engine logs nothing; the prefill engine logs every attempt)
        d_ids = [e["rid"] for e in await _engine_log(s, c.decode)]
        p_ids = [e["rid"] for e in await _engine_log(s, c.prefill)]
        n_failed = c.state(c.decode[0]).counts["injected_error"]
        assert n_failed >= 1 and len(d_ids) == len(set(d_ids)) == 4
        assert len(p_ids) == len(set(p_ids)) == 4 + n_failed and set(d_ids) < set(p_ids) and seen <= set(p_ids)


@pytest.mark.parametrize("rid,field", [(["a", "b"], "rid"), ({"x": 1}, "rid"), ("", "rid"), ("a" * 300, "rid"),
                                       ("bad\nid", "rid")])
async def test_bad_client_ids_are_refused(rid, field):
    async with inprocess_cluster("none", num_decode=1, engine=FAST) as c, aiohttp.ClientSession() as s:
        r = await s.post(c.url + "/v1/completions", json={"prompt": "x", "rid": rid})
        err = (await r.json())["error"]
        assert r.status == 400 and f"'{field}'" in err["message"] and "[" not in err["message"].split(":")[0]
        r = await s.post(c.url + "/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "h" * 257})
        assert r.status == 400 and "'X-Request-Id'" in (await r.json())["error"]["message"]


# ---------------------------------------------------------------------- item 2: admin input, memory
async def test_admin_bounds_and_atomic_registration():
    async with inprocess_cluster("sglang", num_prefill=1, num_decode=1, engine=FAST) as c, \
            aiohttp.ClientSession() as s:
        svc = c.router.app[SERVICE]
        n_before = len(svc.router.replicas())
        for body in ({"url": "http://127.0.0.1:9", "role": "decode", "dp_size": 100_000},
                     {"url": "http://127.0.0.1:9", "role": "decode", "dp_size": 2**31},
                     {"url": "http://127.0.0.1:9", "role": "decode", "dp_size": "8"},     # strings are not counts
                     {"url": "http://127.0.0.1:9", "role": "decode", "dp_size": True},    # nor booleans
                     {"url": "http://127.0.0.1:9", "role": "decode", "kv_capacity_tokens": 10**30},
                     {"url": "http://u:secret@127.0.0.1:9", "role": "decode"},
                     {"url": "http://127.0.0.1:9/v1", "role": "decode"},
                     {"url": "http://127.0.0.1:9?x=1", "role": "decode"},
                     {"url": "http://127.0.0.1:9/" + "a" * 5000, "role": "decode"}):
            r = await s.post(c.url + "/workers", json=body)
            text = await r.text()
            assert r.status == 400 and "secret" not in text, (body, text)
        assert len(svc.router.replicas()) == n_before
        # a registration that fails half-way leaves nothing behind (before: ghost replicas that routes
        # picked, answered 503 "worker was removed")
        real_add = svc.router.add_replica
        calls = []

        def failing_add(rep, role, kv=0):  # noqa: ANN001, ANN202
            calls.append(rep)
            if len(calls) == 3:
                raise ValueError("injected")
            real_add(rep, role, kv)
        svc.router.add_replica = failing_add
        with pytest.raises(ValueError, match="injected"):
            svc.pool.add(WorkerConfig(url="http://127.0.0.1:9", role="decode", dp_size=8))
        svc.router.add_replica = real_add
        assert len(svc.router.replicas()) == n_before and "http://127.0.0.1:9" not in svc.pool.workers
        for _ in range(5):
            r = await s.post(c.url + "/v1/completions", json={"prompt": "y " * 30, "max_tokens": 2})
            assert r.status == 200


def test_pool_bounds_total_replicas():
    pool = WorkerPool(Router(), ServiceConfig().circuit_breaker, ServiceConfig().health_check)
    n = 0
    while pool.num_replicas + 1024 <= MAX_REPLICAS:
        pool.add(WorkerConfig(url=f"http://127.0.0.1:{1000 + n}", role="decode", dp_size=1024))
        n += 1
    with pytest.raises(ValueError, match="at most 16384"):
        pool.add(WorkerConfig(url="http://127.0.0.1:9", role="decode", dp_size=1024))
    assert pool.num_replicas == MAX_REPLICAS == 16 * 1024 and len(pool.router.replicas()) == MAX_REPLICAS


def test_prefix_index_replica_memory_is_linear():
    # before: each replica kept its bit (1 << number), n**2 / 16 bytes in all (20,000 replicas:
    # 25 MB); now a replica costs a constant few hundred bytes (20,000: a few MB)
    index = PrefixIndex(1024)
    tracemalloc.start()
    for k in range(20_000):
        index.register(ReplicaId("http://e", k))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 12e6, peak
    # and the numbers still work (match against a high-numbered replica)
    hi = ReplicaId("http://e", 19_999)
    index.insert(hi, [1, 2, 3])
    assert index.match([1, 2, 9]) == {hi: 2} and index.holds(hi, 3) and not index.holds(ReplicaId("http://e", 0), 3)


# ---------------------------------------------------------------------- item 3: breaker
async def test_breaker_counts_one_failure_per_client_request():
    # the only decode worker answers 503; each client request makes 1 + 3 attempts on it (a pool whose
    # every worker failed is used whole); before, each attempt counted, so a 10-failure breaker opened
    # after 3 client requests; now 2 client requests are 2 failures
    router = {"retry": {"max_retries": 3, **NO_BACKOFF}, "circuit_breaker": {"failure_threshold": 100}}
    async with inprocess_cluster("none", num_decode=1, engine=FAST, router=router) as c, aiohttp.ClientSession() as s:
        dead = c.decode[0]
        await s.post(_url(dead) + "/emulator/faults", json={"error_rate": 1.0, "error_status": 503})
        for _ in range(2):
            r = await s.post(c.url + "/v1/completions", json={"prompt": "z " * 10, "max_tokens": 1})
            assert r.status == 503
        w = (await _workers(s, c))[_url(dead)]
        assert c.state(dead).counts["injected_error"] == 8 and w["consecutive_failures"] == 2


async def test_traffic_returns_soon_after_both_workers_recover(caplog):
    # both decode workers fail (503) until their breakers open; open_duration_s is 60 s, but a passing
    # health probe (every 0.2 s) lets trial requests through: traffic returns within ~1 s of recovery
    router = {"retry": {"max_retries": 2, **NO_BACKOFF}, "health_check": {"enabled": True, "interval_s": 60},
              "circuit_breaker": {"failure_threshold": 2, "open_duration_s": 60, "probe_interval_s": 0.2,
                                  "success_threshold": 1}}
    caplog.set_level(logging.INFO, logger="pdlb.service")
    async with inprocess_cluster("none", num_decode=2, engine=FAST, router=router) as c, aiohttp.ClientSession() as s:
        svc = c.router.app[SERVICE]
        for d in c.decode:
            await s.post(_url(d) + "/emulator/faults", json={"error_rate": 1.0, "error_status": 503})
        for _ in range(4):
            await s.post(c.url + "/v1/completions", json={"prompt": "q", "max_tokens": 1})
        assert all(w.breaker.state.name == "OPEN" for w in svc.pool.workers.values())
        metrics = await (await s.get(c.url + "/metrics")).text()
        assert 'pdlb_circuit_breaker_state{worker="%s"} 2.0' % _url(c.decode[0]) in metrics
        assert 'pdlb_circuit_breaker_transitions_total{state="open",worker="%s"} 1.0' % _url(c.decode[1]) in metrics
        assert sum("circuit breaker of" in r.message and "opened" in r.message for r in caplog.records) == 2
        for d in c.decode:
            await s.post(_url(d) + "/emulator/faults", json={"error_rate": 0.0})
        t0 = time.monotonic()
        while True:
            r = await s.post(c.url + "/v1/completions", json={"prompt": "q", "max_tokens": 1})
            if r.status == 200:
                break
            assert time.monotonic() - t0 < 2.0, "traffic did not return within 2 s of recovery"
            await asyncio.sleep(0.05)
        for _ in range(6):  # and it stays back: no 503 while the workers are healthy
            r = await s.post(c.url + "/v1/completions", json={"prompt": "q", "max_tokens": 1})
            assert r.status == 200
        assert any("half-open" in r.message for r in caplog.records)
        assert all(w.breaker.state.name == "CLOSED" for w in svc.pool.workers.values())


# ---------------------------------------------------------------------- item 4: request-caused errors
async def test_request_caused_500_is_not_retried_on_every_worker_nor_charged():
    # every engine answers 500 to this request (as real engines do to a field they cannot parse):
    # one retry (a second worker, same answer) and then the engine's answer; no breaker charged
    router = {"retry": {"max_retries": 5, **NO_BACKOFF}, "decode_policy": {"name": "round_robin"}}
    async with inprocess_cluster("none", num_decode=3, engine=FAST, router=router) as c, aiohttp.ClientSession() as s:
        for d in c.decode:
            await s.post(_url(d) + "/emulator/faults", json={"error_rate": 1.0, "error_status": 500})
        r = await s.post(c.url + "/v1/completions", json={"prompt": "bad", "max_tokens": 1})
        assert r.status == 500 and (await r.json())["error"]["message"] == "injected fault"  # the engine's own
        assert sum(c.state(d).counts["injected_error"] for d in c.decode) == 2
        assert all(w["consecutive_failures"] == 0 for w in (await _workers(s, c)).values())
        # a 500 from one worker while another serves the request: that worker is charged (once)
        await s.post(_url(c.decode[1]) + "/emulator/faults", json={"error_rate": 0.0})
        await s.post(_url(c.decode[2]) + "/emulator/faults", json={"error_rate": 0.0})
        before = c.state(c.decode[0]).counts["injected_error"]
        for _ in range(3):  # round robin: at least one of them starts on decode[0]
            r = await s.post(c.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 1})
            assert r.status == 200
        ws = await _workers(s, c)
        hit = c.state(c.decode[0]).counts["injected_error"] - before
        assert ws[_url(c.decode[0])]["consecutive_failures"] == hit >= 1


async def test_failed_prefill_is_not_charged_to_the_decode_worker():
    router = {"retry": {"max_retries": 1, **NO_BACKOFF}, "circuit_breaker": {"failure_threshold": 100}}
    async with inprocess_cluster("sglang", num_prefill=1, num_decode=1, engine=FAST, router=router) as c, \
            aiohttp.ClientSession() as s:
        await s.post(_url(c.prefill[0]) + "/emulator/faults", json={"error_rate": 1.0, "error_status": 503})
        for stream in (False, True, False):
            r = await s.post(c.url + "/v1/completions", json={"prompt": "p " * 40, "max_tokens": 2, "stream": stream})
            assert r.status == 503
        ws = await _workers(s, c)
        assert ws[_url(c.decode[0])]["consecutive_failures"] == 0
        assert ws[_url(c.prefill[0])]["consecutive_failures"] == 3  # once per client request, not per attempt
        assert _load(c) == 0


# ---------------------------------------------------------------------- items 5, 7: request checks
@pytest.mark.parametrize("body,field", [
    ({"prompt": "x", "bootstrap_host": "10.0.0.1"}, "bootstrap_host"),
    ({"prompt": "x", "bootstrap_port": 1}, "bootstrap_port"),
    ({"prompt": "x", "bootstrap_room": 7}, "bootstrap_room"),
    ({"prompt": "x", "kv_transfer_params": {"remote_host": "10.0.0.1"}}, "kv_transfer_params"),
    ({"prompt": "x", "data_parallel_rank": "abc"}, "data_parallel_rank"),
    ({"prompt": "x", "max_tokens": 10**7}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 1000}, "n"),
    ({"prompt": "x", "stream": "fals"}, "stream"),  # "false" is a boolean to vLLM and SGLang (lax_bool)
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "stop": [1, 2]}, "stop"),
    ({"prompt": [1, 2, 2**32]}, "prompt"),
    ({"prompt": [[1], [2**40]]}, "prompt"),
])
async def test_bad_fields_get_a_400_naming_them(body, field):
    async with inprocess_cluster("sglang", num_prefill=1, num_decode=1, engine=FAST) as c, \
            aiohttp.ClientSession() as s:
        r = await s.post(c.url + "/v1/completions", json=body)
        err = (await r.json())["error"]
        assert r.status == 400 and err["type"] == "invalid_request_error" and f"'{field}" in err["message"], err
        assert not await _engine_log(s, c.engines)  # nothing reached an engine


@pytest.mark.parametrize("raw,what", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"prompt": "x", "temperature": NaN}', "NaN"),
    (b'{"prompt": "x", "temperature": Infinity}', "Infinity"),
    (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "invalid JSON"),
])
async def test_hostile_json_gets_400(raw, what):
    async with inprocess_cluster("none", num_decode=1, engine=FAST) as c, aiohttp.ClientSession() as s:
        r = await s.post(c.url + "/v1/completions", data=raw, headers={"Content-Type": "application/json"})
        assert r.status == 400 and what in (await r.json())["error"]["message"]
        r = await s.post(c.url + "/v1/completions", json={"prompt": "still fine", "max_tokens": 1})
        assert r.status == 200


async def test_max_model_len():
    async with inprocess_cluster("none", num_decode=1, engine=FAST, router={"max_model_len": 100}) as c, \
            aiohttp.ClientSession() as s:
        r = await s.post(c.url + "/v1/completions", json={"prompt": list(range(90)), "max_tokens": 11})
        assert r.status == 400 and "max_model_len=100" in (await r.json())["error"]["message"]
        r = await s.post(c.url + "/v1/completions", json={"prompt": list(range(90)), "max_tokens": 10})
        assert r.status == 200


def test_worker_urls_with_credentials_path_or_query_are_refused():
    for url, why in (("http://user:pw@10.0.0.1:8000", "user name or password"), ("http://10.0.0.1:8000/v1", "path"),
                     ("http://10.0.0.1:8000?a=b", "query"), ("http://10.0.0.1:8000#f", "fragment")):
        with pytest.raises(ValueError, match=why) as e:
            load_service_config(None, {"workers": [{"url": url, "role": "decode"}]})
        assert "pw" not in str(e.value)
    assert WorkerConfig(url="http://10.0.0.1:8000/", role="decode").url == "http://10.0.0.1:8000"


# ---------------------------------------------------------------------- item 6: no prefill
async def test_no_routable_prefill_gives_503_not_a_decode_only_request(caplog):
    router = {"retry": {"max_retries": 1, **NO_BACKOFF}, "circuit_breaker": {"failure_threshold": 1}}
    caplog.set_level(logging.WARNING, logger="pdlb.service")
    async with inprocess_cluster("sglang", num_prefill=1, num_decode=1, engine=FAST, router=router) as c, \
            aiohttp.ClientSession() as s:
        await s.post(_url(c.prefill[0]) + "/emulator/faults", json={"error_rate": 1.0, "error_status": 503})
        r = await s.post(c.url + "/v1/completions", json={"prompt": "p " * 40, "max_tokens": 2})
        assert r.status == 503
        n_decode = len(await _engine_log(s, c.decode))
        r = await s.post(c.url + "/v1/completions", json={"prompt": "p " * 40, "max_tokens": 2})
        assert r.status == 503 and "no healthy prefill worker" in (await r.json())["error"]["message"]
        assert len(await _engine_log(s, c.decode)) == n_decode  # the decode engine got nothing without bootstrap
        h = await s.get(c.url + "/health")
        assert h.status == 503 and (await h.json())["status"] == "no_prefill"
        assert any("no routable prefill worker" in r.message for r in caplog.records)


# ---------------------------------------------------------------------- item 9: metrics of failed streams
async def test_a_stream_that_fails_mid_way_is_not_counted_as_200():
    async with inprocess_cluster("none", num_decode=1, engine={"speed": 5.0}) as c, aiohttp.ClientSession() as s:
        await s.post(_url(c.decode[0]) + "/emulator/faults", json={"die_after_tokens": 3})
        r = await s.post(c.url + "/v1/completions", json={"prompt": "x", "max_tokens": 20, "stream": True})
        text = await r.text()
        assert r.status == 200 and '"error"' in text
        metrics = await (await s.get(c.url + "/metrics")).text()
        assert 'pdlb_requests_total{endpoint="/v1/completions",status="502"} 1.0' in metrics
        assert 'status="200"' not in metrics.split("pdlb_requests_total", 1)[1].split("# HELP", 1)[0]
        assert _load(c) == 0


# ---------------------------------------------------------------------- item 10: admin access
def test_loopback_check_and_non_loopback_bind():
    for peer, ok in (("127.0.0.1", True), ("127.9.9.9", True), ("::1", True), ("::ffff:127.0.0.1", True),
                     ("10.0.0.1", False), ("::ffff:10.0.0.1", False), ("", False), (None, False), ("garbage", False)):
        assert is_loopback(peer) is ok, peer
    req = make_mocked_request("GET", "/workers")
    assert admin_denied(req, "k").status == 401
    with pytest.raises(ValueError, match="admin_api_key"):
        load_service_config(None, {"host": "0.0.0.0"})
    assert load_service_config(None, {"host": "0.0.0.0", "admin_api_key": "k"}).host == "0.0.0.0"
    assert load_service_config(None, {"host": "0.0.0.0", "allow_unauthenticated_admin": True}).host == "0.0.0.0"
    assert load_service_config(None, {"host": "::1"}).host == "::1"


# ---------------------------------------------------------------------- item 8: slow clients
async def test_slow_clients_are_cut_off_and_connections_are_limited():
    from balancer.service.app import create_app, json_parser_errors, limit_connections, make_runner

    cfg = ServiceConfig.model_validate({"pd_protocol": "none", "port": 0, "client_idle_timeout_s": 0.5,
                                        "body_read_timeout_s": 0.5, "max_connections": 4,
                                        "health_check": {"enabled": False}})
    runner = make_runner(create_app(cfg), cfg)
    await runner.setup()
    limit_connections(runner, cfg.max_connections)
    json_parser_errors(runner)
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        # slowloris: headers never complete -> closed after the idle timeout (was: held ~1 h)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        await w.drain()
        t0 = time.monotonic()
        try:
            for _ in range(30):
                await asyncio.sleep(0.1)
                w.write(b"X-a: b\r\n")  # a header line now and then does not keep it open
                await w.drain()
            data = await asyncio.wait_for(r.read(), 3.0)
        except ConnectionError:
            data = b""
        took = time.monotonic() - t0
        assert data == b"" and 0.4 < took < 2.0, took
        w.close()
        # a body that never arrives -> 408 JSON
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{\"prompt\"")
        await w.drain()
        head = await asyncio.wait_for(r.read(65536), 3.0)
        assert head.startswith(b"HTTP/1.1 408") and b"body_read_timeout_s" in head
        w.close()
        # HTTP parser errors are OpenAI-style JSON too (item 7), not text/plain
        for bad in (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(bad)
            await w.drain()
            raw = await asyncio.wait_for(r.read(), 3.0)
            w.close()
            head, _, body = raw.partition(b"\r\n\r\n")
            assert head.split(b" ")[1] == b"400" and b"application/json" in head, raw
            assert b"\r\nX-Request-Id: pdlb-" in head, raw  # every answer has one (issue 30)
            err = json.loads(body)["error"]
            assert err["code"] == 400 and err["message"].startswith("malformed HTTP request"), err
        # connections beyond max_connections are closed at once; the first ones still work
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(6)]
        await asyncio.sleep(0.1)
        closed = 0
        for rr, ww in conns:
            ww.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                data = await asyncio.wait_for(rr.read(12), 2.0)
            except ConnectionError:
                data = b""
            closed += data == b""
            ww.close()
        assert closed == 2
    finally:
        await runner.cleanup()


async def test_wedged_sglang_prefill_is_charged_not_its_decode():
    # the prefill engine accepts and never answers; the decode engine gives up waiting for the KV
    # (bootstrap timeout 0.3 s) first: the prefill worker is charged (kind prefill_stalled) and the
    # request is retried on the other prefill worker
    router = {"retry": {"max_retries": 2, **NO_BACKOFF}, "prefill_policy": {"name": "round_robin"},
              "circuit_breaker": {"failure_threshold": 100}}
    async with inprocess_cluster("sglang", num_prefill=2, num_decode=1, engine={"speed": 20.0, "bootstrap_timeout_s": 0.3},
                                 router=router) as c, aiohttp.ClientSession() as s:
        # round robin takes the replicas in the router's order (sorted by URL): hang the first
        first = min(c.prefill, key=_url)
        await s.post(_url(first) + "/emulator/faults", json={"hang": True})
        r = await s.post(c.url + "/v1/completions", json={"prompt": "w " * 40, "max_tokens": 2})
        assert r.status == 200
        ws = await _workers(s, c)
        assert ws[_url(c.decode[0])]["consecutive_failures"] == 0
        assert ws[_url(first)]["consecutive_failures"] == 1
        metrics = await (await s.get(c.url + "/metrics")).text()
        assert f'pdlb_upstream_failures_total{{kind="prefill_stalled",worker="{_url(first)}"}}' in metrics
        assert _load(c) == 0
