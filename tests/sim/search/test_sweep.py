"""Sweeps (sim.search.sweep, pdlb sim sweep): expansion, resumability, the table, failures kept as rows."""

from __future__ import annotations

import concurrent.futures as cf
import csv
import json
from pathlib import Path

import pytest

from pdlb_cli.main import main
from sim.search.executor import Executor, SerialExecutor
from sim.search.sweep import MAX_POINTS, load_sweep, read_done, run_sweep

SWEEP = """
policies = ["round_robin", "least_load:metric=requests"]
rates = [0.5, 1.0]
limit = 40
[slo]
ttft_s = 5.0
[grid]
"prefill.num_engines" = [1, 2]
"decode.num_engines" = [1, 2]
"""


def _write(tmp_path: Path, text: str = SWEEP) -> Path:
    p = tmp_path / "sw.toml"
    p.write_text(text)
    return p


def test_expansion_is_the_product_with_stable_distinct_ids(tmp_path: Path) -> None:
    sw = load_sweep(_write(tmp_path))
    assert len(sw.points) == 2 * 2 * 2 * 2  # policies x rates x grid (2 x 2)
    assert len(set(sw.ids)) == len(sw.ids)
    assert load_sweep(_write(tmp_path)).ids == sw.ids  # stable across loads
    p = sw.points[0]
    assert (p.policy.label, p.rate_scale, p.scenario.prefill.num_engines, p.scenario.decode.num_engines) == \
        ("round_robin", 0.5, 1, 1)
    assert p.slo.ttft_s == 5.0 and p.workload.limit == 40
    assert dict(sw.points[-1].tag)["set.prefill.num_engines"] == 2
    # listed points, applied after each grid combination
    sw2 = load_sweep(_write(tmp_path, 'policies = ["round_robin"]\n[grid]\n"prefill.num_engines" = [1, 2]\n'
                                      '[[points]]\n"decode.num_engines" = 1\n[[points]]\n"decode.num_engines" = 3\n'))
    assert [(p.scenario.prefill.num_engines, p.scenario.decode.num_engines) for p in sw2.points] == \
        [(1, 1), (1, 3), (2, 1), (2, 3)]


