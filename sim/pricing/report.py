"""Rich tables, Markdown tables and the revenue heatmap PNG for ``pdlb sim price`` and docs.

Presentation only: the numbers come from :mod:`sim.pricing.revenue`, :mod:`sim.pricing.analysis`
and the sheets themselves. Money in USD (per GPU-hour or per 1M tokens), rates in tokens/s per GPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sim.pricing.analysis import OperatingPointRow, TargetRow
from sim.pricing.revenue import Economics
from sim.pricing.sheets import PriceSheet


def _fmt_batch(b: float) -> str:
    return "inf" if math.isinf(b) else f"{b:.0f}"


def sheets_table(sheets: Sequence[PriceSheet]):  # noqa: ANN201  (rich.table.Table)
    """Rich table of price sheets: list and valley prices, window, source."""
    from rich.table import Table

    t = Table(title="price sheets (USD per 1M tokens)")
    for c in ("sheet", "hit", "miss", "output", "valley hit/miss/out", "off-peak UTC", "source"):
        t.add_column(c, justify="left" if c in ("sheet", "source", "off-peak UTC") else "right",
                     overflow="fold")
    for s in sheets:
        v = s.prices_usd_per_mtok("valley")
        window = f"{s.offpeak_start_utc}-{s.offpeak_end_utc} (-{100 * s.offpeak_discount:.0f}%)" \
            if s.offpeak_discount > 0 else "none"
        t.add_row(s.name + (" [yellow](illustrative)[/]" if s.illustrative else ""),
                  f"{s.input_cache_hit_usd_per_mtok:g}", f"{s.input_cache_miss_usd_per_mtok:g}",
                  f"{s.output_usd_per_mtok:g}", f"{v[0]:g}/{v[1]:g}/{v[2]:g}", window, s.source)
    return t


def economics_table(rows: Sequence[tuple[str, Economics]], title: str):  # noqa: ANN201
    """Rich table: one row per (label, economics)."""
    from rich.table import Table

    t = Table(title=title)
    for c in ("run", "sheet", "period", "hit rate", "in tok/s/GPU", "out tok/s/GPU", "in:out",
              "$/GPU-h", "$/M tok", "cost $/M tok", "cost $/M out", "margin"):
        t.add_column(c, justify="left" if c in ("run", "sheet", "period") else "right")
    for label, e in rows:
        t.add_row(label, e.sheet, e.period, f"{100 * e.rates.hit_rate:.1f}%", f"{e.rates.input_tokens_per_s:,.0f}",
                  f"{e.rates.output_tokens_per_s:,.0f}", f"{e.rates.input_per_output:.2f}",
                  f"{e.revenue_usd_per_gpu_hour:.2f}", f"{e.revenue_usd_per_mtok:.4f}",
                  f"{e.cost_usd_per_mtok:.4f}", f"{e.cost_usd_per_output_mtok:.3f}", f"{100 * e.margin:.1f}%")
    return t


def target_rows_table(rows: Sequence[TargetRow], title: str):  # noqa: ANN201
    """Rich table of :func:`target_table` rows."""
    from rich.table import Table

    t = Table(title=title)
    for c in ("sheet", "hit", "in:out", "$/M tok", "out tok/s/GPU", "fixed B/rank", "fixed P load",
              "ok", "bal. B/rank", "bal. P/D GPUs", "ceiling $/h"):
        t.add_column(c, justify="left" if c == "sheet" else "right", no_wrap=c == "sheet")
    for r in rows:
        t.add_row(r.sheet, f"{100 * r.hit_rate:.1f}%", f"{r.input_per_output:g}", f"{r.usd_per_mtok:.4f}",
                  f"{r.required_output_tokens_per_s_per_gpu:,.0f}", _fmt_batch(r.fixed_batch_per_rank),
                  f"{r.fixed_prefill_load:.2f}", "[green]yes[/]" if r.fixed_feasible else "[red]no[/]",
                  _fmt_batch(r.balanced_batch_per_rank), f"{r.balanced_prefill_gpus_per_decode_gpu:.3f}",
                  f"{r.balanced_ceiling_usd_per_gpu_hour:,.0f}")
    return t


def target_markdown(rows: Sequence[TargetRow]) -> str:
    """The :func:`target_rows_table` as Markdown (for docs)."""
    head = ("| sheet | hit | in:out | $/M tok | out tok/s/GPU | fixed: batch/rank | fixed: prefill load | ok "
            "| balanced: batch/rank | balanced: P per D GPU | ceiling $/GPU-h |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r.sheet} | {100 * r.hit_rate:.1f}% | {r.input_per_output:g} | {r.usd_per_mtok:.4f} "
                     f"| {r.required_output_tokens_per_s_per_gpu:,.0f} | {_fmt_batch(r.fixed_batch_per_rank)} "
                     f"| {r.fixed_prefill_load:.2f} | {'yes' if r.fixed_feasible else 'no'} "
                     f"| {_fmt_batch(r.balanced_batch_per_rank)} | {r.balanced_prefill_gpus_per_decode_gpu:.3f} "
                     f"| {r.balanced_ceiling_usd_per_gpu_hour:,.0f} |")
    return "\n".join(lines)


def operating_point_markdown(rows: Sequence[OperatingPointRow]) -> str:
    """:func:`operating_point_table` rows as Markdown."""
    head = ("| sheet | hit | out tok/s/GPU | fixed split: in:out needed | fixed: prefill load "
            "| balanced: in:out needed | balanced: P GPUs per D GPU |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r.sheet} | {100 * r.hit_rate:.1f}% | {r.output_tokens_per_s_per_gpu:,.0f} "
                     f"| {r.fixed_input_per_output:.2f} | {r.fixed_prefill_load:.2f} "
                     f"| {r.balanced_input_per_output:.2f} | {r.balanced_prefill_gpus_per_decode_gpu:.3f} |")
    return "\n".join(lines)


def plot_revenue_heatmaps(path: str | Path, grids: Sequence[tuple[PriceSheet, np.ndarray]],
                          hit_rates: Sequence[float], ratios: Sequence[float], *, target_usd_per_gpu_hour: float,
                          title: str, row_labels: Sequence[str] = ("",)) -> Path:
    """Heatmap panels of revenue per GPU-hour (rows hit rate, columns input:output), values in the
    cells, cells at or above the target outlined. ``grids`` holds ``len(row_labels)`` figure rows of
    one panel per sheet each (row-major). Writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    nrows = len(row_labels)
    n = len(grids) // nrows
    fig, axes = plt.subplots(nrows, n, figsize=(3.2 * n + 1.2, 3.0 * nrows + 0.8), squeeze=False,
                             constrained_layout=True)
    vmax = min(max(float(np.nanmax(g)) for _, g in grids), 4 * target_usd_per_gpu_hour) or 1.0
    im = None
    for k, (ax, (sheet, g)) in enumerate(zip(axes.ravel(), grids, strict=True)):
        im = ax.imshow(g, origin="lower", cmap="viridis", vmin=0, vmax=vmax, aspect="auto")
        ax.set_xticks(range(len(ratios)), [f"{r:g}" for r in ratios])
        ax.set_yticks(range(len(hit_rates)), [f"{100 * h:.0f}%" for h in hit_rates])
        ax.set_xlabel("input:output tokens")
        label = row_labels[k // n]
        ax.set_title((f"{label}: " if label else "") + sheet.name + (" (illustr.)" if sheet.illustrative else ""),
                     fontsize=8)
        for i in range(g.shape[0]):
            for j in range(g.shape[1]):
                v = g[i, j]
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7,
                        color="black" if v > 0.6 * vmax else "white")
                if v >= target_usd_per_gpu_hour:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.5))
    for row in axes:
        row[0].set_ylabel("input cache-hit rate")
    fig.colorbar(im, ax=axes.ravel().tolist(), label="revenue $/GPU-h (colour clipped)")
    fig.suptitle(f"{title}\nred outline: >= ${target_usd_per_gpu_hour:g}/GPU-h", fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
