"""Client connections placed where the load needs them (``pdlb serve --processes N``, issue 26).

With the parent handing each accepted connection to the next router process in turn
(:mod:`balancer.service.handoff`), every process gets 1/N of the clients whatever the load. Below
N processes' worth of work each process is then partly idle, and an event loop that finds nothing
ready blocks and is woken again for nearly every event (a client's request, each engine answer):
about 100-150 us of CPU per wake-up that a busy loop, which finds several events per pass, does
not pay. On a 16-core host (docs/serving.md, the tenth run) 8 processes in front of engines that
needed 2 cost 2.1x one process's CPU per request in SGLang PD; 2 processes cost 1.0-1.15x.

``connection_placement: follow_load`` (the default) therefore keeps the load on as few processes
as it needs: the first ``k`` ("active") of them.

* **Measure.** Every supervision pass (0.2 s) the parent reads each router process's event-loop
  thread's CPU time (``/proc/PID/schedstat``, nanoseconds) and takes the CPU it used per second
  since the last pass (its utilisation, in cores); ``U`` is their sum.
* **Grow at once.** When the active processes' mean utilisation is over :data:`GROW_UTIL`, ``k``
  becomes ``ceil(U / TARGET_UTIL)``, at least ``k + 1``, at most ``N`` (``placement_target_util``
  sets another target *T*, the growth threshold then ``T + (1 - T) / 2``); when they are saturated
  (over :data:`SATURATED_UTIL`: their CPU then says nothing about the demand) it becomes ``N``,
  so that a burst gets every process within one pass and the shrink rule finds the size after.
  Each process that was active gives back the share of its connections that the new ones
  should take (``(k_new - k) / k_new`` of them).
* **Shrink slowly.** When ``ceil(U / TARGET_UTIL) < k`` on :data:`SHRINK_PASSES` passes in a row
  with at least :data:`SHRINK_MIN_CORES` of load (an idle router keeps its ``k``: idle processes
  cost about nothing, and the next burst finds them), ``k`` becomes that. No change for
  :data:`HOLD_PASSES` passes after one (the measurement must see the new placement first).
* **Place.** New connections go to the active process holding the fewest (its open ones plus
  those handed to it and not yet taken; ties to the lowest index).
* **Even out** (opt-in: ``placement_even_out``, ``pdlb serve --placement-even-out``; off, the
  placement is what it was before the rule). On a pass that changes nothing, with at least
  :data:`SHRINK_MIN_CORES` of load, when no active process still owes connections and the active
  one holding the most holds :data:`REBALANCE_GAP` or more over the one holding the fewest, it
  gives back half the difference (:func:`rebalance`); their clients reconnect and are placed on
  the fewest. An ask not met within :data:`REBALANCE_EXPIRE_PASSES` (its connections idle) is
  dropped, so that an idle process never blocks the next one. The counts
  :meth:`PlacementControl.pick` reads lag behind while a burst of connections closes and another
  opens (a client that closes its pool and opens a new one: each process counts its closes on its
  own loop pass), and keep-alive connections stay where they landed: 16 clients over 2 active
  processes came out 12 and 4, and the busier process served every one of the slowest 1% of the
  requests (``bench/pd_tail.py``, issue 26).
* **Give back.** A process gives a connection back by answering its next request with
  ``Connection: close`` and closing it after the answer (RFC 9110 §7.6.1): the client opens a new
  one, which the parent places. A process outside the first ``k`` gives back every connection;
  an active one the number the parent asked of it. Only the lean HTTP front's connections (the
  generation requests) are given back; a request is never cut or refused for it, and idle
  connections stay where they are until their next request.

Shared state: one shared-memory block of int64, written without locks (each field has one
writer; aligned stores): ``k`` (the parent), and per process its give-back target (the parent),
the connections it gave back, its open client connections and the connections it adopted since
it started (the process). ``connection_placement: round_robin`` is the old behaviour (every
process in turn, nothing given back).

Source: the wake-up costs are this project's measurements (``bench/router_processes_rate.py``);
the rule is this module's own.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from multiprocessing import shared_memory

__all__ = ["GROW_UTIL", "HOLD_PASSES", "LOG_INTERVAL_S",
           "PlacementBlock", "PlacementControl", "PlacementView", "REBALANCE_EXPIRE_PASSES", "REBALANCE_GAP",
           "SATURATED_UTIL",
           "SHRINK_MIN_CORES", "SHRINK_PASSES", "TARGET_UTIL", "next_active", "process_cpu_s", "rebalance"]

TARGET_UTIL = 0.7
"""Utilisation (cores per process) the active set is sized for by default: ``k = ceil(U / TARGET_UTIL)``
(``placement_target_util`` / ``pdlb serve --placement-target-util`` sets another, within
:data:`TARGET_UTIL_RANGE`)."""
TARGET_UTIL_RANGE = (0.3, 0.95)
"""The target utilisations taken (inclusive)."""
GROW_UTIL = 0.85
"""The active processes' mean utilisation over which ``k`` grows at once, at the default target:
half way from the target to a whole core (:func:`grow_util`)."""
SATURATED_UTIL = 0.95
"""Mean utilisation at which the active processes count as saturated (``k`` becomes ``N``)."""
SHRINK_PASSES = 3
"""Supervision passes in a row that must call for fewer processes before ``k`` shrinks."""
SHRINK_MIN_CORES = 0.1
"""Least total load (cores) at which ``k`` shrinks (an idle router keeps its processes ready)."""
HOLD_PASSES = 2
"""Passes after a change of ``k`` during which it does not change again."""
REBALANCE_GAP = 2
"""Connections the active process holding the most must hold over the one holding the fewest
before it gives some back (:func:`rebalance`): below 2 no move makes the split more even."""
REBALANCE_EXPIRE_PASSES = 25
"""Passes (5 s) after which an even-out ask not yet met is dropped (the process's connections
carried no request meanwhile: nothing to move)."""
LOG_INTERVAL_S = 60.0
"""Least seconds between two INFO lines on changes of ``k`` (review R5, session 16: a bursty load
changes it every few passes); the changes between them are logged at DEBUG and counted in the next
INFO line (all are kept in :attr:`PlacementControl.changes` and ``pdlb_router_processes_active``)."""

log = logging.getLogger("pdlb.placement")

_FIELDS = 4  # per process: give-back target, given back, open connections, adopted


def _block_bytes(processes: int) -> int:
    return 8 * (1 + _FIELDS * processes)


class PlacementBlock:
    """The shared block: created by the parent (``name=None``; ``k`` starts at ``processes``) or
    attached by a router process (its name).

    Raises:
        ValueError: ``processes`` < 1, or an attached block smaller than ``processes`` rows.
    """

    def __init__(self, processes: int, name: str | None = None) -> None:
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.processes = processes
        size = _block_bytes(processes)
        self._owner = name is None
        self.shm = shared_memory.SharedMemory(name=name, create=name is None, size=size if name is None else 0)
        if self.shm.size < size:
            self.shm.close()
            raise ValueError(f"placement block {name!r} holds {self.shm.size} bytes, less than {processes} rows")
        buf = self.shm.buf
        assert buf is not None
        self.q = buf.cast("q")
        if self._owner:
            self.q[0] = processes

    @property
    def name(self) -> str:
        return self.shm.name

    @property
    def active(self) -> int:
        """``k``: the processes that take new connections (the first ``k``)."""
        return self.q[0]

    def field(self, index: int, k: int) -> int:
        """Field ``k`` (0 target, 1 given back, 2 open, 3 adopted) of process ``index``."""
        return self.q[1 + _FIELDS * index + k]

    def set_field(self, index: int, k: int, value: int) -> None:
        self.q[1 + _FIELDS * index + k] = value

    def close(self) -> None:
        """Detach (and, the parent's block, remove it)."""
        q, self.q = self.q, memoryview(b"").cast("q")
        q.release()
        self.shm.close()
        if self._owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


class PlacementView:
    """A router process's side: what its lean front asks once per keep-alive answer
    (:meth:`give_back`) and what it tells the parent (open and adopted connections)."""

    def __init__(self, block: PlacementBlock, index: int) -> None:
        if not 0 <= index < block.processes:
            raise ValueError(f"process index {index} outside 0..{block.processes - 1}")
        self.block = block
        self.index = index
        self._base = 1 + _FIELDS * index
        q = block.q
        # a replacement starts with nothing owed: what its predecessor was asked is void
        q[self._base + 1] = q[self._base]
        q[self._base + 2] = 0
        q[self._base + 3] = 0
        self._open = 0
        #: called with "inactive" or "rebalance" for each connection given back (a metric)
        self.on_give_back: Callable[[str], None] | None = None

    def adopted(self) -> None:
        """A connection handed over by the parent arrived (what it counts as no longer in transit)."""
        self.block.q[self._base + 3] += 1

    def give_back(self) -> bool:
        """Whether the connection answered now should be closed after the answer (and the
        answer say so): always outside the active set, else while the parent's target is not met."""
        q = self.block.q
        if self.index >= q[0]:
            if self.on_give_back is not None:
                self.on_give_back("inactive")
            return True
        b = self._base
        done = q[b + 1]
        if done < q[b]:
            q[b + 1] = done + 1
            if self.on_give_back is not None:
                self.on_give_back("rebalance")
            return True
        return False

    def connection_opened(self) -> None:
        self._open += 1
        self.block.q[self._base + 2] = self._open

    def connection_closed(self) -> None:
        self._open = max(0, self._open - 1)
        self.block.q[self._base + 2] = self._open


def check_target_util(target_util: float) -> float:
    """``target_util`` if within :data:`TARGET_UTIL_RANGE`, else ValueError (a number, not NaN)."""
    lo, hi = TARGET_UTIL_RANGE
    if isinstance(target_util, bool) or not isinstance(target_util, (int, float)) or not lo <= target_util <= hi:
        raise ValueError(f"target utilisation must be a number from {lo} to {hi} (cores per process), got {target_util!r}")
    return float(target_util)


def grow_util(target_util: float) -> float:
    """The mean utilisation of the active processes over which ``k`` grows at once for
    ``target_util``: half way from it to a whole core (0.7 -> :data:`GROW_UTIL` 0.85, 0.9 -> 0.95)."""
    return target_util + (1.0 - target_util) / 2


def next_active(k: int, n: int, utils: Sequence[float], low_passes: int,
                target_util: float = TARGET_UTIL) -> tuple[int, int, str]:
    """One pass of the rule (module docstring), as a pure function: ``(k_new, low_passes_new,
    why)`` for ``k`` active of ``n`` processes whose utilisations (cores) are ``utils`` (index
    order; a dead process 0.0), after ``low_passes`` passes in a row that called for fewer;
    ``target_util`` in place of :data:`TARGET_UTIL` (and :func:`grow_util` of it in place of
    :data:`GROW_UTIL`). ``why``: ``"grow"``, ``"shrink"`` or ``""``."""
    total = sum(utils)
    want = max(1, min(n, math.ceil(total / target_util - 1e-9)))
    mean_active = sum(utils[:k]) / k
    if mean_active > grow_util(target_util) and k < n:
        grown = n if mean_active > SATURATED_UTIL else max(k + 1, want)
        return min(n, grown), 0, "grow"
    if want < k and total >= SHRINK_MIN_CORES:
        low_passes += 1
        if low_passes >= SHRINK_PASSES:
            return want, 0, "shrink"
        return k, low_passes, ""
    return k, 0, ""


def rebalance(held: Sequence[int], owed: Sequence[int]) -> tuple[int, int] | None:
    """The even-out rule (module docstring) as a pure function: ``(process, connections to give
    back)``, or None, for the active processes holding ``held`` connections each (open plus in
    transit) and owing ``owed`` give-backs each (asked and not yet done). None while any of them
    owes one (the last move is not over) or when the most minus the fewest is under
    :data:`REBALANCE_GAP`; else the one holding the most (lowest index on ties) gives back half
    the difference, rounded down."""
    if len(held) < 2 or any(o > 0 for o in owed):
        return None
    hi = max(range(len(held)), key=lambda i: (held[i], -i))
    gap = held[hi] - min(held)
    if gap < REBALANCE_GAP:
        return None
    return hi, gap // 2


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds of process ``pid``'s main thread (the event loop's): the first field of
    ``/proc/PID/schedstat`` (nanoseconds on a CPU); where that file is missing, user + system
    CPU seconds of the whole process (``/proc/PID/stat``, 10 ms ticks). None if unreadable. Time
    spent waiting for a CPU does not count: on a host whose CPUs are all busy, more router
    processes would not get more of them."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (IndexError, ValueError):
        return None


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class PlacementControl:
    """The parent's side: :meth:`tick` each supervision pass with the processes' CPU clocks;
    :meth:`pick` for each accepted connection (from the acceptor's thread); :meth:`handed`,
    :meth:`reset` (a process replaced)."""

    def __init__(self, block: PlacementBlock, target_util: float = TARGET_UTIL, even_out: bool = False) -> None:
        """``target_util``: cores per active process the set is sized for (:func:`next_active`;
        ValueError outside :data:`TARGET_UTIL_RANGE`); ``even_out``: apply the even-out rule
        (:func:`rebalance`; off by default)."""
        self.block = block
        self.target_util = check_target_util(target_util)
        self.even_out = even_out
        n = block.processes
        self.sent = [0] * n  # connections handed to each process since it started
        self._last: list[tuple[float, float] | None] = [None] * n  # (time, cpu) at the last pass
        self._low = 0
        self._hold = 0
        self.changes: list[tuple[float, int, int, str]] = []  # (time, k before, k after, why): the last 64
        self._info_s: float | None = None  # when the last INFO line on a change was logged
        self._quiet = 0  # changes logged at DEBUG since then
        self.rebalanced = 0  # connections asked back to even out the active processes (:func:`rebalance`)
        self._ask: tuple[int, int, int] | None = None  # the last even-out ask: (process, its target, passes since)

    def pick(self, dead: set[int] | frozenset[int] = frozenset()) -> int | None:
        """The process for a new connection: the active one holding the fewest (open + in
        transit), lowest index on ties; a live inactive one if every active one is dead; None if
        all are dead."""
        b = self.block
        n = b.processes
        k = max(1, min(n, b.active))
        best, best_load = None, 0
        for candidates in (range(k), range(k, n)):
            for i in candidates:
                if i in dead:
                    continue
                load = self.held(i)
                if best is None or load < best_load:
                    best, best_load = i, load
            if best is not None:
                return best
        return None

    def held(self, i: int) -> int:
        """Client connections process ``i`` holds: its open ones plus those handed to it and not yet taken."""
        b = self.block
        return b.field(i, 2) + max(0, self.sent[i] - b.field(i, 3))

    def _even_out(self, k: int, load_cores: float) -> None:
        """The even-out rule (module docstring) on a pass that left ``k`` as it was."""
        b = self.block
        if self._ask is not None:
            i, target, passes = self._ask
            if b.field(i, 1) >= target or b.field(i, 0) != target:  # met, or a grow's ask replaced it
                self._ask = None
            elif passes + 1 >= REBALANCE_EXPIRE_PASSES:  # its connections idle: drop the rest (ask anew next pass)
                b.set_field(i, 0, b.field(i, 1))
                self._ask = None
                return
            else:
                self._ask = (i, target, passes + 1)
                return
        if load_cores < SHRINK_MIN_CORES:
            return
        move = rebalance([self.held(i) for i in range(k)], [b.field(i, 0) - b.field(i, 1) for i in range(k)])
        if move is not None:
            i, give = move
            target = b.field(i, 1) + give
            b.set_field(i, 0, target)
            self.rebalanced += give
            self._ask = (i, target, 0)

    def handed(self, i: int) -> None:
        self.sent[i] += 1

    def reset(self, i: int) -> None:
        """Process ``i`` was replaced: nothing handed to the new one yet, its CPU clock new."""
        self.sent[i] = 0
        self._last[i] = None

    def tick(self, now_s: float, cpu_s: Sequence[float | None]) -> int:
        """One supervision pass at ``now_s`` (monotonic seconds) with each process's CPU seconds
        (None: dead or unreadable); returns ``k`` after it."""
        b = self.block
        n = b.processes
        utils = [0.0] * n
        for i, c in enumerate(cpu_s):
            last = self._last[i]
            self._last[i] = None if c is None else (now_s, c)
            if c is None or last is None or now_s <= last[0]:
                continue
            utils[i] = max(0.0, (c - last[1]) / (now_s - last[0]))
        k = max(1, min(n, b.active))
        if self._hold > 0:
            self._hold -= 1
            return k
        k_new, self._low, why = next_active(k, n, utils, self._low, self.target_util)
        if k_new == k and self.even_out:
            self._even_out(k, sum(utils))
        if k_new != k:
            if k_new > k:  # the active ones give back the new ones' share of their connections
                for i in range(k):
                    give = (b.field(i, 2) * (k_new - k)) // k_new
                    if give > 0:
                        b.set_field(i, 0, max(b.field(i, 0), b.field(i, 1)) + give)
            else:  # those left out give back everything from now on: no target left for later
                for i in range(k_new, k):
                    b.set_field(i, 0, b.field(i, 1))
            b.q[0] = k_new
            self._hold = HOLD_PASSES
            self.changes = [*self.changes[-63:], (now_s, k, k_new, why)]
            loads = ", ".join(f"{u:.2f}" for u in utils)
            if self._info_s is None or now_s - self._info_s >= LOG_INTERVAL_S:
                log.info("connection placement: %d -> %d active router processes (%s; load %.2f cores: %s)%s", k,
                         k_new, why, sum(utils), loads,
                         f"; {self._quiet} more changes since the last such line (DEBUG)" if self._quiet else "")
                self._info_s, self._quiet = now_s, 0
            else:
                self._quiet += 1
                log.debug("connection placement: %d -> %d active router processes (%s; load %.2f cores: %s)", k,
                          k_new, why, sum(utils), loads)
        return k_new
