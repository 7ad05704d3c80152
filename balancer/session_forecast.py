"""Returning sessions: a forecast of the load that idle sessions will bring back to each replica.

Agentic and chat sessions come back: a lane's next turn arrives a think time after its last
request finished, with a longer context, and every prefix-aware policy sends it to the replica
that holds its prefix. A replica's load *now* (:mod:`balancer.load`) does not show these idle
sessions; a router that places a new session by load alone may put it where many sessions are
about to return (issue 23, AgentX 440246 at twice the measured load: ~95% of requests are
returning sessions kept on their prefix's rank).

The router knows this from what it routes itself (no engine signal): when a request of session
``s`` finishes on replica ``r`` at ``t`` with a context of ``c`` tokens (prompt + output), ``s`` is
*idle on r*; when ``s`` sends its next request it is no longer idle. The forecast of replica
``r`` at ``now`` is, over its idle sessions ``j`` with age ``a_j = now - t_j < H``::

    returning_requests_r   = sum_j (1 - a_j / H)
    returning_kv_tokens_r  = sum_j (1 - a_j / H) c_j

a linear decay to 0 over the horizon ``H`` (seconds: a few think times; a session idle longer has
probably ended, and its next turn, if any, is far off). Sessions idle ``H`` or longer are dropped.

Bounded: at most ``max_sessions`` idle sessions are kept (the oldest is evicted first); every
operation is O(1) amortised except :meth:`ReturningSessions.forecast` (O(replicas), vectorised)
and :meth:`ReturningSessions.drop_slot` (O(sessions kept), for a removed replica). Pure: no clock
(``now_s`` passed in), no I/O. Replicas are the caller's integer slots (the router's load slots).

Source: pdlb (issue 23 part 3). The linear decay's per-slot sums: ``sum_j (1 - (now - t_j) / H) =
n (1 - now / H) + (sum_j t_j) / H``, kept as running sums so a forecast costs no loop over sessions;
times are kept relative to an origin that moves forward every 64 horizons (the sums rebuilt then), so
the two terms stay small and do not cancel at a live router's monotonic clock.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

__all__ = ["DEFAULT_MAX_SESSIONS", "ReturningSessions"]

#: default cap on the idle sessions one router keeps (about 100 bytes each with the sums)
DEFAULT_MAX_SESSIONS = 65_536


class ReturningSessions:
    """Idle sessions per replica slot and their decayed forecast (module docstring).

    Args:
        horizon_s: ``H``, seconds (> 0, finite): the decay horizon.
        max_sessions: cap on the idle sessions kept (>= 1); beyond it the oldest is evicted.

    Raises:
        ValueError: a horizon that is not a finite number > 0, a cap below 1.
    """

    def __init__(self, horizon_s: float, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        if not (isinstance(horizon_s, (int, float)) and math.isfinite(horizon_s) and horizon_s > 0):
            raise ValueError(f"horizon_s must be a finite number of seconds > 0, got {horizon_s!r}")
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be an integer >= 1, got {max_sessions!r}")
        self.horizon_s = float(horizon_s)
        self.max_sessions = max_sessions
        # session -> (slot, finished_s, context_tokens), oldest finish first
        self._idle: OrderedDict[str, tuple[int, float, float]] = OrderedDict()
        n = 16
        self._count = np.zeros(n, dtype=np.int64)  # idle sessions per slot
        self._sum_t = np.zeros(n)  # sum of their finish times
        self._sum_c = np.zeros(n)  # sum of their contexts
        self._sum_tc = np.zeros(n)  # sum of finish time x context
        self._latest_s = -math.inf
        # finish times are kept relative to this origin (the sums then stay small: at a live router's
        # monotonic clock, ~1e6 s, absolute sums cancel to ~1e-13 relative); moved forward, and the
        # sums rebuilt, once the clock is REBASE_HORIZONS horizons past it
        self._origin_s: float | None = None
        #: sessions evicted by the cap (not by age)
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._idle)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if "_origin_s" not in state:  # pickled before the origin: its times are absolute, i.e. relative to 0
            self._origin_s = 0.0 if self._idle else None

    def _grow(self, slot: int) -> None:
        n = len(self._count)
        if slot < n:
            return
        m = max(2 * n, slot + 1)
        self._count = np.concatenate([self._count, np.zeros(m - n, dtype=np.int64)])
        for name in ("_sum_t", "_sum_c", "_sum_tc"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(m - n)]))

    #: horizons after the origin at which the origin moves and the sums are rebuilt (O(sessions) once per
    #: that many horizons)
    REBASE_HORIZONS = 64.0

    def _rebase(self, now_s: float) -> None:
        """Move the origin to ``now_s`` and rebuild the sums from the records (relative times)."""
        old, self._origin_s = self._origin_s, now_s
        shift = now_s - (old if old is not None else now_s)
        self._count[:] = 0
        self._sum_t[:] = self._sum_c[:] = self._sum_tc[:] = 0.0
        for session, (slot, t, c) in self._idle.items():
            t -= shift
            self._idle[session] = (slot, t, c)
            self._count[slot] += 1
            self._sum_t[slot] += t
            self._sum_c[slot] += c
            self._sum_tc[slot] += t * c

    def _rel(self, now_s: float) -> float:
        """``now_s`` relative to the origin (set at the first time given; moved when far behind)."""
        if self._origin_s is None:
            self._origin_s = now_s
        elif now_s - self._origin_s > self.REBASE_HORIZONS * self.horizon_s:
            self._rebase(now_s)
        return now_s - self._origin_s

    def _remove(self, session: str) -> None:
        slot, t, c = self._idle.pop(session)
        self._count[slot] -= 1
        if self._count[slot] == 0:  # float sums do not return exactly to 0: snap
            self._sum_t[slot] = self._sum_c[slot] = self._sum_tc[slot] = 0.0
        else:
            self._sum_t[slot] -= t
            self._sum_c[slot] -= c
            self._sum_tc[slot] -= t * c

    def on_finished(self, session: str, slot: int, context_tokens: float, now_s: float) -> None:
        """Session ``session``'s request finished on ``slot`` with a context of ``context_tokens``
        (prompt + output tokens) at ``now_s``: it is idle there now (replacing any earlier record).
        Times before the latest one given are taken as that latest time (records stay in finish order)."""
        if slot < 0 or not context_tokens >= 0:
            raise ValueError(f"slot must be >= 0 and context_tokens >= 0, got {slot}, {context_tokens}")
        now_s = max(float(now_s), self._latest_s)
        self._latest_s = now_s
        if session in self._idle:
            self._remove(session)
        self._grow(slot)
        c = float(context_tokens)
        t = self._rel(now_s)
        self._idle[session] = (slot, t, c)
        self._count[slot] += 1
        self._sum_t[slot] += t
        self._sum_c[slot] += c
        self._sum_tc[slot] += t * c
        while len(self._idle) > self.max_sessions:
            self._remove(next(iter(self._idle)))
            self.evicted += 1

    def on_returned(self, session: str) -> None:
        """Session ``session`` sent a new request: it is no longer idle (unknown: nothing)."""
        if session in self._idle:
            self._remove(session)

    def expire(self, now_s: float) -> int:
        """Drop the sessions idle ``horizon_s`` or longer at ``now_s``; returns how many."""
        if self._origin_s is None:
            return 0
        cutoff = float(now_s) - self._origin_s - self.horizon_s
        n = 0
        idle = self._idle
        while idle:
            session, (_, t, _) = next(iter(idle.items()))
            if t > cutoff:
                break
            self._remove(session)
            n += 1
        return n

    def finished_s(self, session: str) -> float | None:
        """When ``session`` last finished (the caller's clock), if it is idle; else None."""
        rec = self._idle.get(session)
        return None if rec is None or self._origin_s is None else rec[1] + self._origin_s

    def drop_slot(self, slot: int) -> int:
        """Forget every idle session of ``slot`` (its replica was removed); returns how many."""
        gone = [s for s, rec in self._idle.items() if rec[0] == slot]
        for s in gone:
            self._remove(s)
        return len(gone)

    def forecast(self, slots: np.ndarray, now_s: float) -> tuple[np.ndarray, np.ndarray]:
        """``(returning_requests, returning_kv_tokens)`` of ``slots`` at ``now_s`` (module
        docstring), each float64 of ``slots``' shape, >= 0; expires old sessions first."""
        self.expire(now_s)
        slots = np.asarray(slots, dtype=np.int64)
        if not len(self._idle) or not len(slots):
            z = np.zeros(len(slots))
            return z, z.copy()
        self._grow(int(slots.max()))
        H = self.horizon_s
        assert self._origin_s is not None  # (records exist)
        keep = 1.0 - (float(now_s) - self._origin_s) / H
        n = self._count[slots]
        c = self._sum_c[slots]
        req = n * keep + self._sum_t[slots] / H
        kv = c * keep + self._sum_tc[slots] / H
        # each weight is in [0, 1]: the sums are within [0, count] and [0, sum of contexts] (rounding aside)
        return np.clip(req, 0.0, n), np.clip(kv, 0.0, c)


class SessionFacts:
    """What a router keeps to give a policy its session facts (``Candidates.prefill_inflight``,
    ``returning_requests``, ``returning_kv_tokens``): the idle sessions (:class:`ReturningSessions`)
    and, per routed request of a known session, ``(session, replica slot, prompt tokens)`` until it
    finishes. The in-flight prefill count itself is the load tracker's (:mod:`balancer.load`).

    Bounded: the in-flight map holds routed requests not yet finished; entries whose request the
    load tracker no longer holds (reaped) are pruned when the map outgrows twice the tracker's
    in-flight count plus 1,024. Requests without ``session_id`` are not tracked.

    Args:
        horizon_s, max_sessions: as :class:`ReturningSessions`.
    """

    def __init__(self, horizon_s: float, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        self.sessions = ReturningSessions(horizon_s, max_sessions)
        self._routed: dict[str, tuple[str, int, int]] = {}

    def on_arrival(self, session_id: str | None) -> None:
        """A request of ``session_id`` (None: no session) arrived: the session is no longer idle
        (called before the request's candidates are built, so its own return is not forecast)."""
        if session_id is not None:
            self.sessions.on_returned(session_id)

    def on_route(self, request_id: str, session_id: str | None, slot: int, prompt_tokens: int,
                 in_flight: int, is_in_flight: object = None) -> None:
        """A request was routed to ``slot`` (its decode or mixed replica): its session (if any) is
        idle on ``slot`` again when the request finishes. ``in_flight``: the load tracker's
        in-flight count; ``is_in_flight(request_id) -> bool``: its membership test (for pruning
        reaped entries)."""
        if session_id is None:
            return
        self.sessions.on_returned(session_id)
        self._routed[request_id] = (session_id, slot, prompt_tokens)
        if len(self._routed) > 2 * in_flight + 1024 and callable(is_in_flight):
            for rid in [r for r in self._routed if not is_in_flight(r)]:
                del self._routed[rid]

    def on_finished(self, request_id: str, now_s: float, output_tokens: int) -> None:
        """The request finished (or failed) at ``now_s`` after ``output_tokens`` output tokens: its
        session is idle on its replica with a context of prompt + output tokens."""
        got = self._routed.pop(request_id, None)
        if got is not None:
            session, slot, prompt = got
            self.sessions.on_finished(session, slot, prompt + max(int(output_tokens), 0), now_s)

    def drop_slot(self, slot: int) -> None:
        """The replica of ``slot`` was removed: forget its idle sessions and routed requests."""
        self.sessions.drop_slot(slot)
        for rid in [r for r, v in self._routed.items() if v[1] == slot]:
            del self._routed[rid]

    def forecast(self, slots: np.ndarray, now_s: float) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`ReturningSessions.forecast` of ``slots`` at ``now_s``."""
        return self.sessions.forecast(slots, now_s)
