"""Approximate prefix views shared by the processes of one ``pdlb serve --processes N``.

In approximate mode a router only knows the prompts it routed; N processes behind one port
would keep N partial views (the simulator measures the cost: ``pdlb dev k-routers``,
prefix hit rate 33.0% with one router, 10.6% with 8 independent ones). Here every process
appends each decision (the chosen replicas and the prompt's block hashes, msgpack) to its own
ring buffer, a memory-mapped file in a private directory the parent creates (on ``/dev/shm``
where there is one), and reads the others' rings, recording their decisions with
:meth:`balancer.router.Router.record_routed`. Nothing is sent and nobody is woken: a process
reads the others' new decisions once per event-loop pass in which it routed (right after that
pass's decisions) and every :data:`DRAIN_INTERVAL_S` otherwise, all in the event loop's thread; while
the rings stay quiet that timer backs off, doubling up to :data:`DRAIN_IDLE_INTERVAL_S` (an idle
``pdlb serve`` is not woken 50 times a second per process for rings nobody writes; the first
read that finds a decision brings it back to :data:`DRAIN_INTERVAL_S`).
This replaced one ZMQ PUB socket per process with batches every 5 ms, whose I/O threads and
receiver wake-ups cost each of N processes N - 1 wake-ups per interval (with one message per
decision, 2 processes at 800 requests/s spent 140-240 us more CPU per request than with nothing
shared; one process's whole cost was 350-370 us).

Ring layout: bytes 0-7 the total bytes ever written (``head``, only grows; native byte order,
stored and loaded as one aligned 8-byte word through a ``memoryview`` cast, never byte by byte,
the writer's store made after the record's bytes), bytes 8-15 the data capacity ``C``
(little-endian), bytes 16-39 three ``marks`` (same kind of words: record starts the writer
takes as checkpoints whenever ``head`` has moved ``C / 4`` past the newest, shifting the oldest
out, each store made before that record's bytes; the oldest mark is then ``C / 2`` to about
``3C / 4`` behind ``head``), then ``C`` data bytes; a record is a 4-byte length ``n``, the decision's time
(``now_s``, 8-byte little-endian double) and ``n - 8`` bytes of msgpack
(``[[[engine, dp_rank], ...], [block_hash, ...]]``), written at ``head mod C`` and wrapping
around. A reader keeps its own position in each ring; it copies the bytes between its position
and ``head``, then reads ``head`` again: when the writer has meanwhile lapped the copied span
(more than ``C`` bytes ahead), or had already, the span is dropped (counted in ``lost_bytes``) and
the reader resumes at the new head. This relies on the writer's two stores (record, then head)
becoming visible in that order, as on x86-64; a record read torn elsewhere fails its length or
msgpack check and is skipped.

Applying a decision is an index insert (about 5 us; decoding it about 1.3 us), and with N
processes every decision is applied N - 1 times, so a drain folds repeats: the decisions read
in one drain (from all the rings) that name the same replicas and blocks are applied once, at
their latest time and in the order of their last occurrence, which leaves the index as applying
each in turn would (an insert only touches its path's blocks: the last touch of every block,
and the order of last touches, are the same; tests/service/test_shared_prefix.py checks it against
one-by-one application). A hot prompt routed by every process costs each of them one insert
per drain instead of one per decision. Decoded decisions are kept (up to
:data:`DECODED_CACHE_ENTRIES`) so that a repeated one is not decoded again.

Joining late: a reader that opens a ring reads it from its start, or, once the ring has wrapped
(``head > C``, so its start is overwritten and record boundaries are unknown), from its oldest
mark still within the ring: the last half ring or more of that process's decisions (records
over ``C / 4`` spread the marks wider; then a newer mark, at worst only the newest records). A replacement process (``pdlb serve``
restarts a dead one with the same index) first records its predecessor's decisions from its own
ring the same way (:attr:`PrefixShare.recovered`), then goes on writing where the predecessor
stopped, so the view it routes with is the dead process's as well as the others'.

Retractions (review finding R10): when an engine refuses a request with a 4xx, the routing process
forgets the prompt's new blocks on the replicas that will not hold them
(:meth:`balancer.router.Router.on_rejected`) and, through :meth:`PrefixShare.retract` (a
:class:`balancer.parts.RejectListener`), appends a retraction to its ring: a record of the same
layout whose msgpack is ``[decision, [[engine, dp_rank, kept_blocks], ...]]`` (``decision`` the
decision record's own msgpack bytes, the time field the decision's). A reader keeps, for the last
:data:`APPLIED_ENTRIES` decisions it applied, the time its router recorded them at
(:meth:`balancer.router.Router.record_routed` returns it: a peer's earlier time is raised to the
reader's latest) and how many identical decisions that one application stood for; a retraction
of a decision it applied alone drops, on each named replica, the blocks after ``kept_blocks`` that
nothing touched since (:meth:`balancer.router.Router.forget_recorded`, the same rule as the
routing process's own). A decision folded with an identical one (another request with the same
prompt to the same replicas, accepted) keeps its blocks, as does one no longer remembered; a
retraction read in the same drain as its decision cancels it (neither is applied). Not told
apart: blocks the reader held before it applied the refused decision beyond the routing process's
``kept_blocks`` (its own accepted request of the same prompt there, say) are dropped with it,
a missed prefix hit later rather than a hit on blocks nobody cached; and an own decision this
process recorded later at an earlier time (clamped to the same time) is taken for the peer's.

Delivery is best effort: an approximate index is a guess anyway; a lost decision costs a missed
prefix hit, never a wrong route.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import struct
from collections.abc import Callable, Collection

import msgpack

from balancer.types import ReplicaId

__all__ = ["APPLIED_ENTRIES", "DRAIN_IDLE_INTERVAL_S", "DRAIN_INTERVAL_S", "RING_BYTES", "PrefixShare", "ring_path"]

log = logging.getLogger("pdlb.shared_prefix")

RING_BYTES = 16 * 1024 * 1024
"""Data capacity of one process's ring: about 500,000 one-block decisions, 900 of a 128k-token
prompt at 64-token blocks (only the pages written are ever allocated)."""
DRAIN_INTERVAL_S = 0.02
"""Longest a process that is not routing leaves the others' new decisions unread while they come."""
DRAIN_IDLE_INTERVAL_S = 0.32
"""Longest it leaves them unread after the rings were quiet (the timer doubles from
:data:`DRAIN_INTERVAL_S` after each read that found nothing; issue 26: each wake-up of an idle
router process costs ~75-150 us of CPU, and 50 a second per process were the largest part of an
idle ``pdlb serve --processes N``'s CPU with the default policies)."""
_HEADER = 40
_U64 = struct.Struct("<Q")
_REC = struct.Struct("<Id")  # record length (time + msgpack), decision time
_BIN = frozenset((0xC4, 0xC5, 0xC6))  # msgpack bin headers: a retraction's first element (a decision's is an array)
DECODED_CACHE_ENTRIES = 4096
"""Decoded decisions a reader keeps, by their msgpack bytes (cleared when full)."""
APPLIED_ENTRIES = 8192
"""Decisions a reader remembers applying (their recorded time and fold count), for retractions;
the oldest is forgotten first."""

