"""ZMQ subscriber of engines' KV events (vLLM, SGLang): sequence tracking, replay, restarts, staleness.

One background thread owns every SUB socket (one per engine DP rank: DP rank ``r`` publishes on
the worker's ``events`` port + ``r``, :func:`balancer.kv_wire.offset_port`) and the replay sockets.
Per message ``[topic, seq, payload]`` it decodes the batch (:mod:`balancer.kv_wire`), translates
the events into pdlb's hash space (:mod:`balancer.kv_translate`, one translator per replica) and
hands the result, ``[(ReplicaId, KvEvent), ...]`` per poll round, to ``deliver`` (called in the
subscriber thread; the service queues them for its event loop, :class:`LoopDelivery`).
:class:`KvEventSubscriberProcess` runs the same subscriber in a child process, which is what
``pdlb serve`` does: decoding and hashing a 32k-token ``BlockStored`` is 1-3 ms of work that
holds the GIL, so a thread beside the event loop would still delay requests by that much; in a
child process it runs on another core, and the event loop only applies ready pdlb events to the
index (about 70 us for 512 router blocks).

Sequence handling per source (ANCHORS.md, "Replay"; llm-d's consumer does likewise):

* **first message / late start**: with a replay endpoint the subscriber asks for replay from
  seq 0 as soon as it connects, so a router started after the engines warmed up learns what is
  still in the engine's replay buffer (blocks cached earlier than the buffer reaches are never
  re-announced);
* **gap** (``seq > last + 1``): replay from ``last + 1``; batches the replay no longer holds are
  counted in ``gaps_unrecovered`` (the index may then miss stores and removals of that replica
  until they are overwritten by newer events; nothing is cleared);
* **duplicate** (``seq <= last`` with a timestamp not newer than the last batch's): skipped (live
  batches that arrived while a replay ran);
* **restart** (``seq <= last`` with a newer timestamp: the engine's counter started again): the
  replica's cache is cleared in the router (``AllBlocksCleared``), its translator forgets every
  engine block, and the stream is taken up again from the new numbering (replaying from 0 if the
  first batches were missed);
* **stale**: a source that delivered nothing for ``stale_after_s`` is marked stale (logged once,
  ``pdlb_kv_events_stale`` gauge) until its next message. An idle engine publishes nothing, so
  stale is a signal to look, not a routing change.

Thread safety: :meth:`KvEventSubscriber.stats` may be called from any thread; everything else
runs in the subscriber thread. Stop it with :meth:`KvEventSubscriber.stop` (joins the thread).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from typing import Any

import zmq

from balancer.kv_events import AllBlocksCleared, KvEvent
from balancer.kv_translate import DEFAULT_TRANSLATOR_CAPACITY_BLOCKS, KvEventTranslator
from balancer.kv_wire import END_OF_REPLAY, KvWireError, decode_batch, decode_seq, encode_seq, offset_port
from balancer.service.kv_metrics import KvEventsCollector, KvEventsFilesCollector, write_stats_file
from balancer.types import ReplicaId

__all__ = ["KvEventSource", "KvEventSubscriber", "KvEventSubscriberProcess", "KvEventsCollector",
           "KvEventsFilesCollector", "LoopDelivery", "SourceStats", "sources_for_worker", "start_for_service",
           "write_stats_file"]

log = logging.getLogger("pdlb.kv_events")

RESYNC_POLL_S = 0.1
"""Longest a fan-out reader's resync request waits while no engine events come (the subscriber
child looks at the request file this often; with events flowing, after every write)."""

Deliver = Callable[[list[tuple[ReplicaId, KvEvent]]], object]


#: ZMQ contexts of subscriber threads that did not stop: kept referenced, never finalised
_UNSTOPPED: list = []


@dataclass(frozen=True, slots=True)
class KvEventSource:
    """One publisher: a DP rank's PUB endpoint (already offset) and, optionally, its replay ROUTER."""

    replica: ReplicaId
    endpoint: str
    replay_endpoint: str | None = None
    topic: bytes = b""


