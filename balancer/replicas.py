"""The router's replica registry: the registered DP ranks, their roles, KV capacities and health,
and the candidate pools built from them (:class:`ReplicaRegistry`, one of
:class:`~balancer.router.Router`'s parts).

A *pool* is the healthy replicas of one side, sorted by engine then DP rank: ``"prefill"`` (the
prefill replicas) and ``"decode"`` (the decode replicas, or the mixed ones of an aggregated
deployment). Pools are built once per change of the registry (registration, removal, health) and
cached; each carries the replicas' load-tracker slots, so that a snapshot gathers their load with
one numpy index (:mod:`balancer.load`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import numpy as np

from balancer.types import ReplicaId, Role

__all__ = ["Pool", "ReplicaInfo", "ReplicaRegistry", "RequestTooLargeError"]


class RequestTooLargeError(ValueError):
    """The request cannot fit any candidate replica's KV capacity (the service maps it to 400)."""


@dataclass(slots=True)
class ReplicaInfo:
    """Static facts about a registered replica."""

    replica: ReplicaId
    role: Role
    kv_capacity_tokens: int = 0
    healthy: bool = True


@dataclass(slots=True)
class Pool:
    """The candidates of one side, in order: shapes ``(n,)``.

    Attributes:
        replicas: the DP ranks.
        slots: their load-tracker slots (int64).
        capacity: their KV capacities in tokens (int64; 0 = unknown).
        position: replica -> index in ``replicas``.
        role: the pool's role (prefill, decode or mixed).
        min_capacity: smallest known (> 0) KV capacity in tokens; 0: none known.
    """

    replicas: tuple[ReplicaId, ...]
    slots: np.ndarray
    capacity: np.ndarray
    position: dict[ReplicaId, int]
    role: Role
    min_capacity: int = 0


class ReplicaRegistry:
    """The registered replicas and the cached pools (not thread-safe: the router's lock guards it).

    Args:
        slot_of: the load tracker's slot of a registered replica (:meth:`balancer.load.LoadTracker.slot`).
    """

    def __init__(self, slot_of: Callable[[ReplicaId], int]) -> None:
        self._slot_of = slot_of
        self._infos: dict[ReplicaId, ReplicaInfo] = {}
        self._pools: dict[str, Pool] | None = None
        self._prefill_registered = False  # any prefill replica registered (set with the pools)

    def __contains__(self, replica: object) -> bool:
        return replica in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def __iter__(self) -> Iterator[ReplicaInfo]:
        return iter(self._infos.values())

    def get(self, replica: ReplicaId) -> ReplicaInfo | None:
        """The replica's facts (the registry's own object), or ``None``."""
        return self._infos.get(replica)

    def add(self, replica: ReplicaId, role: Role | str, kv_capacity_tokens: int = 0) -> ReplicaInfo:
        """Register (or update, same role) a replica, healthy; see :meth:`balancer.router.Router.add_replica`.

        Raises:
            TypeError: ``replica`` is not a :class:`~balancer.types.ReplicaId`.
            ValueError: unknown role, negative ``dp_rank`` or ``kv_capacity_tokens``, or another
                role than the one registered (nothing changes then).
        """
        if not isinstance(replica, ReplicaId) or not isinstance(replica.engine, str) \
                or not isinstance(replica.dp_rank, int):
            raise TypeError(f"replica must be a ReplicaId(engine: str, dp_rank: int), got {replica!r}")
        if replica.dp_rank < 0:
            raise ValueError(f"dp_rank must be >= 0, got {replica.dp_rank} for {replica}")
        if kv_capacity_tokens < 0:
            raise ValueError(f"kv_capacity_tokens must be >= 0 (0 = unknown), got {kv_capacity_tokens} for {replica}")
        try:
            role = Role(role)
        except ValueError:
            raise ValueError(f"unknown role {role!r}; valid: {', '.join(r.value for r in Role)}") from None
        info = self._infos.get(replica)
        if info is not None and info.role is not role:
            raise ValueError(f"{replica} is already registered as {info.role.value}, not {role.value} "
                             f"(remove_replica it first to change its role)")
        info = self._infos[replica] = ReplicaInfo(replica, role, int(kv_capacity_tokens), True)
        self._pools = None
        return info

    def remove(self, replica: ReplicaId) -> None:
        """Unregister a replica.

        Raises:
            KeyError: unknown replica.
        """
        if replica not in self._infos:
            raise KeyError(f"unknown replica {replica}")
        del self._infos[replica]
        self._pools = None

    def set_healthy(self, replica: ReplicaId, healthy: bool) -> None:
        """Mark a replica (un)healthy: unhealthy replicas are in no pool.

        Raises:
            KeyError: unknown replica.
        """
        info = self._infos.get(replica)
        if info is None:
            raise KeyError(f"unknown replica {replica}")
        info.healthy = healthy
        self._pools = None

    def sorted_infos(self) -> list[ReplicaInfo]:
        """Every replica's facts, sorted by engine then DP rank."""
        return sorted(self._infos.values(), key=lambda i: (i.replica.engine, i.replica.dp_rank))

    def pools(self) -> dict[str, Pool]:
        """``{"prefill": Pool, "decode": Pool}`` of the healthy replicas (cached until a change)."""
        if self._pools is None:
            self._prefill_registered = any(i.role is Role.PREFILL for i in self._infos.values())
            healthy = [i for i in self.sorted_infos() if i.healthy]
            prefill = [i for i in healthy if i.role is Role.PREFILL]
            decode = [i for i in healthy if i.role in (Role.DECODE, Role.MIXED)]
            self._pools = {"prefill": self._make_pool(prefill, Role.PREFILL),
                           "decode": self._make_pool(decode, decode[0].role if decode else Role.DECODE)}
        return self._pools

    def prefill_registered(self) -> bool:
        """Whether prefill replicas are registered (healthy or not): the prefill policy runs."""
        self.pools()
        return self._prefill_registered

    def forget_pools(self) -> None:
        """Drop the cached pools (they are built again on next use)."""
        self._pools = None

    def _make_pool(self, infos: list[ReplicaInfo], role: Role) -> Pool:
        reps = tuple(i.replica for i in infos)
        return Pool(
            replicas=reps,
            slots=np.array([self._slot_of(r) for r in reps], dtype=np.int64),
            capacity=np.array([i.kv_capacity_tokens for i in infos], dtype=np.int64),
            position={r: k for k, r in enumerate(reps)},
            role=role,
            min_capacity=min((i.kv_capacity_tokens for i in infos if i.kv_capacity_tokens > 0), default=0),
        )

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_pools": None}  # pools are rebuilt on first use


