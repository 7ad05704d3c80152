"""Small bad-input paths of ``pdlb sim``: each is one error line and exit status 2, nothing written
(expected messages written by hand from the rule each enforces)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdlb_cli.main import main
from sim.validation.published import FIGURES_BY_KEY
from sim.workload.benchmarks import load_ramp_workload


def _one_error(argv: list[str], capsys) -> str:
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 2, captured
    assert captured.err.count("\n") == 1, captured.err
    return captured.err.rstrip("\n")


def test_price_simulate_on_an_empty_trace_names_the_trace_before_any_output(tmp_path: Path, capsys) -> None:
    # was: "error: simulation of deepinfer-sm100: key 'input_tokens_per_s_per_gpu' is missing or not a
    # finite number >= 0 (got nan)", after the price sheets table and a 0/0 progress bar
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert _one_error(["sim", "price", "--simulate", "--trace", str(empty)], capsys) == (
        f"error: --trace {empty}: the trace has no requests")


def test_price_simulate_with_every_request_refused_says_so(capsys) -> None:
    rc = main(["sim", "price", "--simulate", "--set", "max_model_len=100", "--limit", "20", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2
    # 20 Mooncake requests, each prompt > 100 tokens: all refused at arrival
    assert err == ("error: simulation of deepinfer-sm100: none of the 20 requests finished (20 over max_model_len; "
                   "max_model_len 100): nothing to price\n")


def test_price_simulate_policy_takes_a_spec(capsys) -> None:
    assert _one_error(["sim", "price", "--simulate", "--policy", "least_load:metrc=requests"], capsys) == (
        "error: --policy: policy 'least_load' has no parameter 'metrc' (did you mean 'metric'?); "
        "accepted: metric='auto'")


def _argparse_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_ramp_with_only_zero_rates_is_refused(tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.jsonl"
    assert _argparse_error(["sim", "workload", "ramp", "--rates", "0,0", "--step-s", "10", "--out", str(out)],
                           capsys) == ("pdlb sim workload ramp: error: argument --rates: every rate is 0, so the "
                                       "workload would be empty; give at least one rate > 0, got '0,0'")
    assert _argparse_error(["sim", "workload", "ramp", "--rates", "1", "--step-s", "10", "--prompt-sigma", "-1",
                            "--out", str(out)], capsys) == (
        "pdlb sim workload ramp: error: argument --prompt-sigma: must be a finite number >= 0, got '-1'")
    with pytest.raises(ValueError, match="every rate is 0"):
        load_ramp_workload([0.0, 0.0], 10.0)
    # a workload that happens to draw no arrival: one line, no empty file
    assert _one_error(["sim", "workload", "ramp", "--rates", "0.001", "--step-s", "1", "--out", str(out)], capsys) == (
        "error: no request arrived (expected 0.001: the sum of --rates x --step-s); raise --rates or --step-s, "
        "or try another --seed")
    assert not out.exists()


@pytest.mark.parametrize("figures", ["", " , "])
def test_validate_with_an_empty_figure_list_is_refused(figures: str, capsys) -> None:
    assert _one_error(["sim", "validate", "--figures", figures], capsys) == (
        f"error: --figures: give at least one figure ({', '.join(FIGURES_BY_KEY)}), or leave the flag out for all")


# ---------------------------------------------------------------------- config syntax errors: one line
@pytest.mark.parametrize("name, text, message", [
    # PyYAML's own report is 5 lines ("while parsing a flow mapping / in "<unicode string>", line 3 ...")
    ("c.yaml", "port: 8000\nworkers: [\n  {url: http://x:1, role: prefill\n",
     ":4:1: expected ',' or '}', but got '<stream end>' (in a flow mapping opened at line 3, column 3)"),
    ("c.yaml", "a: 1\n  b: 2\n", ":2:4: mapping values are not allowed here"),
    ("c.toml", "port = \n", ":1:8: Invalid value"),
    ("c.json", '{"port": }', ":1:10: Expecting value"),
])
def test_config_syntax_errors_are_one_line_with_file_line_column(tmp_path: Path, name: str, text: str,
                                                                 message: str, capsys) -> None:
    f = tmp_path / name
    f.write_text(text)
    assert _one_error(["serve", "--config", str(f)], capsys) == f"error: {f}{message}"
    # a scenario file reads the same way
    s = tmp_path / f"s{Path(name).suffix}"
    s.write_text(text)
    assert _one_error(["sim", "run", "--scenario", str(s), "--limit", "5", "--quiet"], capsys) == f"error: {s}{message}"


def test_a_quoted_count_in_a_serve_router_section_is_one_error_line(tmp_path: Path, capsys) -> None:
    # one error line, exit status 2, not a TypeError traceback with exit status 1
    cfg = tmp_path / "c3.yaml"
    cfg.write_text('router:\n  block_size: "64"\n')
    assert _one_error(["serve", "--config", str(cfg)], capsys) == (
        f"error: {cfg}: router.block_size: block_size must be an integer >= 1, got str '64'")


def test_a_quoted_count_in_a_scenario_router_table_is_one_error_line(tmp_path: Path, capsys) -> None:
    sc = tmp_path / "lc3.toml"
    sc.write_text('name = "t"\nmodel = "llama-3.1-8b"\nhardware = "h100"\n[mixed]\nnum_engines = 2\n'
                  '[router]\nindex_total_capacity_blocks = "1000"\n')
    assert _one_error(["sim", "run", "--scenario", str(sc), "--limit", "20"], capsys) == (
        f"error: {sc}: router.index_total_capacity_blocks: index_total_capacity_blocks must be an integer >= 1, "
        "got str '1000'")


@pytest.mark.parametrize(("argv", "message"), [
    (["--agentx-440246", "--figures", "x"],
     "error: --figures applies only to the published figures (pdlb sim validate without --agentx-440246)"),
    (["--agentx-440246", "--calibrate"],
     "error: --calibrate applies only to the published figures (pdlb sim validate without --agentx-440246)"),
    (["--gpu-runs", "--figures", "sglang-prefill-1k"],
     "error: --figures applies only to the published figures (pdlb sim validate without --gpu-runs)"),
])
def test_validate_refuses_flags_its_mode_would_ignore(argv: list[str], message: str, capsys) -> None:
    # refused before anything runs, not the whole validation with the flag ignored
    assert _one_error(["sim", "validate", *argv], capsys) == message


def test_validate_agentx_notes_a_window_too_short_to_judge(capsys) -> None:
    assert main(["sim", "validate", "--agentx-440246", "--duration-s", "1"]) == 0
    captured = capsys.readouterr()
    out = " ".join(captured.out.split())  # the console wraps the line
    # review4 T6: the hour-long run printed nothing for 30-60 s; now one line first (stderr), the time after
    assert captured.err.startswith("simulating 1 s of AgentX 440246 on pdlb's cluster simulator")
    assert re.search(r"simulated in \d+\.\d s", out)
    assert ("note: --duration-s 1 simulates 1 s of the published 3,600 s: the figures are hour-long averages, so a "
            "window under 600 s (cold caches, few finished requests) is too short to judge the error band") in out


def test_a_quoted_count_in_a_sweep_grid_is_one_error_line_before_any_point(tmp_path: Path, capsys,
                                                                           monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # a point run would write results/ here
    sw = tmp_path / "sw3.toml"
    sw.write_text('scenario = "llama8b-agg-h100"\npolicies = ["least_load"]\n[grid]\n'
                  '"router.index_total_capacity_blocks" = ["1000", 2000]\n')
    assert _one_error(["sim", "sweep", str(sw)], capsys) == (
        f"error: {sw} on scenario 'llama8b-agg-h100': router.index_total_capacity_blocks: index_total_capacity_blocks "
        "must be an integer >= 1, got str '1000' (point {'router.index_total_capacity_blocks': '1000'})")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sw3.toml"]
