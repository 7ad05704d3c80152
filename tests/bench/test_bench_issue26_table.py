"""bench/issue26_table.py: the time budget that decides how many interleaved repeats run, the
issue's table and absolute lines, the route child's time limit, and (slow) one whole run without
peers. Expected values worked out by hand from the inputs written here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
it = pytest.importorskip("issue26_table")


def run(p50_ms: float, p99_ms: float, rps: float, cpu_us: float) -> dict[str, float]:
    return {"p50": p50_ms / 1e3, "p99": p99_ms / 1e3, "rps": rps, "cpu_us": cpu_us, "n": 100}


def test_block_estimate_uses_the_longest_block_so_far_else_two_runs_and_overhead_per_row() -> None:
    # 6 rows (direct, pdlb, pdlb x8, 3 peers) x (2 x 3 s + 3 s) = 54 s before any block was timed
    assert it.block_estimate_s(6, 3.0, []) == pytest.approx(54.0)
    assert it.block_estimate_s(4, 2.5, []) == pytest.approx(4 * 8.0)
    assert it.block_estimate_s(6, 3.0, [50.0, 61.5, 55.0]) == 61.5


def test_a_repeat_starts_only_if_every_modes_block_ends_by_the_deadline() -> None:
    assert it.repeat_fits(100.0, 200.0, [40.0, 50.0])  # ends at 190
    assert it.repeat_fits(100.0, 200.0, [40.0, 60.0])  # ends at 200, exactly the deadline
    assert not it.repeat_fits(100.0, 200.0, [40.0, 60.5])
    assert not it.repeat_fits(201.0, 200.0, [])  # already past it


def test_a_variant_is_parsed_as_a_shell_would_and_named_by_its_process_count() -> None:
    import argparse

    import router_overhead as ro
    ap = argparse.ArgumentParser()
    # by hand: NAME before the first "=", ARGS split as bash would split them
    assert ro.parse_variants(ap, ["fill 0.9=--placement-target 0.9 --processes 8", "rr=--connection-placement round_robin"]) \
        == [("fill 0.9", ["--placement-target", "0.9", "--processes", "8"]), ("rr", ["--connection-placement", "round_robin"])]
    args = argparse.Namespace(default_processes=6)
    assert ro._variant_name("fill", ["--placement-target", "0.9", "--processes", "8"], args) == "pdlb x8, fill"
    assert ro._variant_name("rr", ["--connection-placement", "round_robin"], args) == "pdlb x6, rr"


def test_the_most_processes_row_is_a_plain_pdlb_row_with_results() -> None:
    r = [run(1, 2, 100, 100)]
    res = {"direct": r, "pdlb": r, "pdlb x2": r, "pdlb x8": r, "pdlb x8, uvloop": r, "pdlb x2 (default)": r,
           "smg": r, "peers": ["smg"]}
    assert it.most_processes_row(res) == "pdlb x8"
    res["pdlb x8"] = []  # not measured (e.g. a start that failed): the next one down
    assert it.most_processes_row(res) == "pdlb x2"
    assert it.most_processes_row({"direct": r, "pdlb": r, "peers": []}) == "pdlb"
    assert it.most_processes_row({"direct": r, "smg": r, "peers": ["smg"]}) is None


def _results() -> dict:
    regular = {"direct": [run(0.5, 1.0, 1000, 50), run(0.5, 1.0, 1000, 50)],
               "pdlb": [run(2.0, 4.0, 30, 300), run(2.0, 5.0, 34, 340)],
               "pdlb x8": [run(1.0, 3.0, 100, 600), run(1.0, 2.0, 90, 500)],
               "smg": [run(0.8, 2.0, 80, 300), run(0.8, 1.5, 110, 250)],
               "vllm-router": [run(0.6, 1.06, 120, 200), run(0.6, 1.02, 100, 250)],
               "peers": ["smg", "vllm-router"]}
    pd = {"direct": [run(1.0, 2.0, 500, 80)], "pdlb": [run(3.0, 6.0, 20, 400)],
          "pdlb x8": [run(1.5, 3.0, 60, 800)], "sglang-router": [run(1.2, 2.5, 50, 400)],
          "peers": ["sglang-router"]}
    return {"regular": regular, "pd": pd}


def test_issue_table_gives_pdlb_at_the_most_processes_over_each_peer() -> None:
    lines = it.issue_table(_results())
    assert lines[:2] == ["| mode | pdlb row | pdlb / peer: req/s | CPU per request | added p99 |", "|---|---|---|---|---|"]
    # regular, per repeat then the median (of two: their mean):
    #   / smg: req/s 100/80 = 1.25, 90/110 = 0.818 -> 1.034; CPU 600/300 = 2.00, 500/250 = 2.00 -> 2.00;
    #          added p99 (3-1)/(2-1) = 2.00, (2-1)/(1.5-1) = 2.00 -> 2.00
    #   / vllm-router: req/s 100/120 = 0.833, 90/100 = 0.90 -> 0.867; CPU 600/200 = 3.00, 500/250 = 2.00 -> 2.50;
    #          its added p99 is 0.06 and 0.02 ms (under 0.1: no ratio): pdlb x8's median added p99 (2 + 1) / 2 = 1.50,
    #          its own (0.06 + 0.02) / 2 = 0.04 ms
    assert lines[2] == ("| regular | pdlb x8 | smg 1.03x, vllm-router 0.87x | smg 2.00x, vllm-router 2.50x | "
                        "smg 2.00x, vllm-router n/a (+1.50 vs +0.04 ms) |")
    # SGLang PD: 60/50 = 1.20x, 800/400 = 2.00x, added p99 (3-2)/(2.5-2) = 2.00x
    assert lines[3] == "| PD, SGLang bootstrap | pdlb x8 | sglang-router 1.20x | sglang-router 2.00x | sglang-router 2.00x |"
    assert len(lines) == 4


def test_issue_table_without_peers_says_so_instead_of_an_empty_table() -> None:
    """--peers none (review R9): the modes ran pdlb only; the table would be its header alone."""
    results = {mode: {k: v for k, v in res.items() if k in ("direct", "pdlb", "pdlb x8")} | {"peers": []}
               for mode, res in _results().items()}
    assert it.issue_table(results) == ["(no peer ran in any mode (--peers none, or every peer failed to start): "
                                       "nothing to compare; the absolute figures follow)"]


def test_absolute_lines_give_medians_and_the_most_processes_over_one() -> None:
    lines = it.absolute_lines(_results())
    # regular medians: CPU pdlb (300+340)/2 = 320, x8 550, smg 275, vllm-router 225; req/s 32, 95, 95, 110;
    # 550 / 320 = 1.71875 -> 1.72x
    assert lines[0] == ("regular: CPU us per request pdlb 320, pdlb x8 550, smg 275, vllm-router 225; "
                        "req/s pdlb 32, pdlb x8 95, smg 95, vllm-router 110; pdlb x8 / pdlb CPU per request 1.72x "
                        "(2 repeats)")
    assert lines[1].endswith("pdlb x8 / pdlb CPU per request 2.00x (1 repeats)")


def _fake_modes(monkeypatch: pytest.MonkeyPatch, fail_start: str, fail_repeat: tuple[str, int]) -> tuple[list, list]:
    """router_overhead's mode phases replaced by fakes that record the order of calls (no processes)."""
    import types

    order: list[tuple[str, int]] = []
    stopped: list[str] = []

    async def start_mode(mode: str, args: object, peer_cmds: dict) -> object:
        if mode == fail_start:
            raise RuntimeError("pdlb serve did not start")
        return types.SimpleNamespace(mode=mode, out={"direct": [], "pdlb": [], "peers": []}, pdlbs={"pdlb": None},
                                     header=lambda args: f"== {mode}")

    async def measure_repeat(run: object, args: object, k: int) -> None:
        order.append((run.mode, k))
        run.out["direct"].append(run_(1))
        if (run.mode, k) == fail_repeat:
            raise RuntimeError("client output was not JSON")
        run.out["pdlb"].append(run_(2))

    def run_(x: float) -> dict[str, float]:
        return run(x, 2 * x, 100, 10)

    monkeypatch.setattr(it.ro, "start_mode", start_mode)
    monkeypatch.setattr(it.ro, "measure_repeat", measure_repeat)
    monkeypatch.setattr(it.ro, "stop_mode", lambda r: stopped.append(r.mode))
    return order, stopped


