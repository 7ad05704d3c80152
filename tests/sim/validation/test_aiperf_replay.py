"""aiperf's agentic-replay semantics in the closed-loop lanes (issue 23 part 1): the warm-up's
primer (max_tokens=1, the whole prefix at t*) and cache-pressure requests without idle delays,
the spread of the primers, recycling into turn 0, and an empirical think-time shape (the public
Weka corpus' inter-turn gaps, sim/data/measured/weka_trace_shapes.json)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sim.validation.agentx import simulate_440246
from sim.workload.agentic import (WEKA_SHAPES_PATH, AgenticWorkloadConfig, lane_turns, quantile_mean,
                                  replay_stats, sample_quantiles, warmup_requests, weka_primer_lead_quantiles,
                                  weka_think_quantiles)


def _lane_rows(r, lane: int) -> list[int]:
    """Record rows of ``lane``'s requests, in send order (rows are in submission order)."""
    return [i for i, s in enumerate(r.sessions) if s.startswith(f"lane{lane}-")]


def test_quantile_helpers_by_hand():
    # (0, 2, 4) at probabilities (0, .5, 1) is the uniform distribution on [0, 4]: mean 2, and
    # its 25% point is 1 (hand calculation); trapezoid rule: (0 + 2 + 4 - (0 + 4) / 2) / 2 = 2
    q = (0.0, 2.0, 4.0)
    assert quantile_mean(q) == pytest.approx(2.0)
    assert sample_quantiles(q, 0.25) == pytest.approx(1.0)
    assert sample_quantiles(q, 0.0) == 0.0 and sample_quantiles(q, 1.0) == 4.0
    assert sample_quantiles(q, 0.75) == pytest.approx(3.0)
    assert quantile_mean((1.0, 1.0)) == pytest.approx(1.0)


def test_weka_think_quantiles_are_the_corpus_table():
    # the committed table: 51 quantiles of the end-to-start gaps clamped at aiperf's 300 s cap,
    # and its piecewise-linear mean agrees with the corpus mean it was taken from (the table is a
    # 2%-step approximation of the empirical distribution, so within 5%)
    q = weka_think_quantiles()
    data = json.loads(WEKA_SHAPES_PATH.read_text())
    assert len(q) == 51 and q[0] >= 0 and q[-1] == 300.0
    assert all(b >= a for a, b in zip(q, q[1:]))
    assert q[25] == pytest.approx(data["think_gap_s"]["median"], abs=0.05)
    assert quantile_mean(q) == pytest.approx(data["think_gap_s"]["mean_capped_300"], rel=0.05)
    # the corpus' per-turn new tokens are as dispersed as the generator assumes: log-sigma of
    # the positive part 1.8 vs the generator's sqrt(1.2^2 + 1.5^2) = 1.92 (per turn and per
    # trajectory), median 272 vs the fitted 260
    nt = data["new_tokens_per_turn"]
    c = AgenticWorkloadConfig()
    assert nt["log_sigma_of_positive"] == pytest.approx(np.hypot(c.new_tokens_sigma, c.new_tokens_trajectory_sigma), rel=0.1)
    assert nt["p50"] == pytest.approx(c.new_tokens_median, rel=0.1)


@pytest.mark.parametrize("bad", [(1.0,), (2.0, 1.0), (0.0, 0.0), (-1.0, 2.0), (0.0, 1e6)])
@pytest.mark.parametrize("field", ["think_quantiles_s", "primer_lead_quantiles_s"])
def test_quantile_tables_are_validated(bad, field):
    with pytest.raises(ValueError, match=field):
        AgenticWorkloadConfig(**{field: bad})


def test_recycled_trajectories_start_at_turn_zero():
    # the same draws: a lane's first trajectory is unchanged and starts at its start point; every
    # later one starts at turn 0 (aiperf replays a recycled trace "in full from turn 0"), and
    # turns present in both runs have the same prompt and reply
    plain, recycled = AgenticWorkloadConfig(lanes=2), AgenticWorkloadConfig(lanes=2, recycle_from_turn0=True)
    a = [next(it) for it in [lane_turns(plain, 1)] for _ in range(400)]
    b = [next(it) for it in [lane_turns(recycled, 1)] for _ in range(400)]
    assert a[0] == b[0] and a[0].first_of_trajectory
    starts_a = [t for t in a if t.first_of_trajectory][1:]
    starts_b = [t for t in b if t.first_of_trajectory][1:]
    assert starts_b and all(t.turn == 0 and t.reusable_tokens == 0 for t in starts_b)
    assert any(t.turn > 0 for t in starts_a)
    by_key = {(t.session, t.turn): (t.input_tokens, t.output_tokens) for t in a}
    shared = [(t.session, t.turn) for t in b if (t.session, t.turn) in by_key]
    assert len(shared) > 50
    assert all(by_key[k] == (t.input_tokens, t.output_tokens) for t in b for k in [(t.session, t.turn)] if k in by_key)


