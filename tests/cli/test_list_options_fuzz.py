"""List-valued options, tested by class (review2: ``--pdlb-processes 1,,2`` was read as ``1,2``).

Every list-valued option of the ``pdlb`` commands and of the bench/ fleet scripts
(``bench/router_overhead.py``, ``bench/issue26_table.py``) goes through
:mod:`pdlb_cli.comma_lists`. For each option, from one valid two-item value ``A,B``, the classes:

- empty items (a leading, trailing or doubled comma, a lone comma, nothing): refused, saying so;
- spaces around items: the same list as without them; a space inside an item: refused;
- a negative item (``-A``): refused;
- an item given twice: refused where the list is a set (counts, names, modes, keys), taken where it
  is a sequence (a ramp's rates);

then a seeded random fuzzer over the option's alphabet (its valid items, commas, spaces, junk):
every value either parses to exactly what its stripped, non-empty items parse to one by one (an
independent reading: the valid items' known values), or is refused with exit status 2 and one
error line that names the option; never a traceback, never a silently shortened list.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from pdlb_cli.admission_args import parse_tenant_weights
from pdlb_cli.args import parse_tier_weights
from pdlb_cli.main import build_parser
from pdlb_cli.sim.capacity import _curve
from pdlb_cli.sim.price import hit_rates, prompt_ratios
from pdlb_cli.sim.store_sweep import _parse_class_ttls, _parse_list

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))
import front_paired  # noqa: E402
import issue26_table  # noqa: E402
import route_latency  # noqa: E402
import router_overhead  # noqa: E402
from balancer.policies import available_policies  # noqa: E402

Outcome = tuple[str, Any]  # ("ok", parsed value) or ("err", the error text)


def _pdlb(prefix: list[str], flag: str, dest: str) -> Callable[[str], Outcome]:
    """The real ``pdlb`` parser, parse only (no command runs)."""
    def run(value: str) -> Outcome:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ns = build_parser().parse_args([*prefix, f"{flag}={value}"])
        except SystemExit as e:
            assert e.code == 2
            return "err", err.getvalue()
        return "ok", getattr(ns, dest)
    return run


def _fleet(flag: str, dest: str) -> Callable[[str], Outcome]:
    """issue26_table's parser and router_overhead's shared check (no run starts)."""
    def run(value: str) -> Outcome:
        err = io.StringIO()
        # a 16-CPU host, so that --router-cpus can name a proper subset; pdlb_default_processes
        # (which pins this process to the router CPUs for a moment) left out
        try:
            with contextlib.redirect_stderr(err), \
                    mock.patch.object(router_overhead.os, "sched_getaffinity", lambda _pid: set(range(16))), \
                    mock.patch.object(router_overhead, "pdlb_default_processes", lambda _cpus: 1):
                ap = issue26_table.build_parser()
                args = ap.parse_args([f"{flag}={value}"])
                router_overhead.check_fleet_args(ap, args, min_processes=1)
        except SystemExit as e:
            assert e.code == 2
            return "err", err.getvalue()
        return "ok", getattr(args, dest)
    return run


def _route_latency(flag: str, dest: str) -> Callable[[str], Outcome]:
    """bench/route_latency.py's parser and its list options' reading (no measurement starts)."""
    def run(value: str) -> Outcome:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ap = route_latency.build_parser()
                args = ap.parse_args([f"{flag}={value}"])
                route_latency.list_options(ap, args)
        except SystemExit as e:
            assert e.code == 2
            return "err", err.getvalue()
        return "ok", getattr(args, dest)
    return run


def _front_paired(value: str) -> Outcome:
    """bench/front_paired.py's parser on this checkout, ``--router-cpus`` (no router starts)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = front_paired.parse_args([f"{ROOT}::", f"--router-cpus={value}"])
    except SystemExit as e:
        assert e.code == 2
        return "err", err.getvalue()
    return "ok", args.router_cpus


def _func(fn: Callable[[str], Any]) -> Callable[[str], Outcome]:
    """A parser the command calls after argparse (raises ValueError naming the flag)."""
    def run(value: str) -> Outcome:
        try:
            return "ok", fn(value)
        except (ValueError, argparse.ArgumentTypeError) as e:
            return "err", str(e)
    return run


