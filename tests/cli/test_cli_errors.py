"""What a new user of ``pdlb sim`` sees on bad input: one error line naming the flag, exit 2.

Two kinds of error line (pdlb_cli/main.py module docstring): values checked while parsing end in
argparse's ``pdlb <cmd>: error: argument --flag: ...`` on stderr and ``SystemExit(2)``; the rest
(files, scenarios) end in ``error: ...`` on stdout and ``main`` returns 2. Expected messages are
written out by hand from the inputs; GPU counts are engines x DP ranks x GPUs per rank.
"""

from __future__ import annotations

import io
import json
import sys
import tomllib
from pathlib import Path

import pytest

from pdlb_cli.main import EXIT_BROKEN_PIPE, main
from sim.scenario import PRESETS

ROOT = Path(__file__).resolve().parents[2]


def _argparse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The last stderr line of an argparse rejection (after the usage lines); asserts exit 2."""
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # rejected before any work or output
    return captured.err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    # 1. engine counts (were: NoReplicaError traceback from inside simpy, or "-8 GPUs")
    (["sim", "run", "--decode-engines", "0"], "pdlb sim run: error: argument --decode-engines: must be >= 1, got 0"),
    (["sim", "run", "--prefill-engines", "-2"], "pdlb sim run: error: argument --prefill-engines: must be >= 1, got -2"),
    (["sim", "compare", "--mixed-engines", "0"], "pdlb sim compare: error: argument --mixed-engines: must be >= 1, got 0"),
    # 4. numbers name the flag (were: "factor must be", "count must be", "duration_s must be")
    (["sim", "run", "--rate-scale", "0"], "pdlb sim run: error: argument --rate-scale: must be a finite number > 0, got '0'"),
    (["sim", "run", "--limit", "-5"], "pdlb sim run: error: argument --limit: must be >= 1, got -5"),
    (["sim", "run", "--limit", "0"], "pdlb sim run: error: argument --limit: must be >= 1, got 0"),
    (["sim", "run", "--limit", "ten"], "pdlb sim run: error: argument --limit: expected an integer >= 1, got 'ten'"),
    (["sim", "run", "--duration-s", "-3"], "pdlb sim run: error: argument --duration-s: must be a finite number > 0, got '-3'"),
    (["sim", "run", "--spread-s", "-1"], "pdlb sim run: error: argument --spread-s: must be a finite number >= 0, got '-1'"),
    (["sim", "run", "--slo-ttft-s", "0"], "pdlb sim run: error: argument --slo-ttft-s: must be a finite number > 0, got '0'"),
    (["sim", "run", "--slo-tpot-s", "nan"], "pdlb sim run: error: argument --slo-tpot-s: must be a finite number > 0, got 'nan'"),
    (["sim", "run", "--seed", "1.5"], "pdlb sim run: error: argument --seed: expected an integer >= 0, got '1.5'"),
    # 5. tier weights checked while parsing (were: after the workload loaded and a progress bar started)
    (["sim", "run", "--tier-weights", "host=2"], "pdlb sim run: error: argument --tier-weights: host weight must be in [0, 1], got 2"),
    (["sim", "run", "--tier-weights", "disk=0.5"], "pdlb sim run: error: argument --tier-weights: unknown tier 'disk'; valid: host, store"),
    (["sim", "run", "--tier-weights", "host"],
     "pdlb sim run: error: argument --tier-weights: expected name=number pairs like host=0.75,store=0.5, got 'host'"),
])
def test_bad_values_are_rejected_while_parsing(argv, message, capsys) -> None:
    assert _argparse_error(argv, capsys) == message


def _error_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The whole stderr of a run that fails after parsing (errors go to stderr, stdout stays
    empty); asserts exit 2 and exactly one line."""
    rc = main(argv)
    captured = capsys.readouterr()
    out = captured.err
    assert rc == 2 and captured.out == "", captured
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    return lines[0]


def test_engine_override_on_a_pool_the_scenario_lacks(capsys, tmp_path: Path) -> None:
    line = _error_line(["sim", "run", "--mixed-engines", "2", "--quiet", "--out", str(tmp_path)], capsys)
    assert line == "error: --mixed-engines: scenario 'dsv3-pd-h200' has no mixed pool; it is PD (prefill + decode pools)"


