"""Test-session guards shared by every test module."""

from __future__ import annotations

import os

try:
    import zmq
except ImportError:  # pyzmq is a test dependency; without it the KV-event tests skip
    zmq = None

if zmq is not None:
    # A zmq.Context that a failed test left behind (its publisher or subscriber never closed) is
    # destroyed by the garbage collector wherever it runs next, and Context.term() then blocks
    # for as long as any of its sockets is open in another thread: a CI run hung for good inside
    # an unrelated hypothesis test after one KV test failed. In tests a leaked context is leaked,
    # never terminated from a finaliser; the failure itself is still reported.
    zmq.Context.__del__ = lambda self: None  # type: ignore[method-assign]


def pytest_sessionstart(session) -> None:  # noqa: ANN001
    """Compile ep_aware's numba loops (balancer/kernels.py) once, in this process, before any test
    starts router processes: on a fresh clone the first compile takes seconds, and several spawned
    ``pdlb serve`` processes compiling at once would eat a test's start-up timeout. Later processes
    load numba's cache. Without numba this does nothing."""
    from balancer import kernels

    kernels.compiled()


if os.environ.get("PDLB_TEST_EVENT_LOOP") == "uvloop":  # the in-process tests on uvloop (issue 26)
    import uvloop

    def pytest_asyncio_loop_factories(config, item):  # noqa: ANN001, ANN201
        """pytest-asyncio's event loop for every async test: uvloop's."""
        return {"uvloop": uvloop.new_event_loop}
