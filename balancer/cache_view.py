"""The router's view of where prompts are cached (:class:`CacheView`, one of
:class:`~balancer.router.Router`'s parts): the prefix index of each replica's HBM
(:class:`~balancer.prefix_index.PrefixIndex`), the hybrid mode's index of the router's own routed
prompts, and the optional lower-tier views (each replica's host DRAM, the shared store:
:class:`~balancer.block_index.BlockIndex`).

It answers, per candidate of a pool, how many of a prompt's blocks are cached in HBM and (with
tiers) how many consecutive blocks after those sit in the host tier and then in the store, and the
effective match policies see, ``hbm + w_host * host + w_store * store`` blocks (see the router's
module docstring, "Lower KV tiers"). It changes through the router's hooks only: a routed prompt
(approximate and hybrid modes), another router's routed prompt, an engine's KV event, a replica
registered or removed, and TTL expiry at the router's clock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator

import numpy as np

from balancer.block_index import BlockIndex
from balancer.config import RouterConfig
from balancer.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, tier_of_medium
from balancer.prefix_index import PrefixIndex
from balancer.types import ReplicaId

__all__ = ["STORE_HOLDER", "CacheView"]

#: The pseudo replica that holds the shared store's blocks in the router's store view.
STORE_HOLDER = ReplicaId("shared-store", 0)


class CacheView:
    """The prefix index and the tier views of a router built from ``config``.

    Attributes:
        index: the HBM prefix index (events and hybrid modes keep its block map, to remove single blocks).
        speculative: hybrid mode: the router's own routed prompts, for ``speculative_ttl_s``; else None.
        host_index: each replica's host-DRAM tier view, or None.
        store_index: the shared store's view (one holder, :data:`STORE_HOLDER`), or None.
        tier_weights: ``{"host": w, "store": w}`` (defaults filled in).
        index_mode: ``"approximate"``, ``"events"`` or ``"hybrid"``.
    """

    def __init__(self, config: RouterConfig) -> None:
        self.index_mode = config.index_mode
        self.index = PrefixIndex(config.index_capacity_blocks, config.index_ttl_s,
                                 block_map=config.index_mode != "approximate",
                                 total_capacity_blocks=config.index_total_capacity_blocks)
        self.speculative = (PrefixIndex(config.index_capacity_blocks, config.speculative_ttl_s)
                            if config.index_mode == "hybrid" else None)
        self.host_index = BlockIndex(config.host_index_capacity_blocks, config.index_ttl_s) if config.host_tier else None
        self.store_index = (BlockIndex(config.store_index_capacity_blocks, config.store_ttl_s)
                            if config.shared_store else None)
        self.tier_weights = config.weights
        #: whether any lower-tier view exists (else matches are HBM matches alone)
        self.has_tiers = self.host_index is not None or self.store_index is not None

    # ------------------------------------------------------------------ replicas
    def register(self, replica: ReplicaId) -> None:
        """Number a new replica in the prefix indexes (their cached pool numbers stay valid)."""
        self.index.register(replica)
        if self.speculative is not None:
            self.speculative.register(replica)

    def forget(self, replica: ReplicaId) -> None:
        """Drop everything a removed replica held."""
        self.index.clear(replica)
        if self.speculative is not None:
            self.speculative.clear(replica)
        if self.host_index is not None:
            self.host_index.clear(replica)

    @contextlib.contextmanager
    def deferring_rebalance(self) -> Iterator[None]:
        """Within the block, the prefix indexes enforce their per-replica share once, at the end."""
        indexes = [i for i in (self.index, self.speculative) if i is not None]
        for i in indexes:
            i.defer_rebalance = True
        try:
            yield
        finally:
            for i in indexes:
                i.defer_rebalance = False
                i.rebalance()

    # ------------------------------------------------------------------ reads
    def expire(self, now_s: float) -> None:
        """Drop entries past their TTL at ``now_s`` (the router's clock, non-decreasing)."""
        if self.index.ttl_s is not None:
            self.index.expire(now_s)
            if self.host_index is not None:
                self.host_index.expire(now_s)
        if self.store_index is not None and self.store_index.ttl_s is not None:
            self.store_index.expire(now_s)
        if self.speculative is not None:
            self.speculative.expire(now_s)

    def hbm_matches(self, replicas: tuple[ReplicaId, ...], depths: np.ndarray,
                    spec_depths: np.ndarray | None) -> np.ndarray:
        """Per replica (shape ``(n,)``, int64), its HBM match in blocks: its depth in ``depths``
        (the prefix index's per-number match depths of one prompt), or with ``spec_depths`` (the
        speculative index's) the larger of the two."""
        matched = _gather(self.index, replicas, depths)
        if spec_depths is not None and self.speculative is not None:
            matched = np.maximum(matched, _gather(self.speculative, replicas, spec_depths))
        return matched

    def lower_tier_matches(self, block_hashes: tuple[int, ...], replicas: tuple[ReplicaId, ...],
                           hbm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per replica (shape ``(n,)``, int64): consecutive blocks after its HBM match held in its
        host tier, and consecutive blocks after both held in the shared store. Cost: one index
        match per distinct HBM depth and per distinct host depth (few), not per replica."""
        n = len(replicas)
        host = np.zeros(n, dtype=np.int64)
        store = np.zeros(n, dtype=np.int64)
        nb = len(block_hashes)
        if self.host_index is not None and nb:
            for d in np.unique(hbm).tolist():
                if d >= nb:
                    continue
                ks = np.flatnonzero(hbm == d)
                got = self.host_index.match(block_hashes[d:], [replicas[k] for k in ks.tolist()])
                if got:
                    pos = {r: k for k, r in zip(ks.tolist(), (replicas[k] for k in ks.tolist()))}
                    for r, m in got.items():
                        host[pos[r]] = m
        if self.store_index is not None and nb:
            depth = hbm + host
            for d in np.unique(depth).tolist():
                if d < nb:
                    store[depth == d] = self.store_index.match_replica(STORE_HOLDER, block_hashes[d:])
        return host, store

    # ------------------------------------------------------------------ writes
    def record_routed(self, prefill: ReplicaId | None, decode: ReplicaId, block_hashes: tuple[int, ...],
                      now_s: float, touch_id: int | None = None) -> bool:
        """A prompt this router just routed: the speculative index (hybrid) and, in approximate
        mode, the prefix index of both replicas, the host tier of the one that computes it and the
        store. ``touch_id`` (the route's number) marks the prefix and speculative entries as this
        route's, for :meth:`forget_routed`. Returns whether the approximate index recorded it (then
        other routers may be told)."""
        if self.speculative is not None:
            if prefill is not None:
                self.speculative.insert(prefill, block_hashes, now_s, touch_id=touch_id)
            self.speculative.insert(decode, block_hashes, now_s, touch_id=touch_id)
        if self.index_mode != "approximate":
            return False
        if prefill is not None:
            self.index.insert(prefill, block_hashes, now_s, touch_id=touch_id)
        self.index.insert(decode, block_hashes, now_s, touch_id=touch_id)
        if self.host_index is not None:  # the replica that computes the prompt gets it
            self.host_index.insert(prefill if prefill is not None else decode, block_hashes, now_s)
        if self.store_index is not None:
            self.store_index.insert(STORE_HOLDER, block_hashes, now_s)
        return True

    def forget_routed(self, replica: ReplicaId, block_hashes: tuple[int, ...], kept_blocks: int,
                      routed_at_s: float, touch_id: int | None = None) -> int:
        """Undo :meth:`record_routed` on one replica whose engine rejected the prompt: its blocks
        after the first ``kept_blocks`` (those it held before) leave the prefix index (approximate
        mode) and the speculative index (hybrid), each block only if nothing touched it there since
        ``routed_at_s`` (another request routed there meanwhile keeps it) and, with ``touch_id``
        (the one given to :meth:`record_routed`), only if its last touch was that route's (another
        request routed at the same ``routed_at_s`` keeps it too). The lower tiers (host,
        shared store) keep theirs (their entries expire by LRU; the tiers are off by default).
        Returns the blocks dropped."""
        new = block_hashes[kept_blocks:]
        if not new:
            return 0
        n = 0
        if self.index_mode == "approximate":
            n += self.index.remove_untouched(replica, new, routed_at_s, touch_id)
        if self.speculative is not None:
            n += self.speculative.remove_untouched(replica, new, routed_at_s, touch_id)
        return n

    def record_peer_routed(self, replicas: Collection[ReplicaId], block_hashes: tuple[int, ...], now_s: float) -> None:
        """A prompt another router routed to ``replicas`` (registered ones): approximate mode only."""
        if self.index_mode != "approximate":
            return
        for rep in replicas:
            self.index.insert(rep, block_hashes, now_s)

    def apply_kv_event(self, replica: ReplicaId, event: KvEvent, now_s: float) -> bool:
        """An engine's KV event into the view its ``medium`` names (HBM, the replica's host tier,
        the shared store); ``False`` when the router tracks no such tier (ignored).

        Raises:
            ValueError: an unknown medium, or an HBM ``BlockStored`` that neither starts a prompt
                nor names its parent when its first block is indexed elsewhere.
        """
        tier = tier_of_medium(event.medium)
        index = self.index if tier == "hbm" else (self.host_index if tier == "host" else self.store_index)
        if index is None:
            return False
        holder = STORE_HOLDER if tier == "store" else replica
        if isinstance(event, BlockStored):
            index.insert(holder, event.block_hashes, now_s, parent_block_hash=event.parent_block_hash)
        elif isinstance(event, BlockRemoved):
            index.remove(holder, event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            index.clear(holder)
            if isinstance(index, PrefixIndex):  # keep its number: cached pool numbers stay valid
                index.register(holder)
        return True


def _gather(index: PrefixIndex, replicas: tuple[ReplicaId, ...], depths: np.ndarray) -> np.ndarray:
    """Per replica, its depth in ``depths`` (an index's per-number match depths)."""
    nums, all_known = index.numbers_known(replicas)
    if all_known and len(depths):  # every candidate has a number (the steady state)
        return depths[nums]
    if not len(nums) or not len(depths):
        return np.zeros(len(nums), dtype=np.int64)
    return np.where(nums >= 0, depths[np.maximum(nums, 0)], 0)
