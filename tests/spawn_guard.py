"""No ``pdlb engine`` / ``pdlb serve`` outlives the test session (review finding: a SIGTERMed
pytest left its fixtures' servers running, holding ports and CPU on a shared host).

The helpers of :mod:`sim.emulator.testing` start each server in a process group of its own and
keep a list of them; a fixture stops its servers in a ``finally``. Two things skip the ``finally``:
a SIGTERM (CI cancelling a job, ``timeout``), whose default action ends the interpreter at once,
and a test that forgot. :func:`install` (called at session start by ``tests/conftest.py``) turns
SIGTERM into: end every spawned group (SIGTERM, SIGKILL after 3 s), then die of SIGTERM as before;
:func:`stop_all` (session end) ends what is left.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

#: seconds a spawned group gets between SIGTERM and SIGKILL when the session is terminated
TERM_GRACE_S = 3.0


def stop_all(timeout_s: float = TERM_GRACE_S) -> list[int]:
    """End every server group the session spawned that is still running (nothing if the helpers
    were never imported). Returns the groups signalled."""
    testing = sys.modules.get("sim.emulator.testing")
    return testing.stop_spawned(timeout_s) if testing is not None else []


def _on_sigterm(signum: int, frame: Any) -> None:  # noqa: ARG001 (signal handler signature)
    stop_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)  # then end as SIGTERM would have: status -15, no teardown


def install() -> None:
    """Take SIGTERM in this process (the main thread's; elsewhere nothing is done) for the session."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _on_sigterm)
