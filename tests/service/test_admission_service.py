"""Deadline admission in the live router (balancer.service.admission_gate), on emulated engines in process.

Fault matrix of the held path: a request held and then dispatched, shed at arrival (deadline header),
shed while held (its deadline passes), queue full, client disconnect while held, engine death while
held, and no request left without an answer. The gate's numbers are set so the cases are
hand-computable: a prompt of ``"word " * 400`` is 2,000 characters = 500 tokens (4 characters per
token), one replica prefills ``RATE`` = 1,000 tokens/s, so one such request in flight is a predicted
engine wait of 0.5 s, above ``dispatch_wait_s`` = 0.4 s: the gate then holds the next one.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import aiohttp
import pytest

from balancer.service.admission_config import AdmissionSettings
from pdlb_cli.admission_args import parse_tenant_weights
from balancer.service.admission_gate import AdmissionGate, Shed
from balancer.service.app import SERVICE
from balancer.router import Router
from sim.emulator.testing import inprocess_cluster

PROMPT = "word " * 400  # 500 tokens
ADMISSION = {"enabled": True, "ttft_slo_s": 2.0, "dispatch_wait_s": 0.4, "prefill_tokens_per_s": 1000.0,
             "drain_interval_s": 0.01}
ROUTER = {"request_timeout_s": 10.0, "prefill_policy": {"name": "round_robin"},
          "decode_policy": {"name": "round_robin"}, "first_byte_timeout_s": None}


def router_cfg(**adm) -> dict:  # noqa: ANN003
    return {**ROUTER, "admission": {**ADMISSION, **adm}}


async def post(s: aiohttp.ClientSession, url: str, headers: dict | None = None, **kw):  # noqa: ANN003, ANN201
    async with s.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=headers or {},
                      **kw) as r:
        return r.status, dict(r.headers), await r.text()


async def until(cond, timeout_s: float = 3.0) -> None:  # noqa: ANN001
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "condition not reached"
        await asyncio.sleep(0.005)


def counts(svc) -> dict:  # noqa: ANN001
    return svc.admission.core.stats()["counts"]


async def hung_cluster(**adm):  # noqa: ANN003, ANN201
    """One mixed engine that never answers (fault ``hang``): a request sent to it stays in flight."""
    return inprocess_cluster("none", num_decode=1, router=router_cfg(**adm))


async def hang(c, s) -> asyncio.Task:  # noqa: ANN001
    e = c.decode[0]
    async with s.post(f"http://127.0.0.1:{e.port}/emulator/faults", json={"hang": True}) as r:
        assert r.status == 200
    svc = c.router.app[SERVICE]
    first = asyncio.create_task(post(s, c.url))
    await until(lambda: svc.router.load.num_in_flight == 1)
    return first


async def test_held_requests_are_dispatched_in_turn_and_all_served():
    # 6 at once on 2 mixed engines: the first goes at once (W 0 -> 0.5), the others wait until its
    # prefill is done (the gate re-opens at W < 0.4): every one gets 200, none shed
    async with inprocess_cluster("none", num_decode=2, engine={"speed": 5.0}, router=router_cfg()) as c, \
            aiohttp.ClientSession() as s:
        svc = c.router.app[SERVICE]
        out = await asyncio.gather(*(post(s, c.url) for _ in range(6)))
        assert [o[0] for o in out] == [200] * 6
        assert counts(svc) == {("normal", "default", "dispatched"): 6}
        assert svc.admission.core.num_held == 0
        async with s.get(c.url + "/metrics") as r:
            text = await r.text()
        assert 'pdlb_admission_requests_total{class="normal",outcome="dispatched",tenant="default"} 6.0' in text
        assert 'pdlb_admission_wait_seconds_count{class="normal"} 6.0' in text


async def test_shed_at_arrival_and_while_held_with_retry_after():
    async with await hung_cluster() as c, aiohttp.ClientSession() as s:
        svc = c.router.app[SERVICE]
        first = await hang(c, s)
        # deadline 100 ms: start W 0.5 s > 0.1 s -> 429 at once, Retry-After ceil(0.5) = 1
        t0 = time.monotonic()
        status, headers, text = await post(s, c.url, {"x-pdlb-deadline-ms": "100"})
        assert status == 429 and headers["Retry-After"] == "1"
        assert json.loads(text)["error"]["type"] == "rate_limit_exceeded"
        assert time.monotonic() - t0 < 0.5
        # the SLO's 2 s: held (W 0.5 >= 0.4), shed once now + 0.5 + own 0.5 > 2, i.e. ~1 s after arrival
        t0 = time.monotonic()
        status, headers, _ = await post(s, c.url)
        took = time.monotonic() - t0
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert 0.9 <= took < 1.6, took
        # the hung request went through the open gate: dispatched
        assert counts(svc) == {("normal", "default", "dispatched"): 1, ("normal", "default", "shed_deadline"): 2}
        assert svc.admission.core.num_held == 0
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)


async def test_queue_full_per_tenant():
    async with await hung_cluster(max_queue_per_tenant=1) as c, aiohttp.ClientSession() as s:
        svc = c.router.app[SERVICE]
        first = await hang(c, s)
        held = asyncio.create_task(post(s, c.url, {"x-pdlb-tenant": "x"}))
        await until(lambda: svc.admission.core.num_held == 1)
        status, headers, text = await post(s, c.url, {"x-pdlb-tenant": "x"})  # x's one place is taken
        assert status == 429 and "queue is full" in json.loads(text)["error"]["message"]
        other = asyncio.create_task(post(s, c.url, {"x-pdlb-tenant": "y"}))  # y still gets its place
        await until(lambda: svc.admission.core.num_held == 2)
        assert counts(svc) == {("normal", "default", "dispatched"): 1, ("normal", "x", "shed_queue_full"): 1}
        for t in (held, other, first):
            t.cancel()
        await asyncio.gather(held, other, first, return_exceptions=True)


async def test_client_disconnect_while_held_leaves_the_queue():
    async with await hung_cluster() as c, aiohttp.ClientSession() as s:
        svc = c.router.app[SERVICE]
        first = await hang(c, s)
        with pytest.raises(asyncio.TimeoutError):
            await post(s, c.url, timeout=aiohttp.ClientTimeout(total=0.3))
        await until(lambda: svc.admission.core.num_held == 0)
        assert counts(svc) == {("normal", "default", "dispatched"): 1, ("normal", "default", "cancelled"): 1}
        assert svc.router.load.num_in_flight == 1  # only the hung one: the cancelled one was never routed
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)


async def test_engine_death_while_held_still_answers_everyone():
    async with await hung_cluster() as c, aiohttp.ClientSession() as s:
        svc = c.router.app[SERVICE]
        first = await hang(c, s)
        second = asyncio.create_task(post(s, c.url))
        await until(lambda: svc.admission.core.num_held == 1)
        c.state(c.decode[0]).die()  # drops the hung request's connection and refuses new ones
        (s1, _, t1), (s2, _, t2) = await asyncio.wait_for(asyncio.gather(first, second), 8.0)
        # both answered with an error object (the one engine is gone), none left hanging
        for status, text in ((s1, t1), (s2, t2)):
            assert status in (502, 503, 504), (status, text)
            assert json.loads(text)["error"]["message"]
        assert counts(svc) == {("normal", "default", "dispatched"): 2}
        await until(lambda: svc.router.load.num_in_flight == 0)


async def test_bad_deadline_header_is_400_and_admission_off_by_default():
    async with await hung_cluster() as c, aiohttp.ClientSession() as s:
        status, _, text = await post(s, c.url, {"x-pdlb-deadline-ms": "soon"})
        assert status == 400 and "x-pdlb-deadline-ms" in json.loads(text)["error"]["message"]
    async with inprocess_cluster("none", num_decode=1, router=ROUTER) as c:
        assert c.router.app[SERVICE].admission is None


def test_tenant_from_header_or_api_key_hash():
    gate = AdmissionGate(AdmissionSettings(enabled=True), Router(), __import__("prometheus_client").CollectorRegistry())
    assert gate.identify({"x-pdlb-tenant": "acme", "x-pdlb-priority": "high"}) == ("acme", "high", None)
    # the key's SHA-256, first 12 hex digits (computed here with hashlib, independently of the gate)
    assert gate.identify({"Authorization": "Bearer sk-123"})[0] == "key-" + hashlib.sha256(b"sk-123").hexdigest()[:12]
    assert gate.identify({}) == ("default", None, None)
    assert gate.identify({"x-pdlb-deadline-ms": "250"})[2] == 250.0
    for bad in ("0", "-5", "nan", "inf", "3600001"):
        with pytest.raises(Shed) as e:
            gate.identify({"x-pdlb-deadline-ms": bad})
        assert e.value.status == 400


def test_settings_validation_and_flags():
    with pytest.raises(ValueError, match="default_priority"):
        AdmissionSettings(priority_classes=["a", "b"])
    with pytest.raises(ValueError):
        AdmissionSettings(max_queue_requests=0)
    with pytest.raises(ValueError):
        AdmissionSettings(tenant_weights={"a": -1.0})
    assert parse_tenant_weights("A=2, B=0.5") == {"A": 2.0, "B": 0.5}
    import argparse
    for bad in ("A", "A=0", "=1", "A=x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_tenant_weights(bad)
    from pdlb_cli.serve import config_from_args
    from pdlb_cli.main import build_parser
    args = build_parser().parse_args(["serve", "--mixed", "http://127.0.0.1:1", "--admission",
                                      "--admission-ttft-slo-s", "3", "--admission-max-queue", "7",
                                      "--admission-tenant-weights", "a=2"])
    cfg = config_from_args(args)
    assert cfg.admission.enabled and cfg.admission.ttft_slo_s == 3.0 and cfg.admission.max_queue_requests == 7
    assert cfg.admission.tenant_weights == {"a": 2.0}
    assert not config_from_args(build_parser().parse_args(["serve", "--mixed", "http://127.0.0.1:1"])).admission.enabled


def test_rate_follows_the_routers_online_cost_fit():
    # prefill step = 1e-4 s per token, nothing else: a 8192-token chunk takes 0.8192 s -> 10,000
    # tokens/s (hand-computed); without a configured rate the gate takes it from the learner's fit
    from prometheus_client import CollectorRegistry

    from balancer.cost_model import CostModel, EngineCost, PrefillStepCost
    from balancer.types import ReplicaId, Role

    r = Router("round_robin", "round_robin", learn_cost_model=True)
    r.add_replica(ReplicaId("m0"), Role.MIXED)
    gate = AdmissionGate(AdmissionSettings(enabled=True), r, CollectorRegistry())
    first = gate._core().rate_tokens_per_s
    fast = EngineCost(prefill=PrefillStepCost(overhead_s=0.0, per_token_s=1e-4, per_attn_pair_s=0.0))
    r.cost_learner.model = CostModel(prefill=fast, decode=fast)
    assert gate._core().rate_tokens_per_s == first  # refreshed at most once a second
    gate._rate_at_s = -1e9
    assert gate._core().rate_tokens_per_s == pytest.approx(10_000.0)
    # a configured rate wins
    fixed = AdmissionGate(AdmissionSettings(enabled=True, prefill_tokens_per_s=123.0), r, CollectorRegistry())
    assert fixed._core().rate_tokens_per_s == 123.0
