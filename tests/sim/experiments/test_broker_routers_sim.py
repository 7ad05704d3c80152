"""K routers sharing state through a broker in the simulator (sim/experiments/broker_routers.py):
the delay model checked by hand on a timeline, and the wrapper inside a simulation."""

from __future__ import annotations

import pytest

from balancer.router import Router
from balancer.types import ReplicaId, Request
from sim.run.cluster import simulate
from sim.experiments.broker_routers import BrokerKRouters, markdown, run
from sim.experiments.k_routers import KRouters
from sim.run.metrics import summarize
from sim.scenario import DEFAULT_PRESET, load_scenario
from sim.workload import read_trace, spread_batches, take_slice

R0, R1 = ReplicaId("m0"), ReplicaId("m1")


def _pair(**kw) -> BrokerKRouters:  # noqa: ANN003
    g = BrokerKRouters(lambda **parts: Router("least_load", "least_load", block_size=16, index_mode="approximate",
                                              **parts), 2, seed=0, interval_s=0.05, latency_s=0.001, **kw)
    for r in g.routers:
        r.add_replica(R0, "mixed")
        r.add_replica(R1, "mixed")
    return g


def _peer_requests(g: BrokerKRouters, k: int) -> int:
    return int(g.routers[k].load.peer_requests.sum())


def test_load_is_seen_one_interval_boundary_plus_latency_late():
    g = _pair()
    a, b = g.routers
    # requests alternate A, B, A, B (i mod 2). Timeline, by hand (interval 0.05 s, latency 0.001 s):
    g.route(Request("q0", 0.0, 32, (1, 2)), 0.0)  # A; the snapshot of boundary 0 (empty) is due at 0.001
    g.route(Request("q1", 0.02, 32, (3, 4)), 0.02)  # B: A's q0 not published yet (next boundary 0.05)
    assert _peer_requests(g, 1) == 0
    g.route(Request("q2", 0.0505, 32, (5,)), 0.0505)  # A: boundary 0.05 passed, its snapshots due at 0.051
    assert _peer_requests(g, 0) == 0
    g.route(Request("q3", 0.06, 32, (6,)), 0.06)  # B: A's snapshot of 0.05 holds q0 only (q2 came after)
    assert _peer_requests(g, 1) == 1
    g.on_finished("q0", 0.07)
    g.route(Request("q4", 0.08, 32, (7,)), 0.08)  # A: B's snapshot of 0.05 holds q1 (q3 came after)
    assert _peer_requests(g, 0) == 1
    g.route(Request("q5", 0.12, 32, (8,)), 0.12)  # B: A's snapshot of 0.10: q2 and q4 (q0 finished at 0.07)
    assert _peer_requests(g, 1) == 2
    assert a.load.num_in_flight == 2 and b.load.num_in_flight == 3  # own counts untouched


def test_decisions_reach_the_other_router_at_the_next_boundary_plus_latency():
    g = _pair()
    a, b = g.routers
    route = g.route(Request("q0", 0.01, 32, (11, 12)), 0.01)  # A, sent at 0.05, recorded by B at >= 0.051
    g.route(Request("q1", 0.03, 32, (99,)), 0.03)  # B
    assert b.index.match((11, 12)) == {}
    g.route(Request("q2", 0.0505, 32, (98,)), 0.0505)  # A (0.0505 < 0.051: not yet)
    assert b.index.match((11, 12)) == {}
    g.route(Request("q3", 0.052, 32, (97,)), 0.052)  # B: q0 recorded by B, q1 by A, before this decision
    assert b.index.match((11, 12)) == {route.decode: 2}
    assert set(a.index.match((99,))) == {g.routers[1].index.match((99,)).popitem()[0]}
    assert g.decisions_sent == 4 and g.decisions_recorded == 2  # q2 and q3 go out at 0.10
    g.on_finished("q0", 0.11)  # any call after 0.101 delivers them
    assert g.decisions_recorded == 4 and a.index.match((97,)) != {} and b.index.match((98,)) != {}


def test_bad_delays_rejected():
    for kw in ({"interval_s": 0.0}, {"interval_s": float("nan")}, {"latency_s": -1.0}):
        with pytest.raises(ValueError):
            BrokerKRouters(lambda **parts: Router(**parts), 1, **{"interval_s": 0.05, "latency_s": 0.0, **kw})


def test_in_the_simulator():
    sc = load_scenario(DEFAULT_PRESET)
    reqs = spread_batches(take_slice(read_trace(), 0, 200), 3.0, seed=0)
    plain = summarize(simulate(sc, reqs, "cache_aware", "least_load", seed=0))
    # one router: nobody to share with, so exactly the plain router
    one = summarize(simulate(sc, reqs, "cache_aware", "least_load", seed=0,
                             router_wrapper=BrokerKRouters.broker_wrapper(1, 0)))
    for key in ("prefix_hit_rate", "num_finished", "makespan_s"):
        assert one[key] == plain[key]
    made = []

    def wrap(factory):  # noqa: ANN001, ANN202
        def build(cap):  # noqa: ANN001, ANN202
            g = BrokerKRouters(lambda **parts: factory(cap, **parts), 4, seed=0)
            made.append(g)
            return g
        return build

    four = summarize(simulate(sc, reqs, "cache_aware", "least_load", seed=0, router_wrapper=wrap))
    (g,) = made
    assert four["num_finished"] == 200
    # every decision is recorded by the 3 others: the last one is due 0.05 s + 0.001 s after the
    # last arrival at most, before that request's own prefill is done (a later call delivers it)
    assert g.decisions_sent == 200 and g.decisions_recorded == 3 * 200
    # the sharing routers' prefix hit rate is above four independent ones' (33.0% vs 10.6% for K = 8
    # on the whole trace, README)
    alone = summarize(simulate(sc, reqs, "cache_aware", "least_load", seed=0, router_wrapper=KRouters.wrapper(4, 0)))
    assert four["prefix_hit_rate"] > alone["prefix_hit_rate"]


def test_run_and_table():
    rows = run([1, 2], ["approximate+broker"], limit=60)
    assert [(r["mode"], r["k"]) for r in rows] == [("approximate+broker", 1), ("approximate+broker", 2)]
    assert rows[0]["sync_interval_s"] == 0.05 and rows[0]["num_requests"] == 60
    md = markdown(rows).splitlines()
    assert len(md) == 4 and md[2].endswith("| x1.00 | x1.00 |")
    with pytest.raises(ValueError):
        run([1], ["events+gossip"])
