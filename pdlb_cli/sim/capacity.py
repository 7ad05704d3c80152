"""``pdlb sim capacity``: the highest rate at SLO (``--search rate``) or the fewest engines at a rate
(``--search gpus``), for every policy at once.

    pdlb sim capacity --search rate --policies cache_aware,least_load --slo-ttft-per-1k-tokens-s 0.5
    pdlb sim capacity --search gpus --rate-scale 2 --policy cache_aware:cache_threshold=0.5,balance_abs=8
    pdlb sim capacity --executor ray --ray-address auto ...

Policies run in parallel on the executor (``--jobs`` local processes, or Ray); each search is
sequential in its bisection rounds only, and evaluates several points per round when slots are
free. Prints one table row per policy (answer, GPUs, goodput, goodput per GPU, attainment, ratio
to the best anchor policy) and writes a results folder: ``capacity.json`` (every search and
point), ``capacity_points.csv``, ``capacity.md``, plots and a self-contained ``report.html``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from balancer.policies import available_policies
from pdlb_cli.args import (
    CAPACITY_TTFT_PER_1K_TOKENS_S,
    add_cluster_args,
    comma_items,
    add_executor_args,
    add_output_args,
    add_router_args,
    add_slo_args,
    add_workload_args,
    idle_tier_flags,
    policy_list,
    positive_float,
    positive_int,
    route_slo_note,
    scenario_from_args,
    seed_int,
    default_results_dir,
    warn_idle_flags,
    budget_pools_all_wide_ep,
    warn_idle_slo_params,
)
from sim.search.capacity import GpuSearch, RateSearch, run_searches
from sim.search.capacity_report import (
    _jsonable,
    gpu_table,
    markdown,
    plot_gpus,
    plot_rate,
    rate_table,
    reasons,
    result_dict,
    rich_table,
    write_points_csv,
)
from sim.search.executor import make_executor, run_points
from sim.run.html_report import Section, write_report
from sim.run.idle_options import idle_option_warnings
from sim.run.metrics import burst_note
from sim.search.point import SLO, Point, SimOptions, WorkloadSpec, import_policy_modules, load_workload, parse_policy, point_row
from sim.workload import ideal_hit_rate


# ---------------------------------------------------------------------- what the option groups build
def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    """The :class:`sim.search.point.WorkloadSpec` of the workload options (rate scaling not included)."""
    return WorkloadSpec(args.trace, args.format, args.limit, getattr(args, "duration_s", None), args.spread_s, args.seed,
                        getattr(args, "warmup_s", 0.0))


def sim_options(args: argparse.Namespace) -> SimOptions:
    """The :class:`sim.search.point.SimOptions` of the router options."""
    tw = args.tier_weights
    return SimOptions(index_mode=args.index_mode, router_tiers=not args.no_router_tiers,
                      tier_weights=tuple(sorted(tw.items())) if tw else None,
                      route_slo=getattr(args, "route_slo", True))


def slo_from_args(args: argparse.Namespace) -> SLO:
    """The :class:`sim.search.point.SLO` of the SLO options (each checked by its argparse type)."""
    return SLO(ttft_s=args.slo_ttft_s, tpot_s=args.slo_tpot_s, attainment=args.slo_attainment,
               percentile=args.slo_percentile, ttft_per_1k_prompt_tokens_s=args.slo_ttft_per_1k_tokens_s)


def add_policy_args(p: argparse.ArgumentParser) -> None:
    """``--policies``, ``--policy`` (repeatable, with parameters), ``--decode-policy``, ``--policy-module``."""
    g = p.add_argument_group("policies")
    g.add_argument("--policies", metavar="A,B:K=V,...",
                   help="comma-separated policies, each NAME or NAME:K=V[,K=V] (default: every registered policy)")
    g.add_argument("--policy", dest="policy_specs", action="append", default=[], metavar="NAME[:K=V,...]",
                   help="a policy with parameters, e.g. --policy cache_aware:cache_threshold=0.5,balance_abs=8 "
                        "(repeatable; instead of --policies, not with it)")
    g.add_argument("--decode-policy", metavar="NAME[:K=V,...]",
                   help="the decode pool's policy for every run (default: each run's policy)")
    g.add_argument("--policy-module", dest="policy_modules", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (an importable path, e.g. mypkg.mypolicy) so that its @register-ed "
                        "policies can be named (repeatable)")


def policy_specs(args: argparse.Namespace) -> list:
    """The :class:`sim.search.point.PolicyPair` list of the policy options (checked now).

    Raises:
        ValueError: unknown policy or parameter, a bad value, a module that does not import,
            an empty list.
    """
    import_policy_modules(args.policy_modules)
    if args.policy_specs and args.policies is not None:  # --policy would silently replace --policies
        raise ValueError("--policy and --policies both given: --policy replaces the list, so --policies would be ignored; give one (repeat --policy for several)")
    if args.policy_specs:
        texts = list(args.policy_specs)
    elif args.policies is not None:
        texts = policy_list(args.policies)  # "a,b:k=v,k2=v2": a K=V part continues its policy
    else:
        texts = available_policies()
    specs = [parse_policy(t, args.decode_policy, args.policy_modules) for t in texts]
    labels = [s.label for s in specs]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"policy given twice: {', '.join(dup)}")
    return specs


def add_capacity_parser(simsub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``pdlb sim capacity``."""
    p = simsub.add_parser(
        "capacity", help="highest rate at SLO, or fewest engines at a rate, per policy",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Capacity planning for each policy on a trace and scenario.\n\n"
                    "  --search rate   the highest --rate-scale (and req/s) at which the SLO holds: geometric "
                    "bisection\n"
                    "                  within [--rate-min, --rate-max] until hi/lo <= 1 + --tol\n"
                    "  --search gpus   the fewest engines per pool (prefill and decode together, or mixed) that "
                    "meet\n"
                    "                  the SLO at --rate-scale, up to --max-*-engines\n\n"
                    "SLO: --slo-attainment of requests meet TTFT <= --slo-ttft-s (+ --slo-ttft-per-1k-tokens-s per "
                    "1000 prompt\ntokens) and TPOT <= --slo-tpot-s; or --slo-percentile P for pP targets. An SLO "
                    "that fails even at\nzero load (each request alone) is reported with its reason, without "
                    "searching. Goodput = SLO-meeting\nrequests per second of the arrival window.")
    g = p.add_argument_group("search")
    g.add_argument("--search", default="rate", choices=["rate", "gpus"], help="what to search (default rate)")
    g.add_argument("--rate-min", type=positive_float, default=1 / 64, metavar="F",
                   help="lowest rate scale searched (default 1/64)")
    g.add_argument("--rate-max", type=positive_float, default=64.0, metavar="F",
                   help="highest rate scale searched (default 64)")
    g.add_argument("--rate-start", type=positive_float, default=1.0, metavar="F",
                   help="first rate scale tried (default 1)")
    g.add_argument("--tol", type=positive_float, default=0.02, metavar="R",
                   help="relative tolerance of the rate answer: stop when hi/lo <= 1 + R (default 0.02)")
    g.add_argument("--rate-scale", type=positive_float, default=1.0, metavar="F",
                   help="--search gpus: the rate scale to size for (default 1)")
    g.add_argument("--max-prefill-engines", type=positive_int, metavar="N",
                   help="--search gpus: most prefill engines tried (default max(4 x the scenario's, 8))")
    g.add_argument("--max-decode-engines", type=positive_int, metavar="N",
                   help="--search gpus: most decode engines tried (default max(4 x the scenario's, 8))")
    g.add_argument("--max-mixed-engines", type=positive_int, metavar="N",
                   help="--search gpus: most mixed engines tried (default max(4 x the scenario's, 8))")
    g.add_argument("--max-evals", type=positive_int, default=40, metavar="N",
                   help="most simulations per policy (default 40)")
    g.add_argument("--curve", metavar="F,F,...",
                   help="--search rate: also run every policy to completion at these rate scales, for the goodput "
                        "and TTFT p99 vs rate plot (e.g. 0.25,0.5,1,2)")
    g.add_argument("--warmup-s", type=positive_float, default=0.0, metavar="S",
                   help="simulate the first S seconds of (scaled) arrivals to fill the caches before judging: the "
                        "SLO, goodput and req/s are those of the requests after them (with --duration-s, S + the "
                        "window is simulated; default 0)")
    g.add_argument("--no-early-stop", action="store_true",
                   help="run failing points to completion (slower; same verdicts, fuller plots)")
    add_policy_args(p)
    add_workload_args(p, rate_scale=False)
    add_cluster_args(p)
    add_router_args(p)
    add_executor_args(p)
    out = add_output_args(p, prefix="capacity")
    add_slo_args(out, targets=True, ttft_per_1k_default=CAPACITY_TTFT_PER_1K_TOKENS_S)
    out.add_argument("--seed", type=seed_int, default=0, help="seed of the router's RNG and of the arrival spreading (default 0)")
    return p