def sources_for_worker(url: str, dp_size: int, events: str, replay: str | None = None) -> list[KvEventSource]:
    """The sources of a worker with ``dp_size`` DP ranks whose rank 0 publishes on ``events``
    (and serves replay on ``replay``): rank ``r`` on port + ``r`` (vLLM and SGLang offset both)."""
    return [KvEventSource(ReplicaId(url, r), offset_port(events, r), offset_port(replay, r) if replay else None)
            for r in range(dp_size)]


@dataclass(slots=True)
class SourceStats:
    """Counters and state of one source (monotonic counters; ``last_seq`` -1 before the first batch)."""

    batches: int = 0
    events: int = 0
    pdlb_events: int = 0
    duplicates: int = 0
    gaps: int = 0
    gaps_unrecovered: int = 0
    replays: int = 0
    replay_failures: int = 0
    restarts: int = 0
    decode_errors: int = 0
    dp_rank_mismatches: int = 0
    last_seq: int = -1
    stale: bool = False
    seconds_since_last_batch: float = -1.0

    def as_dict(self) -> dict[str, float | int | bool]:
        return {k: getattr(self, k) for k in self.__slots__}


@dataclass(slots=True)
class _Source:
    src: KvEventSource
    translator: KvEventTranslator
    sub: zmq.Socket | None = None
    stats: SourceStats = field(default_factory=SourceStats)
    last_seq: int | None = None
    last_ts: float = float("-inf")
    last_msg_s: float = 0.0
    replayed_from_start: bool = False


