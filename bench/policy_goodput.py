#!/usr/bin/env python3
"""Benchmark: ``ep_aware`` against every anchor policy, on several workloads and clusters.

For each row (a workload on a scenario), each policy (the same policy on both pools, as
``pdlb sim compare`` runs them) and each seed (router seed and the workload's arrival spreading
or generator seed), in one run:

- **goodput at the trace rate**: SLO-meeting requests per second of the arrival window
  (:mod:`sim.run.metrics`), a complete simulation at rate scale 1;
- **highest rate at SLO**: :func:`sim.search.capacity.search_rate` (geometric bisection, 3% tolerance),
  with the **TTFT p99 at that rate** beside it (a run at each policy's found rate), pdlb's
  policies' TTFT p99 at the best anchor's found rate (equal load), and each
  policy's **light-load attainment** (a run at ``--light-scale``, default 1/64 of the trace rate):
  a row where some policy misses the SLO even when idle is flagged, since its "highest rate at
  SLO" is then where a flat attainment curve crosses the target, not a capacity;
- **GPUs needed at the trace rate** (the rows marked ``gpus``): :func:`sim.search.capacity.search_gpus`,
  prefill and decode engines searched together.

Every figure is printed with its ratio to the best anchor of its row (mean over seeds, and the
spread min..max); ratios > 1 favour ``ep_aware`` (for GPUs, < 1). Then an explanation run on the
default row at the best anchor's sustained rate: hit rate, step imbalance, time the average rank
waits for the slowest one, TTFT split, and a figure (TTFT CDF, and the busiest rank's queued
prefill tokens over time per policy).

    .venv/bin/python bench/policy_goodput.py                 # every row, 2 seeds, all cores
    .venv/bin/python bench/policy_goodput.py --quick         # the Mooncake default row, 1 seed
    .venv/bin/python bench/policy_goodput.py --rows mooncake:default,shared_prefix:default --seeds 3

Rows (``--rows``, ``workload:scenario``): workloads ``mooncake`` (embedded trace),
``azure_code`` / ``azure_conv`` (``--traces-dir``), ``chatbot`` / ``agent`` (``pdlb sim
sessions`` generator, one day), ``shared_prefix`` (SGLang's generated-shared-prefix layout, 256 groups x 16
prompts, at 4 req/s); scenarios ``default`` (dsv3-pd-h200: 6 prefill engines of EP8, 1 decode engine of EP8),
``p16`` (the same with 16 prefill engines), ``dense`` (llama70b-pd-h100), ``agg``
(llama8b-agg-h100), ``longsplit`` (docs/examples/scenarios/dsv3-pd-h200-longsplit.toml: the default's
prefill engines split 4 + 2 at 32k prompt tokens), ``dense_dbound``
(docs/examples/scenarios/llama70b-pd-h100-decode-bound.toml: dense PD whose decode pool saturates first;
judge it with ``--slo-attainment 0.97``); ``mooncake_synthetic`` is Mooncake's FAST25 ``synthetic_trace.jsonl`` in
``--traces-dir``. The base SLO (``--slo-*``): by default 90% of requests with TTFT <= 2 s + 0.1 s
per 1k prompt tokens and TPOT <= 50 ms (a flat 2 s TTFT cannot be met by 90% of the Mooncake
trace at any rate: 16% of its prompts take longer than 2 s to prefill alone even with every prefix
cached; the searches report such a floor instead of searching). With ``--fair-slo`` (the default)
each row is judged at a **fair SLO**: the base SLO's TTFT budget times the smallest factor (5%
steps) at which every compared policy meets it at ``--light-scale`` with ``--fair-margin`` to spare
(:mod:`sim.search.fair_slo`, from one light-load run per policy and seed); otherwise a policy that barely
meets the SLO when idle has a flat attainment curve and its "highest rate at SLO" is a threshold
artefact (issue 23). ``--no-fair-slo`` judges every row at the base SLO.
Results: ``--out`` (default ``bench_results/policy_goodput-<time>/``): ``results.json``,
``table.md``, ``explain.png``, ``points.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ANCHORS = ("cache_aware", "kv_cost", "scored", "least_load", "dp_consistent_hash", "consistent_hash", "power_of_two",
           "round_robin")
OURS = "ep_aware"
#: ep_aware told nothing about the SLO (the searches give the router the SLO they search for)
BLIND = "ep_aware:slo_aware=false"
WORKLOADS = ("mooncake", "mooncake_synthetic", "azure_code", "azure_conv", "chatbot", "agent", "shared_prefix")
#: the Mooncake FAST25 release's synthetic trace (kvcache-ai/Mooncake, FAST25-release/traces/synthetic_trace.jsonl,
#: Apache-2.0; 3,993 requests over 1,022 s, mean input 15,325 tokens), looked for in --traces-dir
MOONCAKE_SYNTHETIC = "mooncake_synthetic_trace.jsonl"
SCENARIOS = {"default": "dsv3-pd-h200", "p16": "dsv3-pd-h200", "dense": "llama70b-pd-h100", "agg": "llama8b-agg-h100",
             # issue 23 part 3's named losses, as committed scenario files
             "longsplit": "docs/examples/scenarios/dsv3-pd-h200-longsplit.toml",
             "dense_dbound": "docs/examples/scenarios/llama70b-pd-h100-decode-bound.toml"}
DEFAULT_ROWS = ("mooncake:default", "mooncake:p16", "mooncake:dense", "mooncake:agg", "azure_code:dense",
                "azure_conv:dense", "chatbot:default", "agent:default", "shared_prefix:default", "shared_prefix:agg")
GPU_ROWS = ("mooncake:default", "mooncake:dense")


def scenario_of(name: str):
    from sim.scenario import load_scenario

    path = SCENARIOS[name]
    sc = load_scenario(ROOT / path if path.endswith(".toml") else path)
    if name == "p16":
        sc = sc.model_copy(update={"name": f"{sc.name}-p16",
                                   "prefill": sc.prefill.model_copy(update={"num_engines": 16})})
    return sc


def workload_of(name: str, seed: int, traces_dir: Path | None, tmp: Path):
    """A :class:`sim.search.point.WorkloadSpec` (trace files; generated workloads are written as JSONL)."""
    from sim.search.point import WorkloadSpec

    if name == "mooncake":
        return WorkloadSpec(seed=seed)
    if name == "mooncake_synthetic":
        path = (traces_dir / MOONCAKE_SYNTHETIC) if traces_dir is not None else None
        if path is None or not path.is_file():
            raise SystemExit(f"row {name}: put {MOONCAKE_SYNTHETIC} (Mooncake's FAST25-release/traces/synthetic_trace.jsonl) "
                             "in --traces-dir")
        return WorkloadSpec(trace=str(path), seed=seed)
    if name in ("azure_code", "azure_conv"):
        if traces_dir is None:
            raise SystemExit(f"row {name}: pass --traces-dir (the folder with azure_llm_2023_*.csv)")
        return WorkloadSpec(trace=str(traces_dir / f"azure_llm_2023_{name.split('_')[1]}.csv"), seed=seed)
    path = tmp / f"{name}-{seed}.jsonl"
    if not path.exists():
        from sim.workload import write_mooncake
        if name in ("chatbot", "agent"):
            from sim.workload import SessionWorkloadConfig, session_workload
            reqs = session_workload(SessionWorkloadConfig(duration_s=86_400.0, sessions_per_hour=60.0,
                                                          agent_fraction=1.0 if name == "agent" else 0.0, seed=seed))
        elif name == "shared_prefix":
            from sim.workload.benchmarks import shared_prefix_workload
            reqs = shared_prefix_workload(256, 16, rate_per_s=4.0, seed=seed)
        else:
            raise SystemExit(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}")
        write_mooncake(reqs, path)
    return WorkloadSpec(trace=str(path), spread_s=0.0, seed=seed)


def mean_spread(xs: list[float]) -> tuple[float, float, float]:
    """(mean, min, max) of the numbers (NaN = failed, skipped; +inf = beyond the search bounds)."""
    v = [x for x in xs if x is not None and not math.isnan(x)]
    if not v:
        return float("nan"), float("nan"), float("nan")
    return sum(v) / len(v), min(v), max(v)


def cell(v: tuple[float, float, float], spread: bool, beyond: str) -> str:
    if math.isinf(v[0]):
        return beyond
    return f"{v[0]:.3g} ({v[1]:.3g}..{v[2]:.3g})" if spread else f"{v[0]:.3g}"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring); returns 0. The worker pool is stopped before
    it returns, whatever happens: left to the interpreter's exit, the process pool raised an
    OSError there (after the results were written)."""
    pools: list = []
    try:
        return _main(argv, pools)
    finally:
        for executor in pools:
            executor.shutdown(kill=sys.exc_info()[0] is not None)


