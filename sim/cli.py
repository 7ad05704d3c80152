"""The ``pdlb`` command line.

    pdlb sim compare            every routing policy on the embedded Mooncake trace
    pdlb sim run --policy P     one policy
    pdlb sim scenarios          the scenario presets
    pdlb sim price              revenue per GPU-hour and cost per 1M tokens from a price sheet
    pdlb sim validate           the perf model vs published deployment figures
    pdlb sim sessions           generate a multi-turn chatbot/agent session workload (JSONL)
    pdlb sim store-sweep        shared KV store hit rate vs TTL and capacity (docs/kv_cache.md)
    pdlb sim capacity           highest rate at SLO / fewest engines at a rate, per policy (sim.capacity_cli)
    pdlb sim sweep SWEEP.toml   a resumable sweep of scenario fields, policies, rates, seeds (sim.sweep_cli)
    pdlb policies               the routing policies and their parameters

Bad arguments end in one error line and exit status 2, after one usage line that points at
``--help`` (:class:`sim.cli_args.ArgumentParser`): argparse's ``argument --flag: ...`` for
values checked while parsing (numbers, engine counts, tier weights), ``error: ...`` for the rest
(files, scenarios, policies). A closed stdout (``pdlb sim compare | head -1``) does not stop a
run: the results folder is still written and the exit status is 141 (128 + SIGPIPE). Ctrl-C prints
``interrupted`` on stderr and exits 130 (128 + SIGINT).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from balancer.config import PolicySpec
from balancer.policies import available_policies
from balancer.policies.base import policy_class
from balancer.router import PolicyError
from balancer.types import TtftSlo
from sim.cli_args import (  # noqa: F401  (positive_* and parse_tier_weights re-exported for callers of sim.cli)
    DEFAULT_INDEX_MODE,
    DEFAULT_SLO_TPOT_S,
    DEFAULT_SLO_TTFT_S,
    ArgumentParser,
    add_cluster_args,
    add_output_args,
    add_router_args,
    add_slo_args,
    add_workload_args,
    command_line,
    given_options,
    idle_tier_flags,
    nonnegative_float,
    parse_tier_weights,
    policy_list,
    positive_float,
    positive_int,
    route_slo_note,
    scenario_from_args,
    seed_int,
    default_results_dir,
    warn_idle_flags,
    warn_idle_slo_params,
)
from sim.scenario import PRESETS, Scenario, describe_pools, load_scenario

def _add_common(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    add_cluster_args(p)
    add_router_args(p)
    g = add_output_args(p)
    add_slo_args(g)
    g.add_argument("--seed", type=seed_int, default=0, help="seed of the router's RNG and of the arrival spreading (default 0)")


def _add_policy_module_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy-module", dest="policy_modules", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (e.g. mypkg.mypolicy) so that its @register-ed policies can be named "
                        "(repeatable)")


def _route_slo_note(args: argparse.Namespace, runs: list) -> str:
    """The table title's note on SLO routing (:func:`sim.cli_args.route_slo_note`) for
    ``_policy_runs``' ``(prefill, decode, prefill label, decode label)`` runs."""
    return route_slo_note(args.route_slo, [(plabel, p, d) for p, d, plabel, _ in runs])


def _policy_runs(args: argparse.Namespace, texts: list[tuple[str, str, str | None]]) -> list[tuple[Any, Any, str, str]]:
    """``[(flag, prefill spec, decode spec or None)]`` -> ``[(prefill policy, decode policy,
    prefill label, decode label)]``, every spec checked before anything runs (the policy spec
    form of :mod:`balancer.policies.spec`).

    Raises:
        ValueError: ``"<flag>: <problem>"`` (unknown policy, unknown parameter with the accepted
            ones, a bad value), or a policy module that does not import.
    """
    from sim.point import import_policy_modules

    import_policy_modules(args.policy_modules)

    def one(flag: str, text: str) -> tuple[Any, str]:
        try:
            spec = PolicySpec.parse(text)
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
        return spec.build(), spec.label

    out = []
    for flag, p, d in texts:
        prefill, plabel = one(flag, p)
        decode, dlabel = one("--decode-policy", d) if d is not None else one(flag, p)
        out.append((prefill, decode, plabel, dlabel))
    return out


