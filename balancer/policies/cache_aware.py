"""``cache_aware``: SGLang's cache-aware policy (prefix affinity with an imbalance fallback).

Algorithm (SGLang router ``cache_aware``; ANCHORS.md), with the load = in-flight request count:

1. If ``max_load - min_load > balance_abs`` **and** ``max_load > min_load * balance_rel``, the
   pool is imbalanced: route to the least-loaded candidate (``reason="imbalanced"``).
2. Else ``match_rate = matched_tokens / prompt_tokens`` of the best-matching candidate. If
   ``match_rate > cache_threshold`` route to the deepest match, ties to the least loaded, then
   random (``"cache_hit"``).
3. Else route to the least-loaded candidate (``"cache_miss"``). Misses never go to the replica
   with the smallest cache ("smallest tree"), which piles work onto one replica.

pdlb matches on KV blocks instead of SGLang's characters, so ``match_rate`` is token-weighted over
whole blocks. The router inserts the prompt for the chosen replica (approximate index), as SGLang
inserts the request text into its tree.

Parameters (SGLang defaults): ``cache_threshold`` 0.3, ``balance_abs`` 64, ``balance_rel`` 1.5.
Scores: matched tokens per candidate (higher is better).
"""

from __future__ import annotations

from dataclasses import dataclass

from balancer.candidates import Candidates
from balancer.policies.base import Policy, SelectContext, argmin_random, array_max, array_min, register, scores_of
from balancer.types import Choice, Request


@register
@dataclass(frozen=True)
class CacheAware(Policy):
    name = "cache_aware"
    prefill_head_roles = frozenset()  # reads no in-service prefill columns
    cache_threshold: float = 0.3
    balance_abs: int = 64
    balance_rel: float = 1.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_aware: cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs < 0 or self.balance_rel < 1.0:
            raise ValueError("cache_aware: balance_abs must be >= 0 and balance_rel >= 1")

    def select(self, request: Request, cands: Candidates, ctx: SelectContext) -> Choice:
        load = cands.num_requests
        max_load, min_load = int(array_max(load)), int(array_min(load))
        scores = scores_of(cands, cands.matched_tokens)
        if max_load - min_load > self.balance_abs and max_load > min_load * self.balance_rel:
            i = argmin_random(load, ctx.rng)
            return Choice(cands.replicas[i], scores, reason="imbalanced")
        best = int(array_max(cands.matched_tokens))
        if best / request.prompt_tokens > self.cache_threshold:
            deepest = (cands.matched_tokens == best).nonzero()[0]
            i = int(deepest[argmin_random(load[deepest], ctx.rng)])
            return Choice(cands.replicas[i], scores, reason="cache_hit")
        i = argmin_random(load, ctx.rng)
        return Choice(cands.replicas[i], scores, reason="cache_miss")


