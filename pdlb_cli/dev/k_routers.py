"""``pdlb dev k-routers``: K independent routers in front of one simulated cluster
(:mod:`sim.experiments.k_routers`): prefix hit rate and TTFT per index mode and K."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from pdlb_cli.args import comma_items, positive_float, positive_int, positive_int_list, seed_int
from sim.experiments.k_routers import DEFAULT_POLICIES, DEFAULT_REPORT_INTERVAL_S, markdown, run

INDEX_MODES = ("approximate", "events", "hybrid")


def index_modes(text: str) -> list[str]:
    """``--modes``: index modes (approximate, events, hybrid), each optionally ``+shared-load`` or
    ``+reports``."""
    modes = comma_items(text, "index modes (approximate, events, hybrid; +shared-load or +reports)")
    bad = [m for m in modes if m.partition("+")[0] not in INDEX_MODES or m.partition("+")[2] not in ("", "shared-load", "reports")]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown index mode(s) {', '.join(bad)} ({', '.join(INDEX_MODES)}, "
                                         "each optionally +shared-load or +reports)")
    return modes


class KRouters:
    """``pdlb dev k-routers`` (:class:`pdlb_cli.command.Subcommand`)."""

    name = "k-routers"

    def add_parser(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        ap = subparsers.add_parser("k-routers", help="K independent routers in front of one cluster (simulated)",
                                   description="Several routers in front of one cluster: what independent approximate "
                                               "routers lose (sim.experiments.k_routers).")
        ap.add_argument("--ks", type=positive_int_list, default=[1, 2, 4, 8],
                        help="router counts, comma-separated (default: 1,2,4,8)")
        ap.add_argument("--modes", type=index_modes, default=["approximate", "events", "events+shared-load"],
                        help="index modes, each optionally +shared-load (one in-flight load view for all routers) "
                             "or +reports (the engines' load reports every --report-interval-s) "
                             "(default: approximate,events,events+shared-load)")
        ap.add_argument("--limit", type=positive_int, default=None, help="first N requests of the trace (default: all)")
        ap.add_argument("--rate-scale", type=positive_float, default=1.0,
                        help="arrival-rate multiplier (default: %(default)s)")
        ap.add_argument("--seed", type=seed_int, default=0, help="seed (default: %(default)s)")
        ap.add_argument("--policy", default=None,
                        help="one policy spec for both pools, e.g. ep_aware (default: {} prefill, {} decode)"
                             .format(*DEFAULT_POLICIES))
        ap.add_argument("--report-interval-s", type=positive_float, default=DEFAULT_REPORT_INTERVAL_S,
                        help="seconds between engine load reports in +reports modes (default: %(default)s)")
        ap.add_argument("--out", type=Path, default=None, help="write summary.json and summary.md here (default: none)")
        return ap

    def run(self, args: argparse.Namespace, console: Console) -> int:
        pols = DEFAULT_POLICIES if args.policy is None else (args.policy, args.policy)
        rows = run(args.ks, args.modes, args.limit, args.seed, args.rate_scale, pols[0], pols[1],
                   args.report_interval_s)
        md = markdown(rows)
        print(md)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "summary.json").write_text(json.dumps(rows, indent=2))
            (args.out / "summary.md").write_text(md + "\n")
        return 0
