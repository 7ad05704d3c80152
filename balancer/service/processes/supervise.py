"""Supervision of the router processes of ``pdlb serve --processes N`` (the parent's side).

A router process may die of anything: SIGKILL, a crash, the kernel's OOM killer. The parent
(:func:`balancer.service.launch._run_processes`) notices within :data:`CHECK_INTERVAL_S`, logs it and
starts a replacement with the same process index, which takes the dead one's place everywhere:

* **in-flight load**: the dead process's row of the shared load block
  (:mod:`balancer.service.processes.shared_load`) still counts the requests it had dispatched; no release
  will ever come for them, so the parent zeroes the row at once (:class:`LoadReaper`) and the
  replacement counts what was there in ``pdlb_router_process_reaped_requests_total`` (DP-rank
  request counts: a request whose prefill leg was still running counts on its prefill and its
  decode rank);
* **metrics**: the dead process's live gauge files are dropped (prometheus-client's
  ``mark_process_dead``), its counters stay in the sums; the replacement adds one to
  ``pdlb_router_process_restarts_total{process}``;
* **workers**: the replacement starts with the worker set every process has now (admin changes
  included, :class:`TrackingCoordinator`) and the same shared-load columns;
* **prefix views**: approximate mode, it first records what the dead one routed, read back from
  its own decision ring, then reads the others' rings (each from its start if it has not
  wrapped, else from its oldest checkpoint: the last half ring or more) and continues its own
  ring where the dead one stopped (:mod:`balancer.service.processes.shared_prefix`); events mode,
  it reads the KV fan-out ring from its start, and, if the ring has wrapped since, asks the
  subscriber for a snapshot (:mod:`balancer.service.processes.kv_fanout`, "Resync"); process 0's
  replacement also restarts the KV-event subscriber (the dead one's subscriber child exits when
  it sees its parent gone; the new one waits for its ring lock);
* **RNG**: a fresh seed (``seed + generation * N + index``), not the dead one's;
* **connections**: the parent hands it new client connections once it reports ready; until then
  they go to the live processes. The connections the dead process held (and any handed to it
  but not yet taken) are lost: those clients see the connection reset.

Restarts are bounded (:class:`RestartPolicy`): the k-th death of one process index within
``window_s`` waits ``min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2**(k-1))`` before its replacement starts,
and a death beyond ``max_restarts`` within the window (a crash loop: a replacement that cannot
start counts too) stops ``pdlb serve`` with status 1 and a message naming the process and its
last exit status.
"""

from __future__ import annotations

import signal
from collections import deque
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from balancer.service.processes.shared_admin import AdminCoordinator

__all__ = ["BACKOFF_FIRST_S", "BACKOFF_MAX_S", "CHECK_INTERVAL_S", "DEFAULT_MAX_RESTARTS", "DEFAULT_RESTART_WINDOW_S",
           "READY_TIMEOUT_S", "LoadReaper", "RestartPolicy", "TrackingCoordinator", "describe_exit",
           "exit_before_ready", "restart_counters"]

CHECK_INTERVAL_S = 0.2
"""Seconds between the parent's checks that every router process runs."""
DEFAULT_MAX_RESTARTS = 5
"""Restarts of one router process allowed within :data:`DEFAULT_RESTART_WINDOW_S`."""
DEFAULT_RESTART_WINDOW_S = 60.0
"""The crash-loop window (seconds)."""
BACKOFF_FIRST_S = 0.1
"""Wait before the first restart of a process within the window; doubled for each further one."""
BACKOFF_MAX_S = 5.0
"""Longest wait before a restart."""
READY_TIMEOUT_S = 60.0
"""Seconds a replacement may take to report ready before it counts as failed (and is killed)."""


