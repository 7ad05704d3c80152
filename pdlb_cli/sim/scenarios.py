"""``pdlb sim scenarios``: the shipped scenario presets, one line each (name, description or pool
shape, GPUs)."""

from __future__ import annotations

import argparse

from rich.console import Console

from pdlb_cli.args import describe_scenario
from sim.scenario import PRESETS


class Scenarios:
    """``pdlb sim scenarios`` (:class:`pdlb_cli.command.Subcommand`)."""

    name = "scenarios"

    def add_parser(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        return subparsers.add_parser("scenarios", help="list scenario presets")

    def run(self, args: argparse.Namespace, console: Console) -> int:
        for _, sc in sorted(PRESETS.items()):
            console.print(describe_scenario(sc))
        return 0
