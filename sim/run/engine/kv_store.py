"""A KV block store with LRU capacity and per-traffic-class TTL: host-DRAM tiers and shared stores.

:class:`KvStore` holds chained KV block hashes (see :mod:`balancer.hashing`: a hash names its
whole prefix, so ``match`` walks a prompt's hashes front to back until the first miss). It is used
for a per-engine host-DRAM tier and for a cluster-wide shared store in the style of DeepSeek's
3FS KV cache.

Rules (all times in seconds on the caller's clock, e.g. ``env.now``):

* **TTL counts from the last access.** A block's ``last_access_s`` is set by :meth:`insert` and
  by :meth:`touch` (a hit). The block is *live* at ``now_s`` iff
  ``now_s - last_access_s <= ttl`` (boundary inclusive, the rule of
  :class:`balancer.prefix_index.PrefixIndex`): at ``now_s - t == ttl`` it is live, one ulp later
  it is not. A ``ttl`` of ``None`` never expires.
* **TTL per traffic class.** ``class_ttl_s`` maps a class (``"agent"``, ``"chatbot"``, ...) to its
  TTL; any other class, and ``None``, gets ``ttl_s``. Source: DeepSeek's online service keeps KV
  on 3FS SSD with a TTL of about 3 days for agent traffic and 7 days for chatbot traffic (DeepSeek
  API context caching on disk; DeepSeek-V3 inference system overview). A block touched by several
  classes (a system prompt shared by chatbot and agent sessions) keeps the **largest** TTL of the
  classes that inserted or touched it since it was stored; the max is forgotten once the block
  leaves the store.
* **Expired blocks are misses at once, swept lazily.** :meth:`match` treats a held block whose
  TTL has passed as a miss; :meth:`expire` removes such blocks and returns them. Re-inserting an
  expired-but-unswept block counts it as expired and then inserted anew; :meth:`touch` never
  revives one.
* **LRU over capacity.** :meth:`insert` touches blocks deepest-first (a prompt's root ends most
  recently used, as in :class:`sim.run.engine.kv_cache.BlockCache`), so LRU eviction takes the tail
  blocks of a prompt before the prefixes they hang from. When over capacity it first sweeps
  expired blocks, then evicts least recently used live blocks.
* **Conservation.** ``inserted_blocks == len(store) + evicted_blocks + expired_blocks`` always.
* **Clock.** ``now_s`` must not decrease from one call to the next (``ValueError`` otherwise);
  the simulator's clock never does.

Cost: blocks live in one ``OrderedDict`` per distinct TTL value, in access order, so the front of
each is both its least recently used and its earliest-expiring block. ``match`` is O(matched
blocks); ``insert`` / ``touch`` O(blocks given + removed x TTL groups); ``expire`` amortised
O(expired blocks + TTL groups). Memory O(held blocks). There are as many TTL groups as distinct
TTL values (two or three in practice).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence

__all__ = ["KvStore"]

_INF = math.inf


class KvStore:
    """A KV block store: LRU over chained block hashes, bounded capacity, TTL per traffic class.

    Used for a per-engine host-DRAM tier and for the cluster-wide shared (3FS-like) store; see the
    module docstring for the exact rules (TTL from last access, inclusive boundary, max-TTL rule
    for blocks shared by classes, deepest-first LRU).

    Args:
        capacity_blocks: most blocks held (>= 0); ``None`` = unbounded.
        ttl_s: TTL in seconds (> 0) of blocks of a class not in ``class_ttl_s`` (and of
            ``traffic_class=None``); ``None`` = never expire.
        class_ttl_s: TTL in seconds (> 0) per traffic class, overriding ``ttl_s``; e.g.
            ``{"agent": 3 * 86400, "chatbot": 7 * 86400}`` (DeepSeek).

    Attributes:
        inserted_blocks: blocks newly stored (refreshing a live block does not count).
        evicted_blocks: blocks dropped by LRU over capacity.
        expired_blocks: blocks dropped because their TTL passed.

    Raises:
        ValueError: a negative capacity, or a TTL that is not a finite number > 0.
    """

    __slots__ = (
        "capacity_blocks",
        "ttl_s",
        "class_ttl_s",
        "inserted_blocks",
        "evicted_blocks",
        "expired_blocks",
        "_groups",
        "_ttl_of",
        "_seq",
        "_last_now_s",
    )

    def __init__(
        self,
        capacity_blocks: int | None,
        ttl_s: float | None = None,
        class_ttl_s: Mapping[str, float] | None = None,
    ) -> None:
        if capacity_blocks is not None and (
            isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 0
        ):
            raise ValueError(f"capacity_blocks must be an int >= 0 or None, got {capacity_blocks!r}")
        self.capacity_blocks = capacity_blocks
        self.ttl_s = None if ttl_s is None else _check_ttl(ttl_s, "ttl_s")
        self.class_ttl_s: dict[str, float] = {
            str(c): _check_ttl(t, f"class_ttl_s[{c!r}]") for c, t in (class_ttl_s or {}).items()
        }
        self.inserted_blocks = 0
        self.evicted_blocks = 0
        self.expired_blocks = 0
        # TTL value (inf = none) -> {hash: (last_access_s, seq)} in access order (oldest first).
        self._groups: dict[float, OrderedDict[int, tuple[float, int]]] = {}
        self._ttl_of: dict[int, float] = {}  # hash -> its TTL group key
        self._seq = 0  # global access counter: LRU order across groups, deterministic ties
        self._last_now_s = -_INF

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        """Blocks held, including expired blocks not yet swept by :meth:`expire`."""
        return len(self._ttl_of)

    def __contains__(self, block_hash: object) -> bool:
        """Whether the block is held (live or expired-but-unswept; use :meth:`is_live` for TTL)."""
        return block_hash in self._ttl_of

    def ttl_for(self, traffic_class: str | None) -> float | None:
        """TTL in seconds that ``traffic_class`` gives a block (``None``: never expires)."""
        if traffic_class is not None and traffic_class in self.class_ttl_s:
            return self.class_ttl_s[traffic_class]
        return self.ttl_s

    def block_ttl_s(self, block_hash: int) -> float | None:
        """The held block's current TTL in seconds (``None``: never expires).

        Raises:
            KeyError: the block is not held.
        """
        ttl = self._ttl_of[block_hash]
        return None if ttl == _INF else ttl

    def last_access_s(self, block_hash: int) -> float:
        """When the held block was last inserted or touched (seconds). Raises KeyError if not held."""
        return self._groups[self._ttl_of[block_hash]][block_hash][0]

    def is_live(self, block_hash: int, now_s: float) -> bool:
        """Whether the block is held and ``now_s - last_access_s <= ttl`` (read-only)."""
        ttl = self._ttl_of.get(block_hash)
        if ttl is None:
            return False
        return now_s - self._groups[ttl][block_hash][0] <= ttl

    def match(self, block_hashes: Sequence[int], now_s: float) -> int:
        """Number of leading blocks of ``block_hashes`` held and live at ``now_s`` (read-only).

        Stops at the first block that is absent or expired (an expired block not yet removed by
        :meth:`expire` is a miss). Does not refresh anything: call :meth:`touch` for a hit.
        """
        ttl_of = self._ttl_of
        groups = self._groups
        n = 0
        for h in block_hashes:
            ttl = ttl_of.get(h)
            if ttl is None or now_s - groups[ttl][h][0] > ttl:
                break
            n += 1
        return n

    def lru_order(self) -> list[int]:
        """Held blocks from least to most recently accessed (for tests and debugging; O(n log n))."""
        items = [(seq, h) for g in self._groups.values() for h, (_, seq) in g.items()]
        items.sort()
        return [h for _, h in items]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ttl_of)

    # ------------------------------------------------------------------ updates
    def insert(self, block_hashes: Sequence[int], now_s: float, traffic_class: str | None = None) -> list[int]:
        """Store or refresh ``block_hashes`` (a prompt's leading blocks) at ``now_s``.

        Blocks are accessed deepest-first, so the first block ends most recently used. A live
        held block is refreshed (``last_access_s = now_s``) and its TTL raised to this class's
        if larger; an absent or expired block is stored anew. If the blocks alone exceed the
        capacity, only the first ``capacity_blocks`` are stored. When over capacity, expired
        blocks are swept first, then least recently used blocks are evicted.

        Args:
            block_hashes: chained block hashes, shape ``(n_blocks,)``.
            now_s: current time in seconds (non-decreasing across calls).
            traffic_class: the class whose TTL applies (see :meth:`ttl_for`).

        Returns:
            Every hash this call removed from the store, oldest first: expired blocks swept to
            make room (counted in ``expired_blocks``) and LRU evictions (``evicted_blocks``).
            Re-inserted expired blocks are counted as expired but not returned (still held).

        Raises:
            ValueError: ``now_s`` is earlier than a previous call's.
        """
        self._advance(now_s)
        cap = self.capacity_blocks
        blocks = block_hashes if cap is None or len(block_hashes) <= cap else block_hashes[:cap]
        class_ttl = self.ttl_for(traffic_class)
        ttl_new = _INF if class_ttl is None else class_ttl
        groups = self._groups
        ttl_of = self._ttl_of
        seq = self._seq
        for h in reversed(blocks):
            old = ttl_of.get(h)
            ttl = ttl_new
            if old is not None:
                g = groups[old]
                if now_s - g[h][0] > old:  # expired, not yet swept: it dies and is born again
                    self.expired_blocks += 1
                    self.inserted_blocks += 1
                else:
                    ttl = old if old > ttl_new else ttl_new
                del g[h]
            else:
                self.inserted_blocks += 1
            seq += 1
            grp = groups.get(ttl)
            if grp is None:
                grp = groups[ttl] = OrderedDict()
            grp[h] = (now_s, seq)
            ttl_of[h] = ttl
        self._seq = seq
        removed: list[int] = []
        if cap is not None and len(ttl_of) > cap:
            removed = self._sweep(now_s)
            while len(ttl_of) > cap:
                removed.append(self._pop_lru())
                self.evicted_blocks += 1
        return removed

    def touch(self, block_hashes: Sequence[int], now_s: float, traffic_class: str | None = None) -> None:
        """Refresh the last access of held, live blocks (a hit), deepest-first like :meth:`insert`.

        Absent and expired blocks are ignored (a touch does not revive a block). With a
        ``traffic_class``, a block's TTL is raised to that class's TTL if larger.

        Raises:
            ValueError: ``now_s`` is earlier than a previous call's.
        """
        self._advance(now_s)
        groups = self._groups
        ttl_of = self._ttl_of
        cls_ttl = None
        if traffic_class is not None:
            t = self.ttl_for(traffic_class)
            cls_ttl = _INF if t is None else t
        seq = self._seq
        for h in reversed(block_hashes):
            old = ttl_of.get(h)
            if old is None:
                continue
            g = groups[old]
            if now_s - g[h][0] > old:
                continue
            seq += 1
            if cls_ttl is not None and cls_ttl > old:
                del g[h]
                grp = groups.get(cls_ttl)
                if grp is None:
                    grp = groups[cls_ttl] = OrderedDict()
                grp[h] = (now_s, seq)
                ttl_of[h] = cls_ttl
            else:
                g[h] = (now_s, seq)
                g.move_to_end(h)
        self._seq = seq

    def expire(self, now_s: float) -> list[int]:
        """Remove every block with ``now_s - last_access_s > ttl``; return them, least recently
        accessed first. Amortised O(expired blocks + TTL groups).

        Raises:
            ValueError: ``now_s`` is earlier than a previous call's.
        """
        self._advance(now_s)
        return self._sweep(now_s)

    def clear(self) -> int:
        """Remove every block without counting it as evicted or expired; returns how many were held.

        Resets the counters to zero too, so conservation keeps holding."""
        n = len(self._ttl_of)
        self._groups.clear()
        self._ttl_of.clear()
        self.inserted_blocks = self.evicted_blocks = self.expired_blocks = 0
        return n

    # ------------------------------------------------------------------ internals
    def _advance(self, now_s: float) -> None:
        if now_s < self._last_now_s:
            raise ValueError(f"now_s went backwards: {now_s!r} after {self._last_now_s!r}")
        self._last_now_s = now_s

    def _sweep(self, now_s: float) -> list[int]:
        dead: list[tuple[int, int]] = []  # (seq, hash)
        ttl_of = self._ttl_of
        groups_hit = 0
        for ttl, g in self._groups.items():
            if ttl == _INF or not g:
                continue
            n0 = len(dead)
            while g:
                h, (t, seq) = next(iter(g.items()))
                if now_s - t <= ttl:  # the documented rule, exact in floats
                    break
                g.popitem(last=False)
                del ttl_of[h]
                dead.append((seq, h))
            groups_hit += len(dead) > n0
        if groups_hit > 1:
            dead.sort()  # least recently accessed first across groups
        self.expired_blocks += len(dead)
        return [h for _, h in dead]

    def _pop_lru(self) -> int:
        best_g: OrderedDict[int, tuple[float, int]] | None = None
        best_seq = 0
        for g in self._groups.values():
            if g:
                _, (_, seq) = next(iter(g.items()))
                if best_g is None or seq < best_seq:
                    best_g, best_seq = g, seq
        assert best_g is not None  # only called while len > capacity >= 0
        h, _ = best_g.popitem(last=False)
        del self._ttl_of[h]
        return h


def _check_ttl(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0 (seconds), got {value!r}")
    return float(value)
