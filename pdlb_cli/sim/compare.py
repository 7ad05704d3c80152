"""``pdlb sim compare``: every policy (or the ones named) on the same workload, one table.

    pdlb sim compare                                   # every registered policy, the default scenario
    pdlb sim compare --policies round_robin,cache_aware:cache_threshold=0.5,balance_abs=8
    pdlb sim compare --policy ep_aware --policy least_load --decode-policy least_load

Each policy routes both pools (or the prefill pool, with ``--decode-policy`` for the decode pool);
the runs share the workload and scenario and run in ``--jobs`` local processes
(:func:`pdlb_cli.sim.run.run_policies`).
"""

from __future__ import annotations

import argparse

from rich.console import Console

from balancer.policies import available_policies
from pdlb_cli.args import policy_list, positive_int
from pdlb_cli.sim.run import add_policy_module_arg, add_run_options, policy_runs, run_policies
from sim.search.host import default_jobs
from sim.scenario import load_scenario


class Compare:
    """``pdlb sim compare`` (:class:`pdlb_cli.command.Subcommand`)."""

    name = "compare"

    def add_parser(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        cmp_ = subparsers.add_parser("compare", help="run several policies on the same workload and compare them",
                                     description="Run each policy (for both the prefill and the decode pool) on the same "
                                                 "workload and print a comparison table; writes per-request CSVs, "
                                                 "summary.json and plots.")
        cmp_.add_argument("--policies", default=",".join(available_policies()), metavar="A,B:K=V,...",
                          help="comma-separated policies, each NAME or NAME:K=V[,K=V] (e.g. round_robin,"
                               "cache_aware:cache_threshold=0.5,balance_abs=8; see 'pdlb policies'; default: all: "
                               "%(default)s)")
        cmp_.add_argument("--policy", dest="policy_specs", action="append", default=[], metavar="NAME[:K=V,...]",
                          help="a policy with parameters, e.g. --policy cache_aware:cache_threshold=0.5,balance_abs=8 "
                               "(repeatable; instead of --policies, not with it; as in 'pdlb sim capacity')")
        cmp_.add_argument("--decode-policy", metavar="NAME[:K=V,...]",
                          help="use this policy for the decode pool in every run (default: the run's policy)")
        add_policy_module_arg(cmp_)
        add_run_options(cmp_)
        cmp_.add_argument("--jobs", "-j", type=positive_int, default=default_jobs(), metavar="N",
                          help="policies simulated at once, in local worker processes (default: this machine's cores, "
                               "%(default)s; 1 = one after another in this process)")
        return cmp_

    def run(self, args: argparse.Namespace, console: Console) -> int:
        """Check the policy list (no name with the same parameters twice, ``--policy`` or
        ``--policies`` but not both, no ``--decode-policy`` on an aggregated scenario), then run it."""
        if args.policy_specs and "policies" in args.given:
            raise ValueError("--policy and --policies both given: --policy replaces the list, so --policies would be "
                             "ignored; give one (repeat --policy for several)")
        flag = "--policy" if args.policy_specs else "--policies"
        names = list(args.policy_specs) or policy_list(args.policies)
        if args.decode_policy and not load_scenario(args.scenario).disaggregated:
            raise ValueError(f"--decode-policy: scenario {args.scenario!r} is aggregated (one mixed pool, "
                             "routed by the decode policy): every run would use "
                             f"{args.decode_policy}; compare with --policies instead")
        runs = policy_runs(args, [(flag, p, args.decode_policy) for p in names])
        seen: dict[str, str] = {}  # same policies and parameters (defaults spelled out or not)
        for p, d, plabel, _ in runs:
            key = repr((p.name, sorted(p.params().items()), d.name, sorted(d.params().items())))
            if key in seen:
                same = "" if seen[key] == plabel else f" (the same policy as {seen[key]})"
                raise ValueError(f"{flag}: {plabel} given more than once{same}")
            seen[key] = plabel
        return run_policies(args, runs, console)
