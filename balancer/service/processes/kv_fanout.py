"""One KV-event subscriber per ``pdlb serve --processes N``, its translated events fanned out to every process.

With several router processes each one needs every engine's KV events (their prefix views must
agree), but decoding an engine batch and re-hashing its blocks' ``token_ids`` is the expensive
part (1-3 ms for a 32k-token ``BlockStored``) and its result is the same in every process. So
router process 0 runs the one :class:`~balancer.service.kv_subscriber.KvEventSubscriberProcess`
(a child process: sequence tracking, gap replay, restarts, staleness and hash translation, as with
one process), which appends the translated pdlb events, a few bytes per router block, to a ring
buffer in a memory-mapped file (on ``/dev/shm``, in the directory ``pdlb serve`` makes for the
processes' shared state); every router process, the first included, reads the ring in its event
loop (:class:`FanoutFollower`) and applies the events to its router. Nothing is sent and nobody is
woken: a follower looks at the ring's head every :data:`POLL_INTERVAL_S` (a few microseconds when
nothing is new), as :mod:`balancer.service.processes.shared_prefix` does for approximate decisions.

The ring's format, how a reader that fell behind catches up (**resync**) and its bounds are
:mod:`balancer.service.processes.kv_ring`'s.

**Failures.** Process 0 checks its subscriber every :data:`SUPERVISE_INTERVAL_S`; one that died is
started again (logged, ``subscriber_restarts``), takes the ring over where it ends, first writes
``AllBlocksCleared`` for each of its replicas (the new subscriber's translator knows none of the
engine blocks announced before, so their removals would go unseen) and then catches up from each
engine's replay buffer, as at start. A router process that dies is started again by the parent
(:mod:`balancer.service.processes.supervise`): its follower reads the ring from the start, or, if the ring
wrapped since, is lapped at its first look and resyncs. Process 0's replacement also starts a
new subscriber, which waits for the ring's writer lock until the dead process's subscriber child
(which exits once it sees its parent gone) lets go. A follower that is slower than the others
only lags (``pdlb_kv_events_fanout_lag_bytes``) until it is lapped (see above).

**Metrics.** The subscriber's ``pdlb_kv_events_*`` counters (batches, events, gaps, replays,
restarts, decode errors, stale, last seq, translator) count each engine batch once: they are
exported by process 0 only (``process="0"``). Each process exports its own fan-out counters
(``pdlb_kv_events_fanout_applied_total`` pdlb events applied to its index,
``..._records_total``, ``..._lost_records_total``, ``..._corrupt_records_total``,
``..._laps_total``, ``..._resyncs_total``, ``..._snapshot_records_total`` and the gauge
``..._lag_bytes``) with its ``process`` label (:mod:`balancer.service.kv_metrics`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from balancer.kv_events import AllBlocksCleared, KvEvent
from balancer.service.kv_metrics import STATS_FILE_PREFIX
from balancer.service.processes.kv_ring import RING_BYTES, RingReader, RingWriter, fanout_ring_path
from balancer.service.kv_subscriber import KvEventSubscriber, KvEventSubscriberProcess, sources_for_worker
from balancer.types import ReplicaId

__all__ = ["FanoutFollower", "KvFanout", "start_fanout"]

log = logging.getLogger("pdlb.kv_events")

POLL_INTERVAL_S = 0.005
"""Seconds between a follower's looks at the ring when nothing was waiting."""
SUPERVISE_INTERVAL_S = 1.0
"""Seconds between process 0's checks that its subscriber still runs."""


