"""``round_robin``: the candidates in turn.

Algorithm: pick ``candidates[decision_index % n]``, where ``decision_index`` counts this
router's earlier decisions for the pool (passed in the context, so the policy stays pure) and
candidates are in the router's stable order. The count is one router's: under
``pdlb serve --processes N`` each process keeps its own, so the turns are per process (N
processes with few requests each can split a run unevenly, e.g. 24/16 over two workers; issue 30).
Parameters: none. Source: every router's baseline
(SGLang, vLLM router, Dynamo ``round_robin``).
"""

from __future__ import annotations

from dataclasses import dataclass

from balancer.candidates import Candidates
from balancer.policies.base import Policy, SelectContext, register
from balancer.types import Choice, Request


@register
@dataclass(frozen=True)
class RoundRobin(Policy):
    name = "round_robin"
    prefill_head_roles = frozenset()  # reads no in-service prefill columns
    uses_load = False
    uses_prefix_index = False

    def select(self, request: Request, cands: Candidates, ctx: SelectContext) -> Choice:
        return Choice(cands.replicas[ctx.decision_index % len(cands)], reason="round_robin")
