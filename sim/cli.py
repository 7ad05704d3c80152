"""The ``pdlb`` command line.

    pdlb sim compare            every routing policy on the embedded Mooncake trace
    pdlb sim run --policy P     one policy
    pdlb sim scenarios          the scenario presets
    pdlb sim price              revenue per GPU-hour and cost per 1M tokens from a price sheet
    pdlb sim validate           the perf model vs published deployment figures
    pdlb sim sessions           generate a multi-turn chatbot/agent session workload (JSONL)
    pdlb sim store-sweep        shared KV store hit rate vs TTL and capacity (docs/kv_cache.md)
    pdlb policies               the routing policies and their parameters

Bad arguments end in one error line and exit status 2: argparse's ``argument --flag: ...`` for
values checked while parsing (numbers, engine counts, tier weights), ``error: ...`` for the rest
(files, scenarios, policies). A closed stdout (``pdlb sim compare | head -1``) does not stop a
run: the results folder is still written and the exit status is 141 (128 + SIGPIPE). Ctrl-C prints
``interrupted`` on stderr and exits 130 (128 + SIGINT).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from balancer.policies import available_policies, make_policy
from balancer.policies.base import _REGISTRY
from balancer.router import DEFAULT_TIER_WEIGHTS
from sim.scenario import DEFAULT_PRESET, PRESETS, Scenario, describe_pools, load_scenario

DEFAULT_SLO_TTFT_S = 2.0
DEFAULT_SLO_TPOT_S = 0.1
DEFAULT_INDEX_MODE = "approximate"


# argparse ``type=`` checks: a bad value stops the parser with "argument --flag: <message>", exit 2
def positive_int(text: str) -> int:
    """An int >= 1 (request counts, engine counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _float_checked(text: str, *, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if allow_zero else '>'} 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0 (rate factor, durations, SLOs)."""
    return _float_checked(text, allow_zero=False)


def nonnegative_float(text: str) -> float:
    """A finite float >= 0 (``--spread-s``: 0 keeps the batches)."""
    return _float_checked(text, allow_zero=True)


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


def _tier_weights_arg(text: str) -> dict[str, float] | None:
    try:
        return parse_tier_weights(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--tier-weights: ")) from None


def _add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", metavar="PATH", help="trace file (default: the embedded Mooncake conversation trace)")
    g.add_argument("--format", default="auto", choices=["auto", "mooncake", "azure"],
                   help="trace format (default: by extension: .jsonl[.gz] mooncake, .csv azure)")
    g.add_argument("--rate-scale", type=positive_float, default=1.0, metavar="F",
                   help="multiply the arrival rate by F (divides arrival times; default 1)")
    g.add_argument("--limit", type=positive_int, metavar="N", help="use only the first N requests")
    g.add_argument("--duration-s", type=positive_float, metavar="S", help="use only requests arriving in the first S seconds (after rate scaling)")
    g.add_argument("--spread-s", type=nonnegative_float, default=3.0, metavar="S",
                   help="move every request of a timestamp group (requests sharing an arrival time, and lone "
                        "ones too) to a uniform time in [t, t + S) (Mooncake logs arrivals in ~3 s batches; 0 keeps "
                        "the batches; default 3); order within a group is kept, but requests of neighbouring "
                        "groups may swap, so two turns of one session can reorder")
    g = p.add_argument_group("cluster")
    g.add_argument("--scenario", default=DEFAULT_PRESET, metavar="NAME|FILE",
                   help=f"scenario preset ({', '.join(sorted(PRESETS))}) or a .toml/.yaml/.json file (default {DEFAULT_PRESET})")
    g.add_argument("--prefill-engines", type=positive_int, metavar="N", help="override the number of prefill engines")
    g.add_argument("--decode-engines", type=positive_int, metavar="N", help="override the number of decode engines")
    g.add_argument("--mixed-engines", type=positive_int, metavar="N",
                   help="override the number of mixed (aggregated) engines")
    g.add_argument("--exact", action="store_true", help="step-by-step decode (reference mode; slower, same results)")
    g = p.add_argument_group("router")
    g.add_argument("--index-mode", default=DEFAULT_INDEX_MODE, choices=["approximate", "events"],
                   help="prefix index: 'approximate' records routed prompts (SGLang, llm-d); 'events' trusts only the "
                        "simulated engines' KV events (Dynamo) (default approximate)")
    g.add_argument("--tier-weights", type=_tier_weights_arg, metavar="host=W,store=W",
                   help="weights of host-tier and shared-store prefix hits relative to HBM hits, each in [0, 1], when "
                        "the scenario has KV tiers (default host=0.75,store=0.5)")
    g.add_argument("--no-router-tiers", action="store_true",
                   help="with KV tiers configured, let the router see only HBM prefix matches")
    g = p.add_argument_group("metrics and output")
    g.add_argument("--slo-ttft-s", type=positive_float, default=DEFAULT_SLO_TTFT_S, metavar="S",
                   help=f"TTFT SLO in seconds for goodput (default {DEFAULT_SLO_TTFT_S})")
    g.add_argument("--slo-tpot-s", type=positive_float, default=DEFAULT_SLO_TPOT_S, metavar="S",
                   help=f"TPOT SLO in seconds for goodput (default {DEFAULT_SLO_TPOT_S})")
    g.add_argument("--seed", type=int, default=0, help="seed of the router's RNG and of the arrival spreading (default 0)")
    g.add_argument("--out", type=Path, metavar="DIR",
                   help="results folder; an existing DIR is reused and the files of this run overwrite those of "
                        "the same name (default results/<scenario>-<YYYYmmdd-HHMMSS>, with -2, -3, ... appended "
                        "when that folder exists)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


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
    for part in text.split(","):
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
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"--tier-weights: {name} weight must be in [0, 1], got {value.strip()}")
        out[name] = weight
    return out


def _version() -> str:
    try:
        return importlib.metadata.version("pdlb")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree without install
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdlb", description="Cross-replica load balancer for PD-disaggregated LLM serving, and its simulator.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("sim", help="simulate a cluster on a trace", description="Simulate prefill/decode pools on a request trace with pdlb's routing policies.")
    simsub = sim.add_subparsers(dest="sim_command", required=True)
    cmp_ = simsub.add_parser("compare", help="run several policies on the same workload and compare them",
                             description="Run each policy (for both the prefill and the decode pool) on the same workload "
                                         "and print a comparison table; writes per-request CSVs, summary.json and plots.")
    cmp_.add_argument("--policies", default=",".join(available_policies()), metavar="A,B,...",
                      help="comma-separated policies (default: all: %(default)s)")
    cmp_.add_argument("--decode-policy", choices=available_policies(),
                      help="use this policy for the decode pool in every run (default: the run's policy)")
    _add_common(cmp_)
    run = simsub.add_parser("run", help="run one policy", description="Simulate one policy and print its summary.")
    run.add_argument("--policy", default="cache_aware", choices=available_policies(), help="prefill (and decode) policy (default cache_aware)")
    run.add_argument("--decode-policy", choices=available_policies(), help="decode-pool policy (default: --policy)")
    _add_common(run)
    simsub.add_parser("scenarios", help="list scenario presets")
    from sim.validate import add_validate_parser
    add_validate_parser(simsub)
    from sim.pricing import add_price_parser
    add_price_parser(simsub)
    from sim.experiments.cli import add_session_parsers
    add_session_parsers(simsub)

    sub.add_parser("policies", help="list routing policies and their parameters")
    from balancer.service.cli import add_serve_parser
    from sim.emulator.cli import add_engine_parser
    add_serve_parser(sub)
    add_engine_parser(sub)
    return parser


def _load_workload(args: argparse.Namespace) -> tuple[list, dict[str, Any]]:
    from sim.workload import read_trace, scale_rate, spread_batches, take_slice
    from sim.workload.loader import TRACE_EXTENSIONS, detect_trace_format

    fmt = args.format
    if args.trace is None and fmt == "azure":
        raise ValueError("--format azure needs --trace (the embedded trace is in mooncake format)")
    if fmt == "auto":
        try:
            fmt = detect_trace_format(args.trace) if args.trace else "mooncake"
        except ValueError:
            raise ValueError(f"--trace {args.trace}: cannot infer the trace format from the file extension "
                             f"(known: {', '.join(TRACE_EXTENSIONS)}); pass --format mooncake or --format azure") from None
    requests = read_trace(args.trace, fmt)
    if not requests:
        raise ValueError(f"--trace {args.trace}: the trace has no requests")
    if args.limit is not None:
        requests = take_slice(requests, 0, args.limit)
    if args.spread_s > 0:
        requests = spread_batches(requests, args.spread_s, seed=args.seed)
    if args.rate_scale != 1.0:
        requests = scale_rate(requests, args.rate_scale)
    if args.duration_s is not None:
        requests = take_slice(requests, duration_s=args.duration_s)
    meta = {
        "trace": args.trace or "embedded:mooncake_conversation.jsonl.gz",
        "format": fmt,
        "rate_scale": args.rate_scale,
        "limit": args.limit,
        "duration_s": args.duration_s,
        "spread_s": args.spread_s,
        "num_requests": len(requests),
    }
    return requests, meta


def _scenario(args: argparse.Namespace) -> Scenario:
    sc = load_scenario(args.scenario)
    counts = {"prefill": args.prefill_engines, "decode": args.decode_engines, "mixed": args.mixed_engines}
    for pool, n in counts.items():
        if n is not None and getattr(sc, pool) is None:
            shape = "PD (prefill + decode pools)" if sc.disaggregated else "aggregated (one mixed pool)"
            raise ValueError(f"--{pool}-engines: scenario {sc.name!r} has no {pool} pool; it is {shape}")
    sc = sc.with_pools(prefill_engines=args.prefill_engines, decode_engines=args.decode_engines,
                       mixed_engines=args.mixed_engines)
    if args.exact:
        sc = sc.model_copy(update={"fast_forward": False})
    return sc


def _check_writable_dir(out: Path) -> None:
    """Fail before any work if ``--out`` cannot hold the results (a file, or not writable)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file, not a directory")
    probe_dir = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    if not probe_dir.is_dir():
        raise ValueError(f"--out {out}: {probe_dir} is not a directory")
    if not os.access(probe_dir, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: {probe_dir} is not writable")


def _describe(sc: Scenario) -> str:
    """``"<name>: <description or pool shape> (<N> GPUs)"`` (rich markup)."""
    return f"[bold]{escape(sc.name)}[/]: {escape(sc.description or describe_pools(sc))} ({sc.num_gpus} GPUs)"


def _run_many(args: argparse.Namespace, runs: list[tuple[str, str]], console: Console) -> int:
    from sim.cluster import simulate
    from sim.metrics import summarize
    from sim.report import kv_tier_table, markdown_table, summary_table, write_results
    from sim.workload import ideal_hit_rate

    scenario = _scenario(args)
    if args.out is not None:
        _check_writable_dir(args.out)
    for p, d in runs:  # fail fast on bad names before loading or simulating anything
        make_policy(p), make_policy(d)
    requests, meta = _load_workload(args)
    from sim.admission import check_block_size
    check_block_size(requests, scenario.block_size, f"--trace {meta['trace']}")  # before any simulation
    span = requests[-1].arrival_time_s - requests[0].arrival_time_s
    ideal = ideal_hit_rate(requests, scenario.block_size)[1]
    if not args.quiet:
        console.print(_describe(scenario))
        console.print(f"workload: {meta['trace']}, {len(requests)} requests over {span:.0f} s "
                      f"(rate x{args.rate_scale}), ideal prefix hit rate {100 * ideal:.1f}%")
    results, summaries = [], []
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=args.quiet, transient=False) as progress:
        for p, d in runs:
            label = p if p == d else f"{p}+{d}"
            task = progress.add_task(f"{label:<28}", total=len(requests))
            res = simulate(scenario, requests, p, d, seed=args.seed, index_mode=args.index_mode,
                           router_tiers=not args.no_router_tiers, tier_weights=args.tier_weights,
                           progress=lambda done, total, task=task: progress.update(task, completed=done))
            results.append(res)
            summaries.append(summarize(res, slo_ttft_s=args.slo_ttft_s, slo_tpot_s=args.slo_tpot_s))
    wall = time.perf_counter() - t0
    index = "" if args.index_mode == DEFAULT_INDEX_MODE else f", --index-mode {args.index_mode}"
    console.print(summary_table(summaries, title=f"{scenario.name}: {len(requests)} requests, "
                                f"SLO TTFT<={args.slo_ttft_s}s TPOT<={1e3 * args.slo_tpot_s:.0f}ms{index}"))
    kv = kv_tier_table(summaries)
    if kv is not None:
        console.print(kv)
    for smry in summaries:
        if smry["num_rejected"]:
            why = ", ".join(f"{n} over {r}" for r, n in sorted(smry["rejected"].items()))
            console.print(f"{smry['policy']}: {smry['num_rejected']} requests rejected at arrival ({why}; "
                          f"max_model_len {scenario.effective_max_model_len}), not simulated")
    console.print(f"ideal (infinite cache) prefix hit rate: {100 * ideal:.1f}%   "
                  f"simulated in {wall:.1f} s")
    out = args.out or unique_results_dir(Path("results") / f"{scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    meta |= {"command": " ".join(sys.argv), "wall_s": wall}
    files = write_results(out, results, summaries, meta, plots=not args.no_plots)
    (out / "summary.md").write_text(markdown_table(summaries) + "\n")
    files.append(out / "summary.md")
    console.print(f"results: {out}/ ({', '.join(f.name for f in files[:1])}, {len(files) - 1} more)")
    return 0


class _PipeSafeStdout:
    """The console's file: the ``sys.stdout`` of when it was made (pytest's capture included; not
    rich's own redirect of ``sys.stdout`` during a live progress bar, which prints through the
    console and would loop), until the reader goes away (``pdlb sim compare | head -1``); from then
    on output is dropped, so the run still finishes and writes its results folder.

    On the first ``BrokenPipeError`` the stdout file descriptor is pointed at ``os.devnull``, the
    recipe of the Python docs (``signal`` module, "Note on SIGPIPE"), so the interpreter's final
    flush of what is still buffered does not raise again at exit.
    """

    def __init__(self) -> None:
        self.stream = sys.stdout
        self.broken = False

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", None) or "utf-8"

    def isatty(self) -> bool:
        return not self.broken and self.stream.isatty()

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                self.stream.write(text)
            except BrokenPipeError:
                self.close_pipe()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self.close_pipe()

    def close_pipe(self) -> None:
        self.broken = True
        try:
            fd = self.stream.fileno()
        except (AttributeError, OSError, ValueError):  # not a real file (pytest capture)
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)


#: Exit status after stdout's reader went away: 128 + SIGPIPE, what a shell reports for a
#: process killed by SIGPIPE (``set -o pipefail`` sees it).
EXIT_BROKEN_PIPE = 141
#: Exit status after Ctrl-C: 128 + SIGINT, what a shell reports for a process killed by SIGINT.
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    """Run the ``pdlb`` command line; returns the exit status (argparse exits 2 itself on bad flags)."""
    out = _PipeSafeStdout()
    try:
        rc = _main(argv, out)
    except BrokenPipeError:  # raised outside the console (argparse --help into a closed pipe)
        out.close_pipe()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:  # Ctrl-C, often deep inside simpy: one line, not a traceback
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_BROKEN_PIPE if out.broken and rc == 0 else rc


def _main(argv: list[str] | None, out: _PipeSafeStdout) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console(file=out) if out.isatty() else Console(file=out, width=160)
    if args.command in ("serve", "engine"):
        from balancer.service.cli import run_serve
        from sim.emulator.cli import run_engine
        return run_serve(args) if args.command == "serve" else run_engine(args)
    try:
        if args.command == "policies":
            for name in available_policies():
                cls = _REGISTRY[name]
                params = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls))
                doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
                console.print(f"[bold]{name}[/]({escape(params)})\n    {escape(doc.replace('``', ''))}")
            return 0
        if args.command == "sim":
            if args.sim_command == "validate":
                from sim.validate import run_validate
                return run_validate(args, console)
            if args.sim_command == "price":
                from sim.pricing import run_price
                return run_price(args, console)
            if args.sim_command in ("sessions", "store-sweep"):
                from sim.experiments.cli import run_session_command
                return run_session_command(args, console)
            if args.sim_command == "scenarios":
                for name, sc in sorted(PRESETS.items()):
                    console.print(_describe(sc))
                return 0
            if args.sim_command == "compare":
                names = [p.strip() for p in args.policies.split(",") if p.strip()]
                if not names:
                    raise ValueError("--policies: give at least one policy")
                if len(set(names)) != len(names):
                    dup = sorted({n for n in names if names.count(n) > 1})
                    raise ValueError(f"--policies: {', '.join(dup)} given more than once")
                if args.decode_policy and not load_scenario(args.scenario).disaggregated:
                    raise ValueError(f"--decode-policy: scenario {args.scenario!r} is aggregated (one mixed pool, "
                                     "routed by the decode policy): every run would use "
                                     f"{args.decode_policy}; compare with --policies instead")
                runs = [(p, args.decode_policy or p) for p in names]
                return _run_many(args, runs, console)
            if args.sim_command == "run":
                return _run_many(args, [(args.policy, args.decode_policy or args.policy)], console)
    except (ValueError, OSError) as e:  # one line on stderr, however long; no traceback
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    parser.error("unknown command")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
