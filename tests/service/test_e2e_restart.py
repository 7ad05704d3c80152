"""End-to-end: ``pdlb serve --processes 2`` restarts a router process killed with SIGKILL, under
traffic, and gives up with status 1 on a crash loop (:mod:`balancer.service.processes.supervise`).

Real ``pdlb serve`` and ``pdlb engine`` processes on 127.0.0.1; every process is stopped in teardown.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import aiohttp
import pytest

from sim.emulator.testing import Proc, spawn_engines, spawn_router

RR = ("--connection-placement", "round_robin")
"""Every router here hands connections to its processes in turn: the tests reach each process with a
light load (the default placement, follow_load, would keep such a load on one)."""

FAST = ("--speed", "20")
# one second of decode per long request at speed 1 (the emulator's default model): in flight long
# enough to kill a router process while it holds them
LONG_TOKENS = 48

pytestmark = pytest.mark.slow


async def _health_by_index(s: aiohttp.ClientSession, router: Proc, n: int, require: bool = True) -> dict[int, dict]:
    """``GET /health`` on fresh connections until each of the ``n`` processes answered; by index.
    The parent hands connections to the processes in turn (every router here runs
    ``--connection-placement round_robin``), so ``n`` live ones answer in ``n``."""
    seen: dict[int, dict] = {}
    for _ in range(50):
        try:
            async with s.get(router.url + "/health", headers={"Connection": "close"}) as r:
                body = await r.json()
        except aiohttp.ClientError:
            continue  # handed to a process that just died
        seen[body["process"]["index"]] = body
        if len(seen) == n:
            return seen
    if not require:
        return seen
    raise AssertionError(f"only processes {sorted(seen)} of {n} answered")


async def _metric(s: aiohttp.ClientSession, router: Proc, pattern: str) -> list[float]:
    async with s.get(router.url + "/metrics") as r:
        text = await r.text()
    return [float(m.group(1)) for m in re.finditer(pattern + r" ([0-9.e+-]+)", text)]


async def _wait_restarted(s: aiohttp.ClientSession, router: Proc, index: int, old_pid: int, n: int,
                          timeout_s: float = 60.0) -> dict[int, dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert router.alive(), "pdlb serve exited"
        health = await _health_by_index(s, router, n, require=False)
        if index in health and health[index]["process"]["pid"] != old_pid:
            return health
        await asyncio.sleep(0.2)
    raise AssertionError(f"router process {index} was not restarted within {timeout_s:g} s")


async def test_killed_router_process_is_restarted_under_traffic():
    """Two router processes, three mixed engines; 8 long requests on 8 connections (the parent
    hands connections out in turn: 4 per process). Router process 1 is killed with SIGKILL while
    it holds its 4: exactly those fail (their connections die with it), the other 4 complete in
    full. The parent restarts process 1 (a new pid, the same index, ready within a minute);
    then every request succeeds, both processes serve, the in-flight gauges read 0 (the dead
    process's 4 requests were reset in the shared load block, not left counting on their
    engines), the restart counter reads 1 for process 1 and 0 for process 0, and the reaped
    counter equals the failed requests (each was one DP-rank request count of a mixed worker)."""
    engines = spawn_engines([("mixed", "--speed", "1")] * 3)
    procs = list(engines)
    try:
        # cache_aware reads the prefix index, so the processes share their decisions through the
        # rings (a mixed pool whose policy reads neither index nor load runs no rings at all)
        router = spawn_router("none", [], [], "--processes", "2", *RR, "--decode-policy", "cache_aware", mixed=engines)
        procs.append(router)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            before = await _health_by_index(s, router, 2)
            victim = before[1]["process"]["pid"]

            async def long_one(i: int) -> int | str:
                # 560 characters: two text chunks, so each decision is shared through the rings
                body = {"model": "emu", "prompt": f"long {i} " * 80, "max_tokens": LONG_TOKENS}
                try:
                    async with s.post(router.url + "/v1/completions", json=body, headers={"Connection": "close"}) as r:
                        assert r.status == 200, await r.text()
                        return (await r.json())["usage"]["completion_tokens"]
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    return type(e).__name__

            tasks = [asyncio.create_task(long_one(i)) for i in range(8)]
            deadline = time.monotonic() + 20
            while True:  # all 8 routed: 4 in each process
                health = await _health_by_index(s, router, 2)
                if sorted(h["in_flight"] for h in health.values()) == [4, 4]:
                    break
                assert time.monotonic() < deadline, f"in flight: {health}"
                await asyncio.sleep(0.05)
            os.kill(victim, signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            failed = [r for r in results if not isinstance(r, int)]
            assert sorted(r for r in results if isinstance(r, int)) == [LONG_TOKENS] * 4, results
            assert len(failed) == 4, results

            after = await _wait_restarted(s, router, 1, victim, 2)
            assert after[0]["process"]["pid"] == before[0]["process"]["pid"]  # the other one lived on
            for i in range(30):  # fresh connections, handed to both processes in turn: none fails
                async with s.post(router.url + "/v1/completions", headers={"Connection": "close"},
                                  json={"model": "emu", "prompt": f"after {i} " * 10, "max_tokens": 2}) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["usage"]["completion_tokens"] == 2
            health = await _health_by_index(s, router, 2)
            assert all(h["in_flight"] == 0 for h in health.values())
            assert await _metric(s, router, r"pdlb_in_flight_requests") == [0.0]
            gauges = await _metric(s, router, r'pdlb_worker_in_flight_requests\{[^}]*\}')
            assert gauges == [0.0, 0.0, 0.0]
            restarts = {p: await _metric(s, router, r'pdlb_router_process_restarts_total\{process="%d"\}' % p)
                        for p in (0, 1)}
            assert restarts == {0: [0.0], 1: [1.0]}
            assert await _metric(s, router, r'pdlb_router_process_reaped_requests_total\{process="1"\}') == [4.0]
            # both processes' counters survive in the sums: 4 + 30 completions, the dead one's 2 included
            assert await _metric(s, router, r'pdlb_requests_total\{endpoint="/v1/completions",status="200"\}') == [34.0]
            # the replacement read back the 4 decisions its predecessor routed (the long prompts,
            # each at least one block) from its own ring; the counters are written at each
            # process's gauge refresh (every second)
            await asyncio.sleep(1.2)
            shared = r'pdlb_shared_prefix_decisions_total\{kind="%s",process="%d"\}'
            assert await _metric(s, router, shared % ("recovered", 1)) == [4.0]
            assert await _metric(s, router, shared % ("recovered", 0)) == []
        assert router.stop() == 0
    finally:
        for p in procs:
            p.stop()


async def test_crash_loop_stops_serve_with_status_1():
    """``--max-process-restarts 1``: the first SIGKILL of process 0 is restarted, the second
    within the window stops ``pdlb serve`` with status 1 and a message naming the process, how it
    died and the limit; the other process is stopped with it."""
    engines = spawn_engines([("mixed", *FAST)])
    procs = list(engines)
    try:
        router = spawn_router("none", [], [], "--processes", "2", *RR, "--max-process-restarts", "1",
                              "--restart-window-s", "120", mixed=engines)
        procs.append(router)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            first = await _health_by_index(s, router, 2)
            os.kill(first[0]["process"]["pid"], signal.SIGKILL)
            second = await _wait_restarted(s, router, 0, first[0]["process"]["pid"], 2)
            other = second[1]["process"]["pid"]
            os.kill(second[0]["process"]["pid"], signal.SIGKILL)
        code = router.popen.wait(30)
        out = router.popen.stdout.read().decode(errors="replace")
        assert code == 1, out
        assert re.search(r"error: router process 0 \(pid \d+\) was killed by SIGKILL; it died 2 times within "
                         r"120 s \(limit: 1 restarts\): crash loop, stopping pdlb serve", out), out
        # once: the restart line was both logged and printed (review F5)
        assert len(re.findall(r"router process 0 restarted", out)) == 1, out
        with pytest.raises(ProcessLookupError):  # the surviving process was stopped too
            for _ in range(100):
                os.kill(other, 0)
                time.sleep(0.1)
    finally:
        for p in procs:
            p.stop()


async def test_sigterm_of_the_parent_alone_stops_quietly_and_cleans_up():
    """``kill PID`` of ``pdlb serve`` (``docker stop``: the parent alone gets SIGTERM): the parent
    closes the hand-off channels, then stops its processes, so each must read that as a stop, not
    as a dead parent (every process once logged 'ERROR ... the pdlb serve parent is
    gone' and exited 1 on each clean stop); the shared /dev/shm folders are removed all the same."""
    engines = spawn_engines([("mixed", *FAST)])
    procs = list(engines)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    before = set(os.listdir(shm)) if shm else set()
    try:
        router = spawn_router("none", [], [], "--processes", "2", *RR, mixed=engines)
        procs.append(router)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            await _health_by_index(s, router, 2)
            async with s.post(router.url + "/v1/completions", json={"model": "emu", "prompt": "hi", "max_tokens": 1}) as r:
                assert r.status == 200
        router.popen.send_signal(signal.SIGTERM)
        code = router.popen.wait(30)
        out = router.popen.stdout.read().decode(errors="replace")
        assert code == 0, out
        assert "parent is gone" not in out and " ERROR " not in out, out
        if shm:
            assert not {d for d in set(os.listdir(shm)) - before if d.startswith(("pdlb-", "psm_"))}
    finally:
        for p in procs:
            p.stop()


async def test_worker_gauges_are_exact_right_after_a_request_ends():
    """The per-worker in-flight gauge, scraped at once after the only request ends, reads 0
    whichever process answers. Each process rewrites its gauges every second; one long request
    (2.4 s at speed 1) in process A is seen in flight by at least two of A's refreshes. Summing the
    processes' files (``livesum``, before) made a scrape answered by B report A's stale 1 until A's
    next refresh (up to a second later): the race that made
    test_two_router_processes_serve_all_and_return_to_zero fail now and then. Now the answering
    process writes the total over all processes from the shared load block at the scrape, and
    the most recent value wins. The parent hands connections out in turn, so the request goes to
    A and the two scrapes to B and A."""
    engines = spawn_engines([("mixed", "--speed", "1")])
    procs = list(engines)
    try:
        router = spawn_router("none", [], [], "--processes", "2", *RR, mixed=engines)
        procs.append(router)
        pattern = r'pdlb_worker_in_flight_requests\{dp_rank="0",role="mixed",worker="%s"\}' % re.escape(engines[0].url)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            await _health_by_index(s, router, 2)  # both ready; the next connection goes to process 0
            async with s.post(router.url + "/v1/completions", headers={"Connection": "close"},
                              json={"model": "emu", "prompt": "one long request", "max_tokens": 6 * LONG_TOKENS}) as r:
                assert r.status == 200
                await r.read()
            first = await _metric_fresh(s, router, pattern)
            second = await _metric_fresh(s, router, pattern)
            assert (first, second) == ([0.0], [0.0])
        assert router.stop() == 0
    finally:
        for p in procs:
            p.stop()


async def _metric_fresh(s: aiohttp.ClientSession, router: Proc, pattern: str) -> list[float]:
    async with s.get(router.url + "/metrics", headers={"Connection": "close"}) as r:
        text = await r.text()
    return [float(m.group(1)) for m in re.finditer(pattern + r" ([0-9.e+-]+)", text)]


async def test_killed_router_process_0_restarts_the_kv_subscriber_and_keeps_both_views():
    """``--index-mode events``, two processes, a worker with events added through the admin API.
    Process 0 runs the one KV-event subscriber. Killed with SIGKILL, its replacement starts with
    the admin-added worker (the worker set the other process has), starts a new subscriber once
    the dead one's child let go of the ring (writer lock), which clears its replicas and catches
    up from the engines' replay buffers: a prefix announced before the kill, and one announced
    after the restart, draw all 12 requests (fresh connections, both processes) to the engine
    that announced it."""
    import random

    from tests.kv_publisher import FakeEngine

    pubs = [FakeEngine("map", "int", block_size=16) for _ in range(3)]
    engines = spawn_engines([("mixed", "--zero-delay")] * 3)
    procs = list(engines)
    try:
        specs = [f"{e.url},events={p.endpoint},replay={p.replay_endpoint}" for e, p in zip(engines[:2], pubs)]
        router = spawn_router("none", [], [], "--processes", "2", *RR, "--index-mode", "events", "--block-size", "16",
                              "--decode-policy", "cache_aware", "--mixed", *specs)
        procs.append(router)
        rng = random.Random(7)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async def served(prefix: list[int], n: int = 12) -> list[int]:
                before = [(await (await s.get(e.url + "/emulator/stats")).json())["ok"] for e in engines]
                for _ in range(n):
                    body = {"prompt": prefix + [rng.randrange(30_000) for _ in range(8)], "max_tokens": 1}
                    async with s.post(router.url + "/v1/completions", json=body, headers={"Connection": "close"}) as r:
                        assert r.status == 200
                after = [(await (await s.get(e.url + "/emulator/stats")).json())["ok"] for e in engines]
                return [b - a for a, b in zip(before, after)]

            async def until_served(prefix: list[int], want: list[int], timeout_s: float = 20.0) -> list[int]:
                end = time.monotonic() + timeout_s
                while (got := await served(prefix)) != want and time.monotonic() < end:
                    await asyncio.sleep(0.3)
                return got

            r = await s.post(router.url + "/workers", json={"url": engines[2].url, "role": "mixed",
                                                             "events": pubs[2].endpoint, "replay": pubs[2].replay_endpoint})
            assert r.status == 201
            await asyncio.sleep(1.5)  # the SUB sockets join
            before_kill = [rng.randrange(30_000) for _ in range(128)]
            pubs[2].publish([pubs[2].stored(before_kill)[1]])
            assert await until_served(before_kill, [0, 0, 12]) == [0, 0, 12]
            health = await _health_by_index(s, router, 2)
            os.kill(health[0]["process"]["pid"], signal.SIGKILL)
            after = await _wait_restarted(s, router, 0, health[0]["process"]["pid"], 2)
            assert after[1]["process"]["pid"] == health[1]["process"]["pid"]
            workers = {i: await _workers_of(s, router, i) for i in (0, 1)}
            assert workers[0] == workers[1] == sorted(e.url for e in engines)
            assert await until_served(before_kill, [0, 0, 12]) == [0, 0, 12]  # replayed into the new subscriber
            await asyncio.sleep(1.0)
            later = [rng.randrange(30_000) for _ in range(128)]
            pubs[1].publish([pubs[1].stored(later)[1]])
            assert await until_served(later, [0, 12, 0]) == [0, 12, 0]
            restarts = await _metric(s, router, r'pdlb_router_process_restarts_total\{process="0"\}')
            assert restarts == [1.0]
        assert router.stop() == 0
    finally:
        for p in procs:
            p.stop()
        for p in pubs:
            p.close()


async def _workers_of(s: aiohttp.ClientSession, router: Proc, index: int) -> list[str]:
    for _ in range(20):
        async with s.get(router.url + "/workers", headers={"Connection": "close"}) as r:
            body = await r.json()
        if body["process"]["index"] == index:
            return sorted(w["url"] for w in body["workers"])
    raise AssertionError(f"process {index} did not answer /workers")


async def test_a_second_death_is_handled_while_a_replacement_starts():
    """Process 1 is killed; once the parent has announced its restart and started the
    replacement (which takes about a second to import and listen), process 0 is killed too. The
    parent notices that second death while the replacement is still starting (it polls the
    starting replacement in its supervision pass instead of waiting for it): process 0's death
    is reported before process 1's restart completes, and both come back. Before, the parent
    waited up to 60 s for one replacement, blind to the others."""
    import threading

    engines = spawn_engines([("mixed", *FAST)])
    procs = list(engines)
    try:
        router = spawn_router("none", [], [], "--processes", "2", *RR, mixed=engines)
        procs.append(router)
        lines: list[tuple[float, str]] = []
        assert router.popen.stdout is not None

        def read() -> None:
            for raw in router.popen.stdout:
                lines.append((time.monotonic(), raw.decode(errors="replace").rstrip()))

        threading.Thread(target=read, daemon=True).start()

        def first(pattern: str) -> float | None:
            return next((t for t, line in lines if re.search(pattern, line)), None)

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            before = await _health_by_index(s, router, 2)
            os.kill(before[1]["process"]["pid"], signal.SIGKILL)
            deadline = time.monotonic() + 10
            while first(r"router process 1 .*restarting it in") is None:
                assert time.monotonic() < deadline, lines
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.35)  # past the 0.1 s backoff and the next 0.2 s pass: spawned
            if first(r"router process 1 restarted") is not None:
                pytest.skip("the replacement was ready within 0.35 s: no start-up to overlap with")
            killed_0 = time.monotonic()
            os.kill(before[0]["process"]["pid"], signal.SIGKILL)
            after = await _wait_restarted(s, router, 0, before[0]["process"]["pid"], 2)
            # both come back; on a loaded host process 1's replacement may still be starting when
            # process 0's answers, so it is waited for in its own right
            after = await _wait_restarted(s, router, 1, before[1]["process"]["pid"], 2)
            assert after[1]["process"]["pid"] != before[1]["process"]["pid"]
            noticed_0, restarted_1 = first(r"router process 0 .*was killed by SIGKILL"), first(r"router process 1 restarted")
            assert noticed_0 is not None and restarted_1 is not None, lines
            assert noticed_0 < restarted_1, lines
            assert noticed_0 - killed_0 < 1.0, lines  # one or two 0.2 s passes, not a start-up
        assert router.stop() == 0
    finally:
        for p in procs:
            p.stop()
