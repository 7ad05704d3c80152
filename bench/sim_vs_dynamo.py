#!/usr/bin/env python3
"""Benchmark: pdlb's simulator vs NVIDIA Dynamo's offline trace replay, same trace, same workers.

Runs Dynamo's replay (Rust mocker, via ../shared/peers/dynamo_replay.sh, installed into a
throwaway venv on first use) and pdlb on the Mooncake conversation trace with 8 aggregated
workers, for round robin and for each one's KV/cache-aware router (Dynamo ``kv_router``, pdlb
``kv_cost``), and prints wall times and the ratio pdlb / Dynamo (goal <= 1.0).

    .venv/bin/python bench/sim_vs_dynamo.py [--trace PATH] [--workers 8] [--repeats 1] [--pdlb-only]

``--pdlb-only`` skips Dynamo (e.g. on a machine without its toolchain) and prints pdlb's wall
time alone, with its events per request.

Both simulate the same arrivals; their models differ (Dynamo's mocker timing vs pdlb's roofline),
so the simulated metrics are printed side by side for sanity, not as a fidelity check.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sim.cluster import simulate  # noqa: E402
from sim.metrics import summarize  # noqa: E402
from sim.scenario import PoolConfig, Scenario  # noqa: E402
from sim.workload import read_trace  # noqa: E402

PEER = ROOT.parent / "shared" / "peers" / "dynamo_replay.sh"
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation.jsonl"


def run_dynamo(trace: Path, mode: str, workers: int) -> dict:
    out = subprocess.run(["bash", str(PEER), str(trace), mode, str(workers), "512"], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"dynamo replay failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_pdlb(trace: Path, policy: str, workers: int) -> tuple[float, dict]:
    t0 = time.perf_counter()
    requests = read_trace(trace)  # reading the trace is part of the job, as for Dynamo
    sc = Scenario(name=f"agg-{workers}", model="llama-3.1-8b", hardware="h100",
                  mixed=PoolConfig(num_engines=workers, max_prefill_tokens=8192))
    res = simulate(sc, requests, policy)
    wall = time.perf_counter() - t0
    s = summarize(res)
    s["events_per_request"] = res.num_waits / max(1, len(requests))
    return wall, s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1, help="take the best of N runs of each")
    ap.add_argument("--pdlb-only", action="store_true", help="skip Dynamo; time pdlb alone")
    args = ap.parse_args()
    if args.pdlb_only:
        print(f"trace {args.trace.name}, {args.workers} aggregated workers, best of {args.repeats} (pdlb only)")
        print(f"{'policy':<14}{'pdlb wall s':>13}{'events/request':>16}{'TTFT ms':>10}{'hit':>8}")
        for pol in ("round_robin", "kv_cost"):
            wall, s = min((run_pdlb(args.trace, pol, args.workers) for _ in range(args.repeats)), key=lambda r: r[0])
            print(f"{pol:<14}{wall:>13.2f}{s['events_per_request']:>16.2f}{1e3 * s['ttft_s']['mean']:>10.0f}"
                  f"{s['prefix_hit_rate']:>8.3f}", flush=True)
        return 0
    rows = []
    for dyn_mode, pdlb_policy in (("round_robin", "round_robin"), ("kv_router", "kv_cost")):
        dyn = min((run_dynamo(args.trace, dyn_mode, args.workers) for _ in range(args.repeats)), key=lambda d: d["wall_s"])
        pd_runs = [run_pdlb(args.trace, pdlb_policy, args.workers) for _ in range(args.repeats)]
        pd_wall, pd_sum = min(pd_runs, key=lambda r: r[0])
        rows.append((dyn_mode, pdlb_policy, dyn, pd_wall, pd_sum))
    print(f"trace {args.trace.name}, {args.workers} aggregated workers, best of {args.repeats}")
    print(f"{'router':<24}{'dynamo wall s':>14}{'pdlb wall s':>13}{'pdlb/dynamo':>13}"
          f"{'dyn TTFT ms':>13}{'pdlb TTFT ms':>14}{'dyn reuse':>11}{'pdlb hit':>10}")
    for dyn_mode, pol, dyn, pd_wall, s in rows:
        print(f"{dyn_mode + ' / ' + pol:<24}{dyn['wall_s']:>14.2f}{pd_wall:>13.2f}{pd_wall / dyn['wall_s']:>13.2f}"
              f"{dyn['mean_ttft_ms']:>13.0f}{1e3 * s['ttft_s']['mean']:>14.0f}"
              f"{dyn['prefix_cache_reused_ratio']:>11.3f}{s['prefix_hit_rate']:>10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
