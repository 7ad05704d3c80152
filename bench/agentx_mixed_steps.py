#!/usr/bin/env python3
"""Why a policy's requests miss the ITL bound on the reproduced AgentX 440246 deployment: how many of
the EP group's steps carry prefill, and why (issue 23, part 3).

One closed-loop run of point 440246 per policy and workload seed (as ``bench/agentx_policies.py``
runs it: the router given the SLO's 10 s TTFT budget, the API server's tokenization on). Any step in
which some DP rank prefills is a mixed step for the whole EP group (at least 115.94 ms with the eager
floor, about 250 ms at these loads, against ~34 ms decode-only), and under vLLM's prefill cadence
(interval 8) a step carries prefill for one of three reasons (``StepGroup`` counts them):

- ``open``: a step open to prefill (every 8th) while some rank has a prompt in prefill;
- ``bound``: a step between open ones on which a capacity-bound rank prefilled (after its last
  prefill-capable step a prompt still waited for admission: its 16 sequence slots full, or no KV
  room), so its admitted prompts' chunks run on every step until the prompt is admitted;
- ``idle``: one on which a rank with nothing to decode prefilled.

Printed per run, over the measured window (sampled each simulated second): the share of requests
meeting the SLO (TTFT <= 10 s, mean ITL <= 30 ms), ITL p50, GPU hit rate, the share of the group's
steps with prefill by reason, the share of its step time in steps with prefill, and the mean step
with and without prefill; then, over all runs, the correlation of each share with the SLO share.

    python bench/agentx_mixed_steps.py --seeds 42,1 --jobs 2
    python bench/agentx_mixed_steps.py --policies scored,ep_aware --lanes 96 --duration-s 600

About 8-10 s of CPU per run at 128 lanes and 1,200 s.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from balancer.policies.spec import split_policy_list  # noqa: E402

POLICIES = "scored,cache_aware,ep_aware,ep_aware:session_forecast=true,prefill_at_once=true"
#: the group counters sampled each simulated second
COUNTERS = ("num_steps", "busy_s", "prefill_busy_s", "open_prefill_steps", "bound_prefill_steps", "idle_prefill_steps")


def run(spec: str, lanes: int, duration_s: float, seed: int) -> dict[str, float | str | int]:
    """One run's figures (module docstring) over its measured window."""
    from balancer.types import TtftSlo
    from sim.run.closed_loop import simulate_closed_loop
    from sim.validation.agentx import FRONTEND_S_PER_TOKEN_MEASURED, perf_factory_440246, scenario_440246
    from sim.workload.agentic import AgenticWorkloadConfig

    samples: list[tuple[float, ...]] = []

    def hook(cluster) -> None:  # noqa: ANN001
        env, groups = cluster.env, cluster.groups

        def sample():  # noqa: ANN202 (SimPy generator)
            while True:
                samples.append((env.now,) + tuple(float(sum(getattr(g, c) for g in groups)) for c in COUNTERS))
                yield env.timeout(1.0)
        env.process(sample())

    t0 = time.process_time()
    r = simulate_closed_loop(scenario_440246(), AgenticWorkloadConfig(lanes=lanes, duration_s=duration_s, seed=seed),
                             spec, perf_factory=perf_factory_440246(), ttft_slo=TtftSlo(10.0),
                             frontend_s_per_token=FRONTEND_S_PER_TOKEN_MEASURED, cluster_hook=hook)
    s = np.array(samples)
    a = s[np.searchsorted(s[:, 0], r.measure_start_s, side="left")]  # the first sample in the window
    d = dict(zip(COUNTERS, s[-1, 1:] - a[1:]))
    req = r.requests
    tt = req[:, 1]
    itl = (req[:, 2] - tt) / np.maximum(req[:, 4] - 1, 1) * 1e3
    steps = max(d["num_steps"], 1.0)
    with_p = d["open_prefill_steps"] + d["bound_prefill_steps"] + d["idle_prefill_steps"]
    return {"policy": spec, "seed": seed, "lanes": lanes, "slo": float(np.mean((tt <= 10) & (itl <= 30))),
            "itl50": float(np.median(itl)), "hit": r.gpu_hit_rate, "steps": int(d["num_steps"]),
            "open": d["open_prefill_steps"] / steps, "bound": d["bound_prefill_steps"] / steps,
            "idle": d["idle_prefill_steps"] / steps, "time": d["prefill_busy_s"] / max(d["busy_s"], 1e-9),
            "step_p_ms": 1e3 * d["prefill_busy_s"] / max(with_p, 1.0),
            "step_d_ms": 1e3 * (d["busy_s"] - d["prefill_busy_s"]) / max(steps - with_p, 1.0),
            "cpu_s": time.process_time() - t0}


