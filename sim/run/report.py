"""Result files, tables and plots of simulation runs.

A results folder holds:

- ``summary.json``: one summary per run (:func:`sim.run.metrics.summarize`) plus the scenario and
  workload description;
- ``requests_<policy>.csv``: per-request records and derived TTFT/TPOT/E2E; the policy part is
  the run's label made safe for file names (:func:`safe_file_stem`); ``summary.json`` keeps each
  run's label (``policy``, with its parameters) and its file (``requests_csv``);
- ``ttft_cdf.png``: TTFT CDF per policy; ``rank_load.png``: per-rank load over time per policy.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from balancer.types import Role
from sim.run.cluster import SimResult
from sim.run.file_names import safe_file_stem
from sim.run.metrics import per_request
from sim.run.records import INT_FIELDS, TIME_FIELDS


def _tiered(summaries: Sequence[dict[str, Any]]) -> bool:
    return any(s.get("kv", {}).get("tiers_configured") for s in summaries)


def _kv_cells(s: dict[str, Any]) -> list[str]:
    kv = s["kv"]
    h, b, t = kv["hit_rate"], kv["bytes"], kv["ttft_split_s"]
    return [
        f"{100 * h['hbm']:.1f}/{100 * h['host']:.1f}/{100 * h['store']:.1f}%",
        f"{(b['host_fetch'] + b['store_fetch']) / 1e9:.1f}",
        f"{(b['host_write'] + b['store_write']) / 1e9:.1f}",
        f"{b['pd_transfer'] / 1e9:.1f}",
        "/".join(f"{t[k]['mean']:.2f}" for k in ("queue_s", "fetch_s", "compute_s", "transfer_s")),
    ]


KV_COLUMNS = ("hit hbm/host/store", "fetch GB", "write GB", "PD xfer GB", "TTFT q/f/c/t s")


#: The columns of a run's summary: ``(header, justify, cell of a summary)``; the terminal table
#: (:func:`summary_table`) and ``summary.md`` (:func:`markdown_table`) both print exactly these.
SUMMARY_COLUMNS: tuple[tuple[str, str, Any], ...] = (
    ("policy", "left", lambda s: s["policy"]),
    ("TTFT mean s", "right", lambda s: f"{s['ttft_s']['mean']:.3f}"),
    ("TTFT p99 s", "right", lambda s: f"{s['ttft_s']['p99']:.3f}"),
    ("TPOT mean ms", "right", lambda s: f"{1e3 * s['tpot_s']['mean']:.1f}"),
    ("TPOT p99 ms", "right", lambda s: f"{1e3 * s['tpot_s']['p99']:.1f}"),
    ("E2E p50 s", "right", lambda s: f"{s['e2e_s']['p50']:.2f}"),
    ("hit rate", "right", lambda s: f"{100 * s['prefix_hit_rate']:.1f}%"),
    ("SLO att.", "right", lambda s: f"{100 * s['slo_attainment']:.1f}%"),
    ("goodput r/s", "right", lambda s: f"{s['goodput_rps']:.2f}"),
    ("out tok/s/GPU", "right", lambda s: f"{s['output_tokens_per_s_per_gpu']:.0f}"),
    ("P imb.", "right", lambda s: f"{s['prefill_step_imbalance']:.2f}"),
    ("D imb.", "right", lambda s: f"{s['decode_step_imbalance']:.2f}"),
)


def nothing_simulated(summary: dict[str, Any]) -> bool:
    """Every request of the run was rejected at arrival (:mod:`sim.run.admission`): no figure exists."""
    return summary["num_requests"] == 0 and summary.get("num_rejected", 0) > 0


def _row_cells(s: dict[str, Any]) -> list[str]:
    """A summary's cells of :data:`SUMMARY_COLUMNS`; a run of only rejected requests has ``-`` in
    every figure (not ``nan`` / ``nan%``), the rejection being reported by the caller. So does a
    single figure that is NaN: goodput when every request arrives at one instant (arrival window
    0 s, :func:`goodput_note`), TPOT when every request has one output token."""
    if nothing_simulated(s):
        return [s["policy"], *("-" for _ in SUMMARY_COLUMNS[1:])]
    cells = [cell(s) for _, _, cell in SUMMARY_COLUMNS]
    return [cells[0], *("-" if c.startswith("nan") else c for c in cells[1:])]


def goodput_note(summary: dict[str, Any]) -> str:
    """Why a run has no goodput, or ``""``: its requests all arrive at one instant (a burst
    replayed with ``--spread-s 0``, one request), so there is no arrival window to divide by
    (:mod:`sim.run.metrics`, "Goodput"); its SLO attainment still stands."""
    if nothing_simulated(summary) or summary.get("num_requests", 0) < 1:
        return ""
    window = summary.get("arrival_window_s")
    if window is not None and window == window and window > 0:  # NaN != NaN
        return ""
    n = summary["num_requests"]
    return (f"goodput: - because the {n} request{'s' if n != 1 else ''} arrive{'s' if n == 1 else ''} at one instant "
            "(arrival window 0 s; goodput counts SLO-meeting requests per second of it); see SLO att., or spread "
            "the arrivals (--spread-s S, or pdlb sim workload --rate R)")


def rejection_line(summary: dict[str, Any], max_model_len: int) -> str:
    """``"<policy>: N requests rejected at arrival (N over max_model_len; max_model_len M), not
    simulated"`` (``"... all N requests ..."``, and what to change, when none was simulated); ``""``
    when none was rejected."""
    n = summary.get("num_rejected", 0)
    if not n:
        return ""
    why = ", ".join(f"{count} over {reason}" for reason, count in sorted(summary["rejected"].items()))
    if nothing_simulated(summary):
        return (f"{summary['policy']}: all {n} requests rejected at arrival ({why}; max_model_len {max_model_len}): "
                "nothing was simulated; raise the scenario's max_model_len (--set max_model_len=N) or its KV "
                "capacity, or use shorter requests")
    return f"{summary['policy']}: {n} requests rejected at arrival ({why}; max_model_len {max_model_len}), not simulated"


def summary_table(summaries: Sequence[dict[str, Any]], title: str = "") -> Table:
    """A rich table: one row per run, the columns a capacity planner compares (:data:`SUMMARY_COLUMNS`;
    KV tiers, when configured, get their own table: :func:`kv_tier_table`)."""
    t = Table(title=title or None, show_lines=False)
    for name, justify, _ in SUMMARY_COLUMNS:
        # a policy label with parameters can be wider than its share: fold it, never cut it
        # (two variants of one policy would otherwise read alike, 'ep_aware(horizon_…')
        t.add_column(name, justify=justify, overflow="fold" if name == "policy" else "ellipsis")  # type: ignore[arg-type]
    for s in summaries:
        t.add_row(*_row_cells(s))
    return t


def kv_tier_table(summaries: Sequence[dict[str, Any]], title: str = "KV tiers") -> Table | None:
    """When KV tiers are configured: per run, the token-weighted hit rate per tier (HBM / host /
    store, %), GB fetched from lower tiers, written back, and moved prefill -> decode, and the mean
    TTFT split into queue / fetch / compute / transfer seconds. ``None`` without tiers."""
    if not _tiered(summaries):
        return None
    t = Table(title=title or None, show_lines=False)
    t.add_column("policy", justify="left", overflow="fold")
    for c in KV_COLUMNS:
        t.add_column(c, justify="right")
    for s in summaries:
        t.add_row(s["policy"], *_kv_cells(s))
    return t


def markdown_table(summaries: Sequence[dict[str, Any]]) -> str:
    """The same table as Markdown (for notes and docs): the columns of :func:`summary_table`, then
    the KV-tier table when tiers are configured."""
    head = "| " + " | ".join(name for name, _, _ in SUMMARY_COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(SUMMARY_COLUMNS)]
    for s in summaries:
        lines.append("| " + " | ".join(_row_cells(s)) + " |")
    if _tiered(summaries):
        lines += ["", "| policy | " + " | ".join(KV_COLUMNS) + " |", "|---" * (len(KV_COLUMNS) + 1) + "|"]
        lines += [f"| {s['policy']} | " + " | ".join(_kv_cells(s)) + " |" for s in summaries]
    return "\n".join(lines)


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def write_requests_csv(result: SimResult, path: Path) -> None:
    """Per-request records, one row per request, times in seconds."""
    rec = result.records
    derived = per_request(result)
    cols = {name: getattr(rec, name) for name in TIME_FIELDS + INT_FIELDS} | derived
    ranks = [str(info.replica) for info in result.ranks]
    adm = result.extra.get("admission")  # deadline admission's columns (sim.run.deadline_gate), when it ran
    if adm is not None:
        cols |= {"dispatch_s": adm.dispatch_s, "shed_s": adm.shed_s}
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["request_id", *cols, "prefill_replica", "decode_replica",
                    *(("tenant", "priority", "shed_reason") if adm is not None else ())])
        arrays = list(cols.values())
        for i, req in enumerate(result.requests):
            p, d = int(rec.prefill_rank[i]), int(rec.decode_rank[i])
            row = [req.request_id]
            for a in arrays:
                v = a[i]
                row.append("" if isinstance(v, float) and math.isnan(v) else (f"{v:.6f}" if isinstance(v, float) else int(v)))
            row += [ranks[p] if p >= 0 else "", ranks[d] if d >= 0 else ""]
            if adm is not None:
                row += [adm.tenant[i], adm.priority[i], adm.shed_reason[i]]
            w.writerow(row)


def results_file_names(labels: Sequence[str], prefix: str = "requests_", suffix: str = ".csv") -> list[str]:
    """One safe, distinct file name per label, in order (:func:`safe_file_stem`); labels that
    become the same stem (``a(x=1)`` and ``a-x=1``, or one label given twice) get ``-2``, ``-3``
    ... in order, so no run's file overwrites another's."""
    names: list[str] = []
    for label in labels:
        stem = safe_file_stem(label)
        name, k = f"{prefix}{stem}{suffix}", 2
        while name in names:
            name, k = f"{prefix}{stem}-{k}{suffix}", k + 1
        names.append(name)
    return names


def write_results(out_dir: Path, results: Sequence[SimResult], summaries: Sequence[dict[str, Any]],
                  meta: dict[str, Any], plots: bool = True) -> list[Path]:
    """Write the results folder; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    summary_path = out_dir / "summary.json"
    names = results_file_names([res.label for res in results])
    runs = [dict(smry) | {"requests_csv": name} for smry, name in zip(summaries, names)]
    payload = {"meta": meta, "scenario": results[0].scenario.model_dump() if results else None, "runs": runs}
    summary_path.write_text(json.dumps(_json_safe(payload), indent=2))
    written.append(summary_path)
    for res, name in zip(results, names):
        p = out_dir / name
        write_requests_csv(res, p)
        written.append(p)
    if plots and results:
        written += plot_results(out_dir, results)
    return written


