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
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def __init__(self, initial_slots: int = 16) -> None:
        n = max(1, initial_slots)
        self.num_requests = np.zeros(n, dtype=np.int64)
        self.prefill_tokens = np.zeros(n, dtype=np.int64)
        self.decode_kv_tokens = np.zeros(n, dtype=np.int64)
        self.prefill_attn_pairs = np.zeros(n, dtype=np.float64)
        self._slot: dict[ReplicaId, int] = {}
        self._free: list[int] = []
        self._next = 0
        self._inflight: dict[str, _InFlight] = {}

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
                for name in ("num_requests", "prefill_tokens", "decode_kv_tokens", "prefill_attn_pairs"):
                    arr = getattr(self, name)
                    setattr(self, name, np.concatenate([arr, np.zeros(grow, dtype=arr.dtype)]))
        self.num_requests[slot] = 0
        self.prefill_tokens[slot] = 0
        self.decode_kv_tokens[slot] = 0
        self.prefill_attn_pairs[slot] = 0.0
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
    ) -> None:
        """Count a routed request. ``prefill`` is None when the decode (mixed) replica prefills it
        itself; then ``prefill_tokens`` count on the decode replica until prefill is done."""
        if request_id in self._inflight:
            raise ValueError(f"request {request_id!r} dispatched twice")
        d = self._slot[decode]
        p = self._slot[prefill] if prefill is not None else -1
        if p >= 0:
            self.num_requests[p] += 1
            self.prefill_tokens[p] += prefill_tokens
            self.prefill_attn_pairs[p] += prefill_attn_pairs
        else:
            self.prefill_tokens[d] += prefill_tokens
            self.prefill_attn_pairs[d] += prefill_attn_pairs
        self.num_requests[d] += 1
        self.decode_kv_tokens[d] += decode_kv_tokens
        self._inflight[request_id] = _InFlight(p, d, prefill_tokens, decode_kv_tokens, float(prefill_attn_pairs))

    def on_prefill_done(self, request_id: str) -> None:
        """Release the prefill share (idempotent; unknown ids are ignored)."""
        rec = self._inflight.get(request_id)
        if rec is None or rec.prefill_released:
            return
        rec.prefill_released = True
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

    def on_finished(self, request_id: str) -> None:
        """Release everything the request still holds (idempotent; unknown ids are ignored)."""
        rec = self._inflight.get(request_id)
        if rec is None:
            return
        self.on_prefill_done(request_id)
        if rec.decode_slot >= 0:
            self.num_requests[rec.decode_slot] -= 1
            self.decode_kv_tokens[rec.decode_slot] -= rec.decode_kv_tokens
        del self._inflight[request_id]
