"""Deadline admission's fair shares across the processes of one real ``pdlb serve --processes 2``
(issue 28, open item 2): the shared held-work file (:mod:`balancer.service.processes.shared_admission`)
in the service, not the simulator's model of it.

16 closed-loop clients, each on one keep-alive connection opened in turn, so that connections 0, 2,
4, ... reach one router process and 1, 3, 5, ... the other (the parent hands connections to the
processes in turn): tenant B's 8 connections all on one process, A's 4 and C's 4 on the other. The
gate's queue budget (``dispatch_wait_s`` x its rate) is 3 prompts, far fewer than the 16 requests
outstanding, so every tenant is held all the time. By hand: with the host's shares each tenant
holds a third of the budget (B's process 1 prompt in flight, A's and C's process 2), so the three
complete about as many requests (A 37, B 40, C 33 in one 20 s run by hand). With per-process shares
(the same run with ``share_across`` left out of the app, once, by hand) B completed 99 and A and C 5
each: the process whose requests finish re-checks its queue first and keeps the engine. About 45 s.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import aiohttp
import pytest

from sim.emulator.testing import spawn_engine, spawn_router

_IDS = itertools.count()


def _prompt() -> str:
    """7,500 characters (1,875 tokens at the router's 4 characters a token) whose first block is unique:
    no prefix hits, so every prompt counts in full in the prefill backlog."""
    return f"r{next(_IDS):07d}" + "abcd" * 1873


RATE = 11250.0  # the gate's prefill rate, tokens/s: 0.5 s x 11,250 = 5,625 tokens = 3 prompts


@pytest.mark.slow
def test_fair_shares_across_two_real_processes():
    engine = spawn_engine("mixed", "--model", "llama-3.1-8b", "--speed", "0.3")
    router = None
    try:
        router = spawn_router("none", [], [], "--processes", "2", "--admission", "--admission-ttft-slo-s", "120",
                              "--admission-dispatch-wait-s", "0.5", "--admission-prefill-tokens-per-s", str(RATE),
                              "--admission-max-queue-per-tenant", "64", mixed=[engine])
        done = asyncio.run(_run(router.url, seconds=20.0))
    finally:
        if router is not None:
            router.stop()
        engine.stop()
    a, b, c = done["A"], done["B"], done["C"]
    assert min(a, b, c) >= 15, done  # enough completions to compare
    for other in (a, c):  # host-wide shares: about equal (per-process shares would give B about 2x)
        assert 0.65 < b / other < 1.5, done


async def _run(url: str, seconds: float) -> dict[str, int]:
    tenants = ["B" if k % 2 == 0 else ("A" if k % 4 == 1 else "C") for k in range(16)]
    sessions = []
    try:
        for _ in tenants:  # one connection each, opened in turn (the parent hands them out in turn)
            s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1, keepalive_timeout=120))
            sessions.append(s)
            async with s.get(url + "/health") as r:
                await r.read()
        done = {"A": 0, "B": 0, "C": 0}
        errors: list[int] = []
        end = time.monotonic() + seconds

        async def client(s: aiohttp.ClientSession, tenant: str) -> None:
            while time.monotonic() < end:
                body = {"prompt": _prompt(), "max_tokens": 2}
                async with s.post(url + "/v1/completions", json=body, headers={"x-pdlb-tenant": tenant}) as r:
                    await r.read()
                    if r.status == 200:
                        done[tenant] += 1
                    else:
                        errors.append(r.status)

        await asyncio.gather(*(client(s, t) for s, t in zip(sessions, tenants)))
        assert not errors, errors[:5]
        return done
    finally:
        for s in sessions:
            await s.close()
