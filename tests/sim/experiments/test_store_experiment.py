"""Experiment 1 (store-only replay): hand-calculated hit rates on a tiny stream, the reuse-gap
method vs the KvStore replay, TTL monotonicity, and the store-sweep command."""

from __future__ import annotations

import csv

import pytest

from balancer.types import Request
from pdlb_cli.main import main
from sim.run.engine.kv_store import KvStore
from sim.experiments.store_hit_rate import replay_store, ttl_hit_rates
from sim.workload import SessionWorkloadConfig, session_workload

BS = 4


def _stream():
    # A: chatbot, 8 tokens [1, 2] at t=0; B: chatbot, 14 tokens [1, 2, 3] at t=10 (its 2 tokens
    # past block 3 are a partial block, not hashed); C: agent, 9 tokens [1, 5] at t=100.
    return [
        Request("A", 0.0, 8, (1, 2), traffic_class="chatbot"),
        Request("B", 10.0, 14, (1, 2, 3), traffic_class="chatbot"),
        Request("C", 100.0, 9, (1, 5), traffic_class="agent"),
    ]


def _hits(res):
    return {c: (v.hit_tokens, v.prompt_tokens) for c, v in res.items()}


# Hand calculation (block_size 4, tokens = min(blocks * 4, prompt)):
#  TTL 50, unbounded: A 0; B hits [1, 2] (last access 0, gap 10) = 8; C: block 1 last accessed at
#    10, gap 90 > 50: 0.  chatbot 8/22, agent 0/9, all 8/31.
#  no TTL, unbounded: C hits block 1 = 4.  chatbot 8/22, agent 4/9, all 12/31.
#  TTL 90 (gap == TTL is live): same as no TTL; TTL 89.999: same as TTL 50.
#  capacity 1, no TTL: A stores only [1]; B hits 1 block = 4, stores [1]; C hits 4.
#  measure from t=5: A not counted: chatbot 8/14.
HAND = {
    50.0: {"all": (8, 31), "chatbot": (8, 22), "agent": (0, 9)},
    89.999: {"all": (8, 31), "chatbot": (8, 22), "agent": (0, 9)},
    90.0: {"all": (12, 31), "chatbot": (8, 22), "agent": (4, 9)},
    None: {"all": (12, 31), "chatbot": (8, 22), "agent": (4, 9)},
}


@pytest.mark.parametrize("ttl", list(HAND))
def test_replay_hit_rate_by_hand(ttl):
    assert _hits(replay_store(_stream(), KvStore(None, ttl_s=ttl), BS)) == HAND[ttl]


def test_ttl_hit_rates_by_hand():
    ttls = list(HAND)
    res = ttl_hit_rates(_stream(), ttls, BS)
    for i, ttl in enumerate(ttls):
        assert {c: (v[i].hit_tokens, v[i].prompt_tokens) for c, v in res.items()} == HAND[ttl]


def test_replay_capacity_and_measure_window_by_hand():
    assert _hits(replay_store(_stream(), KvStore(1), BS)) == {"all": (8, 31), "chatbot": (4, 22), "agent": (4, 9)}
    res = replay_store(_stream(), KvStore(None), BS, measure_from_s=5.0)
    assert _hits(res) == {"all": (12, 23), "chatbot": (8, 14), "agent": (4, 9)}
    assert res["chatbot"].hit_rate == pytest.approx(8 / 14)
    assert res["all"].requests == 2


def test_class_ttl_replay_by_hand():
    # agent TTL 50, chatbot 200: block 1 was stored by chatbot requests, so it keeps the chatbot
    # TTL and C hits it (gap 90 <= 200): same as no TTL.
    res = replay_store(_stream(), KvStore(None, class_ttl_s={"agent": 50.0, "chatbot": 200.0}), BS)
    assert _hits(res) == HAND[None]


@pytest.fixture(scope="module")
def workload():
    return session_workload(SessionWorkloadConfig(duration_s=2 * 86400.0, sessions_per_hour=20.0, seed=5))


TTLS = [60.0, 1800.0, 3 * 3600.0, 12 * 3600.0, 86400.0, None]


def test_reuse_gap_method_equals_store_replay(workload):
    # two independent implementations: numpy reuse gaps vs KvStore
    fast = ttl_hit_rates(workload, TTLS, 512, measure_from_s=86400.0)
    for i, ttl in enumerate(TTLS):
        slow = replay_store(workload, KvStore(None, ttl_s=ttl), 512, measure_from_s=86400.0)
        assert {c: (v[i].hit_tokens, v[i].prompt_tokens) for c, v in fast.items()} == _hits(slow)


def test_longer_ttl_never_lowers_hit_rate_at_unbounded_capacity(workload):
    res = ttl_hit_rates(workload, TTLS, 512)
    for cls, rows in res.items():
        rates = [r.hit_rate for r in rows]
        assert rates == sorted(rates), cls
        assert rates[0] < rates[-1], cls  # and the sweep is not flat: TTL matters here
    # the same with the store, for a capacity-free pair of TTLs
    lo = replay_store(workload, KvStore(None, ttl_s=600.0), 512)["chatbot"].hit_rate
    hi = replay_store(workload, KvStore(None, ttl_s=6000.0), 512)["chatbot"].hit_rate
    assert lo <= hi


def test_store_sweep_command_writes_table_and_plot(tmp_path):
    out = tmp_path / "sweep"
    rc = main(["sim", "store-sweep", "--days", "0.1", "--warmup-days", "0.05", "--sessions-per-hour", "30",
               "--ttl-hours", "0.5,2", "--capacity-blocks", "none,2000", "--out", str(out), "--quiet"])
    assert rc == 0
    rows = list(csv.DictReader(open(out / "store_sweep.csv")))
    # unbounded: 0.5 h, 2 h, none; capacity 2000: the same three; plus the per-class row for each
    assert [(r["capacity_blocks"], r["ttl_hours"]) for r in rows] == [
        ("none", "0.5"), ("none", "2"), ("none", "none"), ("none", "agent=72,chatbot=168"),
        ("2000", "0.5"), ("2000", "2"), ("2000", "none"), ("2000", "agent=72,chatbot=168")]
    for r in rows:
        assert 0.0 <= float(r["hit_rate_all"]) <= 1.0
    unb = [float(r["hit_rate_all"]) for r in rows[:3]]
    assert unb == sorted(unb)
    cap = [float(r["hit_rate_all"]) for r in rows[4:7]]
    assert all(c <= u + 1e-12 for c, u in zip(cap, unb))  # a bounded store never beats the unbounded one
    assert (out / "store_sweep.png").stat().st_size > 1000
    assert "| capacity blocks | TTL h |" in (out / "store_sweep.md").read_text()
    assert main(["sim", "store-sweep", "--ttl-hours", "abc", "--out", str(out)]) == 2
    assert main(["sim", "store-sweep", "--class-ttl-hours", "agent", "--out", str(out)]) == 2
