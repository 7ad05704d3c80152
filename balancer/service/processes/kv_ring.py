"""The ring buffer that carries translated KV events from the one subscriber of a
``pdlb serve --processes N`` to every router process (:mod:`balancer.service.processes.kv_fanout`), in a
memory-mapped file: its record format, :class:`RingWriter` (the subscriber child) and
:class:`RingReader` (each router process). Imports nothing of the service above it, so the
subscriber (:mod:`balancer.service.kv_subscriber`) and the fan-out both build on it.

**Ring** (:class:`RingWriter`, :class:`RingReader`): bytes 0-7 the total bytes ever written
(``head``, only grows; native byte order, stored and loaded as one aligned 8-byte word), 8-15 the
data capacity ``C``, 16-23 the magic ``b"PDLBKVF1"``, 24-31 the next record's sequence number (for a
writer that takes the ring over), 32-63 zero; then ``C`` data bytes. Records follow each other
from ``head mod C``, wrapping byte-wise at the end. A record (all little-endian):

====================  ==================================================================
``u32 L``             body length (bytes)
``u64 check``         ``XXH3_64(body)``
body: ``u64 seq``     record number (consecutive from 0 over the ring's life)
``u8 kind``           1 ``BlockStored``, 2 ``BlockRemoved``, 3 ``AllBlocksCleared``
``u8 flags``          bit 0: a parent hash follows; bit 1: a medium follows; bit 2: a target follows
``u32 dp_rank``       the replica's DP rank
``u16 E`` + E bytes   the replica's engine (worker URL, UTF-8)
``u16 target``        only with flag bit 2: the one router process the record is for (a resync
                      snapshot, see below); every other reader skips it
``u8 M`` + M bytes    the medium (UTF-8), only with flag bit 1
``u64 parent``        ``BlockStored``'s ``parent_block_hash``, only with flag bit 0
``u32 n`` + n u64     the pdlb block hashes (none for ``AllBlocksCleared``)
====================  ==================================================================

The writer copies a round's records in, then stores the new head (one aligned word, after the
bytes: on x86-64 other processes see the stores in that order). A reader copies the bytes between
its position and the head, then reads the head again; so a process never applies a half-written
record:

* bytes past the head are never read (the head moves only after whole records);
* a reader the writer lapped (more than ``C`` bytes behind, or overtaken while it copied) drops
  the span and resumes at the new head, a record boundary: the records it missed are counted
  (``lost_records``, from the sequence numbers) and logged, and it asks for a resync (below);
* every record's checksum is verified before it is applied; one that does not match (its bytes
  not yet visible on a weakly ordered CPU) is retried on the next polls and skipped after
  :data:`TORN_RETRIES` (``corrupt_records``).

Memory is bounded: one ring of :data:`RING_BYTES` per ``pdlb serve`` (only pages written are
allocated); a follower copies at most :data:`READ_BYTES_PER_PASS` per pass (it comes back at once
when more is waiting); a pdlb event larger than :data:`MAX_RECORD_BYTES` is split into several
records (a ``BlockStored``'s later parts name the previous part's last block as their parent), so
nothing is too large to fan out. The writer never waits for readers.

**Resync.** The writer keeps a mirror of what a reader that missed nothing holds (:class:`ViewMirror`:
each replica's stored blocks and their parents, per tier, at most ``C / 64`` blocks). A lapped
reader writes its process index's slot of the request file (:func:`fanout_resync_path`, one
64-bit counter per process, each written by its own process only); the writer, after its next
write or within ``kv_subscriber.RESYNC_POLL_S`` while no events come,
writes a snapshot of the mirror as records for that reader alone (flag bit 2 and its index;
every other reader skips them): ``AllBlocksCleared`` of each replica's HBM and host views, then
its blocks as ``BlockStored`` runs, each block after its parent. In ring order the snapshot
turns whatever the reader held into the writer's view at that point, and the records after it
follow, so once it has read the snapshot the reader's index is what a reader that missed
nothing holds (blocks the mirror's bound evicted excepted: counted by the writer as ``evicted``);
between its lap and the snapshot it routes on a stale view. Counted per reader as ``resyncs``
and ``snapshot_records``. Cost, in the subscriber child (2-core host): keeping the mirror adds
about 0.11 ms to writing a translated 32k-token event (512 router blocks; 0.02 ms without it,
against 2-3 ms to decode and translate it); at its bound for the default ring (524,288 blocks)
it holds about 46 MB, and a snapshot of it takes about 0.2 s to build.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
from collections.abc import Sequence

import xxhash

from balancer.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, tier_of_medium
from balancer.types import ReplicaId

__all__ = ["HEADER_BYTES", "MAX_RECORD_BYTES", "RING_BYTES", "TORN_RETRIES", "RingReader", "RingWriter",
           "ViewMirror", "encode_record", "fanout_ring_path"]

log = logging.getLogger("pdlb.kv_events")

RING_BYTES = 32 * 1024 * 1024
"""Data capacity of the ring: about 7,000 translated 32k-token ``BlockStored`` at 64-token router
blocks (4.2 KB each) of slack for a follower that falls behind."""
MAX_RECORD_BYTES = 1 << 20
"""Largest record body; larger pdlb events are split (about 131,000 block hashes per record)."""
READ_BYTES_PER_PASS = 4 << 20
"""Most ring bytes one follower pass copies and applies before yielding to requests."""
WRITER_LOCK_TIMEOUT_S = 20.0
"""Seconds a new writer waits for the previous one to let go of the ring (a dead router process
0's subscriber child exits within about a second of noticing its parent gone)."""
TORN_RETRIES = 3
"""Polls a record whose checksum fails is retried on before it is skipped."""

MAGIC = b"PDLBKVF1"
HEADER_BYTES = 64
_REC_HEAD = struct.Struct("<IQ")  # body length, XXH3_64(body)
_BODY_FIXED = struct.Struct("<QBBIH")  # seq, kind, flags, dp_rank, engine length
_U8, _U32, _U64 = struct.Struct("<B"), struct.Struct("<I"), struct.Struct("<Q")
KIND_STORED, KIND_REMOVED, KIND_CLEARED = 1, 2, 3
_FLAG_PARENT, _FLAG_MEDIUM, _FLAG_TARGET = 1, 2, 4
_U16 = struct.Struct("<H")
RESYNC_SLOTS = 256
"""Router processes the resync request file has a slot for (``processes`` is at most 256)."""
_xxh3 = xxhash.xxh3_64_intdigest


def fanout_ring_path(directory: str) -> str:
    """The ring file of one ``pdlb serve`` in its shared-state ``directory``."""
    return os.path.join(directory, "kv-events.ring")


# ---------------------------------------------------------------------- record format
def _fixed_bytes(engine: bytes, medium: bytes | None, parent: bool) -> int:
    return _BODY_FIXED.size + len(engine) + (1 + len(medium) if medium is not None else 0) + (8 if parent else 0) + 4


def encode_record(seq: int, replica: ReplicaId, event: KvEvent, target: int | None = None) -> bytes:
    """One whole record (length, checksum, body; see the module docstring) of ``event`` about
    ``replica``; ``target``: for that router process only (a resync snapshot).

    Raises:
        TypeError: not a pdlb KV event. ValueError: an engine name over 65535 bytes or a medium over 255.
    """
    engine = replica.engine.encode("utf-8", "surrogatepass")
    if len(engine) > 0xFFFF:
        raise ValueError(f"engine name of {len(engine)} bytes (at most 65535)")
    medium = None if event.medium is None else event.medium.encode("utf-8", "surrogatepass")
    if medium is not None and len(medium) > 0xFF:
        raise ValueError(f"medium of {len(medium)} bytes (at most 255)")
    if isinstance(event, BlockStored):
        kind, parent, hashes = KIND_STORED, event.parent_block_hash, event.block_hashes
    elif isinstance(event, BlockRemoved):
        kind, parent, hashes = KIND_REMOVED, None, event.block_hashes
    elif isinstance(event, AllBlocksCleared):
        kind, parent, hashes = KIND_CLEARED, None, ()
    else:
        raise TypeError(f"not a pdlb KV event: {event!r}")
    flags = ((_FLAG_PARENT if parent is not None else 0) | (_FLAG_MEDIUM if medium is not None else 0)
             | (_FLAG_TARGET if target is not None else 0))
    parts = [_BODY_FIXED.pack(seq, kind, flags, replica.dp_rank, len(engine)), engine]
    if target is not None:
        parts.append(_U16.pack(target))
    if medium is not None:
        parts += [_U8.pack(len(medium)), medium]
    if parent is not None:
        parts.append(_U64.pack(parent))
    parts.append(struct.pack(f"<I{len(hashes)}Q", len(hashes), *hashes))
    body = b"".join(parts)
    return _REC_HEAD.pack(len(body), _xxh3(body)) + body


def split_event(replica: ReplicaId, event: KvEvent, max_body_bytes: int) -> list[KvEvent]:
    """``event`` as pdlb events whose records' bodies fit ``max_body_bytes``: a ``BlockStored``'s
    later parts name the previous part's last block as their parent (the same chain); a
    ``BlockRemoved`` is split anywhere.

    Raises:
        ValueError: ``max_body_bytes`` leaves no room for one block hash.
    """
    if isinstance(event, AllBlocksCleared):
        return [event]
    engine = replica.engine.encode("utf-8", "surrogatepass")
    medium = None if event.medium is None else event.medium.encode("utf-8", "surrogatepass")
    hashes = event.block_hashes
    room = (max_body_bytes - _fixed_bytes(engine, medium, True) - 2) // 8  # 2: a target
    if room < 1:
        raise ValueError(f"records of {max_body_bytes} bytes hold no block hash for {replica}")
    if len(hashes) <= room:
        return [event]
    out: list[KvEvent] = []
    if isinstance(event, BlockRemoved):
        return [BlockRemoved(hashes[i:i + room], event.medium) for i in range(0, len(hashes), room)]
    parent = event.parent_block_hash
    for i in range(0, len(hashes), room):
        part = hashes[i:i + room]
        out.append(BlockStored(part, event.medium, parent))
        parent = part[-1]
    return out


def decode_body(body: bytes | memoryview, engines: dict[tuple[bytes, int], ReplicaId] | None = None
                ) -> tuple[int, ReplicaId, KvEvent]:
    """``(seq, replica, event)`` of one record body (checksum already verified).

    ``engines``: a cache of replicas by (engine bytes, DP rank), filled as it goes.

    Raises:
        ValueError: the body is malformed (lengths past its end, an unknown kind).
    """
    try:
        seq, kind, flags, dp_rank, elen = _BODY_FIXED.unpack_from(body, 0)
        off = _BODY_FIXED.size
        ekey = (bytes(body[off:off + elen]), dp_rank)
        off += elen
        if len(ekey[0]) != elen:
            raise ValueError("engine name past the record's end")
        if flags & _FLAG_TARGET:
            off += 2
        medium = None
        if flags & _FLAG_MEDIUM:
            (mlen,) = _U8.unpack_from(body, off)
            medium = bytes(body[off + 1:off + 1 + mlen]).decode("utf-8", "surrogatepass")
            off += 1 + mlen
        parent = None
        if flags & _FLAG_PARENT:
            (parent,) = _U64.unpack_from(body, off)
            off += 8
        (n,) = _U32.unpack_from(body, off)
        off += 4
        if off + 8 * n != len(body):
            raise ValueError(f"{n} block hashes do not fill the record's {len(body) - off} bytes")
        hashes = struct.unpack_from(f"<{n}Q", body, off)
    except struct.error as e:
        raise ValueError(f"malformed record: {e}") from None
    rep = None if engines is None else engines.get(ekey)
    if rep is None:
        rep = ReplicaId(ekey[0].decode("utf-8", "surrogatepass"), dp_rank)
        if engines is not None and len(engines) < 65536:
            engines[ekey] = rep
    ev: KvEvent
    if kind == KIND_STORED:
        ev = BlockStored(hashes, medium, parent)
    elif kind == KIND_REMOVED:
        ev = BlockRemoved(hashes, medium)
    elif kind == KIND_CLEARED:
        ev = AllBlocksCleared(medium)
    else:
        raise ValueError(f"unknown record kind {kind}")
    return seq, rep, ev


def record_target(body: bytes | memoryview) -> int | None:
    """The router process a record body is for (flag bit 2), or ``None``: for every reader."""
    if len(body) < _BODY_FIXED.size or not body[9] & _FLAG_TARGET:
        return None
    off = _BODY_FIXED.size + _U16.unpack_from(body, _BODY_FIXED.size - 2)[0]
    if off + 2 > len(body):
        raise ValueError("target past the record's end")
    return _U16.unpack_from(body, off)[0]


def fanout_resync_path(ring_path: str) -> str:
    """The resync request file of the ring at ``ring_path``: one little 64-bit counter per router
    process (:data:`RESYNC_SLOTS`), each written by its own process only."""
    return ring_path + ".resync"


def _map_resync(ring_path: str) -> mmap.mmap:
    fd = os.open(fanout_resync_path(ring_path), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < 8 * RESYNC_SLOTS:
            os.ftruncate(fd, 8 * RESYNC_SLOTS)
        return mmap.mmap(fd, 8 * RESYNC_SLOTS)
    finally:
        os.close(fd)


class ViewMirror:
    """What a reader that applied every record written so far holds, per replica and tier: the
    stored pdlb blocks and their parents (the writer's side; the source of resync snapshots).

    Bounded: at most ``capacity_blocks`` blocks over all replicas; beyond that a store pushes out
    the oldest stored blocks of the view it writes to (as the engine's own LRU would), or, if that
    view holds only what it just stored, of the largest other view (``evicted``). A snapshot
    then lacks them: a reader resynced from it misses those blocks, which its siblings may
    still hold until the engine removes them.
    """

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = max(1, capacity_blocks)
        self._views: dict[tuple[ReplicaId, str], dict[int, int | None]] = {}
        self._medium: dict[tuple[ReplicaId, str], str | None] = {}
        self.replicas: dict[ReplicaId, None] = {}  # every replica written about (ordered set), bounded
        self.blocks = 0
        self.evicted = 0

    def apply(self, replica: ReplicaId, event: KvEvent) -> None:
        try:
            tier = tier_of_medium(event.medium)
        except ValueError:
            return  # readers cannot apply it either
        if replica not in self.replicas and len(self.replicas) < 65536:
            self.replicas[replica] = None
        key = (replica, tier)
        if isinstance(event, AllBlocksCleared):
            d = self._views.pop(key, None)
            if d:
                self.blocks -= len(d)
            return
        d = self._views.get(key)
        if isinstance(event, BlockRemoved):
            if d:
                for h in event.block_hashes:
                    if d.pop(h, 0) != 0:
                        self.blocks -= 1
            return
        if d is None:
            d = self._views[key] = {}
        self._medium[key] = event.medium
        parent = event.parent_block_hash
        for h in event.block_hashes:
            if d.pop(h, 0) == 0:
                self.blocks += 1
            d[h] = parent  # re-inserted: the newest
            parent = h
        new = len(event.block_hashes)
        while self.blocks > self.capacity_blocks:
            victim = d if len(d) > new else max(self._views.values(), key=lambda v: len(v) if v is not d else -1)
            if not victim:  # no other view holds anything: this event alone is over the bound
                victim = d
            victim.pop(next(iter(victim)))
            self.blocks -= 1
            self.evicted += 1

    def snapshot(self) -> list[tuple[ReplicaId, KvEvent]]:
        """Events that turn any view into this one: per replica ``AllBlocksCleared`` of HBM and
        host (and each shared-store medium once), then its stored blocks as ``BlockStored`` runs,
        each block after its parent (a run continues the previous one when chained)."""
        out: list[tuple[ReplicaId, KvEvent]] = []
        stores: dict[str | None, ReplicaId] = {}
        for rep in self.replicas:
            out += [(rep, AllBlocksCleared(None)), (rep, AllBlocksCleared("CPU"))]
        for (rep, tier), med in self._medium.items():
            if tier == "store" and med not in stores:
                stores[med] = rep
        out += [(rep, AllBlocksCleared(med)) for med, rep in stores.items()]
        for key, d in self._views.items():
            if not d:
                continue
            rep, med = key[0], self._medium.get(key)
            done: set[int] = set()
            run: list[int] = []
            run_parent: int | None = None
            for h in d:
                chain = []
                x: int | None = h
                while x is not None and x in d and x not in done:
                    chain.append(x)
                    done.add(x)
                    x = d[x]
                for y in reversed(chain):
                    p = d[y]
                    if run and p == run[-1]:
                        run.append(y)
                    else:
                        if run:
                            out.append((rep, BlockStored(tuple(run), med, run_parent)))
                        run, run_parent = [y], p
            if run:
                out.append((rep, BlockStored(tuple(run), med, run_parent)))
        return out


# ---------------------------------------------------------------------- ring
def _map_ring(path: str) -> mmap.mmap | None:
    """Map an existing ring file read-write, or None if it is not there (or not a whole ring) yet."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size <= HEADER_BYTES:
            return None
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    if bytes(mm[16:24]) != MAGIC or _U64.unpack_from(mm, 8)[0] != size - HEADER_BYTES:
        mm.close()
        return None
    return mm


def _lock_writer(path: str, timeout_s: float) -> int:
    """Take the ring's writer lock (``flock`` on ``path + ".lock"``; the kernel drops it when its
    holder exits, however it dies); returns the lock file's descriptor.

    Raises:
        RuntimeError: another writer still holds it after ``timeout_s``.
    """
    import fcntl
    import time

    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise RuntimeError(f"KV fan-out ring {path}: another writer still holds it after {timeout_s:g} s") from None
            time.sleep(0.05)


class RingWriter:
    """The writing side (one per ring: the subscriber's): creates the ring at ``path`` (atomically:
    readers never see a ring without its header), or takes over an existing one where it ends
    (``resumed``: a restarted subscriber). One writer at a time, enforced: it first takes the
    ring's lock (:func:`_lock_writer`, waiting up to ``lock_timeout_s`` for the previous writer,
    e.g. the subscriber child of a router process 0 that was killed, to exit).

    Args:
        path: the ring file.
        ring_bytes: data capacity of a new ring (an existing one keeps its own).
        max_record_bytes: largest record body (larger events are split, :func:`split_event`).
        lock_timeout_s: how long to wait for the previous writer's lock.
        mirror_capacity_blocks: bound of :attr:`mirror` (default: ``capacity / 64``, so a full
            snapshot's hashes take an eighth of the ring).
    """

    def __init__(self, path: str, ring_bytes: int = RING_BYTES, max_record_bytes: int = MAX_RECORD_BYTES,
                 lock_timeout_s: float = WRITER_LOCK_TIMEOUT_S, mirror_capacity_blocks: int | None = None) -> None:
        self._lock_fd = _lock_writer(path, lock_timeout_s)
        try:
            self._open(path, ring_bytes, max_record_bytes, mirror_capacity_blocks)
        except BaseException:
            os.close(self._lock_fd)
            raise

    def _open(self, path: str, ring_bytes: int, max_record_bytes: int, mirror_capacity_blocks: int | None) -> None:
        mm = _map_ring(path)
        self.resumed = mm is not None
        if mm is None:
            if ring_bytes < 4096:
                raise ValueError(f"ring_bytes must be >= 4096, got {ring_bytes}")
            tmp = f"{path}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, HEADER_BYTES + ring_bytes)  # sparse zeros: head 0
                mm = mmap.mmap(fd, HEADER_BYTES + ring_bytes)
            finally:
                os.close(fd)
            mm[8:16] = _U64.pack(ring_bytes)
            mm[16:24] = MAGIC
            os.rename(tmp, path)
        self._mm = mm
        self.capacity = len(mm) - HEADER_BYTES
        self.max_record_bytes = min(max_record_bytes, MAX_RECORD_BYTES, self.capacity // 8)
        self._head_word = memoryview(mm)[0:8].cast("Q")
        self.head = self._head_word[0]
        self.seq = _U64.unpack_from(mm, 24)[0]
        self.records = 0  # written by this writer
        self.split_events = 0  # events written as several records
        self.unencodable = 0  # events skipped: an engine name or medium too long for the format
        # a full snapshot's hashes take an eighth of the ring
        self.mirror = ViewMirror(self.capacity // 64 if mirror_capacity_blocks is None else mirror_capacity_blocks)
        self.snapshots = 0  # resync snapshots written
        self._lock = threading.Lock()  # write() in the subscriber's thread, serve_resyncs() elsewhere
        self._resync = _map_resync(path)
        self._served = bytes(self._resync)  # requests made before this writer: its clears answer them

    def write(self, items: Sequence[tuple[ReplicaId, KvEvent]], target: int | None = None) -> int:
        """Append the records of ``items`` (in order) and publish them; returns the records written.
        Never blocks (beyond another thread's write). The head is stored after each ``capacity / 8``
        bytes at most (so what is being written but not yet published is under a quarter of the
        ring: readers rely on it, :attr:`RingReader.safe_lag`). ``target``: records for that router
        process only (a snapshot); otherwise the events also update :attr:`mirror`. Then answers
        the resync requests waiting (:meth:`serve_resyncs`)."""
        with self._lock:
            n = self._write(items, target)
            if target is None:
                n += self._serve()
            return n

    def stats(self) -> dict[str, int]:
        """The writer's counters: records written, resync snapshots written, the mirror's
        blocks and the blocks its bound evicted (a reader resynced after that misses them)."""
        with self._lock:
            return {"writer_records": self.records, "snapshots_written": self.snapshots,
                    "mirror_blocks": self.mirror.blocks, "mirror_evicted": self.mirror.evicted}

    def serve_resyncs(self) -> int:
        """Write a snapshot of :attr:`mirror` for each router process that asked for a resync
        since it was last answered (its slot in the request file changed); returns the records
        written. Called after every :meth:`write` and, while no events come, periodically by the
        subscriber."""
        with self._lock:
            return self._serve()

    def _serve(self) -> int:
        now = bytes(self._resync)
        if now == self._served:
            return 0
        n = 0
        snap: list[tuple[ReplicaId, KvEvent]] | None = None
        for k in range(RESYNC_SLOTS):
            if now[8 * k:8 * k + 8] != self._served[8 * k:8 * k + 8]:
                if snap is None:
                    snap = self.mirror.snapshot()
                n += self._write(snap, k)
                self.snapshots += 1
                log.info("KV fan-out ring: resync snapshot for router process %d (%d events, %d blocks)", k,
                         len(snap), self.mirror.blocks)
        self._served = now
        return n

    def _write(self, items: Sequence[tuple[ReplicaId, KvEvent]], target: int | None) -> int:
        if target is None:
            mirror = self.mirror
            for rep, ev in items:
                mirror.apply(rep, ev)
        buf = bytearray()
        n = 0
        limit = self.max_record_bytes
        flush_at = self.capacity // 8
        for rep, ev in items:
            try:
                parts = split_event(rep, ev, limit)
                recs = [encode_record(self.seq + k, rep, part, target) for k, part in enumerate(parts)]
            except (ValueError, TypeError) as e:  # bounded names make this unreachable from pdlb serve
                self.unencodable += 1
                log.warning("KV event for %s not fanned out: %s", rep, e)
                continue
            if len(parts) > 1:
                self.split_events += 1
            for rec in recs:
                buf += rec
                self.seq += 1
                n += 1
                if len(buf) >= flush_at:
                    self._publish(buf)
                    buf = bytearray()
        if buf:
            self._publish(buf)
        self.records += n
        return n

    def _publish(self, data: bytearray) -> None:
        mm, cap = self._mm, self.capacity
        at = self.head % cap
        first = min(len(data), cap - at)
        mm[HEADER_BYTES + at:HEADER_BYTES + at + first] = data[:first]
        if first < len(data):
            mm[HEADER_BYTES:HEADER_BYTES + len(data) - first] = data[first:]
        mm[24:32] = _U64.pack(self.seq)
        self.head += len(data)
        self._head_word[0] = self.head  # after the bytes: a reader never sees a head past unwritten ones

    def close(self) -> None:
        self._head_word.release()
        self._mm.close()
        self._resync.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the writer lock
            self._lock_fd = -1


class RingReader:
    """One process's position in the ring (see the module docstring); opens the ring lazily (it
    may not exist yet when the process starts). Starts at the ring's beginning: what the
    subscriber wrote before this process looked is applied too.

    Attributes (monotonic counters): ``records`` read and decoded, ``lost_records`` overwritten
    before they were read, ``lost_bytes`` likewise, ``corrupt_records`` skipped (checksum or
    format), ``laps`` times this reader was lapped.
    """

    def __init__(self, path: str, read_bytes: int = READ_BYTES_PER_PASS, index: int | None = None) -> None:
        if index is not None and not 0 <= index < RESYNC_SLOTS:
            raise ValueError(f"process index {index} outside 0..{RESYNC_SLOTS - 1}")
        self.path = path
        self.read_bytes = read_bytes
        self.index = index
        self.resyncs = 0  # snapshots asked for (each time this reader was lapped)
        self.snapshot_records = 0  # records of snapshots for this reader, applied
        self._resync: mmap.mmap | None = None
        self._mm: mmap.mmap | None = None
        self._word: memoryview | None = None
        self.capacity = 0
        self.pos = 0
        self.next_seq = 0
        self.records = 0
        self.lost_records = 0
        self.lost_bytes = 0
        self.corrupt_records = 0
        self.laps = 0
        self._torn_at: int | None = None
        self._torn_polls = 0
        self._engines: dict[tuple[bytes, int], ReplicaId] = {}

    def _open(self) -> bool:
        if self._mm is None:
            mm = _map_ring(self.path)
            if mm is None:
                return False
            self._mm = mm
            self.capacity = len(mm) - HEADER_BYTES
            self._word = memoryview(mm)[0:8].cast("Q")
        return True

    def head_bytes(self) -> int:
        """The ring's head: bytes ever written (0 before the ring exists)."""
        return 0 if self._word is None else int(self._word[0])

    def lag_bytes(self) -> int:
        """Bytes written and not yet read by this reader (0 before the ring exists)."""
        if self._word is None:
            return 0
        return max(0, self._word[0] - self.pos)

    def poll(self) -> tuple[list[tuple[ReplicaId, KvEvent]], bool]:
        """The events written since the last poll (at most ``read_bytes`` of records), and whether
        more are waiting."""
        if not self._open():
            return [], False
        mm, cap, word = self._mm, self.capacity, self._word
        assert mm is not None and word is not None
        head = word[0]
        if head == self.pos:
            return [], False
        if head < self.pos or head - self.pos > self.safe_lag:
            self._lapped(head)
            return [], False
        longest = self._longest_record()
        end = min(head, self.pos + self.read_bytes)
        data = self._copy(end)
        if end < head and len(data) >= _REC_HEAD.size:  # a first record longer than read_bytes: take it whole
            whole = _REC_HEAD.size + _REC_HEAD.unpack_from(data, 0)[0]
            if len(data) < whole <= longest:
                end = min(head, self.pos + whole)
                data = self._copy(end)
        now = word[0]
        if now - self.pos > self.safe_lag:  # the writer may have overwritten part of the span meanwhile
            self._lapped(now)
            return [], False
        out: list[tuple[ReplicaId, KvEvent]] = []
        off, n = 0, len(data)
        broken: str | None = None
        view = memoryview(data)
        try:
            while off + _REC_HEAD.size <= n:
                blen, check = _REC_HEAD.unpack_from(data, off)
                rec_end = off + _REC_HEAD.size + blen
                if blen > longest or blen < _BODY_FIXED.size:
                    broken = f"a record length of {blen} bytes"
                    break
                if rec_end > n:
                    if end == head:  # the head moves only after whole records: this one is broken
                        broken = "a record past the written end"
                    break  # else: continued in the next pass (read_bytes reached)
                body = view[off + _REC_HEAD.size:rec_end]
                if _xxh3(body) != check:
                    broken = "a checksum mismatch"
                    break
                try:
                    target = record_target(body)
                    if target is not None and target != self.index:  # another reader's snapshot
                        seq = _U64.unpack_from(body, 0)[0]
                        if seq > self.next_seq:
                            self.lost_records += seq - self.next_seq
                        self.next_seq = seq + 1
                        off = rec_end
                        continue
                    seq, rep, ev = decode_body(body, self._engines)
                    if target is not None:
                        self.snapshot_records += 1
                except ValueError as e:
                    self.corrupt_records += 1
                    log.warning("KV fan-out ring %s: record skipped: %s", self.path, e)
                    off = rec_end
                    continue
                if seq > self.next_seq:
                    self.lost_records += seq - self.next_seq
                self.next_seq = seq + 1
                self.records += 1
                out.append((rep, ev))
                off = rec_end
            if broken is None and end == head and 0 < n - off < _REC_HEAD.size:
                broken = "a record header past the written end"
        finally:
            view.release()
        at = self.pos + off
        if broken is None:
            self._torn_at, self._torn_polls = None, 0
            self.pos = at
        elif self._torn(at, broken):  # given up: skip to the head, a record boundary
            self.lost_bytes += head - at
            self.pos = head
        else:
            self.pos = at  # read again from the broken record next time
        return out, self.pos < word[0] and broken is None

    def _copy(self, end: int) -> bytes:
        """The ring's bytes from this reader's position to ``end`` (total-bytes coordinates)."""
        mm, cap = self._mm, self.capacity
        assert mm is not None
        a, b = self.pos % cap, end % cap
        if a < b:
            return mm[HEADER_BYTES + a:HEADER_BYTES + b]
        return mm[HEADER_BYTES + a:HEADER_BYTES + cap] + mm[HEADER_BYTES:HEADER_BYTES + b]

    @property
    def safe_lag(self) -> int:
        """Most bytes a reader may be behind the head and still trust what it copies: the ring,
        less what the writer may be writing before it next moves the head (:class:`RingWriter`
        publishes at least every quarter ring)."""
        return self.capacity - self.capacity // 4 - 64

    def _longest_record(self) -> int:
        return min(MAX_RECORD_BYTES, self.capacity // 8) + _REC_HEAD.size

    def _lapped(self, head: int) -> None:
        self.laps += 1
        if head > self.pos:
            self.lost_bytes += head - self.pos
        log.warning("KV fan-out ring %s: this process fell %d bytes behind (the ring holds %d): the events "
                    "in between are lost to it", self.path, head - self.pos, self.capacity)
        self.pos = head  # a record boundary; the next record's seq tells how many were lost
        self._torn_at, self._torn_polls = None, 0
        self._request_resync()

    def _request_resync(self) -> None:
        """Ask the writer for a snapshot (this reader's slot of the request file, written by it
        alone): what follows the head it resumed at, plus the snapshot's clears and stores, gives
        it the view of a reader that missed nothing. A reader without an ``index`` cannot ask."""
        if self.index is None:
            return
        if self._resync is None:
            self._resync = _map_resync(self.path)
        self.resyncs += 1
        self._resync[8 * self.index:8 * self.index + 8] = _U64.pack(self.resyncs)
        log.warning("KV fan-out ring %s: router process %d asked for a resync snapshot", self.path, self.index)

    def _torn(self, at: int, what: str) -> bool:
        """A record at ring byte ``at`` is not whole: True once it failed :data:`TORN_RETRIES` polls."""
        if self._torn_at != at:
            self._torn_at, self._torn_polls = at, 0
        self._torn_polls += 1
        if self._torn_polls <= TORN_RETRIES:
            return False
        self.corrupt_records += 1
        log.warning("KV fan-out ring %s: %s at byte %d after %d polls; skipping to the head", self.path, what, at,
                    TORN_RETRIES)
        self._torn_at, self._torn_polls = None, 0
        return True

    def close(self) -> None:
        if self._resync is not None:
            self._resync.close()
            self._resync = None
        if self._word is not None:
            self._word.release()
            self._word = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None
