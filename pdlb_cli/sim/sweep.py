"""``pdlb sim sweep SWEEP.toml``: run every point of a sweep file (:mod:`sim.search.sweep`) on a process
pool or Ray, resumably, into one table (``sweep.csv``, ``sweep.json``), plots and ``report.html``.

    pdlb sim sweep examples/sweep.toml --jobs 2
    pdlb sim sweep sweep.toml --executor ray --ray-address auto --out results/big-sweep
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from pdlb_cli.args import (add_executor_args, budget_pools_all_wide_ep, positive_int, route_slo_note, warn_idle_flags,
                           warn_idle_slo_params)
from sim.search.executor import make_executor
from sim.run.html_report import Section, write_report
from sim.run.idle_options import idle_option_warnings
from sim.search.point import WorkloadSpec, load_workload
from sim.search.sweep import burst_message, load_sweep, mark_bursts, plot_heatmap, plot_rates, read_done, run_sweep, write_table

#: Rows printed in the terminal (the files hold them all).
MAX_PRINTED_ROWS = 40


def add_sweep_parser(simsub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``pdlb sim sweep``."""
    p = simsub.add_parser(
        "sweep", help="run a sweep file: scenario fields x policies x rates x seeds x traces, resumable",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the cartesian product (or listed points) of a sweep file and write one table.\n\n"
                    "The file names a base scenario, policies (with parameters: name:k=v,...), rates, seeds, traces,\n"
                    "an [slo] table, a [grid] of scenario fields by dotted path (prefill.num_engines = [4, 6, 8]) and/or\n"
                    "[[points]] of overrides. Points already in the results folder's points.jsonl are not rerun\n"
                    "(resumable); see sim/search/sweep.py for the format.")
    p.add_argument("file", type=Path, metavar="SWEEP.toml", help="the sweep file")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="results folder (default results/sweep-<file name>: rerunning the same file resumes it)")
    p.add_argument("--limit", type=positive_int, metavar="N", help="use only the first N requests of each trace")
    p.add_argument("--no-resume", action="store_true", help="rerun every point (discard points.jsonl)")
    p.add_argument("--per-point", action="store_true",
                   help="also keep each point's per-request CSV and summary under per_point/<point_id>/ (~2 MB per "
                        "full-trace point)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_executor_args(p)
    return p


def _table(rows: list[dict[str, Any]], grid_cols: list[str]) -> tuple[list[str], list[list[str]]]:
    head = ["policy", "rate", "seed", *[c.removeprefix("set.") for c in grid_cols], "GPUs", "req/s", "attain. %",
            "goodput r/s", "goodput/GPU", "TTFT p99 s", "TPOT p99 ms", "hit rate", "error"]

    def f(x: Any, fmt: str, scale: float = 1.0) -> str:
        try:
            return format(float(x) * scale, fmt)
        except (TypeError, ValueError):
            return "-"

    out = []
    for r in rows:
        out.append([r["policy"], f"{r['rate_scale']:g}", str(r["seed"]), *[str(r.get(c, "")) for c in grid_cols],
                    str(r["num_gpus"]), f(r["offered_rps"], ".3f"), f(r["attainment"], ".1f", 100),
                    f(r["goodput_rps"], ".3f") + ("*" if r.get("goodput_burst") else ""),
                    f(r["goodput_rps_per_gpu"], ".4f"), f(r["ttft_p99_s"], ".2f"),
                    f(r["tpot_p99_s"], ".1f", 1e3), f(r.get("summary.prefix_hit_rate"), ".1%", 1),
                    (r.get("error") or "")[:60]])
    return head, out


def failure_lines(failed: list[dict[str, Any]], most: int = 10) -> list[tuple[str, int]]:
    """``[(error on one line, number of points)]`` of failed rows, distinct errors in first-seen
    order, at most ``most`` (the rest are in ``sweep.csv``)."""
    counts: dict[str, int] = {}
    for r in failed:
        key = " ".join(str(r.get("error")).split())
        counts[key] = counts.get(key, 0) + 1
    return list(counts.items())[:most]


def run_sweep_command(args: argparse.Namespace, console: Console) -> int:
    sweep = load_sweep(args.file, limit=args.limit)
    if args.executor != "ray":
        warn_idle_flags(args, [("ray_address", f"with --executor {args.executor}: it names a Ray cluster")])
    out = args.out or Path("results") / f"sweep-{args.file.stem}"
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file, not a directory")
    # every trace read and checked here, before any worker starts: a truncated or malformed trace is
    # one error line on stderr, not a reason cut off in a table cell
    for wl in dict.fromkeys(p.workload for p in sweep.points if isinstance(p.workload, WorkloadSpec)):
        load_workload(wl)
    done_before = read_done(out / "points.jsonl") if not args.no_resume else {}
    todo = len(set(sweep.ids) - set(done_before))
    if not args.quiet:
        console.print(f"[bold]{escape(str(args.file))}[/]: {len(sweep.points)} points on {escape(sweep.base.name)}; "
                      f"{len(sweep.points) - todo} already done in {escape(str(out))}/, {todo} to run "
                      f"({args.executor}, {args.jobs} jobs)")
    modules = sorted({m for p in sweep.points for m in p.policy.modules})
    t0 = time.perf_counter()
    try:
        executor = make_executor(args.executor, jobs=args.jobs, ray_address=args.ray_address, modules=modules)
    except ImportError as e:
        raise ValueError(str(e)) from None
    if sweep.points:
        warn_idle_slo_params([(label, *spec.build()) for label, spec in {p.policy.label: p.policy for p in sweep.points}.items()],
                             sweep.points[0].options.route_slo, "drop route_slo = false",
                             all(budget_pools_all_wide_ep(sc) for sc in {id(pt.scenario): pt.scenario
                                                                          for pt in sweep.points}.values()))
    for label in dict.fromkeys(p.policy.label for p in sweep.points):  # each policy on the scenarios of its points
        spec = next(p.policy for p in sweep.points if p.policy.label == label)
        for line in idle_option_warnings([(label, label, *spec.build())],
                                         [p.scenario for p in sweep.points if p.policy.label == label]):
            print(line, file=sys.stderr)
    errors = [0]
    with executor as ex, Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[note]}"),
                                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, disable=args.quiet) as progress:
        task = progress.add_task("sweep", total=todo, note="")

        def on_point(pid: str, row: dict[str, Any]) -> None:
            errors[0] += bool(row.get("error"))
            progress.update(task, advance=1, note=f"{row['policy']} x{row['rate_scale']:g}"
                            + (f" [red]{errors[0]} failed[/]" if errors[0] else ""))

        rows, ran = run_sweep(sweep, out, ex, resume=not args.no_resume, per_point=args.per_point, on_point=on_point)
    wall = time.perf_counter() - t0
    burst = burst_message(mark_bursts(rows), len(rows), sweep.raw.get("duration_s"))
    files = [p.name for p in write_table(rows, out)] + ["points.jsonl"]
    grid_cols = list(dict.fromkeys(k for p in sweep.points for k, _ in p.tag if k.startswith("set.")))
    head, table_rows = _table(rows, grid_cols)
    policies = {p.policy.label: p.policy for p in sweep.points}
    route_slo = sweep.points[0].options.route_slo if sweep.points else True
    title = f"{args.file.name}: {len(rows)} points ({ran} run now in {wall:.1f} s)" + route_slo_note(
        route_slo, [(label, *spec.build()) for label, spec in policies.items()], default=True, flag="route_slo = false",
        wide_ep=bool(sweep.points) and all(budget_pools_all_wide_ep(sc) for sc in
                                           {id(pt.scenario): pt.scenario for pt in sweep.points}.values()))
    t = Table(title=title)
    for i, h in enumerate(head):
        # the policy (with its parameters) and the grid columns say which point a row is: fold them,
        # never cut them ('cache_aware…', 'mixed.num_…' in a 160-column terminal say nothing)
        t.add_column(h, justify="left" if i == 0 or h == "error" else "right",
                     overflow="fold" if i == 0 or 3 <= i < 3 + len(grid_cols) else "ellipsis")
    for row in table_rows[:MAX_PRINTED_ROWS]:
        t.add_row(*map(escape, row))
    console.print(t)
    if len(table_rows) > MAX_PRINTED_ROWS:
        console.print(f"... {len(table_rows) - MAX_PRINTED_ROWS} more rows in {out}/sweep.csv")
    if burst:
        console.print(escape(burst), soft_wrap=True)
    failed = [r for r in rows if r.get("error")]
    if failed:
        console.print(f"[red]{len(failed)} points failed[/] (kept in the table with their error; rerun to retry them)")
        for err, n in failure_lines(failed):  # the whole reason, on stderr (the table cell is cut at 60 characters)
            print(f"error: {n} point{'s' if n > 1 else ''} failed: {err}", file=sys.stderr)
    plots = []
    if not args.no_plots:
        if plot_rates(rows, out / "sweep_rates.png"):
            plots.append(out / "sweep_rates.png")
        if plot_heatmap(rows, sweep.grid_keys, out / "sweep_heatmap.png"):
            plots.append(out / "sweep_heatmap.png")
        files += [p.name for p in plots]
    command = getattr(args, "command_line", None) or "pdlb " + shlex.join(sys.argv[1:])
    sections = [Section("Points", text=title, table=(head, table_rows), items=[burst] if burst else ())]
    sections += [Section(p.stem.replace("_", " "), image=p) for p in plots]
    sections += [Section("Command", pre=command), Section("Sweep file", pre=args.file.read_text()),
                 Section("Base scenario", pre=json.dumps(json.loads(sweep.base.model_dump_json()), indent=1))]
    write_report(out / "report.html", f"pdlb sweep: {args.file.name}", sections,
                 subtitle=f"{len(rows)} points; {ran} simulated in this run ({wall:.1f} s, {args.executor}, {args.jobs} jobs).")
    files.append("report.html")
    console.print(f"results: {out}/ ({', '.join(files)})")
    return 1 if failed else 0


class Sweep:
    """``pdlb sim sweep`` (:class:`pdlb_cli.command.Subcommand`)."""

    name = "sweep"
    add_parser = staticmethod(add_sweep_parser)
    run = staticmethod(run_sweep_command)
