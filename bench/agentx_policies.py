"""Routing policies on the reproduced AgentX 440246 deployment, as a capacity answer (issue 23, part 3).

DeepSeek-V4-Pro on one 8-B200 vLLM engine (DP8/EP8), the closed-loop agentic replay of
``sim/workload/agentic.py`` run on pdlb's cluster simulator (``sim/run/closed_loop.py``: the SimPy
cluster, its lockstep EP step group with MTP, vLLM's prefill cadence and scheduler limits, 16
sequences per rank, and the CPU KV tier), as validated by ``pdlb sim validate --agentx-440246``
(docs/validate.md). Every turn is routed by ``balancer.router.Router`` with the policy (its
projected load and its own approximate prefix index, as the live router has them; the session id
is ``Request.session_id``); the router is given the SLO's TTFT bound as its TTFT budget
(``RouterConfig.ttft_slo``; SLO-aware policies route against it; ``--no-router-budget``: none;
``ep_aware`` uses it on wide-EP pools only with ``slo_wide_ep=true``).
The anchor is ``dp_consistent_hash``, what the measured deployment ran (vllm-router 0.1.14).

Load is the number of closed-loop lanes: the published 64 (1x), 96 (1.5x), 128 (2x), and 8 (1/8x,
"light load"). The SLO (stated in the output): a request meets it when its TTFT <= ``--ttft-slo-s``
and its mean ITL <= ``--itl-slo-ms``; a policy meets the SLO at a load when at least
``--attainment`` of its measured requests do.

The error band is part 1's: one validation run of the measured point (``--band-duration-s``
seconds, seed 42, the deployed router, as ``pdlb sim validate --agentx-440246``) gives the
simulator's largest |error| on the published TTFT rows (mean, p50, p90, p95) and ITL rows. Each
attainment is then also computed with every simulated TTFT and ITL made that much worse
(pessimistic) and better (optimistic), and the capacity answer is given for all three.

Printed: per policy its light-load attainment (so a reader sees the SLO is one every policy meets
when idle), per load the completed requests per second, tokens/s per GPU, TTFT p50/p90/p99, ITL
p50, mean latency, GPU hit rate and attainment (nominal and the band), and the capacity answer:
the highest load (of 1x / 1.5x / 2x) each policy meets the SLO at, the request rate it completes
there, and the GPUs it needs for the measured load (8 GPUs x 64 lanes / its lanes, for replicas of
the same engine), nominal and over the band.

Run by hand (each run is seconds to a few minutes of CPU; 13 policies x 4 loads)::

    python bench/agentx_policies.py --duration-s 1200 --jobs 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from balancer.policies.spec import split_policy_list  # noqa: E402
from balancer.types import TtftSlo  # noqa: E402
from sim.validation.agentx import FRONTEND_S_PER_TOKEN_MEASURED, run_rows, simulate_440246  # noqa: E402
from sim.workload.agentic import AgenticWorkloadConfig  # noqa: E402

#: ``ep_aware`` is SLO-blind on this wide-EP pool by default (``slo_wide_ep=false``); ``slo_wide_ep=true``
#: routes it against the router's TTFT budget. It prices vLLM's 512-token chunk limit and prefill
#: cadence of this engine by default (``cadence=true``); ``cadence=false`` is the pricing before them.
#: ``spec_decode=true`` prices MTP's 2.49 accepted tokens per decode step (off by default: one token per step).
#: ``parallel_chunks=true`` prices a prompt's group terms as chunks in parallel, not by FIFO draining (off by default)
#: ``session_forecast=true,prefill_at_once=true`` reads what the router tracks itself: idle sessions that will return
#: to each rank, the prompts each rank prefills at once (off by default; docs/policies/ep_aware.md)
POLICIES = ("dp_consistent_hash", "consistent_hash", "cache_aware", "kv_cost", "scored", "least_load",
            "ep_aware", "ep_aware:session_forecast=true,prefill_at_once=true", "ep_aware:parallel_chunks=true",
            "ep_aware:spec_decode=true", "ep_aware:slo_wide_ep=true",
            "ep_aware:cadence=false", "ep_aware:cadence=false,slo_wide_ep=true")
LOADS = {"1/8x": 8, "1x": 64, "1.5x": 96, "2x": 128}
MEASURED_LANES = 64
MEASURED_GPUS = 8
TTFT_ROWS = ("ttft-mean", "ttft-p50", "ttft-p90", "ttft-p95")
ITL_ROWS = ("itl-mean", "itl-p50", "itl-p90", "itl-p95")


def error_band(duration_s: float, frontend_s_per_token: float = FRONTEND_S_PER_TOKEN_MEASURED) -> dict[str, float]:
    """The simulator's largest |error| against the published point on the TTFT and ITL rows
    (:func:`sim.validation.agentx.run_rows`, the deployed router, workload seed 42)."""
    rows, _ = run_rows(duration_s=duration_s, frontend_s_per_token=frontend_s_per_token)
    by = {r.key: abs(r.error) for r in rows}
    return {"ttft": max(by[k] for k in TTFT_ROWS), "itl": max(by[k] for k in ITL_ROWS)}


def attainment(ttft_s: np.ndarray, itl_ms: np.ndarray, ttft_slo_s: float, itl_slo_ms: float,
               ttft_scale: float = 1.0, itl_scale: float = 1.0) -> float:
    """Share of requests with ``ttft * ttft_scale <= ttft_slo_s`` and ``itl * itl_scale <= itl_slo_ms``."""
    return float(np.mean((ttft_s * ttft_scale <= ttft_slo_s) & (itl_ms * itl_scale <= itl_slo_ms)))


def run(policy: str, lanes: int, duration_s: float, ttft_slo_s: float, itl_slo_ms: float, seed: int,
        router_budget: bool, band: dict[str, float], frontend_s_per_token: float = 0.0) -> dict[str, float]:
    wl = AgenticWorkloadConfig(lanes=lanes, duration_s=duration_s, seed=seed)
    t0 = time.process_time()
    r = simulate_440246(wl, policy, ttft_slo=TtftSlo(ttft_slo_s) if router_budget else None,
                        frontend_s_per_token=frontend_s_per_token)
    req = r.requests
    if len(req) == 0:
        raise RuntimeError(f"{policy} at {lanes} lanes: no measured request completed")
    ttft, e2e, out = req[:, 1], req[:, 2], req[:, 4]
    itl_ms = (e2e - ttft) / np.maximum(out - 1, 1) * 1e3
    m = r.metrics()
    eT, eI = band.get("ttft", 0.0), band.get("itl", 0.0)
    return {"req_s": len(req) / m["duration_seconds"], "tput_gpu": m["tput_per_gpu"],
            "ttft50": float(np.percentile(ttft, 50)), "ttft90": float(np.percentile(ttft, 90)),
            "ttft99": float(np.percentile(ttft, 99)), "itl50": float(np.percentile(itl_ms, 50)),
            "e2e": float(e2e.mean()), "hit": m["server_gpu_cache_hit_rate"],
            "att": attainment(ttft, itl_ms, ttft_slo_s, itl_slo_ms),
            "att_lo": attainment(ttft, itl_ms, ttft_slo_s, itl_slo_ms, 1 + eT, 1 + eI),
            "att_hi": attainment(ttft, itl_ms, ttft_slo_s, itl_slo_ms, max(1 - eT, 0.0), max(1 - eI, 0.0)),
            "cpu_s": time.process_time() - t0}


def highest_load(res: dict, policy: str, loads: dict[str, int], target: float, key: str) -> tuple[str, int]:
    """The highest of the 1x-2x loads at which ``res[policy, load][key] >= target``: ``(load, lanes)``,
    or ``("none", 0)``."""
    ok = [(ld, n) for ld, n in loads.items() if n >= MEASURED_LANES and res[policy, ld][key] >= target]
    return max(ok, key=lambda x: x[1]) if ok else ("none", 0)


def main(argv: list[str] | None = None) -> int:
    from pdlb_cli.args import ArgumentParser  # one usage line, then the error
    from pdlb_cli.arg_types import fraction, nonnegative_float, positive_float, positive_int, seed_int

    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=positive_float, default=1200.0, help="measured seconds per run (default 1200)")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policy specs, the first "
                    "is the anchor (a part key=value continues the spec before it; default: %(default)s)")
    ap.add_argument("--ttft-slo-s", type=positive_float, default=10.0, help="TTFT bound of the SLO, s (default 10)")
    ap.add_argument("--itl-slo-ms", type=positive_float, default=30.0, help="mean-ITL bound of the SLO, ms (default 30)")
    ap.add_argument("--attainment", type=fraction, default=0.9, help="share of requests that must meet it (0.9)")
    ap.add_argument("--seed", type=seed_int, default=42, help="workload seed (default 42, as the validate rows)")
    ap.add_argument("--loads", default=",".join(LOADS), help=f"comma-separated subset of {','.join(LOADS)} "
                    "(1/8x is needed for the light-load line)")
    ap.add_argument("--no-router-budget", action="store_true", help="give the router no TTFT budget")
    ap.add_argument("--band-duration-s", type=nonnegative_float, default=3600.0,
                    help="measured seconds of the validation run behind the error band (default the published "
                         "3600; 0 = no band)")
    ap.add_argument("--frontend-s-per-token", type=nonnegative_float, default=FRONTEND_S_PER_TOKEN_MEASURED,
                    help="the API server's tokenization per prompt token, s, as the validation rows have it "
                         "(default %(default)g; 0 = off)")
    ap.add_argument("--jobs", type=positive_int, default=1, help="runs in parallel (processes, default 1)")
    ap.add_argument("--out", type=Path, default=None, help="write every figure as JSON here")
    a = ap.parse_args(argv)
    pols = split_policy_list(a.policies)
    from pdlb_cli.comma_lists import list_arg, one_of

    loads = {k: LOADS[k] for k in list_arg(ap, "--loads", a.loads, f"loads of {', '.join(LOADS)}", one_of(LOADS))}
    if not pols:
        ap.error("--policies: none given")
    band = error_band(a.band_duration_s, a.frontend_s_per_token) if a.band_duration_s > 0 else {}
    print(f"SLO: TTFT <= {a.ttft_slo_s:g} s and mean ITL <= {a.itl_slo_ms:g} ms for >= {a.attainment:.0%} of "
          f"requests; router TTFT budget: {'none' if a.no_router_budget else f'{a.ttft_slo_s:g} s'}; "
          f"{a.duration_s:g} s measured per run; workload seed {a.seed}; loads (lanes) {loads}; API-server "
          f"tokenization {a.frontend_s_per_token * 1e6:g} us per prompt token")
    if band:
        print(f"error band (part 1: |simulated / published - 1| at the measured point, {a.band_duration_s:g} s, "
              f"seed 42, dp_consistent_hash): TTFT rows up to {band['ttft']:.1%}, ITL rows up to {band['itl']:.1%}; "
              "'lo'/'hi': attainment with every TTFT and ITL that much worse / better")
    jobs = [(p, ld) for p in pols for ld in loads]
    res: dict[tuple[str, str], dict[str, float]] = {}
    args = [(p, loads[ld], a.duration_s, a.ttft_slo_s, a.itl_slo_ms, a.seed, not a.no_router_budget, band,
             a.frontend_s_per_token) for p, ld in jobs]
    with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as ex:
        for (p, ld), m in zip(jobs, ex.map(run, *zip(*args))):
            res[p, ld] = m
            print(f"{p:24s} {ld:5s} lanes {loads[ld]:3d}  req/s {m['req_s']:.2f}  tok/s/GPU {m['tput_gpu']:8,.0f}  "
                  f"TTFT p50/p90/p99 {m['ttft50']:.2f}/{m['ttft90']:.2f}/{m['ttft99']:.1f} s  ITL p50 "
                  f"{m['itl50']:.1f} ms  latency {m['e2e']:.1f} s  hit {m['hit']:.3f}  SLO {m['att']:.1%} "
                  f"(lo {m['att_lo']:.1%}, hi {m['att_hi']:.1%})  [{m['cpu_s']:.0f} s CPU]", flush=True)
    if "1/8x" in loads:
        print("\nlight-load (1/8x) attainment: " + ", ".join(f"{p} {res[p, '1/8x']['att']:.1%}" for p in pols))
    print(f"\ncapacity answer: highest load (of 1x/1.5x/2x) meeting the SLO; GPUs for the measured load "
          f"({MEASURED_LANES} lanes) = {MEASURED_GPUS} x {MEASURED_LANES} / lanes at SLO ('>8': none of these loads)")
    for p in pols:
        parts = []
        for key, label in (("att", "nominal"), ("att_lo", "band lo"), ("att_hi", "band hi")):
            if key != "att" and not band:
                continue
            ld, n = highest_load(res, p, loads, a.attainment, key)
            gpus = f"{MEASURED_GPUS * MEASURED_LANES / n:.1f}" if n else f">{MEASURED_GPUS}"
            rate = f"{res[p, ld]['req_s']:.2f} req/s, TTFT p99 {res[p, ld]['ttft99']:.1f} s" if n else "-"
            parts.append(f"{label}: {ld} ({rate}), {gpus} GPUs")
        print(f"  {p:24s} " + "; ".join(parts))
    anchor = pols[0]
    for load in (x for x in ("1x", "1.5x", "2x") if x in loads):
        base = res[anchor, load]
        print(f"at {load} vs {anchor}: " + ", ".join(
            f"{p} {res[p, load]['tput_gpu'] / base['tput_gpu']:.2f}x tok/s, SLO {res[p, load]['att']:.1%}"
            for p in pols[1:]))
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"slo": {"ttft_s": a.ttft_slo_s, "itl_ms": a.itl_slo_ms, "attainment": a.attainment},
                                     "router_budget": not a.no_router_budget, "duration_s": a.duration_s,
                                     "seed": a.seed, "band": band, "loads": loads,
                                     "frontend_s_per_token": a.frontend_s_per_token,
                                     "runs": [{"policy": p, "load": ld, **m} for (p, ld), m in res.items()]},
                                    indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