def _curve(text: str | None) -> list[float]:
    """``--curve``'s rate scales, sorted and distinct; ``None`` (not given): none. An empty value is
    refused as every empty list option is (``comma_items``): leaving the flag out says "no curve".

    Raises:
        ValueError: naming ``--curve``: nothing, an empty item, a value that is not a finite number
            > 0, more than 64 scales."""
    if text is None:
        return []
    vals = []
    for part in comma_items(text, "positive rate scales like 0.5,1,2", flag="--curve"):
        try:
            v = float(part)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"--curve: expected positive rate scales like 0.5,1,2, got {part!r}")
        vals.append(v)
    if len(vals) > 64:
        raise ValueError(f"--curve: at most 64 rate scales, got {len(vals)}")
    return sorted(set(vals))


def _estimate_evals(args: argparse.Namespace) -> int:
    if args.search == "rate":
        bracket = math.ceil(math.log2(max(args.rate_max / args.rate_start, args.rate_start / args.rate_min, 2.0)))
        return min(args.max_evals, 2 + math.ceil(math.log2(math.log(2) / math.log1p(args.tol))) + min(bracket, 3))
    return min(args.max_evals, 12)


#: An answer resting on fewer judged requests than this gets a small-sample note.
SMALL_SAMPLE_REQUESTS = 1000
#: ... as does one whose window holds less than this share of the whole trace's ideal prefix hits.
COLD_CACHE_SHARE = 0.2


