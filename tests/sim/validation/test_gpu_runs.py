"""Issue 23 part 2: the simulator against a real engine measured on one H200 (``sim.validation.gpu_runs``,
``pdlb sim validate --gpu-runs``, records in ``sim/data/gpu_runs``, made by ``bench/gpu_engine_run.py``).

Hand-checked pieces (step accounting, the non-negative fit, the request/step matching, the
percentiles, one request through the simulated engine), the shipped records' facts, and the
comparison's errors pinned against regressions."""

from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pytest

from sim.validation import gpu_runs as g
from pdlb_cli.main import main

#: simulated / measured - 1 per (model, phase, metric) as of this commit (mean of 5 seeds). A
#: regression pin, not a truth: a change may move these, but must not make any |error| worse by
#: more than 1 point.
PINNED = {
    # Llama: the 2026-12-05 re-run with 100 s phases (46 / 163 / 202 requests), method unchanged
    ("llama-3.1-8b", "rate0"): {"ttft_p50": 0.121, "ttft_p90": 0.081, "tpot_p50": 0.080, "tpot_p90": -0.068},
    ("llama-3.1-8b", "rate1"): {"ttft_p50": -0.098, "ttft_p90": -0.114, "tpot_p50": -0.090, "tpot_p90": -0.123},
    ("llama-3.1-8b", "rate2"): {"ttft_p50": 0.004, "ttft_p90": 0.139, "tpot_p50": 0.120, "tpot_p90": 0.038},
    # Qwen: the 2026-12-04 run with 25 s phases (13 / 33 / 85 requests)
    ("qwen3-30b-a3b-l12", "rate0"): {"ttft_p50": -0.010, "ttft_p90": 0.078, "tpot_p50": 0.127, "tpot_p90": 0.003},
    ("qwen3-30b-a3b-l12", "rate1"): {"ttft_p50": -0.058, "ttft_p90": -0.058, "tpot_p50": -0.083, "tpot_p90": -0.087},
    ("qwen3-30b-a3b-l12", "rate2"): {"ttft_p50": -0.055, "ttft_p90": 0.042, "tpot_p50": 0.029, "tpot_p90": 0.083},
}


# ----------------------------------------------------------------------------- hand checks
def test_step_work_splits_decode_and_prefill_by_hand():
    # q = [3, 1, 1] after kv = [2, 10, 20]: one chunk of 3 after 2 cached -> 3*2 + 3*4/2 = 12 pairs;
    # two decodes attend to 11 and 21 keys
    assert g.step_work([3, 1, 1], [2, 10, 20]) == (3, 12.0, 2, 32)
    assert g.step_work([], []) == (0, 0.0, 0, 0)


def test_nnls_hand_cases():
    # identity design: the unconstrained answer [2, -1] is clipped to [2, 0]
    assert np.allclose(g.nnls(np.eye(2), np.array([2.0, -1.0])), [2.0, 0.0])
    # an exact non-negative solution is found as least squares finds it
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    assert np.allclose(g.nnls(a, a @ np.array([0.5, 0.25])), [0.5, 0.25])


def test_fit_recovers_known_coefficients_from_synthetic_steps():
    # steps generated from a known model (independent of the fit): t = 0.1 + 0.01 [prefill] + 2e-5 T + 1e-3 B
    rng = np.random.default_rng(1)
    steps = []
    for i in range(200):
        t_pf = int(rng.integers(0, 2)) * int(rng.integers(100, 2048))
        b = int(rng.integers(1, 30))
        c = b * int(rng.integers(100, 2000))
        wall = 0.1 + (0.01 if t_pf else 0.0) + 2e-5 * t_pf + 1e-3 * b
        steps.append([float(i), wall, t_pf, t_pf * (t_pf + 1) / 2.0, b, c, 0])
    run = {"engines": [{"config": {"num_blocks": 10, "block_size": 256}, "steps": steps}],
           "phases": [{"name": "probe", "requests": [[0.0, 1.0, 300.0, 2, 10, 2, 1.0]]}]}
    perf = g.fit_step_model(run)
    assert perf.fit["steps"] == 200 and perf.fit["mape"] < 1e-9
    assert perf.kv_capacity_tokens_per_rank == 2560
    # the model reproduces the generator at a new point: 0.1 + 0.01 + 2e-5*500 + 1e-3*7 = 0.127
    t = perf.step_time_s(np.array([[500]]), np.array([[125250.0]]), np.array([[7]]), np.array([[7000]]))
    assert t.shape == (1,) and t[0] == pytest.approx(0.127, rel=1e-6)


