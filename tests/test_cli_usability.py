"""Fresh-user defects of the command line, one test (or matrix) per class: run titles, sweep-file
tables, flag checks, flags without effect, missing trace files, policy lists, argparse errors,
result file names, recorded commands, ``--set`` values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from balancer.policies import make_policy
from sim.cli import main
from sim.cli_args import route_slo_note

EP = make_policy("ep_aware")
OWN = make_policy("ep_aware", ttft_slo_s=2.0)
RR = make_policy("round_robin")
BLIND_EP = make_policy("ep_aware", slo_aware=False)


# ---------------------------------------------------------------------- 1. one title note for SLO routing
@pytest.mark.parametrize("route_slo, default, runs, note", [
    # sim run / compare: SLO-blind by default, --route-slo opts in
    (False, False, [("rr", RR, RR)], ""),
    (False, False, [("rr", RR, RR), ("own", OWN, OWN)], ", routed against their own TTFT budget: own"),
    (True, False, [("rr", RR, RR), ("ep", EP, EP)], ", routed against the TTFT SLO by ep"),
    (True, False, [("rr", RR, RR), ("x", BLIND_EP, BLIND_EP)], ", --route-slo: no policy here routes against the SLO"),
    # capacity / sweep: SLO-aware by default, --no-route-slo opts out; a policy's own budget still holds
    (True, True, [("rr", RR, RR), ("own", OWN, OWN)], ", routed against the TTFT SLO by own"),
    (True, True, [("rr", RR, RR)], ", no policy here routes against the TTFT SLO"),
    (False, True, [("rr", RR, RR), ("ep", EP, EP)], ", routed SLO-blind (--no-route-slo)"),
    (False, True, [("rr", RR, RR), ("own", OWN, OWN)],
     ", routed SLO-blind (--no-route-slo) except against their own TTFT budget: own"),
    # the decode policy's own budget counts too; names are made into policies
    (False, True, [("rr+own", "round_robin", OWN)],
     ", routed SLO-blind (--no-route-slo) except against their own TTFT budget: rr+own"),
])
def test_route_slo_note_matrix(route_slo, default, runs, note) -> None:
    assert route_slo_note(route_slo, runs, default=default, flag="--no-route-slo" if default else "--route-slo") == note


@pytest.mark.parametrize("flags, expected", [
    ([], "routed against the TTFT SLO by ep_aware(ttft_slo_s=2.0)"),
    (["--no-route-slo"], "routed SLO-blind (--no-route-slo) except against their own TTFT budget: "
                         "ep_aware(ttft_slo_s=2.0)"),
])
def test_capacity_title_names_a_policy_with_its_own_budget(flags, expected, tmp_path: Path, capsys) -> None:
    # an SLO unreachable even at zero load (0.1 s TTFT): no simulation runs, the title is still written
    rc = main(["sim", "capacity", "--policy", "ep_aware:ttft_slo_s=2", "--policy", "round_robin", "--limit", "100",
               "--slo-ttft-s", "0.1", "--jobs", "1", "--no-plots", "--out", str(tmp_path), "--quiet", *flags])
    assert rc == 0
    title = (tmp_path / "capacity.md").read_text().splitlines()[0]
    assert title.endswith(expected), title
    assert "round_robin" not in title  # SLO-blind, not named
    capsys.readouterr()


def test_sweep_title_says_how_it_routed(tmp_path: Path, capsys) -> None:
    f = tmp_path / "s.toml"
    f.write_text('policies = ["round_robin", "ep_aware:ttft_slo_s=2"]\nlimit = 10\nroute_slo = false\n')
    rc = main(["sim", "sweep", str(f), "--out", str(tmp_path / "out"), "--jobs", "1", "--no-plots", "--quiet"])
    assert rc == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("routed SLO-blind (route_slo = false) except against their own TTFT budget: ep_aware(ttft_slo_s=2.0)"
            in out), out
    assert "route_slo = false" in (tmp_path / "out" / "report.html").read_text()


# ---------------------------------------------------------------------- 5. a missing trace file, in every command
def _subcommands_with(option: str) -> list[tuple[str, ...]]:
    import argparse

    from sim.cli import build_parser

    def walk(p: argparse.ArgumentParser, path: tuple[str, ...] = ()):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    yield from walk(sp, path + (name,))
        if any(option in a.option_strings for a in p._actions):
            yield path

    return list(walk(build_parser()))


#: what a command needs besides --trace for the trace to be read
NEEDS = {("sim", "price"): ["--simulate"], ("sim", "capacity"): ["--jobs", "1"]}


def test_every_command_taking_a_trace_is_covered() -> None:
    # a new command with --trace joins the matrix below by itself; this pins the list a reader sees
    assert sorted(_subcommands_with("--trace")) == sorted(
        [("sim", "compare"), ("sim", "run"), ("sim", "price"), ("sim", "store-sweep"), ("sim", "capacity")])


@pytest.mark.parametrize("cmd", _subcommands_with("--trace"), ids=" ".join)
@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_a_trace_that_is_not_a_file_is_one_clear_line(cmd, kind, tmp_path: Path, capsys, monkeypatch) -> None:
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # where a default results folder would go
    path = tmp_path / "nope.jsonl.gz" if kind == "missing" else tmp_path
    rc = main([*cmd, "--trace", str(path), *NEEDS.get(cmd, []), "--quiet"])
    assert rc == 2
    err = capsys.readouterr().err
    what = "trace file not found" if kind == "missing" else "trace file is a directory"
    assert err == f"error: {what}: {path}\n"
    assert list((tmp_path / "cwd").iterdir()) == []  # stopped before writing anything


def test_a_sweep_with_a_missing_trace_stops_before_running(tmp_path: Path, capsys) -> None:
    f = tmp_path / "s.toml"
    f.write_text('policies = ["round_robin"]\ntraces = ["nope.jsonl"]\n')
    rc = main(["sim", "sweep", str(f), "--out", str(tmp_path / "out"), "--jobs", "1", "--quiet"])
    assert rc == 2
    assert capsys.readouterr().err == (f"error: {f}: traces: trace file not found: nope.jsonl "
                                       f"(nor in {tmp_path.resolve()}/, the sweep file's folder)\n")
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written
