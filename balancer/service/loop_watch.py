"""How late the router's event loop runs, and how much of that its own work explains (issue 25).

A timer is due every ``interval_s`` (50 ms in ``pdlb serve``); each time it runs, two numbers
go into the metrics:

* the **lag** (``pdlb_event_loop_lag_seconds``): how late the timer ran, in wall-clock time.
  Whatever delays it delays every client: a callback that blocks the loop (parsing a large body
  on it, say), but also a host that gives the router no CPU for a while (other processes on the
  same cores, a stolen virtual CPU).
* the **CPU lag** (``pdlb_event_loop_cpu_lag_seconds``): ``min(lag, CPU seconds the router
  process used since the timer was set)``, the part of the lag that the router's own work can
  explain. Work that blocks the loop is CPU work of the process (on the loop's thread, or another
  thread holding the GIL), so a block of ``c`` seconds shows in both. A wait for a CPU stretches
  wall time, not CPU time: on a host shared with other work, the lag grows and the CPU lag does
  not. So the CPU lag can be held to latency bounds on a loaded machine where the lag cannot
  (``tests/service/test_service_hostile.py`` holds it to issue 25's: p99 under 100 ms, never over 250 ms).

What the CPU lag does not see: a loop blocked without using CPU (a ``time.sleep`` or a blocking
read on the loop): it shows in the lag only. It may count too much, never too little, of a block
that is CPU work: the process's CPU time also counts the loop's ordinary work before the timer
was due and other threads' work in parallel (both at most what the lag leaves room for). Like the
lag, it under-counts a block by the part of it that fell before the timer was due (at most
``interval_s``).

Source: the measure is this module's own; the CPU clock is the process's
(``time.process_time``, ``CLOCK_PROCESS_CPUTIME_ID``: all threads, user and system time).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["LOOP_LAG_INTERVAL_S", "lag_sample", "watch_loop"]

LOOP_LAG_INTERVAL_S = 0.05
"""How often the event loop's lag is measured (seconds)."""


def lag_sample(interval_s: float, set_s: float, ran_s: float, cpu_set_s: float, cpu_ran_s: float) -> tuple[float, float]:
    """``(lag_s, cpu_lag_s)`` of one timer (module docstring): set at loop time ``set_s`` to run
    ``interval_s`` later, ran at ``ran_s``; the process's CPU clock read ``cpu_set_s`` and
    ``cpu_ran_s`` at those moments (all seconds). Both results are ``>= 0``, and
    ``cpu_lag_s <= lag_s``."""
    lag_s = max(0.0, ran_s - set_s - interval_s)
    return lag_s, min(lag_s, max(0.0, cpu_ran_s - cpu_set_s))


async def watch_loop(observe: Callable[[float, float], None], interval_s: float = LOOP_LAG_INTERVAL_S,
                     cpu_clock: Callable[[], float] = time.process_time) -> None:
    """Run forever on the current event loop: every ``interval_s`` seconds, ``observe(lag_s,
    cpu_lag_s)`` (:func:`lag_sample`). Cancel the task to stop it. Cost: two clock reads and one
    call per ``interval_s``."""
    loop = asyncio.get_running_loop()
    while True:
        set_s, cpu_set_s = loop.time(), cpu_clock()
        await asyncio.sleep(interval_s)
        observe(*lag_sample(interval_s, set_s, loop.time(), cpu_set_s, cpu_clock()))