def test_replay_stats_skip_the_primer():
    c = AgenticWorkloadConfig(lanes=2, warmup_requests_per_lane=3, warmup_primer=True)
    assert warmup_requests(c) == 4
    s_primed = replay_stats(c, 20)
    s_plain = replay_stats(AgenticWorkloadConfig(lanes=2, warmup_requests_per_lane=4), 20)
    assert s_primed == s_plain  # the same turns are measured: the primer is one more warm-up request


def test_primer_and_cache_pressure_warmup_without_idle_delays():
    # aiperf's warm-up: per lane one primer (max_tokens=1: a prefill that never decodes), then the
    # cache-pressure requests back to back, then the measured requests after the think time
    wl = AgenticWorkloadConfig(lanes=4, duration_s=90.0, warmup_requests_per_lane=3, warmup_primer=True,
                               warmup_think_s=0.0, think_s=5.0)
    r = simulate_440246(wl)
    rec = r.records
    warm_end = []
    for lane in range(4):
        rows = _lane_rows(r, lane)
        assert len(rows) > 5
        p = rows[0]
        assert rec.output_tokens[p] == 1 and rec.first_token_s[p] == pytest.approx(rec.finish_s[p])
        assert all(rec.output_tokens[i] >= 1 for i in rows)
        for prev, nxt in zip(rows[:3], rows[1:4]):  # primer -> w1 -> w2 -> w3: no idle delay
            assert rec.arrival_s[nxt] == pytest.approx(rec.finish_s[prev], abs=1e-9)
        # after the last warm-up request: the measured think time
        assert rec.arrival_s[rows[4]] - rec.finish_s[rows[3]] == pytest.approx(5.0, abs=1e-9)
        warm_end.append(rec.finish_s[rows[3]])
    # the measured window opens when the last lane finishes its warm-up (primer included)
    assert r.measure_start_s == pytest.approx(max(warm_end))
    measured_send = set(np.round(r.requests[:, 0], 9))
    for lane in range(4):
        assert not {round(float(rec.arrival_s[i]), 9) for i in _lane_rows(r, lane)[:4]} & measured_send


def test_warmup_barrier_holds_every_lane_until_the_last_warmup_finishes():
    # the same warm-up as above, with a barrier between the phases: a lane that has finished its 4
    # warm-up requests sends nothing until the last lane has; then every lane's 5th request is sent
    # at that instant, measured (hand rule). Without the barrier a lane goes on after its think
    # time (the test above), so its 5th request can precede the window.
    wl = AgenticWorkloadConfig(lanes=4, duration_s=90.0, warmup_requests_per_lane=3, warmup_primer=True,
                               warmup_think_s=0.0, think_s=5.0, warmup_barrier=True)
    r = simulate_440246(wl)
    rec = r.records
    warm_end = [rec.finish_s[_lane_rows(r, lane)[3]] for lane in range(4)]
    assert r.measure_start_s == pytest.approx(max(warm_end))
    assert min(warm_end) < max(warm_end)  # the lanes did finish at different times
    fifth = [rec.arrival_s[_lane_rows(r, lane)[4]] for lane in range(4)]
    assert fifth == pytest.approx([r.measure_start_s] * 4, abs=1e-9)
    measured_send = set(np.round(r.requests[:, 0], 9))
    assert round(float(r.measure_start_s), 9) in measured_send
    with pytest.raises(ValueError, match="warmup_barrier"):
        AgenticWorkloadConfig(warmup_barrier=True, subagent_at_once=True)


def test_primers_spread_so_that_every_t_star_falls_together():
    # leads uniform on [0, 50] s (quantiles (0, 50)): lane j sends its primer at max(lead) - lead_j,
    # so all first requests fall in [0, 50] s, the lane with the longest lead at 0 (hand rule)
    wl = AgenticWorkloadConfig(lanes=8, duration_s=30.0, warmup_requests_per_lane=1, warmup_primer=True,
                               primer_lead_quantiles_s=(0.0, 50.0))
    r = simulate_440246(wl)
    first = [r.records.arrival_s[_lane_rows(r, lane)[0]] for lane in range(8)]
    assert all(0.0 <= t <= 50.0 for t in first) and min(first) == 0.0 and max(first) > 5.0


def test_weka_primer_leads_are_capped_at_the_idle_cap():
    q = weka_primer_lead_quantiles()
    assert len(q) == 51 and q[0] == 0.0 and q[-1] <= 300.0 and all(b >= a for a, b in zip(q, q[1:]))
    assert q[25] == pytest.approx(json.loads(WEKA_SHAPES_PATH.read_text())["primer_lead_s"]["median"], abs=0.05)


