"""CPU of per-request parts of the router service (issue 26), each measured against the way it
was done before where it changed, in the same run (thread CPU time, interleaved rounds, medians).

Run by hand::

    .venv/bin/python bench/request_cpu_parts.py

* **timer**: a non-streaming request through the lean upstream client set three timers (the
  request timeout, the leg's first-byte deadline, and that deadline again around reading the
  body); the proxy now skips the third when the whole body came with the head
  (``UpstreamResponse.arrived()``; a short answer on loopback almost always does): reading an
  arrived body inside ``asyncio.timeout_at`` vs bare.
* **histograms** (not changed; the measurement that decided it): each request observes two
  histograms (``pdlb_request_duration_seconds``, ``pdlb_prefix_match_ratio``); with several
  processes each ``observe`` writes the sum and a bucket to memory-mapped files. Their CPU per
  request in one process and in multiprocess mode (a child interpreter with
  ``PROMETHEUS_MULTIPROC_DIR`` set): the most that batching them per event-loop iteration could
  save (a batched version measured 0.5-1.7 us less at 8-32 requests per flush and 1.4-1.5 us more at
  one, on the 2-core development host: not worth its use of prometheus-client's private fields).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


async def _read_done() -> bytes:  # what UpstreamResponse.read does when the body has arrived: no wait
    return b"{}"


async def _timer_round(n: int, timed: bool) -> float:
    loop = asyncio.get_running_loop()
    t0 = time.thread_time_ns()
    for _ in range(n):
        if timed:
            async with asyncio.timeout_at(loop.time() + 60.0):
                await _read_done()
        else:
            await _read_done()
    return (time.thread_time_ns() - t0) / n / 1e3


def timers(n: int, rounds: int) -> None:
    async def run() -> tuple[list[float], list[float]]:
        bare, timed = [], []
        for _ in range(rounds):
            timed.append(await _timer_round(n, True))
            bare.append(await _timer_round(n, False))
        return bare, timed
    bare, timed = asyncio.run(run())
    b, t = statistics.median(bare), statistics.median(timed)
    print(f"timer: reading an arrived body inside asyncio.timeout_at {t:.2f} us, bare {b:.2f} us: "
          f"{t - b:.2f} us less per non-streaming request")


_HIST = r"""
import sys, time, statistics
from balancer.service.metrics import ServiceMetrics
n, rounds = int(sys.argv[1]), int(sys.argv[2])
m = ServiceMetrics(multiprocess=bool(sys.argv[3] == "1"))
durations = [0.003 + 0.0007 * (k % 50) for k in range(1000)]
ratios = [(k % 11) / 10 for k in range(1000)]
d, r = m.child(m.duration, "/v1/completions"), m.child(m.match_ratio, "decode")
out = []
for _ in range(rounds):
    t0 = time.thread_time_ns()
    for k in range(n):
        d.observe(durations[k % 1000])
        r.observe(ratios[k % 1000])
    out.append((time.thread_time_ns() - t0) / n / 1e3)
print(statistics.median(out))
"""


def histograms(n: int, rounds: int) -> None:
    got = {}
    for multi in (False, True):
        with tempfile.TemporaryDirectory() as d:
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            env.pop("PROMETHEUS_MULTIPROC_DIR", None)
            if multi:
                env["PROMETHEUS_MULTIPROC_DIR"] = d
            out = subprocess.run([sys.executable, "-c", _HIST, str(n), str(rounds), "1" if multi else "0"],
                                 env=env, capture_output=True, text=True, check=True)
        got[multi] = float(out.stdout)
    print(f"histograms: two observe() per request cost {got[False]:.2f} us in one process, {got[True]:.2f} us with "
          f"several processes ({got[True] / got[False]:.2f}x)")


def main() -> int:
    from pdlb_cli.arg_types import positive_int
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=positive_int, default=20_000, help="requests per round (default 20000)")
    ap.add_argument("--rounds", type=positive_int, default=7, help="interleaved rounds (default 7)")
    args = ap.parse_args()
    timers(args.requests, args.rounds)
    histograms(args.requests, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