def test_drawn_spread_keeps_the_measured_ratios():
    perf = g.EngineStepPerf((0.1, 0, 0, 0, 0, 0, 0), kv_capacity_tokens_per_rank=1, residuals=(0.5, 2.0), seed=3)
    t = perf.step_time_s(np.zeros((1000, 1)), np.zeros((1000, 1)), np.ones((1000, 1)), np.ones((1000, 1)))
    assert set(np.round(t, 12)) == {0.05, 0.2}  # 0.1 x each measured ratio, nothing else
    assert 0.4 < np.mean(t == 0.2) < 0.6


def test_match_prefill_ends_takes_the_step_that_finishes_each_prompt():
    # engine 0 runs a 5-token prompt in two chunks (3, then 2 after 3); engine 1 a 4-token one in one chunk
    raw = {"engines": [{"steps": [[10.0, 10.1, [3], [0]], [10.1, 10.2, [2, 1], [3, 9]]]},
                       {"steps": [[10.05, 10.3, [4], [0]]]}],
           "phases": [{"name": "rate0", "requests": [
               {"i": 0, "sent": 9.99, "usage": [5, 2]}, {"i": 1, "sent": 10.0, "usage": [4, 2]},
               {"i": 2, "sent": 10.5, "usage": [4, 2]}]}]}  # request 2 has no step after it: unmatched
    assert g.match_prefill_ends(raw) == {("rate0", 0): 10.2, ("rate0", 1): 10.3}


def test_measured_metrics_by_hand():
    # [sent, first, last, chunks, prompt, completion, prefill_end]
    reqs = [[0.0, 0.1, 1.1, 11, 100, 11, 0.09],   # TTFT 0.1, TPOT 1.0/10 = 0.1
            [1.0, 1.3, 1.7, 5, 100, 5, 1.29],      # TTFT 0.3, TPOT 0.4/4 = 0.1
            [2.0, 2.01, 3.2, 4, 100, 3, 2.2]]      # one chunk too many: first token = prefill_end 2.2
    m = g.measured_metrics({"requests": reqs})    # -> TTFT 0.2, TPOT (3.2 - 2.2)/2 = 0.5
    assert m["ttft_p50"] == pytest.approx(0.2)
    assert m["ttft_p90"] == pytest.approx(0.2 + 0.8 * 0.1)  # numpy's linear percentile of 0.1, 0.2, 0.3
    assert m["tpot_p50"] == pytest.approx(0.1)
    assert m["tpot_p90"] == pytest.approx(0.1 + 0.8 * 0.4)
    lo, hi = g.measured_ci({"requests": reqs}, "ttft_p50")
    assert 0.1 - 1e-12 <= lo <= 0.2 <= hi <= 0.3 + 1e-12


def test_one_request_on_an_idle_engine_by_hand():
    # constant 50 ms steps, 2048-token budget: a 3000-token prompt takes 2 prefill steps -> TTFT
    # 0.1 s; 11 output tokens = 1 from the prefill step + 10 decode steps -> TPOT 0.05 s
    run = {"model": {"name": "llama-3.1-8b"},
           "engines": [{"config": {"num_blocks": 100, "block_size": 256, "max_batch_tokens": 2048,
                                   "max_requests_per_batch": 64}}]}
    phase = {"requests": [[5.0, 0.0, 0.0, 11, 3000, 11, None]]}
    perf = g.EngineStepPerf((0.05, 0, 0, 0, 0, 0, 0), kv_capacity_tokens_per_rank=25600)
    m = g.simulate_phase(run, phase, perf)
    assert m["ttft_p50"] == pytest.approx(0.1)
    assert m["tpot_p50"] == pytest.approx(0.05)


