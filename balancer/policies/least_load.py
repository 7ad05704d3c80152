"""``least_load``: the candidate with the least projected load.

Algorithm: ``argmin(load)`` with random tie-break, where ``load`` is chosen by ``metric``:
``auto`` (default: prefill pools balance uncached prefill tokens, decode pools KV tokens, mixed
pools request count; see :func:`balancer.policies.base.load_values`), ``requests``,
``prefill_tokens`` or ``kv_tokens``. Load is counted at dispatch (:mod:`balancer.load`).
Source: DeepSeek V3/R1 inference overview (prefill balances input tokens, decode balances KV
usage and request count); Dynamo/vLLM ``least-loaded``.
"""

from __future__ import annotations

from dataclasses import dataclass

from balancer.candidates import Candidates
from balancer.policies.base import Policy, SelectContext, argmin_random, check_metric, load_values, register, scores_of
from balancer.types import Choice, Request


@register
@dataclass(frozen=True)
class LeastLoad(Policy):
    """Scores are the load values (lower is better)."""

    name = "least_load"
    prefill_head_roles = frozenset()  # reads no in-service prefill columns
    metric: str = "auto"

    def __post_init__(self) -> None:
        check_metric(self.metric)

    def select(self, request: Request, cands: Candidates, ctx: SelectContext) -> Choice:
        load = load_values(cands, self.metric)
        i = argmin_random(load, ctx.rng)
        return Choice(cands.replicas[i], scores_of(cands, load), reason="least_load")
