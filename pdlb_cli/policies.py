"""``pdlb policies``: every registered routing policy, its parameters with their defaults, and the
first line of its module's docstring (one signature per line, for grep)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from rich.console import Console
from rich.markup import escape

from balancer.policies import available_policies
from balancer.policies.base import policy_class


class Policies:
    """``pdlb policies`` (:class:`pdlb_cli.command.Subcommand`)."""

    name = "policies"

    def add_parser(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        return subparsers.add_parser("policies", help="list routing policies and their parameters",
                                     description="List every registered routing policy with its parameters and their "
                                                 "defaults. Any flag or config entry that names a policy takes them "
                                                 "as NAME:K=V[,K=V], e.g. --policy ep_aware:horizon_weight=2; each "
                                                 "policy's docstring (balancer/policies/) explains its parameters.")

    def run(self, args: argparse.Namespace, console: Console) -> int:
        for name in available_policies():
            cls = policy_class(name)
            params = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls))
            doc = next(iter((sys.modules[cls.__module__].__doc__ or cls.__doc__ or "").strip().splitlines()), "")
            console.print(f"[bold]{name}[/]({escape(params)})\n    {escape(doc.replace('``', ''))}",
                          soft_wrap=True)  # one line per signature, for grep
        console.print("parameters on any policy flag or config: NAME:K=V[,K=V], e.g. "
                      "--policy cache_aware:cache_threshold=0.5,balance_abs=8")
        return 0
