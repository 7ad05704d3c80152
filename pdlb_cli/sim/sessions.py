"""``pdlb sim sessions`` (generate a session workload) and ``pdlb sim store-sweep`` (experiment 1)."""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pdlb_cli.args import seed_int

HOUR_S = 3600.0
DAY_S = 86400.0
DEFAULT_TTL_HOURS = "6,12,24,48,72,120,168"
DEEPSEEK_CLASS_TTL_HOURS = "agent=72,chatbot=168"
#: SessionWorkloadConfig field -> the flag that sets it (error messages name the flag)
_FIELD_FLAGS = {"sessions_per_hour": "--sessions-per-hour", "agent_fraction": "--agent-fraction",
                "block_size": "--block-size", "duration_s": "--days", "seed": "--seed"}


def _add_workload_args(p: argparse.ArgumentParser, days_default: float) -> None:
    g = p.add_argument_group("session workload (see sim/workload/sessions.py for every parameter)")
    g.add_argument("--days", type=float, default=days_default, metavar="D",
                   help=f"simulated days of session starts (default {days_default:g})")
    g.add_argument("--sessions-per-hour", type=float, metavar="R", help="new sessions per hour, both classes (default 60)")
    g.add_argument("--agent-fraction", type=float, metavar="F", help="fraction of agent sessions (default 0.3)")
    g.add_argument("--block-size", type=int, metavar="TOKENS", help="tokens per KV block (default 512)")
    g.add_argument("--seed", type=seed_int, default=0, help="seed (default 0)")
    g.add_argument("--config", type=Path, metavar="FILE",
                   help="a SessionWorkloadConfig as .json/.toml/.yaml (flags above override its fields)")


def add_session_parsers(simsub: Any) -> None:
    """Register ``sessions`` and ``store-sweep`` under ``pdlb sim``."""
    p = simsub.add_parser(
        "sessions", help="generate a multi-turn chatbot/agent session workload (JSONL)",
        description="Generate multi-turn chatbot conversations and agent sessions over days (prompts grow turn "
                    "by turn; sessions return after hours or days; agents share long system prompts) and write "
                    "them as Mooncake-style JSONL with session_id and traffic_class. Prints a summary.")
    p.add_argument("--out", type=Path, required=True, metavar="FILE",
                   help="output .jsonl or .jsonl.gz (an existing file is overwritten)")
    _add_workload_args(p, 7.0)
    p.set_defaults(session_cmd="sessions")

    s = simsub.add_parser(
        "store-sweep", help="experiment 1: shared KV store hit rate vs TTL and capacity, per traffic class",
        description="Replay a session workload (or a trace) through a shared KV store (KvStore) and report the "
                    "token-weighted prefix hit rate per traffic class for each TTL and capacity; writes a CSV, a "
                    "markdown table and a PNG curve. The first --warmup-days only fill the store.")
    _add_workload_args(s, 7.0)
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
    s.set_defaults(session_cmd="store-sweep")


def _config(args: argparse.Namespace, days: float):
    """The SessionWorkloadConfig of ``--config`` with the flags applied.

    Raises:
        ValueError: one line; a bad value set by a flag names the flag
            (``"--agent-fraction: Input should be less than or equal to 1"``), one from
            ``--config`` names the file and field, as :func:`balancer.validation.format_validation_error`.
    """
    from pydantic import ValidationError

    from sim.workload.sessions import SessionWorkloadConfig, load_session_config

    base = load_session_config(args.config) if args.config else SessionWorkloadConfig()
    upd: dict[str, Any] = {"duration_s": days * DAY_S, "seed": args.seed}
    for field in ("sessions_per_hour", "agent_fraction", "block_size"):
        v = getattr(args, field)
        if v is not None:
            upd[field] = v
    try:
        return SessionWorkloadConfig.model_validate(base.model_dump() | upd)
    except ValidationError as e:
        parts = []
        for err in e.errors():
            loc = tuple(err.get("loc", ()))
            field = str(loc[0]) if loc else ""
            msg = err.get("msg", "invalid").removeprefix("Value error, ")
            if field in upd and field in _FIELD_FLAGS:
                parts.append(f"{_FIELD_FLAGS[field]}: {msg}")
            else:  # a field of --config (already checked alone) or a check across fields
                if not loc:  # across fields: name the flags that set them (was: "lower duration_s or ...")
                    for name, flag in _FIELD_FLAGS.items():
                        msg = re.sub(rf"\b{name}\b", flag, msg)
                where = ".".join(str(x) for x in loc)
                text = f"{where}: {msg}" if where else msg
                parts.append(f"{args.config}: {text}" if args.config and field not in upd else text)
        raise ValueError("; ".join(parts)) from None


