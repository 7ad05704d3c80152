"""Deadline admission's policy core (balancer.deadline_admission): queue order, DRR shares, sheds.

Expected values are hand-computed from the module docstring's rules; each test says how. Unless a
test says otherwise: one replica prefilling 1,000 tokens/s, so ``W = backlog / 1000`` seconds and a
prompt of ``P`` tokens takes ``P / 1000`` s on its own.
"""

from __future__ import annotations

import random

import pytest

from balancer.deadline_admission import AdmissionConfig, DeadlineAdmission, OTHER_TENANT, prefill_backlog
from balancer.router import Router
from balancer.types import ReplicaId, Request, Role, TtftSlo


def make(dispatch_wait_s: float = 1.0, ttft_s: float = 1000.0, **kw) -> DeadlineAdmission:  # noqa: ANN003
    return DeadlineAdmission(AdmissionConfig(TtftSlo(ttft_s), dispatch_wait_s=dispatch_wait_s, **kw), 1000.0, 1)


def keys(outs, action: str = "dispatch") -> list:  # noqa: ANN001
    return [o.held.key for o in outs if o.action == action]


def test_edf_within_a_tenant():
    # gate closed at offer (backlog 5000 tokens = 5 s >= 1 s), open at drain (backlog 0): 400-token
    # prompts add 0.4 s each, W before each dispatch 0, 0.4, 0.8 < 1 -> all three, by deadline 3, 4, 5
    adm = make()
    for key, dl in (("a", 5.0 + 100), ("b", 3.0 + 100), ("c", 4.0 + 100)):
        assert adm.offer(key, "t", None, 400, 0.0, 5000, deadline_s=dl).action == "hold"
    assert adm.num_held == 3
    assert keys(adm.drain(0.0, 0)) == ["b", "c", "a"]
    assert adm.num_held == 0


def test_the_gate_stops_at_dispatch_wait():
    # 500-token prompts, dispatch_wait 1 s: W before each = 0, 0.5 -> two dispatched, then W = 1.0
    adm = make()
    for k in range(5):
        adm.offer(k, "t", None, 500, 0.0, 10_000)
    assert keys(adm.drain(0.0, 0)) == [0, 1]  # same deadline: arrival order
    assert adm.num_held == 3
    assert keys(adm.drain(0.1, 600)) == [2]   # W = 0.6 -> one (W then 1.1)


def test_drr_shares_follow_weights():
    # quantum 1000, A weight 1, B weight 2, 500-token prompts; dispatch_wait 3 s allows 6
    # dispatches (W = 0, 0.5, ..., 2.5). DRR: A's visit adds 1000 -> A, A; B's adds 2000 -> B x4.
    adm = make(dispatch_wait_s=3.0, quantum_tokens=1000, tenant_weights={"B": 2.0})
    for k in range(10):
        adm.offer(f"A{k}", "A", None, 500, 0.0, 10**4)
        adm.offer(f"B{k}", "B", None, 500, 0.0, 10**4)
    assert keys(adm.drain(0.0, 0)) == ["A0", "A1", "B0", "B1", "B2", "B3"]
    # the next 6: A's new visit (A2, A3), then B (B4..B7): over 12 dispatches A 4, B 8 = 1 : 2
    assert keys(adm.drain(0.0, 0)) == ["A2", "A3", "B4", "B5", "B6", "B7"]


def test_drr_charges_large_prompts_over_several_rounds():
    # quantum 1000: A's 2500-token prompt needs three visits (deficit 1000, 2000, 3000); B's
    # 400-token prompts: visit 1 deficit 1000 -> B0, B1 (200 left); visit 2 1200 -> B2, B3, B4
    # (0 left); then A (3000) -> A0; then B 1000 -> B5
    adm = make(dispatch_wait_s=100.0, quantum_tokens=1000)
    adm.offer("A0", "A", None, 2500, 0.0, 10**4)
    for k in range(6):
        adm.offer(f"B{k}", "B", None, 400, 0.0, 10**4)
    assert keys(adm.drain(0.0, 0)) == ["B0", "B1", "B2", "B3", "B4", "A0", "B5"]


def test_strict_priority_between_classes():
    adm = make()
    adm.offer("n1", "t", "normal", 100, 0.0, 10**4)
    adm.offer("l1", "t", "low", 100, 0.0, 10**4)
    adm.offer("h1", "u", "high", 100, 0.0, 10**4)
    adm.offer("x1", "t", "no-such-class", 100, 0.0, 10**4)  # unknown: the default class ("normal")
    assert keys(adm.drain(0.0, 0)) == ["h1", "n1", "x1", "l1"]


