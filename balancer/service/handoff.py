"""Client connections of ``pdlb serve --processes N``: the parent accepts them and hands them to the
router processes in turn.

With one ``SO_REUSEPORT`` listener per process the kernel hashes each new connection to one of
them, and keep-alive clients stay where they landed: 16 connections over 8 processes came out
as ``[4, 3, 3, 2, 1, 1, 1, 1]`` (and one process with none, 1 time in 3), so the busiest process
queued twice the mean load and set the router's added p99 latency. Here the parent listens alone,
accepts on a thread and passes each accepted socket (``SCM_RIGHTS``, :func:`socket.send_fds`) over
a Unix socket pair to the next process (round robin: 16 connections over 8 processes are 2 each);
the process adopts it into its aiohttp server (``loop.connect_accepted_socket``). Only the
connection's set-up passes through the parent (about 20 us of its CPU), never a request.
Node.js's ``cluster`` module schedules connections the same way by default, for the same reason.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from balancer.service.log_limit import RateLimitedLog

__all__ = ["Acceptor", "adopt_connections", "channel_pair"]

log = logging.getLogger("pdlb.handoff")

_BATCH_FDS = 64  # sockets read per message at most

RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""``accept()`` failures for want of a resource (asyncio's selector loop pauses accepting on the
same four): the connection stays in the backlog, so an immediate retry fails again."""
ACCEPT_RETRY_DELAY_S = 0.1
"""Seconds the parent's acceptor waits after such a failure before it accepts again (not a busy
loop; asyncio waits 1 s)."""


def channel_pair() -> tuple[socket.socket, socket.socket]:
    """The (parent's, process's) ends of one hand-off channel: a Unix ``SOCK_SEQPACKET`` pair,
    so that each handed socket is one message."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


class Acceptor:
    """The parent's side: accept on ``listener`` (bound; listened on here) in a daemon thread and
    send each connection to ``channels[i]`` in turn, skipping a channel whose process is gone (its
    socket then goes to the next; with none left the connection is closed). :meth:`retire` and
    :meth:`replace` take a dead process out and put its replacement in (``pdlb serve`` restarts
    dead processes, :mod:`balancer.service.processes.supervise`). :meth:`close` stops it and closes the
    listener.

    An ``accept()`` that fails for want of a resource (:data:`RESOURCE_ERRNOS`: the open-file limit,
    ...) is logged as one short line per 10 s with a count of those left out (as on the one-process
    path, :func:`balancer.service.fd_limit.install_accept_error_limit`), and accepting resumes after
    ``retry_delay_s`` (default :data:`ACCEPT_RETRY_DELAY_S`)."""

    def __init__(self, listener: socket.socket, channels: Sequence[socket.socket], backlog: int = 1024,
                 retry_delay_s: float = ACCEPT_RETRY_DELAY_S, placement: Any = None) -> None:
        self.listener = listener
        #: with a :class:`balancer.service.processes.placement.PlacementControl`, each connection goes
        #: to the process it picks (the active one holding the fewest) instead of the next in turn
        self.placement = placement
        self.channels = list(channels)
        self.handed = [0] * len(self.channels)  # connections passed to each process
        self.dead: set[int] = set()  # processes handed nothing (gone, or being replaced)
        self._lock = threading.Lock()
        self._closed = False
        self.retry_delay_s = retry_delay_s
        #: failed accepts, logged at most once per 10 s
        self.errors_log = RateLimitedLog(log, interval_s=10.0)
        listener.listen(backlog)
        self._thread = threading.Thread(target=self._run, name="pdlb-accept", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i = 0
        while not self._closed:
            try:
                conn, _ = self.listener.accept()
            except OSError as e:
                if self._closed:
                    return
                if e.errno in RESOURCE_ERRNOS:
                    self.errors_log.log(logging.ERROR, "accept", time.monotonic(),
                                        "cannot accept a client connection: %s (raise the open-file limit or lower "
                                        "max_connections)", e)
                    time.sleep(self.retry_delay_s)
                continue  # e.g. ECONNABORTED: the next one
            try:
                with self._lock:  # against retire / replace from the parent's main thread
                    if self.placement is not None:
                        self._place(conn)
                        continue
                    n = len(self.channels)
                    for _ in range(n):
                        k, i = i, (i + 1) % n
                        if k in self.dead:
                            continue
                        try:
                            socket.send_fds(self.channels[k], [b"c"], [conn.fileno()])
                            self.handed[k] += 1
                            break
                        except OSError:  # that process exited (its end is closed)
                            self.dead.add(k)
            finally:
                conn.close()  # the process holds its own duplicate now

    def _place(self, conn: socket.socket) -> None:
        """Hand ``conn`` to the process the placement picks (another if that one is gone)."""
        placement = self.placement
        for _ in range(len(self.channels)):
            k = placement.pick(self.dead)
            if k is None:
                return
            try:
                socket.send_fds(self.channels[k], [b"c"], [conn.fileno()])
                self.handed[k] += 1
                placement.handed(k)
                return
            except OSError:  # that process exited (its end is closed)
                self.dead.add(k)

    def retire(self, k: int) -> None:
        """Process ``k`` died: hand it nothing more, close the parent's end of its channel (what was
        sent to it and not yet taken is lost with it)."""
        with self._lock:
            self.dead.add(k)
            self.channels[k].close()

    def replace(self, k: int, channel: socket.socket) -> None:
        """Process ``k``'s replacement is ready: hand it connections on ``channel`` from now on."""
        with self._lock:
            old, self.channels[k] = self.channels[k], channel
            old.close()
            self.dead.discard(k)
            if self.placement is not None:
                self.placement.reset(k)

    def close(self) -> None:
        """Stop accepting; tell every process ``pdlb serve`` stops (a ``b"s"`` on its channel, so
        it does not take the channel's end for its parent's death) and close the channels."""
        self._closed = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self.listener.close()
        self._thread.join(5)
        with self._lock:
            for k, ch in enumerate(self.channels):
                if k not in self.dead:
                    try:
                        ch.send(STOP)
                    except OSError:  # that process exited, or its buffer is full: it sees the close
                        pass
                ch.close()


