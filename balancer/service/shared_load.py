"""In-flight load shared by the processes of one ``pdlb serve --processes N`` (shared memory).

Without it each router process counts only the requests *it* routed, so N processes each see
about 1/N of the load and pile onto the same "least loaded" ranks (the simulator measures this:
``python -m sim.experiments.k_routers``, event-fed routers x1.39 mean TTFT at K = 8 with their own
load, x1.00 with one shared view). The parent creates one shared-memory block of
``processes x replicas x 3`` int64 counters (requests, prefill tokens, decode KV tokens per DP rank,
in the config's worker order); each process writes its own row from its
:class:`~balancer.load.LoadTracker` after every dispatch and release, and before each decision
reads the sum of the other rows into the tracker's *peer* arrays, which the router adds to its
own counts (:attr:`balancer.load.LoadTracker.peer`). Reads are not locked: a decision may see a
peer's row mid-update (a count off by one request, never a torn integer: aligned int64 stores).

The worker set is fixed while several processes run (the admin API refuses changes), so the
column of each replica is fixed too.
"""

from __future__ import annotations

from collections.abc import Sequence
from multiprocessing import shared_memory

import numpy as np

from balancer.load import LoadTracker
from balancer.types import ReplicaId

__all__ = ["SharedLoad", "create_shared_load_block"]

_FIELDS = 3  # num_requests, prefill_tokens, decode_kv_tokens


def create_shared_load_block(processes: int, num_replicas: int) -> shared_memory.SharedMemory:
    """The zeroed block the parent creates (and unlinks at exit)."""
    size = max(8, processes * max(1, num_replicas) * _FIELDS * 8)
    shm = shared_memory.SharedMemory(create=True, size=size)
    np.ndarray((size // 8,), dtype=np.int64, buffer=shm.buf)[:] = 0
    return shm


class SharedLoad:
    """One process's view of the shared block (see the module docstring).

    Args:
        name: the shared-memory block's name.
        processes: number of router processes (rows).
        index: this process's row.
        replicas: the replicas, in the column order every process uses.
        tracker: this process's load tracker (its replicas must be registered already).
    """

    def __init__(self, name: str, processes: int, index: int, replicas: Sequence[ReplicaId], tracker: LoadTracker) -> None:
        if not 0 <= index < processes:
            raise ValueError(f"process index {index} outside 0..{processes - 1}")
        self._shm = shared_memory.SharedMemory(name=name)
        n = max(1, len(replicas))
        self._all = np.ndarray((processes, n, _FIELDS), dtype=np.int64, buffer=self._shm.buf)
        self._row = self._all[index]
        self._slots = np.array([tracker.slot(r) for r in replicas], dtype=np.intp)
        self._n = len(replicas)
        self.tracker = tracker
        tracker.peer = self

    def publish(self) -> None:
        """Write this process's counters into its row."""
        t, s, row = self.tracker, self._slots, self._row
        if self._n:
            row[:, 0] = t.num_requests[s]
            row[:, 1] = t.prefill_tokens[s]
            row[:, 2] = t.decode_kv_tokens[s]

    def refresh(self) -> None:
        """Publish, then set the tracker's peer arrays to the other rows' sums."""
        self.publish()
        if not self._n:
            return
        others = self._all.sum(axis=0) - self._row
        t, s = self.tracker, self._slots
        t.peer_requests[s] = others[:, 0]
        t.peer_prefill_tokens[s] = others[:, 1]
        t.peer_kv_tokens[s] = others[:, 2]

    def close(self) -> None:
        """Zero this process's row (its requests no longer count anywhere) and detach."""
        if self._n:
            self._row[:] = 0
        self.tracker.peer = None
        del self._row, self._all
        self._shm.close()
