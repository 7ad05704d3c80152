"""Experiment 2 of ``docs/kv_cache.md``: with a shared KV store, how much does cache-aware routing buy?

On the embedded Mooncake conversation trace and the default scenario (``dsv3-pd-h200``: 48 prefill
DP ranks of DeepSeek-V3 on H200, 1 decode engine EP8), three set-ups, each at two load levels
(``scale_rate`` of the trace after spreading its batched timestamps over 3 s):

* ``hbm+cache_aware``: per-replica HBM prefix caches only, SGLang-style cache-aware prefill routing;
* ``store+least_load``: HBM caches plus a cluster-wide shared store (3FS-like, unbounded, no TTL
  within the hour-long trace, default bandwidths of :class:`sim.scenario.SharedStoreConfig`),
  least-load prefill routing (DeepSeek's balancer);
* ``store+cache_aware``: both; the router also sees the store (tier weight 0.5).

Decode routing is ``least_load`` throughout; fetch rule ``faster`` (fetch iff faster than
recomputing). Reports TTFT p50/p99, hit rate per tier, goodput (TTFT <= 2 s, TPOT <= 100 ms).

Run: ``python -m sim.experiments.tiers_vs_routing`` (``--help`` for options); about 6 runs of
5-15 s each on one core. Writes ``summary.json``, ``summary.md`` and ``tiers_vs_routing.png``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

SETUPS: dict[str, tuple[str, bool]] = {  # name -> (prefill policy, shared store)
    "hbm+cache_aware": ("cache_aware", False),
    "store+least_load": ("least_load", True),
    "store+cache_aware": ("cache_aware", True),
}


def run(rate_scales: list[float], limit: int | None = None, seed: int = 0,
        progress: Progress | None = None) -> list[dict[str, Any]]:
    """Every set-up at every rate scale; one summary row (dict) per run."""
    from sim.run.cluster import simulate
    from sim.run.metrics import summarize
    from sim.scenario import DEFAULT_PRESET, SharedStoreConfig, load_scenario
    from sim.workload import read_trace, scale_rate, spread_batches, take_slice

    base = load_scenario(DEFAULT_PRESET)
    reqs = read_trace()
    if limit is not None:
        reqs = take_slice(reqs, 0, limit)
    reqs = spread_batches(reqs, 3.0, seed=seed)
    rows = []
    task = progress.add_task("runs", total=len(rate_scales) * len(SETUPS)) if progress else None
    for scale in rate_scales:
        workload = scale_rate(reqs, scale) if scale != 1.0 else reqs
        for name, (policy, store) in SETUPS.items():
            sc = base.model_copy(update={"shared_store": SharedStoreConfig() if store else None,
                                         "name": f"{base.name}-{name}"})
            t0 = time.perf_counter()
            res = simulate(sc, workload, policy, "least_load", seed=seed)
            s = summarize(res)
            rows.append({
                "setup": name, "rate_scale": scale, "prefill_policy": policy,
                "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"], "ttft_mean_s": s["ttft_s"]["mean"],
                "hit_rate": s["prefix_hit_rate"], "hit_rate_tiers": s["kv"]["hit_rate"],
                "goodput_rps": s["goodput_rps"], "slo_attainment": s["slo_attainment"],
                "store_fetch_gb": s["kv"]["bytes"]["store_fetch"] / 1e9,
                "store_write_gb": s["kv"]["bytes"]["store_write"] / 1e9,
                "ttft_split_mean_s": {k: v["mean"] for k, v in s["kv"]["ttft_split_s"].items()},
                "prefill_load_imbalance": s["prefill_load_imbalance"],
                "num_requests": s["num_requests"], "wall_s": time.perf_counter() - t0,
            })
            if progress is not None:
                progress.advance(task)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| load | set-up | TTFT p50 s | TTFT p99 s | hit rate (HBM / store) | goodput r/s | SLO att. "
            "| fetch / compute mean s |")
    out = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        h = r["hit_rate_tiers"]
        sp = r["ttft_split_mean_s"]
        out.append(f"| x{r['rate_scale']:g} | {r['setup']} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.1f} "
                   f"| {100 * r['hit_rate']:.1f}% ({100 * h['hbm']:.1f} / {100 * h['store']:.1f}) "
                   f"| {r['goodput_rps']:.2f} | {100 * r['slo_attainment']:.1f}% "
                   f"| {sp['fetch_s']:.3f} / {sp['compute_s']:.2f} |")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    scales = sorted({r["rate_scale"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    width = 0.8 / len(SETUPS)
    x = np.arange(len(scales))
    for k, name in enumerate(SETUPS):
        sel = [next(r for r in rows if r["setup"] == name and r["rate_scale"] == s) for s in scales]
        for ax, key, label in ((axes[0], "ttft_p50_s", "TTFT p50 (s)"), (axes[1], "ttft_p99_s", "TTFT p99 (s)"),
                               (axes[2], "goodput_rps", "goodput (req/s)")):
            ax.bar(x + k * width, [r[key] for r in sel], width, label=name)
            ax.set_ylabel(label)
            ax.set_xticks(x + width, [f"rate x{s:g}" for s in scales])
    axes[0].legend(fontsize=8)
    fig.suptitle("Mooncake trace, dsv3-pd-h200: HBM + cache-aware routing vs shared store + least load vs both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sim.experiments.tiers_vs_routing",
        description="Experiment 2: per-replica HBM caches + cache-aware routing vs a shared KV store + least-load "
                    "routing vs both, on the embedded Mooncake trace at two load levels.")
    p.add_argument("--rate-scales", default="0.6,1.0", metavar="F,F",
                   help="arrival-rate multipliers (default 0.6,1.0: moderate and the default scenario's heavy load)")
    p.add_argument("--limit", type=int, metavar="N", help="first N requests only (default: the whole trace)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--out", type=Path, metavar="DIR", help="results folder (default results/tiers-vs-routing-<time>)")
    args = p.parse_args(argv)
    try:
        scales = [float(x) for x in args.rate_scales.split(",") if x.strip()]
    except ValueError:
        p.error(f"--rate-scales: expected comma-separated numbers, got {args.rate_scales!r}")
    if not scales or min(scales) <= 0:
        p.error("--rate-scales: give at least one multiplier > 0")
    console = Console()
    with Progress(console=console, transient=True) as prog:
        rows = run(scales, args.limit, args.seed, prog)
    out = args.out or Path("results") / f"tiers-vs-routing-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(rows, indent=2))
    md = markdown(rows)
    (out / "summary.md").write_text(md + "\n")
    plot(rows, out / "tiers_vs_routing.png")
    console.print(md)
    console.print(f"results in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
