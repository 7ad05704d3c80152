"""The hostile test's verdict (sim/emulator/hostile.py: ``verdict``, ``LoopLag``, ``HostCpu``) on
made-up readings: which bounds hold on a quiet host and on a busy one. Expected: issue 25's
bounds (p99 under 100 ms, never over 250 ms) applied by hand."""

from __future__ import annotations

from sim.emulator.hostile import CPU_LAG, LAG, LOG_BYTES_MAX, HostCpu, LoopLag, ProbeResult, verdict

OK = LoopLag(samples=200, over_100ms=0, over_250ms=0, over_500ms=0)


def _probe(*latencies_ms: float) -> ProbeResult:
    return ProbeResult([0.05 * i for i in range(len(latencies_ms))], [x / 1e3 for x in latencies_ms],
                       [200] * len(latencies_ms))


def test_a_quiet_host_holds_the_probe_and_the_lag_to_the_issue_bounds():
    fine = _probe(*[5.0] * 199, 240.0)  # p99 (the 198th of 200 sorted) 5 ms, max 240 ms: within
    assert verdict("malformed_bearer", [401], fine, OK, OK, 0.1) == []
    slow_max = _probe(*[5.0] * 199, 260.0)
    assert any("probe" in p for p in verdict("malformed_bearer", [401], slow_max, OK, OK, 0.1))
    slow_p99 = _probe(*[5.0] * 197, 120.0, 120.0, 120.0)  # 3 of 200 over 100 ms: p99 120 ms
    assert any("probe" in p for p in verdict("malformed_bearer", [401], slow_p99, OK, OK, 0.1))
    one_late = LoopLag(samples=200, over_100ms=1, over_250ms=1, over_500ms=0)  # a 250-500 ms sample
    assert any("event loop lag" in p for p in verdict("malformed_bearer", [401], fine, one_late, OK, 0.1))
    two_over_100 = LoopLag(samples=150, over_100ms=2, over_250ms=0, over_500ms=0)  # 1.3% > 1%
    assert verdict("malformed_bearer", [401], fine, two_over_100, OK, 0.1) != []
    one_over_100 = LoopLag(samples=150, over_100ms=1, over_250ms=0, over_500ms=0)  # 0.7%: p99 under 100
    assert verdict("malformed_bearer", [401], fine, one_over_100, OK, 0.1) == []


def test_a_busy_host_holds_only_the_cpu_lag():
    slow = _probe(*[5.0] * 190, *[800.0] * 10)
    late = LoopLag(samples=200, over_100ms=5, over_250ms=2, over_500ms=1)
    assert verdict("malformed_bearer", [401], slow, late, OK, 1.5) == []  # the host's doing: printed only
    cpu_late = LoopLag(samples=200, over_100ms=1, over_250ms=1, over_500ms=0)
    problems = verdict("malformed_bearer", [401], slow, late, cpu_late, 1.5)
    assert len(problems) == 1 and "CPU lag" in problems[0]


def test_statuses_and_failed_probes_fail_on_any_host():
    assert any("statuses" in p for p in verdict("malformed_bearer", [401, 500], _probe(1.0), OK, OK, 1.5))
    failed = ProbeResult([0.0, 0.05], [0.001, 0.002], [200, -1])
    assert any("probes failed" in p for p in verdict("malformed_bearer", [401], failed, OK, OK, 1.5))


def test_loop_lag_between_two_histogram_readings():
    # cumulative counts per upper bound, as /metrics gives them; hand: 10 new samples, of which
    # 10 - 7 = 3 over 100 ms, 10 - 9 = 1 over 250 ms, none over 500 ms
    before = {LAG: {0.1: 100.0, 0.25: 100.0, 0.5: 100.0, float("inf"): 100.0}, CPU_LAG: {}}
    after = {LAG: {0.1: 107.0, 0.25: 109.0, 0.5: 110.0, float("inf"): 110.0}, CPU_LAG: {}}
    assert LoopLag.between(before, after) == LoopLag(samples=10, over_100ms=3, over_250ms=1, over_500ms=0)


def test_foreign_cores_subtract_the_own_tree():
    # hand: 2 s, the host's CPUs busy 3.0 s in all, this test's processes 1.0 s: 1.0 CPU of other work
    assert HostCpu(10.0, 50.0, 5.0).foreign_cores(HostCpu(12.0, 53.0, 6.0)) == 1.0
    assert HostCpu(10.0, 50.0, 5.0).foreign_cores(HostCpu(12.0, 50.5, 6.0)) == 0.0  # never negative
    now = HostCpu.now()
    assert now.busy_s > 0 and now.own_s > 0  # this process has used some CPU


def test_what_the_router_logs_during_an_action_is_bounded():
    fine = ProbeResult([0.0], [0.001], [200])
    assert verdict("content_length_minus_5", [400], fine, OK, OK, 1.5, logged_bytes=LOG_BYTES_MAX) == []
    problems = verdict("content_length_minus_5", [400], fine, OK, OK, 1.5, logged_bytes=578_000)  # the issue's flood
    assert len(problems) == 1 and "logged" in problems[0]
