"""Workload statistics that need no simulator."""

from __future__ import annotations

from collections.abc import Sequence

from balancer.hashing import leading_held
from balancer.types import Request

from ._checks import check_positive_int

__all__ = ["ideal_hit_rate"]


def ideal_hit_rate(requests: Sequence[Request], block_size: int) -> tuple[float, float]:
    """Prefix-cache hit rate of one infinite cache that has seen every earlier request.

    Requests are taken in arrival order (stable: ties keep list order). For each, ``k`` is the
    number of its leading block hashes already seen in an earlier request (matching stops at the
    first miss, as a prefix cache does); then all its hashes are added to the cache. This is an
    upper bound for any routing policy and cache size.

    Args:
        requests: requests with chained ``block_hashes`` (see :mod:`balancer.hashing`).
        block_size: tokens per block, to convert hit blocks to tokens (>= 1).

    Returns:
        ``(block_weighted, token_weighted)``, both in [0, 1]:
        ``sum(k) / sum(len(block_hashes))`` and
        ``sum(min(k * block_size, prompt_tokens)) / sum(prompt_tokens)``. ``(0.0, 0.0)`` when
        there are no blocks or no tokens. On the Mooncake conversation trace: about
        ``(0.3664, 0.3736)``.

    Raises:
        ValueError: ``block_size`` < 1.
    """
    check_positive_int(block_size, "block_size")
    seen: set[int] = set()
    hit_blocks = total_blocks = hit_tokens = total_tokens = 0
    for r in sorted(requests, key=lambda r: r.arrival_time_s):
        hashes = r.block_hashes
        k = leading_held(hashes, seen)
        hit_blocks += k
        total_blocks += len(hashes)
        hit_tokens += min(k * block_size, r.prompt_tokens)
        total_tokens += r.prompt_tokens
        seen.update(hashes)
    return (
        hit_blocks / total_blocks if total_blocks else 0.0,
        hit_tokens / total_tokens if total_tokens else 0.0,
    )
