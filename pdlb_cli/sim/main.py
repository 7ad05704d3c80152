"""``pdlb sim``: the simulator's commands, one module each in this package, listed in the order
``pdlb sim --help`` shows them (:data:`SUBCOMMANDS`)."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from pdlb_cli.command import Subcommand, add_subcommands
from pdlb_cli.sim.capacity import Capacity
from pdlb_cli.sim.compare import Compare
from pdlb_cli.sim.cost_model import CostModel
from pdlb_cli.sim.price import Price
from pdlb_cli.sim.run import Run
from pdlb_cli.sim.scenarios import Scenarios
from pdlb_cli.sim.sessions import Sessions
from pdlb_cli.sim.store_sweep import StoreSweep
from pdlb_cli.sim.sweep import Sweep
from pdlb_cli.sim.validate import Validate
from pdlb_cli.sim.workload import Workload

SUBCOMMANDS: tuple[Subcommand, ...] = (Compare(), Run(), Scenarios(), Validate(), Price(), Sessions(), StoreSweep(),
                                       Workload(), CostModel(), Capacity(), Sweep())


class Sim:
    """``pdlb sim`` (:class:`pdlb_cli.command.Subcommand`): a parser whose subcommands are
    :data:`SUBCOMMANDS` (one is required: argparse rejects a bare ``pdlb sim``)."""

    name = "sim"

    def add_parser(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        sim = subparsers.add_parser("sim", help="simulate a cluster on a trace",
                                    description="Simulate prefill/decode pools on a request trace with pdlb's routing "
                                                "policies.")
        add_subcommands(sim.add_subparsers(dest="sim_command", required=True), SUBCOMMANDS)
        return sim

    def run(self, args: argparse.Namespace, console: Console) -> int:
        """Never reached from the command line (the parser refuses a bare ``pdlb sim`` first, and a
        subcommand's own ``run`` replaces this one); called directly: the usage error, status 2."""
        print("pdlb sim: error: give a subcommand (pdlb sim --help lists them)", file=sys.stderr)
        return 2