def test_trace_errors_name_the_options(tmp_path: Path, capsys) -> None:
    odd = tmp_path / "trace.txt"
    odd.write_text("{}\n")
    assert _error_line(["sim", "run", "--trace", str(odd), "--quiet"], capsys) == (
        f"error: --trace {odd}: cannot infer the trace format from the file extension "
        "(known: .jsonl, .jsonl.gz, .csv, .csv.gz); pass --format mooncake or --format azure")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    # neither --limit nor --duration-s was given: the message must not blame them
    assert _error_line(["sim", "run", "--trace", str(empty), "--quiet"], capsys) == (
        f"error: --trace {empty}: the trace has no requests")
    assert _error_line(["sim", "run", "--format", "azure", "--quiet"], capsys) == (
        "error: --format azure needs --trace (the embedded trace is in mooncake format)")


def test_a_rate_scale_that_pushes_arrivals_past_2_53_ms_is_refused(tmp_path: Path, capsys) -> None:
    # review R5: --rate-scale 1e-300 was taken and gave all-zero latencies with 100% attainment
    # (the loaders refuse timestamps past 2^53 ms; the scaled ones were not checked). The embedded
    # trace's 50th arrival is ~1.7e-299 s * 1e300 = 1.75e+301 s after scaling (the message's number)
    line = _error_line(["sim", "run", "--scenario", "llama8b-agg-h100", "--policy", "round_robin", "--limit", "50",
                        "--quiet", "--no-plots", "--out", str(tmp_path / "o"), "--rate-scale", "1e-300"], capsys)
    assert line.startswith("error: --rate-scale 1e-300 puts the last arrival at ") and "past 2^53 ms" in line, line
    assert main(["sim", "run", "--scenario", "llama8b-agg-h100", "--policy", "round_robin", "--limit", "50",
                 "--quiet", "--no-plots", "--out", str(tmp_path / "p"), "--rate-scale", "1e-9"]) == 0  # still fine


def test_scenario_file_errors_are_one_line(tmp_path: Path, capsys) -> None:
    typo = tmp_path / "typo.toml"
    typo.write_text('name = "t"\n[prefill]\nnum_engine = 2\n[decode]\nnum_engines = 1\n')
    assert _error_line(["sim", "run", "--scenario", str(typo), "--quiet"], capsys) == (
        f"error: {typo}: prefill.num_engine: unknown field (did you mean 'num_engines'?)")
    zero = tmp_path / "zero.yaml"
    zero.write_text("name: z\nprefill: {num_engines: 2}\ndecode: {num_engines: 0}\n")
    assert _error_line(["sim", "run", "--scenario", str(zero), "--quiet"], capsys) == (
        f"error: {zero}: decode.num_engines: Input should be greater than or equal to 1")
    both = tmp_path / "both.json"
    both.write_text(json.dumps({"prefill": {}, "decode": {}, "mixed": {}}))
    assert _error_line(["sim", "run", "--scenario", str(both), "--quiet"], capsys) == (
        f"error: {both}: give either prefill+decode pools (PD) or a mixed pool (aggregated), not both")


def test_with_pools_validates_and_describes_the_copy() -> None:
    base = PRESETS["dsv3-pd-h200"]
    for kw, msg in (({"prefill_engines": 0}, "prefill_engines must be an int >= 1, got 0"),
                    ({"decode_engines": -1}, "decode_engines must be an int >= 1, got -1"),
                    ({"mixed_engines": 2}, "scenario 'dsv3-pd-h200' has no mixed pool")):
        with pytest.raises(ValueError) as ei:
            base.with_pools(**kw)
        assert str(ei.value) == msg
    sc = base.with_pools(prefill_engines=8)
    assert sc.prefill.num_engines == 8 and base.prefill.num_engines == 6  # a copy; the preset is unchanged
    assert sc.num_gpus == 8 * 8 + 1 * 8
    assert sc.description == ("deepseek-v3 PD on h200: 8 prefill engines x 8 DP ranks, 1 decode engine x 8 DP "
                              "ranks (overridden: 8 prefill engines)")
    assert base.with_pools() is base


def test_header_shows_the_overridden_cluster(tmp_path: Path, capsys) -> None:
    rc = main(["sim", "run", "--prefill-engines", "2", "--decode-engines", "2", "--limit", "10", "--no-plots",
               "--out", str(tmp_path)])
    assert rc == 0
    first = capsys.readouterr().out.splitlines()[0]
    # 2 x 8 + 2 x 8 GPUs; the preset's "6 prefill engines" must not appear
    assert first == ("dsv3-pd-h200: deepseek-v3 PD on h200: 2 prefill engines x 8 DP ranks, 2 decode engines x 8 DP "
                     "ranks (overridden: 2 prefill engines, 2 decode engines) (32 GPUs)")
    saved = json.loads((tmp_path / "summary.json").read_text())["scenario"]
    assert (saved["prefill"]["num_engines"], saved["decode"]["num_engines"]) == (2, 2)