def small_window_note(r: Any, requests: list, wl: Any, block_size: int) -> str:
    """A note when a search's answer rests on a short window: its count of judged requests and its
    warm-up share, ``1 - window ideal hit rate / whole-trace ideal hit rate`` (the share of the
    cacheable prompt an infinite cache would still miss because the window starts cold;
    :func:`sim.workload.ideal_hit_rate`); ``""`` for an answer on at least
    :data:`SMALL_SAMPLE_REQUESTS` requests with a warm-up share under :data:`COLD_CACHE_SHARE`, or
    without an answer run. ``requests``: the workload before rate scaling (``wl.read()``)."""
    best = getattr(r, "best", None)
    if best is None or best.error:
        return ""
    at_rate = wl.at_rate(requests, best.point.rate_scale)
    judged = [q for q, j in zip(at_rate, wl.measured(at_rate)) if j]
    whole = ideal_hit_rate(requests, block_size)[1]
    window = ideal_hit_rate(at_rate, block_size)[1] if wl.warmup_s > 0 else ideal_hit_rate(judged, block_size)[1]
    share = max(0.0, 1.0 - window / whole) if whole > 0 else 0.0
    if len(judged) >= SMALL_SAMPLE_REQUESTS and share < COLD_CACHE_SHARE:
        return ""
    where = f"the {wl.duration_s:g} s window" if wl.duration_s is not None else "the trace"
    # with --limit the reference is the requests kept, not the trace file (review4 T6)
    of_whole = "the whole trace" if wl.limit is None else f"the {len(requests):,} requests --limit keeps"
    cold = share >= COLD_CACHE_SHARE
    return (f"{'small' if len(judged) < SMALL_SAMPLE_REQUESTS else 'cold'}{' and cold' if cold and len(judged) < SMALL_SAMPLE_REQUESTS else ''} "
            f"sample: the answer rests on {len(judged)} requests of {where}, with an ideal prefix hit rate "
            f"of {100 * window:.0f}% against {100 * whole:.0f}% over {of_whole} (warm-up share {100 * share:.0f}%"
            + ("; the cache starts cold" if cold else "") + "); policies may rank differently on a longer window "
            "(--duration-s) or trace, or after a warm-up (--warmup-s S: simulate S seconds first, judge what follows)")