def _main(argv: list[str] | None, pools: list) -> int:
    from pdlb_cli.args import ArgumentParser  # one usage line, then the error
    from pdlb_cli.arg_types import fraction, nonnegative_float, positive_float, positive_int, share

    ap = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="workload:scenario,... (default: all rows)")
    ap.add_argument("--policies", default=",".join((OURS, BLIND, *ANCHORS)),
                    help="policies (default ep_aware, ep_aware SLO-blind, and every anchor); names starting with "
                         "ep_aware are pdlb's, the rest anchors")
    ap.add_argument("--seeds", type=positive_int, default=2, help="seeds per row (default 2)")
    ap.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1,
                    help="worker processes (default: all cores; 1: in this process)")
    ap.add_argument("--quick", action="store_true", help="only the Mooncake default row, 1 seed, no GPU search")
    ap.add_argument("--no-gpus", action="store_true", help="skip the GPU searches")
    ap.add_argument("--no-explain", action="store_true", help="skip the explanation runs and figure")
    ap.add_argument("--traces-dir", type=Path, default=None,
                    help="folder with azure_llm_2023_code.csv / _conv.csv (default: ../shared/traces if present)")
    ap.add_argument("--slo-ttft-s", type=positive_float, default=2.0)
    ap.add_argument("--slo-ttft-per-1k-s", type=nonnegative_float, default=0.1, help="TTFT budget per 1k prompt tokens, s (default 0.1; 0: none)")
    ap.add_argument("--slo-tpot-s", type=positive_float, default=0.05)
    ap.add_argument("--slo-attainment", type=fraction, default=0.9)
    ap.add_argument("--tol", type=positive_float, default=0.03, help="rate search tolerance (default 0.03)")
    ap.add_argument("--max-evals", type=positive_int, default=20, help="most simulations per search (default 20)")
    ap.add_argument("--rate-max", type=positive_float, default=4096.0,
                    help="upper bound of the rate search, as a rate scale (default 4096: light generated workloads)")
    ap.add_argument("--light-scale", type=positive_float, default=1 / 64,
                    help="rate scale of the light-load runs that check every policy meets the SLO when idle "
                         "(default 1/64)")
    ap.add_argument("--fair-slo", action=argparse.BooleanOptionalAction, default=True,
                    help="judge each row at a fair SLO (default): the --slo-* TTFT budget times the smallest factor "
                         "(5%% steps, >= 1) at which every compared policy meets the SLO at light load with "
                         "--fair-margin to spare (sim.search.fair_slo); --no-fair-slo: the --slo-* SLO as given")
    ap.add_argument("--fair-margin", type=share, default=None,
                    help="attainment every policy must have to spare at light load under the fair SLO (default: "
                         "half of what the SLO lets miss, 0.05 at 90%%: queueing, not the zero-load floor, then "
                         "decides at least half of the misses; a share in [0, 1), 0: just meet it)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from sim.search.capacity import GpuSearch, RateSearch, run_searches
    from sim.search.executor import make_executor
    from sim.search.point import SLO, Point, parse_policy

    console = Console() if sys.stdout.isatty() else Console(width=240)  # piped: rich would cut the 13 columns to 80
    from pdlb_cli.comma_lists import list_arg

    rows = ["mooncake:default"] if args.quick else list_arg(ap, "--rows", args.rows, "rows workload:scenario")
    for row in rows:  # review R11: an unknown scenario was a KeyError once the pool ran
        wl_name, colon, sc_name = row.partition(":")
        if not colon or ":" in sc_name:
            ap.error(f"--rows: expected workload:scenario, got {row!r}")
        if wl_name not in WORKLOADS:
            ap.error(f"--rows: unknown workload {wl_name!r} in {row!r}; valid: {', '.join(WORKLOADS)}")
        if sc_name not in SCENARIOS:
            ap.error(f"--rows: unknown scenario {sc_name!r} in {row!r}; valid: {', '.join(SCENARIOS)}")
    seeds = list(range(1 if args.quick else args.seeds))
    from balancer.policies.spec import split_policy_list  # "ep_aware:a=1,b=2" is one spec, as bench/agentx_policies.py
    try:
        policies = split_policy_list(args.policies)
    except ValueError as e:
        ap.error(f"--policies: {e}")
    if not policies or len(set(policies)) != len(policies):
        ap.error(f"--policies: expected distinct policy specs, got {args.policies!r}")
    ours_all = [p for p in policies if p.split(":")[0] == OURS]
    anchors = [p for p in policies if p not in ours_all]
    traces_dir = args.traces_dir
    if traces_dir is None and (ROOT.parent / "shared" / "traces").is_dir():
        traces_dir = ROOT.parent / "shared" / "traces"
    slo = SLO(ttft_s=args.slo_ttft_s, tpot_s=args.slo_tpot_s, attainment=args.slo_attainment,
              ttft_per_1k_prompt_tokens_s=args.slo_ttft_per_1k_s)
    out = args.out or ROOT / "bench_results" / f"policy_goodput-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="pdlb-bench-"))  # generated workloads as JSONL
    t0 = time.perf_counter()
    executor = make_executor("process", jobs=args.jobs)
    pools.append(executor)  # main() stops it

    # ------------------------------------------------------------------ each row's SLO
    row_slo = {row: slo for row in rows}
    fair_report: dict[str, dict] = {}
    if args.fair_slo:
        row_slo, fair_report = fair_slos(rows, seeds, policies, slo, args, traces_dir, tmp, executor, console)

    # ------------------------------------------------------------------ plan every search and point
    searches: list = []
    keys: list[tuple] = []
    points: list = []
    point_keys: list[tuple] = []
    for row in rows:
        wl_name, sc_name = row.split(":")
        sc = scenario_of(sc_name)
        slo = row_slo[row]
        for seed in seeds:
            wl = workload_of(wl_name, seed, traces_dir, tmp)
            for pol in policies:
                spec = parse_policy(pol)
                searches.append(RateSearch(sc, wl, spec, slo, rate_min=1 / 256, rate_max=args.rate_max, tol=args.tol, seed=seed,
                                           max_evals=args.max_evals))
                keys.append(("rate", row, pol, seed))
                points.append(Point(sc, wl, spec, 1.0, slo, seed))
                point_keys.append(("trace_rate", row, pol, seed))
                points.append(Point(sc, wl, spec, args.light_scale, slo, seed))
                point_keys.append(("light", row, pol, seed))
                if row in GPU_ROWS and seed == 0 and not (args.quick or args.no_gpus):
                    searches.append(GpuSearch(sc, wl, spec, slo, rate_scale=1.0,
                                              max_engines={"prefill": 24, "decode": 4}, max_evals=args.max_evals))
                    keys.append(("gpus", row, pol, seed))
    results: dict[tuple, object] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("trace-rate runs", total=len(points))
        futs = [executor.submit(p) for p in points]
        for k, f in zip(point_keys, futs):
            results[k] = f.result()
            progress.advance(task)
        task2 = progress.add_task("searches (points)", total=None)
        log = (out / "points.jsonl").open("a")  # every point as it finishes: a cut-off run keeps them

        def on_point(search, r) -> None:
            progress.advance(task2)
            log.write(json.dumps({"search": type(search).__name__, "policy": search.label,
                                  "scenario": search.scenario.name, "seed": search.seed,
                                  "rate_scale": r.point.rate_scale, "engines": [r.prefill_engines, r.decode_engines,
                                                                                r.mixed_engines],
                                  "meets": r.meets, "attainment": r.attainment, "error": r.error}) + "\n")
            log.flush()

        for k, r in zip(keys, run_searches(searches, executor, on_point=on_point)):
            results[k] = r
        log.close()
        # TTFT p99 where each policy's highest rate at SLO was found (the tail it buys the rate with)
        at_rate = [(("at_rate", k[1], k[2], k[3]), Point(s_.scenario, s_.workload, s_.policy, r.rate_scale, s_.slo, k[3]))
                   for k, s_, r in ((k, s_, results[k]) for k, s_ in zip(keys, searches))
                   if k[0] == "rate" and getattr(r, "rate_scale", None)]
        # ... and pdlb's policies at the best anchor's highest rate at SLO: the tail at equal load
        for row in rows:
            for seed in seeds:
                found = [(results[("rate", row, a, seed)].rate_scale, a, s_) for a in anchors for k, s_ in zip(keys, searches)
                         if k == ("rate", row, a, seed) and getattr(results[k], "rate_scale", None)]
                if not found:
                    continue
                f_best, _, s_best = max(found, key=lambda t: t[0])
                for pol in ours_all:
                    at_rate.append((("at_anchor_rate", row, pol, seed),
                                    Point(s_best.scenario, s_best.workload, parse_policy(pol), f_best, s_best.slo, seed)))
        task3 = progress.add_task("runs at the found rates", total=len(at_rate))
        futs = [executor.submit(p) for _, p in at_rate]
        for (k, _), f in zip(at_rate, futs):
            results[k] = f.result()
            progress.advance(task3)
    wall = time.perf_counter() - t0

    # ------------------------------------------------------------------ tables
    def fig(kind: str, row: str, pol: str) -> list[float]:
        xs = []
        for seed in seeds:
            src = {"ttft_p99": "trace_rate", "light_attainment": "light", "ttft_p99_at_rate": "at_rate",
                   "ttft_p99_at_anchor_rate": "at_rate"}.get(kind, kind)
            if kind == "ttft_p99_at_anchor_rate" and pol in ours_all:
                src = "at_anchor_rate"
            r = results.get((src, row, pol, seed))
            if r is None:
                continue
            if kind == "trace_rate":
                xs.append(r.goodput_rps)
            elif kind in ("ttft_p99", "ttft_p99_at_rate", "ttft_p99_at_anchor_rate"):
                xs.append(r.ttft_p99_s)
            elif kind == "light_attainment":
                xs.append(r.attainment)
            elif kind == "rate":
                xs.append(r.rate_rps if r.rate_rps is not None else 0.0)
            else:
                xs.append(float(r.num_gpus) if r.num_gpus is not None else
                          float("inf") if r.status == "above_bounds" else float("nan"))
        return xs

    base_slo = SLO(ttft_s=args.slo_ttft_s, tpot_s=args.slo_tpot_s, attainment=args.slo_attainment,
                   ttft_per_1k_prompt_tokens_s=args.slo_ttft_per_1k_s)
    report: dict = {"slo": base_slo.__dict__, "row_slo": {r: s_.__dict__ for r, s_ in row_slo.items()},
                    "fair": fair_report, "rows": {}, "wall_s": wall, "jobs": args.jobs, "seeds": seeds,
                    "argv": sys.argv[1:] if argv is None else list(argv)}
    md = [f"base SLO: {args.slo_attainment:.0%} of requests with TTFT <= {args.slo_ttft_s:g} s + "
          f"{args.slo_ttft_per_1k_s:g} s per 1k prompt tokens and TPOT <= {args.slo_tpot_s * 1e3:g} ms; "
          f"{len(seeds)} seed(s); mean (min..max); ratio = ep_aware / best anchor (GPUs, TTFT p99: ep_aware's / best "
          f"anchor's); {BLIND} is ep_aware told nothing about the SLO", ""]
    for row in rows:
        line = f"SLO of {row}: {row_slo[row].describe()}"
        if row in fair_report:
            fr = fair_report[row]
            line += (f" (fair: TTFT budget x{fr['scale']:g}, set by {fr['binding']}; light-load attainment at the base "
                     "SLO: " + ", ".join(f"{p} {v:.1%}" for p, v in fr["base_light_attainment"].items()) + ")")
        console.print(line, markup=False)
        md.append(line)
    md.append("")
    # is the SLO one every policy meets at light load? If not, a row's "highest rate at SLO" is where a
    # flat attainment curve crosses the target (a threshold artefact), and the row is flagged
    unfair: dict[str, list[str]] = {}
    for row in rows:
        light = {p: mean_spread(fig("light_attainment", row, p))[0] for p in policies}
        unfair[row] = [f"{p} {v:.1%}" for p, v in light.items() if not math.isnan(v) and v < args.slo_attainment]
        console.print(f"light-load attainment ({args.light_scale:g}x), {row}: "
                      + ", ".join(f"{p} {v:.1%}" for p, v in light.items()), markup=False)
        md.append(f"light-load attainment ({args.light_scale:g}x), {row}: "
                  + ", ".join(f"{p} {v:.1%}" for p, v in light.items()))
        if unfair[row]:
            msg = (f"  {row}: the SLO is not met at light load by {', '.join(unfair[row])}: its highest rate at "
                   "SLO is a threshold artefact on this row; loosen --slo-* until every policy meets it when idle")
            console.print(msg, markup=False)
            md.append(msg)
    md.append("")
    report["light_load_unfair"] = unfair
    for kind, title, better in (("trace_rate", "goodput at the trace rate, req/s", max),
                                ("rate", "highest rate at SLO, req/s", max),
                                ("ttft_p99_at_rate", "TTFT p99 at each policy's highest rate at SLO, s", min),
                                ("ttft_p99_at_anchor_rate", "TTFT p99 at equal load: pdlb's policies at the best "
                                 "anchor's highest rate at SLO (anchors at their own), s", None),
                                ("gpus", "GPUs needed at the trace rate", min),
                                ("ttft_p99", "TTFT p99 at the trace rate, s", min)):
        table = Table(title=title)
        ratio_cols = ["ratio" if v == OURS else f"ratio {v}" for v in ours_all]
        for c in ("row", *policies, "best anchor", *ratio_cols):
            table.add_column(c, justify="right" if c != "row" else "left")
        head = [f"### {title}", "", "| row | " + " | ".join(policies) + " | best anchor | " + " | ".join(ratio_cols) + " |",
                "|---" * (len(policies) + 2 + len(ratio_cols)) + "|"]
        body: list[str] = []
        any_row = False
        for row in rows:
            vals = {p: mean_spread(fig(kind, row, p)) for p in policies}
            if all(math.isnan(v[0]) for v in vals.values()):
                continue
            any_row = True
            finite = [(vals[a][0], a) for a in anchors if not math.isnan(vals[a][0])]
            if better is None:  # the anchor with the highest rate at SLO, its TTFT p99 there
                rates = [(mean_spread(fig("rate", row, a))[0], a) for a in anchors]
                rates = [t for t in rates if not math.isnan(t[0])]
                best = max(rates)[1] if rates else "-"
                best_val = vals[best][0] if rates else float("nan")
            else:
                best_val, best = better(finite) if finite else (float("nan"), "-")
            beyond = "-"
            if kind == "gpus":
                sc = scenario_of(row.split(":")[1])
                most = (24 * sc.prefill.dp_ranks * sc.prefill.gpus_per_rank + 4 * sc.decode.dp_ranks * sc.decode.gpus_per_rank) if sc.disaggregated else None
                beyond = f"> {most}" if most else "> max"
            ratios, ratio_texts = {}, []
            for v in ours_all:
                ours = vals.get(v, (float("nan"),) * 3)[0]
                if kind == "gpus":
                    ratio = best_val / ours if ours and not math.isnan(ours) else float("nan")
                    text = (f"< {ours / most:.2f}x GPUs" if math.isinf(best_val) and most and math.isfinite(ours)
                            else f"{1 / ratio:.2f}x GPUs" if ratio and math.isfinite(ratio) else "n/a")
                elif kind in ("ttft_p99", "ttft_p99_at_rate", "ttft_p99_at_anchor_rate"):
                    ratio = ours / best_val if best_val and math.isfinite(best_val) else float("nan")
                    text = f"{ratio:.2f}x" if math.isfinite(ratio) else "n/a"
                else:
                    ratio = ours / best_val if best_val and not math.isnan(best_val) else float("inf") if ours > 0 else float("nan")
                    text = f"{ratio:.2f}x" if math.isfinite(ratio) else ("no anchor meets it" if ours > 0 else "n/a")
                ratios[v] = ratio
                ratio_texts.append(text)
            cells = [cell(v, len(seeds) > 1, beyond) for v in vals.values()]
            if kind == "rate" and unfair.get(row):
                row_label = f"{row} (SLO not met idle)"
            else:
                row_label = row
            table.add_row(row_label, *cells, best, *ratio_texts)
            body.append(f"| {row} | " + " | ".join(cells) + f" | {best} | " + " | ".join(ratio_texts) + " |")
            report["rows"].setdefault(row, {})[kind] = {"values": {p: list(vals[p]) for p in policies},
                                                        "best_anchor": best, "ratio": ratios.get(OURS),
                                                        "ratios": ratios}
        if any_row:
            console.print(table)
            md += [*head, *body, ""]
    statuses = {f"{k[0]}|{k[1]}|{k[2]}|{k[3]}": (r.status, r.reason) for k, r in results.items() if hasattr(r, "status")
                and r.status != "found"}
    if statuses:
        console.print("[yellow]searches not 'found':[/yellow]")
        for k, v in statuses.items():
            console.print(f"  {k}: {v[0]} {v[1]}")
    report["not_found"] = statuses
    console.print(f"wall {wall:.0f} s on {args.jobs} worker(s)")

    # ------------------------------------------------------------------ explain the win
    if not args.no_explain and "mooncake:default" in rows and OURS in policies and anchors:
        md += explain(results, seeds, anchors, row_slo["mooncake:default"], out, console)
    (out / "table.md").write_text("\n".join(md) + "\n")
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str))
    console.print(f"results: {out}/")
    return 0


