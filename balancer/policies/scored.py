"""``scored``: llm-d style weighted scorers with a max-score picker.

Algorithm (llm-d router, ``pkg/epp``; ANCHORS.md): each scorer maps every candidate to [0, 1];
the total is ``sum(weight_s * score_s)``; the highest total wins, ties random. Scorers:

- ``prefix``: ``matched_blocks / prompt_blocks`` (0 when the prompt has no blocks).
- ``queue``: ``(max_q - q) / (max_q - min_q)`` with ``q`` = in-flight requests; 1.0 for all
  candidates when every ``q`` is equal.
- ``kv_utilization``: ``1 - kv_usage`` (decode KV tokens / capacity; 1.0 when capacity unknown).
- ``load``: ``0.5 * (1 - min(q, load_queue_cap) / load_queue_cap)`` (llm-d load-aware scorer,
  cap 128).

Parameters: ``prefix_weight`` 3, ``queue_weight`` 2, ``kv_utilization_weight`` 2,
``load_weight`` 0, ``load_queue_cap`` 128 (llm-d's default inference-scheduling profile weights
prefix 3, queue 2, kv-cache utilisation 2). Scores: the weighted total (higher is better).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from balancer import kernels
from balancer.candidates import Candidates
from balancer.policies.base import (Policy, SelectContext, argmax_random, array_max, array_min, fresh_scores, register,
                                    scores_of)
from balancer.types import Choice, Request

#: The scorers, in the order their weighted scores are summed.
SCORERS = ("prefix", "queue", "kv_utilization", "load")


@register
@dataclass(frozen=True)
class Scored(Policy):
    name = "scored"
    prefill_head_roles = frozenset()  # reads no in-service prefill columns
    uses_kernels = True  # its choice is one compiled call (balancer.kernels.scored_select)
    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_utilization_weight: float = 2.0
    load_weight: float = 0.0
    load_queue_cap: int = 128

    def __post_init__(self) -> None:
        ws = (self.prefix_weight, self.queue_weight, self.kv_utilization_weight, self.load_weight)
        if min(ws) < 0 or sum(ws) == 0:
            raise ValueError("scored: weights must be >= 0 and not all zero")
        if self.load_queue_cap < 1:
            raise ValueError("scored: load_queue_cap must be >= 1")

    def component_scores(self, request: Request, cands: Candidates,
                         names: Collection[str] = SCORERS) -> dict[str, np.ndarray]:
        """Each scorer's values, shape ``(n,)``, in [0, 1], for the scorers in ``names``
        (default: all of :data:`SCORERS`)."""
        out: dict[str, np.ndarray] = {}
        if "prefix" in names:
            n_blocks = len(request.block_hashes)
            prefix = cands.matched_blocks / n_blocks if n_blocks else np.zeros(len(cands))
            out["prefix"] = np.minimum(prefix, 1.0, out=prefix)
        q = cands.num_requests.astype(np.float64)
        if "queue" in names:
            qmin, qmax = float(array_min(q)), float(array_max(q))
            out["queue"] = np.ones(len(cands)) if qmax == qmin else (qmax - q) / (qmax - qmin)
        if "kv_utilization" in names:
            out["kv_utilization"] = 1.0 - cands.kv_usage
        if "load" in names:
            out["load"] = 0.5 * (1.0 - np.minimum(q, self.load_queue_cap) / self.load_queue_cap)
        return out

    def select(self, request: Request, cands: Candidates, ctx: SelectContext) -> Choice:
        got = kernels.scored_select(cands.matched_blocks, cands.num_requests, cands.decode_kv_tokens,
                                    cands.kv_capacity_tokens, len(request.block_hashes),
                                    (self.prefix_weight, self.queue_weight, self.kv_utilization_weight,
                                     self.load_weight), self.load_queue_cap)
        if got is not None and got[0] >= 1:  # the total and its maxima in one compiled call (the same as below)
            count, total, pos = got
            i = int(pos[0]) if count == 1 else int(pos[ctx.rng.randrange(count)])
            return Choice(cands.replicas[i], fresh_scores(cands, total), reason="max_score")
        weighted = [(name, w) for name, w in (("prefix", self.prefix_weight), ("queue", self.queue_weight),
                                              ("kv_utilization", self.kv_utilization_weight),
                                              ("load", self.load_weight)) if w]
        # only the scorers that count are computed (the default load_weight is 0)
        c = self.component_scores(request, cands, [name for name, _ in weighted])
        total = weighted[0][1] * c[weighted[0][0]]  # = 0.0 + that term (scores are >= 0, never -0.0)
        for name, w in weighted[1:]:
            total += w * c[name]
        i = argmax_random(total, ctx.rng)
        return Choice(cands.replicas[i], scores_of(cands, total), reason="max_score")
