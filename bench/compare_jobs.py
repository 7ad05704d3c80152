#!/usr/bin/env python3
"""Benchmark: ``pdlb sim compare`` (the README's main command) with every policy run one after
another (``--jobs 1``, the baseline) vs in ``--jobs N`` worker processes (``--jobs 2,4,8``: each
of several N), in the same run.

All must give the same table (checked: every summary field but wall time). Printed: wall time of
each (the whole command, start-up included), the speed-up over the serial baseline, the CPU time
(user + system of the command and its worker processes, from ``getrusage(RUSAGE_CHILDREN)``), the
machine's cores and its 1-minute load average before each run. With ``--repeat R`` every job count
is run R times, interleaved, the order rotated by one each repeat (1, 2, 4, 8; then 2, 4, 8, 1; ...)
so that a load change during the run hits all of them; the medians are compared.

On a shared machine the wall-time ratio says little: with load L on C cores a second worker gets
about C / (L + 1) of a core. CPU time shows the work each way costs (the parallel run adds process
start-up and the trace's pickling per worker).

    .venv/bin/python bench/compare_jobs.py [--jobs 2[,4,8]] [--limit N] [--policies a,b,...] [--repeat R]

On a quiet many-core machine (the 16-core GPU host, which starts bare with Python 3.12 and reaches
no registry): fetch the wheels here, carry them, install offline there::

    .venv/bin/pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d wheels312 '.[sim]'
    # device run, carry ["wheels312"] (about 40 MB):
    python3 -m venv /tmp/v && /tmp/v/bin/pip install -q --no-index --find-links wheels312 '.[sim]' &&
      /tmp/v/bin/python bench/compare_jobs.py --jobs 2 --repeat 2 && /tmp/v/bin/python bench/compare_jobs.py --jobs 10
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PDLB = [sys.executable, "-c", "import sys; from pdlb_cli.main import main; sys.exit(main(sys.argv[1:]))"]


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> None:
    """Make this process the reaper of orphaned descendants (Linux), so that the CPU time of the
    forkserver and its workers (which the compare process may leave unreaped) reaches
    ``RUSAGE_CHILDREN`` when ``reap_orphans`` waits for them. Without it their CPU time is lost."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def reap_orphans(timeout_s: float = 30.0) -> None:
    """Wait for every orphaned descendant reparented to this process (bounded by ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.05)


def children_cpu_s() -> float:
    """User + system CPU seconds of every waited-for descendant so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(jobs: int, args: argparse.Namespace, out: Path) -> tuple[float, float, float, list[dict]]:
    """One ``pdlb sim compare``: (wall_s, cpu_s, load average before, the summary rows)."""
    cmd = [*PDLB, "sim", "compare", "--jobs", str(jobs), "--quiet", "--no-plots", "--out", str(out)]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    if args.policies:
        cmd += ["--policies", args.policies]
    load = os.getloadavg()[0]
    cpu0 = children_cpu_s()
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    reap_orphans()
    cpu = children_cpu_s() - cpu0
    runs = json.loads((out / "summary.json").read_text())["runs"]
    return wall, cpu, load, [{k: v for k, v in r.items() if k not in ("wall_s", "events_per_request")} for r in runs]


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pdlb_cli.args import ArgumentParser  # one usage line, then the error
    from pdlb_cli.arg_types import positive_int

    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", default=str(len(os.sched_getaffinity(0))),
                    help="worker processes of the parallel run(s), one or a comma list (default: the cores)")
    ap.add_argument("--limit", type=positive_int, help="first N requests (default: the whole trace)")
    ap.add_argument("--policies", help="comma-separated (default: every policy)")
    ap.add_argument("--repeat", type=positive_int, default=1, help="runs of each, alternating order (default 1)")
    args = ap.parse_args()
    if not 1 <= args.repeat <= 20:
        ap.error("--repeat must be 1..20")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pdlb_cli.args import positive_int
    from pdlb_cli.comma_lists import list_arg

    counts = list_arg(ap, "--jobs", args.jobs, "integers in 1..256", positive_int)
    if max(counts) > 256:
        ap.error("--jobs values must be 1..256")
    counts = [1] + sorted(set(counts) - {1})
    become_subreaper()
    walls: dict[int, list[float]] = {j: [] for j in counts}
    cpus: dict[int, list[float]] = {j: [] for j in counts}
    tables: dict[int, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            order = counts[i % len(counts):] + counts[:i % len(counts)]
            for jobs in order:
                wall, cpu, load, table = run(jobs, args, Path(tmp) / f"j{jobs}-{i}")
                walls[jobs].append(wall)
                cpus[jobs].append(cpu)
                tables.setdefault(jobs, table)
                same_run = tables[jobs] == table
                print(f"  run {i + 1} --jobs {jobs}: wall {wall:6.1f} s, cpu {cpu:6.1f} s, "
                      f"load before {load:4.1f}{'' if same_run else ' (TABLE DIFFERS between repeats)'}",
                      flush=True)
    same = all(tables[j] == tables[1] for j in counts)
    ws, cs = statistics.median(walls[1]), statistics.median(cpus[1])
    print(f"cores: {len(os.sched_getaffinity(0))}; requests: {args.limit or 'all'}; policies: {len(tables[1])}; "
          f"repeats: {args.repeat} (medians)")
    print(f"--jobs 1:          wall {ws:7.1f} s  cpu {cs:7.1f} s  (baseline)")
    for j in counts[1:]:
        wp, cp = statistics.median(walls[j]), statistics.median(cpus[j])
        print(f"--jobs {j:<3}        wall {wp:7.1f} s  cpu {cp:7.1f} s  "
              f"wall x{ws / wp:.2f} faster, cpu x{cp / cs:.2f} of the baseline's")
    print(f"same table: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
