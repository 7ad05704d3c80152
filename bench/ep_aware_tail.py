#!/usr/bin/env python3
"""Benchmark: where ``ep_aware``'s TTFT p99 comes from, and what the tail guard does to it (issue 23).

For each point ``workload:scenario@rate_scale/slo_scale`` (rows and scenarios of
``bench/policy_goodput.py``; ``slo_scale`` multiplies both parts of that bench's TTFT budget, 2 s +
0.1 s per 1k prompt tokens, TPOT <= 50 ms, 90%), every policy is simulated once (seed 0, SLO-aware
routing as the searches route) and the bench prints, per policy: SLO attainment, TTFT p50 / p99,
and its ratios to the first policy of ``--policies`` (the baseline, measured in the same run); then
the requests that make the p99 (TTFT >= p99): their median prompt and uncached tokens, median queue
and compute seconds (:func:`sim.run.metrics.ttft_split`), and the share of them ``ep_aware`` placed as
*doomed* (missing the budget wherever they go: the placement that trades their own TTFT for the
others').

    .venv/bin/python bench/ep_aware_tail.py                                   # the default points
    .venv/bin/python bench/ep_aware_tail.py --points mooncake:default@0.8/1.95 --policies ep_aware,cache_aware

Default points: the Mooncake trace on the default wide-EP scenario at 0.4x and 0.8x its rate under
its fair SLO (x1.95, what ``bench/policy_goodput.py`` chose: every compared policy meets it at 1/64
load with 5 points to spare) and at the trace rate under the base SLO (overload), and on dense PD
(Llama-70B) at the trace rate (overload; where SLO-aware placement made the dense gain).
Runs ``--jobs`` worker processes (default 1); each point of the defaults takes ~5-8 s CPU per policy.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

DEFAULT_POINTS = ("mooncake:default@0.4/1.95", "mooncake:default@0.8/1.95", "mooncake:default@1/1",
                  "mooncake:dense@1/1")
#: the default (SLO-blind on wide-EP pools since issue 23 part 3), SLO-aware placement there too, SLO-blind, an anchor
DEFAULT_POLICIES = ("ep_aware", "ep_aware:slo_wide_ep=true", "ep_aware:slo_aware=false", "cache_aware")


def _recording(spec: str):
    """The policy of ``spec``; an ``ep_aware`` one is wrapped to record each prefill decision's reason."""
    from balancer.policies.ep_aware import EpAware
    from sim.search.point import parse_policy

    pol, _ = parse_policy(spec).build()
    if not isinstance(pol, EpAware):
        return pol, None
    reasons: dict[str, str] = {}

    @dataclass(frozen=True)
    class Recording(EpAware):
        def select(self, request, cands, ctx):  # noqa: ANN001, ANN202 - Policy.select's signature
            ch = super().select(request, cands, ctx)
            if cands.role.name == "PREFILL":
                reasons[request.request_id] = ch.reason
            return ch

    fields = {f: getattr(pol, f) for f in pol.__dataclass_fields__}
    return Recording(**fields), reasons