#: The byte the parent sends before it closes a channel on purpose (a connection comes with b"c").
STOP = b"s"


def adopt_connections(channel: socket.socket, protocol_factory: Callable[[], asyncio.Protocol],
                      on_parent_gone: Callable[[], None] | None = None,
                      on_stop: Callable[[], None] | None = None,
                      on_adopted: Callable[[], None] | None = None) -> Callable[[], None]:
    """A router process's side: read handed-over sockets from ``channel`` in the running event
    loop and serve each with ``protocol_factory`` (the aiohttp server); returns the function that
    stops (call before the runner's cleanup). ``on_stop`` is called once when the parent says
    ``pdlb serve`` stops (:data:`STOP`, sent by :meth:`Acceptor.close`); ``on_parent_gone`` once
    if the channel reaches end of file or fails without it (the parent died: no connection will
    come again, and nobody else will clean up). A process cannot tell the two apart by its parent
    pid: the kernel closes a dying parent's files before it re-parents its children. ``on_adopted``
    is called for each connection taken (the connection placement counts them)."""
    loop = asyncio.get_running_loop()
    channel.setblocking(False)
    pending: set[asyncio.Task] = set()

    def readable() -> None:
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(channel, _BATCH_FDS, _BATCH_FDS)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("connection hand-off channel failed: %s", e)
                stop()
                if on_parent_gone is not None:
                    on_parent_gone()
                return
            if STOP in msg:  # the parent stops pdlb serve (connections sent before it are served)
                for fd in fds:
                    _serve(fd)
                stop()
                if on_stop is not None:
                    on_stop()
                return
            if not msg and not fds:  # end of file without STOP: the parent is gone
                stop()
                if on_parent_gone is not None:
                    on_parent_gone()
                return
            for fd in fds:
                _serve(fd)

    def _serve(fd: int) -> None:
        if on_adopted is not None:
            on_adopted()
        sock = socket.socket(fileno=fd)
        t = loop.create_task(loop.connect_accepted_socket(protocol_factory, sock))
        pending.add(t)
        t.add_done_callback(_done)

    def _done(t: asyncio.Task) -> None:
        pending.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.warning("handed-over connection not served: %s", t.exception())

    stopped = False

    def stop() -> None:
        nonlocal stopped
        if stopped:
            return
        stopped = True
        loop.remove_reader(channel.fileno())
        channel.close()

    loop.add_reader(channel.fileno(), readable)
    return stop