def _version() -> str:
    try:
        return importlib.metadata.version("pdlb")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree without install
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="pdlb", description="Cross-replica load balancer for PD-disaggregated LLM serving, and its simulator.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("sim", help="simulate a cluster on a trace", description="Simulate prefill/decode pools on a request trace with pdlb's routing policies.")
    simsub = sim.add_subparsers(dest="sim_command", required=True)
    cmp_ = simsub.add_parser("compare", help="run several policies on the same workload and compare them",
                             description="Run each policy (for both the prefill and the decode pool) on the same workload "
                                         "and print a comparison table; writes per-request CSVs, summary.json and plots.")
    cmp_.add_argument("--policies", default=",".join(available_policies()), metavar="A,B:K=V,...",
                      help="comma-separated policies, each NAME or NAME:K=V[,K=V] (e.g. round_robin,"
                           "cache_aware:cache_threshold=0.5,balance_abs=8; see 'pdlb policies'; default: all: %(default)s)")
    cmp_.add_argument("--policy", dest="policy_specs", action="append", default=[], metavar="NAME[:K=V,...]",
                      help="a policy with parameters, e.g. --policy cache_aware:cache_threshold=0.5,balance_abs=8 "
                           "(repeatable; instead of --policies, not with it; as in 'pdlb sim capacity')")
    cmp_.add_argument("--decode-policy", metavar="NAME[:K=V,...]",
                      help="use this policy for the decode pool in every run (default: the run's policy)")
    _add_policy_module_arg(cmp_)
    _add_common(cmp_)
    from sim.host import default_jobs

    cmp_.add_argument("--jobs", "-j", type=positive_int, default=default_jobs(), metavar="N",
                      help="policies simulated at once, in local worker processes (default: this machine's cores, "
                           "%(default)s; 1 = one after another in this process)")
    run = simsub.add_parser("run", help="run one policy", description="Simulate one policy and print its summary.")
    run.add_argument("--policy", "--prefill-policy", dest="policy", default="ep_aware", metavar="NAME[:K=V,...]",
                     help="prefill (and decode) policy with optional parameters, e.g. "
                          "cache_aware:cache_threshold=0.5 (see 'pdlb policies'; default ep_aware)")
    run.add_argument("--decode-policy", metavar="NAME[:K=V,...]", help="decode-pool policy (default: --policy)")
    _add_policy_module_arg(run)
    _add_common(run)
    simsub.add_parser("scenarios", help="list scenario presets")
    from sim.validate import add_validate_parser
    add_validate_parser(simsub)
    from sim.pricing import add_price_parser
    add_price_parser(simsub)
    from sim.experiments.cli import add_session_parsers
    add_session_parsers(simsub)
    from sim.workload.generate_cli import add_workload_parser
    add_workload_parser(simsub)
    from sim.cost_model_cli import add_cost_model_parser
    add_cost_model_parser(simsub)
    from sim.capacity_cli import add_capacity_parser
    add_capacity_parser(simsub)
    from sim.sweep_cli import add_sweep_parser
    add_sweep_parser(simsub)

    sub.add_parser("policies", help="list routing policies and their parameters",
                   description="List every registered routing policy with its parameters and their defaults. "
                               "Any flag or config entry that names a policy takes them as NAME:K=V[,K=V], "
                               "e.g. --policy ep_aware:horizon_weight=2; each policy's docstring "
                               "(balancer/policies/) explains its parameters.")
    from balancer.service.cli import add_serve_parser
    from sim.emulator.cli import add_engine_parser
    add_serve_parser(sub)
    add_engine_parser(sub)
    return parser


def _load_workload(args: argparse.Namespace) -> tuple[list, dict[str, Any]]:
    from sim.workload.loader import read_trace_cut

    # limit, spread, rate scale, then --duration-s in simulated time (the order of sim.point.WorkloadSpec too)
    requests, fmt = read_trace_cut(args.trace, args.format, limit=args.limit, spread_s=args.spread_s, seed=args.seed,
                                   rate_scale=args.rate_scale, duration_s=args.duration_s)
    meta = {
        "trace": os.path.abspath(args.trace) if args.trace else "embedded:mooncake_conversation.jsonl.gz",
        "format": fmt,
        "rate_scale": args.rate_scale,
        "limit": args.limit,
        "duration_s": args.duration_s,
        "spread_s": args.spread_s,
        "num_requests": len(requests),
    }
    return requests, meta