def test_think_shape_is_sampled_and_scaled_to_the_mean():
    # quantiles (0, 2) = uniform on [0, 2]; scaled to think_s = 5 s: every gap between a reply and
    # the lane's next request lies in [0, 10] s, their mean is 5 s (sampling error of n gaps:
    # sd 10 / sqrt(12) / sqrt(n), below 0.3 s here, so within 15%), and they are not constant
    wl = AgenticWorkloadConfig(lanes=8, duration_s=240.0, warmup_requests_per_lane=1, think_s=5.0,
                               think_quantiles_s=(0.0, 2.0), max_context_tokens=60_000, max_output_tokens=200)
    r = simulate_440246(wl)
    rec = r.records
    gaps = []
    for lane in range(8):
        rows = _lane_rows(r, lane)
        gaps += [rec.arrival_s[b] - rec.finish_s[a] for a, b in zip(rows, rows[1:])]
    g = np.asarray(gaps)
    assert len(g) > 100
    assert g.min() >= -1e-9 and g.max() <= 10.0 + 1e-9
    assert g.mean() == pytest.approx(5.0, rel=0.15)
    assert g.std() > 1.5  # uniform on [0, 10]: sd 2.9


def test_frontend_work_delays_the_engine_and_counts_in_ttft():
    # one lane: each request reaches the cluster frontend_s_per_token * prompt tokens after the lane
    # sent it (the previous reply's end plus the think time), and the reported TTFT and latency
    # count from the send (hand rule)
    k = 1e-5
    wl = AgenticWorkloadConfig(lanes=1, duration_s=120.0, warmup_requests_per_lane=0, think_s=2.0,
                               max_context_tokens=60_000, max_output_tokens=200)
    r = simulate_440246(wl, frontend_s_per_token=k)
    rec = r.records
    n = len(r.sessions)
    assert n > 3
    for i in range(1, n):
        sent = rec.finish_s[i - 1] + 2.0
        assert rec.arrival_s[i] - sent == pytest.approx(k * rec.prompt_tokens[i], abs=1e-9)
    rows = r.requests
    idx = [int(np.flatnonzero(np.isclose(rec.arrival_s[:n], s + k * p, atol=1e-9))[0]) for s, p in rows[:, [0, 3]]]
    for (s, ttft, e2e, *_), i in zip(rows, idx):
        assert ttft == pytest.approx(rec.first_token_s[i] - s) and e2e == pytest.approx(rec.finish_s[i] - s)
        assert ttft > k * rec.prompt_tokens[i]
    with pytest.raises(ValueError, match="frontend_s_per_token"):
        simulate_440246(wl, frontend_s_per_token=-1.0)


def test_validate_rows_run_with_the_measured_frontend(monkeypatch):
    # pdlb sim validate --agentx-440246 (run_rows) turns the measured tokenization cost on; the
    # bare simulate_440246 keeps it off (policy benches and calibration unchanged)
    import inspect

    import sim.validation.agentx as ax
    seen = {}

    class Fake:
        def metrics(self):
            return {sim: 1.0 for *_, sim, _u, _r in ax.ROWS}

    def fake(workload, *a, **kw):
        seen.update(kw)
        return Fake()
    assert inspect.signature(ax.simulate_440246).parameters["frontend_s_per_token"].default == 0.0
    monkeypatch.setattr(ax, "simulate_440246", fake)
    ax.run_rows(duration_s=10.0)
    assert seen["frontend_s_per_token"] == ax.FRONTEND_S_PER_TOKEN_MEASURED == 2.0e-6
    ax.run_rows(duration_s=10.0, frontend_s_per_token=0.0)
    assert seen["frontend_s_per_token"] == 0.0


def test_a_window_shorter_than_the_warmup_chunk_runs_and_counts_only_requests_done_by_the_deadline():
    # the warm-up runs in 60 s chunks: a no-delay warm-up that ends early in a chunk leaves the clock
    # past start + duration + drain (2.1 s + 1 s + 30 s here); the run must stop there, not raise,
    # and count only requests finished by that deadline (later ones are cancelled)
    from sim.validation.agentx import simulate_440246
    wl = AgenticWorkloadConfig(lanes=4, duration_s=1.0, warmup_requests_per_lane=2, warmup_think_s=0, think_s=0.0,
                               initial_context_median_tokens=2000, turns_median=4, output_median_tokens=20)
    r = simulate_440246(wl)
    deadline = r.measure_start_s + wl.duration_s + 30.0
    assert r.measure_start_s < 30.0  # the warm-up ended early in its first chunk
    assert len(r.requests) > 0
    send, e2e = r.requests[:, 0], r.requests[:, 2]
    assert np.all(send >= r.measure_start_s) and np.all(send < r.measure_start_s + wl.duration_s)
    assert np.all(send + e2e <= deadline + 1e-9)
