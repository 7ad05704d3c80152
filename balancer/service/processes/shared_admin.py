"""Admin changes (add / remove a worker) reaching every process of one ``pdlb serve --processes N``.

The kernel hands an admin request (``POST`` / ``DELETE /workers``) to one router process. That
process checks it (authentication, the body, a duplicate or unknown URL: answered at once) and
sends it to the parent over its control pipe (the pipe it reported ``ready`` on). The parent,
:class:`AdminCoordinator`, runs one change at a time, in arrival order:

1. for an add it assigns the new worker's DP ranks free columns of the shared load block
   (:mod:`balancer.service.processes.shared_load`);
2. it sends the change to **every** process (the one that asked included) and waits for each one's
   answer; each applies it to its worker pool, router, shared-load view and KV-event subscriber;
3. if any process refused an add or did not answer within :data:`APPLY_TIMEOUT_S`, the processes
   that applied it are told to undo it (the worker is removed again), so the worker set stays the
   same in every process; a removal is not undone (a process that no longer has the worker counts
   as done; one that does not answer is dying, and the parent then stops them all); then the
   asking process gets the result and answers its client (201 / 200, or the refusal: 409, 404,
   503).

So a change is all-or-nothing and every process applies the changes in one order: the processes'
worker sets (and their shared-load columns) agree whenever no change is in progress. Between the
first and the last process applying a change, a request may be routed by the old or the new set
(as with one process, where a request routed just before a removal still finishes on the old
worker).

Messages (tuples over ``multiprocessing`` pipes): process -> parent ``("admin", req_id, op,
payload)``, ``("ack", op_id, ok, info)``; parent -> process ``("apply", op_id, op, payload, columns)``
and ``("result", req_id, ok, info)``; ``op`` is ``"add"`` (payload: the worker config dict) or
``"remove"`` (payload: the URL); a refusal's ``info`` is ``[status, message]``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

log = logging.getLogger("pdlb.service")

__all__ = ["APPLY_TIMEOUT_S", "AdminChannel", "AdminCoordinator", "AdminRefused"]

APPLY_TIMEOUT_S = 30.0
"""Seconds the parent waits for every process to apply one change (an add whose worker has KV
events starts a subscriber process: about a second)."""


class AdminRefused(Exception):
    """A change was refused: ``status`` (HTTP) and ``message`` for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


# ---------------------------------------------------------------------- parent side
class AdminCoordinator:
    """The parent's side: serialises changes, assigns shared-load columns, fans changes out.

    Args:
        conns: one duplex pipe per router process, by process index.
        columns: the shared-load columns of the configured workers, ``{url: [column per DP rank]}``.
        capacity: columns in the shared load block.
        alive: ``alive(i)`` is False once process ``i`` died (the parent stops everything then).
    """

    def __init__(self, conns: Sequence[Connection], columns: dict[str, list[int]], capacity: int,
                 alive: Callable[[int], bool] = lambda i: True) -> None:
        self.conns = list(conns)
        self.columns = {url: list(c) for url, c in columns.items()}
        self.capacity = capacity
        self.alive = alive
        used = {c for cs in self.columns.values() for c in cs}
        self._next = max(used, default=-1) + 1
        self._free = sorted(set(range(self._next)) - used, reverse=True)
        self._ops = itertools.count()
        self._queue: deque[tuple[int, Any]] = deque()  # (process index, message) not yet handled
        self.changes = 0  # changes applied everywhere

    # -------------------------------------------------------------- columns
    def _take(self, n: int) -> list[int]:
        if len(self._free) + (self.capacity - self._next) < n:
            raise AdminRefused(409, f"the shared load block has no room for {n} more DP ranks "
                                    f"({self.capacity} in all)")
        out: list[int] = []
        while len(out) < n and self._free:
            out.append(self._free.pop())
        while len(out) < n:
            out.append(self._next)
            self._next += 1
        return out

    def _give_back(self, cols: list[int]) -> None:
        self._free.extend(cols)
        self._free.sort(reverse=True)

    # -------------------------------------------------------------- messages
    def poll(self, timeout_s: float) -> None:
        """Handle what the processes sent within ``timeout_s`` (the parent's main loop calls it)."""
        self._receive(timeout_s)
        while self._queue:
            i, msg = self._queue.popleft()
            if msg[0] == "admin":
                self._handle(i, msg)
            # an "ack" outside a change (its change timed out) is dropped

    def _receive(self, timeout_s: float) -> None:
        live = {id(c): (i, c) for i, c in enumerate(self.conns) if not c.closed}
        for ready in wait([c for _, c in live.values()], timeout_s):
            i, c = live[id(ready)]
            try:
                while c.poll():
                    self._queue.append((i, c.recv()))
            except (EOFError, OSError):
                c.close()  # the process died; the parent's liveness check stops the others

    def _send(self, i: int, msg: tuple) -> bool:
        try:
            self.conns[i].send(msg)
            return True
        except (OSError, ValueError):
            return False

    def _handle(self, origin: int, msg: tuple) -> None:
        _, req_id, op, payload = msg
        try:
            info = self.apply_everywhere(op, payload)
            ok, out = True, info
        except AdminRefused as e:
            ok, out = False, [e.status, e.message]
        self._send(origin, ("result", req_id, ok, out))

    def apply_everywhere(self, op: str, payload: Any) -> Any:
        """Apply one change in every process (undoing it where applied if any process refuses);
        returns the asking process's answer (``None`` here). Raises :class:`AdminRefused`."""
        if op == "add":
            url, dp = str(payload["url"]).rstrip("/"), int(payload.get("dp_size", 1))
            if url in self.columns:
                raise AdminRefused(409, f"worker {url} is already registered")
            cols = self._take(dp)
            refused = self._fan_out("add", payload, cols)
            if refused is not None:
                self._give_back(cols)
                raise refused
            self.columns[url] = cols
        elif op == "remove":
            url = str(payload).rstrip("/")
            if url not in self.columns:
                raise AdminRefused(404, f"no worker {url}")
            refused = self._fan_out("remove", url, [])
            if refused is not None:
                raise refused
            self._give_back(self.columns.pop(url))
        else:
            raise AdminRefused(400, f"unknown admin change {op!r}")
        self.changes += 1
        return None

    def _fan_out(self, op: str, payload: Any, cols: list[int]) -> AdminRefused | None:
        """Send one change to every process and collect the answers; on any refusal or timeout,
        undo it where it was applied and return the refusal."""
        op_id = next(self._ops)
        pending = {i for i in range(len(self.conns)) if self._send(i, ("apply", op_id, op, payload, cols))}
        failed: AdminRefused | None = None
        if len(pending) < len(self.conns):
            failed = AdminRefused(503, "a router process is not reachable")
        applied: set[int] = set()
        deadline = time.monotonic() + APPLY_TIMEOUT_S
        while pending:
            left = deadline - time.monotonic()
            if left <= 0 or not all(self.alive(i) for i in pending):
                failed = failed or AdminRefused(503, f"a router process did not apply the change within "
                                                     f"{APPLY_TIMEOUT_S:g} s")
                break
            self._receive(min(left, 0.2))
            keep: deque[tuple[int, Any]] = deque()
            while self._queue:
                i, msg = self._queue.popleft()
                if msg[0] == "ack" and msg[1] == op_id and i in pending:
                    pending.discard(i)
                    if msg[2] or (op == "remove" and msg[3][0] == 404):  # a removal finds it gone: done
                        applied.add(i)
                    elif failed is None:
                        failed = AdminRefused(int(msg[3][0]), str(msg[3][1]))
                else:
                    keep.append((i, msg))  # another admin request: after this change
            self._queue = keep
        if failed is None:
            return None
        if op == "add" and applied:  # undo where applied (best effort: a process that fails here is dying)
            url = str(payload["url"]).rstrip("/")
            undo_id = next(self._ops)
            for i in applied:
                self._send(i, ("apply", undo_id, "remove", url, []))
            log.warning("admin: adding %s failed in some router process (%s); removed again", url, failed.message)
        return failed


