"""AgentX 440246 per DP rank (sim/validation/agentx_ranks.py, the step group's per-rank records,
``AgenticWorkloadConfig.routing_key``).

Expected values: hand calculations (Pearson correlation and least-squares slope of small arrays),
the published capture's own class totals (aisimulate job-4228930-comparison.json ``fpm.counts``,
transcribed separately from its ``per_rank`` block), and two independent tallies of the same run
(the per-step class counts behind ``iterations`` against the per-rank counts)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sim.validation.agentx import load_published, simulate_440246
from sim.validation.agentx_ranks import (capture_rank_records, capture_rank_spread, rank_spread,
                                         simulated_rank_records)
from sim.workload.agentic import AgenticWorkloadConfig


def test_rank_spread_by_hand() -> None:
    # po = [1, 2, 3, 4], idle = [1, 3, 2, 4]: deviations [-1.5, -.5, .5, 1.5] and [-1.5, .5, -.5, 1.5];
    # covariance sum 2.25 - .25 - .25 + 2.25 = 4, each variance sum 5: corr 4/5, slope 4/5
    s = rank_spread(np.array([1, 2, 3, 4]), np.array([1.0, 3.0, 2.0, 4.0]), np.array([3, 3, 3, 3]))
    assert s["corr"] == pytest.approx(0.8)
    assert s["slope"] == pytest.approx(0.8)
    assert s["max_min"] == pytest.approx(4.0)
    assert s["no_decode_share"] == pytest.approx(10 / 22)  # 10 prefill-only of 10 + 12 prefill-bearing
    # one rank's idle second is another's prefill-only records: corr -1, slope -10 records per second
    s = rank_spread(np.array([10, 20, 30]), np.array([3.0, 2.0, 1.0]))
    assert s["corr"] == pytest.approx(-1.0) and s["slope"] == pytest.approx(-10.0)
    assert "no_decode_share" not in s


def test_rank_spread_degenerate_and_bad_input() -> None:
    s = rank_spread(np.array([0, 5]), np.array([2.0, 2.0]))
    assert math.isnan(s["corr"]) and math.isnan(s["slope"]) and s["max_min"] == math.inf
    for po, idle in (([1, 2], [1.0]), ([1], [1.0]), ([[1, 2]], [[1.0, 2.0]])):
        with pytest.raises(ValueError):
            rank_spread(np.array(po), np.array(idle))
    with pytest.raises(ValueError):
        rank_spread(np.array([1, 2]), np.array([1.0, 2.0]), np.array([1, 2, 3]))


def test_capture_per_rank_records_add_up_to_the_published_totals() -> None:
    rec = capture_rank_records()
    it = load_published()["iteration_times_ms"]
    for c in ("prefill_only", "decode_only", "mixed"):
        assert int(rec[c].sum()) == it[c]["count"]  # 16,225 / 524,712 / 46,119
    assert int(rec["no_requests"].sum()) == 3615  # the README's "no scheduled requests" records
    assert list(rec["prefill_only"]) == [2691, 844, 3159, 2346, 1624, 2271, 2270, 1020]
    s = capture_rank_spread()
    # Pearson by its definition, in plain Python sums (independent of numpy's corrcoef / polyfit)
    po = [float(x) for x in rec["prefill_only"]]
    hb = [float(x) for x in rec["no_requests"]]
    mp, mh = sum(po) / 8, sum(hb) / 8
    cov = sum((a - mp) * (b - mh) for a, b in zip(po, hb))
    vp = sum((a - mp) ** 2 for a in po)
    vh = sum((b - mh) ** 2 for b in hb)
    assert s["corr"] == pytest.approx(cov / math.sqrt(vp * vh))
    assert s["slope"] == pytest.approx(cov / vh)
    assert s["corr"] < -0.9  # the busier the rank (fewer idle seconds), the more prefill-only records
    assert s["max_min"] == pytest.approx(3159 / 844)
    assert s["no_decode_share"] == pytest.approx(16225 / (16225 + 46119))


def _run(**wl):  # noqa: ANN003, ANN202
    w = AgenticWorkloadConfig(lanes=8, duration_s=150.0, warmup_requests_per_lane=2, **wl)
    return w, simulate_440246(w)


def test_per_rank_records_tally_with_the_iteration_records() -> None:
    _, r = _run()
    steps = r.rank_class_steps
    assert steps.shape == (8, 3)
    for j, c in enumerate(("prefill_only", "decode_only", "mixed")):
        assert int(steps[:, j].sum()) == len(r.iterations[c])
    assert np.all(r.warmup_rank_class_steps <= steps)
    assert np.all(r.warmup_rank_active_s <= r.rank_active_s + 1e-9)
    assert np.all(r.rank_active_s <= r.end_s + 1e-9) and r.end_s >= r.measure_start_s > 0
    sim = simulated_rank_records(r)
    assert np.allclose(sim["idle_s"], np.maximum(0.0, r.end_s - r.rank_active_s))
    warm = simulated_rank_records(r, warmup_only=True)
    assert np.array_equal(warm["prefill_only"], r.warmup_rank_class_steps[:, 0])
    assert np.all(warm["idle_s"] <= r.measure_start_s + 1e-9)


def test_capped_warmup_behind_a_barrier_is_all_prefill_only() -> None:
    # aiperf's warm-up with every request capped at one output token decodes nothing: until the
    # barrier opens the measured window, every per-rank record with work is prefill-only
    _, r = _run(warmup_primer=True, warmup_think_s=0.0, warmup_max_output_tokens=1, warmup_barrier=True)
    w = r.warmup_rank_class_steps
    assert w[:, 0].sum() > 0 and w[:, 1].sum() == 0 and w[:, 2].sum() == 0


def test_lane_routing_key_keeps_each_lane_on_one_rank() -> None:
    def ranks_per_lane(r):  # noqa: ANN001, ANN202
        out: dict[str, set[int]] = {}
        for i, s in enumerate(r.sessions):
            if r.records.prefill_rank[i] >= 0:  # prefilled before the run ended
                out.setdefault(s.split("-")[0], set()).add(int(r.records.prefill_rank[i]))
        return out
    _, lane = _run(routing_key="lane", turns_median=3.0)
    assert all(len(v) == 1 for v in ranks_per_lane(lane).values())
    # by trajectory (the default), a lane's short trajectories move it across ranks
    _, sess = _run(turns_median=3.0)
    assert any(len(v) > 1 for v in ranks_per_lane(sess).values())
    with pytest.raises(ValueError):
        AgenticWorkloadConfig(routing_key="user")


def test_primer_context_scale_lengthens_only_the_primer() -> None:
    import itertools

    from sim.workload.agentic import lane_turns
    fields = dict(warmup_primer=True, warmup_think_s=0.0, warmup_max_output_tokens=1)
    w, r = _run(primer_context_scale=2.0, **fields)
    rec = r.records
    checked = 0
    for j in range(w.lanes):
        t0, t1 = itertools.islice(lane_turns(w, j), 2)
        idx = [i for i, s in enumerate(r.sessions) if s.startswith(f"lane{j}-")]
        # the primer: twice its first replayed turn (by hand; far below the 1M context here)
        assert rec.prompt_tokens[idx[0]] == 2 * t0.input_tokens
        if len(idx) > 1:  # the next turn keeps its own length and reuses at most its previous prompt
            assert rec.prompt_tokens[idx[1]] == t1.input_tokens
            if rec.prefill_rank[idx[1]] >= 0:
                assert rec.cached_tokens[idx[1]] <= (t1.server_reusable_tokens // 256) * 256
            checked += 1
    assert checked > 0
    with pytest.raises(ValueError):
        AgenticWorkloadConfig(primer_context_scale=2.0)  # no primer to scale
    with pytest.raises(ValueError):
        AgenticWorkloadConfig(warmup_primer=True, primer_context_scale=0.5)
