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

While the router is quiet the timer backs off (:class:`LoopWatch`, what ``pdlb serve`` runs): a
timer that finds no request observed since the last one (:meth:`LoopWatch.kick`) and nothing in
flight doubles its interval, up to ``idle_interval_s`` (1 s); the next request brings
``interval_s`` back at once. An idle router process is then woken about once a second instead
of twenty times (issue 26: each wake-up of an idle process costs ~100-150 us of CPU). A block
while quiet is still seen if it covers the timer's due time (a block longer than
``idle_interval_s`` always is); the first request after a quiet spell is measured at the usual
50 ms again.

Source: the measure is this module's own; the CPU clock is the process's
(``time.process_time``, ``CLOCK_PROCESS_CPUTIME_ID``: all threads, user and system time).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["LOOP_LAG_IDLE_INTERVAL_S", "LOOP_LAG_INTERVAL_S", "LoopWatch", "lag_sample", "watch_loop"]

LOOP_LAG_INTERVAL_S = 0.05
"""How often the event loop's lag is measured while requests come or are in flight (seconds)."""
LOOP_LAG_IDLE_INTERVAL_S = 1.0
"""The longest interval of :class:`LoopWatch`'s timer while the router is quiet (seconds)."""


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


class LoopWatch:
    """:func:`watch_loop`'s timer as loop callbacks, backing off while quiet (module docstring).

    Every ``interval_s`` seconds while active, ``observe(lag_s, cpu_lag_s)`` (:func:`lag_sample`).
    A timer that runs with no :meth:`kick` since the previous one and ``busy()`` false sets the
    next one twice as far (at most ``idle_interval_s``); otherwise ``interval_s``. :meth:`kick`
    (once per request, cheap: one store and one compare) marks the interval active and, while
    backed off, replaces the pending timer by one ``interval_s`` from now (that timer's sample is
    dropped: it had not come due). :meth:`start` on the running loop; :meth:`stop` cancels.

    Raises:
        ValueError: ``interval_s`` not positive or ``idle_interval_s < interval_s``.
    """

    __slots__ = ("observe", "interval_s", "idle_interval_s", "busy", "cpu_clock", "active", "_interval",
                 "_set_s", "_cpu_set_s", "_handle", "_loop")

    def __init__(self, observe: Callable[[float, float], None], interval_s: float = LOOP_LAG_INTERVAL_S,
                 idle_interval_s: float = LOOP_LAG_IDLE_INTERVAL_S, busy: Callable[[], bool] | None = None,
                 cpu_clock: Callable[[], float] = time.process_time) -> None:
        if not interval_s > 0 or not idle_interval_s >= interval_s:
            raise ValueError(f"need 0 < interval_s <= idle_interval_s, got {interval_s}, {idle_interval_s}")
        self.observe = observe
        self.interval_s = interval_s
        self.idle_interval_s = idle_interval_s
        self.busy = busy
        self.cpu_clock = cpu_clock
        self.active = False  # a request was observed since the last timer
        self._interval = interval_s  # the pending timer's
        self._set_s = self._cpu_set_s = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def current_interval_s(self) -> float:
        """The pending timer's interval (seconds): ``interval_s`` unless backed off."""
        return self._interval

    def start(self) -> None:
        """Arm the first timer (``interval_s``) on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._arm(self.interval_s)

    def stop(self) -> None:
        """Cancel the pending timer (no more samples)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._loop = None

    def kick(self) -> None:
        """A request came: this interval counts as active; back to ``interval_s`` if backed off."""
        self.active = True
        if self._interval != self.interval_s and self._handle is not None:
            self._handle.cancel()
            self._arm(self.interval_s)

    def _arm(self, interval_s: float) -> None:
        loop = self._loop
        assert loop is not None
        self._interval = interval_s
        self._set_s, self._cpu_set_s = loop.time(), self.cpu_clock()
        self._handle = loop.call_at(self._set_s + interval_s, self._tick)

    def _tick(self) -> None:
        loop = self._loop
        if loop is None:
            return
        self.observe(*lag_sample(self._interval, self._set_s, loop.time(), self._cpu_set_s, self.cpu_clock()))
        if self.active or (self.busy is not None and self.busy()):
            nxt = self.interval_s
        else:
            nxt = min(self._interval * 2, self.idle_interval_s)
        self.active = False
        if self._loop is not None:  # observe may have stopped it
            self._arm(nxt)
