"""KV cache events in the router's own block-hash space.

Engines that publish their cache state (vLLM's ZMQ KV events, the simulator's engines) are
translated into these and fed to :meth:`balancer.router.Router.on_kv_event`, which keeps the
prefix index exact instead of approximate. Hashes here are pdlb chained block hashes
(:mod:`balancer.hashing`); a decoder for an engine's wire format maps its hashes onto them.
Source: vLLM ``vllm/distributed/kv_events.py`` event kinds (ANCHORS.md).

Every event carries the ``medium`` (storage tier) it is about, as vLLM's ``BlockStored`` and
``BlockRemoved`` do: ``None`` or ``"GPU"`` is the replica's HBM prefix cache; ``"CPU"`` its
host-DRAM tier; ``"STORE"`` a shared KV store (3FS / Mooncake store / LMCache remote), which is
global: the replica is only the publisher. :func:`tier_of_medium` maps the spellings engines use
onto pdlb's three tiers.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Media (vLLM spells them in upper case; matching is case-insensitive).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORE = "STORE"

#: pdlb's tier names, top to bottom.
TIERS = ("hbm", "host", "store")

_TIER_OF_MEDIUM = {
    "gpu": "hbm", "hbm": "hbm", "cuda": "hbm", "device": "hbm",
    "cpu": "host", "host": "host", "dram": "host", "cpu_pinned": "host", "localcpu": "host",
    # vLLM 0.33 MEDIUM_STORAGE: the engine's own disk/offload tier (locality LOCAL; a REMOTE one is
    # decoded as "STORE", balancer.kv_wire): the replica's lower tier, like its CPU tier
    "storage": "host",
    "store": "store", "disk": "store", "ssd": "store", "nvme": "store", "remote": "store", "3fs": "store",
    "localdisk": "store",
    "external": "store",  # SGLang 0.5.23 StorageMedium.EXTERNAL: a shared / remote pool (e.g. Mooncake)
}


def tier_of_medium(medium: str | None) -> str:
    """``"hbm"``, ``"host"`` or ``"store"`` for an event's medium (``None`` = HBM).

    Raises:
        ValueError: an unknown medium (the message lists the accepted spellings).
    """
    if medium is None:
        return "hbm"
    tier = _TIER_OF_MEDIUM.get(medium.lower())
    if tier is None:
        raise ValueError(f"unknown KV event medium {medium!r}; accepted: {', '.join(sorted(_TIER_OF_MEDIUM))}")
    return tier


@dataclass(frozen=True, slots=True)
class BlockStored:
    """The replica (or, for a shared-store medium, the store) now holds these blocks.

    ``block_hashes`` are consecutive blocks of one prompt, in order: its leading blocks when
    ``parent_block_hash`` is ``None``, else the blocks that follow the block with that hash (vLLM's
    ``BlockStored`` announces only new blocks and names their parent this way)."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    parent_block_hash: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The replica (or the store) evicted these blocks."""

    block_hashes: tuple[int, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The replica dropped its whole cache of ``medium`` (restart, reset)."""

    medium: str | None = None


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
