"""``pdlb dev gpu-runs compact RAW OUT`` | ``pdlb dev gpu-runs report [--plot PNG]``: the measured
GPU runs of :mod:`sim.validation.gpu_runs` (a raw ``bench/gpu_engine_run.py`` result made into the
committed record; measured vs simulated for the shipped runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from sim.validation.gpu_runs import compact_file, plot, print_rows


class GpuRuns:
    """``pdlb dev gpu-runs`` (:class:`pdlb_cli.command.Subcommand`)."""

    name = "gpu-runs"

    def add_parser(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        ap = subparsers.add_parser("gpu-runs", help="measured GPU runs: compact a raw result, report measured vs "
                                                    "simulated",
                                   description="Measured GPU runs of a real engine (sim.validation.gpu_runs).")
        sub = ap.add_subparsers(dest="gpu_runs_command", required=True)
        c = sub.add_parser("compact", help="raw bench/gpu_engine_run.py output -> committed record")
        c.add_argument("raw", type=Path, help="raw result (.json.gz)")
        c.add_argument("out", type=Path, help="record to write (.json.gz)")
        rp = sub.add_parser("report", help="measured vs simulated for the shipped runs (as pdlb sim validate --gpu-runs)")
        rp.add_argument("--plot", metavar="PNG", help="also draw measured vs simulated into this file")
        return ap

    def run(self, args: argparse.Namespace, console: Console) -> int:
        if args.gpu_runs_command == "compact":
            compact_file(args.raw, args.out)
            return 0
        print_rows(Console(width=160))
        if args.plot:
            print(f"wrote {plot(args.plot)}")
        return 0
