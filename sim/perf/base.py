"""The step-latency model interface used by the simulator's engines.

An engine step is one forward pass of a *step group*: the DP ranks that run each forward step
together. For a wide-EP MoE engine that is every DP rank of the engine (MoE dispatch/combine
synchronises them, so the step takes as long as the most loaded rank); for a dense engine each DP
rank is its own step group of one.

The work of one step is described per rank by four numbers (arrays of shape ``(..., R)`` where
``R`` is the number of ranks in the step group; leading axes let callers evaluate many future
steps at once, e.g. ``K`` decode steps in one vectorised call):

``prefill_tokens``
    prompt tokens computed this step on the rank (the uncached part of a chunk; cached prefix
    tokens are not recomputed).
``prefill_attn_pairs``
    attention (query, key) pairs of those tokens: a chunk of ``c`` new tokens after ``p`` tokens
    already in the KV cache contributes ``c * p + c * (c + 1) / 2`` (causal attention).
``decode_seqs``
    decode sequences in the batch (one new token each).
``decode_ctx_tokens``
    sum of the KV lengths those decode sequences attend to.

A model returns the step time in seconds with the rank axis reduced, shape ``(...)``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import ArrayLike


@runtime_checkable
class PerfModel(Protocol):
    """Step latency of one step group; implemented by the roofline and the measured-table models."""

    #: KV cache bytes per token (all layers) of the model on this engine.
    kv_bytes_per_token: int
    #: KV cache capacity of one DP rank in tokens (GPU memory minus weights and activations).
    kv_capacity_tokens_per_rank: int
    #: True when all DP ranks of the engine step together (wide EP); False for independent ranks.
    ep_synchronous: bool
    #: True when :meth:`step_time_s` takes a fifth argument, ``prefill_cached_tokens`` (per rank,
    #: shape ``(..., R)``: the cached prefix tokens of the prompts in the step), which callers then
    #: pass: a causal encoder-decoder roofline (DeepSeek-V4.1) prices a step by its chunk count,
    #: which the prefix sets. Every model declares it (no capability probing).
    wants_prefill_cached_tokens: bool
    #: Tokens each decoding sequence computes per step (``1 + d`` with MTP verification of ``d``
    #: draft tokens; 1 without): the step group charges a decode step this many tokens per sequence.
    verify_tokens_per_seq: int
    #: Output tokens a decoding sequence gains per step (MTP acceptance length; 1.0 without).
    decode_tokens_per_step: float

    def step_time_s(
        self,
        prefill_tokens: ArrayLike,
        prefill_attn_pairs: ArrayLike,
        decode_seqs: ArrayLike,
        decode_ctx_tokens: ArrayLike,
    ) -> np.ndarray:
        """Seconds one step takes, given per-rank work of shape ``(..., R)``; returns shape ``(...)``."""
        ...


def causal_attn_pairs(new_tokens: ArrayLike, cached_tokens: ArrayLike) -> np.ndarray:
    """Attention (query, key) pairs for ``new_tokens`` computed after ``cached_tokens``.

    ``c * p + c * (c + 1) / 2`` for ``c`` new and ``p`` cached tokens (causal mask, each new token
    attends to all cached tokens, the new tokens before it and itself). Hand check: c=2, p=3 ->
    token 1 sees 4 keys, token 2 sees 5 keys = 9 = 2*3 + 3.
    """
    c = np.asarray(new_tokens, dtype=np.float64)
    p = np.asarray(cached_tokens, dtype=np.float64)
    return c * p + c * (c + 1.0) / 2.0
