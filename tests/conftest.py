"""Test-session guards shared by every test module."""

from __future__ import annotations

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
