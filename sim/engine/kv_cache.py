"""A DP rank's prefix cache: an LRU of chained block hashes with a mutable capacity.

The cache holds blocks of finished prompts for reuse. On a rank whose KV memory also holds running
sequences (decode and mixed ranks), the cache gets what running sequences leave free: the
engine shrinks it with :meth:`BlockCache.set_capacity` when it reserves blocks for a sequence, and
grows it back when the sequence finishes (vLLM / SGLang keep freed blocks as evictable cache).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from balancer.hashing import leading_held


class BlockCache:
    """LRU set of block hashes, at most ``capacity_blocks`` of them.

    Blocks are inserted deepest-first so that a prompt's root is evicted last (tail blocks of a
    sequence go first, as in vLLM). ``match`` is read-only.
    """

    __slots__ = ("capacity_blocks", "_lru", "evicted_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def match(self, block_hashes: Sequence[int]) -> int:
        """Number of leading blocks of ``block_hashes`` held."""
        return leading_held(block_hashes, self._lru)

    def insert(self, block_hashes: Sequence[int]) -> list[int]:
        """Hold ``block_hashes`` (most recently used); returns the evicted hashes."""
        lru = self._lru
        cap = self.capacity_blocks
        blocks = block_hashes if len(block_hashes) <= cap else block_hashes[:cap]
        for h in reversed(blocks):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        return self._evict()

    def set_capacity(self, capacity_blocks: int) -> list[int]:
        """Change the capacity (>= 0), evicting LRU blocks beyond it; returns the evicted hashes."""
        self.capacity_blocks = max(0, capacity_blocks)
        return self._evict()

    def _evict(self) -> list[int]:
        lru = self._lru
        out: list[int] = []
        while len(lru) > self.capacity_blocks:
            out.append(lru.popitem(last=False)[0])
        self.evicted_blocks += len(out)
        return out
