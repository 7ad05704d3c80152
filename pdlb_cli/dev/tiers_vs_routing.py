"""``pdlb dev tiers-vs-routing``: per-replica HBM caches with cache-aware routing vs a shared KV
store with least-load routing vs both (:mod:`sim.experiments.tiers_vs_routing`); writes
``summary.json``, ``summary.md`` and ``tiers_vs_routing.png``."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from pdlb_cli.args import positive_float_list, positive_int, seed_int
from sim.experiments.tiers_vs_routing import markdown, plot, run


class TiersVsRouting:
    """``pdlb dev tiers-vs-routing`` (:class:`pdlb_cli.command.Subcommand`)."""

    name = "tiers-vs-routing"

    def add_parser(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        p = subparsers.add_parser(
            "tiers-vs-routing", help="HBM caches + cache-aware routing vs a shared KV store (simulated)",
            description="Experiment 2: per-replica HBM caches + cache-aware routing vs a shared KV store + least-load "
                        "routing vs both, on the embedded Mooncake trace at two load levels.")
        p.add_argument("--rate-scales", type=positive_float_list, default=[0.6, 1.0], metavar="F,F",
                       help="arrival-rate multipliers (default 0.6,1.0: moderate and the default scenario's heavy load)")
        p.add_argument("--limit", type=positive_int, metavar="N", help="first N requests only (default: the whole trace)")
        p.add_argument("--seed", type=seed_int, default=0, help="seed (default 0)")
        p.add_argument("--out", type=Path, metavar="DIR", help="results folder (default results/tiers-vs-routing-<time>)")
        return p

    def run(self, args: argparse.Namespace, console: Console) -> int:
        with Progress(console=console, transient=True) as prog:
            rows = run(args.rate_scales, args.limit, args.seed, prog)
        out = args.out or Path("results") / f"tiers-vs-routing-{time.strftime('%Y%m%d-%H%M%S')}"
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(rows, indent=2))
        md = markdown(rows)
        (out / "summary.md").write_text(md + "\n")
        plot(rows, out / "tiers_vs_routing.png")
        console.print(md)
        console.print(f"results in {out}")
        return 0
