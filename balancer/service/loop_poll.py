"""Keep a partly idle event loop polling for a short while after bytes arrive (``loop_poll_us``,
opt-in; issue 26: the CPU per request of a partly idle router process).

An event loop that finds nothing ready blocks in ``epoll_wait`` and is woken by the next event.
Each wake-up costs a router process far more than the system call: the kernel's switch, and the
interpreter finding its caches cold (``bench/partial_load_cpu.py``: 130-150 us of CPU per wake-up
on the 2-core development host, where one saturated process spends ~100 us on a whole request;
a bare Python process pays 20-40). A process at partial load is woken for nearly every event (a
client's request, each engine answer), so its CPU per request is 2-3x its saturated figure.

:class:`LoopPoller` trades a bounded wait for those wake-ups: after any bytes arrive from a client
or an engine (:meth:`LoopPoller.kick`, called by the lean front's and the lean upstream client's
``data_received``), it keeps one callback queued (:meth:`asyncio.AbstractEventLoop.call_soon`),
so each pass of the loop polls with a zero timeout instead of blocking, until ``window_s`` has
passed since the last bytes. An event that comes within the window is handled by a running loop
(no switch, caches warm); one that comes later finds the loop blocked as before. The polling is CPU
the process pays: it wins where events come closer together than a wake-up costs (mid load),
costs up to ``window_s`` per quiet spell at low load, and a callback per pass when saturated.
Measured in docs/serving.md ("The partly idle process"). Requests, answers and timings are
otherwise unchanged: the callback does nothing but re-queue itself.

Source: the measure is pdlb's own; the technique is the one of Linux's guest halt polling
(``cpuidle-haltpoll``: poll a while before halting a virtual CPU), applied to one event loop.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

__all__ = ["LOOP_POLL_MAX_US", "LoopPoller"]

LOOP_POLL_MAX_US = 10_000.0
"""The longest polling window accepted (us): 10 ms, far above any wake-up's cost."""


class LoopPoller:
    """Polls ``loop`` for ``window_s`` seconds after each :meth:`kick` (module docstring).

    ``clock``: seconds, monotonic (``time.perf_counter``; a test passes its own). Use from the
    loop's thread only.

    Raises:
        ValueError: ``window_s`` not a finite number in ``(0, LOOP_POLL_MAX_US / 1e6]``.
    """

    __slots__ = ("_loop", "window_s", "_clock", "_last_s", "_polling", "kicks", "spells", "passes")

    def __init__(self, loop: asyncio.AbstractEventLoop, window_s: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not (isinstance(window_s, (int, float)) and math.isfinite(window_s) and 0 < window_s <= LOOP_POLL_MAX_US / 1e6):
            raise ValueError(f"window_s must be in (0, {LOOP_POLL_MAX_US / 1e6:g}] seconds, got {window_s!r}")
        self._loop = loop
        #: how long the loop keeps polling after the last bytes (seconds)
        self.window_s = float(window_s)
        self._clock = clock
        self._last_s = -math.inf
        self._polling = False
        #: kicks, polling spells started, and polling passes run (for tests and benches)
        self.kicks = self.spells = self.passes = 0

    def kick(self) -> None:
        """Bytes arrived: poll until ``window_s`` from now (cost: a clock read and a compare)."""
        self._last_s = self._clock()
        self.kicks += 1
        if not self._polling:
            self._polling = True
            self.spells += 1
            self._loop.call_soon(self._poll)

    @property
    def polling(self) -> bool:
        """Whether the loop is being kept polling now."""
        return self._polling

    def _poll(self) -> None:
        self.passes += 1
        if self._clock() - self._last_s < self.window_s:
            self._loop.call_soon(self._poll)
        else:
            self._polling = False