def test_shed_at_arrival_when_the_backlog_passes_the_deadline():
    # TTFT SLO 2 s, prompt 100 (0.1 s own): backlog 3000 tokens -> start 3 s, 3.1 > 2 -> shed,
    # Retry-After ceil(3) = 3 s. Backlog 1000 -> 1.1 <= 2 -> held (the gate at 0.5 s is closed).
    adm = make(dispatch_wait_s=0.5, ttft_s=2.0)
    shed = adm.offer("late", "t", None, 100, 0.0, 3000)
    assert (shed.action, shed.reason, shed.retry_after_s) == ("shed", "deadline", 3.0)
    assert adm.offer("ok", "t", None, 100, 0.0, 1000).action == "hold"
    # the queue ahead counts: t's next request (700 tokens at 0.5 s, deadline 2.5) has "ok"'s 100
    # tokens ahead (deadline 2.0 <= 2.5) at t's whole rate (t is the only tenant): start 1.0 + 0.1,
    # 0.5 + 1.1 + own 0.7 = 2.3 <= 2.5 -> held
    assert adm.offer("t2", "t", None, 700, 0.5, 1000).action == "hold"
    # a third of t, 250 tokens at 0.7 s, deadline 2.7: ahead 800 -> start 1.8, 0.7 + 1.8 + 0.25 > 2.7: shed
    assert adm.offer("t3", "t", None, 250, 0.7, 1000).action == "shed"


def test_expiry_while_held():
    # deadline 2 s, prompt 100 -> latest start 1.9 s; W stays 1.0 (gate 0.5 closed): shed once
    # now + 1.0 > 1.9, i.e. after 0.9 s
    adm = make(dispatch_wait_s=0.5, ttft_s=2.0)
    adm.offer("r", "t", None, 100, 0.0, 1000)
    assert adm.drain(0.85, 1000) == []
    out = adm.drain(0.95, 1000)
    assert [(o.held.key, o.action, o.reason) for o in out] == [("r", "shed", "deadline")]
    assert adm.num_held == 0


def test_dispatch_time_check_sheds_a_doomed_head():
    # held at W = 0.6 (gate 0.5); at 1.5 s the backlog falls to 400 tokens (W 0.4): the head
    # (deadline 2 s, own 0.1 s) would start at 1.5 + 0.4 = 1.9, + 0.1 = 2.0 <= 2.0 -> dispatched;
    # at 1.6 s, 2.1 > 2.0 -> shed (by the sweep: latest start 1.9 - W 0.4 = 1.5 < 1.6)
    for now, action in ((1.5, "dispatch"), (1.6, "shed")):
        adm = make(dispatch_wait_s=0.5, ttft_s=2.0)
        adm.offer("r", "t", None, 100, 0.0, 600)
        out = adm.drain(now, 400)
        assert [o.action for o in out] == [action]


def test_a_request_no_idle_cluster_could_serve_in_time_gets_its_budget_after_its_own_prefill():
    # 5000-token prompt takes 5 s alone, SLO 2 s: deadline 0 + 5 + 2 = 7 s, latest start 2 s
    adm = make(dispatch_wait_s=0.5, ttft_s=2.0)
    out = adm.offer("big", "t", None, 5000, 0.0, 1000)
    assert out.action == "hold" and out.held.deadline_s == 7.0
    assert adm.drain(0.95, 1000) == []      # W 1.0: 0.95 + 1.0 <= 2.0
    assert keys(adm.drain(1.5, 0)) == ["big"]
    adm.offer("big2", "t", None, 5000, 0.0, 1000)
    assert [o.reason for o in adm.drain(1.05, 1000)] == ["deadline"]  # 1.05 + 1.0 > 2.0


def test_bounded_queues():
    adm = make(dispatch_wait_s=0.5, max_queue_requests=3, max_queue_per_tenant=2)
    assert [adm.offer(k, "A", None, 10, 0.0, 10**4).action for k in range(3)] == ["hold", "hold", "shed"]
    assert adm.offer("b0", "B", None, 10, 0.0, 10**4).action == "hold"
    full = adm.offer("c0", "C", None, 10, 0.0, 10**4)
    assert (full.action, full.reason) == ("shed", "queue_full")
    # Retry-After: W 10 s + 30 held tokens / 1000 = 10.03 -> 11 s
    assert full.retry_after_s == 11.0
    assert adm.num_held == 3


def test_cancel_and_counts():
    adm = make(dispatch_wait_s=0.5)
    held = [adm.offer(k, "A", "high", 10, 0.0, 10**4).held for k in range(3)]
    assert adm.cancel(held[1], 1.0) and not adm.cancel(held[1], 1.0)
    out = adm.drain(2.0, 0)
    assert keys(out) == [0, 2]
    st = adm.stats()
    assert st["counts"] == {("high", "A", "cancelled"): 1, ("high", "A", "dispatched"): 2}
    assert st["held_wait_s"][("high", "A")] == pytest.approx(1.0 + 2.0 + 2.0)
    assert adm.cancel(held[0], 3.0) is False  # already dispatched


