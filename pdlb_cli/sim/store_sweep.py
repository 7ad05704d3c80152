"""``pdlb sim store-sweep``: a shared KV store's token-weighted prefix hit rate per traffic class
for each TTL and capacity (:mod:`sim.experiments.store_hit_rate`), on generated sessions or a
trace; writes a CSV, a Markdown table and a PNG curve (docs/kv_cache.md, "hit rate vs TTL and
capacity")."""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pdlb_cli.args import DAY_S, add_session_workload_args, comma_items, session_config, unique_results_dir
from sim.run.engine.kv_store import KvStore
from sim.experiments.store_hit_rate import replay_store, ttl_hit_rates
from sim.workload import read_trace, session_workload
from sim.workload.sessions import AGENT, CHATBOT

HOUR_S = 3600.0
DEFAULT_TTL_HOURS = "6,12,24,48,72,120,168"
DEEPSEEK_CLASS_TTL_HOURS = "agent=72,chatbot=168"


def add_store_sweep_parser(simsub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``pdlb sim store-sweep``."""
    s = simsub.add_parser(
        "store-sweep", help="shared KV store hit rate vs TTL and capacity, per traffic class",
        description="Replay a session workload (or a trace) through a shared KV store (KvStore) and report the "
                    "token-weighted prefix hit rate per traffic class for each TTL and capacity; writes a CSV, a "
                    "markdown table and a PNG curve. The first --warmup-days only fill the store.")
    add_session_workload_args(s, 7.0)
    s.add_argument("--warmup-days", type=float, default=7.0, metavar="D",
                   help="days generated before the measured --days; their requests only fill the store (default 7)")
    s.add_argument("--trace", type=Path, metavar="FILE",
                   help="replay this Mooncake-style JSONL instead of generating (--warmup-days still applies)")
    s.add_argument("--ttl-hours", default=DEFAULT_TTL_HOURS, metavar="H,H,...",
                   help=f"uniform TTLs to sweep, hours; 'none' = never expire (default {DEFAULT_TTL_HOURS},none)")
    s.add_argument("--capacity-blocks", default="none", metavar="N,N,...",
                   help="store capacities in blocks; 'none' = unbounded (default none)")
    s.add_argument("--class-ttl-hours", metavar="C=H,...",
                   help=f"also run one per-class TTL setting (default DeepSeek's {DEEPSEEK_CLASS_TTL_HOURS}, skipped for "
                        "a --trace without those traffic classes; '' to skip)")
    s.add_argument("--out", type=Path, metavar="DIR",
                   help="results folder; an existing DIR is reused and its store_sweep.* files overwritten "
                        "(default results/store-sweep-<YYYYmmdd-HHMMSS>, with -2, -3, ... appended when that exists)")
    s.add_argument("--no-plots", action="store_true", help="skip the PNG")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    return s


def _parse_list(text: str, what: str, scale: float) -> list[float | None]:
    out: list[float | None] = []
    for part in comma_items(text, "numbers > 0 or 'none'", flag=what):
        if part.lower() == "none":
            out.append(None)
            continue
        try:
            v = float(part)
        except ValueError:
            raise ValueError(f"{what}: {part!r} is not a number or 'none'") from None
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"{what}: values must be > 0, got {part!r}")
        out.append(v * scale)
    if not out:
        raise ValueError(f"{what}: empty list")
    return out


def _parse_class_ttls(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in comma_items(text, "CLASS=HOURS pairs", flag="--class-ttl-hours"):
        name, sep, val = part.partition("=")
        try:
            hours = float(val)
        except ValueError:
            hours = math.nan
        if not sep or not name.strip() or not (hours > 0 and math.isfinite(hours)):
            raise ValueError(f"--class-ttl-hours: expected CLASS=HOURS with HOURS > 0, got {part!r}")
        if name.strip() in out:
            raise ValueError(f"--class-ttl-hours: class {name.strip()!r} is given twice in {text!r}")
        out[name.strip()] = hours * HOUR_S
    return out


def _check_classes(class_ttl: dict[str, float], known: set[str], source: str) -> None:
    """Raise ValueError naming ``--class-ttl-hours`` if it names a class ``source`` does not have."""
    unknown = sorted(set(class_ttl) - known)
    if unknown:
        listed = ", ".join(sorted(known)) if known else "none (no request has a traffic_class)"
        raise ValueError(f"--class-ttl-hours: unknown traffic class {', '.join(map(repr, unknown))}; "
                         f"classes in {source}: {listed}")


def _label_ttl(ttl_s: float | None) -> str:
    return "none" if ttl_s is None else f"{ttl_s / HOUR_S:g}"


def run_store_sweep(args: argparse.Namespace, console: Console) -> int:
    """Replay the sessions (or ``--trace``) through the store for each TTL and capacity, print the
    table and write the results folder; returns 0."""
    if args.days <= 0:
        raise ValueError(f"--days must be > 0, got {args.days}")
    ttls = _parse_list(args.ttl_hours, "--ttl-hours", HOUR_S)
    if None not in ttls:
        ttls.append(None)
    caps_f = _parse_list(args.capacity_blocks, "--capacity-blocks", 1.0)
    caps = [None if c is None else int(c) for c in caps_f]
    given = args.class_ttl_hours is not None
    class_ttl = _parse_class_ttls(args.class_ttl_hours if given else DEEPSEEK_CLASS_TTL_HOURS)
    if not args.trace:  # the generator's classes; a trace's are checked once it is read
        _check_classes(class_ttl, {AGENT, CHATBOT}, "the generated sessions")
    if args.warmup_days < 0:
        raise ValueError(f"--warmup-days must be >= 0, got {args.warmup_days}")
    warm_s = args.warmup_days * DAY_S
    t0 = time.perf_counter()
    if args.trace:
        block_size = args.block_size or 512
        requests = read_trace(args.trace, "mooncake", block_size=block_size)
        source = str(args.trace)
    else:
        cfg = session_config(args, args.warmup_days + args.days)
        block_size = cfg.block_size
        with console.status(f"generating {args.warmup_days + args.days:g} days of sessions..."):
            requests = session_workload(cfg)
        source = (f"sessions: {args.warmup_days:g}+{args.days:g} days, {cfg.sessions_per_hour:g}/h, "
                  f"agent fraction {cfg.agent_fraction:g}, seed {cfg.seed}")
    if not requests:
        raise ValueError("the workload is empty")
    if args.trace:
        classes_in = {r.traffic_class for r in requests if r.traffic_class}
        if not given and not set(class_ttl) <= classes_in:  # the default names classes the trace lacks: skip it
            class_ttl = {}
        _check_classes(class_ttl, classes_in, f"{args.trace}")
    measured = sum(1 for r in requests if r.arrival_time_s >= warm_s)
    if not measured:  # every request only fills the store: a table of 0% hit rates measures nothing
        last_s = max(r.arrival_time_s for r in requests)
        raise ValueError(f"no request arrives after the {args.warmup_days:g} warm-up days: the workload's last arrives "
                         f"at {last_s / DAY_S:.3g} days ({last_s:.4g} s); lower --warmup-days")
    if not args.quiet:
        console.print(f"workload: {source}; {len(requests)} requests ({measured} measured), "
                      f"{sum(len(r.block_hashes) for r in requests)} prompt blocks, generated/read in "
                      f"{time.perf_counter() - t0:.1f} s")

    # rows: (capacity, ttl label, {class: ClassHits})
    rows: list[tuple[int | None, str, dict]] = []
    jobs: list[tuple[int | None, float | None, dict[str, float] | None]] = []
    for cap in caps:
        if cap is None:
            res = ttl_hit_rates(requests, ttls, block_size, measure_from_s=warm_s)
            for i, ttl in enumerate(ttls):
                rows.append((None, _label_ttl(ttl), {c: v[i] for c, v in res.items()}))
        else:
            jobs.extend((cap, ttl, None) for ttl in ttls)
        if class_ttl:
            jobs.append((cap, None, class_ttl))
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=args.quiet or not jobs) as progress:
        for cap, ttl, cls_ttl in jobs:
            label = ",".join(f"{c}={_label_ttl(v)}" for c, v in cls_ttl.items()) if cls_ttl else _label_ttl(ttl)
            task = progress.add_task(f"cap {cap or 'none'} ttl {label}", total=len(requests))
            store = KvStore(cap, ttl_s=ttl, class_ttl_s=cls_ttl)
            res1 = replay_store(requests, store, block_size, measure_from_s=warm_s,
                                progress=lambda d, tot, task=task: progress.update(task, completed=d))
            rows.append((cap, label, res1))

    classes = ["all"] + sorted({c for _, _, r in rows for c in r if c != "all"})
    if args.out is not None:
        out = args.out
        out.mkdir(parents=True, exist_ok=True)
    else:
        out = unique_results_dir(Path("results") / f"store-sweep-{time.strftime('%Y%m%d-%H%M%S')}")
    with open(out / "store_sweep.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["capacity_blocks", "ttl_hours"] + [f"hit_rate_{c}" for c in classes]
                   + [f"prompt_tokens_{c}" for c in classes])
        for cap, label, r in rows:
            w.writerow([cap if cap is not None else "none", label]
                       + [f"{r[c].hit_rate:.6f}" if c in r else "" for c in classes]
                       + [r[c].prompt_tokens if c in r else "" for c in classes])
    md = ["| capacity blocks | TTL h | " + " | ".join(f"hit {c}" for c in classes) + " |",
          "|---|---|" + "---|" * len(classes)]
    table = Table(title=f"shared KV store hit rate (token-weighted), {args.days:g} measured days")
    table.add_column("capacity blocks")
    table.add_column("TTL h")
    for c in classes:
        table.add_column(f"hit {c}", justify="right")
    for cap, label, r in rows:
        cells = [f"{100 * r[c].hit_rate:.2f}%" if c in r else "-" for c in classes]
        md.append(f"| {cap if cap is not None else 'none'} | {label} | " + " | ".join(cells) + " |")
        table.add_row(str(cap if cap is not None else "none"), label, *cells)
    (out / "store_sweep.md").write_text("\n".join(md) + "\n")
    console.print(table)
    notes = _deepseek_note(rows)
    if notes:
        console.print(notes)
        (out / "store_sweep.md").open("a").write("\n" + notes + "\n")
    files = ["store_sweep.csv", "store_sweep.md"]
    if not args.no_plots:
        _plot(rows, classes, out / "store_sweep.png", args.days)
        files.append("store_sweep.png")
    console.print(f"results: {out}/ ({', '.join(files)}); command: {getattr(args, 'command_line', None) or ' '.join(sys.argv)}")
    return 0


def _deepseek_note(rows: list[tuple[int | None, str, dict]]) -> str:
    """Chatbot hit rate at TTL 168 h minus at 72 h (unbounded store), if both were run."""
    by = {(cap, label): r for cap, label, r in rows}
    a, b = by.get((None, "72")), by.get((None, "168"))
    if a is None or b is None or "chatbot" not in a:
        return ""
    h3, h7 = a["chatbot"].hit_rate, b["chatbot"].hit_rate
    relative = f" ({100 * (h7 - h3) / h7:.2f}% relative)" if h7 > 0 else ""  # no chatbot hit at 7 days: no ratio
    return (f"chatbot hit rate, unbounded store: TTL 7 days {100 * h7:.2f}%, 3 days {100 * h3:.2f}%: "
            f"a 3-day TTL costs {100 * (h7 - h3):.2f} percentage points{relative}")


def _plot(rows: list[tuple[int | None, str, dict]], classes: list[str], path: Path, days: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    colors = {"all": "black", "chatbot": "tab:blue", "agent": "tab:orange"}
    styles = ["-", "--", ":", "-."]
    caps = list(dict.fromkeys(cap for cap, _, _ in rows))
    for ci, cap in enumerate(caps):
        pts = [(float(label), r) for c, label, r in rows if c == cap and label not in ("none",) and "=" not in label]
        inf = [r for c, label, r in rows if c == cap and label == "none"]
        pts.sort(key=lambda x: x[0])
        for cls in classes:
            xs = [x for x, r in pts if cls in r]
            ys = [100 * r[cls].hit_rate for _, r in pts if cls in r]
            if not xs:
                continue
            lab = f"{cls}" + ("" if len(caps) == 1 else f", cap {cap or 'none'}")
            line, = ax.plot(xs, ys, styles[ci % len(styles)], marker="o", ms=3, color=colors.get(cls), label=lab)
            if inf and cls in inf[0]:
                ax.axhline(100 * inf[0][cls].hit_rate, color=line.get_color(), lw=0.6, ls=":", alpha=0.7)
    ax.set_xscale("log")
    ax.set_xlabel("store TTL, hours (log; dotted: no TTL)")
    ax.set_ylabel("prefix hit rate, % of prompt tokens")
    ax.set_title(f"Shared KV store hit rate vs TTL ({days:g} measured days)")
    for x in (72, 168):
        ax.axvline(x, color="grey", lw=0.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


class StoreSweep:
    """``pdlb sim store-sweep`` (:class:`pdlb_cli.command.Subcommand`)."""

    name = "store-sweep"
    add_parser = staticmethod(add_store_sweep_parser)
    run = staticmethod(run_store_sweep)