def light_arrays(folder: Path):
    """``(ttft_s, tpot_s, prompt_tokens)`` of a point's per-request CSV written under ``folder``."""
    import csv

    import numpy as np

    (path,) = sorted(folder.glob("requests_*.csv"))
    cols: dict[str, list[float]] = {"ttft_s": [], "tpot_s": [], "prompt_tokens": []}
    with path.open(newline="") as f:
        for rec in csv.DictReader(f):
            for c, xs in cols.items():
                xs.append(float(rec[c]) if rec[c] != "" else float("nan"))
    return tuple(np.asarray(cols[c], dtype=np.float64) for c in ("ttft_s", "tpot_s", "prompt_tokens"))


def fair_slos(rows, seeds, policies, slo, args, traces_dir, tmp: Path, executor, console):
    """Per row, the base SLO with its TTFT budget scaled until every policy (every seed) meets it at
    ``--light-scale`` with ``--fair-margin`` to spare (:func:`sim.search.fair_slo.fair_ttft_scale`), from one
    light-load run per policy and seed at the base SLO. Returns ``(row -> SLO, row -> report)``; a row
    no budget makes fair keeps the base SLO and says so."""
    from sim.search.fair_slo import attainment_at, fair_ttft_scale, scaled_slo
    from sim.search.point import Point, parse_policy

    points, keys = [], []
    for row in rows:
        wl_name, sc_name = row.split(":")
        sc = scenario_of(sc_name)
        for seed in seeds:
            wl = workload_of(wl_name, seed, traces_dir, tmp)
            for pol in policies:
                d = tmp / "light" / str(len(keys))
                points.append(Point(sc, wl, parse_policy(pol), args.light_scale, slo, seed, save_dir=str(d)))
                keys.append((row, pol, seed, d))
    futs = [executor.submit(p) for p in points]
    for f in futs:
        f.result()
    row_slo, report = {}, {}
    for row in rows:
        light = {f"{pol}|{seed}": light_arrays(d) for r, pol, seed, d in keys if r == row}
        margin = args.fair_margin if args.fair_margin is not None else (1.0 - slo.attainment) / 2.0
        fs = fair_ttft_scale(light, slo, margin=margin)
        base_att = {pol: sum(attainment_at(*light[f"{pol}|{s}"], slo) for s in seeds) / len(seeds) for pol in policies}
        if fs.scale == float("inf"):
            console.print(f"{row}: no TTFT budget lets every policy meet the SLO at light load ({fs.binding}); "
                          "keeping the base SLO", markup=False)
            row_slo[row] = slo
        else:
            row_slo[row] = scaled_slo(slo, fs.scale)
        fair_att = {pol: sum(attainment_at(*light[f"{pol}|{s}"], row_slo[row]) for s in seeds) / len(seeds)
                    for pol in policies}
        report[row] = {"scale": fs.scale, "margin": margin, "binding": fs.binding.split("|")[0], "needed": fs.needed,
                       "base_light_attainment": base_att, "fair_light_attainment_base_routing": fair_att}
        console.print(f"fair SLO of {row}: TTFT budget x{fs.scale:g} (set by {fs.binding}); light-load attainment "
                      "at the base SLO: " + ", ".join(f"{p} {v:.1%}" for p, v in base_att.items()), markup=False)
    return row_slo, report