# ----------------------------------------------------------------------------- shipped records
@pytest.fixture(scope="module")
def comparisons():
    return {m: g.compare(m) for m in g.shipped_models()}


def test_shipped_records_are_the_two_architectures_at_three_rates(comparisons):
    assert sorted(comparisons) == ["llama-3.1-8b", "qwen3-30b-a3b-l12"]
    for m in comparisons:
        run = g.load_run(m)
        assert run["environment"]["gpu"] == "NVIDIA H200" and run["environment"]["transformers"] == "5.17.0"
        assert len(run["engines"]) == 2
        # what the engine ran with (logged by bench/tf_engine_steps.py): FIFO, 2048-token budget, 256-token blocks
        cfg = run["engines"][0]["config"]
        assert (cfg["scheduler"], cfg["max_batch_tokens"], cfg["block_size"], cfg["prefix_sharing"]) == (
            "fifo", 2048, 256, True)
        rates = [p["rate_rps"] for p in g.rate_phases(run)]
        assert len(rates) == 3 and rates == sorted(rates) and rates[0] > 0
        for p in run["phases"]:  # every request answered, with usage
            assert all(q[1] is not None and q[5] >= 1 for q in p["requests"])
    # 8.03B (published 8B) and 12 / 48 of Qwen3-30B-A3B's 30.5B: 12 * 0.6189B + 2 * 151936 * 2048
    assert g.load_run("llama-3.1-8b")["model"]["params"] == 8_030_261_248
    assert g.load_run("qwen3-30b-a3b-l12")["model"]["params"] == 8_099_779_584


def test_errors_pinned(comparisons):
    for m, cs in comparisons.items():
        for c in cs:
            for k in g.METRICS:
                pinned = PINNED[(m, c.phase)][k]
                assert abs(c.error(k)) <= abs(pinned) + 0.01, (m, c.phase, k, c.error(k), pinned)


def test_24_of_24_within_15_percent_and_the_llama_phases_hold_40_requests_or_more():
    rows = g.rows()
    assert len(rows) == 24
    assert [(r.model, r.phase, r.metric, round(r.error, 3)) for r in rows if r.verdict != "pass"] == []
    # the Llama re-run exists because a p90 of 12 requests (the first run's lowest rate) was the one
    # miss: every phase of it now has at least 40 answered requests (100 s of arrivals per rate)
    assert [c.requests for c in g.compare("llama-3.1-8b")] == [46, 163, 202]


def test_pdlb_ttft_metric_within_5_percent_of_the_client_on_the_gpu_run(comparisons):
    # issue 30: pdlb_time_to_first_token_seconds (first content chunk, after the fix) against the
    # client's mean TTFT over the same requests, every rate of the Llama run
    for c in comparisons["llama-3.1-8b"]:
        assert c.pdlb_ttft_mean_s is not None
        assert abs(c.pdlb_ttft_mean_s / c.client_ttft_mean_s - 1) <= 0.05, c


def test_cli_gpu_runs_table_and_strict(capsys):
    assert main(["sim", "validate", "--gpu-runs"]) == 0
    out = capsys.readouterr().out
    assert "24 of 24 GPU-run figures within +-15%" in out
    assert "qwen3-30b-a3b-l12" in out and "probe+rate1+rate2" in out
    assert main(["sim", "validate", "--gpu-runs", "--strict"]) == 0  # no miss: --strict passes


