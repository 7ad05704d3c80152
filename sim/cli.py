"""The ``pdlb`` command line.

    pdlb sim compare            every routing policy on the embedded Mooncake trace
    pdlb sim run --policy P     one policy
    pdlb sim scenarios          the scenario presets
    pdlb sim price              revenue per GPU-hour and cost per 1M tokens from a price sheet
    pdlb sim validate           the perf model vs published deployment figures
    pdlb sim sessions           generate a multi-turn chatbot/agent session workload (JSONL)
    pdlb sim store-sweep        shared KV store hit rate vs TTL and capacity (docs/kv_cache.md)
    pdlb policies               the routing policies and their parameters
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from balancer.policies import available_policies, make_policy
from balancer.policies.base import _REGISTRY
from sim.scenario import DEFAULT_PRESET, PRESETS, Scenario, load_scenario

DEFAULT_SLO_TTFT_S = 2.0
DEFAULT_SLO_TPOT_S = 0.1


def _add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", metavar="PATH", help="trace file (default: the embedded Mooncake conversation trace)")
    g.add_argument("--format", default="auto", choices=["auto", "mooncake", "azure"],
                   help="trace format (default: by extension: .jsonl[.gz] mooncake, .csv azure)")
    g.add_argument("--rate-scale", type=float, default=1.0, metavar="F",
                   help="multiply the arrival rate by F (divides arrival times; default 1)")
    g.add_argument("--limit", type=int, metavar="N", help="use only the first N requests")
    g.add_argument("--duration-s", type=float, metavar="S", help="use only requests arriving in the first S seconds (after rate scaling)")
    g.add_argument("--spread-s", type=float, default=3.0, metavar="S",
                   help="spread requests that share a timestamp uniformly over S seconds (Mooncake logs arrivals "
                        "in ~3 s batches; 0 keeps the batches; default 3)")
    g = p.add_argument_group("cluster")
    g.add_argument("--scenario", default=DEFAULT_PRESET, metavar="NAME|FILE",
                   help=f"scenario preset ({', '.join(sorted(PRESETS))}) or a .toml/.yaml/.json file (default {DEFAULT_PRESET})")
    g.add_argument("--prefill-engines", type=int, metavar="N", help="override the number of prefill engines")
    g.add_argument("--decode-engines", type=int, metavar="N", help="override the number of decode engines")
    g.add_argument("--mixed-engines", type=int, metavar="N", help="override the number of mixed (aggregated) engines")
    g.add_argument("--exact", action="store_true", help="step-by-step decode (reference mode; slower, same results)")
    g = p.add_argument_group("router")
    g.add_argument("--index-mode", default="approximate", choices=["approximate", "events"],
                   help="prefix index: 'approximate' records routed prompts (SGLang, llm-d); 'events' trusts only the "
                        "simulated engines' KV events (Dynamo) (default approximate)")
    g.add_argument("--tier-weights", metavar="host=W,store=W",
                   help="weights of host-tier and shared-store prefix hits relative to HBM hits, each in [0, 1], when "
                        "the scenario has KV tiers (default host=0.75,store=0.5)")
    g.add_argument("--no-router-tiers", action="store_true",
                   help="with KV tiers configured, let the router see only HBM prefix matches")
    g = p.add_argument_group("metrics and output")
    g.add_argument("--slo-ttft-s", type=float, default=DEFAULT_SLO_TTFT_S, help=f"TTFT SLO in seconds for goodput (default {DEFAULT_SLO_TTFT_S})")
    g.add_argument("--slo-tpot-s", type=float, default=DEFAULT_SLO_TPOT_S, help=f"TPOT SLO in seconds for goodput (default {DEFAULT_SLO_TPOT_S})")
    g.add_argument("--seed", type=int, default=0, help="seed of the router's RNG and of the arrival spreading (default 0)")
    g.add_argument("--out", type=Path, metavar="DIR", help="results folder (default results/<scenario>-<time>)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def parse_tier_weights(text: str | None) -> dict[str, float] | None:
    """``"host=0.8,store=0.4"`` -> ``{"host": 0.8, "store": 0.4}``; ``None`` -> ``None``.

    Raises:
        ValueError: not ``name=number`` pairs (names and ranges are checked by the Router).
    """
    if not text:
        return None
    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        try:
            if not sep:
                raise ValueError
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--tier-weights: expected name=number pairs like host=0.75,store=0.5, got {part!r}") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdlb", description="Cross-replica load balancer for PD-disaggregated LLM serving, and its simulator.")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("sim", help="simulate a cluster on a trace", description="Simulate prefill/decode pools on a request trace with pdlb's routing policies.")
    simsub = sim.add_subparsers(dest="sim_command", required=True)
    cmp_ = simsub.add_parser("compare", help="run several policies on the same workload and compare them",
                             description="Run each policy (for both the prefill and the decode pool) on the same workload "
                                         "and print a comparison table; writes per-request CSVs, summary.json and plots.")
    cmp_.add_argument("--policies", default=",".join(available_policies()), metavar="A,B,...",
                      help="comma-separated policies (default: all: %(default)s)")
    cmp_.add_argument("--decode-policy", metavar="P", help="use P for the decode pool in every run (default: the run's policy)")
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

    requests = read_trace(args.trace, args.format)
    fmt = args.format
    if fmt == "auto":
        fmt = "azure" if args.trace and ".csv" in Path(args.trace).name else "mooncake"
    if args.limit is not None:
        requests = take_slice(requests, 0, args.limit)
    if args.spread_s and args.spread_s > 0:
        requests = spread_batches(requests, args.spread_s, seed=args.seed)
    if args.rate_scale != 1.0:
        requests = scale_rate(requests, args.rate_scale)
    if args.duration_s is not None:
        requests = take_slice(requests, duration_s=args.duration_s)
    if not requests:
        raise ValueError("the workload is empty after --limit/--duration-s")
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
    sc = sc.with_pools(prefill_engines=args.prefill_engines, decode_engines=args.decode_engines,
                       mixed_engines=args.mixed_engines)
    if args.exact:
        sc = sc.model_copy(update={"fast_forward": False})
    return sc


def _run_many(args: argparse.Namespace, runs: list[tuple[str, str]], console: Console) -> int:
    from sim.cluster import simulate
    from sim.metrics import summarize
    from sim.report import kv_tier_table, markdown_table, summary_table, write_results
    from sim.workload import ideal_hit_rate

    scenario = _scenario(args)
    requests, meta = _load_workload(args)
    for p, d in runs:  # fail fast on bad names before simulating anything
        make_policy(p), make_policy(d)
    tier_weights = parse_tier_weights(args.tier_weights)
    span = requests[-1].arrival_time_s - requests[0].arrival_time_s
    ideal = ideal_hit_rate(requests, scenario.block_size)[1]
    if not args.quiet:
        console.print(f"[bold]{scenario.name}[/]: {scenario.description or ''} ({scenario.num_gpus} GPUs)")
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
                           router_tiers=not args.no_router_tiers, tier_weights=tier_weights,
                           progress=lambda done, total, task=task: progress.update(task, completed=done))
            results.append(res)
            summaries.append(summarize(res, slo_ttft_s=args.slo_ttft_s, slo_tpot_s=args.slo_tpot_s))
    wall = time.perf_counter() - t0
    console.print(summary_table(summaries, title=f"{scenario.name}: {len(requests)} requests, "
                                f"SLO TTFT<={args.slo_ttft_s}s TPOT<={1e3 * args.slo_tpot_s:.0f}ms"))
    kv = kv_tier_table(summaries)
    if kv is not None:
        console.print(kv)
    console.print(f"ideal (infinite cache) prefix hit rate: {100 * ideal:.1f}%   "
                  f"simulated in {wall:.1f} s")
    out = args.out or Path("results") / f"{scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    meta |= {"command": " ".join(sys.argv), "wall_s": wall}
    files = write_results(out, results, summaries, meta, plots=not args.no_plots)
    (out / "summary.md").write_text(markdown_table(summaries) + "\n")
    console.print(f"results: {out}/ ({', '.join(f.name for f in files[:1])}, {len(files) - 1} more)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=160)
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
                console.print(f"[bold]{name}[/]({params})\n    {doc}")
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
                    console.print(f"[bold]{name}[/]: {sc.description} ({sc.num_gpus} GPUs)")
                return 0
            if args.sim_command == "compare":
                names = [p.strip() for p in args.policies.split(",") if p.strip()]
                runs = [(p, args.decode_policy or p) for p in names]
                return _run_many(args, runs, console)
            if args.sim_command == "run":
                return _run_many(args, [(args.policy, args.decode_policy or args.policy)], console)
    except (ValueError, FileNotFoundError) as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    parser.error("unknown command")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
