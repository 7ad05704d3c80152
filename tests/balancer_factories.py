"""Small factories shared by the balancer tests (not a conftest: other suites own that name)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from balancer.candidates import Candidates
from balancer.cost_model import DecodeStepCost, PrefillStepCost
from balancer.hashing import chain_block_ids
from balancer.policies import SelectContext
from balancer.types import ReplicaId, ReplicaView, Request, Role


def rid(name: str, dp: int = 0) -> ReplicaId:
    return ReplicaId(name, dp)


def view(name: str, role: Role = Role.DECODE, *, dp: int = 0, **kw) -> ReplicaView:
    """A hand-built replica view; ``matched_tokens`` defaults to ``matched_blocks * block_size``."""
    if "matched_blocks" in kw and "matched_tokens" not in kw:
        kw["matched_tokens"] = kw["matched_blocks"] * kw.get("block_size", 1)
    return ReplicaView(replica=ReplicaId(name, dp), role=role, **kw)


def cands(*views: ReplicaView) -> Candidates:
    return Candidates.from_views(list(views))


def ctx(seed: int = 0, decision_index: int = 0, now_s: float = 0.0) -> SelectContext:
    return SelectContext(random.Random(seed), now_s, decision_index)


def blocks(ids: Sequence[int], parent: int | None = None) -> tuple[int, ...]:
    """Chained block hashes of per-block ids (equal id prefixes -> equal hash prefixes)."""
    return tuple(chain_block_ids(list(ids), parent))


def req(
    request_id: str,
    prompt_tokens: int = 100,
    block_ids: Sequence[int] | None = None,
    *,
    session_id: str | None = None,
    arrival_time_s: float = 0.0,
    block_hashes: tuple[int, ...] | None = None,
) -> Request:
    if block_hashes is None:
        block_hashes = blocks(block_ids) if block_ids is not None else ()
    return Request(
        request_id=request_id,
        arrival_time_s=arrival_time_s,
        prompt_tokens=prompt_tokens,
        block_hashes=block_hashes,
        session_id=session_id,
    )


#: the AgentX 440246 cost model (pdlb sim cost-model of the point), rounded to two digits
PF440 = PrefillStepCost(overhead_s=0.0062, per_token_s=6.2e-5, per_attn_pair_s=2.1e-10, per_group_token_s=3.9e-6)
DC440 = DecodeStepCost(overhead_s=0.018, per_seq_s=5.4e-4, per_kv_token_s=1.8e-9, per_group_seq_s=1.1e-4)


def random_ep_views(rng, role: Role) -> list[ReplicaView]:
    """Two engines of 4 DP ranks (``e0``, ``e1``) in ``role`` with random load, KV and prefix hits
    drawn from ``rng`` (``numpy.random.Generator``): the pools of the differential tests that check an
    option changes no decision where it has nothing to price."""
    return [view(f"e{i // 4}", role, dp=i % 4, num_requests=int(rng.integers(0, 24)),
                 prefill_tokens=int(rng.integers(0, 50_000)), decode_kv_tokens=int(rng.integers(0, 10**6)),
                 kv_capacity_tokens=2 * 10**6, matched_tokens=int(rng.integers(0, 4)) * 4096, block_size=256)
            for i in range(8)]


def random_request(rng, request_id: str) -> Request:
    """A request of 1-29,999 prompt tokens and 1-1,999 output tokens drawn from ``rng``."""
    return Request(request_id, 0.0, int(rng.integers(1, 30_000)), max_output_tokens=int(rng.integers(1, 2000)))