@pytest.mark.parametrize("text, message", [
    ("bogus = 1\n", "unknown key 'bogus'"),
    ('policies = ["nope"]\n', "unknown policy 'nope'"),
    ('[grid]\n"prefill.num_enignes" = [1]\n', "num_enignes"),
    ('[grid]\n"prefill.num_engines" = [1, 0]\n', "point {'prefill.num_engines': 0}"),
    ("rates = [0]\n", "rates must be finite numbers > 0"),
    ('route_slo = "no"\n', "route_slo must be true or false, got 'no'"),
    ("seeds = [0, -1]\n", "sw.toml: seeds must be integers >= 0, got [0, -1]"),  # as the CLI's --seed -1
    ("seeds = [1.5]\n", "sw.toml: seeds: 1.5 is not an integer"),
    ('rates = ["1"]\n', "sw.toml: rates: '1' is not a number"),
    ("[slo]\nttft = 1\n", "[slo]"),
    ("policies = [\n", "sw.toml"),
    ('[grid]\n"perf.mfu" = [' + ",".join(["0.5"] * 101) + ']\n"prefill.num_engines" = [' + ",".join(["1"] * 100) + "]\n",
     f"at most {MAX_POINTS}"),
])
def test_bad_sweep_files_are_one_clear_error(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        load_sweep(_write(tmp_path, text))
    assert message in str(e.value)


def test_route_slo_reaches_the_points_and_their_ids(tmp_path: Path) -> None:
    aware = load_sweep(_write(tmp_path))
    blind = load_sweep(_write(tmp_path, "route_slo = false\n" + SWEEP))
    assert {p.options.route_slo for p in aware.points} == {True}  # default: routed against [slo]
    assert {p.options.route_slo for p in blind.points} == {False}
    # the same points routed otherwise are other simulations: a resume must not take one for the other
    assert not set(aware.ids) & set(blind.ids)
    assert load_sweep(_write(tmp_path, "route_slo = true\n" + SWEEP)).ids == aware.ids


class _FailFirst(Executor):
    """Fails the first point submitted (as a Ray task whose retries ran out would), runs the rest."""

    def __init__(self) -> None:
        self.inner = SerialExecutor()
        self.n = 0

    def submit(self, point):  # noqa: ANN001, ANN201
        self.n += 1
        if self.n == 1:
            fut: cf.Future = cf.Future()
            fut.set_exception(RuntimeError("worker died"))
            return fut
        return self.inner.submit(point)


def test_sweep_resumes_and_keeps_failed_points_as_rows(tmp_path: Path) -> None:
    sw = load_sweep(_write(tmp_path, 'policies = ["round_robin"]\nlimit = 30\nrates = [0.5, 1.0, 2.0]\n'))
    out = tmp_path / "out"
    rows, ran = run_sweep(sw, out, _FailFirst())
    assert ran == 3 and len(rows) == 3
    failed = [r for r in rows if r["error"]]
    assert len(failed) == 1 and "worker died" in failed[0]["error"]
    assert len(read_done(out / "points.jsonl")) == 2  # the failed point is not done
    # rerun: only the failed point runs again, and now succeeds
    rows, ran = run_sweep(sw, out, SerialExecutor())
    assert ran == 1 and all(not r["error"] for r in rows) and len(rows) == 3
    # a run killed mid-write leaves a truncated last line: ignored, that point reruns
    log = out / "points.jsonl"
    text = log.read_text()
    log.write_text(text + text.splitlines()[-1][:40])
    rows, ran = run_sweep(sw, out, SerialExecutor())
    assert ran == 0 and len(rows) == 3
    log.write_text("{bad\n" + text)
    with pytest.raises(ValueError, match="points.jsonl:1: not a JSON line"):
        read_done(log)


def test_sweep_cli_table_csv_json_plots_report_and_resume(tmp_path: Path, capsys) -> None:
    f = _write(tmp_path)
    out = tmp_path / "res"
    assert main(["sim", "sweep", str(f), "--out", str(out), "--jobs", "1", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "16 points (16 run now" in printed
    rows = list(csv.DictReader(open(out / "sweep.csv")))
    assert len(rows) == 16
    cols = set(rows[0])
    # the point's parameters and every summary metric
    assert {"set.prefill.num_engines", "set.decode.num_engines", "policy", "rate_scale", "seed", "attainment",
            "goodput_rps", "summary.ttft_s.p99", "summary.kv.hit_rate.hbm", "summary.decode_load_imbalance"} <= cols
    r = rows[0]
    assert int(r["num_gpus"]) == 8 * (int(r["set.prefill.num_engines"]) + int(r["set.decode.num_engines"]))
    # goodput = SLO-meeting requests per second of the arrival window, with the sweep's SLO
    assert float(r["goodput_rps"]) == pytest.approx(float(r["attainment"]) * float(r["offered_rps"]))
    doc = json.loads((out / "sweep.json").read_text())
    assert len(doc["rows"]) == 16 and "summary.ttft_s.p99" in doc["columns"]
    for name in ("sweep_rates.png", "sweep_heatmap.png", "report.html"):
        assert (out / name).stat().st_size > 5_000, name
    assert not (out / "per_point").exists()  # only if asked
    assert main(["sim", "sweep", str(f), "--out", str(out), "--jobs", "1", "--quiet"]) == 0
    assert "16 points (0 run now" in capsys.readouterr().out


def test_sweep_per_point_folders(tmp_path: Path) -> None:
    f = _write(tmp_path, 'policies = ["round_robin"]\nlimit = 25\n')
    out = tmp_path / "res"
    assert main(["sim", "sweep", str(f), "--out", str(out), "--jobs", "1", "--quiet", "--per-point", "--no-plots"]) == 0
    (pid,) = [d.name for d in (out / "per_point").iterdir()]
    csv_rows = (out / "per_point" / pid / "requests_round_robin.csv").read_text().strip().splitlines()
    assert len(csv_rows) == 26  # header + 25 requests


def test_the_documented_example_sweep_expands() -> None:
    sw = load_sweep(Path(__file__).parents[3] / "docs" / "examples" / "sweep.toml")
    assert len(sw.points) == 24 and sw.grid_keys == ["prefill.num_engines", "decode.num_engines"]
    assert sw.points[0].slo.ttft_per_1k_prompt_tokens_s == 0.5 and sw.points[0].workload.limit == 2000


def test_a_sweep_seed_means_what_sim_run_seed_means(tmp_path: Path) -> None:
    """A sweep's seed seeds the router and the arrival spreading, as ``pdlb sim run --seed`` does
    (was: the router's only, so round_robin gave the same result to 16 digits for every seed). The
    independent implementation is ``pdlb sim run`` itself: each seed's row must equal its summary."""
    f = _write(tmp_path, 'policies = ["round_robin"]\nlimit = 40\nseeds = [0, 1]\nroute_slo = false\n')
    sw = load_sweep(f)
    assert [(p.seed, p.workload.seed) for p in sw.points] == [(0, 0), (1, 1)]
    rows, _ = run_sweep(sw, tmp_path / "out", SerialExecutor())
    by_seed = {r["seed"]: r for r in rows}
    # round_robin ignores the router's RNG: only the spreading can make seeds differ
    assert by_seed[0]["summary.ttft_s.mean"] != by_seed[1]["summary.ttft_s.mean"]
    for seed in (0, 1):
        out = tmp_path / f"run{seed}"
        assert main(["sim", "run", "--policy", "round_robin", "--limit", "40", "--seed", str(seed), "--out", str(out),
                     "--no-plots", "--quiet"]) == 0
        (run,) = json.loads((out / "summary.json").read_text())["runs"]
        for key in ("ttft_s.mean", "ttft_s.p99", "tpot_s.mean", "e2e_s.p50", "makespan_s", "offered_rps"):
            head, _, tail = key.partition(".")
            expect = run[head][tail] if tail else run[head]
            assert by_seed[seed][f"summary.{key}"] == expect, (seed, key)  # bit for bit: the same simulation


def test_sweep_marks_burst_goodput_with_capacitys_check(tmp_path: Path, capsys) -> None:
    """A point whose run ends more than 2 arrival windows after it starts has a burst's goodput
    (sim.run.metrics.burst_note, the check `pdlb sim capacity` applies to its answer); the sweep says so
    in the table, the CSV, the console and the report (was: silent, 20 requests at x64 read as a
    sustained ~200 req/s). Expected: the condition from each row's own summary fields."""
    f = _write(tmp_path, 'scenario = "llama8b-agg-h100"\npolicies = ["round_robin"]\nlimit = 20\nrates = [64.0]\n'
                         'route_slo = false\n')
    out = tmp_path / "burst"
    assert main(["sim", "sweep", str(f), "--out", str(out), "--jobs", "1", "--quiet", "--no-plots"]) == 0
    printed = capsys.readouterr().out
    (row,) = list(csv.DictReader(open(out / "sweep.csv")))
    window, makespan = float(row["summary.arrival_window_s"]), float(row["summary.makespan_s"])
    assert makespan > 2 * window and row["goodput_burst"] == "True"
    note = (f"note: the goodput of 1 of 1 points is a burst's (goodput_burst in sweep.csv, * in the table); e.g. "
            f"round_robin x64 seed 0: the 20 requests arrive over {window:.3g} s and the last finishes at "
            f"{makespan:.3g} s: the cluster absorbed a burst and drained it, which is not a rate it sustains; set "
            "duration_s = S in the sweep file (every rate then runs S seconds of arrivals) or use a longer trace")
    assert note in " ".join(printed.split())
    assert f"{float(row['goodput_rps']):.3f}*" in printed
    assert note.replace("'", "&#x27;") in (out / "report.html").read_text()
    # a steady run: 2 req/s for 60 s of 512-token prompts and 16-token answers, each done within a second
    trace = tmp_path / "ramp.jsonl"
    assert main(["sim", "workload", "ramp", "--rates", "2", "--step-s", "60", "--prompt-tokens", "512",
                 "--output-tokens", "16", "--out", str(trace)]) == 0
    f = _write(tmp_path, f'scenario = "llama8b-agg-h100"\npolicies = ["round_robin"]\ntraces = ["{trace}"]\n')
    capsys.readouterr()
    assert main(["sim", "sweep", str(f), "--out", str(tmp_path / "steady"), "--jobs", "1", "--quiet", "--no-plots"]) == 0
    assert "note:" not in capsys.readouterr().out
    (row,) = list(csv.DictReader(open(tmp_path / "steady" / "sweep.csv")))
    assert row["goodput_burst"] == "False"
    assert float(row["summary.makespan_s"]) < 1.1 * float(row["summary.arrival_window_s"])


def test_burst_note_boundary_and_missing_fields() -> None:
    from sim.run.metrics import burst_note

    # makespan > 2 x window (strict), by hand: 2.0 s over a 1.0 s window is not a burst, 2.01 s is
    assert burst_note(10, 1.0, 2.0) == ""
    assert burst_note(10, 1.0, 2.01).startswith("the 10 requests arrive over 1 s and the last finishes at 2.01 s")
    # no window (all arrive at once: NaN; or 0), a missing field (a failed point): no claim either way
    for window, makespan in ((float("nan"), 5.0), (0.0, 5.0), (None, 5.0), (1.0, None), (1.0, "")):
        assert burst_note(10, window, makespan) == ""
