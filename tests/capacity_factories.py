"""A hand-computable cluster for the capacity tests (module-level so that worker processes and Ray
tasks can import it by name).

One rank per engine, dense (no EP), and a step time of exactly ``PREFILL_S_PER_TOKEN`` seconds per
prefill token plus ``DECODE_STEP_S`` per decode step with any sequence: a ``PROMPT_TOKENS`` prompt
with ``max_prefill_tokens = PROMPT_TOKENS`` takes one step of ``SERVICE_S = 1 s``, one request at a
time. Requests arrive every ``GAP_S = 1 s`` at rate scale 1, have no cached prefix and one output
token (aggregated: done at the end of prefill), so the queue is a D/D/1 queue (see test_capacity.py).
"""

from __future__ import annotations

import numpy as np

from balancer.types import Request
from sim.scenario import PoolConfig, Scenario

PREFILL_S_PER_TOKEN = 1e-3
DECODE_STEP_S = 0.02
PROMPT_TOKENS = 1000
SERVICE_S = PREFILL_S_PER_TOKEN * PROMPT_TOKENS  # 1 s
GAP_S = 1.0


class FixedCostPerf:
    """``step = max over ranks(PREFILL_S_PER_TOKEN * prefill_tokens + DECODE_STEP_S * (decode_seqs > 0))``."""

    kv_bytes_per_token = 0
    kv_capacity_tokens_per_rank = 10_000_000
    ep_synchronous = False
    wants_prefill_cached_tokens = False
    verify_tokens_per_seq = 1  # no MTP (PerfModel declares both)
    decode_tokens_per_step = 1.0

    def step_time_s(self, prefill_tokens, prefill_attn_pairs, decode_seqs, decode_ctx_tokens):  # noqa: ANN001, ANN201
        t = PREFILL_S_PER_TOKEN * np.asarray(prefill_tokens, dtype=np.float64)
        t = t + DECODE_STEP_S * (np.asarray(decode_seqs, dtype=np.float64) > 0)
        return t.max(axis=-1)


def fixed_cost_perf(scenario: Scenario, pool: PoolConfig) -> FixedCostPerf:
    return FixedCostPerf()


def mixed_scenario(engines: int = 1) -> Scenario:
    return Scenario(name="fixed-cost-agg", model="llama-3.1-8b", hardware="h100", index_capacity_blocks=None,
                    mixed=PoolConfig(num_engines=engines, dp_ranks=1, max_prefill_tokens=PROMPT_TOKENS))


def pd_scenario(prefill: int = 1, decode: int = 1) -> Scenario:
    return Scenario(name="fixed-cost-pd", model="llama-3.1-8b", hardware="h100", index_capacity_blocks=None,
                    prefill=PoolConfig(num_engines=prefill, dp_ranks=1, max_prefill_tokens=PROMPT_TOKENS, max_decode_batch=1),
                    decode=PoolConfig(num_engines=decode, dp_ranks=1))


def uniform_requests(n: int = 101, output_tokens: int = 1, prompt_tokens: int = PROMPT_TOKENS) -> list[Request]:
    """``n`` requests ``GAP_S`` apart, no shared prefix (distinct block hashes per request)."""
    blocks = -(-prompt_tokens // 512)
    return [Request(f"r{i}", i * GAP_S, prompt_tokens, tuple(range(i * 1000, i * 1000 + blocks)),
                    max_output_tokens=output_tokens) for i in range(n)]
