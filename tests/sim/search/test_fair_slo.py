"""sim.search.fair_slo: the SLO every compared policy meets at light load (issue 23 part 3).

Expected values are hand-computed from the per-request arrays below (each case says how)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sim.search.fair_slo import MAX_STEPS, attainment_at, fair_ttft_scale, scaled_slo
from sim.search.point import SLO

FLAT = SLO(ttft_s=2.0, tpot_s=0.05, attainment=0.9)


def _run(ttft: list[float], tpot: float = 0.01, prompt: int = 1000):
    n = len(ttft)
    return np.asarray(ttft, dtype=float), np.full(n, tpot), np.full(n, prompt, dtype=float)


def test_the_policy_closest_to_failing_idle_sets_the_factor() -> None:
    # A: 18 of 20 at 1 s, 2 at 3 s; 95% (19 of 20) needs the 19th smallest ttft / budget = 3 / 2 = 1.5.
    # B: 19 at 1 s, 1 at 10 s; 19 of 20 already meet 2 s: factor 1.
    a = _run([1.0] * 18 + [3.0] * 2)
    b = _run([1.0] * 19 + [10.0])
    fs = fair_ttft_scale({"A": a, "B": b}, FLAT, margin=0.05)
    assert fs.scale == pytest.approx(1.5)
    assert fs.binding == "A"
    assert fs.needed == {"A": pytest.approx(1.5), "B": pytest.approx(1.0)}
    # at the scaled SLO both meet 95%: A 19/20... the 20th (3 s) is within 3 s too, so 100%; B 19/20
    fair = scaled_slo(FLAT, fs.scale)
    assert attainment_at(*a, fair) == pytest.approx(1.0)
    assert attainment_at(*b, fair) == pytest.approx(0.95)
    # at the base SLO A sits exactly on the target (18/20 = 90%): the threshold artefact the margin avoids
    assert attainment_at(*a, FLAT) == pytest.approx(0.9)


def test_the_factor_is_rounded_up_to_the_grid() -> None:
    # needs ttft / budget = 3.04 / 2 = 1.52 -> the next 5% step is 1.55 (ceil((1.52 - 1) / 0.05) = 11 steps)
    fs = fair_ttft_scale({"A": _run([1.0] * 19 + [3.04])}, FLAT, margin=0.1)  # margin 0.1: all 20 of 20
    assert fs.scale == pytest.approx(1.55)
    fs = fair_ttft_scale({"A": _run([1.0] * 19 + [3.04])}, FLAT, margin=0.1, step=0.25)
    assert fs.scale == pytest.approx(1.75)  # ceil(0.52 / 0.25) = 3 steps


def test_the_per_1k_part_of_the_budget_scales_too() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=0.05, attainment=0.9, ttft_per_1k_prompt_tokens_s=0.5)
    # prompt 4,000 tokens: budget 1 + 0.5 * 4 = 3 s; the slowest of 10 at 6 s needs factor 2 for 100%
    fs = fair_ttft_scale({"A": _run([1.0] * 9 + [6.0], prompt=4000)}, slo, margin=0.1)
    assert fs.scale == pytest.approx(2.0)
    fair = scaled_slo(slo, fs.scale)
    assert (fair.ttft_s, fair.ttft_per_1k_prompt_tokens_s) == (2.0, 1.0)
    assert fair.tpot_s == slo.tpot_s and fair.attainment == slo.attainment


def test_unfinished_requests_and_tpot_misses_no_budget_can_fix() -> None:
    # 2 of 10 never got a first token (NaN): at most 80% whatever the budget -> 95% is out of reach
    fs = fair_ttft_scale({"A": _run([1.0] * 8 + [math.nan] * 2), "B": _run([1.0] * 10)}, FLAT, margin=0.05)
    assert math.isinf(fs.scale) and fs.binding == "A"
    # every request over the TPOT budget: no TTFT budget helps
    fs = fair_ttft_scale({"A": _run([1.0] * 10, tpot=0.2)}, FLAT, margin=0.05)
    assert math.isinf(fs.scale)
    # one-token outputs (NaN TPOT) have no TPOT budget: they count on their TTFT alone
    ttft, tpot, prompt = _run([1.0] * 10, tpot=0.2)
    tpot[:] = math.nan
    assert fair_ttft_scale({"A": (ttft, tpot, prompt)}, FLAT, margin=0.05).scale == 1.0


def test_attainment_counts_like_the_slo_verdict() -> None:
    ttft, tpot, prompt = _run([1.0, 2.0, 2.5, math.nan], tpot=0.01)
    tpot[1] = 0.06  # over 50 ms
    # meets: 1.0 (ok), 2.0 (TPOT miss), 2.5 (TTFT miss), NaN (miss) -> 1 of 4
    assert attainment_at(ttft, tpot, prompt, FLAT) == pytest.approx(0.25)
    verdict = FLAT.verdict(ttft, tpot, prompt.astype(np.int64))
    assert verdict["attainment"] == pytest.approx(0.25)
    assert math.isnan(attainment_at(np.zeros(0), np.zeros(0), np.zeros(0), FLAT))


@pytest.mark.parametrize("kwargs, match", [
    ({"light": {}}, "at least one"),
    ({"slo": SLO(percentile=99.0)}, "attainment-form"),
    ({"margin": -0.01}, "margin"),
    ({"margin": 0.2}, "margin"),
    ({"step": 0.0}, "step"),
    ({"step": math.inf}, "step"),
    ({"light": {"A": (np.ones(3), np.ones(2), np.ones(3))}}, "differ in length"),
])
def test_bad_input_is_refused_clearly(kwargs, match) -> None:
    args = {"light": {"A": _run([1.0] * 10)}, "slo": FLAT, "margin": 0.05, "step": 0.05} | kwargs
    with pytest.raises(ValueError, match=match):
        fair_ttft_scale(args["light"], args["slo"], margin=args["margin"], step=args["step"])
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="scale"):
            scaled_slo(FLAT, bad)


def test_a_factor_beyond_the_grid_bound_is_reported_as_unreachable() -> None:
    # needs 1e6 / 2 = 5e5: more than MAX_STEPS steps of 0.05 -> inf, not a loop of 1e7 steps
    fs = fair_ttft_scale({"A": _run([1e6] * 10)}, FLAT, margin=0.05)
    assert (5e5 - 1.0) / 0.05 > MAX_STEPS and math.isinf(fs.scale)


def test_rate_at_a_ttft_scale_is_read_off_the_grid_in_log_space() -> None:
    from sim.search.fair_slo import rate_at_ttft_scale

    rates = np.array([0.25, 0.5, 1.0, 2.0])
    needed = np.array([1.0, 1.5, 3.0, math.inf])
    # k = 2: first failure at 1.0 (3 > 2); between (1.5, 0.5) and (3, 1.0):
    # t = ln(2 / 1.5) / ln(3 / 1.5) = 0.28768 / 0.69315 = 0.41504; rate = 0.5 * 2^0.41504 = 0.66667
    assert rate_at_ttft_scale(rates, needed, 2.0) == pytest.approx(0.5 * 2 ** (math.log(2 / 1.5) / math.log(2)))
    assert rate_at_ttft_scale(rates, needed, 2.0) == pytest.approx(2 / 3, rel=1e-9)  # 2^(ln(4/3) / ln 2) = 4/3
    # k = 1.5 exactly meets at 0.5, fails at 1.0: t = 0 -> 0.5
    assert rate_at_ttft_scale(rates, needed, 1.5) == pytest.approx(0.5)
    # k = 5: first failure is the inf run at 2.0: no interpolation, the last rate that holds (1.0)
    assert rate_at_ttft_scale(rates, needed, 5.0) == 1.0
    # k = 0.9: fails at the lowest rate -> 0 (below the grid); NaN needs count as failures
    assert rate_at_ttft_scale(rates, needed, 0.9) == 0.0
    assert rate_at_ttft_scale(rates, np.array([1.0, math.nan, 1.0, 1.0]), 2.0) == 0.25
    # every run holds -> inf (above the grid)
    assert math.isinf(rate_at_ttft_scale(rates, np.array([1.0, 1.0, 1.1, 1.2]), 2.0))
    # a non-monotone grid: the first failure decides (1.0 fails k = 2 even though 2.0 would meet it)
    assert rate_at_ttft_scale(rates, np.array([1.0, 1.0, 4.0, 1.5]), 2.0) == pytest.approx(0.5 * 2 ** 0.5)


@pytest.mark.parametrize("rates, needed, scale, match", [
    ([], [], 1.0, "non-empty"),
    ([1.0, 2.0], [1.0], 1.0, "one length"),
    ([1.0, 1.0], [1.0, 1.0], 1.0, "strictly increasing"),
    ([0.0, 1.0], [1.0, 1.0], 1.0, "positive"),
    ([1.0, 2.0], [1.0, 1.0], 0.0, "scale"),
    ([1.0, 2.0], [1.0, 1.0], math.nan, "scale"),
])
def test_rate_at_a_ttft_scale_refuses_bad_input(rates, needed, scale, match) -> None:
    from sim.search.fair_slo import rate_at_ttft_scale

    with pytest.raises(ValueError, match=match):
        rate_at_ttft_scale(np.array(rates), np.array(needed), scale)