def run_one(point: str, spec: str, traces_dir: str | None) -> dict:
    """One policy at one point: its figures and the p99-makers' (see the module docstring)."""
    import numpy as np

    from policy_goodput import scenario_of, workload_of
    from sim.run.cluster import simulate
    from sim.run.metrics import per_request, ttft_split
    from sim.search.point import SLO

    row, rest = point.split("@")
    rate_s, slo_s = rest.split("/")
    rate, k = float(rate_s), float(slo_s)
    wl_name, sc_name = row.split(":")
    slo = SLO(ttft_s=2.0 * k, tpot_s=0.05, attainment=0.9, ttft_per_1k_prompt_tokens_s=0.1 * k)
    tmp = Path(tempfile.gettempdir()) / "pdlb-ep-aware-tail"  # generated workloads as JSONL
    tmp.mkdir(parents=True, exist_ok=True)
    wl = workload_of(wl_name, 0, Path(traces_dir) if traces_dir else None, tmp)
    reqs = wl.at_rate(wl.read(), rate)
    pol, reasons = _recording(spec)
    t0 = time.process_time()
    res = simulate(scenario_of(sc_name), reqs, pol, pol, ttft_slo=slo.ttft_slo(), seed=0)
    d, sp, r = per_request(res), ttft_split(res), res.records
    ttft = d["ttft_s"]
    ok = (ttft <= slo.ttft_budget_s(r.prompt_tokens.astype(float))) & np.where(np.isnan(d["tpot_s"]), True,
                                                                               d["tpot_s"] <= slo.tpot_s)
    p99 = float(np.nanpercentile(ttft, 99))
    top = ttft >= p99
    doomed = None
    if reasons is not None:
        ids = [q.request_id for q, t in zip(res.requests, top) if t]
        doomed = sum(reasons.get(i, "").endswith(":slo_doomed") for i in ids) / max(len(ids), 1)
        doomed_all = collections.Counter(v.endswith(":slo_doomed") for v in reasons.values())[True] / max(len(reasons), 1)
    else:
        doomed_all = None
    return {"point": point, "policy": spec, "attainment": float(ok.mean()), "ttft_p50_s": float(np.nanpercentile(ttft, 50)),
            "ttft_p99_s": p99, "top_prompt_tokens": float(np.median(r.prompt_tokens[top])),
            "top_uncached_tokens": float(np.median((r.prompt_tokens - r.cached_tokens)[top])),
            "top_queue_s": float(np.nanmedian(sp["queue_s"][top])), "top_compute_s": float(np.nanmedian(sp["compute_s"][top])),
            "top_doomed": doomed, "doomed": doomed_all, "cpu_s": time.process_time() - t0}


def main(argv: list[str] | None = None) -> int:
    from pdlb_cli.args import ArgumentParser  # one usage line, then the error
    from pdlb_cli.arg_types import positive_int

    ap = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default=",".join(DEFAULT_POINTS), help="workload:scenario@rate_scale/slo_scale,...")
    ap.add_argument("--policies", default=";".join(DEFAULT_POLICIES),
                    help="policies separated by ';' (a spec may hold commas); the first is the baseline")
    ap.add_argument("--traces-dir", default=None, help="as bench/policy_goodput.py (Azure, Mooncake synthetic rows)")
    ap.add_argument("--jobs", type=positive_int, default=1)
    args = ap.parse_args(argv)
    from pdlb_cli.comma_lists import list_arg

    points = list_arg(ap, "--points", args.points, "points workload:scenario@rate_scale/slo_scale")
    policies = [p.strip() for p in args.policies.split(";") if p.strip()]
    t0 = time.perf_counter()
    with cf.ProcessPoolExecutor(args.jobs) as pool:
        futs = {(pt, pol): pool.submit(run_one, pt, pol, args.traces_dir) for pt in points for pol in policies}
        res = {k: f.result() for k, f in futs.items()}
    print("| point | policy | attainment | vs base, pt | TTFT p50 s | TTFT p99 s | p99 vs base | p99-makers: prompt / "
          "uncached tokens | queue / compute s | doomed share (all) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for pt in points:
        base = res[(pt, policies[0])]
        for pol in policies:
            r = res[(pt, pol)]
            dm = "-" if r["top_doomed"] is None else f"{r['top_doomed']:.0%} ({r['doomed']:.1%})"
            print(f"| {pt} | {pol} | {r['attainment']:.1%} | {100 * (r['attainment'] - base['attainment']):+.1f} | "
                  f"{r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.1f} | {r['ttft_p99_s'] / base['ttft_p99_s']:.2f}x | "
                  f"{r['top_prompt_tokens']:,.0f} / {r['top_uncached_tokens']:,.0f} | {r['top_queue_s']:.1f} / "
                  f"{r['top_compute_s']:.1f} | {dm} |", flush=True)
    print(f"wall {time.perf_counter() - t0:.0f} s, CPU {sum(r['cpu_s'] for r in res.values()):.0f} s in the simulations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
