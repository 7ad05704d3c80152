#!/usr/bin/env python3
"""Benchmark: ``pdlb sim compare`` (the README's main command) with every policy run one after
another (``--jobs 1``, the baseline) vs in ``--jobs N`` worker processes, in the same run.

Both must give the same table (checked: every summary field but wall time). Printed: wall time of
each (the whole command, start-up included), the speed-up over the serial baseline, and the
machine's cores.

    .venv/bin/python bench/compare_jobs.py [--jobs 2] [--limit N] [--policies a,b,...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PDLB = [sys.executable, "-c", "import sys; from pdlb_cli.main import main; sys.exit(main(sys.argv[1:]))"]


def run(jobs: int, args: argparse.Namespace, out: Path) -> tuple[float, list[dict]]:
    cmd = [*PDLB, "sim", "compare", "--jobs", str(jobs), "--quiet", "--no-plots", "--out", str(out)]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    if args.policies:
        cmd += ["--policies", args.policies]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    runs = json.loads((out / "summary.json").read_text())["runs"]
    return wall, [{k: v for k, v in r.items() if k not in ("wall_s", "events_per_request")} for r in runs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--limit", type=int, help="first N requests (default: the whole trace)")
    ap.add_argument("--policies", help="comma-separated (default: every policy)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        serial_s, serial = run(1, args, Path(tmp) / "serial")
        par_s, par = run(args.jobs, args, Path(tmp) / "parallel")
    same = serial == par
    print(f"cores: {len(os.sched_getaffinity(0))}; requests: {args.limit or 'all'}; policies: {len(serial)}")
    print(f"--jobs 1:          {serial_s:7.1f} s  (baseline)")
    print(f"--jobs {args.jobs:<2}         {par_s:7.1f} s  x{serial_s / par_s:.2f} faster")
    print(f"same table: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