def _scenario(args: argparse.Namespace) -> Scenario:
    return scenario_from_args(args)


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


def _run_many(args: argparse.Namespace, runs: list[tuple[Any, Any, str, str]], console: Console) -> int:
    from sim.cluster import simulate
    from sim.metrics import summarize
    from sim.report import (
        goodput_note,
        kv_tier_table,
        markdown_table,
        nothing_simulated,
        rejection_line,
        summary_table,
        write_results,
    )
    from sim.workload import ideal_hit_rate

    scenario = _scenario(args)
    if args.out is not None:
        _check_writable_dir(args.out)
    idle = idle_tier_flags(scenario)
    if args.sim_command == "run" and not scenario.disaggregated and args.decode_policy is not None:
        idle.append(("policy", f"with --decode-policy on the aggregated scenario {scenario.name!r}: its one mixed "
                               "pool is routed by the decode policy"))
    warn_idle_flags(args, idle)
    warn_idle_slo_params([(plabel, p, d) for p, d, plabel, _ in runs], args.route_slo, "add --route-slo")
    requests, meta = _load_workload(args)
    from sim.admission import check_block_size
    check_block_size(requests, scenario.block_size, f"--trace {meta['trace']}")  # before any simulation
    span = requests[-1].arrival_time_s - requests[0].arrival_time_s
    ideal = ideal_hit_rate(requests, scenario.block_size)[1]
    if not args.quiet:
        console.print(_describe(scenario))
        console.print(f"workload: {meta['trace']}, {len(requests)} requests over {span:.0f} s "
                      f"(rate x{args.rate_scale}), ideal prefix hit rate {100 * ideal:.1f}% of prompt tokens")
    results, summaries = [], []
    t0 = time.perf_counter()
    sim_kw = dict(seed=args.seed, index_mode=args.index_mode, router_tiers=not args.no_router_tiers,
                  tier_weights=args.tier_weights, ttft_slo=TtftSlo(args.slo_ttft_s) if args.route_slo else None)
    jobs = min(getattr(args, "jobs", 1), len(runs))
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=args.quiet, transient=False) as progress:
        tasks = [progress.add_task(f"{(pl if pl == dl else f'{pl}+{dl}'):<28}", total=len(requests))
                 for _, _, pl, dl in runs]
        if jobs > 1:  # policies in parallel (was one at a time: 72% of one core)
            from sim.parallel_runs import simulate_in_parallel

            # starting a worker flushes sys.stdout (multiprocessing), which raises once stdout's reader
            # went away ('| head -1'): flushes go to the console's pipe-safe file meanwhile
            with contextlib.redirect_stdout(console.file):
                done = simulate_in_parallel(scenario, requests, [(p, d) for p, d, _, _ in runs], sim_kw, jobs,
                                            args.policy_modules,
                                            lambda i, n: progress.update(tasks[i], completed=n))
        else:
            done = [simulate(scenario, requests, p, d, **sim_kw,
                             progress=lambda n, total, task=task: progress.update(task, completed=n))
                    for (p, d, _, _), task in zip(runs, tasks)]
        for res, (_, _, plabel, dlabel), task in zip(done, runs, tasks):
            progress.update(task, completed=len(requests))
            res.prefill_policy, res.decode_policy = plabel, dlabel  # with parameters: "name(k=v)"
            results.append(res)
            summaries.append(summarize(res, slo_ttft_s=args.slo_ttft_s, slo_tpot_s=args.slo_tpot_s))
    wall = time.perf_counter() - t0
    index = "" if args.index_mode == DEFAULT_INDEX_MODE else f", --index-mode {args.index_mode}"
    none_simulated = all(nothing_simulated(s) for s in summaries)
    if not none_simulated:  # else a table of '-' only: the rejection lines below say it all
        console.print(summary_table(summaries, title=f"{scenario.name}: {len(requests)} requests, "
                                    f"SLO TTFT<={args.slo_ttft_s}s TPOT<={1e3 * args.slo_tpot_s:.0f}ms{index}"
                                    f"{_route_slo_note(args, runs)}"))
        kv = kv_tier_table(summaries)
        if kv is not None:
            console.print(kv)
    for smry in summaries:
        line = rejection_line(smry, scenario.effective_max_model_len)
        if line:
            console.print(f"[red]{escape(line)}[/]" if nothing_simulated(smry) else escape(line), soft_wrap=True)
    note = next((n for n in map(goodput_note, summaries) if n), "")  # the arrivals are every run's
    if note:
        console.print(escape(note), soft_wrap=True)
    console.print(f"ideal (infinite cache) prefix hit rate: {100 * ideal:.1f}% of prompt tokens   "
                  f"simulated in {wall:.1f} s")
    out = args.out or default_results_dir(scenario.name)
    meta |= {"command": args.command_line, "wall_s": wall, "route_slo": args.route_slo}
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
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.command_line = command_line(parser, args.argv)  # for reports: the command that made them
    args.given = given_options(parser, args.argv)  # the flags given, for warn_idle_flags
    console = Console(file=out) if out.isatty() else Console(file=out, width=160)
    if args.command in ("serve", "engine"):
        from balancer.service.cli import run_serve
        from sim.emulator.cli import run_engine
        return run_serve(args) if args.command == "serve" else run_engine(args)
    try:
        if args.command == "policies":
            for name in available_policies():
                cls = policy_class(name)
                params = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls))
                doc = next(iter((sys.modules[cls.__module__].__doc__ or cls.__doc__ or "").strip().splitlines()), "")
                console.print(f"[bold]{name}[/]({escape(params)})\n    {escape(doc.replace('``', ''))}",
                              soft_wrap=True)  # one line per signature, for grep
            console.print("parameters on any policy flag or config: NAME:K=V[,K=V], e.g. "
                          "--policy cache_aware:cache_threshold=0.5,balance_abs=8")
            return 0
        if args.command == "sim":
            if args.sim_command == "validate":
                from sim.validate import run_validate
                return run_validate(args, console)
            if args.sim_command == "workload":
                from sim.workload.generate_cli import run_workload
                return run_workload(args, console)
            if args.sim_command == "cost-model":
                from sim.cost_model_cli import run_cost_model
                return run_cost_model(args, console)
            if args.sim_command == "price":
                from sim.pricing import run_price
                return run_price(args, console)
            if args.sim_command in ("sessions", "store-sweep"):
                from sim.experiments.cli import run_session_command
                return run_session_command(args, console)
            if getattr(args, "run", None) is not None:  # commands in their own modules (capacity, sweep)
                return args.run(args, console)
            if args.sim_command == "scenarios":
                for name, sc in sorted(PRESETS.items()):
                    console.print(_describe(sc))
                return 0
            if args.sim_command == "compare":
                if args.policy_specs and "policies" in args.given:  # was: --policies silently dropped
                    raise ValueError("--policy and --policies both given: --policy replaces the list, so --policies would be ignored; give one (repeat --policy for several)")
                flag = "--policy" if args.policy_specs else "--policies"
                names = list(args.policy_specs) or policy_list(args.policies)
                if args.decode_policy and not load_scenario(args.scenario).disaggregated:
                    raise ValueError(f"--decode-policy: scenario {args.scenario!r} is aggregated (one mixed pool, "
                                     "routed by the decode policy): every run would use "
                                     f"{args.decode_policy}; compare with --policies instead")
                runs = _policy_runs(args, [(flag, p, args.decode_policy) for p in names])
                seen: dict[str, str] = {}  # same policies and parameters (defaults spelled out or not)
                for p, d, plabel, _ in runs:
                    key = repr((p.name, sorted(p.params().items()), d.name, sorted(d.params().items())))
                    if key in seen:
                        same = "" if seen[key] == plabel else f" (the same policy as {seen[key]})"
                        raise ValueError(f"{flag}: {plabel} given more than once{same}")
                    seen[key] = plabel
                return _run_many(args, runs, console)
            if args.sim_command == "run":
                return _run_many(args, _policy_runs(args, [("--policy", args.policy, args.decode_policy)]), console)
    except (ValueError, OSError, PolicyError) as e:  # one line on stderr, however long; no traceback
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    parser.error("unknown command")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
