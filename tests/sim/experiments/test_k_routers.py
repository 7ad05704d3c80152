"""K routers splitting the traffic in the simulator (sim.experiments.k_routers)."""

from __future__ import annotations

import pytest

from balancer import ReplicaId, Request, Role, Router
from sim.run.cluster import simulate
from sim.experiments.k_routers import KRouters
from sim.run.metrics import summarize
from sim.scenario import DEFAULT_PRESET, load_scenario
from sim.workload import read_trace, spread_batches, take_slice


def _reqs():  # noqa: ANN202
    return spread_batches(take_slice(read_trace(), 0, 300), 3.0, seed=0)


def test_one_router_behind_the_wrapper_is_the_plain_router():
    sc, reqs = load_scenario(DEFAULT_PRESET), _reqs()
    plain = summarize(simulate(sc, reqs, "cache_aware", "least_load", seed=0))
    wrapped = summarize(simulate(sc, reqs, "cache_aware", "least_load", seed=0, router_wrapper=KRouters.wrapper(1, 0)))
    for key in ("prefix_hit_rate", "num_finished", "makespan_s"):
        assert wrapped[key] == plain[key]


def test_requests_split_round_robin_and_events_reach_every_router():
    sc, reqs = load_scenario(DEFAULT_PRESET), _reqs()
    made = []

    def wrap(factory):  # noqa: ANN001, ANN202
        def build(cap):  # noqa: ANN001, ANN202
            g = KRouters(lambda **parts: factory(cap, **parts), 3, seed=0)
            made.append(g)
            return g
        return build

    simulate(sc, reqs, "cache_aware", "least_load", seed=0, index_mode="events", router_wrapper=wrap)
    (g,) = made
    decisions = [r.metrics()["decisions"]["prefill"] for r in g.routers]
    counts = [sum(d.values()) for d in decisions]
    assert counts == [100, 100, 100]  # 300 requests, i mod 3
    applied = [r.metrics()["kv_events"]["applied"] for r in g.routers]
    assert applied[0] > 0 and applied[0] == applied[1] == applied[2]  # every router saw every event
    assert [r.index.num_blocks() for r in g.routers] == [g.routers[0].index.num_blocks()] * 3


def test_shared_load_routers_count_in_one_tracker():
    """``+shared-load``: the K routers are built with one own tracker (LoadSources(own=...)), so
    every request any of them routed is in flight on each one's view, and the run finishes (the
    tracker assigned after construction used to leave the registry on the routers' first
    trackers: a KeyError at the first decision)."""
    sc, reqs = load_scenario(DEFAULT_PRESET), _reqs()
    made = []

    def wrap(factory):  # noqa: ANN001, ANN202
        def build(cap):  # noqa: ANN001, ANN202
            g = KRouters(lambda **parts: factory(cap, **parts), 3, seed=0, shared_load=True)
            made.append(g)
            return g
        return build

    s = summarize(simulate(sc, reqs, "cache_aware", "least_load", seed=0, index_mode="events", router_wrapper=wrap))
    (g,) = made
    assert s["num_finished"] == 300
    assert g.routers[0].load is g.routers[1].load is g.routers[2].load
    assert g.routers[0].load.num_in_flight == 0  # every release reached the one tracker


P0, P1, D0 = ReplicaId("p", 0), ReplicaId("p", 1), ReplicaId("d", 0)


def _route_all(g: KRouters, n: int) -> None:
    for i in range(n):
        g.route(Request(f"r{i}", float(i), 320, tuple(range(i * 100, i * 100 + 20))), 0.5 * i)


def test_k_routers_reports_show_each_router_the_others_in_flight_requests():
    g = KRouters(lambda **parts: Router("round_robin", "round_robin", block_size=16, **parts), 2, seed=0,
                 report_interval_s=1.0)
    for rep, role in ((P0, Role.PREFILL), (P1, Role.PREFILL), (D0, Role.DECODE)):
        g.add_replica(rep, role, 100_000)
    # routes at t = 0, 0.5, 1.0, 1.5: router i mod 2; reports at the first call at or after t = 0 and t = 1
    _route_all(g, 4)
    assert g.reports_sent == 2 * 3 * 2  # 2 boundaries x 3 replicas x 2 routers
    a, b = g.routers
    # at t = 1.0 (before the third request): a routed r0, b routed r1, all in flight; D0 holds both,
    # so each router sees 1 external request there; the decode KV is 2 x 320 = 640 of 100,000 tokens
    sd = a.load.slot(D0)
    assert int(a.load.external_requests[sd]) == 1 and int(b.load.external_requests[sd]) == 1
    assert int(a.load.external_kv_tokens[sd]) == 640 - 320
    with pytest.raises(ValueError, match="report_interval_s"):
        KRouters(lambda **parts: Router("round_robin", block_size=16, **parts), 1, report_interval_s=0.0)
