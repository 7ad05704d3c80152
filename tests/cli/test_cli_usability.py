"""Fresh-user defects of the command line, one test (or matrix) per class: run titles, sweep-file
tables, flag checks, flags without effect, missing trace files, policy lists, argparse errors,
result file names, recorded commands, ``--set`` values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from balancer.policies import make_policy
from pdlb_cli.main import main
from pdlb_cli.args import route_slo_note

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
    # a policy's own budget takes precedence over the router's: named apart
    (True, True, [("rr", RR, RR), ("own", OWN, OWN)], ", routed against their own TTFT budget: own"),
    (True, True, [("ep", EP, EP), ("own", OWN, OWN)],
     ", routed against the TTFT SLO by ep; against their own TTFT budget: own"),
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
    ([], "routed against their own TTFT budget: ep_aware(ttft_slo_s=2.0)"),
    (["--no-route-slo"], "routed SLO-blind (--no-route-slo) except against their own TTFT budget: "
                         "ep_aware(ttft_slo_s=2.0)"),
])
def test_capacity_title_names_a_policy_with_its_own_budget(flags, expected, tmp_path: Path, capsys) -> None:
    # an SLO unreachable even at zero load (0.1 s TTFT): no simulation runs, the title is still written.
    # A dense scenario: on the default (all wide EP) ep_aware ignores its own budget without
    # slo_wide_ep, and the title says so (review R3, tests/cli/test_idle_slo_warning.py)
    rc = main(["sim", "capacity", "--policy", "ep_aware:ttft_slo_s=2", "--policy", "round_robin",
               "--scenario", "llama70b-pd-h100", "--limit", "100",
               "--slo-ttft-s", "0.1", "--jobs", "1", "--no-plots", "--out", str(tmp_path), "--quiet", *flags])
    assert rc == 0
    title = (tmp_path / "capacity.md").read_text().splitlines()[0]
    assert title.endswith(expected), title
    assert "round_robin" not in title  # SLO-blind, not named
    capsys.readouterr()


def test_sweep_title_says_how_it_routed(tmp_path: Path, capsys) -> None:
    f = tmp_path / "s.toml"
    f.write_text('scenario = "llama70b-pd-h100"\npolicies = ["round_robin", "ep_aware:ttft_slo_s=2"]\nlimit = 10\n'
                 'route_slo = false\n')  # dense: on an all-wide-EP scenario ep_aware ignores its own budget (R3)
    rc = main(["sim", "sweep", str(f), "--out", str(tmp_path / "out"), "--jobs", "1", "--no-plots", "--quiet"])
    assert rc == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("routed SLO-blind (route_slo = false) except against their own TTFT budget: ep_aware(ttft_slo_s=2.0)"
            in out), out
    assert "route_slo = false" in (tmp_path / "out" / "report.html").read_text()


# ---------------------------------------------------------------------- 5. a missing trace file, in every command
def _subcommands_with(option: str) -> list[tuple[str, ...]]:
    import argparse

    from pdlb_cli.main import build_parser

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


# ---------------------------------------------------------------------- 2. unknown keys in every table of a file
def _sweep_tables() -> list[tuple[str, str, str, list[str]]]:
    """(table title, TOML text with an unknown key there, the key, the valid keys)."""
    import dataclasses

    from balancer.router import DEFAULT_TIER_WEIGHTS
    from sim.search.point import SLO
    from sim.scenario import PoolConfig
    from sim.search.sweep import _KEYS

    pool = sorted(PoolConfig.model_fields)
    return [
        ("", "bogus_key = 1\n", "bogus_key", sorted(_KEYS)),
        ("[slo]", "[slo]\nbogus_key = 1\n", "bogus_key", sorted(f.name for f in dataclasses.fields(SLO))),
        ("[tier_weights]", "tier_weights = {bogus_key = 0.5}\n", "bogus_key", sorted(DEFAULT_TIER_WEIGHTS)),
        ("[grid]", '[grid]\n"prefill.bogus_key" = [1]\n', "prefill.bogus_key", pool),
        ("[[points]]", '[[points]]\n"prefill.bogus_key" = 1\n', "prefill.bogus_key", pool),
    ]


@pytest.mark.parametrize("table, text, key, valid", _sweep_tables(), ids=lambda x: x if isinstance(x, str) else "")
def test_an_unknown_sweep_key_names_file_table_key_and_the_valid_ones(table, text, key, valid, tmp_path: Path,
                                                                       capsys) -> None:
    f = tmp_path / "sw.toml"
    f.write_text('policies = ["round_robin"]\n' + text)
    rc = main(["sim", "sweep", str(f), "--out", str(tmp_path / "out"), "--jobs", "1", "--quiet"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {f}: {table + ': ' if table else ''}unknown key {key!r}")
    assert err.rstrip().endswith(f"valid: {', '.join(valid)}"), err
    assert "TypeError" not in err and "__init__" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, message", [
    ("[slo]\nttft = 1\n", "[slo]: unknown key 'ttft' (did you mean 'ttft_s'?); valid: attainment, percentile, "
                         "tpot_s, ttft_per_1k_prompt_tokens_s, ttft_s"),  # the reported case (a raw TypeError)
    ('[slo]\nattainment = "x"\n', "[slo] attainment must be a number > 0, got 'x'"),  # was a raw TypeError
    ("[slo]\nattainment = 2\n", "[slo]: SLO attainment must be in (0, 1], got 2"),
    ("tier_weights = {host = 2}\n", "[tier_weights] host must be in [0, 1], got 2"),
    ('index_mode = "exact"\n', "index_mode must be one of approximate, events, hybrid, got 'exact'"),
    ('spread_s = "3"\n', "spread_s must be a number >= 0, got '3'"),  # was "could not convert string to float"
    ("limit = 0\n", "limit must be an integer > 0, got 0"),
    ('format = "csv"\n', "format must be one of auto, mooncake, azure, got 'csv'"),
])
def test_bad_sweep_values_name_the_file(text, message, tmp_path: Path) -> None:
    from sim.search.sweep import load_sweep

    f = tmp_path / "sw.toml"
    f.write_text('policies = ["round_robin"]\n' + text)
    with pytest.raises(ValueError) as e:
        load_sweep(f)
    assert str(e.value) == f"{f}: {message}"


def _model_of(ann: object) -> tuple[type | None, bool]:
    """The pydantic model in a field's annotation, and whether it is a list of them."""
    import typing

    from pydantic import BaseModel

    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann, False
    for a in typing.get_args(ann):
        m, listed = _model_of(a)
        if m is not None:
            return m, listed or typing.get_origin(ann) is list
    return None, False


