"""``dp_consistent_hash``: vllm-router's DP-aware consistent hashing (a hash ring, load-blind).

What vllm-router (vllm-project/router, PyPI ``vllm-router``; read in the 0.1.17 sdist,
``src/policies/consistent_hash.rs`` and ``hash_key.rs``; AgentX point 440246 ran 0.1.14 with
``--policy consistent_hash --intra-node-data-parallel-size 8``) does, restated as a formula:

* with ``--intra-node-data-parallel-size N`` the one engine URL becomes N logical workers
  ``url@0 .. url@N-1`` (one per DP rank; the rank is sent as ``X-data-parallel-rank``);
* the ring: every worker ``w`` puts ``V = 160`` virtual nodes at positions ``h("w:i")``,
  ``i = 0 .. V-1``, on a 64-bit circle;
* the key: the first non-empty header of ``x-session-id, x-user-id, x-tenant-id,
  x-correlation-id, x-request-id, x-trace-id`` (AgentX maps aiperf's correlation id, stable over
  a conversation's turns, to ``x-session-id``), else a session/user field of the body, else the
  body itself;
* the choice: the worker of the first virtual node clockwise from ``h(key)`` (the smallest
  position ``>= h(key)``, wrapping to the smallest position). No load term: a session stays on
  its rank however busy the rank is (an unhealthy worker falls back to the first healthy one).

``h`` in vllm-router is a FurcHash (mcrouter) of the key into 23 bits expanded by MurmurHash64A;
here it is ``xxh3_64`` (any well-mixed 64-bit hash gives the same ring statistics; the exact
placement of a given session differs, which no metric depends on). With 160 virtual nodes per
worker each worker owns ``1/N`` of the circle with a relative spread of about ``1/sqrt(160)`` =
8%, so sessions split almost, but not exactly, evenly; the per-rank imbalance that matters comes
from the sessions themselves (a few long agent trajectories), which no load-blind hash can fix.

pdlb's own ``consistent_hash`` is a different algorithm (rendezvous hashing with bounded loads);
this module reproduces the router a measured deployment used, as an anchor.

Parameters: ``virtual_nodes`` (default 160, vllm-router's ``VIRTUAL_NODES_PER_WORKER``).
Scores: the replica's rank along the circle from the key (0 = chosen), computed only when read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from balancer.candidates import Candidates
from balancer.policies.base import Policy, ScoreMap, SelectContext, register
from balancer.types import Choice, ReplicaId, Request

#: vllm-router ``VIRTUAL_NODES_PER_WORKER``
VIRTUAL_NODES_PER_WORKER = 160
#: most virtual nodes a ring may hold (bounds the allocation per candidate set)
MAX_RING_NODES = 1 << 20


def ring_key(request: Request) -> bytes:
    """What the ring hashes: the session id (vllm-router's ``x-session-id`` header), else the
    request id (vllm-router would hash the body; a request without a session has no affinity)."""
    if request.session_id is not None:
        return b"header:x-session-id:" + request.session_id.encode()
    return b"request:" + request.request_id.encode()


def worker_url(replica: ReplicaId) -> str:
    """vllm-router's logical worker name of a DP rank: ``engine@dp_rank``."""
    return f"{replica.engine}@{replica.dp_rank}"


def build_ring(replicas: tuple[ReplicaId, ...], virtual_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """``(positions, owner)``: the ring's virtual-node positions sorted ascending (``uint64``,
    shape ``(n * virtual_nodes,)``) and the index into ``replicas`` owning each.

    Raises:
        ValueError: no replicas, or more than :data:`MAX_RING_NODES` virtual nodes."""
    n = len(replicas)
    if n == 0:
        raise ValueError("dp_consistent_hash: no candidate replicas")
    if n * virtual_nodes > MAX_RING_NODES:
        raise ValueError(f"dp_consistent_hash: {n} replicas x {virtual_nodes} virtual nodes exceeds "
                         f"{MAX_RING_NODES} ring positions")
    pos = np.empty(n * virtual_nodes, dtype=np.uint64)
    owner = np.repeat(np.arange(n, dtype=np.int64), virtual_nodes)
    k = 0
    for r in replicas:
        url = worker_url(r)
        for i in range(virtual_nodes):
            pos[k] = xxhash.xxh3_64_intdigest(f"{url}:{i}".encode())
            k += 1
    order = np.argsort(pos, kind="stable")
    return pos[order], owner[order]


_RING_CACHE: dict[tuple[int, int], tuple[tuple[ReplicaId, ...], np.ndarray, np.ndarray]] = {}


def _ring(replicas: tuple[ReplicaId, ...], virtual_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    slot = (id(replicas), virtual_nodes)
    hit = _RING_CACHE.get(slot)
    if hit is not None and hit[0] is replicas:
        return hit[1], hit[2]
    pos, owner = build_ring(replicas, virtual_nodes)
    if len(_RING_CACHE) >= 16:
        _RING_CACHE.clear()
    _RING_CACHE[slot] = (replicas, pos, owner)
    return pos, owner


def ring_choice(key: bytes, pos: np.ndarray, owner: np.ndarray) -> int:
    """Index of the replica owning the first virtual node at or after ``h(key)`` (wrapping)."""
    h = np.uint64(xxhash.xxh3_64_intdigest(key))
    i = int(np.searchsorted(pos, h, side="left"))
    return int(owner[i if i < len(pos) else 0])


@register
@dataclass(frozen=True)
class DpConsistentHash(Policy):
    name = "dp_consistent_hash"
    prefill_head_roles = frozenset()  # reads no in-service prefill columns
    uses_prefix_index = False
    uses_load = False
    virtual_nodes: int = VIRTUAL_NODES_PER_WORKER

    def __post_init__(self) -> None:
        if not 1 <= self.virtual_nodes <= 4096:
            raise ValueError(f"dp_consistent_hash: virtual_nodes must be in [1, 4096], got {self.virtual_nodes}")

    def select(self, request: Request, cands: Candidates, ctx: SelectContext) -> Choice:
        pos, owner = _ring(cands.replicas, self.virtual_nodes)
        h = np.uint64(xxhash.xxh3_64_intdigest(ring_key(request)))
        start = int(np.searchsorted(pos, h, side="left"))
        chosen = int(owner[start if start < len(pos) else 0])
        n = len(cands)

        def ranks() -> np.ndarray:  # order in which replicas appear clockwise from the key
            out = np.full(n, float(n), dtype=np.float64)
            seen = 0
            for j in np.concatenate([owner[start:], owner[:start]]):
                if out[j] == n:
                    out[j] = seen
                    seen += 1
                    if seen == n:
                        break
            return out

        return Choice(cands.replicas[chosen], ScoreMap(cands.replicas, ranks), reason="affinity")
