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

**Every source is handled on its own** (ANCHORS.md, "Replay"; llm-d's and Dynamo's consumers do
likewise). A replay is a DEALER socket in the same poll loop, never a blocking call: while one
source's replay runs, that source's live batches are *held* (bounded) and merged by sequence
number when the replay ends or times out, and every other source's batches are applied as they
come. At most ``max_concurrent_replays`` replays run at once (the others wait their turn, still
holding their own live batches); a source whose replay failed waits ``replay_timeout_s``,
doubling up to :data:`MAX_REPLAY_BACKOFF_S`, before it asks again, so an engine whose replay
never answers costs only itself.

Replay framing, as vLLM 0.33 and SGLang 0.5.23 send it (their ``ZmqEventPublisher._service_replay``,
checked by ``tests/service/test_engine_conformance.py`` against their own code): the client sends
``[b"", start_seq]`` (8-byte big-endian); each buffered batch ``seq >= start_seq`` comes back as
``[b"", topic, seq, payload]`` and the end as ``[b"", b"", seq = -1, b""]``. Three-frame replies
``[b"", seq, payload]`` (older publishers) are accepted too.

Sequence handling per source, and how long recovery takes (measured by ``tests/balancer/test_kv_wire.py``
and ``tests/service/test_engine_conformance.py`` on loopback; a replay is one round trip plus the
buffered batches):

* **late start** (a router started after the engines): each source asks for replay from 0 as
  soon as it connects, all sources at once; live batches are held meanwhile and applied after the
  replayed ones. The index holds what the engines' buffers still hold within one replay round
  trip (tens of ms; blocks cached earlier than a buffer reaches are never re-announced).
* **gap** (``seq > last + 1``): replay from ``last`` (one batch before the hole, see restarts),
  live batches held; recovered within one replay round trip. Batches the buffer no longer holds
  are counted in ``gaps_unrecovered`` (the view may then miss stores and removals until newer
  events overwrite them; nothing is cleared).