# ---------------------------------------------------------------------- per process
class FanoutFollower:
    """A router process's reader of the ring, in its event loop: applies the events with
    ``apply(replica, event)`` (``Router.on_kv_event``), at most ``READ_BYTES_PER_PASS`` per
    callback, every :data:`POLL_INTERVAL_S` (at once again while more is waiting).

    ``pending``: bytes written and not yet applied here (the ``queued`` / lag metric).
    """

    def __init__(self, path: str, apply: Callable[[ReplicaId, KvEvent], None],
                 poll_interval_s: float = POLL_INTERVAL_S, index: int | None = None) -> None:
        self.reader = RingReader(path, index=index)
        self._apply = apply
        self.poll_interval_s = poll_interval_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.applied = 0
        self.errors = 0
        self._closed = False

    @property
    def pending(self) -> int:
        return self.reader.lag_bytes()

    def start(self) -> None:
        """Begin following (call in the event loop)."""
        self._loop = asyncio.get_running_loop()
        self._tick()

    def drain(self) -> int:
        """Apply what is waiting (one pass); returns the events applied."""
        items, more = self.reader.poll()
        apply = self._apply
        for rep, ev in items:
            try:
                apply(rep, ev)
                self.applied += 1
            except (ValueError, TypeError) as e:
                self.errors += 1
                log.warning("KV event for %s not applied: %s", rep, e)
        self._more = more
        return len(items)

    def _tick(self) -> None:
        if self._closed:
            self.reader.close()
            return
        self._more = False
        try:
            self.drain()
        except Exception:  # noqa: BLE001 - the follower must not die
            log.exception("KV fan-out: reading the ring failed")
        assert self._loop is not None
        if self._more:
            self._timer = None
            self._loop.call_soon(self._tick)
        else:
            self._timer = self._loop.call_later(self.poll_interval_s, self._tick)

    def stats(self) -> dict[str, int]:
        r = self.reader
        return {"applied": self.applied, "apply_errors": self.errors, "records": r.records,
                "lost_records": r.lost_records, "lost_bytes": r.lost_bytes, "corrupt_records": r.corrupt_records,
                "laps": r.laps, "resyncs": r.resyncs, "snapshot_records": r.snapshot_records,
                "lag_bytes": r.lag_bytes()}

    def close(self) -> None:
        """Stop following (in the event loop's thread; from another thread the next tick closes)."""
        self._closed = True
        loop = self._loop
        if loop is None or _in_thread_of(loop):
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self.reader.close()


