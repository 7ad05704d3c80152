#!/usr/bin/env python3
"""Benchmark: simulator wall time, peak memory and events per request as the workload grows.

Synthetic Poisson workloads (10k / 100k / 1M requests; prompt mean 2,000 tokens with shared
prefixes, output mean 300) through a DeepSeek-V3 PD cluster whose decode pool has 64 .. 512 DP
ranks (EP64 engines) and a proportional prefill pool; the arrival rate scales with the cluster so
the load per rank stays constant. Each configuration runs in a fresh subprocess so peak RSS is its
own. The baseline row is the smallest configuration: ``wall / baseline`` against
``requests / baseline requests`` shows whether growth is linear.

    .venv/bin/python bench/sim_scaling.py [--sizes 10000,100000] [--decode-ranks 64,512]
        [--max-prefill-tokens 8192] [--exact]

``--max-prefill-tokens`` sets the chunked-prefill budget (smaller = more chunk steps per prompt);
``--exact`` runs the step-by-step reference mode (no fast-forward) to show what fast-forward saves.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(n: int, decode_ranks: int, max_prefill_tokens: int = 8192, exact: bool = False) -> dict:
    sys.path.insert(0, str(ROOT))
    from sim.run.cluster import simulate
    from sim.scenario import PoolConfig, Scenario
    from sim.workload import poisson_workload

    engines = decode_ranks // 64
    # ~0.08 req/s per decode rank keeps every configuration at the same per-rank load
    reqs = poisson_workload(n, rate_per_s=0.08 * decode_ranks, prompt_tokens_mean=2000, output_tokens_mean=300,
                            seed=0, shared_prefix_tokens=1024, num_prefix_groups=64)
    sc = Scenario(name="scale", model="deepseek-v3", hardware="h200",
                  prefill=PoolConfig(num_engines=engines * 2, dp_ranks=8, max_prefill_tokens=max_prefill_tokens),
                  decode=PoolConfig(num_engines=engines, dp_ranks=64), fast_forward=not exact)
    t0 = time.perf_counter()
    res = simulate(sc, reqs, "kv_cost")
    wall = time.perf_counter() - t0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"requests": n, "decode_ranks": decode_ranks, "wall_s": wall, "peak_rss_mb": rss_mb,
            "events_per_request": res.num_waits / n, "steps": res.num_steps}


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pdlb_cli.args import ArgumentParser  # one usage line, then the error
    from pdlb_cli.arg_types import positive_int

    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--decode-ranks", default="64,128,512")
    ap.add_argument("--max-prefill-tokens", type=positive_int, default=8192, help="chunked-prefill budget per rank")
    ap.add_argument("--exact", action="store_true", help="step-by-step reference mode (no fast-forward)")
    ap.add_argument("--one", nargs=2, type=positive_int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, args.max_prefill_tokens, args.exact)))
        return 0
    extra = ["--max-prefill-tokens", str(args.max_prefill_tokens)] + (["--exact"] if args.exact else [])
    sys.path.insert(0, str(ROOT))
    from pdlb_cli.args import positive_int
    from pdlb_cli.comma_lists import list_arg

    rows = []
    for ranks in list_arg(ap, "--decode-ranks", args.decode_ranks, "rank counts >= 1", positive_int):
        for n in list_arg(ap, "--sizes", args.sizes, "request counts >= 1", positive_int):
            out = subprocess.run([sys.executable, __file__, "--one", str(n), str(ranks), *extra],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            rows.append(json.loads(out.stdout))
            r, b = rows[-1], rows[0]
            print(f"{r['requests']:>9} req {r['decode_ranks']:>4} decode ranks: wall {r['wall_s']:8.1f} s "
                  f"({r['wall_s'] / b['wall_s']:6.1f}x for {r['requests'] / b['requests']:.0f}x requests)  "
                  f"peak RSS {r['peak_rss_mb']:7.0f} MB  events/request {r['events_per_request']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
