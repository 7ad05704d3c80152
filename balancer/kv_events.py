"""KV cache events in the router's own block-hash space.

Engines that publish their cache state (vLLM's ZMQ KV events, the simulator's engines) are
translated into these and fed to :meth:`balancer.router.Router.on_kv_event`, which keeps the
prefix index exact instead of approximate. Hashes here are pdlb chained block hashes
(:mod:`balancer.hashing`); a decoder for an engine's wire format maps its hashes onto them.
Source: vLLM ``vllm/distributed/kv_events.py`` event kinds (ANCHORS.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """The replica now holds these blocks. ``block_hashes`` are a prompt's leading blocks in order."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The replica evicted these blocks."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The replica dropped its whole prefix cache (restart, reset)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
