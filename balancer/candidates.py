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


# Read-only by contract. Not frozen: one is built per routing decision, and a frozen __init__ is ~3x slower.
@dataclass(slots=True)
class Candidates:
    """Candidate replicas of one pool for one request. All arrays have shape ``(n,)``, int64.

    Attributes:
        role: the pool's role.
        replicas: the candidates, in a stable order (the router sorts by engine, then DP rank).
        num_requests / prefill_tokens / decode_kv_tokens: projected load (:mod:`balancer.load`).
        kv_capacity_tokens: KV capacity per replica in tokens (0 = unknown).
        matched_blocks: leading prompt blocks each replica is believed to hold. With lower KV
            tiers configured on the router this is the tier-weighted *effective* match, float64:
            ``hbm_blocks + w_host * host_blocks + w_store * store_blocks`` (Router
            ``tier_weights``), so policies that read it prefer HBM hits without knowing tiers.
        matched_tokens: ``min(matched_blocks * block_size, prompt_tokens)`` (rounded to tokens).
        block_size: tokens per KV block.
        prefill_attn_pairs: attention pairs of the queued uncached prefill tokens (float64,
            :mod:`balancer.load`), or ``None`` when not known (hand-built candidates).
        hbm_blocks / host_blocks / store_blocks: per-tier columns (int64) when lower tiers are
            configured, else ``None``: leading blocks in the replica's HBM; consecutive blocks
            after those in its host tier; consecutive blocks after both in the shared store.
        prefill_head_start_s / prefill_head_tokens / prefill_head_pairs: the in-service prefill
            of each replica (:mod:`balancer.load`): when the router's oldest pending prefill there
            began service (seconds, the caller's clock; ``inf``: none), its uncached tokens
            (int64) and attention pairs (float64); ``None`` when not known (hand-built).
        prefill_inflight: per replica, the routed prompts whose prefill is not done (int64,
            :mod:`balancer.load`), or ``None`` (the router fills it only for a policy that reads
            it, :attr:`balancer.policies.Policy.session_facts`).
        returning_requests / returning_kv_tokens: per replica, the forecast of idle sessions that
            will return there and their context tokens (float64, decayed;
            :mod:`balancer.session_forecast`), or ``None`` (as ``prefill_inflight``).
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
    hbm_blocks: np.ndarray | None = None
    host_blocks: np.ndarray | None = None
    store_blocks: np.ndarray | None = None
    prefill_attn_pairs: np.ndarray | None = None
    prefill_head_start_s: np.ndarray | None = None
    prefill_head_tokens: np.ndarray | None = None
    prefill_head_pairs: np.ndarray | None = None
    prefill_inflight: np.ndarray | None = None
    returning_requests: np.ndarray | None = None
    returning_kv_tokens: np.ndarray | None = None

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
            matched_blocks=self.matched_blocks[i].item(),
            matched_tokens=int(self.matched_tokens[i]),
            block_size=self.block_size,
            host_blocks=int(self.host_blocks[i]) if self.host_blocks is not None else 0,
            store_blocks=int(self.store_blocks[i]) if self.store_blocks is not None else 0,
        )

    def views(self) -> list[ReplicaView]:
        return [self[i] for i in range(len(self))]

    @property
    def kv_usage(self) -> np.ndarray:
        """Fraction of KV capacity used by decode sequences, in [0, 1] (0 where unknown), float64."""
        cap = self.kv_capacity_tokens
        if not len(cap):
            return np.zeros(0, dtype=np.float64)
        if cap[cap.argmin()] > 0:  # every capacity known (the usual case): no masked divide
            u = self.decode_kv_tokens / cap
        elif cap[cap.argmax()] <= 0:  # none known
            return np.zeros(len(cap), dtype=np.float64)
        else:
            u = np.divide(self.decode_kv_tokens, cap, out=np.zeros(len(cap), dtype=np.float64), where=cap > 0)
        return np.minimum(u, 1.0, out=u)

    @classmethod
    def from_views(cls, views: Sequence[ReplicaView], role: Role | None = None) -> Candidates:
        """Build from hand-made views (tests, embedding code). ``role`` defaults to the first view's.

        ``matched_blocks`` is taken as given (int64, or float64 if any view's is a float: give
        the effective match the policy should see); the per-tier columns stay ``None``.
        """
        if not views:
            raise ValueError("no candidate replicas")
        def col(name: str) -> np.ndarray:
            return np.array([getattr(v, name) for v in views], dtype=np.int64)
        mb = np.array([v.matched_blocks for v in views])
        mb = mb.astype(np.float64 if mb.dtype.kind == "f" else np.int64)
        return cls(
            role=role if role is not None else views[0].role,
            replicas=tuple(v.replica for v in views),
            num_requests=col("num_requests"),
            prefill_tokens=col("prefill_tokens"),
            decode_kv_tokens=col("decode_kv_tokens"),
            kv_capacity_tokens=col("kv_capacity_tokens"),
            matched_blocks=mb,
            matched_tokens=col("matched_tokens"),
            block_size=views[0].block_size,
        )
