"""Which replica holds which KV blocks, for any set of blocks: a flat, bounded block-hash index.

The general-purpose sibling of :class:`balancer.prefix_index.PrefixIndex` (a radix tree, which
needs whole prompts from their first block). This one keeps, per block hash, the replicas that
hold it, so blocks may be inserted and matched from any position of a chain: a host-DRAM tier
receives the arbitrary blocks its HBM demoted, a shared store the new blocks of each prompt, and
the router matches them from the block where the HBM match ends. The router uses it for those
lower-tier views (:class:`balancer.router.Router` ``host_tier`` / ``shared_store``).

It keeps

- ``holders[h]``: the replicas believed to hold block ``h``, as a bit set (a Python ``int`` with
  bit ``b`` set for the replica numbered ``b``), so a prefix match is one ``&`` per prompt block
  whatever the number of replicas, and a held block costs an ``int`` rather than a ``set``;
- per replica, an LRU order of its blocks (``OrderedDict``: oldest first) with the time each
  block was last inserted or touched (kept up to date only when a TTL is set), bounded by
  ``capacity_blocks`` per replica, with optional TTL expiry.

On insert the blocks are touched deepest-first, so a prompt's root block is the most recently
used and LRU eviction takes leaves before the prefixes they hang from (as vLLM frees the tail
blocks of a sequence first). Evicted hashes are returned to the caller.

Cost: ``match`` is O(prompt blocks + matching replicas); ``insert`` is O(prompt blocks + evicted
blocks), a few dict operations per block. Memory is O(sum over replicas of held blocks) <=
``capacity_blocks x replicas``; about 200 bytes per held block.

Sources: llm-d's approximate block-hash LRU index, vLLM automatic prefix caching (ANCHORS.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from balancer.hashing import leading_held
from balancer.types import ReplicaId, checked_count, checked_ttl_s


class BlockIndex:
    """Bounded per-replica index of cached KV blocks, keyed by block hashes, any blocks.

    Args:
        capacity_blocks: most blocks remembered per replica (LRU beyond that); ``None`` means
            unbounded. Must be >= 1 when given.
        ttl_s: blocks not inserted/touched for this many seconds are dropped by :meth:`expire`;
            ``None`` disables TTL.

    Raises:
        ValueError: on a non-positive capacity or TTL.
    """

    __slots__ = ("capacity_blocks", "ttl_s", "_holders", "_lru", "_bit", "_replica_of_bit", "_free_bits")

    def __init__(self, capacity_blocks: int | None = None, ttl_s: float | None = None) -> None:
        if capacity_blocks is not None:
            capacity_blocks = checked_count("capacity_blocks", capacity_blocks, 1)
        ttl_s = checked_ttl_s("ttl_s", ttl_s)
        self.capacity_blocks = capacity_blocks
        self.ttl_s = ttl_s
        self._holders: dict[int, int] = {}  # block hash -> bit set of holder numbers
        self._lru: dict[ReplicaId, OrderedDict[int, float]] = {}
        self._bit: dict[ReplicaId, int] = {}  # replica -> 1 << its number
        self._replica_of_bit: dict[int, ReplicaId] = {}  # number -> replica
        self._free_bits: list[int] = []  # numbers released by clear(), reused first

    def _bit_of(self, replica: ReplicaId) -> int:
        bit = self._bit.get(replica)
        if bit is None:
            num = self._free_bits.pop() if self._free_bits else len(self._bit)
            bit = self._bit[replica] = 1 << num
            self._replica_of_bit[num] = replica
        return bit

    def _replicas_in(self, mask: int) -> list[ReplicaId]:
        """The replicas whose bits are set in ``mask``, lowest number first."""
        out = []
        of = self._replica_of_bit
        while mask:
            low = mask & -mask
            out.append(of[low.bit_length() - 1])
            mask ^= low
        return out

    # ------------------------------------------------------------------ queries (read-only)
    def match(self, block_hashes: Sequence[int], replicas: Iterable[ReplicaId] | None = None) -> dict[ReplicaId, int]:
        """Leading blocks of ``block_hashes`` held by each replica.

        Returns ``{replica: matched_blocks}`` for every replica with at least one matched block
        (restricted to ``replicas`` when given). Never exceeds ``len(block_hashes)``.
        """
        if not block_hashes:
            return {}
        holders = self._holders
        active = holders.get(block_hashes[0], 0)
        if replicas is not None and active:
            allowed = 0
            for r in replicas:
                allowed |= self._bit.get(r, 0)
            active &= allowed
        if not active:
            return {}
        result: dict[ReplicaId, int] = {}
        depth = 1
        for h in block_hashes[1:]:
            still = active & holders.get(h, 0)
            if still != active:
                for r in self._replicas_in(active ^ still):
                    result[r] = depth
                active = still
                if not active:
                    return result
            depth += 1
        for r in self._replicas_in(active):
            result[r] = depth
        return result

    def match_replica(self, replica: ReplicaId, block_hashes: Sequence[int]) -> int:
        """Leading blocks of ``block_hashes`` held by one replica."""
        lru = self._lru.get(replica)
        return leading_held(block_hashes, lru) if lru else 0

    def num_blocks(self, replica: ReplicaId | None = None) -> int:
        """Blocks held by ``replica``, or by all replicas together (counted per replica)."""
        if replica is not None:
            lru = self._lru.get(replica)
            return len(lru) if lru else 0
        return sum(len(lru) for lru in self._lru.values())

    def num_unique_blocks(self) -> int:
        """Distinct block hashes held anywhere."""
        return len(self._holders)

    def replicas(self) -> list[ReplicaId]:
        """Replicas that hold at least one block."""
        return [r for r, lru in self._lru.items() if lru]

    def holds(self, replica: ReplicaId, block_hash: int) -> bool:
        lru = self._lru.get(replica)
        return lru is not None and block_hash in lru

    def lru_order(self, replica: ReplicaId) -> list[int]:
        """The replica's blocks from least to most recently used (for tests and debugging)."""
        lru = self._lru.get(replica)
        return list(lru) if lru else []

    # ------------------------------------------------------------------ updates (hooks only)
    def insert(self, replica: ReplicaId, block_hashes: Sequence[int], now_s: float = 0.0, *,
               parent_block_hash: int | None = None) -> list[int]:
        """Record that ``replica`` holds ``block_hashes`` (a prompt's leading blocks) at ``now_s``.

        Touches the blocks deepest-first (the root ends most recently used), then evicts least
        recently used blocks beyond ``capacity_blocks``. Returns the evicted hashes, oldest first.
        If the prompt alone exceeds the capacity, only its first ``capacity_blocks`` blocks are kept.
        ``parent_block_hash`` (the block a continuation hangs from) is accepted for the same call
        as :meth:`PrefixIndex.insert`; a flat index keeps blocks wherever they are, so needs none.
        """
        lru = self._lru.get(replica)
        if lru is None:
            lru = self._lru[replica] = OrderedDict()
        holders = self._holders
        bit = self._bit_of(replica)
        cap = self.capacity_blocks
        blocks = block_hashes if cap is None or len(block_hashes) <= cap else block_hashes[:cap]
        move_to_end = lru.move_to_end
        if self.ttl_s is None:  # times are only read by expire(): a held block just moves
            for h in reversed(blocks):
                if h in lru:
                    move_to_end(h)
                else:
                    lru[h] = now_s
                    holders[h] = holders.get(h, 0) | bit
        else:
            for h in reversed(blocks):
                if h in lru:
                    move_to_end(h)
                    lru[h] = now_s
                else:
                    lru[h] = now_s
                    holders[h] = holders.get(h, 0) | bit
        if cap is None or len(lru) <= cap:
            return []
        evicted: list[int] = []
        keep = ~bit
        popitem = lru.popitem
        while len(lru) > cap:
            h = popitem(last=False)[0]
            mask = holders[h] & keep
            if mask:
                holders[h] = mask
            else:
                del holders[h]
            evicted.append(h)
        return evicted

    def remove(self, replica: ReplicaId, block_hashes: Iterable[int]) -> int:
        """Forget blocks on one replica (e.g. a ``BlockRemoved`` KV event). Returns how many were held."""
        lru = self._lru.get(replica)
        if not lru:
            return 0
        bit = self._bit[replica]
        n = 0
        for h in block_hashes:
            if lru.pop(h, None) is not None:
                self._drop_holder(h, bit)
                n += 1
        return n

    def clear(self, replica: ReplicaId) -> int:
        """Forget every block of one replica (``AllBlocksCleared`` event, or replica removed)."""
        lru = self._lru.pop(replica, None)
        bit = self._bit.pop(replica, None)
        if bit is not None:
            num = bit.bit_length() - 1
            del self._replica_of_bit[num]
            self._free_bits.append(num)
        if not lru:
            return 0
        assert bit is not None
        for h in lru:
            self._drop_holder(h, bit)
        return len(lru)

    def expire(self, now_s: float) -> int:
        """Drop blocks last touched more than ``ttl_s`` before ``now_s``; returns how many.

        A block touched at ``t`` survives while ``now_s - t <= ttl_s`` and is dropped once
        ``now_s - t > ttl_s``. Cost O(replicas + expired blocks): LRU order is time order.
        """
        if self.ttl_s is None:
            return 0
        ttl = self.ttl_s
        n = 0
        for replica, lru in self._lru.items():
            bit = self._bit[replica]
            while lru:
                h, t = next(iter(lru.items()))
                if now_s - t <= ttl:  # the documented rule, exact in floats (not t >= now - ttl)
                    break
                lru.popitem(last=False)
                self._drop_holder(h, bit)
                n += 1
        return n

    def _drop_holder(self, h: int, bit: int) -> None:
        mask = self._holders.get(h)
        if mask is not None:
            mask &= ~bit
            if mask:
                self._holders[h] = mask
            else:
                del self._holders[h]
