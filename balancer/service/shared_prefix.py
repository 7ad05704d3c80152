"""Approximate prefix views shared by the processes of one ``pdlb serve --processes N``.

In approximate mode a router only knows the prompts it routed; N processes behind one port
would keep N partial views (the simulator measures the cost: ``python -m sim.experiments.k_routers``,
prefix hit rate 33.0% with one router, 10.6% with 8 independent ones). Here every process
publishes each decision (the chosen replicas and the prompt's block hashes, msgpack) on its own
ZMQ PUB socket (``ipc://`` in a private directory the parent creates) and subscribes to all the
others, recording their decisions with :meth:`balancer.router.Router.record_routed`. The reader is
an asyncio task of the event loop (``zmq.asyncio``), so the router is touched by one thread.
Decisions are sent in batches: those made within :data:`FLUSH_INTERVAL_S` of the first queued one
go out together in one message (at most :data:`MAX_BATCH` per message, sent at once when full), so
the N - 1 receivers each wake at most once per interval, not once per request: with a message per
decision, two processes at 800 requests/s spent 140-240 us more CPU per request in approximate mode
than in events mode, which shares nothing (ZMQ's I/O threads and the receivers' wake-ups; one
process's whole cost was 350-370 us). A decision reaches the others at most that much later, which
an approximate index can afford (a request routed meanwhile by another process misses that
prefix, as without the share).

Delivery is best effort (ZMQ PUB drops what a slow subscriber cannot take, and nothing is sent
before the subscriptions join): an approximate index is a guess anyway; a lost message costs a
missed prefix hit, never a wrong route.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Collection

import msgpack
import zmq
import zmq.asyncio

from balancer.router import Router
from balancer.types import ReplicaId

__all__ = ["MAX_BATCH", "PrefixShare", "endpoint"]

log = logging.getLogger("pdlb.shared_prefix")

MAX_BATCH = 256
"""Most decisions in one message."""
FLUSH_INTERVAL_S = 0.005
"""Longest a decision waits for others to share its message."""


def endpoint(directory: str, index: int) -> str:
    """The ``ipc://`` endpoint process ``index`` publishes on."""
    return f"ipc://{os.path.join(directory, f'prefix-{index}.sock')}"


class PrefixShare:
    """One process's side (see the module docstring): ``start()`` in the event loop, ``close()`` at exit."""

    def __init__(self, router: Router, directory: str, processes: int, index: int) -> None:
        self.router = router
        self.index = index
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(endpoint(directory, index))
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        for k in range(processes):
            if k != index:
                self._sub.connect(endpoint(directory, k))
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batch: list[list] = []
        self._timer: asyncio.TimerHandle | None = None
        self.sent = 0  # decisions sent
        self.received = 0  # decisions received
        self.dropped = 0  # decisions dropped (full send queue)
        self.messages = 0  # messages sent (batches)
        router.on_routed = self.publish

    def publish(self, replicas: Collection[ReplicaId], block_hashes: tuple[int, ...], now_s: float) -> None:
        """Queue one decision for the other processes; it is sent with those of the next
        :data:`FLUSH_INTERVAL_S` (at once before :meth:`start`). Never blocks; a full send queue
        drops the batch."""
        self._batch.append([[[r.engine, r.dp_rank] for r in replicas], list(block_hashes), now_s])
        if self._loop is None or len(self._batch) >= MAX_BATCH:
            self.flush()
        elif len(self._batch) == 1:
            self._timer = self._loop.call_later(FLUSH_INTERVAL_S, self.flush)

    def flush(self) -> None:
        """Send the queued decisions as one message."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._batch = self._batch, []
        if not batch:
            return
        try:
            self._pub.send(msgpack.packb(batch), zmq.NOBLOCK)
            self.sent += len(batch)
            self.messages += 1
        except zmq.Again:
            self.dropped += len(batch)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._read())

    async def _read(self) -> None:
        while True:
            try:
                msg = await self._sub.recv()
                batch = msgpack.unpackb(msg)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a bad message is skipped, the reader lives on
                log.warning("shared prefix message skipped: %s", e)
                continue
            for item in batch if isinstance(batch, list) else ():
                try:
                    reps, hashes, now_s = item
                    self.router.record_routed([ReplicaId(e, int(d)) for e, d in reps], tuple(hashes), float(now_s))
                    self.received += 1
                except Exception as e:  # noqa: BLE001 - a bad decision is skipped, the reader lives on
                    log.warning("shared prefix decision skipped: %s", e)

    async def close(self) -> None:
        self.router.on_routed = None
        self.flush()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._pub.close(0)
        self._sub.close(0)
        self._ctx.term()
