"""Synthetic workloads: Poisson arrivals with lognormal lengths and optional shared prefixes."""

from __future__ import annotations

import math

import numpy as np
import xxhash

from balancer.hashing import chain_block_ids
from balancer.types import Request

from ._checks import check_positive_float, check_positive_int

__all__ = ["poisson_workload"]


def _lognormal_lengths(rng: np.random.Generator, n: int, mean: float, sigma: float) -> np.ndarray:
    """``n`` integer lengths: ``LogNormal(mu, sigma)`` with ``mu = ln(mean) - sigma**2 / 2`` (so
    the continuous mean is ``mean``), rounded to the nearest integer and clipped to >= 1."""
    mu = math.log(mean) - sigma * sigma / 2.0
    draws = rng.lognormal(mu, sigma, size=n) if sigma > 0 else np.full(n, mean)
    return np.maximum(np.rint(draws), 1).astype(np.int64)


def poisson_workload(
    num_requests: int,
    rate_per_s: float,
    *,
    prompt_tokens_mean: float,
    output_tokens_mean: float,
    seed: int,
    block_size: int = 512,
    shared_prefix_tokens: int = 0,
    num_prefix_groups: int = 1,
    prompt_tokens_sigma: float = 1.0,
    output_tokens_sigma: float = 0.5,
    traffic_class: str | None = None,
) -> list[Request]:
    """A synthetic open-loop workload, deterministic for a given ``seed``.

    * Arrivals: a Poisson process of rate ``rate_per_s`` starting at t = 0: inter-arrival gaps
      are i.i.d. ``Exponential(mean = 1 / rate_per_s)`` (not capped), and request ``i`` arrives
      at the sum of the first ``i + 1`` gaps (so the first arrival is after one gap, not at 0).
    * Lengths: prompt and output tokens are i.i.d. lognormal with the given mean and log-space
      standard deviation (``sigma``; 0 gives constant lengths), rounded to integers and clipped
      to >= 1 (which raises the mean slightly when it is close to 1). The defaults (prompt
      sigma 1.0, output sigma 0.5) roughly match the Mooncake conversation trace's spread
      (p99/p50 of about 12 for inputs and 3.2 for outputs).
    * Prefixes: with ``shared_prefix_tokens >= block_size``, each request is assigned a prefix
      group uniformly at random among ``num_prefix_groups``; requests of one group share their
      first ``min(shared_prefix_tokens, prompt_tokens) // block_size`` block hashes (only full
      blocks can be shared). All other blocks are unique to the request. The prompt length is
      drawn independently of the prefix, so a prompt shorter than the prefix is entirely shared.
    * Block hashes: ``ceil(prompt_tokens / block_size)`` per request, ``chain_block_ids`` over
      synthetic ids rooted at a hash of ``seed``, so workloads with different seeds share
      nothing and can be merged safely.

    Request ids are ``f"r{i}"``; ``expected_output_tokens == max_output_tokens``.

    Args:
        num_requests: number of requests (>= 0).
        rate_per_s: mean arrival rate in requests per second (> 0).
        prompt_tokens_mean: mean prompt length in tokens (> 0).
        output_tokens_mean: mean output length in tokens (> 0).
        seed: seed of the ``numpy.random.Generator`` (any int).
        block_size: tokens per KV block (>= 1).
        shared_prefix_tokens: tokens of shared prefix per group (>= 0; < ``block_size``: none).
        num_prefix_groups: number of distinct shared prefixes (>= 1).
        prompt_tokens_sigma: lognormal sigma of prompt lengths (>= 0).
        output_tokens_sigma: lognormal sigma of output lengths (>= 0).
        traffic_class: tag stored on every request.

    Returns:
        ``num_requests`` requests sorted by arrival time.

    Raises:
        ValueError: an argument outside the ranges above.
    """
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 0:
        raise ValueError(f"num_requests must be an int >= 0, got {num_requests!r}")
    rate = check_positive_float(rate_per_s, "rate_per_s")
    prompt_mean = check_positive_float(prompt_tokens_mean, "prompt_tokens_mean")
    output_mean = check_positive_float(output_tokens_mean, "output_tokens_mean")
    check_positive_int(block_size, "block_size")
    check_positive_int(num_prefix_groups, "num_prefix_groups")
    if isinstance(shared_prefix_tokens, bool) or not isinstance(shared_prefix_tokens, int) or shared_prefix_tokens < 0:
        raise ValueError(f"shared_prefix_tokens must be an int >= 0, got {shared_prefix_tokens!r}")
    for name, sigma in (("prompt_tokens_sigma", prompt_tokens_sigma), ("output_tokens_sigma", output_tokens_sigma)):
        if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {sigma!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an int, got {seed!r}")

    rng = np.random.default_rng(seed)
    # Draw order is part of the determinism contract: gaps, prompts, outputs, groups.
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=num_requests))
    prompts = _lognormal_lengths(rng, num_requests, prompt_mean, float(prompt_tokens_sigma))
    outputs = _lognormal_lengths(rng, num_requests, output_mean, float(output_tokens_sigma))
    shared_blocks = shared_prefix_tokens // block_size
    groups = rng.integers(0, num_prefix_groups, size=num_requests) if shared_blocks else None

    root = xxhash.xxh3_64_intdigest(f"pdlb/poisson/{int(seed)}".encode())
    next_id = num_prefix_groups * shared_blocks  # ids below this are the groups' prefix blocks
    requests: list[Request] = []
    for i in range(num_requests):
        n_tokens = int(prompts[i])
        n_blocks = -(-n_tokens // block_size)
        ids: list[int] = []
        if groups is not None:
            k = min(shared_prefix_tokens, n_tokens) // block_size
            base = int(groups[i]) * shared_blocks
            ids.extend(range(base, base + k))
        n_own = n_blocks - len(ids)
        ids.extend(range(next_id, next_id + n_own))
        next_id += n_own
        out = int(outputs[i])
        requests.append(
            Request(
                request_id=f"r{i}",
                arrival_time_s=float(arrivals[i]),
                prompt_tokens=n_tokens,
                block_hashes=tuple(chain_block_ids(ids, parent_hash=root)),
                max_output_tokens=out,
                expected_output_tokens=out,
                traffic_class=traffic_class,
            )
        )
    return requests
