"""``consistent_hash``: session affinity by consistent hashing with bounded loads.

Algorithm: the key is the request's ``session_id``, else the hash of its ``key_block``-th block
(or its last block if shorter; chained hashes make that a hash of the whole prefix up to there,
so requests sharing that prefix go together), else its id. ``key_block=1`` keys on the first
block only, which on traces where every prompt starts with the same system-prompt block (the
Mooncake conversation trace) sends everything to one key; 2 keys on the conversation root. Candidates are ranked by
rendezvous (highest-random-weight) hashing, ``xxh3_64(key, replica)`` descending, which is a
consistent hash: adding or removing a replica moves only the keys it wins or held. Bounded
loads: with ``m`` requests in flight on ``n`` candidates, a replica may take the request only if
its count ``+ 1 <= ceil((1 + epsilon) * (m + 1) / n)``; the first such replica in rank order wins
(one always exists, since not every replica can exceed the mean).

Parameters: ``epsilon`` (default 0.25, the balance factor c = 1.25 of the paper), ``key_block``
(default 2, 1-based).
Source: Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads" (SODA 2018);
Thaler & Ravishankar rendezvous hashing; vLLM router ``consistent_hash``.
Scores: the rendezvous rank (0 = first choice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import xxhash

from balancer.candidates import Candidates
from balancer.policies.base import Policy, SelectContext, register
from balancer.types import Choice, Request


def affinity_key(request: Request, key_block: int = 1) -> bytes:
    """The bytes a request is hashed by (session, else the ``key_block``-th block hash, else id)."""
    if request.session_id is not None:
        return b"s:" + request.session_id.encode()
    if request.block_hashes:
        h = request.block_hashes[min(key_block, len(request.block_hashes)) - 1]
        return b"b:" + h.to_bytes(8, "little", signed=False)
    return b"r:" + request.request_id.encode()


@register
@dataclass(frozen=True)
class ConsistentHash(Policy):
    name = "consistent_hash"
    epsilon: float = 0.25
    key_block: int = 2

    def __post_init__(self) -> None:
        if not self.epsilon > 0:
            raise ValueError(f"consistent_hash: epsilon must be > 0, got {self.epsilon}")
        if self.key_block < 1:
            raise ValueError(f"consistent_hash: key_block must be >= 1, got {self.key_block}")

    def select(self, request: Request, cands: Candidates, ctx: SelectContext) -> Choice:
        key = affinity_key(request, self.key_block)
        weights = [
            xxhash.xxh3_64_intdigest(key + b"|" + r.engine.encode() + r.dp_rank.to_bytes(4, "little"))
            for r in cands.replicas
        ]
        order = sorted(range(len(cands)), key=lambda i: weights[i], reverse=True)
        n = len(cands)
        cap = math.ceil((1.0 + self.epsilon) * (int(cands.num_requests.sum()) + 1) / n)
        chosen = order[0]
        reason = "affinity"
        for i in order:
            if cands.num_requests[i] + 1 <= cap:
                chosen = i
                break
        if chosen != order[0]:
            reason = "bounded_load"
        scores = {cands.replicas[i]: float(rank) for rank, i in enumerate(order)}
        return Choice(cands.replicas[chosen], scores, reason=reason)
