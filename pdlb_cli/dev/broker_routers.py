"""``pdlb dev broker-routers``: routers on several hosts sharing load through a broker
(:mod:`sim.experiments.broker_routers`), per sharing mode and router count."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from pdlb_cli.args import comma_items, nonnegative_float, positive_float, positive_int, positive_int_list, seed_int
from sim.experiments.broker_routers import DEFAULT_INTERVAL_S, DEFAULT_LATENCY_S, MODES, markdown, run
from sim.experiments.k_routers import DEFAULT_POLICIES


class BrokerRouters:
    """``pdlb dev broker-routers`` (:class:`pdlb_cli.command.Subcommand`)."""

    name = "broker-routers"

    def add_parser(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        ap = subparsers.add_parser("broker-routers", help="routers on several hosts sharing load through a broker "
                                                          "(simulated)",
                                   description="Routers on several hosts sharing in-flight load and routing decisions "
                                               "through a broker (sim.experiments.broker_routers).")
        ap.add_argument("--ks", type=positive_int_list, default=[1, 2, 4, 8],
                        help="router counts, comma-separated (default: 1,2,4,8)")
        ap.add_argument("--modes", default=",".join(MODES), help="sharing modes (default: %(default)s)")
        ap.add_argument("--limit", type=positive_int, default=None, help="first N requests of the trace (default: all)")
        ap.add_argument("--interval-s", type=positive_float, default=DEFAULT_INTERVAL_S,
                        help="broker publish interval, seconds (default: %(default)s)")
        ap.add_argument("--latency-s", type=nonnegative_float, default=DEFAULT_LATENCY_S,
                        help="broker delivery time, seconds (default: %(default)s)")
        ap.add_argument("--seed", type=seed_int, default=0, help="seed (default: %(default)s)")
        ap.add_argument("--policy", default=None,
                        help="one policy spec for both pools, e.g. ep_aware (default: {} prefill, {} decode)"
                             .format(*DEFAULT_POLICIES))
        return ap

    def run(self, args: argparse.Namespace, console: Console) -> int:
        # an unknown mode is a ValueError from run(): one error line, exit status 2 (pdlb_cli.main)
        pols = DEFAULT_POLICIES if args.policy is None else (args.policy, args.policy)
        rows = run(args.ks, comma_items(args.modes, "modes", flag="--modes"), args.limit, args.seed, 1.0,
                   args.interval_s, args.latency_s, log=lambda s: print(s, file=sys.stderr, flush=True),
                   prefill_policy=pols[0], decode_policy=pols[1])
        print(markdown(rows))
        return 0
