"""A worker whose connections are refused (review findings 4 and 5, session 14).

* A refused connection starts an early health probe of its worker (one in flight per worker, at
  most one per ``EARLY_PROBE_MIN_GAP_S``); if that fails too the worker is unhealthy and not
  routable at once, instead of after ``health_check.failure_threshold`` rounds ``interval_s``
  (60 s) apart while every request routed there pays a connect retry.
* ``reachable`` is ``null`` in ``/workers`` until a request or probe (health or capabilities) got an
  answer or a connection was refused (``POST /workers`` used to answer ``reachable: true`` before anything was tried).

Expected values follow from the rules above by hand (counts of probes started, states).
"""
from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
from aiohttp.test_utils import TestServer

from balancer.policies import make_policy
from balancer.router import Router
from balancer.service.app import create_app
from balancer.service.config import CircuitBreakerConfig, HealthCheckConfig, ServiceConfig, WorkerConfig
from balancer.service.workers import EARLY_PROBE_MIN_GAP_S, WorkerPool

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _pool() -> WorkerPool:
    return WorkerPool(Router(make_policy("round_robin"), make_policy("round_robin")), CircuitBreakerConfig(),
                      HealthCheckConfig())


def _dead_port() -> int:
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_reachable_is_unknown_until_something_answers_or_is_refused():
    pool = _pool()
    w = pool.add(WorkerConfig(url="http://127.0.0.1:9", role="mixed"))
    assert w.describe()["reachable"] is None  # nothing tried yet
    pool.record_health(w, False, 1.0)  # a failed probe does not say whether a connection opened
    assert w.describe()["reachable"] is None
    pool.record_result(w, False, 2.0)  # nor does a failed request (timeout, 5xx, ...)
    assert w.describe()["reachable"] is None
    pool.record_connect_failure(w, 3.0, "UpstreamConnectError")
    assert w.describe()["reachable"] is False
    pool.record_result(w, True, 4.0)
    assert w.describe()["reachable"] is True
    other = pool.add(WorkerConfig(url="http://127.0.0.1:10", role="mixed"))
    pool.record_health(other, True, 5.0)
    assert other.describe()["reachable"] is True


def test_a_refused_connection_starts_one_bounded_early_probe():
    pool = _pool()
    w = pool.add(WorkerConfig(url="http://127.0.0.1:9", role="mixed"))
    started: list[float] = []
    pool.early_probe = lambda worker: started.append(worker.last_early_probe_s)
    for t in (10.0, 10.1, 10.5):  # the first starts a probe; the others find it in flight
        pool.record_connect_failure(w, t, "UpstreamConnectError")
    assert started == [10.0] and w.early_probe_in_flight
    pool.record_early_probe(w, True, 10.6)  # it answered after all: stays healthy and routable
    assert w.healthy and w.routable and not w.early_probe_in_flight
    pool.record_connect_failure(w, 10.0 + EARLY_PROBE_MIN_GAP_S / 2, "UpstreamConnectError")
    assert started == [10.0]  # none in flight, but the last began less than the gap ago
    pool.record_connect_failure(w, 10.0 + EARLY_PROBE_MIN_GAP_S, "UpstreamConnectError")
    assert started == [10.0, 10.0 + EARLY_PROBE_MIN_GAP_S]
    pool.record_early_probe(w, False, 11.2)  # refused and the probe failed: out at once
    assert not w.healthy and not w.routable and w in pool.to_probe()
    assert w.describe()["healthy"] is False and w.describe()["circuit"] == "closed"
    pool.record_connect_failure(w, 20.0, "UpstreamConnectError")  # already unhealthy: the prober's job
    assert len(started) == 2
    # back after health_check.success_threshold (2) passing probes of the prober
    pool.record_health(w, True, 21.0)
    assert not w.routable
    pool.record_health(w, True, 22.0)
    assert w.healthy and w.routable and w.describe()["reachable"] is True


def test_an_early_probe_cut_short_or_of_a_removed_worker_changes_nothing():
    pool = _pool()
    w = pool.add(WorkerConfig(url="http://127.0.0.1:9", role="mixed"))
    pool.early_probe = lambda worker: None
    pool.record_connect_failure(w, 1.0, "UpstreamConnectError")
    pool.record_early_probe(w, None, 1.5)  # shutdown: not run
    assert w.healthy and w.routable and not w.early_probe_in_flight
    pool.record_connect_failure(w, 3.0, "UpstreamConnectError")
    pool.remove(w.url)
    pool.record_early_probe(w, False, 3.5)
    assert w.healthy and not w.early_probe_in_flight


async def test_a_dead_worker_is_unhealthy_about_a_second_after_its_first_refused_connection():
    dead = f"http://127.0.0.1:{_dead_port()}"
    cfg = ServiceConfig.model_validate({
        "pd_protocol": "none", "port": 0,
        "health_check": {"enabled": True, "interval_s": 60.0, "timeout_s": 2.0},
        "retry": {"max_retries": 1, "initial_backoff_s": 0.001},
        "workers": [{"url": dead, "role": "mixed"}]})
    server = TestServer(create_app(cfg), host="127.0.0.1")
    await server.start_server()
    url = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession() as s:
            w = (await (await s.get(url + "/workers")).json())["workers"][0]
            assert w["reachable"] is None and w["healthy"] is True  # nothing tried yet
            r = await s.post(url + "/v1/chat/completions", json={"model": "m", **CHAT})
            assert r.status in (502, 503)
            t0 = time.monotonic()
            while True:  # the early probe runs in the background; a refused connect takes ~ms
                w = (await (await s.get(url + "/workers")).json())["workers"][0]
                if not w["healthy"] or time.monotonic() - t0 > 5.0:
                    break
                await asyncio.sleep(0.02)
            took_s = time.monotonic() - t0
            # before: healthy for up to 3 x 60 s (health_check.failure_threshold rounds)
            assert w["healthy"] is False and w["routable"] is False and w["reachable"] is False, w
            assert took_s < 2.0  # ~ms on an idle machine; slack for a loaded one
            added = await s.post(url + "/workers", json={"url": f"http://127.0.0.1:{_dead_port()}", "role": "mixed"})
            assert added.status == 201
            assert (await added.json())["reachable"] is None  # not probed yet: unknown, not true
    finally:
        await server.close()


async def test_a_worker_that_answered_the_capability_probe_is_reachable_before_any_request():
    # review F2 (session 15): the registration's capability probe got an HTTP answer (so a connection
    # opened), yet /workers said reachable: null until a request or the first health round (60 s)
    from sim.emulator.testing import inprocess_cluster

    async with inprocess_cluster("none", num_decode=1,
                                 router={"health_check": {"enabled": True, "interval_s": 60.0}}) as cluster:
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            while True:
                w = (await (await s.get(f"{cluster.url}/workers")).json())["workers"][0]
                if w["capabilities"]["probed"] or time.monotonic() - t0 > 10.0:
                    break
                await asyncio.sleep(0.02)
            assert w["capabilities"]["probed"] is True and w["capabilities"]["served_models"] == ["pdlb-emulated"]
            assert w["reachable"] is True and w["connect_failures"] == 0, w
            metrics = await (await s.get(f"{cluster.url}/metrics")).text()
            assert f'pdlb_worker_reachable{{worker="{w["url"]}"}} 1.0' in metrics
