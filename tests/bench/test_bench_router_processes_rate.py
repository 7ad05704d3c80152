"""The pure helpers of bench/router_processes_rate.py: the CPU-per-wake-up line and the wake-up
count read from /proc; expected values worked out by hand from the inputs written here."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
rr = pytest.importorskip("router_processes_rate")


def test_the_wakeup_line_through_exact_points() -> None:
    # cpu = 150 + 100 x wake-ups exactly: a = 150, b = 100, r = 1
    pts = [(0.5, 200.0), (1.0, 250.0), (2.5, 400.0), (3.0, 450.0)]
    a, b, r = rr.wakeup_fit(pts)
    assert a == pytest.approx(150.0) and b == pytest.approx(100.0) and r == pytest.approx(1.0)


def test_the_wakeup_line_through_scattered_points() -> None:
    # x = 0, 1, 2; y = 1, 3, 2: mean x 1, mean y 2; sxy = (-1)(-1) + 0 + (1)(0) = 1; sxx = 2; syy = 2
    # b = 1/2, a = 2 - 1/2 = 1.5, r = 1 / sqrt(2 * 2) = 0.5
    a, b, r = rr.wakeup_fit([(0.0, 1.0), (1.0, 3.0), (2.0, 2.0)])
    assert (a, b, r) == pytest.approx((1.5, 0.5, 0.5))


def test_no_line_without_points_or_spread() -> None:
    assert rr.wakeup_fit([(1.0, 2.0), (2.0, 3.0)]) is None  # two points: no fit claimed
    assert rr.wakeup_fit([(1.0, 2.0), (1.0, 3.0), (1.0, 4.0)]) is None  # all at one wake-up count


def test_wakeups_count_a_sleeping_process() -> None:
    """A child that sleeps 20 times blocks (and is woken) at least 20 times: its voluntary context
    switches grow by at least 20 (the kernel's own count, /proc/PID/task/*/status)."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nsys.stdin.readline()\n"
                              "for _ in range(20): time.sleep(0.002)\nsys.stdin.readline()"],
                             stdin=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        before = rr._wakeups(child.pid)
        assert before >= 1
        child.stdin.write("go\n")
        child.stdin.flush()
        time.sleep(0.5)
        assert rr._wakeups(child.pid) - before >= 20
    finally:
        child.stdin.write("end\n")
        child.stdin.flush()
        child.wait(10)
    assert rr._wakeups(os.getpid()) >= 0
