"""The helpers of bench/router_cores.py (issue 26: why x8 costs more per request than x1): the
half-window CPU per request and busy-process counts of a sampled time line, the per-repeat ratio
line, the thread CPU clock read from /proc, and the pinned busy loops. Expected values worked out
by hand from the inputs written here, or read from the kernel / the child's own clock."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
rc = pytest.importorskip("router_cores")


def test_halves_split_cpu_and_requests_at_the_middle_of_the_window() -> None:
    # two processes sampled at 0, 1, 2 s; CPU seconds: (0, 0) -> (0.5, 0.1) -> (1.5, 0.3)
    # requests in 0.5 s bins: 100, 100 in the first second, 300, 300 in the second
    # first half: (0.5 + 0.1) s / 200 requests = 3,000 us; second: (1.0 + 0.2) / 600 = 2,000 us
    # busy (> 0.1 core) per interval: 0.5 and 0.1 core -> 1 (0.1 is not above); 1.0 and 0.2 -> 2
    line = [(0.0, [0.0, 0.0], 1.0), (1.0, [0.5, 0.1], 1.0), (2.0, [1.5, 0.3], 2.0)]
    out = rc._halves(line, [100, 100, 300, 300], 0.5, 2.0)
    assert out["cpu_us_first_half"] == pytest.approx(3000.0)
    assert out["cpu_us_second_half"] == pytest.approx(2000.0)
    assert [(t, n, k) for t, n, k, _ in out["busy"]] == [(1.0, 1, 1.0), (2.0, 2, 2.0)]
    assert out["busy"][1][3] == [1.0, 0.2]  # cores of each process in the interval


def test_ratio_line_is_per_repeat_then_median() -> None:
    rows = {"a": [{"cpu_us": 300.0}, {"cpu_us": 200.0}, {"cpu_us": 500.0}],
            "b": [{"cpu_us": 200.0}, {"cpu_us": 200.0}, {"cpu_us": 250.0}]}
    # per repeat 1.5, 1.0, 2.0 -> median 1.5
    assert rc._ratio_line(rows, "a", "b") == "1.50x (per repeat 1.50, 1.00, 2.00)"
    assert rc._ratio_line(rows, "a", "missing") == "n/a"


def test_own_cpu_s_matches_the_childs_own_clock() -> None:
    # a child burns ~0.3 s of CPU and prints its process_time(); /proc's schedstat (ns, all
    # threads) of the same child agrees within 20 ms
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys, time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\n"
                              "print(time.process_time(), flush=True)\nsys.stdin.readline()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        own = float(child.stdout.readline())
        assert rc._own_cpu_s(child.pid) == pytest.approx(own, abs=0.02)
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(10)
    assert rc._own_cpu_s(child.pid) != rc._own_cpu_s(child.pid)  # gone: nan


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_burners_are_pinned_one_per_cpu_and_gone_after() -> None:
    cpu = min(os.sched_getaffinity(0))
    with rc.Burners([cpu], "spin") as b:
        assert [os.sched_getaffinity(p.pid) for p in b.procs] == [{cpu}]
        assert all(p.poll() is None for p in b.procs)
    assert all(p.poll() is not None for p in b.procs)
