"""Argument types and option groups shared by the ``pdlb`` subcommand modules.

The floor under every subcommand module of :mod:`pdlb_cli`: they import from here, never from each
other (``tests/test_import_graph.py``), and this module imports nothing above the scenario and its
perf model (no simulation, search or report module; no other module of :mod:`pdlb_cli`).

- ``type=`` checks for argparse (numeric ones from :mod:`pdlb_cli.arg_types`: :func:`positive_int`, :func:`int_at_least`, :func:`seed_int`,
  :func:`positive_float`, :func:`nonnegative_float`, :func:`rate_list`, :func:`fraction`,
  :func:`percentile`, :func:`tier_weights_arg`): a bad value stops the
  parser with ``argument --flag: <message>`` and exit status 2;
- option groups (:func:`add_workload_args`, :func:`add_cluster_args`, :func:`add_router_args`,
  :func:`add_slo_args`, :func:`add_output_args`) and the scenario they build (:func:`scenario_from_args`;
  the :mod:`sim.search.point` types they build are :mod:`pdlb_cli.sim.capacity`'s, so this module imports nothing
  above the scenario and its perf model);
- :func:`route_slo_note` for the titles of results tables, :func:`command_line` for the command
  a result records;
- ``--set dotted.key=value`` scenario overrides (:func:`parse_override`; applied by
  :func:`sim.overrides.apply_overrides`);
- the session workload options and their :class:`sim.workload.sessions.SessionWorkloadConfig`
  (:func:`add_session_workload_args`, :func:`session_config`); :func:`describe_scenario`;
- :func:`unique_results_dir` and :func:`default_results_dir` for default results folders,
  :func:`check_out_file` for an ``--out FILE``;
- :class:`ArgumentParser`, argparse's parser with short, clear usage errors;
- list-valued options' items (:func:`comma_items`, :func:`comma_list`, from :mod:`pdlb_cli.comma_lists`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
import shlex
import sys
import time
import tomllib
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.markup import escape

from balancer.policies import make_policy
from balancer.policies.spec import split_policy_list
from balancer.router import DEFAULT_TIER_WEIGHTS
from pdlb_cli.arg_types import (  # noqa: F401 (re-exported: the type= checks live there, standard library only)
    MAX_FLAG_TOKENS, _float_checked, _int_at_least, fraction, int_at_least, int_between, nonnegative_float,
    nonnegative_int, percentile, port_int, positive_float, positive_int, seed_int, share, token_count)
from pdlb_cli.comma_lists import CommaListError, comma_items, comma_list, one_of  # noqa: F401 (re-exported)
from pdlb_cli.engine_options import add_engine_option_args, apply_engine_options
from sim.run.file_names import safe_file_stem
from sim.search.host import default_jobs
from sim.models.presets import get_model
from sim.run.pool_perf import build_perf
from sim.overrides import apply_overrides
from sim.scenario import DEFAULT_PRESET, PRESETS, Scenario, describe_pools, load_scenario
from sim.workload.sessions import SessionWorkloadConfig, load_session_config

DEFAULT_SLO_TTFT_S = 2.0
DEFAULT_SLO_TPOT_S = 0.1
DEFAULT_INDEX_MODE = "approximate"


# ---------------------------------------------------------------------- argparse type= checks (the numeric ones: pdlb_cli.arg_types)
def positive_int_list(text: str) -> list[int]:
    """Comma-separated distinct ints, each >= 1 (``pdlb dev k-routers --ks 1,2,4,8``)."""
    return comma_list(text, positive_int, "integers >= 1")


def positive_float_list(text: str) -> list[float]:
    """Comma-separated distinct finite numbers, each > 0 (``pdlb dev tiers-vs-routing --rate-scales 0.6,1``)."""
    return comma_list(text, positive_float, "numbers > 0")


def rate_list(text: str) -> list[float]:
    """Comma-separated request rates, req/s: finite, >= 0, at least one > 0 (a load ramp's steps,
    so a rate may repeat)."""
    try:
        rates = [float(x) for x in comma_items(text, "rates (req/s)", distinct=False)]
    except CommaListError:
        raise
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates (req/s), got {text!r}") from None
    if any(not (r >= 0 and r != float("inf")) for r in rates):
        raise argparse.ArgumentTypeError(f"expected comma-separated finite rates >= 0, got {text!r}")
    if not any(rates):
        raise argparse.ArgumentTypeError(f"every rate is 0, so the workload would be empty; give at least one "
                                         f"rate > 0, got {text!r}")
    return rates


def parse_tier_weights(text: str | None) -> dict[str, float] | None:
    """``"host=0.8,store=0.4"`` -> ``{"host": 0.8, "store": 0.4}``; ``None`` -> ``None``.

    Checked here, before any work, the same way :class:`balancer.router.Router` checks them.

    Raises:
        ValueError: not ``name=number`` pairs, a name other than ``host``/``store``
            (:data:`balancer.router.DEFAULT_TIER_WEIGHTS`), or a weight outside [0, 1].
    """
    if not text:
        return None
    out: dict[str, float] = {}
    for part in comma_items(text, "name=number pairs like host=0.75,store=0.5", flag="--tier-weights"):
        name, sep, value = part.partition("=")
        name = name.strip()
        try:
            if not sep:
                raise ValueError
            weight = float(value)
        except ValueError:
            raise ValueError(f"--tier-weights: expected name=number pairs like host=0.75,store=0.5, got {part!r}") from None
        if name not in DEFAULT_TIER_WEIGHTS:
            raise ValueError(f"--tier-weights: unknown tier {name!r}; valid: {', '.join(DEFAULT_TIER_WEIGHTS)}")
        if name in out:
            raise ValueError(f"--tier-weights: tier {name} is given twice in {text!r}")
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"--tier-weights: {name} weight must be in [0, 1], got {value.strip()}")
        out[name] = weight
    return out


def tier_weights_arg(text: str) -> dict[str, float] | None:
    """argparse form of :func:`parse_tier_weights`."""
    try:
        return parse_tier_weights(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--tier-weights: ")) from None


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with errors a user reads at a glance (``pdlb`` and every subcommand's
    parser, which argparse makes of the same class):

    - the error is the last line, ``"<prog>: error: <message>"``, after one usage line: a usage
      that would take several lines (``pdlb sim capacity`` has 40 options) becomes ``usage: <prog>
      [options] <positionals> (all options: <prog> --help)``;
    - an unrecognized argument is reported by the subcommand it was given to (argparse reports it
      at the top, ``pdlb: error: ...``, under the top-level usage), with the closest option;
    - an invalid choice (a misspelt subcommand or value) names the closest valid one.
    """

    def error(self, message: str) -> typing.NoReturn:
        subs = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
        for a in subs:  # "argument sim_command: ..." / "required: sim_command": say "command"
            names = ", ".join(a.choices)
            if message == f"the following arguments are required: {a.dest}":
                message = f"give a command: {names}"
            elif message.startswith(f"argument {a.dest}: invalid choice: "):
                bad = message.removeprefix(f"argument {a.dest}: invalid choice: ").split(" (choose from")[0]
                close = difflib.get_close_matches(bad.strip("'"), list(a.choices), n=1, cutoff=0.75)
                message = f"unknown command {bad}" + (f" (did you mean {close[0]!r}?)" if close else "") + \
                    f"; valid: {names}"
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if m:
            choices = re.findall(r"'([^']*)'", m.group(2))
            close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.75)
            if close:
                message += f"; did you mean {close[0]!r}?"
        # argparse's own words for a type= that failed: say what is expected
        message = re.sub(r"invalid int value: (.*)$", r"expected an integer, got \1", message)
        message = re.sub(r"invalid float value: (.*)$", r"expected a number, got \1", message)
        usage = self.format_usage()
        if usage.count("\n") > 1:
            pos = []
            for a in self._get_positional_actions():
                pos.append("COMMAND ..." if isinstance(a, argparse._SubParsersAction) else (a.metavar or a.dest))
            usage = f"usage: {' '.join([self.prog, '[options]', *pos])}  (all options: {self.prog} --help)\n"
        self._print_message(usage, sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        argv = list(sys.argv[1:] if args is None else args)
        ns, extras = self.parse_known_args(argv, namespace)
        if extras:
            target: argparse.ArgumentParser = self
            siblings: dict[str, argparse.ArgumentParser] = {}
            for tok in argv:  # the subcommand the extras were given to: the leading subcommand words
                action = next((a for a in target._actions
                               if isinstance(a, argparse._SubParsersAction) and tok in a.choices), None)
                if action is None:
                    break
                siblings, target = dict(action.choices), action.choices[tok]
            hints = []
            for x in extras:
                if not x.startswith("--"):
                    continue
                name = x.partition("=")[0]
                close = difflib.get_close_matches(name, list(target._option_string_actions), n=1, cutoff=0.75)
                elsewhere = [n for n, p in siblings.items() if p is not target and name in p._option_string_actions]
                if close:
                    hints.append(f"{name}: did you mean {close[0]}?")
                elif elsewhere:
                    parent = target.prog.rsplit(" ", 1)[0]
                    hints.append(f"{name} is an option of {parent} {', '.join(elsewhere)}, not of {target.prog}")
            target.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else ""))
        return ns


