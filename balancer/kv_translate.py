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
event's LoRA name is the LoRA identity above, not an extra key. KV cache groups that are not full
attention (sliding window, Mamba state) are skipped and counted (``skipped_group_events``).

Memory is bounded: at most ``capacity_blocks`` engine blocks per tier (LRU); each keeps its own
token ids (as the engine's message carried them) and the router hashes it overlaps.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import xxhash

from balancer.hashing import ROOT_HASH, hash_token_blocks
from balancer.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, tier_of_medium
from balancer.kv_wire import (EngineAllBlocksCleared, EngineBlockRemoved, EngineBlockStored, EngineEvent,
                              EngineHash, KvWireError)

__all__ = ["DEFAULT_TRANSLATOR_CAPACITY_BLOCKS", "KvEventTranslator", "TranslatorStats", "chain_root"]

#: Default bound of engine blocks remembered per replica and tier (LRU beyond it).
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
    clears: int = 0
    evicted_blocks: int = 0  # map entries dropped by the capacity bound

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]


class _Block:
    """One engine block: its tokens, parent, and where the router's chain stands at its end."""

    __slots__ = ("tokens", "parent", "root", "base", "rem", "covers", "extra")

    def __init__(self, tokens: np.ndarray, parent: EngineHash | None, root: int, base: int | None, rem: int,
                 covers: list[int], extra: Any) -> None:
        self.tokens = tokens  # its own token ids (uint32)
        self.parent = parent
        self.root = root  # chain root (ROOT_HASH or a LoRA root)
        self.base = base  # pdlb hash of the last whole router block ending at or before its end; None: none yet
        self.rem = rem  # tokens after that boundary up to its end (0 <= rem < B)
        self.covers = covers  # pdlb hashes of the router blocks it overlaps (appended as they complete)
        self.extra = extra  # its extra key (None for plain blocks)


def _is_full_attention(kind: str | None) -> bool:
    if kind is None:
        return True
    k = kind.lower()
    return "full" in k or "mla" in k