* **duplicate** (``seq <= last`` with a timestamp not newer than the last batch's): skipped.
* **restart**, recognised by any of: ``seq <= last`` with a newer timestamp (the counter started
  again); a timestamp more than :data:`TS_BACKWARDS_TOLERANCE_S` older than the last batch's; a
  replay whose batch ``last`` differs from the one applied (the new numbering overtook the old
  before the subscriber saw it: the replay starts one batch early to check exactly this); after
  the SUB socket lost its connection (a ZMQ monitor event: the publisher's process went away),
  such a replay is asked as soon as it connects again (or at the next batch), and a replay that
  holds nothing numbered ``last`` or later is a restart too (the engine that published ``last``
  still holds it: a new engine numbering below it, whose first batches may have gone out before
  the socket reconnected); without a replay endpoint, any batch but ``last + 1`` counts as a
  restart; or a run of :data:`RESTART_RUN` consecutive batches whose
  numbers jumped too far (below). Answered by clearing the replica's view (``AllBlocksCleared``
  of HBM and host; its translator forgets every engine block) and replaying the new engine's
  buffer from 0: the view is the new engine's within one replay round trip.
* **undecodable batch**: counted (``decode_errors``), its sequence number taken as seen (the next
  batch is no gap, no replay); its events are lost.
* **refused batch** (``refused_batches``): a non-finite timestamp, one more than
  ``max_future_s`` ahead of this host's clock, or a sequence number more than ``max_seq_jump``
  past the last: nothing of it is applied and its number is not taken (a plausible number is, as
  for an undecodable batch); the source is marked ``inconsistent`` (and ``stale``) until a batch
  is applied in sequence again.
* **stale**: a source that delivered nothing for ``stale_after_s`` is marked stale (logged once,
  ``pdlb_kv_events_stale`` gauge) until its next message. An idle engine publishes nothing, so
  stale is a signal to look, not a routing change.

Memory is bounded per source: at most :data:`MAX_HELD_BATCHES` held live batches and
:data:`MAX_HELD_BYTES` of their payloads (the oldest are dropped beyond, and show up as an
unrecovered gap), and at most :data:`MAX_REPLAY_BATCHES` / :data:`MAX_REPLAY_BYTES` of one replay.

Thread safety: :meth:`KvEventSubscriber.stats` may be called from any thread; everything else
runs in the subscriber thread. Stop it with :meth:`KvEventSubscriber.stop` (joins the thread).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from typing import Any

import zmq

from balancer.kv_events import AllBlocksCleared, KvEvent
from balancer.kv_translate import DEFAULT_TRANSLATOR_CAPACITY_BLOCKS, KvEventTranslator
from balancer.kv_wire import END_OF_REPLAY, EngineBatch, KvWireError, decode_batch, decode_seq, encode_seq, offset_port
from balancer.service.kv_metrics import KvEventsCollector, KvEventsFilesCollector, write_stats_file
from balancer.service.processes.kv_ring import RING_BYTES, RingWriter
from balancer.types import ReplicaId

__all__ = ["KvEventSource", "KvEventSubscriber", "KvEventSubscriberProcess", "KvEventsCollector",
           "KvEventsFilesCollector", "LoopDelivery", "SourceStats", "SupervisedSubscriber", "sources_for_worker",
           "start_for_service", "write_stats_file"]

log = logging.getLogger("pdlb.kv_events")

RESYNC_POLL_S = 0.1
"""Longest a fan-out reader's resync request waits while no engine events come (the subscriber
child looks at the request file this often; with events flowing, after every write)."""

MAX_HELD_BATCHES = 20_000
"""Most live batches one source holds while its replay runs (twice vLLM's and SGLang's default
replay buffer, ``buffer_steps`` 10,000)."""
MAX_HELD_BYTES = 256 << 20
"""Most payload bytes one source holds while its replay runs."""
MAX_REPLAY_BATCHES = 1_000_000
"""Most batches one replay may return (more are dropped: the replay ends there)."""
MAX_REPLAY_BYTES = 1 << 30
"""Most payload bytes one replay may return."""
MAX_REPLAY_BACKOFF_S = 60.0
"""Longest wait between a source's failed replay and its next one."""
TS_BACKWARDS_TOLERANCE_S = 5.0
"""A batch this much older than the source's last one (by the engine's own ``ts``) means another
engine process now publishes there (a restart): engine clocks step back by less than this."""
RESTART_RUN = 3
"""Consecutive refused batches, numbered one after another, that are taken as a restart whose
numbering jumped (the engine restarted with a counter far from the old one)."""

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
    """Counters and state of one source (monotonic counters; ``last_seq`` -1 before the first batch).

    ``refused_batches``: batches refused for a non-finite or far-future timestamp or an absurd
    sequence jump; ``held_dropped``: live batches dropped because the hold bound was reached
    while a replay ran; ``disconnects``: times the SUB socket lost its publisher; ``inconsistent``:
    a batch was refused and none has been applied in sequence since (``stale`` is then set too);
    ``replaying``: a replay of this source runs or waits for its turn."""

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
    refused_batches: int = 0
    held_dropped: int = 0
    disconnects: int = 0
    dp_rank_mismatches: int = 0
    last_seq: int = -1
    stale: bool = False
    inconsistent: bool = False
    replaying: bool = False
    seconds_since_last_batch: float = -1.0

    def as_dict(self) -> dict[str, float | int | bool]:
        return {k: getattr(self, k) for k in self.__slots__}


@dataclass(slots=True)
class _Replay:
    """One replay request of a source: waiting for a slot (``sock`` None) or running."""

    start_seq: int
    why: str                                  # "start", "gap", "verify", "restart"
    verify: tuple[int, bytes] | None = None   # (seq, payload digest) the replay must agree with
    sock: zmq.Socket | None = None
    deadline_s: float = 0.0
    got: list[tuple[int, bytes]] = field(default_factory=list)
    got_bytes: int = 0


@dataclass(slots=True)
class _Source:
    src: KvEventSource
    translator: KvEventTranslator
    sub: zmq.Socket | None = None
    monitor: zmq.Socket | None = None
    stats: SourceStats = field(default_factory=SourceStats)
    last_seq: int | None = None
    last_ts: float = float("-inf")
    last_digest: bytes | None = None
    last_msg_s: float = 0.0
    time_stale: bool = False
    replay: _Replay | None = None
    held: deque = field(default_factory=deque)  # (seq, payload) live batches held while a replay runs
    held_bytes: int = 0
    backoff_s: float = 0.0
    retry_at_s: float = float("-inf")
    disconnected: bool = False
    refused_run: list = field(default_factory=list)  # (seq, payload) consecutive refused jumps
    removed: bool = False


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class KvEventSubscriber:
    """Consumes the KV events of ``sources`` in a background thread (see the module docstring).

    Args:
        sources: the publishers (:func:`sources_for_worker`).
        block_size: the router's block size (tokens), for the translators.
        deliver: called in the subscriber thread with each poll round's ``[(replica, event)]``.
        stale_after_s: seconds without a batch before a source is marked stale.
        replay_timeout_s: how long one replay may take before it is given up (counted); also the
            first wait before a failed source asks again (doubling up to :data:`MAX_REPLAY_BACKOFF_S`).
        translator_capacity_blocks: engine blocks remembered per replica and tier.
        max_concurrent_replays: replays running at once (the others wait, holding their batches).
        max_seq_jump: a batch numbered more than this past the source's last is refused.
        max_future_s: a batch whose ``ts`` is more than this ahead of ``wall_clock`` is refused.
        context: a ``zmq.Context`` (default: a new one, terminated on stop).
        clock: monotonic seconds (injectable for tests).
        wall_clock: this host's wall-clock seconds (``time.time``), compared with engines' ``ts``.
        ring_writer: the fan-out ring ``deliver`` writes to, when it does
            (:mod:`balancer.service.processes.kv_fanout`: its owner serves the ring's resyncs and closes it
            with this subscriber); ``None``: none.

    Attributes:
        error: what stopped the thread, or ``None``.
        ring_writer: as given.
        writer_stats: always ``None`` (a ring writer of this process reports its own counters; the
            child-process kind sets its child's here).
    """

    def __init__(self, sources: Sequence[KvEventSource], block_size: int, deliver: Deliver, *,
                 stale_after_s: float = 60.0, replay_timeout_s: float = 2.0,
                 translator_capacity_blocks: int = DEFAULT_TRANSLATOR_CAPACITY_BLOCKS,
                 max_concurrent_replays: int = 8, max_seq_jump: int = 10_000_000, max_future_s: float = 300.0,
                 context: zmq.Context | None = None, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, ring_writer: RingWriter | None = None) -> None:
        seen: set[ReplicaId] = set()
        for s in sources:
            if s.replica in seen:
                raise ValueError(f"two KV event sources for {s.replica}")
            seen.add(s.replica)
        if max_concurrent_replays < 1:
            raise ValueError(f"max_concurrent_replays must be >= 1, got {max_concurrent_replays}")
        if max_seq_jump < 1:
            raise ValueError(f"max_seq_jump must be >= 1, got {max_seq_jump}")
        self._block_size = block_size
        self._capacity = translator_capacity_blocks
        self._sources = [_Source(s, KvEventTranslator(block_size, translator_capacity_blocks)) for s in sources]
        self._commands: deque[tuple[str, list]] = deque()  # ("add", sources) / ("remove", replicas)
        self._deliver = deliver
        self.stale_after_s = stale_after_s
        self.replay_timeout_s = replay_timeout_s
        self.max_concurrent_replays = max_concurrent_replays
        self.max_seq_jump = max_seq_jump
        self.max_future_s = max_future_s
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._clock = clock
        self._wall = wall_clock
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the stats copies read by other threads
        self._waiting: deque[_Source] = deque()  # replays waiting for a slot, in order
        self._running: list[_Source] = []        # replays running
        self._poller: zmq.Poller | None = None
        self._by_socket: dict[zmq.Socket, tuple[str, _Source]] = {}
        self.error: BaseException | None = None
        self.ring_writer = ring_writer
        self.writer_stats: dict[str, int] | None = None

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

    def alive(self) -> bool:
        """The thread runs and stopped on no error."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def add_sources(self, sources: Sequence[KvEventSource]) -> None:
        """Subscribe to more publishers (a worker added at run time); thread-safe. Each is caught
        up from its replay buffer as at start, after an ``AllBlocksCleared`` (both media) of its
        replica is delivered: a worker removed and added again with the same URL must not keep
        what its predecessor announced, and that predecessor's events may still be waiting
        downstream (queued for the event loop, or in the fan-out ring for a process that lags or
        reads it from its start, :mod:`balancer.service.processes.kv_fanout`); the clear comes after them in
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
        poller = self._poller = zmq.Poller()
        try:
            for s in self._sources:
                self._connect(s)
            self._started.set()
            # a router that starts after the engines asks each for what its buffer still holds
            for s in self._sources:
                self._initial_catch_up(s)
            while not self._stop.is_set():
                out: list[tuple[ReplicaId, KvEvent]] = []
                while self._commands:
                    self._command(*self._commands.popleft(), out)
                self._start_waiting_replays()
                ready = dict(poller.poll(self._poll_ms()))
                for sock in ready:
                    kind, src = self._by_socket.get(sock, ("", None))
                    if src is None:
                        continue
                    if kind == "sub":
                        self._read_sub(src, sock, out)
                    elif kind == "replay":
                        self._read_replay(src, sock, out)
                    elif kind == "monitor":
                        self._read_monitor(src, sock)
                self._expire_replays(out)
                if out:
                    self._deliver(out)
                self._check_stale()
        except BaseException as e:  # noqa: BLE001 - reported, never silent
            self.error = e
            log.exception("KV event subscriber stopped")
            self._started.set()
        finally:
            for s in self._sources:
                self._close_source(s)

    def _poll_ms(self) -> int:
        """Poll timeout: 100 ms, or less until the next replay deadline or retry."""
        now = self._clock()
        wait = 0.1
        for s in self._running:
            if s.replay is not None:
                wait = min(wait, s.replay.deadline_s - now)
        for s in self._waiting:
            wait = min(wait, max(0.0, s.retry_at_s - now))
        return int(math.ceil(max(0.0, wait) * 1000))

    def _register(self, sock: zmq.Socket, kind: str, s: _Source) -> None:
        assert self._poller is not None
        self._poller.register(sock, zmq.POLLIN)
        self._by_socket[sock] = (kind, s)

    def _unregister(self, sock: zmq.Socket | None) -> None:
        if sock is None:
            return
        if self._poller is not None and sock in self._by_socket:
            self._poller.unregister(sock)
        self._by_socket.pop(sock, None)
        sock.close(0)

    def _connect(self, s: _Source) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, s.src.topic)
        # the publisher's process going away shows as a disconnect: a restart signal (see module docstring)
        s.monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        sub.connect(s.src.endpoint)
        s.sub = sub
        s.last_msg_s = self._clock()
        self._register(sub, "sub", s)
        self._register(s.monitor, "monitor", s)

    def _close_source(self, s: _Source) -> None:
        if s.replay is not None:
            self._unregister(s.replay.sock)
            s.replay = None
        if s.sub is not None:
            try:
                s.sub.disable_monitor()
            except zmq.ZMQError:
                pass
        self._unregister(s.monitor)
        s.monitor = None
        self._unregister(s.sub)
        s.sub = None

    def _initial_catch_up(self, s: _Source) -> None:
        if s.src.replay_endpoint is not None:
            self._ask_replay(s, 0, "start")

    def _command(self, kind: str, items: list, out: list[tuple[ReplicaId, KvEvent]]) -> None:
        if kind == "add":
            have = {s.src.replica for s in self._sources}
            new = [_Source(src, KvEventTranslator(self._block_size, self._capacity))
                   for src in items if src.replica not in have]
            for s in new:
                self._connect(s)
            with self._lock:
                self._sources.extend(new)
            # a view that starts empty, in delivery order: see add_sources
            out.extend((s.src.replica, AllBlocksCleared(m)) for s in new for m in (None, "CPU"))
            for s in new:  # the subscription joins while the replay request travels; live batches are held
                self._initial_catch_up(s)
        else:
            gone = set(items)
            keep = []
            for s in self._sources:
                if s.src.replica in gone:
                    s.removed = True
                    self._close_source(s)
                else:
                    keep.append(s)
            self._running = [s for s in self._running if not s.removed]
            self._waiting = deque(s for s in self._waiting if not s.removed)
            with self._lock:
                self._sources = keep

    def _check_stale(self) -> None:
        now = self._clock()
        for s in self._sources:
            time_stale = now - s.last_msg_s > self.stale_after_s
            if time_stale and not s.time_stale:
                log.warning("KV events of %s: nothing for %.0f s (stale)", s.src.replica, now - s.last_msg_s)
            s.time_stale = time_stale
            self._set_flags(s)

    def _set_flags(self, s: _Source) -> None:
        stale = s.time_stale or s.stats.inconsistent
        replaying = s.replay is not None
        if stale != s.stats.stale or replaying != s.stats.replaying:
            with self._lock:
                s.stats.stale = stale
                s.stats.replaying = replaying

    def _count(self, s: _Source, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(s.stats, name, getattr(s.stats, name) + n)

    # ------------------------------------------------------------------ live messages
    def _read_sub(self, s: _Source, sock: zmq.Socket, out: list[tuple[ReplicaId, KvEvent]]) -> None:
        for _ in range(1000):  # bounded per round: other sources get their turn
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            s.last_msg_s = self._clock()
            if len(frames) != 3:
                self._count(s, "decode_errors")
                log.warning("KV events of %s: a message of %d frames (expected topic, seq, payload)",
                            s.src.replica, len(frames))
                continue
            try:
                seq = decode_seq(frames[1])
            except KvWireError as e:
                self._count(s, "decode_errors")
                log.warning("KV events of %s: undecodable sequence number: %s", s.src.replica, e)
                continue
            if s.replay is not None:
                self._hold(s, seq, frames[2])
            else:
                self._on_batch(s, seq, frames[2], out)

    def _read_monitor(self, s: _Source, sock: zmq.Socket) -> None:
        from zmq.utils.monitor import recv_monitor_message

        for _ in range(100):
            try:
                msg = recv_monitor_message(sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            except (zmq.ZMQError, ValueError):
                return
            if msg.get("event") == zmq.EVENT_DISCONNECTED:
                self._count(s, "disconnects")
                if s.last_seq is not None:
                    s.disconnected = True
                    log.info("KV events of %s: publisher disconnected; the next batch is checked for a restart",
                             s.src.replica)
            elif msg.get("event") == zmq.EVENT_CONNECTED and s.disconnected and s.replay is None \
                    and s.src.replay_endpoint is not None and s.last_seq is not None and s.last_digest is not None:
                # connected again: check now, not at the next batch, whether the engine behind the
                # port still has the last batch applied (a restarted engine's first batches may
                # have gone out before this socket reconnected, and it may publish nothing more)
                s.disconnected = False
                self._ask_replay(s, s.last_seq, "verify", verify=(s.last_seq, s.last_digest))

    def _hold(self, s: _Source, seq: int, payload: bytes) -> None:
        s.held.append((seq, payload))
        s.held_bytes += len(payload)
        while len(s.held) > MAX_HELD_BATCHES or s.held_bytes > MAX_HELD_BYTES:
            _, p = s.held.popleft()
            s.held_bytes -= len(p)
            self._count(s, "held_dropped")

    def _on_batch(self, s: _Source, seq: int, payload: bytes, out: list[tuple[ReplicaId, KvEvent]],
                  replay_ok: bool = True) -> None:
        """One live batch of ``s`` (no replay of ``s`` running). ``replay_ok`` False: a gap is
        counted as unrecovered instead of asking for a replay (batches held during a replay that
        just ended, which that replay could not have held)."""
        has_replay = s.src.replay_endpoint is not None
        if s.last_seq is not None and seq > s.last_seq + self.max_seq_jump:
            self._refuse_jump(s, seq, payload, out)
            return
        s.refused_run.clear()
        try:
            batch = decode_batch(payload)
        except KvWireError as e:
            self._count(s, "decode_errors")
            log.warning("KV events of %s: undecodable batch %d (its number is taken as seen): %s",
                        s.src.replica, seq, e)
            if s.last_seq is None or seq > s.last_seq:
                self._take_seq(s, seq, None)
            return
        if not self._ts_ok(s, seq, batch):
            if s.last_seq is None or seq > s.last_seq:
                self._take_seq(s, seq, None)
            return
        if s.last_seq is None:
            if seq > 0 and has_replay and replay_ok and not s.stats.replays:
                self._ask_replay(s, 0, "start", held=(seq, payload))
                return
            self._apply(s, seq, payload, batch, out)
            return
        if seq <= s.last_seq:
            if batch.ts > s.last_ts:  # the counter started again: the engine restarted
                self._restart(s, f"sequence reset {s.last_seq} -> {seq}", seq, payload, batch, out, replay_ok)
            else:
                self._count(s, "duplicates")
            return
        if batch.ts < s.last_ts - TS_BACKWARDS_TOLERANCE_S:
            self._restart(s, f"timestamp went back {s.last_ts - batch.ts:.1f} s", seq, payload, batch, out, replay_ok)
            return
        if s.disconnected:
            s.disconnected = False
            if has_replay and replay_ok:  # ask for the last applied batch: does the engine still have it?
                self._ask_replay(s, s.last_seq, "verify", held=(seq, payload), verify=(s.last_seq, s.last_digest))
                return
            if seq != s.last_seq + 1:
                self._restart(s, f"reconnected at seq {seq} after {s.last_seq}", seq, payload, batch, out, replay_ok)
                return
        if seq > s.last_seq + 1:
            self._count(s, "gaps")
            if has_replay and replay_ok and self._clock() >= s.retry_at_s:
                log.info("KV events of %s: gap %d -> %d, asking for replay", s.src.replica, s.last_seq, seq)
                self._ask_replay(s, s.last_seq, "gap", held=(seq, payload),
                                 verify=(s.last_seq, s.last_digest) if s.last_digest is not None else None)
                return
            self._count(s, "gaps_unrecovered")
            log.warning("KV events of %s: batches %d..%d lost (%s)", s.src.replica, s.last_seq + 1, seq - 1,
                        "no replay endpoint" if not has_replay else "replay not available now")
        self._apply(s, seq, payload, batch, out)

    def _ts_ok(self, s: _Source, seq: int, batch: EngineBatch) -> bool:
        ts = batch.ts
        why = None
        if not math.isfinite(ts):
            why = f"timestamp {ts}"
        elif ts > self._wall() + self.max_future_s:
            why = f"timestamp {ts - self._wall():.0f} s in the future"
        if why is None:
            return True
        self._refused(s, f"batch {seq} refused: {why}")
        return False

    def _refused(self, s: _Source, what: str) -> None:
        with self._lock:
            s.stats.refused_batches += 1
            first = not s.stats.inconsistent
            s.stats.inconsistent = True
        (log.warning if first else log.info)("KV events of %s: %s; marked inconsistent until a batch is applied "
                                             "in sequence", s.src.replica, what)
        self._set_flags(s)

    def _refuse_jump(self, s: _Source, seq: int, payload: bytes, out: list[tuple[ReplicaId, KvEvent]]) -> None:
        assert s.last_seq is not None
        run = s.refused_run
        if run and seq != run[-1][0] + 1:
            run.clear()
        run.append((seq, payload))
        self._refused(s, f"batch {seq} refused: {seq - s.last_seq} past the last ({s.last_seq}; "
                         f"limit {self.max_seq_jump})")
        if len(run) >= RESTART_RUN:  # a consistent new numbering: the engine restarted far away
            first_seq = run[0][0]
            pending = list(run)
            run.clear()
            self._clear_view(s, f"{RESTART_RUN} consecutive batches from seq {first_seq} on", out)
            if s.src.replay_endpoint is not None:
                self._ask_replay(s, 0, "restart")
                for q, p in pending:
                    self._hold(s, q, p)
                return
            for q, p in pending:
                self._on_batch(s, q, p, out, replay_ok=False)

    def _take_seq(self, s: _Source, seq: int, digest: bytes | None) -> None:
        s.last_seq = seq
        s.last_digest = digest
        with self._lock:
            s.stats.last_seq = seq

    def _clear_view(self, s: _Source, why: str, out: list[tuple[ReplicaId, KvEvent]]) -> None:
        """The engine behind ``s`` restarted: clear the replica's HBM and host views (delivered
        before any later event of it) and forget every engine block and sequence number."""
        log.warning("KV events of %s: engine restarted (%s): clearing its cache view", s.src.replica, why)
        self._count(s, "restarts")
        s.translator.reset()
        out.append((s.src.replica, AllBlocksCleared(None)))
        out.append((s.src.replica, AllBlocksCleared("CPU")))
        s.last_seq = None
        s.last_ts = float("-inf")
        s.last_digest = None
        s.disconnected = False

    def _restart(self, s: _Source, why: str, seq: int, payload: bytes, batch: EngineBatch,
                 out: list[tuple[ReplicaId, KvEvent]], replay_ok: bool) -> None:
        self._clear_view(s, why, out)
        if seq > 0 and s.src.replay_endpoint is not None and replay_ok:
            self._ask_replay(s, 0, "restart", held=(seq, payload))
            return
        self._apply(s, seq, payload, batch, out)

    def _apply(self, s: _Source, seq: int, payload: bytes, batch: EngineBatch,
               out: list[tuple[ReplicaId, KvEvent]]) -> None:
        st = s.stats
        rep = s.src.replica
        n = 0
        errors = 0
        in_sequence = s.last_seq is None or seq == s.last_seq + 1
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
            if in_sequence and st.inconsistent:
                st.inconsistent = False
                log.info("KV events of %s: consistent again at seq %d", rep, seq)
        s.last_seq = seq
        s.last_digest = _digest(payload)
        s.last_ts = max(s.last_ts, batch.ts)
        self._set_flags(s)

    # ------------------------------------------------------------------ replays
    def _ask_replay(self, s: _Source, start_seq: int, why: str, held: tuple[int, bytes] | None = None,
                    verify: tuple[int, bytes | None] | None = None) -> None:
        """Queue a replay of ``s`` from ``start_seq``; ``held``: the live batch that asked for it
        (held with the ones that come meanwhile)."""
        if s.replay is not None:  # one at a time per source: the running one answers this too
            if held is not None:
                self._hold(s, *held)
            return
        v = verify if verify is not None and verify[1] is not None else None
        s.replay = _Replay(start_seq, why, v)  # type: ignore[arg-type]
        if held is not None:
            self._hold(s, *held)
        self._waiting.append(s)
        self._set_flags(s)

    def _start_waiting_replays(self) -> None:
        now = self._clock()
        for _ in range(len(self._waiting)):
            if len(self._running) >= self.max_concurrent_replays:
                return
            s = self._waiting.popleft()
            if s.removed or s.replay is None:
                continue
            if now < s.retry_at_s:
                self._waiting.append(s)  # backing off after a failure: later
                continue
            r = s.replay
            assert s.src.replay_endpoint is not None
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(s.src.replay_endpoint)
            r.sock = sock
            try:
                sock.send_multipart([b"", encode_seq(r.start_seq)], zmq.NOBLOCK)
            except zmq.Again:  # nothing to send to: times out like a replay that never answers
                pass
            r.deadline_s = now + self.replay_timeout_s
            self._register(sock, "replay", s)
            self._running.append(s)
            self._count(s, "replays")

    def _read_replay(self, s: _Source, sock: zmq.Socket, out: list[tuple[ReplicaId, KvEvent]]) -> None:
        r = s.replay
        if r is None or r.sock is not sock:
            return
        for _ in range(10_000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # engines: [b"", topic, seq, payload]; older publishers: [b"", seq, payload]
            if len(frames) == 4 and frames[0] == b"":
                seq_frame, payload = frames[2], frames[3]
            elif len(frames) == 3 and frames[0] == b"":
                seq_frame, payload = frames[1], frames[2]
            else:
                continue
            try:
                seq = decode_seq(seq_frame)
            except KvWireError:
                continue
            if seq == END_OF_REPLAY:
                self._finish_replay(s, True, out)
                return
            r.got.append((seq, payload))
            r.got_bytes += len(payload)
            if len(r.got) >= MAX_REPLAY_BATCHES or r.got_bytes >= MAX_REPLAY_BYTES:
                log.warning("KV events of %s: replay cut at %d batches (%d bytes)", s.src.replica, len(r.got),
                            r.got_bytes)
                self._finish_replay(s, True, out)
                return

    def _expire_replays(self, out: list[tuple[ReplicaId, KvEvent]]) -> None:
        now = self._clock()
        for s in list(self._running):
            if s.replay is not None and now >= s.replay.deadline_s:
                self._count(s, "replay_failures")
                s.backoff_s = min(MAX_REPLAY_BACKOFF_S, max(self.replay_timeout_s, 2 * s.backoff_s))
                s.retry_at_s = now + s.backoff_s
                log.warning("KV events of %s: replay from %d timed out after %.1f s; next replay not before "
                            "%.1f s from now", s.src.replica, s.replay.start_seq, self.replay_timeout_s, s.backoff_s)
                self._finish_replay(s, False, out)

    def _finish_replay(self, s: _Source, ok: bool, out: list[tuple[ReplicaId, KvEvent]]) -> None:
        """The replay of ``s`` ended (``ok``) or timed out: apply what it returned, then what was
        held, in sequence order."""
        r = s.replay
        assert r is not None
        self._unregister(r.sock)
        if s in self._running:
            self._running.remove(s)
        s.replay = None
        if ok:
            s.backoff_s = 0.0
            s.retry_at_s = float("-inf")
        got = r.got if ok else []
        if ok and r.verify is not None:
            vseq, vdigest = r.verify
            theirs = next((_digest(p) for q, p in got if q == vseq), None)
            # the engine's batch `vseq` is not the one applied: a new engine, numbering overtaken;
            # or it has nothing numbered `vseq` or later, which the engine that published `vseq`
            # still would (its buffer keeps the newest batches): a new engine numbering below it
            if (theirs is not None and theirs != vdigest) or not got:
                self._clear_view(s, f"its replayed batch {vseq} differs from the one applied" if got else
                                 f"its replay holds nothing from batch {vseq} on", out)
                self._ask_replay(s, 0, "restart")
                self._set_flags(s)
                return  # the held batches stay held for that replay
        # replayed batches newer than the view, in order; a hole the buffer does not cover stays
        for seq, payload in got:
            if s.last_seq is not None and seq <= s.last_seq:
                continue
            if s.last_seq is not None and seq > s.last_seq + 1:
                break
            self._apply_replayed(s, seq, payload, out)
        # then the held live batches, each as if it came now. A gap the replay could not cover
        # (its batches were published after the engine answered it) asks for one more replay; a
        # gap inside what it returned is the engine's buffer's hole and is counted as lost.
        covered = max((q for q, _ in got), default=r.start_seq - 1)
        held = sorted(s.held, key=lambda x: x[0])
        s.held.clear()
        s.held_bytes = 0
        for i, (seq, payload) in enumerate(held):
            if s.replay is not None:  # a restart inside asked for a new replay: hold the rest
                for q, p in held[i:]:
                    self._hold(s, q, p)
                break
            beyond = ok and s.last_seq is not None and s.last_seq >= covered
            self._on_batch(s, seq, payload, out, replay_ok=beyond)
        self._set_flags(s)

    def _apply_replayed(self, s: _Source, seq: int, payload: bytes, out: list[tuple[ReplicaId, KvEvent]]) -> None:
        try:
            batch = decode_batch(payload)
        except KvWireError as e:
            self._count(s, "decode_errors")
            log.warning("KV events of %s: undecodable replayed batch %d: %s", s.src.replica, seq, e)
            self._take_seq(s, seq, None)
            return
        if not self._ts_ok(s, seq, batch):
            self._take_seq(s, seq, None)
            return
        self._apply(s, seq, payload, batch, out)


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
    translated events to that fan-out ring (:class:`balancer.service.processes.kv_ring.RingWriter`, created
    with ``ring_bytes`` of capacity, or taken over) and nothing but counters crosses the pipe
    (``pdlb serve --processes N``: every router process reads the ring, :mod:`balancer.service.processes.kv_fanout`).
    """

    def __init__(self, sources: Sequence[KvEventSource], block_size: int, deliver: Deliver | None, *,
                 stale_after_s: float = 60.0, replay_timeout_s: float = 2.0,
                 translator_capacity_blocks: int = DEFAULT_TRANSLATOR_CAPACITY_BLOCKS,
                 stats_interval_s: float = 0.5, ring_path: str | None = None, ring_bytes: int | None = None,
                 max_concurrent_replays: int = 8) -> None:
        if (deliver is None) == (ring_path is None):
            raise ValueError("give either deliver or ring_path")
        self._args = (list(sources), block_size, stale_after_s, replay_timeout_s, translator_capacity_blocks,
                      stats_interval_s, ring_path, ring_bytes, max_concurrent_replays)
        self._deliver = deliver
        self._stats: dict[ReplicaId, dict[str, float | int | bool]] = {}
        #: with ``ring_path``: the child's ring writer counters (:meth:`RingWriter.stats`), at most
        #: ``stats_interval_s`` old; ``None`` until the first report
        self.writer_stats: dict[str, int] | None = None
        #: always ``None``: the ring writer lives in the child (as :class:`KvEventSubscriber`'s)
        self.ring_writer: RingWriter | None = None
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
        self._proc = ctx.Process(target=_subscriber_child, args=(*self._args, send, self._stop_r, _log_setup()),
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


def _log_setup() -> tuple[int, str | None]:
    """This process's ``pdlb.kv_events`` level and root handler format, for a spawned child (which
    starts with no logging configured: its lines would come out bare and its INFO lines not at all)."""
    root = logging.getLogger()
    fmt = next((h.formatter._fmt for h in root.handlers if h.formatter is not None), None)  # noqa: SLF001
    return log.getEffectiveLevel(), fmt


def _subscriber_child(sources, block_size, stale_after_s, replay_timeout_s, capacity, stats_interval_s,  # noqa: ANN001
                      ring_path, ring_bytes, max_concurrent_replays, conn, stop_conn,  # noqa: ANN001
                      log_setup: tuple[int, str | None] | None = None) -> None:
    """Entry point of :class:`KvEventSubscriberProcess`'s child (``log_setup``: :func:`_log_setup`
    of the parent, applied here so the child logs as the router does)."""
    if log_setup is not None and not logging.getLogger().handlers:
        level, fmt = log_setup
        logging.basicConfig(level=level, format=fmt or logging.BASIC_FORMAT)
    send_lock = threading.Lock()

    def send(kind: str, payload) -> None:  # noqa: ANN001
        with send_lock:
            conn.send((kind, payload))

    writer = None
    try:
        deliver: Deliver
        if ring_path is not None:
            writer = RingWriter(ring_path, ring_bytes or RING_BYTES)
            if writer.resumed:  # a subscriber before this one wrote here: what it announced is unknown now
                writer.write([(s.replica, AllBlocksCleared(m)) for s in sources for m in (None, "CPU")])
            deliver = writer.write
        else:
            def deliver(items: list[tuple[ReplicaId, KvEvent]]) -> None:
                send("events", items)
        sub = KvEventSubscriber(sources, block_size, deliver, stale_after_s=stale_after_s,
                                replay_timeout_s=replay_timeout_s, translator_capacity_blocks=capacity,
                                max_concurrent_replays=max_concurrent_replays)
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


SUPERVISE_INTERVAL_S = 1.0
"""Seconds between the router's checks that its KV event subscriber (thread or child process) still runs."""


class SupervisedSubscriber:
    """The KV event subscriber of ``pdlb serve`` with one router process (``--processes 1``; with
    several, :class:`balancer.service.processes.kv_fanout.KvFanout` does the same in process 0): a
    :class:`KvEventSubscriberProcess` (or :class:`KvEventSubscriber` thread) that is checked every
    :data:`SUPERVISE_INTERVAL_S` and, when it died (its child killed, an exception in its thread),
    logged at ERROR, counted (``restarts``; ``pdlb_kv_events_subscriber_restarts_total``) and
    started again: first an ``AllBlocksCleared`` (HBM and host) of each of its replicas is
    delivered (the new subscriber's translators know none of the engine blocks announced
    before, so their removals would go unseen), then each source is caught up from its engine's
    replay buffer, as at start. Recovery: the check interval plus the child's start (about 1 s)
    plus one replay round trip. Its state is in ``/health`` (``kv_events``) and in
    ``pdlb_kv_events_subscriber_up``. Same interface as the subscriber it wraps.

    Args:
        make: builds a new, unstarted subscriber for a list of sources.
        sources: the sources to start with (workers added later come through :meth:`add_sources`).
        deliver: where cleared views are delivered on a restart (the subscriber's own ``deliver``).
    """

    def __init__(self, make: Callable[[list[KvEventSource]], Any], sources: Sequence[KvEventSource],
                 deliver: Deliver) -> None:
        self._make = make
        self._sources = list(sources)
        self._deliver = deliver
        self.subscriber: Any = None
        self.restarts = 0
        self.last_error: str | None = None
        self.state = "starting"
        self._task: asyncio.Task | None = None
        self._stopped = False

    def start(self) -> None:
        """Start the subscriber (blocking: a child process takes about a second)."""
        sub = self._make(list(self._sources))
        sub.start()
        self.subscriber = sub
        self.state = "running"

    def alive(self) -> bool:
        sub = self.subscriber
        return sub is not None and sub.alive()

    @property
    def error(self) -> BaseException | str | None:
        return None if self.subscriber is None else self.subscriber.error

    def supervise(self) -> None:
        """In the event loop: check the subscriber every :data:`SUPERVISE_INTERVAL_S`."""
        self._task = asyncio.get_running_loop().create_task(self._supervise())

    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopped:
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
            if self._stopped or self.alive():
                continue
            old = self.subscriber
            why = (old.error or "it exited") if old is not None else "not running"
            self.restarts += 1
            self.last_error = str(why)
            self.state = "restarting"
            log.error("KV event subscriber died (%s); starting it again (restart %d): its replicas' views are "
                      "cleared and caught up from the engines' replay buffers", why, self.restarts)
            try:
                await loop.run_in_executor(None, self._restart, old)
                log.warning("KV event subscriber running again (restart %d)", self.restarts)
            except Exception:  # noqa: BLE001 - retried at the next check
                self.state = "dead"
                log.exception("KV event subscriber could not be started again; retrying in %.0f s",
                              SUPERVISE_INTERVAL_S)

    def _restart(self, old: Any) -> None:
        if old is not None:
            try:
                old.stop(1.0)
            except Exception:  # noqa: BLE001 - the old one is gone either way
                pass
        self.subscriber = None
        self._deliver([(s.replica, AllBlocksCleared(m)) for s in self._sources for m in (None, "CPU")])
        self.start()

    def add_sources(self, sources: Sequence[KvEventSource]) -> None:
        """See :meth:`KvEventSubscriber.add_sources` (kept for a restart too)."""
        have = {s.replica for s in self._sources}
        self._sources += [s for s in sources if s.replica not in have]
        if self.subscriber is not None:
            self.subscriber.add_sources(sources)

    def remove_replicas(self, replicas: Sequence[ReplicaId]) -> None:
        """See :meth:`KvEventSubscriber.remove_replicas`."""
        gone = set(replicas)
        self._sources = [s for s in self._sources if s.replica not in gone]
        if self.subscriber is not None:
            self.subscriber.remove_replicas(replicas)

    def stats(self) -> dict[ReplicaId, dict[str, float | int | bool]]:
        """The running subscriber's counters (see :meth:`KvEventSubscriber.stats`; a restarted
        subscriber counts from 0 again)."""
        sub = self.subscriber
        return {} if sub is None else sub.stats()

    def health(self) -> dict[str, Any]:
        """``{"subscriber": "running" | "restarting" | "dead", "restarts", "last_error",
        "stale": [replicas marked stale or inconsistent], "replaying": [...]}`` for ``/health``."""
        state = self.state if self.state != "running" or self.alive() else "dead"
        st = self.stats()
        return {"subscriber": state, "restarts": self.restarts, "last_error": self.last_error,
                "stale": sorted(str(r) for r, d in st.items() if d.get("stale")),
                "replaying": sorted(str(r) for r, d in st.items() if d.get("replaying"))}

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop supervising and the subscriber (idempotent; call from a thread, not the loop)."""
        self._stopped = True
        if self._task is not None:
            self._task.get_loop().call_soon_threadsafe(self._task.cancel)
        sub, self.subscriber = self.subscriber, None
        if sub is not None:
            sub.stop(timeout_s)


def start_for_service(workers, router, block_size: int, loop: asyncio.AbstractEventLoop,  # noqa: ANN001
                      settings) -> tuple[SupervisedSubscriber, LoopDelivery] | None:  # noqa: ANN001
    """The running, supervised subscriber of every worker config in ``workers`` with an ``events``
    endpoint, applying into ``router`` on ``loop`` (``settings``: a ``KvEventsConfig``;
    ``settings.runner`` ``"process"`` or ``"thread"``); ``None`` if no worker has one. Call
    ``.supervise()`` on it in the event loop."""
    sources = [s for w in workers if w.events for s in sources_for_worker(w.url, w.dp_size, w.events, w.replay)]
    if not sources:
        return None
    delivery = LoopDelivery(loop, router.on_kv_event)
    kw: dict[str, Any] = dict(stale_after_s=settings.stale_after_s, replay_timeout_s=settings.replay_timeout_s,
                              translator_capacity_blocks=settings.translator_capacity_blocks,
                              max_concurrent_replays=settings.max_concurrent_replays)

    def make(srcs: list[KvEventSource]) -> KvEventSubscriber | KvEventSubscriberProcess:
        if settings.runner == "process":
            return KvEventSubscriberProcess(srcs, block_size, delivery, **kw)
        return KvEventSubscriber(srcs, block_size, delivery, **kw)

    sup = SupervisedSubscriber(make, sources, delivery)
    sup.start()
    return sup, delivery