def unique_results_dir(base: Path) -> Path:
    """Create and return ``base``, or ``base-2``, ``base-3``, ... if it exists: the default results
    folder of two runs started in the same second is never shared. ``mkdir`` without ``exist_ok``
    makes the claim atomic, so concurrent processes get different folders.

    Raises:
        OSError: the parent cannot be created or written.
    """
    base.parent.mkdir(parents=True, exist_ok=True)
    for i in range(1, 10_000):
        path = base if i == 1 else base.with_name(f"{base.name}-{i}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"{base}: 9999 results folders of that name exist")


def check_out_file(path: Path, example: str) -> None:
    """Fail before any work if ``--out`` cannot be written as a file: one line naming ``--out``
    (a directory gets ``example``, a file name, as the suggestion), instead of an
    ``[Errno 21] Is a directory`` after the work is done.

    Raises:
        ValueError: ``path`` is a directory, its folder does not exist, or it is not writable.
    """
    if path.is_dir():
        raise ValueError(f"--out {path}: is a directory; give a file name, e.g. {path / example}")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"--out {path}: folder {parent} does not exist")
    if not os.access(path if path.exists() else parent, os.W_OK):
        raise ValueError(f"--out {path}: not writable")


def default_results_dir(*parts: str) -> Path:
    """The default results folder ``results/<parts>-<YYYYmmdd-HHMMSS>`` (made by
    :func:`unique_results_dir`), with each part made a safe file name
    (:func:`sim.run.file_names.safe_file_stem`): a scenario's ``name`` is free text, and one such as
    ``"../../etc/x"`` or ``"a/b"`` must not put the folder outside ``results/`` or in a subfolder.
    ``default_results_dir("capacity", "dsv3-pd-h200")`` -> ``results/capacity-dsv3-pd-h200-<time>``."""
    stem = "-".join(safe_file_stem(p) for p in parts)
    return unique_results_dir(Path("results") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}")


