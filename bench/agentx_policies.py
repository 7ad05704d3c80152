"""Routing policies on the reproduced AgentX 440246 deployment (issue 23, part 3).

DeepSeek-V4-Pro on one 8-B200 vLLM engine (DP8/EP8), the closed-loop agentic replay of
``sim/workload/agentic.py`` run on pdlb's cluster simulator (``sim/run/closed_loop.py``: the SimPy
cluster, its lockstep EP step group with MTP, vLLM's prefill cadence and scheduler limits and the
CPU KV tier), as validated by ``pdlb sim validate --agentx-440246`` (docs/validate.md). Every turn
is routed by ``balancer.router.Router`` with the policy (its projected load and its own
approximate prefix index, as the live router has them; the session id is ``Request.session_id``);
the anchor is ``dp_consistent_hash``, what the measured deployment ran (vllm-router 0.1.14).

Load is the number of closed-loop lanes: the published 64 (1x), 96 (1.5x), 128 (2x), and 8 (1/8x,
"light load"). The SLO (stated in the output): a request meets it when its TTFT <= ``--ttft-slo-s``
and its mean ITL <= ``--itl-slo-ms``; a policy meets the SLO at a load when at least
``--attainment`` of its measured requests do. Printed per policy: its light-load attainment (so a
reader sees the SLO is one every policy meets when idle, not a threshold artefact), then per load:
completed requests per second, tokens/s per GPU, TTFT p50/p90/p99, ITL p50, mean latency, GPU hit
rate and attainment; and the highest load it meets the SLO at, with the GPUs that load needs
relative to the anchor (8 GPUs x anchor's lanes / policy's lanes at the SLO).

Run by hand (minutes of CPU per policy and load):
    python bench/agentx_policies.py --duration-s 1200
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.validation.agentx import simulate_440246  # noqa: E402
from sim.workload.agentic import AgenticWorkloadConfig  # noqa: E402

POLICIES = ("dp_consistent_hash", "consistent_hash", "cache_aware", "kv_cost", "scored", "least_load", "ep_aware")
LOADS = {"1/8x": 8, "1x": 64, "1.5x": 96, "2x": 128}


def run(policy: str, lanes: int, duration_s: float, ttft_slo_s: float, itl_slo_ms: float,
        seed: int = 42) -> dict[str, float]:
    wl = AgenticWorkloadConfig(lanes=lanes, duration_s=duration_s, seed=seed)
    r = simulate_440246(wl, policy)
    req = r.requests
    if len(req) == 0:
        raise RuntimeError(f"{policy} at {lanes} lanes: no measured request completed")
    ttft, e2e, out = req[:, 1], req[:, 2], req[:, 4]
    itl_ms = (e2e - ttft) / np.maximum(out - 1, 1) * 1e3
    m = r.metrics()
    return {"req_s": len(req) / m["duration_seconds"], "tput_gpu": m["tput_per_gpu"],
            "ttft50": float(np.percentile(ttft, 50)), "ttft90": float(np.percentile(ttft, 90)),
            "ttft99": float(np.percentile(ttft, 99)), "itl50": float(np.percentile(itl_ms, 50)),
            "e2e": float(e2e.mean()), "hit": m["server_gpu_cache_hit_rate"],
            "att": float(np.mean((ttft <= ttft_slo_s) & (itl_ms <= itl_slo_ms))), "wall_s": r.wall_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=1200.0, help="measured seconds per run (default 1200)")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policy specs")
    ap.add_argument("--ttft-slo-s", type=float, default=10.0, help="TTFT bound of the SLO, s (default 10)")
    ap.add_argument("--itl-slo-ms", type=float, default=30.0, help="mean-ITL bound of the SLO, ms (default 30)")
    ap.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet it (0.9)")
    ap.add_argument("--seed", type=int, default=42, help="workload seed (default 42, as the validate rows)")
    ap.add_argument("--loads", default=",".join(LOADS), help=f"comma-separated subset of {','.join(LOADS)} "
                    "(1/8x is needed for the light-load line, 1x for the ratios)")
    a = ap.parse_args(argv)
    pols = [p.strip() for p in a.policies.split(",") if p.strip()]
    loads = {k: LOADS[k] for k in (x.strip() for x in a.loads.split(",")) if k in LOADS}
    if not loads:
        ap.error(f"--loads: none of {','.join(LOADS)}")
    print(f"SLO: TTFT <= {a.ttft_slo_s:g} s and mean ITL <= {a.itl_slo_ms:g} ms for >= {a.attainment:.0%} of "
          f"requests; {a.duration_s:g} s measured per run; workload seed {a.seed}; loads {LOADS}")
    res: dict[tuple[str, str], dict[str, float]] = {}
    for p in pols:
        for load, lanes in loads.items():
            t0 = time.time()
            res[p, load] = m = run(p, lanes, a.duration_s, a.ttft_slo_s, a.itl_slo_ms, a.seed)
            print(f"{p:20s} {load:5s} lanes {lanes:3d}  req/s {m['req_s']:.2f}  tok/s/GPU {m['tput_gpu']:8,.0f}  "
                  f"TTFT p50/p90/p99 {m['ttft50']:.2f}/{m['ttft90']:.2f}/{m['ttft99']:.2f} s  ITL p50 "
                  f"{m['itl50']:.1f} ms  latency {m['e2e']:.1f} s  hit {m['hit']:.3f}  SLO {m['att']:.1%}  "
                  f"({time.time() - t0:.0f} s)", flush=True)
    if "1/8x" in loads:
        print("\nlight-load (1/8x) attainment: " + ", ".join(f"{p} {res[p, '1/8x']['att']:.1%}" for p in pols))
    anchor = pols[0]

    def best(p: str) -> tuple[str, int]:
        ok = [(ld, n) for ld, n in loads.items() if n >= 64 and res[p, ld]["att"] >= a.attainment]
        return max(ok, key=lambda x: x[1]) if ok else ("none of 1x-2x", 0)

    a_load, a_lanes = best(anchor)
    print(f"highest load meeting the SLO (of 1x/1.5x/2x), TTFT p99 there, vs {anchor}:")
    for p in pols:
        ld, n = best(p)
        p99 = res[p, ld]["ttft99"] if n else float("nan")
        gpus = 8 * a_lanes / n if n and a_lanes else float("nan")
        ratio = f"{n / a_lanes:.2f}x lanes" if n and a_lanes else "-"
        print(f"  {p:20s} {ld:12s} TTFT p99 {p99:6.2f} s   {ratio:12s}  GPUs for the anchor's load: {gpus:.1f}")
    for load in (x for x in ("1x", "1.5x", "2x") if x in loads):
        base = res[anchor, load]
        print(f"at {load}: " + ", ".join(f"{p} {res[p, load]['tput_gpu'] / base['tput_gpu']:.2f}x tok/s, "
                                         f"{res[p, load]['e2e'] / base['e2e']:.2f}x latency" for p in pols[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