def _in_thread_of(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class KvFanout:
    """What a router process holds under ``pdlb serve --processes N`` with KV events (assigned to
    ``Service.kv_subscriber``): its :class:`FanoutFollower`, and in process 0 (``owner``) the one
    subscriber writing the ring, supervised (restarted if it dies). Same control interface as a
    subscriber: ``add_sources``, ``remove_replicas``, ``stats``, ``stop``; in the other processes
    the first two only keep the list (the owner acts on them).

    Args:
        path: the ring file (:func:`fanout_ring_path`).
        apply: ``Router.on_kv_event`` of this process.
        owner: run the subscriber (process 0).
        sources, block_size, settings: the subscriber's (a ``KvEventsConfig``), owner only.
        ring_bytes: capacity of the ring the owner creates.
        index: this router process's number (its resync slot; ``None``: it cannot ask for one).
    """

    def __init__(self, path: str, apply: Callable[[ReplicaId, KvEvent], None], owner: bool,
                 sources: Sequence[Any] = (), block_size: int = 64, settings: Any = None,
                 ring_bytes: int = RING_BYTES, index: int | None = None) -> None:
        self.path = path
        self.owner = owner
        self.follower = FanoutFollower(path, apply, index=index)
        self._sources = list(sources)
        self._block_size = block_size
        self._settings = settings
        self._ring_bytes = ring_bytes
        self.subscriber: KvEventSubscriber | KvEventSubscriberProcess | None = None
        self.subscriber_restarts = 0
        self._supervisor: asyncio.Task | None = None
        self._stopped = False

    # ------------------------------------------------------------------ owner side
    def _make_subscriber(self) -> Any:
        s = self._settings
        kw: dict[str, Any] = dict(stale_after_s=s.stale_after_s, replay_timeout_s=s.replay_timeout_s,
                                  translator_capacity_blocks=s.translator_capacity_blocks,
                                  max_concurrent_replays=s.max_concurrent_replays)
        if s.runner == "process":
            return KvEventSubscriberProcess(self._sources, self._block_size, None, ring_path=self.path,
                                            ring_bytes=self._ring_bytes, **kw)
        writer = RingWriter(self.path, self._ring_bytes)
        if writer.resumed:
            writer.write([(src.replica, AllBlocksCleared(m)) for src in self._sources for m in (None, "CPU")])
        return KvEventSubscriber(self._sources, self._block_size, writer.write, ring_writer=writer, **kw)

    def start_subscriber(self) -> None:
        """Owner: start the subscriber (blocking: a child process takes about a second)."""
        sub = self._make_subscriber()
        sub.start()
        self.subscriber = sub

    def supervise(self) -> None:
        """Owner, in the event loop: check the subscriber every :data:`SUPERVISE_INTERVAL_S`."""
        self._supervisor = asyncio.create_task(self._supervise())

    def subscriber_alive(self) -> bool:
        sub = self.subscriber
        return sub is not None and sub.alive()

    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopped:
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
            sub = self.subscriber
            if sub is not None and sub.ring_writer is not None:
                sub.ring_writer.serve_resyncs()  # the thread runner's writer; a child process serves its own
            if self._stopped or self.subscriber_alive():
                continue
            old = self.subscriber
            log.error("KV event subscriber died (%s); starting it again: its replicas are cleared and caught "
                      "up from the engines' replay buffers", (old.error if old is not None else None) or "exited")
            self.subscriber_restarts += 1
            try:
                await loop.run_in_executor(None, self._restart, old)
            except Exception:  # noqa: BLE001 - retried at the next check
                log.exception("KV event subscriber could not be started again")

    def _restart(self, old: Any) -> None:
        try:
            old.stop(1.0)
            if old.ring_writer is not None:
                old.ring_writer.close()
        except Exception:  # noqa: BLE001 - the old one is gone either way
            pass
        self.subscriber = None
        self.start_subscriber()

    # ------------------------------------------------------------------ both
    def add_sources(self, sources: Sequence[Any]) -> None:
        have = {s.replica for s in self._sources}
        self._sources += [s for s in sources if s.replica not in have]
        if self.owner and self.subscriber is not None:
            self.subscriber.add_sources(sources)

    def remove_replicas(self, replicas: Sequence[ReplicaId]) -> None:
        gone = set(replicas)
        self._sources = [s for s in self._sources if s.replica not in gone]
        if self.owner and self.subscriber is not None:
            self.subscriber.remove_replicas(replicas)

    def stats(self) -> dict[ReplicaId, dict[str, float | int | bool]]:
        """The subscriber's per-replica counters (owner; empty in the other processes)."""
        if not self.owner or self.subscriber is None:
            return {}
        return self.subscriber.stats()

    def fanout_stats(self) -> dict[str, int]:
        """This process's follower counters (and, owner, the subscriber restarts and the ring
        writer's counters, :meth:`RingWriter.stats`)."""
        out = self.follower.stats()
        if self.owner:
            out["subscriber_restarts"] = self.subscriber_restarts
            out["subscriber_up"] = int(self.subscriber_alive())
            sub = self.subscriber
            w = None
            if sub is not None:  # the subscriber in a thread of this process, or its child's counters
                w = sub.ring_writer.stats() if sub.ring_writer is not None else sub.writer_stats
            if w:
                out.update(w)
        return out

    def health(self) -> dict[str, Any]:
        """``/health``'s ``kv_events``: process 0 the state of its subscriber (as
        :meth:`balancer.service.kv_subscriber.SupervisedSubscriber.health`); the other processes
        only read the ring (``"subscriber": "process 0"``)."""
        if not self.owner:  # process 0's state, from the stats file it rewrites every second
            return {"subscriber": "process 0", **_owner_health()}
        alive = self.subscriber_alive()
        st = self.stats() if self.subscriber is not None else {}
        return {"subscriber": "running" if alive else ("restarting" if not self._stopped else "stopped"),
                "restarts": self.subscriber_restarts,
                "stale": sorted(str(r) for r, d in st.items() if d.get("stale")),
                "replaying": sorted(str(r) for r, d in st.items() if d.get("replaying"))}

    @property
    def pending(self) -> int:
        return self.follower.pending

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the subscriber (owner) and the follower (idempotent; call from a thread, not the loop)."""
        self._stopped = True
        if self._supervisor is not None:
            self._supervisor.get_loop().call_soon_threadsafe(self._supervisor.cancel)
        self.follower.close()
        sub, self.subscriber = self.subscriber, None
        if sub is not None:
            sub.stop(timeout_s)
            if sub.ring_writer is not None:
                sub.ring_writer.close()


def _owner_health() -> dict[str, Any]:
    """What process 0 last wrote about its subscriber (``write_stats_file`` in
    ``$PROMETHEUS_MULTIPROC_DIR``): ``{"up": bool, "restarts": n}``, empty if not readable."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory:
        return {}
    try:
        with open(os.path.join(directory, f"{STATS_FILE_PREFIX}0.json")) as f:
            fan = json.load(f).get("fanout") or {}
        return {"up": bool(fan["subscriber_up"]), "restarts": int(fan["subscriber_restarts"])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def start_fanout(workers: Sequence[Any], router: Any, block_size: int, settings: Any, directory: str,
                 process_index: int) -> KvFanout | None:
    """Process ``process_index``'s :class:`KvFanout` for the worker configs in ``workers`` with an
    ``events`` endpoint (``None`` if none has one): process 0 starts the subscriber (blocking, about
    a second: call off the event loop); start the follower with ``fanout.follower.start()`` and the
    supervision with ``fanout.supervise()`` in the loop."""
    sources = [s for w in workers if w.events for s in sources_for_worker(w.url, w.dp_size, w.events, w.replay)]
    if not sources:
        return None
    fan = KvFanout(fanout_ring_path(directory), router.on_kv_event, process_index == 0, sources, block_size, settings,
                   index=process_index)
    if fan.owner:
        fan.start_subscriber()
    return fan

