"""Deadline admission across the processes of one ``pdlb serve --processes N``: fair shares for the host.

Each router process keeps its own admission queue (:class:`balancer.service.admission_gate.AdmissionGate`:
the requests of the client connections the parent handed it). The prefill backlog the gate reads
is already the host's (:mod:`balancer.service.processes.shared_load`), but deficit round robin runs per
process: a tenant that had a process to itself (one keep-alive connection stays on one process)
would get that process's whole dispatch opportunity, about 1/N of the engines, whatever the other
tenants' weights (measured in the simulator, ``tests/service/test_admission_processes.py``: B alone on one
of 2 processes under 2x overload got 84% SLO attainment against 42-43% for A and C).

So every process publishes its held prompt tokens per tenant slot
(:meth:`balancer.deadline_admission.DeadlineAdmission.held_by_slot`: CRC-32 of the tenant's name
mod :data:`~balancer.deadline_admission.TENANT_SLOTS`, with the tenant's weight) in a small file
of the processes' shared directory (memory-backed where ``/dev/shm`` exists), after each request
it holds and each drain; each process's gate reads every row and keeps its own prefill backlog (its
routed prompts not yet prefilled, plus dispatched ones not yet routed) under its share of the
engines' queue budget (:func:`balancer.deadline_admission.process_share`: each tenant's weight,
split between the processes by their held tokens of it). Within a process, DRR orders as before.

The file holds ``2 x processes x slots`` float64 (8 KB at 2 processes); rows are written by their
process only and read without locks (an aligned 8-byte store is never torn; a read may mix two
publications, off by one request's tokens for one pass). A replacement of a dead process (same
index) zeroes its row at start; until then the dead one's last row stays (its held work counts
for its tenants, which can only lower the others' shares).
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from balancer.deadline_admission import TENANT_SLOTS, DeadlineAdmission, process_share

__all__ = ["FILE_NAME", "SharedAdmission"]

#: The file's name in the processes' shared directory.
FILE_NAME = "admission-held.bin"


class SharedAdmission:
    """One process's view of the host's held work per tenant slot (module docstring).

    Args:
        directory: the directory the processes of one ``pdlb serve`` share.
        processes: number of router processes (rows).
        index: this process's row.
        slots: tenant slots per row.

    Raises:
        ValueError: ``index`` outside ``0..processes - 1``.
        OSError: the file cannot be created or mapped.
    """

    def __init__(self, directory: str, processes: int, index: int, slots: int = TENANT_SLOTS) -> None:
        if not 0 <= index < processes:
            raise ValueError(f"process index {index} outside 0..{processes - 1}")
        self.index = index
        self.slots = slots
        size = 2 * processes * slots * 8
        fd = os.open(os.path.join(directory, FILE_NAME), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:  # every process sets the same size: a race is harmless
                os.ftruncate(fd, size)
            self._mm: mmap.mmap | None = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        arr = np.ndarray((2, processes, slots), dtype=np.float64, buffer=self._mm)
        self.tokens = arr[0]
        self.weights = arr[1]
        self.tokens[index] = 0.0
        self.weights[index] = 0.0

    def publish(self, core: DeadlineAdmission) -> None:
        """Write this process's held tokens and weights per slot."""
        tokens, weights = core.held_by_slot(self.slots)
        self.tokens[self.index] = tokens
        self.weights[self.index] = weights

    def share(self) -> float:
        """This process's share of the engines' queue budget now (1 when nothing is held elsewhere)."""
        return process_share(self.tokens, self.weights, self.index)

    def close(self) -> None:
        """Zero this process's row and unmap the file."""
        if self._mm is None:
            return
        self.tokens[self.index] = 0.0
        self.weights[self.index] = 0.0
        del self.tokens, self.weights
        self._mm.close()
        self._mm = None
