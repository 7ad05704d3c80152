"""Bounded soak of the router under faults (issue 14, "tests that keep it so"; ``slow`` marker).

In-process, loopback: 2 prefill + 3 decode emulated engines (SGLang protocol), 48 concurrent clients
for ~15 s of unique prompts, while faults come and go on a schedule (a decode engine answering 503,
a prefill engine hanging, a decode engine whose streams die). Checks: nothing lost (every request
sent got exactly one outcome: success or a clear error, and the router counted each), the load
returns to 0, no engine keeps a request task, and the process's resident memory grows by less
than 64 MB between the first and the last third of the run (the prefix index is bounded).
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import pytest

from balancer.service.app import SERVICE
from sim.emulator.testing import inprocess_cluster

DURATION_S = 15.0
CLIENTS = 48


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.slow
async def test_soak_with_faults():
    router = {"first_byte_timeout_s": 1.0, "prefill_timeout_s": 1.0, "request_timeout_s": 5.0,
              "retry": {"max_retries": 3, "initial_backoff_s": 0.005, "max_backoff_s": 0.05},
              "health_check": {"enabled": True, "interval_s": 2.0, "timeout_s": 0.5},
              "circuit_breaker": {"failure_threshold": 5, "open_duration_s": 1.0, "probe_interval_s": 0.3},
              "index_capacity_blocks": 4096}
    async with inprocess_cluster("sglang", num_prefill=2, num_decode=3, engine={"speed": 50.0}, router=router) as c, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        svc = c.router.app[SERVICE]
        outcomes: dict[str, int] = {}
        sent = 0
        rss: list[tuple[float, int]] = []
        t0 = time.monotonic()

        async def client(k: int) -> None:
            nonlocal sent
            rng = random.Random(k)
            while time.monotonic() - t0 < DURATION_S:
                sent += 1
                stream = rng.random() < 0.5
                body = {"prompt": f"client {k} turn {sent} " + "ctx " * rng.randrange(10, 400),
                        "max_tokens": rng.randrange(1, 12), "stream": stream}
                async with s.post(c.url + "/v1/completions", json=body) as r:
                    text = await r.text()
                events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
                failed = any(e.startswith('{"error"') for e in events)
                if r.status == 200 and (not stream or (events[-1:] == ["[DONE]"] and not failed)):
                    key = "ok"
                elif r.status == 200:  # the error event, then [DONE]
                    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["message"]
                    key = "stream_error"
                else:
                    assert r.status in (502, 503, 504) and json.loads(text)["error"]["message"], text
                    key = f"error {r.status}"
                outcomes[key] = outcomes.get(key, 0) + 1

        async def chaos() -> None:
            schedule = [(2.0, c.decode[0], {"error_rate": 1.0, "error_status": 503}),
                        (4.0, c.decode[0], {}),
                        (5.0, c.prefill[1], {"hang": True}),
                        (8.0, c.prefill[1], {}),
                        (9.0, c.decode[2], {"die_after_tokens": 10**9}),  # reset the counter's meaning below
                        (12.0, c.decode[2], {})]
            for at, eng, faults in schedule:
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                st = c.state(eng)
                if "die_after_tokens" in faults:
                    faults = {"die_after_tokens": st.tokens_streamed + 50}
                if not faults:
                    st.dead = False  # a restarted engine
                async with s.post(f"http://127.0.0.1:{eng.port}/emulator/faults", json=faults) as r:
                    assert r.status == 200

        async def sampler() -> None:
            while time.monotonic() - t0 < DURATION_S:
                rss.append((time.monotonic() - t0, _rss_bytes()))
                await asyncio.sleep(0.5)

        await asyncio.gather(chaos(), sampler(), *(client(k) for k in range(CLIENTS)))
        assert sum(outcomes.values()) == sent and outcomes.get("ok", 0) >= 0.9 * sent, outcomes
        metrics = await (await s.get(c.url + "/metrics")).text()
        counted = sum(float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines()
                      if ln.startswith('pdlb_requests_total{endpoint="/v1/completions"'))
        assert counted == sent
        deadline = time.monotonic() + 3
        while any(c.state(e).tasks for e in c.engines) or svc.router.load.num_in_flight:
            assert time.monotonic() < deadline, "legs left behind"
            await asyncio.sleep(0.05)
        assert int(svc.router.load.num_requests.sum()) == 0 and svc.in_flight == 0
        early = [b for t, b in rss if DURATION_S / 3 > t > 1.0]
        late = [b for t, b in rss if t > 2 * DURATION_S / 3]
        assert max(late) - min(early) < 64 << 20, (min(early) >> 20, max(late) >> 20)