Record = Callable[[Collection[ReplicaId], tuple[int, ...], float], "float | None"]
Forget = Callable[[ReplicaId, tuple[int, ...], float], int]


def ring_path(directory: str, index: int) -> str:
    """The file process ``index`` writes its decisions to."""
    return os.path.join(directory, f"prefix-{index}.ring")


def _open_ring(path: str, create: bool, capacity: int) -> mmap.mmap | None:
    """Map a ring file (creating it with ``capacity`` data bytes), or None if it is not there yet
    or not a ring."""
    try:
        fd = os.open(path, (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY, 0o600)
    except FileNotFoundError:
        return None
    try:
        if create:
            os.ftruncate(fd, _HEADER + capacity)  # sparse zeros: head 0, mark 0
            mm = mmap.mmap(fd, _HEADER + capacity)
            mm[8:16] = _U64.pack(capacity)
            return mm
        size = os.fstat(fd).st_size
        if size <= _HEADER:
            return None
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        if _U64.unpack_from(mm, 8)[0] != size - _HEADER:
            mm.close()
            return None  # being created: capacity not written yet
        return mm
    finally:
        os.close(fd)


class _Reader:
    """This process's position in another process's ring."""

    __slots__ = ("path", "mm", "head", "pos", "cap")

    def __init__(self, path: str) -> None:
        self.path = path
        self.mm: mmap.mmap | None = None
        self.head: memoryview | None = None  # the ring's head, capacity and mark words
        self.pos = 0
        self.cap = 0

    def open(self) -> bool:
        """Map the ring if it is there (False if not yet) and start at its oldest readable
        record: the start while it has not wrapped, else its mark (see the module docstring)."""
        mm = _open_ring(self.path, False, 0)
        if mm is None:
            return False
        self.mm, self.cap = mm, len(mm) - _HEADER
        self.head = memoryview(mm)[0:_HEADER].cast("Q")
        words = self.head
        head = words[0]
        if head <= self.cap:
            self.pos = 0
        else:  # the oldest mark still within the ring (records over C / 4 spread them wider)
            self.pos = next((m for m in (words[2], words[3], words[4]) if head - m <= self.cap), head)
        return True

    def close(self) -> None:
        if self.mm is not None:
            assert self.head is not None
            self.head.release()
            self.mm.close()
            self.mm = self.head = None


class PrefixShare:
    """One process's side (see the module docstring): give :meth:`publish` to the router as a
    route listener (``Router.from_config(config, listeners=[share.publish])``), then
    ``start(router.record_routed)`` in the event loop, ``close()`` at exit.

    Args:
        directory: the directory of the processes' rings (shared by all of them).
        record: records another process's decision as ``record(replicas, block_hashes, now_s)``
            (``Router.record_routed`` of this process's router), returning the time it recorded at
            (``None``: ``now_s``); ``None``: given to :meth:`start` (a drain before records nothing).
        forget: applies another process's retraction as ``forget(replica, block_hashes,
            recorded_s)`` (``Router.forget_recorded``); ``None``: given to :meth:`start`, or
            retractions are skipped.
        processes: number of router processes.
        index: this process's number.
        ring_bytes: data capacity of this process's ring.
    """

    def __init__(self, directory: str, processes: int, index: int, ring_bytes: int = RING_BYTES,
                 record: Record | None = None, forget: Forget | None = None) -> None:
        if not 0 <= index < processes:
            raise ValueError(f"process index {index} outside 0..{processes - 1}")
        self._record = record
        self._forget = forget
        self.index = index
        self._cap = ring_bytes
        mm = _open_ring(ring_path(directory, index), True, ring_bytes)
        assert mm is not None
        self._mm = mm
        self._head_word = memoryview(mm)[0:_HEADER].cast("Q")  # head, capacity, 3 marks
        self._head = self._head_word[0]  # a replacement process continues its predecessor's ring
        self._newest_mark = self._head_word[4]
        self._readers = [_Reader(ring_path(directory, k)) for k in range(processes) if k != index]
        # a replacement first reads what its predecessor wrote (see the module docstring)
        self._own: _Reader | None = _Reader(ring_path(directory, index)) if self._head else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_soon = False
        self._timer: asyncio.TimerHandle | None = None
        self._interval = DRAIN_INTERVAL_S  # the timer's current period (backs off while quiet)
        self._read_since_tick = False  # a drain since the last tick found decisions
        self.ticks = 0  # timer reads (for tests and the curious)
        self._closed = False
        self.sent = 0  # decisions written
        self.received = 0  # records read (decisions recorded, retractions applied)
        self.folded = 0  # of those, applied as one with a later identical decision of the same drain
        self._decoded: dict[bytes, tuple[list[ReplicaId], tuple[int, ...]]] = {}
        # decision msgpack -> [recorded time, decisions it stood for] (oldest first; for retractions)
        self._applied: dict[bytes, list] = {}
        self.retracted = 0  # retractions written
        self.forgotten = 0  # blocks dropped here on the others' retractions
        self.dropped = 0  # decisions not written (larger than the ring)
        self.lost_bytes = 0  # ring bytes a slow reader skipped (overwritten before it read them)
        self.recovered = 0  # decisions of this process's predecessor read back from its ring at start

    def publish(self, replicas: Collection[ReplicaId], block_hashes: tuple[int, ...], now_s: float) -> None:
        """Append one decision to this process's ring (never blocks), and have the others' new
        decisions read once this event-loop pass ends (a :class:`balancer.parts.RouteListener`;
        nothing after :meth:`close`)."""
        if self._closed:
            return
        if self._append(msgpack.packb([[[r.engine, r.dp_rank] for r in replicas], block_hashes]), now_s):
            self.sent += 1

    def retract(self, replicas: Collection[ReplicaId], block_hashes: tuple[int, ...], routed_at_s: float,
                forgotten: tuple[tuple[ReplicaId, int], ...]) -> None:
        """Append a retraction of the decision ``(replicas, block_hashes, routed_at_s)`` that this
        process published: an engine refused it, and each ``(replica, kept_blocks)`` of
        ``forgotten`` forgets the blocks after its first ``kept_blocks`` (a
        :class:`balancer.parts.RejectListener`; see the module docstring)."""
        if self._closed or not forgotten:
            return
        decision = msgpack.packb([[[r.engine, r.dp_rank] for r in replicas], block_hashes])
        if self._append(msgpack.packb([decision, [[r.engine, r.dp_rank, int(k)] for r, k in forgotten]]), routed_at_s):
            self.retracted += 1

    def _append(self, rec: bytes, now_s: float) -> bool:
        """Write one record; False if it is larger than the ring (counted in ``dropped``)."""
        n = _REC.size + len(rec)
        if n > self._cap:
            self.dropped += 1
            return False
        head = self._head
        if head - self._newest_mark >= self._cap >> 2:  # this record's start becomes a mark
            words = self._head_word
            words[2] = words[3]  # oldest first: a reader sees each mark move forward only
            words[3] = words[4]
            words[4] = self._newest_mark = head
        self._write(head % self._cap, _REC.pack(8 + len(rec), now_s) + rec)
        head += n
        self._head_word[0] = head  # after the record: a reader never sees a head past unwritten bytes
        self._head = head
        if self._loop is not None and not self._drain_soon:
            self._drain_soon = True
            self._loop.call_soon(self.drain)
        return True

    def _write(self, at: int, data: bytes) -> None:
        mm, cap = self._mm, self._cap
        first = min(len(data), cap - at)
        mm[_HEADER + at:_HEADER + at + first] = data[:first]
        if first < len(data):
            mm[_HEADER:_HEADER + len(data) - first] = data[first:]

    def drain(self) -> int:
        """Record the other processes' decisions written since the last drain (repeats folded,
        see the module docstring); returns how many were read."""
        self._drain_soon = False
        if self._closed or self._record is None:
            return 0
        pending: dict[bytes, list] = {}  # msgpack -> [latest time, count], in the order of last occurrence
        got = 0
        for rd in self._readers:
            if rd.mm is None and not rd.open():
                continue
            got += self._drain_one(rd, pending)
        if pending:
            self._apply(pending)
        if got:
            self._read_since_tick = True
        self.received += got
        self.folded += got - len(pending)
        return got

    def _drain_one(self, rd: _Reader, pending: dict[bytes, list]) -> int:
        mm, cap, word = rd.mm, rd.cap, rd.head
        assert mm is not None and word is not None
        head = word[0]
        if head == rd.pos:
            return 0
        if head < rd.pos or head - rd.pos > cap:  # lapped (or a new ring): resume at its head
            self.lost_bytes += head - rd.pos if head > rd.pos else 0
            rd.pos = head
            return 0
        a, b = rd.pos % cap, head % cap
        data = mm[_HEADER + a:_HEADER + b] if a < b else mm[_HEADER + a:_HEADER + cap] + mm[_HEADER:_HEADER + b]
        now_head = word[0]
        if now_head - rd.pos > cap:  # the writer overwrote part of the span while it was copied
            self.lost_bytes += now_head - rd.pos
            rd.pos = now_head
            return 0
        rd.pos = head
        got, off, end = 0, 0, len(data)
        unpack = _REC.unpack_from
        while off + _REC.size <= end:
            n, now_s = unpack(data, off)
            if n < 8 or off + 4 + n > end:
                log.warning("shared prefix ring %s: record of %d bytes past the written end; rest skipped", rd.path, n)
                break
            key = data[off + _REC.size:off + 4 + n]
            got += 1
            off += 4 + n
            if len(key) > 1 and key[1] in _BIN and self._cancels(key, pending):
                continue
            last = pending.pop(key, None)  # re-inserted: ordered by its last occurrence
            pending[key] = [now_s, 1] if last is None else [now_s if now_s > last[0] else last[0], last[1] + 1]
        return got

    @staticmethod
    def _cancels(retraction: bytes, pending: dict[bytes, list]) -> bool:
        """A retraction whose decision is still waiting in this drain: the two cancel (the decision
        then stands for one request fewer, and is not applied if it stood for that one alone)."""
        try:
            decision = msgpack.unpackb(retraction)[0]
            waiting = pending.get(decision)
        except Exception:  # noqa: BLE001 - a bad record: applied (and skipped) as any other
            return False
        if waiting is None:
            return False
        if waiting[1] > 1:
            waiting[1] -= 1
        else:
            del pending[decision]
        return True

    def _apply(self, pending: dict[bytes, list]) -> None:
        record, decoded, applied = self._record, self._decoded, self._applied
        assert record is not None
        for key, (now_s, count) in pending.items():
            try:
                d = decoded.get(key)
                if d is None:
                    item = msgpack.unpackb(key)
                    if isinstance(item[0], bytes):  # a retraction: [decision, forgotten]
                        self._retract(item[0], item[1])
                        continue
                    reps, hashes = item
                    d = ([ReplicaId(e, int(r)) for e, r in reps], tuple(hashes))
                    if len(decoded) >= DECODED_CACHE_ENTRIES:
                        decoded.clear()
                    decoded[key] = d
                at = record(d[0], d[1], now_s)
                entry = applied.pop(key, None)
                applied[key] = [now_s if at is None else at, count]
                if entry is None and len(applied) > APPLIED_ENTRIES:
                    del applied[next(iter(applied))]  # the oldest
            except Exception as e:  # noqa: BLE001 - a bad record is skipped, the reader lives on
                log.warning("shared prefix decision skipped: %s", e)

    def _retract(self, decision: bytes, forgotten: list) -> None:
        """Apply another process's retraction of ``decision`` (module docstring)."""
        entry = self._applied.pop(decision, None)
        if entry is None or self._forget is None:
            return
        at, count = entry
        if count > 1:  # it stood for identical decisions too, accepted ones among them
            self._applied[decision] = [at, count - 1]
            return
        hashes = tuple(msgpack.unpackb(decision)[1])
        for e, r, kept in forgotten:
            self.forgotten += self._forget(ReplicaId(e, int(r)), hashes[int(kept):], at)

    def start(self, record: Record | None = None, forget: Forget | None = None) -> None:
        """Begin reading the others' rings (every :data:`DRAIN_INTERVAL_S`, backing off to
        :data:`DRAIN_IDLE_INTERVAL_S` while they are quiet, and after each routing pass), recording their decisions with ``record`` (``Router.record_routed`` of this
        process's router) and applying their retractions with ``forget``
        (``Router.forget_recorded``); ``None``: the ones given at construction."""
        if record is not None:
            self._record = record
        if forget is not None:
            self._forget = forget
        self._loop = asyncio.get_running_loop()
        if self._own is not None:  # the predecessor's decisions, before anything new is routed
            rd, self._own = self._own, None
            if rd.open():
                pending: dict[bytes, list] = {}
                self.recovered = self._drain_one(rd, pending)
                self._apply(pending)
                rd.close()
        self._tick()

    def _tick(self) -> None:
        self.drain()
        assert self._loop is not None
        self.ticks += 1
        if self._read_since_tick:
            self._interval = DRAIN_INTERVAL_S
        else:
            self._interval = min(self._interval * 2, DRAIN_IDLE_INTERVAL_S)
        self._read_since_tick = False
        self._timer = self._loop.call_later(self._interval, self._tick)

    async def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._loop = None
        for rd in self._readers:
            rd.close()
        self._head_word.release()
        self._mm.close()
