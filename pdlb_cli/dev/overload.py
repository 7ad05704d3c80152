"""``pdlb dev overload``: deadline admission under a calm load, a burst and an overload
(:func:`sim.experiments.overload.burst_table`), printed as JSON."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from pdlb_cli.args import positive_float, seed_int
from sim.experiments.overload import burst_table


class Overload:
    """``pdlb dev overload`` (:class:`pdlb_cli.command.Subcommand`)."""

    name = "overload"

    def add_parser(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        p = subparsers.add_parser("overload", help="deadline admission: calm, burst and overload runs (simulated)",
                                  description="Deadline admission off and on under a calm load, a 10x burst and a 2x "
                                              "overload (sim.experiments.overload); JSON on stdout.")
        p.add_argument("--duration-s", type=positive_float, default=60.0, help="seconds of arrivals (default: 60)")
        p.add_argument("--ttft-slo-s", type=positive_float, default=1.0, help="TTFT SLO, seconds (default: 1)")
        p.add_argument("--seed", type=seed_int, default=0, help="seed (default: 0)")
        return p

    def run(self, args: argparse.Namespace, console: Console) -> int:
        json.dump(burst_table(duration_s=args.duration_s, ttft_slo_s=args.ttft_slo_s, seed=args.seed), sys.stdout,
                  indent=1)
        print()
        return 0