def _scenario_tables() -> list[tuple]:
    """Every table of a scenario file as a path of field names (an item of a list of tables as
    index 0), found from the Scenario model itself, so that a new table joins the test below.
    The ``[router]`` table's policy tables are not scenario tables: the scenario refuses them
    (``ROUTER_SECTION_ELSEWHERE``, tested in test_scenario_router.py)."""
    from sim.scenario import ROUTER_SECTION_ELSEWHERE, Scenario

    out: list[tuple] = [()]

    def walk(cls: type, path: tuple) -> None:
        for name, f in cls.model_fields.items():
            m, listed = _model_of(f.annotation)
            if path == ("router",) and name in ROUTER_SECTION_ELSEWHERE:
                continue
            if m is not None:
                sub = (*path, name, 0) if listed else (*path, name)
                out.append(sub)
                walk(m, sub)

    walk(Scenario, ())
    return out


def test_the_scenario_table_walk_finds_the_nested_ones() -> None:
    tables = _scenario_tables()
    assert {("prefill",), ("prefill", "host_tier"), ("shared_store",), ("perf",),
            ("speculative", "acceptance_classes", 0)} <= set(tables) and len(tables) >= 12


@pytest.mark.parametrize("path", _scenario_tables(), ids=lambda p: ".".join(map(str, p)) or "top")
@pytest.mark.parametrize("typo", [False, True], ids=["far", "typo"])
def test_an_unknown_scenario_key_names_file_table_key_and_the_valid_ones(path, typo, tmp_path: Path) -> None:
    from sim.scenario import PRESETS, ROUTER_SECTION_ELSEWHERE, Scenario, load_scenario

    data = json.loads(PRESETS["dsv3-pd-h200"].model_dump_json(exclude_unset=True))
    node, cls = data, Scenario
    for i, part in enumerate(path):  # down to the table, adding the ones the preset lacks
        if isinstance(part, int):
            node.append({}) if not node else None
            node = node[0]
            continue
        cls, listed = _model_of(cls.model_fields[part].annotation)
        node = node.setdefault(part, [] if listed else {})
    valid = sorted(cls.model_fields)
    # the router table: a typo of a key it refuses (block_size) points where that key belongs
    # (test_scenario_router.py), so the typo is made of the first key it takes
    first = next(k for k in valid if path != ("router",) or k not in ROUTER_SECTION_ELSEWHERE)
    key = first + "x" if typo else "bogus_key"
    node[key] = 1
    f = tmp_path / "sc.json"
    f.write_text(json.dumps(data))
    with pytest.raises(ValueError) as e:
        load_scenario(f)
    msg = str(e.value)
    # other problems (the required fields of an added table) may come too, on the same line
    assert msg.startswith(f"{f}: ") and "\n" not in msg
    hint = f"(did you mean {first!r}?)" if typo else f"(valid: {', '.join(valid)})"
    assert f"{'.'.join(map(str, (*path, key)))}: unknown field {hint}" in msg, msg


