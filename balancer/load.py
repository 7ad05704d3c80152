"""Per-replica load accounting, counted at dispatch and released on the progress hooks.

A request counts against its replicas from the moment it is routed (``on_dispatch``), never
from its first streamed byte: counting at first token lets a burst of PD requests all land on the
replica that looked idle (a failure seen in real routers, see ANCHORS.md). Load is *projected*:

============  ==========================  ==================================  =======================
replica       ``num_requests``            ``prefill_tokens``                  ``decode_kv_tokens``
============  ==========================  ==================================  =======================
prefill       +1 dispatch, -1 prefill     +uncached prompt tokens at dispatch  --
              done                        -same at prefill done
decode        +1 dispatch, -1 finished    --                                  +prompt (+output) tokens
                                                                              at dispatch, - at finish
mixed         +1 dispatch, -1 finished    + at dispatch, - at prefill done /   as decode
                                          first token
============  ==========================  ==================================  =======================

Prefill replicas also carry ``prefill_attn_pairs`` (float64): the causal attention (query, key)
pairs of those uncached tokens, ``u * p + u * (u + 1) / 2`` for ``u`` uncached tokens after ``p``
cached ones, released with them (long prompts cost quadratically more attention; cost-based
policies read it).

Every release is idempotent per request and phase, and ``on_finished`` releases whatever is left,
so load returns exactly to zero after any order of hooks (tested).

Counters live in numpy arrays indexed by a per-replica slot, so a routing decision gathers a
pool's load with one fancy-indexing operation (O(replicas), no Python loop).

*Peer* load (``peer_requests``, ``peer_prefill_tokens``, ``peer_kv_tokens``) is what other routers
have in flight: the other processes of one ``pdlb serve --processes N``
(:mod:`balancer.service.processes.shared_load`) and routers on other hosts
(:mod:`balancer.service.broker_sync`). The source that keeps it fresh is given at construction
(``LoadTracker(peer=...)``, a :class:`balancer.parts.PeerLoad`, which is bound to the tracker then);
the router adds it to the own counters.

*External* load (``external_requests``, ``external_kv_tokens``) is what engine load reports
(:class:`LoadReport`, :meth:`LoadTracker.on_report`) show beyond this tracker's own count: other
routers' traffic. The router adds it to the own counters in its snapshots. Engines report request
counts, not queued tokens, so on a prefill replica the external requests are also priced as
queued prefill work (``external_prefill_tokens``, ``external_prefill_pairs``): each counts as
this tracker's own mean pending prefill there (tokens and attention pairs per request), or, where
this tracker has none pending, as the mean of every prefill it has dispatched. Without that, K
independent routers each see about 1/K of every prefill queue (issue 23).

Requests whose release never comes can be reaped (:meth:`LoadTracker.reap`): every in-flight
record keeps its dispatch time.

*In-service prefill* (``prefill_head_start_s``, ``prefill_head_tokens``, ``prefill_head_pairs``):
per replica, the oldest of this tracker's requests whose prefill is pending there (dispatch order:
engines prefill first come, first served), its uncached tokens and attention pairs, and the time it
began service: ``max(its dispatch, the previous prefill done on that replica)`` (``inf`` when none).
The counters above count a prompt in full until its prefill is done; a cost model can subtract
what the head has computed since it began (``balancer.policies.ep_aware``'s in-service progress).
``prefill_inflight`` (int64, per slot): how many of this tracker's routed prompts wait for or are in
prefill there (+1 at dispatch with uncached tokens, -1 at prefill done, first token or finish): the
prompts a replica prefills at once where chunks run in parallel (``ep_aware``'s ``prefill_at_once``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from balancer.types import ReplicaId


@dataclass(slots=True)
class _InFlight:
    prefill_slot: int  # -1 when there is no separate prefill replica
    decode_slot: int
    prefill_tokens: int
    decode_kv_tokens: int
    prefill_attn_pairs: float = 0.0
    prefill_released: bool = False
    dispatched_s: float = 0.0
    #: the replica whose in-service prefill queue holds the request (-1: none)
    queue_slot: int = -1


@dataclass(frozen=True, slots=True)
class LoadReport:
    """An engine's own view of one DP rank's load (e.g. its Prometheus metrics).

    Attributes:
        num_running: requests in the running batch (vLLM ``vllm:num_requests_running``, SGLang
            ``sglang:num_running_reqs``).
        num_waiting: requests queued (vLLM ``vllm:num_requests_waiting``, SGLang
            ``sglang:num_queue_reqs``).
        kv_usage: KV cache usage in [0, 1] (vLLM ``vllm:kv_cache_usage_perc``, SGLang
            ``sglang:token_usage``), ``None`` if not reported.

    Raises:
        ValueError: negative counts or a usage outside [0, 1].
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float | None = None

    def __post_init__(self) -> None:
        if self.num_running < 0 or self.num_waiting < 0:
            raise ValueError(f"request counts must be >= 0, got running={self.num_running} waiting={self.num_waiting}")
        if self.kv_usage is not None and not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage must be in [0, 1], got {self.kv_usage}")


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """One replica's counters (see the module table)."""

    num_requests: int
    prefill_tokens: int
    decode_kv_tokens: int