def plot_results(out_dir: Path, results: Sequence[SimResult]) -> list[Path]:
    """``ttft_cdf.png`` (TTFT CDF per policy) and ``rank_load.png`` (per-rank load over time: every
    rank for small pools, else the min..max band, the max and the mean over ranks; in an
    EP-synchronous engine the max is what every rank waits for)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for res in results:
        ttft = np.sort(per_request(res)["ttft_s"])
        ttft = ttft[~np.isnan(ttft)]
        if len(ttft):
            ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=res.label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF — {results[0].scenario.name}")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # no finished request: no curve to label
        ax.legend(fontsize=8)
    fig.tight_layout()
    p = out_dir / "ttft_cdf.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)

    disagg = results[0].scenario.disaggregated
    rows = len(results)
    fig, axes = plt.subplots(rows, 2 if disagg else 1, figsize=(11 if disagg else 7, 2.2 * rows + 0.6),
                             squeeze=False, sharex=True)
    for k, res in enumerate(results):
        smp = res.samples.as_arrays()
        t = smp["times_s"]
        roles = [info.role for info in res.ranks]
        panels = [("prefill_queued_tokens", Role.PREFILL, "queued prefill tokens"),
                  ("decode_kv_tokens", Role.DECODE, "decode KV tokens")] if disagg else \
                 [("decode_running", Role.MIXED, "running sequences")]
        for j, (key, role, ylabel) in enumerate(panels):
            ax = axes[k][j]
            cols = [i for i, r in enumerate(roles) if r is role]
            if len(t) and cols:
                data = smp[key][:, cols]
                if data.shape[1] <= 8:
                    for c in range(data.shape[1]):
                        ax.plot(t, data[:, c], lw=0.6, alpha=0.7)
                else:  # many ranks: a band is readable, 48 lines are not
                    ax.fill_between(t, data.min(axis=1), data.max(axis=1), color="tab:blue", alpha=0.25,
                                    lw=0, label="min..max over ranks")
                ax.plot(t, data.max(axis=1), color="tab:red", lw=0.7, label="max over ranks")
                ax.plot(t, data.mean(axis=1), color="black", lw=1.2, label="mean over ranks")
            ax.set_ylabel(ylabel, fontsize=8)
            ax.set_title(f"{res.label}: per-rank {ylabel}", fontsize=9)
            ax.tick_params(labelsize=7)
            if k == 0 and j == 0 and ax.get_legend_handles_labels()[0]:  # an empty pool has no lines
                ax.legend(fontsize=7, loc="upper right")
    for ax in axes[-1]:
        ax.set_xlabel("simulated time (s)")
    fig.tight_layout()
    p = out_dir / "rank_load.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths
