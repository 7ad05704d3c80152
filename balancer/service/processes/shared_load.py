"""In-flight load shared by the processes of one ``pdlb serve --processes N`` (shared memory).

Without it each router process counts only the requests *it* routed, so N processes each see
about 1/N of the load and pile onto the same "least loaded" ranks (the simulator measures this:
``python -m sim.experiments.k_routers``, event-fed routers x1.39 mean TTFT at K = 8 with their own
load, x1.00 with one shared view). The parent creates one shared-memory block of
``processes x 3 x columns`` int64 counters (requests, prefill tokens, decode KV tokens per DP
rank; each field's columns contiguous, so that a pool whose DP ranks hold the tracker's slots
0..n-1 in columns 0..n-1, any pool never changed at run time, is read and written as slices);
each process writes its own row from its :class:`~balancer.load.LoadTracker` after every dispatch
and release, and before each decision reads the sum of the other rows into the tracker's *peer*
arrays, which the router adds to its own counts (a :class:`balancer.parts.PeerLoad`, given to the
router at construction: ``LoadSources(peer=view)``, then :meth:`SharedLoad.add` once the replicas
are registered). Reads
are not locked: a decision may see a peer's row mid-update (a count off by one request, never a
torn integer: aligned int64 stores).

Once per event-loop pass (:meth:`SharedLoad.coalesce_in`, what ``pdlb serve`` uses): the row is
written once at the end of each pass in which this process's counts changed, not after every
dispatch and release (about three times per request), and the peer sums are read once per pass,
at its first decision, not before every decision; the views are then at most one pass (well
under a millisecond at load) behind. The block's cache lines are written by every process and
read by all: at 8 processes under load the per-request reads and writes missed the cache and
cost about 40-55 us per request (py-spy on a 16-core host, ``bench/router_scaling.py``), about
a tenth of a process's CPU. A scrape (:meth:`SharedLoad.refresh` with ``force``) always reads afresh.

Columns: the config's workers' DP ranks take columns 0, 1, ... in config order; a worker added at
run time through the admin API gets free columns that the parent assigns
(:class:`balancer.service.processes.shared_admin.AdminCoordinator`) and every process maps the same way
(:meth:`SharedLoad.add`); a removed worker's columns are zeroed by every process
(:meth:`SharedLoad.remove`) before the parent hands them out again. The block is sized for
:data:`balancer.service.workers.MAX_REPLICAS` columns but never written beyond the used ones, so
only those pages are ever allocated (a fresh block is sparse and reads as zeros).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from multiprocessing import shared_memory

import numpy as np

from balancer.load import LoadTracker
from balancer.types import ReplicaId

__all__ = ["SharedLoad", "block_bytes", "create_shared_load_block"]

_FIELDS = 3  # num_requests, prefill_tokens, decode_kv_tokens


def create_shared_load_block(processes: int, columns: int) -> shared_memory.SharedMemory:
    """The block the parent creates (and unlinks at exit) for ``columns`` DP ranks: zeros,
    untouched (sparse: only the pages of the columns in use get allocated)."""
    return shared_memory.SharedMemory(create=True, size=block_bytes(processes, columns))


def block_bytes(processes: int, columns: int) -> int:
    """Size of the block of ``processes`` rows of ``columns`` DP ranks."""
    return max(8, processes * max(1, columns) * _FIELDS * 8)


class SharedLoad:
    """One process's view of the shared block (see the module docstring): a
    :class:`balancer.parts.PeerLoad`. Build it, give it to the router
    (``Router.from_config(config, load_sources=LoadSources(peer=view))``, which binds it to the
    router's tracker), register the replicas, then map them to their columns (:meth:`add`).

    Args:
        name: the shared-memory block's name.
        processes: number of router processes (rows).
        index: this process's row.
        columns: the block's columns per row (DP ranks).

    Raises:
        ValueError: ``index`` outside ``0..processes - 1``, or a block smaller than ``processes x
            columns``.
    """

    def __init__(self, name: str, processes: int, index: int, columns: int) -> None:
        if not 0 <= index < processes:
            raise ValueError(f"process index {index} outside 0..{processes - 1}")
        self._shm = shared_memory.SharedMemory(name=name)
        width = max(1, columns)
        if self._shm.size < block_bytes(processes, width):
            self._shm.close()
            raise ValueError(f"shared load block {name!r} holds {self._shm.size} bytes, less than {processes} x {width} columns")
        self._width = width
        self._all = np.ndarray((processes, _FIELDS, width), dtype=np.int64, buffer=self._shm.buf)
        self._row = self._all[index]
        #: the router's load tracker (set once by :meth:`bind`)
        self.tracker: LoadTracker | None = None
        self._closed = False
        self._n = 0
        self._cols: dict[ReplicaId, int] = {}
        self._slots = np.zeros(0, dtype=np.intp)
        self._sel: slice | np.ndarray = slice(0, 0)
        self._fast = True  # slots 0..n-1 in columns 0..n-1: slices only
        self._sum = np.zeros((_FIELDS, 0), dtype=np.int64)
        self._loop: asyncio.AbstractEventLoop | None = None  # coalescing per pass (coalesce_in)
        self._dirty = False  # this row's counts changed since it was last written
        self._fresh = False  # the peer sums were read in this pass
        self._pass_end_due = False
        self._used = self._all[:, :, :0]
        self._mine = self._row[:, :0]

    def bind(self, tracker: LoadTracker) -> None:
        """Write ``tracker``'s peer arrays and publish its counts (called by the tracker it is
        given to, at construction).

        Raises:
            ValueError: bound already.
        """
        if self.tracker is not None:
            raise ValueError("this shared load view is bound to a router already (one view per router)")
        self.tracker = tracker

    def coalesce_in(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Write this row and read the others' at most once per pass of ``loop`` (see the module
        docstring); ``None``: at every call again (the default). Call from ``loop``'s thread."""
        if loop is None and self._dirty:
            self._write()
        self._loop, self._dirty, self._fresh = loop, False, False

    def _end_of_pass(self) -> None:
        self._pass_end_due = self._fresh = False
        if self._dirty:
            self._write()

    def _pass_end(self) -> None:
        if not self._pass_end_due:
            self._pass_end_due = True
            assert self._loop is not None
            self._loop.call_soon(self._end_of_pass)  # runs after what this pass has ready

    @property
    def columns(self) -> dict[ReplicaId, int]:
        """Replica -> its column (a copy)."""
        return dict(self._cols)

    def add(self, columns: Mapping[ReplicaId, int] | Sequence[ReplicaId]) -> None:
        """Map more replicas (registered in the bound tracker) to their columns (zeroing this
        row's); a sequence maps its replicas to columns 0, 1, ...

        Raises:
            ValueError: a column outside the block or already used by another replica; not bound
                to a tracker yet.
        """
        if self.tracker is None:
            raise ValueError("bind the shared load view to a router's tracker (LoadSources(peer=...)) before add")
        if not isinstance(columns, Mapping):
            columns = {r: c for c, r in enumerate(columns)}
        used = set(self._cols.values())
        for rep, c in columns.items():
            if not 0 <= c < self._width:
                raise ValueError(f"column {c} of {rep} outside the shared load block (0..{self._width - 1})")
            if c in used and self._cols.get(rep) != c:
                raise ValueError(f"column {c} of {rep} is already used")
            used.add(c)
        for rep, c in columns.items():
            self._cols[rep] = c
            self._row[:, c] = 0
        self._reindex()

    def remove(self, replicas: Sequence[ReplicaId]) -> None:
        """Unmap replicas (call before the tracker forgets them); this row's columns are zeroed,
        so that once every process removed them the columns read 0 for their next replica."""
        for rep in replicas:
            c = self._cols.pop(rep, None)
            if c is not None:
                self._row[:, c] = 0
        self._reindex()

    def _reindex(self) -> None:
        reps = sorted(self._cols, key=self._cols.__getitem__)
        cols = [self._cols[r] for r in reps]
        assert self.tracker is not None
        tracker = self.tracker
        self._slots = np.array([tracker.slot(r) for r in reps], dtype=np.intp)
        # columns 0..n-1 in order (a pool never changed at run time): a slice, no gather
        self._sel = slice(0, len(cols)) if cols == list(range(len(cols))) else np.array(cols, dtype=np.intp)
        self._n = len(cols)
        self._fast = isinstance(self._sel, slice) and self._slots.tolist() == list(range(len(cols)))
        self._sum = np.zeros((_FIELDS, len(cols)), dtype=np.int64)
        # views of the block, made once for the slices path: every row's used columns, and this row's
        self._used = self._all[:, :, :len(cols)]  # read only on the slices path
        self._mine = self._row[:, :len(cols)]

    def publish(self) -> None:
        """Write this process's counters into its row (coalescing: at the end of this pass)."""
        if self._closed:
            return
        if self._loop is not None:
            self._dirty = True
            self._pass_end()
            return
        self._write()

    def _write(self) -> None:
        self._dirty = False
        n = self._n
        if not n or self._closed:
            return
        t, row = self.tracker, self._row
        assert t is not None
        if self._fast:
            row[0, :n] = t.num_requests[:n]
            row[1, :n] = t.prefill_tokens[:n]
            row[2, :n] = t.decode_kv_tokens[:n]
        else:
            s, sel = self._slots, self._sel
            row[0, sel] = t.num_requests[s]
            row[1, sel] = t.prefill_tokens[s]
            row[2, sel] = t.decode_kv_tokens[s]

    def refresh(self, force: bool = False) -> bool:
        """Publish, then set the tracker's peer arrays to the other rows' sums (coalescing: once
        per pass unless ``force``; this row is written at the pass's end). Returns False when it
        left the arrays as they were (read already in this pass, or closed)."""
        if self._closed:
            return False
        if self._loop is not None:
            if self._fresh and not force:
                return False
            self._fresh = True
            self._pass_end()  # the pass's end makes the next pass read afresh
        else:
            self._write()
        n = self._n
        if not n:
            return True
        t, others = self.tracker, self._sum
        assert t is not None
        if self._fast:
            np.add.reduce(self._used, axis=0, out=others)
            others -= self._mine
            t.peer_requests[:n] = others[0]
            t.peer_prefill_tokens[:n] = others[1]
            t.peer_kv_tokens[:n] = others[2]
        else:
            sel, s = self._sel, self._slots
            np.add.reduce(self._all[:, :, sel], axis=0, out=others)  # a gather: a copy, made afresh
            others -= self._row[:, sel]
            t.peer_requests[s] = others[0]
            t.peer_prefill_tokens[s] = others[1]
            t.peer_kv_tokens[s] = others[2]
        return True

    def close(self) -> None:
        """Zero this process's row (its requests no longer count anywhere), zero the tracker's
        peer arrays (the others' counts are no longer read) and detach; later calls do nothing."""
        if self._closed:
            return
        self._loop = None
        self._dirty = False
        self._closed = True
        for c in self._cols.values():
            self._row[:, c] = 0
        if self.tracker is not None:
            t = self.tracker
            t.peer_requests[:] = 0
            t.peer_prefill_tokens[:] = 0
            t.peer_kv_tokens[:] = 0
        del self._row, self._all, self._used, self._mine
        self._shm.close()