# ---------------------------------------------------------------------- process side
Apply = Callable[[str, Any, list[int]], Awaitable[None]]


class AdminChannel:
    """A router process's side, on its event loop.

    Args:
        conn: the duplex pipe to the parent.
        apply: ``await apply(op, payload, columns)`` applies one change to this process (raises
            :class:`AdminRefused` to refuse it).
    """

    def __init__(self, conn: Connection, apply: Apply) -> None:
        self.conn = conn
        self.apply = apply
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self._inbox: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._inbox = asyncio.Queue()
        self._loop.add_reader(self.conn.fileno(), self._readable)
        self._task = self._loop.create_task(self._run())

    def _readable(self) -> None:
        assert self._inbox is not None
        try:
            while self.conn.poll():
                self._inbox.put_nowait(self.conn.recv())
        except (EOFError, OSError):  # the parent is gone: stop reading (the process is being stopped)
            assert self._loop is not None
            self._loop.remove_reader(self.conn.fileno())

    async def _run(self) -> None:
        assert self._inbox is not None
        while True:
            msg = await self._inbox.get()
            if msg[0] == "result":
                fut = self._waiting.pop(msg[1], None)
                if fut is not None and not fut.done():
                    fut.set_result((msg[2], msg[3]))
            elif msg[0] == "apply":
                _, op_id, op, payload, cols = msg
                ack: tuple[str, int, bool, list | None]
                try:
                    await self.apply(op, payload, cols)
                    ack = ("ack", op_id, True, None)
                except AdminRefused as e:
                    ack = ("ack", op_id, False, [e.status, e.message])
                except Exception as e:  # noqa: BLE001 - reported to the parent, which undoes the change
                    log.exception("admin change %s failed in this router process", op)
                    ack = ("ack", op_id, False, [500, f"{type(e).__name__}: {e}"])
                self._send(ack)

    def _send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except (OSError, ValueError):
            log.warning("admin: the parent process is gone")

    async def request(self, op: str, payload: Any, timeout_s: float = APPLY_TIMEOUT_S + 10) -> Any:
        """Ask the parent to apply ``op`` everywhere; returns when every process applied it.

        Raises:
            AdminRefused: refused (by a process's pool, or a process did not answer).
        """
        assert self._loop is not None, "start() first"
        req_id = next(self._ids)
        fut = self._waiting[req_id] = self._loop.create_future()
        self._send(("admin", req_id, op, payload))
        try:
            ok, info = await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise AdminRefused(503, f"the change was not confirmed within {timeout_s:g} s") from None
        finally:
            self._waiting.pop(req_id, None)
        if not ok:
            raise AdminRefused(int(info[0]), str(info[1]))
        return info

    async def close(self) -> None:
        if self._loop is not None and not self.conn.closed:
            try:
                self._loop.remove_reader(self.conn.fileno())
            except (ValueError, OSError):
                pass
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
