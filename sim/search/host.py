"""This host as the simulator's command line sees it: :func:`default_jobs`, the default of
``--jobs`` and of the executors' worker counts."""

from __future__ import annotations

import os


def default_jobs() -> int:
    """Cores this process may use (``os.sched_getaffinity`` where available), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)