def run_session_command(args: argparse.Namespace, console: Console) -> int:
    """Run ``pdlb sim sessions`` or ``pdlb sim store-sweep``; returns the exit status."""
    if args.days <= 0:
        raise ValueError(f"--days must be > 0, got {args.days}")
    if args.session_cmd == "sessions":
        return _run_sessions(args, console)
    return _run_sweep(args, console)


def _summary_table(summary: dict[str, dict[str, float]], title: str) -> Table:
    t = Table(title=title)
    for col in ("class", "requests", "sessions", "mean prompt tokens", "mean output tokens", "ideal hit rate"):
        t.add_column(col, justify="right" if col != "class" else "left")
    for cls, s in summary.items():
        n = max(1, int(s["requests"]))
        t.add_row(cls, f"{int(s['requests'])}", f"{int(s['sessions'])}", f"{s['prompt_tokens'] / n:.0f}",
                  f"{s['output_tokens'] / n:.0f}", f"{100 * s['ideal_hit_rate']:.1f}%")
    return t


def _run_sessions(args: argparse.Namespace, console: Console) -> int:
    from sim.workload import session_workload, workload_summary, write_mooncake

    from pdlb_cli.args import check_out_file

    check_out_file(args.out, "sessions.jsonl")
    cfg = _config(args, args.days)
    t0 = time.perf_counter()
    with console.status(f"generating {args.days:g} days of sessions..."):
        requests = session_workload(cfg)
    gen_s = time.perf_counter() - t0
    if not requests:
        raise ValueError("the workload is empty: raise --days or --sessions-per-hour")
    n = write_mooncake(requests, args.out, block_size=cfg.block_size)
    console.print(_summary_table(workload_summary(requests, cfg.block_size),
                                 f"{args.days:g} days, {cfg.sessions_per_hour:g} sessions/h, seed {cfg.seed}"))
    console.print(f"wrote {n} requests to {args.out} (generated in {gen_s:.1f} s); "
                  f"read it back with block_size={cfg.block_size}")
    return 0


def _parse_list(text: str, what: str, scale: float) -> list[float | None]:
    out: list[float | None] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
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
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, val = part.partition("=")
        try:
            hours = float(val)
        except ValueError:
            hours = math.nan
        if not sep or not name.strip() or not (hours > 0 and math.isfinite(hours)):
            raise ValueError(f"--class-ttl-hours: expected CLASS=HOURS with HOURS > 0, got {part!r}")
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


def _run_sweep(args: argparse.Namespace, console: Console) -> int:
    from sim.engine.kv_store import KvStore
    from sim.experiments.store_hit_rate import replay_store, ttl_hit_rates
    from sim.workload import read_trace, session_workload

    ttls = _parse_list(args.ttl_hours, "--ttl-hours", HOUR_S)
    if None not in ttls:
        ttls.append(None)
    caps_f = _parse_list(args.capacity_blocks, "--capacity-blocks", 1.0)
    caps = [None if c is None else int(c) for c in caps_f]
    given = args.class_ttl_hours is not None
    class_ttl = _parse_class_ttls(args.class_ttl_hours if given else DEEPSEEK_CLASS_TTL_HOURS)
    if not args.trace:  # the generator's classes; a trace's are checked once it is read
        from sim.workload.sessions import AGENT, CHATBOT

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
        cfg = _config(args, args.warmup_days + args.days)
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
        from pdlb_cli.args import unique_results_dir

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
