"""``power_of_two``: the less loaded of two random candidates.

Algorithm: draw two distinct candidates uniformly (``rng.sample``), pick the one with the lower
load (``metric`` as in ``least_load``), ties to the first drawn. With one candidate, pick it.
Parameters: ``metric`` (default ``auto``). Source: Mitzenmacher, "The Power of Two Choices in
Randomized Load Balancing" (2001); SGLang / vLLM router ``power_of_two``.
"""

from __future__ import annotations

from dataclasses import dataclass

from balancer.candidates import Candidates
from balancer.policies.base import Policy, SelectContext, check_metric, load_values, register
from balancer.types import Choice, Request


@register
@dataclass(frozen=True)
class PowerOfTwo(Policy):
    """Scores are the two sampled candidates' loads (lower is better)."""

    name = "power_of_two"
    prefill_head_roles = frozenset()  # reads no in-service prefill columns
    metric: str = "auto"

    def __post_init__(self) -> None:
        check_metric(self.metric)

    def select(self, request: Request, cands: Candidates, ctx: SelectContext) -> Choice:
        if len(cands) == 1:
            return Choice(cands.replicas[0], reason="single")
        a, b = ctx.rng.sample(range(len(cands)), 2)
        load = load_values(cands, self.metric)
        i = b if load[b] < load[a] else a
        scores = {cands.replicas[a]: float(load[a]), cands.replicas[b]: float(load[b])}
        return Choice(cands.replicas[i], scores, reason="power_of_two")
