"""Which replica holds which prompt prefixes: a radix tree of KV block hashes with exact block LRU.

The router's view of each replica's HBM prefix cache. A prompt is a chain of block hashes
(:mod:`balancer.hashing`: block ``k``'s hash chains block ``k-1``'s, so a hash names a whole
prefix). The index stores prompts as paths in a radix tree whose edges are *runs* of blocks
(``_Node.blocks``): a run splits only where two prompts diverge or one ends, so a 64-block prompt
that shares a 32-block system prompt with earlier ones is two nodes, not 64 entries. Each node
keeps

- ``holders``: the replicas holding all of its blocks, as a bit set (a Python ``int`` with bit
  ``b`` set for the replica numbered ``b``), so a prefix match is one ``&`` per *node* on the
  prompt's path, whatever the number of replicas;
- one LRU entry per holder, linked into that replica's LRU list (oldest first) with the time the
  replica last inserted or touched it.

Semantics are those of a per-replica, per-block LRU (and what :class:`balancer.block_index.BlockIndex`
does block by block; the tests check both against one list model): inserting a prompt touches
its blocks deepest-first, so the root block ends most recently used and eviction takes leaves
before the prefixes they hang from (vLLM frees a sequence's tail blocks first); a replica holds at
most ``capacity_blocks`` blocks, the least recently used beyond that are evicted and returned,
oldest first; with a TTL, blocks not touched for ``ttl_s`` are dropped by :meth:`expire`. A run's
blocks are always touched together, so they stay adjacent in each holder's LRU order; when an
eviction, a removal or a diverging prompt needs part of a run, the node splits in two and both
pieces keep their exact places in every holder's order. Pieces whose holders and places agree
again are merged back when an insert's path or a drop passes them (opportunistically: the tree
may keep more runs than the minimum, which never changes an answer).

Cost per decision: ``match_depths``/``match`` O(nodes on the prompt's path + depth changes);
``insert`` O(nodes on the path + evicted nodes) plus O(new blocks) and O(evicted blocks) in C-level
dict bulk updates of the block -> node map when it is kept (events mode), plus O(holders) for a
split of a shared node. Memory: one node (with its holders' entries) per run, and one map entry
per block in the tree (held, or in a run kept as the parent of held runs) when the map is kept.

Inserted block lists must be a prompt's leading blocks (from block 0), as routed prompts are, or
name the block they continue (``parent_block_hash``, as vLLM's ``BlockStored`` events do); a list
without a parent is taken as a prompt's start. With the block map on (``block_map=True``, events
mode), an insert whose first new block is already indexed at another place raises ``ValueError``. Blocks from arbitrary positions (lower KV tiers) go to
:class:`balancer.block_index.BlockIndex`.

Sources: SGLang's cache-aware router (an approximate radix tree per worker, LRU leaf eviction),
Dynamo's KV router radix tree of block hashes (ANCHORS.md), vLLM automatic prefix caching.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any
from itertools import repeat

import numpy as np

from balancer.types import ReplicaId, checked_count, checked_ttl_s


#: Most holder bit sets whose replica numbers :meth:`PrefixIndex.match_depths` keeps converted.
MASK_CACHE_SIZE = 1024


def _bit_numbers(mask: int) -> np.ndarray:
    """The numbers of the bits set in ``mask``, ascending, as an int64 array."""
    nbytes = (mask.bit_length() + 7) // 8
    raw = np.frombuffer(mask.to_bytes(nbytes, "little"), dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little"))


class _Entry:
    """A node's place in one replica's LRU list (doubly linked; the list's sentinel has node
    :data:`_NO_NODE`, never read: walks stop at the sentinel). ``time`` and ``touch_id`` are those
    of the last :meth:`PrefixIndex.insert` that touched it (``touch_id``: the caller's token, e.g.
    the router's route number, ``None`` when none was given)."""

    __slots__ = ("node", "time", "touch_id", "prev", "next")

    def __init__(self, node: _Node, time: float, touch_id: int | None = None) -> None:
        self.node = node
        self.time = time
        self.touch_id = touch_id
        self.prev: _Entry = self
        self.next: _Entry = self


class _Node:
    """A run of blocks: ``blocks`` (hashes, in prompt order) hangs from ``parent``'s last block."""

    __slots__ = ("blocks", "parent", "children", "holders", "entries")

    def __init__(self, blocks: tuple[int, ...], parent: _Node | None) -> None:
        self.blocks = blocks
        self.parent = parent
        self.children: dict[int, _Node] = {}  # first block hash of a child -> child
        self.holders = 0  # bit set of the replicas holding every block of the run
        self.entries: dict[int, _Entry] = {}  # replica number -> its LRU entry for this node


_NO_NODE = _Node((), None)
"""The node of every LRU list's sentinel entry (a placeholder: no run, never in a tree)."""


class _Replica:
    """Per-replica state: its number, LRU list sentinel and held block count. O(1) memory: the
    replica's bit (``1 << num``, ``num / 8`` bytes) is built when needed, not stored, so that
    n replicas cost O(n), not O(n**2) bits."""

    __slots__ = ("num", "head", "blocks")

    def __init__(self, num: int) -> None:
        self.num = num
        self.head = _Entry(_NO_NODE, 0.0)  # head.next: least recently used; head.prev: most
        self.blocks = 0


def _link_after(ref: _Entry, e: _Entry) -> None:
    nxt = ref.next
    e.prev = ref
    e.next = nxt
    nxt.prev = e
    ref.next = e


def _unlink(e: _Entry) -> None:
    e.prev.next = e.next
    e.next.prev = e.prev


class PrefixIndex:
    """Bounded per-replica index of cached prompt prefixes (see the module docstring).

    Args:
        capacity_blocks: most blocks remembered per replica (LRU beyond that); ``None`` means
            unbounded. Must be >= 1 when given.
        ttl_s: blocks not inserted/touched for this many seconds are dropped by :meth:`expire`;
            ``None`` disables TTL.
        total_capacity_blocks: most blocks remembered over all replicas together (``None``:
            no global bound): each replica's bound becomes ``min(capacity_blocks,
            total_capacity_blocks // numbered replicas)``, shrinking (with LRU evictions of the
            replicas above it) when a replica is numbered, so 512 replicas cannot hold 512 times
            the per-replica bound. Must be >= 1 when given.
        block_map: keep a block hash -> run map from the start, so that :meth:`remove` and
            :meth:`holds` cost O(1) per block and an insert that does not start at a prompt's
            first block is refused (``ValueError``). Costs a dict entry per distinct block and
            C-level map updates on every new, split, merged or pruned run. Without it the map is
            built on the first :meth:`remove` / :meth:`holds` call and kept from then on; routing
            alone (approximate mode) never needs it. The router turns it on in events mode.

    Raises:
        ValueError: on a non-positive capacity or TTL.
    """

    __slots__ = ("capacity_blocks", "total_capacity_blocks", "ttl_s", "_root", "_node_of", "_state", "_replica_of_num", "_free_nums",
                 "_version", "_numbers_cache", "_unique", "_mask_numbers", "_blocks_bound",
                 "defer_rebalance")

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        """Pickled flat (:meth:`to_flat`): a deep index does not hit Python's recursion limit."""
        return (PrefixIndex.from_flat, (self.to_flat(),))

    def to_flat(self) -> dict[str, Any]:
        """The index as plain lists and numbers (its runs, each replica's LRU order with times,
        replica numbers, bounds), for saving; :meth:`from_flat` rebuilds it. The index is unchanged."""
        return _flat_index(self)

    @classmethod
    def from_flat(cls, flat: dict[str, Any]) -> PrefixIndex:
        """The index :meth:`to_flat` saved (same matches, LRU orders, times, replica numbers and
        bounds), rebuilt through the public methods."""
        return _unflat_index(flat)

    def __init__(self, capacity_blocks: int | None = None, ttl_s: float | None = None, *,
                 block_map: bool = False, total_capacity_blocks: int | None = None) -> None:
        if capacity_blocks is not None:
            capacity_blocks = checked_count("capacity_blocks", capacity_blocks, 1)
        if total_capacity_blocks is not None:
            total_capacity_blocks = checked_count("total_capacity_blocks", total_capacity_blocks, 1)
        self.total_capacity_blocks = total_capacity_blocks
        ttl_s = checked_ttl_s("ttl_s", ttl_s)  # NaN was taken: no entry ever expired
        self.capacity_blocks = capacity_blocks
        self.ttl_s = ttl_s
        self._root = _Node((), None)
        # block hash -> the node whose run holds it; built on the first query that needs it
        # (remove(), holds()), then kept up to date: routing alone never pays for it
        self._node_of: dict[int, _Node] | None = {} if block_map else None
        self._state: dict[ReplicaId, _Replica] = {}
        self._replica_of_num: dict[int, ReplicaId] = {}
        self._free_nums: list[int] = []  # numbers released by clear(), reused first
        self._version = 0  # bumped whenever a number is assigned or released
        self._numbers_cache: dict[int, tuple[tuple[ReplicaId, ...], int, tuple[np.ndarray, bool]]] = {}
        self._unique = 0  # blocks of nodes with at least one holder
        # holder bit set -> its replica numbers (np.ndarray): the same few sets (a shared prefix's
        # holders, a prompt's pair of replicas) come back decision after decision
        self._mask_numbers: dict[int, np.ndarray] = {}
        #: no replica holds more blocks than this (raised by inserts, lowered by eviction passes)
        self._blocks_bound = 0
        #: registering a replica leaves the others over the new share until :meth:`rebalance`
        #: (a batch of registrations then costs one pass, not one per replica)
        self.defer_rebalance = False

    # ------------------------------------------------------------------ numbering
    def _state_of(self, replica: ReplicaId) -> _Replica:
        rs = self._state.get(replica)
        if rs is None:
            num = self._free_nums.pop() if self._free_nums else len(self._state)
            rs = self._state[replica] = _Replica(num)
            self._replica_of_num[num] = replica
            self._version += 1
            if self.total_capacity_blocks is not None:  # the per-replica share shrank
                cap = self.effective_capacity_blocks()
                assert cap is not None  # a global bound gives a per-replica one
                # no replica holds more than _blocks_bound: the pass over all of them is needed
                # only when the share fell below it (registering n replicas was O(n^2) otherwise:
                # 3 s for the 4,096 ranks of one engine next to 12k empty others)
                if self._blocks_bound > cap and not self.defer_rebalance:
                    self.rebalance()
        return rs

    def rebalance(self) -> None:
        """Evict every replica down to the per-replica share now in force (registering replicas
        does it, unless :attr:`defer_rebalance` is set: then call this once after the batch)."""
        cap = self.effective_capacity_blocks()
        if cap is None or self._blocks_bound <= cap:
            return
        bound = 0
        for other in list(self._state.values()):
            if other.blocks > cap:
                self._evict_to(other, cap)
            bound = max(bound, other.blocks)
        self._blocks_bound = bound

    def effective_capacity_blocks(self) -> int | None:
        """The bound per replica now: ``capacity_blocks``, lowered to an even share of
        ``total_capacity_blocks`` over the numbered replicas (at least 1)."""
        cap = self.capacity_blocks
        if self.total_capacity_blocks is not None:
            share = max(1, self.total_capacity_blocks // max(1, len(self._state)))
            cap = share if cap is None else min(cap, share)
        return cap

    def register(self, replica: ReplicaId) -> int:
        """Give ``replica`` its number now (see :meth:`numbers`) rather than at its first insert;
        returns it. The router registers every replica it adds, so the cached number arrays stay
        valid while replicas receive their first prompts (a new number invalidates them all)."""
        return (self._state.get(replica) or self._state_of(replica)).num

    def _replicas_in(self, mask: int) -> list[ReplicaId]:
        """The replicas whose bits are set in ``mask``, lowest number first."""
        out = []
        of = self._replica_of_num
        while mask:
            low = mask & -mask
            out.append(of[low.bit_length() - 1])
            mask ^= low
        return out

    def _size(self) -> int:
        return len(self._state) + len(self._free_nums)

    def _block_map(self) -> dict[int, _Node]:
        """The block hash -> node map, built from the tree on first use (O(blocks) once)."""
        if self._node_of is None:
            node_of: dict[int, _Node] = {}
            stack = list(self._root.children.values())
            while stack:
                node = stack.pop()
                node_of.update(zip(node.blocks, repeat(node)))
                stack.extend(node.children.values())
            self._node_of = node_of
        return self._node_of

    # ------------------------------------------------------------------ the walk
    @staticmethod
    def _common(run: tuple[int, ...], hs: Sequence[int], pos: int) -> int:
        """Leading blocks of ``run`` equal to ``hs[pos:]``: >= 1 when called (the child was found by
        its first block). Full runs are one C-level tuple compare; a partial run costs a binary
        search over prefix compares (prefix equality is monotone in the length)."""
        n = len(run)
        if len(hs) - pos >= n and tuple(hs[pos:pos + n]) == run:
            return n
        lo, hi = 1, min(n, len(hs) - pos)  # run[:lo] matches; run[:hi + 1] does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tuple(hs[pos:pos + mid]) == run[:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ------------------------------------------------------------------ queries (read-only)
    def match(self, block_hashes: Sequence[int], replicas: Iterable[ReplicaId] | None = None) -> dict[ReplicaId, int]:
        """Leading blocks of ``block_hashes`` held by each replica.

        Returns ``{replica: matched_blocks}`` for every replica with at least one matched block
        (restricted to ``replicas`` when given). Never exceeds ``len(block_hashes)``.
        """
        allowed = -1
        if replicas is not None:
            allowed = 0
            for r in replicas:
                rs = self._state.get(r)
                if rs is not None:
                    allowed |= 1 << rs.num
        result: dict[ReplicaId, int] = {}
        for mask, depth in self._depth_changes(block_hashes, allowed):
            for r in self._replicas_in(mask):
                result[r] = depth
        return result

    def _depth_changes(self, hs: Sequence[int], active: int = -1) -> list[tuple[int, int]]:
        """``[(bit set, depth)]``: the replicas (within ``active``) whose match ends at ``depth``
        blocks, for every depth where some match ends (depth >= 1)."""
        out: list[tuple[int, int]] = []
        node = self._root
        pos = 0
        n = len(hs)
        first = True
        while pos < n:
            child = node.children.get(hs[pos])
            if child is None:
                break
            still = active & child.holders
            if still != active and not first:
                out.append((active ^ still, pos))
            first = False
            active = still
            if not active:
                return out
            k = self._common(child.blocks, hs, pos)
            pos += k
            if k < len(child.blocks):
                break
            node = child
        if pos and active and not first:
            out.append((active, pos))
        return out

    def match_depths(self, block_hashes: Sequence[int]) -> np.ndarray:
        """Leading blocks of ``block_hashes`` held by each numbered replica, as one array.

        Returns shape ``(number of replica numbers,)``, int64, indexed by replica number (see
        :meth:`numbers`); 0 for replicas holding nothing of the prompt. Replicas whose match ends
        at the same node are written with one vectorised store (their numbers converted from the
        bit set once and cached), so the cost is O(nodes on the path + depth changes), not
        O(matching replicas) Python work.
        """
        size = self._size()
        out = np.zeros(size, dtype=np.int64)
        if not block_hashes or not size:
            return out
        cache = self._mask_numbers
        for mask, depth in self._depth_changes(block_hashes):
            nums = cache.get(mask)
            if nums is None:
                if len(cache) >= MASK_CACHE_SIZE:
                    cache.clear()
                nums = cache[mask] = _bit_numbers(mask)
            out[nums] = depth
        return out

    def numbers(self, replicas: tuple[ReplicaId, ...]) -> np.ndarray:
        """Each replica's number in :meth:`match_depths`, shape ``(n,)``: -1 for a replica without
        a number (never registered nor inserted, or cleared); a numbered replica that holds
        nothing of a prompt reads depth 0.

        Cached per ``replicas`` tuple object (tuples cannot change) until a number is assigned or
        released, so a router passing the same candidate tuple pays a dict lookup, not O(n) work.
        """
        return self.numbers_known(replicas)[0]

    def numbers_known(self, replicas: tuple[ReplicaId, ...]) -> tuple[np.ndarray, bool]:
        """``(numbers(replicas), every replica has a number)``: :meth:`numbers` and whether none
        of them is -1 (then ``depths[numbers]`` needs no mask), cached alike."""
        hit = self._numbers_cache.get(id(replicas))
        if hit is not None and hit[0] is replicas and hit[1] == self._version:
            return hit[2]
        state = self._state
        arr = np.fromiter((state[r].num if r in state else -1 for r in replicas), dtype=np.int64, count=len(replicas))
        arr.flags.writeable = False  # cached and handed out: nobody may change it
        if len(self._numbers_cache) >= 16:
            self._numbers_cache.clear()
        got = (arr, bool(len(arr)) and bool(arr.min() >= 0))
        self._numbers_cache[id(replicas)] = (replicas, self._version, got)
        return got

    def match_replica(self, replica: ReplicaId, block_hashes: Sequence[int]) -> int:
        """Leading blocks of ``block_hashes`` held by one replica."""
        rs = self._state.get(replica)
        if rs is None:
            return 0
        changes = self._depth_changes(block_hashes, 1 << rs.num)
        return changes[0][1] if changes else 0

    def num_blocks(self, replica: ReplicaId | None = None) -> int:
        """Blocks held by ``replica``, or by all replicas together (counted per replica)."""
        if replica is not None:
            rs = self._state.get(replica)
            return rs.blocks if rs is not None else 0
        return sum(rs.blocks for rs in self._state.values())

    def num_unique_blocks(self) -> int:
        """Distinct block hashes held anywhere."""
        return self._unique

    def num_nodes(self) -> int:
        """Runs (tree nodes) in the index, held or kept as the parent of held runs."""
        count, stack = 0, [self._root]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count - 1

    def replicas(self) -> list[ReplicaId]:
        """Replicas that hold at least one block."""
        return [r for r, rs in self._state.items() if rs.blocks]

    def holds(self, replica: ReplicaId, block_hash: int) -> bool:
        """Whether ``replica`` holds the block (the first call builds the block map if it is
        not kept: O(blocks in the tree) once)."""
        rs = self._state.get(replica)
        node = self._block_map().get(block_hash)
        return rs is not None and node is not None and bool(node.holders >> rs.num & 1)

    def lru_order(self, replica: ReplicaId) -> list[int]:
        """The replica's blocks from least to most recently used (for tests and debugging)."""
        rs = self._state.get(replica)
        out: list[int] = []
        if rs is None:
            return out
        e = rs.head.next
        while e is not rs.head:
            out.extend(reversed(e.node.blocks))
            e = e.next
        return out

    # ------------------------------------------------------------------ updates (hooks only)
    def insert(self, replica: ReplicaId, block_hashes: Sequence[int], now_s: float = 0.0, *,
               parent_block_hash: int | None = None, touch_id: int | None = None) -> list[int]:
        """Record that ``replica`` holds ``block_hashes`` at ``now_s``: a prompt's leading blocks,
        or, with ``parent_block_hash``, the blocks that continue the block with that hash (as an
        engine's ``BlockStored`` event announces only its new blocks).

        Touches the given blocks deepest-first (the first ends most recently used), then evicts
        least recently used blocks beyond ``capacity_blocks``. Returns the evicted hashes, oldest
        first. If the list alone exceeds the capacity, only its first ``capacity_blocks`` blocks
        are kept. A continuation of a block the index does not know is dropped (returns ``[]``):
        it could never be matched, since a match starts at a prompt's first block. ``touch_id``
        marks the touched blocks as this insert's (the router passes its route number), so that
        :meth:`remove_untouched` tells apart two inserts at the same ``now_s``.

        Raises:
            ValueError: with the block map on, the first block of the list's new part is
                already in the tree at another place (the list neither starts at a prompt's
                first block nor names its parent, or hashes are not chained).
        """
        rs = self._state.get(replica) or self._state_of(replica)
        cap = self.capacity_blocks if self.total_capacity_blocks is None else self.effective_capacity_blocks()
        hs = block_hashes if cap is None or len(block_hashes) <= cap else block_hashes[:cap]
        n = len(hs)
        if not n:
            return []
        path: list[_Node] = []
        node = self._root
        if parent_block_hash is not None:  # start below the parent block (split its run after it)
            parent = self._block_map().get(parent_block_hash)
            if parent is None:
                return []
            i = parent.blocks.index(parent_block_hash) + 1
            node = parent if i == len(parent.blocks) else self._split(parent, i)[0]
            # the engine's sequence uses the blocks it continues: they are touched too (root to
            # parent), so the chain's runs share one time and LRU place and merge into one node
            # (1,000 continuation events of one chain: 1 node, not 1,000)
            up: _Node | None = node
            while up is not self._root:
                assert up is not None  # every run below the root has a parent
                path.append(up)
                up = up.parent
            path.reverse()
        pos = 0
        node_of = self._node_of
        while pos < n:
            child = node.children.get(hs[pos])
            if child is None:
                run = tuple(hs[pos:])
                if node_of is not None:
                    if run[0] in node_of:  # the list did not start at block 0 (chained hashes: the
                        # first block of a new run is new, and so is every block after it)
                        raise ValueError("block hashes must be a prompt's leading blocks, chained from block 0, or "
                                         f"name their parent block: block {pos} is new under its parent here but "
                                         "already indexed elsewhere (was a continuation stored earlier without "
                                         "its parent hash?)")
                child = _Node(run, node)
                node.children[run[0]] = child
                if node_of is not None:
                    node_of.update(zip(run, repeat(child)))
                path.append(child)
                break
            run = child.blocks
            if len(run) == 1:  # found by its first block: matched (one-block runs are common)
                k = 1
            else:
                k = self._common(run, hs, pos)
                if k < len(run):
                    child = self._split(child, k)[0]  # the prompt diverges or ends inside the run
            path.append(child)
            pos += k
            node = child
        num, head = rs.num, rs.head
        bit = 1 << num
        for node in reversed(path):  # deepest first: each lands most recently used (list tail)
            e = node.entries.get(num)
            if e is None:
                e = node.entries[num] = _Entry(node, now_s, touch_id)
                if not node.holders:
                    self._unique += len(node.blocks)
                node.holders |= bit
                rs.blocks += len(node.blocks)
            else:  # unlink (inlined: this loop is the hot path)
                e.prev.next = e.next
                e.next.prev = e.prev
                e.time = now_s
                e.touch_id = touch_id
            last = head.prev
            e.prev = last
            e.next = head
            last.next = e
            head.prev = e
        for k in range(len(path) - 1):  # a touch may have made a split run whole again
            if len(path[k].children) == 1:
                path[k + 1] = self._try_merge(path[k]) or path[k + 1]
        if rs.blocks > self._blocks_bound:
            self._blocks_bound = rs.blocks
        if cap is None or rs.blocks <= cap:
            return []
        return self._evict_to(rs, cap)

    def _evict_to(self, rs: _Replica, cap: int) -> list[int]:
        """Evict ``rs``'s least recently used blocks until it holds ``cap``; returns them, oldest first."""
        head = rs.head
        evicted: list[int] = []
        while rs.blocks > cap:
            node = head.next.node
            excess = rs.blocks - cap
            if len(node.blocks) > excess:  # evict the deepest `excess` blocks of the run
                node = self._split(node, len(node.blocks) - excess)[1]
            evicted.extend(reversed(node.blocks))
            self._drop(rs, node)
        return evicted

    def remove(self, replica: ReplicaId, block_hashes: Iterable[int]) -> int:
        """Forget blocks on one replica (e.g. a ``BlockRemoved`` KV event). Returns how many were held.

        The blocks are grouped by run first, so an engine evicting a whole run (or its tail)
        costs one or two splits, not one per block.
        """
        rs = self._state.get(replica)
        if rs is None or not rs.blocks:
            return 0
        node_of = self._block_map()
        bit = 1 << rs.num
        groups: dict[_Node, tuple[tuple[int, ...], set[int]]] = {}  # node -> (its run now, hashes)
        for h in block_hashes:
            node = node_of.get(h)
            if node is None or not node.holders & bit:
                continue
            group = groups.get(node)
            if group is None:
                group = groups[node] = (node.blocks, set())
            group[1].add(h)
        n = 0
        for run, hashes in groups.values():
            if len(hashes) == len(run):  # the whole run (an engine evicting a sequence's blocks)
                node = node_of[run[0]]
                if node.blocks == run:
                    self._drop(rs, node)
                    n += len(run)
                    continue
            ordered = [i for i, h in enumerate(run) if h in hashes]
            segments = []  # maximal runs of consecutive positions, as (start, end)
            start = prev = ordered[0]
            for p in ordered[1:]:
                if p != prev + 1:
                    segments.append((start, prev + 1))
                    start = p
                prev = p
            segments.append((start, prev + 1))
            for a, b in segments:
                node = node_of[run[a]]  # looked up afresh: earlier drops may have split or merged
                i = node.blocks.index(run[a])
                j = i + (b - a)
                if j < len(node.blocks):
                    node = self._split(node, j)[0]  # the piece ending with the segment
                if i:
                    node = self._split(node, i)[1]  # the segment
                self._drop(rs, node)
                n += b - a
        return n

    def remove_untouched(self, replica: ReplicaId, block_hashes: Iterable[int], touched_s: float,
                         touch_id: int | None = None) -> int:
        """Forget those of ``block_hashes`` on ``replica`` whose last touch there was at
        ``touched_s`` exactly (none since; e.g. what one :meth:`insert` at ``touched_s`` recorded,
        unless a later insert touched it again) and, when ``touch_id`` is given, by the insert
        given that ``touch_id`` (another insert at the same ``touched_s`` keeps the blocks it
        touched). Returns how many were dropped."""
        rs = self._state.get(replica)
        if rs is None or not rs.blocks:
            return 0
        node_of = self._block_map()
        num = rs.num
        drop = []
        for h in block_hashes:
            node = node_of.get(h)
            e = node.entries.get(num) if node is not None else None
            if e is not None and e.time == touched_s and (touch_id is None or e.touch_id == touch_id):
                drop.append(h)
        return self.remove(replica, drop) if drop else 0

    def clear(self, replica: ReplicaId) -> int:
        """Forget every block of one replica (``AllBlocksCleared`` event, or replica removed);
        returns how many it held. Its number is released too (reused by the next new replica),
        so cached :meth:`numbers` arrays are rebuilt once."""
        rs = self._state.pop(replica, None)
        if rs is None:
            return 0
        n = rs.blocks
        head = rs.head
        while head.next is not head:  # re-read each time: a drop may merge runs (and their entries)
            self._drop(rs, head.next.node)
        # the empty list's sentinel points to itself: unlinked, it is freed by reference counting
        # now rather than waiting, as cyclic garbage, for a full collection (a router that adds and
        # removes workers of 1,024 DP ranks made 1,024 such cycles per worker)
        del head.prev, head.next
        del self._replica_of_num[rs.num]
        self._free_nums.append(rs.num)
        self._version += 1
        return n

    def expire(self, now_s: float) -> int:
        """Drop blocks last touched more than ``ttl_s`` before ``now_s``; returns how many.

        A block touched at ``t`` survives while ``now_s - t <= ttl_s`` and is dropped once
        ``now_s - t > ttl_s``. Cost O(replicas + expired nodes): LRU order is time order.
        """
        if self.ttl_s is None:
            return 0
        ttl = self.ttl_s
        n = 0
        for rs in list(self._state.values()):
            head = rs.head
            while head.next is not head:
                e = head.next
                if now_s - e.time <= ttl:  # the documented rule, exact in floats (not t >= now - ttl)
                    break
                n += len(e.node.blocks)
                self._drop(rs, e.node)
        return n

    # ------------------------------------------------------------------ tree surgery
    def _split(self, node: _Node, k: int) -> tuple[_Node, _Node]:
        """Cut ``node``'s run after its first ``k`` blocks (0 < k < len); returns ``(top, bottom)``:
        the piece with the first ``k`` blocks and the piece with the rest (which keeps the
        children). ``node`` stays one of them, whichever makes the other cheaper to build (the
        new piece's blocks are re-mapped, and a new bottom adopts the children). Every holder's
        entry for the new piece goes right next to its entry for ``node``, the bottom (deeper)
        piece first, as blocks are touched deepest-first, so each holder's block LRU order is
        unchanged."""
        head, tail = node.blocks[:k], node.blocks[k:]
        node_of = self._node_of
        if len(head) <= len(tail) + len(node.children):  # new top piece; node keeps the tail
            bottom = node
            above = node.parent
            assert above is not None  # the root (no blocks) is never split
            top = _Node(head, above)
            above.children[head[0]] = top
            top.children[tail[0]] = node
            node.parent = top
            node.blocks = tail
            if node_of is not None:
                node_of.update(zip(head, repeat(top)))
            new, after = top, True
        else:  # new bottom piece; node keeps the head
            top = node
            bottom = _Node(tail, node)
            bottom.children = node.children
            for child in bottom.children.values():
                child.parent = bottom
            node.children = {tail[0]: bottom}
            node.blocks = head
            if node_of is not None:
                node_of.update(zip(tail, repeat(bottom)))
            new, after = bottom, False
        new.holders = node.holders
        entries = new.entries
        for num, e in node.entries.items():
            ne = entries[num] = _Entry(new, e.time, e.touch_id)
            _link_after(e if after else e.prev, ne)
        return top, bottom

    def _try_merge(self, top: _Node) -> _Node | None:
        """Merge ``top`` with its only child when no holder can tell them apart: same holders,
        and in each holder's LRU the child's entry directly before ``top``'s with the same time
        and touch id.
        The shorter side's blocks are re-mapped (the child's children adopted if ``top`` stays).
        Returns the merged node (``top`` or its child; the other is detached), or None."""
        if len(top.children) != 1 or top is self._root:
            return None
        (node,) = top.children.values()
        if node.holders != top.holders:
            return None
        entries = node.entries
        for num, te in top.entries.items():
            e = entries[num]
            if e.next is not te or e.time != te.time or e.touch_id != te.touch_id:
                return None
        if len(top.blocks) <= len(node.blocks) + len(node.children):  # node absorbs top
            for te in top.entries.values():
                _unlink(te)
            parent = top.parent
            assert parent is not None  # top is not the root (checked above)
            node.blocks = top.blocks + node.blocks
            node.parent = parent
            parent.children[top.blocks[0]] = node
            if self._node_of is not None:
                self._node_of.update(zip(top.blocks, repeat(node)))
            top.entries.clear()  # detached: its entries point back to it (a cycle the collector would wait for)
            return node
        # top absorbs node
        for e in entries.values():
            _unlink(e)
        top.blocks = top.blocks + node.blocks
        top.children = node.children
        for child in top.children.values():
            child.parent = top
        if self._node_of is not None:
            self._node_of.update(zip(node.blocks, repeat(top)))
        entries.clear()  # node is detached: its entries point back to it (a cycle the collector would wait for)
        return top

    def _drop(self, rs: _Replica, node: _Node) -> None:
        """``rs`` no longer holds ``node``; prune runs nobody holds and nothing hangs from, and
        merge what the drop made indistinguishable."""
        _unlink(node.entries.pop(rs.num))
        node.holders &= ~(1 << rs.num)
        rs.blocks -= len(node.blocks)
        if node.holders:
            if len(node.children) == 1:
                node = self._try_merge(node) or node
            if (above := node.parent) is not None and len(above.children) == 1:
                self._try_merge(above)
            return
        self._unique -= len(node.blocks)
        node_of = self._node_of
        while node is not self._root and not node.holders and not node.children:
            parent = node.parent
            assert parent is not None  # every run below the root has a parent
            del parent.children[node.blocks[0]]
            if node_of is not None:
                deque(map(node_of.__delitem__, node.blocks), 0)
            node = parent
        if len(node.children) == 1:
            self._try_merge(node)


_RESTORE_HOLDER = ReplicaId("\x00pdlb-restore", 0)


def _flat_index(ix: PrefixIndex) -> dict[str, Any]:
    """A :class:`PrefixIndex` as flat lists (no linked structure for ``pickle`` to recurse into):
    its runs parent-first ``[(parent run number or -1, blocks)]``, each replica's LRU order
    ``[(run number, time, touch id)]`` oldest first, the replica numbers, and its bounds. Reads the index's
    internals (the tree and the LRU lists), which it leaves unchanged."""
    runs: list[tuple[int, tuple[int, ...]]] = []
    number: dict[int, int] = {}
    stack = [(ix._root, -1)]
    while stack:
        node, parent = stack.pop()
        for child in node.children.values():
            number[id(child)] = len(runs)
            runs.append((parent, child.blocks))
            stack.append((child, number[id(child)]))
    lru: list[tuple[ReplicaId, int, list[tuple[int, float, int | None]]]] = []
    for rep, rs in ix._state.items():
        order = []
        e = rs.head.next
        while e is not rs.head:
            order.append((number[id(e.node)], e.time, e.touch_id))
            e = e.next
        lru.append((rep, rs.num, order))
    lru.sort(key=lambda t: t[1])
    return {"capacity_blocks": ix.capacity_blocks, "total_capacity_blocks": ix.total_capacity_blocks,
            "ttl_s": ix.ttl_s, "block_map": ix._node_of is not None, "runs": runs, "lru": lru}


def _unflat_index(flat: dict[str, Any]) -> PrefixIndex:
    """The :class:`PrefixIndex` :func:`_flat_index` wrote, rebuilt through its public methods:
    replicas numbered in their old order, the tree laid out under a temporary holder, each
    replica's runs inserted in its LRU order with their times, then the holder cleared, then its
    bounds set (the saved state held within them). Reads the form without ``total_capacity_blocks``
    (snapshots written before it was saved) as no total bound, and LRU items without a touch id
    (written before it was saved) as touched by no known insert (``None``)."""
    ix = PrefixIndex(None, flat["ttl_s"], block_map=True)
    runs = flat["runs"]
    for rep, _num, _order in flat["lru"]:
        ix.register(rep)
    paths: list[tuple[int, ...]] = []
    has_child = [False] * len(runs)
    for parent, blocks in runs:
        paths.append((paths[parent] if parent >= 0 else ()) + blocks)
        if parent >= 0:
            has_child[parent] = True
    for k, path in enumerate(paths):
        if not has_child[k]:
            ix.insert(_RESTORE_HOLDER, path, 0.0)
    for rep, _num, order in flat["lru"]:
        for k, t, *touch in order:
            parent, blocks = runs[k]
            ix.insert(rep, blocks, t, parent_block_hash=runs[parent][1][-1] if parent >= 0 else None,
                      touch_id=touch[0] if touch else None)
    ix.clear(_RESTORE_HOLDER)
    ix.capacity_blocks = flat["capacity_blocks"]
    ix.total_capacity_blocks = flat.get("total_capacity_blocks")
    if not flat["block_map"]:
        ix._node_of = None  # as saved: the block map is built again on first use
    return ix
