"""Capacity searches (sim.search.capacity) on a hand-computable cluster, the zero-load floor, early stop.

The synthetic cluster (capacity_factories.py): one dense rank per engine, 1 s of prefill per
request (1000 tokens x 1 ms), one request per step, requests every 1 s at rate scale 1 with one
output token. At rate scale ``f > 1`` the gap is ``g = 1 / f`` < 1 s, the rank is busy back to
back from request 0 on, request ``i`` finishes at ``i + 1`` and its TTFT is ``1 + i * (1 - g)``
(a D/D/1 queue). With ``n = 101`` requests, a TTFT SLO of ``T = 3 s`` and a 90% attainment
target, 91 requests (``i = 0..90``) must meet it: ``1 + 90 * (1 - 1/f) <= 3``, so the capacity is
``f* = 1 / (1 - 2/90) = 45/44``. Below ``f = 1`` no request waits (TTFT = 1 s).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from capacity_factories import (
    fixed_cost_perf,
    mixed_scenario,
    pd_scenario,
    uniform_requests,
)

from sim.search.capacity import (
    Floor,
    GpuSearch,
    RateSearch,
    run_searches,
    search_gpus,
    search_rate,
    thin_headroom_note,
    zero_load_floor,
)
from sim.run.cluster import simulate
from sim.search.executor import SerialExecutor
from sim.run.metrics import per_request, summarize
from sim.search.point import SLO, Point, SimOptions, WorkloadSpec, evaluate_point, parse_policy, register_workload
from sim.scenario import load_scenario
from sim.workload import scale_rate

OPTS = SimOptions(perf_factory=fixed_cost_perf)
SLO_3S = SLO(ttft_s=3.0, tpot_s=0.1, attainment=0.9)
F_STAR = 45 / 44  # hand-computed capacity, module docstring


def _floor(n: int, misses: int) -> Floor:
    return Floor(np.zeros(n), np.zeros(n), {"num_ok": n - misses}, True, "")


def test_thin_headroom_is_not_noted_for_a_strict_slo_the_floor_barely_touches() -> None:
    """A strict SLO's own small allowance is not thin headroom (at p99 over 12,031
    requests one zero-load miss of the 121 allowed got the note, and attainment 1.0 or p99.9 got it
    with no zero-load miss at all, 'even at zero load 0 of the ... requests miss'). By hand with
    SLO.max_misses: p99 of 12,031 allows 12,031 - floor(0.99 * 12,030) - 1 = 121."""
    assert thin_headroom_note(_floor(12031, 1), SLO(ttft_s=1.0, percentile=99)) is None
    assert thin_headroom_note(_floor(1000, 1), SLO(ttft_s=1.0, attainment=0.99)) is None
    assert thin_headroom_note(_floor(1000, 0), SLO(ttft_s=1.0, attainment=1.0)) is None
    assert thin_headroom_note(_floor(12031, 0), SLO(ttft_s=1.0, percentile=99.9)) is None
    # the measured case (README, policy section): p97 allows 12,031 - floor(0.97 * 12,030) - 1 = 361,
    # the floor misses 297, so queueing has 64 (0.53%): noted
    note = thin_headroom_note(_floor(12031, 297), SLO(ttft_s=1.0, percentile=97))
    assert note is not None and "297 of the 12031 requests (2.47%)" in note and "allows 361, which leaves 64 (0.53%)" in note
    # p99 with the floor spending most of the 121: 100 missed, 21 left (0.17%): noted
    assert "leaves 21 (0.17%)" in thin_headroom_note(_floor(12031, 100), SLO(ttft_s=1.0, percentile=99))


def test_rate_bisection_finds_the_hand_computed_capacity_within_tolerance() -> None:
    tol = 0.005
    r = search_rate(mixed_scenario(), uniform_requests(), "round_robin", slo=SLO_3S, tol=tol, options=OPTS)
    assert r.status == "found", r.reason
    lo, hi = r.bracket
    assert lo <= F_STAR < hi  # the true capacity is inside the final bracket
    assert hi / lo <= 1 + tol
    assert r.rate_scale == lo
    # offered rate: 101 requests over a 100 s window at scale 1 -> 1.01 req/s, times the scale
    assert r.base_rps == pytest.approx(1.01)
    assert r.rate_rps == pytest.approx(1.01 * lo)
    # the answer's point met the SLO with its own numbers: >= 91 of 101 requests, goodput = ok / window
    assert r.best is not None and r.best.meets
    assert r.best.verdict["num_ok"] >= 91
    assert r.best.goodput_rps == pytest.approx(r.best.verdict["num_ok"] / (100 / lo))
    # geometric bisection from start=1: 1 (pass), 2 (miss), then log2(ln 2 / ln 1.005) ~ 7.1 -> 8 halvings
    assert len(r.points) == 10
    assert not r.notes


def test_rate_search_with_two_points_per_round_gives_a_bracket_as_tight() -> None:
    s = RateSearch(mixed_scenario(), "syn-101", parse_policy("round_robin"), SLO_3S, tol=0.005, options=OPTS, width=2)
    register_workload("syn-101", uniform_requests())
    (r,) = run_searches([s], SerialExecutor())
    lo, hi = r.bracket
    assert r.status == "found" and lo <= F_STAR < hi and hi / lo <= 1.005
    # a round of 2 splits the bracket into 3 equal ratios: fewer rounds than width 1's 10 points / 10 rounds
    rounds = len(r.points) / 2
    assert rounds <= 7


def test_rate_search_reports_bounds_instead_of_searching_on() -> None:
    # capacity 45/44 is above a rate_max of 0.5: the SLO holds at the bound
    r = search_rate(mixed_scenario(), uniform_requests(), "round_robin", slo=SLO_3S, rate_min=0.1, rate_max=0.5,
                    start=0.5, options=OPTS)
    assert r.status == "above_bounds" and r.rate_scale == 0.5 and "upper bound" in r.reason
    assert len(r.points) == 1
    # capacity below rate_min = 2: fails at the bound, though the floor (TTFT 1 s <= 3 s) allows it
    r = search_rate(mixed_scenario(), uniform_requests(), "round_robin", slo=SLO_3S, rate_min=2, rate_max=8,
                    start=2, options=OPTS)
    assert r.status == "below_bounds" and r.rate_scale is None and r.bracket == (None, 2)
    assert r.floor is not None and r.floor.meets


def test_unreachable_slo_is_reported_with_the_zero_load_floor_and_no_simulation() -> None:
    # a 10,000-token prompt needs 10 s of prefill alone (1 ms/token) against a 3 s TTFT SLO; the
    # other 100 requests (1 s each) can meet it: at most 100/101 = 99.0% < 99.5%
    reqs = uniform_requests(100) + [uniform_requests(1, prompt_tokens=10_000)[0].__class__(
        "long", 100.0, 10_000, tuple(range(10**6, 10**6 + 20)))]
    slo = SLO(ttft_s=3.0, attainment=0.995)
    r = search_rate(mixed_scenario(), reqs, "round_robin", slo=slo, options=OPTS)
    assert r.status == "unreachable"
    assert r.points == []  # said so before simulating anything
    assert r.floor is not None
    assert r.floor.ttft_lb_s[-1] == pytest.approx(10.0)  # 10 chunks of 1000 tokens x 1 s
    assert r.floor.verdict["attainment"] == pytest.approx(100 / 101)
    assert "request long" in r.reason and "10,000-token prompt" in r.reason and "99%" in r.reason.replace("99.0%", "99%")
    g = search_gpus(mixed_scenario(), reqs, "round_robin", slo=slo, options=OPTS)
    assert g.status == "unreachable" and g.points == [] and g.num_gpus is None


def _one_long_request() -> list:
    """100 requests of 1 s prefill and one of 10 s (the floor misses it against 3 s), module docstring."""
    return uniform_requests(100) + [uniform_requests(1, prompt_tokens=10_000)[0].__class__(
        "long", 100.0, 10_000, tuple(range(10**6, 10**6 + 20)))]


def test_thin_headroom_is_noted_when_the_floor_leaves_queueing_under_one_percent_of_misses() -> None:
    reqs = _one_long_request()
    # 98.5% of 101: SLO.max_misses = 101 - ceil(99.485) = 1 miss allowed; the floor already misses
    # the long request, so queueing has 0 misses to spend (< 1% of 101) -> noted, and said in numbers
    tight = SLO(ttft_s=3.0, attainment=0.985)
    floor = zero_load_floor(mixed_scenario(), reqs, tight, fixed_cost_perf)
    assert floor.meets and floor.verdict["num_ok"] == 100
    note = thin_headroom_note(floor, tight)
    assert note is not None
    assert "1 of the 101 requests (0.99%) miss" in note and "allows 1, which leaves 0 (0.00%)" in note
    # 90%: 101 - ceil(90.9) = 10 allowed, 9 left = 8.9% of the requests: no note, unless the limit is 10%
    loose = SLO(ttft_s=3.0, attainment=0.9)
    floor = zero_load_floor(mixed_scenario(), reqs, loose, fixed_cost_perf)
    assert thin_headroom_note(floor, loose) is None
    # the floor's 1 miss is not most of the 10 allowed: not thin at any limit
    assert thin_headroom_note(floor, loose, limit=0.1) is None
    # both searches carry it in their notes (the capacity report prints notes)
    r = search_rate(mixed_scenario(), reqs, "round_robin", slo=tight, options=OPTS)
    assert r.status == "found" and any(n.startswith("thin headroom") for n in r.notes)
    g = search_gpus(mixed_scenario(), reqs, "round_robin", slo=tight, rate_scale=0.5, options=OPTS)
    assert any(n.startswith("thin headroom") for n in g.notes)
    assert not any(n.startswith("thin headroom") for n in search_rate(
        mixed_scenario(), reqs, "round_robin", slo=loose, options=OPTS).notes)


def test_gpu_search_aggregated_finds_the_hand_computed_engine_count() -> None:
    # rate scale 2.5 (gap 0.4 s) with round robin over m engines: each engine sees a gap of 0.4 m s.
    # m = 3: 1.2 s >= the 1 s service, nobody waits -> all meet. m = 2: 0.8 s, engine 0 serves requests
    # 0, 2, ..., 100 (51) and its k-th waits 0.2 k s: TTFT 1 + 0.2 k <= 3 for k <= 10 only; 11 + 11 of
    # 101 meet < 91. So the fewest engines is 3.
    g = search_gpus(mixed_scenario(), uniform_requests(), "round_robin", slo=SLO_3S, rate_scale=2.5,
                    max_engines={"mixed": 8}, options=OPTS)
    assert g.status == "found", g.reason
    assert (g.mixed_engines, g.num_gpus) == (3, 3)
    assert g.best is not None and g.best.meets and g.best.mixed_engines == 3
    tried = {p.mixed_engines: p.meets for p in g.points}
    assert tried[2] is False and tried[8] is True  # the maximum first, then bisection down to 3
    assert g.max_engines == {"mixed": 8}


def test_gpu_search_pd_searches_both_pools_together() -> None:
    # PD: the same 1 s prefill per request on prefill ranks (3 needed at rate 2.5, as above); decode
    # needs one 20 ms step per request (2 output tokens), so one decode engine suffices.
    reqs = uniform_requests(output_tokens=2)
    g = search_gpus(pd_scenario(), reqs, "round_robin", slo=SLO_3S, rate_scale=2.5,
                    max_engines={"prefill": 6, "decode": 4}, options=OPTS)
    assert g.status == "found", g.reason
    assert (g.prefill_engines, g.decode_engines, g.num_gpus) == (3, 1, 4)


def test_gpu_search_above_bounds() -> None:
    g = search_gpus(mixed_scenario(), uniform_requests(), "round_robin", slo=SLO_3S, rate_scale=2.5,
                    max_engines={"mixed": 2}, options=OPTS)
    assert g.status == "above_bounds" and "raise the maximum" in g.reason and g.num_gpus is None


def test_zero_load_floor_is_a_lower_bound_of_simulated_latencies_and_tight_at_low_load() -> None:
    # the real perf model and trace: every simulated TTFT and TPOT is >= the floor, at any load,
    # and at a twentieth of the trace's rate (near zero load) the median TTFT is within 5% of it
    sc = load_scenario("dsv3-pd-h200")
    reqs = WorkloadSpec(limit=300).read()
    floor = zero_load_floor(sc, reqs, SLO())
    for f, policy in ((0.05, "cache_aware"), (2.0, "round_robin")):
        d = per_request(simulate(sc, scale_rate(reqs, f), policy))
        assert np.all(d["ttft_s"] >= floor.ttft_lb_s * (1 - 1e-9))
        multi = ~np.isnan(d["tpot_s"])
        assert np.all(d["tpot_s"][multi] >= floor.tpot_lb_s[multi] * (1 - 1e-9))
        if f < 1:
            assert np.median(d["ttft_s"] / floor.ttft_lb_s) < 1.05


def test_early_stop_keeps_verdicts_and_full_runs_match_simulate() -> None:
    register_workload("syn-101", uniform_requests())
    spec = parse_policy("round_robin")
    for f in (0.9, 1.2):
        full = evaluate_point(Point(mixed_scenario(), "syn-101", spec, f, SLO_3S, options=OPTS))
        fast = evaluate_point(Point(mixed_scenario(), "syn-101", spec, f, SLO_3S, options=OPTS, early_stop=True))
        assert full.meets == fast.meets == (f <= F_STAR)
        if fast.stopped_early:
            assert not full.meets and fast.attainment >= full.attainment  # an upper bound
        else:
            for key in ("ttft_s", "goodput_rps", "num_steps", "makespan_s"):
                assert fast.summary[key] == full.summary[key], key
    # a passing early-stop run on the real trace is the same run as simulate()'s
    sc = load_scenario("dsv3-pd-h200")
    w = WorkloadSpec(limit=200)
    pt = Point(sc, w, parse_policy("cache_aware"), 0.5, SLO(ttft_s=30, attainment=0.5), early_stop=True)
    got = evaluate_point(pt)
    assert got.meets and not got.stopped_early
    want = summarize(simulate(sc, scale_rate(w.read(), 0.5), "cache_aware"), slo_ttft_s=30, slo_tpot_s=0.1)
    for key in ("ttft_s", "tpot_s", "goodput_rps", "prefix_hit_rate", "num_steps", "decode_load_imbalance"):
        assert got.summary[key] == want[key], key


def test_slo_forms() -> None:
    ttft = np.array([1.0, 2.0, 3.0, 4.0, np.nan])
    tpot = np.array([0.05, np.nan, 0.2, 0.05, 0.05])
    prompt = np.array([1000, 1000, 1000, 4000, 1000])
    v = SLO(ttft_s=2.5, tpot_s=0.1, attainment=0.4).verdict(ttft, tpot, prompt)
    assert (v["num_ok"], v["meets"]) == (2, True)  # requests 0 and 1 (one-token output: TTFT only)
    v = SLO(ttft_s=2.5, tpot_s=0.1, attainment=0.41).verdict(ttft, tpot, prompt)
    assert v["meets"] is False
    # budget 2.5 + 0.5 s per 1k prompt tokens: request 3 gets 4.5 s and meets
    v = SLO(ttft_s=2.5, tpot_s=0.1, attainment=0.6, ttft_per_1k_prompt_tokens_s=0.5).verdict(ttft, tpot, prompt)
    assert v["num_ok"] == 4 - 1  # 0, 1, 3 (request 2 misses TPOT, 4 never finished)
    # percentile form: p50 of TTFT/budget over [1/2, 2/2, 3/2, 4/2, inf] = 1.5 > 1
    v = SLO(ttft_s=2.0, tpot_s=0.1, percentile=50).verdict(ttft, tpot, prompt)
    assert v["ttft_ratio_pctl"] == pytest.approx(1.5) and v["meets"] is False
    assert SLO(attainment=0.9).max_misses(101) == 10  # 91 must meet
    assert SLO(percentile=99).max_misses(1000) == 1000 - math.floor(0.99 * 999) - 1
    with pytest.raises(ValueError, match="attainment"):
        SLO(attainment=1.5)


def test_policy_spec_parsing() -> None:
    spec = parse_policy("cache_aware:cache_threshold=0.25,balance_abs=8")
    assert spec.prefill.kwargs == {"cache_threshold": 0.25, "balance_abs": 8}
    assert spec.label == "cache_aware(balance_abs=8,cache_threshold=0.25)"
    p, d = spec.build()
    assert p.cache_threshold == 0.25 and d.balance_abs == 8
    split = parse_policy("kv_cost", "least_load")
    assert split.label == "kv_cost+least_load" and split.decode_spec.name == "least_load"
    with pytest.raises(ValueError, match="no parameter 'bogus'.*accepted"):
        parse_policy("cache_aware:bogus=1")
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        parse_policy("nope")
    with pytest.raises(ValueError, match="expected a number"):
        parse_policy("cache_aware:cache_threshold=high")
    with pytest.raises(ValueError, match="param=value"):
        parse_policy("cache_aware:cache_threshold")
    with pytest.raises(ValueError, match="--policy-module no_such_module_xyz: cannot import"):
        parse_policy("cache_aware", modules=["no_such_module_xyz"])


def test_rate_search_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="rate bounds"):
        search_rate(mixed_scenario(), uniform_requests(), "round_robin", rate_min=2, rate_max=1, start=1.5)
    with pytest.raises(ValueError, match="tol"):
        search_rate(mixed_scenario(), uniform_requests(), "round_robin", tol=0)
    with pytest.raises(ValueError, match="max_engines"):
        GpuSearch(mixed_scenario(), "x", parse_policy("round_robin"), max_engines={"prefill": 3})


def test_process_pool_gives_the_serial_answer() -> None:
    serial = search_rate(mixed_scenario(), uniform_requests(), "round_robin", slo=SLO_3S, tol=0.01, options=OPTS)
    pooled = search_rate(mixed_scenario(), uniform_requests(), "round_robin", slo=SLO_3S, tol=0.01, options=OPTS,
                         jobs=2)
    # two slots for one search: two rates per round, so different points but a bracket as good
    assert pooled.status == serial.status == "found"
    for r in (serial, pooled):
        lo, hi = r.bracket
        assert lo <= F_STAR < hi and hi / lo <= 1.01
    same = {p.point.rate_scale: p.meets for p in serial.points} | {p.point.rate_scale: p.meets for p in pooled.points}
    assert all(meets == (f <= F_STAR) for f, meets in same.items())


def test_goodput_is_per_second_of_the_arrival_window_not_the_makespan() -> None:
    # D/D/1 at rate scale 1.5 (module docstring): TTFT_i = 1 + i/3 <= 3 s for i <= 6, so 7 of 101
    # requests meet a 3 s TTFT SLO. Arrivals span 100 / 1.5 = 66.7 s; the last request finishes at
    # 101 s (makespan 101 s). Goodput = 7 / 66.7 = 0.105 req/s (per makespan it would be 7 / 101).
    res = simulate(mixed_scenario(), scale_rate(uniform_requests(), 1.5), "round_robin", perf_factory=fixed_cost_perf)
    s = summarize(res, slo_ttft_s=3.0)
    assert s["makespan_s"] == pytest.approx(101.0)
    assert s["arrival_window_s"] == pytest.approx(100 / 1.5)
    assert s["slo_attainment"] == pytest.approx(7 / 101)
    assert s["goodput_rps"] == pytest.approx(7 / (100 / 1.5))
    assert s["offered_rps"] == pytest.approx(101 / (100 / 1.5))
    # with every request meeting the SLO (rate scale 1, no queue) goodput is the offered rate
    s1 = summarize(simulate(mixed_scenario(), uniform_requests(), "round_robin", perf_factory=fixed_cost_perf),
                   slo_ttft_s=3.0)
    assert s1["slo_attainment"] == 1.0 and s1["goodput_rps"] == pytest.approx(s1["offered_rps"]) == pytest.approx(1.01)


def test_process_pool_workers_are_terminated_when_the_caller_is_interrupted() -> None:
    # Ctrl-C in the middle of a search: the pool's workers are killed at once rather than waited
    # for (an interrupted pool can leave a worker the interpreter would wait for at exit forever)
    from sim.search.executor import ProcessExecutor

    ex = ProcessExecutor(2)
    slow = Point(load_scenario("dsv3-pd-h200"), WorkloadSpec(limit=3000), parse_policy("round_robin"), 0.2)
    with pytest.raises(KeyboardInterrupt):
        with ex:
            ex.submit(slow)
            procs = list(ex._pool._processes.values())
            assert procs
            raise KeyboardInterrupt
    assert all(not p.is_alive() for p in procs)
    assert ex._pool is None
