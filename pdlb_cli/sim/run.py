"""``pdlb sim run``: simulate one policy (prefill and decode pools) and print its summary; and the
machinery ``pdlb sim compare`` shares with it (:func:`run_policies`).

    pdlb sim run --policy ep_aware --limit 2000
    pdlb sim run --policy cache_aware:cache_threshold=0.5 --decode-policy least_load
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from balancer.config import PolicySpec
from balancer.deadline_admission import wait_model_warning
from balancer.types import TtftSlo
from pdlb_cli.admission_args import add_admission_args, admission_from_args
from pdlb_cli.args import (
    DEFAULT_INDEX_MODE,
    add_cluster_args,
    add_output_args,
    add_router_args,
    add_slo_args,
    add_workload_args,
    default_results_dir,
    describe_scenario,
    idle_tier_flags,
    route_slo_note,
    scenario_from_args,
    seed_int,
    warn_idle_flags,
    budget_pools_all_wide_ep,
    warn_idle_slo_params,
)
from sim.run import cluster  # called as cluster.simulate: a test stands in for it there
from sim.run.admission import check_block_size
from sim.run.deadline_gate import admission_line
from sim.run.idle_options import idle_option_warnings
from sim.run.metrics import summarize
from sim.search.parallel_runs import simulate_in_parallel
from sim.search.point import import_policy_modules
from sim.run.report import (
    goodput_note,
    kv_tier_table,
    markdown_table,
    nothing_simulated,
    rejection_line,
    summary_table,
    write_results,
)
from sim.workload import ideal_hit_rate
from sim.workload.loader import read_trace_cut


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The workload, cluster, router, output and SLO options and ``--seed`` of ``pdlb sim run`` and ``compare``."""
    add_workload_args(p)
    add_cluster_args(p)
    add_router_args(p)
    g = add_output_args(p)
    add_slo_args(g)
    g.add_argument("--seed", type=seed_int, default=0, help="seed of the router's RNG and of the arrival spreading (default 0)")
    add_admission_args(p, serve=False)


def add_policy_module_arg(p: argparse.ArgumentParser) -> None:
    """``--policy-module MODULE`` (repeatable): modules imported first, for their ``@register``-ed policies."""
    p.add_argument("--policy-module", dest="policy_modules", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (e.g. mypkg.mypolicy) so that its @register-ed policies can be named "
                        "(repeatable)")


def runs_slo_note(args: argparse.Namespace, runs: list, wide_ep: bool = False) -> str:
    """The table title's note on SLO routing (:func:`pdlb_cli.args.route_slo_note`) for
    ``policy_runs``' ``(prefill, decode, prefill label, decode label)`` runs (``wide_ep``: the
    scenario's budget pools are all wide EP)."""
    return route_slo_note(args.route_slo, [(plabel, p, d) for p, d, plabel, _ in runs], wide_ep=wide_ep)


def policy_runs(args: argparse.Namespace, texts: list[tuple[str, str, str | None]]) -> list[tuple[Any, Any, str, str]]:
    """``[(flag, prefill spec, decode spec or None)]`` -> ``[(prefill policy, decode policy,
    prefill label, decode label)]``, every spec checked before anything runs (the policy spec
    form of :mod:`balancer.policies.spec`).

    Raises:
        ValueError: ``"<flag>: <problem>"`` (unknown policy, unknown parameter with the accepted
            ones, a bad value), or a policy module that does not import.
    """
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


def _load_workload(args: argparse.Namespace) -> tuple[list, dict[str, Any]]:
    # limit, spread, rate scale, then --duration-s in simulated time (the order of sim.search.point.WorkloadSpec too)
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


