"""KV cache events of an emulated engine (``pdlb engine --kv-events``), on vLLM's wire.

So that the router's events mode (``pdlb serve --index-mode events``, a worker spec's
``events=``/``replay=``) can be tried with the emulator alone. The wire is vLLM's ZMQ publisher's
(``vllm/distributed/kv_events.py`` as of 0.33; the facts in ``docs`` ANCHORS "vLLM KV cache
events"), written here from that description:

* One ZMQ PUB socket per DP rank, rank ``r`` on the configured port + ``r``; each message is the
  multipart ``[topic, seq, payload]``, ``topic`` empty, ``seq`` an 8-byte big-endian batch counter
  from 0 per rank (reset when the engine restarts).
* ``payload`` = msgpack of the batch ``[ts, events, data_parallel_rank]`` (an array); each event a
  map with its ``"type"``: ``{"type": "BlockStored", "block_hashes", "parent_block_hash",
  "token_ids", "block_size", "lora_id", "medium", "lora_name"}`` (``token_ids``: every stored
  block's tokens, concatenated) or ``{"type": "BlockRemoved", "block_hashes", "medium"}``;
  ``medium`` ``"GPU"`` (the emulator's HBM prefix cache). Block hashes are the emulator's own
  64-bit ints (:func:`balancer.hashing.hash_token_blocks` of the engine's block size): to the
  router, as real engines' hashes, opaque ids.
* Replay: a ROUTER socket per rank (configured port + ``r``): a request ``[identity, b"",
  start_seq]`` is answered with ``[identity, b"", topic, seq, payload]`` for every buffered batch
  numbered ``>= start_seq``, then the end marker ``[identity, b"", b"", -1 (signed 8-byte BE), b""]``.

What is published: a prompt's blocks when its prefill finishes (the rank's prefix cache stores
them) and blocks the cache evicts, batched every :data:`FLUSH_S`. Only blocks whose token ids the
emulator knows are announced as stored: prompts given as token ids (a completion's token-id
``prompt``, ``/generate``'s ``input_ids``). A text prompt's blocks are hashed by characters in the
emulator (it has no tokenizer), which no router could match to tokens, so they are not announced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

import msgpack

__all__ = ["FLUSH_S", "KvEventPublisher", "offset_endpoint"]

log = logging.getLogger("pdlb.engine.kv_events")

FLUSH_S = 0.02
"""Seconds between batches (events of one interval go out together, as an engine step's do)."""
BUFFER_BATCHES = 10_000
"""Batches kept per rank for replay (vLLM's ``buffer_steps`` default)."""
TOKEN_MAP_BLOCKS = 1 << 20
"""Most blocks whose token ids the publisher remembers (least recently registered forgotten)."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM = {"hbm": "GPU", "host": "CPU"}


def offset_endpoint(endpoint: str, dp_rank: int) -> str:
    """``endpoint`` with its TCP port raised by ``dp_rank`` (``tcp://host:5557`` -> ``:5558`` for
    rank 1), as vLLM offsets each DP rank's publisher.

    Raises:
        ValueError: not ``tcp://host:port``.
    """
    head, sep, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit():
        raise ValueError(f"KV events endpoint {endpoint!r}: expected tcp://HOST:PORT")
    return f"{head}:{int(port) + dp_rank}"


class KvEventPublisher:
    """Publishes the KV events of an emulated engine's DP ranks (module docstring).

    Args:
        endpoint: rank 0's PUB endpoint, ``tcp://HOST:PORT`` (rank ``r`` binds PORT + ``r``).
        replay_endpoint: rank 0's replay ROUTER endpoint (same offsets), or None for no replay.
        dp_ranks: ranks of the engine.
        block_size: tokens per block (the engine's).
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None, dp_ranks: int, block_size: int) -> None:
        self.endpoints = [offset_endpoint(endpoint, r) for r in range(dp_ranks)]
        self.replay_endpoints = [offset_endpoint(replay_endpoint, r) for r in range(dp_ranks)] if replay_endpoint else []
        self.block_size = block_size
        self._tokens: OrderedDict[int, tuple[int | None, tuple[int, ...]]] = OrderedDict()
        self._pending: list[list[dict[str, Any]]] = [[] for _ in range(dp_ranks)]
        self._seq = [0] * dp_ranks
        self._buffers: list[deque[tuple[int, bytes]]] = [deque(maxlen=BUFFER_BATCHES) for _ in range(dp_ranks)]
        self._ctx: Any = None
        self._pubs: list[Any] = []
        self._replays: list[Any] = []
        self._tasks: list[asyncio.Task] = []
        self._wake = asyncio.Event()
        self.published_batches = 0

    # ------------------------------------------------------------------ inputs
    def register(self, block_hashes: Sequence[int], token_ids: Sequence[int]) -> None:
        """The token ids of a prompt's blocks (``block_hashes[i]`` covers ``token_ids[i*bs:(i+1)*bs]``)."""
        bs, parent = self.block_size, None
        for i, h in enumerate(block_hashes):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            if len(tokens) < bs:
                break
            self._tokens[h] = (parent, tokens)
            self._tokens.move_to_end(h)
            parent = h
        while len(self._tokens) > TOKEN_MAP_BLOCKS:
            self._tokens.popitem(last=False)

    def on_change(self, medium: str, stored: bool, block_hashes: Sequence[int], rank_index: int) -> None:
        """The engine's prefix-cache listener (:attr:`sim.run.engine.rank.Rank.kv_listener`): queue the
        events for the next batch of rank ``rank_index``."""
        if not block_hashes or not 0 <= rank_index < len(self._pending):
            return
        m = MEDIUM.get(medium, medium.upper())
        out = self._pending[rank_index]
        if not stored:
            out.append({"type": "BlockRemoved", "block_hashes": [int(h) for h in block_hashes], "medium": m})
        else:
            run: list[int] = []
            tokens: list[int] = []
            first_parent: int | None = None
            for h in block_hashes:
                known = self._tokens.get(h)
                if known is None or (run and known[0] != run[-1]):  # unknown tokens, or a new chain
                    if run:
                        out.append(self._stored(run, first_parent, tokens, m))
                    run, tokens = [], []
                    if known is None:
                        continue
                if not run:
                    first_parent = known[0]
                run.append(int(h))
                tokens.extend(known[1])
            if run:
                out.append(self._stored(run, first_parent, tokens, m))
        self._wake.set()

    def _stored(self, run: list[int], parent: int | None, tokens: list[int], medium: str) -> dict[str, Any]:
        return {"type": "BlockStored", "block_hashes": run, "parent_block_hash": parent, "token_ids": tokens,
                "block_size": self.block_size, "lora_id": None, "medium": medium, "lora_name": None}

    # ------------------------------------------------------------------ sockets
    def start(self) -> None:
        """Bind the sockets and start publishing (inside the running event loop).

        Raises:
            zmq.ZMQError: an endpoint cannot be bound (e.g. the port is in use).
        """
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        try:
            for ep in self.endpoints:
                s = self._ctx.socket(zmq.PUB)
                s.setsockopt(zmq.LINGER, 0)
                self._pubs.append(s)
                s.bind(ep)
            for ep in self.replay_endpoints:
                s = self._ctx.socket(zmq.ROUTER)
                s.setsockopt(zmq.LINGER, 0)
                self._replays.append(s)
                s.bind(ep)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._tasks = [asyncio.create_task(self._flush_loop())]
        self._tasks += [asyncio.create_task(self._replay_loop(r)) for r in range(len(self._replays))]

    async def stop(self) -> None:
        """Publish what is pending, stop the tasks and close the sockets."""
        await self._flush()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing anyway
                pass
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (*self._pubs, *self._replays):
            s.close(0)
        self._pubs, self._replays = [], []
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(FLUSH_S)
            self._wake.clear()
            await self._flush()

    async def _flush(self) -> None:
        for r, events in enumerate(self._pending):
            if not events or r >= len(self._pubs):
                continue
            self._pending[r] = []
            payload = msgpack.packb([time.time(), events, r], use_bin_type=True)
            seq = self._seq[r]
            self._seq[r] += 1
            self._buffers[r].append((seq, payload))
            await self._pubs[r].send_multipart((b"", seq.to_bytes(8, "big"), payload))
            self.published_batches += 1

    async def _replay_loop(self, r: int) -> None:
        sock = self._replays[r]
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                log.warning("KV events replay (rank %d): a request of %d frames ignored", r, len(frames))
                continue
            ident, _, start = frames
            start_seq = int.from_bytes(start[:8], "big")
            for seq, payload in list(self._buffers[r]):
                if seq >= start_seq:
                    await sock.send_multipart((ident, b"", b"", seq.to_bytes(8, "big"), payload))
            await sock.send_multipart((ident, b"", b"", END_SEQ, b""))
