"""``consistent_hash``: session affinity by consistent hashing with bounded loads.

Algorithm: the key is the request's ``session_id``, else the hash of its ``key_block``-th block
(or its last block if shorter; chained hashes make that a hash of the whole prefix up to there,
so requests sharing that prefix go together), else its id. ``key_block=1`` keys on the first
block only, which on traces where every prompt starts with the same system-prompt block (the
Mooncake conversation trace) sends everything to one key; 2 keys on the conversation root.

Candidates are ranked by rendezvous (highest-random-weight) hashing with weight
``w_i = splitmix64(xxh3_64(key) XOR xxh3_64(engine | dp_rank as 4 bytes LE))``, descending. This
is a consistent hash: adding or removing a replica moves only the keys it wins or held. The
replica hashes are computed once per candidate set and the weights in one vectorised numpy pass,
cached per key (affinity keys recur), so a decision is O(replicas) array work at most (no
per-replica hashing or sorting per request).
``splitmix64`` (Steele, Lea, Flood, "Fast splittable pseudorandom number generators", OOPSLA
2014; the finaliser constants of Vigna's SplitMix64) is a bijection on 64-bit words that mixes
every input bit into every output bit, which makes the XOR-combined weights independent per key.

Bounded loads: with ``m`` requests in flight on ``n`` candidates, a replica may take the request
only if its count ``+ 1 <= ceil((1 + epsilon) * (m + 1) / n)``; the highest-weight such replica
wins (one always exists, since not every replica can exceed the mean).

Parameters: ``epsilon`` (default 0.25, the balance factor c = 1.25 of the paper), ``key_block``
(default 2, 1-based).
Source: Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads" (SODA 2018);
Thaler & Ravishankar, "Using name-based mappings to increase hit rates" (IEEE/ACM ToN 1998:
rendezvous hashing). Not vllm-router's ``consistent_hash``, which is a ring of virtual nodes with
no load bound: that one is :mod:`balancer.policies.dp_consistent_hash`.
Scores: the rendezvous rank (0 = first choice), computed only when read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import xxhash

from balancer.candidates import Candidates
from balancer.policies.base import Policy, ScoreMap, SelectContext, register
from balancer.types import Choice, ReplicaId, Request

_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_SHIFT30, _SHIFT27, _SHIFT31 = np.uint64(30), np.uint64(27), np.uint64(31)
_ZERO = np.uint64(0)


def affinity_key(request: Request, key_block: int = 1) -> bytes:
    """The bytes a request is hashed by (session, else the ``key_block``-th block hash, else id)."""
    if request.session_id is not None:
        return b"s:" + request.session_id.encode()
    if request.block_hashes:
        h = request.block_hashes[min(key_block, len(request.block_hashes)) - 1]
        return b"b:" + h.to_bytes(8, "little", signed=False)
    return b"r:" + request.request_id.encode()


def replica_hash(replica: ReplicaId) -> int:
    """``xxh3_64(engine | dp_rank as 4 bytes little-endian)``: a replica's rendezvous identity."""
    return xxhash.xxh3_64_intdigest(replica.engine.encode() + b"|" + replica.dp_rank.to_bytes(4, "little"))


def splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a ``uint64`` array (wrapping arithmetic: numpy does not check
    integer array overflow), same shape; ``z`` is not modified."""
    z = z ^ (z >> _SHIFT30)
    z *= _MIX1
    z ^= z >> _SHIFT27
    z *= _MIX2
    z ^= z >> _SHIFT31
    return z


# Replica hashes per candidate tuple. The router hands policies the same tuple object for a pool
# until its membership changes, so an identity check finds it; a few entries cover both pools.
_HASH_CACHE: dict[int, tuple[tuple[ReplicaId, ...], np.ndarray]] = {}


def _replica_hashes(replicas: tuple[ReplicaId, ...]) -> np.ndarray:
    hit = _HASH_CACHE.get(id(replicas))
    if hit is not None and hit[0] is replicas:
        return hit[1]
    arr = np.fromiter((replica_hash(r) for r in replicas), dtype=np.uint64, count=len(replicas))
    if len(_HASH_CACHE) >= 32:
        _HASH_CACHE.clear()
    _HASH_CACHE[id(replicas)] = (replicas, arr)
    return arr


# Weights per (key, candidate tuple): affinity keys recur by design (a session's turns, prompts
# sharing a prefix), so most decisions reuse their key's weights. Bounded to about
# _WEIGHTS_CACHE_BYTES whatever the number of replicas, counting each entry's Python objects
# (key bytes, tuples, dict slot, array header: ~_ENTRY_OVERHEAD_BYTES, measured with tracemalloc)
# as well as its 8 bytes per replica; cleared when full. (Counting only the weights let 262,144
# entries of 2 replicas take ~45 MB.)
_WEIGHTS_CACHE: dict[tuple[bytes, int], tuple[tuple[ReplicaId, ...], np.ndarray]] = {}
_WEIGHTS_CACHE_BYTES = 4 << 20
_ENTRY_OVERHEAD_BYTES = 400


def rendezvous_weights(key: bytes, replicas: tuple[ReplicaId, ...]) -> np.ndarray:
    """``w_i`` of the module docstring for every replica, shape ``(n,)``, ``uint64``, read-only
    (cached per key and candidate tuple)."""
    slot = (key, id(replicas))
    hit = _WEIGHTS_CACHE.get(slot)
    if hit is not None and hit[0] is replicas:
        return hit[1]
    w = splitmix64(_replica_hashes(replicas) ^ np.uint64(xxhash.xxh3_64_intdigest(key)))
    w.flags.writeable = False  # shared by every decision with this key
    if len(_WEIGHTS_CACHE) >= max(64, _WEIGHTS_CACHE_BYTES // (_ENTRY_OVERHEAD_BYTES + 8 * len(replicas))):
        _WEIGHTS_CACHE.clear()
    _WEIGHTS_CACHE[slot] = (replicas, w)
    return w


@register
@dataclass(frozen=True)
class ConsistentHash(Policy):
    name = "consistent_hash"
    prefill_head_roles = frozenset()  # reads no in-service prefill columns
    uses_prefix_index = False  # keyed on the request's own block hashes, not the index
    epsilon: float = 0.25
    key_block: int = 2

    def __post_init__(self) -> None:
        if not self.epsilon > 0:
            raise ValueError(f"consistent_hash: epsilon must be > 0, got {self.epsilon}")
        if self.key_block < 1:
            raise ValueError(f"consistent_hash: key_block must be >= 1, got {self.key_block}")

    def select(self, request: Request, cands: Candidates, ctx: SelectContext) -> Choice:
        w = rendezvous_weights(affinity_key(request, self.key_block), cands.replicas)
        num_requests = cands.num_requests
        n = len(num_requests)
        cap = math.ceil((1.0 + self.epsilon) * (int(np.add.reduce(num_requests)) + 1) / n)
        limit = cap - 1  # "count + 1 <= cap" as "count <= cap - 1": one array operation fewer
        first = int(w.argmax())
        if num_requests[first] <= limit:
            chosen, reason = first, "affinity"
        else:  # the highest weight among the eligible (weights of the others zeroed; one below cap exists)
            chosen, reason = int(np.where(num_requests <= limit, w, _ZERO).argmax()), "bounded_load"

        def ranks() -> np.ndarray:
            out = np.empty(n, dtype=np.float64)
            out[np.argsort(w)[::-1]] = np.arange(n)
            return out

        return Choice(cands.replicas[chosen], ScoreMap(cands.replicas, ranks), reason=reason)
