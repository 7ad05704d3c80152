"""A stand-in engine KV-event publisher for tests, written from the wire-format description
(ANCHORS.md "vLLM KV cache events"; vLLM ``vllm/distributed/kv_events.py``), not from pdlb code.

It builds msgpack payloads by hand with ``msgpack.packb``: positional arrays with the tag first
(SGLang / older vLLM) or maps with a ``"type"`` key (current vLLM), and its own engine block
hashes: sha256 of (parent hash, token ids), as a 64-bit int (low 8 bytes, vLLM's default) or the
32-byte digest. ZMQ: PUB multipart ``[topic, seq (8-byte BE), payload]`` and a ROUTER replay socket
answering ``[identity, b"", start_seq]`` with ``[identity, b"", topic, seq, payload]`` ... and the
end marker ``[identity, b"", b"", seq = -1 (signed 8-byte BE), b""]``: the framing of vLLM 0.33's
and SGLang 0.5.23's ``ZmqEventPublisher._service_replay`` (``tests/service/test_engine_conformance.py`` runs
their own code). ``replay_frames=3`` answers without the topic frame (older publishers).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque

import msgpack
import zmq


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeEngine:
    """One engine DP rank publishing KV events on 127.0.0.1.

    Args:
        encoding: ``"array"`` (positional, tag first) or ``"map"`` (``{"type": ...}``).
        hash_kind: ``"int"`` (64-bit) or ``"bytes"`` (32-byte sha256 digest).
        block_size: the engine's block size (tokens).
        dp_rank: written into the batch (``"array"`` with ``dp_in_batch``: third element).
        sglang: positional BlockStored without medium/lora_name (SGLang's shape) and batches ``[ts, events]``.
    """

    def __init__(self, encoding: str = "array", hash_kind: str = "int", block_size: int = 16, dp_rank: int = 0,
                 port: int | None = None, replay_port: int | None = None, sglang: bool = False,
                 replay_frames: int = 4) -> None:
        self.encoding, self.hash_kind, self.block_size, self.dp_rank, self.sglang = encoding, hash_kind, block_size, dp_rank, sglang
        self.replay_frames = replay_frames
        self.replay_silent = False  # True: replay requests are received and never answered (a sick engine)
        self.replay_gate: threading.Event | None = None  # set: replies wait until the event is set (a slow replay)
        self.ctx = zmq.Context()
        # XPUB: a PUB socket (the same wire for subscribers) that also hands up each new
        # subscription, so a test can wait for a subscriber instead of sleeping a fixed time
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        # no port given: bound to a free one atomically (free_port() then bind raced other test
        # processes on a shared host: "Address already in use")
        if port:
            self.pub.bind(f"tcp://127.0.0.1:{port}")
            self.port = port
        else:
            self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        if replay_port:
            self.router.bind(f"tcp://127.0.0.1:{replay_port}")
            self.replay_port = replay_port
        else:
            self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=10_000)
        self.seq = 0
        self.replay_requests: list[int] = []
        self.replays_answered = 0  # replay requests answered in full (terminator sent)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    # -------------------------------------------------------------- engine hashes
    def block_hash(self, parent, tokens):  # noqa: ANN001, ANN201
        h = hashlib.sha256(repr(parent).encode() + b"|" + ",".join(map(str, tokens)).encode()).digest()
        return h if self.hash_kind == "bytes" else int.from_bytes(h[-8:], "little")

    def hashes(self, tokens: list[int], parent=None) -> list:  # noqa: ANN001
        """The engine hashes of ``tokens``' full blocks under ``parent``."""
        out, bs = [], self.block_size
        for i in range(len(tokens) // bs):
            parent = self.block_hash(parent, tokens[i * bs:(i + 1) * bs])
            out.append(parent)
        return out

    # -------------------------------------------------------------- events
    def stored(self, tokens: list[int], parent=None, lora_name=None, medium="GPU", extra_keys=None,  # noqa: ANN001
               lora_id=None, kind=None) -> tuple[list, object]:  # noqa: ANN001
        """A BlockStored event for the full blocks of ``tokens`` after ``parent``; returns (hashes, event)."""
        n = len(tokens) // self.block_size
        tokens = tokens[: n * self.block_size]
        hs = self.hashes(tokens, parent)
        if self.encoding == "map":
            ev = {"type": "BlockStored", "block_hashes": hs, "parent_block_hash": parent, "token_ids": tokens,
                  "block_size": self.block_size, "lora_id": lora_id, "medium": medium}
            if lora_name is not None:
                ev["lora_name"] = lora_name
            if extra_keys is not None:
                ev["extra_keys"] = extra_keys
            if kind is not None:
                ev["group_idx"] = 1
                ev["kv_cache_spec_kind"] = kind
        elif self.sglang:
            ev = ["BlockStored", hs, parent, tokens, self.block_size, lora_id]
        else:
            ev = ["BlockStored", hs, parent, tokens, self.block_size, lora_id, medium, lora_name]
            if extra_keys is not None or kind is not None:
                ev += [extra_keys, 1 if kind else None, kind]
        return hs, ev

    def removed(self, hashes: list, medium="GPU"):  # noqa: ANN001, ANN201
        if self.encoding == "map":
            return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
        return ["BlockRemoved", hashes] if self.sglang else ["BlockRemoved", hashes, medium]

    def cleared(self):  # noqa: ANN201
        return {"type": "AllBlocksCleared"} if self.encoding == "map" else ["AllBlocksCleared"]

    def payload(self, events: list, ts: float | None = None) -> bytes:
        ts = time.time() if ts is None else ts
        if self.encoding == "map":
            return msgpack.packb({"ts": ts, "events": events, "data_parallel_rank": self.dp_rank})
        if self.sglang:
            return msgpack.packb([ts, events])
        return msgpack.packb([ts, events, self.dp_rank])

    def publish(self, events: list, send: bool = True, ts: float | None = None) -> int:
        """Publish one batch (``send=False``: buffer it for replay but drop it on the wire: a gap)."""
        payload = self.payload(events, ts)
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        """The engine restarts: counter back to 0, replay buffer empty."""
        with self._lock:
            self.seq = 0
            self.buffer.clear()

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            if self.replay_silent:
                continue
            if self.replay_gate is not None:
                self.replay_gate.wait(10)
            with self._lock:
                items = [(s, p) for s, p in self.buffer if s >= start_seq]
            topic = [b""] if self.replay_frames == 4 else []
            for s, p in items:
                self.router.send_multipart([ident, b"", *topic, s.to_bytes(8, "big"), p])
            self.router.send_multipart([ident, b"", *topic, (-1).to_bytes(8, "big", signed=True), b""])
            self.replays_answered += 1

    def wait_subscribed(self, timeout_s: float = 10.0) -> None:
        """Block until a subscriber's subscription has reached this publisher (PUB/SUB joins
        asynchronously: what is published before that is lost to the subscriber); fails the
        test after ``timeout_s``."""
        if not self.pub.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no subscriber on {self.endpoint} within {timeout_s} s")
        msg = self.pub.recv()
        assert msg[:1] == b"\x01", msg  # 1 = subscribe, then the topic filter

    def wait_replays_answered(self, n: int = 1, timeout_s: float = 10.0) -> None:
        """Block until ``n`` replay requests have been answered in full (a subscriber asks for
        replay from 0 when it connects; events published before that answer could reach it by
        replay instead of live, hiding a gap a test means to make)."""
        end = time.monotonic() + timeout_s
        while self.replays_answered < n:
            if time.monotonic() > end:
                raise AssertionError(f"{self.replays_answered} of {n} replay requests answered within {timeout_s} s")
            time.sleep(0.005)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()