# name -> (run, flag named in errors, valid items {text: value}, combine(values) -> parsed, distinct)
CASES: dict[str, tuple[Callable[[str], Outcome], str, dict[str, Any], Callable[[list], Any], bool]] = {
    "k-routers --ks": (_pdlb(["dev", "k-routers"], "--ks", "ks"), "--ks", {"1": 1, "2": 2, "8": 8}, list, True),
    "k-routers --modes": (_pdlb(["dev", "k-routers"], "--modes", "modes"), "--modes",
                          {"events": "events", "hybrid": "hybrid", "approximate+reports": "approximate+reports"},
                          list, True),
    "tiers-vs-routing --rate-scales": (_pdlb(["dev", "tiers-vs-routing"], "--rate-scales", "rate_scales"),
                                       "--rate-scales", {"0.5": 0.5, "1": 1.0, "2.5": 2.5}, list, True),
    "sim workload ramp --rates": (_pdlb(["sim", "workload", "ramp", "--step-s", "1", "--out", "w.jsonl"], "--rates",
                                        "rates"), "--rates",
                                  {"1": 1.0, "2": 2.0, "4.5": 4.5}, list, False),
    "serve --admission-tenant-weights": (_pdlb(["serve"], "--admission-tenant-weights", "admission_tenant_weights"),
                                         "--admission-tenant-weights", {"a=1": ("a", 1.0), "b=2": ("b", 2.0),
                                                                        "c=0.5": ("c", 0.5)}, dict, True),
    "sim run --tier-weights": (_pdlb(["sim", "run"], "--tier-weights", "tier_weights"), "--tier-weights",
                               {"host=0.5": ("host", 0.5), "store=1": ("store", 1.0)}, dict, True),
    "tier weights (library form)": (_func(parse_tier_weights), "--tier-weights",
                                    {"host=0.5": ("host", 0.5), "store=1": ("store", 1.0)}, dict, True),
    "sim capacity --curve": (_func(_curve), "--curve", {"0.5": 0.5, "1": 1.0, "2": 2.0}, sorted, True),
    "sim price --hit-rate": (_func(hit_rates), "--hit-rate", {"0.5": 0.5, "0.8": 0.8, "0.9": 0.9}, list, True),
    "sim price --ratio": (_func(prompt_ratios), "--ratio", {"1": 1.0, "3.6": 3.6, "8": 8.0}, list, True),
    "sim store-sweep --ttl-hours": (_func(lambda t: _parse_list(t, "--ttl-hours", 1.0)), "--ttl-hours",
                                    {"1": 1.0, "2": 2.0, "none": None}, list, True),
    "sim store-sweep --class-ttl-hours": (_func(_parse_class_ttls), "--class-ttl-hours",
                                          {"a=1": ("a", 3600.0), "b=2": ("b", 7200.0)}, dict, True),
    "bench --pdlb-processes": (_fleet("--pdlb-processes", "pdlb_processes"), "--pdlb-processes",
                               {"1": 1, "2": 2, "8": 8}, sorted, True),
    "bench --modes": (_fleet("--modes", "modes"), "--modes", {"regular": "regular", "pd": "pd", "vllm-pd": "vllm-pd"},
                      list, True),
    "bench --peers": (_fleet("--peers", "peer_names"), "--peers",
                      {"smg": "smg", "vllm-router": "vllm-router", "sglang-router": "sglang-router"}, list, True),
    "bench --router-cpus": (_fleet("--router-cpus", "router_cpus"), "--router-cpus",
                            {"0": {0}, "2-3": {2, 3}, "8": {8}}, lambda vs: set().union(*vs), True),
    "front_paired --router-cpus": (_front_paired, "--router-cpus", {"0": {0}, "2-3": {2, 3}, "8": {8}},
                                   lambda vs: set().union(*vs), True),
    "route_latency --replicas": (_route_latency("--replicas", "replica_counts"), "--replicas",
                                 {"8": 8, "64": 64, "512": 512}, list, True),
    "route_latency --prompts": (_route_latency("--prompts", "prompt_sizes"), "--prompts",
                                {"1024": 1024, "32768": 32768, "7": 7}, list, True),
    "route_latency --policies": (_route_latency("--policies", "policy_names"), "--policies",
                                 {"ep_aware": "ep_aware", "kv_cost": "kv_cost", "scored": "scored"}, list, True),
}


#: an empty value is documented as "not given": no tier weights (the defaults), no pinning. Not
#: ``--curve ''``: a curve of no rate scales is refused like any other empty list (review, session 15:
#: it was taken as "no curve", which leaving the flag out already says)
EMPTY_MEANS_NONE = {"sim run --tier-weights": None, "tier weights (library form)": None, "bench --router-cpus": None,
                    "front_paired --router-cpus": None, "route_latency --policies": available_policies()}  # "" (its default): every policy