class LoadTracker:
    """Projected per-replica load. Pure bookkeeping: no clock, no I/O.

    Raises:
        KeyError: when a hook names an unknown replica; ``ValueError`` on a duplicate dispatch.
    """

    def __init__(self, initial_slots: int = 16, peer: Any = None) -> None:
        n = max(1, initial_slots)
        self.num_requests = np.zeros(n, dtype=np.int64)
        self.prefill_tokens = np.zeros(n, dtype=np.int64)
        self.decode_kv_tokens = np.zeros(n, dtype=np.int64)
        self.prefill_attn_pairs = np.zeros(n, dtype=np.float64)
        self.external_requests = np.zeros(n, dtype=np.int64)
        self.external_kv_tokens = np.zeros(n, dtype=np.int64)
        self.external_prefill_tokens = np.zeros(n, dtype=np.int64)
        self.external_prefill_pairs = np.zeros(n, dtype=np.float64)
        # every prefill this tracker dispatched: [requests, tokens, attention pairs] (the mean an
        # external request on a replica without own pending prefills is priced at)
        # requests, prompt tokens, attention pairs of every prefill dispatched (ints, ints, float)
        self._dispatched_prefill: list[float] = [0, 0, 0.0]
        # the other router processes' counts (balancer.service.processes.shared_load), when shared
        self.peer_requests = np.zeros(n, dtype=np.int64)
        self.peer_prefill_tokens = np.zeros(n, dtype=np.int64)
        self.peer_kv_tokens = np.zeros(n, dtype=np.int64)
        #: the source that keeps the peer arrays fresh (a :class:`balancer.parts.PeerLoad`:
        #: ``refresh()``/``publish()``), or None; given at construction and bound to this tracker
        self.peer: Any = peer
        #: True once any load report arrived (snapshots then add the external arrays)
        self.has_external = False
        self._report_s: dict[int, float] = {}  # slot -> time of its last report
        #: the oldest of those times (inf: none), so an expiry check is O(1)
        self.oldest_report_s = float("inf")
        self._slot: dict[ReplicaId, int] = {}
        self._free: list[int] = []
        self._next = 0
        self._inflight: dict[str, _InFlight] = {}
        # in-service prefill (module docstring): per slot, pending prefills in dispatch order
        self.prefill_head_start_s = np.full(n, np.inf)
        self.prefill_head_tokens = np.zeros(n, dtype=np.int64)
        self.prefill_head_pairs = np.zeros(n, dtype=np.float64)
        #: per slot, the routed prompts whose prefill is not done (the prompts it prefills at once)
        self.prefill_inflight = np.zeros(n, dtype=np.int64)
        # records in dispatch order; ones that left out of order stay until they reach the head
        # or outnumber the live ones (then the deque is compacted): O(1) amortised per hook
        self._pending: list[deque[_InFlight]] = [deque() for _ in range(n)]
        self._dead: list[int] = [0] * n  # records in _pending[slot] that left it
        self._now_s = 0.0  # latest time a hook was given (for hooks given none)
        if peer is not None:
            peer.bind(self)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["peer"] = None  # a shared-memory view belongs to its process
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        # a tracker pickled before the in-service columns existed: start them empty (its pending
        # prefills count in full, as they did then)
        n = len(self.num_requests)
        if "_pending" not in state:
            self.prefill_head_start_s = np.full(n, np.inf)
            self.prefill_head_tokens = np.zeros(n, dtype=np.int64)
            self.prefill_head_pairs = np.zeros(n, dtype=np.float64)
            self._pending = [deque() for _ in range(n)]
            self._dead = [0] * n
            self._now_s = 0.0
            self.prefill_inflight = np.zeros(n, dtype=np.int64)
            for rec in self._inflight.values():
                rec.queue_slot = -1
        if "external_prefill_tokens" not in state:  # pickled before the external prefill columns
            self.external_prefill_tokens = np.zeros(n, dtype=np.int64)
            self.external_prefill_pairs = np.zeros(n, dtype=np.float64)
            self._dispatched_prefill = [0, 0, 0.0]
        if "prefill_inflight" not in self.__dict__:  # pickled before the in-flight prefill count: rebuild it
            self.prefill_inflight = np.zeros(n, dtype=np.int64)
            for slot, pending in enumerate(self._pending):
                self.prefill_inflight[slot] = sum(1 for r in pending if r.queue_slot == slot)

    # ------------------------------------------------------------------ replicas
    def add_replica(self, replica: ReplicaId) -> int:
        """Give ``replica`` a slot (idempotent); returns the slot index."""
        slot = self._slot.get(replica)
        if slot is not None:
            return slot
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._next
            self._next += 1
            if slot >= len(self.num_requests):
                grow = len(self.num_requests)
                for name in ("num_requests", "prefill_tokens", "decode_kv_tokens", "prefill_attn_pairs",
                             "external_requests", "external_kv_tokens", "external_prefill_tokens",
                             "external_prefill_pairs", "peer_requests", "peer_prefill_tokens",
                             "peer_kv_tokens", "prefill_head_tokens", "prefill_head_pairs", "prefill_inflight"):
                    arr = getattr(self, name)
                    setattr(self, name, np.concatenate([arr, np.zeros(grow, dtype=arr.dtype)]))
                self.prefill_head_start_s = np.concatenate([self.prefill_head_start_s, np.full(grow, np.inf)])
                self._pending.extend(deque() for _ in range(grow))
                self._dead.extend(0 for _ in range(grow))
        self.num_requests[slot] = 0
        self.prefill_tokens[slot] = 0
        self.decode_kv_tokens[slot] = 0
        self.prefill_attn_pairs[slot] = 0.0
        self.external_requests[slot] = 0
        self.external_kv_tokens[slot] = 0
        self.external_prefill_tokens[slot] = 0
        self.external_prefill_pairs[slot] = 0.0
        self.peer_requests[slot] = self.peer_prefill_tokens[slot] = self.peer_kv_tokens[slot] = 0
        self._clear_line(slot)
        self._report_s.pop(slot, None)
        self.oldest_report_s = min(self._report_s.values(), default=float("inf"))
        self._slot[replica] = slot
        return slot

    def remove_replica(self, replica: ReplicaId) -> None:
        """Free the replica's slot. In-flight requests on it keep their records; their later
        hooks release nothing on the freed slot."""
        slot = self._slot.pop(replica)
        self._free.append(slot)
        for rec in self._inflight.values():
            if rec.prefill_slot == slot:
                rec.prefill_slot = -2
            if rec.decode_slot == slot:
                rec.decode_slot = -2
            if rec.queue_slot == slot:
                rec.queue_slot = -1
        self._clear_line(slot)

    def slot(self, replica: ReplicaId) -> int:
        return self._slot[replica]

    def get(self, replica: ReplicaId) -> LoadSnapshot:
        s = self._slot[replica]
        return LoadSnapshot(int(self.num_requests[s]), int(self.prefill_tokens[s]), int(self.decode_kv_tokens[s]))

    @property
    def num_in_flight(self) -> int:
        """Requests dispatched and not yet finished."""
        return len(self._inflight)

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._inflight

    # ------------------------------------------------------------------ hooks
    def on_dispatch(
        self,
        request_id: str,
        prefill: ReplicaId | None,
        decode: ReplicaId,
        prefill_tokens: int,
        decode_kv_tokens: int,
        prefill_attn_pairs: float = 0.0,
        now_s: float = 0.0,
    ) -> None:
        """Count a routed request. ``prefill`` is None when the decode (mixed) replica prefills it
        itself; then ``prefill_tokens`` count on the decode replica until prefill is done.
        ``now_s``: dispatch time, for :meth:`reap` and the in-service prefill (module docstring)."""
        if request_id in self._inflight:
            raise ValueError(f"request {request_id!r} dispatched twice")
        self._now_s = max(self._now_s, now_s)
        d = self._slot[decode]
        p = self._slot[prefill] if prefill is not None else -1
        if p >= 0:
            self.num_requests[p] += 1
            self.prefill_tokens[p] += prefill_tokens
            self.prefill_attn_pairs[p] += prefill_attn_pairs
            if prefill_tokens > 0:
                acc = self._dispatched_prefill
                acc[0] += 1
                acc[1] += prefill_tokens
                acc[2] += prefill_attn_pairs
        else:
            self.prefill_tokens[d] += prefill_tokens
            self.prefill_attn_pairs[d] += prefill_attn_pairs
        self.num_requests[d] += 1
        self.decode_kv_tokens[d] += decode_kv_tokens
        q = (p if p >= 0 else d) if prefill_tokens > 0 else -1
        rec = _InFlight(p, d, prefill_tokens, decode_kv_tokens, prefill_attn_pairs=float(prefill_attn_pairs),
                        dispatched_s=now_s, queue_slot=q)
        self._inflight[request_id] = rec
        if q >= 0:
            self.prefill_inflight[q] += 1
            pending = self._pending[q]
            pending.append(rec)
            if len(pending) == 1:  # the head is always a live record (see _leave_queue)
                self._set_head(q, rec, now_s)

    def _set_head(self, slot: int, rec: _InFlight | None, start_s: float) -> None:
        if rec is None:
            self.prefill_head_start_s[slot] = np.inf
            self.prefill_head_tokens[slot] = 0
            self.prefill_head_pairs[slot] = 0.0
        else:
            self.prefill_head_start_s[slot] = max(rec.dispatched_s, start_s)
            self.prefill_head_tokens[slot] = rec.prefill_tokens
            self.prefill_head_pairs[slot] = rec.prefill_attn_pairs

    def _clear_line(self, slot: int) -> None:
        self.prefill_inflight[slot] = 0
        self._pending[slot].clear()
        self._dead[slot] = 0
        self._set_head(slot, None, 0.0)

    def _leave_queue(self, rec: _InFlight, now_s: float) -> None:
        q, rec.queue_slot = rec.queue_slot, -1
        if q < 0:
            return
        self.prefill_inflight[q] -= 1
        pending = self._pending[q]
        if pending and pending[0] is rec:
            pending.popleft()
            while pending and pending[0].queue_slot != q:  # drop those that left out of order
                pending.popleft()
                self._dead[q] -= 1
            self._set_head(q, pending[0] if pending else None, now_s)  # it begins now (or at its dispatch)
        else:  # done out of order: the head keeps its start; the record is dropped lazily
            self._dead[q] += 1
            if self._dead[q] > 32 and 2 * self._dead[q] > len(pending):
                self._pending[q] = deque(r for r in pending if r.queue_slot == q)
                self._dead[q] = 0

    def on_prefill_done(self, request_id: str, now_s: float | None = None) -> None:
        """Release the prefill share (idempotent; unknown ids are ignored). ``now_s``: when (the
        next pending prefill on the replica begins then; default: the latest time given)."""
        rec = self._inflight.get(request_id)
        if rec is None or rec.prefill_released:
            return
        rec.prefill_released = True
        now_s = self._now_s if now_s is None else max(self._now_s, now_s)
        self._now_s = now_s
        self._leave_queue(rec, now_s)
        if rec.prefill_slot >= 0:
            self.num_requests[rec.prefill_slot] -= 1
            self.prefill_tokens[rec.prefill_slot] -= rec.prefill_tokens
            self._release_pairs(rec.prefill_slot, rec.prefill_attn_pairs)
        elif rec.prefill_slot == -1 and rec.decode_slot >= 0:
            self.prefill_tokens[rec.decode_slot] -= rec.prefill_tokens
            self._release_pairs(rec.decode_slot, rec.prefill_attn_pairs)

    def _release_pairs(self, slot: int, pairs: float) -> None:
        # float sums do not return exactly to 0 after any order: snap to 0 with the token count
        if self.prefill_tokens[slot] == 0:
            self.prefill_attn_pairs[slot] = 0.0
        else:
            self.prefill_attn_pairs[slot] = max(self.prefill_attn_pairs[slot] - pairs, 0.0)

    def on_finished(self, request_id: str, now_s: float | None = None) -> None:
        """Release everything the request still holds (idempotent; unknown ids are ignored)."""
        rec = self._inflight.get(request_id)
        if rec is None:
            return
        self.on_prefill_done(request_id, now_s)
        if rec.decode_slot >= 0:
            self.num_requests[rec.decode_slot] -= 1
            self.decode_kv_tokens[rec.decode_slot] -= rec.decode_kv_tokens
        del self._inflight[request_id]

    def reap(self, dispatched_before_s: float) -> int:
        """Release every request dispatched before ``dispatched_before_s`` (their release never
        came); returns how many. O(reaped): records are kept in dispatch order."""
        n = 0
        inflight = self._inflight
        while inflight:
            rid, rec = next(iter(inflight.items()))
            if rec.dispatched_s >= dispatched_before_s:
                break
            self.on_finished(rid)
            n += 1
        return n

    # ------------------------------------------------------------------ engine reports
    def on_report(self, replica: ReplicaId, report: LoadReport, kv_capacity_tokens: int, now_s: float,
                  prefill_queue: bool = False) -> None:
        """Keep what ``report`` shows beyond this tracker's own count (plus its peers', when
        shared) as external load: ``max(0, running + waiting - own requests)`` and, with a known
        capacity, ``max(0, kv_usage * capacity - own decode KV tokens)``. ``prefill_queue``: the
        replica is a prefill replica (its requests are pending prefills); its external requests
        are then also priced as queued prefill tokens and attention pairs (module docstring)."""
        s = self._slot[replica]
        own_requests, own_kv = int(self.num_requests[s]), int(self.decode_kv_tokens[s])
        own_tokens, own_pairs = int(self.prefill_tokens[s]), float(self.prefill_attn_pairs[s])
        if self.peer is not None:  # the other processes of this pdlb serve are not "external"
            own_requests += int(self.peer_requests[s])
            own_kv += int(self.peer_kv_tokens[s])
            own_tokens += int(self.peer_prefill_tokens[s])
        ext = max(0, report.num_running + report.num_waiting - own_requests)
        self.external_requests[s] = ext
        if prefill_queue and ext > 0:
            if own_requests > 0 and own_tokens > 0:  # the mix this router sends there
                n, tokens, pairs = own_requests, own_tokens, own_pairs
            else:  # nothing of its own pending there: every prefill it has dispatched
                acc = self._dispatched_prefill
                n, tokens, pairs = int(acc[0]), int(acc[1]), float(acc[2])
            self.external_prefill_tokens[s] = round(ext * tokens / n) if n else 0
            self.external_prefill_pairs[s] = ext * pairs / n if n else 0.0
        else:
            self.external_prefill_tokens[s] = 0
            self.external_prefill_pairs[s] = 0.0
        if report.kv_usage is not None and kv_capacity_tokens > 0:
            used = int(round(report.kv_usage * kv_capacity_tokens))
            self.external_kv_tokens[s] = max(0, used - own_kv)
        self._report_s[s] = now_s
        self.oldest_report_s = min(self._report_s.values())
        self.has_external = True

    def expire_reports(self, reported_before_s: float) -> int:
        """Zero the external load of replicas whose last report is older than ``reported_before_s``."""
        if self.oldest_report_s >= reported_before_s:
            return 0
        old = [s for s, t in self._report_s.items() if t < reported_before_s]
        for s in old:
            self.external_requests[s] = 0
            self.external_kv_tokens[s] = 0
            self.external_prefill_tokens[s] = 0
            self.external_prefill_pairs[s] = 0.0
            del self._report_s[s]
        self.oldest_report_s = min(self._report_s.values(), default=float("inf"))
        if not self._report_s:
            self.has_external = False
        return len(old)