def describe_exit(exitcode: int | None) -> str:
    """``"exited with status 3"`` / ``"was killed by SIGKILL"`` for a ``multiprocessing`` exit code."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def exit_before_ready(process: Any, wait_s: float = 2.0) -> str:
    """Why ``process`` (a ``multiprocessing.Process`` whose ready pipe reached end of file) never
    reported ready: ``"was killed by SIGKILL before listening"``. Its pipe closes as it dies, a
    moment before it can be reaped, so it is joined for up to ``wait_s`` first (else it would be
    described as ``"is still running before listening"``)."""
    process.join(wait_s)
    if process.is_alive():
        return "closed its ready pipe before listening"
    return f"{describe_exit(process.exitcode)} before listening"


class RestartPolicy:
    """Backoff and crash-loop limit per process index (see the module docstring).

    Args:
        max_restarts: restarts of one index allowed within ``window_s`` (0: never restart).
        window_s: the window (seconds).

    Raises:
        ValueError: a negative ``max_restarts`` or a non-positive ``window_s``.
    """

    def __init__(self, max_restarts: int = DEFAULT_MAX_RESTARTS, window_s: float = DEFAULT_RESTART_WINDOW_S) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._deaths: dict[int, deque[float]] = {}
        self.restarts: dict[int, int] = {}  # restarts granted per index, ever

    def on_death(self, index: int, now_s: float) -> float | None:
        """A death of process ``index`` at ``now_s``: seconds to wait before its replacement, or
        ``None`` if this death exceeds the limit (give up)."""
        q = self._deaths.setdefault(index, deque())
        while q and now_s - q[0] > self.window_s:
            q.popleft()
        q.append(now_s)
        if len(q) > self.max_restarts:
            return None
        self.restarts[index] = self.restarts.get(index, 0) + 1
        return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (len(q) - 1))

    def deaths_in_window(self, index: int) -> int:
        return len(self._deaths.get(index, ()))


class LoadReaper:
    """The parent's view of the shared load block: zeroes a dead process's row.

    Args:
        shm: the block (:func:`balancer.service.processes.shared_load.create_shared_load_block`).
        processes, columns: its shape (rows, DP-rank columns).
    """

    _FIELDS = 3  # as balancer.service.processes.shared_load: requests, prefill tokens, decode KV tokens

    def __init__(self, shm: shared_memory.SharedMemory, processes: int, columns: int) -> None:
        self._rows: np.ndarray | None = np.ndarray((processes, self._FIELDS, columns), dtype=np.int64, buffer=shm.buf)
        self.reaped_requests = 0

    def reap(self, index: int) -> int:
        """Zero row ``index`` (its process is dead: nothing writes it); returns the DP-rank request
        counts it held. Only the row's allocated pages are touched (a zero row stays sparse)."""
        assert self._rows is not None
        row = self._rows[index]
        held = int(row[0].sum())
        nz = np.flatnonzero(row.reshape(-1))
        row.reshape(-1)[nz] = 0
        self.reaped_requests += held
        return held

    def close(self) -> None:
        """Release the view (before the block is closed)."""
        self._rows = None


class TrackingCoordinator(AdminCoordinator):
    """:class:`~balancer.service.processes.shared_admin.AdminCoordinator` that also keeps the worker config of
    every registered URL (the configured ones, then those added through the admin API, in order),
    so that a replacement process starts with the worker set the others have now.

    Args:
        workers: ``{url: worker config dict}`` of the configured workers.
        Others: as :class:`AdminCoordinator`.
    """

    def __init__(self, conns: Any, columns: dict[str, list[int]], capacity: int, workers: dict[str, dict],
                 alive: Callable[[int], bool] = lambda i: True) -> None:
        super().__init__(conns, columns, capacity, alive)
        self.workers = dict(workers)

    def apply_everywhere(self, op: str, payload: Any) -> Any:
        out = super().apply_everywhere(op, payload)  # raises AdminRefused when not applied everywhere
        if op == "add":
            self.workers[str(payload["url"]).rstrip("/")] = dict(payload)
        elif op == "remove":
            self.workers.pop(str(payload).rstrip("/"), None)
        return out


def restart_counters(index: int, restarted: bool, reaped_requests: int) -> None:
    """In a router process (multiprocess metrics mode, after its :class:`ServiceMetrics` exist):
    export ``pdlb_router_process_restarts_total{process}`` (one more if this process replaces a dead
    one) and ``pdlb_router_process_reaped_requests_total{process}`` (the load the parent reset)."""
    from prometheus_client import Counter

    restarts = Counter("pdlb_router_process_restarts", "Router processes of pdlb serve --processes N that died "
                       "and were started again, by process index", ["process"], registry=None)
    reaped = Counter("pdlb_router_process_reaped_requests", "In-flight DP-rank request counts a dead router "
                     "process held in the shared load block, reset by the parent", ["process"], registry=None)
    restarts.labels(str(index)).inc(1 if restarted else 0)
    reaped.labels(str(index)).inc(reaped_requests)