# ---------------------------------------------------------------------- --set overrides
#: Most ``--set`` overrides and the deepest dotted path taken (input-driven loops are bounded).
MAX_PATH_DEPTH = 8


def parse_value(text: str) -> Any:
    """A ``--set`` value: a TOML value (what ``x = <value>`` gives in a TOML file: ``8``, ``0.5``,
    ``true``, ``"x"``, ``[1, 2]``, ``{a = 1}``, a list of inline tables ``[{share = 0.5,
    acceptance = [0.9]}, ...]``), or else a bare word taken as a string (``h200``).

    Raises:
        ValueError: text that starts as a TOML string, list or table (``"``, ``'``, ``[``, ``{``)
            but does not parse: the TOML parser's message, with the column in the value.
    """
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as e:
        if not text.lstrip().startswith(('"', "'", "[", "{")):
            return text
        msg = " ".join(str(e).split())
        m = re.search(r"\s*\(at line 1, column (\d+)\)$|\s*\(at end of document\)$", msg)
        where = ""
        if m:
            where = f" at column {int(m.group(1)) - 4} of the value" if m.group(1) else " at the end of the value"
            msg = msg[:m.start()]
        raise ValueError(f"not a TOML value: {msg}{where} (strings in quotes, lists as [a, b], tables as "
                         "{k = v, k2 = v2})") from None


def parse_override(text: str) -> tuple[str, Any]:
    """``"prefill.num_engines=8"`` -> ``("prefill.num_engines", 8)``.

    Raises:
        ValueError: no ``=``, an empty key or key part, a path deeper than :data:`MAX_PATH_DEPTH`,
            or a value that is malformed TOML (:func:`parse_value`).
    """
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ValueError(f"--set {text!r}: expected dotted.key=value, e.g. prefill.num_engines=8")
    if key.count(".") >= MAX_PATH_DEPTH:
        raise ValueError(f"--set {text!r}: paths are at most {MAX_PATH_DEPTH} keys deep")
    try:
        return key, parse_value(value.strip())
    except ValueError as e:
        raise ValueError(f"--set {text!r}: {e}") from None


def override_arg(text: str) -> tuple[str, Any]:
    """argparse form of :func:`parse_override`."""
    try:
        return parse_override(text)
    except ValueError as e:  # argparse names the flag: "argument --set: 'x=[1': ..."
        raise argparse.ArgumentTypeError(str(e).removeprefix("--set ")) from None


# ---------------------------------------------------------------------- option groups
def add_workload_args(p: argparse.ArgumentParser, *, rate_scale: bool = True) -> argparse._ArgumentGroup:
    """``--trace``, ``--format``, ``--rate-scale`` (unless ``rate_scale=False``), ``--limit``,
    ``--duration-s``, ``--spread-s``."""
    g = p.add_argument_group("workload")
    g.add_argument("--trace", metavar="PATH", help="trace file (default: the embedded Mooncake conversation trace)")
    g.add_argument("--format", default="auto", choices=["auto", "mooncake", "azure"],
                   help="trace format (default: by extension: .jsonl[.gz] mooncake, .csv azure)")
    if rate_scale:
        g.add_argument("--rate-scale", type=positive_float, default=1.0, metavar="F",
                       help="multiply the arrival rate by F (divides arrival times; default 1)")
    g.add_argument("--limit", type=positive_int, metavar="N", help="use only the first N requests")
    g.add_argument("--duration-s", type=positive_float, metavar="S",
                   help="use only requests arriving in the first S seconds of simulated time, after rate scaling "
                        + ("(--rate-scale 2 --duration-s 60: 60 s at twice the rate)" if rate_scale else
                           "(every rate is tested over the same S-second window)"))
    g.add_argument("--spread-s", type=nonnegative_float, default=3.0, metavar="S",
                   help="move every request of a timestamp group (requests sharing an arrival time, and lone "
                        "ones too) to a uniform time in [t, t + S) (Mooncake logs arrivals in ~3 s batches; 0 keeps "
                        "the batches; default 3); order within a group is kept, but requests of neighbouring "
                        "groups may swap, so two turns of one session can reorder")
    return g


