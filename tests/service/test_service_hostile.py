"""Issue 25's "Done when", as tests (``slow``; about 60-90 s in all on a 2-core machine).

A real ``pdlb serve`` (one process) in front of three fake engines (1 prefill, 2 decode;
:func:`sim.emulator.hostile.spawn_hostile_cluster`); for each hostile request, admin call or engine
misbehaviour of the issue (:data:`sim.emulator.hostile.ACTIONS`), while it runs a child process
probes ``GET /health`` every 50 ms (:class:`sim.emulator.hostile.Probe`). Checked per action:

* every answer has the expected status (the client's fault: 4xx; an engine's: served elsewhere or
  a stream ended with an error event); never a 5xx;
* the router's event loop: its own lag (``pdlb_event_loop_lag_seconds``, a timer due every 50 ms)
  has a p99 under 100 ms and no sample over 500 ms (over 250 ms is printed: see the test);
* the probe's latency stays under 200 ms p99 and 400 ms at most *above what an idle probe of the
  same router measured just before*: the probe also counts how this machine schedules three busy
  processes (client, router, engines) on two shared cores, which alone puts idle probes at 100+ ms
  now and then; before the fixes the actions froze every client for 0.9-3.4 s, which fails both.
  ``bench/hostile_soak.py`` reports the probe's absolute numbers;
* the router's RSS returns to within 10% of its baseline (taken after a warm-up that started its
  body-parsing worker) within 10 s, and the worker's own RSS likewise.
"""

from __future__ import annotations

import time

import pytest

from sim.emulator.hostile import (ACTIONS, EXPECTED, LoopLag, Probe, loop_lag_counts, spawn_hostile_cluster, wait_until,
                                  warm_up)

pytestmark = pytest.mark.slow

PROBE_P99_BOUND_S = 0.200
PROBE_MAX_BOUND_S = 0.400
RSS_SLACK = 1.10


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = spawn_hostile_cluster(str(tmp_path_factory.mktemp("hostile")))
    try:
        warm_up(c)
        time.sleep(0.5)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def baseline(cluster):
    """The router's RSS and its children's, and an idle probe's p99 and max (seconds)."""
    time.sleep(0.5)
    main, children = cluster.rss()
    probe = Probe(cluster.router.url)
    time.sleep(2.0)
    idle = probe.stop()
    assert idle.errors() == 0 and len(idle.latencies_s) >= 20
    return {"rss": main, "children_rss": children, "p99_s": idle.p99_s(), "max_s": idle.max_s()}


@pytest.mark.parametrize("name", list(ACTIONS))
def test_hostile_action_neither_freezes_nor_bloats_nor_crashes_the_router(cluster, baseline, name):
    lag_before = loop_lag_counts(cluster.router.url)
    probe = Probe(cluster.router.url)
    statuses = ACTIONS[name](cluster)
    time.sleep(0.2)
    seen = probe.stop()
    lag = LoopLag.between(lag_before, loop_lag_counts(cluster.router.url))
    print(f"{name}: probe p99 {seen.p99_s() * 1000:.0f} ms max {seen.max_s() * 1000:.0f} ms; loop lag {lag}")
    assert cluster.router.alive()
    rss_back = wait_until(lambda: cluster.rss()[0] <= RSS_SLACK * baseline["rss"], 10.0)
    children_back = wait_until(lambda: cluster.rss()[1] <= RSS_SLACK * baseline["children_rss"], 10.0)
    problems = []
    if not set(statuses) <= EXPECTED[name]:
        problems.append(f"statuses {statuses}, expected {EXPECTED[name]}")
    if seen.errors() or not seen.latencies_s:
        problems.append(f"{seen.errors()} probes failed")
    # the router's own event loop: p99 under 100 ms (with fewer than 100 samples, one sample over
    # it is allowed) and none over 500 ms; single 250-500 ms samples show up on this shared 2-core
    # machine now and then (about one run in three, in one action of nine), so the 250 ms bound is
    # printed, not asserted
    if not lag.p99_under_100ms(allowed=1) or lag.over_500ms:
        problems.append(f"event loop lag {lag}")
    # the probe also counts this machine's scheduling of three busy processes on shared cores
    if seen.p99_s() > PROBE_P99_BOUND_S + baseline["p99_s"] or seen.max_s() > PROBE_MAX_BOUND_S + baseline["max_s"]:
        problems.append(f"probe p99 {seen.p99_s():.3f} s, max {seen.max_s():.3f} s (idle: {baseline})")
    # memory: back within 10% of the baseline within 10 s (a freed body leaves at once, a
    # cycle-held one at the collection 0.2 s after a large body)
    if not (rss_back and children_back):
        problems.append(f"RSS {cluster.rss()} not back within 10% of {baseline}")
    assert not problems, problems


def test_large_bodies_are_parsed_off_the_loop_in_every_router_process():
    # pdlb serve --processes 2: each router process starts its own body worker (a daemonic child
    # could not: the router processes are not daemonic); 6 large bodies over 2 processes, all served
    import json

    from sim.emulator.hostile import children, http_request, spawn_fake_engine
    from sim.emulator.testing import spawn_router

    engines = [spawn_fake_engine(), spawn_fake_engine()]
    try:
        r = spawn_router("sglang", engines[:1], engines[1:], "--processes", "2")
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
