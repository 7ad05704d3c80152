"""NVIDIA Dynamo mocker's default step-time polynomials as a pdlb perf model.

Dynamo's offline trace replay (``dynamo.replay``, PyPI ``ai-dynamo``) simulates each worker with a
*mocker* engine whose default timing model has no model or hardware in it: two polynomials fitted
once to one GPU (the ``PerfModel::Polynomial`` variant of its mocker's perf model):

* **prefill** of ``T`` new tokens in one pass (all prompts of the pass together; cached prefix
  tokens are not counted and attention to earlier chunks is free)::

      t_pf(T) = 4.209989e-7 * T^2 + 1.518344e-2 * T + 16.50142   [ms]   (T > 0; 0 when T = 0)

* **decode** of a batch, a function of the KV occupancy ``u = min(1, active / capacity)`` only
  (not of the batch size)::

      t_dec(u) = max(1, -25.74 * u^2 + 54.01 * u + 5.74)   [ms]   (0 with no decode sequence)

A mixed pass (chunked prefill next to decode, vLLM-style aggregated engine) takes
``t_pf(T) + t_dec(u)``: the mocker runs the prefill, then the decode, one after the other.

:class:`MockerPolynomialPerf` exposes them through :class:`sim.perf.base.PerfModel` so that pdlb's
simulator and Dynamo's replay can run *the same engine* (``simulate(..., perf_factory=
mocker_polynomial_factory(...))``): the comparison then checks queueing, batching, chunking and
prefix caching rather than two different timing models. ``u`` is pdlb's decode context (sum of the
running sequences' KV lengths, ``decode_ctx_tokens``) over the rank's capacity; Dynamo counts the
blocks its running requests hold (shared prefix blocks once, whole blocks), a difference of at
most a few percent of ``u`` on conversation traces.

Source of the coefficients: the mocker's perf model in ai-dynamo 1.6.1 (Apache-2.0), the formulas
``polynomial_prefill_time`` / ``polynomial_decode_time``; they are facts about that simulator, not
a measurement of any GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import ArrayLike

#: ``t_pf(T) = a T^2 + b T + c`` milliseconds (Dynamo mocker default)
PREFILL_MS_COEFFS = (4.209989e-07, 1.518344e-02, 1.650142e01)
#: ``t_dec(u) = a u^2 + b u + c`` milliseconds, ``u`` = KV occupancy in [0, 1] (Dynamo mocker default)
DECODE_MS_COEFFS = (-25.74, 54.01, 5.74)
#: the mocker's floor on a decode pass, milliseconds
DECODE_MIN_MS = 1.0


def mocker_prefill_ms(new_tokens: ArrayLike) -> np.ndarray:
    """Dynamo mocker's prefill time in ms of ``new_tokens`` new prompt tokens in one pass (0 for 0)."""
    t = np.asarray(new_tokens, dtype=np.float64)
    a, b, c = PREFILL_MS_COEFFS
    return np.where(t > 0, a * t * t + b * t + c, 0.0)


def mocker_decode_ms(kv_occupancy: ArrayLike) -> np.ndarray:
    """Dynamo mocker's decode time in ms at KV occupancy ``kv_occupancy`` (fraction, clipped to [0, 1])."""
    u = np.clip(np.asarray(kv_occupancy, dtype=np.float64), 0.0, 1.0)
    a, b, c = DECODE_MS_COEFFS
    return np.maximum(DECODE_MIN_MS, a * u * u + b * u + c)


class MockerPolynomialPerf:
    """Dynamo mocker's default timing (module docstring) as a :class:`~sim.perf.base.PerfModel`.

    Args:
        kv_capacity_tokens_per_rank: KV capacity of a worker in tokens (Dynamo: ``num_gpu_blocks *
            block_size``); the decode polynomial's occupancy is relative to it. Must be >= 1.
        kv_bytes_per_token: KV bytes per token, used only by KV transfers and tiers (the mocker
            has none by default); default 131,072 (Llama-3.1-8B in BF16: 32 layers x 8 KV heads
            x 128 dims x 2 (K, V) x 2 bytes).

    Raises:
        ValueError: a capacity below 1 token or negative bytes per token.
    """

    ep_synchronous = False
    wants_prefill_cached_tokens = False
    verify_tokens_per_seq = 1
    decode_tokens_per_step = 1.0

    def __init__(self, kv_capacity_tokens_per_rank: int, kv_bytes_per_token: int = 131_072) -> None:
        if kv_capacity_tokens_per_rank < 1:
            raise ValueError(f"kv_capacity_tokens_per_rank must be >= 1, got {kv_capacity_tokens_per_rank}")
        if kv_bytes_per_token < 0:
            raise ValueError(f"kv_bytes_per_token must be >= 0, got {kv_bytes_per_token}")
        self.kv_capacity_tokens_per_rank = int(kv_capacity_tokens_per_rank)
        self.kv_bytes_per_token = int(kv_bytes_per_token)

    def step_time_s(self, prefill_tokens: ArrayLike, prefill_attn_pairs: ArrayLike, decode_seqs: ArrayLike,
                    decode_ctx_tokens: ArrayLike) -> np.ndarray:
        """Seconds of one pass per rank (shape ``(..., R)`` in), max over ranks (shape ``(...)`` out):
        ``t_pf(T) + t_dec(ctx / capacity)`` with the decode term only when ``decode_seqs > 0``.
        ``prefill_attn_pairs`` is ignored (the polynomial has no attention term). One rank
        (shape ``(1,)``) takes a plain-float path with the same operations in the same order."""
        if np.shape(prefill_tokens) == np.shape(decode_seqs) == np.shape(decode_ctx_tokens) == (1,):
            return np.asarray(self._one_rank_ms(float(prefill_tokens[0]), float(decode_seqs[0]),  # type: ignore[index]
                                                float(decode_ctx_tokens[0])) / 1e3)  # type: ignore[index]
        pf = mocker_prefill_ms(prefill_tokens)
        occ = np.asarray(decode_ctx_tokens, dtype=np.float64) / self.kv_capacity_tokens_per_rank
        dec = np.where(np.asarray(decode_seqs) > 0, mocker_decode_ms(occ), 0.0)
        return np.max(pf + dec, axis=-1) / 1e3


    def _one_rank_ms(self, t: float, seqs: float, ctx: float) -> float:
        pf = 0.0
        if t > 0:
            a, b, c = PREFILL_MS_COEFFS
            pf = a * t * t + b * t + c
        if seqs > 0:
            u = min(max(ctx / self.kv_capacity_tokens_per_rank, 0.0), 1.0)
            a, b, c = DECODE_MS_COEFFS
            return pf + max(DECODE_MIN_MS, a * u * u + b * u + c)
        return pf + 0.0


def mocker_polynomial_factory(kv_bytes_per_token: int = 131_072) -> Callable:
    """A ``perf_factory`` for :func:`sim.run.cluster.simulate`: every pool gets a
    :class:`MockerPolynomialPerf` with the pool's ``kv_capacity_tokens`` (required: the mocker's
    capacity is a setting, not derived from a GPU)."""

    def factory(scenario, pool) -> MockerPolynomialPerf:  # noqa: ANN001 (Scenario, PoolConfig)
        if pool.kv_capacity_tokens is None:
            raise ValueError("the mocker polynomial needs the pool's kv_capacity_tokens (Dynamo: "
                             "num_gpu_blocks * block_size)")
        return MockerPolynomialPerf(pool.kv_capacity_tokens, kv_bytes_per_token)

    return factory