# ---------------------------------------------------------------------- 6. empty items in --policies
@pytest.mark.parametrize("cmd", [["sim", "compare"], ["sim", "capacity", "--jobs", "1"]], ids=" ".join)
@pytest.mark.parametrize("text, message", [
    ("round_robin,,least_load", "item 2 is empty (two commas in a row after 'round_robin')"),
    (",round_robin", "item 1 is empty (a leading comma)"),
    ("round_robin,", "item 2 is empty (a trailing comma)"),
    ("cache_aware:cache_threshold=0.5,,balance_abs=8", "item 2 is empty (two commas in a row after "
                                                       "'cache_aware:cache_threshold=0.5')"),
    ("round_robin, ,least_load", "item 2 is empty (two commas in a row after 'round_robin')"),
])
def test_an_empty_policy_item_is_rejected(cmd, text, message, tmp_path: Path, capsys) -> None:
    rc = main([*cmd, "--policies", text, "--limit", "10", "--quiet", "--no-plots", "--out", str(tmp_path / "o")])
    assert rc == 2
    assert capsys.readouterr().err == (f"error: --policies {text!r}: {message}; write NAME[:K=V,...] items "
                                       "separated by single commas\n")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("text, expected", [
    ("round_robin", ["round_robin"]),
    (" round_robin , least_load ", ["round_robin", "least_load"]),  # spaces around items are fine
    ("cache_aware:cache_threshold=0.5,balance_abs=8,least_load", ["cache_aware:cache_threshold=0.5,balance_abs=8",
                                                                  "least_load"]),
])
def test_policy_lists_that_are_fine(text, expected) -> None:
    from pdlb_cli.args import policy_list

    assert policy_list(text) == expected


# ---------------------------------------------------------------------- 3. --slo-percentile, checked once
def _argparse_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


@pytest.mark.parametrize("value", ["0", "-5", "100.5", "120", "nan", "inf", "x", ""])
def test_a_bad_slo_percentile_is_an_argparse_error(value, capsys) -> None:
    # one check, while parsing: no second form of the message from pdlb_cli.sim.capacity.slo_from_args
    err = _argparse_error(["sim", "capacity", "--slo-percentile", value, "--limit", "5"], capsys)
    assert err.strip().splitlines()[-1] == (f"pdlb sim capacity: error: argument --slo-percentile: must be a "
                                            f"percentile in (0, 100], e.g. 99, got {value!r}")


@pytest.mark.parametrize("value, expected", [("99", 99.0), ("p99", 99.0), ("99.9%", 99.9), ("100", 100.0),
                                             ("0.5", 0.5)])
def test_slo_percentile_forms(value, expected) -> None:
    from pdlb_cli.main import build_parser
    from pdlb_cli.sim.capacity import slo_from_args

    args = build_parser().parse_args(["sim", "capacity", "--slo-percentile", value])
    assert slo_from_args(args).percentile == expected