def _refused(case: str, value: str, *words: str) -> str:
    run, flag, *_ = CASES[case]
    kind, out = run(value)
    assert kind == "err", f"{case}: {value!r} was taken as {out!r}"
    assert "Traceback" not in out and flag in out, (case, value, out)
    for w in words:
        assert w in out, (case, value, w, out)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_empty_items_are_refused(case: str) -> None:
    a, b = list(CASES[case][2])[:2]
    for value in (f"{a},,{b}", f",{a},{b}", f"{a},{b},", f"{a}, ,{b}", ","):
        _refused(case, value, "empty")
    for value in ("", "  "):
        if value == "" and case in EMPTY_MEANS_NONE:
            assert CASES[case][0](value) == ("ok", EMPTY_MEANS_NONE[case])
            continue
        _refused(case, value)


@pytest.mark.parametrize("case", list(CASES))
def test_spaces_around_items_are_dropped_inside_refused(case: str) -> None:
    run, _flag, items, combine, _distinct = CASES[case]
    a, b = list(items)[:2]
    assert run(f" {a} , {b} ") == run(f"{a},{b}") == ("ok", combine([items[a], items[b]]))
    _refused(case, f"{a} {b}")


@pytest.mark.parametrize("case", list(CASES))
def test_negative_items_are_refused(case: str) -> None:
    a, b = list(CASES[case][2])[:2]
    name, eq, value = b.partition("=")
    _refused(case, f"{a},{name}=-{value}" if eq else f"{a},-{b}")  # pairs: a negative value
    _refused(case, f"-1,{a}")


@pytest.mark.parametrize("case", list(CASES))
def test_duplicates_are_refused_in_sets_kept_in_sequences(case: str) -> None:
    run, _flag, items, combine, distinct = CASES[case]
    a, b = list(items)[:2]
    if distinct:
        _refused(case, f"{a},{b},{a}", "twice")
    else:  # a ramp may come back to a rate
        assert run(f"{a},{b},{a}") == ("ok", combine([items[a], items[b], items[a]]))


@pytest.mark.parametrize("case", list(CASES))
def test_random_lists_parse_exactly_or_are_refused(case: str) -> None:
    run, flag, items, combine, distinct = CASES[case]
    rng = random.Random(f"lists-{case}")  # seeded: the same 60 values on every run
    alphabet = [*items, "", " ", "x", "-1", "1e999", "nan", "=", "a b"]  # valid items and junk no option takes
    for _ in range(60):
        parts = [rng.choice(alphabet) for _ in range(rng.randint(1, 4))]
        value = rng.choice([",", ", ", " ,"]).join(parts)
        kind, out = run(value)
        if value == "" and case in EMPTY_MEANS_NONE:
            assert (kind, out) == ("ok", EMPTY_MEANS_NONE[case])
            continue
        stripped = [p.strip() for p in value.split(",")]
        well_formed = all(p in items for p in stripped) and (not distinct or len(set(stripped)) == len(stripped))
        if kind == "ok":  # only what the valid items say, all of them, in order
            assert well_formed, f"{case}: {value!r} was taken as {out!r}"
            assert out == combine([items[p] for p in stripped]), (case, value, out)
        else:
            assert "Traceback" not in out and flag in out, (case, value, out)
            if well_formed:
                raise AssertionError(f"{case}: {value!r} is well formed but was refused: {out}")


def test_a_list_is_bounded() -> None:
    # every input-driven loop is bounded: 4,097 items are refused before any is converted
    from pdlb_cli.comma_lists import MAX_ITEMS

    _refused("k-routers --ks", ",".join(str(i) for i in range(1, MAX_ITEMS + 2)), "at most 4,096")
    assert CASES["k-routers --ks"][0](",".join(str(i) for i in range(1, MAX_ITEMS + 1)))[0] == "ok"


def test_a_bad_list_is_one_error_line_after_one_usage_line(capsys: pytest.CaptureFixture[str]) -> None:
    # review2 finding 3: the bench scripts printed argparse's 10-line usage block before the error
    for main, argv in ((router_overhead.main, ["--pdlb-processes", "1,,2"]),
                       (issue26_table.main, ["--pdlb-processes", "1,,2"])):
        old = sys.argv
        sys.argv = ["script.py", *argv]
        try:
            with pytest.raises(SystemExit) as e:
                main() if main is router_overhead.main else main(argv)
        finally:
            sys.argv = old
        assert e.value.code == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 2 and lines[0].startswith("usage: ") and "--help" in lines[0], lines
        assert lines[1].endswith("error: --pdlb-processes: expected integers >= "
                                 f"{0 if main is router_overhead.main else 1}"
                                 + (" (0: pdlb's default)" if main is router_overhead.main else "")
                                 + " separated by single commas, got '1,,2' (item 2 is empty: two commas in a row "
                                 "after '1')"), lines