class KvEventSubscriber:
    """Consumes the KV events of ``sources`` in a background thread (see the module docstring).

    Args:
        sources: the publishers (:func:`sources_for_worker`).
        block_size: the router's block size (tokens), for the translators.
        deliver: called in the subscriber thread with each poll round's ``[(replica, event)]``.
        stale_after_s: seconds without a batch before a source is marked stale.
        replay_timeout_s: how long one replay may take before it is given up (counted).
        translator_capacity_blocks: engine blocks remembered per replica and tier.
        context: a ``zmq.Context`` (default: a new one, terminated on stop).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, sources: Sequence[KvEventSource], block_size: int, deliver: Deliver, *,
                 stale_after_s: float = 60.0, replay_timeout_s: float = 2.0,
                 translator_capacity_blocks: int = DEFAULT_TRANSLATOR_CAPACITY_BLOCKS,
                 context: zmq.Context | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        seen: set[ReplicaId] = set()
        for s in sources:
            if s.replica in seen:
                raise ValueError(f"two KV event sources for {s.replica}")
            seen.add(s.replica)
        self._block_size = block_size
        self._capacity = translator_capacity_blocks
        self._sources = [_Source(s, KvEventTranslator(block_size, translator_capacity_blocks)) for s in sources]
        self._commands: deque[tuple[str, list]] = deque()  # ("add", sources) / ("remove", replicas)
        self._deliver = deliver
        self.stale_after_s = stale_after_s
        self.replay_timeout_s = replay_timeout_s
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._clock = clock
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the stats copies read by other threads
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        """Connect and start the thread; returns once the SUB sockets are connected."""
        if self._thread is not None:
            raise RuntimeError("subscriber already started")
        self._thread = threading.Thread(target=self._run, name="pdlb-kv-events", daemon=True)
        self._thread.start()
        self._started.wait(5.0)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and close the sockets (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._own_ctx:
            if self._thread is None or not self._thread.is_alive():
                self._ctx.term()
            else:  # its sockets are still open in that thread: term() (here or in the context's
                # finaliser, wherever the garbage collector runs it) would block until they close
                log.warning("KV event subscriber thread did not stop within %.1f s; its ZMQ context is left open",
                            timeout_s)
                _UNSTOPPED.append(self._ctx)

    def add_sources(self, sources: Sequence[KvEventSource]) -> None:
        """Subscribe to more publishers (a worker added at run time); thread-safe. Each is caught
        up from its replay buffer as at start, after an ``AllBlocksCleared`` (both media) of its
        replica is delivered: a worker removed and added again with the same URL must not keep
        what its predecessor announced, and that predecessor's events may still be waiting
        downstream (queued for the event loop, or in the fan-out ring for a process that lags or
        reads it from its start, :mod:`balancer.service.kv_fanout`); the clear comes after them in
        delivery order, so every reader drops them there, before the new worker's first event.
        Sources of an already subscribed replica are ignored."""
        self._commands.append(("add", list(sources)))

    def remove_replicas(self, replicas: Sequence[ReplicaId]) -> None:
        """Stop consuming these replicas' events (a worker removed at run time); thread-safe."""
        self._commands.append(("remove", list(replicas)))

    def stats(self) -> dict[ReplicaId, dict[str, float | int | bool]]:
        """Per replica: a copy of its :class:`SourceStats` and translator counters."""
        now = self._clock()
        with self._lock:
            out = {}
            for s in self._sources:
                d = s.stats.as_dict()
                d["seconds_since_last_batch"] = (now - s.last_msg_s) if s.last_seq is not None else -1.0
                d.update({f"translator_{k}": v for k, v in s.translator.stats.as_dict().items()})
                d["translator_engine_blocks"] = s.translator.num_blocks()
                out[s.src.replica] = d
            return out

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        poller = zmq.Poller()
        by_socket: dict[zmq.Socket, _Source] = {}
        try:
            for s in self._sources:
                self._connect(s, poller, by_socket)
            self._started.set()
            # a router that starts after the engines asks each for what its buffer still holds
            for s in self._sources:
                self._initial_catch_up(s)
            while not self._stop.is_set():
                while self._commands:
                    self._command(*self._commands.popleft(), poller, by_socket)
                ready = dict(poller.poll(100))
                out: list[tuple[ReplicaId, KvEvent]] = []
                for sock in ready:
                    src = by_socket.get(sock)
                    if src is None:
                        continue
                    for _ in range(1000):  # bounded per round: other sources get their turn
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_message(src, frames, out)
                if out:
                    self._deliver(out)
                self._check_stale()
        except BaseException as e:  # noqa: BLE001 - reported, never silent
            self.error = e
            log.exception("KV event subscriber stopped")
            self._started.set()
        finally:
            for s in self._sources:
                if s.sub is not None:
                    s.sub.close(0)

    def _connect(self, s: _Source, poller: zmq.Poller, by_socket: dict[zmq.Socket, _Source]) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, s.src.topic)
        sub.connect(s.src.endpoint)
        s.sub = sub
        s.last_msg_s = self._clock()
        poller.register(sub, zmq.POLLIN)
        by_socket[sub] = s

    def _initial_catch_up(self, s: _Source) -> None:
        if s.src.replay_endpoint is not None:
            out: list[tuple[ReplicaId, KvEvent]] = []
            self._catch_up(s, 0, out)
            s.replayed_from_start = True
            if out:
                self._deliver(out)

    def _command(self, kind: str, items: list, poller: zmq.Poller, by_socket: dict[zmq.Socket, _Source]) -> None:
        if kind == "add":
            have = {s.src.replica for s in self._sources}
            new = [_Source(src, KvEventTranslator(self._block_size, self._capacity))
                   for src in items if src.replica not in have]
            for s in new:
                self._connect(s, poller, by_socket)
            with self._lock:
                self._sources.extend(new)
            if new:  # a view that starts empty, in delivery order: see add_sources
                self._deliver([(s.src.replica, AllBlocksCleared(m)) for s in new for m in (None, "CPU")])
            time.sleep(0.05)  # let the subscriptions join before asking for the buffer
            for s in new:
                self._initial_catch_up(s)
        else:
            gone = set(items)
            keep = []
            for s in self._sources:
                if s.src.replica in gone and s.sub is not None:
                    poller.unregister(s.sub)
                    by_socket.pop(s.sub, None)
                    s.sub.close(0)
                    s.sub = None
                else:
                    keep.append(s)
            with self._lock:
                self._sources = keep

    def _check_stale(self) -> None:
        now = self._clock()
        for s in self._sources:
            stale = now - s.last_msg_s > self.stale_after_s
            if stale and not s.stats.stale:
                log.warning("KV events of %s: nothing for %.0f s (stale)", s.src.replica, now - s.last_msg_s)
            if stale != s.stats.stale:
                with self._lock:
                    s.stats.stale = stale

    def _on_message(self, s: _Source, frames: list[bytes], out: list[tuple[ReplicaId, KvEvent]]) -> None:
        st = s.stats
        if len(frames) != 3:
            with self._lock:
                st.decode_errors += 1
            log.warning("KV events of %s: a message of %d frames (expected topic, seq, payload)", s.src.replica, len(frames))
            return
        try:
            seq = decode_seq(frames[1])
            batch = decode_batch(frames[2])
        except KvWireError as e:
            with self._lock:
                st.decode_errors += 1
            log.warning("KV events of %s: undecodable batch: %s", s.src.replica, e)
            return
        s.last_msg_s = self._clock()
        if s.last_seq is not None and seq <= s.last_seq:
            if batch.ts > s.last_ts:  # the counter started again: the engine restarted
                log.warning("KV events of %s: sequence reset %d -> %d: engine restarted, clearing its cache view",
                            s.src.replica, s.last_seq, seq)
                with self._lock:
                    st.restarts += 1
                s.translator.reset()
                out.append((s.src.replica, AllBlocksCleared(None)))
                out.append((s.src.replica, AllBlocksCleared("CPU")))
                s.last_seq = None
                s.last_ts = float("-inf")
            else:
                with self._lock:
                    st.duplicates += 1
                return
        if s.last_seq is None:
            if seq > 0 and s.src.replay_endpoint is not None and not s.replayed_from_start:
                s.replayed_from_start = True
                self._catch_up(s, 0, out, until=seq)
        elif seq > s.last_seq + 1:
            with self._lock:
                st.gaps += 1
            log.info("KV events of %s: gap %d -> %d, asking for replay", s.src.replica, s.last_seq, seq)
            if s.src.replay_endpoint is not None:
                self._catch_up(s, s.last_seq + 1, out, until=seq)
            if s.last_seq is not None and seq > s.last_seq + 1:
                with self._lock:
                    st.gaps_unrecovered += 1
                log.warning("KV events of %s: batches %d..%d lost (not in the replay buffer)",
                            s.src.replica, s.last_seq + 1, seq - 1)
        if s.last_seq is not None and seq <= s.last_seq:
            with self._lock:
                st.duplicates += 1
            return
        self._apply(s, seq, batch, out)

    def _apply(self, s: _Source, seq: int, batch, out: list[tuple[ReplicaId, KvEvent]]) -> None:  # noqa: ANN001
        st = s.stats
        rep = s.src.replica
        n = 0
        errors = 0
        for ev in batch.events:
            try:
                for pe in s.translator.translate(ev):
                    out.append((rep, pe))
                    n += 1
            except KvWireError as e:
                errors += 1
                log.warning("KV events of %s: seq %d: %s", rep, seq, e)
        with self._lock:
            st.batches += 1
            st.events += len(batch.events)
            st.pdlb_events += n
            st.decode_errors += errors
            if batch.data_parallel_rank is not None and batch.data_parallel_rank != rep.dp_rank:
                if not st.dp_rank_mismatches:
                    log.warning("KV events on %s carry data_parallel_rank %d (expected %d): check the port offsets",
                                s.src.endpoint, batch.data_parallel_rank, rep.dp_rank)
                st.dp_rank_mismatches += 1
            st.last_seq = seq
        s.last_seq = seq
        s.last_ts = max(s.last_ts, batch.ts)

    def _catch_up(self, s: _Source, start_seq: int, out: list[tuple[ReplicaId, KvEvent]],
                  until: int | None = None) -> None:
        """Replay from ``start_seq`` and apply every batch newer than what was applied."""
        got = self._replay(s, start_seq)
        if got is None:
            return
        for seq, payload in got:
            if until is not None and seq >= until:
                break
            if s.last_seq is not None and seq <= s.last_seq:
                continue
            if s.last_seq is not None and seq > s.last_seq + 1:
                break  # the buffer no longer reaches back this far: a hole stays
            try:
                batch = decode_batch(payload)
            except KvWireError as e:
                with self._lock:
                    s.stats.decode_errors += 1
                log.warning("KV events of %s: undecodable replayed batch %d: %s", s.src.replica, seq, e)
                continue
            self._apply(s, seq, batch, out)

    def _replay(self, s: _Source, start_seq: int) -> list[tuple[int, bytes]] | None:
        """``[(seq, payload)]`` the replay endpoint holds from ``start_seq``, or ``None`` on timeout."""
        assert s.src.replay_endpoint is not None
        with self._lock:
            s.stats.replays += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(s.src.replay_endpoint)
            sock.send_multipart([b"", encode_seq(start_seq)])
            got: list[tuple[int, bytes]] = []
            deadline = self._clock() + self.replay_timeout_s
            while True:
                left_ms = int(max(0.0, deadline - self._clock()) * 1000)
                if not left_ms or not sock.poll(left_ms):
                    with self._lock:
                        s.stats.replay_failures += 1
                    log.warning("KV events of %s: replay from %d timed out after %.1f s", s.src.replica,
                                start_seq, self.replay_timeout_s)
                    return None
                frames = sock.recv_multipart()
                if len(frames) != 3 or frames[0] != b"":
                    continue
                try:
                    seq = decode_seq(frames[1])
                except KvWireError:
                    continue
                if seq == END_OF_REPLAY:
                    return got
                got.append((seq, frames[2]))
                if len(got) > 1_000_000:  # bounded: no buffer holds this many
                    return got
        finally:
            sock.close(0)


