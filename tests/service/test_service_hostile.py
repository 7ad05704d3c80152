"""Issue 25's "Done when", as tests (``slow``; about 60-90 s in all on a 2-core machine).

A real ``pdlb serve`` (one process) in front of three fake engines (1 prefill, 2 decode;
:func:`sim.emulator.hostile.spawn_hostile_cluster`); for each hostile request, admin call or engine
misbehaviour of the issue (:data:`sim.emulator.hostile.ACTIONS`), while it runs a child process
probes ``GET /health`` every 50 ms (:class:`sim.emulator.hostile.Probe`). Checked per action
(:func:`sim.emulator.hostile.verdict`):

* every answer has the expected status (the client's fault: 4xx; an engine's: served elsewhere or
  a stream ended with an error event); never a 5xx;
* the router logs at most 4 KiB meanwhile (300 ``Content-Length: -5`` requests included: one
  short line per kind of error per 10 s);
* the issue's latency bounds, p99 under 100 ms and never over 250 ms, on the router's event loop
  in CPU terms (``pdlb_event_loop_cpu_lag_seconds``, :mod:`balancer.service.loop_watch`: how late a
  timer due every 50 ms ran, counting only what the router process's CPU time explains). A block
  of the loop is CPU work, which a loaded host stretches in wall time but not in CPU time, so
  this holds on this shared 2-core machine at load 10-18 and fails on a router that blocks its
  loop (:func:`test_the_verdict_fails_on_a_router_without_the_fixes`);
* the same bounds in wall-clock time, on the probe's latency and on the event loop's lag
  (``pdlb_event_loop_lag_seconds``), when the host was quiet during the action (other work took at
  most :data:`~sim.emulator.hostile.QUIET_FOREIGN_CORES` CPUs:
  :class:`~sim.emulator.hostile.HostCpu`). On a busy host they are printed, not asserted: there
  the probe and the lag measure how the host schedules its processes as much as the router (at
  load 18 here, a 788 ms probe and a 0.5 s+ lag sample with no CPU lag over 100 ms). A block of
  the loop without CPU use (a sleep, a blocking read) is therefore caught on a quiet host only;
* the router's RSS returns to within 10% of its baseline (taken after a warm-up that started its
  body-parsing worker) within 10 s, and the worker's own RSS likewise; so does their anonymous
  memory (RSS without mapped files: 10% of the RSS, which counts ~150 MB of library code, numba's
  included, would hide 15 MB of heap growth).

The checks themselves, by hand on made-up readings: ``tests/sim/emulator/test_hostile_verdict.py``.
"""

from __future__ import annotations

import time

import pytest

from sim.emulator.hostile import (ACTIONS, CPU_LAG, HostCpu, LoopLag, Probe, loop_lag_counts, spawn_hostile_cluster,
                                  verdict, wait_until, warm_up)

pytestmark = pytest.mark.slow

RSS_SLACK = 1.10


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = spawn_hostile_cluster(str(tmp_path_factory.mktemp("hostile")))
    try:
        time.sleep(0.5)
        fresh = c.rss(), c.anon()
        warm_up(c)
        time.sleep(0.5)
        print(f"router before the warm-up: RSS {fresh[0][0] / 1e6:.1f} MB (children {fresh[0][1] / 1e6:.1f}), "
              f"anonymous {fresh[1][0] / 1e6:.1f} MB; after: RSS {c.rss()[0] / 1e6:.1f} MB (children "
              f"{c.rss()[1] / 1e6:.1f}), anonymous {c.anon()[0] / 1e6:.1f} MB")
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def baseline(cluster):
    """The router's RSS and its children's, and an idle probe's p99 and max (seconds)."""
    time.sleep(0.5)
    main, children = cluster.rss()
    anon, children_anon = cluster.anon()
    probe = Probe(cluster.router.url)
    time.sleep(2.0)
    idle = probe.stop()
    assert idle.errors() == 0 and len(idle.latencies_s) >= 20
    return {"rss": main, "children_rss": children, "anon": anon, "children_anon": children_anon,
            "p99_s": idle.p99_s(), "max_s": idle.max_s()}


