"""``pdlb dev``: the developer commands, one module each in this package, listed in the order
``pdlb dev --help`` shows them (:data:`SUBCOMMANDS`)."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from pdlb_cli.command import Subcommand, add_subcommands
from pdlb_cli.dev.broker_routers import BrokerRouters
from pdlb_cli.dev.gpu_runs import GpuRuns
from pdlb_cli.dev.hostile_engine import HostileEngine
from pdlb_cli.dev.k_routers import KRouters
from pdlb_cli.dev.overload import Overload
from pdlb_cli.dev.tiers_vs_routing import TiersVsRouting

SUBCOMMANDS: tuple[Subcommand, ...] = (KRouters(), BrokerRouters(), TiersVsRouting(), Overload(), GpuRuns(),
                                       HostileEngine())


class Dev:
    """``pdlb dev`` (:class:`pdlb_cli.command.Subcommand`): a parser whose subcommands are
    :data:`SUBCOMMANDS` (one is required)."""

    name = "dev"

    def add_parser(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        dev = subparsers.add_parser("dev", help="developer experiments and tools",
                                    description="The repository's experiments (simulated, with their tables) and "
                                                "tools (GPU-run records, a misbehaving fake engine).")
        add_subcommands(dev.add_subparsers(dest="dev_command", required=True), SUBCOMMANDS)
        return dev

    def run(self, args: argparse.Namespace, console: Console) -> int:
        """Never reached from the command line (the parser refuses a bare ``pdlb dev``)."""
        print("pdlb dev: error: give a subcommand (pdlb dev --help lists them)", file=sys.stderr)
        return 2
