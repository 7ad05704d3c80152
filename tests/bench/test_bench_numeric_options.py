"""Every numeric option of every bench/ script, by class (review R7 "Left", session 16: about 170
bare ``type=int`` / ``type=float`` options across 35 scripts took ``0``, ``-1``, NaN and infinity:
tracebacks, "every core", or runs of nonsense).

- structure: an option whose values are numbers takes one of :mod:`pdlb_cli.arg_types`' checks
  as its ``type=`` (read from the source for every script, and from the parser for every script
  this environment can load), so a new bare numeric option fails here and the class stays closed;
- values: ``0``, ``-1``, ``nan`` and ``inf`` given to each numeric option stop the parser with
  exit status 2 and one ``error: argument --opt: ...`` line naming the option, before anything
  runs; the exceptions are the options where 0 has a documented meaning (:data:`ZERO_MEANS`: their
  help says so, checked here) and seeds (0 is a seed like any other);
- each numeric option's own default is accepted by its check (a check stricter than the default
  would refuse the documented value);
- slow: every script started as a command with a bad value ends with exit status 2, no traceback.

Expected values are the rules themselves (a count >= 1; seconds, rates, SLOs finite and > 0; an
attainment in (0, 1]; a share in [0, 1)), written here independently of the checks' code.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import math
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if "add_argument(" in p.read_text())

#: options where 0 has a documented meaning: (script, option) -> the words of its help that say so
ZERO_MEANS = {
    ("agentx_decisions.py", "--sample"): "0: none",
    ("agentx_policies.py", "--frontend-s-per-token"): "0 = off",
    ("agentx_policies.py", "--band-duration-s"): "0 = no band",
    ("capacity_search.py", "--slo-ttft-per-1k-tokens-s"): "",  # pdlb sim capacity's option: 0 = no per-token budget
    ("cost_learner.py", "--outliers"): "in [0, 1)",
    ("cost_learner.py", "--noise"): ">= 0",
    ("ep_aware_slo_curve.py", "--slo-ttft-per-1k-s"): "0: none",
    ("gpu_profile.py", "--warmup"): "0: none",
    ("hostile_soak.py", "--tracemalloc"): "default 0: off",
    ("issue26_table.py", "--route-s"): "0: no route table",
    ("pd_tail.py", "--max-concurrency"): "default 0: none",
    ("policy_goodput.py", "--slo-ttft-per-1k-s"): "0: none",
    ("policy_goodput.py", "--fair-margin"): "0: just meet it",
    ("real_engines.py", "--shared-prefix-words"): "0: none",
    ("roofline_vs_measured.py", "--overhead-ms"): "0: none",
    ("route_latency.py", "--kv-events-per-s"): "default 0: approximate mode",
    ("route_latency.py", "--in-flight"): "default 0: each finishes at once",
    ("router_cores.py", "--long-s"): "0: none",
    ("router_overhead.py", "--paired-rounds"): "0: none",
    ("seq_cap_before_after.py", "--slo-ttft-per-1k-s"): "0: none",
}
BAD_VALUES = ("0", "-1", "nan", "inf")


# ------------------------------------------------------------------ structure, from the source
def _type_names(path: Path) -> list[tuple[str, str]]:
    """(option, the source of its type=) of every add_argument call with a type=."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            kw = {k.arg: k.value for k in node.keywords}
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if "type" in kw:
                out.append((names[0] if names else "?", ast.unparse(kw["type"])))
            elif isinstance(kw.get("default"), ast.Constant) and type(kw["default"].value) in (int, float) \
                    and "action" not in kw:
                out.append((names[0] if names else "?", "<none, numeric default>"))
    return out


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_no_bench_option_takes_a_bare_int_or_float(script: Path) -> None:
    bare = [(opt, t) for opt, t in _type_names(script) if t in ("int", "float", "<none, numeric default>")]
    assert bare == [], (f"{script.name}: numeric options without a checked type (use pdlb_cli.arg_types: "
                        f"positive_int, positive_float, fraction, ...): {bare}")


def test_the_source_check_sees_a_bare_option(tmp_path: Path) -> None:
    # the structural check itself can fail: a script with one bare option of each kind
    bad = tmp_path / "bad.py"
    bad.write_text("import argparse\nap = argparse.ArgumentParser()\nap.add_argument('--n', type=int)\n"
                   "ap.add_argument('--s', type=float, default=1.0)\nap.add_argument('--k', default=3)\n"
                   "ap.add_argument('--ok', type=positive_int)\n")
    assert _type_names(bad) == [("--n", "int"), ("--s", "float"), ("--k", "<none, numeric default>"),
                                ("--ok", "positive_int")]


# ------------------------------------------------------------------ the parsers themselves
class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser captured")
        self.parser = parser