def test_tenant_labels_are_bounded():
    adm = make(max_tenants_tracked=2)
    for k in range(5):
        adm.offer(k, f"tenant-{k}", None, 10, 0.0, 0)
    adm.drain(0.0, 0)
    tenants = {t for (_, t, _) in adm.stats()["counts"]}
    assert tenants == {"tenant-0", "tenant-1", OTHER_TENANT}


def test_every_offered_request_gets_one_outcome_fuzz():
    # random offers, cancels, drains and backlogs: each key ends dispatched, shed or cancelled
    # exactly once, and the queue never passes its bound
    rng = random.Random(7)
    for trial in range(30):
        adm = make(dispatch_wait_s=rng.choice([0.1, 0.5, 2.0]), ttft_s=rng.choice([0.5, 2.0, 10.0]),
                   quantum_tokens=rng.choice([1, 100, 8192]), max_queue_requests=rng.choice([1, 5, 50]),
                   max_queue_per_tenant=rng.choice([1, 3, 50]), tenant_weights={"t0": 3.0})
        final: dict[int, str] = {}
        held = []
        now = 0.0
        for k in range(200):
            now += rng.expovariate(20.0)
            backlog = rng.choice([0, 500, 5000, 50_000])
            o = adm.offer(k, f"t{rng.randrange(4)}", rng.choice(["high", "normal", "low", None]),
                          rng.randint(1, 3000), now, backlog, deadline_s=now + rng.uniform(0.01, 5.0)
                          if rng.random() < 0.3 else None)
            if o.action == "shed":
                final[k] = "shed"
                assert o.retry_after_s >= 1
            else:
                held.append(o.held)
            if rng.random() < 0.1 and held:
                h = held.pop(rng.randrange(len(held)))
                if adm.cancel(h, now):
                    assert h.key not in final
                    final[h.key] = "cancelled"
            for x in adm.drain(now, rng.choice([0, 500, 5000, 50_000])):
                assert x.held.key not in final
                final[x.held.key] = x.action
            assert adm.num_held <= adm.config.max_queue_requests
        for _ in range(250):  # the gate lets dispatch_wait_s of work out per drain
            for x in adm.drain(now + 10_000.0, 0):
                assert x.held.key not in final
                final[x.held.key] = x.action
        assert adm.num_held == 0
        assert sorted(final) == list(range(200)), trial
        counts = adm.stats()["counts"]
        assert sum(counts.values()) == 200


def test_config_errors():
    with pytest.raises(ValueError, match="default_priority"):
        AdmissionConfig(default_priority="gold")
    with pytest.raises(ValueError, match="priority_classes"):
        AdmissionConfig(priority_classes=("a", "a"), default_priority="a")
    with pytest.raises(ValueError, match="quantum_tokens"):
        AdmissionConfig(quantum_tokens=0)
    with pytest.raises(ValueError, match="tenant_weights"):
        AdmissionConfig(tenant_weights={"a": float("nan")})
    with pytest.raises(ValueError, match="dispatch_wait_s"):
        AdmissionConfig(dispatch_wait_s=-1.0)
    with pytest.raises(ValueError, match="rate_tokens_per_s"):
        DeadlineAdmission(AdmissionConfig(), 0.0)
    assert AdmissionConfig(TtftSlo(2.0)).effective_dispatch_wait_s == 0.5  # a quarter of the SLO
    adm = make()
    with pytest.raises(ValueError, match="now_s"):
        adm.offer("x", "t", None, 10, float("nan"), 0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        adm.offer("x", "t", None, 0, 0.0, 0)


def test_prefill_backlog_reads_the_router_load():
    # PD: only prefill replicas count; the dispatched prompt is their backlog until prefill done
    r = Router("round_robin", "round_robin", block_size=16)
    r.add_replica(ReplicaId("p0"), Role.PREFILL)
    r.add_replica(ReplicaId("p1"), Role.PREFILL)
    r.add_replica(ReplicaId("d0"), Role.DECODE)
    assert prefill_backlog(r) == (0, 2)
    r.route(Request("a", 0.0, 700, max_output_tokens=5), 0.0)
    r.route(Request("b", 0.0, 300, max_output_tokens=5), 0.0)
    assert prefill_backlog(r) == (1000, 2)
    r.on_prefill_done("a", 1.0)
    assert prefill_backlog(r) == (300, 2)
