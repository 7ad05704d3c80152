"""``kv_cost``: Dynamo's KV-router cost (prefill work vs decode KV blocks), with temperature.

Algorithm (Dynamo KV router; ANCHORS.md), per candidate ``i``::

    prefill_blocks_i = (prefill_tokens_i + prompt_tokens - matched_tokens_i) / block_size
    decode_blocks_i  = (decode_kv_tokens_i + prompt_tokens) / block_size
    cost_i           = overlap_weight * prefill_blocks_i + decode_blocks_i

``prefill_tokens_i`` is the uncached prompt work already routed there and not yet prefilled,
``decode_kv_tokens_i`` the KV of its active sequences (both counted at dispatch). Temperature 0:
``argmin(cost)``, ties to the fewest cached blocks (Dynamo's tie-break), then random.
Temperature ``T > 0``: min-max normalise costs to ``[0, 1]`` and sample with
``p_i ~ exp(-(c_i - c_min) / ((c_max - c_min) * T))`` (uniform when all costs are equal).

Parameters (Dynamo defaults): ``overlap_weight`` 1.0 (0 = pure KV-load balancing),
``temperature`` 0.0. Scores: cost per candidate (lower is better).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from balancer import kernels
from balancer.candidates import Candidates
from balancer.policies.base import (Policy, SelectContext, argmin_random, array_min, fresh_scores, register,
                                    scores_of)
from balancer.types import Choice, Request


@register
@dataclass(frozen=True)
class KvCost(Policy):
    name = "kv_cost"
    prefill_head_roles = frozenset()  # reads no in-service prefill columns
    uses_kernels = True  # its choice is one compiled call (balancer.kernels.kv_cost_select)
    overlap_weight: float = 1.0
    temperature: float = 0.0

    def __post_init__(self) -> None:
        for name in ("overlap_weight", "temperature"):
            v = getattr(self, name)
            if v < 0:
                raise ValueError(f"kv_cost: {name} must be >= 0, got {v!r}")

    def costs(self, request: Request, cands: Candidates) -> np.ndarray:
        """``cost_i`` as in the module docstring, shape ``(n,)``, float64, in blocks."""
        bs = float(cands.block_size)
        prompt = float(request.prompt_tokens)
        cost = (cands.prefill_tokens + (prompt - cands.matched_tokens)) / bs  # prefill_blocks
        if self.overlap_weight != 1.0:  # (1.0 * x is x: no array operation at the default)
            cost *= self.overlap_weight
        cost += (cands.decode_kv_tokens + prompt) / bs  # + decode_blocks
        return cost

    def select(self, request: Request, cands: Candidates, ctx: SelectContext) -> Choice:
        if self.temperature == 0.0:  # costs and the cheapest in one compiled call, when there is one
            got = kernels.kv_cost_select(cands.prefill_tokens, cands.matched_tokens, cands.decode_kv_tokens,
                                         request.prompt_tokens, cands.block_size, self.overlap_weight)
            if got is not None and got[0] >= 1:
                count, cost, tied = got
                if count == 1:
                    i = int(tied[0])
                else:  # fewest cached blocks among the cheapest, then random (as below)
                    fewest = kernels.fewest_among(cands.matched_blocks, count, tied)
                    if fewest is not None:  # argmin_random's candidates, compiled: the same draw
                        i = int(tied[0]) if fewest == 1 else int(tied[ctx.rng.randrange(fewest)])
                    else:
                        tied = tied[:count]
                        i = int(tied[argmin_random(cands.matched_blocks[tied], ctx.rng)])
                return Choice(cands.replicas[i], fresh_scores(cands, cost), reason="min_cost")
        cost = self.costs(request, cands)
        scores = scores_of(cands, cost)
        if self.temperature == 0.0:
            tied = (cost == array_min(cost)).nonzero()[0]
            if len(tied) == 1:
                i = int(tied[0])
            else:  # fewest cached blocks among the cheapest, then random
                i = int(tied[argmin_random(cands.matched_blocks[tied], ctx.rng)])
            return Choice(cands.replicas[i], scores, reason="min_cost")
        lo, hi = float(cost.min()), float(cost.max())
        if hi == lo:
            return Choice(cands.replicas[ctx.rng.randrange(len(cands))], scores, reason="sampled")
        weights = [math.exp(-(c - lo) / ((hi - lo) * self.temperature)) for c in cost.tolist()]
        i = ctx.rng.choices(range(len(cands)), weights=weights, k=1)[0]
        return Choice(cands.replicas[i], scores, reason="sampled")