def test_compact_round_trip_of_a_raw_record(tmp_path):
    raw = {"model": {"name": "llama-3.1-8b", "params": 1, "config": {}}, "environment": {"gpu": "x"},
           "engines": [{"config": [{"kind": "config", "num_blocks": 4}],
                        "steps": [[100.0, 100.25, [4], [0], False], [100.25, 100.5, [1], [4], True]]}],
           "phases": [{"name": "rate0", "rate_rps": 1.0, "pdlb_ttft_before": {"sum": 1.0, "count": 2},
                       "pdlb_ttft_after": {"sum": 1.5, "count": 3},
                       "requests": [{"i": 0, "sent": 99.9, "first": 100.26, "last": 100.51, "chunks": 2,
                                     "usage": [4, 2]}, {"i": 1, "sent": 99.95, "error": "boom"}]}]}
    c = g.compact(raw)
    assert c["engines"][0]["steps"] == [[0.0, 0.25, 4, 10.0, 0, 0, 0], [0.25, 0.25, 0, 0.0, 1, 5, 1]]
    assert c["phases"][0]["requests"][0] == [-0.1, 0.26, 0.51, 2, 4, 2, 0.25]
    assert c["phases"][0]["requests"][1][1] is None  # a failed request keeps no times
    assert c["phases"][0]["pdlb_ttft"] == {"count": 1, "sum_s": 0.5}
    path = tmp_path / "llama-3.1-8b.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump(c, fh)
    assert g.load_run("llama-3.1-8b", tmp_path)["phases"][0]["name"] == "rate0"
    with pytest.raises(ValueError, match="no GPU run record"):
        g.load_run("nope", tmp_path)
    assert not math.isnan(g.measured_metrics(c["phases"][0])["ttft_p50"])


# ----------------------------------------------------------------------------- the bench script's pure parts
def _bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "bench" / "gpu_engine_run.py"
    spec = importlib.util.spec_from_file_location("gpu_engine_run", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # imports no torch at module level
    return mod


def test_bench_trace_slice_and_schedule_by_hand(tmp_path):
    b = _bench()
    csv = tmp_path / "t.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:15:46.0000000,3000,1\n2023-11-16 18:15:47.0000000,10,500\n"
                   "2023-11-16 18:15:50.0000000,20,30\n2023-11-16 18:15:50.5000000,5,5\n")
    rows = b.load_trace(csv, 3, max_prompt=2048, max_output=96)
    # clipped to 2048 / 96, outputs at least 2; gaps 1 s, 3 s, 0.5 s between the 4 timestamps
    assert [(r["prompt_tokens"], r["output_tokens"], r["gap_s"]) for r in rows] == [
        (2048, 2, 1.0), (10, 96, 3.0), (20, 30, 0.5)]
    # mean gap 1.5 s; at 2 req/s each gap is scaled by 1 / (1.5 * 2): arrivals 0, 1/3, 1 + 1/3
    sched = b.arrival_schedule(rows, 2.0, duration_s=10.0)
    assert [round(r["at_s"], 9) for r in sched] == [0.0, round(1 / 3, 9), round(4 / 3, 9)]
    assert len(b.arrival_schedule(rows, 2.0, duration_s=0.2)) == 1  # the arrival at 1/3 s is past 0.2 s
    with pytest.raises(ValueError, match="> 0"):
        b.arrival_schedule(rows, 0.0, 10.0)


def test_bench_reads_pdlb_ttft_histogram_over_label_sets(monkeypatch):
    b = _bench()
    text = ("# HELP pdlb_time_to_first_token_seconds x\n"
            'pdlb_time_to_first_token_seconds_bucket{endpoint="chat",le="0.1"} 1.0\n'
            'pdlb_time_to_first_token_seconds_sum{endpoint="chat"} 0.75\n'
            'pdlb_time_to_first_token_seconds_count{endpoint="chat"} 3.0\n'
            'pdlb_time_to_first_token_seconds_sum{endpoint="completions"} 0.25\n'
            'pdlb_time_to_first_token_seconds_count{endpoint="completions"} 1.0\n')
    monkeypatch.setattr(b, "get_text", lambda url: text)
    assert b.pdlb_ttft_hist("http://x") == {"sum": 1.0, "count": 4.0}
