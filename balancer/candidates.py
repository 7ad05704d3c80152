"""The read-only snapshot of candidate replicas that a policy decides on.

Columnar (one numpy array per field, index ``i`` = ``replicas[i]``) so that policies work in
O(replicas) vector operations even at hundreds of DP ranks; ``cands[i]`` gives a row as a
:class:`~balancer.types.ReplicaView` for readable code and tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from balancer.types import ReplicaId, ReplicaView, Role


@dataclass(frozen=True, slots=True)
class Candidates:
    """Candidate replicas of one pool for one request. All arrays have shape ``(n,)``, int64.

    Attributes:
        role: the pool's role.
        replicas: the candidates, in a stable order (the router sorts by engine, then DP rank).
        num_requests / prefill_tokens / decode_kv_tokens: projected load (:mod:`balancer.load`).
        kv_capacity_tokens: KV capacity per replica in tokens (0 = unknown).
        matched_blocks: leading prompt blocks each replica is believed to hold.
        matched_tokens: ``min(matched_blocks * block_size, prompt_tokens)``.
        block_size: tokens per KV block.
    """

    role: Role
    replicas: tuple[ReplicaId, ...]
    num_requests: np.ndarray
    prefill_tokens: np.ndarray
    decode_kv_tokens: np.ndarray
    kv_capacity_tokens: np.ndarray
    matched_blocks: np.ndarray
    matched_tokens: np.ndarray
    block_size: int

    def __len__(self) -> int:
        return len(self.replicas)

    def __getitem__(self, i: int) -> ReplicaView:
        return ReplicaView(
            replica=self.replicas[i],
            role=self.role,
            num_requests=int(self.num_requests[i]),
            prefill_tokens=int(self.prefill_tokens[i]),
            decode_kv_tokens=int(self.decode_kv_tokens[i]),
            kv_capacity_tokens=int(self.kv_capacity_tokens[i]),
            matched_blocks=int(self.matched_blocks[i]),
            matched_tokens=int(self.matched_tokens[i]),
            block_size=self.block_size,
        )

    def views(self) -> list[ReplicaView]:
        return [self[i] for i in range(len(self))]

    @property
    def kv_usage(self) -> np.ndarray:
        """Fraction of KV capacity used by decode sequences, in [0, 1] (0 where unknown), float64."""
        cap = self.kv_capacity_tokens.astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            u = np.where(cap > 0, self.decode_kv_tokens / np.where(cap > 0, cap, 1.0), 0.0)
        return np.minimum(u, 1.0)

    @classmethod
    def from_views(cls, views: Sequence[ReplicaView], role: Role | None = None) -> Candidates:
        """Build from hand-made views (tests, embedding code). ``role`` defaults to the first view's."""
        if not views:
            raise ValueError("no candidate replicas")
        def col(name: str) -> np.ndarray:
            return np.array([getattr(v, name) for v in views], dtype=np.int64)
        return cls(
            role=role if role is not None else views[0].role,
            replicas=tuple(v.replica for v in views),
            num_requests=col("num_requests"),
            prefill_tokens=col("prefill_tokens"),
            decode_kv_tokens=col("decode_kv_tokens"),
            kv_capacity_tokens=col("kv_capacity_tokens"),
            matched_blocks=col("matched_blocks"),
            matched_tokens=col("matched_tokens"),
            block_size=views[0].block_size,
        )