def add_set_arg(g: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--set KEY=VALUE`` (repeatable) into ``args.overrides``; apply with :func:`apply_overrides`."""
    g.add_argument("--set", dest="overrides", type=override_arg, action="append", default=[], metavar="KEY=VALUE",
                   help="override a scenario field by dotted path, e.g. --set prefill.num_engines=8 --set perf.mfu=0.5 "
                        "--set shared_store.class_ttl_s.chatbot=3600 (values in TOML syntax; repeatable)")


def add_cluster_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """``--scenario``, ``--set``, ``--prefill-engines``/``--decode-engines``/``--mixed-engines``, ``--exact``."""
    g = p.add_argument_group("cluster")
    g.add_argument("--scenario", default=DEFAULT_PRESET, metavar="NAME|FILE",
                   help=f"scenario preset ({', '.join(sorted(PRESETS))}) or a .toml/.yaml/.json file (default {DEFAULT_PRESET})")
    add_set_arg(g)
    g.add_argument("--prefill-engines", type=positive_int, metavar="N", help="override the number of prefill engines")
    g.add_argument("--decode-engines", type=positive_int, metavar="N", help="override the number of decode engines")
    g.add_argument("--mixed-engines", type=positive_int, metavar="N",
                   help="override the number of mixed (aggregated) engines")
    g.add_argument("--exact", action="store_true", help="step-by-step decode (reference mode; slower, same results)")
    add_engine_option_args(p)
    return g


def add_router_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """``--index-mode``, ``--tier-weights``, ``--no-router-tiers``."""
    g = p.add_argument_group("router")
    g.add_argument("--index-mode", default=DEFAULT_INDEX_MODE, choices=["approximate", "events"],
                   help="prefix index: 'approximate' records routed prompts (SGLang, llm-d); 'events' trusts only the "
                        "simulated engines' KV events (Dynamo) (default approximate)")
    g.add_argument("--tier-weights", type=tier_weights_arg, metavar="host=W,store=W",
                   help="weights of host-tier and shared-store prefix hits relative to HBM hits, each in [0, 1], when "
                        "the scenario has KV tiers (default host=0.75,store=0.5)")
    g.add_argument("--no-router-tiers", action="store_true",
                   help="with KV tiers configured, let the router see only HBM prefix matches")
    return g


#: ``pdlb sim capacity``'s default TTFT budget growth per 1000 prompt tokens: with a flat 2 s budget
#: the embedded Mooncake trace (prompts up to ~125k tokens) cannot meet 90% attainment even at zero
#: load (83.4% at most), so every policy was "unreachable"; with 0.5 s per 1k tokens the floor
#: reaches 99.4% (:func:`sim.search.capacity.zero_load_floor`) and the search answers.
CAPACITY_TTFT_PER_1K_TOKENS_S = 0.5


def add_slo_args(g: argparse._ArgumentGroup, *, targets: bool = False, ttft_per_1k_default: float = 0.0) -> None:
    """``--slo-ttft-s`` and ``--slo-tpot-s``; with ``targets``, also ``--slo-attainment``,
    ``--slo-percentile`` and ``--slo-ttft-per-1k-tokens-s`` (default ``ttft_per_1k_default``;
    capacity searches, sweeps)."""
    g.add_argument("--slo-ttft-s", type=positive_float, default=DEFAULT_SLO_TTFT_S, metavar="S",
                   help=f"TTFT SLO in seconds for goodput (default {DEFAULT_SLO_TTFT_S})")
    g.add_argument("--slo-tpot-s", type=positive_float, default=DEFAULT_SLO_TPOT_S, metavar="S",
                   help=f"TPOT SLO in seconds for goodput (default {DEFAULT_SLO_TPOT_S})")
    if targets:
        g.add_argument("--slo-attainment", type=fraction, default=0.9, metavar="FRAC",
                       help="fraction of requests that must meet both the TTFT and TPOT SLO (default 0.9)")
        g.add_argument("--slo-percentile", type=percentile, metavar="P",
                       help="percentile form instead: TTFT pP <= --slo-ttft-s and TPOT pP <= --slo-tpot-s (e.g. 99)")
        g.add_argument("--slo-ttft-per-1k-tokens-s", type=nonnegative_float, default=ttft_per_1k_default, metavar="S",
                       help="TTFT budget grows by S seconds per 1000 prompt tokens (budget = --slo-ttft-s + "
                            f"S * prompt_tokens / 1000; default {ttft_per_1k_default:g}; 0 = a flat budget)")
        g.add_argument("--no-route-slo", dest="route_slo", action="store_false",
                       help="route SLO-blind: by default the router is told the TTFT budget searched for, and "
                            "SLO-aware policies (ep_aware) route against it")
    else:
        g.add_argument("--route-slo", action="store_true",
                       help="tell the router the TTFT budget (--slo-ttft-s), so SLO-aware policies (ep_aware) "
                            "place requests that would miss it anywhere where they harm others least "
                            "(default: SLO-blind routing)")


def add_output_args(p: argparse.ArgumentParser, prefix: str = "") -> argparse._ArgumentGroup:
    """``--out``, ``--no-plots``, ``--quiet`` (with the SLO options added by the caller);
    ``prefix`` is the default folder's first part, as the command passes it to
    :func:`default_results_dir` (``"capacity"``: ``results/capacity-<scenario>-<time>``)."""
    g = p.add_argument_group("metrics and output")
    first = f"{prefix}-" if prefix else ""
    g.add_argument("--out", type=Path, metavar="DIR",
                   help="results folder; an existing DIR is reused and the files of this run overwrite those of "
                        f"the same name (default results/{first}<scenario>-<YYYYmmdd-HHMMSS>, with -2, -3, ... "
                        "appended when that folder exists)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    return g


def add_executor_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """``--jobs``, ``--executor``, ``--ray-address`` (capacity searches and sweeps)."""
    g = p.add_argument_group("execution")
    g.add_argument("--jobs", "-j", type=positive_int, default=default_jobs(), metavar="N",
                   help="simulations at once: local worker processes, or Ray CPUs of a local Ray instance "
                        "(default: this machine's cores, %(default)s)")
    g.add_argument("--executor", default="process", choices=["process", "ray"],
                   help="where simulations run: a local process pool, or Ray tasks (pip install 'pdlb[ray]') "
                        "(default process)")
    g.add_argument("--ray-address", metavar="ADDR",
                   help="Ray cluster to join ('auto' = the one this machine is part of, or host:port); default: "
                        "start a local Ray instance of --jobs CPUs")
    return g


# ---------------------------------------------------------------------- policy lists
def policy_list(text: str, flag: str = "--policies") -> list[str]:
    """``--policies "a,b:k=v,k2=v2,c"`` -> ``["a", "b:k=v,k2=v2", "c"]`` (a ``k=v`` part continues
    the policy before it: :func:`balancer.policies.spec.split_policy_list`), for every command
    that takes a policy list.

    Raises:
        ValueError: ``"<flag>: ..."``: an empty item (``a,,b``, a leading or trailing comma: a
            typo, not a request for fewer policies), no policy at all, a ``k=v`` part after no
            ``name:`` spec.
    """
    parts = text.split(",")
    if not any(p.strip() for p in parts):
        raise ValueError(f"{flag}: give at least one policy")
    for i, part in enumerate(parts):
        if not part.strip():
            where = "a leading comma" if i == 0 else "a trailing comma" if i == len(parts) - 1 else \
                f"two commas in a row after {','.join(parts[:i])!r}"
            raise ValueError(f"{flag} {text!r}: item {i + 1} is empty ({where}); "
                             "write NAME[:K=V,...] items separated by single commas")
    try:
        return split_policy_list(text)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


# ---------------------------------------------------------------------- the recorded command
#: Options whose values may name files although their type is not Path: resolved only where the
#: value (or a comma-separated item of it) is an existing file, so preset names stay names.
_MAYBE_FILE_DESTS = frozenset({"scenario", "prices"})
#: Options that always name a path (their type is str).
_PATH_DESTS = frozenset({"trace"})


def _subparser(parser: argparse.ArgumentParser, token: str) -> argparse.ArgumentParser | None:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction) and token in a.choices:
            return a.choices[token]
    return None


def _option(parser: argparse.ArgumentParser, name: str) -> tuple[str, argparse.Action | None]:
    """The full option string and action of ``name`` (argparse's unique-prefix abbreviations
    included: ``--lim`` -> ``--limit``)."""
    table = parser._option_string_actions
    if name in table:
        return name, table[name]
    hits = [o for o in table if o.startswith(name)] if name.startswith("--") else []
    return (hits[0], table[hits[0]]) if len(hits) == 1 else (name, None)


def _abs(value: str, *, only_files: bool) -> str:
    def one(v: str) -> str:
        if only_files and not Path(v).is_file():
            return v
        return os.path.abspath(os.path.expanduser(v))

    return ",".join(one(v) for v in value.split(",")) if only_files else one(value)


def command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str:
    """The command to record in a result's meta, reproducible from any folder: ``pdlb``, the
    subcommands, then the arguments as given but with abbreviated options spelled out
    (``--lim 5`` -> ``--limit 5``) and file paths made absolute (``--trace``, ``--out``, every
    ``type=Path`` option and positional, and ``--scenario``/``--prices`` values that are files
    rather than preset names), shell-quoted (:func:`shlex.join`).

    ``argv`` is what the parser was given (``sys.argv[1:]``); it has been parsed already, so it
    is well-formed.
    """
    out = ["pdlb"]
    toks = list(argv)
    i = 0
    while i < len(toks):  # the subcommands: the leading words naming a subparser
        sub = _subparser(parser, toks[i])
        if sub is None:
            break
        out.append(toks[i])
        parser, i = sub, i + 1
    positionals = [a for a in parser._actions if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]
    only_positionals = False
    while i < len(toks):
        tok = toks[i]
        i += 1
        if tok == "--":
            out.append(tok)
            only_positionals = True
            continue
        if tok.startswith("-") and tok in parser._option_string_actions and not tok.startswith("--") \
                and not only_positionals:  # a short option (-j 2)
            out.append(tok)
            if parser._option_string_actions[tok].nargs != 0 and i < len(toks):
                out.append(toks[i])
                i += 1
            continue
        if tok.startswith("--") and not only_positionals:
            name, eq, inline = tok.partition("=")
            name, action = _option(parser, name)
            if action is None or action.nargs == 0:
                out.append(name + eq + inline)
                continue
            if eq:
                value = inline
            elif i < len(toks):
                value, i = toks[i], i + 1
            else:
                out.append(name)
                continue
            if action.type is Path or action.dest in _PATH_DESTS:
                value = _abs(value, only_files=False)
            elif action.dest in _MAYBE_FILE_DESTS:
                value = _abs(value, only_files=True)
            out += [f"{name}={value}"] if eq else [name, value]
            continue
        if not tok.startswith("-") and positionals and positionals[0].type is Path:
            tok = _abs(tok, only_files=False)
        if positionals and not tok.startswith("-"):
            positionals.pop(0)
        out.append(tok)
    return shlex.join(out)


# ---------------------------------------------------------------------- flags without effect
def given_options(parser: argparse.ArgumentParser, argv: Sequence[str]) -> dict[str, str]:
    """``{dest: option as the user meant it}`` of the options given in ``argv`` (abbreviations
    spelled out), below the subcommand words; what :func:`warn_idle_flags` looks at."""
    toks = list(argv)
    i = 0
    while i < len(toks):
        sub = _subparser(parser, toks[i])
        if sub is None:
            break
        parser, i = sub, i + 1
    given: dict[str, str] = {}
    for tok in toks[i:]:
        if tok == "--":
            break
        if tok.startswith("-") and len(tok) > 1 and not tok[1].isdigit():
            name, action = _option(parser, tok.partition("=")[0])
            if action is not None:
                given.setdefault(action.dest, name)
    return given


def warn_idle_flags(args: argparse.Namespace, idle: Sequence[tuple[str, str]]) -> None:
    """Warn on stderr, once per flag, about each given flag that has no effect in this mode.

    Args:
        idle: ``(dest, why)`` of the flags that do nothing in the chosen mode, e.g.
            ``("rate_scale", "with --search rate: the search finds the rate")``; those the user
            did not give (:func:`given_options`, in ``args.given``) are passed over.
    """
    given = getattr(args, "given", {})
    warned: set[str] = getattr(args, "_idle_warned", set())
    for dest, why in idle:
        if dest in given and dest not in warned:
            warned.add(dest)
            print(f"warning: {given[dest]} has no effect {why}", file=sys.stderr)
    args._idle_warned = warned


def idle_tier_flags(scenario: Scenario) -> list[tuple[str, str]]:
    """The router tier flags, idle on a scenario without KV tiers (host tier, shared store)."""
    if scenario.has_kv_tiers:
        return []
    why = f"on scenario {scenario.name!r}: it has no KV tiers (host_tier, shared_store) for the router to weigh"
    return [("tier_weights", why), ("no_router_tiers", why)]


def budget_pools_all_wide_ep(scenario: Scenario) -> bool:
    """Whether every engine a TTFT budget would apply to (the prefill pools of a PD scenario, the
    mixed pool of an aggregated one) steps its DP ranks together (wide EP): ep_aware then routes
    SLO-blind unless its ``slo_wide_ep`` is set (:class:`balancer.policies.ep_aware.EpAware`)."""
    pools = [scenario.prefill, scenario.long_prefill] if scenario.disaggregated else [scenario.mixed]
    return all(build_perf(scenario, p).ep_synchronous for p in pools if p is not None)


def _ignores_budget_on_wide_ep(policy: typing.Any, wide_ep: bool) -> bool:
    return wide_ep and not getattr(policy, "slo_wide_ep", True)


def idle_slo_params(policy: typing.Any, route_slo: bool, wide_ep: bool = False) -> list[str]:
    """The ``slo_*`` parameters set away from their defaults on a policy that gets no TTFT budget
    (neither its own ``ttft_slo_s`` nor the router's: ``route_slo`` with ``slo_aware``) or ignores
    the one it gets (``wide_ep``: the pools are all wide EP, :func:`budget_pools_all_wide_ep`, and
    the policy has ``slo_wide_ep`` off, ep_aware's default; then its own ``ttft_slo_s`` and
    ``ttft_slo_per_1k_tokens_s`` are idle too): they change nothing."""
    if not dataclasses.is_dataclass(policy) or not hasattr(policy, "ttft_slo_s"):
        return []
    budget = policy.ttft_slo_s > 0 or (route_slo and getattr(policy, "slo_aware", True))
    if budget and not _ignores_budget_on_wide_ep(policy, wide_ep):
        return []
    own = ("ttft_slo_s", "ttft_slo_per_1k_tokens_s") if budget else ()
    return [f.name for f in dataclasses.fields(policy)
            if (f.name.startswith("slo_") and f.name != "slo_aware" or f.name in own)
            and getattr(policy, f.name) != f.default]


def warn_idle_slo_params(runs: Sequence[tuple[str, typing.Any, typing.Any]], route_slo: bool, fix: str,
                         wide_ep: bool = False) -> None:
    """Warn on stderr, once per run, about :func:`idle_slo_params` of its prefill or decode policy.

    Args:
        runs: ``(label, prefill policy, decode policy)`` (policy objects).
        route_slo: whether the router is told the SLO's TTFT budget.
        fix: how the user gives the policy a budget, e.g. ``"add --route-slo"``,
            ``"drop --no-route-slo"``.
        wide_ep: the pools a budget applies to are all wide EP (:func:`budget_pools_all_wide_ep`):
            a policy with ``slo_wide_ep`` off ignores its budget there, and the warning says to set it.
    """
    for label, p, d in runs:
        idle = list(dict.fromkeys(idle_slo_params(p, route_slo, wide_ep) + idle_slo_params(d, route_slo, wide_ep)))
        if not idle:
            continue
        verb = f"change{'s' if len(idle) == 1 else ''} nothing"
        wide = [x for x in (p, d) if _ignores_budget_on_wide_ep(x, wide_ep)]
        budget = any(x is not None and getattr(x, "ttft_slo_s", 0) > 0 for x in (p, d)) or (
            route_slo and any(getattr(x, "slo_aware", False) for x in (p, d)))
        if wide and budget:
            print(f"warning: {label}: {', '.join(idle)} {verb}: ep_aware routes SLO-blind where every engine is wide "
                  "EP, as here (slo_wide_ep=true to the policy routes against the TTFT budget there too)",
                  file=sys.stderr)
        elif wide:
            print(f"warning: {label}: {', '.join(idle)} {verb} without a TTFT budget to route against ({fix}, or "
                  "ttft_slo_s=S to the policy; and slo_wide_ep=true: every engine here is wide EP, where ep_aware "
                  "routes SLO-blind by default)", file=sys.stderr)
        else:
            print(f"warning: {label}: {', '.join(idle)} {verb} without a "
                  f"TTFT budget to route against ({fix}, or ttft_slo_s=S to the policy)", file=sys.stderr)


# ---------------------------------------------------------------------- run titles
def route_slo_note(route_slo: bool, runs: Sequence[tuple[str, Any, Any]], *, default: bool = False,
                   flag: str = "--route-slo", wide_ep: bool = False) -> str:
    """The note a results title carries on SLO routing (every command that titles runs uses it:
    ``sim run``/``compare``, ``sim capacity``, ``sim sweep``): which runs route against a TTFT
    budget, the router's (``route_slo`` and a policy with ``slo_aware``) or their own (a policy
    with ``ttft_slo_s`` > 0, which holds whatever ``route_slo`` says); the others ignore budgets.

    Args:
        route_slo: whether the router was told the SLO's TTFT budget.
        runs: ``(label, prefill policy, decode policy)`` per run; a policy is an object or a
            registered name.
        default: the command's default for ``route_slo`` (``sim run``: off, capacity searches
            and sweeps: on); the note names ``flag`` when the run departs from it and says
            nothing for SLO-blind runs where that is the default.
        flag: how the user departs from the default (``--route-slo``, ``--no-route-slo``,
            ``route_slo = false``).
        wide_ep: the pools a budget applies to are all wide EP (:func:`budget_pools_all_wide_ep`):
            runs whose policy ignores the budget there (ep_aware without ``slo_wide_ep``) are named
            SLO-blind, not as routed against it.

    Returns:
        ``""`` or ``", <note>"``, e.g. ``", routed against the TTFT SLO by ep_aware"``,
        ``", routed against the TTFT SLO by ep_aware; against their own TTFT budget:
        ep_aware(ttft_slo_s=2.0)"``,
        ``", routed SLO-blind (--no-route-slo) except against their own TTFT budget:
        ep_aware(ttft_slo_s=2.0)"``.
    """
    def pol(x: Any) -> Any:
        return make_policy(x) if isinstance(x, str) else x

    wide = {label for label, p, d in runs if any(_ignores_budget_on_wide_ep(pol(x), wide_ep) for x in (p, d))}
    own_all = [label for label, p, d in runs if any(getattr(pol(x), "ttft_slo_s", 0) > 0 for x in (p, d))]
    own = [label for label in own_all if label not in wide]
    blind_wide = "SLO-blind where every engine is wide EP (slo_wide_ep=false)"
    if route_slo:  # a policy's own budget takes precedence over the router's
        aware_all = [label for label, p, d in runs
                     if label not in own_all and any(getattr(pol(x), "slo_aware", False) for x in (p, d))]
        aware = [label for label in aware_all if label not in wide]
        ignored = [label for label in aware_all + own_all if label in wide]
        parts = ([f"routed against the TTFT SLO by {', '.join(aware)}"] if aware else []) + \
                ([f"{'' if aware else 'routed '}against their own TTFT budget: {', '.join(own)}"] if own else []) + \
                ([f"{'' if aware or own else 'routed '}{blind_wide}: {', '.join(ignored)}"] if ignored else [])
        if parts:
            return ", " + "; ".join(parts)
        return ", no policy here routes against the TTFT SLO" if default else \
            f", {flag}: no policy here routes against the SLO"
    ignored_own = [label for label in own_all if label in wide]
    wide_part = f"; {blind_wide}: {', '.join(ignored_own)}" if ignored_own else ""
    if not default:
        return (f", routed against their own TTFT budget: {', '.join(own)}" if own else "") + wide_part
    if own:
        return f", routed SLO-blind ({flag}) except against their own TTFT budget: {', '.join(own)}" + wide_part
    return f", routed SLO-blind ({flag})" + wide_part


# ---------------------------------------------------------------------- what the groups build
def scenario_from_args(args: argparse.Namespace) -> Scenario:
    """The scenario of the cluster options: the preset or file, then ``--set`` overrides in order,
    then the engine-count flags, then ``--exact``.

    Raises:
        ValueError: unknown scenario, a bad override, an engine flag for a pool the scenario lacks,
            a model that is neither a preset nor a readable, supported config.json.
    """
    sc = load_scenario(args.scenario)
    sc = apply_overrides(sc, getattr(args, "overrides", None) or [])
    sc = apply_engine_options(sc, args)
    counts = {"prefill": args.prefill_engines, "decode": args.decode_engines, "mixed": args.mixed_engines}
    for pool, n in counts.items():
        if n is not None and getattr(sc, pool) is None:
            shape = "PD (prefill + decode pools)" if sc.disaggregated else "aggregated (one mixed pool)"
            raise ValueError(f"--{pool}-engines: scenario {sc.name!r} has no {pool} pool; it is {shape}")
    sc = sc.with_pools(prefill_engines=args.prefill_engines, decode_engines=args.decode_engines,
                       mixed_engines=args.mixed_engines)
    if args.exact:
        sc = sc.model_copy(update={"fast_forward": False})
    try:  # an unknown preset or a bad config.json is reported before any header or progress bar
        get_model(sc.model)
    except FileNotFoundError as e:
        raise ValueError(f"model {sc.model!r}: {e.strerror}: {e.filename}" if e.strerror else str(e)) from None
    for role in ("prefill", "decode", "mixed"):  # a model that does not fit, also before any output
        pool = getattr(sc, role)
        if pool is not None:
            try:
                build_perf(sc, pool)
            except ValueError as e:
                hint = (f" (the scenario's {role}.gpus_per_rank, {role}.dp_ranks, hardware)"
                        if "does not fit" in str(e) else "")
                raise ValueError(f"{role} pool: {e}{hint}") from None
    return sc


def describe_scenario(sc: Scenario) -> str:
    """``"<name>: <description or pool shape> (<N> GPUs)"`` (rich markup), as ``pdlb sim scenarios``
    lists it and ``pdlb sim run`` heads its output."""
    return f"[bold]{escape(sc.name)}[/]: {escape(sc.description or describe_pools(sc))} ({sc.num_gpus} GPUs)"


# ---------------------------------------------------------------------- session workloads
DAY_S = 86400.0
#: SessionWorkloadConfig field -> the flag that sets it (error messages name the flag)
_FIELD_FLAGS = {"sessions_per_hour": "--sessions-per-hour", "agent_fraction": "--agent-fraction",
                "block_size": "--block-size", "duration_s": "--days", "seed": "--seed"}


def add_session_workload_args(p: argparse.ArgumentParser, days_default: float) -> None:
    """The session workload options of ``pdlb sim sessions`` and ``store-sweep`` (``--days`` ..., ``--config``)."""
    g = p.add_argument_group("session workload (see sim/workload/sessions.py for every parameter)")
    g.add_argument("--days", type=float, default=days_default, metavar="D",
                   help=f"simulated days of session starts (default {days_default:g})")
    g.add_argument("--sessions-per-hour", type=float, metavar="R", help="new sessions per hour, both classes (default 60)")
    g.add_argument("--agent-fraction", type=float, metavar="F", help="fraction of agent sessions (default 0.3)")
    g.add_argument("--block-size", type=int, metavar="TOKENS", help="tokens per KV block (default 512)")
    g.add_argument("--seed", type=seed_int, default=0, help="seed (default 0)")
    g.add_argument("--config", type=Path, metavar="FILE",
                   help="a SessionWorkloadConfig as .json/.toml/.yaml (flags above override its fields)")


def session_config(args: argparse.Namespace, days: float) -> SessionWorkloadConfig:
    """The SessionWorkloadConfig of ``--config`` with the flags applied.

    Raises:
        ValueError: one line; a bad value set by a flag names the flag
            (``"--agent-fraction: Input should be less than or equal to 1"``), one from
            ``--config`` names the file and field, as :func:`balancer.validation.format_validation_error`.
    """
    base = load_session_config(args.config) if args.config else SessionWorkloadConfig()
    upd: dict[str, Any] = {"duration_s": days * DAY_S, "seed": args.seed}
    for field in ("sessions_per_hour", "agent_fraction", "block_size"):
        v = getattr(args, field)
        if v is not None:
            upd[field] = v
    try:
        return SessionWorkloadConfig.model_validate(base.model_dump() | upd)
    except ValidationError as e:
        parts = []
        for err in e.errors():
            loc = tuple(err.get("loc", ()))
            field = str(loc[0]) if loc else ""
            msg = err.get("msg", "invalid").removeprefix("Value error, ")
            if field in upd and field in _FIELD_FLAGS:
                parts.append(f"{_FIELD_FLAGS[field]}: {msg}")
            else:  # a field of --config (already checked alone) or a check across fields
                if not loc:  # across fields: name the flags that set them, not the config fields
                    for name, flag in _FIELD_FLAGS.items():
                        msg = re.sub(rf"\b{name}\b", flag, msg)
                where = ".".join(str(x) for x in loc)
                text = f"{where}: {msg}" if where else msg
                parts.append(f"{args.config}: {text}" if args.config and field not in upd else text)
        raise ValueError("; ".join(parts)) from None
