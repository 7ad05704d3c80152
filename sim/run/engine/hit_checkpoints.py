"""Where a prefix hit may end on a hybrid-KV model: vLLM's sliding-window checkpoints.

A hybrid model (DeepSeek-V4: compressed full-attention MLA groups beside sliding-window groups)
can resume a prompt at position ``b`` only if every KV cache group holds what the rest of the
prompt needs there. The full-attention groups hold every whole block of a cached prefix, but a
sliding-window group frees the blocks that leave its window, and vLLM keeps ("retains") the
window's last blocks only at some positions, its *checkpoints*. The rules below are read from
vLLM 0.28.0's ``vllm/v1/core/single_type_kv_cache_manager.py`` (``SingleTypeKVCacheManager.cache_blocks``,
``SlidingWindowManager.reachable_block_mask``, ``SlidingWindowManager.find_longest_cache_hit``)
and ``vllm/v1/core/kv_cache_coordinator.py`` (``HybridKVCacheCoordinator.find_longest_cache_hit``,
``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``); the 440246 deployment ran vLLM 0.28.0 with
``VLLM_PREFIX_CACHE_RETENTION_INTERVAL=32768`` (ai-dynamo/aisimulate's experiment README):

* hits land on the scheduler block (the LCM of the groups' blocks: 256 tokens for V4);
* a request retains the window at its *replay boundary* ``floor((P - 1) / 256) * 256`` (``P``
  its prompt tokens), at a *shared-prefix junction* (when its own hit stopped short of the
  full-attention match ``L``, at ``L``), and, with a retention interval ``I > 0``, at every
  multiple of ``I`` its computation passes; ``I = None`` (vLLM's default) retains every block
  boundary (dense), ``I = 0`` only the first two kinds;
* with EAGLE/MTP speculative decoding (``SpeculativeConfig.use_eagle``: ``mtp`` included) the
  group holding the draft (MTP) layer needs one more sliding-window block *past* the boundary
  (``_contiguous_blocks_for_hit(..., use_eagle=True)`` adds one block, which the hit then
  drops). V4's MTP layer is a sliding-window-only layer (its compress ratio is 1 in
  ``models/deepseek_v4/attention.py``), whose blocks are 64 tokens (``DeepseekV4SWACache``).
  So a boundary is usable only if the 64 tokens after it are part of the prefix the new prompt
  shares. At a replay boundary that holds iff ``P - b >= 64``: a prompt that ends 1..63 tokens
  past a 256-token boundary leaves there a window block that contains its *generated* tokens,
  which a next turn (carrying the trace's recorded reply, not the server's) does not share.
  A hit then falls back to the previous checkpoint: in an agentic session, the turn before.

:class:`HitCheckpoints` keeps the checkpoints of one rank (a set of chained block hashes: the
hash of the last block before the boundary names the prefix), answers the longest usable hit,
and records a request's checkpoints when it is admitted. It forgets checkpoints whose block
left the rank's cache (bounded by the cache). Off (``None`` on :class:`sim.run.engine.rank.Rank`)
the simulator's hit is the full-attention match, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["HitCheckpoints"]


class HitCheckpoints:
    """Retained sliding-window checkpoints of one rank (see the module docstring).

    Args:
        block_size: tokens per KV block (the scheduler block; the hit granularity).
        retention_interval_tokens: vLLM ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``: ``None`` =
            every block boundary (dense), ``0`` = replay boundaries and junctions only, ``> 0`` =
            also every multiple of this many tokens (a multiple of ``block_size``).
        peek_tokens: tokens past a boundary the draft layer's window group needs (EAGLE/MTP:
            that group's block, 64 for DeepSeek-V4; 0 without EAGLE/MTP).

    Raises:
        ValueError: a block size < 1, a negative interval or one that is not a multiple of the
            block size, ``peek_tokens`` outside ``[0, block_size]``.
    """

    __slots__ = ("block_size", "interval_blocks", "dense", "peek_tokens", "_points")

    def __init__(self, block_size: int, retention_interval_tokens: int | None, peek_tokens: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if retention_interval_tokens is not None and (
                retention_interval_tokens < 0 or retention_interval_tokens % block_size):
            raise ValueError(f"retention interval {retention_interval_tokens} tokens: must be 0 or a positive "
                             f"multiple of the block size ({block_size})")
        if not 0 <= peek_tokens <= block_size:
            raise ValueError(f"peek_tokens must be in [0, {block_size}], got {peek_tokens}")
        self.block_size = block_size
        self.dense = retention_interval_tokens is None
        self.interval_blocks = (retention_interval_tokens or 0) // block_size
        self.peek_tokens = peek_tokens
        #: hash of the last block before each retained boundary (the prefix it ends)
        self._points: set[int] = set()

    def __len__(self) -> int:
        return len(self._points)

    def usable_hit_blocks(self, block_hashes: Sequence[int], match_blocks: int, prompt_tokens: int) -> int:
        """The longest hit, in blocks, a prompt may take: the largest checkpoint ``b <=`` the
        full-attention match ``match_blocks`` (its leading cached blocks), capped at ``P - 1``
        tokens as vLLM caps it (the last prompt token is always computed). Under dense retention
        every boundary inside the match is a checkpoint, and so is its end unless EAGLE/MTP needs
        a peek there that no retained replay boundary vouches for (one block back then)."""
        b = min(match_blocks, max(0, prompt_tokens - 1) // self.block_size)
        points = self._points
        if self.dense:
            if b == 0 or self.peek_tokens == 0 or block_hashes[b - 1] in points or b < match_blocks:
                # b < match_blocks: the block after b is cached too, so its first tokens are shared
                return b
            return b - 1
        while b > 0 and block_hashes[b - 1] not in points:
            b -= 1
        return b

    def record(self, block_hashes: Sequence[int], prompt_tokens: int, hit_blocks: int, match_blocks: int) -> None:
        """Register the checkpoints a request admitted with a ``hit_blocks`` hit (of a
        ``match_blocks`` full-attention match) retains as it computes its prompt: its replay
        boundary, the junction at ``match_blocks`` when the hit stopped short of it, and the
        interval multiples past its hit; each only where the peek tokens after it are prompt."""
        bs = self.block_size
        n = len(block_hashes)
        cands: list[int] = [max(0, prompt_tokens - 1) // bs]
        if hit_blocks < match_blocks:
            cands.append(match_blocks)
        if self.interval_blocks:
            k = self.interval_blocks
            first = (hit_blocks // k + 1) * k
            cands.extend(range(first, min(n, (prompt_tokens - self.peek_tokens) // bs) + 1, k))
        for b in cands:
            if 0 < b <= n and prompt_tokens - b * bs >= self.peek_tokens:
                self._points.add(block_hashes[b - 1])

    def forget(self, evicted: Iterable[int]) -> None:
        """Blocks that left the rank's cache take their checkpoints with them."""
        points = self._points
        if points:
            points.difference_update(evicted)