def explain(results: dict, seeds: list[int], anchors: list[str], slo, out: Path, console) -> list[str]:
    """Run ep_aware and the best anchor of the default row at ep_aware's sustained rate (where the
    anchor no longer meets the SLO): what differs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from sim.run.cluster import simulate
    from sim.run.metrics import per_request, summarize
    from sim.workload import read_trace, scale_rate, spread_batches

    row = "mooncake:default"
    rates = {a: results[("rate", row, a, 0)] for a in anchors if ("rate", row, a, 0) in results}
    best = max(rates, key=lambda a: rates[a].rate_scale or 0.0)
    ours = results.get(("rate", row, OURS, 0))
    rate = (ours.rate_scale if ours is not None and ours.rate_scale else None) or rates[best].rate_scale or 0.1
    reqs = scale_rate(spread_batches(read_trace(None), 3.0, seed=0), rate)
    sc = scenario_of("default")
    lines = [f"### Why (Mooncake, default scenario; ep_aware vs the best anchor {best} at ep_aware's sustained rate "
             f"{rate:.3f}x)", "",
             "| policy | attainment | TTFT mean s | queue s | compute s | hit rate | P step imb. | rank wait share |",
             "|---|---|---|---|---|---|---|---|"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for pol in (OURS, best):
        res = simulate(sc, reqs, pol, ttft_slo=slo.ttft_slo())  # as the searches route
        s = summarize(res, slo_ttft_s=slo.ttft_s, slo_tpot_s=slo.tpot_s)
        split = s["kv"]["ttft_split_s"]
        d = per_request(res)
        budget = slo.ttft_budget_s(res.records.prompt_tokens.astype(float))
        ok = (d["ttft_s"] <= budget) & np.where(np.isnan(d["tpot_s"]), True, d["tpot_s"] <= slo.tpot_s)
        lines.append(f"| {pol} | {ok.mean():.1%} | {s['ttft_s']['mean']:.2f} | {split['queue_s']['mean']:.2f} | "
                     f"{split['compute_s']['mean']:.2f} | {s['prefix_hit_rate']:.1%} | {s['prefill_step_imbalance']:.2f} | "
                     f"{s['prefill_ep_wait_fraction']:.1%} |")
        x = np.sort(d["ttft_s"][~np.isnan(d["ttft_s"])])
        ax1.plot(x, np.arange(1, len(x) + 1) / len(x), label=pol)
        rec = res.records
        compute = rec.prefill_end_s - rec.prefill_start_s
        edges = np.array([0, 2000, 8000, 32000, 10**9])
        bucket = np.digitize(rec.prompt_tokens, edges) - 1
        means = [float(np.nanmean(compute[bucket == b])) for b in range(4)]
        width = 0.38
        xpos = np.arange(4) + (-width / 2 if pol == OURS else width / 2)
        ax2.bar(xpos, means, width, label=pol)
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT, s")
    ax1.set_ylabel("fraction of requests")
    ax1.axvline(slo.ttft_s, color="grey", ls=":")
    ax1.legend()
    ax1.set_title("TTFT CDF")
    ax2.set_xticks(range(4), ["< 2k", "2k-8k", "8k-32k", "> 32k"])
    ax2.set_xlabel("prompt tokens")
    ax2.set_ylabel("mean prefill time (first chunk to last), s")
    ax2.set_yscale("log")
    ax2.set_title("prefill time: short prompts stepped at a long one's pace")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out / "explain.png", dpi=110)
    console.print("\n".join(lines))
    return lines + ["", "![explain](explain.png)", ""]


if __name__ == "__main__":
    sys.exit(main())