@pytest.mark.parametrize("name", list(ACTIONS))
def test_hostile_action_neither_freezes_nor_bloats_nor_crashes_the_router(cluster, baseline, name):
    lag_before = loop_lag_counts(cluster.router.url)
    host_before = HostCpu.now()
    log_before = cluster.log.bytes
    probe = Probe(cluster.router.url)
    statuses = ACTIONS[name](cluster)
    time.sleep(0.2)
    seen = probe.stop()
    logged = cluster.log.bytes - log_before
    foreign = host_before.foreign_cores(HostCpu.now())
    lag_after = loop_lag_counts(cluster.router.url)
    lag, cpu_lag = LoopLag.between(lag_before, lag_after), LoopLag.between(lag_before, lag_after, CPU_LAG)
    print(f"{name}: probe p99 {seen.p99_s() * 1000:.0f} ms max {seen.max_s() * 1000:.0f} ms (idle: p99 "
          f"{baseline['p99_s'] * 1000:.0f} ms, max {baseline['max_s'] * 1000:.0f} ms); loop lag {lag}; "
          f"CPU lag {cpu_lag}; other work on the host: {foreign:.2f} CPUs; logged {logged} bytes")
    assert cluster.router.alive()
    problems = verdict(name, statuses, seen, lag, cpu_lag, foreign, logged)
    # memory: back within 10% of the baseline within 10 s (a freed body leaves at once, a
    # cycle-held one at the collection 0.2 s after a large body), as RSS (the measure) and
    # as anonymous memory alone (the heap: RSS also counts ~150 MB of mapped library code, numba's,
    # which no request grows, and 10% of it would hide 15 MB of heap growth)
    def back() -> bool:
        (main, kids), (anon, kids_anon) = cluster.rss(), cluster.anon()
        return (main <= RSS_SLACK * baseline["rss"] and kids <= RSS_SLACK * baseline["children_rss"]
                and anon <= RSS_SLACK * baseline["anon"] and kids_anon <= RSS_SLACK * baseline["children_anon"])

    if not wait_until(back, 10.0):
        problems.append(f"RSS {cluster.rss()}, anonymous {cluster.anon()} not back within 10% of {baseline}")
    assert not problems, problems


def test_large_bodies_are_parsed_off_the_loop_in_every_router_process():
    # pdlb serve --processes 2: each router process starts its own body worker (a daemonic child
    # could not: the router processes are not daemonic); 6 large bodies over 2 processes, all served
    import json

    from sim.emulator.hostile import children, http_request, spawn_fake_engine
    from sim.emulator.testing import spawn_router

    engines = [spawn_fake_engine(), spawn_fake_engine()]
    try:
        # round_robin: the 6 requests (a connection each) to both processes in turn (follow_load would
        # keep this light load on one)
        r = spawn_router("sglang", engines[:1], engines[1:], "--processes", "2", "--connection-placement", "round_robin")
        try:
            body = json.dumps({"prompt": "big " * 100_000, "max_tokens": 2}).encode()
            assert [http_request(r.url, "POST", "/v1/completions", body)[0] for _ in range(6)] == [200] * 6
            routers = children(r.popen.pid)
            assert len(routers) >= 2
            with_workers = [p for p in routers if children(p)]
            assert len(with_workers) == 2, (routers, with_workers)  # both router processes parsed some
        finally:
            r.stop()
    finally:
        for e in engines:
            e.stop()


BROKEN = ("import balancer.service.app as a; a.OFFLOAD_BODY_BYTES = 1 << 62\n"
          "from aiohttp import web_protocol; a._JsonErrorHandler.log_exception = web_protocol.RequestHandler.log_exception")
"""A patch for the router process that undoes two of issue 25's fixes: large bodies are parsed and
hashed on the event loop (item 2 as it was), and aiohttp logs each malformed request with its
traceback (item 7 as it was)."""


def _observe(c, action):  # noqa: ANN001, ANN202
    """Run ``action(c)`` as the hostile test does; what the verdict needs, and the statuses."""
    lag_before, host_before, log_before = loop_lag_counts(c.router.url), HostCpu.now(), c.log.bytes
    probe = Probe(c.router.url)
    statuses = action(c)
    time.sleep(0.2)
    seen = probe.stop()
    foreign = host_before.foreign_cores(HostCpu.now())
    lag_after = loop_lag_counts(c.router.url)
    return (statuses, seen, LoopLag.between(lag_before, lag_after), LoopLag.between(lag_before, lag_after, CPU_LAG),
            foreign, c.log.bytes - log_before)


def test_the_verdict_fails_on_a_router_without_the_fixes(tmp_path):
    # the same checks against a router patched back to before two fixes (BROKEN): the 32 MB
    # token-id prompt of the issue is about a second of CPU on its loop (3.2-3.4 s on the issue's
    # machine), which the CPU lag must show over 250 ms on any host, busy or not; 300
    # Content-Length: -5 requests log 300 lines
    from sim.emulator.hostile import ACTIONS, http_request, token_id_prompt

    c = spawn_hostile_cluster(str(tmp_path), prelude=BROKEN)
    try:
        body = token_id_prompt()
        statuses, seen, lag, cpu_lag, foreign, logged = _observe(
            c, lambda c: [http_request(c.router.url, "POST", "/v1/completions", body)[0]])
        print(f"blocking router: probe max {seen.max_s() * 1000:.0f} ms; loop lag {lag}; CPU lag {cpu_lag}; "
              f"other work on the host: {foreign:.2f} CPUs")
        assert statuses == [200]  # served: the only fault is the frozen loop
        assert cpu_lag.over_250ms >= 1
        problems = verdict("logit_bias_20mb", statuses, seen, lag, cpu_lag, foreign, logged)  # expects a 200 too
        assert any("CPU lag" in p for p in problems), problems
        flood = _observe(c, ACTIONS["content_length_minus_5"])
        print(f"logging router: {flood[-1]} bytes logged")
        problems = verdict("content_length_minus_5", *flood)
        assert any("logged" in p for p in problems), problems
    finally:
        c.stop()