class KvEventSubscriberProcess:
    """A :class:`KvEventSubscriber` in a child process (same interface: ``start``, ``stop``,
    ``stats``, ``error``): decoding and hash translation run on another core, outside this
    process's GIL, and only the translated pdlb events (a few integers per router block) cross a
    pipe, read by a thread here that hands them to ``deliver``. What ``pdlb serve`` runs: a
    thread in the router process would hold the GIL for the ~1-3 ms a 32k-token event costs to
    decode and hash, and the event loop would wait on it (``bench/kv_events_hot_path.py``).

    The child is a daemon (it dies with this process) and sends its counters every
    ``stats_interval_s``. Arguments are those of :class:`KvEventSubscriber` (``clock`` and
    ``context`` excepted), and ``ring_path`` instead of ``deliver``: the child appends the
    translated events to that fan-out ring (:class:`balancer.service.kv_fanout.RingWriter`, created
    with ``ring_bytes`` of capacity, or taken over) and nothing but counters crosses the pipe
    (``pdlb serve --processes N``: every router process reads the ring, :mod:`balancer.service.kv_fanout`).
    """

    def __init__(self, sources: Sequence[KvEventSource], block_size: int, deliver: Deliver | None, *,
                 stale_after_s: float = 60.0, replay_timeout_s: float = 2.0,
                 translator_capacity_blocks: int = DEFAULT_TRANSLATOR_CAPACITY_BLOCKS,
                 stats_interval_s: float = 0.5, ring_path: str | None = None, ring_bytes: int | None = None) -> None:
        if (deliver is None) == (ring_path is None):
            raise ValueError("give either deliver or ring_path")
        self._args = (list(sources), block_size, stale_after_s, replay_timeout_s, translator_capacity_blocks,
                      stats_interval_s, ring_path, ring_bytes)
        self._deliver = deliver
        self._stats: dict[ReplicaId, dict[str, float | int | bool]] = {}
        #: with ``ring_path``: the child's ring writer counters (:meth:`RingWriter.stats`), at most
        #: ``stats_interval_s`` old; ``None`` until the first report
        self.writer_stats: dict[str, int] | None = None
        self._proc: Any = None  # multiprocessing's SpawnProcess
        self._conn: Any = None  # its Connection
        self._reader: threading.Thread | None = None
        self._ready = threading.Event()
        self.error: BaseException | str | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the child and wait until its sockets are connected.

        Raises:
            RuntimeError: the child failed to start (its error) or did not report within ``timeout_s``.
        """
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        recv, send = ctx.Pipe(duplex=False)
        self._stop_r, self._stop_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_subscriber_child, args=(*self._args, send, self._stop_r),
                                 name="pdlb-kv-events", daemon=True)
        self._proc.start()
        send.close()
        self._conn = recv
        self._reader = threading.Thread(target=self._read, name="pdlb-kv-events-reader", daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout_s):
            self.stop()
            raise RuntimeError(f"KV event subscriber process did not start within {timeout_s:g} s")
        if self.error is not None:
            self.stop()
            raise RuntimeError(f"KV event subscriber process failed: {self.error}")

    def _read(self) -> None:
        assert self._conn is not None
        while True:
            try:
                kind, payload = self._conn.recv()
            except (EOFError, OSError):
                break
            if kind == "events" and self._deliver is not None:
                try:
                    self._deliver(payload)
                except Exception:  # noqa: BLE001 - never let the reader die
                    log.exception("KV events: delivery failed")
            elif kind == "stats":
                self._stats = payload
            elif kind == "writer":
                self.writer_stats = payload
            elif kind == "ready":
                self._ready.set()
            elif kind == "error":
                self.error = payload
                log.error("KV event subscriber process: %s", payload)
                self._ready.set()
        self._ready.set()

    def alive(self) -> bool:
        """The child runs and reported no error."""
        return self._proc is not None and self._proc.is_alive() and self.error is None

    @property
    def pid(self) -> int | None:
        """The child's process id (None before start / after stop)."""
        return None if self._proc is None else self._proc.pid

    def add_sources(self, sources: Sequence[KvEventSource]) -> None:
        """See :meth:`KvEventSubscriber.add_sources` (sent to the child)."""
        self._stop_w.send(("add", list(sources)))

    def remove_replicas(self, replicas: Sequence[ReplicaId]) -> None:
        """See :meth:`KvEventSubscriber.remove_replicas` (sent to the child)."""
        self._stop_w.send(("remove", list(replicas)))

    def stats(self) -> dict[ReplicaId, dict[str, float | int | bool]]:
        """The child's latest counters (see :meth:`KvEventSubscriber.stats`), at most
        ``stats_interval_s`` old."""
        return {k: dict(v) for k, v in self._stats.items()}

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the child (politely, then SIGKILL) and the reader thread (idempotent)."""
        if self._proc is None:
            return
        try:
            self._stop_w.send(("stop", None))
        except (OSError, BrokenPipeError):
            pass
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout_s)
        if self._reader is not None:
            self._reader.join(timeout_s)
        self._proc = None


def _subscriber_child(sources, block_size, stale_after_s, replay_timeout_s, capacity, stats_interval_s,  # noqa: ANN001
                      ring_path, ring_bytes, conn, stop_conn) -> None:  # noqa: ANN001
    """Entry point of :class:`KvEventSubscriberProcess`'s child."""
    send_lock = threading.Lock()

    def send(kind: str, payload) -> None:  # noqa: ANN001
        with send_lock:
            conn.send((kind, payload))

    writer = None
    try:
        deliver: Deliver
        if ring_path is not None:
            from balancer.kv_events import AllBlocksCleared as _Cleared
            from balancer.service.kv_fanout import RING_BYTES, RingWriter

            writer = RingWriter(ring_path, ring_bytes or RING_BYTES)
            if writer.resumed:  # a subscriber before this one wrote here: what it announced is unknown now
                writer.write([(s.replica, _Cleared(m)) for s in sources for m in (None, "CPU")])
            deliver = writer.write
        else:
            def deliver(items: list[tuple[ReplicaId, KvEvent]]) -> None:
                send("events", items)
        sub = KvEventSubscriber(sources, block_size, deliver, stale_after_s=stale_after_s,
                                replay_timeout_s=replay_timeout_s, translator_capacity_blocks=capacity)
        sub.start()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        send("error", f"{type(e).__name__}: {e}")
        return
    send("ready", None)
    next_stats = 0.0
    try:
        while True:
            if writer is not None:
                writer.serve_resyncs()  # resync requests that came while no events did
            if stop_conn.poll(min(stats_interval_s, RESYNC_POLL_S) if writer is not None else stats_interval_s):
                kind, items = stop_conn.recv()
                if kind == "stop":
                    break
                if kind == "add":
                    sub.add_sources(items)
                elif kind == "remove":
                    sub.remove_replicas(items)
            if time.monotonic() < next_stats:
                continue
            next_stats = time.monotonic() + stats_interval_s
            send("stats", sub.stats())
            if writer is not None:
                send("writer", writer.stats())
            if sub.error is not None:
                send("error", f"{type(sub.error).__name__}: {sub.error}")
                break
    except (OSError, BrokenPipeError, EOFError):
        pass
    finally:
        sub.stop()
        try:
            send("stats", sub.stats())
        except (OSError, BrokenPipeError):
            pass
        if writer is not None:
            writer.close()
        conn.close()