def main(argv: list[str] | None = None) -> int:
    from pdlb_cli.args import ArgumentParser, positive_float

    from pdlb_cli.arg_types import positive_int
    ap = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default=POLICIES, help="comma-separated policy specs (a part key=value continues "
                    "the spec before it; default: %(default)s)")
    ap.add_argument("--lanes", type=positive_int, default=128, help="closed-loop lanes (64 = the measured load; default 128)")
    ap.add_argument("--duration-s", type=positive_float, default=1200.0, help="measured seconds (default 1200)")
    ap.add_argument("--seeds", default="42", help="comma-separated workload seeds (default 42)")
    ap.add_argument("--jobs", type=positive_int, default=1, help="runs in parallel (processes, default 1)")
    a = ap.parse_args(argv)
    if not 1 <= a.lanes <= 1024:
        ap.error(f"--lanes must be in [1, 1024], got {a.lanes}")
    if a.duration_s > 36_000:
        ap.error(f"--duration-s must be at most 36000 (10 simulated hours), got {a.duration_s:g}")
    from pdlb_cli.arg_types import seed_int
    from pdlb_cli.comma_lists import list_arg
    seeds = list_arg(ap, "--seeds", a.seeds, "workload seeds", seed_int)
    if not seeds or len(seeds) > 64 or any(x >= 2**32 for x in seeds):
        ap.error(f"--seeds: 1 to 64 seeds in [0, 2**32), got {a.seeds!r}")
    if a.jobs > 64:
        ap.error(f"--jobs must be at most 64, got {a.jobs}")
    specs = split_policy_list(a.policies)
    if not specs:
        ap.error("--policies: none given")
    from balancer.config import PolicySpec
    for spec in specs:
        try:
            PolicySpec.parse(spec).build()
        except ValueError as e:
            ap.error(f"--policies: {e}")
    todo = [(p, a.lanes, a.duration_s, s) for s in seeds for p in specs]
    print(f"AgentX 440246, {a.lanes} lanes, {a.duration_s:g} s measured, SLO TTFT <= 10 s and mean ITL <= 30 ms; "
          "steps with prefill by reason (share of the EP group's steps), share of step time in them, mean step")
    print("| policy | seed | SLO | ITL p50 ms | hit | steps | open | bound | idle | time with prefill | "
          "step with / without prefill ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    if a.jobs > 1:
        with ProcessPoolExecutor(a.jobs) as ex:
            rows = list(ex.map(run, *zip(*todo)))
    else:
        rows = [run(*t) for t in todo]
    for x in rows:
        print(f"| {x['policy']} | {x['seed']} | {x['slo']:.1%} | {x['itl50']:.1f} | {x['hit']:.3f} | {x['steps']:,} | "
              f"{x['open']:.1%} | {x['bound']:.1%} | {x['idle']:.1%} | {x['time']:.1%} | "
              f"{x['step_p_ms']:.0f} / {x['step_d_ms']:.0f} |")
    if len(rows) >= 3:
        slo = np.array([x["slo"] for x in rows])
        if slo.std() > 0:
            print("correlation with the SLO share over the runs: " + ", ".join(
                f"{k} {np.corrcoef([x[k] for x in rows], slo)[0, 1]:+.2f}"
                for k in ("open", "bound", "idle", "time", "itl50") if np.std([x[k] for x in rows]) > 0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