# ---------------------------------------------------------------------- 8. result file names
@pytest.mark.parametrize("label, stem", [
    ("round_robin", "round_robin"),  # plain names unchanged
    ("kv_cost+least_load", "kv_cost+least_load"),
    ("ep_aware(horizon_weight=2.0,ttft_slo_s=2.0)", "ep_aware-horizon_weight=2.0-ttft_slo_s=2.0"),
    ("my policy (v2)", "my-policy-v2"),
    ("../../etc/passwd", "etc-passwd"),  # no path out of the results folder
    ("a/b\\c:d", "a-b-c-d"),
    ("-x", "x"),
    ("...", "run"),
])
def test_safe_file_stem(label, stem) -> None:
    from sim.run.file_names import safe_file_stem

    assert safe_file_stem(label) == stem


def test_file_names_are_safe_and_distinct_for_any_labels() -> None:
    # fuzz: random labels from a hostile alphabet give shell-safe, distinct names
    import random
    import re

    from sim.run.report import results_file_names

    rng = random.Random(0)
    alphabet = "ab_=.,()+- /\\:'\"$*?\t"
    for _ in range(300):
        labels = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12))) for _ in range(rng.randrange(1, 6))]
        names = results_file_names(labels)
        assert len(set(names)) == len(names) == len(labels)
        assert all(re.fullmatch(r"requests_[A-Za-z0-9_+=][A-Za-z0-9._+=-]*\.csv", n) for n in names), names
    assert results_file_names(["a(x=1)", "a-x=1", "a-x=1"]) == ["requests_a-x=1.csv", "requests_a-x=1-2.csv",
                                                                  "requests_a-x=1-3.csv"]


def test_compare_names_files_safely_and_keeps_the_spec(tmp_path: Path, capsys) -> None:
    rc = main(["sim", "compare", "--policies", "ep_aware:ttft_slo_s=2,horizon_weight=2,round_robin", "--limit", "20",
               "--no-plots", "--quiet", "--out", str(tmp_path)])
    assert rc == 0
    capsys.readouterr()
    runs = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert [(r["policy"], r["requests_csv"]) for r in runs] == [
        ("ep_aware(horizon_weight=2.0,ttft_slo_s=2.0)", "requests_ep_aware-horizon_weight=2.0-ttft_slo_s=2.0.csv"),
        ("round_robin", "requests_round_robin.csv")]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["summary.json", "summary.md", *(r["requests_csv"]
                                                                                                  for r in runs)])
    assert len((tmp_path / runs[0]["requests_csv"]).read_text().splitlines()) == 21  # header + 20 requests


# ---------------------------------------------------------------------- 9. the recorded command
@pytest.mark.parametrize("argv, expected", [
    (["sim", "run", "--trace", "t.jsonl", "--lim", "5"], "pdlb sim run --trace {d}/t.jsonl --limit 5"),
    (["sim", "run", "--trace=t.jsonl", "--out", "res"], "pdlb sim run --trace={d}/t.jsonl --out {d}/res"),
    # a preset stays a name; a scenario file is made absolute
    (["sim", "compare", "--scenario", "dsv3-pd-h200"], "pdlb sim compare --scenario dsv3-pd-h200"),
    (["sim", "compare", "--scenario", "sc.toml"], "pdlb sim compare --scenario {d}/sc.toml"),
    # values with spaces or parentheses are quoted; short options keep their value
    (["sim", "capacity", "-j", "2", "--policy", "ep_aware:ttft_slo_s=2", "--set", "description=a b"],
     "pdlb sim capacity -j 2 --policy ep_aware:ttft_slo_s=2 --set 'description=a b'"),
    (["sim", "sweep", "sw.toml", "-j", "1", "--no-plots"], "pdlb sim sweep {d}/sw.toml -j 1 --no-plots"),
    (["sim", "price", "--prices", "deepseek-v3-2025-02,sheet.toml", "--png", "x.png"],
     "pdlb sim price --prices deepseek-v3-2025-02,{d}/sheet.toml --png {d}/x.png"),
])
def test_command_line_is_reproducible_from_anywhere(argv, expected, tmp_path: Path, monkeypatch) -> None:
    from pdlb_cli.main import build_parser
    from pdlb_cli.args import command_line

    monkeypatch.chdir(tmp_path)
    for name in ("sc.toml", "sheet.toml"):
        (tmp_path / name).write_text("")
    parser = build_parser()
    parser.parse_args(argv)  # well-formed, as command_line assumes
    assert command_line(parser, argv) == expected.format(d=tmp_path)