class LoopDelivery:
    """Hands batches from the subscriber thread to an asyncio loop, which applies them with
    ``apply(replica, event)`` (``Router.on_kv_event``) in one callback per wake-up: the loop
    never waits on the subscriber, and the router is only touched by the loop's thread.

    ``apply_budget``: most events applied per callback before yielding to other callbacks
    (requests) and rescheduling itself.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, apply: Callable[[ReplicaId, KvEvent], None],
                 apply_budget: int = 2000) -> None:
        self._loop = loop
        self._apply = apply
        self._queue: deque[tuple[ReplicaId, KvEvent]] = deque()
        self._scheduled = False
        self._lock = threading.Lock()
        self.apply_budget = apply_budget
        self.applied = 0
        self.errors = 0

    def __call__(self, items: list[tuple[ReplicaId, KvEvent]]) -> None:
        with self._lock:
            self._queue.extend(items)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop closed (shutdown)
            pass

    @property
    def pending(self) -> int:
        return len(self._queue)

    def _drain(self) -> None:
        q = self._queue
        for _ in range(self.apply_budget):
            try:
                rep, ev = q.popleft()
            except IndexError:
                break
            try:
                self._apply(rep, ev)
                self.applied += 1
            except (ValueError, TypeError) as e:
                self.errors += 1
                log.warning("KV event for %s not applied: %s", rep, e)
        with self._lock:
            if q:
                self._loop.call_soon(self._drain)
            else:
                self._scheduled = False


def start_for_service(workers, router, block_size: int, loop: asyncio.AbstractEventLoop,  # noqa: ANN001
                      settings) -> tuple[KvEventSubscriber | KvEventSubscriberProcess, LoopDelivery] | None:  # noqa: ANN001
    """The running subscriber of every worker config in ``workers`` with an ``events`` endpoint,
    applying into ``router`` on ``loop`` (``settings``: a ``KvEventsConfig``; ``settings.runner``
    ``"process"`` or ``"thread"``); ``None`` if no worker has one."""
    sources = [s for w in workers if w.events for s in sources_for_worker(w.url, w.dp_size, w.events, w.replay)]
    if not sources:
        return None
    delivery = LoopDelivery(loop, router.on_kv_event)
    kw: dict[str, Any] = dict(stale_after_s=settings.stale_after_s, replay_timeout_s=settings.replay_timeout_s,
                              translator_capacity_blocks=settings.translator_capacity_blocks)
    sub: KvEventSubscriber | KvEventSubscriberProcess
    if settings.runner == "process":
        sub = KvEventSubscriberProcess(sources, block_size, delivery, **kw)
    else:
        sub = KvEventSubscriber(sources, block_size, delivery, **kw)
    sub.start()
    return sub, delivery
