"""Engine load reports priced as queued prefill work (issue 23: K independent routers each see
about 1/K of every prefill queue). Expected values are hand-computed in the comments. The K
routers' reports of the simulator: tests/sim/experiments/test_k_routers.py."""

from __future__ import annotations

import pickle

import pytest

from balancer import LoadReport, ReplicaId, Request, Role, Router
from balancer.load import LoadTracker

P0, P1, D0 = ReplicaId("p", 0), ReplicaId("p", 1), ReplicaId("d", 0)


def _tracker() -> LoadTracker:
    t = LoadTracker()
    for r in (P0, P1, D0):
        t.add_replica(r)
    return t


def test_external_requests_on_a_prefill_replica_count_as_its_own_mean_pending_prefill():
    t = _tracker()
    t.on_dispatch("a", P0, D0, 1_000, 1_100, prefill_attn_pairs=500_500.0, now_s=0.0)
    t.on_dispatch("b", P0, D0, 3_000, 3_100, prefill_attn_pairs=4_501_500.0, now_s=0.0)
    s = t.slot(P0)
    # own on P0: 2 requests, 4,000 tokens, 5,002,000 pairs; the engine reports 5 (3 external):
    # 3 x 4,000 / 2 = 6,000 tokens and 3 x 5,002,000 / 2 = 7,503,000 pairs
    t.on_report(P0, LoadReport(num_running=1, num_waiting=4), 0, 1.0, prefill_queue=True)
    assert int(t.external_requests[s]) == 3
    assert int(t.external_prefill_tokens[s]) == 6_000
    assert float(t.external_prefill_pairs[s]) == 7_503_000.0
    # P1: nothing of its own pending: priced at every dispatched prefill's mean, (1,000 + 3,000) / 2
    # = 2,000 tokens (and 2,501,000 pairs) per request; 2 external -> 4,000 tokens, 5,002,000 pairs
    t.on_report(P1, LoadReport(num_running=2), 0, 1.0, prefill_queue=True)
    s1 = t.slot(P1)
    assert int(t.external_prefill_tokens[s1]) == 4_000 and float(t.external_prefill_pairs[s1]) == 5_002_000.0
    # a decode replica's requests are decoding sequences, not prefill work
    t.on_report(D0, LoadReport(num_running=9), 0, 1.0)
    sd = t.slot(D0)
    assert int(t.external_requests[sd]) == 7 and int(t.external_prefill_tokens[sd]) == 0
    # a report with nothing external clears the priced queue
    t.on_report(P0, LoadReport(num_running=2), 0, 2.0, prefill_queue=True)
    assert int(t.external_prefill_tokens[s]) == 0 and float(t.external_prefill_pairs[s]) == 0.0
    # expiry clears it too
    t.on_report(P0, LoadReport(num_running=4), 0, 2.0, prefill_queue=True)
    assert int(t.external_prefill_tokens[s]) == 4_000  # 2 x 4,000 / 2
    assert t.expire_reports(3.0) == 3
    assert int(t.external_prefill_tokens[s]) == 0 and int(t.external_prefill_tokens[s1]) == 0
    assert not t.has_external


def test_no_dispatch_yet_prices_nothing_and_old_pickles_load():
    t = _tracker()
    t.on_report(P0, LoadReport(num_running=3), 0, 0.0, prefill_queue=True)  # no mean known yet
    assert int(t.external_requests[t.slot(P0)]) == 3 and int(t.external_prefill_tokens[t.slot(P0)]) == 0
    state = t.__getstate__()
    for k in ("external_prefill_tokens", "external_prefill_pairs", "_dispatched_prefill"):
        del state[k]  # a tracker pickled before these columns existed
    old = LoadTracker.__new__(LoadTracker)
    old.__setstate__(state)
    assert len(old.external_prefill_tokens) == len(old.num_requests) and old._dispatched_prefill == [0, 0, 0.0]
    assert pickle.loads(pickle.dumps(t)).external_requests.tolist() == t.external_requests.tolist()


def test_the_router_adds_the_priced_queue_to_its_prefill_candidates_only():
    r = Router("least_load", "least_load", block_size=16)
    r.add_replica(P0, Role.PREFILL)
    r.add_replica(P1, Role.PREFILL)
    r.add_replica(D0, Role.DECODE, kv_capacity_tokens=100_000)
    route = r.route(Request("a", 0.0, 1_600, tuple(range(100))), 0.0)  # 1,600 uncached tokens
    busy = route.prefill
    idle = P1 if busy == P0 else P0
    # the engines report 4 requests on the busy rank (3 external) and 2 on the idle one (2 external)
    r.on_load_report(busy, LoadReport(num_running=4), 1.0)
    r.on_load_report(idle, LoadReport(num_running=2), 1.0)
    r.on_load_report(D0, LoadReport(num_running=6, kv_usage=0.5), 1.0)
    c = r.candidates(Request("b", 1.0, 160, tuple(range(1000, 1010))), "prefill")
    got = dict(zip(c.replicas, c.prefill_tokens.tolist()))
    # busy: own 1,600 + 3 x 1,600 = 6,400; idle: the dispatched mean 1,600 x 2 = 3,200
    assert got == {busy: 6_400, idle: 3_200}
    pairs = dict(zip(c.replicas, c.prefill_attn_pairs.tolist()))
    one = 1_600 * 1_601 / 2  # u (u + 1) / 2 pairs of 1,600 tokens after none cached
    assert pairs == {busy: 4 * one, idle: 2 * one}
    d = r.candidates(Request("c", 1.0, 160, tuple(range(2000, 2010))), "decode")
    assert d.prefill_tokens.tolist() == [0]  # decode ranks get no prefill work from reports