def test_a_recorded_command_reruns_to_the_same_result_from_another_folder(tmp_path: Path, monkeypatch,
                                                                          capsys) -> None:
    import shlex

    from sim.workload import read_trace
    from sim.workload.writer import write_mooncake

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    write_mooncake(read_trace()[:25], "t.jsonl")
    assert main(["sim", "run", "--trace", "t.jsonl", "--policy", "round_robin", "--no-plots", "--quiet",
                 "--out", "res"]) == 0
    first = json.loads((tmp_path / "a" / "res" / "summary.json").read_text())
    cmd = shlex.split(first["meta"]["command"])
    assert cmd[:3] == ["pdlb", "sim", "run"] and first["meta"]["trace"] == str(tmp_path / "a" / "t.jsonl")
    monkeypatch.chdir(tmp_path / "b")  # elsewhere: the relative trace path would not be found
    cmd[cmd.index("--out") + 1] = str(tmp_path / "b" / "res")
    assert main(cmd[1:]) == 0
    again = json.loads((tmp_path / "b" / "res" / "summary.json").read_text())
    keys = ("num_requests", "ttft_s", "tpot_s", "goodput_rps", "prefix_hit_rate")
    assert [{k: r[k] for k in keys} for r in again["runs"]] == [{k: r[k] for k in keys} for r in first["runs"]]
    capsys.readouterr()


# ---------------------------------------------------------------------- 7. argparse errors: one usage line, then the error
def _all_parsers() -> list[tuple[tuple[str, ...], object]]:
    import argparse

    from pdlb_cli.main import build_parser

    out = []

    def walk(p, path):  # noqa: ANN001, ANN202
        out.append((path, p))
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    walk(sp, (*path, name))

    walk(build_parser(), ())
    return out


@pytest.mark.parametrize("path", [p for p, _ in _all_parsers()], ids=lambda p: " ".join(p) or "pdlb")
def test_every_command_answers_a_bad_option_in_two_lines(path, capsys) -> None:
    err = _argparse_error([*path, "--bogus-flag-zz"], capsys)
    lines = err.splitlines()
    prog = " ".join(("pdlb", *path))
    assert len(lines) == 2, err
    assert lines[0].startswith(f"usage: {prog}") and len(lines[0]) <= 120
    # the subcommand given the flag reports it (argparse alone reports at the top, as 'pdlb: error')
    assert lines[1].startswith(f"{prog}: error: "), err


@pytest.mark.parametrize("argv, last", [
    (["sim", "run", "--limt", "5"], "pdlb sim run: error: unrecognized arguments: --limt 5 (--limt: did you mean --limit?)"),
    (["sim", "validate", "--trace", "x"], "pdlb sim validate: error: unrecognized arguments: --trace x (--trace is an "
                                          "option of pdlb sim compare, run, price, store-sweep, capacity, not of "
                                          "pdlb sim validate)"),
    (["sim", "runn"], "pdlb sim: error: unknown command 'runn' (did you mean 'run'?); valid: compare, run, scenarios, "
                      "validate, price, sessions, store-sweep, workload, cost-model, capacity, sweep"),
    (["sim"], "pdlb sim: error: give a command: compare, run, scenarios, validate, price, sessions, store-sweep, "
              "workload, cost-model, capacity, sweep"),
    (["sim", "capacity", "--search", "gpuss"], "pdlb sim capacity: error: argument --search: invalid choice: 'gpuss' "
                                               "(choose from 'rate', 'gpus'); did you mean 'gpus'?"),
    (["sim", "run", "--index-mode", "zzz"], "pdlb sim run: error: argument --index-mode: invalid choice: 'zzz' "
                                            "(choose from 'approximate', 'events')"),  # nothing close: no guess
    (["sim", "sweep"], "pdlb sim sweep: error: the following arguments are required: SWEEP.toml"),
    (["sim", "run", "--limit"], "pdlb sim run: error: argument --limit: expected one argument"),
])
def test_simple_mistakes_end_in_a_clear_line(argv, last, capsys) -> None:
    lines = _argparse_error(argv, capsys).splitlines()
    assert len(lines) == 2 and lines[-1] == last
    assert "(all options: " in lines[0] or lines[0].startswith("usage: pdlb sim sweep")


