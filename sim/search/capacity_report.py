"""Tables, plots and result files of capacity searches (:mod:`sim.search.capacity`).

- :func:`rate_table` / :func:`gpu_table`: the terminal tables (rich) and their Markdown twins,
  one row per policy with the searched answer, GPUs, goodput, goodput per GPU, attainment,
  latency figures and the ratio to the best *anchor* policy (:func:`anchor_policies`);
- :func:`plot_rate` (attainment, goodput and TTFT p99 vs request rate per policy, the
  DistServe-style figure), :func:`plot_gpus` (GPUs needed per policy);
- :func:`results_json` / :func:`write_points_csv`: every search and every evaluated point.

Anchors are the policies pdlb ships as baselines: every policy registered from
``balancer.policies`` except pdlb's own new ones (:data:`NOT_ANCHORS`); a user's
``--policy-module`` policies are never anchors.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from balancer.policies.base import available_policies, policy_class
from sim.search.capacity import GpuSearchResult, RateSearchResult
from sim.search.point import PointResult, point_row

#: Shipped policies that are pdlb's own contributions, compared *against* the anchors.
NOT_ANCHORS = frozenset({"ep_aware"})


def anchor_policies() -> list[str]:
    """Registered policies shipped in ``balancer.policies`` that are baselines (not :data:`NOT_ANCHORS`)."""
    return [n for n in available_policies()
            if policy_class(n).__module__.startswith("balancer.policies.") and n not in NOT_ANCHORS]


def _is_anchor(label: str) -> bool:
    """A policy label is an anchor when both its policies are anchors (with any parameters)."""
    anchors = set(anchor_policies())
    names = [part.split("(")[0] for part in label.split("+")]
    return all(n in anchors for n in names)


def _f(x: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x * scale, fmt)


def _ratio(x: float | None) -> str:
    """``1.00``, ``0.23``; small ratios keep 2 significant digits (``0.0017``)."""
    return "-" if x is None else (f"{x:.2f}" if x >= 0.1 else f"{x:.2g}")


def rate_ratios(results: Sequence[RateSearchResult]) -> list[float | None]:
    """Each policy's sustainable req/s over the best anchor's (None when either is unknown)."""
    best = max((r.rate_rps for r in results if r.rate_rps is not None and _is_anchor(r.policy)), default=None)
    return [r.rate_rps / best if best and r.rate_rps is not None else None for r in results]


def gpu_ratios(results: Sequence[GpuSearchResult]) -> list[float | None]:
    """Each policy's GPUs over the best (fewest) anchor's (None when either is unknown)."""
    best = min((r.num_gpus for r in results if r.num_gpus is not None and _is_anchor(r.policy)), default=None)
    return [r.num_gpus / best if best and r.num_gpus is not None else None for r in results]


def _best_cells(best: PointResult | None) -> list[str]:
    if best is None:
        return ["-"] * 5
    return [_f(best.goodput_rps, ".3f"), _f(best.goodput_per_gpu, ".4f"), _f(best.attainment, ".1f", 100),
            _f(best.ttft_p99_s, ".2f"), _f(best.tpot_p99_s, ".1f", 1e3)]


RATE_HEAD = ("policy", "rate scale", "req/s", "GPUs", "goodput r/s", "goodput/GPU", "attain. %", "TTFT p99 s",
             "TPOT p99 ms", "evals", "vs best anchor", "status")
GPU_HEAD = ("policy", "prefill eng.", "decode eng.", "mixed eng.", "GPUs", "goodput r/s", "goodput/GPU", "attain. %",
            "TTFT p99 s", "TPOT p99 ms", "evals", "GPUs vs best anchor", "status")


def rate_rows(results: Sequence[RateSearchResult]) -> list[list[str]]:
    rows = []
    for r, ratio in zip(results, rate_ratios(results)):
        rows.append([r.policy, _f(r.rate_scale, ".3f"), _f(r.rate_rps, ".3f"), str(r.num_gpus), *_best_cells(r.best),
                     str(len(r.points)), _ratio(ratio), r.status])
    return rows


def gpu_rows(results: Sequence[GpuSearchResult]) -> list[list[str]]:
    rows = []
    for r, ratio in zip(results, gpu_ratios(results)):
        cnt = [str(x) if x is not None else "-" for x in (r.prefill_engines, r.decode_engines, r.mixed_engines)]
        at_limit = any(n.startswith("at the limit") for n in r.notes)
        rows.append([r.policy, *cnt, str(r.num_gpus) if r.num_gpus is not None else "-", *_best_cells(r.best),
                     str(len(r.points)), _ratio(ratio), r.status + (" (at limit)" if at_limit else "")])
    return rows


def _drop_empty(head: Sequence[str], rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    keep = [i for i, h in enumerate(head) if not h.endswith("eng.") or any(row[i] != "-" for row in rows)]
    return [head[i] for i in keep], [[row[i] for i in keep] for row in rows]


def rich_table(head: Sequence[str], rows: list[list[str]], title: str) -> Table:
    t = Table(title=title)
    for i, h in enumerate(head):
        t.add_column(h, justify="left" if i == 0 or h == "status" else "right")
    for row in rows:
        t.add_row(*row)
    return t


def markdown(head: Sequence[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def rate_table(results: Sequence[RateSearchResult]) -> tuple[list[str], list[list[str]]]:
    return list(RATE_HEAD), rate_rows(results)


def gpu_table(results: Sequence[GpuSearchResult]) -> tuple[list[str], list[list[str]]]:
    return _drop_empty(GPU_HEAD, gpu_rows(results))


def reasons(results: Sequence[RateSearchResult | GpuSearchResult]) -> list[str]:
    """One line per distinct (status, reason) of the searches that did not simply succeed, naming
    the policies it applies to (the zero-load floor's reason is the same for every policy), then
    one per note."""
    groups: dict[tuple[str, str], list[str]] = {}
    for r in results:
        if r.reason:
            groups.setdefault((r.status, r.reason), []).append(r.policy)
    out = []
    for (status, reason), pols in groups.items():
        who = pols[0] if len(pols) == 1 else (f"all {len(pols)} policies" if len(pols) == len(results) else ", ".join(pols))
        out.append(f"{who}: {status}: {reason}")
    by_note: dict[str, list[str]] = {}  # a note several policies share is printed once, naming them
    for r in results:
        for n in r.notes:
            by_note.setdefault(n, []).append(r.policy)
    for n, pols in by_note.items():
        who = pols[0] if len(pols) == 1 else (f"all {len(pols)} policies" if len(pols) == len(results) else ", ".join(pols))
        out.append(f"{who}: note: {n}")
    return out


# ---------------------------------------------------------------------- files
def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        return _jsonable(x.item())
    return x


def result_dict(r: RateSearchResult | GpuSearchResult) -> dict[str, Any]:
    """A search result as JSON-friendly data (floor arrays summarised, points as rows)."""
    d: dict[str, Any] = {"policy": r.policy, "scenario": r.scenario, "slo": dataclasses.asdict(r.slo),
                         "slo_text": r.slo.describe(), "status": r.status, "reason": r.reason, "notes": r.notes}
    if isinstance(r, RateSearchResult):
        d |= {"search": "rate", "rate_scale": r.rate_scale, "rate_rps": r.rate_rps, "bracket": list(r.bracket),
              "base_rps": r.base_rps, "num_gpus": r.num_gpus}
    else:
        d |= {"search": "gpus", "rate_scale": r.rate_scale, "prefill_engines": r.prefill_engines,
              "decode_engines": r.decode_engines, "mixed_engines": r.mixed_engines, "num_gpus": r.num_gpus,
              "max_engines": r.max_engines}
    d["goodput_rps"] = r.goodput_rps
    d["best"] = point_row(r.best, summary=True) if r.best is not None else None
    if r.floor is not None:
        d["zero_load_floor"] = {"meets": r.floor.meets, "max_attainment": r.floor.verdict.get("attainment"),
                                "reason": r.floor.reason}
    d["points"] = [point_row(p, summary=False) for p in r.points]
    return _jsonable(d)


def write_points_csv(path: Path, points: Sequence[PointResult], *, summary: bool = True) -> None:
    """One row per point (:func:`sim.search.point.point_row`); columns are the union, in first-seen order."""
    rows = [point_row(p, summary=summary) for p in points]
    cols: dict[str, None] = {}
    for row in rows:
        cols.update(dict.fromkeys(row))
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(cols))
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if v is None else v) for k, v in row.items()})


# ---------------------------------------------------------------------- plots
def _plt():  # noqa: ANN202
    from sim.run.plots import pyplot

    return pyplot()


#: Legend entry of the hollow triangles (runs stopped early), listed only when some are drawn.
STOPPED_EARLY_LABEL = "stopped early (upper bound)"


def plot_rate(results: Sequence[RateSearchResult], curves: dict[str, list[PointResult]], path: Path) -> None:
    """The capacity figure (:func:`rate_figure`) written to ``path`` (PNG)."""
    plt = _plt()
    fig = rate_figure(results, curves)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # nothing cut at the edges (the legend's right side was)
    plt.close(fig)


#: Rates spanning more than this ratio get a log x axis (8 policies' answers piled up near 0
#: on a linear axis running to the highest rate tried).
LOG_RATE_SPAN = 4.0
#: Rows of answer labels above the attainment panel.
ANSWER_LEVELS = 4
#: Markers cycled with the colours, so lines stay apart in grey print and for colour-blind readers.
_MARKERS = "osD^v<>pXh"


def rate_figure(results: Sequence[RateSearchResult], curves: dict[str, list[PointResult]]) -> Any:
    """The :class:`matplotlib.figure.Figure` of a rate search, readable without the text around it.

    Three panels stacked over one request-rate axis (req/s; logarithmic when the rates span more
    than :data:`LOG_RATE_SPAN` x): SLO attainment (complete runs; hollow triangles = upper bounds
    of runs stopped early) with the target line labelled, goodput (the dashed diagonal is the
    offered rate: a run on it served every request within the SLO), TTFT p99 (log scale, decimal
    tick labels) with the flat TTFT budget labelled. Each policy's answer (the highest rate meeting
    the SLO) is a dotted vertical line in its colour, marked and labelled with its req/s on the
    attainment panel. One legend, outside the panels on the right, names the policies with their
    answers and explains the marks; the title states the SLO. ``curves``: extra complete runs per
    policy. Axes: ``fig.axes`` = attainment, goodput, TTFT p99; the caller closes the figure.
    """
    from matplotlib.lines import Line2D

    from sim.run.plots import plain_log_ticks

    plt = _plt()
    fig, axes = plt.subplots(3, 1, figsize=(12, 11), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    any_early = False
    handles: list[Any] = []
    rates: list[float] = []
    for i, r in enumerate(results):
        c, m = colors[i % len(colors)], _MARKERS[i % len(_MARKERS)]
        pts = sorted([*r.points, *curves.get(r.policy, [])], key=lambda p: p.offered_rps)
        pts = [p for p in pts if not p.error and math.isfinite(p.offered_rps) and p.offered_rps > 0]
        answer = f"{r.policy}: {r.rate_rps:.3g} req/s" if r.rate_rps is not None else f"{r.policy}: {r.status}"
        handles.append(Line2D([], [], color=c, marker=m, label=answer))
        if not pts:
            continue
        rates += [p.offered_rps for p in pts]
        full = [p for p in pts if not p.stopped_early]
        early = [p for p in pts if p.stopped_early]
        axes[0].plot([p.offered_rps for p in full], [100 * p.attainment for p in full], "-", marker=m, color=c)
        if early:
            axes[0].plot([p.offered_rps for p in early], [100 * p.attainment for p in early], "v", mfc="none", color=c)
            any_early = True
        axes[1].plot([p.offered_rps for p in full], [p.goodput_rps for p in full], "-", marker=m, color=c)
        axes[2].plot([p.offered_rps for p in full], [p.ttft_p99_s for p in full], "-", marker=m, color=c)
        if r.rate_rps is not None:
            for ax in axes:
                ax.axvline(r.rate_rps, color=c, ls=":", lw=1.2)
            best = r.best
            y = 100 * best.attainment if best is not None else 100.0
            axes[0].plot([r.rate_rps], [y], marker="*", ms=14, color=c, mec="k", mew=0.6, zorder=5)
    # each answer's req/s in a band above the attainment panel, at its line; neighbours (in rate order)
    # on different levels so close answers do not print over each other
    answered = sorted((r.rate_rps, i) for i, r in enumerate(results) if r.rate_rps is not None)
    for level, (rps, i) in enumerate(answered):
        axes[0].annotate(f"{rps:.3g}", (rps, 1.0), xycoords=("data", "axes fraction"),
                         xytext=(0, 3 + 10 * (level % ANSWER_LEVELS)), textcoords="offset points", ha="center",
                         fontsize=8, color=colors[i % len(colors)], fontweight="bold")
    slo = results[0].slo if results else None
    log_x = bool(rates) and max(rates) / min(rates) > LOG_RATE_SPAN
    top = max(rates, default=1.0)
    low = min(rates, default=0.0)
    diag = [low, top] if log_x else [0.0, top]
    axes[1].plot(diag, diag, "k--", lw=1)
    if slo is not None and slo.percentile is None:
        axes[0].axhline(100 * slo.attainment, color="k", ls="--", lw=1)
        axes[0].annotate(f"SLO target: {100 * slo.attainment:g}% of requests", (0.005, 100 * slo.attainment),
                         xycoords=("axes fraction", "data"), xytext=(0, -12), textcoords="offset points", fontsize=8)
    if slo is not None and not slo.ttft_per_1k_prompt_tokens_s:
        axes[2].axhline(slo.ttft_s, color="k", ls="--", lw=1)
        axes[2].annotate(f"TTFT budget {slo.ttft_s:g} s", (0.005, slo.ttft_s), xycoords=("axes fraction", "data"),
                         xytext=(0, 4), textcoords="offset points", fontsize=8)
    axes[1].annotate("offered rate (every request met the SLO)", (0.005, 0.95), xycoords="axes fraction",
                     fontsize=8, va="top")
    for ax, yl in zip(axes, ("SLO attainment (%)", "goodput (req/s meeting the SLO)", "TTFT p99 (s)")):
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3, which="both" if log_x else "major")
    axes[2].set_xlabel("offered request rate (req/s)" + (", log scale" if log_x else ""))
    if log_x:
        axes[2].set_xscale("log")
        plain_log_ticks(axes[2].xaxis)
    axes[2].set_yscale("log")
    plain_log_ticks(axes[2].yaxis)  # 0.6, 2 (not 6×10^-1, 2×10^0)
    extra = [Line2D([], [], color="0.3", ls=":", lw=1.2, marker="*", ms=10, mec="k",
                    label="answer: highest rate\nmeeting the SLO")]
    if any_early:
        extra.append(Line2D([], [], color="0.35", ls="", marker="v", mfc="none", label=STOPPED_EARLY_LABEL))
    if slo is not None and slo.percentile is None:
        extra.append(Line2D([], [], color="k", ls="--", lw=1, label=f"target {100 * slo.attainment:g}%"))
    fig.legend(handles=handles + extra, loc="upper left", bbox_to_anchor=(0.765, 0.89), fontsize=9,
               title="policy: answer", title_fontsize=9, frameon=True)
    fig.suptitle(f"highest request rate meeting {slo.describe()}\n(dotted lines and stars: each policy's answer, "
                 "its req/s above the top panel)" if slo else "", fontsize=11)
    fig.subplots_adjust(left=0.08, right=0.75, top=0.87, bottom=0.06, hspace=0.08)
    return fig


def plot_gpus(results: Sequence[GpuSearchResult], path: Path) -> None:
    """Bars of GPUs needed per policy, split by pool (policies that found no answer are omitted)."""
    plt = _plt()
    ok = [r for r in results if r.num_gpus is not None]
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(ok) + 2), 4.3))
    labels = [r.policy for r in ok]
    bottom = [0.0] * len(ok)
    for pool in ("prefill", "decode", "mixed"):
        vals = []
        for r in ok:
            n = getattr(r, f"{pool}_engines")
            sc = r.best.point.scenario if r.best else None
            p = getattr(sc, pool) if sc is not None else None
            vals.append(n * p.dp_ranks * p.gpus_per_rank if n and p is not None else 0)
        if any(vals):
            ax.bar(labels, vals, bottom=bottom, label=f"{pool} GPUs")
            bottom = [b + v for b, v in zip(bottom, vals)]
    for x, r in enumerate(ok):
        ax.text(x, r.num_gpus, str(r.num_gpus), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("GPUs needed")
    if not ok:
        ax.text(0.5, 0.5, "no policy met the SLO within the bounds", ha="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=8)
        ax.set_title(f"fewest GPUs meeting\n{ok[0].slo.describe()} at rate x{ok[0].rate_scale:g}", fontsize=9)
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
