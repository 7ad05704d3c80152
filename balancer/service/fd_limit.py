"""The open-file limit of ``pdlb serve`` and the client-connection cap it can hold.

Every client connection, engine connection, pipe and file of a router process takes a file
descriptor. With a soft ``RLIMIT_NOFILE`` below ``max_connections`` (1,024 is a common default: many
shells and systemd services) a flood of idle connections used up every descriptor before the cap
closed any (issue 25 review finding F1): ``accept()`` failed with ``EMFILE``, engine legs could not
open sockets, nobody was served, and asyncio logged one traceback per failed accept (thousands a
second). So at start :func:`raise_nofile_limit` raises the soft limit toward the hard one, and
:func:`effective_max_connections` lowers the cap to what the descriptors left can hold;
:func:`install_accept_error_limit` rate-limits asyncio's "out of system resource" records.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from balancer.service.log_limit import RateLimitedLog

__all__ = ["FD_RESERVE", "effective_max_connections", "install_accept_error_limit", "raise_nofile_limit"]

FD_RESERVE = 128
"""Descriptors kept for what is not a connection: the listening socket, pipes, shared-memory
files, the body-offload pool, log files, imports (a count, not bytes)."""

log = logging.getLogger("pdlb.service")

ACCEPT_ERRORS_LOG = RateLimitedLog(log, interval_s=10.0)
"""One line per 10 s for failed accepts (asyncio re-reports them once per backlog slot)."""


def wanted_nofile(max_connections: int) -> int:
    """Descriptors a router process wants for ``max_connections`` client connections: one each,
    one more each for its engine leg (a prefill/decode request holds up to two briefly, most hold
    one or none), plus :data:`FD_RESERVE`."""
    return 2 * max_connections + FD_RESERVE


def raise_nofile_limit(max_connections: int) -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` toward its hard limit, as far as
    :func:`wanted_nofile` (never lower it); returns the soft limit now in force (a count of
    descriptors; a very large number where unlimited). Children started later inherit it.
    Platforms without the ``resource`` module: nothing is changed, returns :func:`wanted_nofile`."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return wanted_nofile(max_connections)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted_nofile(max_connections)
    want = wanted_nofile(max_connections)
    target = want if hard == resource.RLIM_INFINITY else min(hard, want)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # e.g. above the kernel's nr_open: keep what we have
            pass
    return int(soft)


def effective_max_connections(max_connections: int, nofile_soft: int) -> int:
    """The client-connection cap a process with ``nofile_soft`` descriptors can hold:
    ``max_connections``, or fewer so that each connection keeps one descriptor for an engine leg
    and :data:`FD_RESERVE` stay free, i.e. ``min(max_connections, (nofile_soft - FD_RESERVE) // 2)``,
    at least 1 (counts of connections and descriptors)."""
    return max(1, min(max_connections, (nofile_soft - FD_RESERVE) // 2))


def install_accept_error_limit(loop: asyncio.AbstractEventLoop) -> None:
    """Route ``loop``'s "socket.accept() out of system resource" records (``EMFILE``/``ENFILE``/...,
    one per listening-backlog slot on every retry) through :data:`ACCEPT_ERRORS_LOG`: one short line
    per 10 s with the count left out, no traceback. Other records go to the handler in place
    before (or the loop's default)."""
    previous = loop.get_exception_handler()

    def handler(lp: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if "out of system resource" in str(context.get("message", "")):
            ACCEPT_ERRORS_LOG.log(logging.ERROR, "accept", time.monotonic(),
                                  "cannot accept a client connection: %s (raise the open-file limit or lower "
                                  "max_connections)", context.get("exception"))
            return
        if previous is not None:
            previous(lp, context)
        else:
            lp.default_exception_handler(context)

    loop.set_exception_handler(handler)
