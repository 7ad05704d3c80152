"""``pdlb sim sessions``: generate multi-turn chatbot and agent sessions over days
(:mod:`sim.workload.sessions`) and write them as Mooncake-style JSONL with ``session_id`` and
``traffic_class``; prints a summary per class."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pdlb_cli.args import add_session_workload_args, check_out_file, session_config
from sim.workload import session_workload, workload_summary, write_mooncake


def add_sessions_parser(simsub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``pdlb sim sessions``."""
    p = simsub.add_parser(
        "sessions", help="generate a multi-turn chatbot/agent session workload (JSONL)",
        description="Generate multi-turn chatbot conversations and agent sessions over days (prompts grow turn "
                    "by turn; sessions return after hours or days; agents share long system prompts) and write "
                    "them as Mooncake-style JSONL with session_id and traffic_class. Prints a summary.")
    p.add_argument("--out", type=Path, required=True, metavar="FILE",
                   help="output .jsonl or .jsonl.gz (an existing file is overwritten)")
    add_session_workload_args(p, 7.0)
    return p


def _summary_table(summary: dict[str, dict[str, float]], title: str) -> Table:
    t = Table(title=title)
    for col in ("class", "requests", "sessions", "mean prompt tokens", "mean output tokens", "ideal hit rate"):
        t.add_column(col, justify="right" if col != "class" else "left")
    for cls, s in summary.items():
        n = max(1, int(s["requests"]))
        t.add_row(cls, f"{int(s['requests'])}", f"{int(s['sessions'])}", f"{s['prompt_tokens'] / n:.0f}",
                  f"{s['output_tokens'] / n:.0f}", f"{100 * s['ideal_hit_rate']:.1f}%")
    return t


def run_sessions(args: argparse.Namespace, console: Console) -> int:
    """Generate the sessions, write them as JSONL and print the summary table; returns 0."""
    if args.days <= 0:
        raise ValueError(f"--days must be > 0, got {args.days}")
    check_out_file(args.out, "sessions.jsonl")
    cfg = session_config(args, args.days)
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


class Sessions:
    """``pdlb sim sessions`` (:class:`pdlb_cli.command.Subcommand`)."""

    name = "sessions"
    add_parser = staticmethod(add_sessions_parser)
    run = staticmethod(run_sessions)
