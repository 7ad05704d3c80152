"""Deadline admission live (issue 28 item 4): the router service in process in front of emulated SGLang
PD engines on loopback, three tenants, requests sent at their arrival times (sim.experiments.overload_live).

Properties asserted (issue 28's): with admission, tenants A and C (not bursting) keep their SLO
attainment within 5 points of the run without the burst while B sends 10x its rate for the middle
third; under overload, goodput with admission is above goodput without; every request gets an
answer (a complete stream or a 429), none is lost. About 90 s on the 2-core development machine.
"""

from __future__ import annotations

import pytest

from sim.experiments.overload_live import live_table


@pytest.mark.slow
def test_live_burst_overload_and_answers():
    runs = live_table(duration_s=12.0, runs=("calm", "burst", "overload"))
    calm, burst = runs["calm/on"], runs["burst/on"]
    for t in ("A", "C"):
        assert burst["by_tenant"][t] >= calm["by_tenant"][t] - 0.05, (t, calm["by_tenant"], burst["by_tenant"])
    assert runs["overload/on"]["goodput_rps"] > runs["overload/off"]["goodput_rps"]
    for key, r in runs.items():
        if isinstance(r, dict):
            assert r["answered"] == r["requests"], (key, r["outcomes"])
            assert set(r["outcomes"]) <= {"ok", "shed"}, (key, r["outcomes"])  # no errors either
    assert runs["overload/on"]["outcomes"].get("shed", 0) > 0
