"""A DP rank's prefix cache: an LRU of chained block hashes with a mutable capacity.

The cache holds blocks of finished prompts for reuse. On a rank whose KV memory also holds running
sequences (decode and mixed ranks), the cache gets what running sequences leave free: the
engine shrinks it with :meth:`BlockCache.set_capacity` when it reserves blocks for a sequence, and
grows it back when the sequence finishes (vLLM / SGLang keep freed blocks as evictable cache).

With shared prompt blocks (``Scenario.kv_accounting = "shared"``, vLLM's and SGLang's paged KV)
a running sequence's prompt blocks *are* cache blocks: :meth:`BlockCache.pin` holds them (counted
once, matched by other prompts, never evicted while held) and :meth:`BlockCache.unpin` lets them go
back to the LRU as its most recently used blocks when the last holder finishes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from balancer.hashing import leading_held


class BlockCache:
    """LRU set of block hashes, at most ``capacity_blocks`` of them.

    Blocks are inserted deepest-first so that a prompt's root is evicted last (tail blocks of a
    sequence go first, as in vLLM). ``match`` is read-only. Pinned blocks (:meth:`pin`) count
    towards the capacity but are not in the LRU: only unpinned blocks are evicted.
    """

    __slots__ = ("capacity_blocks", "_lru", "_pinned", "evicted_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._pinned: dict[int, int] = {}  # block hash -> running sequences holding it
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._lru) + len(self._pinned)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru or block_hash in self._pinned

    @property
    def num_pinned(self) -> int:
        """Blocks held by running sequences (not evictable)."""
        return len(self._pinned)

    def count_unpinned(self, block_hashes: Sequence[int]) -> int:
        """How many of ``block_hashes`` no running sequence holds (pinning them takes that many
        blocks out of the evictable ones)."""
        pinned = self._pinned
        return sum(1 for h in block_hashes if h not in pinned)

    def match(self, block_hashes: Sequence[int]) -> int:
        """Number of leading blocks of ``block_hashes`` held (pinned or not)."""
        return leading_held(block_hashes, self if self._pinned else self._lru)

    def insert(self, block_hashes: Sequence[int]) -> list[int]:
        """Hold ``block_hashes`` (most recently used); returns the evicted hashes. Pinned blocks
        stay pinned."""
        lru = self._lru
        pinned = self._pinned
        cap = self.capacity_blocks
        blocks = block_hashes if len(block_hashes) <= cap else block_hashes[:cap]
        for h in reversed(blocks):
            if h in lru:
                lru.move_to_end(h)
            elif h not in pinned:
                lru[h] = None
        return self._evict()

    def pin(self, block_hashes: Sequence[int]) -> list[int]:
        """A running sequence holds ``block_hashes`` (its prompt's blocks): each leaves the LRU (or
        is added) and is not evicted until as many :meth:`unpin` calls. Returns the hashes evicted
        to make room for blocks that were not held."""
        lru = self._lru
        pinned = self._pinned
        for h in block_hashes:
            n = pinned.get(h)
            if n is None:
                lru.pop(h, None)
                pinned[h] = 1
            else:
                pinned[h] = n + 1
        return self._evict()

    def unpin(self, block_hashes: Sequence[int]) -> list[int]:
        """A running sequence releases ``block_hashes`` (pinned by it before): blocks no other
        sequence holds go back to the LRU as its most recently used, deepest first (so the root is
        evicted last, as :meth:`insert`). Returns the evicted hashes.

        Raises:
            ValueError: a hash that is not pinned (an accounting bug).
        """
        lru = self._lru
        pinned = self._pinned
        for h in reversed(block_hashes):
            n = pinned.get(h)
            if n is None:
                raise ValueError(f"unpin of block {h} that is not pinned")
            if n > 1:
                pinned[h] = n - 1
            else:
                del pinned[h]
                lru[h] = None
        return self._evict()

    def set_capacity(self, capacity_blocks: int) -> list[int]:
        """Change the capacity (>= 0), evicting LRU blocks beyond it; returns the evicted hashes."""
        self.capacity_blocks = max(0, capacity_blocks)
        return self._evict()

    def _evict(self) -> list[int]:
        lru = self._lru
        out: list[int] = []
        room = self.capacity_blocks - len(self._pinned)
        while len(lru) > room and lru:
            out.append(lru.popitem(last=False)[0])
        self.evicted_blocks += len(out)
        return out
