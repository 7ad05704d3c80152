#!/usr/bin/env python3
"""Benchmark: a full ``--search rate`` for every policy on the embedded trace, serial vs a local
process pool vs Ray, with and without early stop of failing points.

Every mode runs the same searches (:func:`sim.search.capacity.run_searches`; with more policies than
slots each search evaluates one rate per round, so every mode evaluates the same points) and must
find the same answers (checked). Printed: wall time per mode and its speed-up over the serial
baseline measured in the same run, simulations run, and the answers with their ratio to the best
anchor policy.

    .venv/bin/python bench/capacity_search.py [--modes serial,process,ray,serial-full] [--jobs 2]
        [--limit N] [--policies a,b] [--slo-ttft-s 2 --slo-ttft-per-1k-tokens-s 0.5 --slo-attainment 0.9]

``serial-full`` is the serial search with early stop off (every failing point run to the end):
the speed-up of ``serial`` over it is what early stop saves. The default SLO (90% of requests
within TTFT 2 s + 0.5 s per 1k prompt tokens, TPOT 100 ms) is reachable at zero load on the
default scenario; the flat 2 s TTFT is not (17% of the trace's requests cannot prefill in
2 s on one H200 DP rank), which every search would report at once without simulating.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_mode(mode: str, policies: list[str], args: argparse.Namespace) -> tuple[float, list]:
    from sim.search.capacity import RateSearch, run_searches
    from sim.search.executor import ProcessExecutor, RayExecutor, SerialExecutor
    from sim.search.point import SLO, WorkloadSpec, parse_policy
    from sim.scenario import load_scenario

    sc = load_scenario(args.scenario)
    wl = WorkloadSpec(limit=args.limit)
    slo = SLO(ttft_s=args.slo_ttft_s, tpot_s=args.slo_tpot_s, attainment=args.slo_attainment,
              ttft_per_1k_prompt_tokens_s=args.slo_ttft_per_1k_tokens_s)
    searches = [RateSearch(sc, wl, parse_policy(p), slo, tol=args.tol, early_stop=mode != "serial-full")
                for p in policies]
    t0 = time.perf_counter()
    if mode in ("serial", "serial-full"):
        ex = SerialExecutor()
    elif mode == "process":
        ex = ProcessExecutor(args.jobs)
    elif mode == "ray":
        ex = RayExecutor(num_cpus=args.jobs)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    with ex:
        results = run_searches(searches, ex)
    return time.perf_counter() - t0, results


def build_parser() -> argparse.ArgumentParser:
    """The options, each value checked as ``pdlb sim capacity`` checks its own (review R7, session 16:
    ``--jobs 0`` silently meant every core, negative SLOs and tolerances ran)."""
    from pdlb_cli.args import ArgumentParser, fraction, nonnegative_float, positive_float, positive_int

    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="serial,process,ray", help="comma-separated: serial, process, ray, serial-full")
    ap.add_argument("--jobs", type=positive_int, default=len(os.sched_getaffinity(0)), help="process pool / Ray CPUs")
    ap.add_argument("--limit", type=positive_int, help="first N requests of the trace (default: all)")
    ap.add_argument("--policies", help="comma-separated (default: every registered policy)")
    ap.add_argument("--scenario", default="dsv3-pd-h200")
    ap.add_argument("--tol", type=positive_float, default=0.02, help="rate search tolerance (default 0.02)")
    ap.add_argument("--slo-ttft-s", type=positive_float, default=2.0)
    ap.add_argument("--slo-tpot-s", type=positive_float, default=0.1)
    ap.add_argument("--slo-attainment", type=fraction, default=0.9)
    ap.add_argument("--slo-ttft-per-1k-tokens-s", type=nonnegative_float, default=0.5)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)

    from balancer.policies import available_policies
    from sim.search.capacity_report import rate_ratios

    from pdlb_cli.comma_lists import list_arg, one_of

    policies = (list_arg(ap, "--policies", args.policies, "policies", one_of(available_policies()))
                if args.policies else available_policies())
    modes = list_arg(ap, "--modes", args.modes, "modes", one_of(("serial", "process", "ray", "serial-full")))
    print(f"{len(policies)} policies, scenario {args.scenario}, {args.limit or 'all'} requests, tol {args.tol}, "
          f"{os.cpu_count()} cores visible, load average {os.getloadavg()[0]:.1f} at start")
    runs = {}
    for mode in modes:
        if mode == "ray":
            try:
                import ray  # noqa: F401
            except ImportError:
                print("ray: not installed (pip install 'pdlb[ray]'), skipped")
                continue
        wall, results = run_mode(mode, policies, args)
        runs[mode] = (wall, results)
        sims = sum(len(r.points) for r in results)
        print(f"{mode:<12} {wall:7.1f} s  {sims} simulations  (load average {os.getloadavg()[0]:.1f})")
    base_mode = "serial" if "serial" in runs else next(iter(runs))
    base_wall, base = runs[base_mode]
    print(f"\nspeed-up over {base_mode} (same run):")
    for mode, (wall, results) in runs.items():
        same = [(r.status, r.rate_scale) for r in results] == [(r.status, r.rate_scale) for r in base]
        print(f"  {mode:<12} x{base_wall / wall:.2f}  answers {'identical' if same else 'DIFFER'}")
    print("\npolicy            status        rate scale   req/s   evals  vs best anchor")
    for r, ratio in zip(base, rate_ratios(base)):
        rs = f"{r.rate_scale:.4f}" if r.rate_scale else "-"
        rps = f"{r.rate_rps:.3f}" if r.rate_rps else "-"
        print(f"  {r.policy:<16} {r.status:<13} {rs:>10} {rps:>7} {len(r.points):>6}  "
              f"{f'{ratio:.2f}' if ratio else '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
