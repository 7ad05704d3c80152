"""Per-process CPU pinning of ``pdlb serve``'s router processes (``pin_processes``, opt-in).

With ``processes: N`` > 1 and ``pin_processes: true`` (``pdlb serve --pin-processes``) router
process ``i`` runs on one CPU only: the ``i``-th (wrapping) of the CPUs the parent may run on
(``os.sched_getaffinity``: a ``taskset`` or cpuset given to ``pdlb serve`` counts), in ascending
order. The parent (it accepts connections and hands them on) keeps the whole set. A replacement
of process ``i`` gets the same CPU. Without it (the default) every process may run on any CPU of
the set and the kernel's scheduler moves them. Linux only (``os.sched_setaffinity``); elsewhere
the option does nothing (a warning in the process's log).

What it buys or costs: docs/serving.md, "Router processes on their own CPUs".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

log = logging.getLogger(__name__)


def process_cpu(index: int, cpus: Iterable[int]) -> int:
    """The CPU of router process ``index`` (>= 0) among ``cpus`` (CPU numbers, any order): the
    ``index % len(cpus)``-th in ascending order. Raises ValueError for a negative index or no CPUs."""
    ordered = sorted(set(cpus))
    if index < 0:
        raise ValueError(f"process index must be >= 0, got {index}")
    if not ordered:
        raise ValueError("no CPUs to pin to")
    return ordered[index % len(ordered)]


def pin_process(index: int) -> int | None:
    """Pin the calling process (and every thread it starts afterwards) to
    :func:`process_cpu` of its current CPU set; returns the CPU, or None where the platform
    cannot pin (no ``os.sched_setaffinity``) or the kernel refused (logged)."""
    if not hasattr(os, "sched_setaffinity"):
        log.warning("pin_processes: this platform cannot pin processes to CPUs; not pinned")
        return None
    cpu = process_cpu(index, os.sched_getaffinity(0))
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError as e:
        log.warning("pin_processes: could not pin router process %d to CPU %d (%s); not pinned", index, cpu, e)
        return None
    return cpu