def test_repeats_interleave_across_modes_and_a_failing_mode_leaves_the_others_running(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse
    import asyncio
    import time

    order, stopped = _fake_modes(monkeypatch, fail_start="vllm-pd", fail_repeat=("pd", 2))
    args = argparse.Namespace(modes=["regular", "pd", "vllm-pd"], repeat=3, duration_s=1.0)
    meta: dict = {}
    res = asyncio.run(it.measure_all(args, {}, time.monotonic() + 600, tmp_path / "o.json", meta))
    # vLLM PD never started; SGLang PD failed in repeat 2 and was left out of repeat 3; regular ran all three,
    # repeat by repeat across the modes
    assert order == [("regular", 1), ("pd", 1), ("regular", 2), ("pd", 2), ("regular", 3)]
    assert sorted(stopped) == ["pd", "regular"] and set(res) == {"regular", "pd"}
    out = capsys.readouterr().out
    assert "vllm-pd: not started (pdlb serve did not start)" in out and "pd: repeat 2 failed" in out
    # what the failed repeat measured before it broke stays (direct), the rows after it were never measured
    assert len(res["pd"]["direct"]) == 2 and len(res["pd"]["pdlb"]) == 1
    raw = json.loads((tmp_path / "o.json").read_text())
    assert [len(raw["meta"]["block_s"][m]) for m in ("regular", "pd")] == [3, 2]
    assert raw["results"]["regular"]["pdlb"][2]["p99"] == pytest.approx(0.004)


def test_past_the_deadline_only_the_first_repeat_runs(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import argparse
    import asyncio
    import time

    order, _ = _fake_modes(monkeypatch, fail_start="", fail_repeat=("", 0))
    args = argparse.Namespace(modes=["regular", "pd"], repeat=3, duration_s=1.0)
    asyncio.run(it.measure_all(args, {}, time.monotonic() - 1.0, None, {}))
    assert order == [("regular", 1), ("pd", 1)]
    assert "repeat 2 not started" in capsys.readouterr().out


def test_route_child_is_stopped_at_its_limit_and_keeps_what_it_printed(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "slow.py"
    script.write_text("import sys, time\nprint('row 1', sys.argv[1:])\nprint('row 2')\ntime.sleep(60)\nprint('never')\n")
    out = tmp_path / "route.txt"
    assert it.run_route(["--a", "b c"], 3.0, out, script=script) == 124
    text = out.read_text()
    assert text.startswith("row 1 ['--a', 'b c']\nrow 2\n") and "never" not in text
    assert "stopped at its limit of 3 s" in text
    assert "row 2" in capsys.readouterr().out
    script.write_text("print('done')\nraise SystemExit(3)\n")
    assert it.run_route([], 30.0, out, script=script) == 3 and out.read_text() == "done\n"


def test_bad_arguments_are_refused_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, words in ((["--modes", "regular,bogus"], "--modes"), (["--pdlb-processes", "1,x"], "--pdlb-processes"),
                        (["--pdlb-processes", "0"], "--pdlb-processes"), (["--repeat", "0"], "--repeat"),
                        (["--peers", "nginx"], "--peers: unknown 'nginx'"), (["--duration-s", "nan"], "--duration-s"),
                        (["--duration-s", "inf"], "--duration-s"), (["--budget-s", "nan"], "--budget-s"),
                        # route_latency's own checks, before anything starts (its --repeat and lists)
                        (["--route-args", "--repeat 0"], "--route-args: argument --repeat: must be >= 1, got 0"),
                        (["--route-args", "--repeat 2 --against ."], "--route-args: --repeat is for"),
                        (["--route-args", "--replicas 64,,512"], "--route-args: --replicas"),
                        (["--route-args", "--bogus 1"], "--route-args: unrecognized arguments: --bogus 1"),
                        # --variant as router_overhead.py reads it (a row "pdlb xN, NAME")
                        (["--variant", "no-equals-sign"], "--variant must be NAME=ARGS"),
                        (["--variant", "=--processes 4"], "--variant must be NAME=ARGS"),
                        (["--variant", "a=--processes 4", "--variant", "a=--processes 2"], "given twice"),
                        (["--variant", "q=--connection-placement 'round"], "No closing quotation")):
        with pytest.raises(SystemExit) as e:
            it.main(argv)
        assert e.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.slow
def test_one_run_without_peers_stops_after_the_repeat_the_budget_allows(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # ~30-60 s on the 2-core host: two modes' engines and one pdlb process each, one repeat of 0.3 s runs,
    # then a tiny route table. Budget 61 s with 60 kept for the route table: the measurement deadline
    # is 1 s after the start, so repeat 1 runs (it always does) and repeat 2 must not start.
    code = it.main(["--out", str(tmp_path), "--modes", "regular,vllm-pd", "--peers", "none", "--pdlb-processes", "1",
                    "--duration-s", "0.3", "--repeat", "3", "--budget-s", "61", "--route-s", "60",
                    "--engines", "1", "--pd-engines", "1", "--load-processes", "1", "--concurrency", "2",
                    "--max-concurrency", "4",
                    "--route-args", "--policies round_robin --replicas 8 --prompts 1024 --requests 50"])
    out = capsys.readouterr().out
    assert code == 0
    assert "repeat 2 not started" in out and "(3 asked, 1 measured)" in out
    raw = json.loads((tmp_path / "overhead.json").read_text())
    assert set(raw["results"]) == {"regular", "vllm-pd"}
    for mode in ("regular", "vllm-pd"):
        res = raw["results"][mode]
        assert res["peers"] == [] and len(res["direct"]) == 1 and len(res["pdlb"]) == 1
        one = res["pdlb"][0]
        assert one["rps"] > 0 and one["n"] > 0 and 0 < one["p50"] <= one["p99"] and one["cpu_us"] > 0
        assert len(raw["meta"]["block_s"][mode]) == 1
    # no peers: the issue table has its header only; the absolute lines name pdlb's row per mode
    assert "regular: CPU us per request pdlb " in out and "PD, vLLM protocol: CPU us per request pdlb " in out
    route = (tmp_path / "route.txt").read_text()
    assert "round_robin" in route and "p99 us" in route


DEVICE = Path(__file__).resolve().parents[2] / "bench" / "device"


def _pins(script: str, var: str) -> dict[str, str]:
    text = (DEVICE / script).read_text()
    start = text.index(f'{var}="') + len(var) + 2
    return dict(p.split("==") for p in text[start:text.index('"', start)].split())


def test_the_device_carry_pins_the_peers_the_bench_pins_and_one_version_of_each_wheel() -> None:
    # prep_issue26.sh downloads the peers it packs for b6.sh: the same versions as router_overhead's PEERS
    ro = it.ro
    assert _pins("prep_issue26.sh", "PEER_PINS") == {p.package: p.version for p in ro.PEERS.values()}
    text = (DEVICE / "prep_issue26.sh").read_text()
    names = [p.split("==")[0] for p in text[text.index('WHEEL_PINS="') + 12:].split('"')[0].split()]
    assert len(names) == len(set(names)) == 14  # pip install of the folder stops at two versions of one package
    # what the peers' launchers import at start (fastapi, uvicorn, orjson, setproctitle; fastapi needs
    # opentelemetry-api) and pdlb's router and engines need (pydantic, httptools, simpy) beyond the device image
    assert {"fastapi", "uvicorn", "orjson", "setproctitle", "opentelemetry-api", "pydantic", "httptools",
            "simpy"} <= set(names)


def test_b6_passes_only_options_issue26_table_has() -> None:
    import re
    import subprocess

    text = (DEVICE / "b6.sh").read_text()
    assert subprocess.run(["bash", "-n", str(DEVICE / "b6.sh")]).returncode == 0
    assert subprocess.run(["bash", "-n", str(DEVICE / "prep_issue26.sh")]).returncode == 0
    call = text[text.index("$PY bench/issue26_table.py"):text.index("tee $OUT/b6.log")]
    given = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", call))
    known = {o for a in it.build_parser()._actions for o in a.option_strings}
    assert {"--out", "--budget-s", "--route-s", "--pdlb-processes", "--smg", "--sglang-router", "--vllm-router",
            "--route-args", "--router-cpus", "--variant"} <= given
    assert given <= known, sorted(given - known)