def fitting(pool: Pool, need_tokens: int, what: str) -> Pool:
    """``pool`` less the replicas whose known KV capacity is below ``need_tokens`` (unknown
    capacity, 0, counts as fitting); ``pool`` itself when all fit (the usual case, O(1)).

    Raises:
        RequestTooLargeError: no replica of a non-empty pool fits.
    """
    if not pool.min_capacity or need_tokens <= pool.min_capacity:
        return pool
    keep = [k for k, c in enumerate(pool.capacity.tolist()) if c == 0 or c >= need_tokens]
    if not keep and pool.replicas:
        raise RequestTooLargeError(f"{what} needs {need_tokens} tokens of KV; the largest {pool.role.value} "
                                   f"replica holds {int(pool.capacity.max())}")
    take = np.array(keep, dtype=np.intp)
    reps = tuple(pool.replicas[k] for k in keep)
    cap = pool.capacity[take]
    return Pool(reps, pool.slots[take], cap, {r: i for i, r in enumerate(reps)}, pool.role,
                min((c for c in cap.tolist() if c > 0), default=0))


def without(pool: Pool, exclude_engines: Collection[str]) -> Pool:
    """``pool`` less the replicas whose engine is in ``exclude_engines``, built per call (the
    cached pools stay as they are); ``pool`` itself when that removes none or all of them."""
    keep = [k for k, r in enumerate(pool.replicas) if r.engine not in exclude_engines]
    if not keep or len(keep) == len(pool.replicas):
        return pool
    take = np.array(keep, dtype=np.intp)
    reps = tuple(pool.replicas[k] for k in keep)
    cap = pool.capacity[take]
    return Pool(reps, pool.slots[take], cap, {r: i for i, r in enumerate(reps)}, pool.role,
                min((c for c in cap.tolist() if c > 0), default=0))