def test_header_of_a_scenario_file_without_description(tmp_path: Path, capsys) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('name = "mine"\nhardware = "h200"\n[prefill]\nnum_engines = 2\ndp_ranks = 8\n'
                    '[decode]\nnum_engines = 1\ndp_ranks = 8\n')
    assert main(["sim", "run", "--scenario", str(path), "--limit", "10", "--no-plots",
                 "--out", str(tmp_path / "o")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "mine: deepseek-v3 PD on h200: 2 prefill engines x 8 DP ranks, 1 decode engine x 8 DP ranks (24 GPUs)"


def test_price_checks_the_summary_file_before_printing(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "nonexist.json"
    assert _error_line(["sim", "price", "--from-summary", str(missing)], capsys) == f"error: {missing}: no such file"


def test_store_sweep_rejects_unknown_traffic_classes(tmp_path: Path, capsys) -> None:
    assert _error_line(["sim", "store-sweep", "--class-ttl-hours", "bot=5", "--out", str(tmp_path)], capsys) == (
        "error: --class-ttl-hours: unknown traffic class 'bot'; classes in the generated sessions: agent, chatbot")
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1], '
                     '"traffic_class": "chatbot"}\n')
    assert _error_line(["sim", "store-sweep", "--trace", str(trace), "--class-ttl-hours", "chatbot=5,agent=2",
                        "--out", str(tmp_path / "o"), "--quiet"], capsys) == (
        f"error: --class-ttl-hours: unknown traffic class 'agent'; classes in {trace}: chatbot")


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    assert ei.value.code == 0
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]  # independent source
    assert capsys.readouterr().out.strip() == f"pdlb {want}"


def test_policies_print_plain_text(capsys) -> None:
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "``" not in out
    assert "    cache_aware: SGLang's cache-aware policy (prefix affinity with an imbalance fallback)." in out


def test_validate_names_the_pass_column(capsys) -> None:
    assert main(["sim", "validate", "--figures", "sglang-prefill-1k"]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if "simulated" in line)  # column names
    assert "±15%" in header  # TOLERANCE = 0.15 (sim/validation/published.py)