@dataclass
class KvEventTranslator:
    """Translates one replica's engine events into pdlb events (see the module docstring).

    Args:
        block_size: the router's block size ``B`` (its ``Router.block_size``), tokens.
        capacity_blocks: engine blocks remembered per tier (LRU beyond).

    Not thread-safe: one translator per replica, used by one thread.
    """

    block_size: int
    capacity_blocks: int = DEFAULT_TRANSLATOR_CAPACITY_BLOCKS
    stats: TranslatorStats = field(default_factory=TranslatorStats)
    _tiers: dict[str, OrderedDict[EngineHash, _Block]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {self.capacity_blocks}")

    def num_blocks(self) -> int:
        """Engine blocks currently remembered, all tiers."""
        return sum(len(t) for t in self._tiers.values())

    def reset(self) -> None:
        """Forget every engine block (the engine restarted)."""
        self._tiers.clear()

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
            return out
        raise KvWireError(f"not an engine KV event: {event!r}")

    # ------------------------------------------------------------------ internals
    def _tier(self, medium: str | None) -> str:
        try:
            return tier_of_medium(medium)
        except ValueError as e:
            raise KvWireError(str(e)) from None

    def _stored(self, ev: EngineBlockStored) -> list[KvEvent]:
        if not _is_full_attention(ev.kv_cache_spec_kind):
            self.stats.skipped_group_events += 1
            return []
        tier = self._tier(ev.medium)
        n, e_size, b_size = len(ev.block_hashes), ev.block_size, self.block_size
        if n == 0:
            return []
        if len(ev.token_ids) != n * e_size:
            raise KvWireError(f"BlockStored has {len(ev.token_ids)} token ids for {n} blocks of {e_size} tokens "
                              f"(expected {n * e_size})")
        try:
            own = np.asarray(ev.token_ids, dtype=np.int64)
        except (OverflowError, ValueError, TypeError):
            raise KvWireError("BlockStored token_ids must be integers in [0, 2**32)") from None
        if own.ndim != 1 or (own.size and (own.min() < 0 or own.max() >= 1 << 32)):
            raise KvWireError("BlockStored token_ids must be integers in [0, 2**32)")
        own = own.astype(np.uint32)
        extras = self._extras(ev, n)
        states = self._tiers.setdefault(tier, OrderedDict())
        # where the chain stands before the first new block: base hash, pending tokens and their owners
        pend: list[np.ndarray] = []
        owners: list[tuple[_Block, int, int]] = []  # (engine block, start, end) in `seq` coordinates
        if ev.parent_block_hash is None:
            root = chain_root(ev.lora_name, ev.lora_id)
            base: int | None = None
            rem = 0
        else:
            p = states.get(ev.parent_block_hash)
            if p is None:
                self.stats.unknown_parent_blocks += n
                return []
            root, base, rem = p.root, p.base, p.rem
            need, cur, h = rem, p, ev.parent_block_hash
            segs: list[tuple[_Block, np.ndarray]] = []
            while need > 0:
                take = min(need, len(cur.tokens))
                segs.append((cur, cur.tokens[len(cur.tokens) - take:]))
                need -= take
                if need > 0:
                    h = cur.parent
                    nxt = states.get(h) if h is not None else None
                    if nxt is None:  # a block of the pending router block is gone: prefix not whole
                        self.stats.unknown_parent_blocks += n
                        return []
                    cur = nxt
            pos = 0
            for blk, toks in reversed(segs):
                pend.append(toks)
                owners.append((blk, pos, pos + len(toks)))
                pos += len(toks)
            states.move_to_end(ev.parent_block_hash)
        seq = np.concatenate(pend + [own]) if pend else own
        start_hash = root if base is None else base
        nfull = len(seq) // b_size
        if extras is None:
            hashes = hash_token_blocks(seq, b_size, start_hash)
        else:
            hashes = self._hash_with_extras(seq, b_size, start_hash, rem, e_size, extras, owners)
        # the pending owners overlap router block 0
        if nfull and owners:
            for blk, _, _ in owners:
                blk.covers.append(hashes[0])
        self.stats.engine_blocks_stored += n
        self.stats.router_blocks_stored += nfull
        if extras is not None:
            self.stats.extra_key_blocks += sum(1 for x in extras if x is not None)
        parent_hash = ev.parent_block_hash
        for i, h in enumerate(ev.block_hashes):
            lo, hi = rem + i * e_size, rem + (i + 1) * e_size  # its tokens in `seq`
            k = hi // b_size
            covers = hashes[lo // b_size: min(k + (1 if hi % b_size else 0), nfull)]
            blk = _Block(own[i * e_size:(i + 1) * e_size], parent_hash, root,
                         hashes[k - 1] if k > 0 else base, hi - k * b_size, list(covers),
                         None if extras is None else extras[i])
            if h in states:
                del states[h]
            states[h] = blk
            parent_hash = h
        while len(states) > self.capacity_blocks:
            states.popitem(last=False)
            self.stats.evicted_blocks += 1
        if not nfull:
            return []
        return [BlockStored(tuple(hashes), ev.medium, None if base is None else base)]

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
    def _hash_with_extras(seq: np.ndarray, b_size: int, start: int, rem: int, e_size: int, extras: list[Any],
                          owners: list[tuple[_Block, int, int]]) -> list[int]:
        """Chained hashes of ``seq``'s full router blocks with the extra keys of the engine blocks
        each overlaps mixed in (after the tokens, msgpack-serialised, behind a marker byte)."""
        out: list[int] = []
        h = start
        data = seq.astype("<u4", copy=False)
        for j in range(len(seq) // b_size):
            lo, hi = j * b_size, (j + 1) * b_size
            keys = [o.extra for o, s, e in owners if s < hi and e > lo and o.extra is not None]
            first = max(0, (lo - rem) // e_size) if hi > rem else 0
            last = (hi - 1 - rem) // e_size if hi > rem else -1
            keys += [extras[i] for i in range(first, last + 1) if 0 <= i < len(extras) and extras[i] is not None]
            payload = h.to_bytes(8, "little") + data[lo:hi].tobytes()
            if keys:
                payload += b"\xffextra" + msgpack.packb(keys, default=repr)
            h = _xxh3(payload)
            out.append(h)
        return out

    def _removed(self, ev: EngineBlockRemoved) -> list[KvEvent]:
        tier = self._tier(ev.medium)
        states = self._tiers.get(tier)
        gone: dict[int, None] = {}
        for h in ev.block_hashes:
            blk = states.pop(h, None) if states is not None else None
            if blk is None:
                self.stats.unknown_removed_blocks += 1
                continue
            gone.update(dict.fromkeys(blk.covers))
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
