"""Engine KV events (engine hashes, engine block size) -> pdlb KV events (pdlb hashes, router block size).

An engine names its blocks with its own hashes (vLLM: seeded sha256; SGLang: Python ``hash``),
which a router cannot recompute reliably (ANCHORS.md). But every ``BlockStored`` carries the
blocks' ``token_ids`` and names its parent block, so the router recomputes *its own* chained hash
of each block (:func:`balancer.hashing.hash_token_blocks`) under the parent's, exactly as it hashes
a routed prompt, and keeps, per replica, a map engine hash -> what it needs to continue the chain
and to remove the block later. Dynamo and llm-d do the same (ANCHORS.md, "Consistency").

**Block sizes.** The engine's block size ``E`` (vLLM 16, SGLang's page size, often 1) need not be
the router's ``B``. Tokens are regrouped by position: router block ``j`` is tokens
``[j*B, (j+1)*B)`` of the sequence, whatever engine blocks they arrived in. A router block is
stored once all its tokens are held (``E < B``: the ``B/E``-th engine block completes it; ``E > B``:
one engine block yields several router blocks; sizes need not divide each other). An engine
block's map entry lists the router blocks it overlaps, and a ``BlockRemoved`` of any of them
removes those router blocks (a router block needs all its tokens). A continuation is translated
by walking back along the parents for the tokens since the last router-block boundary; if one of
those engine blocks is gone (removed, or never seen), the continuation is counted as
``unknown_parent`` and dropped: its prefix is not whole on the engine, and a prefix match could
never reach it.

**Identity.** LoRA adapters are part of a block's identity: a chain computed with adapter ``name``
hashes from :func:`chain_root` ``(name)`` instead of :data:`~balancer.hashing.ROOT_HASH` (a router
hashing a request for that adapter must use the same root; :class:`balancer.service.prompt.PromptHasher`
does). Blocks with ``extra_keys`` (multimodal ids, cache salt: content the router cannot see in a
request) are honoured, never conflated: the extra keys are mixed into the pdlb hash, so such
blocks and everything after them can only match prompts that hash the same keys (none of the
router's own today); they are counted as ``extra_key_blocks``. An extra key that is only the
event's LoRA name is the LoRA identity above, not an extra key.

**Hybrid KV cache groups** (vLLM's hybrid allocator: a model whose layers keep different kinds of KV
cache, each a *group* with its own ``group_idx``, block size and events; DeepSeek-V4: full-attention
MLA groups with compressed KV, sliding-window and compressor-state groups). A prefix hit of ``L``
tokens is what vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit`` grants: every group must
grant it (``L`` a multiple of each group's block size), and what a group needs depends on its kind
(:func:`balancer.kv_wire.kv_group_class`): a full-attention group (full attention, MLA, compressed
MLA, attention with sinks) every block of ``[0, L)``; a sliding-window group (incl.
``sliding_window_mla``) only the ``ceil((window - 1) / block_size)`` blocks before ``L`` (all of them
when ``L`` is shorter); a Mamba or chunked-local group the block that ends at ``L``. Groups of other
kinds (encoder-only, cross attention) are skipped and counted (``skipped_group_events``). So:

* The first full-attention group seen is the *primary* group: its events build the chained router
  hashes as above. Events without a ``group_idx`` (SGLang; tiers whose publisher sends none) are
  taken as the primary group's. Every other group (a further full-attention group, sliding window, Mamba,
  chunked local) only records which of its engine blocks it holds; its ``BlockRemoved`` (matched
  by ``group_idx``) touches only that record, never the primary group's blocks.
* Once a replica has shown such a group (it is then *hybrid*), router blocks reach the index only
  below a *valid end*: the end ``L`` of a primary block (a multiple of every group's block size) at
  which every other group holds what the rule above needs. A group's block ending at ``L`` has the
  primary block's engine hash there (vLLM hashes every group at one ``hash_block_size`` and names a
  bigger block by the hash of its last ``hash_block_size`` piece: ``BlockHashListWithBlockSize``);
  the window's earlier blocks are found through the previous blocks named by that group's events
  where they carry no skipped block, or through the primary group's blocks; a window block no
  event places is taken as held when the window's last block is (vLLM frees a request's blocks
  tail first, so the last goes first). A further full-attention group counts like a one-block
  window (its blocks are freed with the primary's). A router block is held in the index while a
  valid end lies at or below it on some chain (a count per router block of the valid ends below
  it); when a group's removal invalidates the last such end, the block is removed. The first
  group event that makes a replica hybrid also withdraws the router blocks it had announced
  without a valid end. Blocks of the primary group that were removed mid-chain leave the deeper
  blocks unreachable, as without groups. A model without any full-attention group (every layer
  sliding window) announces nothing: its groups' events skip null blocks, so no chain can be
  rebuilt; they are counted in ``skipped_group_events``.
* vLLM 0.33 leaves null blocks (a sliding window's blocks outside the window, blocks its hit rule
  never reads) out of ``block_hashes``; those events are taken as they are, never dropped.

Memory is bounded: at most ``capacity_blocks`` engine blocks per tier (the oldest announced go first); each keeps its own
token ids (as the engine's message carried them) and the router hashes it overlaps.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice, repeat
from typing import Any

import msgpack
import numpy as np
import xxhash

from balancer.hashing import ROOT_HASH, hash_token_blocks
from balancer.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, tier_of_medium
from balancer.kv_wire import (EngineAllBlocksCleared, EngineBlockRemoved, EngineBlockStored, EngineEvent,
                              EngineHash, KvWireError, is_full_attention, kv_group_class)

__all__ = ["DEFAULT_TRANSLATOR_CAPACITY_BLOCKS", "KvEventTranslator", "TranslatorStats", "chain_root"]

#: pdlb's spelling of each tier's medium, for the events the translator makes up itself.
_TIER_MEDIUM: dict[str, str | None] = {"hbm": None, "host": "CPU", "store": "STORE"}
#: Most segments a walk back along a chain visits (a window spans a few engine blocks).
_MAX_WALK = 4096
_MISSING = object()

#: Default bound of engine blocks remembered per replica and tier (the oldest announced go first).
DEFAULT_TRANSLATOR_CAPACITY_BLOCKS = 1 << 20

_xxh3 = xxhash.xxh3_64_intdigest


def chain_root(lora_name: str | None = None, lora_id: int | None = None) -> int:
    """The hash a block chain starts from: :data:`~balancer.hashing.ROOT_HASH` for the base model,
    ``XXH3_64(b"pdlb-lora:" + name)`` for LoRA adapter ``name`` (``lora_id`` alone, the older
    events' spelling: ``b"pdlb-lora-id:" + str(id)``). Pass it as ``parent_hash`` to
    :func:`balancer.hashing.hash_token_blocks` to hash a request for that adapter."""
    if lora_name:
        return _xxh3(b"pdlb-lora:" + lora_name.encode("utf-8", "surrogatepass"))
    if lora_id is not None:
        return _xxh3(b"pdlb-lora-id:" + str(int(lora_id)).encode())
    return ROOT_HASH


@dataclass(slots=True)
class TranslatorStats:
    """Counters of one translator (all monotonic)."""

    engine_blocks_stored: int = 0
    router_blocks_stored: int = 0
    router_blocks_removed: int = 0
    unknown_parent_blocks: int = 0  # continuations of blocks never seen (or gone): dropped
    unknown_removed_blocks: int = 0  # BlockRemoved of blocks never seen
    extra_key_blocks: int = 0
    skipped_group_events: int = 0
    group_blocks_stored: int = 0  # engine blocks of non-primary KV cache groups (hybrid models)
    group_blocks_removed: int = 0
    valid_ends: int = 0  # hybrid: ends of a prefix every group can serve, found so far
    invalidated_ends: int = 0  # hybrid: of those, made invalid by a group's removal
    clears: int = 0
    evicted_blocks: int = 0  # map entries dropped by the capacity bound

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


class _Segment:
    """The blocks one ``BlockStored`` announced, kept together: every engine hash of the event maps
    to ``(segment, block index)``, so an event of ``n`` blocks costs one C-level dict update, and
    each block's place in the router's chain is computed from the segment when needed."""

    __slots__ = ("hashes", "tokens", "e_size", "root", "base", "rem0", "pend_tokens", "pend_owners", "router_hashes",
                 "extras", "late_covers", "parent", "start")

    def __init__(self, hashes: tuple[EngineHash, ...], tokens: np.ndarray, e_size: int, root: int, base: int | None,
                 rem0: int, pend_tokens: np.ndarray | None, pend_owners: list[tuple[_Segment, int]],
                 router_hashes: list[int], extras: list[Any] | None,
                 parent: tuple[_Segment, int] | None = None) -> None:
        self.hashes = hashes  # the engine hashes, in order
        self.tokens = tokens  # all their token ids (uint32), len(hashes) * e_size
        self.e_size: int = e_size
        self.parent = parent  # the engine block this segment continues: (segment, index), or None
        self.start: int = 0 if parent is None else parent[0].start + (parent[1] + 1) * parent[0].e_size  # first token
        self.root = root  # chain root (ROOT_HASH or a LoRA root)
        self.base = base  # pdlb hash of the last whole router block before the segment's first token; None: none
        self.rem0 = rem0  # tokens between that boundary and the segment's first token (< B)
        self.pend_tokens = pend_tokens  # those rem0 tokens (from the parent blocks), or None
        self.pend_owners = pend_owners  # the engine blocks they belong to: (segment, index)
        self.router_hashes = router_hashes  # pdlb hashes of the router blocks completed in this event
        self.extras = extras  # per-block extra keys, or None
        self.late_covers: dict[int, list[int]] | None = None  # block index -> router blocks completed by later events

    def end_state(self, i: int, b_size: int) -> tuple[int | None, int]:
        """(base, rem) at the end of block ``i``: the last whole router block's pdlb hash (None:
        none yet in this chain) and the tokens after it."""
        end = self.rem0 + (i + 1) * self.e_size
        k = end // b_size
        return (self.router_hashes[k - 1] if k > 0 else self.base), end - k * b_size

    def covers(self, i: int, b_size: int) -> list[int]:
        """pdlb hashes of the router blocks block ``i`` overlaps (completed so far)."""
        lo, hi = self.rem0 + i * self.e_size, self.rem0 + (i + 1) * self.e_size
        out = self.router_hashes[lo // b_size: min(-(-hi // b_size), len(self.router_hashes))]
        if self.late_covers is not None and i in self.late_covers:
            out = out + self.late_covers[i]
        return out

    def add_late_cover(self, i: int, h: int) -> None:
        if self.late_covers is None:
            self.late_covers = {}
        self.late_covers.setdefault(i, []).append(h)


_is_full_attention = is_full_attention  # one definition, beside the wire format


@dataclass
class KvEventTranslator:
    """Translates one replica's engine events into pdlb events (see the module docstring).

    Args:
        block_size: the router's block size ``B`` (its ``Router.block_size``), tokens.
        capacity_blocks: engine blocks remembered per tier (the oldest announced are forgotten beyond).

    Not thread-safe: one translator per replica, used by one thread.
    """

    block_size: int
    capacity_blocks: int = DEFAULT_TRANSLATOR_CAPACITY_BLOCKS
    stats: TranslatorStats = field(default_factory=TranslatorStats)
    _tiers: dict[str, dict[EngineHash, tuple[_Segment, int]]] = field(default_factory=dict)
    # hybrid KV cache groups (module docstring)
    _primary: tuple[int | None] | None = None  # (group_idx,) of the primary group once seen
    _groups: dict[int | None, tuple[str, int | None, int]] = field(default_factory=dict)  # other groups: class, window, block size
    _held: dict[tuple[str, int | None], dict[EngineHash, None]] = field(default_factory=dict)  # (tier, group) -> blocks
    _links: dict[tuple[str, int | None], dict[EngineHash, EngineHash]] = field(default_factory=dict)  # block -> previous
    _ends: dict[str, dict[EngineHash, tuple[int, list[tuple[int | None, EngineHash]]]]] = field(default_factory=dict)
    _end_deps: dict[str, dict[tuple[int | None, EngineHash], set[EngineHash]]] = field(default_factory=dict)
    _support: dict[str, dict[int, list[Any]]] = field(default_factory=dict)  # router hash -> [parent, count]

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {self.capacity_blocks}")

    def num_blocks(self) -> int:
        """Engine blocks currently remembered, all tiers."""
        return sum(len(t) for t in self._tiers.values())

    @property
    def hybrid(self) -> bool:
        """Whether the replica has shown KV cache groups besides its primary full-attention group
        (module docstring): router blocks are then announced only below a valid end."""
        return bool(self._groups)

    def reset(self) -> None:
        """Forget every engine block and KV cache group (the engine restarted)."""
        self._tiers.clear()
        self._primary = None
        self._groups.clear()
        self._clear_groups(None)

    def _clear_groups(self, tiers: tuple[str, ...] | None) -> None:
        """Forget the groups' blocks and the valid ends of ``tiers`` (all when ``None``)."""
        for d in (self._held, self._links):
            for k in [k for k in d if tiers is None or k[0] in tiers]:
                del d[k]
        for d2 in (self._ends, self._end_deps, self._support):
            for t in [t for t in d2 if tiers is None or t in tiers]:
                del d2[t]

    def translate(self, event: EngineEvent) -> list[KvEvent]:
        """The pdlb events equivalent to ``event`` (possibly none).

        Raises:
            KvWireError: a ``BlockStored`` whose ``token_ids`` are not ``len(block_hashes) *
                block_size`` ids in ``[0, 2**32)``, an unknown medium, or an unknown event.
        """
        if isinstance(event, EngineBlockStored):
            return self._stored(event)
        if isinstance(event, EngineBlockRemoved):
            return self._removed(event)
        if isinstance(event, EngineAllBlocksCleared):
            self.stats.clears += 1
            out: list[KvEvent] = [AllBlocksCleared(None)]
            if self._tiers.get("host"):
                out.append(AllBlocksCleared("CPU"))
            for tier in ("hbm", "host"):
                self._tiers.pop(tier, None)
            self._clear_groups(("hbm", "host"))
            return out
        raise KvWireError(f"not an engine KV event: {event!r}")

    # ------------------------------------------------------------------ internals
    def _tier(self, medium: str | None) -> str:
        try:
            return tier_of_medium(medium)
        except ValueError as e:
            raise KvWireError(str(e)) from None

    def _stored(self, ev: EngineBlockStored) -> list[KvEvent]:
        cls = kv_group_class(ev.kv_cache_spec_kind)
        if cls == "other":
            self.stats.skipped_group_events += 1
            return []
        if cls == "full":
            g = ev.group_idx
            if self._primary is None or (self._primary == (None,) and g not in self._groups):
                self._primary = (g,)  # the first full-attention group (a group number once one is sent)
            if g is None or self._primary == (g,):  # no group number: the model's only group, or the primary
                return self._primary_stored(ev)
        return self._group_stored(ev, cls)

    def _primary_stored(self, ev: EngineBlockStored) -> list[KvEvent]:
        tier = self._tier(ev.medium)
        n, e_size, b_size = len(ev.block_hashes), ev.block_size, self.block_size
        if n == 0:
            return []
        if len(ev.token_ids) != n * e_size:
            raise KvWireError(f"BlockStored has {len(ev.token_ids)} token ids for {n} blocks of {e_size} tokens "
                              f"(expected {n * e_size})")
        if not set(map(type, ev.token_ids)) <= {int}:
            raise KvWireError("BlockStored token_ids must be integers in [0, 2**32)")
        try:
            own = np.fromiter(ev.token_ids, dtype=np.int64, count=len(ev.token_ids))
        except OverflowError:
            raise KvWireError("BlockStored token_ids must be integers in [0, 2**32)") from None
        if own.size and (own.min() < 0 or own.max() >= 1 << 32):
            raise KvWireError("BlockStored token_ids must be integers in [0, 2**32)")
        own = own.astype(np.uint32)
        extras = self._extras(ev, n)
        states = self._tiers.setdefault(tier, {})
        # where the chain stands before the first new block: base hash, pending tokens, their owners
        pend: np.ndarray | None = None
        owners: list[tuple[_Segment, int]] = []
        if ev.parent_block_hash is None:
            root = chain_root(ev.lora_name, ev.lora_id)
            base: int | None = None
            rem = 0
        else:
            where = states.get(ev.parent_block_hash)
            if where is None:
                self.stats.unknown_parent_blocks += n
                return []
            seg, i = where
            root = seg.root
            base, rem = seg.end_state(i, b_size)
            if rem:
                got = self._pending(states, seg, i, rem)
                if got is None:  # a block of the pending router block is gone: prefix not whole
                    self.stats.unknown_parent_blocks += n
                    return []
                pend, owners = got
        seq = np.concatenate((pend, own)) if pend is not None else own
        after = None if ev.parent_block_hash is None else states.get(ev.parent_block_hash)
        start_hash = root if base is None else base
        nfull = len(seq) // b_size
        if extras is None and not any(o.extras is not None for o, _ in owners):
            hashes = hash_token_blocks(seq, b_size, start_hash)
        else:
            hashes = self._hash_with_extras(seq, b_size, start_hash, rem, e_size, extras, owners)
        if nfull and owners:  # the pending owners overlap router block 0
            for o, k in owners:
                o.add_late_cover(k, hashes[0])
        seg = _Segment(ev.block_hashes, own, e_size, root, base, rem, pend, owners, hashes, extras, after)
        self.stats.engine_blocks_stored += n
        self.stats.router_blocks_stored += nfull
        if extras is not None:
            self.stats.extra_key_blocks += sum(1 for x in extras if x is not None)
        states.update(zip(ev.block_hashes, zip(repeat(seg), range(n))))
        over = len(states) - self.capacity_blocks
        if over > 0:  # oldest announced first (dicts keep insertion order)
            ends = self._ends.get(tier)
            for h in list(islice(states, over)):
                del states[h]
                if ends and h in ends:  # forgotten, not evicted by the engine: its blocks stay announced
                    self._forget_end(tier, h, {})  # (the support counts drop, so their memory is bounded too)
            self.stats.evicted_blocks += over
        if self._groups:  # hybrid: announce only below valid ends
            out: list[KvEvent] = []
            for i in range(n):
                if states.get(ev.block_hashes[i]) == (seg, i):
                    self._try_end(tier, seg, i, ev.medium, out)
            return out
        if not nfull:
            return []
        return [BlockStored(tuple(hashes), ev.medium, base)]

    # ------------------------------------------------------------------ hybrid KV cache groups
    def _group_stored(self, ev: EngineBlockStored, cls: str) -> list[KvEvent]:
        """A ``BlockStored`` of a group other than the primary one: record its blocks, then look
        for the ends they make valid (module docstring)."""
        tier = self._tier(ev.medium)
        g = ev.group_idx
        n, bs = len(ev.block_hashes), ev.block_size
        if len(ev.token_ids) < n * bs or len(ev.token_ids) % bs:
            raise KvWireError(f"BlockStored has {len(ev.token_ids)} token ids for {n} blocks of {bs} tokens "
                              f"(expected {n * bs}, or whole blocks more for a {ev.kv_cache_spec_kind} group)")
        out: list[KvEvent] = []
        if g not in self._groups:
            first = not self._groups
            self._groups[g] = (cls, ev.kv_cache_spec_sliding_window, bs)
            if first:
                out.extend(self._withdraw_all())
        self.stats.group_blocks_stored += n
        held = self._held.setdefault((tier, g), {})
        links = self._links.setdefault((tier, g), {})
        held.update(dict.fromkeys(ev.block_hashes))
        if n * bs == len(ev.token_ids):  # no block skipped: each block's previous one is known
            prev = ev.parent_block_hash
            for h in ev.block_hashes:
                if prev is not None:
                    links[h] = prev
                prev = h
        over = len(held) - self.capacity_blocks
        if over > 0:
            for h in list(islice(held, over)):
                del held[h]
                links.pop(h, None)
            self.stats.evicted_blocks += over
        states = self._tiers.get(tier)
        if states:
            for h in ev.block_hashes:
                where = states.get(h)
                if where is not None:
                    self._try_end(tier, where[0], where[1], ev.medium, out)
        return out

    def _withdraw_all(self) -> list[KvEvent]:
        """The replica turned out hybrid: withdraw every router block announced so far (those
        below valid ends are announced again as the ends are found)."""
        out: list[KvEvent] = []
        for tier, states in self._tiers.items():
            segs = {id(seg): seg for seg, _ in states.values()}
            hs: dict[int, None] = {}
            for seg in segs.values():
                hs.update(dict.fromkeys(seg.router_hashes))
                for extra in (seg.late_covers or {}).values():
                    hs.update(dict.fromkeys(extra))
            if hs:
                out.append(BlockRemoved(tuple(hs), _TIER_MEDIUM[tier]))
        return out

    @staticmethod
    def _primary_hash_at(seg: _Segment, i: int, q: int) -> EngineHash | None:
        """The engine hash of the primary block that ends at token ``q`` on the chain through
        block ``i`` of ``seg`` (``None``: no primary block ends there)."""
        for _ in range(_MAX_WALK):
            if q > seg.start:
                off = q - seg.start
                j = off // seg.e_size - 1
                return seg.hashes[j] if off % seg.e_size == 0 and j <= i else None
            if seg.parent is None:
                return None
            seg, i = seg.parent
        return None

    def _deps_of_end(self, tier: str, seg: _Segment, i: int) -> list[tuple[int | None, EngineHash]] | None:
        """The group blocks a hit ending with block ``i`` of ``seg`` needs, or ``None`` if a
        group cannot serve it (module docstring)."""
        end = seg.start + (i + 1) * seg.e_size
        key = seg.hashes[i]
        deps: list[tuple[int | None, EngineHash]] = []
        for g, (cls, window, bs) in self._groups.items():
            if end % bs:
                return None
            need = 1
            if cls == "window" and window is not None:
                need = min(-(-(window - 1) // bs), end // bs)
                if need <= 0:
                    continue
            held = self._held.get((tier, g))
            if not held or key not in held:
                return None
            deps.append((g, key))
            links = self._links.get((tier, g), {})
            h, q = key, end
            for _ in range(need - 1):
                q -= bs
                prev = links.get(h)
                if prev is None:
                    prev = self._primary_hash_at(seg, i, q)
                if prev is None:  # no event places it: taken as held (tail-first freeing)
                    break
                if prev not in held:
                    return None
                deps.append((g, prev))
                h = prev
        return deps

    @staticmethod
    def _router_chain(seg: _Segment, i: int, b_size: int) -> Iterator[int]:
        """The router hashes of the chain through block ``i`` of ``seg``, deepest first."""
        n = (seg.rem0 + (i + 1) * seg.e_size) // b_size
        while True:
            rh = seg.router_hashes
            for t in range(min(n, len(rh)) - 1, -1, -1):
                yield rh[t]
            if seg.base is None or seg.parent is None:
                return
            seg, i = seg.parent
            n = (seg.rem0 + (i + 1) * seg.e_size) // b_size

    def _try_end(self, tier: str, seg: _Segment, i: int, medium: str | None, out: list[KvEvent]) -> None:
        """If the end of block ``i`` of ``seg`` is a valid end not yet known, record it and
        announce the router blocks it newly supports."""
        key = seg.hashes[i]
        ends = self._ends.setdefault(tier, {})
        if key in ends:
            return
        deps = self._deps_of_end(tier, seg, i)
        if deps is None:
            return
        chain = self._router_chain(seg, i, self.block_size)
        cur = next(chain, None)
        if cur is None:  # shorter than one router block: nothing to announce
            return
        self.stats.valid_ends += 1
        support = self._support.setdefault(tier, {})
        ends[key] = (cur, deps)
        by_dep = self._end_deps.setdefault(tier, {})
        for d in deps:
            by_dep.setdefault(d, set()).add(key)
        new: list[int] = []
        while cur is not None:
            nxt = next(chain, None)
            node = support.get(cur)
            if node is None:
                node = support[cur] = [nxt, 0]
            node[1] += 1
            if node[1] > 1:
                break
            new.append(cur)
            cur = nxt
        if new:
            new.reverse()
            last = out[-1] if out else None
            if (isinstance(last, BlockStored) and last.medium == medium and last.block_hashes
                    and last.block_hashes[-1] == support[new[0]][0]):  # continues the previous announcement
                out[-1] = BlockStored(last.block_hashes + tuple(new), medium, last.parent_block_hash)
            else:
                out.append(BlockStored(tuple(new), medium, support[new[0]][0]))

    def _forget_end(self, tier: str, key: EngineHash, removed: dict[int, None] | None = None) -> None:
        """Drop the valid end ``key``; with ``removed``, lower the support counts along its chain
        and collect the router blocks no valid end supports any more."""
        got = self._ends.get(tier, {}).pop(key, None)
        if got is None:
            return
        rh, deps = got
        by_dep = self._end_deps.get(tier, {})
        for d in deps:
            keys = by_dep.get(d)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del by_dep[d]
        if removed is None:
            return
        support = self._support.get(tier, {})
        cur: int | None = rh
        while cur is not None:
            node = support.get(cur)
            if node is None:
                break
            node[1] -= 1
            if node[1] > 0:
                break
            del support[cur]
            removed[cur] = None
            cur = node[0]

    def _group_removed(self, ev: EngineBlockRemoved, tier: str) -> list[KvEvent]:
        held = self._held.get((tier, ev.group_idx))
        links = self._links.get((tier, ev.group_idx))
        by_dep = self._end_deps.get(tier, {})
        removed: dict[int, None] = {}
        for h in ev.block_hashes:
            if held is None or held.pop(h, _MISSING) is _MISSING:
                self.stats.unknown_removed_blocks += 1
                continue
            self.stats.group_blocks_removed += 1
            if links is not None:
                links.pop(h, None)
            for key in list(by_dep.get((ev.group_idx, h), ())):
                self.stats.invalidated_ends += 1
                self._forget_end(tier, key, removed)
        if not removed:
            return []
        self.stats.router_blocks_removed += len(removed)
        return [BlockRemoved(tuple(removed), ev.medium)]

    @staticmethod
    def _pending(states: dict[EngineHash, tuple[_Segment, int]], seg: _Segment, i: int,
                 rem: int) -> tuple[np.ndarray, list[tuple[_Segment, int]]] | None:
        """The ``rem`` tokens before the end of block ``i`` of ``seg`` (since the last router-block
        boundary) and the engine blocks they belong to; ``None`` if one of those blocks is gone."""
        e = seg.e_size
        end = (i + 1) * e  # in segment coordinates
        if rem <= end:
            first = (end - rem) // e
            owners = [(seg, k) for k in range(first, i + 1)]
            toks = seg.tokens[end - rem:end]
        else:  # no router-block boundary since the segment began: rem = rem0 + end, so the
            # pending router block is the one the segment's own pending tokens started
            assert seg.pend_tokens is not None and rem - end == len(seg.pend_tokens)
            owners = list(seg.pend_owners) + [(seg, k) for k in range(i + 1)]
            toks = np.concatenate((seg.pend_tokens, seg.tokens[:end]))
        for o, k in owners:
            if states.get(o.hashes[k]) != (o, k):
                return None
        return toks, owners

    def _extras(self, ev: EngineBlockStored, n: int) -> list[Any] | None:
        """Per-block extra keys that change identity (``None`` if no block has one)."""
        if not ev.extra_keys:
            return None
        if len(ev.extra_keys) != n:
            raise KvWireError(f"BlockStored has {len(ev.extra_keys)} extra_keys for {n} blocks")
        out: list[Any] = []
        for x in ev.extra_keys:
            if x is not None and ev.lora_name is not None and (x == ev.lora_name or (
                    isinstance(x, (list, tuple)) and len(x) == 1 and x[0] == ev.lora_name)):
                x = None  # the LoRA identity, already in the chain root
            if isinstance(x, (list, tuple)) and not x:
                x = None
            out.append(x)
        return out if any(x is not None for x in out) else None

    @staticmethod
    def _hash_with_extras(seq: np.ndarray, b_size: int, start: int, rem: int, e_size: int, extras: list[Any] | None,
                          owners: list[tuple[_Segment, int]]) -> list[int]:
        """Chained hashes of ``seq``'s full router blocks with the extra keys of the engine blocks
        each overlaps mixed in (after the tokens, msgpack-serialised, behind a marker byte). The
        pending owners (``seq[:rem]``) all overlap router block 0."""
        out: list[int] = []
        h = start
        data = seq.astype("<u4", copy=False)
        for j in range(len(seq) // b_size):
            lo, hi = j * b_size, (j + 1) * b_size
            keys = [o.extras[k] for o, k in owners if j == 0 and o.extras is not None and o.extras[k] is not None]
            if extras is not None and hi > rem:
                first, last = max(0, (lo - rem) // e_size), (hi - 1 - rem) // e_size
                keys += [extras[i] for i in range(first, min(last, len(extras) - 1) + 1) if extras[i] is not None]
            payload = h.to_bytes(8, "little") + data[lo:hi].tobytes()
            if keys:
                payload += b"\xffextra" + msgpack.packb(keys, default=repr)
            h = _xxh3(payload)
            out.append(h)
        return out

    def _removed(self, ev: EngineBlockRemoved) -> list[KvEvent]:
        tier = self._tier(ev.medium)
        if ev.group_idx is not None and ev.group_idx in self._groups and self._primary != (ev.group_idx,):
            return self._group_removed(ev, tier)
        if ev.group_idx is not None and self._primary is not None and self._primary[0] is not None \
                and self._primary != (ev.group_idx,):
            self.stats.unknown_removed_blocks += len(ev.block_hashes)  # a group never seen storing
            return []
        states = self._tiers.get(tier)
        gone: dict[int, None] = {}
        b_size = self.block_size
        ends = self._ends.get(tier)
        for h in ev.block_hashes:
            where = states.pop(h, None) if states is not None else None
            if where is None:
                self.stats.unknown_removed_blocks += 1
                continue
            if ends and h in ends:
                self._forget_end(tier, h, gone)
            gone.update(dict.fromkeys(where[0].covers(where[1], b_size)))
        if not gone:
            return []
        self.stats.router_blocks_removed += len(gone)
        return [BlockRemoved(tuple(gone), ev.medium)]


def translate_all(translator: KvEventTranslator, events: Sequence[EngineEvent]) -> list[KvEvent]:
    """:meth:`KvEventTranslator.translate` of each event, concatenated (errors propagate)."""
    out: list[KvEvent] = []
    for ev in events:
        out.extend(translator.translate(ev))
    return out