def _load_parser(script: Path, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The script's parser, as built when it runs as ``__main__``: its first parse stops here."""
    def capture(self: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
        raise _Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(sys, "argv", [str(script)])
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except _Captured as c:
        monkeypatch.undo()
        return c.parser
    except ModuleNotFoundError as e:  # an engine or GPU library this environment lacks
        monkeypatch.undo()
        pytest.skip(f"{script.name} needs {e.name}; its source is checked by the structural test")
    monkeypatch.undo()
    raise AssertionError(f"{script.name} ran to the end without parsing its options")


def _probe(action: argparse.Action) -> bool:
    """Whether an option's values are numbers: its type turns a number into an int or a float."""
    if action.type in (int, float):
        return True
    if action.type is None:
        return type(action.default) in (int, float)
    if not callable(action.type):
        return False
    for text in ("1", "0.5", "2", "0", "-1"):
        try:
            value = action.type(text)
        except Exception:
            continue
        return type(value) in (int, float)
    return False


def _numeric_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.nargs != 0 and _probe(a)]


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[int | None, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_known_args(argv)  # parse_args would also want the script's required options
        except SystemExit as e:
            return (e.code if isinstance(e.code, int) else 1), err.getvalue()
    return None, err.getvalue()


def _accepts(action: argparse.Action, text: str) -> str | None:
    """None if the option's check takes ``text``, else its message (argparse's own conversion step;
    a parse would also stop at the script's required arguments)."""
    try:
        action.type(text)  # type: ignore[misc]
    except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
        return str(e) or repr(e)
    return None


def _argv(action: argparse.Action, value: str) -> list[str]:
    opt = action.option_strings[-1]
    n = action.nargs if isinstance(action.nargs, int) else 1
    return [f"{opt}={value}"] if n == 1 else [opt, *([value] * n)]


def _zero_allowed(script: Path, opt: str) -> bool:
    return (script.name, opt) in ZERO_MEANS or opt == "--seed"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_numeric_option_refuses_bad_values(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = _load_parser(script, monkeypatch)
    options = _numeric_options(parser)
    for action in options:
        opt = action.option_strings[-1]
        assert getattr(action.type, "__module__", None) == "pdlb_cli.arg_types", \
            f"{script.name} {opt}: numeric values without a check of pdlb_cli.arg_types (type={action.type!r})"
        for value in BAD_VALUES:
            if value == "0" and _zero_allowed(script, opt):
                refused = _accepts(action, "0")
                assert refused is None, f"{script.name} {opt}=0 has a documented meaning, yet was refused: {refused}"
                continue
            code, err = _parse(parser, _argv(action, value))
            assert code == 2, f"{script.name} {opt}={value}: exit status {code}, expected 2 ({err!r})"
            assert "Traceback" not in err
            last = err.rstrip("\n").splitlines()[-1]
            assert last.startswith(f"{parser.prog}: error: argument {opt}"), (script.name, opt, value, err)
            assert value in last or value.lstrip("-") in last, (script.name, opt, value, last)
        # the default, where it is a number, is accepted (a check stricter than its own default is wrong)
        if type(action.default) in (int, float) and math.isfinite(action.default) and action.nargs is None:
            refused = _accepts(action, repr(action.default))
            assert refused is None, f"{script.name} {opt}: its default {action.default!r} is refused: {refused}"


@pytest.mark.parametrize("key", sorted(ZERO_MEANS), ids=lambda k: f"{k[0]}{k[1]}")
def test_a_zero_that_means_something_says_so_in_the_help(key: tuple[str, str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    script, opt = BENCH / key[0], key[1]
    source = script.read_text()
    assert f'"{opt}"' in source, f"{key}: no such option (ZERO_MEANS is stale)"
    parser = _load_parser(script, monkeypatch)
    action = next(a for a in parser._actions if opt in a.option_strings)
    help_text = (action.help or "") % {"default": action.default}
    assert ZERO_MEANS[key] in help_text, f"{key}: the help does not say what 0 means: {help_text!r}"
    assert _accepts(action, "0") is None


def test_the_class_is_not_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    # the probe finds the numeric options: a script known to have 13 (router_cores.py, every one of
    # them a count, seconds or a rate) and one list-valued option that is not numeric (--modes)
    parser = _load_parser(BENCH / "router_cores.py", monkeypatch)
    names = {a.option_strings[-1] for a in _numeric_options(parser)}
    assert {"--processes", "--rate", "--duration-s", "--long-s", "--budget-s"} <= names
    assert "--modes" not in names
    assert len(SCRIPTS) >= 35


# ------------------------------------------------------------------ as a command (slow)
def _first_refused(script: Path) -> tuple[str, str] | None:
    for opt, t in _type_names(script):
        if t.startswith(("positive_", "fraction", "port_int", "int_between", "share")):
            return opt, "-1" if t == "share" else "0"
    return None


@pytest.mark.slow  # about 40 s at load 1 (one interpreter per script); longer on a loaded host
def test_a_bad_value_stops_every_script_before_it_runs() -> None:
    failures = []
    for script in SCRIPTS:
        pick = _first_refused(script)
        if pick is None:
            continue
        opt, value = pick
        r = subprocess.run([sys.executable, str(script), f"{opt}={value}"], capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
        if "No module named" in r.stderr and ("torch" in r.stderr or "transformers" in r.stderr):
            continue
        last = r.stderr.rstrip("\n").splitlines()[-1] if r.stderr.strip() else ""
        if r.returncode != 2 or "Traceback" in r.stderr or f"error: argument {opt}" not in last or r.stdout:
            failures.append((script.name, opt, value, r.returncode, r.stderr[-300:]))
    assert failures == []
