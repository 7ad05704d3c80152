"""Price sheets, revenue per GPU-hour, cost per million tokens, the required-load solvers, the
analytic steady state and ``pdlb sim price``.

Expected values are hand calculations (the arithmetic is in the comments) or DeepSeek's published
day-6 figures (open-infra-index, 202502OpenSourceWeek: $562,027 theoretical revenue a day at R1
prices, 545% cost profit margin, $87,072 cost a day at $2/GPU-h).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from pdlb_cli.main import main
from sim.pricing import (
    K_HOUR_PER_MTOK,
    PriceSheet,
    TokenRates,
    balanced_revenue_usd_per_gpu_hour,
    cost_usd_per_mtok,
    economics,
    implied_fleet_gpus,
    load_price_sheet,
    load_price_sheets,
    load_summaries,
    operating_point_table,
    prefill_input_tokens_per_s_per_rank,
    rates_from_summary,
    required_input_per_output,
    required_output_tokens_per_s,
    revenue_usd_per_gpu_hour,
    shipped_price_sheets,
    steady_state,
    target_table,
)
from sim.scenario import PoolConfig, Scenario

V3 = dict(name="t", source="test", input_cache_hit_usd_per_mtok=0.07, input_cache_miss_usd_per_mtok=0.27,
          output_usd_per_mtok=1.10, offpeak_discount=0.5, offpeak_start_utc="16:30", offpeak_end_utc="00:30")


def sheet(**kw) -> PriceSheet:
    return PriceSheet(**(V3 | kw))


# ---------------------------------------------------------------------------- formulas
def test_revenue_per_gpu_hour_hand_calculated() -> None:
    # 1000 hit, 500 miss, 200 output tok/s per GPU at 0.07 / 0.27 / 1.10 $/Mtok:
    # 1000*0.07 + 500*0.27 + 200*1.10 = 70 + 135 + 220 = 425 $/Mtok*tok/s; x 3600 s / 1e6 = 1.53 $/GPU-h
    rates = TokenRates(1000.0, 500.0, 200.0)
    assert revenue_usd_per_gpu_hour(rates, sheet()) == pytest.approx(1.53, rel=1e-12)
    assert K_HOUR_PER_MTOK == pytest.approx(0.0036)


def test_cost_per_million_tokens_hand_calculated() -> None:
    rates = TokenRates(1000.0, 500.0, 200.0)
    # all tokens: $2 / (0.0036 * 1700) = 0.326797...; output only: 2 / (0.0036 * 200) = 2.7777...
    assert cost_usd_per_mtok(rates, 2.0) == pytest.approx(2 / (0.0036 * 1700), rel=1e-12)
    assert cost_usd_per_mtok(rates, 2.0, "output") == pytest.approx(2.0 / 0.72, rel=1e-12)
    assert cost_usd_per_mtok(rates, 2.0, "input") == pytest.approx(2 / (0.0036 * 1500), rel=1e-12)
    assert cost_usd_per_mtok(TokenRates(0, 0, 0), 2.0) == math.inf
    e = economics(rates, sheet(), 2.0)
    # margin = 1.53 / 2 - 1 = -0.235; revenue per Mtok of all tokens = 1.53 / (0.0036 * 1700) = 0.25
    assert e.margin == pytest.approx(-0.235, rel=1e-12)
    assert e.revenue_usd_per_mtok == pytest.approx(425 / 1700, rel=1e-12)
    with pytest.raises(ValueError, match="basis"):
        cost_usd_per_mtok(rates, 2.0, "bogus")  # type: ignore[arg-type]


def test_deepseek_day6_published_revenue_and_margin() -> None:
    # DeepSeek day 6: 608B input (342B hit), 168B output a day on 226.75 nodes x 8 H800 on average,
    # $2/GPU-h; at R1 prices (0.14 / 0.55 / 2.19) theoretical revenue $562,027 a day, margin 545%.
    r1 = load_price_sheet("deepseek-r1-2025-02")
    gpus, day_s = 226.75 * 8, 86_400
    rates = TokenRates(342e9 / day_s / gpus, (608e9 - 342e9) / day_s / gpus, 168e9 / day_s / gpus)
    daily = revenue_usd_per_gpu_hour(rates, r1, "list") * gpus * 24
    # published token counts are rounded to 1B; 342e3*0.14 + 266e3*0.55 + 168e3*2.19 = 562,100
    assert daily == pytest.approx(562_100, rel=1e-9)
    assert daily == pytest.approx(562_027, rel=2e-4)
    assert gpus * 24 * 2.0 == pytest.approx(87_072)  # the published daily cost
    e = economics(rates, r1, 2.0, "list")
    assert 100 * e.margin == pytest.approx(545, abs=1.0)


def test_valley_and_blended_discounts() -> None:
    s = sheet()
    rates = TokenRates(1000.0, 500.0, 200.0)
    assert s.offpeak_hours_per_day == 8.0  # 16:30 -> 00:30 wraps midnight
    assert revenue_usd_per_gpu_hour(rates, s, "valley") == pytest.approx(1.53 * 0.5, rel=1e-12)
    # blended: 16 h at list, 8 h at half price -> 1 - 0.5 * 8/24 = 5/6
    assert revenue_usd_per_gpu_hour(rates, s, "blended") == pytest.approx(1.53 * 5 / 6, rel=1e-12)
    assert s.prices_usd_per_mtok("valley") == pytest.approx((0.035, 0.135, 0.55))
    assert s.is_offpeak(17 * 60) and s.is_offpeak(15) and s.is_offpeak(16 * 60 + 30)
    assert not s.is_offpeak(30) and not s.is_offpeak(16 * 60 + 29) and not s.is_offpeak(12 * 60)
    none = sheet(offpeak_discount=0.0, offpeak_start_utc=None, offpeak_end_utc=None)
    assert revenue_usd_per_gpu_hour(rates, none, "valley") == revenue_usd_per_gpu_hour(rates, none, "list")
    assert none.offpeak_hours_per_day == 0.0
    with pytest.raises(ValueError, match="unknown price period"):
        s.factor("night")  # type: ignore[arg-type]
    # R1 sheet: 75% off -> valley output 2.19 * 0.25 = 0.5475
    assert load_price_sheet("deepseek-r1-2025-02").prices_usd_per_mtok("valley")[2] == pytest.approx(0.5475)


@pytest.mark.parametrize("target,h,r,period", [(38.0, 0.96, 1.0, "valley"), (38.0, 0.563, 3.6, "list"),
                                               (5.0, 0.0, 0.0, "blended"), (120.0, 1.0, 50.0, "valley")])
def test_required_output_inverts_revenue(target: float, h: float, r: float, period: str) -> None:
    s = sheet()
    out = required_output_tokens_per_s(target, s, hit_rate=h, input_per_output=r, period=period)
    assert revenue_usd_per_gpu_hour(TokenRates.from_mix(out, r, h), s, period) == pytest.approx(target, rel=1e-12)
    r_back = required_input_per_output(target, s, hit_rate=h, output_tokens_per_s=out, period=period)
    assert r_back == pytest.approx(r, rel=1e-9, abs=1e-9)


def test_required_output_hand_calculated() -> None:
    # valley (x0.5), h 0.96, r 1: p_eff = 0.96*0.035 + 0.04*0.135 + 0.55 = 0.0336 + 0.0054 + 0.55 = 0.589
    # out = 38 / (0.0036 * 0.589) = 38 / 0.0021204 = 17,921.15 tok/s per GPU
    out = required_output_tokens_per_s(38.0, sheet(), hit_rate=0.96, input_per_output=1.0, period="valley")
    assert out == pytest.approx(38 / (0.0036 * 0.589), rel=1e-12)
    assert out == pytest.approx(17_921.15, abs=0.01)


def test_required_input_per_output_edges() -> None:
    s = sheet()
    # output alone: 10,000 tok/s * 0.0036 * 1.10 = $39.6 >= 38 -> no input needed
    assert required_input_per_output(38.0, s, hit_rate=0.9, output_tokens_per_s=10_000) == 0.0
    with pytest.raises(ValueError, match="> 0"):
        required_input_per_output(38.0, s, hit_rate=0.9, output_tokens_per_s=0.0)
    free_input = sheet(input_cache_hit_usd_per_mtok=0.0, input_cache_miss_usd_per_mtok=0.0)
    with pytest.raises(ValueError, match="input is free"):
        required_input_per_output(38.0, free_input, hit_rate=0.9, output_tokens_per_s=100.0)
    free = sheet(input_cache_hit_usd_per_mtok=0.0, input_cache_miss_usd_per_mtok=0.0, output_usd_per_mtok=0.0)
    with pytest.raises(ValueError, match="earns nothing"):
        required_output_tokens_per_s(38.0, free, hit_rate=0.5, input_per_output=1.0)
    with pytest.raises(ValueError, match="hit_rate"):
        required_output_tokens_per_s(38.0, s, hit_rate=1.5, input_per_output=1.0)


def test_balanced_revenue_equals_a_sized_deployment() -> None:
    # o_d = 1000 out tok/s per decode GPU, c_p = 4000 in tok/s per prefill GPU, r = 2:
    # 2 decode GPUs make 2000 out/s, need 4000 in/s = 1 prefill GPU -> 3 GPUs, per GPU 2000/3 out, 4000/3 in
    s = sheet()
    bal = balanced_revenue_usd_per_gpu_hour(s, hit_rate=0.8, input_per_output=2.0, decode_output_tokens_per_s=1000,
                                            prefill_input_tokens_per_s=4000)
    direct = revenue_usd_per_gpu_hour(TokenRates.from_mix(2000 / 3, 2.0, 0.8), s)
    assert bal == pytest.approx(direct, rel=1e-12)


def test_implied_fleet_hand_calculated() -> None:
    # list, h 0.5, r 3: p_eff = 3*(0.5*0.07 + 0.5*0.27) + 1.10 = 0.51 + 1.10 = 1.61 $/M out; /4 = 0.4025 $/Mtok
    # 1e12 tokens/day -> 1e6 Mtok * 0.4025 = $402,500/day; at $38 * 24 = $912 per GPU-day -> 441.3 GPUs
    n = implied_fleet_gpus(sheet(), tokens_per_day=1e12, hit_rate=0.5, input_per_output=3.0,
                           target_usd_per_gpu_hour=38.0, period="list")
    assert n == pytest.approx(402_500 / 912, rel=1e-12)


# ---------------------------------------------------------------------------- sheets
def test_shipped_sheets_load() -> None:
    names = shipped_price_sheets()
    assert {"deepseek-v3-2025-02", "deepseek-r1-2025-02", "deepseek-v3.2-2025-09"} <= set(names)
    for s in load_price_sheets("all"):
        assert s.name in names and s.source and s.currency == "USD"
        assert s.illustrative or s.effective_date
    v3 = load_price_sheet("deepseek-v3-2025-02")
    assert (v3.input_cache_hit_usd_per_mtok, v3.input_cache_miss_usd_per_mtok, v3.output_usd_per_mtok) == (0.07, 0.27, 1.10)
    assert v3.offpeak_discount == 0.5 and v3.offpeak_hours_per_day == 8.0
    assert [s.name for s in load_price_sheets("deepseek-v3-2025-02,deepseek-r1-2025-02")] == \
        ["deepseek-v3-2025-02", "deepseek-r1-2025-02"]


def test_sheet_from_yaml_file(tmp_path: Path) -> None:
    p = tmp_path / "mine.yaml"
    p.write_text("name: mine\nsource: my contract\ninput_cache_hit_usd_per_mtok: 0.1\n"
                 "input_cache_miss_usd_per_mtok: 0.5\noutput_usd_per_mtok: 2\n")
    s = load_price_sheet(p)
    assert (s.name, s.output_usd_per_mtok, s.offpeak_discount) == ("mine", 2.0, 0.0)


@pytest.mark.parametrize("body,match", [
    ('name = "x"\nsource = "s"\ninput_cache_hit_usd_per_mtok = 0.5\ninput_cache_miss_usd_per_mtok = 0.2\n'
     'output_usd_per_mtok = 1\n', "above input_cache_miss"),
    ('name = "x"\ninput_cache_hit_usd_per_mtok = 0.1\ninput_cache_miss_usd_per_mtok = 0.2\noutput_usd_per_mtok = 1\n',
     "source"),
    ('name = "x"\nsource = "s"\ninput_cache_hit_usd_per_mtok = 0.1\ninput_cache_miss_usd_per_mtok = 0.2\n'
     'output_usd_per_mtok = -1\n', "output_usd_per_mtok"),
    ('name = "x"\nsource = "s"\ninput_cache_hit_usd_per_mtok = 0.1\ninput_cache_miss_usd_per_mtok = 0.2\n'
     'output_usd_per_mtok = 1\noffpeak_discount = 0.5\n', "offpeak_start_utc"),
    ('name = "x"\nsource = "s"\ninput_cache_hit_usd_per_mtok = 0.1\ninput_cache_miss_usd_per_mtok = 0.2\n'
     'output_usd_per_mtok = 1\noffpeak_discount = 0.5\noffpeak_start_utc = "25:00"\noffpeak_end_utc = "01:00"\n',
     "HH:MM"),
    ('name = "x"\nsource = "s"\ninput_cache_hit_usd_per_mtok = 0.1\ninput_cache_miss_usd_per_mtok = 0.2\n'
     'output_usd_per_mtok = 1\nprice_in_yen = 3\n', "price_in_yen"),
    ('name = "x"\nsource = "s"\ninput_cache_hit_usd_per_mtok = 0.1\nthis is not toml\n', r"\.toml:4:6: "),  # file:line:col
])
def test_invalid_sheet_names_the_file(tmp_path: Path, body: str, match: str) -> None:
    p = tmp_path / "bad_prices.toml"
    p.write_text(body)
    with pytest.raises(ValueError, match=match) as ei:
        load_price_sheet(p)
    assert str(p) in str(ei.value)


def test_unknown_sheet_lists_shipped() -> None:
    with pytest.raises(ValueError, match="deepseek-v3-2025-02"):
        load_price_sheet("no-such-sheet")


# ---------------------------------------------------------------------------- from a simulation summary
def test_rates_from_summary_and_file(tmp_path: Path) -> None:
    run = {"policy": "p", "scenario": "s", "input_tokens_per_s_per_gpu": 1000.0,
           "output_tokens_per_s_per_gpu": 100.0, "prefix_hit_rate": 0.25}
    r = rates_from_summary(run)
    # 1000 input/s at 25% hit -> 250 hit + 750 miss
    assert (r.input_hit_tokens_per_s, r.input_miss_tokens_per_s, r.output_tokens_per_s) == (250.0, 750.0, 100.0)
    p = tmp_path / "summary.json"
    p.write_text(json.dumps({"meta": {}, "runs": [run, run]}))
    assert len(load_summaries(p)) == 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"runs": [{"policy": "p", "output_tokens_per_s_per_gpu": 1.0}]}))
    with pytest.raises(ValueError, match="input_tokens_per_s_per_gpu") as ei:
        load_summaries(bad)
    assert str(bad) in str(ei.value)
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match="junk.json"):
        load_summaries(tmp_path / "junk.json")


def test_rates_from_a_real_simulation_summary() -> None:
    # the summary divides by all GPUs; rates_from_summary must keep input = hit + miss and the hit split
    from sim.run.cluster import simulate
    from sim.run.metrics import summarize
    from sim.workload import read_trace, take_slice

    reqs = take_slice(read_trace(), 0, 60)
    sc = Scenario(name="tiny", model="deepseek-v3", hardware="h200", prefill=PoolConfig(num_engines=1, dp_ranks=8),
                  decode=PoolConfig(num_engines=1, dp_ranks=8))
    res = simulate(sc, reqs, "cache_aware")
    s = summarize(res)
    r = rates_from_summary(s)
    span = s["makespan_s"]
    # independent: totals from the per-request records
    assert r.input_tokens_per_s * 16 * span == pytest.approx(float(res.records.prompt_tokens.sum()), rel=1e-9)
    assert r.input_hit_tokens_per_s * 16 * span == pytest.approx(float(res.records.cached_tokens.sum()), rel=1e-9)
    assert r.output_tokens_per_s * 16 * span == pytest.approx(float(res.records.output_tokens.sum()), rel=1e-9)


# ---------------------------------------------------------------------------- analytic steady state
class FakePerf:
    """step = 10 ms + 10 us per prefill token + 0.1 ms per decode sequence (max over ranks)."""

    ep_synchronous = False
    wants_prefill_cached_tokens = False
    verify_tokens_per_seq = 1  # no MTP (PerfModel declares both)
    decode_tokens_per_step = 1.0
    kv_bytes_per_token = 100
    kv_capacity_tokens_per_rank = 1_000_000

    def step_time_s(self, pt, pp, ds, dc):  # noqa: ANN001, ANN201
        return np.max(0.01 + 1e-5 * np.asarray(pt, float) + 1e-4 * np.asarray(ds, float), axis=-1)


def _fake_scenario(**decode_kw) -> Scenario:
    return Scenario(name="fake", model="llama-3.1-8b", hardware="h100",
                    prefill=PoolConfig(num_engines=1, dp_ranks=2, max_prefill_tokens=1000, ep=False),
                    decode=PoolConfig(num_engines=1, dp_ranks=4, ep=False, **decode_kw))


def test_prefill_capacity_hand_calculated() -> None:
    pool = PoolConfig(max_prefill_tokens=1000)
    # prompt 1000 at 50% hit: 500 computed -> 2 prompts per step, step = 0.01 + 1e-5 * 1000 = 0.02 s
    # -> 2 * 1000 / 0.02 = 100,000 prompt tokens/s
    assert prefill_input_tokens_per_s_per_rank(FakePerf(), pool, 1000, 0.5) == pytest.approx(100_000)
    # prompt 2500 at 0% hit: chunks 1000, 1000, 500 -> 0.02 + 0.02 + 0.015 = 0.055 s -> 45,454.5/s
    assert prefill_input_tokens_per_s_per_rank(FakePerf(), pool, 2500, 0.0) == pytest.approx(2500 / 0.055)


def test_steady_state_hand_calculated() -> None:
    sc = _fake_scenario()
    f = lambda s, p: FakePerf()  # noqa: E731
    # decode B 10: step 0.01 + 10 * 1e-4 = 0.011 s -> 4 ranks * 10 / 0.011 = 3636.36 out/s;
    # prefill 2 ranks * 100,000 = 200,000 in/s; r = 1000 / 100 = 10 -> feeds 20,000 out/s: decode-bound
    ss = steady_state(sc, prompt_tokens=1000, output_tokens=100, hit_rate=0.5, decode_batch_per_rank=10,
                      perf_factory=f)
    assert ss.bottleneck == "decode" and ss.prefill_limit == "compute"
    assert ss.output_tokens_per_s == pytest.approx(40 / 0.011)
    # per GPU over 2 + 4 = 6 GPUs, input = 10 x output, half of it hits
    assert ss.rates.output_tokens_per_s == pytest.approx(40 / 0.011 / 6)
    assert ss.rates.input_hit_tokens_per_s == pytest.approx(40 / 0.011 / 6 * 10 * 0.5)
    # B 200: step 0.03 -> 4 * 200 / 0.03 = 26,667 out/s > 20,000 the prefill feeds -> prefill-bound
    ss = steady_state(sc, prompt_tokens=1000, output_tokens=100, hit_rate=0.5, decode_batch_per_rank=200,
                      perf_factory=f)
    assert ss.bottleneck == "prefill" and ss.output_tokens_per_s == pytest.approx(20_000)
    # published speed override: 4 ranks * 10 * 230 = 9,200 out/s
    ss = steady_state(sc, prompt_tokens=1000, output_tokens=100, hit_rate=0.5, decode_batch_per_rank=10,
                      decode_tokens_per_s_per_seq=230.0, perf_factory=f)
    assert ss.decode_output_tokens_per_s == pytest.approx(9_200)
    # KV cap 110,000 tokens per rank / (1000 + 100) per sequence = 100 sequences
    ss = steady_state(_fake_scenario(kv_capacity_tokens=110_000), prompt_tokens=1000, output_tokens=100,
                      hit_rate=0.5, decode_batch_per_rank=200, perf_factory=f)
    assert (ss.decode_batch_kv_limit, ss.decode_batch_per_rank) == (100, 100)
    with pytest.raises(ValueError, match="aggregated"):
        steady_state(Scenario(mixed=PoolConfig()), prompt_tokens=10, output_tokens=10, hit_rate=0.5)


def test_target_and_operating_point_tables_agree_with_solvers() -> None:
    sc = _fake_scenario()
    f = lambda s, p: FakePerf()  # noqa: E731
    s = sheet()
    rows = target_table(sc, [s], [0.5], [10.0], target_usd_per_gpu_hour=10.0, period="list", output_tokens=100,
                        tokens_per_s_per_seq=50.0, perf_factory=f)
    (row,) = rows
    out = required_output_tokens_per_s(10.0, s, hit_rate=0.5, input_per_output=10.0)
    assert row.required_output_tokens_per_s_per_gpu == pytest.approx(out)
    # fixed batch = out * 6 GPUs / (4 ranks * 50 tok/s); prefill load = 10 * out * 6 / (2 GPUs * 100,000)
    assert row.fixed_batch_per_rank == pytest.approx(out * 6 / 200)
    assert row.fixed_prefill_load == pytest.approx(10 * out * 6 / 200_000)
    # balanced: the batch's o_d = B * 50 must give the target back through the balanced formula
    o_d = row.balanced_batch_per_rank * 50.0
    assert balanced_revenue_usd_per_gpu_hour(s, hit_rate=0.5, input_per_output=10.0, decode_output_tokens_per_s=o_d,
                                             prefill_input_tokens_per_s=100_000) == pytest.approx(10.0)
    (op,) = operating_point_table(sc, [s], [0.5], batch_per_rank=10, tokens_per_s_per_seq=50.0,
                                  target_usd_per_gpu_hour=10.0, period="list", output_tokens=100, perf_factory=f)
    # 4 ranks * 10 * 50 / 6 GPUs = 333.3 out/s per GPU; r from the inverse solver
    assert op.output_tokens_per_s_per_gpu == pytest.approx(2000 / 6)
    assert op.fixed_input_per_output == pytest.approx(
        required_input_per_output(10.0, s, hit_rate=0.5, output_tokens_per_s=2000 / 6))


# ---------------------------------------------------------------------------- CLI
def test_cli_price_analysis_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "heat.png"
    rc = main(["sim", "price", "--prices", "deepseek-v3-2025-02", "--hit-rate", "0.9,0.96", "--ratio", "1,4",
               "--png", str(png)])
    out = capsys.readouterr().out
    assert rc == 0 and png.stat().st_size > 10_000
    assert "deepinfer-sm100" in out and "deepseek-v3-2025-02" in out and "cross-check" in out


def test_cli_price_from_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "summary.json"
    p.write_text(json.dumps({"runs": [{"policy": "rr", "scenario": "s", "input_tokens_per_s_per_gpu": 1500.0,
                                       "output_tokens_per_s_per_gpu": 200.0, "prefix_hit_rate": 2 / 3}]}))
    rc = main(["sim", "price", "--prices", "deepseek-v3-2025-02", "--period", "list", "--from-summary", str(p)])
    out = capsys.readouterr().out
    # 1000 hit + 500 miss + 200 out at list prices = 1.53 $/GPU-h (first test); margin 1.53/2 - 1 = -23.5%
    assert rc == 0 and "1.53" in out and "-23.5%" in out and "0.3268" in out


def test_cli_price_bad_sheet_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "broken.toml"
    p.write_text('name = "x"\n')
    rc = main(["sim", "price", "--prices", str(p)])
    out = capsys.readouterr().err
    assert rc == 2 and "broken.toml" in out