def progress_note(r: Any, search: str) -> str:
    """A progress bar's note for the point just finished: the rate scale and its request rate
    (``x0.5 = 2.1 req/s meets``) or the engine counts (``4+2 misses``)."""
    verdict = "error" if r.error else ("meets" if r.meets else "misses")
    if search == "rate":
        rps = f" = {r.offered_rps:.3g} req/s" if math.isfinite(r.offered_rps) else ""
        return f"x{r.point.rate_scale:.4g}{rps} {verdict}"
    return "+".join(str(x) for x in (r.prefill_engines, r.decode_engines, r.mixed_engines) if x is not None) + f" {verdict}"


def _burst_note(r: Any, duration_s: float | None = None) -> str:
    """The answer's :func:`sim.run.metrics.burst_note` with what to do about it; ``""`` for a steady
    answer, or without a complete answer run. ``duration_s``: the search's ``--duration-s``, if
    given (the advice is then a longer window, not the flag the user already passed)."""
    best = getattr(r, "best", None)
    summary = best.summary if best is not None else None
    if not summary:
        return ""
    note = burst_note(summary["num_requests"], summary.get("arrival_window_s"), summary.get("makespan_s"))
    if not note:
        return ""
    if duration_s is not None:
        return f"at the answer {note}; search over a longer window than --duration-s {duration_s:g} or a longer trace"
    return (f"at the answer {note}; search over a fixed window (--duration-s S: every rate runs S seconds of arrivals) "
            "or a longer trace")


