#!/usr/bin/env python3
"""Benchmark: ``ep_aware``'s highest rate at SLO over the best anchor's, against the SLO's TTFT budget scale.

``bench/policy_goodput.py`` judges each row at one fair SLO (issue 23). This draws the whole
curve: for every TTFT budget factor ``k`` in ``--scales`` (the base SLO's flat and per-1k parts
both times ``k``; base: 90% of requests with TTFT <= 2 s + 0.1 s per 1k prompt tokens and TPOT <=
50 ms, as policy_goodput), each policy's highest rate at that SLO and the ratio of pdlb's to the
best anchor's.

How, without a rate search per ``k``: each policy runs once per rate on a geometric grid
(``--rates``, rate scales of the trace); a run's per-request TTFTs give the smallest factor at
which it meets the SLO (:func:`sim.search.capacity.reachable_ttft_scale`), and a policy's rate at factor
``k`` is where that needed factor first exceeds ``k`` along the grid, interpolated in (log factor,
log rate) between the two grid runs around it (:func:`sim.search.fair_slo.rate_at_ttft_scale`). This is
exact for policies that route without the SLO (the anchors and SLO-blind ``ep_aware``; each grid
run serves every ``k``). SLO-aware ``ep_aware`` routes against the budget, so it runs its own grid
per factor in ``--aware-scales`` (the router told that factor's budget). A policy's grid stops at
its first rate that fails the largest factor asked. "Light-load" is the grid's lowest rate: a
factor below which some policy fails even there has no ratio (printed as such).

    .venv/bin/python bench/ep_aware_slo_curve.py --jobs 2                     # both Mooncake rows
    .venv/bin/python bench/ep_aware_slo_curve.py --rows mooncake --scales 1,2,4 --aware-scales 2

Rows (``--rows``): ``mooncake`` (the embedded conversation trace) and ``mooncake_synthetic``
(Mooncake's FAST25 ``synthetic_trace.jsonl`` in ``--traces-dir`` as
``mooncake_synthetic_trace.jsonl``), both on ``dsv3-pd-h200`` (6 prefill engines of EP8, 1 decode
engine of EP8), approximate prefix index, seed ``--seed``. Output (``--out``, default
``bench_results/ep_aware_slo_curve-<time>/``): ``results.json`` (every grid run), ``table.md``,
``slo_curve.png``. Time on the 2-core development host at load ~17 (2026-12-05): 61 minutes wall, 12 minutes of CPU, with
``--jobs 2`` for both rows.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: SLO-aware ep_aware: since issue 23 part 3 the default routes SLO-blind on wide-EP pools (this scenario), so the
#: SLO-aware placement is asked for explicitly
OURS = "ep_aware:slo_wide_ep=true"
BLIND = "ep_aware:slo_aware=false"
ANCHORS = ("cache_aware", "kv_cost", "scored", "least_load", "dp_consistent_hash")
MOONCAKE_SYNTHETIC = "mooncake_synthetic_trace.jsonl"
SCENARIO = "dsv3-pd-h200"


def workload(row: str, traces_dir: Path | None, seed: int):  # noqa: ANN201
    from sim.search.point import WorkloadSpec

    if row == "mooncake":
        return WorkloadSpec(seed=seed)
    if row == "mooncake_synthetic":
        path = traces_dir / MOONCAKE_SYNTHETIC if traces_dir is not None else None
        if path is None or not path.is_file():
            raise SystemExit(f"row {row}: put {MOONCAKE_SYNTHETIC} (Mooncake's FAST25-release/traces/synthetic_trace.jsonl) "
                             "in --traces-dir")
        return WorkloadSpec(trace=str(path), seed=seed)
    raise SystemExit(f"unknown row {row!r} (mooncake, mooncake_synthetic)")


def run_grid(row: str, policy: str, aware_scale: float | None, rates: list[float], stop_above: float,
             slo_args: tuple[float, float, float, float], traces_dir: Path | None, seed: int) -> dict:
    """One policy's grid on one row: per rate scale (ascending), the needed TTFT factor, TTFT p99
    and attainment at the base SLO; stops after the first rate whose factor exceeds
    ``stop_above`` (``aware_scale``: the router routes against the base SLO times it)."""
    from sim.search.capacity import reachable_ttft_scale
    from sim.run.cluster import simulate
    from sim.search.fair_slo import attainment_at, scaled_slo
    from sim.run.metrics import per_request
    from sim.search.point import SLO, parse_policy
    from sim.scenario import load_scenario

    ttft_s, per_1k, tpot_s, att = slo_args
    slo = SLO(ttft_s=ttft_s, tpot_s=tpot_s, attainment=att, ttft_per_1k_prompt_tokens_s=per_1k)
    sc = load_scenario(SCENARIO)
    spec = workload(row, traces_dir, seed)
    base = spec.read()
    route_slo = scaled_slo(slo, aware_scale).ttft_slo() if aware_scale is not None else None
    runs = []
    for rate in rates:
        reqs = spec.at_rate(base, rate)
        prefill, decode = parse_policy(policy).build()
        t0 = time.process_time()
        res = simulate(sc, reqs, prefill, decode, seed=seed, index_mode="approximate", ttft_slo=route_slo)
        d = per_request(res)
        prompt = res.records.prompt_tokens.astype(np.float64)
        k = reachable_ttft_scale(d["ttft_s"], d["tpot_s"], prompt, slo)
        ttft = d["ttft_s"]
        runs.append({"rate_scale": rate, "needed_scale": float("inf") if k is None else float(k),
                     "ttft_p99_s": float(np.nanpercentile(ttft, 99)) if np.isfinite(ttft).any() else float("nan"),
                     "attainment_base": attainment_at(ttft, d["tpot_s"], prompt, slo), "cpu_s": time.process_time() - t0})
        if runs[-1]["needed_scale"] > stop_above:
            break
    return {"row": row, "policy": policy, "aware_scale": aware_scale, "runs": runs}


def curve(grids: list[dict], row: str, scales: list[float], aware: list[float]) -> list[dict]:
    """Per factor: every policy's rate (rate scale; 0 = below the grid, inf = above it), the best
    anchor, the ratios, and the TTFT p99 of the highest grid run that holds."""
    from sim.search.fair_slo import rate_at_ttft_scale

    def at(g: dict, k: float) -> tuple[float, float]:
        r = np.array([x["rate_scale"] for x in g["runs"]])
        need = np.array([x["needed_scale"] for x in g["runs"]])
        rate = rate_at_ttft_scale(r, need, k)
        ok = [x for x in g["runs"] if x["needed_scale"] <= k]
        return rate, (ok[-1]["ttft_p99_s"] if ok else float("nan"))

    out = []
    for k in scales:
        entry: dict = {"scale": k, "rates": {}, "p99_s": {}}
        for g in grids:
            if g["row"] != row or (g["aware_scale"] is not None and not math.isclose(g["aware_scale"], k)):
                continue
            name = g["policy"] if g["aware_scale"] is None else OURS
            entry["rates"][name], entry["p99_s"][name] = at(g, k)
        anchors = {p: v for p, v in entry["rates"].items() if p in ANCHORS}
        best = max(anchors, key=lambda p: anchors[p]) if anchors else None
        entry["best_anchor"] = best
        b = anchors.get(best, float("nan")) if best else float("nan")
        for name, key in ((BLIND, "ratio_blind"), (OURS, "ratio_aware")):
            v = entry["rates"].get(name)
            entry[key] = (v / b if b > 0 and math.isfinite(b) and v is not None and math.isfinite(v) else
                          float("nan"))
        entry["anchor_below_grid"] = b == 0.0
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    from pdlb_cli.args import ArgumentParser  # one usage line, then the error
    from pdlb_cli.arg_types import fraction, nonnegative_float, positive_float, positive_int, seed_int

    ap = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="mooncake,mooncake_synthetic", help="rows (default: %(default)s)")
    ap.add_argument("--anchors", default=",".join(ANCHORS), help="anchor policies (default: %(default)s)")
    ap.add_argument("--rates", default=",".join(f"{2 ** (i / 2):.4g}" for i in range(-10, 6)),
                    help="rate scales of the grid, ascending (default: 2^(i/2), i = -10..5: 1/32 to 5.7)")
    ap.add_argument("--scales", default="1,1.25,1.5,2,2.5,3,4,6,8", help="TTFT budget factors (default: %(default)s)")
    ap.add_argument("--aware-scales", default="1,2,4",
                    help="factors at which SLO-aware ep_aware runs its own grid (default: %(default)s; '' = none)")
    ap.add_argument("--slo-ttft-s", type=positive_float, default=2.0)
    ap.add_argument("--slo-ttft-per-1k-s", type=nonnegative_float, default=0.1,
                    help="TTFT budget per 1k prompt tokens, s (default 0.1; 0: none)")
    ap.add_argument("--slo-tpot-s", type=positive_float, default=0.05)
    ap.add_argument("--slo-attainment", type=fraction, default=0.9)
    ap.add_argument("--seed", type=seed_int, default=0)
    ap.add_argument("--jobs", type=positive_int, default=1, help="worker processes (default 1)")
    ap.add_argument("--traces-dir", type=Path, default=None, help="folder with mooncake_synthetic_trace.jsonl")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from pdlb_cli.args import positive_float
    from pdlb_cli.comma_lists import list_arg

    rates = list_arg(ap, "--rates", args.rates, "rate scales > 0", positive_float)
    scales = list_arg(ap, "--scales", args.scales, "factors > 0", positive_float)
    aware = list_arg(ap, "--aware-scales", args.aware_scales, "factors > 0", positive_float, empty_ok=True)
    if not rates or any(b <= a for a, b in zip(rates, rates[1:])) or min(rates) <= 0 or len(rates) > 64:
        print("error: --rates must be 1-64 positive, strictly increasing rate scales", file=sys.stderr)
        return 2
    if not scales or min(scales + aware) <= 0 or len(scales) > 64 or len(aware) > 16:
        print("error: --scales (1-64) and --aware-scales (0-16) must be positive factors", file=sys.stderr)
        return 2
    rows = list_arg(ap, "--rows", args.rows, "rows")
    anchors = list_arg(ap, "--anchors", args.anchors, "anchor policies")
    for row in rows:
        workload(row, args.traces_dir, args.seed)  # fail now on a missing trace
    slo_args = (args.slo_ttft_s, args.slo_ttft_per_1k_s, args.slo_tpot_s, args.slo_attainment)
    out = args.out or ROOT / "bench_results" / f"ep_aware_slo_curve-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    scales_all = sorted(set(scales) | set(aware))
    tasks = [(row, p, None, max(scales_all)) for row in rows for p in (BLIND, *anchors)]
    tasks += [(row, OURS, k, k) for row in rows for k in aware]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        futs = [ex.submit(run_grid, row, p, k, rates, stop, slo_args, args.traces_dir, args.seed)
                for row, p, k, stop in tasks]
        grids = []
        for f, (row, p, k, _) in zip(futs, tasks):
            grids.append(f.result())
            print(f"  {row} {p}{'' if k is None else f' (SLO-aware at x{k:g})'}: {len(grids[-1]['runs'])} runs, "
                  f"{sum(x['cpu_s'] for x in grids[-1]['runs']):.0f} s CPU", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0
    curves = {row: curve(grids, row, scales_all, aware) for row in rows}

    def fmt(v: float) -> str:
        return "< grid" if v == 0.0 else ("> grid" if math.isinf(v) else f"{v:.3g}")

    lines = [f"Base SLO: {args.slo_attainment:.0%} of requests with TTFT <= {args.slo_ttft_s:g} s + "
             f"{args.slo_ttft_per_1k_s:g} s/1k prompt tokens (both times the factor) and TPOT <= {args.slo_tpot_s * 1e3:g} "
             f"ms; scenario {SCENARIO}; rates are rate scales of the trace (grid {fmt(rates[0])}..{fmt(rates[-1])}); "
             f"{wall:.0f} s wall, jobs {args.jobs}.", ""]
    for row in rows:
        lines += [f"### {row}", "", "| TTFT factor | ep_aware SLO-blind | ep_aware (SLO-aware) | best anchor | "
                  "ratio blind | ratio SLO-aware | TTFT p99 s: blind / aware / best anchor |", "|---|---|---|---|---|---|---|"]
        for e in curves[row]:
            rb, ra = e["rates"].get(BLIND, float("nan")), e["rates"].get(OURS, float("nan"))
            best = e["best_anchor"]
            b = e["rates"].get(best, float("nan")) if best else float("nan")
            p = e["p99_s"]
            def ratio(key: str, name: str) -> str:
                v = e["rates"].get(name, float("nan"))
                if math.isnan(e[key]):  # the best anchor fails below the grid: a lower bound
                    return f"> {v / rates[0]:.2g}x" if e["anchor_below_grid"] and 0 < v < math.inf else "-"
                return f"{e[key]:.2f}x"
            ratio_b, ratio_a = ratio("ratio_blind", BLIND), ratio("ratio_aware", OURS)
            lines.append(f"| x{e['scale']:g} | {fmt(rb)} | {fmt(ra) if OURS in e['rates'] else '-'} | {best} {fmt(b)} | "
                         f"{ratio_b} | {ratio_a} | "
                         f"{p.get(BLIND, float('nan')):.1f} / {p.get(OURS, float('nan')):.1f} / "
                         f"{p.get(best, float('nan')) if best else float('nan'):.1f} |")
        lines.append("")
    table = "\n".join(lines)
    print(table)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps({"argv": sys.argv[1:], "rates": rates, "scales": scales_all,
                                                  "aware_scales": aware, "wall_s": wall, "grids": grids,
                                                  "curves": curves}, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, row in enumerate(rows):
        c = curves[row]
        xs = [e["scale"] for e in c if 0 < e["ratio_blind"] < math.inf]
        ys = [e["ratio_blind"] for e in c if 0 < e["ratio_blind"] < math.inf]
        ax.plot(xs, ys, marker="o", color=f"C{i}", label=f"{row}: SLO-blind ep_aware / best anchor")
        xa = [e["scale"] for e in c if 0 < e["ratio_aware"] < math.inf]
        ya = [e["ratio_aware"] for e in c if 0 < e["ratio_aware"] < math.inf]
        if xa:
            ax.plot(xa, ya, marker="s", linestyle="none", color=f"C{i}", label=f"{row}: ep_aware (SLO-aware)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("TTFT budget factor (x (2 s + 0.1 s/1k tokens))")
    ax.set_ylabel("highest rate at SLO, ratio to best anchor")
    ax.set_title(f"ep_aware vs the best anchor ({SCENARIO}, 90% SLO)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "slo_curve.png", dpi=110)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
