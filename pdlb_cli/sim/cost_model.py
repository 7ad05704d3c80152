"""``pdlb sim cost-model``: the argument parser and the command (the cost model itself is
:mod:`sim.run.router_cost`, a library module that knows no command line)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from pdlb_cli.args import add_set_arg, check_out_file
from sim.run.router_cost import cost_model_for, to_toml
from sim.overrides import apply_overrides
from sim.scenario import load_scenario


def add_cost_model_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``cost-model`` (``--scenario``, ``--set``, ``--out``) to the ``pdlb sim`` subparsers."""
    p = subparsers.add_parser(
        "cost-model", help="print the step-time cost model of a scenario (for pdlb serve --cost-model)",
        description="Fit the cost model that ep_aware prices placements with to a scenario's perf model and print "
                    "it as a TOML table for 'pdlb serve --cost-model FILE' (the service then refits it online).")
    p.add_argument("--scenario", default="dsv3-pd-h200", metavar="NAME|FILE",
                   help="scenario preset or file (default dsv3-pd-h200)")
    add_set_arg(p)  # --set KEY=VALUE, as on pdlb sim run
    p.add_argument("--out", metavar="FILE",
                   help="write the table to FILE instead of standard output (JSON if FILE ends in .json, else TOML)")
    return p


def run_cost_model(args: argparse.Namespace, console: Console) -> int:
    """``pdlb sim cost-model``: fit :func:`sim.run.router_cost.cost_model_for` and print or write it.
    Returns the exit code (0); a bad ``--out`` or ``--set`` raises ``ValueError``."""
    if args.out:  # an error naming the flag, before fitting, not "[Errno 2]" / "[Errno 21]" after
        check_out_file(Path(args.out), "cost_model.toml")
    sc = apply_overrides(load_scenario(args.scenario), args.overrides)  # same order and checks as sim run
    model = cost_model_for(sc)
    if args.out and str(args.out).lower().endswith(".json"):
        text = json.dumps({"cost_model": model.to_dict()}, indent=2) + "\n"
    else:
        text = to_toml(model, sc.name, [f"{k}={v!r}" for k, v in args.overrides])
    if args.out:
        Path(args.out).write_text(text)
        console.print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


class CostModel:
    """``pdlb sim cost-model`` (:class:`pdlb_cli.command.Subcommand`)."""

    name = "cost-model"
    add_parser = staticmethod(add_cost_model_parser)
    run = staticmethod(run_cost_model)