# ---------------------------------------------------------------------- 11. --set values are TOML values
def test_set_takes_a_list_of_inline_tables(tmp_path: Path, capsys) -> None:
    rc = main(["sim", "run", "--limit", "10", "--quiet", "--no-plots", "--out", str(tmp_path),
               "--set", "speculative.draft_tokens=2", "--set", "speculative.acceptance=[0.8, 0.6]",
               "--set", 'speculative.acceptance_classes=[{share = 0.5, acceptance = [0.9, 0.8], name = "code"}, '
                        "{share=0.5, acceptance=[0.5,0.3]}]"])
    assert rc == 0
    capsys.readouterr()
    spec = json.loads((tmp_path / "summary.json").read_text())["scenario"]["speculative"]
    assert spec["acceptance_classes"] == [{"share": 0.5, "acceptance": [0.9, 0.8], "name": "code"},
                                          {"share": 0.5, "acceptance": [0.5, 0.3], "name": ""}]


@pytest.mark.parametrize("text, value", [
    ("8", 8), ("0.5", 0.5), ("true", True), ('"x y"', "x y"), ("'lit'", "lit"), ("[1, 2]", [1, 2]),
    ("{a = 1, b = [2]}", {"a": 1, "b": [2]}), ("[{a = 1}, {a = 2}]", [{"a": 1}, {"a": 2}]),
    ("h200", "h200"), ("my model", "my model"), ("1.2.3", "1.2.3"),  # bare words: strings, as before
])
def test_set_values(text, value) -> None:
    from pdlb_cli.args import parse_value

    assert parse_value(text) == value


@pytest.mark.parametrize("value, problem", [
    ("[{share=0.5 acceptance=[0.5]}]", "Unclosed inline table at column 13 of the value"),
    ("[1, 2", "Unclosed array at the end of the value"),
    ('"abc', "Unterminated string at the end of the value"),
    ("{a = }", "Invalid value at column 6 of the value"),
])
def test_malformed_set_values_are_argparse_errors(value, problem, capsys) -> None:
    # they were taken as strings, and the scenario then said "Input should be a valid list"
    lines = _argparse_error(["sim", "run", "--set", f"speculative.acceptance_classes={value}"], capsys).splitlines()
    assert lines[-1] == (f"pdlb sim run: error: argument --set: {'speculative.acceptance_classes=' + value!r}: not a "
                         f"TOML value: {problem} (strings in quotes, lists as [a, b], tables as {{k = v, k2 = v2}})")


# ---------------------------------------------------------------------- 4. flags without effect in the chosen mode
CAP = ["sim", "capacity", "--policy", "round_robin", "--slo-ttft-s", "0.1", "--limit", "20", "--jobs", "1", "--quiet",
       "--no-plots"]  # an SLO unreachable at zero load: the search ends before any simulation


