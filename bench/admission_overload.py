"""Deadline admission under a tenant's burst and under 2x overload: simulator and live, with vs without.

Run by hand::

    .venv/bin/python bench/admission_overload.py                    # simulator (60 s runs) and live (30 s runs)
    .venv/bin/python bench/admission_overload.py --no-live          # simulator only (a few seconds)
    .venv/bin/python bench/admission_overload.py --live-duration-s 60 --json out.json
    .venv/bin/python bench/admission_overload.py --no-live --wait-models   # + the gate's wait models, ep_aware (~10 s)

Simulator: :func:`sim.experiments.overload.burst_table` (Llama-3.1-8B on H100, 2 prefill + 2 decode
engines, three tenants, TTFT SLO 1 s). Live: :func:`sim.experiments.overload_live.live_table` (the
router service in process in front of four emulated SGLang PD engines slowed 10x, TTFT SLO 2.5 s,
the client's TTFT). Each scenario runs with admission off (the baseline, measured in the same run)
and on; the table prints SLO attainment (all tenants; tenants A and C, the ones not bursting),
goodput, TTFT percentiles of the served requests, sheds, and requests without an answer (must be 0).
Ratios: goodput on / off; the others' attainment under the burst minus their attainment without it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sim.experiments.overload import burst_table, wait_model_table  # noqa: E402
from sim.experiments.overload_live import live_table  # noqa: E402


def _others(run: dict) -> float:
    return (run["by_tenant"].get("A", math.nan) + run["by_tenant"].get("C", math.nan)) / 2


def print_table(title: str, runs: dict) -> None:
    print(f"\n{title}: capacity {runs['capacity_rps']:.2f} req/s, TTFT SLO {runs['ttft_slo_s']} s")
    print(f"{'run':<14} {'requests':>8} {'SLO att.':>9} {'A,C att.':>9} {'goodput r/s':>11} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'shed':>6} {'unanswered':>10}")
    for key, r in runs.items():
        if not isinstance(r, dict):
            continue
        shed = r.get("num_shed", r.get("outcomes", {}).get("shed", 0))
        print(f"{key:<14} {r['requests']:>8} {100 * r['slo_attainment']:>8.1f}% {100 * _others(r):>8.1f}% "
              f"{r['goodput_rps']:>11.2f} {r['ttft_p50_s']:>9.2f} {r['ttft_p99_s']:>9.2f} {shed:>6} "
              f"{r['requests'] - r['answered']:>10}")
    for label in ("off", "on"):
        if f"calm/{label}" in runs and f"burst/{label}" in runs:
            d = 100 * (_others(runs[f"burst/{label}"]) - _others(runs[f"calm/{label}"]))
            print(f"burst vs calm, admission {label}: tenants A, C attainment {d:+.1f} points")
    if "overload/on" in runs:
        on, off = runs["overload/on"]["goodput_rps"], runs["overload/off"]["goodput_rps"]
        print(f"overload goodput, admission on / off: {on:.2f} / {off:.2f} = {on / off:.1f}x")


def main(argv: list[str] | None = None) -> int:
    from pdlb_cli.arg_types import positive_float, seed_int
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sim-duration-s", type=positive_float, default=60.0)
    p.add_argument("--live-duration-s", type=positive_float, default=30.0)
    p.add_argument("--no-live", action="store_true")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    p.add_argument("--wait-models", action="store_true",
                   help="also compare the gate's wait models (backlog, policy, max) with ep_aware: the burst table "
                        "and wide EP on the Mooncake trace")
    a = p.parse_args(argv)
    out = {}
    t0 = time.perf_counter()
    out["sim"] = burst_table(duration_s=a.sim_duration_s, seed=a.seed)
    print_table(f"simulator ({time.perf_counter() - t0:.0f} s)", out["sim"])
    if not a.no_live:
        t0 = time.perf_counter()
        out["live"] = live_table(duration_s=a.live_duration_s, seed=a.seed)
        print_table(f"live, loopback, emulated engines ({time.perf_counter() - t0:.0f} s)", out["live"])
    if a.wait_models:
        t0 = time.perf_counter()
        out["sim_ep_aware"] = {}
        for wm in ("backlog", "policy", "max"):
            out["sim_ep_aware"][wm] = burst_table(duration_s=a.sim_duration_s, seed=a.seed, policy="ep_aware",
                                                  wait_model=wm)
            print_table(f"simulator, ep_aware, wait model {wm}", out["sim_ep_aware"][wm])
        out["wait_models"] = w = wait_model_table(seed=a.seed)
        print(f"\nwide EP ({w['scenario']}, Mooncake trace, {w['requests']} requests at 3x, {w['routing_policy']}, "
              f"TTFT SLO 2 s; {time.perf_counter() - t0:.0f} s)")
        print(f"{'wait model':<11} {'SLO att.':>9} {'goodput r/s':>11} {'admitted':>8} {'met SLO':>8} "
              f"{'met own deadline':>16} {'TTFT p50':>9} {'TTFT p99':>9}")
        for wm in ("backlog", "policy", "max"):
            r = w[wm]
            print(f"{wm:<11} {100 * r['slo_attainment']:>8.1f}% {r['goodput_rps']:>11.2f} {r['admitted']:>8} "
                  f"{r['admitted_met_slo']:>8} {r['admitted_met_deadline']:>8} ({100 * r['admitted_met_deadline'] / max(1, r['admitted']):.1f}%) "
                  f"{r['ttft_p50_s']:>9.2f} {r['ttft_p99_s']:>9.2f}")
        out["wait_models_light"] = light = wait_model_table(("policy",), rate_scale=0.3, seed=a.seed)
        for label, r in (("3x, policy", w["policy"]), ("0.3x, policy", light["policy"])):
            e = r["prefill_error_s"]
            print(f"ep_aware's predicted prefill at dispatch vs simulated, {label}: error (simulated - predicted) "
                  f"p1 {e['p1']:+.3f} s, p50 {e['p50']:+.3f} s, p99 {e['p99']:+.3f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