class _ClosedPipe(io.TextIOBase):
    """A stdout whose reader went away, like ``| head -1`` after its line."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def isatty(self) -> bool:
        return False


def test_closed_stdout_still_writes_results(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    rc = main(["sim", "compare", "--policies", "round_robin,cache_aware", "--limit", "20", "--no-plots",
               "--out", str(tmp_path)])
    assert rc == EXIT_BROKEN_PIPE == 141  # 128 + SIGPIPE
    runs = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert [r["policy"] for r in runs] == ["round_robin", "cache_aware"]
    assert capsys.readouterr().err == ""  # quiet: no traceback, no "Exception ignored"


def test_closed_stdout_error_goes_to_stderr(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    rc = main(["sim", "run", "--scenario", str(tmp_path / "none.toml"), "--quiet"])
    assert rc == 2  # the error status wins over 141
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: unknown scenario '{tmp_path / 'none.toml'}': not a preset (")


# ---- new-user trial, round 2: each bad input is one line naming the flag, before any output
@pytest.mark.parametrize("argv, message", [
    # were ZeroDivisionError tracebacks in sim/pricing/analysis.py
    (["sim", "price", "--tok-s-per-seq", "0"],
     "pdlb sim price: error: argument --tok-s-per-seq: must be a finite number > 0, got '0'"),
    (["sim", "price", "--target", "0"], "pdlb sim price: error: argument --target: must be a finite number > 0, got '0'"),
    # was: 0 silently replaced by the scenario's batch; -5 rejected only after the tables
    (["sim", "price", "--decode-batch", "0"], "pdlb sim price: error: argument --decode-batch: must be >= 1, got 0"),
    (["sim", "price", "--decode-batch", "-5"], "pdlb sim price: error: argument --decode-batch: must be >= 1, got -5"),
    (["sim", "price", "--output-tokens", "0"], "pdlb sim price: error: argument --output-tokens: must be >= 1, got 0"),
    (["sim", "price", "--published-batch", "0"], "pdlb sim price: error: argument --published-batch: must be >= 1, got 0"),
])
def test_price_numbers_are_rejected_while_parsing(argv, message, capsys) -> None:
    assert _argparse_error(argv, capsys) == message


@pytest.mark.parametrize("argv, message", [
    (["sim", "price", "--ratio", "1,0"], "error: --ratio: values must be finite and > 0, got 0"),
    (["sim", "price", "--scenario", "nosuch"],
     f"error: unknown scenario 'nosuch': not a preset ({', '.join(sorted(PRESETS))}) nor a file"),
    (["sim", "price", "--scenario", "llama8b-agg-h100"],
     "error: --scenario llama8b-agg-h100: the scenario is aggregated; pdlb sim price needs prefill and decode pools "
     "(or --simulate)"),
    (["sim", "compare", "--policies", ""], "error: --policies: give at least one policy"),
    (["sim", "compare", "--policies", " , "], "error: --policies: give at least one policy"),
    # compare's --decode-policy lists the valid names (a policy spec since policy parameters work on every flag)
    (["sim", "compare", "--decode-policy", "nope"],
     "error: --decode-policy: unknown policy 'nope'; valid policies: cache_aware, consistent_hash, dp_consistent_hash, ep_aware, "
     "kv_cost, least_load, power_of_two, random, round_robin, scored"),
    # were multi-line pydantic dumps; bounds from SessionWorkloadConfig (gt=0, le=1, ge=1)
    (["sim", "sessions", "--out", "s.jsonl", "--sessions-per-hour", "0"],
     "error: --sessions-per-hour: Input should be greater than 0"),
    (["sim", "sessions", "--out", "s.jsonl", "--agent-fraction", "2"],
     "error: --agent-fraction: Input should be less than or equal to 1"),
    (["sim", "sessions", "--out", "s.jsonl", "--block-size", "0"],
     "error: --block-size: Input should be greater than or equal to 1"),
])
def test_errors_before_any_output(argv, message, capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # sessions' relative --out, never written
    assert _error_line(argv, capsys) == message  # the whole stdout: no table printed first
    assert list(tmp_path.iterdir()) == []


def test_sessions_out_must_be_a_writable_file(tmp_path: Path, capsys) -> None:
    # was: IsADirectoryError traceback after generating the workload
    assert _error_line(["sim", "sessions", "--days", "0.01", "--out", str(tmp_path)], capsys) == (
        f"error: --out {tmp_path}: is a directory; give a file name, e.g. {tmp_path / 'sessions.jsonl'}")
    missing = tmp_path / "no" / "s.jsonl"
    assert _error_line(["sim", "sessions", "--days", "0.01", "--out", str(missing)], capsys) == (
        f"error: --out {missing}: folder {missing.parent} does not exist")


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys, tmp_path: Path) -> None:
    import sim.run.cluster

    def interrupted(*args, **kwargs):  # what simpy raises when Ctrl-C lands mid-run
        raise KeyboardInterrupt

    monkeypatch.setattr(sim.run.cluster, "simulate", interrupted)
    for cmd in (["run"], ["compare", "--policies", "round_robin"]):
        rc = main(["sim", *cmd, "--limit", "5", "--quiet", "--out", str(tmp_path)])
        assert rc == 130  # 128 + SIGINT (2)
        assert capsys.readouterr().err == "interrupted\n"


def test_default_results_folders_are_unique_and_counted(monkeypatch, capsys, tmp_path: Path) -> None:
    import time as time_mod

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time_mod, "strftime", lambda fmt, *a: "20260101-000000")  # two runs in the same second
    argv = ["sim", "compare", "--policies", "round_robin,random", "--limit", "5", "--no-plots", "--quiet"]
    lines = []
    for _ in range(3):
        assert main(argv) == 0
        lines.append(capsys.readouterr().out.strip().splitlines()[-1])
    base = "results/dsv3-pd-h200-20260101-000000"
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == [
        "dsv3-pd-h200-20260101-000000", "dsv3-pd-h200-20260101-000000-2", "dsv3-pd-h200-20260101-000000-3"]
    # files: summary.json, requests_round_robin.csv, requests_random.csv, summary.md -> "3 more"
    assert lines == [f"results: {d}/ (summary.json, 3 more)" for d in (base, base + "-2", base + "-3")]
    for d in (base, base + "-2", base + "-3"):
        assert len(list((tmp_path / d).iterdir())) == 4


def test_explicit_out_is_reused(tmp_path: Path, capsys) -> None:
    argv = ["sim", "run", "--policy", "round_robin", "--limit", "5", "--no-plots", "--quiet", "--out", str(tmp_path)]
    assert main(argv) == 0 and main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requests_round_robin.csv", "summary.json", "summary.md"]
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"results: {tmp_path}/ (summary.json, 2 more)"