@pytest.mark.parametrize("argv, warnings", [
    ([*CAP, "--rate-scale", "2"], ["--rate-scale has no effect with --search rate: the search finds the rate "
                                   "(--rate-scale is the load --search gpus sizes for)"]),
    ([*CAP, "--max-prefill-engines", "3", "--max-decode-engines", "2"],
     ["--max-prefill-engines has no effect with --search rate: engine limits are for --search gpus",
      "--max-decode-engines has no effect with --search rate: engine limits are for --search gpus"]),
    ([*CAP, "--search", "gpus", "--rate-min", "0.5", "--tol", "0.1", "--curve", "1,2"],
     [f"{f} has no effect with --search gpus: it shapes the rate search (--search rate)"
      for f in ("--rate-min", "--tol", "--curve")]),
    ([*CAP, "--slo-percentile", "99", "--slo-att", "0.8"],  # abbreviated: named in full
     ["--slo-attainment has no effect with --slo-percentile: the percentile form has no attainment target"]),
    ([*CAP, "--ray-address", "auto"], ["--ray-address has no effect with --executor process: it names a Ray cluster"]),
    ([*CAP, "--tier-weights", "host=0.5", "--no-router-tiers"],
     [f"{f} has no effect on scenario 'dsv3-pd-h200': it has no KV tiers (host_tier, shared_store) for the router "
      "to weigh" for f in ("--tier-weights", "--no-router-tiers")]),
    # the same flags where they do matter: no warning
    ([*CAP, "--search", "gpus", "--rate-scale", "2", "--max-prefill-engines", "3"], []),
    ([*CAP, "--slo-attainment", "0.8", "--set", "shared_store.ttl_s=60", "--tier-weights", "host=0.5"], []),
    (["sim", "run", "--scenario", "llama8b-agg-h100", "--policy", "cache_aware", "--decode-policy", "least_load",
      "--limit", "5", "--quiet", "--no-plots"],
     ["--policy has no effect with --decode-policy on the aggregated scenario 'llama8b-agg-h100': its one mixed pool "
      "is routed by the decode policy"]),
    (["sim", "price", "--trace", "x.jsonl", "--seed", "3"],
     ["--trace has no effect without --simulate", "--seed has no effect without --simulate"]),
    (["sim", "price", "--simulate", "--limit", "20", "--target", "30", "--png", "p.png"],
     [f"{f} has no effect with --simulate or --from-summary: it shapes the analytic tables only"
      for f in ("--target", "--png")]),
    # ep_aware's spec_decode where the decode pool gains one token per step (review F9, session 15)
    (["sim", "run", "--policy", "ep_aware:spec_decode=true", "--limit", "5", "--quiet", "--no-plots"],
     ["ep_aware(spec_decode=True): spec_decode changes nothing on scenario 'dsv3-pd-h200': its decode pool gains one "
      "output token per step (a [speculative] table with verify = \"every_step\" gives more)"]),
    (["sim", "run", "--policy", "ep_aware:spec_decode=true", "--limit", "5", "--quiet", "--no-plots",
      "--set", "speculative.draft_tokens=2", "--set", "speculative.acceptance=[0.8, 0.6]",
      "--set", "speculative.verify=every_step"], []),
])
def test_a_flag_without_effect_is_warned_about_once(argv, warnings, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([*argv, *(["--out", str(tmp_path / "o")] if argv[1] in ("capacity", "run") else [])]) == 0
    err = capsys.readouterr().err
    assert [ln for ln in err.splitlines() if ln.startswith("warning:")] == [f"warning: {w}" for w in warnings]


def test_spec_decode_without_speculative_decoding_really_has_no_effect(tmp_path: Path, capsys) -> None:
    # the evidence behind the spec_decode warning: with it and without, the same run, request by request
    got = []
    for policy in ("ep_aware", "ep_aware:spec_decode=true"):
        out = tmp_path / policy.replace(":", "_").replace("=", "_")
        assert main(["sim", "run", "--policy", policy, "--limit", "40", "--quiet", "--no-plots", "--out",
                     str(out)]) == 0
        got.append(next(out.glob("requests_*.csv")).read_text())
    capsys.readouterr()
    assert got[0] == got[1]


def test_the_warned_policy_really_has_no_effect(tmp_path: Path, capsys) -> None:
    # the evidence behind the aggregated-scenario warning: a different --policy, the same run
    got = []
    for policy in ("cache_aware", "round_robin"):
        out = tmp_path / policy
        assert main(["sim", "run", "--scenario", "llama8b-agg-h100", "--policy", policy, "--decode-policy",
                     "least_load", "--limit", "40", "--quiet", "--no-plots", "--out", str(out)]) == 0
        got.append((out / "requests_least_load.csv").read_text())
    capsys.readouterr()
    assert got[0] == got[1]