@pytest.mark.parametrize(("argv", "last_line"), [
    # argparse's own "invalid int value: 'abc'" / "invalid float value" said what was wrong, not what is expected
    (["serve", "--port", "abc"], "pdlb serve: error: argument --port: expected an integer, got 'abc'"),
    (["sim", "store-sweep", "--block-size", "1.5"],
     "pdlb sim store-sweep: error: argument --block-size: expected an integer, got '1.5'"),
])
def test_argparse_type_errors_say_what_is_expected(argv: list[str], last_line: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    lines = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(lines) == 2 and lines[0].startswith("usage: ") and lines[1] == last_line


@pytest.mark.parametrize(("argv", "last_line"), [
    (["--repeat", "x"], "error: argument --repeat: expected an integer >= 1, got 'x'"),
    (["--duration-s", "soon"], "error: argument --duration-s: must be a finite number > 0, got 'soon'"),
])
def test_bench_type_errors_say_what_is_expected(argv: list[str], last_line: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        issue26_table.main(argv)
    lines = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(lines) == 2 and lines[1].endswith(last_line), lines


#: every split on "," left in bench/ and pdlb_cli/ outside pdlb_cli.comma_lists, as (file, what is
#: split), each with why: the structural test below fails on any other
HAND_SPLIT = {
    # GPU-host scripts that import no more of pdlb than pdlb_cli.arg_types (they run where only torch
    # is installed); their --rates and --load-fractions go through comma_list since session 16
    ("bench/gpu_engine_run.py", "a.models"), ("bench/gpu_kinds.py", "args.kinds"),
    # --ablate's ';'-separated groups: every item must be a known switch, so an empty one is refused
    ("bench/proxy_floor.py", "w"),
    # policy_list: refuses empty items itself (a k=v part continues the policy before it, so
    # comma_items cannot split it); _abs: the file paths of a value already parsed
    ("pdlb_cli/args.py", "text"), ("pdlb_cli/args.py", "value"),
    ("pdlb_cli/comma_lists.py", "text"),  # the parser itself
}


def test_no_list_option_is_split_by_hand() -> None:
    # the class, by structure: a value split on "," anywhere in bench/ or pdlb_cli/ other than
    # through pdlb_cli.comma_lists would bring back 1,,2 read as 1,2 (or a traceback). Any split, not
    # only args.X's: bench/front_paired.py's --router-cpus went through a helper's text.split(",")
    # (review F8, session 15)
    import ast

    found = set()
    for path in sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("pdlb_cli/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "split"
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == ","):
                found.add((path.relative_to(ROOT).as_posix(), ast.unparse(node.func.value)))
    assert found == HAND_SPLIT, sorted(found ^ HAND_SPLIT)


def _route_latency_repeat(*argv: str) -> Outcome:
    """bench/route_latency.py's parser and its ``--repeat`` check (no measurement starts)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ap = route_latency.build_parser()
            args = ap.parse_args(list(argv))
            route_latency.list_options(ap, args)
            route_latency.check_repeat(ap, args)
    except SystemExit as e:
        assert e.code == 2
        return "err", err.getvalue()
    return "ok", args.repeat


def test_route_latency_repeat_is_an_integer_in_range_refused_by_class() -> None:
    """``--repeat N``: 1..MAX_REPEAT (100) taken as is; by class, refused with one error naming
    the option: below 1, above the bound, not an integer, empty; and with the options it does not
    go with (--against/--numpy-baseline have --rounds; --decisions logs one run)."""
    top = route_latency.MAX_REPEAT
    for v in ("1", "2", " 3", str(top)):
        assert _route_latency_repeat(f"--repeat={v}") == ("ok", int(v))
    assert _route_latency_repeat() == ("ok", 1)  # the default: the table as before
    for v in ("0", "-1", str(top + 1), "10**9", "x", "1.5", "", "nan", "1e999", "2,3"):
        kind, out = _route_latency_repeat(f"--repeat={v}")
        assert kind == "err" and "--repeat" in out and "Traceback" not in out, (v, out)
        assert len([ln for ln in out.splitlines() if "error" in ln]) == 1, (v, out)
    for other in (["--against", "."], ["--numpy-baseline"], ["--decisions", "d.csv"]):
        kind, out = _route_latency_repeat("--repeat", "2", *other)
        assert kind == "err" and "--repeat" in out, (other, out)
        assert _route_latency_repeat("--repeat", "1", *other) == ("ok", 1)
    rng = random.Random("route_latency --repeat")  # seeded fuzz: exactly the integers 1..100 are taken
    for _ in range(60):
        v = "".join(rng.choice("0123456789-+. xe") for _ in range(rng.randint(1, 4)))
        kind, out = _route_latency_repeat(f"--repeat={v}")
        try:
            n = int(v)
        except ValueError:
            n = None
        assert (kind, out) == ("ok", n) if n is not None and 1 <= n <= top else kind == "err", (v, kind, out)