def run_capacity(args: argparse.Namespace, console: Console) -> int:
    if args.rate_min > args.rate_max or not args.rate_min <= args.rate_start <= args.rate_max:
        raise ValueError(f"--rate-min {args.rate_min:g} <= --rate-start {args.rate_start:g} <= --rate-max "
                         f"{args.rate_max:g} does not hold")
    if args.tol >= 1:
        raise ValueError(f"--tol: must be < 1, got {args.tol:g}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out}: is a file, not a directory")
    scenario = scenario_from_args(args)
    slo = slo_from_args(args)
    specs = policy_specs(args)
    curve = _curve(args.curve)
    wl = workload_spec(args)
    requests = load_workload(wl)  # read and checked here, before any worker starts
    opts = sim_options(args)
    early = not args.no_early_stop
    idle = idle_tier_flags(scenario)
    if args.search == "rate":
        idle += [("rate_scale", "with --search rate: the search finds the rate (--rate-scale is the load --search "
                                "gpus sizes for)")]
        idle += [(f"max_{p}_engines", "with --search rate: engine limits are for --search gpus")
                 for p in ("prefill", "decode", "mixed")]
    else:
        idle += [(d, "with --search gpus: it shapes the rate search (--search rate)")
                 for d in ("rate_min", "rate_max", "rate_start", "tol", "curve")]
    if args.slo_percentile is not None:
        idle.append(("slo_attainment", "with --slo-percentile: the percentile form has no attainment target"))
    if args.executor != "ray":
        idle.append(("ray_address", f"with --executor {args.executor}: it names a Ray cluster"))
    warn_idle_flags(args, idle)
    warn_idle_slo_params([(s.label, *s.build()) for s in specs], opts.route_slo, "drop --no-route-slo",
                         budget_pools_all_wide_ep(scenario))
    for line in idle_option_warnings([(s.label, s.label, *s.build()) for s in specs], [scenario]):
        print(line, file=sys.stderr)
    if args.search == "rate":
        searches: list = [RateSearch(scenario, wl, s, slo, args.rate_min, args.rate_max, args.rate_start, args.tol,
                                     args.max_evals, args.seed, opts, early) for s in specs]
    else:
        mx = {"prefill": args.max_prefill_engines, "decode": args.max_decode_engines, "mixed": args.max_mixed_engines}
        pools = ["prefill", "decode"] if scenario.disaggregated else ["mixed"]
        for pool, n in mx.items():
            if n is not None and pool not in pools:
                raise ValueError(f"--max-{pool}-engines: scenario {scenario.name!r} has no {pool} pool")
        searches = [GpuSearch(scenario, wl, s, slo, args.rate_scale, {p: mx[p] for p in pools}, args.max_evals,
                              args.seed, opts, early) for s in specs]
    span = requests[-1].arrival_time_s - requests[0].arrival_time_s
    if not args.quiet:
        console.print(f"[bold]{escape(scenario.name)}[/]: {escape(scenario.description)} ({scenario.num_gpus} GPUs)")
        console.print(f"workload: {escape(wl.label)}, {len(requests)} requests over {span:.0f} s "
                      f"({len(requests) / span if span > 0 else float('nan'):.3f} req/s at rate x1)"
                      + (f", each rate simulated over its first {wl.duration_s:g} s of arrivals"
                         if wl.duration_s is not None else "")
                      + (f" after a {wl.warmup_s:g} s warm-up that is simulated but not judged" if wl.warmup_s else "")
                      + "; "
                      f"SLO: {escape(slo.describe())}; {len(specs)} policies, executor {args.executor} "
                      f"({args.jobs} jobs)")
    modules = tuple(args.policy_modules)
    t0 = time.perf_counter()
    est = _estimate_evals(args)
    try:
        executor = make_executor(args.executor, jobs=args.jobs, ray_address=args.ray_address, modules=modules)
    except ImportError as e:
        raise ValueError(str(e)) from None
    with executor as ex, \
            Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[note]}"),
                     TimeElapsedColumn(), console=console, disable=args.quiet, transient=False) as progress:
        tasks = {id(s): progress.add_task(f"{s.label:<30}", total=est, note="") for s in searches}
        counts = {id(s): 0 for s in searches}

        def on_point(s: Any, r: Any) -> None:
            counts[id(s)] += 1
            progress.update(tasks[id(s)], completed=min(counts[id(s)], est - 1), note=progress_note(r, args.search))

        def on_done(s: Any, r: Any) -> None:
            # each policy's bar ends, and its clock stops, when its own search does (not when the
            # last search ends); the bar's total becomes the simulations run, not the estimate
            answer = f" x{r.rate_scale:.4g} = {r.rate_rps:.3g} req/s" if getattr(r, "rate_rps", None) else ""
            progress.update(tasks[id(s)], total=len(r.points), completed=len(r.points), note=f"{r.status}{answer}")

        results = run_searches(searches, ex, on_point, on_done)
        curves: dict[str, list] = {}
        if curve and args.search == "rate":
            pts = [Point(scenario, wl, s, f, slo, args.seed, opts, False, (("search", "curve"), ("policy", s.label)))
                   for s in specs for f in curve]
            task = progress.add_task(f"{'curve runs':<30}", total=len(pts), note="")
            got = run_points(pts, ex, lambda i, r: progress.advance(task))
            for p, r in zip(pts, got):
                curves.setdefault(p.policy.label, []).append(r)
    wall = time.perf_counter() - t0
    head, rows = rate_table(results) if args.search == "rate" else gpu_table(results)
    if args.search == "rate":
        title = f"{scenario.name}: highest rate meeting {slo.describe()} (tol {100 * args.tol:g}%)"
    else:
        title = f"{scenario.name}: fewest GPUs meeting {slo.describe()} at rate x{args.rate_scale:g}"
    # the answer depends on it (ep_aware routes against the SLO by default)
    title += route_slo_note(opts.route_slo, [(s.label, *s.build()) for s in specs], default=True, flag="--no-route-slo",
                            wide_ep=budget_pools_all_wide_ep(scenario))
    console.print(rich_table(head, rows, title))
    for r in results:
        for note in (_burst_note(r, args.duration_s), small_window_note(r, requests, wl, scenario.block_size)):
            if note:
                r.notes.append(note)
    notes = reasons(results)
    for line in notes:
        console.print(f"  {escape(line)}", soft_wrap=True)
    n_points = sum(len(r.points) for r in results) + sum(len(v) for v in curves.values())
    console.print(f"{n_points} simulations in {wall:.1f} s")
    out = args.out or default_results_dir("capacity", scenario.name)
    out.mkdir(parents=True, exist_ok=True)
    command = getattr(args, "command_line", None) or "pdlb " + shlex.join(sys.argv[1:])
    meta = {"command": command, "scenario": json.loads(scenario.model_dump_json()), "workload": vars(wl) | {
        "trace": os.path.abspath(wl.trace) if wl.trace else None, "num_requests": len(requests),
        "arrival_window_s": span}, "search": args.search, "route_slo": opts.route_slo, "executor": args.executor,
        "jobs": args.jobs, "wall_s": wall}
    doc = {"meta": meta, "results": [result_dict(r) for r in results],
           "curves": {k: [result_dict_point(p) for p in v] for k, v in curves.items()}}
    (out / "capacity.json").write_text(json.dumps(doc, indent=1) + "\n")
    all_points = [p for r in results for p in r.points] + [p for v in curves.values() for p in v]
    write_points_csv(out / "capacity_points.csv", all_points)
    (out / "capacity.md").write_text(f"{title}\n\n{markdown(head, rows)}\n" + "".join(f"\n- {n}" for n in notes) + "\n")
    files = ["capacity.json", "capacity_points.csv", "capacity.md"]
    plot = None
    if not args.no_plots:
        plot = out / ("capacity_rate.png" if args.search == "rate" else "capacity_gpus.png")
        if args.search == "rate":
            plot_rate(results, curves, plot)
        else:
            plot_gpus(results, plot)
        files.append(plot.name)
    sections = [Section("Answer", text=title, table=(head, rows), items=notes)]
    if plot is not None:
        sections.append(Section("Plot", image=plot))
    sections += [Section("Command", pre=command),
                 Section("Scenario", text=scenario.description, pre=json.dumps(meta["scenario"], indent=1)),
                 Section("Workload", pre=json.dumps(meta["workload"], indent=1)),
                 Section("Every simulation", table=_points_table(all_points))]
    write_report(out / "report.html", f"pdlb capacity: {scenario.name}", sections,
                 subtitle=f"{n_points} simulations in {wall:.1f} s on {args.executor} ({args.jobs} jobs).")
    files.append("report.html")
    console.print(f"results: {out}/ ({', '.join(files)})")
    return 0


def result_dict_point(p: Any) -> dict:
    return _jsonable(point_row(p, summary=False))


def _points_table(points: list) -> tuple[list[str], list[list[str]]]:
    head = ["policy", "rate scale", "req/s", "engines P/D/M", "GPUs", "meets", "attain. %", "goodput r/s",
            "TTFT p99 s", "stopped early", "wall s"]
    rows = []
    for p in points:
        eng = "/".join("-" if x is None else str(x) for x in (p.prefill_engines, p.decode_engines, p.mixed_engines))
        rows.append([p.point.policy.label, f"{p.point.rate_scale:.4g}", f"{p.offered_rps:.3f}", eng, str(p.num_gpus),
                     "error" if p.error else ("yes" if p.meets else "no"), f"{100 * p.attainment:.1f}",
                     f"{p.goodput_rps:.3f}", f"{p.ttft_p99_s:.2f}", "yes" if p.stopped_early else "", f"{p.wall_s:.1f}"])
    return head, rows


class Capacity:
    """``pdlb sim capacity`` (:class:`pdlb_cli.command.Subcommand`)."""

    name = "capacity"
    add_parser = staticmethod(add_capacity_parser)
    run = staticmethod(run_capacity)
