"""``random``: a uniformly random candidate.

Algorithm: ``rng.randrange(n)`` with the router's seeded ``random.Random``. Parameters: none.
Source: SGLang / vLLM router ``random`` policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from balancer.candidates import Candidates
from balancer.policies.base import Policy, SelectContext, register
from balancer.types import Choice, Request


@register
@dataclass(frozen=True)
class Random(Policy):
    name = "random"
    prefill_head_roles = frozenset()  # reads no in-service prefill columns
    uses_load = False
    uses_prefix_index = False

    def select(self, request: Request, cands: Candidates, ctx: SelectContext) -> Choice:
        return Choice(cands.replicas[ctx.rng.randrange(len(cands))], reason="random")
