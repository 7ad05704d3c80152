"""Request deadlines without a timer each (issue 26: CPU per request of the service path).

``asyncio.timeout`` / ``asyncio.timeout_at`` put one ``TimerHandle`` per use into the event
loop's timer heap (a ``Timeout`` object, a heap push, a cancel and later a heap clean-up); the
proxy used two per request (the request's ``request_timeout_s`` and its decode leg's first-byte
deadline), about 9% of one router process's CPU per request in the running service
(``bench/proxy_floor.py --ablate timeouts``, 2-core development host).

Most of those deadlines are *first in, first out*: every request's ``request_timeout_s`` is the
same length, started when the request is, so a request registered later never expires earlier.
A :class:`DeadlineQueue` keeps such deadlines in insertion order (a dict: one insert and one
delete per use) with a single timer, set for the oldest one; when it runs it cancels every task
whose deadline has passed and sets itself for the next. The semantics are ``asyncio.timeout_at``'s
(:meth:`DeadlineQueue.at` is a drop-in for it):

* the task running the ``async with`` body is cancelled at the deadline, and the block's exit
  turns that cancellation into :class:`TimeoutError` (raised from the ``CancelledError``), unless
  the task was cancelled by someone else as well (``Task.uncancel()`` count above the one at
  entry: then the ``CancelledError`` propagates, as with ``asyncio.timeout``);
* a deadline already passed at entry cancels at the next event-loop pass;
* blocks nest (an inner ``asyncio.timeout_at`` or another queue's block).

A deadline earlier than the newest one in the queue (out of order: another length, or an
absolute deadline reused later) is not queued: its block sets a timer of its own, as
``asyncio.timeout_at`` would, so every deadline fires on time whatever its order.

Timing: the one timer is an ordinary ``loop.call_at`` at the oldest deadline, so a block expires
when an ``asyncio.timeout_at`` block with the same deadline would (the loop runs timers up to
its clock resolution early; the queue treats everything up to the fired timer's time as due).
"""

from __future__ import annotations

import asyncio
from types import TracebackType

__all__ = ["DeadlineQueue", "QueuedDeadline"]


class QueuedDeadline:
    """One ``async with`` block of a :class:`DeadlineQueue` (use once)."""

    __slots__ = ("_queue", "when", "_task", "_cancelling", "expired", "_own")

    def __init__(self, queue: DeadlineQueue, when: float) -> None:
        self._queue = queue
        #: the deadline, event-loop time (seconds)
        self.when = when
        self._task: asyncio.Task | None = None
        self._cancelling = 0
        #: the deadline passed while the block ran (the queue cancelled the task)
        self.expired = False
        self._own: asyncio.TimerHandle | None = None  # a timer of its own (entered out of order)

    async def __aenter__(self) -> QueuedDeadline:
        # the queue's loop given: asyncio.current_task() would look the running loop up again
        # (on Python 3.11 a getpid() system call per lookup)
        queue = self._queue
        task = asyncio.current_task(queue._loop or queue._running_loop())
        if task is None:
            raise RuntimeError("a deadline must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._queue._push(self)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._own is not None:
            self._own.cancel()
            self._own = None
        self._queue._entries.pop(self, None)
        if self.expired:
            assert self._task is not None
            # as asyncio.Timeout: ours was the only cancellation asked for since entry -> TimeoutError
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc
        return None


class DeadlineQueue:
    """Deadlines in non-decreasing order on one event loop, one timer for all (module docstring).

    ``async with queue.at(when):`` is ``async with asyncio.timeout_at(when):`` (``when``: event-loop
    time, seconds); ``async with queue.after(delay_s):`` is ``asyncio.timeout(delay_s)``. Use the
    queue from one event loop (the first one that uses it).
    """

    __slots__ = ("_entries", "_loop", "_handle", "_armed_s", "queued", "fallbacks")

    def __init__(self) -> None:
        #: the blocks waiting, oldest deadline first (insertion order: deadlines never decrease)
        self._entries: dict[QueuedDeadline, None] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._armed_s = float("-inf")  # the deadline the timer is set for
        #: blocks entered in order (queued) / out of order (a timer of their own), for tests and benches
        self.queued = 0
        self.fallbacks = 0

    def __len__(self) -> int:
        return len(self._entries)

    def at(self, when: float) -> QueuedDeadline:
        """An async context manager that is ``asyncio.timeout_at(when)`` (module docstring)."""
        return QueuedDeadline(self, when)

    def after(self, delay_s: float) -> QueuedDeadline:
        """``asyncio.timeout(delay_s)``: :meth:`at` ``delay_s`` seconds from now (event-loop time)."""
        return self.at((self._loop or self._running_loop()).time() + delay_s)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def _push(self, entry: QueuedDeadline) -> None:
        entries = self._entries
        if entries and entry.when < next(reversed(entries)).when:
            # out of order since at() (another block entered in between): a timer of its own
            self.fallbacks += 1
            entry._own = self._running_loop().call_at(entry.when, self._expire, entry)
            return
        entries[entry] = None
        self.queued += 1
        if self._handle is None or entry.when < self._armed_s:
            self._arm(entry.when)

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed_s = when
        self._handle = (self._loop or self._running_loop()).call_at(when, self._fire)

    @staticmethod
    def _expire(entry: QueuedDeadline) -> None:
        entry._own = None
        entry.expired = True
        assert entry._task is not None
        entry._task.cancel()

    def _fire(self) -> None:
        self._handle = None
        due = max(self._armed_s, self._running_loop().time())
        entries = self._entries
        while entries:
            entry = next(iter(entries))
            if entry.when > due:
                self._arm(entry.when)
                return
            del entries[entry]
            self._expire(entry)