def _check_writable_dir(out: Path) -> None:
    """Fail before any work if ``--out`` cannot hold the results (a file, or not writable)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file, not a directory")
    probe_dir = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    if not probe_dir.is_dir():
        raise ValueError(f"--out {out}: {probe_dir} is not a directory")
    if not os.access(probe_dir, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: {probe_dir} is not writable")


def run_policies(args: argparse.Namespace, runs: list[tuple[Any, Any, str, str]], console: Console) -> int:
    """Simulate each ``(prefill policy, decode policy, prefill label, decode label)`` of ``runs``
    (from :func:`policy_runs`) on the workload and scenario of ``args`` (the options of
    :func:`add_run_options`), print the comparison table and write the results folder
    (per-request CSVs, ``summary.json``, ``summary.md``, plots). Returns 0.

    Raises:
        ValueError: a bad scenario, trace, ``--out`` or block size, before any simulation.
    """
    scenario = scenario_from_args(args)
    if args.out is not None:
        _check_writable_dir(args.out)
    idle = idle_tier_flags(scenario)
    if args.sim_command == "run" and not scenario.disaggregated and args.decode_policy is not None:
        idle.append(("policy", f"with --decode-policy on the aggregated scenario {scenario.name!r}: its one mixed "
                               "pool is routed by the decode policy"))
    warn_idle_flags(args, idle)
    warn_idle_slo_params([(plabel, p, d) for p, d, plabel, _ in runs], args.route_slo, "add --route-slo",
                         budget_pools_all_wide_ep(scenario))
    for line in idle_option_warnings([(plabel, dlabel, p, d) for p, d, plabel, dlabel in runs], [scenario]):
        print(line, file=sys.stderr)
    requests, meta = _load_workload(args)
    check_block_size(requests, scenario.block_size, f"--trace {meta['trace']}")  # before any simulation
    span = requests[-1].arrival_time_s - requests[0].arrival_time_s
    ideal = ideal_hit_rate(requests, scenario.block_size)[1]
    if not args.quiet:
        console.print(describe_scenario(scenario))
        console.print(f"workload: {meta['trace']}, {len(requests)} requests over {span:.0f} s "
                      f"(rate x{args.rate_scale}), ideal prefix hit rate {100 * ideal:.1f}% of prompt tokens")
    results, summaries = [], []
    t0 = time.perf_counter()
    sim_kw = dict(seed=args.seed, index_mode=args.index_mode, router_tiers=not args.no_router_tiers,
                  tier_weights=args.tier_weights, ttft_slo=TtftSlo(args.slo_ttft_s) if args.route_slo else None)
    adm_cfg = admission_from_args(args)
    if adm_cfg is not None:
        sim_kw["admission"] = adm_cfg
        for p, d, plabel, dlabel in runs:  # one line per run whose policies predict nothing
            line = wait_model_warning(adm_cfg.wait_model, {"prefill": p, "decode": d} if plabel != dlabel
                                      else {"policy": d})
            if line is not None:
                print(line, file=sys.stderr)
    jobs = min(getattr(args, "jobs", 1), len(runs))
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=args.quiet, transient=False) as progress:
        tasks = [progress.add_task(f"{(pl if pl == dl else f'{pl}+{dl}'):<28}", total=len(requests))
                 for _, _, pl, dl in runs]
        if jobs > 1:  # policies in parallel, one worker process each
            # starting a worker flushes sys.stdout (multiprocessing), which raises once stdout's reader
            # went away ('| head -1'): flushes go to the console's pipe-safe file meanwhile
            with contextlib.redirect_stdout(console.file):
                done = simulate_in_parallel(scenario, requests, [(p, d) for p, d, _, _ in runs], sim_kw, jobs,
                                            args.policy_modules,
                                            lambda i, n: progress.update(tasks[i], completed=n))
        else:
            done = [cluster.simulate(scenario, requests, p, d, **sim_kw,
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
                                    f"{runs_slo_note(args, runs, budget_pools_all_wide_ep(scenario))}"))
        kv = kv_tier_table(summaries)
        if kv is not None:
            console.print(kv)
    for smry in summaries:
        line = rejection_line(smry, scenario.effective_max_model_len)
        if line:
            console.print(f"[red]{escape(line)}[/]" if nothing_simulated(smry) else escape(line), soft_wrap=True)
    for smry in summaries:
        if "admission" in smry:
            console.print(escape(admission_line(smry)), soft_wrap=True)
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


class Run:
    """``pdlb sim run`` (:class:`pdlb_cli.command.Subcommand`)."""

    name = "run"

    def add_parser(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        run = subparsers.add_parser("run", help="run one policy", description="Simulate one policy and print its summary.")
        run.add_argument("--policy", "--prefill-policy", dest="policy", default="ep_aware", metavar="NAME[:K=V,...]",
                         help="prefill (and decode) policy with optional parameters, e.g. "
                              "cache_aware:cache_threshold=0.5 (see 'pdlb policies'; default ep_aware)")
        run.add_argument("--decode-policy", metavar="NAME[:K=V,...]", help="decode-pool policy (default: --policy)")
        add_policy_module_arg(run)
        add_run_options(run)
        return run

    def run(self, args: argparse.Namespace, console: Console) -> int:
        return run_policies(args, policy_runs(args, [("--policy", args.policy, args.decode_policy)]), console)
